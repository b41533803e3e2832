"""infer_layout on the programs of every supported jax and on NNX models
whose forward pass updates their own state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import optax_muon as om
from conftest import gaussian
from conftest import normal
from optax_muon._src.inference import jaxprs as _jaxprs

MDN = om.MuonDimensionNumbers


def _scanned_mlp(params, x):
  step = lambda h, w: (jnp.tanh(h @ w), None)
  return jax.lax.scan(step, x, params["w"])[0] @ params["head"]


def test_a_scan_over_stacked_layers_is_read_on_this_jax():
  # jax >= 0.11 replaced the scan's num_consts/num_carry by ft_in
  layout = om.infer_layout(
    _scanned_mlp,
    {"w": jnp.zeros((3, 8, 8)), "head": jnp.zeros((8, 4))},
    jnp.ones((2, 8)),
  )
  assert layout.roles == {"w": "matrix", "head": "head"}
  assert layout.dimension_numbers["w"] == MDN((1,), (2,))
  assert layout.labels == {"w": "muon", "head": "adam"}


def test_scan_operand_counts_split_consts_carry_and_xs():
  const = jnp.ones((4,))

  def two_carries(x, xs):
    def body(carry, pair):
      a, b = carry
      u, v = pair
      return (a + u * const, b * v), a

    return jax.lax.scan(body, (x, x), (xs, xs))

  jaxpr = jax.make_jaxpr(two_carries)(jnp.ones(4), jnp.ones((3, 4))).jaxpr
  (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  assert _jaxprs.scan_operand_counts(scan.params) == (1, 2)
  assert len(scan.invars) == 1 + 2 + 2


def test_a_closed_over_layer_inside_a_scan_body_is_a_const():
  # the weight enters the scan as a constant, the stacked one as xs
  def f(params, x):
    step = lambda h, w: (jnp.tanh((h @ params["shared"]) @ w), None)
    return jax.lax.scan(step, x, params["w"])[0]

  layout = om.infer_layout(
    f,
    {"w": jnp.zeros((3, 8, 8)), "shared": jnp.zeros((8, 8))},
    jnp.ones((2, 8)),
    output=lambda out: (),
  )
  assert layout.dimension_numbers == {
    "w": MDN((1,), (2,)),
    "shared": MDN((0,), (1,)),
  }


class DropoutMLP(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(8, 16, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.b = nnx.Linear(16, 8, rngs=rngs)

  def __call__(self, x):
    return self.b(self.drop(jax.nn.relu(self.a(x))))


def _non_params(model):
  return jax.tree.map(
    np.asarray,
    nnx.state(model, nnx.Not(nnx.Param)),
    is_leaf=lambda x: isinstance(x, jax.Array),
  )


def _same(before, after):
  key_data = lambda x: (
    jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    else x
  )
  jax.tree.map(
    lambda a, b: np.testing.assert_array_equal(key_data(a), key_data(b)),
    before,
    after,
  )


def test_a_model_with_active_dropout_is_traced_and_left_unchanged():
  model = DropoutMLP(nnx.Rngs(0, dropout=1))
  before = nnx.state(model, nnx.RngState)
  count = int(model.drop.rngs.count[...])
  layout = om.infer_layout(model, jnp.ones((2, 8)))
  assert layout.roles["a"]["kernel"] == "matrix"
  assert layout.roles["b"]["kernel"] == "head"
  assert int(model.drop.rngs.count[...]) == count
  _same(before, nnx.state(model, nnx.RngState))


class BatchNormMLP(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(8, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, use_running_average=False, rngs=rngs)
    self.b = nnx.Linear(16, 16, rngs=rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(jax.nn.relu(self.b(self.norm(self.a(x)))))


def test_batch_norm_in_train_mode_keeps_the_users_statistics():
  model = BatchNormMLP(nnx.Rngs(0))
  model.norm.mean[...] = jnp.arange(16.0)  # statistics a call would move
  before = _non_params(model)
  layout = om.infer_layout(model, gaussian((4, 8)))
  assert layout.roles["a"]["kernel"] == "matrix"
  assert layout.roles["b"]["kernel"] == "matrix"
  assert layout.roles["head"]["kernel"] == "head"
  assert layout.roles["norm"]["scale"] == "vector"
  _same(before, _non_params(model))


class RoutingBias(nnx.Variable):
  pass


class Router(nnx.Module):
  def __init__(self):
    self.bias = RoutingBias(jnp.zeros((4,)))


class BiasUpdatingMoE(nnx.Module):
  """A forward pass that updates a sub-module's state with ``nnx.update``,
  as auxiliary-loss-free MoE routing does with its bias."""

  def __init__(self, rngs):
    self.gate = nnx.Linear(8, 4, rngs=rngs)
    self.router = Router()
    self.up = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    scores = self.gate(x) + self.router.bias[...]
    load = jax.nn.softmax(scores).mean(axis=0)
    nnx.update(
      self.router,
      nnx.State({"bias": self.router.bias[...] - 0.01 * (load - 0.25)}),
    )
    return self.up(x * jax.nn.sigmoid(scores.max(axis=-1, keepdims=True)))


def test_a_forward_pass_that_calls_nnx_update_is_traced():
  model = BiasUpdatingMoE(nnx.Rngs(0))
  model(jnp.ones((2, 8)))  # the update works eagerly: the bias moves
  assert float(jnp.abs(model.router.bias[...]).max()) > 0
  before = _non_params(model)
  layout = om.infer_layout(model, gaussian((2, 8)))
  assert layout.roles["gate"]["kernel"] == "matrix"
  assert layout.roles["up"]["kernel"] == "head"
  assert "router" not in layout.roles  # not an nnx.Param: not optimized
  _same(before, _non_params(model))


def _in_shard_map(f):
  mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.PartitionSpec()
  return lambda w, h: jax.shard_map(
    f, mesh=mesh, in_specs=(spec, spec), out_specs=spec
  )(w, h)


def _in_fori(f):  # a traced trip count: a while loop
  return lambda w, h: jax.lax.fori_loop(
    0, jnp.int32(h.shape[0]) * 0 + 2, lambda i, a: f(w, a), h
  )


@jax.custom_vjp
def _custom(w, h):
  return h @ w


_custom.defvjp(
  lambda w, h: (h @ w, (w, h)), lambda res, g: (res[1].T @ g, g @ res[0].T)
)

WRAPPERS = {
  "jit": jax.jit,
  "remat": jax.checkpoint,
  "cond": lambda f: lambda w, h: jax.lax.cond(h[0, 0] > 0, f, f, w, h),
  "while": _in_fori,
  "shard_map": _in_shard_map,
  "custom_vjp": lambda f: _custom,
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_a_matmul_inside_each_sub_program_is_read(wrapper):
  inner = WRAPPERS[wrapper](lambda w, h: h @ w)

  def f(params, x):
    return inner(params["w"], x) @ params["head"]

  layout = om.infer_layout(
    f, {"w": jnp.zeros((8, 8)), "head": jnp.zeros((8, 4))}, jnp.ones((2, 8))
  )
  assert layout.roles == {"w": "matrix", "head": "head"}, layout.reasons
  assert layout.dimension_numbers["w"] == MDN((0,), (1,))


def test_concatenated_and_padded_sinks_are_vectors():
  # gpt-oss: a learned per-head logit joined to the attention logits
  def attend(params, x):
    logits = jnp.einsum("bd,dh->bh", x, params["q"])[:, :, None]  # (b, h, 1)
    sinks = jnp.broadcast_to(params["sinks"][None, :, None], logits.shape)
    joined = jnp.concatenate([logits, sinks], axis=-1)
    padded = jnp.pad(params["bias"], (0, 1))
    return jax.nn.softmax(joined + padded, axis=-1).sum(-1) @ params["out"]

  params = {
    "q": jnp.zeros((8, 4)),
    "sinks": jnp.zeros((4,)),
    "bias": jnp.zeros((1,)),
    "out": jnp.zeros((4, 8)),
  }
  layout = om.infer_layout(attend, params, jnp.ones((2, 8)))
  assert layout.roles["sinks"] == "vector", layout.reasons["sinks"]
  assert layout.roles["bias"] == "vector", layout.reasons["bias"]
  assert layout.labels["sinks"] == "adam"


# -- structure over names: what the program does with a matmul's product ------


def _attention(q_kernel_spec, kv):
  def attend(params, x):
    q = jnp.einsum(q_kernel_spec, x, params["q"])
    k, v = kv(x, params)
    scores = jnp.einsum("btnh,bsnh->bnts", q, k)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores), v)
    return jnp.einsum("btnh,nhd->btd", out, params["o"])

  return attend


GEMMA_KV = lambda x, p: jnp.einsum("bsd,ckdh->cbskh", x, p["kv_einsum"])
LLAMA_KV = lambda x, p: (
  jnp.einsum("bsd,dkh->bskh", x, p["k"]),
  jnp.einsum("bsd,dkh->bskh", x, p["v"]),
)
X = gaussian((2, 5, 16), 9)


def _per_matrix_update(grad, to_matrices, from_matrices):
  matrices = to_matrices(np.asarray(grad))
  scale = np.sqrt(max(matrices.shape[-2:]))
  return from_matrices(
    np.asarray(om.newton_schulz(jnp.asarray(matrices))) * scale
  )


def _direction(params, layout, grads):
  tx = om.scale_by_muon(layout=layout)
  return tx.update(grads, tx.init(params), params)[0]


def _assert_one_matrix_per_part(params, layout, name):
  """A fused (parts, heads, D, H) kernel's update is, for each part, the
  per-matrix Newton–Schulz of its D × heads·H matrix."""
  parts, heads, d, h = params[name].shape
  grads = {k: gaussian(v.shape, 3) for k, v in params.items()}
  got = _direction(params, layout, grads)[name]
  want = _per_matrix_update(
    grads[name],
    lambda g: g.transpose(0, 2, 1, 3).reshape(parts, d, heads * h),
    lambda m: m.reshape(parts, d, heads, h).transpose(0, 2, 1, 3),
  )
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_llama_and_gemma_query_kernels_are_one_matrix_each():
  llama = {
    "q": jnp.zeros((16, 2, 8)),
    "k": jnp.zeros((16, 2, 8)),
    "v": jnp.zeros((16, 2, 8)),
    "o": jnp.zeros((2, 8, 16)),
  }
  layout = om.infer_layout(
    _attention("btd,dnh->btnh", LLAMA_KV), llama, X, output=lambda out: ()
  )
  assert layout.dimension_numbers["q"] == MDN((0,), (1, 2))  # (D, N, H)
  assert layout.dimension_numbers["o"] == MDN((0, 1), (2,))
  gemma = {
    "q": jnp.zeros((2, 16, 8)),
    "kv_einsum": jnp.zeros((2, 2, 16, 8)),
    "o": jnp.zeros((2, 8, 16)),
  }
  layout = om.infer_layout(
    _attention("btd,ndh->btnh", GEMMA_KV), gemma, X, output=lambda out: ()
  )
  assert layout.dimension_numbers["q"] == MDN((1,), (0, 2))  # (N, D, H)


def test_gemmas_fused_kv_is_two_matrices():
  params = {
    "q": jnp.zeros((2, 16, 8)),
    "kv_einsum": jnp.zeros((2, 2, 16, 8)),
    "o": jnp.zeros((2, 8, 16)),
  }
  layout = om.infer_layout(
    _attention("btd,ndh->btnh", GEMMA_KV), params, X, output=lambda out: ()
  )
  assert layout.dimension_numbers["kv_einsum"] == MDN((2,), (1, 3))
  assert "indexed apart" in layout.reasons["kv_einsum"]
  _assert_one_matrix_per_part(params, layout, "kv_einsum")  # K and V


def test_gemmas_fused_qkv_is_three_matrices():
  def attend(params, x):
    q, k, v = jnp.einsum("btd,cndh->cbtnh", x, params["qkv_einsum"])
    scores = jnp.einsum("btnh,bsnh->bnts", q, k)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores), v)
    return jnp.einsum("btnh,nhd->btd", out, params["o"])

  params = {"qkv_einsum": jnp.zeros((3, 2, 16, 8)), "o": jnp.zeros((2, 8, 16))}
  layout = om.infer_layout(attend, params, X, output=lambda out: ())
  assert layout.dimension_numbers["qkv_einsum"] == MDN((2,), (1, 3))
  _assert_one_matrix_per_part(params, layout, "qkv_einsum")  # Q, K and V


def test_a_dense_moe_under_any_name_has_an_expert_axis():
  # MaxText's MoeBlock_0/wi_0: no "expert" or "moe" path component needed
  def block(params, x):
    p = params["MoeBlock_0"]
    hidden = jax.nn.gelu(jnp.einsum("btd,edh->bteh", x, p["wi_0"]))
    out = jnp.einsum("bteh,ehd->bted", hidden, p["wo"])
    weights = jax.nn.softmax(x @ p["gate"])
    return jnp.einsum("bted,bte->btd", out, weights)

  params = {
    "MoeBlock_0": {
      "wi_0": jnp.zeros((4, 16, 32)),
      "wo": jnp.zeros((4, 32, 16)),
      "gate": jnp.zeros((16, 4)),
    }
  }
  layout = om.infer_layout(block, params, X, output=lambda out: ())
  dims = layout.dimension_numbers["MoeBlock_0"]
  assert dims["wi_0"] == MDN((1,), (2,)) and dims["wo"] == MDN((1,), (2,))
  assert "expert axis" in layout.reasons["MoeBlock_0"]["wi_0"]
  grads = jax.tree.map(lambda v: gaussian(v.shape, 5), params)
  got = _direction(params, layout, grads)["MoeBlock_0"]["wi_0"]
  want = _per_matrix_update(
    grads["MoeBlock_0"]["wi_0"], lambda g: g, lambda m: m
  )
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_fused_qkv_kernel_sliced_into_wide_parts_stays_one_matrix():
  # slices wider than one index (q | k | v columns) are not indexed apart
  def attend(params, x):
    qkv = x @ params["qkv"]
    q, k, v = qkv[..., :16], qkv[..., 16:32], qkv[..., 32:]
    return (jax.nn.softmax(q @ k.swapaxes(-1, -2)) @ v) @ params["o"]

  params = {"qkv": jnp.zeros((16, 48)), "o": jnp.zeros((16, 16))}
  layout = om.infer_layout(attend, params, X, output=lambda out: ())
  assert layout.dimension_numbers["qkv"] == MDN((0,), (1,))


def test_a_stacked_weight_unpacked_by_python_is_one_matrix_per_part():
  # `a, b = w`: jax <= 0.10 slices and squeezes, jax >= 0.11 unstacks
  def f(params, x):
    first, second = params["w"]
    return jnp.tanh(x @ first) @ second

  layout = om.infer_layout(
    f, {"w": jnp.zeros((2, 8, 8))}, jnp.ones((2, 8)), output=lambda out: ()
  )
  assert layout.dimension_numbers["w"] == MDN((1,), (2,))


class GemmaKVLoRA(nnx.Module):
  """Gemma's fused kv_einsum with a qwix-shaped LoRA: B is (r, 2, K, H)."""

  def __init__(self, rngs):
    init = lambda key, shape: normal(key, shape) * jnp.float32(0.1)
    self.q = nnx.Param(init(rngs.params(), (2, 16, 8)))
    self.kv = nnx.Param(init(rngs.params(), (2, 2, 16, 8)))
    self.kv_a = nnx.LoRAParam(init(rngs.params(), (16, 4)))
    self.kv_b = nnx.LoRAParam(init(rngs.params(), (4, 2, 2, 8)))
    self.o = nnx.Param(init(rngs.params(), (2, 8, 16)))

  def __call__(self, x):
    q = jnp.einsum("btd,ndh->btnh", x, self.q[...])
    kv = jnp.einsum("bsd,ckdh->cbskh", x, self.kv[...]) + jnp.einsum(
      "bsr,rckh->cbskh", x @ self.kv_a[...], self.kv_b[...]
    )
    k, v = kv
    scores = jnp.einsum("btnh,bsnh->bnts", q, k)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores), v)
    return jnp.einsum("btnh,nhd->btd", out, self.o[...])


def test_gemmas_kv_lora_b_is_two_matrices_like_its_base():
  layout = om.infer_layout(GemmaKVLoRA(nnx.Rngs(0)), X, wrt=nnx.LoRAParam)
  assert layout.labels["kv_a"] == layout.labels["kv_b"] == "muon"
  assert layout.dimension_numbers["kv_b"] == MDN((0,), (2, 3))


def test_adapters_with_a_closed_over_base_are_matrices_not_heads():
  # only the adapters are params; the frozen base is closed over
  base = {"up": gaussian((16, 32), 1), "head": gaussian((32, 10), 2)}

  def forward(adapters, x):
    h = jax.nn.relu(x @ base["up"] + (x @ adapters["a"]) @ adapters["b"])
    return h @ base["head"]

  adapters = {"a": jnp.zeros((16, 4)), "b": jnp.zeros((4, 32))}
  layout = om.infer_layout(forward, adapters, jnp.ones((2, 16)))
  assert layout.roles == {"a": "matrix", "b": "matrix"}, layout.reasons
