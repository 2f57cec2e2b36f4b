"""Comparable numbers: the validation set is fixed by the data config alone (same sequences,
same loss for the same weights whatever the DP size, train.steps or micro-batch size), and the
logged LR is the LR the step used (closed form of the schedule)."""

import json
import math

import pytest

from conftest import TINY, pretrain_group, pretrain_here, train_losses
from megahash.data.validation import batch_sizes, chunks_for_rank, rounds_for_rank

COMMON = [
    *TINY,
    "train.min_lr=2e-4",
    "train.warmup_steps=2",
    "train.decay_steps=20",
    "train.eval_interval=5",
    "train.log_interval=5",
    "data.valid_samples=40",
    "data.valid_micro_batch=8",
]


def _records(run_dir, split):
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["split"] == split:
            out[rec["step"]] = rec
    return out


def test_chunks_partition_the_same_set():
    for dp in (1, 2, 3, 4):
        ids = sorted(i for r in range(dp) for _, c in chunks_for_rank(37, 8, r, dp) for i in c)
        assert ids == list(range(37))


def test_batch_sizes_are_the_chunks_validation_runs():
    """The batch sizes a compiled model meets in validation (trainer.compile_layers counts a graph per size): the
    sizes of the chunks every rank evaluates, the last shorter chunk included; a set of fewer samples than a chunk."""
    from types import SimpleNamespace

    for n, chunk in ((40, 8), (37, 8), (5, 8), (8, 8), (1, 1)):
        cfg = SimpleNamespace(valid_samples=n, valid_micro_batch=chunk)
        walked = {len(c) for dp in (1, 3) for r in range(dp) for _, c in chunks_for_rank(n, chunk, r, dp)}
        assert batch_sizes(range(100), cfg) == walked, (n, chunk)
    assert batch_sizes(None, SimpleNamespace(valid_samples=8, valid_micro_batch=8)) == set()


def test_every_rank_runs_as_many_forward_passes():
    """Under ZeRO-3 a forward pass is a collective: every data-parallel rank runs the same number, the
    counted ones still partition the set, and a rank without a chunk of its own (fewer chunks than ranks)
    runs stand-ins that count for nothing."""
    for n, chunk, dp in ((37, 8, 3), (8, 8, 2), (24, 8, 2), (64, 8, 16), (5, 8, 4)):
        rounds = [rounds_for_rank(n, chunk, r, dp) for r in range(dp)]
        chunks = math.ceil(n / chunk)
        assert [len(r) for r in rounds] == [math.ceil(chunks / dp)] * dp, (n, chunk, dp, rounds)
        counted = sorted(i for r in rounds for _, ids, c in r if c for i in ids)
        assert counted == list(range(n))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_zero3_validates_with_a_rank_that_has_no_chunk(shakespeare_shards, tmp_path):
    """8 validation sequences are one chunk: at 2 ranks rank 1 has none. Under ZeRO-3 it sat in the
    all-reduce of the sums while rank 0's forward waited for it in the parameter all-gather, forever
    (first validation of the run). Now it runs the chunk as an uncounted stand-in: the run ends, and its
    validation loss is ZeRO-1's (the same weights) over the same 8 sequences."""
    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    common = [*data, *TINY, "train.steps=2", "data.valid_samples=8", "data.valid_micro_batch=8"]
    dirs = {z: tmp_path / f"zero{z}" for z in (1, 3)}
    runs = [[*common, f"train.zero_stage={z}", f"train.save_dir={d}"] for z, d in dirs.items()]
    for r in pretrain_group(runs, timeout=300):
        assert r.returncode == 0, r.stderr[-3000:]
    v1, v3 = (_records(d, "valid")[2] for d in dirs.values())
    assert v1["sequences"] == v3["sequences"] == 8 and v1["tokens"] == v3["tokens"] == 8 * 64
    assert abs(v1["loss"] - v3["loss"]) < 1e-5, (v1, v3)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_validation_fixed_across_dp_steps_and_batch(shakespeare_shards, tmp_path):
    """1 rank x 10 steps (micro-batch 4) and 2 ranks x 20 steps (micro-batch 2, 2 accumulation
    steps): same validation loss at steps 5 and 10, on the same number of tokens, same weights."""
    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    a, b = tmp_path / "dp1_10", tmp_path / "dp2_20"
    ra = pretrain_here(data + COMMON + ["train.steps=10", "train.micro_batch_size=4", f"train.save_dir={a}"])
    assert ra.returncode == 0, ra.stderr[-3000:]
    (rb,) = pretrain_group(
        [
            data
            + COMMON
            + ["train.steps=20", "train.micro_batch_size=2", "train.save_interval=10", f"train.save_dir={b}"]
        ]
    )
    assert rb.returncode == 0, rb.stderr[-3000:]
    va, vb = _records(a, "valid"), _records(b, "valid")
    assert sorted(va) == [5, 10] and sorted(vb) == [5, 10, 15, 20]
    for step in (5, 10):
        assert abs(va[step]["loss"] - vb[step]["loss"]) < 2e-5, (step, va[step], vb[step])
        assert va[step]["sequences"] == vb[step]["sequences"] == 40
        assert va[step]["tokens"] == vb[step]["tokens"] == 40 * 64  # every position of 40 full sequences
    ta, tb = train_losses(a), train_losses(b)
    assert all(abs(ta[s] - tb[s]) < 1e-4 for s in range(1, 11))
    # the logged LR is the one the step used: step s (1-based) ran with the schedule's LR of s - 1
    lrs = {s: rec["lr"] for s, rec in _records(b, "train").items()}
    assert abs(lrs[1] - 2e-3 / 2) < 1e-12 and abs(lrs[2] - 2e-3) < 1e-12
    assert abs(lrs[12] - (2e-4 + 1.8e-3 * 0.5)) < 1e-12  # cosine half way: 0-based step 11 = (2 + 20) / 2
    assert lrs[20] > 2e-4 and _records(a, "train")[10]["lr"] == lrs[10]  # decay length 20, not train.steps
    # progress and logging (same runs): step/total + ETA lines from rank 0 only (no TTY here),
    # consumed tokens/samples every step, parameter norm and peak memory at log intervals
    assert sum(l.startswith("[train] step 5/20 ") for l in rb.stdout.splitlines()) == 1, rb.stdout[-2000:]
    assert " eta " in next(l for l in rb.stdout.splitlines() if l.startswith("[train] step 5/20 "))
    assert "[valid] step 5/10 loss" in ra.stdout and "Transformer Engine and Apex" not in rb.stdout + rb.stderr
    tra, trb = _records(a, "train"), _records(b, "train")
    assert trb[7]["consumed_samples"] == 7 * 8 and trb[7]["consumed_tokens"] == 7 * 8 * 64
    assert "param_norm" not in trb[7] and trb[10]["peak_memory_mib"] > 50
    for step in (5, 10):  # the same parameters give the same norm at DP 1 and 2
        assert abs(tra[step]["param_norm"] - trb[step]["param_norm"]) < 1e-4 * trb[step]["param_norm"]
    assert vb[10]["consumed_tokens"] == 10 * 8 * 64
    import torch

    from megahash.accelerator import process_groups
    from megahash.checkpoint.weights import load_for_inference

    sds = []
    for d in (a / "step_00000010", b / "step_00000010"):
        try:
            _, m, _ = load_for_inference(d)
            sds.append(
                {k: v.clone() for k, v in m.state_dict().items() if torch.is_tensor(v) and v.is_floating_point()}
            )
        finally:
            process_groups.teardown()
    # fp32 sums in another order (2 ranks, 2 accumulation steps), through Adam
    assert max((sds[0][k] - sds[1][k]).abs().max().item() for k in sds[0]) < 5e-5
