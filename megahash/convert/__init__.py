"""Hugging Face conversion of megahash checkpoints (issue 8).

- :mod:`megahash.convert.export`: ``megahash export-hf`` -> a folder with ``model.safetensors``,
  ``config.json`` (``auto_map``) and self-contained remote code assembled from the library's own
  torch-only code (:mod:`megahash.convert.remote_code`: ``configuration_megahash.py``,
  ``modeling_megahash.py``, ``hashing_megahash.py``, ``megahash_*.py``; torch + transformers + numpy only) for every embedding, attention kind and schedule, with ``generate()``;
  or a native ``Qwen2ForCausalLM`` (:mod:`megahash.convert.qwen2`) for standard-attention decoders.
- :mod:`megahash.convert.importer`: ``megahash import-hf`` -> a weights-only megahash checkpoint
  that ``train.resume=auto`` continues.
- :mod:`megahash.convert.tokenizer`: ``tokenizer.json`` equal to the run's sentencepiece model or
  word table (AutoTokenizer, no remote code).
- :mod:`megahash.convert.verify`: reference logits / greedy decoding on the megahash side.

Details: docs/convert.md.
"""
