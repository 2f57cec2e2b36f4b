"""House rule for numerical tests (issue 36): a bit-exact comparison (``torch.equal``,
``np.array_equal``, ``np.testing.assert_array_equal``/``assert_equal``, ``Tensor.equal``) in tests/
carries a ``# bit-exact: <reason>`` comment on its statement or in the comments just above it.
Floating-point results of different kernels, layouts, thread counts, CPU capabilities or dtypes are
compared with tolerances from the dtype (tests/numerics.py); bit-equality is asserted only where it
is the promise (integer data, copied values, resume, one deterministic path). The checker is also
run on planted violations, so it cannot pass vacuously.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
BIT_EXACT = {"equal", "array_equal", "array_equiv", "assert_array_equal", "assert_equal"}
REASON = re.compile(r"#\s*bit-exact:\s*\S")


def _called(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _span(stmt: ast.stmt) -> tuple[int, int]:
    """Lines of a simple statement, or of a compound statement's header (not its body)."""
    body = getattr(stmt, "body", None)
    if isinstance(body, list) and body and not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return stmt.lineno, max(stmt.lineno, body[0].lineno - 1)
    return stmt.lineno, stmt.end_lineno


def unjustified(source: str) -> list[int]:
    """Line numbers of bit-exact comparisons without a ``# bit-exact: <reason>`` comment on their
    statement's lines or in the comment lines directly above the statement."""
    lines = source.splitlines()
    tree = ast.parse(source)
    stmts = [s for s in ast.walk(tree) if isinstance(s, ast.stmt)]
    bad = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and _called(n.func) in BIT_EXACT):
        spans = [_span(s) for s in stmts if s.lineno <= call.lineno and s.end_lineno >= call.end_lineno]
        first, last = max(spans)  # the innermost statement
        above = first - 1
        while above >= 1 and lines[above - 1].strip().startswith("#"):
            above -= 1
        if not any(REASON.search(line) for line in lines[above:last]):
            bad.append(call.lineno)
    return sorted(set(bad))


def test_every_bit_exact_comparison_in_tests_says_why():
    found = {
        f"{p.name}:{n}": p.read_text().splitlines()[n - 1].strip()
        for p in sorted(TESTS.rglob("*.py"))
        for n in unjustified(p.read_text())
    }
    assert not found, (
        "bit-exact comparisons without a '# bit-exact: <reason>' comment (compare floating-point "
        f"results of different kernels/layouts/dtypes with tests/numerics.ulp_tol): {found}"
    )


def test_the_checker_flags_a_planted_violation():
    planted = """
import numpy as np
import torch

def test_x(pa, rx, a, b):
    assert torch.equal(pa, rx[..., :16]) and torch.equal(a, b)
    np.testing.assert_array_equal(a, b)
    assert np.array_equal(a, b)  # a comment, but no reason
    # bit-exact: token ids
    x = 1
    assert a.equal(b)
    if torch.equal(a, b):
        pass
    assert torch.equal(a, b)  # bit-exact: token ids (integers)
    # the codes are integers;
    # bit-exact: codes (integers)
    assert np.array_equal(a,
                          b)
    assert torch.equal(a, b)  # bit-exact:
    for k in a:  # bit-exact: copied, not computed
        assert torch.equal(a[k],
                           b[k])  # bit-exact: copied, not computed
"""
    assert unjustified(planted) == [6, 7, 8, 11, 12, 19]


@pytest.mark.numerics
def test_the_requested_cpu_capability_is_in_force():
    """Under tests/run_numerics_capabilities.sh (ATEN_CPU_CAPABILITY=default|avx2) ATen really runs
    those kernels, so the re-run is not vacuous."""
    import torch

    want = os.environ.get("ATEN_CPU_CAPABILITY")
    got = torch.backends.cpu.get_cpu_capability()
    assert want is None or got == want.upper(), (want, got)


@pytest.mark.numerics
def test_bf16_causal_attention_of_512_tokens_runs_under_the_capability():
    """torch's CPU flash attention packs bf16 operands when oneDNN says the CPU has AMX, with a packer compiled
    only into its AVX-512 kernels: on an AMX CPU under ATEN_CPU_CAPABILITY=default or avx2 alone every bf16 SDPA
    of 512 tokens raised (tests/run_numerics_capabilities.sh holds oneDNN to the same ISA, as such a CPU would).
    Here it runs and stays within bf16's error of the fp32 result."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 512, 32, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True).float()
    eps = torch.finfo(torch.bfloat16).eps
    assert torch.allclose(got, want, rtol=4 * eps, atol=4 * eps * want.abs().max().item())
