"""The gated delta rule of gated DeltaNet ([Yang25b]).

* :func:`gated_delta_causal` (``chunk.py``, the WY/UT chunked form: one triangular solve and batched GEMMs
  for all chunks, the state carried over chunks): training, prefill and decoding (called with the carried
  state on the new tokens); on CUDA with flash-linear-attention installed, fla's ``chunk_gated_delta_rule``
  instead (``fla_gated.py``);
* :func:`gated_delta_recurrent` (``recurrent.py``): the token-by-token test oracle;
* :func:`causal_conv` (``conv.py``): the short causal convolution of q, k, v, with its carried inputs."""

from megahash.ops.gated_delta.chunk import gated_delta_causal
from megahash.ops.gated_delta.conv import causal_conv
from megahash.ops.gated_delta.recurrent import gated_delta_recurrent

__all__ = ["causal_conv", "gated_delta_causal", "gated_delta_recurrent"]
