"""Layout inference from the model's jaxpr, and the routing table."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import optax_muon as om
from conftest import ROOT
from conftest import gaussian
from optax_muon._src.views import layout as layout_lib

MDN = om.MuonDimensionNumbers
TOKENS = jnp.zeros((2, 8), jnp.int32)


def _by_path(tree):
  flat, _ = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: x is None or isinstance(x, MDN)
  )
  names = lambda p: "/".join(
    str(getattr(k, "key", getattr(k, "name", k)))
    for k in p
    if getattr(k, "name", None) != "value"
  )
  return {names(p): leaf for p, leaf in flat}


def _muon_update(params, layout, grads):
  tx = om.muon(
    1.0, labels=layout.labels, dimension_numbers=layout.dimension_numbers
  )
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  return updates


def _true_matrix_update(grad, to_matrices, from_matrices):
  """The hand-written reference: the leaf reshaped into its true matrices,
  each orthogonalized and scaled by √max(fan_out, fan_in), times −lr."""
  matrices = to_matrices(grad)
  scale = np.sqrt(max(matrices.shape[-2:]))
  return -from_matrices(om.newton_schulz(matrices) * scale)


class LinenLM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(100, 32)(tokens)
    x = x + nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32)(
      nn.LayerNorm()(x)
    )
    hidden = nn.Dense(64)(nn.LayerNorm()(x))
    x = x + nn.Dense(32)(jax.nn.gelu(hidden))
    return nn.Dense(100)(x)  # auto-named Dense_2: the head


@pytest.fixture(scope="module")
def linen():
  model = LinenLM()
  params = jax.jit(model.init)(jax.random.key(0), TOKENS)
  return params, om.infer_layout(lambda p, t: model.apply(p, t), params, TOKENS)


def test_linen_attention_kernels_are_whole_matrices(linen):
  _, layout = linen
  roles, dims = _by_path(layout.roles), _by_path(layout.dimension_numbers)
  labels = _by_path(layout.labels)
  attention = "params/MultiHeadDotProductAttention_0"
  for name in ("query", "key", "value"):  # (in, heads, head_dim)
    assert dims[f"{attention}/{name}/kernel"] == MDN((0,), (1, 2))
    assert labels[f"{attention}/{name}/kernel"] == "muon"
    assert roles[f"{attention}/{name}/bias"] == "vector"
  assert dims[f"{attention}/out/kernel"] == MDN(
    (0, 1), (2,)
  )  # (heads, hd, out)
  assert dims["params/Dense_0/kernel"] == MDN((0,), (1,))
  for path, role in [
    ("params/Dense_2/kernel", "head"),
    ("params/Embed_0/embedding", "embedding"),
    ("params/LayerNorm_0/scale", "vector"),
    ("params/Dense_0/bias", "vector"),
  ]:
    assert (roles[path], labels[path]) == (role, "adam"), path
  # the default view and labels got both of these wrong
  assert om.default_labels(linen[0])["params"]["Dense_2"]["kernel"] == "muon"


def test_the_layout_table_says_which_rule_decided(linen):
  _, layout = linen
  lines = str(layout).splitlines()
  assert lines[0].split()[-1] == "rule"
  head = next(l for l in lines if l.startswith("params/Dense_2/kernel"))
  assert "head" in head and "reaches the output" in head


def test_linen_update_equals_the_true_matrices(linen):
  params, layout = linen
  grads = jax.tree.map(lambda p: gaussian(p.shape, p.size % 97), params)
  updates = _muon_update(params, layout, grads)["params"]
  g = grads["params"]["MultiHeadDotProductAttention_0"]
  got = updates["MultiHeadDotProductAttention_0"]
  want = _true_matrix_update(
    g["query"]["kernel"],
    lambda x: x.reshape(32, 32),
    lambda x: x.reshape(32, 4, 8),
  )
  np.testing.assert_allclose(got["query"]["kernel"], want, atol=1e-5)
  want = _true_matrix_update(
    g["out"]["kernel"],
    lambda x: x.reshape(32, 32),
    lambda x: x.reshape(4, 8, 32),
  )
  np.testing.assert_allclose(got["out"]["kernel"], want, atol=1e-5)
  want = _true_matrix_update(
    grads["params"]["Dense_0"]["kernel"], lambda x: x, lambda x: x
  )
  np.testing.assert_allclose(updates["Dense_0"]["kernel"], want, atol=1e-5)


def test_the_example_gpt_agrees_with_its_labels_and_views():
  from examples.flax_lm.model import GPT
  from examples.flax_lm.model import GPTConfig

  cfg = GPTConfig(
    n_layer=2,
    n_embd=32,
    block_size=16,
    scan_layers=True,
    n_experts=4,
    n_kv_head=2,
  )
  model = GPT(cfg, nnx.Rngs(0))
  layout = om.infer_layout(model, jnp.zeros((2, 16), jnp.int32))
  params = nnx.state(model, nnx.Param)
  assert _by_path(layout.labels) == _by_path(om.default_labels(params))
  shapes = {path: leaf.shape for path, leaf in _by_path(params).items()}
  for path, dims in _by_path(layout.dimension_numbers).items():
    if _by_path(layout.labels)[path] == "muon":  # the same matrices
      assert (
        layout_lib.matrix_view(shapes[path], dims).matrix_shapes
        == layout_lib.matrix_view(shapes[path], "leading").matrix_shapes
      ), path
  roles, reasons = _by_path(layout.roles), _by_path(layout.reasons)
  assert roles["lm_head/kernel"] == "head"
  assert roles["wte/embedding"] == roles["wpe/embedding"] == "embedding"
  # the dense MoE's expert axis is free in btd,edh->bteh: the name decides
  assert _by_path(layout.dimension_numbers)["blocks/experts/fc"] == MDN(
    (2,), (3,)
  )
  assert "expert" in reasons["blocks/experts/fc"]
  assert "fused QKV" in reasons["blocks/attn/qkv/kernel"]


class ScannedLinen(nn.Module):
  """A stack scanned with the layer axis second: (embed, layers, mlp)."""

  @nn.compact
  def __call__(self, x):
    class Layer(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        return jax.nn.relu(nn.Dense(24, use_bias=False)(x)) @ jnp.ones(
          (24, 16)
        ) + x, None

    stack = nn.scan(
      Layer, variable_axes={"params": 1}, split_rngs={"params": True}, length=3
    )
    x, _ = stack()(x, None)
    return x


def test_linen_scan_over_axis_one_is_a_batch_axis():
  model = ScannedLinen()
  x = gaussian((4, 16))
  params = jax.jit(model.init)(jax.random.key(0), x)
  layout = om.infer_layout(
    lambda p, x: model.apply(p, x), params, x, output=lambda out: ()
  )  # no head in this stack
  (kernel_dims,) = jax.tree.leaves(
    layout.dimension_numbers, is_leaf=lambda d: isinstance(d, MDN)
  )
  assert kernel_dims == MDN((0,), (2,))  # (embed, layers, mlp): axis 1 batch
  kernel = jax.tree.leaves(params)[0]
  assert kernel.shape == (16, 3, 24)
  grads = jax.tree.map(lambda p: gaussian(p.shape, 3), params)
  got = jax.tree.leaves(_muon_update(params, layout, grads))[0]
  g = jax.tree.leaves(grads)[0]
  want = jnp.stack(
    [_true_matrix_update(g[:, l], lambda x: x, lambda x: x) for l in range(3)],
    axis=1,
  )
  np.testing.assert_allclose(got, want, atol=1e-5)


class ConvNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.Conv(8, (3, 3), feature_group_count=8)(x)  # depthwise
    x = nn.Conv(16, (3, 3))(jax.nn.relu(x))
    return nn.Dense(10)(x.mean(axis=(1, 2)))


def test_conv_kernels_are_fan_in_by_fan_out_and_depthwise_goes_to_adam():
  model = ConvNet()
  x = gaussian((2, 8, 8, 3))
  # flax's tree and shapes; the values do not enter (no weight decay), and
  # compiling the init of 4-d kernels takes ~10 s on a CPU
  params = jax.tree.map(
    lambda leaf: gaussian(leaf.shape, 4),
    jax.eval_shape(model.init, jax.random.key(0), x),
  )
  layout = om.infer_layout(lambda p, x: model.apply(p, x), params, x)
  roles, labels = _by_path(layout.roles), _by_path(layout.labels)
  dims = _by_path(layout.dimension_numbers)
  assert dims["params/Conv_0/kernel"] == MDN((0, 1, 2), (3,))
  assert (roles["params/Conv_1/kernel"], labels["params/Conv_1/kernel"]) == (
    "conv",
    "adam",
  )
  assert (roles["params/Dense_0/kernel"], labels["params/Dense_0/kernel"]) == (
    "head",
    "adam",
  )
  grads = jax.tree.map(lambda p: gaussian(p.shape, 5), params)
  got = _muon_update(params, layout, grads)["params"]["Conv_2"]["kernel"]
  want = _true_matrix_update(
    grads["params"]["Conv_2"]["kernel"],
    lambda x: x.reshape(72, 16),
    lambda x: x.reshape(3, 3, 8, 16),
  )
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_vmapped_experts_have_a_batch_axis():
  params = {"experts": gaussian((4, 16, 32)), "out": gaussian((32, 16))}

  def fn(p, x):  # x: (experts, tokens, 16)
    hidden = jax.vmap(lambda w, xe: xe @ w)(p["experts"], x)
    return hidden @ p["out"]

  layout = om.infer_layout(
    fn, params, gaussian((4, 5, 16)), output=lambda out: ()
  )
  assert layout.dimension_numbers["experts"] == MDN((1,), (2,))
  assert layout.roles["experts"] == "matrix"
  # dispatched experts: ragged_dot's group axis is a batch axis too
  ragged = om.infer_layout(
    lambda p, x, sizes: jax.lax.ragged_dot(x, p["experts"], sizes),
    {"experts": params["experts"]},
    gaussian((10, 16)),
    jnp.array([3, 3, 2, 2], jnp.int32),
    output=lambda out: (),
  )
  assert ragged.dimension_numbers["experts"] == MDN((1,), (2,))


def test_tied_embeddings_go_to_adam():
  class Tied(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(50, 16, rngs=rngs)
      self.hidden = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, tokens):
      return self.embed.attend(self.hidden(self.embed(tokens)))

  model = Tied(nnx.Rngs(0))
  layout = om.infer_layout(model, TOKENS)
  roles = _by_path(layout.roles)
  assert roles["embed/embedding"] == "embedding"
  assert _by_path(layout.labels)["embed/embedding"] == "adam"
  assert roles["hidden/kernel"] == "matrix"
  assert "head" not in roles.values()
  # the trees line up with what nnx.Optimizer hands the transform
  tx = om.muon(
    0.1, labels=layout.labels, dimension_numbers=layout.dimension_numbers
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  before = model.hidden.kernel[...]
  grads = nnx.grad(lambda m: m(TOKENS).mean())(model)
  optimizer.update(model, grads)
  muon = om.scale_by_muon()
  expected, _ = muon.update(
    {"k": grads["hidden"]["kernel"][...]}, muon.init({"k": before})
  )
  np.testing.assert_allclose(
    model.hidden.kernel[...] - before, -0.1 * expected["k"], atol=1e-6
  )


def test_an_unknown_op_keeps_the_default_and_names_the_op():
  params = {
    "w": gaussian((8, 8)),
    "v": gaussian((8, 8)),
    "unused": gaussian((4, 4)),
  }

  def fn(p, x):
    return x @ jnp.cumsum(p["w"], axis=0) @ p["v"]

  layout = om.infer_layout(fn, params, gaussian((2, 8)), output=lambda o: ())
  assert layout.roles["w"] == "unknown" and "cumsum" in layout.reasons["w"]
  assert layout.labels["w"] == om.default_labels(params)["w"] == "muon"
  assert layout.dimension_numbers["w"] is None
  assert layout.roles["v"] == "matrix"
  assert layout.roles["unused"] == "unused"


def test_the_routing_table_lists_every_leaf():
  params = {
    "dense": {"kernel": jnp.ones((64, 192))},
    "norm": {"scale": jnp.ones((64,))},
    "attn": {"qkv": jnp.ones((64, 192))},
  }
  table = om.describe(params, split_qkv=om.SplitQKV(4, 4, 16))
  lines = table.splitlines()
  assert lines[0].split() == [
    "path",
    "shape",
    "role",
    "optimizer",
    "matrices",
    "scale",
  ]  # describe: no rule column
  rows = {line.split()[0]: line for line in lines[1:]}
  assert rows["dense/kernel"].split()[2:] == [
    "matrix",
    "muon",
    "1",
    "×",
    "64",
    "×",
    "192",
    "13.9",
  ]
  assert (
    "split qkv" in rows["attn/qkv"] and rows["attn/qkv"].count("64 × 64") == 3
  )
  assert rows["norm/scale"].split()[2:4] == ["—", "adam"]


def test_the_docs_show_the_table_describe_prints():
  from examples.flax_lm import optimizer as optimizer_lib
  from examples.flax_lm.config import run_config
  from examples.flax_lm.model import GPT

  cfg = run_config(["optim.optimizer=muon"])
  params = nnx.state(GPT(cfg.model, nnx.Rngs(0)), nnx.Param)
  table = om.describe(params, split_qkv=optimizer_lib.split_qkv_of(cfg))
  page = (ROOT / "docs" / "matrices.md").read_text()
  assert table in page, table


def test_without_a_structural_head_the_vocabulary_size_decides():
  params = {
    "embed": gaussian((50, 16)),
    "hidden": gaussian((16, 16)),
    "logits": gaussian((16, 50)),
  }

  def fn(p, tokens):  # returns (aux, logits)
    x = jnp.take(p["embed"], tokens, axis=0) @ p["hidden"]
    return x.mean(), x @ p["logits"]

  structural = om.infer_layout(fn, params, TOKENS, output=1)
  assert structural.roles["logits"] == "head"
  assert "reaches the output" in structural.reasons["logits"]
  # no structural head (the selected output is none of the matmuls'):
  # the matrix whose fan-out is the embedding's vocabulary is the head
  by_size = om.infer_layout(fn, params, TOKENS, output=lambda outputs: ())
  assert by_size.roles["logits"] == "head"
  assert "vocabulary" in by_size.reasons["logits"]
  assert by_size.roles["hidden"] == "matrix"
