"""Costs of an attention kind AS IMPLEMENTED, measured on the ``meta`` device (no memory, no compute).

[Xue25] Tables 4.5-4.8 (``megahash.models.costs``) describe the [Xue25] implementations; this
module measures megahash's own code, whatever the kind (a kind needs no cost formula to be listed):
one attention sublayer of the config is built on ``meta`` in 16-bit and run with the config's
shapes (``batch`` sequences of ``seq`` tokens, plus the fixed sequence rndembqk/fixedseqqk carry):

- ``prefill_flops``: GEMM FLOPs of the forward (torch's ``FlopCounterMode``: matmuls and SDPA, as
  Table 4.6 counts GEMMs), output projection excluded as in Table 4.6;
- ``decode_flops``: the same for one new token per sequence after ``seq`` tokens of context
  (the layer's decoding cache filled by an inference prefill);
- ``cache_elements``: numbers in the layer's decode cache after ``seq`` tokens (bytes at 16 bit = 2x);
- ``activation_bytes``: bytes of the tensors the forward saves for backward (saved-tensor hooks,
  parameters excluded, each storage once). SDPA on ``meta`` follows the math path (the L x L map is
  saved); flash kernels on GPUs keep O(L) instead.

Measured per TP rank and multiplied by the TP size (TP = 1 in ``megahash params``/``report``).
Anything that cannot be measured (e.g. ``mha-megatron``, which has no ``mix``) is reported as "n/a".
"""

from __future__ import annotations

import copy

import torch

NA = "n/a"


def _build(cfg, kind: str, options: dict | None = None, dtype=torch.bfloat16):
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.utils import init_method_normal, scaled_init_method_normal

    from megahash.models import registry
    from megahash.models.megatron_model import transformer_config

    cfg = copy.deepcopy(cfg)
    cfg.parallel.sequence = False
    config = transformer_config(cfg, dtype)
    config.perform_initialization = False
    config.init_method = init_method_normal(cfg.model.init_std)
    config.output_layer_init_method = scaled_init_method_normal(cfg.model.init_std, cfg.model.num_layers)
    with torch.device("meta"):
        return build_module(registry.attention_spec(cfg, kind, options), config=config, layer_number=1)


def _flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def measure_kind(cfg, kind: str, batch: int, seq: int, options: dict | None = None) -> dict:
    """{"prefill_flops", "decode_flops", "cache_elements", "activation_bytes"} of one ``kind`` layer with its
    per-layer ``options`` (values "n/a" where a measurement is not possible)."""
    from megatron.core import parallel_state

    from megahash.models.forward_state import ForwardState
    from megahash.models.megatron_model import DecodeState

    out = {"prefill_flops": NA, "decode_flops": NA, "cache_elements": NA, "activation_bytes": NA}
    try:
        module = _build(cfg, kind, options)
    except Exception:
        return out
    if not hasattr(module, "mix"):
        return out
    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    from megahash import catalog
    from megahash.models.arch import arch_of

    rows = batch + (1 if catalog.caps("attention", kind).fixed_input else 0)  # the fixed sequence rides along
    h = cfg.model.hidden_size
    encoder = not arch_of(cfg.model.arch).causal
    mask = torch.zeros(rows, 1, 1, seq, dtype=torch.bool, device="meta") if encoder else None
    params = {p.untyped_storage()._cdata for p in module.parameters()}

    def x_of(length, grad=False):
        return torch.empty(length, rows, h, device="meta", dtype=torch.bfloat16, requires_grad=grad)

    try:  # training forward: FLOPs and saved activations
        saved: dict = {}

        def pack(t):
            key = t.untyped_storage()._cdata
            if key not in params:
                saved[key] = t.untyped_storage().nbytes()
            # not ``t``: a node saving its own output would hold it, and through its grad_fn itself, in
            # a cycle Python's gc cannot see; the graph and the process group that megatron's autograd
            # functions keep in it then lived as long as the process (three gloo threads a run)
            return t.detach()

        x = x_of(seq, grad=True)
        module.train()
        state = ForwardState(embeddings=x)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out["prefill_flops"] = tp * _flops(lambda: module.mix(x, mask, None, state))
        out["activation_bytes"] = tp * sum(saved.values())
    except Exception:
        pass
    if encoder:
        out["decode_flops"], out["cache_elements"] = NA, NA
        return out
    try:  # inference: prefill into the cache, then one token
        module.eval()
        decode = DecodeState(module.layer_number)
        with torch.no_grad():
            x = x_of(seq)
            module.mix(x, None, None, ForwardState(embeddings=x, decode=decode))
            cache = decode.layer(module.layer_number - 1)
            out["cache_elements"] = tp * sum(t.numel() for t in cache.values())
            y = x_of(1)
            state = ForwardState(embeddings=y, offset=seq, decode=decode)
            out["decode_flops"] = tp * _flops(lambda: module.mix(y, None, None, state))
    except Exception:
        pass
    return out
