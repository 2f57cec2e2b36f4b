#!/usr/bin/env python
"""megahash's training step against the plain transformers loop a user would write instead.

    python benchmarks/bench_vs_transformers.py [--shapes small,70m-shape,70m] [--rounds 5] [--steps 5]
                                              [--warmup 2] [--threads 2] [--prefix PREFIX --tokenizer SPM]

megahash side: the step ``megahash/pretrain.py`` runs (``trainer.build_engine`` + ``trainer.train_step``
through ``megahash.training.profiling.TrainHarness``: DeepSpeed engine of ``train.zero_stage`` (default
1), megatron-core model, megatron-core ``GPTDataset`` over real shards built by the data tools, the
resumable loader, clipping 1.0, the LR schedule), one rank, fp32.

transformers side: ``Qwen2ForCausalLM`` (sdpa attention) of the same shape (hidden, layers, heads, ffn,
QKV bias, tied head, vocabulary = megahash's padded vocabulary, RoPE base, RMSNorm eps; parameter
counts printed and checked equal) with ``torch.optim.AdamW(model.parameters())`` (its defaults),
``clip_grad_norm_(1.0)`` and the same ``LambdaLR`` schedule, on the same token batches (the batches
megahash's loader yields, in the same order), cross-entropy of the logits against the same labels.

Each side runs in its own worker process of this script (``--worker``), as each would in real use:
sharing one process would share one heap, and each side's allocations would change the other's
page faults (with glibc's defaults a step's large tensors are page-faulted in again when the heap
was trimmed or they were mmapped). The megahash worker writes the batches its loader yields to
``--work``; the transformers worker reads them. Both warm up, then alternate in rounds
(``--rounds`` x ``--steps`` steps per side, only one side running at a time; the side that starts
alternates), so machine noise hits both alike. Reported: median tokens/s over all
measured steps (wall clock), the median from process CPU time, and megahash / transformers ratios.
Shapes: ``small`` (h256, 4L, 4 heads, ffn 1024, seq 256, batch 8), ``70m-shape`` (h512, 6L, 8 heads,
ffn 2048, seq 512, batch 4; tokenizer vocabulary) and ``70m`` (the same with configs/model/70m.yaml's
50,304-token vocabulary); for GPUs ``500m`` (configs/model/500m.yaml, seq 2048, batch 8) and ``500m-4l``.

On a GPU both sides run there at the same precision policy, megahash's (``--precision``, default auto: bf16 on
GPUs): fp32 parameters (the master weights) and fp32 AdamW state stepped by torch's fused AdamW, forward and loss
under ``torch.autocast`` to bf16 (:func:`megahash.accelerator.policy.compute_context`); megahash with ``--compile``
(default auto: compiled layers), transformers eager and, with ``--hf-compiled``, under ``torch.compile`` (a third
worker). Timings synchronise the device; each worker reports its peak GPU memory, and MFU is the project's
FLOPs per token (:func:`megahash.models.costs.train_flops_per_token`, the same model on both sides) times
tokens/s over the device's peak (:func:`megahash.accelerator.measurement.peak_flops`). ``benchmarks/gpu_check.sh`` runs it
on the 4-layer slice of the 500M shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "small": dict(hidden=256, layers=4, heads=4, ffn=1024, seq=256, batch=8, vocab=0),
    "70m-shape": dict(hidden=512, layers=6, heads=8, ffn=2048, seq=512, batch=4, vocab=0),
    "70m": dict(hidden=512, layers=6, heads=8, ffn=2048, seq=512, batch=4, vocab=50304),
    # GPU shapes (configs/model/500m.yaml, seq 2048): the whole 500M and a 4-layer slice of it
    "500m": dict(hidden=896, layers=24, heads=14, ffn=4864, seq=2048, batch=8, vocab=50304),
    "500m-4l": dict(hidden=896, layers=4, heads=14, ffn=4864, seq=2048, batch=8, vocab=50304),
}


def build_shards(work: Path) -> tuple[str, str]:
    """A 4,000-piece BPE tokenizer and token shards of the Shakespeare corpus (the real data tools)."""
    work.mkdir(parents=True, exist_ok=True)
    spm, prefix = work / "spm", work / "shakespeare"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if not Path(f"{spm}.model").is_file():
        subprocess.run(
            [
                sys.executable,
                "data_tools/train_tokenizer.py",
                "--input",
                "shakespeare",
                "--output",
                str(spm),
                "--vocab-size",
                "4000",
            ],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
        )
    if not Path(f"{prefix}_text_document.idx").is_file():
        subprocess.run(
            [
                sys.executable,
                "data_tools/preprocess_data.py",
                "--input",
                "shakespeare",
                "--output-prefix",
                str(prefix),
                "--tokenizer",
                f"{spm}.model",
                "--workers",
                "1",
                "--quiet",
            ],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
        )
    return str(prefix), f"{spm}.model"


def megahash_config(
    shape: dict, prefix: str, tokenizer: str, cache: str, precision: str = "auto", compile_setting: str = "auto"
):
    from megahash.config import load_config

    over = [
        f"model.hidden_size={shape['hidden']}",
        f"model.num_layers={shape['layers']}",
        f"model.num_heads={shape['heads']}",
        f"model.ffn_hidden_size={shape['ffn']}",
        f"model.vocab_size={shape['vocab']}",
        f"model.max_position_embeddings={max(2048, shape['seq'])}",
        f"data.seq_length={shape['seq']}",
        f"data.prefix=[{prefix}]",
        f"data.tokenizer={tokenizer}",
        f"data.cache_dir={cache}",
        f"train.micro_batch_size={shape['batch']}",
        f"train.global_batch_size={shape['batch']}",
        f"train.precision={precision}",
        "train.warmup_steps=2",
        f"train.compile={compile_setting}",
    ]
    return load_config(None, over)


class HFLoop:
    """The plain loop: Qwen2ForCausalLM + torch AdamW + clip + LambdaLR over given batches."""

    def __init__(self, cfg, vocab: int, batches: list[dict], compiled: bool = False):
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from megahash.accelerator import policy
        from megahash.training.lr_schedule import lambda_for

        m, t = cfg.model, cfg.train
        hf_cfg = Qwen2Config(
            vocab_size=vocab,
            hidden_size=m.hidden_size,
            intermediate_size=m.ffn_hidden_size,
            num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads,
            num_key_value_heads=m.num_query_groups or m.num_heads,
            max_position_embeddings=m.max_position_embeddings,
            rms_norm_eps=m.norm_eps,
            rope_theta=float(m.rotary_base),
            tie_word_embeddings=m.tie_embeddings,
            attention_dropout=0.0,
            use_cache=False,
            initializer_range=m.init_std,
        )
        hf_cfg._attn_implementation = "sdpa"
        torch.manual_seed(t.seed)
        dev = policy.device()
        # megahash's precision policy on both sides: fp32 parameters and AdamW state, compute under autocast
        self.model = Qwen2ForCausalLM(hf_cfg).to(dev, policy.param_dtype(t.precision, dev)).train()
        self.context = lambda: policy.compute_context(t.precision, dev)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            weight_decay=t.weight_decay,
            **policy.adamw_options(dev),
        )
        if compiled:
            self.model = torch.compile(self.model)
        batches = [{k: v.to(dev) for k, v in b.items()} for b in batches]
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda_for(t))
        self.clip = t.clip_grad
        self.batches = batches
        self.i = 0
        self.vocab = vocab

    def step(self) -> float:
        import torch
        import torch.nn.functional as F

        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        with self.context():
            logits = self.model(input_ids=b["tokens"]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), b["labels"].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


REPLY = "@bench-worker "  # the prefix of a worker's replies on its stdout (libraries print there too)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> tuple[float, float]:
    _sync()
    w, c = time.perf_counter(), time.process_time()
    fn()
    _sync()
    return time.perf_counter() - w, time.process_time() - c


def worker(args) -> int:
    """One side in its own process: build, warm up, then run ``N`` timed steps per ``run N`` line read
    from stdin and answer each with one JSON line of (wall, CPU) seconds per step."""
    import torch

    from megahash.accelerator import measurement, policy, process_groups

    shape = SHAPES[args.shape]
    cfg = megahash_config(
        shape, args.prefix, args.tokenizer, str(Path(args.work) / "cache"), args.precision, args.compile
    )
    total = args.warmup + args.rounds * args.steps
    batches_file = Path(args.work) / f"batches_{args.shape}.pt"
    if args.worker == "megahash":
        from megahash.data.dataset import make_loader
        from megahash.training.profiling import TrainHarness

        process_groups.init_distributed(1)
        mh = TrainHarness(cfg, total + 1)
        loader = make_loader(mh.data.train, 0, cfg.train.micro_batch_size, 0, 1)
        from megahash.atomic_write import atomic_path

        with atomic_path(batches_file) as tmp:
            torch.save([b for _, b in zip(range(total), loader)], tmp)
        from megahash.models.costs import train_flops_per_token

        flops = train_flops_per_token(cfg, mh.data.vocab_size)
        step, info = (
            mh.step,
            dict(
                params=mh.num_params,
                vocab=mh.model.vocab_size,
                optimizer=type(mh.engine.optimizer).__name__,
                flops_per_token=flops if isinstance(flops, (int, float)) else None,
                peak_flops=measurement.peak_flops(policy.train_dtype(cfg.train.precision)),
            ),
        )
    else:
        hf = HFLoop(cfg, args.vocab, torch.load(batches_file), compiled=args.worker == "transformers-compiled")
        step, info = hf.step, dict(params=hf.num_params, vocab=args.vocab, optimizer=type(hf.opt).__name__)
    for _ in range(args.warmup):
        step()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        step()
        info["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(REPLY + json.dumps(info), flush=True)
    for line in sys.stdin:
        if not line.startswith("run "):
            break
        print(REPLY + json.dumps([timed(step) for _ in range(int(line.split()[1]))]), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the sides take turns on one GPU
    if args.worker == "megahash":
        process_groups.teardown()
    return 0


class Side:
    """A worker process of this script running one side."""

    def __init__(self, name: str, shape: str, args, extra: list[str]):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            name,
            "--shape",
            shape,
            "--work",
            args.work,
            "--prefix",
            args.prefix,
            "--tokenizer",
            args.tokenizer,
            "--rounds",
            str(args.rounds),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--threads",
            str(args.threads),
            *extra,
        ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(args.threads),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = None

    def ready(self) -> Side:
        """Wait for the worker's build and warm-up (its info)."""
        if self.info is None:
            self.info = self._read()
        return self

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY) :])
            sys.stderr.write(line)  # a library's own print
        raise SystemExit(f"a benchmark worker exited with status {self.proc.wait()} (its error is above)")

    def run(self, n: int) -> list[tuple[float, float]]:
        self.proc.stdin.write(f"run {n}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def run_shape(name: str, shape: dict, args) -> dict:
    """The sides of one shape: megahash's first (it writes the batches and says the vocabulary), then the
    transformers sides started together (their start-up, build and warm-up overlap; the timed rounds that follow
    run one side at a time)."""
    sides = {"megahash": Side("megahash", name, args, []).ready()}
    vocab = ["--vocab", str(sides["megahash"].info["vocab"])]
    sides["transformers"] = Side("transformers", name, args, vocab)
    if args.hf_compiled:
        sides["transformers-compiled"] = Side("transformers-compiled", name, args, vocab)
    for side in sides.values():
        side.ready()
    mh, hf = sides["megahash"].info, sides["transformers"].info
    same = mh["params"] == hf["params"]
    print(
        f"# {name}: h{shape['hidden']} {shape['layers']}L {shape['heads']} heads ffn {shape['ffn']} "
        f"seq {shape['seq']} batch {shape['batch']} vocab {mh['vocab']} (tied head); parameters "
        f"megahash {mh['params']:,} transformers {hf['params']:,}{'' if same else '  MISMATCH'}; "
        f"megahash optimizer {mh['optimizer']}",
        flush=True,
    )
    try:
        if not same:
            raise SystemExit(f"{name}: the two models differ in size")
        times = {k: ([], []) for k in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for k in order:
                for w, c in sides[k].run(args.steps):
                    times[k][0].append(w)
                    times[k][1].append(c)
            med = {k: statistics.median(v[0]) for k, v in times.items()}
            cpu = {k: statistics.median(v[1]) for k, v in times.items()}
            print(
                f"  round {r + 1}: megahash {med['megahash'] * 1e3:.0f} ms, transformers "
                f"{med['transformers'] * 1e3:.0f} ms per step (medians of {len(times['megahash'][0])} steps so far;"
                f" ratio {med['transformers'] / med['megahash']:.2f}x wall, "
                f"{cpu['transformers'] / cpu['megahash']:.2f}x CPU time)",
                flush=True,
            )
    finally:
        for side in sides.values():
            side.close()
    tok = shape["seq"] * shape["batch"]
    res = {"name": name, "params": mh["params"], "vocab": mh["vocab"], "n": len(times["megahash"][0])}
    for k, (w, c) in times.items():
        res[k] = (tok / statistics.median(w), tok / statistics.median(c))
    res["ratio"] = res["megahash"][0] / res["transformers"][0]
    res["ratio_cpu"] = res["megahash"][1] / res["transformers"][1]
    if "transformers-compiled" in res:
        res["ratio_compiled"] = res["megahash"][0] / res["transformers-compiled"][0]
    res["peak_gib"] = {k: side.info.get("peak_gib") for k, side in sides.items()}
    flops, peak = mh.get("flops_per_token"), mh.get("peak_flops")
    res["mfu"] = {k: (flops * res[k][0] / peak if flops and peak else None) for k in sides}
    res["optimizer"] = mh["optimizer"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="small,70m-shape,70m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="measured steps per side per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "megahash_bench_vs_hf"))
    ap.add_argument("--prefix", default="", help="existing shard prefix (default: build Shakespeare shards in --work)")
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--precision", default="auto", help="megahash train.precision (auto: bf16 on GPUs, fp32 on CPU)")
    ap.add_argument("--compile", default="auto", help="megahash train.compile (auto: on for GPUs)")
    ap.add_argument("--hf-compiled", action="store_true", help="also time transformers under torch.compile")
    ap.add_argument("--worker", choices=("megahash", "transformers", "transformers-compiled"), help=argparse.SUPPRESS)
    ap.add_argument("--shape", choices=tuple(SHAPES), help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    if args.worker:
        return worker(args)
    if not args.prefix:
        args.prefix, args.tokenizer = build_shards(Path(args.work))
    import transformers

    from megahash.accelerator import policy

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(
        f"device {policy.device()} ({gpu}, CUDA {torch.version.cuda}), precision {args.precision} -> "
        f"{policy.train_dtype(args.precision)}, megahash compile {args.compile} -> "
        f"{policy.compile_layers(args.compile)}; "
        f"threads {torch.get_num_threads()}, 1 rank per side, each side in its own process "
        f"(MEGAHASH_MALLOC_TUNING={os.environ.get('MEGAHASH_MALLOC_TUNING', 'unset')}); torch "
        f"{torch.__version__}, transformers {transformers.__version__}; {args.rounds} rounds x {args.steps} "
        f"steps per side after {args.warmup} warm-up"
    )
    rows = [run_shape(n, SHAPES[n], args) for n in args.shapes.split(",")]
    print()
    print(
        "| shape | params | vocab | steps | megahash tokens/s | transformers tokens/s | ratio | ratio (CPU time) | "
        "transformers compiled tokens/s | ratio vs compiled | MFU megahash / transformers / compiled | "
        "peak GiB megahash / transformers / compiled |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        comp = (
            f"{r['transformers-compiled'][0]:,.0f} | {r['ratio_compiled']:.2f}x"
            if "ratio_compiled" in r
            else "not run | n/a"
        )
        peak = " / ".join("n/a" if v is None else f"{v:.1f}" for v in r["peak_gib"].values())
        mfu = " / ".join("n/a" if v is None else f"{100 * v:.1f}%" for v in r["mfu"].values())
        print(
            f"| {r['name']} | {r['params'] / 1e6:.1f}M | {r['vocab']:,} | {r['n']} | {r['megahash'][0]:,.0f} | "
            f"{r['transformers'][0]:,.0f} | {r['ratio']:.2f}x | {r['ratio_cpu']:.2f}x | {comp} | {mfu} | {peak} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
