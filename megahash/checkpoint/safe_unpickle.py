"""Loading a checkpoint's dist checkpoints (``model/``, ``ema/``, ``optimizer/``) without running code.

A megatron-core dist checkpoint is ``*.distcp`` files, megatron's ``common.pt`` and ``metadata.json``,
and torch.distributed.checkpoint's ``.metadata``. torch 2.13 has no weights-only path for the latter:
``FileSystemReader.read_metadata`` calls plain ``pickle.load``, and ``DefaultLoadPlanner.load_bytes``
reads the byte items of a ``.distcp`` (megatron's ShardedObjects, the layers' ``_extra_state``) with
``torch.load(weights_only=False)``. While :func:`no_code_unpickling` runs:

- ``.metadata`` is read (at most :data:`MAX_METADATA_BYTES`) by :class:`RestrictedUnpickler`, which
  answers exactly the (module, name) pairs of :data:`METADATA_GLOBALS`: the classes that real
  checkpoints' metadata references (recorded from checkpoints saved at TP 1 and 2, ZeRO 0-3, fp32
  and bf16, Muon, EMA, asynchronous saves; docs/security.md) and the dtypes a tensor may have. No
  dotted name, module, function or other attribute resolves: every other pair is refused with one
  line (CheckpointError) before anything is built. The one callable, torch's ``_get_layout``, is
  answered by :func:`_layout`, which returns a ``torch.layout`` by its name and nothing else; the two
  Enums answer with their member of a value (:func:`_members`);
- every ``torch.load`` is weights-only (torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, which overrides
  an explicit ``weights_only=False``): tensors, megatron's ``common.pt`` and the byte items.

DeepSpeed's own files (resume) are :mod:`megahash.checkpoint.deepspeed_files`'s.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import types

import torch

from megahash.errors import CheckpointError

MAX_METADATA_BYTES = 1 << 30  # a 1 GiB .metadata is ~5M chunks; real ones are KBs to MBs
_DCP = "torch.distributed.checkpoint"
# the dtypes a saved tensor may have (each ("torch", name) resolves to a torch.dtype: tests check it)
DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "complex64",
    "complex128",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "bool",
)
METADATA_GLOBALS = frozenset(
    {
        (f"{_DCP}.metadata", "Metadata"),
        (f"{_DCP}.metadata", "TensorStorageMetadata"),
        (f"{_DCP}.metadata", "BytesStorageMetadata"),
        (f"{_DCP}.metadata", "ChunkStorageMetadata"),
        (f"{_DCP}.metadata", "MetadataIndex"),
        (f"{_DCP}.metadata", "StorageMeta"),
        (f"{_DCP}.metadata", "TensorProperties"),
        (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),  # an Enum: its members are pickled as (class, (value,))
        (f"{_DCP}.planner", "SavePlan"),
        (f"{_DCP}.planner", "WriteItem"),
        (f"{_DCP}.planner", "WriteItemType"),  # an Enum
        (f"{_DCP}.planner", "TensorWriteData"),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # answered by _layout
        *(("torch", name) for name in DTYPES),
    }
)


def _layout(name):
    """``torch.serialization._get_layout``'s answer, data only: the ``torch.layout`` named ``name``."""
    found = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}.get(name)
    if found is None:
        raise CheckpointError(f"checkpoint metadata names an unknown tensor layout {_shown(name)}")
    return found


def _members(cls):
    """An Enum of the list as pickle calls it (``(cls, (value,))``): the member of one value, nothing else
    (not the functional API that builds a new Enum)."""

    def member(value):
        return cls(value)

    return member


def _resolve(module: str, name: str):
    import enum
    import importlib

    if (module, name) == ("torch.serialization", "_get_layout"):
        return _layout
    obj = vars(importlib.import_module(module))[name]  # a plain attribute of the module, never a dotted path
    return _members(obj) if isinstance(obj, type) and issubclass(obj, enum.Enum) else obj


def _shown(x) -> str:
    """A name from a file, fit for a one-line message (printable, at most 80 characters)."""
    s = ascii(x)[1:-1] if isinstance(x, str) else ascii(x)
    return s if len(s) <= 80 else s[:77] + "..."


class RestrictedUnpickler(pickle.Unpickler):
    """Builds data only: the classes of :data:`METADATA_GLOBALS` (exact module and name), nothing else."""

    def find_class(self, module, name):
        if (module, name) not in METADATA_GLOBALS:
            raise CheckpointError(
                f"checkpoint metadata asks to run {_shown(module)}.{_shown(name)}: refused (weights are loaded "
                f"without running code); the checkpoint is damaged or not from megahash"
            )
        return _resolve(module, name)

    def persistent_load(self, pid):
        raise CheckpointError("checkpoint metadata holds a persistent reference: refused (not torch's metadata)")


def restricted_load(file, *args, **kwargs):
    """``pickle.load`` of a ``.metadata`` file, restricted; a file that is not one is one line."""
    name = getattr(file, "name", ".metadata")
    data, chunk = bytearray(), b"-"
    while chunk and len(data) <= MAX_METADATA_BYTES:
        chunk = file.read(1 << 20)
        data += chunk
    if len(data) > MAX_METADATA_BYTES:
        raise CheckpointError(f"checkpoint metadata {name} is over {MAX_METADATA_BYTES} bytes: refused")
    try:
        return RestrictedUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated or garbage pickles raise many kinds
        raise CheckpointError(
            f"checkpoint metadata {name} is not torch.distributed.checkpoint metadata ({type(e).__name__}: "
            f"{_shown(str(e))})"
        ) from None


def refusal(e: BaseException, where: str = "a tensor file of the checkpoint") -> CheckpointError | None:
    """The one-line refusal inside an error of a load: ours, or torch's weights-only refusal of a pickle in
    ``where`` (torch and megatron wrap the errors of every rank: CheckpointException ``failures``, causes)."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if isinstance(x, tuple):  # torch's failures: (exception, stack summary) per rank
            todo += list(x)
            continue
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, CheckpointError):
            return x
        if isinstance(x, pickle.UnpicklingError) and "Weights only load failed" in str(x):
            import re

            what = (re.findall(r"GLOBAL (\S+)", str(x)) or ["code"])[0]
            return CheckpointError(
                f"{where} asks to run {_shown(what)}: refused (weights are loaded without running code); it is "
                f"damaged or not from megahash"
            )
        todo += [x.__cause__, x.__context__, *getattr(x, "failures", {}).values()]
    return None


@contextlib.contextmanager
def no_code_unpickling():
    """While the block runs, torch.distributed.checkpoint reads ``.metadata`` with the restricted
    unpickler and every ``torch.load`` is weights-only (module docstring)."""
    from torch.distributed.checkpoint import filesystem

    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):
        raise CheckpointError(
            "torch.load is configured to unpickle code (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD); unset it "
            "to load checkpoint weights"
        )
    real = filesystem.pickle
    proxy = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    proxy.load = restricted_load
    forced = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    filesystem.pickle = proxy
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        filesystem.pickle = real
        if forced is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = forced
