"""Token embedding kinds. Each returns [s, b, h] (scattered over TP ranks under sequence parallelism).

Registered names (``model.embedding``): ``vocab`` (baseline table), ``hash-emb`` (HashFormer-Emb,
eq. 2.12), ``pool`` (eq. 2.1), ``add`` (eq. 2.2), ``proj`` (eq. 2.3), ``bert-hash`` ([NeuML25]),
``rolling`` (EELBERT, [Cohn23]). See :mod:`megahash.models.embeddings.base` for the shared rules
(special-token table, TP/SP, the extra word row of Table 2.2).
"""

from __future__ import annotations


def _global_numel(p) -> int:
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    return p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)


def embedding_param_report(model) -> dict:
    """{"embedding": n, "special": n}: global parameter counts of a model's token embedding.

    ``embedding`` counts what [Xue25] sec. 2.8 counts: every parameter used to build the
    embedding of an ordinary token (tables, codebooks, projections, the shared word row of
    Pool/Add/Proj), summed over TP ranks, without TP padding rows and without position embeddings
    (megahash uses RoPE). ``special`` is the 5 x h table of ``<s> <pad> </s> <unk> <mask>`` (0 for
    ``vocab``, whose specials are ordinary rows of its table). Accepts a MegahashLM or an embedding
    module.
    """
    emb = getattr(model, "embedding", model)
    report = getattr(emb, "param_report", None)
    if callable(report):
        return dict(report())
    return {"embedding": sum(_global_numel(p) for p in emb.parameters()), "special": 0}
