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

Memory (docs/data.md#memory): documents are read in pieces of at most ``--split-chars`` characters
and a line is cut into sentences as it arrives, so reading holds O(``--split-chars``) whatever the
input; sentencepiece holds its sample, at most ``--input-sentence-size`` x ``--max-sentence-length``
bytes, and its own training state. The temporary model files are removed however the run ends
(:class:`megahash.data.preprocess.publish.TempReaper`: also on SIGKILL).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from megahash.arguments import ArgumentParser
from megahash.data.preprocess.common import InputError, check_output_prefix, cli, one_line
from megahash.data.preprocess.long_documents import pieces
from megahash.data.preprocess.publish import TempReaper
from megahash.data.preprocess.sources import open_source, parse_doc_range, select_documents
from megahash.hashing.words import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID

# sentencepiece trainer options of the default (lossless) tokenizer
_SPACE = re.compile(r"\s")
LOSSLESS = {
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "allow_whitespace_only_pieces": True,
    "split_digits": False,
}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--input",
        required=True,
        help="SRC: file/dir/glob of .txt/.jsonl/.parquet, hf:NAME[:CONFIG]:SPLIT, shakespeare, bible-kjv",
    )
    p.add_argument("--output", required=True, help="output prefix: writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--type", dest="model_type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--input-sentence-size", type=int, default=2_000_000, help="sentences sampled for training")
    p.add_argument("--max-sentence-length", type=int, default=4192, help="bytes; longer lines are cut at spaces")
    p.add_argument(
        "--split-chars",
        type=int,
        default=1 << 19,
        help="long documents are read in pieces of at most this many characters (memory, docs/data.md)",
    )
    p.add_argument(
        "--byte-fallback", action="store_true", help="with --lossy: encode unknown characters as byte pieces"
    )
    p.add_argument(
        "--lossy",
        action="store_true",
        help="sentencepiece's default normaliser (NFKC, whitespace folded); "
        "default: lossless (identity normaliser, whitespace kept, byte fallback)",
    )
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
    cut = _Cut(limit)
    yield from cut.add(line.split())
    yield from cut.flush()


class _Cut:
    """Words joined by single spaces into sentences of at most ``limit`` UTF-8 bytes, greedily;
    longer words are dropped."""

    def __init__(self, limit: int):
        self.limit = limit
        self.piece: list[str] = []
        self.size = 0

    def add(self, words) -> Iterator[str]:
        for word in words:
            n = len(word.encode("utf-8")) + 1
            if self.piece and self.size + n > self.limit:
                yield " ".join(self.piece)
                self.piece, self.size = [], 0
            if n - 1 <= self.limit:
                self.piece.append(word)
                self.size += n

    def flush(self) -> Iterator[str]:
        if self.piece:
            yield " ".join(self.piece)
        self.piece, self.size = [], 0


def _line(line: str, max_len: int, keep_whitespace: bool) -> Iterator[str]:
    if not line.strip():
        return
    if not keep_whitespace:
        yield from _cut(line.strip(), max_len)
    elif len(line.encode("utf-8")) <= max_len:
        yield line
    else:
        yield from _cut(line, max_len)


def _stream_lines(doc, max_len: int, keep_whitespace: bool, split_chars: int) -> Iterator[str]:
    """``_line`` of every line of ``doc`` (``str.splitlines``), reading a long document in pieces: a
    line past ``max_len`` characters is cut as it arrives (its words go to a ``_Cut``; a word longer
    than ``max_len`` is dropped as it grows), so a line of any length needs O(``split_chars``) memory."""
    buf, cut, dropping = "", None, False
    for text, _ in pieces(doc, split_chars):
        lines = text.splitlines()
        ends = text[-1].splitlines() == [""]  # the piece ends with a line break
        for k, seg in enumerate(lines):
            complete = k < len(lines) - 1 or ends
            if cut is None:
                buf = buf + seg if keep_whitespace else (buf + seg).lstrip()  # (stripped lines: no leading space)
                if complete:
                    yield from _line(buf, max_len, keep_whitespace)
                    buf = ""
                    continue
                if len(buf if keep_whitespace else buf.rstrip()) <= max_len:
                    if len(buf) > 2 * max_len + 2:  # a trailing space run: what passes max_len + 1 cannot matter
                        text_part = buf.rstrip()
                        buf = text_part + buf[len(text_part) : len(text_part) + max_len + 1]
                    continue
                cut, seg, buf = _Cut(max_len), buf, ""  # more than max_len bytes: cut by words from here
            if dropping:  # the rest of a word longer than max_len
                m = _SPACE.search(seg)
                seg, dropping = (seg[m.start() :], False) if m else ("", True)
            text_now = buf + seg
            words = text_now.split()
            buf = words.pop() if words and not complete and not dropping and not text_now[-1].isspace() else ""
            yield from cut.add(words)
            if len(buf) > max_len:  # a word too long for a sentence: dropped, and it ends the sentence
                buf, dropping = "", True
                yield from cut.flush()
            if complete:
                yield from cut.add([buf] if buf else [])
                yield from cut.flush()
                cut, buf, dropping = None, "", False
    if cut is not None:
        yield from cut.add([buf] if buf else [])
        yield from cut.flush()
    elif buf:
        yield from _line(buf, max_len, keep_whitespace)


def sentences(documents, max_len: int, keep_whitespace: bool = False, split_chars: int = 1 << 19) -> Iterator[str]:
    """Non-blank lines of the documents (``str`` or streamed), each at most ``max_len`` UTF-8 bytes
    (stripped, unless ``keep_whitespace``: lossless tokenizers learn indentation and space runs as
    pieces); longer lines are cut at whitespace into sentences of whole words."""
    for doc in documents:
        if isinstance(doc, str) and len(doc) <= split_chars:
            for line in doc.splitlines():
                yield from _line(line, max_len, keep_whitespace)
        else:
            yield from _stream_lines(doc, max_len, keep_whitespace, split_chars)


def _no_text(source: str, start: int, end: int | None) -> str:
    return (
        f"no text in {source!r} (document range {start}:{'' if end is None else end}): no document, or each empty or "
        f"whitespace; check --input, --json-key and --doc-range"
    )


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.split_chars < 64 or args.max_sentence_length < 1:
        raise InputError("--split-chars must be >= 64 and --max-sentence-length >= 1")
    if args.vocab_size <= len(SPECIAL_TOKENS):
        raise InputError(f"--vocab-size must be > {len(SPECIAL_TOKENS)}, got {args.vocab_size}")
    byte_fallback = args.byte_fallback or not args.lossy
    if byte_fallback and args.vocab_size <= len(SPECIAL_TOKENS) + 256:
        raise InputError(
            f"--vocab-size must be > {len(SPECIAL_TOKENS) + 256} with byte fallback (256 byte pieces), "
            f"got {args.vocab_size}; raise it or pass --lossy"
        )
    check_output_prefix(args.output, "--output")
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
    raised: list[BaseException] = []  # what reading the input raised inside sentencepiece's training

    def feed() -> Iterator[str]:
        docs = select_documents(source, start, end, stream=True)
        try:
            for s in sentences(
                docs, args.max_sentence_length, keep_whitespace=not args.lossy, split_chars=args.split_chars
            ):
                counted["sentences"] += 1
                yield s
        except BaseException as e:  # sentencepiece reports it (Ctrl-C too) as its own "INTERNAL" failure: kept
            raised.append(e)
            raise

    reaper = TempReaper(glob.escape(tmp_prefix) + ".*").__enter__()  # the temp model goes even on SIGKILL
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
            if raised:  # the input's own error (a missing JSON key, a value that is no string, ...) or a Ctrl-C
                raise raised[0] from None
            if counted["sentences"] == 0:  # sentencepiece refuses an empty sample before the check below
                raise InputError(_no_text(args.input, start, end)) from None
            raise InputError(f"sentencepiece training failed: {one_line(e)}") from None
        if counted["sentences"] == 0:
            raise InputError(_no_text(args.input, start, end))
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
        reaper.__exit__(None, None, None)
    if not args.quiet:
        print(
            f"wrote {final['.model']} ({sp.get_piece_size()} pieces, {counted['sentences']} sentences read)",
            file=sys.stderr,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: 0 on success, 2 with ``error: ...`` on bad input."""
    return cli(run, argv)


if __name__ == "__main__":
    sys.exit(main())
