#!/usr/bin/env bash
# The standing mutation score of the policy core (docs/testing.md), outside CI.
#
#   bash benchmarks/mutation.sh [REV]      # REV: the commit to measure (default HEAD): the policy core
#   bash benchmarks/mutation.sh REV MODULE...   # other modules, one run for the named ones (spikes,
#       # telemetry, distributed, scaler, ...: `python benchmarks/mutation_modules.py --list` names them,
#       # their files and their tests); torchtitan and verl need their venvs active (envs/*/ci.sh DIR)
#   MUTATION_EMPTY="tests/test_validate.py tests/test_keywords.py" bash benchmarks/mutation.sh   # without those tests
#   MUTATION_ONLY=names.txt bash benchmarks/mutation.sh   # only the mutants named in names.txt (one a line,
#                                                         # e.g. an earlier run's survivors.txt): reruns
#
# mutmut rewrites the code it mutates, so it never runs in this checkout: REV is exported into a
# fresh folder ($MUTATION_DIR, default /tmp/lossscale-mutation), this checkout's setup.cfg (the
# [mutmut] section: which modules, which tests) is laid over it, and mutmut runs there with one
# worker. mutmut itself lives in its own virtual environment ($MUTATION_VENV), made on first use
# on top of the project's environment: the `python` on PATH, so activate the project's venv first
# (torch, pytest, hypothesis; `python -m venv --system-site-packages` would see the interpreter's
# own site-packages, not that venv's, so a .pth file names the venv's instead).
set -euo pipefail

main() {  # one function, read whole before it runs: editing this file mid-run cannot derail it
    local repo rev commit work venv version=3.8.1 start
    repo="${MUTATION_REPO:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}"
    rev="${1:-HEAD}"
    local modules=("${@:2}")  # none: setup.cfg's [mutmut] as committed (the policy core)
    work="${MUTATION_DIR:-/tmp/lossscale-mutation}"
    venv="${MUTATION_VENV:-/tmp/lossscale-mutmut-venv}"
    if ! "$venv/bin/mutmut" --version 2>/dev/null | grep -q "$version"; then
        python -m venv "$venv"
        "$venv/bin/pip" install -q "mutmut==$version"
    fi
    # On every run, so that mutmut's venv sees the environment active now, not the one it was made in.
    if printf '%s\n' "${modules[@]}" | grep -q -x -E 'torchtitan|verl'; then  # their venvs: no hypothesis
        python -c 'import torch, pytest' \
            || { echo "activate the framework's virtual environment first (envs/*/ci.sh DIR)" >&2; exit 2; }
    else
        python -c 'import torch, pytest, hypothesis' \
            || { echo "activate the project's virtual environment first (torch, pytest, hypothesis)" >&2; exit 2; }
    fi
    python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
        > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/project-env.pth"
    # The spawned gloo ranks of the distributed tests run the mutant (they inherit MUTANT_UNDER_TEST
    # and mutmut's sys.path) but cannot tell mutmut's stats run which functions they reached:
    # benchmarks/mutmut_spawned.py carries that back (a .pth line loads it in every spawned process,
    # PYTEST_PLUGINS in the test process). Installed on every run, so an edit to it takes effect.
    local site
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    cp "$repo/benchmarks/mutmut_spawned.py" "$site/mutmut_spawned.py"
    echo "import mutmut_spawned" > "$site/zz-mutmut-spawned.pth"  # after project-env.pth: pytest is found
    case "$work" in "$repo"|"$repo"/*) echo "MUTATION_DIR must lie outside the checkout" >&2; exit 2;; esac
    rm -rf "$work" && mkdir -p "$work"
    commit="$(git -C "$repo" rev-parse --short "$rev")"  # now: the branch may move while this runs
    git -C "$repo" archive "$commit" | tar -x -C "$work"
    cp "$repo/setup.cfg" "$work/setup.cfg"
    if [ ${#modules[@]} -gt 0 ]; then  # the copy's [mutmut] section: those modules and their tests
        python "$repo/benchmarks/mutation_modules.py" "$work/setup.cfg" "${modules[@]}" || exit 2
        echo "modules: ${modules[*]}"
    fi
    local only=()
    if [ -n "${MUTATION_ONLY:-}" ]; then  # read before the cd below: the path may be relative
        # A process substitution's failure does not stop the script: check the file, then the names, so
        # a wrong path cannot turn into a run of every mutant.
        [ -r "$MUTATION_ONLY" ] || { echo "MUTATION_ONLY=$MUTATION_ONLY: no such readable file" >&2; exit 2; }
        mapfile -t only < <(sed -e 's/:.*//' -e 's/^[[:space:]]*//' "$MUTATION_ONLY" | grep .)
        [ ${#only[@]} -gt 0 ] || { echo "MUTATION_ONLY=$MUTATION_ONLY names no mutant" >&2; exit 2; }
    fi
    local f
    for f in ${MUTATION_EMPTY:-}; do : > "$work/$f"; done  # emptied, not removed: setup.cfg names them
    cd "$work"
    # One thread per process: the CPU is shared, and mutmut forks the test process (OpenMP after fork).
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
    mkdir -p "$work/spawned-hits"
    export LOSSSCALE_MUTMUT_HITS="$work/spawned-hits" PYTEST_PLUGINS=mutmut_spawned
    start=$(date +%s)
    "$venv/bin/mutmut" run --max-children 1 "${only[@]}" > mutmut-run.log 2>&1 || { tail -c 3000 mutmut-run.log; exit 1; }
    echo "commit $commit${modules:+, modules ${modules[*]}}, run time $(( $(date +%s) - start )) s"
    "$venv/bin/mutmut" results --all true > results.txt
    if [ ${#only[@]} -gt 0 ]; then  # the named mutants only: the others were not run
        grep -F -f <(printf '%s:\n' "${only[@]}") results.txt > named.txt || true
        mv named.txt results.txt
    fi
    python - <<'PY'
import collections
counts = collections.Counter(line.rsplit(": ", 1)[1].strip() for line in open("results.txt") if ": " in line)
total = sum(counts.values())
killed = counts["killed"] + counts["timeout"]  # mutmut counts a timeout as a kill too
print(dict(counts))
print(f"killed {killed} of {total} = {100 * killed / total:.1f}% (a mutant no selected test reaches counts as a survivor)")
PY
    grep -v -E ": (killed|timeout)$" results.txt > survivors.txt || true
    echo "not killed: $work/survivors.txt; see one with: cd $work && $venv/bin/mutmut show NAME"
}

main "$@"
