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


@pytest.mark.parametrize("host, name, features, host_avx2, want", [
    ("znver4", None, None, True, True),                           # host target with AVX2: permutes
    ("znver4", None, None, False, False),                         # no AVX2: the byte table
    ("znver1", None, None, True, False),                          # Zen 1: slow lane-crossing permutes
    ("znver1", "haswell", "+64bit,+avx,+avx2,+fma", True, False),  # the host's cores, whatever the target
    ("znver4", "haswell", "+64bit,+avx,+avx2,+fma,+bmi2", True, True),  # the AVX2 environment of numba_kv.info
    ("skylake", "x86-64", "+64bit,+sse2", True, False),
    ("znver4", "haswell", None, True, False),                     # named without features: the table
])
def test_codegen_permutes_fast_reads_host_and_target(monkeypatch, host, name, features, host_avx2, want):
    """4-bit codes decode through permutes only where the code has AVX2 and the host's cores run
    lane-crossing permutes fast (not AMD Zen 1)."""
    monkeypatch.setattr(jit_module.numba_config, "CPU_NAME", name)
    monkeypatch.setattr(jit_module.numba_config, "CPU_FEATURES", features)
    monkeypatch.setattr(jit_module.llvm_binding, "get_host_cpu_name", lambda: host)
    monkeypatch.setattr(jit_module.llvm_binding, "get_host_cpu_features", lambda: {"avx2": host_avx2})
    assert jit_module.codegen_permutes_fast() is want


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


def _product(a, b):
    return a * b


def test_twin_device_override():
    """``twin(device=...)`` keeps the given device function (a libdevice intrinsic) as the
    device variant, compiles the CPU variant from the core, and registers both for rebinding."""
    from numba import cuda

    dev = cuda.jit(device=True)(_product)
    cpu, got = jit_module.twin(_product, inline=True, device=dev)
    assert got is dev and jit_module.CORES[_product] == (cpu, dev)
    assert cpu(3.0, 4.0) == 12.0


def test_mul_rn_rounds_the_product_alone():
    """The CPU variant of ``ops._exact.mul_rn`` is the float32 product rounded once: summed
    afterwards it gives the twice-rounded result, not the FMA one."""
    import numpy as np
    from numba import njit

    from numba_kv.ops._exact import mul_rn_cpu

    @njit
    def acc(a, b, c):
        return c + mul_rn_cpu(a, b)

    a = np.float32(1 + 2.0 ** -12)
    c = np.float32(-(1 + 2.0 ** -11))
    # a² = 1 + 2^-11 + 2^-24 rounds to 1 + 2^-11 in float32, so the sum is exactly 0;
    # an FMA would keep the 2^-24 term
    assert acc(a, a, c) == np.float32(0.0)
    assert np.float64(a) * np.float64(a) + np.float64(c) == 2.0 ** -24


#: device functions inlined at the Numba IR level, with the reason (everything else NVVM inlines:
#: ``_jit.cuda_device``)
IR_INLINED = {
    "_flat_plane_dev": "returns a view of an argument array (a cache plane)",
    "_paged_plane_dev": "as _flat_plane_dev",
    "_gpu_primitives.<locals>.shfl_idx": "a one-line shuffle wrapper in the tensor-core hot loop",
    "_gpu_primitives.<locals>.shfl_f32": "as shfl_idx",
    "_gpu_primitives.<locals>.shfl_u32": "as shfl_idx",
}


def _device_functions() -> dict:
    """Every CUDA device function of ``numba_kv.ops``: module globals and the device side of
    every registered core, by qualified name."""
    import importlib
    import pkgutil

    from numba.cuda.dispatcher import CUDADispatcher

    import numba_kv.ops as ops

    found = {}
    for info in pkgutil.walk_packages(ops.__path__, "numba_kv.ops."):
        for value in vars(importlib.import_module(info.name)).values():
            if isinstance(value, CUDADispatcher) and value.targetoptions.get("device"):
                found[value.py_func.__qualname__] = value
    for _, dev in jit_module.CORES.values():
        if isinstance(dev, CUDADispatcher) and dev.py_func.__module__.startswith("numba_kv."):
            found[dev.py_func.__qualname__] = dev
    return found


def test_device_functions_are_inlined_by_nvvm():
    """Numba's IR inliner deep-copies a callee's IR per call site and nesting level: a kernel
    built from IR-inlined cores spent most of its compile there (the PTX test job took 20
    minutes, 6 with NVVM inlining).  Only the listed one-liners may be IR-inlined; the
    device side of a core and every CUDA-only helper carry ``forceinline``."""
    from numba_kv import _backend

    if _backend.simulator_enabled():
        pytest.skip("the simulator's jit takes no forceinline")
    found = _device_functions()
    assert len(found) > 100  # the walk reached the kernels' helpers
    ir_inlined = {name for name, f in found.items() if f.targetoptions.get("inline") == "always"}
    assert ir_inlined == set(IR_INLINED)
    core_devices = {name for name, f in found.items() if any(f is dev for _, dev in jit_module.CORES.values())}
    assert len(core_devices) > 50
    not_forced = {name for name in core_devices - ir_inlined if not found[name].targetoptions.get("forceinline")}
    assert not not_forced, f"device cores NVVM may leave as calls: {sorted(not_forced)}"


def test_a_view_returning_core_is_ir_inlined():
    """``twin(returns_view=True)``: a CUDA device function cannot return a view of its argument,
    so that core's device side is inlined by Numba; every other core's by NVVM."""
    def _row_of(a, i):
        return a[i]

    _, dev = jit_module.twin(_row_of, inline=True, returns_view=True)
    _, plain = jit_module.twin(_product, inline=True)
    assert dev.targetoptions.get("inline") == "always" and not dev.targetoptions.get("forceinline")
    assert plain.targetoptions.get("forceinline") is True and plain.targetoptions.get("inline") != "always"
