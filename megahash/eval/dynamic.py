"""Dynamic evaluation: held-out text scored window by window, the weights adapted on each window after it is scored.

    megahash eval --checkpoint RUN --text SRC --dynamic-lr 0.5 [--dynamic-clip 1.0]

Krause et al. 2018 ("Dynamic Evaluation of Neural Sequence Models", sec. 3-4) and 2019 (for transformers): the
documents, in order, are cut into lm-eval's disjoint rolling windows (megahash/eval/lm.py ``_rolling_windows``,
the same windows and tokens as the static number); window i is scored with the weights theta_i, then

    g_i = grad of (NLL of window i / its scored tokens) at theta_i
    theta_{i+1} = theta_i - lr * min(1, clip / |g_i|) * g_i           (SGD with the global gradient norm clipped)

so every token is scored by weights that have seen only the text before it ("score first", as Parameter Golf's
test-time training must be). ``lr = 0`` is the static score. The weights the evaluation started from are put
back at the end (on error too): what follows in the process scores the checkpoint, not the adapted model.
Vocabulary heads only (the scores are the heads' log-softmax, as ``_vocab_scores``); every embedding kind (the
windows carry their hash codes). The adapted parameters are all of the model's floating-point ones, in the
evaluation's mode (dropout off) and compute context (bf16 autocast for a bf16 run).
"""

from __future__ import annotations

import torch

from megahash.errors import ConfigError


def check_settings(lr: float, clip: float, names: tuple[str, str] = ("--dynamic-lr", "--dynamic-clip")) -> None:
    """One-line errors for a step size or clipping norm that cannot be meant (``names``: where they were set)."""
    if not lr >= 0 or lr == float("inf"):
        raise ConfigError(f"{names[0]} {lr} must be a finite number >= 0 (0 = off)")
    if not clip > 0 or clip == float("inf"):
        raise ConfigError(f"{names[1]} {clip} must be a finite number > 0")


def check_model(lm) -> None:
    """One-line error for a model dynamic evaluation cannot score (a head that scores hash codes)."""
    if lm.hash_head:
        raise ConfigError(
            f"dynamic evaluation scores vocabulary heads; this run's model.head={lm.cfg.model.head} scores hash "
            "codes: drop --dynamic-lr (or set eval.dynamic_lr=0)"
        )


def window_nll(lm, enc, n: int, codes) -> torch.Tensor:
    """NLL (nats, a differentiable scalar) of the last ``n`` tokens of ``enc`` given the tokens before them,
    through ``lm``'s model and compute context: ``_vocab_scores`` of one window, with its graph."""
    from megahash.eval.lm import target_logprobs

    m = len(enc) - 1
    tok, cod = lm._inputs([enc[:m]], [None if codes is None else codes[:-1]], m)
    with lm._compute():
        logits = lm.model(tok, hash_codes=cod)
    lp, target = target_logprobs(logits[0], enc, n, lm.codec.vocab_size)
    return -lp.gather(-1, target[:, None]).sum()


def dynamic_nll(lm, docs: list[str], lr: float, clip: float = 1.0) -> float:
    """Total NLL (nats) of ``docs`` under dynamic evaluation (module docstring) through a ``MegahashEvalLM``;
    the model's weights (and ``requires_grad`` flags) are as before when it returns or raises."""
    check_settings(lr, clip)
    check_model(lm)
    model = lm.model
    params = [p for p in model.parameters() if p.is_floating_point()]
    flags = [p.requires_grad for p in params]
    start = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=lr) if lr > 0 else None
    total = 0.0
    try:
        for p in params:
            p.requires_grad_(opt is not None)
        for doc in docs:
            full = lm.codec.encode(doc)
            for enc, n, codes in lm._rolling_windows(full):
                if n <= 0:
                    continue
                codes = lm.codec.codes(enc) if codes is None else codes
                with torch.set_grad_enabled(opt is not None):
                    nll = window_nll(lm, enc, n, codes)
                score = float(nll.detach())  # scored before the step below
                if score != score or score == float("inf"):
                    raise ConfigError(
                        f"dynamic evaluation diverged (a window's loss is {score}) at --dynamic-lr {lr}: lower it"
                    )
                total += score
                if opt is not None:
                    opt.zero_grad(set_to_none=True)
                    (nll / n).backward()
                    torch.nn.utils.clip_grad_norm_(params, clip)
                    opt.step()
    finally:
        with torch.no_grad():
            for p, s, flag in zip(params, start, flags, strict=True):
                p.copy_(s)
                p.grad = None
                p.requires_grad_(flag)
    return total
