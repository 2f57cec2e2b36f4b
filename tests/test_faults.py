"""Faults (issue 14): damaged inputs refused before step 1, checkpoint faults, signals, elastic resume.

Damaged inputs run in-process through the pretrain entry point (a 1-rank gloo world): each case is
one damaged copy of the real Shakespeare shards (symlinks to the intact files), exit status 2, one
``error:`` line naming the file, nothing written under ``train.save_dir``."""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

TINY = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.ffn_hidden_size=128",
        "data.seq_length=64", "train.micro_batch_size=4", "train.global_batch_size=8", "train.lr=2e-3",
        "train.warmup_steps=2", "train.log_interval=100", "logging.plot=false", "logging.tensorboard=false"]


def base(shards, save_dir, steps, *extra, prefix=None):
    return [f"data.prefix=[{prefix or shards['prefix']}]", f"data.tokenizer={shards['tokenizer']}", *TINY,
            f"train.steps={steps}", f"train.save_dir={save_dir}", *extra]


def _foreign_shard(path_prefix: str, docs: int, dtype, width: int = 1) -> None:
    """A shard written by the data stage's writer from other documents (another build)."""
    from data_tools.indexed_writer import IndexedShardWriter

    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 50, size=docs) * width
    w = IndexedShardWriter(path_prefix + ".bin", path_prefix + ".idx", dtype)
    w.add_documents(rng.integers(5, 200, size=int(lengths.sum())), lengths)
    w.finalize()


def _truncate(p: Path, keep: float = 0.5) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * keep)])


def _flip(p: Path) -> None:  # same size, other content: only the checksum sees it
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _foreign_side_with_sizes_in_meta(d: Path) -> None:
    """A side shard of another document count whose sizes were also copied into the meta (only the
    index header/count checks can tell)."""
    _foreign_shard(str(d / "shakespeare_hash_md5"), 37, np.uint8, 16)
    meta_path = d / "shakespeare_meta.json"
    meta = json.loads(meta_path.read_text())
    for ext in (".bin", ".idx"):
        meta["files"]["shakespeare_hash_md5" + ext]["bytes"] = (d / f"shakespeare_hash_md5{ext}").stat().st_size
    meta_path.write_text(json.dumps(meta))


DAMAGE = {
    "truncated_token_bin": (lambda d: _truncate(d / "shakespeare_text_document.bin"), [], "shakespeare_text_document.bin"),
    "truncated_token_idx": (lambda d: _truncate(d / "shakespeare_text_document.idx", 0.9), [], "shakespeare_text_document.idx"),
    "foreign_token_bin": (lambda d: _foreign_shard(str(d / "shakespeare_text_document"), 400, np.uint16), [],
                          "shakespeare_text_document"),
    "foreign_side_shard_doc_count": (lambda d: _foreign_shard(str(d / "shakespeare_hash_md5"), 37, np.uint8, 16), [],
                                     "shakespeare_hash_md5"),
    "foreign_side_shard_meta_sizes": (_foreign_side_with_sizes_in_meta, [], ("shakespeare_hash_md5", "shakespeare_meta")),
    "foreign_idx_same_size_bin": (lambda d: _flip(d / "shakespeare_hash_lsh128.idx"), [], "shakespeare_hash_lsh128.idx"),
    "flipped_bin_byte_full_verify": (lambda d: _flip(d / "shakespeare_hash_md5.bin"), ["data.verify=full"],
                                     "shakespeare_hash_md5.bin"),
    "missing_meta": (lambda d: (d / "shakespeare_meta.json").unlink(), [], "shakespeare_meta.json"),
    "corrupt_meta": (lambda d: (d / "shakespeare_meta.json").write_text("{\"format_version\": 1,"), [],
                     "shakespeare_meta.json"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_input_refused_before_step_1(shakespeare_shards, tmp_path, capsys, case):
    damage, extra, names = DAMAGE[case]
    names = (names,) if isinstance(names, str) else names
    src = Path(shakespeare_shards["prefix"]).parent
    d = tmp_path / "shards"
    d.mkdir()
    for p in src.iterdir():
        if p.name.startswith("shakespeare"):
            (d / p.name).symlink_to(p)
    for p in d.iterdir():  # the files a case damages become private copies
        if p.name.startswith(names):
            p.unlink()
            shutil.copy(src / p.name, p)
    damage(d)
    from megahash.pretrain import main

    save = tmp_path / "run"
    status = main(base(shakespeare_shards, save, 2, *extra, prefix=str(d / "shakespeare")))
    err = [l for l in capsys.readouterr().err.strip().splitlines() if l.strip()]
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith("error: ") and any(n in err[0] for n in names), err
    assert "preprocess_data.py" in err[0]  # the fix
    assert not save.exists()


def test_intact_shards_pass_cheap_and_full(shakespeare_shards):
    from megahash.data.verify import verify_set

    for level in ("cheap", "full"):
        info = verify_set(shakespeare_shards["prefix"], level)
        assert info["side_shards"] == ["md5", "lsh128"] and info["documents"] > 0
    meta = json.loads(Path(shakespeare_shards["prefix"] + "_meta.json").read_text())
    assert info["checked_files"] == len(meta["files"]) and info["tokens"] == meta["counts"]["tokens"]
