"""Named validation sets (``data.valid``, megahash/data/valid_sets.py) through the real DeepSpeed engine
on CPU, one rank in process: two named sets beside the ``data.split`` set, each reported by name (loss,
perplexity, bits per byte) in the progress line, metrics.jsonl and TensorBoard; fp32 and bf16; bad
input is one line, exit 2, before torch."""

import json
import math
import shutil
import sys

import pytest

import conftest
from conftest import run

TINY = [
    *conftest.TINIER,
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.steps=2",
    "train.eval_interval=2",
    "data.valid_samples=40",
    "data.valid_micro_batch=8",
    "logging.tensorboard=true",
    "eval.at_end=false",
]
# held-out documents: accents, CJK, an emoji and special-token strings written in the text
DOCS = [
    f"Held-out page {i}: Über naïve café, </s> and <s> are only text. 日本語 😀 " + "Now is the winter. " * (2 + i % 4)
    for i in range(24)
]


@pytest.fixture(scope="module")
def held(shakespeare_shards, tmp_path_factory):
    d = tmp_path_factory.mktemp("held")
    src = d / "held.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    r = run(
        [
            sys.executable,
            "data_tools/preprocess_data.py",
            "--input",
            str(src),
            "--output-prefix",
            str(d / "held"),
            "--tokenizer",
            shakespeare_shards["tokenizer"],
            "--word-hashes",
            "md5",
            "--workers",
            "1",
            "--quiet",
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return {"prefix": str(d / "held"), "jsonl": str(src), "dir": d}


def _main(args, capsys):
    from megahash.pretrain import main

    status = main(args)
    cap = capsys.readouterr()
    return status, cap.out, cap.err


def _data(shards, held):
    return [
        f"data.prefix=[{shards['prefix']}]",
        f"data.tokenizer={shards['tokenizer']}",
        f"data.valid=[held={held['prefix']},train={shards['prefix']}]",
    ]


def _tensorboard(run_dir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_named_sets_are_reported_by_name(shakespeare_shards, held, tmp_path, capsys, precision):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out_dir = tmp_path / "run"
    # bf16 also trains on the whole blend (data.split=100,0,0): the named sets alone are validated
    split = ["data.split=100,0,0"] if precision == "bf16" else []
    status, out, err = _main(
        [*_data(shakespeare_shards, held), *TINY, *split, f"train.precision={precision}", f"train.save_dir={out_dir}"],
        capsys,
    )
    assert status == 0, (out + err)[-3000:]
    recs = {
        r["split"]: r
        for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())
        if r["split"].startswith("valid")
    }
    names = ["valid/held", "valid/train"] if split else ["valid", "valid/held", "valid/train"]
    assert sorted(recs) == names  # the split keeps its name
    tb = _tensorboard(out_dir)
    index = IndexedDataset(held["prefix"] + "_text_document")
    one_epoch = (int(index.sequence_lengths.sum()) - 1) // 32  # megatron-core's sequences of one epoch
    for name, rec in recs.items():
        assert rec["step"] == 2 and f"[{name}] step 2/2 loss" in out
        assert rec["ppl"] == pytest.approx(math.exp(rec["loss"]), rel=1e-12)
        # bpb = sum NLL / (ln 2 * bytes), the sum NLL being the token-weighted mean loss times the tokens
        assert rec["bpb"] == pytest.approx(rec["loss"] * rec["tokens"] / (math.log(2) * rec["bytes"]), rel=1e-12)
        assert 0 < rec["bytes"] and rec["tokens"] == 32 * rec["sequences"]
        for key in ("loss", "ppl", "bpb"):  # TensorBoard holds the jsonl's values (stored as fp32)
            assert tb[f"{name}/{key}"][2] == pytest.approx(rec[key], rel=1e-6)
    assert recs["valid/held"]["sequences"] == min(40, one_epoch) and recs["valid/train"]["sequences"] == 40
    # different text, different numbers: the sets are not the split's set
    assert len({recs[n]["loss"] for n in recs}) == len(names) and len({recs[n]["bytes"] for n in recs}) == len(names)
    if precision == "bf16":
        assert "torch.bfloat16" in out
        return
    from megahash.training.logging import plot_loss

    assert plot_loss(out_dir).stat().st_size > 0  # the curve of every set
    # megahash eval --text on the checkpoint: bytes of the text, bits per byte (test_bits_per_byte.py: = lm-eval's)
    from megahash.eval.run import main as eval_main

    assert eval_main(["--checkpoint", str(out_dir), "--text", held["jsonl"], "--limit", "3"]) == 0
    rec = json.loads((out_dir / "eval" / "step_00000002_text_held.json").read_text())  # named after held.jsonl
    assert rec["documents"] == 3 and rec["bytes"] == sum(len(t.encode("utf-8")) for t in DOCS[:3])
    assert rec["bpb"] == pytest.approx(rec["nll"] / (math.log(2) * rec["bytes"]), rel=1e-12)
    printed = capsys.readouterr().out
    assert f"bpb {rec['bpb']:.4f}" in printed  # lm-eval's disjoint windows, then strided ones (default: half)
    sl = rec["sliding"]
    assert sl["stride"] == rec["max_length"] // 2 and f"stride {sl['stride']}: loss {sl['loss']:.4f}" in printed
    assert sl["bpb"] == pytest.approx(sl["nll"] / (math.log(2) * rec["bytes"]), rel=1e-12)


def test_bad_sets_are_one_line(shakespeare_shards, held, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in held["dir"].glob("held*"):
        shutil.copy(f, broken / f.name)
    (broken / "held_text_document.idx").unlink()
    base = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    cases = {
        f"data.valid=[a={held['prefix']},a={held['prefix']}]": "data.valid names 'a' twice",
        f"data.valid=[{held['prefix']}]": "must be NAME=PREFIX",
        f"data.valid=[x={tmp_path}/nowhere]": "data.valid set 'x': data shard",
        f"data.valid=[b={broken}/held]": "data.valid set 'b': data shard",
        f"data.valid=[valid={held['prefix']}]": "not 'valid'",
    }
    for arg, expect in cases.items():
        status, out, err = _main(["--check", "inputs", *base, arg], capsys)
        lines = [l for l in err.splitlines() if l.strip()]
        assert status == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], (arg, err)
    status, out, err = _main(
        [
            "--check",
            "inputs",
            *base,
            f"data.valid=[held={held['prefix']}]",
            "data.seq_length=4096",
            "model.max_position_embeddings=4096",
        ],
        capsys,
    )
    assert status == 2 and "fewer than one sequence" in err and len(err.strip().splitlines()) == 1, err


def test_perplexity_is_exact_and_null_past_a_floats_range():
    """The validation line's ppl is exp(loss) at every loss a float holds (it was capped at e^50: a diverging run
    showed 5.2e21 at every loss past 50), and null past it or for a nan loss (valid JSON in metrics.jsonl),
    as ``megahash eval --text`` reports it; bpb is unchanged."""
    from megahash.training.valid_sets import set_metrics

    def metrics(loss):
        return set_metrics({"nll": loss * 1000, "tokens": 1000, "sequences": 4, "bytes": 4000}, True, True)

    for loss in (0.0, 3.2, 60.0, 700.0):
        m = metrics(loss)
        assert m["ppl"] == pytest.approx(math.exp(loss), rel=1e-12) and m["bpb"] == pytest.approx(
            loss / 4 / math.log(2)
        )
    assert metrics(720.0)["ppl"] is None and metrics(float("nan"))["ppl"] is None
    assert json.loads(json.dumps(metrics(720.0)))["ppl"] is None


def test_a_set_hashed_otherwise_is_one_line_and_lsh_from_shares_the_first_sets_model(
    shakespeare_shards, held, tmp_path, capsys
):
    """LSH codes project the n-grams counted on a set's own corpus, MD5 codes depend on the HMAC key: a data.valid
    set (or blend part) hashed otherwise than the blend's first set gave codes of other words, scored silently. Now
    one line before torch, naming the difference and the fix; ``preprocess_data.py --lsh-from PREFIX`` writes the
    set with that set's LSH model (the same .npz, byte for byte: the save is deterministic)."""
    import hashlib

    def preprocess(name, *extra):
        args = ["--input", held["jsonl"], "--output-prefix", str(tmp_path / name)]
        args += ["--tokenizer", shakespeare_shards["tokenizer"], "--quiet", *extra]
        r = run([sys.executable, "data_tools/preprocess_data.py", *args])
        assert r.returncode == 0, r.stderr[-2000:]
        return str(tmp_path / name)

    own = preprocess("own", "--word-hashes", "lsh128")
    shared = preprocess("shared", "--word-hashes", "lsh128", "--lsh-from", shakespeare_shards["prefix"])
    keyed = preprocess("keyed", "--word-hashes", "md5", "--md5-key", "other")

    def digest(prefix):
        return hashlib.sha256(open(f"{prefix}_lsh.npz", "rb").read()).hexdigest()

    assert digest(shared) == digest(shakespeare_shards["prefix"]) != digest(own)
    base = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    lsh = ["model.embedding=proj", "model.embed.hash_spec=lsh128", "model.embed.num_bits=128"]
    md5 = ["model.embedding=proj", "model.embed.hash_spec=md5", "model.embed.num_bits=128"]
    cases = [
        (lsh, own, "the LSH model"),
        (lsh, shared, None),
        (md5, keyed, "key 'other' against 'en'"),
        (md5, held["prefix"], None),
        ([], keyed, None),  # a vocabulary embedding reads no codes
    ]
    for model, prefix, expect in cases:
        status, out, err = _main(["--check", "inputs", *base, *model, f"data.valid=[held={prefix}]"], capsys)
        if expect is None:
            assert status == 0, (model, prefix, err)
            continue
        lines = [l for l in err.splitlines() if l.strip()]
        assert status == 2 and len(lines) == 1 and expect in lines[0], (model, prefix, err)
        assert "another hashing" in lines[0] and ("--lsh-from" in lines[0]) == (expect == "the LSH model"), lines[0]
    r = run([sys.executable, "data_tools/preprocess_data.py", "--input", held["jsonl"], "--output-prefix",
             str(tmp_path / "x"), "--tokenizer", shakespeare_shards["tokenizer"], "--word-hashes", "md5",
             "--lsh-from", shakespeare_shards["prefix"], "--quiet"])  # fmt: skip
    assert r.returncode == 2 and "--lsh-from needs an lsh spec" in r.stderr and not list(tmp_path.glob("x_*"))
