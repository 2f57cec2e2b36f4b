"""Launcher helpers without a cluster: SLURM node lists, rank/world/master resolution from torchrun,
Open MPI and SLURM environments, DeepSpeed hostfiles, the launcher commands of ``python -m launch``,
and the SIGUSR1 protocol of the trainer (second signal during the save included)."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import conftest
from conftest import ROOT, child_env, pretrain_here, run, train_losses
from megahash.launching import env as lenv
from megahash.launching.env import DistEnv, NodeListError, expand_nodelist, first_host, resolve_env, slurm_port
from megahash.launching.hostfile import hostfile_from_slurm, slots_from_slurm
from megahash.launching.run import build, parse_args


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
        ("gpu[01-02],cpu7", ["gpu01", "gpu02", "cpu7"]),
        ("node7", ["node7"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x[3],y[1,4-5],z", ["x3", "y1", "y4", "y5", "z"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts
    assert first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("bad", ["n[1-", "n1]", "n[a-b]", "n[5-2]"])
def test_malformed_nodelist(bad):
    with pytest.raises(NodeListError):
        expand_nodelist(bad)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol (Debian slurm-client) not installed")
def test_expand_nodelist_matches_scontrol(tmp_path):
    from megahash.launching.local_slurm import LocalSlurm

    conf = LocalSlurm(tmp_path).write_config()  # scontrol needs a parseable slurm.conf, no daemons
    for nodelist in ("n[1-3,5]", "gpu[01-02],cpu7", "n[098-101]", "rack[1-2]-n[01-02]", "x[3],y[1,4-5],z"):
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            env={**os.environ, "SLURM_CONF": str(conf)},
        )
        assert out.returncode == 0, out.stderr
        assert expand_nodelist(nodelist) == out.stdout.split(), nodelist


def test_one_local_slurm_per_machine_at_a_time(tmp_path, monkeypatch):
    """Two local SLURM clusters on one machine would give their first jobs the same id, so the same
    rendezvous port (as two pytest workers once did): the second waits for the first's lock, gives up
    after its wait with a one-line reason, and takes the lock once the first one stops."""
    import threading

    from megahash.launching.local_slurm import LocalSlurm, SlurmUnavailable

    monkeypatch.setenv("MEGAHASH_LOCAL_SLURM_LOCK", str(tmp_path / "slurm.lock"))
    first, second = LocalSlurm(tmp_path / "a"), LocalSlurm(tmp_path / "b")
    first._take_machine_lock(wait=1)
    with pytest.raises(SlurmUnavailable, match="another local SLURM held .*slurm.lock for over 1s"):
        second._take_machine_lock(wait=1)
    timer = threading.Timer(1.0, first.stop)  # stop() ends no daemon here (none started) and frees the lock
    timer.start()
    second._take_machine_lock(wait=30)  # returns once the first has stopped
    timer.join()
    assert first._lock is None
    with pytest.raises(SlurmUnavailable):
        first._take_machine_lock(wait=0)
    second.stop()
    first._take_machine_lock(wait=0)
    first.stop()


def test_resolve_torchrun():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "1234",
        "OMPI_COMM_WORLD_RANK": "0",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_STEP_ID": "0",
    }
    assert resolve_env(env) == DistEnv(3, 8, 1, "h0", 1234, "torchrun")


def test_resolve_openmpi():
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29999",
    }
    assert resolve_env(env) == DistEnv(1, 2, 1, "10.0.0.1", 29999, "openmpi")
    assert resolve_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}).master_addr == "127.0.0.1"


def test_resolve_slurm_step(monkeypatch):
    monkeypatch.setattr(lenv, "_resolves", lambda host: True)
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08],cpu1",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
    }
    info = resolve_env(env)
    assert info == DistEnv(5, 8, 1, "gpu07", 20000 + 123456 % 20000, "slurm")
    assert slurm_port("123456") == 23456 and slurm_port(40000) == 20000 and slurm_port("77_3") == 20077
    # explicit MASTER_* win
    info = resolve_env({**env, "MASTER_ADDR": "a", "MASTER_PORT": "7"})
    assert (info.master_addr, info.master_port) == ("a", 7)


def test_unresolvable_first_node_uses_scontrol_nodeaddr(monkeypatch):
    monkeypatch.setattr(lenv, "_resolves", lambda host: False)

    class Out:
        stdout = "NodeName=n1 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.1.2.3 NodeHostName=vm Version=22.05.8"

    monkeypatch.setattr(lenv.subprocess, "run", lambda *a, **k: Out())
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "n[1-2]",
    }
    assert resolve_env(env).master_addr == "10.1.2.3"


def test_slurm_batch_shell_is_one_process():
    """A batch script or salloc shell has SLURM_PROCID=0 and SLURM_NTASKS=N but is not a job step:
    a plain python there must not wait for N-1 other ranks."""
    env = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost"}
    info = resolve_env(env)
    assert (info.rank, info.world_size, info.source) == (0, 1, "single")


def test_resolve_writes_back(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # recorded, so the values resolve_env writes are undone after the test
        monkeypatch.delenv(k)
    for k, v in {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "MASTER_PORT": "23456",
    }.items():
        monkeypatch.setenv(k, v)
    resolve_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("1", "2", "0")
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("127.0.0.1", "23456")


def test_hostfile_from_slurm(tmp_path):
    assert hostfile_from_slurm("gpu[01-02],cpu7", 8) == "gpu01 slots=8\ngpu02 slots=8\ncpu7 slots=8\n"
    with pytest.raises(ValueError):
        hostfile_from_slurm("n1", 0)
    assert slots_from_slurm({"SLURM_GPUS_ON_NODE": "4", "SLURM_NTASKS_PER_NODE": "2"}) == 4
    assert slots_from_slurm({"SLURM_TASKS_PER_NODE": "2(x3)"}) == 2
    out = tmp_path / "hostfile"
    r = run(
        [sys.executable, "launch/hostfile.py", "-o", str(out)], SLURM_JOB_NODELIST="n[1-3,5]", SLURM_GPUS_ON_NODE="8"
    )
    assert r.returncode == 0, r.stderr
    assert out.read_text().splitlines() == [f"n{i} slots=8" for i in (1, 2, 3, 5)]
    r = run([sys.executable, "-m", "launch.hostfile", "--nodelist", "n[1-2]", "--slots", "2"])
    assert r.stdout == "n1 slots=2\nn2 slots=2\n"
    env = child_env()
    for k in [k for k in env if k.startswith("SLURM_")]:
        env.pop(k)
    r = subprocess.run([sys.executable, "-m", "launch.hostfile"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: no node list")


SLURM_ALLOC = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "localhost,gpu[02-03]",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_NTASKS": "6",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_GPUS_ON_NODE": "2",
    "PATH": os.environ["PATH"],
}


def _build(argv, env):
    return build(parse_args(argv), env)


def test_launcher_commands_inside_slurm(tmp_path):
    cmd, extra = _build(["--config", "c.yaml", "a.b=1"], SLURM_ALLOC)  # auto -> srun, one task per rank
    assert cmd[0] == "srun" and cmd[-3:] == ["--config", "c.yaml", "a.b=1"]
    assert cmd[-4].endswith("megahash/pretrain.py")
    assert extra == {"MASTER_ADDR": "localhost", "MASTER_PORT": str(20000 + 4242)}
    cmd, _ = _build(["--launcher", "torchrun"], SLURM_ALLOC)
    s = " ".join(cmd)
    assert cmd[0] == "srun" and "--ntasks-per-node=1" in cmd and "--nnodes=3" in cmd and "--nproc_per_node=2" in cmd
    assert f"--rdzv_endpoint=localhost:{20000 + 4242}" in s and "--rdzv_backend=c10d" in s
    assert "launch/supervise.py" in s  # one supervisor per node: its exit status is the ranks' 3
    cmd, _ = _build(["--launcher", "deepspeed"], SLURM_ALLOC)
    hostfile = cmd[cmd.index("--hostfile") + 1]
    assert Path(hostfile).read_text() == "localhost slots=2\ngpu02 slots=2\ngpu03 slots=2\n"
    assert "--master_addr=localhost" in cmd and "--num_nodes=3" in cmd
    Path(hostfile).unlink()
    if shutil.which("mpirun"):
        cmd, _ = _build(["--launcher", "mpirun"], SLURM_ALLOC)
        assert cmd[1:3] == ["-np", "6"] and "ppr:2:node" in cmd


def test_launcher_commands_outside_slurm(tmp_path):
    env = {"PATH": os.environ["PATH"]}
    cmd, extra = _build(["--nproc-per-node", "2"], env)  # auto -> deepspeed, under launch/supervise.py
    assert cmd[:3] == [sys.executable, "-u", str(Path(ROOT) / "launch" / "supervise.py")]
    assert Path(cmd[3]).name == "deepspeed" and "--num_gpus=2" in cmd
    cmd, extra = _build([], env)  # auto, one process -> python
    assert cmd[0] == sys.executable and extra == {}
    cmd, extra = _build(["--launcher", "torchrun", "--nproc-per-node", "2", "--master-port", "29123"], env)
    assert "--nproc_per_node=2" in cmd and "--master_port=29123" in cmd and extra["MASTER_PORT"] == "29123"
    assert cmd[2].endswith("launch/supervise.py") and extra["PET_SIGNALS_TO_HANDLE"].endswith(",SIGUSR1")
    hf = tmp_path / "hostfile"
    hf.write_text("h1 slots=4\nh2 slots=4  # comment\n")
    cmd, extra = _build(["--launcher", "deepspeed", "--hostfile", str(hf)], env)
    assert cmd[cmd.index("--hostfile") + 1] == str(hf) and "--master_addr=h1" in cmd and "--num_nodes=2" in cmd
    if shutil.which("mpirun"):
        cmd, _ = _build(["--launcher", "mpirun", "--hostfile", str(hf)], env)
        assert cmd[1:3] == ["-np", "8"] and str(hf) in cmd
    # already launched (torchrun/srun set the rank): run the entry point directly
    cmd, _ = _build([], {**env, "RANK": "0", "WORLD_SIZE": "2"})
    assert cmd[0] == sys.executable


@pytest.mark.parametrize(
    "argv, env, expect",
    [
        (["--launcher", "srun"], {}, "needs a SLURM allocation"),
        (["--nnodes", "4"], SLURM_ALLOC, "this SLURM job has 3 node(s)"),
        (["--launcher", "python", "--nproc-per-node", "2"], {}, "starts one process, not 2"),
        (["--launcher", "deepspeed", "--nnodes", "2"], {}, "needs --hostfile"),
        (["--config", "c.yaml", "notanoverride"], {}, "is not a key=value override"),
    ],
)
def test_launcher_one_line_errors(argv, env, expect):
    base = child_env()
    for k in [k for k in base if k.startswith(("SLURM_", "OMPI_"))]:
        base.pop(k)
    base.update(env)
    r = subprocess.run(
        [sys.executable, "-m", "launch", "--dry-run", *argv],
        cwd=ROOT,
        env=base,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], r.stderr


def test_dry_run_prints_command():
    r = run(
        [
            sys.executable,
            "launch/run.py",
            "--launcher",
            "torchrun",
            "--nproc-per-node",
            "2",
            "--dry-run",
            "--config",
            "configs/quickstart.yaml",
            "train.steps=3",
        ]
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("+ MASTER_ADDR=127.0.0.1 MASTER_PORT=")
    assert (
        "--nproc_per_node=2" in r.stdout
        and "megahash/pretrain.py --config configs/quickstart.yaml train.steps=3" in r.stdout
    )


# ---------------------------------------------------------------------------------- signals

TINY = [*conftest.TINY, "train.eval_interval=0", "train.save_interval=0"]


def wait_for_step(run_dir: Path, step: int, alive, timeout: float = 900, group: int | None = None) -> None:
    """Wait until ``run_dir``'s metrics.jsonl has reached ``step``; ``alive()`` False = the run ended. On a
    timeout the error lists the processes of process group ``group`` (state, kernel wait channel)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not alive():
            raise AssertionError(f"the run of {run_dir} ended before step {step}")
        try:
            if max(train_losses(run_dir), default=0) >= step:
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    where = f"; its processes: {group_states(group)}" if group is not None else ""
    raise AssertionError(f"no step {step} in {run_dir} after {timeout}s{where}; load {os.getloadavg()}")


def group_states(pgid: int) -> list[str]:
    """'PID STATE WCHAN' of each process of process group ``pgid`` (from /proc), for a failure message."""
    out = []
    for pid, fields in _proc_stats():
        if int(fields[2]) == pgid:
            try:
                wchan = Path(f"/proc/{pid}/wchan").read_text()
            except OSError:
                continue
            out.append(f"{pid} {fields[0]} {wchan}")
    return out


def continue_group(pgid: int, settle: float = 2.0) -> None:
    """SIGCONT to process group ``pgid``, again while any of its processes is still stopped: a child being
    forked while the group's SIGSTOP arrived can stop after the first SIGCONT (seen: a run's helper process
    left in state T, the run waiting on it forever)."""
    import signal

    deadline = time.time() + settle
    while True:
        os.killpg(pgid, signal.SIGCONT)
        stopped = [f for _, f in _proc_stats() if int(f[2]) == pgid and f[0] in ("T", "t")]
        if not stopped or time.time() > deadline:
            return
        time.sleep(0.05)


def _proc_stats():
    """(pid, the fields of /proc/PID/stat after the command name) of every process now running."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            yield int(stat.parent.name), stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue


def descendants(pids) -> list[int]:
    """``pids`` and all their descendant processes (from /proc)."""
    children: dict[int, list[int]] = {}
    for pid, fields in _proc_stats():
        children.setdefault(int(fields[1]), []).append(pid)
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def signal_during_save(run_dir: Path, pids, sig=signal.SIGUSR1, timeout: float = 120) -> bool:
    """Wait until a checkpoint is being written (``step_N.tmp`` exists), then send ``sig`` to the
    ranks ``pids()`` and, like SLURM's signal to a job step, to every process under them, again to
    each helper process that appears while the save runs. True if the save was still in progress
    after the signals were sent."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        tmp = list(run_dir.glob("step_*.tmp")) if run_dir.is_dir() else []
        if tmp:
            sent: set[int] = set()
            during = False
            ranks = pids()
            end = time.time() + 5
            while time.time() < end and tmp[0].exists():
                for pid in descendants(ranks):
                    if pid not in sent:
                        try:
                            os.kill(pid, sig)
                        except ProcessLookupError:
                            pass
                        sent.add(pid)
                        during = during or tmp[0].exists()
                time.sleep(0.01)
            return during
        time.sleep(0.001)
    return False


def test_sigusr1_checkpoints_and_exits_3_and_second_signal_is_harmless(shakespeare_shards, tmp_path):
    """Without SLURM: SIGUSR1 mid-run -> checkpoint at the next step boundary, exit 3; a second
    SIGUSR1 while that checkpoint is being written leaves it complete; resuming reproduces the
    uninterrupted run's per-step losses."""
    base = [
        f"data.prefix=[{shakespeare_shards['prefix']}]",
        f"data.tokenizer={shakespeare_shards['tokenizer']}",
        *TINY,
        "train.steps=40",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    # forked from the test fork server (conftest.popen): the trainer's signal handling is tested, not start-up
    ref = conftest.popen(
        [sys.executable, "megahash/pretrain.py", *base, f"train.save_dir={straight}"],
        subprocess.PIPE,
        subprocess.STDOUT,
    )
    proc = conftest.popen(
        [sys.executable, "megahash/pretrain.py", *base, f"train.save_dir={split}"], subprocess.PIPE, subprocess.STDOUT
    )
    try:
        wait_for_step(split, 3, lambda: proc.poll() is None)
        proc.send_signal(signal.SIGUSR1)
        during = signal_during_save(split, lambda: [proc.pid])
        out, _ = proc.communicate(timeout=300)
        ref_out, _ = ref.communicate(timeout=300)
    finally:
        for p in (proc, ref):
            if p.poll() is None:
                p.kill()
    assert proc.returncode == 3, out[-3000:]
    assert ref.returncode == 0, ref_out[-3000:]
    assert during, "the second signal did not land while the checkpoint was being written"
    stop = int((split / "latest").read_text().strip().split("_")[1])
    assert 3 <= stop < 40 and f"stopped at step {stop} (signal 10)" in out
    assert not list(split.glob("*.tmp")) and (split / f"step_{stop:08d}" / "megahash_state.json").is_file()
    r = pretrain_here([*base, f"train.save_dir={split}"])  # the resume, in this process
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {split}/step_{stop:08d}" in r.stdout
    a, b = train_losses(straight), train_losses(split)
    assert sorted(b) == list(range(1, 41))
    assert [a[s] for s in range(1, 41)] == [b[s] for s in range(1, 41)]


def test_rendezvous_ports_are_outside_the_ephemeral_range():
    """A rendezvous port drawn from the kernel's ephemeral range can be taken by another process's
    outgoing connection before the store binds it (seen under two test workers)."""
    import socket
    from pathlib import Path

    from megahash.launching.env import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1, ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


@pytest.mark.parametrize(
    "typo, message",
    [
        ("train.stpes=5", "unknown config key 'train.stpes'"),
        ("model.schedule=uniform:mhaa", "unknown attention kind 'mhaa'"),
    ],
)
def test_quickstart_passes_config_errors_through_as_one_line(typo, message):
    """A config typo given to launch/quickstart.sh: its one-line error, exit 2, before any data step or
    the deepspeed launcher (issue 29: an 11-line traceback, exit 1, before)."""
    r = subprocess.run(
        ["bash", "launch/quickstart.sh", typo], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert "[2/6]" not in r.stdout and "[5/6]" not in r.stdout


def test_python_m_launch_checks_the_config_before_the_launcher():
    """`python -m launch` runs pretrain.py's torch-free checks once before exec'ing the launcher: a typo
    is one line, exit 2, and no launcher starts (under deepspeed it was one line per rank among the
    launcher's own)."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch",
            "--launcher",
            "deepspeed",
            "--nproc-per-node",
            "2",
            "--config",
            "configs/quickstart.yaml",
            "model.schedule=uniform:mhaa",
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (r.returncode, r.stdout) == (2, ""), (r.stdout[-2000:], r.stderr[-2000:])
    assert r.stderr.strip().splitlines() == [
        "error: unknown attention kind 'mhaa' in schedule 'uniform:mhaa' (did you mean 'mha'?)"
    ]


def test_a_finished_script_ignores_a_late_stop_signal(shakespeare_shards):
    """``pretrain.py`` run as the script (``main(exiting=True)``): a stop signal that comes after the run ended
    (SLURM's ``--signal=USR1@N`` again when a requeued job's limit nears) finds it ignored, so a finished rank
    exits 0 instead of 138; an in-process call (``exiting`` False) gets the caller's handlers back."""
    code = (
        "import os, signal, sys\n"
        "from megahash import pretrain\n"
        "exiting = sys.argv[1] == 'script'\n"
        "before = signal.getsignal(signal.SIGUSR1)\n"
        "status = pretrain.main(['--check', 'config', f'data.prefix=[{sys.argv[2]}]'], exiting=exiting)\n"
        "assert exiting or signal.getsignal(signal.SIGUSR1) is before\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "sys.exit(status)\n"
    )
    for mode, status in (("script", 0), ("in-process", -signal.SIGUSR1)):
        r = subprocess.run(
            [sys.executable, "-c", code, mode, shakespeare_shards["prefix"]],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == status, (mode, r.stdout[-2000:], r.stderr[-2000:])
