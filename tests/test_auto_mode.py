"""``TensorParallel(mode="auto")``: each leaf routed to the mode of least
modeled time, the model checked against the compiler's own counts, the
memory budget, the spectral and blockwise cases, and bad settings."""

import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import ROOT
from conftest import nnx_losses
from conftest import normal
from conftest import tp_mlp
from optax_muon._src.parallel import allgather
from optax_muon._src.parallel import cost
from optax_muon._src.parallel import rates as rates_lib
from optax_muon._src.parallel import waves
from optax_muon._src.views import layout

sys.path.insert(0, str(ROOT / "benchmarks"))
import _hlo  # noqa: E402  (the benchmarks' HLO byte count)

CPU = om.KNOWN_RATES["cpu"]
# rates that make one side of the model dominate
SLOW_LINK = om.DeviceRates(1e30, 1e30, 1e30, link_bytes=1e6, latency=0.0)
SLOW_MATMUL = om.DeviceRates(1e9, 1e9, 1e9, link_bytes=1e30, latency=0.0)


def _mesh(shape=(8,)):
  names = ("model",) if len(shape) == 1 else ("data", "model")
  return jax.make_mesh(
    shape, names, axis_types=(AxisType.Explicit,) * len(shape)
  )


def _tree():
  keys = iter(jax.random.split(jax.random.key(0), 8))
  draw = lambda shape: normal(next(keys), shape)
  params = {
    "square": draw((64, 64)),
    "wide_out": draw((32, 128)),
    "tall_in": draw((128, 32)),
    "short_side": draw((128, 16)),
    "stack": draw((16, 32, 64)),
    "small_stack": draw((2, 32, 48)),
    "replicated": draw((24, 40)),
  }
  specs = {
    "square": P(None, "model"),
    "wide_out": P(None, "model"),
    "tall_in": P("model", None),
    "short_side": P(None, "model"),
    "stack": P(None, None, "model"),
    "small_stack": P(None, "model", None),
    "replicated": P(),
  }
  return params, specs


def _put(tree, specs, mesh):
  return jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )


def _update(mesh, params, sharding, **kwargs):
  tx = om.scale_by_muon(
    dimension_numbers="leading", sharding=sharding, **kwargs
  )
  with jax.set_mesh(mesh):
    return jax.jit(tx.update)(params, tx.init(params), params)[0]


def _choices(params, tp, steps=5, precision="highest", budget=None, **kw):
  views = [v for _, _, v in layout.view_resolver("leading")(params)]
  itemsizes = [x.dtype.itemsize for x in jax.tree.leaves(params)]
  return cost.leaf_choices(
    tp,
    views,
    tp.leaf_specs(params),
    itemsizes,
    steps,
    precision,
    kw.get("preconditioning", "frobenius"),
    budget,
  )


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
def test_auto_equals_each_leafs_chosen_mode(mesh_shape):
  mesh = _mesh(mesh_shape)
  params, specs = _tree()
  sharded = _put(params, specs, mesh)
  by_mode = {
    mode: _update(mesh, sharded, om.TensorParallel(mesh, mode=mode))
    for mode in ("duplicated", "distributed", "allgather")
  }
  chosen, compiled = set(), set()
  for rates in (CPU, SLOW_LINK, SLOW_MATMUL):
    tp = om.TensorParallel(mesh, mode="auto", rates=rates)
    modes = [c.mode for c in _choices(sharded, tp)]
    chosen |= set(modes)
    if tuple(modes) in compiled:  # the same program as before
      continue
    compiled.add(tuple(modes))
    updates = _update(mesh, sharded, tp)
    for name, mode in zip(sorted(updates), modes):
      got = updates[name]
      run_as = "duplicated" if mode == "blockwise" else mode  # not sharded
      chex.assert_trees_all_close(got, by_mode[run_as][name], atol=1e-6)
  # the rates moved the choice: the routing itself was exercised
  assert {"duplicated", "distributed", "allgather"} <= chosen


def test_a_leaf_not_split_over_the_tp_axis_runs_blockwise():
  mesh = _mesh()
  params, specs = _tree()
  choices = _choices(
    _put(params, specs, mesh), om.TensorParallel(mesh, mode="auto")
  )
  assert choices[sorted(params).index("replicated")].mode == "blockwise"


@pytest.mark.parametrize(
  "shape, spec",
  [
    ((256, 1024), P(None, "model")),
    ((1024, 256), P("model", None)),
    ((16, 256, 1024), P(None, None, "model")),
  ],
)
def test_the_modeled_flops_and_bytes_are_the_compilers(shape, spec):
  """One Newton–Schulz step (the loop's first step is outside the
  ``fori_loop``, so the compiler's count is the whole step): the modeled
  FLOPs within 5 % of ``cost_analysis()``; the modeled bytes are the ring's
  share of the compiled collectives' results: ``(P−1)/P`` of a gather's or an
  all-to-all's, ``2(P−1)/P`` of an all-reduce's."""
  mesh = _mesh()
  tree = {
    "w": jax.ShapeDtypeStruct(
      shape, jnp.float32, sharding=NamedSharding(mesh, spec)
    )
  }
  view = layout.view_resolver("leading")(tree)[0][2]
  auto = om.TensorParallel(mesh, mode="auto")
  (leaf_spec,) = auto.leaf_specs(tree)
  for mode in ("duplicated", "distributed", "allgather"):
    tx = om.orthogonalize(
      steps=1,
      dimension_numbers="leading",
      sharding=om.TensorParallel(mesh, mode=mode),
    )
    with jax.set_mesh(mesh):
      compiled = (
        jax.jit(lambda u: tx.update(u, tx.init(u))[0]).lower(tree).compile()
      )
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    (modeled,) = cost.mode_costs(
      view, leaf_spec, 4, auto, 1, "highest", modes=[mode]
    )
    assert modeled.flops == pytest.approx(analysis["flops"], rel=0.05), mode
    results = _hlo.collective_bytes(compiled.as_text())
    ring = 7 / 8
    expected = ring * (
      results["all-gather"] + results["all-to-all"] + 2 * results["all-reduce"]
    )
    # the normalization's two scalars per matrix are not modeled
    assert modeled.bytes == pytest.approx(expected, rel=0.01), mode


def test_the_choice_is_the_least_modeled_time():
  mesh = _mesh()
  params, specs = _tree()
  sharded = _put(params, specs, mesh)
  names = sorted(params)
  # the 64 × 64 "square", split by columns over 8 ranks, 5 steps, float32,
  # modeled by hand: duplicated orthogonalizes it whole (5 · 6 · 64³ FLOPs)
  # after gathering 7/8 of it, with 3 collectives (max, norm, gather);
  # distributed splits the 4 m² n product 8 ways and all-reduces the
  # float32 Gram matrix each step (7 collectives); allgather has one
  # matrix of its shape, so it gathers as duplicated does
  by_hand = {
    "duplicated": (5 * 6 * 64**3, 64 * 64 * 4 * 7 / 8, 3),
    "distributed": (
      5 * (4 * 64**3 / 8 + 2 * 64**3),
      5 * 2 * 64 * 64 * 4 * 7 / 8,
      7,
    ),
  }
  for rates in (CPU, SLOW_LINK, SLOW_MATMUL):
    tp = om.TensorParallel(mesh, mode="auto", rates=rates)
    seconds = {
      mode: flops / rates.highest_flops
      + moved / rates.link_bytes
      + collectives * rates.latency
      for mode, (flops, moved, collectives) in by_hand.items()
    }
    choice = _choices(sharded, tp)[names.index("square")]
    assert choice.mode == min(seconds, key=seconds.get), (rates, seconds)
    modeled = {c.mode: c.seconds for c in choice.costs}
    for mode, want in seconds.items():
      assert modeled[mode] == pytest.approx(want, rel=1e-9), mode
    assert modeled["allgather"] == pytest.approx(seconds["duplicated"])
  # a slow link: the fewest bytes; slow matmuls: the fewest FLOPs
  slow_link = _choices(
    sharded, om.TensorParallel(mesh, mode="auto", rates=SLOW_LINK)
  )
  assert (
    slow_link[names.index("stack")].mode == "allgather"
  )  # 2/16 of the bytes
  assert slow_link[names.index("square")].mode == "duplicated"  # no Gram
  slow_matmul = _choices(
    sharded, om.TensorParallel(mesh, mode="auto", rates=SLOW_MATMUL)
  )
  assert slow_matmul[names.index("square")].mode == "distributed"
  assert slow_matmul[names.index("stack")].mode == "allgather"  # 2 of 16


def test_a_leaf_takes_the_cheapest_mode_whose_piece_fits_the_budget():
  mesh = _mesh()
  tree = _put(
    {"w": normal(jax.random.key(1), (256, 256))}, {"w": P(None, "model")}, mesh
  )
  tp = om.TensorParallel(
    mesh, mode="auto", auto_modes=("duplicated", "distributed"), rates=SLOW_LINK
  )
  (free,) = _choices(tree, tp)
  assert free.mode == "duplicated"  # the Gram all-reduces move 10x the bytes
  pieces = {c.mode: c.piece_bytes for c in free.costs}
  budget = (pieces["duplicated"] + pieces["distributed"]) // 2
  assert pieces["distributed"] < budget < pieces["duplicated"]
  (tight,) = _choices(tree, tp, budget=budget)
  assert tight.mode == "distributed"
  assert "memory budget" in tight.reason
  updates = _update(mesh, tree, tp, memory_budget=budget)
  expected = _update(mesh, tree, om.TensorParallel(mesh, mode="distributed"))
  chex.assert_trees_all_close(updates, expected, atol=1e-6)


def test_without_a_budget_given_time_alone_decides():
  """The default budget orders the waves, as in every fixed mode (a matrix
  whose work exceeds it runs alone); only a budget the user gives rules a
  mode out. An 8192 x 32768 matrix: its whole Newton-Schulz exceeds 2 GiB,
  a rank's columns of it do not."""
  mesh = _mesh()
  tree = {
    "w": jax.ShapeDtypeStruct(
      (8192, 32768),
      jnp.float32,
      sharding=NamedSharding(mesh, P(None, "model")),
    )
  }
  tp = om.TensorParallel(mesh, mode="auto", rates=SLOW_LINK)
  (free,) = _choices(tree, tp)
  assert free.mode == "duplicated"  # the fewest bytes
  pieces = {c.mode: c.piece_bytes for c in free.costs}
  default = waves.DEFAULT_MEMORY_BUDGET
  assert pieces["distributed"] < default < pieces["duplicated"]
  (given,) = _choices(tree, tp, budget=default)
  assert given.mode == "distributed"
  assert "memory budget" in given.reason
  # the transform decides as the model does: one gather, no Gram all-reduce
  # (only the normalization's scalars)
  for budget, gathers in ((None, True), (default, False)):
    tx = om.orthogonalize(
      dimension_numbers="leading", sharding=tp, memory_budget=budget
    )
    with jax.set_mesh(mesh):
      hlo = (
        jax.jit(lambda u, tx=tx: tx.update(u, tx.init(u))[0])
        .lower(tree)
        .compile()
        .as_text()
      )
    moved = _hlo.collective_bytes(hlo)
    assert (moved["all-gather"] > 0) == gathers, (budget, moved)
    assert (moved["all-reduce"] > 1e6) == (not gathers), (budget, moved)


def test_spectral_preconditioning_never_runs_distributed():
  mesh = _mesh()
  params, specs = _tree()
  sharded = _put(params, specs, mesh)
  tp = om.TensorParallel(mesh, mode="auto", rates=SLOW_MATMUL)
  assert "distributed" in {c.mode for c in _choices(sharded, tp)}
  spectral = _choices(sharded, tp, preconditioning="spectral")
  assert "distributed" not in {c.mode for c in spectral}
  updates = _update(mesh, sharded, tp, preconditioning="spectral")
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))


def test_auto_with_blockwise_allowed_scales_blockwise_leaves_by_their_shard():
  """A slow link makes every sharded leaf blockwise (no bytes): the update
  (the shape scale included) is ``mode="blockwise"``'s."""
  mesh = _mesh()
  params, specs = _tree()
  sharded = _put(params, specs, mesh)
  tp = om.TensorParallel(
    mesh,
    mode="auto",
    auto_modes=("blockwise", "duplicated", "distributed", "allgather"),
    rates=SLOW_LINK,
  )
  assert {c.mode for c in _choices(sharded, tp)} == {"blockwise"}
  for scale_mode in ("shape_scaling", "spectral"):
    got = _update(mesh, sharded, tp, scale_mode=scale_mode)
    expected = _update(
      mesh,
      sharded,
      om.TensorParallel(mesh, mode="blockwise"),
      scale_mode=scale_mode,
    )
    chex.assert_trees_all_close(got, expected, atol=1e-6)
  # the exact modes' own scale where the model picks one
  exact = _update(
    mesh, sharded, om.TensorParallel(mesh, mode="auto", rates=SLOW_LINK)
  )
  assert not np.allclose(
    np.asarray(exact["square"]),
    np.asarray(_update(mesh, sharded, tp)["square"]),
    atol=1e-3,
  )


def test_describe_shows_each_leafs_mode_and_why():
  mesh = _mesh()
  params, specs = _tree()
  sharded = _put(params, specs, mesh)
  tp = om.TensorParallel(mesh, mode="auto", rates=SLOW_LINK)
  table = om.describe(sharded, dimension_numbers="leading", sharding=tp)
  lines = {line.split()[0]: line for line in table.splitlines()}
  assert "tp mode" in lines["path"] and "why" in lines["path"]
  assert " allgather " in lines["stack"]
  assert "modeled allgather" in lines["stack"]  # the costs, cheapest first
  assert "duplicated" in lines["square"] and "distributed" in lines["square"]
  assert "not sharded over the TP axis" in lines["replicated"]
  fixed = om.describe(
    sharded,
    dimension_numbers="leading",
    sharding=om.TensorParallel(mesh, mode="distributed"),
  )
  fixed_lines = {line.split()[0]: line for line in fixed.splitlines()}
  # a short sharded side gathers (mode_for), as the update does
  assert " duplicated " in fixed_lines["short_side"]
  assert " distributed " in fixed_lines["square"]


def test_muon_config_and_nnx_take_auto():
  from flax import nnx

  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  with jax.set_mesh(mesh):
    model = tp_mlp(nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    tx = om.MuonConfig(muon_tp_mode="auto").build(0.02, mesh=mesh, specs=specs)
    losses = nnx_losses(model, tx, normal(jax.random.key(0), (32, 16)))
  assert losses[2] < losses[0]


def test_bad_auto_settings_raise(monkeypatch):
  mesh = _mesh()
  for modes in (
    ("blockwise",),
    ("auto",),
    ["duplicated"],
    ("duplicated", "duplicated"),
    ("gathered",),
  ):
    with pytest.raises(ValueError, match="sharding.auto_modes"):
      om.TensorParallel(mesh, mode="auto", auto_modes=modes)
  with pytest.raises(ValueError, match="sharding.rates"):
    om.TensorParallel(mesh, mode="auto", rates="h100")
  with pytest.raises(ValueError, match="DeviceRates.link_bytes"):
    om.DeviceRates(1e12, 1e12, 1e12, 0)
  with pytest.raises(ValueError, match="DeviceRates.latency"):
    om.DeviceRates(1e12, 1e12, 1e12, 1e9, latency=-1.0)
  # a unit slip (an H100 in TFLOP/s, NVLink in GB/s) and an infinite link
  with pytest.raises(ValueError, match="bf16_flops=989 .*not tera"):
    om.DeviceRates(989, 494, 67, 450e9)
  with pytest.raises(ValueError, match="link_bytes=450 .*not tera"):
    om.DeviceRates(989e12, 494e12, 67e12, 450)
  with pytest.raises(
    ValueError, match="DeviceRates.link_bytes must be a finite"
  ):
    om.DeviceRates(989e12, 494e12, 67e12, float("inf"))
  # auto's settings on a fixed mode would be read by nothing
  with pytest.raises(ValueError, match="sharding.auto_modes is read only by"):
    om.TensorParallel(mesh, mode="duplicated", auto_modes=("duplicated",))
  with pytest.raises(ValueError, match="sharding.rates is read only by"):
    om.TensorParallel(mesh, mode="allgather", rates=CPU)
  # muon_bp's block steps drop the full steps' auto settings, as they must
  om.muon_bp(0.02, sharding=om.TensorParallel(mesh, mode="auto", rates=CPU))
  monkeypatch.setattr(rates_lib, "KNOWN_RATES", {})
  with pytest.raises(ValueError, match="sharding.rates=om.DeviceRates"):
    om.TensorParallel(mesh, mode="auto")
  # a fixed mode needs no rates; given ones are taken
  om.TensorParallel(mesh, mode="duplicated")
  assert om.TensorParallel(mesh, mode="auto", rates=CPU).resolved_rates() is CPU


def test_the_known_parts_rates_match_their_device_kinds():
  mesh = _mesh()
  assert rates_lib.rates_of(mesh) is om.KNOWN_RATES["cpu"]
  h100 = om.KNOWN_RATES["NVIDIA H100"]
  # 989 TFLOP/s bf16 dense, NVLink 4 at 900 GB/s both ways
  assert (h100.bf16_flops, h100.link_bytes) == (989e12, 450e9)
  v5p = om.KNOWN_RATES["TPU v5"]  # the device_kind of a v5p chip
  assert v5p.name == "TPU v5p" and v5p.link_bytes == 300e9
  assert v5p.matmul_flops("highest") == pytest.approx(v5p.bf16_flops / 6)
  # across nodes: one 400 Gb/s InfiniBand port a GPU (DGX H100); a v5p
  # chip's 50 Gb/s of DCN between slices; a v5e host's 2 x 100 Gb/s over
  # its 8 chips
  assert h100.network_bytes == 50e9 and h100.link_for(True) == 50e9
  assert h100.link_for(False) == 450e9
  assert v5p.network_bytes == 6.25e9
  assert om.KNOWN_RATES["TPU v5e"].network_bytes == 3.125e9
  # no network figure: the link's rate across nodes too
  assert SLOW_LINK.link_for(True) == SLOW_LINK.link_bytes
  with pytest.raises(ValueError, match="DeviceRates.network_bytes"):
    om.DeviceRates(1e12, 1e12, 1e12, 1e9, network_bytes=50)


class _Device:
  """A stand-in for a device of another machine: its platform, host
  (``process_index``) and TPU slice."""

  def __init__(self, platform, process_index, slice_index=None):
    self.platform, self.process_index = platform, process_index
    self.slice_index = slice_index


class _Mesh:
  def __init__(self, devices, axis_names):
    self.devices, self.axis_names = np.array(devices), axis_names


def test_an_axis_crosses_nodes_where_its_groups_span_hosts_or_slices():
  # two GPU hosts of four: the data axis spans them, the model axis not;
  # laid out the other way round, the model axis does
  hosts = [[_Device("gpu", h) for _ in range(4)] for h in range(2)]
  mesh = _Mesh(hosts, ("data", "model"))
  assert rates_lib.crosses_nodes(mesh, "data")
  assert not rates_lib.crosses_nodes(mesh, "model")
  assert rates_lib.crosses_nodes(mesh, ("data", "model"))
  assert rates_lib.crosses_nodes(
    _Mesh(np.array(hosts).T, ("data", "model")), "model"
  )
  # TPU hosts of one slice are joined by ICI; two slices are not
  one_slice = [[_Device("tpu", h) for _ in range(4)] for h in range(2)]
  assert not rates_lib.crosses_nodes(_Mesh(one_slice, ("a", "b")), "a")
  two = [[_Device("tpu", 2 * s + h, s) for h in range(2)] for s in range(2)]
  assert rates_lib.crosses_nodes(_Mesh(two, ("a", "b")), "a")
  assert not rates_lib.crosses_nodes(_Mesh(two, ("a", "b")), "b")
  # this machine's simulated devices are one node
  assert not rates_lib.crosses_nodes(_mesh((2, 4)), "data")


# matmuls at 1e9 FLOP/s, the link free, the network at 1e6 bytes/s
NETWORKED = om.DeviceRates(
  1e9, 1e9, 1e9, link_bytes=1e30, latency=0.0, network_bytes=1e6
)


def test_an_axis_across_nodes_moves_its_bytes_at_the_network_rate(
  monkeypatch,
):
  # the 8 simulated devices taken as two nodes of four
  monkeypatch.setattr(rates_lib, "node_of", lambda device: device.id // 4)
  params, specs = _tree()
  names = sorted(params)
  # the 64 x 64 "square" over 8 ranks (the costs by hand in
  # test_the_choice_is_the_least_modeled_time): inside a node the link is
  # free and distributed's fewer FLOPs win; with the model axis across the
  # two nodes duplicated's 10x fewer bytes win at the network's rate
  duplicated = (5 * 6 * 64**3, 64 * 64 * 4 * 7 / 8)
  distributed = (5 * (4 * 64**3 / 8 + 2 * 64**3), 5 * 2 * 64 * 64 * 4 * 7 / 8)
  across = _mesh()
  tp = om.TensorParallel(across, mode="auto", rates=NETWORKED)
  choice = _choices(_put(params, specs, across), tp)[names.index("square")]
  modeled = {c.mode: c.seconds for c in choice.costs}
  for mode, (flops, moved) in (
    ("duplicated", duplicated),
    ("distributed", distributed),
  ):
    assert modeled[mode] == pytest.approx(flops / 1e9 + moved / 1e6)
  assert choice.mode == "duplicated"
  # the same square on a (2, 4) mesh, tensor parallel inside each node
  inside = jax.sharding.Mesh(
    np.array(jax.devices()[:8]).reshape(2, 4),
    ("data", "model"),
    axis_types=(AxisType.Explicit,) * 2,
  )
  tp = om.TensorParallel(
    inside, mode="auto", rates=NETWORKED, distribute_over="data"
  )
  choice = _choices(_put(params, specs, inside), tp)[names.index("square")]
  costs = {c.mode: c for c in choice.costs}
  assert choice.mode == "distributed"
  # duplicated's gather over 4 ranks is free; its results all-gathered over
  # the two data ranks (float32, half each) cross the nodes
  over_data = 64 * 64 * 4 / 2
  assert costs["duplicated"].bytes == pytest.approx(
    64 * 64 * 4 * 3 / 4 + over_data
  )
  assert costs["duplicated"].seconds == pytest.approx(
    costs["duplicated"].flops / 1e9 + over_data / 1e6
  )


@pytest.mark.parametrize(
  "rates",
  [CPU, SLOW_LINK, SLOW_MATMUL],
  ids=["cpu", "slow-link", "slow-matmul"],
)
def test_the_compiled_collectives_are_the_chosen_modes(rates):
  """The bytes the compiled ``auto`` program moves are the sum of its leaves'
  chosen modes' modeled bytes (each mode's bytes are the compiler's:
  ``test_the_modeled_flops_and_bytes_are_the_compilers``)."""
  mesh = _mesh()
  params, specs = _tree()
  sharded = _put(params, specs, mesh)
  tp = om.TensorParallel(mesh, mode="auto", rates=rates)
  choices = _choices(sharded, tp)
  modeled = sum(
    next(c for c in choice.costs if c.runs == choice.mode).bytes
    for choice in choices
  )
  tx = om.orthogonalize(dimension_numbers="leading", sharding=tp)
  with jax.set_mesh(mesh):
    hlo = (
      jax.jit(lambda u: tx.update(u, tx.init(u))[0])
      .lower(sharded)
      .compile()
      .as_text()
    )
  results = _hlo.collective_bytes(hlo)
  moved = (
    7
    / 8
    * (
      results["all-gather"] + results["all-to-all"] + 2 * results["all-reduce"]
    )
  )
  assert moved == pytest.approx(modeled, rel=0.02)


def _costs(shape, spec, itemsize, rates, modes=None):
  """``cost.mode_costs`` of one leaf over 8 ranks of ``model``, by mode."""
  tp = om.TensorParallel(_mesh(), mode="auto", rates=rates)
  view = layout.matrix_view(shape, "leading")
  (normalized,) = tp.leaf_specs(
    {
      "w": jax.ShapeDtypeStruct(
        shape, "float32", sharding=NamedSharding(tp.mesh, spec)
      )
    }
  )
  found = cost.mode_costs(
    view, normalized, itemsize, tp, 5, "highest", modes=modes
  )
  return {c.mode: c for c in found}


def test_each_collective_costs_its_latency():
  # links and matmuls free: a mode's time is its collectives × latency,
  # counted by hand: duplicated all-reduces the max and the norm, then
  # gathers (3); distributed all-reduces the Gram matrix each of 5 steps
  # and the max and norm once (7)
  free = om.DeviceRates(1e30, 1e30, 1e30, 1e30, latency=1.0)
  costs = _costs((64, 64), P(None, "model"), 4, free)
  assert costs["duplicated"].seconds == pytest.approx(3.0)
  assert costs["distributed"].seconds == pytest.approx(7.0)
  mesh = _mesh()
  tree = _put(
    {"w": normal(jax.random.key(1), (64, 64))}, {"w": P(None, "model")}, mesh
  )
  tp = om.TensorParallel(mesh, mode="auto", rates=free)
  assert [c.mode for c in _choices(tree, tp)] == ["duplicated"]


@pytest.mark.parametrize("dtype, itemsize", [("bfloat16", 2), ("float32", 4)])
def test_allgather_moves_its_elements_at_the_leafs_own_itemsize(
  dtype, itemsize
):
  # 16 matrices of 32 × 64 over 8 ranks: 2 whole ones each, sent and sent
  # back by two all-to-alls, each moving 7/8 of them
  moved = 2 * 2 * 32 * 64 * itemsize * 7 / 8
  costs = _costs(
    (16, 32, 64), P(None, None, "model"), itemsize, CPU, ["allgather"]
  )
  assert costs["allgather"].bytes == pytest.approx(moved)
  # and what auto reads for a bfloat16 tree is its bytes: the compiled ones
  mesh = _mesh()
  leaf = normal(jax.random.key(2), (16, 32, 64)).astype(dtype)
  tx = om.orthogonalize(
    dimension_numbers="leading",
    sharding=om.TensorParallel(mesh, mode="allgather"),
  )
  struct = {
    "w": jax.ShapeDtypeStruct(
      leaf.shape,
      leaf.dtype,
      sharding=NamedSharding(mesh, P(None, None, "model")),
    )
  }
  with jax.set_mesh(mesh):
    hlo = (
      jax.jit(lambda u: tx.update(u, tx.init(u))[0])
      .lower(struct)
      .compiler_ir("hlo")
      .as_hlo_text()
    )
  # the all-to-alls JAX asks for carry the stack's shards in its dtype, 2 ×
  # 16·32·64/8 (XLA:CPU then widens bfloat16 ones to float32; the TPU and
  # GPU compilers keep them)
  assert (
    _hlo.collective_bytes(hlo)["all-to-all"] == 2 * 16 * 32 * 64 // 8 * itemsize
  )


@pytest.mark.parametrize("link_bytes", [1e9, 1e11], ids=["exposed", "hidden"])
def test_a_pipelined_stack_hides_its_transfers_under_its_other_parts(
  monkeypatch, link_bytes
):
  """``allgather``'s modeled time counts the overlap of its pipelined parts
  (``waves._pipelined_parts``), as the schedule reader does: a stack of 64
  matrices of 64 × 128 over 8 ranks is 8 whole matrices a rank; a wave
  budget of three matrices' pieces cuts them into 4 parts of 2 (pipelined:
  three parts in flight), each part's transfers ``c`` beside a neighbour's
  Newton–Schulz ``s``. Counted by hand: exposed ``c + 2 max(0, c/2 − s) +
  2 max(0, c − s)``; in one part, or where parts are not pipelined (TPUs),
  all of it."""
  rates = om.DeviceRates(1e10, 1e10, 1e10, link_bytes=link_bytes, latency=0)
  tp = om.TensorParallel(_mesh(), mode="auto", rates=rates)
  shape, itemsize = (64, 64, 128), 4
  view = layout.matrix_view(shape, "leading")
  (spec,) = tp.leaf_specs(
    {
      "w": jax.ShapeDtypeStruct(
        shape,
        "float32",
        sharding=NamedSharding(tp.mesh, P(None, None, "model")),
      )
    }
  )
  compute = 8 * 5 * (4 * 64**2 * 128 + 2 * 64**3) / 1e10
  transfer = 2 * 8 * 64 * 128 * itemsize * 7 / 8 / link_bytes
  c, s = transfer / 4, compute / 4
  exposed = c + 2 * max(0.0, c / 2 - s) + 2 * max(0.0, c - s)
  piece = (
    waves.newton_schulz_bytes(64, 128, 1, itemsize) + 2 * itemsize * 64 * 128
  )

  def seconds(wave_bytes):
    (found,) = cost.mode_costs(
      view, spec, itemsize, tp, 5, "highest", None, ["allgather"], wave_bytes
    )
    return found.seconds

  assert seconds(3 * piece) == pytest.approx(compute + exposed, rel=1e-12)
  assert exposed < transfer
  # the whole stack in one wave (the default 2 GiB): nothing to hide under
  assert seconds(waves.DEFAULT_MEMORY_BUDGET) == pytest.approx(
    compute + transfer, rel=1e-12
  )
  # not pipelined (TPUs): all of it, whatever the parts
  monkeypatch.setattr(allgather, "pipelines", lambda tp: False)
  assert seconds(3 * piece) == pytest.approx(compute + transfer, rel=1e-12)


def test_the_waves_cut_a_stack_into_the_parts_the_model_counts():
  """``waves.parts_of``, which the cost model reads, is how the planner
  cuts a split task (``waves.part_sizes``): 8 slices of 1000 bytes, each
  budget from 2 to 9 slices' bytes, pipelined (three parts in flight) or
  not; a task within its budget runs whole (one part)."""
  piece = 1000
  for pipelined in (True, False):
    task = waves.Task(
      [jax.ShapeDtypeStruct((8, 4, 4), "float32")],
      None,
      None,
      None,
      8 * piece,
      0,
      pipelined=pipelined,
    )
    for budget in range(2 * piece, 10 * piece, piece):
      (size,) = waves.part_sizes([task], budget)
      parts = -(-8 // size) if size else 1
      assert waves.parts_of(8, piece, budget, pipelined) == parts, budget
  assert waves.parts_of(8, piece, 3 * piece, pipelined=True) == 4
  assert waves.parts_of(8, piece, 5 * piece, pipelined=False) == 2
