"""One plan per leaf: ``om.describe(params, optimizer=tx)`` shows the mode
and the scale the update applies, and the cost model runs once for the
same leaves.

The applied scale and mode are read from the update itself: with lr 1 and
no decay, a Muon leaf's update is ``−scale · O``, where ``O`` is the
orthogonalization in the leaf's mode (``om.orthogonalize`` with the same
sharding, the mode the table names); so the table's scale times that ``O``
must give the update, which fails if either column is not what ran."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import normal
from optax_muon import compat
from optax_muon._src.parallel import cost
from optax_muon._src.parallel.execution import Execution

STACK = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)


def _mesh():
  return jax.make_mesh((8,), ("model",), axis_types=(AxisType.Explicit,))


def _rows(table: str) -> dict[str, dict[str, str]]:
  """The table's cells by path and column name."""
  lines = str(table).splitlines()
  header = re.split(r"\s{2,}", lines[0].strip())
  return {
    cells[0]: dict(zip(header, cells))
    for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[1:])
  }


def _placed(tree, specs, mesh):
  return jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )


def _applied_equals_described(tx, params, orthogonalized, rtol=2e-4):
  """For each Muon leaf: −update == the table's scale × ``orthogonalized``
  (the leaf's O in the table's mode, by path); the table's rows."""
  grads = jax.tree.map(
    lambda p: jax.device_put(normal(jax.random.key(1), p.shape), p.sharding),
    params,
  )
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  rows = _rows(om.describe(params, optimizer=tx))
  checked = 0
  for path, row in rows.items():
    if row["optimizer"] != "muon":
      continue
    scale = float(row["scale"])  # one piece each here
    want = scale * np.asarray(orthogonalized(path, row, grads))
    got = -np.asarray(updates[path])
    # the table prints 3 digits: the applied factor is the printed one
    np.testing.assert_allclose(got, want, rtol=5e-3, atol=5e-3 * scale)
    ratio = np.median(got / np.where(want == 0, 1, want)) * scale
    assert abs(ratio / scale - 1) < 5e-3, (path, ratio, scale)
    checked += 1
  return rows, checked


def test_blockwise_on_a_split_stack_is_scaled_by_the_shard_as_described():
  # issue 59: the table said √128 = 11.3 where √64 = 8.0 was applied
  mesh = _mesh()
  specs = {"stack": P(None, None, "model")}
  params = _placed({"stack": jnp.zeros((4, 64, 128))}, specs, mesh)
  sharding = om.TensorParallel(mesh, "model", "blockwise", specs=specs)
  tx = om.muon(1.0, dimension_numbers={"stack": STACK}, sharding=sharding)
  blockwise = om.orthogonalize(
    dimension_numbers={"stack": STACK}, sharding=sharding
  )
  rows, checked = _applied_equals_described(
    tx,
    params,
    lambda path, row, g: jax.jit(blockwise.update)(g, None)[0][path],
  )
  assert checked == 1
  assert rows["stack"]["scale"] == "8"
  assert rows["stack"]["tp mode"] == "blockwise"


def test_matched_rms_is_described_as_applied():
  # the table of the settings alone says 11.3; the optimizer's, 0.229 · 11.3
  params = {"w": jnp.zeros((64, 128)), "b": jnp.zeros(128)}
  tx = om.muon(1.0, match_adamw_update_rms=True)
  plain = om.orthogonalize()
  rows, checked = _applied_equals_described(
    tx, params, lambda path, row, g: plain.update(g[path], None)[0]
  )
  assert checked == 1
  assert float(rows["w"]["scale"]) == pytest.approx(
    om.adamw_rms_match_factor(0.9) * 128**0.5, rel=5e-3
  )
  assert _rows(om.describe(params))["w"]["scale"] == "11.3"


@pytest.mark.parametrize(
  "adjust_lr_fn, scale",
  # torch holds the (in 64, out 128) kernel as (A, B) = (128, 64)
  [(None, 2**0.5), ("original", 2**0.5), ("match_rms_adamw", 0.2 * 128**0.5)],
)
def test_torch_muon_is_described_as_applied(adjust_lr_fn, scale):
  params = {"w": jnp.zeros((64, 128)), "b": jnp.zeros(128)}
  tx = compat.torch_muon(
    1.0, adjust_lr_fn=adjust_lr_fn, precision="highest", weight_decay=0.0
  )
  torch_iteration = om.orthogonalize(
    coefficients=[(3.4445, -4.775, 2.0315)],
    eps=1e-7,  # torch.optim.Muon's
  )
  rows, checked = _applied_equals_described(
    tx, params, lambda path, row, g: torch_iteration.update(g[path], None)[0]
  )
  assert checked == 1
  assert float(rows["w"]["scale"]) == pytest.approx(scale, rel=5e-3)


@pytest.mark.parametrize("build", ["dion2", "dion2_matched", "MuonConfig"])
def test_dion2_is_described_with_its_own_scale(build):
  # every row selected: Dion2's step is its scale × O of the momentum (the
  # gradient, at the first step)
  params = {"w": jnp.zeros((64, 128))}
  plain = om.orthogonalize(coefficients="polar_express_dion")
  unit_rms = 2**0.5  # Dion2's default scale: √(fan_out / fan_in)
  if build == "dion2":
    tx, want = om.dion2(1.0, fraction=1.0), unit_rms
  elif build == "dion2_matched":
    # AdamW's β₁ reaches the factor (it stayed 0.9 before the plan)
    tx = om.dion2(1.0, fraction=1.0, match_adamw_update_rms=True, adam_b1=0.5)
    want = unit_rms * om.adamw_rms_match_factor(0.5)
  else:  # MuonConfig sets the family's spectral scale (√128)
    config = om.MuonConfig(optimizer="dion2", dion2_fraction=1.0)
    tx, want = config.build(1.0), 128**0.5
    plain = om.orthogonalize(
      coefficients=config.muon_coefficient_type,
      precision=config.muon_fp32_matmul_prec,
    )
  rows, checked = _applied_equals_described(
    tx, params, lambda path, row, g: plain.update(g[path], None)[0]
  )
  assert checked == 1
  assert float(rows["w"]["scale"]) == pytest.approx(want, rel=5e-3)


def test_auto_over_mixed_leaves_is_described_as_it_runs():
  mesh = _mesh()
  specs = {
    "stack": P(None, None, "model"),  # split: blockwise is cheapest
    "replicated": P(),  # not split over the TP axis
    "rows": P("model", None),
  }
  params = _placed(
    {
      "stack": jnp.zeros((4, 64, 128)),
      "replicated": jnp.zeros((48, 80)),
      "rows": jnp.zeros((128, 64)),
    },
    specs,
    mesh,
  )
  dims = {"stack": STACK, "replicated": None, "rows": None}
  auto = om.TensorParallel(
    mesh,
    "model",
    "auto",
    specs=specs,
    auto_modes=("duplicated", "distributed", "allgather", "blockwise"),
  )
  tx = om.muon(1.0, dimension_numbers=dims, sharding=auto)

  def in_its_mode(path, row, grads):
    fixed = om.TensorParallel(mesh, "model", row["tp mode"], specs=specs)
    tx = om.orthogonalize(dimension_numbers=dims, sharding=fixed)
    return jax.jit(tx.update)(grads, None)[0][path]

  rows, checked = _applied_equals_described(tx, params, in_its_mode)
  assert checked == 3
  modes = {path: row["tp mode"] for path, row in rows.items()}
  assert modes["stack"] == "blockwise"
  assert rows["stack"]["scale"] == "8"  # the shard's √64
  assert rows["replicated"]["scale"] == "8.94"  # the whole √80


def test_the_cost_model_runs_once_per_leaf_for_the_same_leaves(monkeypatch):
  calls = []
  mode_costs = cost.mode_costs
  monkeypatch.setattr(
    cost,
    "mode_costs",
    lambda *args, **kwargs: (
      calls.append(args[0].shape) or mode_costs(*args, **kwargs)
    ),
  )
  mesh = _mesh()
  specs = {"a": P(None, "model"), "b": P("model", None)}
  params = _placed(
    {"a": jnp.zeros((40, 64)), "b": jnp.zeros((64, 24))}, specs, mesh
  )
  sharding = om.TensorParallel(mesh, "model", "auto", specs=specs)
  tx = om.muon(0.1, sharding=sharding)
  state = tx.init(params)
  jax.jit(tx.update).lower(params, state, params)
  # the orthogonalization and the shape scale read one plan
  assert sorted(calls) == [(40, 64), (64, 24)]
  om.describe(params, optimizer=tx)
  jax.jit(tx.update).lower(params, state, params)  # a second trace
  assert len(calls) == 2


@pytest.mark.parametrize("memory_budget", [None, 3 << 20])
def test_the_budget_is_resolved_once_into_its_two_meanings(
  monkeypatch, memory_budget
):
  # every piece of om.muon (momentum, orthogonalization, shape scale) reads
  # one Execution: the budget is resolved when it is built, and only then
  resolved = []
  post_init = Execution.__post_init__

  def counted(self):
    post_init(self)
    resolved.append((self.wave_bytes, self.auto_limit))

  monkeypatch.setattr(Execution, "__post_init__", counted)
  mesh = _mesh()
  specs = {"a": P(None, "model"), "b": P("model", None)}
  params = _placed(
    {"a": jnp.zeros((40, 64)), "b": jnp.zeros((64, 24))}, specs, mesh
  )
  sharding = om.TensorParallel(mesh, "model", "auto", specs=specs)
  tx = om.muon(0.1, sharding=sharding, memory_budget=memory_budget)
  state = tx.init(params)
  jax.jit(tx.update).lower(params, state, params)
  # the waves' size is the budget or 2 GiB; auto's limit the budget or none
  assert resolved == [
    (memory_budget or 2 << 30, memory_budget),
  ]


def test_describe_with_an_optimizer_takes_no_other_setting():
  tx = om.muon(0.1)
  with pytest.raises(ValueError, match=r"\['steps'\] were also given"):
    om.describe({"w": jnp.zeros((4, 4))}, optimizer=tx, steps=3)
  with pytest.raises(ValueError, match="reads an optimizer built by one of"):
    om.describe({"w": jnp.zeros((4, 4))}, optimizer=optax.adam(0.1))
