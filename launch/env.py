"""Resolve rank, local rank, world size, master address and port from the launcher's environment.

Order: torchrun / deepspeed (RANK, WORLD_SIZE, LOCAL_RANK), Open MPI (OMPI_COMM_WORLD_*),
SLURM (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, first host of SLURM_JOB_NODELIST), else a
single process. The result is also written back as RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/
MASTER_PORT so torch.distributed's env:// rendezvous sees one convention.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str


def first_host(nodelist: str) -> str:
    """First hostname of a SLURM node list (``n[1-3,5],gpu7`` -> ``n1``)."""
    nodelist = nodelist.strip()
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def expand_nodelist(nodelist: str) -> list[str]:
    """All hostnames of a SLURM node list (``n[1-2],g[01-02]`` -> n1 n2 g01 g02)."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = m.group(1), m.group(2)
        if not ranges:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            if "-" in part:
                a, b = part.split("-")
                width = len(a)
                hosts.extend(f"{prefix}{i:0{width}d}" for i in range(int(a), int(b) + 1))
            else:
                hosts.append(prefix + part)
    return hosts


def free_port() -> int:
    """An unused TCP port on localhost (for single-process runs, which need a rendezvous too)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_env(environ: dict | None = None, write_back: bool = True) -> DistEnv:
    env = os.environ if environ is None else environ
    port = int(env.get("MASTER_PORT", "29500"))
    if "RANK" in env and "WORLD_SIZE" in env:
        info = DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                       env.get("MASTER_ADDR", "127.0.0.1"), port, "torchrun")
    elif "OMPI_COMM_WORLD_RANK" in env:
        info = DistEnv(int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"]),
                       int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),
                       env.get("MASTER_ADDR", "127.0.0.1"), port, "openmpi")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "127.0.0.1")
        info = DistEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0")),
                       env.get("MASTER_ADDR") or first_host(nodelist), port, "slurm")
    else:
        if "MASTER_PORT" not in env:
            port = free_port()
        info = DistEnv(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), port, "single")
    if write_back and environ is None:
        os.environ.update({"RANK": str(info.rank), "WORLD_SIZE": str(info.world_size),
                           "LOCAL_RANK": str(info.local_rank), "MASTER_ADDR": info.master_addr,
                           "MASTER_PORT": str(info.master_port)})
    return info
