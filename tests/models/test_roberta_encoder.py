"""The RoBERTa-base-faithful encoder (model.layout=roberta): parameter count = RoBERTa-base's formula
(and transformers' RobertaModel), hidden states = transformers' RobertaModel with the same weights,
MHE in it = eq. 3.5 on position-carrying inputs, hash embeddings compose. TP/SP parity runs in
tests/models/test_attention.py::test_tp2_parity_all_kinds (cases @roberta)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from megahash.accelerator import rng
from megahash.config import load_config

pytestmark = [pytest.mark.usefixtures("dist"), pytest.mark.numerics]


def roberta_base_formula(V=50265, d=768, f=3072, L=12, P=512, T=1):
    """RoBERTa-base without pooler: embeddings (V + P + 2 + T) d + LN 2d; per layer Q/K/V/O 4d^2 + 4d,
    two LayerNorms 4d, FFN 2df + f + d."""
    return (V + P + 2 + T) * d + 2 * d + L * (4 * d * d + 4 * d + 4 * d + 2 * d * f + f + d)


def test_parameter_count_is_roberta_base():
    from transformers import RobertaConfig, RobertaModel

    from megahash.models.megatron_model import build_model

    cfg = load_config(None, ["model.size=bert-base", "model.make_vocab_size_divisible_by=1"])
    with torch.device("meta"):
        ours = build_model(cfg, 50265, init=False)
        ref = RobertaModel(
            RobertaConfig(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1), add_pooling_layer=False
        )
    n = sum(p.numel() for p in ours.parameters())
    assert n == roberta_base_formula() == sum(p.numel() for p in ref.parameters()) == 124_055_040
    assert n + 768 * 768 + 768 == 124_645_632  # + pooler: the published roberta-base count
    assert ours.decoder.final_layernorm is None


def tiny(*extra):
    return load_config(
        None,
        [
            "model.arch=encoder",
            "model.layout=roberta",
            "model.hidden_size=32",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.ffn_hidden_size=64",
            "data.seq_length=16",
            "model.max_position_embeddings=16",
            "model.norm_eps=1e-5",
            "model.type_vocab_size=1",
            "model.make_vocab_size_divisible_by=1",
            *extra,
        ],
    )


def test_hidden_states_equal_transformers_roberta():
    """Same weights in transformers' RobertaModel: equal last hidden states on a padded batch (post-LN,
    positions from 2, padding position 1, token type 0, embedding LayerNorm, GELU)."""
    from transformers import RobertaConfig, RobertaModel

    from megahash.models.megatron_model import build_model

    V = 100
    rng.seed_all(0)
    model = build_model(tiny(), V, dtype=torch.float64).eval()
    with torch.no_grad():  # non-trivial LayerNorm parameters
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.2, 0.2)
    ref = (
        RobertaModel(
            RobertaConfig(
                vocab_size=V,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=18,
                type_vocab_size=1,
                layer_norm_eps=1e-5,
                hidden_act="gelu",
                pad_token_id=1,
            ),
            add_pooling_layer=False,
        )
        .double()
        .eval()
    )
    s = dict(model.state_dict())
    t = {
        "embeddings.word_embeddings.weight": s["embedding.word_embeddings.weight"],
        "embeddings.position_embeddings.weight": s["embedding_extras.position_embeddings.weight"],
        "embeddings.token_type_embeddings.weight": s["embedding_extras.token_type_embeddings.weight"],
        "embeddings.LayerNorm.weight": s["embedding_extras.layernorm.weight"],
        "embeddings.LayerNorm.bias": s["embedding_extras.layernorm.bias"],
    }
    for i in range(2):
        a, r = f"decoder.layers.{i}.", f"encoder.layer.{i}."
        kv_w = s[a + "self_attention.linear_kv.weight"].view(4, 2, 8, 32)
        kv_b = s[a + "self_attention.linear_kv.bias"].view(4, 2, 8)
        for name, w, b in (
            ("query", s[a + "self_attention.linear_q.weight"], s[a + "self_attention.linear_q.bias"]),
            ("key", kv_w[:, 0].reshape(32, 32), kv_b[:, 0].reshape(32)),
            ("value", kv_w[:, 1].reshape(32, 32), kv_b[:, 1].reshape(32)),
        ):
            t[r + f"attention.self.{name}.weight"], t[r + f"attention.self.{name}.bias"] = w, b
        pairs = {
            "attention.output.dense": "self_attention.linear_proj",
            "attention.output.LayerNorm": "input_layernorm",
            "intermediate.dense": "mlp.linear_fc1",
            "output.dense": "mlp.linear_fc2",
            "output.LayerNorm": "pre_mlp_layernorm",
        }
        for hf, mh in pairs.items():
            t[r + hf + ".weight"], t[r + hf + ".bias"] = s[a + mh + ".weight"], s[a + mh + ".bias"]
    missing, unexpected = ref.load_state_dict(t, strict=False)
    assert not unexpected and not [k for k in missing if "position_ids" not in k and "token_type_ids" not in k]
    tok = torch.randint(5, V, (3, 12), generator=torch.Generator().manual_seed(0))
    pad = torch.ones_like(tok, dtype=torch.bool)
    pad[1, 8:] = False
    tok[~pad] = 1  # RoBERTa derives positions from the pad id
    with torch.no_grad():
        ours = model.hidden_states(tok, padding_mask=pad).transpose(0, 1)
        theirs = ref(input_ids=tok, attention_mask=pad.long()).last_hidden_state
    torch.testing.assert_close(ours[pad], theirs[pad], rtol=1e-10, atol=1e-10)


def test_mhe_in_roberta_is_eq_3_5_with_positions():
    """Layer 1's MHE-MUL input is LN(E[tok] + P[pos] + T[0]) and its heads are
    softmax(psi(Q, e_i^Q) psi(K, e_i^K)^T / sqrt(d)) psi(V, e_i^V), psi(A, e) = A (.) 1(e + 1)^T (eq. 3.5),
    with no RoPE: position information enters only through the embeddings, before the head embeddings."""
    from megahash.models.megatron_model import build_model

    V = 100
    rng.seed_all(0)
    model = build_model(tiny("model.schedule=uniform:mhe-mul"), V, dtype=torch.float64).eval()
    att = model.decoder.layers[0].self_attention
    seen = {}
    att.register_forward_hook(lambda mod, args, kwargs, out: seen.update(x=args[0], out=out[0]), with_kwargs=True)
    tok = torch.randint(5, V, (2, 10), generator=torch.Generator().manual_seed(1))
    pad = torch.ones_like(tok, dtype=torch.bool)
    pad[1, 7:] = False
    with torch.no_grad():
        model.hidden_states(tok, padding_mask=pad)
    ex = model.embedding_extras
    pos = torch.where(pad, torch.arange(10) + 2, torch.ones_like(tok))
    e = (
        model.embedding.word_embeddings.weight[tok]
        + ex.position_embeddings.weight[pos]
        + ex.token_type_embeddings.weight[0]
    )
    h = torch.nn.functional.layer_norm(e, (32,), ex.layernorm.weight, ex.layernorm.bias, 1e-5).transpose(0, 1)
    torch.testing.assert_close(seen["x"], h, rtol=1e-12, atol=1e-12)
    n, d = 4, 8
    w = att.linear_qkv.weight
    bias = att.linear_qkv.bias
    q, k, v = (
        (h @ w[i * d : (i + 1) * d].T + bias[i * d : (i + 1) * d]) for i in range(3)
    )  # seed projections [s, b, d]
    heads = []
    for i in range(n):
        qi, ki, vi = (a * (emb.weight[i] + 1) for a, emb in zip((q, k, v), (att.emb_q, att.emb_k, att.emb_v)))
        scores = torch.einsum("sbd,tbd->bst", qi, ki) / math.sqrt(d)
        scores = scores.masked_fill(~pad[:, None, :], float("-inf"))
        heads.append(torch.einsum("bst,tbd->sbd", torch.softmax(scores, -1), vi))
    want = torch.cat(heads, -1) @ att.linear_proj.weight.T  # linear_proj's bias is returned separately
    torch.testing.assert_close(seen["out"], want, rtol=1e-10, atol=1e-12)


def test_hash_embeddings_compose_and_layout_errors():
    """A proj (HashFormers) embedding under the roberta layout trains (finite loss, gradients reach
    the position table); model.layout=roberta on a decoder is a one-line error."""
    from megahash.errors import ConfigError
    from megahash.models.megatron_model import build_model

    rng.seed_all(0)
    model = build_model(tiny("model.embedding=proj", "model.embed.hash_spec=md5", "train.objective=sr"), 100)
    tok = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    codes = torch.randint(0, 256, (2, 12, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 3, (2, 12), generator=torch.Generator().manual_seed(2))
    loss = model(tok, codes, labels=labels, padding_mask=torch.ones_like(tok, dtype=torch.bool)).mean()
    loss.backward()
    assert torch.isfinite(loss) and model.embedding_extras.position_embeddings.weight.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="encoder layout"):
        load_config(None, ["model.layout=roberta"])
