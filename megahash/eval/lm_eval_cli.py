"""``megahash-lm-eval``: lm-eval's own command line, with the ``megahash`` model registered.

    megahash-lm-eval --model megahash --model_args checkpoint=runs/quickstart,batch_size=8 \\
        --tasks kjv_suite --include_path data/eval_tasks
    python -m megahash.eval.lm_eval_cli ...          # the same without the console script

Why a wrapper: lm-eval 0.4.13 looks models up only in its own registry (``lm_eval.models.MODEL_MAPPING``
and the ``@register_model`` classes of modules already imported); it has no entry-point or plugin
discovery for models (``--include_path`` adds tasks only). A plain ``lm_eval --model megahash`` in a
fresh shell therefore cannot find the name. This script imports :mod:`megahash.eval.lm` (which
registers ``megahash``) and hands every argument, unchanged, to lm-eval's CLI (``HarnessCLI``): all
of lm-eval's flags and subcommands work as with ``lm_eval``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from lm_eval.__main__ import cli_evaluate

    import megahash.eval.lm  # noqa: F401 - registers the lm-eval model name "megahash"

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
