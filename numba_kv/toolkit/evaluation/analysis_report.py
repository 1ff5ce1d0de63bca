"""Rich tables of :func:`numba_kv.toolkit.evaluation.analysis.analyze_kv` (``numba-kv analyze``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

__all__ = ["render_tables"]


def render_tables(result: dict[str, Any], console: Any = None, worst: int = 8) -> None:
    """Print the analysis as rich tables.

    Parameters
    ----------
    result : dict
        The dictionary returned by :func:`~numba_kv.toolkit.evaluation.analysis.analyze_kv`.
    console : rich.console.Console, optional
        Default: a new console on stdout.
    worst : int
        Rows of the "worst layer/heads" table.
    """
    con = console or Console(width=170)
    cfg = result["config"]
    b0 = f"pqo{min(cfg['bits'])}"
    groups = cfg["n_heads"] // cfg["n_kv_heads"]
    con.print(_kv_table(result))
    con.print(_per_layer_table(result, b0, groups))
    con.print(_worst_heads_table(result, b0, groups, worst))
    con.print(_engine_table(result))
    con.print("timings: " + ", ".join(f"{k} {v:.0f} s" for k, v in result["timings"].items()))


def _kv_table(result: dict[str, Any]) -> Table:
    """K vs V sensitivity: one row per ``kv_sensitivity`` entry."""
    cfg = result["config"]
    t = Table(title=f"K vs V — {cfg['model_name']}, {Path(cfg['text']).name}: N={cfg['tokens']}, "
                    f"P={cfg['prefill']} ({cfg['scored_positions']} scored decode positions), "
                    f"{result['wall_s']:.0f} s")
    for col in ("row", "engine", "K b/v", "V b/v", "mean b/v", "PPL", "ΔPPL", "top-1", "KL mean", "KL p95"):
        t.add_column(col, justify="left" if col in ("row", "engine") else "right")
    for r in result["kv_sensitivity"]:
        t.add_row(r["label"], r["engine"], f"{r['k_bits_per_value']:.2f}", f"{r['v_bits_per_value']:.2f}",
                  f"{r['bits_per_value']:.2f}", f"{r['ppl']:.3f}", f"{r['ppl_change_pct']:+.2f}%",
                  f"{r['top1_agreement']:.3f}", f"{r['kl_mean']:.4f}", f"{r['kl_p95']:.4f}")
    return t


def _per_layer_table(result: dict[str, Any], b0: str, groups: int) -> Table:
    """Per layer at ``b0`` bits (e.g. ``"pqo3"``): NMSE, channel outliers, attention errors
    (``groups`` query heads per KV head) and the layer-sensitivity sweep."""
    sens = result.get("layer_sensitivity", {})
    t = Table(title=f"Per layer ({b0}, mean over KV heads; attention errors over decode rows, no window; "
                    f"sensitivity = only this layer's K or V quantized, {b0}, no window)")
    cols = ["layer", "K NMSE", "V NMSE", "K ch max/med", "K top ch (worst head)", "V ch max/med", "attn KL",
            "attn KL max head", "logit err σ", "logit σ", "K→out err", "V→out err", "K-layer ΔPPL",
            "K-layer KL", "V-layer ΔPPL", "V-layer KL"]
    for col in cols:
        t.add_column(col, justify="right")
    for L in result["per_layer"]:
        li = L["layer"]
        a = L["attn"][f"{b0}-r0-s0"]
        wh = int(np.argmax(L["k_channel_ratio"]))
        ks, vs = sens.get("k", []), sens.get("v", [])

        def sweep(rows: list[dict[str, Any]], key: str, fmt: str, li: int = li) -> str:
            return format(rows[li][key], fmt) + ("%" if key == "ppl_change_pct" else "") if rows else "-"

        t.add_row(str(li), f"{np.mean(L['k_nmse'][b0]):.4f}", f"{np.mean(L['v_nmse'][b0]):.4f}",
                  f"{max(L['k_channel_ratio']):.1f}", f"h{wh}:{L['k_top_channels'][wh]}",
                  f"{max(L['v_channel_ratio']):.1f}", f"{np.mean(a['kl']):.4f}",
                  f"{max(a['kl']):.4f} (q{int(np.argmax(a['kl']))}/kv{int(np.argmax(a['kl'])) // groups})",
                  f"{np.mean(a['logit_err_std']):.3f}", f"{np.mean(a['logit_std']):.2f}",
                  f"{np.mean(a['k_out_err']):.3f}", f"{np.mean(a['v_out_err']):.3f}",
                  sweep(ks, "ppl_change_pct", "+.2f"), sweep(ks, "kl_mean", ".4f"),
                  sweep(vs, "ppl_change_pct", "+.2f"), sweep(vs, "kl_mean", ".4f"))
    return t


def _worst_heads_table(result: dict[str, Any], b0: str, groups: int, worst: int) -> Table:
    """The ``worst`` query heads by attention KL at ``b0`` bits, no window and with the window."""
    cfg = result["config"]
    win = f"r{cfg['residual_length']}-s{cfg['sink_tokens']}"
    keys = [f"{b0}-r0-s0"] + ([f"{b0}-{win}"] if f"{b0}-{win}" in result["per_layer"][0]["attn"] else [])
    items = []
    for L in result["per_layer"]:
        for h, kl in enumerate(L["attn"][keys[0]]["kl"]):
            items.append((kl, L["layer"], h))
    items.sort(reverse=True)
    t = Table(title=f"Worst query heads by attention KL ({keys[0]})")
    for col in ("layer", "q head", "kv head", "attn KL", f"KL {keys[-1]}", "logit err σ", "K NMSE",
                "K ch max/med", "K top channels (ratio)", "K token-norm max/med (pos)"):
        t.add_column(col, justify="right")
    for kl, li, h in items[:worst]:
        L = result["per_layer"][li]
        g = h // groups
        a = L["attn"][keys[0]]
        top = ", ".join(f"{ch}({r:.1f})"
                        for ch, r in zip(L["k_top_channels"][g], L["k_top_channel_ratios"][g]))
        t.add_row(str(li), str(h), str(g), f"{kl:.4f}", f"{L['attn'][keys[-1]]['kl'][h]:.4f}",
                  f"{a['logit_err_std'][h]:.3f}", f"{L['k_nmse'][b0][g]:.4f}",
                  f"{L['k_channel_ratio'][g]:.1f}",
                  top, f"{L['k_token_norm_ratio'][g]:.1f} ({L['k_token_norm_argmax'][g]})")
    return t


def _engine_table(result: dict[str, Any]) -> Table:
    """The one-pass engine against the protocol rows (``engine_check``)."""
    t = Table(title="One-pass engine vs protocol (same configuration; all-layer rows differ by "
                    "quantization-bucket flips that float rounding triggers: compare the KL-vs-dense "
                    "columns)")
    for col in ("row", "KL between", "top-1 between", "max |Δlogit|", "PPL protocol", "PPL one-pass",
                "KL vs dense: protocol", "one-pass"):
        t.add_column(col, justify="right")
    for ch in result["engine_check"]:
        t.add_row(ch["label"], f"{ch['kl_between']:.2e}", f"{ch['top1_between']:.4f}",
                  f"{ch['max_abs_logit_diff']:.2e}", f"{ch['ppl_protocol']:.4f}",
                  f"{ch['ppl_simulated']:.4f}", f"{ch['kl_dense_protocol']:.4f}",
                  f"{ch['kl_dense_simulated']:.4f}")
    return t
