"""A real SLURM cluster on localhost for tests: one ``slurmctld`` and N ``slurmd`` emulating N nodes.

Uses Debian's SLURM 22.05 (``slurmctld slurmd slurm-client``) without systemd, all state in one
directory: ``AuthType=auth/none`` (no munge daemon), ``ProctrackType=proctrack/linuxproc``,
``TaskPlugin=task/none``, no cgroup.conf, ``MailProg=/bin/true``, free TCP ports, one ``slurmd -N nK``
per emulated node (each on its own port, all pointing at 127.0.0.1), a fake ``gpu`` GRES per node so
scripts with ``--gpus-per-node`` are accepted (its "device" is /dev/null). Clients find it through ``SLURM_CONF``.

    with LocalSlurm(tmpdir, nodes=2) as cluster:           # Python (tests)
        subprocess.run(["sbatch", ...], env=cluster.env())

    python -m launch.local_slurm up --dir /tmp/cluster     # shell: prints `export SLURM_CONF=...`
    python -m launch.local_slurm down --dir /tmp/cluster

Must run as root (slurmd runs jobs as the submitting user). Requeued jobs wait ``cred_expire``
seconds (set to 5 here; SLURM's default is 120) before they start again.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from megahash.errors import print_error

DAEMONS = ("slurmctld", "slurmd", "sinfo", "sbatch", "srun", "scontrol", "squeue", "scancel")


class SlurmUnavailable(RuntimeError):
    """The SLURM programs are missing or the cluster did not come up."""


# machine-wide: one local SLURM at a time (LocalSlurm.start); MEGAHASH_LOCAL_SLURM_LOCK names another file
LOCK_FILE = "/tmp/megahash-local-slurm.lock"


def missing_programs() -> list[str]:
    return [p for p in DAEMONS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]


def _free_ports(n: int) -> list[int]:
    """n distinct free ports for the daemons (``free_port``: below the ephemeral range)."""
    from megahash.launching.env import free_port

    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _exe(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    if Path("/usr/sbin", name).exists():
        return f"/usr/sbin/{name}"
    raise SlurmUnavailable(f"{name} not found (apt-get install slurmctld slurmd slurm-client)")


class LocalSlurm:
    """Start/stop a local SLURM with ``nodes`` emulated nodes named ``n1..nN`` under ``root``."""

    def __init__(
        self,
        root: str | os.PathLike,
        nodes: int = 2,
        cpus_per_node: int = 2,
        gpus_per_node: int = 1,
        partition: str = "debug",
    ):
        self.root = Path(root).resolve()
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus_per_node
        self.gpus = gpus_per_node
        self.partition = partition
        self.conf = self.root / "etc" / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------ configuration
    def write_config(self) -> Path:
        r = self.root
        for sub in ("etc", "state", "log", "run", *(f"spool/{n}" for n in self.nodes)):
            (r / sub).mkdir(parents=True, exist_ok=True)
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        host = socket.gethostname()
        lines = [
            "ClusterName=megahash-local",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            "CredType=cred/none",
            "AuthInfo=cred_expire=5",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "GresTypes=gpu",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "KillWait=5",
            "MinJobAge=300",
            "InactiveLimit=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "MessageTimeout=20",
            "JobRequeue=1",
            "EnforcePartLimits=ALL",
            "PrologFlags=NoHold",
        ]
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        for name, port in zip(self.nodes, node_ports):
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={self.cpus} RealMemory=1000{gres} State=UNKNOWN"
            )
        lines.append(
            f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=YES"
        )
        self.conf.write_text("\n".join(lines) + "\n")
        gres_lines = ["AutoDetect=off"]
        if self.gpus:  # SLURM drops file-less GPUs and wants device files: borrow harmless ones
            devices = ["/dev/null", "/dev/zero", "/dev/full", "/dev/urandom", "/dev/random"][: self.gpus]
            if len(devices) < self.gpus:
                raise SlurmUnavailable(f"at most 5 fake GPUs per node, asked for {self.gpus}")
            gres_lines.append(f"NodeName={','.join(self.nodes)} Name=gpu File={','.join(devices)}")
        (self.conf.parent / "gres.conf").write_text("\n".join(gres_lines) + "\n")
        (self.conf.parent / "plugstack.conf").write_text("")
        return self.conf

    def env(self, base: dict | None = None) -> dict:
        """Environment for SLURM clients (sbatch, srun, squeue...) talking to this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    # ------------------------------------------------------------------ lifecycle
    def _take_machine_lock(self, wait: float) -> None:
        """One local SLURM per machine at a time (``LOCK_FILE``, held until :meth:`stop`): two would
        number their first jobs alike, so their jobs' rendezvous ports (derived from the job id)
        collide, and each one's clean-up could end the other's job processes."""
        lock_file = os.environ.get("MEGAHASH_LOCAL_SLURM_LOCK", LOCK_FILE)
        self._lock = open(lock_file, "a+")
        deadline, said = time.time() + wait, False
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.time() > deadline:
                    self._lock.close()
                    self._lock = None
                    raise SlurmUnavailable(f"another local SLURM held {lock_file} for over {wait:.0f}s") from None
                if not said:
                    print(
                        f"local_slurm: waiting for another local SLURM on this machine ({lock_file})",
                        file=sys.stderr,
                        flush=True,
                    )
                    said = True
                time.sleep(1.0)

    def _release_machine_lock(self) -> None:
        if getattr(self, "_lock", None) is not None:
            self._lock.close()  # closing the file releases the flock
            self._lock = None

    def start(self, timeout: float = 60.0, lock_wait: float = 3600.0) -> LocalSlurm:
        if os.geteuid() != 0:
            raise SlurmUnavailable("a local SLURM needs root (slurmd runs jobs as their user)")
        self._take_machine_lock(lock_wait)
        self.write_config()
        env = self.env()
        logs = self.root / "log"
        # slurmctld inherits the lock's descriptor: the lock lasts as long as the cluster, also after `up` exits
        self._spawn(
            "slurmctld",
            [_exe("slurmctld"), "-D", "-i", "-f", str(self.conf)],
            logs / "slurmctld.out",
            env,
            keep_fds=(self._lock.fileno(),),
        )
        for n in self.nodes:
            self._spawn(
                f"slurmd-{n}", [_exe("slurmd"), "-D", "-N", n, "-f", str(self.conf)], logs / f"slurmd-{n}.out", env
            )
        self.wait_idle(timeout)
        return self

    def _spawn(self, name, cmd, log, env, keep_fds=()):
        with open(log, "ab") as out:
            self.procs[name] = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                cwd=self.root,
                pass_fds=keep_fds,
            )
        (self.root / "run" / f"{name}.popen.pid").write_text(str(self.procs[name].pid))

    def sinfo(self) -> str:
        r = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env(), capture_output=True, text=True, timeout=30
        )
        return r.stdout.strip() if r.returncode == 0 else ""

    def wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        state = ""
        while time.time() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with status {p.returncode}; see {self.root}/log/")
            state = self.sinfo()
            rows = dict(line.split() for line in state.splitlines() if len(line.split()) == 2)
            if rows and all(rows.get(n, "").startswith("idle") for n in self.nodes):
                return
            time.sleep(0.5)
        raise SlurmUnavailable(f"nodes not idle after {timeout:.0f}s (sinfo: {state!r}); see {self.root}/log/")

    def stop(self) -> None:
        """Cancel all jobs (waiting up to 20 s for them to end), stop the daemons started by this
        object (or recorded in ``run/*.popen.pid`` by ``up``), then end any process still running
        with this cluster's SLURM_CONF (slurmstepd daemons and job processes left behind)."""
        if self.conf.is_file() and (self.procs or list((self.root / "run").glob("*.popen.pid"))):
            env = self.env()
            subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True, timeout=30)
            deadline = time.time() + 20
            while time.time() < deadline:
                r = subprocess.run(
                    ["squeue", "-h", "-t", "all", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30
                )
                if r.returncode != 0 or not any(s in r.stdout for s in ("RUNNING", "COMPLETING", "CONFIGURING")):
                    break
                time.sleep(0.5)
        pids = {name: p.pid for name, p in self.procs.items()}
        for f in (self.root / "run").glob("*.popen.pid"):
            pids.setdefault(f.name[: -len(".popen.pid")], int(f.read_text()))
        for pid in pids.values():
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        for name, pid in pids.items():
            while time.time() < deadline and _alive(pid, self.procs.get(name)):
                time.sleep(0.1)
            if _alive(pid, self.procs.get(name)):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for f in (self.root / "run").glob("*.popen.pid"):
            f.unlink()
        self.procs.clear()
        self._kill_leftovers()
        self._release_machine_lock()

    def _kill_leftovers(self) -> None:
        """SIGKILL slurmstepd daemons and job processes (SLURM_JOB_ID set) whose environment names
        this cluster's SLURM_CONF (never this process or its ancestors)."""
        mine = f"SLURM_CONF={self.conf}".encode()
        keep, pid = set(), os.getpid()
        while pid > 1:
            keep.add(pid)
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) in keep:
                continue
            try:
                env = (proc / "environ").read_bytes().split(b"\0")
                stepd = (proc / "comm").read_text().startswith("slurmstepd")
                if mine in env and (stepd or any(v.startswith(b"SLURM_JOB_ID=") for v in env)):
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass

    def __enter__(self) -> LocalSlurm:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def logs(self, tail: int = 4000) -> str:
        """The daemons' log tails (for test failure messages)."""
        out = []
        for f in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)


def _alive(pid: int, popen: subprocess.Popen | None) -> bool:
    if popen is not None:
        return popen.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv=None) -> int:
    from megahash.arguments import ArgumentParser

    p = ArgumentParser(
        prog="python -m launch.local_slurm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--dir", required=True, help="state directory (config, spool, logs)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--cpus-per-node", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=1, help="fake gpu GRES per node (0 = none)")
    a = p.parse_args(argv)
    cluster = LocalSlurm(a.dir, a.nodes, a.cpus_per_node, a.gpus_per_node)
    try:
        if a.action == "up":
            if missing_programs():
                print(
                    f"error: missing SLURM programs {missing_programs()}; run launch/install_cluster_tools.sh",
                    file=sys.stderr,
                )
                return 2
            try:
                cluster.start()
            except BaseException:
                cluster.stop()
                raise
            cluster.procs.clear()  # leave the daemons running after this process exits
            print(f"export SLURM_CONF={cluster.conf}")
        elif a.action == "down":
            cluster.stop()
        else:
            print(cluster.sinfo() or "not running")
    except SlurmUnavailable as e:
        print_error(e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
