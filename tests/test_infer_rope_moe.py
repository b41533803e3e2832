"""Layout inference on common attention: RoPE that picks value pairs or
halves of ``head_dim`` keeps the head axis a matrix axis, and a path that
names experts never makes attention heads an expert axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optax.contrib import MuonDimensionNumbers as MDN

import optax_muon as om
from conftest import gaussian

D, H, HD, T = 32, 4, 16, 8
X = jnp.ones((T, D))


def _interleaved(x):  # GPT-J / complex-rotation RoPE: value pairs
  pairs = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
  a, b = pairs[..., 0], pairs[..., 1]
  return jnp.stack([a * 0.8 - b * 0.6, a * 0.6 + b * 0.8], -1).reshape(x.shape)


def _rotate_half(x):  # Llama / NeoX RoPE: halves of head_dim
  half = x.shape[-1] // 2
  a, b = x[..., :half], x[..., half:]
  return jnp.concatenate([a * 0.8 - b * 0.6, a * 0.6 + b * 0.8], -1)


def _strided(x):  # even and odd columns by strided slices
  a, b = x[..., ::2], x[..., 1::2]
  return jnp.stack([a * 0.8 - b * 0.6, a * 0.6 + b * 0.8], -1).reshape(x.shape)


def _partial(rope, rope_dim=8):  # MLA: RoPE on the last rope_dim columns
  def apply(x):
    plain, rotary = x[..., :-rope_dim], x[..., -rope_dim:]
    return jnp.concatenate([plain, rope(rotary)], -1)

  return apply


def _attention(rope):
  def forward(p, x):
    q = rope(jnp.einsum("td,dnh->tnh", x, p["wq"]))
    k = rope(jnp.einsum("td,dnh->tnh", x, p["wk"]))
    v = jnp.einsum("td,dnh->tnh", x, p["wv"])
    scores = jax.nn.softmax(jnp.einsum("tnh,snh->nts", q, k), -1)
    out = jnp.einsum("nts,snh->tnh", scores, v)
    return jnp.einsum("tnh,nhd->td", out, p["wo"]) @ p["head"]

  return forward


def _params():
  params = {n: jnp.zeros((D, H, HD)) for n in ("wq", "wk", "wv")}
  return params | {"wo": jnp.zeros((H, HD, D)), "head": jnp.zeros((D, 10))}


def _direction(layout, grads):
  tx = om.scale_by_muon(layout=layout, scale_mode="shape_scaling")
  muon = {k: v for k, v in grads.items() if layout.labels[k] == "muon"}
  out, _ = tx.update(muon, tx.init(muon))
  return out


def _true_query_update(grad):
  """Newton–Schulz of the one (D, H·HD) matrix the kernel is."""
  matrix = grad.reshape(D, H * HD)
  out = om.newton_schulz(matrix) * np.sqrt(max(1.0, H * HD / D))
  return out.reshape(D, H, HD)


@pytest.mark.parametrize(
  "rope",
  [
    _interleaved,
    _rotate_half,
    _strided,
    _partial(_interleaved),
    _partial(_rotate_half),
  ],
  ids=[
    "interleaved",
    "rotate_half",
    "strided",
    "partial_pairs",
    "partial_half",
  ],
)
def test_rope_keeps_each_query_and_key_kernel_one_matrix(rope):
  layout = om.infer_layout(_attention(rope), _params(), X)
  for name in ("wq", "wk", "wv"):
    assert layout.dimension_numbers[name] == MDN((0,), (1, 2)), (
      name,
      layout.reasons[name],
    )
    assert "indexed apart" not in layout.reasons[name]
  grads = {
    k: gaussian(v.shape, i) for i, (k, v) in enumerate(_params().items())
  }
  got = _direction(layout, grads)
  for name in ("wq", "wk"):
    want = _true_query_update(grads[name])
    cos = jnp.vdot(got[name], want) / (
      jnp.linalg.norm(got[name]) * jnp.linalg.norm(want)
    )
    assert float(cos) >= 0.999999, (name, float(cos))


def test_fused_kv_indexed_apart_is_still_two_matrices():
  # the rule still fires on a whole axis taken apart (Gemma's K/V), with
  # interleaved RoPE on the keys
  def forward(p, x):
    q = _interleaved(jnp.einsum("td,dnh->tnh", x, p["wq"]))
    k, v = jnp.einsum("td,cdnh->ctnh", x, p["kv"])
    k = _interleaved(k)
    scores = jax.nn.softmax(jnp.einsum("tnh,snh->nts", q, k), -1)
    return jnp.einsum("nts,snh,nhd->td", scores, v, p["wo"])

  params = {
    "wq": jnp.zeros((D, H, HD)),
    "kv": jnp.zeros((2, D, H, HD)),
    "wo": jnp.zeros((H, HD, D)),
  }
  layout = om.infer_layout(forward, params, X, output=lambda out: ())
  assert layout.dimension_numbers["kv"] == MDN((1,), (2, 3))
  assert "indexed apart" in layout.reasons["kv"]


def _moe_decoder(outer="moe_layers", attention="self_attention"):
  """A decoder layer: latent attention's wkv_b ``(rank, heads, dim)`` beside
  a dense MoE with real experts, under the given path names."""

  def forward(p, x):
    layer = p[outer]
    attn = layer[attention]
    latent = x @ attn["wkv_a"]  # (T, rank)
    kv = jnp.einsum("tr,rnh->tnh", latent, attn["wkv_b"])
    k, v = kv[..., : HD // 2], kv[..., HD // 2 :]
    q = jnp.einsum("td,dnh->tnh", x, attn["wq"])[..., : HD // 2]
    scores = jax.nn.softmax(jnp.einsum("tnh,snh->nts", q, k), -1)
    h = x + jnp.einsum("nts,snh,nhd->td", scores, v, attn["wo"])
    experts = layer["experts"]
    hidden = jax.nn.gelu(jnp.einsum("td,edf->tef", h, experts["wi"]))
    out = jnp.einsum("tef,efd->ted", hidden, experts["wo"])
    weights = jax.nn.softmax(h @ layer["router"])
    return jnp.einsum("ted,te->td", out, weights)

  return forward


def _moe_params(outer="moe_layers", attention="self_attention"):
  rank, experts, ffn = 8, 4, 24
  return {
    outer: {
      attention: {
        "wkv_a": jnp.zeros((D, rank)),
        "wkv_b": jnp.zeros((rank, H, HD)),
        "wq": jnp.zeros((D, H, HD)),
        "wo": jnp.zeros((H, HD // 2, D)),
      },
      "experts": {
        "wi": jnp.zeros((experts, D, ffn)),
        "wo": jnp.zeros((experts, ffn, D)),
      },
      "router": jnp.zeros((D, experts)),
    }
  }


def test_attention_under_a_moe_path_keeps_its_heads_a_matrix_axis():
  none = lambda out: ()
  layout = om.infer_layout(_moe_decoder(), _moe_params(), X, output=none)
  attn = layout.dimension_numbers["moe_layers"]["self_attention"]
  reasons = layout.reasons["moe_layers"]["self_attention"]
  # heads × dim is one matrix with the rank as fan-in, as under any name
  assert attn["wkv_b"] == MDN((0,), (1, 2)), reasons["wkv_b"]
  assert "by name" not in reasons["wkv_b"]
  assert attn["wq"] == MDN((0,), (1, 2)), reasons["wq"]
  # the real experts keep their expert (batch) axis
  experts = layout.dimension_numbers["moe_layers"]["experts"]
  assert experts["wi"] == MDN((1,), (2,)) and experts["wo"] == MDN((1,), (2,))
  # the same model under plain names reads the same
  names = ("dense_layers", "attention")
  plain = om.infer_layout(
    _moe_decoder(*names), _moe_params(*names), X, output=none
  )
  assert plain.dimension_numbers["dense_layers"]["attention"] == attn


def test_a_name_still_breaks_a_tie_the_structure_leaves_open():
  # experts whose matmuls the walk cannot see apart: each expert's kernel
  # used in one einsum with no batch dim, its expert axis a free output
  def forward(p, x):
    out = jnp.einsum("td,edf->tef", x, p["moe"]["experts"])
    return jnp.sum(out, axis=(1, 2))

  params = {"moe": {"experts": jnp.zeros((4, D, 24))}}
  layout = om.infer_layout(forward, params, X, output=lambda o: ())
  assert layout.dimension_numbers["moe"]["experts"] == MDN((1,), (2,))
  assert "by name" in layout.reasons["moe"]["experts"]


# -- opaque kernels: a use the walk cannot read never aborts the inference --


def _pallas_matmul(x, w):
  from jax.experimental import pallas as pl  # noqa: PLC0415

  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] @ w_ref[...]

  out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
  return pl.pallas_call(kernel, out_shape=out, interpret=True)(x, w)


def _opaque_moe(expert_matmul, outer="moe"):
  """Experts ``wi (E, D, F)``, ``wo (E, F, D)`` through ``expert_matmul``
  (a Pallas kernel, or ``ragged_dot``), a router, attention-free."""

  def forward(p, x):
    experts = p[outer]
    hidden = expert_matmul(x, experts["wi"])  # (T, E, F)
    out = jnp.einsum("tef,efd->ted", jax.nn.gelu(hidden), experts["wo"])
    weights = jax.nn.softmax(x @ experts["router"])
    return jnp.einsum("ted,te->td", out, weights) @ p["head"]

  return forward


def _opaque_params(outer="moe"):
  return {
    outer: {
      "wi": jnp.zeros((4, D, 24)),
      "wo": jnp.zeros((4, 24, D)),
      "router": jnp.zeros((D, 4)),
    },
    "head": jnp.zeros((D, 10)),
  }


def _per_expert_pallas(x, wi):
  return jnp.stack([_pallas_matmul(x, wi[e]) for e in range(wi.shape[0])], 1)


def _per_expert_ragged(x, wi):
  # every token to every expert, grouped: (E·T, D) rows in E groups of T
  rows = jnp.tile(x, (wi.shape[0], 1))
  sizes = jnp.full((wi.shape[0],), x.shape[0], jnp.int32)
  out = jax.lax.ragged_dot(rows, wi, sizes)  # (E·T, F)
  return out.reshape(wi.shape[0], x.shape[0], -1).transpose(1, 0, 2)


def test_a_pallas_expert_kernel_is_decided_by_the_fallback_rules():
  layout = om.infer_layout(_opaque_moe(_per_expert_pallas), _opaque_params(), X)
  reason = layout.reasons["moe"]["wi"]
  assert "pallas_call" in reason and "fallback" in reason, reason
  assert layout.roles["moe"]["wi"] == "unknown"  # the use was not read
  assert layout.dimension_numbers["moe"]["wi"] == MDN((1,), (2,))
  # the rest of the model is read as without the kernel
  assert layout.dimension_numbers["moe"]["wo"] == MDN((1,), (2,))
  assert layout.roles["head"] == "head"
  assert "pallas_call" in str(layout)  # the table says the use was not read


def test_ragged_dot_experts_read_as_a_grouped_matmul_like_dense_ones():
  ragged = om.infer_layout(_opaque_moe(_per_expert_ragged), _opaque_params(), X)
  assert ragged.dimension_numbers["moe"]["wi"] == MDN((1,), (2,))
  assert "fallback" not in ragged.reasons["moe"]["wi"]


def test_an_opaque_leaf_no_rule_decides_is_unknown_and_muon_names_it():
  # the same Pallas experts under a path that names no experts
  layout = om.infer_layout(
    _opaque_moe(_per_expert_pallas, "block"), _opaque_params("block"), X
  )
  assert layout.roles["block"]["wi"] == "unknown"
  assert "dimension_numbers=" in layout.reasons["block"]["wi"]
  params = jax.tree.map(lambda v: gaussian(v.shape, 1), _opaque_params("block"))
  with pytest.raises(ValueError, match="block/wi"):
    om.muon(0.02, layout=layout).init(params)
