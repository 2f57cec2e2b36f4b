"""Config tree: YAML + dotted overrides, typed, one-line errors naming the key and the closest one."""
import pytest

from megahash.config import load_config
from megahash.errors import ConfigError


def test_yaml_include_and_overrides():
    cfg = load_config("configs/quickstart.yaml", ["train.steps=7", "model.num_layers=3", "parallel.tensor=2"])
    assert cfg.model.hidden_size == 128  # from the included model/tiny.yaml
    assert cfg.train.steps == 7 and cfg.model.num_layers == 3 and cfg.parallel.tensor == 2
    assert cfg.data.prefix == ["data/shakespeare/shakespeare"]


def test_model_size_table_4_10():
    for size, (h, ffn, layers, heads) in {"70m": (512, 2048, 6, 8), "160m": (768, 3072, 12, 12),
                                           "500m": (896, 4864, 24, 14), "1.7b": (2048, 6144, 28, 16)}.items():
        m = load_config(f"configs/model/{size}.yaml").model
        assert (m.hidden_size, m.ffn_hidden_size, m.num_layers, m.num_heads) == (h, ffn, layers, heads)
    assert load_config(None, ["model.size=160m"]).model.hidden_size == 768


@pytest.mark.parametrize("override, expect", [
    ("train.stpes=3", "did you mean 'steps'"),
    ("modle.hidden_size=3", "did you mean 'model'"),
    ("train.steps=many", "must be an integer"),
    ("parallel.sequence=maybe", "true/false"),
    ("parallel.tensor=3", "does not divide model.num_heads"),
    ("data.seq_length=4096", "exceeds model.max_position_embeddings"),
    ("model.size=13b", "unknown model size"),
    ("parallel.sequence=true", "needs parallel.tensor >= 2"),
])
def test_config_errors_name_the_key(override, expect):
    with pytest.raises(ConfigError) as e:
        load_config("configs/quickstart.yaml", [override])
    msg = str(e.value)
    assert expect in msg and "\n" not in msg
