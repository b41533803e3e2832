"""Spectral-clipped weight decay as an optax transform."""

import jax
import optax

from optax_muon._src.base import checks as _checks
from optax_muon._src.base import types
from optax_muon._src.kernels.spectral import check_share
from optax_muon._src.kernels.spectral import spectral_clipped_weight_decay
from optax_muon._src.views import layout as layout_lib


def add_spectral_clipped_weight_decay(
  beta: types.Numeric = 1.0,
  c: types.Numeric = 0.5,
  *,
  dimension_numbers: types.PerLeaf = None,
) -> optax.GradientTransformation:
  """Adds ``spectral_clipped_weight_decay(p) − p`` to each update, after the
  learning rate (the parameter moves as EO's decay moves it).

  Args:
    beta: the singular-value cap.
    c: the share of the way to the capped matrix, in ``[0, 1]``.
    dimension_numbers: the matrix views, as in ``scale_by_muon`` (a leaf of
      3+ axes needs them).

  Returns:
    An ``optax.GradientTransformation`` that needs ``params``.
  """
  _checks.check_positive("beta", beta)
  check_share(c)
  resolve_views = layout_lib.view_resolver(dimension_numbers)

  def init_fn(params):
    resolve_views(params)  # bad views raise here
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("add_spectral_clipped_weight_decay needs the params")
    decayed = []
    for _, leaf, view in resolve_views(params):
      (matrices,) = view.to_matrices(leaf)
      decayed.append(
        view.from_matrices(
          [spectral_clipped_weight_decay(matrices, beta, c)], like=leaf
        )
        - leaf
      )
    decayed = jax.tree.unflatten(jax.tree.structure(params), decayed)
    return jax.tree.map(
      lambda u, d: u + d.astype(u.dtype), updates, decayed
    ), state

  return optax.GradientTransformation(init_fn, update_fn)
