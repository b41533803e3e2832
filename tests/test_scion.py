"""Scion: om.scion against emerging-optimizers 0.3.0's own outputs
(tests/data/eo_scion.*; inputs shared with eo_adaptive_muon.npz)."""

import json

import numpy as np
import pytest

import optax_muon as om
from conftest import DATA
from conftest import EO_ORIENTATIONS
from conftest import close_to_max
from conftest import eo_orientation
from conftest import eo_steps

REFERENCE = json.loads((DATA / "eo_scion.json").read_text())["cases"]
ARRAYS = np.load(DATA / "eo_scion.npz")
INPUTS = np.load(DATA / "eo_adaptive_muon.npz")


@pytest.mark.parametrize("orientation", EO_ORIENTATIONS)
@pytest.mark.parametrize("case", REFERENCE, ids=[c["id"] for c in REFERENCE])
def test_every_scion_case_matches_eo(case, orientation):
  # 32x48 and 48x32: the unit_rms_norm scale √(out/in) is not symmetric, so
  # a wrong fan-in/fan-out reading fails one of them
  kw = case["effective_kwargs"]
  turn, dims = eo_orientation(orientation)
  tx = om.scion(
    kw["lr"],
    beta=kw["momentum"],
    spectral_radius=kw["spectral_radius"],
    coefficients=kw["coefficient_type"],
    steps=kw["num_ns_steps"],
    precision=kw["fp32_matmul_prec"],
    labels={"w": "muon"},
    dimension_numbers={"w": dims},
  )
  for k, before, _, update, _, param in eo_steps(tx, case, INPUTS, turn):
    step = lambda key: ARRAYS[f"{case['id']}/{k}/{key}"]
    close_to_max(turn(param), step("param"))
    # EO records the direction; the step is p <- (1 - lr) p - lr * direction
    close_to_max(turn(-update / kw["lr"] - before), step("update"))


def test_scion_fixes_what_defines_it():
  with pytest.raises(ValueError, match="weight_decay"):
    om.scion(1e-2, weight_decay=0.1)
