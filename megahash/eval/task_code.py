"""Task YAMLs that would run Python (issue 47 item 6), refused unless the user trusts the tasks directory.

lm-eval (0.4.13) runs Python a task file names in three ways: ``!function MODULE.NAME`` imports
``MODULE.py`` beside the YAML (or any importable module) and calls the function (``process_docs``,
``process_results``, ``doc_to_text``, ``custom_dataset``, a metric, a ``class``); a metric name it does
not register (or ``hf_evaluate: true``) is loaded with Hugging Face ``evaluate``, which runs a Python
script (a local path or the Hub's); and the ``doc_to_*`` templates render in an unsandboxed Jinja
environment, where ``{{ lipsum.__globals__['os'] }}`` reaches the operating system. Without
``--trust-task-code`` (``eval.trust_task_code``), ``megahash eval --tasks-dir DIR`` runs none of them:

- :func:`task_code` finds, before lm-eval reads DIR, every ``!function`` and ``class`` in its YAML files
  and in the files they ``include`` (lm-eval's own task folders excepted: installed code, like lm-eval
  itself), every metric lm-eval would hand to ``evaluate``, and every template that names an underscored
  attribute; :func:`refuse_task_code` turns the first into one line naming the file and the flag;
- :func:`sandboxed_templates` renders every template in Jinja's ``ImmutableSandboxedEnvironment`` while
  the tasks run (https://jinja.palletsprojects.com/en/stable/sandbox/), so what the static look misses
  (an attribute name built at render time) is refused there, in one line.

The suites ``data_tools/make_eval_tasks.py`` writes use none of these and need no flag.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from megahash.errors import ConfigError

FLAG = "--trust-task-code (eval.trust_task_code=true)"


def _loader(tags: list):
    """A safe YAML loader (aliases and nesting bounded: megahash/safe_yaml.py) that records lm-eval's
    ``!function`` (any ``!`` tag) instead of importing it."""
    import yaml

    from megahash import safe_yaml

    class L(safe_yaml.Loader):
        pass

    def record(loader, suffix, node):
        value = loader.construct_scalar(node) if isinstance(node, yaml.ScalarNode) else "..."
        tags.append(f"!{suffix} {value}")
        return f"!{suffix} {value}"

    L.add_multi_constructor("!", record)
    return L


def _walk(x, seen=None):
    """Every dict inside a YAML document, each once (aliases are shared objects: nested anchors stay linear)."""
    seen = set() if seen is None else seen
    if id(x) in seen:
        return
    seen.add(id(x))
    if isinstance(x, dict):
        yield x
        for v in x.values():
            yield from _walk(v, seen)
    elif isinstance(x, list):
        for v in x:
            yield from _walk(v, seen)


def _unsafe_template(text: str) -> str | None:
    """The underscored attribute a Jinja template names (``x.__globals__``, ``x['_y']``, ``x|attr('_y')``)."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        tree = ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError:
        return None  # lm-eval's own error names it
    for n in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
        name = n.attr if isinstance(n, nodes.Getattr) else None
        if isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Const):
            name = n.arg.value
        if isinstance(n, nodes.Filter) and n.name == "attr" and n.args and isinstance(n.args[0], nodes.Const):
            name = n.args[0].value
        if isinstance(name, str) and name.startswith("_"):
            return name
    return None


def _registered_metric(name: str) -> bool:
    import lm_eval.api.metrics  # noqa: F401  (fills the registry)
    from lm_eval.api.registry import metric_registry

    return name in metric_registry


def _lm_eval_tasks() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


def _scan(path: Path, found: list[str], seen: set) -> None:
    import yaml

    from megahash import safe_yaml

    path = path.resolve()
    if path in seen or _lm_eval_tasks() in path.parents:
        return
    seen.add(path)
    tags: list[str] = []
    try:  # the bytes, as lm-eval hands them to libyaml: UTF-16 with a byte-order mark is read too (read as
        # UTF-8 text here, such a file was passed over and its !function ran without the flag)
        data = safe_yaml.load(path.read_bytes(), f"task file {path}", _loader(tags))
    except OSError:
        return  # lm-eval cannot open it either (a file past safe_yaml's bounds is its one-line ConfigError)
    except yaml.YAMLError as e:  # what this reader cannot see into is not known to be free of code
        found.append(f"{path}: not readable as YAML here ({type(e).__name__}), so not checked for Python")
        return
    found += [f"{path}: {t[:100]}" for t in tags]
    for d in _walk(data):
        if "class" in d:
            found.append(f"{path}: class {str(d['class'])[:100]}")
        metrics = d.get("metric_list") if isinstance(d.get("metric_list"), list) else []
        for m in metrics:
            name = m.get("metric") if isinstance(m, dict) else None
            if isinstance(name, str) and (m.get("hf_evaluate") is True or not _registered_metric(name)):
                found.append(f"{path}: metric {name[:100]!r} (not lm-eval's: Hugging Face evaluate runs its script)")
        for key, value in d.items():
            if isinstance(value, str) and ("{{" in value or "{%" in value):
                bad = _unsafe_template(value)
                if bad is not None:
                    found.append(f"{path}: the template of {str(key)[:40]} reaches {bad[:40]}")
        includes = d.get("include")
        for inc in [includes] if isinstance(includes, str) else includes if isinstance(includes, list) else []:
            if isinstance(inc, str):
                _scan(Path(inc) if Path(inc).is_absolute() else path.parent / inc, found, seen)


def task_code(tasks_dir) -> list[str]:
    """``FILE: what`` for every piece of Python the task files under ``tasks_dir`` would have lm-eval run
    (module docstring); empty when there is none."""
    found: list[str] = []
    seen: set = set()
    root = Path(tasks_dir)
    for path in sorted([*root.rglob("*.yaml"), *root.rglob("*.yml")]):
        _scan(path, found, seen)
    return found


def refuse_task_code(tasks_dir) -> None:
    """One-line ConfigError naming the first file under ``tasks_dir`` that would run Python, and the flag."""
    found = task_code(tasks_dir)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ConfigError(
            f"{found[0]}{more}: task files that run Python are refused; if you trust {tasks_dir}, pass {FLAG}"
        )


@contextlib.contextmanager
def sandboxed_templates():
    """While the block runs, lm-eval renders task templates in Jinja's sandbox (same filters, undefined and
    newline handling as its own environment); an unsafe access is a one-line ConfigError."""
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from lm_eval import utils

    real = utils.env
    sandbox = ImmutableSandboxedEnvironment(
        loader=real.loader, undefined=real.undefined, keep_trailing_newline=real.keep_trailing_newline
    )
    sandbox.filters.update({k: v for k, v in real.filters.items() if k not in sandbox.filters})
    utils.env = sandbox
    try:
        yield
    except SecurityError as e:
        raise ConfigError(
            f"a task template was refused ({str(e)[:160]}); if you trust the tasks, pass {FLAG}"
        ) from None
    finally:
        utils.env = real
