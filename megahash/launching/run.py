"""One entry to launch megahash pretraining anywhere: picks the launcher, prints the command, runs it.

    python -m launch [--launcher L] [--nproc-per-node N] [--nnodes N] [--hostfile F] \\
                     [--config configs/....yaml] [key=value ...]
    python launch/run.py ...                                      (same)

Launchers (``--launcher``, default ``auto``):

  srun       inside a SLURM allocation: ``srun`` starts one task per rank (SLURM_NTASKS, i.e.
             ``--nodes`` x ``--ntasks-per-node``); every task runs ``python megahash/pretrain.py``
             and maps SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID to rank/world/local rank
             (``megahash/launching/env.py``); MASTER_ADDR = first node, MASTER_PORT = 20000 + job id % 20000.
             Signals sent to srun (SIGUSR1, SIGTERM) are forwarded to every task.
  torchrun   ``torchrun --nproc_per_node N``; inside a SLURM allocation one torchrun per node
             (``srun --ntasks-per-node=1``) with c10d rendezvous on the first node. The agent
             forwards SIGUSR1 too (``PET_SIGNALS_TO_HANDLE``) and waits up to
             ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (300 s unless set) for the ranks' checkpoint.
  deepspeed  ``deepspeed --num_gpus N`` on one node; with several nodes ``--hostfile`` (inside SLURM
             written from the node list, ``launch/hostfile.py``) and ``--master_addr``.
  mpirun     Open MPI ``mpirun -np N*nodes`` (``--hostfile`` for several nodes); ranks read
             OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK.
  python     one process (or one rank of a launcher that already set RANK/WORLD_SIZE).
  auto       srun inside a SLURM allocation (outside ``srun``), python when already launched
             (RANK or a SLURM step or OMPI_* set) or for 1 process, else deepspeed.

torchrun and deepspeed run under ``launch/supervise.py`` (one per node): SIGTERM/SIGUSR1 to it, or
to the launcher process alone, reaches every rank, it waits for their checkpoint and exits 3 (the
requeue status) where the bare launchers exit 1 or die.

The command is printed (``+ ...`` on stdout) and then replaces this process (``exec``), so signals
reach the launcher (or its supervisor) directly. ``--dry-run`` only prints it. Errors are one line ``error: ...``, exit 2.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

from megahash.errors import print_error
from megahash.launching.env import NodeListError, free_port, in_slurm_step, slurm_master_addr, slurm_port
from megahash.launching.hostfile import hostfile_from_slurm, slots_from_slurm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: launch/, megahash/
LAUNCHERS = ("auto", "srun", "torchrun", "deepspeed", "mpirun", "python")
SUPERVISE = os.path.join(ROOT, "launch", "supervise.py")  # stop signals -> every rank, exit 3 (see there)
# torchrun's agent: forward SIGUSR1 like SIGTERM (default: it dies of it, the workers train on)
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SHUTDOWN_TIMEOUT = "300"  # s torchrun's agent waits for the ranks' checkpoint after a signal (its default: 30)


class LaunchError(Exception):
    pass


def _tool(name: str, module: str | None, python: str) -> list[str]:
    """``name`` from the interpreter's bin dir (or PATH), else ``python -m module``."""
    beside = os.path.join(os.path.dirname(python), name)
    if os.access(beside, os.X_OK):
        return [beside]
    found = shutil.which(name)
    if found:
        return [found]
    if module:
        return [python, "-m", module]
    raise LaunchError(f"{name} not found on PATH")


def tasks_per_node(env) -> int | None:
    """Ranks per node of the allocation: its tasks per node (sbatch --ntasks-per-node, one per
    GPU), else its GPUs per node."""
    for key in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        m = re.match(r"(\d+)", env.get(key, ""))
        if m:
            return int(m.group(1))
    return slots_from_slurm(env)


def _in_allocation(env) -> bool:
    return "SLURM_JOB_ID" in env and not in_slurm_step(env)


def _hostfile_hosts(path: str) -> list[tuple[str, int]]:
    hosts = []
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        raise LaunchError(f"cannot read hostfile {path}: {e.strerror}") from None
    for line in lines:
        line = line.split("#")[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = 1
        for p in parts[1:]:
            if p.startswith("slots="):
                slots = int(p.split("=", 1)[1])
        hosts.append((parts[0], slots))
    return hosts


def pick_launcher(requested: str, env, nproc: int, nnodes: int) -> str:
    if requested != "auto":
        return requested
    if _in_allocation(env):
        return "srun"
    if "RANK" in env or in_slurm_step(env) or "OMPI_COMM_WORLD_RANK" in env:
        return "python"
    return "deepspeed" if nproc * nnodes > 1 else "python"


def build(args, env=None) -> tuple[list[str], dict]:
    """(command, extra environment) for the parsed arguments."""
    env = dict(os.environ if env is None else env)
    py = args.python or sys.executable
    script = args.script if os.path.isabs(args.script) else os.path.join(ROOT, args.script)
    train = [*(["--config", args.config] if args.config else []), *args.overrides]
    slurm = _in_allocation(env)
    job_nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1) if slurm else 1

    hosts = _hostfile_hosts(args.hostfile) if args.hostfile else None
    nnodes = args.nnodes or (len(hosts) if hosts else job_nodes)
    nproc = args.nproc_per_node or (hosts[0][1] if hosts else None) or (tasks_per_node(env) if slurm else None) or 1
    launcher = pick_launcher(args.launcher, env, nproc, nnodes)
    if slurm and nnodes > job_nodes:
        raise LaunchError(
            f"--nnodes {nnodes} but this SLURM job has {job_nodes} node(s) ({env.get('SLURM_JOB_NODELIST', '?')})"
        )

    extra: dict[str, str] = {}
    if args.master_addr:
        extra["MASTER_ADDR"] = args.master_addr
    if args.master_port:
        extra["MASTER_PORT"] = str(args.master_port)
    if slurm:
        extra.setdefault("MASTER_ADDR", env.get("MASTER_ADDR") or slurm_master_addr(env))
        extra.setdefault("MASTER_PORT", env.get("MASTER_PORT") or str(slurm_port(env["SLURM_JOB_ID"])))
    elif hosts:
        extra.setdefault("MASTER_ADDR", env.get("MASTER_ADDR") or hosts[0][0])
    addr = extra.get("MASTER_ADDR") or env.get("MASTER_ADDR") or "127.0.0.1"
    port = extra.get("MASTER_PORT") or env.get("MASTER_PORT") or str(free_port())
    if launcher != "python":
        extra.setdefault("MASTER_ADDR", addr)
        extra.setdefault("MASTER_PORT", port)

    if launcher == "srun":
        if not slurm:
            raise LaunchError(
                "--launcher srun needs a SLURM allocation (SLURM_JOB_ID is unset, or this is "
                "already a job step): submit with sbatch/salloc or pick --launcher torchrun|deepspeed|mpirun"
            )
        cmd = ["srun", f"--wait={args.srun_wait}", "--kill-on-bad-exit=0"]
        if args.nnodes or args.nproc_per_node:
            cmd += [f"--nodes={nnodes}", f"--ntasks={nnodes * nproc}", f"--ntasks-per-node={nproc}"]
        cmd += [py, "-u", script, *train]
    elif launcher == "torchrun":
        trun = [py, "-u", SUPERVISE, *_tool("torchrun", "torch.distributed.run", py)]
        for var in ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
            extra[var] = env.get(var) or TORCHRUN_SIGNALS
        if not (env.get("PET_SHUTDOWN_TIMEOUT") or env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")):
            extra["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = SHUTDOWN_TIMEOUT
        if slurm:
            # one supervised agent per node; SLURM signals every process of the step
            cmd = [
                "srun",
                f"--nodes={nnodes}",
                f"--ntasks={nnodes}",
                "--ntasks-per-node=1",
                f"--wait={args.srun_wait}",
                "--kill-on-bad-exit=0",
                *trun,
                f"--nnodes={nnodes}",
                f"--nproc_per_node={nproc}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={addr}:{port}",
                f"--rdzv_id=megahash-{env['SLURM_JOB_ID']}",
            ]
        elif nnodes > 1:
            raise LaunchError(
                "torchrun on several nodes outside SLURM: start it on every node yourself "
                "(torchrun --nnodes N --rdzv_endpoint HOST:PORT ...)"
            )
        else:
            cmd = [*trun, f"--nproc_per_node={nproc}", f"--master_addr={addr}", f"--master_port={port}"]
        cmd += [script, *train]
    elif launcher == "deepspeed":
        cmd = [py, "-u", SUPERVISE, *_tool("deepspeed", None, py)]
        if nnodes > 1:
            hostfile = args.hostfile
            if not hostfile:
                if not slurm:
                    raise LaunchError("deepspeed on several nodes needs --hostfile (or a SLURM allocation)")
                hostfile = os.path.join(tempfile.gettempdir(), f"megahash-hostfile-{env['SLURM_JOB_ID']}")
                with open(hostfile, "w") as f:
                    f.write(hostfile_from_slurm(env["SLURM_JOB_NODELIST"], nproc))
            cmd += ["--hostfile", hostfile, f"--num_nodes={nnodes}", f"--master_addr={addr}"]
            if args.ds_launcher:
                cmd += [f"--launcher={args.ds_launcher}"]
        else:
            cmd += [f"--num_gpus={nproc}"]
        cmd += [f"--master_port={port}", script, *train]
    elif launcher == "mpirun":
        mpirun = shutil.which("mpirun")
        if not mpirun:
            raise LaunchError("mpirun not found (Debian: apt-get install openmpi-bin; see docs/launching.md)")
        cmd = [mpirun, "-np", str(nnodes * nproc), "--bind-to", "none"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if args.hostfile:
            cmd += ["--hostfile", args.hostfile]
        elif slurm:
            cmd += ["--map-by", f"ppr:{nproc}:node"]
        else:
            cmd += ["--oversubscribe"]
        for var in ("MASTER_ADDR", "MASTER_PORT", "PYTHONPATH", "OMP_NUM_THREADS", "WANDB_MODE"):
            if var in extra or var in env or var == "PYTHONPATH":
                cmd += ["-x", var]
        cmd += [py, "-u", script, *train]
    elif launcher == "python":
        if nproc * nnodes > 1 and "RANK" not in env and not in_slurm_step(env):
            raise LaunchError(
                f"--launcher python starts one process, not {nproc * nnodes}; pick --launcher torchrun|deepspeed|mpirun"
            )
        cmd = [py, "-u", script, *train]
    else:  # pragma: no cover - argparse restricts choices
        raise LaunchError(f"unknown launcher {launcher!r}")
    return cmd, extra


def parse_args(argv=None):
    from megahash.arguments import ArgumentParser

    p = ArgumentParser(
        prog="python -m launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--launcher", choices=LAUNCHERS, default=os.environ.get("MEGAHASH_LAUNCHER", "auto"))
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=None,
        help="ranks per node (default: the allocation's tasks per node, hostfile slots, else 1)",
    )
    p.add_argument("--nnodes", type=int, default=None, help="nodes (default: the allocation's / hostfile's, else 1)")
    p.add_argument("--hostfile", default=None, help="HOST slots=N lines (deepspeed, mpirun)")
    p.add_argument("--master-addr", default=None)
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--ds-launcher", default=None, help="deepspeed --launcher for several nodes (pdsh, openmpi, slurm)")
    p.add_argument(
        "--srun-wait", type=int, default=120, help="srun --wait: seconds the other tasks get after the first one exits"
    )
    p.add_argument("--python", default=None, help="interpreter for the ranks (default: this one)")
    p.add_argument("--script", default="megahash/pretrain.py", help="entry point (default megahash/pretrain.py)")
    p.add_argument("--config", default=None, help="passed on to the entry point")
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    p.add_argument("overrides", nargs="*", help="config overrides key=value, passed on")
    return p.parse_args(argv)


def check_inputs(args) -> int:
    """megahash/pretrain.py's checks without torch (``--check inputs``: config, kinds, shards, tokenizer,
    resume path), here and once: a mistake is one line and exit 2, not a line per rank buried in the
    launcher's output. Run as the entry point's own command (like launch/quickstart.sh does), so the
    launcher library imports no command line."""
    script = os.path.normpath(os.path.join(ROOT, args.script))
    if script != os.path.join(ROOT, "megahash", "pretrain.py"):
        return 0
    argv = (["--config", args.config] if args.config else []) + list(args.overrides)
    return subprocess.run([sys.executable, script, "--check", "inputs", *argv], stdout=subprocess.DEVNULL).returncode


def main(argv=None) -> int:
    args = parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        print_error(f"{bad[0]!r} is not a key=value override (launcher options go before them)")
        return 2
    try:
        cmd, extra = build(args)
    except (LaunchError, NodeListError) as e:
        print_error(e)
        return 2
    status = 0 if args.dry_run else check_inputs(args)
    if status:
        return status
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items())
    print(f"+ {shown + ' ' if shown else ''}{shlex.join(cmd)}", flush=True)
    if args.dry_run:
        return 0
    env = dict(os.environ)
    env.update(extra)
    env.setdefault("PYTHONPATH", ROOT)
    if ROOT not in env["PYTHONPATH"].split(os.pathsep):
        env["PYTHONPATH"] = ROOT + os.pathsep + env["PYTHONPATH"]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as e:
        print_error(f"cannot run {cmd[0]}: {e.strerror}")
        return 2
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
