"""The one cache-name grammar (``numba_kv.caches.spec``): ``make_cache``, the evaluation command
line and the compression-mode benchmark read cache names through it."""

import pytest

from numba_kv import make_cache
from numba_kv.caches.spec import CacheSpec, parse_cache_spec


@pytest.mark.parametrize("text, name, options", [
    ("pqo3", "pqo3", {}),
    (" PQO3-L2 ", "pqo3-l2", {}),
    ("pqo3-r32-s4", "pqo3", {"residual_length": 32, "sink_tokens": 4}),
    ("tq-k4v3-head-eden-s0", "tq-k4v3-head-eden", {"sink_tokens": 0}),
    ("pqo3:key_center=true", "pqo3", {"key_center": True}),
    ("pqo4:r=8,window_dtype=int8,x=1.5", "pqo4", {"residual_length": 8, "window_dtype": "int8", "x": 1.5}),
    ("dense:dtype=float16", "dense", {"dtype": "float16"}),
])
def test_parse_cache_spec(text, name, options):
    assert parse_cache_spec(text) == CacheSpec(name, options)


@pytest.mark.parametrize("text, fragment", [
    ("pqo5", "unknown cache 'pqo5'"),
    ("pqo3:r", "malformed option"),
    ("pqo3:r=1,r=2", "given twice"),
    ("pqo3-r8:r=8", "given twice"),
])
def test_parse_cache_spec_errors(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_cache_spec(text)


def test_defaults_apply_to_compressed_caches_only():
    assert parse_cache_spec("pqo3:r=8", {"residual_length": 0, "sink_tokens": 0}).options == \
        {"residual_length": 8, "sink_tokens": 0}
    assert parse_cache_spec("dense", {"residual_length": 0}).options == {}


def test_make_cache_reads_the_full_grammar():
    """A cache's own ``name`` and the compact / option forms build the same cache."""
    geom = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64}
    c = make_cache("pqo3-r0-s0:key_center=true", **geom)
    assert (c.residual_length, c.sink_tokens, c.key_center) == (0, 0, True)
    ref = make_cache("tq3-l2", **geom, residual_length=16, sink_tokens=2)
    assert make_cache(ref.name, **geom).name == ref.name
    with pytest.raises(ValueError, match="residual_length: 3 conflicts with the name"):
        make_cache("pqo3-r0", **geom, residual_length=3)
    with pytest.raises(ValueError, match="^name: unknown cache"):
        make_cache("pqo9", **geom)


@pytest.mark.parametrize("spec", ["pqo-k5v5-head", "tq-k5v5-head", "pq-k5v5-head", "pqo-k5v4-head-eden",
                                  "pqo-k4v4-head", "pqo-k2v2", "tq-k3v3-l2", "pqo3.5", "pqo2.5"])
def test_a_cache_name_builds_the_same_cache(spec):
    """``make_cache(cache.name)`` is the same cache for every width pair (5-bit codes on both
    sides were named ``pqo5-head``, which the grammar has no uniform form for)."""
    geom = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 64}
    c = make_cache(spec, **geom)
    back = make_cache(c.name, **geom)
    assert back.name == c.name and back.config == c.config


def test_override_files(tmp_path):
    """``head_overrides=@FILE`` / ``layer_overrides=@FILE``: JSON's string keys read as ints, the
    same cache as the argument form, the label names the file, and every misuse names the option."""
    import json

    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"1": {"0": {"k_bits": 4}, "-1": {"v_bits": 4}}}))
    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps({"-1": {"bits": 4}}))
    spec = parse_cache_spec(f"pqo3-head:head_overrides=@{heads},layer_overrides=@{layers}")
    assert spec.options["head_overrides"] == {1: {0: {"k_bits": 4}, -1: {"v_bits": 4}}}
    assert spec.options["layer_overrides"] == {-1: {"bits": 4}}
    assert f"head_overrides=@{heads}" in spec.label
    import copy
    import dataclasses
    import pickle

    for clone in (copy.deepcopy(spec), pickle.loads(pickle.dumps(spec))):
        assert clone == spec and str(clone.options["head_overrides"]) == f"@{heads}"
    assert dataclasses.asdict(spec)["options"]["head_overrides"] == spec.options["head_overrides"]
    geom = {"num_layers": 3, "num_kv_heads": 3, "head_dim": 64}
    from_file = make_cache(spec.name, **geom, **spec.options)
    direct = make_cache("pqo3-head", **geom, head_overrides={1: {0: {"k_bits": 4}, 2: {"v_bits": 4}}},
                        layer_overrides={2: {"bits": 4}})
    assert from_file.config_dict() == direct.config_dict()
    # the whole text through make_cache, and through a preset
    assert make_cache(f"pqo3-head:head_overrides=@{heads},layer_overrides=@{layers}",
                      **geom).config_dict() == direct.config_dict()
    kv4 = make_cache(f"kv4:head_overrides=@{heads}", **geom)
    # kv4 is k4v3: head 0's 4-bit keys change nothing, head 2's 4-bit values split it off
    assert [((p.k_bits, p.v_bits), h) for p, _, h in kv4.layer_pieces(1)] == [((4, 3), (0, 1)), ((4, 4), (2,))]
    with pytest.raises(ValueError, match="head_overrides: given twice"):
        make_cache(f"pqo3-head:head_overrides=@{heads}", **geom, head_overrides={0: {0: {"bits": 4}}})
    with pytest.raises(ValueError, match="head_overrides: expected @FILE"):
        parse_cache_spec("pqo3:head_overrides=3")
    with pytest.raises(ValueError, match="layer_overrides: cannot read the JSON file"):
        parse_cache_spec(f"pqo3:layer_overrides=@{tmp_path / 'missing.json'}")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"x": {"bits": 4}}))
    with pytest.raises(ValueError, match="keys must be integers"):
        parse_cache_spec(f"pqo3:layer_overrides=@{bad}")
    bad.write_text(json.dumps({"0": 4}))
    with pytest.raises(ValueError, match=r"head_overrides .*expected a JSON object"):
        parse_cache_spec(f"pqo3:head_overrides=@{bad}")


def test_override_files_on_the_command_line(tmp_path):
    """The command line's cache list keeps ``@FILE`` maps for the model's geometry (its tiny-geometry
    check of names and options skips them) and labels the cache with the file."""
    import json

    from numba_kv.toolkit.specs import parse_cache_specs

    heads = tmp_path / "h.json"
    heads.write_text(json.dumps({"5": {"2": {"k_bits": 4}}}))
    dense, cache = parse_cache_specs(f"dense,pqo3-head-r8:head_overrides=@{heads},key_center=true")
    assert str(cache.options["head_overrides"]) == f"@{heads}" and repr(cache.options["head_overrides"]) == f"@{heads}"
    assert cache.label == f"pqo3-head-r8-s4:head_overrides=@{heads},key_center=True"
    built = cache.make(num_layers=6, num_kv_heads=3, head_dim=64)
    assert [(p.k_bits, h) for p, _, h in built.layer_pieces(5)] == [(3, (0, 1)), (4, (2,))]
    with pytest.raises(ValueError, match="head_overrides"):  # the real geometry checks the map
        cache.make(num_layers=6, num_kv_heads=2, head_dim=64)


def test_shipped_calibrations_by_name(tmp_path, monkeypatch):
    """``@NAME`` without a directory or ``.json`` reads the allocation shipped in the package; a
    file of that name in the working directory wins; an unknown name lists the shipped ones."""
    import json
    from pathlib import Path

    import numba_kv
    from numba_kv.caches.spec import load_overrides, shipped_calibrations

    root = Path(numba_kv.__file__).parent / "caches" / "calibrations"
    names = shipped_calibrations()
    assert {"kv3-smollm2-135m", "kv3-smollm2-135m-retrieval"} <= set(names)
    monkeypatch.chdir(tmp_path)
    for name in names:  # each parses as per-KV-head widths with the file's contents, labelled by name
        got = load_overrides("head_overrides", name)
        raw = json.loads((root / f"{name}.json").read_text())
        assert got == {int(li): {int(h): o for h, o in hs.items()} for li, hs in raw.items()} and str(got) == f"@{name}"
    spec = parse_cache_spec("kv3:head_overrides=@kv3-smollm2-135m-retrieval")
    # SmolLM2's five strongest retrieval heads (benchmarks/results/*round6-retrieval-scores*) have 5-bit keys
    heads = spec.options["head_overrides"]
    assert all(heads[li][h]["k_bits"] == 5 for li, h in ((18, 2), (21, 2), (23, 0), (17, 1), (23, 2)))
    assert spec.label == "kv3:head_overrides=@kv3-smollm2-135m-retrieval"
    (tmp_path / "kv3-smollm2-135m").write_text(json.dumps({"1": {"0": {"k_bits": 3}}}))  # a local file wins
    assert load_overrides("head_overrides", "kv3-smollm2-135m") == {1: {0: {"k_bits": 3}}}
    with pytest.raises(ValueError, match=r"head_overrides: cannot read .*'no-such-model'.*kv3-smollm2-135m-retrieval"):
        load_overrides("head_overrides", "no-such-model")


_BAD_LAYER_OVERRIDES = [
    {0: {"bits": 4}, -4: {"bits": 2}}, [{"bits": 4}], {0: 4}, {4: {}}, {"0": {}}, {0: {"bitz": 4}},
]
_BAD_HEAD_OVERRIDES = [
    {0: {0: {"bits": 4}}, -4: {0: {"bits": 2}}}, {0: {0: {"bits": 4}, -3: {"bits": 2}}}, [1], {0: 4},
    {0: {0: 4}}, {0: {3: {}}}, {0: {0: {"sink_tokens": 2}}},
]


@pytest.mark.parametrize("preset", ["kv3", "kv4", "kv5"])
@pytest.mark.parametrize("key, bad", [("layer_overrides", b) for b in _BAD_LAYER_OVERRIDES]
                         + [("head_overrides", b) for b in _BAD_HEAD_OVERRIDES])
def test_a_preset_checks_the_callers_overrides_as_its_base_name_does(preset, key, bad):
    """A preset merges the caller's ``layer_overrides`` / ``head_overrides`` into its own only
    once they passed the checks of a plain name: the same error, naming the same layer (a layer
    given twice was merged, last one winning; a list or a bare value crashed inside)."""
    from numba_kv.caches.presets import PRESETS

    geom = {"num_layers": 4, "num_kv_heads": 3, "head_dim": 64}
    with pytest.raises((TypeError, ValueError)) as plain:
        make_cache(PRESETS[preset].base, **geom, **{key: bad})
    with pytest.raises(plain.type) as got:
        make_cache(preset, **geom, **{key: bad})
    assert str(got.value) == str(plain.value) and key in str(got.value)


def test_a_preset_still_merges_the_callers_layer_overrides():
    geom = {"num_layers": 4, "num_kv_heads": 3, "head_dim": 64}
    cache = make_cache("kv4", **geom, layer_overrides={-1: {"bits": 4}, 1: {"v_bits": 4}})
    assert [(cache.layer_cache(i).k_bits, cache.layer_cache(i).v_bits) for i in range(4)] == \
        [(4, 3), (4, 4), (4, 3), (4, 4)]


def test_unknown_name_lists_every_asymmetric_family():
    """``pq-k4v3`` is a name the parser takes (``windows`` guide); the message left it out."""
    for family in ("pq", "pqo", "tq"):
        assert make_cache(f"{family}-k4v3", num_layers=1, num_kv_heads=1, head_dim=64).name.startswith(f"{family}-k4v3")
    with pytest.raises(ValueError) as e:
        make_cache("pqx-k4v3", num_layers=1, num_kv_heads=1, head_dim=64)
    for family in ("pq", "pqo", "tq"):
        assert f"'{family}-k<2-5>v<2-5>'" in str(e.value)


@pytest.mark.parametrize("base", ["pq3", "pqo2", "pqo3.5", "tq4", "pqo-k4v3", "tq-k5v4-head", "pqo3-head-n8",
                                  "pq-k2v3-l2-eden", "pqo-k4v2-head-vq"])
@pytest.mark.parametrize("window", ["", "-r0-s0", "-r0-s4", "-r8-s0", "-r0-g10-s0", "-r16-g25-s2"])
def test_a_cache_name_builds_its_own_cache_again(base, window):
    """``cache.name`` is a name ``make_cache`` reads back to the same configuration.  A cache
    without a window was named without its ``-r0-s0``, which reads back as the default
    32 + 4 window."""
    geom = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 128}
    cache = make_cache(base + window, **geom)
    again = make_cache(cache.name, **geom)
    assert again.config == cache.config and again.name == cache.name
    if window == "-r0-s0":
        assert cache.name.endswith("-r0-s0") and not cache.config.windowed
