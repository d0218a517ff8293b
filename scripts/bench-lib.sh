# scripts/bench-lib.sh — what the serving benchmarks share (sourced by
# bench-serving.sh and bench-arrival.sh): seeded documents and a server on a
# loopback port. Needs curl.

# The words documents are drawn from.
bench_words=(river valley town market farmer bridge winter harvest council record library
    school children teacher road mountain forest village mayor storm summer festival
    baker bread wheat mill water stone tower church bell lantern night morning train
    station letter journey north south painter garden flower apple orchard season rain
    cloud wind fisherman boat harbor lighthouse island map captain sailor merchant)

# bench_doc HEAD N: "HEAD" and N words drawn from RANDOM, a full stop every
# 12, into $DOC. Call it in this shell, not in a command substitution: a
# subshell reseeds RANDOM, and the same seed must give the same documents.
bench_doc() {
    DOC=$1
    local n=0
    while [ $n -lt "$2" ]; do
        DOC+=" ${bench_words[RANDOM % ${#bench_words[@]}]}"
        n=$((n + 1))
        [ $((n % 12)) -eq 0 ] && DOC+="."
    done
    DOC+="."
}

# bench_serve BIN MODEL PORT LOG [ARGS...]: start `BIN serve` in the
# background ($BENCH_SERVER is its pid) and wait until /ready answers; on a
# server that exits first, print its log and exit 1.
bench_serve() {
    local bin=$1 model=$2 port=$3 log=$4
    shift 4
    "$bin" serve --model "$model" --threads 2 --kv-dtype f16 --port "$port" --log-level warn \
        "$@" >"$log" 2>&1 &
    BENCH_SERVER=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/ready" >/dev/null 2>&1 && return 0
        kill -0 "$BENCH_SERVER" 2>/dev/null || { cat "$log" >&2; exit 1; }
        sleep 0.5
    done
    echo "the server did not start in 300 s (log: $log)" >&2
    exit 1
}
