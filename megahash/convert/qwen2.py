"""Native ``Qwen2ForCausalLM`` export (no remote code) of standard-attention megahash decoders.

Eligible: ``model.arch=decoder``, ``train.objective=clm``, ``model.embedding=vocab``, ``model.head=vocab``,
every layer ``mha``/``gqa``/``mqa`` with the same number of key/value groups and none dropped by
`skip` mode, no muP (``model.mup_base_hidden_size``: its attention scale and readout multiplier have no Qwen2
field; such a model exports with remote code). megahash's decoder is Qwen2.5's block (RMSNorm, SwiGLU, RoPE, QKV bias), so the
mapping is a renaming:

=========================================================  ==============================================
megahash (TP=1)                                            Qwen2
=========================================================  ==============================================
``embedding.word_embeddings.weight`` (rows < vocab)        ``model.embed_tokens.weight``
``decoder.layers.N.input_layernorm.weight``                ``model.layers.N.input_layernorm.weight``
``...self_attention.linear_q.{weight,bias}``               ``...self_attn.q_proj.{weight,bias}``
``...self_attention.linear_kv`` rows ``[g][k (d), v (d)]``  ``...self_attn.k_proj`` / ``v_proj`` (group-major)
``...self_attention.linear_proj.weight``                   ``...self_attn.o_proj.weight``
``...pre_mlp_layernorm.weight``                            ``...post_attention_layernorm.weight``
``...mlp.linear_fc1.weight`` rows ``[gate (f); up (f)]``    ``...mlp.gate_proj`` / ``mlp.up_proj``
``...mlp.linear_fc2.weight``                               ``...mlp.down_proj.weight``
``decoder.final_layernorm.weight``                         ``model.norm.weight``
``output_layer.weight`` (rows < vocab; absent when tied)   ``lm_head.weight`` (``tie_word_embeddings``)
=========================================================  ==============================================

RoPE: megatron's non-interleaved rotary is Hugging Face's ``rotate_half`` (same inv_freq with
``rope_theta = model.rotary_base``); ``rms_norm_eps = model.norm_eps``; Qwen2 always has q/k/v biases
(zeros when ``model.qkv_bias=false``). The TP padding rows of the vocabulary tables go to
``megahash_extra.safetensors`` (``import-hf`` restores them) since Qwen2's tables have the real
vocabulary's size. The table above is documentation; the code's one map (both directions) is
``GLOBAL_RENAMES``/``VOCAB_TABLES``/``LAYER_RENAMES``/``LAYER_SPLITS`` below.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def _qwen2(group: str, name: str) -> bool:
    """Does the kind register itself as a plain Qwen2 part (``caps.qwen2``)?"""
    from megahash import catalog

    return bool(catalog.caps(group, name).qwen2)


def ineligible(cfg, model) -> str:
    """ "" if the model exports to Qwen2, else why not (one phrase)."""
    from megahash.models.arch import arch_of
    from megahash.objective_spec import objective_spec

    m = cfg.model
    if not arch_of(m.arch).causal:
        return f"model.arch={m.arch}"
    if not objective_spec(cfg.train.objective).next_token:
        return f"train.objective={cfg.train.objective}"
    if not _qwen2("embedding", m.embedding):
        return f"model.embedding={m.embedding}"
    if not _qwen2("head", m.head):
        return f"model.head={m.head}"
    if getattr(m, "qk_norm", False):
        return "model.qk_norm=true (Qwen3 QK-norm; Qwen2 has none)"
    if getattr(m, "logit_softcap", 0.0):
        return "model.logit_softcap (Qwen2 has no logit soft-cap)"
    if getattr(m, "mlp_activation", "auto") != "auto":
        return f"model.mlp_activation={m.mlp_activation} (Qwen2's MLP is SwiGLU)"
    if getattr(m, "x0_mix", False) or getattr(m, "unet_skips", False):
        return "model.x0_mix / model.unet_skips (a Qwen2 layer reads the residual stream alone)"
    if getattr(m, "value_embeds", 0):
        return "model.value_embeds (a Qwen2 layer's values are its projection alone)"
    if getattr(m, "mup_base_hidden_size", 0):
        return "model.mup_base_hidden_size (muP's attention scale 1/d_h and readout multiplier; Qwen2 has neither)"
    other = sorted({k for k in model.layer_kinds if not _qwen2("attention", k)})
    if other:
        return f"attention kinds {other}"
    extra = sorted(
        {n.split(".", 3)[3] for n, _ in model.named_parameters() if n.startswith("decoder.layers.")}
        - set(LAYER_RENAMES)
        - set(LAYER_SPLITS)
    )
    if extra:  # e.g. an option's own parameters (an output gate): a Qwen2 layer has no place for them
        return f"layer parameters {extra}"
    groups = {int(layer.self_attention.groups) for layer in model.decoder.layers}
    if len(groups) != 1:
        return f"layers with different key/value group counts {sorted(groups)}"
    from megahash.models import registry

    if any(registry.skipped_layers(cfg, model.layer_kinds)):
        return "layers dropped by skip mode"
    if model.kind_inputs():  # e.g. a token n-gram table: Qwen2 has no place for it
        return f"model inputs {sorted(model.kind_input_attrs)}"
    return ""


# The one megahash <-> Qwen2 name map; both directions (to_qwen2, from_qwen2) read it.
# Whole-model tensors:
GLOBAL_RENAMES = {"decoder.final_layernorm.weight": "model.norm.weight"}
# vocabulary tables: Qwen2 keeps rows < vocab; megahash's TP padding rows go to the extra file
VOCAB_TABLES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "output_layer.weight": "lm_head.weight",
}  # absent when tied
# per layer ("decoder.layers.N." <-> "model.layers.N."), plain renamings:
LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_q.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q.bias": "self_attn.q_proj.bias",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
# per layer, a fused megahash tensor <-> Qwen2 parts: "groups" = rows [group][part][d] (megatron's
# linear_kv), "stack" = rows [part 0; part 1] (SwiGLU's linear_fc1 = [gate; up])
LAYER_SPLITS = {
    "self_attention.linear_kv.weight": (("self_attn.k_proj.weight", "self_attn.v_proj.weight"), "groups"),
    "self_attention.linear_kv.bias": (("self_attn.k_proj.bias", "self_attn.v_proj.bias"), "groups"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "stack"),
}


def _split(t: torch.Tensor, layout: str, groups: int) -> list[torch.Tensor]:
    if layout == "stack":
        return list(t.chunk(2, dim=0))
    rest = t.shape[1:]
    v = t.reshape(groups, 2, -1, *rest)
    return [v[:, j].reshape(-1, *rest) for j in range(2)]


def _join(parts: list[torch.Tensor], layout: str, groups: int) -> torch.Tensor:
    if layout == "stack":
        return torch.cat(parts, dim=0)
    rest = parts[0].shape[1:]
    return torch.stack([p.reshape(groups, -1, *rest) for p in parts], dim=1).reshape(-1, *rest)


def to_qwen2(state: dict, cfg, groups: int, vocab: int) -> tuple[dict, dict]:
    """(Qwen2 tensors, extra tensors: the padding rows) from megahash TP=1 tensors."""
    m = cfg.model
    d = m.hidden_size // m.num_heads
    dtype = state["embedding.word_embeddings.weight"].dtype
    out, extra = {}, {}
    for ours, theirs in VOCAB_TABLES.items():
        if ours in state:
            out[theirs] = state[ours][:vocab]
            extra[ours + ".padding"] = state[ours][vocab:]
    for ours, theirs in GLOBAL_RENAMES.items():
        out[theirs] = state[ours]
    # Qwen2 always has q/k/v biases: zeros when model.qkv_bias=false
    zeros = {
        "self_attention.linear_q.bias": torch.zeros(m.num_heads * d, dtype=dtype),
        "self_attention.linear_kv.bias": torch.zeros(2 * groups * d, dtype=dtype),
    }
    for i in range(m.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."

        def ours(name):
            return state[src + name] if src + name in state else zeros[name]

        for name, theirs in LAYER_RENAMES.items():
            out[dst + theirs] = ours(name)
        for name, (parts, layout) in LAYER_SPLITS.items():
            for theirs, t in zip(parts, _split(ours(name), layout, groups)):
                out[dst + theirs] = t
    return out, extra


def expected_shapes(cfg, groups: int, vocab: int):
    """(Qwen2 tensor name, shape) pairs that :func:`from_qwen2` reads for ``cfg``, layer by layer (the
    biases only with ``model.qkv_bias``; ``lm_head.weight`` only untied)."""
    m = cfg.model
    h, n, f = m.hidden_size, m.num_heads, m.ffn_hidden_size
    d = h // n
    yield "model.embed_tokens.weight", (vocab, h)
    yield "model.norm.weight", (h,)
    if not m.tie_embeddings:
        yield "lm_head.weight", (vocab, h)
    layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (n * d, h),
        "self_attn.o_proj.weight": (h, n * d),
        "mlp.down_proj.weight": (h, f),
        "self_attn.k_proj.weight": (groups * d, h),
        "self_attn.v_proj.weight": (groups * d, h),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
    }
    if m.qkv_bias:
        layer.update({"self_attn.q_proj.bias": (n * d,), "self_attn.k_proj.bias": (groups * d,)})
        layer["self_attn.v_proj.bias"] = (groups * d,)
    for i in range(m.num_layers):
        for k, v in layer.items():
            yield f"model.layers.{i}.{k}", v


def check_tensors(tensors: dict, extra: dict, cfg, groups: int, padded: int, vocab: int) -> None:
    """One-line CheckpointError unless the folder's tensors are the ones ``cfg`` (``groups`` key/value
    groups, ``vocab`` rows padded to ``padded``) needs, at their shapes: checked before :func:`from_qwen2`
    splits, joins or pads anything (a missing tensor was a KeyError, one of another shape a reshape
    RuntimeError, a ``padded`` of 10**12 a zeros() of 128 TB)."""
    from megahash.errors import CheckpointError

    m = cfg.model
    if not (0 < groups <= m.num_heads and m.num_heads % groups == 0):
        raise CheckpointError(f"config.json: {groups} key/value groups do not divide {m.num_heads} heads")
    if not vocab <= padded <= vocab + max(vocab, 1 << 16):
        raise CheckpointError(f"config.json: a padded vocabulary of {padded} rows is not a padding of {vocab}")
    expected = set()
    for name, shape in expected_shapes(cfg, groups, vocab):
        expected.add(name)
        if name not in tensors:
            raise CheckpointError(f"the weights lack {name}, which the model of config.json has")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"the weights do not fit the model of config.json: {name} has shape "
                f"{list(tensors[name].shape)}, the config's model {list(shape)}"
            )
        if not tensors[name].is_floating_point():
            raise CheckpointError(
                f"the weights do not fit the model of config.json: {name} is {str(tensors[name].dtype)[6:]}, "
                "not floating point"
            )
    # what transformers ignores too: a tied model's saved lm_head, the RoPE buffers of older checkpoints
    ignored = {"lm_head.weight"} if m.tie_embeddings else set()
    unexpected = sorted(k for k in tensors if k not in expected | ignored and not k.endswith("rotary_emb.inv_freq"))
    if not m.qkv_bias:  # Qwen2 always has q/k/v biases: an export of model.qkv_bias=false writes zeros
        unexpected = [k for k in unexpected if not (k.endswith("_proj.bias") and not bool(tensors[k].any()))]
    if unexpected:  # e.g. the layers of a config.json that names fewer than the weights have: dropped before
        raise CheckpointError(
            f"the weights do not fit the model of config.json: tensors it has no place for: {unexpected[:3]}"
            + (f" (+{len(unexpected) - 3} more)" if len(unexpected) > 3 else "")
        )
    for table in VOCAB_TABLES:
        pad = extra.get(table + ".padding")
        if pad is not None and tuple(pad.shape) != (padded - vocab, m.hidden_size):
            raise CheckpointError(
                f"{table}.padding has shape {list(pad.shape)}, the config's padding rows "
                f"{[padded - vocab, m.hidden_size]}"
            )


def from_qwen2(tensors: dict, extra: dict, cfg, groups: int, padded: int) -> dict:
    """megahash TP=1 tensors from Qwen2 tensors (+ the padding rows; zeros if absent)."""
    m = cfg.model
    state = {}

    def padded_rows(t, key):
        pad = extra.get(key)
        if pad is None:
            pad = torch.zeros(padded - t.shape[0], t.shape[1], dtype=t.dtype)
        return torch.cat([t, pad.to(t.dtype)], dim=0)

    for ours, theirs in VOCAB_TABLES.items():
        if theirs in tensors:
            state[ours] = padded_rows(tensors[theirs], ours + ".padding")
    for ours, theirs in GLOBAL_RENAMES.items():
        state[ours] = tensors[theirs]
    wanted = (lambda name: True) if m.qkv_bias else (lambda name: not name.endswith(".bias"))
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for name, theirs in LAYER_RENAMES.items():
            if wanted(name):
                state[dst + name] = tensors[src + theirs]
        for name, (parts, layout) in LAYER_SPLITS.items():
            if wanted(name):
                state[dst + name] = _join([tensors[src + theirs] for theirs in parts], layout, groups)
    return state


def write(out: Path, cfg, model, state: dict, fields: dict, dtype: torch.dtype, max_shard_size="2GB") -> list[str]:
    """Write ``model.safetensors`` (+ extra) and a Qwen2 ``config.json`` into ``out``."""
    from transformers import Qwen2Config

    from megahash.convert.hf_folder import EXTRA_FILE, cast, save_tensors, save_weights, special_token_ids

    m = cfg.model
    groups = int(model.decoder.layers[0].self_attention.groups)
    vocab = fields["vocab_size"]
    tensors, extra = to_qwen2(state, cfg, groups, vocab)
    weights = save_weights(out, cast(tensors, dtype), max_shard_size)
    save_tensors(out / EXTRA_FILE, cast(extra, dtype))
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=groups,
        hidden_act="silu",
        max_position_embeddings=m.max_position_embeddings,
        initializer_range=m.init_std,
        rms_norm_eps=m.norm_eps,
        use_cache=True,
        tie_word_embeddings=bool(model.tie),
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
        use_sliding_window=False,
        attention_dropout=0.0,
        **special_token_ids(cfg),
    )
    config.architectures = ["Qwen2ForCausalLM"]
    config.dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    config.save_pretrained(str(out))
    # megahash extras (ignored by Qwen2): the resolved config and what import-hf needs
    path = out / "config.json"
    data = json.loads(path.read_text())
    # n_positions: the context megahash trained and evaluates with (lm-eval's hf model reads it first)
    data.update(
        megahash_config=fields["megahash_config"],
        megahash_padded_vocab_size=fields["padded_vocab_size"],
        n_positions=fields["n_positions"],
        # transformers 4.x reads rope_theta (else it silently uses 10000); 5.x rope_parameters
        rope_theta=float(m.rotary_base),
        megahash_step=fields["megahash_step"],
        megahash_kv_groups=groups,
    )
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return [*weights, EXTRA_FILE, "config.json"]


# ----------------------------------------------------------------------------------- import of any Qwen2 folder


def load_hf_tensors(folder) -> dict:
    """Tensors of a Hugging Face folder: ``model.safetensors`` or the shards named by
    ``model.safetensors.index.json`` (safetensors only: a folder with ``pytorch_model.bin`` and no
    safetensors is refused, pickles are never read). One-line CheckpointError for a damaged file."""
    from megahash.errors import CheckpointError

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        return read_safetensors(folder / "model.safetensors")
    if index.is_file():
        from megahash.checkpoint.layout import read_json

        try:
            names = sorted(set(read_json(index)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} does not map weights to files ({type(e).__name__}: {e})") from None
        out = {}
        for name in names:
            if not (isinstance(name, str) and name.endswith(".safetensors") and Path(name).name == name):
                raise CheckpointError(f"{index} names {str(name)[:80]!r}, not a safetensors file of the folder")
            out.update(read_safetensors(folder / name))
        return out
    raise CheckpointError(
        f"{folder} has neither model.safetensors nor model.safetensors.index.json (only safetensors weights are read)"
    )


def read_safetensors(path: Path) -> dict:
    """The tensors of a safetensors file (which holds no code); one line for a damaged one."""
    from safetensors.torch import load_file

    from megahash.errors import CheckpointError

    try:
        return load_file(str(path))
    except Exception as e:  # SafetensorError, OSError, ...
        raise CheckpointError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None


def number(data: dict, key: str, kind=int, default=...):
    """``data[key]`` as a finite ``kind`` (int: a whole JSON number, not a bool); ``default`` when absent or
    null (no default: required). One-line CheckpointError naming the key for anything else (a string, a list,
    1e400), so a config.json of another shape never reaches ``int()`` or a tensor size."""
    from megahash.errors import CheckpointError

    value = data.get(key)
    if value is None:
        if default is ...:
            raise CheckpointError(f"config.json has no {key}")
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and kind is int:
        ok = float(value).is_integer()
    if not ok:
        raise CheckpointError(
            f"config.json: {key} must be a {'whole' if kind is int else 'finite'} number, got {str(value)[:80]!r}"
        )
    return kind(value)


def size(data: dict, key: str, default=...) -> int:
    """``data[key]`` as a size (a whole number >= 1), :func:`number`'s rules otherwise."""
    from megahash.errors import CheckpointError

    value = number(data, key, int, default)
    if value < 1:
        raise CheckpointError(f"config.json: {key} must be >= 1, got {value}")
    return value


# model_type -> (name in messages, q/k/v biases): families whose decoder is Qwen2's block (RMSNorm, SwiGLU,
# RoPE rotate_half, GQA) with the same tensor names; Llama and Mistral have no q/k/v biases unless attention_bias
IMPORTABLE = {"qwen2": "Qwen2", "llama": "Llama", "mistral": "Mistral"}


def megahash_tree(data: dict, folder) -> dict:
    """A megahash config tree for a standard ``Qwen2ForCausalLM``, ``LlamaForCausalLM`` or ``MistralForCausalLM``
    config.json (without sliding windows shorter than the context, RoPE scaling, or Llama's o_proj/MLP biases):
    megahash's decoder block with ``mha`` in every layer, ``model.num_query_groups`` = its key/value heads, QKV
    biases (Qwen2; Llama's ``attention_bias``), ``rotary_base = rope_theta`` (transformers 4.x ``rope_theta`` or
    5.x ``rope_parameters``). The folder's tokenizer, if any, becomes ``data.tokenizer`` with its special ids."""
    from megahash.errors import ConfigError

    family = IMPORTABLE.get(data.get("model_type"), "Qwen2")

    def need(ok, what):
        if not ok:
            raise ConfigError(f"cannot import this {family} model into megahash's decoder: {what}")

    need(
        data.get("hidden_act", "silu") == "silu", f"hidden_act={str(data.get('hidden_act'))[:80]!r} (SwiGLU needs silu)"
    )
    need(not data.get("use_sliding_window"), "use_sliding_window=true")
    if family == "Qwen2":
        qkv_bias = True
    else:
        need(not data.get("mlp_bias"), "mlp_bias=true (megahash's MLP has no biases)")
        qkv_bias = bool(data.get("attention_bias", False))
        need(not qkv_bias, "attention_bias=true (an o_proj bias: megahash's output projection has none)")
        window = number(data, "sliding_window", int, None) if family == "Mistral" else None
        need(
            window is None or window >= size(data, "max_position_embeddings", 2048),
            f"sliding_window={window} shorter than max_position_embeddings",
        )
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    need(isinstance(rope, dict), f"rope_parameters is a {type(rope).__name__}, not an object")
    need(rope.get("rope_type", rope.get("type", "default")) in ("default", None), f"RoPE scaling {str(rope)[:200]}")
    theta = number(data, "rope_theta", float, None) or number(rope, "rope_theta", float, None) or 10000.0
    need(theta > 0 and theta.is_integer(), f"rope_theta={theta} (megahash's model.rotary_base is a positive integer)")
    h, n = size(data, "hidden_size"), size(data, "num_attention_heads")
    kv = size(data, "num_key_value_heads", n)
    need(h % n == 0 and (data.get("head_dim") in (None, h // n)), f"head_dim={data.get('head_dim')} != hidden/heads")
    need(n % kv == 0, f"{n} heads not divisible into {kv} key/value groups")
    max_pos = size(data, "max_position_embeddings", 2048)
    from megahash import catalog
    from megahash.objective_spec import standard as standard_objective

    tree = {
        "model": {
            "arch": "decoder",
            "hidden_size": h,
            "num_layers": size(data, "num_hidden_layers"),
            "num_heads": n,
            "num_query_groups": 0 if kv == n else kv,
            "ffn_hidden_size": size(data, "intermediate_size"),
            "vocab_size": size(data, "vocab_size"),
            "max_position_embeddings": max_pos,
            "rotary_base": int(theta),
            "tie_embeddings": bool(data.get("tie_word_embeddings", False)),
            "qkv_bias": qkv_bias,
            "norm_eps": number(data, "rms_norm_eps", float, 1e-6),
            "init_std": number(data, "initializer_range", float, 0.02),
            "embedding": catalog.standard("embedding"),
            "head": catalog.standard("head"),
            "schedule": f"uniform:{catalog.standard('attention')}",
        },
        "train": {"objective": standard_objective()},
        "data": {"seq_length": min(max_pos, 2048)},
    }
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file():
        from megahash.tokenization import load_tokenizer

        tok = load_tokenizer(str(folder.resolve()))
        tree["data"].update(tokenizer=str(folder.resolve()), special_ids=dict(tok.special_ids))
    return tree
