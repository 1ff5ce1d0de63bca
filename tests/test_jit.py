"""``numba_kv._jit``: what the code-generation target offers (register blocks are chosen by it)."""

import pytest

import numba_kv._jit as jit_module


@pytest.mark.parametrize("name, features, host_avx512, want", [
    (None, None, True, True),                                   # host target: the host's flags
    (None, None, False, False),
    ("host", None, True, True),
    ("haswell", "+64bit,+avx,+avx2,+fma,+bmi2", True, False),  # the AVX2 environment of numba_kv.info
    ("skylake-avx512", "+avx2,+avx512f,+avx512vl", False, True),
    ("skylake-avx512", None, True, False),                      # named without features: the safe block
])
def test_codegen_has_avx512_reads_numba_target(monkeypatch, name, features, host_avx512, want):
    monkeypatch.setattr(jit_module.numba_config, "CPU_NAME", name)
    monkeypatch.setattr(jit_module.numba_config, "CPU_FEATURES", features)
    monkeypatch.setattr(jit_module.llvm_binding, "get_host_cpu_features", lambda: {"avx512f": host_avx512})
    assert jit_module.codegen_has_avx512() is want


def _add_one(x):
    return x + 1


def test_cpu_serial_inline_option():
    """``cpu_serial(inline=True)`` asks Numba to inline at the IR level (helpers called per block
    in hot loops); without it the helper stays a separate compiled function."""
    inlined = jit_module.cpu_serial(_add_one, inline=True)
    called = jit_module.cpu_serial(_add_one)
    assert inlined.targetoptions.get("inline") == "always"
    assert called.targetoptions.get("inline", "never") == "never"
    assert inlined(41) == called(41) == 42
