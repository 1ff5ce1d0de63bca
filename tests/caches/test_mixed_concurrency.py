"""A mixed cache's whole-cache operations while another thread decodes, for real.

``docs/guide/lifecycle.md`` promises that ``fork`` (and ``state_dict`` / ``save``, ``crop``,
``select_batch``) takes the layer locks in layer order and holds them for the whole
operation: a consistent snapshot even with other threads decoding.  A :class:`MixedCache`
keeps its layers in several parts, so it must hold every part's layer locks at once, in
model layer order, rather than copy one part after another.

* The race test runs a decoder thread that stores layers ``0, 1, ..., L-1`` in that order,
  again and again, while the main thread takes forks and state dicts: every snapshot's
  per-layer lengths must be those of some instant of that loop (non-increasing with the
  layer, first minus last at most 1).  The parts interleave over the layers (and split
  layers over KV heads), and each part's copy ends with a short sleep — the main thread
  descheduled between two parts — so a cache copied part by part lets the decoder run
  ahead between two parts' copies in most snapshots, while a cache holding every lock for
  the whole copy keeps the decoder waiting.
* The lock test records every layer lock's acquire and release during each operation: all
  of them taken once, in model layer order (a split layer's pieces in the order its calls
  take them), before any is released.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from numba_kv import AttendConfig, PolarQuantCache, make_cache
from numba_kv.caches.mixed import MixedCache

L, NKV, HQ, D = 6, 2, 4, 64
CFG = AttendConfig.for_shapes(D, HQ, NKV)
GEOM = {"num_layers": L, "num_kv_heads": NKV, "head_dim": D}
#: parts that interleave over the layers: whole layers; layers split over KV heads (layer 3's
#: pieces in the reverse order of their parts)
LAYOUTS = {
    "layers": {"layer_overrides": {1: {"bits": 4}, 3: {"bits": 4}, 5: {"bits": 4}}},
    "heads": {"layer_overrides": {1: {"bits": 4}, 4: {"bits": 4}},
              "head_overrides": {2: {1: {"bits": 4}}, 3: {0: {"bits": 4}}}},
}
SNAPSHOTS = 200  # forks and state dicts per race (one part-by-part copy in ~2 breaks the rule)
PAUSE = 5e-4  # seconds the main thread sleeps after copying each part


def _cache(layout: str, batch: int = 1, prompt: int = 16) -> MixedCache:
    cache = make_cache("pqo3", **GEOM, **LAYOUTS[layout])
    assert isinstance(cache, MixedCache) and len(cache.parts) >= 2
    assert all(type(p) is PolarQuantCache for p in cache.parts)
    rng = np.random.default_rng(0)
    for layer in range(L):
        k = rng.standard_normal((batch, NKV, prompt, D)).astype(np.float32)
        cache.prefill(layer, k, k)
    return cache


def _in_loop_order(lens: list[int]) -> bool:
    """Lengths some instant of the in-order decode loop shows: ``[n+1]*j + [n]*(L-j)``."""
    return all(a >= b for a, b in zip(lens, lens[1:])) and lens[0] - lens[-1] <= 1


def _pause_after_each_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part's ``fork`` / ``state_dict`` sleeps :data:`PAUSE` once done (the main thread
    descheduled between two parts' copies)."""
    for name in ("__deepcopy__", "state_dict"):
        original = getattr(PolarQuantCache, name)

        def paused(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            time.sleep(PAUSE)
            return out

        monkeypatch.setattr(PolarQuantCache, name, paused)


def _race(cache: MixedCache, k: np.ndarray, q: np.ndarray) -> tuple[list, int, int]:
    """Decode layers 0..L-1 in order on a thread while this one takes :data:`SNAPSHOTS`
    forks / state dicts; ``(snapshots out of loop order, snapshots between two layers of
    the loop, decode cycles)``."""
    stop, errors, cycles = threading.Event(), [], [0]

    def decoder() -> None:
        try:
            while not stop.is_set():
                for layer in range(L):  # always layer 0, 1, ..., L-1
                    cache.decode(layer, k, k, q, CFG)
                cycles[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    bad, mid_cycle = [], 0
    thread = threading.Thread(target=decoder, daemon=True)
    thread.start()
    try:
        for n in range(SNAPSHOTS):
            if errors:
                break
            snap = cache.fork() if n % 2 == 0 else MixedCache.from_state_dict(cache.state_dict())
            lens = [snap.seq_len(layer) for layer in range(L)]
            mid_cycle += len(set(lens)) > 1
            if not _in_loop_order(lens):
                bad.append((("fork", "state_dict")[n % 2], lens))
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive(), "the decoder thread is stuck (deadlock?)"
    assert not errors, errors
    return bad, mid_cycle, cycles[0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fork_and_state_dict_are_snapshots_while_a_thread_decodes(layout, monkeypatch):
    cache = _cache(layout)
    rng = np.random.default_rng(1)
    k, q = (rng.standard_normal((1, h, 1, D)).astype(np.float32) for h in (NKV, HQ))
    for layer in range(L):  # compile everything before the race
        cache.decode(layer, k, k, q, CFG)
    MixedCache.from_state_dict(cache.fork().state_dict())
    _pause_after_each_part(monkeypatch)
    bad, mid_cycle, cycles = _race(cache, k, q)
    assert not bad, f"{len(bad)} of {SNAPSHOTS} snapshots show a later layer ahead of an earlier one: {bad[:5]}"
    # the race was run: the decoder went on, and snapshots landed between two of its layers
    assert cycles >= 10 and mid_cycle >= 10, (cycles, mid_cycle)


class _RecordingLock:
    """A layer lock that logs ``("acquire" | "release", name)``."""

    def __init__(self, name: tuple[int, int], log: list) -> None:
        self.name, self.log, self.lock = name, log, threading.Lock()

    def acquire(self, *args, **kwargs) -> bool:
        got = self.lock.acquire(*args, **kwargs)
        if got:
            self.log.append(("acquire", self.name))
        return got

    def release(self) -> None:
        self.log.append(("release", self.name))
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_whole_cache_operations_hold_every_layer_lock_at_once_in_layer_order(layout, tmp_path):
    cache = _cache(layout, batch=2)
    log: list = []
    order = []  # (part, part layer) of every piece, in model layer order
    for layer in range(L):
        for part, j, _ in cache.layer_pieces(layer):
            name = (cache.parts.index(part), j)
            part._layers[j].lock = _RecordingLock(name, log)
            order.append(name)
    assert sorted(order) != order or layout == "layers"  # "heads": model order is not part order
    ops = {"fork": cache.fork, "state_dict": cache.state_dict, "save": lambda: cache.save(tmp_path / "c.safetensors"),
           "crop_range": cache.crop_range, "crop": lambda: cache.crop(10),
           "select_batch": lambda: cache.select_batch([1, 0])}
    for what, op in ops.items():
        log.clear()
        op()
        assert log == [("acquire", n) for n in order] + [("release", n) for n in reversed(order)], what
    assert [cache.seq_len(i) for i in range(L)] == [10] * L
