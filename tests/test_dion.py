"""om.dion: against microsoft/dion's dion_reference.py (recorded by
tests/data/record_dion.py), the low rank, error feedback and QR-sign
invariance, stacks, bad input, and a sharded run."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import DATA
from conftest import gaussian

RECORDED = np.load(DATA / "dion.npz")
META = json.loads((DATA / "dion.json").read_text())
COUNT = len(META["shapes"])
TORCH_WEIGHTS = [RECORDED[f"weight_{i}"] for i in range(COUNT)]
TORCH_GRADS = [
  [RECORDED[f"grad_{step}_{i}"] for i in range(COUNT)]
  for step in range(META["steps"])
]


def _ours(setting: dict, **extra) -> optax.GradientTransformation:
  """A recorded setting under our names (dion's ``mu`` is ``ef_decay``; its
  weight decay default 0.01)."""
  setting = dict(setting)
  learning_rate = setting.pop("lr")
  kwargs = dict(
    weight_decay=setting.pop("weight_decay", 0.01),
    ef_decay=setting.pop("mu", 0.95),
    rank_fraction=setting.pop("rank_fraction", 1.0),
    power_iters=setting.pop("power_iters", 1),
  )
  assert not setting, f"not translated: {setting}"
  return om.dion(learning_rate, **kwargs, **extra)


def _dion_state(state) -> om.DionState:
  (only,) = [
    s
    for s in jax.tree.leaves(
      state, is_leaf=lambda s: isinstance(s, om.DionState)
    )
    if isinstance(s, om.DionState)
  ]
  return only


def _with_q(state, qs):
  """``state`` with its Dion ``Q``s replaced (one matrix per leaf)."""
  return jax.tree.map(
    lambda s: (
      s._replace(q=[(jnp.asarray(q)[None],) for q in qs])
      if isinstance(s, om.DionState)
      else s
    ),
    state,
    is_leaf=lambda s: isinstance(s, om.DionState),
  )


def _run(name, **extra):
  """The recorded steps from dion's first Q, on our (in, out) weights; the
  weights and momenta come back in torch's (out, in) order."""
  tx = _ours(META["settings"][name], **extra)
  params = [jnp.asarray(w.T) for w in TORCH_WEIGHTS]
  first_q = [RECORDED[f"{name}/fp32/q0_{i}"] for i in range(COUNT)]
  state = _with_q(tx.init(params), first_q)
  update = jax.jit(tx.update)
  for grads in TORCH_GRADS:
    updates, state = update([jnp.asarray(g.T) for g in grads], state, params)
    params = optax.apply_updates(params, updates)
  momenta = _dion_state(state).momentum
  return [np.asarray(w).T for w in params], [np.asarray(m).T for m in momenta]


def _off_by(got, want):
  """Per matrix: ‖got − want‖ over ‖want − start‖ (of dion's displacement)."""
  return [
    float(np.linalg.norm(g - w) / np.linalg.norm(w - s))
    for g, w, s in zip(got, want, TORCH_WEIGHTS)
  ]


@pytest.mark.parametrize("qr_method", ["qr", "rcqr"])
@pytest.mark.parametrize("name", sorted(META["settings"]))
def test_equals_microsoft_dion_in_float32(name, qr_method):
  finals, momenta = _run(name, qr_method=qr_method)
  want = [RECORDED[f"{name}/fp32/final_{i}"] for i in range(COUNT)]
  exact = [RECORDED[f"{name}/fp64/final_{i}"] for i in range(COUNT)]
  # measured with "qr" 3.1e-6 to 8.2e-6 from dion's float32 run, 2.5e-6 to
  # 9.3e-6 from its float64 run ("rcqr" 6.6e-6, 7.6e-6 at most), where dion's
  # own float32 run is 2.0e-6 to 9.0e-6 off: the float32 floor (dion's randomized Cholesky QR, with its
  # own sketch, and Householder QR give the same update up to rounding)
  assert max(_off_by(finals, want)) <= 2e-5, _off_by(finals, want)
  assert max(_off_by(finals, exact)) <= 2e-5, _off_by(finals, exact)
  for got, expected in zip(momenta, range(COUNT)):
    recorded = RECORDED[f"{name}/fp32/momentum_{expected}"]
    off = np.linalg.norm(got - recorded) / np.linalg.norm(recorded)
    assert off <= 1e-5, (expected, off)


def _tree(seed):
  return {
    "a": gaussian((24, 40), seed),
    "b": gaussian((40, 24), seed + 1),
    "c": gaussian((32, 32), seed + 2),
  }


def _steps(tx, count=3, params=None):
  params = _tree(0) if params is None else params
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(count):
    grads = jax.tree.map(lambda p: gaussian(p.shape, 10 + step), params)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize(
  "shape, fraction, multiple, rank",
  [((24, 40), 0.25, 1, 6), ((40, 24), 0.25, 4, 8), ((32, 32), 0.1, 1, 4)]
  + [((7, 40), 1.0, 8, 7)],
)
def test_the_step_has_the_rank_and_the_shapes_of_dion(
  shape, fraction, multiple, rank
):
  # r = ⌈fraction · shorter / multiple⌉ · multiple, at most the shorter side
  g = gaussian(shape, 3)
  tx = om.scale_by_dion(rank_fraction=fraction, rank_multiple_of=multiple)
  state = tx.init({"w": g})
  chex.assert_shape(state.q["w"][0], (1, min(shape), rank))
  direction, state = tx.update({"w": g}, state)
  assert int(np.linalg.matrix_rank(np.asarray(direction["w"]))) == rank
  chex.assert_shape(state.q["w"][0], (1, min(shape), rank))


def test_at_full_rank_the_error_feedback_keeps_ef_decay_of_the_sum():
  # P Rᵀ = P Pᵀ B = B when P spans B's columns: M ← ef_decay · (M + g)
  tx = om.scale_by_dion(ef_decay=0.7)
  params = _tree(0)
  state = tx.init(params)
  grads = [_tree(5), _tree(9)]
  _, state = tx.update(grads[0], state)
  _, state = tx.update(grads[1], state)
  want = jax.tree.map(lambda a, b: 0.7 * (0.7 * a + b), grads[0], grads[1])
  chex.assert_trees_all_close(state.momentum, want, atol=2e-5, rtol=0)


def test_the_step_does_not_depend_on_the_signs_of_q():
  # a QR's column signs are arbitrary: a flipped column of Q flips P's and
  # R's alike, so dion's randomized QR and ours give the same update
  tx = om.scale_by_dion(rank_fraction=0.5)
  g = {"w": gaussian((24, 40), 1)}
  state = tx.init(g)
  signs = jnp.where(jnp.arange(12) % 3 == 0, -1.0, 1.0)
  flipped = state._replace(q={"w": (state.q["w"][0] * signs,)})
  for _ in range(2):
    direction, state = tx.update(g, state)
    again, flipped = tx.update(g, flipped)
    chex.assert_trees_all_close(direction, again, atol=1e-6, rtol=0)
    chex.assert_trees_all_close(
      state.momentum, flipped.momentum, atol=1e-6, rtol=0
    )


def test_rcqr_takes_the_steps_of_householder_qr():
  # the sketched Cholesky QR's basis is QR's: the same P up to column signs
  # (measured 1e-6 apart at rank 20 and 12 over 3 steps)
  dims = {"a": None, "b": None, "c": None}
  qr = om.dion(0.02, rank_fraction=0.5, dimension_numbers=dims)
  rcqr = om.dion(
    0.02, rank_fraction=0.5, dimension_numbers=dims, qr_method="rcqr"
  )
  chex.assert_trees_all_close(_steps(rcqr)[0], _steps(qr)[0], atol=1e-5, rtol=0)


def test_a_zero_gradient_gives_a_zero_step_and_keeps_q():
  tx = om.scale_by_dion(rank_fraction=0.5)
  zeros = {"w": jnp.zeros((16, 24))}
  state = tx.init(zeros)
  direction, after = tx.update(zeros, state)
  np.testing.assert_array_equal(direction["w"], 0.0)
  norms = np.linalg.norm(np.asarray(state.q["w"][0]), axis=-2, keepdims=True)
  np.testing.assert_allclose(after.q["w"][0], state.q["w"][0] / norms, 1e-6)


class StackTest(chex.TestCase):
  @chex.variants(with_jit=True, without_jit=True)
  def test_a_stack_is_its_matrices_one_by_one(self):
    stack = gaussian((3, 24, 40), 4)
    dims = om.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    tx = om.scale_by_dion(dimension_numbers={"w": dims}, rank_fraction=0.5)
    one = om.scale_by_dion(rank_fraction=0.5)
    state = tx.init({"w": stack})
    chex.assert_shape(state.q["w"][0], (3, 24, 12))
    stacked, _ = self.variant(tx.update)({"w": stack}, state)
    for i in range(3):
      alone_state = one.init({"w": stack[i]})
      alone_state = alone_state._replace(q={"w": (state.q["w"][0][i : i + 1],)})
      alone, _ = one.update({"w": stack[i]}, alone_state)
      chex.assert_trees_all_close(stacked["w"][i], alone["w"], atol=1e-5)


def test_a_memory_budget_runs_a_stack_in_parts_with_the_same_step():
  # 5 matrices of 24×40 at rank 12: wave_bytes 4·(3·40·24 + 3·40·12 +
  # 3·24·12 + 128·40) = 41216 each; 100000 bytes run parts of 2 (2, 2, 1)
  stack = {"w": gaussian((5, 24, 40), 4)}
  dims = {"w": om.MuonDimensionNumbers(reduction_axis=1, output_axis=2)}
  whole = om.scale_by_dion(rank_fraction=0.5, dimension_numbers=dims)
  parts = om.scale_by_dion(
    rank_fraction=0.5, dimension_numbers=dims, memory_budget=100_000
  )
  hlo = jax.jit(parts.update).lower(stack, parts.init(stack)).as_text()
  assert "while" in hlo  # the parts run one after another
  want, want_state = whole.update(stack, whole.init(stack))
  got, got_state = parts.update(stack, parts.init(stack))
  chex.assert_trees_all_close(got, want, atol=1e-6, rtol=0)
  chex.assert_trees_all_close(got_state, want_state, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
  "kwargs, field",
  [
    (dict(rank_fraction=0), "rank_fraction"),
    (dict(rank_fraction=1.5), "rank_fraction"),
    (dict(rank_fraction="0.25"), "rank_fraction"),
    (dict(rank_fraction=True), "rank_fraction"),
    (dict(rank_multiple_of=0), "rank_multiple_of"),
    (dict(rank_multiple_of=2.0), "rank_multiple_of"),
    (dict(power_iters=0), "power_iters"),
    (dict(ef_decay=1.5), "ef_decay"),
    (dict(epsilon=-1.0), "epsilon"),
    (dict(seed="0"), "seed"),
    (dict(precision="fp64"), "precision"),
    (dict(scale_mode="rms"), "scale_mode"),
    (dict(mu_dtype=om.QuantizedMomentum()), "mu_dtype"),
    (dict(memory_budget=0), "memory_budget"),
    (dict(qr_method="householder"), "qr_method"),
  ],
)
def test_bad_input_names_the_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    om.scale_by_dion(**kwargs)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_sharded_params_give_the_unsharded_update(mesh_shape, axis_type):
  mesh = jax.make_mesh(
    mesh_shape, ("data", "model"), axis_types=(axis_type,) * 2
  )
  params = {"a": gaussian((32, 48), 0), "b": gaussian((48, 32), 1)}
  spec = {"a": P("data", "model"), "b": P("model", "data")}
  sharded = jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, spec
  )
  tx = om.dion(0.02, rank_fraction=0.5, weight_decay=0.1)
  want, _ = _steps(tx, 3, params)
  got, _ = _steps(tx, 3, sharded)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)


def test_a_resumed_state_continues_bit_for_bit():
  tx = om.dion(0.02, rank_fraction=0.5)
  params, state = _steps(tx, 2)
  restored = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), state)
  grads = jax.tree.map(lambda p: gaussian(p.shape, 99), params)
  once, _ = jax.jit(tx.update)(grads, state, params)
  again, _ = jax.jit(tx.update)(grads, restored, params)
  chex.assert_trees_all_equal(once, again)


def test_nnx_optimizer_takes_the_functional_steps():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.hidden = nnx.Linear(24, 40, rngs=rngs)
      self.out = nnx.Linear(40, 8, rngs=rngs)

    def __call__(self, x):
      return self.out(jax.nn.relu(self.hidden(x)))

  def loss(model, x):
    return jnp.mean(model(x) ** 2)

  tx = om.dion(0.02, rank_fraction=0.5)
  model = Net(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  state = tx.init(params)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = gaussian((4, 24), 7)
  for _ in range(3):
    grads = nnx.grad(loss)(model, x)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    optimizer.update(model, grads)
  chex.assert_trees_all_equal(nnx.state(model, nnx.Param), params)
