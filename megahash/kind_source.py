"""The one reader of kind files' source (torch-free): each file parsed once (cached), then asked.

A kind file is ordinary Python (imports at the top, its plain-torch reference, its megatron-core
implementation, its register lines). Three users read it without importing it (importing a kind file
imports torch and megatron-core, seconds):

- :mod:`megahash.catalog`: the register lines (:meth:`KindFile.registrations`) and the values of their
  ``caps=``, ``costs=`` and ``options=`` for config checks and closed-form costs;
- :mod:`megahash.convert.remote_code`: the plain-torch section of the HF export, found by what it is: the
  attention kinds' classes (``register_attention(name, Kind, ...)``: each written once, its plain-torch layer
  derived in the export), the definitions decorated ``@register_reference`` (embeddings, heads, kind inputs)
  and the top-level names they use (:meth:`KindFile.closure`);
- ``tests/kind_leaks.py``: the parsed tree, the register calls and the public names.

:meth:`KindFile.value` executes a top-level name of a file with only what it needs of the same file
(helpers, constants, bases: :meth:`closure`). Its imports run for real when the imported module is
torch-free (the standard library, a megahash module whose top-level imports are all torch-free,
recursively); a name imported from any other module (a kind file, ``megahash/ops``, a plugin) is itself
read from that module's source the same way; a name from torch, megatron-core or another third-party
package is a one-line error.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from megahash.errors import ConfigError

ROOT = Path(__file__).resolve().parent  # the megahash package
REGISTER = {
    "register_attention": "attention",
    "register_embedding": "embedding",
    "register_head": "head",
    "register_input": "input",
}  # register line -> group
BUILTINS = frozenset(dir(builtins)) | {"__name__", "__class__", "__file__"}


@dataclass(frozen=True)
class Registration:
    """One ``register_<group>("name", key=value, ...)`` call of a file."""

    group: str
    name: str
    call: ast.Call

    def keyword(self, key: str):
        return next((k.value for k in self.call.keywords if k.arg == key), None)


def module_file(module: str) -> Path | None:
    """The source file of a module, without importing it (megahash modules by path)."""
    if module == "megahash" or module.startswith("megahash."):
        base = ROOT.parent / Path(*module.split("."))
        return next((c for c in (base.with_suffix(".py"), base / "__init__.py") if c.is_file()), None)
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def _stdlib(module: str) -> bool:
    return module.split(".")[0] in sys.stdlib_module_names or module == "__future__"


def _top_imports(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    out = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append(resolve(node.module, node.level, module, is_package))
    return out


_VISITING: set = set()  # modules whose lightness is being decided (an import cycle decides by its other imports)
_LIGHT: dict = {}  # module -> decided at the top of a search (inner answers may assume a cycle light)


def is_light(module: str) -> bool:
    """Does importing ``module`` stay torch-free? The standard library, or a megahash module (and its
    packages) whose top-level imports are all light; anything else is not."""
    if module not in _LIGHT:
        top = not _VISITING
        light = _is_light(module)
        if top:
            _LIGHT[module] = light
        return light
    return _LIGHT[module]


def _is_light(module: str) -> bool:
    if _stdlib(module):
        return True
    if not (module == "megahash" or module.startswith("megahash.")):
        return False
    if module in sys.modules and "torch" not in sys.modules:
        return True  # imported already, and torch is not: its import was torch-free (no file to parse)
    _VISITING.add(module)
    try:
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            path = module_file(".".join(parts[:i]))
            if path is None:
                return False
            f = read(path)
            imports = _top_imports(f.tree, f.module or "", f.is_package)
            if any(m != f.module and m not in _VISITING and not is_light(m) for m in imports):
                return False
        return True
    finally:
        _VISITING.discard(module)


def resolve(module: str | None, level: int, here: str, is_package: bool) -> str:
    """Absolute module of ``from <level dots><module> import ...`` written in module ``here``."""
    if not level:
        return module or ""
    parts = here.split(".") if here else []
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join(parts + ([module] if module else []))


def free_names(node, annotations: bool = True) -> set:
    """Names a definition or statement loads that none of its own scopes binds (coarse: any binding
    anywhere inside counts); ``@register_reference`` decorators excluded (stripped from the HF export)."""
    loaded, bound = set(), set()
    skip = set()
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        skip = {id(d) for d in node.decorator_list if is_reference_decorator(d)}
    if not annotations:
        skip |= {id(n.annotation) for n in ast.walk(node) if isinstance(n, (ast.AnnAssign, ast.arg)) and n.annotation}
        skip |= {
            id(n.returns)
            for n in ast.walk(node)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns
        }
    todo = [node]
    while todo:
        n = todo.pop()
        if id(n) in skip:
            continue
        if isinstance(n, ast.Name):
            (loaded if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n is not node:
            bound.add(n.name)
        elif isinstance(n, ast.alias):
            bound.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
        todo.extend(ast.iter_child_nodes(n))
    return loaded - bound


def is_reference_decorator(d: ast.expr) -> bool:
    f = d.func if isinstance(d, ast.Call) else d
    return (isinstance(f, ast.Name) and f.id == "register_reference") or (
        isinstance(f, ast.Attribute) and f.attr == "register_reference"
    )


class KindFile:
    """One parsed source file (a kind file, or a module a kind file imports from)."""

    def __init__(self, path: Path, source: str | None = None):
        self.path = path
        self.source = path.read_text() if source is None else source
        self.lines = self.source.split("\n")
        self.tree = ast.parse(self.source, str(path))
        self.is_package = path.name == "__init__.py"
        self.module = _module_of(path)
        self.bindings: dict[str, ast.stmt] = {}  # top-level name -> the (last) statement binding it
        for node in self.tree.body:
            for name in _bound_by(node):
                self.bindings[name] = node
        self._env: dict = {"__builtins__": builtins, "__name__": f"megahash_kind_source.{path.stem}"}
        self._done: set = set()

    # ------------------------------------------------------------------ what the file says

    def registrations(self) -> list[Registration]:
        """Every ``register_<group>("name", ...)`` call of the file (decorator or plain call)."""
        out = []
        for node in ast.walk(self.tree):
            if (
                isinstance(node, ast.Call)
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                fn = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if fn in REGISTER:
                    out.append(Registration(REGISTER[fn], node.args[0].value, node))
        return out

    def reference_defs(self) -> list:
        """The top-level definitions of the plain-torch side: the classes a ``register_attention(name, Kind,
        ...)`` line registers and the definitions decorated ``@register_reference``."""
        kinds = {
            r.call.args[1].id
            for r in self.registrations()
            if len(r.call.args) > 1 and isinstance(r.call.args[1], ast.Name)
        }
        return [
            n
            for n in self.tree.body
            if (isinstance(n, ast.ClassDef) and n.name in kinds)
            or (isinstance(n, (ast.ClassDef, ast.FunctionDef)) and any(map(is_reference_decorator, n.decorator_list)))
        ]

    def public_names(self) -> set:
        """Public top-level names the file defines (classes, functions, constants; not its imports)."""
        return {
            n
            for n, node in self.bindings.items()
            if not n.startswith("_") and not isinstance(node, (ast.Import, ast.ImportFrom))
        }

    def text(self, node) -> str:
        return "\n".join(self.lines[node.lineno - 1 : node.end_lineno])

    # ------------------------------------------------------------------ what a definition needs

    @property
    def lazy_annotations(self) -> bool:
        """Does the file say ``from __future__ import annotations`` (its annotations never run)?"""
        return any(
            isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
            for n in self.tree.body
        )

    def closure(self, roots, annotations: bool = True) -> tuple[list, dict, dict]:
        """(top-level statements ``roots`` need, in file order, ``roots`` included; {name: referrer} of the
        names they load that the file imports; {name: referrer} of the names bound nowhere in the file).
        ``annotations=False``: names used only in annotations do not count."""
        stmts, imported, unbound, seen = {}, {}, {}, set()
        todo = [(r, None) for r in roots]
        while todo:
            node, by = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            stmts[id(node)] = node
            here = getattr(node, "name", None) or by
            for name in sorted(free_names(node, annotations) - BUILTINS):
                dep = self.bindings.get(name)
                if dep is None:
                    unbound.setdefault(name, here)
                elif isinstance(dep, (ast.Import, ast.ImportFrom)):
                    imported.setdefault(name, here)
                    stmts[id(dep)] = dep
                elif dep is not node:
                    todo.append((dep, here))
        return sorted(stmts.values(), key=lambda n: (n.lineno, n.col_offset)), imported, unbound

    def import_of(self, name: str) -> tuple[str, str | None]:
        """(absolute module, attribute or None for ``import m``) a top-level import binds ``name`` to."""
        node = self.bindings[name]
        for a in node.names:
            if (a.asname or a.name.split(".")[0]) == name:
                if isinstance(node, ast.Import):
                    return (a.name if a.asname else name), None
                return resolve(node.module, node.level, self.module or "", self.is_package), a.name
        raise KeyError(name)

    def value(self, name: str):
        """The value of a top-level name, executed torch-free with only what it needs (module docstring)."""
        if name not in self._env:
            node = self.bindings.get(name)
            if node is None:
                raise ConfigError(f"{self.path}: no top-level {name}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module, attr = self.import_of(name)
                self._env[name] = self._import(module, attr, name, None)
            else:
                self._execute([node])
        return self._env[name]

    def evaluate(self, expr: ast.expr):
        """The value of an expression of the file (e.g. a register line's ``caps=``), torch-free."""
        self._execute([expr])
        code = compile(ast.Expression(body=expr), str(self.path), "eval", dont_inherit=True)
        return eval(code, self._env)  # the kind file's own expression, compiled from its parsed source

    def _execute(self, roots) -> None:
        stmts, imported, _ = self.closure(roots)
        for name, by in sorted(imported.items()):
            if name in self._env:
                continue
            module, attr = self.import_of(name)
            self._env[name] = self._import(module, attr, name, by)
        for node in stmts:
            if (
                id(node) in self._done
                or not isinstance(node, ast.stmt)
                or isinstance(node, (ast.Import, ast.ImportFrom))
            ):
                continue
            self._done.add(id(node))
            # annotations evaluated (dataclass fields need no module of their own): they must be torch-free too
            code = compile(ast.Module(body=[node], type_ignores=[]), str(self.path), "exec", dont_inherit=True)
            try:
                exec(code, self._env)  # one top-level statement of the kind file
            except NameError as e:  # a name the file binds nowhere
                raise ConfigError(
                    f"{self.path.name}: {getattr(node, 'name', f'line {node.lineno}')} uses "
                    f"{e.name}, which the file does not define"
                ) from None

    def _import(self, module: str, attr: str | None, name: str, by):
        if is_light(module):
            mod = importlib.import_module(module)
            return mod if attr is None else getattr(mod, attr)
        path = module_file(module) if attr is not None else None
        if path is None:
            raise ConfigError(
                f"{self.path.name}: {by or name} uses {name} from {module}, which is not torch-free "
                "(cost, option and caps values run without torch)"
            )
        return read(path).value(attr)


def _bound_by(node) -> list[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return [node.name]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name.split(".")[0]) for a in node.names if a.name != "*"]
    if isinstance(node, ast.Assign):
        return [
            n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        ]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _module_of(path: Path) -> str | None:
    """Dotted module of a file: under megahash by path, else by the sys.path entry it lies under (plugins)."""
    for base in [ROOT.parent] + [Path(p).resolve() for p in sys.path if p]:
        try:
            parts = list(path.relative_to(base).with_suffix("").parts)
        except ValueError:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        if all(p.isidentifier() for p in parts):
            return ".".join(parts)
    return None


@functools.cache
def _read(path: Path, stamp: tuple) -> KindFile:
    return KindFile(path)


@functools.cache
def _real(path: str) -> Path:
    return Path(path).resolve()


def read(path) -> KindFile:
    """The parsed file (once per process while the file is unchanged)."""
    path = _real(str(path))
    st = os.stat(path)
    return _read(path, (st.st_mtime_ns, st.st_size))


@functools.cache
def _read_head(path: Path, stamp: tuple, name: str) -> KindFile | None:
    text = path.read_text()
    m = re.search(rf"^(?:class|def) {name}\b|^{name}\s*[:=]", text, re.M)
    if m is None:
        return None
    end = _TOP_LEVEL.search(text, text.index("\n", m.end()) + 1 if "\n" in text[m.end() :] else len(text))
    return KindFile(path, text[: end.start() if end else len(text)])


_TOP_LEVEL = re.compile(r"^[^\s#)\]}]", re.M)  # the first line of a top-level statement (no closing bracket)


def read_head(path, name: str) -> KindFile | None:
    """The file parsed up to the end of the top-level statement that binds ``name`` (None: no such
    statement): what it defines after that is not read, so ``name`` and what it uses must come first
    (a feature's ``Config`` after its imports: megahash/feature_configs.py). Cached like :func:`read`."""
    path = _real(str(path))
    st = os.stat(path)
    return _read_head(path, (st.st_mtime_ns, st.st_size), name)
