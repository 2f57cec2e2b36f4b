"""configs/compact.yaml (docs/compact_models.md) runs as documented: the quickstart model at the same stored
parameters (``megahash params`` in closed form), trained through the real DeepSpeed engine with Muon and the WSD
schedule at the recipe's batch (here 3 steps, in this process), then written as an int8 + zlib artifact whose
printed size is the file's; over several data-parallel ranks its Muon runs sharded (ZeRO-1; tests/training/test_muon.py
runs that layout)."""

import json
import os
import re

from test_batch_ramp import _main


def _params(*args) -> int:
    from megahash.cli import main as cli

    return cli(["params", "--json", "--vocab-size", "4000", *args])


def test_compact_recipe_trains_and_exports_no_larger_than_the_quickstart(shakespeare_shards, tmp_path, capsys):
    from megahash.cli import main as cli

    totals = {}
    for name in ("quickstart", "compact"):
        assert _params("--config", f"configs/{name}.yaml") == 0
        totals[name] = json.loads(capsys.readouterr().out)["total"]
    assert totals["compact"] <= totals["quickstart"], totals  # the recipe's promise: no more stored parameters
    from megahash.config import load_config
    from megahash.training.muon import sharded

    recipe = load_config("configs/compact.yaml").train
    assert sharded(recipe, 2) and not sharded(recipe, 1)  # its documented 2-rank run: Muon sharded (ZeRO-1)

    run = tmp_path / "compact"
    data = [
        f"data.prefix=[{shakespeare_shards['prefix']}]",
        f"data.tokenizer={shakespeare_shards['tokenizer']}",
        "model.vocab_size=0",
    ]
    status, out = _main(
        [
            "--config",
            "configs/compact.yaml",
            *data,
            "train.steps=3",
            "train.warmup_steps=1",
            "train.eval_interval=3",
            "data.valid_samples=8",
            "logging.plot=false",
            f"train.save_dir={run}",
            "train.save_interval=0",
        ],
        capsys,
    )
    assert status == 0, out[-3000:]
    assert re.search(r"\[train\] step 3/3 .*optimizer_s \d", out), out[-2000:]
    assert re.search(r"\[valid\] step 3/3 .* bpb \d", out), out[-2000:]  # bits per byte of the held-out split
    path = tmp_path / "compact.int8.zlib"
    assert (
        cli(["export", "--checkpoint", str(run), "--output", str(path), "--quantize", "int8", "--compress", "zlib"])
        == 0
    )
    assert int(re.search(r"; (\d+) bytes", capsys.readouterr().out)[1]) == os.path.getsize(path)
    # its evaluation: `megahash eval --text` adds dynamic evaluation at the recipe's eval.dynamic_lr
    assert load_config("configs/compact.yaml").eval.dynamic_lr > 0
    held = tmp_path / "held.txt"
    held.write_text("To be, or not to be: that is the question.\n\nWhether 'tis nobler in the mind to suffer.\n")
    assert cli(["eval", "--checkpoint", str(run), "--text", str(held), "--out", str(tmp_path / "t.json")]) == 0
    rec = json.loads((tmp_path / "t.json").read_text())
    assert rec["dynamic"]["lr"] == load_config("configs/compact.yaml").eval.dynamic_lr and rec["dynamic"]["bpb"] > 0


def test_compact_recipes_batch_fits_their_documented_rank_counts():
    """docs/compact_models.md runs configs/compact.yaml and configs/compact_artifact.yaml with
    ``deepspeed --num_gpus 2``; their global batch of 8 at the quickstart's micro-batch of 8 was refused on 2 ranks
    ("not a multiple of micro_batch_size x data-parallel size = 8 x 2"). Both layouts now build the engine's JSON."""
    from megahash.config import load_config
    from megahash.training.ds_config import deepspeed_config

    for name in ("compact", "compact_artifact"):
        cfg = load_config(f"configs/{name}.yaml")
        assert cfg.train.global_batch_size == 8  # the recipe's batch: the quickstart's tokens at twice the steps
        for ranks in (1, 2):
            ds = deepspeed_config(cfg, dp_size=ranks, bf16=False)
            assert ds["train_micro_batch_size_per_gpu"] * ranks * ds["gradient_accumulation_steps"] == 8, (name, ranks)
