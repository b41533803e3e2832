"""optax_muon: Muon for JAX as composable optax transformations."""

from importlib import metadata as _metadata

from optax.contrib import MuonDimensionNumbers

from optax_muon import compat
from optax_muon._src.config.describe import describe
from optax_muon._src.config.muon_config import MuonConfig
from optax_muon._src.config.overrides import parse_fields
from optax_muon._src.config.overrides import split_overrides
from optax_muon._src.inference.infer import Layout
from optax_muon._src.inference.infer import infer_layout
from optax_muon._src.kernels.coefficients import COEFFICIENT_SETS
from optax_muon._src.kernels.coefficients import coefficient_schedule
from optax_muon._src.kernels.diagnostics import orthogonality_error
from optax_muon._src.kernels.diagnostics import singular_value_spread
from optax_muon._src.kernels.diagnostics import update_rms
from optax_muon._src.kernels.newton_schulz import newton_schulz
from optax_muon._src.kernels.qk import clip_mla_qk
from optax_muon._src.kernels.qk import clip_qk
from optax_muon._src.kernels.quantize import QuantizedMomentum
from optax_muon._src.kernels.shape_scale import adamw_rms_match_factor
from optax_muon._src.kernels.shape_scale import scale_factor
from optax_muon._src.kernels.spectral import spectral_clip
from optax_muon._src.kernels.spectral import spectral_clipped_weight_decay
from optax_muon._src.kernels.spectral import spectral_hardcap
from optax_muon._src.optimizers.adaptive import adaptive_muon
from optax_muon._src.optimizers.adaptive import scale_by_adaptive_muon
from optax_muon._src.optimizers.dion import DionState
from optax_muon._src.optimizers.dion import dion
from optax_muon._src.optimizers.dion import scale_by_dion
from optax_muon._src.optimizers.dion2 import Dion2State
from optax_muon._src.optimizers.dion2 import dion2
from optax_muon._src.optimizers.dion2 import nordion2
from optax_muon._src.optimizers.dion2 import scale_by_dion2
from optax_muon._src.optimizers.hyperball import muon_hyperball
from optax_muon._src.optimizers.muon import muon
from optax_muon._src.optimizers.muon import scale_by_muon
from optax_muon._src.optimizers.muon_bp import MuonBPState
from optax_muon._src.optimizers.muon_bp import muon_bp
from optax_muon._src.optimizers.polargrad import polargrad
from optax_muon._src.optimizers.polargrad import scale_by_polargrad
from optax_muon._src.optimizers.scion import scion
from optax_muon._src.parallel.rates import KNOWN_RATES
from optax_muon._src.parallel.rates import DeviceRates
from optax_muon._src.parallel.tensor_parallel import TensorParallel
from optax_muon._src.parallel.zero1 import zero1_sharding
from optax_muon._src.transforms.hyperball import hyperball
from optax_muon._src.transforms.moment2 import scale_by_moment2
from optax_muon._src.transforms.momentum import momentum
from optax_muon._src.transforms.orthogonalize import orthogonalize
from optax_muon._src.transforms.qk_clip import qk_clip
from optax_muon._src.transforms.scaling import scale_by_shape
from optax_muon._src.transforms.spectral_decay import (
  add_spectral_clipped_weight_decay,
)
from optax_muon._src.views.labels import default_labels
from optax_muon._src.views.layout import SplitGateUp
from optax_muon._src.views.layout import SplitQKV

try:  # the installed distribution's version (pyproject.toml), one source
  __version__ = _metadata.version("optax_muon")
except _metadata.PackageNotFoundError:  # a source tree on sys.path
  __version__ = "0+unknown"

__all__ = (
  "COEFFICIENT_SETS",
  "DeviceRates",
  "Dion2State",
  "DionState",
  "KNOWN_RATES",
  "Layout",
  "MuonBPState",
  "MuonConfig",
  "MuonDimensionNumbers",
  "QuantizedMomentum",
  "SplitGateUp",
  "SplitQKV",
  "TensorParallel",
  "adamw_rms_match_factor",
  "add_spectral_clipped_weight_decay",
  "adaptive_muon",
  "clip_mla_qk",
  "clip_qk",
  "compat",
  "coefficient_schedule",
  "default_labels",
  "describe",
  "dion",
  "dion2",
  "hyperball",
  "infer_layout",
  "momentum",
  "muon",
  "muon_bp",
  "muon_hyperball",
  "newton_schulz",
  "nordion2",
  "orthogonality_error",
  "orthogonalize",
  "parse_fields",
  "polargrad",
  "qk_clip",
  "scale_by_adaptive_muon",
  "scale_by_dion",
  "scale_by_dion2",
  "scale_by_moment2",
  "scale_by_muon",
  "scale_by_polargrad",
  "scale_by_shape",
  "scale_factor",
  "scion",
  "singular_value_spread",
  "spectral_clip",
  "spectral_clipped_weight_decay",
  "spectral_hardcap",
  "split_overrides",
  "update_rms",
  "zero1_sharding",
)
