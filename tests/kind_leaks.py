"""Which library files name a kind that is not theirs (issue 27 item 2), read with :mod:`ast` only
(no import of the files it reads, no torch).

A kind (attention, embedding, head) is the file that registers it. Its identifiers are:

- ``string``: a registered name as a string constant (docstrings excepted), e.g. ``"fixedseqqk"``;
- ``module``: its module, by any import (``import a.b.k``, ``from a.b import k``, ``from a.b.k import
  X``, relative forms), by an attribute chain through an imported package (``attention.k.X``) or by
  a string naming it (``importlib.import_module("a.b.k")``, ``".k"``, ``"a/b/k.py"``);
- ``name``: the public top-level names the kind file defines (classes, functions, constants) and its
  module's own name where that is not also a registered name (``fixed_qk``, not ``mlp``), used as
  an attribute (``model.set_fixed_tokens``), imported from elsewhere (a re-export), defined again
  at the top of another module (a second ``FixedInput``), read unbound (a ``*`` import) or as a
  string (``getattr(model, "fixed_qk")``; the module's own name also as a dotted part: ``"fixed_qk."``);
- ``config``: the fields of its options dataclass (``options=`` of its ``register_*`` line, or the
  declarations entry's ``.options``) read through a config section (``attention``, ``embed``, ``head``,
  ``options``): an attribute (``cfg.model.attention.options.fixed_text``), a dotted key in a string
  (``"model.attention.options.seed=3"``), a field of a section's class (``AttentionConfig``); a
  field of two or more words (``fixed_text``, not ``seed``) anywhere: any attribute, call keyword,
  class field or string equal to it (a one-word field is too common a word outside a section);
- ``home``: a kind registered outside the kind directories (its file is then a central one).

"Elsewhere" is every scanned file but the kind's own, including another kind's file. A kind file
may import shared modules (``base.py``, ``__init__.py``, anything that registers no kind). Generic
words that coincide are excused only by an allow-list of (identifier, path prefix) the caller passes.

Use: ``scan(root, catalog_kinds(root), allow=...)`` -> sorted :class:`Leak` records
(``tests/models/test_new_kind.py``); ``tests/test_kind_leaks.py`` plants one violation of each sort. Files are
parsed by the library's one reader of kind files (:mod:`megahash.kind_source`: each file once).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from megahash import kind_source

KIND_DIRS = ("megahash/models/attention/", "megahash/models/embeddings/", "megahash/models/heads/")
IMPORTERS = ("import_module", "__import__", "find_spec")
_PARTS = re.compile(r"[./:]")
SECTIONS = {"attention", "embed", "embedding", "head", "options"}  # where a kind's options are read from
_DOTTED = re.compile(r"(?<![\w.])(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)")  # a dotted key in a string: its last part


@dataclass(frozen=True)
class Kind:
    """One kind file: the names it registers and the identifiers that belong to it alone."""

    names: frozenset  # registered names
    file: Path  # resolved
    module: str | None  # dotted module name (None: outside the scanned root)
    public: frozenset  # public top-level names (and the module's own name, see above)
    fields: frozenset  # options fields
    home: bool  # in a kind directory

    @property
    def label(self) -> str:
        return "/".join(sorted(self.names))


@dataclass(frozen=True, order=True)
class Leak:
    path: str  # relative to the root, posix
    line: int
    identifier: str
    sort: str  # string | module | name | config | home
    kind: str  # the kind file's registered names

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.identifier} ({self.sort}, {self.kind})"


# ----------------------------------------------------------------------------- the kinds


def _module_name(path: Path, root: Path) -> str | None:
    try:
        rel = path.relative_to(root)
    except ValueError:
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _register_calls(path: Path):
    """(registered name, call node) of every ``register_*("name", ...)`` in a file."""
    return [(r.name, r.call) for r in kind_source.read(path).registrations()]


def _class_fields(tree: ast.Module, name: str) -> set[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign)
                and isinstance(s.target, ast.Name)
                and "ClassVar" not in ast.unparse(s.annotation)
            }
    return set()


def _option_fields(name: str, entry, path: Path) -> set[str]:
    """Fields of a kind's options dataclass: the entry's ``.options`` (a class or its name), else the
    ``options=`` keyword of the kind's ``register_*`` line; none without either."""
    opt = getattr(entry, "options", None)
    if opt is None:
        for reg, call in _register_calls(path):
            kw = next((k.value for k in call.keywords if k.arg == "options"), None)
            if reg == name and isinstance(kw, ast.Name):
                opt = kw.id
    if opt is None:
        return set()
    if isinstance(opt, str):
        return _class_fields(kind_source.read(path).tree, opt)
    if dataclasses.is_dataclass(opt):
        return {f.name for f in dataclasses.fields(opt)}
    return set(getattr(opt, "__annotations__", {}))


def kinds(entries, root: Path) -> list[Kind]:
    """The kind files of ``entries``: (name, entry) pairs, the entry with ``.file`` and optionally
    ``.options`` (names may repeat across groups: the embedding ``vocab`` and the head ``vocab``)."""
    root = root.resolve()
    entries = list(entries)
    by_file: dict[Path, list] = {}
    for name, e in entries:
        by_file.setdefault(Path(e.file).resolve(), []).append((name, e))
    all_names = {n.replace("-", "_") for n, _ in entries}
    out = []
    for path, named in sorted(by_file.items()):
        module = _module_name(path, root)
        rel = path.relative_to(root).as_posix() if module is not None else None
        home = rel is None or rel.startswith(KIND_DIRS)
        module = module if home else None  # a central module is imported for other things
        public = kind_source.read(path).public_names() if home else set()  # a central file's names are not the kind's
        if home and path.stem not in all_names and path.stem != "__init__":
            public.add(path.stem)  # fixed_qk, bert_hash; not mlp, vocab, add (common words, checked as strings)
        fields = set().union(*(_option_fields(n, e, path) for n, e in named))
        out.append(Kind(frozenset(n for n, _ in named), path, module, frozenset(public), frozenset(fields), home))
    return out


def catalog_kinds(root: Path) -> list[Kind]:
    """The kinds megahash registers (:mod:`megahash.catalog`: every group, torch-free)."""
    from megahash import catalog

    return kinds([(n, e) for g in catalog.GROUPS for n, e in catalog.entries(g).items()], root)


# ----------------------------------------------------------------------------- one file


def _docstrings(nodes) -> set[int]:
    docs = set()
    for node in nodes:
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            docs.add(id(body[0].value))
    return docs


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _bindings(nodes, here: str, is_package: bool) -> tuple[dict, set]:
    """({local name: dotted module it was imported as}, every name bound anywhere in the file)."""
    aliases, bound = {}, set()
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                aliases[local] = a.name if a.asname else local
                bound.add(local)
        elif isinstance(node, ast.ImportFrom):
            base = kind_source.resolve(node.module, node.level, here, is_package)
            for a in node.names:
                aliases[a.asname or a.name] = f"{base}.{a.name}"
                bound.add(a.asname or a.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return aliases, bound


def _distinctive(field: str) -> bool:
    return "_" in field.strip("_")


def _in_section(chain: str | None) -> bool:
    return bool(chain) and not SECTIONS.isdisjoint(chain.lower().split("."))


def _module_strings(k: Kind) -> set[str]:
    parts = k.module.split(".")
    return {k.module, "/".join(parts) + ".py", "." + parts[-1], ".".join(parts[-2:]), "/".join(parts[-2:]) + ".py"}


class _Index:
    """The kinds' identifiers as look-up tables (one pass over a file's nodes, whatever the kinds)."""

    def __init__(self, kinds_: list[Kind]):
        self.kinds = kinds_
        self.names, self.modstr, self.public, self.fields = {}, {}, {}, {}
        for k in kinds_:
            for n in k.names:
                self.names.setdefault(n, []).append(k)
            for n in _module_strings(k) if k.module else ():
                self.modstr.setdefault(n, []).append(k)
            for n in k.public:
                self.public.setdefault(n, []).append(k)
            for n in k.fields:
                self.fields.setdefault(n, []).append(k)
        self.modules = [(k.module, k) for k in kinds_ if k.module]
        self.stems = {}  # a module's own name where it is one of its public names (fixed_qk)
        for mod, k in self.modules:
            if mod.rsplit(".", 1)[-1] in k.public:
                self.stems.setdefault(mod.rsplit(".", 1)[-1], []).append(k)

    def of_module(self, full: str) -> list[Kind]:
        return [k for mod, k in self.modules if full == mod or full.startswith(mod + ".")]


def scan_file(path: Path, root: Path, kinds_, index: _Index | None = None) -> list[Leak]:
    """Every reference of ``path`` to a kind that is not its own."""
    path, root = path.resolve(), root.resolve()
    ix = index or _Index(kinds_)
    rel = path.relative_to(root).as_posix()
    here = _module_name(path, root) or ""
    is_package = path.name == "__init__.py"
    tree = kind_source.read(path).tree
    own = [k for k in ix.kinds if k.file == path]
    mine = set().union(*(k.names | k.public | k.fields for k in own)) | {k.module for k in own}
    nodes = list(ast.walk(tree))
    docs = _docstrings(nodes)
    aliases, bound = _bindings(nodes, here, is_package)
    top = {id(n) for n in tree.body}
    class_fields = {
        id(s): any(w in c.name.lower() for w in SECTIONS)
        for c in nodes
        if isinstance(c, ast.ClassDef)
        for s in c.body
        if isinstance(s, ast.AnnAssign)
    }  # -> is it a section's class
    found: set[Leak] = set()

    def leak(node, ident, sort, ks):
        for k in ks:
            what = k.module if sort == "module" else ident
            if k.file != path and what not in mine:
                found.add(Leak(rel, node.lineno, what, sort, k.label))

    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                leak(node, a.name, "module", ix.of_module(a.name))
        elif isinstance(node, ast.ImportFrom):
            base = kind_source.resolve(node.module, node.level, here, is_package)
            hit = ix.of_module(base)
            leak(node, base, "module", hit)
            for a in node.names if not hit else ():
                sub = ix.of_module(f"{base}.{a.name}")
                leak(node, base, "module", sub)
                if not sub:  # a kind's name re-exported by a shared module
                    leak(node, a.name, "name", ix.public.get(a.name, ()))
        elif isinstance(node, ast.Attribute):
            chain = _dotted(node)
            head = chain.split(".")[0] if chain else None
            full = aliases[head] + chain[len(head) :] if head in aliases else None
            hit = [k for k in ix.of_module(full) if k.module == full] if full else []
            leak(node, full, "module", hit)  # attention.fixed_qk (through an imported package)
            if not hit:
                leak(node, node.attr, "name", ix.public.get(node.attr, ()))
                if _distinctive(node.attr) or _in_section(_dotted(node.value)):
                    leak(node, node.attr, "config", ix.fields.get(node.attr, ()))
        elif isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load) and node.id not in bound:
                leak(node, node.id, "name", ix.public.get(node.id, ()))
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if id(node) in top:
                leak(node, node.name, "name", ix.public.get(node.name, ()))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name) and id(node) in top:
                    leak(node, t.id, "name", ix.public.get(t.id, ()))
                if (
                    isinstance(t, ast.Name)
                    and id(node) in class_fields
                    and (class_fields[id(node)] or _distinctive(t.id))
                ):
                    leak(node, t.id, "config", ix.fields.get(t.id, ()))
        elif isinstance(node, ast.keyword):
            if node.arg and _distinctive(node.arg):  # an option passed on (a parameter is its function's own)
                leak(node.value, node.arg, "config", ix.fields.get(node.arg, ()))
        elif isinstance(node, ast.Call):
            name = _imported_string(node)
            if name is not None:
                leak(node, name, "module", ix.of_module(name))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            s = node.value
            leak(node, s, "string", ix.names.get(s, ()))
            leak(node, s, "name", ix.public.get(s, ()))  # getattr(model, "fixed_qk")
            if s in ix.modstr:
                leak(node, s, "module", ix.modstr[s])
            else:
                for part in set(_PARTS.split(s)) - {s} if ix.stems else ():
                    leak(node, part, "name", ix.stems.get(part, ()))  # "fixed_qk.tokens"
            if _distinctive(s):
                leak(node, s, "config", ix.fields.get(s, ()))
            for key in _DOTTED.finditer(s) if ix.fields else ():
                field = key.group(1)
                if _distinctive(field) or _in_section(key.group(0).rsplit(".", 1)[0]):
                    leak(node, field, "config", ix.fields.get(field, ()))
    return sorted(found)


def _imported_string(call: ast.Call) -> str | None:
    """The absolute module a call ``import_module("x"[, package])`` (``__import__``, ``find_spec``)
    names, or None."""
    fn = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
    arg = call.args[0] if call.args else None
    if fn not in IMPORTERS or not isinstance(arg, ast.Constant) or not isinstance(arg.value, str):
        return None
    pkg = next((kw.value for kw in call.keywords if kw.arg == "package"), call.args[1] if len(call.args) > 1 else None)
    name = arg.value
    if name.startswith(".") and isinstance(pkg, ast.Constant) and isinstance(pkg.value, str):
        level = len(name) - len(name.lstrip("."))
        name = kind_source.resolve(name[level:] or None, level, pkg.value, True)
    return name


# ----------------------------------------------------------------------------- a tree


def misplaced(kinds_: list[Kind], root: Path) -> list[Leak]:
    """A kind registered in a file outside the kind directories: that (central) file names it."""
    out = []
    for k in kinds_:
        if k.home:
            continue
        lines = {name: call.lineno for name, call in _register_calls(k.file)}
        rel = k.file.relative_to(root.resolve()).as_posix()
        out += [Leak(rel, lines.get(name, 1), name, "home", k.label) for name in sorted(k.names)]
    return sorted(out)


def allowed(leak: Leak, allow: dict) -> bool:
    """Is ``leak`` an allow-listed homonym ({(identifier, path or path prefix): reason})?"""
    return any(leak.identifier == ident and leak.path.startswith(prefix) for ident, prefix in allow)


def scan(root: Path, kinds_: list[Kind], package: str = "megahash", allow: dict | None = None) -> list[Leak]:
    """Every leak in the ``*.py`` files under ``root/package``, minus the allow-listed homonyms."""
    root = root.resolve()
    found = misplaced(kinds_, root)
    index = _Index(kinds_)
    for path in sorted((root / package).rglob("*.py")):
        found += scan_file(path, root, kinds_, index)
    return sorted(leak for leak in found if not allowed(leak, allow or {}))
