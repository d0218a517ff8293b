#!/usr/bin/env python3
"""Generation throughput of one `ragkv serve` with 1, 4 and 8 concurrent streams.

    scripts/bench-streams.py MODEL [--ragkv build/ragkv] [--threads 2]
        [--streams 1,4,8] [--tokens 64] [--rounds 2]

Starts `ragkv serve --model MODEL --threads T` on a free loopback port. For
each stream count N it sends N requests at once (a short distinct prompt
each, greedy, `max_tokens` tokens, `ignore_eos`), waits for all, and
reports the generated tokens of all N over the wall time from the first
send to the last answer (aggregate tok/s, prompts included in the time),
and the median of the requests' own `decode_tokens_per_s`. Each count runs
`--rounds` times after one warm-up request; the best round is printed."""
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from serverlib import free_port, post as post_json, wait_ready






def post(port, body):
    return post_json(port, "/v1/completions", body)


def one(port, i, n_tokens, out):
    doc = post(port, {"prompt": f"Stream {i}: tell a short story about the number {i * 37}.",
                      "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True})
    rag = doc.get("ragkv") or doc["choices"][0].get("ragkv", {})
    out[i] = (doc["usage"]["completion_tokens"], rag.get("timings", {}).get("decode_tokens_per_s"))


def main():
    args = sys.argv[1:]
    if not args or args[0].startswith("-"):
        sys.exit(__doc__)
    model = args.pop(0)
    ragkv, threads, streams, n_tokens, rounds = "build/ragkv", 2, [1, 4, 8], 64, 2
    while args:
        a = args.pop(0)
        if a == "--ragkv":
            ragkv = args.pop(0)
        elif a == "--threads":
            threads = int(args.pop(0))
        elif a == "--streams":
            streams = [int(x) for x in args.pop(0).split(",")]
        elif a == "--tokens":
            n_tokens = int(args.pop(0))
        elif a == "--rounds":
            rounds = int(args.pop(0))
        else:
            sys.exit(f"unknown argument {a}")
    port = free_port()
    log = open(os.path.join(tempfile.mkdtemp(prefix="ragkv-streams-"), "serve.log"), "w")
    proc = subprocess.Popen([ragkv, "serve", "--model", model, "--port", str(port), "--threads",
                             str(threads)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(port, proc, "ragkv serve", "/ready", 900)
        post(port, {"prompt": "warm up", "max_tokens": 4, "temperature": 0})
        print(f"model {model}, {threads} threads, {n_tokens} tokens per stream")
        print("streams  aggregate tok/s  median per-stream decode tok/s")
        for n in streams:
            best = None
            for _ in range(rounds):
                out = [None] * n
                ts = [threading.Thread(target=one, args=(port, i, n_tokens, out))
                      for i in range(n)]
                t0 = time.time()
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                wall = time.time() - t0
                agg = sum(o[0] for o in out) / wall
                per = statistics.median(o[1] for o in out if o[1] is not None)
                if best is None or agg > best[0]:
                    best = (agg, per)
            print(f"{n:7d}  {best[0]:15.2f}  {best[1]:30.2f}")
    finally:
        proc.terminate()
        proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
