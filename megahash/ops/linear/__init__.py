"""Causal linear attention with a feature map (chunked, recurrent and naive forms)."""
