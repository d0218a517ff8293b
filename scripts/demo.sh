#!/usr/bin/env bash
# The demo: start `ragkv serve` on the embedded model (a synthetic tiny model,
# so the generated text is noise, but every step is real), send one RAG
# request twice with curl — its chunks miss the first time and hit the second
# — print the two chunk reports and the cache statistics, then stop the service.
set -euo pipefail
bin=${1:-build/ragkv}
log=$(mktemp)
"$bin" serve --port 0 2>"$log" &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -f "$log"' EXIT
url=""
for _ in $(seq 100); do
    url=$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -1 || true)
    [ -n "$url" ] && curl -sf "$url/ready" >/dev/null 2>&1 && break
    sleep 0.1
done
[ -n "$url" ] || { echo "the service did not start:"; cat "$log"; exit 1; }
echo "== ragkv serve is listening on $url (embedded model)"
body='{"prompt": "You answer from the documents.##The cache keys each chunk by its content.##A chunk that moves keeps its KV: its keys are rotated to the new position.##What happens to a chunk that moves?", "max_tokens": 16, "temperature": 0}'
show() {
    python3 -c 'import json,sys
d = json.load(sys.stdin)
for c in d["ragkv"]["chunks"]:
    print("   chunk %d: %-4s from %-8s %3d tokens at offset %3d  key %s" % (c["index"], c["status"], c["source"], c["tokens"], c["live_offset"], c["key"]))
u = d["usage"]
print("   prompt tokens %d, cached %d, TTFT %.2f ms" % (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], d["ragkv"]["timings"]["ttft_ms"]))'
}
for i in 1 2; do
    echo "== request $i"
    curl -sf "$url/v1/completions" -H 'Content-Type: application/json' -d "$body" | show
done
echo "== GET /v1/stats (chunk cache)"
curl -sf "$url/v1/stats" | python3 -c 'import json,sys
d = json.load(sys.stdin)
print(json.dumps(d.get("chunks", d), indent=2)[:1500])'
stories=../shared/models/stories260K.gguf
if [ -f "$stories" ]; then
    echo
    echo "== ragkv generate on $stories (a real tiny Llama)"
    "$bin" generate --model "$stories" --prompt "Once upon a time" -n 60 --temp 0
    echo
fi
