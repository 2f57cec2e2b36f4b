"""The quick tier (README "Tests": ``pytest -m quick``, derived in tests/conftest.py from the measured
tests/durations.json): at least 100 tests, at most 5 minutes by those measurements, and every package of
megahash imported by one of its test modules."""

import ast
import json
import re
import subprocess
import sys

from conftest import DURATIONS, ROOT, child_env


def _quick_nodeids() -> list[str]:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "quick",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "tests",
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [line for line in r.stdout.splitlines() if "::" in line]


def _packages_imported(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n.split(".")[1] for n in names if n.startswith("megahash.")}


def test_quick_tier_is_large_fast_and_covers_every_package():
    quick = _quick_nodeids()
    measured = json.loads(DURATIONS.read_text())
    assert len(quick) >= 100, len(quick)
    assert sum(measured[n] for n in quick) <= 300, sum(measured[n] for n in quick)
    packages = {p.name for p in (ROOT / "megahash").iterdir() if (p / "__init__.py").is_file()}
    imported = set()
    for module in {n.split("::")[0] for n in quick}:
        imported |= _packages_imported(ROOT / module)
    assert packages <= imported, f"no quick test imports megahash.{sorted(packages - imported)}"
    assert all(re.match(r"tests/(\w+/)?test_\w+\.py::", n) for n in quick)
