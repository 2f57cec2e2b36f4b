"""The linear layers' oneDNN GEMMs on CPU (megahash.models.cpu_linear) compute the same function as
``F.linear``: values and gradients against an fp64 reference (as close as torch's own BLAS path
is), strided inputs as megatron's [s, b, h] layout gives them, in-place use of the output, and a
whole model's loss and gradients equal to the model with the routing off."""

import os

import pytest
import torch
import torch.nn.functional as F
from numerics import ulp_tol

from megahash.accelerator import policy, rng
from megahash.models import cpu_linear

pytestmark = [
    pytest.mark.skipif(not policy.onednn_linear(), reason="torch without oneDNN, or a GPU host"),
    pytest.mark.numerics,
]


def _grads(fn, x, w, b, g):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    b = b.detach().requires_grad_() if b is not None else None
    out = fn(x, w, b)
    out.backward(g)
    return out.detach(), x.grad, w.grad, (b.grad if b is not None else None)


def _rel(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out_features", [224, 64])  # 64: in >= 2 out, the weight gradient through oneDNN too
def test_values_and_gradients_match_an_fp64_reference(bias, out_features):
    torch.manual_seed(0)
    x = torch.randn(4, 96, 160).transpose(0, 1)  # [s, b, in] from [b, s, in]: strided, as megatron's layout
    w = torch.randn(out_features, 160) / 12
    b = torch.randn(out_features) if bias else None
    g = torch.randn(96, 4, out_features)
    ref = _grads(F.linear, x.double(), w.double(), b.double() if bias else None, g.double())
    ours = _grads(cpu_linear.onednn_linear, x, w, b, g)
    blas = _grads(F.linear, x, w, b, g)
    assert ours[0].shape == (96, 4, out_features)
    for name, o, r, k in zip(("out", "dx", "dw", "db"), ours, ref, blas):
        if r is None:
            assert o is None
            continue
        # fp32 rounding only: within 1e-5 of fp64, and no further from it than 4x torch's own fp32 GEMM
        assert _rel(o, r) < 1e-5 and _rel(o, r) <= 4 * _rel(k, r) + 1e-7, name


def test_a_weight_slice_gets_its_gradient():
    """The SwiGLU gate/up halves are slices of megatron's fc1 weight (models/feedforward.py)."""
    torch.manual_seed(1)
    x = torch.randn(64, 48)
    w = torch.randn(80, 48, requires_grad=True)
    out = F.silu(cpu_linear.linear(x, w[:40])) * cpu_linear.linear(x, w[40:])
    out.sum().backward()
    w2 = w.detach().clone().requires_grad_()
    (F.silu(F.linear(x, w2[:40])) * F.linear(x, w2[40:])).sum().backward()
    # two GEMM kernels (oneDNN's, ATen's BLAS) each summing 64 rows: under oneDNN held to SSE4.1 they differ by
    # 3.8e-5 on gradients of up to 213 (the old fixed 1e-5 failed there)
    torch.testing.assert_close(w.grad, w2.grad, **ulp_tol(torch.float32, ops=64, scale=w2.grad.abs().max()))


def test_output_can_be_changed_in_place():
    """Callers add into the output (megatron's bias-dropout-add, the cross-entropy's shift); the
    oneDNN op returns a view for 3-D inputs, which autograd forbids in place."""
    x = torch.randn(8, 2, 16, requires_grad=True)
    w = torch.randn(24, 16, requires_grad=True)
    out = cpu_linear.onednn_linear(x, w)
    out.add_(1.0)
    out.sum().backward()
    assert torch.allclose(x.grad, w.sum(0).expand(8, 2, 16), atol=1e-5)


def test_other_dtypes_and_off_switch_keep_f_linear(monkeypatch):
    x, w = torch.randn(5, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    assert torch.equal(
        cpu_linear.linear(x, w), F.linear(x, w)
    )  # bit-exact: outside fp32 linear() is F.linear itself (one path); fp64 (TP parity tests): torch's BLAS
    monkeypatch.setenv("MEGAHASH_ONEDNN_LINEAR", "0")
    x, w = x.float(), w.float()
    assert not policy.onednn_linear() and torch.equal(
        cpu_linear.linear(x, w), F.linear(x, w)
    )  # bit-exact: switched off, linear() is F.linear itself


def test_model_routes_every_linear_and_keeps_loss_and_gradients(dist, monkeypatch):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megahash.config import load_config
    from megahash.models.megatron_model import build_model

    cfg = load_config(
        None,
        [
            "model.hidden_size=64",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.ffn_hidden_size=128",
            "data.seq_length=32",
            "model.max_position_embeddings=64",
        ],
    )
    rng.seed_all(3)
    model = build_model(cfg, 500)
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert len(linears) >= 2 * 4 + 1 and all(getattr(m._forward_impl, "megahash_onednn", False) for m in linears)
    tokens = torch.randint(0, 500, (3, 32))
    labels = torch.randint(0, 500, (3, 32))

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    on = loss_and_grads()
    monkeypatch.setenv("MEGAHASH_ONEDNN_LINEAR", "0")  # megatron's own linear function, torch's BLAS
    off = loss_and_grads()
    assert on[0] == pytest.approx(off[0], rel=1e-6)
    for a, b in zip(on[1], off[1]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6 * b.abs().max().item())
    assert os.environ["MEGAHASH_ONEDNN_LINEAR"] == "0"
