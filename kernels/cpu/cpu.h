/* kernels/cpu/cpu.h — private header of the CPU backend (the reference
 * implementation of the op table in kernels/kernels.h).
 *
 * Not for use outside kernels/ except by tests and benchmarks: it exposes the
 * thread pool, the backend's private state, the algorithm choices the tests
 * must steer (which matmul path a shape takes) and a contiguous-cache variant
 * of the attention kernel that runs the same traversal and reduction order as
 * the paged one, so tests can prove the two bit-identical.
 *
 * Determinism: every op partitions its work so that each output element is
 * computed by exactly one task with an arithmetic order that depends only on
 * the shapes, never on the number of threads or on which thread runs a task. */
#ifndef RK_KERNELS_CPU_H
#define RK_KERNELS_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "config/config.h"
#include "kernels/kernels.h"

/* ---------------------------------------------------------------- thread pool */

typedef struct rk_threadpool rk_threadpool;

/* A task: ctx is the caller's, task in [0, n_tasks), thread_id in
 * [0, n_threads) names the thread running it (0 is the calling thread); use it
 * only to pick per-thread scratch, never to decide what to compute. */
typedef void (*rk_task_fn)(void *ctx, int task, int thread_id);

/* Start a pool of n_threads threads in all (n_threads - 1 workers plus the
 * caller of rk_threadpool_run; <= 0 means one per online core). Workers sleep
 * on a condition variable between jobs after a short bounded spin. The caller
 * owns *out and frees it with rk_threadpool_free(). */
rk_status rk_threadpool_create(int n_threads, rk_threadpool **out);

/* Stop and join the workers and free the pool. Accepts NULL. */
void rk_threadpool_free(rk_threadpool *pool);

/* Number of threads, the caller included. */
int rk_threadpool_size(const rk_threadpool *pool);

/* Run fn(ctx, t, thread_id) for every t in [0, n_tasks) across the pool; the
 * caller participates and the call returns when every task has finished.
 * Tasks are claimed in increasing order from a shared counter. Not reentrant:
 * one job at a time, and a task must not call rk_threadpool_run. */
void rk_threadpool_run(rk_threadpool *pool, int n_tasks, rk_task_fn fn, void *ctx);

/* ---------------------------------------------------------------- backend state */

/* The pages of large buffers faulted in by a thread of their own
 * (populate.c): add a buffer once allocated; forget it before freeing it. */
typedef struct rk_populator rk_populator;
rk_status rk_populator_create(rk_populator **out);
void rk_populator_add(rk_populator *pp, void *p, size_t n);
void rk_populator_forget(rk_populator *pp, void *p);
void rk_populator_free(rk_populator *pp);

typedef struct rk_cpu {
    rk_threadpool *pool;
    rk_populator *populate; /* large buffers' pages, faulted in ahead of use */
    int n_threads;
    unsigned char *scratch; /* (n_threads, scratch_stride) per-thread scratch, 64-byte aligned */
    size_t scratch_stride;
    unsigned char *shared; /* shared scratch (matmul panels, attention partials and tasks) */
    size_t shared_cap;
} rk_cpu;

/* Create the CPU backend (see rk_backend_create). */
rk_status rk_cpu_backend_create(int n_threads, rk_backend **out);

/* Free a CPU backend. Accepts NULL. */
void rk_cpu_backend_free(rk_backend *be);

/* Make sure every thread has at least n_bytes of scratch; returns
 * RK_ERR_NOMEM on failure (the old scratch stays valid). Call from the
 * thread that runs the op, before rk_threadpool_run. */
rk_status rk_cpu_reserve_scratch(rk_cpu *cpu, size_t n_bytes);

/* Thread thread_id's scratch (valid after rk_cpu_reserve_scratch). */
static inline void *rk_cpu_scratch(rk_cpu *cpu, int thread_id) {
    return cpu->scratch + (size_t)thread_id * cpu->scratch_stride;
}

/* Make sure the shared scratch holds n_bytes and return it in *out. */
rk_status rk_cpu_reserve_shared(rk_cpu *cpu, size_t n_bytes, void **out);

/* ---------------------------------------------------------------- ops */

/* The ops of the table that live outside backend.c; each has the contract of
 * its rk_backend_ops entry in kernels/kernels.h and returns RK_ERR_INVALID
 * (with a message) for a bad shape, slot or block id, RK_ERR_NOMEM when its
 * scratch cannot grow. */
rk_status rk_cpu_matmul(rk_backend *be, float *y, const float *x, const void *w, rk_dtype wtype,
                        int n, int k, int m);
size_t rk_cpu_packed_bytes(rk_backend *be, rk_dtype wtype, int k, int m);
rk_status rk_cpu_pack(rk_backend *be, void *dst, const void *w, rk_dtype wtype, int k, int m);
rk_status rk_cpu_matmul_packed(rk_backend *be, float *y, const float *x, const void *packed,
                               rk_dtype wtype, int n, int k, int m);
size_t rk_cpu_packed_offset(rk_backend *be, rk_dtype wtype, int k, int r0);
rk_status rk_cpu_kv_write(rk_backend *be, const rk_kv_cache *kv, int layer, const float *k,
                          const float *v, const int32_t *slots, int n_tokens);
rk_status rk_cpu_attention(rk_backend *be, float *out, float *lse, const float *q,
                           const rk_kv_cache *kv, int layer, const rk_attn_batch *batch,
                           int n_heads, const rk_attn_params *params);
rk_status rk_cpu_rope_shift_copy(rk_backend *be, const rk_kv_cache *kv, const int32_t *src_slots,
                                 const int32_t *dst_slots, const int32_t *delta, int n_tokens,
                                 const rk_rope *const *ropes);

/* Smallest n (rows of x) for which matmul takes the BLAS path (for quantized
 * weights at the AVX-512 BF16 level, the BF16 tile kernel instead; BF16
 * weights there take the tile for every n); below it the hand-written
 * matrix-vector kernels run. The choice depends on
 * (n, k, m, wtype) only, never on the thread count. Returns 1 for the BLAS
 * (or tile) path. */
int rk_cpu_matmul_uses_blas(int n, int k, int m, rk_dtype wtype);

/* The attention kernel over contiguous caches, for tests and benchmarks:
 * sequence s has k[s] and v[s] of shape (kv_len[s], n_kv_heads, head_dim) and
 * dtype dtype; everything else as the attention op. Runs the same traversal
 * and reduction order as the paged kernel, so results are bit-identical. */
rk_status rk_cpu_attention_contig(rk_backend *be, float *out, float *lse, const float *q,
                                  const void *const *k, const void *const *v, rk_dtype dtype,
                                  int n_kv_heads, int head_dim, const int32_t *q_start,
                                  const int32_t *kv_len, int n_seqs, int n_heads,
                                  const rk_attn_params *params);

/* KV partition size of the attention kernel: the kv range of every query row
 * is split into partitions of this many entries (the last one shorter), each
 * reduced on its own and merged in order with their log-sum-exp. */
#define RK_CPU_ATTN_PARTITION 512

/* ---------------------------------------------------------------- conversions */

/* dst(n) f32 = src(n) of dtype (exact). */
void rk_cpu_to_f32(float *dst, const void *src, rk_dtype dtype, size_t n);
/* dst(n) of dtype = src(n) f32, round to nearest even (bit-identical to the
 * scalar rk_f32_to_f16 / rk_f32_to_bf16 for finite values). */
void rk_cpu_from_f32(void *dst, const float *src, rk_dtype dtype, size_t n);

/* Rotate the n_rot leading dims of one head x by the pairs (c[i], s[i]):
 * (x0, x1) -> (x0 c - x1 s, x0 s + x1 c), pairs (2i, 2i+1) for NORMAL and
 * (i, i + n_rot/2) for NEOX. Shared by rope and rope_shift_copy. */
static inline void rk_cpu_rotate_head(float *x, const float *c, const float *s, int n_rot,
                                      rk_rope_pairing pairing) {
    int half = n_rot / 2;
    if (pairing == RK_ROPE_NEOX) {
        for (int i = 0; i < half; i++) {
            float x0 = x[i], x1 = x[i + half];
            x[i] = x0 * c[i] - x1 * s[i];
            x[i + half] = x0 * s[i] + x1 * c[i];
        }
    } else {
        for (int i = 0; i < half; i++) {
            float x0 = x[2 * i], x1 = x[2 * i + 1];
            x[2 * i] = x0 * c[i] - x1 * s[i];
            x[2 * i + 1] = x0 * s[i] + x1 * c[i];
        }
    }
}

/* ---------------------------------------------------------------- quantized weights */

/* A block of 32 activations quantized to int8 for the integer dot products
 * against block-quantized weights (kernels/cpu/quant.c): x[l] ~ d * q[l],
 * d = max |x| / 127, sum = the sum of q. */
typedef struct rk_q8_block {
    float d;
    int32_t sum;
    int8_t q[32];
} rk_q8_block;

/* dst(k / 32) = the activations x(k) quantized; k a multiple of 32; q
 * rounded to nearest even. f16_scale 0: d = max |x| / 127, q = x * (1 / d).
 * f16_scale 1 (the rk_cpu_act_is_q8_0 types): as the reference engine's
 * Q8_0 activations, d = max |x| / 127 rounded to f16 and q = x * (127 /
 * max |x|), so the integer sums and scales are the reference's. */
void rk_cpu_quantize_act(rk_q8_block *dst, const float *x, int k, int f16_scale);

/* 1 for the weight types the reference engine dots against Q8_0 (or Q8_1)
 * activations, whose scale is an f16: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL
 * and MXFP4. The K-quants dot against Q8_K there, with an f32 scale: here
 * against rk_q8_block with an f32 d, or rk_q8k_block (rk_cpu_act_is_q8k). */
static inline int rk_cpu_act_is_q8_0(rk_dtype t) {
    return t == RK_DTYPE_Q8_0 || t == RK_DTYPE_Q4_0 || t == RK_DTYPE_Q4_1 || t == RK_DTYPE_Q5_0 ||
           t == RK_DTYPE_Q5_1 || t == RK_DTYPE_IQ4_NL || t == RK_DTYPE_MXFP4;
}

/* A block of 256 activations quantized to int8 as GGML's Q8_K, for the
 * weight types whose reference dot products take it (Q2_K, Q3_K, IQ4_XS;
 * kernels/cpu/quant_q8k.c): the element of largest magnitude max is mapped
 * to -127, q = round(x * -127 / max) (at most 127), d = max / -127;
 * bsums[g] = the sum of q over elements 16g .. 16g + 15. */
typedef struct rk_q8k_block {
    float d;
    int16_t bsums[16];
    int8_t q[256];
} rk_q8k_block;

/* dst(k / 256) = the activations x(k) quantized; k a multiple of 256. */
void rk_cpu_quantize_act_k(rk_q8k_block *dst, const float *x, int k);

/* 1 for the weight types whose activations are quantized to rk_q8k_block
 * (rk_cpu_qdotk_fn), 0 for those that take rk_q8_block (rk_cpu_qdot_fn). */
static inline int rk_cpu_act_is_q8k(rk_dtype t) {
    return t == RK_DTYPE_Q2_K || t == RK_DTYPE_Q3_K || t == RK_DTYPE_IQ4_XS;
}

/* The dot product of one row of quantized weights (k elements) with one
 * quantized activation row. */
typedef float (*rk_qdot_fn)(const void *w, const rk_q8_block *x, int k);
typedef float (*rk_qdotk_fn)(const void *w, const rk_q8k_block *x, int k);

/* The non-linear 16-entry codebook of IQ4_NL and IQ4_XS: a 4-bit index q
 * stands for rk_iq4_values[q] times its block's scale. */
extern const int8_t rk_iq4_values[16];
/* The index of the codebook entry nearest v (the lower one on a tie). */
int rk_cpu_iq4_nearest(float v);

/* Instruction sets the quantized and BF16 kernels come in, each level
 * including the ones before it. AUTO picks the best one the CPU has
 * (AVX-512 BF16, then AVX-512 VNNI, then AVX2, then portable C). Only
 * AVX512_BF16 changes how BF16 weights are multiplied: the activations are
 * rounded to BF16 and meet the weights in _mm512_dpbf16_ps (see matmul.c);
 * below it BF16 weights are widened to f32. */
typedef enum rk_cpu_isa {
    RK_CPU_ISA_AUTO = 0,
    RK_CPU_ISA_PORTABLE,
    RK_CPU_ISA_AVX2,
    RK_CPU_ISA_AVX512_VNNI,
    RK_CPU_ISA_AVX512_BF16,
} rk_cpu_isa;

/* The AVX-512 BF16 kernels are compiled with target attributes whatever
 * -march says, and chosen at run time when the CPU has the instructions. */
#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 10)
#define RK_CPU_BF16_KERNELS 1
#define RK_CPU_BF16_TARGET  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

/* The AVX-512 VNNI kernels of packed quantized weights (qpack.c), likewise. */
#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 10)
#define RK_CPU_VNNI_KERNELS 1
#define RK_CPU_VNNI_TARGET                                                                         \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#endif

/* Force the kernels of one instruction set (tests and benchmarks; not
 * thread-safe: call it while no matmul runs). RK_ERR_UNSUPPORTED when the
 * build or the CPU lacks it; AUTO restores the default. */
rk_status rk_cpu_force_isa(rk_cpu_isa isa);
/* The instruction set the quantized kernels use now. */
rk_cpu_isa rk_cpu_isa_active(void);
/* The dot kernel of quantized dtype t for the active instruction set (NULL
 * for a dtype that is not quantized, and for the rk_cpu_act_is_q8k types). */
rk_qdot_fn rk_cpu_qdot_fn(rk_dtype t);
/* The dot kernel of an rk_cpu_act_is_q8k type (NULL for the others). */
rk_qdotk_fn rk_cpu_qdotk_fn(rk_dtype t);
/* The instruction set the integer dot kernels run at: the active one, with
 * AVX512_BF16 (which adds nothing to integer dots) taken down to the best
 * level below it that this build and CPU have. */
rk_cpu_isa rk_cpu_qdot_isa(void);

/* The block types of kernels/cpu/quant_q32.c (Q4_1, Q5_0, Q5_1, IQ4_NL) and
 * kernels/cpu/quant_q8k.c (Q2_K, Q3_K, IQ4_XS): rk_dequantize and
 * rk_quantize of n elements (a multiple of the block), and the dot kernel
 * of a q32 type at instruction set isa (a level rk_cpu_qdot_isa gives). */
void rk_cpu_dequantize_q32(float *dst, const void *src, rk_dtype t, size_t n);
void rk_cpu_quantize_q32(void *dst, const float *src, rk_dtype t, size_t n);
rk_qdot_fn rk_cpu_qdot_q32(rk_dtype t, rk_cpu_isa isa);
void rk_cpu_dequantize_q8k(float *dst, const void *src, rk_dtype t, size_t n);
void rk_cpu_quantize_q8k(void *dst, const float *src, rk_dtype t, size_t n);

/* MXFP4 (kernels/cpu/quant_mxfp4.c): its E2M1 codes as twice their value,
 * half the E8M0 scale e (2^(e - 128), exact), the conversions of n elements
 * and the dot kernel at instruction set isa. */
extern const int8_t rk_mxfp4_values[16];
float rk_cpu_e8m0_half(uint8_t e);
void rk_cpu_dequantize_mxfp4(float *dst, const void *src, size_t n);
void rk_cpu_quantize_mxfp4(void *dst, const float *src, size_t n);
rk_qdot_fn rk_cpu_qdot_mxfp4(rk_cpu_isa isa);

/* Scale and min of sub-block j (0..7) from the 12 packed bytes of Q4_K/Q5_K. */
static inline void rk_cpu_kq_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

/* Q8_0, Q3_K, Q4_K, Q6_K and MXFP4 weights packed for the AVX-512 VNNI integer kernels,
 * eight rows to a group (kernels/cpu/qpack.c has the layout). */
/* 1 when weights of type t are packed here: the type has a packed layout and
 * the active instruction set is AVX-512 VNNI or above. */
int rk_cpu_qpack_supported(rk_dtype t);
/* Packed weights meet fewer rows of x than this in the integer kernels, which
 * take four rows a pass (measured faster than dequantizing panels for the
 * BF16 tile below about 128 rows), and this many or more on the prefill path;
 * rk_cpu_matmul_uses_blas does not apply to them. */
#define RK_CPU_QPACK_MV_MAX_N 128
/* Bytes of w(m, k) packed; 0 for a type without a packed layout. */
size_t rk_cpu_qpack_bytes(rk_dtype t, int k, int m);
/* Pack group g (rows 8g .. 8g + 7) of w(m, k) into its place in dst. */
void rk_cpu_qpack_group(void *dst, const void *w, rk_dtype t, int k, int m, int g);
/* dst(rows, k) = rows r0 .. r0 + rows - 1 of packed weights in f32, with the
 * bits rk_dequantize gives for the stored rows. */
void rk_cpu_qpack_dequant_rows(float *dst, const void *packed, rk_dtype t, int k, int r0, int rows);
#ifdef RK_CPU_VNNI_KERNELS
/* y(n, m) columns 8 g0 .. 8 g1 - 1 = the quantized rows of x (n, k / 32 blocks;
 * for Q3_K, xk: n, k / 256 Q8_K blocks instead) . packed weights; xs16
 * (n, k / 16): 32 times each 16 activations' sum (Q6_K only, else unused). */
void rk_cpu_qpack_matvec(float *y, const void *packed, rk_dtype t, const rk_q8_block *xq,
                         const rk_q8k_block *xk, const int32_t *xs16, int n, int k, int m, int g0,
                         int g1);
#endif

/* ---------------------------------------------------------------- SIMD helpers */

#ifdef __AVX2__
#include <immintrin.h>

/* Sums of four adjacent products of unsigned u (0..127) and signed s bytes,
 * as eight int32 lanes (lane i covers bytes 4i .. 4i + 3): with AVX2 and
 * with AVX-512 VNNI, the same integers. */
static inline __m256i rk_mul_sum_us_avx2(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i rk_mul_sum_us_vnni(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#endif

/* Products of two signed byte vectors (a in -127..127): |a| times b with
 * a's sign. */
#define RK_MUL_SUM_SS(MUL, a, b) MUL(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a))

/* Horizontal sum of 8 lanes in a fixed order. */
static inline float rk_hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehl_ps(lo, lo);
    lo = _mm_add_ps(lo, sh);
    sh = _mm_shuffle_ps(lo, lo, 1);
    lo = _mm_add_ss(lo, sh);
    return _mm_cvtss_f32(lo);
}

/* exp(x) for 8 lanes, each lane independent of the others (~1 ulp for
 * |x| < 87; 0 below about -87.3, inf above 88.38, NaN stays NaN). */
static inline __m256 rk_exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f);
    const __m256 lo = _mm256_set1_ps(-87.3365447504f);
    __m256 nan_mask = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    __m256 xc = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 r2 = _mm256_mul_ps(r, r);
    y = _mm256_fmadd_ps(y, r2, r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i n = _mm256_cvtps_epi32(fx);
    __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
    y = _mm256_andnot_ps(under, y);
    y = _mm256_blendv_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000)), over);
    return _mm256_blendv_ps(y, x, nan_mask);
}
#endif

/* Vector-friendly exp over an array: dst[i] = exp(src[i]) for i < n. Each
 * result depends only on its own input (the same on every call site). */
void rk_cpu_exp(float *dst, const float *src, size_t n);

#endif
