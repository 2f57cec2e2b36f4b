"""CPU training keeps freed memory in glibc's heap (``accelerator.tune_host_allocator``): a large
buffer freed and allocated again is not page-faulted in a second time. Counted with the kernel's
minor-fault counter of the process (``getrusage``), not timed."""
import sys

import pytest

from conftest import run

SCRIPT = """
import resource, torch
from megahash import accelerator
tuned = accelerator.tune_host_allocator()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(16 << 20)  # 64 MiB: above glibc's largest mmap threshold (32 MiB)
del x
f0 = faults()
y = torch.ones(16 << 20)
print(tuned, faults() - f0)
"""
PAGES = (64 << 20) // 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_activations_are_reused_not_faulted_in_again():
    on = run([sys.executable, "-c", SCRIPT])
    off = run([sys.executable, "-c", SCRIPT], MEGAHASH_MALLOC_TUNING="0")
    assert on.returncode == 0 and off.returncode == 0, on.stderr[-2000:] + off.stderr[-2000:]
    tuned_on, faults_on = on.stdout.split()
    tuned_off, faults_off = off.stdout.split()
    assert (tuned_on, tuned_off) == ("True", "False")
    assert int(faults_off) >= PAGES * 0.9, faults_off  # glibc's default: fresh pages for every 64 MiB
    assert int(faults_on) < PAGES * 0.05, faults_on  # tuned: the freed heap memory is reused
