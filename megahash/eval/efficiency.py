"""Memory-efficiency and retention metrics of [Xue25] (pure Python, no torch).

Sec. 2.4.4 (HashFormers, Table 2.2), as fractions (x 100 for the tables' percentages):

- PRR = score_model / score_baseline                                   (eq. 2.4)
- PCR_All = 1 - #params_model / #params_baseline                       (eq. 2.5)
- PCR_Emb = 1 - #emb_params_model / #emb_params_baseline               (eq. 2.6)
- PoEP = #emb_params / #total_params                                   (eq. 2.7)

Sec. 3.4.6 (MHE, Tables 3.1-3.3): PRR against the MHA upper bound for direct indicators as
above and, for inverse indicators (perplexity: lower is better), PRR = 1 - (score_model -
score_MHA) / score_MHA; the performance elasticity of parameters against the SHA lower bound

- PEoP = ((score_model / score_SHA) - 1) / ((params_model / params_SHA) - 1)  (direct)
- PEoP = -((score_model / score_SHA) - 1) / ((params_model / params_SHA) - 1) (inverse)

(undefined, None, when the parameter counts are equal). The per-block memory model of Table 3.13
is :func:`megahash.models.costs.memory_usage`.
"""

from __future__ import annotations


def prr(score: float, baseline: float, higher_is_better: bool = True) -> float | None:
    """Performance retention ratio (eq. 2.4; sec. 3.4.6 for inverse indicators)."""
    if baseline is None or score is None or baseline == 0:
        return None
    if higher_is_better:
        return score / baseline
    return 1.0 - (score - baseline) / baseline


def pcr_all(params: int, baseline_params: int) -> float | None:
    """Parameter compression ratio of the whole model (eq. 2.5)."""
    return None if not baseline_params else 1.0 - params / baseline_params


def pcr_emb(emb_params: int, baseline_emb_params: int) -> float | None:
    """Parameter compression ratio of the embeddings (eq. 2.6)."""
    return None if not baseline_emb_params else 1.0 - emb_params / baseline_emb_params


def poep(emb_params: int, total_params: int) -> float | None:
    """Proportion of embedding parameters (eq. 2.7)."""
    return None if not total_params else emb_params / total_params


def peop(
    score: float, lower_score: float, params: int, lower_params: int, higher_is_better: bool = True
) -> float | None:
    """Performance elasticity of parameters against a lower-bound model (sec. 3.4.6)."""
    if None in (score, lower_score, params, lower_params) or lower_score == 0 or lower_params == 0:
        return None
    dp = params / lower_params - 1.0
    if dp == 0:
        return None
    e = (score / lower_score - 1.0) / dp
    return e if higher_is_better else -e
