/* bench/bench_radix.c — the prefix cache's costs and savings:
 *   1. match + lock + unlock latency of a 512-token prompt with 1k and 10k
 *      cached sequences (page size 16, prompts sharing nothing but a 64-token
 *      head, the worst case for child lookups);
 *   2. prefill time saved on a 1000-token system prompt, on a real model:
 *      the first request computes it, the second reuses it.
 *
 *   bench_radix [--model F.gguf] [--threads N]   (default: the stories260K model, 2 threads) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/setup.h"

static void no_release(void *ctx, const int32_t *pages, int n) { (void)ctx, (void)pages, (void)n; }

static void bench_match(int n_seqs) {
    rk_radix_params p = {.page_size = 16, .policy = RK_RADIX_LRU, .release_pages = no_release};
    rk_radix *r;
    if (rk_radix_create(&p, &r)) return;
    enum { LEN = 512 };
    int32_t *toks = malloc(sizeof(int32_t) * LEN * (size_t)n_seqs), pages[LEN / 16];
    uint64_t x = 88172645463325252ull;
    for (int s = 0; s < n_seqs; s++)
        for (int i = 0; i < LEN; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            toks[(size_t)s * LEN + i] = i < 64 ? i : (int32_t)(x % 150000);
        }
    for (int s = 0; s < n_seqs; s++) {
        int present;
        for (int k = 0; k < LEN / 16; k++) pages[k] = s * (LEN / 16) + k;
        rk_radix_insert(r, 1, toks + (size_t)s * LEN, LEN, pages, 0, &present, NULL);
    }
    int iters = 200000;
    double t0 = rk_time_now();
    long matched = 0;
    for (int i = 0; i < iters; i++) {
        rk_radix_result m;
        rk_radix_match(r, 1, toks + (size_t)(i % n_seqs) * LEN, LEN, RK_RADIX_LEAVE_ONE, pages, &m);
        matched += m.n_matched;
        if (m.node) rk_radix_unlock(r, m.node);
    }
    double us = (rk_time_now() - t0) / iters * 1e6;
    printf(
        "match+lock+unlock, 512-token prompt, %5d cached sequences: %6.2f us  (matched %ld/iter)\n",
        n_seqs, us, matched / iters);
    free(toks);
    rk_radix_free(r);
}

int main(int argc, char **argv) {
    static const char *usage =
        "usage: bench_radix [--model F.gguf] [--threads N]\n"
        "The prefix cache's match cost at 1k and 10k cached sequences, and the prefill a cached\n"
        "1000-token system prompt saves. Defaults: the stories260K model, 2 threads.\n";
    rk_bench_model m;
    rk_bench_model_defaults(&m);
    snprintf(m.model, sizeof m.model, "%s", RK_SHARED_DIR "/models/stories260K.gguf");
    int exit_code;
    if (rk_bench_parse("bench_radix", usage, &m, RK_BENCH_MODEL_FILE, NULL, argc, argv, &exit_code))
        return exit_code;
    bench_match(1000);
    bench_match(10000);

    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.kv_memory_mb = 4096;
    rk_service *svc;
    if (rk_bench_model_open(&m, &cfg, &svc)) {
        fprintf(stderr, "bench_radix: %s\n", rk_error_message());
        return 1;
    }
    enum { SYS = 1000, Q = 24 };
    int32_t prompt[SYS + Q];
    for (int i = 0; i < SYS + Q; i++) prompt[i] = 3 + (i * 37) % 400;
    double ttft[3];
    int cached[3];
    for (int run = 0; run < 3; run++) {
        prompt[SYS] = 10 + run; /* a different question each time */
        rk_request r = {0};
        rk_req_options_default(&r.opt);
        r.opt.max_tokens = 1;
        r.opt.sampling.temperature = 0;
        if (rk_request_prepare_tokens(svc, prompt, SYS, prompt + SYS, Q, &r) ||
            rk_pipeline_run(svc, (rk_request *[]){&r}, 1, NULL)) {
            fprintf(stderr, "bench_radix: %s\n", rk_error_message());
            return 1;
        }
        ttft[run] = r.t.ttft_ms / 1e3;
        cached[run] = r.sys_cached;
        rk_request_free(&r);
    }
    printf("%s, 1000-token system prompt + 24-token question, %d threads:\n",
           rk_model_hparams(svc->model)->name, m.threads);
    printf("  cold (computes all):   TTFT %8.2f ms, cached tokens %d\n", ttft[0] * 1e3, cached[0]);
    printf("  warm (reuses system):  TTFT %8.2f ms, cached tokens %d  -> %.1fx faster, %.2f ms "
           "saved\n",
           ttft[2] * 1e3, cached[2], ttft[0] / ttft[2], (ttft[0] - ttft[2]) * 1e3);
    rk_service_close(svc);
    return 0;
}
