"""Chunked form of the Taylor kernel attention (training, prefill, and decoding with the carried
state; [Xue25] eq. 4.6).

The causal form is :func:`megahash.ops.linear.chunk.chunk_linear` with the Taylor kernel inside
chunks and the feature map phi (D = 1 + d + d(d+1)/2) between them; the features are recomputed in
backward (:class:`megahash.ops.linear.chunk.FeatureMatmul`), so a layer saves O(L (d + C)) and the
chunk states for backward, not the L x D features. Chunk size (0 = auto): 128 tokens for narrow
features (Based's d = 16: D = 153), 256 for the full head width (d = 64: D = 2,145, where the
feature state costs 2D d_v FLOPs per token and the chunk's map 2C(d + d_v); measured fastest on
CPU, benchmarks/results/2026-11-25_kinds_cpu_after2.md); a sequence no longer than the chunk is one
chunk (the parallel form). On CUDA with Based's 16 features and flash-linear-attention installed,
training and stateless prefill run fla's kernel (:mod:`megahash.ops.taylor.fla_based`)."""

from __future__ import annotations

from megahash.ops.linear.chunk import chunk_linear
from megahash.ops.taylor.feature_map import feature_dim, taylor_features, taylor_kernel
from megahash.ops.taylor.fla_based import fla_taylor
from megahash.ops.utils.documents import pair_mask
from megahash.ops.utils.fp32 import fp32_kernel

WIDE = 1024  # features per token above which the auto chunk is 256 tokens instead of 128


def taylor_chunk(length: int, d: int, chunk_size: int = 0) -> int:
    """The chunk size: ``chunk_size`` if > 0, else 128 (D <= 1024) or 256; at most ``length``."""
    c = chunk_size if chunk_size > 0 else (256 if feature_dim(d) > WIDE else 128)
    return max(1, min(c, length))


def _taylor(q, k, v, chunk, state, need_state, doc=None):
    num, den, state = chunk_linear(q, k, v, taylor_features, taylor_kernel, chunk, state, need_state, doc)
    return num / den.unsqueeze(-1), state


@fp32_kernel
def taylor_causal(q, k, v, chunk: int = 0, state=None, need_state: bool = False, doc=None):
    """Causal Taylor attention: q [..., L, d], k [..., L, d], v [..., L, dv] (leading dims broadcast,
    e.g. q [b, g, rep, L, d] with k, v [b, g, 1, L, .]); ``state`` = (S [..., D, dv], z [..., D])
    of the keys before this call; ``doc`` [..., L] document ids: the sums restart at each document
    start (:mod:`megahash.ops.utils.documents`; fla's Based kernel has no ``cu_seqlens``, so packed
    rows run the chunked form on every device). Returns (out [..., L, dv] in q's dtype, accumulated in fp32 under
    autocast (:func:`megahash.ops.utils.fp32.fp32_kernel`), state or None)."""
    chunk = taylor_chunk(q.shape[-2], q.shape[-1], chunk)
    if state is None and not need_state and doc is None:
        out = fla_taylor(q, k, v) if q.dim() == 5 else None
        if out is not None:
            return out, None
    return _taylor(q, k, v, chunk, state, need_state, doc)


@fp32_kernel
def taylor_bidirectional(q, k, v, key_mask=None, doc=None):
    """Encoders: sums over every (non-padded) key, from the kernel matrix when T <= 2D, else from
    the features (sum_j phi(k_j) v_j^T once); ``doc`` [..., L]: the keys of the query's document
    only, from the kernel matrix masked block-diagonally (:func:`megahash.ops.utils.documents.pair_mask`)."""
    d, T = q.shape[-1], k.shape[-2]
    if doc is not None:
        a = taylor_kernel(q, k) * pair_mask(doc, key_mask).to(q.dtype)
        return (a @ v) / a.sum(-1, keepdim=True)
    if T <= 2 * feature_dim(d):
        a = taylor_kernel(q, k)
        if key_mask is not None:
            a = a * key_mask.unsqueeze(-2).to(a.dtype)
        return (a @ v) / a.sum(-1, keepdim=True)
    fk = taylor_features(k)
    if key_mask is not None:
        fk = fk * key_mask.unsqueeze(-1).to(fk.dtype)
    fq = taylor_features(q)
    return (fq @ (fk.transpose(-1, -2) @ v)) / (fq @ fk.sum(-2).unsqueeze(-1))
