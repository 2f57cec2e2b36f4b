"""``python`` and console scripts (``megahash``) on a test's PATH that fork their command from a test fork server
(tests/_forkserver.py) started with the test's environment, for tests that run shell commands as a user types them
(tests/test_readme.py): the command runs as it would in a fresh interpreter (its argv, cwd, environment, streams
and exit status; every megahash module imported by it), without ~5 CPU-s of third-party imports. A command the
server cannot run as a fresh interpreter would (``python -c``, stdin, warnings shown, another import-time
environment: tests/_forkserver.py's rules) execs the real interpreter instead."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import _forkserver

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def install(bin_dir: Path, server, scripts: dict[str, str | None]) -> None:
    """Write the shims ``name -> console script path`` (None: the interpreter itself) into ``bin_dir``, each
    forking from ``server`` (a tests/_forkserver.py ``_Server``) when the environment it is run in imports as
    the server's did."""
    tests = str(Path(__file__).resolve().parent)
    for name, script in scripts.items():
        shim = bin_dir / name
        shim.write_text(
            f"#!{sys.executable}\n"
            f"import sys\nsys.path.insert(0, {tests!r})\nimport _fork_shim\n"
            f"_fork_shim.main({server.address!r}, {_forkserver._import_time(server.base_env)!r}, {script!r})\n"
        )
        shim.chmod(0o755)


def main(address: str, server_env: dict, script: str | None) -> None:
    args = [sys.executable, *([script] if script else []), *sys.argv[1:]]
    request = _forkserver.request_for(args, os.getcwd(), dict(os.environ), server_env)
    if request is None:
        os.execv(sys.executable, args)
    try:
        child = _forkserver.fork_at(address, request, None, None)  # this process's stdout and stderr
    except (ConnectionRefusedError, FileNotFoundError):  # the server is gone: a fresh interpreter
        os.execv(sys.executable, args)
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    status = child.wait()
    if status < 0:  # killed by a signal: end the same way, as the command's shell expects
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)
