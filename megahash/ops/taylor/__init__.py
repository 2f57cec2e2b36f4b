"""Based's second-order Taylor kernel ([Xue25] eq. 4.6; [Arora24]).

* :func:`taylor_causal` (``chunk.py``): training, prefill and decoding (called with the carried
  state ``(S, z)`` on the new tokens); on CUDA with 16 features and flash-linear-attention installed,
  training and stateless prefill run fla's ``parallel_based`` instead (``fla_based.py``);
  :func:`taylor_bidirectional`: encoders;
* :func:`taylor_recurrent` (``recurrent.py``) and :func:`naive_taylor` (``naive.py``): test oracles;
* :func:`taylor_kernel` / :func:`taylor_features` (``feature_map.py``): the kernel 1 + s + s^2/2 and
  its feature map phi (the kernel also gives the indicators' map)."""

from megahash.ops.taylor.chunk import taylor_bidirectional, taylor_causal
from megahash.ops.taylor.feature_map import taylor_features, taylor_kernel
from megahash.ops.taylor.naive import naive_taylor
from megahash.ops.taylor.recurrent import taylor_recurrent

__all__ = [
    "naive_taylor",
    "taylor_bidirectional",
    "taylor_causal",
    "taylor_features",
    "taylor_kernel",
    "taylor_recurrent",
]
