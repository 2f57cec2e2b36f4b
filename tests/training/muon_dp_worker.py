"""One rank of tests/training/test_muon.py's data-parallel check (run as 1, 2 or 4 gloo processes): the trainer's
engine (megahash.training.profiling.TrainHarness) at ``train.zero_stage=1`` with ``train.optimizer=muon``, and at
every step, from the same weights and the same (all-reduced, clipped) gradients, a single-rank Muon (MuonAdamW
unsharded, every matrix and every AdamW element on this rank) stepped beside it: the step hooks of torch's
optimizer read the gradients before the sharded step and compare the weights after it (the reference's LR as
the schedule set it, its momentum the warm-up's value of the step, computed here). Rank 0 writes a JSON
file: per-step losses, the largest difference from the single-rank step, the final weights (a torch file
beside it), and per rank the matrices it ran Newton-Schulz on, the momentum buffers it holds and its
optimizer-state elements. With SAVE_AT > 0 it saves the checkpoint of that step (megahash.training.checkpoint.save,
as the trainer does) under ``train.save_dir``.
Usage: RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python muon_dp_worker.py OUT TP STEPS SAVE_AT OVERRIDE...
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megahash.accelerator import policy, process_groups
from megahash.config import load_config


def main(out: str, tp: int, steps: int, save_at: int, overrides: list[str]) -> None:
    process_groups.init_distributed(tp)
    from megatron.core import parallel_state

    from megahash.training import muon
    from megahash.training.profiling import TrainHarness

    cfg = load_config(None, [*overrides, f"parallel.tensor={tp}", f"train.steps={steps}"])
    counting = contextlib.ExitStack()  # for the whole run (closed by teardown's exit)
    ns_shapes = counting.enter_context(muon.counting_newton_schulz())
    h = TrainHarness(cfg, steps)
    opt = h.engine.optimizer
    names = {id(p): n for n, p in h.model.named_parameters()}
    params = [p for g in opt.param_groups for p in g["params"]]
    # the single-rank Muon: the same groups over copies of the parameters, never sharded
    copies = {id(p): torch.nn.Parameter(p.detach().clone()) for p in params}
    for p in params:  # megatron-core's tensor-parallel marks: the reference gathers the TP shards as well
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(p, attr):
                setattr(copies[id(p)], attr, getattr(p, attr))
    ref = muon.MuonAdamW(
        [{**g, "params": [copies[id(p)] for p in g["params"]]} for g in opt.param_groups],
        lr=cfg.train.lr,
        betas=(cfg.train.beta1, cfg.train.beta2),
        eps=cfg.train.eps,
        **policy.adamw_options(),
    )
    assert ref.shards is None
    diffs = []

    def before(optimizer, args, kwargs):
        with torch.no_grad():
            for p in params:
                c = copies[id(p)]
                c.copy_(p)  # the same weights before every step
                c.grad = None if p.grad is None else p.grad.detach().clone()
        m, step = cfg.train.muon, len(diffs)  # the 0-based step about to run
        warm = min(step / m.momentum_warmup_steps, 1.0) if m.momentum_warmup_steps else 1.0
        for g, r in zip(opt.param_groups, ref.param_groups):
            r["lr"] = g["lr"]  # as the schedule set it
            if r["use_muon"]:  # the momentum warm-up (modded-nanogpt's linear rise), from the step here
                r["momentum"] = m.momentum_start + (m.momentum - m.momentum_start) * warm
        ns_before = len(ns_shapes)
        ref.step()
        del ns_shapes[ns_before:]  # count the sharded optimizer's Newton-Schulz only

    def after(optimizer, args, kwargs):
        diffs.append(max(float((p.detach() - copies[id(p)].detach()).abs().max()) for p in params))

    opt.register_step_pre_hook(before)
    opt.register_step_post_hook(after)
    losses = []
    for step in range(1, steps + 1):
        losses.append(h.step())
        if step == save_at:
            from megahash.data.samples import consumed_samples
            from megahash.training import checkpoint

            checkpoint.save(h.engine, cfg, step, consumed_samples(cfg.train, step))
    shards = opt.shards
    mine = {
        "ns": sorted(names[id(p)] for p in (shards.matrices[shards.rank] if shards else [])),
        "ns_calls": len(ns_shapes),
        "momentum": sorted(names[id(p)] for p in params if muon.MOMENTUM in opt.state.get(p, {})),
        "state_numel": shards.state_numel(opt.state) if shards else None,
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
    }
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, mine)
    routed = sorted(n for n, r in muon.routes_to_muon(h.model).items() if r)
    if torch.distributed.get_rank() == 0:
        torch.save({n: p.detach().clone() for n, p in h.model.named_parameters()}, out + ".pt")
        with open(out, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "diffs": diffs,
                    "ranks": ranks,
                    "routed": routed,
                    "shapes": {n: list(p.shape) for n, p in h.model.named_parameters() if p.requires_grad},
                    "ns_steps": cfg.train.muon.ns_steps,
                    "sharded": shards is not None,
                    "engine_stage": h.engine.zero_optimization_stage(),
                },
                f,
            )
    process_groups.teardown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
