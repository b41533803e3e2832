"""om.infer_layout against MaxText's own Muon tables, model by model.

    python benchmarks/maxtext_layout.py [MODEL ...]   # default: the list below

For each MaxText model (its own config, ``scan_layers=True``), the abstract
NNX model is built as ``maxtext.utils.muon_utils.get_model_mdn`` builds it,
and every parameter's Muon dimension numbers from MaxText's hand-written
table (``get_muon_weight_dimension_numbers``) are compared with what
``om.infer_layout`` reads from the model's own program (traced, nothing
computed). Prints one JSON line per model: the leaves that agree, of all,
and each one that does not (path, shape, ours, MaxText's), axes normalized.

Needs MaxText (Python >= 3.12): ``pip install --no-deps maxtext==0.2.5``,
then what its imports name (omegaconf, pathwaysutils, jinja2,
huggingface_hub, transformers, grain, drjax, qwix, aqtp, tokamax, tiktoken,
sentencepiece, sympy); see ../shared/notes or docs/libraries.md.
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import optax_muon as om  # noqa: E402

MODELS = (
  "deepseek3-tiny",
  "deepseek3-671b",
  "deepseek2-16b",
  "qwen3-4b",
  "llama3.1-8b",
  "gemma3-4b",
  "mixtral-8x7b",
  "gpt-oss-20b",
)
SEQUENCE = 16


def _normalized(dims, ndim):
  """``(reduction axes, output axes)`` as sorted non-negative tuples."""
  if dims is None:
    return None
  axes = lambda a: tuple(
    sorted(x % ndim for x in ((a,) if isinstance(a, int) else a))
  )
  return axes(dims.reduction_axis), axes(dims.output_axis)


def compare(model_name: str) -> dict:
  from flax import nnx
  from maxtext.configs import pyconfig
  from maxtext.utils import maxtext_utils
  from maxtext.utils import model_creation_utils
  from maxtext.utils import muon_utils
  from maxtext.utils.globals import MAXTEXT_PKG_DIR

  config = pyconfig.initialize(
    [
      None,
      os.path.join(MAXTEXT_PKG_DIR, "configs", "base.yml"),
      f"model_name={model_name}",
      "scan_layers=True",
      "attention=dot_product",
      "skip_jax_distributed_system=True",
      f"max_target_length={SEQUENCE}",
      "per_device_batch_size=1",
    ]
  )
  mesh = jax.sharding.Mesh(
    maxtext_utils.create_device_mesh(config), config.mesh_axes
  )
  _, model = model_creation_utils.create_nnx_abstract_model(config, mesh)
  theirs = muon_utils.get_muon_weight_dimension_numbers(model, config)
  tokens = jnp.zeros((1, SEQUENCE), jnp.int32)
  with jax.set_mesh(mesh):
    layout = om.infer_layout(
      model,
      tokens,
      jnp.arange(SEQUENCE)[None],
      decoder_segment_ids=jnp.ones_like(tokens),
      enable_dropout=False,
    )
  is_dims = lambda x: x is None or hasattr(x, "reduction_axis")
  listed = lambda tree: dict(
    jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(tree), is_leaf=is_dims)
  )
  ours, table = listed(layout.dimension_numbers), listed(theirs)
  shapes = dict(
    jax.tree_util.tree_leaves_with_path(
      nnx.to_pure_dict(nnx.state(model, nnx.Param))
    )
  )
  differ = []
  for path, dims in ours.items():
    shape = shapes[path].shape
    want = _normalized(table.get(path), len(shape))
    if _normalized(dims, len(shape)) != want:
      differ.append(
        [jax.tree_util.keystr(path), shape, _normalized(dims, len(shape)), want]
      )
  return {
    "benchmark": "maxtext_layout",
    "model": model_name,
    "agree": len(ours) - len(differ),
    "leaves": len(ours),
    "differ": differ,
  }


def main(argv=None):
  for name in (argv if argv is not None else sys.argv[1:]) or MODELS:
    print(json.dumps(compare(name)), flush=True)


if __name__ == "__main__":
  main()
