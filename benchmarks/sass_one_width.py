"""SASS of the tensor-core decode attention's hot loop for ONE code width of K and V.

``numba-kv kernels --sass`` counts the kernel as shipped, whose token loop holds the decoders
of all three widths (2, 3, 4 bits) of K and of V, of which a pass runs one each (and the flat
kernel has two such loops: block scales, and one scale a token).  This script counts what one
pass of one width pair costs: it copies ``numba_kv/`` (the working tree, or a git revision
with ``--rev``) to a temporary folder, turns the width dispatch of the tiles (``if kb == 3:``
...) into constants there (the chosen branch ``True``, the others ``False``, so the compiler
drops them) and, with ``--scales token``, the flat kernel's choice of the token-scale loop
(``if sshift >= 2:``; default ``block``, the other loop), compiles ``decode_attention_mma`` (or
``--kernel``) for sm_90
with nvJitLink, disassembles it and prints the loop that holds the ``HMMA`` instructions:
static instructions per pass, per token per KV head (16 tokens a pass), registers, and the
largest instruction classes.  No GPU needed (``nvidia-cuda-nvdisasm``, in the ``test`` extra).

    .venv/bin/python benchmarks/sass_one_width.py --bits 3 [--vbits 3] [--scales block|token] [--rev 2937c4b]
        [--kernel paged_decode_attention_mma | --kernel decode_attention_mma_vq --quads k|v|kv|none]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

_CHILD = """
import json, sys
import numba_kv
assert numba_kv.__file__.startswith(sys.argv[2]), numba_kv.__file__  # the pinned copy, not the checkout
from collections import Counter
from numba_kv._sass import kernel_sass
k = kernel_sass(sys.argv[1], (9, 0))
loops = [loop for loop in k.loops if any(i.opcode.startswith("HMMA") for i in loop.instructions)]
loop = max(loops, key=lambda lp: lp.size)
top = Counter(i.opcode for i in loop.instructions).most_common(8)
print(json.dumps({"registers": k.resources.registers, "size": loop.size, "per_token": loop.size / 16, "top": top}))
"""


def pinned_source(text: str, bits: int, vbits: int | None = None, scales: str | None = None,
                  quads: str | None = None) -> str:
    """``mma.py`` with the width tests of its tile dispatchers made constant for ``bits`` (K;
    V: ``vbits``, default ``bits``), with ``scales`` its choice of the tile loop, and with
    ``quads`` the VQ build's quad tests (``VQ_BUILD and kq`` / ``vq``): True for the sides it
    names (``"k"``, ``"v"``, ``"kv"``), False for the others (``"none"``: both)."""
    want = {"kb": bits, "vb": bits if vbits is None else vbits}
    out, n = re.subn(r"\b([kv]b) == ([234])\b", lambda m: "True" if int(m.group(2)) == want[m.group(1)] else "False",
                     text)
    if n < 4:
        raise SystemExit(f"found {n} width tests in mma.py (expected the K and V dispatchers' 4)")
    if scales is not None:
        out, n = re.subn(r"\b(el)?if \(int32\(1\) << sshift\) >= HEAD_DIM // 32:",
                         lambda m: f"{m.group(1) or ''}if {scales == 'token'}:", out)
        if n != 1:
            raise SystemExit(f"found {n} choices of the tile loop in mma.py (expected 1: "
                             "'if (int32(1) << sshift) >= HEAD_DIM // 32:')")
    for side in "kv" if quads is not None else "":
        out, n = re.subn(rf"\bVQ_BUILD and {side}q\b", str(side in quads), out)
        if n != 1:
            raise SystemExit(f"found {n} quad tests of {side} in mma.py (expected 1)")
    return out


def package(rev: str | None, dest: pathlib.Path) -> None:
    """``numba_kv/`` of ``rev`` (or the working tree) at ``dest / "numba_kv"``."""
    if rev is None:
        shutil.copytree(ROOT / "numba_kv", dest / "numba_kv", ignore=shutil.ignore_patterns("__pycache__"))
        return
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "numba_kv"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, choices=(2, 3, 4), default=3, help="K's width (and V's by default)")
    ap.add_argument("--vbits", type=int, choices=(2, 3, 4), default=None, help="V's width")
    ap.add_argument("--scales", choices=("block", "token"), default=None,
                    help="the flat kernel's tile loop: block scales or one scale a token (default: as compiled)")
    ap.add_argument("--rev", default=None, help="git revision (default: the working tree)")
    ap.add_argument("--kernel", default="decode_attention_mma")
    ap.add_argument("--quads", default=None, choices=("k", "v", "kv", "none"),
                    help="sides in VQ quads, the others not (--kernel decode_attention_mma_vq; VQ pairs are the "
                         "4-bit tiles); default: the quad branches as compiled")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="numba_kv_sass_") as tmp:
        dest = pathlib.Path(tmp)
        package(args.rev, dest)
        mma = dest / "numba_kv" / "ops" / "attention" / "mma.py"
        mma.write_text(pinned_source(mma.read_text(), args.bits, args.vbits, args.scales, args.quads))
        env = {**os.environ, "PYTHONPATH": str(dest), "NUMBA_CACHE_DIR": str(dest / "numba_cache")}
        # (cwd: ``-c`` puts the current folder first on sys.path, which must not be a checkout)
        run = subprocess.run([sys.executable, "-c", _CHILD, args.kernel, tmp], env=env, cwd=tmp, capture_output=True,
                             text=True, check=False)
    if run.returncode != 0:
        raise SystemExit(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else "the compile failed")
    r = json.loads(run.stdout.strip().splitlines()[-1])
    vbits = args.bits if args.vbits is None else args.vbits
    mode = (f", {args.scales} scales" if args.scales else "") + (f", quads: {args.quads}" if args.quads else "")
    # (quads "none": the VQ build with scalar codes on both sides, pairs as the 4-bit tiles)
    print(f"{args.kernel} at {args.rev or 'working tree'}, {args.bits}-bit K, {vbits}-bit V{mode}, sm_90: "
          f"{r['size']} SASS a pass, "
          f"{r['per_token']:.1f} per token per KV head, {r['registers']} registers; "
          + ", ".join(f"{n} {op}" for op, n in r["top"]))


if __name__ == "__main__":
    main()
