"""Attention kinds. Each is one self-describing file: its class, written once (megahash.models.mixing: the
megatron-core layer and the plain-torch layer of the HF export are derived from it), and, in its
``register_attention`` line (megahash.models.registry), its cost formulas and capabilities (megahash.catalog).

Registered names (``model.schedule``):

- MHA family ([Xue25] ch. 3, Table 3.4): ``mha`` (model.num_query_groups gives GQA), ``gqa``,
  ``mqa``, ``sha``, ``skv``, ``el-att``, ``mhe-add``, ``mhe-mul``; ``swa`` (``mha`` over a sliding window);
  ``gated`` (an option of ``mha``/``gqa``/``mqa``/``swa``): a sigmoid output gate;
- deconstructed attention (ch. 4, sec. 4.3): ``mlp``, ``approx`` (Based's kernel), ``approx-thesis``
  (Appendix I, eq. 4.14-4.17), ``nonapprox``, ``rndembqk``,
  ``fixedseqqk``, ``staticembqk`` (parameter-matched to ``mha``);
- ``mha-megatron``: megatron-core's own SelfAttention (reference for tests; no decoding cache).

Shared plumbing: :mod:`.base` (the megatron-core parts and layer: TP/SP), :mod:`.sdpa` (megatron's softmax
core), :mod:`.document_mask` (packed documents and sliding windows), :mod:`.softmax_base`, :mod:`.linear_base`, :mod:`.separate_qkv` (the families' torch-only bases); the
fixed input of rndembqk/fixedseqqk lives in :mod:`.fixed_qk`. The generic cost
machinery (which asks each kind's own formulas): :mod:`megahash.models.costs`.
"""
