"""Quantized weight artifacts (``megahash export --quantize``, megahash/models/quantized.py): one
compressed file of a checkpoint's weights, written, read back (round-tripped) and loaded into a model."""

from __future__ import annotations

from pathlib import Path

import torch

from megahash.atomic_write import write_bytes_atomic
from megahash.errors import CheckpointError


def write_artifact(
    state: dict, path: Path, fmt: str, codec: str, meta: dict, formats: dict | None = None, groups: dict | None = None
) -> int:
    """Write the quantized artifact of ``state`` (megahash/models/quantized.py) to ``path`` (temporary
    name, renamed); its exact size in bytes. ``fmt``: the one format of every quantized tensor; or, with
    ``formats`` ({group: format}) and ``groups`` ({tensor name: group}, megahash/models/tensor_groups.py),
    each tensor at its group's format: a mixed artifact (version 2), each entry recording its width and
    the record its groups' formats (``format`` is then ``"mixed"``)."""
    import io

    from megahash.models.quantized import FORMATS, compress, encode

    if formats is not None and len(set(formats.values())) == 1:
        fmt, formats = next(iter(formats.values())), None  # one format: the single-format record
    if formats is None:
        rec = {"megahash_artifact": 1, "format": fmt, "bits": FORMATS[fmt], "meta": meta}
        rec["tensors"] = encode(state, FORMATS[fmt])
    else:
        rec = {"megahash_artifact": 2, "format": "mixed", "bits": None, "formats": dict(formats), "meta": meta}
        rec["groups"] = {name: groups[name] for name in state if name in groups}
        rec["tensors"] = encode(state, {name: FORMATS[formats[groups[name]]] for name in state if name in groups})
    buf = io.BytesIO()
    torch.save(rec, buf)
    blob = compress(buf.getvalue(), codec)
    write_bytes_atomic(path, blob)
    return len(blob)


MAX_BYTES = 1 << 31  # what an artifact read without its model may decompress to (2 GiB)


def read_artifact(path: Path, like: dict | None = None) -> tuple[dict, dict]:
    """(round-tripped state dict, artifact record without its tensors) of a quantized artifact file;
    nothing but tensors and plain data is unpickled (``weights_only``). ``like`` (the model's state dict)
    bounds what the file may decompress to (its tensors in fp32, plus 64 MiB; else :data:`MAX_BYTES`), and so
    the size of a file that is read at all (a dataset's shard passed by mistake is refused before it is read), and
    the names and shapes the artifact must have; sizes, dtypes and shapes are checked before anything is
    decoded. One-line CheckpointError for anything else."""
    import io

    from megahash.models.quantized import ChecksumMismatch, check, decode, decompress

    limit = MAX_BYTES if like is None else 4 * sum(v.numel() for v in like.values()) + (64 << 20)
    try:
        size = Path(path).stat().st_size
        if size > limit + limit // 128 + (1 << 20):  # more than any compression of ``limit`` bytes: never read
            raise CheckpointError(
                f"{path} is not a megahash quantized artifact: its {size} bytes are more than the model's weights "
                f"compress to (at most {limit} bytes decompressed); pass the artifact file (megahash export --quantize)"
            )
        blob = Path(path).read_bytes()
        rec = torch.load(io.BytesIO(decompress(blob, limit)), map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except ChecksumMismatch:
        raise CheckpointError(f"artifact {path} is corrupt (checksum mismatch): export it again") from None
    except Exception as e:  # zlib/zstd/torch errors: one line
        from megahash.checkpoint.safe_unpickle import refusal

        if refusal(e, f"artifact {path}") is not None:
            raise refusal(e, f"artifact {path}") from None
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise CheckpointError(f"{path} is not a megahash quantized artifact ({type(e).__name__}: {why})") from None
    if not isinstance(rec, dict) or rec.get("megahash_artifact") not in (1, 2):
        raise CheckpointError(f"{path} is not a megahash quantized artifact")
    why = check(rec.get("tensors"), rec.get("bits"))  # a mixed artifact (bits None): each entry's own
    if why is not None:
        raise CheckpointError(f"artifact {path} is damaged or from another model: {why}")
    if like is not None and (why := misfit(rec["tensors"], like)) is not None:
        raise CheckpointError(
            f"artifact {path} is from another model: {why}; pass the run it was exported from (--checkpoint)"
        )
    return decode(rec.pop("tensors"), rec["bits"]), rec


def misfit(tensors: dict, like: dict) -> str | None:
    """Why the artifact's tensors do not fit the model's state dict ``like``: a tensor the model has and the
    artifact lacks, one the artifact holds and the model has no place for (another depth, an untied head
    into a tied model: loading them with ``strict=False`` dropped them silently), or another shape. The
    artifact is the model's own ``state_dict()`` (:func:`write_artifact`), so the names match exactly;
    only megatron's ``_extra_state`` entries (kept or not by the linear implementation) are let differ."""
    lacking = sorted(k for k in like if k not in tensors and not k.endswith("_extra_state"))
    if lacking:
        return f"it lacks {_few(lacking)}"
    unexpected = sorted(k for k in tensors if k not in like and not k.endswith("_extra_state"))
    if unexpected:
        return f"it holds tensors the model has no place for: {_few(unexpected)}"
    for name, e in tensors.items():
        shape = tuple(e["shape"]) if "packed" in e else tuple(e["value"].shape)
        if name in like and shape != tuple(like[name].shape):
            return f"{name} has shape {list(shape)[:8]}, the model's is {list(like[name].shape)}"
    return None


def _few(names: list[str], n: int = 3) -> str:
    """The first ``n`` names, and how many more."""
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def load_artifact_into(model: torch.nn.Module, path: Path) -> dict:
    """Load a quantized artifact's round-tripped weights into ``model`` (TP=1); its record."""
    from megahash.models.quantized import load_state_into

    like = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    state, rec = read_artifact(path, like)
    load_state_into(model, state, f"artifact {path}")
    return rec
