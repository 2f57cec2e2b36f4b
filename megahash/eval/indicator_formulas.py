"""The attention pattern indicators of [Xue25] sec. 4.4.4, exactly as defined there, of the attention matrix
A_j in R^{L x L} of each head j (sums over all entries a of the matrix):

- Entropy (H): H = - sum_{a in A} a log a (0 log 0 = 0). High: uniform, mean-pooling-like mixing.
- Concentration (Conc): Conc = ||A||_F = sqrt(sum_{a in A} a^2). High: focus on few tokens.
- Head diversity (HeadDiv, per layer): HeadDiv = 2 / (L (1 + L)) sum std({A_1, ..., A_{n_h}}): the
  position-wise standard deviation across the layer's heads (population std, ddof 0), summed over
  the L(L+1)/2 causal positions (j <= i) and divided by their number; for bidirectional encoders
  over all L^2 positions.
- Attention sink (Sink): Sink = sum A_{:,1} / L: the mean attention of all queries to the first token.
- Local focus (LocFoc_N): LocFoc_N = sum_i A_{i, i-N} / (L - N): the mean attention at relative
  distance N (the N-th sub-diagonal), N in {0, 1, 2, 3}.
"""

from __future__ import annotations

import torch

INDICATORS = ["entropy", "conc", "sink", "locfoc_0", "locfoc_1", "locfoc_2", "locfoc_3"]
LABELS = {
    "entropy": "H",
    "conc": "Conc",
    "head_div": "HeadDiv",
    "sink": "Sink",
    "locfoc_0": "LocFoc0",
    "locfoc_1": "LocFoc1",
    "locfoc_2": "LocFoc2",
    "locfoc_3": "LocFoc3",
}


def _as3d(A) -> torch.Tensor:
    A = torch.as_tensor(A, dtype=torch.float64)
    return A.unsqueeze(0) if A.dim() == 2 else A


def entropy(A) -> torch.Tensor:
    """H = - sum_{a in A} a log a per head; A [L, L] or [heads, L, L] -> [] or [heads]."""
    A3 = _as3d(A)
    h = -(torch.where(A3 > 0, A3 * torch.log(A3.clamp_min(1e-300)), torch.zeros_like(A3))).sum((-1, -2))
    return h[0] if torch.as_tensor(A).dim() == 2 else h


def concentration(A) -> torch.Tensor:
    """Conc = ||A||_F = sqrt(sum a^2) per head."""
    A3 = _as3d(A)
    c = A3.square().sum((-1, -2)).sqrt()
    return c[0] if torch.as_tensor(A).dim() == 2 else c


def sink(A) -> torch.Tensor:
    """Sink = sum A_{:,1} / L: mean attention paid to the first token."""
    A3 = _as3d(A)
    s = A3[..., :, 0].sum(-1) / A3.shape[-2]
    return s[0] if torch.as_tensor(A).dim() == 2 else s


def local_focus(A, n: int) -> torch.Tensor:
    """LocFoc_N = sum_i A_{i, i-N} / (L - N): mean attention at relative distance N."""
    A3 = _as3d(A)
    L = A3.shape[-1]
    if n >= L:
        out = torch.zeros(A3.shape[0], dtype=torch.float64)
    else:
        out = torch.diagonal(A3, offset=-n, dim1=-2, dim2=-1).sum(-1) / (L - n)
    return out[0] if torch.as_tensor(A).dim() == 2 else out


def head_diversity(A, causal: bool = True) -> float:
    """HeadDiv = 2 / (L (1 + L)) sum_{j <= i} std_heads(A[:, i, j]) (population std); for
    bidirectional maps the mean over all L^2 positions."""
    A3 = _as3d(A)
    L = A3.shape[-1]
    std = A3.std(dim=0, unbiased=False)
    if causal:
        return float(torch.tril(std).sum() * 2.0 / (L * (1 + L)))
    return float(std.mean())


def head_indicators(A) -> dict[str, list[float]]:
    """All per-head indicators of one layer's maps [heads, L, L]."""
    A3 = _as3d(A)
    out = {"entropy": entropy(A3), "conc": concentration(A3), "sink": sink(A3)}
    for n in range(4):
        out[f"locfoc_{n}"] = local_focus(A3, n)
    return {k: [float(x) for x in v] for k, v in out.items()}
