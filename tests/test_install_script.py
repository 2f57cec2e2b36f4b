"""launch/install_cpu.sh: torch from PyTorch's CPU wheel index (TORCH_INDEX_URL), the configured
index when that one is unreachable, and its steps printed (dry run: the commands it would run)."""
import functools
import http.server
import subprocess
import threading

from conftest import ROOT, child_env


def _install(url):
    env = child_env(INSTALL_DRY_RUN="1", INSTALL_FORCE="1", TORCH_INDEX_URL=url)
    r = subprocess.run(["bash", "launch/install_cpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_cpu_index_used_when_reachable_else_configured_index(tmp_path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
        (tmp_path / "whl" / "cpu" / "torch").mkdir(parents=True)
        out = _install(url)
    finally:
        server.shutdown()
    assert f"-m pip install -q --index-url {url} torch==2.13.0" in out
    assert "[1/3]" in out and "[2/3]" in out and "[3/3]" in out and "-c constraints/cpu-lock.txt" in out
    out = _install("http://127.0.0.1:9/whl/cpu")  # nothing listens on the discard port
    assert "is unreachable: using pip's configured index" in out
    assert "-m pip install -q torch==2.13.0" in out and "--index-url" not in out
