"""``numba_kv.toolkit.models.calibrations``: a preset gets the per-head widths shipped for the
model it runs on — on the command line (visible in the label) and through
``LlamaModel.new_cache`` — unless it names its own or the user asks for the plain preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from numba_kv.caches.mixed import MixedCache
from numba_kv.caches.polarquant import PolarQuantCache
from numba_kv.toolkit import cli
from numba_kv.toolkit.models import calibrations
from numba_kv.toolkit.models.calibrations import calibrated_options, calibrated_specs, model_key
from numba_kv.toolkit.specs import parse_cache_specs

SHIPPED = Path(calibrations.__file__).parents[2] / "caches" / "calibrations"


def test_the_table_names_shipped_files_of_known_models():
    """Every entry names a model short name, a preset and a calibration file the package ships."""
    from numba_kv.caches.presets import PRESETS
    from numba_kv.toolkit.models import MODEL_NAMES
    for key, table in calibrations.PRESET_CALIBRATIONS.items():
        assert key in MODEL_NAMES
        for preset, name in table.items():
            assert preset in PRESETS and (SHIPPED / f"{name}.json").is_file()


def test_a_preset_gets_the_models_calibration_only_when_it_names_none():
    want = json.loads((SHIPPED / "kv3-smollm2-135m-retrieval.json").read_text())
    got = calibrated_options("kv3", {"sink_tokens": 8}, "smollm2")
    assert got["sink_tokens"] == 8 and str(got["head_overrides"]) == "@kv3-smollm2-135m-retrieval"
    assert got["head_overrides"] == {int(i): {int(h): o for h, o in hs.items()} for i, hs in want.items()}
    assert calibrated_options("KV3", {}, "smollm2")["head_overrides"] == got["head_overrides"]  # any case
    own = {"head_overrides": {0: {0: {"k_bits": 5}}}}
    assert calibrated_options("kv3", own, "smollm2") == own  # the user's own wins
    for name, key in (("kv3", "gemma3-270m"), ("kv3", None), ("kv4", "smollm2"), ("pqo3", "smollm2")):
        assert calibrated_options(name, {}, key) == {}


def test_model_key_of_a_model_argument(tmp_path):
    assert model_key(None) == model_key("smollm2") == "smollm2"
    assert model_key("gemma3-270m") == "gemma3-270m"
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    assert model_key(other) is None and model_key(tmp_path / "missing.gguf") is None


def test_command_line_labels_show_the_calibration():
    args = cli.build_parser().parse_args(["eval", "--cache", "dense,kv3,kv4,kv3:sink_tokens=4"])
    assert [s.label for s in cli._specs(args)] == [
        "dense", "kv3:head_overrides=@kv3-smollm2-135m-retrieval", "kv4",
        "kv3:head_overrides=@kv3-smollm2-135m-retrieval,sink_tokens=4"]
    args = cli.build_parser().parse_args(["eval", "--cache", "kv3", "--no-calibration"])
    assert [s.label for s in cli._specs(args)] == ["kv3"]
    args = cli.build_parser().parse_args(["eval", "--cache", "kv3", "--model", "gemma3-270m"])
    assert [s.label for s in cli._specs(args)] == ["kv3"]
    own = parse_cache_specs("kv3:head_overrides=@kv3-smollm2-135m")
    assert [s.label for s in calibrated_specs(own, None)] == ["kv3:head_overrides=@kv3-smollm2-135m"]


def test_new_cache_on_smollm2_is_calibrated(smollm2):
    """SmolLM2's ``kv3`` has the shipped widths: layer 18's KV head 2, a retrieval head, keeps
    5-bit keys and 3-bit values, head 0 3-bit keys; ``calibrate=False`` is the plain preset
    (one configuration, 4-bit keys everywhere)."""
    model, _ = smollm2
    assert model.model_key == "smollm2"
    cache = model.new_cache("kv3")
    assert isinstance(cache, MixedCache)
    widths = {heads: (part.k_bits, part.v_bits) for part, _, heads in cache.layer_pieces(18)}
    assert widths[(2,)] == (5, 3) and widths[(0,)] == (3, 2)
    plain = model.new_cache("kv3", calibrate=False)
    assert isinstance(plain, PolarQuantCache) and (plain.k_bits, plain.v_bits) == (4, 2)
    assert plain.residual_length == cache.layer_pieces(18)[0][0].residual_length  # same mean: same window


def test_a_model_from_another_file_is_not_calibrated(tiny):
    model, _, _ = tiny
    assert model.model_key is None
    with pytest.raises(ValueError, match="head_overrides"):  # SmolLM2's widths would not even fit
        model.new_cache("kv3", head_overrides=calibrated_options("kv3", {}, "smollm2")["head_overrides"])
    assert isinstance(model.new_cache("kv3"), PolarQuantCache)
