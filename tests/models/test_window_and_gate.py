"""Sliding-window attention (``swa``) and the sigmoid output gate (``gated``) of the softmax kinds (issue 45 item 2).

Independent facts: the window and the gate written out as formulas, megatron-core's own gated ``SelfAttention``
(``attention_output_gate``), mha itself (a window of the whole length), the full forward (decoding with the rolling
cache), SDPA with the banded mask (FlexAttention's block mask), Qwen2's parameter map. The registry-derived tests
(tests/_kinds.py ``variants``) run ``swa+window=4``, ``swa+window=3+gated`` and ``KIND+gated`` everywhere else.
"""

from __future__ import annotations

import math
import os
import types

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from numerics import needs_vector_isa
from test_attention import VOCAB, build, build_attention, make_cfg, tokens

from megahash.accelerator import policy
from megahash.models.forward_state import ForwardState

pytestmark = [pytest.mark.usefixtures("dist"), pytest.mark.numerics]


def _decode(model, tok, steps):
    """Hidden states of ``tok`` fed in pieces of the given lengths with a decoding cache, and the state."""
    from megahash.models.megatron_model import DecodeState

    state = DecodeState(len(model.decoder.layers))
    out, at = [], 0
    with torch.no_grad():
        for n in steps:
            out.append(model.hidden_states(tok[:, at : at + n], decode_state=state))
            at += n
    return torch.cat(out), state


# ------------------------------------------------------------------------ the window


@pytest.mark.parametrize("extra", [(), ("model.num_query_groups=2",), ("model.arch=encoder",)])
def test_a_window_of_the_whole_length_is_mha_bit_for_bit(extra):
    """swa with window >= the sequence length is mha: same parameters (same draws), the same hidden states bit
    for bit (the same kernels: the core drops a window that covers every key), packed documents too; one key
    less and the outputs differ."""
    from megahash.data import documents

    tok = tokens(s=12)
    doc = documents.document_ids(torch.cat([tok[:, :5], torch.full((2, 1), 2), tok[:, 6:]], 1), 2)
    with torch.no_grad():
        mha = build(make_cfg("mha", *extra)).eval()
        ref, ref_doc = mha.hidden_states(tok), mha.hidden_states(tok, document_ids=doc)
        for window, same in ((12, True), (100, True), (11, False)):
            swa = build(make_cfg(f"swa+window={window}", *extra)).eval()
            params = zip(mha.state_dict().values(), swa.state_dict().values())
            assert all(torch.equal(a, b) for a, b in params if torch.is_tensor(a))  # bit-exact: same draws
            got, got_doc = swa.hidden_states(tok), swa.hidden_states(tok, document_ids=doc)
            # bit-exact: one path (the same kernel and mask) when the window holds every key
            assert (torch.equal(got, ref) and torch.equal(got_doc, ref_doc)) == same, window


def _windowed(q, k, v, window, causal):
    """softmax(q k^T / sqrt(d) + M) v with M = 0 iff i - W < j <= i (decoder) or |i - j| < W (encoder), looped."""
    s = q.shape[0]
    allowed = torch.tensor(
        [[(0 <= i - j < window) if causal else (abs(i - j) < window) for j in range(s)] for i in range(s)]
    )
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
    o = torch.softmax(scores, -1) @ v
    return o.permute(2, 0, 1, 3).reshape(s, o.shape[0], -1)


@pytest.mark.parametrize("arch", ["decoder", "encoder"])
@pytest.mark.parametrize("gated", [False, True])
def test_module_equals_the_window_and_gate_written_out(arch, gated):
    """One swa layer (fp64, 2 key/value groups, no RoPE) = the window rule of megahash/ops/utils/window.py written
    as a loop over (i, j), times sigmoid(x W_g^T) per head and channel when gated ([Qiu25] G1)."""
    item = "swa+window=3" + ("+gated" if gated else "")
    cfg = make_cfg(item, "model.qkv_bias=false", "model.num_query_groups=2", f"model.arch={arch}")
    m = build_attention(cfg).double()
    x = torch.randn(9, 2, 32, dtype=torch.float64)
    n, g, d = 4, 2, 8
    with torch.no_grad():
        got = m.mix(x, None, None, ForwardState())
        q = (x @ m.linear_q.weight.T).view(9, 2, n, d)
        kv = (x @ m.linear_kv.weight.T).view(9, 2, g, 2, d)
        k, v = (t.repeat_interleave(n // g, dim=2) for t in (kv[..., 0, :], kv[..., 1, :]))
        want = _windowed(q, k, v, 3, arch == "decoder")
        if gated:
            want = want * torch.sigmoid(x @ m.linear_output_gate.weight.T)
    assert hasattr(m, "linear_output_gate") == gated
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_rolling_cache_keeps_window_minus_one_keys_and_decodes_as_the_forward():
    """Decoding 40 tokens (a prefill of 3, a chunk of 4 on top of the cache, then one at a time) with a window of
    5 over 2 key/value groups: every step equals the full forward (fp64) and the cache never holds more than
    W - 1 = 4 positions (2 B (W - 1) g d_h numbers, swa's cache_elements), however long the text."""
    from megahash.models import costs

    model = build(make_cfg("swa+window=5", "model.num_query_groups=2", "model.max_position_embeddings=64")).eval()
    tok = tokens(s=40)
    with torch.no_grad():
        full = model.hidden_states(tok)
    parts, state = _decode(model, tok, [3, 4] + [1] * 33)
    torch.testing.assert_close(parts, full, rtol=0, atol=1e-10)
    for cache in state.caches:
        assert {k: tuple(t.shape) for k, t in cache.items()} == {"k": (4, 2, 2, 8), "v": (4, 2, 2, 8)}
    assert sum(t.numel() for t in state.caches[0].values()) == costs.cache_elements("swa", 2, 40, 4, 8, 2, window=5)


def test_decode_step_work_and_aten_calls_stay_flat_in_the_context():
    """One decoding step after 32 and after 256 tokens of context: the same ATen calls and the same keys attended
    in every layer for swa (its cache stops at the window: a step's work and memory are flat in the generated
    length); mha's step attends to the whole context (the measurement can tell)."""
    from megahash.training.op_count import CountOps

    def step(schedule, context):
        model = build(make_cfg(schedule, "model.max_position_embeddings=512"), dtype=torch.float32).eval()
        tok = tokens(b=1, s=context + 1)
        _, state = _decode(model, tok[:, :context], [context])
        keys = []
        hooks = [
            m.core_attention.register_forward_hook(lambda mod, args, out: keys.append(args[1].shape[0]))
            for m in model.attention_modules()
        ]
        with torch.no_grad(), CountOps() as ops:
            model.hidden_states(tok[:, context:], decode_state=state)
        for h in hooks:
            h.remove()
        return ops.total(), keys

    assert step("swa+window=8", 32) == step("swa+window=8", 256)
    assert step("swa+window=8", 32)[1] == [8, 8]
    assert step("mha", 32)[1] == [33, 33] and step("mha", 256)[1] == [257, 257]


# ------------------------------------------------------------------------ the kernels


@pytest.mark.parametrize(
    "compiled,head_dim", [(False, 8), pytest.param(True, 16, marks=needs_vector_isa)], ids=["eager", "compiled"]
)
def test_flex_sliding_window_block_mask_equals_sdpa_with_the_band(compiled, head_dim):
    """FlexAttention with the sliding-window BlockMask (the CUDA kernel; eager on CPU: a window alone, with packed
    documents (``and_masks``), an encoder with padding; compiled by inductor's CPU FlexAttention with the block mask
    built compiled, as on CUDA: the packed case; forward only) = SDPA with the boolean band (fp32, 1e-5); blocks
    outside the band are skipped."""
    from megahash.models.attention import document_mask

    s = 384  # three blocks of 128
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, s, head_dim, generator=g) for _ in range(3))
    doc = torch.tensor([[0] * 50 + [1] * 200 + [2] * 134, [0] * s])
    keep = torch.ones(2, s, dtype=torch.bool)
    keep[0, 300:] = False
    flex = policy.flex_attention("cpu", compiled=compiled)
    cases = [(None, True, None, 40), (doc, True, None, 70), (doc, False, keep, 33)]
    for docs, causal, kp, window in cases[1:2] if compiled else cases:
        band = document_mask.boolean_mask(docs, 2, causal, kp, window, s, q.device)
        sd = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band)
        bm = document_mask.block_mask(docs, 2, causal, kp, compiled, window, s, q.device)
        torch.testing.assert_close(flex(q, k, v, block_mask=bm), sd, rtol=0, atol=1e-5)
        if docs is None:  # causal alone keeps 6 of the 9 blocks; a window of 40 keeps 5
            assert bm.sparsity() == pytest.approx(100 * 4 / 9)


def test_model_forward_through_flex_attention_equals_sdpa(monkeypatch):
    """The model's forward with the kernel choice forced to FlexAttention (the CUDA branch; eager on CPU, its block
    masks built eagerly: the compiled build is the test above) = its SDPA branch: swa alone, swa with packed
    documents, and an encoder (fp32, 1e-5)."""
    from megahash.data import documents
    from megahash.models.attention import document_mask

    eager = document_mask.block_mask
    monkeypatch.setattr(document_mask, "block_mask", lambda *a: eager(*a[:4], False, *a[5:]))

    row = tokens(b=1, s=16)
    row[0, 6] = 2  # an EOD: two documents
    docs = {"document_ids": documents.document_ids(row, 2)}
    for extra, kw in (([], {}), ([], docs), (["model.arch=encoder"], {})):
        model = build(make_cfg("swa+window=4", *extra, layers=3), dtype=torch.float32).eval()
        with torch.no_grad():
            sdpa = model(row, **kw)
            with monkeypatch.context() as m:
                m.setattr(policy, "document_attention_kernel", lambda *a, **k: "flex")
                flex = model(row, **kw)
        torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5 * max(1.0, sdpa.abs().max().item()))


def test_the_band_is_built_once_per_forward():
    """Without packed documents the banded SDPA mask lives in the forward's state: three layers, one mask."""
    from megahash.models.attention import document_mask

    built = []
    original = document_mask.additive_mask

    def counting(mask, dtype):
        built.append(mask.shape)
        return original(mask, dtype)

    model = build(make_cfg("swa+window=4", layers=3), dtype=torch.float32).eval()
    document_mask.additive_mask = counting
    try:
        with torch.no_grad():
            model.hidden_states(tokens(s=16))
    finally:
        document_mask.additive_mask = original
    assert built == [(1, 1, 16, 16)]


# ------------------------------------------------------------------------ the gate


def test_gated_mha_equals_megatron_core_gated_attention():
    """megahash's gated mha = megatron-core's SelfAttention with ``attention_output_gate`` (its fused linear_qkv
    holds, per key/value group, [q heads, gate heads, k, v]) with the same weights: the gate, its layout per head
    and its fp32 sigmoid as megatron-core has them."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.utils import init_method_normal, scaled_init_method_normal

    from megahash.models import registry
    from megahash.models.megatron_model import transformer_config

    ours = build_attention(make_cfg("mha+gated", "model.num_query_groups=2"))
    cfg = make_cfg("mha-megatron", "model.num_query_groups=2")
    config = transformer_config(cfg)
    config.init_method = init_method_normal(cfg.model.init_std)
    config.output_layer_init_method = scaled_init_method_normal(cfg.model.init_std, cfg.model.num_layers)
    config.attention_output_gate = True
    ref = build_module(registry.spec("attention", "mha-megatron").build(cfg), config=config, layer_number=1)
    # megatron-core's gate is torch.compile'd (its jit_fuser) and loses its module binding on CPU: its own
    # uncompiled function, bound to the module
    gate_fn = type(ref)._apply_output_gate
    ref._apply_output_gate = types.MethodType(getattr(gate_fn, "_torchdynamo_orig_callable", gate_fn), ref)
    n, g, d = 4, 2, 8
    rows = lambda w, per: w.view(g, per * d, *w.shape[1:])  # noqa: E731 - [group][rows of the group]
    with torch.no_grad():
        parts = [(ours.linear_q, n // g), (ours.linear_output_gate, n // g), (ours.linear_kv, 2)]
        ref.linear_qkv.weight.copy_(torch.cat([rows(m.weight, p) for m, p in parts], 1).reshape(-1, 32))
        ref.linear_qkv.bias.copy_(torch.cat([rows(m.bias, p) for m, p in parts], 1).reshape(-1))
        ref.linear_proj.weight.copy_(ours.linear_proj.weight)
    rot = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, use_cpu_initialization=True)(10)
    x = torch.randn(10, 2, 32)
    torch.testing.assert_close(
        ours(x, None, rotary_pos_emb=rot)[0], ref(x, None, rotary_pos_emb=rot)[0], rtol=1e-5, atol=1e-6
    )


def test_gated_is_built_exactly_by_the_kinds_that_declare_it():
    """``model.attention.options.gated=true`` gates the layers of the kinds whose options declare ``gated`` (the
    mha family, swa) and no other kind's: every registered kind, built with it on."""
    import _kinds

    from megahash import catalog

    declared = set(catalog.option_specs("attention")["gated"].kinds)
    assert {"mha", "gqa", "mqa", "swa"} <= declared
    for kind in _kinds.attention(decoder=True):
        if catalog.caps("attention", kind).fixed_input or kind == "mha-megatron":
            continue  # a model input to build / megatron's own module (no mix of ours)
        module = build_attention(make_cfg(kind, "model.attention.options.gated=true"))
        assert hasattr(module, "linear_output_gate") == (kind in declared), kind


def test_gated_layers_do_not_export_as_qwen2_and_params_count_the_gate():
    """A gated layer has parameters a Qwen2 layer has no place for: ``--format auto`` picks the megahash format
    (the reason names them); ``megahash params`` in closed form counts the gate as the meta-device model does."""
    from megahash.convert import qwen2
    from megahash.models.accounting import count_parameters
    from megahash.models.closed_form import closed_form_report

    plain = build(make_cfg("mha"))
    assert qwen2.ineligible(plain.cfg, plain) == ""
    for schedule in ("hybrid:mha:even:mha+gated", "uniform:mha"):
        extra = ("model.attention.options.gated=true",) if schedule == "uniform:mha" else ()
        model = build(make_cfg(schedule, *extra))
        assert "self_attention.linear_output_gate.weight" in qwen2.ineligible(model.cfg, model)
        closed = closed_form_report(model.cfg, VOCAB)
        counted = count_parameters(make_cfg(schedule, *extra), VOCAB)
        assert closed["total"] == counted["total"] == sum(p.numel() for p in model.parameters())
        gate = (32 * 32 + 32) * sum(hasattr(m, "linear_output_gate") for m in model.attention_modules())
        assert closed["total"] - closed_form_report(plain.cfg, VOCAB)["total"] == gate


# ------------------------------------------------------------------------ costs


def test_swa_costs_are_mha_within_the_window_and_measured_flat():
    """swa's formulas: the Standard row with min(L, W) keys per query (at W >= L exactly mha's), the cache
    min(L, W - 1) positions; the implementation measured on the meta device: decode FLOPs and cache equal the
    formulas and stay the same from L = 256 to 1,024; prefill FLOPs are mha's (SDPA computes the masked map: what
    FlexAttention's block mask saves on CUDA), which ``differs`` says."""
    from megahash.models import costs as c
    from megahash.models.costs import layer_costs

    B, d, h, g = 2, 128, 4, 4
    for L, W in ((256, 300), (256, 257)):
        for key in ("prefill_flops", "decode_flops", "activation_bytes"):
            row = {"prefill_flops": ("prefill",), "decode_flops": ("decode",)}.get(key)
            if row:
                assert c.flops("swa", *row, B, L, d, h, window=W) == c.flops("mha", *row, B, L, d, h)
        assert c.activation_memory("swa", B, L, d, h, window=W) == c.activation_memory("mha", B, L, d, h)
        assert c.cache_bytes("swa", B, L, d, h, g, window=W) == c.cache_bytes("mha", B, L, d, h, g)
    W = 64
    assert c.flops("swa", "prefill", B, 256, d, h, window=W) == 4 * B * 256 * W * d + 6 * B * 256 * d * d
    assert c.flops("swa", "decode", B, 256, d, h, window=W) == 6 * B * d * d + 4 * B * W * d
    assert c.cache_bytes("swa", B, 256, d, h, g, window=W) == 4 * B * (W - 1) * d
    assert c.time_complexity("swa", B, 256, d, window=W) == B * 256 * W * d + B * 256 * d * d

    def measured(L):
        cfg = make_cfg(
            f"swa+window={W}", "model.size=tiny", f"data.seq_length={L}", f"model.max_position_embeddings={L}"
        )
        return layer_costs(cfg, "swa", B, L, options={"window": W})

    short, long = measured(256), measured(1024)
    for row in (short, long):
        assert row["impl_decode_flops"] == row["decode_flops"] and row["impl_cache_bytes"] == row["cache_bytes"]
        assert "prefill_flops" in row["differs"] and "decode_flops" not in row["differs"]
    assert short["impl_decode_flops"] == long["impl_decode_flops"] and short["cache_bytes"] == long["cache_bytes"]
