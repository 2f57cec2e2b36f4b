"""Launch count, activation memory and CPU time of every attention kind's model (issue 26's CPU table).

For each registered attention kind a small uniform decoder (default: hidden 256, 2 layers, 4 heads
of dim 64, batch 1, fp32) runs forward + backward of one sequence at each length (default 2048 and
8192) and reports

* ATen calls: operator calls of the whole step counted with a ``TorchDispatchMode`` (forward and
  backward; what a GPU pays one kernel launch or more for). A kind whose count grows with the
  length runs a Python loop over the sequence;
* saved MB: bytes of the tensors autograd saves for backward (``saved_tensors_hooks``, distinct
  storages, parameters excluded): activation memory;
* CPU s: CPU seconds (``time.process_time``, all threads of the process) of an uninstrumented
  forward + backward (the fastest of ``--repeat`` steps), and its wall-clock seconds. On a shared, oversubscribed machine the CPU time
  is the steadier of the two (it does not count waiting for a core); compare with ``mha`` measured
  in the same run, and read the load printed beside the table.

``--extra`` adds variants as ``kind@override,override`` rows (default: Based's projected feature
dimension, ``approx@model.attention.options.feature_dim=16``). A kind written as a schedule
(``hybrid:approx:even``: every other layer of the kind, the others ``mha``) runs that schedule.

    PYTHONPATH=. python benchmarks/bench_kinds_cpu.py [--kinds mha,approx] [--seqs 2048,8192] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from megahash.accelerator import process_groups, rng
from megahash.config import load_config
from megahash.training.op_count import CountOps

VOCAB = 1024


def kinds_of_registry() -> list[str]:
    from megahash import catalog

    names = list(catalog.entries("attention"))
    return ["mha"] + [k for k in names if k != "mha"]


def schedule_of(kind: str) -> str:
    """A kind's uniform schedule; a row named as a schedule (``hybrid:approx:even``) runs as given."""
    return kind if ":" in kind else f"uniform:{kind}"


def build(kind: str, overrides: list[str], args):
    from megahash.models.attention import fixed_qk
    from megahash.models.megatron_model import build_model

    longest = max(args.seqs) + 8
    cfg = load_config(
        None,
        [
            f"model.hidden_size={args.hidden}",
            f"model.num_heads={args.heads}",
            f"model.num_layers={args.layers}",
            f"model.ffn_hidden_size={4 * args.hidden}",
            f"model.schedule={schedule_of(kind)}",
            f"model.max_position_embeddings={longest}",
            f"model.attention.options.fixed_seq_length={longest}",
            f"data.seq_length={max(args.seqs)}",
            *overrides,
        ],
    )
    rng.seed_all(0)
    model = build_model(cfg, VOCAB, dtype=torch.float32)
    if getattr(model, "fixed_qk", None) is not None and model.fixed_qk.source == "text":
        fixed_qk.set_fixed_tokens(model, [(31 * i + 7) % VOCAB for i in range(longest)])
    return model.train()


def step(model, tok):
    from megatron.core import tensor_parallel

    logits = model.logits(model.hidden_states(tok))
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), tok.t().contiguous()).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)


def measure(model, seq: int, repeat: int = 1) -> dict:
    from bench_attention import saved_bytes_hooks

    tok = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seq))
    counter = CountOps()
    with counter:
        step(model, tok)
    seen, hooks = saved_bytes_hooks(model)
    with hooks:
        logits = model.logits(model.hidden_states(tok))
    saved = sum(seen.values())
    del logits
    times = []
    for _ in range(max(1, repeat)):
        t0, c0 = time.perf_counter(), time.process_time()
        step(model, tok)
        times.append((time.process_time() - c0, time.perf_counter() - t0))
    seconds, wall = min(times)
    return {
        "calls": counter.total(),
        "saved": saved,
        "wall": wall,
        "seconds": seconds,
        "top": counter.calls.most_common(3),
    }


def table(rows: dict, seqs: list[int]) -> str:
    lo, hi = seqs[0], seqs[-1]
    head = (
        f"| kind | ATen calls {' / '.join(map(str, seqs))} | saved MB at {lo} | saved MB at {hi} "
        f"| CPU s at {lo} | CPU s at {hi} | x mha at {hi} | wall s at {hi} |"
    )
    out = [head, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ref = rows.get("mha", {}).get(hi, {}).get("seconds")
    for name, r in rows.items():
        calls = " / ".join(f"{r[s]['calls']:,}" for s in seqs)
        ratio = f"{r[hi]['seconds'] / ref:.2f}" if ref else "n/a"
        out.append(
            f"| {name} | {calls} | {r[lo]['saved'] / 2**20:,.0f} | {r[hi]['saved'] / 2**20:,.0f} "
            f"| {r[lo]['seconds']:.1f} | {r[hi]['seconds']:.1f} | {ratio} | {r[hi]['wall']:.1f} |"
        )
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="", help="comma-separated (default: every registered attention kind)")
    ap.add_argument(
        "--extra",
        default="approx@model.attention.options.feature_dim=16",
        help="';'-separated kind@override,override rows ('' for none)",
    )
    ap.add_argument("--seqs", default="2048,8192")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="uninstrumented steps per length; the fastest (CPU seconds) is reported (steadier under load)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default="", help="also write the markdown table here (temp name, then rename)")
    args = ap.parse_args(argv)
    args.seqs = [int(x) for x in args.seqs.split(",")]
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    kinds = args.kinds.split(",") if args.kinds else kinds_of_registry()
    variants = [(k, k, []) for k in kinds]
    for item in filter(None, args.extra.split(";")):
        kind, _, over = item.partition("@")
        variants.append((f"{kind} ({over.split('.')[-1]})" if over else kind, kind, over.split(",") if over else []))

    process_groups.init_distributed(1)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(
        f"hidden={args.hidden} heads={args.heads} layers={args.layers} threads={torch.get_num_threads()} "
        f"load before: {load}",
        flush=True,
    )
    rows = {}
    for name, kind, over in variants:
        model = build(kind, over, args)
        rows[name] = {s: measure(model, s, args.repeat) for s in args.seqs}
        r = rows[name][args.seqs[-1]]
        print(
            f"  {name}: {r['calls']} calls, {r['saved'] / 2**20:.0f} MB, {r['seconds']:.1f} s, top {r['top']}",
            file=sys.stderr,
            flush=True,
        )
        del model
    text = table(rows, args.seqs)
    after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(text)
    print(f"load after: {after}")
    if args.out:
        cmd = "PYTHONPATH=. python benchmarks/bench_kinds_cpu.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        body = (
            f"`{cmd}`\n\nhidden {args.hidden}, {args.layers} layers, {args.heads} heads of "
            f"{args.hidden // args.heads}, batch 1, fp32, forward + backward of the model; "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}.\n"
            f"Load: before `{load}`; after `{after}` (2 cores shared with other jobs: CPU seconds are noisy).\n\n"
            f"{text}\n"
        )
        from megahash.atomic_write import write_text_atomic

        write_text_atomic(args.out, body)
    process_groups.teardown()


if __name__ == "__main__":
    main()
