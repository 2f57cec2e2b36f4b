"""Citations a reader can follow (issue 27 item 6): every short key the code's docstrings and
comments or the docs use is an entry of docs/references.md, every entry there has a year and an
arXiv id or URL, markdown links to it land on an entry, and no citation names a seed document
("seed 00N") that a contributor does not have."""

import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFS = os.path.join(ROOT, "docs", "references.md")
KEY = re.compile(r"(?<![\w\]])\[([A-Z][A-Za-z]+\d\d[a-z]?)\](?!\w)")
SEED = re.compile(r"\b[Ss]eeds? 00\d")
CODE_DIRS = ("megahash", "data_tools", "launch", "benchmarks", "tests")
TEXT_DIRS = ("docs", "configs", "slurm", "benchmarks")


def entries():
    """{key: text of its entry} from the '### [Key]' headings of docs/references.md."""
    text = open(REFS, encoding="utf-8").read()
    parts = re.split(r"^### \[([A-Za-z]+\d\d[a-z]?)\]\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _walk(dirs, exts):
    for d in dirs:
        for dp, dns, fns in os.walk(os.path.join(ROOT, d)):
            dns[:] = [x for x in dns if not x.startswith(".") and x != "__pycache__"]
            for fn in fns:
                if fn.endswith(exts):
                    yield os.path.join(dp, fn)


def prose():
    """(file:line, text) of every comment and string in the Python sources and every line of the
    markdown, YAML and shell files (references.md itself excluded)."""
    for path in _walk(CODE_DIRS, (".py",)):
        rel = os.path.relpath(path, ROOT)
        src = open(path, encoding="utf-8").read()
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING):
                yield f"{rel}:{tok.start[0]}", tok.string
    texts = list(_walk(TEXT_DIRS, (".md", ".yaml", ".yml", ".sh"))) + [os.path.join(ROOT, "README.md")]
    for path in texts:
        if os.path.abspath(path) == REFS:
            continue
        rel = os.path.relpath(path, ROOT)
        for i, line in enumerate(open(path, encoding="utf-8"), 1):
            yield f"{rel}:{i}", line


def test_every_entry_has_a_year_and_an_arxiv_id_or_url():
    refs = entries()
    assert len(refs) >= 7, "docs/references.md lists the seven sources megahash is built from at least"
    for key, body in refs.items():
        assert re.search(r"\b(19|20)\d\d\b", body), f"[{key}] has no year"
        assert re.search(r"arXiv:\d{4}\.\d{4,5}\b|https?://\S+", body), f"[{key}] has neither an arXiv id nor a URL"
        yy = re.fullmatch(r"[A-Za-z]+(\d\d)[a-z]?", key).group(1)
        assert re.search(rf"\b(19|20){yy}\b", body), f"[{key}]: the entry gives no year 19{yy}/20{yy}"


def test_the_seed_sources_are_listed():
    refs = entries()
    assert "arXiv:2310.20144" in refs["Cohn23"]  # EELBERT
    assert "arXiv:2210.07904" in refs["Xue22"]  # HashFormers
    assert "huggingface.co/NeuML/bert-hash-nano" in refs["NeuML25"]
    assert "Exploring Efficient Methods for Transformer-based Foundation Language Models" in refs["Xue25"]


def test_every_cited_key_is_defined():
    refs = entries()
    used = {}
    for where, text in prose():
        for key in KEY.findall(text):
            used.setdefault(key, where)
    undefined = {k: w for k, w in used.items() if k not in refs}
    assert not undefined, f"keys cited but not in docs/references.md: {undefined}"
    assert {"Xue25", "Cohn23", "NeuML25", "Julian23"} <= set(used)  # the rewrite reached the code


def test_markdown_links_land_on_an_entry():
    refs = entries()
    link = re.compile(r"\[\[([A-Za-z]+\d\d[a-z]?)\]\]\(([^)#]+)#([^)]+)\)")
    bad = []
    for where, text in prose():
        if not where.split(":")[0].endswith(".md"):
            continue
        for key, path, anchor in link.findall(text):
            target = os.path.normpath(os.path.join(ROOT, os.path.dirname(where.split(":")[0]), path))
            if target != REFS or anchor != key.lower() or key not in refs:
                bad.append(f"{where}: [{key}]({path}#{anchor})")
    assert not bad, bad


def test_no_seed_document_is_cited():
    left = [f"{where}: {text.strip()[:100]}" for where, text in prose() if SEED.search(text)]
    assert not left, "cite docs/references.md keys instead of seed files: " + "; ".join(left)
