#!/usr/bin/env python3
"""Render the same chat bodies with ragkv and the reference engine's
llama-server on the same GGUF file (POST /apply-template on both) and compare
the prompts token by token: ragkv's tokens against the reference's prompt
tokenized by the reference, a leading BOS left out of both (ragkv's tokens
start with it; the reference's prompt may or may not write it).

    scripts/compare-template.py MODEL.gguf [--cases tests/data/gemma4_tool_chats.json]
        [--template F.jinja] [--ragkv build/ragkv] [--server PATH/llama-server]

The cases file is {"cases": [{"name", "body", "known"?}]}: each body a chat
request. --template gives both servers the same Jinja template (ragkv's
--chat-template, the reference's --chat-template-file) for a file without
one. A case with "known" (why) is a known difference: reported, not failed.
Both servers listen on 127.0.0.1 only and are stopped at the end. Exits 1
when a case without "known" differs."""
import argparse
import json
import subprocess
import sys
import urllib.error
import urllib.request

from serverlib import free_port, post, wait_ready


def ask(port, path, body):
    try:
        return post(port, path, body, timeout=60)
    except urllib.error.HTTPError as e:
        return {"error": f"HTTP {e.code}: {e.read().decode(errors='replace')}"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--cases", default="tests/data/gemma4_tool_chats.json")
    ap.add_argument("--template")
    ap.add_argument("--ragkv", default="build/ragkv")
    ap.add_argument("--server", default="llama-server")
    a = ap.parse_args()
    cases = json.load(open(a.cases, encoding="utf-8"))["cases"]
    rp, kp = free_port(), free_port()
    ref_cmd = [a.server, "-m", a.model, "--host", "127.0.0.1", "--port", str(rp), "-c", "256",
               "-t", "1", "--jinja"]
    rk_cmd = [a.ragkv, "serve", "--model", a.model, "--host", "127.0.0.1", "--port", str(kp),
              "--threads", "1", "--kv-memory-mb", "256"]
    if a.template:
        ref_cmd += ["--chat-template-file", a.template]
        rk_cmd += ["--chat-template", a.template]
    ref = subprocess.Popen(ref_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rk = subprocess.Popen(rk_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(rp, ref, "the reference server")
        wait_ready(kp, rk, "ragkv")
        with urllib.request.urlopen(f"http://127.0.0.1:{kp}/v1/models", timeout=60) as m:
            bos = json.load(m)["data"][0]["ragkv"]["bos"]
        same = known = bad = 0
        for c in cases:
            r = ask(rp, "/apply-template", c["body"])
            k = ask(kp, "/apply-template", c["body"])
            if "prompt" in r:
                t = ask(rp, "/tokenize", {"content": r["prompt"], "add_special": False,
                                          "parse_special": True})
                want = t.get("tokens", t.get("error"))
            else:
                want = r["error"]
            got = k["ragkv"]["tokens"] if "ragkv" in k else k["error"]
            want, got = [x[1:] if isinstance(x, list) and x[:1] == [bos] else x for x in (want, got)]
            if want == got:
                same += 1
                continue
            if c.get("known"):
                known += 1
                print(f"known difference: {c['name']}: {c['known']}")
                continue
            bad += 1
            n = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y),
                     min(len(want), len(got))) if isinstance(want, list) and isinstance(got, list) else 0
            print(f"differ: {c['name']}\n  reference {r.get('prompt', want)!r:.300}\n"
                  f"  ragkv     {k.get('prompt', got)!r:.300}\n  first differing token: {n}")
        print(f"{same} of {len(cases)} prompts give the same tokens"
              + (f", {known} known differences" if known else ""))
        sys.exit(1 if bad else 0)
    finally:
        ref.kill()
        rk.kill()


if __name__ == "__main__":
    main()
