"""Python processes for the tests, forked from one that has already imported torch, DeepSpeed and megatron-core.

A test that starts ``python megahash/pretrain.py ...`` (or ``python -m megahash ...``, ``tests/_ranks.py``) pays
about 5 CPU-s of third-party imports before megahash does anything; the suite starts hundreds of them on a 2-core
machine. This module keeps one server process per pytest process: it imported those libraries once (with their
import-time warnings silenced, as megahash's entry points silence them) and forks a child for each command. The
child then looks like a fresh ``python ARGS``: its own environment, working directory, argv, ``__main__``,
standard streams and exit status, and it imports every megahash module itself (the server imports none, so a
missing import in megahash still fails). It is the standard library's ``multiprocessing`` forkserver idea applied
to whole commands.

Where a fresh interpreter is what a test needs, it is used instead (``spawn`` returns None):
- a command that is not ``sys.executable [-u] SCRIPT|-m MODULE ...``;
- an environment that differs from the server's in a variable a library reads when it is imported
  (``IMPORT_TIME``: thread counts, CPU capability, accelerators, warnings shown, Python's own flags);
- warnings shown (``--verbose``, ``logging.verbose=true``): import-time warnings come only from a fresh import;
- a CUDA build of torch (CUDA must not be touched before a fork), or ``MEGAHASH_TEST_FRESH=1`` (the whole suite
  with fresh interpreters: the check that this module changes no result).
The launchers (deepspeed, torchrun, SLURM), the quickstart's commands and the start-up tests start fresh processes
as before: they are what those tests test. The README's own ``python``/``megahash`` lines are forked through shims
on PATH (tests/_fork_shim.py) from a server started under the README test's environment.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

# the libraries the server imports once (what `megahash/pretrain.py` and `megahash eval/export` import that is
# not megahash)
PRELOAD = (
    "numpy",
    "yaml",
    "torch",
    "torch._dynamo",
    "torch.distributed.tensor",
    "deepspeed",
    "deepspeed.runtime.engine",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.dist_checkpointing",
    "megatron.core.tensor_parallel",
    "sentencepiece",
    "safetensors.torch",
)
# environment variables read when those libraries are imported: a child whose value differs is started fresh
# (not the launchers' CUDA_VISIBLE_DEVICES and PYTORCH_NVML_BASED_CUDA_CHECK, which conftest.RankGroup sets:
# torch reads them when CUDA is first used, and a fork is only made from a torch without CUDA, see ``wanted``)
IMPORT_TIME = re.compile(
    r"^(?!CUDA_VISIBLE_DEVICES$|PYTORCH_NVML_BASED_CUDA_CHECK$)"
    r"(PYTHON|TORCH|PYTORCH|ATEN_|OMP_|MKL_|KMP_|OPENBLAS|GOMP|CUDA|NVIDIA|DS_|NCCL|TRITON|MEGATRON|LD_|MALLOC|"
    r"MEGAHASH_SHOW_WARNINGS$|TQDM|TOKENIZERS|NUMPY)"
)
_server = None


def wanted() -> bool:
    """False where every command must start a fresh interpreter (see the module docstring)."""
    if os.environ.get("MEGAHASH_TEST_FRESH") == "1":
        return False
    import torch

    return torch.version.cuda is None


def _parse(args: list[str]):
    """(unbuffered, script or None, module or None, argv) of ``sys.executable [-u] SCRIPT|-m MODULE ...``."""
    if not args or os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        return None
    rest, unbuffered = list(args[1:]), False
    while rest and rest[0] == "-u":
        rest, unbuffered = rest[1:], True
    if not rest:
        return None
    if rest[0] == "-m" and len(rest) > 1:
        return unbuffered, None, rest[1], rest[1:]
    if rest[0].startswith("-"):
        return None
    return unbuffered, rest[0], None, rest


def spawn(args, cwd, env: dict, stdout, stderr, base_env: dict) -> Forked | None:
    """``args`` forked from the server (a Forked, Popen-like), or None where a fresh interpreter is needed.
    ``stdout``/``stderr``: open files (or None: this process's); ``base_env``: the environment the server is
    started with (conftest.child_env()), to which ``env`` is compared."""
    global _server
    request = request_for(args, cwd, env, base_env)
    if request is None or not wanted():
        return None
    if _server is not None and (_server.poll() is not None or _import_time(_server.base_env) != _import_time(env)):
        # its imports saw other values (an in-process run set TQDM_DISABLE since, say): a new server; the old one
        # stays up for the children it still has and is closed at exit
        _server = None
    if _server is None:
        _server = _Server(base_env)
    return _server.fork(request, stdout, stderr)


def request_for(args, cwd, env: dict, base_env: dict) -> dict | None:
    """The server's request for ``args`` run in ``cwd`` under ``env``, or None where a fresh interpreter is needed:
    not ``python [-u] SCRIPT|-m MODULE``, warnings shown, or import-time variables other than ``base_env``'s."""
    parsed = _parse([str(a) for a in args])
    if parsed is None or any(a == "--verbose" or a.startswith("logging.verbose=t") for a in map(str, args)):
        return None
    if _import_time(env) != _import_time(base_env):
        return None
    unbuffered, script, module, argv = parsed
    return {"cwd": str(cwd), "env": {k: str(v) for k, v in env.items()}, "argv": argv, "script": script,
            "module": module, "unbuffered": unbuffered}  # fmt: skip


def _import_time(env: dict) -> dict:
    return {k: str(v) for k, v in env.items() if IMPORT_TIME.match(k)}


def run(args, cwd, env: dict, base_env: dict, timeout: float | None = None) -> subprocess.CompletedProcess | None:
    """``subprocess.run(args, cwd=, env=, capture_output=True, text=True, timeout=)`` through the server, or
    None where a fresh interpreter is needed."""
    p = popen(args, cwd, env, base_env, subprocess.PIPE, subprocess.PIPE, fresh=False)
    if p is None:
        return None
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    return subprocess.CompletedProcess(list(args), p.returncode, out, err)


def popen(args, cwd, env: dict, base_env: dict, stdout=None, stderr=None, fresh: bool = True):
    """``subprocess.Popen(args, cwd=, env=, stdout=, stderr=, text=True)`` through the server (stdout and stderr
    each None, PIPE, an open file, or for stderr STDOUT; what PIPE collects comes back from ``communicate``); a
    fresh ``subprocess.Popen`` where one is needed (None instead if not ``fresh``)."""
    files = {}
    for name, want in (("out", stdout), ("err", stderr)):
        files[name] = tempfile.TemporaryFile("w+") if want == subprocess.PIPE else want
    if stderr == subprocess.STDOUT:
        files["err"] = files["out"]
    p = spawn(args, cwd, env, files["out"], files["err"], base_env)
    if p is not None:
        p.pipes = (
            files["out"] if stdout == subprocess.PIPE else None,
            files["err"] if stderr == subprocess.PIPE else None,
        )
        return p
    for name, want in (("out", stdout), ("err", stderr)):
        if want == subprocess.PIPE:
            files[name].close()
    if not fresh:
        return None
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True)


# user + system seconds of the children this process had forked that have ended (a forked child is the server's,
# so its CPU is in no ``RUSAGE_CHILDREN`` of the test's process: conftest's per-test CPU adds this)
forked_cpu_seconds = 0.0


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` has data (or EOF) within ``timeout`` seconds. ``poll``, not ``select``: a pytest worker that
    has opened many files holds descriptors above FD_SETSIZE (1024), which ``select`` refuses."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(timeout * 1000))


class Forked:
    """A child of the server, with the part of ``subprocess.Popen``'s interface the tests use. The server sends
    the child's pid with a pidfd of it (taken before it could be reaped), so a signal reaches that process or no
    one (tests/_pidfd.py), then one line with its exit status."""

    def __init__(self, conn: socket.socket, args):
        self.conn, self.args, self.pipes = conn, args, (None, None)
        self.returncode = None
        self._buf, fds, _, _ = socket.recv_fds(conn, 4096, 1)
        self.pidfd = fds[0] if fds else None
        self.pid = self._line(None)["pid"]

    def _line(self, timeout) -> dict:
        self.conn.settimeout(timeout)
        while b"\n" not in self._buf:
            chunk = self.conn.recv(4096)
            if not chunk:
                raise RuntimeError("the test fork server went away")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _ended(self, reply: dict) -> int:
        global forked_cpu_seconds
        self.returncode = reply["status"]
        forked_cpu_seconds += reply.get("cpu", 0.0)
        self.conn.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        return self.returncode

    def poll(self):
        if self.returncode is None and (b"\n" in self._buf or _readable(self.conn, 0)):
            self._ended(self._line(None))
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            try:
                self._ended(self._line(timeout))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def communicate(self, timeout=None):
        """(stdout, stderr) as ``Popen.communicate`` with text=True: what went to a PIPE, else None."""
        self.wait(timeout)
        got = []
        for f in self.pipes:
            if f is None:
                got.append(None)
                continue
            f.flush()
            f.seek(0)
            got.append(f.read())
            f.close()
        self.pipes = (None, None)
        return tuple(got)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _Server:
    """The server process of this pytest process (tests/_forkserver.py run as a script), listening on an abstract
    Unix socket: nothing of it is on the file system (tests check that runs leave no file behind)."""

    def __init__(self, base_env: dict):
        import secrets

        self.base_env = dict(base_env)
        self.address = f"\0megahash-forkserver-{os.getpid()}-{secrets.token_hex(6)}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.address[1:], str(os.getpid())],
            env=base_env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        deadline = time.monotonic() + 300
        while not self._connects():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                raise RuntimeError(f"the test fork server did not start:\n{self.log.read()[-3000:]}")
            time.sleep(0.05)
        atexit.register(self.close)

    def _connects(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(self.address)
            except (FileNotFoundError, ConnectionRefusedError):
                return False
            probe.sendall(b"\n")  # an empty request: the server drops it
        return True

    def poll(self):
        return self.proc.poll()

    def fork(self, request: dict, stdout, stderr) -> Forked:
        return fork_at(self.address, request, stdout, stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def fork_at(address: str, request: dict, stdout, stderr) -> Forked:
    """``request`` (:func:`request_for`) forked by the server listening at ``address``."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(address)
    fds = [_fd(stdout, 1), _fd(stderr, 2)]
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
    return Forked(conn, request["argv"])


def _fd(f, default: int) -> int:
    if f is None:
        return default
    if hasattr(f, "flush"):
        f.flush()
    return f if isinstance(f, int) else f.fileno()


# ---------------------------------------------------------------------------------------------------- server


def _serve(name: str, parent: int) -> None:
    import warnings

    with warnings.catch_warnings():  # megahash's entry points silence these; the children import nothing of this
        warnings.simplefilter("ignore")
        import logging

        logging.disable(logging.CRITICAL)
        for module in PRELOAD:
            __import__(module)
        logging.disable(logging.NOTSET)
    import threading

    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, "a thread before fork"
    import gc

    gc.collect()
    gc.freeze()  # the preloaded objects out of the collector's sight: a child's collections copy none of their pages
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)  # abstract: no file
    listener.listen(64)
    children: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    signal.signal(signal.SIGTERM, lambda *_: _stop(children))
    while True:
        if os.getppid() != parent:  # the pytest process is gone
            _stop(children)
        if _readable(listener, 0.05):
            conn, _ = listener.accept()
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            while msg and not msg.endswith(b"\n"):
                msg += conn.recv(1 << 20)
            if not msg.strip():  # the client's probe that the server is up
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for c in children.values():
                    c.close()
                _child(json.loads(msg), conn, fds)  # never returns
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            pidfd = os.pidfd_open(pid)  # before any waitpid: the pid is this child's until it is reaped
            socket.send_fds(conn, [json.dumps({"pid": pid}).encode() + b"\n"], [pidfd])
            os.close(pidfd)
        while children:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                cpu = usage.ru_utime + usage.ru_stime  # the child's and its waited-for children's
                try:
                    conn.sendall(json.dumps({"status": code, "cpu": cpu}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


def _stop(children) -> None:
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(0)


def _child(req: dict, conn: socket.socket, fds: list[int]) -> None:
    """In the forked child: become ``python [-u] SCRIPT|-m MODULE ARGV...`` and exit with its status."""
    import random
    import runpy
    import threading

    code = 1
    try:
        conn.close()
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0), os.dup2(fds[0], 1), os.dup2(fds[1], 2)
        for fd in (stdin, *fds):
            if fd > 2:
                os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.stdin = open(0, closefd=False)
        # as Python sets them up: stdout block-buffered, stderr line-buffered; both written through under -u
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)
        if req["unbuffered"]:
            sys.stdout.reconfigure(write_through=True, line_buffering=True)
            sys.stderr.reconfigure(write_through=True)
        random.seed()
        sys.modules["numpy"].random.seed()
        sys.argv = list(req["argv"])
        if req["module"]:
            sys.path[0] = req["cwd"]
            sys.argv[0] = req["module"]
            code = _main(lambda: runpy.run_module(req["module"], run_name="__main__", alter_sys=True))
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
            code = _main(lambda: runpy.run_path(req["script"], run_name="__main__"))
        try:
            threading._shutdown()  # as the interpreter's exit: wait for the non-daemon threads
        except Exception:
            pass
        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush(), sys.stderr.flush()
        except Exception:
            pass
        os._exit(code)


def _main(fn) -> int:
    """Run ``fn`` as the interpreter runs a program: the exit status of SystemExit, 1 and the traceback for an
    exception (sys.excepthook, as Python prints it)."""
    try:
        fn()
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        return 128 + signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
