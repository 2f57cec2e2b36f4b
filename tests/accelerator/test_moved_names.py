"""The names of the former single module ``megahash/accelerator.py`` (issue 46 item 4): each lives in the module
the package's map names, and asking the package for it is one line naming that module (a script of the previous
layout learns where it went)."""

import importlib

import pytest

import megahash.accelerator as accelerator


def test_every_moved_name_is_in_the_module_the_map_names():
    moved = {name: home for home, names in accelerator._MOVED.items() for name in names.split()}
    assert len(moved) == 45  # every public name of the former module (its 45 functions, classes, constants)
    for name, home in moved.items():
        assert hasattr(importlib.import_module(f"megahash.accelerator.{home}"), name), (home, name)


def test_asking_the_package_for_a_moved_name_names_its_module():
    with pytest.raises(
        AttributeError, match=r"^megahash.accelerator.seed_all is now megahash.accelerator.rng.seed_all"
    ):
        accelerator.seed_all(0)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        accelerator.not_a_name  # noqa: B018
