#!/usr/bin/env python3
"""Tokenize the same strings with ragkv and the reference engine's llama-server
on the same GGUF file (POST /tokenize, no BOS, special tokens recognised) and
compare the ids.

    scripts/compare-tokenizer.py MODEL.gguf [--strings tests/data/gemma3_tokens.json]
        [--ragkv build/ragkv] [--server PATH/llama-server] [--write OUT.json]

The strings are the "text" of each case in --strings (a test-vector file).
--write keeps the reference's ids as a test-vector file ({"source", "cases":
[{"text", "ids"}]}). Both servers listen on 127.0.0.1 only and are stopped at
the end. Prints the strings whose ids differ and a summary; exits 1 when any
differ."""
import argparse
import json
import subprocess
import sys
import urllib.error

from serverlib import free_port, post, wait_ready


def tokenize(port, text):
    try:
        return post(port, "/tokenize", {"content": text, "add_special": False, "parse_special": True},
                    timeout=60)["tokens"]
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read().decode(errors='replace')}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--strings", default="tests/data/gemma3_tokens.json")
    ap.add_argument("--ragkv", default="build/ragkv")
    ap.add_argument("--server", default="llama-server")
    ap.add_argument("--write")
    a = ap.parse_args()
    texts = [c["text"] for c in json.load(open(a.strings, encoding="utf-8"))["cases"]]
    rp, kp = free_port(), free_port()
    ref = subprocess.Popen([a.server, "-m", a.model, "--host", "127.0.0.1", "--port", str(rp),
                            "-c", "256", "-t", "1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rk = subprocess.Popen([a.ragkv, "serve", "--model", a.model, "--host", "127.0.0.1", "--port",
                           str(kp), "--threads", "1", "--kv-memory-mb", "256"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(rp, ref, "the reference server")
        wait_ready(kp, rk, "ragkv")
        differ, cases = 0, []
        for t in texts:
            want, got = tokenize(rp, t), tokenize(kp, t)
            cases.append({"text": t, "ids": want})
            if want != got:
                differ += 1
                print(f"differ: {t[:60]!r}\n  reference {str(want)[:100]}\n  ragkv     {str(got)[:100]}")
        print(f"{len(texts) - differ} of {len(texts)} strings give the same ids")
        if a.write:
            with open(a.write, "w", encoding="utf-8") as f:
                json.dump({"source": f"the reference engine's /tokenize on {a.model}", "cases": cases},
                          f, ensure_ascii=False, indent=0)
        sys.exit(1 if differ else 0)
    finally:
        ref.kill()
        rk.kill()


if __name__ == "__main__":
    main()
