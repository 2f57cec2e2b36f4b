"""Quantized artifacts (issue 37 item 5): one file with a model's weights quantized per row, compressed.

Format (as Parameter Golf's int8 + zlib baseline): every floating tensor of the TP=1 state dict with
at least 2 dimensions and more than :data:`KEEP_NUMEL` elements is quantized **per row** (dim 0, the
rest flattened) symmetrically to ``bits`` (8, 6, 4): scale ``s = max|row| / qmax`` (qmax = 2^(bits-1) - 1:
127, 31, 7) stored in fp16, rounded *up* to an fp16 value so that no value clips, ``q = round(w / s)``;
so ``|w - q s| <= s / 2`` per element (the round-trip bound the tests check). int8 stores one byte a
value; int6 packs four values into three bytes, int4 two values into a byte (offset binary). Other
floating tensors are kept: 1-D ones (norms, biases, gains) in fp32, small matrices in fp16; integer
buffers as they are. The whole is ``torch.save``d (megahash/checkpoint/artifact.py ``write_artifact``: models open no files) (no pickled code: ``torch.load(weights_only=True)``)
and compressed with zstandard (level 19; the package megahash already needs for .jsonl.zst corpora)
or the standard library's zlib (level 9), after a header with the sha256 of the compressed payload
(:func:`compress`; :func:`decompress` checks it before decompressing). torchao's quantization primitives are not installed here, and
torch's own ``quantize_per_channel`` covers int8 only, so the few lines below do it for every width.

Widths may differ per tensor (issue 44 item 3: ``export.artifact`` gives each tensor group its format,
megahash/models/tensor_groups.py): :func:`encode` then records each quantized tensor's ``bits`` in its entry,
and :func:`decode` / :func:`check` read an entry's own width before the artifact's one.

QAT (``train.qat.bits``, ``train.qat.widths``; megahash/training/qat.py) trains through this same round trip.
"""

from __future__ import annotations

import math
import zlib

import torch

KEEP_NUMEL = 4096  # tensors with at most this many elements stay in floating point
FORMATS = {"int8": 8, "int6": 6, "int4": 4}
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
FRAME_MAGIC = b"megahash-artifact-sha256\n"  # then the sha256 of the compressed payload, then the payload


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def quantize_rows(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values in [-qmax, qmax], fp16 scale per row) of ``w`` viewed as (rows, -1):
    s = max|row| / qmax rounded up to fp16 (never below 2^-14, fp16's smallest normal), q = round(w / s)."""
    rows = w.detach().float().reshape(w.shape[0], -1)
    s = (rows.abs().amax(dim=1) / qmax(bits)).clamp(min=2.0**-14)
    s16 = (s * (1 + 2.0**-10)).to(torch.float16)  # fp16 rounding is within 2^-11: s16 >= s, no clipping
    q = torch.round(rows / s16.float()[:, None]).clamp(-qmax(bits), qmax(bits)).to(torch.int8)
    return q, s16


def dequantize_rows(q: torch.Tensor, s16: torch.Tensor, shape) -> torch.Tensor:
    return (q.float() * s16.float()[:, None]).reshape(shape)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 bytes of the values ``q`` (offset binary): int8 as is, int6 4 values in 3 bytes, int4 2 in 1."""
    u = (q.reshape(-1).to(torch.int16) + (qmax(bits) + 1)).to(torch.uint8)
    if bits == 8:
        return u
    per = 4 if bits == 6 else 2
    u = torch.cat([u, u.new_zeros((-u.numel()) % per)]).reshape(-1, per).to(torch.int32)
    if bits == 4:
        return (u[:, 0] | (u[:, 1] << 4)).to(torch.uint8)
    word = u[:, 0] | (u[:, 1] << 6) | (u[:, 2] << 12) | (u[:, 3] << 18)  # 24 bits
    return torch.stack([word & 255, (word >> 8) & 255, (word >> 16) & 255], 1).reshape(-1).to(torch.uint8)


def unpack(b: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` int8 values :func:`pack` wrote into ``b``."""
    b = b.to(torch.int32)
    if bits == 8:
        u = b
    elif bits == 4:
        u = torch.stack([b & 15, b >> 4], 1).reshape(-1)
    else:
        t = b.reshape(-1, 3)
        word = t[:, 0] | (t[:, 1] << 8) | (t[:, 2] << 16)
        u = torch.stack([(word >> (6 * i)) & 63 for i in range(4)], 1).reshape(-1)
    return (u[:n] - (qmax(bits) + 1)).to(torch.int8)


def quantized(name: str, t: torch.Tensor) -> bool:
    """The rule of the module docstring: floating, at least 2-D, more than KEEP_NUMEL elements."""
    return t.is_floating_point() and t.ndim >= 2 and t.numel() > KEEP_NUMEL


def encode(state: dict, bits: int | dict) -> dict:
    """The artifact's tensors of a state dict; ``bits``: one width for every quantized tensor, or
    {name: width} (per-tensor widths, recorded in each tensor's entry)."""
    out = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().cpu()
        if quantized(name, t):
            b = bits[name] if isinstance(bits, dict) else bits
            q, s16 = quantize_rows(t, b)
            out[name] = {"packed": pack(q, b), "scale": s16, "shape": list(t.shape), "dtype": str(t.dtype)[6:]}
            if isinstance(bits, dict):
                out[name]["bits"] = b
        elif t.is_floating_point():
            out[name] = {"value": t.float() if t.ndim <= 1 else t.half(), "dtype": str(t.dtype)[6:]}
        else:
            out[name] = {"value": t.clone()}
    return out


def decode(tensors: dict, bits: int | None) -> dict:
    """The round-tripped state dict of :func:`encode`'s output (``bits``: the width of entries that record
    none, an artifact of one format)."""
    out = {}
    for name, e in tensors.items():
        if "packed" in e:
            shape = torch.Size(e["shape"])
            q = unpack(e["packed"], e.get("bits", bits), shape.numel()).reshape(shape[0], -1)
            out[name] = dequantize_rows(q, e["scale"], shape).to(getattr(torch, e["dtype"]))
        else:
            v = e["value"]
            out[name] = v.to(getattr(torch, e["dtype"])) if "dtype" in e else v
    return out


class ChecksumMismatch(ValueError):
    """The payload of a framed artifact is not the one its digest was computed over (a flipped byte, a cut)."""


def compress(raw: bytes, codec: str) -> bytes:
    """The artifact file of ``raw``: :data:`FRAME_MAGIC`, the sha256 of the payload, then the payload,
    ``raw`` compressed with ``codec`` (zstd frames carry their own content checksum too). Whatever the
    codec, a changed byte anywhere in the file is found by :func:`decompress` before anything is decoded."""
    import hashlib

    if codec == "zstd":
        import zstandard

        payload = zstandard.ZstdCompressor(level=19, write_checksum=True).compress(raw)
    else:
        payload = zlib.compress(raw, 9)
    return FRAME_MAGIC + hashlib.sha256(payload).digest() + payload


def decompress(blob: bytes, limit: int) -> bytes:
    """The bytes of a compressed artifact, at most ``limit`` of them. A framed file (:func:`compress`) whose
    payload does not match its digest is a :class:`ChecksumMismatch`; a file of an earlier release (the bare
    zstd or zlib stream, no digest) is read as it was. A stream that would give more than ``limit`` (a "zip
    bomb") or ends early is a ValueError, found while at most ``limit`` + 1 MiB are held."""
    import hashlib

    if blob[: len(FRAME_MAGIC)] == FRAME_MAGIC:
        digest, blob = blob[len(FRAME_MAGIC) : len(FRAME_MAGIC) + 32], blob[len(FRAME_MAGIC) + 32 :]
        if hashlib.sha256(blob).digest() != digest:
            raise ChecksumMismatch("checksum mismatch")
    if blob[:4] == ZSTD_MAGIC:
        import io

        import zstandard

        out, chunk = bytearray(), b"-"
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)) as r:
            while chunk and len(out) <= limit:
                chunk = r.read(1 << 20)
                out += chunk
    else:
        d = zlib.decompressobj()
        out = d.decompress(blob, limit + 1)
        if len(out) <= limit and not d.eof:
            raise ValueError("the zlib stream is truncated")
    if len(out) > limit:
        raise ValueError(f"it decompresses to more than {limit} bytes, more than the model's weights can take")
    return bytes(out)


FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")


def packed_bytes(numel: int, bits: int) -> int:
    """Length of :func:`pack`'s output for ``numel`` values."""
    per, size = {8: (1, 1), 6: (4, 3), 4: (2, 1)}[bits]
    return -(-numel // per) * size


def check(tensors, bits) -> str | None:
    """Why the tensors of an artifact record are not :func:`encode`'s output (None if they are): every
    size, dtype, width and shape is checked before :func:`decode` allocates anything. ``bits``: the
    record's one width (None in a mixed artifact, whose entries record theirs)."""
    if bits is not None and bits not in FORMATS.values():
        return f"bits {bits!r} is not one of {sorted(FORMATS.values())}"
    if not isinstance(tensors, dict):
        return "it holds no tensor table"
    for name, e in tensors.items():
        if not isinstance(e, dict) or not isinstance(name, str):
            return f"entry {name!r} is not a tensor record"
        if "dtype" in e and e["dtype"] not in FLOAT_DTYPES:
            return f"{name}: dtype {str(e['dtype'])[:40]!r} is not a floating dtype"
        if "packed" not in e:
            if not _dense(e.get("value")):
                return f"{name}: no tensor"
            continue
        shape, packed, scale, width = e.get("shape"), e.get("packed"), e.get("scale"), e.get("bits", bits)
        if type(width) is not int or width not in FORMATS.values():
            return f"{name}: bits {str(width)[:20]} is not one of {sorted(FORMATS.values())}"
        if not (isinstance(shape, list) and len(shape) >= 2 and all(type(d) is int and d >= 0 for d in shape)):
            return f"{name}: shape {str(shape)[:60]} is not a list of sizes"
        n = math.prod(shape)  # Python's integers: a forged size neither overflows nor wraps to a small count
        if not (_dense(packed) and packed.dtype == torch.uint8 and packed.shape == (packed_bytes(n, width),)):
            return f"{name}: its packed values do not hold {n} {width}-bit values"
        if not (_dense(scale) and scale.dtype == torch.float16 and scale.shape == (shape[0],)):
            return f"{name}: it has no fp16 scale per row"
        if "dtype" not in e:
            return f"{name}: no dtype"
    return None


def _dense(t) -> bool:
    """A dense tensor with its values in memory, as :func:`encode` wrote it (not a meta tensor, which has none
    to copy, nor a sparse one)."""
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu"


def load_state_into(model: torch.nn.Module, state: dict, name: str = "artifact") -> None:
    """Load a round-tripped state dict into ``model`` (TP=1); one-line error if it does not fit: a tensor
    missing, one the model has no place for, or another shape (``_extra_state`` entries aside). The
    load is strict in what it takes: nothing of ``state`` is dropped silently."""
    from megahash.errors import CheckpointError

    own = model.state_dict()
    lacking = sorted(k for k in own if k not in state and not k.endswith("_extra_state"))
    unexpected = sorted(k for k in state if k not in own and not k.endswith("_extra_state"))
    bad = sorted(k for k in state if k in own and tuple(own[k].shape) != tuple(state[k].shape))
    if lacking or unexpected or bad:
        why = (
            f"it lacks {lacking[:3]}"
            if lacking
            else f"the model has no place for {unexpected[:3]}"
            if unexpected
            else f"shapes of {bad[:3]}"
        )
        raise CheckpointError(
            f"{name} does not fit the checkpoint's model ({why}); it belongs to another model: "
            f"pass the run it was exported from"
        )
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
