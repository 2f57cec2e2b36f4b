"""The documented paths stay true (the README's commands run in tests/test_readme.py; these are the rest): every
config key docs/*.md and the configs' comments name resolves in the typed config tree, every repository path they
name exists, every command of a ```bash block of docs/*.md is accepted by its tool's argument parser as written
(parsed only: nothing runs, and a pretraining command's config with its overrides loads), and every ``--flag``
given to a megahash tool in the docs' other blocks and inline code is one that tool has. A command no rule here
knows fails the test, so a new kind of documented command gets a rule. No training, no imports of lm-eval,
DeepSpeed or megatron-core."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import importlib
import importlib.util
import io
import os
import re
import shlex
import sys
import typing

import pytest

from conftest import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md"))
CONFIG_COMMENTS = sorted((ROOT / "configs").rglob("*.yaml"))
SECTIONS = ("model", "data", "train", "parallel", "eval", "logging", "export")
KEY = re.compile(r"(?<![\w./$-])((?:" + "|".join(SECTIONS) + r")(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?![\w/(-])")
FILE_SUFFIX = re.compile(
    r"\.(py|md|yaml|yml|json|jsonl|sh|txt|png|pt|safetensors|npz|bin|idx|model|vocab|csv|log|out)$"
)
# dotted names in the docs that are not config keys, each with why
NOT_KEYS = {
    "model.size": "the size alias: merges configs/model/NAME.yaml (megahash/config.py load_config)",
    "train.ema_decay": "a pre-issue-46 name, shown as one that still loads (config.RENAMED_KEYS)",
    "train.hang_timeout_s": "a pre-issue-46 name, shown as one that still loads (config.RENAMED_KEYS)",
    "train.loss_smooth": "architecture.md's worked example of adding a training feature",
    "train.loss_smooth.beta": "architecture.md's worked example of adding a training feature",
    "train.loss_smooth.bta": "architecture.md's example of the unknown-key error",
    "train.muon.warmup_steps": "architecture.md's example of adding a key",
    "data.special_ids.pad": "a role of the data.special_ids mapping",
    "data.reset_": "data.reset_* (the packed-documents switches)",
    "parallel.shared_softmax": "a kernel of megahash/ops/shared_map/parallel.py",
    "model.decoder.layers.N": "a state-dict name of the export",
    "model.encode_text": "a method of the exported model",
    "model.fixed_qk": "a state-dict name of the export",
    "model.norm": "a Hugging Face state-dict name",
    "model.ngram_hash.table": "a state-dict name of the export",
}
TOP = r"(?:megahash|configs|docs|tests|benchmarks|data_tools|launch|slurm|constraints)"
PATH = re.compile(r"(?<![\w./~$-])(" + TOP + r"/[A-Za-z0-9_./*{},-]*[A-Za-z0-9_*}/])")
# repository-looking paths in the docs that are not files of the repository, each with why
NOT_PATHS = {
    "megahash/models/attention/tiedqk.py": "architecture.md's worked example of adding a kind",
    "megahash/objectives/word_dropout.py": "architecture.md's worked example of adding an objective",
    "megahash/training/loss_smooth.py": "architecture.md's worked example of adding a training feature",
    "data_tools/NAME.py": "a pattern",
    "megahash/data/preprocess/NAME.py": "a pattern",
    "configs/pretrain_SIZE.yaml": "a pattern",
    "docs/s": "a rate (docs/s), not a path",
    "megahash/forward": "a profiler range name",
    "megahash/backward": "a profiler range name",
    "megahash/optimizer": "a profiler range name",
}


def _doc_texts():
    """(name, text) of docs/*.md and of the configs' YAML comments."""
    for path in DOCS:
        yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")
    for path in CONFIG_COMMENTS:
        lines = path.read_text(encoding="utf-8").splitlines()
        yield path.relative_to(ROOT).as_posix(), "\n".join(line.split("#", 1)[1] for line in lines if "#" in line)


def _code(name: str, text: str) -> list[str]:
    """The inline code spans and fenced blocks of a markdown text (a YAML's comments: all of it)."""
    if name.endswith(".yaml"):
        return [text]
    return re.findall(r"`([^`\n]+)`", text) + re.findall(r"```\w*\n(.*?)```", text, flags=re.S)


def resolves(key: str) -> bool:
    """Whether ``a.b.c`` is a key of megahash's typed config tree (kinds' options included)."""
    from megahash import catalog
    from megahash import config as C

    node, group = C.Config, None
    for part in key.split("."):
        if node is C.KindOptions:
            return part in catalog.option_specs(group) and part == key.split(".")[-1]
        if node is None or not dataclasses.is_dataclass(node):
            return False
        if part not in {f.name for f in dataclasses.fields(node)}:
            return False
        typ = typing.get_type_hints(node)[part]
        group = getattr(node, "OPTION_GROUP", None)
        node = typ if dataclasses.is_dataclass(typ) or typ is C.KindOptions else None
    return True


def test_config_keys_named_in_docs_resolve():
    missing, used = [], set()
    for name, text in _doc_texts():
        for span in _code(name, text):
            for m in KEY.finditer(span):
                key = m.group(1)
                if FILE_SUFFIX.search(key):
                    continue
                if key in NOT_KEYS:
                    used.add(key)
                elif not resolves(key):
                    missing.append(f"{name}: {key}")
    assert not missing, "config keys in the docs that megahash/config.py does not have:\n" + "\n".join(missing)
    assert used == set(NOT_KEYS), f"NOT_KEYS entries no doc names any more: {sorted(set(NOT_KEYS) - used)}"


def test_repository_paths_named_in_docs_exist():
    missing, used = [], set()
    for name, text in _doc_texts():
        base = (ROOT / name).parent
        for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):  # markdown links
            target = m.group(1)
            if not re.match(r"[a-z]+:", target) and not (base / target).exists():
                missing.append(f"{name}: link {target}")
        for m in PATH.finditer(text):
            path = m.group(1).rstrip(".")
            if path in NOT_PATHS:
                used.add(path)
                continue
            pre, brace, rest = path.partition("{")
            options, _, post = rest.partition("}")
            for p in [pre + o + post for o in options.split(",")] if brace else [path]:
                if not (glob.glob(str(ROOT / p)) if "*" in p else (ROOT / p).exists()):
                    missing.append(f"{name}: {p}")
    assert not missing, "paths in the docs that the repository does not have:\n" + "\n".join(missing)
    assert used == set(NOT_PATHS), f"NOT_PATHS entries no doc names any more: {sorted(set(NOT_PATHS) - used)}"


# ------------------------------------------------------------------------------------------------ commands


class _Parser(Exception):
    def __init__(self, parser):
        self.parser = parser


@contextlib.contextmanager
def _capturing():
    """``parse_args`` raises the parser it was called on, so a tool's ``main`` hands over its parser unused."""

    def capture(self, *args, **kw):
        raise _Parser(self)

    real = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = real


def _from_main(main, *args):
    with _capturing(), pytest.raises(_Parser) as got:
        main(*args)
    return got.value.parser


def _script(path: str):
    spec = importlib.util.spec_from_file_location(f"_doc_{os.path.basename(path)[:-3]}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parser(tool: str):
    """The argument parser of a documented tool: ``megahash SUB``, ``pretrain``, ``launch``, ``launch.hostfile``,
    ``launch.local_slurm``, ``data_tools/NAME.py`` or ``benchmarks/NAME.py``."""
    from megahash import cli

    if tool.startswith("data_tools/"):
        name = tool.split("/")[1][:-3]
        return importlib.import_module(f"megahash.data.preprocess.{name}").build_parser()
    if tool.startswith("benchmarks/"):
        module, argv = _script(tool), sys.argv
        sys.argv = [tool]
        try:
            return _from_main(module.main)
        finally:
            sys.argv = argv
    if tool == "pretrain":
        return _from_main(importlib.import_module("megahash.pretrain").parse_args, [])
    if tool.startswith("launch"):
        name = {"launch": "run"}.get(tool, tool.split(".")[-1])
        return _from_main(importlib.import_module(f"megahash.launching.{name}").main, [])
    sub = tool.split()[1]
    if sub == "params":
        return _from_main(cli.params_main, [])
    module, func = cli.SUBCOMMANDS[sub].split(":")
    module = importlib.import_module(module)
    build = getattr(module, "build_parser", None)
    return build() if build and func == "main" else _from_main(getattr(module, func), [])


# commands of the docs' bash blocks that are not a megahash tool's, each with why
SKIP = {
    "sbatch": "SLURM's (slurm/*.sh are run on a local SLURM by tests/launching/test_slurm.py)",
    "bash launch/install_cluster_tools.sh": "installs system packages (tests/test_install_script.py)",
    "export": "a shell variable",
    "megahash-lm-eval": "lm-eval's own command line (run in tests/data/test_tokenizers.py)",
    "python -m megahash.eval.lm_eval_cli": "lm-eval's own command line (run in tests/data/test_tokenizers.py)",
    "deepspeed --hostfile": "DeepSpeed's multi-host runner",
}


def commands(text: str) -> list[str]:
    """The commands of the ```bash blocks: continuation lines joined, comments dropped, leading VAR=value
    assignments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words.pop(0)
            if words:
                out.append(shlex.join(words))
    return out


def tool_and_argv(words: list[str]) -> tuple[str, list[str]] | None:
    """(tool, its arguments) of a command line, or None when no rule knows it."""
    if words[:3] == ["python", "-m", "launch.supervise"]:
        return tool_and_argv(words[3:])
    if words[0] in ("python", "python3") and len(words) > 1:
        if words[1] == "-m" and words[2] == "megahash":
            return tool_and_argv(["megahash", *words[3:]])
        if words[1] == "-m" and words[2] in ("launch", "launch.hostfile", "launch.local_slurm"):
            return words[2], words[3:]
        if words[1] in ("megahash/pretrain.py", "launch/run.py"):
            return ("pretrain" if "pretrain" in words[1] else "launch"), words[2:]
        if re.fullmatch(r"(data_tools|benchmarks)/\w+\.py", words[1]):
            return words[1], words[2:]
    if words[0] in ("deepspeed", "torchrun") and "megahash/pretrain.py" in words:
        return "pretrain", words[words.index("megahash/pretrain.py") + 1 :]
    if words[0] == "megahash" and len(words) > 1 and words[1] in _subcommands():
        return f"megahash {words[1]}", words[2:]
    return None


def _parse(parser, argv: list[str]) -> str | None:
    """None when ``parser`` accepts ``argv``, else its message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv)
            return None
        except SystemExit:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "exit"


def _ranks(words: list[str]) -> int | None:
    """The processes a ``deepspeed --num_gpus N`` / ``torchrun --nproc_per_node N`` command starts."""
    for flag in ("--num_gpus", "--nproc_per_node", "--nproc-per-node"):
        if flag in words[: words.index("megahash/pretrain.py") if "megahash/pretrain.py" in words else len(words)]:
            return int(words[words.index(flag) + 1])
    return None


def test_documented_commands_parse_as_written():
    from megahash.config import load_config
    from megahash.training.ds_config import deepspeed_config

    parsers, bad, unknown, checked = {}, [], [], 0
    for path in DOCS:
        for cmd in commands(path.read_text(encoding="utf-8")):
            if any(cmd.startswith(p) for p in SKIP):
                continue
            words = shlex.split(cmd)
            found = tool_and_argv(words)
            if found is None:
                unknown.append(f"{path.name}: {cmd}")
                continue
            tool, argv = found
            parser = parsers.get(tool) or parsers.setdefault(tool, _parser(tool))
            problem = _parse(parser, argv)
            if problem is None and tool in ("pretrain", "launch"):
                args = parser.parse_args(argv)
                configs = [c for c in (args.config if isinstance(args.config, list) else [args.config]) if c]
                if all((ROOT / c).is_file() for c in configs):  # a run's or the reader's own config: not here
                    try:
                        cfg = load_config(configs, args.overrides)
                        # the batch at the command's rank count (deepspeed --num_gpus N, torchrun/launch N per node)
                        ranks = _ranks(words) or getattr(args, "nproc_per_node", None) or 1
                        deepspeed_config(cfg, dp_size=max(1, ranks // cfg.parallel.tensor), bf16=False)
                    except Exception as e:  # noqa: BLE001 - the config error is the finding
                        problem = f"{type(e).__name__}: {e}"
            if problem:
                bad.append(f"{path.name}: {cmd}\n    -> {problem}")
            checked += 1
    assert not unknown and not bad, (
        "documented commands no rule of tests/test_docs.py knows:\n" + "\n".join(unknown)
        if unknown
        else "documented commands their tool refuses:\n" + "\n".join(bad)
    ) + ("\n(and refused: " + "; ".join(bad) + ")" if unknown and bad else "")
    assert checked >= 60, checked


def _mentions(text: str):
    """(tool, flags) of every command in the docs' inline code and non-bash blocks (synopses included)."""
    spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"```(?!bash)\w*\n(.*?)```", text, flags=re.S)
    for span in spans:
        for line in span.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line.strip())
            m = re.match(
                r"(?:python3? )?(megahash [\w-]+|megahash/pretrain\.py|(?:data_tools|benchmarks)/\w+\.py)", line
            )
            if not m:
                continue
            tool = "pretrain" if m.group(1) == "megahash/pretrain.py" else m.group(1)
            if tool.startswith("megahash ") and tool.split()[1] not in _subcommands():
                continue  # prose: "megahash eval's ...", "megahash export-hf" is one
            if tool.endswith(".py") and not (ROOT / tool).is_file():
                continue  # a pattern: data_tools/NAME.py
            flags = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", line[m.end() :]))
            if flags:
                yield tool, flags


def _subcommands():
    from megahash import cli

    return cli.SUBCOMMANDS


def test_flags_named_in_docs_exist():
    parsers, bad = {}, []
    for path in DOCS:
        for tool, flags in _mentions(path.read_text(encoding="utf-8")):
            parser = parsers.get(tool) or parsers.setdefault(tool, _parser(tool))
            for flag in sorted(flags - set(parser._option_string_actions)):
                bad.append(f"{path.name}: {tool} {flag}")
    assert not bad, "flags in the docs that their tool does not have:\n" + "\n".join(sorted(set(bad)))
