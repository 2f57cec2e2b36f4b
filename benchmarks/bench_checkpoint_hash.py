#!/usr/bin/env python
"""What the per-file sha256 of a checkpoint's manifest costs: a save with the digests against the same
save writing a manifest of sizes only, and the checks of a resume (``train.verify_checkpoint``).

    python benchmarks/bench_checkpoint_hash.py [--model 70m] [--rounds 6] [--out FILE]

One rank in this process (DeepSpeed ZeRO-1 engine on the CPU, ``configs/quickstart.yaml`` +
``configs/model/70m.yaml``, Shakespeare shards built here with the data tools), one training step,
then ``rounds`` pairs of synchronous saves (megahash/training/checkpoint.py ``save``), with and
without the digests, alternating which goes first; ratio = median save with digests / median save
without, of the wall time and of the CPU time (this process and megatron's forked file writers). Then the verification of the last checkpoint as a resume runs it (manifest.damage): cheap
(sizes, zip structure) and full (sha256 of every file), each timed ``rounds`` times. Last,
``rounds`` saves of ``train.async_save``: the step loop's stall and what of the hashing remains on
it (the manifest at the publication, and the bytes it had to hash itself).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_async_save import MODELS, shards  # noqa: E402  (the same model lines and shards)


def _cpu_seconds() -> float:
    """User + system CPU of this process and its finished children (megatron's forked file writers)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _async_saves(run, cfg, step: int, rounds: int) -> dict:
    """``rounds`` saves of ``train.async_save`` in this process: the step loop's stall (the save's
    planning and fork, then every poll until the publication), the time of the manifest at the
    publication and the bytes it hashed itself (the writers hashed the rest in their processes)."""
    from megahash.checkpoint import digest, manifest
    from megahash.training import async_save

    out = {"stall": [], "manifest": [], "bytes": []}
    own_write, own_digests = manifest.write_manifest, digest.digests

    def timed_write(*args, **kwargs):
        t0 = time.perf_counter()
        own_write(*args, **kwargs)
        out["manifest"].append(time.perf_counter() - t0)

    def counted(paths, *args, **kwargs):
        paths = list(paths)
        out["bytes"].append(sum(Path(p).stat().st_size for p in paths))
        return own_digests(paths, *args, **kwargs)

    manifest.write_manifest, digest.digests = timed_write, counted
    saver = async_save.AsyncSaver(cfg)
    saver.warm.join()
    try:
        for i in range(rounds):
            t0 = time.perf_counter()
            saver.save(run.engine, step + i, run.consumed(1), wait=False)
            stall = time.perf_counter() - t0
            while saver.pending is not None:
                time.sleep(0.05)
                stall += saver.finish(blocking=False)
            out["stall"].append(stall)
    finally:
        saver.close(abort=False)
        manifest.write_manifest, digest.digests = own_write, own_digests
    ckpt = Path(cfg.train.save_dir) / (Path(cfg.train.save_dir) / "latest").read_text()
    out["size"] = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="70m", choices=sorted(MODELS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    from megahash.accelerator import process_groups
    from megahash.checkpoint.manifest import damage
    from megahash.config import load_config
    from megahash.training import checkpoint, trainer

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        prefix, tok = shards(d)
        argv, configs = MODELS[a.model], []
        while argv and argv[0] == "--config":
            configs.append(str(ROOT / argv[1]))
            argv = argv[2:]
        cfg = load_config(
            configs,
            [
                *argv,
                f"data.prefix=[{prefix}]",
                f"data.tokenizer={tok}",
                f"train.save_dir={d / 'run'}",
                "train.steps=1000",
                "train.keep_last=1",
                "train.eval_interval=0",
                "train.log_interval=1000",
                "logging.plot=false",
                "logging.tensorboard=false",
            ],
        )
        rank, world = process_groups.init_distributed(1)
        run = trainer._set_up(cfg, rank, world)
        trainer._train_step_logged(run)
        times, cpu = {True: [], False: []}, {True: [], False: []}
        step = 1
        for r in range(a.rounds):
            for hashes in (True, False) if r % 2 == 0 else (False, True):
                c0, t0 = _cpu_seconds(), time.perf_counter()
                checkpoint.save(run.engine, cfg, step, run.consumed(1), hashes=hashes)
                times[hashes].append(time.perf_counter() - t0)
                cpu[hashes].append(_cpu_seconds() - c0)
                step += 1
        checkpoint.save(run.engine, cfg, step, run.consumed(1))  # the checkpoint verified below
        ckpt = d / "run" / (d / "run" / "latest").read_text()
        size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        verify = {}
        for level in ("cheap", "full"):
            verify[level] = []
            for _ in range(a.rounds):
                t0 = time.perf_counter()
                assert damage(ckpt, level) is None
                verify[level].append(time.perf_counter() - t0)
        asynchronous = _async_saves(run, cfg, step + 1, a.rounds)
        trainer._close(run)
        process_groups.teardown()
    with_h, without = statistics.median(times[True]), statistics.median(times[False])
    lines = [
        f"model {a.model}, checkpoint {size / 2**20:.0f} MiB, {a.rounds} saves each, load average "
        f"{os.getloadavg()[0]:.2f} at the end",
        "",
        "| save | wall, each, s | wall, median, s | CPU (process + writers), median, s |",
        "| --- | --- | --- | --- |",
        *(
            f"| {'sha256 digests' if h else 'sizes only'} | {', '.join(f'{x:.2f}' for x in times[h])} "
            f"| {statistics.median(times[h]):.3f} | {statistics.median(cpu[h]):.3f} |"
            for h in (True, False)
        ),
        "",
        f"ratio (median with digests / median without): wall {with_h / without:.3f}, "
        f"CPU {statistics.median(cpu[True]) / statistics.median(cpu[False]):.3f}",
        "",
        "| verification of a resume | each, s | median, s |",
        "| --- | --- | --- |",
        *(
            f"| {level} | {', '.join(f'{x:.2f}' for x in verify[level])} | {statistics.median(verify[level]):.3f} |"
            for level in verify
        ),
    ]
    lines += [
        "",
        "train.async_save: what of the hashing stays on the training path (the publication's manifest)",
        "",
        "| asynchronous save | median |",
        "| --- | --- |",
        f"| stall of the step loop (planning + fork, then the publication), s | {statistics.median(asynchronous['stall']):.3f} |",
        f"| of which the manifest at the publication, s | {statistics.median(asynchronous['manifest']):.3f} |",
        f"| bytes hashed there (what no writer's sidecar covered) | {statistics.median(asynchronous['bytes']):,.0f} |",
        f"| bytes of the checkpoint (no DeepSpeed copy) | {asynchronous['size']:,.0f} |",
    ]
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
