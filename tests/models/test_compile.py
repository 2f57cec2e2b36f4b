"""``train.compile``: torch.compile of each transformer layer (regional compilation) gives the
eager model's loss and gradients, without graph breaks in the layers (megatron-core 0.16.1's
RowParallelLinear warning, removed by ``accelerator.patches.apply_megatron_fixes``, was one on rank 0)."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from conftest import eager_backend_model
from megahash.accelerator import rng
from megahash.config import load_config

pytestmark = pytest.mark.usefixtures("dist")


@pytest.mark.parametrize("schedule", ["uniform:mha", "list:mhe-mul,rndembqk"])
def test_compiled_layers_match_eager_without_graph_breaks(schedule):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from megahash.models.megatron_model import build_model
    from megahash.training.trainer import compile_layers

    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.ffn_hidden_size=64",
            f"model.schedule={schedule}",
            "data.seq_length=16",
            "model.max_position_embeddings=64",
        ],
    )
    tokens = torch.randint(5, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    torch._dynamo.reset()
    counters.clear()
    for compiled in (False, True):  # the recompile limit: test_recompile_limit_covers_every_shape_of_... below
        rng.seed_all(0)
        model = build_model(cfg, 128, dtype=torch.float32)
        if compiled:
            compile_layers(model)
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    (l0, g0), (l1, g1) = results
    assert sorted(g0) == sorted(g1)  # parameter names unchanged: checkpoints do not depend on compile
    assert torch.allclose(l0, l1, atol=1e-5), (l0, l1)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-4, rtol=1e-3), n
    assert counters["stats"]["unique_graphs"] >= 1  # the layers really were compiled
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_recompile_limit_covers_every_shape_of_a_fixed_input_hybrid(monkeypatch):
    """A bf16 hybrid of distinct kinds with a fixed-input kind keeps a graph per layer for the micro-batch, the
    fixed sequence's own pass (a batch of 1, fp32 into the first layer) and each validation chunk size: 20 graphs
    here, over the 2 per layer + 8 = 16 compile_layers allowed before (a 20-kind bf16 hybrid with fixedseqqk hit
    48 on CPU and ran the rest eagerly). Dynamo's own recompile accounting, with its eager backend for speed."""

    import torch._dynamo
    from torch._dynamo.utils import counters

    from megahash.models.attention import fixed_qk
    from megahash.training.trainer import compile_layers

    kinds = ["mha", "gqa", "swa+window=4", "fixedseqqk"]
    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            f"model.num_layers={len(kinds)}",
            "model.num_heads=4",
            "model.ffn_hidden_size=64",
            "model.schedule=list:" + ",".join(kinds),
            "data.seq_length=16",
            "model.max_position_embeddings=64",
            "model.attention.options.fixed_seq_length=16",
        ],
    )
    model = eager_backend_model(monkeypatch, cfg)
    fixed_qk.set_fixed_tokens(model, [(7 * i + 5) % 128 for i in range(16)])
    tokens = torch.randint(5, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        compile_layers(model, shapes=3)  # training's micro-batch of 2, validation's chunks of 4 and 3
        with torch.autocast("cpu", torch.bfloat16):
            model(tokens[:2], labels=tokens[:2]).float().mean().backward()
            with torch.no_grad():
                for rows in (4, 3):
                    model(tokens[:rows], labels=tokens[:rows])
    assert counters["stats"]["unique_graphs"] == 20 > 2 * len(kinds) + 8  # 4 layers x (2 + 3) inputs; the old limit
