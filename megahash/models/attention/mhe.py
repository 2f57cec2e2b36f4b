"""Multi-head embedding attention ``mhe-add`` / ``mhe-mul`` ([Xue25] ch. 3, sec. 3.3).

One shared ("seed") projection W^Q, W^K, W^V in R^{d_m x d_h} for all heads (eq. 3.4) and one
head embedding per head e_i^Q, e_i^K, e_i^V in R^{d_h}; head i attends with
Q~_i, K~_i, V~_i = psi(Q; K; V, e_i^{Q,K,V}) (eq. 3.5-3.6), where

- MHE-ADD: psi(A, b) = A + 1 b^T
- MHE-MUL: psi(A, b) = A (.) 1 (b + 1)^T   (the +1 keeps the heads near the seed at init)

Table 3.4 count 3 d^2 n + 3 d n (biases of the seed projection, if model.qkv_bias, add 3d).
TP: the seed projection ``linear_qkv`` (rows ``[q, k, v]``, d_h each) is replicated on every
rank (gradients summed over TP); the head embeddings ``emb_q/emb_k/emb_v`` ([n, d_h]) are split
by head, so each TP rank owns its heads. RoPE is applied to Q~_i, K~_i (after psi); the KV cache
holds the per-head K~ (rotated) and V~.
"""

from __future__ import annotations

from megahash.models.attention.maps import softmax_core_maps
from megahash.models.attention.softmax_base import SoftmaxAttention
from megahash.models.cost_formulas import AllHeadsRow
from megahash.models.registry import AttentionCaps, register_attention


class MultiHeadEmbedding(SoftmaxAttention):
    """MHE (eq. 3.5): one shared ``linear_qkv`` (rows ``[q, k, v]`` of d_h each, replicated over TP) and head
    embeddings ``emb_{q,k,v}`` [n, d_h] (split by head): ADD A + 1 e_i^T, MUL A * 1 (e_i + 1)^T."""

    def build(self, parts):
        self.mode = "add" if self.kind == "mhe-add" else "mul"
        self.linear_qkv = parts.replicated(self.d_m, 3 * self.d_h, self.qkv_bias)
        self.emb_q = parts.per_head(self.n, self.d_h)
        self.emb_k = parts.per_head(self.n, self.d_h)
        self.emb_v = parts.per_head(self.n, self.d_h)

    @property
    def value_heads(self) -> int:
        """Every head has its own values (``model.value_embeds`` sizes its tables by them)."""
        return self.n

    def psi(self, a, e):
        """a [s, b, d_h] seed projection, e [n_local, d_h] head embeddings -> [s, b, n_local, d_h]."""
        a = a.unsqueeze(2)
        return a + e if self.mode == "add" else a * (e + 1)

    def project(self, x):
        q, k, v = self.linear_qkv(x).chunk(3, dim=-1)
        return self.psi(q, self.emb_q.weight), self.psi(k, self.emb_k.weight), self.psi(v, self.emb_v.weight)


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class MHECosts(AllHeadsRow):
    """Table 3.4 MHE: 3d^2n + 3dn (shared projections + head embeddings; generalised Standard
    row); cache 2BLnd_h numbers (n heads of keys and values)."""

    @staticmethod
    def qkv_params(n, d, g):
        return 3 * d * d * n + 3 * d * n


register_attention(
    "mhe-add",
    MultiHeadEmbedding,
    costs=MHECosts,
    caps=AttentionCaps(thesis_name="MHE-ADD", chapters=(3,), value_embeds=True),
    maps=softmax_core_maps,
)
register_attention(
    "mhe-mul",
    MultiHeadEmbedding,
    costs=MHECosts,
    caps=AttentionCaps(thesis_name="MHE-MUL", chapters=(3,), value_embeds=True),
    maps=softmax_core_maps,
)
