/* tests/test_kernels.c — the CPU backend, the reference every other backend is
 * compared with: conversions, the thread pool, matmul (both paths) against a
 * double-precision reference, the element-wise ops, RoPE tables against the
 * published formulas, paged attention (bit-identical to the contiguous
 * kernel, close to a double reference, independent of thread count),
 * kv_write and rope_shift_copy. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "tests/testutil.h"

/* The same RoPE for each layer of a cache of at most 8, as rope_shift_copy
 * takes them. */
#define LAYERS(r) ((const rk_rope *const[]){r, r, r, r, r, r, r, r})

/* ---------------------------------------------------------------- helpers */

/* The suite's random numbers: one stream from a fixed seed. */
static rk_test_rng rng = {0x9e3779b97f4a7c15ull};

static rk_backend *make_backend(int n_threads) {
    rk_backend *be = NULL;
    cr_assert_eq(rk_backend_create("cpu", n_threads, &be), RK_OK, "%s", rk_error_message());
    cr_assert_eq(be->n_threads, n_threads);
    return be;
}

/* Value of element i of a dtype array as f32. */
static float elem_f32(const void *p, rk_dtype t, size_t i) {
    switch (t) {
    case RK_DTYPE_F32: return ((const float *)p)[i];
    case RK_DTYPE_F16: return rk_f16_to_f32(((const uint16_t *)p)[i]);
    case RK_DTYPE_BF16: return rk_bf16_to_f32(((const uint16_t *)p)[i]);
    case RK_DTYPE_Q8_0: { /* KV: blocks of an f16 scale and 32 int8 */
        const unsigned char *b = (const unsigned char *)p + i / 32 * 34;
        return rk_f16_to_f32((uint16_t)(b[0] | b[1] << 8)) * (float)(int8_t)b[2 + i % 32];
    }
    default: return NAN; /* other quantized types are tested in test_quant.c */
    }
}

/* f rounded to dtype t and back. */
static float round_to(float f, rk_dtype t) {
    switch (t) {
    case RK_DTYPE_F32: return f;
    case RK_DTYPE_F16: return rk_f16_to_f32(rk_f32_to_f16(f));
    case RK_DTYPE_BF16: return rk_bf16_to_f32(rk_f32_to_bf16(f));
    default: return NAN; /* quantized types are tested in test_quant.c */
    }
}

/* A dtype copy of an f32 array (malloc'ed). */
static void *to_dtype(const float *src, size_t n, rk_dtype t) {
    void *p = malloc(rk_dtype_row_bytes(t, n) + 1);
    cr_assert(p);
    rk_cpu_from_f32(p, src, t, n);
    return p;
}

/* ---------------------------------------------------------------- conversions */

Test(convert, f16_rounds_to_nearest_even_at_the_edges) {
    cr_assert_eq(rk_f32_to_f16(1.0f), 0x3c00);
    cr_assert_eq(rk_f32_to_f16(-2.0f), 0xc000);
    cr_assert_eq(rk_f32_to_f16(0.1f), 0x2e66);
    cr_assert_eq(rk_f32_to_f16(65504.0f), 0x7bff);
    cr_assert_eq(rk_f32_to_f16(65519.0f), 0x7bff);
    cr_assert_eq(rk_f32_to_f16(65520.0f), 0x7c00); /* the tie rounds to even: inf */
    cr_assert_eq(rk_f32_to_f16(1e9f), 0x7c00);
    cr_assert_eq(rk_f32_to_f16(-INFINITY), 0xfc00);
    cr_assert_eq(rk_f32_to_f16(0x1p-24f), 0x0001);        /* smallest subnormal */
    cr_assert_eq(rk_f32_to_f16(0x1p-25f), 0x0000);        /* tie between 0 and 2^-24: even */
    cr_assert_eq(rk_f32_to_f16(0x1.8p-25f), 0x0001);      /* above the tie */
    cr_assert_eq(rk_f32_to_f16(0x1.8p-24f), 0x0002);      /* 1.5 ulp ties to even 2 */
    cr_assert_eq(rk_f32_to_f16(0x1.ffcp-15f), 0x0400);    /* rounds up into the normals */
    cr_assert_eq(rk_f32_to_f16(1.0f + 0x1p-11f), 0x3c00); /* tie at 1 + half ulp: even */
    cr_assert_eq(rk_f32_to_f16(1.0f + 0x1.8p-10f), 0x3c02);
    uint16_t nan = rk_f32_to_f16(NAN);
    cr_assert_eq(nan & 0x7c00, 0x7c00);
    cr_assert_neq(nan & 0x03ff, 0);
}

Test(convert, every_f16_value_round_trips_through_f32) {
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = rk_f16_to_f32((uint16_t)h);
        if (f != f) continue;
        cr_assert_eq(rk_f32_to_f16(f), h, "f16 0x%04x -> %g -> 0x%04x", h, f, rk_f32_to_f16(f));
    }
    cr_assert_eq(rk_f16_to_f32(0x3c00), 1.0f);
    cr_assert_eq(rk_f16_to_f32(0x0001), 0x1p-24f);
    cr_assert_eq(rk_f16_to_f32(0x7bff), 65504.0f);
}

Test(convert, bf16_rounds_to_nearest_even) {
    cr_assert_eq(rk_f32_to_bf16(1.0f), 0x3f80);
    cr_assert_eq(rk_f32_to_bf16(-1.0f), 0xbf80);
    uint32_t bits = 0x3f808000; /* exactly between 0x3f80 and 0x3f81: even */
    float f;
    memcpy(&f, &bits, 4);
    cr_assert_eq(rk_f32_to_bf16(f), 0x3f80);
    bits = 0x3f818000; /* between 0x3f81 and 0x3f82: even */
    memcpy(&f, &bits, 4);
    cr_assert_eq(rk_f32_to_bf16(f), 0x3f82);
    bits = 0x3f808001;
    memcpy(&f, &bits, 4);
    cr_assert_eq(rk_f32_to_bf16(f), 0x3f81);
    cr_assert_eq(rk_f32_to_bf16(INFINITY), 0x7f80);
    uint16_t nan = rk_f32_to_bf16(NAN);
    cr_assert(rk_bf16_to_f32(nan) != rk_bf16_to_f32(nan));
    cr_assert_eq(rk_bf16_to_f32(0x4049), 3.140625f);
}

Test(convert, vector_conversions_match_the_scalar_ones) {
    size_t n = 1003;
    float *x = malloc(n * sizeof(float));
    cr_assert(x);
    for (size_t i = 0; i < n; i++) {
        float mag = powf(2.0f, rk_test_frand(&rng, -30.0f, 18.0f));
        x[i] = (i % 2 ? -1.0f : 1.0f) * mag;
    }
    x[0] = 0.0f;
    x[1] = -0.0f;
    x[2] = INFINITY;
    x[3] = 65520.0f;
    uint16_t *h = malloc(n * 2), *b = malloc(n * 2);
    float *back = malloc(n * sizeof(float));
    cr_assert(h && b && back);
    rk_cpu_from_f32(h, x, RK_DTYPE_F16, n);
    rk_cpu_from_f32(b, x, RK_DTYPE_BF16, n);
    for (size_t i = 0; i < n; i++) {
        cr_assert_eq(h[i], rk_f32_to_f16(x[i]), "f16 at %zu (%g)", i, x[i]);
        cr_assert_eq(b[i], rk_f32_to_bf16(x[i]), "bf16 at %zu (%g)", i, x[i]);
    }
    rk_cpu_to_f32(back, h, RK_DTYPE_F16, n);
    for (size_t i = 0; i < n; i++) cr_assert_eq(back[i], rk_f16_to_f32(h[i]));
    rk_cpu_to_f32(back, b, RK_DTYPE_BF16, n);
    for (size_t i = 0; i < n; i++) cr_assert_eq(back[i], rk_bf16_to_f32(b[i]));
    free(x);
    free(h);
    free(b);
    free(back);
}

Test(convert, dtype_sizes_and_names) {
    cr_assert_eq(rk_dtype_size(RK_DTYPE_F32), 4);
    cr_assert_eq(rk_dtype_size(RK_DTYPE_F16), 2);
    cr_assert_eq(rk_dtype_size(RK_DTYPE_BF16), 2);
    cr_assert_str_eq(rk_dtype_name(RK_DTYPE_BF16), "bf16");
    cr_assert_str_eq(rk_dtype_name(RK_DTYPE_F16), "f16");
}

Test(convert, vector_exp_is_accurate_and_handles_the_edges) {
    size_t n = 2001;
    float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
    cr_assert(x && y);
    for (size_t i = 0; i < n; i++) x[i] = -87.0f + 175.0f * (float)i / (float)(n - 1);
    rk_cpu_exp(y, x, n);
    for (size_t i = 0; i < n; i++) {
        double ref = exp((double)x[i]);
        cr_assert(fabs(y[i] - ref) <= 4e-7 * ref, "exp(%g) = %g, expected %g", x[i], y[i], ref);
    }
    float e[7] = {0.0f, -INFINITY, -100.0f, INFINITY, NAN, 1.0f, -1.0f}, r[7];
    rk_cpu_exp(r, e, 7);
    cr_assert_eq(r[0], 1.0f);
    cr_assert_eq(r[1], 0.0f);
    cr_assert_eq(r[2], 0.0f);
    cr_assert(isinf(r[3]) && r[3] > 0);
    cr_assert(isnan(r[4]));
    cr_assert_float_eq(r[5], 2.7182818f, 1e-6);
    cr_assert_float_eq(r[6], 0.36787944f, 1e-7);
    free(x);
    free(y);
}

/* ---------------------------------------------------------------- backends, pool */

Test(backend, creation_by_name) {
    rk_backend *be = NULL;
    cr_assert_eq(rk_backend_create("cpu", 3, &be), RK_OK);
    cr_assert_str_eq(be->name, "cpu");
    cr_assert_eq(be->n_threads, 3);
    rk_backend_free(be);
    cr_assert_eq(rk_backend_create("cpu", 0, &be), RK_OK);
    cr_assert_geq(be->n_threads, 1);
    rk_backend_free(be);
#ifndef RAGKV_CUDA
    be = (rk_backend *)1;
    cr_assert_eq(rk_backend_create("cuda", 1, &be), RK_ERR_UNSUPPORTED);
    cr_assert_null(be);
    cr_assert(strstr(rk_error_message(), "CUDA") != NULL);
#endif
    cr_assert_eq(rk_backend_create("tpu", 1, &be), RK_ERR_INVALID);
    rk_backend_free(NULL);
}

Test(backend, memory_ops_copy_and_fill) {
    rk_backend *be = make_backend(1);
    void *p = NULL;
    cr_assert_eq(be->ops->alloc(be, 100, &p), RK_OK);
    cr_assert_eq((uintptr_t)p % 64, 0);
    char src[100], dst[100];
    for (int i = 0; i < 100; i++) src[i] = (char)i;
    cr_assert_eq(be->ops->upload(be, p, src, 100), RK_OK);
    cr_assert_eq(be->ops->download(be, dst, p, 100), RK_OK);
    cr_assert_arr_eq(src, dst, 100);
    cr_assert_eq(be->ops->memset(be, p, 7, 100), RK_OK);
    cr_assert_eq(be->ops->download(be, dst, p, 100), RK_OK);
    for (int i = 0; i < 100; i++) cr_assert_eq(dst[i], 7);
    cr_assert_eq(be->ops->sync(be), RK_OK);
    be->ops->free(be, p);
    rk_backend_free(be);
}

typedef struct pool_probe {
    int *hits;
    int *owner;
} pool_probe;

static void probe_task(void *ctx, int task, int tid) {
    pool_probe *p = ctx;
    p->hits[task]++;
    p->owner[task] = tid;
}

Test(threadpool, runs_every_task_exactly_once) {
    for (int nt = 1; nt <= 4; nt++) {
        rk_threadpool *pool = NULL;
        cr_assert_eq(rk_threadpool_create(nt, &pool), RK_OK);
        cr_assert_eq(rk_threadpool_size(pool), nt);
        int hits[257], owner[257];
        pool_probe p = {hits, owner};
        for (int rep = 0; rep < 200; rep++) {
            int n = 1 + rep % 257;
            memset(hits, 0, sizeof hits);
            rk_threadpool_run(pool, n, probe_task, &p);
            for (int i = 0; i < n; i++) {
                cr_assert_eq(hits[i], 1, "threads %d rep %d task %d ran %d times", nt, rep, i,
                             hits[i]);
                cr_assert(owner[i] >= 0 && owner[i] < nt);
            }
            for (int i = n; i < 257; i++) cr_assert_eq(hits[i], 0);
        }
        rk_threadpool_run(pool, 0, probe_task, &p); /* no tasks: returns at once */
        rk_threadpool_free(pool);
    }
    rk_threadpool_free(NULL);
}

/* ---------------------------------------------------------------- matmul */

/* The double reference of y = x · w^T on the weights as stored. */
static void matmul_ref(double *y, double *abs_sum, const float *x, const void *w, rk_dtype t, int n,
                       int k, int m) {
    for (int i = 0; i < n; i++)
        for (int j = 0; j < m; j++) {
            double s = 0.0, a = 0.0;
            for (int l = 0; l < k; l++) {
                double p = (double)x[(size_t)i * k + l] * elem_f32(w, t, (size_t)j * k + l);
                s += p;
                a += fabs(p);
            }
            y[(size_t)i * m + j] = s;
            abs_sum[(size_t)i * m + j] = a;
        }
}

Test(matmul, both_paths_are_chosen_from_the_shape) {
    cr_assert_eq(rk_cpu_matmul_uses_blas(1, 1024, 3072, RK_DTYPE_F32), 0);
    cr_assert_eq(rk_cpu_matmul_uses_blas(3, 1024, 3072, RK_DTYPE_BF16), 0);
    cr_assert_eq(rk_cpu_matmul_uses_blas(17, 1024, 3072, RK_DTYPE_F16), 0);
    cr_assert_eq(rk_cpu_matmul_uses_blas(31, 1024, 3072, RK_DTYPE_F32), 0);
    cr_assert_eq(rk_cpu_matmul_uses_blas(32, 1024, 3072, RK_DTYPE_F32), 1);
    cr_assert_eq(rk_cpu_matmul_uses_blas(64, 67, 37, RK_DTYPE_F32), 1);
}

/* The activations matmul multiplies BF16 weights with: x itself, or x
 * rounded to BF16 where the AVX-512 BF16 kernels run (malloc'ed copy). */
static float *bf16_kernel_input(const float *x, size_t n) {
    float *r = malloc(n * sizeof(float) + 1);
    cr_assert(r);
    int rounds = rk_cpu_isa_active() == RK_CPU_ISA_AVX512_BF16;
    for (size_t i = 0; i < n; i++) r[i] = rounds ? round_to(x[i], RK_DTYPE_BF16) : x[i];
    return r;
}

Test(matmul, matches_a_double_reference_and_is_thread_count_independent) {
    rk_backend *bes[4] = {make_backend(1), make_backend(2), make_backend(3), make_backend(4)};
    const int ns[] = {1, 3, 17, 64};
    const int ks[] = {91, 1029}; /* 2 x 32 + 3 x 8 + 3 and 32 x 32 + 5 */
    const int ms[] = {37, 131};
    const rk_dtype ts[] = {RK_DTYPE_F32, RK_DTYPE_F16, RK_DTYPE_BF16};
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 2; b++)
            for (int c = 0; c < 2; c++)
                for (int d = 0; d < 3; d++) {
                    int n = ns[a], k = ks[b], m = ms[c];
                    rk_dtype t = ts[d];
                    float *x = rk_test_rand_floats(&rng, (size_t)n * k, -1.0f, 1.0f);
                    float *wf = rk_test_rand_floats(&rng, (size_t)m * k, -1.0f, 1.0f);
                    void *w = to_dtype(wf, (size_t)m * k, t);
                    double *ref = malloc((size_t)n * m * sizeof(double));
                    double *abs_sum = malloc((size_t)n * m * sizeof(double));
                    float *y[4];
                    cr_assert(ref && abs_sum);
                    float *xin = t == RK_DTYPE_BF16 ? bf16_kernel_input(x, (size_t)n * k) : x;
                    matmul_ref(ref, abs_sum, xin, w, t, n, k, m);
                    if (xin != x) free(xin);
                    for (int e = 0; e < 4; e++) {
                        y[e] = malloc((size_t)n * m * sizeof(float));
                        cr_assert(y[e]);
                        cr_assert_eq(bes[e]->ops->matmul(bes[e], y[e], x, w, t, n, k, m), RK_OK);
                    }
                    for (size_t i = 0; i < (size_t)n * m; i++) {
                        double err = fabs(y[0][i] - ref[i]);
                        cr_assert(err <= 1e-5 * abs_sum[i] + 1e-30,
                                  "n=%d k=%d m=%d %s: y[%zu]=%.9g ref=%.9g", n, k, m,
                                  rk_dtype_name(t), i, y[0][i], ref[i]);
                    }
                    cr_assert_arr_eq(y[0], y[1], (size_t)n * m * sizeof(float),
                                     "n=%d k=%d m=%d %s: 1 vs 2 threads differ", n, k, m,
                                     rk_dtype_name(t));
                    cr_assert_arr_eq(y[0], y[2], (size_t)n * m * sizeof(float),
                                     "n=%d k=%d m=%d %s: 1 vs 3 threads differ", n, k, m,
                                     rk_dtype_name(t));
                    cr_assert_arr_eq(y[0], y[3], (size_t)n * m * sizeof(float),
                                     "n=%d k=%d m=%d %s: 1 vs 4 threads differ", n, k, m,
                                     rk_dtype_name(t));
                    for (int e = 0; e < 4; e++) free(y[e]);
                    free(x);
                    free(wf);
                    free(w);
                    free(ref);
                    free(abs_sum);
                }
    for (int e = 0; e < 4; e++) rk_backend_free(bes[e]);
}

Test(matmul, matvec_rows_do_not_depend_on_n_or_on_each_other) {
    /* Row i of y from a 3-row call equals the same row computed alone. */
    rk_backend *be = make_backend(2);
    int k = 301, m = 45; /* 9 steps of 32, 1 of 8, a tail of 5 */
    for (int d = 0; d < 3; d++) {
        rk_dtype t = (rk_dtype)d;
        float *x = rk_test_rand_floats(&rng, 3 * (size_t)k, -1.0f, 1.0f);
        float *wf = rk_test_rand_floats(&rng, (size_t)m * k, -1.0f, 1.0f);
        void *w = to_dtype(wf, (size_t)m * k, t);
        float y3[3 * 45], y1[45];
        cr_assert_eq(be->ops->matmul(be, y3, x, w, t, 3, k, m), RK_OK);
        for (int i = 0; i < 3; i++) {
            cr_assert_eq(be->ops->matmul(be, y1, x + (size_t)i * k, w, t, 1, k, m), RK_OK);
            cr_assert_arr_eq(y1, y3 + i * m, sizeof y1);
        }
        free(x);
        free(wf);
        free(w);
    }
    rk_backend_free(be);
}

/* With AVX-512 BF16 the activations are rounded to BF16 (2^-8 relative at
 * most) and the products summed in f32: the result is within 1e-5 of the sum
 * of |x w| of the double product on the rounded x, and within 2^-8 of it
 * (plus that 1e-5) of the double product on x itself and of the f32 path.
 * Decode and prefill sizes of n, odd k, k below one 32-element step, and
 * columns that leave partial tiles. */
Test(matmul, bf16_kernels_round_the_activations_to_bf16) {
    if (rk_cpu_force_isa(RK_CPU_ISA_AVX512_BF16) != RK_OK)
        cr_skip_test("no AVX-512 BF16 in this build or CPU");
    rk_backend *be = make_backend(2);
    const int ns[] = {1, 2, 5, 31, 32, 33, 70};
    const int ks[] = {7, 30, 91, 1029, 1024};
    const int ms[] = {17, 64, 131};
    for (int a = 0; a < 7; a++)
        for (int b = 0; b < 5; b++)
            for (int c = 0; c < 3; c++) {
                int n = ns[a], k = ks[b], m = ms[c];
                size_t nk = (size_t)n * k, nm = (size_t)n * m;
                float *x = rk_test_rand_floats(&rng, nk, -1.0f, 1.0f);
                float *wf = rk_test_rand_floats(&rng, (size_t)m * k, -1.0f, 1.0f);
                void *w = to_dtype(wf, (size_t)m * k, RK_DTYPE_BF16);
                cr_assert_eq(rk_cpu_force_isa(RK_CPU_ISA_AVX512_BF16), RK_OK);
                float *xr = bf16_kernel_input(x, nk);
                double *ref = malloc(nm * sizeof(double)), *abs_sum = malloc(nm * sizeof(double));
                double *ref_r = malloc(nm * sizeof(double)), *abs_r = malloc(nm * sizeof(double));
                float *y = malloc(nm * sizeof(float)), *yf = malloc(nm * sizeof(float));
                cr_assert(ref && abs_sum && ref_r && abs_r && y && yf);
                matmul_ref(ref, abs_sum, x, w, RK_DTYPE_BF16, n, k, m);
                matmul_ref(ref_r, abs_r, xr, w, RK_DTYPE_BF16, n, k, m);
                cr_assert_eq(be->ops->matmul(be, y, x, w, RK_DTYPE_BF16, n, k, m), RK_OK);
                cr_assert_eq(rk_cpu_force_isa(RK_CPU_ISA_PORTABLE), RK_OK);
                cr_assert_eq(be->ops->matmul(be, yf, x, w, RK_DTYPE_BF16, n, k, m), RK_OK);
                for (size_t i = 0; i < nm; i++) {
                    cr_assert(fabs(y[i] - ref_r[i]) <= 1e-5 * abs_r[i] + 1e-30,
                              "n=%d k=%d m=%d: y[%zu]=%.9g, rounded-x ref %.9g", n, k, m, i, y[i],
                              ref_r[i]);
                    double bound = (0x1p-8 + 1e-5) * abs_sum[i] + 1e-30;
                    cr_assert(fabs(y[i] - ref[i]) <= bound, "n=%d k=%d m=%d: y[%zu]=%.9g ref=%.9g",
                              n, k, m, i, y[i], ref[i]);
                    cr_assert(fabs(y[i] - yf[i]) <= bound, "n=%d k=%d m=%d: y[%zu]=%.9g f32 %.9g",
                              n, k, m, i, y[i], yf[i]);
                }
                free(x);
                free(wf);
                free(w);
                free(xr);
                free(ref);
                free(abs_sum);
                free(ref_r);
                free(abs_r);
                free(y);
                free(yf);
            }
    cr_assert_eq(rk_cpu_force_isa(RK_CPU_ISA_AUTO), RK_OK);
    rk_backend_free(be);
}

/* The BF16 tile gives a row of x the same bits whatever the other rows are,
 * however many there are (one, as in decode, or a prefill's worth) and
 * wherever the row falls in a 6-row tile; weights packed once at load give
 * the same bits as weights packed per call. */
Test(matmul, bf16_rows_do_not_depend_on_n_and_packed_weights_match) {
    if (rk_cpu_force_isa(RK_CPU_ISA_AVX512_BF16) != RK_OK)
        cr_skip_test("no AVX-512 BF16 in this build or CPU");
    rk_backend *be = make_backend(2);
    const int n = 45, ks[] = {333, 1024, 7}, ms[] = {150, 64, 1};
    for (int s = 0; s < 3; s++) {
        int k = ks[s], m = ms[s];
        float *x = rk_test_rand_floats(&rng, (size_t)n * k, -1.0f, 1.0f);
        float *wf = rk_test_rand_floats(&rng, (size_t)m * k, -1.0f, 1.0f);
        void *w = to_dtype(wf, (size_t)m * k, RK_DTYPE_BF16);
        size_t bytes = be->ops->packed_bytes(be, RK_DTYPE_BF16, k, m);
        cr_assert_geq(bytes, (size_t)m * k * 2);
        void *packed;
        cr_assert_eq(be->ops->alloc(be, bytes, &packed), RK_OK);
        cr_assert_eq(be->ops->pack(be, packed, w, RK_DTYPE_BF16, k, m), RK_OK);
        float *ya = malloc((size_t)n * m * sizeof(float)),
              *yb = malloc((size_t)n * m * sizeof(float));
        cr_assert(ya && yb);
        cr_assert_eq(be->ops->matmul(be, ya, x, w, RK_DTYPE_BF16, n, k, m), RK_OK);
        cr_assert_eq(be->ops->matmul_packed(be, yb, x, packed, RK_DTYPE_BF16, n, k, m), RK_OK);
        cr_assert_arr_eq(ya, yb, (size_t)n * m * sizeof(float), "k=%d m=%d: packed differs", k, m);
        /* Sub-batches at every offset and size class: 1 (decode), 2, 5, 6, 13, 35. */
        const int subs[][2] = {{0, 1}, {44, 1}, {9, 2}, {3, 5}, {12, 6}, {1, 13}, {7, 35}};
        for (size_t b = 0; b < sizeof subs / sizeof subs[0]; b++) {
            int off = subs[b][0], n2 = subs[b][1];
            cr_assert_eq(be->ops->matmul_packed(be, yb, x + (size_t)off * k, packed, RK_DTYPE_BF16,
                                                n2, k, m),
                         RK_OK);
            cr_assert_arr_eq(ya + (size_t)off * m, yb, (size_t)n2 * m * sizeof(float),
                             "k=%d m=%d: rows %d..%d alone differ from the batch", k, m, off,
                             off + n2);
            cr_assert_eq(be->ops->matmul(be, yb, x + (size_t)off * k, w, RK_DTYPE_BF16, n2, k, m),
                         RK_OK);
            cr_assert_arr_eq(ya + (size_t)off * m, yb, (size_t)n2 * m * sizeof(float));
        }
        /* Rows from a panel's start are a packed weight of their own. */
        if (m > 64) {
            size_t off = be->ops->packed_offset(be, RK_DTYPE_BF16, k, 64);
            cr_assert_neq(off, SIZE_MAX);
            cr_assert_eq(be->ops->packed_offset(be, RK_DTYPE_BF16, k, 8), SIZE_MAX);
            cr_assert_eq(be->ops->matmul_packed(be, yb, x, (const char *)packed + off,
                                                RK_DTYPE_BF16, n, k, m - 64),
                         RK_OK);
            for (int i = 0; i < n; i++)
                cr_assert_arr_eq(ya + (size_t)i * m + 64, yb + (size_t)i * (m - 64),
                                 (size_t)(m - 64) * sizeof(float));
        }
        be->ops->free(be, packed);
        free(x);
        free(wf);
        free(w);
        free(ya);
        free(yb);
    }
    /* BF16 is packed for the tile, quantized types for their own kernels. */
    cr_assert_eq(be->ops->packed_bytes(be, RK_DTYPE_F32, 64, 64), 0);
    cr_assert_eq(be->ops->packed_bytes(be, RK_DTYPE_F16, 64, 64), 0);
    cr_assert_eq(rk_cpu_force_isa(RK_CPU_ISA_PORTABLE), RK_OK);
    cr_assert_eq(be->ops->packed_bytes(be, RK_DTYPE_BF16, 64, 64), 0, "packed without the kernels");
    cr_assert_eq(rk_cpu_force_isa(RK_CPU_ISA_AUTO), RK_OK);
    rk_backend_free(be);
}

/* Without the BF16 instructions (AVX-512 alone), BF16 weights on the
 * prefill side take a tile that widens them in registers and keeps x in
 * f32: within 1e-5 of the sum of |x w| of the double product, and a row's
 * bits do not depend on how many rows share the call (from BLAS_MIN_N on)
 * nor on the thread count. */
Test(matmul, bf16_tile_without_bf16_instructions_matches_the_reference) {
    if (rk_cpu_force_isa(RK_CPU_ISA_AVX512_VNNI) != RK_OK)
        cr_skip_test("no AVX-512 in this build or CPU");
    rk_backend *be2 = make_backend(2), *be3 = make_backend(3);
    const int ks[] = {91, 1024, 7}, ms[] = {131, 64, 1}, n = 70;
    for (int s = 0; s < 3; s++) {
        int k = ks[s], m = ms[s];
        float *x = rk_test_rand_floats(&rng, (size_t)n * k, -1.0f, 1.0f);
        float *wf = rk_test_rand_floats(&rng, (size_t)m * k, -1.0f, 1.0f);
        void *w = to_dtype(wf, (size_t)m * k, RK_DTYPE_BF16);
        double *ref = malloc((size_t)n * m * sizeof(double)),
               *abs_sum = malloc((size_t)n * m * sizeof(double));
        float *ya = malloc((size_t)n * m * sizeof(float)),
              *yb = malloc((size_t)n * m * sizeof(float));
        cr_assert(ref && abs_sum && ya && yb);
        matmul_ref(ref, abs_sum, x, w, RK_DTYPE_BF16, n, k, m);
        cr_assert_eq(be2->ops->matmul(be2, ya, x, w, RK_DTYPE_BF16, n, k, m), RK_OK);
        for (size_t i = 0; i < (size_t)n * m; i++)
            cr_assert(fabs(ya[i] - ref[i]) <= 1e-5 * abs_sum[i] + 1e-30,
                      "k=%d m=%d: y[%zu]=%.9g ref=%.9g", k, m, i, ya[i], ref[i]);
        cr_assert_eq(be3->ops->matmul(be3, yb, x, w, RK_DTYPE_BF16, n, k, m), RK_OK);
        cr_assert_arr_eq(ya, yb, (size_t)n * m * sizeof(float), "k=%d m=%d: 2 vs 3 threads", k, m);
        /* 33 rows from an offset that is no multiple of the 4-row tile */
        cr_assert_eq(be2->ops->matmul(be2, yb, x + 5 * (size_t)k, w, RK_DTYPE_BF16, 33, k, m),
                     RK_OK);
        cr_assert_arr_eq(ya + 5 * (size_t)m, yb, 33 * (size_t)m * sizeof(float),
                         "k=%d m=%d: rows 5..37 alone differ from the batch", k, m);
        free(x);
        free(wf);
        free(w);
        free(ref);
        free(abs_sum);
        free(ya);
        free(yb);
    }
    cr_assert_eq(rk_cpu_force_isa(RK_CPU_ISA_AUTO), RK_OK);
    rk_backend_free(be2);
    rk_backend_free(be3);
}

Test(matmul, degenerate_shapes) {
    rk_backend *be = make_backend(2);
    float x[6] = {1, 2, 3, 4, 5, 6}, w[6] = {1, 0, 0, 0, 1, 0}, y[4] = {9, 9, 9, 9};
    /* k = 0: the sum over nothing is 0 */
    cr_assert_eq(be->ops->matmul(be, y, x, w, RK_DTYPE_F32, 2, 0, 2), RK_OK);
    for (int i = 0; i < 4; i++) cr_assert_eq(y[i], 0.0f);
    cr_assert_eq(be->ops->matmul(be, y, x, w, RK_DTYPE_F32, 2, 3, 2), RK_OK);
    cr_assert_eq(y[0], 1.0f);
    cr_assert_eq(y[1], 2.0f);
    cr_assert_eq(y[2], 4.0f);
    cr_assert_eq(y[3], 5.0f);
    cr_assert_eq(be->ops->matmul(be, y, x, w, RK_DTYPE_F32, -1, 3, 2), RK_ERR_INVALID);
    rk_backend_free(be);
}

/* ---------------------------------------------------------------- element-wise ops */

Test(ops, rmsnorm_matches_a_double_reference_in_and_out_of_place) {
    rk_backend *be = make_backend(2);
    int rows = 5, dim = 37;
    float *x = rk_test_rand_floats(&rng, (size_t)rows * dim, -2.0f, 2.0f);
    float *w = rk_test_rand_floats(&rng, (size_t)dim, 0.5f, 1.5f);
    float *out = malloc((size_t)rows * dim * sizeof(float));
    float *inplace = malloc((size_t)rows * dim * sizeof(float));
    cr_assert(out && inplace);
    memcpy(inplace, x, (size_t)rows * dim * sizeof(float));
    cr_assert_eq(be->ops->rmsnorm(be, out, x, w, rows, dim, 1e-5f), RK_OK);
    cr_assert_eq(be->ops->rmsnorm(be, inplace, inplace, w, rows, dim, 1e-5f), RK_OK);
    cr_assert_arr_eq(out, inplace, (size_t)rows * dim * sizeof(float));
    for (int r = 0; r < rows; r++) {
        double ss = 0;
        for (int j = 0; j < dim; j++) ss += (double)x[r * dim + j] * x[r * dim + j];
        double inv = 1.0 / sqrt(ss / dim + 1e-5);
        for (int j = 0; j < dim; j++) {
            double ref = x[r * dim + j] * inv * w[j];
            cr_assert(fabs(out[r * dim + j] - ref) <= 1e-6 * fabs(ref) + 1e-7,
                      "row %d col %d: %g vs %g", r, j, out[r * dim + j], ref);
        }
    }
    /* a constant row of 3 with unit weights and eps 0 normalises to ones */
    float c[4] = {3, 3, 3, 3}, ones[4] = {1, 1, 1, 1}, o[4];
    cr_assert_eq(be->ops->rmsnorm(be, o, c, ones, 1, 4, 0.0f), RK_OK);
    for (int j = 0; j < 4; j++) cr_assert_float_eq(o[j], 1.0f, 1e-7);
    free(x);
    free(w);
    free(out);
    free(inplace);
    rk_backend_free(be);
}

Test(ops, swiglu_is_silu_of_gate_times_up) {
    rk_backend *be = make_backend(2);
    size_t n = 70001;
    float *g = rk_test_rand_floats(&rng, n, -20.0f, 20.0f),
          *u = rk_test_rand_floats(&rng, n, -2.0f, 2.0f);
    float *out = malloc(n * sizeof(float));
    cr_assert(out);
    g[0] = 0.0f;
    g[1] = -100.0f;
    g[2] = 100.0f;
    u[2] = 0.5f;
    cr_assert_eq(be->ops->swiglu(be, out, g, u, n), RK_OK);
    cr_assert_eq(out[0], 0.0f);
    cr_assert(fabsf(out[1]) < 1e-30f);
    cr_assert_eq(out[2], 50.0f);
    for (size_t i = 0; i < n; i++) {
        double ref = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
        cr_assert(fabs(out[i] - ref) <= 1e-6 * fabs(ref) + 1e-30, "at %zu: %g vs %g", i, out[i],
                  ref);
    }
    /* in place: out == gate */
    float *g2 = malloc(n * sizeof(float));
    cr_assert(g2);
    memcpy(g2, g, n * sizeof(float));
    cr_assert_eq(be->ops->swiglu(be, g2, g2, u, n), RK_OK);
    cr_assert_arr_eq(g2, out, n * sizeof(float));
    free(g);
    free(g2);
    free(u);
    free(out);
    rk_backend_free(be);
}

Test(ops, geglu_is_tanh_gelu_of_gate_times_up_and_scale_multiplies) {
    rk_backend *be = make_backend(2);
    size_t n = 70001;
    float *g = rk_test_rand_floats(&rng, n, -12.0f, 12.0f),
          *u = rk_test_rand_floats(&rng, n, -2.0f, 2.0f);
    float *out = malloc(n * sizeof(float)), *g2 = malloc(n * sizeof(float));
    cr_assert(out && g2);
    g[0] = 0.0f;
    g[1] = -100.0f;
    g[2] = 100.0f;
    u[2] = 0.5f;
    cr_assert_eq(be->ops->geglu(be, out, g, u, n), RK_OK);
    cr_assert_eq(out[0], 0.0f);
    cr_assert(fabsf(out[1]) < 1e-30f);
    cr_assert_eq(out[2], 50.0f);
    for (size_t i = 0; i < n; i++) {
        double x = g[i];
        double ref = 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))) * u[i];
        cr_assert(fabs(out[i] - ref) <= 1e-5 * fabs(ref) + 1e-6, "at %zu: %g vs %g", i, out[i],
                  ref);
    }
    memcpy(g2, g, n * sizeof(float));
    cr_assert_eq(be->ops->geglu(be, g2, g2, u, n), RK_OK); /* in place */
    cr_assert_arr_eq(g2, out, n * sizeof(float));
    memcpy(g2, g, n * sizeof(float));
    cr_assert_eq(be->ops->scale(be, g2, 0.25f, n), RK_OK);
    for (size_t i = 0; i < n; i++) cr_assert_eq(g2[i], g[i] * 0.25f);
    free(g);
    free(g2);
    free(u);
    free(out);
    rk_backend_free(be);
}

Test(ops, add_and_add_bias) {
    rk_backend *be = make_backend(2);
    size_t n = 100000;
    float *y = rk_test_rand_floats(&rng, n, -1, 1), *x = rk_test_rand_floats(&rng, n, -1, 1),
          *y0 = malloc(n * 4);
    cr_assert(y0);
    memcpy(y0, y, n * 4);
    cr_assert_eq(be->ops->add(be, y, x, n), RK_OK);
    for (size_t i = 0; i < n; i++) cr_assert_eq(y[i], y0[i] + x[i]);
    float yb[6] = {1, 2, 3, 4, 5, 6}, b[3] = {10, 20, 30};
    cr_assert_eq(be->ops->add_bias(be, yb, b, 2, 3), RK_OK);
    float expect[6] = {11, 22, 33, 14, 25, 36};
    cr_assert_arr_eq(yb, expect, sizeof yb);
    free(y);
    free(x);
    free(y0);
    rk_backend_free(be);
}

Test(ops, embed_gathers_rows_of_every_dtype) {
    rk_backend *be = make_backend(2);
    int vocab = 50, dim = 13;
    float *tf = rk_test_rand_floats(&rng, (size_t)vocab * dim, -1, 1);
    int32_t ids[5] = {49, 0, 7, 7, 23};
    float out[5 * 13];
    for (int d = 0; d < 3; d++) {
        rk_dtype t = (rk_dtype)d;
        void *table = to_dtype(tf, (size_t)vocab * dim, t);
        cr_assert_eq(be->ops->embed(be, out, table, t, ids, 5, dim), RK_OK);
        for (int i = 0; i < 5; i++)
            for (int j = 0; j < dim; j++)
                cr_assert_eq(out[i * dim + j], elem_f32(table, t, (size_t)ids[i] * dim + j));
        free(table);
    }
    int32_t bad = -1;
    cr_assert_eq(be->ops->embed(be, out, tf, RK_DTYPE_F32, &bad, 1, dim), RK_ERR_INVALID);
    free(tf);
    rk_backend_free(be);
}

Test(ops, argmax_picks_the_first_largest) {
    float a[6] = {-5, 3, 7, 7, -1, 2};
    cr_assert_eq(rk_argmax_f32(a, 6), 2);
    float b[3] = {-3, -2, -2};
    cr_assert_eq(rk_argmax_f32(b, 3), 1);
    float c[3] = {NAN, 1, 0};
    cr_assert_eq(rk_argmax_f32(c, 3), 1);
    cr_assert_eq(rk_argmax_f32(a, 1), 0);
    cr_assert_eq(rk_argmax_f32(a, 0), -1);
}

/* ---------------------------------------------------------------- rope */

static rk_rope plain_rope(int n_rot, float theta, rk_rope_pairing pairing) {
    rk_rope_params p = {.n_rot = n_rot, .theta = theta, .pairing = pairing};
    rk_rope r;
    cr_assert_eq(rk_rope_init(&r, &p), RK_OK);
    return r;
}

Test(rope, init_plain_frequencies) {
    rk_rope r = plain_rope(128, 10000.0f, RK_ROPE_NORMAL);
    cr_assert_eq(r.n_rot, 128);
    cr_assert_eq(r.mscale, 1.0f);
    cr_assert_eq(r.freq[0], 1.0f);
    cr_assert_float_eq(r.freq[1], 0.86596432f, 1e-7);
    for (int i = 0; i < 64; i++)
        cr_assert_eq(r.freq[i], (float)pow(10000.0, -2.0 * i / 128.0), "freq[%d]", i);
    rk_rope_params bad = {.n_rot = 7, .theta = 10000.0f};
    cr_assert_eq(rk_rope_init(&r, &bad), RK_ERR_INVALID);
    bad.n_rot = 2 * RK_ROPE_MAX_PAIRS + 2;
    cr_assert_eq(rk_rope_init(&r, &bad), RK_ERR_INVALID);
    bad.n_rot = 64;
    bad.theta = 0.0f;
    cr_assert_eq(rk_rope_init(&r, &bad), RK_ERR_INVALID);
}

Test(rope, check_accepts_a_fitting_shape_and_names_a_bad_one) {
    rk_rope r = plain_rope(64, 10000.0f, RK_ROPE_NEOX);
    cr_expect_eq(rk_rope_check(0, 1, 64, &r), RK_OK);
    cr_expect_eq(rk_rope_check(5, 8, 128, &r), RK_OK);
    cr_expect_eq(rk_rope_check(-1, 8, 64, &r), RK_ERR_INVALID);
    cr_expect_eq(rk_rope_check(5, 0, 64, &r), RK_ERR_INVALID);
    cr_expect_eq(rk_rope_check(5, 8, 32, &r), RK_ERR_INVALID);
    cr_expect(strstr(rk_error_message(), "n_rot 64 does not fit head_dim 32") != NULL, "%s",
              rk_error_message());
}

Test(rope, init_linear_divides_by_the_factor) {
    rk_rope_params p = {
        .n_rot = 64, .theta = 10000.0f, .scaling = RK_ROPE_SCALING_LINEAR, .factor = 4.0f};
    rk_rope r;
    cr_assert_eq(rk_rope_init(&r, &p), RK_OK);
    cr_assert_eq(r.mscale, 1.0f);
    for (int i = 0; i < 32; i++)
        cr_assert_eq(r.freq[i], (float)(pow(10000.0, -2.0 * i / 64.0) / 4.0));
}

Test(rope, init_llama3_follows_the_published_smoothing) {
    rk_rope_params p = {.n_rot = 128,
                        .theta = 500000.0f,
                        .scaling = RK_ROPE_SCALING_LLAMA3,
                        .factor = 8.0f,
                        .orig_ctx = 8192,
                        .low_freq_factor = 1.0f,
                        .high_freq_factor = 4.0f};
    rk_rope r;
    cr_assert_eq(rk_rope_init(&r, &p), RK_OK);
    cr_assert_eq(r.mscale, 1.0f);
    /* Meta's apply_scaling(): wavelen < 8192/4 keeps freq, wavelen > 8192/1 uses
     * freq/8, in between (1 - smooth) freq/8 + smooth freq with
     * smooth = (8192/wavelen - 1) / (4 - 1). */
    int n_kept = 0, n_scaled = 0, n_mixed = 0;
    for (int i = 0; i < 64; i++) {
        double f = 1.0 / pow(500000.0, (2.0 * i) / 128.0);
        double wl = 2.0 * 3.14159265358979323846 / f, expect;
        if (wl < 2048.0) {
            expect = f;
            n_kept++;
        } else if (wl > 8192.0) {
            expect = f / 8.0;
            n_scaled++;
        } else {
            double smooth = (8192.0 / wl - 1.0) / 3.0;
            expect = (1.0 - smooth) * f / 8.0 + smooth * f;
            n_mixed++;
        }
        cr_assert(fabs(r.freq[i] - expect) <= 1e-6 * expect, "freq[%d] %.9g vs %.9g", i, r.freq[i],
                  expect);
    }
    cr_assert(n_kept > 0 && n_scaled > 0 && n_mixed > 0, "%d %d %d", n_kept, n_scaled, n_mixed);
    cr_assert_eq(r.freq[0], 1.0f);
}

Test(rope, init_yarn_ramps_between_extrapolation_and_interpolation) {
    rk_rope_params p = {.n_rot = 128,
                        .theta = 1000000.0f,
                        .scaling = RK_ROPE_SCALING_YARN,
                        .factor = 4.0f,
                        .orig_ctx = 32768,
                        .beta_fast = 32.0f,
                        .beta_slow = 1.0f};
    rk_rope r;
    cr_assert_eq(rk_rope_init(&r, &p), RK_OK);
    cr_assert_float_eq(r.mscale, (float)(0.1 * log(4.0) + 1.0), 1e-7); /* 1.1386294 */
    /* find_correction_dim(rot) = dim ln(orig / (rot 2 pi)) / (2 ln base):
     * 23.597 for rot 32 (floor: 23) and 39.655 for rot 1 (ceil: 40). */
    double lo = floor(128.0 * log(32768.0 / (32.0 * 2.0 * M_PI)) / (2.0 * log(1e6)));
    double hi = ceil(128.0 * log(32768.0 / (1.0 * 2.0 * M_PI)) / (2.0 * log(1e6)));
    cr_assert_eq(lo, 23.0);
    cr_assert_eq(hi, 40.0);
    for (int i = 0; i < 64; i++) {
        double extrap = 1.0 / pow(1e6, 2.0 * i / 128.0), interp = extrap / 4.0;
        double ramp = (i - lo) / (hi - lo);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        double keep = 1.0 - ramp; /* share of the extrapolated frequency */
        double expect = interp * (1.0 - keep) + extrap * keep;
        cr_assert(fabs(r.freq[i] - expect) <= 1e-6 * expect, "freq[%d] %.9g vs %.9g", i, r.freq[i],
                  expect);
    }
    rk_rope plain = plain_rope(128, 1000000.0f, RK_ROPE_NORMAL);
    cr_assert_eq(r.freq[10], plain.freq[10]);     /* below the ramp: unchanged */
    cr_assert_eq(r.freq[50], plain.freq[50] / 4); /* above: interpolated */
}

/* The reference rotation: angle (float)pos * freq in fp32 (the definition),
 * cos/sin in double, times mscale. */
static void rope_ref(double *out, const float *x, int pos, int head_dim, const rk_rope *r) {
    for (int d = 0; d < head_dim; d++) out[d] = x[d];
    int half = r->n_rot / 2;
    for (int i = 0; i < half; i++) {
        float a = (float)pos * r->freq[i];
        double c = cos((double)a) * r->mscale, s = sin((double)a) * r->mscale;
        int i0 = r->pairing == RK_ROPE_NEOX ? i : 2 * i;
        int i1 = r->pairing == RK_ROPE_NEOX ? i + half : 2 * i + 1;
        out[i0] = x[i0] * c - x[i1] * s;
        out[i1] = x[i0] * s + x[i1] * c;
    }
}

Test(rope, rotates_both_pairings_like_the_reference_up_to_1e6) {
    rk_backend *be = make_backend(2);
    int32_t pos[7] = {0, 1, 7, 1000, 65535, 524287, 1000000};
    int n_heads = 3, hd = 64;
    for (int pr = 0; pr < 2; pr++)
        for (int part = 0; part < 2; part++) {
            rk_rope_params p = {.n_rot = part ? 32 : 64,
                                .theta = 10000.0f,
                                .pairing = (rk_rope_pairing)pr,
                                .scaling = part ? RK_ROPE_SCALING_YARN : RK_ROPE_SCALING_NONE,
                                .factor = 4.0f,
                                .orig_ctx = 4096};
            rk_rope r;
            cr_assert_eq(rk_rope_init(&r, &p), RK_OK);
            size_t n = 7 * (size_t)n_heads * hd;
            float *x = rk_test_rand_floats(&rng, n, -1, 1), *y = malloc(n * sizeof(float));
            cr_assert(y);
            memcpy(y, x, n * sizeof(float));
            cr_assert_eq(be->ops->rope(be, y, pos, 7, n_heads, hd, &r), RK_OK);
            double ref[64];
            for (int t = 0; t < 7; t++)
                for (int h = 0; h < n_heads; h++) {
                    size_t o = ((size_t)t * n_heads + h) * hd;
                    rope_ref(ref, x + o, pos[t], hd, &r);
                    for (int d = 0; d < hd; d++) {
                        cr_assert(fabs(y[o + d] - ref[d]) <= 1e-6 * 2,
                                  "pairing %d pos %d dim %d: %.9g vs %.9g", pr, pos[t], d, y[o + d],
                                  ref[d]);
                        if (d >= r.n_rot) cr_assert_eq(y[o + d], x[o + d]); /* untouched */
                    }
                }
            free(x);
            free(y);
        }
    rk_backend_free(be);
}

Test(rope, neox_pairs_i_with_i_plus_half) {
    rk_backend *be = make_backend(1);
    rk_rope r = plain_rope(8, 10000.0f, RK_ROPE_NEOX);
    float x[8] = {1, 0, 0, 0, 0, 0, 0, 0};
    int32_t pos = 1;
    cr_assert_eq(be->ops->rope(be, x, &pos, 1, 1, 8, &r), RK_OK);
    /* pair 0 is (x[0], x[4]) with freq 1: (cos 1, sin 1) */
    cr_assert_float_eq(x[0], 0.54030231f, 1e-7);
    cr_assert_float_eq(x[4], 0.84147098f, 1e-7);
    cr_assert_eq(x[1], 0.0f);
    rk_rope rn = plain_rope(8, 10000.0f, RK_ROPE_NORMAL);
    float z[8] = {1, 0, 0, 0, 0, 0, 0, 0};
    cr_assert_eq(be->ops->rope(be, z, &pos, 1, 1, 8, &rn), RK_OK);
    /* pair 0 is (x[0], x[1]) */
    cr_assert_float_eq(z[0], 0.54030231f, 1e-7);
    cr_assert_float_eq(z[1], 0.84147098f, 1e-7);
    cr_assert_eq(z[4], 0.0f);
    r.n_rot = 10; /* wider than the head */
    cr_assert_eq(be->ops->rope(be, x, &pos, 1, 1, 8, &r), RK_ERR_INVALID);
    rk_backend_free(be);
}

/* ---------------------------------------------------------------- paged KV fixture */

typedef struct seq_spec {
    int n_q, kv_len;
} seq_spec;

/* A paged cache of 2 layers (layer 1 holds the data, layer 0 stays poisoned),
 * random non-monotone block tables, the same K/V as contiguous arrays, and
 * random queries. The cache starts filled with 0xff bytes (NaN in every
 * dtype), so reading an unwritten slot shows up as NaN in the output. */
typedef struct fixture {
    int n_seqs, n_kv_heads, head_dim, n_heads, block_size, max_blocks, total_q;
    rk_dtype dtype;
    rk_kv_cache kv;
    void *kbuf[2], *vbuf[2];
    int32_t *table, *q_start, *kv_len;
    float *q;         // (total_q, n_heads, head_dim)
    float **kf, **vf; // [seq] -> (kv_len, n_kv_heads, head_dim) unrounded f32
    void **ck, **cv;  // [seq] -> the same in dtype (contiguous cache)
    int window;       // sliding window (0: none), set after fixture_build
    float softcap;    // soft-capping of the scores (0: none)
} fixture;

static void fixture_build(fixture *f, rk_backend *be, const seq_spec *specs, int n_seqs,
                          int n_kv_heads, int group, int head_dim, int block_size, rk_dtype dtype) {
    memset(f, 0, sizeof *f);
    f->n_seqs = n_seqs;
    f->n_kv_heads = n_kv_heads;
    f->head_dim = head_dim;
    f->n_heads = n_kv_heads * group;
    f->block_size = block_size;
    f->dtype = dtype;
    int need = 0, max_blocks = 1;
    for (int s = 0; s < n_seqs; s++) {
        int nb = (specs[s].kv_len + block_size - 1) / block_size;
        need += nb;
        if (nb + 2 > max_blocks) max_blocks = nb + 2;
    }
    int n_blocks = need + 3;
    f->max_blocks = max_blocks;
    size_t row = (size_t)n_kv_heads * head_dim;
    size_t layer_bytes = (size_t)n_blocks * block_size * rk_dtype_row_bytes(dtype, row);
    for (int l = 0; l < 2; l++) {
        f->kbuf[l] = malloc(layer_bytes);
        f->vbuf[l] = malloc(layer_bytes);
        cr_assert(f->kbuf[l] && f->vbuf[l]);
        memset(f->kbuf[l], 0xff, layer_bytes);
        memset(f->vbuf[l], 0xff, layer_bytes);
    }
    f->kv = (rk_kv_cache){2, n_blocks, block_size, n_kv_heads, head_dim, dtype, f->kbuf, f->vbuf};

    /* a random permutation of the block ids, dealt out to the sequences */
    int *perm = malloc((size_t)n_blocks * sizeof(int));
    cr_assert(perm);
    for (int i = 0; i < n_blocks; i++) perm[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int j = rk_test_irand(&rng, i + 1), tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    f->table = malloc((size_t)n_seqs * max_blocks * sizeof(int32_t));
    f->q_start = malloc((size_t)(n_seqs + 1) * sizeof(int32_t));
    f->kv_len = malloc((size_t)n_seqs * sizeof(int32_t));
    f->kf = calloc((size_t)n_seqs, sizeof(float *));
    f->vf = calloc((size_t)n_seqs, sizeof(float *));
    f->ck = calloc((size_t)n_seqs, sizeof(void *));
    f->cv = calloc((size_t)n_seqs, sizeof(void *));
    cr_assert(f->table && f->q_start && f->kv_len && f->kf && f->vf && f->ck && f->cv);
    int next = 0;
    f->q_start[0] = 0;
    for (int s = 0; s < n_seqs; s++) {
        int L = specs[s].kv_len, nb = (L + block_size - 1) / block_size;
        int32_t *row_t = f->table + (size_t)s * max_blocks;
        for (int b = 0; b < max_blocks; b++) row_t[b] = b < nb ? perm[next++] : -1;
        f->kv_len[s] = L;
        f->q_start[s + 1] = f->q_start[s] + specs[s].n_q;
        f->kf[s] = rk_test_rand_floats(&rng, (size_t)L * row + 1, -1, 1);
        f->vf[s] = rk_test_rand_floats(&rng, (size_t)L * row + 1, -1, 1);
        f->ck[s] = to_dtype(f->kf[s], (size_t)L * row, dtype);
        f->cv[s] = to_dtype(f->vf[s], (size_t)L * row, dtype);
        int32_t *slots = malloc((size_t)L * sizeof(int32_t) + 4);
        cr_assert(slots);
        for (int t = 0; t < L; t++) slots[t] = row_t[t / block_size] * block_size + t % block_size;
        cr_assert_eq(be->ops->kv_write(be, &f->kv, 1, f->kf[s], f->vf[s], slots, L), RK_OK);
        free(slots);
    }
    free(perm);
    f->total_q = f->q_start[n_seqs];
    f->q = rk_test_rand_floats(&rng, (size_t)f->total_q * f->n_heads * head_dim + 1, -2, 2);
}

static void fixture_free(fixture *f) {
    for (int l = 0; l < 2; l++) {
        free(f->kbuf[l]);
        free(f->vbuf[l]);
    }
    for (int s = 0; s < f->n_seqs; s++) {
        free(f->kf[s]);
        free(f->vf[s]);
        free(f->ck[s]);
        free(f->cv[s]);
    }
    free(f->kf);
    free(f->vf);
    free(f->ck);
    free(f->cv);
    free(f->table);
    free(f->q_start);
    free(f->kv_len);
    free(f->q);
}

static rk_attn_batch fixture_batch(const fixture *f) {
    return (rk_attn_batch){.n_seqs = f->n_seqs,
                           .q_start = f->q_start,
                           .kv_len = f->kv_len,
                           .block_table = f->table,
                           .max_blocks = f->max_blocks};
}

static float fixture_scale(const fixture *f) { return 1.0f / sqrtf((float)f->head_dim); }

static rk_attn_params fixture_params(const fixture *f) {
    return (rk_attn_params){.scale = fixture_scale(f), .softcap = f->softcap, .window = f->window};
}

/* Run paged attention into out/lse (malloc'ed by the caller). */
static rk_status run_paged(rk_backend *be, const fixture *f, float *out, float *lse) {
    rk_attn_batch b = fixture_batch(f);
    rk_attn_params ap = fixture_params(f);
    return be->ops->attention(be, out, lse, f->q, &f->kv, 1, &b, f->n_heads, &ap);
}

/* The naive double reference on the stored (dtype-rounded) K/V, or on the
 * unrounded f32 values when rounded is 0. */
static void attn_ref(const fixture *f, int rounded, double *out, double *lse) {
    int hd = f->head_dim, G = f->n_heads / f->n_kv_heads;
    double scale = fixture_scale(f);
    for (int s = 0; s < f->n_seqs; s++) {
        int n_q = f->q_start[s + 1] - f->q_start[s], L = f->kv_len[s];
        double *sc = malloc((size_t)L * sizeof(double) + 8);
        cr_assert(sc);
        for (int j = 0; j < n_q; j++)
            for (int h = 0; h < f->n_heads; h++) {
                size_t qi = (size_t)(f->q_start[s] + j) * f->n_heads + h;
                const float *q = f->q + qi * hd;
                int kh = h / G, vis = L - n_q + j + 1;
                /* the row's own entry is vis - 1; a window sees the last
                 * window entries up to it */
                int first = f->window > 0 && vis > f->window ? vis - f->window : 0;
                double mx = -INFINITY;
                for (int t = first; t < vis; t++) {
                    size_t o = ((size_t)t * f->n_kv_heads + kh) * hd;
                    double d = 0;
                    for (int e = 0; e < hd; e++) {
                        double kval =
                            rounded ? elem_f32(f->ck[s], f->dtype, o + e) : f->kf[s][o + e];
                        d += (double)q[e] * kval;
                    }
                    sc[t] = d * scale;
                    if (f->softcap > 0) sc[t] = f->softcap * tanh(sc[t] / f->softcap);
                    if (sc[t] > mx) mx = sc[t];
                }
                double sum = 0;
                for (int t = first; t < vis; t++) {
                    sc[t] = exp(sc[t] - mx);
                    sum += sc[t];
                }
                for (int e = 0; e < hd; e++) {
                    double a = 0;
                    for (int t = first; t < vis; t++) {
                        size_t o = ((size_t)t * f->n_kv_heads + kh) * hd + e;
                        double vval = rounded ? elem_f32(f->cv[s], f->dtype, o) : f->vf[s][o];
                        a += sc[t] * vval;
                    }
                    out[qi * hd + e] = a / sum;
                }
                lse[qi] = mx + log(sum);
            }
        free(sc);
    }
}

/* Check one fixture: paged == contiguous bit for bit (out and lse), and both
 * within 1e-5 of the double reference. Returns the paged output (malloc'ed). */
static float *check_fixture(rk_backend *be, const fixture *f, const char *what) {
    size_t n_out = (size_t)f->total_q * f->n_heads * f->head_dim + 1;
    size_t n_lse = (size_t)f->total_q * f->n_heads + 1;
    float *out = malloc(n_out * sizeof(float)), *lse = malloc(n_lse * sizeof(float));
    float *cout = malloc(n_out * sizeof(float)), *clse = malloc(n_lse * sizeof(float));
    double *rout = malloc(n_out * sizeof(double)), *rlse = malloc(n_lse * sizeof(double));
    cr_assert(out && lse && cout && clse && rout && rlse);
    cr_assert_eq(run_paged(be, f, out, lse), RK_OK, "%s: %s", what, rk_error_message());
    rk_attn_params ap = fixture_params(f);
    cr_assert_eq(rk_cpu_attention_contig(be, cout, clse, f->q, (const void *const *)f->ck,
                                         (const void *const *)f->cv, f->dtype, f->n_kv_heads,
                                         f->head_dim, f->q_start, f->kv_len, f->n_seqs, f->n_heads,
                                         &ap),
                 RK_OK);
    cr_assert_arr_eq(out, cout, (n_out - 1) * sizeof(float), "%s: paged and contiguous differ",
                     what);
    cr_assert_arr_eq(lse, clse, (n_lse - 1) * sizeof(float), "%s: lse differs", what);
    attn_ref(f, 1, rout, rlse);
    for (size_t i = 0; i + 1 < n_out; i++)
        cr_assert(fabs(out[i] - rout[i]) <= 1e-5, "%s: out[%zu] = %.9g, reference %.9g", what, i,
                  out[i], rout[i]);
    for (size_t i = 0; i + 1 < n_lse; i++)
        cr_assert(fabs(lse[i] - rlse[i]) <= 1e-5 * fmax(1.0, fabs(rlse[i])),
                  "%s: lse[%zu] = %.9g, reference %.9g", what, i, lse[i], rlse[i]);
    free(lse);
    free(cout);
    free(clse);
    free(rout);
    free(rlse);
    return out;
}

/* ---------------------------------------------------------------- attention */

static const int kv_lens[] = {1, 15, 16, 17, 31, 32, 33, 255, 256, 257, 4095};
static const int groups[] = {1, 2, 4, 7};
static const int head_dims[] = {8, 64, 128};
static const int block_sizes[] = {8, 16, 32};

Test(attention, decode_paged_is_bit_identical_to_contiguous_and_matches_double, .timeout = 600) {
    /* The full cross product: every kv length x GQA ratio x head_dim x block
     * size, each a batch of two decode sequences (lengths L and L/3 + 1). */
    rk_backend *be = make_backend(2);
    char what[128];
    for (size_t a = 0; a < sizeof kv_lens / sizeof *kv_lens; a++)
        for (size_t g = 0; g < 4; g++)
            for (size_t d = 0; d < 3; d++)
                for (size_t b = 0; b < 3; b++) {
                    seq_spec specs[2] = {{1, kv_lens[a]}, {1, kv_lens[a] / 3 + 1}};
                    fixture f;
                    fixture_build(&f, be, specs, 2, 2, groups[g], head_dims[d], block_sizes[b],
                                  RK_DTYPE_F32);
                    snprintf(what, sizeof what, "decode L=%d G=%d hd=%d B=%d", kv_lens[a],
                             groups[g], head_dims[d], block_sizes[b]);
                    free(check_fixture(be, &f, what));
                    fixture_free(&f);
                }
    rk_backend_free(be);
}

Test(attention, prefill_batches_are_bit_identical_to_contiguous_and_match_double, .timeout = 600) {
    /* A representative subset: every GQA ratio x head_dim, block sizes in
     * turn, each batch mixing full prefills, chunked prefills over a longer
     * cache (crossing the 512 partition), an empty and a decode sequence. */
    rk_backend *be = make_backend(2);
    char what[128];
    int turn = 0;
    for (size_t g = 0; g < 4; g++)
        for (size_t d = 0; d < 3; d++) {
            int B = block_sizes[turn++ % 3];
            seq_spec specs[6] = {{17, 17}, {15, 33}, {40, 600}, {0, 9}, {1, 1100}, {16, 256}};
            fixture f;
            fixture_build(&f, be, specs, 6, 2, groups[g], head_dims[d], B, RK_DTYPE_F32);
            snprintf(what, sizeof what, "prefill G=%d hd=%d B=%d", groups[g], head_dims[d], B);
            free(check_fixture(be, &f, what));
            fixture_free(&f);
        }
    /* head_dim 20 and 44: dims past the last multiple of 8 take the scalar tail */
    for (int hd = 20; hd <= 44; hd += 24) {
        seq_spec specs[3] = {{9, 9}, {3, 700}, {1, 530}};
        fixture f;
        fixture_build(&f, be, specs, 3, 3, 2, hd, 16, RK_DTYPE_F32);
        snprintf(what, sizeof what, "prefill hd=%d", hd);
        free(check_fixture(be, &f, what));
        fixture_free(&f);
    }
    /* one long prefill: every row of a 257-token sequence, and 33 rows at 4095 */
    for (size_t b = 0; b < 3; b++) {
        seq_spec specs[2] = {{257, 257}, {33, 4095}};
        fixture f;
        fixture_build(&f, be, specs, 2, 1, 4, 64, block_sizes[b], RK_DTYPE_F32);
        snprintf(what, sizeof what, "long prefill B=%d", block_sizes[b]);
        free(check_fixture(be, &f, what));
        fixture_free(&f);
    }
    rk_backend_free(be);
}

Test(attention, results_do_not_depend_on_the_thread_count) {
    rk_backend *bes[3] = {make_backend(1), make_backend(2), make_backend(4)};
    seq_spec specs[4] = {{1, 4095}, {30, 700}, {1, 17}, {5, 5}};
    fixture f;
    fixture_build(&f, bes[0], specs, 4, 2, 4, 128, 16, RK_DTYPE_F32);
    size_t n_out = (size_t)f.total_q * f.n_heads * f.head_dim,
           n_lse = (size_t)f.total_q * f.n_heads;
    float *out[3], *lse[3];
    for (int e = 0; e < 3; e++) {
        out[e] = malloc(n_out * sizeof(float));
        lse[e] = malloc(n_lse * sizeof(float));
        cr_assert(out[e] && lse[e]);
        cr_assert_eq(run_paged(bes[e], &f, out[e], lse[e]), RK_OK);
    }
    for (int e = 1; e < 3; e++) {
        cr_assert_arr_eq(out[0], out[e], n_out * sizeof(float), "1 vs %d threads", e == 1 ? 2 : 4);
        cr_assert_arr_eq(lse[0], lse[e], n_lse * sizeof(float));
    }
    for (int e = 0; e < 3; e++) {
        free(out[e]);
        free(lse[e]);
        rk_backend_free(bes[e]);
    }
    fixture_free(&f);
}

Test(attention, decode_and_prefill_rows_agree_bit_for_bit) {
    /* The last row of a prefill sees the same range as a decode step over the
     * same cache: split-K and the sequential walk give the same bits, whether
     * the prefill's kernels take its vectors one, two or four at a time,
     * whatever the head_dim's tail and for every cache type. */
    rk_backend *be = make_backend(2);
    static const struct {
        int rows, kv_len, group, head_dim;
        rk_dtype dtype;
    } cases[] = {{3, 1500, 2, 64, RK_DTYPE_F32},    {40, 700, 2, 44, RK_DTYPE_F32},
                 {130, 1100, 4, 128, RK_DTYPE_F32}, {9, 530, 7, 20, RK_DTYPE_F32},
                 {40, 700, 2, 44, RK_DTYPE_F16},    {130, 1100, 4, 128, RK_DTYPE_F16},
                 {40, 700, 2, 44, RK_DTYPE_BF16},   {130, 1100, 4, 128, RK_DTYPE_BF16}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int rows = cases[c].rows;
        seq_spec specs[2] = {{rows, cases[c].kv_len}, {1, cases[c].kv_len}};
        fixture f;
        fixture_build(&f, be, specs, 2, 2, cases[c].group, cases[c].head_dim, 16, cases[c].dtype);
        /* make sequence 1 a copy of sequence 0 in the cache: same table, same q */
        memcpy(f.table + f.max_blocks, f.table, (size_t)f.max_blocks * sizeof(int32_t));
        size_t qrow = (size_t)f.n_heads * f.head_dim;
        memcpy(f.q + rows * qrow, f.q + (rows - 1) * qrow, qrow * sizeof(float));
        float *out = malloc((size_t)(rows + 1) * qrow * sizeof(float)),
              *lse = malloc((size_t)(rows + 1) * f.n_heads * sizeof(float));
        cr_assert(out && lse);
        cr_assert_eq(run_paged(be, &f, out, lse), RK_OK);
        cr_assert_arr_eq(out + (rows - 1) * qrow, out + rows * qrow, qrow * sizeof(float),
                         "case %zu", c);
        cr_assert_arr_eq(lse + (size_t)(rows - 1) * f.n_heads, lse + (size_t)rows * f.n_heads,
                         (size_t)f.n_heads * sizeof(float), "case %zu", c);
        free(out);
        free(lse);
        fixture_free(&f);
    }
    rk_backend_free(be);
}

Test(attention, half_precision_caches_stay_close_to_f32) {
    /* F16 and BF16 caches: paged == contiguous, within 1e-5 of the double
     * reference on the rounded values, and within 5e-4 (F16) / 4e-3 (BF16)
     * of the F32 result on the unrounded values. */
    rk_backend *be = make_backend(2);
    char what[128];
    const float tol[3] = {0, 5e-4f, 4e-3f}; /* seen: 1.2e-4 and 8.2e-4 */
    for (int dt = 1; dt <= 2; dt++)
        for (int c = 0; c < 4; c++) {
            int hd = c % 2 ? 128 : 64, B = c < 2 ? 16 : 8, G = c < 2 ? 2 : 7;
            seq_spec specs[3] = {{1, c < 2 ? 4095 : 257}, {20, 530}, {1, 33}};
            fixture f;
            fixture_build(&f, be, specs, 3, 2, G, hd, B, (rk_dtype)dt);
            snprintf(what, sizeof what, "%s hd=%d B=%d G=%d", rk_dtype_name((rk_dtype)dt), hd, B,
                     G);
            float *out = check_fixture(be, &f, what);
            size_t n_out = (size_t)f.total_q * f.n_heads * hd;
            double *r32 = malloc(n_out * sizeof(double)),
                   *l32 = malloc((size_t)f.total_q * f.n_heads * sizeof(double));
            cr_assert(r32 && l32);
            attn_ref(&f, 0, r32, l32);
            double worst = 0;
            for (size_t i = 0; i < n_out; i++) worst = fmax(worst, fabs(out[i] - r32[i]));
            cr_assert(worst <= tol[dt], "%s: max |out - f32| = %g > %g", what, worst, tol[dt]);
            free(r32);
            free(l32);
            free(out);
            fixture_free(&f);
        }
    rk_backend_free(be);
}

/* The documented bound of Q8_0 KV against F32 on the attention fixture's
 * values (uniform in [-1, 1]; docs/benchmarks.md). */
#define RK_Q8_0_KV_TOL 4e-3 /* seen: 1.9e-3 */

Test(attention, q8_0_caches_are_read_directly_and_stay_close_to_f32) {
    /* Q8_0 caches (32 int8 and an f16 scale per block, head_dim a multiple of
     * 32): decode (split-K over 4095 entries) and prefill, paged ==
     * contiguous bit for bit, within 1e-5 of the double reference on the
     * dequantized values, and within RK_Q8_0_KV_TOL of the F32 result. */
    rk_backend *be = make_backend(2);
    char what[128];
    double seen = 0;
    for (int c = 0; c < 4; c++) {
        int hd = c % 2 ? 128 : 64, B = c < 2 ? 16 : 8, G = c < 2 ? 2 : 7;
        seq_spec specs[3] = {{1, c < 2 ? 4095 : 257}, {20, 530}, {1, 33}};
        fixture f;
        fixture_build(&f, be, specs, 3, 2, G, hd, B, RK_DTYPE_Q8_0);
        snprintf(what, sizeof what, "q8_0 hd=%d B=%d G=%d", hd, B, G);
        float *out = check_fixture(be, &f, what);
        size_t n_out = (size_t)f.total_q * f.n_heads * hd;
        double *r32 = malloc(n_out * sizeof(double)),
               *l32 = malloc((size_t)f.total_q * f.n_heads * sizeof(double));
        cr_assert(r32 && l32);
        attn_ref(&f, 0, r32, l32);
        double worst = 0;
        for (size_t i = 0; i < n_out; i++) worst = fmax(worst, fabs(out[i] - r32[i]));
        cr_assert(worst <= RK_Q8_0_KV_TOL, "%s: max |out - f32| = %g", what, worst);
        seen = fmax(seen, worst);
        free(r32);
        free(l32);
        free(out);
        fixture_free(&f);
    }
    cr_log_info("q8_0 KV: max |out - f32| = %g", seen);
    /* A head size that is not whole blocks is refused, not misread. */
    fixture f;
    seq_spec one = {1, 8};
    fixture_build(&f, be, &one, 1, 2, 1, 64, 16, RK_DTYPE_Q8_0);
    f.kv.head_dim = 48;
    float out[4 * 48], lse[4];
    cr_assert_eq(run_paged(be, &f, out, lse), RK_ERR_INVALID);
    fixture_free(&f);
    rk_backend_free(be);
}

static float max_abs_diff(const float *a, const float *b, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        if (!(d <= m)) m = d; /* NaN wins */
    }
    return m;
}

Test(attention, sliding_windows_and_soft_capping_match_the_reference) {
    /* A sliding window sees the last `window` entries up to the row's own
     * (i - window < j <= i): windows shorter than a tile, a tile, a block,
     * and crossing the 512-entry partitions of both the split decode and the
     * prefill walk; with and without soft-capping; every cache type.
     * Paged == contiguous bit for bit and both within 1e-5 of the double
     * reference, which masks by the same rule. */
    rk_backend *be = make_backend(2);
    char what[160];
    static const int windows[] = {1, 5, 16, 32, 33, 100, 512, 600, 5000};
    for (size_t wi = 0; wi < sizeof windows / sizeof *windows; wi++)
        for (int cap = 0; cap < 2; cap++) {
            rk_dtype dt = (rk_dtype)(wi % 4 == 3 ? RK_DTYPE_Q8_0 : (rk_dtype)(wi % 3));
            seq_spec specs[6] = {{1, 1500}, {40, 700}, {17, 17}, {1, 3}, {130, 1100}, {0, 9}};
            fixture f;
            fixture_build(&f, be, specs, 6, 2, 2 + (int)wi % 3, dt == RK_DTYPE_Q8_0 ? 64 : 44,
                          block_sizes[wi % 3], dt);
            f.window = windows[wi];
            f.softcap = cap ? 1.5f : 0.0f;
            snprintf(what, sizeof what, "window %d softcap %g %s", f.window, (double)f.softcap,
                     rk_dtype_name(dt));
            free(check_fixture(be, &f, what));
            fixture_free(&f);
        }
    /* soft-capping alone, over long decodes */
    seq_spec specs[2] = {{1, 4095}, {33, 600}};
    fixture f;
    fixture_build(&f, be, specs, 2, 2, 4, 64, 16, RK_DTYPE_F32);
    f.softcap = 0.5f; /* well below the largest scores: the cap matters */
    free(check_fixture(be, &f, "softcap 0.5"));
    fixture_free(&f);
    rk_backend_free(be);
}

Test(attention, a_window_changes_the_result_and_does_not_depend_on_threads) {
    /* The window must matter (a test that passes with it ignored would prove
     * nothing): outputs with and without it differ for rows past it and agree
     * bit for bit for rows that see no more than it. The decode row and the
     * prefill's last row over the same cache agree bit for bit, and so do 1,
     * 2 and 4 threads. */
    rk_backend *bes[3] = {make_backend(1), make_backend(2), make_backend(4)};
    int rows = 40, L = 1300, W = 530;
    seq_spec specs[2] = {{rows, L}, {1, L}};
    fixture f;
    fixture_build(&f, bes[0], specs, 2, 2, 4, 64, 16, RK_DTYPE_F32);
    memcpy(f.table + f.max_blocks, f.table, (size_t)f.max_blocks * sizeof(int32_t));
    size_t qrow = (size_t)f.n_heads * f.head_dim, n_out = (size_t)(rows + 1) * qrow;
    memcpy(f.q + rows * qrow, f.q + (rows - 1) * qrow, qrow * sizeof(float));
    float *full = malloc(n_out * sizeof(float)), *out[3];
    cr_assert(full);
    cr_assert_eq(run_paged(bes[0], &f, full, NULL), RK_OK);
    f.window = W;
    for (int e = 0; e < 3; e++) {
        out[e] = malloc(n_out * sizeof(float));
        cr_assert(out[e]);
        cr_assert_eq(run_paged(bes[e], &f, out[e], NULL), RK_OK);
    }
    for (int e = 1; e < 3; e++)
        cr_assert_arr_eq(out[0], out[e], n_out * sizeof(float), "threads %d", e == 1 ? 2 : 4);
    cr_assert_arr_eq(out[0] + (rows - 1) * qrow, out[0] + rows * qrow, qrow * sizeof(float),
                     "decode and prefill rows differ");
    cr_assert(max_abs_diff(out[0], full, n_out) > 1e-3f, "the window changed nothing");
    /* a window as long as the cache is no window */
    f.window = L;
    cr_assert_eq(run_paged(bes[1], &f, out[1], NULL), RK_OK);
    cr_assert_arr_eq(out[1], full, n_out * sizeof(float));
    /* bad params are refused */
    rk_attn_batch b = fixture_batch(&f);
    rk_attn_params bad[3] = {
        {.scale = NAN}, {.scale = 1, .softcap = -1}, {.scale = 1, .window = -2}};
    for (int i = 0; i < 3; i++)
        cr_assert_eq(
            bes[0]->ops->attention(bes[0], out[0], NULL, f.q, &f.kv, 1, &b, f.n_heads, &bad[i]),
            RK_ERR_INVALID);
    for (int e = 0; e < 3; e++) {
        free(out[e]);
        rk_backend_free(bes[e]);
    }
    free(full);
    fixture_free(&f);
}

Test(attention, one_entry_returns_its_value_and_two_equal_scores_average) {
    rk_backend *be = make_backend(1);
    float kbuf[2 * 4] = {0}, vbuf[2 * 4] = {0};
    void *kl[1] = {kbuf}, *vl[1] = {vbuf};
    rk_kv_cache kv = {1, 1, 2, 1, 4, RK_DTYPE_F32, kl, vl};
    float k[8] = {1, 0, 0, 0, 1, 0, 0, 0}, v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int32_t slots[2] = {0, 1};
    cr_assert_eq(be->ops->kv_write(be, &kv, 0, k, v, slots, 2), RK_OK);
    float q[4] = {2, 0, 0, 0}, out[4], lse;
    int32_t qs[2] = {0, 1}, len = 1, table[1] = {0};
    rk_attn_batch b = {
        .n_seqs = 1, .q_start = qs, .kv_len = &len, .block_table = table, .max_blocks = 1};
    rk_attn_params half = {.scale = 0.5f};
    cr_assert_eq(be->ops->attention(be, out, &lse, q, &kv, 0, &b, 1, &half), RK_OK);
    float v0[4] = {1, 2, 3, 4};
    cr_assert_arr_eq(out, v0, sizeof out);
    cr_assert_eq(lse, 1.0f); /* 0.5 * q.k = 1, one term: lse = 1 */
    len = 2;
    cr_assert_eq(be->ops->attention(be, out, &lse, q, &kv, 0, &b, 1, &half), RK_OK);
    for (int i = 0; i < 4; i++) cr_assert_float_eq(out[i], 3.0f + i, 1e-6);
    cr_assert_float_eq(lse, 1.0f + logf(2.0f), 1e-6);
    rk_backend_free(be);
}

Test(attention, rejects_bad_tables_and_shapes) {
    rk_backend *be = make_backend(2);
    seq_spec specs[1] = {{2, 40}};
    fixture f;
    fixture_build(&f, be, specs, 1, 2, 2, 8, 16, RK_DTYPE_F32);
    float *out = malloc((size_t)2 * f.n_heads * 8 * sizeof(float));
    cr_assert(out);
    rk_attn_batch b = fixture_batch(&f);
    rk_attn_params ap = fixture_params(&f);
    /* -1 beyond kv_len is fine (entries 40.. are not used) */
    cr_assert_eq(f.table[3], -1);
    cr_assert_eq(be->ops->attention(be, out, NULL, f.q, &f.kv, 1, &b, f.n_heads, &ap), RK_OK);
    int32_t saved = f.table[2];
    f.table[2] = -1; /* entries 32..39 live in block 2 */
    cr_assert_eq(be->ops->attention(be, out, NULL, f.q, &f.kv, 1, &b, f.n_heads, &ap),
                 RK_ERR_INVALID);
    f.table[2] = f.kv.n_blocks;
    cr_assert_eq(be->ops->attention(be, out, NULL, f.q, &f.kv, 1, &b, f.n_heads, &ap),
                 RK_ERR_INVALID);
    f.table[2] = saved;
    int32_t short_len = 1; /* kv_len < n_q */
    rk_attn_batch b2 = b;
    b2.kv_len = &short_len;
    cr_assert_eq(be->ops->attention(be, out, NULL, f.q, &f.kv, 1, &b2, f.n_heads, &ap),
                 RK_ERR_INVALID);
    int32_t long_len = 16 * f.max_blocks + 1; /* does not fit the table */
    b2.kv_len = &long_len;
    cr_assert_eq(be->ops->attention(be, out, NULL, f.q, &f.kv, 1, &b2, f.n_heads, &ap),
                 RK_ERR_INVALID);
    cr_assert_eq(be->ops->attention(be, out, NULL, f.q, &f.kv, 1, &b, 3, &ap), RK_ERR_INVALID);
    cr_assert_eq(be->ops->attention(be, out, NULL, f.q, &f.kv, 2, &b, f.n_heads, &ap),
                 RK_ERR_INVALID);
    free(out);
    fixture_free(&f);
    rk_backend_free(be);
}

/* ---------------------------------------------------------------- kv_write */

Test(kv_write, skips_negative_slots_and_rejects_bad_ones_without_writing) {
    rk_backend *be = make_backend(2);
    int n_blocks = 4, bs = 8, heads = 2, hd = 16;
    size_t row = (size_t)heads * hd, slots_total = (size_t)n_blocks * bs;
    for (int dt = 0; dt < 3; dt++) {
        rk_dtype t = (rk_dtype)dt;
        size_t bytes = slots_total * row * rk_dtype_size(t);
        void *k0 = malloc(bytes), *v0 = malloc(bytes), *k1 = malloc(bytes), *v1 = malloc(bytes);
        cr_assert(k0 && v0 && k1 && v1);
        memset(k0, 0xab, bytes);
        memset(v0, 0xab, bytes);
        memset(k1, 0xab, bytes);
        memset(v1, 0xab, bytes);
        void *kl[2] = {k0, k1}, *vl[2] = {v0, v1};
        rk_kv_cache kv = {2, n_blocks, bs, heads, hd, t, kl, vl};
        float *k = rk_test_rand_floats(&rng, 5 * row, -1, 1),
              *v = rk_test_rand_floats(&rng, 5 * row, -1, 1);
        int32_t slots[5] = {3, -1, 31, -7, 12};
        cr_assert_eq(be->ops->kv_write(be, &kv, 1, k, v, slots, 5), RK_OK);
        unsigned char *kb = k1;
        size_t es = rk_dtype_size(t);
        for (size_t s = 0; s < slots_total; s++) {
            int tok = -1;
            for (int i = 0; i < 5; i++)
                if (slots[i] == (int32_t)s) tok = i;
            for (size_t e = 0; e < row; e++) {
                if (tok >= 0) {
                    /* the cache holds k and v rounded to its dtype */
                    float got = elem_f32(kb + s * row * es, t, e);
                    cr_assert_eq(got, round_to(k[tok * row + e], t));
                    cr_assert_eq(elem_f32(v1, t, s * row + e), round_to(v[tok * row + e], t));
                } else {
                    cr_assert_eq(kb[(s * row + e) * es], 0xab, "slot %zu was written", s);
                }
            }
        }
        /* layer 0 untouched */
        unsigned char *l0 = k0;
        for (size_t i = 0; i < bytes; i++) cr_assert_eq(l0[i], 0xab);
        /* out of range: error, nothing written */
        void *snap = malloc(bytes);
        cr_assert(snap);
        memcpy(snap, k1, bytes);
        float *k2 = rk_test_rand_floats(&rng, 5 * row, 5, 6);
        int32_t bad[3] = {0, 32, 1};
        cr_assert_eq(be->ops->kv_write(be, &kv, 1, k2, k2, bad, 3), RK_ERR_INVALID);
        cr_assert_arr_eq(snap, k1, bytes);
        int32_t dup[3] = {4, 5, 4};
        cr_assert_eq(be->ops->kv_write(be, &kv, 1, k2, k2, dup, 3), RK_ERR_INVALID);
        cr_assert_arr_eq(snap, k1, bytes);
        cr_assert_eq(be->ops->kv_write(be, &kv, 2, k2, k2, slots, 3), RK_ERR_INVALID);
        free(snap);
        free(k2);
        free(k);
        free(v);
        free(k0);
        free(v0);
        free(k1);
        free(v1);
    }
    rk_backend_free(be);
}

/* ---------------------------------------------------------------- rope_shift_copy */

typedef struct shift_fixture {
    rk_kv_cache kv;
    void *kl[3], *vl[3];
    size_t row, layer_bytes;
} shift_fixture;

static void shift_build(shift_fixture *f, int n_blocks, int bs, int heads, int hd, rk_dtype t) {
    memset(f, 0, sizeof *f);
    f->row = (size_t)heads * hd;
    f->layer_bytes = (size_t)n_blocks * bs * rk_dtype_row_bytes(t, f->row);
    for (int l = 0; l < 3; l++) {
        f->kl[l] = malloc(f->layer_bytes);
        f->vl[l] = malloc(f->layer_bytes);
        cr_assert(f->kl[l] && f->vl[l]);
        memset(f->kl[l], 0, f->layer_bytes);
        memset(f->vl[l], 0, f->layer_bytes);
    }
    f->kv = (rk_kv_cache){3, n_blocks, bs, heads, hd, t, f->kl, f->vl};
}

static void shift_free(shift_fixture *f) {
    for (int l = 0; l < 3; l++) {
        free(f->kl[l]);
        free(f->vl[l]);
    }
}

Test(rope_shift_copy, shifting_keys_equals_computing_them_at_the_new_position) {
    rk_backend *be = make_backend(2);
    int n = 24, heads = 2, hd = 64, bs = 16, n_blocks = 8;
    for (int pr = 0; pr < 2; pr++)
        for (int part = 0; part < 2; part++) {
            rk_rope_params p = {.n_rot = part ? 48 : 64,
                                .theta = 10000.0f,
                                .pairing = (rk_rope_pairing)pr,
                                .scaling = part ? RK_ROPE_SCALING_YARN : RK_ROPE_SCALING_NONE,
                                .factor = 2.0f,
                                .orig_ctx = 1024};
            rk_rope r;
            cr_assert_eq(rk_rope_init(&r, &p), RK_OK);
            shift_fixture f;
            shift_build(&f, n_blocks, bs, heads, hd, RK_DTYPE_F32);
            float *x = rk_test_rand_floats(&rng, (size_t)n * f.row, -1, 1);
            float *k_src = malloc((size_t)n * f.row * sizeof(float));
            float *k_dst = malloc((size_t)n * f.row * sizeof(float));
            cr_assert(k_src && k_dst);
            memcpy(k_src, x, (size_t)n * f.row * sizeof(float));
            memcpy(k_dst, x, (size_t)n * f.row * sizeof(float));
            int32_t pos_src[24], pos_dst[24], src[24], dst[24], delta[24];
            for (int i = 0; i < n; i++) {
                pos_src[i] = 100 + i;
                pos_dst[i] = 33 + i;
                delta[i] = -67;
                src[i] = 5 + i;       /* slots 5..28 */
                dst[i] = 127 - 3 * i; /* slots 127, 124, ... 58: other blocks, reversed */
            }
            cr_assert_eq(be->ops->rope(be, k_src, pos_src, n, heads, hd, &r), RK_OK);
            cr_assert_eq(be->ops->rope(be, k_dst, pos_dst, n, heads, hd, &r), RK_OK);
            float *v = rk_test_rand_floats(&rng, (size_t)n * f.row, -1, 1);
            for (int l = 0; l < 3; l++)
                cr_assert_eq(be->ops->kv_write(be, &f.kv, l, k_src, v, src, n), RK_OK);
            unsigned char *snap_k = malloc(f.layer_bytes), *snap_v = malloc(f.layer_bytes);
            cr_assert(snap_k && snap_v);
            memcpy(snap_k, f.kl[2], f.layer_bytes);
            memcpy(snap_v, f.vl[2], f.layer_bytes);
            cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, src, dst, delta, n, LAYERS(&r)),
                         RK_OK);
            for (int l = 0; l < 3; l++) {
                const float *kc = f.kl[l];
                for (int i = 0; i < n; i++) {
                    const float *got = kc + (size_t)dst[i] * f.row;
                    const float *want = k_dst + (size_t)i * f.row;
                    for (size_t e = 0; e < f.row; e++)
                        cr_assert(fabsf(got[e] - want[e]) <= 1e-5f * fmaxf(1.0f, fabsf(want[e])),
                                  "pairing %d layer %d token %d elem %zu: %.9g vs %.9g", pr, l, i,
                                  e, got[e], want[e]);
                    /* V byte-identical */
                    cr_assert_arr_eq((const unsigned char *)f.vl[l] + (size_t)dst[i] * f.row * 4,
                                     v + (size_t)i * f.row, f.row * 4);
                }
            }
            /* the source slots (and everything else but the destinations) are unchanged */
            for (int i = 0; i < n; i++) {
                size_t o = (size_t)src[i] * f.row * 4;
                cr_assert_arr_eq(snap_k + o, (unsigned char *)f.kl[2] + o, f.row * 4);
                cr_assert_arr_eq(snap_v + o, (unsigned char *)f.vl[2] + o, f.row * 4);
            }
            free(snap_k);
            free(snap_v);
            free(x);
            free(v);
            free(k_src);
            free(k_dst);
            shift_free(&f);
        }
    rk_backend_free(be);
}

Test(rope_shift_copy, each_layer_is_shifted_with_its_own_rope) {
    /* Gemma 3's pattern in three layers: a local base (10000) for layers 0
     * and 2, a global one (1e6, linear scaling 8) for layer 1, the local
     * table given once as the same pointer and once as an equal copy. Each
     * layer's shifted keys equal its keys computed at the new positions with
     * its own RoPE, and differ from those of the other RoPE. */
    rk_backend *be = make_backend(2);
    int n = 20, heads = 2, hd = 64;
    rk_rope_params pl = {.n_rot = 64, .theta = 10000.0f, .pairing = RK_ROPE_NEOX},
                   pg = {.n_rot = 64,
                         .theta = 1000000.0f,
                         .pairing = RK_ROPE_NEOX,
                         .scaling = RK_ROPE_SCALING_LINEAR,
                         .factor = 8.0f};
    rk_rope local, global, local2;
    cr_assert_eq(rk_rope_init(&local, &pl), RK_OK);
    cr_assert_eq(rk_rope_init(&global, &pg), RK_OK);
    local2 = local;
    const rk_rope *ropes[3] = {&local, &global, &local2};
    shift_fixture f;
    shift_build(&f, 8, 16, heads, hd, RK_DTYPE_F32);
    float *x = rk_test_rand_floats(&rng, (size_t)n * f.row, -1, 1);
    float *v = rk_test_rand_floats(&rng, (size_t)n * f.row, -1, 1);
    float *ks[3], *kd[3];
    int32_t pos_src[20], pos_dst[20], src[20], dst[20], delta[20];
    for (int i = 0; i < n; i++) {
        pos_src[i] = 700 + i;
        pos_dst[i] = 40 + 2 * i;
        delta[i] = pos_dst[i] - pos_src[i];
        src[i] = i;
        dst[i] = 127 - i;
    }
    for (int l = 0; l < 3; l++) {
        ks[l] = malloc((size_t)n * f.row * sizeof(float));
        kd[l] = malloc((size_t)n * f.row * sizeof(float));
        cr_assert(ks[l] && kd[l]);
        memcpy(ks[l], x, (size_t)n * f.row * sizeof(float));
        memcpy(kd[l], x, (size_t)n * f.row * sizeof(float));
        cr_assert_eq(be->ops->rope(be, ks[l], pos_src, n, heads, hd, ropes[l]), RK_OK);
        cr_assert_eq(be->ops->rope(be, kd[l], pos_dst, n, heads, hd, ropes[l]), RK_OK);
        cr_assert_eq(be->ops->kv_write(be, &f.kv, l, ks[l], v, src, n), RK_OK);
    }
    cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, src, dst, delta, n, ropes), RK_OK);
    for (int l = 0; l < 3; l++) {
        float worst = 0, other = 0;
        for (int i = 0; i < n; i++)
            for (size_t e = 0; e < f.row; e++) {
                float got = ((const float *)f.kl[l])[(size_t)dst[i] * f.row + e];
                worst = fmaxf(worst, fabsf(got - kd[l][(size_t)i * f.row + e]));
                other = fmaxf(other, fabsf(got - kd[1 - l % 2][(size_t)i * f.row + e]));
            }
        cr_assert(worst <= 1e-4f, "layer %d: shifted keys off by %g", l, worst); /* fp32 angles */
        cr_assert(other > 1e-2f, "layer %d: the other RoPE gives the same keys", l);
    }
    /* a layer without a table is refused */
    const rk_rope *missing[3] = {&local, NULL, &local};
    cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, src, dst, delta, n, missing), RK_ERR_INVALID);
    for (int l = 0; l < 3; l++) {
        free(ks[l]);
        free(kd[l]);
    }
    free(x);
    free(v);
    shift_free(&f);
    rk_backend_free(be);
}

Test(rope_shift_copy, shifting_by_d_then_minus_d_restores_the_keys) {
    rk_backend *be = make_backend(2);
    int n = 40, heads = 3, hd = 128, bs = 8, n_blocks = 16;
    for (int pr = 0; pr < 2; pr++) {
        rk_rope r = plain_rope(128, 1000000.0f, (rk_rope_pairing)pr);
        shift_fixture f;
        shift_build(&f, n_blocks, bs, heads, hd, RK_DTYPE_F32);
        float *k = rk_test_rand_floats(&rng, (size_t)n * f.row, -1, 1),
              *v = rk_test_rand_floats(&rng, (size_t)n * f.row, -1, 1);
        int32_t a[40], b[40], c[40], d[40], md[40];
        for (int i = 0; i < n; i++) {
            a[i] = i;
            b[i] = 40 + i;
            c[i] = 127 - i; /* 127..88: disjoint from b */
            d[i] = (i * 7919) % 100000 - 50000;
            md[i] = -d[i];
        }
        cr_assert_eq(be->ops->kv_write(be, &f.kv, 1, k, v, a, n), RK_OK);
        cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, a, b, d, n, LAYERS(&r)), RK_OK);
        cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, b, c, md, n, LAYERS(&r)), RK_OK);
        const float *kc = f.kl[1];
        for (int i = 0; i < n; i++)
            for (size_t e = 0; e < f.row; e++) {
                float want = k[(size_t)i * f.row + e], got = kc[(size_t)c[i] * f.row + e];
                cr_assert(fabsf(got - want) <= 1e-6f * fmaxf(1.0f, fabsf(want)),
                          "pairing %d token %d elem %zu: %.9g vs %.9g", pr, i, e, got, want);
            }
        free(k);
        free(v);
        shift_free(&f);
    }
    rk_backend_free(be);
}

Test(rope_shift_copy, half_precision_caches_round_once_per_shift) {
    rk_backend *be = make_backend(2);
    int n = 16, heads = 2, hd = 64;
    rk_rope r = plain_rope(64, 10000.0f, RK_ROPE_NEOX);
    for (int dt = 1; dt <= 2; dt++) {
        rk_dtype t = (rk_dtype)dt;
        shift_fixture f;
        shift_build(&f, 4, 16, heads, hd, t);
        float *x = rk_test_rand_floats(&rng, (size_t)n * f.row, -1, 1),
              *v = rk_test_rand_floats(&rng, (size_t)n * f.row, -1, 1);
        float *want = malloc((size_t)n * f.row * sizeof(float));
        cr_assert(want);
        int32_t src[16], dst[16], pos[16], delta[16];
        for (int i = 0; i < n; i++) {
            src[i] = i;
            dst[i] = 63 - i;
            pos[i] = 500 + i;
            delta[i] = 500 + i;
        }
        cr_assert_eq(be->ops->kv_write(be, &f.kv, 0, x, v, src, n), RK_OK);
        /* expected: the stored (rounded) x rotated in f32, rounded again */
        for (int i = 0; i < n; i++)
            for (size_t e = 0; e < f.row; e++)
                want[(size_t)i * f.row + e] = elem_f32(f.kl[0], t, (size_t)i * f.row + e);
        cr_assert_eq(be->ops->rope(be, want, pos, n, heads, hd, &r), RK_OK);
        cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, src, dst, delta, n, LAYERS(&r)), RK_OK);
        /* the same f32 rotation as the rope op, then exactly one rounding */
        for (int i = 0; i < n; i++)
            for (size_t e = 0; e < f.row; e++) {
                float got = elem_f32(f.kl[0], t, (size_t)dst[i] * f.row + e);
                float w = want[(size_t)i * f.row + e];
                cr_assert_eq(got, round_to(w, t), "%s: %.9g vs %.9g", rk_dtype_name(t), got,
                             round_to(w, t));
                cr_assert_eq(((uint16_t *)f.vl[0])[(size_t)dst[i] * f.row + e],
                             ((uint16_t *)f.vl[0])[(size_t)src[i] * f.row + e]);
            }
        free(x);
        free(v);
        free(want);
        shift_free(&f);
    }
    rk_backend_free(be);
}

Test(rope_shift_copy, q8_0_caches_dequantize_rotate_and_requantize_each_row) {
    rk_backend *be = make_backend(2);
    int n = 16, heads = 2, hd = 64;
    rk_rope r = plain_rope(64, 10000.0f, RK_ROPE_NEOX);
    shift_fixture f;
    shift_build(&f, 4, 16, heads, hd, RK_DTYPE_Q8_0);
    size_t rb = rk_dtype_row_bytes(RK_DTYPE_Q8_0, f.row);
    cr_assert_eq(rb, f.row / 32 * 34);
    float *x = rk_test_rand_floats(&rng, (size_t)n * f.row, -1, 1),
          *v = rk_test_rand_floats(&rng, (size_t)n * f.row, -1, 1);
    float *want = malloc((size_t)n * f.row * sizeof(float));
    unsigned char *wq = malloc(rb);
    cr_assert(want && wq);
    int32_t src[16], dst[16], pos[16];
    for (int i = 0; i < n; i++) {
        src[i] = i;
        dst[i] = 63 - i;
        pos[i] = 300 - 37 * i; /* shifts both ways */
    }
    cr_assert_eq(be->ops->kv_write(be, &f.kv, 1, x, v, src, n), RK_OK);
    /* kv_write quantizes: the stored row is rk_quantize of the input. */
    rk_quantize(wq, x, RK_DTYPE_Q8_0, f.row);
    cr_assert_arr_eq((unsigned char *)f.kl[1], wq, rb);
    for (int i = 0; i < n; i++)
        rk_dequantize(want + (size_t)i * f.row, (unsigned char *)f.kl[1] + (size_t)i * rb,
                      RK_DTYPE_Q8_0, f.row);
    cr_assert_eq(be->ops->rope(be, want, pos, n, heads, hd, &r), RK_OK);
    cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, src, dst, pos, n, LAYERS(&r)), RK_OK);
    for (int i = 0; i < n; i++) {
        /* the stored row dequantized, rotated in f32 as the rope op does, quantized once */
        rk_quantize(wq, want + (size_t)i * f.row, RK_DTYPE_Q8_0, f.row);
        cr_assert_arr_eq((unsigned char *)f.kl[1] + (size_t)dst[i] * rb, wq, rb, "row %d", i);
        cr_assert_arr_eq((unsigned char *)f.vl[1] + (size_t)dst[i] * rb,
                         (unsigned char *)f.vl[1] + (size_t)src[i] * rb, rb, "V is copied");
    }
    free(x);
    free(v);
    free(want);
    free(wq);
    shift_free(&f);
    rk_backend_free(be);
}

Test(rope_shift_copy, rejects_bad_slots_without_writing) {
    rk_backend *be = make_backend(2);
    rk_rope r = plain_rope(16, 10000.0f, RK_ROPE_NORMAL);
    shift_fixture f;
    shift_build(&f, 2, 8, 1, 16, RK_DTYPE_F32);
    float *k = rk_test_rand_floats(&rng, 16 * f.row, -1, 1);
    int32_t all[16];
    for (int i = 0; i < 16; i++) all[i] = i;
    for (int l = 0; l < 3; l++) cr_assert_eq(be->ops->kv_write(be, &f.kv, l, k, k, all, 16), RK_OK);
    unsigned char *snap = malloc(f.layer_bytes);
    cr_assert(snap);
    memcpy(snap, f.kl[0], f.layer_bytes);
    int32_t delta[2] = {5, 5};
    int32_t s1[2] = {0, 1}, d_over[2] = {2, 16}, d_neg[2] = {-1, 3}, d_dup[2] = {4, 4},
            d_overlap[2] = {1, 5};
    cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, s1, d_over, delta, 2, LAYERS(&r)),
                 RK_ERR_INVALID);
    cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, s1, d_neg, delta, 2, LAYERS(&r)),
                 RK_ERR_INVALID);
    cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, d_over, s1, delta, 2, LAYERS(&r)),
                 RK_ERR_INVALID);
    cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, s1, d_dup, delta, 2, LAYERS(&r)),
                 RK_ERR_INVALID);
    cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, s1, d_overlap, delta, 2, LAYERS(&r)),
                 RK_ERR_INVALID);
    cr_assert_arr_eq(snap, f.kl[0], f.layer_bytes);
    rk_rope wide = plain_rope(32, 10000.0f, RK_ROPE_NORMAL); /* n_rot > head_dim */
    int32_t d_ok[2] = {8, 9};
    cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, s1, d_ok, delta, 2, LAYERS(&wide)),
                 RK_ERR_INVALID);
    cr_assert_eq(be->ops->rope_shift_copy(be, &f.kv, s1, d_ok, delta, 2, LAYERS(&r)), RK_OK);
    free(snap);
    free(k);
    shift_free(&f);
    rk_backend_free(be);
}

/* ---------------------------------------------------------------- attention over shifted runs */

/* Position-shifted ("zero-copy") attention against the copy path it replaces:
 * cached runs stay in their own blocks with a delta per run, versus the same
 * runs moved into packed blocks by rope_shift_copy and attended without
 * segments. Every cache slot starts as NaN, so reading the unused tail of a
 * run's partial last block would poison the output. */

#define ZC_LIVE INT32_MIN /* a run written at its live positions (delta 0), never shared */

/* A cached run: len keys rotated at base .. base + len - 1. */
typedef struct zc_chunk {
    int len, base;
} zc_chunk;

typedef struct zc_seq {
    int n_runs;
    const int *run; /* (n_runs) chunk ids; a chunk used twice shares its blocks */
    int n_q;        /* query rows: the last n_q entries */
    int pos_off;    /* live position of entry 0 */
} zc_seq;

typedef struct zc_case {
    const zc_chunk *chunks;
    int n_chunks;
    const zc_seq *seqs;
    int n_seqs;
    int n_heads, n_kv, hd, bs;
    rk_dtype dtype;
    const rk_rope *rope;
    int window; /* sliding window of both paths (0: none) */
} zc_case;

typedef struct zc_fixture {
    rk_kv_cache kv;
    void *kl[1], *vl[1];
    int32_t *q_start, *kv_len, *seg_start, *seg_end, *seg_delta;
    int32_t *run_table, *packed_table; /* (n_seqs, max_blocks) */
    int max_blocks, rows;
    float *q;
} zc_fixture;

static int zc_blocks(int len, int bs) { return (len + bs - 1) / bs; }

/* Fill the cache: every distinct chunk (and every live run) once, at its
 * positions, in shuffled blocks; then rope_shift_copy each sequence's runs
 * into packed blocks of its own. */
static void zc_build(zc_fixture *f, rk_backend *be, const zc_case *zc) {
    memset(f, 0, sizeof *f);
    int bs = zc->bs, row = zc->n_kv * zc->hd, n_seqs = zc->n_seqs;
    int total_runs = 0, n_blocks = 0;
    f->max_blocks = 1;
    for (int s = 0; s < n_seqs; s++) {
        int len = 0, blocks = 0;
        for (int k = 0; k < zc->seqs[s].n_runs; k++) {
            int l = zc->chunks[zc->seqs[s].run[k]].len;
            len += l;
            blocks += zc_blocks(l, bs);
        }
        int need = blocks > zc_blocks(len, bs) ? blocks : zc_blocks(len, bs);
        f->max_blocks = need > f->max_blocks ? need : f->max_blocks;
        n_blocks += blocks + zc_blocks(len, bs);
        total_runs += zc->seqs[s].n_runs;
    }
    size_t layer = (size_t)n_blocks * bs * rk_dtype_row_bytes(zc->dtype, (size_t)row);
    f->kl[0] = malloc(layer);
    f->vl[0] = malloc(layer);
    cr_assert(f->kl[0] && f->vl[0]);
    memset(f->kl[0], 0xff, layer); /* NaN in every dtype */
    memset(f->vl[0], 0xff, layer);
    f->kv = (rk_kv_cache){1, n_blocks, bs, zc->n_kv, zc->hd, zc->dtype, f->kl, f->vl};
    int32_t *order = malloc((size_t)n_blocks * sizeof *order);
    cr_assert(order);
    for (int i = 0; i < n_blocks; i++) order[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int j = rk_test_irand(&rng, i + 1);
        int32_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    int next = 0;
    int32_t *chunk_first = malloc((size_t)zc->n_chunks * sizeof *chunk_first);
    f->q_start = calloc((size_t)n_seqs + 1, sizeof(int32_t));
    f->kv_len = calloc((size_t)n_seqs, sizeof(int32_t));
    f->seg_start = calloc((size_t)n_seqs + 1, sizeof(int32_t));
    f->seg_end = calloc((size_t)total_runs, sizeof(int32_t));
    f->seg_delta = calloc((size_t)total_runs, sizeof(int32_t));
    f->run_table = malloc((size_t)n_seqs * f->max_blocks * sizeof(int32_t));
    f->packed_table = malloc((size_t)n_seqs * f->max_blocks * sizeof(int32_t));
    cr_assert(chunk_first && f->q_start && f->kv_len && f->seg_start && f->seg_end &&
              f->seg_delta && f->run_table && f->packed_table);
    for (int c = 0; c < zc->n_chunks; c++) chunk_first[c] = -1;
    for (int i = 0; i < n_seqs * f->max_blocks; i++) f->run_table[i] = f->packed_table[i] = -1;

    /* write len entries (keys rotated at pos0..) into blocks[] */
    float *k = NULL, *v = NULL;
    int32_t *pos = NULL, *slots = NULL;
    int cap = 0;
#define ZC_WRITE(blocks, len, pos0)                                                                \
    do {                                                                                           \
        if ((len) > cap) {                                                                         \
            cap = (len);                                                                           \
            free(k);                                                                               \
            free(v);                                                                               \
            free(pos);                                                                             \
            free(slots);                                                                           \
            k = malloc((size_t)cap * row * sizeof(float));                                         \
            v = malloc((size_t)cap * row * sizeof(float));                                         \
            pos = malloc((size_t)cap * sizeof(int32_t));                                           \
            slots = malloc((size_t)cap * sizeof(int32_t));                                         \
            cr_assert(k &&v &&pos &&slots);                                                        \
        }                                                                                          \
        for (int j = 0; j < (len); j++) {                                                          \
            pos[j] = (pos0) + j;                                                                   \
            slots[j] = (blocks)[j / bs] * bs + j % bs;                                             \
        }                                                                                          \
        for (size_t e = 0; e < (size_t)(len)*row; e++) {                                           \
            k[e] = rk_test_frand(&rng, -1, 1);                                                     \
            v[e] = rk_test_frand(&rng, -1, 1);                                                     \
        }                                                                                          \
        cr_assert_eq(be->ops->rope(be, k, pos, (len), zc->n_kv, zc->hd, zc->rope), RK_OK);         \
        cr_assert_eq(be->ops->kv_write(be, &f->kv, 0, k, v, slots, (len)), RK_OK);                 \
    } while (0)

    int run_i = 0;
    for (int s = 0; s < n_seqs; s++) {
        const zc_seq *sq = &zc->seqs[s];
        int32_t *rt = f->run_table + (size_t)s * f->max_blocks;
        int tb = 0, begin = 0;
        f->seg_start[s] = run_i;
        for (int r = 0; r < sq->n_runs; r++, run_i++) {
            const zc_chunk *ch = &zc->chunks[sq->run[r]];
            int live = sq->pos_off + begin, nb = zc_blocks(ch->len, bs);
            if (ch->base == ZC_LIVE || chunk_first[sq->run[r]] < 0) {
                int32_t *blocks = order + next;
                next += nb;
                ZC_WRITE(blocks, ch->len, ch->base == ZC_LIVE ? live : ch->base);
                if (ch->base != ZC_LIVE) chunk_first[sq->run[r]] = (int32_t)(blocks - order);
                memcpy(rt + tb, blocks, (size_t)nb * sizeof(int32_t));
            } else {
                memcpy(rt + tb, order + chunk_first[sq->run[r]], (size_t)nb * sizeof(int32_t));
            }
            tb += nb;
            begin += ch->len;
            f->seg_end[run_i] = begin;
            f->seg_delta[run_i] = ch->base == ZC_LIVE ? 0 : live - ch->base;
        }
        f->kv_len[s] = begin;
        f->q_start[s + 1] = f->q_start[s] + sq->n_q;
        /* the copy path: every run into packed blocks, rotated by its delta */
        int npk = zc_blocks(begin, bs);
        memcpy(f->packed_table + (size_t)s * f->max_blocks, order + next,
               (size_t)npk * sizeof(int32_t));
        next += npk;
        int32_t *src = malloc((size_t)begin * sizeof(int32_t)),
                *dst = malloc((size_t)begin * sizeof(int32_t)),
                *dl = malloc((size_t)begin * sizeof(int32_t));
        cr_assert(src && dst && dl);
        int e = 0, tbl = 0;
        for (int r = f->seg_start[s]; r < run_i; r++) {
            int b0 = r > f->seg_start[s] ? f->seg_end[r - 1] : 0;
            for (int j = 0; j < f->seg_end[r] - b0; j++, e++) {
                src[e] = rt[tbl + j / bs] * bs + j % bs;
                dst[e] = f->packed_table[(size_t)s * f->max_blocks + e / bs] * bs + e % bs;
                dl[e] = f->seg_delta[r];
            }
            tbl += zc_blocks(f->seg_end[r] - b0, bs);
        }
        cr_assert_eq(be->ops->rope_shift_copy(be, &f->kv, src, dst, dl, begin, LAYERS(zc->rope)),
                     RK_OK, "%s", rk_error_message());
        free(src);
        free(dst);
        free(dl);
    }
#undef ZC_WRITE
    f->seg_start[n_seqs] = run_i;
    cr_assert(next <= n_blocks);
    /* queries, rotated at their live positions */
    f->rows = f->q_start[n_seqs];
    f->q = rk_test_rand_floats(&rng, (size_t)f->rows * zc->n_heads * zc->hd, -4, 4);
    for (int s = 0; s < n_seqs; s++) {
        int n_q = zc->seqs[s].n_q;
        for (int j = 0; j < n_q; j++) {
            int32_t p = zc->seqs[s].pos_off + f->kv_len[s] - n_q + j;
            cr_assert_eq(be->ops->rope(be,
                                       f->q + (size_t)(f->q_start[s] + j) * zc->n_heads * zc->hd,
                                       &p, 1, zc->n_heads, zc->hd, zc->rope),
                         RK_OK);
        }
    }
    free(order);
    free(chunk_first);
    free(k);
    free(v);
    free(pos);
    free(slots);
}

static void zc_free(zc_fixture *f) {
    free(f->kl[0]);
    free(f->vl[0]);
    free(f->q_start);
    free(f->kv_len);
    free(f->seg_start);
    free(f->seg_end);
    free(f->seg_delta);
    free(f->run_table);
    free(f->packed_table);
    free(f->q);
}

static rk_attn_batch zc_packed_batch(const zc_fixture *f, int n_seqs) {
    return (rk_attn_batch){.n_seqs = n_seqs,
                           .q_start = f->q_start,
                           .kv_len = f->kv_len,
                           .block_table = f->packed_table,
                           .max_blocks = f->max_blocks};
}

static rk_attn_batch zc_run_batch(const zc_fixture *f, int n_seqs, const rk_rope *rope) {
    rk_attn_batch b = zc_packed_batch(f, n_seqs);
    b.block_table = f->run_table;
    b.seg_start = f->seg_start;
    b.seg_end = f->seg_end;
    b.seg_delta = f->seg_delta;
    b.rope = rope;
    return b;
}

/* Run both paths and require outputs and lse within tol; unless every delta
 * is 0, also require that dropping the deltas (no counter-rotation) moves the
 * output by more than 10 tol, so the comparison can tell. Returns the
 * largest output difference. */
static float zc_compare(rk_backend *be, const zc_case *zc, float tol, const char *what) {
    zc_fixture f;
    zc_build(&f, be, zc);
    size_t n_out = (size_t)f.rows * zc->n_heads * zc->hd, n_lse = (size_t)f.rows * zc->n_heads;
    float *want = malloc(n_out * sizeof(float)), *got = malloc(n_out * sizeof(float));
    float *want_lse = malloc(n_lse * sizeof(float)), *got_lse = malloc(n_lse * sizeof(float));
    cr_assert(want && got && want_lse && got_lse);
    rk_attn_params ap = {.scale = 1.0f / sqrtf((float)zc->hd), .window = zc->window};
    rk_attn_batch pb = zc_packed_batch(&f, zc->n_seqs), rb = zc_run_batch(&f, zc->n_seqs, zc->rope);
    cr_assert_eq(be->ops->attention(be, want, want_lse, f.q, &f.kv, 0, &pb, zc->n_heads, &ap),
                 RK_OK, "%s: %s", what, rk_error_message());
    cr_assert_eq(be->ops->attention(be, got, got_lse, f.q, &f.kv, 0, &rb, zc->n_heads, &ap), RK_OK,
                 "%s: %s", what, rk_error_message());
    float d_out = max_abs_diff(got, want, n_out), d_lse = max_abs_diff(got_lse, want_lse, n_lse);
    cr_assert(d_out <= tol && d_lse <= tol, "%s: output differs by %g, lse by %g (tolerance %g)",
              what, d_out, d_lse, tol);
    int rotates = 0;
    for (int r = 0; r < f.seg_start[zc->n_seqs]; r++) rotates |= f.seg_delta[r] != 0;
    if (rotates && zc->window == 0) { /* a window may hide every shifted run */
        memset(f.seg_delta, 0, (size_t)f.seg_start[zc->n_seqs] * sizeof(int32_t));
        cr_assert_eq(be->ops->attention(be, got, NULL, f.q, &f.kv, 0, &rb, zc->n_heads, &ap),
                     RK_OK);
        float d0 = max_abs_diff(got, want, n_out);
        cr_assert(d0 > 10 * tol, "%s: without the rotation the output moves only %g", what, d0);
    }
    free(want);
    free(got);
    free(want_lse);
    free(got_lse);
    zc_free(&f);
    return d_out;
}

/* Chunks 0..3 cached at base 0 (delta = live offset > 0), chunk 4 at base 900
 * (delta < 0), chunk 5 a system prompt and 6..8 questions/generated tokens at
 * their live positions. */
static const zc_chunk zc_chunks[] = {
    {37, 0},       {16, 0},      {70, 0},      {5, 0},        {23, 900},
    {21, ZC_LIVE}, {9, ZC_LIVE}, {1, ZC_LIVE}, {17, ZC_LIVE},
};
static const int zc_prefill[] = {5, 0, 4, 2, 6};   /* system, 3 chunks, a 9-token question */
static const int zc_decode[] = {5, 3, 0, 1, 4, 8}; /* ..., then 17 entries, the last the query */
static const int zc_decode_shared[] = {0, 2, 7};   /* chunks 0 and 2 again, elsewhere */
static const int zc_shifted_last[] = {5, 4, 2};    /* the query row in a shifted run */

Test(attention_segments, prefill_and_decode_match_the_copy_path) {
    rk_backend *be = make_backend(2);
    const zc_seq seqs[] = {
        {5, zc_prefill, 9, 0},
        {6, zc_decode, 1, 0},
        {3, zc_decode_shared, 1, 40},
        {3, zc_shifted_last, 4, 3},
    };
    const int groups_[] = {1, 4};
    for (int pr = 0; pr < 2; pr++)
        for (int gi = 0; gi < 2; gi++)
            for (int variant = 0; variant < 2; variant++) {
                int hd = variant ? 80 : 64; /* 80: partial rotary dims and a scalar tail */
                rk_rope_params p = {.n_rot = variant ? 48 : 64,
                                    .theta = variant ? 1e6f : 10000.0f,
                                    .pairing = (rk_rope_pairing)pr,
                                    .scaling =
                                        variant ? RK_ROPE_SCALING_YARN : RK_ROPE_SCALING_NONE,
                                    .factor = 4.0f,
                                    .orig_ctx = 256};
                rk_rope r;
                cr_assert_eq(rk_rope_init(&r, &p), RK_OK);
                zc_case zc = {zc_chunks,    9,  seqs, 4, 2 * groups_[gi], 2, hd, 16,
                              RK_DTYPE_F32, &r, 0};
                char what[96];
                snprintf(what, sizeof what, "pairing %d group %d variant %d", pr, groups_[gi],
                         variant);
                zc_compare(be, &zc, 1e-5f, what);
                /* each sequence alone too: decode only, prefill only */
                for (int s = 0; s < 4; s++) {
                    zc_case one = zc;
                    one.seqs = seqs + s;
                    one.n_seqs = 1;
                    zc_compare(be, &one, 1e-5f, what);
                }
            }
    rk_backend_free(be);
}

Test(attention_segments, sixty_four_runs_over_several_partitions_match_the_copy_path) {
    rk_backend *be = make_backend(2);
    /* 64 runs: 60 cached chunks (every 7th at a base above its live offset),
     * a system prompt, two live runs and the question; ~1700 entries, so
     * runs straddle the 512-entry partitions of the split decode. */
    zc_chunk chunks[64];
    int run[64];
    for (int c = 0; c < 60; c++) {
        chunks[c] = (zc_chunk){1 + rk_test_irand(&rng, 48),
                               c % 7 == 3 ? 1500 + rk_test_irand(&rng, 500) : 0};
        run[c + 1] = c;
    }
    chunks[60] = (zc_chunk){13, ZC_LIVE};
    chunks[61] = (zc_chunk){32, ZC_LIVE};
    chunks[62] = (zc_chunk){7, ZC_LIVE};
    chunks[63] = (zc_chunk){11, ZC_LIVE};
    run[0] = 60;
    run[61] = 61;
    run[62] = 62;
    run[63] = 63;
    for (int pr = 0; pr < 2; pr++) {
        rk_rope r = plain_rope(64, 10000.0f, (rk_rope_pairing)pr);
        for (int nq = 1; nq <= 11; nq += 10) {
            zc_seq seq = {64, run, nq, 0};
            zc_case zc = {chunks, 64, &seq, 1, 8, 2, 64, 16, RK_DTYPE_F32, &r, 0};
            zc_compare(be, &zc, 1e-5f, nq == 1 ? "64 runs, decode" : "64 runs, prefill");
        }
    }
    rk_backend_free(be);
}

Test(attention_segments, sliding_windows_match_the_copy_path) {
    /* A window counts entries of the concatenated runs: runs wholly before
     * it, cut by its start, and one window longer than several runs; the
     * runs path and the packed copy agree within 1e-5 for decode and
     * prefill rows, over the partition edges of the 64-run case. */
    rk_backend *be = make_backend(2);
    zc_chunk chunks[64];
    int run[64];
    for (int c = 0; c < 60; c++) {
        chunks[c] = (zc_chunk){1 + rk_test_irand(&rng, 48),
                               c % 7 == 3 ? 1500 + rk_test_irand(&rng, 500) : 0};
        run[c + 1] = c;
    }
    chunks[60] = (zc_chunk){13, ZC_LIVE};
    chunks[61] = (zc_chunk){32, ZC_LIVE};
    chunks[62] = (zc_chunk){7, ZC_LIVE};
    chunks[63] = (zc_chunk){11, ZC_LIVE};
    run[0] = 60;
    run[61] = 61;
    run[62] = 62;
    run[63] = 63;
    static const int windows[] = {3, 40, 517, 1000};
    for (int pr = 0; pr < 2; pr++) {
        rk_rope r = plain_rope(64, 10000.0f, (rk_rope_pairing)pr);
        for (int wi = 0; wi < 4; wi++)
            for (int nq = 1; nq <= 11; nq += 10) {
                zc_seq seq = {64, run, nq, 0};
                zc_case zc = {chunks, 64, &seq, 1, 8, 2, 64, 16, RK_DTYPE_F32, &r, windows[wi]};
                char what[64];
                snprintf(what, sizeof what, "window %d, %s", windows[wi],
                         nq == 1 ? "decode" : "prefill");
                zc_compare(be, &zc, 1e-5f, what);
            }
    }
    rk_backend_free(be);
}

Test(attention_segments, decode_across_block_and_partition_edges_inside_shared_runs) {
    rk_backend *be1 = make_backend(1), *be2 = make_backend(2);
    /* Two sequences share chunks 0 (600 entries: crosses the partition edge at
     * 512 and many block edges) and 1 at different offsets; each decodes
     * while its live tail grows across a block edge (15, 16, 17, 31, 32, 33
     * entries with block size 16). */
    rk_rope r = plain_rope(64, 10000.0f, RK_ROPE_NEOX);
    const int tails[] = {15, 16, 17, 31, 32, 33};
    for (int ti = 0; ti < 6; ti++) {
        zc_chunk chunks[4] = {{600, 0}, {45, 7}, {tails[ti], ZC_LIVE}, {tails[ti] + 3, ZC_LIVE}};
        const int a[] = {1, 0, 2}, b[] = {0, 1, 3};
        zc_seq seqs[2] = {{3, a, 1, 0}, {3, b, 1, 100}};
        zc_case zc = {chunks, 4, seqs, 2, 8, 2, 64, 16, RK_DTYPE_F32, &r, 0};
        zc_compare(be2, &zc, 1e-5f, "shared runs");
        /* one thread (another split plan) and two: bit-identical */
        zc_fixture f;
        zc_build(&f, be1, &zc);
        size_t n = (size_t)f.rows * 8 * 64;
        float *o1 = malloc(n * sizeof(float)), *o2 = malloc(n * sizeof(float));
        cr_assert(o1 && o2);
        rk_attn_batch rb = zc_run_batch(&f, 2, &r);
        rk_attn_params ap8 = {.scale = 0.125f};
        cr_assert_eq(be1->ops->attention(be1, o1, NULL, f.q, &f.kv, 0, &rb, 8, &ap8), RK_OK);
        cr_assert_eq(be2->ops->attention(be2, o2, NULL, f.q, &f.kv, 0, &rb, 8, &ap8), RK_OK);
        cr_assert_arr_eq(o1, o2, n * sizeof(float));
        free(o1);
        free(o2);
        zc_free(&f);
    }
    rk_backend_free(be1);
    rk_backend_free(be2);
}

Test(attention_segments, q8_0_caches_match_the_copy_path_within_their_rounding) {
    /* The copy path requantizes each rotated key (its own block scales); the
     * shifted path reads the keys as cached and rotates the queries. */
    rk_backend *be = make_backend(2);
    const zc_seq seqs[] = {{5, zc_prefill, 9, 0}, {6, zc_decode, 1, 0}};
    float worst = 0;
    for (int pr = 0; pr < 2; pr++) {
        rk_rope r = plain_rope(64, 10000.0f, (rk_rope_pairing)pr);
        zc_case zc = {zc_chunks, 9, seqs, 2, 4, 2, 64, 16, RK_DTYPE_Q8_0, &r, 0};
        float d = zc_compare(be, &zc, RK_Q8_0_KV_TOL, "q8_0");
        worst = d > worst ? d : worst;
    }
    cr_log_info("q8_0 KV: shifted against copied keys: %g", worst);
    rk_backend_free(be);
}

Test(attention_segments, half_precision_caches_match_the_copy_path_loosely) {
    rk_backend *be = make_backend(2);
    const zc_seq seqs[] = {{5, zc_prefill, 9, 0}, {6, zc_decode, 1, 0}};
    /* The copy path rounds each rotated key to the cache dtype once more
     * (2^-11 relative for f16, 2^-8 for bf16); the shifted path reads the
     * keys as cached. */
    const rk_dtype dts[] = {RK_DTYPE_F16, RK_DTYPE_BF16};
    const float tols[] = {1e-3f, 1e-2f};
    for (int di = 0; di < 2; di++)
        for (int pr = 0; pr < 2; pr++) {
            rk_rope r = plain_rope(64, 10000.0f, (rk_rope_pairing)pr);
            zc_case zc = {zc_chunks, 9, seqs, 2, 4, 2, 64, 16, dts[di], &r, 0};
            float d = zc_compare(be, &zc, tols[di], rk_dtype_name(dts[di]));
            cr_assert(d > 0.0f, "%s: the copy path's rounding should show", rk_dtype_name(dts[di]));
        }
    rk_backend_free(be);
}

Test(attention_segments, one_unshifted_run_is_bit_identical_to_no_segments) {
    rk_backend *be = make_backend(2);
    const int lens[] = {1, 17, 600};
    for (int li = 0; li < 3; li++)
        for (int nq = 1; nq <= 5; nq += 4) {
            if (nq > lens[li]) continue;
            zc_chunk chunks[1] = {{lens[li], ZC_LIVE}};
            const int run[1] = {0};
            zc_seq seq = {1, run, nq, 0};
            rk_rope r = plain_rope(64, 10000.0f, RK_ROPE_NEOX);
            zc_case zc = {chunks, 1, &seq, 1, 4, 2, 64, 16, RK_DTYPE_F32, &r, 0};
            zc_fixture f;
            zc_build(&f, be, &zc);
            size_t n = (size_t)nq * 4 * 64;
            float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
            cr_assert(a && b);
            rk_attn_batch plain = zc_packed_batch(&f, 1);
            plain.block_table = f.run_table;
            rk_attn_batch seg = zc_run_batch(&f, 1, NULL); /* no rope needed for delta 0 */
            rk_attn_params ap8 = {.scale = 0.125f};
            cr_assert_eq(be->ops->attention(be, a, NULL, f.q, &f.kv, 0, &plain, 4, &ap8), RK_OK);
            cr_assert_eq(be->ops->attention(be, b, NULL, f.q, &f.kv, 0, &seg, 4, &ap8), RK_OK, "%s",
                         rk_error_message());
            cr_assert_arr_eq(a, b, n * sizeof(float));
            free(a);
            free(b);
            zc_free(&f);
        }
    rk_backend_free(be);
}

Test(attention_segments, rejects_bad_segments_without_writing) {
    rk_backend *be = make_backend(2);
    const int run[3] = {0, 1, 2};
    zc_chunk chunks[3] = {{20, 0}, {9, 0}, {3, ZC_LIVE}}; /* blocks 2 + 1 + 1, max_blocks 4 */
    zc_seq seq = {3, run, 2, 5};
    rk_rope r = plain_rope(32, 10000.0f, RK_ROPE_NORMAL);
    zc_case zc = {chunks, 3, &seq, 1, 2, 2, 32, 16, RK_DTYPE_F32, &r, 0};
    zc_fixture f;
    zc_build(&f, be, &zc);
    cr_assert_eq(f.max_blocks, 4);
    float out[2 * 2 * 32], sentinel[2 * 2 * 32];
    for (int i = 0; i < 2 * 2 * 32; i++) sentinel[i] = out[i] = -7.0f;
    rk_attn_params ap = {.scale = 1.0f / sqrtf(32.0f)};
    rk_attn_batch ok = zc_run_batch(&f, 1, &r);
    cr_assert_eq(be->ops->attention(be, out, NULL, f.q, &f.kv, 0, &ok, 2, &ap), RK_OK);
    for (int i = 0; i < 2 * 2 * 32; i++) out[i] = -7.0f;
#define BAD(stmt)                                                                                  \
    do {                                                                                           \
        rk_attn_batch b = ok;                                                                      \
        int32_t ss[2] = {0, 3}, se[3] = {20, 29, 32}, sd[3] = {5, 20, 0}, kl = 32;                 \
        int32_t table[4];                                                                          \
        memcpy(table, f.run_table, sizeof table);                                                  \
        rk_rope rr = r;                                                                            \
        b.seg_start = ss;                                                                          \
        b.seg_end = se;                                                                            \
        b.seg_delta = sd;                                                                          \
        b.kv_len = &kl;                                                                            \
        b.block_table = table;                                                                     \
        b.rope = &rr;                                                                              \
        stmt;                                                                                      \
        cr_assert_eq(be->ops->attention(be, out, NULL, f.q, &f.kv, 0, &b, 2, &ap), RK_ERR_INVALID, \
                     "accepted: %s", #stmt);                                                       \
        cr_assert_arr_eq(out, sentinel, sizeof out, "wrote on: %s", #stmt);                        \
    } while (0)
    BAD(ss[0] = 1);                /* does not start at 0 */
    BAD(ss[1] = 2);                /* runs end at 29, kv_len is 32 */
    BAD(se[2] = 33);               /* past kv_len */
    BAD(se[1] = 20);               /* empty run */
    BAD((se[0] = 25, se[1] = 24)); /* decreasing */
    BAD(table[3] = -1);            /* a run's block unset */
    BAD(table[2] = f.kv.n_blocks); /* out of range */
    BAD(b.max_blocks = 3);         /* runs take 2 + 1 + 1 blocks (packed, 32 entries need 2) */
    BAD(b.rope = NULL);            /* deltas without a rope */
    BAD(rr.n_rot = 34);            /* rope wider than head_dim */
    BAD(b.seg_delta = NULL);       /* half a description */
#undef BAD
    zc_free(&f);
    rk_backend_free(be);
}

/* ---------------------------------------------------------------- attention mass */

/* rk_attn_key_mass against the CPU attention kernel itself: with V's row j
 * the one-hot vector e_j (head_dim >= keys), a head's attention output is its
 * softmax row, so the outputs summed over query rows and heads are the mass
 * every key receives. Grouped heads, causal lengths, and a double reference. */
Test(attention_mass, equals_the_attention_kernels_probabilities_summed) {
    enum { NK = 12, HD = 16, KVH = 2, H = 6, NQ = 4 };
    rk_backend *be = make_backend(1);
    float *kbuf = calloc(NK * KVH * HD, sizeof *kbuf), *vbuf = calloc(NK * KVH * HD, sizeof *vbuf);
    void *kl[1] = {kbuf}, *vl[1] = {vbuf};
    rk_kv_cache kv = {1, 1, NK, KVH, HD, RK_DTYPE_F32, kl, vl};
    float *k = rk_test_rand_floats(&rng, NK * KVH * HD, -1, 1), v[NK * KVH * HD] = {0};
    for (int j = 0; j < NK; j++)
        for (int g = 0; g < KVH; g++) v[(j * KVH + g) * HD + j] = 1;
    int32_t slots[NK];
    for (int j = 0; j < NK; j++) slots[j] = j;
    cr_assert_eq(be->ops->kv_write(be, &kv, 0, k, v, slots, NK), RK_OK);
    float *q = rk_test_rand_floats(&rng, NQ * H * HD, -2, 2), out[NQ * H * HD];
    /* One sequence whose NQ query rows are its last entries: row i sees
     * NK - NQ + i + 1 keys (its last `window` ones with a window). Plain,
     * a window of 5 and soft-capping at 0.5 (below the largest scores). */
    int32_t qs[2] = {0, NQ}, len = NK, table[1] = {0}, q_len[NQ];
    for (int i = 0; i < NQ; i++) q_len[i] = NK - NQ + i + 1;
    rk_attn_batch b = {
        .n_seqs = 1, .q_start = qs, .kv_len = &len, .block_table = table, .max_blocks = 1};
    const rk_attn_params cases[3] = {
        {.scale = 0.3f}, {.scale = 0.3f, .window = 5}, {.scale = 0.3f, .softcap = 0.5f}};
    for (int c = 0; c < 3; c++) {
        const rk_attn_params *ap = &cases[c];
        cr_assert_eq(be->ops->attention(be, out, NULL, q, &kv, 0, &b, H, ap), RK_OK);
        double kernel[NK] = {0}, mass[NK] = {0}, ref[NK] = {0};
        for (int i = 0; i < NQ; i++)
            for (int h = 0; h < H; h++)
                for (int j = 0; j < NK; j++) kernel[j] += out[(i * H + h) * HD + j];
        cr_assert_eq(rk_attn_key_mass(q, q_len, NQ, k, NK, H, KVH, HD, ap, mass), RK_OK);
        for (int i = 0; i < NQ; i++)
            for (int h = 0; h < H; h++) {
                double p[NK], mx = -1e300, sum = 0;
                int lo = ap->window && q_len[i] > ap->window ? q_len[i] - ap->window : 0;
                for (int j = lo; j < q_len[i]; j++) {
                    p[j] = 0;
                    for (int e = 0; e < HD; e++)
                        p[j] +=
                            (double)q[(i * H + h) * HD + e] * k[(j * KVH + h / (H / KVH)) * HD + e];
                    p[j] *= ap->scale;
                    if (ap->softcap > 0) p[j] = ap->softcap * tanh(p[j] / ap->softcap);
                    mx = p[j] > mx ? p[j] : mx;
                }
                for (int j = lo; j < q_len[i]; j++) sum += p[j] = exp(p[j] - mx);
                for (int j = lo; j < q_len[i]; j++) ref[j] += p[j] / sum;
            }
        double total = 0;
        for (int j = 0; j < NK; j++) {
            cr_assert_float_eq(mass[j], ref[j], 1e-9, "case %d key %d: %g against %g", c, j,
                               mass[j], ref[j]);
            cr_assert_float_eq(mass[j], kernel[j], 1e-4,
                               "case %d key %d: %g against the kernel's %g", c, j, mass[j],
                               kernel[j]);
            total += mass[j];
        }
        cr_assert_float_eq(total, NQ * H, 1e-9, "every row and head hands out mass 1");
        cr_assert_gt(mass[NK - 1], 0, "only the last row sees the last key, and it does");
        if (ap->window) cr_assert_eq(mass[0], 0, "the first key lies outside every window");
    }
    free(k);
    free(q);
    free(kbuf);
    free(vbuf);
    rk_backend_free(be);
}

/* A q8_0 KV body is finite exactly when every block's f16 scale is: the int8
 * values cannot be anything else. The scan names the block's first element. */
Test(kernels, q8_0_nonfinite_scan_checks_every_block_scale) {
    enum { BLOCKS = 9 };
    size_t bb = rk_dtype_row_bytes(RK_DTYPE_Q8_0, 32);
    cr_assert_eq(bb, 34);
    unsigned char body[BLOCKS * 34];
    for (size_t i = 0; i < sizeof body; i++) body[i] = (unsigned char)(i * 7);
    for (int b = 0; b < BLOCKS; b++) { /* a finite scale: 1.0 in f16 */
        uint16_t one = 0x3c00;
        memcpy(body + b * bb, &one, sizeof one);
    }
    cr_assert_eq(rk_dtype_first_nonfinite(RK_DTYPE_Q8_0, body, BLOCKS * 32), -1);
    static const uint16_t bad[] = {0x7c00 /* +inf */, 0xfc00 /* -inf */, 0x7e00 /* NaN */};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        unsigned char copy[sizeof body];
        memcpy(copy, body, sizeof body);
        memcpy(copy + 5 * bb, &bad[k], sizeof bad[k]);
        cr_assert_eq(rk_dtype_first_nonfinite(RK_DTYPE_Q8_0, copy, BLOCKS * 32), 5 * 32,
                     "scale 0x%04x", bad[k]);
    }
}
