"""Tensor groups of a model (issue 44 item 3): which part of the model each state-dict tensor belongs to,
so that an artifact (``export.artifact``, megahash/models/quantized.py) and QAT (megahash/training/qat.py)
can give each part its own bit width, as Parameter Golf's records do (int8 embeddings, int6/int4 blocks).

The group of a tensor is its module's slot in the model, never a kind's name: ``attention`` is everything
under a layer's ``self_attention`` submodule (whatever attention kind fills it), ``mlp`` everything under a
layer's ``mlp`` submodule (megatron-core's ``TransformerLayer`` slots), ``embedding`` the embedding module
(token tables, hash tables, their projections), its extras and the inputs the layer kinds add beside it,
``head`` the output layer and the objective's head (absent when tied to the embedding), and ``other``
whatever lies outside these (norms, gains, kind-specific parameters of the model itself).
"""

from __future__ import annotations

GROUPS = ("embedding", "attention", "mlp", "head", "other")


def owners(model) -> dict[str, str]:
    """{module prefix (``decoder.layers.0.mlp``): group} of the model's group-owning modules."""
    names = {id(m): n for n, m in model.named_modules()}
    out = {}

    def own(module, group):
        if module is not None and id(module) in names:
            out[names[id(module)]] = group

    for attr in ("embedding", "embedding_extras", *getattr(model, "kind_input_attrs", ())):
        own(getattr(model, attr, None), "embedding")
    for attr in ("output_layer", "head"):
        own(getattr(model, attr, None), "head")
    decoder = getattr(model, "decoder", None)
    for layer in getattr(decoder, "layers", ()):
        own(getattr(layer, "self_attention", None), "attention")
        own(getattr(layer, "mlp", None), "mlp")
    return out


def group_of(name: str, table: dict[str, str]) -> str:
    """The group of the state-dict key ``name``: its longest owning module prefix's (``other`` if none)."""
    parts = name.split(".")
    for n in range(len(parts) - 1, 0, -1):
        group = table.get(".".join(parts[:n]))
        if group is not None:
            return group
    return "other"


def tensor_groups(model) -> dict[str, str]:
    """{state-dict key: group} of every tensor of ``model``'s state dict."""
    table = owners(model)
    return {name: group_of(name, table) for name in model.state_dict()}
