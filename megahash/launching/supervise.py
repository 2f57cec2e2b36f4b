"""Run a multi-process launcher (deepspeed, torchrun) so that a stop signal to it checkpoints and requeues.

    python -m launch.supervise deepspeed --num_gpus 2 megahash/pretrain.py --config ... [key=value ...]
    python -m launch.supervise torchrun --nproc_per_node 2 megahash/pretrain.py --config ...
    python -m launch --launcher deepspeed|torchrun ...            (uses it; prints the launcher command)

The launchers alone do not do it: ``deepspeed``'s runner has no signal handler on one node (SIGTERM
or SIGUSR1 kills it and leaves the ranks training), its per-node ``launch.py`` dies of SIGUSR1 and
answers SIGTERM by SIGKILLing the ranks after 30 s, and both ``deepspeed`` and ``torchrun`` exit
with their own status (1, 143, ...), never the ranks' requeue status 3. This process:

- starts the launcher as its child and is the *subreaper* of everything under it (ranks whose
  launcher dies are re-parented here, so it can wait for them);
- gives the ranks a folder (``MEGAHASH_RANK_STATUS_DIR``): every megahash rank registers there as
  soon as its stop-signal handler is installed (``megahash.training.signals.install_early``, before
  the slow imports) and writes its exit status there at the end;
- on SIGTERM or SIGUSR1 to itself, or when the launcher exits while ranks still run (a signal to
  the ``deepspeed`` runner, to its ``launch.py`` or to the torchrun agent alone killed it), sends
  that signal (SIGUSR1 when the launcher died) to every registered rank whose handler is installed,
  and to every rank that registers later (still starting: it keeps the signal and stops at its first
  step boundary). The launcher processes are not signalled by it (their own reactions kill ranks);
- waits for the launcher and every registered rank, then exits with: a rank's status other than 0
  and 3 if there is one (a real failure), else 3 if a rank stopped on a signal after checkpointing
  (the requeue status, ``EXIT_REQUEUE``), also 3 if a stop signal killed the launcher before any
  rank started (nothing to save), else the launcher's status (128+N if a signal N killed it).

Forwarding reaches the ranks on this machine (one supervisor per node: ``srun ... python -m
launch.supervise torchrun ...`` under SLURM). Standard library only: it must start fast.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

STATUS_DIR_ENV = "MEGAHASH_RANK_STATUS_DIR"  # = megahash.training.signals.STATUS_DIR_ENV
EXIT_REQUEUE = 3  # = megahash.training.signals.EXIT_REQUEUE
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
GRACE = 10.0  # s to wait for ranks a dead launcher's orphans may still start


def _log(msg: str) -> None:
    print(f"megahash-launch: {msg}", file=sys.stderr, flush=True)


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process (Linux >= 3.4), not to init."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (``SigCgt`` of /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def shell_status(waitstatus: int) -> int:
    """An exit status as a shell reports it (128+N for a process killed by signal N)."""
    code = os.waitstatus_to_exitcode(waitstatus)
    return 128 - code if code < 0 else code


class Supervisor:
    def __init__(self, cmd: list[str], env: dict | None = None, poll: float = 0.2):
        self.cmd = cmd
        self.env = dict(os.environ if env is None else env)
        self.poll = poll
        self.stop_signal: int | None = None  # the signal to forward once a stop is requested
        self.why = ""
        self.signalled: set[int] = set()
        self.received: list[int] = []

    # ------------------------------------------------------------------ ranks
    def ranks(self) -> dict[int, str]:
        """Registered ranks: pid -> reported exit status ('' while running)."""
        out = {}
        try:
            names = os.listdir(self.dir)
        except OSError:
            return out
        for name in names:
            if name.startswith("rank-") and name[5:].isdigit():
                try:
                    with open(os.path.join(self.dir, name)) as f:
                        out[int(name[5:])] = f.read().strip()
                except OSError:
                    pass
        return out

    def is_rank(self, pid: int) -> bool:
        """``pid`` is a running rank of this launch (not a zombie, not a reused pid)."""
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return f"{STATUS_DIR_ENV}={self.dir}".encode() in f.read().split(b"\0") and alive(pid)
        except OSError:
            return False

    def running_ranks(self) -> list[int]:
        return [pid for pid in self.ranks() if self.is_rank(pid)]

    def forward(self) -> None:
        """Send the stop signal to every running rank that handles it and has not had it yet."""
        for pid, status in self.ranks().items():
            if pid in self.signalled or status or not self.is_rank(pid) or not catches(pid, self.stop_signal):
                continue
            try:
                os.kill(pid, self.stop_signal)
                self.signalled.add(pid)
            except ProcessLookupError:
                pass

    def request_stop(self, sig: int, why: str) -> None:
        if self.stop_signal is None:
            self.stop_signal, self.why = sig, why
            n = len(self.running_ranks())
            _log(
                f"{why}: sending {signal.Signals(sig).name} to the ranks ({n} running now, and any that "
                f"start later); they checkpoint at the next step boundary and exit {EXIT_REQUEUE}"
            )

    def _on_signal(self, signum, frame) -> None:
        self.received.append(signum)  # acted on by the loop (no printing inside a handler)

    # ------------------------------------------------------------------ run
    def run(self) -> int:
        self.dir = tempfile.mkdtemp(prefix="megahash-ranks-")
        try:
            return self._run()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _run(self) -> int:
        self.env[STATUS_DIR_ENV] = self.dir
        become_subreaper()
        for s in STOP_SIGNALS:  # handled here; the launcher starts with the default actions
            signal.signal(s, self._on_signal)
        try:
            child = subprocess.Popen(self.cmd, env=self.env)
        except OSError as e:
            from megahash.errors import print_error  # here: the supervisor starts on the standard library alone

            print_error(f"cannot run {self.cmd[0]}: {e.strerror}")
            return 2
        # Ctrl-C reaches the whole foreground group: the launchers handle it; this process waits for them
        signal.signal(signal.SIGINT, lambda *_: None)
        launcher_status = None
        idle_since = None  # when the launcher had exited and no rank was running
        while True:
            children = True
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # no child (nor orphan re-parented here) left at all
                pid, status, children = 0, 0, False
                if launcher_status is None:
                    launcher_status = child.returncode if child.returncode is not None else 1
            if pid:
                if pid == child.pid:
                    launcher_status = shell_status(status)
                    child.returncode = launcher_status
                continue  # reap everything that has exited before looking further
            if self.received:
                self.request_stop(self.received[0], f"received {signal.Signals(self.received[0]).name}")
            if launcher_status is not None:
                running = self.running_ranks()
                if not running:
                    # done, unless orphans of a dead launcher may still start ranks (a helper that
                    # outlives its rank does not hold this process for more than GRACE seconds)
                    idle_since = idle_since or time.monotonic()
                    if not children or time.monotonic() - idle_since > GRACE:
                        break
                else:
                    idle_since = None
                unreported = [pid for pid in running if not self.ranks().get(pid)]
                if unreported:
                    self.request_stop(
                        signal.SIGUSR1,
                        f"the launcher exited (status {launcher_status}) while {len(unreported)} rank(s) still run",
                    )
            if self.stop_signal is not None:
                self.forward()
            time.sleep(self.poll)
        return self.exit_status(launcher_status)

    def exit_status(self, launcher_status: int) -> int:
        reported = [int(s) for s in self.ranks().values() if s.lstrip("-").isdigit()]
        failed = [s for s in reported if s not in (0, EXIT_REQUEUE)]
        if failed:
            return failed[0]
        if not self.ranks() and launcher_status in (128 + signal.SIGTERM, 128 + signal.SIGUSR1):
            _log(
                f"the launcher died of a stop signal before any rank started (nothing to save); exit status "
                f"{EXIT_REQUEUE}: resume with train.resume=auto"
            )
            return EXIT_REQUEUE
        if EXIT_REQUEUE in reported:
            if launcher_status != EXIT_REQUEUE:
                _log(
                    f"the ranks stopped on a signal after checkpointing; exit status {EXIT_REQUEUE} "
                    f"(the launcher's was {launcher_status})"
                )
            return EXIT_REQUEUE
        if launcher_status == 0 and self.stop_signal is not None and not reported and self.ranks():
            return 1  # the ranks vanished without a word
        return launcher_status


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    return Supervisor(argv).run()


if __name__ == "__main__":
    sys.exit(main())
