#!/usr/bin/env python3
"""Compare ragkv's /v1/embeddings with a reference server's on one model.

    scripts/compare-embeddings.py [REFERENCE_SERVER] [--ragkv build/ragkv]
        [--model F.gguf]

REFERENCE_SERVER is llama.cpp's `llama-server` binary, started here as
`--embedding --pooling last -m F.gguf --port P` on 127.0.0.1; without it the
script says so and exits 0. The model defaults to a fresh
`ragkv mkmodel --preset qwen3-embedding-tiny` (F32, Qwen3 vocabulary,
pooling_type 3). Both servers get the same 20 varied inputs, one call each
with the whole list; the script prints each input's cosine similarity and
the smallest, and exits 1 when one is under 0.9999."""
import math
import os
import subprocess
import sys
import tempfile

from serverlib import free_port, post, wait_ready

INPUTS = [
    "The cat sat on the mat.",
    "Paris is the capital of France.",
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\n"
    "Query: what is the capital of France?",
    "x",
    "KV caches store keys and values for every layer and every token.",
    "Retrieval-augmented generation reuses document chunks across requests.",
    "1 2 3 4 5 6 7 8 9 10",
    "def add(a, b):\n    return a + b\n",
    "¿Dónde está la biblioteca? Está al lado del museo.",
    "東京は日本の首都です。",
    "The quick brown fox jumps over the lazy dog. " * 8,
    "Emoji too: 🚀🔥 and symbols ∑ ∫ √.",
    "SELECT name FROM users WHERE age > 30 ORDER BY name;",
    "A",
    "   leading and trailing spaces   ",
    "Line one\nLine two\nLine three",
    "<|im_start|>user\nhello<|im_end|>",
    "Qwen3-Embedding pools the last token of the sequence.",
    "https://example.com/path?query=1&other=two",
    "The mitochondria is the powerhouse of the cell; ATP is its currency.",
]


def embed(port):
    doc = post(port, "/v1/embeddings", {"input": INPUTS, "model": "m"}, 300)
    out = [None] * len(INPUTS)
    for d in doc["data"]:
        out[d["index"]] = d["embedding"]
    return out


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    na = math.sqrt(sum(x * x for x in a))
    nb = math.sqrt(sum(y * y for y in b))
    return dot / (na * nb)


def main():
    args = sys.argv[1:]
    ragkv = "build/ragkv"
    model = None
    ref = None
    while args:
        a = args.pop(0)
        if a == "--ragkv":
            ragkv = args.pop(0)
        elif a == "--model":
            model = args.pop(0)
        else:
            ref = a
    if not ref:
        print("compare-embeddings: no reference server binary given; skipped "
              "(usage: scripts/compare-embeddings.py PATH/llama-server)")
        return 0
    tmp = tempfile.mkdtemp(prefix="ragkv-embcmp-")
    if not model:
        model = os.path.join(tmp, "qwen3-embedding-tiny.gguf")
        subprocess.run([ragkv, "mkmodel", "--preset", "qwen3-embedding-tiny", "-o", model],
                       check=True, stdout=subprocess.DEVNULL)
    procs = []
    try:
        p_ref = free_port()
        log_ref = open(os.path.join(tmp, "reference.log"), "w")
        procs.append(subprocess.Popen(
            [ref, "--embedding", "--pooling", "last", "-m", model, "--host", "127.0.0.1",
             "--port", str(p_ref), "-c", "4096", "-b", "4096", "-ub", "4096"],
            stdout=log_ref, stderr=subprocess.STDOUT))
        p_rk = free_port()
        log_rk = open(os.path.join(tmp, "ragkv.log"), "w")
        procs.append(subprocess.Popen(
            [ragkv, "serve", "--model", model, "--port", str(p_rk), "--kv-dtype", "f32"],
            stdout=log_rk, stderr=subprocess.STDOUT))
        wait_ready(p_ref, procs[0], "the reference server")
        wait_ready(p_rk, procs[1], "ragkv serve", "/ready")
        ours, theirs = embed(p_rk), embed(p_ref)
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    worst = 1.0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        c = cosine(a, b)
        worst = min(worst, c)
        print(f"{i:2d}  cosine {c:.7f}  {INPUTS[i][:50]!r}")
    print(f"min cosine over {len(INPUTS)} inputs: {worst:.7f} (dim {len(ours[0])})")
    return 0 if worst >= 0.9999 else 1


if __name__ == "__main__":
    sys.exit(main())
