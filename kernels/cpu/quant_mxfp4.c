/* kernels/cpu/quant_mxfp4.c — MXFP4, the OCP microscaling 4-bit float type
 * gpt-oss's experts are stored in: conversions to and from f32 and the dot
 * product against activation blocks of 32 (rk_q8_block), which is what the
 * reference engine dots MXFP4 with (its Q8_0).
 *
 * Block layout (as GGML writes it, type id 39), 32 elements in 17 bytes:
 *   u8 e | u8 q[16]
 * e is an E8M0 scale (the power of two 2^(e - 127), no sign, no mantissa);
 * byte i of q holds element i (low nibble) and element i + 16 (high). Each
 * nibble is an E2M1 float: bit 3 the sign, then the values 0, 0.5, 1, 1.5,
 * 2, 3, 4, 6. They are computed as integers twice their value
 * (rk_mxfp4_values: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives) times half
 * the scale, 2^(e - 128), so x = v[q] 2^(e - 128) exactly.
 *
 * Quantizing (as the reference's quantizer): e = floor(log2(max |x|)) - 2 +
 * 127 (0 for an all-zero block), each element the code nearest x / 2^(e -
 * 128) (the first on a tie). */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

#define QK 32
#define BB 17

const int8_t rk_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

float rk_cpu_e8m0_half(uint8_t e) {
    /* 2^(e - 128): a subnormal for e < 2, else exponent field e - 1 */
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

void rk_cpu_dequantize_mxfp4(float *y, const void *src, size_t n) {
    const uint8_t *b = src;
    for (size_t i = 0; i < n / QK; i++, b += BB, y += QK) {
        float d = rk_cpu_e8m0_half(b[0]);
        for (int l = 0; l < 16; l++) {
            y[l] = d * (float)rk_mxfp4_values[b[1 + l] & 15];
            y[l + 16] = d * (float)rk_mxfp4_values[b[1 + l] >> 4];
        }
    }
}

static int nearest(float x, float d) {
    int best = 0;
    float err = fabsf((float)rk_mxfp4_values[0] * d - x);
    for (int j = 1; j < 16; j++) {
        float e = fabsf((float)rk_mxfp4_values[j] * d - x);
        if (e < err) {
            err = e;
            best = j;
        }
    }
    return best;
}

void rk_cpu_quantize_mxfp4(void *dst, const float *src, size_t n) {
    uint8_t *b = dst;
    for (size_t i = 0; i < n / QK; i++, b += BB, src += QK) {
        float amax = 0;
        for (int l = 0; l < QK; l++) amax = fmaxf(amax, fabsf(src[l]));
        int e = 0;
        if (amax > 0) {
            e = (int)floorf(log2f(amax)) - 2 + 127;
            e = e < 0 ? 0 : e > 254 ? 254 : e;
        }
        float d = rk_cpu_e8m0_half((uint8_t)e);
        b[0] = (uint8_t)e;
        for (int l = 0; l < 16; l++)
            b[1 + l] = (uint8_t)(nearest(src[l], d) | nearest(src[l + 16], d) << 4);
    }
}

/* ---------------------------------------------------------------- dots */

static float dot_mxfp4_c(const void *w, const rk_q8_block *x, int k) {
    const uint8_t *b = w;
    float acc = 0;
    for (int i = 0; i < k / QK; i++, b += BB) {
        int s = 0;
        for (int l = 0; l < 16; l++)
            s += rk_mxfp4_values[b[1 + l] & 15] * x[i].q[l] +
                 rk_mxfp4_values[b[1 + l] >> 4] * x[i].q[l + 16];
        acc += rk_cpu_e8m0_half(b[0]) * x[i].d * (float)s;
    }
    return acc;
}

#ifdef __AVX2__
#define DEF_MXFP4_DOT(SUF, MUL)                                                                    \
    static float dot_mxfp4_##SUF(const void *w, const rk_q8_block *x, int k) {                     \
        const uint8_t *b = w;                                                                      \
        const __m256i table =                                                                      \
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)rk_mxfp4_values));        \
        __m256 acc = _mm256_setzero_ps();                                                          \
        for (int i = 0; i < k / QK; i++, b += BB) {                                                \
            __m128i raw = _mm_loadu_si128((const __m128i *)(b + 1));                               \
            __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),          \
                                           _mm256_set1_epi8(15));                                  \
            __m256i q = _mm256_shuffle_epi8(table, nib);                                           \
            __m256i p = RK_MUL_SUM_SS(MUL, q, _mm256_loadu_si256((const __m256i *)x[i].q));        \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),                                           \
                                  _mm256_set1_ps(rk_cpu_e8m0_half(b[0]) * x[i].d), acc);           \
        }                                                                                          \
        return rk_hsum256(acc);                                                                    \
    }
DEF_MXFP4_DOT(avx2, rk_mul_sum_us_avx2)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
DEF_MXFP4_DOT(vnni, rk_mul_sum_us_vnni)
#endif
#endif

rk_qdot_fn rk_cpu_qdot_mxfp4(rk_cpu_isa isa) {
    switch (isa) {
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case RK_CPU_ISA_AVX512_VNNI: return dot_mxfp4_vnni;
#endif
#ifdef __AVX2__
    case RK_CPU_ISA_AVX2: return dot_mxfp4_avx2;
#endif
    default: return dot_mxfp4_c;
    }
}
