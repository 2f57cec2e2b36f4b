"""Causal softmax with one score per key ([Xue25] eq. 4.7-4.8, 4.18) as a scan."""
