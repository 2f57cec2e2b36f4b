"""With ``MEGAHASH_MALLOC_TUNING=1`` CPU training keeps freed memory in glibc's heap
(``host_allocator.tune_host_allocator``; off by default): a training-like allocation pattern, repeated, stops page-faulting after its first two steps (almost no
new pages touched, so the heap has settled), where glibc's defaults fault tens of thousands of
pages in again at every step. Counted with the kernel's minor-fault counter of the process
(``getrusage``), not timed."""

import json
import sys

import pytest

from conftest import run

SCRIPT = """
import json, resource, torch
from megahash.accelerator import host_allocator
tuned = host_allocator.tune_host_allocator()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
per_step = []
for step in range(8):
    f0 = faults()
    live = []
    for mib in (4, 16, 40, 64, 40, 16, 4):  # activations and gradients of different sizes ...
        live.append(torch.ones(mib << 18))
        small = [object() for _ in range(500)]  # ... with small allocations between them
    while live:  # freed in reverse, as backward does
        live.pop()
    per_step.append(faults() - f0)
print(json.dumps({"tuned": tuned, "faults": per_step}))
"""
STEP_PAGES = (4 + 16 + 40 + 64 + 40 + 16 + 4) * 256  # 4 KiB pages the step's buffers span


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_repeated_steps_stop_faulting_pages_in():
    on = run([sys.executable, "-c", SCRIPT], MEGAHASH_MALLOC_TUNING="1")
    off = run([sys.executable, "-c", SCRIPT])  # the default
    assert on.returncode == 0 and off.returncode == 0, on.stderr[-2000:] + off.stderr[-2000:]
    on, off = json.loads(on.stdout), json.loads(off.stdout)
    assert (on["tuned"], off["tuned"]) == (True, False)
    assert on["faults"][0] > STEP_PAGES * 0.9  # the first step touches its pages once
    # then (almost) none: in all of steps 3-8 fewer than one step's pages (0 in most runs; an
    # occasional step refills a fragment, e.g. 10,240)
    assert sum(on["faults"][2:]) < STEP_PAGES, on["faults"]
    assert all(f > STEP_PAGES * 0.5 for f in off["faults"][2:]), off["faults"]  # glibc's defaults: every step
