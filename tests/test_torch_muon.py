"""compat.torch_muon against torch.optim.Muon (torch 2.13.0, recorded by
tests/data/record_torch_muon.py), and precision="bf16"."""

import json
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_muon as om
from conftest import DATA
from conftest import gaussian
from optax_muon import compat

RECORDED = np.load(DATA / "torch_muon.npz")
META = json.loads((DATA / "torch_muon.json").read_text())
TORCH_WEIGHTS = [RECORDED[f"weight/{i}"] for i in range(len(META["shapes"]))]
TORCH_GRADS = [
  [RECORDED[f"grad/{step}/{i}"] for i in range(len(TORCH_WEIGHTS))]
  for step in range(META["steps"])
]


def _run(tx, weight_order):
  """Five steps on the recorded gradients; the weights come back in torch's
  (out, in) order whichever order the optimizer saw."""
  to = (lambda w: w) if weight_order == "out_in" else (lambda w: w.T)
  params = [jnp.asarray(to(w)) for w in TORCH_WEIGHTS]
  state = tx.init(params)
  update = jax.jit(tx.update)
  for grads in TORCH_GRADS:
    updates, state = update([jnp.asarray(to(g)) for g in grads], state, params)
    params = optax.apply_updates(params, updates)
  return [np.asarray(to(np.asarray(w))) for w in params]


def _off_by(got, want):
  """‖got − want‖ over ‖want − start‖, all weights together."""
  error = sum(np.sum((g - w) ** 2) for g, w in zip(got, want))
  moved = sum(np.sum((w - s) ** 2) for w, s in zip(want, TORCH_WEIGHTS))
  return float(np.sqrt(error / moved))


CASES = [
  (name, order) for name in META["settings"] for order in ("in_out", "out_in")
]


@pytest.mark.parametrize("name,weight_order", CASES)
def test_torch_muon_equals_torch_in_bf16(name, weight_order):
  settings = META["settings"][name]
  got = _run(
    compat.torch_muon(**settings, weight_order=weight_order), weight_order
  )
  want = [RECORDED[f"{name}/bf16/{i}"] for i in range(len(TORCH_WEIGHTS))]
  # at most 0.25% on this data (defaults: 0.13%, 0.14%, 0.36% by matrix):
  # XLA's fp32 sums are not oneDNN's, and the bf16 iteration amplifies their
  # last bit (see test_torchs_own_bf16_result_moves_with_its_summation_order)
  assert _off_by(got, want) <= 3.5e-3, _off_by(got, want)


def test_torchs_own_bf16_result_moves_with_its_summation_order():
  # the floor of any comparison: torch with every bf16 sum rounded once from
  # its exact value is itself 0.19% from torch (and up to 0.74% per call)
  want = [RECORDED[f"defaults/bf16/{i}"] for i in range(len(TORCH_WEIGHTS))]
  exact = [
    RECORDED[f"defaults/bf16_exact_sums/{i}"] for i in range(len(TORCH_WEIGHTS))
  ]
  assert 1e-3 < _off_by(exact, want) < 3e-3


@pytest.mark.parametrize("name,weight_order", CASES)
def test_torch_muon_at_highest_equals_torch_in_fp32(name, weight_order):
  settings = META["settings"][name]
  tx = compat.torch_muon(
    **settings, weight_order=weight_order, precision="highest"
  )
  got = _run(tx, weight_order)
  want = [RECORDED[f"{name}/fp32/{i}"] for i in range(len(TORCH_WEIGHTS))]
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)
  assert _off_by(got, want) <= 1e-4


@pytest.mark.parametrize("weight_order", ["in_out", "out_in"])
def test_a_square_matrix_is_iterated_as_torch_holds_it(weight_order):
  # torch's Muon iterates a square (out, in) weight untransposed; the bf16
  # rounding depends on the orientation (the exact polar factor does not)
  g = jnp.asarray(TORCH_GRADS[0][2])  # 96 × 96, torch's (out, in)
  leaf = g if weight_order == "out_in" else g.T
  tx = compat.torch_muon(
    lr=1.0, weight_decay=0.0, momentum=0.0, weight_order=weight_order
  )
  update, _ = tx.update({"w": leaf}, tx.init({"w": leaf}), {"w": leaf})
  got = -update["w"] if weight_order == "out_in" else -update["w"].T
  ns = lambda x: om.newton_schulz(
    x, coefficients=[compat_triple()], steps=5, precision="bf16", eps=1e-7
  )
  torchs, other = ns(g), ns(g.T).T
  apart = float(jnp.linalg.norm(torchs - other))
  assert apart > 1e-3 * float(jnp.linalg.norm(torchs))  # orientation shows
  assert float(jnp.linalg.norm(got - torchs)) <= 0.05 * apart


def compat_triple():
  import inspect

  return (
    inspect.signature(compat.torch_muon).parameters["ns_coefficients"].default
  )


def test_bf16_is_closer_to_torch_than_the_fp32_iteration():
  # the reason precision="bf16" exists: torch's default numbers are those of
  # a bf16 iterate, which an fp32 iteration (or "medium") does not give
  want = [RECORDED[f"defaults/bf16/{i}"] for i in range(len(TORCH_WEIGHTS))]
  off = {
    precision: _off_by(
      _run(compat.torch_muon(precision=precision), "in_out"), want
    )
    for precision in ("bf16", "highest", "medium")
  }
  assert off["bf16"] < 0.75 * off["highest"], off
  assert off["highest"] < off["medium"], off


def test_torch_order_ignored_is_caught():
  # (out, in) weights read as (in, out) get the wrong shape scale
  got = _run(compat.torch_muon(weight_order="in_out"), "out_in")
  want = [RECORDED[f"defaults/bf16/{i}"] for i in range(len(TORCH_WEIGHTS))]
  assert _off_by(got, want) > 0.1


def test_torch_muon_routes_the_rest_to_adamw():
  # torch's Muon takes 2-D params only; here the rest rides along to AdamW
  # with torch.optim.AdamW's default decay (0.01), on the AdamW group's
  # matrices (the embedding) as om.muon masks it; the bias does not decay
  params = {
    "w": jnp.asarray(TORCH_WEIGHTS[2]),
    "b": jnp.ones(96),
    "embed": jnp.ones((10, 96)),
  }
  grads = {
    "w": jnp.asarray(TORCH_GRADS[0][2]),
    "b": jnp.full(96, 0.5),
    "embed": jnp.full((10, 96), 0.5),
  }
  tx = compat.torch_muon(lr=0.02)
  updates, _ = tx.update(grads, tx.init(params), params)
  for name, decay in (("b", 0.0), ("embed", 0.01)):
    adamw = optax.adamw(0.02, weight_decay=decay)
    one = {name: params[name]}
    want, _ = adamw.update({name: grads[name]}, adamw.init(one), one)
    chex.assert_trees_all_close(updates[name], want[name], rtol=1e-6)


def test_a_head_not_named_head_goes_to_adamw_with_a_layout():
  # a last layer named "out": by name it is a matrix (Muon); the layout
  # reads it as the head, and its update is then AdamW's
  params = {"hidden": gaussian((32, 64), 0), "out": gaussian((64, 10), 1)}
  forward = lambda p, x: jax.nn.relu(x @ p["hidden"]) @ p["out"]
  layout = om.infer_layout(forward, params, jnp.ones((4, 32)))
  grads = {"hidden": gaussian((32, 64), 2), "out": gaussian((64, 10), 3)}
  tx = compat.torch_muon(lr=0.02, layout=layout)
  updates, _ = tx.update(grads, tx.init(params), params)
  adamw = optax.adamw(0.02, weight_decay=0.01)
  out = {"out": params["out"]}
  want, _ = adamw.update({"out": grads["out"]}, adamw.init(out), out)
  chex.assert_trees_all_close(updates["out"], want["out"], rtol=1e-6)
  assert om.default_labels(params)["out"] == "muon"


def _scales(table):
  """{path: scale} from a routing table's Muon rows."""
  rows = [re.split(r"\s{2,}", line) for line in str(table).splitlines()[1:]]
  return {row[0]: float(row[5]) for row in rows if row[3] == "muon"}


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("weight_order", ["in_out", "out_in"])
def test_describe_torch_muon_shows_torchs_scale(adjust_lr_fn, weight_order):
  # torch's A × B is (out, in): √max(1, A/B), or 0.2·√max(A, B)
  shapes = {"wide": (64, 128), "tall": (128, 64)}  # (out, in)
  order = (lambda s: s) if weight_order == "out_in" else (lambda s: s[::-1])
  params = {k: jnp.zeros(order(s)) for k, s in shapes.items()}
  got = _scales(
    compat.describe_torch_muon(params, adjust_lr_fn, weight_order=weight_order)
  )
  for name, (out, in_) in shapes.items():
    if adjust_lr_fn == "match_rms_adamw":
      want = 0.2 * max(out, in_) ** 0.5
    else:
      want = max(1.0, out / in_) ** 0.5
    assert abs(got[name] - want) <= 5e-3 * want, (name, got, want)
  # om.describe's own scale is om.muon's spectral one: √max(fan_out, fan_in)
  assert _scales(om.describe(params, dimension_numbers=None))["wide"] == (
    pytest.approx(128**0.5, rel=5e-3)
  )


def test_describe_returns_a_table_that_shows_as_one():
  table = om.describe({"w": jnp.zeros((8, 16)), "b": jnp.zeros(16)})
  assert isinstance(table, str) and table.count("\n") == 2
  assert repr(table) == str(table)  # a REPL or notebook cell shows the table


@pytest.mark.parametrize(
  "kwargs,field",
  [
    ({"adjust_lr_fn": "match_rms"}, "adjust_lr_fn"),
    ({"weight_order": "torch"}, "weight_order"),
    ({"ns_coefficients": (3.4, -4.7)}, "ns_coefficients"),
    ({"momentum": 1.0}, "momentum"),
    ({"ns_steps": 0}, "ns_steps"),
    ({"lr": -1.0}, "learning_rate"),
    ({"weight_decay": float("nan")}, "weight_decay"),
    ({"precision": "bfloat16"}, "precision"),
  ],
)
def test_bad_torch_muon_arguments_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=field):
    compat.torch_muon(**kwargs)


def test_out_in_with_dimension_numbers_raises():
  with pytest.raises(ValueError, match="weight_order"):
    compat.torch_muon(
      weight_order="out_in", dimension_numbers=om.MuonDimensionNumbers()
    )


def test_the_defaults_are_torchs():
  import inspect

  signature = inspect.signature(compat.torch_muon)
  defaults = {
    name: p.default
    for name, p in signature.parameters.items()
    if p.kind is p.POSITIONAL_OR_KEYWORD
  }
  assert defaults == {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "ns_coefficients": (3.4445, -4.775, 2.0315),
    "eps": 1e-7,
    "ns_steps": 5,
    "adjust_lr_fn": None,
  }


# precision="bf16" in the kernel


# (square matrices have singular values near zero, where the quintic is
# steep and one bf16 bit moves them)
@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (3, 32, 64)])
def test_bf16_keeps_the_input_dtype_and_the_fp32_iterations_polynomial(shape):
  x = gaussian(shape)
  out = om.newton_schulz(x, precision="bf16")
  chex.assert_shape(out, shape)
  assert out.dtype == x.dtype
  exact = om.newton_schulz(x, precision="highest")
  singular = lambda y: np.linalg.svd(
    np.asarray(y, np.float64), compute_uv=False
  )
  # the same polynomial of the singular values, to bf16's rounding
  np.testing.assert_allclose(singular(out), singular(exact), atol=0.02)
  assert float(jnp.linalg.norm(out - exact)) <= 0.02 * float(
    jnp.linalg.norm(exact)
  )


def test_bf16_is_scale_invariant_over_the_fp32_range():
  x = gaussian((48, 96), seed=1)
  ns = jax.jit(lambda x: om.newton_schulz(x, precision="bf16"))
  base = np.asarray(ns(x))
  for power in (-90, -40, 0, 40, 90):  # exactly: a power of two
    np.testing.assert_array_equal(np.asarray(ns(x * 2.0**power)), base)
  for scale in (1e-30, 1e30):  # up to bf16 rounding
    got = np.asarray(ns(x * scale))
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - base) <= 0.05 * np.linalg.norm(base)
  np.testing.assert_array_equal(
    np.asarray(ns(jnp.zeros((8, 16)))), np.zeros((8, 16))
  )


def test_bf16_differs_from_medium():
  # "medium" keeps an fp32 iterate: not the same numbers
  x = gaussian((64, 128), seed=2)
  bf16 = om.newton_schulz(x, coefficients="simple", precision="bf16")
  medium = om.newton_schulz(x, coefficients="simple", precision="medium")
  assert float(jnp.max(jnp.abs(bf16 - medium))) > 1e-3


def test_bf16_with_the_gram_form_raises():
  with pytest.raises(ValueError, match="precision='bf16'"):
    om.orthogonalize(method="gram", precision="bf16")


def test_bf16_rejects_complex():
  with pytest.raises(ValueError, match="bf16"):
    om.newton_schulz(gaussian((4, 8), dtype=jnp.complex64), precision="bf16")
