/* bench/bench_zerocopy.c — what attending cached chunks in place buys over
 * copying them into live blocks (--reindex zero-copy vs copy):
 *   1. N concurrent requests over the same chunks (different questions),
 *      admitted together and decoded to the end: the peak of live-pool blocks
 *      in use;
 *   2. the TTFT of one request whose chunks all hit (best and median of
 *      --rounds, the two modes' rounds alternating).
 *
 *   bench_zerocopy [--model F.gguf | --preset NAME --type f32|bf16] [--threads N]
 *                  [--requests N] [--chunks N] [--chunk-tokens N] [--answer N] [--rounds N]
 *                  [--kv-memory-mb N]
 *
 * Defaults: ../shared/models/stories260K.gguf, 8 requests over 4 chunks of
 * about 96 tokens, 40-token answers, 2 threads, 20 rounds, 256 MiB of KV. Not a test: it
 * prints a table. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/mkmodel.h"
#include "pipeline/pipeline.h"

static const char *WORDS[] = {"Lily", "had",   "a",    "red",  "ball",  "and",  "the", "dog",
                              "ran",  "to",    "park", "sun",  "was",   "warm", "she", "liked",
                              "play", "happy", "big",  "tree", "birds", "sang", "day", "Tom"};

/* Append words until the text tokenizes to about n tokens. */
static char *make_text(const rk_tokenizer *tok, int n, unsigned *seed) {
    size_t cap = (size_t)n * 16 + 64, len = 0;
    char *s = malloc(cap);
    if (!s) exit(1);
    s[0] = '\0';
    for (;;) {
        *seed = *seed * 1103515245u + 12345u;
        const char *w = WORDS[(*seed >> 16) % (sizeof WORDS / sizeof *WORDS)];
        len += (size_t)snprintf(s + len, cap - len, "%s%s", len ? " " : "", w);
        int32_t *ids;
        size_t k;
        if (rk_tokenizer_encode(tok, s, len, 0, &ids, &k)) return s;
        free(ids);
        if ((int)k >= n || len + 32 > cap) return s;
    }
}

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

static rk_service *open_mode(const char *model, const char *reindex, int threads, int kv_mb) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.n_threads = threads;
    cfg.kv_memory_mb = kv_mb;
    cfg.max_chunks = 1024;
    snprintf(cfg.reindex, sizeof cfg.reindex, "%s", reindex);
    rk_service *svc;
    if (rk_service_open(&cfg, model, &svc)) die();
    return svc;
}

static rk_req_options greedy(int max_tokens) {
    rk_req_options o;
    rk_req_options_default(&o);
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
static void measure(const char *model, int threads, int kv_mb, char **prompts, int n_req,
                    int answer, int rounds, result res[2]) {
    const char *modes[2] = {"copy", "zero-copy"};
    rk_service *svc[2];
    double *ttft = calloc((size_t)rounds * 2, sizeof *ttft);
    if (!ttft) die();
    for (int m = 0; m < 2; m++) {
        svc[m] = open_mode(model, modes[m], threads, kv_mb);
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

int main(int argc, char **argv) {
    const char *model = RK_SHARED_DIR "/models/stories260K.gguf", *preset = NULL, *type = "bf16";
    int threads = 2, n_req = 8, n_chunks = 4, chunk_tokens = 96, answer = 40, rounds = 20,
        kv_mb = 256;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--model"))
            model = v;
        else if (!strcmp(a, "--preset"))
            preset = v;
        else if (!strcmp(a, "--type"))
            type = v;
        else if (!strcmp(a, "--threads"))
            threads = atoi(v);
        else if (!strcmp(a, "--requests"))
            n_req = atoi(v);
        else if (!strcmp(a, "--chunks"))
            n_chunks = atoi(v);
        else if (!strcmp(a, "--chunk-tokens"))
            chunk_tokens = atoi(v);
        else if (!strcmp(a, "--answer"))
            answer = atoi(v);
        else if (!strcmp(a, "--rounds"))
            rounds = atoi(v);
        else if (!strcmp(a, "--kv-memory-mb"))
            kv_mb = atoi(v);
        else {
            fprintf(stderr, "bench_zerocopy: unknown option %s\n", a);
            return 2;
        }
    }
    if (n_req < 1 || n_chunks < 1 || chunk_tokens < 1 || answer < 1 || rounds < 1 || kv_mb < 1) {
        fprintf(stderr, "bench_zerocopy: counts must be positive\n");
        return 2;
    }
    char tmp[256] = "";
    if (preset) {
        snprintf(tmp, sizeof tmp, "/tmp/ragkv-bench-zc-%s-%s-%d.gguf", preset, type, (int)getpid());
        rk_mkmodel_opts mo;
        rk_mkmodel_opts_default(&mo);
        mo.preset = preset;
        mo.vocab_path = RK_SHARED_DIR "/tokenizers/qwen3/tokenizer.json";
        if (rk_mkmodel_parse_wtype(type, &mo.wtype) || rk_mkmodel_write(tmp, &mo)) die();
        model = tmp;
    }
    /* The prompts: one system prompt and the same chunks, a question each. */
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.kv_memory_mb = 16;
    rk_service *svc;
    if (rk_service_open(&cfg, model, &svc)) die();
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    unsigned seed = 11;
    size_t cap = (size_t)(n_chunks + 2) * ((size_t)chunk_tokens * 16 + 64), len = 0;
    char *shared = malloc(cap);
    char *sys = make_text(tok, 12, &seed);
    len += (size_t)snprintf(shared + len, cap - len, "%s", sys);
    free(sys);
    for (int k = 0; k < n_chunks; k++) {
        char *c = make_text(tok, chunk_tokens, &seed);
        len += (size_t)snprintf(shared + len, cap - len, "##%s", c);
        free(c);
    }
    char **prompts = calloc((size_t)n_req, sizeof *prompts);
    for (int i = 0; i < n_req; i++) {
        char *q = make_text(tok, 8, &seed);
        prompts[i] = malloc(len + strlen(q) + 3);
        sprintf(prompts[i], "%s##%s", shared, q);
        free(q);
    }
    const rk_hparams *hp = rk_model_hparams(svc->model);
    printf("%s (%s), %d threads, block size %d; %d requests over the same %d chunks of ~%d "
           "tokens, %d-token answers\n",
           hp->name, rk_dtype_name(hp->wtype), threads, cfg.block_size, n_req, n_chunks,
           chunk_tokens, answer);
    rk_service_close(svc);
    result res[2];
    measure(model, threads, kv_mb, prompts, n_req, answer, rounds, res);
    printf("  %-10s %16s %14s %24s %16s\n", "reindex", "peak live blocks", "shared blocks",
           "all-hit TTFT best/median", "concurrent wall");
    for (int m = 0; m < 2; m++)
        printf("  %-10s %16d %14d %11.3f / %8.3f ms %13.1f ms\n", m ? "zero-copy" : "copy",
               res[m].peak_live, res[m].shared_blocks, res[m].ttft_best, res[m].ttft_median,
               res[m].wall_ms);
    printf("  live blocks: zero-copy needs %.1f%% of copy's peak\n",
           100.0 * res[1].peak_live / (res[0].peak_live ? res[0].peak_live : 1));
    for (int i = 0; i < n_req; i++) free(prompts[i]);
    free(prompts);
    free(shared);
    if (*tmp) remove(tmp);
    return 0;
}
