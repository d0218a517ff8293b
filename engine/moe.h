/* engine/moe.h — mixture-of-experts feed-forward: routing and the expert FFN.
 *
 * A MoE layer replaces the dense FFN with n_expert SwiGLU experts of width
 * ffn_exp and a router (n_expert, dim). For every token:
 *   logits = router · x (+ router_b)               (n_expert)
 *   probs  = softmax(logits) | sigmoid(logits) | logits (the gating function)
 *   ids    = the n_used experts of highest prob, highest first; equal probs
 *            in increasing expert order
 *   w      = probs[ids], softmax over these n_used (RK_MOE_SOFTMAX_TOPK),
 *            divided by their sum when norm_topk (the sum clamped
 *            from below at 2^-14, the smallest normal f16, as the reference
 *            engine does), then times w_scale when it is not 0 or 1
 *   y      = sum over the n_used experts e of w_e · down_e(act(gate_e x, up_e x))
 *            (each of gate_e x, up_e x and down_e(.) plus its bias where the
 *            layer has biases)
 * qwen3moe: softmax gating, norm_topk on, no scale, SiLU, no biases.
 * gpt-oss: RK_MOE_SOFTMAX_TOPK, no norm, no scale, RK_FFN_SWIGLU_OAI, biases.
 *
 * The expert tensors are stored stacked, as GGUF files hold them: the
 * ffn_gate_exps tensor has ne = {dim, ffn_exp, n_expert}, so expert e is the
 * (ffn_exp, dim) matrix of rows e * ffn_exp .. (e + 1) * ffn_exp - 1, a
 * normal matrix at an offset of whole rows (quantized rows are whole blocks).
 *
 * The FFN computes a batch expert by expert: the tokens routed to an expert
 * are gathered into one matrix and multiplied together, so each active
 * expert's weights are read once per pass whatever the number of tokens,
 * and experts no token chose are not read at all. Each matmul runs on the
 * backend's thread pool like a dense one. Host backends only (the gather and
 * the weighted sum are done on host memory); the loader refuses MoE files on
 * other backends with RK_ERR_UNSUPPORTED. */
#ifndef RK_MOE_H
#define RK_MOE_H

#include <stdint.h>

#include "config/config.h"
#include "engine/arch.h"
#include "kernels/kernels.h"

typedef struct rk_moe_route_params {
    int n_expert;         /* experts to choose from, >= 1 */
    int n_used;           /* experts per token, 1..n_expert */
    rk_moe_gating gating; /* RK_MOE_SOFTMAX, _SIGMOID or _SOFTMAX_TOPK (arch.h) */
    int norm_topk;        /* divide the n_used weights by their sum */
    float w_scale;        /* multiply the weights by it; 0 or 1: no scaling */
} rk_moe_route_params;

/* Route n_tokens tokens: logits (n_tokens, n_expert) in, out_ids (n_tokens,
 * n_used) expert ids highest weight first and out_w (n_tokens, n_used) their
 * weights. Returns RK_ERR_INVALID (writing nothing) for a bad shape. Pure:
 * any thread. */
rk_status rk_moe_route(const float *logits, int n_tokens, const rk_moe_route_params *p,
                       int32_t *out_ids, float *out_w);

/* Group routed pairs by expert: ids (n_pairs) expert ids in [0, n_expert);
 * out_offs (n_expert + 1) gets the start of each expert's run in out_order,
 * out_order (n_pairs) the pair indices, expert by expert in increasing order,
 * pair order kept within an expert. RK_ERR_INVALID for an id out of range. */
rk_status rk_moe_group(const int32_t *ids, int n_pairs, int n_expert, int32_t *out_offs,
                       int32_t *out_order);

/* One expert matrix: w the stored rows (backend memory), packed the
 * backend's packed copy or NULL. */
typedef struct rk_moe_mat {
    const void *w;
    const void *packed;
    rk_dtype type;
} rk_moe_mat;

typedef struct rk_moe_layer {
    rk_moe_route_params route;
    int dim, ffn_exp;
    const float *router; /* (n_expert, dim) F32 */
    rk_moe_mat *gate;    /* [n_expert] each (ffn_exp, dim) */
    rk_moe_mat *up;      /* [n_expert] each (ffn_exp, dim) */
    rk_moe_mat *down;    /* [n_expert] each (dim, ffn_exp) */
    /* Optional (NULL: gate and up apart): [n_expert] each [gate; up]
     * (2 ffn_exp, dim) as one packed matrix, which the FFN multiplies
     * instead; up_offset is the backend's packed_offset of its row ffn_exp
     * (SIZE_MAX: the parts cannot be multiplied apart). */
    rk_moe_mat *gate_up;
    size_t up_offset;
    rk_ffn_act act; /* RK_FFN_SILU (0) or RK_FFN_SWIGLU_OAI */
    /* Optional biases (NULL: none), host memory: the router's (n_expert),
     * and per expert e the gate's and up's at e * ffn_exp, down's at e * dim */
    const float *router_b, *gate_b, *up_b, *down_b;
} rk_moe_layer;

/* Activation buffers of rk_moe_ffn, grown on demand; zero-initialise, free
 * with rk_moe_scratch_free. */
typedef struct rk_moe_scratch {
    int cap, cap_dim, cap_ffn, cap_expert, cap_used;
    float *logits;  /* (cap, n_expert) */
    int32_t *ids;   /* (cap, n_used) */
    float *w;       /* (cap, n_used) */
    int32_t *offs;  /* (n_expert + 1) */
    int32_t *order; /* (cap * n_used) */
    float *xg, *yg; /* (cap, dim): the gathered rows of one expert, its outputs */
    float *hg, *ug; /* (cap, ffn_exp) */
    float *acc;     /* (cap, dim): the weighted sums */
    float *gu;      /* (cap, 2 ffn_exp): a fused gate/up output */
} rk_moe_scratch;

void rk_moe_scratch_free(rk_moe_scratch *s);

/* y(n, dim) += the MoE FFN of x(n, dim) (host memory, y distinct from x) on
 * the host backend be: the experts' weighted sum is formed first, then added
 * to y (the residual stream). RK_ERR_NOMEM when scratch cannot be had, else
 * the backend ops' status. */
rk_status rk_moe_ffn(rk_backend *be, const rk_moe_layer *L, const float *x, float *y, int n,
                     rk_moe_scratch *s);

#endif
