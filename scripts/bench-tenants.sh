#!/usr/bin/env bash
# Tenant isolation by timing (docs/benchmarks.md, "Tenant isolation"): one
# `ragkv serve` with two tenants' keys (--api-keys-file) on a loopback port.
# For each of ROUNDS documents of about 500 tokens, in this order:
#
#   A sends the document (its first time: computed, not measured);
#   B sends a document nobody sent before            -> "B, fresh document"
#   B sends A's document                             -> "B, A's document"
#   A sends its document again                       -> "A, repeat"
#
# Each request has the same system prompt and question and generates one
# token, greedily; its time to first token is the server's (queue + ttft,
# what /metrics' ragkv_ttft_seconds counts) and the client's whole exchange.
# Prints each set's distribution and each request's chunk status.
#
#   scripts/bench-tenants.sh MODEL [BIN] [PORT] [ROUNDS]
# Needs curl and python3. The server stops at the end.
set -euo pipefail
model=${1:?usage: scripts/bench-tenants.sh MODEL [BIN] [PORT] [ROUNDS]}
bin=${2:-build/ragkv}
port=${3:-18483}
rounds=${4:-20}
url=http://127.0.0.1:$port
for tool in curl python3; do
    command -v $tool >/dev/null || { echo "bench-tenants: $tool is required" >&2; exit 2; }
done
work=$(mktemp -d)
cat >"$work/keys.json" <<'EOF'
{"keys": [{"key": "bench-key-a", "tenant": "A"}, {"key": "bench-key-b", "tenant": "B"}]}
EOF
"$bin" serve --model "$model" --threads 2 --kv-dtype f16 --kv-memory-mb 4096 --port "$port" \
    --api-keys-file "$work/keys.json" --log-level warn >"$work/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 600); do
    curl -sf "$url/ready" >/dev/null 2>&1 && break
    kill -0 $server 2>/dev/null || { cat "$work/serve.log" >&2; exit 1; }
    sleep 0.5
done

python3 - "$url" "$rounds" <<'EOF'
import json, random, statistics, sys, time, urllib.request

url, rounds = sys.argv[1], int(sys.argv[2])
words = ("river valley town market farmer bridge winter harvest council record library school "
         "children teacher road mountain forest village mayor storm summer festival baker bread "
         "wheat mill water stone tower church bell lantern night morning train station letter "
         "journey north south painter garden flower apple orchard season rain cloud wind").split()
rng = random.Random(2026)

def doc(tag):
    out = [f"Document {tag}."]
    for i in range(360):
        out.append(rng.choice(words) + ("." if i % 12 == 11 else ""))
    return " ".join(out)

def send(key, text):
    body = json.dumps({"system": "Answer from the document.", "chunks": [text],
                       "question": "Which town is named first?", "max_tokens": 1,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {
        "Authorization": "Bearer " + key, "Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        j = json.load(r)
    wall = (time.perf_counter() - t0) * 1e3
    t = j["ragkv"]["timings"]
    return t["queue_ms"] + t["ttft_ms"], wall, j["ragkv"]["chunks"][0]["status"]

A, B = "bench-key-a", "bench-key-b"
send(B, doc("warm-up"))  # B's system prompt in B's own radix tree, as A's will be
sets = {"B, fresh document": [], "B, A's document": [], "A, repeat": []}
for i in range(rounds):
    mine = doc(f"A{i}")
    send(A, mine)
    sets["B, fresh document"].append(send(B, doc(f"B{i}")))
    sets["B, A's document"].append(send(B, mine))
    sets["A, repeat"].append(send(A, mine))

def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))]

print(f"{'requests':24} {'n':>3} {'TTFT p10':>9} {'p50':>8} {'p90':>8} {'mean':>8} "
      f"{'client p50':>11}  chunk status")
for name, v in sets.items():
    ttft = [x[0] for x in v]
    wall = [x[1] for x in v]
    status = {s: sum(1 for x in v if x[2] == s) for s in sorted({x[2] for x in v})}
    print(f"{name:24} {len(v):3} {q(ttft, .1):9.1f} {q(ttft, .5):8.1f} {q(ttft, .9):8.1f} "
          f"{statistics.mean(ttft):8.1f} {q(wall, .5):11.1f}  {status}")
EOF
