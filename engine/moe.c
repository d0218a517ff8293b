/* engine/moe.c — mixture-of-experts routing and expert FFN (see moe.h).
 *
 * Routing follows the reference engine's graph (build_moe_ffn): the gating
 * function over all experts, the top n_used by value, the chosen
 * probabilities as weights, optionally renormalised. The reference sorts the
 * probabilities with an unstable sort, so its order among exactly equal
 * values is unspecified (an insertion sort, hence stable, up to 16 experts);
 * ragkv always keeps the lower expert id first. */
#include "engine/moe.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The smallest normal f16: the floor of the weight sum under norm_topk. */
#define MOE_MIN_WEIGHT_SUM 6.103515625e-5f

static rk_status check_params(const rk_moe_route_params *p) {
    if (!p || p->n_expert < 1 || p->n_used < 1 || p->n_used > p->n_expert ||
        (p->gating != RK_MOE_SOFTMAX && p->gating != RK_MOE_SIGMOID &&
         p->gating != RK_MOE_SOFTMAX_TOPK))
        return rk_errorf(RK_ERR_INVALID, "moe: bad routing parameters (%d of %d experts)",
                         p ? p->n_used : 0, p ? p->n_expert : 0);
    return RK_OK;
}

/* probs(n) = the gating function of logits(n). */
static void gate_probs(const float *logits, int n, rk_moe_gating g, float *probs) {
    if (g == RK_MOE_SIGMOID) {
        for (int i = 0; i < n; i++) probs[i] = 1.0f / (1.0f + expf(-logits[i]));
        return;
    }
    if (g == RK_MOE_SOFTMAX_TOPK) { /* chosen on the logits, softmax after */
        memcpy(probs, logits, (size_t)n * sizeof *probs);
        return;
    }
    float mx = -INFINITY;
    for (int i = 0; i < n; i++) mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    for (int i = 0; i < n; i++) {
        probs[i] = expf(logits[i] - mx);
        sum += probs[i];
    }
    float inv = (float)(1.0 / sum);
    for (int i = 0; i < n; i++) probs[i] *= inv;
}

/* Route; see moe.h. */
rk_status rk_moe_route(const float *logits, int n_tokens, const rk_moe_route_params *p,
                       int32_t *out_ids, float *out_w) {
    rk_status st = check_params(p);
    if (st) return st;
    if (n_tokens < 0) return rk_errorf(RK_ERR_INVALID, "moe: %d tokens", n_tokens);
    int ne = p->n_expert, k = p->n_used;
    float *probs = malloc((size_t)ne * sizeof *probs);
    if (!probs) return rk_errorf(RK_ERR_NOMEM, "moe: out of memory routing %d experts", ne);
    for (int t = 0; t < n_tokens; t++) {
        int32_t *ids = out_ids + (size_t)t * k;
        float *w = out_w + (size_t)t * k;
        gate_probs(logits + (size_t)t * ne, ne, p->gating, probs);
        /* Insertion into the k best so far, highest first: an expert goes
         * before the first kept one of strictly lower value, so among equal
         * values the lower id stays ahead. */
        int cnt = 0;
        for (int e = 0; e < ne; e++) {
            float v = probs[e];
            if (cnt == k && !(v > w[k - 1])) continue;
            int pos = 0;
            while (pos < cnt && !(w[pos] < v)) pos++;
            int last = cnt < k ? cnt : k - 1;
            for (int j = last; j > pos; j--) {
                ids[j] = ids[j - 1];
                w[j] = w[j - 1];
            }
            ids[pos] = e;
            w[pos] = v;
            if (cnt < k) cnt++;
        }
        if (p->gating == RK_MOE_SOFTMAX_TOPK) gate_probs(w, k, RK_MOE_SOFTMAX, w);
        if (p->norm_topk) {
            float sum = 0;
            for (int j = 0; j < k; j++) sum += w[j];
            if (!(sum >= MOE_MIN_WEIGHT_SUM)) sum = MOE_MIN_WEIGHT_SUM;
            for (int j = 0; j < k; j++) w[j] /= sum;
        }
        if (p->w_scale != 0.0f && p->w_scale != 1.0f)
            for (int j = 0; j < k; j++) w[j] *= p->w_scale;
    }
    free(probs);
    return RK_OK;
}

/* Group by expert (a counting sort); see moe.h. */
rk_status rk_moe_group(const int32_t *ids, int n_pairs, int n_expert, int32_t *out_offs,
                       int32_t *out_order) {
    for (int i = 0; i < n_pairs; i++)
        if (ids[i] < 0 || ids[i] >= n_expert)
            return rk_errorf(RK_ERR_INVALID, "moe: expert id %d out of range [0, %d)", ids[i],
                             n_expert);
    memset(out_offs, 0, (size_t)(n_expert + 1) * sizeof *out_offs);
    for (int i = 0; i < n_pairs; i++) out_offs[ids[i] + 1]++;
    for (int e = 0; e < n_expert; e++) out_offs[e + 1] += out_offs[e];
    /* out_offs[e] is the next free place of expert e while filling; shift back after. */
    for (int i = 0; i < n_pairs; i++) out_order[out_offs[ids[i]]++] = i;
    for (int e = n_expert; e > 0; e--) out_offs[e] = out_offs[e - 1];
    out_offs[0] = 0;
    return RK_OK;
}

void rk_moe_scratch_free(rk_moe_scratch *s) {
    if (!s) return;
    free(s->logits);
    free(s->ids);
    free(s->w);
    free(s->offs);
    free(s->order);
    free(s->xg);
    free(s->yg);
    free(s->hg);
    free(s->ug);
    free(s->acc);
    free(s->gu);
    memset(s, 0, sizeof *s);
}

static rk_status scratch_reserve(rk_moe_scratch *s, int n, const rk_moe_layer *L) {
    int ne = L->route.n_expert, k = L->route.n_used;
    if (n <= s->cap && L->dim <= s->cap_dim && L->ffn_exp <= s->cap_ffn && ne <= s->cap_expert &&
        k <= s->cap_used)
        return RK_OK;
    rk_moe_scratch t = {0};
    t.cap = n > s->cap ? n : s->cap;
    t.cap_dim = L->dim > s->cap_dim ? L->dim : s->cap_dim;
    t.cap_ffn = L->ffn_exp > s->cap_ffn ? L->ffn_exp : s->cap_ffn;
    t.cap_expert = ne > s->cap_expert ? ne : s->cap_expert;
    t.cap_used = k > s->cap_used ? k : s->cap_used;
    size_t c = (size_t)t.cap;
    t.logits = malloc(c * t.cap_expert * sizeof(float));
    t.ids = malloc(c * t.cap_used * sizeof(int32_t));
    t.w = malloc(c * t.cap_used * sizeof(float));
    t.offs = malloc((size_t)(t.cap_expert + 1) * sizeof(int32_t));
    t.order = malloc(c * t.cap_used * sizeof(int32_t));
    t.xg = malloc(c * t.cap_dim * sizeof(float));
    t.yg = malloc(c * t.cap_dim * sizeof(float));
    t.hg = malloc(c * t.cap_ffn * sizeof(float));
    t.ug = malloc(c * t.cap_ffn * sizeof(float));
    t.acc = malloc(c * t.cap_dim * sizeof(float));
    t.gu = malloc(c * 2 * t.cap_ffn * sizeof(float));
    if (!t.logits || !t.ids || !t.w || !t.offs || !t.order || !t.xg || !t.yg || !t.hg || !t.ug ||
        !t.acc || !t.gu) {
        rk_moe_scratch_free(&t);
        return rk_errorf(RK_ERR_NOMEM, "moe: out of memory for %d tokens", n);
    }
    rk_moe_scratch_free(s);
    *s = t;
    return RK_OK;
}

/* y(n, rows) = x(n, cols) · mat^T. */
static rk_status mat_mul(rk_backend *be, float *y, const float *x, const rk_moe_mat *mat, int n,
                         int cols, int rows) {
    if (mat->packed) return be->ops->matmul_packed(be, y, x, mat->packed, mat->type, n, cols, rows);
    return be->ops->matmul(be, y, x, mat->w, mat->type, n, cols, rows);
}

/* Rows of gathered tokens up to which a fused [gate; up] matrix is
 * multiplied whole and its output split by copying; above, each half is
 * multiplied on its own (as the dense FFN does). */
#define MOE_FUSED_WHOLE_MAX_N 16

/* hg(c, ffn), ug(c, ffn) = xg(c, dim) times expert e's gate and up. */
static rk_status gate_up(rk_backend *be, const rk_moe_layer *L, int e, int c, rk_moe_scratch *s) {
    int dim = L->dim, ffn = L->ffn_exp;
    rk_status st;
    if (!L->gate_up) {
        if ((st = mat_mul(be, s->hg, s->xg, &L->gate[e], c, dim, ffn))) return st;
        return mat_mul(be, s->ug, s->xg, &L->up[e], c, dim, ffn);
    }
    const rk_moe_mat *gu = &L->gate_up[e];
    if (c > MOE_FUSED_WHOLE_MAX_N && L->up_offset != SIZE_MAX) {
        const rk_moe_mat up = {NULL, (const char *)gu->packed + L->up_offset, gu->type};
        if ((st = mat_mul(be, s->hg, s->xg, gu, c, dim, ffn))) return st;
        return mat_mul(be, s->ug, s->xg, &up, c, dim, ffn);
    }
    if ((st = mat_mul(be, s->gu, s->xg, gu, c, dim, 2 * ffn))) return st;
    for (int i = 0; i < c; i++) {
        memcpy(s->hg + (size_t)i * ffn, s->gu + (size_t)i * 2 * ffn, (size_t)ffn * sizeof(float));
        memcpy(s->ug + (size_t)i * ffn, s->gu + ((size_t)i * 2 + 1) * ffn,
               (size_t)ffn * sizeof(float));
    }
    return RK_OK;
}

/* rows(c, width) += the bias of expert e (bias + e * width) on every row. */
static void add_row_bias(float *rows, const float *bias, int e, int c, int width) {
    if (!bias) return;
    const float *b = bias + (size_t)e * width;
    for (int i = 0; i < c; i++)
        for (int d = 0; d < width; d++) rows[(size_t)i * width + d] += b[d];
}

/* h(n) = gpt-oss's clamped SwiGLU of gate h and up u (arch.h), as the
 * reference computes it: g / (1 + e^(-alpha g)) * (u + 1). */
static void swiglu_oai(float *h, const float *u, size_t n) {
    const float alpha = 1.702f, limit = 7.0f;
    for (size_t i = 0; i < n; i++) {
        float g = h[i] < limit ? h[i] : limit;
        float v = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
        h[i] = g / (1.0f + expf(alpha * -g)) * (v + 1.0f);
    }
}

/* The MoE FFN; see moe.h. */
rk_status rk_moe_ffn(rk_backend *be, const rk_moe_layer *L, const float *x, float *y, int n,
                     rk_moe_scratch *s) {
    rk_status st = check_params(&L->route);
    if (st || (st = scratch_reserve(s, n, L))) return st;
    const rk_backend_ops *ops = be->ops;
    int ne = L->route.n_expert, k = L->route.n_used, dim = L->dim, ffn = L->ffn_exp;
    if ((st = ops->matmul(be, s->logits, x, L->router, RK_DTYPE_F32, n, dim, ne))) return st;
    if (L->router_b) add_row_bias(s->logits, L->router_b, 0, n, ne);
    if ((st = rk_moe_route(s->logits, n, &L->route, s->ids, s->w)) ||
        (st = rk_moe_group(s->ids, n * k, ne, s->offs, s->order)))
        return st;
    float *acc = s->acc;
    memset(acc, 0, (size_t)n * dim * sizeof *acc);
    for (int e = 0; e < ne; e++) {
        int c = s->offs[e + 1] - s->offs[e];
        if (c == 0) continue; /* nobody chose it: its weights are not read */
        const int32_t *pairs = s->order + s->offs[e];
        for (int i = 0; i < c; i++)
            memcpy(s->xg + (size_t)i * dim, x + (size_t)(pairs[i] / k) * dim,
                   (size_t)dim * sizeof *x);
        if ((st = gate_up(be, L, e, c, s))) return st;
        add_row_bias(s->hg, L->gate_b, e, c, ffn);
        add_row_bias(s->ug, L->up_b, e, c, ffn);
        if (L->act == RK_FFN_SWIGLU_OAI)
            swiglu_oai(s->hg, s->ug, (size_t)c * ffn);
        else if ((st = ops->swiglu(be, s->hg, s->hg, s->ug, (size_t)c * ffn)))
            return st;
        if ((st = mat_mul(be, s->yg, s->hg, &L->down[e], c, ffn, dim))) return st;
        add_row_bias(s->yg, L->down_b, e, c, dim);
        /* Experts are added in increasing id order for every token, so a
         * token's sum has the same order alone or in any batch. */
        for (int i = 0; i < c; i++) {
            float wt = s->w[pairs[i]], *dst = acc + (size_t)(pairs[i] / k) * dim;
            const float *src = s->yg + (size_t)i * dim;
            for (int d = 0; d < dim; d++) dst[d] += wt * src[d];
        }
    }
    return ops->add(be, y, acc, (size_t)n * dim);
}
