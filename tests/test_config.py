"""Config tree: YAML + dotted overrides, typed, one-line errors naming the key and the closest one."""

import math
import re

import pytest
import yaml

from megahash.config import load_config
from megahash.errors import ConfigError


def test_yaml_include_and_overrides():
    cfg = load_config("configs/quickstart.yaml", ["train.steps=7", "model.num_layers=3", "parallel.tensor=2"])
    assert cfg.model.hidden_size == 128  # from the included model/tiny.yaml
    assert cfg.train.steps == 7 and cfg.model.num_layers == 3 and cfg.parallel.tensor == 2
    assert cfg.data.prefix == ["data/shakespeare/shakespeare"]


def test_model_size_table_4_10():
    for size, (h, ffn, layers, heads) in {
        "70m": (512, 2048, 6, 8),
        "160m": (768, 3072, 12, 12),
        "500m": (896, 4864, 24, 14),
        "1.7b": (2048, 6144, 28, 16),
    }.items():
        m = load_config(f"configs/model/{size}.yaml").model
        assert (m.hidden_size, m.ffn_hidden_size, m.num_layers, m.num_heads) == (h, ffn, layers, heads)
    assert load_config(None, ["model.size=160m"]).model.hidden_size == 768


@pytest.mark.parametrize(
    "override, expect",
    [
        ("train.stpes=3", "did you mean 'steps'"),
        ("modle.hidden_size=3", "did you mean 'model'"),
        ("train.steps=many", "must be an integer"),
        ("parallel.sequence=maybe", "true/false"),
        ("parallel.tensor=3", "does not divide model.num_heads"),
        ("model.hidden_size=132", "odd head size 33; RoPE needs an even one"),  # 132 / 4 heads: was a traceback
        ("data.seq_length=4096", "exceeds model.max_position_embeddings"),
        ("model.size=13b", "unknown model size"),
        ("model=3", "config key 'model' must be a mapping, got 3"),  # was an AttributeError traceback
        ("data.special_ids=5", "data.special_ids must be a mapping role: id over bos, pad, eos, unk, mask, got 5"),
        ("data.special_ids.makz=4", "unknown config key 'data.special_ids.makz' (did you mean 'mask'?)"),
        ("data.special_ids.mask=-3", "'data.special_ids.mask' must be a token id >= 0 or null, got -3"),
        ("parallel.sequence=true", "needs parallel.tensor >= 2"),
        ("train.verify_checkpoint=none", "'train.verify_checkpoint' must be cheap or full"),
        # the registries' choices name the closest too (they did not: 'got 'clmm'', 'got 'Decoder'')
        ("train.objective=clmm", "train.objective must be clm, mlm or sr, got 'clmm' (did you mean 'clm'?)"),
        ("model.arch=Decoder", "model.arch must be decoder or encoder, got 'Decoder' (did you mean 'decoder'?)"),
    ],
)
def test_config_errors_name_the_key(override, expect):
    with pytest.raises(ConfigError) as e:
        load_config("configs/quickstart.yaml", [override])
    msg = str(e.value)
    assert expect in msg and "\n" not in msg


def test_kind_options_live_in_the_kind_files(tmp_path):
    """A kind's options are the fields of the options dataclass its own file registers
    (``model.attention.options.*`` / ``model.embed.options.*``, every declared option present with its
    default); an option spelled outside ``options`` (``model.attention.fixed_text``, as before kinds owned
    them) is an unknown key in YAML, overrides and saved trees alike."""
    import dataclasses

    import yaml

    from megahash import catalog
    from megahash.config import AttentionConfig, EmbeddingConfig, config_from_dict, load_config, save_config

    # no kind-specific field is left in the central config classes
    central = {f.name for c in (AttentionConfig, EmbeddingConfig) for f in dataclasses.fields(c)}
    declared = set(catalog.option_specs("attention")) | set(catalog.option_specs("embedding"))
    assert {"fixed_text", "chunk_size", "feature_dim", "pool_bits", "rolling_dim"} <= declared
    assert not central & declared
    # each option's default is its declaring class's default, read torch-free from the kind's source
    spec = catalog.option_specs("attention")["fixed_seq_length"]
    assert spec.default == 2048 and set(spec.kinds) == {"rndembqk", "fixedseqqk"}
    cfg = load_config(None, [])
    assert cfg.model.attention.options.fixed_seq_length == 2048 and cfg.model.embed.options.pool_bits == 10

    cfg = load_config(
        None,
        [
            "model.attention.options.chunk_size=16",
            "model.attention.options.fixed_seq_length=128",
            "model.embed.options.rolling_dim=24",
        ],
    )
    o = cfg.model.attention.options
    assert (o.fixed_seq_length, o.chunk_size, cfg.model.embed.options.rolling_dim) == (128, 16, 24)
    save_config(cfg, tmp_path / "resolved.yaml")
    tree = yaml.safe_load((tmp_path / "resolved.yaml").read_text())
    assert tree["model"]["attention"]["options"]["chunk_size"] == 16 and "chunk_size" not in tree["model"]["attention"]
    assert config_from_dict(tree).model.attention.options.chunk_size == 16
    # an option outside ``options`` (the spelling before kinds owned them) is an unknown key: one line
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  attention:\n    fixed_seq_length: 64\n")
    for make in (
        lambda: load_config(str(old)),
        lambda: load_config(None, ["model.embed.rolling_dim=24"]),
        lambda: config_from_dict({"model": {"attention": {"fixed_text": "x.tok"}}}),
    ):
        with pytest.raises(ConfigError) as e:
            make()
        assert str(e.value).startswith("unknown config key 'model.") and "\n" not in str(e.value)


def test_checkpoint_model_signature_matches_its_model_only():
    """A checkpoint's saved model tree matches the same model; a changed option value, or a tree spelled
    otherwise (kind options outside ``options``), is another model, named by its first difference."""
    import copy

    from megahash.checkpoint.signature import model_diffs, model_signature

    cfg = load_config(
        None,
        [
            "model.schedule=uniform:fixedseqqk",
            "model.attention.options.fixed_seq_length=64",
            "model.embedding=rolling",
            "model.embed.hash_spec=rolling3",
        ],
    )
    saved = copy.deepcopy(model_signature(cfg)["model"])
    assert model_diffs(saved, cfg) == []
    changed = copy.deepcopy(saved)
    changed["attention"]["options"]["fixed_seq_length"] = 128
    assert model_diffs(changed, cfg) == ["model.attention.options.fixed_seq_length: checkpoint 128 vs config 64"]
    old = copy.deepcopy(saved)
    old["attention"].update(old["attention"].pop("options"))
    assert model_diffs(old, cfg)[0].startswith("model.attention.chunk_size: checkpoint ")


def test_keys_of_the_previous_release_load_under_their_new_names_with_one_warning(tmp_path, capsys):
    """Issue 46 moved the training features' keys into their own sections of ``train``: a config file or an
    override with an old key (``train.ema_decay``, ``train.hang_timeout_s``, ``train.max_skips``) still loads,
    the values under the new names, with ONE warning line naming them; an old key beside its new name in one
    file is one line; a saved tree of that release (a checkpoint's resolved config) loads silently."""
    from megahash.config import config_from_dict, load_config

    f = tmp_path / "old.yaml"
    f.write_text("include: [quickstart.yaml]\ntrain:\n  ema_decay: 0.9\n  hang_timeout_s: 5\n")
    cfg = load_config(str(f), ["train.max_skips=3", "train.qat.bits=4"])
    assert (cfg.train.ema.decay, cfg.train.watchdog.timeout_s, cfg.train.step_guard.max_skips) == (0.9, 5.0, 3)
    assert cfg.train.qat.bits == 4 and not hasattr(cfg.train, "ema_decay")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: config keys renamed"), err
    for new in ("train.ema.decay", "train.watchdog.timeout_s", "train.step_guard.max_skips"):
        assert new in err[0]
    f.write_text("train:\n  ema_decay: 0.9\n  ema:\n    decay: 0.8\n")
    with pytest.raises(ConfigError, match="gives both 'train.ema_decay' and its new name 'train.ema.decay'"):
        load_config(str(f))
    saved = load_config("configs/quickstart.yaml").to_dict()
    del saved["train"]["step_guard"]["spike_factor"]
    saved["train"]["spike_factor"] = 3.0  # as that release wrote it
    assert config_from_dict(saved).train.step_guard.spike_factor == 3.0
    # what evaluation and export read: that checkpoint's saved config, with overrides in the new names
    import yaml

    from megahash.checkpoint.resolve import checkpoint_config

    (tmp_path / "resolved_config.yaml").write_text(yaml.safe_dump(saved))
    cfg = checkpoint_config(tmp_path, ["train.step_guard.spike_factor=4", "train.hang_factor=3"])
    assert (cfg.train.step_guard.spike_factor, cfg.train.watchdog.factor) == (4.0, 3.0)
    assert capsys.readouterr().err == ""


def test_a_choice_is_its_literal_one_line_with_the_closest():
    """Closed sets are ``Literal`` fields, checked in one place (config_checks.check_fields) with the closest
    value named; the features' sections likewise (``train.muon.adjust_lr``)."""
    for override, expect in (
        (
            "train.decay=cosin",
            "config key 'train.decay' must be cosine, linear, wsd or constant, got 'cosin' (did you mean 'cosine'?)",
        ),
        ("train.muon.adjust_lr=match_rms", "config key 'train.muon.adjust_lr' must be original or match_rms_adamw"),
        (
            "train.muon.orthogonalizer=polar",
            "config key 'train.muon.orthogonalizer' must be newton_schulz or polar_express, got 'polar' "
            "(did you mean 'polar_express'?)",
        ),
        ("logging.x_axis=token", "(did you mean 'tokens'?)"),
    ):
        with pytest.raises(ConfigError) as e:
            load_config("configs/quickstart.yaml", [override])
        assert expect in str(e.value), str(e.value)
    assert load_config("configs/quickstart.yaml", ["train.compile=true"]).train.compile == "true"  # YAML's bool


@pytest.mark.parametrize("text", ["1.5", "'1.5'", "2.5e0", "1e400", "-1e400"])
def test_an_integer_key_never_truncates_a_fraction(text):
    """An int key given a number that is not a whole one is one line naming it, whatever form PyYAML leaves it
    in (PyYAML reads 2.5e0 as text: its floats need a dot). Before: '1.5' and 2.5e0 trained 1 and 2 steps,
    1e400 was an OverflowError traceback."""
    as_number = float(yaml.safe_load(text))
    assert not (math.isfinite(as_number) and as_number.is_integer())  # the independent fact: not a whole number
    with pytest.raises(ConfigError, match=r"^config key 'train.steps' must be an integer, got "):
        load_config("configs/quickstart.yaml", [f"train.steps={text}"])


@pytest.mark.parametrize("text", ["1e3", "128.0", "'64'", "1_000", "+8"])
def test_an_integer_key_takes_any_whole_number_spelling(text):
    want = float(str(yaml.safe_load(text)).replace("_", ""))
    assert want.is_integer()
    assert load_config("configs/quickstart.yaml", [f"train.steps={text}"]).train.steps == int(want)


@pytest.mark.parametrize("key", ["data.prefix", "eval.tasks", "model.plugins", "train.profile_steps"])
@pytest.mark.parametrize("text", ["null", "~", ""])
def test_a_null_list_is_an_empty_one(tmp_path, key, text):
    """YAML's null (``prefix:`` with no value, ``eval.tasks=~``) for a list key is no entries, as ``[]`` is.
    Before: [''] (a shard prefix '' -> 'data shard _text_document.bin does not exist'; an eval task named '')."""
    assert yaml.safe_load(text) is None  # the independent fact: PyYAML reads each as null
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {text}\n")
    for cfg in (load_config(path), load_config(None, [f"{key}={text or 'null'}"])):
        assert getattr(getattr(cfg, section), name) == []


def test_an_empty_section_in_a_later_file_merges_nothing(tmp_path):
    """A section whose keys are all commented out is YAML's null; merged over an earlier file (``--config A
    --config B``, or ``include:``) it is ``model: {}``: nothing. Before: it replaced the section, so the
    quickstart's 128-wide model trained at the 64-wide default without a word."""
    empty, braces = tmp_path / "empty.yaml", tmp_path / "braces.yaml"
    empty.write_text("include: quickstart.yaml\nmodel:\n  # hidden_size: 256\ntrain:\n")
    braces.write_text("include: quickstart.yaml\nmodel: {}\ntrain: {}\n")
    assert yaml.safe_load(empty.read_text())["model"] is None  # PyYAML's reading: null
    want = load_config("configs/quickstart.yaml").to_dict()
    assert want["model"]["hidden_size"] == 128
    assert load_config(empty).to_dict() == load_config(braces).to_dict() == want
    assert load_config(["configs/quickstart.yaml", empty]).to_dict() == want


def test_a_section_given_whole_on_the_command_line_merges_key_by_key():
    """``model={num_layers: 3}`` is ``model.num_layers=3`` (as a later --config file, and Hydra's override of
    a mapping); ``model=null`` is one line. Before: both replaced the section, the YAML's model keys silently
    back at their defaults."""
    base = ["model.hidden_size=256", "model.attention.options.window=8"]
    whole = load_config("configs/quickstart.yaml", [*base, "model={num_layers: 3, attention: {options: {}}}"])
    dotted = load_config("configs/quickstart.yaml", [*base, "model.num_layers=3"])
    assert whole.to_dict() == dotted.to_dict()
    assert (whole.model.hidden_size, whole.model.attention.options.window) == (256, 8)
    with pytest.raises(ConfigError, match=r"^override 'train=null': 'train' is a section, not a value; set its"):
        load_config("configs/quickstart.yaml", ["train=null"])


def _leaves(tree: dict, prefix: str = "") -> dict[str, list[str]]:
    """{leaf name: [dotted keys]} of a resolved tree (the independent fact: where a key lives)."""
    out: dict[str, list[str]] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and not k.endswith("special_ids"):
            for name, keys in _leaves(v, f"{prefix}{k}.").items():
                out.setdefault(name, []).extend(keys)
        out.setdefault(k, []).append(prefix + k)
    return out


@pytest.mark.parametrize("override", ["train.hidden_size=3", "train.seq_length=64", "num_layers=3", "model.seed=1"])
def test_a_key_of_another_section_names_where_it_lives(override):
    """Before: 'unknown config key 'train.hidden_size' (valid: async_save, batch_ramp, ...)' (every train key, not
    the one meant); a Megatron-style YAML with top-level num_layers listed the seven sections."""
    where = _leaves(load_config("configs/quickstart.yaml").to_dict())[override.split("=")[0].split(".")[-1]]
    with pytest.raises(ConfigError) as e:
        load_config("configs/quickstart.yaml", [override])
    assert all(repr(k) in str(e.value) for k in where) and "valid:" not in str(e.value), str(e.value)


def test_other_trainers_names_point_at_megahash_keys(tmp_path):
    """A Megatron-LM/GPT-NeoX/torchtitan name (``num_attention_heads``, ``train_iters``) suggests megahash's key;
    every suggestion is a key of the resolved tree, and no foreign name is one of megahash's own."""
    from megahash.config import FOREIGN_NAMES

    leaves = _leaves(load_config("configs/quickstart.yaml").to_dict())
    dotted = {k for keys in leaves.values() for k in keys}
    assert set(FOREIGN_NAMES.values()) <= dotted and not set(FOREIGN_NAMES) & set(leaves)
    with pytest.raises(
        ConfigError, match=r"^unknown config key 'model.num-layers' \(did you mean 'model.num_layers'\?\)$"
    ):
        load_config(None, ["model.num-layers=3"])  # GPT-NeoX's spelling, with dashes
    megatron = tmp_path / "megatron.yaml"
    megatron.write_text("num_attention_heads: 16\nnum_layers: 24\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'num_attention_heads' \(did you mean 'model.num_heads'"):
        load_config(megatron)


def test_a_deepspeed_json_given_as_config_says_where_it_goes():
    """Before: 'unknown config key 'zero_optimization' (valid: data, eval, ...)'. Now the line names the file a
    DeepSpeed config and the flag that takes it; the same file as --deepspeed_config still loads."""
    import json

    from megahash.pretrain import main

    ds = "configs/deepspeed/zero1.json"  # the quickstart's stage
    assert "zero_optimization" in json.loads(open(ds).read())  # the independent fact: a DeepSpeed config
    with pytest.raises(ConfigError, match=r"is a DeepSpeed config \(zero_optimization\).*--deepspeed_config "):
        load_config(["configs/quickstart.yaml", ds])
    assert main(["--check", "config", "--config", "configs/quickstart.yaml", "--deepspeed_config", ds]) == 0


@pytest.mark.parametrize("text", ["off", "no", "false", "True", "on"])
def test_a_yaml_boolean_in_a_text_key_reads_as_yaml_writes_it(text, shakespeare_shards):
    """PyYAML reads off/no/on as booleans; a text key keeps them as YAML writes a boolean back ('false', 'true'),
    and train.resume=off/no/false means no resume. Before: 'False'/'True' (Python's spelling), and
    train.resume=off was 'train.resume=False is not a complete megahash checkpoint'."""
    from megahash.inputs import check_training_inputs

    parsed = yaml.safe_load(text)
    assert isinstance(parsed, bool)  # the independent fact: a YAML boolean
    want = yaml.safe_dump(parsed).split("\n")[0]  # how YAML writes it: true / false
    cfg = load_config("configs/quickstart.yaml", [f"logging.run_name={text}", f"train.resume={text}"])
    assert cfg.logging.run_name == cfg.train.resume == want
    if text == "off":  # no checkpoint is looked for (on the session's shards: a fresh clone has no data/)
        data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
        check_training_inputs(load_config("configs/quickstart.yaml", [*data, "eval.at_end=false", "train.resume=off"]))


def test_print_config_is_the_resolved_tree_and_reads_back_as_it(tmp_path, capsys):
    """``--print-config`` (there was no way to see every key's value short of training a run): the YAML printed
    is the tree load_config resolves, every default in it, and fed back as --config it resolves the same."""
    from megahash.pretrain import main

    args = ["--config", "configs/quickstart.yaml", "train.steps=4", "model={num_layers: 3}"]
    assert main(["--print-config", *args]) == 0
    printed = capsys.readouterr().out
    want = load_config("configs/quickstart.yaml", ["train.steps=4", "model.num_layers=3"]).to_dict()
    assert yaml.safe_load(printed) == want and printed == yaml.safe_dump(want, sort_keys=False)
    (tmp_path / "printed.yaml").write_text(printed)
    assert load_config(tmp_path / "printed.yaml").to_dict() == want


@pytest.mark.parametrize(
    "override", ["data.prefix=[a,b", "eval.tasks=[arc_easy, hellaswag", "train={steps: 3, steps: 5}"]
)
def test_an_override_value_is_read_as_strictly_as_a_config_file(tmp_path, override):
    """Before: a list left open fell back to its text, split at commas into '[a' and 'b' (two shard prefixes);
    a key twice in a mapping override kept the last. Now each is one line, as the same value in a file is."""
    key, value = override.split("=", 1)
    path = tmp_path / "c.yaml"
    path.write_text(f"{key}: {value}\n")
    with pytest.raises((yaml.YAMLError, ConfigError)):  # the independent fact: PyYAML / the file reader refuses it
        load_config(path) if "steps" in value else yaml.safe_load(value)
    with pytest.raises(ConfigError, match=rf"^override {re.escape(repr(override))} is not valid YAML|written twice"):
        load_config("configs/quickstart.yaml", [override])


def test_a_list_element_override_says_the_list_is_set_whole():
    """Before: 'override 'data.prefix.0=foo': 'prefix' is not a section' (what is it, then?)."""
    assert isinstance(load_config("configs/quickstart.yaml").data.prefix, list)
    with pytest.raises(ConfigError, match=r"'data.prefix' is a list, set as a whole: data.prefix=\[A, B\]$"):
        load_config("configs/quickstart.yaml", ["data.prefix.0=foo"])


def test_a_size_override_beats_the_yamls_model_keys(tmp_path):
    """Before: ``--config configs/quickstart.yaml model.size=500m`` resolved to the quickstart's tiny model (its
    YAML model keys beat the size the command line named; `megahash params` counted 7.5M parameters). Now the
    override merges the size over the YAML's model keys, under the other overrides; a YAML's own size: stays
    under the keys it gives."""
    size = yaml.safe_load(open("configs/model/160m.yaml"))["model"]  # the independent fact: the size file
    m = load_config("configs/quickstart.yaml", ["model.size=160m", "model.num_layers=3"]).model
    assert [getattr(m, k) for k in ("hidden_size", "ffn_hidden_size", "num_heads", "max_position_embeddings")] == [
        size[k] for k in ("hidden_size", "ffn_hidden_size", "num_heads", "max_position_embeddings")
    ]
    assert m.num_layers == 3 and load_config(None, ["model={size: 160m}"]).model.num_layers == size["num_layers"]
    (tmp_path / "c.yaml").write_text("model:\n  size: 160m\n  num_layers: 3\n")
    m = load_config(tmp_path / "c.yaml").model
    assert (m.hidden_size, m.num_layers) == (size["hidden_size"], 3)


@pytest.mark.parametrize("text", ["12:30", "0123", "0.10", "1_000"])
def test_a_text_key_keeps_the_override_as_typed(text):
    """PyYAML (YAML 1.1) reads each as a number (12:30 sexagesimal = 750, 0123 octal = 83, 0.10 = 0.1); a text
    key given it on the command line keeps what was typed. Before: logging.run_name=12:30 was '750',
    train.save_dir=0123 wrote the run to '83'."""
    assert not isinstance(yaml.safe_load(text), str) and str(yaml.safe_load(text)) != text  # the independent fact
    cfg = load_config("configs/quickstart.yaml", [f"logging.run_name={text}", f"train.save_dir={text}"])
    assert cfg.logging.run_name == cfg.train.save_dir == text


def test_a_leading_zero_integer_override_is_decimal():
    """train.steps=010 was YAML 1.1's octal 8; now 10, as YAML 1.2 and Megatron's argparse (int('010', 10))."""
    assert yaml.safe_load("010") == 8  # PyYAML's reading, refused here
    cfg = load_config("configs/quickstart.yaml", ["train.steps=010", "data.seed=0042", "train.steps=0x10"])
    assert (cfg.train.steps, cfg.data.seed) == (16, int("0042", 10))  # the later 0x10 (hexadecimal) wins
    assert load_config("configs/quickstart.yaml", ["train.steps=010"]).train.steps == int("010", 10)


def test_a_text_override_keeps_a_hash_sign():
    """A shell word has no YAML comment: train.save_dir='runs/exp #2' was 'runs/exp' (PyYAML drops ' #...')."""
    assert yaml.safe_load("runs/exp #2") == "runs/exp"  # PyYAML's reading of the same text
    assert load_config("configs/quickstart.yaml", ["train.save_dir=runs/exp #2"]).train.save_dir == "runs/exp #2"


def test_wandb_mode_is_one_of_wandbs_own_modes():
    """Before: logging.wandb_mode was free text (logging.wandb_mode=offlne, or =off: 'False') and failed in
    wandb.init, after the model was built. Now its choices are wandb's Settings.mode, checked at load."""
    import typing

    from megahash.config import LoggingConfig

    wandb_settings = pytest.importorskip("wandb.sdk.wandb_settings")
    theirs = typing.get_args(wandb_settings.Settings.model_fields["mode"].annotation)
    assert set(typing.get_args(typing.get_type_hints(LoggingConfig)["wandb_mode"])) == set(theirs)
    with pytest.raises(ConfigError, match=r"'logging.wandb_mode' must be .* got 'offlne' \(did you mean 'offline'\?\)"):
        load_config(None, ["logging.wandb_mode=offlne"])
