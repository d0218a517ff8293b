/* tests/test_moe.c — mixture-of-experts routing and the expert FFN
 * (engine/moe.c) against plain reference implementations written here:
 * a full stable sort of the gate values for the top-k (ties included), and
 * a token-by-token dense SwiGLU sum for the FFN, on the CPU backend. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/moe.h"
#include "kernels/kernels.h"
#include "tests/testutil.h"

/* ---------------------------------------------------------------- reference routing */

static const double *g_sort_vals;

/* Descending by value, then ascending by expert id. */
static int cmp_desc(const void *a, const void *b) {
    int ia = *(const int *)a, ib = *(const int *)b;
    double va = g_sort_vals[ia], vb = g_sort_vals[ib];
    if (va != vb) return va > vb ? -1 : 1;
    return ia - ib;
}

/* Route one token in double: gate, full sort, first k, renormalise, scale. */
static void ref_route(const float *logits, const rk_moe_route_params *p, int *ids, double *w) {
    int ne = p->n_expert;
    double *probs = malloc((size_t)ne * sizeof *probs);
    int *order = malloc((size_t)ne * sizeof *order);
    cr_assert(probs && order);
    double mx = -INFINITY, sum = 0;
    for (int e = 0; e < ne; e++) mx = logits[e] > mx ? logits[e] : mx;
    for (int e = 0; e < ne; e++) {
        probs[e] = p->gating == RK_MOE_SIGMOID ? 1.0 / (1.0 + exp(-(double)logits[e]))
                                               : exp((double)logits[e] - mx);
        sum += probs[e];
    }
    if (p->gating == RK_MOE_SOFTMAX)
        for (int e = 0; e < ne; e++) probs[e] /= sum;
    for (int e = 0; e < ne; e++) order[e] = e;
    g_sort_vals = probs;
    qsort(order, (size_t)ne, sizeof *order, cmp_desc);
    double wsum = 0;
    for (int j = 0; j < p->n_used; j++) {
        ids[j] = order[j];
        w[j] = probs[order[j]];
        wsum += w[j];
    }
    for (int j = 0; j < p->n_used; j++) {
        if (p->norm_topk) w[j] /= wsum;
        if (p->w_scale != 0 && p->w_scale != 1) w[j] *= p->w_scale;
    }
    free(probs);
    free(order);
}

static rk_test_rng rng = {0x6d6f652d74657374ull};

/* Route n_tokens random tokens and compare with ref_route. With ties, the
 * logits take only a few distinct values, so equal gate values straddle the
 * k-th place in most tokens. */
static void check_routing(rk_moe_route_params p, int n_tokens, int ties) {
    int ne = p.n_expert, k = p.n_used;
    float *logits = malloc((size_t)n_tokens * ne * sizeof *logits);
    int32_t *ids = malloc((size_t)n_tokens * k * sizeof *ids);
    float *w = malloc((size_t)n_tokens * k * sizeof *w);
    int *rids = malloc((size_t)k * sizeof *rids);
    double *rw = malloc((size_t)k * sizeof *rw);
    cr_assert(logits && ids && w && rids && rw);
    for (int i = 0; i < n_tokens * ne; i++)
        logits[i] =
            ties ? (float)rk_test_irand(&rng, 4) * 0.5f - 1.0f : rk_test_frand(&rng, -4.0f, 4.0f);
    cr_assert_eq(rk_moe_route(logits, n_tokens, &p, ids, w), RK_OK, "%s", rk_error_message());
    for (int t = 0; t < n_tokens; t++) {
        ref_route(logits + (size_t)t * ne, &p, rids, rw);
        for (int j = 0; j < k; j++) {
            cr_assert_eq(ids[t * k + j], rids[j], "token %d place %d: expert %d, expected %d", t, j,
                         ids[t * k + j], rids[j]);
            cr_assert(fabs(w[t * k + j] - rw[j]) <= 1e-6 * fabs(rw[j]) + 1e-7,
                      "token %d place %d: weight %.9g, expected %.9g", t, j, w[t * k + j], rw[j]);
        }
    }
    free(logits);
    free(ids);
    free(w);
    free(rids);
    free(rw);
}

Test(moe, softmax_top8_of_128_renormalised_matches_reference) {
    check_routing((rk_moe_route_params){128, 8, RK_MOE_SOFTMAX, 1, 0.0f}, 200, 0);
}

Test(moe, softmax_top2_of_8_matches_reference_with_ties) {
    check_routing((rk_moe_route_params){8, 2, RK_MOE_SOFTMAX, 1, 0.0f}, 500, 1);
}

Test(moe, ties_among_128_experts_keep_the_lower_id_first) {
    check_routing((rk_moe_route_params){128, 8, RK_MOE_SOFTMAX, 1, 0.0f}, 200, 1);
}

Test(moe, softmax_without_renormalisation_keeps_the_probabilities) {
    check_routing((rk_moe_route_params){64, 6, RK_MOE_SOFTMAX, 0, 0.0f}, 100, 0);
    check_routing((rk_moe_route_params){64, 6, RK_MOE_SOFTMAX, 0, 0.0f}, 100, 1);
}

Test(moe, sigmoid_gating_with_scale_matches_reference) {
    check_routing((rk_moe_route_params){32, 4, RK_MOE_SIGMOID, 1, 2.5f}, 100, 0);
    check_routing((rk_moe_route_params){32, 4, RK_MOE_SIGMOID, 0, 2.5f}, 100, 1);
}

Test(moe, all_experts_used_is_a_full_sort) {
    check_routing((rk_moe_route_params){16, 16, RK_MOE_SOFTMAX, 1, 0.0f}, 50, 1);
}

Test(moe, exact_tie_at_the_kth_place_picks_the_lower_id) {
    /* experts 5 and 2 tie for second place, 7 is first */
    float logits[8] = {0, 0, 1, 0, 0, 1, 0, 3};
    int32_t ids[2];
    float w[2];
    rk_moe_route_params p = {8, 2, RK_MOE_SOFTMAX, 1, 0.0f};
    cr_assert_eq(rk_moe_route(logits, 1, &p, ids, w), RK_OK);
    cr_assert_eq(ids[0], 7);
    cr_assert_eq(ids[1], 2);
    cr_assert_float_eq(w[0] + w[1], 1.0f, 1e-6);
    cr_assert_float_eq(w[0] / w[1], expf(2.0f), 1e-4);
}

Test(moe, bad_parameters_are_refused) {
    float logits[4] = {0};
    int32_t ids[4] = {-7, -7, -7, -7};
    float w[4];
    rk_moe_route_params p = {4, 5, RK_MOE_SOFTMAX, 1, 0.0f};
    cr_assert_eq(rk_moe_route(logits, 1, &p, ids, w), RK_ERR_INVALID);
    p.n_used = 0;
    cr_assert_eq(rk_moe_route(logits, 1, &p, ids, w), RK_ERR_INVALID);
    p = (rk_moe_route_params){0, 0, RK_MOE_SOFTMAX, 1, 0.0f};
    cr_assert_eq(rk_moe_route(logits, 1, &p, ids, w), RK_ERR_INVALID);
    cr_assert_eq(ids[0], -7, "nothing written on a refused call");
}

Test(moe, grouping_is_by_expert_then_pair_order) {
    const int32_t ids[] = {3, 1, 3, 0, 1, 3};
    int32_t offs[5], order[6];
    cr_assert_eq(rk_moe_group(ids, 6, 4, offs, order), RK_OK);
    const int32_t want_offs[] = {0, 1, 3, 3, 6}, want_order[] = {3, 1, 4, 0, 2, 5};
    for (int i = 0; i < 5; i++) cr_assert_eq(offs[i], want_offs[i], "offs[%d]", i);
    for (int i = 0; i < 6; i++) cr_assert_eq(order[i], want_order[i], "order[%d]", i);
    const int32_t bad[] = {0, 4};
    cr_assert_eq(rk_moe_group(bad, 2, 4, offs, order), RK_ERR_INVALID);
}

/* ---------------------------------------------------------------- the FFN */

typedef struct ffn_case {
    int n_expert, n_used, dim, ffn;
    rk_dtype type;
    float *router;                 /* (n_expert, dim) */
    float *gate_f, *up_f, *down_f; /* f32 values of the stored (rounded) weights */
    void *gate, *up, *down;        /* stacked, of type */
    rk_moe_mat *mg, *mu, *md;
    rk_moe_layer L;
} ffn_case;

/* A stacked (n_expert * rows, cols) tensor of random weights, stored as type
 * t; *out_f gets its values as f32. */
static void *stacked(int n_expert, int rows, int cols, rk_dtype t, float **out_f) {
    size_t n = (size_t)n_expert * rows * cols;
    float *f = rk_test_rand_floats(&rng, n, -1.0f / sqrtf((float)cols), 1.0f / sqrtf((float)cols));
    void *q = malloc(rk_dtype_row_bytes(t, n));
    cr_assert(f && q);
    rk_quantize(q, f, t, n);
    rk_dequantize(f, q, t, n);
    *out_f = f;
    return q;
}

static void ffn_case_init(ffn_case *c, int n_expert, int n_used, int dim, int ffn, rk_dtype t) {
    memset(c, 0, sizeof *c);
    c->n_expert = n_expert;
    c->n_used = n_used;
    c->dim = dim;
    c->ffn = ffn;
    c->type = t;
    c->router = rk_test_rand_floats(&rng, (size_t)n_expert * dim, -0.5f, 0.5f);
    c->gate = stacked(n_expert, ffn, dim, t, &c->gate_f);
    c->up = stacked(n_expert, ffn, dim, t, &c->up_f);
    c->down = stacked(n_expert, dim, ffn, t, &c->down_f);
    c->mg = calloc((size_t)n_expert, sizeof *c->mg);
    c->mu = calloc((size_t)n_expert, sizeof *c->mu);
    c->md = calloc((size_t)n_expert, sizeof *c->md);
    cr_assert(c->router && c->mg && c->mu && c->md);
    size_t gb = rk_dtype_row_bytes(t, (size_t)dim) * ffn,
           db = rk_dtype_row_bytes(t, (size_t)ffn) * dim;
    for (int e = 0; e < n_expert; e++) {
        c->mg[e] = (rk_moe_mat){(const char *)c->gate + e * gb, NULL, t};
        c->mu[e] = (rk_moe_mat){(const char *)c->up + e * gb, NULL, t};
        c->md[e] = (rk_moe_mat){(const char *)c->down + e * db, NULL, t};
    }
    c->L = (rk_moe_layer){{n_expert, n_used, RK_MOE_SOFTMAX, 1, 0.0f},
                          dim,
                          ffn,
                          c->router,
                          c->mg,
                          c->mu,
                          c->md,
                          NULL,
                          SIZE_MAX,
                          RK_FFN_SILU,
                          NULL,
                          NULL,
                          NULL,
                          NULL};
}

static void ffn_case_free(ffn_case *c) {
    void *p[] = {c->router, c->gate_f, c->up_f, c->down_f, c->gate,
                 c->up,     c->down,   c->mg,   c->mu,     c->md};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
}

/* y(dim) of one token in double: route with ref_route, then the weighted
 * sum of the chosen experts. */
static void ref_ffn(const ffn_case *c, const float *x, double *y) {
    int ne = c->n_expert, k = c->n_used, dim = c->dim, ffn = c->ffn;
    float *logits = malloc((size_t)ne * sizeof *logits);
    int *ids = malloc((size_t)k * sizeof *ids);
    double *w = malloc((size_t)k * sizeof *w), *h = malloc((size_t)ffn * sizeof *h);
    cr_assert(logits && ids && w && h);
    for (int e = 0; e < ne; e++) {
        double s = 0;
        for (int d = 0; d < dim; d++) s += (double)c->router[(size_t)e * dim + d] * x[d];
        logits[e] = (float)s;
    }
    ref_route(logits, &c->L.route, ids, w);
    for (int d = 0; d < dim; d++) y[d] = 0;
    for (int j = 0; j < k; j++) {
        const float *g = c->gate_f + (size_t)ids[j] * ffn * dim;
        const float *u = c->up_f + (size_t)ids[j] * ffn * dim;
        const float *dn = c->down_f + (size_t)ids[j] * dim * ffn;
        for (int i = 0; i < ffn; i++) {
            double a = 0, b = 0;
            for (int d = 0; d < dim; d++) {
                a += (double)g[(size_t)i * dim + d] * x[d];
                b += (double)u[(size_t)i * dim + d] * x[d];
            }
            h[i] = a / (1.0 + exp(-a)) * b;
        }
        for (int d = 0; d < dim; d++) {
            double s = 0;
            for (int i = 0; i < ffn; i++) s += (double)dn[(size_t)d * ffn + i] * h[i];
            y[d] += w[j] * s;
        }
    }
    free(logits);
    free(ids);
    free(w);
    free(h);
}

/* Run the FFN on n random tokens with the CPU backend (2 threads) and
 * compare every row with ref_ffn, to tol relative to the row's scale. */
static void check_ffn(ffn_case *c, int n, double tol) {
    rk_backend *be = NULL;
    cr_assert_eq(rk_backend_create("cpu", 2, &be), RK_OK, "%s", rk_error_message());
    float *x = rk_test_rand_floats(&rng, (size_t)n * c->dim, -1.0f, 1.0f);
    float *y = calloc((size_t)n * c->dim, sizeof *y);
    double *ry = malloc((size_t)c->dim * sizeof *ry);
    cr_assert(x && y && ry);
    rk_moe_scratch s = {0};
    cr_assert_eq(rk_moe_ffn(be, &c->L, x, y, n, &s), RK_OK, "%s", rk_error_message());
    for (int t = 0; t < n; t++) {
        ref_ffn(c, x + (size_t)t * c->dim, ry);
        double scale = 0;
        for (int d = 0; d < c->dim; d++) scale = fmax(scale, fabs(ry[d]));
        for (int d = 0; d < c->dim; d++)
            cr_assert(fabs(y[(size_t)t * c->dim + d] - ry[d]) <= tol * scale + 1e-6,
                      "token %d dim %d: %.7g, expected %.7g", t, d, y[(size_t)t * c->dim + d],
                      ry[d]);
    }
    /* A token alone gets what it got in the batch (same routing, same sums). */
    float *y1 = malloc((size_t)c->dim * sizeof *y1);
    cr_assert(y1);
    for (int d = 0; d < c->dim; d++) y1[d] = 1.0f; /* the output is added to y */
    int t = n / 2;
    cr_assert_eq(rk_moe_ffn(be, &c->L, x + (size_t)t * c->dim, y1, 1, &s), RK_OK);
    for (int d = 0; d < c->dim; d++)
        cr_assert(fabsf(y1[d] - 1.0f - y[(size_t)t * c->dim + d]) <=
                      1e-5f * (float)fmax(1.0, fabs(y1[d])),
                  "token %d alone, dim %d: %.7g, in the batch %.7g", t, d, y1[d],
                  y[(size_t)t * c->dim + d]);
    free(y1);
    rk_moe_scratch_free(&s);
    free(x);
    free(y);
    free(ry);
    rk_backend_free(be);
}

Test(moe, ffn_f32_batch_matches_the_dense_reference) {
    ffn_case c;
    ffn_case_init(&c, 8, 2, 64, 32, RK_DTYPE_F32);
    check_ffn(&c, 37, 1e-4);
    ffn_case_free(&c);
}

Test(moe, ffn_q8_0_many_experts_matches_the_dense_reference) {
    ffn_case c;
    ffn_case_init(&c, 32, 4, 128, 64, RK_DTYPE_Q8_0);
    /* Q8_0 matmuls quantize the activations to 8 bits as well */
    check_ffn(&c, 20, 2e-2);
    ffn_case_free(&c);
}

Test(moe, ffn_single_token_decode_matches_the_dense_reference) {
    ffn_case c;
    ffn_case_init(&c, 16, 4, 64, 32, RK_DTYPE_F16);
    check_ffn(&c, 1, 1e-3);
    ffn_case_free(&c);
}

Test(moe, ffn_never_reads_an_expert_no_token_chose) {
    ffn_case c;
    ffn_case_init(&c, 8, 2, 64, 32, RK_DTYPE_F32);
    /* Experts 6 and 7: a router row that loses for every positive x, and
     * weights that would turn any output they touch into NaN. */
    for (int e = 6; e < 8; e++) {
        for (int d = 0; d < c.dim; d++) c.router[e * c.dim + d] = -1.0f;
        size_t n = (size_t)c.ffn * c.dim;
        for (size_t i = 0; i < n; i++) {
            ((float *)c.gate)[e * n + i] = NAN;
            ((float *)c.up)[e * n + i] = NAN;
            ((float *)c.down)[e * n + i] = NAN;
        }
    }
    for (size_t i = 0; i < (size_t)6 * c.dim; i++) c.router[i] = fabsf(c.router[i]) * 0.01f;
    rk_backend *be = NULL;
    cr_assert_eq(rk_backend_create("cpu", 2, &be), RK_OK);
    int n = 9;
    float *x = rk_test_rand_floats(&rng, (size_t)n * c.dim, 0.5f, 1.0f);
    float *y = calloc((size_t)n * c.dim, sizeof *y);
    cr_assert(x && y);
    rk_moe_scratch s = {0};
    cr_assert_eq(rk_moe_ffn(be, &c.L, x, y, n, &s), RK_OK, "%s", rk_error_message());
    for (int i = 0; i < n * c.dim; i++) cr_assert(isfinite(y[i]), "y[%d] = %g", i, y[i]);
    rk_moe_scratch_free(&s);
    free(x);
    free(y);
    rk_backend_free(be);
    ffn_case_free(&c);
}

/* The layout the model loader gives experts where the CPU packs their type:
 * down packed per expert, gate and up packed as one [gate; up] matrix. Both
 * sides of the fused split (whole for a few rows, apart for many) are run. */
static void check_packed(rk_dtype t, int dim, int ffn) {
    rk_backend *be = NULL;
    cr_assert_eq(rk_backend_create("cpu", 2, &be), RK_OK);
    const rk_backend_ops *ops = be->ops;
    size_t bgu = ops->packed_bytes ? ops->packed_bytes(be, t, dim, 2 * ffn) : 0;
    size_t bd = ops->packed_bytes ? ops->packed_bytes(be, t, ffn, dim) : 0;
    if (!bgu || !bd) {
        rk_backend_free(be);
        cr_skip_test("this CPU keeps %s weights as stored", rk_dtype_name(t));
    }
    ffn_case c;
    ffn_case_init(&c, 16, 4, dim, ffn, t);
    size_t half = rk_dtype_row_bytes(t, (size_t)dim) * ffn;
    unsigned char *gu = malloc(bgu * c.n_expert), *dn = malloc(bd * c.n_expert);
    unsigned char *stored = malloc(2 * half);
    rk_moe_mat *mgu = calloc((size_t)c.n_expert, sizeof *mgu);
    cr_assert(gu && dn && stored && mgu);
    for (int e = 0; e < c.n_expert; e++) {
        memcpy(stored, c.mg[e].w, half);
        memcpy(stored + half, c.mu[e].w, half);
        cr_assert_eq(ops->pack(be, gu + e * bgu, stored, t, dim, 2 * ffn), RK_OK);
        cr_assert_eq(ops->pack(be, dn + e * bd, c.md[e].w, t, ffn, dim), RK_OK);
        mgu[e] = (rk_moe_mat){NULL, gu + e * bgu, t};
        c.md[e].packed = dn + e * bd;
    }
    c.L.gate_up = mgu;
    c.L.up_offset = ops->packed_offset ? ops->packed_offset(be, t, dim, ffn) : SIZE_MAX;
    cr_log_info("%s: up rows at byte %zu of %zu", rk_dtype_name(t), c.L.up_offset, bgu);
    check_ffn(&c, 1, 2e-2);   /* decode: one token, fused whole */
    check_ffn(&c, 150, 2e-2); /* about 37 tokens per expert: the halves apart */
    free(gu);
    free(dn);
    free(stored);
    free(mgu);
    ffn_case_free(&c);
    rk_backend_free(be);
}

Test(moe, ffn_with_packed_and_fused_q8_0_experts_matches_the_dense_reference) {
    check_packed(RK_DTYPE_Q8_0, 128, 64);
}

Test(moe, ffn_with_packed_and_fused_q4_k_experts_matches_the_dense_reference) {
    check_packed(RK_DTYPE_Q4_K, 256, 256);
}
