#!/usr/bin/env bash
# One accelerator session: the small-preset comparison of the three
# contestants (examples/flax_lm/compare.py: both seeds, bracketed sweeps),
# then the benchmarks of gpu.sh in the time left. The sweeps' starting lrs run
# in parallel, one process each; then one process per contestant extends its
# sweep past an edge, reusing the finished runs. Everything lands in OUT:
# compare.tgz (every run's curves; `compare --out DIR` here completes and
# re-plots them, reusing what finished), the benchmarks' JSON lines, the logs.
#   usage: benchmarks/device_run.sh OUT [--quick]   (--quick: tiny, on a CPU)
set -uo pipefail
out=${1:?usage: benchmarks/device_run.sh OUT [--quick]}
quick=${2:-}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
mkdir -p "$out"
"$py" -c "import jax; print(jax.devices())" | tee "$out/devices.txt"
if [ "$quick" = "--quick" ]; then
  preset="preset=tiny train.steps=8 train.warmup_steps=2 train.eval_every=4"
  declare -A sweeps=([adam]=3e-3,1e-2 [muon]=1e-2,2e-2 [optax]=2e-2,4e-2)
  budget=300
else
  preset="preset=small"
  declare -A sweeps=([adam]=1e-3,2e-3,4e-3 [muon]=2e-3,4e-3,8e-3
                     [optax]=5e-3,1e-2,2e-2)
  budget=${COMPARE_SECONDS:-420}
fi
work=$(mktemp -d)
deadline=$((SECONDS + budget))
# many processes share the GPU: none may take most of its memory up front
export XLA_PYTHON_CLIENT_PREALLOCATE=false
for name in "${!sweeps[@]}"; do
  for lr in ${sweeps[$name]//,/ }; do
    timeout "$budget" "$py" -m examples.flax_lm.compare $preset --out "$work" \
      --lrs "$name=$lr" --max-extensions 0 > "$out/compare_$name-$lr.log" 2>&1 &
  done
done
wait
for name in "${!sweeps[@]}"; do
  timeout $((deadline - SECONDS > 1 ? deadline - SECONDS : 1)) "$py" -m \
    examples.flax_lm.compare $preset --out "$work" --lrs "$name=${sweeps[$name]}" \
    > "$out/compare_$name.log" 2>&1 &
done
wait
unset XLA_PYTHON_CLIENT_PREALLOCATE
tar czf "$out/compare.tgz" -C "$work" .
cat "$out"/compare_*-*.log > "$out/compare_starts.log" && rm "$out"/compare_*-*.log
rm -rf "$work"
timeout "${BENCH_SECONDS:-150}" bash benchmarks/gpu.sh "$out/bench" $quick \
  > "$out/bench.log" 2>&1
echo "device_run finished: $(ls "$out" "$out/bench" | tr '\n' ' ')"
