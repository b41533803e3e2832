"""Sphinx configuration: the optax_muon documentation site.

Build with warnings as errors (CI does)::

    pip install -e ".[docs]"
    python -m sphinx -W -b html docs docs/_build
"""

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

# The quick-start notebook lives in notebooks/ (where Colab opens it); the
# site renders a copy, executed at build time so that its figures are current.
_NOTEBOOK = ROOT / "notebooks" / "muon_quickstart.ipynb"
(ROOT / "docs" / "notebooks").mkdir(exist_ok=True)
shutil.copy2(_NOTEBOOK, ROOT / "docs" / "notebooks" / _NOTEBOOK.name)

exclude_patterns = ["_build", "jupyter_execute", "**.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

nb_execution_mode = "force"
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
