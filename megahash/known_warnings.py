"""The one place that silences library warnings known to be harmless for megahash.

:func:`install` runs first in every entry point (``megahash``, ``megahash/pretrain.py``), before the
libraries are imported. Listed here, each with why it is harmless:

- megatron-core "Transformer Engine and Apex are not installed. Falling back to ..." (4 per import):
  megahash uses megatron-core's local (torch) implementations on purpose (CPU, no TE wheel).
- megatron-core "full scope is deprecated" (TransformerConfig's cuda_graph_scope default): no
  CUDA graphs are used.
- torch "TypedStorage is deprecated": raised inside DeepSpeed/megatron checkpoint code.
- torch.distributed "barrier(): using the device under current context" / "No device id is
  provided": the gloo/CPU backend has no device to bind.
- DeepSpeed's INFO log lines (config dumps, "Using client Optimizer", ZeRO setup): set to
  WARNING; megahash prints its own one-line summary of the run.
- "pkg_resources is deprecated" (setuptools, imported by older dependencies).
- megatron-core's log line "Unknown MLP type ... Using default kwargs" (one per layer): TransformerLayer
  says it of a ModuleSpec of any MLP subclass; megahash's layer spec now names the FeedForward class
  itself (models/registry.py ``mlp_spec``), so it is no longer logged; the filter stays for plugins.
- torch "`torch.distributed.all_gather_into_tensor` is deprecated" (FutureWarning, per ZeRO step
  in DeepSpeed): the name's deprecation, the collective is what DeepSpeed needs.

Every other user/future/runtime warning is shown once per message (``"once"``), not once per call
site and step; DeprecationWarnings stay hidden as Python hides them by default.
``MEGAHASH_SHOW_WARNINGS=1`` turns all of this off.

Warnings of one call site are silenced only around that call (:func:`silenced`), not process-wide:

- :data:`DIST_CHECKPOINT_LOAD` (``megahash.training.weights.load_weights``: ``megahash eval``,
  ``indicators``, ``export-hf``, a resume at another layout): megatron-core's ``torch_dist`` load calls
  torch's deprecated ``checkpoint.load_state_dict`` name, and torch's planner warns of the
  ShardedTensors megatron-core builds its dist checkpoints from (megatron-core's format, not ours to
  change); the loaded values are checked (tests/test_training.py, tests/test_convert.py).
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings

KNOWN_HARMLESS = [
    # (message regex, category)
    (r"Transformer Engine and Apex are not installed", UserWarning),
    (r"full scope is deprecated", UserWarning),
    (r".*TypedStorage is deprecated", UserWarning),
    (r".*barrier\(\): using the device under current context", UserWarning),
    (r".*No device id is provided", UserWarning),
    (r"pkg_resources is deprecated", UserWarning),
    (r".*torch\.cuda\.amp\..* is deprecated", FutureWarning),
    # DeepSpeed ZeRO calls torch's all_gather_into_tensor (deprecation of the name only)
    (r".*torch\.distributed\.all_gather_into_tensor. is deprecated", FutureWarning),
    # DeprecationWarnings are hidden by Python's default filters; these two are listed so they
    # stay hidden under `python -W default` too: torch.jit in an import, megatron-core's specs
    (r".*torch\.jit\.script_method. is deprecated", DeprecationWarning),
    (r"MLP requires ffn_hidden_size", DeprecationWarning),
    (r"The following imports from .dynamic_context\.py.", DeprecationWarning),
]
DIST_CHECKPOINT_LOAD = [
    (r"`load_state_dict` is deprecated", FutureWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
]
QUIET_LOGGERS = ("DeepSpeed", "deepspeed")
# logger -> messages (prefixes) dropped from it
QUIET_MESSAGES = {"megatron.core.transformer.transformer_layer": ("Unknown MLP type",)}


class _DropMessages(logging.Filter):
    def __init__(self, prefixes):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)

_installed = False


def install() -> None:
    """Filters above + "once" for the rest (idempotent)."""
    global _installed
    if _installed or os.environ.get("MEGAHASH_SHOW_WARNINGS") == "1":
        return
    _installed = True
    for category in (UserWarning, FutureWarning, RuntimeWarning):  # Python's defaults keep hiding the rest
        warnings.filterwarnings("once", category=category)
    for message, category in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name, prefixes in QUIET_MESSAGES.items():
        logging.getLogger(name).addFilter(_DropMessages(prefixes))


def quiet_deepspeed_logger() -> None:
    """DeepSpeed sets its logger's level when imported: lower it again afterwards."""
    if os.environ.get("MEGAHASH_SHOW_WARNINGS") == "1":
        return
    try:
        from deepspeed.utils import logger
    except ImportError:
        return
    logger.setLevel(logging.WARNING)


@contextlib.contextmanager
def silenced(known):
    """Ignore the ``(message regex, category)`` warnings of ``known`` inside the block only."""
    with warnings.catch_warnings():
        if os.environ.get("MEGAHASH_SHOW_WARNINGS") != "1":
            for message, category in known:
                warnings.filterwarnings("ignore", message=message, category=category)
        yield
