"""Execute the research notebooks in fresh kernels, optionally saving them with their outputs.

``make notebooks`` runs ``python notebooks/execute.py --save`` (every ``notebooks/NN_*.ipynb``,
outputs written back into the files); ``tests/test_notebooks.py`` calls :func:`execute_notebook`
without saving, so a cell that raises fails the test.

Every notebook runs in its own new ``python3`` kernel (the interpreter running this script,
through ``ipykernel``), with ``NUMBA_NUM_THREADS=2`` and ``OPENBLAS_NUM_THREADS=1`` unless the
environment sets them: the notebooks are sized and their speed numbers labelled for that.

``size="small"`` (``--size small``) sets ``NUMBA_KV_NOTEBOOK_SIZE=small`` for the kernel: the
heavy notebooks read it in their setup cell and run every cell on smaller inputs (fewer
tokens, fewer timing rounds), still past the same windows and page boundaries.  The test uses
it; the stored outputs are always the full size (``--save`` refuses ``small``).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent

#: Environment every notebook kernel gets unless the caller's environment already sets it.
KERNEL_ENV = {"NUMBA_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "1"}

#: Seconds one cell may run before the execution fails.
CELL_TIMEOUT_S = 600

#: The environment variable the notebooks read their size from, and its values.
SIZE_ENV = "NUMBA_KV_NOTEBOOK_SIZE"
SIZES = ("full", "small")


def notebook_paths(folder: Path = HERE) -> list[Path]:
    """The numbered notebooks of ``folder`` (``NN_*.ipynb``), in order."""
    return sorted(p for p in folder.glob("[0-9][0-9]_*.ipynb"))


def execute_notebook(path: str | Path, save: bool = False, timeout: int = CELL_TIMEOUT_S,
                     size: str = "full") -> nbformat.NotebookNode:
    """Run every cell of the notebook at ``path`` in a fresh kernel.

    Parameters
    ----------
    path : str or Path
        The ``.ipynb`` file.
    save : bool
        Write the executed notebook (with its outputs) back to ``path``.
    timeout : int
        Seconds per cell.
    size : {"full", "small"}
        ``NUMBA_KV_NOTEBOOK_SIZE`` for the kernel.  ``"small"`` cannot be saved: the stored
        outputs are the full-size run's.

    Returns
    -------
    nbformat.NotebookNode
        The executed notebook.

    Raises
    ------
    ValueError
        ``size`` is not one of :data:`SIZES`, or ``save`` with ``size="small"``.
    nbclient.exceptions.CellExecutionError
        A cell raised; nothing is saved then.
    """
    if size not in SIZES:
        raise ValueError(f"size: expected one of {SIZES}, got {size!r}")
    if save and size != "full":
        raise ValueError(f"size: the stored outputs are the full-size run; save=True needs size='full', got {size!r}")
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    for key, value in KERNEL_ENV.items():
        os.environ.setdefault(key, value)  # the kernel inherits this process's environment
    # record_timing=False: no per-cell timestamps, so re-executing changes only the outputs
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    before = os.environ.get(SIZE_ENV)
    os.environ[SIZE_ENV] = size  # for this kernel only: restored below
    try:
        client.execute()
    finally:
        if before is None:
            del os.environ[SIZE_ENV]
        else:
            os.environ[SIZE_ENV] = before
    if save:
        nbformat.write(nb, path)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/NN_*.ipynb")
    parser.add_argument("--save", action="store_true", help="write the outputs back into the files")
    parser.add_argument("--size", choices=SIZES, default="full",
                        help="NUMBA_KV_NOTEBOOK_SIZE for the kernels (small: the test's inputs; not with --save)")
    args = parser.parse_args(argv)
    if args.save and args.size != "full":
        parser.error("--save stores the full-size outputs: drop --size small")
    paths = args.notebooks or notebook_paths()
    t_all = time.perf_counter()
    for p in paths:
        t0, cpu0 = time.perf_counter(), _children_cpu_s()
        execute_notebook(p, save=args.save, size=args.size)
        # CPU seconds of the (finished) kernel: on a shared machine wall time says little
        print(f"{p.name}: {time.perf_counter() - t0:.0f} s wall, {_children_cpu_s() - cpu0:.0f} s CPU"
              f"{' (saved)' if args.save else ''}{' (small)' if args.size == 'small' else ''}", flush=True)
    print(f"{len(paths)} notebooks, {time.perf_counter() - t_all:.0f} s wall", flush=True)
    return 0


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's terminated children (the kernels)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


if __name__ == "__main__":
    sys.exit(main())
