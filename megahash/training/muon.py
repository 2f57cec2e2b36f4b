"""Muon for the hidden matrices, AdamW for the rest (``train.optimizer=muon``; docs/compact_models.md).

Muon [Jordan24] (``torch.optim.Muon``'s algorithm): per hidden matrix W with gradient G,

    B <- mu B + (1 - mu) G                      (momentum, ``lerp``)
    U <- (1 - mu) G + mu B   (Nesterov)  or  B
    O <- NS_k(U)                                (k quintic Newton-Schulz steps: U's orthogonal polar factor, roughly)
    W <- (1 - lr wd) W - AdjustLR(lr, shape) O

Two options beyond torch's: a momentum warm-up (modded-nanogpt's ``get_muon_momentum``: mu rises linearly from
``momentum_start`` at step 0 to ``momentum`` at step ``momentum_warmup_steps``, :func:`momentum_at`, set on the
groups by the LR schedule from the optimizer step, so a resume takes it up where it stopped), and
``orthogonalizer=polar_express``: NS_k with the per-iteration minimax coefficients of Polar Express [Amsel25]
(:func:`polar_express`) in place of the one fixed quintic.

and ``normuon: true``, NorMuon [Li25] (Algorithm 1; the authors' ``normuon.py``): after NS_k, each row (output
neuron) of O is divided by the root of an EMA of its mean square, and the result is scaled back to O's norm
(:func:`normuon`), its state a column [rows, 1] beside the momentum:

    v <- beta2 v + (1 - beta2) mean_j(O_ij^2)          (per row i)
    N = O / (sqrt(v) + 1e-10);   O <- N |O|_F / (|N|_F + 1e-10)

(the paper writes the update as 0.2 lr sqrt(mn) N / |N|_F; with O orthogonal, |O|_F = sqrt(min(m, n)), this is
AdjustLR=match_rms_adamw applied to the rescaled N, and ``adjust_lr`` keeps its meaning).

with AdjustLR = lr sqrt(max(1, A/B)) (original) or lr 0.2 sqrt(max(A, B)) (match_rms_adamw [Liu25]),
computed with torch's own pieces (``torch.optim._muon._zeropower_via_newtonschulz``, ``_adjust_lr``), so
one step equals ``torch.optim.Muon`` (tests/training/test_muon.py). Every other parameter takes ``torch.optim.AdamW``.

Routing (:func:`routes_to_muon`) is decided once, from each parameter's role in the megahash model before
DeepSpeed sees it: a 2-D weight of a transformer layer (``decoder.layers.*``: attention and MLP projections)
takes Muon; embeddings (vocabulary and hash tables, any ``nn.Embedding``-like module), the output layer and
heads, norms and biases take AdamW, as torchtitan, megatron-core (``optimizer/muon.py``) and DeepSpeed route them.

Layouts: Muon needs each matrix whole. Under tensor parallelism the shards are gathered over the TP group,
orthogonalized whole and cut back (megatron-core's ``TensorParallelMuon``, mode "duplicated"; the gathered
matrix is a row/column permutation of the logical one for interleaved SwiGLU/QKV, and NS commutes with
permutations). Over data-parallel ranks:

- ``train.zero_stage=0``: DeepSpeed's engine all-reduces the gradients and every rank steps every matrix
  (every rank holds all of Muon's and AdamW's state and runs every Newton-Schulz iteration);
- ``train.zero_stage`` 1 or 2 (several data-parallel ranks): the same engine path (DeepSpeed's ZeRO-0: gradient
  all-reduce, clipping, gradient norm), and this optimizer sharded over the ranks
  (megahash/training/muon_sharded.py): whole matrices owned by one rank each, which alone keeps their momentum and
  runs their Newton-Schulz; AdamW's groups cut into flat equal partitions as ZeRO-1 cuts them; the updated
  tensors all-gathered to every rank after the step. Stage 2's gradient partitioning is not applied: the
  gradients are all-reduced whole, as at stage 1;
- ZeRO-3 (parameters partitioned into flat slices on every rank) and DeepSpeed's bf16 optimizer (flat fp32
  masters) are refused in one line (:class:`Config`); ``train.precision=bf16`` (autocast over fp32
  parameters) runs on every layout above.

Why this design and not DeepSpeed's own: DeepSpeed's ZeRO-1/2 optimizer owns the gradient reduction, the
clipping norm and the flat fp32 partitions of every parameter it is given; its ``MuonWithAuxAdam`` (0.19)
all-reduces each matrix that straddles a partition boundary and runs the Newton-Schulz of such a matrix on
every rank holding a piece of it (its momentum too), with its own Newton-Schulz variant (not
``torch.optim.Muon``'s), and its issues show it silently running none at stage 0 (#8441) or under
``zero.Init`` (#8438). Handing DeepSpeed only AdamW's parameters would leave the matrices outside its clipping
norm. Megatron-LM's answer (megatron-core ``optimizer/layer_wise_optimizer.py``, ``LayerWiseDistributedOptimizer``,
"muon with dist optimizer is not supported" in ``optimizer/muon.py``) keeps the data-parallel all-reduce,
steps each whole parameter on one rank and all-gathers the results; torchtitan's ``DistributedMuon``
redistributes FSDP2 shards so that each matrix is computed whole on one owning rank, and back. modded-nanogpt
reduce-scatters the gradients of same-shape matrices straight to their owners and all-gathers the results (half
the gradient traffic, but a gradient path of its own, outside the engine's clipping).
megahash takes Megatron's: the engine's gradient path stays as it is (one clipping norm over every gradient,
the step guard and the gradient norm unchanged), whole matrices per rank, and AdamW's state partitioned as
ZeRO-1 partitions it (flat, equal: the embedding tables, the largest tensors, split evenly).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

from megahash.config_checks import ranged
from megahash.errors import ConfigError
from megahash.models import mup
from megahash.training.param_groups import param_groups as groups_of_roles

MOMENTUM = "momentum_buffer"  # torch.optim.Muon's state key
ROW_MOMENT = "second_momentum_buffer"  # NorMuon's per-row second moment, [rows, 1] (the authors' key)


@dataclass
class Config:
    """``train.muon``: Muon's options, used with ``train.optimizer=muon`` (docs/compact_models.md). Muon takes
    the 2-D matrices of the transformer layers at ``lr`` (torch.optim.Muon's algorithm), AdamW the rest at
    ``train.lr``; the LR schedule scales both. ``adjust_lr``: original (sqrt(max(1, rows/cols))) |
    match_rms_adamw (0.2 sqrt(max)). ``momentum_warmup_steps`` > 0: the momentum rises linearly from
    ``momentum_start`` to ``momentum`` over those steps (:func:`momentum_at`); ``orthogonalizer``: newton_schulz
    (torch.optim.Muon's quintic) | polar_express (:func:`polar_express`, [Amsel25]); ``normuon``: NorMuon's
    per-row normalisation of the orthogonalized update (:func:`normuon`, [Li25]) with EMA ``normuon_beta2``."""

    lr: float = ranged(0.02, "(0, inf)", "Muon's peak learning rate (hidden matrices)")
    momentum: float = ranged(0.95, "[0, 1)", "Muon's momentum")
    nesterov: bool = True
    ns_steps: int = ranged(5, "[1, 99]", "Newton-Schulz steps (torch.optim.Muon: < 100)")
    adjust_lr: Literal["original", "match_rms_adamw"] = "original"
    momentum_warmup_steps: int = ranged(0, "[0, inf)", "steps of Muon's momentum warm-up (0: none)")
    momentum_start: float = ranged(0.85, "[0, 1)", "Muon's momentum at step 0 of the warm-up")
    orthogonalizer: Literal["newton_schulz", "polar_express"] = "newton_schulz"
    normuon: bool = False
    normuon_beta2: float = ranged(0.95, "[0, 1)", "NorMuon's EMA factor of the per-row second moment")

    def check(self, cfg) -> None:
        """ZeRO-3 refused with the config (its layouts once the stage is known: :meth:`check_layout`); NorMuon
        under tensor parallelism (its row moments would need the whole rows of every TP shard) refused."""
        if cfg.train.optimizer == "muon" and self.normuon and cfg.parallel.tensor > 1:
            raise ConfigError(
                f"train.muon.normuon normalizes the whole rows of each matrix and is not implemented under "
                f"tensor parallelism (parallel.tensor={cfg.parallel.tensor}); set parallel.tensor=1 or "
                f"train.muon.normuon=false"
            )
        if cfg.train.optimizer == "muon" and cfg.train.zero_stage == 3:
            raise ConfigError(
                "train.optimizer=muon orthogonalizes whole matrices and ZeRO stage 3 partitions every weight into "
                "flat slices on every rank; set train.zero_stage=1 (Muon's state and Newton-Schulz work sharded "
                "over the data-parallel ranks, the weights whole on each) or train.optimizer=adamw"
            )

    def check_layout(self, t, stage: int, bf16_params: bool) -> None:
        """``train.optimizer=muon`` once the DeepSpeed stage is known (megahash/training/ds_config.py): refused
        in one line where the optimizer would not see whole fp32 matrices."""
        if t.optimizer != "muon":
            return
        if stage > 0:  # stage 3 (refused with the config already); 1 and 2 run as 0 with the optimizer sharded
            raise ConfigError(
                f"train.optimizer=muon orthogonalizes whole matrices and ZeRO stage {stage} partitions them into "
                f"flat slices; set train.zero_stage=1 (Muon's state and work sharded over the data-parallel ranks) "
                f"or train.optimizer=adamw"
            )
        if bf16_params:
            raise ConfigError(
                "train.optimizer=muon needs fp32 parameters (DeepSpeed's bf16 optimizer keeps flat "
                "masters); use train.precision=bf16 (autocast over fp32 parameters)"
            )


def routes_to_muon(model: torch.nn.Module) -> dict[str, bool]:
    """Parameter name -> True where Muon takes it: a 2-D weight of a module inside a transformer layer
    (``decoder.layers``) that is not an embedding table (``models.mup.layer_matrices``; under muP the hidden
    matrices, a kind's vector-like ones going to AdamW); False for everything else (embeddings and hash tables,
    output layer and heads, norms, biases). Decided by role, before any ZeRO flattening."""
    if getattr(model, "mup_width", None) is not None:
        return mup.hidden_matrices(model)
    return mup.layer_matrices(model)


def param_groups(model: torch.nn.Module, t) -> list[dict]:
    """Groups of :class:`MuonAdamW` (megahash/training/param_groups.py, each tagged ``use_muon``): the Muon
    matrices (``train.muon``, ``train.weight_decay``), AdamW's 2-D rest with decay and its 1-D rest without."""
    groups = groups_of_roles(model, t, muon=True)
    for g in groups:
        if g["use_muon"]:
            g.update(group_settings(t.muon, 0))
    return groups


def group_settings(m: Config, step: int) -> dict:
    """A Muon group's settings at optimizer step ``step``, all from ``train.muon``: set when the groups are
    built and again at every step by the LR schedule (megahash/training/lr_schedule.py ``go_to``), so a
    resume takes the run's config, not the settings an optimizer checkpoint carried in its groups."""
    from torch.optim import _muon

    coefficients = (
        POLAR_EXPRESS if m.orthogonalizer == "polar_express" else (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
    )
    return {
        "momentum": momentum_at(m, step),
        "nesterov": m.nesterov,
        "ns_steps": m.ns_steps,
        "adjust_lr_fn": m.adjust_lr,
        "ns_coefficients": coefficients,
        "normuon_beta2": m.normuon_beta2 if m.normuon else None,
    }


def momentum_at(m: Config, step: int) -> float:
    """Muon's momentum at 0-based optimizer step ``step`` (modded-nanogpt's ``get_muon_momentum`` warm-up):
    ``start + (momentum - start) * step / W`` while ``step < W`` (W = ``momentum_warmup_steps``), then
    ``momentum``. A function of the step alone, so a resume continues it exactly."""
    w = m.momentum_warmup_steps
    if step >= w:
        return m.momentum
    return m.momentum_start + (m.momentum - m.momentum_start) * step / w


# Polar Express [Amsel25]: the greedy minimax odd quintics p_t(x) = a x + b x^3 + c x^5, one per iteration,
# as modded-nanogpt ships them ("computed for num_iters=5, safety_factor=2e-2, cushion=2", train_gpt.py at
# KellerJordan/modded-nanogpt f411b3d); the input is scaled by its Frobenius norm times 1 + 2e-2 (the safety
# factor). Beyond the fifth iteration (a choice of megahash's): the classical quintic Newton-Schulz step
# 15/8 x - 10/8 x^3 + 3/8 x^5 (p(1) = 1, p'(1) = 0: it contracts the singular values, near 1 by then, onto 1).
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
POLAR_EXPRESS_LIMIT = (15 / 8, -10 / 8, 3 / 8)


def polar_express(update: torch.Tensor, steps: int, table=POLAR_EXPRESS) -> torch.Tensor:
    """``steps`` Polar Express iterations on one matrix in bf16 (modded-nanogpt's ``polar_express``, after
    [Amsel25]): X <- G / (1.02 |G|_F + 1e-6), then X <- a_t X + (b_t A + c_t A^2) X with A = X X^T
    and (a_t, b_t, c_t) the ``table``'s row t (the wide orientation: a tall matrix is transposed there and
    back), returned in the input's dtype."""
    coefficients = [tuple(r) for r in table[:steps]] + [POLAR_EXPRESS_LIMIT] * (steps - len(table))
    x = update.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)
    for a, b, c in coefficients:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x.to(update.dtype)


def newton_schulz(update: torch.Tensor, steps: int, coefficients, eps: float) -> torch.Tensor:
    """NS_k of one whole matrix: ``torch.optim.Muon``'s quintic iteration (in bf16, as torch runs it), or with
    ``coefficients`` a table of one (a, b, c) per iteration (:data:`POLAR_EXPRESS`), :func:`polar_express`'s."""
    if isinstance(coefficients[0], (tuple, list)):
        return polar_express(update, steps, coefficients)
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(update, coefficients, steps, eps)


def normuon(update: torch.Tensor, moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon's step on an orthogonalized ``update`` O [m, n] (module docstring, [Li25] Algorithm 1):
    ``moment`` [m, 1] (fp32, updated in place) <- EMA of each row's mean square; each row of O divided by
    sqrt(moment) + 1e-10, then the whole scaled to O's Frobenius norm. In fp32 and returned in fp32, as the
    authors' ``normuon_update`` keeps it (Newton-Schulz's output is bf16: rounding the scaled update back to bf16
    would add a relative error of 2^-9).

    [Li25] Z. Li et al., "NorMuon: Making Muon more efficient and scalable", arXiv:2510.05491 (2025)."""
    o = update.float()
    moment.lerp_(o.square().mean(dim=-1, keepdim=True), 1 - beta2)
    n = o / (moment.sqrt() + 1e-10)
    return n * (o.norm() / (n.norm() + 1e-10))


@contextlib.contextmanager
def counting_newton_schulz():
    """Within: the shape of every matrix :func:`newton_schulz` runs on, appended to the list it yields (the
    Newton-Schulz work of a rank, for tests and benchmarks)."""
    global newton_schulz
    real, calls = newton_schulz, []

    def counted(update, *args):
        calls.append(tuple(update.shape))
        return real(update, *args)

    newton_schulz = counted
    try:
        yield calls
    finally:
        newton_schulz = real


def _orthogonalize(p: torch.Tensor, update: torch.Tensor, group: dict) -> tuple[torch.Tensor, tuple]:
    """NS of ``p``'s whole matrix (its TP shards gathered and cut back); (local result, full shape)."""
    args = (group["ns_steps"], group["ns_coefficients"], group["eps"])
    dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
    if dim not in (0, 1) or not torch.distributed.is_initialized():
        return newton_schulz(update, *args), tuple(p.shape)
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = torch.distributed.get_world_size(tp_group)
    if tp == 1:
        return newton_schulz(update, *args), tuple(p.shape)
    parts = [torch.empty_like(update) for _ in range(tp)]
    torch.distributed.all_gather(parts, update.contiguous(), group=tp_group)
    full = newton_schulz(torch.cat(parts, dim=dim), *args)
    rank = torch.distributed.get_rank(tp_group)
    return full.chunk(tp, dim=dim)[rank], tuple(full.shape)


class MuonAdamW(torch.optim.Optimizer):
    """One torch optimizer (DeepSpeed takes one): groups tagged ``use_muon`` step as ``torch.optim.Muon``
    (:meth:`_muon_step`), the others through a ``torch.optim.AdamW`` sharing this optimizer's groups and state;
    after :meth:`shard`, each rank steps its own matrices and AdamW partitions, then all-gathers."""

    shards = None  # megahash.training.muon_sharded.DataParallelShards when the state is sharded over DP ranks

    def __init__(self, groups: list[dict], lr: float, betas, eps: float, **adamw_options):
        from torch.optim import _muon

        muon = [g for g in groups if g["use_muon"]]
        for g in muon:  # torch.optim.Muon's defaults
            g.setdefault("ns_coefficients", (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C))
            g.setdefault("eps", _muon.EPS)
        adam = [g for g in groups if not g["use_muon"]]
        self._adamw = torch.optim.AdamW(adam, lr=lr, betas=betas, eps=eps, **adamw_options) if adam else None
        # AdamW's groups first: the logged lr (the first group's) stays train.lr's schedule
        super().__init__((self._adamw.param_groups if adam else []) + muon, {})

    def state_keys_of(self, p: torch.Tensor, adam_keys: list[str]) -> list[str]:
        """The state saved for ``p`` (megahash/checkpoint/optimizer_state.py): Muon's momentum, or Adam's."""
        if not self.is_muon(p):
            return adam_keys
        return [MOMENTUM, ROW_MOMENT] if self._group_of(p).get("normuon_beta2") is not None else [MOMENTUM]

    def _group_of(self, p: torch.Tensor) -> dict:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    @staticmethod
    def fresh_state(p: torch.Tensor, group: dict) -> dict:
        """The state a Muon matrix ``p`` of ``group`` starts with (created at its first step, or before a
        checkpoint is loaded into it): the momentum, and NorMuon's row moments where the group runs it."""
        st = {MOMENTUM: torch.zeros_like(p, memory_format=torch.preserve_format)}
        if group.get("normuon_beta2") is not None:
            st[ROW_MOMENT] = torch.zeros(*p.shape[:-1], 1, dtype=torch.float32, device=p.device)
        return st

    def is_muon(self, p: torch.Tensor) -> bool:
        return any(g["use_muon"] and any(q is p for q in g["params"]) for g in self.param_groups)

    def shard(self, named: dict[str, torch.Tensor], group) -> None:
        """Shard the state and the work over the data-parallel process ``group`` (module docstring; ``named``:
        name -> parameter, for the assignment of the matrices)."""
        from megahash.training.muon_sharded import DataParallelShards

        names = {id(p): n for n, p in named.items()}
        matrices = {names[id(p)]: p for g in self.param_groups if g["use_muon"] for p in g["params"]}
        adam = [list(g["params"]) for g in self.param_groups if not g["use_muon"]]
        self.shards = DataParallelShards(matrices, adam, group)

    def owns(self, p: torch.Tensor) -> bool:
        """This rank steps Muon matrix ``p`` (every one without sharding)."""
        return self.shards is None or self.shards.owns(p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
        if self._adamw is not None:
            adam = [g for g in self.param_groups if not g["use_muon"]]
            if self.shards is None:  # the groups and state of load_state_dict, shared
                self._adamw.param_groups, self._adamw.state = adam, self.state
            else:  # this rank's partitions of them
                self._adamw.param_groups, self._adamw.state = self.shards.adam_groups(adam)
            self._adamw.step()
        if self.shards is not None:
            self.shards.gather()
        return loss

    def _muon_step(self, group: dict) -> None:
        """``torch.optim._muon._single_tensor_muon`` for one group (module docstring's equations)."""
        from torch.optim._muon import _adjust_lr

        lr, wd, mu = float(group["lr"]), group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None or not self.owns(p):
                continue
            grad = p.grad
            state = self.state[p]
            if MOMENTUM not in state or (group.get("normuon_beta2") is not None and ROW_MOMENT not in state):
                for k, v in self.fresh_state(p, group).items():
                    state.setdefault(k, v)
            buf = state[MOMENTUM]
            buf.lerp_(grad, 1 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            update, shape = _orthogonalize(p, update, group)
            if group.get("normuon_beta2") is not None:  # TP refused with the config: the matrix is whole here
                update = normuon(update, state[ROW_MOMENT], group["normuon_beta2"])
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))


def sharded(t, dp_size: int) -> bool:
    """Muon's state and work are sharded over the data-parallel ranks (``train.zero_stage`` 1 or 2, DP > 1)."""
    return t.optimizer == "muon" and t.zero_stage in (1, 2) and dp_size > 1


def build_optimizer(model: torch.nn.Module, t, adamw_groups: list[dict], adamw_options: dict, dp_size: int = 1):
    """The run's optimizer (``train.optimizer``): AdamW over ``adamw_groups``, or :class:`MuonAdamW`, sharded
    over megatron-core's data-parallel group where :func:`sharded`."""
    if t.optimizer == "muon":
        opt = MuonAdamW(param_groups(model, t), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **adamw_options)
        if sharded(t, dp_size):
            from megatron.core import parallel_state

            opt.shard(dict(model.named_parameters()), parallel_state.get_data_parallel_group())
        return opt
    return torch.optim.AdamW(adamw_groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **adamw_options)
