"""Each rank's RNG states in a checkpoint (``rng_rankNNNNN.json``): torch, numpy and Python's
generators (accelerator.rng.rng_state) as JSON, tensors and arrays tagged with their dtype."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from megahash.accelerator import process_groups, rng
from megahash.atomic_write import write_text_atomic


def _to_jsonable(x):
    if isinstance(x, torch.Tensor):
        return {"__tensor__": x.tolist(), "dtype": str(x.dtype).replace("torch.", "")}
    if isinstance(x, np.ndarray):
        return {"__ndarray__": x.tolist(), "dtype": str(x.dtype)}
    if isinstance(x, dict):
        return {k: _to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return {"__tuple__": [_to_jsonable(v) for v in x]} if isinstance(x, tuple) else [_to_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return x


def _from_jsonable(x):
    if isinstance(x, dict):
        if "__tensor__" in x:
            dtype = getattr(torch, str(x["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{str(x['dtype'])[:40]!r} is not a torch dtype")
            return torch.tensor(x["__tensor__"], dtype=dtype)
        if "__ndarray__" in x:
            dtype = np.dtype(str(x["dtype"]))
            if dtype.hasobject:
                raise ValueError("an array of Python objects")
            return np.array(x["__ndarray__"], dtype=dtype)
        if "__tuple__" in x:
            return tuple(_from_jsonable(v) for v in x["__tuple__"])
        return {k: _from_jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_jsonable(v) for v in x]
    return x


def _file(ckpt: Path) -> Path:
    return Path(ckpt) / f"rng_rank{process_groups.rank():05d}.json"


def write_rng(ckpt: Path) -> None:
    """This rank's RNG states into ``ckpt``."""
    write_text_atomic(_file(ckpt), json.dumps(_to_jsonable(rng.rng_state())))


def load_rng(ckpt: Path) -> None:
    """This rank's RNG states from ``ckpt``, when it has them (a weights-only checkpoint has none)."""
    from megahash.checkpoint.layout import read_json
    from megahash.errors import CheckpointError

    f = _file(ckpt)
    if f.is_file():
        try:
            rng.set_rng_state(_from_jsonable(read_json(f)))
        except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, OverflowError) as e:
            raise CheckpointError(
                f"checkpoint {ckpt}: {f.name} does not hold RNG states ({type(e).__name__}: {str(e)[:120]})"
            ) from None
