/* kernels/cpu/quant_q32.c — the GGML block types of 32 elements beside
 * Q8_0 and Q4_0 (quant.c): conversions to and from f32 and the integer dot
 * products against activation blocks of 32 (rk_q8_block), which is what
 * the reference engine's dot products of these types take (Q8_0, or Q8_1
 * with its sum for the types with a min).
 *
 * Block layouts (little-endian, packed, as GGML writes them):
 *   Q4_1    32 elements, 20 bytes: f16 d | f16 m | u8 q[16]           x = d q + m
 *           byte i holds element i (low nibble) and element i + 16 (high).
 *   Q5_0    32 elements, 22 bytes: f16 d | u8 qh[4] | u8 q[16]        x = d (q - 16)
 *           the nibbles as Q4_1's; bit e of the little-endian word qh is
 *           the fifth (value 16) bit of element e.
 *   Q5_1    32 elements, 24 bytes: f16 d | f16 m | u8 qh[4] | u8 q[16]  x = d q + m
 *   IQ4_NL  32 elements, 18 bytes: f16 d | u8 q[16]                   x = d v[q]
 *           the nibbles as Q4_1's, each an index into the codebook v
 *           (rk_iq4_values).
 *
 * Dot products: the weights are unpacked to bytes and meet the activation
 * block in the multiply-adds of quant.c (portable, AVX2, AVX-512 VNNI; the
 * same integer sums), and the mins of Q4_1 and Q5_1 meet the block's sum:
 * d x.d sum(q x.q) + m x.d x.sum. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#define QK 32

/* GGML's kvalues_iq4nl. */
const int8_t rk_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                  1,    13,   25,  38,  53,  69,  89,  113};

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (unsigned)p[1] << 8); }
static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void wr16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static float rdh(const uint8_t *p) { return rk_f16_to_f32(rd16(p)); }
static int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static size_t block_bytes(rk_dtype t) { return rk_dtype_block_bytes(t); }

/* Offset of the nibbles, of qh (0: none) and whether the block has a min. */
static int q_off(rk_dtype t) {
    return t == RK_DTYPE_Q4_1 ? 4 : t == RK_DTYPE_Q5_0 ? 6 : t == RK_DTYPE_Q5_1 ? 8 : 2;
}
static int qh_off(rk_dtype t) { return t == RK_DTYPE_Q5_0 ? 2 : t == RK_DTYPE_Q5_1 ? 4 : 0; }
static int has_min(rk_dtype t) { return t == RK_DTYPE_Q4_1 || t == RK_DTYPE_Q5_1; }

/* The 32 quant values of one block: 0..15 or 0..31 (Q5 types), or the
 * codebook index (IQ4_NL). */
static void unpack(uint8_t q[QK], const uint8_t *b, rk_dtype t) {
    const uint8_t *qs = b + q_off(t);
    for (int l = 0; l < 16; l++) {
        q[l] = qs[l] & 15;
        q[l + 16] = qs[l] >> 4;
    }
    if (qh_off(t)) {
        uint32_t qh = rd32(b + qh_off(t));
        for (int l = 0; l < QK; l++) q[l] |= (uint8_t)((qh >> l & 1) << 4);
    }
}

/* ---------------------------------------------------------------- dequantize */

void rk_cpu_dequantize_q32(float *y, const void *src, rk_dtype t, size_t n) {
    const uint8_t *b = src;
    size_t bb = block_bytes(t);
    for (size_t i = 0; i < n / QK; i++, b += bb, y += QK) {
        uint8_t q[QK];
        unpack(q, b, t);
        float d = rdh(b);
        switch (t) {
        case RK_DTYPE_Q4_1:
        case RK_DTYPE_Q5_1: {
            float m = rdh(b + 2);
            for (int l = 0; l < QK; l++) y[l] = d * (float)q[l] + m;
            break;
        }
        case RK_DTYPE_Q5_0:
            for (int l = 0; l < QK; l++) y[l] = d * (float)(q[l] - 16);
            break;
        default: /* IQ4_NL */
            for (int l = 0; l < QK; l++) y[l] = d * (float)rk_iq4_values[q[l]];
            break;
        }
    }
}

/* ---------------------------------------------------------------- quantize */

int rk_cpu_iq4_nearest(float v) {
    int best = 0;
    float err = fabsf(v - (float)rk_iq4_values[0]);
    for (int j = 1; j < 16; j++) {
        float e = fabsf(v - (float)rk_iq4_values[j]);
        if (e < err) {
            err = e;
            best = j;
        }
    }
    return best;
}

/* Q4_1 and Q5_1 map [lo, hi] onto 0..qmax with the scale and min as
 * stored; Q5_0 maps the element of largest magnitude to -16 (as Q4_0 does to
 * -8) and IQ4_NL to the codebook's -127. */
static void quant_block(uint8_t *b, const float *x, rk_dtype t) {
    uint8_t q[QK];
    memset(b, 0, block_bytes(t));
    if (has_min(t)) {
        int qmax = t == RK_DTYPE_Q4_1 ? 15 : 31;
        float lo = x[0], hi = x[0];
        for (int l = 1; l < QK; l++) {
            lo = fminf(lo, x[l]);
            hi = fmaxf(hi, x[l]);
        }
        uint16_t dh = rk_f32_to_f16((hi - lo) / (float)qmax), mh = rk_f32_to_f16(lo);
        float d = rk_f16_to_f32(dh), m = rk_f16_to_f32(mh), id = d > 0 ? 1.0f / d : 0.0f;
        wr16(b, dh);
        wr16(b + 2, mh);
        for (int l = 0; l < QK; l++) q[l] = (uint8_t)clampi((int)lrintf((x[l] - m) * id), 0, qmax);
    } else {
        float mx = 0;
        for (int l = 0; l < QK; l++)
            if (fabsf(x[l]) > fabsf(mx)) mx = x[l];
        float div = t == RK_DTYPE_Q5_0 ? -16.0f : -127.0f;
        uint16_t dh = rk_f32_to_f16(mx / div);
        float d = rk_f16_to_f32(dh), id = d != 0 ? 1.0f / d : 0.0f;
        wr16(b, dh);
        for (int l = 0; l < QK; l++)
            q[l] = t == RK_DTYPE_Q5_0 ? (uint8_t)clampi((int)lrintf(x[l] * id) + 16, 0, 31)
                                      : (uint8_t)rk_cpu_iq4_nearest(x[l] * id);
    }
    uint8_t *qs = b + q_off(t);
    for (int l = 0; l < 16; l++) qs[l] = (uint8_t)((q[l] & 15) | (q[l + 16] & 15) << 4);
    if (qh_off(t)) {
        uint32_t qh = 0;
        for (int l = 0; l < QK; l++) qh |= (uint32_t)(q[l] >> 4) << l;
        for (int i = 0; i < 4; i++) b[qh_off(t) + i] = (uint8_t)(qh >> 8 * i);
    }
}

void rk_cpu_quantize_q32(void *dst, const float *src, rk_dtype t, size_t n) {
    uint8_t *b = dst;
    for (size_t i = 0; i < n / QK; i++) quant_block(b + i * block_bytes(t), src + i * QK, t);
}

/* ---------------------------------------------------------------- portable dots */

static int dot_u8_i8(const uint8_t *a, const int8_t *b) {
    int s = 0;
    for (int l = 0; l < QK; l++) s += a[l] * b[l];
    return s;
}

static float dot_min_c(const void *w, const rk_q8_block *x, int k, rk_dtype t) {
    const uint8_t *b = w;
    size_t bb = block_bytes(t);
    float acc = 0;
    for (int i = 0; i < k / QK; i++, b += bb) {
        uint8_t q[QK];
        unpack(q, b, t);
        acc +=
            rdh(b) * x[i].d * (float)dot_u8_i8(q, x[i].q) + rdh(b + 2) * x[i].d * (float)x[i].sum;
    }
    return acc;
}
static float dot_q4_1_c(const void *w, const rk_q8_block *x, int k) {
    return dot_min_c(w, x, k, RK_DTYPE_Q4_1);
}
static float dot_q5_1_c(const void *w, const rk_q8_block *x, int k) {
    return dot_min_c(w, x, k, RK_DTYPE_Q5_1);
}

static float dot_q5_0_c(const void *w, const rk_q8_block *x, int k) {
    const uint8_t *b = w;
    float acc = 0;
    for (int i = 0; i < k / QK; i++, b += 22) {
        uint8_t q[QK];
        unpack(q, b, RK_DTYPE_Q5_0);
        int s = 0;
        for (int l = 0; l < QK; l++) s += (q[l] - 16) * x[i].q[l];
        acc += rdh(b) * x[i].d * (float)s;
    }
    return acc;
}

static float dot_iq4_nl_c(const void *w, const rk_q8_block *x, int k) {
    const uint8_t *b = w;
    float acc = 0;
    for (int i = 0; i < k / QK; i++, b += 18) {
        uint8_t q[QK];
        unpack(q, b, RK_DTYPE_IQ4_NL);
        int s = 0;
        for (int l = 0; l < QK; l++) s += rk_iq4_values[q[l]] * x[i].q[l];
        acc += rdh(b) * x[i].d * (float)s;
    }
    return acc;
}

/* ---------------------------------------------------------------- SIMD dots */

#ifdef __AVX2__
/* The 32 nibbles at p as bytes, element order (low nibbles, then high). */
static inline __m256i nibbles(const uint8_t *p) {
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15));
}

/* 16 in byte e where bit e of qh is set, else 0. */
static inline __m256i fifth_bits(uint32_t qh) {
    __m256i v = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh),
        _mm256_setr_epi64x(0, 0x0101010101010101ll, 0x0202020202020202ll, 0x0303030303030303ll));
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfell));
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(16));
}

#define DEF_Q32_DOTS(SUF, MUL)                                                                     \
    static float dot_min_##SUF(const void *w, const rk_q8_block *x, int k, int five) {             \
        const uint8_t *b = w;                                                                      \
        size_t bb = five ? 24 : 20;                                                                \
        __m256 acc = _mm256_setzero_ps();                                                          \
        float mins = 0;                                                                            \
        for (int i = 0; i < k / QK; i++, b += bb) {                                                \
            __m256i q = nibbles(b + (five ? 8 : 4));                                               \
            if (five) q = _mm256_or_si256(q, fifth_bits(rd32(b + 4)));                             \
            __m256i p = MUL(q, _mm256_loadu_si256((const __m256i *)x[i].q));                       \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),                                           \
                                  _mm256_set1_ps(_cvtsh_ss(rd16(b)) * x[i].d), acc);               \
            mins += _cvtsh_ss(rd16(b + 2)) * x[i].d * (float)x[i].sum;                             \
        }                                                                                          \
        return rk_hsum256(acc) + mins;                                                             \
    }                                                                                              \
    static float dot_q4_1_##SUF(const void *w, const rk_q8_block *x, int k) {                      \
        return dot_min_##SUF(w, x, k, 0);                                                          \
    }                                                                                              \
    static float dot_q5_1_##SUF(const void *w, const rk_q8_block *x, int k) {                      \
        return dot_min_##SUF(w, x, k, 1);                                                          \
    }                                                                                              \
    static float dot_q5_0_##SUF(const void *w, const rk_q8_block *x, int k) {                      \
        const uint8_t *b = w;                                                                      \
        __m256 acc = _mm256_setzero_ps();                                                          \
        for (int i = 0; i < k / QK; i++, b += 22) {                                                \
            __m256i q = _mm256_or_si256(nibbles(b + 6), fifth_bits(rd32(b + 2)));                  \
            q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));                                          \
            __m256i p = RK_MUL_SUM_SS(MUL, q, _mm256_loadu_si256((const __m256i *)x[i].q));        \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),                                           \
                                  _mm256_set1_ps(_cvtsh_ss(rd16(b)) * x[i].d), acc);               \
        }                                                                                          \
        return rk_hsum256(acc);                                                                    \
    }                                                                                              \
    static float dot_iq4_nl_##SUF(const void *w, const rk_q8_block *x, int k) {                    \
        const uint8_t *b = w;                                                                      \
        const __m256i table =                                                                      \
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)rk_iq4_values));          \
        __m256 acc = _mm256_setzero_ps();                                                          \
        for (int i = 0; i < k / QK; i++, b += 18) {                                                \
            __m256i q = _mm256_shuffle_epi8(table, nibbles(b + 2));                                \
            __m256i p = RK_MUL_SUM_SS(MUL, q, _mm256_loadu_si256((const __m256i *)x[i].q));        \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),                                           \
                                  _mm256_set1_ps(_cvtsh_ss(rd16(b)) * x[i].d), acc);               \
        }                                                                                          \
        return rk_hsum256(acc);                                                                    \
    }

DEF_Q32_DOTS(avx2, rk_mul_sum_us_avx2)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
DEF_Q32_DOTS(vnni, rk_mul_sum_us_vnni)
#endif
#endif

/* ---------------------------------------------------------------- dispatch */

rk_qdot_fn rk_cpu_qdot_q32(rk_dtype t, rk_cpu_isa isa) {
    int i = t == RK_DTYPE_Q4_1 ? 0 : t == RK_DTYPE_Q5_0 ? 1 : t == RK_DTYPE_Q5_1 ? 2 : 3;
    if (t != RK_DTYPE_Q4_1 && t != RK_DTYPE_Q5_0 && t != RK_DTYPE_Q5_1 && t != RK_DTYPE_IQ4_NL)
        return NULL;
    switch (isa) {
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case RK_CPU_ISA_AVX512_VNNI: {
        static const rk_qdot_fn f[] = {dot_q4_1_vnni, dot_q5_0_vnni, dot_q5_1_vnni,
                                       dot_iq4_nl_vnni};
        return f[i];
    }
#endif
#ifdef __AVX2__
    case RK_CPU_ISA_AVX2: {
        static const rk_qdot_fn f[] = {dot_q4_1_avx2, dot_q5_0_avx2, dot_q5_1_avx2,
                                       dot_iq4_nl_avx2};
        return f[i];
    }
#endif
    default: {
        static const rk_qdot_fn f[] = {dot_q4_1_c, dot_q5_0_c, dot_q5_1_c, dot_iq4_nl_c};
        return f[i];
    }
    }
}
