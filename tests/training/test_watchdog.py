"""Hang watchdog (issue 35, megahash/training/watchdog.py): its limits on a fake clock, the stack dump
and requeue exit of a real in-process run whose step is made slow, a peer's hang turning a failed
collective into the requeue exit, and the config checks. The SLURM test (one rank of two stopped
with SIGSTOP, the job requeued and resumed) is in tests/launching/test_slurm.py (it shares the cluster)."""

import os
import re
import threading
import time

import pytest

import conftest
from megahash.errors import ConfigError
from megahash.training import watchdog as wd
from megahash.training.signals import EXIT_REQUEUE

TINY = [*conftest.TINY, "train.eval_interval=0"]


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_limits_on_a_fake_clock(tmp_path, capsys):
    """limit = min(timeout_s, factor x median of the timed steps): the first step of a process
    is never timed, the factor rule waits for WARMUP_STEPS timed steps, validation/saves after a step
    are held to timeout_s alone; when the limit is passed: the stacks, one line, exit 3."""
    clock, exits = FakeClock(), []
    w = wd.HangWatchdog(30, 3, rank=1, save_dir=tmp_path, clock=clock, exit=exits.append)
    assert not w.check()  # nothing watched before the first step
    durations = [20.0, 1.0, 2.0, 1.5]  # the first (compilation) is not timed: median of 1, 2, 1.5 = 1.5
    for step, dt in enumerate(durations):
        w.step_started(step)
        if step < wd.WARMUP_STEPS:
            assert w.limit()[0] == 30  # warm-up: the absolute rule only
        clock.now += dt
        assert not w.check()
        w.step_ended()
    assert list(w.times) == durations[1:]
    clock.now += 25  # a long save: the factor rule does not apply outside a step
    assert w.limit() == (30, "train.watchdog.timeout_s=30") and not w.check()
    w.step_started(4)
    assert w.limit() == (4.5, "train.watchdog.factor=3 x median step 1.5 s")
    clock.now += 4.4
    assert not w.check() and not exits
    clock.now += 0.2
    assert w.check() and exits == [EXIT_REQUEUE]
    out = capsys.readouterr()
    report = tmp_path / "hang" / "rank1.txt"
    assert out.out.strip() == (
        f"megahash: rank 1 hung at step 5 for 4.6 s (train.watchdog.factor=3 x median step "
        f"1.5 s); stacks in {report}; exiting for requeue"
    )
    text = report.read_text()
    assert text.startswith("rank 1 hung at step 5 for 4.6 s") and text.splitlines()[1:] == out.err.splitlines()[1:]
    assert "test_limits_on_a_fake_clock" in text  # faulthandler's dump names this frame
    off = wd.HangWatchdog(0, 0, rank=0, save_dir=tmp_path)
    assert not off.enabled and off.start()._thread is None


def test_peer_hang_turns_a_failed_collective_into_requeue(tmp_path, monkeypatch):
    """A collective that fails because a peer's watchdog ended its process: exit 3 when that peer's
    report is newer than this process; any other error (or an old report) stays an error."""
    monkeypatch.setattr(wd, "PEER_WAIT_S", 0.3)
    w = wd.HangWatchdog(10, 0, rank=0, save_dir=tmp_path)
    (tmp_path / "hang").mkdir()
    old = tmp_path / "hang" / "rank1.txt"
    old.write_text("an earlier run's hang")
    os.utime(old, (w.started - 3600, w.started - 3600))
    with pytest.raises(RuntimeError), w.requeue_after_peer_hang():
        raise RuntimeError("Connection closed by peer")
    old.write_text("rank 1 hung at step 7")  # now
    with pytest.raises(SystemExit) as e, w.requeue_after_peer_hang():
        raise RuntimeError("Connection closed by peer")
    assert e.value.code == EXIT_REQUEUE
    with pytest.raises(RuntimeError), wd.HangWatchdog(0, 0, 0, tmp_path).requeue_after_peer_hang():  # off
        raise RuntimeError("Connection closed by peer")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.watchdog.factor=0.5"], "train.watchdog.factor=0.5 must be > 1"),
        (
            ["train.watchdog.timeout_s=600"],
            "train.watchdog.timeout_s=600 must be below train.distributed_timeout_s=600",
        ),
        (["train.watchdog.timeout_s=-1"], "config key 'train.watchdog.timeout_s' must be >= 0.0"),
    ],
)
def test_config_checks(overrides, message):
    from megahash.config import load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_slow_step_of_a_real_run_dumps_stacks(shakespeare_shards, tmp_path, monkeypatch, capsys):
    """In-process tiny run (real DeepSpeed engine, 1 gloo rank, the trainer's hooks and the watchdog's
    own thread) with train.watchdog.timeout_s=300 whose 4th step blocks and moves the watchdog's clock 301 s
    on (no long sleep, and no flake on a loaded machine): the watchdog fires during that step, the
    dump shows the main thread inside the blocked step, exit status 3 requested. The test's exit
    only releases the step (os._exit is the SLURM test's), so the run then finishes."""
    from megahash.pretrain import main
    from megahash.training import trainer

    released, exits, calls, real_step = threading.Event(), [], [], trainer.train_step
    skew = [0.0]

    def slow_train_step(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            skew[0] += 301.0
            assert released.wait(60), "the watchdog did not fire"
        return real_step(*a, **k)

    def fake_exit(status):
        exits.append((status, len(calls)))
        released.set()

    monkeypatch.setattr(trainer, "train_step", slow_train_step)
    monkeypatch.setattr(
        wd,
        "watchdog_for",
        lambda t, rank: wd.HangWatchdog(
            t.watchdog.timeout_s,
            t.watchdog.factor,
            rank,
            t.save_dir,
            clock=lambda: time.monotonic() + skew[0],
            exit=fake_exit,
            poll_s=0.05,
        ).start(),
    )
    save = tmp_path / "run"
    status = main(
        [
            f"data.prefix=[{shakespeare_shards['prefix']}]",
            f"data.tokenizer={shakespeare_shards['tokenizer']}",
            *TINY,
            "train.steps=5",
            f"train.save_dir={save}",
            "train.watchdog.timeout_s=300",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0 and exits == [(EXIT_REQUEUE, 4)], out
    m = re.search(
        r"megahash: rank 0 hung at step 4 for ([\d.]+) s \(train.watchdog.timeout_s=300\); stacks in (\S+); "
        r"exiting for requeue",
        out,
    )
    assert m and 301 <= float(m.group(1)) < 400 and m.group(2) == str(save / "hang" / "rank0.txt"), out
    text = (save / "hang" / "rank0.txt").read_text()
    assert "in slow_train_step" in text and "in _train_step_logged" in text and "in _loop" in text, text
    assert "in fire" in text and "in _run" in text  # the watchdog thread's own stack (the current one)
