"""Shared machinery of the hash embeddings ([Xue25] ch. 2; [Cohn23], [NeuML25]).

Every hash embedding maps the batch's precomputed word codes (``hash_codes`` [b, s, width], see
:mod:`megahash.hashing.specs`) to [s, b, h] and gives the five special tokens (ids 0-4: ``<s> <pad>
</s> <unk> <mask>``, recognised by ``tokens < 5``) rows of their own small table ``special``
(5 x h, reported separately by :func:`megahash.models.embeddings.embedding_param_report`).

Layout and parallelism. Inputs are transposed to [s, b] *before* any h-wide tensor exists, so the
output is produced directly in megatron's [s, b, h] order (no [b, s, h] -> [s, b, h] copy). All
parameters are replicated over tensor-parallel ranks (they are tiny), except the N x h table of
``hash-emb``, which is split by rows like megatron's ``VocabParallelEmbedding``:

* no sequence parallelism: every TP rank embeds the whole sequence; the gradient reaching the
  embedding output is the full, identical gradient on every rank (the first ColumnParallelLinear
  all-reduces it in backward), so replicated parameters get identical, correct gradients;
* sequence parallelism: each TP rank embeds only its own s/TP slice of the sequence (the slice
  ``scatter_to_sequence_parallel_region`` would keep), so replicated parameters see a partial
  gradient; they are tagged ``sequence_parallel=True`` and their gradients are summed over the TP
  group by :func:`megahash.models.norm.mark_sequence_parallel` (a hook in backward, as for the
  norms). Every parameter takes part in every forward (no data-dependent branches), so the hooks'
  all-reduces run on all ranks.

Specials: the word part of a special token is exactly zero (its bits / weights are masked), and
its row ``special[token]`` is written in place at the (few) special positions, which costs far
less than a ``torch.where`` over the whole [s, b, h] output.

The extra "word" row of Table 2.2. The [Xue25] embedding counts (99.1K Proj, 197.4K Add,
797.2K Pool) are each one h-wide row above eq. 2.13-2.15 (98,304 / 196,608 / 796,416 for
d = 768, T = 128, k = 10). Sec. 2.8 counts "parameters which are used for retrieving or generating
the embeddings of any tokens (excluding those special tokens e.g. <PAD>)"; in the authors' code
(HUIYINXUE/hashformer, ``RobertaProjEmbeddingsPCC`` & co.) the special-token table has 6 rows:
ids 0-4 for the specials and row 5, which every ordinary word looks up and adds to its hashed
embedding. The five special rows are excluded and that shared word row is counted: 129 x 768 =
99,072 (99.1K), 257 x 768 = 197,376 (197.4K), (13 + 1024 + 1) x 768 = 797,184 (797.2K). Pool,
Add and Proj therefore carry ``word_row`` (1 x h, added to every non-special token, initialised
to zero), counted under "embedding".
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule

from megahash.errors import ConfigError
from megahash.models.norm import mark_sequence_parallel

NUM_SPECIAL = 5  # <s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4 (megahash.hashing.words)


def parse_spec(cfg, embedding: str):
    """The :class:`megahash.hashing.specs.HashSpec` of ``model.embed.hash_spec`` (ConfigError if bad)."""
    from megahash.hashing.specs import parse_hash_spec

    try:
        return parse_hash_spec(cfg.model.embed.hash_spec)
    except ValueError as e:
        raise ConfigError(f"model.embed.hash_spec: {e}") from None


def bucket_count(cfg, who: str) -> tuple[int, str]:
    """(N, how) of bucketed word codes (hash-emb rows, hash-bucket head classes): how = "ids" (bucket-id
    codes) or "md5" (packed MD5 bits, N from ``model.embed.num_buckets``); ``who`` names the user in errors."""
    spec = parse_spec(cfg, who)
    n_cfg = int(cfg.model.embed.num_buckets)
    if spec.kind in ("md5-bucket", "lsh-bucket"):
        n = int(spec.params["buckets"])
        if n_cfg and n_cfg != n:
            raise ConfigError(
                f"model.embed.num_buckets={n_cfg} disagrees with model.embed.hash_spec={spec.name} (N={n}); "
                f"set num_buckets=0 or {n}"
            )
        return n, "ids"
    if spec.kind == "md5":
        if n_cfg <= 0:
            raise ConfigError(
                f"{who} with model.embed.hash_spec=md5 needs model.embed.num_buckets=N "
                "(or use hash_spec md5-bucketN / lsh-bucketN)"
            )
        return n_cfg, "md5"
    raise ConfigError(
        f"{who} needs bucket codes: model.embed.hash_spec md5-bucketN, lsh-bucketN "
        f"or md5 with model.embed.num_buckets; got {spec.name!r}"
    )


def bit_spec(cfg, embedding: str) -> int:
    """T of a packed-bit spec (md5 / lshT) for pool/add/proj; checks ``model.embed.num_bits``."""
    spec = parse_spec(cfg, embedding)
    if not spec.is_bits:
        raise ConfigError(
            f"model.embedding={embedding} needs bit codes (model.embed.hash_spec md5 or lshT), got {spec.name!r}"
        )
    t = spec.num_bits
    if cfg.model.embed.num_bits != t:
        raise ConfigError(
            f"model.embed.num_bits={cfg.model.embed.num_bits} but model.embed.hash_spec={spec.name} "
            f"gives {t} bits; set model.embed.num_bits={t}"
        )
    return t


def unpack_bits(codes: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """uint8 [..., T/8] packed MSB first (``np.packbits`` order) -> uint8 [..., T] of 0/1."""
    if codes.dtype != torch.uint8:
        codes = codes.to(torch.uint8)
    bits = (codes.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*codes.shape[:-1], codes.shape[-1] * 8)


def bit_shifts() -> torch.Tensor:
    return torch.arange(7, -1, -1, dtype=torch.uint8)


def check_codes(codes, width: int, name: str) -> None:
    if codes is None:
        raise ValueError(
            f"model.embedding={name} reads precomputed word codes: the batch needs 'hash_codes' "
            f"(build the side shard with data_tools/preprocess_data.py --word-hashes ...)"
        )
    if codes.shape[-1] != width:
        raise ValueError(
            f"model.embedding={name}: hash_codes width {codes.shape[-1]} != {width} expected from "
            f"model.embed.hash_spec; the side shard and the config disagree"
        )


def special_id_tensor(cfg) -> torch.Tensor:
    """Long [5]: the tokenizer's id of each role of ``special`` (``data.special_ids``; -1 absent)."""
    from megahash.tokenization import ROLES, special_ids_of

    ids = special_ids_of(getattr(getattr(cfg, "data", None), "special_ids", None))
    return torch.tensor([-1 if ids.get(r) is None else int(ids[r]) for r in ROLES], dtype=torch.long)


class EmbeddingOutput(MegatronModule):
    """Shared tail of every embedding: [b, s, h] -> [s, b, h], SP scatter, dropout."""

    def finish(self, emb: torch.Tensor) -> torch.Tensor:
        emb = emb.transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(
                emb, group=parallel_state.get_tensor_model_parallel_group()
            )
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.dropout(emb)
        return self.dropout(emb)


class HashEmbeddingBase(EmbeddingOutput):
    """Base of every hash embedding: special table, SP slicing, in-place specials, dropout.

    Subclasses implement ``embed_words(tok [s', b], codes [s', b, w] or None, word [s', b] bool)
    -> [s', b, h] or [s' * b, h]``, which must be exactly zero where ``word`` is False *and* must
    not depend on the parameters there (masked inputs / zero bag weights), and call
    ``self._finish_init()`` at the end of ``__init__``. Return a fresh tensor, not a view (e.g. the
    2-D result of ``embedding_bag``/``mm`` before any reshape): the special rows are then written
    in place at no extra pass over the output.
    """

    tieable = False
    #: embed only this rank's sequence slice under SP (False: ``embed_words`` sees the whole
    #: sequence and returns this rank's slice itself, e.g. by a reduce-scatter; the special rows
    #: are still written on the local slice only)
    sequence_local = True

    def __init__(self, config, cfg):
        super().__init__(config=config)
        self.cfg = cfg
        self.hidden_size = config.hidden_size
        self.special = torch.nn.Parameter(torch.empty(NUM_SPECIAL, config.hidden_size, dtype=config.params_dtype))
        self._init(self.special)
        # row r of ``special`` belongs to role r of megahash.tokenization.ROLES (bos pad eos unk mask):
        # the tokenizer's id of that role (data.special_ids; the word ids 0-4 by default), -1 if absent
        self.register_buffer("special_ids", special_id_tensor(cfg), persistent=False)
        self.dropout = torch.nn.Dropout(config.hidden_dropout)

    # ------------------------------------------------------------------ helpers for subclasses
    def _init(self, tensor: torch.Tensor, std: float | None = None) -> None:
        if not self.config.perform_initialization or tensor.is_meta:
            return
        with torch.no_grad():
            if std is None:
                self.config.init_method(tensor)
            elif std == 0:
                tensor.zero_()
            else:
                tensor.normal_(0.0, std)

    def _finish_init(self) -> None:
        """Tag the replicated parameters for SP gradient summation (see the module docstring)."""
        replicated = [p for p in self.parameters() if not getattr(p, "tensor_model_parallel", False)]
        mark_sequence_parallel(replicated, self.config.sequence_parallel)

    def _local(self, x):
        """This rank's slice of dim 0 (the sequence) under SP; identity otherwise."""
        if x is None or not self.config.sequence_parallel:
            return x
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp == 1:
            return x
        n = x.shape[0] // tp
        r = parallel_state.get_tensor_model_parallel_rank()
        return x[r * n : (r + 1) * n]

    def _special_rows(self, tok: torch.Tensor) -> torch.Tensor:
        """Row of ``special`` of each token (its role), -1 for ordinary tokens."""
        ids = self.special_ids
        if ids.device != tok.device:
            ids = ids.to(tok.device)
        if bool((ids == torch.arange(NUM_SPECIAL, device=ids.device)).all()):  # the word ids 0-4
            return torch.where(tok < NUM_SPECIAL, tok, torch.full_like(tok, -1))
        rows = torch.full_like(tok, -1)
        for r in range(NUM_SPECIAL - 1, -1, -1):  # a token holding several roles takes the first role's row
            if int(ids[r]) >= 0:
                rows = torch.where(tok == ids[r], torch.full_like(tok, r), rows)
        return rows

    def _put_specials(self, emb: torch.Tensor, tok: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
        """Write ``special[tok]`` at the special positions of ``emb`` ([s', b, h] or [s' * b, h]) in
        place (``tok``: the special rows of :meth:`_special_rows`)."""
        pos = (~word).reshape(-1).nonzero(as_tuple=True)[0]
        if emb._is_view():  # in-place on a view would make autograd clone the whole gradient
            emb = emb.clone()
        return _PutSpecials.apply(emb, self.special, pos, tok.reshape(-1)[pos])

    def _dropout(self, emb: torch.Tensor) -> torch.Tensor:
        if self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.dropout(emb)
        return self.dropout(emb)

    @property
    def out_dtype(self) -> torch.dtype:
        return self.special.dtype

    # ------------------------------------------------------------------ forward / accounting
    def forward(self, tokens: torch.Tensor, hash_codes: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s], hash_codes [b, s, w] -> [s(/TP under SP), b, h]."""
        tok = tokens.t()
        codes = hash_codes.transpose(0, 1) if hash_codes is not None else None
        if self.sequence_local:
            tok, codes = self._local(tok), self._local(codes)
        rows = self._special_rows(tok)
        word = rows < 0
        emb = self.embed_words(tok, codes, word)
        if self.sequence_local or not self.config.sequence_parallel:
            local_rows, local_word = rows, word
        else:
            local_rows = self._local(rows)
            local_word = local_rows < 0
        emb = self._put_specials(emb, local_rows, local_word)
        return self._dropout(emb.view(*local_rows.shape, self.hidden_size))

    def padding_rows(self) -> int:
        """Rows allocated only to make a TP-split table divisible (not counted)."""
        return 0

    def param_report(self) -> dict:
        """Global (all TP ranks) parameter counts: {"embedding": n, "special": n}."""
        tp = (
            parallel_state.get_tensor_model_parallel_world_size()
            if parallel_state.model_parallel_is_initialized()
            else 1
        )
        total = 0
        for name, p in self.named_parameters():
            if name == "special":
                continue
            total += p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
        return {"embedding": total - self.padding_rows() * self.hidden_size, "special": self.special.numel()}


class _PutSpecials(torch.autograd.Function):
    """emb[pos] = special[tok_at_pos] in place. Backward: the output gradient flows to ``emb`` as it
    is (no clone: the word part of a special position is exactly zero and independent of the
    parameters, so the gradient it receives there is multiplied by zero upstream), and
    ``special`` gets the gradient rows of its positions (index_add over the few specials)."""

    @staticmethod
    def forward(ctx, emb, special, pos, tok_at_pos):
        flat = emb.view(-1, emb.shape[-1])
        flat.index_copy_(0, pos, special.index_select(0, tok_at_pos).to(emb.dtype))
        ctx.mark_dirty(emb)
        ctx.save_for_backward(pos, tok_at_pos)
        ctx.special_shape, ctx.special_dtype = special.shape, special.dtype
        return emb

    @staticmethod
    def backward(ctx, grad):
        pos, tok_at_pos = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1]).index_select(0, pos)
        grad_special = torch.zeros(ctx.special_shape, dtype=ctx.special_dtype, device=grad.device)
        grad_special.index_add_(0, tok_at_pos, rows.to(ctx.special_dtype))
        return grad, grad_special, None, None


def rsqrt_or_zero(x: torch.Tensor) -> torch.Tensor:
    """1/sqrt(x) where x > 0, else 0 (a constant bit vector has no Pearson correlation)."""
    return torch.where(x > 0, torch.rsqrt(x.clamp_min(1e-30)), torch.zeros_like(x))


def md5_mod(codes: torch.Tensor, n: int) -> torch.Tensor:
    """Packed bytes [..., 16] (big-endian 128-bit value) -> value % n, int64 (Emb(N) of sec. 2.3.2)."""
    c = codes.long()
    r = torch.zeros(codes.shape[:-1], dtype=torch.long, device=codes.device)
    for j in range(codes.shape[-1]):
        r = (r * 256 + c[..., j]) % n
    return r
