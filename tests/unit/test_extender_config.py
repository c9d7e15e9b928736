"""The extender's YAML: every field loads, and bad values are one ConfigError naming the file."""

from __future__ import annotations

import pytest

from cachefs.base.errors import ConfigError
from scheduler_hints.config import ExtenderConfig, load_extender_config


def test_defaults_without_a_file():
    assert load_extender_config(None) == ExtenderConfig()


def test_fields_load(tmp_path):
    f = tmp_path / "ext.yaml"
    f.write_text("weights:\n  packing: 1\n  packing_when_short: 3\n  topology_levels: [a, b]\n"
                 "locality_wait: 60\nlocality_slack: 0.1\nbind_timeout: 10\n")
    cfg = load_extender_config(str(f))
    assert (cfg.weights.packing, cfg.weights.packing_when_short, cfg.weights.topology_levels) == (1.0, 3.0, ("a", "b"))
    assert (cfg.locality_wait, cfg.locality_slack, cfg.bind_timeout) == (60.0, 0.1, 10.0)


def test_the_dra_section_loads(tmp_path):
    f = tmp_path / "ext.yaml"
    f.write_text("dra:\n  gpu_drivers: [gpu.nvidia.com, gpu.amd.com]\n  gpu_classes: [h200]\n"
                 "  topology_attributes: {gpu.amd.com/xgmiHive: amd.com/xgmi-hive}\n")
    cfg = load_extender_config(str(f))
    assert cfg.dra.gpu_drivers == ("gpu.nvidia.com", "gpu.amd.com") and cfg.dra.gpu_classes == ("h200",)
    assert cfg.dra.topology_attributes == {"gpu.amd.com/xgmiHive": "amd.com/xgmi-hive"}


@pytest.mark.parametrize(("text", "words"), [
    ("dra:\n  gpu_drivers: gpu.nvidia.com\n", "list of names"),
    ("dra:\n  topology_attributes: {cliqueId: clique}\n", "qualified"),
    ("dra:\n  devices: 8\n", "dra may set"),
    ("weights:\n  packing_when_short: -1\n", "must not be negative"),
    ("weights:\n  gravity: 1\n", "weights may set"),
    ("speed: 1\n", "unknown key"),
    ("locality_slack: 2\n", "fraction"),
    ("weights:\n  hole_fit_when_short: 1.5\n", "fraction"),
    ("weights:\n  hole_data_spread: -0.1\n", "fraction"),
    ("bind_timeout: 0\n", "positive"),
    ("locality_wait: soon\n", "soon"),
    ("[1, 2]\n", "expected a mapping"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_values_are_one_clear_error(tmp_path, text, words):
    f = tmp_path / "ext.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_extender_config(str(f))
    assert words in str(exc.value) and str(f) in str(exc.value)
