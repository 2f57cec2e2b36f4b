"""Experiments that run many models as one unit: ``megahash sweep`` (grids of configs, the
[Xue25] comparison tables) and ``megahash diagnose`` (synthetic recall tasks per attention kind)."""
