"""The files a training config names, checked before the heavy imports (torch, megatron-core and
DeepSpeed take 20-30 s to import on a cold machine; a wrong path should not wait for them).

:func:`check_training_inputs` (megahash/pretrain.py, every rank, before step 1 and before torch):

- ``data.prefix``: every shard set exists and passes ``data.verify`` (:mod:`megahash.data.verify`, the
  same one-line errors training gives; ``full`` hashes every file here, and the data loader's build
  after it finds the files already checked: :func:`megahash.data.verify.sha256_file` remembers them);
- ``data.tokenizer``: loads (:func:`megahash.tokenization.load_tokenizer`, the loader preprocess and
  eval use, so a text file or a missing path is refused as they refuse it) and is the tokenizer the
  shards were made with (vocabulary size and sha256 of the shard meta); the export copies it;
- ``data.split``: each split of the blend has documents and tokens for the samples ``train.steps`` and
  ``data.valid_samples`` ask, in an index that fits in memory (:mod:`megahash.data.split_sizes`);
- ``train.resume=PATH``: a complete checkpoint; ``eval.tasks_dir`` (with ``eval.at_end``): a folder.

Each problem is one :class:`~megahash.errors.MegahashError` line naming the key and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

from megahash.errors import ConfigError, DataError


def check_training_inputs(cfg) -> None:
    meta = check_shards(cfg)
    tok = check_tokenizer(cfg, meta)
    check_objective_roles(cfg, tok, meta)
    check_document_flags(cfg, meta)
    check_vocab_size(cfg, tok, meta)
    from megahash.data.valid_sets import check_valid_shards

    check_valid_shards(cfg)  # data.valid: every named set's shards
    check_one_tokenizer(cfg, meta)
    check_one_hashing(cfg, meta)
    from megahash.data.split_sizes import check_run

    check_run(cfg)  # each split has documents, tokens and an index that fits in memory (train.steps=1e30)
    t = cfg.train
    if t.resume not in ("auto", "none", "false", ""):  # false: YAML's off/no too
        from megahash.checkpoint.layout import STATE_FILE
        from megahash.checkpoint.resolve import not_a_checkpoint

        if not (Path(t.resume) / STATE_FILE).is_file():
            raise not_a_checkpoint(t.resume)
    if cfg.eval.at_end and cfg.eval.tasks_dir and not os.path.isdir(cfg.eval.tasks_dir):
        raise ConfigError(
            f"eval.tasks_dir {cfg.eval.tasks_dir} does not exist; build it with "
            f"`python data_tools/make_eval_tasks.py --out {cfg.eval.tasks_dir} ...` or fix eval.tasks_dir"
        )


def check_shards(cfg) -> dict:
    """Every ``data.prefix`` set exists and passes ``data.verify``, with the side shard the model reads; returns the
    first set's meta."""
    from megahash import catalog
    from megahash.data.verify import blend_paths, check_prefix, check_side_shards, read_meta, verify_set

    if not cfg.data.prefix:
        raise DataError("data.prefix is empty; point it at shards made by data_tools/preprocess_data.py")
    paths, _ = blend_paths(list(cfg.data.prefix))
    for p in paths:
        check_prefix(p)
    for p in paths:
        verify_set(p, cfg.data.verify)
    meta = read_meta(paths[0], required=False)
    spec = cfg.model.embed.hash_spec if catalog.reads_hash_codes(cfg) else None
    check_side_shards(paths, spec, cfg.model.embedding, meta)
    return meta


def check_one_tokenizer(cfg, meta: dict) -> None:
    """Every set of the ``data.prefix`` blend and of ``data.valid`` was made with the tokenizer of the first set
    (its meta's sha256 for a tokenizer of the same kind, else its vocabulary size and special ids): ids of another tokenizer are other words, and
    were trained on or scored silently (or, past the vocabulary, called a damaged shard). Word streams are left
    alone: each set has its own word table, and hash embeddings read its word codes."""
    from megahash.data.verify import base_prefix, blend_paths, read_meta

    ref = meta.get("tokenizer") or {}
    if not ref or (meta.get("stream") or {}).get("kind") == "words":
        return
    paths = [base_prefix(p) for p in blend_paths(list(cfg.data.prefix))[0]]
    for what, prefix in _other_sets(cfg):
        other = read_meta(prefix, required=False).get("tokenizer") or {}
        if not other:
            continue
        same_kind = ref.get("sha256") and other.get("sha256") and ref.get("kind") == other.get("kind")
        keys = ("sha256",) if same_kind else ("vocab_size", "special_ids")
        if any(other.get(k) != ref.get(k) for k in keys):
            raise DataError(
                f"{what} was made with the tokenizer {other.get('path')!r} ({other.get('vocab_size')} ids), "
                f"{paths[0]} with {ref.get('path')!r} ({ref.get('vocab_size')} ids); preprocess every set with the "
                f"run's tokenizer"
            )


def _other_sets(cfg) -> list[tuple[str, str]]:
    """(what, prefix) of every shard set the run reads besides the blend's first: the rest of ``data.prefix`` and
    the ``data.valid`` sets."""
    from megahash.config_checks import parse_valid
    from megahash.data.verify import base_prefix, blend_paths

    paths = [base_prefix(p) for p in blend_paths(list(cfg.data.prefix))[0]]
    sets = [(f"data.prefix {p}", p) for p in paths[1:]]
    return sets + [(f"data.valid set {name!r} ({prefix})", prefix) for name, prefix in parse_valid(cfg.data.valid)]


def hashing_of(prefix: str, meta: dict, spec: str) -> dict | None:
    """What the codes of hash spec ``spec`` in the shard set ``prefix`` mean: its ``hash_specs`` entry (kind, width,
    bits, buckets, seed, MD5 key), the stream's hash unit and word pattern, and for LSH specs the arrays of the
    set's ``_lsh.npz`` that this spec reads (the n-gram vocabulary counted on that set's corpus, the seed, the
    spec's planes); None where the meta records no such spec (the shard checks name it)."""
    entry = next((d for d in meta.get("hash_specs") or [] if isinstance(d, dict) and d.get("name") == spec), None)
    if entry is None:
        return None
    stream = meta.get("stream") or {}
    out = {k: v for k, v in entry.items() if k != "file"}
    out.update(hash_unit=stream.get("hash_unit"), word_pattern=stream.get("word_pattern"))
    lsh = meta.get("lsh") or {}
    if str(entry.get("kind", "")).startswith("lsh") and isinstance(lsh, dict) and isinstance(lsh.get("file"), str):
        import zipfile

        import numpy as np

        path = os.path.join(os.path.dirname(prefix) or ".", os.path.basename(lsh["file"]))
        try:
            params = entry.get("params") if isinstance(entry.get("params"), dict) else {}
            own = {f"hyperplanes_{params.get('bits')}", f"eta_{params.get('buckets')}"}  # this spec's planes
            with np.load(path, allow_pickle=False) as z:
                wanted = {"seed", "orders", "ngrams", "ngram_lengths", *own}
                out["lsh"] = {k: z[k] for k in sorted(z.files) if k in wanted}
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
            raise DataError(
                f"{path} (the LSH model of {prefix}) cannot be read ({type(e).__name__}: {e}); preprocess the set again"
            ) from None
    return out


def _same_hashing(a: dict, b: dict) -> str | None:
    """The first field where two :func:`hashing_of` records differ, else None."""
    import numpy as np

    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if k == "lsh" and isinstance(x, dict) and isinstance(y, dict):
            same = x.keys() == y.keys() and all(
                x[n].shape == y[n].shape and x[n].dtype == y[n].dtype and np.array_equal(x[n], y[n]) for n in x
            )
            if not same:
                return "the LSH model: each preprocess counts the n-grams of its own corpus"
        elif x != y:
            return f"{k} {y!r} against {x!r}"
    return None


def check_one_hashing(cfg, meta: dict) -> None:
    """A model that reads word-hash codes reads the same hash spec from every set of the blend and of
    ``data.valid``: the codes must mean the same words in each (the same spec, MD5 key, seed, hash unit and, for
    LSH, the same n-gram vocabulary and hyperplanes). Codes of another hashing trained on or were scored silently."""
    from megahash import catalog
    from megahash.data.verify import base_prefix, blend_paths, read_meta

    if not catalog.reads_hash_codes(cfg) or not cfg.model.embed.hash_spec:
        return
    spec = cfg.model.embed.hash_spec
    first = base_prefix(blend_paths(list(cfg.data.prefix))[0][0])
    ref = hashing_of(first, meta, spec)
    if ref is None:
        return
    for what, prefix in _other_sets(cfg):
        other = hashing_of(prefix, read_meta(prefix, required=False), spec)
        why = None if other is None else _same_hashing(ref, other)
        if why:
            fix = (
                f"preprocess it with --lsh-from {first} (the first set's LSH model)"
                if why.startswith("the LSH model")
                else "preprocess every set with the same --word-hashes, --md5-key, --seed and --hash-unit"
            )
            raise DataError(
                f"{what} holds hash spec {spec!r} of another hashing than {first} ({why}): its codes mean other "
                f"words; {fix}"
            )


def check_objective_roles(cfg, tok, meta: dict) -> None:
    """The special tokens ``train.objective`` writes (``ObjectiveSpec.roles``: MLM's ``<mask>``) are in the
    tokenizer (``tok``, else the shard meta's special ids; none recorded: the word ids 0-4, which have them)."""
    from megahash.objective_spec import objective_spec

    made = meta.get("tokenizer") or {}
    ids = tok.special_ids if tok is not None else (made.get("special_ids") or {})
    missing = [r for r in objective_spec(cfg.train.objective).roles if ids and ids.get(r) is None]
    if missing:
        raise DataError(
            f"train.objective={cfg.train.objective} needs a {missing[0]} token and the tokenizer "
            f"{cfg.data.tokenizer or made.get('path')!r} has none; use a tokenizer with one "
            f"(data_tools/train_tokenizer.py makes <mask>) or another train.objective"
        )


def check_document_flags(cfg, meta: dict) -> None:
    """The packed-document flags (``data.reset_position_ids``, ``reset_attention_mask``, ``eod_mask_loss``) find
    documents by their end-of-document token: the tokenizer's eos (``data.special_ids.eos``, else the shard
    meta's), written after every document. Without one the dataset's fallback id 2 is an ordinary token of such a
    tokenizer, and documents would end at each of its occurrences; without the written eos none would end."""
    from megahash.tokenization import special_ids_of

    names = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")  # megahash.data.documents.FLAGS (torch)
    flags = [f"data.{f}" for f in names if getattr(cfg.data, f, False)]
    if not flags:
        return
    made = meta.get("tokenizer") or {}
    given = {r: i for r, i in (cfg.data.special_ids or {}).items() if i is not None}
    ids = special_ids_of({**special_ids_of(made.get("special_ids")), **given}) if made.get("special_ids") else {}
    name = cfg.data.tokenizer or made.get("path")
    if ids and ids.get("eos") is None:
        raise DataError(
            f"{', '.join(flags)}: documents are found by their end-of-document token and the tokenizer {name!r} has "
            f"none; "
            f"turn the flags off, or use a tokenizer with an eos token"
        )
    if (meta.get("stream") or {}).get("append_eos") is False:
        raise DataError(
            f"{', '.join(flags)}: documents are found by the eos token written after each, and the shards of "
            f"data.prefix were made with --no-append-eos; turn the flags off, or preprocess again without it"
        )


def check_vocab_size(cfg, tok, meta: dict) -> None:
    """An explicit ``model.vocab_size`` holds every id of the tokenizer (``tok``, else the shard meta's): a
    smaller one would stop at the first sample holding a larger id, calling the shard damaged."""
    made = meta.get("tokenizer") or {}
    n = tok.vocab_size if tok is not None else int(made.get("vocab_size") or 0)
    if cfg.model.vocab_size and n > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {n} ids "
            f"({cfg.data.tokenizer or made.get('path')}); set model.vocab_size=0 (the tokenizer's) or at least {n}"
        )


def check_tokenizer(cfg, meta: dict):
    """``data.tokenizer`` loads and matches the shard meta's tokenizer; returns it (None: none named
    or a word stream, whose table comes with the shards)."""
    from megahash.tokenization import WORDS, TokenizerError, load_tokenizer

    spec = cfg.data.tokenizer
    if not spec or spec == WORDS:
        return None
    made = meta.get("tokenizer") or {}
    hint = f" (the shards were made with {made['path']})" if made.get("path") else ""
    try:
        tok = load_tokenizer(spec)
    except TokenizerError as e:
        raise DataError(f"data.tokenizer: {e}; set data.tokenizer to the tokenizer of the shards{hint}") from None
    if made.get("vocab_size") and int(made["vocab_size"]) != tok.vocab_size:
        raise DataError(
            f"data.tokenizer {spec!r} has {tok.vocab_size} entries, the shards' tokenizer "
            f"{made['vocab_size']}; set data.tokenizer to the tokenizer of the shards{hint}"
        )
    if made.get("sha256") and made.get("kind") == tok.kind and made["sha256"] != tok.sha256:
        raise DataError(
            f"data.tokenizer {spec!r} is not the tokenizer the shards were made with (sha256 differs); "
            f"set data.tokenizer to the tokenizer of the shards{hint}"
        )
    return tok
