#!/usr/bin/env python3
"""Compare ragkv's greedy tokens and top-5 log-probabilities with a reference server's.

    scripts/compare-logits.py [REFERENCE_SERVER] [--ragkv build/ragkv]
        [--model F.gguf | --preset NAME [--type T] [--vocab tokenizer.json] [--seed S]]
        [--tokens N] [--threads T] [--tol 2e-3] [--ctx 4096]

REFERENCE_SERVER is llama.cpp's `llama-server` binary, started here on
127.0.0.1 with the same file; without it the script says so and exits 0.
The model defaults to a fresh `ragkv mkmodel --preset qwen3moe-tiny` (F32,
Qwen3 vocabulary); --vocab is passed on to mkmodel (gpt-oss-tiny needs
gpt-oss's or o200k's tokenizer.json), and --seed too. The reference
server answers 500 when the generated text is not valid UTF-8 (its output
parser refuses it), which a random model's byte-level tokens can make: its
tokens are streamed, and a prompt whose reference stream stops early is
compared over the tokens it gave (the line says so); pick a seed whose four
continuations are valid text to compare all N. ragkv runs as `ragkv serve --kv-dtype f32`, the reference
with an F32 KV cache and without flash attention (`-ctk f32 -ctv f32 -fa
off`): its CPU flash-attention kernel rounds through F16 and moves these
log-probabilities by up to 8e-3 on its own), and `--reasoning-format none`
(its gpt-oss output parser otherwise turns a random model's text away).

Both servers get the same 4 prompts (the first in the model's chat format:
ChatML, or harmony for gpt-oss), each as one greedy request of N tokens
(64 by default) that ignores end-of-generation: the reference's
`/completion` with `n_probs: 5` (streamed), ragkv's `/v1/completions` with
`logprobs: 5`. For every prompt the script prints how many leading tokens
agree, and over the agreeing steps the largest difference between the two
top-5 log-probabilities, rank by rank, and where the tokens part, how far
apart the reference's top two log-probabilities were there. It exits 1 when a prompt's tokens
part before N, or a difference exceeds --tol (2e-3)."""
import json
import os
import subprocess
import sys
import tempfile
import urllib.request

from serverlib import free_port, post, wait_ready

PROMPTS = [
    "<|im_start|>user\nWhat does a KV cache store?<|im_end|>\n<|im_start|>assistant\n",
    "The chunk cache keys the KV of each document by its content, so a later request",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "东京是日本的首都。Paris est la capitale de la France.",
]
HARMONY_PROMPT = ("<|start|>system<|message|>Reasoning: low<|end|><|start|>user<|message|>"
                  "What does a KV cache store?<|end|><|start|>assistant")
# gpt-oss slides over 128 entries in every other layer: one prompt of about
# 190 tokens, so the window cuts in before the 64 generated ones.
LONG_PROMPT = ("The chunk cache keeps each document's keys and values, so a later request "
               "that quotes the same document skips its prefill. ") * 8


def reference_run(port, prompt, n):
    """(token ids, [top-5 logprobs, descending] per step) from llama-server,
    streamed: when its output parser refuses the text (not valid UTF-8) the
    stream ends in an error event, and the steps before it are kept."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        data=json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "n_probs": 5,
                         "ignore_eos": True, "cache_prompt": False, "seed": 1,
                         "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    ids, tops = [], []
    with urllib.request.urlopen(req, timeout=1800) as r:
        for line in r:
            if not line.startswith(b"data: "):
                continue
            doc = json.loads(line[6:])
            if "error" in doc:
                break
            for step in doc.get("completion_probabilities", []):
                ids.append(step["id"])
                tops.append(sorted((t["logprob"] for t in step["top_logprobs"]),
                                   reverse=True)[:5])
    return ids, tops


def ragkv_run(port, prompt, n):
    """(token ids, [top-5 logprobs, descending] per step) from ragkv serve."""
    doc = post(port, "/v1/completions", {
        "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 5,
        "ignore_eos": True})
    choice = doc["choices"][0]
    ids = doc.get("ragkv", choice.get("ragkv", {}))["completion_ids"]
    tops = [sorted((v for v in step.values() if v is not None), reverse=True)[:5]
            for step in choice["logprobs"]["top_logprobs"]]
    return ids, tops


def main():
    args = sys.argv[1:]
    ragkv, model, preset, wtype, vocab = "build/ragkv", None, "qwen3moe-tiny", "f32", None
    seed = None
    n, threads, tol, ref, ctx = 64, 2, 2e-3, None, 4096
    while args:
        a = args.pop(0)
        if a == "--ragkv":
            ragkv = args.pop(0)
        elif a == "--model":
            model = args.pop(0)
        elif a == "--preset":
            preset = args.pop(0)
        elif a == "--type":
            wtype = args.pop(0)
        elif a == "--vocab":
            vocab = args.pop(0)
        elif a == "--seed":
            seed = args.pop(0)
        elif a == "--tokens":
            n = int(args.pop(0))
        elif a == "--threads":
            threads = int(args.pop(0))
        elif a == "--tol":
            tol = float(args.pop(0))
        elif a == "--ctx":  # a LongRoPE file (Phi-3) needs one above its original context
            ctx = int(args.pop(0))
        else:
            ref = a
    if not ref:
        print("compare-logits: no reference server binary given; skipped "
              "(usage: scripts/compare-logits.py PATH/llama-server)")
        return 0
    tmp = tempfile.mkdtemp(prefix="ragkv-logitcmp-")
    if not model:
        model = os.path.join(tmp, f"{preset}-{wtype}.gguf")
        subprocess.run([ragkv, "mkmodel", "--preset", preset, "--type", wtype, "-o", model] +
                       (["--vocab", vocab] if vocab else []) + (["--seed", seed] if seed else []),
                       check=True, stdout=subprocess.DEVNULL)
    prompts = list(PROMPTS)
    if "gpt-oss" in os.path.basename(model):  # a preset's file is named after it
        prompts[0], prompts[3] = HARMONY_PROMPT, LONG_PROMPT
    procs = []
    results = []
    try:
        p_ref = free_port()
        log_ref = open(os.path.join(tmp, "reference.log"), "w")
        procs.append(subprocess.Popen(
            [ref, "-m", model, "--host", "127.0.0.1", "--port", str(p_ref), "-c", str(ctx),
             "-t", str(threads), "-np", "1", "-ctk", "f32", "-ctv", "f32", "-fa", "off",
             "--reasoning-format", "none"],
            stdout=log_ref, stderr=subprocess.STDOUT))
        wait_ready(p_ref, procs[0], "the reference server", "/health", 300)
        theirs = [reference_run(p_ref, p, n) for p in prompts]
        procs[0].terminate()
        procs[0].wait()
        p_rk = free_port()
        log_rk = open(os.path.join(tmp, "ragkv.log"), "w")
        procs.append(subprocess.Popen(
            [ragkv, "serve", "--model", model, "--port", str(p_rk), "--kv-dtype", "f32",
             "--threads", str(threads)],
            stdout=log_rk, stderr=subprocess.STDOUT))
        wait_ready(p_rk, procs[1], "ragkv serve", "/ready", 300)  # /health: up, maybe loading
        ours = [ragkv_run(p_rk, p, n) for p in prompts]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()
    ok = True
    worst_all = 0.0
    for i, ((ids_o, top_o), (ids_t, top_t)) in enumerate(zip(ours, theirs)):
        same = 0
        while same < min(len(ids_o), len(ids_t)) and ids_o[same] == ids_t[same]:
            same += 1
        worst = 0.0
        for s in range(same):
            for a, b in zip(top_o[s], top_t[s]):
                worst = max(worst, abs(a - b))
        worst_all = max(worst_all, worst)
        cut = len(ids_t) < n  # the reference's stream ended early (see reference_run)
        good = same >= min(n, len(ids_t)) and worst <= tol
        ok &= good
        # Where the tokens part: how far apart the reference's top two were
        # (a near tie parts at rounding differences).
        gap = ""
        if same < min(len(ids_o), len(ids_t)) and len(top_t[same]) > 1:
            gap = f"; parted where the reference's top two were {top_t[same][0] - top_t[same][1]:.2e} apart"
        print(f"prompt {i}: {same}/{n} greedy tokens agree, top-5 logprobs differ by at most "
              f"{worst:.2e}{gap}{'' if good else '  <-- FAIL'}"
              f"{f' (the reference stopped after {len(ids_t)}: not valid UTF-8)' if cut else ''}")
    print(f"worst top-5 logprob difference over {len(prompts)} prompts: {worst_all:.2e} "
          f"(tolerance {tol:g}); model {model}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
