"""Sequence-length warm-up (``train.seq_warmup``, megahash/training/seq_warmup.py): the length of every step
against DeepSpeed's fixed_linear seqlen rule written out here; bad settings one line; a truncated batch of packed
documents equals the fields the truncated tokens give; a run stopped inside the warm-up (with the batch ramp,
gradient accumulation and packed documents, fp32 and bf16) and resumed equals the uninterrupted run bit-exactly,
logging each step's length and the tokens trained on. One rank in this process through the pretraining entry point."""

from __future__ import annotations

import math

import pytest
from test_batch_ramp import _main, _records

from conftest import TINIER, eager_backend_model
from megahash.config import load_config
from megahash.errors import ConfigError

RAMP = ["train.micro_batch_size=2", "train.global_batch_size=8", "train.batch_ramp=[2,2,24]"]
WARMUP = ["train.seq_warmup.steps=6", "train.seq_warmup.start=8", "train.seq_warmup.multiple=8"]
STEPS = 10


def expected_length(s: int, start: int, seq: int, steps: int, m: int) -> int:
    """DeepSpeed's fixed_linear seqlen difficulty (curriculum_scheduler.py), at 0-based step s, written out:
    floor(start + (seq - start) s / steps) rounded down to a multiple of m, not below start, not above seq."""
    if s >= steps:
        return seq
    x = math.floor(start + (seq - start) * s / steps)
    return min(seq, max(start, x - x % m))


@pytest.mark.parametrize("start, seq, steps, m", [(8, 32, 6, 8), (16, 128, 10, 8), (64, 1000, 37, 16), (4, 4, 3, 4)])
def test_lengths_follow_deepspeeds_linear_rule(start, seq, steps, m):
    from megahash.training.seq_warmup import length_at

    w = load_config(
        None,
        [
            f"data.seq_length={seq}",
            f"model.max_position_embeddings={max(seq, 64)}",
            f"train.seq_warmup.steps={steps}",
            f"train.seq_warmup.start={start}",
            f"train.seq_warmup.multiple={m}",
        ],
    ).train.seq_warmup
    got = [length_at(w, seq, s) for s in range(steps + 5)]
    assert got == [expected_length(s, start, seq, steps, m) for s in range(steps + 5)]
    assert got[0] == start and got[steps:] == [seq] * 5 and got == sorted(got)
    assert all(n % m == 0 for n in got[:steps] if n < seq)


@pytest.mark.parametrize(
    "overrides, expect",
    [
        (["train.seq_warmup.start=64"], "train.seq_warmup.start=64 exceeds data.seq_length=32"),
        (["train.seq_warmup.start=12"], "train.seq_warmup.start=12 is not a multiple of train.seq_warmup.multiple=8"),
        (
            ["parallel.tensor=2", "parallel.sequence=true", "train.seq_warmup.multiple=3", "train.seq_warmup.start=9"],
            "train.seq_warmup.multiple=3 must be a multiple of parallel.tensor=2 under sequence parallelism",
        ),
        (["train.seq_warmup.multiple=0"], "train.seq_warmup.multiple"),
    ],
)
def test_bad_warmup_is_one_line(overrides, expect):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*TINIER, "train.seq_warmup.steps=4", *overrides])
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_truncated_packed_batch_is_the_batch_of_the_truncated_tokens():
    """Document ids, positions and the EOD loss mask of the first L tokens == those fields cut to L; every
    field cut along the sequence (hash codes [b, s, k] too)."""
    import torch

    from megahash.data import documents
    from megahash.training.trainer import truncated

    data = load_config(
        None, ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true"]
    ).data
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (3, 32), generator=g)  # eod 2: several documents a row
    batch = {"tokens": tokens, "labels": tokens.roll(-1, 1), "hash_codes": torch.randint(0, 9, (3, 32, 4))}
    batch.update(documents.sample_fields(tokens, torch.ones(3, 32), data, eod=2))
    cut = truncated(batch, 8)
    fresh = documents.sample_fields(tokens[:, :8], torch.ones(3, 8), data, eod=2)
    assert set(cut) == set(batch) and all(v.shape[:2] == (3, 8) for v in cut.values())
    # bit-exact: integer and mask tensors, cut or computed from the same integers
    assert cut["hash_codes"].shape == (3, 8, 4) and torch.equal(cut["hash_codes"], batch["hash_codes"][:, :8])
    for k, v in fresh.items():
        assert torch.equal(cut[k], v), k  # bit-exact: integer ids and 0/1 masks
    assert truncated(batch, 32) is batch and truncated(batch, None) is batch


def test_compiled_layers_run_the_warmup_eagerly_and_compile_the_full_length_once(dist, monkeypatch):
    """train.compile with a warm-up: the layers compile with static shapes, so every warm-up length was a graph of its
    own, and past dynamo's recompile limit (12 here: 2 layers, 2 shapes) the layers ran eagerly for the rest of
    the run, the full length too. Now the steps shorter than data.seq_length run eagerly and the full length is the
    one graph (dynamo's own accounting, with its eager backend for speed; over the limit it raises here)."""
    from types import SimpleNamespace

    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from megahash.training.seq_warmup import SeqWarmup
    from megahash.training.trainer import compile_layers

    seq = 128
    cfg = load_config(
        None,
        [
            *TINIER,
            "model.num_layers=2",
            f"data.seq_length={seq}",
            f"model.max_position_embeddings={seq}",
            "train.compile=true",
            "train.seq_warmup.steps=16",
            "train.seq_warmup.start=8",
            "train.seq_warmup.multiple=8",
        ],
    )
    model = eager_backend_model(monkeypatch, cfg)
    tokens = torch.randint(5, 128, (2, seq), generator=torch.Generator().manual_seed(0))
    hook, run, lengths = SeqWarmup(), SimpleNamespace(cfg=cfg, step=0, seq_length=None), []
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        compile_layers(model, shapes=2)
        for step in range(18):
            run.step = step
            hook.before_step(run)
            lengths.append(run.seq_length)
            with hook.micro_batch(run):
                cut = tokens[:, : run.seq_length]
                model(cut, labels=cut).mean().backward()
    assert sorted(set(lengths)) == list(range(8, seq + 1, 8)) and lengths[-2:] == [seq, seq]  # 15 warm-up lengths
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_inside_the_warmup_equals_the_uninterrupted_run(shakespeare_shards, tmp_path, capsys, precision):
    """10 steps with the warm-up 8 -> 32 over 6 steps, the batch ramp 2 -> 8 (1 to 4 accumulation steps) and
    packed documents == 3 steps, stop, resume for 7 (bit-exact: losses, gradient norms, weights); each step's
    logged length is the rule's, ``trained_tokens`` the sum of batch x length, ``consumed_tokens`` the samples
    read x 32; a run without the warm-up trains otherwise (its first loss differs)."""
    import torch

    from megahash.data.samples import consumed_samples, step_batch

    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    docs = ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true"]
    common = [*data, *TINIER, *RAMP, *docs, f"train.precision={precision}", f"train.steps={STEPS}"]
    straight, split, plain = tmp_path / "straight", tmp_path / "split", tmp_path / "plain"
    status, out = _main([*common, *WARMUP, f"train.save_dir={straight}"], capsys)
    assert status == 0, out[-3000:]
    status, out = _main([*common, *WARMUP, f"train.save_dir={split}", "train.stop_after=3"], capsys)
    assert status == 0 and "stopped at step 3" in out, out[-3000:]
    status, out = _main([*common, *WARMUP, f"train.save_dir={split}"], capsys)
    assert status == 0 and f"resumed from {split}/step_00000003" in out, out[-3000:]
    status, out = _main([*common, f"train.save_dir={plain}", "train.steps=1"], capsys)
    assert status == 0, out[-3000:]

    a, b, p = _records(straight), _records(split), _records(plain)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    t = load_config(None, [*TINIER, *RAMP, *WARMUP, f"train.steps={STEPS}"]).train
    lengths = [expected_length(s, 8, 32, 6, 8) for s in range(STEPS)]
    assert lengths == [8, 8, 16, 16, 24, 24, 32, 32, 32, 32]
    trained = 0
    for s in range(1, STEPS + 1):
        trained += step_batch(t, s - 1) * lengths[s - 1]
        assert a[s]["seq_length"] == lengths[s - 1] and a[s]["trained_tokens"] == trained, s
        assert a[s]["consumed_tokens"] == consumed_samples(t, s) * 32, s
    assert a[1]["loss"] != p[1]["loss"]  # the first step trained on 8 of the 32 tokens
    keys = ("loss", "grad_norm", "param_norm", "lr", "consumed_samples", "seq_length", "trained_tokens")
    assert [[a[s][k] for k in keys] for s in a] == [[b[s][k] for k in keys] for s in b]  # bit-exact: resume
    one, two = (
        torch.load(d / "step_00000010" / "mp_rank_00_model_states.pt", weights_only=False) for d in (straight, split)
    )
    weights = {k: v for k, v in one["module"].items() if torch.is_tensor(v)}
    # bit-exact: resume inside the warm-up is the promise (same path, same machine)
    assert len(weights) > 5 and all(torch.equal(v, two["module"][k]) for k, v in weights.items())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tensor_and_sequence_parallel_warmup_equals_one_rank(shakespeare_shards, tmp_path, capsys):
    """The warm-up at TP 2 with sequence parallelism (each rank holding L / 2 positions of every length) gives one
    rank's per-step losses (fp32, dropout 0) to 1e-4, as tests/training/test_training.py's TP/SP parity, and the
    same lengths."""
    from conftest import pretrain_group

    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    common = [*data, *TINIER, *WARMUP, "train.steps=7", "train.eval_interval=0"]
    (r,) = pretrain_group(
        [[*common, "parallel.tensor=2", "parallel.sequence=true", f"train.save_dir={tmp_path / 'tp2sp'}"]]
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    status, out = _main([*common, f"train.save_dir={tmp_path / 'tp1'}"], capsys)
    assert status == 0, out[-3000:]
    a, b = _records(tmp_path / "tp1"), _records(tmp_path / "tp2sp")
    assert [a[s]["seq_length"] for s in a] == [b[s]["seq_length"] for s in b] == [8, 8, 16, 16, 24, 24, 32]
    assert all(abs(a[s]["loss"] - b[s]["loss"]) < 1e-4 for s in a), (a, b)
