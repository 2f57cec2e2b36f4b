"""Counting ATen operator calls (what a GPU pays one kernel launch or more for) with a
``TorchDispatchMode``: forward and the autograd engine's backward (its threads inherit the mode).

A step whose count grows with the sequence length runs a Python loop over it
(``benchmarks/bench_kinds_cpu.py``, ``tests/ops/test_ops.py``)."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """``with CountOps() as c: ...`` then ``c.calls`` (Counter of operator names) and ``c.total()``."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.calls.values())
