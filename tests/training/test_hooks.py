"""The training features as hooks (issue 46, megahash/training/hooks.py): the worked example of
docs/architecture.md (a feature of its own: its config section, its hook, its state in checkpoints) run from
the page through the pretraining entry point, and the rules that keep the features in their own files (the
trainer and the checkpoint code name none, only engine_patches.py changes DeepSpeed's engine)."""

from __future__ import annotations

import ast
import re
import sys

import pytest
from test_batch_ramp import _main, _records

from conftest import ROOT, TINIER, doc_block
from megahash.errors import ConfigError

EXAMPLE = doc_block("docs/architecture.md", "## Worked example: add a training feature")
TRAINING = ROOT / "megahash" / "training"


@pytest.fixture
def loss_smooth(tmp_path, monkeypatch):
    """The page's feature as a module outside the package (``MEGAHASH_FEATURES``), the config tree rebuilt
    with its section; the tree without it again afterwards."""
    from megahash import config

    pkg = tmp_path / "features"
    pkg.mkdir()
    (pkg / "loss_smooth.py").write_text(EXAMPLE)
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv("MEGAHASH_FEATURES", "loss_smooth")
    # a module imported by an earlier test stays in sys.modules, where find_spec would take its file from (that
    # test's tmp_path, deleted once it passed): this test's own file, imported afresh
    sys.modules.pop("loss_smooth", None)
    config.reload_features()
    yield
    monkeypatch.delenv("MEGAHASH_FEATURES")
    sys.modules.pop("loss_smooth", None)
    config.reload_features()


def test_the_example_feature_is_a_config_section_checked_like_any_key(loss_smooth):
    from megahash.config import load_config

    assert load_config(None, []).train.loss_smooth.beta == 0.0  # its default, in the tree
    assert load_config(None, ["train.loss_smooth.beta=0.5"]).train.loss_smooth.beta == 0.5
    with pytest.raises(ConfigError, match=re.escape("'train.loss_smooth.beta' must be in [0.0, 1.0)")):
        load_config(None, ["train.loss_smooth.beta=1"])
    with pytest.raises(ConfigError, match="did you mean 'beta'"):
        load_config(None, ["train.loss_smooth.bta=0.5"])


def test_the_example_feature_trains_and_resumes_bit_exactly(loss_smooth, shakespeare_shards, tmp_path, capsys):
    """Its metric follows s_1 = L_1, s_k = beta s_{k-1} + (1 - beta) L_k over the logged losses; a run
    stopped after step 2 and resumed (its state through the checkpoint's state file) logs the same values."""
    import json

    beta = 0.75
    common = [
        f"data.prefix=[{shakespeare_shards['prefix']}]",
        f"data.tokenizer={shakespeare_shards['tokenizer']}",
        *TINIER,
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
        "train.steps=4",
        f"train.loss_smooth.beta={beta}",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    for extra in ([f"train.save_dir={straight}"], [f"train.save_dir={split}", "train.stop_after=2"], []):
        status, out = _main([*common, *(extra or [f"train.save_dir={split}"])], capsys)
        assert status == 0, out[-3000:]
    a, b = _records(straight), _records(split)
    want = None
    for s in range(1, 5):
        loss = a[s]["loss"]
        want = loss if want is None else beta * want + (1 - beta) * loss
        assert a[s]["loss_smooth"] == pytest.approx(want, rel=1e-12)
    assert [b[s]["loss_smooth"] for s in range(1, 5)] == [a[s]["loss_smooth"] for s in range(1, 5)]
    state = json.loads((split / "step_00000002" / "megahash_state.json").read_text())
    assert state["loss_smooth"] == {"value": a[2]["loss_smooth"]}


def _names(path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        a.asname or a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names
    }


def test_trainer_and_checkpoints_name_no_feature_they_call_through_hooks():
    """The trainer calls the features through their hooks, and checkpoints keep their parts by iterating them:
    none of the hooked features' modules is named in trainer.py, checkpoint.py or async_save.py."""
    from megahash.training.hooks import FEATURES

    hooked = set(FEATURES) - {"batch_ramp", "profile_steps", "muon"}  # also used off the hooks (below)
    for name in ("trainer.py", "checkpoint.py", "async_save.py"):
        named = _names(TRAINING / name) & (hooked - {name[:-3]})
        assert named == set(), f"{name} names {sorted(named)}"
    # what the trainer still takes from those three is no hook's business: the resume check of a checkpoint
    # before set-up, the profiler's ranges inside a step, the optimizer
    trainer = (TRAINING / "trainer.py").read_text()
    for module, names in (("batch_ramp", "check_resume"), ("profile_steps", "phase"), ("muon", "build_optimizer")):
        assert f"from megahash.training.{module} import {names}\n" in trainer


def _engine_assignments(path) -> list[str]:
    """``engine.X = ...`` / ``engine.optimizer.X = ...`` / ``setattr(engine, ...)`` in a file."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and "engine" in ast.unparse(t.value):
                out.append(ast.unparse(t))
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "setattr" and "engine" in ast.unparse(n.args[0]):
            out.append(ast.unparse(n))
    return out


def test_only_engine_patches_changes_the_deepspeed_engine():
    """Every patch of DeepSpeed's engine is in one module, in its order (elastic.py sets the step counters
    as DeepSpeed's own checkpoint load does: a restore, not a patch)."""
    found = {
        p.name: a
        for p in sorted(TRAINING.glob("*.py"))
        if p.name != "engine_patches.py"
        if (a := _engine_assignments(p))
    }
    assert found == {"elastic.py": ["engine.global_steps", "engine.global_samples"]}, found
    assert _engine_assignments(TRAINING / "engine_patches.py")  # the rule sees assignments where they are
