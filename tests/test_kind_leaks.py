"""The kind-leak checker (tests/kind_leaks.py, issue 27 item 2) finds each sort of reference to a
kind from a file that is not the kind's own: a small library is planted in a temporary folder, one
violation at a time, and the checker must report exactly that violation (file, line, identifier,
sort); the clean library reports nothing. Torch-free: the checker reads source with ``ast``."""

from __future__ import annotations

import dataclasses
import textwrap
from types import SimpleNamespace

import kind_leaks as kl
import pytest

KIND_FILE = '''
"""The toy attention kind ``toyqk`` (a planted kind): reads a fixed input."""
import dataclasses

from megahash.models.attention.base import heads
from megahash.models.registry import register_attention
from megahash.ops import kernel

TOY_KINDS = ("toyqk",)


@dataclasses.dataclass
class ToyOptions:
    toy_text: str = ""
    toy_length: int = 4


class ToyInput:
    """The fixed input."""


def set_toy_tokens(model, ids):
    model.toy_ids = ids


@register_attention("toyqk", options=ToyOptions)
def toyqk_spec(cfg):
    return heads(kernel(cfg.model.attention.options.toy_text), "toyqk")
'''

OTHER_KIND_FILE = '''
"""A second kind ``plainemb``: an embedding that names nobody."""
from megahash.models.attention import base
from megahash.models.registry import register_embedding


@register_embedding("plainemb")
class PlainEmbedding:
    kind = "plainemb"

    def forward(self, x):
        return base.heads(x)
'''

# shared modules and a central one that use kinds only generically (docstrings may name them)
CLEAN = {
    "megahash/__init__.py": "",
    "megahash/models/__init__.py": "",
    "megahash/models/attention/__init__.py": '"""Attention kinds: ``toyqk`` (in :mod:`.toykind`)."""\n',
    "megahash/models/attention/base.py": '"""Shared helpers."""\n\n\ndef heads(x, name=None):\n    return x\n',
    "megahash/models/embeddings/__init__.py": "",
    "megahash/ops/__init__.py": "def kernel(q):\n    return q\n",
    "megahash/models/registry.py": "def register_attention(name, **kw):\n    return lambda f: f\n\n\n"
    "def register_embedding(name, **kw):\n    return lambda f: f\n",
    "megahash/models/megatron_model.py": textwrap.dedent('''
        """The model; the toyqk kind's fixed input is one of its hooks (docstrings may say so)."""
        import importlib

        import megahash.models.attention
        from megahash.models import attention, registry
        from megahash.models.attention import base
        from megahash.ops import kernel


        def build(cfg, toy_text=None):
            """A parameter may share an option's spelling (it is the function's own)."""
            mod = importlib.import_module("megahash.models.attention.base")
            return kernel(base.heads(cfg.model.hidden_size)), attention.base, mod, registry, toy_text, "toy"
        '''),
}
KIND = "megahash/models/attention/toykind.py"
OTHER = "megahash/models/embeddings/plainemb.py"
MODEL = "megahash/models/megatron_model.py"
MODULE = "megahash.models.attention.toykind"


def plant(root, extra: dict | None = None, append: dict | None = None):
    files = {**CLEAN, KIND: KIND_FILE, OTHER: OTHER_KIND_FILE, **(extra or {})}
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip("\n") + (append or {}).get(rel, ""))
    return [("toyqk", SimpleNamespace(file=str(root / KIND))), ("plainemb", SimpleNamespace(file=str(root / OTHER)))]


def found(root, entries, allow=None):
    return [
        (leak.path, leak.line, leak.identifier, leak.sort)
        for leak in kl.scan(root, kl.kinds(entries, root), allow=allow)
    ]


def test_the_clean_library_reports_nothing(tmp_path):
    entries = plant(tmp_path)
    ks = {k.label: k for k in kl.kinds(entries, tmp_path)}
    assert ks["toyqk"].module == MODULE and ks["toyqk"].home
    assert ks["toyqk"].public == {"TOY_KINDS", "ToyOptions", "ToyInput", "set_toy_tokens", "toyqk_spec", "toykind"}
    assert ks["toyqk"].fields == {"toy_text", "toy_length"}  # options= of its register line
    assert found(tmp_path, entries) == []


# (file, source, line, identifier, sort): each source holds exactly one violation
PLANTED = [
    # string: a registered name as a string constant
    (MODEL, 'KIND = "toyqk"\n', 1, "toyqk", "string"),
    ("megahash/data/x.py", 'def f(s):\n    return s == "plainemb"\n', 2, "plainemb", "string"),
    # module: imports of every style, a string naming it, an attribute chain through its package
    (MODEL, "import megahash.models.attention.toykind\n", 1, MODULE, "module"),
    (MODEL, "import megahash.models.attention.toykind as tk\n", 1, MODULE, "module"),
    (MODEL, "from megahash.models.attention import toykind\n", 1, MODULE, "module"),
    (MODEL, "from megahash.models.attention.toykind import ToyInput\n", 1, MODULE, "module"),
    (MODEL, "def f():\n    from .attention import toykind\n    return toykind\n", 2, MODULE, "module"),
    ("megahash/models/attention/shared.py", "from .toykind import ToyInput\n", 1, MODULE, "module"),
    ("megahash/training/trainer.py", "from ..models.attention.toykind import ToyInput\n", 1, MODULE, "module"),
    ("megahash/models/attention/base.py", "from . import toykind\n", 1, MODULE, "module"),  # a shared module
    (
        MODEL,
        'import importlib\nm = importlib.import_module("megahash.models.attention.toykind")\n',
        2,
        MODULE,
        "module",
    ),
    (
        MODEL,
        'import importlib\nm = importlib.import_module(".toykind", package="megahash.models.attention")\n',
        2,
        MODULE,
        "module",
    ),
    (MODEL, 'PATH = "megahash/models/attention/toykind.py"\n', 1, MODULE, "module"),
    (MODEL, "import megahash.models.attention\nm = megahash.models.attention.toykind\n", 2, MODULE, "module"),
    (MODEL, "from megahash.models import attention\nm = attention.toykind\n", 2, MODULE, "module"),
    # name: its public top-level names and its module's name, as attribute, re-export, definition, string
    (MODEL, "def f(model):\n    model.set_toy_tokens([1])\n", 2, "set_toy_tokens", "name"),
    (MODEL, "def f(x):\n    return x.TOY_KINDS\n", 2, "TOY_KINDS", "name"),
    (MODEL, "def f(model):\n    return model.toykind\n", 2, "toykind", "name"),
    (MODEL, "from megahash.models.attention import ToyInput\n", 1, "ToyInput", "name"),  # re-exported
    (MODEL, "class ToyInput:\n    pass\n", 1, "ToyInput", "name"),  # a second one
    (MODEL, "from megahash.models.attention.base import *\nx = ToyInput()\n", 2, "ToyInput", "name"),
    (MODEL, 'def f(m):\n    return getattr(m, "set_toy_tokens")\n', 2, "set_toy_tokens", "name"),
    (MODEL, 'PREFIXES = ("embedding.", "toykind.")\n', 1, "toykind", "name"),  # a state-dict prefix
    # config: its options' fields as attribute, keyword, another class's field, key or string
    (MODEL, "def f(cfg):\n    return cfg.model.attention.toy_text\n", 2, "toy_text", "config"),
    (MODEL, 'KEY = "model.attention.toy_text"\n', 1, "toy_text", "config"),
    (MODEL, 'OVERRIDES = ["model.attention.toy_text=abc"]\n', 1, "toy_text", "config"),
    (MODEL, 'FIELD = "toy_length"\n', 1, "toy_length", "config"),
    (MODEL, 'ERROR = "set model.attention.toy_length to 4 or more"\n', 1, "toy_length", "config"),
    (
        MODEL,
        'import dataclasses\n\n\ndef f(m):\n    return dataclasses.replace(m, toy_text="")\n',
        5,
        "toy_text",
        "config",
    ),
    (
        "megahash/config.py",
        'import dataclasses\n\n\n@dataclasses.dataclass\nclass AttentionConfig:\n    toy_text: str = ""\n',
        6,
        "toy_text",
        "config",
    ),  # a central config field
]


@pytest.mark.parametrize("rel,source,line,ident,sort", PLANTED, ids=[f"{p[4]}-{i}" for i, p in enumerate(PLANTED)])
def test_each_planted_violation_is_reported_exactly(tmp_path, rel, source, line, ident, sort):
    entries = plant(tmp_path, {rel: source})
    assert found(tmp_path, entries) == [(rel, line, ident, sort)]


def test_a_kind_file_naming_another_kind_is_a_leak(tmp_path):
    """Kind files may import shared modules (base, ops), never another kind's file or names."""
    entries = plant(
        tmp_path, append={OTHER: "\nfrom megahash.models.attention.toykind import ToyInput\nKINDS = ('toyqk',)\n"}
    )
    n = len(OTHER_KIND_FILE.strip().splitlines())
    assert found(tmp_path, entries) == [(OTHER, n + 2, MODULE, "module"), (OTHER, n + 3, "toyqk", "string")]


def test_a_kind_registered_in_a_central_file_is_a_leak(tmp_path):
    """A kind whose register line is in a central module (not models/{attention,embeddings,heads}/):
    that module names it; its other names stay the central module's own."""
    entries = plant(
        tmp_path,
        append={
            "megahash/models/registry.py": '\n\n@register_attention("homeless")\n'
            "def heads_spec(cfg):\n    return None\n"
        },
    )
    entries.append(("homeless", SimpleNamespace(file=str(tmp_path / "megahash/models/registry.py"))))
    assert found(tmp_path, entries) == [("megahash/models/registry.py", 9, "homeless", "home")]


def test_names_shared_across_groups_are_each_files_own(tmp_path):
    """The embedding ``vocab`` and the head ``vocab``: each file may say "vocab"; another file may not."""
    entries = plant(
        tmp_path,
        {
            "megahash/models/attention/same_a.py": 'register_attention("same")\nX = "same"\n',
            "megahash/models/embeddings/same_b.py": 'register_embedding("same")\n',
            MODEL: 'K = "same"\n',
        },
    )
    entries += [
        ("same", SimpleNamespace(file=str(tmp_path / "megahash/models/attention/same_a.py"))),
        ("same", SimpleNamespace(file=str(tmp_path / "megahash/models/embeddings/same_b.py"))),
    ]
    assert found(tmp_path, entries) == [(MODEL, 1, "same", "string")]


def test_the_entrys_options_class_names_the_fields(tmp_path):
    """``entry.options`` (a dataclass, as the declarations may give it) wins over the register line."""

    @dataclasses.dataclass
    class Options:
        window: int = 3

    entries = plant(
        tmp_path, {MODEL: "def f(cfg):\n    return cfg.model.attention.window, cfg.model.attention.toy_text\n"}
    )
    entries[0] = ("toyqk", SimpleNamespace(file=entries[0][1].file, options=Options))
    assert found(tmp_path, entries) == [(MODEL, 2, "window", "config")]
    entries[0] = ("toyqk", SimpleNamespace(file=entries[0][1].file, options="ToyOptions"))  # a class name in the file
    assert found(tmp_path, entries) == [(MODEL, 2, "toy_text", "config")]


def test_the_allow_list_excuses_one_identifier_in_one_file(tmp_path):
    entries = plant(tmp_path, {MODEL: 'KIND = "toyqk"\n', "megahash/data/x.py": 'KIND = "toyqk"\n'})
    allow = {("toyqk", MODEL): "a homonym"}
    assert found(tmp_path, entries, allow) == [("megahash/data/x.py", 1, "toyqk", "string")]


def test_a_one_word_field_counts_only_in_a_config_section(tmp_path):
    """An option ``seed`` is a leak where it is read through a config section (attention, embed, head,
    options) or declared in a section's class; ``cfg.data.seed``, a ``seed=`` keyword, the string
    "seed" or "data.seed" are other seeds. (A field of two words, e.g. ``toy_text``, counts anywhere.)"""

    @dataclasses.dataclass
    class Options:
        seed: int = 0

    source = """
        import dataclasses


        @dataclasses.dataclass
        class DataConfig:
            seed: int = 0


        @dataclasses.dataclass
        class AttentionConfig:
            seed: int = 0


        def f(cfg, g):
            g(seed=cfg.data.seed)
            keys = ["seed", "data.seed", "model.attention.options.seed=3"]
            return cfg.model.attention.seed, keys
        """
    entries = plant(tmp_path, {MODEL: source})
    entries[0] = ("toyqk", SimpleNamespace(file=entries[0][1].file, options=Options))
    assert found(tmp_path, entries) == [
        (MODEL, 11, "seed", "config"),
        (MODEL, 16, "seed", "config"),
        (MODEL, 17, "seed", "config"),
    ]
