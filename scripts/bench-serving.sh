#!/usr/bin/env bash
# The serving scenarios of docs/benchmarks.md ("Serving core"), against one
# `ragkv serve` on a loopback port, each ratio measured in the same run:
#
#   1. first request: 8 chunks of about 230 tokens, every chunk missed;
#   2. the same 8 chunks reordered (every chunk hit);
#   3. an exact repeat of request 2 against one decode step;
#   4. a chat turn 2 over the same 8 documents: tokens computed, TTFT
#      against the prefill pass of those tokens;
#   5. a short request arriving while a 128-token generation runs, against
#      the same short request alone (SHORT_SAMPLES=N: the median of N);
#   6. 8 closed-loop clients sending RAG prompts (4 of 12 shared chunks,
#      64-token answers) through `ragkv bench --url`: tokens/s, TTFT p99.
#
#   scripts/bench-serving.sh MODEL [BIN] [PORT]
# Needs curl and jq. Every request is greedy; the server stops at the end.
# STEP_TOKENS=N in the environment runs the server with --step-tokens N.
set -euo pipefail
model=${1:?usage: scripts/bench-serving.sh MODEL [BIN] [PORT]}
bin=${2:-build/ragkv}
port=${3:-18480}
url=http://127.0.0.1:$port
for tool in curl jq; do
    command -v $tool >/dev/null || { echo "bench-serving: $tool is required" >&2; exit 2; }
done
work=$(mktemp -d)
. "$(dirname "$0")/bench-lib.sh"
bench_serve "$bin" "$model" "$port" "$work/serve.log" --kv-memory-mb 6144 \
    ${STEP_TOKENS:+--step-tokens "$STEP_TOKENS"}
server=$BENCH_SERVER
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$work"' EXIT

# Eight documents of seeded words (about 230 tokens each), a system prompt
# and a question.
# Drawn in this shell (a command substitution's subshell reseeds RANDOM), so
# every run sends the same documents.
RANDOM=2026
docs=()
for i in 1 2 3 4 5 6 7 8; do
    bench_doc "Document $i." 170
    docs+=("$DOC")
done
system="You are a helpful assistant. Answer from the documents."
question="Based on the documents above, which town had the oldest library and who kept it?"
joined() { # joined ORDER...: the prompt with the documents in that order
    local p="$system"
    for i in "$@"; do p+="##${docs[$i]}"; done
    printf '%s##%s' "$p" "$question"
}

post() { # post PATH BODY: the response body
    curl -sf -X POST "$url$1" -H 'Content-Type: application/json' --data-binary "$2"
}
complete() { # complete PROMPT MAX_TOKENS
    post /v1/completions "$(jq -n --arg p "$1" --argjson n "$2" \
        '{prompt: $p, max_tokens: $n, temperature: 0, ignore_eos: true}')"
}
field() { jq -r "$1" <<<"$2"; }

r1=$(complete "$(joined 0 1 2 3 4 5 6 7)" 1)
r2=$(complete "$(joined 7 6 5 4 3 2 1 0)" 1)
r3=$(complete "$(joined 7 6 5 4 3 2 1 0)" 8)
step=$(field '.ragkv.timings.decode_ms / (.usage.completion_tokens - 1)' "$r3")
printf '%-44s %8s %8s %10s\n' scenario prompt computed "TTFT ms"
row() { printf '%-44s %8s %8s %10.1f\n' "$1" "$(field .usage.prompt_tokens "$2")" \
    "$(field .ragkv.timings.prompt_tokens_computed "$2")" "$(field .ragkv.timings.ttft_ms "$2")"; }
row "first request, every chunk missed" "$r1"
row "same chunks reordered, every chunk hit" "$r2"
row "exact repeat of the reordered request" "$r3"
printf '%-44s %8s %8s %10.1f\n' "one decode step (of the repeat)" - - "$step"
printf '  exact repeat / decode step: %.2fx\n' \
    "$(jq -n --argjson a "$(field .ragkv.timings.ttft_ms "$r3")" --argjson b "$step" '$a / $b')"

# Chat: turn 1 with the documents, turn 2 with its answer and a new question.
docs_msg=$(printf '%s##' "${docs[@]}")
msgs=$(jq -n --arg s "$system" --arg u "$docs_msg$question" \
    '[{role: "system", content: $s}, {role: "user", content: $u}]')
c1=$(post /v1/chat/completions "$(jq -n --argjson m "$msgs" \
    '{messages: $m, max_tokens: 32, temperature: 0, separator: "##"}')")
answer=$(field '.choices[0].message.content' "$c1")
msgs=$(jq --arg a "$answer" '. + [{role: "assistant", content: $a},
    {role: "user", content: "And which document mentions the lighthouse first?"}]' <<<"$msgs")
c2=$(post /v1/chat/completions "$(jq -n --argjson m "$msgs" \
    '{messages: $m, max_tokens: 1, temperature: 0, separator: "##"}')")
row "chat turn 1 (documents cached)" "$c1"
row "chat turn 2" "$c2"
printf '  chat turn 2: %s cached, TTFT / its prefill pass: %.2fx\n' \
    "$(field .usage.prompt_tokens_details.cached_tokens "$c2")" \
    "$(field '.ragkv.timings.ttft_ms / .ragkv.timings.prefill_ms' "$c2")"

# A short request alone, then while a 128-token generation runs.
short="You answer in one word.##${docs[0]}##What is the first word of the document?"
latency() { # latency PROMPT: ms from send to the whole response
    local t0 t1
    t0=$(date +%s%N)
    complete "$1" 1 >/dev/null
    t1=$(date +%s%N)
    echo $(((t1 - t0) / 1000000))
}
latency "$short" >/dev/null # its chunk and system prompt cached
alone=$(latency "$short")
# SHORT_SAMPLES=N (default 1) times, the median: one sample lands anywhere
# within a decode step of the generation.
samples=()
for _ in $(seq "${SHORT_SAMPLES:-1}"); do
    complete "$(joined 0 1)" 128 >"$work/long.json" &
    long=$!
    sleep 2
    samples+=("$(latency "$short")")
    wait $long
done
during=$(printf '%s\n' "${samples[@]}" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }')
printf '  short request: alone %d ms, during a 128-token generation %d ms (%.2fx; of %s)\n' \
    "$alone" "$during" "$(jq -n --argjson a "$during" --argjson b "$alone" '$a / $b')" \
    "${samples[*]}"

# Eight closed-loop clients (CLIENTS=0 leaves them out).
[ "${CLIENTS:-1}" = 0 ] && exit 0
"$bin" bench --model "$model" --url "$url" --modes rag --corpus 12 --k 4 \
    --chunk-tokens 200:260 --system-tokens 16 --systems 1 --question-tokens 24 \
    --max-tokens 64:64 --concurrency 8 --requests 32 --seed 7 2>&1 |
    grep -E "^ *(mode|rag|generation|  rag)" || true
