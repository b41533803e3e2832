"""FSDP × TP: a stack whose matrix axis is sharded over ``data`` as well as
the tensor-parallel axis gives each data rank whole matrices of its share
of the stack (one all-to-all), so no two data ranks orthogonalize the same
matrix; the update equals the unsharded one."""

import re
import sys

import chex
import jax
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import ROOT
from conftest import normal
from optax_muon._src.parallel import fsdp as om_fsdp

sys.path.insert(0, str(ROOT / "benchmarks"))
import _hlo  # noqa: E402  (the benchmarks' HLO byte count)

EXACT = ("duplicated", "distributed", "allgather")


def _mesh(shape):
  return jax.make_mesh(
    shape, ("data", "model"), axis_types=(AxisType.Explicit,) * 2
  )


def _tree():
  keys = iter(jax.random.split(jax.random.key(3), 8))
  draw = lambda shape: normal(next(keys), shape)
  params = {
    "up": draw((8, 32, 64)),  # column-parallel, FSDP on its input axis
    "down": draw((8, 64, 32)),  # row-parallel, FSDP on its output axis
    "layers_fsdp": draw((8, 32, 64)),  # FSDP on the layer axis
    "per_layer": draw((32, 64)),  # no stack: gathered over data
    "experts": draw((2, 4, 32, 64)),  # layers x experts
    "experts_ep": draw((2, 4, 32, 64)),  # experts over data: EP
  }
  specs = {
    "up": P(None, "data", "model"),
    "down": P(None, "model", "data"),
    "layers_fsdp": P("data", None, "model"),
    "per_layer": P("data", "model"),
    "experts": P(None, None, "data", "model"),
    "experts_ep": P(None, "data", None, "model"),
  }
  return params, specs


def _put(tree, specs, mesh):
  return jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )


def _update(tx, params, mesh):
  with jax.set_mesh(mesh):
    return jax.jit(tx.update)(params, tx.init(params), params)[0]


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
@pytest.mark.parametrize("distribute_over", [None, "data"])
@pytest.mark.parametrize("mode", EXACT)
def test_fsdp_stacks_equal_the_unsharded_update(
  mesh_shape, distribute_over, mode
):
  mesh = _mesh(mesh_shape)
  params, specs = _tree()
  reference = om.scale_by_muon(dimension_numbers="leading")
  expected = reference.update(params, reference.init(params))[0]
  tp = om.TensorParallel(mesh, mode=mode, distribute_over=distribute_over)
  tx = om.scale_by_muon(dimension_numbers="leading", sharding=tp)
  got = _update(tx, _put(params, specs, mesh), mesh)
  chex.assert_trees_all_close(got, expected, atol=1e-5)
  for name, spec in specs.items():
    assert got[name].sharding.spec == spec, name


def test_blockwise_under_fsdp_is_blockwise_over_the_tp_axis_alone():
  mesh = _mesh((2, 4))
  params, specs = _tree()
  tx = om.scale_by_muon(
    dimension_numbers="leading",
    sharding=om.TensorParallel(mesh, mode="blockwise"),
  )
  got = _update(tx, _put(params, specs, mesh), mesh)
  tp_only = jax.tree.map(
    lambda s: P(*[None if a == "data" else a for a in s]), specs
  )
  expected = _update(tx, _put(params, tp_only, mesh), mesh)
  chex.assert_trees_all_close(got, expected, atol=1e-5)


def _compiled(tree, spec, mesh, mode, distribute_over=None):
  struct = {
    "w": jax.ShapeDtypeStruct(
      tree, "float32", sharding=NamedSharding(mesh, spec)
    )
  }
  tx = om.orthogonalize(
    dimension_numbers="leading",
    sharding=om.TensorParallel(
      mesh, mode=mode, distribute_over=distribute_over
    ),
  )
  with jax.set_mesh(mesh):
    compiled = (
      jax.jit(lambda u: tx.update(u, tx.init(u))[0]).lower(struct).compile()
    )
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, list) else analysis
  return analysis["flops"], _hlo.collective_bytes(compiled.as_text())


@pytest.mark.parametrize("mode", EXACT)
def test_each_data_rank_orthogonalizes_only_its_share_of_the_stack(mode):
  """16 layers on (data 4, model 2): FSDP on the matrix axis costs each
  device the Newton–Schulz FLOPs of FSDP on the layer axis (a quarter of
  the stack), not the whole stack's, and moves the stack's shard twice
  (two all-to-alls over data), not three times (an all-gather)."""
  mesh = _mesh((4, 2))
  shape = (16, 128, 256)
  on_matrix, matrix_bytes = _compiled(
    shape, P(None, "data", "model"), mesh, mode
  )
  on_layers, layer_bytes = _compiled(
    shape, P("data", None, "model"), mesh, mode
  )
  assert on_matrix <= 1.1 * on_layers, (on_matrix, on_layers)
  shard = 16 * 128 * 256 * 4 // 8  # bytes of one device's block
  over_data = matrix_bytes["all-to-all"] - layer_bytes["all-to-all"]
  assert over_data == pytest.approx(2 * shard, rel=0.01), matrix_bytes
  assert matrix_bytes["all-gather"] <= layer_bytes["all-gather"] + 64


@pytest.mark.parametrize("mode", EXACT)
def test_distribute_over_data_adds_no_bytes_under_fsdp(mode):
  mesh = _mesh((4, 2))
  spec = P(None, "data", "model")
  _, plain = _compiled((16, 128, 256), spec, mesh, mode)
  _, split = _compiled((16, 128, 256), spec, mesh, mode, "data")
  assert sum(split.values()) <= sum(plain.values()), (split, plain)


def _assert_up_and_down_exact(mesh, mode, layers):
  """An MLP's up and down stacks of ``layers`` under FSDP on the matrix
  axis (one allgather group): the update equals the unsharded one."""
  keys = iter(jax.random.split(jax.random.key(layers), 2))
  params = {
    "up": normal(next(keys), (layers, 32, 64)),
    "down": normal(next(keys), (layers, 64, 32)),
  }
  specs = {"up": P(None, "data", "model"), "down": P(None, "model", "data")}
  reference = om.scale_by_muon(dimension_numbers="leading")
  expected = reference.update(params, reference.init(params))[0]
  tx = om.scale_by_muon(
    dimension_numbers="leading", sharding=om.TensorParallel(mesh, mode=mode)
  )
  got = _update(tx, _put(params, specs, mesh), mesh)
  chex.assert_trees_all_close(got, expected, atol=1e-5)


@pytest.mark.parametrize("mode", EXACT)
def test_a_stack_too_short_to_share_is_gathered(mode):
  """2 layers over 4 data ranks: padded to 4, its all-to-alls would move
  more than a gather, so the matrix axis is gathered (every data rank does
  the whole stack), and the update is still exact, an MLP's up and down
  kernels in one allgather group included."""
  mesh = _mesh((4, 2))
  _assert_up_and_down_exact(mesh, mode, layers=2)
  _, moved = _compiled((2, 32, 64), P(None, "data", "model"), mesh, mode)
  assert moved["all-gather"] >= 2 * 32 * 64 * 4 / 2  # the stack, whole


@pytest.mark.parametrize("mode", EXACT)
def test_a_stack_the_data_axis_does_not_divide_is_padded_to_share(mode):
  """6 layers over 4 data ranks: padded with zero matrices to 8, two a
  rank; exact, and each device does 2 of the 6 layers' work (the padding's
  zero matrices included), not all 6."""
  mesh = _mesh((4, 2))
  _assert_up_and_down_exact(mesh, mode, layers=6)
  padded, moved = _compiled((6, 128, 256), P(None, "data", "model"), mesh, mode)
  two_layers, _ = _compiled((8, 128, 256), P("data", None, "model"), mesh, mode)
  assert padded <= 1.1 * two_layers, (padded, two_layers)
  assert moved["all-gather"] <= 2 * 128 * 256 * 4  # no stack gathered


def _crosses_rows(line: str, mesh) -> bool:
  """Whether a compiled collective runs across rows of ``mesh`` (over its
  first axis), its groups read by ``_hlo.replica_groups`` (places in the
  mesh's devices in order)."""
  groups = _hlo.replica_groups(line)
  rows = mesh.devices.shape[1]
  return any(len({i // rows for i in group}) > 1 for group in groups)


@pytest.mark.parametrize("mode", EXACT)
def test_experts_sharded_over_an_expert_axis_move_nothing_over_it(mode):
  """Experts ``[L, E, in, out]`` with E over ``data`` as the expert-parallel
  axis and tensor parallelism inside: every collective of the update runs
  within one row of the mesh (a model-axis group), none across experts."""
  mesh = _mesh((2, 4))
  struct = {
    "experts": jax.ShapeDtypeStruct(
      (2, 8, 32, 64),
      "float32",
      sharding=NamedSharding(mesh, P(None, "data", None, "model")),
    )
  }
  tx = om.orthogonalize(
    dimension_numbers="leading", sharding=om.TensorParallel(mesh, mode=mode)
  )
  with jax.set_mesh(mesh):
    hlo = (
      jax.jit(lambda u: tx.update(u, tx.init(u))[0])
      .lower(struct)
      .compile()
      .as_text()
    )
  collective = r"(all-gather|all-reduce|all-to-all|collective-permute)"
  lines = [
    l for l in hlo.splitlines() if re.search(collective + r"(-start)?\(", l)
  ]
  assert lines  # the mode's own tensor-parallel traffic
  for line in lines:
    assert not _crosses_rows(line, mesh), line


@pytest.mark.parametrize(
  "mode, budgets",
  [
    ("duplicated", (1, 200_000, 300_000)),
    ("distributed", (1, 80_000, 150_000)),
  ],
)
def test_homed_stacks_moved_in_parts_or_before_are_exact(
  mode, budgets, monkeypatch
):
  """A stack homed over data (10 layers, 5 a data rank) under budgets that
  move it home a part at a time (1 byte: parts of one layer), or make it
  whole before its waves (one part of 3 and one of 2: too few parts to move
  per part; or it fits whole): each path is taken, and each equals the
  unsharded update."""
  taken = []
  real = om_fsdp.in_task

  def spy(plans, axis, parts):
    got = real(plans, axis, parts)
    path = (
      "before" if got is None else "parts" if got[0].split_home else "whole"
    )
    taken.append(path)
    return got

  monkeypatch.setattr(om_fsdp, "in_task", spy)
  mesh = _mesh((2, 4))
  params = {"w": normal(jax.random.key(3), (10, 32, 64))}
  specs = {"w": P(None, "data", "model")}
  reference = om.scale_by_muon(dimension_numbers="leading")
  expected = reference.update(params, reference.init(params))[0]
  for budget in budgets:
    tx = om.scale_by_muon(
      dimension_numbers="leading",
      sharding=om.TensorParallel(mesh, mode=mode),
      memory_budget=budget,
    )
    got = _update(tx, _put(params, specs, mesh), mesh)
    chex.assert_trees_all_close(got, expected, atol=1e-5)
  assert taken == ["parts", "before", "before"]


def test_fsdp_homes_on_a_two_rank_data_axis():
  # the fast tier's other FSDP cases are on (4, 2) or split the work over
  # data: here each of 2 data ranks is home to half of each stack
  mesh = _mesh((2, 4))
  params, specs = _tree()
  reference = om.scale_by_muon(dimension_numbers="leading")
  expected = reference.update(params, reference.init(params))[0]
  for mode in EXACT:
    tx = om.scale_by_muon(
      dimension_numbers="leading", sharding=om.TensorParallel(mesh, mode=mode)
    )
    got = _update(tx, _put(params, specs, mesh), mesh)
    chex.assert_trees_all_close(got, expected, atol=1e-5)
  # an 8-layer stack FSDP'd on its matrix axis: half of it a data rank,
  # the shard moved twice over data (not gathered)
  on_matrix, matrix_bytes = _compiled(
    (8, 128, 256), P(None, "data", "model"), mesh, "duplicated"
  )
  on_layers, layer_bytes = _compiled(
    (8, 128, 256), P("data", None, "model"), mesh, "duplicated"
  )
  assert on_matrix <= 1.1 * on_layers, (on_matrix, on_layers)
  shard = 8 * 128 * 256 * 4 // 8
  over_data = matrix_bytes["all-to-all"] - layer_bytes["all-to-all"]
  assert over_data == pytest.approx(2 * shard, rel=0.01), matrix_bytes
