"""Sphinx configuration: the optax_muon documentation site.

Build with warnings as errors (CI does)::

    pip install -e ".[docs]"
    python -m sphinx -W -b html docs docs/_build
"""

import json
import pathlib
import shutil
import sys

import optax_muon

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `examples` for the notebook

project = "optax_muon"
author = "The optax_muon authors"
copyright = "2026, the optax_muon authors"
release = optax_muon.__version__

extensions = [
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
  "sphinx.ext.mathjax",
  "myst_nb",
]

# The quick-start notebook lives in notebooks/; the site renders a copy. The
# test suite executes it once (tests/test_notebook.py) and leaves the executed
# copy in docs/notebooks/; when that copy's cells are the notebook's, the site
# renders its outputs as they are, else it executes the notebook itself (a
# docs build without a test run first). Either way it runs once per CI run.
_NOTEBOOK = ROOT / "notebooks" / "muon_quickstart.ipynb"
_RENDERED = ROOT / "docs" / "notebooks" / _NOTEBOOK.name


def _sources(path: pathlib.Path) -> list:
  return [
    (cell["cell_type"], "".join(cell["source"]))
    for cell in json.loads(path.read_text())["cells"]
  ]


_EXECUTED = _RENDERED.exists() and _sources(_RENDERED) == _sources(_NOTEBOOK)
if not _EXECUTED:
  _RENDERED.parent.mkdir(exist_ok=True)
  shutil.copy2(_NOTEBOOK, _RENDERED)

exclude_patterns = ["_build", "jupyter_execute", "**.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

nb_execution_mode = "off" if _EXECUTED else "force"
nb_execution_timeout = 900
nb_execution_raise_on_error = True
nb_execution_in_temp = False

myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]

# Every cross-reference must resolve (a broken one fails the -W build);
# third-party types are not documented here.
nitpicky = True
nitpick_ignore_regex = [
  ("py:.*", r"(optax|jax|jnp|np|numpy|chex|flax|nnx|typing|collections)\..*"),
]
autodoc_typehints = "none"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "furo"
html_title = f"optax_muon {release}"
