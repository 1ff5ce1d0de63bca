"""Issue 29, item 3 (``kv3``): find a model's retrieval heads and give their keys more bits.

A needle is retrieved when the heads that copy from it still find it: Wu et al., "Retrieval
Head Mechanistically Explains Long-Context Factuality" (arXiv 2404.15574) show that a few
percent of a model's heads do this copying, and that they are a property of the model, not of
the text.  Measured so far (``benchmarks/results/kv3-2026-11-27-round5.md``): ``kv3`` misses
SmolLM2's 4K needle at 10 % depth and retrieves it once *every* head's keys have 5 bits —
the key codes decide it.  This script spends those bits only where retrieval happens.

Calibration uses its **own** needle and question (not the evaluation's, see
:data:`CAL_NEEDLE`), at lengths and depths the evaluation does not use: the dense model
reads the prompt followed by the needle's answer (teacher forcing), every layer's queries
and keys are recorded, and a KV head's *retrieval score* is the attention mass that the
answer's queries put on the needle's tokens (mean over answer positions and calibration
prompts, max over the query heads of the group).  The heads scoring at least ``--min-score``
(or the ``--top`` heads) get
``--k-bits`` keys (values unchanged); the result is written as a ``head_overrides`` file,
merged over ``--base`` (e.g. a KL calibration) when given — or, with ``--sens`` (the per-head
KL table of ``benchmarks/kv3_layers.py``), as that script's allocation at ``--budget`` mean
code bits with the retrieval heads pinned to ``--k-bits`` keys: the other heads pay for them,
so the preset's window does not shrink.

Usage::

    OPENBLAS_NUM_THREADS=1 python benchmarks/kv3_retrieval.py --model smollm2 \\
        --lengths 3000 6000 --depths 20 45 75 --out retrieval.json \
        --sens benchmarks/results/kv3-2026-11-27-round4-sens-smollm2-heads-essays-vqb8-w44.npz
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from numba_kv import make_cache
from numba_kv.toolkit import models
from numba_kv.toolkit.evaluation.kv_split import RecordingCache
from numba_kv.toolkit.evaluation.needle import essays_text

#: the calibration needle, question and answer: unrelated to the evaluation's
#: (``numba_kv.toolkit.evaluation.needle.NEEDLE``) so the heads are not chosen on the test
CAL_NEEDLE = (" The secret ingredient of my grandmother's soup was a spoonful of smoked paprika"
              " from Valencia.")
CAL_QUESTION = ("\n\nQuestion: What was the secret ingredient of my grandmother's soup?\n"
                "Answer: The secret ingredient of my grandmother's soup was")
CAL_ANSWER = " a spoonful of smoked paprika from Valencia."


def prompt_ids(tok: Any, hay: list[int], length: int, depth: float) -> tuple[list[int], int, int, int]:
    """``(ids, needle_start, needle_len, answer_start)``: BOS, filler with the needle at
    ``depth`` (at a sentence end), question, answer; ``length`` tokens before the answer."""
    needle = tok.encode(CAL_NEEDLE, add_bos=False)
    question = tok.encode(CAL_QUESTION, add_bos=False)
    answer = tok.encode(CAL_ANSWER, add_bos=False)
    bos = [tok.bos_id] if getattr(tok, "add_bos", False) and tok.bos_id is not None else []
    n_ctx = length - len(bos) - len(needle) - len(question)
    ctx = hay[:n_ctx]
    cut = int(round(depth * n_ctx))
    for i in range(cut, max(cut - 256, -1), -1):
        if i == 0 or "." in tok.decode([ctx[i - 1]]):
            cut = i
            break
    ids = bos + ctx[:cut] + needle + ctx[cut:] + question + answer
    return ids, len(bos) + cut, len(needle), length


def retrieval_scores(model: Any, ids: list[int], start: int, n_needle: int, answer_start: int) -> np.ndarray:
    """``[layers, kv_heads]``: attention mass of the answer's queries on the needle (dense)."""
    c = model.config
    rec = RecordingCache(make_cache("dense", num_layers=c.n_layers, num_kv_heads=c.n_kv_heads,
                                    head_dim=c.head_dim))
    model.forward(ids, rec, logits="none", chunk_size=512)
    g = c.n_heads // c.n_kv_heads
    out = np.zeros((c.n_layers, c.n_kv_heads))
    # the queries that predict the answer's tokens: the question's last token and the answer's
    qs = slice(answer_start - 1, len(ids) - 1)
    for layer in range(c.n_layers):
        q, k, _ = rec.recorded(layer)
        qa = q[0, :, qs].astype(np.float64)  # [H, A, d]
        kk = np.repeat(k[0].astype(np.float64), g, axis=0)  # [H, T, d]
        s = np.einsum("had,htd->hat", qa, kk) * model.softmax_scale
        pos = np.arange(kk.shape[1])
        qpos = np.arange(len(ids))[qs]
        s = np.where(pos[None, None, :] <= qpos[None, :, None], s, -np.inf)  # causal
        window = model.layer_windows[layer]
        if window is not None:  # a sliding layer sees only its window (the needle is far)
            s = np.where(pos[None, None, :] > qpos[None, :, None] - window, s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        mass = p[:, :, start:start + n_needle].sum(axis=-1).mean(axis=-1)  # [H]
        out[layer] = mass.reshape(c.n_kv_heads, g).max(axis=1)
    return out


def overrides(scores: np.ndarray, top: int, k_bits: int, base: dict[str, Any], v_bits: int | None = None
              ) -> dict[str, Any]:
    """``head_overrides``: ``base`` with the ``top`` best-scoring heads' keys at ``k_bits`` (and
    values at ``v_bits`` when given) or wider."""
    out = {str(li): dict(heads) for li, heads in base.items()}
    order = np.argsort(-scores, axis=None)[:top]
    for flat in order:
        li, h = np.unravel_index(flat, scores.shape)
        entry = dict(out.setdefault(str(int(li)), {}).get(str(int(h)), {}))
        entry["k_bits"] = max(int(entry.get("k_bits", 0)), k_bits)
        if v_bits is not None:
            entry["v_bits"] = max(int(entry.get("v_bits", 0)), v_bits)
        out[str(int(li))][str(int(h))] = entry
    return out


def pinned_allocation(scores: np.ndarray, top: int, k_bits: int, sens_path: str, budget: float
                      ) -> dict[str, Any]:
    """``head_overrides``: ``kv3_layers``' KL allocation at ``budget`` with the ``top`` heads'
    keys pinned to at least ``k_bits``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import kv3_layers

    sens = kv3_layers.load_sens(sens_path)
    if sens["k"][min(sens["k"])].size != scores.size:
        raise SystemExit(f"--sens: {sens['k'][min(sens['k'])].size} units, the model has {scores.size} KV heads")
    if k_bits not in sens["k"]:  # the table's widest keys' KL bounds a wider code's from above;
        sens["k"][k_bits] = sens["k"][max(sens["k"])].copy()  # only pinned units take it anyway
    pins = {int(u): k_bits for u in np.argsort(-scores, axis=None)[:top]}
    alloc = kv3_layers.allocate(sens, budget, min_k=pins)
    return kv3_layers.alloc_overrides(alloc, scores.shape[1], True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[3000, 6000])
    ap.add_argument("--depths", type=float, nargs="+", default=[25, 60], help="percent")
    ap.add_argument("--top", type=int, default=None, help="heads whose keys get --k-bits (instead of --min-score)")
    ap.add_argument("--min-score", type=float, default=0.3,
                    help="the heads scoring at least this get --k-bits keys (default 0.3)")
    ap.add_argument("--k-bits", type=int, default=5)
    ap.add_argument("--v-bits", type=int, default=None, help="the retrieval heads' values too (not with --sens)")
    ap.add_argument("--base", help="head_overrides JSON to merge over (e.g. a KL calibration)")
    ap.add_argument("--sens", help="per-head KL table (.npz of kv3_layers.py): allocate around the pins")
    ap.add_argument("--budget", type=float, default=3.0, help="with --sens: mean code bits (k + v) / 2")
    ap.add_argument("--scores", help="read the scores (.npy) instead of measuring them")
    ap.add_argument("--scores-out", help="write the [layers, kv_heads] scores (.npy)")
    ap.add_argument("--out", required=True, help="head_overrides JSON to write")
    a = ap.parse_args(argv)
    total = np.load(a.scores) if a.scores else measure(a)
    if a.scores_out:
        np.save(a.scores_out, total)
    top = a.top if a.top is not None else int(np.count_nonzero(total >= a.min_score))
    best = np.argsort(-total, axis=None)[:top]
    print("retrieval heads (layer.head: score): " + ", ".join(
        f"{i // total.shape[1]}.{i % total.shape[1]}: {total.flat[i]:.3f}" for i in best), file=sys.stderr)
    if a.sens and a.v_bits is not None:
        raise SystemExit("--v-bits: not with --sens (the allocation pins keys only)")
    if a.sens:
        out = pinned_allocation(total, top, a.k_bits, a.sens, a.budget)
    else:
        out = overrides(total, top, a.k_bits, json.loads(Path(a.base).read_text()) if a.base else {}, a.v_bits)
    Path(a.out).write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")
    return 0


def measure(a: argparse.Namespace) -> np.ndarray:
    """Mean retrieval scores over ``a.lengths`` × ``a.depths`` (progress on stderr)."""
    model, tok = models.load_model(a.model)
    hay = tok.encode(essays_text(), add_bos=False)
    # the calibration haystack starts past the evaluation's longest prompt's filler
    hay = hay[len(hay) // 2:]
    total = np.zeros((model.config.n_layers, model.config.n_kv_heads))
    for n in a.lengths:
        for d in a.depths:
            t0 = time.perf_counter()
            ids, start, n_needle, ans = prompt_ids(tok, hay, n, d / 100)
            s = retrieval_scores(model, ids, start, n_needle, ans)
            total += s
            top = np.argsort(-s, axis=None)[:5]
            print(f"{n} tokens, depth {d:g} %: {time.perf_counter() - t0:.0f} s; top heads "
                  + ", ".join(f"{i // s.shape[1]}.{i % s.shape[1]}={s.flat[i]:.2f}" for i in top), file=sys.stderr)
    return total / (len(a.lengths) * len(a.depths))


if __name__ == "__main__":
    raise SystemExit(main())
