#!/usr/bin/env bash
# The standing mutation score of the policy core (docs/testing.md), outside CI.
#
#   bash benchmarks/mutation.sh [REV]      # REV: the commit to measure (default HEAD)
#
# mutmut rewrites the code it mutates, so it never runs in this checkout: REV is exported into a
# fresh folder ($MUTATION_DIR, default /tmp/lossscale-mutation), this checkout's setup.cfg (the
# [mutmut] section: which modules, which tests) is laid over it, and mutmut runs there with one
# worker. mutmut itself lives in its own virtual environment ($MUTATION_VENV), made on first use
# on top of the project's environment (torch, pytest, hypothesis).
set -euo pipefail
REPO="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
REV="${1:-HEAD}"
WORK="${MUTATION_DIR:-/tmp/lossscale-mutation}"
VENV="${MUTATION_VENV:-/tmp/lossscale-mutmut-venv}"
MUTMUT_VERSION=3.8.1

if ! "$VENV/bin/mutmut" --version 2>/dev/null | grep -q "$MUTMUT_VERSION"; then
    python -m venv --system-site-packages "$VENV"
    "$VENV/bin/pip" install -q "mutmut==$MUTMUT_VERSION"
fi
case "$WORK" in "$REPO"|"$REPO"/*) echo "MUTATION_DIR must lie outside the checkout" >&2; exit 2;; esac
rm -rf "$WORK" && mkdir -p "$WORK"
git -C "$REPO" archive "$REV" | tar -x -C "$WORK"
cp "$REPO/setup.cfg" "$WORK/setup.cfg"
cd "$WORK"
# One thread per process: the CPU is shared, and mutmut forks the test process (OpenMP after fork).
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
start=$(date +%s)
"$VENV/bin/mutmut" run --max-children 1 > mutmut-run.log 2>&1 || { tail -c 3000 mutmut-run.log; exit 1; }
echo "run time: $(( $(date +%s) - start )) s"
"$VENV/bin/mutmut" results --all true > results.txt
python - <<'PY'
import collections, re
counts = collections.Counter(line.rsplit(": ", 1)[1].strip() for line in open("results.txt") if ": " in line)
total = sum(counts.values())
killed = counts["killed"] + counts["timeout"]  # mutmut counts a timeout as a kill too
print(dict(counts))
print(f"killed {killed} of {total} (a mutant no selected test reaches counts as a survivor) = {100 * killed / total:.1f}%")
PY
grep -v -E ": (killed|timeout)$" results.txt > survivors.txt || true
echo "survivors (and untested mutants): $WORK/survivors.txt; show one with: cd $WORK && $VENV/bin/mutmut show NAME"
