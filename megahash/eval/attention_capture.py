"""The attention maps of every layer of one forward, each captured by its kind's own ``maps`` hook (the registry's
:class:`megahash.models.registry.KindSpec`; the families' hooks: :mod:`megahash.models.attention.maps`). The
capture is opt-in and observes only: the forward hooks it attaches are removed on leaving, the model computes
exactly what it computes without them."""

from __future__ import annotations

import functools


class AttentionCapture:
    """``with AttentionCapture(model, batch) as cap: model(tokens)`` -> ``cap.layers[i]`` = dict(kind, source,
    probs [b, heads, L, L] float64, logits (1-D tensor of the valid pre-softmax values) or None, causal) for
    every layer that ran (None: the layer did not run, e.g. dropped in ``skip`` mode); a kind that registers no
    ``maps`` hook is "unavailable". ``verify``: also ``check_err`` = max |A V - the layer's output| (tests)."""

    def __init__(self, model, batch: int | None = None, verify: bool = False):
        self.model = model
        self.batch = batch
        self.verify = verify
        self.kinds = list(getattr(model, "layer_kinds", []))
        self.layers: list[dict | None] = []
        self._handles = []

    def __enter__(self):
        from megahash.models import registry  # megatron-core: imported when a capture starts, not with the command

        modules = [layer.self_attention for layer in self.model.decoder.layers]
        self.layers = [None] * len(modules)
        known = registry.kinds("attention")
        for i, m in enumerate(modules):
            kind = self.kinds[i] if i < len(self.kinds) else getattr(m, "kind", type(m).__name__)
            capture = known[kind].maps if kind in known else None
            if capture is None:
                self.layers[i] = {"kind": kind, "source": "unavailable", "probs": None, "logits": None, "causal": True}
                continue
            self._handles += capture(m, functools.partial(self._store, i, kind))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return False

    def _store(self, i: int, kind: str, found: dict) -> None:
        """Keep what a layer's hook found (its keys: megahash.models.attention.maps) for the first ``batch`` rows."""
        probs = found["probs"]
        b = self.batch or probs.shape[0]
        probs = probs[:b] if probs.shape[0] > 1 else probs.expand(b, *probs.shape[1:])
        vals, logits, valid = None, found.get("logits"), found.get("valid")
        if logits is not None:
            lg = logits[:b] if logits.shape[0] > 1 else logits
            vals = lg[..., valid].reshape(-1).float() if valid is not None else lg.reshape(-1).float()
        elif found.get("logit_values") is not None:  # logits not of the map's shape (one per key)
            lv = found["logit_values"]
            vals = lv[: self.batch or lv.shape[0]].reshape(-1).float()
        self.layers[i] = {
            "kind": kind,
            "source": found["source"],
            "probs": probs.detach().cpu(),
            "logits": None if vals is None else vals.cpu(),
            "causal": found["causal"],
        }
        if self.verify and found.get("check") is not None:
            self.layers[i]["check_err"] = float(found["check"]())
