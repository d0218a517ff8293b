/* engine/model_gemma4.c — what Gemma 4 adds to the forward pass (arch.h):
 * per-layer layer kinds read from an array, layers that reuse an earlier
 * layer's KV, and per-layer token embeddings.
 *
 * Per-layer embeddings, for a batch of n tokens (ple = the per-layer width,
 * L = n_layers, e = the scaled token embeddings):
 *   in[t, l] = (rmsnorm(e[t] · Wproj / sqrt(dim))[l] · proj_norm
 *               + tbl[tok[t]][l] * sqrt(ple)) / sqrt(2)
 * and after layer l's FFN:
 *   x += rmsnorm((gelu(x · Wgate_l) * in[., l]) · Wproj_l) · post_norm_l
 *   x *= out_scale_l (where the file has layer_output_scale; else 1)
 * Host memory only: the family is refused on other backends. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model_internal.h"

static rk_status get_u32_key(rk_model *m, const char *suffix, uint32_t def, int *out) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", m->hp.arch_name, suffix);
    uint32_t v;
    rk_status st = rk_gguf_get_u32(m->gguf, key, &v);
    if (st == RK_ERR_NOT_FOUND)
        v = def;
    else if (st)
        return st;
    if (v > (1u << 30)) return rk_errorf(RK_ERR_FORMAT, "model: %s = %u is out of range", key, v);
    *out = (int)v;
    return RK_OK;
}

/* Each layer's kind from the bool array <arch>.attention.sliding_window_pattern. */
static rk_status read_kinds(rk_model *m) {
    rk_hparams *hp = &m->hp;
    char key[128];
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", hp->arch_name);
    int32_t *a;
    size_t n;
    rk_status st = rk_gguf_get_arr_i32(m->gguf, key, &a, &n);
    if (st == RK_ERR_NOT_FOUND) return rk_errorf(RK_ERR_FORMAT, "model: %s is missing", key);
    if (st) return st;
    if ((int64_t)n != hp->n_layers) {
        free(a);
        return rk_errorf(RK_ERR_FORMAT, "model: %s has %zu entries for %d layers", key, n,
                         hp->n_layers);
    }
    m->slides = malloc((size_t)hp->n_layers);
    if (!m->slides) {
        free(a);
        return rk_errorf(RK_ERR_NOMEM, "model: out of memory");
    }
    for (int l = 0; l < hp->n_layers; l++) m->slides[l] = a[l] != 0;
    free(a);
    return RK_OK;
}

rk_status rk_gemma4_read_hparams(rk_model *m) {
    rk_hparams *hp = &m->hp;
    const char *arch = hp->arch_name;
    rk_status st;
    if (hp->desc->cpu_only && strcmp(m->be->name, "cpu") != 0)
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "model: %s (per-layer embeddings, layers sharing KV) is computed on the "
                         "cpu backend only, not on %s",
                         arch, m->be->name);
    /* The mixture-of-experts variant (26B-A4B) has a dense FFN beside its
     * experts: computing the dense one alone would be silently wrong. */
    int n_expert;
    if ((st = get_u32_key(m, "expert_count", 0, &n_expert))) return st;
    if (n_expert > 0 || rk_gguf_find_tensor(m->gguf, "blk.0.ffn_gate_inp.weight"))
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "model: %s with experts (%s.expert_count %d) is not computed: ragkv "
                         "computes the dense Gemma 4 models",
                         arch, arch, n_expert);
    if (hp->desc->swa_pattern_arr && (st = read_kinds(m))) return st;
    /* The sliding layers' head size: the KV cache's rows are the larger
     * of the two kinds', the smaller zero-padded (model_internal.h). */
    int k_swa, v_swa, shared;
    if ((st = get_u32_key(m, "attention.key_length_swa", (uint32_t)hp->head_dim, &k_swa)) ||
        (st = get_u32_key(m, "attention.value_length_swa", (uint32_t)k_swa, &v_swa)))
        return st;
    if (k_swa != v_swa || k_swa < 2 || k_swa > 2 * RK_ROPE_MAX_PAIRS ||
        (k_swa != hp->head_dim && !hp->desc->attn_unscaled))
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "model: %s.attention.key_length_swa %d / value_length_swa %d not "
                         "supported (key_length %d)",
                         arch, k_swa, v_swa, hp->head_dim);
    m->head_dim_swa = k_swa;
    m->head_dim_global = hp->head_dim;
    /* The sliding layers' rotated dims (the global ones: rope.dimension_count). */
    int n_rot_swa;
    if ((st = get_u32_key(m, "rope.dimension_count_swa", (uint32_t)hp->rope.n_rot, &n_rot_swa)))
        return st;
    if (n_rot_swa < 2 || n_rot_swa > k_swa || n_rot_swa % 2)
        return rk_errorf(RK_ERR_FORMAT,
                         "model: %s.rope.dimension_count_swa = %d is invalid (even, 2..%d)", arch,
                         n_rot_swa, k_swa);
    hp->rope_swa.n_rot = n_rot_swa;
    if ((st = rk_rope_init(&m->rope_swa, &hp->rope_swa))) return st;
    if ((st = get_u32_key(m, "embedding_length_per_layer_input", 0, &hp->n_embd_per_layer)))
        return st;
    /* Shared KV: the last `shared` layers attend over the KV of layer
     * n_kv - 2 (sliding) or n_kv - 1 (global), as the reference engine maps
     * them; that layer must be of the same kind. */
    if ((st = get_u32_key(m, "attention.shared_kv_layers", 0, &shared))) return st;
    int n_kv = hp->n_layers - shared;
    if (shared > 0 && n_kv < 2)
        return rk_errorf(RK_ERR_FORMAT,
                         "model: %s.attention.shared_kv_layers = %d leaves fewer than 2 of %d "
                         "layers with KV",
                         arch, shared, hp->n_layers);
    for (int l = n_kv; l < hp->n_layers; l++) {
        int src = n_kv - (rk_model_slides(m, l) ? 2 : 1);
        if (rk_model_slides(m, src) != rk_model_slides(m, l))
            return rk_errorf(RK_ERR_FORMAT,
                             "model: layer %d (%s) would reuse the KV of layer %d, of the other "
                             "kind",
                             l, rk_model_slides(m, l) ? "sliding" : "global", src);
    }
    hp->n_kv_layers = n_kv;
    if (k_swa > hp->head_dim) hp->head_dim = k_swa; /* the KV cache's head size */
    return RK_OK;
}

void rk_gemma4_widen(float *x, int rows, int from, int to) {
    for (int r = rows - 1; r >= 0; r--) { /* last row first: each moves up or stays */
        memmove(x + (size_t)r * to, x + (size_t)r * from, (size_t)from * sizeof *x);
        memset(x + (size_t)r * to + from, 0, (size_t)(to - from) * sizeof *x);
    }
}

void rk_gemma4_narrow(float *x, int rows, int from, int to) {
    for (int r = 0; r < rows; r++)
        memmove(x + (size_t)r * to, x + (size_t)r * from, (size_t)to * sizeof *x);
}

/* A norm weight of n floats (F32 in every file the reference converter writes). */
static rk_status f32_vec(rk_model *m, const char *name, int64_t n, int optional,
                         const float **out) {
    const rk_gguf_tensor *t = rk_gguf_find_tensor(m->gguf, name);
    *out = NULL;
    if (!t) return optional ? RK_OK : rk_errorf(RK_ERR_FORMAT, "model: tensor %s is missing", name);
    if (t->type != RK_GGML_F32 || t->ne[0] != n || t->ne[1] != 1 || t->ne[2] != 1)
        return rk_errorf(RK_ERR_FORMAT, "model: tensor %s should be F32 {%lld}", name,
                         (long long)n);
    if (rk_gguf_tensor_first_nonfinite(t) >= 0)
        return rk_errorf(RK_ERR_FORMAT, "model: tensor %s has a non-finite value", name);
    *out = t->data;
    return RK_OK;
}

/* A matrix (rows, cols) as stored, computed by the backend's unpacked matmul. */
static rk_status stored_mat(rk_model *m, const char *name, int rows, int cols, rk_matrix *out) {
    const rk_gguf_tensor *t = rk_gguf_find_tensor(m->gguf, name);
    if (!t) return rk_errorf(RK_ERR_FORMAT, "model: tensor %s is missing", name);
    if (t->ne[0] != cols || t->ne[1] != rows || t->ne[2] != 1 || t->ne[3] != 1)
        return rk_errorf(RK_ERR_FORMAT,
                         "model: tensor %s has shape {%lld, %lld}, expected {%d, %d}", name,
                         (long long)t->ne[0], (long long)t->ne[1], cols, rows);
    rk_dtype dt;
    switch (t->type) {
    case RK_GGML_F32: dt = RK_DTYPE_F32; break;
    case RK_GGML_F16: dt = RK_DTYPE_F16; break;
    case RK_GGML_BF16: dt = RK_DTYPE_BF16; break;
    case RK_GGML_Q8_0: dt = RK_DTYPE_Q8_0; break;
    case RK_GGML_Q4_0: dt = RK_DTYPE_Q4_0; break;
    case RK_GGML_Q4_1: dt = RK_DTYPE_Q4_1; break;
    case RK_GGML_Q5_0: dt = RK_DTYPE_Q5_0; break;
    case RK_GGML_Q5_1: dt = RK_DTYPE_Q5_1; break;
    case RK_GGML_Q4_K: dt = RK_DTYPE_Q4_K; break;
    case RK_GGML_Q5_K: dt = RK_DTYPE_Q5_K; break;
    case RK_GGML_Q6_K: dt = RK_DTYPE_Q6_K; break;
    default:
        return rk_errorf(RK_ERR_UNSUPPORTED, "model: tensor %s has type %s", name,
                         rk_ggml_type_name(t->type));
    }
    *out = (rk_matrix){t->data, NULL, dt, rows, cols};
    m->weight_bytes += t->n_bytes;
    return RK_OK;
}

rk_status rk_gemma4_load(rk_model *m) {
    const rk_hparams *hp = &m->hp;
    const int ple = hp->n_embd_per_layer, nl = hp->n_layers;
    rk_status st;
    char name[96];
    float *ones = malloc((size_t)hp->head_dim * sizeof *ones);
    if (!ones) return rk_errorf(RK_ERR_NOMEM, "model: out of memory");
    for (int i = 0; i < hp->head_dim; i++) ones[i] = 1.0f;
    m->ones = ones;
    for (int l = 0; l < nl; l++) {
        rk_layer *L = &m->layers[l];
        const float *scale;
        snprintf(name, sizeof name, "blk.%d.layer_output_scale.weight", l);
        if (hp->desc->layer_out_scale && (st = f32_vec(m, name, 1, 1, &scale))) return st;
        L->out_scale = hp->desc->layer_out_scale && scale ? scale[0] : 1.0f;
        if (ple == 0) continue;
        snprintf(name, sizeof name, "blk.%d.inp_gate.weight", l);
        if ((st = stored_mat(m, name, ple, hp->dim, &L->ple_gate))) return st;
        snprintf(name, sizeof name, "blk.%d.proj.weight", l);
        if ((st = stored_mat(m, name, hp->dim, ple, &L->ple_proj))) return st;
        snprintf(name, sizeof name, "blk.%d.post_norm.weight", l);
        if ((st = f32_vec(m, name, hp->dim, 0, &L->ple_norm))) return st;
    }
    if (ple == 0) return RK_OK;
    const rk_gguf_tensor *t = rk_gguf_find_tensor(m->gguf, "per_layer_token_embd.weight");
    if (!t) return rk_errorf(RK_ERR_FORMAT, "model: tensor per_layer_token_embd.weight is missing");
    if (t->ne[0] != (int64_t)ple * nl || t->ne[1] != hp->n_vocab || t->ne[2] != 1)
        return rk_errorf(RK_ERR_FORMAT,
                         "model: per_layer_token_embd.weight has shape {%lld, %lld}, expected "
                         "{%d, %d}",
                         (long long)t->ne[0], (long long)t->ne[1], ple * nl, hp->n_vocab);
    rk_matrix tbl;
    /* the table's rows are read one token at a time, like token_embd's */
    if ((st = stored_mat(m, "per_layer_token_embd.weight", hp->n_vocab, ple * nl, &tbl))) return st;
    m->weight_bytes -= t->n_bytes;
    m->ple_embd = tbl.w;
    m->ple_type = tbl.type;
    if ((st =
             stored_mat(m, "per_layer_model_proj.weight", ple * nl, hp->dim, &m->ple_model_proj)) ||
        (st = f32_vec(m, "per_layer_proj_norm.weight", ple, 0, &m->ple_proj_norm)))
        return st;
    return RK_OK;
}

static rk_status reserve(rk_model *m, int n) {
    if (n <= m->ple_cap) return RK_OK;
    /* ple_tmp also holds a layer's gate and inputs, 2 n ple */
    size_t floats = (size_t)n * (m->hp.n_layers > 2 ? m->hp.n_layers : 2) * m->hp.n_embd_per_layer;
    float *a = malloc(floats * sizeof *a), *b = malloc(floats * sizeof *b);
    if (!a || !b) {
        free(a);
        free(b);
        return rk_errorf(RK_ERR_NOMEM, "model: out of memory for %d tokens' per-layer inputs", n);
    }
    free(m->ple_in);
    free(m->ple_tmp);
    m->ple_in = a;
    m->ple_tmp = b;
    m->ple_cap = n;
    return RK_OK;
}

static rk_status mat(rk_model *m, float *y, const float *x, const rk_matrix *w, int n) {
    return m->be->ops->matmul(m->be, y, x, w->w, w->type, n, w->cols, w->rows);
}

rk_status rk_gemma4_ple_inputs(rk_model *m, const int32_t *tokens, int n) {
    const rk_hparams *hp = &m->hp;
    if (!m->ple_embd) return RK_OK;
    const rk_backend_ops *ops = m->be->ops;
    rk_backend *be = m->be;
    const int ple = hp->n_embd_per_layer, w = ple * hp->n_layers;
    const size_t all = (size_t)n * w;
    rk_status st;
    if ((st = reserve(m, n)) || (st = mat(m, m->ple_in, m->s.x, &m->ple_model_proj, n)) ||
        (st = ops->scale(be, m->ple_in, 1.0f / sqrtf((float)hp->dim), all)) ||
        (st = ops->rmsnorm(be, m->ple_in, m->ple_in, m->ple_proj_norm, n * hp->n_layers, ple,
                           hp->rms_eps)) ||
        (st = ops->embed(be, m->ple_tmp, m->ple_embd, m->ple_type, tokens, n, w)) ||
        (st = ops->scale(be, m->ple_tmp, sqrtf((float)ple), all)) ||
        (st = ops->add(be, m->ple_in, m->ple_tmp, all)))
        return st;
    return ops->scale(be, m->ple_in, 1.0f / sqrtf(2.0f), all);
}

rk_status rk_gemma4_layer_out(rk_model *m, int l, int n) {
    const rk_hparams *hp = &m->hp;
    const rk_layer *L = &m->layers[l];
    const rk_backend_ops *ops = m->be->ops;
    rk_backend *be = m->be;
    rk_status st;
    if (L->ple_gate.rows) {
        const int ple = hp->n_embd_per_layer;
        float *g = m->ple_tmp, *in = m->ple_tmp + (size_t)n * ple;
        for (int t = 0; t < n; t++) /* this layer's inputs, contiguous */
            memcpy(in + (size_t)t * ple, m->ple_in + ((size_t)t * hp->n_layers + l) * ple,
                   (size_t)ple * sizeof *in);
        if ((st = mat(m, g, m->s.x, &L->ple_gate, n)) ||
            (st = ops->geglu(be, g, g, in, (size_t)n * ple)) ||
            (st = mat(m, m->s.xb, g, &L->ple_proj, n)) ||
            (st = ops->rmsnorm(be, m->s.xb, m->s.xb, L->ple_norm, n, hp->dim, hp->rms_eps)) ||
            (st = ops->add(be, m->s.x, m->s.xb, (size_t)n * hp->dim)))
            return st;
    }
    if (L->out_scale != 1.0f) return ops->scale(be, m->s.x, L->out_scale, (size_t)n * hp->dim);
    return RK_OK;
}

void rk_gemma4_free(rk_model *m) {
    free(m->ple_in);
    free(m->ple_tmp);
    free((void *)m->ones);
    free(m->slides);
    free(m->ffn_of);
}
