"""Checks of an export against megahash itself: logits on a probe and greedy decoding.

``megahash_logits`` / ``megahash_greedy`` are the reference side (a MegahashLM at TP=1 with
``DecodeState`` incremental decoding, the same loop megahash's lm-eval model runs: the next token is
the argmax over the real vocabulary, the codes of a generated token are computed from the whole
sequence so far); ``load_hf`` loads an exported folder offline; ``verify_export`` compares the two on
a probe (``megahash export-hf`` runs it unless ``--no-verify``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

PROBE_TEXT = "KING. My lord, the queen, my lord, is dead. What says the king?"


def load_hf(folder, dtype=torch.float32):
    """The exported model (remote code trusted), in eval mode."""
    import transformers

    from megahash.errors import CheckpointError
    from megahash.models.arch import arch_of

    cfg = json.loads((Path(folder) / "config.json").read_text())
    auto = getattr(transformers, arch_of(cfg.get("arch", "decoder")).hf_auto)  # AutoModelForCausalLM / ...MaskedLM
    model, info = auto.from_pretrained(str(folder), trust_remote_code=True, dtype=dtype, output_loading_info=True)
    bad = {k: list(v)[:3] for k, v in info.items() if v}
    if bad:
        raise CheckpointError(f"{folder}: weights and model disagree: {bad}")
    return model.eval()


def code_tensor(codes) -> torch.Tensor | None:
    if codes is None:
        return None
    t = torch.from_numpy(np.ascontiguousarray(codes))
    return t if t.dtype == torch.uint8 else t.long()


@torch.no_grad()
def megahash_logits(model, tokens, codes=None, padding_mask=None, vocab: int | None = None):
    """Head logits [b, s, ...] of a MegahashLM (a head over the vocabulary's ``output_layer`` cut to the real
    vocabulary, as the export's head is, whatever its loss: a label-smoothed head's too)."""
    out = model(tokens, hash_codes=codes, padding_mask=padding_mask)
    if vocab and getattr(getattr(model, "head", None), "uses_output_layer", False):
        out = out[..., :vocab]
    return out


@torch.no_grad()
def hf_logits(hf, tokens, codes=None, attention_mask=None):
    kw = {"hash_codes": codes} if codes is not None else {}
    if attention_mask is not None:
        kw["attention_mask"] = attention_mask
    return hf(input_ids=tokens, **kw).logits


@torch.no_grad()
def megahash_greedy(model, ids, max_new_tokens: int, vocab: int, codes_fn=None, prompt_codes=None, eos_id: int = 2):
    """Greedy continuation (list of new ids, stopping after ``eos_id``) of one prompt by incremental
    decoding. ``codes_fn(ids) -> [n, w]`` gives the codes of a whole sequence (hash embeddings);
    ``prompt_codes`` overrides the prompt's codes."""
    from megahash.models.megatron_model import DecodeState

    state = DecodeState(len(model.decoder.layers))
    seq = list(ids)
    codes = None
    if codes_fn is not None:
        codes = code_tensor(prompt_codes if prompt_codes is not None else codes_fn(seq))[None]
    logits = model(torch.tensor([seq]), hash_codes=codes, decode_state=state)[:, -1]
    new = []
    for _ in range(max_new_tokens):
        nxt = int(logits[0, :vocab].float().argmax())
        new.append(nxt)
        seq.append(nxt)
        if nxt == eos_id:
            break
        step_codes = None if codes_fn is None else code_tensor(codes_fn(seq)[-1:])[None]
        logits = model(torch.tensor([[nxt]]), hash_codes=step_codes, decode_state=state)[:, -1]
    return new


def probe_inputs(cfg, model, codec, length: int = 12):
    """(tokens [1, n], codes [1, n, w] or None) of a probe text (random ids without a codec)."""
    from megahash.eval.text import needs_codes

    if codec is not None:
        enc = codec.encode(PROBE_TEXT)
        enc = enc[:length] if len(enc) >= 2 else enc
        return torch.tensor([enc.ids]), code_tensor(codec.codes(enc))[None] if codec.spec is not None else None
    if needs_codes(cfg):
        return None, None
    g = torch.Generator().manual_seed(0)
    return torch.randint(5, max(6, model.vocab_size), (1, length), generator=g), None


def verify_export(cfg, model, folder, codec=None) -> dict:
    """Load ``folder`` and compare its logits with the megahash model's on a probe."""
    from megahash.errors import CheckpointError

    tokens, codes = probe_inputs(cfg, model, codec)
    if tokens is None:
        return {"max_abs_diff": float("nan"), "tokens": 0, "skipped": "no tokenizer to hash a probe"}
    hf = load_hf(folder)
    vocab = hf.config.vocab_size
    ref = megahash_logits(model, tokens, codes, vocab=vocab)
    got = hf_logits(hf, tokens, codes)
    diff = float((ref.float() - got.float()).abs().max())
    exported = str(json.loads((Path(folder) / "config.json").read_text()).get("dtype", "float32"))
    tol = export_tolerance(exported, float(ref.float().abs().max()))
    if not diff <= tol:
        raise CheckpointError(
            f"export check failed: logits of {folder} differ from the checkpoint's by {diff:.3g} "
            f"(tolerance {tol:.3g} for {exported.replace('torch.', '')} weights)"
        )
    return {"max_abs_diff": diff, "tokens": int(tokens.numel()), "tolerance": tol}


def export_tolerance(dtype: str, scale: float) -> float:
    """Largest probe-logit difference an export may show against the checkpoint's fp32 forward.

    The reference is always the checkpoint's fp32 weights (a bf16 run keeps fp32 master weights, and
    those are what it saves) run in fp32. An fp32 export holds the same numbers: 1e-3 (differences of
    kernels and summation order only). A bf16/fp16 export rounds every weight to the dtype and the
    exported model then computes in it, with no fp32 accumulation outside the GEMMs: 8 epsilons of the
    dtype (bf16: 8 x 2^-7 = 0.0625) relative to the logits' scale, which a wrong or misplaced tensor
    exceeds by far (measured for bf16: 4.8e-3 at a logit scale of 0.73, 14 kinds in one model; the
    rounding of 8 significant bits per layer)."""
    name = dtype.replace("torch.", "")
    if name == "float32":
        return 1e-3
    return 8 * torch.finfo(getattr(torch, name)).eps * max(1.0, scale)
