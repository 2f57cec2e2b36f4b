"""Quantized weight artifacts (``megahash export --quantize``, megahash/models/quantized.py): one
compressed file of a checkpoint's weights, written, read back (round-tripped) and loaded into a model."""

from __future__ import annotations

from pathlib import Path

import torch

from megahash.atomic_write import write_bytes_atomic
from megahash.errors import CheckpointError


def write_artifact(state: dict, path: Path, fmt: str, codec: str, meta: dict) -> int:
    """Write the quantized artifact of ``state`` (megahash/models/quantized.py) to ``path`` (temporary
    name, renamed); its exact size in bytes."""
    import io

    from megahash.models.quantized import FORMATS, compress, encode

    buf = io.BytesIO()
    torch.save(
        {
            "megahash_artifact": 1,
            "format": fmt,
            "bits": FORMATS[fmt],
            "meta": meta,
            "tensors": encode(state, FORMATS[fmt]),
        },
        buf,
    )
    blob = compress(buf.getvalue(), codec)
    write_bytes_atomic(path, blob)
    return len(blob)


def read_artifact(path: Path) -> tuple[dict, dict]:
    """(round-tripped state dict, artifact record without its tensors) of a quantized artifact file;
    nothing but tensors and plain data is unpickled (``weights_only``)."""
    import io

    from megahash.models.quantized import decode, decompress

    try:
        rec = torch.load(io.BytesIO(decompress(Path(path).read_bytes())), map_location="cpu", weights_only=True)
    except Exception as e:  # zlib/zstd/torch errors: one line
        raise CheckpointError(f"{path} is not a megahash quantized artifact ({type(e).__name__}: {e})") from None
    if not isinstance(rec, dict) or rec.get("megahash_artifact") != 1:
        raise CheckpointError(f"{path} is not a megahash quantized artifact")
    return decode(rec.pop("tensors"), rec["bits"]), rec


def load_artifact_into(model: torch.nn.Module, path: Path) -> dict:
    """Load a quantized artifact's round-tripped weights into ``model`` (TP=1); its record."""
    from megahash.models.quantized import load_state_into

    state, rec = read_artifact(path)
    load_state_into(model, state, f"artifact {path}")
    return rec
