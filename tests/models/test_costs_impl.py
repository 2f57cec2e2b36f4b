"""Costs describe the implementation: measured (meta device) FLOPs, decode cache and saved
activations of every registered kind, shown beside [Xue25] Tables 4.6-4.8, labelled; unknown
kinds give "n/a", never an error."""

from __future__ import annotations

import pytest

from megahash.config import load_config
from megahash.models import costs as c

pytestmark = pytest.mark.usefixtures("dist")
L, B = 256, 2


def cfg_of(kind, *extra):
    schedule = kind if ":" in kind else f"uniform:{kind}"
    return load_config(
        None,
        [
            "model.size=tiny",
            f"model.schedule={schedule}",
            f"data.seq_length={L}",
            "model.max_position_embeddings=256",
            "model.attention.options.fixed_seq_length=256",
            *extra,
        ],
    )


def registered_kinds():
    from megahash.models import registry

    return registry.names("attention")


def test_every_registered_kind_has_costs_and_measured_cache_equals_formula():
    """Every registry kind gets a cost row without error; where measurable, the measured decode cache
    equals the implementation's cache formula (cache_elements, itself tested against the real decode
    caches in tests/models/test_attention.py); mha's measured GEMM FLOPs equal Table 4.6's Standard row."""
    n, d_h, d = 4, 32, 128
    for kind in registered_kinds():
        row = c.layer_costs(cfg_of(kind), kind, B, L)
        assert set(row["differs"]) <= {"prefill_flops", "decode_flops", "cache_bytes", "activation_bytes"}
        if kind == "mha-megatron":  # megatron's own module: nothing measurable, no table row
            assert row["impl_prefill_flops"] == "n/a" and row["thesis_name"] == "n/a"
            continue
        assert isinstance(row["impl_prefill_flops"], int) and row["impl_activation_bytes"] > 0, kind
        groups = 1 if kind == "gqa" else None
        formula = c.cache_elements(kind, B, L, n, d_h, groups, frozen=False)
        assert row["impl_cache_bytes"] == 2 * formula, kind
    mha = c.layer_costs(cfg_of("mha"), "mha", B, L)
    assert mha["impl_prefill_flops"] == mha["prefill_flops"] == 4 * B * L * L * d + 6 * B * L * d * d
    assert "prefill_flops" not in mha["differs"] and "cache_bytes" not in mha["differs"]


def test_approx_forms_against_table_4_8_and_unknown_kinds():
    """approx-thesis's cache is Table 4.8's Approx. row; Based's approx is not (flagged, both shown);
    an unknown kind is "n/a" everywhere."""
    n, d = 4, 128
    thesis = c.layer_costs(cfg_of("approx-thesis"), "approx-thesis", B, L)
    assert (
        thesis["thesis_name"] == "Approx."
        and thesis["impl_cache_bytes"] == thesis["cache_bytes"] == 6 * B * d + 4 * B * d * d / n
    )
    based = c.layer_costs(cfg_of("approx"), "approx", B, L)
    dh = d // n  # Based's state: S [D, d_h] and z [D] per head, D = 1 + d_h + d_h(d_h + 1)/2, 16-bit
    assert "cache_bytes" in based["differs"] and based["impl_cache_bytes"] == 2 * B * n * (
        1 + dh + dh * (dh + 1) // 2
    ) * (dh + 1)
    assert based["impl_cache_bytes"] > 8 * based["cache_bytes"]
    odd = c.layer_costs(cfg_of("mha"), "no-such-kind", B, L)
    assert {odd[k] for k in ("prefill_flops", "cache_bytes", "impl_prefill_flops", "impl_cache_bytes")} == {"n/a"}


def test_gated_deltanet_closed_form_equals_its_measured_costs():
    """gated-deltanet's cost formulas (no [Xue25] row) describe its implementation: prefill GEMM FLOPs at a
    whole number of chunks (256 = 4 x 64), at a padded last chunk (100) and within one chunk (48), decode
    FLOPs and the decode cache equal the meta-device measurements; saved activations are measured only."""
    cfg = cfg_of("gated-deltanet")
    for seq in (256, 100, 48):
        row = c.layer_costs(cfg, "gated-deltanet", B, seq)
        assert row["differs"] == ["activation_bytes"] and row["activation_bytes"] == "n/a", (seq, row)
        assert row["impl_prefill_flops"] == row["prefill_flops"] and row["impl_decode_flops"] == row["decode_flops"]
        assert row["impl_cache_bytes"] == row["cache_bytes"] and row["impl_activation_bytes"] > 0


def test_mfu_flops_use_the_implementation_and_params_shows_both():
    """train_flops_per_token counts the measured attention GEMMs; `megahash params` prints the
    implemented and the [Xue25] table values side by side, labelled."""
    from megahash.models.accounting import count_parameters, format_report

    cfg = cfg_of("approx-thesis")
    d, f, V = 128, 512, 1000
    impl = c.implemented_costs(cfg, "approx-thesis", 1, L)["prefill_flops_per_token"]
    want = 3.0 * (4 * (impl + 2 * d * d + 2 * 3 * d * f) + 2 * d * V)
    assert c.train_flops_per_token(cfg, V, L) == pytest.approx(want)
    assert c.train_flops_per_token(cfg, V, L, measure=False) != pytest.approx(want)  # the table's 14BLd^2
    text = format_report(count_parameters(cfg_of("list:approx,approx-thesis,mha,mlp", "model.num_layers=4"), V))
    assert "implemented" in text and "thesis table" in text and "approx-thesis [Approx.]" in text
    assert "*inference cache (16-bit)" in text.replace(" *", "*")  # approx's cache differs from Table 4.8
