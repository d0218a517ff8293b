/* kernels/kernels.c — backend-independent helpers of the compute layer: dtype
 * names and sizes, scalar f16/bf16 conversions, RoPE frequency tables (with
 * linear, llama3 and YaRN scaling), argmax, and backend creation by name. */
#include "kernels/kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#ifdef RAGKV_CUDA
#include "kernels/cuda/cuda.h"
#endif

/* ---------------------------------------------------------------- dtypes */

/* Elements are tested a block at a time: the inner loop only ORs comparison
 * results, which the compiler turns into vector code, and only a block with a
 * hit is searched again element by element. Elements are read through memcpy
 * because a file's alignment may be as small as 1. An all-ones exponent is NaN
 * or infinity in each format. */
#define NONFINITE_BLOCK 4096
#define DEFINE_NONFINITE_SCAN(fn, T, mask)                                                         \
    static int64_t fn(const unsigned char *p, int64_t n) {                                         \
        for (int64_t b = 0; b < n; b += NONFINITE_BLOCK) {                                         \
            int64_t end = n - b < NONFINITE_BLOCK ? n : b + NONFINITE_BLOCK;                       \
            unsigned hit = 0;                                                                      \
            for (int64_t j = b; j < end; j++) {                                                    \
                T v;                                                                               \
                memcpy(&v, p + (size_t)j * sizeof v, sizeof v);                                    \
                hit |= (v & (mask)) == (mask);                                                     \
            }                                                                                      \
            if (!hit) continue;                                                                    \
            for (int64_t j = b; j < end; j++) {                                                    \
                T v;                                                                               \
                memcpy(&v, p + (size_t)j * sizeof v, sizeof v);                                    \
                if ((v & (mask)) == (mask)) return j;                                              \
            }                                                                                      \
        }                                                                                          \
        return -1;                                                                                 \
    }
DEFINE_NONFINITE_SCAN(scan_f32, uint32_t, 0x7f800000u)
DEFINE_NONFINITE_SCAN(scan_f16, uint16_t, 0x7c00u)
DEFINE_NONFINITE_SCAN(scan_bf16, uint16_t, 0x7f80u)
#undef DEFINE_NONFINITE_SCAN

int64_t rk_dtype_first_nonfinite(rk_dtype dt, const void *p, size_t n) {
    switch (dt) {
    case RK_DTYPE_F32: return scan_f32(p, (int64_t)n);
    case RK_DTYPE_F16: return scan_f16(p, (int64_t)n);
    case RK_DTYPE_BF16: return scan_bf16(p, (int64_t)n);
    case RK_DTYPE_Q8_0: { /* only the blocks' f16 scales can be non-finite */
        const unsigned char *b = p;
        size_t bb = rk_dtype_row_bytes(RK_DTYPE_Q8_0, 32);
        for (size_t i = 0; i < n / 32; i++) {
            uint16_t d;
            memcpy(&d, b + i * bb, sizeof d);
            if ((d & 0x7c00u) == 0x7c00u) return (int64_t)(i * 32);
        }
        return -1;
    }
    default: return -1;
    }
}

size_t rk_dtype_size(rk_dtype t) {
    switch (t) {
    case RK_DTYPE_F32: return 4;
    case RK_DTYPE_F16: return 2;
    case RK_DTYPE_BF16: return 2;
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
    case RK_DTYPE_MXFP4: return 0;
    }
    return 0;
}

int rk_dtype_is_quant(rk_dtype t) { return t >= RK_DTYPE_Q8_0 && t < RK_DTYPE_COUNT; }

size_t rk_dtype_block(rk_dtype t) {
    switch (t) {
    case RK_DTYPE_F32:
    case RK_DTYPE_F16:
    case RK_DTYPE_BF16: return 1;
    case RK_DTYPE_Q8_0:
    case RK_DTYPE_Q4_0:
    case RK_DTYPE_Q4_1:
    case RK_DTYPE_Q5_0:
    case RK_DTYPE_Q5_1:
    case RK_DTYPE_IQ4_NL:
    case RK_DTYPE_MXFP4: return 32;
    case RK_DTYPE_Q4_K:
    case RK_DTYPE_Q5_K:
    case RK_DTYPE_Q6_K:
    case RK_DTYPE_Q2_K:
    case RK_DTYPE_Q3_K:
    case RK_DTYPE_IQ4_XS: return 256;
    }
    return 0;
}

size_t rk_dtype_block_bytes(rk_dtype t) {
    switch (t) {
    case RK_DTYPE_F32: return 4;
    case RK_DTYPE_F16:
    case RK_DTYPE_BF16: return 2;
    case RK_DTYPE_Q8_0: return 34;
    case RK_DTYPE_Q4_0: return 18;
    case RK_DTYPE_Q4_K: return 144;
    case RK_DTYPE_Q5_K: return 176;
    case RK_DTYPE_Q6_K: return 210;
    case RK_DTYPE_Q4_1: return 20;
    case RK_DTYPE_Q5_0: return 22;
    case RK_DTYPE_Q5_1: return 24;
    case RK_DTYPE_Q2_K: return 84;
    case RK_DTYPE_Q3_K: return 110;
    case RK_DTYPE_IQ4_NL: return 18;
    case RK_DTYPE_IQ4_XS: return 136;
    case RK_DTYPE_MXFP4: return 17;
    }
    return 0;
}

size_t rk_dtype_row_bytes(rk_dtype t, size_t n) {
    size_t b = rk_dtype_block(t);
    if (b == 0 || n % b) return 0;
    return n / b * rk_dtype_block_bytes(t);
}

const char *rk_dtype_name(rk_dtype t) {
    switch (t) {
    case RK_DTYPE_F32: return "f32";
    case RK_DTYPE_F16: return "f16";
    case RK_DTYPE_BF16: return "bf16";
    case RK_DTYPE_Q8_0: return "q8_0";
    case RK_DTYPE_Q4_0: return "q4_0";
    case RK_DTYPE_Q4_K: return "q4_k";
    case RK_DTYPE_Q5_K: return "q5_k";
    case RK_DTYPE_Q6_K: return "q6_k";
    case RK_DTYPE_Q4_1: return "q4_1";
    case RK_DTYPE_Q5_0: return "q5_0";
    case RK_DTYPE_Q5_1: return "q5_1";
    case RK_DTYPE_Q2_K: return "q2_k";
    case RK_DTYPE_Q3_K: return "q3_k";
    case RK_DTYPE_IQ4_NL: return "iq4_nl";
    case RK_DTYPE_IQ4_XS: return "iq4_xs";
    case RK_DTYPE_MXFP4: return "mxfp4";
    }
    return "unknown";
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits. Every f16 is
 * exactly representable as f32, so this direction is exact. */
float rk_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24, exact in f32 */
        float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13)); /* inf, nan */
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* Round-to-nearest-even narrowing to binary16; overflow gives inf, NaN stays a
 * quiet NaN (same result as the F16C vcvtps2ph instruction with RNE). */
uint16_t rk_f32_to_f16(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) { /* inf or nan */
        if (ax == 0x7f800000u) return sign | 0x7c00u;
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    }
    if (ax >= 0x477ff000u) return sign | 0x7c00u; /* >= 65520 rounds to inf */
    if (ax < 0x38800000u) {                       /* below 2^-14: subnormal result */
        if (ax < 0x33000000u) return sign;        /* below 2^-25 rounds to zero */
        uint32_t e = ax >> 23;
        uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* 14 .. 24 */
        uint32_t h = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = (ax - 0x38000000u) >> 13; /* rebias exponent 127 -> 15 */
    uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

float rk_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* Round-to-nearest-even truncation to the top 16 bits; NaN stays a quiet NaN. */
uint16_t rk_f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

void rk_dtype_to_f32(float *dst, const void *src, rk_dtype t, size_t n) {
    const uint16_t *h = src;
    switch (t) {
    case RK_DTYPE_F32: memcpy(dst, src, n * sizeof *dst); return;
    case RK_DTYPE_F16:
        for (size_t i = 0; i < n; i++) dst[i] = rk_f16_to_f32(h[i]);
        return;
    case RK_DTYPE_BF16:
        for (size_t i = 0; i < n; i++) dst[i] = rk_bf16_to_f32(h[i]);
        return;
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
    case RK_DTYPE_MXFP4: rk_dequantize(dst, src, t, n); return;
    }
}

/* ---------------------------------------------------------------- RoPE */

/* YaRN: the (fractional) pair index whose wavelength makes n_rot_turns full
 * turns over the original context. */
static double yarn_corr_dim(int n_rot, int orig_ctx, double turns, double theta) {
    return n_rot * log((double)orig_ctx / (turns * 2.0 * M_PI)) / (2.0 * log(theta));
}

/* Fill rope->freq from the params: freq[i] = theta^(-2i/n_rot), computed in
 * double and rounded once, then scaled:
 *  - LINEAR: freq / factor.
 *  - LLAMA3 (llama 3.1): wavelengths shorter than orig_ctx/high_freq_factor keep
 *    their frequency, longer than orig_ctx/low_freq_factor are divided by
 *    factor, and in between the two are blended with
 *    smooth = (orig_ctx / wavelen - low) / (high - low).
 *  - YARN: pairs below the beta_fast correction dim keep the extrapolated
 *    frequency, pairs above the beta_slow one take freq / factor, a linear ramp
 *    in between; mscale = 0.1 ln(factor) + 1 (1 when factor <= 1). beta_fast and
 *    beta_slow default to 32 and 1 when both are zero.
 * mscale is 1 except for YaRN. Returns RK_ERR_INVALID for a bad parameter. */
rk_status rk_rope_init(rk_rope *rope, const rk_rope_params *p) {
    if (!rope || !p) return rk_errorf(RK_ERR_INVALID, "rope_init: NULL argument");
    if (p->n_rot <= 0 || (p->n_rot & 1) || p->n_rot > 2 * RK_ROPE_MAX_PAIRS)
        return rk_errorf(RK_ERR_INVALID, "rope_init: n_rot must be even and in 2..%d, got %d",
                         2 * RK_ROPE_MAX_PAIRS, p->n_rot);
    if (!(p->theta > 0.0f) || !isfinite(p->theta))
        return rk_errorf(RK_ERR_INVALID, "rope_init: theta must be > 0, got %g", p->theta);
    if (p->pairing != RK_ROPE_NORMAL && p->pairing != RK_ROPE_NEOX)
        return rk_errorf(RK_ERR_INVALID, "rope_init: unknown pairing %d", (int)p->pairing);
    if (p->scaling != RK_ROPE_SCALING_NONE) {
        if (!(p->factor > 0.0f) || !isfinite(p->factor))
            return rk_errorf(RK_ERR_INVALID, "rope_init: scaling factor must be > 0, got %g",
                             p->factor);
    }
    if ((p->scaling == RK_ROPE_SCALING_YARN || p->scaling == RK_ROPE_SCALING_LLAMA3) &&
        p->orig_ctx <= 0)
        return rk_errorf(RK_ERR_INVALID, "rope_init: orig_ctx must be > 0 for %s scaling, got %d",
                         p->scaling == RK_ROPE_SCALING_YARN ? "yarn" : "llama3", p->orig_ctx);
    if (p->scaling == RK_ROPE_SCALING_LLAMA3 &&
        !(p->high_freq_factor > p->low_freq_factor && p->low_freq_factor > 0.0f))
        return rk_errorf(RK_ERR_INVALID,
                         "rope_init: llama3 needs 0 < low_freq_factor < high_freq_factor, "
                         "got %g and %g",
                         p->low_freq_factor, p->high_freq_factor);

    int n_pairs = p->n_rot / 2;
    memset(rope, 0, sizeof *rope);
    rope->n_rot = p->n_rot;
    rope->pairing = p->pairing;
    rope->mscale = 1.0f;

    double theta = p->theta, factor = p->factor;
    double yarn_low = 0.0, yarn_high = 0.0;
    if (p->scaling == RK_ROPE_SCALING_YARN) {
        double beta_fast = p->beta_fast, beta_slow = p->beta_slow;
        if (beta_fast == 0.0 && beta_slow == 0.0) {
            beta_fast = 32.0;
            beta_slow = 1.0;
        }
        if (!(beta_fast > 0.0) || !(beta_slow > 0.0))
            return rk_errorf(RK_ERR_INVALID, "rope_init: yarn betas must be > 0, got %g and %g",
                             beta_fast, beta_slow);
        yarn_low = floor(yarn_corr_dim(p->n_rot, p->orig_ctx, beta_fast, theta));
        yarn_high = ceil(yarn_corr_dim(p->n_rot, p->orig_ctx, beta_slow, theta));
        if (yarn_low < 0.0) yarn_low = 0.0;
        if (yarn_high > p->n_rot - 1) yarn_high = p->n_rot - 1;
        if (factor > 1.0) rope->mscale = (float)(0.1 * log(factor) + 1.0);
    }

    for (int i = 0; i < n_pairs; i++) {
        double f = pow(theta, -2.0 * i / p->n_rot);
        switch (p->scaling) {
        case RK_ROPE_SCALING_NONE: break;
        case RK_ROPE_SCALING_LINEAR: f /= factor; break;
        case RK_ROPE_SCALING_LLAMA3: {
            double wavelen = 2.0 * M_PI / f;
            double low_wavelen = p->orig_ctx / (double)p->low_freq_factor;
            double high_wavelen = p->orig_ctx / (double)p->high_freq_factor;
            if (wavelen < high_wavelen) {
                /* high frequency: unchanged */
            } else if (wavelen > low_wavelen) {
                f /= factor;
            } else {
                double smooth = (p->orig_ctx / wavelen - p->low_freq_factor) /
                                ((double)p->high_freq_factor - p->low_freq_factor);
                f = (1.0 - smooth) * f / factor + smooth * f;
            }
            break;
        }
        case RK_ROPE_SCALING_YARN: {
            double y = (i - yarn_low) / fmax(0.001, yarn_high - yarn_low);
            double ramp = 1.0 - fmin(1.0, fmax(0.0, y)); /* 1: extrapolate, 0: interpolate */
            f = (f / factor) * (1.0 - ramp) + f * ramp;
            break;
        }
        default: return rk_errorf(RK_ERR_INVALID, "rope_init: unknown scaling %d", (int)p->scaling);
        }
        rope->freq[i] = (float)f;
    }
    return RK_OK;
}

/* ---------------------------------------------------------------- helpers */

/* Return the index of the largest element of x(n), the first one on ties; NaN
 * elements are never chosen unless all are NaN (then 0). Returns -1 for n <= 0. */
int rk_argmax_f32(const float *x, int n) {
    if (n <= 0) return -1;
    int best = 0;
    float bv = x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] > bv || (bv != bv && x[i] == x[i])) {
            bv = x[i];
            best = i;
        }
    }
    return best;
}

/* ---------------------------------------------------------------- argument checks */

int64_t rk_kv_slots(const rk_kv_cache *kv) { return (int64_t)kv->n_blocks * kv->block_size; }

int rk_kv_dtype_ok(rk_dtype t, int head_dim) {
    if (t == RK_DTYPE_Q8_0) return head_dim > 0 && head_dim % 32 == 0;
    return rk_dtype_size(t) != 0;
}

static rk_status check_cache(const rk_kv_cache *kv, const char *op) {
    if (!kv || kv->n_layers <= 0 || kv->n_blocks <= 0 || kv->block_size <= 0 ||
        kv->n_kv_heads <= 0 || kv->head_dim <= 0 || !kv->k || !kv->v)
        return rk_errorf(RK_ERR_INVALID, "%s: malformed KV cache", op);
    if (!rk_kv_dtype_ok(kv->dtype, kv->head_dim))
        return rk_errorf(RK_ERR_INVALID, "%s: bad KV dtype %d", op, (int)kv->dtype);
    return RK_OK;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Sort the slots >= 0 of slots(n) into tmp (n) and report the first
 * duplicate; returns the number of sorted slots, or -1 on a duplicate. */
static int sort_unique(const int32_t *slots, int n, int32_t *tmp, int32_t *out_dup) {
    int m = 0;
    for (int i = 0; i < n; i++)
        if (slots[i] >= 0) tmp[m++] = slots[i];
    qsort(tmp, (size_t)m, sizeof *tmp, cmp_i32);
    for (int i = 1; i < m; i++) {
        if (tmp[i] == tmp[i - 1]) {
            *out_dup = tmp[i];
            return -1;
        }
    }
    return m;
}

rk_status rk_kv_check_write(const rk_kv_cache *kv, int layer, int n_tokens) {
    rk_status st = check_cache(kv, "kv_write");
    if (st != RK_OK) return st;
    if (layer < 0 || layer >= kv->n_layers)
        return rk_errorf(RK_ERR_INVALID, "kv_write: layer %d out of range [0, %d)", layer,
                         kv->n_layers);
    if (n_tokens < 0) return rk_errorf(RK_ERR_INVALID, "kv_write: n_tokens %d < 0", n_tokens);
    return RK_OK;
}

rk_status rk_kv_check_write_slots(const rk_kv_cache *kv, const int32_t *slots, int n_tokens,
                                  int32_t *tmp) {
    int64_t total = rk_kv_slots(kv);
    for (int t = 0; t < n_tokens; t++)
        if (slots[t] >= total)
            return rk_errorf(RK_ERR_INVALID, "kv_write: token %d slot %d out of range [0, %lld)", t,
                             slots[t], (long long)total);
    int32_t dup = 0; /* set by sort_unique where it fails */
    if (sort_unique(slots, n_tokens, tmp, &dup) < 0)
        return rk_errorf(RK_ERR_INVALID, "kv_write: slot %d is written twice", dup);
    return RK_OK;
}

/* The rotated dimensions of rope fit a head of head_dim. */
static rk_status check_n_rot(const rk_rope *rope, int head_dim, const char *op) {
    if (!rope) return rk_errorf(RK_ERR_INVALID, "%s: no RoPE table", op);
    if (rope->n_rot <= 0 || (rope->n_rot & 1) || rope->n_rot > head_dim ||
        rope->n_rot > 2 * RK_ROPE_MAX_PAIRS)
        return rk_errorf(RK_ERR_INVALID, "%s: n_rot %d does not fit head_dim %d", op, rope->n_rot,
                         head_dim);
    return RK_OK;
}

rk_status rk_matmul_check(rk_dtype wtype, int n, int k, int m) {
    if (n < 0 || k < 0 || m < 0)
        return rk_errorf(RK_ERR_INVALID, "matmul: negative shape n=%d k=%d m=%d", n, k, m);
    if (rk_dtype_block(wtype) == 0)
        return rk_errorf(RK_ERR_INVALID, "matmul: bad weight dtype %d", (int)wtype);
    if (k % (int)rk_dtype_block(wtype))
        return rk_errorf(RK_ERR_INVALID, "matmul: k=%d is not a multiple of the %s block of %zu", k,
                         rk_dtype_name(wtype), rk_dtype_block(wtype));
    return RK_OK;
}

rk_status rk_rope_check(int n_tokens, int n_heads, int head_dim, const rk_rope *rope) {
    if (n_tokens < 0 || n_heads <= 0 || head_dim <= 0)
        return rk_errorf(RK_ERR_INVALID, "rope: bad shape %d x %d x %d", n_tokens, n_heads,
                         head_dim);
    return check_n_rot(rope, head_dim, "rope");
}

rk_status rk_kv_check_shift(const rk_kv_cache *kv, int n_tokens, const rk_rope *const *ropes) {
    rk_status st = check_cache(kv, "rope_shift_copy");
    if (st != RK_OK) return st;
    if (n_tokens < 0)
        return rk_errorf(RK_ERR_INVALID, "rope_shift_copy: n_tokens %d < 0", n_tokens);
    if (!ropes) return rk_errorf(RK_ERR_INVALID, "rope_shift_copy: no RoPE tables");
    for (int l = 0; l < kv->n_layers; l++)
        if ((st = check_n_rot(ropes[l], kv->head_dim, "rope_shift_copy")) != RK_OK) return st;
    return RK_OK;
}

int rk_rope_same(const rk_rope *a, const rk_rope *b) {
    if (a == b) return 1;
    if (!a || !b || a->n_rot != b->n_rot || a->pairing != b->pairing || a->mscale != b->mscale ||
        a->n_rot < 0 || a->n_rot > 2 * RK_ROPE_MAX_PAIRS)
        return 0;
    return memcmp(a->freq, b->freq, (size_t)(a->n_rot / 2) * sizeof a->freq[0]) == 0;
}

rk_status rk_kv_check_shift_slots(const rk_kv_cache *kv, const int32_t *src_slots,
                                  const int32_t *dst_slots, int n_tokens, int32_t *tmp) {
    int64_t total = rk_kv_slots(kv);
    for (int t = 0; t < n_tokens; t++) {
        if (src_slots[t] < 0 || src_slots[t] >= total || dst_slots[t] < 0 || dst_slots[t] >= total)
            return rk_errorf(RK_ERR_INVALID,
                             "rope_shift_copy: token %d slots %d -> %d out of range [0, %lld)", t,
                             src_slots[t], dst_slots[t], (long long)total);
    }
    int32_t *ds = tmp, *ss = tmp + n_tokens, dup = 0; /* dup: set where sort_unique fails */
    if (sort_unique(dst_slots, n_tokens, ds, &dup) < 0)
        return rk_errorf(RK_ERR_INVALID, "rope_shift_copy: destination slot %d is written twice",
                         dup);
    memcpy(ss, src_slots, (size_t)n_tokens * sizeof *ss);
    qsort(ss, (size_t)n_tokens, sizeof *ss, cmp_i32);
    for (int i = 0, j = 0; i < n_tokens && j < n_tokens;) { /* merge walk of two sorted lists */
        if (ds[i] == ss[j])
            return rk_errorf(RK_ERR_INVALID,
                             "rope_shift_copy: slot %d is both a source and a destination", ds[i]);
        if (ds[i] < ss[j])
            i++;
        else
            j++;
    }
    return RK_OK;
}

rk_status rk_attn_check_params(const rk_attn_params *p) {
    if (!p) return rk_errorf(RK_ERR_INVALID, "attention: no params");
    if (!isfinite(p->scale))
        return rk_errorf(RK_ERR_INVALID, "attention: scale %g is not finite", (double)p->scale);
    if (!isfinite(p->softcap) || p->softcap < 0.0f)
        return rk_errorf(RK_ERR_INVALID, "attention: softcap %g must be finite and >= 0",
                         (double)p->softcap);
    if (p->window < 0) return rk_errorf(RK_ERR_INVALID, "attention: window %d < 0", p->window);
    return RK_OK;
}

rk_status rk_attn_check_shape(const int32_t *q_start, const int32_t *kv_len, int n_seqs,
                              int n_heads, int n_kv_heads, int head_dim) {
    if (n_seqs < 0) return rk_errorf(RK_ERR_INVALID, "attention: n_seqs %d < 0", n_seqs);
    if (n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0)
        return rk_errorf(RK_ERR_INVALID,
                         "attention: n_heads %d must be a positive multiple of n_kv_heads %d",
                         n_heads, n_kv_heads);
    if (head_dim <= 0) return rk_errorf(RK_ERR_INVALID, "attention: head_dim %d", head_dim);
    if (n_seqs > 0 && q_start[0] < 0)
        return rk_errorf(RK_ERR_INVALID, "attention: q_start[0] = %d < 0", q_start[0]);
    for (int s = 0; s < n_seqs; s++) {
        int n_q = q_start[s + 1] - q_start[s];
        if (n_q < 0)
            return rk_errorf(RK_ERR_INVALID, "attention: q_start decreases at sequence %d", s);
        if (kv_len[s] < n_q)
            return rk_errorf(RK_ERR_INVALID, "attention: sequence %d has kv_len %d < %d query rows",
                             s, kv_len[s], n_q);
    }
    return RK_OK;
}

static int64_t blocks_needed(const rk_kv_cache *kv, int kv_len) {
    return ((int64_t)kv_len + kv->block_size - 1) / kv->block_size;
}

/* Table entries the kv range of sequence s takes: ceil(kv_len / block_size)
 * without segments, the sum of its runs' blocks with them (runs already
 * checked to increase). */
static int64_t seq_blocks(const rk_kv_cache *kv, const rk_attn_batch *batch, int s) {
    if (!batch->seg_start) return blocks_needed(kv, batch->kv_len[s]);
    int64_t n = 0;
    int32_t begin = 0;
    for (int32_t k = batch->seg_start[s]; k < batch->seg_start[s + 1]; k++) {
        n += blocks_needed(kv, batch->seg_end[k] - begin);
        begin = batch->seg_end[k];
    }
    return n;
}

/* The runs of every sequence: see rk_attn_batch. */
static rk_status check_segments(const rk_kv_cache *kv, const rk_attn_batch *batch) {
    const int32_t *ss = batch->seg_start;
    if (!batch->seg_end || !batch->seg_delta)
        return rk_errorf(RK_ERR_INVALID, "attention: seg_start without seg_end and seg_delta");
    if (batch->n_seqs > 0 && ss[0] != 0)
        return rk_errorf(RK_ERR_INVALID, "attention: seg_start[0] = %d, not 0", ss[0]);
    int rotates = 0;
    for (int s = 0; s < batch->n_seqs; s++) {
        if (ss[s + 1] < ss[s])
            return rk_errorf(RK_ERR_INVALID, "attention: seg_start decreases at sequence %d", s);
        int32_t begin = 0;
        for (int32_t k = ss[s]; k < ss[s + 1]; k++) {
            if (batch->seg_end[k] <= begin)
                return rk_errorf(RK_ERR_INVALID,
                                 "attention: sequence %d segment %d ends at %d, not after %d", s, k,
                                 batch->seg_end[k], begin);
            begin = batch->seg_end[k];
            rotates |= batch->seg_delta[k] != 0;
        }
        if (begin != batch->kv_len[s])
            return rk_errorf(RK_ERR_INVALID,
                             "attention: sequence %d segments end at %d, kv_len is %d", s, begin,
                             batch->kv_len[s]);
    }
    const rk_rope *r = batch->rope;
    if (rotates && !r) return rk_errorf(RK_ERR_INVALID, "attention: segment deltas without a rope");
    if (r) {
        if (r->n_rot <= 0 || (r->n_rot & 1) || r->n_rot > kv->head_dim ||
            r->n_rot > 2 * RK_ROPE_MAX_PAIRS)
            return rk_errorf(RK_ERR_INVALID, "attention: rope n_rot %d does not fit head_dim %d",
                             r->n_rot, kv->head_dim);
    }
    return RK_OK;
}

rk_status rk_attn_check_batch(const rk_kv_cache *kv, int layer, const rk_attn_batch *batch,
                              int n_heads) {
    if (!kv || !batch || kv->block_size <= 0 || kv->n_blocks <= 0 || !kv->k || !kv->v ||
        !rk_kv_dtype_ok(kv->dtype, kv->head_dim))
        return rk_errorf(RK_ERR_INVALID, "attention: malformed KV cache or batch");
    if (layer < 0 || layer >= kv->n_layers)
        return rk_errorf(RK_ERR_INVALID, "attention: layer %d out of range [0, %d)", layer,
                         kv->n_layers);
    rk_status st = rk_attn_check_shape(batch->q_start, batch->kv_len, batch->n_seqs, n_heads,
                                       kv->n_kv_heads, kv->head_dim);
    if (st != RK_OK) return st;
    if (batch->seg_start && (st = check_segments(kv, batch)) != RK_OK) return st;
    for (int s = 0; s < batch->n_seqs; s++) {
        int64_t need = seq_blocks(kv, batch, s);
        if (need > batch->max_blocks)
            return rk_errorf(RK_ERR_INVALID,
                             "attention: sequence %d kv_len %d needs %lld blocks, table has %d", s,
                             batch->kv_len[s], (long long)need, batch->max_blocks);
    }
    return RK_OK;
}

rk_status rk_attn_check_block_ids(const rk_kv_cache *kv, const rk_attn_batch *batch,
                                  const int32_t *table) {
    for (int s = 0; s < batch->n_seqs; s++) {
        const int32_t *row = table + (size_t)s * batch->max_blocks;
        int64_t need = seq_blocks(kv, batch, s);
        for (int64_t b = 0; b < need; b++)
            if (row[b] < 0 || row[b] >= kv->n_blocks)
                return rk_errorf(RK_ERR_INVALID,
                                 "attention: sequence %d block %lld is %d, not in [0, %d)", s,
                                 (long long)b, row[b], kv->n_blocks);
    }
    return RK_OK;
}

/* ---------------------------------------------------------------- backends */

/* Create the backend called name ("cpu", or "cuda" when built with RAGKV_CUDA)
 * with n_threads compute threads (<= 0: one per online core). On success the
 * caller owns *out and frees it with rk_backend_free(). */
rk_status rk_backend_create(const char *name, int n_threads, rk_backend **out) {
    if (!name || !out) return rk_errorf(RK_ERR_INVALID, "backend_create: NULL argument");
    *out = NULL;
    if (strcmp(name, "cpu") == 0) return rk_cpu_backend_create(n_threads, out);
    if (strcmp(name, "cuda") == 0) {
#ifdef RAGKV_CUDA
        return rk_cuda_backend_create(n_threads, out);
#else
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "backend \"cuda\": this build has no CUDA support (configure with "
                         "-DRAGKV_CUDA=ON)");
#endif
    }
    return rk_errorf(RK_ERR_INVALID, "backend \"%s\" is unknown (expected \"cpu\" or \"cuda\")",
                     name);
}

/* Free a backend created by rk_backend_create() and everything it owns
 * (its allocations are not tracked: free them first). Accepts NULL. */
void rk_backend_free(rk_backend *be) {
    if (!be) return;
    if (be->name && strcmp(be->name, "cpu") == 0) {
        rk_cpu_backend_free(be);
        return;
    }
#ifdef RAGKV_CUDA
    rk_cuda_backend_free(be);
#endif
}

/* Per query row and head: scores over its keys, softmax in double, mass
 * added per key. Straightforward on purpose: it scores a few question rows. */
rk_status rk_attn_key_mass(const float *q, const int32_t *q_len, int n_q, const float *k, int n_k,
                           int n_heads, int n_kv_heads, int head_dim, const rk_attn_params *params,
                           double *mass) {
    rk_status st = rk_attn_check_params(params);
    if (st != RK_OK) return st;
    int group = n_heads / n_kv_heads, window = params->window;
    double scale = params->scale, cap = params->softcap;
    size_t q_row = (size_t)n_heads * head_dim, k_row = (size_t)n_kv_heads * head_dim;
    double *p = malloc((size_t)(n_k > 0 ? n_k : 1) * sizeof *p);
    if (!p) return rk_errorf(RK_ERR_NOMEM, "attention mass: out of memory");
    for (int i = 0; i < n_q; i++) {
        int len = q_len[i] < n_k ? q_len[i] : n_k;
        int lo = window > 0 && q_len[i] > window ? q_len[i] - window : 0;
        for (int h = 0; h < n_heads && len > lo; h++) {
            const float *qv = q + i * q_row + (size_t)h * head_dim;
            double mx = -INFINITY, sum = 0;
            for (int j = lo; j < len; j++) {
                const float *kv = k + j * k_row + (size_t)(h / group) * head_dim;
                double d = 0;
                for (int e = 0; e < head_dim; e++) d += (double)qv[e] * kv[e];
                p[j] = d * scale;
                if (cap > 0) p[j] = cap * tanh(p[j] / cap);
                mx = p[j] > mx ? p[j] : mx;
            }
            double sk = params->sinks ? params->sinks[h] : -INFINITY;
            if (sk > mx) mx = sk;
            sum = exp(sk - mx); /* the sink's share of the denominator (0 without) */
            for (int j = lo; j < len; j++) sum += p[j] = exp(p[j] - mx);
            for (int j = lo; j < len; j++) mass[j] += p[j] / sum;
        }
    }
    free(p);
    return RK_OK;
}
