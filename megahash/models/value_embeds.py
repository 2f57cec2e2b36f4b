"""Value embeddings (issue 44, docs/compact_models.md#levers): modded-nanogpt's extra token tables whose rows are
added to the attention's values ([Jordan24b] train_gpt.py: ``GPT.value_embeds``, three ``nn.Embedding`` tables
feeding layers 0, 1, 2 and again the last three, "012 ... 012", and ``CausalSelfAttention.lambdas``).

``model.value_embeds`` = N > 0: N tables E_k [V, G d_h] (V the padded vocabulary, G the value heads of the
layers: key/value groups, or every head for MHE), table k feeding layer k and layer L-N+k (the first and last N
layers share, U-Net style). In such a layer i, after the kind's projection and before RoPE, the cache and the core,

    v <- v + lambda_i E_k[token]        (per token, reshaped to the G value heads)

with lambda_i one learnable gain per layer (0.5 at init, modded-nanogpt's ``lambdas[1]``; the values themselves
are not rescaled here). One module (torch only: the Hugging Face export copies it verbatim) that both models
hand their layers through the forward's ``MixState.value_embeds``; the softmax kinds that claim it
(``AttentionCaps.value_embeds``) call :meth:`ValueEmbeds.add` on their values. Under tensor parallelism the tables
and gains are whole on every rank (each rank adds its value heads' columns; gradients summed over TP).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megahash.errors import ConfigError

GAIN_INIT = 0.5  # modded-nanogpt's lambdas[1]


def layer_slots(num_tables: int, num_layers: int) -> list:
    """Per layer: (table, gain) indices of the layers that get a value embedding, None for the others: layer
    k < N takes table k and gain k, layer L-N+k table k and gain N+k."""
    slots: list = [None] * num_layers
    for k in range(num_tables):
        slots[k] = (k, k)
        slots[num_layers - num_tables + k] = (k, num_tables + k)
    return slots


class ValueEmbeds(nn.Module):
    """``tables`` (N ``nn.Embedding`` [V, G d_h]: embedding tables, so AdamW at ``train.embed_lr`` like the
    model's own) and ``gains`` [2N] (1-D: AdamW without weight decay)."""

    def __init__(
        self, num_tables: int, num_layers: int, vocab_size: int, heads: int, head_dim: int, std: float, dtype=None
    ):
        super().__init__()
        self.heads, self.head_dim, self.slots = heads, head_dim, layer_slots(num_tables, num_layers)
        with torch.random.fork_rng(devices=[]):  # the model's other weights are those of the model without it
            self.tables = nn.ModuleList(
                [nn.Embedding(vocab_size, heads * head_dim, dtype=dtype) for _ in range(num_tables)]
            )
            for t in self.tables:
                nn.init.normal_(t.weight, 0.0, std)
        self.gains = nn.Parameter(torch.full((2 * num_tables,), GAIN_INIT, dtype=dtype))

    def add(self, v: torch.Tensor, layer: int, tokens: torch.Tensor, tp_rank: int = 0) -> torch.Tensor:
        """v [s, b, c, d_h] the values of layer ``layer`` (0-based) for ``tokens`` [b, s]: all G value heads
        (c = G) or this TP rank's block of them (c = G / TP) -> v + lambda_i E_k[tokens] (unchanged in a layer
        without a table)."""
        slot = self.slots[layer]
        if slot is None:
            return v
        table, gain = slot
        ve = F.embedding(tokens.t(), self.tables[table].weight)  # [s, b, G d_h]
        ve = ve.view(*ve.shape[:2], self.heads, self.head_dim)
        c = v.shape[2]
        if c != self.heads:  # this rank's value heads
            ve = ve[:, :, tp_rank * c : (tp_rank + 1) * c]
        return v + self.gains[gain].to(v.dtype) * ve.to(v.dtype)


def build(num_tables: int, attentions: list, vocab_size: int, std: float, dtype=None):
    """The model's :class:`ValueEmbeds` (``model.value_embeds`` = ``num_tables``), or None when 0. ``attentions``:
    each layer's attention module, whose ``value_heads`` (G) and ``d_h`` size the tables; the layers that get a
    table must agree on them (a ConfigError, a ValueError, otherwise)."""
    if not num_tables:
        return None
    L = len(attentions)
    shapes = {
        (getattr(a, "value_heads", None), getattr(a, "d_h", None))
        for a, slot in zip(attentions, layer_slots(num_tables, L))
        if slot is not None
    }
    if len(shapes) != 1 or None in next(iter(shapes)):
        raise ConfigError(  # bad user input: one line, exit 2 (a ValueError traceback on every rank before)
            f"model.value_embeds={num_tables}: the layers it feeds need one value width (value heads x head dim), "
            f"got {sorted(shapes, key=str)}"
        )
    heads, head_dim = next(iter(shapes))
    return ValueEmbeds(num_tables, L, vocab_size, heads, head_dim, std, dtype)
