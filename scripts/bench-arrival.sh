#!/usr/bin/env bash
# A RAG request arriving while another streams (docs/benchmarks.md, "Cold
# arrival" and "Slow tier"), each figure in one run of this script:
#
#   A streams 96 tokens (its prompt cached). After 1.5 s, B arrives with 8
#   documents of about 210 tokens and asks for one token. Measured: A's
#   inter-token gaps alone (median) and with B (worst), and B's time to
#   first token.
#
#   scripts/bench-arrival.sh MODEL [BIN] [PORT] [BUDGETS...]
#     B's documents are new (every chunk a miss), at each step budget
#     (default "0 32 64 128 256 512"; 0 = unlimited).
#   DISK_DELAYS="0 200" scripts/bench-arrival.sh MODEL [BIN] [PORT] [BUDGETS...]
#     B's documents are in the disk tier (pre-warmed, then flushed from
#     memory), every read delayed by each of DISK_DELAYS ms
#     (--store-read-delay-ms), at each step budget (default "64 0": with a
#     budget the reads run on the loader thread; with none, on the engine
#     thread).
#   WRITE_DELAYS="0 200" scripts/bench-arrival.sh MODEL [BIN] [PORT] [BUDGETS...]
#     B's documents are new and written through to a fresh disk tier, every
#     write delayed by each of WRITE_DELAYS ms (--store-write-delay-ms; 0
#     passes no flag, for a build without it), at each step budget
#     (default "64").
# B_EXTRA='{"chunk_context": "anchor"}' (any JSON object) is merged into B's
# request in every mode: another chunk context, a repair policy.
# SERVE_FLAGS="--log-level debug" adds flags to every server (debug: a line
# per engine step, its tokens and times); KEEP_LOGS=DIR keeps each server's
# log there as serve-BUDGET.log.
# Needs curl and jq. The server restarts for each figure and stops at the end.
set -euo pipefail
model=${1:?usage: scripts/bench-arrival.sh MODEL [BIN] [PORT] [BUDGETS...]}
bin=${2:-build/ragkv}
port=${3:-18490}
shift $(($# < 3 ? $# : 3))
budgets=("$@")
delays=(${DISK_DELAYS:-})
write_delays=(${WRITE_DELAYS:-})
if [ ${#budgets[@]} -eq 0 ]; then
    if [ ${#delays[@]} -gt 0 ]; then
        budgets=(64 0)
    elif [ ${#write_delays[@]} -gt 0 ]; then
        budgets=(64)
    else
        budgets=(0 32 64 128 256 512)
    fi
fi
url=http://127.0.0.1:$port
for tool in curl jq; do
    command -v $tool >/dev/null || { echo "bench-arrival: $tool is required" >&2; exit 2; }
done
work=$(mktemp -d)
. "$(dirname "$0")/bench-lib.sh"
server=
server_label=
stop_server() {
    [ -n "$server" ] || return 0
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    [ -z "${KEEP_LOGS:-}" ] || cp "$work/serve.log" "$KEEP_LOGS/serve-$server_label.log"
    server=
}
trap 'stop_server; rm -rf "$work"' EXIT

# doc TAG: about 210 tokens of seeded words, unique to TAG, into $DOC.
doc() { bench_doc "Record $1." 160; }
RANDOM=2027
doc a
a_prompt="You are a storyteller.##$DOC##Tell the story of the town in many words."

body() { # body PROMPT MAX_TOKENS STREAM [EXTRA]: EXTRA (a JSON object) merged in
    jq -n --arg p "$1" --argjson n "$2" --argjson s "$3" --argjson x "${4:-{\}}" \
        '{prompt: $p, max_tokens: $n, temperature: 0, ignore_eos: true, stream: $s} + $x'
}
# stream_times OUT: stream A, one arrival time (s) per content event to OUT.
stream_times() {
    curl -sN -X POST "$url/v1/completions" -H 'Content-Type: application/json' \
        --data-binary "$(body "$a_prompt" 96 true)" |
        while IFS= read -r line; do
            case $line in data:*'"text"'*) echo "$EPOCHREALTIME" ;; esac
        done >"$1"
}
# gaps IN: the gaps between consecutive times, in ms, one a line.
gaps() { awk 'NR > 1 { printf "%.3f\n", ($1 - p) * 1000 } { p = $1 }' "$1"; }
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
worst() { sort -n | tail -1; }

# start_server BUDGET [ARGS...]: serve MODEL with that step budget.
start_server() {
    local budget=$1
    shift
    bench_serve "$bin" "$model" "$port" "$work/serve.log" --kv-memory-mb 4096 \
        --step-tokens "$budget" ${SERVE_FLAGS:-} "$@"
    server=$BENCH_SERVER
    server_label=$budget
}
# b_prompt TAG: B's eight documents (the same for the same TAG) and
# question, into $B_PROMPT.
b_prompt() {
    local i
    B_PROMPT="Answer from the documents."
    RANDOM=$((2027 + ${#1}))
    for i in 1 2 3 4 5 6 7 8; do
        doc "b$1-$i"
        B_PROMPT+="##$DOC"
    done
    B_PROMPT+="##Which record mentions the lighthouse?"
}
# arrival LABEL B_PROMPT WANT: A alone, then A with B arriving; one row.
# WANT is the status every chunk of B should report ("miss" or "hit").
arrival() {
    stream_times "$work/warm" # A's prompt cached from here on
    stream_times "$work/alone"
    local alone worst_gap t0 t1 a n
    alone=$(gaps "$work/alone" | median)
    stream_times "$work/with_b" &
    a=$!
    sleep 1.5
    t0=$EPOCHREALTIME
    curl -sf -X POST "$url/v1/completions" -H 'Content-Type: application/json' \
        --data-binary "$(body "$2" 1 false "${B_EXTRA:-{\}}")" >"$work/b.json"
    t1=$EPOCHREALTIME
    wait $a
    worst_gap=$(gaps "$work/with_b" | worst)
    n=$(jq --arg w "$3" '[.ragkv.chunks[] | select(.status == $w)] | length' "$work/b.json")
    [ "$n" = 8 ] || echo "bench-arrival: B had $n chunks with status $3, not 8" >&2
    printf '%-14s %12.1f %12.1f %7.1fx %10.0f\n' "$1" "$alone" "$worst_gap" \
        "$(jq -n --argjson w "$worst_gap" --argjson a "$alone" '$w / $a')" \
        "$(jq -n --argjson a "$t0" --argjson b "$t1" '($b - $a) * 1000')"
}

printf '%-14s %12s %12s %8s %10s\n' "budget" "A gap alone" "A worst" ratio "B TTFT ms"
if [ ${#write_delays[@]} -gt 0 ]; then
    for delay in "${write_delays[@]}"; do
        for budget in "${budgets[@]}"; do
            flags=(--store "$work/store-w$delay-$budget")
            [ "$delay" = 0 ] || flags+=(--store-write-delay-ms "$delay")
            start_server "$budget" "${flags[@]}"
            b_prompt "w$delay-$budget"
            arrival "$budget, w ${delay} ms" "$B_PROMPT" miss
            stop_server
        done
    done
    exit 0
fi
if [ ${#delays[@]} -eq 0 ]; then
    for budget in "${budgets[@]}"; do
        start_server "$budget"
        b_prompt "$budget"
        arrival "$budget" "$B_PROMPT" miss
        stop_server
    done
    exit 0
fi
# The slow tier: B's documents computed once into the store, then read back.
store="$work/store"
b_prompt disk
docs=$(jq -n --arg p "$B_PROMPT" '$p | split("##")[1:-1] | {chunks: ., persist: true}')
start_server 0 --store "$store"
curl -sf -X POST "$url/v1/chunks" -H 'Content-Type: application/json' --data-binary "$docs" \
    >/dev/null
stop_server
for delay in "${delays[@]}"; do
    for budget in "${budgets[@]}"; do
        start_server "$budget" --store "$store" --store-read-delay-ms "$delay"
        arrival "$budget, ${delay} ms" "$B_PROMPT" hit
        stop_server
    done
done
