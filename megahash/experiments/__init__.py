"""Experiments that run many models as one unit: ``megahash sweep`` (grids of configs, the
thesis's comparison tables) and ``megahash diagnose`` (synthetic recall tasks per attention kind)."""
