"""Why a cell of ``megahash sweep`` has no result: its failure record ``OUT/cells/CELL/sweep_failed.json``
(exit status and one-line error), written when its training or evaluation fails, read by the
end-of-sweep summary and the report (megahash.experiments.grid_report)."""

from __future__ import annotations

import json
import time

from megahash.atomic_write import write_text_atomic

FAILED_FILE = "sweep_failed.json"


def error_line(text: str) -> str:
    """The one-line error of a failed cell's log: its last ``error:`` line (megahash's one-line
    errors), else the last line of a traceback or of the log."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["(no output)"])[-1][:400]


def record_failure(cell, status: int, error: str) -> None:
    """``FAILED_FILE`` of a cell: its exit status and one-line error (the report names it)."""
    record = {
        "cell": cell.name,
        "label": cell.label,
        "exit": status,
        "error": error,
        "log": str(cell.dir / "sweep.log"),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_text_atomic(cell.dir / FAILED_FILE, json.dumps(record, indent=1) + "\n")


def failure(cell) -> dict | None:
    """The recorded failure of a cell that is not done (None: none recorded)."""
    try:
        return None if cell.done else json.loads((cell.dir / FAILED_FILE).read_text())
    except (OSError, ValueError):
        return None
