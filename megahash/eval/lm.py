"""The lm-eval-harness model ``megahash``: any megahash checkpoint as an lm-eval ``LM``.

    import megahash.eval.lm  # registers the name
    lm_eval.simple_evaluate(model="megahash", model_args="checkpoint=runs/quickstart,batch_size=8", ...)

or ``megahash eval --checkpoint DIR --tasks ...`` (megahash/eval/run.py). The checkpoint (a run
directory -> its ``latest``, or a ``step_N`` directory) is loaded at TP=1 in eval mode through
:func:`megahash.checkpoint.weights.load_for_inference`, whatever TP/ZeRO layout it was trained with;
text is tokenised and hashed exactly as the shards were (:mod:`megahash.eval.text`).

Requests (lm-eval 0.4 ``LM`` API):

- ``loglikelihood(context, continuation)``: sum of log p(continuation tokens | context) and whether
  every continuation token is the argmax. Context and continuation are tokenised together
  (trailing spaces of the context move to the continuation; the continuation tokens are the tail
  of the whole text's tokens, as in lm-eval's HF model). An empty context is ``</s>`` (id 2: the
  shards end every document with it, so it stands for "a new document starts"). Sequences longer
  than ``max_length`` + 1 are cut on the left.
- ``loglikelihood_rolling(text)``: lm-eval's disjoint rolling windows of ``max_length`` tokens
  (first window after a ``</s>`` prefix, every token scored exactly once).
- ``generate_until(context, {until, max_gen_toks})``: greedy decoding, stopping at any ``until``
  string, at ``</s>``, after ``max_gen_toks`` tokens or at ``max(max_length,
  model.max_position_embeddings)`` positions; the context keeps its last
  ``max(max_length - max_gen_toks, max_length // 2)`` tokens. Decoding is incremental (``DecodeState``: KV caches or
  recurrent states per attention kind); a model whose incremental logits do not match a full
  forward on a probe sequence (or that raises) falls back to recomputing the whole sequence each
  step (``self.decode_mode`` says which). Word-hash codes of generated tokens are computed from
  the text generated so far; with the ``word`` hash unit of subword streams a piece's code can
  depend on the pieces after it, which the incremental path cannot revise (the recompute path
  can: ``incremental=False``).

Batching: requests are sorted by length (longest first), right-padded with ``<pad>`` (zero codes)
and run ``batch_size`` at a time; causal models make right padding exact. Log-probabilities use
the real vocabulary only (TP padding columns of the output layer are dropped).

Hash-code heads (``model.head=hash-bits|hash-bucket``, the hashed-word decoder): log-likelihoods
come from :func:`megahash.models.heads.score_continuation` (sum over continuation words of the
head's log-probability of the word's code), ``is_greedy`` from the head's argmax code; generation
needs a word stream and picks the word-table entry whose code has the highest log-probability.

Only causal decoders (``model.arch=decoder``, ``train.objective=clm``) can be scored.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from megahash.errors import ConfigError
from megahash.eval.text import NUM_SPECIAL, Encoded, TextCodec, load_codec

log = logging.getLogger(__name__)


def _as_bool(v) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def target_logprobs(logits: torch.Tensor, enc: Encoded, n: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The vocabulary log-softmax [n, V] at the positions predicting the last ``n`` tokens of ``enc`` and those
    tokens' ids [n], from one window's logits [s, V'] (inputs ``enc[:-1]``; V' the padded vocabulary)."""
    m = len(enc) - 1
    lp = logits[m - n : m, :vocab_size].float().log_softmax(-1)
    return lp, torch.tensor(enc.ids[-n:], dtype=torch.long, device=lp.device)


@register_model("megahash")
class MegahashEvalLM(LM):
    """lm-eval ``LM`` over a megahash checkpoint (see the module docstring).

    model_args: ``checkpoint`` (or ``pretrained``) DIR, ``batch_size`` (8), ``max_length``
    (default ``data.seq_length`` of the run: the context the model was trained on),
    ``incremental`` (true), ``tokenizer`` (override ``data.tokenizer``), ``overrides``
    (config overrides ``a.b=c`` separated by ``|``), ``weights`` (live, ema or a quantized artifact's path).
    """

    def __init__(
        self,
        checkpoint: str | None = None,
        pretrained: str | None = None,
        batch_size=8,
        max_length=None,
        incremental=True,
        tokenizer: str | None = None,
        overrides=None,
        max_batch_size=None,
        device=None,
        _loaded=None,
        weights: str = "live",
        **_kw,
    ):
        super().__init__()
        if _loaded is not None:
            cfg, model, ckpt, codec = _loaded
        else:
            path = checkpoint or pretrained
            if not path:
                raise ConfigError("the megahash lm-eval model needs checkpoint=DIR")
            from megahash.eval.text import load_model

            if isinstance(overrides, str):
                overrides = [o for o in overrides.split("|") if o]
            cfg, model, ckpt = load_model(path, list(overrides or []), weights)
            codec = load_codec(cfg, ckpt, tokenizer, model_vocab=model.vocab_size)
        self._setup(cfg, model, ckpt, codec, batch_size, max_length, incremental)

    @classmethod
    def from_model(cls, cfg, model, codec: TextCodec | None = None, ckpt=None, **kw) -> MegahashEvalLM:
        """Wrap a model already in memory (eval mode is set here)."""
        codec = codec or load_codec(cfg, ckpt, model_vocab=model.vocab_size)
        return cls(_loaded=(cfg, model, ckpt, codec), **kw)

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **args})

    def _setup(self, cfg, model, ckpt, codec, batch_size, max_length, incremental):
        from megahash.models.arch import arch_of
        from megahash.objective_spec import objective_spec

        if not (arch_of(cfg.model.arch).causal and objective_spec(cfg.train.objective).next_token):
            raise ConfigError(
                f"megahash eval scores causal decoders; this checkpoint is model.arch={cfg.model.arch} "
                f"train.objective={cfg.train.objective}"
            )
        from megahash.accelerator import policy

        if policy.has_gpu() and next(model.parameters()).device.type == "cpu":
            model = model.to(policy.device())
        self._dev = next(model.parameters()).device
        self.cfg, self.model, self.ckpt, self.codec = cfg, model.eval(), ckpt, codec
        if isinstance(batch_size, str):
            batch_size = 8 if batch_size.startswith("auto") else int(batch_size)
        self.batch_size = max(1, int(batch_size or 8))
        self.max_length = int(max_length or cfg.data.seq_length)
        self.max_positions = max(self.max_length, int(cfg.model.max_position_embeddings))
        self.incremental = _as_bool(incremental)
        from megahash import catalog

        self.hash_head = catalog.caps("head", cfg.model.head).reads_hash_codes
        self.precision = cfg.train.precision  # the run's compute dtype (overrides: train.precision=fp32)
        self.num_layers = len(model.decoder.layers)
        self.decode_mode: str | None = None
        self._word_scores_cache = None

    # ================================================================== scoring helpers
    def _code_tensor(self, codes: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(codes))
        return (t if t.dtype == torch.uint8 else t.long()).to(self._dev)

    def _inputs(self, encs: list[Encoded], codes: list[np.ndarray | None], length: int):
        """Right-padded tokens [B, length] and codes [B, length, w] (or None)."""
        B = len(encs)
        tok = torch.full((B, length), self.codec.pad_id, dtype=torch.long, device=self._dev)
        cod = None
        if codes[0] is not None:
            cod = self._code_tensor(np.zeros((B, length, codes[0].shape[1]), codes[0].dtype))
        for i, (e, c) in enumerate(zip(encs, codes)):
            n = min(len(e), length)
            tok[i, :n] = torch.tensor(e.ids[:n], dtype=torch.long)
            if cod is not None:
                cod[i, :n] = self._code_tensor(c[:n])
        return tok, cod

    @torch.no_grad()
    def _score(self, items: list[tuple]) -> list[tuple[float, bool]]:
        """items: (full sequence, n_cont[, codes]): log p(last n_cont tokens | the tokens before
        them) and whether each of them is the greedy choice."""
        prepared = []
        for item in items:
            enc, n = item[0], item[1]
            codes = item[2] if len(item) > 2 and item[2] is not None else self.codec.codes(enc)
            if len(enc) > self.max_length + 1:
                cut = len(enc) - self.max_length - 1
                enc, codes = enc[cut:], None if codes is None else codes[cut:]
            n = min(n, len(enc) - 1)
            prepared.append((enc, n, codes))
        order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][0]))
        out: list = [None] * len(prepared)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            batch = [prepared[i] for i in idx]
            with self._compute():
                scores = self._hash_head_scores(batch) if self.hash_head else self._vocab_scores(batch)
            for i, s in zip(idx, scores):
                out[i] = s
        return out

    def _vocab_scores(self, batch):
        length = max(len(e) for e, _, _ in batch) - 1
        tok, cod = self._inputs(
            [e[: len(e) - 1] for e, _, _ in batch], [None if c is None else c[:-1] for _, _, c in batch], length
        )
        logits = self.model(tok, hash_codes=cod)  # [B, s, V]
        res = []
        for i, (e, n, _) in enumerate(batch):
            if n <= 0:
                res.append((0.0, True))
                continue
            lp, tgt = target_logprobs(logits[i], e, n, self.codec.vocab_size)
            ll = lp.gather(-1, tgt[:, None]).sum().item()
            res.append((float(ll), bool((lp.argmax(-1) == tgt).all())))
        return res

    def _hash_head_scores(self, batch):
        from megahash.models import heads

        score_fn = getattr(heads, "score_continuation", None)
        res = []
        for enc, n, codes in batch:
            if n <= 0:
                res.append((0.0, True))
                continue
            c = len(enc) - n
            ids = torch.tensor(enc.ids, dtype=torch.long, device=self._dev)
            ct = self._code_tensor(codes)
            if score_fn is not None:
                ll = float(score_fn(self.model, ct[:c], ct[c:], ids[:c], ids[c:]))
            else:  # the head's per-token loss is -log p(code)
                loss = self.model(
                    ids[None, :-1], hash_codes=ct[None, :-1], labels=ids[None, 1:], label_codes=ct[None, 1:]
                )
                ll = -float(loss[0, c - 1 :].sum())
            logits = self.model(ids[None, :-1], hash_codes=ct[None, :-1])[0, c - 1 :]  # [n, T or N]
            target = ct[c:]
            head = self.model.head
            if hasattr(head, "targets"):  # hash-bits: every bit on the right side of 0
                greedy = bool(((logits > 0) == head.targets(target).bool()).all())
            else:
                greedy = bool((logits.argmax(-1) == head.bucket_ids(target)).all())
            res.append((ll, greedy))
        return res

    # ================================================================== lm-eval API
    def _encode_pair(self, context: str, continuation: str) -> tuple[Encoded, int]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        if not context:
            return self._after_prefix(self.codec.encode(continuation))
        whole = self.codec.encode(context + continuation)
        ctx_len = len(self.codec.encode(context))
        ctx_len = min(ctx_len, len(whole) - 1) if len(whole) > 1 else 0
        if ctx_len == 0:
            return self._after_prefix(whole)
        return whole, len(whole) - ctx_len

    def _after_prefix(self, enc: Encoded) -> tuple[Encoded, int]:
        """A continuation with no context: the codec's prefix + it, every token scored; with no prefix (a
        tokenizer without eos and bos) its first token is the context."""
        prefix = self.codec.prefix()
        if len(prefix) or len(enc) > 1:
            return prefix + enc, len(enc) - (0 if len(prefix) else 1)
        from megahash.errors import DataError

        raise DataError(
            "a request with no context and a one-token continuation cannot be scored: the tokenizer has no eos or bos "
            "token to condition on; use a tokenizer with an end-of-document token, or tasks whose requests have a context"
        )

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        items = [self._encode_pair(*req.args) for req in requests]
        return self._score(items)

    def _rolling_windows(self, enc: Encoded) -> list[tuple[Encoded, int, np.ndarray | None]]:
        """lm-eval's disjoint rolling windows over ``</s>`` + text, with the codes of the whole
        text cut per window (codes of the word hash unit depend on neighbouring pieces)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        full = self.codec.prefix() + enc  # index 0 = the prefix (or the text's first token: no eos/bos)
        codes = self.codec.codes(full)
        windows = []
        for ctx, pred in map(
            make_disjoint_window,
            get_rolling_token_windows(
                token_list=list(range(1, len(full))), prefix_token=0, max_seq_len=self.max_length, context_len=1
            ),
        ):
            idx = ctx + pred
            words = None if full.words is None else [full.words[i] for i in idx]
            windows.append(
                (Encoded([full.ids[i] for i in idx], words), len(pred), None if codes is None else codes[idx])
            )
        return windows

    def _sliding_windows(self, enc: Encoded, stride: int) -> list[tuple[Encoded, int, np.ndarray | None]]:
        """Strided windows over ``</s>`` + text (the perplexity of fixed-length models, as transformers'
        guide computes it): the first window scores its first ``max_length`` tokens; each next one
        ends ``stride`` tokens later and scores those ``stride``, with the ``max_length + 1 - stride``
        tokens before them as context. Every token is scored once; ``stride = max_length`` gives
        lm-eval's disjoint windows (one token of context), ``stride = 1`` every token with a full window."""
        full = self.codec.prefix() + enc  # index 0 = the prefix (or the text's first token: no eos/bos)
        codes = self.codec.codes(full)
        windows, scored, n = [], 1, len(full)
        while scored < n:
            end = min(n, scored + (self.max_length if scored == 1 else stride))
            start = max(0, end - 1 - self.max_length)
            windows.append((full[start:end], end - scored, None if codes is None else codes[start:end]))
            scored = end
        return windows

    def loglikelihood_sliding(self, texts: list[str], stride: int) -> list[float]:
        """Log-likelihood of each text with strided windows (:meth:`_sliding_windows`)."""
        if not 1 <= stride <= self.max_length:
            raise ConfigError(f"--stride {stride} must be between 1 and the window ({self.max_length} tokens)")
        return [
            float(sum(s for s, _ in self._score(self._sliding_windows(self.codec.encode(t), stride)))) for t in texts
        ]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        out = []
        for req in requests:
            scores = self._score(self._rolling_windows(self.codec.encode(req.args[0])))
            out.append(float(sum(s for s, _ in scores)))
        return out

    # ------------------------------------------------------------------ generation
    def _next_tokens(self, logits: torch.Tensor) -> list[int]:
        """Greedy next token per row from the last position's head output [B, ...]. A hash-code
        head scores every word of the word table by the log-probability of its code."""
        if not self.hash_head:
            return logits[:, : self.codec.vocab_size].float().argmax(-1).tolist()
        if self.codec.kind != "words":
            raise ConfigError("generation with a hash-code head needs a word stream (data.tokenizer=words)")
        head = self.model.head
        bits = hasattr(head, "targets")  # HashBitsHead; HashBucketHead has bucket_ids
        if self._word_scores_cache is None:
            words = self.codec.word_list[NUM_SPECIAL:]
            codes = self._code_tensor(
                self.codec.codes(Encoded([NUM_SPECIAL + i for i in range(len(words))], list(words)))
            )
            self._word_scores_cache = head.targets(codes).float() if bits else head.bucket_ids(codes)
        table = self._word_scores_cache  # [W, T] bits or [W] bucket ids
        lg = logits.float()
        if bits:  # log p(code) = sum_bits log sigmoid(+-logit)
            scores = table @ F.logsigmoid(lg).T + (1 - table) @ F.logsigmoid(-lg).T  # [W, B]
            best = scores.argmax(0)
        else:
            best = lg.log_softmax(-1)[:, table].argmax(-1)
        return (best + NUM_SPECIAL).tolist()

    def _forward_last(self, encs: list[Encoded], state=None) -> torch.Tensor:
        codes = [self.codec.codes(e) for e in encs]
        length = max(len(e) for e in encs)
        tok, cod = self._inputs(encs, codes, length)
        out = (
            self.model(tok, hash_codes=cod, decode_state=state)
            if state is not None
            else self.model(tok, hash_codes=cod)
        )
        return out[:, -1]

    def _compute(self):
        """The run's compute context (``accelerator.policy.compute_context``: bf16 autocast for a bf16 run)."""
        from megahash.accelerator import policy

        return policy.compute_context(self.precision, self._dev)

    @torch.no_grad()
    def _check_incremental(self) -> str:
        """'incremental' if DecodeState decoding reproduces a full forward on a probe (within the
        compute dtype's tolerance, ``accelerator.policy.compute_tolerance``), else 'recompute'."""
        if not self.incremental:
            return "recompute"
        from megahash.accelerator import policy
        from megahash.models.megatron_model import DecodeState

        try:
            with self._compute():
                return self._incremental_matches(DecodeState, policy.compute_tolerance(self.precision, self._dev))
        except Exception as e:  # a kind without decoding support
            log.warning(
                "megahash: incremental decoding unavailable (%s); recomputing instead", str(e).splitlines()[0][:200]
            )
            return "recompute"

    def _incremental_matches(self, DecodeState, tol: float) -> str:
        """Decode a 7-token probe (4 tokens, then 3 one at a time) and compare its last logits with a full forward."""
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(5, max(6, self.codec.vocab_size), (1, 7), generator=g).tolist()[0]
        if self.codec.kind == "words":
            enc = Encoded(ids, [self.codec.token_word(i) for i in ids])
        else:
            enc = Encoded(ids)
        codes = self.codec.codes(enc)  # the same codes for both paths: only the attention differs
        tok, cod = self._inputs([enc], [codes], len(enc))
        full = self.model(tok, hash_codes=cod)[:, -1]
        st = DecodeState(self.num_layers)
        self.model(tok[:, :4], hash_codes=None if cod is None else cod[:, :4], decode_state=st)
        out = None
        for k in range(4, 7):
            out = self.model(tok[:, k : k + 1], hash_codes=None if cod is None else cod[:, k : k + 1], decode_state=st)[
                :, -1
            ]
        scale = max(1.0, float(full.float().abs().max()))  # relative to the logits' scale
        ok = torch.allclose(out.float(), full.float(), atol=tol * scale, rtol=tol)
        if not ok:
            log.warning("megahash: incremental decoding differs from a full forward; recomputing instead")
        return "incremental" if ok else "recompute"

    def _append(self, enc: Encoded, token: int) -> Encoded:
        words = None if enc.words is None else [self.codec.token_word(token)]
        return enc + Encoded([token], words)

    def _continuation_text(self, ctx: Encoded, gen: list[int]) -> str:
        if self.codec.kind == "words":
            return "".join(" " + self.codec.token_word(t) for t in gen if self.codec.token_word(t))
        full = self.codec.decode(ctx.ids + gen)
        head = self.codec.decode(ctx.ids)
        return full[len(head) :] if full.startswith(head) else self.codec.decode(gen)

    @torch.no_grad()
    def _generate_group(self, encs: list[Encoded], until: list[str], max_gen: int) -> list[str]:
        if self.decode_mode is None:
            self.decode_mode = self._check_incremental()
        with self._compute():
            return self._greedy_group(encs, until, max_gen)

    def _greedy_group(self, encs: list[Encoded], until: list[str], max_gen: int) -> list[str]:
        from megahash.models.megatron_model import DecodeState

        B = len(encs)
        seqs = list(encs)
        gens: list[list[int]] = [[] for _ in range(B)]
        texts = [""] * B
        done = [False] * B
        state = DecodeState(self.num_layers) if self.decode_mode == "incremental" else None
        logits = self._forward_last(seqs, state)
        for _ in range(max_gen):
            nxt = self._next_tokens(logits)
            for i in range(B):
                if done[i]:
                    continue
                if nxt[i] == self.codec.eos_id:
                    done[i] = True
                    continue
                gens[i].append(nxt[i])
                texts[i] = self._continuation_text(encs[i], gens[i])
                if any(s and s in texts[i] for s in until):
                    done[i] = True
            seqs = [self._append(s, t) for s, t in zip(seqs, nxt)]
            if all(done) or len(seqs[0]) >= self.max_positions:
                break
            if state is not None:
                step_codes = [self.codec.codes(s) for s in seqs]
                tok = torch.tensor([[t] for t in nxt], dtype=torch.long, device=self._dev)
                cod = None if step_codes[0] is None else torch.stack([self._code_tensor(c[-1:]) for c in step_codes])
                logits = self.model(tok, hash_codes=cod, decode_state=state)[:, -1]
            else:
                logits = self._forward_last(seqs)
        out = []
        for t in texts:
            cut = min([t.index(s) for s in until if s and s in t], default=len(t))
            out.append(t[:cut])
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        prepared = []
        for k, req in enumerate(requests):
            context, kwargs = req.args[0], dict(req.args[1] if len(req.args) > 1 else {})
            until = kwargs.get("until") or []
            if isinstance(until, str):
                until = [until]
            max_gen = int(kwargs.get("max_gen_toks", 256))
            keep = max(self.max_length - max_gen, self.max_length // 2, 1)
            enc = self.codec.encode(context) if context else Encoded([])
            enc = self.codec.prefix() + enc if len(enc) == 0 else enc
            if len(enc) == 0:
                from megahash.errors import DataError

                raise DataError(
                    "generation from an empty context needs a token to start from: the tokenizer has no eos or bos "
                    "token; use a tokenizer with an end-of-document token, or tasks whose requests have a context"
                )
            enc = enc[max(0, len(enc) - keep) :]
            prepared.append((k, enc, tuple(until), max_gen))
        groups: dict = {}
        for k, enc, until, max_gen in prepared:
            groups.setdefault((len(enc), until, max_gen), []).append((k, enc))
        out: list = [None] * len(prepared)
        for (_, until, max_gen), members in sorted(groups.items(), key=lambda kv: -kv[0][0]):
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                texts = self._generate_group([e for _, e in chunk], list(until), max_gen)
                for (k, _), t in zip(chunk, texts):
                    out[k] = t
        return out
