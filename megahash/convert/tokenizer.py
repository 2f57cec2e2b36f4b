"""Tokenizer files of an exported folder, loadable by ``AutoTokenizer`` without remote code.

sentencepiece streams: ``tokenizer.model`` (the run's sentencepiece model, copied) plus a
``tokenizer.json`` built from it (BPE with the model's merges, or Unigram with its scores; the
sentencepiece normaliser's precompiled character map, whitespace stripping and collapsing,
"\u2581" prefix; a Unigram model's control and byte pieces kept out of reach of the text:
:func:`megahash.piece_escape.unigram_escape`), checked on probe text to give exactly ``SentencePieceProcessor.encode``'s ids.
Word streams (``data.tokenizer=words``): a WordLevel ``tokenizer.json`` over the word table
(lowercase, split with ``\\w+|[^\\w\\s]+``, unknown words -> ``<unk>``). Special tokens keep the
megahash ids ``<s>``=0 ``<pad>``=1 ``</s>``=2 ``<unk>``=3 ``<mask>``=4; nothing is added around a
text (megahash neither prepends ``<s>`` nor appends ``</s>``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from megahash.piece_escape import unigram_escape

SPECIALS = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>", "mask_token": "<mask>"}
PROBES = [
    "KING. My lord, the queen is dead.  How now?",
    "  leading and trailing  ",
    "tab\there\nnew line",
    "é ü ñ Æ ﬁ x\u00a0y",
    "Hello <mask> world",
    "zzzqqq \u2603 \u4e2d\u6587 1234",
    "",
    "<s> a </s><unk><pad> <|endoftext|>\x00\x07\t\t   \n\n<mask>",
]


def sentencepiece_tokenizer(sp_model):
    """A ``tokenizers.Tokenizer`` equivalent to the sentencepiece model's ``encode`` (``sp_model``:
    a path or the serialized model)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import import_protobuf
    from transformers.tokenization_utils_base import generate_merges

    pb = import_protobuf()
    proto = pb.ModelProto()
    proto.ParseFromString(sp_model if isinstance(sp_model, bytes) else Path(sp_model).read_bytes())
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    vocab_scores = [(p.piece, p.score) for p in proto.pieces]
    byte_fallback = bool(spec.byte_fallback)
    escape = None
    if spec.model_type == 2:  # BPE
        vocab = {piece: i for i, (piece, _) in enumerate(vocab_scores)}
        # sentencepiece's BPE never produces control/user-defined/byte pieces by merging: keep them out of the merges
        mergeable = {p.piece: i for i, p in enumerate(proto.pieces) if p.type in (1, 2)}
        merges = generate_merges(mergeable, [(p.piece, p.score) for p in proto.pieces if p.type in (1, 2)])
        tok = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, unk_token=spec.unk_piece, fuse_unk=True, byte_fallback=byte_fallback)
        )
    elif spec.model_type == 1:  # Unigram
        escape = unigram_escape(proto)
        if escape:
            vocab_scores = [(escape["names"].get(i, piece), score) for i, (piece, score) in enumerate(vocab_scores)]
        tok = Tokenizer(models.Unigram(vocab_scores, unk_id=spec.unk_id, byte_fallback=byte_fallback))
    else:
        raise ValueError(f"sentencepiece model type {spec.model_type} (neither BPE nor Unigram)")
    norms = []
    if norm.precompiled_charsmap:
        norms.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        norms += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    # sentencepiece adds its dummy "\u2581" even before a leading space ("  a" -> "\u2581\u2581\u2581a"); the
    # Metaspace pre-tokenizer would not (it skips texts starting with one), so prefix in the normaliser
    if norm.add_dummy_prefix:
        norms.append(normalizers.Prepend("\u2581"))
    norms.append(normalizers.Replace(" ", "\u2581"))
    if escape:  # after it no space is left: the escaped character takes its place
        norms.append(normalizers.Replace(escape["char"], " "))
    tok.normalizer = normalizers.Sequence(norms)
    scheme = "always" if norm.add_dummy_prefix else "never"
    # (the Metaspace pre-tokenizer would turn an escaped character's space into "\u2581": none then)
    if not escape:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=False)
    # as transformers' Llama converter: "\u2581" -> " ", bytes -> text, drop the dummy prefix's space
    if escape:  # bytes first: the escaped character's byte piece gives a space, which is the character
        dec = [decoders.Replace(k, v) for k, v in escape["decode"]]
        dec += [decoders.ByteFallback(), decoders.Replace(" ", escape["char"]), decoders.Replace("\u2581", " ")]
    else:
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback()]
    dec.append(decoders.Fuse())
    if scheme == "always":
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    # user-defined symbols (<mask>) are matched in the text like sentencepiece does; control pieces are specials
    tok.add_tokens([AddedToken(p.piece, normalized=True, special=False) for p in proto.pieces if p.type == 4])
    tok.add_special_tokens([AddedToken(p.piece, normalized=False, special=True) for p in proto.pieces if p.type == 3])
    return tok


def word_tokenizer(words: list[str]):
    """WordLevel tokenizer over a word table (id = position)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {}
    for i, w in enumerate(words):
        vocab.setdefault(w, i)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+"), "isolated")]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS.values()])
    return tok


def export_specials(tok) -> dict:
    """``{role}_token`` strings of the exported tokenizer. No ``bos_token`` unless it is the eos:
    megahash never puts a BOS before a document (a document starts after the previous one's eos), so
    lm-eval's ``hf`` model, which prefixes scored text with the BOS when there is one and with the eos
    otherwise, conditions on the eos exactly as ``megahash eval`` does (docs/eval.md, window policy)."""
    ids = tok.special_ids
    keep_bos = ids.get("bos") is not None and ids.get("bos") == ids.get("eos")  # GPT-2's: the folder reads back alike
    return {f"{r}_token": t for r, t in tok.special_tokens.items() if t is not None and (r != "bos" or keep_bos)}


def write_tokenizer(out: Path, codec, max_length: int) -> dict:
    """Write the tokenizer files of ``codec`` (a megahash.eval.text.TextCodec) to ``out``.
    Returns {"files": [...], "mismatches": n} (n = probe texts whose ids differ from megahash's)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    files = []
    specials = {k: v for k, v in SPECIALS.items() if k != "bos_token"}  # see export_specials
    if codec.kind == "words":
        tok = word_tokenizer(codec.word_list)
    elif codec.kind == "sentencepiece":
        # the run's model with its special user-defined pieces made control pieces (megahash.tokenization)
        (out / "tokenizer.model").write_bytes(codec.sp.model_bytes)
        files.append("tokenizer.model")
        tok = sentencepiece_tokenizer(codec.sp.model_bytes)
        specials = export_specials(codec.sp)
    else:  # tokenizer.json of the run (nothing added around a text)
        tok = Tokenizer.from_str(codec.sp.export_json())
        specials = export_specials(codec.sp)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
        split_special_tokens=True,
        **specials,
    )
    fast.save_pretrained(str(out))
    # a plain fast tokenizer (tokenizer.json as it is) on transformers 4.x and 5.x without remote code:
    # ``tokenizer_class`` is what 4.x reads; 5.x maps some model types (qwen2) to their own tokenizer
    # class whatever tokenizer_config says, unless an ``auto_map`` is present, which it skips without
    # trust_remote_code and then uses ``tokenizer_class``. Special-token strings in a text are ordinary
    # text (split_special_tokens), as on every other megahash path.
    shutil.copyfile(
        Path(__file__).resolve().parent / "hf" / "tokenization_megahash.py", out / "tokenization_megahash.py"
    )
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc.update(
        tokenizer_class="PreTrainedTokenizerFast",
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
        model_max_length=int(max_length),
        # no token_type_ids (4.x's fast tokenizers return them by default; generate(**tok(text)) then refuses them)
        model_input_names=["input_ids", "attention_mask"],
    )
    tc["auto_map"] = {"AutoTokenizer": [None, "tokenization_megahash.MegahashTokenizerFast"]}
    tc.pop("backend", None)
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    files += ["tokenizer.json", "tokenizer_config.json", "tokenization_megahash.py"]
    for extra in ("special_tokens_map.json",):
        if (out / extra).is_file():
            files.append(extra)
    mismatches = sum(
        _probe_ids(lambda t: fast.encode(t, add_special_tokens=False), t)
        != _probe_ids(lambda t: codec.encode(t).ids, t)
        for t in PROBES
    )
    return {"files": files, "mismatches": mismatches}


def _probe_ids(encode, text: str) -> list[int] | None:
    """``encode(text)``, or None when the tokenizer cannot encode the probe (a tokenizer.json whose unk token
    is not in its model's vocabulary raises on a character it never saw; ``tokenizers`` raises a plain
    Exception, megahash a TokenizerError): both sides failing alike is agreement."""
    try:
        return list(encode(text))
    except Exception:  # tokenizers raises plain Exception
        return None
