"""The research notebooks (``notebooks/NN_*.ipynb``) run without error in fresh kernels.

Each notebook is executed by ``notebooks/execute.py`` (nbclient, a new ``python3`` kernel,
``NUMBA_NUM_THREADS=2``, ``OPENBLAS_NUM_THREADS=1``) at ``size="small"``
(``NUMBA_KV_NOTEBOOK_SIZE=small``: the same cells on smaller inputs, still past the same
windows and pages; ``make notebooks`` runs and stores the full size); a cell that raises fails
its test.
The stored files are checked too: they keep their outputs (with at least one figure) and
import only public names of ``numba_kv``.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebooks extra: pip install -e '.[notebooks]'")
nbclient = pytest.importorskip("nbclient", reason="the notebooks extra: pip install -e '.[notebooks]'")
pytest.importorskip("ipykernel", reason="the notebooks extra: pip install -e '.[notebooks]'")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("notebooks_execute", ROOT / "notebooks" / "execute.py")
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)

NOTEBOOKS = execute.notebook_paths(ROOT / "notebooks")
# any import of a module or name whose dotted path has a part starting with "_" below numba_kv
_PRIVATE = re.compile(r"^\s*(from\s+numba_kv(\.\w+)*\._\w*|import\s+numba_kv(\.\w+)*\._\w*"
                      r"|from\s+numba_kv(\.\w+)*\s+import\s+.*\b_\w+)", re.M)


def _code(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code")


def test_six_numbered_notebooks():
    assert len(NOTEBOOKS) >= 6, [p.name for p in NOTEBOOKS]
    assert [p.name[:2] for p in NOTEBOOKS] == [f"{i:02d}" for i in range(1, len(NOTEBOOKS) + 1)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_with_outputs_and_public_api_only(path):
    nb = nbformat.read(path, as_version=4)
    code = _code(nb)
    assert not _PRIVATE.search(code), _PRIVATE.search(code).group(0)
    assert "numba_kv._" not in code  # attribute access to private modules too
    cells = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in cells), "re-run `make notebooks`: a code cell was not executed"
    assert not any(o.get("output_type") == "error" for c in cells for o in c.outputs)
    assert any("image/png" in o.get("data", {}) for c in cells for o in c.outputs), "no figure"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[-1].cell_type == "markdown"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path):
    nb = execute.execute_notebook(path, save=False, size="small")
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_size_reaches_the_kernel_and_small_is_never_saved(tmp_path, monkeypatch):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import os\nprint(os.environ['NUMBA_KV_NOTEBOOK_SIZE'])")]
    path = tmp_path / "01_size.ipynb"
    nbformat.write(nb, path)
    monkeypatch.delenv("NUMBA_KV_NOTEBOOK_SIZE", raising=False)
    for size in ("small", "full"):
        out = execute.execute_notebook(path, size=size)
        assert out.cells[0].outputs[0]["text"].strip() == size
    assert "NUMBA_KV_NOTEBOOK_SIZE" not in execute.os.environ  # set for the kernel only
    before = path.read_bytes()
    with pytest.raises(ValueError, match="save=True needs size='full'"):
        execute.execute_notebook(path, save=True, size="small")
    with pytest.raises(ValueError, match="size: expected one of"):
        execute.execute_notebook(path, size="tiny")
    assert path.read_bytes() == before


def test_a_failing_cell_fails_the_runner(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("raise RuntimeError('boom')"),
                nbformat.v4.new_code_cell("y = 2")]
    path = tmp_path / "01_failing.ipynb"
    nbformat.write(nb, path)
    before = path.read_bytes()
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="boom"):
        execute.execute_notebook(path, save=True)
    assert path.read_bytes() == before  # a failed run saves nothing


# --- notebook 05: a speed figure a reader can trust ----------------------------------------------
#: a longer context measured this much faster than a shorter one is not believable (the work grows with T)
SPEED_TOLERANCE = 0.20


def _stored_text(nb) -> str:
    return "\n".join("".join(o.get("text", "")) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def _timing_rows(text: str) -> list[tuple[int, int, float, float, float]]:
    """(T, bits, fused ms, dense ms, deq+attend ms) of the stored table of notebook 05."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 9 and parts[0].isdigit() and parts[1].isdigit() and parts[6].endswith("x"):
            rows.append((int(parts[0]), int(parts[1]), float(parts[2]), float(parts[3]), float(parts[5])))
    return rows


def _falls_with_t(rows, tolerance=SPEED_TOLERANCE) -> int:
    """Pairs (same bits, same contender) where the longer context took < (1 - tolerance) of the shorter."""
    count = 0
    for bits in {r[1] for r in rows}:
        sel = sorted((r for r in rows if r[1] == bits), key=lambda r: r[0])
        for col in (2, 3, 4):
            count += sum(b[col] < a[col] * (1 - tolerance) for i, a in enumerate(sel) for b in sel[i + 1:])
    return count


def test_speed_notebook_states_its_machine_and_flags_unbelievable_timings():
    # cheap: reads the stored outputs (no execution); an independent count of the pairs the notebook must flag
    path = next(p for p in NOTEBOOKS if p.name.startswith("05_"))
    text = _stored_text(nbformat.read(path, as_version=4))
    assert "Numba threads" in text and "BLAS threads" in text, "05 must print its CPU and thread counts"
    assert re.search(r"\d+ CPUs; load average", text), "05 must print the CPU count and load average"
    rows = _timing_rows(text)
    assert len(rows) >= 6 and {r[1] for r in rows} == {3, 4}, rows
    falls = _falls_with_t(rows)
    if falls:
        assert text.count("WARNING: ") >= falls + 1, f"{falls} unbelievable timing pairs, not all flagged"
    else:
        assert "WARNING" not in text and "timings grow with T" in text


def test_speed_check_counts_falls():
    rows = [(1024, 3, 0.74, 24.7, 50.2), (2048, 3, 15.1, 22.6, 93.3), (4096, 3, 7.6, 46.2, 153.0)]
    # fused 2048 -> 4096 falls 50 %; dense 1024 -> 2048 falls 8.5 % (within tolerance): one pair
    assert _falls_with_t(rows) == 1
    assert _falls_with_t([(1024, 3, 1.0, 2.0, 3.0), (2048, 3, 0.85, 2.0, 3.0)]) == 0
