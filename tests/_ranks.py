"""One rank of conftest.pretrain_group: ``megahash.pretrain.main`` for each run of DIR/runs.json in turn, in this
process (started with the DeepSpeed launcher's environment). Run i's stdout and stderr (file descriptors 1 and 2,
so the libraries' prints too) go to DIR/i.RANK.out and .err, its exit status to DIR/i.RANK.status; a run's
environment (``env``) and MASTER_PORT are set for it alone.

    python -u tests/_ranks.py DIR --local_rank=N
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, as megahash/pretrain.py does


def _run(argv: list[str]) -> int:
    from megahash.pretrain import main

    try:
        return main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except Exception:
        traceback.print_exc()
        return 1


def main() -> int:
    d, local = Path(sys.argv[1]), sys.argv[2]
    rank = os.environ["RANK"]
    for i, run in enumerate(json.loads((d / "runs.json").read_text())):
        before = {k: os.environ.get(k) for k in run["env"]}
        os.environ.update(run["env"])
        os.environ["MASTER_PORT"] = str(run["port"])
        saved = os.dup(1), os.dup(2)
        with open(d / f"{i}.{rank}.out", "w") as out, open(d / f"{i}.{rank}.err", "w") as err:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
            try:
                status = _run([local, *run["argv"]])  # where the launcher puts it
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(saved[0], 1), os.dup2(saved[1], 2)
                os.close(saved[0]), os.close(saved[1])
        (d / f"{i}.{rank}.status").write_text(str(status))
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return 0


if __name__ == "__main__":
    sys.exit(main())
