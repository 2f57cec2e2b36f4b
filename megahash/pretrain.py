"""Pretraining entry point.

    deepspeed --num_gpus N megahash/pretrain.py --config configs/quickstart.yaml [key=value ...]
    deepspeed --num_gpus N megahash/pretrain.py --config A.yaml --config B.yaml --deepspeed --deepspeed_config ds.json
    torchrun --nproc_per_node N megahash/pretrain.py --config ... [key=value ...]
    python megahash/pretrain.py --config ... [key=value ...]          (one rank)
    python megahash/pretrain.py --check inputs --config ... [key=value ...]   (check only: prints train.save_dir)
    python megahash/pretrain.py --print-config --config ... [key=value ...]   (the resolved tree, every default)

Exit status: 0 done, 2 bad input (one-line ``error:`` message), 3 stopped by SIGUSR1/SIGTERM
after checkpointing (SLURM scripts requeue on it).
"""

from __future__ import annotations

import gc
import os
import sys

if __package__ in (None, ""):
    # Run as a script (deepspeed/torchrun megahash/pretrain.py): Python put megahash/ itself first on
    # sys.path, where its modules would shadow top-level names (``config``, ``data``). Put the repository
    # root there instead.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(_here))

import argparse


def parse_args(argv=None):
    from megahash.arguments import ArgumentParser

    p = ArgumentParser(
        prog="megahash-pretrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config",
        action="append",
        default=None,
        help="YAML config (configs/...); repeat to merge several, left to right (later files win)",
    )
    p.add_argument(
        "--deepspeed",
        nargs="?",
        const=True,
        default=None,
        help="DeepSpeed's flag (always on); `--deepspeed FILE` (Hugging Face style) = --deepspeed_config FILE",
    )
    p.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        default=None,
        help="a DeepSpeed JSON (= train.deepspeed_config); merged with megahash's keys, "
        "conflicts refused in one line (megahash/training/ds_config.py)",
    )
    p.add_argument(
        "--check",
        choices=("config", "inputs"),
        default=None,
        help="check without training (no torch import) and print train.save_dir: `config` the config, "
        "schedule, embeddings and DeepSpeed JSON; `inputs` also the shards, tokenizer and resume path "
        "(launch/quickstart.sh runs it before its launcher, whose output would bury the error line)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as YAML (every key, defaults included: what resolved_config.yaml "
        "starts from) after the checks of --check (config when not given) and exit; no torch import",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="= logging.verbose=true: also the libraries' known-harmless warnings, logs and progress bars",
    )
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 parallel.tensor=2")
    refuse = p.error  # an unknown flag: the override it stands for, if any
    p.error = lambda message: refuse(
        message + _flag_hint(message.partition("unrecognized arguments: ")[2].split(" ")[0])
    )
    args = p.parse_args(argv)
    if isinstance(args.deepspeed, str):
        if "=" in args.deepspeed and not args.deepspeed.endswith(".json"):
            args.overrides.insert(0, args.deepspeed)  # `--deepspeed key=value`: the flag, then an override
        elif args.deepspeed_config and args.deepspeed_config != args.deepspeed:
            p.error(f"--deepspeed {args.deepspeed} and --deepspeed_config {args.deepspeed_config} name two files")
        else:
            args.deepspeed_config = args.deepspeed
    if args.deepspeed_config:
        args.overrides.insert(0, f"train.deepspeed_config={args.deepspeed_config}")
    if args.verbose:
        args.overrides.append("logging.verbose=true")
    return args


def _flag_hint(token: str) -> str:
    """For a flag argparse does not know, the override it stands for: torchtitan's ``--training.steps=5`` and
    Megatron's ``--train-iters 100`` are megahash's ``train.steps=...`` (no dashes)."""
    if not token.startswith("--"):
        return ""
    name = token[2:].split("=", 1)[0]
    if "." in name:
        return f"; config overrides take no dashes: {name}=VALUE"
    from megahash.config import FOREIGN_NAMES, _leaf_keys

    leaf = name.replace("-", "_")
    keys = [FOREIGN_NAMES[leaf]] if leaf in FOREIGN_NAMES else sorted(_leaf_keys().get(leaf, []))
    return f"; as a config override: {' or '.join(f'{k}=VALUE' for k in keys)}" if keys else ""


def main(argv=None, exiting: bool = False) -> int:
    """``pretrain.py``'s entry; ``exiting``: the process ends after it (the script itself), so the stop signals
    stay ignored after the run instead of their handlers being restored (signals.restore)."""
    from megahash.training import signals

    previous = signals.install_early()  # first: a stop signal during start-up is honoured at the first step boundary
    status, built = 1, []
    try:
        status = _main(argv, built)
    except SystemExit as e:  # argparse's usage errors
        status = e.code if isinstance(e.code, int) else 1
        raise
    finally:
        signals.report_exit(status)  # to megahash/launching/supervise.py, if it started this rank
        if exiting:  # a late copy of a stop signal (SLURM's --signal again near the time limit) must not turn
            signals.ignore_stops()  # a finished rank's status into 138 while it tears down
        else:
            signals.restore(previous)
        # the run's engine and optimizer sit in reference cycles that hold its destroyed gloo groups and
        # their threads: free them now, so in-process callers (sweeps, tests) do not pile up threads (only after a
        # run was built: a full collection of a large caller's heap costs up to a second, a config error nothing)
        if built:
            gc.collect()
    return status


def check(args, inputs: bool = True):
    """The config of ``args`` after every check that needs no torch, megatron-core or DeepSpeed:
    config values, DeepSpeed JSON, layer kinds and embeddings, and (``inputs``) the files it names
    (megahash/inputs.py: shards, tokenizer, resume checkpoint)."""
    from megahash.config import load_config
    from megahash.models.schedules import check_kinds
    from megahash.training.ds_config import check_early

    cfg = load_config(args.config, args.overrides)
    if cfg.logging.verbose:  # before any library import, like known_warnings.install
        from megahash import known_warnings

        known_warnings.show_all()
    check_early(cfg)
    check_kinds(cfg)  # misspelt schedules/embeddings fail before the heavy imports
    if inputs:
        from megahash.inputs import check_training_inputs

        check_training_inputs(cfg)  # a missing/foreign tokenizer or damaged shard: before torch and step 1
    return cfg


def _main(argv=None, built: list | None = None) -> int:
    """``main`` without its signal and exit handling; ``built`` gets an entry once a run is about to be built."""
    from megahash import known_warnings
    from megahash.command_errors import run_guarded

    known_warnings.install()  # before any library import (megahash/known_warnings.py lists them)

    args = parse_args(argv)

    def run():
        cfg = check(args, inputs=args.check == "inputs" or not (args.check or args.print_config))
        if args.print_config:  # Hydra's --cfg job: the tree a run would start from
            print(cfg.to_yaml(), end="")
            return 0
        if args.check:
            print(cfg.train.save_dir)
            return 0
        if cfg.eval.interval:  # eval.interval: an unknown task name is refused before the model is built
            from megahash.eval.run import check_tasks

            check_tasks(cfg.eval.tasks or None, cfg.eval.tasks_dir or None, cfg.eval.trust_task_code)
        elif cfg.eval.at_end and cfg.eval.tasks_dir and not cfg.eval.trust_task_code:
            from megahash.eval.task_code import refuse_task_code

            refuse_task_code(cfg.eval.tasks_dir)  # before training, not after it
        from megahash.training.trainer import train

        if built is not None:
            built.append(True)

        def evaluate_at_end(save_dir):  # cfg.eval.at_end: lm-eval on the final checkpoint, rank 0
            from megahash.eval.run import evaluate_checkpoint

            evaluate_checkpoint(
                save_dir,
                cfg.eval.tasks or None,
                cfg.eval.tasks_dir or None,
                None,
                batch_size=cfg.eval.batch_size,
                trust_task_code=cfg.eval.trust_task_code,
            )

        return train(cfg, at_end=evaluate_at_end if cfg.eval.at_end else None)

    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main(exiting=True))
