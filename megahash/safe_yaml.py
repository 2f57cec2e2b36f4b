"""Reading YAML with its aliases and nesting bounded: every YAML file megahash reads (configs and their
``include:``, sweep grids, dotted overrides, checkpoints' ``resolved_config.yaml``, lm-eval task files
under ``--tasks-dir``) goes through :func:`load` or :class:`Loader`.

PyYAML's ``safe_load`` runs no code, but an alias (``*a``) is the anchored node itself, so a 400-byte
document of nested anchors ("billion laughs": 9 aliases of 9 aliases ... 9 levels deep) stands for
9^9 = 387 million scalars. Loading it is quick (the nodes are shared); anything that walks the value
(type checks, merges, the ``repr`` in an error message) walks the expansion: a 2 GB error line after a
minute. :class:`Loader` composes the node graph as PyYAML does and, before constructing Python
objects, counts the document's size with every alias written out (one per node plus the characters
of each scalar, go-yaml's alias budget in spirit): the aliases may add at most
:data:`ALIAS_BUDGET` to what the file itself holds; a recursive alias (an anchor inside itself)
expands without end and is refused too. Nesting is bounded by :data:`MAX_DEPTH` (PyYAML composes
recursively: 2,000 nested ``[`` were a RecursionError traceback).

Why the bounds cannot break a real config: the largest shipped file (configs/grids/table4_1.yaml)
counts 2,004 in all, so aliases may repeat a block as large as it about 500 times; shipped configs
nest at most 5 levels deep and use no aliases. A file without aliases is only bounded by its own size.
"""

from __future__ import annotations

import yaml

from megahash.errors import ConfigError

ALIAS_BUDGET = 1_000_000  # nodes + scalar characters the aliases of one document may add
MAX_DEPTH = 64  # nested collections of one document


class YAMLLimitError(ConfigError):
    """A YAML document's aliases expand past :data:`ALIAS_BUDGET` or it nests deeper than :data:`MAX_DEPTH`."""


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _own(node: yaml.Node) -> int:
    return 1 + (len(node.value) if isinstance(node, yaml.ScalarNode) else 0)


def alias_expansion(root: yaml.Node) -> int:
    """What the aliases of the document ``root`` add to it: its size with every alias written out
    minus the size of its distinct nodes (size: one per node plus each scalar's characters). Linear
    in the distinct nodes (memoized over the shared ones); YAMLLimitError for a recursive alias."""
    expanded: dict[int, int] = {}
    on_path: set[int] = set()
    distinct = 0
    stack = [(root, False)]
    while stack:  # depth-first, without recursion
        node, leaving = stack.pop()
        key = id(node)
        if leaving:
            expanded[key] = _own(node) + sum(expanded[id(c)] for c in _children(node))
            on_path.discard(key)
            continue
        if key in expanded:
            continue
        on_path.add(key)
        distinct += _own(node)
        stack.append((node, True))
        for child in _children(node):
            if id(child) in on_path:
                mark = child.start_mark
                raise YAMLLimitError(
                    f"a recursive YAML alias (an anchor used inside itself, line {mark.line + 1}) expands without end"
                )
            if id(child) not in expanded:
                stack.append((child, False))
    return expanded[id(root)] - distinct


class Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the document's alias expansion and nesting bounded (module docstring)."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YAMLLimitError(f"YAML nested deeper than {MAX_DEPTH} levels (line {mark.line + 1})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        root = super().compose_document()
        added = alias_expansion(root)
        if added > ALIAS_BUDGET:
            raise YAMLLimitError(
                f"YAML aliases (*name) expand the document by {added:,} nodes and characters, over the limit of "
                f"{ALIAS_BUDGET:,} (a 'billion laughs' file?); write repeated blocks out or share them with include:"
            )
        return root


class UniqueKeyLoader(Loader):
    """:class:`Loader` that refuses a key written twice in one mapping (PyYAML keeps the last one silently:
    ``hidden_size: 64`` then ``hidden_size: 128`` would train the second); merge keys (``<<``) may still be
    overridden. For megahash's own configs and grids (task files are lm-eval's, read as it reads them)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}  # key -> the line it was first written on
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: PyYAML's own error follows
                    continue
                if first is not None:  # on another line, or the same one ({a: 1, a: 2})
                    raise YAMLLimitError(
                        f"key {key!r} is written twice in one mapping (lines {first} and {line}); keep one"
                    )
                seen[key] = line
        return super().construct_mapping(node, deep)


def load(text: str | bytes, where: str, loader: type[Loader] = Loader):
    """The value of the YAML ``text`` (safe: no Python tags; bytes are decoded as PyYAML and libyaml do: UTF-8,
    or UTF-16 after a byte-order mark), read with ``loader``; a document past the
    bounds is ConfigError ``<where>: <why>`` (other YAML errors are raised as PyYAML raises them)."""
    try:
        return yaml.load(text, Loader=loader)
    except YAMLLimitError as e:
        raise YAMLLimitError(f"{where}: {e}") from None
