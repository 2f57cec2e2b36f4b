"""Configuration of megahash models in transformers (remote code written by ``megahash export-hf``).

The flat fields are what ``modeling_megahash.py`` builds the model from (one entry of
``layer_specs`` per layer: attention kind, key/value groups, whether `skip` mode drops it, the
gated-MLP width of ``mlp`` layers, the chunk size of the linear kinds); ``megahash_config`` is the
full resolved megahash config tree (``megahash import-hf`` rebuilds the training checkpoint from it).
"""

from __future__ import annotations

try:
    from transformers import PreTrainedConfig as _Base
except ImportError:  # transformers 4.x
    from transformers import PretrainedConfig as _Base


class MegahashConfig(_Base):
    model_type = "megahash"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        megahash_config=None,
        vocab_size=0,
        padded_vocab_size=0,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=None,
        intermediate_size=256,
        max_position_embeddings=2048,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        arch="decoder",
        objective=None,
        embedding=None,
        head=None,
        tie_embeddings=False,
        qkv_bias=True,
        layer_specs=None,
        embed=None,
        kind_inputs=None,
        hash_spec=None,
        code_width=0,
        num_buckets=0,
        megahash_step=0,
        tie_word_embeddings=False,
        **kwargs,
    ):
        self.megahash_config = megahash_config or {}
        self.vocab_size = vocab_size  # real vocabulary (tokenizer); logits have this width
        self.padded_vocab_size = padded_vocab_size or vocab_size  # rows of the (TP-padded) tables
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.norm_eps = norm_eps
        self.arch = arch
        self.objective = objective  # train.objective (written by the export; the head is ``head``)
        self.embedding = embedding  # kind names: written by the export (no default kind here)
        self.head = head
        self.tie_embeddings = tie_embeddings
        self.qkv_bias = qkv_bias
        self.layer_specs = layer_specs or []  # one {"kind", "groups", ...} per layer (written by the export)
        self.embed = embed or {}
        self.kind_inputs = (
            kind_inputs or {}
        )  # {model attribute: {"kind", ...}}: inputs the layer kinds add (export_meta)
        self.hash_spec = hash_spec
        self.code_width = code_width
        self.num_buckets = num_buckets
        self.megahash_step = megahash_step
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def kind_references(self) -> dict:
        """{kind name: plain-torch reference class} the model is built from. (In an export this is the
        folder's own table, so transformers' hash of this module covers the whole remote code: two
        exports with different kinds never share a cached config class, which transformers maps to
        the model class of the first one loaded.)"""
        from megahash.models.reference_table import references

        return references()
