/* bench/bench_engine.c — CPU engine throughput against what the machine can
 * do: prefill tokens/s on a 512-token prompt next to the GFLOP/s that
 * OpenBLAS sgemm alone reaches at a matching shape, and decode tokens/s next
 * to the bound set by memory bandwidth (weight bytes per token / GB/s).
 *
 *   bench_engine [--model F.gguf | --preset NAME --type T] [--threads N]
 *                [--prompt-tokens N] [--decode-tokens N]
 *
 * Without --model it writes the preset (default qwen3-0.6b) with weights
 * of type T (any `ragkv mkmodel --type`: f32, bf16, q8_0, q4_k_m, ...) to a
 * temporary file first. Not a test: it prints figures. */
#include <cblas.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "bench/setup.h"

static double sgemm_gflops(int n, int k, int m) {
    float *a = malloc((size_t)n * k * 4), *b = malloc((size_t)m * k * 4),
          *c = malloc((size_t)n * m * 4);
    for (size_t i = 0; i < (size_t)n * k; i++) a[i] = (float)(i % 7) * 0.01f;
    for (size_t i = 0; i < (size_t)m * k; i++) b[i] = (float)(i % 5) * 0.01f;
    double best = 1e9;
    for (int r = 0; r < 5; r++) {
        double t0 = rk_time_now();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, k, 1.0f, a, k, b, k, 0.0f, c, m);
        double t = rk_time_now() - t0;
        best = t < best ? t : best;
    }
    free(a);
    free(b);
    free(c);
    return 2.0 * n * k * m / best / 1e9;
}

typedef struct read_job {
    const float *p;
    size_t n;
    float sum;
} read_job;

/* Stream through the buffer with 32-byte integer loads (XOR needs no FP
 * dependency chain, so the loop is limited by memory, not by adds). */
static void *read_part(void *arg) {
    read_job *j = arg;
    const __m256i *p = (const __m256i *)j->p;
    size_t n = j->n / 8;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 4 <= n; i += 4) {
        a0 = _mm256_xor_si256(a0, _mm256_load_si256(p + i));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256(p + i + 1));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256(p + i + 2));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256(p + i + 3));
    }
    a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    j->sum = (float)_mm256_extract_epi32(a0, 0);
    return NULL;
}

/* Read bandwidth in GB/s with n_threads threads over a buffer much larger than cache. */
static double read_bandwidth(int n_threads) {
    size_t n = (size_t)1 << 28; /* 1 GiB of floats */
    float *buf = aligned_alloc(64, n * 4);
    if (!buf) return 0;
    for (size_t i = 0; i < n; i++) buf[i] = 1.0f;
    double best = 1e9;
    for (int r = 0; r < 3; r++) {
        pthread_t th[64];
        read_job jobs[64];
        double t0 = rk_time_now();
        for (int t = 0; t < n_threads; t++) {
            jobs[t] = (read_job){buf + n / n_threads * t, n / n_threads, 0};
            pthread_create(&th[t], NULL, read_part, &jobs[t]);
        }
        for (int t = 0; t < n_threads; t++) pthread_join(th[t], NULL);
        double t = rk_time_now() - t0;
        best = t < best ? t : best;
    }
    free(buf);
    return (double)n * 4 / best / 1e9;
}

typedef struct opts {
    int n_prompt, n_decode;
} opts;

static const rk_setting k_settings[] = {
    {"prompt_tokens", "prompt-tokens", RK_SET_INT, offsetof(opts, n_prompt), 0, 16, 1 << 20, 0, 0,
     "N  prefill prompt length (default: 512)"},
    {"decode_tokens", "decode-tokens", RK_SET_INT, offsetof(opts, n_decode), 0, 1, 1 << 20, 0, 0,
     "N  tokens decoded after a 16-token prompt (default: 16)"},
};

/* KV memory tried first: enough for most runs' prompts. */
#define FIRST_KV_MB 512

/* The KV arena sized to the run, as the reference's llama-bench sizes its
 * context: a larger one would still be faulted in by its background thread
 * (kernels/cpu/populate.c) while the decode is measured, its page clearing
 * taking memory bandwidth from the weights. Reopens *svc when the first
 * budget's live pool is too small for the prompt. */
static rk_status size_kv(rk_bench_model *m, rk_config *cfg, int n_prompt, int n_decode,
                         rk_service **svc) {
    const rk_kv_plan *k = &(*svc)->kv;
    long tokens = (n_prompt > 16 + n_decode ? n_prompt : 16 + n_decode) + 2L * k->block_size;
    if ((long)k->pool_blocks[RK_POOL_LIVE] * k->block_size >= tokens) return RK_OK;
    /* the live pool's share of the budget, from the first plan */
    double share = (double)k->pool_blocks[RK_POOL_LIVE] * k->block_size * k->token_bytes /
                   (double)k->budget_bytes;
    cfg->kv_memory_mb = (int)((double)tokens * k->token_bytes / share / (1 << 20)) + 1;
    rk_service_close(*svc);
    *svc = NULL;
    return rk_bench_model_open(m, cfg, svc);
}

int main(int argc, char **argv) {
    static const char *usage =
        "usage: bench_engine [--model F.gguf | --preset NAME --type T] [--threads N]\n"
        "                    [--backend cpu|cuda] [--kv-dtype T] [--prompt-tokens N]\n"
        "                    [--decode-tokens N]\n"
        "Prefill and decode throughput next to what sgemm and memory bandwidth allow.\n"
        "Defaults: the qwen3-0.6b preset in F32, 2 threads.\n";
    rk_bench_model m;
    rk_bench_model_defaults(&m);
    snprintf(m.preset, sizeof m.preset, "qwen3-0.6b");
    opts o = {.n_prompt = 512, .n_decode = 16};
    rk_settings own = {k_settings, sizeof k_settings / sizeof k_settings[0], &o};
    int exit_code;
    if (rk_bench_parse("bench_engine", usage, &m, RK_BENCH_MODEL_BACKEND, &own, argc, argv,
                       &exit_code))
        return exit_code;
    int threads = m.threads, n_prompt = o.n_prompt, n_decode = o.n_decode;
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.kv_memory_mb = FIRST_KV_MB;
    rk_service *svc;
    if (rk_bench_model_open(&m, &cfg, &svc) || size_kv(&m, &cfg, n_prompt, n_decode, &svc)) {
        fprintf(stderr, "bench_engine: %s\n", rk_error_message());
        rk_bench_model_done(&m);
        return 1;
    }
    const rk_hparams *hp = rk_model_hparams(svc->model);
    int32_t *prompt = malloc((size_t)n_prompt * 4);
    uint64_t x = 12345;
    for (int i = 0; i < n_prompt; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        prompt[i] = (int32_t)((x >> 33) % 32000);
    }
    /* Prefill: best of 3 (one forward pass over the whole prompt, one logit row). */
    double best_prefill = 1e9;
    for (int r = 0; r < 3; r++) {
        /* a first token of its own per run, so no run reuses another's prefix */
        prompt[0] = (int32_t)(prompt[0] + 1) % 32000;
        rk_request req = {0};
        rk_req_options_default(&req.opt);
        req.opt.max_tokens = 1;
        req.opt.sampling.temperature = 0;
        if (rk_request_prepare_tokens(svc, NULL, 0, prompt, n_prompt, &req) ||
            rk_pipeline_run(svc, (rk_request *[]){&req}, 1, NULL)) {
            fprintf(stderr, "bench_engine: %s\n", rk_error_message());
            return 1;
        }
        best_prefill = fmin(best_prefill, req.t.prefill_ms / 1e3);
        rk_request_free(&req);
    }
    /* Decode: n_decode tokens after a 16-token prompt. */
    rk_request dreq = {0};
    rk_req_options_default(&dreq.opt);
    dreq.opt.max_tokens = n_decode + 1;
    dreq.opt.sampling.temperature = 0;
    dreq.opt.stop_at_eog = 0;
    if (rk_request_prepare_tokens(svc, NULL, 0, prompt, 16, &dreq) ||
        rk_pipeline_run(svc, (rk_request *[]){&dreq}, 1, NULL)) {
        fprintf(stderr, "bench_engine: %s\n", rk_error_message());
        return 1;
    }
    double decode_s = dreq.t.decode_ms / 1e3;
    int decode_tokens = dreq.n_out - 1;
    rk_request_free(&dreq);
    double q = (double)hp->n_heads * hp->head_dim, kvd = (double)hp->n_kv_heads * hp->head_dim;
    double layer_params =
        (double)hp->dim * (q + 2 * kvd) + q * hp->dim + 3.0 * hp->dim * hp->ffn_dim;
    double attn_flops = 2.0 * 2.0 * hp->n_layers * q * (double)n_prompt * (n_prompt + 1) / 2;
    double prefill_flops =
        2.0 * n_prompt * hp->n_layers * layer_params + attn_flops + 2.0 * hp->dim * hp->n_vocab;
    /* The backend runs OpenBLAS single-threaded inside its own pool; the
     * reference is OpenBLAS's own threading at the same thread count. */
    openblas_set_num_threads(threads);
    double gemm = sgemm_gflops(n_prompt, hp->dim, hp->ffn_dim);
    openblas_set_num_threads(1);
    double bw = read_bandwidth(threads);
    double wbytes = (double)rk_model_weight_bytes(svc->model);
    double dec_tps = decode_tokens / decode_s;
    double bound_tps = bw * 1e9 / wbytes;
    double prefill_gflops = prefill_flops / best_prefill / 1e9;
    printf("model %s (%s, %d layers, dim %d, weights %s, %.0f MB read per token), %d threads\n",
           hp->name, hp->arch_name, hp->n_layers, hp->dim, rk_dtype_name(hp->wtype), wbytes / 1e6,
           threads);
    printf("%-44s %10.1f tok/s  (%.1f GFLOP/s)\n", "prefill", n_prompt / best_prefill,
           prefill_gflops);
    printf("%-44s %10.1f GFLOP/s  -> prefill at %.0f%% of sgemm\n",
           "OpenBLAS sgemm, same threads (n=512,k=dim,m=ffn)", gemm, 100 * prefill_gflops / gemm);
    printf("%-44s %10.2f tok/s  (%.1f GB/s of weights)\n", "decode", dec_tps,
           dec_tps * wbytes / 1e9);
    printf("%-44s %10.1f GB/s   -> bound %.2f tok/s, decode at %.0f%% of it\n",
           "memory read bandwidth", bw, bound_tps, 100 * dec_tps / bound_tps);
    free(prompt);
    rk_service_close(svc);
    rk_bench_model_done(&m);
    return 0;
}
