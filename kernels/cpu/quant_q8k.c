/* kernels/cpu/quant_q8k.c — the GGML block types of 256 elements whose
 * reference dot products take activations quantized to Q8_K blocks of 256
 * (rk_q8k_block): Q2_K, Q3_K and IQ4_XS. Conversions to and from f32, the
 * activations' quantization and the integer dot products.
 *
 * Block layouts (little-endian, packed, as GGML writes them); element e of a
 * super-block lies in 16-group g = e / 16, and for the 2-bit planes in half
 * n = e / 128, plane j = e % 128 / 32, lane l = e % 32:
 *   Q2_K    256 elements, 84 bytes: u8 scales[16] | u8 q[64] | f16 d | f16 dmin
 *           x = d (scales[g] & 15) q - dmin (scales[g] >> 4), q the two
 *           bits at 2j of q[32n + l].
 *   Q3_K    256 elements, 110 bytes: u8 hmask[32] | u8 q[64] | u8 scales[12] | f16 d
 *           x = d (s_g - 32) (q - 4 h), q the two bits at 2j of q[32n + l],
 *           h = 1 when bit 4n + j of hmask[l] is clear; the 6-bit s_g has
 *           its low four bits at 4 (g / 8) of scales[g % 8] and its high two
 *           at 2 (g / 4) of scales[8 + g % 4].
 *   IQ4_XS  256 elements, 136 bytes: f16 d | u16 scales_h | u8 scales_l[4] | u8 q[128]
 *           eight sub-blocks of 32, x = d (ls - 32) v[q] with v the IQ4
 *           codebook (rk_iq4_values); sub-block j's 6-bit ls has its low
 *           four bits at 4 (j % 2) of scales_l[j / 2] and its high two at
 *           2j of scales_h; its bytes q[16j + l] hold element l (low
 *           nibble) and l + 16 (high nibble).
 *
 * Dot products: integer sums per 16-group (Q2_K, Q3_K) or 32-sub-block
 * (IQ4_XS) times the block's integer scale, one int32 per super-block,
 * scaled by d x.d once; Q2_K's mins meet the activations' 16-sums (bsums).
 * Q3_K's weights are summed as q + 4 (1 - h), 0..7, so they are unsigned
 * bytes, and 4 (s - 32) times each 16-sum is taken back off. The portable,
 * AVX2 and AVX-512 VNNI kernels compute the same integers; only the order
 * of the f32 accumulation differs. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#define QKK 256

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (unsigned)p[1] << 8); }
static void wr16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static float rdh(const uint8_t *p) { return rk_f16_to_f32(rd16(p)); }
static int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Q3_K's 6-bit scale of group g (0..63; the scale is this minus 32). */
static int q3_scale(const uint8_t *sc, int g) {
    return (sc[g % 8] >> 4 * (g / 8) & 15) | (sc[8 + g % 4] >> 2 * (g / 4) & 3) << 4;
}
/* IQ4_XS's 6-bit scale of sub-block j (the scale is this minus 32). */
static int iq4xs_scale(const uint8_t *b, int j) {
    return (b[4 + j / 2] >> 4 * (j % 2) & 15) | (rd16(b + 2) >> 2 * j & 3) << 4;
}

/* The 256 quant values of a super-block: Q2_K 0..3, Q3_K the stored
 * q + 4 (1 - h), 0..7 (value + 4), IQ4_XS the codebook index. */
static void unpack(uint8_t q[QKK], const uint8_t *b, rk_dtype t) {
    if (t == RK_DTYPE_IQ4_XS) {
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 16; l++) {
                q[32 * j + l] = b[8 + 16 * j + l] & 15;
                q[32 * j + l + 16] = b[8 + 16 * j + l] >> 4;
            }
        return;
    }
    const uint8_t *qs = t == RK_DTYPE_Q2_K ? b + 16 : b + 32;
    for (int e = 0; e < QKK; e++) {
        int n = e / 128, j = e % 128 / 32, l = e % 32;
        int v = qs[32 * n + l] >> 2 * j & 3;
        if (t == RK_DTYPE_Q3_K) v |= (b[l] >> (4 * n + j) & 1) << 2;
        q[e] = (uint8_t)v;
    }
}

/* ---------------------------------------------------------------- dequantize */

void rk_cpu_dequantize_q8k(float *y, const void *src, rk_dtype t, size_t n) {
    const uint8_t *b = src;
    size_t bb = rk_dtype_block_bytes(t);
    for (size_t i = 0; i < n / QKK; i++, b += bb, y += QKK) {
        uint8_t q[QKK];
        unpack(q, b, t);
        if (t == RK_DTYPE_Q2_K) {
            float d = rdh(b + 80), dmin = rdh(b + 82);
            for (int g = 0; g < 16; g++) {
                float dl = d * (float)(b[g] & 15), ml = dmin * (float)(b[g] >> 4);
                for (int l = 16 * g; l < 16 * g + 16; l++) y[l] = dl * (float)q[l] - ml;
            }
        } else if (t == RK_DTYPE_Q3_K) {
            float d = rdh(b + 108);
            for (int g = 0; g < 16; g++) {
                float dl = d * (float)(q3_scale(b + 96, g) - 32);
                for (int l = 16 * g; l < 16 * g + 16; l++) y[l] = dl * (float)(q[l] - 4);
            }
        } else {
            float d = rdh(b);
            for (int j = 0; j < 8; j++) {
                float dl = d * (float)(iq4xs_scale(b, j) - 32);
                for (int l = 32 * j; l < 32 * j + 32; l++) y[l] = dl * (float)rk_iq4_values[q[l]];
            }
        }
    }
}

/* ---------------------------------------------------------------- quantize */

/* Q2_K: each group of 16 maps [min(0, lo), hi] onto 0..3; its scale and min
 * are quantized to 4 bits against the super-block's largest, and the
 * elements re-quantized with them as stored. */
static void q_q2_k(uint8_t *b, const float *x) {
    float scale[16], mins[16], smax = 0, mmax = 0;
    for (int g = 0; g < 16; g++) {
        float lo = 0, hi = -INFINITY;
        for (int l = 0; l < 16; l++) {
            lo = fminf(lo, x[16 * g + l]);
            hi = fmaxf(hi, x[16 * g + l]);
        }
        scale[g] = (hi - lo) / 3.0f;
        mins[g] = -lo;
        smax = fmaxf(smax, scale[g]);
        mmax = fmaxf(mmax, mins[g]);
    }
    memset(b, 0, 84);
    uint16_t dh = rk_f32_to_f16(smax / 15.0f), mh = rk_f32_to_f16(mmax / 15.0f);
    float d = rk_f16_to_f32(dh), dmin = rk_f16_to_f32(mh);
    wr16(b + 80, dh);
    wr16(b + 82, mh);
    for (int g = 0; g < 16; g++) {
        int s = d > 0 ? clampi((int)lrintf(scale[g] / d), 0, 15) : 0;
        int m = dmin > 0 ? clampi((int)lrintf(mins[g] / dmin), 0, 15) : 0;
        b[g] = (uint8_t)(s | m << 4);
        float ds = d * (float)s, dm = dmin * (float)m;
        for (int l = 0; l < 16; l++) {
            int e = 16 * g + l;
            int q = ds > 0 ? clampi((int)lrintf((x[e] + dm) / ds), 0, 3) : 0;
            b[16 + 32 * (e / 128) + e % 32] |= (uint8_t)(q << 2 * (e % 128 / 32));
        }
    }
}

/* The element of largest magnitude of x(n). */
static float signed_max(const float *x, int n) {
    float mx = 0;
    for (int l = 0; l < n; l++)
        if (fabsf(x[l]) > fabsf(mx)) mx = x[l];
    return mx;
}

/* Q3_K: each group's largest element maps to -4, and the groups' scales to
 * 6 bits against the super-block's largest (which maps to -32). */
static void q_q3_k(uint8_t *b, const float *x) {
    float scale[16], smax = 0;
    for (int g = 0; g < 16; g++) {
        scale[g] = signed_max(x + 16 * g, 16) / -4.0f;
        if (fabsf(scale[g]) > fabsf(smax)) smax = scale[g];
    }
    memset(b, 0, 110);
    uint16_t dh = rk_f32_to_f16(smax / -32.0f);
    float d = rk_f16_to_f32(dh);
    wr16(b + 108, dh);
    for (int g = 0; g < 16; g++) {
        int s = d != 0 ? clampi((int)lrintf(scale[g] / d), -32, 31) : 0;
        int v = s + 32;
        b[96 + g % 8] |= (uint8_t)((v & 15) << 4 * (g / 8));
        b[96 + 8 + g % 4] |= (uint8_t)((v >> 4) << 2 * (g / 4));
        float ds = d * (float)s;
        for (int l = 0; l < 16; l++) {
            int e = 16 * g + l, n = e / 128, j = e % 128 / 32, k = e % 32;
            int q = (ds != 0 ? clampi((int)lrintf(x[e] / ds), -4, 3) : 0) + 4;
            b[32 + 32 * n + k] |= (uint8_t)((q & 3) << 2 * j);
            b[k] |= (uint8_t)((q >> 2) << (4 * n + j));
        }
    }
}

/* IQ4_XS: each sub-block's largest element maps to the codebook's -127, and
 * the sub-blocks' scales to 6 bits against the super-block's largest (which
 * maps to -32); each element takes the nearest codebook entry. */
static void q_iq4_xs(uint8_t *b, const float *x) {
    float scale[8], smax = 0;
    for (int j = 0; j < 8; j++) {
        scale[j] = signed_max(x + 32 * j, 32) / -127.0f;
        if (fabsf(scale[j]) > fabsf(smax)) smax = scale[j];
    }
    memset(b, 0, 136);
    uint16_t dh = rk_f32_to_f16(smax / -32.0f);
    float d = rk_f16_to_f32(dh);
    wr16(b, dh);
    uint16_t sh = 0;
    for (int j = 0; j < 8; j++) {
        int s = d != 0 ? clampi((int)lrintf(scale[j] / d), -32, 31) : 0;
        int v = s + 32;
        b[4 + j / 2] |= (uint8_t)((v & 15) << 4 * (j % 2));
        sh |= (uint16_t)((v >> 4) << 2 * j);
        float ds = d * (float)s, id = ds != 0 ? 1.0f / ds : 0.0f;
        for (int l = 0; l < 32; l++) {
            int q = rk_cpu_iq4_nearest(x[32 * j + l] * id);
            b[8 + 16 * j + l % 16] |= (uint8_t)(q << 4 * (l / 16));
        }
    }
    wr16(b + 2, sh);
}

void rk_cpu_quantize_q8k(void *dst, const float *src, rk_dtype t, size_t n) {
    uint8_t *b = dst;
    size_t bb = rk_dtype_block_bytes(t);
    for (size_t i = 0; i < n / QKK; i++, b += bb, src += QKK) {
        if (t == RK_DTYPE_Q2_K)
            q_q2_k(b, src);
        else if (t == RK_DTYPE_Q3_K)
            q_q3_k(b, src);
        else
            q_iq4_xs(b, src);
    }
}

/* ---------------------------------------------------------------- activations */

void rk_cpu_quantize_act_k(rk_q8k_block *dst, const float *x, int k) {
    for (int i = 0; i < k / QKK; i++, x += QKK, dst++) {
        float mx = signed_max(x, QKK);
        if (mx == 0) {
            memset(dst, 0, sizeof *dst);
            continue;
        }
        float is = -127.0f / mx;
        for (int l = 0; l < QKK; l++) {
            int q = (int)lrintf(is * x[l]);
            dst->q[l] = (int8_t)(q < 127 ? q : 127);
        }
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += dst->q[16 * g + l];
            dst->bsums[g] = (int16_t)s;
        }
        dst->d = 1.0f / is;
    }
}

/* ---------------------------------------------------------------- portable dots */

static int dot16(const uint8_t *a, const int8_t *b) {
    int s = 0;
    for (int l = 0; l < 16; l++) s += a[l] * b[l];
    return s;
}

static float dot_q2_k_c(const void *w, const rk_q8k_block *x, int k) {
    const uint8_t *b = w;
    float acc = 0;
    for (int i = 0; i < k / QKK; i++, b += 84, x++) {
        uint8_t q[QKK];
        unpack(q, b, RK_DTYPE_Q2_K);
        int isum = 0, msum = 0;
        for (int g = 0; g < 16; g++) {
            isum += (b[g] & 15) * dot16(q + 16 * g, x->q + 16 * g);
            msum += (b[g] >> 4) * x->bsums[g];
        }
        acc += x->d * (rdh(b + 80) * (float)isum - rdh(b + 82) * (float)msum);
    }
    return acc;
}

static float dot_q3_k_c(const void *w, const rk_q8k_block *x, int k) {
    const uint8_t *b = w;
    float acc = 0;
    for (int i = 0; i < k / QKK; i++, b += 110, x++) {
        uint8_t q[QKK];
        unpack(q, b, RK_DTYPE_Q3_K);
        int isum = 0;
        for (int g = 0; g < 16; g++)
            isum +=
                (q3_scale(b + 96, g) - 32) * (dot16(q + 16 * g, x->q + 16 * g) - 4 * x->bsums[g]);
        acc += x->d * rdh(b + 108) * (float)isum;
    }
    return acc;
}

static float dot_iq4_xs_c(const void *w, const rk_q8k_block *x, int k) {
    const uint8_t *b = w;
    float acc = 0;
    for (int i = 0; i < k / QKK; i++, b += 136, x++) {
        uint8_t q[QKK];
        unpack(q, b, RK_DTYPE_IQ4_XS);
        int isum = 0;
        for (int j = 0; j < 8; j++) {
            int s = 0;
            for (int l = 32 * j; l < 32 * j + 32; l++) s += rk_iq4_values[q[l]] * x->q[l];
            isum += (iq4xs_scale(b, j) - 32) * s;
        }
        acc += x->d * rdh(b) * (float)isum;
    }
    return acc;
}

/* ---------------------------------------------------------------- SIMD dots */

#ifdef __AVX2__
/* Lanes 0..3 a, lanes 4..7 c: the scales of the two 16-groups whose sums
 * the lanes of a 32-byte multiply-add hold. */
static inline __m256i pair_scale(int a, int c) { return _mm256_setr_epi32(a, a, a, a, c, c, c, c); }

#define DEF_Q8K_DOTS(SUF, MUL)                                                                     \
    static float dot_q2_k_##SUF(const void *w, const rk_q8k_block *x, int k) {                     \
        const uint8_t *b = w;                                                                      \
        const __m256i m3 = _mm256_set1_epi8(3);                                                    \
        __m256 acc = _mm256_setzero_ps();                                                          \
        float mins = 0;                                                                            \
        for (int i = 0; i < k / QKK; i++, b += 84, x++) {                                          \
            __m256i isum = _mm256_setzero_si256();                                                 \
            for (int n = 0; n < 2; n++) {                                                          \
                __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * n));              \
                for (int j = 0; j < 4; j++) {                                                      \
                    int g = 8 * n + 2 * j;                                                         \
                    __m256i q = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * j), m3);               \
                    __m256i p =                                                                    \
                        MUL(q, _mm256_loadu_si256((const __m256i *)(x->q + 128 * n + 32 * j)));    \
                    isum = _mm256_add_epi32(                                                       \
                        isum, _mm256_mullo_epi32(p, pair_scale(b[g] & 15, b[g + 1] & 15)));        \
                }                                                                                  \
            }                                                                                      \
            int msum = 0;                                                                          \
            for (int g = 0; g < 16; g++) msum += (b[g] >> 4) * x->bsums[g];                        \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),                                        \
                                  _mm256_set1_ps(x->d * _cvtsh_ss(rd16(b + 80))), acc);            \
            mins += x->d * _cvtsh_ss(rd16(b + 82)) * (float)msum;                                  \
        }                                                                                          \
        return rk_hsum256(acc) - mins;                                                             \
    }                                                                                              \
    static float dot_q3_k_##SUF(const void *w, const rk_q8k_block *x, int k) {                     \
        const uint8_t *b = w;                                                                      \
        const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);                        \
        __m256 acc = _mm256_setzero_ps();                                                          \
        for (int i = 0; i < k / QKK; i++, b += 110, x++) {                                         \
            __m256i hm = _mm256_loadu_si256((const __m256i *)b), isum = _mm256_setzero_si256();    \
            int sc[16], corr = 0;                                                                  \
            for (int g = 0; g < 16; g++) {                                                         \
                sc[g] = q3_scale(b + 96, g) - 32;                                                  \
                corr += sc[g] * x->bsums[g];                                                       \
            }                                                                                      \
            for (int n = 0; n < 2; n++) {                                                          \
                __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * n));              \
                for (int j = 0; j < 4; j++) {                                                      \
                    int g = 8 * n + 2 * j;                                                         \
                    __m256i bit = _mm256_set1_epi8((char)(1 << (4 * n + j)));                      \
                    __m256i h = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);                 \
                    __m256i q =                                                                    \
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 2 * j), m3),       \
                                        _mm256_and_si256(h, four));                                \
                    __m256i p =                                                                    \
                        MUL(q, _mm256_loadu_si256((const __m256i *)(x->q + 128 * n + 32 * j)));    \
                    isum = _mm256_add_epi32(isum,                                                  \
                                            _mm256_mullo_epi32(p, pair_scale(sc[g], sc[g + 1])));  \
                }                                                                                  \
            }                                                                                      \
            isum = _mm256_sub_epi32(isum, _mm256_setr_epi32(4 * corr, 0, 0, 0, 0, 0, 0, 0));       \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),                                        \
                                  _mm256_set1_ps(x->d * _cvtsh_ss(rd16(b + 108))), acc);           \
        }                                                                                          \
        return rk_hsum256(acc);                                                                    \
    }                                                                                              \
    static float dot_iq4_xs_##SUF(const void *w, const rk_q8k_block *x, int k) {                   \
        const uint8_t *b = w;                                                                      \
        const __m256i m4 = _mm256_set1_epi8(15);                                                   \
        const __m256i table =                                                                      \
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)rk_iq4_values));          \
        __m256 acc = _mm256_setzero_ps();                                                          \
        for (int i = 0; i < k / QKK; i++, b += 136, x++) {                                         \
            __m256i isum = _mm256_setzero_si256();                                                 \
            for (int j = 0; j < 8; j++) {                                                          \
                __m128i raw = _mm_loadu_si128((const __m128i *)(b + 8 + 16 * j));                  \
                __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4);   \
                q = _mm256_shuffle_epi8(table, q);                                                 \
                __m256i p =                                                                        \
                    RK_MUL_SUM_SS(MUL, q, _mm256_loadu_si256((const __m256i *)(x->q + 32 * j)));   \
                isum = _mm256_add_epi32(                                                           \
                    isum, _mm256_mullo_epi32(p, _mm256_set1_epi32(iq4xs_scale(b, j) - 32)));       \
            }                                                                                      \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),                                        \
                                  _mm256_set1_ps(x->d * _cvtsh_ss(rd16(b))), acc);                 \
        }                                                                                          \
        return rk_hsum256(acc);                                                                    \
    }

DEF_Q8K_DOTS(avx2, rk_mul_sum_us_avx2)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
DEF_Q8K_DOTS(vnni, rk_mul_sum_us_vnni)
#endif
#endif

/* ---------------------------------------------------------------- dispatch */

rk_qdotk_fn rk_cpu_qdotk_fn(rk_dtype t) {
    if (!rk_cpu_act_is_q8k(t)) return NULL;
    int i = t == RK_DTYPE_Q2_K ? 0 : t == RK_DTYPE_Q3_K ? 1 : 2;
    switch (rk_cpu_qdot_isa()) {
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case RK_CPU_ISA_AVX512_VNNI: {
        static const rk_qdotk_fn f[] = {dot_q2_k_vnni, dot_q3_k_vnni, dot_iq4_xs_vnni};
        return f[i];
    }
#endif
#ifdef __AVX2__
    case RK_CPU_ISA_AVX2: {
        static const rk_qdotk_fn f[] = {dot_q2_k_avx2, dot_q3_k_avx2, dot_iq4_xs_avx2};
        return f[i];
    }
#endif
    default: {
        static const rk_qdotk_fn f[] = {dot_q2_k_c, dot_q3_k_c, dot_iq4_xs_c};
        return f[i];
    }
    }
}
