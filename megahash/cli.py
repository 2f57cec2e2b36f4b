"""The ``megahash`` command (also ``python -m megahash``).

Subcommands: ``pretrain`` (same as megahash/pretrain.py), ``params`` (parameter accounting);
later stages add ``eval``, ``indicators``, ``report``, ``export-hf``, ``import-hf`` via SUBCOMMANDS.
Every user-facing error is one line ``error: ...`` with exit status 2. ``--verbose`` (any subcommand)
shows what megahash/known_warnings.py silences.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from megahash.arguments import ArgumentParser
from megahash.command_errors import run_guarded
from megahash.errors import print_error

# name -> "module:function" taking argv (list[str]) and returning an exit status
SUBCOMMANDS = {
    "pretrain": "megahash.pretrain:main",
    "params": "megahash.cli:params_main",
    "eval": "megahash.eval.run:main",
    "indicators": "megahash.eval.indicators:main",
    "report": "megahash.eval.report:main",
    "export-hf": "megahash.convert.export:main",
    "export": "megahash.convert.artifact:main",  # a quantized artifact (issue 37)
    "import-hf": "megahash.convert.importer:main",
    "sweep": "megahash.experiments.sweep:main",
    "diagnose": "megahash.experiments.diagnose:main",
}

# subcommand -> (option, what it names): inputs that must exist, checked before the subcommand's
# module is imported (several import torch, megatron-core or lm-eval: 10-40 s before a typo is seen)
INPUTS = {
    "eval": (("--checkpoint", "checkpoint"), ("--tasks-dir", "--tasks-dir")),
    "indicators": (("--checkpoint", "checkpoint"), ("--text", "--text")),
    "report": (("--runs", "checkpoint"), ("--baseline", "checkpoint"), ("--lower-bound", "checkpoint")),
    "export-hf": (("--checkpoint", "checkpoint"),),
    "export": (("--checkpoint", "checkpoint"),),
    "import-hf": (("--hf", "--hf"),),
}


def option_values(argv: list[str], option: str) -> list[str]:
    """Values given to ``option`` in ``argv`` (``--opt V``, ``--opt=V``, ``--opt V1 V2`` up to the next option)."""
    values = []
    for i, a in enumerate(argv):
        if a.startswith(option + "="):
            values.append(a.split("=", 1)[1])
        elif a == option:
            for v in argv[i + 1 :]:
                if v.startswith("-"):
                    break
                values.append(v)
    return values


def check_inputs(name: str, argv: list[str]) -> None:
    """One-line error for the first missing input of :data:`INPUTS` (the subcommand re-checks the rest)."""
    from megahash.errors import MegahashError

    for option, what in INPUTS.get(name, ()):
        for value in option_values(argv, option):
            if not os.path.exists(value):
                raise MegahashError(f"{what} {value} does not exist")


def params_main(argv=None) -> int:
    p = ArgumentParser(prog="megahash params", description="Parameter accounting of a config.")
    p.add_argument("--config", action="append", default=None, help="YAML config; repeat to merge left to right")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--vocab-size", type=int, default=0, help="vocabulary (default: model.vocab_size or 50304)")
    p.add_argument(
        "--measure",
        action="store_true",
        help="also measure the implementation's attention costs on a meta-device model (imports torch, megatron-core)",
    )
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    def run():
        from megahash.config import load_config
        from megahash.models.closed_form import closed_form_report

        cfg = load_config(args.config, args.overrides)
        vocab = args.vocab_size or cfg.model.vocab_size or 50304
        # pure Python for the standard decoder (< 1 s); other variants and --measure: a meta-device model
        report = None if args.measure else closed_form_report(cfg, vocab)
        if report is None:  # (imports torch and megatron-core)
            from megahash.models.accounting import count_parameters

            report = count_parameters(cfg, vocab)
        from megahash.models.accounting import format_report

        print(json.dumps(report, indent=1) if args.json else format_report(report))
        return 0

    return run_guarded(run)


def main(argv=None) -> int:
    from megahash import known_warnings

    known_warnings.install()  # before any library import (megahash/known_warnings.py lists them)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--verbose" in argv[1:]:  # any subcommand: the libraries' warnings, logs and progress bars too
        argv.remove("--verbose")
        known_warnings.show_all()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        names = ", ".join(SUBCOMMANDS)
        if argv and argv[0] not in ("-h", "--help"):
            print_error(f"unknown subcommand {argv[0]!r} (choose from {names})")
            return 2
        print(f"usage: megahash {{{names}}} [args]\n\n{__doc__}")
        return 0
    if argv[0] in INPUTS and run_guarded(lambda: check_inputs(argv[0], argv[1:])):
        return 2  # before the subcommand's imports
    module, func = SUBCOMMANDS[argv[0]].split(":")
    return getattr(importlib.import_module(module), func)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
