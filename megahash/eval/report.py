"""``megahash report``: one markdown table of size, efficiency and scores across runs.

    megahash report --runs runs/a runs/b ... [--baseline runs/a] [--lower-bound runs/sha]
                    [--peop-params attention|total|embedding] [--out report.md]

Per run (a run directory or a ``step_N`` checkpoint; the latest complete checkpoint is used):

- parameters from the checkpoint's resolved config (:func:`megahash.models.accounting.count_parameters`
  at the checkpoint's vocabulary): total, embedding ([Xue25] sec. 2.8 counting), attention (every
  attention sublayer with its output projection);
- against ``--baseline`` (default: the first run): PCR_All, PCR_Emb (eq. 2.5-2.6), and PoEP
  (eq. 2.7) of the run itself;
- attention costs from :mod:`megahash.models.costs` ([Xue25] Tables 4.6 and 4.8), summed over the
  layers at batch 1 and the run's ``data.seq_length``: prefill FLOPs per token, decode FLOPs per
  token, inference cache bytes (16-bit) at that context;
- eval scores from the ``megahash eval`` JSON files in ``RUN_DIR/eval/`` (newest step wins per
  task); each task is summarised by its main metric (acc, exact_match, word_perplexity,
  perplexity, bits_per_byte, in that order of preference), with PRR against the baseline
  (sec. 3.4.6: inverse form for lower-is-better metrics) averaged over the tasks both runs have,
  and PEoP against ``--lower-bound`` (default: the baseline) with the ``--peop-params`` count
  (default attention, as in Tables 3.1-3.3; undefined when the counts are equal).

The table goes to stdout and ``--out`` (markdown), the numbers to ``--out`` with ``.json``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from megahash.errors import ConfigError
from megahash.eval import efficiency


def read_evals(run_dir: Path) -> dict:
    """task -> {"metric", "value", "higher_is_better", "step", "file"} from RUN_DIR/eval/*.json. A file that
    is not a megahash eval record is passed over; one that says it is but whose fields are of another shape
    (a string step, results that are not an object of objects, a score that is not a number) is passed over
    with one warning line naming it (they were TypeError/AttributeError/RecursionError tracebacks)."""
    found: dict = {}
    files = sorted((run_dir / "eval").glob("*.json")) if (run_dir / "eval").is_dir() else []
    from megahash.checkpoint.layout import read_json
    from megahash.eval.run import main_metric

    for f in files:
        try:
            rec = read_json(f)  # at most 64 MiB, nesting within the recursion limit, an object
        except (OSError, ValueError):
            continue
        if not rec.get("megahash_eval"):
            continue
        problem = _record_problem(rec)
        if problem:
            print(f"warning: {f} is passed over: {problem}", file=sys.stderr)
            continue
        step = rec.get("step") or 0
        for task, metrics in (rec.get("results") or {}).items():
            m = main_metric(metrics)
            if m is None:
                continue
            if task in found and found[task]["step"] > step:
                continue
            hib = ((rec.get("higher_is_better") or {}).get(task) or {}).get(m)
            if hib is None:
                hib = not ("perplexity" in m or m == "bits_per_byte")
            found[task] = {
                "metric": m,
                "value": metrics[m],
                "higher_is_better": bool(hib),
                "step": step,
                "file": str(f),
            }
    return found


def _record_problem(rec: dict) -> str:
    """ "" for an eval record of the shape ``megahash eval`` writes (as far as the report reads it), else what is not."""
    from megahash.eval.run import main_metric

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    step = rec.get("step")
    if step is not None and not (number(step) and step >= 0):
        return f"its step is {str(step)[:40]!r}, not a step number"
    for key in ("results", "higher_is_better"):
        table = rec.get(key)
        if table is not None and not (
            isinstance(table, dict) and all(isinstance(v, dict) or v is None for v in table.values())
        ):
            return f"its {key} is not an object of task objects"
    for task, metrics in (rec.get("results") or {}).items():
        m = main_metric(metrics or {})
        if m is not None and not number(metrics[m]):
            return f"the {m} of task {str(task)[:40]!r} is {str(metrics[m])[:40]!r}, not a number"
    return ""


def describe_run(path: str) -> dict:
    """Parameters, costs and eval scores of one run (see the module docstring)."""
    from megahash.checkpoint.layout import padded_vocab, read_state
    from megahash.checkpoint.resolve import checkpoint_config, resolve_checkpoint
    from megahash.checkpoint.weights import check_fits
    from megahash.models.accounting import count_parameters

    ckpt = resolve_checkpoint(path)
    cfg = checkpoint_config(ckpt)
    state = read_state(ckpt)
    vocab = padded_vocab(state, ckpt) if state.get("padded_vocab_size") else cfg.model.vocab_size
    check_fits(cfg, vocab, ckpt, meta=False)  # a config the weights cannot be (10**9 layers) counted for hours
    report = count_parameters(cfg, vocab)
    attention = sum(L["attention"]["qkv"] + L["attention"]["out"] for L in report["layers"])
    run_dir = ckpt.parent
    out = {
        "run": run_dir.name,
        "run_dir": str(run_dir),
        "checkpoint": str(ckpt),
        "step": state.get("step"),
        "schedule": cfg.model.schedule,
        "embedding_kind": cfg.model.embedding,
        "params": {"total": report["total"], "embedding": report["embedding"], "attention": attention},
        "costs": _costs(cfg, report["layers"]),
        "scores": read_evals(run_dir),
    }
    out["poep"] = efficiency.poep(report["embedding"], report["total"])
    return out


def name_apart(runs: list[dict]) -> None:
    """Runs of one folder name in different places (``a/quickstart``, ``b/quickstart``; cells of two sweeps) are
    named by as many trailing path parts as tell them apart (in place; they were rows of the same name)."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["run"], []).append(r)
    for same in groups.values():
        dirs = {r["run_dir"] for r in same}
        if len(dirs) < 2:
            continue  # one run (or the same run given twice): its name says which
        parts = {d: Path(d).parts for d in dirs}
        for k in range(2, max(map(len, parts.values())) + 1):
            names = {d: "/".join(p[-k:]) for d, p in parts.items()}
            if len(set(names.values())) == len(dirs):
                break
        for r in same:
            r["run"] = names[r["run_dir"]]


def _costs(cfg, layers) -> dict | None:
    try:
        from megahash.models import costs, registry
    except ImportError:
        return None
    fn = getattr(costs, "layer_costs", None)
    if fn is None:
        return None
    seq = cfg.data.seq_length
    skipped = registry.skipped_layers(cfg, [L["kind"] for L in layers])
    keys = ("prefill_flops_per_token", "decode_flops_per_token", "cache_bytes")
    total = {k: 0.0 for k in keys + tuple(f"impl_{k}" for k in keys)}  # [Xue25] tables, and implemented (impl_)
    try:
        for L, skip in zip(layers, skipped):
            if skip:
                continue
            c = fn(cfg, L["kind"], 1, seq)
            for k in total:  # a kind without a value makes the sum "n/a"
                v = c.get(k, "n/a")
                total[k] = total[k] + v if isinstance(v, (int, float)) and isinstance(total[k], float) else "n/a"
    except (KeyError, ValueError):
        return None
    total["context"] = seq
    return total


def compare(runs: list[dict], baseline: dict, lower: dict, peop_params: str) -> None:
    """Add pcr_all, pcr_emb, prr (per task + mean), peop (per task + mean) to every run (in place)."""
    for r in runs:
        p, b = r["params"], baseline["params"]
        r["pcr_all"] = efficiency.pcr_all(p["total"], b["total"])
        r["pcr_emb"] = efficiency.pcr_emb(p["embedding"], b["embedding"])
        r["prr"], r["peop"] = {}, {}
        for task, s in r["scores"].items():
            bs, ls = baseline["scores"].get(task), lower["scores"].get(task)
            if bs and bs["metric"] == s["metric"]:
                r["prr"][task] = efficiency.prr(s["value"], bs["value"], s["higher_is_better"])
            if ls and ls["metric"] == s["metric"]:
                r["peop"][task] = efficiency.peop(
                    s["value"], ls["value"], p[peop_params], lower["params"][peop_params], s["higher_is_better"]
                )
        vals = [v for v in r["prr"].values() if v is not None]
        r["prr_mean"] = sum(vals) / len(vals) if vals else None
        vals = [v for v in r["peop"].values() if v is not None]
        r["peop_mean"] = sum(vals) / len(vals) if vals else None


def _num(v, pct=False, digits=1) -> str:
    if v is None:
        return "–"
    if isinstance(v, str):  # "n/a"
        return v
    if pct:
        return f"{100 * v:.{digits}f}"
    if isinstance(v, int) or float(v).is_integer():
        v = int(v)
        return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}K" if v >= 1e4 else str(v)
    return f"{v:.4g}"


def markdown(runs: list[dict], baseline: dict, lower: dict, peop_params: str) -> str:
    tasks = sorted({t for r in runs for t in r["scores"]})
    metric = {t: next(r["scores"][t]["metric"] for r in runs if t in r["scores"]) for t in tasks}
    arrow = {
        t: "↑" if next(r["scores"][t]["higher_is_better"] for r in runs if t in r["scores"]) else "↓" for t in tasks
    }
    head = [
        "run",
        "schedule",
        "embedding",
        "#params",
        "#emb",
        "#attn",
        "PCR_All %",
        "PCR_Emb %",
        "PoEP %",
        "attn FLOPs/tok prefill (impl / thesis)",
        "attn FLOPs/tok decode (impl / thesis)",
        "cache bytes (impl / thesis)",
    ]
    head += [f"{t} {metric[t]} {arrow[t]}" for t in tasks] + ["PRR %", f"PEoP ({peop_params})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([" --- "] * 3 + [" ---: "] * (len(head) - 3)) + "|"]
    for r in runs:
        c = r["costs"] or {}
        row = [
            r["run"]
            + (" (baseline)" if r is baseline else "")
            + (" (lower bound)" if r is lower and r is not baseline else ""),
            r["schedule"],
            r["embedding_kind"],
            _num(r["params"]["total"]),
            _num(r["params"]["embedding"]),
            _num(r["params"]["attention"]),
            _num(r["pcr_all"], True),
            _num(r["pcr_emb"], True),
            _num(r["poep"], True, 2),
            *[
                f"{_num(c.get('impl_' + k))} / {_num(c.get(k))}"
                for k in ("prefill_flops_per_token", "decode_flops_per_token", "cache_bytes")
            ],
        ]
        for t in tasks:
            s = r["scores"].get(t)
            row.append("–" if s is None or s["value"] is None else f"{s['value']:.4g}")
        row += [_num(r["prr_mean"], True), _num(r["peop_mean"], digits=2) if r["peop_mean"] is not None else "–"]
        lines.append("| " + " | ".join(row) + " |")
    ctx = next((r["costs"]["context"] for r in runs if r.get("costs")), None)
    notes = [
        f"Baseline for PCR/PRR: {baseline['run']}; lower bound for PEoP: {lower['run']} ({peop_params} parameters).",
        "PRR: mean over tasks of eq. 2.4 (inverse form of sec. 3.4.6 for ↓ metrics); PCR/PoEP: eq. 2.5-2.7.",
    ]
    if ctx:
        notes.append(
            "Attention costs: implemented (measured GEMM FLOPs and decode cache of megahash's code, "
            "megahash.models.measured_costs) / thesis Tables 4.6/4.8 (megahash.models.costs), batch 1, "
            "context = each run's data.seq_length, summed over layers."
        )
    notes += empty_reasons(runs, baseline, lower, tasks, peop_params)
    notes += stale_scores(runs)
    return "\n".join(lines + [""] + notes)


def stale_scores(runs: list[dict]) -> list[str]:
    """One note per run whose scores are not of the checkpoint its row describes (an evaluation during training at
    step 3 of a run that went on to step 6, a killed run's older results): which tasks, of which steps."""
    notes = []
    for r in runs:
        other = {}
        for task, s in sorted(r["scores"].items()):
            if r.get("step") is not None and s.get("step") != r["step"]:
                other.setdefault(s.get("step"), []).append(task)
        if other:
            of = "; ".join(f"{', '.join(tasks)} of step {step}" for step, tasks in sorted(other.items(), key=str))
            notes.append(
                f"Scores of {r['run']} not of its newest checkpoint (step {r['step']}): {of} "
                f"(`megahash eval --checkpoint {r['run_dir']}` scores step {r['step']})."
            )
    return notes


def empty_reasons(runs: list[dict], baseline: dict, lower: dict, tasks: list[str], peop_params: str) -> list[str]:
    """One note per empty ("–") cell kind and run: why it is empty and what fills it."""
    notes = []
    for r in runs:
        name = r["run"]
        if not r["scores"]:
            notes.append(
                f"Empty scores, PRR and PEoP of {name}: no `megahash eval` results in {r['run_dir']}/eval/ "
                f"(run `megahash eval --checkpoint {r['run_dir']} --tasks-dir DIR --tasks SUITE`)."
            )
            continue
        missing = [t for t in tasks if t not in r["scores"]]
        if missing:
            notes.append(
                f"Empty {', '.join(missing)} of {name}: not evaluated in {r['run_dir']}/eval/ "
                f"(`megahash eval --checkpoint {r['run_dir']} --tasks {','.join(missing)}`)."
            )
        if r["prr_mean"] is None:
            notes.append(f"Empty PRR of {name}: no task scored with the same metric by the baseline {baseline['run']}.")
        if r["peop_mean"] is None:
            why = (
                "it is the lower bound"
                if r is lower
                else f"same {peop_params} parameter count as the lower bound {lower['run']} (eq. 2.7 divides by the difference; "
                f"pick another --lower-bound or --peop-params)"
                if r["params"][peop_params] == lower["params"][peop_params]
                else f"no task scored with the same metric by the lower bound {lower['run']}"
            )
            notes.append(f"Empty PEoP of {name}: {why}.")
        if not r.get("costs"):
            notes.append(
                f"Empty attention costs of {name}: a layer kind of {r['schedule']} has no Table 4.6/4.8 formula."
            )
        for key, label in (("pcr_all", "PCR_All"), ("pcr_emb", "PCR_Emb"), ("poep", "PoEP")):
            if r.get(key) is None:
                notes.append(f"Empty {label} of {name}: undefined for its parameter counts (a zero denominator).")
    return notes


def build_parser() -> argparse.ArgumentParser:
    from megahash.arguments import ArgumentParser

    p = ArgumentParser(prog="megahash report", description="Size, efficiency and eval scores of runs.")
    p.add_argument("--runs", nargs="+", required=True, help="run directories (or step_N checkpoints)")
    p.add_argument("--baseline", default=None, help="run for PCR/PRR (default: the first of --runs)")
    p.add_argument("--lower-bound", default=None, help="run for PEoP (default: the baseline)")
    p.add_argument("--peop-params", default="attention", choices=["attention", "total", "embedding"])
    p.add_argument("--out", default=None, help="markdown file (numbers beside it as .json)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from megahash.command_errors import run_guarded

    args = build_parser().parse_args(argv)

    def run():
        import warnings

        warnings.filterwarnings("ignore")
        from megahash.eval.run import check_out

        check_out(args.out, beside=".json")
        runs = [describe_run(p) for p in args.runs]
        name_apart(runs)
        by_path = {}
        for p, r in zip(args.runs, runs):
            by_path[str(Path(p).resolve())] = r
            by_path[str(Path(r["run_dir"]).resolve())] = r
            by_path[str(Path(r["checkpoint"]).resolve())] = r

        def pick(path):
            if path is None:
                return None
            key = str(Path(path).resolve())
            if key in by_path:
                return by_path[key]
            extra = describe_run(path)
            compare([extra], extra, extra, args.peop_params)
            return extra

        baseline = pick(args.baseline) or runs[0]
        lower = pick(args.lower_bound) or baseline
        if args.peop_params not in baseline["params"]:
            raise ConfigError(f"--peop-params {args.peop_params!r} is not a parameter count")
        compare(runs, baseline, lower, args.peop_params)
        table = markdown(runs, baseline, lower, args.peop_params)
        print(table)
        if args.out:
            from megahash.atomic_write import write_finite_json_atomic, write_text_atomic

            out = Path(args.out)  # each file under a temp name, then renamed: never half a table
            write_text_atomic(out, table + "\n")
            # an eval file of a diverged run: NaN / inf as null
            write_finite_json_atomic(
                out.with_suffix(".json"), {"runs": runs, "baseline": baseline["run"], "lower_bound": lower["run"]}
            )
            print(f"\nwrote {out} and {out.with_suffix('.json')}")
        return 0

    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main())
