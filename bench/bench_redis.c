/* bench/bench_redis.c — what the shared Redis tier buys a fleet: the same
 * Zipf-distributed RAG workload on one service, on two replicas without the
 * tier (requests alternate between them) and on two replicas sharing chunks
 * through Redis; chunk hit rates, chunks computed across the fleet, and the
 * cost of a Redis load (per MiB and per chunk) against a chunk's compute.
 *
 *   bench_redis --redis URL [--model F.gguf] [--threads N] [--requests N]
 *               [--corpus N] [--k N] [--chunk-tokens N] [--zipf S]
 *               [--kv-memory-mb N]
 *
 * Runs in-process (two rk_service on one Redis, different arenas), on the
 * engine threads of one process, one request at a time. The tier's keys for
 * the model are flushed before the shared run. Defaults: the embedded tiny
 * model, 1 thread, 200 requests of 4 chunks of about 128 tokens drawn from a
 * corpus of 64 with Zipf exponent 1.1. Not a test: it prints a table. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline.h"

static const char *WORDS[] = {
    "cache",     "model",     "token",      "chunk",    "server", "memory", "position",
    "rotation",  "attention", "document",   "question", "answer", "layer",  "block",
    "system",    "prompt",    "value",      "key",      "the",    "of",     "and",
    "retrieval", "latency",   "throughput", "kernel",   "vector", "index"};

static unsigned next(unsigned *seed) {
    *seed = *seed * 1103515245u + 12345u;
    return *seed >> 16;
}

/* Words until the text tokenizes to about n tokens. */
static char *make_text(const rk_tokenizer *tok, int n, unsigned *seed) {
    size_t cap = (size_t)n * 16 + 64, len = 0;
    char *s = malloc(cap);
    if (!s) return NULL;
    s[0] = '\0';
    for (;;) {
        const char *w = WORDS[next(seed) % (sizeof WORDS / sizeof *WORDS)];
        len += (size_t)snprintf(s + len, cap - len, "%s%s", len ? " " : "", w);
        int32_t *ids;
        size_t k;
        if (rk_tokenizer_encode(tok, s, len, 0, &ids, &k)) return s;
        free(ids);
        if ((int)k >= n || len + 32 > cap) return s;
    }
}

typedef struct opts {
    const char *redis, *model;
    int threads, requests, corpus, k, chunk_tokens, kv_mb;
    double zipf;
} opts;

static rk_service *open_svc(const opts *o, int shared) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.n_threads = o->threads;
    cfg.kv_memory_mb = o->kv_mb;
    if (shared) snprintf(cfg.redis_url, sizeof cfg.redis_url, "%s", o->redis);
    rk_service *svc = NULL;
    if (rk_service_open(&cfg, o->model, &svc)) {
        fprintf(stderr, "bench_redis: %s\n", rk_error_message());
        exit(1);
    }
    return svc;
}

/* The request sequence: k distinct corpus indices each, Zipf by rank. */
static int *make_plan(const opts *o) {
    double *cdf = malloc((size_t)o->corpus * sizeof *cdf), sum = 0;
    int *plan = malloc((size_t)o->requests * o->k * sizeof *plan);
    if (!cdf || !plan) exit(1);
    for (int i = 0; i < o->corpus; i++) cdf[i] = sum += 1.0 / pow(i + 1, o->zipf);
    unsigned seed = 7;
    for (int r = 0; r < o->requests; r++)
        for (int j = 0; j < o->k; j++) {
            int pick;
            int dup;
            do {
                double u = (next(&seed) / 32768.0) * sum;
                pick = 0;
                while (pick < o->corpus - 1 && cdf[pick] < u) pick++;
                dup = 0;
                for (int q = 0; q < j; q++) dup |= plan[r * o->k + q] == pick;
            } while (dup);
            plan[r * o->k + j] = pick;
        }
    free(cdf);
    return plan;
}

typedef struct result {
    uint64_t lookups, hits, computes, redis_hits;
    double seconds;
} result;

static void run_fleet(const opts *o, rk_service **svcs, int n_svc, char **corpus, const int *plan,
                      result *res) {
    memset(res, 0, sizeof *res);
    size_t cap = 64;
    for (int i = 0; i < o->corpus; i++) cap += strlen(corpus[i]) + 4;
    char *prompt = malloc(cap * (size_t)o->k);
    if (!prompt) exit(1);
    double t0 = rk_time_now();
    for (int r = 0; r < o->requests; r++) {
        rk_service *svc = svcs[r % n_svc];
        size_t len = (size_t)sprintf(prompt, "Answer from the documents.");
        for (int j = 0; j < o->k; j++)
            len += (size_t)sprintf(prompt + len, "##%s", corpus[plan[r * o->k + j]]);
        sprintf(prompt + len, "##What is request %d about?", r);
        rk_split sp;
        rk_request req;
        memset(&req, 0, sizeof req);
        rk_req_options_default(&req.opt);
        req.opt.max_tokens = 1;
        req.opt.sampling.temperature = 0;
        rk_request *one = &req;
        if (rk_split_prompt(prompt, strlen(prompt), NULL, 1024, &sp) ||
            rk_request_prepare(svc, &sp, &req) || rk_pipeline_run(svc, &one, 1, NULL)) {
            fprintf(stderr, "bench_redis: %s\n", rk_error_message());
            exit(1);
        }
        rk_split_free(&sp);
        for (int k = 0; k < req.n_chunks; k++)
            res->redis_hits += req.chunk_reports[k].source == RK_CHUNK_SOURCE_REDIS;
        rk_request_free(&req);
        /* Let the asynchronous writes land before the next replica looks, as
         * they would between two requests a second apart. */
        if (svc->redis) {
            int idle;
            rk_redis_wait_idle(svc->redis, 5000, &idle);
        }
    }
    res->seconds = rk_time_now() - t0;
    for (int i = 0; i < n_svc; i++) {
        rk_chunk_stats cs;
        rk_chunk_index_get_stats(svcs[i]->chunks, &cs);
        res->lookups += cs.lookups;
        res->hits += cs.hits;
        res->computes += cs.computes;
    }
    free(prompt);
}

static void print_row(const char *name, const result *r) {
    printf("| %s | %.1f%% | %llu | %llu | %.2f |\n", name,
           r->lookups ? 100.0 * (double)r->hits / (double)r->lookups : 0.0,
           (unsigned long long)r->computes, (unsigned long long)r->redis_hits, r->seconds);
}

int main(int argc, char **argv) {
    opts o = {.threads = 1,
              .requests = 200,
              .corpus = 64,
              .k = 4,
              .chunk_tokens = 128,
              .kv_mb = 256,
              .zipf = 1.1};
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *f = argv[i], *v = argv[i + 1];
        if (!strcmp(f, "--redis"))
            o.redis = v;
        else if (!strcmp(f, "--model"))
            o.model = v;
        else if (!strcmp(f, "--threads"))
            o.threads = atoi(v);
        else if (!strcmp(f, "--requests"))
            o.requests = atoi(v);
        else if (!strcmp(f, "--corpus"))
            o.corpus = atoi(v);
        else if (!strcmp(f, "--k"))
            o.k = atoi(v);
        else if (!strcmp(f, "--chunk-tokens"))
            o.chunk_tokens = atoi(v);
        else if (!strcmp(f, "--kv-memory-mb"))
            o.kv_mb = atoi(v);
        else if (!strcmp(f, "--zipf"))
            o.zipf = atof(v);
        else {
            fprintf(stderr, "bench_redis: unknown flag %s\n", f);
            return 2;
        }
    }
    if (!o.redis || o.k < 1 || o.k > o.corpus || o.requests < 1) {
        fprintf(stderr, "usage: bench_redis --redis URL [--model F.gguf] [--threads N] "
                        "[--requests N] [--corpus N] [--k N] [--chunk-tokens N] [--zipf S] "
                        "[--kv-memory-mb N]\n");
        return 2;
    }
    int *plan = make_plan(&o);
    rk_service *one = open_svc(&o, 0);
    const rk_tokenizer *tok = rk_model_tokenizer(one->model);
    char **corpus = malloc((size_t)o.corpus * sizeof *corpus);
    unsigned seed = 1;
    for (int i = 0; i < o.corpus; i++) corpus[i] = make_text(tok, o.chunk_tokens, &seed);

    printf("%d requests of %d chunks (~%d tokens) from %d, Zipf %.2f, %d thread(s)\n\n", o.requests,
           o.k, o.chunk_tokens, o.corpus, o.zipf, o.threads);
    printf("| fleet | chunk hit rate | chunks computed | loaded from Redis | seconds |\n"
           "|---|---|---|---|---|\n");
    result r1, r2, r3;
    run_fleet(&o, &one, 1, corpus, plan, &r1);
    print_row("one service", &r1);
    double prefill_tps = one->prefill_tps;
    rk_service_close(one);

    rk_service *two[2] = {open_svc(&o, 0), open_svc(&o, 0)};
    run_fleet(&o, two, 2, corpus, plan, &r2);
    print_row("two, no tier", &r2);
    rk_service_close(two[0]);
    rk_service_close(two[1]);

    rk_service *shared[2] = {open_svc(&o, 1), open_svc(&o, 1)};
    if (rk_redis_flush(shared[0]->redis, NULL)) {
        fprintf(stderr, "bench_redis: %s\n", rk_error_message());
        return 1;
    }
    run_fleet(&o, shared, 2, corpus, plan, &r3);
    print_row("two, Redis tier", &r3);
    rk_redis_counters c = {0};
    for (int i = 0; i < 2; i++) {
        rk_redis_counters ci;
        rk_redis_stats(shared[i]->redis, &ci);
        c.hits += ci.hits;
        c.bytes_in += ci.bytes_in;
        c.get_count += ci.get_count;
        c.get_seconds += ci.get_seconds;
        c.writes += ci.writes;
    }
    double mib = (double)c.bytes_in / (1 << 20);
    printf("\nRedis: %llu loads, %.2f MiB in, %llu round trips of %.3f ms mean; "
           "%.2f ms per MiB loaded, %.3f ms per chunk loaded\n",
           (unsigned long long)c.hits, mib, (unsigned long long)c.get_count,
           c.get_count ? 1e3 * c.get_seconds / (double)c.get_count : 0.0,
           mib > 0 ? 1e3 * c.get_seconds / mib : 0.0,
           c.hits ? 1e3 * c.get_seconds / (double)c.hits : 0.0);
    printf("Compute: prefill %.0f tokens/s, %.3f ms per %d-token chunk\n", prefill_tps,
           prefill_tps > 0 ? 1e3 * o.chunk_tokens / prefill_tps : 0.0, o.chunk_tokens);
    rk_service_close(shared[0]);
    rk_service_close(shared[1]);
    for (int i = 0; i < o.corpus; i++) free(corpus[i]);
    free(corpus);
    free(plan);
    return 0;
}
