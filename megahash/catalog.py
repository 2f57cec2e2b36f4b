"""What the kinds declare, torch-free: the one place config, data, training, evaluation and export ask.

Every attention kind, embedding kind and head registers itself in its own file with
``@register_attention(name, costs=..., caps=AttentionCaps(...))`` (``register_embedding`` /
``register_head`` / ``register_input`` alike, :mod:`megahash.models.registry`). This module holds the
capability records (plain dataclasses) and answers questions about kinds for the rest of the library
(costs, accounting, data loading, evaluation, export): nothing outside a kind's own file names the kind.

Two readers of the same declarations:

- the live registry (:mod:`megahash.models.registry`, filled by importing the kind files: torch and
  megatron-core), used whenever it is loaded;
- the kind files' source (:mod:`megahash.kind_source`: each file parsed once; a register line's
  ``caps=``, ``costs=`` and ``options=`` executed with only what they need of their own file), so that
  config checks and ``megahash params`` of the standard decoder stay free of heavy imports. Hence
  cost, option and caps values use no torch (``tests/models/test_registry.py`` checks both readers agree).

Plugins (kinds outside the package, e.g. a research repo's new attention): module or package names
from the ``megahash.kinds`` entry-point group, the ``MEGAHASH_PLUGINS`` environment variable
(comma-separated) and the config's ``model.plugins`` list. A plugin is one file per kind, written
exactly like the kinds under ``megahash/models/attention`` and ``megahash/models/embeddings``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from megahash import kind_source
from megahash.errors import ConfigError

MODELS = kind_source.ROOT / "models"  # where the library's kinds live
GROUPS = {group: call for call, group in kind_source.REGISTER.items()}  # group -> its register call
ENTRY_POINT_GROUP = "megahash.kinds"
PLUGINS_ENV = "MEGAHASH_PLUGINS"


# ----------------------------------------------------------------------------- capability records


@dataclass(frozen=True)
class AttentionCaps:
    """What an attention kind can do (the literal ``caps=`` of its ``register_attention``)."""

    decoder: bool = True  # causal, in a decoder
    encoder: bool = True  # bidirectional, in an encoder (padding mask)
    decodes: bool = True  # incremental decoding (decode_cache) equals the full forward
    fixed_input: bool = False  # reads the model's fixed input, which rides as one more sequence
    exportable: bool = True  # Hugging Face export
    standard: bool = False  # THE standard attention: default schedule, kept layers of a hybrid
    qwen2: bool = False  # a plain Qwen2 attention layer (Qwen2 import/export, closed-form params)
    mixes_tokens: bool = True  # False: each output reads only its own token (attention map = I)
    thesis_name: str | None = None  # row of the [Xue25] tables (Tables 3.4, 4.5-4.8), None: not there
    chapters: tuple = ()  # [Xue25] chapters whose tables list it
    documents: bool = True  # keeps attention (and state) inside packed documents (data.reset_attention_mask)
    mup: bool = True  # takes muP's attention scale (Mixing.score_scale, or its core's; model.mup_base_hidden_size)
    chunk_loop: bool = False  # carries a matrix state over chunks in a Python loop (operator calls grow per chunk)
    value_embeds: bool = False  # adds model.value_embeds' rows to its values (``value_heads``; softmax_base.mix)


@dataclass(frozen=True)
class EmbeddingCaps:
    """What an embedding kind needs and offers (``caps=`` of ``register_embedding``)."""

    reads_hash_codes: bool = True  # reads the batch's word-hash codes (needs hash side shards)
    standard: bool = False  # the default ``model.embedding``
    qwen2: bool = False  # a plain token table (Qwen2 import/export, closed-form params)
    sr_random: str = "batch"  # Shuffle+Random replacements: token | bits-density | bits-uniform | batch
    example_hash_spec: str = "md5"  # a model.embed.hash_spec it works with (tests and examples)


@dataclass(frozen=True)
class HeadCaps:
    """What an output head needs and offers (``caps=`` of ``register_head``)."""

    reads_hash_codes: bool = False  # targets are word-hash codes
    standard: bool = False  # the default ``model.head``
    qwen2: bool = False  # the vocabulary LM head (Qwen2 import/export, closed-form params)
    token_loss: bool = True  # its loss is nats per vocabulary token (perplexity; clm/mlm)
    selectable: bool = True  # chosen by model.head; False: the head an objective trains (its ObjectiveSpec.head)


@dataclass(frozen=True)
class InputCaps:
    """What a model input registered on its own (``caps=`` of ``register_input``: an add-on every model may
    carry, e.g. a table added to the input embedding) declares."""

    section: str = "embedding"  # the config section whose ``options`` hold its options (model.embed.options)


CAPS = {"attention": AttentionCaps, "embedding": EmbeddingCaps, "head": HeadCaps, "input": InputCaps}


@dataclass
class Entry:
    name: str
    group: str
    file: str  # source file that registers it
    caps: object  # an *Caps record
    costs: object = None  # name of the cost class (``costs=``, static formulas) or None ("measured only")
    options: object = None  # name of the kind's options dataclass (``options=`` of its register line) or None


# ----------------------------------------------------------------------------- plugins

_config_plugins: list[str] = []


def add_plugins(names) -> None:
    """Plugins named by a config (``model.plugins``): discovered from now on, in this process."""
    new = [n for n in (names or ()) if n and n not in _config_plugins]
    if new:
        _config_plugins.extend(new)
        _scan.cache_clear()
        _option_specs.cache_clear()


def check_foreign_plugins(names, where: str, trusted: bool = False) -> None:
    """``model.plugins`` of a config megahash reads from a file it did not get as a config (a checkpoint's
    ``resolved_config.yaml``, an export's ``megahash_config``): every name must be one this process already
    discovers (entry points, ``MEGAHASH_PLUGINS``, the user's own config), unless ``trusted`` (this install wrote
    the checkpoint). A plugin is imported, so a name the file chose runs that module (``this`` printed the Zen
    of Python from ``import-hf``; ``python -m megahash`` imports a ``NAME.py`` from the working directory).
    One-line ConfigError naming the plugin and the way to allow it."""
    if names is None:
        return
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ConfigError(f"{where}: model.plugins is {str(names)[:60]!r}, not a list of module names")
    if trusted:
        return
    known = set(plugin_modules())
    unknown = [n for n in names if n and n not in known]
    if unknown:
        raise ConfigError(
            f"{where} names plugin {unknown[0][:80]!r} (model.plugins), a module megahash would import and run; "
            f"a plugin named by a file is imported only when you name it too: if you trust it, set "
            f"{PLUGINS_ENV}={unknown[0][:80]}"
        )


@functools.cache
def _entry_point_plugins() -> tuple:
    """Module names of the ``megahash.kinds`` entry points (installed distributions; read once a process)."""
    try:
        from importlib.metadata import entry_points

        return tuple(ep.value.split(":")[0] for ep in entry_points(group=ENTRY_POINT_GROUP))
    except Exception:  # broken metadata of an unrelated distribution
        return ()


def plugin_modules() -> list[str]:
    """Plugin module names: entry points ``megahash.kinds``, then ``MEGAHASH_PLUGINS``, then configs."""
    names = list(_entry_point_plugins())
    names += [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]
    names += _config_plugins
    return list(dict.fromkeys(names))


def _plugin_spec(name: str):
    """The import spec of plugin module ``name``; one-line ConfigError when it cannot be found (a
    ModuleNotFoundError traceback at its import) or is no Python source megahash can read for its
    ``register_*`` lines (a built-in or frozen module such as ``abc``: "No such file or directory: frozen")."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as e:
        raise ConfigError(
            f"plugin {name!r} cannot be found ({e}); check {PLUGINS_ENV}/model.plugins and PYTHONPATH"
        ) from None
    if spec is None or not spec.origin:
        raise ConfigError(f"plugin {name!r} cannot be found; check {PLUGINS_ENV}/model.plugins and PYTHONPATH")
    if not spec.submodule_search_locations and not (spec.has_location and str(spec.origin).endswith(".py")):
        raise ConfigError(
            f"plugin {name!r} is {spec.origin!r}, not a Python source file or package; a plugin is a module of yours "
            f"with register_* lines (docs/architecture.md, the kind spec): check {PLUGINS_ENV}/model.plugins"
        )
    return spec


def _plugin_files(name: str) -> list[Path]:
    spec = _plugin_spec(name)
    if spec.submodule_search_locations:
        return sorted(p for loc in spec.submodule_search_locations for p in Path(loc).rglob("*.py"))
    return [Path(spec.origin)]


def plugin_import_names() -> list[str]:
    """Every module to import for the plugins' ``register_*`` lines (packages: all submodules)."""
    out = []
    for name in plugin_modules():
        spec = _plugin_spec(name)
        out.append(name)
        if spec.submodule_search_locations:
            import pkgutil

            out += [info.name for info in pkgutil.walk_packages(spec.submodule_search_locations, prefix=name + ".")]
    return out


# ----------------------------------------------------------------------------- the source reader


_REGISTER_CALL = re.compile(r"\b(?:" + "|".join(kind_source.REGISTER) + r")\(")


def _library_files() -> list[Path]:
    return sorted(MODELS.rglob("*.py"))


def _entries_of_file(path: Path) -> list[Entry]:
    if not _REGISTER_CALL.search(path.read_text()):  # most library files: not parsed
        return []
    f = kind_source.read(path)
    out = []
    for r in f.registrations():
        caps = r.keyword("caps")
        caps = CAPS[r.group]() if caps is None else f.evaluate(caps)
        if not isinstance(caps, CAPS[r.group]):
            raise ConfigError(f"{path}: caps of {r.group} kind {r.name!r} must be a {CAPS[r.group].__name__}")
        costs, options = r.keyword("costs"), r.keyword("options")
        out.append(
            Entry(
                r.name,
                r.group,
                str(path),
                caps,
                costs.id if isinstance(costs, ast.Name) else None,
                options.id if isinstance(options, ast.Name) else None,
            )
        )
    return out


def _exec_class(path: Path, name: str):
    """A cost or options class of a kind file, executed torch-free (:meth:`megahash.kind_source.KindFile.value`)."""
    return kind_source.read(path).value(name)


@functools.cache
def _scan() -> dict:
    """{group: {name: Entry}} from the source of the library's kind files and the plugins'."""
    out: dict = {g: {} for g in GROUPS}
    files = _library_files() + [p for name in plugin_modules() for p in _plugin_files(name)]
    for path in files:
        for e in _entries_of_file(path):
            out[e.group][e.name] = e
    return out


def _live(group: str) -> dict | None:
    """{name: KindSpec} of the live registry when it is loaded (never imported from here: torch)."""
    reg = sys.modules.get("megahash.models.registry")
    return None if reg is None else reg.KINDS[group]


# ----------------------------------------------------------------------------- questions


def names(group: str) -> frozenset:
    """Registered names of a group (attention, embedding, head)."""
    live = _live(group)
    found = set(_scan()[group])
    if live is not None:
        found |= set(live)
    return frozenset(found)


def caps(group: str, name: str):
    """The capability record of a kind (defaults for an unknown kind)."""
    live = _live(group)
    if live is not None and name in live:
        return live[name].caps
    e = _scan()[group].get(name)
    return e.caps if e is not None else CAPS[group]()


def costs(name: str):
    """The cost class an attention kind registers (static formulas), or None ("measured only")."""
    live = _live("attention")
    if live is not None and name in live:
        return live[name].costs
    e = _scan()["attention"].get(name)
    if e is None or e.costs is None:
        return None
    return _exec_class(Path(e.file), e.costs)


# ----------------------------------------------------------------------------- kind options


@dataclass(frozen=True)
class OptionSpec:
    """One option a kind declares: a field of its options dataclass (``model.attention.options.NAME``)."""

    name: str
    type: type
    default: object
    range: tuple | None  # (low, high, low_open, high_open, meaning): the field's ranged() or the class's RANGES
    kinds: tuple  # the kinds that declare it


_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def options_class(group: str, name: str):
    """The options dataclass a kind registers (``options=``), read from its source alone, or None."""
    e = _scan()[group].get(name)
    if e is None or e.options is None:
        return None
    return _exec_class(Path(e.file), e.options)


@functools.cache
def _option_specs(group: str, plugins: tuple) -> dict:
    out: dict = {}
    owners = [(group, name) for name in sorted(_scan()[group])]
    owners += [
        ("input", name) for name, e in sorted(_scan()["input"].items()) if e.caps.section == group and group != "input"
    ]
    for owner_group, name in owners:
        cls = options_class(owner_group, name)
        if cls is None:
            continue
        ranges = getattr(cls, "RANGES", {}) or {}
        for f in dataclasses.fields(cls):
            typ = f.type if isinstance(f.type, type) else _SCALARS.get(str(f.type))
            if typ not in _SCALARS.values():
                raise ConfigError(
                    f"{group} kind {name!r}: option {f.name} must be int, float, str or bool, got {f.type}"
                )
            rule = f.metadata.get("range") or ranges.get(f.name)  # config_checks.ranged, or the class's RANGES
            spec = OptionSpec(f.name, typ, f.default, rule, (name,))
            old = out.get(f.name)
            if old is not None:
                if (old.type, old.default, old.range) != (spec.type, spec.default, spec.range):
                    raise ConfigError(
                        f"option {group}.options.{f.name} is declared differently by {old.kinds[0]!r} "
                        f"and {name!r} (type, default and range must agree)"
                    )
                spec = dataclasses.replace(old, kinds=old.kinds + (name,))
            out[f.name] = spec
    return out


def input_params(cfg) -> dict:
    """{label: parameters} of the model inputs registered on their own (``register_input``) that ``cfg``
    switches on, in closed form: each one's cost class ``params(cfg) -> {label: n}`` read from its source."""
    out: dict = {}
    for _name, e in sorted(_scan()["input"].items()):
        if e.costs is not None:
            out.update(_exec_class(Path(e.file), e.costs).params(cfg))
    return out


def option_specs(group: str) -> dict:
    """{option name: :class:`OptionSpec`} over every registered kind of ``group`` (plugins included)."""
    return _option_specs(group, tuple(plugin_modules()))


def source_file(group: str, name: str) -> str | None:
    e = _scan()[group].get(name)
    return e.file if e is not None else None


def entries(group: str) -> dict:
    return dict(_scan()[group])


def with_cap(group: str, cap: str, value=True) -> list[str]:
    """Registered names of a group whose capability ``cap`` equals ``value`` (sorted)."""
    return sorted(n for n in names(group) if getattr(caps(group, n), cap) == value)


def standard(group: str) -> str:
    """THE standard kind of a group (``caps.standard``): the config default, hybrids' kept layers."""
    found = with_cap(group, "standard")
    if len(found) != 1:
        raise ConfigError(f"exactly one {group} kind must register caps.standard=True, found {found}")
    return found[0]


def reads_hash_codes(cfg) -> bool:
    """Does this model read word-hash codes (its embedding or its head)? The one owner of the fact."""
    m = cfg.model
    return bool(caps("embedding", m.embedding).reads_hash_codes or caps("head", m.head).reads_hash_codes)


def thesis_kinds(chapter: int) -> list[str]:
    """Attention kinds listed in the tables of a [Xue25] chapter (3: Table 3.4, 4: Tables 4.5-4.8)."""
    return sorted(n for n in names("attention") if chapter in caps("attention", n).chapters)


def by_thesis_name(thesis_name: str) -> str | None:
    """The attention kind whose [Xue25] table row is ``thesis_name`` (e.g. "SHA"), or None."""
    for n in sorted(names("attention")):
        if (caps("attention", n).thesis_name or "").lower() == thesis_name.lower():
            return n
    return None
