"""One rank of the TP parity check of tests/models/test_attention.py (run as 2 gloo processes).

For every case: build the model from the same seed at TP=1, TP=2 and TP=2 + sequence parallel,
run the same batch in float64, and record the mean loss and the global gradient norm^2 (TP-split
parameters summed over ranks, replicated ones counted once). At TP=1 the case also runs through
the kinds' plain-torch references (``megahash.convert.reference.reference_model``: the HF export's model, weights
through the export's name map): largest logit and per-parameter gradient differences. Rank 0
writes a JSON file.
Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python attention_tp_worker.py OUT CASES
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megahash.accelerator import process_groups, rng
from megahash.config import load_config

VOCAB, SEQ, BATCH = 256, 16, 2


def case_config(case: str, tp: int, sp: bool):
    """case = KIND[@encoder][@gN][@resid][@vemb][@emb=EMBEDDING] or a schedule (contains ':')."""
    parts = case.split("@")
    kind, opts = parts[0], parts[1:]
    schedule = kind if ":" in kind else f"uniform:{kind}"
    over = [
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.ffn_hidden_size=64",
        f"model.schedule={schedule}",
        f"data.seq_length={SEQ}",
        "model.max_position_embeddings=64",
        "model.attention.options.fixed_seq_length=64",
        f"parallel.tensor={tp}",
        f"parallel.sequence={str(sp).lower()}",
    ]
    for o in opts:
        if o == "encoder":
            over += ["model.arch=encoder"]
        elif o.startswith("g"):
            over += [f"model.num_query_groups={int(o[1:])}"]
        elif o == "chunk":
            over += ["model.attention.options.chunk_size=4"]
        elif o == "roberta":
            over += ["model.arch=encoder", "model.layout=roberta", "model.hidden_dropout=0.0"]
        elif o == "qknorm":
            over += ["model.qk_norm=true"]
        elif o.startswith("f"):
            over += [f"model.attention.options.feature_dim={int(o[1:])}"]
        elif (
            o == "ngram"
        ):  # the token n-gram hash table added to the embedding (megahash/models/embeddings/ngram_hash.py)
            over += ["model.embed.options.ngram_hash_buckets=32", "model.embed.options.ngram_hash_dim=8"]
        elif o == "resid":  # model.x0_mix and model.unet_skips (megahash/models/residual_mix.py), two skips
            over += ["model.x0_mix=true", "model.unet_skips=true", "model.num_layers=4"]
        elif o == "vemb":  # model.value_embeds (megahash/models/value_embeds.py): one table, both layers fed
            over += ["model.value_embeds=1"]
        elif o.startswith("emb="):  # an embedding kind that reads token ids (no hash codes here)
            over += [f"model.embedding={o[4:]}"]
    return load_config(None, over)


def setup(case: str, tp: int, sp: bool):
    from megahash.models.attention import fixed_qk
    from megahash.models.megatron_model import build_model

    cfg = case_config(case, tp, sp)
    rng.seed_all(7)
    model = build_model(cfg, VOCAB, dtype=torch.float64)
    if getattr(model, "fixed_qk", None) is not None and model.fixed_qk.source == "text":
        fixed_qk.set_fixed_tokens(model, [(11 * i + 3) % VOCAB for i in range(64)])
    with torch.no_grad():  # the inputs a model adds start at zero (an n-gram table): a seeded draw, same on every rank
        g = torch.Generator().manual_seed(5)
        for extra in model.kind_inputs():
            for p in extra.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
        if model.decoder.residual is not None:  # the mixing's scalars off their init (1, 0, 1)
            for p in model.decoder.residual.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    padding = torch.ones(BATCH, SEQ, dtype=torch.bool)
    padding[1, SEQ - 5 :] = False
    return cfg, model, tokens, labels, padding


def reference_case(case: str) -> dict:
    """TP=1 model vs the kinds' plain-torch references: logits on the kept positions (encoders: the
    padding mask) and the gradients of the same masked cross-entropy, parameter by parameter."""
    import torch.nn.functional as F

    from megahash.convert.reference import reference_model, reference_names

    cfg, model, tokens, labels, padding = setup(case, 1, False)
    ref = reference_model(cfg, model)
    keep = torch.ones_like(padding) if model.decoder_only else padding
    mask = None if model.decoder_only else padding
    a = model.logits(model.hidden_states(tokens, padding_mask=mask)).transpose(0, 1)
    b = ref(input_ids=tokens, attention_mask=None if mask is None else mask.long()).logits
    F.cross_entropy(a[keep], labels[keep]).backward()
    F.cross_entropy(b[keep], labels[keep]).backward()
    ref_params = dict(ref.named_parameters())
    names = reference_names(model, ref)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    # relative to the parameter's largest gradient, floored at 1e-10 of the model's: a gradient that is 0 in exact
    # arithmetic (the key bias of a kind without RoPE: softmax ignores a score shift shared by all keys) is fp64
    # rounding, ~1e-20, on both sides (before: 0.8 "relative" error for a correct ALiBi kind)
    floor = 1e-10 * max(float(g.abs().max()) for g in grads.values())
    grad_rel, n = 0.0, 0
    for name, grad in grads.items():
        g = ref_params[names[name]].grad
        grad_rel = max(grad_rel, ((grad - g).abs().max() / grad.abs().max().clamp_min(floor)).item())
        n += 1
    return {"logit_diff": (a - b)[keep].abs().max().item(), "grad_rel": grad_rel, "params": n}


def run_case(case: str, tp: int, sp: bool) -> dict:
    from megatron.core import parallel_state, tensor_parallel

    cfg, model, tokens, labels, padding = setup(case, tp, sp)
    hidden = model.hidden_states(tokens, padding_mask=None if model.decoder_only else padding)
    logits = model.logits(hidden)  # [s, b, V/tp]
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())
    loss = loss.mean()
    loss.backward()
    sq = torch.zeros((), dtype=torch.float64)
    sq_attn = torch.zeros((), dtype=torch.float64)
    sq_resid = torch.zeros((), dtype=torch.float64)
    sq_vemb = torch.zeros((), dtype=torch.float64)
    group = parallel_state.get_tensor_model_parallel_group()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        s = p.grad.double().pow(2).sum()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            dist.all_reduce(s, group=group)
        sq = sq + s
        if ".self_attention." in name:
            sq_attn = sq_attn + s
        if name.startswith("decoder.residual."):  # the mixing's scalars: replicated, summed over TP under SP
            sq_resid = sq_resid + s
        if name.startswith("value_embeds."):  # the value tables and gains: replicated, summed over TP
            sq_vemb = sq_vemb + s
    return {
        "loss": loss.item(),
        "grad_sq": sq.item(),
        "attn_grad_sq": sq_attn.item(),
        "resid_grad_sq": sq_resid.item(),
        "vemb_grad_sq": sq_vemb.item(),
    }


def main():
    out_path, cases = sys.argv[1], sys.argv[2].split(",")
    results = {case: {} for case in cases}
    for tp in (1, 2):  # one model-parallel set-up per TP size (creating groups is the slow part)
        process_groups.init_distributed(tp)
        for case in cases:
            for sp in (False,) if tp == 1 else (False, True):
                results[case][f"tp{tp}{'sp' if sp else ''}"] = run_case(case, tp, sp)
            if tp == 1:
                results[case]["reference"] = reference_case(case)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    process_groups.teardown()


if __name__ == "__main__":
    main()
