/* tests/test_mxfp4.c — the MXFP4 weight type: its layout read from the OCP
 * microscaling description (E8M0 scale, E2M1 elements), every code, the
 * quantizer's choice of scale, and the dot product against quantized
 * activations. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static uint32_t urand(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 32);
}
static float frand(void) { return (float)(urand() >> 8) * (1.0f / 8388608.0f) - 1.0f; }

/* E2M1 from its bits: sign (bit 3), exponent (bits 2-1, bias 1), mantissa
 * (bit 0); exponent 0 is subnormal, 0.5 * m. */
static double e2m1(int code) {
    int s = code >> 3 & 1, ex = code >> 1 & 3, m = code & 1;
    double v = ex == 0 ? 0.5 * m : ldexp(1.0 + 0.5 * m, ex - 1);
    return s ? -v : v;
}

/* Element e of a block as the description reads it: e2m1(q) 2^(e8 - 127). */
static float ref_element(const uint8_t *b, int e) {
    int q = e < 16 ? b[1 + e] & 15 : b[1 + e - 16] >> 4;
    /* the negative zero (code 8) reads as +0, as the reference engine's
     * integer codebook gives it */
    return (float)(e2m1(q) * ldexp(1.0, (int)b[0] - 127)) + 0.0f;
}

Test(mxfp4, type_table_has_the_layout) {
    cr_assert_str_eq(rk_ggml_type_name(RK_GGML_MXFP4), "MXFP4");
    cr_assert_eq(RK_GGML_MXFP4, 39);
    cr_assert_eq(rk_ggml_type_row_bytes(RK_GGML_MXFP4, 96), 3 * 17);
    cr_assert_eq(rk_dtype_block(RK_DTYPE_MXFP4), 32);
    cr_assert_eq(rk_dtype_block_bytes(RK_DTYPE_MXFP4), 17);
    cr_assert_eq(rk_dtype_row_bytes(RK_DTYPE_MXFP4, 33), 0);
    cr_assert(rk_dtype_is_quant(RK_DTYPE_MXFP4));
    cr_assert_str_eq(rk_dtype_name(RK_DTYPE_MXFP4), "mxfp4");
}

/* Random blocks, every byte random (scales of the whole E8M0 range but the
 * NaN code 255), dequantize bit for bit as described. */
Test(mxfp4, random_blocks_dequantize_bit_for_bit_as_described) {
    enum { NB = 512 };
    uint8_t q[NB * 17];
    float y[NB * 32];
    for (size_t i = 0; i < sizeof q; i++) q[i] = (uint8_t)urand();
    for (int i = 0; i < NB; i++)
        if (q[i * 17] == 255) q[i * 17] = 254;
    q[0] = 0; /* the two subnormal scales */
    q[17] = 1;
    rk_dequantize(y, q, RK_DTYPE_MXFP4, NB * 32);
    for (int i = 0; i < NB; i++)
        for (int e = 0; e < 32; e++) {
            float want = ref_element(q + i * 17, e), got = y[i * 32 + e];
            cr_assert(memcmp(&want, &got, sizeof want) == 0,
                      "block %d (e %d) element %d: %a, want %a", i, q[i * 17], e, (double)got,
                      (double)want);
        }
}

/* Every code in every position of a block of scale 1 (e = 127) reads as its
 * E2M1 value; the codebook is twice those values. */
Test(mxfp4, every_code_reads_as_its_e2m1_value) {
    for (int c = 0; c < 16; c++)
        cr_assert_eq((double)rk_mxfp4_values[c], 2 * e2m1(c), "code %d", c);
    uint8_t b[17];
    float y[32];
    for (int shift = 0; shift < 16; shift++) {
        b[0] = 127;
        for (int l = 0; l < 16; l++)
            b[1 + l] = (uint8_t)((l + shift) % 16 | ((l + 16 + shift) % 16) << 4);
        rk_dequantize(y, b, RK_DTYPE_MXFP4, 32);
        for (int e = 0; e < 32; e++)
            cr_assert_eq((double)y[e], e2m1((e + shift) % 16), "element %d code %d", e,
                         (e + shift) % 16);
    }
    for (int e = 0; e < 256; e++) {
        b[0] = (uint8_t)e;
        cr_assert_eq((double)rk_cpu_e8m0_half((uint8_t)e), ldexp(1.0, e - 128), "e %d", e);
    }
}

/* The quantizer picks e = floor(log2 max|x|) - 2 + 127 and for each element
 * the nearest code (the first of equals), as the reference's does; an
 * all-zero block is e 0, codes 0. */
Test(mxfp4, quantizer_picks_the_scale_and_nearest_codes) {
    enum { NB = 64 };
    float x[NB * 32], y[NB * 32];
    uint8_t q[NB * 17];
    for (int i = 0; i < NB * 32; i++) x[i] = frand() * ldexpf(1.0f, i / 32 % 9 - 4);
    for (int l = 0; l < 32; l++) x[32 + l] = 0;
    x[64] = 1.75f; /* max exactly between two codes: 1.5 and 2 at scale 2^-2 ... */
    rk_quantize(q, x, RK_DTYPE_MXFP4, NB * 32);
    rk_dequantize(y, q, RK_DTYPE_MXFP4, NB * 32);
    for (int i = 0; i < NB; i++) {
        float amax = 0;
        for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(x[i * 32 + l]));
        int e = amax > 0 ? (int)floor(log2((double)amax)) - 2 + 127 : 0;
        cr_assert_eq(q[i * 17], e, "block %d: e %d, want %d", i, q[i * 17], e);
        for (int l = 0; l < 32; l++) {
            double xv = x[i * 32 + l], d = ldexp(1.0, e - 128), best = 1e30;
            int bc = 0;
            for (int c = 0; c < 16; c++)
                if (fabs(rk_mxfp4_values[c] * d - xv) < best) {
                    best = fabs(rk_mxfp4_values[c] * d - xv);
                    bc = c;
                }
            int got = l < 16 ? q[i * 17 + 1 + l] & 15 : q[i * 17 + 1 + l - 16] >> 4;
            cr_assert_eq(got, bc, "block %d element %d (%g): code %d, want %d", i, l, xv, got, bc);
        }
    }
    for (int l = 0; l < 32; l++) cr_assert_eq(y[32 + l], 0.0f);
}

/* The dot kernel of every instruction set is the reference engine's sum:
 * per block, 2^(e - 128) d_x sum(v[q] q_x), exact in integers. */
Test(mxfp4, dot_is_the_scaled_integer_sum_at_every_isa) {
    int k = 2048;
    float *w = malloc((size_t)k * sizeof *w), *x = malloc((size_t)k * sizeof *x);
    uint8_t *wq = malloc(rk_dtype_row_bytes(RK_DTYPE_MXFP4, (size_t)k));
    rk_q8_block *xq = malloc((size_t)k / 32 * sizeof *xq);
    cr_assert(w && x && wq && xq);
    for (int i = 0; i < k; i++) {
        w[i] = frand() * (i % 61 == 0 ? 16.0f : 1.0f);
        x[i] = frand() * (i % 53 == 0 ? 16.0f : 1.0f);
    }
    rk_quantize(wq, w, RK_DTYPE_MXFP4, (size_t)k);
    rk_cpu_quantize_act(xq, x, k, 1);
    double ref = 0;
    for (int b = 0; b < k / 32; b++) {
        long s = 0;
        for (int l = 0; l < 32; l++) {
            int c = l < 16 ? wq[b * 17 + 1 + l] & 15 : wq[b * 17 + 1 + l - 16] >> 4;
            s += (long)rk_mxfp4_values[c] * xq[b].q[l];
        }
        ref += ldexp(1.0, wq[b * 17] - 128) * xq[b].d * (double)s;
    }
    static const rk_cpu_isa isas[] = {RK_CPU_ISA_PORTABLE, RK_CPU_ISA_AVX2, RK_CPU_ISA_AVX512_VNNI};
    int n_run = 0;
    for (size_t a = 0; a < sizeof isas / sizeof isas[0]; a++) {
        if (rk_cpu_force_isa(isas[a]) != RK_OK) continue;
        n_run++;
        rk_qdot_fn f = rk_cpu_qdot_fn(RK_DTYPE_MXFP4);
        cr_assert_not_null(f);
        float got = f(wq, xq, k);
        cr_assert_float_eq(got, ref, 1e-5 * (1.0 + fabs(ref)), "isa %d: %g, want %g", (int)isas[a],
                           got, ref);
    }
    cr_assert_eq(rk_cpu_force_isa(RK_CPU_ISA_AUTO), RK_OK);
    cr_assert_geq(n_run, 1);
    free(w);
    free(x);
    free(wq);
    free(xq);
}
