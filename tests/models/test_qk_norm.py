"""``model.qk_norm`` (Qwen3 QK-norm) against megatron-core's qk_layernorm and transformers' Qwen3,
and configs/model/1.7b.yaml = Qwen3-1.7B ([Xue25] Tables 4.9-4.10)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from conftest import MICRO
from megahash.accelerator import rng
from megahash.config import load_config

pytestmark = [pytest.mark.usefixtures("dist"), pytest.mark.numerics]
VOCAB = 128


def cfg_of(*extra):
    return load_config(
        None,
        [
            *MICRO,
            "model.qk_norm=true",
            "model.qkv_bias=false",
            "model.num_query_groups=2",
            *extra,
        ],
    )


def build_attention(cfg):
    """One attention module of the config's first layer, built like TransformerLayer does."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.utils import init_method_normal, scaled_init_method_normal

    from megahash.models import registry
    from megahash.models.megatron_model import transformer_config

    registry.load_kinds()
    config = transformer_config(cfg)
    config.init_method = init_method_normal(cfg.model.init_std)
    config.output_layer_init_method = scaled_init_method_normal(cfg.model.init_std, cfg.model.num_layers)
    return build_module(
        registry.spec("attention", registry.schedule_kinds(cfg)[0]).build(cfg), config=config, layer_number=1
    )


def test_mha_qk_norm_equals_megatron_qk_layernorm():
    """megahash mha with model.qk_norm = megatron-core SelfAttention with qk_layernorm (same weights)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    ours = build_attention(cfg_of())
    ref = build_attention(cfg_of("model.schedule=uniform:mha-megatron"))
    g, rep, d = 2, 2, 8
    with torch.no_grad():
        for m in (ours, ref):
            for norm, seed in ((m.q_layernorm, 1), (m.k_layernorm, 2)):
                norm.weight.copy_(1 + 0.3 * torch.randn(d, generator=torch.Generator().manual_seed(seed)))
        wq = ours.linear_q.weight.view(g, rep * d, -1)
        wkv = ours.linear_kv.weight.view(g, 2 * d, -1)
        ref.linear_qkv.weight.copy_(torch.cat([wq, wkv], 1).reshape(-1, wq.shape[-1]))
        ref.linear_proj.weight.copy_(ours.linear_proj.weight)
    rot = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, use_cpu_initialization=True)(10)
    x = torch.randn(10, 2, 32)
    got, want = ours(x, None, rotary_pos_emb=rot)[0], ref(x, None, rotary_pos_emb=rot)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    plain = build_attention(cfg_of("model.qk_norm=false"))
    assert not hasattr(plain, "q_layernorm")


def test_decoder_with_qk_norm_equals_transformers_qwen3():
    """A tiny megahash decoder with qk_norm and no q/k/v bias gives the logits of transformers'
    Qwen3ForCausalLM with the same weights (q_norm/k_norm = q_layernorm/k_layernorm)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megahash.convert.qwen2 import to_qwen2
    from megahash.models.megatron_model import build_model

    cfg = cfg_of()
    rng.seed_all(0)
    model = build_model(cfg, VOCAB, dtype=torch.float64).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    for layer in model.decoder.layers:  # non-trivial norm weights
        with torch.no_grad():
            layer.self_attention.q_layernorm.weight.uniform_(0.5, 1.5)
            layer.self_attention.k_layernorm.weight.uniform_(0.5, 1.5)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    tensors, _ = to_qwen2(state, cfg, 2, VOCAB)
    tensors = {k: v for k, v in tensors.items() if not k.endswith("_proj.bias")}
    for i in range(2):
        a = f"decoder.layers.{i}.self_attention."
        tensors[f"model.layers.{i}.self_attn.q_norm.weight"] = state[a + "q_layernorm.weight"]
        tensors[f"model.layers.{i}.self_attn.k_norm.weight"] = state[a + "k_layernorm.weight"]
    m = cfg.model
    hf = (
        Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                rms_norm_eps=m.norm_eps,
                rope_theta=m.rotary_base,
                max_position_embeddings=64,
                tie_word_embeddings=True,
                attention_bias=False,
            )
        )
        .double()
        .eval()
    )
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    tok = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.gather_logits(model.logits(model.hidden_states(tok)).transpose(0, 1))[..., :VOCAB]
        theirs = hf(tok).logits
    # megatron's RoPE frequencies are fp32 (HF's are fp64 here): ~1e-7
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert (ours - theirs).abs().max() < 1e-3 * ours.std()


def test_1_7b_config_is_qwen3_1_7b():
    """Table 4.10 sizes; Qwen3-1.7B: QK-norm, no q/k/v bias; Table 4.9: LR 3e-4 for Qwen3-1.7B."""
    cfg = load_config(None, ["model.size=1.7b"])
    m = cfg.model
    assert (m.hidden_size, m.ffn_hidden_size, m.num_layers, m.num_heads) == (2048, 6144, 28, 16)
    assert m.qk_norm and not m.qkv_bias
    assert cfg.train.lr == 3e-4
    recipe = load_config("configs/pretrain_1.7b.yaml")
    assert recipe.model.qk_norm and not recipe.model.qkv_bias and recipe.train.lr == 3e-4
    assert recipe.train.min_lr == 0.0 and recipe.train.decay == "cosine"
