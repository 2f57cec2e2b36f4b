"""``megahash export``: one quantized, compressed artifact of a checkpoint's weights (issue 37 item 5).

The format is megahash/models/quantized.py's (per-row int8/int6/int4 with fp16 scales, small tensors
kept, zstandard or zlib); the command prints the artifact's exact size in bytes. ``megahash eval
--checkpoint RUN --artifact PATH`` evaluates the round-tripped weights in the checkpoint's model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def export_artifact(checkpoint, output, fmt: str = "int8", codec: str = "zstd", weights: str = "live") -> dict:
    """Write the artifact of a checkpoint's ``weights`` (live or ema); a summary with its ``bytes``."""
    from megahash.accelerator import process_groups
    from megahash.checkpoint.artifact import write_artifact
    from megahash.checkpoint.layout import read_state
    from megahash.checkpoint.signature import model_signature
    from megahash.checkpoint.weights import load_for_inference
    from megahash.models.quantized import quantized

    with process_groups.releasing_group():
        cfg, model, ckpt = load_for_inference(checkpoint, weights=weights)
        state = model.state_dict()
        meta = {
            "checkpoint": str(ckpt),
            "step": int(read_state(ckpt).get("step", 0)),
            "weights": weights,
            "signature": model_signature(cfg),
        }
        n = write_artifact(state, Path(output), fmt, codec, meta)
        tensors = [k for k, v in state.items() if hasattr(v, "is_floating_point")]
        q = sum(1 for k in tensors if quantized(k, state[k]))
        del model
    return {
        "checkpoint": str(ckpt),
        "output": str(output),
        "bytes": n,
        "format": fmt,
        "compress": codec,
        "weights": weights,
        "quantized": q,
        "kept": len(tensors) - q,
    }


def main(argv=None) -> int:
    from megahash.command_errors import run_guarded

    p = argparse.ArgumentParser(
        prog="megahash export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checkpoint", required=True, help="run directory (its latest) or step_N directory")
    p.add_argument("--output", required=True, help="the artifact file to write")
    p.add_argument("--quantize", default="int8", choices=["int8", "int6", "int4"])
    p.add_argument("--compress", default="zstd", choices=["zstd", "zlib"])
    p.add_argument(
        "--weights",
        default="live",
        choices=["live", "ema"],
        help="the trained weights (live) or their average (ema, a run with train.ema_decay)",
    )
    args = p.parse_args(argv)

    def run():
        s = export_artifact(args.checkpoint, args.output, args.quantize, args.compress, args.weights)
        print(
            f"megahash export: {s['checkpoint']} ({s['weights']} weights) -> {s['output']}: {s['format']} per row "
            f"+ {s['compress']}, {s['quantized']} tensors quantized, {s['kept']} kept; {s['bytes']} bytes"
        )
        return 0

    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main())
