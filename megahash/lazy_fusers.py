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
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

_JIT_MODULE = "megatron.core.jit"


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
    """Loads ``megatron.core.jit`` as usual, then makes its ``jit_fuser`` lazy."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        module.jit_fuser = lazy(module.jit_fuser)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Make megatron-core's ``jit_fuser`` lazy in this process (before megatron-core is imported; once)."""
    if _JIT_MODULE not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
