"""One path from the model to the optimizer: ``layout=``, no guessed views,
settings trees from every library, and the defaults that used to surprise."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import gaussian

MDN = om.MuonDimensionNumbers


def _update(tx, params, grads):
  updates, _ = tx.update(grads, tx.init(params), params)
  return updates


# -- no guessed views --------------------------------------------------------

LLAMA = {
  "q_proj": gaussian((16, 4, 8), 0),
  "o_proj": gaussian((4, 8, 16), 1),
  "mlp": gaussian((16, 32), 2),
}


def test_a_kernel_of_three_axes_without_dimension_numbers_raises_at_init():
  tx = om.muon(1e-2)
  with pytest.raises(ValueError) as error:
    tx.init(LLAMA)
  message = str(error.value)
  assert "q_proj (16, 4, 8)" in message and "o_proj (4, 8, 16)" in message
  assert "mlp" not in message  # two axes: (in, out)
  assert "layout=om.infer_layout" in message and "'leading'" in message


def test_leading_is_the_old_view_bit_for_bit():
  # the old default: the last two axes (in, out), the leading ones batch
  old = {
    "q_proj": MDN((1,), (2,)),
    "o_proj": MDN((1,), (2,)),
    "mlp": MDN((0,), (1,)),
  }
  grads = jax.tree.map(lambda p: gaussian(p.shape, 7), LLAMA)
  chex.assert_trees_all_equal(
    _update(om.muon(1e-2, dimension_numbers="leading"), LLAMA, grads),
    _update(om.muon(1e-2, dimension_numbers=old), LLAMA, grads),
  )


def test_an_unknown_dimension_numbers_string_raises_when_built():
  with pytest.raises(ValueError, match="'leading'"):
    om.muon(1e-2, dimension_numbers="last_two")


def test_a_tuple_where_dimension_numbers_belong_names_the_class():
  with pytest.raises(TypeError, match="MuonDimensionNumbers"):
    om.muon(1e-2, dimension_numbers=(0, 1))
  with pytest.raises(TypeError, match="MuonDimensionNumbers"):
    om.muon(1e-2, dimension_numbers={"q_proj": (0, 1)})


def test_compat_keeps_optax_behaviour_for_three_axes():
  # optax.contrib.muon sends a leaf of 3 axes without dims to Adam
  tx = om.compat.muon(1e-2)
  grads = jax.tree.map(lambda p: gaussian(p.shape, 7), LLAMA)
  ours = _update(tx, LLAMA, grads)
  theirs = _update(optax.contrib.muon(1e-2), LLAMA, grads)
  chex.assert_trees_all_close(ours, theirs, atol=2e-6)


# -- layout= -----------------------------------------------------------------


def _llama(params, x):
  h = jnp.einsum("bd,dnh->bnh", x, params["q_proj"])
  h = jnp.einsum("bnh,nhd->bd", jnp.tanh(h), params["o_proj"])
  return jnp.tanh(h) @ params["mlp"]


def test_layout_gives_labels_and_views_of_every_ready_made_optimizer():
  layout = om.infer_layout(
    _llama, LLAMA, jnp.ones((2, 16)), output=lambda out: ()
  )
  assert layout.dimension_numbers["q_proj"] == MDN((0,), (1, 2))
  assert layout.dimension_numbers["o_proj"] == MDN((0, 1), (2,))
  grads = jax.tree.map(lambda p: gaussian(p.shape, 7), LLAMA)
  by_hand = om.muon(
    1e-2, labels=layout.labels, dimension_numbers=layout.dimension_numbers
  )
  want = _update(by_hand, LLAMA, grads)
  chex.assert_trees_all_equal(
    _update(om.muon(1e-2, layout=layout), LLAMA, grads), want
  )
  config = om.MuonConfig(
    optimizer="muon",
    clip_grad=0.0,
    weight_decay=0.0,
    muon_fp32_matmul_prec="highest",
  )
  assert jax.tree.leaves(
    _update(config.build(1e-2, layout=layout), LLAMA, grads)
  )
  # scale_by_muon takes the views
  direction = _update(om.scale_by_muon(layout=layout), LLAMA, grads)
  want_q = om.newton_schulz(grads["q_proj"].reshape(16, 32)) * np.sqrt(32)
  np.testing.assert_allclose(
    direction["q_proj"].reshape(16, 32), want_q, atol=1e-5
  )


@pytest.mark.parametrize("other", ["labels", "dimension_numbers"])
def test_layout_with_labels_or_dimension_numbers_raises(other):
  layout = om.infer_layout(_llama, LLAMA, jnp.ones((2, 16)))
  value = layout.labels if other == "labels" else layout.dimension_numbers
  with pytest.raises(ValueError, match=f"layout=.*{other}="):
    om.muon(1e-2, layout=layout, **{other: value})


def test_a_layout_that_is_not_one_is_a_type_error():
  with pytest.raises(TypeError, match="om.Layout"):
    om.muon(1e-2, layout={"q_proj": MDN()})


class LoRAModel(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(50, 16, rngs=rngs)
    self.a = nnx.LoRALinear(16, 32, lora_rank=4, rngs=rngs)
    self.b = nnx.LoRALinear(32, 16, lora_rank=4, rngs=rngs)
    self.head = nnx.Linear(16, 50, rngs=rngs)

  def __call__(self, tokens):
    return self.head(self.b(jax.nn.relu(self.a(self.embed(tokens)))))


TOKENS = jax.random.randint(jax.random.key(0), (4, 8), 0, 50)


def test_wrt_lora_params_gives_only_the_adapters_all_matrices():
  model = LoRAModel(nnx.Rngs(0))
  layout = om.infer_layout(model, TOKENS, wrt=nnx.LoRAParam)
  flat = dict(jax.tree_util.tree_flatten_with_path(layout.roles)[0])
  assert len(flat) == 4 and set(flat.values()) == {"matrix"}
  # the last adapter's product passes through the frozen head: not a head
  assert layout.roles["b"]["lora"]["lora_b"] == "matrix"
  assert layout.dimension_numbers["b"]["lora"]["lora_b"] == MDN((0,), (1,))


def test_a_whole_model_layout_serves_an_optimizer_of_the_adapters():
  model = LoRAModel(nnx.Rngs(0))
  layout = om.infer_layout(model, TOKENS)  # covers base and head too
  base = nnx.state(model, nnx.Not(nnx.LoRAParam))
  before = jax.tree.map(np.array, base)
  optimizer = nnx.Optimizer(
    model, om.muon(1e-2, layout=layout), wrt=nnx.LoRAParam
  )
  loss = lambda m: optax.softmax_cross_entropy_with_integer_labels(
    m(TOKENS), TOKENS
  ).mean()
  losses = []
  for _ in range(3):
    value, grads = nnx.value_and_grad(
      loss, argnums=nnx.DiffState(0, nnx.LoRAParam)
    )(model)
    optimizer.update(model, grads)
    losses.append(float(value))
  assert losses[-1] < losses[0]
  jax.tree.map(
    np.testing.assert_array_equal,
    before,
    jax.tree.map(np.array, nnx.state(model, nnx.Not(nnx.LoRAParam))),
  )


def test_a_hand_written_tree_still_names_only_existing_paths():
  with pytest.raises(
    ValueError, match="no parameter path; the optimizer sees 3 leaves"
  ):
    om.muon(1e-2, labels={"zzz_unrelated_9": "adam"}).init(LLAMA)


def test_infer_layout_of_a_module_without_inputs_asks_for_them():
  with pytest.raises(ValueError, match="pass an example batch"):
    om.infer_layout(LoRAModel(nnx.Rngs(0)))


# -- the defaults that used to surprise ----------------------------------------


def test_learning_rate_none_raises():
  with pytest.raises(ValueError, match="learning_rate=None"):
    om.muon(None)


def test_adam_patterns_extend_the_built_in_ones():
  params = {
    "embed": jnp.zeros((50, 16)),
    "router": jnp.zeros((16, 4)),
    "mlp": jnp.zeros((16, 16)),
  }
  labels = om.default_labels(params, adam_patterns=("router",))
  assert labels == {"embed": "adam", "router": "adam", "mlp": "muon"}


def test_a_pattern_that_matches_nothing_raises_naming_it():
  params = {"embed": jnp.zeros((50, 16)), "mlp": jnp.zeros((16, 16))}
  tx = om.muon(
    1e-2, labels=lambda p: om.default_labels(p, adam_patterns=("routr",))
  )
  with pytest.raises(ValueError, match="'routr', which matches no"):
    tx.init(params)


def test_adam_weight_decay_skips_vectors_by_default():
  params = {
    "embed": jnp.ones((50, 16)),
    "norm": {"scale": jnp.ones((16,))},
    "mlp": jnp.ones((16, 16)),
  }
  zeros = jax.tree.map(jnp.zeros_like, params)
  for tx in (
    om.muon(0.1, adam_weight_decay=0.5),
    om.MuonConfig(optimizer="muon", weight_decay=0.5).build(0.1),
  ):
    updates = _update(tx, params, zeros)
    np.testing.assert_allclose(updates["embed"], -0.05, rtol=1e-6)
    np.testing.assert_array_equal(updates["norm"]["scale"], 0.0)


def test_every_update_has_its_parameters_dtype():
  params = {
    "embed": jnp.ones((50, 16), jnp.bfloat16),
    "mlp": jnp.ones((16, 32), jnp.bfloat16),
    "bias": jnp.ones((32,), jnp.bfloat16),
  }
  grads = jax.tree.map(lambda p: gaussian(p.shape, 3, p.dtype), params)
  updates = _update(om.muon(1e-2, mu_dtype=jnp.float32), params, grads)
  assert {u.dtype for u in jax.tree.leaves(updates)} == {jnp.dtype("bfloat16")}


def test_describe_shows_the_scale_that_will_be_applied():
  params = {"mlp": jnp.zeros((16, 64))}
  scale = lambda table: float(table.splitlines()[1].split()[-1])
  assert scale(om.describe(params)) == pytest.approx(8.0, rel=1e-3)
  assert scale(om.describe(params, scale_mode="shape_scaling")) == (
    pytest.approx(2.0, rel=1e-3)
  )
  assert scale(om.describe(params, match_adamw_update_rms=True)) == (
    pytest.approx(8.0 * 0.229416, rel=1e-2)
  )  # the table shows 3 digits
  assert scale(om.describe(params, extra_scale_factor=0.5)) == (
    pytest.approx(4.0, rel=1e-3)
  )


def test_config_build_runs_tensor_parallel_over_any_named_axis():
  mesh = jax.make_mesh(
    (2, 4), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
  )
  config = om.MuonConfig(
    optimizer="muon", muon_tp_mode="duplicated", muon_fp32_matmul_prec="highest"
  )
  params = {
    "mlp": jax.device_put(
      gaussian((16, 32), 0), jax.NamedSharding(mesh, jax.P(None, "tp"))
    )
  }
  tx = config.build(1e-2, mesh=mesh, tp_axis="tp")
  updates = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(params, params)
  assert updates["mlp"].sharding.spec == jax.P(None, "tp")
  with pytest.raises(ValueError, match="tp_axis='model'"):
    config.build(1e-2, mesh=mesh)


# -- settings trees from every library ----------------------------------------


def _equinox_lm():
  eqx = pytest.importorskip("equinox")

  class LM(eqx.Module):
    embed: eqx.nn.Embedding
    attn: eqx.nn.MultiheadAttention  # default: projections without bias
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.Linear
    drop: eqx.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, key):
      keys = jax.random.split(key, 4)
      self.embed = eqx.nn.Embedding(50, 32, key=keys[0])
      self.attn = eqx.nn.MultiheadAttention(4, 32, key=keys[1])
      self.norm = eqx.nn.LayerNorm(32)
      self.mlp = eqx.nn.Linear(32, 16, key=keys[2])  # weight (out, in)
      self.drop = eqx.nn.Dropout(0.1)
      self.head = eqx.nn.Linear(16, 50, use_bias=False, key=keys[3])

    def __call__(self, tokens, key=None):
      x = jax.vmap(self.embed)(tokens)
      x = x + self.attn(x, x, x)
      x = self.drop(
        jax.vmap(self.mlp)(jax.vmap(self.norm)(x)),
        key=key,
        inference=key is None,
      )
      return jax.vmap(self.head)(jax.nn.relu(x))

  return eqx, LM(jax.random.key(0))


def test_an_equinox_lm_trains_with_its_layout():
  eqx, model = _equinox_lm()
  tokens = jnp.arange(8) % 50
  params, static = eqx.partition(model, eqx.is_inexact_array)
  layout = om.infer_layout(
    lambda p, t: eqx.combine(p, static)(t), params, tokens
  )
  assert layout.dimension_numbers.mlp.weight == MDN((1,), (0,))  # (out, in)
  assert layout.labels.head.weight == "adam"
  assert layout.labels.attn.query_proj.weight == "muon"
  tx = om.muon(1e-2, layout=layout)
  state = tx.init(params)

  @eqx.filter_jit
  def step(model, state, key):
    def loss(m):
      return optax.softmax_cross_entropy_with_integer_labels(
        m(tokens, key), jnp.roll(tokens, -1)
      ).mean()

    value, grads = eqx.filter_value_and_grad(loss)(model)
    updates, state = tx.update(
      grads, state, eqx.filter(model, eqx.is_inexact_array)
    )
    return eqx.apply_updates(model, updates), state, value

  losses = []
  for i in range(5):
    model, state, value = step(model, state, jax.random.key(i))
    losses.append(float(value))
  assert losses[-1] < 0.8 * losses[0]
  assert {
    x.dtype for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
  } == {jnp.dtype("float32")}


def test_equinox_settings_trees_are_trees_not_functions():
  # an eqx.Module is callable; its None fields (no bias) are no paths
  eqx, model = _equinox_lm()
  params, static = eqx.partition(model, eqx.is_inexact_array)
  layout = om.infer_layout(
    lambda p, t: eqx.combine(p, static)(t), params, jnp.arange(8) % 50
  )
  assert callable(layout.labels)
  by_hand = om.muon(
    1e-2, labels=layout.labels, dimension_numbers=layout.dimension_numbers
  )
  grads = jax.tree.map(lambda p: gaussian(p.shape, 1), params)
  chex.assert_trees_all_equal(
    _update(by_hand, params, grads),
    _update(om.muon(1e-2, layout=layout), params, grads),
  )


def test_haiku_params_route_by_their_layout():
  hk = pytest.importorskip("haiku")

  def forward(x):
    x = jax.nn.relu(hk.Linear(32)(x))
    x = hk.LayerNorm(-1, True, True)(x)
    hidden = hk.Linear(32)(x)  # linear_1
    return hk.Linear(4)(jax.nn.relu(hidden))  # linear_2: the head

  model = hk.without_apply_rng(hk.transform(forward))
  x = jnp.ones((2, 8))
  params = jax.jit(model.init)(jax.random.key(0), x)
  layout = om.infer_layout(model.apply, params, x)
  assert layout.labels == {
    "linear": {"w": "muon", "b": "adam"},
    "layer_norm": {"scale": "adam", "offset": "adam"},
    "linear_1": {"w": "muon", "b": "adam"},
    "linear_2": {"w": "adam", "b": "adam"},
  }
  grads = jax.tree.map(lambda p: gaussian(p.shape, 1), params)
  updates = _update(om.muon(1e-2, layout=layout), params, grads)
  chex.assert_trees_all_equal_shapes_and_dtypes(updates, params)


def test_an_nnx_state_layout_is_read_by_path():
  model = LoRAModel(nnx.Rngs(0))
  layout = om.infer_layout(model, TOKENS)
  params = nnx.state(model, nnx.Param)
  grads = jax.tree.map(lambda p: gaussian(p.shape, 1), params)
  by_hand = om.muon(
    1e-2, labels=layout.labels, dimension_numbers=layout.dimension_numbers
  )
  chex.assert_trees_all_equal(
    _update(by_hand, params, grads),
    _update(om.muon(1e-2, layout=layout), params, grads),
  )


def test_describe_with_a_layout_shows_the_layouts_roles_and_rules():
  def forward(p, x):
    h = jnp.einsum("td,dnh->tnh", x, p["q"]).reshape(x.shape[0], -1)
    return h @ p["head"] + p["bias"]

  params = {
    "q": jnp.zeros((8, 2, 4)),
    "head": jnp.zeros((8, 5)),
    "bias": jnp.zeros((5,)),
  }
  layout = om.infer_layout(forward, params, jnp.ones((3, 8)))
  table = om.describe(params, layout=layout)
  assert table == str(layout)
  for line in table.splitlines()[1:]:
    path = line.split()[0]
    assert layout.roles[path] in line and layout.reasons[path] in line


def test_a_layout_of_another_model_raises_at_init_naming_the_leaf():
  forward = lambda p, x: x @ p["w1"] @ p["w2"]
  small = {"w1": jnp.zeros((8, 16)), "w2": jnp.zeros((16, 4))}
  layout = om.infer_layout(forward, small, jnp.ones((2, 8)))
  other = {"w1": jnp.zeros((8, 32)), "w2": jnp.zeros((32, 4))}
  with pytest.raises(ValueError, match=r"w1 has shape \(8, 16\).*\(8, 32\)"):
    om.muon(0.02, layout=layout).init(other)
  om.muon(0.02, layout=layout).init(small)  # its own model is accepted


# settings trees with paths that match no parameter --------------------------

PARAMS = {
  "attn": {"qkv": {"kernel": jnp.ones((8, 24))}},
  "mlp": {"w": jnp.ones((8, 16))},
  "embed": jnp.ones((12, 8)),
  "bias": jnp.ones((8,)),
}

UNKNOWN_PATHS = {
  "weight_decay_mask": lambda: om.muon(
    0.1,
    weight_decay=0.1,
    weight_decay_mask={"mlp": {"W": True}},
    dimension_numbers="leading",
  ),
  "adam_weight_decay_mask": lambda: om.muon(
    0.1, adam_weight_decay_mask={"embedding": True}, dimension_numbers="leading"
  ),
  "dimension_numbers": lambda: om.muon(
    0.1, dimension_numbers={"mlp": {"kernel": MDN(0, 1)}}
  ),
  "split_qkv": lambda: om.muon(
    0.1,
    split_qkv={"attn": {"qkv_proj": om.SplitQKV(1, 1, 8)}},
    dimension_numbers="leading",
  ),
  "labels": lambda: om.muon(
    0.1, labels={"mlp": {"W": "muon"}}, dimension_numbers="leading"
  ),
  "sharding.specs": lambda: om.muon(
    0.1,
    sharding=om.TensorParallel(
      jax.make_mesh((1,), ("model",), axis_types=(AxisType.Explicit,)),
      specs={"mlp": {"w": P()}, "attn": {"qkv": {"kernal": P()}}},
    ),
    dimension_numbers="leading",
  ),
}


@pytest.mark.parametrize("name", sorted(UNKNOWN_PATHS))
def test_a_path_that_names_no_parameter_raises_at_init(name):
  tx = UNKNOWN_PATHS[name]()
  with pytest.raises(ValueError) as raised:
    tx.init(PARAMS)
  message = str(raised.value)
  assert message.startswith(f"{name} names"), message
  assert "no parameter path" in message and "nearest existing paths" in message
  nearest = {
    "weight_decay_mask": "mlp/w",
    "adam_weight_decay_mask": "embed",
    "dimension_numbers": "mlp",
    "split_qkv": "attn/qkv",
    "labels": "mlp/w",
    "sharding.specs": "attn/qkv/kernel",
  }[name]
  assert repr(nearest) in message, message


def test_full_tree_settings_still_work_inside_the_partition():
  # every path names a real leaf, Muon's and AdamW's alike
  full = lambda value: jax.tree.map(lambda _: value, PARAMS)
  tx = om.muon(
    0.1,
    weight_decay=0.1,
    weight_decay_mask=full(True),
    adam_weight_decay_mask=full(False),
    dimension_numbers=full(None),
    labels={"attn": "muon", "mlp": "muon", "embed": "adam", "bias": "adam"},
  )
  updates, _ = tx.update(PARAMS, tx.init(PARAMS), PARAMS)
  chex.assert_trees_all_equal_shapes(updates, PARAMS)
