"""The long-run features together on the GPU's path (issue 35 under ``train.precision=bf16``: CPU autocast,
the dtype decisions CUDA autocast makes): a batch-size ramp, the bad-step guard, a profiled window,
asynchronous saves and the hang watchdog in one run, stopped inside the ramp and resumed from an async
checkpoint, equal to the uninterrupted run."""

import json

from test_batch_ramp import RAMP, SCHEDULE, _main, _records

from conftest import TINIER

STEPS = 6
LONG_RUN = [
    "train.precision=bf16",
    "train.step_guard.skip_nonfinite=true",
    "train.step_guard.spike_factor=50",
    "train.step_guard.spike_window=2",
    "train.profile_steps=[2,3]",
    "train.async_save=true",
    "train.save_interval=2",
    "train.watchdog.timeout_s=300",
]


def test_every_long_run_feature_in_bf16_resumes_from_an_async_save_exactly(shakespeare_shards, tmp_path, capsys):
    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    common = [*data, *TINIER, *RAMP, *SCHEDULE, *LONG_RUN, f"train.steps={STEPS}"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    status, out = _main([*common, f"train.save_dir={straight}"], capsys)
    assert status == 0 and "torch.bfloat16" in out, out[-3000:]
    assert (straight / "profile" / "steps_2-3" / "rank0.pt.trace.json").is_file()
    status, out = _main([*common, f"train.save_dir={split}", "train.stop_after=3"], capsys)
    assert status == 0 and "stopped at step 3" in out, out[-3000:]
    state = json.loads((split / "step_00000003" / "megahash_state.json").read_text())
    # an async checkpoint (no DeepSpeed files) holding the ramp's consumed samples and the guard's window
    assert state["deepspeed_files"] is False and state["consumed_samples"] == 2 + 2 + 2
    assert len(state["step_guard"]["window"]) == 2
    status, out = _main([*common, f"train.save_dir={split}"], capsys)
    assert status == 0 and f"resumed from {split}/step_00000003" in out, out[-3000:]

    a, b = _records(straight), _records(split)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert not any(r["skipped"] for r in a.values())  # finite, no spike at 50x: every step applied
    # bit-exact: resume is the promise (same configuration in process, same machine)
    keys = ("loss", "grad_norm", "lr", "consumed_samples", "global_batch")
    assert [[a[s][k] for k in keys] for s in a] == [[b[s][k] for k in keys] for s in b]
