"""Evaluation during training (``eval.interval``, megahash/training/eval_during.py) through the real
DeepSpeed engine on CPU, one rank in process, under ``train.precision=bf16`` with asynchronous saves
(an evaluation starts when its checkpoint is published): one 6-step run with ``eval.interval=2`` and
``train.keep_last=1`` evaluates steps 2, 4 and 6 in ``megahash eval`` child processes on a tiny offline
task (data_tools/make_eval_tasks.py). The child of step 4 fails (planted,
``MEGAHASH_TEST_EVAL_FAIL``): one line, and training goes on. The child of step 2 waits until the
step-6 checkpoint exists (``MEGAHASH_TEST_EVAL_WAIT``), so that keep_last=1 would have pruned step 2
twice over while it was evaluated: it is there when its evaluation ends, and gone after.
An unknown task name is refused in one line before the model is built."""

import json

import pytest

import conftest

TINY = [
    *conftest.TINIER,
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.steps=6",
    "train.save_interval=0",
    "train.keep_last=1",
    "train.precision=bf16",
    "logging.tensorboard=true",
    "train.async_save=true",
    "eval.interval=2",
    "eval.tasks=[shk_order]",
    "eval.batch_size=8",
]


@pytest.fixture(scope="module")
def tasks(shakespeare_shards, tmp_path_factory):
    from megahash.data.preprocess import make_eval_tasks

    d = tmp_path_factory.mktemp("eval_during_tasks")
    assert (
        make_eval_tasks.main(
            [
                "--source",
                "shakespeare",
                "--out",
                str(d),
                "--held-out-docs",
                "1100:",
                "--n",
                "6",
                "--ppl-docs",
                "2",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    return d


def _args(shards, tasks, out_dir):
    return [
        f"data.prefix=[{shards['prefix']}]",
        f"data.tokenizer={shards['tokenizer']}",
        *TINY,
        f"eval.tasks_dir={tasks}",
        f"train.save_dir={out_dir}",
    ]


@pytest.mark.slow  # ~25 CPU-s with the shards fixture, two lm-eval child processes
def test_scores_logged_at_their_steps_pins_and_failures(shakespeare_shards, tasks, tmp_path, capsys, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megahash.pretrain import main
    from megahash.training import eval_during

    out_dir = tmp_path / "run"
    monkeypatch.setenv(eval_during.FAIL_ENV, "4")
    monkeypatch.setenv(eval_during.WAIT_ENV, f"2:{out_dir / 'step_00000006' / 'megahash_state.json'}")
    seen = {}  # step -> the checkpoints on disk when its evaluation ended
    done = eval_during.EvalDuring._done

    def spy(self, step, status):
        seen[step] = sorted(p.name for p in out_dir.glob("step_*"))
        return done(self, step, status)

    monkeypatch.setattr(eval_during.EvalDuring, "_done", spy)
    (out_dir / "eval").mkdir(parents=True)
    (out_dir / "eval" / "step_00000099.pin").write_text("1\n")  # a killed job's pin: removed at the start
    status = main(_args(shakespeare_shards, tasks, out_dir))
    out = capsys.readouterr().out
    assert status == 0, out[-3000:]
    recs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in recs if r["split"] == "eval"}
    assert sorted(evals) == [2, 6]  # the failed step 4 logs nothing
    for step, rec in evals.items():  # the scores of the child's results file, at its step
        res = json.loads((out_dir / "eval" / f"step_{step:08d}.json").read_text())
        assert res["step"] == step and res["model_args"]["precision"] == "bf16"  # the checkpoint's precision
        assert rec["shk_order/acc"] == res["results"]["shk_order"]["acc"] and 0 <= rec["shk_order/acc"] <= 1
        assert rec["consumed_samples"] == 4 * step and rec["eval_s"] > 0
    # step 2's record comes after the step-6 save: it was logged late, at its own step
    order = [(r["split"], r.get("saved_step", r["step"])) for r in recs if r["split"] in ("eval", "checkpoint")]
    assert order.index(("checkpoint", 6)) < order.index(("eval", 2)), order
    acc = EventAccumulator(str(out_dir / "tensorboard"))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("eval/shk_order/acc")} == pytest.approx(
        {s: evals[s]["shk_order/acc"] for s in (2, 6)}, abs=1e-6
    )  # stored as fp32
    # keep_last=1: step 2 stayed while evaluated (steps 4 and 6 saved meanwhile), pruned after
    assert "step_00000002" in seen[2] and "step_00000006" in seen[2], seen
    assert sorted(p.name for p in out_dir.glob("step_*")) == ["step_00000006"]
    assert not list((out_dir / "eval").glob("*.pin"))
    failed = [line for line in out.splitlines() if "evaluation of step 4" in line]
    assert len(failed) == 1 and "failed" in failed[0] and "planted failure" in failed[0], out[-3000:]
    assert "training goes on" in failed[0]
    assert any(r["split"] == "train" and r["step"] == 6 for r in recs)  # training went on to the end


def test_unknown_task_is_refused_before_the_model(shakespeare_shards, tasks, tmp_path, capsys):
    from megahash.pretrain import main

    status = main(_args(shakespeare_shards, tasks, tmp_path / "bad") + ["eval.tasks=[shk_ordr]"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(err) == 1 and "unknown task 'shk_ordr'" in err[0], err
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie is dead (reaped by whoever adopted it)
    except FileNotFoundError:
        return False


def test_the_evaluation_is_killed_at_close_and_dies_with_the_trainer(tmp_path, monkeypatch, capsys):
    """No training: the child of :meth:`EvalDuring._start` held before it evaluates
    (``MEGAHASH_TEST_EVAL_WAIT`` on a file that never comes). ``close`` (a stop or an error) kills it
    and unpins its checkpoint; a trainer killed with SIGKILL takes it along (PR_SET_PDEATHSIG)."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    from conftest import ROOT, child_env
    from megahash.training import eval_during

    monkeypatch.setenv(eval_during.WAIT_ENV, f"2:{tmp_path / 'never'}")
    setup = textwrap.dedent(f"""
        import types
        from megahash.training import eval_during
        ns = types.SimpleNamespace
        cfg = ns(eval=ns(interval=2, tasks=["t"], tasks_dir="", trust_task_code=False, batch_size=1, wait_s=0.0),
                 train=ns(save_dir={str(tmp_path)!r}, keep_last=1), data=ns(seq_length=8))
        ev = eval_during.EvalDuring(cfg, None, 0, lambda step: step)
        ev.dir.mkdir(parents=True, exist_ok=True)
    """)
    ns = {}
    exec(setup, ns)
    ev = ns["ev"]
    ev.after_save(2)  # due: pinned; the checkpoint is not there (yet): nothing started
    assert ev.running == {2: None} and eval_during.pin_path(tmp_path, "step_00000002").is_file()
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000002" / "megahash_state.json").write_text("{}")
    ev.poll()  # published: started
    proc = ev.running[2]
    assert proc is not None and proc.poll() is None
    ev.close()
    assert proc.returncode == -signal.SIGKILL and ev.running == {}
    assert not eval_during.pin_path(tmp_path, "step_00000002").exists()
    assert "evaluation of step 2 stopped unfinished" in capsys.readouterr().out
    # a trainer killed with SIGKILL: its evaluation goes too
    parent = subprocess.Popen(
        [sys.executable, "-c", setup + "print(ev._start(2).pid, flush=True)\nimport time; time.sleep(300)\n"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(**{eval_during.WAIT_ENV: f"2:{tmp_path / 'never'}"}),
    )
    child = int(parent.stdout.readline())
    time.sleep(1.0)  # the child is past its start-up (its PR_SET_PDEATHSIG set, or it sees its parent gone)
    assert _alive(child)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 30
    while _alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the evaluation outlived its trainer"
