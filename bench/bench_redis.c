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

#include "bench/setup.h"

static const char *const WORDS[] = {
    "cache",     "model",     "token",      "chunk",    "server", "memory", "position",
    "rotation",  "attention", "document",   "question", "answer", "layer",  "block",
    "system",    "prompt",    "value",      "key",      "the",    "of",     "and",
    "retrieval", "latency",   "throughput", "kernel",   "vector", "index"};

static unsigned next(unsigned *seed) {
    *seed = *seed * 1103515245u + 12345u;
    return *seed >> 16;
}

typedef struct opts {
    rk_bench_model m;
    char redis[sizeof(((rk_config *)0)->redis_url)];
    int requests, corpus, k, chunk_tokens, kv_mb;
    double zipf;
} opts;

#define O_OFF(f) offsetof(opts, f)

static const rk_setting k_settings[] = {
    {"redis", "redis", RK_SET_STR, O_OFF(redis), sizeof(((opts *)0)->redis), 0, 0, 0, RK_SECRET_URL,
     "URL  the shared tier, redis://[user:password@]HOST:PORT[/DB] (required)"},
    {"requests", "requests", RK_SET_INT, O_OFF(requests), 0, 1, 10000000, 0, 0,
     "N  requests per fleet (default: 200)"},
    {"corpus", "corpus", RK_SET_INT, O_OFF(corpus), 0, 1, 1000000, 0, 0,
     "N  chunks in the corpus (default: 64)"},
    {"k", "k", RK_SET_INT, O_OFF(k), 0, 1, 4096, 0, 0, "K  chunks per request (default: 4)"},
    {"chunk_tokens", "chunk-tokens", RK_SET_INT, O_OFF(chunk_tokens), 0, 1, 1 << 20, 0, 0,
     "N  tokens per chunk, about (default: 128)"},
    {"kv_memory_mb", "kv-memory-mb", RK_SET_INT, O_OFF(kv_mb), 0, 1, 1 << 24, 0, 0,
     "N  KV budget in MiB per service (default: 256)"},
    {"zipf", "zipf", RK_SET_DOUBLE, O_OFF(zipf), 0, 0, 10, 0, 0,
     "S  Zipf exponent of chunk popularity (default: 1.1)"},
};

static rk_service *open_svc(opts *o, int shared) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.kv_memory_mb = o->kv_mb;
    if (shared) snprintf(cfg.redis_url, sizeof cfg.redis_url, "%s", o->redis);
    rk_service *svc = NULL;
    if (rk_bench_model_open(&o->m, &cfg, &svc)) {
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
    static const char *usage =
        "usage: bench_redis --redis URL [--model F.gguf] [--threads N] [--requests N]\n"
        "                   [--corpus N] [--k N] [--chunk-tokens N] [--zipf S] [--kv-memory-mb N]\n"
        "One service, two replicas without the tier and two sharing chunks through Redis, on\n"
        "the same Zipf RAG workload. Defaults: the embedded model, 1 thread.\n";
    opts o = {
        .requests = 200, .corpus = 64, .k = 4, .chunk_tokens = 128, .kv_mb = 256, .zipf = 1.1};
    rk_bench_model_defaults(&o.m);
    o.m.threads = 1;
    rk_settings own = {k_settings, sizeof k_settings / sizeof k_settings[0], &o};
    int exit_code;
    if (rk_bench_parse("bench_redis", usage, &o.m, RK_BENCH_MODEL_FILE, &own, argc, argv,
                       &exit_code))
        return exit_code;
    if (!o.redis[0] || o.k > o.corpus) {
        fprintf(stderr, "bench_redis: %s (see bench_redis --help)\n",
                o.redis[0] ? "--k is larger than --corpus" : "--redis is required");
        return 2;
    }
    int *plan = make_plan(&o);
    rk_service *one = open_svc(&o, 0);
    const rk_tokenizer *tok = rk_model_tokenizer(one->model);
    char **corpus = malloc((size_t)o.corpus * sizeof *corpus);
    if (!corpus) exit(1);
    unsigned seed = 1;
    for (int i = 0; i < o.corpus; i++) {
        corpus[i] = rk_bench_make_text(tok, WORDS, (int)(sizeof WORDS / sizeof *WORDS),
                                       o.chunk_tokens, &seed);
        if (!corpus[i]) exit(1);
    }

    printf("%d requests of %d chunks (~%d tokens) from %d, Zipf %.2f, %d thread(s)\n\n", o.requests,
           o.k, o.chunk_tokens, o.corpus, o.zipf, o.m.threads);
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
