"""The training step's fast paths keep the mathematics: RoPE equals megatron-core's, and the
DeepSpeed engine at one fp32 data-parallel rank (plain fused AdamW inside the engine) trains exactly
like the plain torch loop (clip_grad_norm_ + AdamW + LambdaLR) on the same model and batches."""

import pytest
import torch

import conftest

pytestmark = pytest.mark.numerics  # compares floating-point results (see tests/numerics.py)

TINY = [*conftest.TINY, "train.global_batch_size=4", "train.precision=fp32"]


def test_rope_matches_megatron_core(dist):
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megahash.config import load_config
    from megahash.models.megatron_model import transformer_config
    from megahash.models.mixing import rope

    config = transformer_config(load_config(None, TINY))
    freqs = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)(37)
    t = torch.randn(37, 3, 4, 16, requires_grad=True)
    g = torch.randn(37, 3, 4, 16)
    ours = rope(t, freqs)
    (ga,) = torch.autograd.grad(ours, t, g)
    ref = apply_rotary_pos_emb(t, freqs, config)
    (gb,) = torch.autograd.grad(ref, t, g)
    # bit-exact: the same correctly rounded element-wise products and sum as megatron's (x (-s) = -(x s)), no reduction
    assert torch.equal(ours, ref) and torch.equal(ga, gb)


def test_one_rank_cross_entropy_equals_megatron_core(dist):
    """The TP=1 loss path (no collectives) gives megatron-core's vocab-parallel loss and gradient exactly."""
    from megatron.core import tensor_parallel

    from megahash.models.heads import vocab_cross_entropy

    logits = torch.randn(33, 3, 101, dtype=torch.float64).float() * 4
    target = torch.randint(0, 101, (33, 3))
    g = torch.rand(33, 3)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    ours = vocab_cross_entropy(a * 1.0, target)  # (the loss works in place on its input, as megatron's does)
    ref = tensor_parallel.vocab_parallel_cross_entropy(b * 1.0, target)
    ours.backward(g)
    ref.backward(g)
    # bit-exact: megatron's own VocabParallelCrossEntropy steps on the same tensors (one path, its no-op all-reduces skipped)
    assert torch.equal(ours, ref) and torch.equal(a.grad, b.grad)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 101), target.reshape(-1), reduction="none")
    assert torch.allclose(ours.detach().reshape(-1), expected, atol=1e-5)


def test_one_rank_engine_trains_like_the_plain_torch_loop(shakespeare_shards, tmp_path, dist):
    """ZeRO-1 configured at one data-parallel rank: the engine holds torch's fused AdamW itself, records
    the gradient norm, and 3 steps give the losses, norms and weights of the plain torch loop."""
    from megahash.accelerator import rng
    from megahash.config import load_config
    from megahash.data.dataset import make_loader
    from megahash.models.megatron_model import build_model
    from megahash.training.lr_schedule import lambda_for
    from megahash.training.param_groups import param_groups
    from megahash.training.profiling import TrainHarness

    cfg = load_config(
        None,
        [
            f"data.prefix=[{shakespeare_shards['prefix']}]",
            f"data.tokenizer={shakespeare_shards['tokenizer']}",
            f"data.cache_dir={tmp_path}",
            "train.zero_stage=1",
            *TINY,
        ],
    )
    h = TrainHarness(cfg, 3)
    assert type(h.engine.optimizer) is torch.optim.AdamW and h.engine.optimizer.defaults["fused"]
    rng.seed_all(cfg.train.seed)
    ref = build_model(cfg, h.data.vocab_size)  # the same initial weights (same seed), outside the engine
    assert all(
        torch.equal(a, b) for a, b in zip(h.model.parameters(), ref.parameters())
    )  # bit-exact: the same seed builds the same weights (one path)
    t = cfg.train
    opt = torch.optim.AdamW(param_groups(ref, t), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda_for(t))
    batches = iter(make_loader(h.data.train, 0, t.micro_batch_size, 0, 1))  # the same batches, same order
    for step in range(3):
        batch = next(batches)
        ours = h.step()
        mask = batch["loss_mask"].float()
        loss = (ref(batch["tokens"], labels=batch["labels"]) * mask).sum() / mask.sum().clamp(min=1.0)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), t.clip_grad)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        assert ours == pytest.approx(loss.item(), rel=1e-6, abs=0), step
        assert float(h.engine.get_global_grad_norm()) == pytest.approx(norm.item(), rel=1e-5), step
    for (name, a), b in zip(h.model.named_parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), name
