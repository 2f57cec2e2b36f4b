"""One rank of tests/training/test_step_guard.py: the real pretrain entry point with a NaN gradient injected on one rank.

The injection is test code only: a tensor hook on one weight of the built model (registered by wrapping
the trainer's ``_build_model`` here) puts a NaN into that weight's gradient on rank POISON_RANK at the
listed backward passes (1-based; one micro-batch a step here, so the step numbers); the forward pass and
the loss stay finite. After each step this rank's parameters are saved to OUT/params_rank{R}_step{S}.pt
(OUT/params_rank{R}_refused.pt after a step refused without train.step_guard.skip_nonfinite: the run stops there).
Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python nonfinite_worker.py OUT POISON_RANK STEPS,.. OVERRIDES...
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from megahash import pretrain
from megahash.training import trainer

out, poison_rank, poison_at, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
poison_at = {int(s) for s in poison_at.split(",") if s}
rank = int(os.environ.get("RANK", "0"))
build_model, step_logged = trainer._build_model, trainer._train_step_logged


def poisoned_build_model(cfg, data):
    model, n_params, n_emb = build_model(cfg, data)
    weight = model.decoder.layers[0].mlp.linear_fc1.weight
    passes = [0]

    def hook(grad):
        passes[0] += 1
        if rank != poison_rank or passes[0] not in poison_at:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    weight.register_hook(hook)
    return model, n_params, n_emb


def step_and_save(run):
    before = run.step
    try:
        step_logged(run)
    finally:  # the step that stops the run is saved too: after a skip as its step, a refused one as "refused"
        params = {n: p.detach().clone() for n, p in run.engine.module.named_parameters()}
        name = f"step{run.step}" if run.step > before else "refused"
        torch.save(params, os.path.join(out, f"params_rank{rank}_{name}.pt"))


trainer._build_model = poisoned_build_model
trainer._train_step_logged = step_and_save
sys.exit(pretrain.main(overrides))
