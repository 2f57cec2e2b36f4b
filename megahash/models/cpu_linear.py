"""The linear layers' GEMMs through oneDNN on CPU (fp32, one TP rank).

y = x W^T + b forward, dx = dy W backward, dW = dy^T x, db = sum(dy): the same function as
megatron-core's ``linear_with_grad_accumulation_and_async_allreduce`` at TP=1 (no sequence
parallelism, nothing to reduce), with the forward and input-gradient GEMMs run by oneDNN
(``torch.ops.mkldnn._linear_pointwise``, dense tensors in and out, strided operands read in
place) instead of torch's default CPU BLAS. The weight gradient goes through oneDNN only for
layers at least twice as wide in as out (fc2: 26 against 32 ms at 2,048 tokens, 2,048 -> 512);
for the others the BLAS was as fast or faster (2-core AMD EPYC). Values agree with the BLAS GEMMs to fp32 rounding (relative 1e-6; a different
summation order), and each path is deterministic, so resume stays bit-exact.

Installed per layer by :func:`install` when ``accelerator.policy.onednn_linear()`` says so; every other
case (GPU, TP > 1, sequence parallelism, bf16/fp64, deferred embedding gradients) keeps
megatron's own function.
"""

from __future__ import annotations

import torch

from megahash.accelerator import policy


def _onednn_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [n, k] @ b[m, k]^T -> [n, m] through oneDNN (fp32, either operand may be strided)."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


class _OneDNNLinear2d(torch.autograd.Function):
    """x [n, in] -> x W^T + b [n, out]; 2-D so that the output is no view (callers add in place)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = _onednn_gemm(x, weight)
        if bias is not None:
            out += bias
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _onednn_gemm(grad, weight.t())
        if ctx.needs_input_grad[1]:  # dW = dy^T x, [out, in]
            wide = weight.shape[1] >= 2 * weight.shape[0]
            dw = _onednn_gemm(grad.t(), x.t()) if wide else grad.t().matmul(x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad.sum(0)
        return dx, dw, db


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] with oneDNN's GEMMs (no checks; see :func:`linear`)."""
    out = _OneDNNLinear2d.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with oneDNN GEMMs where :func:`usable` (else ``F.linear`` itself)."""
    if usable(x, weight):
        return onednn_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """fp32 CPU tensors, outside ``torch.compile`` (Inductor picks its own GEMMs for compiled layers)."""
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and policy.onednn_linear()
    )


def _forward_impl(fallback):
    """A ``_forward_impl`` for a megatron ``ColumnParallelLinear``/``RowParallelLinear``: this module's
    linear where nothing needs communication or megatron's gradient fusions, ``fallback`` otherwise.

    The arguments go on to ``fallback`` exactly as the layer passed them (megatron passes them by
    keyword): megatron's ``_forward_impl`` sends a weight that does not require grad (autocast's bf16
    copy under ``torch.no_grad``, a frozen weight) to ``linear_with_frozen_weight``, whose parameters
    are in another order (``tp_group`` seventh) and which refuses any ``grad_output_buffer`` or
    ``wgrad_deferral_limit`` but None; re-passing them by position (and a default of 0) made every
    bf16 validation fail with "grad_output_buffer kwarg is only supported with ..."."""

    def impl(input, weight, bias=None, **kwargs):
        tp_group = kwargs.get("tp_group")
        if (
            kwargs.get("allreduce_dgrad")
            or kwargs.get("sequence_parallel")
            or kwargs.get("gradient_accumulation_fusion")
            or kwargs.get("grad_output_buffer") is not None
            or (tp_group is not None and tp_group.size() > 1)
            or not usable(input, weight)
        ):
            return fallback(input, weight, bias, **kwargs)
        return onednn_linear(input, weight, bias)

    impl.megahash_onednn = True
    return impl


def install(model: torch.nn.Module) -> int:
    """Route every TP=1 megatron linear layer of ``model`` through :func:`onednn_linear` on CPU;
    returns how many layers were routed (0 where ``accelerator.policy.onednn_linear()`` is False)."""
    from megatron.core import parallel_state

    from megahash.models.linear_layers import wrap_forward_impls

    if not policy.onednn_linear() or parallel_state.get_tensor_model_parallel_world_size() != 1:
        return 0
    return wrap_forward_impls(model, _forward_impl, "megahash_onednn")
