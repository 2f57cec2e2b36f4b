"""Muon's optimizer state and work sharded over the data-parallel ranks: ``train.optimizer=muon`` at
``train.zero_stage`` 1 or 2 with several data-parallel ranks (docs/compact_models.md, Layouts; the design and why:
megahash/training/muon.py). :class:`DataParallelShards` is one rank's part:

- every Muon matrix is owned whole by one data-parallel rank (:func:`assign`): its owner keeps its momentum and
  runs its Newton-Schulz iteration (with the tensor-parallel gather of ``muon._orthogonalize``); the other ranks
  hold neither;
- every AdamW group is one flat sequence of its parameters (in the group's order) cut into equal contiguous
  partitions, one a rank, as DeepSpeed's ZeRO-1 cuts its flat groups: rank r steps the elements
  [r S, (r + 1) S) with ``torch.optim.AdamW`` on views of them (:meth:`adam_groups`) and keeps only their
  moments. AdamW is elementwise, so a partition steps as the whole tensor would;
- after the step :meth:`gather` brings every rank's updated elements to every rank: one all-gather over the
  data-parallel group of equal-sized buffers (a rank's Muon matrices, padded to the largest rank's, then its
  AdamW partitions).

The gradients arrive all-reduced (DeepSpeed's ZeRO-0 path: clipping and the gradient norm as without sharding),
so an owner steps its tensors exactly as one rank stepping all of them would.

:func:`assign` is longest-processing-time-first list scheduling [Graham69]: the matrices sorted by size, largest
first (ties by name), each to the rank with the fewest Muon elements so far (ties: the lowest rank). It reads
only names and (TP-local) sizes, the same on every rank of the data-parallel group and on its TP peers (which
therefore own the same matrices and gather them together), and is independent of the order of registration;
each rank's share is within 4/3 of the best possible [Graham69], and never above the ideal 1/DP share plus
the largest matrix.

The checkpoint accessors (megahash/checkpoint/optimizer_state.py) give each parameter's whole state, collective
over the data-parallel group: a matrix's momentum broadcast from its owner, an AdamW moment assembled from its
partitions (an all-reduce of zero-filled copies, as DeepSpeed's ``safe_get_full_optimizer_state`` does); written
back, each rank takes its own part.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from megahash.checkpoint.optimizer_state import as_param_shape, as_state_shape


def assign(sizes: dict[str, int], ranks: int) -> dict[str, int]:
    """Name -> owning rank of each matrix (module docstring: largest first, to the least-loaded rank)."""
    load = [0] * ranks
    out = {}
    for name, n in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        r = min(range(ranks), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += n
    return out


class _Piece:
    """Elements [a, b) of parameter ``p`` (flattened) that this rank steps with AdamW, and their state."""

    __slots__ = ("p", "a", "b", "state")

    def __init__(self, p: torch.Tensor, a: int, b: int):
        self.p, self.a, self.b, self.state = p, a, b, {}

    def view(self) -> torch.Tensor:
        return self.p.detach().view(-1)[self.a : self.b]


class DataParallelShards:
    """This rank's matrices and AdamW partitions (module docstring). ``matrices``: Muon's matrices by name;
    ``adam_groups``: the parameters of each AdamW group, in the group's order; ``group``: the data-parallel
    process group."""

    def __init__(self, matrices: dict[str, torch.Tensor], adam_groups: list[list[torch.Tensor]], group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        tensors = [*matrices.values(), *(p for ps in adam_groups for p in ps)]
        dtypes = {p.dtype for p in tensors}
        if len(dtypes) > 1:  # one all-gather buffer (megahash refuses Muon over bf16 parameters)
            raise ValueError(f"sharded Muon needs parameters of one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.device = tensors[0].device if tensors else torch.device("cpu")
        owners = assign({n: p.numel() for n, p in matrices.items()}, self.size)
        self.owner = {id(p): owners[n] for n, p in matrices.items()}
        self.matrices = [[p for n, p in sorted(matrices.items()) if owners[n] == r] for r in range(self.size)]
        self._muon_len = max((sum(p.numel() for p in ps) for ps in self.matrices), default=0)
        self.adam = [list(ps) for ps in adam_groups]
        self.partition = [math.ceil(sum(p.numel() for p in ps) / self.size) for ps in self.adam]
        self.pieces = [self._pieces_of_rank(ps, s, self.rank) for ps, s in zip(self.adam, self.partition)]
        self._by_param = defaultdict(list)
        for pieces in self.pieces:
            for pc in pieces:
                self._by_param[id(pc.p)].append(pc)

    @staticmethod
    def _pieces_of_rank(params: list[torch.Tensor], part: int, rank: int) -> list[_Piece]:
        lo, hi, out, offset = rank * part, (rank + 1) * part, [], 0
        for p in params:
            a, b = max(lo, offset) - offset, min(hi, offset + p.numel()) - offset
            if a < b:
                out.append(_Piece(p, a, b))
            offset += p.numel()
        return out

    # ------------------------------------------------------------------------------------------ the step

    def owns(self, p: torch.Tensor) -> bool:
        """This rank steps Muon matrix ``p`` (keeps its momentum, runs its Newton-Schulz)."""
        return self.owner.get(id(p)) == self.rank

    def adam_groups(self, groups: list[dict]) -> tuple[list[dict], dict]:
        """AdamW's ``groups`` (their hyper-parameters as the schedule set them) over this rank's partitions:
        views of the parameters' elements, stepped in place, with their gradients' elements; and the state of
        each view (the pieces' own, so it persists across steps). A parameter without a gradient is left
        out, as ``torch.optim.AdamW`` leaves it."""
        out, state = [], defaultdict(dict)
        for g, pieces in zip(groups, self.pieces):
            views = []
            for pc in pieces:
                if pc.p.grad is None:
                    continue
                v = pc.view()
                v.grad = pc.p.grad.detach().reshape(-1)[pc.a : pc.b]
                state[v] = pc.state
                views.append(v)
            out.append({**g, "params": views})
        return out, state

    @torch.no_grad()
    def gather(self) -> None:
        """Collective: every rank's updated matrices and AdamW partitions to every rank (one all-gather)."""
        if self.size == 1:
            return
        own = [p.detach().reshape(-1) for p in self.matrices[self.rank]]
        parts = []
        for pieces, part in zip(self.pieces, self.partition):
            parts += [pc.view() for pc in pieces]
            parts.append(self._zeros(part - sum(pc.b - pc.a for pc in pieces)))
        local = torch.cat([*own, self._zeros(self._muon_len - sum(t.numel() for t in own)), *parts])
        outs = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(outs, local, group=self.group)
        for r, buf in enumerate(outs):
            if r == self.rank:
                continue
            offset = 0
            for p in self.matrices[r]:
                p.copy_(buf[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        start = self._muon_len
        for params, part in zip(self.adam, self.partition):
            flat = torch.cat([buf[start : start + part] for buf in outs])
            offset = 0
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            start += part

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------------ checkpoints (optimizer_state)

    def slots(self, state: dict, groups: list[dict]):
        """(tensor, its state dict, its group) of every state this rank keeps: its matrices' (in ``state``, the
        optimizer's) and its AdamW pieces'. ``groups``: the optimizer's groups, AdamW's first (muon.MuonAdamW)."""
        muon = next((g for g in groups if g.get("use_muon")), None)
        adam = [g for g in groups if not g.get("use_muon")]
        for p in self.matrices[self.rank]:
            yield p, state[p], muon
        for g, pieces in zip(adam, self.pieces):
            for pc in pieces:
                yield pc.view(), pc.state, g

    def full_state(self, p: torch.Tensor, key: str, state: dict) -> torch.Tensor:
        """Collective: parameter ``p``'s whole state ``key`` on every rank (from its owner, or its partitions)."""
        if id(p) in self.owner:
            mine = self.owns(p)
            if mine:  # a smaller state (NorMuon's row moments) broadcast to p's shape, as a checkpoint holds it
                t = as_param_shape(state[p][key].detach().float(), p.shape).clone(memory_format=torch.contiguous_format)
            else:
                t = torch.empty_like(p, dtype=torch.float32)
            dist.broadcast(t, src=dist.get_global_rank(self.group, self.owner[id(p)]), group=self.group)
            return t
        full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        for pc in self._by_param.get(id(p), ()):
            full[pc.a : pc.b] = pc.state[key]
        dist.all_reduce(full, group=self.group)  # each element from one rank, zeros from the others
        return full.view_as(p)

    def set_full_state(self, p: torch.Tensor, key: str, value: torch.Tensor, state: dict) -> None:
        """Write this rank's part of parameter ``p``'s whole state ``key`` (after :meth:`slots` filled it)."""
        if id(p) in self.owner:
            if self.owns(p):
                st = state[p][key]
                st.copy_(as_state_shape(value.to(st.device, st.dtype).reshape(p.shape), st))
            return
        flat = value.reshape(-1)
        for pc in self._by_param.get(id(p), ()):
            st = pc.state[key]
            st.copy_(flat[pc.a : pc.b].to(st.device, st.dtype))

    def adam_counts(self, params: list[torch.Tensor]) -> list[int]:
        """Collective: AdamW's step count of each of ``params`` (0: no state, or a Muon matrix), from the rank
        that holds it (every piece of a parameter has the same count: it has a gradient or not)."""
        counts = [0.0] * len(params)
        for i, p in enumerate(params):
            for pc in self._by_param.get(id(p), ()):
                if "step" in pc.state:
                    counts[i] = float(pc.state["step"])
        t = torch.tensor(counts, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(c) for c in t.tolist()]

    def pieces_of(self, p: torch.Tensor) -> list:
        """This rank's AdamW pieces of ``p`` (their ``state`` dicts)."""
        return self._by_param.get(id(p), [])

    # -------------------------------------------------------------------------------- measurement (benchmarks)

    def state_numel(self, state: dict) -> int:
        """Elements of optimizer state this rank holds (its matrices' momentum, its pieces' AdamW moments)."""
        held = [state.get(p, {}) for p in self.matrices[self.rank]] + [pc.state for ps in self.pieces for pc in ps]
        return sum(t.numel() for st in held for t in st.values() if torch.is_tensor(t) and t.ndim)
