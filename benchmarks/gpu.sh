#!/usr/bin/env bash
# The GPU benchmark run: NS at precision "medium", "bf16", "fp16" and "high" up to
# 8192×28672,
# our update against optax.contrib.muon, state memory, the train step and one
# update compiled at Llama-3-8B shapes (benchmarks/at_scale.py).
# Writes JSON lines into the folder named by the first argument.
#   usage: benchmarks/gpu.sh OUT_DIR [--quick]     (--quick: small, runs on CPU)
set -euo pipefail
out=${1:?usage: benchmarks/gpu.sh OUT_DIR [--quick]}
quick=${2:-}
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
mkdir -p "$out"
if [ "$quick" = "--quick" ]; then
  shapes=128x512; rate=256
else
  shapes=1024x4096,4096x4096,4096x14336,8192x28672; rate=8192
fi
"$py" benchmarks/ns_roofline.py $quick --shapes "$shapes" \
  --precisions medium,bf16,fp16,high --rate-size "$rate" > "$out/ns_roofline.jsonl"
"$py" benchmarks/update_vs_optax.py $quick > "$out/update_vs_optax.jsonl"
"$py" benchmarks/memory.py $quick > "$out/memory.jsonl"
"$py" benchmarks/train_step.py $quick > "$out/train_step.jsonl"
# one update compiled at Llama-3-8B shapes for this machine's GPU (one
# device: unsharded), its memory against optax.contrib.muon's
if [ "$quick" = "--quick" ]; then
  "$py" benchmarks/at_scale.py --quick --json > "$out/at_scale.jsonl"
else
  "$py" benchmarks/at_scale.py --target gpu --mesh 1x1 --model llama3-8b \
    --dtype bf16 --json > "$out/at_scale.jsonl"
fi
echo "wrote $(ls "$out" | wc -l) files to $out"
