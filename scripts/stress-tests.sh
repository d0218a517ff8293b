#!/usr/bin/env bash
# Run every test suite RUNS times in a row with another suite running beside
# it, so that a test that waits for a proxy of its event, or for a duration,
# fails here rather than on a loaded machine.
#
#   scripts/stress-tests.sh [BUILD] [RUNS] [SUITE...]
#
# BUILD defaults to build, RUNS to 20, the suites to every test_* there. Each
# suite runs as ctest runs it (--jobs=1, from BUILD); the neighbour is the
# next suite in the list, run in a loop until the suite's runs end. Prints a
# line a suite and "N passed, N failed" at the end; exits 1 on any failure.
# Logs of failed runs are kept in BUILD/stress-logs/.
set -uo pipefail
build=${1:-build}
runs=${2:-20}
shift $(($# > 2 ? 2 : $#))
cd "$build" || exit 2
mkdir -p testtmp stress-logs
if [ $# -gt 0 ]; then suites=("$@"); else mapfile -t suites < <(ls test_* | grep -v '\.' ); fi
[ ${#suites[@]} -gt 0 ] || { echo "no test suites in $build"; exit 2; }

passed=0
failed=0
for i in "${!suites[@]}"; do
    s=${suites[$i]}
    neighbour=${suites[$(((i + 1) % ${#suites[@]}))]}
    # The neighbour loops in the background, in a process group of its own
    # so that it stops whole: a loaded machine for s.
    setsid bash -c 'while :; do ./"$1" --jobs=1 >/dev/null 2>&1; done' _ "$neighbour" &
    bg=$!
    ok=0
    for r in $(seq 1 "$runs"); do
        if ./"$s" --jobs=1 >"stress-logs/$s.$r.log" 2>&1; then
            ok=$((ok + 1))
            rm -f "stress-logs/$s.$r.log"
        fi
    done
    kill -- -"$bg" 2>/dev/null
    wait "$bg" 2>/dev/null
    bad=$((runs - ok))
    printf '%-24s %3d/%d passed (beside %s)%s\n' "$s" "$ok" "$runs" "$neighbour" \
        "$([ $bad -gt 0 ] && echo "  FAILED: see $build/stress-logs/$s.*.log")"
    if [ $bad -eq 0 ]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
