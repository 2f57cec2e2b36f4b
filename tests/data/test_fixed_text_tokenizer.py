"""One tokenizer everywhere, for the fixed text too (issue 33 item 5).

fixedseqqk's fixed text (``model.attention.options.fixed_text``) is tokenised by
``megahash.data.text_source`` for the kind's ``prepare`` hook. It must give the ids the data stage
gives for the same text, with every tokenizer kind megahash.tokenization loads, special ids that are
not the word ids 0-4, and special-token strings inside the text treated as ordinary text.

Three tokenizers, trained here on a bit of the shakespeare text, each with its specials at the END of
the vocabulary:

- ``sp``: a sentencepiece BPE model (unk/bos/eos/pad = 396-399) with a user-defined ``<mask>``
  appended as id 400 (sentencepiece on its own matches user-defined pieces in text; the data stage
  does not);
- ``json``: a byte-level BPE ``tokenizer.json`` (``tokenizers``), specials ``<s> <pad> </s> <mask>``
  added after the merges;
- ``folder``: a Hugging Face tokenizer folder (``PreTrainedTokenizerFast.save_pretrained``) whose
  specials have names only its ``tokenizer_config.json`` tells (``<|doc|>`` bos, ``<|enddoc|>`` eos).

Independent facts: the data stage's worker encoder (``ChunkEncoder``, a second code path with its
own per-token cache for sentencepiece BPE) and, for the Hugging Face files, transformers'
``AutoTokenizer`` with ``split_special_tokens=True`` give the same ids; decoding the fixed ids gives
the special-token strings back as text. Before the fix the ``sp`` case put id 400 for ``<mask>``
in the text, ``json`` failed with ``could not parse ModelProto`` and ``folder`` with ``cannot
tokenise ... without a tokenizer``.
"""

from __future__ import annotations

import os

import pytest
import torch

from megahash.config import load_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPECIAL_STRINGS = ["<s>", "</s>", "<pad>", "<unk>", "<mask>", "<|doc|>", "<|enddoc|>", "<|pad|>", "<|endoftext|>"]
LENGTH = 192  # fixed_seq_length: the spliced special strings are inside it for every tokenizer


def _shakespeare(chars: int) -> str:
    from megahash.data.text_source import shakespeare_text

    return shakespeare_text(max_chars=chars)


def _sentencepiece(d, text: str) -> str:
    """BPE (byte fallback: no unknown characters) with unk/bos/eos/pad at 396-399 and a user-defined
    <mask> appended (id 400)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    (d / "corpus.txt").write_text(text)
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"),
        model_prefix=str(d / "sp"),
        vocab_size=400,
        model_type="bpe",
        unk_id=396,
        bos_id=397,
        eos_id=398,
        pad_id=399,
        byte_fallback=True,
        minloglevel=2,
    )
    proto = pb.ModelProto.FromString((d / "sp.model").read_bytes())
    proto.pieces.add(piece="<mask>", score=0.0, type=pb.ModelProto.SentencePiece.USER_DEFINED)
    (d / "sp.model").write_bytes(proto.SerializeToString())
    return str(d / "sp.model")


def _byte_bpe(text: str, specials: list[str]):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(
        vocab_size=500, special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(text.split("\n\n"), tr)
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return tok


@pytest.fixture(scope="module")
def tokenizers_(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("fixed_tok")
    text = _shakespeare(40_000)
    out = {"sp": _sentencepiece(d, text)}
    _byte_bpe(text, ["<s>", "<pad>", "</s>", "<mask>"]).save(str(d / "tokenizer.json"))
    out["json"] = str(d / "tokenizer.json")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_byte_bpe(text, ["<|doc|>", "<|enddoc|>", "<|pad|>", "<|mask|>"]),
        bos_token="<|doc|>",
        eos_token="<|enddoc|>",
        pad_token="<|pad|>",
        mask_token="<|mask|>",
    )
    fast.save_pretrained(str(d / "hf_folder"))
    out["folder"] = str(d / "hf_folder")
    # the fixed text: the play's opening with every special-token string spliced in early
    play = _shakespeare(6_000)
    spliced = play[:120] + " " + " ".join(SPECIAL_STRINGS) + "\n" + play[120:300] + "<mask>x</s>" + play[300:]
    (d / "fixed.txt").write_text(spliced)
    out["fixed_text"], out["text"] = str(d / "fixed.txt"), spliced
    return out


def _cfg(tokenizer: str, fixed_text: str = "shakespeare"):
    return load_config(
        None,
        [
            "model.schedule=uniform:fixedseqqk",
            "model.hidden_size=32",
            "model.num_layers=1",
            "model.num_heads=4",
            "model.ffn_hidden_size=64",
            "data.seq_length=16",
            "model.max_position_embeddings=64",
            f"model.attention.options.fixed_seq_length={LENGTH}",
            f"data.tokenizer={tokenizer}",
            f"model.attention.options.fixed_text={fixed_text}",
        ],
    )


def _data_stage_ids(spec: str, text: str) -> list[int]:
    """What the data stage's worker encoder writes for ``text`` (no EOS appended)."""
    from megahash.data.preprocess.encoding import ChunkEncoder, EncoderConfig

    res = ChunkEncoder(EncoderConfig(tokenizer=spec, specs=[], append_eos=False)).encode([text])
    return res.tokens.astype("int64").tolist()


@pytest.fixture(scope="module")
def fixed_model(dist):
    """A one-layer fixedseqqk model (vocabulary 512, above every tokenizer's) whose prepare hook reads the text."""
    from megahash.models.megatron_model import build_model

    model = build_model(_cfg("unused"), 512, dtype=torch.float32)
    assert model.fixed_qk is not None and model.fixed_qk.source == "text"
    return model


@pytest.mark.parametrize("kind", ["sp", "json", "folder"])
def test_tokenizer_specials_are_not_the_word_ids(tokenizers_, kind):
    from megahash.tokenization import load_tokenizer

    tok = load_tokenizer(tokenizers_[kind])
    ids = {r: i for r, i in tok.special_ids.items() if i is not None}
    assert min(ids.values()) >= tok.vocab_size - 5 > 4, ids  # at the end of the vocabulary, not 0-4
    assert {"bos", "eos", "pad", "mask"} <= set(ids)
    if kind == "folder":  # names only the folder's tokenizer_config.json gives
        assert tok.special_tokens["bos"] == "<|doc|>" and tok.special_tokens["eos"] == "<|enddoc|>"


@pytest.mark.parametrize("source", ["text", "shakespeare"])
@pytest.mark.parametrize("kind", ["sp", "json", "folder"])
def test_fixed_input_ids_are_the_data_stages(tokenizers_, fixed_model, kind, source):
    """The fixed input prepared for the model == megahash.tokenization's encoder == the data stage's
    worker encoder (== transformers' AutoTokenizer for the Hugging Face files), on a text with every
    special-token string in it: none becomes a special id, and decoding gives them back as text."""
    from megahash.data.text_source import RunTexts
    from megahash.tokenization import load_tokenizer

    spec = tokenizers_[kind]
    tok = load_tokenizer(spec)
    cfg = _cfg(spec, tokenizers_["fixed_text"] if source == "text" else "shakespeare")
    text = tokenizers_["text"] if source == "text" else _shakespeare(64 * LENGTH)
    fixed_model.fixed_qk.prepare(cfg, tok.vocab_size, RunTexts(cfg))
    got = fixed_model.fixed_qk.tokens.tolist()
    assert len(got) == LENGTH and min(got) >= 0  # the whole buffer filled
    want = tok.encode(text)[:LENGTH]
    assert got == want
    assert got == _data_stage_ids(spec, text)[:LENGTH]
    if kind != "sp":
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(os.path.dirname(spec) if kind == "json" else spec, split_special_tokens=True)
        assert got == hf(text, add_special_tokens=False).input_ids[:LENGTH]
    specials = {i for i in tok.special_ids.values() if i is not None}
    assert not specials & set(got)  # special-token strings in the text are text
    if source == "text":
        decoded = tok.decode(got)
        assert all(s in decoded for s in SPECIAL_STRINGS), decoded[:400]


def test_fixed_text_errors_are_one_line(tokenizers_, tmp_path):
    from megahash.data.text_source import token_ids
    from megahash.errors import ConfigError

    cfg = _cfg(str(tmp_path / "missing.model"), tokenizers_["fixed_text"])
    with pytest.raises(ConfigError, match=r"cannot tokenise model.attention.options.fixed_text: tokenizer not found"):
        token_ids(tokenizers_["fixed_text"], cfg, LENGTH, None, "model.attention.options.fixed_text")
    cfg.data.tokenizer = ""
    with pytest.raises(ConfigError, match="without a tokenizer"):
        token_ids(tokenizers_["fixed_text"], cfg, LENGTH, None, "model.attention.options.fixed_text")


@pytest.mark.parametrize("kind", ["json", "folder"])
def test_shards_of_a_hugging_face_tokenizer_decode_verify_and_size(tokenizers_, kind, tmp_path):
    """The shard tools (decode, verify's recomputed codes) and the dataset's vocabulary size load the
    tokenizer through megahash.tokenization too (they used to read any tokenizer as sentencepiece)."""
    from megahash.config import Config
    from megahash.data.dataset import _vocab_size
    from megahash.data.preprocess.preprocess_data import run
    from megahash.data.shards import ShardSet
    from megahash.tokenization import load_tokenizer

    spec = tokenizers_[kind]
    docs = [tokenizers_["text"][i : i + 700] for i in range(0, 2800, 700)]
    (tmp_path / "docs.txt").write_text("\n\n".join(docs))
    assert (
        run(
            [
                "--input",
                str(tmp_path / "docs.txt"),
                "--output-prefix",
                str(tmp_path / "s"),
                "--tokenizer",
                spec,
                "--word-hashes",
                "md5",
                "--workers",
                "1",
                "--quiet",
            ]
        )
        == 0
    )
    shards = ShardSet.open(str(tmp_path / "s"))
    assert shards.verify(sample_docs=3)["checked_tokens"] > 0
    tok = load_tokenizer(spec)
    assert shards.decode(0) == tok.decode(shards.tokens.get(0).tolist())
    assert "<s>" in "".join(shards.decode(d) for d in range(shards.num_documents))  # special strings are text
    cfg = Config()
    cfg.data.tokenizer = spec
    assert _vocab_size(cfg, {}) == tok.vocab_size


def test_fixed_text_of_a_word_stream_is_its_word_table_ids(tmp_path):
    """A word stream (``--tokenizer words``, no data.tokenizer): the fixed text gets the word-table
    ids the data stage wrote for the same text (megahash.tokenization.WordTable; unseen words <unk>)."""
    from megahash.data.preprocess.preprocess_data import run
    from megahash.data.shards import ShardSet
    from megahash.data.text_source import token_ids
    from megahash.hashing.words import UNK_ID

    play = "\n".join(line for line in _shakespeare(3_000).splitlines() if line.strip())  # no blank line: 2 documents
    docs = [play[:1200] + " <s> </s> <mask>", play[1200:2400]]
    (tmp_path / "docs.txt").write_text("\n\n".join(docs))
    assert (
        run(
            [
                "--input",
                str(tmp_path / "docs.txt"),
                "--output-prefix",
                str(tmp_path / "w"),
                "--tokenizer",
                "words",
                "--workers",
                "1",
                "--quiet",
                "--no-append-eos",
            ]
        )
        == 0
    )
    shards = ShardSet.open(str(tmp_path / "w"))
    (tmp_path / "fixed.txt").write_text(docs[0])
    cfg = _cfg("", str(tmp_path / "fixed.txt"))
    cfg.data.prefix = [str(tmp_path / "w")]
    ids = token_ids(str(tmp_path / "fixed.txt"), cfg, 10_000, None, "model.attention.options.fixed_text")
    assert ids == shards.tokens.get(0).astype("int64").tolist()
    (tmp_path / "fixed.txt").write_text("zyzzyva " + " ".join(docs[0].split()[:8]))  # whole words of doc 0
    ids = token_ids(str(tmp_path / "fixed.txt"), cfg, 10_000, None, "model.attention.options.fixed_text")
    assert ids[0] == UNK_ID and ids[1:] == shards.tokens.get(0).astype("int64").tolist()[: len(ids) - 1]
