"""Shards damaged in place (same sizes, so ``data.verify=cheap`` passes them): the loader refuses an
out-of-range token id or word code in one line naming the shard and the document (issue 47), and
``pretrain.py --check inputs`` honours ``data.verify=full``. In-process runs through the pretrain
entry point, like tests/training/test_faults.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

TINY = [
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.ffn_hidden_size=128",
    "data.seq_length=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.log_interval=100",
    "logging.plot=false",
    "logging.tensorboard=false",
    "train.eval_interval=0",
    "train.steps=2",
]


def _copy_set(prefix: str, dest: Path, damaged: str) -> str:
    """A copy of the shard set at ``prefix`` (symlinks, except the file ``damaged``: a private copy)."""
    src = Path(prefix)
    dest.mkdir()
    for p in src.parent.iterdir():
        if p.name.startswith(src.name + "_"):
            if p.name == src.name + damaged:
                shutil.copy(p, dest / p.name)
            else:
                (dest / p.name).symlink_to(p)
    return str(dest / src.name)


def _poke(path: str, dtype, value, every: int) -> list[int]:
    """Write ``value`` over every ``every``-th element of ``path`` in place (same size); the positions."""
    data = np.memmap(path, dtype=dtype, mode="r+")
    where = list(range(every // 2, len(data), every))
    data[where] = value
    data.flush()
    del data
    return where


def _one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("workers", [0, 1])
def test_token_id_out_of_range_is_one_line_naming_shard_and_document(shakespeare_shards, tmp_path, capsys, workers):
    prefix = _copy_set(shakespeare_shards["prefix"], tmp_path / "set", "_text_document.bin")
    _poke(prefix + "_text_document.bin", np.uint16, 65535, 97)  # ids of a 1000-piece vocabulary: 65535 is impossible
    from megahash.pretrain import main

    save = tmp_path / "run"
    status = main(
        [
            f"data.prefix=[{prefix}]",
            f"data.tokenizer={shakespeare_shards['tokenizer']}",
            *TINY,
            f"train.save_dir={save}",
            f"data.num_workers={workers}",
        ]
    )
    line = _one_line(capsys)
    assert status == 2
    assert f"{prefix}_text_document.bin document " in line and "token id 65535" in line, line
    assert "inspect_shards.py" in line and "[0, 1000)" in line


def test_bucket_code_out_of_range_is_one_line_naming_the_side_shard(hashed_shards, tmp_path, capsys):
    prefix = _copy_set(hashed_shards["prefix"], tmp_path / "set", "_hash_md5-bucket64.bin")
    _poke(prefix + "_hash_md5-bucket64.bin", np.int32, 64, 89)  # buckets are 0..63
    from megahash.pretrain import main

    status = main(
        [
            f"data.prefix=[{prefix}]",
            f"data.tokenizer={hashed_shards['tokenizer']}",
            *TINY,
            "model.embedding=hash-emb",
            "model.embed.hash_spec=md5-bucket64",
            f"train.save_dir={tmp_path / 'run'}",
        ]
    )
    line = _one_line(capsys)
    assert status == 2
    assert f"{prefix}_hash_md5-bucket64.bin document " in line and "code 64 is outside [0, 64)" in line, line


def test_check_inputs_honours_full_verification(shakespeare_shards, tmp_path, capsys):
    """A token changed to another valid id: sizes and ranges hold, only the sha256 pass sees it."""
    prefix = _copy_set(shakespeare_shards["prefix"], tmp_path / "set", "_text_document.bin")
    _poke(prefix + "_text_document.bin", np.uint16, 7, 5000)
    from megahash.pretrain import main

    args = [
        "--check",
        "inputs",
        f"data.prefix=[{prefix}]",
        f"data.tokenizer={shakespeare_shards['tokenizer']}",
        f"train.save_dir={tmp_path / 'run'}",
    ]
    assert main(args) == 0  # cheap: sizes and headers only
    capsys.readouterr()
    assert main([*args, "data.verify=full"]) == 2
    line = _one_line(capsys)
    assert "sha256" in line and f"{prefix}_text_document.bin" in line, line


def test_range_check_finds_the_document_and_position():
    from megahash.data.token_check import CorruptShardError, check_range, code_range

    parts = [(7, 30, 5), (8, 0, 4)]  # a sample cut from the end of document 7 and the start of 8
    check_range(np.arange(9), 0, 9, parts, "p_text_document", "p", "token id")
    with pytest.raises(
        CorruptShardError, match=r"p_text_document.bin document 8, token 2: token id 9 is outside \[0, 9\)"
    ):
        check_range(np.array([0, 1, 2, 3, 4, 5, 6, 9, 8]), 0, 9, parts, "p_text_document", "p", "token id")
    codes = np.zeros((9, 2), np.int32)
    codes[3, 1] = -2
    with pytest.raises(CorruptShardError, match="document 7, token 33: code -2"):
        check_range(codes, -1, 10, parts, "p_hash_rolling3", "p", "code", 2)
    assert code_range("md5") is None and code_range("lsh-bucket500") == (0, 500) and code_range("rolling3")[0] == -1
    wrapped = CorruptShardError(
        "Caught CorruptShardError in DataLoader worker process 0.\nOriginal Traceback (most "
        "recent call last):\n  File x\nmegahash.data.token_check.CorruptShardError: p.bin: bad"
    )
    assert str(wrapped) == "p.bin: bad"
