"""Loading a checkpoint's model weights without running code from it.

The weights of every checkpoint are a megatron-core dist checkpoint (``step_N/model/``): tensors in
``*.distcp`` files read as raw bytes, ``common.pt`` read by ``torch.load`` (``weights_only=True``,
torch's default since 2.6; checked here), ``metadata.json``, and torch.distributed.checkpoint's
``.metadata``, which torch reads with plain ``pickle.load``. :func:`no_code_unpickling` replaces that
``pickle.load`` with an unpickler that builds only the plain data classes of
``torch.distributed.checkpoint`` (``Metadata``, ``TensorStorageMetadata``, ...), ``torch.Size``,
dtypes and layouts; any other global (``os.system``, ``builtins.eval``, ...) is refused with a
one-line CheckpointError. ``export-hf``, ``eval`` and ``indicators`` load weights only this way.

Resuming training additionally loads DeepSpeed's optimizer/engine state (``*_optim_states.pt``,
``mp_rank_*_model_states.pt``) with DeepSpeed's own ``torch.load(weights_only=False)``: resume only
from checkpoints of trusted origin (docs/launching.md).
"""

from __future__ import annotations

import contextlib
import pickle
import types

import torch

from megahash.errors import CheckpointError

_DATA_MODULES = ("torch.distributed.checkpoint.",)
_TORCH_NAMES = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
}


class RestrictedUnpickler(pickle.Unpickler):
    """Builds data only: classes of torch.distributed.checkpoint, torch.Size, dtypes, layouts."""

    def find_class(self, module, name):
        obj = None
        if module.startswith(_DATA_MODULES) or (module, name) in _TORCH_NAMES:
            obj = super().find_class(module, name)
            if module.startswith(_DATA_MODULES) and not isinstance(obj, type) and not _is_enum_member(obj):
                obj = None
        elif module == "torch":
            cand = getattr(torch, name, None)
            if isinstance(cand, (torch.dtype, torch.memory_format, torch.layout)):
                obj = cand
        if obj is None:
            raise CheckpointError(
                f"checkpoint metadata asks to run {module}.{name}: refused (weights are loaded "
                f"without running code); the checkpoint is damaged or not from megahash"
            )
        return obj


def _is_enum_member(obj) -> bool:
    import enum

    return isinstance(obj, (enum.Enum, dict))  # _MEM_FORMAT_ENCODING is an Enum; plain tables are data


def restricted_load(file, *args, **kwargs):
    return RestrictedUnpickler(file).load()


@contextlib.contextmanager
def no_code_unpickling():
    """While the block runs, torch.distributed.checkpoint reads ``.metadata`` with the restricted
    unpickler, and ``torch.load`` is called with ``weights_only=True``."""
    import os

    from torch.distributed.checkpoint import filesystem

    forced = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in ("0", "", "false")
    if forced or torch.serialization._default_to_weights_only(None) is not True:
        raise CheckpointError(
            "torch.load is configured to unpickle code (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD); unset it "
            "to load checkpoint weights"
        )
    real = filesystem.pickle
    proxy = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    proxy.load = restricted_load
    filesystem.pickle = proxy
    try:
        yield
    finally:
        filesystem.pickle = real
