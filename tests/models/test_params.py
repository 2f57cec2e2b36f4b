"""`megahash params`: totals and per-layer splits equal the closed-form count of the architecture."""

import json
import subprocess
import sys

from conftest import ROOT, child_env


def params_json(*args):
    r = subprocess.run(
        [sys.executable, "-m", "megahash", "params", "--json", *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def decoder_count(V, h, ffn, L, tied=True):
    """Qwen2.5-style decoder: QKV with bias (3h^2 + 3h), output projection h^2, SwiGLU 3 h ffn,
    two RMSNorms per layer, final RMSNorm, V x h embedding (+ V x h head when untied)."""
    layer = (3 * h * h + 3 * h) + h * h + 3 * h * ffn + 2 * h
    return V * h * (1 if tied else 2) + L * layer + h


def test_500m_table_4_10_counts():
    r = params_json("--config", "configs/model/500m.yaml")
    assert r["total"] == decoder_count(50304, 896, 4864, 24) == 436_037_504  # DESIGN.md: ~436M tied
    assert r["embedding"] == 50304 * 896 and r["head"] == 0 and r["tied_head"]
    assert len(r["layers"]) == 24
    layer = r["layers"][0]
    assert layer["attention"] == {"qkv": 3 * 896 * 896 + 3 * 896, "out": 896 * 896}
    assert layer["mlp"] == 3 * 896 * 4864 and layer["norm"] == 2 * 896
    untied = params_json("--config", "configs/model/500m.yaml", "model.tie_embeddings=false")
    assert untied["total"] == decoder_count(50304, 896, 4864, 24, tied=False) == 481_109_888


def params_run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megahash", "params", *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_params_bad_override_is_one_line():
    r = params_run("model.num_heds=3")
    assert (
        r.returncode == 2
        and r.stderr.strip() == "error: unknown config key 'model.num_heds' (did you mean 'num_heads'?)"
    )


def test_a_schedule_naming_an_unregistered_kind_is_one_line():
    """A hybrid preset naming a kind that is not registered (e.g. a plugin not loaded): one line, exit 2, before
    torch; so is an option its kind does not declare."""
    unknown = params_run("model.schedule=hybrid:not-a-kind:3to1:mha+gated")
    undeclared = params_run("model.schedule=hybrid:swa:5to1:mha+window=8")
    assert unknown.stderr.startswith("error: unknown attention kind 'not-a-kind' in schedule"), unknown.stderr
    assert undeclared.stderr.startswith("error: attention kind 'mha' has no option 'window'"), undeclared.stderr
    assert all(r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 for r in (unknown, undeclared))


def test_reader_that_stops_early_gets_no_traceback():
    """`megahash params --json | head`: stdout's reader is gone; the command ends quietly with 141
    (as a SIGPIPE death reads in the shell), without a BrokenPipeError traceback (issue 29)."""
    import os

    for args in (["--json"], []):
        r, w = os.pipe()
        os.close(r)  # the reader has already gone: every write gets EPIPE
        try:
            p = subprocess.run(
                [sys.executable, "-m", "megahash", "params", "--config", "configs/model/500m.yaml", *args],
                cwd=ROOT,
                env=child_env(),
                stdout=w,
                stderr=subprocess.PIPE,
                text=True,
                timeout=600,
            )
        finally:
            os.close(w)
        assert (p.returncode, p.stderr) == (141, ""), p.stderr[-2000:]


def test_text_report_says_how_to_measure_instead_of_not_measured_cells():
    """Without --measure (closed form, no torch: the README's example) the cost table has the thesis rows
    only and one line naming --measure, not a column of "not measured" (issue 36)."""
    r = subprocess.run(
        [sys.executable, "-m", "megahash", "params", "--config", "configs/model/500m.yaml"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    assert "not measured" not in r.stdout and "implemented" not in r.stdout
    assert [l for l in r.stdout.splitlines() if "--measure" in l] == [
        "  the implementation's costs: add --measure (a meta-device model: imports torch and megatron-core, ~6 s of CPU; "
        "pretrain's MFU and `megahash report` always measure)"
    ]
    assert "  attention prefill FLOPs/token             1.266e+08" in r.stdout  # 24 x 5.276e6, [Xue25] Standard row
