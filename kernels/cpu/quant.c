/* kernels/cpu/quant.c — GGML block-quantized weights: the reference
 * conversions to and from f32, and the integer dot products the matrix-vector
 * path of matmul runs on them.
 *
 * Block layouts (little-endian, packed, as GGML writes them):
 *   Q8_0  32 elements, 34 bytes:  f16 d | i8 q[32]                   x = d q
 *   Q4_0  32 elements, 18 bytes:  f16 d | u8 q[16]                   x = d (q - 8)
 *         byte i holds element i (low nibble) and element i + 16 (high nibble).
 *   Q4_K 256 elements, 144 bytes: f16 d | f16 dmin | u8 scales[12] | u8 q[128]
 *         eight sub-blocks of 32, each with a 6-bit scale sc and a 6-bit min m:
 *         x = d sc q - dmin m. Sub-block j < 4: sc = scales[j] & 63,
 *         m = scales[j + 4] & 63; j >= 4: sc = (scales[j + 4] & 15) |
 *         (scales[j - 4] >> 6) << 4, m = (scales[j + 4] >> 4) | (scales[j] >> 6) << 4.
 *         Bytes q[32c .. 32c + 31] hold sub-block 2c in their low nibbles and
 *         sub-block 2c + 1 in their high nibbles.
 *   Q5_K 256 elements, 176 bytes: as Q4_K with u8 qh[32] between scales and q:
 *         bit j of qh[l] is the fifth (value 16) bit of element l of sub-block j.
 *   Q6_K 256 elements, 210 bytes: u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d
 *         x = d scales[e / 16] (q - 32) for element e. Each half h (128
 *         elements) uses ql[64h ..], qh[32h ..]: for l < 32, elements
 *         128h + l, + 32, + 64, + 96 take the low nibble of ql[l], of ql[l + 32],
 *         the high nibble of ql[l], of ql[l + 32], and bits (0,1), (2,3), (4,5),
 *         (6,7) of qh[l] as their two high bits.
 *
 * Dot products: a row of activations is quantized once per matmul to blocks
 * of 32 int8 with an f32 scale (rk_q8_block), and each weight block meets its
 * activation block as integer multiply-adds (one int32 sum per 32 elements,
 * or per 16 for Q6_K's scales), scaled to f32 once per block. The portable C
 * kernels, the AVX2 ones (_mm256_maddubs_epi16) and the AVX-512 VNNI ones
 * (_mm256_dpbusd_epi32) compute the same integer sums; only the order of the
 * f32 accumulation differs between them.
 *
 * The other block types GGML files carry live beside this file:
 * quant_q32.c (Q4_1, Q5_0, Q5_1, IQ4_NL, dotted against these activation
 * blocks) and quant_q8k.c (Q2_K, Q3_K, IQ4_XS, dotted against Q8_K
 * activation blocks of 256, as the reference engine does). */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#define QK  32  /* Q8_0, Q4_0 and activation block */
#define QKK 256 /* K-quant super-block */

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (unsigned)p[1] << 8); }
static void wr16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static float rdh(const uint8_t *p) { return rk_f16_to_f32(rd16(p)); }

static int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* ---------------------------------------------------------------- dequantize */

static void deq_q8_0(float *y, const uint8_t *b, size_t nb) {
    for (size_t i = 0; i < nb; i++, b += 34, y += QK) {
        float d = rdh(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int l = 0; l < QK; l++) y[l] = d * (float)q[l];
    }
}

static void deq_q4_0(float *y, const uint8_t *b, size_t nb) {
    for (size_t i = 0; i < nb; i++, b += 18, y += QK) {
        float d = rdh(b);
        const uint8_t *q = b + 2;
        for (int l = 0; l < 16; l++) {
            y[l] = d * (float)((q[l] & 15) - 8);
            y[l + 16] = d * (float)((q[l] >> 4) - 8);
        }
    }
}

/* Q4_K (qh NULL) and Q5_K: qs points at the 128 nibble bytes. */
static void deq_kq(float *y, const uint8_t *b, const uint8_t *qh, const uint8_t *qs) {
    float d = rdh(b), dmin = rdh(b + 2);
    const uint8_t *sc = b + 4;
    for (int j = 0; j < 8; j++) {
        int s, m;
        rk_cpu_kq_scale_min(sc, j, &s, &m);
        float ds = d * (float)s, dm = dmin * (float)m;
        const uint8_t *q = qs + 32 * (j / 2);
        int shift = (j & 1) * 4;
        for (int l = 0; l < 32; l++) {
            int v = (q[l] >> shift) & 15;
            if (qh && (qh[l] >> j & 1)) v += 16;
            y[32 * j + l] = ds * (float)v - dm;
        }
    }
}

/* One group of 16 elements per inner loop, whose scale is one: the compiler
 * vectorizes it (the values are those of d sc (q - 32), left to right). */
static void deq_q6_k(float *y, const uint8_t *b) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = rdh(b + 208);
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 4; g++) {
            const uint8_t *lq = ql + 64 * h + 32 * (g & 1), *hq = qh + 32 * h;
            int lshift = 4 * (g >> 1), hshift = 2 * g;
            for (int half = 0; half < 2; half++) {
                int e0 = 128 * h + 32 * g + 16 * half;
                float s = d * (float)sc[e0 / 16];
                for (int l = 16 * half; l < 16 * half + 16; l++) {
                    int q = (lq[l] >> lshift & 15) | (hq[l] >> hshift & 3) << 4;
                    y[128 * h + 32 * g + l] = s * (float)(q - 32);
                }
            }
        }
}

void rk_dequantize(float *dst, const void *src, rk_dtype t, size_t n) {
    const uint8_t *b = src;
    switch (t) {
    case RK_DTYPE_F32:
    case RK_DTYPE_F16:
    case RK_DTYPE_BF16: rk_cpu_to_f32(dst, src, t, n); return;
    case RK_DTYPE_Q8_0: deq_q8_0(dst, b, n / QK); return;
    case RK_DTYPE_Q4_0: deq_q4_0(dst, b, n / QK); return;
    case RK_DTYPE_Q4_K:
        for (size_t i = 0; i < n / QKK; i++)
            deq_kq(dst + i * QKK, b + i * 144, NULL, b + i * 144 + 16);
        return;
    case RK_DTYPE_Q5_K:
        for (size_t i = 0; i < n / QKK; i++)
            deq_kq(dst + i * QKK, b + i * 176, b + i * 176 + 16, b + i * 176 + 48);
        return;
    case RK_DTYPE_Q6_K:
        for (size_t i = 0; i < n / QKK; i++) deq_q6_k(dst + i * QKK, b + i * 210);
        return;
    case RK_DTYPE_Q4_1:
    case RK_DTYPE_Q5_0:
    case RK_DTYPE_Q5_1:
    case RK_DTYPE_IQ4_NL: rk_cpu_dequantize_q32(dst, src, t, n); return;
    case RK_DTYPE_Q2_K:
    case RK_DTYPE_Q3_K:
    case RK_DTYPE_IQ4_XS: rk_cpu_dequantize_q8k(dst, src, t, n); return;
    case RK_DTYPE_MXFP4: rk_cpu_dequantize_mxfp4(dst, src, n); return;
    }
}

/* ---------------------------------------------------------------- quantize */

static void q_q8_0(uint8_t *b, const float *x, size_t nb) {
    for (size_t i = 0; i < nb; i++, b += 34, x += QK) {
        float amax = 0;
        for (int l = 0; l < QK; l++) amax = fmaxf(amax, fabsf(x[l]));
        uint16_t dh = rk_f32_to_f16(amax / 127.0f);
        float d = rk_f16_to_f32(dh), id = d > 0 ? 1.0f / d : 0.0f;
        wr16(b, dh);
        for (int l = 0; l < QK; l++)
            b[2 + l] = (uint8_t)(int8_t)clampi((int)lrintf(x[l] * id), -127, 127);
    }
}

/* The element of largest magnitude is mapped to -8, so the grid's extra
 * negative step is not wasted. */
static void q_q4_0(uint8_t *b, const float *x, size_t nb) {
    for (size_t i = 0; i < nb; i++, b += 18, x += QK) {
        float mx = 0;
        for (int l = 0; l < QK; l++)
            if (fabsf(x[l]) > fabsf(mx)) mx = x[l];
        uint16_t dh = rk_f32_to_f16(mx / -8.0f);
        float d = rk_f16_to_f32(dh), id = d != 0 ? 1.0f / d : 0.0f;
        wr16(b, dh);
        for (int l = 0; l < 16; l++) {
            int a = clampi((int)lrintf(x[l] * id) + 8, 0, 15);
            int c = clampi((int)lrintf(x[l + 16] * id) + 8, 0, 15);
            b[2 + l] = (uint8_t)(a | c << 4);
        }
    }
}

/* Q4_K (qmax 15, qh NULL) and Q5_K (qmax 31): each sub-block maps
 * [min(0, lo), hi] onto 0..qmax; its scale and min are then quantized to 6
 * bits against the super-block's largest, and the elements re-quantized with
 * the scale and min as stored. */
static void q_kq(uint8_t *b, const float *x, int qmax, uint8_t *qh, uint8_t *qs) {
    float scale[8], mins[8], smax = 0, mmax = 0;
    for (int j = 0; j < 8; j++) {
        float lo = 0, hi = -INFINITY;
        for (int l = 0; l < 32; l++) {
            lo = fminf(lo, x[32 * j + l]);
            hi = fmaxf(hi, x[32 * j + l]);
        }
        scale[j] = (hi - lo) / (float)qmax;
        mins[j] = -lo;
        smax = fmaxf(smax, scale[j]);
        mmax = fmaxf(mmax, mins[j]);
    }
    uint16_t dh = rk_f32_to_f16(smax / 63.0f), mh = rk_f32_to_f16(mmax / 63.0f);
    float d = rk_f16_to_f32(dh), dmin = rk_f16_to_f32(mh);
    wr16(b, dh);
    wr16(b + 2, mh);
    uint8_t *sc = b + 4;
    memset(sc, 0, 12);
    if (qh) memset(qh, 0, 32);
    memset(qs, 0, 128);
    for (int j = 0; j < 8; j++) {
        int s = d > 0 ? clampi((int)lrintf(scale[j] / d), 0, 63) : 0;
        int m = dmin > 0 ? clampi((int)lrintf(mins[j] / dmin), 0, 63) : 0;
        if (j < 4) {
            sc[j] |= (uint8_t)s;
            sc[j + 4] |= (uint8_t)m;
        } else {
            sc[j + 4] = (uint8_t)((s & 15) | (m & 15) << 4);
            sc[j - 4] |= (uint8_t)((s >> 4) << 6);
            sc[j] |= (uint8_t)((m >> 4) << 6);
        }
        float ds = d * (float)s, dm = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int q = ds > 0 ? clampi((int)lrintf((x[32 * j + l] + dm) / ds), 0, qmax) : 0;
            qs[32 * (j / 2) + l] |= (uint8_t)((q & 15) << ((j & 1) * 4));
            if (qh) qh[l] |= (uint8_t)((q >> 4) << j);
        }
    }
}

/* Q6_K: each group of 16 gets the scale that maps its largest magnitude to
 * 31, quantized to 8 bits against the super-block's largest. */
static void q_q6_k(uint8_t *b, const float *x) {
    float scale[16], smax = 0;
    for (int g = 0; g < 16; g++) {
        float amax = 0;
        for (int l = 0; l < 16; l++) amax = fmaxf(amax, fabsf(x[16 * g + l]));
        scale[g] = amax / 31.0f;
        smax = fmaxf(smax, scale[g]);
    }
    uint16_t dh = rk_f32_to_f16(smax / 127.0f);
    float d = rk_f16_to_f32(dh);
    uint8_t *ql = b, *qh = b + 128;
    int8_t *sc = (int8_t *)(b + 192);
    memset(b, 0, 192);
    wr16(b + 208, dh);
    for (int g = 0; g < 16; g++)
        sc[g] = (int8_t)(d > 0 ? clampi((int)lrintf(scale[g] / d), 0, 127) : 0);
    for (int e = 0; e < QKK; e++) {
        float ds = d * (float)sc[e / 16];
        int q = (ds > 0 ? clampi((int)lrintf(x[e] / ds), -32, 31) : 0) + 32;
        int h = e / 128, g = e % 128 / 32, l = e % 32;
        uint8_t *lb = ql + 64 * h + l + (g & 1) * 32;
        *lb |= (uint8_t)((q & 15) << (g >> 1) * 4);
        qh[32 * h + l] |= (uint8_t)((q >> 4) << 2 * g);
    }
}

void rk_quantize(void *dst, const float *src, rk_dtype t, size_t n) {
    uint8_t *b = dst;
    switch (t) {
    case RK_DTYPE_F32:
    case RK_DTYPE_F16:
    case RK_DTYPE_BF16: rk_cpu_from_f32(dst, src, t, n); return;
    case RK_DTYPE_Q8_0: q_q8_0(b, src, n / QK); return;
    case RK_DTYPE_Q4_0: q_q4_0(b, src, n / QK); return;
    case RK_DTYPE_Q4_K:
        for (size_t i = 0; i < n / QKK; i++)
            q_kq(b + i * 144, src + i * QKK, 15, NULL, b + i * 144 + 16);
        return;
    case RK_DTYPE_Q5_K:
        for (size_t i = 0; i < n / QKK; i++)
            q_kq(b + i * 176, src + i * QKK, 31, b + i * 176 + 16, b + i * 176 + 48);
        return;
    case RK_DTYPE_Q6_K:
        for (size_t i = 0; i < n / QKK; i++) q_q6_k(b + i * 210, src + i * QKK);
        return;
    case RK_DTYPE_Q4_1:
    case RK_DTYPE_Q5_0:
    case RK_DTYPE_Q5_1:
    case RK_DTYPE_IQ4_NL: rk_cpu_quantize_q32(dst, src, t, n); return;
    case RK_DTYPE_Q2_K:
    case RK_DTYPE_Q3_K:
    case RK_DTYPE_IQ4_XS: rk_cpu_quantize_q8k(dst, src, t, n); return;
    case RK_DTYPE_MXFP4: rk_cpu_quantize_mxfp4(dst, src, n); return;
    }
}

/* ---------------------------------------------------------------- activations */

/* The AVX2 loop computes the same bits as the scalar one: the same max,
 * scale and products, and _mm256_cvtps_epi32 rounds to nearest even as
 * lrintf does in the default rounding mode. */
/* The step d of a block whose largest magnitude is amax, and the factor id
 * its values are multiplied by before rounding (see rk_cpu_quantize_act). */
static void act_scale(float amax, int f16_scale, float *d, float *id) {
    if (f16_scale) {
        *d = rk_f16_to_f32(rk_f32_to_f16(amax / 127.0f));
        *id = amax > 0 ? 127.0f / amax : 0.0f;
    } else {
        *d = amax / 127.0f;
        *id = *d > 0 ? 1.0f / *d : 0.0f;
    }
}

void rk_cpu_quantize_act(rk_q8_block *dst, const float *x, int k, int f16_scale) {
    for (int b = 0; b < k / QK; b++, x += QK) {
#ifdef __AVX2__
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int u = 0; u < 4; u++) {
            v[u] = _mm256_loadu_ps(x + 8 * u);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[u]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float d, id;
        act_scale(amax, f16_scale, &d, &id);
        __m256i q[4];
        for (int u = 0; u < 4; u++)
            q[u] = _mm256_cvtps_epi32(_mm256_mul_ps(v[u], _mm256_set1_ps(id)));
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        /* packs work within 128-bit lanes: undo the interleave at the end */
        __m256i p =
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)dst[b].q, p);
        dst[b].d = d;
        dst[b].sum = _mm_cvtsi128_si32(s4);
#else
        float amax = 0;
        for (int l = 0; l < QK; l++) amax = fmaxf(amax, fabsf(x[l]));
        float d, id;
        act_scale(amax, f16_scale, &d, &id);
        int sum = 0;
        for (int l = 0; l < QK; l++) {
            int q = (int)lrintf(x[l] * id);
            dst[b].q[l] = (int8_t)q;
            sum += q;
        }
        dst[b].d = d;
        dst[b].sum = sum;
#endif
    }
}

/* ---------------------------------------------------------------- portable dots */

/* The portable kernels unpack a block's weights to int8 first, so the
 * integer dot products are plain loops the compiler can vectorize. */
static int dot_i8(const int8_t *a, const int8_t *b, int n) {
    int s = 0;
    for (int l = 0; l < n; l++) s += a[l] * b[l];
    return s;
}

static float dot_q8_0_c(const void *w, const rk_q8_block *x, int k) {
    const uint8_t *b = w;
    float acc = 0;
    for (int i = 0; i < k / QK; i++, b += 34)
        acc += rdh(b) * x[i].d * (float)dot_i8((const int8_t *)(b + 2), x[i].q, QK);
    return acc;
}

static float dot_q4_0_c(const void *w, const rk_q8_block *x, int k) {
    const uint8_t *b = w;
    float acc = 0;
    for (int i = 0; i < k / QK; i++, b += 18) {
        const uint8_t *q = b + 2;
        int s = 0;
        for (int l = 0; l < 16; l++)
            s += ((q[l] & 15) - 8) * x[i].q[l] + ((q[l] >> 4) - 8) * x[i].q[l + 16];
        acc += rdh(b) * x[i].d * (float)s;
    }
    return acc;
}

static float dot_kq_c(const uint8_t *b, size_t bytes, int has_qh, const rk_q8_block *x, int k) {
    float acc = 0;
    int8_t q[QKK];
    for (int i = 0; i < k / QKK; i++, b += bytes, x += 8) {
        float d = rdh(b), dmin = rdh(b + 2);
        const uint8_t *qh = b + 16, *qs = b + (has_qh ? 48 : 16);
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++) {
                int v = (qs[32 * (j / 2) + l] >> (j & 1) * 4) & 15;
                if (has_qh) v |= (qh[l] >> j & 1) << 4;
                q[32 * j + l] = (int8_t)v;
            }
        for (int j = 0; j < 8; j++) {
            int sc, m;
            rk_cpu_kq_scale_min(b + 4, j, &sc, &m);
            int s = dot_i8(q + 32 * j, x[j].q, 32);
            acc += x[j].d * (d * (float)sc * (float)s - dmin * (float)m * (float)x[j].sum);
        }
    }
    return acc;
}

static float dot_q4_k_c(const void *w, const rk_q8_block *x, int k) {
    return dot_kq_c(w, 144, 0, x, k);
}
static float dot_q5_k_c(const void *w, const rk_q8_block *x, int k) {
    return dot_kq_c(w, 176, 1, x, k);
}

static float dot_q6_k_c(const void *w, const rk_q8_block *x, int k) {
    const uint8_t *b = w;
    float acc = 0;
    int8_t q[QKK];
    for (int i = 0; i < k / QKK; i++, b += 210, x += 8) {
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = rdh(b + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            for (int l = 0; l < 32; l++) {
                int8_t *o = q + 128 * h + l;
                o[0] = (int8_t)(((ql[l] & 15) | (qh[l] & 3) << 4) - 32);
                o[32] = (int8_t)(((ql[l + 32] & 15) | (qh[l] >> 2 & 3) << 4) - 32);
                o[64] = (int8_t)(((ql[l] >> 4) | (qh[l] >> 4 & 3) << 4) - 32);
                o[96] = (int8_t)(((ql[l + 32] >> 4) | (qh[l] >> 6) << 4) - 32);
            }
        }
        for (int g = 0; g < 8; g++) {
            int s0 = dot_i8(q + 32 * g, x[g].q, 16), s1 = dot_i8(q + 32 * g + 16, x[g].q + 16, 16);
            acc += d * x[g].d * (float)(sc[2 * g] * s0 + sc[2 * g + 1] * s1);
        }
    }
    return acc;
}

/* ---------------------------------------------------------------- SIMD dots */

#ifdef __AVX2__
/* The kernels, instantiated once per multiply-add primitive. Activation
 * sums of a K-quant super-block go through a scalar accumulator. */
#define DEF_SIMD_DOTS(SUF, MUL)                                                                    \
    static float dot_q8_0_##SUF(const void *w, const rk_q8_block *x, int k) {                      \
        const uint8_t *b = w;                                                                      \
        __m256 acc = _mm256_setzero_ps();                                                          \
        for (int i = 0; i < k / QK; i++, b += 34) {                                                \
            __m256i q = _mm256_loadu_si256((const __m256i *)(b + 2));                              \
            __m256i p = RK_MUL_SUM_SS(MUL, q, _mm256_loadu_si256((const __m256i *)x[i].q));        \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),                                           \
                                  _mm256_set1_ps(_cvtsh_ss(rd16(b)) * x[i].d), acc);               \
        }                                                                                          \
        return rk_hsum256(acc);                                                                    \
    }                                                                                              \
    static float dot_q4_0_##SUF(const void *w, const rk_q8_block *x, int k) {                      \
        const uint8_t *b = w;                                                                      \
        const __m256i m4 = _mm256_set1_epi8(15), eight = _mm256_set1_epi8(8);                      \
        __m256 acc = _mm256_setzero_ps();                                                          \
        for (int i = 0; i < k / QK; i++, b += 18) {                                                \
            __m128i raw = _mm_loadu_si128((const __m128i *)(b + 2));                               \
            __m256i q = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);                             \
            q = _mm256_sub_epi8(_mm256_and_si256(q, m4), eight);                                   \
            __m256i p = RK_MUL_SUM_SS(MUL, q, _mm256_loadu_si256((const __m256i *)x[i].q));        \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),                                           \
                                  _mm256_set1_ps(_cvtsh_ss(rd16(b)) * x[i].d), acc);               \
        }                                                                                          \
        return rk_hsum256(acc);                                                                    \
    }                                                                                              \
    static float dot_kq_##SUF(const uint8_t *b, size_t bytes, int has_qh, const rk_q8_block *x,    \
                              int k) {                                                             \
        const __m256i m4 = _mm256_set1_epi8(15), b16 = _mm256_set1_epi8(16);                       \
        __m256 acc = _mm256_setzero_ps();                                                          \
        float mins = 0;                                                                            \
        for (int i = 0; i < k / QKK; i++, b += bytes, x += 8) {                                    \
            float d = _cvtsh_ss(rd16(b)), dmin = _cvtsh_ss(rd16(b + 2));                           \
            const uint8_t *qs = b + (has_qh ? 48 : 16);                                            \
            __m256i hb =                                                                           \
                has_qh ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();   \
            for (int c = 0; c < 4; c++) {                                                          \
                __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));                  \
                __m256i q[2] = {_mm256_and_si256(raw, m4),                                         \
                                _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4)};                  \
                for (int u = 0; u < 2; u++) {                                                      \
                    int j = 2 * c + u, sc, m;                                                      \
                    rk_cpu_kq_scale_min(b + 4, j, &sc, &m);                                        \
                    if (has_qh) {                                                                  \
                        __m256i bit = _mm256_set1_epi8((char)(1 << j));                            \
                        __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit);           \
                        q[u] = _mm256_or_si256(q[u], _mm256_and_si256(set, b16));                  \
                    }                                                                              \
                    __m256i p = MUL(q[u], _mm256_loadu_si256((const __m256i *)x[j].q));            \
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),                                   \
                                          _mm256_set1_ps(d * (float)sc * x[j].d), acc);            \
                    mins += dmin * (float)m * x[j].d * (float)x[j].sum;                            \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        return rk_hsum256(acc) - mins;                                                             \
    }                                                                                              \
    /* inline: the VNNI table takes the 512-bit Q4_K kernel where it exists */                     \
    static inline float dot_q4_k_##SUF(const void *w, const rk_q8_block *x, int k) {               \
        return dot_kq_##SUF(w, 144, 0, x, k);                                                      \
    }                                                                                              \
    static float dot_q5_k_##SUF(const void *w, const rk_q8_block *x, int k) {                      \
        return dot_kq_##SUF(w, 176, 1, x, k);                                                      \
    }                                                                                              \
    static float dot_q6_k_##SUF(const void *w, const rk_q8_block *x, int k) {                      \
        const uint8_t *b = w;                                                                      \
        const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);                         \
        const __m256i b32 = _mm256_set1_epi8(32);                                                  \
        __m256 acc = _mm256_setzero_ps();                                                          \
        for (int i = 0; i < k / QKK; i++, b += 210, x += 8) {                                      \
            const int8_t *sc = (const int8_t *)(b + 192);                                          \
            float d = _cvtsh_ss(rd16(b + 208));                                                    \
            for (int h = 0; h < 2; h++) {                                                          \
                __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));                    \
                __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));               \
                __m256i hh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));              \
                __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),               \
                                 _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),                   \
                                 _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};                  \
                for (int g = 0; g < 4; g++) {                                                      \
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hh, 2 * g), m3);               \
                    __m256i q =                                                                    \
                        _mm256_sub_epi8(_mm256_or_si256(lo[g], _mm256_slli_epi16(hi, 4)), b32);    \
                    const rk_q8_block *xb = &x[4 * h + g];                                         \
                    __m256i p = RK_MUL_SUM_SS(MUL, q, _mm256_loadu_si256((const __m256i *)xb->q)); \
                    int e = 8 * h + 2 * g;                                                         \
                    __m256i s = _mm256_setr_epi32(sc[e], sc[e], sc[e], sc[e], sc[e + 1],           \
                                                  sc[e + 1], sc[e + 1], sc[e + 1]);                \
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(p, s)),            \
                                          _mm256_set1_ps(d * xb->d), acc);                         \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        return rk_hsum256(acc);                                                                    \
    }

DEF_SIMD_DOTS(avx2, rk_mul_sum_us_avx2)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
DEF_SIMD_DOTS(vnni, rk_mul_sum_us_vnni)
#endif
#endif

/* Q4_K with 512-bit VNNI, a super-block at a time: one _mm512_dpbusd_epi32
 * multiplies a byte row of nibbles (sub-blocks 2c and 2c + 1 in the low and
 * high 256 bits) with the two activation blocks, and each half of its 16
 * lanes is scaled by its own sub-block's d sc x.d in one FMA. The eight
 * scales and mins are unpacked together (the 12 bytes as three words), and
 * the mins term dmin m x.d x.sum is a vector over the eight sub-blocks. The
 * integer sums are those of the other kernels; the f32 order differs. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RK_Q4K_VNNI512 1
static float dot_q4_k_vnni512(const void *w, const rk_q8_block *x, int k) {
    const uint8_t *b = w;
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i deint = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}; /* two FMA chains */
    __m256 mins = _mm256_setzero_ps();
    for (int i = 0; i < k / QKK; i++, b += 144, x += 8) {
        uint32_t u[4];
        memcpy(u, b + 4, 12);
        /* bytes 0..7: the scales of sub-blocks 0..7, bytes 8..15 their mins */
        u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
        uint32_t m03 = u[1] & 0x3f3f3f3fu;
        u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
        u[2] = m03;
        u[0] &= 0x3f3f3f3fu;
        /* from registers: a 128-bit load of four 32-bit stores would stall */
        __m128i sm = _mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3]);
        __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm));
        __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
        /* (d, sum) of the eight blocks as four 128-bit pairs of pairs, then
         * d0..d7 in the low half and sum0..sum7 in the high half */
        __m128i pr[4];
        for (int j = 0; j < 4; j++)
            pr[j] = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)&x[2 * j]),
                                       _mm_loadl_epi64((const __m128i *)&x[2 * j + 1]));
        __m512i ds = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(pr[1], pr[0])),
                                        _mm256_set_m128i(pr[3], pr[2]), 1);
        ds = _mm512_permutexvar_epi32(deint, ds);
        __m256 xd = _mm256_castsi256_ps(_mm512_castsi512_si256(ds));
        __m256 xs = _mm256_cvtepi32_ps(_mm512_extracti64x4_epi64(ds, 1));
        __m256 dmin = _mm256_set1_ps(_cvtsh_ss(rd16(b + 2)));
        mins = _mm256_fmadd_ps(_mm256_mul_ps(mn, dmin), _mm256_mul_ps(xd, xs), mins);
        __m512 f = _mm512_castps256_ps512(
            _mm256_mul_ps(_mm256_mul_ps(sc, xd), _mm256_set1_ps(_cvtsh_ss(rd16(b)))));
        const uint8_t *qs = b + 16;
        for (int c = 0; c < 4; c++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m512i q =
                _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
            q = _mm512_and_si512(q, m4);
            __m512i xq = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)x[2 * c].q)),
                _mm256_loadu_si256((const __m256i *)x[2 * c + 1].q), 1);
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xq);
            __m512 fc = _mm512_permutexvar_ps(_mm512_add_epi32(half, _mm512_set1_epi32(2 * c)), f);
            acc[c & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), fc, acc[c & 1]);
        }
    }
    /* one horizontal sum: the mins ride in the low half */
    return _mm512_reduce_add_ps(
        _mm512_sub_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_zextps256_ps512(mins)));
}
#endif

/* ---------------------------------------------------------------- dispatch */

static rk_cpu_isa g_forced = RK_CPU_ISA_AUTO;

static int isa_available(rk_cpu_isa isa) {
    switch (isa) {
    case RK_CPU_ISA_AUTO:
    case RK_CPU_ISA_PORTABLE: return 1;
    case RK_CPU_ISA_AVX2:
#ifdef __AVX2__
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
        return 0;
#endif
    case RK_CPU_ISA_AVX512_VNNI:
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
        return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
#else
        return 0;
#endif
    case RK_CPU_ISA_AVX512_BF16:
#ifdef RK_CPU_BF16_KERNELS
        return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
#else
        return 0;
#endif
    }
    return 0;
}

rk_status rk_cpu_force_isa(rk_cpu_isa isa) {
    if (!isa_available(isa))
        return rk_errorf(RK_ERR_UNSUPPORTED, "cpu: instruction set %d is not available here",
                         (int)isa);
    g_forced = isa;
    return RK_OK;
}

rk_cpu_isa rk_cpu_isa_active(void) {
    if (g_forced != RK_CPU_ISA_AUTO) return g_forced;
    if (isa_available(RK_CPU_ISA_AVX512_BF16)) return RK_CPU_ISA_AVX512_BF16;
    if (isa_available(RK_CPU_ISA_AVX512_VNNI)) return RK_CPU_ISA_AVX512_VNNI;
    if (isa_available(RK_CPU_ISA_AVX2)) return RK_CPU_ISA_AVX2;
    return RK_CPU_ISA_PORTABLE;
}

rk_cpu_isa rk_cpu_qdot_isa(void) {
    rk_cpu_isa isa = rk_cpu_isa_active();
    if (isa == RK_CPU_ISA_AVX512_BF16)
        isa = isa_available(RK_CPU_ISA_AVX512_VNNI) ? RK_CPU_ISA_AVX512_VNNI
              : isa_available(RK_CPU_ISA_AVX2)      ? RK_CPU_ISA_AVX2
                                                    : RK_CPU_ISA_PORTABLE;
    return isa;
}

rk_qdot_fn rk_cpu_qdot_fn(rk_dtype t) {
    static const rk_qdot_fn portable[] = {dot_q8_0_c, dot_q4_0_c, dot_q4_k_c, dot_q5_k_c,
                                          dot_q6_k_c};
    if (!rk_dtype_is_quant(t) || rk_cpu_act_is_q8k(t)) return NULL;
    rk_cpu_isa isa = rk_cpu_qdot_isa();
    if (t == RK_DTYPE_MXFP4) return rk_cpu_qdot_mxfp4(isa);
    if (t > RK_DTYPE_Q6_K) return rk_cpu_qdot_q32(t, isa);
    int i = (int)t - (int)RK_DTYPE_Q8_0;
    switch (isa) {
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case RK_CPU_ISA_AVX512_VNNI: {
#ifdef RK_Q4K_VNNI512
        static const rk_qdot_fn f[] = {dot_q8_0_vnni, dot_q4_0_vnni, dot_q4_k_vnni512,
                                       dot_q5_k_vnni, dot_q6_k_vnni};
#else
        static const rk_qdot_fn f[] = {dot_q8_0_vnni, dot_q4_0_vnni, dot_q4_k_vnni, dot_q5_k_vnni,
                                       dot_q6_k_vnni};
#endif
        return f[i];
    }
#endif
#ifdef __AVX2__
    case RK_CPU_ISA_AVX2: {
        static const rk_qdot_fn f[] = {dot_q8_0_avx2, dot_q4_0_avx2, dot_q4_k_avx2, dot_q5_k_avx2,
                                       dot_q6_k_avx2};
        return f[i];
    }
#endif
    default: return portable[i];
    }
}
