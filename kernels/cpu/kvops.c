/* kernels/cpu/kvops.c — writes into the paged KV cache: kv_write (new tokens
 * of one layer through a slot mapping) and rope_shift_copy (re-rotate cached
 * K to a new position while copying it, V copied as is).
 *
 * Both validate every slot before touching memory, so a failed call writes
 * nothing, and both reject a mapping in which two tokens write the same slot
 * (the parallel writes would race). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

/* ---------------------------------------------------------------- kv_write */

typedef struct write_ctx {
    const rk_kv_cache *kv;
    int layer;
    const float *k, *v;
    const int32_t *slots;
    int n_tokens, tokens_per;
} write_ctx;

static void write_task(void *p, int task, int tid) {
    (void)tid;
    write_ctx *c = p;
    const rk_kv_cache *kv = c->kv;
    size_t row = (size_t)kv->n_kv_heads * kv->head_dim;
    size_t row_bytes = rk_dtype_row_bytes(kv->dtype, row);
    unsigned char *kb = kv->k[c->layer], *vb = kv->v[c->layer];
    int t0 = task * c->tokens_per;
    int t1 = t0 + c->tokens_per < c->n_tokens ? t0 + c->tokens_per : c->n_tokens;
    for (int t = t0; t < t1; t++) {
        if (c->slots[t] < 0) continue;
        size_t off = (size_t)c->slots[t] * row_bytes;
        rk_cpu_from_f32(kb + off, c->k + (size_t)t * row, kv->dtype, row);
        rk_cpu_from_f32(vb + off, c->v + (size_t)t * row, kv->dtype, row);
    }
}

/* Write K and V (n_tokens, n_kv_heads, head_dim) of one layer to their slots,
 * converted to the cache dtype. Negative slots are skipped; a slot past the
 * cache or a slot named twice makes the call fail with RK_ERR_INVALID before
 * anything is written. */
rk_status rk_cpu_kv_write(rk_backend *be, const rk_kv_cache *kv, int layer, const float *k,
                          const float *v, const int32_t *slots, int n_tokens) {
    rk_cpu *cpu = be->impl;
    rk_status st = rk_kv_check_write(kv, layer, n_tokens);
    if (st != RK_OK || n_tokens == 0) return st;
    void *tmp;
    if ((st = rk_cpu_reserve_shared(cpu, (size_t)n_tokens * sizeof(int32_t), &tmp)) != RK_OK ||
        (st = rk_kv_check_write_slots(kv, slots, n_tokens, tmp)) != RK_OK)
        return st;

    size_t row = (size_t)kv->n_kv_heads * kv->head_dim;
    int per = (int)(16384 / row);
    if (per < 1) per = 1;
    write_ctx c = {kv, layer, k, v, slots, n_tokens, per};
    rk_threadpool_run(cpu->pool, (n_tokens + per - 1) / per, write_task, &c);
    return RK_OK;
}

/* ---------------------------------------------------------------- rope_shift_copy */

#define SHIFT_TOKENS_PER_TASK 16

typedef struct shift_ctx {
    rk_cpu *cpu;
    const rk_kv_cache *kv;
    const int32_t *src, *dst, *delta;
    int n_tokens;
    const rk_rope *const *ropes; /* (n_layers) */
} shift_ctx;

static void shift_task(void *p, int task, int tid) {
    shift_ctx *c = p;
    const rk_kv_cache *kv = c->kv;
    size_t row = (size_t)kv->n_kv_heads * kv->head_dim;
    size_t row_bytes = rk_dtype_row_bytes(kv->dtype, row);
    int t0 = task * SHIFT_TOKENS_PER_TASK;
    int nt = c->n_tokens - t0 < SHIFT_TOKENS_PER_TASK ? c->n_tokens - t0 : SHIFT_TOKENS_PER_TASK;

    float *scratch = rk_cpu_scratch(c->cpu, tid);
    float *cs = scratch;                                                 // (nt, half)
    float *sn = cs + (size_t)SHIFT_TOKENS_PER_TASK * RK_ROPE_MAX_PAIRS;  // (nt, half)
    float *tmp = sn + (size_t)SHIFT_TOKENS_PER_TASK * RK_ROPE_MAX_PAIRS; // (row) f32 K row
    /* The layers grouped by their RoPE: the angles once per group. */
    for (int g = 0; g < kv->n_layers; g++) {
        const rk_rope *r = c->ropes[g];
        int seen = 0;
        for (int e = 0; e < g && !seen; e++) seen = rk_rope_same(c->ropes[e], r);
        if (seen) continue;
        int half = r->n_rot / 2;
        /* Angles from the integer delta in fp32; no mscale: a shift composes
         * rotations, the cached K already carries mscale once. */
        for (int t = 0; t < nt; t++) {
            float fd = (float)c->delta[t0 + t];
            for (int i = 0; i < half; i++) {
                float a = fd * r->freq[i];
                cs[t * half + i] = cosf(a);
                sn[t * half + i] = sinf(a);
            }
        }
        for (int l = g; l < kv->n_layers; l++) {
            if (!rk_rope_same(c->ropes[l], r)) continue;
            unsigned char *kb = kv->k[l], *vb = kv->v[l];
            for (int t = 0; t < nt; t++) {
                size_t so = (size_t)c->src[t0 + t] * row_bytes;
                size_t d_off = (size_t)c->dst[t0 + t] * row_bytes;
                float *kd;
                if (kv->dtype == RK_DTYPE_F32) {
                    kd = (float *)(kb + d_off);
                    memcpy(kd, kb + so, row_bytes);
                } else {
                    kd = tmp;
                    rk_cpu_to_f32(kd, kb + so, kv->dtype, row);
                }
                for (int h = 0; h < kv->n_kv_heads; h++)
                    rk_cpu_rotate_head(kd + (size_t)h * kv->head_dim, cs + t * half, sn + t * half,
                                       r->n_rot, r->pairing);
                if (kv->dtype != RK_DTYPE_F32) rk_cpu_from_f32(kb + d_off, kd, kv->dtype, row);
                memcpy(vb + d_off, vb + so, row_bytes);
            }
        }
    }
}

/* For every layer l and token t: K[dst_slots[t]] = R_l(delta[t]) K[src_slots[t]]
 * with angles (float)delta * ropes[l]->freq[i] (mscale is NOT applied: the
 * cached K was scaled once when it was computed, and a shift only composes
 * rotations), V copied byte for byte. Every slot must lie in the cache,
 * destinations must be distinct and no destination may be a source;
 * otherwise RK_ERR_INVALID and nothing is written. */
rk_status rk_cpu_rope_shift_copy(rk_backend *be, const rk_kv_cache *kv, const int32_t *src_slots,
                                 const int32_t *dst_slots, const int32_t *delta, int n_tokens,
                                 const rk_rope *const *ropes) {
    rk_cpu *cpu = be->impl;
    rk_status st = rk_kv_check_shift(kv, n_tokens, ropes);
    if (st != RK_OK || n_tokens == 0) return st;
    void *tmp;
    if ((st = rk_cpu_reserve_shared(cpu, 2 * (size_t)n_tokens * sizeof(int32_t), &tmp)) != RK_OK ||
        (st = rk_kv_check_shift_slots(kv, src_slots, dst_slots, n_tokens, tmp)) != RK_OK)
        return st;

    size_t row = (size_t)kv->n_kv_heads * kv->head_dim;
    st = rk_cpu_reserve_scratch(cpu, (2 * (size_t)SHIFT_TOKENS_PER_TASK * RK_ROPE_MAX_PAIRS + row) *
                                         sizeof(float));
    if (st != RK_OK) return st;
    shift_ctx c = {cpu, kv, src_slots, dst_slots, delta, n_tokens, ropes};
    rk_threadpool_run(cpu->pool, (n_tokens + SHIFT_TOKENS_PER_TASK - 1) / SHIFT_TOKENS_PER_TASK,
                      shift_task, &c);
    return RK_OK;
}
