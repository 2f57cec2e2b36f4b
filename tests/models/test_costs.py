"""megahash.models.costs against numbers printed in [Xue25] and hand-computed table values."""

from __future__ import annotations

import pytest

from megahash.models import costs as c


@pytest.mark.parametrize("n,d", [(12, 64), (8, 64), (16, 32), (3, 5)])
def test_table_3_4_formulas(n, d):
    assert c.attention_param_count("sha", n, d) == 3 * d * d * n
    assert c.attention_param_count("mha", n, d) == 3 * d * d * n * n
    assert c.attention_param_count("el-att", n, d) == d * d * n * n
    assert c.attention_param_count("mqa", n, d) == d * d * n * n + 2 * d * d * n
    assert c.attention_param_count("skv", n, d) == 2 * d * d * n * n
    assert c.attention_param_count("mhe-add", n, d) == 3 * d * d * n + 3 * d * n
    assert c.attention_param_count("mhe-mul", n, d) == 3 * d * d * n + 3 * d * n
    # the "#Params (+)" column
    assert c.extra_params_over_sha("mha", n, d) == (3 * n * n - 3 * n) * d * d
    assert c.extra_params_over_sha("el-att", n, d) == (n * n - 3 * n) * d * d
    assert c.extra_params_over_sha("mqa", n, d) == (n * n - n) * d * d
    assert c.extra_params_over_sha("skv", n, d) == (2 * n * n - 3 * n) * d * d
    assert c.extra_params_over_sha("mhe-mul", n, d) == 3 * n * d
    assert c.attention_param_count("gqa", n, d, groups=1) == c.attention_param_count("mqa", n, d)
    assert c.attention_param_count("gqa", n, d, groups=n) == c.attention_param_count("mha", n, d)


def test_table_3_4_bert_base_values():
    n, d = 12, 64
    printed = {
        "sha": 147_456,
        "mha": 1_769_472,
        "el-att": 589_824,
        "mqa": 688_128,
        "skv": 1_179_648,
        "mhe-add": 149_760,
        "mhe-mul": 149_760,
    }
    assert sorted(c.chapter_kinds(3)) == sorted(printed)  # the kinds registering a Table 3.4 row
    assert {k: c.attention_param_count(k, n, d) for k in printed} == printed


def test_gpt3_projection_sec_3_5_4():
    """96 layers, 96 heads, head dim 128: MHA 43.48B, MHE 0.46B, EL-ATT 14.50B, MQA 14.80B, SKV 28.99B."""
    printed = {"mha": 43.48, "mhe-mul": 0.46, "el-att": 14.50, "mqa": 14.80, "skv": 28.99}
    for kind, billions in printed.items():
        assert abs(96 * c.attention_param_count(kind, 96, 128) / 1e9 - billions) < 0.01, kind


@pytest.mark.parametrize(
    "blocks,n,d,printed",
    [
        (
            12,
            12,
            64,
            {"sha": 8.85, "mha": 28.32, "el-att": 14.16, "mqa": 15.34, "skv": 21.23, "mhe-add": 8.88},
        ),  # Table 3.1
        (
            18,
            8,
            64,
            {"sha": 6.49, "mha": 18.87, "el-att": 9.44, "mqa": 10.62, "skv": 14.16, "mhe-mul": 6.52},
        ),  # Table 3.3
        (18, 16, 32, {"mha": 18.87, "mhe-mul": 5.63}),  # Table 3.15 rows
        (18, 4, 128, {"mha": 18.87, "mhe-mul": 8.29}),
        (12, 8, 64, {"mha": 12.58, "mhe-mul": 4.34}),
        (24, 8, 64, {"mha": 25.17, "mhe-mul": 8.69}),
        (18, 12, 64, {"mha": 42.47, "mhe-mul": 13.31}),
        (18, 16, 64, {"mha": 75.50, "mhe-mul": 22.47}),
        (24, 16, 64, {"mha": 100.66, "mhe-mul": 29.96}),  # Table 3.14 LARGE/MEDIUM
    ],
)
def test_attention_totals_printed_in_chapter_3(blocks, n, d, printed):
    """#params of all attention blocks (Q/K/V + output projection) as printed (millions, 2 decimals;
    an encoder-decoder with 6+6 layers has 18 attention blocks)."""
    for kind, millions in printed.items():
        assert abs(blocks * c.block_params(kind, n, d) / 1e6 - millions) < 0.0101, (kind, blocks, n, d)


def test_table_3_13_memory():
    table = {  # weights, gradients, Adam states, activations, total, saving ratio (%)
        "sha": (4423680, 4423680, 5898240, 25165824, 39911424, 44.84),
        "mha": (14155776, 14155776, 18874368, 25165824, 72351744, 0.00),
        "el-att": (7077888, 7077888, 9437184, 25165824, 48758784, 32.61),
        "mqa": (7667712, 7667712, 10223616, 25165824, 50724864, 29.89),
        "skv": (10616832, 10616832, 14155776, 25165824, 60555264, 16.30),
        "mhe-add": (4437504, 4437504, 5916672, 25165824, 39957504, 44.77),
        "mhe-mul": (4437504, 4437504, 5916672, 25165824, 39957504, 44.77),
    }
    for kind, (w, g, adam, act, total, ratio) in table.items():
        m = c.memory_usage(kind)
        assert (m["weights"], m["gradients"], m["adam"], m["activations"], m["total"]) == (w, g, adam, act, total)
        assert round(c.memory_saving_ratio(kind), 2) == ratio


B, L, D, H = 2, 8, 16, 4  # hand-computed values below use these


def test_table_4_5_complexity():
    assert c.time_complexity("mha", B, L, D) == B * L * L * D + B * L * D * D == 6144
    for kind in ("mlp", "approx", "nonapprox"):
        assert c.time_complexity(kind, B, L, D) == 4096
    for kind in ("rndembqk", "fixedseqqk", "staticembqk", "standard"):
        assert c.time_complexity(kind, B, L, D) == 6144


def test_table_4_6_flops():
    pre = {
        "mha": 32768,
        "mlp": 24576,
        "approx": 57344,
        "nonapprox": 24576,
        "rndembqk": 30720,
        "fixedseqqk": 30720,
        "staticembqk": 32768,
    }
    dec = {
        "mha": 4096,
        "mlp": 3072,
        "approx": 5120,
        "nonapprox": 3072,
        "rndembqk": 3840,
        "fixedseqqk": 3840,
        "staticembqk": 4096,
    }
    assert c.chapter_kinds(4) == sorted(pre)  # the kinds registering a Table 4.5-4.8 row
    for kind in pre:
        assert c.flops(kind, "prefill", B, L, D) == pre[kind], kind
        assert c.flops(kind, "decode", B, L, D) == dec[kind], kind
    # sec. 4.13: pre-computed global scores: 2L^2d + 2BLd^2 (prefill), 2BLd + 2d^2 (decode)
    assert c.flops("rndembqk", "prefill", B, L, D, precomputed=True) == 10240
    assert c.flops("fixedseqqk", "decode", B, L, D, precomputed=True) == 1024
    # per token: prefill / (B L), decode / B
    assert c.flops_per_token("mha", "prefill", B, L, D) == 4 * L * D + 6 * D * D
    assert c.flops_per_token("mha", "decode", B, L, D) == 6 * D * D + 4 * L * D
    # "Non-approximate achieves a low FLOP/it, equivalent to that of the simplest MLP"
    assert c.flops("nonapprox", "decode", 8, 2048, 896) == c.flops("mlp", "decode", 8, 2048, 896)
    # generalised chapter-3 rows reduce to Standard for mha-sized projections
    assert c.flops("skv", "prefill", B, L, D, H) == 4 * B * L * D * D + 4 * B * L * L * D
    assert c.flops("mha", "decode", B, L, D, H, groups=1) == c.flops("mqa", "decode", B, L, D, H)


def test_table_4_7_activation_memory():
    t = 2
    expected = {
        "mha": 1536,
        "mlp": 1024,
        "approx": 1600,
        "nonapprox": 1152,
        "rndembqk": 1280,
        "fixedseqqk": 1280,
        "staticembqk": 1536,
    }
    for kind, value in expected.items():
        assert c.activation_memory(kind, B, L, D, H, t) == value, kind


def test_table_4_8_cache():
    expected = {
        "mha": 1024,
        "mlp": 0,
        "approx": 704,
        "nonapprox": 96,
        "rndembqk": 768,
        "fixedseqqk": 768,
        "staticembqk": 1024,
    }
    for kind, value in expected.items():
        assert c.cache_bytes(kind, B, L, D, H) == value, kind
    # "RndEmbQK and FixedSeqQK can reduce the cache size by nearly half" for large batches
    assert abs(c.cache_bytes("rndembqk", 256, 2048, 896, 14) / c.cache_bytes("mha", 256, 2048, 896, 14) - 0.5) < 0.01
    # Approx. and Non-apx.: independent of the context length
    for kind in ("approx", "nonapprox"):
        assert c.cache_bytes(kind, 4, 128, 896, 14) == c.cache_bytes(kind, 4, 4096, 896, 14)


def test_implementation_cache_matches_table_4_8_where_the_forms_agree():
    """16-bit bytes of this implementation's decode cache = Table 4.8, except approx (Based's
    shared-denominator feature map keeps (1 + d_h + d_h(d_h+1)/2)(d_h + 1) numbers per head (x x^T's
    upper triangle) instead of
    Appendix I's 3 vectors + 2 d_h x d_h matrices)."""
    b, ctx, n, d_h = 3, 50, 14, 64
    d = n * d_h
    for kind in ("mha", "mlp", "nonapprox", "rndembqk", "fixedseqqk", "staticembqk"):
        assert 2 * c.cache_elements(kind, b, ctx, n, d_h) == c.cache_bytes(kind, b, ctx, d, n), kind
    assert c.cache_elements("approx", b, ctx, n, d_h) == b * n * (1 + d_h + d_h * (d_h + 1) // 2) * (d_h + 1)
    assert 2 * c.cache_elements("mqa", b, ctx, n, d_h) == c.cache_bytes("mqa", b, ctx, d, n) == 4 * b * ctx * d_h


def test_layer_costs_of_a_config():
    from megahash.config import load_config

    cfg = load_config(None, ["model.size=500m"])
    row = c.layer_costs(cfg, "nonapprox", 8, 2048)
    assert row["thesis_name"] == "Non-apx."
    assert row["decode_flops"] == 6 * 8 * 896**2
    assert row["cache_bytes"] == 2 * 8 * 896 + 4 * 8 * 14
    assert row["qkv_params"] == 3 * 896 * 896
    assert c.layer_costs(cfg, "mlp", 1, 16)["qkv_params"] is None
