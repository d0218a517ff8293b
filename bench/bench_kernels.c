/* bench/bench_kernels.c — throughput of the CPU backend's hot ops, printed as
 * a table (a program, not a test):
 *   (a) GEMM: cblas_sgemm and our matmul (F32 and BF16 weights) at
 *       (512 x 1024) . (1024 x 3072);
 *   (b) memory bandwidth (memcpy, and a read loop over the pool) against the
 *       decode matvec (n = 1) at k = 1024, m = 3072 and m = 151936;
 *   (c) paged vs contiguous attention (16 heads, 8 KV heads, head_dim 128):
 *       decode at 1k, 4k, 8k context, prefill of 512 queries at 4k; and
 *       over an F16 cache, a 512-token prefill from empty and a decode at 4k;
 *   (d) rope_shift_copy of 4096 tokens x 28 layers x (8 x 128) against a
 *       plain memcpy of the same bytes;
 *   (e) attention at 4k context (decode, and a prefill of 512 queries) read
 *       as 8 position-shifted runs (chunks attended in place, queries
 *       counter-rotated) against the same entries as one run;
 *   (f) quantized weights (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) at k = 1024,
 *       m = 3072: the decode matvec (n = 1) with each instruction set's
 *       kernels, and matmul at n = 32, 128 and 512 (prefill sizes).
 * Usage: bench_kernels [--threads N] (default 2) [--only abcdef] (sections). */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/setup.h"
#include "config/config.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"

static uint64_t rng = 88172645463325252ull;

static float frand(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

static void *xmalloc(size_t n) {
    void *p = aligned_alloc(64, (n + 63) / 64 * 64);
    if (!p) {
        fprintf(stderr, "bench_kernels: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

/* 0..n-1 in a random order (Fisher-Yates on the benchmark's generator). */
static int32_t *shuffled(int n) {
    int32_t *perm = xmalloc((size_t)n * 4);
    for (int i = 0; i < n; i++) perm[i] = i;
    for (int i = n - 1; i > 0; i--) {
        (void)frand();
        int j = (int)((rng >> 33) % (uint64_t)(i + 1));
        int32_t tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    return perm;
}

static void check(rk_status st, const char *what) {
    if (st != RK_OK) {
        fprintf(stderr, "bench_kernels: %s failed: %s (%s)\n", what, rk_status_str(st),
                rk_error_message());
        exit(1);
    }
}

/* Backend memory, as the engine allocates weights and the KV arena (huge
 * pages for large buffers). */
static void *be_alloc(rk_backend *be, size_t n) {
    void *p = NULL;
    check(be->ops->alloc(be, n, &p), "alloc");
    return p;
}

static float *be_rand_f32(rk_backend *be, size_t n) {
    float *p = be_alloc(be, n * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = frand();
    return p;
}

static float *rand_f32(size_t n) {
    float *p = xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = frand();
    return p;
}

/* Best time of reps runs after one warm-up (seconds). */
#define TIME_BEST(reps, out_best, body)                                                            \
    do {                                                                                           \
        body;                                                                                      \
        double best_ = 1e30;                                                                       \
        for (int r_ = 0; r_ < (reps); r_++) {                                                      \
            double t0_ = rk_time_now();                                                            \
            body;                                                                                  \
            double dt_ = rk_time_now() - t0_;                                                      \
            if (dt_ < best_) best_ = dt_;                                                          \
        }                                                                                          \
        (out_best) = best_;                                                                        \
    } while (0)

/* ---------------------------------------------------------------- (a) gemm */

static void bench_gemm(rk_backend *be) {
    int n = 512, k = 1024, m = 3072;
    float *x = rand_f32((size_t)n * k), *w = be_rand_f32(be, (size_t)m * k);
    float *y = rand_f32((size_t)n * m);
    uint16_t *wb = be_alloc(be, (size_t)m * k * 2);
    rk_cpu_from_f32(wb, w, RK_DTYPE_BF16, (size_t)m * k);
    double flop = 2.0 * n * k * m, t;
    printf("\n(a) GEMM y(512,3072) = x(512,1024) . w(3072,1024)^T\n");
    printf("  %-34s %10s %10s\n", "", "ms", "GFLOP/s");
    /* plain OpenBLAS with its own threads (the backend keeps it at 1 and
     * runs panels on its pool instead) */
    openblas_set_num_threads(be->n_threads);
    TIME_BEST(5, t,
              cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, k, 1.0f, x, k, w, k, 0.0f,
                          y, m));
    char label[64];
    snprintf(label, sizeof label, "cblas_sgemm, OpenBLAS %d threads", be->n_threads);
    printf("  %-34s %10.2f %10.1f\n", label, t * 1e3, flop / t * 1e-9);
    openblas_set_num_threads(1);
    TIME_BEST(5, t,
              cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, k, 1.0f, x, k, w, k, 0.0f,
                          y, m));
    printf("  %-34s %10.2f %10.1f\n", "cblas_sgemm, OpenBLAS 1 thread", t * 1e3, flop / t * 1e-9);
    TIME_BEST(5, t, check(be->ops->matmul(be, y, x, w, RK_DTYPE_F32, n, k, m), "matmul"));
    printf("  %-34s %10.2f %10.1f\n", "matmul F32 weights", t * 1e3, flop / t * 1e-9);
    TIME_BEST(5, t, check(be->ops->matmul(be, y, x, wb, RK_DTYPE_BF16, n, k, m), "matmul"));
    printf("  %-34s %10.2f %10.1f\n", "matmul BF16 weights", t * 1e3, flop / t * 1e-9);
    /* where the two paths cross over: small n at the decode shape */
    printf("  small n at k=1024 m=3072 (path: mv = matvec kernel, blas = sgemm panels;\n"
           "  last column: plain OpenBLAS sgemm with %d threads):\n",
           be->n_threads);
    printf("  %6s %6s %12s %12s %12s\n", "n", "path", "F32 ms", "BF16 ms", "sgemm ms");
    const int small_n[7] = {1, 2, 4, 8, 16, 24, 32};
    for (int ni = 0; ni < 7; ni++) {
        int nn = small_n[ni];
        double tf, tb, ts;
        TIME_BEST(10, tf, check(be->ops->matmul(be, y, x, w, RK_DTYPE_F32, nn, k, m), "matmul"));
        TIME_BEST(10, tb, check(be->ops->matmul(be, y, x, wb, RK_DTYPE_BF16, nn, k, m), "matmul"));
        openblas_set_num_threads(be->n_threads);
        TIME_BEST(10, ts,
                  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nn, m, k, 1.0f, x, k, w, k,
                              0.0f, y, m));
        openblas_set_num_threads(1);
        printf("  %6d %6s %12.3f %12.3f %12.3f\n", nn,
               rk_cpu_matmul_uses_blas(nn, k, m, RK_DTYPE_F32) ? "blas" : "mv", tf * 1e3, tb * 1e3,
               ts * 1e3);
    }
    free(x);
    be->ops->free(be, w);
    free(y);
    free(wb);
}

/* ---------------------------------------------------------------- (b) bandwidth */

typedef struct read_ctx {
    const float *p;
    size_t n, per;
    float sums[64 * 16];
} read_ctx;

static void read_task(void *ctx, int task, int tid) {
    read_ctx *c = ctx;
    size_t i0 = (size_t)task * c->per, i1 = i0 + c->per < c->n ? i0 + c->per : c->n;
#ifdef __AVX2__
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
           a3 = _mm256_setzero_ps();
    for (size_t i = i0; i + 32 <= i1; i += 32) {
        a0 = _mm256_add_ps(a0, _mm256_load_ps(c->p + i));
        a1 = _mm256_add_ps(a1, _mm256_load_ps(c->p + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_load_ps(c->p + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_load_ps(c->p + i + 24));
    }
    c->sums[(tid % 64) * 16] +=
        rk_hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
    float a[8] = {0};
    for (size_t i = i0; i + 8 <= i1; i += 8)
        for (int j = 0; j < 8; j++) a[j] += c->p[i + j];
    for (int j = 0; j < 8; j++) c->sums[(tid % 64) * 16] += a[j];
#endif
}

static void bench_bandwidth(rk_backend *be) {
    size_t bytes = (size_t)1 << 30; /* 1 GiB: far beyond the caches */
    float *a = xmalloc(bytes), *b = xmalloc(bytes);
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double t;
    printf("\n(b) memory bandwidth and decode matvec (n = 1)\n");
    TIME_BEST(3, t, memcpy(b, a, bytes));
    printf("  %-44s %8.1f GB/s (read + write %.1f)\n", "memcpy 1 GiB, 1 thread (bytes copied)",
           bytes / t * 1e-9, 2 * bytes / t * 1e-9);
    rk_cpu *cpu = be->impl;
    read_ctx *rc = xmalloc(sizeof *rc);
    memset(rc, 0, sizeof *rc);
    rc->p = a;
    rc->n = bytes / sizeof(float);
    rc->per = (size_t)1 << 20;
    int n_tasks = (int)((rc->n + rc->per - 1) / rc->per);
    TIME_BEST(3, t, rk_threadpool_run(cpu->pool, n_tasks, read_task, rc));
    double read_bw = bytes / t * 1e-9;
    printf("  %-44s %8.1f GB/s\n", "read loop 1 GiB, pool threads", read_bw);
    free(rc);
    free(a);
    free(b);

    const int ms[2] = {3072, 151936};
    int k = 1024;
    printf("  %-28s %10s %10s %10s\n", "matvec", "weights", "ms", "GB/s");
    for (int i = 0; i < 2; i++) {
        int m = ms[i];
        float *w = be_rand_f32(be, (size_t)m * k), *x = rand_f32((size_t)k),
              *y = rand_f32((size_t)m);
        uint16_t *wb = be_alloc(be, (size_t)m * k * 2);
        rk_cpu_from_f32(wb, w, RK_DTYPE_BF16, (size_t)m * k);
        int reps = m > 10000 ? 5 : 50;
        char name[64];
        snprintf(name, sizeof name, "k=%d m=%d F32", k, m);
        TIME_BEST(reps, t, check(be->ops->matmul(be, y, x, w, RK_DTYPE_F32, 1, k, m), "matmul"));
        printf("  %-28s %8.1fMB %10.3f %10.1f\n", name, m * (double)k * 4 / 1e6, t * 1e3,
               m * (double)k * 4 / t * 1e-9);
        snprintf(name, sizeof name, "k=%d m=%d BF16", k, m);
        TIME_BEST(reps, t, check(be->ops->matmul(be, y, x, wb, RK_DTYPE_BF16, 1, k, m), "matmul"));
        printf("  %-28s %8.1fMB %10.3f %10.1f\n", name, m * (double)k * 2 / 1e6, t * 1e3,
               m * (double)k * 2 / t * 1e-9);
        be->ops->free(be, w);
        free(x);
        free(y);
        be->ops->free(be, wb);
    }
    (void)read_bw;
}

/* ---------------------------------------------------------------- (c) attention */

static void bench_attention(rk_backend *be) {
    const int n_heads = 16, n_kv = 8, hd = 128, bs = 16;
    const size_t row = (size_t)n_kv * hd;
    printf("\n(c) attention, 16 heads / 8 KV heads, head_dim 128, F32 KV, block size 16\n"
           "  paged: a random block table; in-order: blocks 0, 1, 2, ... (the memory\n"
           "  order of the contiguous cache); ratio = paged / contig\n");
    printf("  %-22s %10s %10s %10s %8s %8s %9s\n", "", "paged ms", "in-order", "contig ms", "ratio",
           "in-order", "KV GB/s");
    struct {
        int n_q, kv_len;
    } cases[4] = {{1, 1024}, {1, 4096}, {1, 8192}, {512, 4096}};
    for (int c = 0; c < 4; c++) {
        int L = cases[c].kv_len, n_q = cases[c].n_q, nb = (L + bs - 1) / bs;
        int n_blocks = nb * 2;
        float *kc = be_rand_f32(be, (size_t)L * row), *vc = be_rand_f32(be, (size_t)L * row);
        float *kp = be_alloc(be, (size_t)n_blocks * bs * row * 4),
              *vp = be_alloc(be, (size_t)n_blocks * bs * row * 4);
        /* blocks 0..nb-1 hold the sequence in order, blocks nb..2nb-1 hold it
         * again under a random permutation */
        int32_t *table = xmalloc((size_t)nb * 4), *perm = shuffled(nb);
        int32_t *in_order = xmalloc((size_t)nb * 4);
        for (int b = 0; b < nb; b++) {
            table[b] = nb + perm[b];
            in_order[b] = b;
        }
        for (int t = 0; t < L; t++) {
            size_t slot = (size_t)table[t / bs] * bs + t % bs, slot2 = (size_t)t;
            memcpy(kp + slot * row, kc + (size_t)t * row, row * 4);
            memcpy(vp + slot * row, vc + (size_t)t * row, row * 4);
            memcpy(kp + slot2 * row, kc + (size_t)t * row, row * 4);
            memcpy(vp + slot2 * row, vc + (size_t)t * row, row * 4);
        }
        void *kl[1] = {kp}, *vl[1] = {vp};
        rk_kv_cache kv = {1, n_blocks, bs, n_kv, hd, RK_DTYPE_F32, kl, vl};
        float *q = rand_f32((size_t)n_q * n_heads * hd),
              *out = rand_f32((size_t)n_q * n_heads * hd);
        int32_t qs[2] = {0, n_q}, len = L;
        rk_attn_batch batch = {
            .n_seqs = 1, .q_start = qs, .kv_len = &len, .block_table = table, .max_blocks = nb};
        rk_attn_batch batch2 = batch;
        batch2.block_table = in_order;
        const void *ck[1] = {kc}, *cv[1] = {vc};
        rk_attn_params ap = {.scale = 1.0f / sqrtf((float)hd)};
        /* alternate single runs of the layouts and keep each one's best, so
         * drift and noise from other processes hit them alike */
        int rounds = n_q > 1 ? 6 : 60;
        double tp = 1e30, ti = 1e30, tc = 1e30;
        for (int round = 0; round <= rounds; round++) {
            double t0 = rk_time_now();
            check(be->ops->attention(be, out, NULL, q, &kv, 0, &batch, n_heads, &ap), "attention");
            double t1 = rk_time_now();
            check(be->ops->attention(be, out, NULL, q, &kv, 0, &batch2, n_heads, &ap), "attention");
            double t2 = rk_time_now();
            check(rk_cpu_attention_contig(be, out, NULL, q, ck, cv, RK_DTYPE_F32, n_kv, hd, qs,
                                          &len, 1, n_heads, &ap),
                  "attention_contig");
            double t3 = rk_time_now();
            if (round == 0) continue; /* warm-up */
            if (t1 - t0 < tp) tp = t1 - t0;
            if (t2 - t1 < ti) ti = t2 - t1;
            if (t3 - t2 < tc) tc = t3 - t2;
        }
        char name[64];
        snprintf(name, sizeof name, "%s %d q @ %d", n_q > 1 ? "prefill" : "decode", n_q, L);
        double kv_bytes = 2.0 * L * row * 4;
        printf("  %-22s %10.3f %10.3f %10.3f %8.3f %8.3f %9.1f\n", name, tp * 1e3, ti * 1e3,
               tc * 1e3, tp / tc, ti / tc, kv_bytes / tp * 1e-9);
        be->ops->free(be, kc);
        be->ops->free(be, vc);
        be->ops->free(be, kp);
        be->ops->free(be, vp);
        free(table);
        free(in_order);
        free(perm);
        free(q);
        free(out);
    }
}

/* Attention over an F16 cache as the engine runs it (contiguous here): the
 * causal prefill of 512 tokens from an empty cache (query i sees entries
 * 0..i) and one decode query over 4096 entries; ms, and GFLOP/s of the QK
 * and PV products. */
static void bench_f16_attention(rk_backend *be) {
    const int n_heads = 16, n_kv = 8, hd = 128;
    const size_t row = (size_t)n_kv * hd;
    struct {
        int n_q, kv_len;
    } cases[2] = {{512, 512}, {1, 4096}};
    for (int c = 0; c < 2; c++) {
        int n_q = cases[c].n_q, L = cases[c].kv_len;
        uint16_t *kc = xmalloc((size_t)L * row * 2), *vc = xmalloc((size_t)L * row * 2);
        float *tmp = rand_f32((size_t)L * row);
        rk_cpu_from_f32(kc, tmp, RK_DTYPE_F16, (size_t)L * row);
        free(tmp);
        tmp = rand_f32((size_t)L * row);
        rk_cpu_from_f32(vc, tmp, RK_DTYPE_F16, (size_t)L * row);
        free(tmp);
        float *q = rand_f32((size_t)n_q * n_heads * hd),
              *out = rand_f32((size_t)n_q * n_heads * hd);
        int32_t qs[2] = {0, n_q}, len = L;
        const void *ck[1] = {kc}, *cv[1] = {vc};
        rk_attn_params ap = {.scale = 1.0f / sqrtf((float)hd)};
        double t;
        TIME_BEST(n_q > 1 ? 8 : 60, t,
                  check(rk_cpu_attention_contig(be, out, NULL, q, ck, cv, RK_DTYPE_F16, n_kv, hd,
                                                qs, &len, 1, n_heads, &ap),
                        "attention_contig"));
        /* scores per head: query i sees L - n_q + i + 1 entries */
        double scores = (double)n_q * (L - n_q) + (double)n_q * (n_q + 1) / 2;
        char name[64];
        snprintf(name, sizeof name, "%s %d q @ %d", n_q > 1 ? "prefill" : "decode", n_q,
                 n_q > 1 ? 0 : L);
        printf("  %-22s %10.3f ms  %6.1f GFLOP/s  (causal, F16 KV, contiguous)\n", name, t * 1e3,
               4.0 * n_heads * hd * scores / t * 1e-9);
        free(kc);
        free(vc);
        free(q);
        free(out);
    }
}

/* ---------------------------------------------------------------- (d) rope shift */

typedef struct copy_ctx {
    unsigned char **dst, **src;
    size_t bytes;
} copy_ctx;

static void copy_task(void *ctx, int task, int tid) {
    (void)tid;
    copy_ctx *c = ctx;
    memcpy(c->dst[task], c->src[task], c->bytes);
}

static void bench_shift(rk_backend *be) {
    const int n_tok = 4096, n_layers = 28, n_kv = 8, hd = 128, bs = 16;
    const size_t row_bytes = (size_t)n_kv * hd * 4;
    int n_blocks = 2 * n_tok / bs;
    size_t layer_bytes = (size_t)n_blocks * bs * row_bytes;
    void **kl = xmalloc(n_layers * sizeof(void *)), **vl = xmalloc(n_layers * sizeof(void *));
    for (int l = 0; l < n_layers; l++) {
        kl[l] = be_alloc(be, layer_bytes);
        vl[l] = be_alloc(be, layer_bytes);
        float *k = kl[l], *v = vl[l];
        for (size_t i = 0; i < layer_bytes / 4; i++) k[i] = v[i] = (float)(i % 977) * 1e-3f;
    }
    rk_kv_cache kv = {n_layers, n_blocks, bs, n_kv, hd, RK_DTYPE_F32, kl, vl};
    int32_t *src = xmalloc(n_tok * 4), *dst = xmalloc(n_tok * 4), *delta = xmalloc(n_tok * 4);
    for (int i = 0; i < n_tok; i++) {
        src[i] = i;
        dst[i] = n_tok + i;
        delta[i] = 1000 + i;
    }
    rk_rope_params rp = {.n_rot = 128, .theta = 1000000.0f, .pairing = RK_ROPE_NEOX};
    rk_rope rope;
    check(rk_rope_init(&rope, &rp), "rope_init");
    const rk_rope *ropes[28];
    for (int l = 0; l < n_layers; l++) ropes[l] = &rope;
    double bytes = 2.0 * n_tok * n_layers * row_bytes; /* K + V read (and as much written) */
    double t;
    printf("\n(d) rope_shift_copy, 4096 tokens x 28 layers x (8 x 128), F32, K + V = %.0f MB\n",
           bytes / 1e6);
    TIME_BEST(
        3, t,
        check(be->ops->rope_shift_copy(be, &kv, src, dst, delta, n_tok, ropes), "rope_shift_copy"));
    double t_shift = t;
    /* the same bytes as one memcpy per layer and tensor (contiguous runs) */
    size_t run = (size_t)n_tok * row_bytes;
    TIME_BEST(
        3, t, for (int l = 0; l < n_layers; l++) {
            memcpy((unsigned char *)kl[l] + run, kl[l], run);
            memcpy((unsigned char *)vl[l] + run, vl[l], run);
        });
    double t_copy1 = t;
    unsigned char **ds = xmalloc(2 * n_layers * sizeof(void *)),
                  **ss = xmalloc(2 * n_layers * sizeof(void *));
    for (int l = 0; l < n_layers; l++) {
        ss[2 * l] = kl[l];
        ds[2 * l] = (unsigned char *)kl[l] + run;
        ss[2 * l + 1] = vl[l];
        ds[2 * l + 1] = (unsigned char *)vl[l] + run;
    }
    copy_ctx cc = {ds, ss, run};
    rk_cpu *cpu = be->impl;
    TIME_BEST(3, t, rk_threadpool_run(cpu->pool, 2 * n_layers, copy_task, &cc));
    double t_copyn = t;
    printf("  %-36s %10s %10s %10s\n", "", "ms", "GB/s", "vs copy");
    printf("  %-36s %10.1f %10.2f %10s\n", "memcpy, 1 thread", t_copy1 * 1e3,
           bytes / t_copy1 * 1e-9, "");
    printf("  %-36s %10.1f %10.2f %10s\n", "memcpy, pool threads", t_copyn * 1e3,
           bytes / t_copyn * 1e-9, "");
    printf("  %-36s %10.1f %10.2f %9.0f%% / %.0f%%\n", "rope_shift_copy", t_shift * 1e3,
           bytes / t_shift * 1e-9, 100.0 * t_copy1 / t_shift, 100.0 * t_copyn / t_shift);
    printf("  (GB/s counts bytes copied; the last column is vs 1-thread / pool memcpy)\n");
    for (int l = 0; l < n_layers; l++) {
        be->ops->free(be, kl[l]);
        be->ops->free(be, vl[l]);
    }
    free(kl);
    free(vl);
    free(src);
    free(dst);
    free(delta);
    free(ds);
    free(ss);
}

/* ---------------------------------------------------------------- (e) shifted runs */

static void bench_segments(rk_backend *be) {
    const int n_heads = 16, n_kv = 8, hd = 128, bs = 16, n_runs = 8;
    const int lens[8] = {509, 515, 480, 530, 512, 498, 540, 512}; /* 4096 entries */
    const size_t row = (size_t)n_kv * hd;
    printf("\n(e) attention over 4096 entries, 16 heads / 8 KV heads, head_dim 128, F32 KV,\n"
           "  block size 16, random block tables. one run: no segments; 8 runs: the same\n"
           "  entries as 8 runs each from a block of its own, delta 0 or 7 shifted (the\n"
           "  queries rotated per run); ratio = 8 runs / one run\n");
    rk_rope rope;
    rk_rope_params rp = {.n_rot = hd, .theta = 1e6f, .pairing = RK_ROPE_NEOX};
    check(rk_rope_init(&rope, &rp), "rope_init");
    int L = 0, nb_runs = 0;
    int32_t seg_start[2] = {0, n_runs}, seg_end[8], seg_delta[8], seg_zero[8] = {0};
    for (int r = 0; r < n_runs; r++) {
        L += lens[r];
        nb_runs += (lens[r] + bs - 1) / bs;
        seg_end[r] = L;
        seg_delta[r] = r == n_runs - 1 ? 0 : 1000 - 300 * r; /* +1000 .. -800, then 0 */
    }
    int nb_one = (L + bs - 1) / bs, n_blocks = nb_one + nb_runs;
    float *kp = be_rand_f32(be, (size_t)n_blocks * bs * row),
          *vp = be_rand_f32(be, (size_t)n_blocks * bs * row);
    int32_t *perm = shuffled(n_blocks);
    void *kl[1] = {kp}, *vl[1] = {vp};
    rk_kv_cache kv = {1, n_blocks, bs, n_kv, hd, RK_DTYPE_F32, kl, vl};
    rk_attn_params ap = {.scale = 1.0f / sqrtf((float)hd)};
    printf("  %-32s %10s %8s\n", "", "best ms", "ratio");
    for (int n_q = 1; n_q <= 512; n_q += 511) { /* decode, then a 512-query prefill */
        float *q = rand_f32((size_t)n_q * n_heads * hd),
              *out = rand_f32((size_t)n_q * n_heads * hd);
        int32_t qs[2] = {0, n_q}, len = L;
        rk_attn_batch one = {
            .n_seqs = 1, .q_start = qs, .kv_len = &len, .block_table = perm, .max_blocks = nb_one};
        rk_attn_batch runs = one, runs0;
        runs.block_table = perm + nb_one;
        runs.max_blocks = nb_runs;
        runs.seg_start = seg_start;
        runs.seg_end = seg_end;
        runs.seg_delta = seg_delta;
        runs.rope = &rope;
        runs0 = runs;
        runs0.seg_delta = seg_zero;
        /* alternate single calls and keep each one's best, so drift and noise
         * from other processes hit them alike */
        double t_one = 1e30, t_runs = 1e30, t_runs0 = 1e30;
        int rounds = n_q > 1 ? 4 : 300;
        for (int round = 0; round <= rounds; round++) {
            double t0 = rk_time_now();
            check(be->ops->attention(be, out, NULL, q, &kv, 0, &one, n_heads, &ap), "attention");
            double t1 = rk_time_now();
            check(be->ops->attention(be, out, NULL, q, &kv, 0, &runs, n_heads, &ap), "attention");
            double t2 = rk_time_now();
            check(be->ops->attention(be, out, NULL, q, &kv, 0, &runs0, n_heads, &ap), "attention");
            double t3 = rk_time_now();
            if (round == 0) continue; /* warm-up */
            if (t1 - t0 < t_one) t_one = t1 - t0;
            if (t2 - t1 < t_runs) t_runs = t2 - t1;
            if (t3 - t2 < t_runs0) t_runs0 = t3 - t2;
        }
        const char *what = n_q > 1 ? "prefill 512 q" : "decode";
        char name[64];
        snprintf(name, sizeof name, "%s, one run", what);
        printf("  %-32s %10.3f %8s\n", name, t_one * 1e3, "");
        snprintf(name, sizeof name, "%s, 8 runs, delta 0", what);
        printf("  %-32s %10.3f %8.3f\n", name, t_runs0 * 1e3, t_runs0 / t_one);
        snprintf(name, sizeof name, "%s, 8 runs, 7 shifted", what);
        printf("  %-32s %10.3f %8.3f\n", name, t_runs * 1e3, t_runs / t_one);
        free(q);
        free(out);
    }
    be->ops->free(be, kp);
    be->ops->free(be, vp);
    free(perm);
}

/* ---------------------------------------------------------------- (f) quantized */

/* Decode (n = 1) seconds of y = x . w^T for w(m, k) as stored and, where the
 * backend packs type t, packed (-1 when not). */
static void time_decode(rk_backend *be, const void *wq, rk_dtype t, const float *x, float *y, int k,
                        int m, int reps, double *stored, double *packed) {
    TIME_BEST(reps, *stored, check(be->ops->matmul(be, y, x, wq, t, 1, k, m), "matmul"));
    *packed = -1;
    size_t pb = be->ops->packed_bytes(be, t, k, m);
    if (!pb) return;
    void *p = be_alloc(be, pb);
    check(be->ops->pack(be, p, wq, t, k, m), "pack");
    TIME_BEST(reps, *packed, check(be->ops->matmul_packed(be, y, x, p, t, 1, k, m), "matmul"));
    be->ops->free(be, p);
}

static void print_gbs(double bytes, double seconds) {
    if (seconds > 0)
        printf(" %6.1f", bytes / seconds * 1e-9);
    else
        printf(" %6s", "-");
}

static void bench_quant(rk_backend *be) {
    int k = 1024, m = 3072, n_max = 512, m_big = 151936;
    static const rk_dtype types[] = {RK_DTYPE_Q8_0, RK_DTYPE_Q4_0, RK_DTYPE_Q3_K, RK_DTYPE_Q4_K,
                                     RK_DTYPE_Q5_K, RK_DTYPE_Q6_K, RK_DTYPE_BF16};
    static const rk_cpu_isa isas[] = {RK_CPU_ISA_PORTABLE, RK_CPU_ISA_AVX2, RK_CPU_ISA_AVX512_VNNI};
    float *w = rand_f32((size_t)m * k), *x = rand_f32((size_t)n_max * k);
    float *y = rand_f32((size_t)n_max * m_big);
    printf("\n(f) quantized weights, y(n,3072) = x(n,1024) . w(3072,1024)^T\n");
    printf("  decode (n = 1), GB/s of weights per instruction set and packed (AVX-512 VNNI);\n"
           "  the same from memory (w 151936 x 1024, the qwen3 output matrix), as stored and "
           "packed;\n  matmul at n = 32, 128, 512 in GMAC/s\n");
    printf("  %-6s %7s %6s %6s %6s %6s | %6s %6s | %7s %7s %7s\n", "type", "bytes/w", "C", "AVX2",
           "VNNI", "packed", "mem", "packed", "n=32", "n=128", "n=512");
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        rk_dtype t = types[ti];
        size_t row = rk_dtype_row_bytes(t, (size_t)k), bytes = row * (size_t)m;
        void *wq = be_alloc(be, bytes);
        rk_quantize(wq, w, t, (size_t)m * k);
        printf("  %-6s %7.4f", rk_dtype_name(t), (double)bytes / ((double)m * k));
        for (size_t a = 0; a < sizeof isas / sizeof isas[0]; a++) {
            double tt;
            if (!rk_dtype_is_quant(t) || rk_cpu_force_isa(isas[a]) != RK_OK) {
                printf(" %6s", "-");
                continue;
            }
            TIME_BEST(20, tt, check(be->ops->matmul(be, y, x, wq, t, 1, k, m), "matmul"));
            printf(" %6.1f", (double)bytes / tt * 1e-9);
        }
        check(rk_cpu_force_isa(RK_CPU_ISA_AUTO), "force_isa");
        double ts, tp;
        if (rk_dtype_is_quant(t)) {
            time_decode(be, wq, t, x, y, k, m, 20, &ts, &tp);
            print_gbs((double)bytes, tp);
            /* the big matrix: the small one's rows over and over */
            size_t big = row * (size_t)m_big;
            unsigned char *wb = be_alloc(be, big);
            for (size_t off = 0; off < big; off += bytes)
                memcpy(wb + off, wq, big - off < bytes ? big - off : bytes);
            time_decode(be, wb, t, x, y, k, m_big, 5, &ts, &tp);
            printf(" |");
            print_gbs((double)big, ts);
            print_gbs((double)big, tp);
            be->ops->free(be, wb);
        } else {
            printf(" %6s | %6s %6s", "-", "-", "-");
        }
        printf(" |");
        static const int ns[] = {32, 128, 512};
        for (int ni = 0; ni < 3; ni++) {
            double tt;
            TIME_BEST(3, tt, check(be->ops->matmul(be, y, x, wq, t, ns[ni], k, m), "matmul"));
            printf(" %7.1f", (double)ns[ni] * k * m / tt * 1e-9);
        }
        printf("\n");
        be->ops->free(be, wq);
    }
    free(w);
    free(x);
    free(y);
}

typedef struct opts {
    int n_threads;
    char only[8];
} opts;

static const rk_setting k_settings[] = {
    {"threads", "threads", RK_SET_INT, offsetof(opts, n_threads), 0, 0, 1024, 0, 0,
     "N  backend threads (default: 2; 0 = one per core)"},
    {"only", "only", RK_SET_STR, offsetof(opts, only), sizeof(((opts *)0)->only), 0, 0, 0, 0,
     "SECTIONS  the sections to run, letters from abcdef (default: all)"},
};

int main(int argc, char **argv) {
    static const char *usage =
        "usage: bench_kernels [--threads N] [--only SECTIONS]\n"
        "Throughput of the CPU backend's hot ops: (a) GEMM, (b) bandwidth and the decode\n"
        "matvec, (c) paged attention, (d) rope shift, (e) position-shifted segments,\n"
        "(f) quantized weights.\n";
    opts o = {.n_threads = 2, .only = "abcdef"};
    rk_settings own = {k_settings, sizeof k_settings / sizeof k_settings[0], &o};
    int exit_code;
    if (rk_bench_parse("bench_kernels", usage, NULL, 0, &own, argc, argv, &exit_code))
        return exit_code;
    if (!o.only[0] || strspn(o.only, "abcdef") != strlen(o.only)) {
        fprintf(stderr, "bench_kernels: --only takes letters from abcdef, got '%s'\n", o.only);
        return 2;
    }
    int n_threads = o.n_threads;
    const char *only = o.only;
    rk_backend *be = NULL;
    check(rk_backend_create("cpu", n_threads, &be), "backend_create");
    printf("bench_kernels: CPU backend, %d threads\n", be->n_threads);
    if (strchr(only, 'a')) bench_gemm(be);
    if (strchr(only, 'b')) bench_bandwidth(be);
    if (strchr(only, 'c')) {
        bench_attention(be);
        bench_f16_attention(be);
    }
    if (strchr(only, 'd')) bench_shift(be);
    if (strchr(only, 'e')) bench_segments(be);
    if (strchr(only, 'f')) bench_quant(be);
    rk_backend_free(be);
    return 0;
}
