/* kernels/cpu/backend.c — the CPU backend: creation, host memory, per-thread
 * scratch, dtype conversions and the element-wise ops (add_bias, add, rmsnorm,
 * embed, rope, swiglu). matmul lives in matmul.c, attention in attention.c,
 * kv_write and rope_shift_copy in kvops.c. */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kernels/cpu/cpu.h"

#define ALIGN      64
#define HUGE_MIN   ((size_t)4 << 20) /* allocations from this size ask for huge pages */
#define HUGE_ALIGN ((size_t)2 << 20)

/* ---------------------------------------------------------------- memory */

static rk_cpu *cpu_of(rk_backend *be) { return (rk_cpu *)be->impl; }

static void *aligned_bytes(size_t n_bytes) {
    size_t n = n_bytes ? n_bytes : 1;
    if (n > SIZE_MAX - ALIGN) return NULL;
    n = (n + ALIGN - 1) / ALIGN * ALIGN;
    return aligned_alloc(ALIGN, n);
}

/* Large buffers (weights, the KV arena) are 2 MiB aligned and advised to use
 * transparent huge pages: attention reads one head of every kv entry, a page
 * apart, and would otherwise miss the TLB on nearly every entry. Their pages
 * are then faulted in by the populator's thread (populate.c), not by a
 * forward pass. */
static rk_status cpu_alloc(rk_backend *be, size_t n_bytes, void **out) {
    if (n_bytes >= HUGE_MIN && n_bytes <= SIZE_MAX - HUGE_ALIGN) {
        size_t n = (n_bytes + HUGE_ALIGN - 1) / HUGE_ALIGN * HUGE_ALIGN;
        *out = aligned_alloc(HUGE_ALIGN, n);
        if (*out) {
            (void)madvise(*out, n, MADV_HUGEPAGE); /* advice only: failure is harmless */
            rk_populator_add(cpu_of(be)->populate, *out, n);
        }
    } else {
        *out = aligned_bytes(n_bytes);
    }
    if (!*out) return rk_errorf(RK_ERR_NOMEM, "cpu: cannot allocate %zu bytes", n_bytes);
    return RK_OK;
}

static void cpu_free(rk_backend *be, void *p) {
    rk_populator_forget(cpu_of(be)->populate, p);
    free(p);
}

static rk_status cpu_copy(rk_backend *be, void *dst, const void *src, size_t n_bytes) {
    (void)be;
    if (n_bytes) memcpy(dst, src, n_bytes);
    return RK_OK;
}

static rk_status cpu_memset(rk_backend *be, void *dst, int value, size_t n_bytes) {
    (void)be;
    if (n_bytes) memset(dst, value, n_bytes);
    return RK_OK;
}

static rk_status cpu_sync(rk_backend *be) {
    (void)be;
    return RK_OK;
}

/* Grow every thread's scratch to n_bytes (page-separated); keeps the old
 * scratch and returns RK_ERR_NOMEM when that fails. */
rk_status rk_cpu_reserve_scratch(rk_cpu *cpu, size_t n_bytes) {
    if (n_bytes <= cpu->scratch_stride) return RK_OK;
    size_t stride = (n_bytes + 4095) / 4096 * 4096; /* separate pages: no false sharing */
    if (stride > SIZE_MAX / (size_t)cpu->n_threads)
        return rk_errorf(RK_ERR_NOMEM, "cpu: scratch of %zu bytes per thread is too large",
                         n_bytes);
    unsigned char *p = aligned_bytes(stride * (size_t)cpu->n_threads);
    if (!p)
        return rk_errorf(RK_ERR_NOMEM, "cpu: cannot allocate %zu bytes of scratch per thread",
                         stride);
    free(cpu->scratch);
    cpu->scratch = p;
    cpu->scratch_stride = stride;
    return RK_OK;
}

/* Grow the shared scratch to n_bytes and return it in *out (the backend owns
 * it); RK_ERR_NOMEM when that fails. */
rk_status rk_cpu_reserve_shared(rk_cpu *cpu, size_t n_bytes, void **out) {
    if (n_bytes > cpu->shared_cap) {
        size_t cap = n_bytes + n_bytes / 4;
        if (cap < n_bytes) cap = n_bytes;
        unsigned char *p = aligned_bytes(cap);
        if (!p) return rk_errorf(RK_ERR_NOMEM, "cpu: cannot allocate %zu bytes of scratch", cap);
        free(cpu->shared);
        cpu->shared = p;
        cpu->shared_cap = cap;
    }
    *out = cpu->shared;
    return RK_OK;
}

/* ---------------------------------------------------------------- conversions */

void rk_cpu_to_f32(float *dst, const void *src, rk_dtype dtype, size_t n) {
    size_t i = 0;
    if (dtype == RK_DTYPE_F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    if (dtype == RK_DTYPE_Q8_0) { /* KV rows: whole blocks */
        rk_dequantize(dst, src, dtype, n);
        return;
    }
    const uint16_t *s = src;
#ifdef __AVX2__
    if (dtype == RK_DTYPE_F16) {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    } else {
        for (; i + 8 <= n; i += 8) {
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
    }
#endif
    if (dtype == RK_DTYPE_F16)
        for (; i < n; i++) dst[i] = rk_f16_to_f32(s[i]);
    else
        for (; i < n; i++) dst[i] = rk_bf16_to_f32(s[i]);
}

/* Narrow n f32 elements to dtype with round-to-nearest-even, bit-identical
 * to the scalar conversions. */
void rk_cpu_from_f32(void *dst, const float *src, rk_dtype dtype, size_t n) {
    size_t i = 0;
    if (dtype == RK_DTYPE_F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    if (dtype == RK_DTYPE_Q8_0) { /* KV rows: whole blocks, one f16 scale each */
        rk_quantize(dst, src, dtype, n);
        return;
    }
    uint16_t *d = dst;
#ifdef __AVX2__
    if (dtype == RK_DTYPE_F16) {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
        const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
        const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
        const __m256i inf = _mm256_set1_epi32(0x7f800000), quiet = _mm256_set1_epi32(0x40);
        for (; i + 8 <= n; i += 8) {
            __m256i x = _mm256_castps_si256(_mm256_loadu_ps(src + i));
            __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), one);
            __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(bias, lsb)), 16);
            __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), inf);
            __m256i nan_r = _mm256_or_si256(_mm256_srli_epi32(x, 16), quiet);
            r = _mm256_blendv_epi8(r, nan_r, is_nan);
            __m256i packed = _mm256_packus_epi32(r, r); /* values fit in 16 bits: exact */
            packed = _mm256_permute4x64_epi64(packed, 0x08);
            _mm_storeu_si128((__m128i *)(d + i), _mm256_castsi256_si128(packed));
        }
    }
#endif
    if (dtype == RK_DTYPE_F16)
        for (; i < n; i++) d[i] = rk_f32_to_f16(src[i]);
    else
        for (; i < n; i++) d[i] = rk_f32_to_bf16(src[i]);
}

/* exp over an array with the lane-independent vector exp (expf without
 * AVX2). */
void rk_cpu_exp(float *dst, const float *src, size_t n) {
#ifdef __AVX2__
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, rk_exp256(_mm256_loadu_ps(src + i)));
    if (i < n) {
        float tmp[8] = {0};
        for (size_t j = i; j < n; j++) tmp[j - i] = src[j];
        _mm256_storeu_ps(tmp, rk_exp256(_mm256_loadu_ps(tmp)));
        for (size_t j = i; j < n; j++) dst[j] = tmp[j - i];
    }
#else
    for (size_t i = 0; i < n; i++) dst[i] = expf(src[i]);
#endif
}

/* ---------------------------------------------------------------- element-wise ops */

/* Rows per task for row-parallel ops: about 64 KiB of work per task. */
static int rows_per_task(int rows, size_t row_elems) {
    size_t per = row_elems ? (16384 + row_elems - 1) / row_elems : 1;
    if (per < 1) per = 1;
    if (per > (size_t)rows) per = (size_t)rows;
    return (int)per;
}

typedef struct bias_ctx {
    float *y;
    const float *b;
    int n, m, rows_per;
} bias_ctx;

static void bias_task(void *p, int task, int tid) {
    (void)tid;
    bias_ctx *c = p;
    int r0 = task * c->rows_per, r1 = r0 + c->rows_per < c->n ? r0 + c->rows_per : c->n;
    for (int r = r0; r < r1; r++) {
        float *row = c->y + (size_t)r * c->m;
        for (int j = 0; j < c->m; j++) row[j] += c->b[j];
    }
}

static rk_status cpu_add_bias(rk_backend *be, float *y, const float *b, int n, int m) {
    if (n < 0 || m < 0) return rk_errorf(RK_ERR_INVALID, "add_bias: negative shape %d x %d", n, m);
    if (n == 0 || m == 0) return RK_OK;
    bias_ctx c = {y, b, n, m, rows_per_task(n, (size_t)m)};
    rk_threadpool_run(cpu_of(be)->pool, (n + c.rows_per - 1) / c.rows_per, bias_task, &c);
    return RK_OK;
}

#define ELEMS_PER_TASK 32768

typedef struct add_ctx {
    float *y;
    const float *x;
    size_t n;
} add_ctx;

static void add_task(void *p, int task, int tid) {
    (void)tid;
    add_ctx *c = p;
    size_t i0 = (size_t)task * ELEMS_PER_TASK;
    size_t i1 = i0 + ELEMS_PER_TASK < c->n ? i0 + ELEMS_PER_TASK : c->n;
    for (size_t i = i0; i < i1; i++) c->y[i] += c->x[i];
}

static rk_status cpu_add(rk_backend *be, float *y, const float *x, size_t n) {
    if (n == 0) return RK_OK;
    size_t n_tasks = (n + ELEMS_PER_TASK - 1) / ELEMS_PER_TASK;
    if (n_tasks > INT32_MAX) return rk_errorf(RK_ERR_INVALID, "add: %zu elements is too many", n);
    add_ctx c = {y, x, n};
    rk_threadpool_run(cpu_of(be)->pool, (int)n_tasks, add_task, &c);
    return RK_OK;
}

typedef struct rmsnorm_ctx {
    float *out;
    const float *x, *w;
    int rows, dim, rows_per;
    float eps;
} rmsnorm_ctx;

/* Sum of squares in a fixed order: 8 lanes of partial sums, then the lanes,
 * then the scalar tail. */
static float sum_squares(const float *x, int n) {
    int i = 0;
    float s = 0.0f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    s = rk_hsum256(acc);
#endif
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

static void rmsnorm_task(void *p, int task, int tid) {
    (void)tid;
    rmsnorm_ctx *c = p;
    int r0 = task * c->rows_per, r1 = r0 + c->rows_per < c->rows ? r0 + c->rows_per : c->rows;
    for (int r = r0; r < r1; r++) {
        const float *x = c->x + (size_t)r * c->dim;
        float *o = c->out + (size_t)r * c->dim;
        float ss = sum_squares(x, c->dim);
        float inv = 1.0f / sqrtf(ss / (float)c->dim + c->eps);
        for (int j = 0; j < c->dim; j++) o[j] = x[j] * inv * c->w[j];
    }
}

static rk_status cpu_rmsnorm(rk_backend *be, float *out, const float *x, const float *w, int rows,
                             int dim, float eps) {
    if (rows < 0 || dim <= 0)
        return rk_errorf(RK_ERR_INVALID, "rmsnorm: bad shape %d x %d", rows, dim);
    if (rows == 0) return RK_OK;
    rmsnorm_ctx c = {out, x, w, rows, dim, rows_per_task(rows, (size_t)dim), eps};
    rk_threadpool_run(cpu_of(be)->pool, (rows + c.rows_per - 1) / c.rows_per, rmsnorm_task, &c);
    return RK_OK;
}

typedef struct embed_ctx {
    float *out;
    const unsigned char *table;
    rk_dtype dtype;
    const int32_t *ids;
    int n, dim, rows_per;
} embed_ctx;

static void embed_task(void *p, int task, int tid) {
    (void)tid;
    embed_ctx *c = p;
    size_t row_bytes = rk_dtype_row_bytes(c->dtype, (size_t)c->dim);
    int r0 = task * c->rows_per, r1 = r0 + c->rows_per < c->n ? r0 + c->rows_per : c->n;
    for (int r = r0; r < r1; r++)
        rk_dequantize(c->out + (size_t)r * c->dim, c->table + (size_t)c->ids[r] * row_bytes,
                      c->dtype, (size_t)c->dim);
}

/* The table has no row count in the op signature: the caller guarantees
 * ids < n_vocab (the engine checks token ids); negative ids are rejected. */
static rk_status cpu_embed(rk_backend *be, float *out, const void *table, rk_dtype dtype,
                           const int32_t *ids, int n, int dim) {
    if (n < 0 || dim <= 0) return rk_errorf(RK_ERR_INVALID, "embed: bad shape %d x %d", n, dim);
    if (rk_dtype_row_bytes(dtype, (size_t)dim) == 0)
        return rk_errorf(RK_ERR_INVALID, "embed: bad dtype %d for rows of %d", dtype, dim);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0) return rk_errorf(RK_ERR_INVALID, "embed: token id %d < 0", ids[i]);
    if (n == 0) return RK_OK;
    embed_ctx c = {out, table, dtype, ids, n, dim, rows_per_task(n, (size_t)dim)};
    rk_threadpool_run(cpu_of(be)->pool, (n + c.rows_per - 1) / c.rows_per, embed_task, &c);
    return RK_OK;
}

typedef struct swiglu_ctx {
    float *out;
    const float *gate, *up;
    size_t n;
} swiglu_ctx;

static void swiglu_task(void *p, int task, int tid) {
    (void)tid;
    swiglu_ctx *c = p;
    size_t i0 = (size_t)task * ELEMS_PER_TASK;
    size_t i1 = i0 + ELEMS_PER_TASK < c->n ? i0 + ELEMS_PER_TASK : c->n;
    float e[256];
    for (size_t b = i0; b < i1; b += 256) {
        size_t len = i1 - b < 256 ? i1 - b : 256;
        float ng[256];
        for (size_t j = 0; j < len; j++) ng[j] = -c->gate[b + j];
        rk_cpu_exp(e, ng, len);
        for (size_t j = 0; j < len; j++) {
            float g = c->gate[b + j];
            c->out[b + j] = g / (1.0f + e[j]) * c->up[b + j];
        }
    }
}

static rk_status cpu_swiglu(rk_backend *be, float *out, const float *gate, const float *up,
                            size_t n) {
    if (n == 0) return RK_OK;
    size_t n_tasks = (n + ELEMS_PER_TASK - 1) / ELEMS_PER_TASK;
    if (n_tasks > INT32_MAX)
        return rk_errorf(RK_ERR_INVALID, "swiglu: %zu elements is too many", n);
    swiglu_ctx c = {out, gate, up, n};
    rk_threadpool_run(cpu_of(be)->pool, (int)n_tasks, swiglu_task, &c);
    return RK_OK;
}

/* GELU's tanh form, 0.5 g (1 + tanh(u)) with u = sqrt(2/pi) (g + 0.044715 g^3),
 * is g / (1 + exp(-2u)): written so, the vector exp computes it (a tanhf call
 * an element took a tenth of a Gemma decode step). */
static void geglu_task(void *p, int task, int tid) {
    (void)tid;
    swiglu_ctx *c = p;
    const float m2c = -2.0f * 0.79788456080286535588f; /* -2 sqrt(2 / pi) */
    size_t i0 = (size_t)task * ELEMS_PER_TASK;
    size_t i1 = i0 + ELEMS_PER_TASK < c->n ? i0 + ELEMS_PER_TASK : c->n;
    float e[256];
    for (size_t b = i0; b < i1; b += 256) {
        size_t len = i1 - b < 256 ? i1 - b : 256;
        for (size_t j = 0; j < len; j++) {
            float g = c->gate[b + j];
            e[j] = m2c * g * (1.0f + 0.044715f * g * g);
        }
        rk_cpu_exp(e, e, len);
        for (size_t j = 0; j < len; j++)
            c->out[b + j] = c->gate[b + j] / (1.0f + e[j]) * c->up[b + j];
    }
}

static rk_status cpu_geglu(rk_backend *be, float *out, const float *gate, const float *up,
                           size_t n) {
    if (n == 0) return RK_OK;
    size_t n_tasks = (n + ELEMS_PER_TASK - 1) / ELEMS_PER_TASK;
    if (n_tasks > INT32_MAX) return rk_errorf(RK_ERR_INVALID, "geglu: %zu elements is too many", n);
    swiglu_ctx c = {out, gate, up, n};
    rk_threadpool_run(cpu_of(be)->pool, (int)n_tasks, geglu_task, &c);
    return RK_OK;
}

static rk_status cpu_scale(rk_backend *be, float *x, float s, size_t n) {
    (void)be;
    for (size_t i = 0; i < n; i++) x[i] *= s;
    return RK_OK;
}

/* ---------------------------------------------------------------- rope */

typedef struct rope_ctx {
    float *x;
    const int32_t *pos;
    int n_tokens, n_heads, head_dim, tokens_per;
    const rk_rope *rope;
} rope_ctx;

static void rope_task(void *p, int task, int tid) {
    (void)tid;
    rope_ctx *c = p;
    const rk_rope *r = c->rope;
    int half = r->n_rot / 2;
    float cs[RK_ROPE_MAX_PAIRS], sn[RK_ROPE_MAX_PAIRS];
    int t0 = task * c->tokens_per;
    int t1 = t0 + c->tokens_per < c->n_tokens ? t0 + c->tokens_per : c->n_tokens;
    for (int t = t0; t < t1; t++) {
        float fp = (float)c->pos[t];
        for (int i = 0; i < half; i++) {
            float a = fp * r->freq[i];
            cs[i] = cosf(a) * r->mscale;
            sn[i] = sinf(a) * r->mscale;
        }
        for (int h = 0; h < c->n_heads; h++)
            rk_cpu_rotate_head(c->x + ((size_t)t * c->n_heads + h) * c->head_dim, cs, sn, r->n_rot,
                               r->pairing);
    }
}

static rk_status cpu_rope(rk_backend *be, float *x, const int32_t *pos, int n_tokens, int n_heads,
                          int head_dim, const rk_rope *rope) {
    rk_status st = rk_rope_check(n_tokens, n_heads, head_dim, rope);
    if (st) return st;
    if (n_tokens == 0) return RK_OK;
    rope_ctx c = {x, pos, n_tokens, n_heads, head_dim, 0, rope};
    c.tokens_per = rows_per_task(n_tokens, (size_t)n_heads * head_dim);
    rk_threadpool_run(cpu_of(be)->pool, (n_tokens + c.tokens_per - 1) / c.tokens_per, rope_task,
                      &c);
    return RK_OK;
}

/* ---------------------------------------------------------------- backend */

static const rk_backend_ops cpu_ops = {
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .memset = cpu_memset,
    .sync = cpu_sync,
    .matmul = rk_cpu_matmul,
    .packed_bytes = rk_cpu_packed_bytes,
    .pack = rk_cpu_pack,
    .matmul_packed = rk_cpu_matmul_packed,
    .packed_offset = rk_cpu_packed_offset,
    .add_bias = cpu_add_bias,
    .add = cpu_add,
    .rmsnorm = cpu_rmsnorm,
    .embed = cpu_embed,
    .rope = cpu_rope,
    .swiglu = cpu_swiglu,
    .geglu = cpu_geglu,
    .scale = cpu_scale,
    .kv_write = rk_cpu_kv_write,
    .attention = rk_cpu_attention,
    .rope_shift_copy = rk_cpu_rope_shift_copy,
};

/* Create the CPU backend with a pool of n_threads threads (<= 0: one per
 * online core) and keep OpenBLAS single-threaded (its calls run inside the
 * pool). The caller owns *out. */
rk_status rk_cpu_backend_create(int n_threads, rk_backend **out) {
    *out = NULL;
    rk_backend *be = calloc(1, sizeof *be);
    rk_cpu *cpu = calloc(1, sizeof *cpu);
    if (!be || !cpu) {
        free(be);
        free(cpu);
        return rk_errorf(RK_ERR_NOMEM, "cpu backend: out of memory");
    }
    rk_status st = rk_threadpool_create(n_threads, &cpu->pool);
    if (!st && (st = rk_populator_create(&cpu->populate))) rk_threadpool_free(cpu->pool);
    if (st != RK_OK) {
        free(be);
        free(cpu);
        return st;
    }
    cpu->n_threads = rk_threadpool_size(cpu->pool);
    /* The BLAS path runs its panels on our pool, one single-threaded sgemm
     * per panel: OpenBLAS threading would oversubscribe the cores and its
     * results vary with its thread count. */
    openblas_set_num_threads(1);
    be->ops = &cpu_ops;
    be->name = "cpu";
    be->n_threads = cpu->n_threads;
    be->impl = cpu;
    *out = be;
    return RK_OK;
}

/* Stop the pool and free the backend and its scratch. Accepts NULL. */
void rk_cpu_backend_free(rk_backend *be) {
    if (!be) return;
    rk_cpu *cpu = be->impl;
    if (cpu) {
        rk_populator_free(cpu->populate);
        rk_threadpool_free(cpu->pool);
        free(cpu->scratch);
        free(cpu->shared);
        free(cpu);
    }
    free(be);
}
