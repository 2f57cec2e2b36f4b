"""A checkpoint's model signature: what must match for its weights to be loaded into a model."""

from __future__ import annotations

from megahash.config import Config


def model_signature(cfg: Config) -> dict:
    """What must match for a checkpoint to be loaded into a model: the model tree and TP size."""
    return {"model": cfg.to_dict()["model"], "tensor_parallel": cfg.parallel.tensor}


def model_diffs(saved_model: dict, cfg: Config) -> list[str]:
    """Where a checkpoint's saved model tree differs from ``cfg``'s (``model.a.b: checkpoint X vs config Y``)."""
    return _diff(saved_model, model_signature(cfg)["model"], "model")


def _diff(a, b, path):
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{path}.{k}")
        return out
    return [] if a == b else [f"{path}: checkpoint {a!r} vs config {b!r}"]
