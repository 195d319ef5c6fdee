"""Sphinx configuration of attnlab's documentation site (``scripts/build-docs.sh`` builds it).

The API reference is generated from the docstrings of the *installed* attnlab (or of the one
on ``PYTHONPATH``): nothing here puts ``python/`` on the path, so the site documents the
package that was built and tested.
"""

from __future__ import annotations

import importlib.util
import inspect
import shutil
from pathlib import Path
from typing import Any

import attnlab

project = "attnlab"
author = "attnlab contributors"
copyright = "attnlab contributors"
release = attnlab.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_nb",  # Markdown pages (MyST) and the notebooks
]

# The notebooks and their README, copied from the repository's notebooks/ into docs/notebooks/
# (not committed), so that they are pages of the site and the README's link to them resolves.
_HERE = Path(__file__).resolve().parent
_NOTEBOOKS = _HERE / "notebooks"
_NOTEBOOKS.mkdir(exist_ok=True)
for _old in _NOTEBOOKS.iterdir():
    if not (_HERE.parent / "notebooks" / _old.name).is_file():
        _old.unlink()
for _src in sorted((_HERE.parent / "notebooks").glob("*")):
    if _src.suffix in (".ipynb", ".md"):
        # copy2 keeps the time stamp, so that a rebuild reads only the notebooks that changed
        shutil.copy2(_src, _NOTEBOOKS / _src.name)

# Markdown (MyST) and notebooks
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]

# The notebooks are committed without outputs and executing them takes minutes (they time
# kernels): the site shows their text and code; tests/test_notebooks.py runs them.
nb_execution_mode = "off"
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

# The API reference: autosummary writes one page per name (docs/generated/, not committed).
autosummary_generate = True
autodoc_typehints = "none"  # the numpydoc Parameters section states the types

# Optional dependencies: attnlab.torch imports torch, attnlab.dask imports dask. Where they are
# missing the modules are documented against mocks (their docstrings are all that is read).
autodoc_mock_imports = [m for m in ("torch", "dask") if importlib.util.find_spec(m) is None]

numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

html_theme = "furo"
html_title = f"attnlab {release}"
templates_path = ["_templates"]
html_static_path: list[str] = []


def _hide_private_parameters(
    _app: Any, what: str, _name: str, obj: Any, _options: Any, signature: str | None, _ret: Any
) -> tuple[str, None] | None:
    """Signatures without attnlab's private parameters (``_keep``, ``_order``), which the
    docstrings do not describe either (Sphinx's ``autodoc-process-signature`` event)."""
    if signature is None or not callable(obj):
        return None
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    if not any(p.startswith("_") for p in sig.parameters):
        return None
    params = [
        p.replace(annotation=inspect.Parameter.empty)
        for p in sig.parameters.values()
        if not p.name.startswith("_")
    ]
    if what in ("class", "method") and params and params[0].name == "self":
        params = params[1:]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty)), None


def setup(app: Any) -> None:
    app.connect("autodoc-process-signature", _hide_private_parameters)
