"""Checkpoint files, read and written: the layer beneath training, evaluation and conversion.

- ``layout``: the names in a checkpoint folder, its state file;
- ``manifest``: the manifest of every file and the check that a checkpoint is intact;
- ``digest``: the sha256 of checkpoint files, hashed by the ranks that wrote them;
- ``resolve``: which checkpoint a path names (newest intact), the config saved with it;
- ``signature``: what must match for a checkpoint to load into a model;
- ``weights``: model weights as a megatron-core dist checkpoint (any TP size), ``load_for_inference``;
- ``optimizer_state``: Adam's state sharded like the weights (any TP, DP size and ZeRO stage);
- ``artifact``: quantized weight artifacts; ``rng``: each rank's RNG states;
- ``safe_unpickle``: dist checkpoints loaded without running code (an exact allow-list for ``.metadata``);
- ``deepspeed_files``: DeepSpeed's files loaded weights-only on resume; ``origin``: whether this install
  wrote a checkpoint (an HMAC of its manifest and pickles; docs/security.md).

The training loop's save and resume (collectives, failures, the DeepSpeed engine) is
megahash/training/checkpoint.py; it and ``megahash eval``/``export-hf``/``import-hf`` use this package.
"""
