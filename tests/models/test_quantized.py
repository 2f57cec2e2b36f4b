"""Quantized artifacts (issue 37 item 5, megahash/models/quantized.py, ``megahash export``): the per-row
round trip stays within the format's bound |w - q(w)| <= s/2, packing is lossless, the printed bytes are
the file's size, and the artifact's round-tripped weights evaluate close to the live model."""

import math
import os
import re

import pytest
import torch
from test_batch_ramp import _main

from conftest import TINIER
from megahash.models import quantized as qz


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_pack_is_lossless_and_rows_within_half_a_step(bits):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(37, 3, 11, generator=g) * torch.logspace(-6, 2, 37)[:, None, None]
    w[5] = 0.0  # an all-zero row
    q, s = qz.quantize_rows(w, bits)
    assert q.abs().max() <= qz.qmax(bits) and s.dtype == torch.float16
    for n in (q.numel(), q.numel() - 1, 1, 5):  # sizes that are not multiples of the packing group
        # bit-exact: integer codes
        assert torch.equal(qz.unpack(qz.pack(q.reshape(-1)[:n], bits), bits, n), q.reshape(-1)[:n])
    # the bound holds exactly in fp64 with the stored fp16 scale (no value clips: s is rounded up)
    err = (w.double().reshape(37, -1) - q.double() * s.double()[:, None]).abs()
    assert bool((err <= s.double()[:, None] / 2).all())


def _loss(model, tokens) -> float:
    with torch.no_grad():
        per = model(tokens[:, :-1], labels=tokens[:, 1:])
    return float(per.float().mean())


def test_export_artifact_bytes_bound_and_eval(shakespeare_shards, tmp_path, capsys):
    from megahash.accelerator import process_groups
    from megahash.checkpoint.artifact import read_artifact
    from megahash.checkpoint.weights import load_for_inference
    from megahash.cli import main as cli
    from megahash.eval.run import main as eval_main

    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    run = tmp_path / "run"
    shape = ["model.hidden_size=64", "model.ffn_hidden_size=128"]  # matrices above KEEP_NUMEL are quantized
    # the trainer's QAT path under bf16 autocast: the last step fake-quantized
    qat = ["train.qat.bits=8", "train.qat.fraction=0.34", "train.precision=bf16"]
    status, out = _main(
        [*data, *TINIER, *shape, *qat, "train.steps=3", "train.lr=3e-3", f"train.save_dir={run}"], capsys
    )
    assert status == 0, out[-3000:]
    with process_groups.releasing_group():
        _, live, _ = load_for_inference(run)
        state = {k: v.clone() for k, v in live.state_dict().items() if isinstance(v, torch.Tensor)}
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(3, live.vocab_size - 1, (4, 33), generator=g)
        base = _loss(live, tokens)
        del live
    sizes, losses = {}, {}
    for fmt, codec in (("int8", "zstd"), ("int6", "zstd"), ("int4", "zlib")):
        path = tmp_path / f"m.{fmt}.{codec}"
        assert (
            cli(["export", "--checkpoint", str(run), "--output", str(path), "--quantize", fmt, "--compress", codec])
            == 0
        )
        printed = int(re.search(r"; (\d+) bytes", capsys.readouterr().out)[1])
        assert printed == os.path.getsize(path)
        sizes[fmt] = printed
        back, rec = read_artifact(path)
        assert rec["format"] == fmt and rec["meta"]["weights"] == "live"
        n_quantized = 0
        for name, w in state.items():
            if qz.quantized(name, w):
                n_quantized += 1
                _, s = qz.quantize_rows(w, qz.FORMATS[fmt])
                # decoded in fp32: the bound plus one fp32 rounding of q*s (<= qmax*s*2^-24)
                bound = s.float()[:, None] * (0.5 + qz.qmax(qz.FORMATS[fmt]) * 2.0**-24)
                assert bool(((w - back[name]).reshape(w.shape[0], -1).abs() <= bound).all()), name
            elif w.is_floating_point() and w.ndim <= 1:
                assert torch.equal(back[name], w), name  # bit-exact: fp32 tensors are kept as they are
        assert n_quantized >= 4
        with process_groups.releasing_group():
            _, model, _ = load_for_inference(run, weights=str(path))
            losses[fmt] = _loss(model, tokens)
            del model
    assert sizes["int4"] < sizes["int6"] < sizes["int8"]
    # int8 per row moves the loss of this tiny model by far less than a hundredth of a nat
    assert abs(losses["int8"] - base) < 1e-2 and all(math.isfinite(v) for v in losses.values()), (base, losses)
    # eval: a missing artifact, or an artifact together with --weights ema, is one line and exit 2
    assert eval_main(["--checkpoint", str(run), "--artifact", str(tmp_path / "none")]) == 2
    assert eval_main(["--checkpoint", str(run), "--artifact", str(path), "--weights", "ema"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(l.startswith("error: ") for l in err), err


def test_qat_straight_through_gradient():
    """Inside ``applied()`` the forward sees q(w) (the artifact's round trip, from its formula) and the
    gradient is the one at q(w) (dq/dw := 1); the live weights come back untouched."""
    from types import SimpleNamespace

    from megahash.training import qat

    torch.manual_seed(0)
    m = torch.nn.Module()
    m.decoder = torch.nn.Linear(128, 64)  # 8,192 > KEEP_NUMEL elements: a hidden matrix
    w0 = m.decoder.weight.detach().clone()
    fq = qat.FakeQuant(m, SimpleNamespace(qat=SimpleNamespace(bits=4, fraction=0.5), steps=10))
    assert fq.first_step == 5 and fq.params == [m.decoder.weight]
    x, c = torch.randn(3, 128), torch.randn(3, 64)
    xr, xq = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    s = (w0.abs().amax(1) / 7 * (1 + 2.0**-10)).half().float()  # the rule, written out
    q = (torch.round(w0 / s[:, None]).clamp(-7, 7) * s[:, None]).requires_grad_(True)
    ((xr @ q.T + m.decoder.bias.detach()) * c).sum().backward()
    fq.active = True
    with fq.applied():
        y = m.decoder(xq)
        (y * c).sum().backward()
    # bit-exact: the stored weight restored by a copy
    assert torch.equal(m.decoder.weight.detach(), w0)
    # the same products in the same order: float32 results agree to a few ulps of their size
    torch.testing.assert_close(y.detach(), x @ q.detach().T + m.decoder.bias.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m.decoder.weight.grad, q.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xq.grad, xr.grad, rtol=1e-6, atol=1e-6)  # backward through q(w), not w
    assert float((xq.grad - c @ w0).abs().max()) > 1e-3


@pytest.mark.parametrize(
    "overrides, expect",
    [
        (["train.qat.bits=5"], "'train.qat.bits' must be 0, 4, 6 or 8"),
        (["train.qat.bits=4", "train.zero_stage=3"], "train.qat.bits needs train.zero_stage"),
        (["train.qat.widths=artifact", "train.zero_stage=3"], "train.qat.widths=artifact needs train.zero_stage"),
        (["train.qat.widths=artifact", "train.qat.bits=4"], "takes each group's width from export.artifact"),
        (["train.qat.widths=artefact"], "(did you mean 'artifact'?)"),
    ],
)
def test_qat_config_errors(overrides, expect):
    from megahash.config import load_config
    from megahash.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(expect)):
        load_config(None, overrides)


def test_qat_at_the_artifact_widths_of_each_group():
    """``train.qat.widths=artifact``: every matrix the artifact quantizes, embedding table included, is replaced
    by its round trip at its group's width (the rule written out), the rest untouched; ``bits`` mode keeps the
    decoder's matrices only."""
    from types import SimpleNamespace

    from megahash.accelerator import process_groups
    from megahash.config import load_config
    from megahash.models.megatron_model import MegahashLM
    from megahash.training import qat

    shape = ["model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_layers=2", "model.vocab_size=256"]
    mixed = ["export.artifact.embedding=int6", "export.artifact.attention=int6", "export.artifact.mlp=int4"]
    cfg = load_config(None, [*shape, *mixed, "train.qat.widths=artifact", "train.steps=10"])
    expect = {"embedding": 6, "self_attention": 6, "mlp": 4}
    with process_groups.releasing_group():
        process_groups.init_distributed(1)
        torch.manual_seed(0)
        model = MegahashLM(cfg, 256)
    widths = qat.artifact_widths(model, cfg.export.artifact)
    for name, bits in widths.items():
        slot = "embedding" if name.startswith("embedding.") else name.split(".")[3]
        assert bits == expect[slot], (name, bits)
    assert {n.split(".")[0] for n in widths} == {"embedding", "decoder"} and len(
        widths
    ) == 1 + 2 * 3  # linear_kv, fc1, fc2
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fq = qat.FakeQuant(model, cfg.train, widths)
    fq.active = True
    with fq.applied():
        for name, p in model.named_parameters():
            if name in widths:
                qm = 2 ** (widths[name] - 1) - 1
                w = before[name].reshape(p.shape[0], -1)
                s = (w.abs().amax(1) / qm * (1 + 2.0**-10)).half().float()
                q = torch.round(w / s[:, None]).clamp(-qm, qm) * s[:, None]
                torch.testing.assert_close(p.detach().reshape(p.shape[0], -1), q, rtol=1e-6, atol=1e-7)
                assert float((p.detach() - before[name]).abs().max()) > 0, name
            else:
                assert torch.equal(p.detach(), before[name]), name  # bit-exact: not touched at all
    # bit-exact: the live storage is put back, not recomputed
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    uniform = qat.FakeQuant(model, SimpleNamespace(qat=SimpleNamespace(bits=4, fraction=0.5), steps=10))
    assert len(uniform.params) == 2 * 3 and set(uniform.widths) == {4}  # the decoder's only
