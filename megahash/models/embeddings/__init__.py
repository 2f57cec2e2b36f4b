"""Token embedding kinds. Each returns [s, b, h] (scattered over TP ranks under sequence parallelism)."""
