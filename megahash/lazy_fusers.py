"""megatron-core's fused functions compiled on their first call, not while megatron-core imports.

megatron-core decorates about 34 functions with ``megatron.core.jit.jit_fuser`` (``torch.compile``
on torch >= 2.2). Each ``torch.compile`` call at import builds a dynamo wrapper and imports inductor:
1.1-1.4 CPU seconds of the ~4.7 s a one-rank CPU run of the test model spends in all (measured on the
2-core EPYC; every rank, launcher-spawned evaluation and conversion process pays it, most of them
never call one of those functions). :func:`install` (run by ``import megahash``; imports no torch)
wraps ``jit_fuser`` as soon as megatron-core's ``jit.py`` has run, so a decorated function is
handed to the same ``torch.compile`` on its first call, where ``torch.compile`` would compile it
anyway. Inside a region torch.compile is tracing (``train.compile``), the plain function is called,
which dynamo inlines as it inlines a nested compiled function.

The same hook keeps two modules that ``import megatron.core`` runs and megahash never uses from importing
loggers: its timers' writers (``megatron.core.timers``: wandb, TensorBoard's ``SummaryWriter``) and its dynamic
inference context (wandb): 0.4 CPU-s a process. While one of them runs, those imports fail as if the packages
were not installed, so each takes its own fallback branch (``wandb = None``, ``SummaryWriter = None``); the
packages stay importable (``logging.wandb`` and ``logging.tensorboard`` import them).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

_JIT_MODULE = "megatron.core.jit"
_UNUSED_LOGGERS = {  # megatron-core module -> the optional imports it is run without
    "megatron.core.timers": ("wandb", "torch.utils.tensorboard"),
    "megatron.core.inference.contexts.dynamic_context": ("wandb",),
}


class LazyFused:
    """``fuser(fn)``, made on the first call of the returned callable."""

    def __init__(self, fuser, fn):
        self._fuser, self._fn, self._fused = fuser, fn, None
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        import torch

        if torch.compiler.is_compiling():
            return self._fn(*args, **kwargs)
        if self._fused is None:
            self._fused = self._fuser(self._fn)
        return self._fused(*args, **kwargs)


def lazy(fuser):
    """A decorator that defers ``fuser`` (``torch.compile``, ``torch.jit.script``, a no-op) to the first call."""
    return functools.wraps(fuser)(lambda fn: LazyFused(fuser, fn))


class _Loader(importlib.abc.Loader):
    """Loads a megatron-core module as usual, with ``exec_hook`` around its execution."""

    def __init__(self, inner, exec_hook):
        self._inner, self._hook = inner, exec_hook

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._hook(self._inner, module)


def _lazy_jit(inner, module) -> None:
    """``megatron.core.jit`` as usual, then its ``jit_fuser`` lazy."""
    inner.exec_module(module)
    module.jit_fuser = lazy(module.jit_fuser)


def _without(names):
    """A hook running the module while ``import NAME`` raises ImportError for each of ``names`` not imported yet
    (a None entry in sys.modules, removed afterwards: a later import imports it)."""

    def hook(inner, module) -> None:
        blocked = [n for n in names if n not in sys.modules]
        for n in blocked:
            sys.modules[n] = None
        try:
            inner.exec_module(module)
        finally:
            for n in blocked:
                if n in sys.modules and sys.modules[n] is None:
                    del sys.modules[n]

    return hook


_HOOKS = {_JIT_MODULE: _lazy_jit, **{m: _without(names) for m, names in _UNUSED_LOGGERS.items()}}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        hook = _HOOKS.get(name)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, hook)
        return spec


def install() -> None:
    """Make megatron-core's ``jit_fuser`` lazy in this process (before megatron-core is imported; once)."""
    if _JIT_MODULE not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
