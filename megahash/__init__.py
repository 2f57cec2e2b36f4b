"""megahash: pretraining compact transformer LMs with hash embeddings and efficient attention."""
__version__ = "0.1.0"
