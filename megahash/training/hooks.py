"""The protocol of the training loop's features: one :class:`Hook` per feature, called at fixed points.

A training feature is one module of ``megahash/training/`` named in :data:`FEATURES`. It may declare

- ``Config``: a dataclass, its section ``train.<module>`` of the config tree (read from the source, without
  importing the module: megahash/feature_configs.py);
- ``hook(run) -> Hook | None``: its hook for a run set up to its engine (``run.cfg``, ``run.engine``,
  ``run.data``, ``run.rank``), or None where the config leaves it off.

The trainer (megahash/training/trainer.py) builds the hooks once the engine exists (:func:`build`, in
:data:`FEATURES` order) and calls them at these points of a run, every hook in list order (``close`` in
reverse, as a stack unwinds); every method is optional:

=========================  ====================================================================================
``start(run)``             the run is set up (logs, batches, progress meter): start threads, children, writers
``around_loop(run)``       a context around the whole loop (an error in it may become another exit)
``around_step(run)``       a context around one step (profiling, an out-of-memory dump)
``before_step(run)``       before the micro-batches of step ``run.step + 1``
``micro_batch(run)``       a context around each micro-batch's forward and backward
``after_step(run)``        the optimizer step was taken (or refused), before it counts (``run.step`` unchanged)
``step_metrics(run, m)``   the step counts (``run.step``); add to its metrics ``m``; may raise (it is logged)
``end_step(run)``          the step is logged, before its checkpoint: validation
``valid_metrics(run, f)``  more metrics of a validation set: ``f()`` evaluates it (e.g. with other weights)
``after_save(run)``        after each step's checkpoint (or none): evaluations
``state_dict()``           JSON-able state kept in a checkpoint's state file under the hook's ``name``
``load_state_dict(s)``     ... given back on resume (absent from an older checkpoint: not called)
``save_files(...)``        collective: folders of its own in a checkpoint being written (their names)
``load_files(run, ckpt)``  on resume: read them back
``close(run, status)``     the end: ``status`` the exit status, or None after an error; once
=========================  ====================================================================================

Checkpoints save and restore the hooks by iterating them (megahash/training/checkpoint.py,
megahash/training/async_save.py); no module names another feature. What patches DeepSpeed's engine is
megahash/training/engine_patches.py alone (the order of its wrappers matters). A new feature is one file
plus one line here (docs/architecture.md, *Worked example: add a training feature*).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from pathlib import Path

# the training features, in the order their hooks run; each a module of megahash/training/. Constraints: the
# step guard's after_step (a refused step stops the run) before the weight average's; the watchdog's end_step
# (the step's time) before validation's; at close (reverse order) the writer of asynchronous saves first and
# the watchdog before the evaluations' wait.
FEATURES = (
    "batch_ramp",
    "seq_warmup",
    "qat",
    "step_guard",
    "ema",
    "muon",
    "profile_steps",
    "eval_during",
    "watchdog",
    "valid_sets",
    "async_save",
)


class Hook:
    """One feature's part in a run (module docstring: when each method is called). All no-ops here. ``run``
    is the run's record (megahash.training.trainer.Run: config, engine, step, logs, hooks, saver)."""

    name: str = ""  # set by build(): the feature's module name (its state's key in a checkpoint)

    def start(self, run) -> None:
        pass

    def around_loop(self, run):
        return contextlib.nullcontext()

    def around_step(self, run):
        return contextlib.nullcontext()

    def before_step(self, run) -> None:
        pass

    def micro_batch(self, run):
        return contextlib.nullcontext()

    def after_step(self, run) -> None:
        pass

    def step_metrics(self, run, metrics: dict) -> None:
        pass

    def end_step(self, run) -> None:
        pass

    def valid_metrics(self, run, evaluate: Callable[[], dict]) -> dict:
        return {}

    def after_save(self, run) -> None:
        pass

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict) -> None:
        pass

    def save_files(self, engine, folder: Path, zero_stage: int, async_queue=None) -> list[str]:
        return []

    def load_files(self, run, ckpt: Path) -> None:
        pass

    def close(self, run, status: int | None) -> None:
        pass


class Hooks:
    """The hooks of one run, in :data:`FEATURES` order; each method calls every hook's."""

    def __init__(self, hooks: list[Hook]):
        self.hooks = list(hooks)

    def __iter__(self) -> Iterator[Hook]:
        return iter(self.hooks)

    def start(self, run) -> None:
        for h in self.hooks:
            h.start(run)

    @contextlib.contextmanager
    def _each(self, method: str, run):
        with contextlib.ExitStack() as stack:
            for h in self.hooks:
                stack.enter_context(getattr(h, method)(run))
            yield

    def around_loop(self, run):
        return self._each("around_loop", run)

    def around_step(self, run):
        return self._each("around_step", run)

    def micro_batch(self, run):
        return self._each("micro_batch", run)

    def before_step(self, run) -> None:
        for h in self.hooks:
            h.before_step(run)

    def after_step(self, run) -> None:
        for h in self.hooks:
            h.after_step(run)

    def step_metrics(self, run, metrics: dict) -> None:
        for h in self.hooks:
            h.step_metrics(run, metrics)

    def end_step(self, run) -> None:
        for h in self.hooks:
            h.end_step(run)

    def valid_metrics(self, run, evaluate) -> dict:
        out: dict = {}
        for h in self.hooks:
            out.update(h.valid_metrics(run, evaluate))
        return out

    def after_save(self, run) -> None:
        for h in self.hooks:
            h.after_save(run)

    def state_dicts(self) -> dict:
        """{hook name: state} of every hook that keeps state (a checkpoint's state file holds them)."""
        return {h.name: s for h in self.hooks if (s := h.state_dict()) is not None}

    def save_files(self, engine, folder, zero_stage: int, async_queue=None) -> list[str]:
        """Collective: every hook's folders into ``folder`` (a checkpoint being written); their names."""
        out = []
        for h in self.hooks:
            out += h.save_files(engine, folder, zero_stage, async_queue)
        return out

    def load(self, run, ckpt, state: dict) -> None:
        """On resume from ``ckpt`` (its state file ``state``): every hook's state and files."""
        for h in self.hooks:
            if h.name in state:
                h.load_state_dict(state[h.name])
            h.load_files(run, ckpt)

    def close(self, run, status: int | None) -> None:
        """Every hook's ``close``, in reverse order, once (later calls do nothing); an error in one does not
        keep the others from closing (the first is raised after)."""
        hooks, self.hooks = self.hooks, []
        error = None
        for h in reversed(hooks):
            try:
                h.close(run, status)
            except BaseException as e:  # the others are closed all the same; raised below
                error = error or e
        if error is not None:
            raise error


def feature_modules() -> list[str]:
    """The modules of the training features (:data:`FEATURES`, then ``MEGAHASH_FEATURES``: features outside
    the package, megahash/feature_configs.py)."""
    from megahash.feature_configs import feature_modules as modules

    return modules()


def build(run) -> Hooks:
    """The run's hooks: each feature module's ``hook(run)`` that is not None, in feature order."""
    out = []
    for module in feature_modules():
        mod = importlib.import_module(module)
        make = getattr(mod, "hook", None)
        h = make(run) if make is not None else None
        if h is not None:
            h.name = module.rsplit(".", 1)[-1]
            out.append(h)
    return Hooks(out)
