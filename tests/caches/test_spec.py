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
