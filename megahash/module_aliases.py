"""Old import paths of modules that moved into the package.

The repository's entry folders ``data_tools/`` and ``launch/`` hold scripts users run by path
(``python data_tools/preprocess_data.py``, ``python -m launch``); their library code lives in
:mod:`megahash.data_stage` and :mod:`megahash.launching`, so an installed megahash claims no generic
top-level names. :func:`alias_submodules` keeps ``import launch.env`` / ``python -m
launch.local_slurm`` (docs, scripts written against the old layout) working from a checkout: the
old name is the SAME module object as the new one (one copy of its state), found lazily by a
``sys.meta_path`` finder, and ``python -m OLD`` runs the new module's code.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, old_package: str, new_package: str, names):
        self.old, self.new, self.names = old_package, new_package, frozenset(names)
        self._real_specs = {}

    def _target(self, fullname: str):
        parent, _, name = fullname.rpartition(".")
        return f"{self.new}.{name}" if parent == self.old and name in self.names else None

    def find_spec(self, fullname, path=None, target=None):
        real = self._target(fullname)
        if real is None:
            return None
        spec = importlib.util.find_spec(real)
        return importlib.util.spec_from_loader(fullname, self, origin=spec.origin if spec else None)

    def create_module(self, spec):
        module = importlib.import_module(self._target(spec.name))
        self._real_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # the import system set __spec__ to the alias's spec; the module keeps its own
        module.__spec__ = self._real_specs.pop(module.__spec__.name, module.__spec__)

    def get_code(self, fullname):  # ``python -m OLD`` (runpy)
        real = importlib.util.find_spec(self._target(fullname))
        return real.loader.get_code(real.name)


def alias_submodules(old_package: str, new_package: str, names) -> None:
    """Make ``old_package.NAME`` import ``new_package.NAME`` for each NAME in ``names``."""
    if not any(isinstance(f, _AliasFinder) and f.old == old_package for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder(old_package, new_package, names))
