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

- DeepSpeed's "Setting accelerator to CPU. If you have GPU ... we were unable to detect it" (once per
  process that imports it): CPU is megahash's own choice when torch sees no GPU (megahash/accelerator/policy.py);
  launch/quickstart.sh names the accelerator (``DS_ACCELERATOR``) so its launcher does not say it either.
- DeepSpeed's ``print`` "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" (once per
  rank, its CPU shared-memory all-reduce): a build that fails still raises; lm-eval's "bootstrapping for
  stddev: METRIC" (``megahash eval``): the stderr is in the table (:func:`dropped_prints`).
- progress bars (tqdm: lm-eval's requests, datasets' "Generating test split") when stderr is not a
  terminal: a log file gets a line per update; on a terminal they stay (``TQDM_DISABLE``,
  ``HF_DATASETS_DISABLE_PROGRESS_BARS``, set only where the user has not set them).

Every other user/future/runtime warning is shown once per message (``"once"``), not once per call
site and step; DeprecationWarnings stay hidden as Python hides them by default.
``MEGAHASH_SHOW_WARNINGS=1`` turns all of this off, and so does the entry points' ``--verbose``
(``logging.verbose=true`` for pretraining: :func:`show_all`).

Warnings of one call site are silenced only around that call (:func:`silenced`), not process-wide:

- :data:`DIST_CHECKPOINT_LOAD` (``megahash.checkpoint.weights.load_weights``: ``megahash eval``,
  ``indicators``, ``export-hf``, a resume at another layout): megatron-core's ``torch_dist`` load calls
  torch's deprecated ``checkpoint.load_state_dict`` name, and torch's planner warns of the
  ShardedTensors megatron-core builds its dist checkpoints from (megatron-core's format, not ours to
  change); the loaded values are checked (tests/training/test_training.py, tests/convert/test_convert.py).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import sys
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
QUIET_MESSAGES = {
    "megatron.core.transformer.transformer_layer": ("Unknown MLP type",),
    "DeepSpeed": ("Setting accelerator to CPU",),
}
# lines libraries print (stdout): DeepSpeed building its CPU communication op, lm-eval per bootstrapped metric
SHM_BUILD_PRINTS = ("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",)
LM_EVAL_PRINTS = ("bootstrapping for stddev:",)
# progress bars off when stderr is not a terminal (environment variables the libraries read at import)
NO_PROGRESS_BARS = ("TQDM_DISABLE", "HF_DATASETS_DISABLE_PROGRESS_BARS")


class _DropMessages(logging.Filter):
    def __init__(self, prefixes):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


_installed = False
_undo: dict = {}


def install() -> None:
    """Filters above + "once" for the rest (idempotent)."""
    global _installed
    if _installed or os.environ.get("MEGAHASH_SHOW_WARNINGS") == "1":
        return
    _installed = True
    _undo.update(filters=list(warnings.filters), env=[], loggers={})
    for category in (UserWarning, FutureWarning, RuntimeWarning):  # Python's defaults keep hiding the rest
        warnings.filterwarnings("once", category=category)
    for message, category in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in QUIET_LOGGERS:
        _undo["loggers"].setdefault(name, [logging.getLogger(name).level, None])
        logging.getLogger(name).setLevel(logging.WARNING)
    for name, prefixes in QUIET_MESSAGES.items():
        _undo["loggers"].setdefault(name, [logging.getLogger(name).level, None])[1] = f = _DropMessages(prefixes)
        logging.getLogger(name).addFilter(f)
    if not sys.stderr.isatty():
        for var in NO_PROGRESS_BARS:
            if var not in os.environ:
                os.environ[var] = "1"
                _undo["env"].append(var)


def show_all() -> None:
    """``--verbose``: undo :func:`install` (before the libraries are imported) and let every later call
    of this module pass everything, in this process and the ones it starts (``MEGAHASH_SHOW_WARNINGS=1``)."""
    global _installed
    os.environ["MEGAHASH_SHOW_WARNINGS"] = "1"
    if not _installed:
        return
    _installed = False
    warnings.filters[:] = _undo["filters"]
    mutated = getattr(warnings, "_filters_mutated", None)  # what filterwarnings calls after changing the list
    if mutated is not None:
        mutated()
    for var in _undo["env"]:
        os.environ.pop(var, None)
    for name, (level, drop) in _undo["loggers"].items():
        logging.getLogger(name).setLevel(level)
        if drop is not None:
            logging.getLogger(name).removeFilter(drop)


def quiet_deepspeed_logger() -> None:
    """DeepSpeed sets its logger's level when imported: lower it again afterwards; and its CPU
    communication op's "built successfully" print is dropped (QUIET_PRINTS)."""
    if os.environ.get("MEGAHASH_SHOW_WARNINGS") == "1":
        return
    try:
        from deepspeed.utils import logger

        ds_torch = importlib.import_module("deepspeed.comm.torch")  # `from deepspeed.comm import torch` is torch
    except ImportError:
        return
    logger.setLevel(logging.WARNING)
    build = ds_torch.build_shm_op
    if getattr(build, "megahash_quiet", False):
        return

    def build_quietly():
        with dropped_prints(SHM_BUILD_PRINTS):
            return build()

    build_quietly.megahash_quiet = True
    ds_torch.build_shm_op = build_quietly


class _DropLines(io.TextIOBase):
    """stdout that passes every line but those starting with ``prefixes`` (whole lines, in order)."""

    def __init__(self, target, prefixes):
        self.target, self.prefixes, self.part = target, prefixes, ""

    def write(self, text: str) -> int:
        *lines, self.part = (self.part + text).split("\n")
        for line in lines:
            if not line.startswith(self.prefixes):
                self.target.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def close_part(self) -> None:
        if self.part and not self.part.startswith(self.prefixes):
            self.target.write(self.part)
        self.part = ""


@contextlib.contextmanager
def dropped_prints(prefixes):
    """Lines a library ``print``s that start with ``prefixes`` are dropped inside the block (stdout)."""
    if os.environ.get("MEGAHASH_SHOW_WARNINGS") == "1":
        yield
        return
    out = _DropLines(sys.stdout, tuple(prefixes))
    try:
        with contextlib.redirect_stdout(out):
            yield
    finally:
        out.close_part()


@contextlib.contextmanager
def silenced(known):
    """Ignore the ``(message regex, category)`` warnings of ``known`` inside the block only."""
    with warnings.catch_warnings():
        if os.environ.get("MEGAHASH_SHOW_WARNINGS") != "1":
            for message, category in known:
                warnings.filterwarnings("ignore", message=message, category=category)
        yield
