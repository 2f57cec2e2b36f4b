"""One rank of tests/training/test_muon.py's TP check (run as 2 gloo processes, parallel.tensor=2): for every matrix Muon
takes in the TP=2 model, its shard of a full update is orthogonalized as the full matrix is (gathered, NS, cut
back), and NS of the shard alone is not that. Rank 0 writes a JSON file.
Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python muon_tp_worker.py OUT
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megahash.accelerator import process_groups
from megahash.config import load_config


def main(out: str) -> None:
    process_groups.init_distributed(2)
    from megahash.models.megatron_model import build_model
    from megahash.training import muon

    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            "model.num_layers=1",
            "model.num_heads=2",
            "model.ffn_hidden_size=64",
            "parallel.tensor=2",
            "train.optimizer=muon",
        ],
    )
    model = build_model(cfg, 128)
    group = next(g for g in muon.param_groups(model, cfg.train) if g["use_muon"])
    group.update(ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7)
    rank = torch.distributed.get_rank()
    routed = [n for n, r in muon.routes_to_muon(model).items() if r]
    params = dict(model.named_parameters())
    result = {}
    for i, name in enumerate(routed):
        p = params[name]
        dim = p.partition_dim
        full_shape = list(p.shape)
        full_shape[dim] *= 2
        full = torch.randn(full_shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64).float()
        local = full.chunk(2, dim=dim)[rank].contiguous()
        got, shape = muon._orthogonalize(p, local, group)
        want = muon.newton_schulz(full, 5, group["ns_coefficients"], 1e-7).chunk(2, dim=dim)[rank]
        alone = muon.newton_schulz(local, 5, group["ns_coefficients"], 1e-7)
        # bit-exact: the same Newton-Schulz on the same gathered matrix (one path)
        result[name] = {
            "dim": dim,
            "full_shape": list(shape) == full_shape,
            "equal": bool(torch.equal(got, want)),
            "alone_diff": float((alone.float() - want.float()).abs().max()),
        }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    process_groups.teardown()


if __name__ == "__main__":
    main(sys.argv[1])
