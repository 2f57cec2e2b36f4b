"""The CUDA-only paths (marker ``gpu``: skipped with the reason where there is no CUDA device;
``bash benchmarks/gpu_check.sh`` runs them on one): bf16 compute under autocast over fp32 parameters
with the fused AdamW inside the DeepSpeed engine, compiled layers through the engine, the chunked
cross-entropy and fused SwiGLU on the device, the rotary table of a CPU model on a GPU machine
(the export check's failure of issue 25), and the process group bound to the device."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

TINY = [
    "model.hidden_size=128",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.ffn_hidden_size=256",
    "data.seq_length=128",
    "train.micro_batch_size=4",
    "train.global_batch_size=4",
    "train.warmup_steps=1",
    "train.lr=3e-3",
]


def _cfg(shards, *extra):
    from megahash.config import load_config

    return load_config(
        None,
        [
            *TINY,
            f"data.prefix=[{shards['prefix']}]",
            f"data.tokenizer={shards['tokenizer']}",
            f"data.cache_dir={shards['dir'] / 'cache'}",
            *extra,
        ],
    )


def test_process_group_is_bound_to_the_device(dist):
    from megahash.accelerator import policy

    group = torch.distributed.distributed_c10d._get_default_group()
    assert getattr(group, "bound_device_id", None) == policy.device()


@pytest.mark.parametrize("compile_setting", ["false", "auto"])
def test_bf16_autocast_engine_step_on_cuda(shakespeare_shards, dist, compile_setting):
    """precision auto on CUDA: fp32 parameters on the GPU, bf16 layer outputs, the engine's own fused
    AdamW (no DeepSpeed ZeRO optimizer at one rank); compiled layers (auto) train like eager ones."""
    from megahash.training.profiling import TrainHarness

    h = TrainHarness(_cfg(shakespeare_shards, f"train.compile={compile_setting}"), 12)
    assert h.engine.torch_autocast_enabled() and type(h.engine.optimizer).__name__ == "AdamW"
    assert h.engine.optimizer.defaults.get("fused") is True
    assert all(p.is_cuda and p.dtype == torch.float32 for p in h.model.parameters())
    dtypes = set()
    hook = h.model.decoder.layers[0].register_forward_hook(lambda m, i, o: dtypes.add(o[0].dtype))
    losses = [h.step() for _ in range(10)]
    hook.remove()
    assert dtypes == {torch.bfloat16} and losses[-1] < losses[0] - 0.3


def test_chunked_cross_entropy_and_swiglu_on_cuda():
    from megahash.models.chunked_ce import linear_cross_entropy
    from megahash.models.feedforward import SwiGLU

    dev = torch.device("cuda")
    h = torch.randn(300, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1000, 64, device=dev, requires_grad=True)
    t = torch.randint(0, 1000, (300,), device=dev)
    loss = linear_cross_entropy(h, w, t, rows=128)
    loss.sum().backward()
    ref = F.cross_entropy(F.linear(h.float(), w), t, reduction="none")
    assert torch.allclose(loss, ref, atol=0.05, rtol=0.02)
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    x = torch.randn(8, 2, 64, device=dev, requires_grad=True)
    a, b = torch.chunk(x, 2, -1)
    assert torch.allclose(SwiGLU.apply(x), F.silu(a) * b)


def test_cpu_model_on_a_gpu_machine_gets_cpu_rotary_tables(dist):
    """The export check runs the loaded checkpoint on the CPU: its RoPE tables must stay there
    (megatron's RotaryEmbedding moved them to the current CUDA device)."""
    from megahash.config import load_config
    from megahash.models.megatron_model import build_model

    cfg = load_config(
        None,
        [
            "model.hidden_size=64",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.ffn_hidden_size=128",
            "model.schedule=hybrid:rndembqk:even",
            "data.seq_length=16",
        ],
    )
    model = build_model(cfg, 300).eval()
    tokens = torch.randint(5, 300, (1, 12))
    with torch.no_grad():
        cpu_out = model(tokens)
        assert cpu_out.device.type == "cpu"
        model.cuda()
        gpu_out = model(tokens.cuda())
    assert model.rotary_pos_emb(12).is_cuda
    assert torch.allclose(cpu_out, gpu_out.cpu(), atol=1e-3)
