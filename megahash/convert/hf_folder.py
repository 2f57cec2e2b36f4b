"""The files of a Hugging Face model folder that every export format writes: safetensors weights
(one file, or shards + index as huggingface_hub writes them), megahash's extra tensors, the special
token ids of config.json / generation_config.json, and dtype casting. Shared by the megahash
(remote-code) format (:mod:`megahash.convert.export`) and the native Qwen2 format
(:mod:`megahash.convert.qwen2`), which import this module and not each other."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"
EXTRA_FILE = "megahash_extra.safetensors"


def special_token_ids(cfg) -> dict:
    """bos/pad/eos token ids of the run's tokenizer (``data.special_ids``; the word ids 0-4 if the
    run recorded none). A missing pad is the eos id (padding is never scored)."""
    from megahash.tokenization import special_ids_of

    ids = special_ids_of(getattr(cfg.data, "special_ids", None))
    eos = ids.get("eos")
    return {
        "bos_token_id": ids.get("bos") if ids.get("bos") is not None else eos,
        "pad_token_id": ids.get("pad") if ids.get("pad") is not None else eos,
        "eos_token_id": eos,
    }


def cast(state: dict, dtype: torch.dtype) -> dict:
    """Floating tensors to ``dtype`` (contiguous, cloned); integer buffers unchanged."""
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().clone() for k, v in state.items()}


MAX_SHARD_SIZE = "2GB"


def save_weights(out: Path, tensors: dict, max_shard_size=MAX_SHARD_SIZE) -> list[str]:
    """``model.safetensors``, or above ``max_shard_size`` shards ``model-0000K-of-0000N.safetensors``
    with ``model.safetensors.index.json`` (huggingface_hub's layout, which transformers loads)."""
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(tensors, out, max_shard_size=max_shard_size, metadata={"format": "pt"})
    if (out / "model.safetensors.index.json").is_file():
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = ["model.safetensors.index.json", *sorted(set(index["weight_map"].values()))]
    else:
        files = [WEIGHTS_FILE]
    for name in files:
        umask_mode(out / name)
    return files


def save_tensors(path: Path, tensors: dict, meta: dict | None = None) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt", **(meta or {})})
    umask_mode(path)


def _umask() -> int:
    try:  # Linux >= 4.7 reports it without changing it
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def umask_mode(path: Path) -> None:
    """Give a file the mode ``open()`` would have given it (0666 less the umask): safetensors writes a
    private 0600 temp file and renames it, so the weights of an export were unreadable to the
    group/others that can read the rest of the folder."""
    os.chmod(path, 0o666 & ~_umask())
