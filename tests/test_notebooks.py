"""The research notebooks (``notebooks/NN_*.ipynb``) run without error in fresh kernels.

Each notebook is executed by ``notebooks/execute.py`` (nbclient, a new ``python3`` kernel,
``NUMBA_NUM_THREADS=2``, ``OPENBLAS_NUM_THREADS=1``); a cell that raises fails its test.
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
    nb = execute.execute_notebook(path, save=False)
    assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


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
