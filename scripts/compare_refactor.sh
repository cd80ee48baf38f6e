#!/usr/bin/env bash
# Issue 34, acceptance 8: `kvstrata bench restore` and `kvstrata bench batching` with the code
# before the store's restructuring (commit 17d59bf) and now, side by side on one machine, in the
# order old, new, old, new (per suite), each run's --json kept; then every ratio the suites report
# compared: new against old, and old against old (the noise of runs of the same code).
#
# Run it on a quiet machine from the repository root:
#   bash scripts/compare_refactor.sh
# ROUNDS=3 runs each side three times (old, new, old, new, old, new); SUITES="restore" runs one
# suite; AFTER=<commit> compares with that commit (in a worktree of its own) instead of this tree.
# Shorter runs (a rough check, not the acceptance): pass each suite's options, e.g.
#   RESTORE_ARGS="--contexts 512,2048 --tiny-contexts 4096 --repeats 3 --no-lossy" \
#   BATCHING_ARGS="--sessions 1,8 --steps 8 --dtypes fp32 --repeats 2" bash scripts/compare_refactor.sh
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
BEFORE=${BEFORE:-17d59bf}
PY=${PY:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/bench-out/refactor-compare}
OLD_TREE=${OLD_TREE:-${TMPDIR:-/tmp}/kvstrata-before-refactor}
ROUNDS=${ROUNDS:-2}
SUITES=${SUITES:-restore batching}
NEW_TREE=$ROOT
if [ -n "${AFTER:-}" ]; then
  NEW_TREE=${TMPDIR:-/tmp}/kvstrata-after-refactor
  [ -d "$NEW_TREE" ] || git -C "$ROOT" worktree add --detach "$NEW_TREE" "$AFTER" >/dev/null
fi
RESTORE_ARGS=${RESTORE_ARGS:-}
BATCHING_ARGS=${BATCHING_ARGS:-}
mkdir -p "$OUT"
if [ ! -d "$OLD_TREE" ]; then
  git -C "$ROOT" worktree add --detach "$OLD_TREE" "$BEFORE" >/dev/null
fi

run() {  # tree label suite args...
  local tree=$1 label=$2 suite=$3
  shift 3
  echo "== $suite ($label: $tree)" >&2
  # the tree's own source first on the path: the installed kvstrata is either one
  PYTHONPATH="$tree/src" "$PY" -c 'import sys; from kvstrata.cli.main import app; sys.argv[0] = "kvstrata"; app()' \
    bench "$suite" "$@" --json >"$OUT/$suite-$label.json"
}

for suite in $SUITES; do
  case $suite in
    restore) args=$RESTORE_ARGS ;;
    batching) args=$BATCHING_ARGS ;;
    *) echo "unknown suite $suite (restore, batching)" >&2; exit 2 ;;
  esac
  for ((round = 1; round <= ROUNDS; round++)); do
    # shellcheck disable=SC2086  # the options are words
    run "$OLD_TREE" "old$round" "$suite" $args
    # shellcheck disable=SC2086
    run "$NEW_TREE" "new$round" "$suite" $args
  done
done
"$PY" "$ROOT/scripts/compare_bench.py" "$OUT"
echo "(the old tree stays at $OLD_TREE: git worktree remove $OLD_TREE)" >&2
