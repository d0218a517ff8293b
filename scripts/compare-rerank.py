#!/usr/bin/env python3
"""Compare ragkv's /v1/rerank with a reference server's on one model.

    scripts/compare-rerank.py [REFERENCE_SERVER] [--ragkv build/ragkv]
        [--model F.gguf] [--tol 1e-4] [--ref-defaults]

REFERENCE_SERVER is llama.cpp's `llama-server` binary, started here as
`--reranking -m F.gguf --port P` on 127.0.0.1 (the file unchanged: its
pooling type, head and rerank prompt are read from it) with an F32 KV cache
and flash attention off, as ragkv's `--kv-dtype f32` computes
(`--ref-defaults` leaves the reference's defaults: an F16 KV cache and, on
the CPU, flash attention, which round to F16); without the binary the
script says so and exits 0. The model defaults to a fresh
`ragkv mkmodel --preset qwen3-reranker-tiny` (F32, Qwen3 vocabulary,
pooling_type 4, a yes/no head cls.output, Qwen3-Reranker's prompt). Both
servers get the same 4 queries with 5 documents each (20 query/document
pairs), one /v1/rerank call per query; the script prints each pair's two
scores and their difference, checks that both servers rank each query's
documents in the same order, and exits 1 when a difference is over the
tolerance or an order differs."""
import os
import subprocess
import sys
import tempfile

from serverlib import free_port, post, wait_ready

CASES = [
    ("What is the capital of France?", [
        "Paris is the capital and largest city of France.",
        "Berlin is the capital of Germany.",
        "The mitochondria is the powerhouse of the cell; ATP is its currency.",
        "France's capital city, Paris, lies on the Seine.",
        "x",
    ]),
    ("how do KV caches speed up transformer inference", [
        "KV caches store keys and values for every layer and every token.",
        "Retrieval-augmented generation reuses document chunks across requests.",
        "def add(a, b):\n    return a + b\n",
        "The quick brown fox jumps over the lazy dog. " * 6,
        "SELECT name FROM users WHERE age > 30 ORDER BY name;",
    ]),
    ("¿Dónde está la biblioteca?", [
        "¿Dónde está la biblioteca? Está al lado del museo.",
        "東京は日本の首都です。",
        "Emoji too: 🚀🔥 and symbols ∑ ∫ √.",
        "   leading and trailing spaces   ",
        "Line one\nLine two\nLine three",
    ]),
    ("python function that adds two numbers", [
        "def add(a, b):\n    return a + b\n",
        "https://example.com/path?query=1&other=two",
        "<|im_start|>user\nhello<|im_end|>",
        "A",
        "1 2 3 4 5 6 7 8 9 10",
    ]),
]


def rerank(port, query, docs):
    """[(index, score)] best first, as the server sorts them."""
    doc = post(port, "/v1/rerank", {"model": "m", "query": query, "documents": docs}, 300)
    return [(x["index"], x["relevance_score"]) for x in doc["results"]]


def main():
    args = sys.argv[1:]
    ragkv, model, ref, tol, exact = "build/ragkv", None, None, 1e-4, True
    while args:
        a = args.pop(0)
        if a == "--ragkv":
            ragkv = args.pop(0)
        elif a == "--model":
            model = args.pop(0)
        elif a == "--tol":
            tol = float(args.pop(0))
        elif a == "--ref-defaults":
            exact = False
        else:
            ref = a
    if not ref:
        print("compare-rerank: no reference server binary given; skipped "
              "(usage: scripts/compare-rerank.py PATH/llama-server)")
        return 0
    tmp = tempfile.mkdtemp(prefix="ragkv-rrcmp-")
    if not model:
        model = os.path.join(tmp, "qwen3-reranker-tiny.gguf")
        subprocess.run([ragkv, "mkmodel", "--preset", "qwen3-reranker-tiny", "-o", model],
                       check=True, stdout=subprocess.DEVNULL)
    procs = []
    try:
        p_ref = free_port()
        log_ref = open(os.path.join(tmp, "reference.log"), "w")
        procs.append(subprocess.Popen(
            [ref, "--reranking", "-m", model, "--host", "127.0.0.1", "--port", str(p_ref),
             "-c", "4096", "-b", "4096", "-ub", "4096"]
            + (["-ctk", "f32", "-ctv", "f32", "-fa", "off"] if exact else []),
            stdout=log_ref, stderr=subprocess.STDOUT))
        p_rk = free_port()
        log_rk = open(os.path.join(tmp, "ragkv.log"), "w")
        procs.append(subprocess.Popen(
            [ragkv, "serve", "--model", model, "--port", str(p_rk), "--kv-dtype", "f32"],
            stdout=log_rk, stderr=subprocess.STDOUT))
        wait_ready(p_ref, procs[0], "the reference server")
        wait_ready(p_rk, procs[1], "ragkv serve", "/ready")
        answers = [(rerank(p_rk, q, d), rerank(p_ref, q, d)) for q, d in CASES]
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    worst, bad_order, n = 0.0, 0, 0
    for (query, docs), (ours, theirs) in zip(CASES, answers):
        a, b = dict(ours), dict(theirs)
        same = [i for i, _ in ours] == [i for i, _ in theirs]
        bad_order += not same
        print(f"query {query[:40]!r}: order {'same' if same else 'DIFFERS'} "
              f"{[i for i, _ in ours]} vs {[i for i, _ in theirs]}")
        for i, doc in enumerate(docs):
            d = abs(a[i] - b[i])
            worst = max(worst, d)
            n += 1
            print(f"  doc {i}  ragkv {a[i]:.7f}  reference {b[i]:.7f}  |diff| {d:.2e}  "
                  f"{doc[:40]!r}")
    print(f"max |score difference| over {n} pairs: {worst:.2e}; "
          f"orders differing: {bad_order} of {len(CASES)}")
    return 0 if worst <= tol and bad_order == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
