"""The escape that keeps a sentencepiece Unigram model's unmatched pieces (control, unknown, unused, byte) out of
reach of the text in an exported ``tokenizer.json`` (megahash/convert/tokenizer.py writes it), and its undoing
where megahash reads such a file back (megahash/tokenization.py: the pieces' names for word hashes and bytes).

Hugging Face's ``Unigram`` matches every piece of its vocabulary, and control pieces score 0, above any ordinary
piece, so a literal ``</s>`` in a text became the eos id, where sentencepiece never matches them. When all those
pieces start with one ASCII character c (``<`` for sentencepiece's own), the normaliser replaces c with a space
after the text's spaces became "\u2581" (so no space of the text is left, and c never reaches the model); the
ordinary pieces are named with the space for c (ids unchanged; the decoder turns it back). With byte fallback
and c no piece of its own, an unknown c is the space's byte: the byte pieces of c and of the space swap names
(the space's byte piece, which no sentencepiece encoding gives, decodes as a space through "\u2581").
"""

from __future__ import annotations

SPACE_BYTE = "<0x20>"


def byte_name(c: str) -> str:
    return f"<0x{ord(c):02X}>"


def unigram_escape(proto) -> dict | None:
    """The escape of a sentencepiece ``ModelProto`` (module docstring); None (the vocabulary as it is) when its
    unmatched pieces start with several characters, a piece holds a space, or a renamed piece would meet
    another's name. Returns ``{"char": c, "names": {id: name}, "decode": [(token, replacement), ...]}``."""
    pieces = proto.pieces
    unmatched = [p.piece for p in pieces if p.type in (2, 3, 5, 6)]
    firsts = {p[0] for p in unmatched if p}
    if len(firsts) != 1 or any(" " in p.piece for p in pieces):
        return None
    (c,) = firsts
    if not c.isascii() or c == " ":
        return None
    names = {i: p.piece.replace(c, " ") for i, p in enumerate(pieces) if p.type == 1 and c in p.piece}
    decode = []
    if proto.trainer_spec.byte_fallback and not any(p.type == 1 and p.piece == c for p in pieces):
        byte = {p.piece: i for i, p in enumerate(pieces) if p.type == 6}
        mine, space = byte_name(c), SPACE_BYTE
        if mine not in byte or space not in byte:
            return None
        names[byte[mine]], names[byte[space]] = space, mine
        decode = [(mine, "\u2581")]
    taken = [names.get(i, p.piece) for i, p in enumerate(pieces)]
    if len(set(taken)) != len(taken):
        return None
    return {"char": c, "names": names, "decode": decode}


def escaped_char(tokenizer_json: dict) -> tuple[str, bool] | None:
    """(c, bytes swapped) of a ``tokenizer.json`` (parsed) written with the escape, else None: its normaliser ends
    with the "\u2581" replacement then c -> space, and its decoder starts with c's byte name -> "\u2581" when
    the byte pieces were swapped."""
    norms = _steps(tokenizer_json.get("normalizer"), "normalizers")
    if len(norms) < 2 or _replace(norms[-2]) != (" ", "\u2581"):
        return None
    c, space = _replace(norms[-1]) or (None, None)
    if space != " " or not isinstance(c, str) or len(c) != 1:
        return None
    decoders = _steps(tokenizer_json.get("decoder"), "decoders")
    return c, bool(decoders) and _replace(decoders[0]) == (byte_name(c), "\u2581")


def _steps(node, key: str) -> list:
    steps = node.get(key) if isinstance(node, dict) else None
    return steps if isinstance(steps, list) else []


def _replace(step) -> tuple | None:
    """(pattern, content) of a ``Replace`` step with a string pattern, else None."""
    if not isinstance(step, dict) or step.get("type") != "Replace" or not isinstance(step.get("pattern"), dict):
        return None
    return step["pattern"].get("String"), step.get("content")


def unescaped(names: list[str], escape: tuple[str, bool], added: set[int]) -> list[str]:
    """The sentencepiece names of an escaped vocabulary's pieces (``names`` by id; ``added`` ids kept as they are)."""
    c, swapped = escape
    swap = {SPACE_BYTE: byte_name(c), byte_name(c): SPACE_BYTE} if swapped else {}
    return [t if i in added else swap.get(t, t.replace(" ", c)) for i, t in enumerate(names)]
