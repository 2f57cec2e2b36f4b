"""Every number of the config tree is validated at load (megahash/config_checks.py): one test per
number out of its range, run in-process through the pretrain entry point (exit 2, one line, nothing
written), the issue's examples once through a real process, and a guard that no numeric field of
the tree lacks a range."""

import sys

import pytest

from conftest import run
from megahash.config import Config
from megahash.config_checks import field_ranges, numeric_fields

RANGES = field_ranges(Config)  # every range the tree declares (its fields' metadata)


def _bad_value(key):
    low, high, low_open, high_open, _ = RANGES[key] if key in RANGES else RANGES_OPT[key]
    is_float = isinstance(low, float) or isinstance(high, float)
    if low is not None:
        return low if low_open else (low - (0.5 if is_float else 1))
    return high if high_open else high + 1


def test_every_numeric_field_has_a_range():
    fields = numeric_fields(Config)
    assert "train.steps" in fields and "model.embed.num_bits" in fields
    assert sorted(set(fields) - set(RANGES)) == []  # a new number needs its range (config_checks.ranged)
    assert sorted(set(RANGES) - set(fields)) == []


def _option_cases():
    """Every kind option with a declared range (its options class's RANGES): one value just outside."""
    from megahash import catalog

    out = []
    for group, section in (("attention", "model.attention.options."), ("embedding", "model.embed.options.")):
        for name, spec in sorted(catalog.option_specs(group).items()):
            if spec.range is not None:
                RANGES_OPT[section + name] = spec.range
                out.append((section + name, _bad_value(section + name)))
    return out


RANGES_OPT: dict = {}
CASES = (
    [(k, _bad_value(k)) for k in sorted(RANGES)]
    + _option_cases()
    + [
        ("train.global_batch_size", 6),
        ("train.min_lr", 1.0),
        ("data.split", "0,1,1"),
        ("data.split", "90,x"),
        ("model.norm_eps", "nan"),
        ("train.lr", "inf"),
    ]
)


@pytest.mark.parametrize("key, value", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_invalid_number_exit_2_one_line_nothing_written(tmp_path, capsys, key, value):
    from megahash.pretrain import main

    save = tmp_path / "run"
    status = main(["--config", "configs/quickstart.yaml", f"train.save_dir={save}", f"{key}={value}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith("error: ") and key.split(".")[-1] in err[0], err
    assert not save.exists() and list(tmp_path.iterdir()) == []


def test_issue_examples_in_a_real_process(tmp_path):
    """train.steps=-5 used to exit 0 having done nothing; data.seq_length=0 died of SIGFPE."""
    for ov, rng in (
        ("train.steps=-5", ">= 1"),
        ("data.seq_length=0", ">= 1"),
        ("model.num_heads=0", ">= 1"),
        ("train.lr=-0.1", "> 0.0"),
    ):
        r = run(
            [
                sys.executable,
                "megahash/pretrain.py",
                "--config",
                "configs/quickstart.yaml",
                f"train.save_dir={tmp_path / 'x'}",
                ov,
            ]
        )
        assert r.returncode == 2, (ov, r.returncode, r.stderr[-2000:])
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and ov.split("=")[0] in lines[0] and rng in lines[0], lines
    assert not (tmp_path / "x").exists()


def test_a_non_finite_value_is_named_as_such():
    """inf satisfies ">= 0" as a number: the line says a finite number is wanted (it said "must be >= 0.0,
    got inf")."""
    from megahash.config_checks import check_value, interval
    from megahash.errors import ConfigError

    rule = interval("[0, inf)", "dynamic evaluation's SGD step size", float)
    for value in (float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"must be a finite number >= 0\.0 .*got (inf|nan)"):
            check_value("eval.dynamic_lr", value, rule)
    with pytest.raises(ConfigError, match=r"must be >= 0\.0 \(") as e:
        check_value("eval.dynamic_lr", -1.0, rule)
    assert "finite" not in str(e.value)
