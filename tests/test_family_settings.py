"""The Muon family's shared settings (optimizers/settings.py): every member
takes each of them with the reference's default and type, or says why not;
and what a member is given reaches its direction."""

import inspect

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_muon as om
from conftest import gaussian
from optax_muon._src.optimizers import settings

DIRECTIONS = (
  om.scale_by_adaptive_muon,
  om.scale_by_polargrad,
  om.scale_by_dion2,
  om.scale_by_dion,
)
OPTIMIZERS = (
  om.adaptive_muon,
  om.polargrad,
  om.muon_hyperball,
  om.scion,
  om.muon_bp,
  om.dion2,
  om.nordion2,
  om.dion,
)


def _parameters(function):
  return inspect.signature(function).parameters


def _takes_keywords(function) -> bool:
  return any(
    p.kind is inspect.Parameter.VAR_KEYWORD
    for p in _parameters(function).values()
  )


def _held_to(member, reference, shared):
  """``(name, problem)`` for each shared setting of ``reference`` that
  ``member`` does not take as the reference does, without a stated reason."""
  exempt = settings.NOT_APPLICABLE.get(member.__name__, {})
  different = settings.DIFFERENT_DEFAULTS.get(member.__name__, {})
  problems = []
  for name in shared:
    want = _parameters(reference).get(name)
    if want is None:
      continue
    if name in exempt:
      if name not in (member.__doc__ or ""):
        problems.append((name, "not applicable, but the docstring is silent"))
      continue
    got = _parameters(member).get(name)
    if got is None:
      if not _takes_keywords(member):
        problems.append((name, "not taken"))
      continue
    if got.annotation != want.annotation:
      problems.append((name, f"annotated {got.annotation}"))
    if got.default != want.default and name not in different:
      problems.append((name, f"default {got.default!r}"))
  return problems


@pytest.mark.parametrize("member", DIRECTIONS, ids=lambda f: f.__name__)
def test_every_direction_takes_the_shared_settings_as_scale_by_muon(member):
  assert _held_to(member, om.scale_by_muon, settings.DIRECTION) == []


@pytest.mark.parametrize("member", OPTIMIZERS, ids=lambda f: f.__name__)
def test_every_optimizer_takes_the_shared_settings_as_muon(member):
  shared = settings.DIRECTION + settings.ROUTING
  assert _held_to(member, om.muon, shared) == []


@pytest.mark.parametrize("member", OPTIMIZERS, ids=lambda f: f.__name__)
def test_a_shared_setting_taken_through_keywords_builds(member):
  # muon_hyperball and scion hand **kwargs on: each shared setting muon
  # takes must get through them to something that takes it
  exempt = settings.NOT_APPLICABLE.get(member.__name__, {})
  params = {"hidden": jnp.ones((8, 16))}
  for name in settings.DIRECTION + settings.ROUTING:
    reference = _parameters(om.muon).get(name)
    if reference is None or name in exempt or name in _parameters(member):
      continue
    tx = member(0.01, **{name: reference.default})
    assert jax.tree.structure(tx.init(params)) is not None
    # and it reaches what checks it: a value no member accepts is refused
    # by name (om.muon refuses -3 for every shared keyword); a keyword
    # dropped on the way would be accepted silently
    with pytest.raises((ValueError, TypeError), match=name):
      bad = member(0.01, **{name: -3})
      bad.update(params, bad.init(params), params)


def test_a_setting_that_does_not_apply_is_refused_by_name():
  for name in settings.NOT_APPLICABLE["scion"]:
    with pytest.raises(ValueError, match=name):
      om.scion(0.01, **{name: _parameters(om.muon)[name].default})
  with pytest.raises(TypeError, match="weight_decay_mask"):
    om.muon_hyperball(0.01, weight_decay_mask=None)


def _one_step(tx, grads, params=None):
  params = grads if params is None else params
  updates, _ = tx.update(grads, tx.init(params), params)
  return updates


def test_polargrad_preconditions_as_it_is_told():
  # one step: u = (1 − β) g, update = ⟨O, u⟩ · O with O = orthogonalize(u)
  g = {"w": gaussian((16, 64))}
  beta = 0.9
  u = jax.tree.map(lambda x: (1 - beta) * x, g)
  orthogonalize = om.orthogonalize(preconditioning="aol")
  o, _ = orthogonalize.update(u, orthogonalize.init(u))
  want = {"w": jnp.sum(o["w"] * u["w"]) * o["w"]}
  got = _one_step(om.scale_by_polargrad(beta=beta, preconditioning="aol"), g)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  default = _one_step(om.scale_by_polargrad(beta=beta), g)
  assert float(jnp.max(jnp.abs(got["w"] - default["w"]))) > 1e-3


def test_adaptive_muon_preconditions_as_it_is_told():
  g = {"w": gaussian((16, 64))}
  got = _one_step(
    om.scale_by_adaptive_muon(moment2_method="normuon", preconditioning="aol"),
    g,
  )
  default = _one_step(om.scale_by_adaptive_muon(moment2_method="normuon"), g)
  difference = float(jnp.max(jnp.abs(got["w"] - default["w"])))
  # the same update up to AOL's different Newton–Schulz start
  assert 1e-3 < difference < 0.1 * float(jnp.max(jnp.abs(default["w"])))


@pytest.mark.parametrize(
  "member",
  (om.scale_by_adaptive_muon, om.scale_by_polargrad, om.adaptive_muon),
  ids=lambda f: f.__name__,
)
def test_method_reaches_the_orthogonalization(member):
  # the Gram form equals the standard one to 1e-6, so its arrival is seen
  # in orthogonalize's own check: it refuses precision="bf16"
  args = () if member.__name__.startswith("scale_by") else (0.01,)
  member(*args, method="gram", precision="highest")
  with pytest.raises(ValueError, match="method='gram'"):
    member(*args, method="gram", precision="bf16")


def test_polargrad_splits_a_fused_qkv_kernel_into_its_matrices():
  heads, kv_heads, head_dim, width = 4, 2, 8, 32
  split = om.SplitQKV(heads, kv_heads, head_dim, layout="concatenated")
  q, k, v = (
    gaussian((width, n * head_dim), seed=s)
    for s, n in ((1, heads), (2, kv_heads), (3, kv_heads))
  )
  fused = {"qkv": jnp.concatenate([q, k, v], axis=1)}
  got = _one_step(om.scale_by_polargrad(split_qkv=split), fused)
  apart = _one_step(om.scale_by_polargrad(), {"q": q, "k": k, "v": v})
  want = jnp.concatenate([apart["q"], apart["k"], apart["v"]], axis=1)
  chex.assert_trees_all_close(got["qkv"], want, rtol=1e-5, atol=1e-6)


def test_polargrad_split_gate_up_and_sharding_give_the_unsharded_numbers():
  mesh = jax.make_mesh((4,), ("model",))
  params = {
    "mlp": {"gate_up": gaussian((16, 64), seed=4)},
    "out": gaussian((32, 16), seed=5),
  }
  specs = {"mlp": {"gate_up": P(None, "model")}, "out": P("model", None)}
  sharded = jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs
  )
  gate_up = om.SplitGateUp()
  want = _one_step(om.polargrad(0.1, split_gate_up=gate_up), params)
  for mode in ("duplicated", "allgather"):  # the exact modes
    tx = om.polargrad(
      0.1,
      split_gate_up=gate_up,
      sharding=om.TensorParallel(mesh, mode=mode),
    )
    got = jax.jit(lambda g: _one_step(tx, g))(sharded)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  fused = _one_step(om.polargrad(0.1), params)["mlp"]["gate_up"]
  assert float(jnp.max(jnp.abs(fused - want["mlp"]["gate_up"]))) > 1e-4


@pytest.mark.parametrize("member", settings.SCALAR_KWARGS)
def test_a_misspelt_adamw_keyword_is_refused_by_name(member):
  # **scalar_kwargs would take any keyword; the optimizer refuses it as
  # Python refuses an unknown keyword, naming it and what it takes
  with pytest.raises(TypeError, match="'adam_beta1'.*adam_b1"):
    getattr(om, member)(0.1, adam_beta1=0.5)


def test_the_adamw_group_is_set_the_same_way_in_every_optimizer():
  params = {"hidden": jnp.ones((8, 16)), "bias": jnp.ones(16)}
  grads = jax.tree.map(lambda x: 0.5 * jnp.ones_like(x), params)
  adam = dict(adam_learning_rate=0.3, adam_b1=0.5, adam_eps=1e-3)
  want = _one_step(
    optax.adamw(0.3, b1=0.5, eps=1e-3, weight_decay=0.0),
    {"bias": grads["bias"]},
  )
  for member in (om.muon, *OPTIMIZERS):
    got = _one_step(member(0.01, **adam), grads, params)
    chex.assert_trees_all_close(got["bias"], want["bias"], rtol=1e-6)


@pytest.mark.parametrize(
  "member", (om.muon, *OPTIMIZERS), ids=lambda f: f.__name__
)
def test_every_shared_setting_an_optimizer_takes_reaches_what_checks_it(member):
  # each member hands its keywords on by name, to its direction's settings
  # objects and to route: a keyword left out on the way would fall back to
  # a default without a word, and a value no member accepts would pass
  params = {"hidden": jnp.ones((8, 16)), "bias": jnp.ones(16)}
  exempt = settings.NOT_APPLICABLE.get(member.__name__, {})
  taken = [
    name
    for name in settings.DIRECTION + settings.ROUTING
    if name not in exempt
    and (name in _parameters(member) or _takes_keywords(member))
    and name in _parameters(om.muon)
  ]
  assert len(taken) >= 20
  for name in taken:
    with pytest.raises((ValueError, TypeError), match=name):
      bad = member(0.01, **{name: -3})
      bad.update(params, bad.init(params), params)


MATCHES_ADAMW = (om.muon, om.adaptive_muon, om.dion2, om.nordion2, om.dion)


@pytest.mark.parametrize("member", MATCHES_ADAMW, ids=lambda f: f.__name__)
def test_adam_b1_sets_the_rms_matching_factor(member):
  # the optimizers' adam_b1 is their direction's adamw_beta1: the Muon
  # update is √((1 − β₁)/(1 + β₁)) times the unmatched one
  params = {"hidden": gaussian((8, 16), seed=0)}
  grads = {"hidden": gaussian((8, 16), seed=1)}

  def step(tx):
    return tx.update(grads, tx.init(params), params)[0]["hidden"]

  matched = step(member(1.0, match_adamw_update_rms=True, adam_b1=0.5))
  chex.assert_trees_all_close(
    matched, step(member(1.0)) * (0.5 / 1.5) ** 0.5, rtol=1e-5, atol=1e-7
  )
