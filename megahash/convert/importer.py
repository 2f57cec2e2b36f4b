"""``megahash import-hf``: a Hugging Face folder written by ``export-hf``, or a standard
``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` / ``MistralForCausalLM`` folder (:func:`megahash.convert.qwen2.megahash_tree`)
-> a megahash checkpoint.

    megahash import-hf --hf HFDIR --output RUN_DIR [--step N]

Reads the full megahash config stored in ``config.json`` (``megahash_config``), builds the TP=1
``MegahashLM`` of it, loads the weights (``model.safetensors`` of the megahash format, or the
renamed Qwen2 tensors plus ``megahash_extra.safetensors``; safetensors only) and writes a complete
checkpoint ``RUN_DIR/step_N/`` (``model/`` megatron dist checkpoint, ``resolved_config.yaml``,
``megahash_state.json`` marked ``weights_only``) plus ``RUN_DIR/latest``. N is the step the export
was made at (``--step`` overrides).

Continue pretraining with ``train.save_dir=RUN_DIR train.resume=auto`` (any TP size: the weights
are a dist checkpoint; the trainer starts a fresh optimizer and LR scheduler, fast-forwarded to
step N, for a ``weights_only`` checkpoint). ``resolved_config.yaml`` is the exported run's config
(data paths included); ``python megahash/pretrain.py --config RUN_DIR/resolved_config.yaml
train.save_dir=RUN_DIR ...`` continues it.
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
from megahash.errors import CheckpointError, ConfigError


def read_hf(folder) -> dict:
    """{"tree", "format", "state" (megahash TP=1 names, float32), "padded", "step"} of an export."""
    from megahash.convert.export import from_hf_names
    from megahash.convert.hf_folder import EXTRA_FILE, WEIGHTS_FILE

    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder} is not a Hugging Face model folder (no config.json)")
    from megahash.checkpoint.layout import read_json

    try:
        data = read_json(cfg_path)
    except ValueError as e:
        raise CheckpointError(f"{folder} is not a Hugging Face model folder: {e}") from None
    from megahash.convert.qwen2 import number, size

    tree = data.get("megahash_config")
    fmt = data.get("model_type")
    if tree is not None and not (isinstance(tree, dict) and all(isinstance(v, dict) for v in tree.values())):
        raise CheckpointError(f"{cfg_path}: megahash_config is not a config tree (an object of sections)")
    if tree:  # the modules it names as plugins are imported: only those this process was told about
        from megahash import catalog

        catalog.check_foreign_plugins((tree.get("model") or {}).get("plugins"), str(cfg_path))
    from megahash.convert.qwen2 import IMPORTABLE

    if not tree and fmt in IMPORTABLE:  # a standard Qwen2/Llama/Mistral ForCausalLM folder (not a megahash export)
        from megahash.config import config_from_dict
        from megahash.convert import qwen2

        tree = qwen2.megahash_tree(data, folder)
        cfg = config_from_dict(_tp1(tree))
        vocab, mult = cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by
        padded = -(-vocab // mult) * mult
        kv = cfg.model.num_query_groups or cfg.model.num_heads
        tensors = qwen2.load_hf_tensors(folder)
        qwen2.check_tensors(tensors, {}, cfg, kv, padded, vocab)
        state = qwen2.from_qwen2(tensors, {}, cfg, kv, padded)
        state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
        return {"tree": tree, "format": f"{fmt}-hf", "state": state, "padded": padded, "step": 0}
    if not tree:
        raise CheckpointError(
            f"{cfg_path} has no megahash_config and model_type {fmt!r}: import-hf reads megahash "
            f"exports and standard Qwen2ForCausalLM, LlamaForCausalLM and MistralForCausalLM folders"
        )
    if not (folder / WEIGHTS_FILE).is_file() and not (folder / "model.safetensors.index.json").is_file():
        raise CheckpointError(f"{folder} has no {WEIGHTS_FILE}")
    from megahash.convert.qwen2 import load_hf_tensors, read_safetensors

    tensors = load_hf_tensors(folder)
    step = number(data, "megahash_step", int, 0)
    if step < 0:
        raise CheckpointError(f"{cfg_path}: megahash_step must be >= 0, got {step}")
    if fmt == "megahash":
        state, padded = from_hf_names(tensors), size(data, "padded_vocab_size")
    elif fmt == "qwen2":
        from megahash.config import config_from_dict
        from megahash.convert import qwen2

        extra = read_safetensors(folder / EXTRA_FILE) if (folder / EXTRA_FILE).is_file() else {}
        vocab = size(data, "vocab_size")
        padded = size(data, "megahash_padded_vocab_size", vocab)
        cfg = config_from_dict(_tp1(tree))
        kv = size(data, "megahash_kv_groups")
        qwen2.check_tensors(tensors, extra, cfg, kv, padded, vocab)
        state = qwen2.from_qwen2(tensors, extra, cfg, kv, padded)
    else:
        raise CheckpointError(f"{cfg_path}: model_type {str(fmt)[:80]!r} is neither megahash nor qwen2")
    _check_agrees(data, tree, fmt, padded, cfg_path)
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    if not (tree.get("model") or {}).get("vocab_size") and data.get("vocab_size"):
        # the real vocabulary, which the run's tokenizer gave (an export names no local tokenizer path)
        tree = json.loads(json.dumps(tree))
        tree.setdefault("model", {})["vocab_size"] = size(data, "vocab_size")
    return {"tree": tree, "format": fmt, "state": state, "padded": padded, "step": step}


def _check_agrees(data: dict, tree: dict, fmt: str, padded: int, cfg_path) -> None:
    """config.json's own fields (what transformers builds the model from) must be those of its
    ``megahash_config`` (what the import builds): a folder whose two disagree is refused in one line (before,
    the import took megahash_config's silently: another model than the one transformers loads from the same
    folder, or a vocabulary larger than the tables)."""
    from megahash.config import config_from_dict
    from megahash.convert.qwen2 import number

    cfg = config_from_dict(_tp1(tree))
    m = cfg.model
    fields = {
        "hidden_size": (m.hidden_size, "model.hidden_size"),
        "num_hidden_layers": (m.num_layers, "model.num_layers"),
        "num_attention_heads": (m.num_heads, "model.num_heads"),
        "intermediate_size": (m.ffn_hidden_size, "model.ffn_hidden_size"),
    }
    if fmt == "megahash":
        fields["num_key_value_heads"] = (m.num_query_groups or m.num_heads, "model.num_query_groups")
    for key, (want, name) in fields.items():
        got = number(data, key, int, None)
        if got != want:
            raise CheckpointError(
                f"{cfg_path}: {key}={got} disagrees with its megahash_config ({name}={want}): "
                "the folder names two models (edited by hand?)"
            )
    vocab = number(data, "vocab_size", int, None)  # the tokenizer's ids, which the logits cover
    if vocab is None or vocab < 1 or (m.vocab_size and vocab > m.vocab_size):
        raise CheckpointError(
            f"{cfg_path}: vocab_size={vocab} disagrees with its megahash_config (model.vocab_size={m.vocab_size}, "
            "0 = the tokenizer's): the folder names two models (edited by hand?)"
        )
    tp = number(tree.get("parallel") or {}, "tensor", int, 1)
    # the tables: the model's vocabulary (an explicit model.vocab_size may exceed the tokenizer's) padded to a
    # multiple of make_vocab_size_divisible_by x TP (or resized to it)
    rows = m.vocab_size or vocab
    if not 0 <= padded - rows < max(1, m.make_vocab_size_divisible_by) * max(1, tp):
        raise CheckpointError(
            f"{cfg_path}: a vocabulary of {rows} (vocab_size {vocab}, megahash_config's model.vocab_size "
            f"{m.vocab_size}) does not fit the {padded}-row vocabulary tables of its weights"
        )
    if fmt != "megahash":
        return
    specs = data.get("layer_specs")
    if not isinstance(specs, list) or len(specs) != m.num_layers:
        n = len(specs) if isinstance(specs, list) else None
        raise CheckpointError(
            f"{cfg_path}: layer_specs has {n} entries, its megahash_config {m.num_layers} layers (model.num_layers)"
        )
    from megahash.models import registry

    for i, (spec, kind) in enumerate(zip(specs, registry.schedule_kinds(cfg))):  # the kind transformers builds
        got = spec.get("kind") if isinstance(spec, dict) else None
        if got != kind:
            raise CheckpointError(
                f"{cfg_path}: layer_specs[{i}] is {str(got)[:40]!r}, its megahash_config's schedule "
                f"{m.schedule!r} has {kind!r} there: the folder names two models (edited by hand?)"
            )


def _tp1(tree: dict) -> dict:
    tree = json.loads(json.dumps(tree))
    tree["parallel"] = {"tensor": 1, "sequence": False}
    return tree


def build_model(tree: dict, padded: int, save_dir=None, state: dict | None = None):
    """(cfg, TP=1 MegahashLM without initialisation) of a resolved config tree; with ``state`` (the folder's
    tensors) its shapes are checked first on a meta-device model, so a config.json whose sizes the tensors
    do not have is one line before anything is allocated."""
    from megahash.accelerator import process_groups, rng
    from megahash.config import config_from_dict
    from megahash.models.megatron_model import MegahashLM

    tree = _tp1(tree)
    for section in ("attention", "embed"):  # kind options naming files of the exporting machine: the
        opts = (tree.get("model", {}).get(section) or {}).get("options") or {}  # data they made comes with the weights
        for key, value in opts.items():
            if isinstance(value, str) and os.sep in value and not os.path.exists(value):
                opts[key] = ""
    if save_dir is not None:
        tree.setdefault("train", {})["save_dir"] = str(save_dir)
    cfg = config_from_dict(tree)
    process_groups.init_distributed(1)
    rng.seed_all(cfg.train.seed)
    if state is not None:
        # every layer has tensors of its own (a skipped one too): more layers than the weights have is
        # refused before the meta model, whose build takes minutes at 10**5 layers
        layers = {k.split(".")[2] for k in state if k.startswith("decoder.layers.")}
        if cfg.model.num_layers > len(layers):
            raise CheckpointError(
                f"the weights do not fit the model of megahash_config: model.num_layers={cfg.model.num_layers}, "
                f"the weights have {len(layers)} layers"
            )
        try:
            with torch.device("meta"):
                want = MegahashLM(cfg, padded, torch.float32, init=False).state_dict()
        except (RuntimeError, OverflowError, ValueError, TypeError) as e:  # past int64 (torch: TypeError)
            raise CheckpointError(
                f"the model of megahash_config cannot be built: {str(e).splitlines()[0][:200]}"
            ) from None
        lacking = [k for k in want if k not in state and not k.endswith("_extra_state")]
        if lacking:
            raise CheckpointError(f"the weights do not fit the model of megahash_config: missing {lacking[:3]}")
        bad = [k for k, v in want.items() if k in state and tuple(state[k].shape) != tuple(v.shape)]
        if bad:
            raise CheckpointError(
                f"the weights do not fit the model of megahash_config: {bad[0]} has shape "
                f"{list(state[bad[0]].shape)}, the config's model {list(want[bad[0]].shape)}"
            )
        kind = [k for k, v in want.items() if k in state and state[k].is_floating_point() != v.is_floating_point()]
        if kind:  # an integer tensor where a float weight goes (or a float for an integer buffer)
            raise CheckpointError(
                f"the weights do not fit the model of megahash_config: {kind[0]} is "
                f"{str(state[kind[0]].dtype)[6:]}, the config's model {str(want[kind[0]].dtype)[6:]}"
            )
    return cfg, MegahashLM(cfg, padded, torch.float32, init=False)


def load_state(model, state: dict) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(
            f"the weights do not fit the model of megahash_config: missing {missing[:3]}, "
            f"unexpected {list(unexpected)[:3]}"
        )


def write_weights_checkpoint(model, cfg, save_dir, step: int, extra: dict | None = None) -> Path:
    """A complete, weights-only megahash checkpoint ``save_dir/step_N`` (+ ``latest``) of a TP=1 model."""
    from megahash.atomic_write import write_json_atomic, write_text_atomic
    from megahash.checkpoint.layout import STATE_FILE, STATE_FORMAT, WEIGHTS_DIR, tag_for
    from megahash.checkpoint.resolve import complete_checkpoints
    from megahash.checkpoint.signature import model_signature
    from megahash.checkpoint.weights import save_weights
    from megahash.config import save_config

    root = Path(save_dir)
    if complete_checkpoints(root):
        raise CheckpointError(f"{root} already holds megahash checkpoints; import into a new directory")
    tag = tag_for(step)
    if (root / tag).exists() or (root / tag).is_symlink():  # os.replace onto it: ENOTEMPTY after the work
        raise CheckpointError(f"{root} already holds {tag} (unfinished); import into a new directory")
    for name in ("latest", "resolved_config.yaml"):  # written last: a folder there left a checkpoint without them
        if (root / name).exists() and not (root / name).is_file():
            raise CheckpointError(f"{root / name} is not a file; import into a new directory")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (tag + ".tmp")
    if tmp.is_dir() and not tmp.is_symlink():  # an earlier import's leftover, whatever it is
        shutil.rmtree(tmp)
    else:
        tmp.unlink(missing_ok=True)
    save_weights(model, tmp / WEIGHTS_DIR)
    save_config(cfg, tmp / "resolved_config.yaml")
    from megahash.data.samples import consumed_samples

    state = {
        "format": STATE_FORMAT,
        "step": int(step),
        "consumed_samples": consumed_samples(cfg.train, int(step)),
        "signature": model_signature(cfg),
        "padded_vocab_size": int(model.vocab_size),
        "world_size": 1,
        "weights_only": True,
        **(extra or {}),
    }
    from megahash.checkpoint.manifest import write_manifest

    write_manifest(tmp)  # size and sha256 of every file, as a training save's (docs/security.md)
    write_json_atomic(tmp / STATE_FILE, state)
    os.replace(tmp, root / tag)
    write_text_atomic(root / "latest", tag)
    save_config(cfg, root / "resolved_config.yaml")
    return root / tag


def import_hf(hf_dir, output, step: int | None = None) -> dict:
    got = read_hf(hf_dir)
    cfg, model = build_model(got["tree"], got["padded"], save_dir=output, state=got["state"])
    load_state(model, got["state"])
    n = got["step"] if step is None else int(step)
    ckpt = write_weights_checkpoint(
        model, cfg, output, n, {"imported_from": str(Path(hf_dir).resolve()), "imported_format": got["format"]}
    )
    return {"checkpoint": str(ckpt), "step": n, "format": got["format"]}


def main(argv=None) -> int:
    from megahash.command_errors import run_guarded

    p = ArgumentParser(
        prog="megahash import-hf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--hf", required=True, help="folder written by megahash export-hf, or a Qwen2/Llama/Mistral ForCausalLM folder"
    )
    p.add_argument("--output", required=True, help="new run directory for the checkpoint")
    p.add_argument("--step", type=int, default=None, help="step number of the checkpoint (default: the export's)")
    args = p.parse_args(argv)

    def run():
        from megahash.atomic_write import check_output

        if args.step is not None and args.step < 0:
            raise ConfigError(f"--step must be >= 0, got {args.step}")
        check_output(args.output, "--output", folder=True)  # a file there was a FileExistsError after the work
        import torch.distributed as dist

        owned = not dist.is_initialized()
        try:
            s = import_hf(args.hf, args.output, args.step)
        finally:
            from megahash.convert.export import _teardown

            if owned:
                _teardown()
        print(
            f"megahash import-hf: {args.hf} ({s['format']}) -> {s['checkpoint']} (weights only; resume with "
            f"train.save_dir={args.output} train.resume=auto)"
        )
        return 0

    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main())
