#!/usr/bin/env bash
# The demo: generate with the embedded default model (random weights, so the
# text is noise, but every step is real), then with the real stories260K
# model when ../shared is present.
set -euo pipefail
bin=${1:-build/ragkv}
echo "== ragkv generate on the embedded default model (tiny, synthetic weights)"
"$bin" generate --prompt "The cache remembers" -n 32 --temp 0 --json
stories=../shared/models/stories260K.gguf
if [ -f "$stories" ]; then
    echo
    echo "== ragkv generate on $stories (a real tiny Llama)"
    "$bin" generate --model "$stories" --prompt "Once upon a time" -n 120 --temp 0
    echo
fi
