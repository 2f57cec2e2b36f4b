"""megahash.ops.gated_delta (issue 45 item 1): the chunked WY/UT form of the gated delta rule equals the
token-by-token recurrence written from the gated delta rule of [Yang25b] (fp64, several lengths and chunk sizes, a carried
state, packed documents, gradients too) and megatron-core's own plain-torch chunked form
(``megatron.core.ssm.gated_delta_net.torch_chunk_gated_delta_rule``, a second implementation, fp32); the
short convolution equals torch's ``conv1d`` (documents: each alone; decoding: the carried inputs); and the
bytes a layer saves for backward stay flat per token."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import torch.nn.functional as F

from megahash.ops.gated_delta.chunk import gated_delta_causal, l2norm
from megahash.ops.gated_delta.conv import causal_conv
from megahash.ops.gated_delta.recurrent import gated_delta_recurrent

pytestmark = pytest.mark.numerics  # compares floating-point results (see tests/numerics.py)

LENGTHS = (1, 5, 16, 33)
CHUNKS = (1, 3, 8, 64)
DOCS = torch.tensor([[0] * 5 + [1] * 13 + [2] * 15, [0] * 30 + [1] * 3])[:, None, :]  # [b, 1, L=33]


def inputs(L, dk=5, dv=4, seed=0, dtype=torch.float64):
    """q, k [2, 3, L, dk], v [2, 3, L, dv], log decays g in (-1.5, 0], beta in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, L, dk, dtype=dtype, generator=g)
    k = torch.randn(2, 3, L, dk, dtype=dtype, generator=g)
    v = torch.randn(2, 3, L, dv, dtype=dtype, generator=g)
    decay = -1.5 * torch.rand(2, 3, L, dtype=dtype, generator=g)
    beta = torch.rand(2, 3, L, dtype=dtype, generator=g)
    return q, k, v, decay, beta


def grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    w = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    w = w.to(out.device, out.dtype)  # the same weights on every device and dtype
    (out * w).sum().backward()
    return [x.grad for x in xs]


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_readout_scale_is_the_layers_score_scale():
    """``scale`` c replaces d_k^{-1/2} on q only: o_t = c S_t^T q_t is linear in c and the state does not depend
    on it (what lets gated-deltanet take muP's sqrt(d_0)/d_k, megahash.models.mixing.score_scale)."""
    x = inputs(16)
    ref, ref_state = gated_delta_recurrent(*x, qk_l2norm=True)  # d_k^{-1/2}, d_k = 5
    c = 0.37
    out, state = gated_delta_causal(*x, 8, need_state=True, qk_l2norm=True, scale=c)
    close(out, ref * (c * 5**0.5))
    close(state, ref_state)


@pytest.mark.parametrize("L", LENGTHS)
def test_chunked_equals_the_recurrence(L):
    """Outputs, the state after the call and the gradients of q, k, v, g, beta (L2-normalised q, k)."""
    x = inputs(L)
    want, want_state = gated_delta_recurrent(*x, qk_l2norm=True)
    want_grads = grads(lambda *t: gated_delta_recurrent(*t, qk_l2norm=True)[0], *x)
    for chunk in CHUNKS:
        out, state = gated_delta_causal(*x, chunk, need_state=True, qk_l2norm=True)
        close(out, want)
        close(state, want_state)
        close(gated_delta_causal(*x, chunk, qk_l2norm=True)[0], want)  # no state asked: the same outputs
        for a, b in zip(grads(lambda *t: gated_delta_causal(*t, chunk, qk_l2norm=True)[0], *x), want_grads):
            close(a, b, 1e-9)


def test_carried_state_and_packed_documents():
    """Prefill then continue with the carried state (decoding) = one call; packed documents (the state
    passed in belongs to document 0) = the recurrence restarting at each document start, values,
    state and gradients, for every chunk size (documents inside a chunk and across chunks)."""
    x = inputs(33, seed=1)
    state0 = torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want, want_state = gated_delta_recurrent(*x, state=state0, qk_l2norm=True)
    for cut in (1, 7, 32):
        first = [t[..., :cut, :] if t.dim() == 4 else t[..., :cut] for t in x]
        rest = [t[..., cut:, :] if t.dim() == 4 else t[..., cut:] for t in x]
        o1, s1 = gated_delta_causal(*first, 4, state=state0, need_state=True, qk_l2norm=True)
        o2, s2 = gated_delta_causal(*rest, 4, state=s1, need_state=True, qk_l2norm=True)
        close(torch.cat([o1, o2], dim=-2), want)
        close(s2, want_state)
    want, want_state = gated_delta_recurrent(*x, state=state0, doc=DOCS, qk_l2norm=True)
    want_grads = grads(lambda *t: gated_delta_recurrent(*t, state=state0, doc=DOCS, qk_l2norm=True)[0], *x)
    for chunk in CHUNKS:
        out, state = gated_delta_causal(*x, chunk, state=state0, need_state=True, doc=DOCS, qk_l2norm=True)
        close(out, want)
        close(state, want_state)
        got = grads(lambda *t: gated_delta_causal(*t, chunk, state=state0, doc=DOCS, qk_l2norm=True)[0], *x)
        for a, b in zip(got, want_grads):
            close(a, b, 1e-9)
    # each document alone (no state) = the packed row
    out, _ = gated_delta_causal(*x, 8, doc=DOCS, qk_l2norm=True)
    for row, bounds in ((0, (0, 5, 18, 33)), (1, (0, 30, 33))):
        for a, b in zip(bounds[:-1], bounds[1:]):
            part = [t[row : row + 1, ..., a:b, :] if t.dim() == 4 else t[row : row + 1, ..., a:b] for t in x]
            close(out[row : row + 1, ..., a:b, :], gated_delta_recurrent(*part, qk_l2norm=True)[0])


def test_equals_megatron_cores_plain_torch_form():
    """megatron-core 0.16's ``torch_chunk_gated_delta_rule`` (Qwen3-Next's reference loop, [B, T, H, d],
    fp32, chunk 64) on the same inputs: outputs and the final state from an initial state, fp32
    round-off of sums of a few hundred terms."""
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    q, k, v, g, beta = inputs(150, dk=16, dv=8, seed=3, dtype=torch.float32)
    q, k = l2norm(q), l2norm(k)
    h0 = torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(4))
    ours, state = gated_delta_causal(q, k, v, g, beta, 0, state=h0, need_state=True)
    theirs, their_state = torch_chunk_gated_delta_rule(
        *(t.transpose(1, 2) for t in (q, k, v, g, beta)), initial_state=h0, output_final_state=True
    )
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=0, atol=2e-5)
    torch.testing.assert_close(state, their_state, rtol=0, atol=2e-5)


def test_short_convolution_equals_conv1d():
    """The K-tap causal depthwise convolution = torch's conv1d over the left-padded sequence; with
    packed documents = each document convolved alone; split in two with the carried inputs = whole."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(20, 2, 6, dtype=torch.float64, generator=gen)  # [s, b, c]
    w = torch.randn(6, 4, dtype=torch.float64, generator=gen)

    def conv1d(x):
        return F.conv1d(F.pad(x.permute(1, 2, 0), (3, 0)), w.unsqueeze(1), groups=6).permute(2, 0, 1)

    y, state = causal_conv(x, w, need_state=True)
    close(y, conv1d(x))
    close(state, x[-3:].transpose(0, 1))
    y1, s1 = causal_conv(x[:2], w, need_state=True)  # shorter than the window: zeros before it
    y2, _ = causal_conv(x[2:], w, state=s1)
    close(torch.cat([y1, y2]), conv1d(x))
    doc = torch.tensor([[0] * 7 + [1] * 2 + [2] * 11, [0] * 20])
    y, _ = causal_conv(x, w, doc=doc)
    for row, bounds in ((0, (0, 7, 9, 20)), (1, (0, 20))):
        for a, b in zip(bounds[:-1], bounds[1:]):
            close(y[a:b, row : row + 1], conv1d(x[a:b, row : row + 1]))


def test_saved_bytes_flat_per_token():
    """Bytes autograd saves for backward (distinct storages) are affine in the length (chunk 64: per-token
    tensors, chunk maps and chunk states; nothing L x L), so flat per token: 256 -> 512 -> 1,024 tokens add
    exactly 1x, then 2x the same bytes."""

    def saved(L):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = [t.float().requires_grad_(True) for t in inputs(L, dk=16, dv=16, seed=6)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            gated_delta_causal(*x, 64, qk_l2norm=True)
        return sum(seen.values())

    sizes = [saved(L) for L in (256, 512, 1024)]
    assert 0 < sizes[1] - sizes[0] and sizes[2] - sizes[1] == 2 * (sizes[1] - sizes[0]), sizes


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["state", "documents"])
def test_fla_path_on_cuda_equals_the_recurrence(packed):
    """On CUDA with flash-linear-attention (``benchmarks/gpu_check.sh`` runs it), ``gated_delta_causal`` takes
    fla's ``chunk_gated_delta_rule`` (packed documents through ``cu_seqlens``): outputs, state and the gradients
    of q, k, v, g, beta (through fla's backward, or the chunked form where fla refuses it:
    ``fla_gated.backward_refusal``) within TF32 tolerance of the fp64 recurrence on the CPU (L = 200: several of fla's
    64-token chunks, the last partial; d_k = d_v = 64, fla's head sizes). TF32, not fp32: fla multiplies fp32
    inputs in TF32 on sm_80+ (its ``chunk_fwd.py`` gives the triangular solve ``input_precision='tf32'``, and
    Triton's ``tl.dot`` defaults to TF32 for fp32); on an H200 (2026-11-30) the output was 2.0e-3 of its largest
    value off, where the fp32 tolerance this test had allowed 1e-3."""
    from megahash.accelerator import policy
    from megahash.ops.gated_delta.fla_gated import gated_delta_kernel

    if not policy.has_gpu() or gated_delta_kernel() is None:
        pytest.skip("needs a GPU and flash-linear-attention")
    x = inputs(200, dk=64, dv=64, seed=3)
    doc = torch.tensor([[0] * 70 + [1] * 100 + [2] * 30, [0] * 150 + [1] * 50])[:, None, :] if packed else None
    state = not packed

    def run(dev, dtype):
        t = [a.to(dev, dtype) for a in x]
        d = None if doc is None else doc.to(dev)
        return gated_delta_causal(*t, 64, need_state=state, doc=d, qk_l2norm=True)

    (got, got_state), (want, want_state) = run(policy.device(), torch.float32), run("cpu", torch.float64)
    dev = policy.device()
    on_gpu = grads(lambda *t: gated_delta_causal(*t, 64, doc=None if doc is None else doc.to(dev), qk_l2norm=True)[0],
                   *[a.to(dev, torch.float32) for a in x])  # fmt: skip
    on_cpu = grads(lambda *t: gated_delta_causal(*t, 64, doc=doc, qk_l2norm=True)[0], *x)
    pairs = {"out": (got, want), **({"state": (got_state, want_state)} if state else {})}
    pairs.update({f"d{n}": ab for n, ab in zip(("q", "k", "v", "g", "beta"), zip(on_gpu, on_cpu))})
    # each error relative to the reference's largest value: TF32 keeps 10 mantissa bits (epsilon 2**-10), and the
    # chunked form chains a few products per chunk (the WY representation, the triangular solve, the state)
    rel = {n: ((a.double().cpu() - b).abs().max() / b.abs().max()).item() for n, (a, b) in pairs.items()}
    print("fla vs the fp64 recurrence, max error / max value:", {n: f"{r:.1e}" for n, r in rel.items()})
    assert max(rel.values()) <= 4 * 2.0**-10, {n: f"{r:.1e}" for n, r in rel.items()}
