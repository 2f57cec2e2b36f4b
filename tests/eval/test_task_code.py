"""Task files that would run Python are refused without ``--trust-task-code`` (issue 47 item 6;
megahash/eval/task_code.py). A copy of the generated Shakespeare suite (data_tools/make_eval_tasks.py,
which needs no flag) gets one hostile change per case: ``!function`` with a ``utils.py`` beside the YAML,
``!function os.system``, a ``class``, an ``include`` of a file elsewhere that has one, a metric lm-eval
would hand to Hugging Face ``evaluate`` (a local script), a template reaching ``__globals__``, one
building that name at render time (only Jinja's sandbox sees it), a ``!function`` in a UTF-16 file, a file
that is not YAML. ``megahash eval`` exits 2 with one line
naming the file (where it can be known before running) and the flag; the marker file every payload would
create stays absent; with the flag the task's code runs, as the flag says."""

from __future__ import annotations

import os
import shutil

import pytest
import yaml

from conftest import TINIER, pretrain

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMALL = [*TINIER, "train.micro_batch_size=2", "train.global_batch_size=2"]


@pytest.fixture(scope="module")
def suite(shakespeare_shards, tmp_path_factory):
    from megahash.data.preprocess import make_eval_tasks

    d = tmp_path_factory.mktemp("task_code")
    r = pretrain(
        [
            f"data.prefix=[{shakespeare_shards['prefix']}]",
            f"data.tokenizer={shakespeare_shards['tokenizer']}",
            *SMALL,
            "train.steps=1",
            f"train.save_dir={d / 'run'}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    args = ["--source", "shakespeare", "--out", str(d / "tasks"), "--held-out-docs", "1100:", "--n", "4"]
    assert make_eval_tasks.main([*args, "--ppl-docs", "2", "--seed", "7"]) == 0
    return {"run": d / "run", "tasks": d / "tasks"}


def _eval(suite, tasks_dir, capsys, *extra) -> tuple[int, list[str]]:
    from megahash.cli import main

    argv = ["eval", "--checkpoint", str(suite["run"]), "--tasks", "shk_order", "--tasks-dir", str(tasks_dir)]
    status = main([*argv, "--limit", "2", "--batch-size", "2", "--overwrite", *extra])
    err = capsys.readouterr().err
    return status, [l for l in err.strip().splitlines() if l.startswith("error:")]


def _hostile(suite, tmp_path, name: str, marker) -> tuple:
    """A copy of the suite with shk_order.yaml changed as case ``name`` says; (dir, file named in the error)."""
    d = tmp_path / name
    shutil.copytree(suite["tasks"], d)
    task = d / "shk_order.yaml"
    cfg = yaml.safe_load(task.read_text())
    touch = f"open({str(marker)!r}, 'w').close()"
    (d / "utils.py").write_text(f"{touch}\n\ndef process_docs(ds):\n    {touch}\n    return ds\n")
    body = yaml.safe_dump(cfg, sort_keys=False)
    named = task
    if name == "function":
        body += "process_docs: !function utils.process_docs\n"
    elif name == "os_system":
        body += "doc_to_decontamination_query: !function os.system\n"
    elif name == "class":
        body = "task: shk_order\nclass: !function utils.process_docs\n"
    elif name == "include":
        outside = tmp_path / f"{name}_elsewhere" / "base.yaml"
        outside.parent.mkdir()
        (outside.parent / "utils.py").write_text((d / "utils.py").read_text())
        outside.write_text("process_docs: !function utils.process_docs\n")
        body += f"include: {outside}\n"
        named = outside
    elif name == "evaluate_metric":
        (d / "metric.py").write_text(touch + "\n")
        cfg["metric_list"] = [{"metric": str(d / "metric.py"), "aggregation": "mean", "higher_is_better": True}]
        body = yaml.safe_dump(cfg, sort_keys=False)
    elif name == "template":
        cfg["doc_to_text"] = "{{ lipsum.__globals__['os'].system('touch " + str(marker) + "') }}{{ctx}}"
        body = yaml.safe_dump(cfg, sort_keys=False)
    elif name == "utf16":  # lm-eval's libyaml reads UTF-16 with a BOM; read as UTF-8 it was passed over and ran
        task.write_bytes((body + "process_docs: !function utils.process_docs\n").encode("utf-16"))
        return d, named
    elif name == "unreadable":  # YAML this check cannot parse is not known to be free of code: refused too
        body += "process_docs: !function utils.process_docs\nbad: [unclosed\n"
    elif name == "template_at_render":
        cfg["doc_to_text"] = "{{ lipsum['__glo' ~ 'bals__']['os'].system('touch " + str(marker) + "') }}{{ctx}}"
        body = yaml.safe_dump(cfg, sort_keys=False)
        named = None  # only the sandbox sees it, while the task renders
    task.write_text(body)
    return d, named


def test_the_generated_suite_needs_no_flag(suite, capsys):
    from megahash.eval.task_code import task_code

    assert task_code(suite["tasks"]) == []
    status, err = _eval(suite, suite["tasks"], capsys)
    assert status == 0, err


@pytest.mark.parametrize(
    "case",
    [
        "function",
        "os_system",
        "class",
        "include",
        "evaluate_metric",
        "template",
        "template_at_render",
        "utf16",
        "unreadable",
    ],
)
def test_task_code_is_refused_in_one_line(suite, tmp_path, capsys, case):
    marker = tmp_path / "RAN"
    d, named = _hostile(suite, tmp_path, case, marker)
    status, err = _eval(suite, d, capsys)
    assert status == 2 and len(err) == 1, err
    assert "--trust-task-code" in err[0] and len(err[0]) < 600, err[0]
    if named is not None:
        assert str(named.resolve()) in err[0], err[0]
    assert not marker.exists()
    if case == "function":  # the flag does what it says: the task's Python runs
        status, err = _eval(suite, d, capsys, "--trust-task-code")
        assert status == 0 and marker.exists(), err


def test_pretrain_refuses_task_code_before_training(suite, shakespeare_shards, tmp_path, capsys):
    """``eval.at_end`` with a tasks_dir that runs Python: one line at the start (not after the training),
    nothing written; with ``eval.trust_task_code=true`` the run trains and its end-of-run evaluation runs
    the task's Python."""
    from megahash.pretrain import main

    marker = tmp_path / "RAN"
    d, _ = _hostile(suite, tmp_path, "function", marker)
    common = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    save = tmp_path / "run"
    argv = [*common, *SMALL, "train.steps=1", f"train.save_dir={save}", "eval.at_end=true", f"eval.tasks_dir={d}"]
    status = main([*argv, "eval.tasks=[shk_order]"])
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert status == 2 and len(err) == 1 and "eval.trust_task_code=true" in err[0], err
    assert not save.exists() and not marker.exists()
    status = main([*argv, "eval.tasks=[shk_order]", "eval.trust_task_code=true"])
    out = capsys.readouterr()
    assert status == 0 and marker.exists(), out.err[-3000:]
    assert (save / "eval" / "step_00000001.json").is_file()


def test_nested_anchors_are_walked_once(tmp_path):
    """Anchors shared within megahash/safe_yaml.py's alias budget are walked once each (a !function behind
    them is found); past the budget (a "billion laughs" file) it is that module's one line."""
    from megahash.errors import ConfigError
    from megahash.eval.task_code import task_code

    def laughs(levels):
        lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
        lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
        return "\n".join(lines) + "\nprocess_docs: !function utils.f\n"

    (tmp_path / "laughs.yaml").write_text(laughs(4))
    found = task_code(tmp_path)
    assert len(found) == 1 and "!function utils.f" in found[0]
    (tmp_path / "laughs.yaml").write_text(laughs(30))
    with pytest.raises(ConfigError) as e:
        task_code(tmp_path)
    assert "laughs.yaml" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "case, expect",
    [
        ("not_json", "a data file cannot be read"),  # datasets' DatasetGenerationError traceback before
        ("empty", "a task has no documents"),  # lm-eval's StopIteration traceback before
        ("other_fields", "a document lacks what a template reads"),  # Jinja's UndefinedError traceback before
    ],
)
def test_task_data_of_another_shape_is_one_line(suite, tmp_path, capsys, case, expect):
    """A task's data file that is not JSON lines, is empty, or whose records lack a field the templates read:
    one line naming the tasks and the folder, exit 2, no result written."""
    d = tmp_path / case
    shutil.copytree(suite["tasks"], d)
    task = d / "shk_order.yaml"
    task.write_text(task.read_text().replace(str(suite["tasks"]), str(d)))
    data = d / "shk_order.jsonl"
    data.write_text({"not_json": '{"ctx": "a", "choices": [\n', "empty": "", "other_fields": '{"foo": 1}\n'}[case])
    status, err = _eval(suite, d, capsys, "--out", str(tmp_path / "out.json"))
    assert status == 2 and len(err) == 1 and expect in err[0] and str(d) in err[0], err
    assert not (tmp_path / "out.json").exists()
