#!/usr/bin/env bash
# Embeddings beside generation (docs/benchmarks.md, "Embeddings beside
# generation"):
#
#   (a) throughput: one /v1/embeddings call of INPUTS inputs of 64 token ids
#   each (seeded, the same for every server), timed end to end, after a
#   one-input warm-up, on `ragkv serve --pooling last` and, when REF is
#   given, on the reference llama-server (`--embedding --pooling last`);
#   both on 2 threads, run one after the other; embeddings per second.
#   (b) a stream beside it: stream A (temperature 0, TOKENS tokens) alone,
#   then again with the same call sent after A's first token; A's median
#   gap between tokens alone, its median and worst gaps while the call runs,
#   the worst over the median alone, and A's tokens while the call ran; for
#   BIN and, when BEFORE is given, for an older binary too. ragkv runs with
#   --step-tokens 64. Each row ends with the 1-minute load average.
#
#   scripts/bench-embeddings.sh MODEL [BIN] [REF] [BEFORE] [INPUTS] [TOKENS]
#     MODEL a qwen3 GGUF without a pooling key (`ragkv mkmodel --preset
#     qwen3-0.6b --type bf16`): it generates, and --pooling last embeds;
#     BIN (default build/ragkv); REF the llama-server binary ("" to skip;
#     set LD_LIBRARY_PATH for it); BEFORE another ragkv binary ("" to skip);
#     INPUTS (default 256); TOKENS (default 32). REF_ARGS (environment)
#     replaces the reference's slots and batch flags (default "-c 4096 -np
#     32 -b 2048 -ub 2048": 32 inputs of 64 tokens a batch, as ragkv's
#     2048-token passes).
# Needs curl, jq and awk. Every request has a time limit, every server runs
# on loopback and is stopped at the end.
set -euo pipefail
usage="usage: scripts/bench-embeddings.sh MODEL [BIN] [REF] [BEFORE] [INPUTS] [TOKENS]"
model=${1:?$usage}
bin=${2:-build/ragkv}
ref=${3:-}
before=${4:-}
inputs=${5:-256}
tokens=${6:-32}
port=18496
url=http://127.0.0.1:$port
for tool in curl jq awk; do
    command -v $tool >/dev/null || { echo "bench-embeddings: $tool is required" >&2; exit 2; }
done
work=$(mktemp -d)
. "$(dirname "$0")/bench-lib.sh"
server=
stop_server() {
    [ -n "$server" ] || return 0
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    server=
}
trap 'stop_server; rm -rf "$work"' EXIT

# The call: INPUTS arrays of 64 token ids in [1000, 101000), seeded.
awk -v n="$inputs" 'BEGIN {
    srand(7)
    printf "{\"input\": ["
    for (i = 0; i < n; i++) {
        printf "%s[", (i ? "," : "")
        for (k = 0; k < 64; k++) printf "%s%d", (k ? "," : ""), 1000 + int(rand() * 100000)
        printf "]"
    }
    printf "]}"
}' >"$work/call.json"
warm='{"input": [[1000, 2000, 3000, 4000]]}'

# embed_call OUT: the call, its HTTP status and seconds into OUT.
embed_call() {
    curl -s --max-time 1800 -o "$work/embed.out" -w '%{http_code} %{time_total}\n' -X POST \
        "$url/v1/embeddings" -H 'Content-Type: application/json' \
        --data-binary @"$work/call.json" >"$1"
    local code n
    read -r code _ <"$1"
    n=$(jq '.data | length' "$work/embed.out" 2>/dev/null || echo 0)
    if [ "$code" != 200 ] || [ "$n" != "$inputs" ]; then
        echo "bench-embeddings: the call got $code, $n embeddings: $(head -c 300 "$work/embed.out")" >&2
        exit 1
    fi
}

# wait_health: until /health answers 200 (at most 300 s).
wait_health() {
    for _ in $(seq 600); do
        curl -sf "$url/health" >/dev/null 2>&1 && return 0
        kill -0 "$server" 2>/dev/null || { cat "$work/serve.log" >&2; exit 1; }
        sleep 0.5
    done
    echo "bench-embeddings: the server did not start (log: $work/serve.log)" >&2
    exit 1
}

a_body=$(jq -n --argjson n "$tokens" \
    '{prompt: "Once upon a time, there was a little girl who", max_tokens: $n,
      temperature: 0, ignore_eos: true, stream: true}')
# stream_times OUT: stream A, one arrival time (s) per content event into OUT.
stream_times() {
    curl -sN --max-time 1800 -X POST "$url/v1/completions" -H 'Content-Type: application/json' \
        --data-binary "$a_body" |
        while IFS= read -r line; do
            case $line in data:*'"text"'*) echo "$EPOCHREALTIME" >>"$1" ;; esac
        done
}
# gaps IN [FROM [TO]]: the gaps (ms) between consecutive times in IN that end
# after FROM and start before TO, one a line.
gaps() {
    awk -v from="${2:-0}" -v to="${3:-1e18}" \
        'p != "" && $1 > from && p < to { printf "%.1f\n", ($1 - p) * 1000 } { p = $1 }' "$1"
}
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
worst() { sort -n | tail -1; }

# throughput NAME: the call on the server at $url, after a warm-up; a row.
throughput() {
    curl -sf --max-time 600 -X POST "$url/v1/embeddings" -H 'Content-Type: application/json' \
        -d "$warm" >/dev/null
    embed_call "$work/t"
    local s
    read -r _ s <"$work/t"
    printf '%-28s %8d %10.1f %12.1f %6s\n' "$1" "$inputs" "$s" \
        "$(awk -v n="$inputs" -v s="$s" 'BEGIN { print n / s }')" "$(cut -d' ' -f1 /proc/loadavg)"
}

# beside NAME: stream A alone, then A with the call sent after its first token.
beside() {
    rm -f "$work/alone" "$work/with"
    stream_times "$work/warm" # A's prompt cached from here on
    stream_times "$work/alone"
    stream_times "$work/with" &
    local a=$! t0 t1 s
    while [ ! -s "$work/with" ]; do sleep 0.01; done
    t0=$EPOCHREALTIME
    embed_call "$work/t"
    t1=$EPOCHREALTIME
    wait $a
    local med med_with with n_during
    med=$(gaps "$work/alone" | median)
    med_with=$(gaps "$work/with" "$t0" "$t1" | median)
    with=$(gaps "$work/with" "$t0" "$t1" | worst)
    n_during=$(awk -v a="$t0" -v b="$t1" '$1 > a && $1 < b' "$work/with" | wc -l)
    read -r _ s <"$work/t"
    printf '%-28s %10s %10s %10s %8.1f %10d %10.1f %6s\n' "$1" "$med" "$med_with" "$with" \
        "$(awk -v a="$with" -v b="$med" 'BEGIN { print a / b }')" "$n_during" "$s" \
        "$(cut -d' ' -f1 /proc/loadavg)"
}

# A fixed KV budget: an `auto` one (11 GiB here) is still being faulted in
# by its background thread while the first minute measures.
ragkv_args=(--pooling last --step-tokens 64 --kv-memory-mb 2048)
echo "(a) one call of $inputs inputs of 64 tokens, 2 threads"
printf '%-28s %8s %10s %12s %6s\n' server inputs seconds "embeddings/s" load
bench_serve "$bin" "$model" "$port" "$work/serve.log" "${ragkv_args[@]}"
server=$BENCH_SERVER
throughput "ragkv"
stop_server
if [ -n "$ref" ]; then
    # shellcheck disable=SC2086 # REF_ARGS is a list of flags
    "$ref" -m "$model" --host 127.0.0.1 --port "$port" -t 2 --embedding --pooling last \
        ${REF_ARGS:--c 4096 -np 32 -b 2048 -ub 2048} >"$work/serve.log" 2>&1 &
    server=$!
    wait_health
    throughput "llama-server"
    grep -E 'n_ctx_seq|kv_unified|flash_attn' "$work/serve.log" | head -4 | sed 's/^/    /' || true
    stop_server
fi

echo
echo "(b) stream A ($tokens tokens) beside the same call, --step-tokens 64"
printf '%-28s %10s %10s %10s %8s %10s %10s %6s\n' binary "median ms" "med. with" "worst with" \
    "worst/med" "A tokens" "call s" load
for b in "$bin" ${before:+"$before"}; do
    bench_serve "$b" "$model" "$port" "$work/serve.log" "${ragkv_args[@]}"
    server=$BENCH_SERVER
    beside "$b"
    stop_server
done
