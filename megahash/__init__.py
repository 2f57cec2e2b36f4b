"""megahash: pretraining compact transformer LMs with hash embeddings and efficient attention."""

from megahash import lazy_fusers as _lazy_fusers

__version__ = "0.1.0"

_lazy_fusers.install()  # megatron-core's fused functions compiled on first call (start-up time)
