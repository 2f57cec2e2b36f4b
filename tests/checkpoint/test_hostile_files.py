"""Every command that reads a checkpoint or an artifact runs no code from it (issue 47 item 1).

One real run (1 rank, with a weight average) is copied and forged per case, as an attacker would: the
manifest's sizes fixed after the change. Each command (``eval``, ``export-hf``, ``export`` and
``--quantize``, ``indicators``, ``--weights ema``, ``--artifact``, ``import-hf``) exits 2 with one
``error:`` line, and the marker file the payload would create stays absent. Compressed artifacts are
bounded (a zlib/zstd bomb is refused while decompressing) and checked (sizes, dtypes, shapes) before
anything is allocated; the JSON and safetensors files of a checkpoint or export that are not what they
claim are one line too."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import sys
import zlib
from pathlib import Path

import pytest
import torch
from gadgets import function_from_code
from test_faults import TINY

from conftest import pretrain, run

SMALL = [*TINY, "train.warmup_steps=1", "train.eval_interval=0", "train.zero_stage=0", "train.ema.decay=0.9"]


@pytest.fixture(scope="module")
def trained(shakespeare_shards, tmp_path_factory):
    """A finished 2-step run (model/, ema/, optimizer/, DeepSpeed's files) and a text to score."""
    root = tmp_path_factory.mktemp("hostile")
    run_dir = root / "run"
    r = pretrain(
        [
            f"data.prefix=[{shakespeare_shards['prefix']}]",
            f"data.tokenizer={shakespeare_shards['tokenizer']}",
            *SMALL,
            "train.steps=2",
            f"train.save_dir={run_dir}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    text = root / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 20)
    return {"run": run_dir, "ckpt": run_dir / "step_00000002", "text": text}


class Payload:
    """Pickles as a call of os.system (the classic gadget)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def forge_manifest(ckpt: Path) -> None:
    """The manifest of ``ckpt`` written again from its files (sizes, sha256): a forger who can write the
    folder rewrites it too (the manifest is for accidents; docs/security.md)."""
    from megahash.checkpoint.manifest import write_manifest

    write_manifest(ckpt)


def copy_of(trained, tmp_path) -> Path:
    dst = tmp_path / "run" / trained["ckpt"].name
    shutil.copytree(trained["ckpt"], dst)
    return dst


def forge_metadata(ckpt: Path, part: str, marker: Path) -> None:
    """``part/.metadata`` replaced by issue 47's exploit (a function built from bytes and called)."""
    (ckpt / part / ".metadata").write_bytes(function_from_code(marker))
    forge_manifest(ckpt)


def forge_byte_items(ckpt: Path, part: str, marker: Path) -> None:
    """The byte items of ``part`` (megatron's ShardedObjects, the layers' ``_extra_state``: read by torch's
    DefaultLoadPlanner with ``torch.load(weights_only=False)``) pointed at a pickled os.system call."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = pickle.loads((ckpt / part / ".metadata").read_bytes())  # our own file: plain pickle is fine here
    buf = io.BytesIO()
    torch.save([Payload(marker)], buf)
    n = 0
    for idx, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata.get(idx.fqn), BytesStorageMetadata):
            f = ckpt / part / info.relative_path
            info.offset, info.length = f.stat().st_size, len(buf.getvalue())
            with open(f, "ab") as fh:
                fh.write(buf.getvalue())
            n += 1
    assert n, "the model has no byte items to forge"
    (ckpt / part / ".metadata").write_bytes(pickle.dumps(md))
    forge_manifest(ckpt)


def _cli(argv, capsys) -> tuple[int, list[str]]:
    from megahash.cli import main

    status = main(argv)
    err = capsys.readouterr().err
    return status, [l for l in err.strip().splitlines() if l.startswith("error:")]


def _commands(ckpt: Path, out: Path, text: Path, weights: str) -> dict[str, list[str]]:
    w = ["--weights", weights]
    return {
        "eval": ["eval", "--checkpoint", str(ckpt), "--text", str(text), "--out", str(out / "e.json"), *w],
        "export-hf": ["export-hf", "--checkpoint", str(ckpt), "--output", str(out / "hf"), "--no-verify", *w],
        "export": ["export", "--checkpoint", str(ckpt), "--output", str(out / "q"), *w],
        "export --quantize int4": [
            "export",
            "--checkpoint",
            str(ckpt),
            "--output",
            str(out / "q4"),
            "--quantize",
            "int4",
            *w,
        ],
        "indicators": [
            "indicators",
            "--checkpoint",
            str(ckpt),
            "--text",
            str(text),
            "--out",
            str(out / "ind"),
            "--no-plots",
        ],
    }


def test_export_hf_runs_no_code_of_a_forged_metadata(trained, tmp_path):
    """Through the real command line, in its own process: exit 2, one line, nothing run, nothing written."""
    ckpt = copy_of(trained, tmp_path)
    marker = tmp_path / "RAN"
    forge_metadata(ckpt, "model", marker)
    r = run(
        [sys.executable, "-m", "megahash", "export-hf", "--checkpoint", str(ckpt), "--output", str(tmp_path / "hf")]
    )
    err = [l for l in r.stderr.strip().splitlines() if l.startswith("error:")]
    assert r.returncode == 2 and len(err) == 1, r.stderr[-3000:]
    assert "dataclass.__class__: refused" in err[0] and "Traceback" not in r.stderr
    assert not marker.exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("forge", ["metadata", "byte_items"])
@pytest.mark.parametrize("weights", ["live", "ema"])
def test_every_command_refuses_forged_weights(trained, tmp_path, capsys, forge, weights):
    """eval, export-hf, export (int8, int4) and indicators of the live weights (``model/``) and of the
    average (``--weights ema``, ``ema/``): one line each, nothing run."""
    ckpt = copy_of(trained, tmp_path)
    marker = tmp_path / "RAN"
    part = "model" if weights == "live" else "ema"
    (forge_metadata if forge == "metadata" else forge_byte_items)(ckpt, part, marker)
    for name, argv in _commands(ckpt, tmp_path / "out", trained["text"], weights).items():
        if weights == "ema" and name == "indicators":
            continue  # indicators reads the live weights only
        status, err = _cli(argv, capsys)
        assert status == 2 and len(err) == 1 and "refused" in err[0], (name, err)
        assert not marker.exists(), name
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def _artifact(trained, tmp_path, capsys, codec="zlib") -> Path:
    path = tmp_path / f"a.{codec}"
    status, err = _cli(
        ["export", "--checkpoint", str(trained["ckpt"]), "--output", str(path), "--compress", codec], capsys
    )
    assert status == 0, err
    return path


def _eval_artifact(trained, path, tmp_path, capsys) -> tuple[int, list[str]]:
    argv = ["eval", "--checkpoint", str(trained["ckpt"]), "--text", str(trained["text"]), "--artifact", str(path)]
    return _cli([*argv, "--out", str(tmp_path / "e.json"), "--overwrite"], capsys)


def _record(path: Path) -> dict:
    from megahash.models.quantized import decompress

    return torch.load(io.BytesIO(decompress(path.read_bytes(), 1 << 30)), weights_only=True)


def _write(rec, path: Path, codec="zlib") -> None:
    from megahash.models.quantized import compress

    buf = io.BytesIO()
    torch.save(rec, buf)
    path.write_bytes(compress(buf.getvalue(), codec))


def test_artifacts_are_bounded_and_checked_before_allocating(trained, tmp_path, capsys):
    """``eval --artifact``: the real artifact scores; a pickled call, a zlib and a zstd bomb (decompressing to
    more than the model's weights in fp32), a truncated stream, a shape that does not fit the model, a packed
    size, scale or dtype that lies: one line each, nothing run."""
    import zstandard

    good = _artifact(trained, tmp_path, capsys)
    status, err = _eval_artifact(trained, good, tmp_path, capsys)
    assert status == 0, err
    marker = tmp_path / "RAN"
    cases = {}
    rec = _record(good)
    rec["meta"]["x"] = Payload(marker)
    buf = io.BytesIO()
    torch.save(rec, buf)
    cases["pickled call"] = (zlib.compress(buf.getvalue()), "posix.system")
    zeros = zlib.compressobj(9)
    bomb = b"".join(zeros.compress(bytes(1 << 20)) for _ in range(200)) + zeros.flush()  # 200 MiB of zeros in ~200 KB
    cases["zlib bomb"] = (bomb, "decompresses to more than")
    z = zstandard.ZstdCompressor(level=3).compressobj()
    cases["zstd bomb"] = (b"".join(z.compress(bytes(1 << 20)) for _ in range(200)) + z.flush(), "decompresses to more")
    cases["truncated"] = (good.read_bytes()[: len(good.read_bytes()) // 2], "(checksum mismatch)")  # the digest sees it
    legacy = zlib.compress(zlib.decompress(good.read_bytes()[len(_FRAME) + 32 :]), 9)  # an earlier release's: no digest
    cases["truncated, no digest"] = (legacy[: len(legacy) // 2], "truncated")
    name = next(k for k, e in _record(good)["tensors"].items() if "packed" in e)
    for what, change, expect in (
        ("shape", {"shape": [1 << 20, 1 << 20]}, "do not hold"),
        ("fitting shape", None, "has shape"),
        ("packed", {"packed": torch.zeros(3, dtype=torch.uint8)}, "do not hold"),
        ("scale", {"scale": torch.zeros(2, dtype=torch.float16)}, "scale"),
        ("dtype", {"dtype": "load"}, "not a floating dtype"),
    ):
        r = _record(good)
        e = r["tensors"][name]
        if change is None:  # consistent in itself, but not the model's shape
            rows = e["shape"][0] * 2
            e.update(shape=[rows, 4], packed=torch.zeros(rows * 4, dtype=torch.uint8), scale=torch.ones(rows).half())
        else:
            e.update(change)
        _write(r, tmp_path / "x")
        cases[what] = ((tmp_path / "x").read_bytes(), expect)
    for what, (blob, expect) in cases.items():
        path = tmp_path / f"bad_{what.replace(' ', '_')}"
        path.write_bytes(blob)
        status, err = _eval_artifact(trained, path, tmp_path, capsys)
        assert status == 2 and len(err) == 1 and expect in err[0], (what, err)
        assert len(err[0]) < 500, err[0]
        assert not marker.exists(), what


_FRAME = b"megahash-artifact-sha256\n"  # the documented file layout (docs/compact_models.md): magic, sha256, payload


def _flipped(path: Path, at: float, out: Path) -> Path:
    blob = bytearray(path.read_bytes())
    blob[int(len(blob) * at)] ^= 0x10  # one bit
    out.write_bytes(bytes(blob))
    return out


@pytest.mark.parametrize("codec", ["zlib", "zstd"])
def test_a_flipped_bit_in_an_artifact_is_one_line(codec, trained, tmp_path, capsys):
    """Every artifact carries the sha256 of its payload (zstd frames their content checksum too): one bit
    flipped at a third, half, three quarters of the file is one line through the CLI, exit 2 (a zstd frame
    written without its checksum loaded with one weight changed)."""
    import hashlib

    import zstandard

    good = _artifact(trained, tmp_path, capsys, codec)
    blob = good.read_bytes()
    head, digest, payload = blob[: len(_FRAME)], blob[len(_FRAME) : len(_FRAME) + 32], blob[len(_FRAME) + 32 :]
    assert head == _FRAME and digest == hashlib.sha256(payload).digest()
    if codec == "zstd":
        assert zstandard.get_frame_parameters(payload).has_checksum
    else:
        assert len(zlib.decompress(payload)) > len(payload)  # a complete zlib stream
    for at in (1 / 3, 1 / 2, 3 / 4):
        bad = _flipped(good, at, tmp_path / f"flipped_{at:.2f}")
        status, err = _eval_artifact(trained, bad, tmp_path, capsys)
        assert status == 2 and err == [f"error: artifact {bad} is corrupt (checksum mismatch): export it again"], err


def _foreign_artifact(trained, overrides: list[str], path: Path) -> dict:
    """The real artifact of a model built from the trained run's config under ``overrides`` (another model)."""
    from megahash.accelerator import process_groups
    from megahash.checkpoint.artifact import write_artifact
    from megahash.checkpoint.layout import read_state
    from megahash.checkpoint.resolve import checkpoint_config
    from megahash.models.megatron_model import MegahashLM

    cfg = checkpoint_config(trained["ckpt"], overrides)
    with process_groups.releasing_group():
        process_groups.init_distributed(1)
        model = MegahashLM(cfg, int(read_state(trained["ckpt"])["padded_vocab_size"]), init=False)
        state = model.state_dict()
    write_artifact(state, path, "int8", "zlib", {})
    return state


def test_an_artifact_of_another_model_is_refused(trained, tmp_path, capsys):
    """Tensors the run's model has no place for (an untied head into the tied run, 3 layers more) are one
    line naming them, exit 2; they were dropped silently (``strict=False``) and scored with wrong numbers.
    The run's own artifact loads (test_artifacts_are_bounded_and_checked_before_allocating)."""
    from megahash.checkpoint.resolve import checkpoint_config

    cfg = checkpoint_config(trained["ckpt"])
    assert cfg.model.tie_embeddings and cfg.model.num_layers == 2  # the trained run: tiny.yaml
    untied = _foreign_artifact(trained, ["model.tie_embeddings=false"], tmp_path / "untied")
    assert "output_layer.weight" in untied
    deeper = _foreign_artifact(trained, ["model.num_layers=5"], tmp_path / "deeper")
    assert any(k.startswith("decoder.layers.4.") for k in deeper)
    for path, names in ((tmp_path / "untied", "output_layer.weight"), (tmp_path / "deeper", "decoder.layers.2.")):
        status, err = _eval_artifact(trained, path, tmp_path, capsys)
        assert status == 2 and len(err) == 1, err
        assert err[0].startswith(f"error: artifact {path} is from another model: it holds tensors the model has no "), (
            err
        )
        assert names in err[0] and err[0].endswith("pass the run it was exported from (--checkpoint)"), err
        assert len(err[0]) < 500


def test_loading_a_state_takes_every_tensor_or_none():
    """load_state_into: a tensor the model lacks is refused (it was dropped), as one it has not or of another
    shape; ``_extra_state`` entries may differ; a fitting state is loaded."""
    from megahash.errors import CheckpointError
    from megahash.models.quantized import load_state_into

    model = torch.nn.Linear(3, 2)
    fit = {"weight": torch.ones(2, 3), "bias": torch.zeros(2)}
    load_state_into(model, {**fit, "x._extra_state": torch.zeros(1)})
    assert float(model.weight.sum()) == 6.0 and float(model.bias.abs().sum()) == 0.0
    for state, why in (
        ({**fit, "extra.weight": torch.ones(2)}, "no place for ['extra.weight']"),
        ({"weight": fit["weight"]}, "it lacks ['bias']"),
        ({**fit, "bias": torch.zeros(3)}, "shapes of ['bias']"),
    ):
        with pytest.raises(CheckpointError, match=re.escape(why)):
            load_state_into(model, state)


def test_bounded_decompression_stops_at_the_limit():
    from megahash.models.quantized import compress, decompress

    raw = bytes(range(256)) * 1000
    for codec in ("zlib", "zstd"):
        blob = compress(raw, codec)
        assert decompress(blob, len(raw)) == raw
        with pytest.raises(ValueError, match="more than"):
            decompress(blob, len(raw) - 1)


def test_forged_artifact_records_and_oversized_files_are_one_line(tmp_path):
    """read_artifact on what torch.load(weights_only) can still hand back: a size past int64 (a ValueError
    traceback), one whose product wraps to 0 in int64 (named "0 values"), a meta tensor (no data: a traceback
    from load_state_dict) or a sparse one as a kept, packed or scale tensor: CheckpointError. A file larger than
    any compression of the bound (a 200 MiB shard passed by mistake; it was read whole into memory) is refused
    by its size before it is read; the real artifact loads."""
    from megahash.checkpoint.artifact import read_artifact, write_artifact
    from megahash.errors import CheckpointError
    from megahash.models.quantized import compress, decompress

    like = {"w": torch.randn(64, 128), "b": torch.zeros(64)}
    good = tmp_path / "good.artifact"
    write_artifact(like, good, "int8", "zlib", {})
    state, _ = read_artifact(good, like)
    # bit-exact: a 1-d tensor is kept as it is (not quantized), so it round-trips exactly
    assert state["w"].shape == (64, 128) and torch.equal(state["b"], like["b"])

    def forged(change) -> Path:
        rec = torch.load(io.BytesIO(decompress(good.read_bytes(), 1 << 30)), weights_only=True)
        change(rec["tensors"])
        buf = io.BytesIO()
        torch.save(rec, buf)
        path = tmp_path / "forged.artifact"
        path.write_bytes(compress(buf.getvalue(), "zlib"))
        return path

    meta = torch.device("meta")
    for what, change, expect in (
        ("size past int64", lambda t: t["w"].update(shape=[64, 1 << 70]), "do not hold"),
        ("size wrapping to 0", lambda t: t["w"].update(shape=[64, 1 << 58]), f"do not hold {64 << 58} "),
        ("meta kept", lambda t: t["b"].update(value=torch.empty(64, device=meta)), "b: no tensor"),
        ("sparse kept", lambda t: t["b"].update(value=torch.zeros(64).to_sparse()), "b: no tensor"),
        ("meta packed", lambda t: t["w"].update(packed=t["w"]["packed"].to(meta)), "do not hold"),
        ("meta scale", lambda t: t["w"].update(scale=t["w"]["scale"].to(meta)), "scale"),
    ):
        with pytest.raises(CheckpointError, match="is damaged or from another model") as e:
            read_artifact(forged(change), like)
        assert expect in str(e.value), (what, str(e.value))
    shard = tmp_path / "shard.bin"
    with open(shard, "wb") as f:
        f.truncate(200 << 20)  # sparse: nothing to write, 200 MiB to read
    with pytest.raises(CheckpointError, match=r"its 209715200 bytes are more than the model's weights compress to"):
        read_artifact(shard, like)
    # the size is read inside the one-line guard: a missing file is not a FileNotFoundError traceback
    with pytest.raises(CheckpointError, match=r"is not a megahash quantized artifact \(FileNotFoundError"):
        read_artifact(tmp_path / "missing.artifact", like)


def _hf_export(trained, tmp_path, capsys) -> Path:
    out = tmp_path / "hf"
    status, err = _cli(["export-hf", "--checkpoint", str(trained["ckpt"]), "--output", str(out), "--no-verify"], capsys)
    assert status == 0, err
    return out


def test_import_hf_reads_safetensors_only(trained, tmp_path, capsys):
    """A folder whose weights are a pickle (``pytorch_model.bin``) is refused, never unpickled; an index
    naming a file outside the folder or not safetensors, a damaged safetensors file, a config.json that is
    not a JSON object or whose sizes the tensors do not have: one line each."""
    hf = _hf_export(trained, tmp_path, capsys)
    marker = tmp_path / "RAN"
    weights = sorted(p.name for p in hf.glob("*.safetensors"))
    cases = {}

    def case(name, fn):
        d = tmp_path / name
        shutil.copytree(hf, d)
        fn(d)
        cases[name] = d

    def pickle_weights(d):
        for w in weights:
            (d / w).unlink()
        torch.save({"x": Payload(marker)}, d / "pytorch_model.bin")

    def index_outside(d):
        (d / "model.safetensors").unlink()
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../hf/model.safetensors"}}))

    def index_pickle(d):
        (d / "model.safetensors").unlink()
        torch.save({"x": Payload(marker)}, d / "pytorch_model.bin")
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "pytorch_model.bin"}}))

    def damaged(d):
        (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100])

    def nested(d):
        (d / "config.json").write_text("[" * 100000 + "]" * 100000)

    def oversized(d):  # a model of ~50 GiB in fp32: refused on the meta device, before it is allocated
        data = json.loads((d / "config.json").read_text())
        data["megahash_config"]["model"]["hidden_size"] = 1 << 16
        (d / "config.json").write_text(json.dumps(data))

    for name, fn in (
        ("pickle_weights", pickle_weights),
        ("index_outside", index_outside),
        ("index_pickle", index_pickle),
        ("damaged", damaged),
        ("nested", nested),
        ("oversized", oversized),
    ):
        case(name, fn)
    for name, d in cases.items():
        status, err = _cli(["import-hf", "--hf", str(d), "--output", str(tmp_path / f"out_{name}")], capsys)
        assert status == 2 and len(err) == 1 and len(err[0]) < 500, (name, err)
        assert not marker.exists(), name


def test_json_files_of_a_checkpoint_are_one_line(trained, tmp_path, capsys):
    """megahash_state.json nested past the recursion limit or not an object: eval and export refuse in one
    line; RNG states naming a non-dtype or Python objects: the loader refuses (never builds them)."""
    from megahash.checkpoint.rng import load_rng
    from megahash.errors import CheckpointError

    for name, body in (("nested", "[" * 100000 + "]" * 100000), ("list", "[1, 2]"), ("huge", " " * (65 << 20))):
        ckpt = tmp_path / name / trained["ckpt"].name
        shutil.copytree(trained["ckpt"], ckpt)
        (ckpt / "megahash_state.json").write_text(body)
        status, err = _cli(["export", "--checkpoint", str(ckpt), "--output", str(tmp_path / f"q_{name}")], capsys)
        assert status == 2 and len(err) == 1 and len(err[0]) < 500, (name, err)
    rng = trained["ckpt"] / "rng_rank00000.json"
    state = json.loads(rng.read_text())
    for name, patch in (
        ("dtype", {"__tensor__": [1], "dtype": "load"}),
        ("objects", {"__ndarray__": [1], "dtype": "O"}),
    ):
        ckpt = tmp_path / f"rng_{name}"
        ckpt.mkdir()
        (ckpt / rng.name).write_text(json.dumps({**state, "torch": patch}))
        with pytest.raises(CheckpointError) as e:
            load_rng(ckpt)
        assert "\n" not in str(e.value)


def test_a_config_or_state_that_is_not_the_weights_is_one_line(trained, tmp_path, capsys):
    """A checkpoint's resolved_config.yaml that is no mapping (empty, a list), holds a value out of its range
    (hidden_size -32: megatron's negative-dimension traceback) or sizes the weights cannot be (hidden_size 10**8,
    10**5 layers: terabytes allocated, minutes of meta build), or a megahash_state.json whose padded vocabulary is
    a string or 10**12, or whose format is damaged or a later megahash's: eval refuses in one line before
    allocating, and writes nothing."""
    import yaml

    def config(fn):
        def edit(ckpt):
            path = ckpt / "resolved_config.yaml"
            path.write_text(fn(path.read_text()))

        return edit

    def sized(key, value):
        def fn(text):
            tree = yaml.safe_load(text)
            tree["model"][key] = value
            return yaml.safe_dump(tree)

        return config(fn)

    def state(value, key="padded_vocab_size"):
        def edit(ckpt):
            path = ckpt / "megahash_state.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))

        return edit

    cases = {
        "empty config": config(lambda text: ""),
        "a list": config(lambda text: "[1, 2]\n"),
        "hidden_size -32": sized("hidden_size", -32),
        "hidden_size 10**8": sized("hidden_size", 10**8),
        "10**5 layers": sized("num_layers", 10**5),
        "vocabulary 'abc'": state("abc"),
        "vocabulary 10**12": state(10**12),
        "vocabulary 10**30": state(10**30),  # past int64: a torch TypeError traceback
        "ffn_hidden_size 10**30": sized("ffn_hidden_size", 10**30),
        "state format 2": state(2, "format"),  # a later megahash's layout: misread as this one's
        "state format '1'": state("1", "format"),
        "state format true": state(True, "format"),
    }
    assert json.loads((trained["ckpt"] / "megahash_state.json").read_text())["format"] == 1  # what a save records
    for name, edit in cases.items():
        ckpt = copy_of(trained, tmp_path / name.replace(" ", "_").replace("*", ""))
        edit(ckpt)
        forge_manifest(ckpt)
        out = tmp_path / f"e_{len(name)}.json"
        argv = ["eval", "--checkpoint", str(ckpt), "--text", str(trained["text"]), "--out", str(out)]
        status, err = _cli(argv, capsys)
        assert status == 2 and len(err) == 1 and len(err[0]) < 520, (name, err)
        assert ("newer megahash" in err[0]) == (name == "state format 2"), (name, err)
        assert not out.exists(), name
        if name not in ("hidden_size 10**8", "ffn_hidden_size 10**30"):  # report counts these (no weights read)
            status, err = _cli(["report", "--runs", str(ckpt), "--out", str(tmp_path / "r.md")], capsys)
            assert status == 2 and len(err) == 1, (name, err)  # ValueError/TypeError tracebacks, 10**9 layers: hours


def test_plugins_named_by_a_file_are_not_imported(trained, tmp_path, capsys, monkeypatch):
    """model.plugins in an export's config.json or a forged checkpoint's resolved_config.yaml named modules that
    import-hf and eval imported (``this`` printed the Zen of Python; ``python -m megahash`` in the folder ran a
    NAME.py beside it): refused in one line naming MEGAHASH_PLUGINS, the module never imported; named in
    MEGAHASH_PLUGINS it loads (a missing one is one line, not a ModuleNotFoundError traceback). A checkpoint this
    install wrote with the plugin in its config evaluates as before (its signature vouches for the config)."""
    import yaml

    from megahash import catalog

    marker = tmp_path / "RAN"
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "megahash_hostile_plugin.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(mods))
    monkeypatch.setattr(catalog, "_config_plugins", [])
    hf = _hf_export(trained, tmp_path, capsys)
    data = json.loads((hf / "config.json").read_text())
    data["megahash_config"]["model"]["plugins"] = ["megahash_hostile_plugin"]
    (hf / "config.json").write_text(json.dumps(data))
    status, err = _cli(["import-hf", "--hf", str(hf), "--output", str(tmp_path / "imported")], capsys)
    assert status == 2 and len(err) == 1 and "MEGAHASH_PLUGINS=megahash_hostile_plugin" in err[0], err
    ckpt = copy_of(trained, tmp_path)
    tree = yaml.safe_load((ckpt / "resolved_config.yaml").read_text())
    tree["model"]["plugins"] = ["megahash_hostile_plugin"]
    (ckpt / "resolved_config.yaml").write_text(yaml.safe_dump(tree))
    forge_manifest(ckpt)
    argv = ["eval", "--checkpoint", str(ckpt), "--text", str(trained["text"]), "--out", str(tmp_path / "e.json")]
    status, err = _cli(argv, capsys)
    assert status == 2 and len(err) == 1 and "MEGAHASH_PLUGINS=megahash_hostile_plugin" in err[0], err
    assert not marker.exists() and "megahash_hostile_plugin" not in sys.modules
    data["megahash_config"]["model"]["plugins"] = ["megahash_no_such_plugin"]
    (hf / "config.json").write_text(json.dumps(data))
    monkeypatch.setenv(catalog.PLUGINS_ENV, "megahash_no_such_plugin")
    status, err = _cli(["import-hf", "--hf", str(hf), "--output", str(tmp_path / "imported2")], capsys)
    assert status == 2 and len(err) == 1 and "plugin 'megahash_no_such_plugin' cannot be found" in err[0], err
    monkeypatch.delenv(catalog.PLUGINS_ENV)
    monkeypatch.setattr(catalog, "_config_plugins", [])
    # this install's checkpoint, its config naming a plugin: the signature vouches for it (no variable needed)
    from megahash.checkpoint.origin import written_here
    from megahash.checkpoint.resolve import checkpoint_config

    own = copy_of(trained, tmp_path / "own")
    assert written_here(own)
    monkeypatch.setattr(catalog, "check_foreign_plugins", lambda names, where, trusted=False: seen.append(trusted))
    seen: list = []
    tree = yaml.safe_load((own / "resolved_config.yaml").read_text())
    tree["model"]["plugins"] = ["megahash_hostile_plugin"]  # as a run trained with it would have saved it
    (own / "resolved_config.yaml").write_text(yaml.safe_dump(tree))
    checkpoint_config(own)
    assert seen == [False]  # changed after the save: not vouched for
    from megahash.checkpoint.origin import sign

    forge_manifest(own)
    sign(own)  # what the save of such a run writes
    checkpoint_config(own)
    assert seen == [False, True]
