"""Output heads of MegahashLM, chosen by ``train.objective`` and ``model.head``.

=============  ===============  ==========================================================================
objective      model.head       head
=============  ===============  ==========================================================================
clm / mlm      ``vocab``        :class:`VocabHead`: the model's vocab-parallel ``output_layer`` (tied or
                                not) + megatron's vocab-parallel cross-entropy; positions labelled -100
                                (MLM: unmasked tokens) cost 0. For clm this is exactly the LM head.
clm / mlm      ``hash-bits``    :class:`HashBitsHead`: Linear(h -> T) predicting the target word's T hash
                                bits (md5 / lshT codes), loss = sum over bits of the binary
                                cross-entropy = -log p(code) under independent Bernoulli bits.
clm / mlm      ``hash-bucket``  :class:`HashBucketHead`: vocab-parallel Linear(h -> N) over the word's
                                bucket (md5-bucketN / lsh-bucketN codes, or md5 % num_buckets), softmax
                                cross-entropy.
sr             (``vocab``)      :class:`ShuffleRandomHead`: Linear(h -> 3), cross-entropy over
                                original / shuffled / random (thesis sec. 2.3.6); labels -100 cost 0.
=============  ===============  ==========================================================================

The hash heads make a decoder (or encoder) vocabulary-free at the output too: the target of
position t is ``label_codes[t]`` (the dataset's next-word codes for clm, the original codes of the
masked words for mlm); if the batch has no ``label_codes`` a clm head shifts ``hash_codes`` by one
and the last position costs 0. :func:`score_continuation` turns either head into the
log-likelihood lm-eval needs to rank answers.

Every head's ``forward(model, hidden [s(/TP), b, h], labels [b, s] or None, label_codes=None,
hash_codes=None)`` returns the per-token loss [b, s] (= -log-likelihood of the target, 0 where
``labels < 0``) when labels are given, else its logits [b, s, ...] (vocab-parallel for
vocab/hash-bucket). Replicated heads (S+R, hash-bits) see the whole sequence on every TP rank
(under SP the hidden states are all-gathered with a split, not a reduce-scatter, in backward), so
their parameters get identical gradients on all TP ranks.
"""
from __future__ import annotations

# ---- plain-torch reference (@register_reference; copied into the HF export): torch-only imports above its code
import torch
import torch.nn as nn

from megahash.models.registry import register_reference


@register_reference("head:hash-bits")
class HashBitsReference(nn.Module):
    """Linear(h -> T): logits of the target word's T hash bits."""

    reads_codes = True

    def __init__(self, config):
        super().__init__()
        self.linear = nn.Linear(config.hidden_size, int(config.code_width) * 8)

    def forward(self, hidden):
        return self.linear(hidden)


@register_reference("head:hash-bucket")
class HashBucketReference(nn.Module):
    """Linear(h -> N) over the word's bucket (TP padding columns scored -1e4)."""

    reads_codes = True

    def __init__(self, config):
        super().__init__()
        self.num_buckets = int(config.num_buckets)
        self.padded = int(config.embed.get("head_padded_rows") or self.num_buckets)
        self.linear = nn.Linear(config.hidden_size, self.padded, bias=False)

    def forward(self, hidden):
        logits = self.linear(hidden)
        if self.padded != self.num_buckets:
            col = torch.arange(self.padded, device=logits.device)
            logits = logits.masked_fill(col >= self.num_buckets, -1e4)
        return logits


@register_reference("objective:sr")
class ShuffleRandomReference(nn.Module):
    """Linear(h -> 3): original / shuffled / random (thesis sec. 2.3.6); cross-entropy over 3 classes."""

    token_classes = 3

    def __init__(self, config):
        super().__init__()
        self.linear = nn.Linear(config.hidden_size, 3)

    def forward(self, hidden):
        return self.linear(hidden)


# ---- megatron-core implementation
import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel

from megahash.errors import ConfigError

HEADS = ("vocab", "hash-bits", "hash-bucket")
WORD_TOKEN = 5  # any id >= 5 is an ordinary word to the hash embeddings (ids 0-4 are specials)


def build_head(cfg, config, vocab_size: int) -> torch.nn.Module:
    """The head of ``train.objective`` x ``model.head`` (table in the module docstring)."""
    head, objective = cfg.model.head, cfg.train.objective
    if head not in HEADS:
        raise ConfigError(f"model.head must be one of {', '.join(HEADS)}, got {head!r}")
    if objective == "sr":
        if head != "vocab":
            raise ConfigError(
                f"train.objective=sr trains the 3-way Shuffle+Random head; model.head={head} applies to "
                f"clm/mlm only (leave model.head=vocab)"
            )
        return ShuffleRandomHead(config)
    if head == "vocab":
        return VocabHead()
    if head == "hash-bits":
        return HashBitsHead(config, cfg)
    return HashBucketHead(config, cfg)


def _full_sequence(hidden: torch.Tensor, config) -> torch.Tensor:
    """[s/TP, b, h] -> [s, b, h] under SP for a replicated head (backward: split, not reduce-scatter)."""
    if config.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
        return tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=parallel_state.get_tensor_model_parallel_group())
    return hidden


def _shifted_codes(hash_codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """clm targets from the inputs' codes: codes[t + 1] for t < s - 1; the last position is invalid."""
    target = torch.zeros_like(hash_codes)
    target[:, :-1] = hash_codes[:, 1:]
    valid = torch.ones(hash_codes.shape[:2], dtype=torch.bool, device=hash_codes.device)
    valid[:, -1] = False
    return target, valid


def _target_codes(head: str, labels, label_codes, hash_codes) -> tuple[torch.Tensor, torch.Tensor]:
    """(target codes [b, s, w], valid [b, s]) of a hash-code head: the batch's ``label_codes``, or the
    next position's input codes (clm) when it has none."""
    valid = labels >= 0
    if label_codes is None:
        if hash_codes is None:
            raise ValueError(f"model.head={head} needs label_codes (or hash_codes to shift) in the batch")
        label_codes, shift_valid = _shifted_codes(hash_codes)
        valid = valid & shift_valid
    return label_codes, valid


class _OneRankCrossEntropy(torch.autograd.Function):
    """megatron-core's vocab-parallel cross-entropy at TP=1, step for step (its own
    ``VocabParallelCrossEntropy`` helpers: max, shift, exp, sum, log - target logit; gradient
    softmax - one-hot), without the three all-reduces over a one-rank TP group (each a wait on the
    gloo worker thread). Same values and gradients as ``tensor_parallel.vocab_parallel_cross_entropy``."""

    @staticmethod
    def forward(ctx, logits, target):
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as V

        logits, logits_max = V.calculate_logits_max(logits)
        target_mask, masked_target_1d, predicted, sum_exp, exp_logits = V.calculate_predicted_logits(
            logits, target, logits_max, 0, logits.size(-1))
        softmax, loss = V.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as V

        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, update, grad_input = V.prepare_gradient_calculation_operands(softmax, target_mask)
        return V.calculate_gradients(grad_2d, arange_1d, masked_target_1d, update, grad_input, grad_output), None


def vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy of vocab-parallel logits [s, b, V/TP] against target ids [s, b]."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return _OneRankCrossEntropy.apply(logits, target)
    return tensor_parallel.vocab_parallel_cross_entropy(logits, target)


class VocabHead(torch.nn.Module):
    """LM / MLM head: ``model.logits`` (vocab-parallel ``output_layer``) + vocab-parallel CE."""

    uses_output_layer = True

    def forward(self, model, hidden, labels=None, label_codes=None, hash_codes=None):
        logits = model.logits(hidden)  # [s, b, V/TP]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        lab = labels.transpose(0, 1).contiguous()
        ignore = lab < 0
        loss = vocab_cross_entropy(logits.float(), lab.clamp(min=0))
        return loss.masked_fill(ignore, 0.0).transpose(0, 1).contiguous()  # [b, s]


class ShuffleRandomHead(torch.nn.Module):
    """Shuffle+Random (thesis sec. 2.3.6, Yamaguchi et al. 2021): Linear(h, 3) + CE; labels
    0 original, 1 shuffled, 2 random, -100 ignored (specials)."""

    uses_output_layer = False

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.linear = torch.nn.Linear(config.hidden_size, 3, dtype=config.params_dtype)
        if config.perform_initialization and not self.linear.weight.is_meta:
            with torch.no_grad():
                config.init_method(self.linear.weight)
                self.linear.bias.zero_()

    def forward(self, model, hidden, labels=None, label_codes=None, hash_codes=None):
        logits = self.linear(_full_sequence(hidden, self.config)).transpose(0, 1)  # [b, s, 3]
        if labels is None:
            return logits.contiguous()
        loss = F.cross_entropy(logits.float().reshape(-1, 3), labels.reshape(-1).long(), ignore_index=-100, reduction="none")
        return loss.view(labels.shape)


class HashBitsHead(torch.nn.Module):
    """Predict the target word's T hash bits: logits Linear(h -> T), loss sum_bits BCE
    (= -sum_bits log sigmoid(+-logit) = -log p(code))."""

    uses_output_layer = False

    def __init__(self, config, cfg):
        super().__init__()
        from megahash.models.embeddings.base import bit_shifts, parse_spec

        spec = parse_spec(cfg, "hash-bits head")
        if not spec.is_bits:
            raise ConfigError(
                f"model.head=hash-bits needs bit codes (model.embed.hash_spec md5 or lshT), got {spec.name!r}; "
                f"use model.head=hash-bucket for bucket codes"
            )
        self.config = config
        self.num_bits = spec.num_bits
        self.linear = torch.nn.Linear(config.hidden_size, self.num_bits, dtype=config.params_dtype)
        if config.perform_initialization and not self.linear.weight.is_meta:
            with torch.no_grad():
                config.init_method(self.linear.weight)
                self.linear.bias.zero_()
        self.register_buffer("shifts", bit_shifts(), persistent=False)

    def targets(self, codes: torch.Tensor) -> torch.Tensor:
        from megahash.models.embeddings.base import unpack_bits

        return unpack_bits(codes, self.shifts).float()

    def forward(self, model, hidden, labels=None, label_codes=None, hash_codes=None):
        logits = self.linear(_full_sequence(hidden, self.config)).transpose(0, 1)  # [b, s, T]
        if labels is None:
            return logits.contiguous()
        label_codes, valid = _target_codes("hash-bits", labels, label_codes, hash_codes)
        target = self.targets(label_codes)
        loss = F.binary_cross_entropy_with_logits(logits.float(), target, reduction="none").sum(dim=-1)
        return loss * valid


class HashBucketHead(torch.nn.Module):
    """Predict the target word's bucket: vocab-parallel Linear(h -> N) + softmax CE
    (N from the bucket spec or model.embed.num_buckets; padding columns to a TP multiple are masked)."""

    uses_output_layer = False

    def __init__(self, config, cfg):
        super().__init__()
        from megahash.models.embeddings.hash_emb import num_buckets

        self.config = config
        try:
            self.num_buckets, self.mode = num_buckets(cfg)
        except ConfigError as e:
            raise ConfigError(f"model.head=hash-bucket: {e}") from None
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.padded = -(-self.num_buckets // tp) * tp
        self.linear = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, self.padded, config=config, init_method=config.init_method, bias=False,
            skip_bias_add=False, gather_output=False,
        )

    def bucket_ids(self, codes: torch.Tensor) -> torch.Tensor:
        from megahash.models.embeddings.base import md5_mod

        return md5_mod(codes, self.num_buckets) if self.mode == "md5" else codes[..., 0].long()

    def forward(self, model, hidden, labels=None, label_codes=None, hash_codes=None):
        logits, _ = self.linear(hidden)  # [s, b, padded/TP]
        if self.padded != self.num_buckets:
            per = logits.shape[-1]
            col = torch.arange(per, device=logits.device) + parallel_state.get_tensor_model_parallel_rank() * per
            logits = logits.masked_fill(col >= self.num_buckets, -1e4)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        label_codes, valid = _target_codes("hash-bucket", labels, label_codes, hash_codes)
        target = self.bucket_ids(label_codes).transpose(0, 1).contiguous()
        loss = vocab_cross_entropy(logits.float(), target).transpose(0, 1)
        return loss * valid


@torch.no_grad()
def score_continuation(model, context_codes, continuation_codes, context_tokens=None, continuation_tokens=None):
    """Log-likelihood of a continuation given a context, for ranking answers (lm-eval loglikelihood).

    context_codes [n_ctx, w] / continuation_codes [n_cont, w] (or batched [B, n, w], equal lengths):
    the words' hash codes in the configured ``model.embed.hash_spec``; the optional token ids default
    to an ordinary word (id 5; pass real ids for specials or for the ``vocab`` head). The model reads
    context + continuation[:-1] causally and the head scores each continuation word:

        hash-bits:   sum over words of sum_bits log sigmoid(+-logit)  (+ if the target bit is 1, - if 0)
        hash-bucket: sum over words of log softmax(logits)[bucket]
        vocab:       sum over words of log softmax(logits)[token]

    i.e. ``-sum(per-token loss)`` of the head on the continuation positions. An empty context is
    replaced by ``<s>`` (id 0, zero codes). Returns a float (unbatched) or a tensor [B]. Call with the
    model in eval mode; under TP every rank must call it (the result is the same on all ranks).
    """
    batched = continuation_codes.dim() == 3
    ctx = context_codes if batched else context_codes.unsqueeze(0)
    cont = continuation_codes if batched else continuation_codes.unsqueeze(0)
    bsz, n_cont = cont.shape[0], cont.shape[1]
    if n_cont == 0:
        return torch.zeros(bsz) if batched else 0.0

    def toks(given, codes):
        if given is None:
            return torch.full(codes.shape[:2], WORD_TOKEN, dtype=torch.long, device=codes.device)
        return (given if batched else given.unsqueeze(0)).long()

    ctx_tok, cont_tok = toks(context_tokens, ctx), toks(continuation_tokens, cont)
    if ctx.shape[1] == 0:
        ctx = torch.zeros(bsz, 1, cont.shape[2], dtype=cont.dtype, device=cont.device)
        ctx_tok = torch.zeros(bsz, 1, dtype=torch.long, device=cont.device)
    codes = torch.cat([ctx, cont], dim=1)
    tokens = torch.cat([ctx_tok, cont_tok], dim=1)
    n_ctx = ctx.shape[1]
    inputs, in_tok = codes[:, :-1], tokens[:, :-1]
    targets, tgt_tok = codes[:, 1:], tokens[:, 1:]
    length = inputs.shape[1]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if model.config.sequence_parallel and length % tp:  # causal: right padding changes nothing before it
        pad = tp - length % tp
        inputs = torch.cat([inputs, torch.zeros(bsz, pad, inputs.shape[2], dtype=inputs.dtype, device=inputs.device)], 1)
        targets = torch.cat([targets, torch.zeros_like(inputs[:, -pad:])], 1)
        in_tok = torch.cat([in_tok, torch.ones(bsz, pad, dtype=torch.long, device=in_tok.device)], 1)
        tgt_tok = torch.cat([tgt_tok, torch.ones(bsz, pad, dtype=torch.long, device=in_tok.device)], 1)
    hidden = model.hidden_states(in_tok, inputs)
    loss = model.head(model, hidden, labels=tgt_tok, label_codes=targets, hash_codes=inputs)  # [B, s]
    ll = -loss[:, n_ctx - 1:n_ctx - 1 + n_cont].float().sum(dim=1)
    return ll if batched else float(ll[0])
