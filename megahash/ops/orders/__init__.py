"""[Xue25] Appendix I recurrence: three separately normalised orders (eq. 4.14-4.17).

* :func:`orders_causal` (``chunk.py``): training, prefill and decoding (called with the carried
  state ``(s0, s1, z1, s2, z2)`` and the position ``offset`` on the new tokens);
  :func:`orders_bidirectional`: encoders;
* :func:`orders_recurrent` (``recurrent.py``) and :func:`naive_orders` (``naive.py``): test oracles;
  :func:`orders_maps` (``naive.py``): the three normalised maps (the indicators' maps)."""

from megahash.ops.orders.chunk import orders_bidirectional, orders_causal
from megahash.ops.orders.naive import naive_orders, orders_maps
from megahash.ops.orders.recurrent import orders_recurrent

__all__ = ["naive_orders", "orders_bidirectional", "orders_causal", "orders_maps", "orders_recurrent"]
