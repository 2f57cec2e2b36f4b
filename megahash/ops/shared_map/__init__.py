"""One softmax attention map shared by a whole batch ([Xue25] eq. 4.9-4.12).

* :func:`shared_softmax` (``parallel.py``: the whole map formed in the forward and recomputed in a
  flash-style backward, none kept): training, prefill and decoding (the new query rows against the
  fixed keys, the values cached), encoders with a key mask;
* :func:`naive_shared_softmax` (``naive.py``, autograd keeps the map): the test oracle, and the path
  :func:`shared_softmax` takes when training with attention dropout. There is no recurrent form."""

from megahash.ops.shared_map.naive import naive_shared_softmax
from megahash.ops.shared_map.parallel import shared_softmax

__all__ = ["naive_shared_softmax", "shared_softmax"]
