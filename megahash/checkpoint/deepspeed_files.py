"""DeepSpeed's files of a checkpoint (``mp_rank_*_model_states.pt``, ``*_optim_states.pt``) read without
running code on resume.

DeepSpeed 0.19's ``TorchCheckpointEngine.load`` is ``torch.load(weights_only=False)``: a pickle that can
run anything. Every file ``engine.load_checkpoint`` reads goes through ``engine.checkpoint_engine.load``
(the model states through ``SDLoaderFactory``, the ZeRO partitions in ``_load_zero_checkpoint``), so
:func:`weights_only_engine` puts :class:`WeightsOnlyEngine` there for the duration of the load: torch's
weights-only unpickler, with ``torch.serialization.safe_globals`` for exactly the classes DeepSpeed pickles
(:data:`DEEPSPEED_GLOBALS`, recorded from checkpoints saved at ZeRO 0-3, fp32 and bf16, TP 1 and 2, Muon,
EMA: docs/security.md); everything else DeepSpeed writes (tensors, dicts, lists, numbers, strings,
``OrderedDict``, ``torch.Size``) is in torch's own weights-only set.

:func:`unsafe_globals` says before anything is unpickled which globals beyond those a checkpoint's
DeepSpeed files reference (torch's static scan of each pickle, ``get_unsafe_globals_in_checkpoint``);
the trainer loads such a checkpoint only when it is trusted (``train.trust_checkpoint=true``, or written
by this install: :mod:`megahash.checkpoint.origin`), then with DeepSpeed's own ``torch.load``. A pickle
the scan cannot read (damaged, or opcodes torch.save never writes) goes to the weights-only load, which
refuses anything beyond the list: a failed load, which the trainer treats as damage.
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path

from megahash.errors import CheckpointError

DEEPSPEED_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),  # ZeRO 1-3: the optimizer's (static, 1.0) loss scale
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),  # ZeRO 1-3: the stage, an int Enum
    ("deepspeed.utils.tensor_fragment", "fragment_address"),  # ZeRO 1-2: (numel, start) of a partition
)


def safe_globals() -> list:
    """The objects of :data:`DEEPSPEED_GLOBALS` (for ``torch.serialization.safe_globals``)."""
    import importlib

    return [vars(importlib.import_module(m))[n] for m, n in DEEPSPEED_GLOBALS]


def deepspeed_files(ckpt: Path) -> list[Path]:
    """The torch files DeepSpeed wrote into ``ckpt`` (none in an asynchronous save)."""
    return sorted(p for p in Path(ckpt).glob("*.pt") if p.is_file())


def unsafe_globals(ckpt: Path) -> dict[str, list[str]]:
    """file name -> the globals its pickle references beyond torch's weights-only set and
    :data:`DEEPSPEED_GLOBALS` (or the opcode torch's scan cannot read); empty when every file loads without
    code. A file torch cannot open at all is left to the load (a damaged file, not a hostile one)."""
    import torch

    found = {}
    with torch.serialization.safe_globals(safe_globals()):
        for f in deepspeed_files(ckpt):
            try:
                bad = torch.serialization.get_unsafe_globals_in_checkpoint(str(f))
            except Exception:  # not a zip, truncated, opcodes the scan does not read (a damaged pickle, or a
                continue  # crafted one): left to the weights-only load, whose failure is damage (a fallback)
            if bad:
                found[f.name] = sorted(bad)
    return found


class UntrustedCheckpoint(CheckpointError):
    """A checkpoint whose DeepSpeed files need more than weights-only loading, neither trusted nor written by this
    install: a refusal (the run stops, exit 2), not damage (megahash/training/trainer.py falls back past damage)."""


def refused(ckpt: Path, unsafe: dict[str, list[str]]) -> CheckpointError:
    name, bad = next(iter(sorted(unsafe.items()))) if unsafe else ("a DeepSpeed file", ["code"])
    shown = ", ".join(b[:80] for b in bad[:3]) + (", ..." if len(bad) > 3 else "")
    return UntrustedCheckpoint(
        f"checkpoint {ckpt} was not written by this install and its {name} asks to unpickle {shown}, which "
        f"megahash does not load without running code: refused; resume it only if you trust where it comes "
        f"from, with train.trust_checkpoint=true, or resume another checkpoint with train.resume=PATH "
        f"(docs/security.md)"
    )


class WeightsOnlyEngine:
    """DeepSpeed's checkpoint engine with a weights-only ``load`` (everything else is the engine's)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def load(self, path, map_location=None):
        import torch

        with torch.serialization.safe_globals(safe_globals()):
            try:
                return torch.load(path, map_location=map_location, weights_only=True)
            except pickle.UnpicklingError as e:
                from megahash.checkpoint.safe_unpickle import refusal

                raise (refusal(e, str(path)) or CheckpointError(f"{path} is not a readable torch file")) from None


@contextlib.contextmanager
def weights_only_engine(engine):
    """While the block runs, DeepSpeed reads the checkpoint files of ``engine`` weights-only."""
    real = engine.checkpoint_engine
    engine.checkpoint_engine = WeightsOnlyEngine(real)
    try:
        yield
    finally:
        engine.checkpoint_engine = real
