/* bench/bench_zerocopy.c — what attending cached chunks in place buys over
 * copying them into live blocks (--reindex zero-copy vs copy):
 *   1. N concurrent requests over the same chunks (different questions),
 *      admitted together and decoded to the end: the peak of live-pool blocks
 *      in use;
 *   2. the TTFT of one request whose chunks all hit (best and median of
 *      --rounds, the two modes' rounds alternating);
 *   3. with --live-blocks B: the same requests submitted at once to the
 *      engine thread (rk_scheduler, as `ragkv serve` runs them) with a live
 *      pool of B blocks, after one request warmed the chunks: the most
 *      generations running together, and the wall time for all.
 *
 *   bench_zerocopy [--model F.gguf | --preset NAME --type f32|bf16] [--threads N]
 *                  [--requests N] [--chunks N] [--chunk-tokens N] [--answer N] [--rounds N]
 *                  [--kv-memory-mb N]
 *
 * Defaults: ../shared/models/stories260K.gguf, 8 requests over 4 chunks of
 * about 96 tokens, 40-token answers, 2 threads, 20 rounds, 256 MiB of KV. Not a test: it
 * prints a table. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/setup.h"
#include "pipeline/scheduler.h"

static const char *const WORDS[] = {
    "Lily", "had",  "a",   "red",   "ball", "and",   "the", "dog",  "ran",   "to",   "park", "sun",
    "was",  "warm", "she", "liked", "play", "happy", "big", "tree", "birds", "sang", "day",  "Tom"};
#define N_WORDS ((int)(sizeof WORDS / sizeof *WORDS))

static void die(void) {
    fprintf(stderr, "bench_zerocopy: %s\n", rk_error_message());
    exit(1);
}

static void prepare(rk_service *svc, const char *prompt, rk_req_options o, rk_request *r) {
    rk_split sp;
    if (rk_split_prompt(prompt, strlen(prompt), NULL, 1024, &sp)) die();
    memset(r, 0, sizeof *r);
    r->opt = o;
    rk_status st = rk_request_prepare(svc, &sp, r);
    rk_split_free(&sp);
    if (st) die();
}

static int live_used(rk_service *svc) {
    return rk_arena_pool_total(svc->arena, RK_POOL_LIVE) -
           rk_arena_pool_free(svc->arena, RK_POOL_LIVE);
}

typedef struct result {
    int peak_live, shared_blocks;
    double ttft_best, ttft_median, wall_ms;
} result;

static rk_service *open_mode(rk_bench_model *m, const char *reindex, int kv_mb) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.kv_memory_mb = kv_mb;
    cfg.max_chunks = 1024;
    snprintf(m->reindex, sizeof m->reindex, "%s", reindex);
    rk_service *svc;
    if (rk_bench_model_open(m, &cfg, &svc)) die();
    return svc;
}

/* Greedy; the radix tree holds system prompts only, so that what is
 * measured is how chunks reach requests (a repeated or extended sequence
 * would share its chunks' pages through the tree on either path). */
static rk_req_options greedy(int max_tokens) {
    rk_req_options o;
    rk_req_options_default(&o);
    o.reuse_sequences = 0;
    o.sampling.temperature = 0;
    o.stop_at_eog = 0;
    o.max_tokens = max_tokens;
    return o;
}

/* One request alone; its TTFT. */
static double one(rk_service *svc, const char *prompt, int *shared_blocks) {
    rk_request r;
    prepare(svc, prompt, greedy(1), &r);
    rk_request *one = &r;
    if (rk_pipeline_run(svc, &one, 1, NULL)) die();
    double ttft = r.t.ttft_ms;
    *shared_blocks = r.shared_blocks;
    rk_request_free(&r);
    return ttft;
}

/* n_req requests admitted together and decoded to the end: the live pool's
 * peak (blocks in use after admission and after every step). */
static void concurrent(rk_service *svc, char **prompts, int n_req, int answer, result *res) {
    rk_request *reqs = calloc((size_t)n_req, sizeof *reqs);
    rk_request **ptrs = calloc((size_t)n_req, sizeof *ptrs);
    rk_pipeline *p;
    if (!reqs || !ptrs || rk_pipeline_create(svc, &p)) die();
    int base = live_used(svc);
    for (int i = 0; i < n_req; i++) {
        prepare(svc, prompts[i], greedy(answer), &reqs[i]);
        ptrs[i] = &reqs[i];
    }
    double t = rk_time_now();
    if (rk_pipeline_admit(p, ptrs, n_req, NULL)) die();
    res->peak_live = live_used(svc) - base;
    while (rk_pipeline_n_running(p)) {
        if (rk_pipeline_step(p, NULL)) die();
        int used = live_used(svc) - base;
        res->peak_live = used > res->peak_live ? used : res->peak_live;
    }
    res->wall_ms = (rk_time_now() - t) * 1e3;
    rk_pipeline_free(p);
    for (int i = 0; i < n_req; i++) rk_request_free(&reqs[i]);
    free(reqs);
    free(ptrs);
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Both modes side by side: the chunks warmed in each, then all-hit TTFT
 * rounds alternating between them (so load from elsewhere falls on both),
 * then the concurrent run in each. */
static void measure(rk_bench_model *model, int kv_mb, char **prompts, int n_req, int answer,
                    int rounds, result res[2]) {
    const char *modes[2] = {"copy", "zero-copy"};
    rk_service *svc[2];
    double *ttft = calloc((size_t)rounds * 2, sizeof *ttft);
    if (!ttft) die();
    for (int m = 0; m < 2; m++) {
        svc[m] = open_mode(model, modes[m], kv_mb);
        memset(&res[m], 0, sizeof res[m]);
        one(svc[m], prompts[0], &res[m].shared_blocks); /* every chunk computed */
    }
    for (int i = 0; i < rounds; i++)
        for (int m = 0; m < 2; m++)
            ttft[m * rounds + i] = one(svc[m], prompts[i % n_req], &res[m].shared_blocks);
    for (int m = 0; m < 2; m++) {
        qsort(ttft + m * rounds, (size_t)rounds, sizeof *ttft, by_value);
        res[m].ttft_best = ttft[m * rounds];
        res[m].ttft_median = ttft[m * rounds + rounds / 2];
        concurrent(svc[m], prompts, n_req, answer, &res[m]);
        rk_service_close(svc[m]);
    }
    free(ttft);
}

/* ---------------------------------------------------------------- 3. a fixed live pool */

/* The most generations the engine thread ran at once (its snapshots). */
typedef struct peak_running {
    pthread_mutex_t mu;
    int peak;
} peak_running;

static void on_snapshot(void *ctx, const rk_cache_snapshot *snap) {
    peak_running *p = ctx;
    pthread_mutex_lock(&p->mu);
    if (snap->running > p->peak) p->peak = snap->running;
    pthread_mutex_unlock(&p->mu);
}

static void submit_one(rk_scheduler *e, rk_job *j, const char *prompt, int answer) {
    rk_service *svc = rk_scheduler_service(e);
    if (rk_job_init(j)) die();
    j->req.opt = greedy(answer);
    rk_split sp;
    if (rk_split_prompt(prompt, strlen(prompt), NULL, 1024, &sp)) die();
    rk_status st = rk_request_prepare(svc, &sp, &j->req);
    rk_split_free(&sp);
    if (st || rk_scheduler_submit(e, j)) die();
}

static void wait_done(rk_job *j) {
    int n = 0, done = 0;
    while (!done)
        if (rk_job_wait(j, n, rk_time_now() + 600, &n, &done)) {
            fprintf(stderr, "bench_zerocopy: a request made no progress in 10 minutes\n");
            exit(1);
        }
    if (j->status) {
        fprintf(stderr, "bench_zerocopy: a request failed: %s\n", j->error);
        exit(1);
    }
}

/* All n_req prompts at once through an engine thread whose live pool has
 * live_blocks blocks: the peak of generations running and the wall time. */
static void fixed_pool(rk_bench_model *model, const char *reindex, int live_blocks, int kv_mb,
                       char **prompts, int n_req, int answer, int *out_peak, double *out_ms) {
    const char *path;
    if (rk_bench_model_path(model, &path)) die();
    peak_running peak = {.peak = 0};
    pthread_mutex_init(&peak.mu, NULL);
    rk_scheduler_params p = {.model_path = path,
                             .max_queue = n_req + 1,
                             .max_batch = n_req,
                             .publish = on_snapshot,
                             .stats_ctx = &peak};
    rk_config_defaults(&p.cfg);
    p.cfg.n_threads = model->threads;
    p.cfg.kv_memory_mb = kv_mb;
    p.cfg.live_blocks = live_blocks;
    p.cfg.max_chunks = 1024;
    snprintf(p.cfg.backend, sizeof p.cfg.backend, "%s", model->backend);
    snprintf(p.cfg.kv_dtype, sizeof p.cfg.kv_dtype, "%s", model->kv_dtype);
    snprintf(p.cfg.reindex, sizeof p.cfg.reindex, "%s", reindex);
    rk_scheduler *e;
    if (rk_scheduler_start(&p, &e)) die();
    char why[320];
    rk_scheduler_state state;
    while ((state = rk_scheduler_get_state(e, why, sizeof why)) == RK_SCHEDULER_LOADING) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (state != RK_SCHEDULER_READY) {
        fprintf(stderr, "bench_zerocopy: the engine did not start: %s\n", why);
        exit(1);
    }
    rk_job *jobs = calloc((size_t)n_req + 1, sizeof *jobs);
    if (!jobs) die();
    submit_one(e, &jobs[n_req], prompts[0], 1); /* the chunks, computed once */
    wait_done(&jobs[n_req]);
    pthread_mutex_lock(&peak.mu);
    peak.peak = 0;
    pthread_mutex_unlock(&peak.mu);
    double t0 = rk_time_now();
    for (int i = 0; i < n_req; i++) submit_one(e, &jobs[i], prompts[i], answer);
    for (int i = 0; i < n_req; i++) wait_done(&jobs[i]);
    *out_ms = (rk_time_now() - t0) * 1e3;
    for (int i = 0; i <= n_req; i++) rk_job_destroy(&jobs[i]);
    free(jobs);
    rk_scheduler_free(e);
    *out_peak = peak.peak;
    pthread_mutex_destroy(&peak.mu);
}

typedef struct opts {
    int n_req, n_chunks, chunk_tokens, answer, rounds, kv_mb, live_blocks;
} opts;

#define O_OFF(f) offsetof(opts, f)

static const rk_setting k_settings[] = {
    {"requests", "requests", RK_SET_INT, O_OFF(n_req), 0, 1, 4096, 0, 0,
     "N  concurrent requests over the same chunks (default: 8)"},
    {"chunks", "chunks", RK_SET_INT, O_OFF(n_chunks), 0, 1, 1024, 0, 0,
     "N  chunks per request (default: 4)"},
    {"chunk_tokens", "chunk-tokens", RK_SET_INT, O_OFF(chunk_tokens), 0, 1, 1 << 20, 0, 0,
     "N  tokens per chunk, about (default: 96)"},
    {"answer", "answer", RK_SET_INT, O_OFF(answer), 0, 1, 1 << 20, 0, 0,
     "N  tokens each concurrent request generates (default: 40)"},
    {"rounds", "rounds", RK_SET_INT, O_OFF(rounds), 0, 1, 100000, 0, 0,
     "N  all-hit TTFT rounds per mode (default: 20)"},
    {"kv_memory_mb", "kv-memory-mb", RK_SET_INT, O_OFF(kv_mb), 0, 1, 1 << 24, 0, 0,
     "N  KV budget in MiB per service (default: 256)"},
    {"live_blocks", "live-blocks", RK_SET_INT, O_OFF(live_blocks), 0, 0, 1 << 30, 0, 0,
     "B  also submit the requests at once with a live pool of B blocks (default: 0 = skip)"},
};

/* One system prompt and the same chunks, then a question each: n_req prompts. */
static char **make_prompts(const rk_tokenizer *tok, const opts *o) {
    unsigned seed = 11;
    char *shared =
        rk_bench_make_context(tok, WORDS, N_WORDS, 12, o->n_chunks, o->chunk_tokens, 0, &seed);
    char **prompts = calloc((size_t)o->n_req, sizeof *prompts);
    if (!shared || !prompts) die();
    size_t len = strlen(shared);
    for (int i = 0; i < o->n_req; i++) {
        char *q = rk_bench_make_text(tok, WORDS, N_WORDS, 8, &seed);
        prompts[i] = q ? malloc(len + strlen(q) + 3) : NULL;
        if (!prompts[i]) die();
        sprintf(prompts[i], "%s##%s", shared, q);
        free(q);
    }
    free(shared);
    return prompts;
}

int main(int argc, char **argv) {
    static const char *usage =
        "usage: bench_zerocopy [--model F.gguf | --preset NAME --type f32|bf16] [--threads N]\n"
        "                      [--requests N] [--chunks N] [--chunk-tokens N] [--answer N]\n"
        "                      [--rounds N] [--kv-memory-mb N] [--live-blocks B]\n"
        "Peak live blocks of concurrent requests over the same chunks, and all-hit TTFT, with\n"
        "cached chunks attended in place (zero-copy) and copied (copy). Defaults: the\n"
        "stories260K model, BF16 weights for a preset, 2 threads.\n";
    rk_bench_model m;
    rk_bench_model_defaults(&m);
    snprintf(m.type, sizeof m.type, "bf16");
    opts o = {.n_req = 8,
              .n_chunks = 4,
              .chunk_tokens = 96,
              .answer = 40,
              .rounds = 20,
              .kv_mb = 256,
              .live_blocks = 0};
    rk_settings own = {k_settings, sizeof k_settings / sizeof k_settings[0], &o};
    int exit_code;
    if (rk_bench_parse("bench_zerocopy", usage, &m, RK_BENCH_MODEL_PRESET, &own, argc, argv,
                       &exit_code))
        return exit_code;
    /* A preset, when given, stands instead of the default model. */
    if (!m.model[0] && !m.preset[0])
        snprintf(m.model, sizeof m.model, "%s", RK_SHARED_DIR "/models/stories260K.gguf");
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.kv_memory_mb = 16;
    rk_service *svc;
    if (rk_bench_model_open(&m, &cfg, &svc)) die();
    char **prompts = make_prompts(rk_model_tokenizer(svc->model), &o);
    int threads = m.threads, n_req = o.n_req, n_chunks = o.n_chunks, chunk_tokens = o.chunk_tokens,
        answer = o.answer;
    const rk_hparams *hp = rk_model_hparams(svc->model);
    printf("%s (%s), %d threads, block size %d; %d requests over the same %d chunks of ~%d "
           "tokens, %d-token answers\n",
           hp->name, rk_dtype_name(hp->wtype), threads, cfg.block_size, n_req, n_chunks,
           chunk_tokens, answer);
    rk_service_close(svc);
    result res[2];
    measure(&m, o.kv_mb, prompts, n_req, answer, o.rounds, res);
    printf("  %-10s %16s %14s %24s %16s\n", "reindex", "peak live blocks", "shared blocks",
           "all-hit TTFT best/median", "concurrent wall");
    for (int i = 0; i < 2; i++)
        printf("  %-10s %16d %14d %11.3f / %8.3f ms %13.1f ms\n", i ? "zero-copy" : "copy",
               res[i].peak_live, res[i].shared_blocks, res[i].ttft_best, res[i].ttft_median,
               res[i].wall_ms);
    printf("  live blocks: zero-copy needs %.1f%% of copy's peak\n",
           100.0 * res[1].peak_live / (res[0].peak_live ? res[0].peak_live : 1));
    if (o.live_blocks) {
        int peak[2];
        double ms[2];
        const char *modes[2] = {"copy", "zero-copy"};
        for (int i = 0; i < 2; i++)
            fixed_pool(&m, modes[i], o.live_blocks, o.kv_mb, prompts, n_req, answer, &peak[i],
                       &ms[i]);
        printf("  live pool of %d blocks, %d requests submitted at once:\n", o.live_blocks, n_req);
        for (int i = 0; i < 2; i++)
            printf("  %-10s %3d running at most, all done in %.1f ms\n", modes[i], peak[i], ms[i]);
        printf("  zero-copy runs %.1fx as many at once\n",
               (double)peak[1] / (peak[0] ? peak[0] : 1));
    }
    for (int i = 0; i < n_req; i++) free(prompts[i]);
    free(prompts);
    rk_bench_model_done(&m);
    return 0;
}
