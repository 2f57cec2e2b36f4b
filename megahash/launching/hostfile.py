"""DeepSpeed (and Open MPI) hostfile from a SLURM node list: one ``HOST slots=N`` line per node.

    python -m launch.hostfile                                  # inside an allocation: SLURM_JOB_NODELIST,
                                                               # slots = GPUs (or tasks) per node
    python -m launch.hostfile --nodelist 'gpu[01-02],cpu7' --slots 8 -o hostfile
    deepspeed --hostfile hostfile --master_addr gpu01 megahash/pretrain.py --config ...
    mpirun --hostfile hostfile -np 24 ...                      # same format

Both DeepSpeed's runner and Open MPI read ``HOST slots=N``; ``#`` starts a comment.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from megahash.errors import print_error
from megahash.launching.env import NodeListError, expand_nodelist


def hostfile_from_slurm(nodelist: str, slots: int) -> str:
    """Hostfile text for every node of ``nodelist`` with ``slots`` processes (GPUs) each."""
    if int(slots) < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise NodeListError(f"empty node list {nodelist!r}")
    return "".join(f"{h} slots={int(slots)}\n" for h in hosts)


def _first_count(value: str | None) -> int | None:
    """``8(x2)`` / ``gpu:8`` / ``4`` -> the first count in a SLURM per-node value."""
    if not value:
        return None
    m = re.search(r"(\d+)", value.split(",")[0].split(":")[-1])
    return int(m.group(1)) if m else None


def slots_from_slurm(environ=None) -> int | None:
    """Processes per node in the current allocation: GPUs per node if the job has GPUs, else tasks
    per node."""
    env = os.environ if environ is None else environ
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        n = _first_count(env.get(key))
        if n:
            return n
    return None


def main(argv=None) -> int:
    from megahash.arguments import ArgumentParser

    p = ArgumentParser(
        prog="python -m launch.hostfile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodelist", default=None, help="SLURM node list (default: $SLURM_JOB_NODELIST)")
    p.add_argument(
        "--slots", type=int, default=None, help="processes per node (default: GPUs or tasks per node of the allocation)"
    )
    p.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    a = p.parse_args(argv)
    nodelist = a.nodelist or os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        print("error: no node list: pass --nodelist or run inside a SLURM allocation", file=sys.stderr)
        return 2
    slots = a.slots or slots_from_slurm()
    if not slots:
        print("error: cannot tell processes per node: pass --slots", file=sys.stderr)
        return 2
    try:
        text = hostfile_from_slurm(nodelist, slots)
    except (NodeListError, ValueError) as e:
        print_error(e)
        return 2
    if a.output == "-":
        sys.stdout.write(text)
    else:
        with open(a.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
