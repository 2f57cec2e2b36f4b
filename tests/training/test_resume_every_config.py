"""Every configuration megahash offers saves and resumes (issue 28): for every hybrid schedule preset
(half of them with ``model.attention.skip_nonstandard=true``), every embedding kind, every objective
on its architecture, every head and dropout, read from the registry (tests/_kinds.py, the presets of
megahash/models/schedules.py, the objectives of megahash/objectives): a tiny 4-step run saving at
step 2, and a second run resumed from that checkpoint, log bit-identical steps 3-4 (loss, gradient
norm, parameter norm, LR) and the same per-parameter Adam step counts. One rank, in this process,
through the pretraining entry point; the ZeRO stages reachable at one rank (0 and 3 in fp32, 1 in
bf16) rotate over the configurations. The multi-rank layouts have their own tests
(tests/training/test_training.py, tests/training/test_faults.py).

Plus: a hybrid with skipped layers moves between ZeRO stages (elastic resume) with its per-parameter
optimizer state, the skipped layers are in no optimizer and stay as built, and a save failure names
its real cause."""

from __future__ import annotations

import json
from pathlib import Path

import _kinds
import pytest

import conftest
from conftest import ROOT

TINY = [
    *conftest.TINY,
    "model.num_layers=4",
    "model.vocab_size=0",
    "model.attention.options.fixed_seq_length=64",
    "train.global_batch_size=4",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.keep_last=0",
]
# options that only make a kind faster here (a newly registered kind runs with none)
FASTER = {"pool": ["model.embed.options.pool_bits=6"], "rolling": ["model.embed.options.rolling_dim=48"]}
COMPARED = ("loss", "grad_norm", "param_norm", "lr", "consumed_samples")
# the ZeRO stages one rank can hold (fp32 ZeRO-1/2 at one rank run as ZeRO-0: ds_config.effective_zero_stage)
STAGES = (["train.zero_stage=0"], ["train.zero_stage=3"], ["train.zero_stage=1", "train.precision=bf16"])


def _objectives() -> list[str]:
    from megahash.objective_spec import names

    return names()


def _arch(objective: str) -> str:
    from megahash.objective_spec import objective_spec

    return objective_spec(objective).arch  # causal LM in a decoder, corruption objectives in encoders


def _embedding(kind: str) -> list[str]:
    from megahash import catalog

    return [
        f"model.embedding={kind}",
        f"model.embed.hash_spec={catalog.caps('embedding', kind).example_hash_spec}",
        *FASTER.get(kind, []),
    ]


def configurations() -> dict[str, list[str]]:
    """name -> overrides: every preset (non-standard attention kinds and embedding kinds cycled over
    them, skip_nonstandard on every other one), every objective, every selectable head."""
    from megahash import catalog
    from megahash.models.schedules import PRESETS

    kinds = [k for k in _kinds.attention(decoder=True) if k != _kinds.attention(standard=True)[0]]
    todo = _kinds.embeddings()  # embedding kinds not yet in a configuration
    out = {}
    for i, preset in enumerate(PRESETS):
        skip, kind = i % 2 == 0, kinds[i % len(kinds)]
        # a kind reading a fixed input (the fixed text) embeds token ids: no hash-code embedding beside it
        fits = [
            e
            for e in todo
            if not (catalog.caps("attention", kind).fixed_input and catalog.caps("embedding", e).reads_hash_codes)
        ]
        emb = fits[0] if fits else _kinds.embeddings(standard=True)[0]
        todo = [e for e in todo if e != emb]
        out[f"{'skip' if skip else 'hybrid'}-{kind}-{preset}-{emb}"] = [
            f"model.schedule=hybrid:{kind}:{preset}",
            f"model.attention.skip_nonstandard={str(skip).lower()}",
            *_embedding(emb),
        ]
    for emb in todo:
        out[f"embedding-{emb}"] = _embedding(emb)
    for obj in _objectives():
        out[f"objective-{obj}"] = [f"train.objective={obj}", f"model.arch={_arch(obj)}"]
    for head in _kinds.heads(selectable=True, standard=False):
        out[f"head-{head}"] = [f"model.head={head}"]  # its hash spec: the first one it accepts (_head_spec)
    # dropout draws from torch's RNG, which the checkpoint restores: the resumed batch iterator must not draw from it
    out["dropout"] = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    return out


CONFIGS = configurations()


def _base(shards, save_dir, *extra) -> list[str]:
    return [
        f"data.prefix=[{shards['prefix']}]",
        f"data.tokenizer={shards['tokenizer']}",
        *TINY,
        f"train.save_dir={save_dir}",
        *extra,
    ]


def _head_spec(shards, head: str) -> str:
    """The first hash spec of the shards that ``head`` accepts (its constructor refuses the others)."""
    from megahash.accelerator import process_groups
    from megahash.config import load_config
    from megahash.errors import ConfigError
    from megahash.models.megatron_model import MegahashLM

    process_groups.init_distributed(1)
    try:
        for spec in shards["specs"]:
            try:
                MegahashLM(load_config(None, [*TINY, f"model.head={head}", f"model.embed.hash_spec={spec}"]), 1024)
                return spec
            except ConfigError:
                continue
    finally:
        process_groups.teardown()
    raise AssertionError(f"no hash spec of {shards['specs']} suits head {head}")


def _records(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["split"] == "train":
            out[rec["step"]] = {k: rec.get(k) for k in COMPARED}
    return out


def _optim_info(ckpt: Path) -> dict:
    return json.loads((ckpt / "optimizer" / "megahash_optimizer.json").read_text())


def _main(args: list[str], capsys) -> tuple[int, str]:
    from megahash.pretrain import main

    status = main(args)
    cap = capsys.readouterr()
    return status, cap.out + cap.err


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_configuration_saves_and_resumes_exactly(hashed_shards, tmp_path, capsys, name):
    extra = list(CONFIGS[name])
    if name.startswith("head-"):
        extra.append(f"model.embed.hash_spec={_head_spec(hashed_shards, extra[0].split('=', 1)[1])}")
    extra += STAGES[list(CONFIGS).index(name) % len(STAGES)]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    status, out = _main(_base(hashed_shards, straight, "train.steps=4", "train.save_interval=2", *extra), capsys)
    assert status == 0, out[-3000:]
    status, out = _main(
        _base(hashed_shards, resumed, "train.steps=4", f"train.resume={straight / 'step_00000002'}", *extra), capsys
    )
    assert status == 0 and f"resumed from {straight}/step_00000002" in out, out[-3000:]
    a, b = _records(straight), _records(resumed)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [3, 4], (a, b)
    # bit-exact: resume is the promise (the same configuration in process, same machine)
    assert [a[3], a[4]] == [b[3], b[4]]  # bit-identical, as the uninterrupted run
    saved, again = _optim_info(straight / "step_00000004"), _optim_info(resumed / "step_00000004")
    assert saved["param_steps"] == again["param_steps"] and saved["adam_step"] == 4
    skipped = _skipped_layers(extra)  # frozen: in no optimizer; every other layer trains
    layers = {int(n.split(".")[2]) for n in saved["param_steps"] if n.startswith("decoder.layers.")}
    assert layers == set(range(4)) - skipped, (skipped, layers)


def _skipped_layers(overrides: list[str]) -> set[int]:
    """0-based layers ``model.attention.skip_nonstandard=true`` drops (megahash.models.schedules)."""
    from megahash.models.schedules import layer_kinds, skip_mask

    opts = dict(o.split("=", 1) for o in overrides)
    if opts.get("model.attention.skip_nonstandard") != "true":
        return set()
    return {i for i, s in enumerate(skip_mask(layer_kinds(opts["model.schedule"], 4))) if s}


def test_skipped_layers_move_between_zero_stages_and_stay_as_built(hashed_shards, tmp_path, capsys):
    """``hybrid:rndembqk:even`` with skip_nonstandard (the README grid's failing cell): 6 straight steps
    at ZeRO-0 fp32 vs 2 steps at ZeRO-0, resumed at ZeRO-3 (another layout: the elastic resume carries
    each parameter's Adam state) for 2, resumed at ZeRO-0 for 2; every resumed step within 1e-5 of the
    straight run (the order of float sums differs between the stages), the skipped layers' weights
    bit-identical to their initialisation (weight decay 0.1), and a checkpoint of a flat optimizer's (ZeRO-3) records
    the same step counts as the per-parameter one."""
    import torch

    from megahash.accelerator import process_groups
    from megahash.checkpoint.weights import load_for_inference

    skip = [
        "model.schedule=hybrid:rndembqk:even",
        "model.attention.skip_nonstandard=true",
        "train.weight_decay=0.1",
        "train.steps=6",
        "train.save_interval=2",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    # the straight run's checkpoint at its end is the one read (no periodic saves: they change no loss)
    status, out = _main(_base(hashed_shards, straight, *skip, "train.zero_stage=0", "train.save_interval=0"), capsys)
    assert status == 0, out[-3000:]
    for leg, (stage, stop) in enumerate([(0, 2), (3, 4), (0, 6)]):
        status, out = _main(
            _base(hashed_shards, split, *skip, f"train.zero_stage={stage}", f"train.stop_after={stop}"), capsys
        )
        assert status == 0 and (leg == 0 or f"resumed from {split}/step_{stop - 2:08d}" in out), out[-3000:]
    a, b = _records(straight), _records(split)
    # bit-exact: steps 1-2 run the same ZeRO-0 path in both (one path); later steps change layout: 1e-5
    assert [a[s] for s in (1, 2)] == [b[s] for s in (1, 2)]
    for s in range(3, 7):
        assert abs(a[s]["loss"] - b[s]["loss"]) < 1e-5 and abs(a[s]["param_norm"] - b[s]["param_norm"]) < 1e-5, (
            s,
            a,
            b,
        )
    steps = {n: _optim_info(split / f"step_{n:08d}")["param_steps"] for n in (2, 4, 6)}
    assert set(steps[4].values()) == {4} and steps[6] == {k: 6 for k in steps[2]} and set(steps[2].values()) == {2}
    assert not [k for k in steps[2] if k.startswith(("decoder.layers.0.", "decoder.layers.2."))]
    # the skipped (odd, 1-based) layers 1 and 3 are as the seed built them, in both runs (weight decay
    # under ZeRO-3 would have shrunk them): the same as after one ZeRO-0 step (no gradient, no step)
    init = tmp_path / "init"
    status, out = _main(_base(hashed_shards, init, *skip[:3], "train.steps=1", "train.zero_stage=0"), capsys)
    assert status == 0, out[-3000:]
    weights = {}
    try:
        for d in (init, straight, split):
            _, model, _ = load_for_inference(d)
            weights[d] = {
                k: v.clone()
                for k, v in model.state_dict().items()
                if torch.is_tensor(v)
                and k.startswith(("decoder.layers.0.", "decoder.layers.2."))
                and v.is_floating_point()
            }
    finally:
        process_groups.teardown()
    # bit-exact: skipped layers are never updated: their weights are the stored initial ones
    assert weights[init] and all(
        torch.equal(weights[init][k], weights[d][k]) for d in (straight, split) for k in weights[init]
    )


def test_a_failed_save_names_its_cause_not_the_disk():
    """A save that fails for another reason than the file system does not advise freeing space."""
    from megahash.errors import CheckpointError
    from megahash.training.checkpoint_faults import disk_note, save_failed

    root = ROOT / "tests"
    cause = CheckpointError("the optimizer state cannot be written")
    text = str(save_failed(root, "step_00000050", disk_note(root, cause), cause))
    assert "(the optimizer state cannot be written)" in text and "free space" not in text
    assert "not a file-system problem" in text
    perm = PermissionError(13, "Permission denied", "/x/step_00000050.tmp")
    text = str(save_failed(root, "step_00000050", disk_note(root, perm), perm))
    assert "Permission denied: /x/step_00000050.tmp" in text and "fix the folder" in text
    full = OSError(28, "No space left on device")
    text = str(save_failed(root, "step_00000050", disk_note(root, full), full))
    assert "disk full" in text and "free space on that file system" in text
