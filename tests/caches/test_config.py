"""PolarQuantConfig / TurboQuantConfig: one message per validation rule, resolution,
immutability, and the caches built from them."""

import copy
import dataclasses
import re
import typing

import numpy as np
import pytest

from numba_kv import PolarQuantCache, TurboQuantCache, make_cache
from numba_kv.caches.config import PolarQuantConfig, TurboQuantConfig

GEOM = (2, 2, 128)

# (overrides of PolarQuantConfig(2, 2, 128), exception, full message)
PQ_RULES = [
    (dict(num_layers=0), ValueError, "num_layers: expected an int >= 1, got 0"),
    (dict(num_layers="2"), TypeError, "num_layers: expected an int, got str '2'"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads: expected an int >= 1, got 0"),
    (dict(head_dim=0), ValueError, "head_dim: expected an int >= 1, got 0"),
    (dict(head_dim=48), ValueError, "head_dim: expected a positive multiple of 32 (the rotation block), got 48"),
    (dict(sliding_window=1), ValueError, "sliding_window: expected an int >= 2, got 1"),
    (dict(sliding_window=[8]), ValueError,
     "sliding_window: expected 2 per-layer entries (int or None), got 1"),
    (dict(sliding_window={5: 8}), ValueError,
     "sliding_window: layer 5 is out of range for 2 layers (expected -2 .. 1)"),
    (dict(bits=5), ValueError, "bits: 5-bit codebooks need rotation='head' (the 32-block codes stop at 4 bits), "
                               "got rotation='block'"),
    (dict(bits=6), ValueError, "bits: expected one of [2, 3, 4, 5], got 6"),
    (dict(bits=3.0), TypeError, "bits: expected an int, got float 3.0"),
    (dict(k_bits=1), ValueError, "k_bits: expected one of [2, 3, 4, 5], got 1"),
    (dict(v_bits=6), ValueError, "v_bits: expected one of [2, 3, 4, 5], got 6"),
    (dict(v_bits=5), ValueError, "v_bits: 5-bit codebooks need rotation='head' (the 32-block codes stop at 4 bits), "
                                 "got rotation='block'"),
    (dict(mode="tq"), ValueError, "mode: expected one of ['pq', 'pqo'], got 'tq'"),
    (dict(rotation="full"), ValueError, "rotation: expected one of ['block', 'head'], got 'full'"),
    (dict(norm_mode="abs"), ValueError, "norm_mode: expected one of ['maxnorm', 'l2'], got 'abs'"),
    (dict(rotation="head", norm_mode="maxnorm"), ValueError,
     "norm_mode: rotation='head' stores one L2 norm per vector, expected 'l2', got 'maxnorm'"),
    (dict(head_dim=96, rotation="head"), ValueError,
     "head_dim: rotation='head' needs a power of two <= 512, got 96"),
    (dict(head_dim=1024, rotation="head"), ValueError,
     "head_dim: rotation='head' needs a power of two <= 512, got 1024"),
    (dict(decode_output="sdpa"), ValueError, "decode_output: expected one of ['fused', 'dequantized'], got 'sdpa'"),
    (dict(window_dtype="bfloat16"), ValueError,
     "window_dtype: expected one of ['float16', 'float32', 'int8'], got 'bfloat16'"),
    (dict(residual_length=-1), ValueError, "residual_length: expected an int >= 0, got -1"),
    (dict(sink_tokens=-2), ValueError, "sink_tokens: expected an int >= 0, got -2"),
    (dict(key_center=1), TypeError, "key_center: expected a bool, got int 1"),
    (dict(unbiased="yes"), TypeError, "unbiased: expected a bool, got str 'yes'"),
    (dict(window_rotation="no"), TypeError, "window_rotation: expected a bool, got str 'no'"),
    (dict(outlier_channels=-32), ValueError, "outlier_channels: expected an int >= 0, got -32"),
    (dict(outlier_channels=48), ValueError,
     "outlier_channels: expected a multiple of 32 below head_dim=128 (whole rotation blocks, some left for the "
     "rest), got 48"),
    (dict(outlier_channels=128), ValueError,
     "outlier_channels: expected a multiple of 32 below head_dim=128 (whole rotation blocks, some left for the "
     "rest), got 128"),
    (dict(outlier_channels=32, rotation="head"), ValueError,
     "outlier_channels: channel splits need rotation='block', got rotation='head'"),
    (dict(outlier_bits=4), ValueError, "outlier_bits: expected None without outlier_channels (outlier_channels=0), "
     "got 4"),
    (dict(outlier_channels=32, outlier_bits=3), ValueError,
     "outlier_bits: expected more bits than the k channels' 3 and at most 4, got 3"),
    (dict(outlier_channels=32, k_bits=4), ValueError,
     "outlier_bits: expected more bits than the k channels' 4 and at most 4, got 5"),
    (dict(outlier_channels=32, outlier_bits=5), ValueError, "outlier_bits: expected one of [2, 3, 4], got 5"),
]

TQ_RULES = [
    (dict(mode="pqo"), ValueError, "mode: TurboQuantCache is mode 'tq', got 'pqo'"),
    (dict(outlier_channels=32), ValueError,
     "outlier_channels: expected 0 (channel splits are not supported by TurboQuantCache), got 32"),
    (dict(vq=True, rotation="head"), ValueError,
     "vq: expected False (the head VQ code is not supported by TurboQuantCache; PolarQuant caches only), got True"),
    (dict(qjl_seed=-1), ValueError, "qjl_seed: expected a non-negative int, got -1"),
    (dict(qjl_seed=True), TypeError, "qjl_seed: expected a non-negative int, got bool True"),
    (dict(qjl_seed="1"), TypeError, "qjl_seed: expected a non-negative int, got str '1'"),
    (dict(qjl_dim=8.0), TypeError, "qjl_dim: expected a positive multiple of 8, got float 8.0"),
    (dict(qjl_dim=12), ValueError,
     "qjl_dim: expected a positive multiple of 8 (sketch rows m, packed 8 signs per byte), got 12"),
    (dict(qjl_dim=0), ValueError,
     "qjl_dim: expected a positive multiple of 8 (sketch rows m, packed 8 signs per byte), got 0"),
    (dict(bits=1), ValueError, "bits: expected one of [2, 3, 4, 5], got 1"),
]


def test_five_bit_sides_are_head_codes_counted_by_formula():
    # 5-bit indices with the whole-head rotation: d·5/8 bytes and one binary16 norm per vector
    cfg = PolarQuantConfig(1, 2, 256, k_bits=5, v_bits=4, rotation="head")
    assert cfg.slot_bits == {"k": 5, "v": 4}
    assert (cfg.vector_bytes("k"), cfg.vector_bytes("v")) == (256 * 5 // 8 + 2, 256 * 4 // 8 + 2)
    # mode "pq" drops a bit: a 5-bit setting is a 4-bit codebook, which the block rotation has
    assert PolarQuantConfig(1, 2, 64, k_bits=5, mode="pq").slot_bits == {"k": 4, "v": 2}
    # TurboQuant keys spend one bit on QJL: 5-bit keys are a 4-bit codebook; 5-bit values are not
    assert TurboQuantConfig(1, 2, 64, k_bits=5).slot_bits == {"k": 4, "v": 3}
    with pytest.raises(ValueError, match="^v_bits: 5-bit codebooks need rotation='head'"):
        TurboQuantConfig(1, 2, 64, k_bits=5, v_bits=5)


def _build(cls, overrides):
    geom = dict(zip(("num_layers", "num_kv_heads", "head_dim"), GEOM))
    geom.update(overrides)
    return cls(**geom)


@pytest.mark.parametrize("overrides, exc, message", PQ_RULES)
def test_every_polarquant_rule_names_its_argument(overrides, exc, message):
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        _build(PolarQuantConfig, overrides)
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):  # the cache says the same
        _build(PolarQuantCache, overrides)


@pytest.mark.parametrize("overrides, exc, message", TQ_RULES)
def test_every_turboquant_rule_names_its_argument(overrides, exc, message):
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        _build(TurboQuantConfig, overrides)
    with pytest.raises(exc, match="^" + re.escape(message) + "$"):
        _build(TurboQuantCache, overrides)


def test_optional_values_are_resolved_so_equal_caches_have_equal_configs():
    a = PolarQuantConfig(*GEOM, bits=3)
    b = PolarQuantConfig(*GEOM, bits=3, k_bits=3, v_bits=3, norm_mode="maxnorm", window_dtype=np.dtype("float16"))
    assert a == b and hash(a) == hash(b)
    assert (a.k_bits, a.v_bits, a.norm_mode, a.window_dtype, a.sliding_window) == (3, 3, "maxnorm", "float16", None)
    assert PolarQuantConfig(*GEOM, rotation="head").norm_mode == "l2"
    assert PolarQuantConfig(*GEOM, sliding_window={-1: 8}).sliding_window == (None, 8)
    assert PolarQuantConfig(*GEOM, sliding_window=[None, None]).sliding_window is None
    split = PolarQuantConfig(*GEOM, bits=2, outlier_channels=64)
    assert split.outlier_bits == 3 and split.outlier_widths == {"k": 3, "v": 3}
    # per-side widths that differ stay unresolved (one int cannot hold both)
    asym = PolarQuantConfig(*GEOM, k_bits=3, v_bits=2, outlier_channels=64)
    assert asym.outlier_bits is None and asym.outlier_widths == {"k": 4, "v": 3}
    tq = TurboQuantConfig(*GEOM)
    assert (tq.mode, tq.qjl_dim, tq.slot_bits) == ("tq", 128, {"k": 2, "v": 3})


def test_config_is_frozen():
    cfg = PolarQuantConfig(*GEOM)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bits = 4  # type: ignore[misc]


def test_cache_exposes_and_rebuilds_from_its_config():
    c = PolarQuantCache(*GEOM, bits=4, residual_length=8, window_dtype="int8", unbiased=True)
    assert isinstance(c.config, PolarQuantConfig)
    assert (c.bits, c.residual_length, c.unbiased, c.window_dtype) == (4, 8, True, np.dtype(np.int8))
    d = PolarQuantCache.from_config(c.config)
    assert d.config is c.config and d.name == c.name and d.bits_per_value == c.bits_per_value
    t = TurboQuantCache.from_config(TurboQuantConfig(*GEOM, qjl_dim=64))
    assert t.qjl_dim == 64 and t.sketch.shape == (64, 128)
    with pytest.raises(TypeError, match="config: expected a PolarQuantConfig, got TurboQuantConfig"):
        PolarQuantCache.from_config(TurboQuantConfig(*GEOM))
    with pytest.raises(TypeError, match="config: expected a TurboQuantConfig, got PolarQuantConfig"):
        TurboQuantCache.from_config(PolarQuantConfig(*GEOM))
    with pytest.raises(AttributeError):
        c.bits = 3  # the configuration is read-only through the cache too


def test_fork_and_factory_share_the_config():
    c = make_cache("pqo3-r8-s2", num_layers=2, num_kv_heads=2, head_dim=64, key_center=True)
    assert c.config == PolarQuantConfig(2, 2, 64, bits=3, residual_length=8, sink_tokens=2, key_center=True)
    assert copy.deepcopy(c).config is c.config and c.fork().config is c.config


def test_config_dict_rebuilds_the_same_config():
    for c in (PolarQuantCache(*GEOM, k_bits=3, v_bits=2, outlier_channels=64, sliding_window={0: 16}),
              TurboQuantCache(*GEOM, bits=4, qjl_seed=7, norm_mode="l2")):
        cfg = c.config_dict()
        assert type(c)(**cfg).config == c.config


def test_spec_config_is_what_make_builds():
    from numba_kv.caches.spec import make_cache as spec_make_cache
    from numba_kv.caches.spec import parse_cache_spec

    assert spec_make_cache is make_cache
    for text in ("pqo3-r16:key_center=true", "tq-k4v3-l2", "pqo2.5-s0", "pq4-head-eden"):
        spec = parse_cache_spec(text)
        assert spec.config(2, 2, 128) == spec.make(2, 2, 128).config
    assert isinstance(parse_cache_spec("tq3").config(1, 1, 64), TurboQuantConfig)
    with pytest.raises(ValueError, match="^name: the dense cache"):
        parse_cache_spec("dense").config(1, 1, 64)
    with pytest.raises(TypeError, match="residual_length"):
        parse_cache_spec("pqo3-r8").config(1, 1, 64, residual_length=4)


def test_split_with_different_side_widths_saves_and_loads(tmp_path, rng):
    """K and V outlier widths differ (k 3 -> 4, v 2 -> 3): the file must rebuild the same
    layouts (it used to store the K width for both sides)."""
    pytest.importorskip("safetensors")
    from numba_kv import load_cache

    c = PolarQuantCache(1, 1, 128, k_bits=3, v_bits=2, outlier_channels=64, residual_length=0, sink_tokens=0)
    k = rng.standard_normal((1, 1, 5, 128)).astype(np.float32)
    c.prefill(0, k, k)
    c.save(tmp_path / "s.safetensors")
    d = load_cache(tmp_path / "s.safetensors", expect=c)
    assert d.config == c.config and d.outlier_bits == {"k": 4, "v": 3}
    for a, b in zip(c.live_arrays(0), d.live_arrays(0)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("given, name", [(np.float16, "float16"), (np.float32, "float32"), (np.int8, "int8"),
                                         (np.dtype("int8"), "int8"), ("float32", "float32")])
def test_window_dtype_takes_numpy_types(given, name):
    """``np.float16`` was refused (``got "<class 'numpy.float16'>"``), though the cache reports
    the window dtype as a NumPy dtype and takes ``np.dtype("float16")``."""
    c = PolarQuantConfig(*GEOM, window_dtype=given)
    assert c.window_dtype == name and c == PolarQuantConfig(*GEOM, window_dtype=name)


@pytest.mark.parametrize("bad", [np.float64, "f2", 3, None])
def test_window_dtype_refuses_others_by_name(bad):
    with pytest.raises(ValueError, match=r"window_dtype: expected one of \['float16', 'float32', 'int8'\]"):
        PolarQuantConfig(*GEOM, window_dtype=bad)


def test_config_fields_are_typed_read_only_attributes():
    """``cache.bits`` is ``cache.config.bits``, and a type checker sees each field's type (the
    decorator that made them returned ``Any``: pyright then took both cache classes for ``Any``)."""
    for cls, cfg in ((PolarQuantCache, PolarQuantConfig(2, 2, 64, bits=3, k_bits=4, residual_length=8)),
                     (TurboQuantCache, TurboQuantConfig(2, 2, 64, bits=3, qjl_dim=32))):
        hints = typing.get_type_hints(cls)
        fields = [n for n in hints if n != "config" and isinstance(getattr(cls, n, None), property)]
        assert {"bits", "k_bits", "v_bits", "rotation", "residual_length", "norm_bits"} <= set(fields)
        assert hints["bits"] is int and hints["rotation"] is str and hints["residual_fraction"] is float
        cache = cls.from_config(cfg)
        for name in fields:
            assert getattr(cache, name) == getattr(cfg, name), name
            with pytest.raises(AttributeError):
                setattr(cache, name, getattr(cfg, name))
    assert {"qjl_seed", "qjl_dim"} <= set(typing.get_type_hints(TurboQuantCache))
    assert TurboQuantCache.from_config(TurboQuantConfig(1, 1, 64, bits=3)).qjl_dim == 64  # resolved


@pytest.mark.parametrize("name, option", [("pqo3", "bits"), ("tq3", "bits"), ("pqo3", "mode"), ("kv4", "bits")])
def test_an_option_the_name_sets_is_named(name, option):
    """``make_cache("pqo3", bits=4)`` said only "got multiple values for keyword argument". A
    preset is named as the caller wrote it, with its expansion beside it."""
    said = f"'{name}' \\(= 'pqo-k4v3-head-eden'\\)" if name == "kv4" else f"'{name}'"
    with pytest.raises(TypeError, match=rf"^{option}: set by the name {said}; spell it there"):
        make_cache(name, num_layers=2, num_kv_heads=1, head_dim=64, **{option: 4 if option == "bits" else "pq"})


@pytest.mark.parametrize("option", ["bits", "residual_length", "dtypes"])
def test_dense_names_its_options(option):
    with pytest.raises(TypeError, match=rf"^{option}: not an option of DenseCache; expected one of "
                                        r"\['dtype', 'sliding_window'\]"):
        make_cache("dense", num_layers=2, num_kv_heads=1, head_dim=64, **{option: 4})
    assert make_cache("dense", num_layers=2, num_kv_heads=1, head_dim=64, dtype=np.float16).bits_per_value == 16


def test_channel_splits_stop_where_the_int16_permutation_does():
    """The outlier channels' permutation is stored as int16: with head_dim 32,832 its
    indices past 32,767 wrapped and the split read the wrong channels (error 50 for 0.005)."""
    assert PolarQuantConfig(1, 1, 2 ** 15, bits=3, outlier_channels=32).outlier_channels == 32
    with pytest.raises(ValueError, match=r"outlier_channels: channel splits need head_dim <= 32768"):
        PolarQuantConfig(1, 1, 2 ** 15 + 32, bits=3, outlier_channels=32)
