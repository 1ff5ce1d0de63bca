"""The machine code (SASS) of the CUDA kernels, found without a GPU: how many instructions
the loop that walks the tokens costs per token, and of which kind.

:mod:`numba_kv._cuda_resources` compiles a registered kernel's PTX with nvJitLink (ptxas in
process); the same run yields a cubin, which ``nvdisasm`` (the PyPI package
``nvidia-cuda-nvdisasm``) turns into SASS text.  :func:`parse_sass` reads that text,
:func:`find_loops` finds the loops of the kernel's entry function and
:func:`kernel_sass` puts it together with the registers and spills of the same ptxas run.

Loops.  The entry function is cut into basic blocks (a block ends at a branch, ``EXIT`` or
``RET``; a branch target or the instruction after a block end starts one).  A loop is a
natural loop: a back edge ``u → h`` is a branch whose target block ``h`` dominates ``u``,
and the loop of ``h`` is ``h`` with every block that reaches a back edge's source without
passing ``h``.  Two kinds of edge are left out, so that what remains is the code a
converged warp runs:

* ``BRA.DIV`` jumps to the slow path of a warp-synchronous instruction (a shuffle, a vote)
  for a warp that is not converged; ptxas places it after the function and branches back
  into the loop from there.  The kernels call those instructions with the whole warp, so
  that path is never taken (counted, it would double every shuffle of the loop);
* code after ``EXIT`` that nothing reaches (``BRA`` to itself, the ``NOP`` padding).

Counts are static: every instruction of a loop's blocks once, whichever branch an
iteration takes, with nested loops counted once (not times their trip count).  A call
(``CALL``, e.g. to ptxas's 64-bit division ``__cuda_sm20_div_s64``) counts as one
instruction of class ``branch``; the callee's instructions are not added.

The hot loop, and "per token".  The rule is :func:`tile_loop`: the loop with the most
instructions, its nested loops included, among the loops before the kernel's first global
atomic (:func:`epilogue_start`), which in the decode attention kernels is the loop over the
token tiles (every other loop runs inside it or before/after it).  The atomic is the
partition kernels' arrival count: what follows it is the merge by the last block to finish
(``merge_if_last``), whose loop over its query rows runs once per launch in one block of a
row chunk, not per token, and is as large as some kernels' token loop.
:data:`TOKENS_PER_ITERATION` states, per kernel, how many tokens one pass of one warp
through that loop covers for one KV head; instructions per token per KV head are the
loop's static instructions divided by that.  A kernel without an entry gets its raw
per-iteration count.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ._cuda_resources import KernelResources, kernel_ptx, link_cubin, parse_link_log, ptx_max_threads

__all__ = ["CLASSES", "NVDISASM_PACKAGE", "TOKENS_PER_ITERATION", "Instruction", "KernelSass", "Loop",
           "SassFunction", "class_counts", "classify", "disassemble", "entry_function", "find_loops",
           "epilogue_start", "kernel_sass", "nvdisasm_path", "parse_sass", "tile_loop"]

#: the PyPI package that ships ``nvdisasm``
NVDISASM_PACKAGE = "nvidia-cuda-nvdisasm"

#: Tokens of one KV head that one warp's pass through the kernel's :func:`tile_loop` covers
#: (head_dim 128, 4 query rows per KV head, the default 128 threads per block), by kernel:
#:
#: * ``decode_attention_warp``: one warp walks its partition 32 tokens a tile (one token
#:   per lane in the score layout); the score, staging and ``p·v`` loops are nested inside;
#: * ``decode_attention``: a block walks 16 tokens a tile (``_tile_tokens(128)``) and its 4
#:   warps (128 threads) each pass through the loop once a tile: 4 tokens per warp pass;
#: * ``decode_attention_mma``: one warp, 16 tokens per iteration (tensor-core tiles; the
#:   ``_d64`` builds too, at head_dim 64).
TOKENS_PER_ITERATION: dict[str, float] = {
    "decode_attention_warp": 32.0,
    "decode_attention_warp_vq": 32.0,
    "decode_attention": 4.0,
    "decode_attention_mma": 16.0,
    "decode_attention_mma_vq": 16.0,
    "paged_decode_attention_mma": 16.0,
    "decode_attention_mma_d64": 16.0,
    "decode_attention_mma_vq_d64": 16.0,
    "paged_decode_attention_mma_d64": 16.0,
}

#: instruction classes, in report order (see :func:`classify`)
CLASSES = ("load.global", "load.shared", "load.const", "load.local", "store", "fp32", "mufu", "mma", "fp16",
           "int", "move", "shfl", "convert", "branch", "sync", "other")

_CLASS_OF = {
    "load.global": ("LDG", "LD", "LDGSTS", "LDGDEPBAR"),
    "load.shared": ("LDS", "LDSM"),
    "load.const": ("LDC",),
    "load.local": ("LDL", "STL"),
    "store": ("STG", "STS", "ST", "RED", "ATOM", "ATOMS", "ATOMG", "STSM"),
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "FSWZADD", "FFMA32I", "FMUL32I",
             "FADD32I"),
    "mufu": ("MUFU",),
    "mma": ("HMMA", "IMMA", "DMMA", "BMMA", "HGMMA", "IGMMA", "QGMMA", "BGMMA", "UTCHMMA", "UTCQMMA"),
    "fp16": ("HFMA2", "HADD2", "HMUL2", "HSETP2", "HMNMX2", "HSET2"),
    "int": ("IMAD", "IADD3", "IADD", "VIADD", "LOP3", "LOP", "SHF", "SHL", "SHR", "LEA", "ISETP", "SEL", "IMNMX",
            "VIMNMX", "PRMT", "IABS", "POPC", "FLO", "BREV", "BMSK", "SGXT", "IDP", "IMUL", "PLOP3", "P2R", "R2P",
            "ISCADD", "BFE", "BFI"),
    "move": ("MOV", "S2R", "CS2R", "S2UR", "R2UR", "MOVM", "MOV32I"),
    "shfl": ("SHFL",),
    "convert": ("F2F", "F2I", "I2F", "I2I", "F2FP", "FRND", "I2FP", "F2IP"),
    "branch": ("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "BREAK", "KILL", "BPT"),
    "sync": ("BAR", "WARPSYNC", "MEMBAR", "DEPBAR", "ERRBAR", "FENCE", "CCTL", "ENDCOLLECTIVE", "ELECT", "VOTE",
             "VOTEU", "MATCH", "REDUX", "SYNCS", "ARRIVES"),
}
_CLASS = {op: cls for cls, ops in _CLASS_OF.items() for op in ops}


def classify(opcode: str) -> str:
    """Class of an instruction (one of :data:`CLASSES`) from its opcode (``"IMAD.WIDE.U32"``).

    The opcode's first word decides (``LDG.E.64`` is ``load.global``), with two refinements:
    ``IMAD.MOV`` (ptxas's move on the integer pipe) is ``move``, and the uniform-datapath
    forms (``ULDC``, ``UIADD3``, ``UMOV``...) go with the operation they perform.  An
    opcode the table does not know is ``other``.
    """
    words = opcode.split(".")
    base = words[0]
    if base == "IMAD" and len(words) > 1 and words[1] == "MOV":
        return "move"
    if base not in _CLASS and base.startswith("U") and base[1:] in _CLASS:
        base = base[1:]
    return _CLASS.get(base, "other")


def class_counts(instructions: Iterable[Instruction]) -> dict[str, int]:
    """Instructions per class, every class of :data:`CLASSES` present (0 where none)."""
    counts = Counter(classify(ins.opcode) for ins in instructions)
    return {cls: counts[cls] for cls in CLASSES}


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction.

    Attributes
    ----------
    address : int
        Byte offset in its function.
    opcode : str
        Mnemonic with its modifiers (``"IMAD.WIDE.U32"``).
    guard : str
        Predicate guard (``"@!P0"``), ``""`` without one.
    operands : str
        The rest of the line up to the ``;``.
    """

    address: int
    opcode: str
    guard: str
    operands: str

    @property
    def target(self) -> str | None:
        """The label a branch names (``BRA `(.L_x_12)`` → ``".L_x_12"``), else ``None``."""
        if not self.opcode.startswith(("BRA", "BRX", "JMP", "CALL")):
            return None
        m = re.search(r"`\(([^)]+)\)", self.operands)
        return m.group(1) if m else None


@dataclass(frozen=True)
class SassFunction:
    """One function of a disassembled cubin.

    Attributes
    ----------
    name : str
        Its (mangled) symbol.
    instructions : tuple of Instruction
        In address order.
    labels : dict of str to int
        Address of every label in it.
    entry : bool
        Whether it is a kernel (``STO_CUDA_ENTRY``) rather than a called function.
    """

    name: str
    instructions: tuple[Instruction, ...]
    labels: dict[str, int] = field(default_factory=dict)
    entry: bool = False


_SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_LABEL = re.compile(r"^\s*([.$\w]+):\s*$")


def parse_sass(text: str) -> dict[str, SassFunction]:
    """The functions of a SASS listing.

    Parameters
    ----------
    text : str
        ``nvdisasm --print-code`` output: one ``.section .text.<name>`` per function, an
        instruction a line (``/*0040*/  @!P0 BRA `(.L_x_1) ;``), labels on their own line.

    Returns
    -------
    dict of str to SassFunction
        By name, in the order they appear.
    """
    raw: dict[str, tuple[list[Instruction], dict[str, int], list[bool]]] = {}
    name = None
    pending: list[str] = []
    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            name = m.group(1)
            raw[name] = ([], {}, [False])
            pending = []
            continue
        if name is None:
            continue
        instructions, labels, entry = raw[name]
        if "STO_CUDA_ENTRY" in line:
            entry[0] = True
        m = _INSTRUCTION.match(line)
        if m:
            address = int(m.group(1), 16)
            for label in pending:
                labels[label] = address
            pending = []
            instructions.append(Instruction(address, m.group(3), (m.group(2) or "").strip(), m.group(4).strip()))
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
    return {n: SassFunction(n, tuple(i), labels, e[0]) for n, (i, labels, e) in raw.items()}


def entry_function(functions: dict[str, SassFunction]) -> SassFunction:
    """The one kernel (``STO_CUDA_ENTRY``) among ``functions``; ``ValueError`` unless
    exactly one."""
    entries = [f for f in functions.values() if f.entry]
    if len(entries) != 1:
        raise ValueError(f"SASS: expected exactly one kernel (STO_CUDA_ENTRY), found {len(entries)}")
    return entries[0]


# --- control flow ----------------------------------------------------------------------------
def _ends_block(ins: Instruction) -> bool:
    return ins.opcode.split(".")[0] in ("BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "KILL")


def _conditional(ins: Instruction) -> bool:
    """Whether control may fall through ``ins`` (a guard other than ``@PT``, or a predicate
    operand as in ``BRA P1, `(.L)`` or ``BRA.U !UP0, `(.L)``)."""
    if ins.guard and ins.guard != "@PT":
        return True
    first = ins.operands.split(",")[0].strip()
    return bool(re.fullmatch(r"!?U?P[T0-9]+", first)) and "," in ins.operands


def _blocks(func: SassFunction) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Basic blocks of ``func`` as ``(first, last + 1)`` instruction index ranges, and the
    successors of each (``BRA.DIV`` edges left out: see the module docstring)."""
    ins = func.instructions
    index = {x.address: i for i, x in enumerate(ins)}
    leaders = {0}
    for i, x in enumerate(ins):
        if x.target is not None and x.target in func.labels and not x.opcode.startswith("CALL"):
            leaders.add(index[func.labels[x.target]])
        if _ends_block(x) and i + 1 < len(ins):
            leaders.add(i + 1)
    starts = sorted(leaders)
    ranges = [(s, e) for s, e in zip(starts, [*starts[1:], len(ins)], strict=True)]
    block_of = {s: b for b, (s, _) in enumerate(ranges)}
    succ: list[list[int]] = []
    for b, (_, e) in enumerate(ranges):
        last = ins[e - 1]
        out = []
        falls = not _ends_block(last) or _conditional(last) or last.opcode.startswith("BRA.DIV")
        if last.opcode.startswith(("BRA", "JMP")) and not last.opcode.startswith("BRA.DIV") \
                and last.target in func.labels and last.guard != "@!PT":
            out.append(block_of[index[func.labels[last.target]]])
        if falls and b + 1 < len(ranges):
            out.append(b + 1)
        succ.append(out)
    return ranges, succ


def _dominators(succ: list[list[int]]) -> tuple[list[int], dict[int, int]]:
    """Reverse postorder of the blocks reachable from block 0 and their immediate
    dominators (Cooper, Harvey & Kennedy, "A Simple, Fast Dominance Algorithm")."""
    order, seen, stack = [], {0}, [(0, iter(succ[0]))]
    while stack:
        node, it = stack[-1]
        nxt = next((s for s in it if s not in seen), None)
        if nxt is None:
            order.append(node)
            stack.pop()
        else:
            seen.add(nxt)
            stack.append((nxt, iter(succ[nxt])))
    order.reverse()
    rank = {b: i for i, b in enumerate(order)}
    preds: dict[int, list[int]] = {b: [] for b in order}
    for b in order:
        for s in succ[b]:
            preds[s].append(b)
    idom = {0: 0}
    changed = True
    while changed:
        changed = False
        for b in order[1:]:
            done = [p for p in preds[b] if p in idom]
            new = done[0]
            for p in done[1:]:
                a, c = p, new
                while a != c:
                    while rank[a] > rank[c]:
                        a = idom[a]
                    while rank[c] > rank[a]:
                        c = idom[c]
                new = a
            if idom.get(b) != new:
                idom[b] = new
                changed = True
    return order, idom


def _dominates(idom: dict[int, int], a: int, b: int) -> bool:
    while b != a and idom[b] != b:
        b = idom[b]
    return a == b


@dataclass(frozen=True)
class Loop:
    """A natural loop of a SASS function.

    Attributes
    ----------
    header : int
        Address of the loop's first instruction (the target of its back edges).
    instructions : tuple of Instruction
        Every instruction of its blocks, nested loops included, in address order.
    depth : int
        0 for an outermost loop, 1 for a loop inside one, ...
    parent : int or None
        Index (in :func:`find_loops`'s list) of the innermost loop around it.
    """

    header: int
    instructions: tuple[Instruction, ...]
    depth: int = 0
    parent: int | None = None

    @property
    def size(self) -> int:
        """Static instructions of one iteration (nested loops counted once)."""
        return len(self.instructions)

    def counts(self) -> dict[str, int]:
        """:func:`class_counts` of the loop's instructions."""
        return class_counts(self.instructions)


def find_loops(func: SassFunction) -> list[Loop]:
    """The natural loops of a function (rules in the module docstring).

    Parameters
    ----------
    func : SassFunction
        Usually :func:`entry_function` of a listing.

    Returns
    -------
    list of Loop
        Ordered by header address, each with its depth and the index of its parent; loops
        only reachable through ``BRA.DIV``, or not at all, are not in it.
    """
    ranges, succ = _blocks(func)
    order, idom = _dominators(succ)
    preds: dict[int, list[int]] = {b: [] for b in order}
    for b in order:
        for s in succ[b]:
            preds[s].append(b)
    bodies: dict[int, set[int]] = {}
    for u in order:
        for h in succ[u]:
            if _dominates(idom, h, u):
                body = bodies.setdefault(h, {h})
                work = [u]
                while work:
                    x = work.pop()
                    if x not in body:
                        body.add(x)
                        work.extend(preds[x])
    headers = sorted(bodies, key=lambda h: (len(bodies[h]), h))  # inner loops are smaller sets
    loops = []
    for h in sorted(bodies, key=lambda h: ranges[h][0]):
        inside = [func.instructions[i] for b in sorted(bodies[h]) for i in range(*ranges[b])]
        outer = [o for o in headers if o != h and bodies[h] < bodies[o]]
        loops.append((h, tuple(sorted(inside, key=lambda x: x.address)), outer))
    position = {h: i for i, (h, _, _) in enumerate(loops)}
    out = []
    for h, inside, outer in loops:
        parent = min(outer, key=lambda o: len(bodies[o])) if outer else None
        out.append(Loop(func.instructions[ranges[h][0]].address, inside, len(outer),
                        None if parent is None else position[parent]))
    return out


def tile_loop(loops: Sequence[Loop], before: int | None = None, needs: str | None = None) -> int | None:
    """Index of the hot loop of a kernel: the loop with the most instructions, nested loops
    included (the token-tile loop of the decode attention kernels), among those whose header
    lies before address ``before`` (default: all; :func:`epilogue_start`) and, with ``needs``
    (a class of :data:`CLASSES`), that hold an instruction of that class; ``None`` without
    such a loop.  Ties go to the first.  (``needs="mma"``: a tensor-core kernel's tile loop,
    which at head_dim 64 is smaller than the loop nest of its exact tokens.)"""
    cand = [i for i in range(len(loops)) if (before is None or loops[i].header < before)
            and (needs is None or any(classify(ins.opcode) == needs for ins in loops[i].instructions))]
    if not cand:
        return None
    return max(cand, key=lambda i: (loops[i].size, -i))


#: first words of the opcodes of a global atomic (the arrival count of the last-block merge)
_ATOMIC = ("ATOMG", "ATOM", "RED")


def epilogue_start(function: SassFunction) -> int | None:
    """Address of the first global atomic of ``function``: in the decode attention kernels
    the arrival count that opens the merge by the last block (``merge_if_last``), after
    their token loop; ``None`` without one."""
    for ins in function.instructions:
        if ins.opcode.split(".")[0] in _ATOMIC:
            return ins.address
    return None


# --- nvdisasm and the registered kernels -------------------------------------------------------
def nvdisasm_path() -> str:
    """Path of ``nvdisasm``: the one of the :data:`NVDISASM_PACKAGE` wheel, else one on
    ``PATH``.  ``FileNotFoundError`` (one line, naming the package) when there is none."""
    try:
        files = importlib.metadata.files(NVDISASM_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name in ("nvdisasm", "nvdisasm.exe"):
            path = str(f.locate())
            if os.access(path, os.X_OK):
                return path
    found = shutil.which("nvdisasm")
    if found is None:
        raise FileNotFoundError(f"nvdisasm not found: pip install {NVDISASM_PACKAGE} (or 'numba-kv[cuda]')")
    return found


def disassemble(cubin: bytes, nvdisasm: str | None = None) -> str:
    """SASS text of a cubin.

    Parameters
    ----------
    cubin : bytes
        An ELF cubin (:func:`numba_kv._cuda_resources.link_cubin`).
    nvdisasm : str, optional
        Path of ``nvdisasm``; default :func:`nvdisasm_path`.

    Returns
    -------
    str
        ``nvdisasm --print-code`` output (:func:`parse_sass` reads it).

    Raises
    ------
    RuntimeError
        With nvdisasm's message if it fails.
    """
    exe = nvdisasm or nvdisasm_path()
    with tempfile.TemporaryDirectory(prefix="numba_kv_sass_") as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        run = subprocess.run([exe, "--print-code", path], capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"nvdisasm failed ({run.returncode}): {run.stderr.strip()}")
    return run.stdout


@dataclass(frozen=True)
class KernelSass:
    """A registered kernel as ptxas builds it: resources, SASS and loops.

    Attributes
    ----------
    name : str
        Key of :data:`numba_kv.ops.TWINS`.
    cc : (int, int)
        Compute capability compiled for.
    resources : KernelResources
        Registers and spills of the same ptxas run.
    function : SassFunction
        The kernel's entry function.
    loops : list of Loop
        :func:`find_loops` of it.
    hot : int or None
        :func:`tile_loop` of ``loops`` before :func:`epilogue_start` of ``function``.
    """

    name: str
    cc: tuple[int, int]
    resources: KernelResources
    function: SassFunction
    loops: list[Loop]
    hot: int | None

    @property
    def tokens_per_iteration(self) -> float | None:
        """:data:`TOKENS_PER_ITERATION` of the kernel (``None`` if not stated)."""
        return TOKENS_PER_ITERATION.get(self.name)

    @property
    def per_token(self) -> float | None:
        """Static SASS instructions of the hot loop per token per KV head (``None`` when the
        kernel has no loop or no :data:`TOKENS_PER_ITERATION` entry)."""
        if self.hot is None or self.tokens_per_iteration is None:
            return None
        return self.loops[self.hot].size / self.tokens_per_iteration


@functools.cache
def kernel_sass(name: str, cc: tuple[int, int] = (9, 0), signature: int = 0) -> KernelSass:
    """Compile registered kernel ``name`` for ``sm_<cc>`` (nvJitLink, no GPU), disassemble
    it with ``nvdisasm`` and find its loops.

    Parameters
    ----------
    name : str
        A key of :data:`numba_kv.ops.TWINS`.
    cc : (int, int)
        Compute capability.
    signature : int
        Index into the twin's ``signatures``.

    Returns
    -------
    KernelSass
        Cached per argument tuple.

    Raises
    ------
    FileNotFoundError
        Without ``nvdisasm`` (:func:`nvdisasm_path`), checked before anything compiles.
    """
    exe = nvdisasm_path()
    ptx = kernel_ptx(name, tuple(cc), signature)
    cubin, log = link_cubin(ptx, tuple(cc))
    resources = dataclasses.replace(parse_link_log(log), max_threads=ptx_max_threads(ptx))
    function = entry_function(parse_sass(disassemble(cubin, exe)))
    loops = find_loops(function)
    hot = tile_loop(loops, epilogue_start(function), "mma" if "_mma" in name else None)
    return KernelSass(name, tuple(cc), resources, function, loops, hot)
