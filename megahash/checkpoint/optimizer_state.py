"""Adam's state independent of TP size, data-parallel size and ZeRO stage: a second megatron-core
dist checkpoint in every checkpoint (``step_N/optimizer/``), sharded exactly like the weights.

DeepSpeed's own optimizer files hold each rank's ZeRO partition of flat fp32 buffers, laid out for
one TP size, DP size and stage. Here every TP-local parameter's *full* (un-ZeRO'd) state is gathered
with DeepSpeed's ``safe_get_full_optimizer_state`` / ``safe_get_full_fp32_param`` (collective over
the data-parallel group; ZeRO-0 in fp32 runs the plain torch optimizer, whose state already is
per parameter) and wrapped with megatron-core's ``make_sharded_optimizer_tensor`` around the
parameter's own ``ShardedTensor`` (or ``ShardedTensorFactory``: the interleaved SwiGLU ``fc1``), so
megatron's dist checkpointing knows where each TP shard lives in the full tensor, as for the weights
in ``model/`` (megahash/checkpoint/weights.py). Saved per parameter:

- ``exp_avg``, ``exp_avg_sq`` (Adam's moments; ``max_exp_avg_sq`` with amsgrad),
- ``fp32``: the fp32 master copy, only where the trained weights are not fp32 (bf16: the masters
  differ from the weights; in fp32 they are the weights),

and in ``megahash_optimizer.json`` Adam's step count (bias correction) of every parameter by name,
``null`` where it has no state: a parameter that never received a gradient (an unused head, a
kind's parameter outside the loss) is never stepped by the torch optimizer of ZeRO-0 fp32, whose
counts are per parameter; DeepSpeed's flat optimizers step every group at every step, so all their
parameters share one count. (Layers dropped by ``model.attention.skip_nonstandard`` are frozen and
are in no optimizer at all.) The moments are written under one key per layer (``decoder.layers.N``),
so layers without trainable parameters leave no holes in megatron's stacked keys. At a resume on another
layout (megahash/training/elastic.py) the same sharded dict is built for the new TP shape, loaded
(any TP size; data only, never unpickling code), and written into this run's partitions with
``safe_set_full_optimizer_state`` (ZeRO-1/2, bf16 optimizer), the local-partition setters under
ZeRO-3 (DeepSpeed's full-tensor setter does not handle a padded last partition), the torch
optimizer's state at ZeRO-0 in fp32 (each parameter at its own count; none where none was saved),
or the fp32 masters of DeepSpeed's FP16 optimizers (ZeRO-0 in bf16); a flat optimizer takes the
highest saved count. The LR schedule is put at the saved step by the caller. Muon sharded over the data-parallel
ranks (train.optimizer=muon at ZeRO-1/2: megahash/training/muon_sharded.py) keeps each parameter's state on its
owner (a matrix) or in flat partitions (AdamW): its own accessors give the whole state on every rank and write
back each rank's part, and DeepSpeed's files, which would hold the first rank's shard only, are not written
(:func:`native_files`).

The cost of a save is one gather of the state per parameter (all-reduce/all-gather over DP) and one
dist-checkpoint write of twice the model's fp32 size, by the first data-parallel rank of each shard.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from megahash.accelerator import process_groups
from megahash.atomic_write import write_json_atomic
from megahash.errors import CheckpointError

OPTIM_DIR = "optimizer"
INFO_FILE = "megahash_optimizer.json"
FORMAT = 1
MOMENTS = ("exp_avg", "exp_avg_sq")
MASTER = "fp32"


def torch_optimizer(engine):
    """The torch optimizer inside DeepSpeed's wrapper (ZeRO, bf16), or the engine's own at ZeRO-0 fp32."""
    opt = engine.optimizer
    return opt.optimizer if hasattr(opt, "optimizer") and isinstance(opt.optimizer, torch.optim.Optimizer) else opt


def _flat_slices(engine) -> dict | None:
    """The fp32 masters of DeepSpeed's FP16 optimizers (bf16 at ZeRO-0 with bf16 gradient
    accumulation): FP16_UnfusedOptimizer keeps one fp32 copy per parameter, FP16_Optimizer one flat
    fp32 master per group, the group's parameters back to back (``_flatten_dense_tensors``, no
    padding): id(parameter) -> (master, offset of the parameter in it). None for other optimizers."""
    opt = engine.optimizer
    if type(opt).__name__ == "FP16_UnfusedOptimizer" and hasattr(opt, "fp32_groups"):
        return {
            id(p): (m, 0)
            for g16, g32 in zip(opt.fp16_groups, opt.fp32_groups)
            for p, m in zip(g16, g32)
            if m.numel() == p.numel()
        }
    if type(opt).__name__ != "FP16_Optimizer" or not hasattr(opt, "fp32_groups_flat"):
        return None
    out = {}
    for group, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
        offset = 0
        for p in group:
            out[id(p)] = (flat, offset)
            offset += p.numel()
        if offset != flat.numel():
            return None
    return out


def unsupported(engine) -> str | None:
    """Why this engine's optimizer state cannot be written per parameter (None: it can)."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    if any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in params):
        return None  # ZeRO-1/2/3 and DeepSpeed's bf16 optimizer: DeepSpeed's full-state accessors
    inner = torch_optimizer(engine)
    if inner is engine.optimizer and all(p.dtype == torch.float32 for p in params):
        return None  # the torch optimizer itself on fp32 parameters (ZeRO-0 in fp32)
    flat = _flat_slices(engine)
    if flat is not None and all(id(p) in flat for p in params):
        return None  # flat fp32 masters per group (ZeRO-0 in bf16)
    return (
        f"DeepSpeed's {type(engine.optimizer).__name__} (ZeRO stage {engine.zero_optimization_stage()}, "
        f"{'bf16' if engine.bfloat16_enabled() else 'fp16' if engine.fp16_enabled() else 'fp32'}) keeps its "
        f"state in flat buffers megahash cannot address per parameter"
    )


def _shards(engine):
    """The data-parallel layout of a sharded optimizer (train.optimizer=muon at ZeRO-1/2:
    megahash/training/muon_sharded.py), whose state of a parameter lives on its owners; None otherwise."""
    return getattr(torch_optimizer(engine), "shards", None)


def native_files(engine) -> bool:
    """DeepSpeed's own checkpoint files can hold this engine's optimizer state: not for a sharded optimizer,
    whose state DeepSpeed's ZeRO-0 files would take from the first data-parallel rank only (its shard); its
    checkpoints resume through ``optimizer/`` at every layout (megahash/training/checkpoint.py)."""
    return _shards(engine) is None


def _keys_of(engine, p, keys: list[str]) -> list[str]:
    """The state keys of parameter ``p``: ``keys`` (Adam's), or the optimizer's own for it (Muon's momentum
    under train.optimizer=muon: megahash/training/muon.py)."""
    own = getattr(torch_optimizer(engine), "state_keys_of", None)
    return own(p, keys) if own is not None else keys


def _stateless_adam(engine, p) -> bool:
    """``p`` is stepped without Adam's state and count (a Muon matrix)."""
    return _keys_of(engine, p, list(MOMENTS)) != list(MOMENTS)


def _state_keys(engine) -> list[str]:
    inner = torch_optimizer(engine)
    keys = list(MOMENTS)
    if any(g.get("amsgrad") for g in inner.param_groups):
        keys.append("max_exp_avg_sq")
    if any(p.dtype != torch.float32 for p in engine.module.parameters() if p.requires_grad):
        keys.append(MASTER)
    return keys


def ensure_state(engine) -> None:
    """Create Adam's state where torch has not yet (it does so at the first step): zero moments,
    step 0, exactly what torch would create, and let DeepSpeed link its per-parameter views of it."""
    inner = torch_optimizer(engine)
    shards = _shards(engine)
    if shards is not None:  # the state this rank keeps: its matrices' and its AdamW partitions'
        for p, st, group in shards.slots(inner.state, inner.param_groups):
            _fill(st, p, group, inner)
        return
    targets = [(p, group) for group in inner.param_groups for p in group["params"]]
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flats is not None:  # ZeRO-3 hands its flat fp32 sub-groups to the torch optimizer only while stepping
        to_group = engine.optimizer.sub_group_to_group_id
        targets += [(flat, inner.param_groups[to_group[i]]) for i, flat in enumerate(flats)]
    for p, group in targets:
        _fill(inner.state[p], p, group, inner)
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # ZeRO-1/2, bf16 optimizer: views of the flat state per parameter. Linked
        # again: DeepSpeed links every group after stepping the first one, so with two parameter
        # groups (decay, no decay) the second group's views stay empty
        engine.optimizer._hp_optimizer_states_linked = False
        link()


def _fill(st: dict, p: torch.Tensor, group: dict, inner) -> None:
    """The state torch creates at ``p``'s first step, unless ``st`` has some: Muon's (its optimizer's
    ``fresh_state``: the momentum, NorMuon's row moments), or Adam's."""
    if st:
        return
    if group.get("use_muon"):  # created at the first step, as torch.optim.Muon creates its buffer
        st.update(inner.fresh_state(p, group))
        return
    on_device = bool(group.get("fused") or group.get("capturable"))
    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if group.get("amsgrad"):
        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def per_parameter(engine) -> bool:
    """True when the torch optimizer itself runs on the parameters (ZeRO-0 in fp32): its state, and
    Adam's step count, are per parameter, and a parameter without a gradient has none."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    return (
        torch_optimizer(engine) is engine.optimizer
        and _flat_slices(engine) is None
        and not any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in params)
    )


def _count(st) -> int | None:
    """Adam's step count of one state entry; None without state (step 0: what torch creates unstepped)."""
    n = int(float(st["step"])) if st and "step" in st else 0
    return n or None


def adam_steps(engine, params) -> list[int | None]:
    """Adam's step count of each of ``params`` (None: no state). Per parameter at ZeRO-0 fp32; DeepSpeed's
    flat optimizers step every group at every step (zeros for a parameter without a gradient), so
    every parameter has their count."""
    inner = torch_optimizer(engine)
    if _shards(engine) is not None:  # from the rank holding each (collective)
        return [n or None for n in _shards(engine).adam_counts(params)]
    if per_parameter(engine):
        return [_count(inner.state.get(p)) for p in params]
    counts = {_count(st) for st in inner.state.values()} - {None}
    common = max(counts) if counts else None
    return [common] * len(params)


def _set_steps(engine, params, steps: list[int | None]) -> None:
    """Put every parameter at its saved count: per parameter (dropping the state of one saved without
    any), or, for flat optimizers, every group at the highest count."""
    inner = torch_optimizer(engine)
    shards = _shards(engine)
    if shards is not None:  # this rank's AdamW pieces of each, as torch's per-parameter state below
        for p, n in zip(params, steps):
            for pc in shards.pieces_of(p):
                if n is None:
                    pc.state.clear()
                else:
                    _fill_step(pc.state, n)
        return
    if per_parameter(engine):
        for p, n in zip(params, steps):
            if _stateless_adam(engine, p):
                continue
            if n is None:
                inner.state.pop(p, None)
            else:
                _fill_step(inner.state[p], n)
        return
    common = max((n for n in steps if n is not None), default=0)
    for st in inner.state.values():
        _fill_step(st, common)


def _fill_step(st: dict, n: int) -> None:
    if torch.is_tensor(st.get("step")):
        st["step"].fill_(float(n))
    elif "step" in st:
        st["step"] = n


PER_LAYER = {"non_homogeneous_layers": True}


def _sharded_params(engine, zero_stage: int, metadata):
    """[(parameter, its ShardedTensor or ShardedTensorFactory, TP-local shape)] of every trained
    parameter, from the model's ``sharded_state_dict(metadata=metadata)`` (built with ZeRO-3
    parameters gathered)."""
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    from megahash.checkpoint.weights import gathered

    model = engine.module
    params = [p for p in model.parameters() if p.requires_grad]
    with gathered(model, zero_stage):  # a copy: megatron adds this run's dp_cp_group to the dict it is given
        sd = model.sharded_state_dict(metadata=dict(metadata))
        shapes = [tuple(p.shape) for p in params]
    by_index = get_param_id_to_sharded_param_map(sd, params)
    names = {id(p): n for n, p in model.named_parameters()}
    lacking = [names.get(id(p), "?") for i, p in enumerate(params) if i not in by_index]
    if lacking:
        raise CheckpointError(f"parameters {lacking[:3]} have no entry in the model's sharded_state_dict")
    return [(p, by_index[i], shapes[i]) for i, p in enumerate(params)]


def as_param_shape(state: torch.Tensor, shape) -> torch.Tensor:
    """A state tensor in its parameter's ``shape``, as a checkpoint holds it: reshaped, or broadcast where it is
    kept smaller (NorMuon's per-row moment [rows, 1] of a matrix: every column the same), so it is sharded over
    TP and data-parallel ranks as the parameter is."""
    if state.numel() == math.prod(shape):
        return state.reshape(shape)
    return state.expand(shape)


def as_state_shape(value: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`as_param_shape` for ``state``'s shape: the first columns of a broadcast value."""
    if value.numel() == state.numel():
        return value.reshape(state.shape)
    return value[..., : state.shape[-1]].reshape(state.shape)


def _get(engine, p, key: str, shape) -> torch.Tensor:
    """The full TP-local state ``key`` of parameter ``p`` (collective over DP under ZeRO)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
        t = safe_get_full_fp32_param(p) if key == MASTER else safe_get_full_optimizer_state(p, key)
        return t.detach().float().reshape(shape).cpu()
    if _shards(engine) is not None and key != MASTER:  # from its owner or its partitions (collective)
        return _shards(engine).full_state(p, key, torch_optimizer(engine).state).float().reshape(shape).cpu()
    view = _flat_view(engine, p, key)
    if view is not None:
        return view.detach().float().reshape(shape).cpu()
    if key == MASTER:
        return p.detach().float().reshape(shape).cpu()
    return as_param_shape(torch_optimizer(engine).state[p][key].detach().float(), shape).cpu()


def _flat_view(engine, p, key: str) -> torch.Tensor | None:
    """``p``'s slice of a flat fp32 master (or of its state ``key``) under FP16_Optimizer; else None."""
    flat = _flat_slices(engine)
    if flat is None or id(p) not in flat:
        return None
    master, offset = flat[id(p)]
    src = master if key == MASTER else torch_optimizer(engine).state[master][key]
    return src.view(-1).narrow(0, offset, p.numel())


def _set(engine, p, key: str, value: torch.Tensor) -> None:
    """Write the full TP-local ``value`` of state ``key`` into this rank's partition of ``p``."""
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    if hasattr(p, "ds_id"):  # ZeRO-3: this rank's slice of the flattened tensor, zero-padded at the end
        opt = p._z3_optimizer
        rank, size = opt._get_param_partition_rank(p), p.partition_numel()
        flat = value.reshape(-1)
        local = torch.zeros(size, dtype=torch.float32)
        piece = flat[rank * size : (rank + 1) * size]
        local[: piece.numel()] = piece
        local = local.to(p.ds_tensor.device)
        safe_set_local_fp32_param(p, local) if key == MASTER else safe_set_local_optimizer_state(p, local, key)
    elif hasattr(p, "_hp_mapping"):
        v = value.to(p.device)
        safe_set_full_fp32_param(p, v) if key == MASTER else safe_set_full_optimizer_state(p, v, key)
    elif _shards(engine) is not None and key != MASTER:  # this rank's part of it
        _shards(engine).set_full_state(p, key, value, torch_optimizer(engine).state)
    elif _flat_view(engine, p, key) is not None:
        view = _flat_view(engine, p, key)
        view.data.copy_(value.reshape(-1).to(view.device, view.dtype))
    elif key == MASTER:
        with torch.no_grad():
            p.copy_(value.to(p.device, p.dtype))
    else:
        st = torch_optimizer(engine).state[p][key]
        st.copy_(as_state_shape(value.to(st.device, st.dtype).reshape(p.shape), st))


def _write_info(directory: Path, info: dict) -> None:
    if process_groups.rank() == 0:
        write_json_atomic(directory / INFO_FILE, info)


def save(engine, directory: Path, zero_stage: int, async_queue=None) -> None:
    """Collective: write this engine's optimizer state to ``directory`` (module docstring; with an
    ``async_queue`` the tensor write is scheduled there, weights.dist_save). An optimizer that cannot
    be addressed per parameter writes only the reason, which a resume at another layout reports in
    its one-line refusal."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    from megahash.checkpoint.weights import dist_save

    directory = Path(directory)
    why = unsupported(engine)
    if why is not None:
        if process_groups.rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
        _write_info(directory, {"format": FORMAT, "complete": False, "reason": why})
        return
    params = _sharded_params(engine, zero_stage, PER_LAYER)
    names = _names(engine)
    steps = adam_steps(engine, [p for p, _, _ in params])  # before ensure_state creates empty entries
    ensure_state(engine)
    keys = _state_keys(engine)
    sharded = {}
    for i, (p, sh, shape) in enumerate(params):
        for key in _keys_of(engine, p, keys):  # (indexed by parameter; a parameter without state writes zeros)
            sharded[f"{key}.{i}"] = make_sharded_optimizer_tensor(sh, _get(engine, p, key, shape), prefix=key)
    directory.mkdir(parents=True, exist_ok=True)
    dist_save(sharded, directory, async_queue)
    _write_info(
        directory,
        {
            "format": FORMAT,
            "complete": True,
            "keys": keys,
            "adam_step": max((n for n in steps if n is not None), default=0),
            "param_steps": {names[id(p)]: n for (p, _, _), n in zip(params, steps)},
            "layers": "per_layer",
            "saved_zero_stage": engine.zero_optimization_stage(),
        },
    )


def _names(engine) -> dict:
    return {id(p): n for n, p in engine.module.named_parameters()}


def read_info(directory: Path) -> dict:
    """The optimizer state's description; ``complete`` false with a ``reason`` when there is none."""
    from megahash.checkpoint.layout import read_json

    try:
        info = read_json(Path(directory) / INFO_FILE)
    except FileNotFoundError:
        return {"complete": False, "reason": f"it has no {OPTIM_DIR}/{INFO_FILE} (saved by an older megahash)"}
    except (OSError, ValueError) as e:
        return {"complete": False, "reason": f"its {OPTIM_DIR}/{INFO_FILE} is unreadable ({type(e).__name__})"}
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        return {"complete": False, "reason": f"its {OPTIM_DIR}/{INFO_FILE} has an unknown format"}
    if info.get("complete") and not info.get("keys"):
        return {"complete": False, "reason": f"its {OPTIM_DIR}/{INFO_FILE} lists no state"}
    return info


def load(engine, directory: Path, zero_stage: int) -> int:
    """Collective: load the optimizer state in ``directory`` into this engine, at this run's TP size,
    DP size and ZeRO stage (the weights are already loaded). Returns Adam's step count."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    from megahash.checkpoint.safe_unpickle import no_code_unpickling, refusal
    from megahash.checkpoint.weights import error_line

    directory = Path(directory)
    info = read_info(directory)
    if not info.get("complete"):
        raise CheckpointError(f"checkpoint {directory.parent} holds no movable optimizer state: {info['reason']}")
    why = unsupported(engine)
    if why is not None:
        raise CheckpointError(
            f"this run's optimizer cannot take the optimizer state of {directory.parent}: {why}; "
            f"resume at the saved layout, or with train.resume_weights_only=true (docs/resume.md)"
        )
    # fp32 masters of a bf16 run go into a bf16 run's masters; a fp32 run takes the weights of model/
    keys = [k for k in info["keys"] if k != MASTER or MASTER in _state_keys(engine)]
    from megahash.checkpoint.weights import sharded_metadata  # older checkpoints: the weights' layer layout

    params = _sharded_params(
        engine, zero_stage, PER_LAYER if info.get("layers") == "per_layer" else sharded_metadata(engine.module)
    )
    template = {}
    for i, (p, sh, shape) in enumerate(params):
        for key in _keys_of(engine, p, keys):
            template[f"{key}.{i}"] = make_sharded_optimizer_tensor(
                sh, torch.zeros(shape, dtype=torch.float32), prefix=key
            )
    try:
        from megahash.known_warnings import DIST_CHECKPOINT_LOAD, silenced

        with no_code_unpickling(), silenced(DIST_CHECKPOINT_LOAD):  # data only: never run code from a checkpoint file
            loaded = dist_checkpointing.load(template, str(directory))
    except (KeyboardInterrupt, SystemExit, CheckpointError):
        raise
    except BaseException as e:  # megatron/torch raise several kinds
        if refusal(e) is not None:  # a file asked to run code: that is the one line
            raise refusal(e) from None
        raise CheckpointError(
            f"the optimizer state in {directory} does not fit this model ({error_line(e)}); "
            f"resume with train.resume_weights_only=true (docs/resume.md)"
        ) from None
    ensure_state(engine)
    for i, (p, _sh, _shape) in enumerate(params):
        for key in _keys_of(engine, p, keys):
            _set(engine, p, key, loaded[f"{key}.{i}"])
    step = int(info.get("adam_step", 0))
    saved = info.get("param_steps")  # older checkpoints: one count for every parameter
    names = _names(engine)
    _set_steps(
        engine,
        [p for p, _, _ in params],
        [saved.get(names[id(p)]) if saved is not None else step for p, _, _ in params],
    )
    return step
