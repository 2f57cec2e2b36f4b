"""``megahash export``: one quantized, compressed artifact of a checkpoint's weights (issue 37 item 5,
issue 44 item 3).

The format is megahash/models/quantized.py's (per-row int8/int6/int4 with fp16 scales, small tensors
kept, zstandard or zlib), chosen per tensor group (megahash/models/tensor_groups.py: embedding,
attention, mlp, head, other) by the run's config, ``export.artifact``; ``--quantize`` overrides it
(``int8``: every group; ``mlp=int4,attention=int6``: those groups), ``--compress`` its codec. With no
``--output`` the artifact goes to ``RUN/artifacts/STEP.artifact`` (``STEP_ema.artifact`` for the average).
The command prints the artifact's path and exact size in bytes. An existing output file (the default path's
too) is replaced only with ``--overwrite``; an output that is a folder or lies under a file is one line, both
before the checkpoint is read. ``megahash eval --checkpoint RUN --artifact PATH`` evaluates the round-tripped
weights in the checkpoint's model (an artifact of another model, or a damaged one, is one line).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path


def artifact_groups() -> list[str]:
    """The tensor groups ``export.artifact`` names (its fields but the codec)."""
    from megahash.config import ArtifactConfig

    return [f.name for f in dataclasses.fields(ArtifactConfig) if f.name != "compress"]


def parse_quantize(quantize: str) -> dict[str, str]:
    """``--quantize`` as {group: format} (``"*"``: every group): ``int6`` alone, or ``GROUP=FORMAT`` entries
    separated by single commas, each group once; a bare format among entries sets the groups they do not
    name. An empty spec or entry, an entry without a group, or a group (or the bare format) given twice is a
    one-line ConfigError (a later entry silently won before). Formats and groups are checked by the config
    (:func:`quantize_overrides`), whose formats, as every config choice, are case-insensitive."""
    from megahash.errors import ConfigError

    example = "e.g. --quantize int6 or --quantize mlp=int4,attention=int6"
    if not quantize.strip():
        raise ConfigError(f"--quantize is empty; give a format (int8, int6, int4) or GROUP=FORMAT entries, {example}")
    out: dict[str, str] = {}
    for item in quantize.split(","):
        if not item.strip():
            raise ConfigError(
                f"--quantize {quantize!r} has an empty entry; separate its entries by single commas, {example}"
            )
        group, sep, fmt = (part.strip() for part in item.strip().rpartition("="))
        if sep and not group:
            raise ConfigError(f"--quantize entry {item.strip()!r} names no group; write GROUP=FORMAT, {example}")
        key = group if sep else "*"
        if key in out:
            what = f"group {group!r}" if sep else "a format for every group"
            raise ConfigError(
                f"--quantize {quantize!r} gives {what} twice ({out[key]!r} and {fmt!r}); give each group once"
            )
        out[key] = fmt
    return out


def quantize_overrides(quantize: str | None, compress: str | None = None) -> list[str]:
    """``--quantize`` / ``--compress`` as config overrides of ``export.artifact``: ``int6`` sets every
    group, ``GROUP=FORMAT`` (comma-separated) one group (:func:`parse_quantize`); checked (unknown group or
    format: one line naming the closest) by loading them onto the defaults, before torch is imported."""
    from megahash.config import load_config

    out = []
    if quantize is not None:
        spec = parse_quantize(quantize)
        if (every := spec.pop("*", None)) is not None:  # every group first, then the groups named, in any order
            out += [f"export.artifact.{g}={every}" for g in artifact_groups()]
        out += [f"export.artifact.{g}={fmt}" for g, fmt in spec.items()]
    if compress is not None:
        out.append(f"export.artifact.compress={compress}")
    load_config(None, out)
    return out


def default_output(ckpt: Path, weights: str) -> Path:
    """``RUN/artifacts/STEP.artifact`` (``STEP_ema.artifact`` for the average) of a checkpoint ``ckpt``."""
    return ckpt.parent / "artifacts" / f"{ckpt.name}{'' if weights == 'live' else '_' + weights}.artifact"


def check_output(output, overwrite: bool, default: bool = False) -> None:
    """One line (ConfigError) for an artifact path that cannot be written: a folder, a file above it
    (:func:`megahash.atomic_write.check_output`), or an existing file without ``overwrite``. ``default``:
    the path is :func:`default_output`'s, not ``--output``'s."""
    from megahash.atomic_write import check_output as check_path
    from megahash.atomic_write import file_above
    from megahash.errors import ConfigError

    if default and (Path(output).is_dir() or file_above(output) is not None):
        what = "it is a folder" if Path(output).is_dir() else f"{file_above(output)} is a file"
        raise ConfigError(f"cannot write the default output {output} ({what}); name the file with --output")
    check_path(output, "--output", example="model.artifact")
    if Path(output).exists() and not overwrite:
        raise ConfigError(f"{output} already exists; pass --overwrite to replace it (or --output for another file)")


def export_artifact(
    checkpoint, output=None, overrides: list[str] | None = None, weights: str = "live", overwrite: bool = False
) -> dict:
    """Write the artifact of a checkpoint's ``weights`` (live or ema) at the formats of its config's
    ``export.artifact`` under ``overrides`` (:func:`quantize_overrides`), to ``output`` (None:
    :func:`default_output`); a summary with its ``bytes``. An ``output`` that cannot be written, or that
    exists without ``overwrite``, is one line before the model is built (:func:`check_output`; ``--output``'s
    before torch is imported)."""
    if output is not None:
        check_output(output, overwrite)
    else:  # the default path needs the checkpoint's step: resolved (and verified) first, once
        from megahash.checkpoint.resolve import resolve_for_inference

        checkpoint = resolve_for_inference(checkpoint, overrides)
        check_output(default_output(checkpoint, weights), overwrite, default=True)
    from megahash.accelerator import process_groups
    from megahash.checkpoint.artifact import write_artifact
    from megahash.checkpoint.layout import read_state
    from megahash.checkpoint.signature import model_signature
    from megahash.checkpoint.weights import load_for_inference
    from megahash.models.quantized import quantized
    from megahash.models.tensor_groups import tensor_groups

    with process_groups.releasing_group():
        cfg, model, ckpt = load_for_inference(checkpoint, overrides, weights=weights)
        a = cfg.export.artifact
        formats = {g: getattr(a, g) for g in artifact_groups()}
        groups = tensor_groups(model)
        state = model.state_dict()
        meta = {
            "checkpoint": str(ckpt),
            "step": int(read_state(ckpt).get("step", 0)),
            "weights": weights,
            "signature": model_signature(cfg),
        }
        output = Path(output) if output is not None else default_output(ckpt, weights)
        output.parent.mkdir(parents=True, exist_ok=True)
        n = write_artifact(state, output, formats["other"], a.compress, meta, formats, groups)
        tensors = [k for k, v in state.items() if hasattr(v, "is_floating_point")]
        quant = [k for k in tensors if quantized(k, state[k])]
        del model
    used = {g: f for g, f in formats.items() if g in {groups[k] for k in quant}}  # groups with a quantized tensor
    return {
        "checkpoint": str(ckpt),
        "output": str(output),
        "bytes": n,
        "format": next(iter(used.values()))
        if len(set(used.values())) == 1
        else ",".join(f"{g}={f}" for g, f in used.items()),
        "compress": a.compress,
        "weights": weights,
        "quantized": len(quant),
        "kept": len(tensors) - len(quant),
    }


def main(argv=None) -> int:
    from megahash.arguments import ArgumentParser
    from megahash.command_errors import run_guarded

    p = ArgumentParser(
        prog="megahash export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checkpoint", required=True, help="run directory (its latest) or step_N directory")
    p.add_argument("--output", default=None, help="the artifact file to write (default RUN/artifacts/STEP.artifact)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing artifact file (refused otherwise)")
    p.add_argument(
        "--quantize",
        default=None,
        metavar="FORMAT|GROUP=FORMAT,...",
        help="int8, int6 or int4 for every group, or per group (embedding, attention, mlp, head, other), "
        "e.g. mlp=int4,attention=int6; default: the run's export.artifact",
    )
    p.add_argument("--compress", default=None, help="zstd or zlib (default: the run's export.artifact.compress)")
    p.add_argument(
        "--weights",
        default="live",
        choices=["live", "ema"],
        help="the trained weights (live) or their average (ema, a run with train.ema.decay)",
    )
    args = p.parse_args(argv)

    def run():
        overrides = quantize_overrides(args.quantize, args.compress)
        s = export_artifact(args.checkpoint, args.output, overrides, args.weights, args.overwrite)
        print(
            f"megahash export: {s['checkpoint']} ({s['weights']} weights) -> {s['output']}: {s['format']} per row "
            f"+ {s['compress']}, {s['quantized']} tensors quantized, {s['kept']} kept; {s['bytes']} bytes"
        )
        return 0

    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main())
