#!/usr/bin/env bash
# A cold RAG request arriving while another streams (docs/benchmarks.md,
# "Cold arrival"), at several step budgets, each in one run of this script:
#
#   A streams 96 tokens (its prompt cached). After 1.5 s, B arrives with 8
#   new documents of about 210 tokens (every chunk a miss) and asks for one
#   token. Measured: A's inter-token gaps alone (median) and with B (worst),
#   and B's time to first token, against the same with an unlimited budget.
#
#   scripts/bench-arrival.sh MODEL [BIN] [PORT] [BUDGETS...]
# BUDGETS default to "0 32 64 128 256 512" (0 = unlimited). Needs curl and
# jq. The server restarts for each budget and stops at the end.
set -euo pipefail
model=${1:?usage: scripts/bench-arrival.sh MODEL [BIN] [PORT] [BUDGETS...]}
bin=${2:-build/ragkv}
port=${3:-18490}
shift $(($# < 3 ? $# : 3))
budgets=("$@")
[ ${#budgets[@]} -gt 0 ] || budgets=(0 32 64 128 256 512)
url=http://127.0.0.1:$port
for tool in curl jq; do
    command -v $tool >/dev/null || { echo "bench-arrival: $tool is required" >&2; exit 2; }
done
work=$(mktemp -d)
server=
stop_server() {
    [ -n "$server" ] || return 0
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    server=
}
trap 'stop_server; rm -rf "$work"' EXIT

words=(river valley town market farmer bridge winter harvest council record library
    school children teacher road mountain forest village mayor storm summer festival
    baker bread wheat mill water stone tower church bell lantern night morning train
    station letter journey north south painter garden flower apple orchard season rain
    cloud wind fisherman boat harbor lighthouse island map captain sailor merchant)
RANDOM=2027
doc() { # doc TAG: about 210 tokens of seeded words, unique to TAG
    local out="Record $1." n=0
    while [ $n -lt 160 ]; do
        out+=" ${words[RANDOM % ${#words[@]}]}"
        n=$((n + 1))
        [ $((n % 12)) -eq 0 ] && out+="."
    done
    printf '%s.' "$out"
}
a_prompt="You are a storyteller.##$(doc a)##Tell the story of the town in many words."

body() { # body PROMPT MAX_TOKENS STREAM
    jq -n --arg p "$1" --argjson n "$2" --argjson s "$3" \
        '{prompt: $p, max_tokens: $n, temperature: 0, ignore_eos: true, stream: $s}'
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

printf '%-8s %12s %12s %8s %10s\n' budget "A gap alone" "A worst" ratio "B TTFT ms"
for budget in "${budgets[@]}"; do
    "$bin" serve --model "$model" --threads 2 --kv-dtype f16 --kv-memory-mb 4096 \
        --step-tokens "$budget" --port "$port" --log-level warn >"$work/serve.log" 2>&1 &
    server=$!
    for _ in $(seq 600); do
        curl -sf "$url/health" >/dev/null 2>&1 && break
        kill -0 "$server" 2>/dev/null || { cat "$work/serve.log" >&2; exit 1; }
        sleep 0.5
    done
    stream_times "$work/warm" # A's prompt cached from here on
    stream_times "$work/alone"
    alone=$(gaps "$work/alone" | median)
    # B: eight documents no request sent before, then one token.
    b_prompt="Answer from the documents."
    for i in 1 2 3 4 5 6 7 8; do b_prompt+="##$(doc "b$budget-$i")"; done
    b_prompt+="##Which record mentions the lighthouse?"
    stream_times "$work/with_b" &
    a=$!
    sleep 1.5
    t0=$EPOCHREALTIME
    curl -sf -X POST "$url/v1/completions" -H 'Content-Type: application/json' \
        --data-binary "$(body "$b_prompt" 1 false)" >"$work/b.json"
    t1=$EPOCHREALTIME
    wait $a
    worst_gap=$(gaps "$work/with_b" | worst)
    misses=$(jq '[.ragkv.chunks[] | select(.status == "miss")] | length' "$work/b.json")
    [ "$misses" = 8 ] || echo "bench-arrival: B had $misses misses, not 8" >&2
    printf '%-8s %12.1f %12.1f %7.1fx %10.0f\n' "$budget" "$alone" "$worst_gap" \
        "$(jq -n --argjson w "$worst_gap" --argjson a "$alone" '$w / $a')" \
        "$(jq -n --argjson a "$t0" --argjson b "$t1" '($b - $a) * 1000')"
    stop_server
done
