"""``python -m numba_kv``: the ``numba-kv`` command line (:func:`numba_kv.toolkit.cli.main`).

An entry point like the console script, not library code: nothing in the package imports this
module, so the library still never imports the toolkit (``tests/test_conventions.py``).
"""

from numba_kv.toolkit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
