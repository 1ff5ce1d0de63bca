"""A decode step bound to fixed arrays: once steady, its kernels replay as one CUDA graph and
its Python is skipped (issue 27, item 3).

:class:`numba_kv.StepGraph` replays a steady step's launches as one graph, but still runs the
step's Python every time: validation, the store's bookkeeping, the attention call, the launch
recording — about 0.24 ms per step on a 2-vCPU EPYC (``benchmarks/host_step_profile.py``), more
than the step's kernels take on a GPU.  :class:`DecodeStep` binds one layer's step to its
arrays (the plan/run split of FlashInfer at the level of a whole cache step): it runs the step
in full through its own ``StepGraph`` until two steps in a row replayed the same graph and
changed the layer's host state by the same amounts (:mod:`numba_kv.caches._steady`); from
then on, while the layer is exactly in the state the last step left and the cache says the
next step stores the same way, a step is one graph launch plus those amounts added to its
counters.  Anything else runs the step in full again.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np

from .._graph import StepGraph
from .._validate import check_bool, check_float_array, check_layer
from ._steady import SteadyMark, SteadyStepMixin
from .protocol import AttendConfig, DecodeOutput, Fused

__all__ = ["DecodeStep"]


class _Armed:
    """What a skipped step needs: the state the last step left, the counters' step, the graph's
    generation, the result to return, and the graph's arrays (held alive)."""

    __slots__ = ("after", "arrays", "delta", "generation", "result")

    def __init__(self, after: SteadyMark, delta: tuple, generation: int, result: Any, arrays: tuple) -> None:
        self.after, self.delta, self.generation, self.result, self.arrays = after, delta, generation, result, arrays


class DecodeStep:
    """``cache.decode(layer, k, v, q, config, out=out)`` bound to fixed arrays: call it once per
    step after writing the step's inputs into ``k``, ``v`` and ``q``.

    On device arrays (CuPy, Numba) every call runs the step's kernels on the calling thread's
    launch stream (:func:`numba_kv.launch_stream`).  The first steps run in full through the
    step's own :class:`numba_kv.StepGraph` (launched, captured, replayed); once two steps in
    a row replayed the same graph and moved the layer's host bookkeeping by the same amounts,
    a step whose layer is exactly in the state the last step left, and whose cache says it
    stores the same way (a fixed window that is full, room in the codes, no sliding layer),
    skips its Python: one graph launch and the counters advanced.  Any other step — the codes
    grow, the window is not full yet, the layer was cropped, reset or decoded by another
    caller, a knob or the launch stream changed, the inputs were reshaped, the deferred value
    checks were read — runs in full, and the bound step learns again.  On NumPy arrays every
    call is ``cache.decode``.

    Parameters
    ----------
    cache : CompressedKVCache
        Any cache; steps skip their Python only on the library's fused layered caches
        (``pq*``/``pqo*``/``kv*`` presets) with a window or not; TurboQuant's (``tq*``) never do
        (their key residual and projected queries are CuPy work between the launches).
    layer : int
    k, v : arrays ``[batch, num_kv_heads, n, head_dim]``
        The step's new keys and values (written by the caller before each call).
    q : array ``[batch, num_heads, n, head_dim]``
    config : AttendConfig
    out : array shaped like ``q``, optional
        The output (float32 on a GPU: the kernel writes it).  Without it no step skips its
        Python (each call returns a new array).
    verify : bool, default False
        Run every step in full and check that a skipped one would have launched the same
        graph and left the same host state (``RuntimeError`` otherwise): for tests.

    Raises
    ------
    TypeError, ValueError, IndexError
        When built: ``config`` not an :class:`AttendConfig`, an array that is not 4-D, or
        (the library's layered caches) ``layer`` not an int in ``[0, num_layers)``.

    Notes
    -----
    ``cache``, ``layer``, ``config``, ``k``, ``v``, ``q`` and ``out`` are read-only: a skipped
    step replays what it captured from those objects, so to change one, bind a new step.
    One call at a time per bound step (a lock); other threads may use the cache's other
    layers, or this layer through ``cache.decode`` (the bound step then sees a state it did not
    leave and runs its next step in full).  Between calls the bound step holds the objects of
    its last step's state (the layer's buffer dict, its captured graph's arrays), so device
    memory that the cache let go of (after a growth, a ``reset``) is freed at the next call or
    when the bound step is dropped.

    Examples
    --------
    >>> import numpy as np, numba_kv
    >>> cache = numba_kv.make_cache("pqo3", num_layers=1, num_kv_heads=2, head_dim=64)
    >>> k = np.ones((1, 2, 1, 64), np.float32); q = np.ones((1, 4, 1, 64), np.float32)
    >>> step = numba_kv.DecodeStep(cache, 0, k, k, q, numba_kv.AttendConfig(0.125, n_kv_groups=2))
    >>> step().out.shape, cache.seq_len(0)
    ((1, 4, 1, 64), 1)
    """

    def __init__(self, cache: Any, layer: int, k: Any, v: Any, q: Any, config: AttendConfig, *, out: Any = None,
                 verify: bool = False) -> None:
        if not isinstance(config, AttendConfig):
            raise TypeError(f"config: expected an AttendConfig, got {type(config).__name__}")
        if not callable(getattr(cache, "decode", None)):
            raise TypeError(f"cache: expected a numba_kv cache (with a decode method), got {type(cache).__name__}")
        # the shapes the step reads of them (the rest is checked by the cache, as cache.decode does)
        for name, a in (("k", k), ("v", v), ("q", q)) + ((("out", out),) if out is not None else ()):
            check_float_array(name, a, 4)
        if isinstance(cache, SteadyStepMixin):  # (its hooks index the layers: a bad one named here, not deep inside)
            layer = check_layer(layer, len(cache._layers))  # noqa: SLF001
        # read-only (properties below): a skipped step replays what it captured from these
        # objects, so one swapped in afterwards would be ignored without a word
        self._cache, self._layer, self._config = cache, layer, config
        self._k, self._v, self._q, self._out = k, v, q, out
        self.verify = check_bool("verify", verify)
        self.graph = StepGraph()
        self._n = int(k.shape[2])
        self._inputs = self._shapes()
        self._hooks = isinstance(cache, SteadyStepMixin) and out is not None and not isinstance(k, np.ndarray)
        self._lock = threading.Lock()
        self._prev: tuple | None = None
        self._armed: _Armed | None = None

    @property
    def cache(self) -> Any:
        """The bound cache."""
        return self._cache

    @property
    def layer(self) -> int:
        """The bound layer."""
        return self._layer

    @property
    def config(self) -> AttendConfig:
        """The bound attention parameters."""
        return self._config

    @property
    def k(self) -> Any:
        """The bound new keys: write each step's into it (the array itself cannot be swapped)."""
        return self._k

    @property
    def v(self) -> Any:
        """The bound new values (written in place, as ``k``)."""
        return self._v

    @property
    def q(self) -> Any:
        """The bound queries (written in place, as ``k``)."""
        return self._q

    @property
    def out(self) -> Any:
        """The bound output array, or None."""
        return self._out

    def _shapes(self) -> tuple:
        # (a CuPy array's shape can be set in place: the bound arrays are checked each step)
        return tuple((tuple(a.shape), a.dtype) for a in (self._k, self._v, self._q, self._out) if a is not None)

    def __call__(self) -> DecodeOutput:
        """One decode step (what ``cache.decode`` returns; ``Fused.out is out`` when given)."""
        with self._lock:
            armed = self._armed
            if armed is not None and not self.verify and self._shapes() == self._inputs:
                new = self._cache._steady_step(self._layer, self._n, armed.after, armed.delta,  # noqa: SLF001
                                              functools.partial(self.graph.replay, armed.generation))
                if new is not None:
                    armed.after = new
                    return armed.result
            return self._full()

    def _full(self) -> DecodeOutput:
        """The step in full through the graph; learn (or check, ``verify``) what it did."""
        cache, n, armed = self._cache, self._n, self._armed
        if not self._hooks:
            return self.graph.run(cache.decode, self._layer, self._k, self._v, self._q, self._config, out=self._out)
        expect = None
        # (verify only: a step that was not skipped though its state was steady, e.g. on another launch
        # stream than the graph's, runs in full and is learnt again)
        if self.verify and armed is not None and self._shapes() == self._inputs:  # what a skipped step would leave
            expect = cache._steady_step(self._layer, n, armed.after, armed.delta, None)  # noqa: SLF001
        before = cache._steady_mark(self._layer, n)  # noqa: SLF001
        self._armed = None
        try:
            res = self.graph.run(cache.decode, self._layer, self._k, self._v, self._q, self._config, out=self._out)
        except BaseException:
            self._prev = None
            raise
        after = cache._steady_mark(self._layer, n)  # noqa: SLF001
        if expect is not None:
            self._check(expect, after, armed.generation)
        self._learn(before, after, res)
        return res

    def _learn(self, before: SteadyMark, after: SteadyMark, res: Any) -> None:
        """Arm the bound step when this step and the one before replayed one graph, in the
        same regime, with the same counter step, one right after the other."""
        delta = after.delta(before) if self.graph.last in ("replayed", "captured") else None
        step = None if delta is None or before.regime is None else (before, after, delta, self.graph.generation)
        prev, self._prev = self._prev, step
        if step is None or prev is None or not isinstance(res, Fused) or res.out is not self._out:
            return
        _, p_after, p_delta, p_gen = prev
        if p_delta != delta or p_gen != step[3] or not p_after.same(before) or after.regime != before.regime:
            return
        arrays = self.graph.captured_arrays()
        if arrays is not None:
            self._armed = _Armed(after, delta, step[3], res, arrays)

    def _check(self, expect: SteadyMark, after: SteadyMark, generation: int) -> None:
        """``verify``: the full step must have replayed the armed graph and left ``expect``."""
        where = f"DecodeStep(verify=True), layer {self._layer}"
        if self.graph.last != "replayed" or self.graph.generation != generation:
            raise RuntimeError(f"{where}: a skipped step would have replayed the captured graph, but the full "
                               f"step's launches were {self.graph.last!r}")
        if after.layout != expect.layout or after.consts != expect.consts or after.delta(expect) is None:
            raise RuntimeError(f"{where}: the full step changed more than the counters a skipped step advances")
        bad = after.differences(expect)
        if bad:
            raise RuntimeError(f"{where}: the full step left other counters than a skipped step would: "
                               + "; ".join(bad))

    def stats(self) -> dict[str, int]:
        """The step's :meth:`numba_kv.StepGraph.stats`; ``bound`` counts the steps that skipped
        their Python."""
        return self.graph.stats()

