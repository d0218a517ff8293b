/* kernels/cpu/qpack.c — Q8_0, Q3_K, Q4_K, Q6_K and MXFP4 weights repacked once, at load,
 * for the integer kernels of CPUs with AVX-512 VNNI (decode, and every
 * matmul below RK_CPU_QPACK_MV_MAX_N rows).
 *
 * The stored layout (kernels/cpu/quant.c) puts a row's blocks one after the
 * other, so a dot kernel meets one row at a time and spends a horizontal sum
 * and a scale per block and row. Here eight rows form a group and, within
 * each block column of the group, the quants are interleaved four elements
 * at a time: one 32-byte load holds elements 4c .. 4c + 3 of each of the
 * eight rows (row r in bytes 4r .. 4r + 3), so _mm256_dpbusd_epi32 against
 * a broadcast of the four matching activations adds them into eight lanes,
 * one per row, with no horizontal sum. Scales sit beside the quants as
 * vectors over the group's rows. Rows past m in the last group are zero.
 *
 * A block column of a group (little-endian; r = row in the group, 0..7):
 *   Q8_0 (32 elements, 272 bytes = 8 x 34):
 *     f16 d[8] | 8 chunks of 32 bytes: chunk c, byte 4r + e = q_r[4c + e] + 128
 *   Q4_K (256 elements, 1184 bytes; 8 x 144 plus 32: the 6-bit scales and
 *   mins are unpacked to bytes):
 *     f16 d[8] | f16 dmin[8] | u8 sc[8 sub-blocks][8] | u8 m[8][8] |
 *     per sub-block j, 4 chunks of 32 bytes: chunk t, byte 4r + e holds
 *     element 4t + e of sub-block j in its low nibble, 16 + 4t + e in its high
 *   Q6_K (256 elements, 1680 bytes = 8 x 210):
 *     per sub-block j: the low 4 bits in 4 chunks of 32 bytes as Q4_K's,
 *     then the high 2 bits in 2 chunks of 32 bytes: chunk u, byte 4r + e,
 *     bits 2p .. 2p + 1 hold those of element 16u + 4p + e |
 *     f16 d[8] | i8 sc[16 groups of 16][8]
 *   Q3_K (256 elements, 912 bytes; 8 x 110 plus 32: the 6-bit scales are
 *   unpacked to bytes); element values v = q + 4 (1 - h), 0..7, as in
 *   kernels/cpu/quant_q8k.c:
 *     per pair p of 16-groups (elements 32p .. 32p + 31), 96 bytes: two
 *     chunks of 32 bytes of low bits, chunk s (group 2p + s), byte 4r + e,
 *     bits 2t .. 2t + 1 hold the low two bits of v of element
 *     32p + 16s + 4t + e; then 32 bytes of high bits, byte 4r + e, bit
 *     4s + t holds bit 2 of v of that element |
 *     f16 d[8] | i8 s - 32[16 groups][8]
 *   MXFP4 (32 elements, 136 bytes = 8 x 17):
 *     u8 e[8] | 4 chunks of 32 bytes as one Q4_K sub-block's: chunk t, byte
 *     4r + e holds the code of element 4t + e in its low nibble, 16 + 4t + e
 *     in its high
 *
 * The unsigned operand of dpbusd is the weight: Q8_0 quants are stored plus
 * 128 (the kernel takes 128 times the activation block's sum back off), Q6_K
 * quants as 0..63 (32 times each 16-element activation sum is taken back
 * off before the group's scale), Q3_K values as 0..7 (4 times each 16-element
 * sum of its Q8_K activations is taken back off, as the unpacked kernels of
 * quant_q8k.c do: the integer sum of a super-block is theirs), MXFP4 codes
 * looked up as twice their value plus 12, 0..24 (12 times the activation
 * block's sum is taken back off). Integer sums
 * are exact; the f32 order is fixed per output (block after block, in k
 * order), so a row of x gets the same bits alone or with others, on any
 * thread. The prefill side reads rows back (rk_cpu_qpack_dequant_rows) with
 * the arithmetic of rk_dequantize, so it gets the bits of the stored
 * weights. */
#include <string.h>

#include "kernels/cpu/cpu.h"

#define QR 8 /* rows of w per group */

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (unsigned)p[1] << 8); }

/* Bytes of one block column of a group; 0 for a type not packed. */
static size_t col_bytes(rk_dtype t) {
    switch (t) {
    case RK_DTYPE_Q8_0: return 272;
    case RK_DTYPE_Q4_K: return 1184;
    case RK_DTYPE_Q6_K: return 1680;
    case RK_DTYPE_Q3_K: return 912;
    case RK_DTYPE_MXFP4: return 136;
    default: return 0;
    }
}

static size_t group_bytes(rk_dtype t, int k) {
    return (size_t)k / rk_dtype_block(t) * col_bytes(t);
}

int rk_cpu_qpack_supported(rk_dtype t) {
#ifdef RK_CPU_VNNI_KERNELS
    rk_cpu_isa isa = rk_cpu_isa_active();
    return col_bytes(t) > 0 && (isa == RK_CPU_ISA_AVX512_VNNI || isa == RK_CPU_ISA_AVX512_BF16) &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw");
#else
    (void)t;
    return 0;
#endif
}

size_t rk_cpu_qpack_bytes(rk_dtype t, int k, int m) {
    if (k <= 0 || m <= 0 || col_bytes(t) == 0 || k % (int)rk_dtype_block(t)) return 0;
    return (size_t)(m + QR - 1) / QR * group_bytes(t, k);
}

/* ---------------------------------------------------------------- packing */

/* Quant values 0..15 (Q4_K) or 0..63 (Q6_K) of one row's super-block. */
static void kq_values(uint8_t q[256], const uint8_t *b, rk_dtype t) {
    if (t == RK_DTYPE_Q4_K) {
        const uint8_t *qs = b + 16;
        for (int e = 0; e < 256; e++) q[e] = (qs[32 * (e / 64) + e % 32] >> 4 * (e / 32 % 2)) & 15;
        return;
    }
    const uint8_t *ql = b, *qh = b + 128;
    for (int e = 0; e < 256; e++) {
        int h = e / 128, g = e % 128 / 32, l = e % 32;
        int lo = ql[64 * h + 32 * (g & 1) + l] >> 4 * (g >> 1) & 15;
        q[e] = (uint8_t)(lo | (qh[32 * h + l] >> 2 * g & 3) << 4);
    }
}

/* Row r's bytes in (element order) into the four-element chunks at p
 * (chunk c at p + 32 c), and back out. */
static void scatter_row(uint8_t *p, int r, const uint8_t *in, int chunks) {
    for (int c = 0; c < chunks; c++) memcpy(p + 32 * c + 4 * r, in + 4 * c, 4);
}
static void gather_row(uint8_t *out, const uint8_t *p, int r, int chunks) {
    for (int c = 0; c < chunks; c++) memcpy(out + 4 * c, p + 32 * c + 4 * r, 4);
}

/* Offsets in a block column: Q4_K sub-block j's nibbles; Q6_K sub-block j's
 * nibbles and high bits (side by side, so the kernel reads one stream), its
 * d and its scales. */
#define Q4K_Q(j)  (160 + 128 * (j))
#define Q6K_LO(j) (192 * (j))
#define Q6K_HI(j) (192 * (j) + 128)
#define Q6K_D     1536
#define Q6K_SC    1552
#define Q3K_LO(p) (96 * (p))
#define Q3K_HI(p) (96 * (p) + 64)
#define Q3K_D     768
#define Q3K_SC    784
#define MXFP4_Q   8

/* Q3_K's 6-bit scale of group g, as quant_q8k.c reads it (minus 32). */
static int q3k_scale(const uint8_t *sc, int g) {
    return ((sc[g % 8] >> 4 * (g / 8) & 15) | (sc[8 + g % 4] >> 2 * (g / 4) & 3) << 4) - 32;
}

/* Q3_K row r of the block b into the column at dst. */
static void pack_q3_k(uint8_t *dst, const uint8_t *b, int r) {
    memcpy(dst + Q3K_D + 2 * r, b + 108, 2);
    for (int g = 0; g < 16; g++) dst[Q3K_SC + 8 * g + r] = (uint8_t)(int8_t)q3k_scale(b + 96, g);
    for (int p = 0; p < 8; p++) {
        uint8_t lo[2][16] = {{0}}, hi[16] = {0};
        for (int s = 0; s < 2; s++)
            for (int t = 0; t < 4; t++)
                for (int e = 0; e < 4; e++) {
                    int el = 32 * p + 16 * s + 4 * t + e, n = el / 128, j = el % 128 / 32,
                        l = el % 32;
                    int v = (b[32 + 32 * n + l] >> 2 * j & 3) | (b[l] >> (4 * n + j) & 1) << 2;
                    lo[s][e] |= (uint8_t)((v & 3) << 2 * t);
                    hi[e] |= (uint8_t)((v >> 2) << (4 * s + t));
                }
        scatter_row(dst + Q3K_LO(p), r, lo[0], 1);
        scatter_row(dst + Q3K_LO(p) + 32, r, lo[1], 1);
        scatter_row(dst + Q3K_HI(p), r, hi, 1);
    }
}

static void pack_col(uint8_t *dst, const uint8_t *const src[QR], rk_dtype t) {
    memset(dst, 0, col_bytes(t));
    for (int r = 0; r < QR; r++) {
        const uint8_t *b = src[r];
        if (!b) continue;
        uint8_t lo[32], hi[8];
        if (t == RK_DTYPE_Q8_0) {
            memcpy(dst + 2 * r, b, 2);
            for (int l = 0; l < 32; l++) lo[l] = b[2 + l] ^ 0x80;
            scatter_row(dst + 16, r, lo, 8);
            continue;
        }
        if (t == RK_DTYPE_Q3_K) {
            pack_q3_k(dst, b, r);
            continue;
        }
        if (t == RK_DTYPE_MXFP4) { /* byte l of a block: elements l and 16 + l already */
            dst[r] = b[0];
            scatter_row(dst + MXFP4_Q, r, b + 1, 4);
            continue;
        }
        uint8_t q[256];
        kq_values(q, b, t);
        if (t == RK_DTYPE_Q4_K) {
            memcpy(dst + 2 * r, b, 2);
            memcpy(dst + 16 + 2 * r, b + 2, 2);
            for (int j = 0; j < 8; j++) {
                int sc, m;
                rk_cpu_kq_scale_min(b + 4, j, &sc, &m);
                dst[32 + 8 * j + r] = (uint8_t)sc;
                dst[96 + 8 * j + r] = (uint8_t)m;
            }
            for (int j = 0; j < 8; j++) {
                for (int l = 0; l < 16; l++)
                    lo[l] = (uint8_t)(q[32 * j + l] | q[32 * j + 16 + l] << 4);
                scatter_row(dst + Q4K_Q(j), r, lo, 4);
            }
        } else {
            memcpy(dst + Q6K_D + 2 * r, b + 208, 2);
            for (int g = 0; g < 16; g++) dst[Q6K_SC + 8 * g + r] = b[192 + g];
            for (int j = 0; j < 8; j++) {
                const uint8_t *qj = q + 32 * j;
                memset(hi, 0, sizeof hi);
                for (int l = 0; l < 16; l++) {
                    lo[l] = (uint8_t)((qj[l] & 15) | (qj[16 + l] & 15) << 4);
                    hi[l % 4] |= (uint8_t)((qj[l] >> 4) << 2 * (l / 4));
                    hi[4 + l % 4] |= (uint8_t)((qj[16 + l] >> 4) << 2 * (l / 4));
                }
                scatter_row(dst + Q6K_LO(j), r, lo, 4);
                scatter_row(dst + Q6K_HI(j), r, hi, 2);
            }
        }
    }
}

void rk_cpu_qpack_group(void *dst, const void *w, rk_dtype t, int k, int m, int g) {
    size_t row_bytes = rk_dtype_row_bytes(t, (size_t)k),
           blk = rk_dtype_row_bytes(t, rk_dtype_block(t));
    int nb = k / (int)rk_dtype_block(t);
    uint8_t *out = (uint8_t *)dst + (size_t)g * group_bytes(t, k);
    for (int b = 0; b < nb; b++) {
        const uint8_t *src[QR];
        for (int r = 0; r < QR; r++) {
            int row = QR * g + r;
            src[r] =
                row < m ? (const uint8_t *)w + (size_t)row * row_bytes + (size_t)b * blk : NULL;
        }
        pack_col(out + (size_t)b * col_bytes(t), src, t);
    }
}

/* ---------------------------------------------------------------- rows back */

#ifdef RK_CPU_VNNI_KERNELS
#include <immintrin.h>

/* Row r's 16 bytes of the four chunks at p. */
RK_CPU_VNNI_TARGET static inline __m128i gather16(const uint8_t *p, int r) {
    int32_t v[4];
    for (int c = 0; c < 4; c++) memcpy(&v[c], p + 32 * c + 4 * r, 4);
    return _mm_loadu_si128((const __m128i *)v);
}

/* y[0..16) = s * u - o for the 16 unsigned bytes of u. */
RK_CPU_VNNI_TARGET static inline void deq16(float *y, __m128i u, __m256 s, __m256 o) {
    for (int h = 0; h < 2; h++) {
        __m128i q = h ? _mm_srli_si128(u, 8) : u;
        _mm256_storeu_ps(
            y + 8 * h,
            _mm256_sub_ps(_mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q))), o));
    }
}

/* Q8_0 and Q4_K rows with the operations of the scalar loops below (a
 * product, then a difference; no fused multiply-add), so the same bits.
 * Returns 0 for the other types. */
RK_CPU_VNNI_TARGET static int dequant_row_simd(float *y, const uint8_t *col, rk_dtype t, int r,
                                               int nb) {
    const __m128i m4 = _mm_set1_epi8(15);
    if (t == RK_DTYPE_Q8_0) {
        for (int b = 0; b < nb; b++, col += 272, y += 32) {
            __m256 d = _mm256_set1_ps(rk_f16_to_f32(rd16(col + 2 * r)));
            for (int u = 0; u < 2; u++) {
                __m128i q = _mm_xor_si128(gather16(col + 16 + 128 * u, r), _mm_set1_epi8(-128));
                for (int h = 0; h < 2; h++)
                    _mm256_storeu_ps(y + 16 * u + 8 * h,
                                     _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                          h ? _mm_srli_si128(q, 8) : q))));
            }
        }
        return 1;
    }
    if (t != RK_DTYPE_Q4_K) return 0;
    for (int b = 0; b < nb; b++, col += 1184, y += 256) {
        float d = rk_f16_to_f32(rd16(col + 2 * r)), dmin = rk_f16_to_f32(rd16(col + 16 + 2 * r));
        for (int j = 0; j < 8; j++) {
            __m256 ds = _mm256_set1_ps(d * (float)col[32 + 8 * j + r]);
            __m256 dm = _mm256_set1_ps(dmin * (float)col[96 + 8 * j + r]);
            __m128i v = gather16(col + Q4K_Q(j), r);
            deq16(y + 32 * j, _mm_and_si128(v, m4), ds, dm);
            deq16(y + 32 * j + 16, _mm_and_si128(_mm_srli_epi16(v, 4), m4), ds, dm);
        }
    }
    return 1;
}
#endif

/* Each value is computed as rk_dequantize computes it, so the bits agree:
 * the row's bytes are gathered first, and the loops over them vectorize. */
void rk_cpu_qpack_dequant_rows(float *dst, const void *packed, rk_dtype t, int k, int r0,
                               int rows) {
    size_t cb = col_bytes(t), qb = rk_dtype_block(t);
    int nb = k / (int)qb;
    for (int i = 0; i < rows; i++) {
        int row = r0 + i, r = row % QR;
        const uint8_t *col = (const uint8_t *)packed + (size_t)(row / QR) * group_bytes(t, k);
        float *y = dst + (size_t)i * k;
#ifdef RK_CPU_VNNI_KERNELS
        if (dequant_row_simd(y, col, t, r, nb)) continue;
#endif
        for (int b = 0; b < nb; b++, col += cb, y += qb) {
            uint8_t q[32], h[16];
            if (t == RK_DTYPE_Q8_0) {
                float d = rk_f16_to_f32(rd16(col + 2 * r));
                gather_row(q, col + 16, r, 8);
                for (int l = 0; l < 32; l++) y[l] = d * (float)(int8_t)(q[l] ^ 0x80);
            } else if (t == RK_DTYPE_Q4_K) {
                float d = rk_f16_to_f32(rd16(col + 2 * r)),
                      dmin = rk_f16_to_f32(rd16(col + 16 + 2 * r));
                for (int j = 0; j < 8; j++) {
                    float ds = d * (float)col[32 + 8 * j + r],
                          dm = dmin * (float)col[96 + 8 * j + r];
                    gather_row(q, col + Q4K_Q(j), r, 4);
                    float *yj = y + 32 * j;
                    for (int l = 0; l < 16; l++) {
                        yj[l] = ds * (float)(q[l] & 15) - dm;
                        yj[l + 16] = ds * (float)(q[l] >> 4) - dm;
                    }
                }
            } else if (t == RK_DTYPE_MXFP4) {
                float d = rk_cpu_e8m0_half(col[r]);
                gather_row(q, col + MXFP4_Q, r, 4);
                for (int l = 0; l < 16; l++) {
                    y[l] = d * (float)rk_mxfp4_values[q[l] & 15];
                    y[l + 16] = d * (float)rk_mxfp4_values[q[l] >> 4];
                }
            } else if (t == RK_DTYPE_Q3_K) {
                float d = rk_f16_to_f32(rd16(col + Q3K_D + 2 * r));
                for (int p = 0; p < 8; p++) {
                    gather_row(q, col + Q3K_LO(p), r, 2);
                    gather_row(h, col + Q3K_HI(p), r, 1);
                    for (int s = 0; s < 2; s++) {
                        float dl = d * (float)(int8_t)col[Q3K_SC + 8 * (2 * p + s) + r];
                        float *yg = y + 32 * p + 16 * s;
                        /* element 4t + e of the group: low bits at 2t of q[4s + e] */
                        for (int l = 0; l < 16; l++) {
                            int tt = l / 4, e = l % 4;
                            int v = (q[4 * s + e] >> 2 * tt & 3) | (h[e] >> (4 * s + tt) & 1) << 2;
                            yg[l] = dl * (float)(v - 4);
                        }
                    }
                }
            } else {
                float d = rk_f16_to_f32(rd16(col + Q6K_D + 2 * r));
                for (int j = 0; j < 8; j++) {
                    gather_row(q, col + Q6K_LO(j), r, 4);
                    gather_row(h, col + Q6K_HI(j), r, 2);
                    float s0 = d * (float)(int8_t)col[Q6K_SC + 16 * j + r];
                    float s1 = d * (float)(int8_t)col[Q6K_SC + 16 * j + 8 + r];
                    float *yj = y + 32 * j;
                    /* element 4p + e of each half: its high bits at 2p of h[4u + e] */
                    for (int l = 0; l < 16; l++) {
                        int sh = 2 * (l / 4);
                        int a = (q[l] & 15) | (h[l % 4] >> sh & 3) << 4;
                        int c = (q[l] >> 4) | (h[4 + l % 4] >> sh & 3) << 4;
                        yj[l] = s0 * (float)(a - 32);
                        yj[l + 16] = s1 * (float)(c - 32);
                    }
                }
            }
        }
    }
}

/* ---------------------------------------------------------------- integer kernels */

#ifdef RK_CPU_VNNI_KERNELS
#include <immintrin.h>

#define DP(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)

/* The four activations x[0..3] in every lane. */
RK_CPU_VNNI_TARGET static inline __m256i bcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

RK_CPU_VNNI_TARGET static inline __m256 f16x8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* The group at col against nr rows of x at once (nr = 1..4, a constant at
 * every call: the kernels are always inlined, so the row loops unroll and
 * their accumulators stay in registers). Each weight vector is loaded and
 * unpacked once and meets every row; a row's arithmetic -- its integer dot
 * products, then its float accumulations in block order -- is the same for
 * every nr, so a row of x gets the same bits alone or in any batch. */
#define QPACK_INLINE static inline __attribute__((always_inline))
#define XR_MAX       4

RK_CPU_VNNI_TARGET QPACK_INLINE void rows_q8_0(const uint8_t *col, const rk_q8_block *const *x,
                                               int nr, int nb, __m256 *out) {
    __m256 acc[XR_MAX];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, col += 272) {
        const uint8_t *q = col + 16;
        __m256i s0[XR_MAX], s1[XR_MAX];
        for (int r = 0; r < nr; r++) s0[r] = s1[r] = _mm256_setzero_si256();
        for (int c = 0; c < 8; c += 2) {
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(q + 32 * c + 32));
            for (int r = 0; r < nr; r++) {
                s0[r] = DP(s0[r], w0, bcast4(x[r][b].q + 4 * c));
                s1[r] = DP(s1[r], w1, bcast4(x[r][b].q + 4 * c + 4));
            }
        }
        __m256 d = f16x8(col);
        for (int r = 0; r < nr; r++) {
            __m256i s = _mm256_sub_epi32(_mm256_add_epi32(s0[r], s1[r]),
                                         _mm256_set1_epi32(128 * x[r][b].sum));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                     _mm256_mul_ps(d, _mm256_set1_ps(x[r][b].d)), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = acc[r];
}

RK_CPU_VNNI_TARGET QPACK_INLINE void rows_q4_k(const uint8_t *col, const rk_q8_block *const *x,
                                               int nr, int nb, __m256 *out) {
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 acc[XR_MAX];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, col += 1184) {
        __m256 sacc[XR_MAX], macc[XR_MAX];
        for (int r = 0; r < nr; r++) sacc[r] = macc[r] = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) {
            const uint8_t *q = col + Q4K_Q(j);
            __m256i s0[XR_MAX], s1[XR_MAX];
            for (int r = 0; r < nr; r++) s0[r] = s1[r] = _mm256_setzero_si256();
            for (int t = 0; t < 4; t++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * t));
                __m256i lo = _mm256_and_si256(v, m4),
                        hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                for (int r = 0; r < nr; r++) {
                    const rk_q8_block *xj = &x[r][8 * b + j];
                    s0[r] = DP(s0[r], lo, bcast4(xj->q + 4 * t));
                    s1[r] = DP(s1[r], hi, bcast4(xj->q + 16 + 4 * t));
                }
            }
            __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(col + 32 + 8 * j)));
            __m256 mn = _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(col + 96 + 8 * j))));
            for (int r = 0; r < nr; r++) {
                const rk_q8_block *xj = &x[r][8 * b + j];
                __m256i s = _mm256_mullo_epi32(_mm256_add_epi32(s0[r], s1[r]), sc);
                sacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(xj->d), sacc[r]);
                macc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xj->d * (float)xj->sum), macc[r]);
            }
        }
        __m256 d = f16x8(col), dmin = f16x8(col + 16);
        for (int r = 0; r < nr; r++) {
            acc[r] = _mm256_fmadd_ps(sacc[r], d, acc[r]);
            acc[r] = _mm256_fnmadd_ps(macc[r], dmin, acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = acc[r];
}

/* The two high bits of chunk p (0..3) of a high-bit chunk, moved to bits 4, 5. */
RK_CPU_VNNI_TARGET static inline __m256i hi2(__m256i h, int p) {
    const __m256i m = _mm256_set1_epi8(0x30);
    switch (p) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(h, 4), m);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(h, 2), m);
    case 2: return _mm256_and_si256(h, m);
    default: return _mm256_and_si256(_mm256_srli_epi16(h, 2), m);
    }
}

/* xs16[r]: 32 times the sum of each 16 activations of row r. */
RK_CPU_VNNI_TARGET QPACK_INLINE void rows_q6_k(const uint8_t *col, const rk_q8_block *const *x,
                                               const int32_t *const *xs16, int nr, int nb,
                                               __m256 *out) {
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 acc[XR_MAX];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, col += 1680) {
        __m256 sacc[XR_MAX];
        for (int r = 0; r < nr; r++) sacc[r] = _mm256_setzero_ps();
        for (int j = 0; j < 8; j++) {
            const uint8_t *ql = col + Q6K_LO(j), *qh = col + Q6K_HI(j);
            __m256i h0 = _mm256_loadu_si256((const __m256i *)qh);
            __m256i h1 = _mm256_loadu_si256((const __m256i *)(qh + 32));
            __m256i sa[XR_MAX], sb[XR_MAX];
            for (int r = 0; r < nr; r++) sa[r] = sb[r] = _mm256_setzero_si256();
            for (int t = 0; t < 4; t++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(ql + 32 * t));
                __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m4), hi2(h0, t));
                __m256i hi =
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), hi2(h1, t));
                for (int r = 0; r < nr; r++) {
                    const rk_q8_block *xj = &x[r][8 * b + j];
                    sa[r] = DP(sa[r], lo, bcast4(xj->q + 4 * t));
                    sb[r] = DP(sb[r], hi, bcast4(xj->q + 16 + 4 * t));
                }
            }
            const uint8_t *sc = col + Q6K_SC + 16 * j;
            __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc));
            __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8)));
            for (int r = 0; r < nr; r++) {
                const int32_t *s16 = xs16[r] + 16 * b + 2 * j;
                __m256i a = _mm256_sub_epi32(sa[r], _mm256_set1_epi32(s16[0]));
                __m256i c = _mm256_sub_epi32(sb[r], _mm256_set1_epi32(s16[1]));
                __m256i s =
                    _mm256_add_epi32(_mm256_mullo_epi32(a, sc0), _mm256_mullo_epi32(c, sc1));
                sacc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(x[r][8 * b + j].d),
                                          sacc[r]);
            }
        }
        __m256 d = f16x8(col + Q6K_D);
        for (int r = 0; r < nr; r++) acc[r] = _mm256_fmadd_ps(sacc[r], d, acc[r]);
    }
    for (int r = 0; r < nr; r++) out[r] = acc[r];
}

/* The low two bits of chunk t (0..3) of a Q3_K low-bit chunk, and bit 2 of
 * chunk 4s + t of a high-bit chunk in place. */
RK_CPU_VNNI_TARGET static inline __m256i q3_lo(__m256i l, int t) {
    const __m256i m = _mm256_set1_epi8(3);
    switch (t) {
    case 0: return _mm256_and_si256(l, m);
    case 1: return _mm256_and_si256(_mm256_srli_epi16(l, 2), m);
    case 2: return _mm256_and_si256(_mm256_srli_epi16(l, 4), m);
    default: return _mm256_and_si256(_mm256_srli_epi16(l, 6), m);
    }
}
RK_CPU_VNNI_TARGET static inline __m256i q3_hi(__m256i h, int bit) {
    const __m256i m = _mm256_set1_epi8(4);
    switch (bit) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(h, 2), m);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(h, 1), m);
    case 2: return _mm256_and_si256(h, m);
    default: return _mm256_and_si256(_mm256_srli_epi16(h, bit - 2), m);
    }
}

/* Q3_K against Q8_K activations: per 16-group the eight rows' integer sums,
 * less 4 times the activations' 16-sum, times the group's scale, into one
 * int32 per super-block and row; then d x.d once, as quant_q8k.c does. */
RK_CPU_VNNI_TARGET QPACK_INLINE void rows_q3_k(const uint8_t *col, const rk_q8k_block *const *x,
                                               int nr, int nb, __m256 *out) {
    __m256 acc[XR_MAX];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, col += 912) {
        __m256i isum[XR_MAX];
        for (int r = 0; r < nr; r++) isum[r] = _mm256_setzero_si256();
        for (int p = 0; p < 8; p++) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(col + Q3K_HI(p)));
            for (int s = 0; s < 2; s++) {
                int g = 2 * p + s;
                __m256i l = _mm256_loadu_si256((const __m256i *)(col + Q3K_LO(p) + 32 * s));
                __m256i sg[XR_MAX];
                for (int r = 0; r < nr; r++) sg[r] = _mm256_setzero_si256();
                for (int t = 0; t < 4; t++) {
                    __m256i v = _mm256_or_si256(q3_lo(l, t), q3_hi(h, 4 * s + t));
                    for (int r = 0; r < nr; r++)
                        sg[r] = DP(sg[r], v, bcast4(x[r][b].q + 16 * g + 4 * t));
                }
                __m256i sc =
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(col + Q3K_SC + 8 * g)));
                for (int r = 0; r < nr; r++) {
                    __m256i c = _mm256_sub_epi32(sg[r], _mm256_set1_epi32(4 * x[r][b].bsums[g]));
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(c, sc));
                }
            }
        }
        __m256 d = f16x8(col + Q3K_D);
        for (int r = 0; r < nr; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]),
                                     _mm256_mul_ps(d, _mm256_set1_ps(x[r][b].d)), acc[r]);
    }
    for (int r = 0; r < nr; r++) out[r] = acc[r];
}

/* 2^(e - 128) for the eight E8M0 bytes at p, as rk_cpu_e8m0_half: the
 * product of two powers of two that are normal floats, 2^(e/2 - 64) and
 * 2^(e - e/2 - 64), is exact, subnormal results included. */
RK_CPU_VNNI_TARGET static inline __m256 e8m0_half8(const uint8_t *p) {
    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i a = _mm256_srli_epi32(e, 1), b = _mm256_sub_epi32(e, a), bias = _mm256_set1_epi32(63);
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(a, bias), 23)),
                         _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, bias), 23)));
}

RK_CPU_VNNI_TARGET QPACK_INLINE void rows_mxfp4(const uint8_t *col, const rk_q8_block *const *x,
                                                int nr, int nb, __m256 *out) {
    static const int8_t lut_plus12[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                          12, 11, 10, 9,  8,  6,  4,  0};
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lut_plus12));
    __m256 acc[XR_MAX];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, col += 136) {
        const uint8_t *q = col + MXFP4_Q;
        __m256i s0[XR_MAX], s1[XR_MAX];
        for (int r = 0; r < nr; r++) s0[r] = s1[r] = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * t));
            __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m4));
            __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            for (int r = 0; r < nr; r++) {
                s0[r] = DP(s0[r], lo, bcast4(x[r][b].q + 4 * t));
                s1[r] = DP(s1[r], hi, bcast4(x[r][b].q + 16 + 4 * t));
            }
        }
        __m256 d = e8m0_half8(col);
        for (int r = 0; r < nr; r++) {
            __m256i s = _mm256_sub_epi32(_mm256_add_epi32(s0[r], s1[r]),
                                         _mm256_set1_epi32(12 * x[r][b].sum));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                     _mm256_mul_ps(d, _mm256_set1_ps(x[r][b].d)), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = acc[r];
}

/* y(nr rows from i0, columns 8 g ..) = rows i0 .. i0 + nr - 1 of x . the
 * group at col (left of its 8 rows exist). */
RK_CPU_VNNI_TARGET QPACK_INLINE void group_rows(float *y, const uint8_t *col, rk_dtype t,
                                                const rk_q8_block *xq, const rk_q8k_block *xk,
                                                const int32_t *xs16, int i0, int nr, int k, int m,
                                                int g, int left) {
    int nb = k / (int)rk_dtype_block(t), nx = k / 32;
    const rk_q8_block *x[XR_MAX];
    const rk_q8k_block *x8k[XR_MAX];
    const int32_t *s16[XR_MAX];
    for (int r = 0; r < nr; r++) {
        x[r] = xq ? xq + (size_t)(i0 + r) * nx : NULL;
        x8k[r] = xk ? xk + (size_t)(i0 + r) * (nx / 8) : NULL;     /* Q3_K only */
        s16[r] = xs16 ? xs16 + (size_t)(i0 + r) * (k / 16) : NULL; /* Q6_K only */
    }
    __m256 v[XR_MAX];
    switch (t) {
    case RK_DTYPE_Q3_K: rows_q3_k(col, x8k, nr, nb, v); break;
    case RK_DTYPE_Q8_0: rows_q8_0(col, x, nr, nb, v); break;
    case RK_DTYPE_Q4_K: rows_q4_k(col, x, nr, nb, v); break;
    case RK_DTYPE_MXFP4: rows_mxfp4(col, x, nr, nb, v); break;
    default: rows_q6_k(col, x, s16, nr, nb, v); break;
    }
    for (int r = 0; r < nr; r++) {
        float *yi = y + (size_t)(i0 + r) * m + QR * g;
        if (left == QR)
            _mm256_storeu_ps(yi, v[r]);
        else
            _mm256_mask_storeu_ps(yi, (__mmask8)((1u << left) - 1), v[r]);
    }
}

RK_CPU_VNNI_TARGET void rk_cpu_qpack_matvec(float *y, const void *packed, rk_dtype t,
                                            const rk_q8_block *xq, const rk_q8k_block *xk,
                                            const int32_t *xs16, int n, int k, int m, int g0,
                                            int g1) {
    size_t gb = group_bytes(t, k);
    for (int g = g0; g < g1; g++) {
        const uint8_t *col = (const uint8_t *)packed + (size_t)g * gb;
        int left = m - QR * g < QR ? m - QR * g : QR, i = 0;
        for (; i + XR_MAX <= n; i += XR_MAX)
            group_rows(y, col, t, xq, xk, xs16, i, XR_MAX, k, m, g, left);
        switch (n - i) {
        case 3: group_rows(y, col, t, xq, xk, xs16, i, 3, k, m, g, left); break;
        case 2: group_rows(y, col, t, xq, xk, xs16, i, 2, k, m, g, left); break;
        case 1: group_rows(y, col, t, xq, xk, xs16, i, 1, k, m, g, left); break;
        }
    }
}
#endif
