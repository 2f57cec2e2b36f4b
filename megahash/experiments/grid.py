"""The grid of ``megahash sweep``: a grid file (base config, axes, variants, standard row, evaluation) read into
its cells, each cell's resolved and checked config, the cells a run selects, and the plan written before any
cell runs (``grid.json``, ``cells.txt``, every ``cell_config.yaml``). The file's format:
:mod:`megahash.experiments.sweep`."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megahash import safe_yaml
from megahash.atomic_write import write_text_atomic
from megahash.config_files import CONFIG_ROOT
from megahash.errors import ConfigError

DONE_FILE = "sweep_cell.json"
CELL_CONFIG = "cell_config.yaml"
GRID_KEYS = {
    "name",
    "config",
    "overrides",
    "axes",
    "variants",
    "standard",
    "eval",
    "launch",
    "slurm",
    "out",
    "description",
    "expected",
}
SAME_BUDGET = (
    "train.steps",
    "train.global_batch_size",
    "train.seed",
    "data.seed",
    "data.seq_length",
    "data.prefix",
    "data.split",
    "data.tokenizer",
)


@dataclass
class Cell:
    index: int
    name: str
    label: str  # the variant (every non-seed value)
    seed: str  # the repetition ("" without a seed axis)
    values: dict  # dotted key (or "variant") -> value
    overrides: list[str]
    dir: Path

    @property
    def done(self) -> bool:
        """Trained (and evaluated): its DONE_FILE exists."""
        return (self.dir / DONE_FILE).is_file()


@dataclass
class Grid:
    name: str
    path: Path | None
    base: str | None
    overrides: list[str]
    cells: list[Cell]
    standard: dict
    eval: dict
    ranks: int
    sbatch: list[str]
    out: Path
    expected: str = ""
    seed_keys: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "megahash_sweep": 1,
            "name": self.name,
            "grid": str(self.path) if self.path else None,
            "base": self.base,
            "overrides": self.overrides,
            "standard": self.standard,
            "eval": self.eval,
            "ranks": self.ranks,
            "sbatch": self.sbatch,
            "out": str(self.out),
            "seed_keys": self.seed_keys,
            "expected": self.expected,
            "cells": [
                {
                    "index": c.index,
                    "name": c.name,
                    "label": c.label,
                    "seed": c.seed,
                    "values": c.values,
                    "overrides": c.overrides,
                    "dir": str(c.dir),
                }
                for c in self.cells
            ],
        }

    @classmethod
    def from_json(cls, d: dict) -> Grid:
        cells = [
            Cell(c["index"], c["name"], c["label"], c["seed"], c["values"], c["overrides"], Path(c["dir"]))
            for c in d["cells"]
        ]
        return cls(
            d["name"],
            Path(d["grid"]) if d.get("grid") else None,
            d["base"],
            d["overrides"],
            cells,
            d["standard"],
            d["eval"],
            d["ranks"],
            d["sbatch"],
            Path(d["out"]),
            d.get("expected", ""),
            d.get("seed_keys", []),
        )


MAX_CELLS = 10_000  # the shipped grids have at most 35


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def override_text(key: str, value) -> str:
    """``key=value`` that :func:`megahash.config.parse_override` reads back as ``value``."""
    if isinstance(value, str):
        try:
            if safe_yaml.load(value, f"grid value of {key}") == value:
                return f"{key}={value}"
        except yaml.YAMLError:
            pass
    return f"{key}={json.dumps(value)}"


def _overrides(spec, where: str) -> list[str]:
    if spec is None:
        return []
    if isinstance(spec, dict):
        return [override_text(k, v) for k, v in spec.items()]
    if isinstance(spec, list) and all(isinstance(x, str) and "=" in x for x in spec):
        return list(spec)
    raise ConfigError(f"{where} must be a mapping of dotted keys to values or a list of key=value strings")


def _flatten(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append(override_text(f"{prefix}{k}", v))
    return out


def _snippet(name: str | None, grid_dir: Path) -> list[str]:
    """A variant's ``config:`` (a YAML snippet, e.g. embeddings/md5-pool.yaml) as dotted overrides."""
    if not name:
        return []
    from megahash.config import _load_yaml_tree

    return _flatten(_load_yaml_tree(Path(_resolve_base(name, grid_dir))))


def _slug(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    out = "".join(ch if ch.isalnum() or ch in "-_." else ("+" if ch == "," else "-") for ch in text)
    return out.strip("-") or "x"


def _resolve_base(name: str | None, grid_dir: Path) -> str | None:
    if not name:
        return None
    for cand in (grid_dir / name, CONFIG_ROOT / name, Path(name)):
        if cand.is_file():
            return str(cand.resolve())
    raise ConfigError(f"grid config {name!r} not found (looked beside the grid file and in {CONFIG_ROOT})")


def _first_repeat(items: list) -> int | None:
    """The index of the first item equal to an earlier one, else None."""
    return next((i for i, x in enumerate(items) if x in items[:i]), None)


def load_grid(path: str, extra: Sequence[str] = (), out: str | None = None) -> Grid:
    """Read a grid YAML into its cells (each cell's config is resolved and checked)."""
    from megahash.config import read_yaml_mapping

    p = Path(path)
    data = read_yaml_mapping(path, "grid")
    unknown = sorted(set(data) - GRID_KEYS)
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], sorted(GRID_KEYS), n=1)
        raise ConfigError(
            f"unknown grid key {unknown[0]!r} in {path}"
            + (f" (did you mean {close[0]!r}?)" if close else f" (valid: {', '.join(sorted(GRID_KEYS))})")
        )
    name = str(data.get("name") or p.stem)
    base = _resolve_base(data.get("config"), p.parent)
    overrides = _overrides(data.get("overrides"), f"{path}: overrides") + list(extra)
    axes = data.get("axes") or {}
    if not isinstance(axes, dict) or not all(isinstance(v, list) and v for v in axes.values()):
        raise ConfigError(f"{path}: axes must map dotted config keys to non-empty lists of values")
    variants = data.get("variants") or []
    if not isinstance(variants, list) or not all(isinstance(v, dict) and v.get("name") for v in variants):
        raise ConfigError(f"{path}: variants must be a list of {{name: ..., overrides: {{...}}}}")
    if not axes and not variants:
        raise ConfigError(f"{path}: a grid needs axes (dotted key -> list) or variants")
    n_cells = max(1, len(variants)) * math.prod(len(v) for v in axes.values())
    if n_cells > MAX_CELLS:  # counted before the product is built: 100 x 100 x 100 values checked cells for hours
        raise ConfigError(
            f"{path}: the grid has {n_cells:,} cells (variants x axis values), more than {MAX_CELLS:,}; "
            f"split it into several grids or shorten its axes"
        )
    for key, values in axes.items():  # a value listed twice is a cell run twice (and two rows of one variant)
        i = _first_repeat([json.dumps(v, sort_keys=True, default=str) for v in values])
        if i is not None:
            raise ConfigError(f"{path}: axis {key} lists {values[i]!r} twice (a cell would run twice); list it once")
    names = [str(v["name"]) for v in variants]
    i = _first_repeat(names)
    if i is not None:
        raise ConfigError(f"{path}: two variants are named {names[i]!r} (their rows would be one); rename one")
    seed_keys = [k for k in axes if k.split(".")[-1].endswith("seed")]
    out_dir = Path(out or data.get("out") or f"runs/grids/{name}").resolve()
    cells: list[Cell] = []
    keys = list(axes)
    var_list = variants or [None]
    for var, combo in itertools.product(var_list, itertools.product(*(axes[k] for k in keys))):
        values = dict(zip(keys, combo))
        if var is not None:
            values = {"variant": var["name"], **values}
        label = " · ".join(str(v) for k, v in values.items() if k not in seed_keys) or "cell"
        seed = ",".join(str(values[k]) for k in seed_keys)
        slug = "__".join(f"{k.split('.')[-1]}={_slug(v)}" if k != "variant" else _slug(v) for k, v in values.items())
        cell_dir = out_dir / "cells" / f"{len(cells):03d}_{slug}"[:200]
        ov = list(overrides)
        if var is not None:
            ov += _snippet(var.get("config"), p.parent) + _overrides(
                var.get("overrides"), f"{path}: variant {var['name']}"
            )
        ov += [override_text(k, v) for k, v in values.items() if k != "variant"]
        ov.append(f"train.save_dir={cell_dir}")
        cells.append(Cell(len(cells), cell_dir.name, label, seed, values, ov, cell_dir))
    standard = data.get("standard")
    if standard is None:
        standard = {k: v[0] for k, v in axes.items() if k not in seed_keys}
        if variants:
            standard = {"variant": variants[0]["name"], **standard}
    if not isinstance(standard, dict):
        raise ConfigError(f"{path}: standard must map axis keys to values")
    bad = [k for k in standard if k not in axes and k != "variant"]
    if bad:
        raise ConfigError(f"{path}: standard names {bad[0]!r}, which is not an axis ({', '.join(axes)})")
    if cells and not any(all(c.values.get(k) == v for k, v in standard.items()) for c in cells):
        values = {"variant": [v["name"] for v in variants], **axes}
        k = next((k for k in standard if standard[k] not in values[k]), next(iter(standard)))
        choices = values[k]
        raise ConfigError(
            f"{path}: standard {k}={standard[k]!r} is no cell's value (the report would have no standard row and "
            f"no deltas); pick one of {', '.join(map(repr, choices))}"
        )
    ev = data.get("eval") or {}
    if not isinstance(ev, dict):
        raise ConfigError(f"{path}: eval must be a mapping (tasks, tasks_dir, limit, batch_size, trust_task_code)")
    if not isinstance(ev.get("trust_task_code", False), bool):
        raise ConfigError(f"{path}: eval.trust_task_code must be true or false (task files that run Python)")
    tasks = ev.get("tasks") or []
    if not (isinstance(tasks, str) or (isinstance(tasks, list) and all(isinstance(t, str) for t in tasks))):
        raise ConfigError(f"{path}: eval.tasks must be a task name or a list of task names")
    if not isinstance(ev.get("tasks_dir") or "", str):
        raise ConfigError(f"{path}: eval.tasks_dir must be a folder path")
    limit = ev.get("limit")
    if limit is not None and not (_number(limit) and limit > 0):
        raise ConfigError(
            f"{path}: eval.limit must be a positive number of documents (or a fraction), got {str(limit)[:40]!r}"
        )
    launch = data.get("launch") or {}
    slurm = data.get("slurm") or {}
    for key, section, fields in (("eval", ev, "batch_size"), ("launch", launch, "ranks")):
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: {key} must be a mapping ({key}.{fields})")
        value = section.get(fields, 8 if key == "eval" else 1)
        if not (_number(value) and value == int(value) and value >= 1):
            raise ConfigError(f"{path}: {key}.{fields} must be a whole number >= 1, got {str(value)[:40]!r}")
    if not isinstance(slurm, dict):
        raise ConfigError(f"{path}: slurm must be a mapping (slurm.sbatch: a list of sbatch options)")
    sbatch = slurm.get("sbatch", [])
    if not (isinstance(sbatch, list) and all(isinstance(x, str) for x in sbatch)):
        raise ConfigError(f"{path}: slurm.sbatch must be a list of sbatch options (strings)")
    ev = {
        "tasks": [tasks] if isinstance(tasks, str) else list(tasks),
        "tasks_dir": ev.get("tasks_dir"),
        "limit": ev.get("limit"),
        "batch_size": int(ev.get("batch_size", 8)),
        "trust_task_code": ev.get("trust_task_code") is True,  # task files that run Python (docs/security.md)
    }
    if ev["tasks_dir"] and not Path(ev["tasks_dir"]).is_absolute():
        ev["tasks_dir"] = str((Path.cwd() / ev["tasks_dir"]).resolve())
    grid = Grid(
        name,
        p.resolve(),
        base,
        overrides,
        cells,
        standard,
        ev,
        int(launch.get("ranks", 1)),
        [str(x) for x in slurm.get("sbatch", [])],
        out_dir,
        str(data.get("expected") or ""),
        seed_keys,
    )
    check_cells(grid, set(axes))
    return grid


def cell_config(grid: Grid, cell: Cell):
    from megahash.config import load_config

    try:
        return load_config(grid.base, cell.overrides)
    except ConfigError as e:
        raise ConfigError(f"grid {grid.name}, cell {cell.name}: {e}") from None


def check_cells(grid: Grid, axis_keys: set) -> None:
    """Every cell's config resolves, and cells share data, seed and budget unless an axis varies them."""

    def get(tree, dotted):
        for part in dotted.split("."):
            tree = tree[part]
        return tree

    from megahash.models.registry import schedule_kinds

    ref = None
    configs: dict[str, str] = {}  # the resolved config without its save_dir -> the first cell of it
    for cell in grid.cells:
        cfg = cell_config(grid, cell)
        try:
            schedule_kinds(cfg)  # unknown attention kinds / bad schedules fail before anything runs
        except ConfigError as e:
            raise ConfigError(f"grid {grid.name}, cell {cell.name}: {e}") from None
        tree = cfg.to_dict()
        key = json.dumps({**tree, "train": {**tree["train"], "save_dir": None}}, sort_keys=True, default=str)
        if key in configs:
            raise ConfigError(
                f"grid {grid.name}: cells {configs[key]} and {cell.name} resolve to the same config (the same run "
                f"twice); drop one, or make their overrides differ"
            )
        configs[key] = cell.name
        same = {k: get(tree, k) for k in SAME_BUDGET if k not in axis_keys}
        if ref is None:
            ref = same
        elif same != ref:
            k = next(k for k in same if same[k] != ref[k])
            raise ConfigError(
                f"grid {grid.name}: cell {cell.name} changes {k} ({ref[k]!r} -> {same[k]!r}) "
                f"without an axis; every cell must get the same data, seed and budget"
            )


def is_done(cell: Cell) -> bool:
    return cell.done


def select_cells(grid: Grid, spec: str | None) -> list[Cell]:
    """The cells of ``--cells`` (``0-3,7``: indices and ranges); every cell without one."""
    if not spec:
        return list(grid.cells)
    chosen = set()
    for part in str(spec).split(","):
        try:
            lo, _, hi = part.strip().partition("-")
            chosen.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ConfigError(f"--cells {spec!r}: use cell indices and ranges like 0-3,7") from None
    bad = sorted(i for i in chosen if not 0 <= i < len(grid.cells))
    if bad:
        raise ConfigError(f"--cells {spec!r}: grid {grid.name} has cells 0-{len(grid.cells) - 1}, not {bad[0]}")
    return [c for c in grid.cells if c.index in chosen]


def override_eval(grid: Grid, tasks: str | None, tasks_dir: str | None, limit: float | None) -> None:
    """``--tasks``/``--tasks-dir``/``--limit`` in place of the grid's ``eval`` (``--tasks none``: none)."""
    if tasks is not None:
        grid.eval["tasks"] = [] if tasks.strip().lower() == "none" else [t for t in tasks.split(",") if t.strip()]
    if tasks_dir is not None:
        grid.eval["tasks_dir"] = str(Path(tasks_dir).resolve())
    if limit is not None:
        grid.eval["limit"] = limit


def trained_step(cell: Cell) -> int:
    latest = cell.dir / "latest"
    try:
        tag = latest.read_text().strip()
        state = json.loads((cell.dir / tag / "megahash_state.json").read_text())
        return int(state.get("step", 0))
    except (OSError, ValueError):
        return 0


def write_plan(grid: Grid) -> None:
    """grid.json, cells.txt (array index -> cell) and every cell's resolved config (atomic writes)."""
    from megahash.config import save_config

    grid.out.mkdir(parents=True, exist_ok=True)
    for cell in grid.cells:
        save_config(cell_config(grid, cell), cell.dir / CELL_CONFIG)
    write_text_atomic(grid.out / "grid.json", json.dumps(grid.to_json(), indent=1) + "\n")
    write_text_atomic(grid.out / "cells.txt", "".join(c.name + "\n" for c in grid.cells))
