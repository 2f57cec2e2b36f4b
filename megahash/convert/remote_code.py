"""The Hugging Face remote-code folder, assembled at export time from the library's own torch-only code.

The model exists once (issue 19): ``megahash export-hf`` writes no hand-written second copy of any
kind. The folder holds

* the torch-only library modules (:data:`LIBRARY_FILES`: the shared ops, the model shell, the
  ``PreTrainedModel`` wrapper, the config class, the kinds' torch-only bases (:mod:`megahash.models.mixing`
  and the attention families'), every attention kernel of :mod:`megahash.ops`; the numpy-only text coder
  and every module of :mod:`megahash.hashing`) copied verbatim, each
  ``from megahash.x import y`` rewritten to the folder's relative import (transformers loads remote
  code as one flat package: ``dynamic_module_utils.get_relative_import_files`` follows
  ``from .name import ...`` to ``name.py`` next to the module);
* one module per kind file the model uses: the attention kind's class (``register_attention(name, Kind)``,
  written once; the shell derives its plain-torch layer) or the definitions marked with
  ``@register_reference`` (decorators stripped), and the top-level names they use (torch-only imports,
  helpers), read from the kind's own file by :mod:`megahash.kind_source`;
* ``megahash_references.py``: the table {kind name: class} the shell builds layers, embedding and head
  from.

A kind with no reference makes :func:`missing_references` name it (the export checks it before
writing anything).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

from megahash import kind_source
from megahash.errors import ConfigError

MODELING_MODULE = "modeling_megahash"
CONFIG_MODULE = "configuration_megahash"
TABLE_MODULE = "megahash_references"

# library module -> its file in the folder (without .py); copied verbatim, imports made relative
LIBRARY_FILES = {
    "megahash.models.hf_config": CONFIG_MODULE,
    "megahash.errors": "megahash_errors",
    "megahash.models.arch": "megahash_arch",
    "megahash.models.mixing": "megahash_mixing",
    "megahash.models.attention.softmax_base": "megahash_attention_softmax_base",
    "megahash.models.attention.linear_base": "megahash_attention_linear_base",
    "megahash.models.attention.separate_qkv": "megahash_attention_separate_qkv",
    "megahash.models.reference_ops": "megahash_reference_ops",
    "megahash.models.residual_mix": "megahash_residual_mix",
    "megahash.models.value_embeds": "megahash_value_embeds",
    "megahash.models.reference_layers": "megahash_reference_layers",
    "megahash.models.hf_model": MODELING_MODULE,
    "megahash.hashing.text_coder": "hashing_megahash",
}
# megahash/hashing (numpy only) verbatim: megahash.hashing.codes -> megahash_hashing_codes.py, ...
LIBRARY_FILES.update(
    {
        f"megahash.hashing.{p.stem}": f"megahash_hashing_{p.stem}"
        for p in sorted((Path(__file__).resolve().parents[1] / "hashing").glob("*.py"))
        if p.stem not in ("__init__", "text_coder")
    }
)
# megahash/ops (the attention kernels, torch only) verbatim: megahash.ops.taylor.chunk -> megahash_ops_taylor_chunk.py
_OPS = Path(__file__).resolve().parents[1] / "ops"
LIBRARY_FILES.update(
    {
        "megahash.ops." + ".".join(p.relative_to(_OPS).with_suffix("").parts): "megahash_ops_"
        + "_".join(p.relative_to(_OPS).with_suffix("").parts)
        for p in sorted(_OPS.rglob("*.py"))
        if p.name != "__init__.py"
    }
)
GENERATED = {"megahash.models.reference_table": TABLE_MODULE}
# what a kind's reference section may import besides the torch-only library modules
ALLOWED_TOP = {"__future__", "torch", "math", "typing"}


def kind_module_file(module: str) -> str:
    """``megahash.models.attention.mha`` -> ``megahash_attention_mha``."""
    tail = module[len("megahash.models.") :] if module.startswith("megahash.models.") else module
    return "megahash_" + tail.replace(".", "_")


def _reference_names(module: str) -> set:
    """Names of the reference classes a module defines (another kind's reference may import them)."""
    path = kind_source.module_file(module) if module else None
    return {n.name for n in kind_source.read(path).reference_defs()} if path is not None else set()


def _has_references(module: str) -> bool:
    return bool(module) and bool(_reference_names(module))


def _import_target(module: str) -> str:
    if module in LIBRARY_FILES:
        return LIBRARY_FILES[module]
    if module in GENERATED:
        return GENERATED[module]
    if _has_references(module):
        return kind_module_file(module)
    raise ConfigError(
        f"remote code: {module} is not a torch-only library module the export can copy "
        f"(megahash.convert.remote_code.LIBRARY_FILES)"
    )


def _relative(node: ast.ImportFrom) -> str:
    names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
    return f"from .{_import_target(node.module)} import {names}"


def _deferred(node: ast.ImportFrom) -> str:
    """A function-local import, as an ``importlib`` call transformers' import scan does not follow (the
    folder's visible import graph stays acyclic; the entry modules name what it reaches)."""
    mod = f'__import__("importlib").import_module(".{_import_target(node.module)}", __package__)'
    return "; ".join(f"{a.asname or a.name} = {mod}.{a.name}" for a in node.names)


def rewrite_imports(source: str, where: str) -> str:
    """``from megahash.x import y`` -> ``from .file import y`` at module level, an ``importlib`` call
    inside functions (:func:`_deferred`); the rest verbatim."""
    lines = source.split("\n")
    tree = ast.parse(source)
    top = {id(node) for node in tree.body}
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "megahash" for a in node.names):
            raise ConfigError(
                f"remote code: {where} line {node.lineno}: use 'from megahash.x import y' "
                "(the export rewrites it to a relative import)"
            )
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "megahash":
            edits.append(node)
    for node in sorted(edits, key=lambda n: n.lineno, reverse=True):
        first = lines[node.lineno - 1]
        indent = first[: len(first) - len(first.lstrip())]
        lines[node.lineno - 1 : node.end_lineno] = [indent + (_relative(node) if id(node) in top else _deferred(node))]
    return "\n".join(lines)


def _allowed(module: str) -> bool:
    return module.split(".")[0] in ALLOWED_TOP or module in LIBRARY_FILES


def extract_references(module: str) -> tuple[str, list[str]]:
    """(source of the folder module, kind modules it imports) from a kind file: its attention kinds' classes
    and its ``@register_reference`` definitions (decorators stripped; :meth:`KindFile.reference_defs`) and the
    top-level names they use (helpers, constants, imports of torch, math, typing and the torch-only library
    modules). They may import another kind file's (that file's module joins the folder)."""
    path = Path(inspect.getsourcefile(importlib.import_module(module)))
    f = kind_source.read(path)
    defs = f.reference_defs()
    if not defs:
        raise ConfigError(f"{path.name}: no attention kind class nor @register_reference definition")
    stmts, imported, unbound = f.closure(defs, annotations=not f.lazy_annotations)
    bad = {}
    for name, by in imported.items():
        source, attr = f.import_of(name)
        if not (_allowed(source) or (attr is not None and attr in _reference_names(source))):
            bad[name] = (by, source)
    if unbound or bad:
        what = sorted(
            [(by, f"{n}") for n, by in unbound.items()]
            + [(by, f"{n} (from {src}: not torch-only)") for n, (by, src) in bad.items()]
        )
        where = ", ".join(f"{n} (in {by})" for by, n in what)
        raise ConfigError(
            f"{path.name}: the plain-torch reference uses {where}; import it from torch, math, typing "
            "or a torch-only megahash module (megahash.convert.remote_code.LIBRARY_FILES), or define "
            "it in the kind's file from those"
        )
    future = [n for n in f.tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
    imports = future + [n for n in stmts if isinstance(n, (ast.Import, ast.ImportFrom)) and n not in future]
    deps = sorted(
        {
            f.import_of(a.asname or a.name)[0]
            for n in imports
            if isinstance(n, ast.ImportFrom)
            for a in n.names
            if (a.asname or a.name) in imported and not _allowed(f.import_of(a.asname or a.name)[0])
        }
    )
    out = []
    for node in imports:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = kind_source.resolve(node.module, node.level, f.module or "", f.is_package)
            used = [a for a in node.names if (a.asname or a.name) in imported]
            node = ast.ImportFrom(module=base, names=used, level=0)
            out.append(_relative(node) if base.split(".")[0] == "megahash" or base in deps else ast.unparse(node))
        elif isinstance(node, ast.Import):
            used = [a for a in node.names if (a.asname or a.name.split(".")[0]) in imported]
            out.append(ast.unparse(ast.Import(names=used)))
        else:
            out.append(f.text(node))
    out.append("")
    for node in stmts:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        first = (
            node.lineno
            if node in defs
            else min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        )
        out.append("\n" + "\n".join(f.lines[first - 1 : node.end_lineno]) + "\n")  # a reference's decorators stripped
    doc = (
        f'"""Plain-torch reference of {module} (extracted by megahash export-hf from the library\'s '
        f'{path.name}; do not edit)."""\n'
    )
    return doc + "\n".join(out).rstrip("\n") + "\n", deps


def references() -> dict:
    from megahash.models.reference_table import references as table

    return table()


def head_keys(cfg) -> list[str]:
    from megahash.objective_spec import objective_spec

    return [f"head:{objective_spec(cfg.train.objective).head_name(cfg.model.head)}"]


def needed_kinds(cfg, model) -> list[str]:
    """Reference names the model needs: its layers' attention kinds, its embedding kind and, unless
    its head is the vocabulary head over ``output_layer``, the head (``head:NAME``: the objective's own head or
    ``model.head``)."""
    from megahash.models import registry

    kinds = list(dict.fromkeys(model.layer_kinds if hasattr(model, "layer_kinds") else registry.schedule_kinds(cfg)))
    kinds += [f"input:{meta['kind']}" for meta in (e.export_meta() for e in model.kind_inputs())]  # inputs kinds add
    kinds.append(cfg.model.embedding)
    head = getattr(model, "head", None)
    if head is not None and not getattr(head, "uses_output_layer", False):
        table = references()
        keys = head_keys(cfg)
        kinds.append(next((k for k in keys if k in table), " or ".join(keys)))  # none: named as missing
    return kinds


def missing_references(cfg, model) -> list[str]:
    table = references()
    return [k for k in needed_kinds(cfg, model) if k not in table]


def check_references(cfg, model) -> None:
    """One-line error naming every kind of the model that has no plain-torch reference."""
    missing = missing_references(cfg, model)
    if missing:
        raise ConfigError(
            f"export-hf: no plain-torch reference (@register_reference) for kind(s) "
            f"{', '.join(missing)}; add one to the kind's file or use --format qwen2 where eligible"
        )


def assemble(kinds) -> dict:
    """{file name: text} of the remote code for the reference names ``kinds``."""
    table = references()
    missing = [k for k in kinds if k not in table]
    if missing:
        raise ConfigError(f"export-hf: no plain-torch reference (@register_reference) for kind(s) {', '.join(missing)}")
    files = {}
    for module, name in LIBRARY_FILES.items():
        path = Path(inspect.getsourcefile(importlib.import_module(module)))
        files[name + ".py"] = rewrite_imports(path.read_text(), path.name)
    entries, modules = [], {}
    for kind in kinds:
        cls = table[kind]
        modules.setdefault(cls.__module__, None)
        entries.append((kind, kind_module_file(cls.__module__), cls.__name__))
    todo = list(modules)
    while todo:
        module = todo.pop()
        if kind_module_file(module) + ".py" in files:
            continue
        text, deps = extract_references(module)
        files[kind_module_file(module) + ".py"] = text
        todo += deps
    imports = sorted({(f, c) for _, f, c in entries})
    body = "".join(f"from .{f} import {c}\n" for f, c in imports)
    rows = "".join(f"    {k!r}: {c},\n" for k, _, c in entries)
    files[TABLE_MODULE + ".py"] = (
        '"""{kind name: plain-torch reference class} of this model (written by megahash export-hf)."""\n'
        f"{body}\n_TABLE = {{\n{rows}}}\n\n\ndef references() -> dict:\n    return _TABLE\n"
    )
    return name_closure_in_entries(files, (CONFIG_MODULE, MODELING_MODULE))


_VISIBLE = re.compile(r"^\s*from\s+\.(\w+)\s+import", re.MULTILINE)  # what transformers' loader follows
_DEFERRED = re.compile(r'import_module\("\.(\w+)", __package__\)')


def name_closure_in_entries(files: dict, entries) -> dict:
    """The ``auto_map`` entry modules import, at their end, every folder module they reach (through
    deferred imports too): transformers 4.x-5.0 copy only an entry module's *direct* relative imports
    into their module cache, and scan the rest with a loop that never ends on an import cycle before
    4.56 (huggingface/transformers#40326); the visible import graph must stay acyclic."""
    visible = {n[:-3]: set(_VISIBLE.findall(t)) for n, t in files.items()}
    every = {m: deps | set(_DEFERRED.findall(files[m + ".py"])) for m, deps in visible.items()}
    out = dict(files)
    for entry in entries:
        seen, todo = set(), list(every[entry])
        while todo:
            m = todo.pop()
            if m not in seen and m in every:
                seen.add(m)
                todo += every[m]
        extra = sorted(seen - visible[entry] - {entry})
        if extra:
            out[entry + ".py"] = out[entry + ".py"].rstrip("\n") + (
                "\n\n\n# every folder module this one reaches (transformers 4.x copies direct imports only)\n"
                + "".join(f"from .{m} import __name__ as _folder_{m}  # noqa: E402,F401\n" for m in extra)
            )
            visible[entry] |= set(extra)
    cycle = _find_cycle(visible)
    if cycle:
        raise ConfigError(f"remote code: module-level import cycle {' -> '.join(cycle)} (import inside a function)")
    return out


def _find_cycle(graph: dict) -> list:
    """One cycle of ``graph`` ({node: successors}) as a path, or []."""
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m in graph and not state.get(m):
                found = visit(m)
                if found:
                    return found
        state[n] = 2
        stack.pop()
        return []

    for n in sorted(graph):
        if not state.get(n):
            found = visit(n)
            if found:
                return found
    return []


def write(out: Path, kinds) -> list[str]:
    """Write the remote code for ``kinds`` into ``out``; returns the file names."""
    from megahash.atomic_write import write_text_atomic

    files = assemble(kinds)
    for name, text in files.items():
        write_text_atomic(out / name, text)
    return sorted(files)


def stale_files(out: Path) -> list[Path]:
    """Remote-code files an earlier export may have left in ``out``."""
    names = {*(n + ".py" for n in LIBRARY_FILES.values()), TABLE_MODULE + ".py"}
    return [p for p in out.glob("*.py") if p.name in names or p.name.startswith("megahash_")]
