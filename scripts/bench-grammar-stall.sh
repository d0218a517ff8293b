#!/usr/bin/env bash
# A stream while another client sends the largest grammar the bounds accept
# (docs/benchmarks.md, "Grammars beside a stream"):
#
#   A streams TOKENS tokens (temperature 0, its prompt cached): three
#   streams alone, then one stream after another for as long as a second
#   client sends, REPEATS times one after the other,
#   (a) the largest grammar the bounds accept: 4,096 alternatives alive at
#   once (the width bound), each [a-z]{250} and a word of its own, so
#   1,044,480 elements of the 1,048,576 allowed, every one of its decode
#   steps 4,096 alternatives wide and allowing every lowercase token; it
#   asks for 16 tokens, and its words change at every repeat so that no
#   compile is answered by the cache; and (b) the same grammar with a
#   4,097th alternative, which must be refused (400, naming the bound).
#   Measured: A's median and worst gap between tokens (within a stream)
#   alone and with the grammar client, the worst over the median alone, and
#   the grammar client's answers (how many 200 and 400, its slowest
#   request).
#
#   scripts/bench-grammar-stall.sh MODEL [BIN] [PORT] [RUNS] [TOKENS] [REPEATS]
#     RUNS (default 3) rows, each a fresh server; TOKENS (default 200);
#     REPEATS (default 4).
# Needs curl and jq. Every request has a time limit (--max-time 120), the
# grammar client stops after REPEATS, and the server stops at the end.
set -euo pipefail
model=${1:?usage: scripts/bench-grammar-stall.sh MODEL [BIN] [PORT] [RUNS] [TOKENS] [REPEATS]}
bin=${2:-build/ragkv}
port=${3:-18495}
runs=${4:-3}
tokens=${5:-200}
repeats=${6:-4}
url=http://127.0.0.1:$port
for tool in curl jq awk; do
    command -v $tool >/dev/null || { echo "bench-grammar-stall: $tool is required" >&2; exit 2; }
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

a_prompt="Once upon a time, there was a little girl who liked to tell long stories."
a_body=$(jq -n --arg p "$a_prompt" --argjson n "$tokens" \
    '{prompt: $p, max_tokens: $n, temperature: 0, ignore_eos: true, stream: true}')

# grammar_body N TAG: a request whose grammar is N alternatives, each
# [a-z]{250} then a word of four letters of its own (TAG makes them differ
# from one call to the next), into the file $work/g.json.
grammar_body() {
    awk -v n="$1" -v tag="$2" 'BEGIN {
        a = "abcdefghijklmnopqrstuvwxyz"
        printf "root ::= "
        for (i = 0; i < n; i++) {
            w = substr(a, tag % 26 + 1, 1)
            for (k = i; length(w) < 4; k = int(k / 26)) w = w substr(a, k % 26 + 1, 1)
            printf "%s[a-z]{250} \"%s\"", (i ? " | " : ""), w
        }
        printf "\n"
    }' | jq -Rs '{prompt: "Once", max_tokens: 16, temperature: 0, grammar: .}' >"$work/g.json"
}

# stream_times OUT: stream A, one arrival time (s) per content event
# appended to OUT, then a line "-" (the end of the stream).
stream_times() {
    curl -sN --max-time 120 -X POST "$url/v1/completions" -H 'Content-Type: application/json' \
        --data-binary "$a_body" |
        while IFS= read -r line; do
            case $line in data:*'"text"'*) echo "$EPOCHREALTIME" ;; esac
        done >>"$1"
    echo - >>"$1"
}
# gaps IN: the gaps between consecutive times of a stream, in ms, one a line.
gaps() { awk '$1 == "-" { p = ""; next } p != "" { printf "%.3f\n", ($1 - p) * 1000 } { p = $1 }' "$1"; }
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
worst() { sort -n | tail -1; }

# grammar_client: REPEATS times, the largest accepted grammar then one over
# the width bound; one line "STATUS MS" per request into $work/client.
grammar_client() {
    local i code t0 t1
    : >"$work/client"
    for i in $(seq "$repeats"); do
        for n in 4096 4097; do
            grammar_body "$n" "$((RANDOM + i))"
            t0=$EPOCHREALTIME
            code=$(curl -s --max-time 120 -o "$work/g.out" -w '%{http_code}' -X POST \
                "$url/v1/completions" -H 'Content-Type: application/json' \
                --data-binary @"$work/g.json") || true
            t1=$EPOCHREALTIME
            echo "$n $code $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", (b - a) * 1000 }')" \
                >>"$work/client"
            if [ "$n" = 4097 ] && ! grep -q 'more than 4096 alternatives' "$work/g.out"; then
                echo "bench-grammar-stall: the over-bound grammar got $code: $(head -c 300 "$work/g.out")" >&2
            fi
            if [ "$n" = 4096 ] && [ "$code" != 200 ]; then
                echo "bench-grammar-stall: the largest grammar got $code: $(head -c 300 "$work/g.out")" >&2
            fi
        done
    done
}

printf '%-4s %10s %10s %8s %8s %10s %10s %8s %6s %6s %10s\n' run "med alone" "worst alone" ratio \
    streams "med with" "worst with" ratio "200s" "400s" "slowest ms"
for run in $(seq "$runs"); do
    bench_serve "$bin" "$model" "$port" "$work/serve.log"
    server=$BENCH_SERVER
    rm -f "$work/warm" "$work/alone" "$work/with"
    stream_times "$work/warm" # A's prompt cached from here on
    for _ in 1 2 3; do stream_times "$work/alone"; done
    grammar_client &
    client=$!
    n_streams=0
    while kill -0 $client 2>/dev/null && [ $n_streams -lt 1000 ]; do
        stream_times "$work/with"
        n_streams=$((n_streams + 1))
    done
    wait $client
    m_alone=$(gaps "$work/alone" | median)
    w_alone=$(gaps "$work/alone" | worst)
    m_with=$(gaps "$work/with" | median)
    w_with=$(gaps "$work/with" | worst)
    printf '%-4s %10.2f %10.2f %7.1fx %8s %10.2f %10.2f %7.1fx %6s %6s %10s\n' "$run" \
        "$m_alone" "$w_alone" "$(awk -v w="$w_alone" -v m="$m_alone" 'BEGIN { print w / m }')" \
        "$n_streams" \
        "$m_with" "$w_with" "$(awk -v w="$w_with" -v m="$m_alone" 'BEGIN { print w / m }')" \
        "$(awk '$2 == 200' "$work/client" | wc -l)" "$(awk '$2 == 400' "$work/client" | wc -l)" \
        "$(awk '$3 > s { s = $3 } END { print s }' "$work/client")"
    stop_server
done
