"""The attention plan: every decision about a decode attention that does not change per step.

An :class:`AttentionPlan` is built once per cache layer and query/cache shape (and device):
it checks head_dim against the kernels' limits, holds the code layouts and their device
copies, picks the kernel variant (``cpu``, CUDA ``block``, ``warp`` or ``mma``), the
partitioning policy, the CUDA grid, and keeps the partial-result buffers of the split-K
partitions (its workspace, per thread).  A decode step then only hands over the arrays of
that step (:meth:`AttentionPlan.run_flat`, :meth:`AttentionPlan.run_paged`) — no re-checks,
no dummy arrays, no knob reads.  It is the object a CUDA-graph replay of the decode step
captures.

Who decides what (ARCHITECTURE.md, "The decode path"): the *cache* owns its state (codes,
window, positions) and hands the plan the live arrays; the *plan* owns legality, variant,
partitioning, grid and workspace; the *kernels* own the arithmetic.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import cuda

from ... import _backend, _config
from ..._config import MAX_HEAD_DIM
from ..._validate import check_grid
from .._registry import TWINS
from ..hadamard import SIGNS32
from ..headquant import rotate_head_rows
from .cores import EXACT_F16, EXACT_F32, EXACT_I8
from .kernels import (
    DECODE_ATTENTION,
    DECODE_ATTENTION_MMA,
    DECODE_ATTENTION_WARP,
    DECODE_ATTENTION_WARP_VQ,
    MMA_TWINS,
    PAGED_DECODE_ATTENTION,
    PAGED_DECODE_ATTENTION_MMA,
    PAGED_DECODE_ATTENTION_WARP,
    rows_per_block,
)
from .layout import F16_ABS_TABLE, CodeLayout, mma_layout_ok, mma_operands
from .merge import MERGE_PARTITIONS
from .mma import MMA_HEAD_DIMS, MMA_THREADS, MMA_TILE, mma_partition_size
from .step_cpu import ROTATE_HEAD, flat_step_parallel, flat_step_serial
from .warp import VROW, WARP_ROWS, warp_ok

__all__ = ["AttentionPlan", "FlatStep", "TILE", "VARIANTS", "attention_plan", "check_cuda_head_dim",
           "cuda_block_threads", "default_partition_size", "use_mma_kernel", "use_warp_kernel"]

TILE = 128  # tokens per partition granule (partition sizes are multiples of it)
WORKSPACES = 4  # partition workspaces a plan keeps per thread and launch stream
#: the kernel variants, and the registered twins of each for flat caches and paged pools
VARIANTS = ("cpu", "block", "warp", "mma")
_KERNELS = {False: {"cpu": DECODE_ATTENTION, "block": DECODE_ATTENTION, "warp": DECODE_ATTENTION_WARP,
                    "mma": DECODE_ATTENTION_MMA},
            True: {"cpu": PAGED_DECODE_ATTENTION, "block": PAGED_DECODE_ATTENTION,
                   "warp": PAGED_DECODE_ATTENTION_WARP, "mma": PAGED_DECODE_ATTENTION_MMA}}


def cuda_block_threads() -> int:
    """Threads per block of the cooperative attention kernels (the ``cuda_threads`` knob;
    ``cuda_threads_sim`` under the simulator, where every thread is an OS thread)."""
    return int(_config.get("cuda_threads_sim" if _backend.simulator_enabled() else "cuda_threads"))


def check_cuda_head_dim(d: int) -> None:
    """``ValueError`` unless the CUDA kernels' shared-memory buffers hold head_dim ``d``
    (:data:`numba_kv._config.MAX_HEAD_DIM`, the one source of that limit)."""
    if d > MAX_HEAD_DIM:
        raise ValueError(f"q: the CUDA decode attention kernels support head_dim <= {MAX_HEAD_DIM} "
                         f"(static shared memory), got {d}")


def use_warp_kernel(dev: str, d: int, has_bias: bool, has_qjl: bool) -> bool:
    """Whether a decode on ``dev`` runs a warp kernel (flat or paged) instead of a block kernel.

    Parameters
    ----------
    dev : {"cpu", "cuda"}
    d : int
        head_dim (the warp kernels take 32, 64 and 128).
    has_bias, has_qjl : bool
        A logit bias or the QJL correction (only the block kernels apply them).

    Returns
    -------
    bool
        CUDA, the ``cuda_warp_attention`` knob on, neither extra, a head_dim and a block size
        (whole warps) the warp kernels take."""
    return (dev == _backend.CUDA and not has_bias and not has_qjl and bool(_config.get("cuda_warp_attention"))
            and warp_ok(d, cuda_block_threads()))


def use_mma_kernel(dev: str, d: int, has_bias: bool, has_qjl: bool, klayout: CodeLayout,
                   vlayout: CodeLayout) -> bool:
    """Whether a decode on ``dev`` runs a tensor-core kernel (``decode_attention_mma``, paged too,
    or for head VQ layouts ``decode_attention_mma_vq``).

    Parameters
    ----------
    dev : {"cpu", "cuda"}
    d : int
        head_dim (the kernels take :data:`~numba_kv.ops.attention.mma.MMA_HEAD_DIMS`).
    has_bias, has_qjl : bool
        A logit bias or the QJL correction (only the block kernels apply them).
    klayout, vlayout : CodeLayout
        The code layouts of K and V (:func:`~numba_kv.ops.attention.layout.mma_layout_ok`).

    Returns
    -------
    bool
        The warp kernel would run (:func:`use_warp_kernel`), the ``cuda_mma_attention`` knob
        is on, ``d`` is 64 or 128 and both layouts are uniform with a pair or VQ table."""
    return (d in MMA_HEAD_DIMS and bool(_config.get("cuda_mma_attention"))
            and use_warp_kernel(dev, d, has_bias, has_qjl) and mma_layout_ok(klayout) and mma_layout_ok(vlayout))


def default_partition_size(n_tokens: int, n_rows_kv: int, device: str, warp: bool = False) -> int:
    """Tokens per partition: enough partitions to occupy the machine, at least one tile.

    ``warp``: for the warp kernels (one warp per partition), about ``n_rows_kv · n_tokens /
    16384`` tokens per warp (some 120 warps queued per SM of an H100) in multiples of 32 in
    [64, 1024]: longer ones would leave SMs idle at small batch, shorter ones make the merge's
    partial sums a larger share of the bytes read."""
    if device == _backend.CPU:
        want = 4 * numba.get_num_threads()
        per = -(-n_tokens // max(1, -(-want // max(n_rows_kv, 1))))
        return int(max(4 * TILE, -(-per // TILE) * TILE))
    if _backend.simulator_enabled():
        return 64
    if warp:
        per = -(-max(n_rows_kv, 1) * n_tokens // 16384)
        return int(min(1024, max(64, -(-per // 32) * 32)))
    return 256


# Placeholders for the kernel arguments of an absent QJL correction, logit bias, exact-token
# scales and (paged float32 pools) code layout: never read (the kernels test their flags), put
# on the plan's device once; writable: the kernels are compiled for the real arguments' types.
_NO_QJL = (np.zeros((1, 1, 8), np.float32), np.zeros((1, 1, 1), np.uint8), np.zeros((1, 1), np.uint16))
_NO_BIAS = np.zeros((1, 1, 1), np.float32)
_NO_SCALES = np.zeros((1, 1, 1), np.uint16)
# the flat kernels' page table (KV row g is "page" g: never read) and the paged kernels' exact
# tokens' positions and scales (a pool's tokens sit at their index; float32 pools, no scales)
_NO_PAGES = (np.zeros(2, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32))
_NO_POS = np.zeros(1, np.int32)
_NO_POOL_SCALES = np.zeros((1, 1, 1, 1), np.uint16)
_FLOAT_CENT = np.zeros((1, 16), np.float32)
_FLOAT_BITS = np.ones(1, np.int64)
for _a in (_FLOAT_CENT, _FLOAT_BITS):
    _a.flags.writeable = False


class AttentionPlan:
    """One decode attention's fixed decisions: built by :func:`attention_plan`, run per step.

    Attributes
    ----------
    device : {"cpu", "cuda"}
    paged : bool
        Paged pools read through a page table (else flat ``[n_g, capacity, ·]`` arrays).
    n_g, rows, d : int
        KV rows (batch·KV heads, or sequences·KV heads), query rows per KV row (GQA group ×
        q_len) and head_dim.
    variant : {"cpu", "block", "warp", "mma"}
        The kernel that runs (``mma`` falls back to ``warp`` where arrays give no word views).
    threads : int
        CUDA threads per block (0 on the CPU).
    rotate_q : bool
        The partition kernel rotates the queries in its prologue where a step asks for it
        (CUDA, the ``cuda_fused_query_rotation`` knob): no rotation launch.
    """

    def __init__(self, like: Any, *, paged: bool, n_g: int, rows: int, d: int, klayout: CodeLayout | None,
                 vlayout: CodeLayout | None, v_width: int, has_bias: bool = False, has_qjl: bool = False) -> None:
        dev = _backend.device_of("q", like)
        if d % 32 or d <= 0:
            raise ValueError(f"q: expected head_dim a positive multiple of 32, got {d}")
        if dev == _backend.CUDA:
            check_cuda_head_dim(d)
        compressed = klayout is not None
        self.device, self.paged, self.compressed = dev, bool(paged), compressed
        self.n_g, self.rows, self.d = int(n_g), int(rows), int(d)
        self.has_bias, self.has_qjl = bool(has_bias), bool(has_qjl)
        # the warp kernel stages each token's packed V bytes: at most VROW per token
        warp = use_warp_kernel(dev, d, has_bias, has_qjl) and (not compressed or v_width <= VROW)
        # head VQ layouts (flat: pools store no VQ code) run the warp and tensor-core kernels' VQ builds
        vq = compressed and not paged and (klayout.group > 1 or vlayout.group > 1)
        mma = compressed and warp and use_mma_kernel(dev, d, has_bias, has_qjl, klayout, vlayout)
        self.variant = "mma" if mma else "warp" if warp else "block" if dev == _backend.CUDA else "cpu"
        self._fallback = DECODE_ATTENTION_WARP_VQ if vq else _KERNELS[self.paged]["warp"]  # (no word views)
        self.kernel = (MMA_TWINS[d, self.paged, vq] if mma else self._fallback if vq and warp
                       else _KERNELS[self.paged][self.variant])
        self.threads = cuda_block_threads() if dev == _backend.CUDA else 0
        #: the partition kernel's last block merges (CUDA, the ``cuda_merge_last_block`` knob):
        #: no MERGE_PARTITIONS launch
        self.merge_last = dev == _backend.CUDA and bool(_config.get("cuda_merge_last_block"))
        #: the partition kernel rotates the raw queries in its prologue (CUDA, the
        #: ``cuda_fused_query_rotation`` knob): no rotation launch, no rotated copy
        self.rotate_q = dev == _backend.CUDA and bool(_config.get("cuda_fused_query_rotation"))
        #: the tensor-core kernel's partitions follow the wave model (the ``cuda_wave_partitions``
        #: knob; :meth:`partition_size`), with :meth:`resident_blocks` per kernel here
        self.wave_partitions = dev == _backend.CUDA and bool(_config.get("cuda_wave_partitions"))
        #: the compute capability of the plan's GPU (``None`` on the CPU and in the simulator):
        #: the partition kernel's build for it runs (``Twin.build_for``: the tensor-core
        #: kernels' sm_90 builds)
        self.cc = tuple(cuda.get_current_device().compute_capability) if (
            dev == _backend.CUDA and not _backend.simulator_enabled()) else None
        self._resident: dict[Any, int | None] = {}
        c = self._const = lambda a: _backend.constant(like, a)  # noqa: E731
        if compressed:
            self.layout_args = (c(klayout.centroids), c(vlayout.centroids), c(klayout.bits), c(klayout.offsets),
                                c(vlayout.bits), c(vlayout.offsets))
            self.sshift = klayout.scale_shift
        else:
            self.layout_args = (c(_FLOAT_CENT), c(_FLOAT_CENT)) + (c(_FLOAT_BITS),) * 4
            self.sshift = 0
        self.table, self.signs = c(F16_ABS_TABLE), c(SIGNS32)
        self.no_bias = c(_NO_BIAS)
        self.no_qjl = tuple(c(a) for a in _NO_QJL) + (np.float32(0.0),)
        self.no_scales = c(_NO_SCALES)
        if paged:
            self.no_pos, self.no_pool_scales = c(_NO_POS), c(_NO_POOL_SCALES)
        else:
            self.no_pages = (*(c(a) for a in _NO_PAGES), 1, 1)
        self._ws = threading.local()

    # --- geometry ---------------------------------------------------------------------------
    def partition_size(self, n_tokens: int, kernel: Any = None, n_exact: int = 0,
                       launch_args: Callable[[], tuple] | None = None) -> int:
        """Tokens per split-K partition for a KV row of ``n_tokens`` tokens (``kernel``: the
        twin that runs, default the plan's; ``n_exact``: the row's exact tokens, whose
        partitions share the grid).  The tensor-core kernel on a GPU sizes its partitions by
        the wave model over its resident blocks (:func:`~numba_kv.ops.attention.mma.mma_partition_size`,
        the ``cuda_wave_partitions`` knob), which :meth:`resident_blocks` counts from the
        arguments ``launch_args()`` returns (called once per plan and kernel)."""
        kernel = kernel or self.kernel
        if "_mma" in kernel.name and not _backend.simulator_enabled():
            chunks = -(-self.rows // WARP_ROWS)
            resident = None
            if self.wave_partitions and launch_args is not None:
                resident = self.resident_blocks(kernel, launch_args)
            return mma_partition_size(max(n_tokens, 1), self.n_g * chunks, max(n_exact, 0), resident)
        return default_partition_size(max(n_tokens, 1), self.n_g, self.device, self.variant in ("warp", "mma"))

    def resident_blocks(self, kernel: Any, launch_args: Callable[[], tuple]) -> int | None:
        """Blocks of ``kernel``'s CUDA build that the device holds at once.

        The driver's occupancy of the overload that ``launch_args()`` selects, at
        :data:`~numba_kv.ops.attention.mma.MMA_THREADS` threads, times the SMs (FlashInfer's
        ``max_grid_size``).  Compiles that overload, which the launch then reuses; counted
        once per plan and CUDA build (:meth:`~numba_kv.ops._registry.Twin.build_for` of the
        plan's compute capability).

        Parameters
        ----------
        kernel : Twin
            The partition kernel's twin.
        launch_args : callable
            Returns the launch's arguments (arrays and scalars of the types the launch passes:
            a ``[n_g, rows, d]`` float32 query array first, …); called only when the count is
            not known yet.

        Returns
        -------
        int or None
            The resident blocks; ``None`` where the driver cannot say (then the partition rule
            without waves applies).
        """
        dispatcher = key = kernel.build_for(self.cc)  # (per build: an A/B swaps another into the twin)
        if key not in self._resident:
            try:
                compiled = dispatcher.compile(tuple(dispatcher.typeof_pyval(a) for a in launch_args()))
                n = int(compiled.max_cooperative_grid_blocks(MMA_THREADS))
            except Exception:  # noqa: BLE001 - no occupancy (an old driver, a failed query): no waves
                n = 0
            self._resident[key] = n if n > 0 else None
        return self._resident[key]

    def grid(self, kernel: Any, n_parts: int) -> tuple | None:
        """CUDA launch geometry of the partition kernel (``None`` on the CPU): the block
        kernels' ``(n_g, n_parts, row chunks)``, the warp kernels' ``(n_g, ceil(n_parts /
        warps per block), ceil(rows / WARP_ROWS))``; y and z checked (:func:`check_grid`)."""
        if self.device != _backend.CUDA:
            return None
        threads = self.threads
        if "_mma" in kernel.name:
            # its launch bounds; in the simulator one warp per block (its simulated warp
            # primitives need every lane of a block together)
            threads = 32 if _backend.simulator_enabled() else MMA_THREADS
        per_block = threads // 32 if self.variant in ("warp", "mma") else 1
        rows = WARP_ROWS if self.variant in ("warp", "mma") else rows_per_block(self.d)
        return check_grid((self.n_g, -(-n_parts // per_block), -(-self.rows // rows)), n_parts, self.rows), threads

    def workspace(self, like: Any, n_parts: int) -> tuple:
        """``(part_m, part_l, part_acc)`` for ``n_parts`` partitions, reused from step to step (the partition
        kernel writes every entry before the merge reads it); kept per thread and launch stream (streams run at
        once) for the last :data:`WORKSPACES` counts: layers of one shape and other capacities that alternate
        neither allocate nor change a launch (a CUDA graph)."""
        bufs, key = self._ws.__dict__.setdefault("bufs", {}), (_backend.launch_stream_state()[1], n_parts)
        ws = bufs.pop(key, None)  # (put back last below: the most recently used)
        if ws is None:
            while len(bufs) >= WORKSPACES:
                bufs.pop(next(iter(bufs)))
            shape = (self.n_g, n_parts, self.rows)
            ws = (_backend.empty(like, shape, np.float32), _backend.empty(like, shape, np.float32),
                  _backend.empty(like, (*shape, self.d), np.float32))
        bufs[key] = ws
        return ws

    def merge_counter(self, like: Any) -> Any:
        """The arrival counters of the last-block merge (int32, one per KV row and row chunk;
        per thread and launch stream like :meth:`workspace`): zeroed once here, left zero by
        every launch (the merging block resets its own), so a step needs no memset launch."""
        handle = _backend.launch_stream_state()[1]
        key = ("counter", handle) if handle else "counter"  # (the default stream's: an attribute)
        mine = self._ws.__dict__
        if key not in mine:
            mine[key] = _backend.zeros(like, (self.n_g * self.rows,), np.int32)
        return mine[key]

    def _run(self, like: Any, kernel: Any, args: tuple, n_parts: int, n_rot: int, head_signs: Any, parts: tuple,
             work: int, rotate_q: bool = False, out: Any = None) -> Any:
        """Launch the partition kernel, then (unless its last block merges) the merge; returns
        ``out`` ``[n_g, rows, d]`` (a new array unless given).  ``rotate_q``: the kernel
        rotates the raw queries itself."""
        if out is None:
            out = _backend.empty(like, (self.n_g, self.rows, self.d), np.float32)
        head_rot = head_signs is not None
        merge = (int(n_rot), self.signs, head_rot, head_signs if head_rot else self.signs, out)
        kernel.launch(self.device, self.n_g * n_parts, *args, self.merge_last, *merge, self.merge_counter(like),
                      bool(rotate_q), work=work, grid=self.grid(kernel, n_parts), cc=self.cc)
        if not self.merge_last:
            mgrid = ((self.n_g, self.rows), self.threads) if self.device == _backend.CUDA else None
            MERGE_PARTITIONS.launch(self.device, self.n_g * self.rows, *parts, *merge,
                                    work=self.n_g * self.rows * self.d * n_parts, grid=mgrid)
        return out

    # --- a step ------------------------------------------------------------------------------
    def bind_flat(self, kc: Any, ks: Any, vc: Any, vs: Any, comp_pos0: int, ke: Any, ve: Any, exact_pos: Any,
                  head_signs: Any = None, exact_rotated: bool = False, exact_scales: tuple | None = None,
                  scale_table: Any = None) -> FlatStep:
        """A flat cache layer's arrays bound to this plan: a :class:`FlatStep` whose
        :meth:`~FlatStep.run` takes only what changes from step to step.

        Parameters
        ----------
        kc, ks, vc, vs, comp_pos0, ke, ve, exact_pos, head_signs, exact_rotated, exact_scales
            As for :meth:`run_flat`.  The arrays are bound by identity: their contents may
            change between steps (the cache writes new tokens and positions into them), the
            objects may not (a cache that regrows a buffer binds again).  ``exact_pos`` may be
            longer than the exact tokens of a step (the kernels read its first ``n_exact``).
        scale_table : float32 array, optional
            The table the compressed scales are read through, on the plan's device (default
            ``F16_ABS_TABLE``); uint8 scale planes (8-bit norms) need the layer's
            :func:`~numba_kv.ops.norm8.norm8_scale_table`.
        """
        return FlatStep(self, kc, ks, vc, vs, comp_pos0, ke, ve, exact_pos, head_signs, exact_rotated, exact_scales,
                        scale_table)

    def run_flat(self, qr: Any, q: Any, kc: Any, ks: Any, vc: Any, vs: Any, n_comp: int, comp_pos0: int, ke: Any,
                 ve: Any, n_exact: int, exact_pos: Any, softmax_scale: float, bias: Any, q_pos0: int, q_len: int,
                 causal: bool = True, part_size: int | None = None, head_signs: Any = None, qjl: Any = None,
                 exact_rotated: bool = False, exact_scales: tuple | None = None) -> Any:
        """One step over a flat cache's arrays (the arguments of :func:`.flat.fused_attention_rows`, which
        validates nothing either); returns ``out`` ``[n_g, rows, d]`` float32 on the device of ``qr``.  A
        cache that decodes step after step binds its arrays once instead (:meth:`bind_flat`)."""
        step = self.bind_flat(kc, ks, vc, vs, comp_pos0, ke, ve, exact_pos, head_signs, exact_rotated, exact_scales)
        return step.run(qr, q, n_comp, n_exact, q_pos0, q_len, softmax_scale, bias, qjl, part_size, causal)

    def run_paged(self, qr: Any, q3: Any, pools: tuple, page_table: tuple, page_size: int, n_kv_heads: int,
                  max_len: int, total_len: int, n_seq: int, softmax_scale: float, q_len: int, causal: bool,
                  part_size: int | None = None, rotate_q: bool = False, out: Any = None) -> Any:
        """One step over paged pools ``(kc, ks, vc, vs, kp, vp)`` (placeholders for the kind not used) read
        through ``page_table`` ``(kv_indptr, kv_indices, kv_last_page_len)``; ``max_len``/``total_len``: the
        longest sequence's and all sequences' tokens.  ``rotate_q``: ask the partition kernel to rotate the
        queries of compressed pools per 32-block in its prologue (no rotation launch; :attr:`rotate_q` says
        whether it does, and then ``qr`` may be ``q3`` itself).  ``out``: a C-contiguous float32
        ``[n_g, rows, d]`` array on the plan's device to write into (default: a new one)."""
        kernel = self.kernel
        if self.variant == "mma":
            # (the tensor-core tiles read a tile's page once, a token's slot by a shift: pages of
            # a power of two >= 16 tokens, partitions of whole tiles; mma_partition_size's are)
            fits = (page_size >= MMA_TILE and page_size & (page_size - 1) == 0
                    and (part_size is None or part_size % MMA_TILE == 0))
            words = mma_operands(*pools[:4], flat=False) if fits else None
            if words is None:
                kernel = self._fallback
            else:
                pools = (*words, *pools[4:])
        kc, ks, vc, vs, kp, vp = pools
        # a flat cache's kernel arguments with the page table: a pool of codes is all compressed
        # partitions, a float32 pool is read as exact tokens at positions 0, 1, …
        sq, qsig, qnorm, qconst = self.no_qjl

        def args_for(part_size: int, n_parts: int, parts: tuple) -> tuple:
            return (qr, q3, kc, ks, vc, vs, 0, 0, kp, vp, 0, self.no_pos, self.no_pool_scales, self.no_pool_scales,
                    EXACT_F32, *self.layout_args, self.sshift, self.table, np.float32(softmax_scale), self.no_bias,
                    False, False, sq, qsig, qnorm, qconst, 0, int(q_len), bool(causal), int(part_size),
                    n_parts if self.compressed else 0, *page_table, int(page_size), int(n_kv_heads), *parts)

        if part_size is None:
            # (the probe's arguments for the occupancy: the launch's, with a one-partition
            # workspace and the merge's arguments as _run passes them)
            part_size = self.partition_size(max_len, kernel, 0, lambda: (
                *args_for(TILE, 1, self.workspace(q3, 1)), self.merge_last, 1, self.signs, False, self.signs,
                _backend.empty(q3, (1, 1, 1), np.float32), self.merge_counter(q3),
                bool(rotate_q and self.rotate_q and self.compressed)))
        n_parts = max(1, -(-max_len // part_size))
        parts = self.workspace(q3, n_parts)
        args = args_for(part_size, n_parts, parts)
        work = self.n_g * self.rows * self.d * total_len // max(n_seq, 1)
        return self._run(q3, kernel, args, n_parts, n_parts if self.compressed else 0, None, parts, work,
                         rotate_q and self.rotate_q and self.compressed, out)

    def _exact_args(self, ke: Any, ve: Any, exact_scales: tuple | None) -> tuple:
        """``(ke, ve, kes, ves, exact_kind)`` of the fused kernel for exact tokens stored as
        float32, binary16 (``float16`` or its ``uint16`` bit patterns) or int8 (with
        ``exact_scales`` = the per-token binary16 scales ``[n_g, >= n_exact, 1]`` uint16)."""
        dt = np.dtype(ke.dtype)
        if dt == np.int8:
            if exact_scales is None:
                raise ValueError("exact_scales: int8 exact tokens need their binary16 scales, got None")
            return ke, ve, exact_scales[0], exact_scales[1], EXACT_I8
        if dt == np.float32:
            return ke, ve, self.no_scales, self.no_scales, EXACT_F32
        if dt == np.float16:
            ke, ve = ke.view(np.uint16), ve.view(np.uint16)
            dt = np.dtype(np.uint16)
        if dt == np.uint16:
            return ke, ve, self.no_scales, self.no_scales, EXACT_F16
        raise TypeError(f"k_exact: expected float32, float16 (or its uint16 bits) or int8 tokens, got {dt}")


def _rotate_into(kind: int, q_in: Any, signs: Any, out: Any) -> None:
    """``out`` ``[n, d]`` ← ``q_in`` rotated as :meth:`FlatStep.run`'s ``rotate`` says
    (op by op: the path of a GPU step or of a step above the serial threshold)."""
    if kind == ROTATE_HEAD:
        rotate_head_rows(q_in, False, out)
    elif kind:  # as rotate32_rows, into ``out``
        n, d = (int(x) for x in q_in.shape)
        TWINS["rotate32"].launch(_backend.device_of("x", q_in), n * (d // 32), q_in, signs, False, out, work=n * d)


class FlatStep:
    """A flat cache layer's decode step bound to its :class:`AttentionPlan`
    (:meth:`AttentionPlan.bind_flat`): the static part of the partition kernel's and the
    merge's arguments (the layer's arrays, the plan's device constants and placeholders) is
    built once, so a step hands over only its queries, token counts and positions.

    It holds no workspace: the partial results live in the plan's per-thread workspace
    (:meth:`AttentionPlan.workspace`), so two threads running one step at once (two layers
    of one shape) never share them.  A cache keeps one per layer, binds again when a bound
    array is replaced (:meth:`bound_to`), and runs it under the layer's lock.

    Parameters
    ----------
    plan : AttentionPlan
        The plan of the layer's device and shape.
    kc, ks, vc, vs, comp_pos0, ke, ve, exact_pos, head_signs, exact_rotated, exact_scales, scale_table
        The layer's arrays and flags, as for :meth:`AttentionPlan.bind_flat` (shapes and dtypes
        there).
    """

    __slots__ = ("_bound", "_exact_rotated", "_host", "_kernel", "_merge_static", "_mid", "_no_qjl", "_out_shape",
                 "_scale", "_views", "capacity", "comp_pos0", "plan")

    def __init__(self, plan: AttentionPlan, kc: Any, ks: Any, vc: Any, vs: Any, comp_pos0: int, ke: Any, ve: Any,
                 exact_pos: Any, head_signs: Any, exact_rotated: bool, exact_scales: tuple | None,
                 scale_table: Any = None) -> None:
        self.plan = plan
        self._bound = (kc, ks, vc, vs, ke, ve, exact_pos, head_signs,
                       None if exact_scales is None else exact_scales[0],
                       None if exact_scales is None else exact_scales[1])
        kernel = plan.kernel
        #: the compressed tokens the bound codes hold room for: the partitions of a step that
        #: reads its count on the device cover them all (:meth:`run`)
        self.capacity = int(kc.shape[1])
        if plan.variant == "mma":  # the tensor-core kernel reads the codes as 32-bit words
            words = mma_operands(kc, ks, vc, vs, flat=True, norm8=(32 << plan.sshift) >= plan.d)
            if words is None:
                kernel = plan._fallback  # noqa: SLF001 - the plan's own fallback twin
            else:  # (8-bit norms: the VQ build reads them, one scale a token)
                kc, ks, vc, vs = words
                kernel = MMA_TWINS[plan.d, False, True] if np.dtype(ks.dtype) == np.uint8 else kernel
        self._kernel = kernel
        self.comp_pos0 = int(comp_pos0)
        ke, ve, kes, ves, exact_kind = plan._exact_args(ke, ve, exact_scales)  # noqa: SLF001
        # the kernel's arguments between the per-step ones (see run)
        self._mid = ((kc, ks, vc, vs), (self.comp_pos0, ke, ve),
                     (exact_pos, kes, ves, exact_kind, *plan.layout_args, plan.sshift,
                      plan.table if scale_table is None else scale_table))
        sq, qsig, qnorm, qconst = plan.no_qjl
        self._no_qjl = (plan.no_bias, False, False, sq, qsig, qnorm, np.float32(qconst))
        head_rot = head_signs is not None
        self._merge_static = (plan.signs, head_rot, head_signs if head_rot else plan.signs)
        self._exact_rotated = bool(exact_rotated)
        # a NumPy plan allocates its output with NumPy directly
        self._host = plan.device == _backend.CPU and isinstance(kc, np.ndarray)
        self._out_shape = (plan.n_g, plan.rows, plan.d)
        self._scale = (None, None)  # the last softmax scale and its float32
        self._views: dict = {}  # the same views of the same query arrays (a repeated launch)

    @property
    def exact_pos(self) -> Any:
        """The bound position buffer of the exact tokens."""
        return self._bound[6]

    def bound_to(self, plan: AttentionPlan, *arrays: Any) -> bool:
        """Whether this step was bound by ``plan`` to exactly these objects (``kc, ks, vc,
        vs, ke, ve, exact_pos, head_signs, k exact scales, v exact scales``; identity)."""
        return plan is self.plan and len(arrays) == len(self._bound) and all(map(operator.is_, arrays, self._bound))

    def _cpu_part_size(self, n_tok: int, kernel: Any) -> int:
        """The partition length of a CPU step: a row of at most 4 tiles is one partition
        whatever the thread count (:func:`default_partition_size`'s floor: no thread-count
        read for short caches)."""
        return 4 * TILE if n_tok <= 4 * TILE else self.plan.partition_size(n_tok, kernel)

    def run(self, qr: Any, q: Any, n_comp: int, n_exact: int, q_pos0: int, q_len: int, softmax_scale: float,
            bias: Any = None, qjl: Any = None, part_size: int | None = None, causal: bool = True,
            rotate: tuple | None = None, out: Any = None, n_comp_dev: Any = None) -> Any:
        """One step: ``out`` ``[n_g, rows, d]`` float32 on the plan's device (a new array, or
        the ``out`` given: C-contiguous float32 of that shape, written in place, so that a
        step allocates nothing).

        Parameters
        ----------
        qr, q : arrays ``[n_g, rows, d]`` float32
            Rotated and raw queries of this step (``q`` may be ``qr`` itself).
        n_comp, n_exact : int
            Live compressed and exact tokens.
        q_pos0, q_len : int
            Position of the first query row's token and the queries per KV row.
        softmax_scale : float
        bias, qjl, part_size, causal
            As for :meth:`AttentionPlan.run_flat`.
        rotate : ``(kind, q_in, signs)``, optional
            Fill ``qr`` (C-contiguous) first: ``q_in`` ``[n_g·rows, d]`` float32 rotated over the whole head with
            ``signs`` (``kind`` = :data:`~numba_kv.ops.attention.step_cpu.ROTATE_HEAD`, as
            :func:`~numba_kv.ops.headquant.rotate_head_rows`) or per 32-block
            (:data:`~numba_kv.ops.attention.step_cpu.ROTATE_BLOCK`, as :func:`~numba_kv.ops.hadamard.rotate32_rows`
            with ``signs`` = ``SIGNS32``).  A NumPy step then is one compiled call, its partitions serial or (from
            the ``cpu_parallel_min_work`` knob's work on) in parallel
            (:func:`~numba_kv.ops.attention.step_cpu.flat_step_serial` /
            :func:`~numba_kv.ops.attention.step_cpu.flat_step_parallel`), with the same bits. On a GPU the partition
            kernel rotates the queries itself in its prologue (no rotation launch, ``qr`` not written; the plan's
            :attr:`~AttentionPlan.rotate_q`, the ``cuda_fused_query_rotation`` knob) when ``kind`` is the bound
            rotation (``ROTATE_HEAD`` with ``head_signs``, ``ROTATE_BLOCK`` without); ``signs`` must then be those
            the merge rotates back with (the bound ``head_signs``, or ``SIGNS32``), which the kernel reads instead.
        out : array ``[n_g, rows, d]`` float32, optional
            Written instead of a new array (C-contiguous, on the plan's device, not
            overlapping ``qr``/``q``; the caller checked it).
        n_comp_dev : int32 array ``[1]``, optional
            On the plan's device, holding ``n_comp`` when the kernel runs (written there by an earlier launch of the
            step): the kernel reads the count from it instead of an argument that changes every step (a CUDA graph
            replays the launch, issue 27).  The partition size, the compressed partitions and so the grid and the
            workspace then follow the codes' :attr:`capacity`, not ``n_comp``: the partitions past the live count
            (read on the device) store empty partials (``m = -inf``), which the merge skips, and still count their
            arrival for the last-block merge, so the launch stays the same until the codes grow (new addresses:
            bound again).  Not on the host's one-call path.
        """
        plan = self.plan
        n_comp, n_exact = int(n_comp), int(n_exact)
        kernel = self._kernel
        if n_comp <= 0 and n_exact <= 0:
            raise ValueError("k: expected at least one stored token to attend over, got none")
        # the compressed tokens the partitions cover: the live ones, or (count on the device) every
        # slot, so the partitions and grid stay when the count crosses a boundary (a CUDA graph)
        n_span = n_comp if n_comp_dev is None else max(self.capacity, n_comp)
        n_tok = n_span if n_span > n_exact else n_exact
        last, scale32 = self._scale
        if softmax_scale != last or last is None:
            scale32 = np.float32(softmax_scale)
            self._scale = (softmax_scale, scale32)
        if bias is None and qjl is None:
            extra = self._no_qjl
        else:
            sq, qsig, qnorm, qconst = plan.no_qjl if qjl is None else qjl
            extra = (plan.no_bias if bias is None else bias, bias is not None, qjl is not None, sq, qsig, qnorm,
                     np.float32(qconst))
        codes, comp, exact = self._mid
        dev, n_g, rows, d = plan.device, plan.n_g, plan.rows, plan.d
        work = n_g * rows * d * (n_comp + n_exact)
        if self._host and rotate is not None:
            # the whole step in one call: its partitions serially below the parallel threshold,
            # in parallel above it (the rotation and the merge, a few microseconds, stay serial)
            part_size = int(self._cpu_part_size(n_tok, kernel) if part_size is None else part_size)
            n_cp = -(-n_span // part_size)
            n_parts = n_cp + -(-n_exact // part_size)
            parts = plan.workspace(qr, n_parts)
            parallel = max(work, n_g * rows * d * n_parts) >= _config.get("cpu_parallel_min_work")
            if out is None:
                out = np.empty(self._out_shape, np.float32)
            (flat_step_parallel if parallel else flat_step_serial)(
                rotate[0], rotate[1], rotate[2], qr.reshape(n_g * rows, d), qr, q, *codes, n_comp, *comp, n_exact,
                *exact, scale32, *extra, int(q_pos0), int(q_len), bool(causal), part_size, n_cp, *plan.no_pages,
                *parts, n_parts if self._exact_rotated else n_cp, *self._merge_static, out)
            return out
        rotate_q = rotate is not None and plan.rotate_q and (rotate[0] == ROTATE_HEAD) == self._merge_static[1]
        if rotate_q:  # the kernel's prologue rotates the raw queries (issue 27: no rotation launch)
            qr = q = _backend.same_view(self._views, "q", rotate[1], lambda a: a.reshape(self._out_shape))
        elif rotate is not None:
            _rotate_into(*rotate, _backend.same_view(self._views, "qr", qr, lambda a: a.reshape(n_g * rows, d)))
        if out is None and self._host:
            out = np.empty(self._out_shape, np.float32)
        elif out is None:
            out = _backend.empty(qr, self._out_shape, np.float32)
        pages = plan.no_pages
        if n_comp_dev is not None:  # the count on the device: 0 by value (cores._flat_row adds them)
            pages, n_comp = (*pages[:2], n_comp_dev, *pages[3:]), 0

        def args(part_size: int, n_cp: int, parts: tuple, n_rot: int) -> tuple:
            # the merge rotates partitions [0, n_rot) back: the compressed ones, and the exact
            # ones too when they were attended in the rotated domain; on a GPU the partition
            # kernel's last block runs it (plan.merge_last), else a launch of its own
            return (qr, q, *codes, n_comp, *comp, n_exact, *exact, scale32, *extra, int(q_pos0), int(q_len),
                    bool(causal), part_size, n_cp, *pages, *parts, plan.merge_last, n_rot, *self._merge_static, out,
                    plan.merge_counter(qr), rotate_q)

        if part_size is None:
            part_size = self._cpu_part_size(n_tok, kernel) if dev == _backend.CPU else plan.partition_size(
                n_tok, kernel, n_exact, lambda: args(TILE, 1, plan.workspace(qr, 1), 1))
        part_size = int(part_size)
        n_cp = -(-n_span // part_size)
        n_parts = n_cp + -(-n_exact // part_size)
        parts = plan.workspace(qr, n_parts)
        merge = (n_parts if self._exact_rotated else n_cp, *self._merge_static, out)
        kernel.launch(dev, n_g * n_parts, *args(part_size, n_cp, parts, merge[0]), work=work,
                      grid=plan.grid(kernel, n_parts), cc=plan.cc)
        if not plan.merge_last:
            MERGE_PARTITIONS.launch(dev, n_g * rows, *parts, *merge, work=n_g * rows * d * n_parts,
                                    grid=((n_g, rows), plan.threads) if dev == _backend.CUDA else None)
        return out


_PLANS: dict[tuple, AttentionPlan] = {}
#: plans kept (least recently used dropped first)
MAX_PLANS = 1024
_PLANS_LOCK = threading.Lock()


def attention_plan(like: Any, *, paged: bool, n_g: int, rows: int, d: int, klayout: CodeLayout | None,
                   vlayout: CodeLayout | None, v_width: int, has_bias: bool = False,
                   has_qjl: bool = False) -> AttentionPlan:
    """The :class:`AttentionPlan` for these shapes on the device of ``like`` (cached).

    Parameters
    ----------
    like : array
        Any array on the plan's device (its device copies of the constants go there).
    paged : bool
        Paged pools (``True``) or flat ``[n_g, capacity, ·]`` arrays.
    n_g, rows, d : int
        KV rows, query rows per KV row and head_dim.
    klayout, vlayout : CodeLayout or None
        Layouts of the K and V codes; ``None`` for float32 paged pools.
    v_width : int
        Packed bytes per V vector (the warp kernels stage at most 64).
    has_bias, has_qjl : bool
        A logit bias or TurboQuant's QJL correction will be passed (only the block kernels
        apply them).

    Returns
    -------
    AttentionPlan
        Cached per arguments and, on a GPU, per device and the CUDA knobs that choose the
        kernel (the arguments are ints and bools as given: a NumPy integer keys like an int).

    Raises
    ------
    ValueError
        ``d`` not a positive multiple of 32, or beyond the CUDA kernels' shared memory.
    """
    if isinstance(like, np.ndarray):
        # (the CPU partition size follows the live Numba thread count at each step: no key)
        env = None
    else:
        _backend.device_of("q", like)
        env = (id(_backend.constant(like, F16_ABS_TABLE)), _backend.simulator_enabled(), cuda_block_threads(),
               _config.get("cuda_warp_attention"), _config.get("cuda_mma_attention"),
               _config.get("cuda_merge_last_block"), _config.get("cuda_fused_query_rotation"),
               _config.get("cuda_wave_partitions"))
    key = (env, paged, n_g, rows, d, klayout, vlayout, v_width, has_bias, has_qjl)
    with _PLANS_LOCK:  # layers call from several threads: one plan per key
        plan = _PLANS.pop(key, None)
        if plan is None:
            while len(_PLANS) >= MAX_PLANS:  # the least recently used goes (shapes of long-gone models)
                _PLANS.pop(next(iter(_PLANS)))
            plan = AttentionPlan(like, paged=paged, n_g=n_g, rows=rows, d=d, klayout=klayout, vlayout=vlayout,
                                 v_width=v_width, has_bias=has_bias, has_qjl=has_qjl)
        # most recently used last: a plan in use is never the one dropped (dropping it would
        # bind its layers again: a new workspace, and a CUDA graph of their step captured again)
        _PLANS[key] = plan
    return plan
