"""benchmarks/bench_compact_recipe.py's ``--steps N``: every recipe trains N steps, as its help says."""

import importlib.util
from pathlib import Path

from conftest import ROOT
from megahash.config import load_config


def _bench():
    spec = importlib.util.spec_from_file_location("bench_compact_recipe", ROOT / "benchmarks/bench_compact_recipe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_steps_sets_every_recipes_steps():
    """Before, ``--steps 2`` trained the ``schedule`` recipe (whose own overrides set train.steps=600) 600 steps,
    every other recipe 2: its overrides came after the flag's. 0 keeps each recipe's own steps."""
    bench = _bench()
    for recipe, (configs, _) in bench.RECIPES.items():
        own = load_config(configs, bench.train_sets(recipe, 1, 0, Path("runs/x"))).train.steps
        assert load_config(configs, bench.train_sets(recipe, 1, 2, Path("runs/x"))).train.steps == 2, recipe
        assert own == {"schedule": 600, "compact": 600}.get(recipe, 300), (recipe, own)
