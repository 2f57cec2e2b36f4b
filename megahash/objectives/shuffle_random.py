"""Shuffle+Random (S+R, [Xue25] sec. 2.3.6; [Yamaguchi21]): a 3-way token classification.

Of the ordinary (non-special) tokens, each is selected for shuffling with p = 10%; within each
sequence the selected tokens are permuted among themselves (a random cyclic order, so every selected
position receives the token of another selected position; a sequence with a single selected token
leaves it unselected); hash codes move with their tokens. Each remaining ordinary token is then
replaced with p = 10% ("~10% of the rest") by a random input, ``random=`` (``train.sr_random``):

- ``codes`` (default of ``train.sr_random``): as the authors' collators (HUIYINXUE/hashformer,
  ``src/model/data_collator.py``) for the input the embedding reads, never equal to the original:
  ``bits-density`` (Proj, Add: ``random_bitarrays``: a density p ~ U(0, 1) per token, then each of
  the T bits ~ Bernoulli(p)); ``bits-uniform`` (Pool: ``random_indarrays``, a uniform codeword id
  per k-bit chunk = uniform random bits; also hash-emb over packed MD5 bits); ``bucket`` (hash-emb
  over bucket ids: a uniform bucket of N); ``token`` (vocabulary ids, e.g. ``vocab``/``bert-hash``:
  a uniform ordinary id < V, the reference's ``torch.randint(len(tokenizer))``). The token id of a
  code-replaced position stays (the collators keep ``input_ids``; only specials are read from it).
  :func:`random_options` picks the mode from the config (``rolling``: ``batch``).
- ``batch`` (``corrupt``'s default): a word drawn from the batch's own ordinary tokens, with its codes.

Labels: 0 original, 1 shuffled, 2 random, -100 special (untouched, no loss).
The expected fractions of ordinary tokens are therefore ~10% shuffled and 9% (= 10% of the other
90%) random, as in the reference collator (HUIYINXUE/hashformer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megahash.objective_spec import ObjectiveSpec, register_objective
from megahash.objectives.common import NUM_SPECIAL, bernoulli, pad_of, replace_with_drawn, special_mask

SHUFFLE_PROB = 0.1
RANDOM_PROB = 0.1
ORIGINAL, SHUFFLED, RANDOM, IGNORE = 0, 1, 2, -100

if TYPE_CHECKING:
    import torch


def _groups(tokens: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
    """[b, s] shuffle group of each position: its row, or (row, document) with packed documents."""
    import torch

    b, s = tokens.shape
    rows = torch.arange(b, device=tokens.device)[:, None].expand(b, s)
    return rows if document_ids is None else rows * s + document_ids


def _cyclic_shuffle_sources(
    selected: torch.Tensor, generator: torch.Generator, groups: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the selected positions (row-major flat indices ``dst``) the flat index ``src`` of the
    token each receives: a random cyclic permutation within each row (each group of ``groups``)."""
    import torch

    b, s = selected.shape
    dst = selected.reshape(-1).nonzero(as_tuple=True)[0]
    if dst.numel() == 0:
        return dst, dst
    rows = dst // s if groups is None else groups.reshape(-1)[dst]
    b = b if groups is None else b * s
    keys = rows.double() + torch.rand(dst.numel(), generator=generator, dtype=torch.float64).to(dst.device)
    order = dst[torch.argsort(keys)]  # grouped by row, random order inside each row
    counts = torch.bincount(rows, minlength=b)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(order.numel(), device=dst.device)
    row_of = rows[torch.argsort(keys)]
    nxt = starts[row_of] + (pos - starts[row_of] + 1) % counts[row_of]  # next in the row's cycle
    return order, order[nxt]


def random_options(cfg, vocab_size: int | None = None) -> dict:
    """``corrupt`` keyword arguments of a config's random replacements (see the module docstring)."""
    from megahash.hashing.specs import parse_hash_spec

    if cfg.train.sr_random == "batch":
        return {"random": "batch"}
    from megahash import catalog

    how = catalog.caps("embedding", cfg.model.embedding).sr_random  # the embedding kind's own file says
    if how == "token":
        return {"random": "token", "vocab_size": vocab_size} if vocab_size else {"random": "batch"}
    if how not in ("bits-density", "bits-uniform"):
        return {"random": "batch"}
    spec = parse_hash_spec(cfg.model.embed.hash_spec)
    if spec.kind in ("md5-bucket", "lsh-bucket"):
        return {"random": "bucket", "num_buckets": int(spec.params["buckets"])}
    if not spec.is_bits:
        return {"random": "batch"}
    return {"random": how, "num_bits": spec.num_bits}


def _pack_bits(bits: torch.Tensor, width: int) -> torch.Tensor:
    """[n, T] 0/1 -> [n, width] uint8, most significant bit first (zero padding bits)."""
    import torch

    n, t = bits.shape
    full = torch.zeros(n, width * 8, dtype=torch.uint8)
    full[:, :t] = bits.to(torch.uint8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32)
    return (full.view(n, width, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def random_bits(original: torch.Tensor, num_bits: int, density: bool, generator: torch.Generator) -> torch.Tensor:
    """Packed random codes [n, width] for the packed ``original`` codes, none equal to its original:
    density=True: p ~ U(0, 1) per row, bits ~ Bernoulli(p) (the collators' ``random_bitarrays``);
    False: uniform bits (uniform codeword ids of every chunk, ``random_indarrays``)."""
    import torch

    n, width = original.shape
    out = torch.empty_like(original, device="cpu")
    todo = torch.arange(n)
    orig = original.cpu()
    while todo.numel():
        m = todo.numel()
        p = (
            torch.rand(m, 1, generator=generator, dtype=torch.float64)
            if density
            else torch.full((m, 1), 0.5, dtype=torch.float64)
        )
        bits = torch.rand(m, num_bits, generator=generator, dtype=torch.float64) < p
        packed = _pack_bits(bits, width).to(out.dtype)
        out[todo] = packed
        todo = todo[(packed == orig[todo]).all(-1)]  # redraw the rows equal to their original
    return out.to(original.device)


def random_ids(original: torch.Tensor, low: int, high: int, generator: torch.Generator) -> torch.Tensor:
    """Uniform ids in [low, high) other than ``original`` (draw from high - low - 1 values, skip it)."""
    import torch

    if high - low < 2:
        raise ValueError(f"cannot draw an id different from the original among {high - low} values")
    draw = torch.randint(low, high - 1, original.shape, generator=generator).to(original.device)
    inside = (original >= low) & (original < high)
    return draw + (inside & (draw >= original)).to(draw.dtype)


def random_word_ids(
    original: torch.Tensor, vocab_size: int, special_ids: dict | None, generator: torch.Generator
) -> torch.Tensor:
    """Uniform ordinary ids (never a special id of the tokenizer, never ``original``): the word ids
    5.. without ``special_ids``; otherwise draws over [0, vocab) with the special ids redrawn."""
    import torch

    if not special_ids:
        return random_ids(original, NUM_SPECIAL, vocab_size, generator)
    specials = torch.tensor(sorted({int(i) for i in special_ids.values() if i is not None}), dtype=original.dtype)
    out = random_ids(original, 0, vocab_size, generator)
    for _ in range(100):  # each redraw hits a special with probability |specials| / vocab
        bad = torch.isin(out, specials.to(out.device))
        if not bad.any():
            return out
        out[bad] = random_ids(original[bad], 0, vocab_size, generator)
    raise ValueError(f"cannot draw ordinary ids from a vocabulary of {vocab_size} with {len(specials)} special ids")


def replace_random(
    new_tokens,
    new_codes,
    where,
    random: str,
    generator,
    vocab_size=None,
    num_buckets=None,
    num_bits=None,
    special_ids: dict | None = None,
) -> None:
    """In place: the positions ``where`` get the random inputs of mode ``random`` (not ``batch``)."""
    if not where.any():
        return
    if random == "token":
        new_tokens[where] = random_word_ids(new_tokens[where], int(vocab_size), special_ids, generator)
        return
    if new_codes is None:
        raise ValueError(f"S+R random={random!r} needs hash codes in the batch")
    if random == "bucket":
        flat = new_codes[where]  # [m, 1]
        new_codes[where] = random_ids(flat.long(), 0, int(num_buckets), generator).to(flat.dtype)
    elif random in ("bits-density", "bits-uniform"):
        new_codes[where] = random_bits(
            new_codes[where], int(num_bits or new_codes.shape[-1] * 8), random == "bits-density", generator
        )
    else:
        raise ValueError(
            f"unknown S+R random mode {random!r} (codes modes: token, bucket, bits-density, bits-uniform; or batch)"
        )


def corrupt(
    tokens: torch.Tensor,
    hash_codes: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    special_ids: dict | None = None,
    shuffle_prob: float = SHUFFLE_PROB,
    random_prob: float = RANDOM_PROB,
    random: str = "batch",
    vocab_size: int | None = None,
    num_buckets: int | None = None,
    num_bits: int | None = None,
    document_ids: torch.Tensor | None = None,
) -> dict:
    """tokens [b, s], hash_codes [b, s, w] or None -> dict(tokens, hash_codes, labels, loss_mask,
    padding_mask); deterministic given the generator's state. ``random`` and its sizes: see the
    module docstring (:func:`random_options` derives them from a config). With ``document_ids``
    (``data.reset_attention_mask``) tokens are shuffled within their document only."""
    import torch

    if generator is None:
        generator = torch.Generator().manual_seed(0)
    dev = tokens.device
    special = special_mask(tokens, special_ids)
    word = ~special
    shuffled = bernoulli(tokens.shape, shuffle_prob, generator, dev) & word
    groups = _groups(tokens, document_ids)
    counts = torch.zeros(groups.numel(), dtype=torch.long, device=dev).index_add_(
        0, groups.reshape(-1), shuffled.reshape(-1).long()
    )
    single = counts[groups] < 2  # nothing to swap with in its row (document)
    shuffled = shuffled & ~single
    mode = random
    random = bernoulli(tokens.shape, random_prob, generator, dev) & word & ~shuffled

    new_tokens = tokens.clone()
    new_codes = None if hash_codes is None else hash_codes.clone()
    dst, src = _cyclic_shuffle_sources(shuffled, generator, None if document_ids is None else groups)
    flat_tok = new_tokens.view(-1)
    flat_tok[dst] = tokens.reshape(-1)[src]
    if new_codes is not None:
        w = hash_codes.shape[-1]
        new_codes.view(-1, w)[dst] = hash_codes.reshape(-1, w)[src]
    if mode == "batch":
        replace_with_drawn(new_tokens, new_codes, tokens, hash_codes, word, random, generator)
    else:
        replace_random(new_tokens, new_codes, random, mode, generator, vocab_size, num_buckets, num_bits, special_ids)
    labels = torch.full_like(tokens, ORIGINAL, dtype=torch.long)
    labels[shuffled] = SHUFFLED
    labels[random] = RANDOM
    labels[special] = IGNORE
    return {
        "tokens": new_tokens,
        "hash_codes": new_codes,
        "labels": labels,
        "loss_mask": word.float(),
        "padding_mask": tokens != pad_of(special_ids),
    }


# a 3-class loss of its own head (not a vocabulary loss), on the S+R head registered in models/heads
register_objective(
    ObjectiveSpec(
        "sr", token_loss=False, corrupt=corrupt, options=random_options, head="shuffle-random", arch="encoder"
    )
)
