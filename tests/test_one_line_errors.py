"""Errors stay one line (issue 47.5): YAML alias bombs ("billion laughs"), recursive aliases and deep nesting
are refused in one line wherever megahash reads YAML (megahash/safe_yaml.py), and every ``error:`` line is
capped (megahash.errors.one_line). Before: a 400-byte config of nested anchors printed a 2 GB error line
after a minute; 2,000 nested ``[`` were a RecursionError traceback; a 100 kB value was quoted in full."""

import re
import sys

import pytest
import yaml

from conftest import run
from megahash.errors import ConfigError

LIMIT = len("error: ") + 500  # megahash.errors.LINE_LIMIT after the prefix


def laughs(levels: int, width: int = 9) -> str:
    """A flow sequence of ``levels`` anchors, each ``width`` aliases of the one before: ``width ** levels``
    scalars once expanded."""
    parts = ["&a0 [" + ", ".join(["lol"] * width) + "]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


def _one_error_line(r) -> str:
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[:2000]
    assert len(lines[0]) <= LIMIT, len(lines[0])
    return lines[0]


BOMB = laughs(7)  # 9^7 = 4.8 million scalars from 390 bytes


@pytest.mark.parametrize("where", ["config", "include", "override", "grid"])
def test_a_billion_laughs_yaml_is_refused_in_one_line(tmp_path, where):
    """Through the real entry points: a config file, a file it includes, a command-line override and a sweep
    grid holding the bomb; one line naming the file (or key) and the alias limit, exit 2."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(f"train:\n  lr: {BOMB}\n")
    if where == "config":
        cmd, named = ["megahash/pretrain.py", "--check", "config", "--config", str(bomb)], str(bomb)
    elif where == "include":
        main = tmp_path / "main.yaml"
        main.write_text("include: [bomb.yaml]\ntrain:\n  steps: 3\n")
        cmd, named = ["megahash/pretrain.py", "--check", "config", "--config", str(main)], str(bomb)
    elif where == "override":
        cmd, named = ["-m", "megahash", "params", "--config", "configs/quickstart.yaml", f"train.lr={BOMB}"], "train.lr"
    else:
        grid = tmp_path / "grid.yaml"
        grid.write_text(f"name: g\nconfig: quickstart.yaml\naxes:\n  - {BOMB}\n")
        cmd, named = ["-m", "megahash", "sweep", "--grid", str(grid), "--dry-run"], str(grid)
    line = _one_error_line(run([sys.executable, *cmd], timeout=300))
    assert named in line and "YAML aliases" in line and "1,000,000" in line, line


def test_recursive_aliases_and_deep_nesting_are_refused_in_one_line(tmp_path):
    """An anchor inside itself expands without end; 2,000 nested sequences overflowed PyYAML's recursion."""
    for name, text, why in [
        ("recursive.yaml", "train:\n  lr: &a [1, *a]\n", "recursive YAML alias"),
        ("deep.yaml", "train:\n  lr: " + "[" * 2000 + "]" * 2000 + "\n", "nested deeper than 64"),
    ]:
        path = tmp_path / name
        path.write_text(text)
        line = _one_error_line(
            run([sys.executable, "megahash/pretrain.py", "--check", "config", "--config", str(path)])
        )
        assert str(path) in line and why in line, line


def test_a_key_written_twice_in_a_config_is_one_line(tmp_path):
    """PyYAML keeps the last of two equal keys: a config writing hidden_size twice trained the second, silently.
    Refused in one line naming both lines; a merge key (<<) overridden by the mapping's own key still loads."""
    from megahash.config import read_yaml_mapping

    twice = tmp_path / "twice.yaml"
    twice.write_text("model:\n  hidden_size: 64\n  num_heads: 4\n  hidden_size: 128\n")
    line = _one_error_line(run([sys.executable, "megahash/pretrain.py", "--check", "config", "--config", str(twice)]))
    assert str(twice) in line and "key 'hidden_size' is written twice in one mapping (lines 2 and 4)" in line, line
    flow = tmp_path / "flow.yaml"  # both on one line: a flow mapping
    flow.write_text("model: {hidden_size: 64, hidden_size: 128}\n")
    with pytest.raises(
        ConfigError, match=re.escape("key 'hidden_size' is written twice in one mapping (lines 1 and 1)")
    ):
        read_yaml_mapping(flow, "config")
    merged = tmp_path / "merged.yaml"
    merged.write_text("base: &b\n  x: 1\n  y: 2\nother:\n  <<: *b\n  x: 3\n")
    assert read_yaml_mapping(merged, "config") == {"base": {"x": 1, "y": 2}, "other": {"x": 3, "y": 2}}


def test_a_binary_file_or_a_directory_as_config_is_one_line(tmp_path):
    """--config naming a binary file (UnicodeDecodeError) or a directory (IsADirectoryError): tracebacks before."""
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    for path, why in [(binary, "is not UTF-8 text"), (tmp_path, "cannot be read: Is a directory")]:
        line = _one_error_line(
            run([sys.executable, "megahash/pretrain.py", "--check", "config", "--config", str(path)])
        )
        assert line.startswith(f"error: config file {path} {why}"), line


def test_a_run_folder_as_config_names_its_config_file(tmp_path):
    """``megahash params --config RUN`` (or a step_N folder): the line names the run's resolved_config.yaml, the
    file meant (it said "Is a directory", no more)."""
    from megahash.config import read_yaml_mapping

    run = tmp_path / "run"
    run.mkdir()
    (run / "resolved_config.yaml").write_text("model: {hidden_size: 64}\n")
    with pytest.raises(ConfigError) as e:
        read_yaml_mapping(run, "config")
    assert str(e.value) == (
        f"config file {run} cannot be read: Is a directory; a run's config is {run / 'resolved_config.yaml'}"
    )
    with pytest.raises(ConfigError, match=r"Is a directory$"):  # a folder that is no run: no hint
        read_yaml_mapping(tmp_path / "run" / ".." / "run" / "..", "config")


def test_a_deeply_nested_deepspeed_json_is_one_line(tmp_path):
    """train.deepspeed_config naming 100,000 nested arrays: Python's JSON decoder's RecursionError was a traceback."""
    path = tmp_path / "ds.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    cmd = ["megahash/pretrain.py", "--check", "config", "--config", "configs/quickstart.yaml"]
    line = _one_error_line(run([sys.executable, *cmd, f"train.deepspeed_config={path}"]))
    assert str(path) in line and "nested too deeply" in line, line


def test_alias_expansion_counts_what_the_expanded_value_holds():
    """What :func:`alias_expansion` adds, against the value PyYAML constructs walked twice: once in full (every
    shared list visited each time it is referenced: the expansion) and once visiting each list once."""
    from megahash.safe_yaml import alias_expansion

    def size(value, seen=None):  # one per node plus a scalar's characters; keys of a mapping count too
        if isinstance(value, list | dict):
            if seen is not None:
                if id(value) in seen:
                    return 0
                seen.add(id(value))
            items = [x for kv in value.items() for x in kv] if isinstance(value, dict) else value
            return 1 + sum(size(x, seen) for x in items)
        return 1 + len(str(value))

    for text in [laughs(3, 3), laughs(4, 2), "a: &x {k: [vv, www]}\nb: *x\nc: [*x, *x]\n", "plain: [1, 22, 333]\n"]:
        node, value = yaml.compose(text, Loader=yaml.SafeLoader), yaml.safe_load(text)
        assert alias_expansion(node) == size(value) - size(value, set()), text


def test_the_largest_shipped_config_is_far_below_the_bounds():
    """The bounds cannot refuse a real config: every shipped YAML loads, none uses aliases, none nests deeper
    than 5 (the numbers megahash/safe_yaml.py's docstring gives)."""
    from megahash import safe_yaml
    from megahash.config_files import CONFIG_ROOT

    def depth(node):
        return 1 + max((depth(c) for c in safe_yaml._children(node)), default=0)

    paths = sorted(CONFIG_ROOT.rglob("*.yaml"))
    assert len(paths) > 20
    for path in paths:
        safe_yaml.load(path.read_text(), str(path))
        node = yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
        assert node is None or (safe_yaml.alias_expansion(node) == 0 and depth(node) <= 5), path


def test_task_files_and_saved_configs_refuse_the_bomb_too(tmp_path):
    """lm-eval task YAMLs under --tasks-dir (read by megahash before lm-eval reads them unbounded) and a
    checkpoint's resolved_config.yaml."""
    from megahash.errors import ConfigError
    from megahash.eval.run import local_task_names
    from megahash.training.batch_ramp import _saved_ramp

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "ok.yaml").write_text("task: fine\n")
    (tasks / "bomb.yaml").write_text(f"task: bomb\ndoc_to_text: {BOMB}\n")
    with pytest.raises(ConfigError, match="bomb.yaml: YAML aliases"):
        local_task_names(str(tasks))
    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    (ckpt / "resolved_config.yaml").write_text(f"train:\n  batch_ramp: {BOMB}\n")
    with pytest.raises(ConfigError, match="resolved_config.yaml: YAML aliases"):
        _saved_ramp(ckpt)
    from megahash.checkpoint.resolve import checkpoint_config  # what evaluation and export read

    with pytest.raises(ConfigError, match="resolved_config.yaml: YAML aliases"):
        checkpoint_config(ckpt)


def test_a_huge_error_message_is_capped_to_one_line(tmp_path):
    """A config value of 100,000 characters quoted in its error: one line of at most the cap, keeping the
    head (what failed) and the tail, with an ellipsis between."""
    path = tmp_path / "long.yaml"
    path.write_text("train:\n  lr: " + "x" * 50_000 + "y" * 50_000 + "\n")
    line = _one_error_line(run([sys.executable, "-m", "megahash", "params", "--config", str(path)]))
    assert line.startswith("error: config key 'train.lr' must be a number, got 'xxx") and line.endswith("yyy'"), line
    assert " ... " in line and len(line) == LIMIT


def test_one_line_joins_lines_and_keeps_both_ends():
    from megahash.errors import LINE_LIMIT, one_line

    assert one_line("short") == "short"
    assert one_line("first\n  second\n\nthird ") == "first second third"
    text = "A" * 1000 + "\n" + "B" * 3000
    capped = one_line(text)
    assert len(capped) == LINE_LIMIT and capped.startswith("AAA") and capped.endswith("BBB") and " ... " in capped
    assert one_line("x" * LINE_LIMIT) == "x" * LINE_LIMIT  # at the cap: unchanged


def test_launcher_errors_are_capped(capsys):
    """megahash.launching.run (``python -m launch``) refuses a stray argument in one capped line."""
    from megahash.launching.run import main

    assert main(["--launcher", "python", "--dry-run", "stray" * 10_000]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and len(line) <= LIMIT and line.endswith("(launcher options go before them)"), line[:300]


@pytest.mark.parametrize(
    "cmd",
    [
        ["-m", "megahash", "eval", "--checkpoint", "configs", "--dynamic-lr", "abc"],
        ["-m", "megahash", "params", "--vocab-size", "many"],
        ["-m", "megahash", "export", "--checkpoint"],
        ["-m", "megahash", "sweep", "--no-such-flag"],
        ["megahash/pretrain.py", "--no-such-flag"],
        ["data_tools/preprocess_data.py", "--input"],
    ],
)
def test_argument_errors_are_one_line(cmd):
    """argparse's own errors (a bad value, an unknown flag, a missing value) are one line too, naming the
    command and pointing at its --help, exit 2 (megahash.arguments.ArgumentParser): argparse printed its
    usage block before them."""
    line = _one_error_line(run([sys.executable, *cmd], timeout=300))
    assert "(see " in line and "--help)" in line, line


@pytest.mark.parametrize(
    "text",
    [
        "model:\n\thidden_size: 64\n",
        "train:\n  steps: [1, 2\n  lr: 3\n",
        "train:\n  steps: 1\n   lr: 3\n",
        "train:\n  steps: 1\n---\nmodel: {}\n",  # a second document: PyYAML's context says so
    ],
)
def test_a_yaml_syntax_error_names_the_problem_and_its_line(tmp_path, text):
    """Before: only PyYAML's first line, its context ('while scanning for the next token'): neither what was
    wrong nor where. Now: PyYAML's problem and the line and column it gives."""
    from megahash.config import load_config

    with pytest.raises(yaml.YAMLError) as theirs:
        yaml.safe_load(text)
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as ours:
        load_config(path)
    msg = str(ours.value)
    mark = theirs.value.problem_mark
    assert theirs.value.problem in msg and f"(line {mark.line + 1}, column {mark.column + 1})" in msg, msg
    assert "\n" not in msg and (("not tabs" in msg) == ("\t" in text))
    assert ("expected a single document" in msg) == ("---" in text), msg


@pytest.mark.parametrize(
    "flag, hint",
    [
        ("--training.steps=5", "config overrides take no dashes: training.steps=VALUE"),  # torchtitan's spelling
        ("--train-iters", "as a config override: train.steps=VALUE"),  # Megatron-LM's
        ("--seq-length", "as a config override: data.seq_length=VALUE"),
    ],
)
def test_another_trainers_flag_names_the_override(capsys, flag, hint):
    """Before: 'unrecognized arguments: --train-iters', nothing on what megahash calls it."""
    from megahash.config import load_config
    from megahash.pretrain import main

    if "training" not in flag:  # the key named is one of megahash's: the override it stands for loads
        load_config("configs/quickstart.yaml", [hint.split(": ")[-1].replace("VALUE", "5")])
    with pytest.raises(SystemExit) as e:
        main(["--check", "config", "--config", "configs/quickstart.yaml", flag, "5"])
    line = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in line and f"unrecognized arguments: {flag}; {hint} (see " in line, line


@pytest.mark.parametrize("value", ["3", "[quickstart.yaml, null]", "{quickstart.yaml: 1}"])
def test_an_include_that_names_no_file_is_one_line(tmp_path, value):
    """Before: include: 3 and include: [quickstart.yaml, null] were TypeError tracebacks; include: {a: 1} looked
    for a file 'a'. Now one line naming the file and what include takes."""
    from megahash.config import load_config

    parsed = yaml.safe_load(f"include: {value}")["include"]  # what PyYAML reads: not a name or a list of names
    assert not (isinstance(parsed, list) and all(isinstance(i, str) for i in parsed))
    path = tmp_path / "c.yaml"
    path.write_text(f"include: {value}\n")
    with pytest.raises(ConfigError, match=r"include must be a file name or a list of them, got "):
        load_config(path)
