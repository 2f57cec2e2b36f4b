"""Train a sentencepiece tokenizer whose special ids match the HashFormers words (megahash.hashing.words).

    python data_tools/train_tokenizer.py --input shakespeare --output data/tok/shk8k --vocab-size 8000

Writes PREFIX.model and PREFIX.vocab (atomically, via temp names). Ids: ``<s>``=0 ``<pad>``=1 ``</s>``=2
``<unk>``=3, ``<mask>``=4 (user-defined symbol).

Lossless by default: ``decode(encode(text)) == text`` for any UTF-8 text (newlines, tabs, runs of
spaces, indentation, any script, control characters): the identity normaliser
(``normalization_rule_name=identity``: no NFKC), ``remove_extra_whitespaces=False``,
``allow_whitespace_only_pieces=True`` (runs of spaces become pieces) and ``byte_fallback=True``
(characters outside the vocabulary, and "\n"/"\t", which sentencepiece never puts in pieces
because it trains on lines, become UTF-8 byte pieces ``<0x0A>``). ``--lossy`` restores
sentencepiece's default normaliser (NFKC, whitespace runs folded and stripped, unknown characters
-> ``<unk>`` unless ``--byte-fallback``). Input: any SRC of ``megahash/data/preprocess/sources.py``, streamed
into ``SentencePieceTrainer`` through ``sentence_iterator``: every non-blank line of every document
is a sentence (lines longer than ``--max-sentence-length`` bytes are cut at spaces), at most
``--input-sentence-size`` of them are sampled by sentencepiece.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

from megahash.data.preprocess.common import InputError, cli, one_line
from megahash.data.preprocess.sources import open_source, parse_doc_range, select_documents
from megahash.hashing.words import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID


# sentencepiece trainer options of the default (lossless) tokenizer
LOSSLESS = {"normalization_rule_name": "identity", "remove_extra_whitespaces": False,
            "allow_whitespace_only_pieces": True, "split_digits": False}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="SRC: file/dir/glob of .txt/.jsonl/.parquet, hf:NAME[:CONFIG]:SPLIT, shakespeare, bible-kjv")
    p.add_argument("--output", required=True, help="output prefix: writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--type", dest="model_type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--input-sentence-size", type=int, default=2_000_000, help="sentences sampled for training")
    p.add_argument("--max-sentence-length", type=int, default=4192, help="bytes; longer lines are cut at spaces")
    p.add_argument("--byte-fallback", action="store_true", help="with --lossy: encode unknown characters as byte pieces")
    p.add_argument("--lossy", action="store_true", help="sentencepiece's default normaliser (NFKC, whitespace folded); "
                   "default: lossless (identity normaliser, whitespace kept, byte fallback)")
    p.add_argument("--txt-mode", choices=["blocks", "lines"], default="blocks")
    p.add_argument("--json-key", default="text")
    p.add_argument("--doc-range", default=None, help="START:END source document indices")
    p.add_argument("--skip-docs", type=int, default=0)
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234, help="sentencepiece sampling seed")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--quiet", action="store_true", help="not even the one line naming what was written")
    p.add_argument("--verbose", action="store_true", help="sentencepiece's own log too (hundreds of lines)")
    return p


def _cut(line: str, limit: int) -> Iterator[str]:
    if len(line.encode("utf-8")) <= limit:
        yield line
        return
    piece, size = [], 0
    for word in line.split():
        n = len(word.encode("utf-8")) + 1
        if piece and size + n > limit:
            yield " ".join(piece)
            piece, size = [], 0
        if n - 1 <= limit:
            piece.append(word)
            size += n
    if piece:
        yield " ".join(piece)


def sentences(documents, max_len: int, keep_whitespace: bool = False) -> Iterator[str]:
    """Non-blank lines of the documents, each at most ``max_len`` UTF-8 bytes (stripped, unless
    ``keep_whitespace``: lossless tokenizers learn indentation and space runs as pieces)."""
    for doc in documents:
        for line in doc.splitlines():
            if not line.strip():
                continue
            if not keep_whitespace:
                yield from _cut(line.strip(), max_len)
            elif len(line.encode("utf-8")) <= max_len:
                yield line
            else:
                yield from _cut(line, max_len)


def run(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.vocab_size <= len(SPECIAL_TOKENS):
        raise InputError(f"--vocab-size must be > {len(SPECIAL_TOKENS)}, got {args.vocab_size}")
    byte_fallback = args.byte_fallback or not args.lossy
    if byte_fallback and args.vocab_size <= len(SPECIAL_TOKENS) + 256:
        raise InputError(f"--vocab-size must be > {len(SPECIAL_TOKENS) + 256} with byte fallback (256 byte pieces), "
                         f"got {args.vocab_size}; raise it or pass --lossy")
    final = {ext: args.output + ext for ext in (".model", ".vocab")}
    if not args.overwrite:
        for path in final.values():
            if os.path.exists(path):
                raise InputError(f"output {path!r} already exists; pass --overwrite to replace it")
    source = open_source(args.input, txt_mode=args.txt_mode, json_key=args.json_key)
    start, end = parse_doc_range(args.doc_range, args.skip_docs, args.max_docs)
    import sentencepiece as spm

    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f"{args.output}.tmp-{os.getpid()}"
    counted = {"sentences": 0}

    def feed() -> Iterator[str]:
        for s in sentences(select_documents(source, start, end), args.max_sentence_length, keep_whitespace=not args.lossy):
            counted["sentences"] += 1
            yield s

    try:
        spm.set_random_generator_seed(args.seed)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=feed(),
                model_prefix=tmp_prefix,
                vocab_size=args.vocab_size,
                model_type=args.model_type,
                character_coverage=args.character_coverage,
                input_sentence_size=args.input_sentence_size,
                shuffle_input_sentence=True,
                max_sentence_length=args.max_sentence_length,
                bos_id=BOS_ID,
                pad_id=PAD_ID,
                eos_id=EOS_ID,
                unk_id=UNK_ID,
                bos_piece=SPECIAL_TOKENS[BOS_ID],
                pad_piece=SPECIAL_TOKENS[PAD_ID],
                eos_piece=SPECIAL_TOKENS[EOS_ID],
                unk_piece=SPECIAL_TOKENS[UNK_ID],
                user_defined_symbols=[SPECIAL_TOKENS[4]],
                byte_fallback=byte_fallback,
                **({} if args.lossy else LOSSLESS),
                num_threads=max(1, args.threads),
                minloglevel=0 if args.verbose else 2,  # 2: errors only (its INFO log is ~330 lines)
            )
        except RuntimeError as e:
            raise InputError(f"sentencepiece training failed: {one_line(e)}") from None
        if counted["sentences"] == 0:
            raise InputError(f"no text in {args.input!r} (document range {start}:{'' if end is None else end})")
        sp = spm.SentencePieceProcessor(model_file=tmp_prefix + ".model")
        got = [sp.id_to_piece(i) for i in range(len(SPECIAL_TOKENS))]
        if got != SPECIAL_TOKENS:  # pragma: no cover - guards against sentencepiece changes
            raise InputError(f"trained tokenizer has specials {got}, expected {SPECIAL_TOKENS}")
        for ext, path in final.items():
            os.replace(tmp_prefix + ext, path)
    finally:
        for ext in final:
            if os.path.exists(tmp_prefix + ext):
                os.remove(tmp_prefix + ext)
    if not args.quiet:
        print(f"wrote {final['.model']} ({sp.get_piece_size()} pieces, {counted['sentences']} sentences read)", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point: 0 on success, 2 with ``error: ...`` on bad input."""
    return cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
