"""Attention kinds. Each is one module plus one registry line (megahash.models.registry)."""
