"""``megahash eval``: lm-eval-harness tasks on a megahash checkpoint; results as JSON + markdown.

    megahash eval --checkpoint runs/quickstart [--tasks arc_easy,boolq,...] [--tasks-dir DIR]
                  [--out FILE.json] [--limit N] [--batch-size B] [--max-length L] [--tokenizer PATH]
                  [--override key=value ...] [--no-incremental]
    megahash eval --checkpoint runs/quickstart --text held_out.jsonl   # loss, ppl, bits per byte of raw text

Tasks: lm-eval task (or tag/group) names, comma-separated. Default: the nine of [Xue25] Table 4.1
(``DEFAULT_TASKS``: ARC-E, BoolQ, COPA, PIQA, SciQ, RTE, HellaSwag, WikiText, LAMBADA OpenAI),
which lm-eval downloads from the Hugging Face Hub (a networked machine). Offline: local task
YAMLs (``data_tools/make_eval_tasks.py`` writes a suite) under ``--tasks-dir``; when every requested
name is defined there, lm-eval's ~200 built-in task folders are not indexed at all
(``TaskManager(include_path=DIR, include_defaults=False)``, ~8 s saved). An unknown task name is a
one-line error naming the closest known one.

Output (refused in one line if it exists, unless ``--overwrite``): ``--out`` (default
``RUN_DIR/eval/STEP.json``, RUN_DIR the checkpoint's run directory) gets
``{"megahash_eval": 1, "checkpoint", "step", "tasks", "results": {task: {metric: value}}, "higher_is_better",
"n_samples", "config", ...}`` and the markdown table goes to the same path with ``.md``; the table
is also printed. ``megahash report`` reads these files from ``RUN_DIR/eval/``.

The trainer's end-of-run hook is :func:`evaluate_checkpoint` (``cfg.eval.at_end``).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megahash import known_warnings, safe_yaml
from megahash.errors import ConfigError, DataError
from megahash.launching.env import LAUNCHER_VARS

DEFAULT_TASKS = ["arc_easy", "boolq", "copa", "piqa", "sciq", "rte", "hellaswag", "wikitext", "lambada_openai"]
# the metric each task type is summarised by (first match wins), and whether higher is better
MAIN_METRICS = ["acc", "exact_match", "word_perplexity", "perplexity", "bits_per_byte", "acc_norm"]


def _offline_env(tasks: list[str] | None = None, tasks_dir: str | None = None) -> None:
    """When every requested task is a local YAML, datasets/huggingface_hub must never try the Hub
    (HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 unless already set); hub tasks keep the environment.
    Call before lm-eval/datasets are imported (they read these variables at import)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if tasks is None or (tasks_dir and Path(tasks_dir).is_dir() and set(tasks) <= local_task_names(tasks_dir)):
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")


def split_tasks(tasks) -> list[str]:
    if tasks is None:
        return list(DEFAULT_TASKS)
    if isinstance(tasks, str):
        tasks = [tasks]
    out = []
    for t in tasks:
        out += [x.strip() for x in str(t).split(",") if x.strip()]
    return out or list(DEFAULT_TASKS)


def local_task_names(tasks_dir: str) -> set[str]:
    """Task, tag and group names defined by the YAML files under ``tasks_dir`` (no lm-eval import)."""
    loader = _yaml_loader()
    names: set[str] = set()
    for path in sorted(Path(tasks_dir).rglob("*.yaml")):
        try:
            data = safe_yaml.load(path.read_text(), f"task file {path}", loader) or {}
        except safe_yaml.YAMLLimitError:
            raise  # lm-eval would read it next, unbounded: refused here in one line
        except Exception:
            continue
        if not isinstance(data, dict):
            continue
        for key in ("task", "group"):
            v = data.get(key)
            if isinstance(v, str):
                names.add(v)
        tags = data.get("tag") or []
        names.update([tags] if isinstance(tags, str) else [t for t in tags if isinstance(t, str)])
    return names


def _yaml_loader():
    """A safe YAML loader (aliases bounded: megahash.safe_yaml) that tolerates lm-eval's ``!function`` tags."""

    class L(safe_yaml.Loader):
        pass

    L.add_multi_constructor("!", lambda loader, suffix, node: None)
    return L


def task_manager(tasks: list[str], tasks_dir: str | None, trust_task_code: bool = False):
    """A TaskManager that knows ``tasks`` (one-line ConfigError for unknown names); task files of
    ``tasks_dir`` that would run Python are refused unless ``trust_task_code`` (megahash/eval/task_code.py)."""
    from lm_eval.tasks import TaskManager

    if tasks_dir and not Path(tasks_dir).is_dir():
        raise ConfigError(f"--tasks-dir {tasks_dir} is not a directory")
    if tasks_dir and not trust_task_code:
        from megahash.eval.task_code import refuse_task_code

        refuse_task_code(tasks_dir)
    local = local_task_names(tasks_dir) if tasks_dir else set()
    all_local = bool(tasks_dir) and all(t in local for t in tasks)
    tm = TaskManager(include_path=tasks_dir or None, include_defaults=not all_local)
    known = set(tm.all_tasks)
    for t in tasks:
        if t not in known:
            close = difflib.get_close_matches(t, sorted(known | local), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            where = (
                f" in {tasks_dir} or lm-eval's tasks"
                if tasks_dir
                else " among lm-eval's tasks (offline: pass --tasks-dir)"
            )
            raise ConfigError(f"unknown task {t!r}{hint}: not found{where}")
    return tm


def check_tasks(tasks, tasks_dir: str | None, trust_task_code: bool = False) -> None:
    """Refuse an unknown task name, or task files that run Python without ``trust_task_code``, in one line
    (ConfigError) before a run that evaluates them (``eval.interval``): instant when every name is a YAML of
    ``tasks_dir``, else lm-eval's index (seconds)."""
    tasks = split_tasks(tasks)
    _offline_env(tasks, tasks_dir)
    task_manager(tasks, tasks_dir, trust_task_code)


def _clean(v):
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


def summarise(results: dict) -> dict:
    """lm-eval's ``simple_evaluate`` output -> the JSON megahash writes (metrics without filters)."""
    res, hib = {}, {}
    for task, metrics in (results.get("results") or {}).items():
        row = {}
        for key, value in metrics.items():
            if key in ("alias", "sample_len", "sample_count") or not isinstance(value, (int, float)):
                continue
            name, _, filt = key.partition(",")
            if name.endswith("_stderr"):
                row[name] = _clean(float(value)) if value != "N/A" else None
                continue
            row[name] = _clean(float(value))
        res[task] = row
        hib[task] = {m: bool(v) for m, v in (results.get("higher_is_better") or {}).get(task, {}).items()}
    n = {t: (v.get("effective") if isinstance(v, dict) else v) for t, v in (results.get("n-samples") or {}).items()}
    return {"results": res, "higher_is_better": hib, "n_samples": n, "versions": results.get("versions", {})}


def main_metric(task_results: dict) -> str | None:
    for m in MAIN_METRICS:
        if m in task_results and task_results[m] is not None:
            return m
    return None


def markdown_table(summary: dict, title: str = "") -> str:
    """One row per task: every metric (± stderr where lm-eval gives one)."""
    lines = [f"### {title}", ""] if title else []
    lines += ["| task | metric | value | ± stderr | n |", "| --- | --- | ---: | ---: | ---: |"]
    for task in sorted(summary["results"]):
        row = summary["results"][task]
        n = summary.get("n_samples", {}).get(task, "")
        for metric in sorted(k for k in row if not k.endswith("_stderr")):
            v, se = row[metric], row.get(metric + "_stderr")
            arrow = {True: " ↑", False: " ↓"}.get(summary.get("higher_is_better", {}).get(task, {}).get(metric), "")
            vs = "n/a" if v is None else (f"{v:.4f}" if abs(v) < 1000 else f"{v:.4g}")
            ss = "" if se is None else f"{se:.4f}"
            lines.append(f"| {task} | {metric}{arrow} | {vs} | {ss} | {n} |")
    return "\n".join(lines)


def default_out(ckpt: Path) -> Path:
    return ckpt.parent / "eval" / f"{ckpt.name}.json"


def evaluate(
    lm,
    tasks: list[str],
    tasks_dir: str | None = None,
    limit: float | None = None,
    seed: int = 1234,
    log_samples: bool = False,
    trust_task_code: bool = False,
) -> dict:
    """Run lm-eval on an already-built ``MegahashEvalLM``; returns lm-eval's raw results dict. The templates
    of an untrusted ``tasks_dir`` render in Jinja's sandbox (megahash/eval/task_code.py)."""
    _offline_env(tasks, tasks_dir)
    import lm_eval

    from megahash.eval.task_code import sandboxed_templates

    tm = task_manager(tasks, tasks_dir, trust_task_code)
    sandbox = sandboxed_templates() if tasks_dir and not trust_task_code else contextlib.nullcontext()
    try:
        with sandbox, known_warnings.dropped_prints(known_warnings.LM_EVAL_PRINTS), _without_env_info():
            return lm_eval.simple_evaluate(
                model=lm,
                tasks=tasks,
                task_manager=tm,
                limit=limit,
                log_samples=log_samples,
                bootstrap_iters=100,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
                batch_size=lm.batch_size,
            )
    except (ConnectionError, OSError) as e:  # datasets cannot reach the Hub / a data file is missing
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise DataError(
            f"cannot load the data of {', '.join(tasks)}: {first[:300]}; offline, evaluate local tasks "
            f"(data_tools/make_eval_tasks.py, --tasks-dir)"
        ) from None
    except Exception as e:  # a task's data or templates that lm-eval cannot use (each a traceback before)
        why = _task_data_problem(e)
        if why is None:
            raise
        raise DataError(
            f"the tasks {', '.join(tasks)} cannot be evaluated: {why[:300]}; check their data files and templates"
            + (f" under {tasks_dir}" if tasks_dir else "")
        ) from None


def _task_data_problem(e: BaseException) -> str | None:
    """What is wrong with a task's data, for the errors lm-eval and datasets raise on data of another shape: a
    data file that is not JSON lines (datasets' DatasetGenerationError, its cause the parse error), no documents
    (lm-eval's ``next()`` on them: StopIteration), a record without a field a template reads (Jinja's
    UndefinedError). None for anything else (raised as it is)."""
    from jinja2.exceptions import UndefinedError

    if isinstance(e, StopIteration):
        return "a task has no documents (an empty data file or split)"
    if isinstance(e, UndefinedError):
        return f"a document lacks what a template reads ({e})"
    try:
        from datasets.exceptions import DatasetGenerationError
    except ImportError:  # pragma: no cover
        return None
    if isinstance(e, DatasetGenerationError):
        cause = e.__cause__ or e.__context__ or e
        first = next((line.strip() for line in str(cause).splitlines() if line.strip()), type(cause).__name__)
        return f"a data file cannot be read ({type(cause).__name__}: {first})"
    return None


@contextlib.contextmanager
def _without_env_info():
    """lm-eval's ``simple_evaluate`` ends with ``add_env_info``: torch's ``collect_env`` report, which runs
    ``pip list`` and probes compilers and drivers in subprocesses (~0.6 CPU-s, every evaluation, each eval during
    training included). megahash keeps none of it (:func:`summarise`; the run's resolved config and
    ``megahash_state.json`` say what ran), so inside this block it records that it was skipped instead."""
    import lm_eval.evaluator as evaluator

    def note(storage: dict) -> None:
        from importlib.metadata import version

        storage["pretty_env_info"] = "not collected (megahash.eval.run: the run directory records the setup)"
        storage["lm_eval_version"], storage["transformers_version"] = version("lm_eval"), version("transformers")

    saved = evaluator.add_env_info
    evaluator.add_env_info = note
    try:
        yield
    finally:
        evaluator.add_env_info = saved


def _in_distributed_job() -> bool:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return True
    except ImportError:  # pragma: no cover
        pass
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def evaluate_checkpoint(
    ckpt_dir,
    tasks=None,
    tasks_dir: str | None = None,
    out=None,
    limit=None,
    batch_size: int = 8,
    max_length: int | None = None,
    tokenizer: str | None = None,
    overrides: list[str] | None = None,
    incremental: bool = True,
    quiet: bool = False,
    isolated: bool | None = None,
    overwrite: bool = True,
    weights: str = "live",
    trust_task_code: bool = False,
) -> dict:
    """Evaluate one checkpoint (run dir or step dir) on ``tasks``; write JSON (+ .md) to ``out``
    (default ``RUN_DIR/eval/STEP.json``) and return the written record.

    The trainer's end-of-run hook (``cfg.eval.at_end``, with ``cfg.eval.tasks``/``tasks_dir``/
    ``batch_size``): call it on ONE rank after training. ``isolated`` (default: True inside a
    multi-process job, i.e. WORLD_SIZE > 1 or a live process group of several ranks) runs ``megahash eval`` in a
    fresh process without the launcher's rank variables, so the 1-rank group of
    ``load_for_inference`` never meets the training job's group; False runs in this process.
    ``overwrite=False`` (``megahash eval`` without ``--overwrite``) refuses an existing ``out`` before the
    model is loaded. ``weights``: live, ema (train.ema.decay's average) or a quantized artifact's path.
    ``trust_task_code``: let task files of ``tasks_dir`` run Python (``--trust-task-code``; refused otherwise)."""
    tasks = split_tasks(tasks)
    _offline_env(tasks, tasks_dir)
    if isolated is None:
        isolated = _in_distributed_job()
    if isolated:
        return _evaluate_in_subprocess(
            ckpt_dir,
            tasks,
            tasks_dir,
            out,
            limit,
            batch_size,
            max_length,
            tokenizer,
            overrides,
            incremental,
            quiet,
            overwrite,
            weights,
            trust_task_code,
        )
    from megahash.atomic_write import check_writable
    from megahash.checkpoint.resolve import read_while_kept
    from megahash.eval.lm import MegahashEvalLM

    given_out = out
    t0 = time.time()

    def load(ckpt: Path):  # the newest intact one of a run directory (again if a running training pruned it)
        out = Path(given_out) if given_out else _weights_out(default_out(ckpt), weights)
        refuse_existing(out, overwrite)
        check_writable(out, "pass --out FILE elsewhere")  # a read-only run folder: before the evaluation, not after
        task_manager(tasks, tasks_dir, trust_task_code)  # unknown names, task code: before the model is loaded
        if not quiet:
            print(
                f"megahash eval: {ckpt} on {', '.join(tasks) if tasks else 'default tasks'}"
                f"{' from ' + str(tasks_dir) if tasks_dir else ''} (lm-eval; loading the model)",
                file=sys.stderr,
                flush=True,
            )
        lm = MegahashEvalLM(
            checkpoint=str(ckpt),
            batch_size=batch_size,
            max_length=max_length,
            tokenizer=tokenizer,
            overrides=overrides,
            incremental=incremental,
            weights=weights,
        )
        from megahash.checkpoint.layout import STATE_FILE, read_json

        try:  # now: a running training may prune the checkpoint while lm-eval runs
            step = read_json(ckpt / STATE_FILE).get("step")
        except (OSError, ValueError):
            step = None
        return ckpt, out, lm, step

    from megahash.accelerator import process_groups

    with process_groups.releasing_group():  # the model's 1-rank group goes with it (unless a caller's group was up)
        ckpt, out, lm, step = read_while_kept(ckpt_dir, load, overrides)
        raw = evaluate(lm, tasks, tasks_dir, limit, trust_task_code=trust_task_code)
        model_args = {
            "batch_size": lm.batch_size,
            "max_length": lm.max_length,
            "decode_mode": lm.decode_mode,
            "precision": lm.precision,
            "codec": lm.codec.description,
        }
        del lm  # before the group goes: nothing of the model outlives it
    summary = summarise(raw)
    record = {
        "megahash_eval": 1,
        "checkpoint": str(ckpt),
        "step": step,
        "tasks": tasks,
        "tasks_dir": tasks_dir,
        "limit": limit,
        "weights": weights,
        **summary,
        "model_args": model_args,
        "seconds": round(time.time() - t0, 2),
    }
    from megahash.atomic_write import write_text_atomic

    write_text_atomic(out, json.dumps(record, indent=1, default=str) + "\n")
    table = markdown_table(summary, title=f"{ckpt} (step {step})")
    write_text_atomic(out.with_suffix(".md"), table + "\n")
    if not quiet:
        print(table)
        print(f"\nwrote {out} and {out.with_suffix('.md')}")
    return record


def _weights_out(out: Path, weights: str) -> Path:
    """The default results file of ``weights``: STEP.json (live), STEP_ema.json, STEP_<artifact name>.json."""
    from megahash.eval.bits_per_byte import weights_tag

    return out.with_name(f"{out.stem}{weights_tag(weights)}{out.suffix}")


def check_out(out, folder: bool = False, beside: str = "") -> None:
    """``--out`` names a results file (``folder``: an output folder) that can be made
    (:func:`megahash.atomic_write.check_output`): one line before the checkpoint is read. ``beside``: the suffix
    of the second file written next to it (``megahash eval``'s ``.md`` table, ``megahash report``'s ``.json``
    numbers), which must be another file that can be made too (``--out X.md`` was the JSON results overwritten
    by the table; a folder named like it, a traceback after the work with the first file already replaced)."""
    from megahash.atomic_write import check_output

    check_output(out, "--out", folder)
    if out and beside:
        p = Path(out)
        if p.suffix == beside:
            own = ".md" if beside == ".json" else ".json"
            raise ConfigError(
                f"--out {out}: {'the table' if own == '.md' else 'the results'} would be overwritten by the "
                f"{beside} written beside it; name the {own} file, e.g. --out {p.with_suffix(own)}"
            )
        if p.with_suffix(beside).is_dir():
            raise ConfigError(
                f"--out {out}: {p.with_suffix(beside)}, written beside it, is a folder; name another --out"
            )


def refuse_existing(out: Path, overwrite: bool) -> None:
    """One line for an existing results file (or its markdown) unless ``overwrite``."""
    if not overwrite:
        for path in (out, out.with_suffix(".md")):
            if path.exists():
                raise ConfigError(f"{path} already exists; pass --overwrite to replace it (or --out for another file)")


def _evaluate_in_subprocess(
    ckpt_dir,
    tasks,
    tasks_dir,
    out,
    limit,
    batch_size,
    max_length,
    tokenizer,
    overrides,
    incremental,
    quiet,
    overwrite=True,
    weights="live",
    trust_task_code=False,
) -> dict:
    import subprocess

    from megahash.checkpoint.resolve import resolve_for_inference

    ckpt = resolve_for_inference(ckpt_dir, overrides)
    out = Path(out) if out else _weights_out(default_out(ckpt), weights)
    argv = [
        sys.executable,
        "-m",
        "megahash",
        "eval",
        "--checkpoint",
        str(ckpt),
        "--tasks",
        ",".join(tasks),
        "--out",
        str(out),
        "--batch-size",
        str(batch_size),
    ]
    for flag, value in (
        ("--tasks-dir", tasks_dir),
        ("--limit", limit),
        ("--max-length", max_length),
        ("--tokenizer", tokenizer),
    ):
        if value is not None:
            argv += [flag, str(value)]
    for o in overrides or []:
        argv += ["--override", o]
    if not incremental:
        argv.append("--no-incremental")
    argv += ["--artifact", weights] if weights not in ("live", "ema") else ["--weights", weights]
    if overwrite:
        argv.append("--overwrite")
    if trust_task_code:
        argv.append("--trust-task-code")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    if not quiet and r.stdout:
        print(r.stdout, end="")
    if r.returncode != 0:
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        msg = next(
            (line[len("error: ") :] for line in reversed(lines) if line.startswith("error: ")),
            lines[-1] if lines else f"exit status {r.returncode}",
        )
        raise DataError(f"megahash eval of {ckpt} failed: {msg}")
    return json.loads(out.read_text())


def build_parser() -> argparse.ArgumentParser:
    from megahash.arguments import ArgumentParser

    p = ArgumentParser(prog="megahash eval", description="lm-eval-harness tasks on a megahash checkpoint.")
    p.add_argument("--checkpoint", required=True, help="run directory (its latest checkpoint) or a step_N directory")
    p.add_argument("--tasks", default=None, help=f"comma-separated task/tag names (default: {','.join(DEFAULT_TASKS)})")
    p.add_argument("--tasks-dir", default=None, help="directory of local task YAMLs (offline suite)")
    p.add_argument(
        "--trust-task-code",
        action="store_true",
        help="let task files of --tasks-dir run Python (!function, utils.py, evaluate metrics, unsandboxed "
        "templates); refused otherwise (docs/security.md)",
    )
    p.add_argument(
        "--out", default=None, help="results JSON (default RUN_DIR/eval/STEP.json); markdown beside it (.md)"
    )
    p.add_argument("--limit", type=float, default=None, help="documents per task (or a fraction < 1)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=None, help="context window in tokens (default data.seq_length)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer: sentencepiece model, tokenizer.json, HF folder or name (default: data.tokenizer of the run)",
    )
    p.add_argument("--override", action="append", default=[], help="config override key=value (repeatable)")
    p.add_argument("--no-incremental", action="store_true", help="recompute the whole sequence per generated token")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file (refused otherwise)")
    p.add_argument(
        "--text",
        default=None,
        help="score raw text instead of tasks: loss, perplexity and bits per byte of "
        "a data-stage SRC (.txt/.jsonl/folder/hf:...; megahash/eval/bits_per_byte.py)",
    )
    p.add_argument(
        "--stride",
        type=int,
        default=None,
        help="with --text: also score strided windows, each token with up to the full window as context "
        "(default half of --max-length; 0 = lm-eval's disjoint windows only)",
    )
    p.add_argument(
        "--dynamic-lr",
        type=float,
        default=None,
        help="with --text: also score it with dynamic evaluation, an SGD step of this size on each window after "
        "scoring it (megahash/eval/dynamic.py; default the run's eval.dynamic_lr; 0 = off)",
    )
    p.add_argument(
        "--dynamic-clip",
        type=float,
        default=None,
        help="with --text: dynamic evaluation's gradient clipping norm (default the run's eval.dynamic_clip)",
    )
    p.add_argument(
        "--weights",
        default="live",
        choices=["live", "ema"],
        help="the trained weights (live) or their average (ema, a run with train.ema.decay)",
    )
    p.add_argument(
        "--artifact",
        default=None,
        help="evaluate the round-tripped weights of this quantized artifact (megahash export --quantize)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from megahash.command_errors import run_guarded

    args = build_parser().parse_args(argv)

    def run():
        if args.limit is not None and not 0 < args.limit < math.inf:
            raise ConfigError(f"--limit {args.limit} must be a finite number > 0 (documents, or a fraction below 1)")
        for flag, value in (("--batch-size", args.batch_size), ("--max-length", args.max_length)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} {value} must be >= 1")
        if args.text is not None and not args.text.strip():
            raise ConfigError("--text is empty: pass a data-stage SRC (.txt, .jsonl, folder, hf:NAME:SPLIT, ...)")
        if args.text and args.tasks:
            raise ConfigError("--text scores raw text instead of tasks: pass --text or --tasks, not both")
        check_out(args.out, beside="" if args.text is not None else ".md")
        limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
        _quiet_logs()
        if args.stride is not None and args.text is None:
            raise ConfigError(
                "--stride scores raw text: pass it with --text SRC (lm-eval's tasks keep their own windows)"
            )
        if (args.dynamic_lr is not None or args.dynamic_clip is not None) and args.text is None:
            raise ConfigError(
                "--dynamic-lr/--dynamic-clip score raw text: pass them with --text SRC (lm-eval's tasks are static)"
            )
        if args.text is not None:  # loss, perplexity and bits per byte of raw text (megahash/eval/bits_per_byte.py)
            from megahash.eval.bits_per_byte import evaluate_text

            evaluate_text(
                args.checkpoint,
                args.text,
                args.out,
                limit,
                args.batch_size,
                args.max_length,
                args.tokenizer,
                args.override,
                overwrite=args.overwrite,
                stride=args.stride,
                weights=_weights(args),
                dynamic_lr=args.dynamic_lr,
                dynamic_clip=args.dynamic_clip,
            )
            return 0
        evaluate_checkpoint(
            args.checkpoint,
            args.tasks,
            args.tasks_dir,
            args.out,
            limit,
            args.batch_size,
            args.max_length,
            args.tokenizer,
            args.override,
            not args.no_incremental,
            overwrite=args.overwrite,
            weights=_weights(args),
            trust_task_code=args.trust_task_code,
        )
        return 0

    return run_guarded(run)


def _weights(args) -> str:
    """``--weights`` or ``--artifact`` (one-line error when both name weights or the artifact is missing)."""
    if args.artifact is None:
        return args.weights
    if args.weights != "live":
        raise ConfigError("--artifact and --weights ema exclude each other (the artifact holds one set of weights)")
    if not os.path.isfile(args.artifact):
        what = "is not a file" if os.path.exists(args.artifact) else "does not exist"
        raise ConfigError(f"--artifact {args.artifact} {what} (pass the file megahash export wrote)")
    return args.artifact


def _quiet_logs() -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lm_eval", "lm-eval", "datasets", "huggingface_hub", "fsspec", "filelock"):
        logging.getLogger(name).setLevel(logging.ERROR)


if __name__ == "__main__":
    sys.exit(main())
