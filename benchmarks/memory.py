"""Optimizer-state bytes and the update's peak temporary bytes.

    python benchmarks/memory.py [--quick]

For the example GPT's params, with the settings of ``update_vs_optax.py`` (the
same leaves to Muon, quintic × 5, β = 0.95), Nesterov off and on: state bytes
of ours / AdamW / optax.contrib.muon (counted over the state's arrays), and the
temporary bytes XLA allocates for one jitted update
(``compiled.memory_analysis().temp_size_in_bytes``), ours with the standard
and the Gram Newton–Schulz.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import jax  # noqa: E402
from _timing import emit  # noqa: E402
from _timing import quick_flag  # noqa: E402
from flax import nnx  # noqa: E402
from update_vs_optax import optimizers  # noqa: E402

from examples.flax_lm.model import GPT  # noqa: E402
from examples.flax_lm.model import GPTConfig  # noqa: E402


def state_bytes(state) -> int:
  return sum(
    x.size * x.dtype.itemsize
    for x in jax.tree.leaves(state)
    if hasattr(x, "dtype")
  )


def main():
  cfg = (
    GPTConfig(n_layer=2, n_embd=64)
    if quick_flag()
    else GPTConfig(n_layer=4, n_embd=192, n_head=6)
  )
  params = nnx.to_pure_dict(nnx.state(GPT(cfg, nnx.Rngs(0)), nnx.Param))
  grads = jax.tree.map(lambda p: p * 0.5, params)
  for nesterov in (False, True):
    record = {
      "benchmark": "memory",
      "nesterov": nesterov,
      "params": int(sum(x.size for x in jax.tree.leaves(params))),
      "state_bytes": {},
      "update_temp_bytes": {},
    }
    for name, tx in optimizers(params, None, nesterov).items():
      state = tx.init(params)
      record["state_bytes"][name] = state_bytes(state)
      compiled = jax.jit(tx.update).lower(grads, state, params).compile()
      record["update_temp_bytes"][name] = int(
        compiled.memory_analysis().temp_size_in_bytes
      )
    state, temp = record["state_bytes"], record["update_temp_bytes"]
    record["state_ours_over_adamw"] = state["optax_muon"] / state["adamw"]
    record["temp_ours_over_optax"] = (
      temp["optax_muon"] / temp["optax.contrib.muon"]
    )
    record["temp_ours_gram_over_optax"] = (
      temp["optax_muon_gram"] / temp["optax.contrib.muon"]
    )
    emit(record)


if __name__ == "__main__":
  main()
