/* kernels/cpu/matmul.c — y(n, m) = x(n, k) · w(m, k)^T with F32, F16 or BF16
 * weights.
 *
 * Two paths, chosen from the shape alone (rk_cpu_matmul_uses_blas):
 *  - n >= BLAS_MIN_N (prefill): OpenBLAS cblas_sgemm. F32 weights go in
 *    directly; F16/BF16 weights are converted to f32 one panel of rows at a
 *    time (in parallel, into a bounded shared buffer) and multiplied panel by
 *    panel into the matching columns of y.
 *  - small n (decode): a memory-bound matrix-vector kernel, parallel over
 *    blocks of output rows (rows of w). Four rows of w stream together; F16
 *    rows are widened with F16C and BF16 rows by a 16-bit shift on the fly.
 *    For n > 1 each block of four rows is widened once into per-thread scratch
 *    and reused for every row of x.
 * Every element of y is one dot product with a fixed order (two 8-lane FMA
 * accumulators over 16-float steps, one more 8-float step, a fixed horizontal
 * sum, then the scalar tail), whichever block, task or thread computes it. */
#include <cblas.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#define BLAS_MIN_N       8                  /* n at which sgemm beats the matvec kernel */
#define ROWS_PER_TASK    64                 /* rows of w per matvec task (a multiple of 4) */
#define PANEL_MAX_BYTES  (8u * 1024 * 1024) /* f32 panel of converted weights */
#define PANEL_ROWS_ALIGN 16

int rk_cpu_matmul_uses_blas(int n, int k, int m, rk_dtype wtype) {
    (void)k;
    (void)m;
    (void)wtype;
    return n >= BLAS_MIN_N;
}

/* ---------------------------------------------------------------- dot kernels */

#ifdef __AVX2__
#define LOAD_F32(p) _mm256_loadu_ps(p)
#define LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD_BF16(p)                                                                               \
    _mm256_castsi256_ps(                                                                           \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))

/* One dot product; dot4 below computes four with the same arithmetic. */
#define DEF_DOT(NAME, T, LOAD, SCALAR)                                                             \
    static float NAME##_1(const float *x, const T *w, int k) {                                     \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                 \
        int j = 0;                                                                                 \
        for (; j + 16 <= k; j += 16) {                                                             \
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), LOAD(w + j), a0);                         \
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 8), LOAD(w + j + 8), a1);                 \
        }                                                                                          \
        if (j + 8 <= k) {                                                                          \
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), LOAD(w + j), a0);                         \
            j += 8;                                                                                \
        }                                                                                          \
        float s = rk_hsum256(_mm256_add_ps(a0, a1));                                               \
        for (; j < k; j++) s += x[j] * SCALAR(w[j]);                                               \
        return s;                                                                                  \
    }                                                                                              \
    static void NAME##_4(const float *x, const T *w0, const T *w1, const T *w2, const T *w3,       \
                         int k, float *out) {                                                      \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                                 \
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();                                 \
        __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();                                 \
        __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();                                 \
        int j = 0;                                                                                 \
        for (; j + 16 <= k; j += 16) {                                                             \
            __m256 x0 = _mm256_loadu_ps(x + j), x1 = _mm256_loadu_ps(x + j + 8);                   \
            a0 = _mm256_fmadd_ps(x0, LOAD(w0 + j), a0);                                            \
            a1 = _mm256_fmadd_ps(x1, LOAD(w0 + j + 8), a1);                                        \
            b0 = _mm256_fmadd_ps(x0, LOAD(w1 + j), b0);                                            \
            b1 = _mm256_fmadd_ps(x1, LOAD(w1 + j + 8), b1);                                        \
            c0 = _mm256_fmadd_ps(x0, LOAD(w2 + j), c0);                                            \
            c1 = _mm256_fmadd_ps(x1, LOAD(w2 + j + 8), c1);                                        \
            d0 = _mm256_fmadd_ps(x0, LOAD(w3 + j), d0);                                            \
            d1 = _mm256_fmadd_ps(x1, LOAD(w3 + j + 8), d1);                                        \
        }                                                                                          \
        if (j + 8 <= k) {                                                                          \
            __m256 x0 = _mm256_loadu_ps(x + j);                                                    \
            a0 = _mm256_fmadd_ps(x0, LOAD(w0 + j), a0);                                            \
            b0 = _mm256_fmadd_ps(x0, LOAD(w1 + j), b0);                                            \
            c0 = _mm256_fmadd_ps(x0, LOAD(w2 + j), c0);                                            \
            d0 = _mm256_fmadd_ps(x0, LOAD(w3 + j), d0);                                            \
            j += 8;                                                                                \
        }                                                                                          \
        float sa = rk_hsum256(_mm256_add_ps(a0, a1)), sb = rk_hsum256(_mm256_add_ps(b0, b1));      \
        float sc = rk_hsum256(_mm256_add_ps(c0, c1)), sd = rk_hsum256(_mm256_add_ps(d0, d1));      \
        for (; j < k; j++) {                                                                       \
            sa += x[j] * SCALAR(w0[j]);                                                            \
            sb += x[j] * SCALAR(w1[j]);                                                            \
            sc += x[j] * SCALAR(w2[j]);                                                            \
            sd += x[j] * SCALAR(w3[j]);                                                            \
        }                                                                                          \
        out[0] = sa;                                                                               \
        out[1] = sb;                                                                               \
        out[2] = sc;                                                                               \
        out[3] = sd;                                                                               \
    }
#else
/* Portable fallback: a plain ordered sum (the same in dot1 and dot4). */
#define DEF_DOT(NAME, T, LOAD, SCALAR)                                                             \
    static float NAME##_1(const float *x, const T *w, int k) {                                     \
        float s = 0.0f;                                                                            \
        for (int j = 0; j < k; j++) s += x[j] * SCALAR(w[j]);                                      \
        return s;                                                                                  \
    }                                                                                              \
    static void NAME##_4(const float *x, const T *w0, const T *w1, const T *w2, const T *w3,       \
                         int k, float *out) {                                                      \
        out[0] = NAME##_1(x, w0, k);                                                               \
        out[1] = NAME##_1(x, w1, k);                                                               \
        out[2] = NAME##_1(x, w2, k);                                                               \
        out[3] = NAME##_1(x, w3, k);                                                               \
    }
#endif

#define SCALAR_F32(v) (v)
DEF_DOT(dot_f32, float, LOAD_F32, SCALAR_F32)
DEF_DOT(dot_f16, uint16_t, LOAD_F16, rk_f16_to_f32)
DEF_DOT(dot_bf16, uint16_t, LOAD_BF16, rk_bf16_to_f32)

/* ---------------------------------------------------------------- matvec path */

typedef struct mv_ctx {
    rk_cpu *cpu;
    float *y;
    const float *x;
    const void *w;
    rk_dtype wtype;
    int n, k, m;
} mv_ctx;

/* n == 1: stream the rows of w straight from memory. */
static void mv_rows_n1(const mv_ctx *c, int r0, int r1) {
    size_t k = (size_t)c->k;
    int r = r0;
    switch (c->wtype) {
    case RK_DTYPE_F32: {
        const float *w = c->w;
        for (; r + 4 <= r1; r += 4)
            dot_f32_4(c->x, w + r * k, w + (r + 1) * k, w + (r + 2) * k, w + (r + 3) * k, c->k,
                      c->y + r);
        for (; r < r1; r++) c->y[r] = dot_f32_1(c->x, w + r * k, c->k);
        break;
    }
    case RK_DTYPE_F16: {
        const uint16_t *w = c->w;
        for (; r + 4 <= r1; r += 4)
            dot_f16_4(c->x, w + r * k, w + (r + 1) * k, w + (r + 2) * k, w + (r + 3) * k, c->k,
                      c->y + r);
        for (; r < r1; r++) c->y[r] = dot_f16_1(c->x, w + r * k, c->k);
        break;
    }
    case RK_DTYPE_BF16: {
        const uint16_t *w = c->w;
        for (; r + 4 <= r1; r += 4)
            dot_bf16_4(c->x, w + r * k, w + (r + 1) * k, w + (r + 2) * k, w + (r + 3) * k, c->k,
                       c->y + r);
        for (; r < r1; r++) c->y[r] = dot_bf16_1(c->x, w + r * k, c->k);
        break;
    }
    }
}

/* n > 1: widen a block of up to four rows once (exact), reuse it for every
 * row of x. The f32 kernel gives the same bits as the on-the-fly ones. */
static void mv_rows_multi(const mv_ctx *c, int r0, int r1, float *scratch) {
    size_t k = (size_t)c->k, m = (size_t)c->m;
    size_t es = rk_dtype_size(c->wtype);
    const unsigned char *wb = c->w;
    for (int r = r0; r < r1; r += 4) {
        int nr = r1 - r < 4 ? r1 - r : 4;
        const float *rows[4];
        for (int i = 0; i < nr; i++) {
            const void *src = wb + (size_t)(r + i) * k * es;
            if (c->wtype == RK_DTYPE_F32) {
                rows[i] = src;
            } else {
                rk_cpu_to_f32(scratch + i * k, src, c->wtype, k);
                rows[i] = scratch + i * k;
            }
        }
        for (int i = 0; i < c->n; i++) {
            const float *x = c->x + i * k;
            float *y = c->y + i * m + r;
            if (nr == 4) {
                dot_f32_4(x, rows[0], rows[1], rows[2], rows[3], c->k, y);
            } else {
                for (int j = 0; j < nr; j++) y[j] = dot_f32_1(x, rows[j], c->k);
            }
        }
    }
}

static void mv_task(void *p, int task, int tid) {
    mv_ctx *c = p;
    int r0 = task * ROWS_PER_TASK;
    int r1 = r0 + ROWS_PER_TASK < c->m ? r0 + ROWS_PER_TASK : c->m;
    if (c->n == 1)
        mv_rows_n1(c, r0, r1);
    else
        mv_rows_multi(c, r0, r1, rk_cpu_scratch(c->cpu, tid));
}

/* ---------------------------------------------------------------- BLAS path */

typedef struct cvt_ctx {
    float *dst;
    const unsigned char *src;
    rk_dtype dtype;
    size_t k;
    int rows, rows_per;
} cvt_ctx;

static void cvt_task(void *p, int task, int tid) {
    (void)tid;
    cvt_ctx *c = p;
    int r0 = task * c->rows_per, r1 = r0 + c->rows_per < c->rows ? r0 + c->rows_per : c->rows;
    size_t es = rk_dtype_size(c->dtype);
    rk_cpu_to_f32(c->dst + (size_t)r0 * c->k, c->src + (size_t)r0 * c->k * es, c->dtype,
                  (size_t)(r1 - r0) * c->k);
}

static rk_status matmul_blas(rk_cpu *cpu, float *y, const float *x, const void *w, rk_dtype wtype,
                             int n, int k, int m) {
    if (wtype == RK_DTYPE_F32) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, m, k, 1.0f, x, k, w, k, 0.0f, y, m);
        return RK_OK;
    }
    size_t panel_rows = PANEL_MAX_BYTES / ((size_t)k * sizeof(float));
    panel_rows = panel_rows / PANEL_ROWS_ALIGN * PANEL_ROWS_ALIGN;
    if (panel_rows < PANEL_ROWS_ALIGN) panel_rows = PANEL_ROWS_ALIGN;
    if (panel_rows > (size_t)m) panel_rows = (size_t)m;
    void *buf;
    rk_status st = rk_cpu_reserve_shared(cpu, panel_rows * (size_t)k * sizeof(float), &buf);
    if (st != RK_OK) return st;
    float *panel = buf; // (panel_rows, k)
    size_t es = rk_dtype_size(wtype);
    for (size_t p0 = 0; p0 < (size_t)m; p0 += panel_rows) {
        int rows = (int)((size_t)m - p0 < panel_rows ? (size_t)m - p0 : panel_rows);
        cvt_ctx c = {panel, (const unsigned char *)w + p0 * (size_t)k * es, wtype, (size_t)k, rows,
                     8};
        rk_threadpool_run(cpu->pool, (rows + c.rows_per - 1) / c.rows_per, cvt_task, &c);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, rows, k, 1.0f, x, k, panel, k, 0.0f,
                    y + p0, m);
    }
    return RK_OK;
}

/* ---------------------------------------------------------------- entry */

rk_status rk_cpu_matmul(rk_backend *be, float *y, const float *x, const void *w, rk_dtype wtype,
                        int n, int k, int m) {
    rk_cpu *cpu = be->impl;
    if (n < 0 || k < 0 || m < 0)
        return rk_errorf(RK_ERR_INVALID, "matmul: negative shape n=%d k=%d m=%d", n, k, m);
    if (rk_dtype_size(wtype) == 0)
        return rk_errorf(RK_ERR_INVALID, "matmul: bad weight dtype %d", (int)wtype);
    if (n == 0 || m == 0) return RK_OK;
    if (k == 0) {
        memset(y, 0, (size_t)n * m * sizeof(float));
        return RK_OK;
    }
    if (rk_cpu_matmul_uses_blas(n, k, m, wtype)) return matmul_blas(cpu, y, x, w, wtype, n, k, m);
    if (n > 1) {
        rk_status st = rk_cpu_reserve_scratch(cpu, 4 * (size_t)k * sizeof(float));
        if (st != RK_OK) return st;
    }
    mv_ctx c = {cpu, y, x, w, wtype, n, k, m};
    rk_threadpool_run(cpu->pool, (m + ROWS_PER_TASK - 1) / ROWS_PER_TASK, mv_task, &c);
    return RK_OK;
}
