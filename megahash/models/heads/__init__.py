"""Output heads of MegahashLM, chosen by ``train.objective`` and ``model.head``; each head is one file
of this package registered with ``@register_head(name, caps=HeadCaps(...))``; this module holds what
they share (cross-entropy, sequence gathering, code targets) and :func:`score_continuation`.

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
                                original / shuffled / random ([Xue25] sec. 2.3.6); labels -100 cost 0.
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

import torch
from megatron.core import parallel_state, tensor_parallel

from megahash.errors import ConfigError

WORD_TOKEN = 5  # any id >= 5 is an ordinary word to the hash embeddings (ids 0-4 are specials)


def build_head(cfg, config, vocab_size: int) -> torch.nn.Module:
    """The head of ``train.objective`` x ``model.head``: the registered head named by ``model.head``
    (megahash.models.registry.spec), unless the objective trains a head of its own (its
    ``ObjectiveSpec.head``, registered with ``HeadCaps(selectable=False)``, e.g. Shuffle+Random), which
    then needs the standard ``model.head``."""
    from megahash import catalog
    from megahash.models import registry
    from megahash.objective_spec import names as objectives
    from megahash.objective_spec import objective_spec

    head, objective = cfg.model.head, objective_spec(cfg.train.objective)
    heads = registry.kinds("head")
    selectable = sorted(n for n, h in heads.items() if h.caps.selectable)
    if head not in selectable:
        raise ConfigError(f"model.head must be one of {', '.join(selectable)}, got {head!r}")
    if objective.head is not None:
        std = catalog.standard("head")
        if head != std:
            plain = "/".join(n for n in objectives() if objective_spec(n).head is None)
            raise ConfigError(
                f"train.objective={objective.name} trains its own head ({objective.head}); model.head={head} applies to "
                f"{plain} only (leave model.head={std})"
            )
    return heads[objective.head_name(head)].build(config, cfg, vocab_size)


def full_sequence(hidden: torch.Tensor, config) -> torch.Tensor:
    """[s/TP, b, h] -> [s, b, h] under SP for a replicated head (backward: split, not reduce-scatter)."""
    if config.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
        return tensor_parallel.gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=False, group=parallel_state.get_tensor_model_parallel_group()
        )
    return hidden


def _shifted_codes(hash_codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """clm targets from the inputs' codes: codes[t + 1] for t < s - 1; the last position is invalid."""
    target = torch.zeros_like(hash_codes)
    target[:, :-1] = hash_codes[:, 1:]
    valid = torch.ones(hash_codes.shape[:2], dtype=torch.bool, device=hash_codes.device)
    valid[:, -1] = False
    return target, valid


def target_codes(head: str, labels, label_codes, hash_codes) -> tuple[torch.Tensor, torch.Tensor]:
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
            logits, target, logits_max, 0, logits.size(-1)
        )
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
        inputs = torch.cat(
            [inputs, torch.zeros(bsz, pad, inputs.shape[2], dtype=inputs.dtype, device=inputs.device)], 1
        )
        targets = torch.cat([targets, torch.zeros_like(inputs[:, -pad:])], 1)
        in_tok = torch.cat([in_tok, torch.ones(bsz, pad, dtype=torch.long, device=in_tok.device)], 1)
        tgt_tok = torch.cat([tgt_tok, torch.ones(bsz, pad, dtype=torch.long, device=in_tok.device)], 1)
    hidden = model.hidden_states(in_tok, inputs)
    loss = model.head(model, hidden, labels=tgt_tok, label_codes=targets, hash_codes=inputs)  # [B, s]
    ll = -loss[:, n_ctx - 1 : n_ctx - 1 + n_cont].float().sum(dim=1)
    return ll if batched else float(ll[0])
