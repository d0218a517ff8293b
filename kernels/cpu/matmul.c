/* kernels/cpu/matmul.c — y(n, m) = x(n, k) · w(m, k)^T with F32, F16, BF16
 * or block-quantized (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K,
 * Q5_K, Q6_K, IQ4_XS) weights.
 *
 * Two paths, chosen from the shape alone (rk_cpu_matmul_uses_blas):
 *  - n >= BLAS_MIN_N (prefill): OpenBLAS cblas_sgemm, one call per panel of
 *    rows of w, the panels spread over our thread pool and OpenBLAS kept
 *    single-threaded. F32 weights go in directly; F16/BF16 panels are first
 *    widened into per-thread scratch, so memory stays bounded. (OpenBLAS's
 *    own threading is not bit-reproducible across thread counts for every
 *    shape -- n=64 k=1029 m=37 differs between 1 and 2 threads -- so the
 *    panel split, which depends on k only, does the parallel work.)
 *  - small n (decode): a memory-bound matrix-vector kernel, parallel over
 *    blocks of output rows (rows of w). Each row of w streams once from memory
 *    and meets every row of x (two at a time) while it is in L1; F16 rows are
 *    widened with F16C and BF16 rows by a 16-bit shift on the fly.
 *    Quantized weights stay quantized: the rows of x are quantized to int8
 *    blocks once (kernels/cpu/quant.c; blocks of 256 for the types the
 *    reference engine dots against Q8_K, rk_cpu_act_is_q8k) and each row of
 *    w meets them in integer dot products; on the BLAS path quantized panels are dequantized
 *    into scratch like F16/BF16 ones.
 * Where the CPU has AVX-512 BF16 (rk_cpu_isa_active), BF16 weights take a
 * tile kernel of their own for every n, and quantized weights take it on the
 * prefill side, instead of the sgemm panels: see "BF16 path" below. Where it
 * has AVX-512 without the BF16 instructions, BF16 weights take a tile of the
 * same layout on the prefill side: see "BF16 path without the instructions".
 * Quantized weights packed at load (matmul_packed, qpack.c) stay on their
 * integer kernels up to RK_CPU_QPACK_MV_MAX_N rows instead of BLAS_MIN_N.
 * Every element of y is one dot product with a fixed order (see dot kernels),
 * whichever block, task or thread computes it, and whatever n is on this
 * path: a row of x gets the same bits alone or in a batch. (F32, F16 and
 * quantized rows get other bits on the two sides of BLAS_MIN_N; BF16 rows
 * on the tile get the same bits for every n.) */
#include <cblas.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#define BLAS_MIN_N       32  /* n from which sgemm beats the matvec kernel (measured: 24-32) */
#define MV_MAX_ROWS      512 /* rows of w per matvec task at most */
#define QUANT_POOL_MIN_N 4   /* rows of x from which their int8 quantization runs on the pool */

/* Return 1 when matmul takes the BLAS path for this shape (n alone decides). */
int rk_cpu_matmul_uses_blas(int n, int k, int m, rk_dtype wtype) {
    (void)k;
    (void)m;
    (void)wtype;
    return n >= BLAS_MIN_N;
}

/* ---------------------------------------------------------------- dot kernels */

/* The dot product of one row of x and one row of w, the same for every path:
 * four 8-lane FMA accumulators over 32-element steps, the remaining 8-element
 * steps into accumulators 0, 1, 2 in turn, then (a0 + a1) + (a2 + a3), the
 * fixed horizontal sum, and the scalar tail. One row of w is streamed at a
 * time (a single sequential stream is what the memory system serves best);
 * dot_2 computes the dots of one row of w with two rows of x at once. */
#ifdef __AVX2__
#define LOAD_F32(p) _mm256_loadu_ps(p)
#define LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD_BF16(p)                                                                               \
    _mm256_castsi256_ps(                                                                           \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))

#define DEF_DOT(NAME, T, LOAD, SCALAR)                                                             \
    static float NAME##_1(const float *x, const T *w, int k) {                                     \
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),              \
                       _mm256_setzero_ps()};                                                       \
        int j = 0;                                                                                 \
        for (; j + 32 <= k; j += 32)                                                               \
            for (int u = 0; u < 4; u++)                                                            \
                a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + j + 8 * u), LOAD(w + j + 8 * u), a[u]); \
        for (int u = 0; j + 8 <= k; j += 8, u++)                                                   \
            a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), LOAD(w + j), a[u]);                     \
        float s = rk_hsum256(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]))); \
        for (; j < k; j++) s += x[j] * SCALAR(w[j]);                                               \
        return s;                                                                                  \
    }                                                                                              \
    static void NAME##_2(const float *x0, const float *x1, const T *w, int k, float *out0,         \
                         float *out1) {                                                            \
        __m256 a[4], b[4];                                                                         \
        for (int u = 0; u < 4; u++) a[u] = b[u] = _mm256_setzero_ps();                             \
        int j = 0;                                                                                 \
        for (; j + 32 <= k; j += 32)                                                               \
            for (int u = 0; u < 4; u++) {                                                          \
                __m256 wv = LOAD(w + j + 8 * u);                                                   \
                a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + j + 8 * u), wv, a[u]);                 \
                b[u] = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + j + 8 * u), wv, b[u]);                 \
            }                                                                                      \
        for (int u = 0; j + 8 <= k; j += 8, u++) {                                                 \
            __m256 wv = LOAD(w + j);                                                               \
            a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + j), wv, a[u]);                             \
            b[u] = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + j), wv, b[u]);                             \
        }                                                                                          \
        float s0 =                                                                                 \
            rk_hsum256(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));       \
        float s1 =                                                                                 \
            rk_hsum256(_mm256_add_ps(_mm256_add_ps(b[0], b[1]), _mm256_add_ps(b[2], b[3])));       \
        for (; j < k; j++) {                                                                       \
            float wj = SCALAR(w[j]);                                                               \
            s0 += x0[j] * wj;                                                                      \
            s1 += x1[j] * wj;                                                                      \
        }                                                                                          \
        *out0 = s0;                                                                                \
        *out1 = s1;                                                                                \
    }
#else
/* Portable fallback: a plain ordered sum (the same in dot_1 and dot_2). */
#define DEF_DOT(NAME, T, LOAD, SCALAR)                                                             \
    static float NAME##_1(const float *x, const T *w, int k) {                                     \
        float s = 0.0f;                                                                            \
        for (int j = 0; j < k; j++) s += x[j] * SCALAR(w[j]);                                      \
        return s;                                                                                  \
    }                                                                                              \
    static void NAME##_2(const float *x0, const float *x1, const T *w, int k, float *out0,         \
                         float *out1) {                                                            \
        *out0 = NAME##_1(x0, w, k);                                                                \
        *out1 = NAME##_1(x1, w, k);                                                                \
    }
#endif

#define SCALAR_F32(v) (v)
DEF_DOT(dot_f32, float, LOAD_F32, SCALAR_F32)
DEF_DOT(dot_f16, uint16_t, LOAD_F16, rk_f16_to_f32)
DEF_DOT(dot_bf16, uint16_t, LOAD_BF16, rk_bf16_to_f32)

/* ---------------------------------------------------------------- matvec path */

typedef struct mv_ctx {
    float *y;
    const float *x;
    const void *w;
    rk_dtype wtype;
    int n, k, m;
    rk_q8_block *xq;  /* quantized weights: x quantized, (n, k / 32) */
    rk_q8k_block *xk; /* rk_cpu_act_is_q8k weights: x quantized, (n, k / 256), instead */
    int32_t *xs16;    /* packed Q6_K: 32 times each 16 quantized activations' sum, (n, k / 16) */
    rk_qdot_fn qdot;
    rk_qdotk_fn qdotk; /* with xk */
    int qpacked;       /* w packed by rk_cpu_qpack_group */
    int task_rows;     /* rows of w per task (mv_task_rows) */
} mv_ctx;

/* Rows of w per matvec task: two tasks a thread, at most MV_MAX_ROWS, a
 * multiple of 8 (a packed group). Each thread then streams long contiguous
 * runs of the weights: 64-row tasks, which the two threads took in turn,
 * decoded Q4_K_M at 54-56 tok/s where this gets 63-72 (docs/benchmarks.md).
 * Every row's dot product is the same whatever task computes it. */
static int mv_task_rows(int m, int n_threads) {
    int tasks = 2 * n_threads, rows = ((m + tasks - 1) / tasks + 7) / 8 * 8;
    return rows < MV_MAX_ROWS ? rows : MV_MAX_ROWS;
}

/* Rows [r0, r1) of w against every row of x: y(n, m) columns r0..r1-1. */
#define DEF_MV_ROWS(NAME, DOT, T)                                                                  \
    static void NAME(const mv_ctx *c, int r0, int r1) {                                            \
        const T *w = c->w;                                                                         \
        size_t k = (size_t)c->k, m = (size_t)c->m;                                                 \
        for (int r = r0; r < r1; r++) {                                                            \
            const T *wr = w + (size_t)r * k;                                                       \
            int i = 0;                                                                             \
            for (; i + 2 <= c->n; i += 2)                                                          \
                DOT##_2(c->x + i * k, c->x + (i + 1) * k, wr, c->k, c->y + i * m + r,              \
                        c->y + (i + 1) * m + r);                                                   \
            if (i < c->n) c->y[i * m + r] = DOT##_1(c->x + i * k, wr, c->k);                       \
        }                                                                                          \
    }
DEF_MV_ROWS(mv_rows_f32, dot_f32, float)
DEF_MV_ROWS(mv_rows_f16, dot_f16, uint16_t)
DEF_MV_ROWS(mv_rows_bf16, dot_bf16, uint16_t)

/* Quantized rows: each row of w against every quantized row of x. */
static void mv_rows_quant(const mv_ctx *c, int r0, int r1) {
    size_t row_bytes = rk_dtype_row_bytes(c->wtype, (size_t)c->k), nb = (size_t)c->k / 32;
    for (int r = r0; r < r1; r++) {
        const void *wr = (const unsigned char *)c->w + (size_t)r * row_bytes;
        if (c->xk)
            for (int i = 0; i < c->n; i++)
                c->y[(size_t)i * c->m + r] = c->qdotk(wr, c->xk + (size_t)i * (nb / 8), c->k);
        else
            for (int i = 0; i < c->n; i++)
                c->y[(size_t)i * c->m + r] = c->qdot(wr, c->xq + (size_t)i * nb, c->k);
    }
}

/* Task: quantize row i of x into c->xq. */
static void quant_row(void *p, int i, int tid) {
    (void)tid;
    const mv_ctx *c = p;
    size_t nb = (size_t)c->k / 32;
    if (c->xk) {
        rk_cpu_quantize_act_k(c->xk + (size_t)i * (nb / 8), c->x + (size_t)i * c->k, c->k);
        return;
    }
    rk_q8_block *xq = c->xq + (size_t)i * nb;
    rk_cpu_quantize_act(xq, c->x + (size_t)i * c->k, c->k, rk_cpu_act_is_q8_0(c->wtype));
    if (!c->xs16) return;
    int32_t *s = c->xs16 + (size_t)i * 2 * nb;
    for (size_t b = 0; b < nb; b++)
        for (int h = 0; h < 2; h++) {
            int sum = 0;
            for (int l = 0; l < 16; l++) sum += xq[b].q[16 * h + l];
            s[2 * b + h] = 32 * sum;
        }
}

static void mv_task(void *p, int task, int tid) {
    (void)tid;
    mv_ctx *c = p;
    int r0 = task * c->task_rows;
    int r1 = r0 + c->task_rows < c->m ? r0 + c->task_rows : c->m;
#ifdef RK_CPU_VNNI_KERNELS
    if (c->qpacked) {
        rk_cpu_qpack_matvec(c->y, c->w, c->wtype, c->xq, c->xk, c->xs16, c->n, c->k, c->m, r0 / 8,
                            (r1 + 7) / 8);
        return;
    }
#endif
    switch (c->wtype) {
    case RK_DTYPE_F32: mv_rows_f32(c, r0, r1); break;
    case RK_DTYPE_F16: mv_rows_f16(c, r0, r1); break;
    case RK_DTYPE_BF16: mv_rows_bf16(c, r0, r1); break;
    case RK_DTYPE_Q8_0:
    case RK_DTYPE_Q4_0:
    case RK_DTYPE_Q4_K:
    case RK_DTYPE_Q5_K:
    case RK_DTYPE_Q6_K:
    case RK_DTYPE_Q4_1:
    case RK_DTYPE_Q5_0:
    case RK_DTYPE_Q5_1:
    case RK_DTYPE_Q2_K:
    case RK_DTYPE_Q3_K:
    case RK_DTYPE_IQ4_NL:
    case RK_DTYPE_IQ4_XS:
    case RK_DTYPE_MXFP4: mv_rows_quant(c, r0, r1); break;
    }
}

/* ---------------------------------------------------------------- BLAS path */

/* Rows of w per sgemm call: the panel of f32 weights stays within about
 * 2 MiB (a per-thread scratch for F16/BF16), at most 256 rows, at least 16.
 * It depends on k only, so the split -- and the bits -- never depend on the
 * thread count. */
static int blas_panel_rows(int k) {
    size_t rows = ((size_t)2 << 20) / ((size_t)k * sizeof(float));
    if (rows > 256) rows = 256;
    if (rows < 16) rows = 16;
    return (int)rows;
}

/* dst(rows, k) = rows r0.. of w in f32: as stored, or (qpacked) packed by
 * rk_cpu_qpack_group; the same bits either way. */
static void dequant_rows(float *dst, const void *w, rk_dtype t, int qpacked, int k, int r0,
                         int rows) {
    if (qpacked)
        rk_cpu_qpack_dequant_rows(dst, w, t, k, r0, rows);
    else
        rk_dequantize(dst, (const unsigned char *)w + (size_t)r0 * rk_dtype_row_bytes(t, (size_t)k),
                      t, (size_t)rows * k);
}

typedef struct blas_ctx {
    rk_cpu *cpu;
    float *y;
    const float *x;
    const void *w;
    rk_dtype wtype;
    int qpacked; /* w packed by rk_cpu_qpack_group */
    int n, k, m, panel;
} blas_ctx;

/* One panel: y(n, cols) at column c0 = x(n, k) · w(rows c0.., k)^T with a
 * single-threaded sgemm (OpenBLAS runs in the calling pool thread). */
static void blas_task(void *p, int task, int tid) {
    blas_ctx *c = p;
    int c0 = task * c->panel;
    int cols = c->m - c0 < c->panel ? c->m - c0 : c->panel;
    size_t k = (size_t)c->k;
    const float *wp;
    if (c->wtype == RK_DTYPE_F32) {
        wp = (const float *)c->w + (size_t)c0 * k;
    } else {
        float *scratch = rk_cpu_scratch(c->cpu, tid); // (panel, k)
        dequant_rows(scratch, c->w, c->wtype, c->qpacked, c->k, c0, cols);
        wp = scratch;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, c->n, cols, c->k, 1.0f, c->x, c->k, wp,
                c->k, 0.0f, c->y + c0, c->m);
}

static rk_status matmul_blas(rk_cpu *cpu, float *y, const float *x, const void *w, rk_dtype wtype,
                             int qpacked, int n, int k, int m) {
    int panel = blas_panel_rows(k);
    if (wtype != RK_DTYPE_F32) {
        rk_status st = rk_cpu_reserve_scratch(cpu, (size_t)panel * k * sizeof(float));
        if (st != RK_OK) return st;
    }
    blas_ctx c = {cpu, y, x, w, wtype, qpacked, n, k, m, panel};
    rk_threadpool_run(cpu->pool, (m + panel - 1) / panel, blas_task, &c);
    return RK_OK;
}

/* ---------------------------------------------------------------- BF16 path */

#ifdef RK_CPU_BF16_KERNELS
#include <immintrin.h>

#define BF16_NR 64 /* columns of y (rows of w) per packed panel and micro-kernel tile */
#define BF16_MR 6  /* rows of x per micro-kernel tile: 6 x 4 accumulators */

/* With AVX-512 BF16, x is rounded to BF16 (round to nearest even) once per
 * matmul, rows padded with zeros to xs elements, and each weight meets it in
 * _mm512_dpbf16_ps: a lane accumulates two exact BF16 products into f32. The
 * result is the product on the rounded activations, so it differs from the
 * f32 one by at most 2^-8 of the sum of |x w| (a BF16 rounding is within
 * 2^-8 relative), plus the f32 summation error; the instruction flushes
 * subnormal inputs and results to zero.
 *
 * The weights are packed BF16_NR rows at a time, pair-interleaved: for each
 * pair p of k and each group of 16 rows, one vector holds (w[r][2p],
 * w[r][2p + 1]) for the 16 rows, so a 32-bit broadcast of (x[i][2p],
 * x[i][2p + 1]) times it adds 16 outputs' pair p at once. The micro-kernel
 * keeps a 6 x 64 tile of y in 24 registers over the whole of k; the packed
 * panel stays in L2 while every row of x passes. Every element of y is one
 * lane summing the pairs in order, so it does not depend on n, on the tile
 * it falls in or on the thread count. A model's BF16 weights are packed once
 * at load (rk_cpu_pack), so decode streams the packed panels from memory as
 * a matrix-vector kernel would stream the rows; weights given as stored are
 * packed a panel per task into scratch, with the same bits. Quantized
 * weights are packed per task from their rows dequantized and rounded to
 * BF16 (one more 2^-8 relative rounding per weight, below any of the
 * formats' own steps); their decode stays on the int8 kernels. */

/* Elements per row of the BF16 copy of x: k rounded up to 32. */
static size_t bf16_row_elems(int k) { return ((size_t)k + 31) / 32 * 32; }

typedef struct bf16_ctx {
    rk_cpu *cpu;
    float *y;
    const float *x;
    const void *w;
    rk_dtype wtype;         /* BF16, or quantized (prefill only) */
    int qpacked;            /* quantized w packed by rk_cpu_qpack_group */
    const uint32_t *packed; /* the whole of w packed (rk_cpu_pack), or NULL: packed per task */
    uint16_t *xb;           /* (n, xs) BF16 copy of x */
    size_t xs;
    int n, k, m;
} bf16_ctx;

/* dst(n) = src(n) rounded to BF16 by the instruction, 16 at a time: the bits
 * of rk_cpu_from_f32 for every normal, zero, infinite or NaN value, and 0 of
 * the same sign for a subnormal one, which is what _mm512_dpbf16_ps reads
 * the software's BF16 subnormal as. */
RK_CPU_BF16_TARGET static void bf16_round(uint16_t *dst, const float *src, size_t n) {
    size_t j = 0;
    for (; j + 16 <= n; j += 16)
        _mm256_storeu_si256((__m256i *)(dst + j),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + j)));
    if (j < n) {
        __mmask16 m = (__mmask16)((1u << (n - j)) - 1);
        __m256i r = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + j));
        _mm256_mask_storeu_epi16(dst + j, m, r);
    }
}

/* Row i of x rounded to BF16, zero-padded to xs elements. */
static void bf16_round_row(void *p, int i, int tid) {
    (void)tid;
    const bf16_ctx *c = p;
    uint16_t *dst = c->xb + (size_t)i * c->xs;
    bf16_round(dst, c->x + (size_t)i * c->k, (size_t)c->k);
    memset(dst + c->k, 0, (c->xs - (size_t)c->k) * sizeof(uint16_t));
}

/* What packing needs: AVX-512 shuffles alone, so that the tile without the
 * BF16 instructions (below) packs the same way. */
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))

#define BF16_LOAD(p)       ((__m512bh)_mm512_loadu_si512(p))
#define BF16_DP(acc, a, b) _mm512_dpbf16_ps(acc, a, b)
/* Transpose 16 x 16 dwords in place: r[l] element j becomes r[j] element l
 * (pairs within 128-bit lanes, then quarters of lanes, then lanes). */
AVX512_TARGET static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4i + j]: column j of each 128-bit lane, rows 4i .. 4i + 3 */
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        __m512i x0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
        __m512i x1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
        __m512i y0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        __m512i y1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
        r[j] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
        r[8 + j] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
    }
}

/* Pack group g of a panel into dst: for pair p, the 16 dwords
 * (w[l][2p], w[l][2p + 1]) of rows l = 0..15 of rows (ld elements apart) at
 * dst + 16 (4p + g); rows from left on and the element past an odd k are 0.
 * A panel is groups 0..3 of BF16_NR rows. Each row is read in order, 16
 * pairs at a time, and the 16 x 16 block transposed in registers. */
AVX512_TARGET static void bf16_pack_group(uint32_t *dst, const uint16_t *rows, size_t ld, int k,
                                          int g, int left) {
    int pairs = k / 2, kp = (k + 1) / 2;
    for (int p0 = 0; p0 < pairs; p0 += 16) {
        int np = pairs - p0 < 16 ? pairs - p0 : 16;
        __mmask16 lm = np == 16 ? (__mmask16)0xffff : (__mmask16)((1u << np) - 1);
        __m512i r[16];
        for (int l = 0; l < 16; l++)
            r[l] = l < left ? _mm512_maskz_loadu_epi32(lm, rows + (size_t)l * ld + 2 * (size_t)p0)
                            : _mm512_setzero_si512();
        transpose16_epi32(r);
        for (int j = 0; j < np; j++) _mm512_storeu_si512(dst + 16 * (4 * (p0 + j) + g), r[j]);
    }
    if (kp > pairs) { /* odd k: the last element alone, its partner 0 */
        uint32_t *o = dst + 16 * (4 * pairs + g);
        for (int l = 0; l < 16; l++) o[l] = l < left ? rows[(size_t)l * ld + (size_t)(k - 1)] : 0;
    }
}

/* Two BF16 elements of x read as one dword (an alias of the uint16_t array). */
typedef uint32_t __attribute__((may_alias)) bf16_pair;

/* A tile's accumulators acc[MR][4] into its rows of y (ldy apart), the
 * first cols columns. */
#define STORE_TILE(MR)                                                                             \
    for (int u = 0; u < 4; u++) {                                                                  \
        int left = cols - 16 * u;                                                                  \
        if (left <= 0) break;                                                                      \
        __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);           \
        for (int r = 0; r < MR; r++)                                                               \
            _mm512_mask_storeu_ps(y + (size_t)r * ldy + 16 * u, mask, acc[r][u]);                  \
    }

/* y rows [0, MR) x columns [0, cols) of the tile = x rows (xs elements
 * apart) . packed panel, over kp pairs. MR is a constant at every call, so
 * the row loops unroll and the accumulators stay in registers. */
#define DEF_BF16_TILE(MR)                                                                          \
    RK_CPU_BF16_TARGET static void bf16_tile_##MR(const uint16_t *x, size_t xs,                    \
                                                  const uint32_t *wp, int kp, float *y,            \
                                                  size_t ldy, int cols) {                          \
        __m512 acc[MR][4];                                                                         \
        for (int r = 0; r < MR; r++)                                                               \
            for (int u = 0; u < 4; u++) acc[r][u] = _mm512_setzero_ps();                           \
        const bf16_pair *xr[MR];                                                                   \
        for (int r = 0; r < MR; r++) xr[r] = (const bf16_pair *)(x + (size_t)r * xs);              \
        for (int p = 0; p < kp; p++, wp += 64) {                                                   \
            __m512bh w0 = BF16_LOAD(wp), w1 = BF16_LOAD(wp + 16), w2 = BF16_LOAD(wp + 32),         \
                     w3 = BF16_LOAD(wp + 48);                                                      \
            for (int r = 0; r < MR; r++) {                                                         \
                __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xr[r][p]);                          \
                acc[r][0] = BF16_DP(acc[r][0], xv, w0);                                            \
                acc[r][1] = BF16_DP(acc[r][1], xv, w1);                                            \
                acc[r][2] = BF16_DP(acc[r][2], xv, w2);                                            \
                acc[r][3] = BF16_DP(acc[r][3], xv, w3);                                            \
            }                                                                                      \
        }                                                                                          \
        STORE_TILE(MR);                                                                            \
    }
DEF_BF16_TILE(1)
DEF_BF16_TILE(2)
DEF_BF16_TILE(3)
DEF_BF16_TILE(4)
DEF_BF16_TILE(5)
DEF_BF16_TILE(6)

/* Pack rows [c0, c0 + cols) of quantized weights, 16 at a time: each row
 * dequantized to f32 in row and rounded to BF16 into rows16 (16 rows of k),
 * then packed as BF16 weights are. */
RK_CPU_BF16_TARGET static void bf16_pack_quant(uint32_t *dst, const void *w, rk_dtype t,
                                               int qpacked, int k, int c0, int cols, float *row,
                                               uint16_t *rows16) {
    for (int g = 0; g < BF16_NR / 16; g++) {
        int left = cols - 16 * g;
        for (int l = 0; l < 16 && l < left; l++) {
            dequant_rows(row, w, t, qpacked, k, c0 + 16 * g + l, 1);
            bf16_round(rows16 + (size_t)l * k, row, (size_t)k);
        }
        bf16_pack_group(dst, rows16, (size_t)k, k, g, left);
    }
}

/* Columns [c0, c0 + cols) of y for every row of x, from the packed panel wp. */
RK_CPU_BF16_TARGET static void bf16_tiles(const bf16_ctx *c, const uint32_t *wp, int c0, int cols) {
    int kp = (c->k + 1) / 2;
    size_t m = (size_t)c->m;
    for (int i = 0; i < c->n; i += BF16_MR) {
        const uint16_t *xi = c->xb + (size_t)i * c->xs;
        float *yi = c->y + (size_t)i * m + c0;
        switch (c->n - i < BF16_MR ? c->n - i : BF16_MR) {
        case 1: bf16_tile_1(xi, c->xs, wp, kp, yi, m, cols); break;
        case 2: bf16_tile_2(xi, c->xs, wp, kp, yi, m, cols); break;
        case 3: bf16_tile_3(xi, c->xs, wp, kp, yi, m, cols); break;
        case 4: bf16_tile_4(xi, c->xs, wp, kp, yi, m, cols); break;
        case 5: bf16_tile_5(xi, c->xs, wp, kp, yi, m, cols); break;
        default: bf16_tile_6(xi, c->xs, wp, kp, yi, m, cols); break;
        }
    }
}

/* Task: columns [c0, c0 + BF16_NR) of y for every row of x. */
RK_CPU_BF16_TARGET static void bf16_gemm_task(void *p, int task, int tid) {
    const bf16_ctx *c = p;
    int c0 = task * BF16_NR;
    int cols = c->m - c0 < BF16_NR ? c->m - c0 : BF16_NR;
    int kp = (c->k + 1) / 2;
    if (c->packed) {
        bf16_tiles(c, c->packed + (size_t)task * kp * BF16_NR, c0, cols);
        return;
    }
    /* (kp, BF16_NR) dwords; for quantized weights then a row of f32 and
     * 16 rows of BF16 */
    uint32_t *wp = rk_cpu_scratch(c->cpu, tid);
    if (c->wtype == RK_DTYPE_BF16) {
        const uint16_t *panel = (const uint16_t *)c->w + (size_t)c0 * c->k;
        for (int g = 0; g < BF16_NR / 16; g++)
            bf16_pack_group(wp, panel + (size_t)16 * g * c->k, (size_t)c->k, c->k, g,
                            cols - 16 * g);
    } else {
        float *row = (float *)(wp + (size_t)kp * BF16_NR);
        bf16_pack_quant(wp, c->w, c->wtype, c->qpacked, c->k, c0, cols, row,
                        (uint16_t *)(row + c->k));
    }
    bf16_tiles(c, wp, c0, cols);
}

/* y = x . w^T on the tile: w packed whole (packed), or packed a panel per task. */
static rk_status matmul_bf16(rk_cpu *cpu, float *y, const float *x, const void *w,
                             const uint32_t *packed, rk_dtype wtype, int qpacked, int n, int k,
                             int m) {
    bf16_ctx c = {cpu, y, x, w, wtype, qpacked, packed, NULL, bf16_row_elems(k), n, k, m};
    void *xb;
    rk_status st = rk_cpu_reserve_shared(cpu, (size_t)n * c.xs * sizeof(uint16_t), &xb);
    if (st != RK_OK) return st;
    c.xb = xb;
    if (n < QUANT_POOL_MIN_N)
        for (int i = 0; i < n; i++) bf16_round_row(&c, i, 0);
    else
        rk_threadpool_run(cpu->pool, n, bf16_round_row, &c);
    if (!packed) {
        /* the packed panel, then (quantized weights) a row in f32 and in BF16 */
        size_t panel = (size_t)(k + 1) / 2 * BF16_NR * sizeof(uint32_t);
        if (wtype != RK_DTYPE_BF16)
            panel += (size_t)k * sizeof(float) + (size_t)16 * k * sizeof(uint16_t);
        st = rk_cpu_reserve_scratch(cpu, panel);
        if (st != RK_OK) return st;
    }
    rk_threadpool_run(cpu->pool, (m + BF16_NR - 1) / BF16_NR, bf16_gemm_task, &c);
    return RK_OK;
}

typedef struct bf16_pack_ctx {
    uint32_t *dst;
    const uint16_t *w;
    int k, m;
} bf16_pack_ctx;

/* Task: panel `task` of w(m, k) packed into its place in dst. */
RK_CPU_BF16_TARGET static void bf16_pack_task(void *p, int task, int tid) {
    (void)tid;
    const bf16_pack_ctx *c = p;
    int c0 = task * BF16_NR, cols = c->m - c0 < BF16_NR ? c->m - c0 : BF16_NR;
    uint32_t *dst = c->dst + (size_t)task * ((size_t)(c->k + 1) / 2 * BF16_NR);
    const uint16_t *panel = c->w + (size_t)c0 * c->k;
    for (int g = 0; g < BF16_NR / 16; g++)
        bf16_pack_group(dst, panel + (size_t)16 * g * c->k, (size_t)c->k, c->k, g, cols - 16 * g);
}

/* ------------------------------------------------ BF16 path without the instructions */

/* Where the CPU has AVX-512 but not its BF16 instructions, BF16 weights on
 * the prefill side (n >= BLAS_MIN_N) take the same packed panels, packed a
 * panel per task, and a tile that widens each weight pair in registers: the
 * pair's first element (the low half of the dword) by a 16-bit shift, the
 * second by clearing the low half. x stays f32 and meets them in two FMAs a
 * pair. The sgemm path pays a copy of the weights in f32 and OpenBLAS's own
 * packing of it on every call, whatever n: on a 2-core Xeon, 2.3 ms of a
 * 1024 x 3072 call at 33 rows (docs/benchmarks.md). Every element of y is
 * one lane summing the pairs in order, so it does not depend on n (on this
 * side of BLAS_MIN_N), on the tile or on the thread count. Four rows of x a
 * tile: 16 accumulators, the four dwords of weights and their widened
 * halves stay in the 32 registers. */
#define BF16E_MR 4

#define DEF_BF16E_TILE(MR)                                                                         \
    AVX512_TARGET static void bf16e_tile_##MR(                                                     \
        const float *x, size_t xs, int k, const uint32_t *wp, float *y, size_t ldy, int cols) {    \
        __m512 acc[MR][4];                                                                         \
        for (int r = 0; r < MR; r++)                                                               \
            for (int u = 0; u < 4; u++) acc[r][u] = _mm512_setzero_ps();                           \
        const __m512i high = _mm512_set1_epi32((int)0xffff0000u);                                  \
        int kp = (k + 1) / 2;                                                                      \
        for (int p = 0; p < kp; p++, wp += 64) {                                                   \
            __m512i w[4] = {_mm512_loadu_si512(wp), _mm512_loadu_si512(wp + 16),                   \
                            _mm512_loadu_si512(wp + 32), _mm512_loadu_si512(wp + 48)};             \
            __m512 lo[4];                                                                          \
            for (int u = 0; u < 4; u++) lo[u] = _mm512_castsi512_ps(_mm512_slli_epi32(w[u], 16));  \
            for (int r = 0; r < MR; r++) {                                                         \
                __m512 xv = _mm512_set1_ps(x[(size_t)r * xs + 2 * (size_t)p]);                     \
                for (int u = 0; u < 4; u++) acc[r][u] = _mm512_fmadd_ps(xv, lo[u], acc[r][u]);     \
            }                                                                                      \
            if (2 * p + 1 == k) break; /* odd k: the last pair's second element is 0 */            \
            for (int u = 0; u < 4; u++) lo[u] = _mm512_castsi512_ps(_mm512_and_si512(w[u], high)); \
            for (int r = 0; r < MR; r++) {                                                         \
                __m512 xv = _mm512_set1_ps(x[(size_t)r * xs + 2 * (size_t)p + 1]);                 \
                for (int u = 0; u < 4; u++) acc[r][u] = _mm512_fmadd_ps(xv, lo[u], acc[r][u]);     \
            }                                                                                      \
        }                                                                                          \
        STORE_TILE(MR);                                                                            \
    }
DEF_BF16E_TILE(1)
DEF_BF16E_TILE(2)
DEF_BF16E_TILE(3)
DEF_BF16E_TILE(4)

/* Task: columns [c0, c0 + BF16_NR) of y for every row of x, from the panel
 * packed into this thread's scratch. */
AVX512_TARGET static void bf16e_gemm_task(void *p, int task, int tid) {
    const bf16_ctx *c = p;
    int c0 = task * BF16_NR, cols = c->m - c0 < BF16_NR ? c->m - c0 : BF16_NR;
    uint32_t *wp = rk_cpu_scratch(c->cpu, tid);
    const uint16_t *panel = (const uint16_t *)c->w + (size_t)c0 * c->k;
    for (int g = 0; g < BF16_NR / 16; g++)
        bf16_pack_group(wp, panel + (size_t)16 * g * c->k, (size_t)c->k, c->k, g, cols - 16 * g);
    size_t m = (size_t)c->m, xs = (size_t)c->k;
    for (int i = 0; i < c->n; i += BF16E_MR) {
        const float *xi = c->x + (size_t)i * xs;
        float *yi = c->y + (size_t)i * m + c0;
        switch (c->n - i < BF16E_MR ? c->n - i : BF16E_MR) {
        case 1: bf16e_tile_1(xi, xs, c->k, wp, yi, m, cols); break;
        case 2: bf16e_tile_2(xi, xs, c->k, wp, yi, m, cols); break;
        case 3: bf16e_tile_3(xi, xs, c->k, wp, yi, m, cols); break;
        default: bf16e_tile_4(xi, xs, c->k, wp, yi, m, cols); break;
        }
    }
}

/* y = x . w^T for BF16 w as stored, on the tile without BF16 instructions. */
static rk_status matmul_bf16e(rk_cpu *cpu, float *y, const float *x, const void *w, int n, int k,
                              int m) {
    bf16_ctx c = {cpu, y, x, w, RK_DTYPE_BF16, 0, NULL, NULL, 0, n, k, m};
    rk_status st = rk_cpu_reserve_scratch(cpu, (size_t)(k + 1) / 2 * BF16_NR * sizeof(uint32_t));
    if (st != RK_OK) return st;
    rk_threadpool_run(cpu->pool, (m + BF16_NR - 1) / BF16_NR, bf16e_gemm_task, &c);
    return RK_OK;
}
#endif

/* ---------------------------------------------------------------- entry */

/* y = x . w^T with w as stored, or (qpacked) quantized w packed by
 * rk_cpu_qpack_group. */
static rk_status matmul_any(rk_cpu *cpu, float *y, const float *x, const void *w, rk_dtype wtype,
                            int qpacked, int n, int k, int m) {
    int blas = qpacked ? n >= RK_CPU_QPACK_MV_MAX_N : rk_cpu_matmul_uses_blas(n, k, m, wtype);
#ifdef RK_CPU_BF16_KERNELS
    if (rk_cpu_isa_active() == RK_CPU_ISA_AVX512_BF16 &&
        (wtype == RK_DTYPE_BF16 || (rk_dtype_is_quant(wtype) && blas)))
        return matmul_bf16(cpu, y, x, w, NULL, wtype, qpacked, n, k, m);
    if (rk_cpu_isa_active() == RK_CPU_ISA_AVX512_VNNI && wtype == RK_DTYPE_BF16 && blas)
        return matmul_bf16e(cpu, y, x, w, n, k, m);
#endif
    if (blas) return matmul_blas(cpu, y, x, w, wtype, qpacked, n, k, m);
    mv_ctx c = {.y = y,
                .x = x,
                .w = w,
                .wtype = wtype,
                .n = n,
                .k = k,
                .m = m,
                .qpacked = qpacked,
                .task_rows = mv_task_rows(m, rk_threadpool_size(cpu->pool))};
    if (rk_dtype_is_quant(wtype)) {
        size_t nb = (size_t)k / 32, bytes = (size_t)n * nb * sizeof(rk_q8_block);
        if (rk_cpu_act_is_q8k(wtype)) bytes = (size_t)n * (nb / 8) * sizeof(rk_q8k_block);
        int sums = qpacked && wtype == RK_DTYPE_Q6_K;
        void *xq;
        rk_status st = rk_cpu_reserve_shared(
            cpu, bytes + (sums ? (size_t)n * 2 * nb * sizeof(int32_t) : 0), &xq);
        if (st != RK_OK) return st;
        if (rk_cpu_act_is_q8k(wtype))
            c.xk = xq;
        else
            c.xq = xq;
        if (sums) c.xs16 = (int32_t *)((unsigned char *)xq + bytes);
        /* A few rows are quicker quantized here than handed to the pool. */
        if (n < QUANT_POOL_MIN_N)
            for (int i = 0; i < n; i++) quant_row(&c, i, 0);
        else
            rk_threadpool_run(cpu->pool, n, quant_row, &c);
        c.qdot = rk_cpu_qdot_fn(wtype);
        c.qdotk = rk_cpu_qdotk_fn(wtype);
    }
    rk_threadpool_run(cpu->pool, (m + c.task_rows - 1) / c.task_rows, mv_task, &c);
    return RK_OK;
}

rk_status rk_cpu_matmul(rk_backend *be, float *y, const float *x, const void *w, rk_dtype wtype,
                        int n, int k, int m) {
    rk_status st = rk_matmul_check(wtype, n, k, m);
    if (st) return st;
    if (n == 0 || m == 0) return RK_OK;
    if (k == 0) {
        memset(y, 0, (size_t)n * m * sizeof(float));
        return RK_OK;
    }
    return matmul_any(be->impl, y, x, w, wtype, 0, n, k, m);
}

/* ---------------------------------------------------------------- packed weights */

/* BF16 weights are packed for the tile kernel (AVX-512 BF16); Q8_0, Q3_K,
 * Q4_K, Q6_K and MXFP4 ones for the VNNI integer kernels (qpack.c). */
size_t rk_cpu_packed_bytes(rk_backend *be, rk_dtype wtype, int k, int m) {
    (void)be;
    if (k <= 0 || m <= 0) return 0;
    if (rk_dtype_is_quant(wtype))
        return rk_cpu_qpack_supported(wtype) ? rk_cpu_qpack_bytes(wtype, k, m) : 0;
#ifdef RK_CPU_BF16_KERNELS
    if (wtype == RK_DTYPE_BF16 && rk_cpu_isa_active() == RK_CPU_ISA_AVX512_BF16)
        return (size_t)(m + BF16_NR - 1) / BF16_NR * ((size_t)(k + 1) / 2) * BF16_NR *
               sizeof(uint32_t);
#endif
    return 0;
}

/* Rows r0.. start a unit of the layout at a multiple of its rows: 8 for the
 * quantized groups, BF16_NR for the BF16 panels; each unit's bytes do not
 * depend on m, so the offset is the size of r0 rows packed. */
size_t rk_cpu_packed_offset(rk_backend *be, rk_dtype wtype, int k, int r0) {
    if (r0 == 0) return 0;
    int unit = rk_dtype_is_quant(wtype) ? 8 : 0;
#ifdef RK_CPU_BF16_KERNELS
    if (wtype == RK_DTYPE_BF16) unit = BF16_NR;
#endif
    if (r0 < 0 || !unit || r0 % unit) return SIZE_MAX;
    size_t bytes = rk_cpu_packed_bytes(be, wtype, k, r0);
    return bytes ? bytes : SIZE_MAX;
}

typedef struct qpack_ctx {
    void *dst;
    const void *w;
    rk_dtype t;
    int k, m;
} qpack_ctx;

static void qpack_task(void *p, int task, int tid) {
    (void)tid;
    const qpack_ctx *c = p;
    rk_cpu_qpack_group(c->dst, c->w, c->t, c->k, c->m, task);
}

rk_status rk_cpu_pack(rk_backend *be, void *dst, const void *w, rk_dtype wtype, int k, int m) {
    if (rk_cpu_packed_bytes(be, wtype, k, m) == 0)
        return rk_errorf(RK_ERR_INVALID, "pack: %s weights of %d x %d are not packed here",
                         rk_dtype_name(wtype), m, k);
    rk_cpu *cpu = be->impl;
    if (rk_dtype_is_quant(wtype)) {
        qpack_ctx c = {dst, w, wtype, k, m};
        rk_threadpool_run(cpu->pool, (m + 7) / 8, qpack_task, &c);
        return RK_OK;
    }
#ifdef RK_CPU_BF16_KERNELS
    bf16_pack_ctx c = {dst, w, k, m};
    rk_threadpool_run(cpu->pool, (m + BF16_NR - 1) / BF16_NR, bf16_pack_task, &c);
#endif
    return RK_OK;
}

rk_status rk_cpu_matmul_packed(rk_backend *be, float *y, const float *x, const void *packed,
                               rk_dtype wtype, int n, int k, int m) {
    if (n < 0 || k <= 0 || m <= 0)
        return rk_errorf(RK_ERR_INVALID, "matmul_packed: bad shape n=%d k=%d m=%d", n, k, m);
    if (n == 0) return RK_OK;
    if (rk_dtype_is_quant(wtype)) return matmul_any(be->impl, y, x, packed, wtype, 1, n, k, m);
#ifdef RK_CPU_BF16_KERNELS
    if (wtype == RK_DTYPE_BF16)
        return matmul_bf16(be->impl, y, x, NULL, packed, RK_DTYPE_BF16, 0, n, k, m);
#endif
    (void)y;
    (void)x;
    (void)packed;
    return rk_errorf(RK_ERR_UNSUPPORTED, "matmul_packed: no packed layout for %s here",
                     rk_dtype_name(wtype));
}
