"""The GPU step's levers keep the mathematics, checked on CPU against independent references: the
chunked projection + cross-entropy (megahash.models.chunked_ce) against megatron-core's loss on the
whole logits, the fused SwiGLU against its autograd form, RoPE without ``cat`` against the
``rotate_half`` form; and what the accelerator's policy picks for a named CUDA device (configuration,
not speed), the rotary table's device following the model, and bf16 training under autocast."""

import pytest
import torch
import torch.nn.functional as F
from numerics import ulp_tol

pytestmark = pytest.mark.numerics  # compares floating-point results (see tests/numerics.py)


def saved_storages(fn, *args) -> int:
    """Bytes of the distinct storages ``fn`` saves for backward (inputs excluded)."""
    inputs = {a.untyped_storage().data_ptr() for a in args}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in inputs:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


@pytest.mark.parametrize("rows", [5, 1000])
def test_chunked_cross_entropy_equals_megatron_loss_on_whole_logits(dist, rows):
    from megahash.models.chunked_ce import linear_cross_entropy
    from megahash.models.heads import vocab_cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 2, 16, generator=g, requires_grad=True)
    weight = (torch.randn(37, 16, generator=g) * 0.5).requires_grad_()
    target = torch.randint(0, 37, (9, 2), generator=g)
    w_out = torch.rand(9, 2, generator=g)
    ours = linear_cross_entropy(hidden, weight, target, rows=rows)
    dh, dw = torch.autograd.grad(ours, (hidden, weight), w_out)
    ref = vocab_cross_entropy(F.linear(hidden, weight).float(), target)
    rh, rw = torch.autograd.grad(ref, (hidden, weight), w_out)
    assert (
        torch.allclose(ours, ref, atol=1e-5) and torch.allclose(dh, rh, atol=1e-5) and torch.allclose(dw, rw, atol=1e-5)
    )
    full = F.cross_entropy(F.linear(hidden, weight).reshape(-1, 37), target.reshape(-1), reduction="none")
    assert torch.allclose(ours.detach().reshape(-1), full, atol=1e-5)


def test_chunked_cross_entropy_gradcheck_and_keeps_no_logits():
    from megahash.models.chunked_ce import linear_cross_entropy

    g = torch.Generator().manual_seed(1)
    h = torch.randn(7, 6, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 6, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 11, (7,), generator=g)
    assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy(a, b, t, rows=3), (h, w))
    big_h, big_w = torch.randn(64, 8, requires_grad=True), torch.randn(500, 8, requires_grad=True)
    tt = torch.randint(0, 500, (64,))
    kept = saved_storages(lambda a, b: linear_cross_entropy(a, b, tt, rows=16), big_h, big_w)
    assert kept < 64 * 500 * 4 / 10  # the log-sum-exp per token and the targets, not [64 x 500] logits
    assert saved_storages(lambda a, b: F.cross_entropy(F.linear(a, b), tt), big_h, big_w) >= 64 * 500 * 4


def test_chunked_cross_entropy_keeps_autocasts_dtype_in_backward():
    """Under bf16 autocast (CPU's, the dtype decisions CUDA's makes for matmuls) every GEMM of the head, the
    three of backward too (logits recomputed, dh, dW), runs in bf16: autocast does not reach a custom
    Function's backward, which ran them in fp32 for fp32 hidden states (the model's final norm hands bf16 ones)
    and normalised the recomputed fp32 logits by the bf16 forward's log-sum-exp. The gradients equal autograd through the whole
    logits of the same policy (bf16 GEMMs, fp32 softmax) within bf16's rounding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megahash.models.chunked_ce import linear_cross_entropy

    class GemmDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "addmm", "bmm"):
                self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(3)
    h = torch.randn(96, 32, generator=g).requires_grad_(True)
    w = (0.2 * torch.randn(300, 32, generator=g)).requires_grad_(True)
    t = torch.randint(0, 300, (96,), generator=g)
    gemms = GemmDtypes()
    with gemms, torch.autocast("cpu", torch.bfloat16):
        loss = linear_cross_entropy(h, w, t, rows=32).mean()
    with gemms:
        loss.backward()
    assert len(gemms.seen) == 3 + 3 * 3 and set(gemms.seen) == {(torch.bfloat16, torch.bfloat16)}, gemms.seen
    h2, w2 = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16):
        ref = F.cross_entropy(F.linear(h2, w2).float(), t)
    ref.backward()
    tol = ulp_tol(torch.bfloat16, ops=4)
    torch.testing.assert_close(loss, ref, **tol)
    torch.testing.assert_close(h.grad, h2.grad, rtol=tol["rtol"], atol=tol["rtol"] * h2.grad.abs().max().item())
    torch.testing.assert_close(w.grad, w2.grad, rtol=tol["rtol"], atol=tol["rtol"] * w2.grad.abs().max().item())


def test_vocab_head_loss_equals_the_logits_path(dist):
    """The model's TP=1 head (chunked) gives the loss and gradients of its logits + megatron's CE."""
    from megahash.accelerator import rng
    from megahash.config import load_config
    from megahash.models.heads import vocab_cross_entropy
    from megahash.models.megatron_model import build_model

    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            "model.num_layers=1",
            "model.num_heads=2",
            "model.ffn_hidden_size=64",
            "data.seq_length=16",
            "train.precision=fp32",
        ],
    )
    rng.seed_all(0)
    model = build_model(cfg, 200)
    tokens = torch.randint(5, 200, (2, 16))
    labels = tokens.clone()
    labels[0, :3] = -100
    loss = model(tokens, labels=labels)
    ga = torch.autograd.grad(loss.sum(), model.embedding.weight)[0]
    hidden = model.hidden_states(tokens)
    lab = labels.transpose(0, 1).contiguous()
    ref = vocab_cross_entropy(model.logits(hidden).float(), lab.clamp(min=0)).masked_fill(lab < 0, 0).transpose(0, 1)
    gb = torch.autograd.grad(ref.sum(), model.embedding.weight)[0]
    assert torch.allclose(loss, ref, atol=1e-5) and torch.allclose(ga, gb, atol=1e-5)
    assert (loss[0, :3] == 0).all()


def test_fused_swiglu_equals_autograd_form_and_saves_less():
    from megahash.models.feedforward import SwiGLU, SwiGLUPair

    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, 32, generator=g, requires_grad=True)
    dy = torch.randn(5, 3, 16, generator=g)
    ours = SwiGLU.apply(x)
    (dx,) = torch.autograd.grad(ours, x, dy)

    def unfused(t):
        a, b = torch.chunk(t, 2, dim=-1)
        return F.silu(a) * b

    ref = unfused(x)
    (rx,) = torch.autograd.grad(ref, x, dy)
    # bit-exact: the forward is the same ATen ops (silu, mul) on the same views of x: one path
    assert torch.equal(ours, ref)
    # the gradients come from other layouts (strided halves written in place, contiguous halves): ATen's
    # vectorised loop and its scalar tail round differently per CPU capability, so a few ulps apart;
    # d gate = SiLU'(gate) g up with SiLU' = s (1 + gate (1 - s)), s = sigmoid: about 10 fp32 roundings,
    # absolute where 1 + gate (1 - s) cancels (scale: the largest gradient)
    tol = ulp_tol(torch.float32, ops=10, scale=rx.abs().max())
    torch.testing.assert_close(dx, rx, **tol)
    a, b = x.detach()[..., :16].clone().requires_grad_(), x.detach()[..., 16:].clone().requires_grad_()
    pa, pb = torch.autograd.grad(SwiGLUPair.apply(a, b), (a, b), dy)
    torch.testing.assert_close(pa, rx[..., :16], **tol)
    torch.testing.assert_close(pb, rx[..., 16:], **tol)
    assert saved_storages(SwiGLU.apply, x) == 0  # only its input (the fc1 output)
    assert saved_storages(unfused, x) == 5 * 3 * 16 * 4  # plus SiLU(gate)
    assert torch.autograd.gradcheck(SwiGLU.apply, (x.detach().double().requires_grad_(),))


def test_reference_rope_angles_equal_megatron_core():
    """The plain-torch model's RoPE angles (the HF export's) are the megatron model's table (megatron-core's
    RotaryEmbedding): at an offset, and at per-token positions (packed documents) as the model indexes it."""
    from megahash.models.megatron_model import Rotary
    from megahash.models.reference_ops import rope_freqs

    table = Rotary(kv_channels=16, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2]])
    # bit-exact: the same float32 products of the same integers and inverse frequencies, no reduction
    assert torch.equal(rope_freqs(3, 11, 16, 10000.0, "cpu"), table(14)[3:])
    # bit-exact: the same table's rows, gathered
    assert torch.equal(rope_freqs(0, 11, 16, 10000.0, "cpu", positions), table(11)[:, 0, 0][positions.t()].unsqueeze(2))


def test_accelerator_settings_for_a_named_cuda_device():
    """Asked for "cuda", the accelerator's policy picks the fused AdamW, bf16 compute under autocast
    over fp32 parameters, compiled layers and the fused GEMM of SwiGLU; for "cpu" its CPU choices."""
    from megahash.accelerator import policy

    gpu = policy.training_settings("auto", "auto", "cuda")
    assert gpu["adamw"] == {"fused": True} and gpu["param_dtype"] == torch.float32
    assert gpu["autocast_dtype"] == torch.bfloat16 and gpu["compile"] is True
    assert gpu["split_glu_gemms"] is False and gpu["onednn_linear"] is False
    assert gpu["fused_swiglu"] and gpu["chunked_cross_entropy"]
    cpu = policy.training_settings("auto", "auto", "cpu")
    assert cpu["autocast_dtype"] is None and cpu["compile"] is False and cpu["split_glu_gemms"] is True
    assert cpu["adamw"] == {"fused": True}  # torch >= 2.4 has the fused CPU kernel
    assert policy.training_settings("fp32", "true", "cuda")["autocast_dtype"] is None
    assert policy.compile_layers("false", "cuda") is False and policy.compile_layers("true", "cpu") is True


def test_deepspeed_json_for_bf16_autocast(tmp_path):
    from megahash.config import load_config
    from megahash.training.ds_config import deepspeed_config

    cfg = load_config(
        None, ["train.precision=bf16", "train.zero_stage=1", "train.global_batch_size=4", "train.micro_batch_size=4"]
    )
    ds = deepspeed_config(cfg, dp_size=1, bf16=False, autocast=torch.bfloat16)
    assert ds["bf16"]["enabled"] is False and ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert (
        ds["zero_optimization"]["stage"] == 0
    )  # one data-parallel rank, fp32 parameters: the engine steps AdamW itself


def test_rotary_table_follows_the_model_device(dist):
    """The table is built on the device of the module's own buffer (moved with the model), never on
    megatron's ``torch.cuda.current_device()``: a meta-device model gets meta tables."""
    from megahash.config import load_config
    from megahash.models.megatron_model import build_model

    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            "model.num_layers=1",
            "model.num_heads=2",
            "model.ffn_hidden_size=64",
            "data.seq_length=16",
        ],
    )
    model = build_model(cfg, 100)
    assert model.rotary_pos_emb(8).device.type == "cpu"
    model.to("meta")
    table = model.rotary_pos_emb(8)
    assert table.device.type == "meta" and table.shape == (8, 1, 1, 16)
    assert "rotary_pos_emb.anchor" not in model.state_dict()


def test_bf16_autocast_training_step(shakespeare_shards, dist):
    """precision=bf16 on CPU: fp32 parameters, bf16 activations, the engine's own fused AdamW (the
    path the accelerator picks for CUDA); the loss falls over a few steps and the grad norm is kept."""
    from megahash.config import load_config
    from megahash.training.profiling import TrainHarness

    prefix, tok = shakespeare_shards["prefix"], shakespeare_shards["tokenizer"]
    cfg = load_config(
        None,
        [
            "model.hidden_size=64",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.ffn_hidden_size=128",
            "data.seq_length=64",
            f"data.prefix=[{prefix}]",
            f"data.tokenizer={tok}",
            f"data.cache_dir={shakespeare_shards['dir'] / 'cache'}",
            "train.micro_batch_size=4",
            "train.global_batch_size=4",
            "train.precision=bf16",
            "train.warmup_steps=1",
            "train.lr=3e-3",
        ],
    )
    h = TrainHarness(cfg, 10)
    assert h.engine.torch_autocast_enabled() and not h.engine.bfloat16_enabled()
    assert type(h.engine.optimizer).__name__ == "AdamW" and all(p.dtype == torch.float32 for p in h.model.parameters())
    dtypes = set()
    hook = h.model.decoder.layers[0].register_forward_hook(lambda m, i, o: dtypes.add(o[0].dtype))
    losses = [h.step() for _ in range(8)]
    hook.remove()
    assert dtypes == {torch.bfloat16}
    assert losses[-1] < losses[0] - 0.2
    from megahash.training.engine_patches import grad_norm

    assert float(grad_norm(h.engine)) > 0
