"""Where a suite run left the cores idle: read the ``.timeline.json`` that ``pytest --record-durations PATH``
writes beside PATH (tests/conftest.py: each test's worker, start and end, and the machine's busy cores every 2 s),
print the idle core-seconds per minute of the run and, for the idlest stretches, the tests that were running.

    python benchmarks/suite_timeline.py /tmp/megahash-ci-durations.timeline.json [--cores 2] [--top 12]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline", type=Path)
    ap.add_argument("--cores", type=float, default=2.0, help="the machine's cores (idle = cores - busy)")
    ap.add_argument("--top", type=int, default=12, help="how many of the idlest 10-second stretches to explain")
    args = ap.parse_args()
    data = json.loads(args.timeline.read_text())
    tests, busy = data["tests"], data["busy_cores"]
    if not busy:
        raise SystemExit(f"error: {args.timeline} has no busy-core samples (not recorded on Linux?)")
    t0 = min([b[0] for b in busy] + [s[1] for s in tests.values()])
    step = busy[1][0] - busy[0][0] if len(busy) > 1 else 2.0
    idle = [(t, max(0.0, args.cores - b) * step) for t, b in busy]
    total = sum(i for _, i in idle)
    print(f"{len(tests)} tests, {busy[-1][0] - t0:.0f} s from the first sample, idle {total:.0f} core-seconds in all")

    def per(seconds: int) -> dict[int, float]:
        """Idle core-seconds per ``seconds``-long stretch of the run, by the stretch's index."""
        out: dict[int, float] = {}
        for t, i in idle:
            out[int((t - t0) // seconds)] = out.get(int((t - t0) // seconds), 0.0) + i
        return out

    print("minute: idle core-seconds")
    print("  ".join(f"{m}:{v:.0f}" for m, v in sorted(per(60).items())))
    for w, v in sorted(per(10).items(), key=lambda kv: -kv[1])[: args.top]:
        a, b = t0 + 10 * w, t0 + 10 * w + 10
        running = [f"{s[0]} {k}" for k, s in tests.items() if s[1] < b and s[2] > a]
        print(f"\n[{10 * w}-{10 * w + 10} s] idle {v:.0f} core-s; running: " + ("; ".join(running) or "nothing"))


if __name__ == "__main__":
    main()
