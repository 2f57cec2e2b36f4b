"""``megahash export``: one quantized, compressed artifact of a checkpoint's weights (issue 37 item 5,
issue 44 item 3).

The format is megahash/models/quantized.py's (per-row int8/int6/int4 with fp16 scales, small tensors
kept, zstandard or zlib), chosen per tensor group (megahash/models/tensor_groups.py: embedding,
attention, mlp, head, other) by the run's config, ``export.artifact``; ``--quantize`` overrides it
(``int8``: every group; ``mlp=int4,attention=int6``: those groups), ``--compress`` its codec. With no
``--output`` the artifact goes to ``RUN/artifacts/STEP.artifact`` (``STEP_ema.artifact`` for the average).
The command prints the artifact's path and exact size in bytes. ``megahash eval --checkpoint RUN
--artifact PATH`` evaluates the round-tripped weights in the checkpoint's model.
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


def quantize_overrides(quantize: str | None, compress: str | None = None) -> list[str]:
    """``--quantize`` / ``--compress`` as config overrides of ``export.artifact``: ``int6`` sets every
    group, ``GROUP=FORMAT`` (comma-separated) one group; checked (unknown group or format: one line
    naming the closest) by loading them onto the defaults, before torch is imported."""
    from megahash.config import load_config

    out = []
    for item in (quantize or "").split(","):
        if item.strip():
            group, sep, fmt = item.strip().rpartition("=")
            out += [f"export.artifact.{g.strip()}={fmt.strip()}" for g in ([group] if sep else artifact_groups())]
    if compress is not None:
        out.append(f"export.artifact.compress={compress}")
    load_config(None, out)
    return out


def default_output(ckpt: Path, weights: str) -> Path:
    """``RUN/artifacts/STEP.artifact`` (``STEP_ema.artifact`` for the average) of a checkpoint ``ckpt``."""
    return ckpt.parent / "artifacts" / f"{ckpt.name}{'' if weights == 'live' else '_' + weights}.artifact"


def export_artifact(checkpoint, output=None, overrides: list[str] | None = None, weights: str = "live") -> dict:
    """Write the artifact of a checkpoint's ``weights`` (live or ema) at the formats of its config's
    ``export.artifact`` under ``overrides`` (:func:`quantize_overrides`), to ``output`` (None:
    :func:`default_output`); a summary with its ``bytes``."""
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
    from megahash.command_errors import run_guarded

    p = argparse.ArgumentParser(
        prog="megahash export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checkpoint", required=True, help="run directory (its latest) or step_N directory")
    p.add_argument("--output", default=None, help="the artifact file to write (default RUN/artifacts/STEP.artifact)")
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
        s = export_artifact(args.checkpoint, args.output, overrides, args.weights)
        print(
            f"megahash export: {s['checkpoint']} ({s['weights']} weights) -> {s['output']}: {s['format']} per row "
            f"+ {s['compress']}, {s['quantized']} tensors quantized, {s['kept']} kept; {s['bytes']} bytes"
        )
        return 0

    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main())
