"""``megahash export-hf``: a megahash checkpoint -> a Hugging Face model folder.

    megahash export-hf --checkpoint RUN_OR_STEP_DIR --output HFDIR [--dtype float32|bfloat16]
                       [--format auto|megahash|qwen2] [--tokenizer PATH] [--no-verify]

The checkpoint (any TP size / ZeRO stage: its megatron dist checkpoint ``step_N/model/`` is loaded
at TP=1 by :func:`megahash.checkpoint.weights.load_for_inference`) becomes:

``--format megahash`` (every model): ``model.safetensors`` (megahash's TP=1 parameter names under
``model.``/``output_layer``/``head``; the fixed input of rndembqk/fixedseqqk and the rolling seeds as
buffers), ``config.json`` (``model_type: megahash``, ``auto_map`` for AutoConfig /
AutoModelForCausalLM (decoders) or AutoModelForMaskedLM (encoders) / AutoModel, per-layer specs, and
the full resolved megahash config under ``megahash_config``), the remote code assembled from the
library's own torch-only code by :mod:`megahash.convert.remote_code` (``configuration_megahash.py``,
``modeling_megahash.py``, ``hashing_megahash.py``, ``megahash_*.py``: torch + transformers + numpy
only), ``generation_config.json``, the tokenizer files
(:mod:`megahash.convert.tokenizer`) and, for hash embeddings, ``megahash_hashing.json`` with the
files raw text needs (sentencepiece pieces or the word table, ``megahash_lsh.npz``).

``--format qwen2``: decoders with only standard attention (``mha``/``gqa``/``mqa`` with one group
count), a vocabulary embedding and head and the clm objective, as a native ``Qwen2ForCausalLM``
(no remote code; :mod:`megahash.convert.qwen2`). ``auto`` (default) picks qwen2 when eligible.

Logits are over the real vocabulary (the tokenizer's); the rows megatron added to make the table
divisible by 128 x TP are kept in ``model.safetensors`` (megahash format) or
``megahash_extra.safetensors`` (qwen2) so that ``megahash import-hf`` restores them exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from megahash.arguments import ArgumentParser
from megahash.convert.hf_folder import EXTRA_FILE, MAX_SHARD_SIZE, WEIGHTS_FILE, cast, save_weights, special_token_ids
from megahash.errors import CheckpointError, ConfigError, MegahashError
from megahash.models.arch import arch_of
from megahash.objective_spec import objective_spec

REMOTE_FILES = ["configuration_megahash.py", "modeling_megahash.py", "hashing_megahash.py"]  # + megahash_*.py
HASHING_FILE = "megahash_hashing.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECIAL_IDS = {"bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2}  # the word tokenizer's (default)


# megahash parameter prefixes that live in the base model (``model.``) of the HF classes
BASE_PREFIXES = ("embedding.", "decoder.", "value_embeds.")  # + the kind inputs' attributes (model.kind_input_attrs)


# ----------------------------------------------------------------------------------- state dicts


def megahash_state(model) -> dict:
    """TP=1 tensors of a MegahashLM (parameters and persistent buffers; no ``_extra_state``)."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("_extra_state") or not torch.is_tensor(v):
            continue
        out[k] = v.detach()
    return out


def to_hf_names(state: dict, kind_inputs=()) -> dict:
    """HF names: the base model's tensors (``BASE_PREFIXES`` and the model's ``kind_inputs`` attributes)
    under ``model.``."""
    base = BASE_PREFIXES + tuple(f"{a}." for a in kind_inputs)
    return {("model." + k if k.startswith(base) else k): v for k, v in state.items()}


def from_hf_names(state: dict) -> dict:
    return {(k[len("model.") :] if k.startswith("model.") else k): v for k, v in state.items()}


# ----------------------------------------------------------------------------------- config


def layer_specs(model) -> list[dict]:
    """Per layer: attention kind and what the HF model needs to build it (its options from the schedule too:
    ``KIND+OPTION=VALUE``, over the exported ``model.attention.options``)."""
    from megahash import catalog
    from megahash.models import registry
    from megahash.models.schedules import layer_options

    cfg = model.cfg
    kinds = model.layer_kinds
    skipped = registry.skipped_layers(cfg, kinds)
    specs = []
    for layer, kind, skip, options in zip(model.decoder.layers, kinds, skipped, layer_options(cfg)):
        att = layer.self_attention
        if not registry.spec("attention", kind).caps.exportable:
            raise ConfigError(f"attention kind {kind} has no Hugging Face export; use {catalog.standard('attention')}")
        spec = {"kind": kind, "groups": int(getattr(att, "groups", 0) or cfg.model.num_heads), "skip": bool(skip)}
        spec.update(options)
        extra = registry.spec("attention", kind).export
        if extra is not None:  # what the kind's HF layer needs beyond kind and groups (its own file says)
            spec.update(extra(att))
        specs.append(spec)
    return specs


def embed_meta(model) -> dict:
    """What the HF embedding / head classes need beyond the sizes."""
    from megahash.models import registry

    cfg, emb = model.cfg, model.embedding

    meta: dict = {}
    extra = registry.spec("embedding", cfg.model.embedding).export
    if extra is not None:  # the embedding kind's own file says what its HF module needs
        meta.update(extra(emb, cfg))
    head = getattr(model, "head", None)
    if head is not None and hasattr(head, "padded"):
        meta["head_padded_rows"] = int(head.padded)
    return meta


def hf_config_dict(cfg, model, vocab_size: int, step: int) -> dict:
    """Fields of ``MegahashConfig`` for a loaded megahash model."""
    from megahash.eval.text import needs_codes
    from megahash.models.embeddings.base import parse_spec

    m = cfg.model
    spec = parse_spec(cfg, m.embedding) if needs_codes(cfg) else None
    kind_inputs = {extra.attr: extra.export_meta() for extra in model.kind_inputs()}  # e.g. a fixed input
    num_buckets = int(getattr(model.head, "num_buckets", 0) or 0)  # heads over word-hash buckets
    from megahash.convert.model_card import portable_tree

    tree = portable_tree(cfg.to_dict())  # no local paths in an export
    return dict(
        megahash_config=tree,
        vocab_size=int(vocab_size),
        padded_vocab_size=int(model.vocab_size),
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_query_groups or m.num_heads,
        intermediate_size=m.ffn_hidden_size,
        max_position_embeddings=m.max_position_embeddings,
        rope_theta=float(m.rotary_base),
        norm_eps=m.norm_eps,
        arch=m.arch,
        objective=cfg.train.objective,
        embedding=m.embedding,
        head=objective_spec(cfg.train.objective).head_name(m.head),
        tie_embeddings=bool(model.tie),
        qkv_bias=bool(m.qkv_bias),
        layer_specs=layer_specs(model),
        embed=embed_meta(model),
        kind_inputs=kind_inputs,
        hash_spec=spec.name if spec is not None else None,
        code_width=spec.width if spec is not None else 0,
        num_buckets=num_buckets,
        megahash_step=int(step),
        **special_token_ids(cfg),
        n_positions=int(cfg.data.seq_length),
    )


# ----------------------------------------------------------------------------------- files


def write_hashing_files(out: Path, codec, cfg) -> list[str]:
    """``megahash_hashing.json`` (+ pieces / word table / LSH planes) for raw text -> ids, codes."""
    files = [HASHING_FILE]
    meta = {
        "kind": "words" if codec.kind == "words" else codec.kind,
        "hash_spec": codec.spec.name if codec.spec is not None else None,
        "md5_key": codec.description.get("md5_key", "en"),
        "hash_unit": codec.description.get("hash_unit", "word"),
    }
    if codec.kind == "words":
        (out / "megahash_words.json").write_text(json.dumps(codec.word_list, ensure_ascii=False))
        meta["words_file"] = "megahash_words.json"
        files.append("megahash_words.json")
    else:
        pieces = list(codec.coder.pieces) if codec.coder is not None else list(codec.sp.hash_pieces)
        special = (codec.coder.special if codec.coder is not None else codec.special_flags).tolist()
        (out / "megahash_pieces.json").write_text(
            json.dumps({"pieces": pieces, "special": special}, ensure_ascii=False)
        )
        meta.update(pieces_file="megahash_pieces.json")
        if codec.kind == "sentencepiece":
            meta["sp_model"] = "tokenizer.model"
        else:
            meta["tokenizer_json"] = "tokenizer.json"
        files.append("megahash_pieces.json")
    if codec.spec is not None and codec.spec.kind in ("lsh", "lsh-bucket"):
        shutil.copyfile(codec.description["lsh"], out / "megahash_lsh.npz")
        meta["lsh_file"] = "megahash_lsh.npz"
        files.append("megahash_lsh.npz")
    (out / HASHING_FILE).write_text(json.dumps(meta, indent=1))
    return files


def generation_config(out: Path, max_length: int, cfg=None) -> None:
    ids = special_token_ids(cfg) if cfg is not None else SPECIAL_IDS
    (out / "generation_config.json").write_text(json.dumps({**ids, "do_sample": False}, indent=1))


# ----------------------------------------------------------------------------------- export


def load_checkpoint(checkpoint, tokenizer: str | None = None, weights: str = "live"):
    """(cfg, TP=1 model, checkpoint dir, codec or None, step) of a megahash checkpoint; ``weights``: live
    or ema (the average of train.ema.decay)."""
    from megahash.checkpoint.layout import read_state
    from megahash.checkpoint.weights import load_for_inference
    from megahash.eval.text import load_codec

    cfg, model, ckpt = load_for_inference(checkpoint, weights=weights)
    step = int(read_state(ckpt).get("step", 0))
    try:
        codec = load_codec(cfg, ckpt, tokenizer, model_vocab=model.vocab_size)
    except MegahashError as e:
        if tokenizer or isinstance(e, CheckpointError):  # one the user named, or one that contradicts the run
            raise
        print(f"megahash export-hf: warning: no tokenizer/hashing files ({e})", file=sys.stderr)
        codec = None
    return cfg, model, ckpt, codec, step


STAGE_DIR = ".megahash-export.tmp"  # inside --output: the export's files until every one is written


def written_nowhere(e: BaseException) -> bool:
    """An export write the file system refused (OSError; safetensors' Rust writer reports its own error type)."""
    return isinstance(e, OSError) or (type(e).__name__ == "SafetensorError" and "os error" in str(e))


def unwritable_export(out: Path, e: BaseException) -> ConfigError:
    """The one line of an export that could not be written (its staged files removed, ``out`` as it was)."""
    from megahash.atomic_write import disk_full

    if full := disk_full(out, e):
        what = full
        todo = "free space on that file system or choose another --output"
    else:
        what = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0][:200]
        todo = "fix the folder (permissions, mount, space) or choose another --output"
    return ConfigError(f"cannot write the export in {out} ({what}); nothing in it was changed: {todo}")


def _write_files(stage: Path, cfg, model, codec, fmt: str, dtype: str, vocab: int, step: int, max_shard_size, run_dir):
    """Every file of the export into ``stage``: weights, config and remote code (megahash format) or the Qwen2
    files, generation config, model card, tokenizer and hashing files; returns (file names, tokenizer summary)."""
    from megahash.convert import qwen2, remote_code

    torch_dtype = DTYPES[dtype]
    state = megahash_state(model)
    fields = hf_config_dict(cfg, model, vocab, step)
    files = []
    if fmt == "qwen2":
        files += qwen2.write(stage, cfg, model, state, fields, torch_dtype, max_shard_size)
    else:
        from megahash.models.hf_config import MegahashConfig

        files += save_weights(stage, cast(to_hf_names(state, model.kind_input_attrs), torch_dtype), max_shard_size)
        remote = remote_code.write(stage, remote_code.needed_kinds(cfg, model))
        arch = arch_of(cfg.model.arch)
        head_cls = arch.hf_class
        modeling = remote_code.MODELING_MODULE
        auto_map = {
            "AutoConfig": f"{remote_code.CONFIG_MODULE}.MegahashConfig",
            "AutoModel": f"{modeling}.MegahashModel",
            arch.hf_auto: f"{modeling}.{head_cls}",
        }
        config = MegahashConfig(**fields, auto_map=auto_map, architectures=[head_cls], dtype=dtype)
        config.save_pretrained(str(stage))
        files += ["config.json", *remote]
    generation_config(stage, cfg.model.max_position_embeddings, cfg)
    files.append("generation_config.json")
    from megahash.convert.model_card import write_model_card

    files.append(write_model_card(stage, cfg, model, fmt, step, run_dir))
    tok_info = {"mismatches": None}
    if codec is not None:
        from megahash.convert.tokenizer import write_tokenizer

        tok_info = write_tokenizer(stage, codec, cfg.model.max_position_embeddings)
        files += tok_info["files"]
        files += write_hashing_files(stage, codec, cfg)
        if tok_info["mismatches"]:
            print(
                f"megahash export-hf: warning: tokenizer.json differs from the run's tokenizer on "
                f"{tok_info['mismatches']} probe texts; use model.encode_text for exact ids",
                file=sys.stderr,
            )
    return files, tok_info


def export_model(
    cfg,
    model,
    output,
    codec=None,
    step: int = 0,
    dtype: str = "float32",
    fmt: str = "auto",
    vocab_size: int | None = None,
    max_shard_size=MAX_SHARD_SIZE,
    run_dir=None,
) -> dict:
    """Write the HF folder of an in-memory TP=1 megahash model; returns a summary dict."""
    from megahash.convert import qwen2, remote_code

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if fmt not in ("auto", "megahash", "qwen2"):
        raise ConfigError(f"--format must be auto, megahash or qwen2, got {fmt!r}")
    why = qwen2.ineligible(cfg, model)
    if fmt == "qwen2" and why:
        raise ConfigError(
            f"--format qwen2 needs a decoder with only standard attention and a vocabulary embedding "
            f"and head: {why}; use --format megahash"
        )
    fmt = "qwen2" if fmt == "qwen2" or (fmt == "auto" and not why) else "megahash"
    if fmt == "megahash":
        remote_code.check_references(cfg, model)  # a kind without a plain-torch reference: before writing anything
    vocab = int(
        vocab_size or (codec.vocab_size if codec is not None else 0) or cfg.model.vocab_size or model.vocab_size
    )
    if vocab > model.vocab_size:
        raise CheckpointError(f"vocabulary {vocab} exceeds the checkpoint's {model.vocab_size} rows")
    out = Path(output)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name (FileExistsError), a file above it, no permission
        raise ConfigError(f"cannot make the export folder {out}: {e.strerror}; name a folder for --output") from None
    stage = out / STAGE_DIR  # the files are written here, then moved into the folder: a failed export changes nothing
    shutil.rmtree(stage, ignore_errors=True)
    try:
        stage.mkdir()
        files, tok_info = _write_files(stage, cfg, model, codec, fmt, dtype, vocab, step, max_shard_size, run_dir)
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or not written_nowhere(e):
            raise
        raise unwritable_export(out, e) from None
    for stale in (
        WEIGHTS_FILE,
        EXTRA_FILE,
        HASHING_FILE,
        "megahash_lsh.npz",
        "megahash_pieces.json",
        "megahash_words.json",
        "tokenization_megahash.py",
        "model.safetensors.index.json",
        *REMOTE_FILES,
    ):
        (out / stale).unlink(missing_ok=True)
    for stale in [*out.glob("model-*-of-*.safetensors"), *remote_code.stale_files(out)]:
        stale.unlink()
    for f in sorted(stage.iterdir()):
        os.replace(f, out / f.name)  # whole files, each renamed in place (no room needed)
    stage.rmdir()
    return {
        "output": str(out),
        "format": fmt,
        "dtype": dtype,
        "vocab_size": vocab,
        "padded_vocab_size": int(model.vocab_size),
        "step": int(step),
        "files": sorted(set(files)),
        "tokenizer_mismatches": tok_info["mismatches"],
        "qwen2_ineligible": why or None,
    }


def export_hf(
    checkpoint,
    output,
    dtype: str = "float32",
    fmt: str = "auto",
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    verify: bool = False,
    max_shard_size=MAX_SHARD_SIZE,
    weights: str = "live",
) -> dict:
    """Export a megahash checkpoint (run dir or step dir) to ``output``; see the module docstring."""
    cfg, model, ckpt, codec, step = load_checkpoint(checkpoint, tokenizer, weights)
    summary = export_model(
        cfg, model, output, codec, step, dtype, fmt, vocab_size, max_shard_size, run_dir=Path(ckpt).parent
    )
    summary["checkpoint"], summary["weights"] = str(ckpt), weights
    if verify:
        from megahash.convert.verify import verify_export

        summary["verify"] = verify_export(cfg, model, output, codec)
    return summary


def main(argv=None) -> int:
    from megahash.command_errors import run_guarded

    p = ArgumentParser(
        prog="megahash export-hf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checkpoint", required=True, help="run directory (its latest) or step_N directory")
    p.add_argument("--output", required=True, help="Hugging Face folder to write")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--format", default="auto", choices=["auto", "megahash", "qwen2"])
    p.add_argument("--tokenizer", default=None, help="override data.tokenizer of the run")
    p.add_argument("--vocab-size", type=int, default=None, help="real vocabulary (default: the tokenizer's)")
    p.add_argument("--no-verify", action="store_true", help="skip loading the export and comparing logits")
    p.add_argument(
        "--max-shard-size",
        default=MAX_SHARD_SIZE,
        help="split model.safetensors above this size "
        "(e.g. 500MB; default 2GB) into shards with model.safetensors.index.json",
    )
    p.add_argument(
        "--weights",
        default="live",
        choices=["live", "ema"],
        help="the trained weights (live) or their average (ema, a run with train.ema.decay)",
    )
    args = p.parse_args(argv)

    def run():
        import os

        import torch.distributed as dist

        from megahash.atomic_write import check_output

        check_output(args.output, "--output", folder=True)  # a file, or a file above it: one line before any work
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        owned = not dist.is_initialized()
        try:
            s = export_hf(
                args.checkpoint,
                args.output,
                args.dtype,
                args.format,
                args.tokenizer,
                args.vocab_size,
                verify=not args.no_verify,
                max_shard_size=args.max_shard_size,
                weights=args.weights,
            )
        finally:
            if owned:
                _teardown()
        print(
            f"megahash export-hf: {s['checkpoint']} ({s['weights']} weights) -> {s['output']} ({s['format']} format, {s['dtype']}, "
            f"vocabulary {s['vocab_size']}, step {s['step']})"
        )
        if "verify" in s:
            v = s["verify"]
            tol = f" (tolerance {v['tolerance']:.3g})" if "tolerance" in v else ""
            print(
                f"megahash export-hf: verified: max |logit difference| {v['max_abs_diff']:.3g} on {v['tokens']} tokens{tol}"
            )
        return 0

    return run_guarded(run)


def _teardown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        from megahash.accelerator import process_groups

        process_groups.teardown()


if __name__ == "__main__":
    sys.exit(main())
