"""Packed documents for the linear and recurrent kinds (issue 34 item 1): with
``ForwardState.document_ids`` (the document-boundary contract, docs/attention.md "Packed documents")
the state restarts at each document start, in the chunked and the recurrent forms.

The independent facts: a packed row = each of its documents run alone (outputs and input gradients),
the chunked form = the token-by-token recurrence zeroing its state at each document start (written
from the recurrent equations), and the number of ATen calls does not depend on the number of
documents per row (no loop over documents). Modules are built as tests/models/test_attention.py builds them;
RoPE is left out here (positions restart with ``data.reset_position_ids``, the model's plumbing)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from test_attention import build_attention, make_cfg

from megahash.accelerator import policy
from megahash.models.forward_state import ForwardState
from megahash.training.op_count import CountOps

pytestmark = [pytest.mark.usefixtures("dist"), pytest.mark.numerics]

LENGTHS = (11, 6, 9)  # one document longer than the chunk (4), none a multiple of it
CHUNK = 4
# kind -> the options its packed-row test runs with (approx-thesis's literal first-order denominator has no
# sign and is ill-conditioned (docs/attention.md "Numerics"): it runs in fp64, the positive one in fp32/bf16)
KINDS = {
    "approx": (f"model.attention.options.chunk_size={CHUNK}",),
    "approx-thesis": (f"model.attention.options.chunk_size={CHUNK}", "model.attention.options.denominator=positive"),
    "nonapprox": (),
}


def document_ids(lengths, b=1):
    """[b, s] ids of consecutive documents (Megatron's semantics: nondecreasing from 0)."""
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(b, -1).clone()


@pytest.fixture
def small_scan_chunk(monkeypatch):
    """nonapprox's scan chunk (64) down to 5 tokens, so a document spans several chunks."""
    from megahash.ops.cumsoftmax import chunk

    monkeypatch.setattr(chunk, "CHUNK", 5)


def _module(kind, dtype, *extra):
    return build_attention(make_cfg(kind, *KINDS[kind], *extra, hidden=32, heads=4)).to(dtype)


def _run(m, x, doc):
    return m.mix(x, None, None, ForwardState(document_ids=doc))


def _packed_and_alone(m, x, lengths):
    """(packed out, alone out, packed input grad, alone input grad) for x [s, 1, d_m]."""
    xp = x.detach().clone().requires_grad_(True)
    packed = _run(m, xp, document_ids(lengths))
    packed.square().sum().backward()
    xa = x.detach().clone().requires_grad_(True)
    starts = torch.tensor((0,) + lengths).cumsum(0).tolist()
    alone = torch.cat([_run(m, xa[a : a + n], None) for a, n in zip(starts, lengths)], 0)
    alone.square().sum().backward()
    return packed, alone, xp.grad, xa.grad


@pytest.mark.parametrize(
    "kind,dtype",
    [(k, t) for k in KINDS for t in (torch.float32, torch.bfloat16)] + [("approx-thesis-literal", torch.float64)],
    ids=lambda p: str(p).replace("torch.", ""),
)
def test_packed_row_equals_each_document_alone(kind, dtype, small_scan_chunk):
    extra = ()
    if kind == "approx-thesis-literal":
        kind, extra = "approx-thesis", ("model.attention.options.denominator=literal",)
    m = _module(kind, dtype, *extra)
    x = torch.randn(sum(LENGTHS), 1, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    packed, alone, gp, ga = _packed_and_alone(m, x, LENGTHS)
    # fp32: 1e-5 (the contract); fp64: 1e-10; bf16: the projections' GEMMs round differently for a row of
    # another length: two bf16 epsilons relative to the scale (megahash.accelerator.policy.compute_tolerance)
    tol = {torch.float32: 1e-5, torch.float64: 1e-10}.get(dtype) or policy.compute_tolerance("bf16")
    for a, b in ((packed, alone), (gp, ga)):
        scale = 1.0 if dtype != torch.bfloat16 else float(b.float().abs().max())
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * scale)


def test_packed_rows_are_not_the_unmasked_run():
    """Sanity: without the ids the later documents see the earlier ones (the test above is not vacuous)."""
    m = _module("approx", torch.float32)
    x = torch.randn(sum(LENGTHS), 1, 32)
    with torch.no_grad():
        diff = (_run(m, x, document_ids(LENGTHS)) - _run(m, x, None))[LENGTHS[0] :].abs().max()
    assert diff > 1e-3


def _oracles():
    from megahash.ops.cumsoftmax.chunk import cumsoftmax_causal
    from megahash.ops.cumsoftmax.recurrent import cumsoftmax_recurrent
    from megahash.ops.orders.chunk import orders_causal
    from megahash.ops.orders.recurrent import orders_recurrent
    from megahash.ops.taylor.chunk import taylor_causal
    from megahash.ops.taylor.recurrent import taylor_recurrent

    return {
        "taylor": (
            lambda q, k, v, st, doc: taylor_causal(q, k, v, CHUNK, st, True, doc=doc),
            lambda q, k, v, st, doc: taylor_recurrent(q, k, v, st, doc=doc),
        ),
        "orders": (
            lambda q, k, v, st, doc: orders_causal(q, k, v, CHUNK, st, 0, True, doc=doc),
            lambda q, k, v, st, doc: orders_recurrent(q, k, v, st, doc=doc),
        ),
        "orders-positive": (
            lambda q, k, v, st, doc: orders_causal(q, k, v, CHUNK, st, 0, True, True, doc=doc),
            lambda q, k, v, st, doc: orders_recurrent(q, k, v, st, positive=True, doc=doc),
        ),
        "cumsoftmax": (
            lambda q, k, v, st, doc: cumsoftmax_causal((q * k).sum(-1), v, st, True, doc=doc),
            lambda q, k, v, st, doc: cumsoftmax_recurrent((q * k).sum(-1), v, st, doc=doc),
        ),
    }


@pytest.mark.parametrize("form", ["taylor", "orders", "orders-positive", "cumsoftmax"])
def test_chunked_equals_recurrent_with_resets(form, small_scan_chunk):
    """fp64, two rows (3 documents; 1 document), q [b, g, rep, L, d] with grouped k, v: outputs and the
    returned state (the last token's document's) equal the token-by-token recurrence that zeroes its state
    at each document start; the same with no ids, and with a carried state (it joins document 0)."""
    chunked, recurrent = _oracles()[form]
    g = torch.Generator().manual_seed(1)
    L = sum(LENGTHS)
    q = torch.randn(2, 2, 2, L, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 1, L, 4, generator=g, dtype=torch.float64) for _ in range(2))
    doc = torch.stack([document_ids(LENGTHS)[0], torch.zeros(L, dtype=torch.long)])[:, None, None, :]
    for state in (None, recurrent(q[..., :3, :], k[..., :3, :], v[..., :3, :], None, None)[1]):
        out_c, st_c = chunked(q, k, v, state, doc)
        out_r, st_r = recurrent(q, k, v, state, doc)
        tol = 1e-9  # fp64; the literal first-order denominator amplifies round-off (no sign)
        torch.testing.assert_close(out_c, out_r, rtol=tol, atol=tol)
        for a, b in zip(st_c, st_r):
            torch.testing.assert_close(a.expand_as(b), b, rtol=tol, atol=tol)


def _count(m, x, doc):
    with torch.no_grad(), CountOps() as c:
        _run(m, x, doc)
    return c.total()


@pytest.mark.parametrize("kind", list(KINDS))
def test_aten_calls_do_not_depend_on_documents_per_row(kind, small_scan_chunk):
    """A forward of 2 rows x 48 tokens: 1 document per row and 8 documents per row, the same ATen calls."""
    m = _module(kind, torch.float32)
    x = torch.randn(48, 2, 32)
    one = _count(m, x, document_ids((48,), 2))
    eight = _count(m, x, document_ids((3, 9, 5, 7, 4, 8, 6, 6), 2))
    assert one == eight


# ------------------------------------------------------------------ the deconstructed kinds (docs/attention.md)


def _fixed_module(kind, dtype=torch.float32, L=None):
    """A fixed-Q/K module and random frozen maps (Q, K of the fixed pass at positions 0..L-1) as the fixed
    input hands them to it (``ForwardState.inputs``)."""
    L = sum(LENGTHS) if L is None else L
    from megahash.models.attention.fixed_qk import FixedInput

    m = build_attention(make_cfg(kind, hidden=32, heads=4, layers=1)).to(dtype)
    g = torch.Generator().manual_seed(3)
    qk = (torch.randn(L, 1, 4, 8, generator=g).to(dtype), torch.randn(L, 1, 4, 8, generator=g).to(dtype))
    return m, {FixedInput.attr: {m.layer_number: qk}}


def _run_ctx(m, x, doc, inputs=None):
    return m.mix(x, None, None, ForwardState(offset=0, document_ids=doc, inputs=inputs or {}))


@pytest.mark.parametrize(
    "kind,dtype",
    [("mlp", torch.float32), ("rndembqk", torch.float32), ("fixedseqqk", torch.float32), ("rndembqk", torch.bfloat16)],
    ids=lambda p: str(p).replace("torch.", ""),
)
def test_deconstructed_packed_row_equals_each_document_alone(kind, dtype):
    """mlp: no token mixing (nothing to reset); rndembqk/fixedseqqk (frozen maps): a document's tokens read the
    fixed Q, K at their positions within the document and attend inside it."""
    m, inputs = (
        _fixed_module(kind, dtype)
        if kind != "mlp"
        else (build_attention(make_cfg(kind, hidden=32, heads=4)).to(dtype), None)
    )
    x = torch.randn(sum(LENGTHS), 1, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    xp = x.clone().requires_grad_(True)
    packed = _run_ctx(m, xp, document_ids(LENGTHS), inputs)
    packed.square().sum().backward()
    xa = x.clone().requires_grad_(True)
    starts = torch.tensor((0,) + LENGTHS).cumsum(0).tolist()
    alone = torch.cat([_run_ctx(m, xa[a : a + n], None, inputs) for a, n in zip(starts, LENGTHS)], 0)
    alone.square().sum().backward()
    tol = 1e-5 if dtype == torch.float32 else policy.compute_tolerance("bf16")  # see the linear kinds' test
    for a, b in ((packed, alone), (xp.grad, xa.grad)):
        scale = 1.0 if dtype == torch.float32 else float(b.float().abs().max())
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * scale)


def test_fixed_sequence_riding_along_keeps_its_own_map():
    """Training without a separate fixed pass: the fixed sequence is the batch's last row (no document ids of
    its own: one document); each packed document of row 0 = that document alone beside the fixed row's prefix
    (the fixed pass is causal: its first n positions do not depend on the later ones)."""
    m = build_attention(make_cfg("rndembqk", hidden=32, heads=4, layers=1))
    g = torch.Generator().manual_seed(0)
    L = sum(LENGTHS)
    x, fixed = torch.randn(L, 1, 32, generator=g), torch.randn(L, 1, 32, generator=g)
    with torch.no_grad():
        out = _run_ctx(m, torch.cat([x, fixed], 1), document_ids(LENGTHS))
        starts = torch.tensor((0,) + LENGTHS).cumsum(0).tolist()
        alone = [_run_ctx(m, torch.cat([x[a : a + n], fixed[:n]], 1), None) for a, n in zip(starts, LENGTHS)]
        fixed_alone = _run_ctx(m, torch.cat([x, fixed], 1), None)[:, 1]
    torch.testing.assert_close(out[:, 0], torch.cat([a[:, 0] for a in alone]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 1], fixed_alone, rtol=1e-5, atol=1e-5)  # the fixed row: its own pass


def test_staticembqk_packed_row_equals_each_document_alone():
    """Q, K from the layer-0 embeddings (positions within the document: RoPE left out here), block-diagonal
    causal softmax from the SDPA core's document mask (helper docmask's plumbing)."""
    pytest.importorskip("megahash.models.attention.document_mask", reason="the SDPA core's document mask (docmask)")
    m = build_attention(make_cfg("staticembqk", hidden=32, heads=4))
    g = torch.Generator().manual_seed(0)
    L = sum(LENGTHS)
    x, e = torch.randn(L, 1, 32, generator=g), torch.randn(L, 1, 32, generator=g)
    starts = torch.tensor((0,) + LENGTHS).cumsum(0).tolist()

    def run(xx, ee, doc):
        return m.mix(xx, None, None, ForwardState(embeddings=ee, document_ids=doc))

    with torch.no_grad():
        packed = run(x, e, document_ids(LENGTHS))
        alone = torch.cat([run(x[a : a + n], e[a : a + n], None) for a, n in zip(starts, LENGTHS)])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_fixed_qk_aten_calls_do_not_depend_on_documents_per_row():
    m, inputs = _fixed_module("rndembqk", L=48)
    x = torch.randn(48, 2, 32)
    counts = []
    for lengths in ((48,), (3, 9, 5, 7, 4, 8, 6, 6)):
        doc = document_ids(lengths, 2)
        with torch.no_grad(), CountOps() as c:
            _run_ctx(m, x, doc, inputs)
        counts.append(c.total())
    assert counts[0] == counts[1]


@pytest.mark.parametrize("kind", list(KINDS))
def test_encoder_packed_row_with_padding_equals_each_document_alone(kind):
    """Encoders: the bidirectional sums over the keys of the query's document (block-diagonal), with padding
    at the row's end (its own document: its queries see themselves and stay finite); fp32, 1e-5."""
    m = build_attention(make_cfg(kind, *KINDS[kind], "model.arch=encoder", hidden=32, heads=4))
    lengths = (7, 5)
    x = torch.randn(sum(lengths) + 3, 1, 32, generator=torch.Generator().manual_seed(0))
    doc = document_ids(lengths + (3,))
    pad = torch.zeros(1, 1, 1, x.shape[0], dtype=torch.bool)
    pad[..., -3:] = True  # True = masked (megatron's padding mask)
    with torch.no_grad():
        packed = m.mix(x, pad, None, ForwardState(document_ids=doc))
        alone = torch.cat([m.mix(x[a : a + n], None, None, ForwardState()) for a, n in ((0, 7), (7, 5))])
    assert torch.isfinite(packed).all()
    torch.testing.assert_close(packed[:12], alone, rtol=1e-5, atol=1e-5)
