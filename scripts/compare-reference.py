#!/usr/bin/env python3
"""Run the same GGUF file in ragkv and in the reference engine's llama-server
and compare greedy generations: the generated token ids must agree for N
tokens and each step's top-5 log-probabilities must agree within a tolerance.

    scripts/compare-reference.py MODEL.gguf [--ragkv build/ragkv]
        [--server PATH/llama-server] [-n 64] [--tol 2e-3]

Both engines keep an F32 KV cache, and the reference runs with its flash
attention off (its CPU kernel rounds through F16). Where the tokens part, the
line says how far apart the reference's top two log-probabilities were there
(a near tie parts at quantization-rounding differences).
The reference server listens on 127.0.0.1 only and is stopped at the end.
Prints one line per prompt and a summary; exits 1 on a mismatch."""
import argparse
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

from serverlib import free_port, wait_ready

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Question: what is the capital of France? Answer:",
]


def post(url, body, timeout=120):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        sys.exit(f"{url}: {e.code} {e.read().decode(errors='replace')}")


def stream(url, body, timeout=120):
    """The completion_probabilities of a streamed completion (streaming
    skips the server's final parse of the text, which rejects some byte
    sequences a random model writes)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    steps = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            ev = json.loads(line[6:])
            steps.extend(ev.get("completion_probabilities", []))
    return steps


def reference(server, model, n, threads, ctx):
    port = free_port()
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.dirname(server)
    proc = subprocess.Popen(
        ["timeout", "600", server, "-m", model, "--host", "127.0.0.1", "--port", str(port),
         "-c", str(ctx), "-t", str(threads), "-np", "1", "-ctk", "f32", "-ctv", "f32",
         "-fa", "off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(port, proc, "the reference server", "/health", 60)
        out = []
        for p in PROMPTS:
            steps = stream(url + "/completion", {"prompt": p, "n_predict": n, "temperature": 0,
                                                 "n_probs": 5, "cache_prompt": False,
                                                 "samplers": ["top_k"], "top_k": 1,
                                                 "stream": True})
            rows = []
            for s in steps:
                by_text = {}
                for t in s["top_logprobs"]:
                    by_text[t["token"]] = None if t["token"] in by_text else t["logprob"]
                rows.append((s["id"], by_text))
            out.append(rows)
        return out
    finally:
        proc.terminate()
        proc.wait()


def ours(ragkv, model, n, threads):
    out = []
    for p in PROMPTS:
        r = subprocess.run([ragkv, "generate", "--model", model, "--prompt", p, "-n", str(n),
                            "--temp", "0", "--json", "--logprobs", "5", "--kv-dtype", "f32", "--threads",
                            str(threads)], capture_output=True, text=True, check=True)
        j = json.loads(r.stdout.splitlines()[-1])
        ids = j["ragkv"]["completion_ids"]
        tops = j["choices"][0]["logprobs"]["top_logprobs"]
        out.append(list(zip(ids, tops)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ragkv", default="build/ragkv")
    ap.add_argument("--server", default="llama-server",
                    help="the reference engine's llama-server (default: the one on PATH)")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--tol", type=float, default=5e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024,
                    help="the reference's context (-c); a LongRoPE file (Phi-3) needs one "
                         "above its original context length, as ragkv computes at its own")
    a = ap.parse_args()
    ref = reference(a.server, a.model, a.n, a.threads, a.ctx)
    got = ours(a.ragkv, a.model, a.n, a.threads)
    ok = True
    worst_all = 0.0
    for i, (r, g) in enumerate(zip(ref, got)):
        agree = 0
        worst = 0.0
        tie = ""
        for (rid, rtop), (gid, gtop) in zip(r, g):
            if rid != gid:
                # how near a tie the step where the engines part is
                rv = sorted((v for v in rtop.values() if v is not None), reverse=True)
                if len(rv) > 1:
                    tie = f", parting where the reference's top two are {rv[0] - rv[1]:.2e} apart"
                break
            agree += 1
            for text, lp in gtop.items():
                # a text two tokens share (a byte token and its character,
                # bytes of one character) cannot be matched by text: skipped
                if "\ufffd" in text or text not in rtop or rtop[text] is None or lp is None:
                    continue
                worst = max(worst, abs(lp - rtop[text]))
        worst_all = max(worst_all, worst)
        good = agree >= min(a.n, len(r)) and worst <= a.tol
        ok &= good
        print(f"prompt {i}: {agree}/{len(r)} tokens agree, max |dlogprob| top-5 = {worst:.2e}"
              f"{tie} {'ok' if good else 'MISMATCH'}")
    print(f"{'ok' if ok else 'MISMATCH'}: max |dlogprob| {worst_all:.2e} (tolerance {a.tol})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
