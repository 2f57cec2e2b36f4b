"""A synchronous dist checkpoint save (megahash/checkpoint/weights.py ``dist_save``) writes in the calling
process: no writer process forked or spawned, and the files are megatron-core's own writer's, byte for byte."""

import multiprocessing
import os

import torch

_forks: list[int] = []
_counting = [False]
os.register_at_fork(before=lambda: _counting[0] and _forks.append(os.getpid()))


def _model():
    from conftest import TINY
    from megahash.config import load_config
    from megahash.models.megatron_model import MegahashLM

    torch.manual_seed(0)
    return MegahashLM(load_config(None, TINY), 128, torch.float32)


def test_a_synchronous_save_forks_nothing_and_writes_megatrons_files(tmp_path, dist):
    """``save_weights`` (no async queue) starts no process (megatron's ``FileSystemWriterAsync`` forks a
    writer per file and spawns a results manager), and its files are those of megatron-core's own
    ``dist_checkpointing.save``: the same names, the same bytes in every ``.distcp`` file, the same
    metadata; the weights load back bit for bit."""
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megahash.checkpoint.weights import load_weights, save_weights, sharded_metadata

    model = _model()
    _forks.clear()
    _counting[0] = True
    try:
        save_weights(model, tmp_path / "here")
    finally:
        _counting[0] = False
    assert _forks == [] and multiprocessing.active_children() == [], (_forks, multiprocessing.active_children())
    ours = tmp_path / "megatron"
    ours.mkdir()
    before, filesystem_async._results_queue = filesystem_async._results_queue, queue.Queue()  # no Manager
    try:  # megatron's own synchronous save: a forked writer per file
        dist_checkpointing.save(model.sharded_state_dict(metadata=sharded_metadata(model)), str(ours))
    finally:
        filesystem_async._results_queue = before
    here = sorted(p.name for p in (tmp_path / "here").iterdir())
    assert here == sorted(p.name for p in ours.iterdir()) and sum(n.endswith(".distcp") for n in here) == 2, here
    for name in here:
        if name.endswith(".distcp") or name == "metadata.json":
            assert (tmp_path / "here" / name).read_bytes() == (ours / name).read_bytes(), name
    reader = dist_checkpointing.strategies.torch._get_filesystem_reader
    a, b = reader(tmp_path / "here").read_metadata(), reader(ours).read_metadata()  # storage_meta: ids, path
    assert (a.state_dict_metadata, a.storage_data, a.planner_data) == (
        b.state_dict_metadata,
        b.storage_data,
        b.planner_data,
    )
    again = _model()
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    load_weights(again, tmp_path / "here")
    saved, loaded = model.state_dict(), again.state_dict()
    # bit-exact: a save and load round trip copies the bytes (no arithmetic)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved if torch.is_tensor(saved[k]))
