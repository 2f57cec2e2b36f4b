"""Resolve rank, local rank, world size, master address and port from the launcher's environment.

Order (the first that matches wins):

1. torchrun / deepspeed / anything setting ``RANK`` and ``WORLD_SIZE`` (+ ``LOCAL_RANK``);
2. Open MPI ``mpirun``: ``OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK``;
3. a SLURM job step (``srun``; ``SLURM_STEP_ID`` set): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``
   (or ``SLURM_NTASKS``), ``SLURM_LOCALID``. A batch script or ``salloc`` shell outside ``srun``
   is *not* a step: a plain ``python`` there is one process, not rank 0 of ``SLURM_NTASKS``;
4. otherwise a single process.

Master address: ``MASTER_ADDR`` if set, else inside a SLURM job the first host of the node list
(``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST``; if that name does not resolve, its ``NodeAddr``
from ``scontrol``), else 127.0.0.1. Master port: ``MASTER_PORT`` if set, else inside a SLURM job
``20000 + SLURM_JOB_ID % 20000`` (the same for every task and for a requeued job, different for
concurrent jobs), else 29500 (a free port for a single process).

``resolve_env()`` writes the result back as RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT so
``torch.distributed``'s ``env://`` rendezvous sees one convention.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from dataclasses import dataclass

# launcher variables a child process with a 1-rank group of its own must not see (an evaluation of
# eval.interval, megahash eval in a sweep cell): it would meet the launching job's group
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_STEP_ID",
    "SLURM_LOCALID",
)


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # torchrun | openmpi | slurm | single


class NodeListError(ValueError):
    pass


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: ``a[1,2],b`` -> ``a[1,2]``, ``b``."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise NodeListError(f"unbalanced ']' in node list {text!r}")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise NodeListError(f"unbalanced '[' in node list {text!r}")
    out.append(cur)
    return [s.strip() for s in out if s.strip()]


def _expand_range(body: str, full: str) -> list[str]:
    vals: list[str] = []
    for part in body.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            if not (a.isdigit() and b.isdigit()) or int(b) < int(a):
                raise NodeListError(f"bad range {part!r} in node list {full!r}")
            width = len(a) if a.startswith("0") else 0
            vals.extend(f"{i:0{width}d}" for i in range(int(a), int(b) + 1))
        else:
            if not part.isdigit():
                raise NodeListError(f"bad index {part!r} in node list {full!r}")
            vals.append(part)
    return vals


def _expand_host(token: str, full: str) -> list[str]:
    """``rack[1-2]-n[01-02]`` -> rack1-n01 rack1-n02 rack2-n01 rack2-n02 (SLURM's order)."""
    m = re.search(r"\[([^\[\]]*)\]", token)
    if not m:
        return [token]
    head, tail = token[: m.start()], token[m.end() :]
    return [h for v in _expand_range(m.group(1), full) for h in _expand_host(head + v + tail, full)]


def expand_nodelist(nodelist: str) -> list[str]:
    """All hostnames of a SLURM node list, in order (like ``scontrol show hostnames``).

    ``n[1-3,5]`` -> n1 n2 n3 n5; ``gpu[01-02],cpu7`` -> gpu01 gpu02 cpu7. Raises NodeListError on
    a malformed list."""
    hosts: list[str] = []
    for token in _split_top(nodelist.strip()):
        hosts.extend(_expand_host(token, nodelist))
    return hosts


def first_host(nodelist: str) -> str:
    """First hostname of a SLURM node list (``n[1-3,5],gpu7`` -> ``n1``)."""
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise NodeListError(f"empty node list {nodelist!r}")
    return hosts[0]


def free_port(low: int = 10000, high: int = 20000) -> int:
    """An unused TCP port on localhost for a rendezvous (single-process runs need one too).

    Drawn at random from [low, high), below the kernel's ephemeral range (32768-60999 by default)
    and below ``slurm_port``'s: a port the kernel hands out for ``bind(0)`` is also the pool every
    outgoing connection takes its local port from, so on a busy machine (gloo opens many) another
    process's connection could take it before the rendezvous server binds it. Falls back to the
    kernel's choice when 200 draws find nothing free."""
    import random

    rng = random.Random()  # not the training seed's stream
    for _ in range(200):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local_world(
    cmd: list[str], ranks: int, timeout: float | None = None, start=subprocess.Popen, **popen
) -> list[tuple[int, str]]:
    """Run ``cmd`` as the ``ranks`` processes of one torch.distributed world on this machine (the ``env://``
    variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free MASTER_PORT; one thread each, so
    ranks share the cores evenly): (exit status, output with stderr) of each, in rank order; a rank still running
    when one times out is killed. ``popen``: more ``subprocess.Popen`` arguments (``cwd``; ``env``, the base
    environment, default this process's); ``start``: what starts a process (``subprocess.Popen``'s signature)."""
    base, port, procs = popen.pop("env", None) or os.environ, free_port(), []
    for rank in range(ranks):
        env = dict(base, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(start(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen))
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def slurm_port(job_id: str | int) -> int:
    """Deterministic rendezvous port of a SLURM job: 20000 + job_id % 20000 (stays below the
    usual ephemeral range 32768+)."""
    return 20000 + int(str(job_id).split("_")[0]) % 20000


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
        return True
    except (socket.gaierror, UnicodeError):
        return False


def node_addr(host: str) -> str:
    """An address for SLURM node ``host``: the name itself if it resolves, else the node's
    ``NodeAddr`` from ``scontrol show node`` (emulated or renamed nodes), else the name."""
    if _resolves(host):
        return host
    try:
        out = subprocess.run(
            ["scontrol", "-o", "show", "node", host], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return host
    m = re.search(r"\bNodeAddr=(\S+)", out)
    return m.group(1) if m else host


def slurm_master_addr(environ=None) -> str:
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    return node_addr(first_host(nodelist))


def in_slurm_step(environ=None) -> bool:
    env = os.environ if environ is None else environ
    return "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and ("SLURM_STEP_NUM_TASKS" in env or "SLURM_NTASKS" in env)


def _master(env) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) of a multi-process run: the variables if set, else SLURM-derived
    inside a job, else 127.0.0.1:29500."""
    in_job = "SLURM_JOB_ID" in env and ("SLURM_JOB_NODELIST" in env or "SLURM_NODELIST" in env)
    addr = env.get("MASTER_ADDR") or (slurm_master_addr(env) if in_job else "127.0.0.1")
    if env.get("MASTER_PORT"):
        return addr, int(env["MASTER_PORT"])
    return addr, slurm_port(env["SLURM_JOB_ID"]) if in_job else 29500


def resolve_env(environ: dict | None = None, write_back: bool = True) -> DistEnv:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        addr, port = _master(env)
        info = DistEnv(
            int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")), addr, port, "torchrun"
        )
    elif "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        addr, port = _master(env)
        info = DistEnv(
            int(env["OMPI_COMM_WORLD_RANK"]),
            int(env["OMPI_COMM_WORLD_SIZE"]),
            int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),
            addr,
            port,
            "openmpi",
        )
    elif in_slurm_step(env):
        addr, port = _master(env)
        world = env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]
        info = DistEnv(int(env["SLURM_PROCID"]), int(world), int(env.get("SLURM_LOCALID", "0")), addr, port, "slurm")
    else:
        addr = env.get("MASTER_ADDR", "127.0.0.1")
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else free_port()
        info = DistEnv(0, 1, 0, addr, port, "single")
    if write_back and environ is None:
        os.environ.update(
            {
                "RANK": str(info.rank),
                "WORLD_SIZE": str(info.world_size),
                "LOCAL_RANK": str(info.local_rank),
                "MASTER_ADDR": info.master_addr,
                "MASTER_PORT": str(info.master_port),
            }
        )
    return info
