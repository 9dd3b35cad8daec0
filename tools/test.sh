#!/usr/bin/env bash
# Every check the project runs, in CI order. The README's test command (and so .ci/run) calls this after
# installing the package with its dev extra. Runs on a 2-core CPU machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n== %s ==\n' "$*"; }
t0=$SECONDS

step "the house rules of dspark/: no import cycles, no imports that run back up a floor, no private names across modules"
python tools/check_layers.py

step "notebooks and package in sync: nbdev-export must leave dspark/ unchanged"
nbdev-export
if [ -n "$(git status --porcelain -- dspark)" ]; then
  git status --porcelain -- dspark; git --no-pager diff --stat -- dspark
  echo "nbdev-export changed dspark/: edit the notebooks (or nbdev-update), export, and commit both"; exit 1
fi

# One run of the notebooks: papermill executes every cell that `nbdev-test` would (and the cells flagged slow or
# notest, which it skips), with the CPU-sized parameters; running both took ~200 s more for the same cells.
# Cells flagged gpu are left out on CPU. For a quick local check: nbdev-test --n-workers 2
step "notebooks end to end with small parameters (papermill, two kernels at a time)"
python tools/run_papermill.py

if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  step "installing Debian chromium for the docs rendering test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || echo "could not install chromium"
fi

step "docs site builds offline from the notebooks"
python tools/build_docs.py --out _build/site

step "pytest"
python -m pytest -n 2 -q -p no:cacheprovider
echo "all checks passed in $((SECONDS - t0)) s"
