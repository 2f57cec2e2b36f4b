"""Mixed-width artifacts (issue 44 item 3; megahash/convert/artifact.py, megahash/models/tensor_groups.py):
a config names its artifact's format per tensor group (``export.artifact``), ``megahash export --checkpoint RUN``
with no other flags writes it, each tensor at its group's width, smaller than all-int8, and ``megahash eval
--artifact`` scores it close to the fp32 weights; ``--quantize`` overrides it; a single-format artifact of the
earlier release still loads; a bad group or format is one line, exit 2, before torch is imported."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_batch_ramp import _main

from conftest import ROOT, TINIER

# a tiny shape whose attention and MLP matrices are above KEEP_NUMEL (4,096 elements): all of them quantized
SHAPE = ["model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_layers=2", "model.mup_base_hidden_size=64"]
WIDTHS = {"embedding": 6, "attention": 6, "mlp": 4}  # what configs/compact_artifact.yaml asks for


def _group_by_name(name: str) -> str:
    """The group of a state-dict key, written out from the model's layout (independent of tensor_groups)."""
    if name.startswith("embedding."):
        return "embedding"
    return {"self_attention": "attention", "mlp": "mlp"}.get(name.split(".")[3] if ".layers." in name else "", "other")


def test_config_artifact_written_with_no_flags_and_scored(shakespeare_shards, tmp_path, capsys):
    from megahash.checkpoint.artifact import read_artifact
    from megahash.cli import main as cli
    from megahash.config import load_config
    from megahash.eval.run import main as eval_main
    from megahash.models import quantized as qz

    a = load_config("configs/compact_artifact.yaml").export.artifact
    assert {g: qz.FORMATS[getattr(a, g)] for g in WIDTHS} == WIDTHS and a.compress == "zlib"
    run = tmp_path / "run"
    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    # the config's own run (Muon, WSD, QAT at the artifact's widths in the last quarter: step 4 of 4), made tiny
    status, out = _main(
        [
            "--config",
            "configs/compact_artifact.yaml",
            *data,
            *TINIER,
            *SHAPE,
            "train.steps=4",
            "train.warmup_steps=1",
            "train.eval_interval=0",
            f"train.save_dir={run}",
            "train.save_interval=0",
        ],
        capsys,
    )
    assert status == 0, out[-3000:]
    assert cli(["export", "--checkpoint", str(run)]) == 0
    printed = capsys.readouterr().out
    path = run / "artifacts" / "step_00000004.artifact"  # the documented default path, printed
    assert f"-> {path}:" in printed and "mlp=int4" in printed, printed
    assert int(re.search(r"; (\d+) bytes", printed)[1]) == path.stat().st_size
    # the default path again: refused in one line before the model is built, the file as it was; --overwrite
    # replaces it (the same weights and formats: the same bytes)
    before = path.read_bytes()
    assert cli(["export", "--checkpoint", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {path} already exists; pass --overwrite to replace it (or --output for another file)"]
    assert path.read_bytes() == before
    assert cli(["export", "--checkpoint", str(run), "--overwrite"]) == 0 and path.read_bytes() == before
    capsys.readouterr()
    back, rec = read_artifact(path)
    assert rec["format"] == "mixed" and rec["formats"]["mlp"] == "int4"
    tensors = torch.load(__import__("io").BytesIO(qz.decompress(path.read_bytes(), 1 << 30)), weights_only=True)[
        "tensors"
    ]
    seen = set()
    for name, e in tensors.items():
        if "packed" in e:
            group = _group_by_name(name)
            assert e["bits"] == WIDTHS[group], (name, e["bits"])
            assert e["packed"].numel() == qz.packed_bytes(torch.Size(e["shape"]).numel(), WIDTHS[group])
            seen.add(group)
    assert seen == set(WIDTHS), seen  # every group has a quantized tensor here
    # --quantize int8: every group at int8, a single-format (version 1) artifact, larger than the mixed one
    int8 = tmp_path / "all.int8"
    assert cli(["export", "--checkpoint", str(run), "--output", str(int8), "--quantize", "int8"]) == 0
    capsys.readouterr()
    _, rec8 = read_artifact(int8)
    assert rec8["megahash_artifact"] == 1 and rec8["format"] == "int8"
    assert path.stat().st_size < 0.8 * int8.stat().st_size
    # eval through --artifact: the held-out text's bits per byte within 2% of the fp32 weights'
    text = tmp_path / "held_out.txt"
    text.write_text(
        "\n\n".join(
            "Shall I compare thee to a summer's day? Thou art more lovely and more temperate." for _ in range(6)
        )
    )
    bpb = {}
    for weights in ([], ["--artifact", str(path)], ["--artifact", str(int8)]):
        out_json = tmp_path / f"bpb{len(bpb)}.json"
        assert eval_main(["--checkpoint", str(run), "--text", str(text), "--out", str(out_json), *weights]) == 0
        bpb[weights[-1] if weights else "fp32"] = json.loads(out_json.read_text())["bpb"]
    capsys.readouterr()
    assert bpb[str(path)] == pytest.approx(bpb["fp32"], rel=0.02), bpb
    assert bpb[str(int8)] == pytest.approx(bpb["fp32"], rel=2e-3), bpb


def test_single_format_artifact_of_the_earlier_release_still_loads(tmp_path):
    """A version-1 record (one ``bits`` for the file, none per entry), as the earlier release wrote it."""
    import io

    import zstandard

    from megahash.checkpoint.artifact import read_artifact
    from megahash.models import quantized as qz

    g = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(80, 64, generator=g), "a.bias": torch.randn(80, generator=g)}
    buf = io.BytesIO()
    torch.save({"megahash_artifact": 1, "format": "int6", "bits": 6, "meta": {}, "tensors": qz.encode(state, 6)}, buf)
    path = tmp_path / "old.artifact"
    path.write_bytes(zstandard.ZstdCompressor(level=19).compress(buf.getvalue()))  # a bare zstd frame, no digest
    back, rec = read_artifact(path)
    q, s = qz.quantize_rows(state["a.weight"], 6)
    # bit-exact: the same integer codes and fp16 scales through the same dequantize
    torch.testing.assert_close(back["a.weight"], qz.dequantize_rows(q, s, (80, 64)), rtol=0, atol=0)
    # bit-exact: a 1-D fp32 tensor is stored as it is
    assert torch.equal(back["a.bias"], state["a.bias"]) and rec["format"] == "int6"


def test_mixed_record_with_a_bad_width_is_refused(tmp_path):
    """An entry of a mixed artifact whose width is no format, or whose packed bytes do not match its width."""
    import io

    from megahash.checkpoint.artifact import read_artifact
    from megahash.errors import CheckpointError
    from megahash.models import quantized as qz

    state = {"a.weight": torch.randn(80, 64), "b.weight": torch.randn(64, 80)}
    for widths, why in (({"a.weight": 4, "b.weight": 6}, None), ({"a.weight": 4, "b.weight": 5}, "bits 5")):
        tensors = qz.encode(state, {k: 4 if v == 5 else v for k, v in widths.items()})
        tensors["b.weight"]["bits"] = widths["b.weight"]
        buf = io.BytesIO()
        torch.save({"megahash_artifact": 2, "format": "mixed", "bits": None, "meta": {}, "tensors": tensors}, buf)
        path = tmp_path / "m.artifact"
        path.write_bytes(qz.compress(buf.getvalue(), "zlib"))
        if why is None:
            back, _ = read_artifact(path)
            q, s = qz.quantize_rows(state["b.weight"], 6)
            # bit-exact: the same integer codes and fp16 scales through the same dequantize
            torch.testing.assert_close(back["b.weight"], qz.dequantize_rows(q, s, (64, 80)), rtol=0, atol=0)
        else:
            with pytest.raises(CheckpointError, match="b.weight: bits 5 is not one of"):
                read_artifact(path)
    tensors["b.weight"]["bits"] = 6  # packed as int4: 2 values a byte, not 4 in 3
    buf = io.BytesIO()
    torch.save({"megahash_artifact": 2, "format": "mixed", "bits": None, "meta": {}, "tensors": tensors}, buf)
    path.write_bytes(qz.compress(buf.getvalue(), "zlib"))
    with pytest.raises(CheckpointError, match="b.weight: its packed values do not hold 5120 6-bit values"):
        read_artifact(path)


@pytest.mark.parametrize(
    "quantize, expect",
    [
        ("mpl=int4", "unknown config key 'export.artifact.mpl' (did you mean 'mlp'?)"),
        ("mlp=int5", "config key 'export.artifact.mlp' must be int8, int6 or int4, got 'int5'"),
        ("int3", "config key 'export.artifact.embedding' must be int8, int6 or int4, got 'int3'"),
        ("", "--quantize is empty; give a format"),
        (" ", "--quantize is empty; give a format"),
        ("int8,", "--quantize 'int8,' has an empty entry"),
        ("mlp=int4,,attention=int6", "--quantize 'mlp=int4,,attention=int6' has an empty entry"),
        ("mlp=int4,mlp=int6", "--quantize 'mlp=int4,mlp=int6' gives group 'mlp' twice ('int4' and 'int6')"),
        ("int8,int6", "--quantize 'int8,int6' gives a format for every group twice"),
        ("=int4", "--quantize entry '=int4' names no group"),
    ],
)
def test_bad_group_or_format_is_one_line_before_torch(quantize, expect, tmp_path):
    """Checked before the checkpoint is read or torch imported: the directory holds no checkpoint. An empty
    spec or entry and a group given twice (the last one won silently) are refused too."""
    code = (
        "import sys; from megahash.cli import main; s = main(['export', '--checkpoint', sys.argv[1], "
        "'--quantize', sys.argv[2]]); assert 'torch' not in sys.modules, 'torch imported'; sys.exit(s)"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), quantize], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expect}"), r.stderr


def test_quantize_spec_means_what_the_config_would():
    """Formats are case-insensitive as every config choice is (``export.artifact.mlp: INT4`` in a config is
    int4); a format for every group and group entries give the same config in either order."""
    from megahash.config import load_config
    from megahash.convert.artifact import quantize_overrides

    def formats(spec):
        a = load_config(None, quantize_overrides(spec)).export.artifact
        return {g: getattr(a, g) for g in ("embedding", "attention", "mlp", "head", "other")}

    six = {"embedding": "int6", "attention": "int6", "mlp": "int4", "head": "int6", "other": "int6"}
    assert formats("int6,mlp=int4") == formats("mlp=int4,int6") == formats(" MLP=int4 , INT6".lower()) == six
    assert formats("INT6") == formats("int6") == {**six, "mlp": "int6"}
    assert formats("mlp=Int4") == {**{g: "int8" for g in six}, "mlp": "int4"}
    assert load_config(None, ["export.artifact.mlp=INT4"]).export.artifact.mlp == "int4"  # the config's own rule


def _export_here(argv, tmp_path):
    """``megahash export ARGV`` in a fresh process: (status, stderr lines, whether torch was imported)."""
    code = (
        "import sys, json; from megahash.cli import main; s = main(json.loads(sys.argv[1])); "
        "print('torch' in sys.modules); sys.exit(s)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argv)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    return r.returncode, r.stderr.strip().splitlines(), r.stdout.strip() == "True"


def test_unwritable_or_existing_output_is_one_line_before_any_work(tmp_path):
    """``--output`` a folder, under a file, or an existing file without ``--overwrite``: one line, exit 2,
    before the checkpoint is read (here there is none) or torch imported, the existing file untouched
    (a folder was an IsADirectoryError traceback after the export, a file above a FileExistsError one, a
    file was overwritten, even a run's resolved_config.yaml). ``export-hf --output`` a file or under one too."""
    folder, afile = tmp_path / "folder", tmp_path / "x.json"
    folder.mkdir()
    afile.write_text("{}")
    nowhere = str(tmp_path / "no_run")  # a folder without a checkpoint: reading it would be a CheckpointError
    Path(nowhere).mkdir()
    for output, expect in (
        (folder, f"--output {folder} is a folder; name the file to write, e.g. --output {folder / 'model.artifact'}"),
        (afile / "a.art", f"--output {afile / 'a.art'}: {afile} is a file, not a folder; name another --output"),
        (afile, f"{afile} already exists; pass --overwrite to replace it (or --output for another file)"),
    ):
        status, err, torch_imported = _export_here(
            ["export", "--checkpoint", nowhere, "--output", str(output)], tmp_path
        )
        assert status == 2 and err == [f"error: {expect}"] and not torch_imported, (output, err)
    assert afile.read_text() == "{}"
    status, err, _ = _export_here(["export", "--checkpoint", nowhere, "--output", str(afile), "--overwrite"], tmp_path)
    assert status == 2 and err == [
        f"error: {nowhere} holds no complete megahash checkpoint (no step_N with megahash_state.json)"
    ], err  # past the output check
    for output, expect in (
        (afile, f"--output {afile} is a file; name a folder for the outputs"),
        (afile / "hf", f"--output {afile / 'hf'}: {afile} is a file, not a folder; name another --output"),
    ):
        status, err, _ = _export_here(["export-hf", "--checkpoint", nowhere, "--output", str(output)], tmp_path)
        assert status == 2 and err == [f"error: {expect}"], (output, err)
    assert afile.read_text() == "{}"


@pytest.mark.parametrize(
    "config, extra",
    [
        ("configs/embeddings/md5-emb-1k.yaml", []),
        ("configs/embeddings/lsh-proj.yaml", []),
        ("configs/embeddings/rolling.yaml", []),
        ("configs/embeddings/bert-hash.yaml", []),
        (None, ["model.tie_embeddings=false"]),
        (None, ["model.schedule=hybrid:rndembqk:even"]),
    ],
)
def test_the_artifact_of_each_model_kind_loads_into_it_whole(config, extra, tmp_path):
    """The model's own artifact loads into another instance of the same model under the strict name check
    (no tensor refused as unexpected: buffers, fixed inputs, tied heads, ``_extra_state``), and every tensor
    the model has comes from the artifact (the loaded weights are the artifact's round trip, not the fresh
    instance's)."""
    from megahash.accelerator import process_groups
    from megahash.checkpoint.artifact import load_artifact_into, read_artifact, write_artifact
    from megahash.config import load_config
    from megahash.models.megatron_model import MegahashLM
    from megahash.models.tensor_groups import tensor_groups

    cfg = load_config(config, [*SHAPE, "model.vocab_size=256", *extra])
    formats = {"embedding": "int6", "attention": "int6", "mlp": "int4", "head": "int8", "other": "int8"}
    path = tmp_path / "own.artifact"
    with process_groups.releasing_group():
        process_groups.init_distributed(1)
        torch.manual_seed(0)
        exported = MegahashLM(cfg, 256, init=True)
        write_artifact(exported.state_dict(), path, "int8", "zstd", {}, formats, tensor_groups(exported))
        torch.manual_seed(1)
        model = MegahashLM(cfg, 256, init=True)
        load_artifact_into(model, path)
    back, _ = read_artifact(path)
    own = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert set(own) == set(back)
    for name, t in own.items():
        # bit-exact: the loaded tensor is the artifact's decoded one, copied into the parameter as it is
        assert torch.equal(t, back[name].to(t.dtype)), name


def test_groups_are_the_module_slots_and_name_the_config_keys():
    """Every key of ``export.artifact`` but the codec is a group of tensor_groups, and the groups of a model
    with an untied head and a hybrid schedule follow the modules (the layer slots, the embedding, the head)."""
    import dataclasses

    from megahash.accelerator import process_groups
    from megahash.config import ArtifactConfig, load_config
    from megahash.models.megatron_model import MegahashLM
    from megahash.models.tensor_groups import GROUPS, tensor_groups

    assert [f.name for f in dataclasses.fields(ArtifactConfig) if f.name != "compress"] == list(GROUPS)
    cfg = load_config(None, ["model.tie_embeddings=false", "model.vocab_size=256", *SHAPE])
    with process_groups.releasing_group():
        process_groups.init_distributed(1)
        model = MegahashLM(cfg, 256, init=False)
        groups = tensor_groups(model)
    assert groups["output_layer.weight"] == "head"
    for name, group in groups.items():
        if not name.startswith("output_layer."):
            assert group == _group_by_name(name), (name, group)
    assert {"embedding", "attention", "mlp", "head", "other"} <= set(groups.values())
