"""Model layer: megatron-core ModuleSpec registry, attention kinds, embeddings, heads."""
