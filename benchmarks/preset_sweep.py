"""Measure preset candidates on a real model, one JSON line per cache (so a long run that is
stopped keeps the rows it finished): the table that chose ``kv4`` / ``kv5``.

Same measurement as ``numba-kv eval`` (teacher-forced decode, dense as the reference, the
statistics of :func:`numba_kv.metrics.compare_logits`, bits/value from ``memory_usage()``),
without the greedy check.  Usage::

    NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/preset_sweep.py \
        --model smollm2 --out benchmarks/results/presets-smollm2.jsonl NAME=SPEC_JSON ...

Each candidate is ``LABEL=JSON`` with JSON ``{"name": ..., "options": {...}}`` (options may
hold ``layer_overrides`` and ``head_overrides`` — ``{"3": {"0": {"k_bits": 4}}}``, string keys
as JSON has them) or a cache spec string (a preset name, ``pqo3-r32-s4``, ...).  A JSON
candidate with ``"budget"`` is a preset under trial: ``{"name": BASE, "options": {...},
"budget": 4.0, "sink_tokens": 4}`` is registered as a temporary preset ``LABEL`` and sized
like ``kv4``/``kv5`` (its window fills the budget on the model's geometry); ``"residual_fraction":
0.07`` gives it a window that grows to 7 % of the history (``Preset.residual_fraction``;
``"budget"``: the sized window over 1,024 tokens, as ``kv3``).

The dense reference logits are kept in ``--ref-dir`` (one ``.npy`` per model, length and
prefill), so later runs skip the dense pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from numba_kv import info as env_info
from numba_kv.caches import presets
from numba_kv.caches.spec import CacheSpec, parse_cache_spec
from numba_kv.metrics import compare_logits
from numba_kv.toolkit import models
from numba_kv.toolkit.evaluation import evaluate as ev


def _fraction(value: object) -> float | str:
    """A candidate's ``residual_fraction``: a number, or ``"budget"`` (f = sized window / 1024)."""
    return value if value == "budget" else float(value)  # type: ignore[arg-type]


def _spec(label: str, text: str) -> CacheSpec:
    if text.lstrip().startswith("{"):
        d = json.loads(text)
        opts = dict(d.get("options", {}))
        if "layer_overrides" in opts:  # JSON keys are strings: layers are ints
            opts["layer_overrides"] = {int(k): v for k, v in opts["layer_overrides"].items()}
        if "head_overrides" in opts:  # {layer: {kv_head: {option: value}}}, both keys ints
            opts["head_overrides"] = {int(k): {int(h): o for h, o in heads.items()}
                                      for k, heads in opts["head_overrides"].items()}
        if "budget" in d:  # a preset under trial: register it under the label
            over = opts.pop("layer_overrides", {})
            head_over = opts.pop("head_overrides", {})
            presets.PRESETS[label] = presets.Preset(label, d["name"], opts, float(d["budget"]),
                                                    int(d.get("sink_tokens", 4)), over, head_overrides=head_over,
                                                    residual_fraction=_fraction(d.get("residual_fraction", 0.0)))
            return CacheSpec(label, {})
        return CacheSpec(d["name"], opts)
    return parse_cache_spec(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ref-dir", default="/tmp/nkv_ref", help="where the dense logits are kept")
    ap.add_argument("candidates", nargs="+", help="LABEL=SPEC")
    args = ap.parse_args(argv)
    model, tok = models.load_model(args.model)
    c = model.config
    text = ev.resolve_text(None)
    ids = np.asarray(tok.encode(text.read_text(encoding="utf-8", errors="replace"))[:args.tokens], dtype=np.int64)
    targets = ids[args.prefill + 1:]
    cands = [(lab, _spec(lab, s)) for lab, s in (a.split("=", 1) for a in args.candidates)]
    ref_file = Path(args.ref_dir) / f"{Path(args.model).stem}-{args.tokens}-{args.prefill}.npy"
    ref = None
    ref_ppl = float("nan")
    if ref_file.exists():
        ref = np.load(ref_file)
        ref_ppl = compare_logits(ref, ref, targets)["ppl"]
    else:
        cands.insert(0, ("dense", CacheSpec("dense", {})))
    env = env_info.collect()  # (each row names its machine, code generation and threads)
    with open(args.out, "a", encoding="utf-8") as f:
        for label, spec in cands:
            t0 = time.perf_counter()
            ev.warm_up(model, ids, [spec], 256)
            cache = spec.make(c.n_layers, c.n_kv_heads, c.head_dim, **ev.model_cache_options(model))
            scored, tps = ev._decode_logits(model, ids, cache, args.prefill, 256, label, False)
            if ref is None:
                ref = scored
                m = compare_logits(scored, scored, targets)
                ref_ppl = m["ppl"]
                ref_file.parent.mkdir(parents=True, exist_ok=True)
                np.save(ref_file, scored)
            else:
                m = compare_logits(ref, scored, targets)
            row = ev.eval_row(spec, m, ref_ppl, cache, c, tps, None, None, [], time.perf_counter() - t0)
            doc = ev.json_safe({"label": label, "model": args.model, "tokens": args.tokens,
                                 "prefill": args.prefill, "cache_name": getattr(cache, "name", ""),
                                 **{k: v for k, v in vars(row).items() if k != "generations"}, "env": env})
            f.write(json.dumps(doc) + "\n")
            f.flush()
            print(f"{label}: bits {row.bits_per_value:.3f} dPPL {row.ppl_change_pct:+.2f}% +- "
                  f"{row.ppl_change_se:.2f} top1 {row.top1_agreement:.3f} KL {row.kl_mean:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
