#!/usr/bin/env python3
"""Write N question records like ragqa's dev.jsonl (see its README), from a
seed, for `ragkv eval --task`: 3-5 chunks of one or two sentences
"SUBJECT VERB a NOUN.", the subject a name or He/She; the asked sentence has a
pronoun subject whose referent is the most recent name of its gender, named in
an earlier chunk (`coref`, 46 %) or earlier in the same chunk (`direct`).

    scripts/coref-set.py N SEED > set.jsonl
    scripts/coref-set.py N SEED --turns 2 > set-2turns.jsonl

With --turns 2 the same records (the same N and SEED give the same stories)
are written as `segments`: the chunks before the middle one, the middle
chunk as text, the chunks after it, then the question; the prompt's tokens
are the one-group record's, but the story arrives in two chunk groups with
a live text between them, as passages do over two turns of a chat.

The sets are larger than dev.jsonl and made independently of it, so a repair
policy chosen on dev.jsonl can be checked on them. They are not ragqa's
training distribution exactly: ragqa answers about 84 % of them with full
attention (90 % of dev.jsonl)."""
import json
import random
import sys

GIRLS = ["Lily", "Sue", "May", "Ivy", "Liz"]
BOYS = ["Tim", "Tom", "Ben", "Hal", "Owen"]
VERBS = ["lost", "took", "made", "got", "fed", "saw", "liked", "wanted", "had", "found",
         "held", "drew"]
NOUNS = ["lamp", "pen", "kite", "star", "nest", "dog", "net", "sled", "hat", "plane", "duck",
         "toy", "fish", "bell", "tent", "sock", "map", "cat", "log", "ring", "ball", "web",
         "gift", "wagon"]
SYSTEMS = ["", "", "Read the story.", "Answer the question.", "Here is a story.",
           "Read the story and answer."]


def story(rng):
    """Chunks of sentences (chunk, subject, referent, verb, noun)."""
    n_chunks = rng.choices([3, 4, 5], [41, 66, 93])[0]
    people = rng.sample(GIRLS, rng.choice([1, 2])) + rng.sample(BOYS, rng.choice([1, 2]))
    while len(people) < 3:
        people.append(rng.choice([p for p in GIRLS + BOYS if p not in people]))
    nouns = rng.sample(NOUNS, len(NOUNS))  # every noun once a story
    sents, last, seen = [], {}, set()  # last: gender -> the most recent name
    for c in range(n_chunks):
        for _ in range(rng.choices([1, 2], [35, 65])[0]):
            unnamed = [p for p in people if p not in seen]
            name = rng.choice(unnamed if unnamed and rng.random() < 0.7 else people)
            g = name in GIRLS
            if g in last and rng.random() < 0.45:
                sents.append((c, "She" if g else "He", last[g], rng.choice(VERBS), nouns.pop()))
            else:
                sents.append((c, name, name, rng.choice(VERBS), nouns.pop()))
                last[g] = name
                seen.add(name)
    return n_chunks, sents


def record(rng, kind):
    """A record whose asked sentence is of the kind asked, with another name
    of the referent's gender in the story."""
    while True:
        n_chunks, sents = story(rng)
        order = list(range(len(sents)))
        rng.shuffle(order)
        for i in order:
            c, subject, ref, verb, noun = sents[i]
            if subject == ref:
                continue  # names are context, never asked
            gender = GIRLS if ref in GIRLS else BOYS
            local = any(s[0] == c and s[1] in gender for s in sents[:i])
            others = {s[1] for s in sents if s[1] in gender and s[1] != ref}
            if ("direct" if local else "coref") != kind or not others:
                continue
            chunks = [" ".join(f"{s[1]} {s[3]} a {s[4]}." for s in sents if s[0] == k)
                      for k in range(n_chunks)]
            return {"system": rng.choice(SYSTEMS), "chunks": chunks,
                    "question": f"Who {verb} a {noun}?", "answer": ref, "type": kind,
                    "fact_chunk": c}


def two_turns(rec):
    """rec with its chunks in two groups, the middle chunk a text between."""
    c, m = rec["chunks"], len(rec["chunks"]) // 2
    out = {"segments": [{"text": rec["system"]}, {"chunks": c[:m]}, {"text": c[m]},
                        {"chunks": c[m + 1:]}, {"text": rec["question"]}]}
    out.update({k: rec[k] for k in ("answer", "type", "fact_chunk")})
    return out


def main():
    args = sys.argv[1:]
    turns = 1
    if len(args) == 4 and args[2] == "--turns":
        turns = int(args.pop(3))
        args.pop(2)
    if len(args) != 2 or turns not in (1, 2):
        sys.exit("usage: scripts/coref-set.py N SEED [--turns 2] > set.jsonl")
    n, seed = int(args[0]), int(args[1])
    rng = random.Random(seed)
    for _ in range(n):
        kind = "coref" if rng.random() < 0.46 else "direct"
        rec = record(rng, kind)
        print(json.dumps(two_turns(rec) if turns == 2 else rec))


main()
