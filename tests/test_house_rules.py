"""House rules of the code base (issue 19 item 4), checked on the source:

- import contracts with import-linter (``[tool.importlinter]`` in pyproject.toml): ``megahash.hashing``
  imports no torch/megatron/DeepSpeed/transformers, even lazily or transitively; no import cycles
  between sibling modules at any depth; library code never imports the command line
  (``megahash.cli``, ``megahash.pretrain``);
- importing the hashing and data-stage packages really loads no torch (preprocessing workers);
- ``megahash.models`` opens no files (the fixed text of fixedseqqk is read by megahash.data.fixed_text;
  the model receives token ids);
- only ``megahash/accelerator/`` touches CUDA (``.cuda``, ``torch.cuda``, ``"cuda"``/``"nccl"``), and in it only
  ``policy.py`` asks whether there is a GPU;
- only ``megahash/tokenization.py`` imports a tokenizer library (sentencepiece, ``tokenizers``,
  transformers' tokenizer classes) to turn text into ids: every other path loads its tokenizer there
  (:data:`TOKENIZER_ALLOWED` lists the exceptions and why);
- ``data_tools/*.py`` and ``launch/*.py`` are thin shells over ``megahash.data.preprocess`` and
  ``megahash.launching`` (one home for the code of each stage);
- nothing generated is tracked: what the tools write into a checkout (coverage data, bytecode, caches, runs)
  is ignored by .gitignore, and no ignored file is in git;
- ruff (CI's format and lint check) sees every tracked Python file, and skips the top-level output folders.

Each rule is also checked to fire on a planted violation, so none of them passes vacuously.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import ROOT, child_env

PKG = ROOT / "megahash"
HEAVY = ("torch", "megatron", "deepspeed", "transformers")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env=child_env(PYTHONPATH=str(root)),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_contracts_hold():
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "8 kept, 0 broken" in r.stdout, r.stdout[-2000:]


def test_import_contracts_catch_a_cycle_and_torch_in_hashing(tmp_path):
    """The same contracts on a copy of the package with one planted cycle (hashing -> data -> hashing
    would be a sibling cycle), torch imported lazily in hashing, the training loop imported by evaluation,
    conversion imported by the checkpoint layer, the accelerator's RNG by its policy, the sweep command by its
    grid and evaluation by the attention kinds' map hooks: each contract but the command line's breaks."""
    import shutil

    shutil.copytree(PKG, tmp_path / "megahash", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "megahash" / "hashing" / "words.py", "a") as f:
        f.write(
            "\n\ndef _planted():\n    import torch  # noqa: F401\n    from megahash.data import verify  # noqa: F401\n"
        )
    for module, planted in (
        ("eval/report.py", "megahash.training import checkpoint"),
        ("checkpoint/layout.py", "megahash.convert import export"),
        ("accelerator/policy.py", "megahash.accelerator import rng"),
        ("experiments/grid.py", "megahash.experiments import sweep"),
        ("models/attention/maps.py", "megahash.eval import attention_capture"),
    ):
        with open(tmp_path / "megahash" / module, "a") as f:
            f.write(f"\n\ndef _planted():\n    from {planted}  # noqa: F401\n")
    r = lint_imports(tmp_path)
    assert r.returncode != 0 and "1 kept, 7 broken" in r.stdout, r.stdout[-3000:]
    assert "megahash.hashing.words -> torch" in r.stdout and ".hashing -> .data" in r.stdout, r.stdout[-3000:]
    out = " ".join(r.stdout.split())
    assert "megahash.eval.report -> megahash.training.checkpoint" in out, r.stdout[-3000:]
    assert "megahash.checkpoint.layout -> megahash.convert.export" in out, r.stdout[-3000:]
    assert "megahash.accelerator.policy -> megahash.accelerator.rng" in out, r.stdout[-3000:]
    assert "megahash.experiments.grid -> megahash.experiments.sweep" in out, r.stdout[-3000:]
    assert "megahash.models.attention.maps -> megahash.eval.attention_capture" in out, r.stdout[-3000:]


def test_hashing_and_preprocessing_load_no_torch():
    code = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        import megahash.hashing, megahash.data.preprocess
        for pkg in (megahash.hashing, megahash.data.preprocess):
            for m in pkgutil.iter_modules(pkg.__path__):
                importlib.import_module(pkg.__name__ + "." + m.name)
        print(sorted(k for k in sys.modules if k.split(".")[0] in {HEAVY!r}))
    """)
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


# ------------------------------------------------------------------------------ source rules (AST)

FILE_CALLS = {
    "open",
    "read_text",
    "read_bytes",
    "write_text",
    "write_bytes",
    "load",
    "loadtxt",
    "fromfile",
    "memmap",
    "save",
    "savez",
    "load_file",
    "safe_open",
    "SentencePieceProcessor",
    "listdir",
    "scandir",
    "iterdir",
    "glob",
    "rglob",
}
# (file, call): why a models file may open files. None: the kind files' SOURCE (register lines, caps,
# cost and options classes, read without importing torch) is read by megahash/kind_source.py, outside models.
FILE_ALLOWED: set = set()


def _called_name(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def file_calls(path: Path, src: str | None = None) -> list[str]:
    tree = ast.parse(path.read_text() if src is None else src)
    return [
        f"{_called_name(n)} (line {n.lineno})"
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and _called_name(n) in FILE_CALLS
    ]


def cuda_uses(src: str) -> list[str]:
    out = []
    for n in ast.walk(ast.parse(src)):
        if isinstance(n, ast.Attribute) and n.attr == "cuda":
            out.append(f".cuda (line {n.lineno})")
        elif isinstance(n, ast.Name) and n.id == "cuda":
            out.append(f"cuda (line {n.lineno})")
        elif (
            isinstance(n, ast.Constant)
            and isinstance(n.value, str)
            and (n.value in ("cuda", "nccl") or n.value.startswith("cuda:"))
        ):
            out.append(f"{n.value!r} (line {n.lineno})")
    return out


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def test_models_open_no_files():
    bad = {}
    for path in sorted((PKG / "models").rglob("*.py")):
        calls = [c for c in file_calls(path) if (_rel(path), c.split(" ")[0]) not in FILE_ALLOWED]
        if calls:
            bad[_rel(path)] = calls
    assert not bad, f"megahash.models opens files (read them in megahash/data or config, pass the values): {bad}"
    # the rule fires on the loading that used to live in fixed_qk.py
    planted = "def load(path):\n    with open(path) as f:\n        return f.read().split()\n"
    assert file_calls(PKG / "models" / "attention" / "fixed_qk.py", planted) == ["open (line 2)"]


def test_only_the_accelerator_package_touches_cuda():
    accelerator = PKG / "accelerator"
    bad = {}
    for path in sorted(PKG.rglob("*.py")):
        if accelerator in path.parents:
            continue
        uses = cuda_uses(path.read_text())
        if uses:
            bad[_rel(path)] = uses
    assert not bad, f"CUDA outside megahash/accelerator/ (ask accelerator.policy.device()/has_gpu()): {bad}"
    assert cuda_uses((accelerator / "policy.py").read_text()), "the device policy is where CUDA is checked"
    # inside the package only the policy asks whether there is a GPU; the other modules ask the policy
    asking = sorted(p.name for p in accelerator.glob("*.py") if "cuda.is_available" in p.read_text())
    assert asking == ["policy.py"], asking
    # what training/signals.py and data/dataset.py did before
    planted = (
        "if dist.get_backend() == 'nccl':\n    t = t.cuda()\n"
        "loader = DataLoader(ds, pin_memory=torch.cuda.is_available())\n"
    )
    assert len(cuda_uses(planted)) == 3


# ------------------------------------------------------------------------------ entry scripts

SHELL_HOMES = {"data_tools": "megahash.data.preprocess", "launch": "megahash.launching"}
SHELL_STDLIB = {"sys", "pathlib", "os"}
SHELL_MAX_LINES = 30


def shell_problems(src: str, home: str) -> list[str]:
    """Why ``src`` is not a thin entry shell over the package ``home``: a def or class (library code
    belongs in the package), an import of anything but sys/os/pathlib and ``home``'s modules, more than
    ``SHELL_MAX_LINES`` lines."""
    out = [f"{len(src.splitlines())} lines > {SHELL_MAX_LINES}"] if len(src.splitlines()) > SHELL_MAX_LINES else []
    for n in ast.walk(ast.parse(src)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(f"defines {n.name} (line {n.lineno})")
        names = (
            [a.name for a in n.names]
            if isinstance(n, ast.Import)
            else [n.module or ""]
            if isinstance(n, ast.ImportFrom)
            else []
        )
        for name in names:
            if name.split(".")[0] not in SHELL_STDLIB and not name.startswith(home + "."):
                out.append(f"imports {name} (line {n.lineno})")
    return out


def test_entry_scripts_are_thin_shells():
    """The documented commands (``python data_tools/preprocess_data.py``, ``python -m launch``, ...) stay in
    the repository's entry folders; their code lives in the package, once."""
    bad, seen = {}, 0
    for folder, home in SHELL_HOMES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            seen += 1
            problems = shell_problems(path.read_text(), home)
            if problems:
                bad[_rel(path)] = problems
    assert not bad, f"entry scripts holding code (move it to {sorted(SHELL_HOMES.values())}): {bad}"
    assert seen >= 10, seen
    # the rule fires on what data_tools/preprocess_data.py held before (a class, numpy, 700 lines)
    planted = (
        "import numpy as np\nfrom megahash.data.preprocess.common import cli\n\n\n"
        "class AtomicOutputs:\n    pass\n" + "# ...\n" * 30
    )
    assert sorted(shell_problems(planted, "megahash.data.preprocess")) == [
        "36 lines > 30",
        "defines AtomicOutputs (line 5)",
        "imports numpy (line 1)",
    ]
    assert shell_problems("from launch.run import main\n", "megahash.launching") == ["imports launch.run (line 1)"]


# ------------------------------------------------------------------------------ one tokenizer

TOKENIZER_LIBS = {"sentencepiece", "tokenizers"}
TOKENIZER_NAME = re.compile(
    r"Tokenizer|^tokenization"
)  # transformers' AutoTokenizer, PreTrainedTokenizer*, tokenization_*
TOKENIZER_ATTRS = {
    "AutoTokenizer",
    "PreTrainedTokenizer",
    "PreTrainedTokenizerFast",
    "SentencePieceProcessor",
    "SentencePieceTrainer",
}
# file -> why it may use a tokenizer library itself; everything else loads its tokenizer with
# megahash.tokenization.load_tokenizer (the data stage, fixed texts, shards, training, eval, export)
TOKENIZER_ALLOWED = {
    "megahash/tokenization.py": "the one home: loads and encodes with every tokenizer kind",
    "megahash/data/preprocess/train_tokenizer.py": "trains a sentencepiece model (SentencePieceTrainer), "
    "then checks the trained model's special pieces",
    "megahash/convert/tokenizer.py": "builds the export's tokenizer.json / PreTrainedTokenizerFast from the run's "
    "tokenizer object and checks its ids against megahash's",
    "megahash/convert/hf/tokenization_megahash.py": "the export's AutoTokenizer class: remote code, runs without megahash",
    "megahash/hashing/text_coder.py": "copied verbatim into the export as hashing_megahash.py (remote code): "
    "encodes with the exported files, without megahash",
}


def tokenizer_uses(src: str) -> list[str]:
    """Imports of sentencepiece/tokenizers (any form), of transformers' tokenizer classes or
    ``tokenization_*`` modules, and attribute uses of those classes (``transformers.AutoTokenizer``)."""
    out = []

    def flagged(module: str, names=()) -> bool:
        parts = module.split(".")
        if parts[0] in TOKENIZER_LIBS:
            return True
        return parts[0] == "transformers" and any(TOKENIZER_NAME.search(x) for x in [*parts[1:], *names])

    for n in ast.walk(ast.parse(src)):
        if isinstance(n, ast.Import):
            out += [f"import {a.name} (line {n.lineno})" for a in n.names if flagged(a.name)]
        elif isinstance(n, ast.ImportFrom) and n.module and flagged(n.module, [a.name for a in n.names]):
            out.append(f"from {n.module} import {', '.join(a.name for a in n.names)} (line {n.lineno})")
        elif isinstance(n, ast.Attribute) and n.attr in TOKENIZER_ATTRS:
            out.append(f".{n.attr} (line {n.lineno})")
    return out


def test_only_the_tokenization_module_encodes_text():
    """Every path that turns text into ids goes through megahash/tokenization.py (issue 33: the fixed
    text of fixedseqqk, the shard tools and the dataset read every tokenizer as sentencepiece)."""
    bad, used = {}, set()
    for path in sorted([*PKG.rglob("*.py"), *(ROOT / "data_tools").glob("*.py")]):
        uses = tokenizer_uses(path.read_text())
        if uses and _rel(path) in TOKENIZER_ALLOWED:
            used.add(_rel(path))
        elif uses:
            bad[_rel(path)] = uses
    assert not bad, f"tokenizer libraries used outside megahash/tokenization.py (load_tokenizer(spec).encode): {bad}"
    assert used == set(TOKENIZER_ALLOWED), f"stale allow-list entries: {set(TOKENIZER_ALLOWED) - used}"
    # the rule fires on what megahash/data/text_source.py and data/shards.py did before
    planted = (
        "def _tokenize(text, tok):\n    import sentencepiece as spm\n"
        "    return list(spm.SentencePieceProcessor(model_file=tok).encode(text))\n"
        "from tokenizers import Tokenizer\nfrom transformers import AutoTokenizer, AutoModel\n"
        "import transformers\nt = transformers.PreTrainedTokenizerFast\nfrom transformers import AutoConfig\n"
    )
    assert sorted(tokenizer_uses(planted)) == [
        ".PreTrainedTokenizerFast (line 7)",
        ".SentencePieceProcessor (line 3)",
        "from tokenizers import Tokenizer (line 4)",
        "from transformers import AutoTokenizer, AutoModel (line 5)",
        "import sentencepiece (line 2)",
    ]


def test_tests_mirror_the_package():
    """tests/<package>/ holds the tests of megahash/<package>/ (issue 38.8): every test folder names a package
    of megahash; tests of top-level modules and project-wide rules stay in tests/."""
    tests = ROOT / "tests"
    folders = {d.name for d in tests.iterdir() if d.is_dir() and d.name[0] not in "._"}
    packages = {d.name for d in (ROOT / "megahash").iterdir() if (d / "__init__.py").is_file()}
    assert folders and folders <= packages, sorted(folders - packages)
    assert all(any(d.glob("test_*.py")) for d in map(tests.joinpath, folders))


# what the tools write into a checkout: coverage data, bytecode, package metadata, caches, runs, data, exports,
# environments, the GPU check's folders (a path each, as the tool names it)
GENERATED = [
    ".coverage",
    ".coverage.host.1234.XyZ",
    "htmlcov/index.html",
    "coverage.xml",
    "megahash/__pycache__/config.cpython-311.pyc",
    "megahash.egg-info/PKG-INFO",
    ".pytest_cache/v/cache/nodeids",
    "build/lib/megahash/__init__.py",
    "runs/quickstart/metrics.jsonl",
    "data/shakespeare/spm.model",
    "hf/quickstart/config.json",
    "wandb/latest-run",
    ".venv/bin/python3",
    ".whl/torch-2.13.0-cp311-cp311-linux_x86_64.whl",
    ".gpu_check/manifest.json",
    ".gpu_check-rehearsal/site/x.py",
    ".gpu-extra/triton/__init__.py",
]


def _git(*args: str) -> list[str]:
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\0")[:-1] if "-z" in args else r.stdout.splitlines()


def test_nothing_generated_is_tracked():
    """Every file the tools write into a checkout is ignored by .gitignore, and no ignored file is tracked
    (a merge once committed .ci/run's .coverage: ``git add -A`` then picks such a file up no more)."""
    ignored = set(_git("check-ignore", "--no-index", *GENERATED))
    assert [p for p in GENERATED if p not in ignored] == []
    assert _git("ls-files", "-z", "--cached", "--ignored", "--exclude-standard") == []


def test_ruff_checks_every_tracked_python_file(tmp_path):
    """``[tool.ruff] extend-exclude`` names the top-level output folders only: a bare ``"data"`` matched every
    folder of that name, and megahash/data/ and tests/data/ (36 files) went unformatted and unlinted by CI."""
    tracked = {p for p in _git("ls-files", "-z", "*.py") if p}
    r = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "."], cwd=ROOT, capture_output=True, text=True
    )
    seen = {str(Path(line).relative_to(ROOT)) for line in r.stdout.splitlines() if line.startswith(str(ROOT))}
    assert seen and sorted(tracked - seen) == []
    # and the output folders stay out: a file planted in each is not seen
    planted = tmp_path / "clone"
    for name in ("data", "runs", "hf", "build", "megahash/data"):
        (planted / name).mkdir(parents=True)
        (planted / name / "planted.py").write_text("import os\n")
    (planted / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    r = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "."], cwd=planted, capture_output=True, text=True
    )
    seen = [Path(line).relative_to(planted).as_posix() for line in r.stdout.split() if line.endswith(".py")]
    assert seen == ["megahash/data/planted.py"]
