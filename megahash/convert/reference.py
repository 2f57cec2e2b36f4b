"""The plain-torch reference of an in-memory TP=1 megahash model: the Hugging Face export's model
(:mod:`megahash.models.hf_model` built from the kinds' plain-torch forms), without the
folder. The parity tests use it as the TP=1 reference of every kind (tests/models/test_attention.py,
tests/convert/test_remote_code.py)."""

from __future__ import annotations

from megahash.convert.export import hf_config_dict, megahash_state, to_hf_names
from megahash.convert.remote_code import check_references


def reference_model(cfg, model, vocab_size: int | None = None):
    """The plain-torch reference of an in-memory TP=1 MegahashLM: the transformers classes of
    :mod:`megahash.models.hf_model` built from the kinds' references, with the model's weights
    copied through the export's name map (the HF model of an export, without the folder); same
    dtype, training mode like ``model``."""
    from megahash.errors import CheckpointError
    from megahash.models import hf_model
    from megahash.models.arch import arch_of
    from megahash.models.hf_config import MegahashConfig

    check_references(cfg, model)
    config = MegahashConfig(**hf_config_dict(cfg, model, int(vocab_size or model.vocab_size), 0))
    cls = getattr(hf_model, arch_of(cfg.model.arch).hf_class)
    param = next(model.parameters())
    ref = cls(config).to(param.dtype)
    names = reference_names(model, ref)
    missing, unexpected = ref.load_state_dict(
        {names.get(k, k): v for k, v in megahash_state(model).items()}, strict=False
    )
    if missing or unexpected:
        raise CheckpointError(f"reference and model disagree: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return ref.train(model.training)


def reference_names(model, ref) -> dict:
    """{library name: reference name} of every tensor of ``model``: the export's name map
    (``export.to_hf_names``), plus the base model's prefix where transformers adds it on loading."""
    target = set(ref.state_dict())
    out = {}
    for k in megahash_state(model):
        name = next(iter(to_hf_names({k: None}, model.kind_input_attrs)))
        out[k] = (
            name
            if name in target or f"{ref.base_model_prefix}.{name}" not in target
            else f"{ref.base_model_prefix}.{name}"
        )
    return out
