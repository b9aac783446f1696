"""Configuration: TOML + --set overrides, every mistake a one-line error naming the key."""
from __future__ import annotations

import pytest
from conftest import gem

from gemcore.config import Config, ConfigError, load_config


def test_defaults_are_valid_and_round_trip_through_toml(tmp_path):
    config = load_config()
    path = tmp_path / "c.toml"
    path.write_text(config.to_toml())
    assert load_config(path) == config


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nhidden = 32\nnum_heads = 4\n[attention]\nimpl = "gdpa"\n')
    config = load_config(path, ["model.hidden=48", "train.lr=0.5", "plugins.disable=a,b",
                                "run.name=abc"])
    assert (config.model.hidden, config.model.num_heads) == (48, 4)
    assert config.attention.impl == "gdpa" and config.train.lr == 0.5
    assert config.plugins.disable == ["a", "b"] and config.run.name == "abc"


def test_int_is_accepted_for_float():
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0


@pytest.mark.parametrize("override, needle", [
    ("model.hiden=3", "model.hiden"),
    ("modle.hidden=3", "modle"),
    ("model.hidden=3.5", "model.hidden"),
    ("model.hidden=true", "model.hidden"),
    ("train.lr=fast", "train.lr"),
    ("run.device=tpu", "run.device"),
    ("data.kind=zipf", "data.kind"),
    ("model.hidden=33", "model.num_heads"),
    ("data.batch_size=0", "data.batch_size"),
    ("plugins.disable=3", "plugins.disable"),
    ("nodot=3", "section.key"),
])
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")) as info:
        load_config(None, [override])
    assert "\n" not in str(info.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nhidden=")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
    bad.write_text("model = 3\n")
    with pytest.raises(ConfigError, match="model: expected a table"):
        load_config(bad)


@pytest.mark.parametrize("args, needle", [
    (["--set", "model.hiden=3"], "model.hiden"),
    (["--set", "attention.impl=nonexistent"], "attention.impl"),
    (["--set", "precision.impl=fp7"], "precision.impl"),
    (["--set", "data.sampler=nope"], "data.sampler"),
    (["--set", "parallelism.impl=nope"], "parallelism.impl"),
    (["--set", "comms.backend=nope"], "comms.backend"),
    (["--config", "does-not-exist.toml"], "does-not-exist.toml"),
])
def test_cli_config_errors_exit_2_in_one_line(args, needle, tmp_path, monkeypatch):
    result = gem(["train", "--quiet", "--max-steps", "1", *args], tmp_path, monkeypatch)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("gem train: error")]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_config_dataclass_validates_on_construction():
    with pytest.raises(ConfigError, match="moe_top_k"):
        load_config(None, ["model.moe_experts=2", "model.moe_top_k=3"])
    assert isinstance(Config(), Config)
