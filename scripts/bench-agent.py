#!/usr/bin/env python3
"""Agent-style conversations: time to first token per turn, ragkv against a
reference server with its prefix cache, on the same messages.

    scripts/bench-agent.py MODEL [--ragkv build/ragkv] [--reference LLAMA_SERVER]
        [--threads 2] [--conversations 4] [--warm 6] [--turns 4] [--corpus 24]
        [--passage-words 110] [--max-tokens 8] [--tool] [--seed 7]

Each conversation has --turns turns; each turn brings 2 to 4 passages drawn
Zipf-like (s = 1.1) from a shared corpus of --corpus passages, so passages
repeat within and across conversations, and asks a question. The passages
come in the turn's user message (ragkv: its `documents` field) or, with
--tool, as a search tool's result (an assistant tool call, then a `tool`
message whose content is a JSON array of passages, ragkv's
`chunking.tool_results`). Every turn resends the conversation so far, the
answers as returned, as a client does.

The reference server gets the same conversation with the passages written
into the message text exactly as ragkv's ChatML rendering places them
(a user message's passages before its question; a tool result as a user
turn of `<tool_response>`), so both compute the same kind of prompt; it
runs with one slot (`-np 1`, its prefix cache is that slot's, holding the
previous turn of the same conversation) and `--cache-reuse 256`. ragkv runs
`--reasoning off` (no thinking block).

--warm conversations run first on each server and are not counted (they
fill ragkv's chunk cache as earlier users would). Printed per turn: the
median over the measured conversations of the server's own time to first
token (ragkv `ragkv.timings.ttft_ms`; reference `timings.prompt_ms`, its
prompt processing) and of the prompt tokens it computed (ragkv
`prompt_tokens_computed`; reference `timings.prompt_n`), and ragkv's corpus
hit rate for the turn (passages found in the chunk cache among those it
looked up). Both servers start on free loopback ports and stop at the end."""
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile

from serverlib import free_port, post, wait_ready

SYLLABLES = ["ka", "lo", "mi", "ren", "tas", "vo", "shi", "pa", "dun", "el", "ri", "mor",
             "ta", "quin", "ve", "sol", "an", "gri", "po", "zel", "nu", "bra", "tor", "ix"]








def corpus(rng, n, words):
    out = []
    for i in range(n):
        w = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(words)]
        out.append(f"Record {i}. " + " ".join(w) + ".")
    return out


def zipf_draw(rng, n, k, s=1.1):
    weights = [1 / (i + 1) ** s for i in range(n)]
    picked = []
    while len(picked) < k:
        i = rng.choices(range(n), weights)[0]
        if i not in picked:
            picked.append(i)
    return picked


def conversations(rng, n_conv, turns, n_corpus):
    """Each conversation: per turn (passage ids, question)."""
    return [[(zipf_draw(rng, n_corpus, rng.randint(2, 4)),
              f"Turn {t + 1}: which record mentions {rng.choice(SYLLABLES)}{rng.choice(SYLLABLES)}?")
             for t in range(turns)] for _ in range(n_conv)]


def messages(conv, upto, answers, docs, tool, ragkv):
    """The chat messages of turns 0..upto (answers of the earlier ones)."""
    msgs = [{"role": "system", "content": "Answer from the records."}]
    for t in range(upto + 1):
        ids, question = conv[t]
        passages = [docs[i] for i in ids]
        if tool:
            msgs.append({"role": "user", "content": question})
            call = {"role": "assistant", "content": ""}
            if ragkv:  # the reference's plain ChatML has no tool-call format
                call["tool_calls"] = [{"id": f"call{t}", "type": "function",
                                       "function": {"name": "search",
                                                    "arguments": json.dumps({"q": question})}}]
            msgs.append(call)
            if ragkv:
                msgs.append({"role": "tool", "tool_call_id": f"call{t}",
                             "content": json.dumps(passages)})
            else:  # the same text ragkv's ChatML rendering gives a chunked tool result
                msgs.append({"role": "user", "content": "<tool_response>\n" + "".join(passages)
                             + "\n</tool_response>"})
        elif ragkv:
            msgs.append({"role": "user", "content": question, "documents": passages})
        else:
            msgs.append({"role": "user", "content": "".join(passages) + question})
        if t < upto:
            msgs.append({"role": "assistant", "content": answers[t]})
    return msgs


def run_turns(port, convs, docs, args, ragkv, measured):
    """Per conversation, per turn: (ttft_ms, computed, hits, lookups)."""
    rows = []
    for conv in convs:
        answers, row = [], []
        for t in range(len(conv)):
            body = {"messages": messages(conv, t, answers, docs, args["tool"], ragkv),
                    "max_tokens": args["max_tokens"], "temperature": 0}
            if ragkv and args["tool"]:
                body["chunking"] = {"tool_results": True}
            if not ragkv:
                body["cache_prompt"] = True
            doc = post(port, "/v1/chat/completions", body)
            answers.append(doc["choices"][0]["message"].get("content") or "")
            if ragkv:
                rep = doc["ragkv"]
                looked = [c for c in rep["chunks"] if c["source"] != "prefix"]
                hits = sum(c["status"] == "hit" for c in looked)
                row.append((rep["timings"]["ttft_ms"], rep["timings"]["prompt_tokens_computed"],
                            hits, len(looked)))
            else:
                tm = doc["timings"]
                row.append((tm["prompt_ms"], tm["prompt_n"], 0, 0))
        if measured:
            rows.append(row)
    return rows


def serve(cmd, port, ready_path, log):
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    wait_ready(port, proc, f"{cmd[0]} (log: {log})", ready_path, 600)
    return proc


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def main():
    argv = sys.argv[1:]
    if not argv or argv[0].startswith("-"):
        sys.exit(__doc__)
    model = argv.pop(0)
    a = {"ragkv": "build/ragkv", "reference": None, "threads": 2, "conversations": 4, "warm": 6,
         "turns": 4, "corpus": 24, "passage_words": 110, "max_tokens": 8, "tool": False,
         "seed": 7}
    while argv:
        k = argv.pop(0)[2:].replace("-", "_")
        if k not in a:
            sys.exit(f"unknown option --{k}\n{__doc__}")
        a[k] = True if k == "tool" else (argv.pop(0) if isinstance(a[k], (str, type(None)))
                                         else int(argv.pop(0)))
    rng = random.Random(a["seed"])
    docs = corpus(rng, a["corpus"], a["passage_words"])
    warm = conversations(rng, a["warm"], a["turns"], a["corpus"])
    convs = conversations(rng, a["conversations"], a["turns"], a["corpus"])
    work = tempfile.mkdtemp()
    results = {}
    port = free_port()
    proc = serve([a["ragkv"], "serve", "--model", model, "--threads", str(a["threads"]),
                  "--port", str(port), "--kv-dtype", "f16", "--reasoning", "off",
                  "--log-level", "warn"], port, "/ready", os.path.join(work, "ragkv.log"))
    try:
        run_turns(port, warm, docs, a, True, False)
        results["ragkv"] = run_turns(port, convs, docs, a, True, True)
    finally:
        stop(proc)
    if a["reference"]:
        port = free_port()
        proc = serve([a["reference"], "-m", model, "-t", str(a["threads"]), "--host", "127.0.0.1",
                      "--port", str(port), "-c", "16384", "-np", "1", "--cache-reuse", "256",
                      "-ctk", "f16", "-ctv", "f16"], port, "/health",
                     os.path.join(work, "reference.log"))
        try:
            run_turns(port, warm[:1], docs, a, False, False)
            results["reference"] = run_turns(port, convs, docs, a, False, True)
        finally:
            stop(proc)
    mode = "tool results" if a["tool"] else "user documents"
    print(f"{a['conversations']} conversations x {a['turns']} turns ({mode}), corpus "
          f"{a['corpus']} passages of ~{a['passage_words']} words, {a['warm']} warm-up "
          f"conversations; medians")
    head = f"{'turn':>4}  {'ragkv TTFT ms':>13}  {'computed':>8}  {'hit rate':>8}"
    if "reference" in results:
        head += f"  {'ref TTFT ms':>11}  {'computed':>8}  {'ratio':>6}"
    print(head)
    for t in range(a["turns"]):
        r = [row[t] for row in results["ragkv"]]
        ttft = statistics.median(x[0] for x in r)
        comp = statistics.median(x[1] for x in r)
        hits, looked = sum(x[2] for x in r), sum(x[3] for x in r)
        line = f"{t + 1:>4}  {ttft:>13.1f}  {comp:>8.0f}  {hits / looked if looked else math.nan:>8.2f}"
        if "reference" in results:
            f = [row[t] for row in results["reference"]]
            rt = statistics.median(x[0] for x in f)
            line += f"  {rt:>11.1f}  {statistics.median(x[1] for x in f):>8.0f}  {rt / ttft:>5.1f}x"
        print(line)


if __name__ == "__main__":
    main()
