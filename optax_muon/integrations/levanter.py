"""optax_muon in Levanter: ``type: optax_muon`` in a Levanter optimizer config.

    import optax_muon.integrations.levanter  # registers the name
    # then, in the run's YAML:   optimizer: {type: optax_muon, lr: 0.02, ...}

Levanter picks its optimizer by name (``OptimizerConfig``, a ``draccus``
choice registry) and calls ``build(num_train_steps)``. ``OptaxMuonConfig`` is
Levanter's own ``MuonConfig`` (its fields, defaults, learning-rate schedules,
routing: each ``haliax.nn.Linear`` weight to Muon but the embeddings' and
the LM head's, the rest to AdamW behind a global-norm clip) with the Muon
group built from optax_muon's transforms: ``om.momentum`` (Levanter's
``m ← βm + g``), ``om.orthogonalize`` (Jordan's coefficients,
``X / (‖X‖ + eps)``) over each Linear's own axes — its ``In`` axes the
fan-in, its ``Out`` axes the fan-out, the scanned layer axis a batch of
matrices, wherever haliax put them — and ``om.scale_by_shape``. A run that
says ``type: muon`` changes one word. Importing this module imports
Levanter.
"""

import dataclasses

import haliax
import jax
import optax
from levanter.optim import MuonConfig
from levanter.optim import OptimizerConfig

import optax_muon as om
from optax_muon._src.base.paths import path_names

# Levanter's update scale with use_kimi_scaling (Moonlight's 0.2·√max)
KIMI_RMS = 0.2


def linear_dimension_numbers(params):
  """Each Linear weight's ``MuonDimensionNumbers`` from its named axes (its
  ``In`` axes reduced, its ``Out`` axes the output, any other axis a batch
  of matrices); ``None`` for every other leaf."""
  dims = {}  # by path names, so the masked params of a group match too

  def visit(path, node):
    if isinstance(node, haliax.nn.Linear) and haliax.is_named_array(
      node.weight
    ):
      names = [axis.name for axis in node.weight.axes]
      among = lambda axes: tuple(
        names.index(axis.name) for axis in haliax.axis.ensure_tuple(axes)
      )
      for leaf_path, _ in jax.tree_util.tree_leaves_with_path(node.weight):
        dims[path_names((*path, "weight", *leaf_path))] = (
          om.MuonDimensionNumbers(
            reduction_axis=among(node.In), output_axis=among(node.Out)
          )
        )
    return node

  is_linear = lambda x: isinstance(x, haliax.nn.Linear)
  jax.tree_util.tree_map_with_path(visit, params, is_leaf=is_linear)
  return jax.tree_util.tree_map_with_path(
    lambda path, _: dims.get(path_names(path)),
    params,
    is_leaf=lambda x: isinstance(x, optax.MaskedNode),
  )


@OptimizerConfig.register_subclass("optax_muon")
@dataclasses.dataclass(frozen=True)
class OptaxMuonConfig(MuonConfig):
  """Levanter's ``MuonConfig`` with optax_muon's Muon group; its fields are
  Levanter's (``lr``, ``adam_lr``, ``momentum``, ``nesterov``,
  ``backend_steps``, ``weight_decay``, ``adam_weight_decay``, ``beta1``,
  ``beta2``, ``epsilon``, ``muon_epsilon``, ``max_grad_norm``,
  ``use_kimi_scaling``) and ``precision`` (``om.orthogonalize``'s: ``"highest"``,
  ``"high"`` or ``"medium"``)."""

  precision: str = "highest"

  def build(self, num_train_steps):
    """The optax transform of a run of ``num_train_steps``, with
    ``learning_rate`` and ``adam_lr`` injected hyperparameters (logged by
    Levanter), as Levanter's own ``MuonConfig.build``."""
    om.orthogonalize(precision=self.precision)  # a bad precision raises here
    muon_lr = self.lr_scheduler(num_train_steps)
    adam_lr = self.lr_scheduler(num_train_steps, override_lr=self.adam_lr)

    def optimizer(learning_rate, adam_lr):
      muon = [
        om.momentum(self.momentum, nesterov=self.nesterov, style="sgd"),
        om.orthogonalize(
          coefficients="simple",
          steps=self.backend_steps,
          precision=self.precision,
          dimension_numbers=linear_dimension_numbers,
          eps=self.muon_epsilon,
          add_eps=True,
        ),
        om.scale_by_shape(
          "spectral" if self.use_kimi_scaling else "shape_scaling",
          dimension_numbers=linear_dimension_numbers,
          steps=self.backend_steps,
        ),
      ]
      if self.use_kimi_scaling:
        muon.append(optax.scale(KIMI_RMS))
      if self.weight_decay > 0:
        muon.append(
          optax.add_decayed_weights(
            self.weight_decay, self.build_weight_decay_mask()
          )
        )
      muon.append(optax.scale(-learning_rate))
      adam = []
      if self.max_grad_norm:
        adam.append(optax.clip_by_global_norm(self.max_grad_norm))
      adam.append(optax.scale_by_adam(self.beta1, self.beta2, self.epsilon))
      decay = (
        self.weight_decay
        if self.adam_weight_decay is None
        else self.adam_weight_decay
      )
      if decay > 0:
        adam.append(
          optax.add_decayed_weights(decay, self.build_weight_decay_mask())
        )
      adam.append(optax.scale(-adam_lr))
      return optax.multi_transform(
        {"muon": optax.chain(*muon), "adamw": optax.chain(*adam)},
        lambda params: self.create_mask(
          params, use_kimi_scaling=self.use_kimi_scaling
        ),
      )

    return optax.inject_hyperparams(optimizer)(
      learning_rate=muon_lr, adam_lr=adam_lr
    )
