#!/usr/bin/env bash
# CI's four installs (.ci/run) timed two ways in fresh environments: as pip
# does by default with the pip a new venv has, and as .ci/run does them (pip
# upgraded, --no-compile); prints each install's seconds, the two totals and
# their ratio, and whether `pip freeze` is the same both ways.
# Needs the package registries; takes ~12 minutes on 2 cores.
#   usage: benchmarks/ci_install.sh [PYTHON_3_12]
set -euo pipefail
cd "$(dirname "$0")/.."
newest=${1:-python3.12}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

installs() {  # installs WAY: the four installs, "name seconds" lines
  local way=$1 floor="$work/$1-floor" top="$work/$1-newest" flag=""
  python3 -m venv "$floor"
  "$newest" -m venv "$top"
  local start=$SECONDS  # the upgrades count in "test"
  if [ "$way" = ci ]; then
    "$floor/bin/pip" install -q --upgrade pip
    "$top/bin/pip" install -q --upgrade pip
    flag=--no-compile
  fi
  "$floor/bin/pip" install -q $flag -e ".[test]"
  echo "test $((SECONDS - start))"; start=$SECONDS
  "$floor/bin/pip" install -q $flag -e ".[docs,lint]"
  echo "docs $((SECONDS - start))"; start=$SECONDS
  "$top/bin/pip" install -q $flag -e ".[test]"
  "$top/bin/pip" install -q $flag -e ".[maxtext]"
  "$top/bin/pip" install -q $flag --no-deps "maxtext==0.2.5"
  echo "newest $((SECONDS - start))"; start=$SECONDS
  "$floor/bin/pip" install -q $flag -e ".[test,levanter,tunix]"
  echo "trainers $((SECONDS - start))"
  "$floor/bin/pip" freeze --exclude-editable | grep -v '^pip==' \
    > "$work/$way.freeze"
  "$top/bin/pip" freeze --exclude-editable | grep -v '^pip==' \
    >> "$work/$way.freeze"
}

installs default 2>/dev/null | tee "$work/default.txt"
installs ci 2>/dev/null | tee "$work/ci.txt"
default=$(awk '{s += $2} END {print s}' "$work/default.txt")
ci=$(awk '{s += $2} END {print s}' "$work/ci.txt")
echo "total default ${default} s, as .ci/run ${ci} s:" \
  "ratio $(awk -v a="$ci" -v b="$default" 'BEGIN {printf "%.2f", a / b}')"
if cmp -s "$work/default.freeze" "$work/ci.freeze"; then
  echo "pip freeze: the same"
else
  echo "pip freeze: differs"; diff "$work/default.freeze" "$work/ci.freeze"
fi
