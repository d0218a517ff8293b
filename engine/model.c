/* engine/model.c — loading a model's weights from GGUF (its
 * hyper-parameters: model_hparams.c) and the transformer forward pass over a
 * paged KV cache.
 *
 * Per layer, for a batch of n tokens (x is the residual stream):
 *   xb = rmsnorm(x) · attn_norm
 *   q, k, v = xb·Wq (+bq), xb·Wk (+bk), xb·Wv (+bv)
 *   q, k = rmsnorm per head (qwen3 only), then RoPE at each token's position
 *   kv_write(k, v → slots);  att = paged attention(q, block tables)
 *   x += att·Wo
 *   xb = rmsnorm(x) · ffn_norm;  x += (silu(xb·Wgate) * (xb·Wup)) · Wdown
 * then logits = (rmsnorm(x) · output_norm) · Wout for the requested rows. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "engine/model_internal.h"

/* ---------------------------------------------------------------- helpers */

static rk_status track(void ***arr, int *n, int *cap, void *p) {
    if (*n == *cap) {
        int nc = *cap ? *cap * 2 : 64;
        void **na = realloc(*arr, (size_t)nc * sizeof *na);
        if (!na) return rk_errorf(RK_ERR_NOMEM, "model: out of memory");
        *arr = na;
        *cap = nc;
    }
    (*arr)[(*n)++] = p;
    return RK_OK;
}

static rk_status be_alloc(rk_model *m, size_t bytes, void **out) {
    rk_status st = m->be->ops->alloc(m->be, bytes ? bytes : 1, out);
    if (st) return st;
    st = track(&m->allocs, &m->n_allocs, &m->cap_allocs, *out);
    if (st) m->be->ops->free(m->be, *out);
    return st;
}

static int backend_is_host(const rk_backend *be) { return strcmp(be->name, "cpu") == 0; }

#define SUPPORTED_TYPES                                                                            \
    "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, " \
    "MXFP4"
/* The CUDA backend has kernels for these only. */
#define SUPPORTED_TYPES_CUDA "F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K"

/* The compute dtype of a tensor on m's backend: the CPU computes every type
 * ragkv reads, the CUDA backend all but the seven added block types, which
 * it refuses with the same message naming the ones it computes. */
static rk_status dtype_of(const rk_model *m, const rk_gguf_tensor *t, rk_dtype *out) {
    if (!backend_is_host(m->be)) switch (t->type) {
        case RK_GGML_Q4_1:
        case RK_GGML_Q5_0:
        case RK_GGML_Q5_1:
        case RK_GGML_Q2_K:
        case RK_GGML_Q3_K:
        case RK_GGML_IQ4_NL:
        case RK_GGML_IQ4_XS:
        case RK_GGML_MXFP4:
            return rk_errorf(RK_ERR_UNSUPPORTED,
                             "tensor %s has type %s; ragkv computes with %s on the %s backend",
                             t->name, rk_ggml_type_name(t->type), SUPPORTED_TYPES_CUDA,
                             m->be->name);
        default: break;
        }
    switch (t->type) {
    case RK_GGML_F32: *out = RK_DTYPE_F32; return RK_OK;
    case RK_GGML_F16: *out = RK_DTYPE_F16; return RK_OK;
    case RK_GGML_BF16: *out = RK_DTYPE_BF16; return RK_OK;
    case RK_GGML_Q8_0: *out = RK_DTYPE_Q8_0; return RK_OK;
    case RK_GGML_Q4_0: *out = RK_DTYPE_Q4_0; return RK_OK;
    case RK_GGML_Q4_K: *out = RK_DTYPE_Q4_K; return RK_OK;
    case RK_GGML_Q5_K: *out = RK_DTYPE_Q5_K; return RK_OK;
    case RK_GGML_Q6_K: *out = RK_DTYPE_Q6_K; return RK_OK;
    case RK_GGML_Q4_1: *out = RK_DTYPE_Q4_1; return RK_OK;
    case RK_GGML_Q5_0: *out = RK_DTYPE_Q5_0; return RK_OK;
    case RK_GGML_Q5_1: *out = RK_DTYPE_Q5_1; return RK_OK;
    case RK_GGML_Q2_K: *out = RK_DTYPE_Q2_K; return RK_OK;
    case RK_GGML_Q3_K: *out = RK_DTYPE_Q3_K; return RK_OK;
    case RK_GGML_IQ4_NL: *out = RK_DTYPE_IQ4_NL; return RK_OK;
    case RK_GGML_IQ4_XS: *out = RK_DTYPE_IQ4_XS; return RK_OK;
    case RK_GGML_MXFP4: *out = RK_DTYPE_MXFP4; return RK_OK;
    default:
        return rk_errorf(RK_ERR_UNSUPPORTED, "tensor %s has type %s; ragkv computes with %s",
                         t->name, rk_ggml_type_name(t->type), SUPPORTED_TYPES);
    }
}

/* Find a tensor and check its shape (ne0 fastest; ne1 = 1 for vectors). */
static rk_status find(rk_model *m, const char *name, int64_t ne0, int64_t ne1, int optional,
                      const rk_gguf_tensor **out) {
    const rk_gguf_tensor *t = rk_gguf_find_tensor(m->gguf, name);
    *out = t;
    if (!t) {
        if (optional) return RK_OK;
        return rk_errorf(RK_ERR_FORMAT, "model: tensor %s is missing", name);
    }
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != 1 || t->ne[3] != 1)
        return rk_errorf(
            RK_ERR_FORMAT,
            "model: tensor %s has shape {%lld, %lld, %lld, %lld}, expected {%lld, %lld}", name,
            (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3],
            (long long)ne0, (long long)ne1);
    return RK_OK;
}

/* A NaN or infinite weight poisons every activation it touches, silently:
 * refuse the file instead. Quantized tensors are not scanned (their scales
 * would need decoding block by block; rk_gguf_tensor_first_nonfinite
 * returns -1 for them). */
static rk_status check_finite(const rk_gguf_tensor *t, rk_dtype dt) {
    int64_t i = rk_gguf_tensor_first_nonfinite(t);
    if (i < 0) return RK_OK;
    float v;
    rk_dtype_to_f32(&v, (const char *)t->data + (size_t)i * rk_dtype_size(dt), dt, 1);
    return rk_errorf(RK_ERR_FORMAT, "model: tensor %s has %s at element %lld", t->name,
                     isnan(v) ? "a NaN" : "an infinite value", (long long)i);
}

/* A weight as backend memory: the mapping itself on the CPU backend, an upload elsewhere. */
static rk_status place(rk_model *m, const rk_gguf_tensor *t, const void **out) {
    if (backend_is_host(m->be)) {
        *out = t->data;
        return RK_OK;
    }
    void *p;
    rk_status st = be_alloc(m, t->n_bytes, &p);
    if (st) return st;
    *out = p;
    return m->be->ops->upload(m->be, p, t->data, t->n_bytes);
}

/* A small f32 tensor (norm weight, bias) of {n, rows} elements, converted
 * when stored narrower; host memory when host is set, else backend memory. */
static rk_status load_vec2(rk_model *m, const char *name, int64_t n, int64_t rows, int optional,
                           int host, const float **out) {
    const rk_gguf_tensor *t;
    *out = NULL;
    rk_status st = find(m, name, n, rows, optional, &t);
    if (st || !t) return st;
    n *= rows;
    rk_dtype dt;
    if ((st = dtype_of(m, t, &dt)) || (st = check_finite(t, dt))) return st;
    const void *src = t->data;
    if (dt != RK_DTYPE_F32) {
        float *f = malloc((size_t)n * sizeof *f);
        if (!f) return rk_errorf(RK_ERR_NOMEM, "model: out of memory");
        if ((st = track(&m->host_allocs, &m->n_host, &m->cap_host, f))) {
            free(f);
            return st;
        }
        rk_dtype_to_f32(f, t->data, dt, (size_t)n);
        src = f;
    }
    if (host || backend_is_host(m->be)) {
        *out = src;
        return RK_OK;
    }
    void *p;
    if ((st = be_alloc(m, (size_t)n * sizeof(float), &p))) return st;
    *out = p;
    return m->be->ops->upload(m->be, p, src, (size_t)n * sizeof(float));
}

static rk_status load_vec(rk_model *m, const char *name, int64_t n, int optional,
                          const float **out) {
    return load_vec2(m, name, n, 1, optional, 0, out);
}

/* Give w a packed copy where the backend reads one faster (on the CPU: BF16
 * with AVX-512 BF16, for the tile kernel whatever n is; Q8_0, Q3_K, Q4_K and Q6_K
 * with AVX-512 VNNI, for the interleaved decode kernels). The stored weights
 * stay mapped for the embedding rows; the packed copy is the memory the
 * matmuls read. */
static rk_status pack_mat(rk_model *m, rk_matrix *w) {
    const rk_backend_ops *ops = m->be->ops;
    size_t bytes = ops->packed_bytes ? ops->packed_bytes(m->be, w->type, w->cols, w->rows) : 0;
    if (bytes == 0) return RK_OK;
    void *p;
    rk_status st = be_alloc(m, bytes, &p);
    if (st) return st;
    if ((st = ops->pack(m->be, p, w->w, w->type, w->cols, w->rows))) return st;
    w->packed = p;
    return RK_OK;
}

/* Find, check and place a matrix as stored; the caller packs it. */
static rk_status load_stored(rk_model *m, const char *name, int rows, int cols, rk_matrix *out) {
    const rk_gguf_tensor *t;
    rk_status st = find(m, name, cols, rows, 0, &t);
    if (st) return st;
    out->rows = rows;
    out->cols = cols;
    if ((st = dtype_of(m, t, &out->type)) || (st = check_finite(t, out->type))) return st;
    m->weight_bytes += t->n_bytes;
    return place(m, t, &out->w);
}

static rk_status load_mat(rk_model *m, const char *name, int rows, int cols, rk_matrix *out) {
    rk_status st = load_stored(m, name, rows, cols, out);
    return st ? st : pack_mat(m, out);
}

/* Matrices that multiply the same input (q, k and v; gate and up) packed as
 * one, their rows one after the other, where the backend packs them: decode
 * then streams one long matrix in one pass of the thread pool instead of
 * two or three short ones (the per-call start and the wait for the last
 * task are paid once), and each output gets the bits it gets unfused. Only
 * on the host backend, whose stored weights are host memory; otherwise, or
 * with types that differ, each part is packed alone and out->rows stays 0. */
static rk_status fuse_mats(rk_model *m, rk_matrix *parts[], int n_parts, rk_matrix *out) {
    const rk_backend_ops *ops = m->be->ops;
    rk_dtype t = parts[0]->type;
    int rows = 0, cols = parts[0]->cols;
    for (int i = 0; i < n_parts; i++) {
        if (parts[i]->type != t || parts[i]->cols != cols) rows = -1;
        if (rows >= 0) rows += parts[i]->rows;
    }
    size_t bytes = rows > 0 && backend_is_host(m->be) && ops->packed_bytes
                       ? ops->packed_bytes(m->be, t, cols, rows)
                       : 0;
    if (bytes == 0) {
        rk_status st = RK_OK;
        for (int i = 0; i < n_parts && !st; i++) st = pack_mat(m, parts[i]);
        return st;
    }
    size_t row_bytes = rk_dtype_row_bytes(t, (size_t)cols);
    unsigned char *stored = malloc((size_t)rows * row_bytes);
    if (!stored) return rk_errorf(RK_ERR_NOMEM, "model: out of memory fusing %d matrices", n_parts);
    for (int i = 0, r = 0; i < n_parts; r += parts[i]->rows, i++)
        memcpy(stored + (size_t)r * row_bytes, parts[i]->w, (size_t)parts[i]->rows * row_bytes);
    void *p;
    rk_status st = be_alloc(m, bytes, &p);
    if (!st) st = ops->pack(m->be, p, stored, t, cols, rows);
    free(stored);
    if (st) return st;
    *out = (rk_matrix){NULL, p, t, rows, cols};
    m->has_fused = 1;
    return RK_OK;
}

/* ---------------------------------------------------------------- loading */

/* One stacked expert tensor name {ne0, ne1, n_expert} as n_expert matrices
 * (ne1, ne0) at offsets of whole rows, each packed on its own where the
 * backend packs and pack is set; out[e] for expert e. Counted in
 * weight_bytes for the share a token reads (n_expert_used of n_expert). */
static rk_status load_stack(rk_model *m, const char *name, int rows, int cols, int pack,
                            rk_moe_mat *out) {
    const rk_hparams *hp = &m->hp;
    const rk_gguf_tensor *t = rk_gguf_find_tensor(m->gguf, name);
    if (!t) return rk_errorf(RK_ERR_FORMAT, "model: tensor %s is missing", name);
    if (t->ne[0] != cols || t->ne[1] != rows || t->ne[2] != hp->n_expert || t->ne[3] != 1)
        return rk_errorf(RK_ERR_FORMAT,
                         "model: tensor %s has shape {%lld, %lld, %lld, %lld}, expected "
                         "{%d, %d, %d}",
                         name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                         (long long)t->ne[3], cols, rows, hp->n_expert);
    rk_dtype dt;
    rk_status st;
    if ((st = dtype_of(m, t, &dt)) || (st = check_finite(t, dt))) return st;
    m->weight_bytes += t->n_bytes / (size_t)hp->n_expert * (size_t)hp->n_expert_used;
    size_t per = rk_dtype_row_bytes(dt, (size_t)cols) * (size_t)rows;
    const rk_backend_ops *ops = m->be->ops;
    size_t packed = pack && ops->packed_bytes ? ops->packed_bytes(m->be, dt, cols, rows) : 0;
    unsigned char *p = NULL;
    if (packed && (st = be_alloc(m, packed * (size_t)hp->n_expert, (void **)&p))) return st;
    for (int e = 0; e < hp->n_expert; e++) {
        const void *w = (const unsigned char *)t->data + (size_t)e * per;
        out[e] = (rk_moe_mat){w, NULL, dt};
        if (!packed) continue;
        if ((st = ops->pack(m->be, p + (size_t)e * packed, w, dt, cols, rows))) return st;
        out[e].packed = p + (size_t)e * packed;
    }
    return RK_OK;
}

/* Each expert's gate and up packed as one matrix [gate; up] (2 ffn_exp,
 * dim) where the backend packs their type, as fuse_mats does for a dense
 * FFN: a decoded token's expert is then two matmuls, not three. Otherwise
 * gate and up are packed (where the backend packs) on their own. */
static rk_status fuse_experts(rk_model *m, rk_layer *L) {
    const rk_hparams *hp = &m->hp;
    const rk_backend_ops *ops = m->be->ops;
    rk_moe_layer *M = &L->moe;
    rk_dtype t = M->gate[0].type;
    int rows = 2 * hp->ffn_exp;
    size_t bytes =
        t == M->up[0].type && ops->packed_bytes ? ops->packed_bytes(m->be, t, hp->dim, rows) : 0;
    rk_status st = RK_OK;
    if (bytes == 0) {
        for (int e = 0; e < hp->n_expert && !st; e++) {
            rk_moe_mat *mats[2] = {&M->gate[e], &M->up[e]};
            for (int i = 0; i < 2 && !st; i++) {
                rk_matrix w = {mats[i]->w, NULL, t, hp->ffn_exp, hp->dim};
                if (!(st = pack_mat(m, &w))) mats[i]->packed = w.packed;
            }
        }
        return st;
    }
    size_t half = rk_dtype_row_bytes(t, (size_t)hp->dim) * (size_t)hp->ffn_exp;
    unsigned char *p, *stored = malloc(2 * half);
    rk_moe_mat *gu = calloc((size_t)hp->n_expert, sizeof *gu);
    if (!stored || !gu) {
        free(stored);
        free(gu);
        return rk_errorf(RK_ERR_NOMEM, "model: out of memory fusing experts");
    }
    if ((st = track(&m->host_allocs, &m->n_host, &m->cap_host, gu))) {
        free(stored);
        free(gu);
        return st;
    }
    st = be_alloc(m, bytes * (size_t)hp->n_expert, (void **)&p);
    for (int e = 0; e < hp->n_expert && !st; e++) {
        memcpy(stored, M->gate[e].w, half);
        memcpy(stored + half, M->up[e].w, half);
        gu[e] = (rk_moe_mat){NULL, p + (size_t)e * bytes, t};
        st = ops->pack(m->be, p + (size_t)e * bytes, stored, t, hp->dim, rows);
    }
    free(stored);
    if (st) return st;
    M->gate_up = gu;
    M->up_offset =
        ops->packed_offset ? ops->packed_offset(m->be, t, hp->dim, hp->ffn_exp) : SIZE_MAX;
    return RK_OK;
}

/* The router and experts of layer l (a mixture-of-experts family): the
 * router as F32 (converted when stored otherwise), the expert stacks as
 * load_stack reads them. Host backends only (read_experts). */
static rk_status load_experts(rk_model *m, int l, rk_layer *L) {
    const rk_hparams *hp = &m->hp;
    char name[96];
    const rk_gguf_tensor *t;
    snprintf(name, sizeof name, "blk.%d.ffn_gate_inp.weight", l);
    rk_status st = find(m, name, hp->dim, hp->n_expert, 0, &t);
    rk_dtype dt;
    if (st || (st = dtype_of(m, t, &dt)) || (st = check_finite(t, dt))) return st;
    m->weight_bytes += t->n_bytes;
    const float *router = t->data;
    if (dt != RK_DTYPE_F32) {
        size_t n = (size_t)hp->n_expert * hp->dim;
        float *f = malloc(n * sizeof *f);
        if (!f) return rk_errorf(RK_ERR_NOMEM, "model: out of memory");
        if ((st = track(&m->host_allocs, &m->n_host, &m->cap_host, f))) {
            free(f);
            return st;
        }
        rk_dequantize(f, t->data, dt, n);
        router = f;
    }
    rk_moe_mat *mats = calloc((size_t)hp->n_expert * 3, sizeof *mats);
    if (!mats) return rk_errorf(RK_ERR_NOMEM, "model: out of memory");
    if ((st = track(&m->host_allocs, &m->n_host, &m->cap_host, mats))) {
        free(mats);
        return st;
    }
    L->moe = (rk_moe_layer){
        .route = {hp->n_expert, hp->n_expert_used, hp->desc->moe, hp->desc->moe_norm_topk, 0.0f},
        .dim = hp->dim,
        .ffn_exp = hp->ffn_exp,
        .router = router,
        .act = hp->desc->act,
        .gate = mats,
        .up = mats + hp->n_expert,
        .down = mats + 2 * (size_t)hp->n_expert,
    };
    char gate[96], up[96], down[96];
    snprintf(gate, sizeof gate, "blk.%d.ffn_gate_exps.weight", l);
    snprintf(up, sizeof up, "blk.%d.ffn_up_exps.weight", l);
    snprintf(down, sizeof down, "blk.%d.ffn_down_exps.weight", l);
    if ((st = load_stack(m, gate, hp->ffn_exp, hp->dim, 0, L->moe.gate)) ||
        (st = load_stack(m, up, hp->ffn_exp, hp->dim, 0, L->moe.up)) ||
        (st = load_stack(m, down, hp->dim, hp->ffn_exp, 1, L->moe.down)))
        return st;
    if (hp->desc->moe_biases) { /* host memory: the MoE FFN adds them itself */
        int ne = hp->n_expert;
        snprintf(name, sizeof name, "blk.%d.ffn_gate_inp.bias", l);
        if ((st = load_vec2(m, name, ne, 1, 0, 1, &L->moe.router_b))) return st;
        snprintf(gate, sizeof gate, "blk.%d.ffn_gate_exps.bias", l);
        snprintf(up, sizeof up, "blk.%d.ffn_up_exps.bias", l);
        snprintf(down, sizeof down, "blk.%d.ffn_down_exps.bias", l);
        if ((st = load_vec2(m, gate, hp->ffn_exp, ne, 0, 1, &L->moe.gate_b)) ||
            (st = load_vec2(m, up, hp->ffn_exp, ne, 0, 1, &L->moe.up_b)) ||
            (st = load_vec2(m, down, hp->dim, ne, 0, 1, &L->moe.down_b)))
            return st;
    }
    return fuse_experts(m, L);
}

static rk_status load_weights(rk_model *m) {
    rk_hparams *hp = &m->hp;
    const rk_gguf_tensor *t;
    rk_status st = rk_gguf_find_tensor(m->gguf, "token_embd.weight")
                       ? RK_OK
                       : rk_errorf(RK_ERR_FORMAT, "model: tensor token_embd.weight is missing");
    if (st) return st;
    t = rk_gguf_find_tensor(m->gguf, "token_embd.weight");
    if (t->ne[0] != hp->dim || t->ne[1] < 1 || t->ne[1] > (1 << 24) || t->n_dims != 2)
        return rk_errorf(RK_ERR_FORMAT, "model: token_embd.weight has shape {%lld, %lld}",
                         (long long)t->ne[0], (long long)t->ne[1]);
    hp->n_vocab = (int)t->ne[1];
    if ((st = dtype_of(m, t, &m->embd_type)) || (st = check_finite(t, m->embd_type)) ||
        (st = place(m, t, &m->embd)))
        return st;

    m->layers = calloc((size_t)hp->n_layers, sizeof *m->layers);
    if (!m->layers) return rk_errorf(RK_ERR_NOMEM, "model: out of memory");
    char name[96];
#define N(fmt) (snprintf(name, sizeof name, "blk.%d." fmt, l), name)
    for (int l = 0; l < hp->n_layers; l++) {
        rk_layer *L = &m->layers[l];
        char ffn_norm[96];
        snprintf(ffn_norm, sizeof ffn_norm, "blk.%d.%s.weight", l,
                 hp->desc->ffn_norm ? hp->desc->ffn_norm : "ffn_norm");
        /* the KV layer it writes, or (past the owning layers) the last owning one of its kind */
        L->owns_kv = l < hp->n_kv_layers;
        L->kv_layer = L->owns_kv ? l : hp->n_kv_layers - (rk_model_slides(m, l) ? 2 : 1);
        L->ffn_dim = m->ffn_of ? m->ffn_of[l] : hp->ffn_dim;
        L->out_scale = 1.0f;
        const int ffn = L->ffn_dim;
        int hd = rk_model_slides(m, l) ? m->head_dim_swa : m->head_dim_global;
        L->head_dim = hd = hd ? hd : hp->head_dim;
        const int q_dim = hp->n_heads * hd, kv_dim = hp->n_kv_heads * hd;
        if ((st = load_vec(m, N("attn_norm.weight"), hp->dim, 0, &L->attn_norm)) ||
            (st = load_vec(m, ffn_norm, hp->dim, 0, &L->ffn_norm)) ||
            (st = load_mat(m, N("attn_output.weight"), hp->dim, q_dim, &L->wo)))
            return st;
        /* Q, K, V: one attn_qkv matrix where the family's files may hold one
         * (they may also hold the three), else three, fused here where the
         * backend packs them. */
        if (hp->desc->fused_qkv && rk_gguf_find_tensor(m->gguf, N("attn_qkv.weight"))) {
            if ((st = load_mat(m, name, q_dim + 2 * kv_dim, hp->dim, &L->qkv))) return st;
            m->has_fused = 1;
        } else if (!L->owns_kv ||
                   (hp->desc->v_norm && !rk_gguf_find_tensor(m->gguf, N("attn_v.weight")))) {
            /* Q alone (a layer reusing KV), or Q and K (V = K) */
            if ((st = load_mat(m, N("attn_q.weight"), q_dim, hp->dim, &L->wq)) ||
                (L->owns_kv && (st = load_mat(m, N("attn_k.weight"), kv_dim, hp->dim, &L->wk))))
                return st;
        } else {
            rk_matrix *qkv[] = {&L->wq, &L->wk, &L->wv};
            if ((st = load_stored(m, N("attn_q.weight"), q_dim, hp->dim, &L->wq)) ||
                (st = load_stored(m, N("attn_k.weight"), kv_dim, hp->dim, &L->wk)) ||
                (st = load_stored(m, N("attn_v.weight"), kv_dim, hp->dim, &L->wv)) ||
                (st = fuse_mats(m, qkv, 3, &L->qkv)))
                return st;
        }
        /* The FFN: experts (load_experts), or gate and up (ffn_up holds both,
         * gate first, in fused families) and down. */
        if (hp->desc->moe) {
            if ((st = load_experts(m, l, L))) return st;
        } else if ((st = load_mat(m, N("ffn_down.weight"), hp->dim, ffn, &L->down))) {
            return st;
        } else if (hp->desc->fused_gate_up) {
            if ((st = load_mat(m, N("ffn_up.weight"), 2 * ffn, hp->dim, &L->gate_up))) return st;
            m->has_fused = 1;
        } else {
            rk_matrix *gate_up[] = {&L->gate, &L->up};
            if ((st = load_stored(m, N("ffn_gate.weight"), ffn, hp->dim, &L->gate)) ||
                (st = load_stored(m, N("ffn_up.weight"), ffn, hp->dim, &L->up)) ||
                (st = fuse_mats(m, gate_up, 2, &L->gate_up)))
                return st;
        }
        if (hp->desc->qk_norm &&
            ((st = load_vec(m, N("attn_q_norm.weight"), hd, 0, &L->q_norm)) ||
             (L->owns_kv && (st = load_vec(m, N("attn_k_norm.weight"), hd, 0, &L->k_norm)))))
            return st;
        if (hp->desc->post_norms &&
            ((st = load_vec(m, N("post_attention_norm.weight"), hp->dim, 0, &L->post_attn_norm)) ||
             (st = load_vec(m, N("post_ffw_norm.weight"), hp->dim, 0, &L->post_ffn_norm))))
            return st;
        L->window = rk_model_slides(m, l) ? hp->sliding_window : 0;
        /* Biases are optional where the family does not require them. */
        int bias_optional = !hp->desc->qkv_bias;
        if ((st = load_vec(m, N("attn_q.bias"), q_dim, bias_optional, &L->bq)) ||
            (L->owns_kv && ((st = load_vec(m, N("attn_k.bias"), kv_dim, bias_optional, &L->bk)) ||
                            (st = load_vec(m, N("attn_v.bias"), kv_dim, bias_optional, &L->bv)))))
            return st;
        if (hp->desc->attn_out_bias &&
            (st = load_vec(m, N("attn_output.bias"), hp->dim, 0, &L->bo)))
            return st;
        if (hp->desc->attn_sinks && /* host memory: the attention op reads them there */
            (st = load_vec2(m, N("attn_sinks.weight"), hp->n_heads, 1, 0, 1, &L->sinks)))
            return st;
    }
#undef N
    if ((hp->desc->per_layer_embd || hp->desc->layer_out_scale) && (st = rk_gemma4_load(m)))
        return st;
    if ((st = load_vec(m, "output_norm.weight", hp->dim, 0, &m->out_norm))) return st;
    if (rk_gguf_find_tensor(m->gguf, "output.weight")) {
        if ((st = load_mat(m, "output.weight", hp->n_vocab, hp->dim, &m->out))) return st;
    } else {
        hp->tied_embeddings = 1;
        m->out = (rk_matrix){m->embd, NULL, m->embd_type, hp->n_vocab, hp->dim};
        m->weight_bytes += t->n_bytes;
        if ((st = pack_mat(m, &m->out))) return st;
    }
    hp->wtype = m->layers[0].wq.rows ? m->layers[0].wq.type : m->layers[0].qkv.type;
    return RK_OK;
}

/* Fingerprint: XXH3-128 over the hyper-parameters, the RoPE tables, the
 * tensor table and a sample (first and last 64 KiB) of every tensor's data.
 * It keys persistent stores, so nothing that differs between runs of the
 * same file (an address) may enter it. */
static void compute_fingerprint(rk_model *m) {
    XXH3_state_t *s = XXH3_createState();
    if (!s) {
        snprintf(m->fingerprint, sizeof m->fingerprint, "%032x", 0);
        return;
    }
    XXH3_128bits_reset(s);
    rk_hparams hp; /* without the description's address; memcpy keeps the padding's zeros */
    memcpy(&hp, &m->hp, sizeof hp);
    hp.desc = NULL;
    /* The fields up to the experts' as before Gemma 4's were added (so the
     * other families' fingerprints, which key stores, stay what they were),
     * then what Gemma 4's layers add, where a model has it. */
    hp.n_kv_layers = hp.n_embd_per_layer = 0;
    size_t align = _Alignof(rk_hparams), head = offsetof(rk_hparams, n_kv_layers);
    XXH3_128bits_update(s, &hp, (head + align - 1) / align * align);
    XXH3_128bits_update(s, &m->rope, sizeof m->rope); /* factors and scale from the file */
    XXH3_128bits_update(s, &m->rope_swa, sizeof m->rope_swa);
    if (m->slides || m->hp.n_kv_layers != m->hp.n_layers || m->hp.n_embd_per_layer) {
        int g4[4] = {m->hp.n_kv_layers, m->hp.n_embd_per_layer, m->head_dim_swa,
                     m->head_dim_global};
        XXH3_128bits_update(s, g4, sizeof g4);
        if (m->slides) XXH3_128bits_update(s, m->slides, (size_t)m->hp.n_layers);
    }
    if (m->ffn_of) XXH3_128bits_update(s, m->ffn_of, (size_t)m->hp.n_layers * sizeof(int));
    for (int64_t i = 0; i < rk_gguf_n_tensors(m->gguf); i++) {
        const rk_gguf_tensor *t = rk_gguf_tensor_at(m->gguf, i);
        XXH3_128bits_update(s, t->name, strlen(t->name));
        XXH3_128bits_update(s, &t->type, sizeof t->type);
        XXH3_128bits_update(s, t->ne, sizeof t->ne);
        size_t n = t->n_bytes < 65536 ? t->n_bytes : 65536;
        XXH3_128bits_update(s, t->data, n);
        XXH3_128bits_update(s, (const char *)t->data + t->n_bytes - n, n);
    }
    XXH128_hash_t h = XXH3_128bits_digest(s);
    XXH3_freeState(s);
    snprintf(m->fingerprint, sizeof m->fingerprint, "%016llx%016llx", (unsigned long long)h.high64,
             (unsigned long long)h.low64);
}

static rk_status load_common(rk_model *m) {
    rk_status st;
    if ((st = rk_model_read_hparams(m)) || (st = rk_model_apply_rope_freqs(m)) ||
        (st = load_weights(m)) || (st = rk_tokenizer_from_gguf(m->gguf, &m->tok)))
        return st;
    m->layer_rope = malloc((size_t)m->hp.n_layers * sizeof *m->layer_rope);
    if (!m->layer_rope) return rk_errorf(RK_ERR_NOMEM, "model: out of memory");
    for (int l = 0; l < m->hp.n_layers; l++)
        m->layer_rope[l] = rk_model_slides(m, l) ? &m->rope_swa : &m->rope;
    if (rk_tokenizer_n_vocab(m->tok) > m->hp.n_vocab)
        return rk_errorf(RK_ERR_FORMAT, "model: tokenizer has %d tokens but the embedding %d rows",
                         rk_tokenizer_n_vocab(m->tok), m->hp.n_vocab);
    compute_fingerprint(m);
    return RK_OK;
}

rk_status rk_model_load(const char *path, rk_backend *be, rk_model **out) {
    *out = NULL;
    rk_model *m = calloc(1, sizeof *m);
    if (!m) return rk_errorf(RK_ERR_NOMEM, "model: out of memory");
    m->be = be;
    rk_status st = rk_gguf_open(path, &m->gguf);
    if (!st) st = load_common(m);
    if (st) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", rk_error_message());
        rk_model_free(m);
        return strstr(msg, path) ? rk_errorf(st, "%s", msg) : rk_errorf(st, "%s: %s", path, msg);
    }
    *out = m;
    return RK_OK;
}

rk_status rk_model_load_owned_buffer(void *buf, size_t len, const char *name, rk_backend *be,
                                     rk_model **out) {
    *out = NULL;
    rk_model *m = calloc(1, sizeof *m);
    if (!m) {
        free(buf);
        return rk_errorf(RK_ERR_NOMEM, "model: out of memory");
    }
    m->be = be;
    m->owned_buf = buf;
    rk_status st = rk_gguf_open_memory(buf, len, &m->gguf);
    if (!st) st = load_common(m);
    if (st) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", rk_error_message());
        rk_model_free(m);
        return rk_errorf(st, "%s: %s", name, msg);
    }
    *out = m;
    return RK_OK;
}

static void scratch_free(rk_model *m) {
    rk_scratch *s = &m->s;
    void *bufs[] = {s->x,     s->xb, s->q,      s->att,    s->k,   s->v,     s->hb,   s->hb2,
                    s->fused, s->xl, s->logits, s->tokens, s->pos, s->slots, s->table};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) m->be->ops->free(m->be, bufs[i]);
    memset(s, 0, sizeof *s);
}

void rk_model_free(rk_model *m) {
    if (!m) return;
    scratch_free(m);
    for (int i = 0; i < m->n_allocs; i++) m->be->ops->free(m->be, m->allocs[i]);
    for (int i = 0; i < m->n_host; i++) free(m->host_allocs[i]);
    free(m->allocs);
    free(m->host_allocs);
    free(m->layers);
    rk_moe_scratch_free(&m->moe_s);
    free(m->layer_rope);
    rk_gemma4_free(m);
    rk_tokenizer_free(m->tok);
    rk_gguf_close(m->gguf);
    free(m->owned_buf);
    free(m);
}

const rk_hparams *rk_model_hparams(const rk_model *m) { return &m->hp; }
const rk_tokenizer *rk_model_tokenizer(const rk_model *m) { return m->tok; }
const rk_rope *rk_model_rope(const rk_model *m, int layer) {
    return layer >= 0 && layer < m->hp.n_layers ? m->layer_rope[layer] : NULL;
}
const rk_rope *const *rk_model_ropes(const rk_model *m) { return m->layer_rope; }
rk_attn_params rk_model_attn_params(const rk_model *m, int layer) {
    int window = layer >= 0 && layer < m->hp.n_layers ? m->layers[layer].window : 0;
    return (rk_attn_params){.scale = m->hp.attn_scale,
                            .softcap = m->hp.attn_softcap,
                            .window = window,
                            .sinks = layer >= 0 && layer < m->hp.n_layers ? m->layers[layer].sinks
                                                                          : NULL};
}
int rk_model_kv_layer(const rk_model *m, int layer) {
    return layer >= 0 && layer < m->hp.n_layers ? m->layers[layer].kv_layer : -1;
}
const rk_gguf *rk_model_gguf(const rk_model *m) { return m->gguf; }
rk_backend *rk_model_backend(const rk_model *m) { return m->be; }
const char *rk_model_fingerprint(const rk_model *m) { return m->fingerprint; }
size_t rk_model_weight_bytes(const rk_model *m) { return m->weight_bytes; }

/* ---------------------------------------------------------------- forward */

static rk_status scratch_reserve(rk_model *m, int n, int n_logits, int n_table) {
    rk_scratch *s = &m->s;
    if (n <= s->cap && n_logits <= s->cap_logits && n_table <= s->cap_blocks) return RK_OK;
    int cap = n > s->cap ? n : s->cap;
    int cap_l = n_logits > s->cap_logits ? n_logits : s->cap_logits;
    int cap_b = n_table > s->cap_blocks ? n_table : s->cap_blocks;
    scratch_free(m);
    const rk_hparams *hp = &m->hp;
    size_t q_dim = (size_t)hp->n_heads * hp->head_dim,
           kv_dim = (size_t)hp->n_kv_heads * hp->head_dim;
    /* the widest fused output, for as many rows as a fused matrix is used whole */
    size_t fused_cols =
        q_dim + 2 * kv_dim > 2 * (size_t)hp->ffn_dim ? q_dim + 2 * kv_dim : 2 * (size_t)hp->ffn_dim;
    size_t fused_rows = m->has_fused ? (size_t)cap : 1;
    struct {
        void **p;
        size_t bytes;
    } want[] = {
        {(void **)&s->x, (size_t)cap * hp->dim * 4},
        {(void **)&s->xb, (size_t)cap * hp->dim * 4},
        {(void **)&s->q, (size_t)cap * q_dim * 4},
        {(void **)&s->att, (size_t)cap * q_dim * 4},
        {(void **)&s->k, (size_t)cap * kv_dim * 4},
        {(void **)&s->v, (size_t)cap * kv_dim * 4},
        {(void **)&s->hb, (size_t)cap * hp->ffn_dim * 4},
        {(void **)&s->hb2, (size_t)cap * hp->ffn_dim * 4},
        {(void **)&s->fused, fused_rows * fused_cols * 4},
        {(void **)&s->xl, (size_t)(cap_l ? cap_l : 1) * hp->dim * 4},
        {(void **)&s->logits, (size_t)(cap_l ? cap_l : 1) * hp->n_vocab * 4},
        {(void **)&s->tokens, (size_t)cap * 4},
        {(void **)&s->pos, (size_t)cap * 4},
        {(void **)&s->slots, (size_t)cap * 4},
        {(void **)&s->table, (size_t)(cap_b ? cap_b : 1) * 4},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        rk_status st = m->be->ops->alloc(m->be, want[i].bytes, want[i].p);
        if (st) {
            scratch_free(m);
            return rk_errorf(st, "model: cannot allocate %zu bytes of activations for %d tokens",
                             want[i].bytes, cap);
        }
    }
    s->cap = cap;
    s->cap_logits = cap_l;
    s->cap_blocks = cap_b;
    return RK_OK;
}

static rk_status check_batch(const rk_model *m, const rk_kv_cache *kv, const rk_batch *b) {
    const rk_hparams *hp = &m->hp;
    if (b->n_tokens < 1 || b->attn.n_seqs < 1 || b->n_logits < 0)
        return rk_errorf(RK_ERR_INVALID, "forward: empty batch");
    if (kv->n_layers != hp->n_kv_layers || kv->n_kv_heads != hp->n_kv_heads ||
        kv->head_dim != hp->head_dim)
        return rk_errorf(RK_ERR_INVALID, "forward: KV cache shape does not match the model");
    if (b->attn.q_start[0] != 0 || b->attn.q_start[b->attn.n_seqs] != b->n_tokens)
        return rk_errorf(RK_ERR_INVALID, "forward: sequences do not cover the batch's tokens");
    for (int i = 0; i < b->n_tokens; i++)
        if (b->tokens[i] < 0 || b->tokens[i] >= hp->n_vocab)
            return rk_errorf(RK_ERR_INVALID, "forward: token id %d out of range [0, %d)",
                             b->tokens[i], hp->n_vocab);
    if (b->n_layers < 0 || b->n_layers > hp->n_layers)
        return rk_errorf(RK_ERR_INVALID, "forward: n_layers %d out of range [0, %d]", b->n_layers,
                         hp->n_layers);
    if (b->n_layers > 0 && b->n_layers < hp->n_layers && b->n_logits > 0)
        return rk_errorf(RK_ERR_INVALID, "forward: logits need every layer");
    for (int i = 0; i < b->n_logits; i++)
        if (b->logit_rows[i] < 0 || b->logit_rows[i] >= b->n_tokens)
            return rk_errorf(RK_ERR_INVALID, "forward: logit row %d out of range",
                             b->logit_rows[i]);
    return RK_OK;
}

static rk_status matmul(rk_model *m, float *y, const float *x, const rk_matrix *w, int n) {
    if (w->packed)
        return m->be->ops->matmul_packed(m->be, y, x, w->packed, w->type, n, w->cols, w->rows);
    return m->be->ops->matmul(m->be, y, x, w->w, w->type, n, w->cols, w->rows);
}

/* Rows of x up to which a fused matrix is multiplied whole and its output
 * split by copying; above, each part's rows are multiplied on their own
 * (the split would copy more than a compute-bound pass gains). */
#define FUSED_WHOLE_MAX_N 16

/* out[i](n, widths[i]) = x . the parts of the fused matrix w (fuse_mats). */
static rk_status matmul_fused(rk_model *m, const rk_matrix *w, const float *x, int n, float *out[],
                              const int widths[], int n_out) {
    const rk_backend_ops *ops = m->be->ops;
    if (!w->packed) { /* fused in the file, not packed: each part is a range of its rows */
        size_t row_bytes = rk_dtype_row_bytes(w->type, (size_t)w->cols);
        for (int i = 0, r = 0; i < n_out; r += widths[i], i++) {
            rk_status st = ops->matmul(m->be, out[i], x, (const char *)w->w + (size_t)r * row_bytes,
                                       w->type, n, w->cols, widths[i]);
            if (st) return st;
        }
        return RK_OK;
    }
    size_t off[3];
    int apart = n > FUSED_WHOLE_MAX_N && ops->packed_offset && n_out <= 3;
    for (int i = 0, r = 0; apart && i < n_out; r += widths[i], i++)
        apart = (off[i] = ops->packed_offset(m->be, w->type, w->cols, r)) != SIZE_MAX;
    if (apart) {
        for (int i = 0; i < n_out; i++) {
            rk_status st = ops->matmul_packed(m->be, out[i], x, (const char *)w->packed + off[i],
                                              w->type, n, w->cols, widths[i]);
            if (st) return st;
        }
        return RK_OK;
    }
    rk_status st = matmul(m, m->s.fused, x, w, n);
    if (st) return st;
    for (int r = 0; r < n; r++)
        for (int i = 0, c = 0; i < n_out; c += widths[i], i++)
            memcpy(out[i] + (size_t)r * widths[i], m->s.fused + (size_t)r * w->rows + c,
                   (size_t)widths[i] * sizeof(float));
    return RK_OK;
}

rk_status rk_model_forward(rk_model *m, const rk_kv_cache *kv, const rk_batch *b,
                           float *out_logits) {
    rk_status st = check_batch(m, kv, b);
    if (st) return st;
    const rk_hparams *hp = &m->hp;
    const rk_backend_ops *ops = m->be->ops;
    rk_backend *be = m->be;
    int n = b->n_tokens, n_table = b->attn.n_seqs * b->attn.max_blocks;
    if ((st = scratch_reserve(m, n, b->n_logits, n_table))) return st;
    rk_scratch *s = &m->s;
    if ((st = ops->upload(be, s->tokens, b->tokens, (size_t)n * 4)) ||
        (st = ops->upload(be, s->pos, b->pos, (size_t)n * 4)) ||
        (st = ops->upload(be, s->slots, b->slots, (size_t)n * 4)) ||
        (st = ops->upload(be, s->table, b->attn.block_table, (size_t)n_table * 4)))
        return st;
    rk_attn_batch attn = b->attn;
    attn.block_table = s->table;

#define CK(call)                                                                                   \
    do {                                                                                           \
        if ((st = (call))) return st;                                                              \
    } while (0)
    CK(ops->embed(be, s->x, m->embd, m->embd_type, s->tokens, n, hp->dim));
    if (hp->desc->embd_scale_sqrt) /* after the lookup, in f32, as the reference engine */
        CK(ops->scale(be, s->x, sqrtf((float)hp->dim), (size_t)n * hp->dim));
    if (m->ple_embd) CK(rk_gemma4_ple_inputs(m, s->tokens, n));
    int n_layers = b->n_layers > 0 ? b->n_layers : hp->n_layers;
    for (int l = 0; l < n_layers; l++) {
        const rk_layer *L = &m->layers[l];
        const int hd = L->head_dim, q_dim = hp->n_heads * hd, kv_dim = hp->n_kv_heads * hd;
        CK(ops->rmsnorm(be, s->xb, s->x, L->attn_norm, n, hp->dim, hp->rms_eps));
        if (L->qkv.rows) {
            float *out[] = {s->q, s->k, s->v};
            const int widths[] = {q_dim, kv_dim, kv_dim};
            CK(matmul_fused(m, &L->qkv, s->xb, n, out, widths, 3));
        } else {
            CK(matmul(m, s->q, s->xb, &L->wq, n));
            if (L->wk.rows) CK(matmul(m, s->k, s->xb, &L->wk, n));
            if (L->wv.rows)
                CK(matmul(m, s->v, s->xb, &L->wv, n));
            else if (L->wk.rows) /* V = K before its norm (gemma4 without attn_v; host) */
                memcpy(s->v, s->k, (size_t)n * kv_dim * sizeof(float));
        }
        if (L->bq) CK(ops->add_bias(be, s->q, L->bq, n, q_dim));
        if (L->bk) CK(ops->add_bias(be, s->k, L->bk, n, kv_dim));
        if (L->bv) CK(ops->add_bias(be, s->v, L->bv, n, kv_dim));
        if (L->q_norm)
            CK(ops->rmsnorm(be, s->q, s->q, L->q_norm, n * hp->n_heads, hd, hp->rms_eps));
        if (L->k_norm)
            CK(ops->rmsnorm(be, s->k, s->k, L->k_norm, n * hp->n_kv_heads, hd, hp->rms_eps));
        if (hp->desc->v_norm && L->owns_kv)
            CK(ops->rmsnorm(be, s->v, s->v, m->ones, n * hp->n_kv_heads, hd, hp->rms_eps));
        if (hd < hp->head_dim) { /* zero-padded to the KV cache's heads (gemma4; host) */
            rk_gemma4_widen(s->q, n * hp->n_heads, hd, hp->head_dim);
            if (L->owns_kv) {
                rk_gemma4_widen(s->k, n * hp->n_kv_heads, hd, hp->head_dim);
                rk_gemma4_widen(s->v, n * hp->n_kv_heads, hd, hp->head_dim);
            }
        }
        const rk_rope *rope = m->layer_rope[l];
        CK(ops->rope(be, s->q, s->pos, n, hp->n_heads, hp->head_dim, rope));
        if (b->out_q && l == n_layers - 1)
            CK(ops->download(be, b->out_q, s->q,
                             (size_t)n * hp->n_heads * hp->head_dim * sizeof(float)));
        if (L->owns_kv) { /* else the layer attends over an earlier layer's KV, as it is */
            CK(ops->rope(be, s->k, s->pos, n, hp->n_kv_heads, hp->head_dim, rope));
            CK(ops->kv_write(be, kv, L->kv_layer, s->k, s->v, s->slots, n));
        }
        rk_attn_params ap = rk_model_attn_params(m, l);
        if (attn.seg_start) attn.rope = rope; /* segments rotate with the layer's own */
        CK(ops->attention(be, s->att, NULL, s->q, kv, L->kv_layer, &attn, hp->n_heads, &ap));
        if (hd < hp->head_dim) rk_gemma4_narrow(s->att, n * hp->n_heads, hp->head_dim, hd);
        CK(matmul(m, s->xb, s->att, &L->wo, n));
        if (L->bo) CK(ops->add_bias(be, s->xb, L->bo, n, hp->dim));
        if (L->post_attn_norm)
            CK(ops->rmsnorm(be, s->xb, s->xb, L->post_attn_norm, n, hp->dim, hp->rms_eps));
        CK(ops->add(be, s->x, s->xb, (size_t)n * hp->dim));
        CK(ops->rmsnorm(be, s->xb, s->x, L->ffn_norm, n, hp->dim, hp->rms_eps));
        if (L->moe.gate) { /* x += the chosen experts' weighted sum */
            CK(rk_moe_ffn(be, &L->moe, s->xb, s->x, n, &m->moe_s));
            continue;
        }
        if (L->gate_up.rows) {
            float *out[] = {s->hb, s->hb2};
            const int widths[] = {L->ffn_dim, L->ffn_dim};
            CK(matmul_fused(m, &L->gate_up, s->xb, n, out, widths, 2));
        } else {
            CK(matmul(m, s->hb, s->xb, &L->gate, n));
            CK(matmul(m, s->hb2, s->xb, &L->up, n));
        }
        if (hp->desc->act == RK_FFN_GELU_TANH)
            CK(ops->geglu(be, s->hb, s->hb, s->hb2, (size_t)n * L->ffn_dim));
        else
            CK(ops->swiglu(be, s->hb, s->hb, s->hb2, (size_t)n * L->ffn_dim));
        CK(matmul(m, s->xb, s->hb, &L->down, n));
        if (L->post_ffn_norm)
            CK(ops->rmsnorm(be, s->xb, s->xb, L->post_ffn_norm, n, hp->dim, hp->rms_eps));
        CK(ops->add(be, s->x, s->xb, (size_t)n * hp->dim));
        if (hp->desc->per_layer_embd || hp->desc->layer_out_scale) CK(rk_gemma4_layer_out(m, l, n));
    }
    /* Without logits nothing is downloaded: sync, so an error the device
     * found in this pass is reported by this pass. */
    if (b->n_logits == 0) return ops->sync(be);
    for (int i = 0; i < b->n_logits; i++)
        CK(ops->rmsnorm(be, s->xl + (size_t)i * hp->dim, s->x + (size_t)b->logit_rows[i] * hp->dim,
                        m->out_norm, 1, hp->dim, hp->rms_eps));
    if (b->hidden) /* embeddings: the normed hidden states themselves */
        return ops->download(be, out_logits, s->xl, (size_t)b->n_logits * hp->dim * 4);
    CK(matmul(m, s->logits, s->xl, &m->out, b->n_logits));
    CK(ops->download(be, out_logits, s->logits, (size_t)b->n_logits * hp->n_vocab * 4));
    if (hp->final_softcap > 0) { /* as the reference: scale by 1 / cap, tanh, scale by cap */
        float cap = hp->final_softcap, inv = 1.0f / cap;
        for (size_t i = 0; i < (size_t)b->n_logits * hp->n_vocab; i++)
            out_logits[i] = tanhf(out_logits[i] * inv) * cap;
    }
#undef CK
    return RK_OK;
}
