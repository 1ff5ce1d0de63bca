"""The tensor-core decode kernel against its float32 CPU twin on the K, V and queries real models
write (issue 27: accuracy "on random and real-model KV").

The kernel has builds for ``head_dim`` 128 and 64.  With ``--rows native`` a model whose heads
have one of them runs its own heads (SmolLM2-135M's 64: the ``*_d64`` builds).  By default
(``--rows 128``), and for Gemma-3-270M's 256 always, each model's rows are made 128 wide from
its own post-RoPE tensors of one prefill of the evaluation text (the capture of
``benchmarks/rotation_order.py``):

* SmolLM2-135M (3 KV heads of 64, 9 query heads): three KV rows a layer, the heads ``(0, 1)``,
  ``(1, 2)`` and ``(2, 0)`` side by side; query ``i`` of a row is query head ``i`` of the
  first head's group beside query head ``i`` of the second's (a row's score is the sum of the
  two heads' real scores);
* Gemma-3-270M (1 KV head of 256, 4 query heads): two KV rows a layer, the first and the last
  128 coordinates of the head, with the same halves of the queries.

Keys are centered per channel (what the caches' ``key_center`` does; a softmax does not see
the shift), then coded as the code layouts of the kernels: 3-bit block codes for keys and
values (``pqo3``'s layout, ``quantize_blocks``) and whole-head codes, 4-bit keys and 3-bit values
(``kv4``'s, ``quantize_head``, ``rotation="head"``), and the head VQ code, 4-bit pairs for keys
and 2-bit quads for values with the unbiased rescale (``kv3``'s, ``quantize_headvq``: the
kernel's VQ build ``decode_attention_mma_vq``, through ``fused_attention_rows``; binary16 norms).
The last ``--queries`` positions of each layer attend causally over the ``--tokens`` tokens,
through ``decode_attention`` on host arrays (the CPU twin) and on CUDA device arrays: the
tensor-core kernel, on a GPU, or its Python twins under ``NUMBA_ENABLE_CUDASIM=1`` (every
``mma.sync``, ``cvt.rn.f16x2`` and table read as the PTX does it; a call takes seconds there).
Reported: the relative L2 error of the outputs per layer (min / median / max over the layers)
and whether every output was finite; the script fails if the tensor-core kernel did not run.

    NUMBA_ENABLE_CUDASIM=1 .venv/bin/python benchmarks/mma_real_kv.py [--models smollm2,gemma3-270m]
        [--tokens 256] [--queries 2] [--layouts pqo3,kv4,kv3] [--rows 128|native] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # (run as a script: the package)
from benchmarks.rotation_order import capture  # noqa: E402
from numba_kv._backend import simulator_enabled, to_host  # noqa: E402
from numba_kv.info import collect, provenance_line  # noqa: E402
from numba_kv.ops._registry import Twin  # noqa: E402
from numba_kv.ops.attention import CodeLayout, decode_attention, fused_attention_rows, kernels  # noqa: E402
from numba_kv.ops.attention.mma import MMA_HEAD_DIMS  # noqa: E402
from numba_kv.ops.blockquant import quantize_blocks  # noqa: E402
from numba_kv.ops.headquant import head_signs, quantize_head, rotate_head  # noqa: E402
from numba_kv.ops.headvq import quantize_headvq  # noqa: E402

D = 128
#: the code layouts the kernels read: (name, key bits, value bits, quantizer, rotation, short name)
LAYOUTS = (("block codes K3/V3 (pqo3)", 3, 3, quantize_blocks, "block", "pqo3"),
           ("head codes K4/V3 (kv4)", 4, 3, quantize_head, "head", "kv4"),
           ("head VQ codes K4/V2 (kv3)", 4, 2, quantize_headvq, "vq", "kv3"))


def _vq_attention(qq: np.ndarray, kq: np.ndarray, ks: np.ndarray, vq: np.ndarray, vs: np.ndarray, scale: float,
                  kbits: int, vbits: int, to: Any) -> np.ndarray:
    """The fused attention of the last ``qq.shape[2]`` positions over head VQ codes, through the
    flat kernels' entry (``decode_attention`` takes scalar codes): arrays moved by ``to``."""
    b, hq, nq, d = qq.shape
    g, T = kq.shape[1], kq.shape[2]
    rows = np.ascontiguousarray(qq.reshape(g, hq // g * nq, d))  # (row: query head of the group, then position)
    qr = np.ascontiguousarray(rotate_head(rows))
    empty = np.zeros((g, 0, d), np.float32)
    out = fused_attention_rows(to(qr), to(rows), *(to(a[0]) for a in (kq, ks, vq, vs)), T, 0, to(empty), to(empty), 0,
                               to(np.zeros(1, np.int32)), CodeLayout.head_vq(kbits, d), CodeLayout.head_vq(vbits, d),
                               scale, None, T - nq, nq, True, head_signs=to(head_signs(d)))
    return np.asarray(to_host(out)).reshape(b, hq, nq, d)


def rows_128(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A layer's ``q [H, T, d]``, ``k``/``v [G, T, d]`` as 128-wide rows (the module docstring):
    ``(q [1, rows·groups, T, 128], k [1, rows, T, 128], v [1, rows, T, 128])``."""
    heads, d = k.shape[0], k.shape[-1]
    groups = q.shape[0] // heads
    if d == D:
        return q[None], k[None], v[None]
    if d == D // 2 and heads >= 2:
        pairs = [(j, (j + 1) % heads) for j in range(heads)] if heads > 2 else [(0, 1)]
        kk = np.stack([np.concatenate([k[a], k[b]], -1) for a, b in pairs])
        vv = np.stack([np.concatenate([v[a], v[b]], -1) for a, b in pairs])
        qq = np.stack([np.concatenate([q[a * groups + i], q[b * groups + i]], -1) for a, b in pairs
                       for i in range(groups)])
        return qq[None], kk[None], vv[None]
    if d % D == 0:
        parts = d // D
        kk = np.stack([k[h, :, D * s:D * (s + 1)] for h in range(heads) for s in range(parts)])
        vv = np.stack([v[h, :, D * s:D * (s + 1)] for h in range(heads) for s in range(parts)])
        qq = np.stack([q[h * groups + i, :, D * s:D * (s + 1)] for h in range(heads) for s in range(parts)
                       for i in range(groups)])
        return qq[None], kk[None], vv[None]
    raise ValueError(f"head_dim {d} with {heads} KV heads: no 128-wide rows")


def native_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The layer's own heads where the kernel has a build for their head_dim, else :func:`rows_128`."""
    return (q[None], k[None], v[None]) if k.shape[-1] in MMA_HEAD_DIMS else rows_128(q, k, v)


def kernel_error(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, layout: tuple,
                 queries: int) -> tuple[float, bool, int]:
    """``(relative L2 error, all finite, tensor-core launches)`` of the last ``queries``
    positions of rows ``q``, ``k``, ``v`` (:func:`rows_128`) through ``decode_attention`` on
    device arrays against the CPU twin, keys centered and coded as ``layout``."""
    from numba import cuda

    _, kbits, vbits, quantize, rotation, _ = layout
    kc = np.ascontiguousarray(k - k.mean(2, keepdims=True))
    extra = {"unbiased": True} if rotation == "vq" else {}
    kq, ks = quantize(kc, kbits, **extra)
    vq, vs = quantize(np.ascontiguousarray(v), vbits, **extra)
    qq = np.ascontiguousarray(q[:, :, -queries:])
    kw = dict(k_bits=kbits, v_bits=vbits, softmax_scale=scale, causal=True, rotation=rotation)
    kernel = kernels.MMA_TWINS[int(q.shape[-1]), False, rotation == "vq"]  # (the head_dim's build)
    if rotation == "vq":
        ref = _vq_attention(qq, kq, ks, vq, vs, scale, kbits, vbits, lambda a: a)
    else:
        ref = decode_attention(qq, kq, ks, vq, vs, **kw)
    launched: list[int] = []
    real = Twin.launch

    def spy(self: Twin, device: Any, *args: Any, **kws: Any) -> Any:
        if self.name == kernel.name:
            launched.append(1)
        return real(self, device, *args, **kws)

    Twin.launch = spy
    try:
        if rotation == "vq":
            dev = _vq_attention(qq, kq, ks, vq, vs, scale, kbits, vbits, cuda.to_device)
        else:
            dev = to_host(decode_attention(*(cuda.to_device(a) for a in (qq, kq, ks, vq, vs)), **kw))
    finally:
        Twin.launch = real
    ref64 = np.asarray(ref, np.float64)
    rel = float(np.linalg.norm(dev.astype(np.float64) - ref64) / np.linalg.norm(ref64))
    return rel, bool(np.isfinite(dev).all()), len(launched)


def measure(name: str, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every layer of model ``name`` in every layout: one record each, and a table row a layout."""
    layers, scale, _ = capture(name, a.tokens)
    rows = native_rows if a.rows == "native" else rows_128
    q0, k0, _ = rows(*layers[0])
    print(f"\n{name}: {len(layers)} layers, {k0.shape[2]} tokens, {k0.shape[1]} rows of {k0.shape[3]} a layer, "
          f"GQA {q0.shape[1] // k0.shape[1]}, the last {a.queries} positions (causal), softmax scale {scale:.4g}")
    print("| layout | rel. L2 error, min | median | max | finite | tensor-core launches |")
    print("| --- | --- | --- | --- | --- | --- |")
    records = []
    for layout in (lay for lay in LAYOUTS if lay[5] in a.layouts.split(",")):
        errs, finite, runs = [], True, 0
        for i, layer in enumerate(layers):
            t0 = time.perf_counter()
            rel, fin, n = kernel_error(*rows(*layer), scale, layout, a.queries)
            errs.append(rel)
            finite &= fin
            runs += n
            records.append({"model": name, "layer": i, "layout": layout[0], "head_dim": int(k0.shape[3]),
                            "rel_l2": rel, "finite": fin,
                            "mma_launches": n, "seconds": time.perf_counter() - t0})
        if runs < len(layers):
            raise SystemExit(f"{name} {layout[0]}: the tensor-core kernel ran {runs} times for {len(layers)} layers")
        print(f"| {layout[0]} | {min(errs):.2e} | {float(np.median(errs)):.2e} | {max(errs):.2e} | "
              f"{'yes' if finite else 'NO'} | {runs} |")
    return records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2,gemma3-270m", help="comma-separated model names")
    p.add_argument("--tokens", type=int, default=256, help="tokens of the evaluation text each layer holds")
    p.add_argument("--queries", type=int, default=2, help="last positions that attend (causal), a call each layer")
    p.add_argument("--layouts", default="pqo3,kv4,kv3", help="comma-separated layouts: pqo3, kv4, kv3")
    p.add_argument("--rows", choices=("128", "native"), default="128",
                   help="128-wide rows made from the heads (default), or the heads themselves where the kernel "
                        "has a build for their head_dim (64, 128)")
    p.add_argument("--json", type=pathlib.Path, default=None, help="write the per-layer records here")
    a = p.parse_args()
    print(provenance_line())
    print("device:", "the CUDA simulator (Python twins of the PTX)" if simulator_enabled() else "a GPU")
    records = [r for name in a.models.split(",") for r in measure(name, a)]
    if a.json is not None:
        a.json.write_text(json.dumps({"schema": "numba_kv.mma_real_kv/1", "env": collect(),
                                      "simulator": simulator_enabled(), "tokens": a.tokens, "queries": a.queries,
                                      "rows": a.rows,
                                      "records": records}, indent=1) + "\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
