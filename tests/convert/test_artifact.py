"""Mixed-width artifacts (issue 44 item 3; megahash/convert/artifact.py, megahash/models/tensor_groups.py):
a config names its artifact's format per tensor group (``export.artifact``), ``megahash export --checkpoint RUN``
with no other flags writes it, each tensor at its group's width, smaller than all-int8, and ``megahash eval
--artifact`` scores it close to the fp32 weights; ``--quantize`` overrides it; a single-format artifact of the
earlier release still loads; a bad group or format is one line, exit 2, before torch is imported."""

import json
import re
import subprocess
import sys

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

    from megahash.checkpoint.artifact import read_artifact
    from megahash.models import quantized as qz

    g = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(80, 64, generator=g), "a.bias": torch.randn(80, generator=g)}
    buf = io.BytesIO()
    torch.save({"megahash_artifact": 1, "format": "int6", "bits": 6, "meta": {}, "tensors": qz.encode(state, 6)}, buf)
    path = tmp_path / "old.artifact"
    path.write_bytes(qz.compress(buf.getvalue(), "zstd"))
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
    ],
)
def test_bad_group_or_format_is_one_line_before_torch(quantize, expect, tmp_path):
    """Checked before the checkpoint is read or torch imported: the directory holds no checkpoint."""
    code = (
        "import sys; from megahash.cli import main; s = main(['export', '--checkpoint', sys.argv[1], "
        "'--quantize', sys.argv[2]]); assert 'torch' not in sys.modules, 'torch imported'; sys.exit(s)"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), quantize], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expect}"), r.stderr


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
