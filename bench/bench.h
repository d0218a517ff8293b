/* bench/bench.h — `ragkv bench`: a RAG workload benchmark that measures the
 * chunk cache against full prefill in one run.
 *
 * A seeded generator builds a corpus of chunks from the model's vocabulary,
 * a few system prompts and a list of requests, each taking k distinct chunks
 * drawn from a Zipf popularity plus a short question, written as
 * `system##chunk##...##question`. The same request list then runs once per
 * mode, each from empty caches:
 *
 *   plain   the pieces as one ordinary sequence, no cache (full prefill);
 *   prefix  the same, with the system prompt through the radix cache;
 *   rag     the chunk cache and the radix cache (the product);
 *   oracle  the chunk cache off: chunks fresh at their live positions.
 *
 * Requests run in-process through the pipeline (batches of --concurrency
 * requests, or an engine thread fed at Poisson arrival times with
 * --arrival-rate), or against a running `ragkv serve` (--url, loopback only),
 * streamed, from --concurrency client threads or as an open loop; each is a
 * single completion or a conversation of --turns turns (a chat over HTTP);
 * --peer-url runs the same requests against another OpenAI-compatible
 * server as one more row, `peer`. Output lengths may vary
 * per request (--max-tokens MIN:MAX): TPOT and throughput are reported beside
 * TTFT. The result is a table (or one JSON object with --json), an optional
 * SVG plot, and invariants checked at the end. */
#ifndef RK_BENCH_H
#define RK_BENCH_H

/* Run `ragkv bench` with its command-line arguments (argv[0] is "bench").
 * Returns the process exit status: 0 when every request succeeded and every
 * invariant held, 1 on a runtime failure or a broken invariant, 2 on bad
 * usage. Prints to stdout and stderr; owns nothing after returning. */
int rk_bench_main(int argc, char **argv);

#endif
