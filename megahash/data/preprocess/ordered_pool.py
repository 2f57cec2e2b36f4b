"""Ordered, bounded process pool for the preprocessing passes.

``OrderedPool(n, init, args).map(fn, items)`` yields ``fn(item)`` in input order. Item ``i`` goes to
worker ``i mod n`` over that worker's own pipes, and each worker holds at most one task: the main
process sends a worker its next task only after taking its previous result, so a large result and
a large task can never block each other, and memory stays bounded (unlike ``Pool.imap``, which
drains its input). The next item is read before waiting, so workers idle only for a pipe round
trip. There are no locks shared between processes, so ``terminate`` (on errors, Ctrl-C, SIGTERM)
can kill the workers at any moment without hanging. ``n <= 1`` runs everything in-process.
``broadcast(fn)`` runs ``fn`` once in every worker (e.g. to collect per-worker totals at the end).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from megahash.errors import DataError

_STOP = None


def _noop() -> None:
    pass


def _worker(tasks, results, initializer: Callable, initargs: tuple, parent_pid: int | None = None) -> None:
    if parent_pid is not None:  # killed with the main process, even by SIGKILL (megahash/data/preprocess/publish.py)
        from megahash.data.preprocess.publish import die_with_parent

        die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the main process
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        initializer(*initargs)
    except BaseException as e:  # report at the first result
        err: BaseException | None = e
    else:
        err = None
    while True:
        try:
            msg = tasks.recv()
        except EOFError:
            return
        if msg is _STOP:
            return
        fn, item = msg
        if err is not None:
            results.send((False, err))
            continue
        try:
            out = (True, fn(item))
        except BaseException as e:
            out = (False, e)
        try:
            results.send(out)
        except Exception as e:  # unpicklable result/exception
            results.send((False, RuntimeError(f"worker result not transferable: {e!r}")))


class OrderedPool:
    """See module docstring. Use as a context manager: normal exit stops the workers, an exception
    kills them."""

    def __init__(self, workers: int, initializer: Callable | None = None, initargs: tuple = ()):
        self.workers = max(1, workers)
        initializer = initializer or _noop
        self.procs: list = []
        self.tasks: list = []
        self.results: list = []
        if self.workers == 1:
            initializer(*initargs)
            return
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        for _ in range(self.workers):
            task_r, task_w = ctx.Pipe(duplex=False)
            res_r, res_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(task_r, res_w, initializer, initargs, os.getpid()), daemon=True)
            p.start()
            task_r.close()
            res_w.close()
            self.procs.append(p)
            self.tasks.append(task_w)
            self.results.append(res_r)

    def map(self, fn: Callable, items: Iterable) -> Iterator[Any]:
        if not self.procs:
            for item in items:
                yield fn(item)
            return
        it = iter(items)
        pending: deque = deque()  # worker index per task in flight, in input order
        for w in range(self.workers):
            item = next(it, _STOP)
            if item is _STOP:
                break
            self._send(w, (fn, item))
            pending.append(w)
        while pending:
            upcoming = next(it, _STOP)  # read ahead while the workers run
            w = pending.popleft()
            out = self._receive(w)
            if upcoming is not _STOP:
                self._send(w, (fn, upcoming))
                pending.append(w)
            yield out

    def broadcast(self, fn: Callable) -> list:
        """``fn(None)`` once in every worker (in-process: once), results in worker order; for
        collecting per-worker state after ``map`` is exhausted (no task may be in flight)."""
        if not self.procs:
            return [fn(None)]
        for w in range(self.workers):
            self._send(w, (fn, None))
        return [self._receive(w) for w in range(self.workers)]

    def _died(self, w: int) -> DataError:
        self.procs[w].join(timeout=5)
        return DataError(f"preprocessing worker {w} died (exit code {self.procs[w].exitcode})")

    def _send(self, w: int, message: Any) -> None:
        try:
            self.tasks[w].send(message)
        except OSError:  # BrokenPipeError: the worker is gone
            raise self._died(w) from None

    def _receive(self, w: int) -> Any:
        try:
            ok, value = self.results[w].recv()
        except (EOFError, OSError):  # OSError: it died in the middle of sending a result
            raise self._died(w) from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Stop the workers after their current task."""
        for conn in self.tasks:
            try:
                conn.send(_STOP)
            except OSError:
                pass
        for p in self.procs:
            p.join()
        self._release()

    def terminate(self) -> None:
        """Kill the workers now."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join()
        self._release()

    def _release(self) -> None:
        for conn in self.tasks + self.results:
            conn.close()
        self.procs, self.tasks, self.results = [], [], []

    def __enter__(self) -> OrderedPool:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.terminate()
