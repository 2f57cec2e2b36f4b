"""One tokenizer for every path: the data stage, training, ``megahash eval`` and the HF export.

:func:`load_tokenizer` accepts

* a sentencepiece model (``PATH.model``, or ``PATH`` with ``.model`` appended),
* a Hugging Face ``tokenizer.json`` (any ``tokenizers`` model: byte-level BPE as GPT-2/Pythia,
  Metaspace BPE/Unigram, WordPiece) or a tokenizer folder holding one (its
  ``tokenizer_config.json``/``special_tokens_map.json`` name the special tokens),
* a Hugging Face tokenizer name (``EleutherAI/pythia-160m``): loaded with
  ``AutoTokenizer.from_pretrained`` from the local HF cache, or from the hub when it answers; offline
  (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``, or the hub unreachable within 3 s) and not cached it
  fails at once with one line saying what to pass instead (no minute of hub retries).

A value that can only be a path (starts with ``.``, ``~`` or ``/``, ends with a tokenizer file suffix,
has two ``/``, or its first component is a local folder: ``data/stage1/spm``) and does not exist is
"tokenizer not found" at once; it is never looked up on the hub.

A word stream's text -> ids is :class:`WordTable` (the shards' word table). This module is the only
one of the package that encodes text with sentencepiece, ``tokenizers`` or ``AutoTokenizer``
(tests/test_house_rules.py; the exceptions, tokenizer training and the export's standalone files,
are listed there with their reasons): the data stage, the fixed text of fixed-input attention kinds
(:mod:`megahash.data.text_source`), shard verification and decoding, training and evaluation all
load their tokenizer here.

Every path encodes text the same way (:meth:`MegahashTokenizer.encode`):

* nothing is added around a text (no BOS/EOS/post-processor), and a tokenizer.json's truncation and padding
  are not applied;
* **special-token strings in a text are ordinary text**: ``"<s>"``, ``"</s>"``, ``"<mask>"``,
  ``"<|endoftext|>"`` written in a document are split into ordinary pieces, never mapped to the
  special ids (sentencepiece: the special pieces of user-defined type, e.g. ``<mask>`` of
  ``data_tools/train_tokenizer.py``, are turned into control pieces, which sentencepiece never
  matches in text; ``tokenizers``: ``encode_special_tokens = True``; the export writes
  ``split_special_tokens: true`` in ``tokenizer_config.json``, which transformers passes on).

Special ids are the tokenizer's own, by role (``ROLES``: bos, pad, eos, unk, mask; a role the
tokenizer lacks is ``None``). They are recorded in the shard meta (``tokenizer.special_ids``) and in
the checkpoint (``data.special_ids``); nothing else may assume the word-tokenizer ids 0-4.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from megahash.errors import DataError

#: the roles of special tokens, in the row order of the hash embeddings' special table (= the
#: HashFormers word ids 0-4)
ROLES = ("bos", "pad", "eos", "unk", "mask")
SP_SPACE = "\u2581"
WORDS = "words"

# names tried for a role when a tokenizer file does not say (first match among its special tokens)
_ROLE_CANDIDATES = {
    "bos": ["<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>", "[CLS]", "<|endoftext|>"],
    "pad": ["<pad>", "<|pad|>", "[PAD]", "<|padding|>"],
    "eos": ["</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]"],
    "unk": ["<unk>", "[UNK]", "<|unk|>"],
    "mask": ["<mask>", "[MASK]", "<|mask|>"],
}
_HF_NAME = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


class TokenizerError(DataError):
    """A tokenizer cannot be found or loaded (one line, names the fix)."""


def _one_line(e) -> str:
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()
    return type(e).__name__


class MegahashTokenizer:
    """Common interface over sentencepiece and ``tokenizers`` (see the module docstring).

    Attributes: ``kind`` ("sentencepiece" | "hf"), ``spec`` (as given), ``path`` (the resolved
    file, or the HF name), ``vocab_size``, ``special_ids`` {role: id or None}, ``special_tokens``
    {role: string or None}, ``hash_pieces`` (each id's surface text in sentencepiece spelling:
    "\u2581" stands for a preceding space; used by the word-hash coder), ``special_flags`` (bool
    [vocab]: ids that get zero hash codes and their own embedding rows)."""

    kind: str

    # ------------------------------------------------------------------ common helpers
    def role_id(self, role: str, default: int | None = None) -> int | None:
        v = self.special_ids.get(role)
        return default if v is None else v

    @property
    def eos_id(self) -> int | None:
        return self.special_ids.get("eos")

    @property
    def pad_id(self) -> int | None:
        """Padding id: the pad token, else eos (padding positions are never scored)."""
        return self.role_id("pad", self.eos_id if self.eos_id is not None else 0)

    def to_meta(self) -> dict:
        return {
            "kind": self.kind,
            "path": self.spec,
            "file": self.path,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "special_ids": dict(self.special_ids),
            "special_tokens": dict(self.special_tokens),
        }

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_pieces(self, texts: Sequence[str], kinds: Sequence[int], num_threads: int = 1) -> list[list[int]]:
        """Ids of pieces of long documents (megahash/data/preprocess/long_documents.py): kind 0 starts a
        text and is encoded as one; 1 (a cut before whitespace) and 2 (a hard cut) continue one and are
        encoded without the word-start marker a tokenizer puts at a text's start (sentencepiece's dummy
        prefix, ``tokenizers``' ``add_prefix_space``/Metaspace ``prepend_scheme``/``Prepend``), so the
        pieces spell the whole text's normalised string."""
        out: list = [None] * len(texts)
        for kind in sorted(set(kinds)):
            idx = [i for i, k in enumerate(kinds) if k == kind]
            encode = self.encode_batch if kind == 0 else self._continuation(kind == 1)
            for i, ids in zip(idx, encode([texts[i] for i in idx], num_threads=num_threads)):
                out[i] = ids
        return out

    def _continuation(self, after_space: bool):
        """``encode_batch`` of text that continues a document (see ``encode_pieces``)."""
        return self.encode_batch


# ---------------------------------------------------------------------------------- sentencepiece
def _sp_protobuf():
    from sentencepiece import sentencepiece_model_pb2 as pb

    return pb


class SentencePieceTokenizer(MegahashTokenizer):
    """A sentencepiece model whose special user-defined pieces are made control pieces (so the
    strings never match in text); ``model_bytes`` is that model, ``sp`` its processor."""

    kind = "sentencepiece"

    def __init__(self, path: str, spec: str | None = None):
        import sentencepiece as spm

        self.spec, self.path = spec or path, path
        try:
            raw = Path(path).read_bytes()
            pb = _sp_protobuf()
            proto = pb.ModelProto()
            proto.ParseFromString(raw)
            if not len(proto.pieces):
                raise ValueError("no pieces")
        except Exception as e:  # protobuf raises its own DecodeError
            raise TokenizerError(f"cannot load sentencepiece model {path!r}: {_one_line(e)}") from None
        self.sha256 = hashlib.sha256(raw).hexdigest()
        specials = {p.piece for p in proto.pieces if p.type == 3}
        specials |= {c for cands in _ROLE_CANDIDATES.values() for c in cands}
        for p in proto.pieces:
            if p.type == 4 and p.piece in specials:  # USER_DEFINED special -> CONTROL
                p.type = 3
        self.model_bytes = proto.SerializeToString()
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=self.model_bytes)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"cannot load sentencepiece model {path!r}: {_one_line(e)}") from None
        sp = self.sp
        self.vocab_size = sp.get_piece_size()
        ids = {"bos": sp.bos_id(), "pad": sp.pad_id(), "eos": sp.eos_id(), "unk": sp.unk_id()}
        m = sp.piece_to_id("<mask>")
        ids["mask"] = m if sp.id_to_piece(m) == "<mask>" and not sp.is_unknown(m) else -1
        self.special_ids = {r: (int(ids[r]) if ids[r] is not None and ids[r] >= 0 else None) for r in ROLES}
        self.special_tokens = {r: (sp.id_to_piece(i) if i is not None else None) for r, i in self.special_ids.items()}
        self.hash_pieces = [sp.id_to_piece(i) for i in range(self.vocab_size)]
        flags = [
            sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or sp.is_byte(i) for i in range(self.vocab_size)
        ]
        self.special_flags = np.array(flags, dtype=bool)

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return self.sp.encode(list(texts), num_threads=num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids if 0 <= i < self.vocab_size])

    def _continuation(self, after_space: bool):
        """No dummy prefix, except after a whitespace cut with a normaliser that strips whitespace (it
        strips the piece's leading space, and the prefix stands for it)."""
        if getattr(self, "_no_prefix", None) is None:
            import sentencepiece as spm

            proto = self.model_proto()
            self._strips = proto.normalizer_spec.remove_extra_whitespaces
            proto.normalizer_spec.add_dummy_prefix = False
            self._no_prefix = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        if after_space and self._strips:
            return self.encode_batch
        return lambda texts, num_threads=1: self._no_prefix.encode(list(texts), num_threads=num_threads)

    def model_proto(self):
        """A ``ModelProto`` of the model (a copy: trainer/normalizer specs, pieces)."""
        return _sp_protobuf().ModelProto.FromString(self.model_bytes)

    def unnormalized(self):
        """A processor of the same model (specials as above) with the identity normaliser: no character
        map, no dummy "\u2581" prefix, whitespace kept and escaped as "\u2581". It encodes a string
        exactly as the model sees it after normalisation (the data stage's per-whitespace-token cache,
        :class:`megahash.data.preprocess.encoding.SentencePieceSegments`)."""
        import sentencepiece as spm

        proto = self.model_proto()
        proto.normalizer_spec.Clear()
        proto.normalizer_spec.name = "identity"
        proto.normalizer_spec.add_dummy_prefix = False
        proto.normalizer_spec.remove_extra_whitespaces = False
        proto.normalizer_spec.escape_whitespaces = True
        return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


# ---------------------------------------------------------------------------------- tokenizers
@lru_cache(maxsize=1)
def _byte_decoder() -> dict:
    """GPT-2's byte <-> printable character map, inverted (character -> byte)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _types(node) -> set:
    """Every ``"type"`` value in a tokenizer.json subtree."""
    out = set()
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            out.add(node["type"])
        for v in node.values():
            out |= _types(v)
    elif isinstance(node, list):
        for v in node:
            out |= _types(v)
    return out


def _token_content(v) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


class HFTokenizer(MegahashTokenizer):
    """A ``tokenizers.Tokenizer`` (tokenizer.json) with ``encode_special_tokens = True``."""

    kind = "hf"

    def __init__(self, json_text: str, spec: str, path: str, config: dict | None = None):
        from tokenizers import Tokenizer

        self.spec, self.path = spec, path
        try:
            self.json = json.loads(json_text)
            self.tok = Tokenizer.from_str(json_text)
        except Exception as e:  # tokenizers raises plain Exception
            raise TokenizerError(f"cannot load tokenizer {path!r}: {_one_line(e)}") from None
        _whole_text(self.tok)
        self.sha256 = hashlib.sha256(json_text.encode("utf-8")).hexdigest()
        self.vocab_size = int(self.tok.get_vocab_size(with_added_tokens=True))
        added = self.json.get("added_tokens") or []
        special_added = {a["content"]: int(a["id"]) for a in added if a.get("special")}
        config = config or {}
        self.special_ids, self.special_tokens = {}, {}
        for role in ROLES:
            name = _token_content(config.get(f"{role}_token"))
            if name is None:
                name = next((c for c in _ROLE_CANDIDATES[role] if c in special_added), None)
            if name is None and role == "unk":
                unk = (self.json.get("model") or {}).get("unk_token")
                name = unk if isinstance(unk, str) else None
            tid = self.tok.token_to_id(name) if name is not None else None
            self.special_ids[role] = int(tid) if tid is not None else None
            self.special_tokens[role] = name if tid is not None else None
        types = _types(self.json.get("pre_tokenizer")) | _types(self.json.get("decoder"))
        model_type = (self.json.get("model") or {}).get("type")
        vocab = self.tok.get_vocab(with_added_tokens=True)
        inv = [""] * self.vocab_size
        for t, i in vocab.items():
            if 0 <= i < self.vocab_size:
                inv[i] = t
        added_ids = {int(a["id"]) for a in added}
        from megahash.piece_escape import escaped_char, unescaped

        escape = escaped_char(self.json)  # a Unigram export's pieces under their sentencepiece names
        if escape:
            inv = unescaped(inv, escape, added_ids)
        self.piece_names = inv
        flags = np.zeros(self.vocab_size, dtype=bool)
        flags[list(special_added.values())] = True
        for i in self.special_ids.values():
            if i is not None:
                flags[i] = True
        byte_piece = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
        pieces = []
        bd = _byte_decoder()
        for i, t in enumerate(inv):
            if i in added_ids:
                pieces.append(t)
            elif "ByteLevel" in types:
                raw = bytes(bd.get(c, 0x3F) for c in t)
                pieces.append(raw.decode("utf-8", "replace").replace(" ", SP_SPACE))
            elif model_type == "WordPiece":
                pieces.append(t[2:] if t.startswith("##") else SP_SPACE + t)
            else:  # Metaspace (sentencepiece-style) tokenizers spell spaces as "\u2581" already
                if byte_piece.match(t):
                    flags[i] = True
                pieces.append(t)
        self.hash_pieces = pieces
        self.special_flags = flags

    @classmethod
    def from_folder(cls, folder: str, spec: str) -> HFTokenizer:
        path = str(Path(folder) / "tokenizer.json")
        return cls(_read_tokenizer_file(path), spec, path, _folder_config(folder))

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return self._encode_with(self.tok, texts)

    def _encode_with(self, tok, texts: Sequence[str]) -> list[list[int]]:
        """Ids of ``texts`` by ``tok``; a text the tokenizer cannot encode is a one-line TokenizerError
        (``tokenizers`` raises a plain Exception, e.g. for an unknown word when the model's unk token is
        not in the model's own vocabulary)."""
        try:
            return [list(e.ids) for e in tok.encode_batch(list(texts), add_special_tokens=False)]
        except Exception as e:  # tokenizers raises plain Exception
            msg = _one_line(e)
            fix = "fix or retrain the tokenizer"
            if "unk" in msg.lower():
                fix = (
                    "its model's unk token must be in the model's own vocabulary (a token added with "
                    "add_special_tokens is not): retrain it with the unk token among the trainer's special_tokens"
                )
            raise TokenizerError(f"tokenizer {self.path!r} cannot encode the text: {msg}; {fix}") from None

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=True)

    def _continuation(self, after_space: bool):
        """The same tokenizer with its word-start prefixes off (ByteLevel ``add_prefix_space``,
        Metaspace ``prepend_scheme``, a ``Prepend`` normaliser)."""
        if getattr(self, "_no_prefix", None) is None:
            from tokenizers import Tokenizer

            d = json.loads(json.dumps(self.json))
            d["normalizer"] = _without_prepend(d.get("normalizer"))
            _prefix_off(d.get("pre_tokenizer"))
            tok = Tokenizer.from_str(json.dumps(d))
            _whole_text(tok)
            self._no_prefix = tok
        return lambda texts, num_threads=1: self._encode_with(self._no_prefix, texts)

    def export_json(self) -> str:
        """tokenizer.json for the HF export: the same model, nothing added around a text."""
        d = dict(self.json)
        d["post_processor"] = None
        d["truncation"] = None
        d["padding"] = None
        return json.dumps(d, ensure_ascii=False)


def _whole_text(tok) -> None:
    """Encode as megahash does: special-token strings are text, and no ``truncation``/``padding`` a tokenizer.json
    may carry (saved after ``enable_truncation``: every document was cut to its max_length and padded, silently)."""
    tok.encode_special_tokens = True
    tok.no_truncation()
    tok.no_padding()


def _without_prepend(node):
    """A tokenizer.json normaliser without its ``Prepend`` steps."""
    if not isinstance(node, dict) or node.get("type") == "Prepend":
        return None if isinstance(node, dict) else node
    if node.get("type") == "Sequence":
        node["normalizers"] = [n for n in (_without_prepend(n) for n in node.get("normalizers", [])) if n is not None]
    return node


def _prefix_off(node) -> None:
    """Turn off the word-start prefix of ByteLevel/Metaspace pre-tokenizers in a tokenizer.json subtree."""
    if isinstance(node, list):
        for n in node:
            _prefix_off(n)
    elif isinstance(node, dict):
        if node.get("type") in ("ByteLevel", "Metaspace") and "add_prefix_space" in node:
            node["add_prefix_space"] = False
        if node.get("type") == "Metaspace" and "prepend_scheme" in node:
            node["prepend_scheme"] = "never"
        for v in node.values():
            _prefix_off(v)


# ---------------------------------------------------------------------------------- resolution
def _read_tokenizer_file(path: str) -> str:
    """The text of a tokenizer.json (a file or a folder's); unreadable or not UTF-8: one-line TokenizerError."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(
            f"cannot read tokenizer {path!r}: {_one_line(e)}; a tokenizer.json is UTF-8 JSON"
        ) from None


def _folder_config(folder: str) -> dict:
    """``*_token`` entries of a folder's special_tokens_map.json / tokenizer_config.json."""
    config = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        p = Path(folder) / name
        if p.is_file():
            try:
                d = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:  # was passed over: the roles it names silently lost
                raise TokenizerError(
                    f"cannot read {p}: {_one_line(e)}; it names the tokenizer's special tokens: fix it or remove it"
                ) from None
            if not isinstance(d, dict):  # was an AttributeError traceback
                raise TokenizerError(f"{p} is not a JSON object; it names the tokenizer's special tokens: fix it")
            config.update({k: v for k, v in d.items() if k.endswith("_token")})
    return config


_FILE_SUFFIXES = (".model", ".json", ".vocab", ".txt", ".spm", ".bin")
HUB_TIMEOUT_S = 3.0


def _path_like(spec: str) -> bool:
    """A spec that names a local file or folder, never a hub repository (see the module docstring)."""
    head, sep, _ = spec.partition("/")
    return (
        spec.startswith((".", "~", "/"))
        or spec.endswith(_FILE_SUFFIXES)
        or spec.count("/") > 1
        or bool(sep and os.path.isdir(head))
    )


def _hub_source(name: str) -> str:
    """Where ``name`` can be loaded from now: "hub" (it answers within HUB_TIMEOUT_S) or "cache" (offline:
    ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``, or unreachable, and cached); a one-line TokenizerError
    otherwise, at once, instead of huggingface_hub's minute of retries."""
    from huggingface_hub import constants, get_session, try_to_load_from_cache

    try:
        cached = any(
            isinstance(try_to_load_from_cache(name, f), str) for f in ("tokenizer_config.json", "tokenizer.json")
        )
    except ValueError as e:  # huggingface_hub's HFValidationError: not a valid repository name either
        raise TokenizerError(f"tokenizer not found: {name!r} (no such file, and {_one_line(e)[:120]})") from None
    why = "offline (HF_HUB_OFFLINE)"
    if not constants.HF_HUB_OFFLINE:
        try:
            get_session().head(constants.ENDPOINT, timeout=HUB_TIMEOUT_S)
            return "hub"
        except Exception as e:  # DNS, connection and timeout errors of the HTTP client
            why = f"{constants.ENDPOINT} is unreachable ({_one_line(e)[:80]})"
    if cached:
        return "cache"
    raise TokenizerError(
        f"cannot load Hugging Face tokenizer {name!r}: no such local file, and {why} with no copy in the local "
        f"Hugging Face cache; download it where the hub answers (`hf download {name}`), or pass its tokenizer.json, "
        f"a tokenizer folder or a sentencepiece .model"
    )


def _hf_from_name(name: str) -> HFTokenizer:
    local = _hub_source(name) == "cache"
    try:
        from transformers import AutoTokenizer

        t = AutoTokenizer.from_pretrained(name, local_files_only=local)
        backend = t.backend_tokenizer
    except Exception as e:  # hub/network errors come in many types
        raise TokenizerError(
            f"cannot load Hugging Face tokenizer {name!r} ({_one_line(e)[:160]}); offline, pass its tokenizer.json, "
            f"a tokenizer folder or a sentencepiece .model instead"
        ) from None
    config = {f"{r}_token": getattr(t, f"{r}_token", None) for r in ROLES}
    return HFTokenizer(backend.to_str(), name, name, {k: v for k, v in config.items() if v})


def resolve(spec: str, base_dirs: Sequence = ()) -> tuple[str, str] | None:
    """(kind, path) of a tokenizer spec, tried as given and relative to ``base_dirs``; kinds:
    "sentencepiece", "hf-file", "hf-folder"; None if nothing local matches."""
    spec = os.path.expanduser(spec)
    cands = [spec]
    if not os.path.isabs(spec):
        cands += [str(Path(b) / spec) for b in base_dirs]
    for c in cands:
        if os.path.isdir(c):
            if os.path.isfile(os.path.join(c, "tokenizer.json")):
                return "hf-folder", c
            if os.path.isfile(os.path.join(c, "tokenizer.model")):
                return "sentencepiece", os.path.join(c, "tokenizer.model")
        if os.path.isfile(c):
            return ("hf-file" if c.endswith(".json") else "sentencepiece"), c
        if os.path.isfile(c + ".model"):
            return "sentencepiece", c + ".model"
    return None


def load_tokenizer(spec: str, base_dirs: Sequence = ()) -> MegahashTokenizer:
    """The tokenizer of ``spec`` (see the module docstring); one-line ``TokenizerError`` otherwise."""
    if not spec or spec == WORDS:
        raise TokenizerError(f"no subword tokenizer given ({spec!r})")
    found = resolve(spec, base_dirs)
    if found is not None:
        kind, path = found
        if kind == "sentencepiece":
            return SentencePieceTokenizer(path, spec)
        if kind == "hf-folder":
            return HFTokenizer.from_folder(path, spec)
        return HFTokenizer(_read_tokenizer_file(path), spec, path, _folder_config(os.path.dirname(path) or "."))
    if _HF_NAME.match(spec) and not _path_like(spec):
        return _hf_from_name(spec)
    raise TokenizerError(
        f"tokenizer not found: {spec!r} (give a sentencepiece .model, a tokenizer.json, a Hugging Face tokenizer "
        f"folder or name, or 'words')"
    )


class WordTable:
    """Text -> ids of a vocabulary-free word stream (``words``, [Xue25] sec. 2.3): the HashFormers
    words of the text (:func:`megahash.hashing.words.split_words`: lowercase, ``\\w+|[^\\w\\s]+``),
    each the id of its entry in the shards' word table (``PREFIX_words.tsv``), else ``<unk>``. Ids
    0-4 are the specials, which no word maps to (the splitter never yields ``"<s>"``: special-token
    strings are text here too)."""

    kind = WORDS

    def __init__(self, words: Sequence[str]):
        from megahash.hashing.words import NUM_SPECIAL, UNK_ID

        self.words, self.unk_id = list(words), UNK_ID
        self.index = {w: i for i, w in enumerate(self.words) if i >= NUM_SPECIAL}

    @staticmethod
    def split(text: str) -> list[str]:
        from megahash.hashing.words import split_words

        return split_words(text)

    def ids(self, words: Sequence[str]) -> list[int]:
        return [self.index.get(w, self.unk_id) for w in words]

    def encode(self, text: str) -> list[int]:
        return self.ids(self.split(text))


def special_ids_of(meta_or_cfg) -> dict:
    """{role: id} recorded in a shard meta's ``tokenizer`` entry or a config's ``data.special_ids``
    (empty: the HashFormers word ids 0-4)."""
    ids = dict(meta_or_cfg or {})
    if not ids:
        return {r: i for i, r in enumerate(ROLES)}
    return {r: (None if ids.get(r) is None else int(ids[r])) for r in ROLES}
