"""Pretraining entry point.

    deepspeed --num_gpus N megahash/pretrain.py --config configs/quickstart.yaml [key=value ...]
    torchrun --nproc_per_node N megahash/pretrain.py --config ... [key=value ...]
    python megahash/pretrain.py --config ... [key=value ...]          (one rank)

Exit status: 0 done, 2 bad input (one-line ``error:`` message), 3 stopped by SIGUSR1/SIGTERM
after checkpointing (SLURM scripts requeue on it).
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    # Run as a script (deepspeed/torchrun megahash/pretrain.py): Python put megahash/ itself first on
    # sys.path, where megahash/platform.py would shadow the stdlib ``platform``. Put the repository
    # root there instead.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(_here))

import argparse  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="megahash-pretrain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="YAML config (configs/...)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 parallel.tensor=2")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from megahash.cli import run_guarded

    args = parse_args(argv)

    def run():
        from megahash.config import load_config
        from megahash.training.trainer import train

        cfg = load_config(args.config, args.overrides)
        return train(cfg)

    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main())
