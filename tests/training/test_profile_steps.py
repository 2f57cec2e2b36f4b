"""``train.profile_steps`` (issue 35 item 3): ``torch.profiler`` traces of chosen steps of the real run
(megahash/training/profile_steps.py). One in-process run through the DeepSpeed engine on CPU checks the
trace file (Chrome-trace JSON, the model's operators, the steps of the window only) and the phase
table; the CUDA parts (memory history, snapshots, the out-of-memory dump) are checked by the
accelerator's choice for a named CUDA device and on a stand-in recorder."""

import json
from types import SimpleNamespace

import pytest
import torch

import conftest
from megahash.accelerator import measurement
from megahash.training import profile_steps

TINY = [
    *conftest.TINY,
    "data.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.warmup_steps=1",
    "train.eval_interval=0",
]


def _events(trace: dict, name: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("name") == name and e.get("ph") == "X"]


def test_profiled_window_of_a_real_run(shakespeare_shards, tmp_path, capsys):
    """Steps 2-3 of 4 (two micro-batches each): one trace for rank 0, Chrome-trace JSON naming the
    GEMMs and the step's phases; every phase range lies inside step 2 or 3 (steps 1 and 4 untraced);
    rank 0 prints the phase and top-op tables; the profiler is off after the window."""
    from megahash.pretrain import main

    save = tmp_path / "run"
    status = main(
        [
            f"data.prefix=[{shakespeare_shards['prefix']}]",
            f"data.tokenizer={shakespeare_shards['tokenizer']}",
            *TINY,
            "train.steps=4",
            "train.profile_steps=[2,3]",
            f"train.save_dir={save}",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    files = sorted(p.relative_to(save / "profile").as_posix() for p in (save / "profile").rglob("*") if p.is_file())
    assert files == ["steps_2-3/rank0.pt.trace.json"]  # no memory snapshot on CPU
    trace = json.loads((save / "profile" / "steps_2-3" / "rank0.pt.trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert names & {"aten::mm", "aten::addmm"}, sorted(names)[:50]
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names
    assert not names & {"ProfilerStep#1", "ProfilerStep#4"}
    steps = [(e["ts"], e["ts"] + e["dur"]) for n in (2, 3) for e in _events(trace, f"ProfilerStep#{n}")]
    assert len(steps) == 2
    for p in ("data", "forward", "backward", "optimizer"):
        ranges = _events(trace, f"megahash/{p}")
        assert len(ranges) == 4, p  # 2 steps x 2 micro-batches
        assert all(any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in steps) for e in ranges), p
    assert "megahash: profiled 2 step(s)" in out and "| forward |" in out and "| step |" in out
    assert "| step | 0.0 |" not in out and "| step |" in out.split("| optimizer |")[1], out[-3000:]
    assert "| aten::" in out, out[-3000:]
    assert not torch.autograd._profiler_enabled() and profile_steps.phase("forward") is profile_steps._NULL
    assert [
        json.loads(line)["step"]
        for line in (save / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["split"] == "train"
    ] == [1, 2, 3, 4]  # every step logged, profiled or not


@pytest.mark.parametrize(
    "value, why",
    [
        ("[0,2]", "within 1..train.steps=4"),
        ("[3,5]", "within 1..train.steps=4"),
        ("[3,2]", "end >= start"),
        ("[2]", "two step numbers"),
    ],
)
def test_bad_window_is_one_line_exit_2(tmp_path, capsys, value, why):
    from megahash.pretrain import main

    status = main(
        [
            "--config",
            "configs/quickstart.yaml",
            "train.steps=4",
            f"train.save_dir={tmp_path / 'run'}",
            f"train.profile_steps={value}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error: ") and "train.profile_steps" in err[0], err
    assert why in err[0] and not (tmp_path / "run").exists()


def test_accelerator_picks_the_cuda_branch_for_a_cuda_device(monkeypatch, tmp_path):
    """Named "cuda", the accelerator traces CUDA kernels and records / dumps the caching allocator's
    history (torch.cuda.memory's private API, replaced by a recorder here); on CPU it does nothing."""
    from torch.profiler import ProfilerActivity

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    assert measurement.profiler_activities("cuda") == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    assert measurement.profiler_activities("cpu") == [ProfilerActivity.CPU]
    assert not measurement.record_memory_history(True, "cpu") and not measurement.dump_memory_snapshot(
        tmp_path / "x", "cpu"
    )
    assert calls == []
    assert measurement.record_memory_history(True, "cuda:0")
    assert measurement.dump_memory_snapshot(tmp_path / "d" / "rank0.memory.pickle", torch.device("cuda"))
    assert measurement.record_memory_history(False, "cuda")
    n = measurement.MEMORY_HISTORY_ENTRIES
    assert calls == [
        ("record", {"enabled": "all", "max_entries": n}),
        ("dump", str(tmp_path / "d" / "rank0.memory.pickle")),
        ("record", {"enabled": None, "max_entries": n}),
    ]
    assert (tmp_path / "d").is_dir()


def test_memory_snapshot_of_the_window_and_dump_on_out_of_memory(monkeypatch, tmp_path):
    """With the accelerator answering as on a CUDA device: the allocator's history is recorded over
    the window only and dumped beside the trace; an out-of-memory error in a step dumps the state
    under oom_step_N and is raised again; a run stopped inside the window still writes its steps."""
    calls = []
    monkeypatch.setattr(measurement, "record_memory_history", lambda on, dev=None: calls.append(("record", on)) or True)
    monkeypatch.setattr(
        measurement, "dump_memory_snapshot", lambda path, dev=None: calls.append(("dump", path)) or True
    )
    cfg = SimpleNamespace(train=SimpleNamespace(profile_steps=[2, 4], save_dir=str(tmp_path)))
    lines = []
    prof = profile_steps.StepProfiler(cfg, 0, lines.append)
    model = torch.nn.Linear(8, 8)
    for n in (1, 2, 3):  # stopped after step 3 of the window 2-4
        if n == 2:
            assert calls == []  # nothing before the window
        with prof.step(n):
            with profile_steps.phase("forward"):
                model(torch.randn(4, 8)).sum().backward()
    assert calls == [("record", True)]
    prof.close()
    window = tmp_path / "profile" / "steps_2-3"
    assert calls == [("record", True), ("dump", window / "rank0.memory.pickle"), ("record", False)]
    assert (window / "rank0.pt.trace.json").is_file() and "| forward |" in lines[0]
    calls.clear()
    with pytest.raises(torch.OutOfMemoryError), prof.step(7):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    assert calls == [("dump", tmp_path / "profile" / "oom_step_7" / "rank0.memory.pickle")]
