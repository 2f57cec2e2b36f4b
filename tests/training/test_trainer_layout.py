"""House rule of the training loop (issue 27 item 4): ``megahash/training/trainer.py`` reads top to
bottom, ``train`` a short sequence of named steps and no function over 50 lines (checked on the
source with ``ast``, and shown to fire on a planted long function)."""

from __future__ import annotations

import ast
import textwrap

from conftest import ROOT

TRAINER = ROOT / "megahash" / "training" / "trainer.py"
LIMIT = 50


def long_functions(source: str, limit: int = LIMIT) -> dict[str, int]:
    """{qualified name: lines} of every function (methods and nested ones included) longer than
    ``limit`` lines, decorators and docstring counted."""
    out = {}

    def visit(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}."
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    n = child.end_lineno - first + 1
                    if n > limit:
                        out[name[:-1]] = n
            visit(child, name)

    visit(ast.parse(source))
    return out


def test_no_trainer_function_over_50_lines():
    assert long_functions(TRAINER.read_text()) == {}


def test_train_is_a_short_sequence_of_named_steps():
    """``train`` calls its set-up, loop and stop steps by name, each defined in the module."""
    tree = ast.parse(TRAINER.read_text())
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    called = {c.func.id for c in ast.walk(defs["train"]) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    assert {"_set_up", "_loop", "_finish"} <= called and {"_set_up", "_loop", "_finish"} <= set(defs)
    assert defs["train"].end_lineno - defs["train"].lineno + 1 <= 20


def test_the_rule_fires_on_a_planted_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    planted = (
        textwrap.dedent("""
        def short():
            return 1

        class Holder:
            @staticmethod
            def long():
        """)
        + textwrap.indent(body, "    ")
        + "\n"
    )
    assert long_functions(planted) == {"Holder.long": LIMIT + 2}
    nested = "def outer():\n    def inner():\n" + textwrap.indent(body, "    ") + "\n    return inner\n"
    assert set(long_functions(nested)) == {"outer", "outer.inner"}
