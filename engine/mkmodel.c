/* engine/mkmodel.c — synthetic GGUF models (see mkmodel.h).
 *
 * A preset fixes the architecture and shapes; the vocabulary comes from
 * mkmodel_vocab.c (the built-in tiny one, or a family's real tokenizer.json).
 * The writer gets every key and tensor declaration up front and asks the fill
 * callback below for each tensor's bytes while it writes, so no weights are
 * held in memory beyond the output itself. */
#include "engine/mkmodel_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "engine/tokenizer.h"
#include "kernels/kernels.h"

/* Fill opts with the defaults; see mkmodel.h. */
void rk_mkmodel_opts_default(rk_mkmodel_opts *opts) {
    memset(opts, 0, sizeof *opts);
    opts->preset = "tiny";
    opts->wtype = RK_GGML_F32;
    opts->vocab_path = NULL;
    opts->seed = 42;
}

/* The weight type names, as `--type` takes them, and general.file_type
 * (llama.cpp's LLAMA_FTYPE numbering) for each. */
static const struct {
    const char *name;
    rk_ggml_type type;
    uint32_t file_type;
} k_wtypes[] = {
    {"f32", RK_GGML_F32, 0},      {"f16", RK_GGML_F16, 1},        {"bf16", RK_GGML_BF16, 32},
    {"q8_0", RK_GGML_Q8_0, 7},    {"q4_0", RK_GGML_Q4_0, 2},      {"q4_k_m", RK_GGML_Q4_K, 15},
    {"q5_k_m", RK_GGML_Q5_K, 17}, {"q6_k", RK_GGML_Q6_K, 18},     {"q3_k_m", RK_GGML_Q3_K, 12},
    {"q2_k", RK_GGML_Q2_K, 10},   {"iq4_xs", RK_GGML_IQ4_XS, 30}, {"mxfp4", RK_GGML_MXFP4, 38}};
#define N_WTYPES (sizeof k_wtypes / sizeof k_wtypes[0])

/* Parse a weight type name; see mkmodel.h. */
rk_status rk_mkmodel_parse_wtype(const char *name, rk_ggml_type *out) {
    if (name) {
        for (size_t i = 0; i < N_WTYPES; i++)
            if (strcasecmp(name, k_wtypes[i].name) == 0) {
                *out = k_wtypes[i].type;
                return RK_OK;
            }
    }
    return rk_errorf(RK_ERR_INVALID,
                     "mkmodel: unknown weight type '%s' (f32, f16, bf16, q8_0, q4_0, q4_k_m, "
                     "q5_k_m, q6_k, q3_k_m, q2_k, iq4_xs)",
                     name ? name : "(null)");
}

/* The compute dtype of a tensor type the generator writes. */
static rk_dtype mk_dtype(rk_ggml_type t) {
    switch (t) {
    case RK_GGML_F16: return RK_DTYPE_F16;
    case RK_GGML_BF16: return RK_DTYPE_BF16;
    case RK_GGML_Q8_0: return RK_DTYPE_Q8_0;
    case RK_GGML_Q4_0: return RK_DTYPE_Q4_0;
    case RK_GGML_Q4_K: return RK_DTYPE_Q4_K;
    case RK_GGML_Q5_K: return RK_DTYPE_Q5_K;
    case RK_GGML_Q6_K: return RK_DTYPE_Q6_K;
    case RK_GGML_Q5_0: return RK_DTYPE_Q5_0;
    case RK_GGML_Q5_1: return RK_DTYPE_Q5_1;
    case RK_GGML_Q2_K: return RK_DTYPE_Q2_K;
    case RK_GGML_Q3_K: return RK_DTYPE_Q3_K;
    case RK_GGML_IQ4_NL: return RK_DTYPE_IQ4_NL;
    case RK_GGML_IQ4_XS: return RK_DTYPE_IQ4_XS;
    case RK_GGML_MXFP4: return RK_DTYPE_MXFP4;
    default: return RK_DTYPE_F32;
    }
}

/* ================================================================ weights */

typedef enum init_kind {
    INIT_MATRIX,  /* uniform, std 1/sqrt(ne[0]) */
    INIT_NORM,    /* 1 + U(-0.05, 0.05) */
    INIT_BIAS,    /* uniform, std 0.02 */
    INIT_LONG,    /* LongRoPE long factors: U(1, 8) */
    INIT_ROWS,    /* rows rows[] of the INIT_MATRIX tensor src with the same ne[0] */
    INIT_PARTIAL, /* proportional RoPE divisors: rows[0] ones, then 1e30 */
    INIT_QK_NORM, /* INIT_NORM times ne[0]^-1/4: q·k of unscaled attention as if scaled */
} init_kind;

typedef struct mk_tensor {
    char name[64];
    init_kind kind;
    rk_ggml_type type;
    uint32_t n_dims;
    int64_t ne[3];   /* ne[2]: experts of a stacked expert tensor, else 1 */
    const char *src; /* INIT_ROWS: the tensor whose rows these are */
    int32_t rows[2]; /* INIT_ROWS: which (ne[1] of them) */
} mk_tensor;

typedef struct mk_fill_ctx {
    const mk_tensor *tensors;
    uint64_t seed;
} mk_fill_ctx;

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

typedef struct xoshiro {
    uint64_t s[4];
} xoshiro;

static inline uint64_t rotl64(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* xoshiro256** (Blackman and Vigna). */
static inline uint64_t xo_next(xoshiro *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl64(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return result;
}

/* Seed a generator from the model seed and the tensor name (FNV-1a). */
static void xo_seed(xoshiro *r, uint64_t seed, const char *name) {
    uint64_t h = 0xCBF29CE484222325ull;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++)
        h = (h ^ *p) * 0x100000001B3ull;
    uint64_t sm = seed ^ rotl64(h, 29);
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&sm);
}

#define FILL_CHUNK 4096 /* values generated per step; even */

/* Fill callback for the GGUF writer: generate tensor i's values in chunks
 * and store them in its type. */
static rk_status mk_fill(void *ctx, int64_t index, void *dst, size_t n_bytes) {
    const mk_fill_ctx *fc = ctx;
    const mk_tensor *t = &fc->tensors[index];
    size_t n = (size_t)t->ne[0] * (size_t)t->ne[1] * (size_t)t->ne[2];
    rk_dtype dt = mk_dtype(t->type);
    if (rk_dtype_row_bytes(dt, n) != n_bytes)
        return rk_errorf(RK_ERR_INTERNAL, "mkmodel: tensor %s: %zu bytes requested, %zu expected",
                         t->name, n_bytes, rk_dtype_row_bytes(dt, n));
    float scale, bias = 0.0f;
    switch (t->kind) {
    case INIT_MATRIX:
    case INIT_ROWS: scale = sqrtf(3.0f / (float)t->ne[0]); break;
    case INIT_NORM:
        scale = 0.05f;
        bias = 1.0f;
        break;
    case INIT_QK_NORM:
        bias = 1.0f / sqrtf(sqrtf((float)t->ne[0]));
        scale = 0.05f * bias;
        break;
    case INIT_LONG:
        scale = 3.5f;
        bias = 4.5f;
        break;
    default: scale = 0.02f * sqrtf(3.0f); break;
    }
    scale *= 0x1p-31f;             /* int32 -> [-1, 1) */
    if (t->kind == INIT_PARTIAL) { /* a vector, F32 */
        float *f = dst;
        for (int64_t i = 0; i < t->ne[0]; i++) f[i] = i < t->rows[0] ? 1.0f : 1e30f;
        return RK_OK;
    }
    xoshiro r;
    xo_seed(&r, fc->seed, t->kind == INIT_ROWS ? t->src : t->name);
    float buf[FILL_CHUNK];
    uint8_t *out = dst;
    if (t->kind == INIT_ROWS) { /* each row from its place in src's stream (ne[0] even) */
        for (int64_t k = 0; k < t->ne[1]; k++) {
            xo_seed(&r, fc->seed, t->src);
            for (int64_t skip = (int64_t)t->rows[k] * t->ne[0] / 2; skip > 0; skip--) xo_next(&r);
            for (int64_t j = 0; j < t->ne[0]; j += 2) {
                uint64_t x = xo_next(&r);
                buf[j] = (float)(int32_t)(uint32_t)(x >> 32) * scale;
                buf[j + 1] = (float)(int32_t)(uint32_t)x * scale;
            }
            rk_quantize(out + rk_dtype_row_bytes(dt, (size_t)(k * t->ne[0])), buf, dt,
                        (size_t)t->ne[0]);
        }
        return RK_OK;
    }
    for (size_t i = 0; i < n; i += FILL_CHUNK) {
        size_t m = n - i < FILL_CHUNK ? n - i : FILL_CHUNK;
        for (size_t j = 0; j < m; j += 2) {
            uint64_t x = xo_next(&r);
            buf[j] = (float)(int32_t)(uint32_t)(x >> 32) * scale + bias;
            buf[j + 1] = (float)(int32_t)(uint32_t)x * scale + bias; /* j + 1 < FILL_CHUNK */
        }
        /* Chunks are whole blocks (FILL_CHUNK and every row length are
         * multiples of the block), so a chunk converts on its own. */
        rk_quantize(out + rk_dtype_row_bytes(dt, i), buf, dt, m);
    }
    return RK_OK;
}

/* ================================================================ the model */

typedef struct mk_model {
    const preset *p;
    const char *name; /* the preset's name (static) */
    mk_vocab vocab;
    rk_gguf_writer *w;
    mk_tensor *tensors; /* (n_tensors), in declaration order */
    int64_t n_tensors, cap;
} mk_model;

static void mk_model_free(mk_model *m) {
    rk_mk_vocab_free(&m->vocab);
    rk_gguf_writer_free(m->w);
    free(m->tensors);
    memset(m, 0, sizeof *m);
}

/* Declare a tensor to the writer and remember how to fill it: 1-D when ne1
 * is 0, 3-D (a stack of ne2 matrices) when ne2 > 1. */
static rk_status mk_add3(mk_model *m, init_kind kind, rk_ggml_type type, int64_t ne0, int64_t ne1,
                         int64_t ne2, const char *fmt, int layer) {
    if (m->n_tensors == m->cap) {
        int64_t cap = m->cap ? m->cap * 2 : 64;
        mk_tensor *p = realloc(m->tensors, (size_t)cap * sizeof *p);
        if (!p) return rk_errorf(RK_ERR_NOMEM, "mkmodel: out of memory");
        m->tensors = p;
        m->cap = cap;
    }
    mk_tensor *t = &m->tensors[m->n_tensors];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, fmt, layer);
    t->kind = kind;
    t->type = ne1 ? type : RK_GGML_F32; /* 1-D tensors stay F32 */
    t->n_dims = ne2 > 1 ? 3 : ne1 ? 2 : 1;
    t->ne[0] = ne0;
    t->ne[1] = ne1 ? ne1 : 1;
    t->ne[2] = ne2 > 1 ? ne2 : 1;
    rk_status st = rk_gguf_writer_add_tensor(m->w, t->name, t->type, t->n_dims, t->ne);
    if (st) return st;
    m->n_tensors++;
    return RK_OK;
}

static rk_status mk_add(mk_model *m, init_kind kind, rk_ggml_type type, int64_t ne0, int64_t ne1,
                        const char *fmt, int layer) {
    return mk_add3(m, kind, type, ne0, ne1, 1, fmt, layer);
}

static rk_status mk_set_arch_u32(rk_gguf_writer *w, const char *arch, const char *suffix,
                                 uint32_t v) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return rk_gguf_writer_set_u32(w, key, v);
}

static rk_status mk_set_arch_f32(rk_gguf_writer *w, const char *arch, const char *suffix, float v) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return rk_gguf_writer_set_f32(w, key, v);
}

/* Rank presets (pooling 4) are written as the reference converter writes
 * Qwen3-Reranker: the labels of the head cls.output (its rows: "yes", "no")
 * and the prompt a (query, document) pair is scored with. */
#define MK_RERANK_PROMPT                                                                           \
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "    \
    "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"   \
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that "     \
    "answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"                       \
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"

static rk_status mk_rerank_metadata(rk_gguf_writer *w, const char *arch) {
    static const char *const labels[] = {"yes", "no"};
    char key[128];
    snprintf(key, sizeof key, "%s.classifier.output_labels", arch);
    rk_status st = rk_gguf_writer_set_arr_str(w, key, labels, NULL, 2);
    if (!st) st = rk_gguf_writer_set_str(w, "tokenizer.chat_template.rerank", MK_RERANK_PROMPT);
    return st;
}

/* Gemma 4's keys (see gemma4_extra): the layer kinds, the sliding layers'
 * head and RoPE, shared KV, per-layer embeddings, per-layer FFN widths. */
static rk_status mk_gemma4_metadata(mk_model *m, const gemma4_extra *g) {
    const preset *p = m->p;
    rk_gguf_writer *w = m->w;
    const char *a = p->arch;
    char key[128];
    uint8_t swa[128];
    int32_t ffn[128];
    if (p->n_layers > 128) return rk_errorf(RK_ERR_INTERNAL, "mkmodel: too many layers");
    for (int l = 0; l < p->n_layers; l++) {
        swa[l] = l % g->period != g->period - 1;
        ffn[l] = l >= p->n_layers - g->n_shared && g->ffn_shared ? g->ffn_shared : p->ffn_dim;
    }
    rk_status st;
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", a);
    if ((st = rk_gguf_writer_set_arr(w, key, RK_GGUF_BOOL, swa, (size_t)p->n_layers))) return st;
    snprintf(key, sizeof key, "%s.feed_forward_length", a);
    if ((st = rk_gguf_writer_set_arr_i32(w, key, ffn, (size_t)p->n_layers))) return st;
    return (st = mk_set_arch_u32(w, a, "attention.sliding_window", (uint32_t)g->window)) ||
                   (st = mk_set_arch_u32(w, a, "attention.shared_kv_layers",
                                         (uint32_t)g->n_shared)) ||
                   (st = mk_set_arch_u32(w, a, "embedding_length_per_layer_input",
                                         (uint32_t)g->ple)) ||
                   (st = mk_set_arch_u32(w, a, "attention.key_length_swa",
                                         (uint32_t)g->head_dim_swa)) ||
                   (st = mk_set_arch_u32(w, a, "attention.value_length_swa",
                                         (uint32_t)g->head_dim_swa)) ||
                   (st = mk_set_arch_u32(w, a, "rope.dimension_count_swa",
                                         (uint32_t)g->n_rot_swa)) ||
                   (st = mk_set_arch_f32(w, a, "rope.freq_base_swa", g->theta_swa)) ||
                   (st = mk_set_arch_f32(w, a, "final_logit_softcapping", g->final_softcap))
               ? st
               : RK_OK;
}

static rk_status mk_metadata(mk_model *m, const rk_mkmodel_opts *opts) {
    const preset *p = m->p;
    rk_gguf_writer *w = m->w;
    const mk_vocab *mv = &m->vocab;
    const char *a = p->arch;
    char name[96];
    snprintf(name, sizeof name, "ragkv synthetic %s", m->name);
    uint32_t file_type = 0;
    for (size_t i = 0; i < N_WTYPES; i++)
        if (k_wtypes[i].type == opts->wtype) file_type = k_wtypes[i].file_type;
    rk_status st;
    if ((st = rk_gguf_writer_set_str(w, "general.architecture", a)) ||
        (st = rk_gguf_writer_set_str(w, "general.name", name)) ||
        (st = rk_gguf_writer_set_u32(w, "general.file_type", file_type)) ||
        (st = rk_gguf_writer_set_str(w, "ragkv.synthetic.preset", m->name)) ||
        (st = rk_gguf_writer_set_u64(w, "ragkv.synthetic.seed", opts->seed)) ||
        (st = mk_set_arch_u32(w, a, "vocab_size", (uint32_t)mv->n)) ||
        (st = mk_set_arch_u32(w, a, "context_length", (uint32_t)p->n_ctx)) ||
        (st = mk_set_arch_u32(w, a, "embedding_length", (uint32_t)p->dim)) ||
        (st = mk_set_arch_u32(w, a, "block_count", (uint32_t)p->n_layers)) ||
        (!rk_mk_gemma4_of(m->name) &&
         (st = mk_set_arch_u32(w, a, "feed_forward_length", (uint32_t)p->ffn_dim))) ||
        (st = mk_set_arch_u32(w, a, "attention.head_count", (uint32_t)p->n_heads)) ||
        (st = mk_set_arch_u32(w, a, "attention.head_count_kv", (uint32_t)p->n_kv_heads)) ||
        (st = mk_set_arch_u32(w, a, "attention.key_length", (uint32_t)p->head_dim)) ||
        (st = mk_set_arch_u32(w, a, "attention.value_length", (uint32_t)p->head_dim)) ||
        (st = mk_set_arch_f32(w, a, "attention.layer_norm_rms_epsilon", p->eps)) ||
        (st = mk_set_arch_f32(w, a, "rope.freq_base", p->theta)) ||
        (st = mk_set_arch_u32(w, a, "rope.dimension_count",
                              (uint32_t)(p->n_rot ? p->n_rot : p->head_dim))) ||
        (p->pooling > 0 && (st = mk_set_arch_u32(w, a, "pooling_type", (uint32_t)p->pooling))))
        return st;
    if (p->n_expert > 0 &&
        ((st = mk_set_arch_u32(w, a, "expert_count", (uint32_t)p->n_expert)) ||
         (st = mk_set_arch_u32(w, a, "expert_used_count", (uint32_t)p->n_expert_used)) ||
         (st = mk_set_arch_u32(w, a, "expert_feed_forward_length", (uint32_t)p->ffn_exp))))
        return st;
    /* LongRoPE: the attention factor its converter writes, sqrt(1 + ln(s) / ln(orig)). */
    if (p->orig_ctx &&
        ((st = mk_set_arch_u32(w, a, "rope.scaling.original_context_length",
                               (uint32_t)p->orig_ctx)) ||
         (st = mk_set_arch_f32(w, a, "rope.scaling.attn_factor",
                               sqrtf(1.0f + logf((float)p->n_ctx / (float)p->orig_ctx) /
                                                logf((float)p->orig_ctx))))))
        return st;
    if (p->pooling == 4 && (st = mk_rerank_metadata(w, a))) return st;
    if (p->gptoss_window) { /* as the reference converter writes gpt-oss */
        char key[128];
        snprintf(key, sizeof key, "%s.rope.scaling.type", a);
        if ((st = mk_set_arch_u32(w, a, "attention.sliding_window", (uint32_t)p->gptoss_window)) ||
            (st = rk_gguf_writer_set_str(w, key, "yarn")) ||
            (st = mk_set_arch_f32(w, a, "rope.scaling.factor", p->yarn_factor)) ||
            (st = mk_set_arch_u32(w, a, "rope.scaling.original_context_length",
                                  (uint32_t)p->yarn_orig_ctx)))
            return st;
    }
    const gemma_extra *g = rk_mk_gemma_of(m->name);
    if (g && ((st = mk_set_arch_u32(w, a, "attention.sliding_window", (uint32_t)g->window)) ||
              (g->attn_softcap > 0 &&
               (st = mk_set_arch_f32(w, a, "attn_logit_softcapping", g->attn_softcap))) ||
              (g->final_softcap > 0 &&
               (st = mk_set_arch_f32(w, a, "final_logit_softcapping", g->final_softcap)))))
        return st;
    const gemma4_extra *g4 = rk_mk_gemma4_of(m->name);
    if (g4 && (st = mk_gemma4_metadata(m, g4))) return st;
    if (g && g->rope_linear > 0) {
        char key[128];
        snprintf(key, sizeof key, "%s.rope.scaling.type", a);
        if ((st = rk_gguf_writer_set_str(w, key, "linear")) ||
            (st = mk_set_arch_f32(w, a, "rope.scaling.factor", g->rope_linear)))
            return st;
    }

    return rk_mk_vocab_write(w, mv);
}

/* The layers whose attn_v and ffn_down the K mixes keep at Q6_K, as the
 * common Q4_K_M / Q5_K_M files do: the first and the last eighth of the
 * layers, and every third layer between them. */
static int mk_more_bits_layer(int l, int n_layers) {
    return l < n_layers / 8 || l >= 7 * n_layers / 8 || (l - n_layers / 8) % 3 == 2;
}

/* The matrices a mix treats apart. */
typedef enum mk_role { ROLE_OTHER, ROLE_OUTPUT, ROLE_ATTN_V, ROLE_ATTN_OUT, ROLE_FFN_DOWN } mk_role;

/* The low-bit mixes (q3_k_m, q2_k, iq4_xs) as the reference quantizer
 * writes them for a model without an importance matrix: the output
 * projection at Q6_K, and
 *   q2_k    attn_v at Q3_K (Q4_K when four or more query heads share a KV
 *           head), attn_output and ffn_down at Q3_K;
 *   q3_k_m  attn_v at Q5_K in the first two layers and Q4_K after,
 *           attn_output at Q4_K, ffn_down at Q5_K in the first sixteenth
 *           of the layers and Q4_K after;
 *   iq4_xs  attn_v at Q5_K when four or more query heads share a KV head,
 *           ffn_down at Q5_K in the first eighth of the layers.
 * On rows that are not whole super-blocks each type falls back to the
 * 32-element type the reference takes: IQ4_NL for Q2_K, Q3_K and IQ4_XS,
 * Q5_0 for Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K. */
static rk_ggml_type mk_low_bit_type(rk_ggml_type wt, int64_t ne0, mk_role role, int layer,
                                    int n_layers, int gqa) {
    rk_ggml_type t = wt;
    if (role == ROLE_OUTPUT)
        t = RK_GGML_Q6_K;
    else if (wt == RK_GGML_Q2_K)
        t = role == ROLE_ATTN_V ? (gqa >= 4 ? RK_GGML_Q4_K : RK_GGML_Q3_K)
            : role == ROLE_ATTN_OUT || role == ROLE_FFN_DOWN ? RK_GGML_Q3_K
                                                             : wt;
    else if (wt == RK_GGML_Q3_K)
        t = role == ROLE_ATTN_V     ? (layer < 2 ? RK_GGML_Q5_K : RK_GGML_Q4_K)
            : role == ROLE_ATTN_OUT ? RK_GGML_Q4_K
            : role == ROLE_FFN_DOWN ? (layer < n_layers / 16 ? RK_GGML_Q5_K : RK_GGML_Q4_K)
                                    : wt;
    else if ((role == ROLE_ATTN_V && gqa >= 4) || (role == ROLE_FFN_DOWN && layer < n_layers / 8))
        t = RK_GGML_Q5_K; /* iq4_xs */
    if (ne0 % 256) switch (t) {
        case RK_GGML_Q2_K:
        case RK_GGML_Q3_K:
        case RK_GGML_IQ4_XS: return RK_GGML_IQ4_NL;
        case RK_GGML_Q4_K: return RK_GGML_Q5_0;
        case RK_GGML_Q5_K: return RK_GGML_Q5_1;
        case RK_GGML_Q6_K: return RK_GGML_Q8_0;
        default: break;
        }
    return t;
}

/* The type of one matrix under a weight type (see mkmodel.h): the output
 * projection, and in the K mixes attn_v and ffn_down of the layers
 * mk_more_bits_layer names, at Q6_K; a K type on rows that are not whole
 * super-blocks falls back to Q8_0. The low-bit mixes: mk_low_bit_type. */
static rk_ggml_type mk_matrix_type(const preset *p, rk_ggml_type wt, int64_t ne0, mk_role role,
                                   int layer) {
    if (wt == RK_GGML_MXFP4) return RK_GGML_Q8_0; /* the experts alone are MXFP4 */
    if (wt == RK_GGML_Q2_K || wt == RK_GGML_Q3_K || wt == RK_GGML_IQ4_XS)
        return mk_low_bit_type(wt, ne0, role, layer, p->n_layers, p->n_heads / p->n_kv_heads);
    int is_output = role == ROLE_OUTPUT,
        is_sensitive = (role == ROLE_ATTN_V || role == ROLE_FFN_DOWN) &&
                       mk_more_bits_layer(layer, p->n_layers);
    rk_ggml_type t = wt;
    if (is_output && (wt == RK_GGML_Q4_0 || wt == RK_GGML_Q4_K || wt == RK_GGML_Q5_K))
        t = RK_GGML_Q6_K;
    else if (is_sensitive && (wt == RK_GGML_Q4_K || wt == RK_GGML_Q5_K))
        t = RK_GGML_Q6_K;
    if ((t == RK_GGML_Q4_K || t == RK_GGML_Q5_K || t == RK_GGML_Q6_K) && ne0 % 256)
        t = RK_GGML_Q8_0;
    return t;
}

/* What gpt-oss adds to a layer, as its files have it: attn_output's bias,
 * the heads' sink logits (about 1, so they matter against unit-scale
 * scores), the router's bias and the experts' biases (F32, {width,
 * n_expert}). */
static rk_status mk_gptoss_layer(mk_model *m, int l) {
    const preset *p = m->p;
    const int64_t ne = p->n_expert, fe = p->ffn_exp, dim = p->dim;
    rk_status st;
    if ((st = mk_add(m, INIT_BIAS, RK_GGML_F32, dim, 0, "blk.%d.attn_output.bias", l)) ||
        (st = mk_add(m, INIT_NORM, RK_GGML_F32, p->n_heads, 0, "blk.%d.attn_sinks.weight", l)) ||
        (st = mk_add(m, INIT_BIAS, RK_GGML_F32, ne, 0, "blk.%d.ffn_gate_inp.bias", l)) ||
        (st = mk_add(m, INIT_BIAS, RK_GGML_F32, fe, ne, "blk.%d.ffn_gate_exps.bias", l)) ||
        (st = mk_add(m, INIT_BIAS, RK_GGML_F32, fe, ne, "blk.%d.ffn_up_exps.bias", l)) ||
        (st = mk_add(m, INIT_BIAS, RK_GGML_F32, dim, ne, "blk.%d.ffn_down_exps.bias", l)))
        return st;
    return RK_OK;
}

/* Gemma 4's tensors (see gemma4_extra), named as the reference converter
 * names them; the layers that reuse KV have no attn_k, attn_v, attn_k_norm.
 * Its attention is unscaled: the Q and K norm weights carry head_dim^-1/4
 * each, so random weights give logits of the usual size (unit ones make a
 * model so peaked that float rounding moves its log-probabilities by 1e-2). */
static rk_status mk_gemma4_tensors(mk_model *m, rk_ggml_type wt, const gemma4_extra *g) {
    const preset *p = m->p;
    const int64_t dim = p->dim, ple = g->ple, nl = p->n_layers;
    rk_status st;
    if ((st = mk_add(m, INIT_MATRIX, mk_matrix_type(p, wt, dim, ROLE_OUTPUT, 0), dim, m->vocab.n,
                     "token_embd.weight", 0)) ||
        (st = mk_add(m, INIT_MATRIX, mk_matrix_type(p, wt, ple * nl, ROLE_OTHER, 0), ple * nl,
                     m->vocab.n, "per_layer_token_embd.weight", 0)) ||
        (st = mk_add(m, INIT_MATRIX, mk_matrix_type(p, wt, dim, ROLE_OTHER, 0), dim, ple * nl,
                     "per_layer_model_proj.weight", 0)) ||
        (st = mk_add(m, INIT_NORM, wt, ple, 0, "per_layer_proj_norm.weight", 0)) ||
        (st = mk_add(m, INIT_PARTIAL, wt, p->head_dim / 2, 0, "rope_freqs.weight", 0)))
        return st;
    m->tensors[m->n_tensors - 1].rows[0] = g->rot_pairs;
    for (int l = 0; l < nl; l++) {
        int slides = l % g->period != g->period - 1, owns = l < nl - g->n_shared;
        int64_t hd = slides ? g->head_dim_swa : p->head_dim, q_dim = p->n_heads * hd,
                kv_dim = p->n_kv_heads * hd;
        int64_t ffn = l >= nl - g->n_shared && g->ffn_shared ? g->ffn_shared : p->ffn_dim;
        const rk_ggml_type t_dim = mk_matrix_type(p, wt, dim, ROLE_OTHER, l);
        if ((st = mk_add(m, INIT_NORM, wt, dim, 0, "blk.%d.attn_norm.weight", l)) ||
            (st = mk_add(m, INIT_MATRIX, t_dim, dim, q_dim, "blk.%d.attn_q.weight", l)) ||
            (owns &&
             ((st = mk_add(m, INIT_MATRIX, t_dim, dim, kv_dim, "blk.%d.attn_k.weight", l)) ||
              (st = mk_add(m, INIT_MATRIX, mk_matrix_type(p, wt, dim, ROLE_ATTN_V, l), dim, kv_dim,
                           "blk.%d.attn_v.weight", l)) ||
              (st = mk_add(m, INIT_QK_NORM, wt, hd, 0, "blk.%d.attn_k_norm.weight", l)))) ||
            (st = mk_add(m, INIT_QK_NORM, wt, hd, 0, "blk.%d.attn_q_norm.weight", l)) ||
            (st = mk_add(m, INIT_MATRIX, mk_matrix_type(p, wt, q_dim, ROLE_ATTN_OUT, l), q_dim, dim,
                         "blk.%d.attn_output.weight", l)) ||
            (st = mk_add(m, INIT_NORM, wt, dim, 0, "blk.%d.post_attention_norm.weight", l)) ||
            (st = mk_add(m, INIT_NORM, wt, dim, 0, "blk.%d.ffn_norm.weight", l)) ||
            (st = mk_add(m, INIT_MATRIX, t_dim, dim, ffn, "blk.%d.ffn_gate.weight", l)) ||
            (st = mk_add(m, INIT_MATRIX, t_dim, dim, ffn, "blk.%d.ffn_up.weight", l)) ||
            (st = mk_add(m, INIT_MATRIX, mk_matrix_type(p, wt, ffn, ROLE_FFN_DOWN, l), ffn, dim,
                         "blk.%d.ffn_down.weight", l)) ||
            (st = mk_add(m, INIT_NORM, wt, dim, 0, "blk.%d.post_ffw_norm.weight", l)) ||
            (st = mk_add(m, INIT_MATRIX, t_dim, dim, ple, "blk.%d.inp_gate.weight", l)) ||
            (st = mk_add(m, INIT_MATRIX, mk_matrix_type(p, wt, ple, ROLE_OTHER, l), ple, dim,
                         "blk.%d.proj.weight", l)) ||
            (st = mk_add(m, INIT_NORM, wt, dim, 0, "blk.%d.post_norm.weight", l)) ||
            (st = mk_add(m, INIT_NORM, wt, 1, 0, "blk.%d.layer_output_scale.weight", l)))
            return st;
    }
    return mk_add(m, INIT_NORM, wt, dim, 0, "output_norm.weight", 0);
}

/* A mixture-of-experts layer's FFN: the router (F32, as the reference
 * converter and quantizer keep it) and the stacked experts (MXFP4 files:
 * the experts MXFP4), and gpt-oss's biases and sinks. */
static rk_status mk_expert_layer(mk_model *m, rk_ggml_type wt, int l) {
    const preset *p = m->p;
    const int64_t ne = p->n_expert, fe = p->ffn_exp, dim = p->dim;
    const rk_ggml_type t_exp = wt == RK_GGML_MXFP4 ? wt : mk_matrix_type(p, wt, dim, ROLE_OTHER, l);
    const rk_ggml_type t_down =
        wt == RK_GGML_MXFP4 ? wt : mk_matrix_type(p, wt, fe, ROLE_FFN_DOWN, l);
    rk_status st;
    if ((st = mk_add(m, INIT_MATRIX, RK_GGML_F32, dim, ne, "blk.%d.ffn_gate_inp.weight", l)) ||
        (st = mk_add3(m, INIT_MATRIX, t_exp, dim, fe, ne, "blk.%d.ffn_gate_exps.weight", l)) ||
        (st = mk_add3(m, INIT_MATRIX, t_exp, dim, fe, ne, "blk.%d.ffn_up_exps.weight", l)) ||
        (st = mk_add3(m, INIT_MATRIX, t_down, fe, dim, ne, "blk.%d.ffn_down_exps.weight", l)))
        return st;
    return p->gptoss_window ? mk_gptoss_layer(m, l) : RK_OK;
}

/* A reranker's head, as the reference converter makes it: the output
 * projection's rows of "yes" and "no", in the projection's type t_out. */
static rk_status mk_rerank_head(mk_model *m, rk_ggml_type t_out) {
    const preset *p = m->p;
    int32_t yes = -1, no = -1;
    for (int32_t i = 0; i < m->vocab.n; i++) {
        if (yes < 0 && !strcmp(m->vocab.tokens[i], "yes")) yes = i;
        if (no < 0 && !strcmp(m->vocab.tokens[i], "no")) no = i;
    }
    if (yes < 0 || no < 0 || p->dim % 2)
        return rk_errorf(RK_ERR_INVALID, "mkmodel %s: the vocabulary has no \"yes\" or \"no\"",
                         m->name);
    rk_status st = mk_add(m, INIT_ROWS, t_out, p->dim, 2, "cls.output.weight", 0);
    if (st) return st;
    mk_tensor *t = &m->tensors[m->n_tensors - 1];
    t->src = p->tied ? "token_embd.weight" : "output.weight";
    t->rows[0] = yes;
    t->rows[1] = no;
    return RK_OK;
}

static rk_status mk_tensors(mk_model *m, rk_ggml_type wt) {
    const preset *p = m->p;
    const gemma4_extra *g4 = rk_mk_gemma4_of(m->name);
    if (g4) return mk_gemma4_tensors(m, wt, g4);
    const int64_t dim = p->dim, q_dim = (int64_t)p->n_heads * p->head_dim;
    const int64_t kv_dim = (int64_t)p->n_kv_heads * p->head_dim, ffn = p->ffn_dim;
    rk_status st;
    /* Tied: the embedding is the output projection too. */
    if ((st = mk_add(m, INIT_MATRIX,
                     mk_matrix_type(p, wt, dim, p->tied ? ROLE_OUTPUT : ROLE_OTHER, 0), dim,
                     m->vocab.n, "token_embd.weight", 0)))
        return st;
    const rk_ggml_type t_dim = mk_matrix_type(p, wt, dim, ROLE_OTHER, 0);
    const int post_norms = rk_mk_gemma_of(m->name) != NULL;
    const rk_ggml_type t_out = mk_matrix_type(p, wt, dim, ROLE_OUTPUT, 0);
    for (int l = 0; l < p->n_layers; l++) {
        const rk_ggml_type t_q = mk_matrix_type(p, wt, q_dim, ROLE_ATTN_OUT, l);
        const rk_ggml_type t_v = mk_matrix_type(p, wt, dim, ROLE_ATTN_V, l);
        const rk_ggml_type t_ffn = mk_matrix_type(p, wt, ffn, ROLE_FFN_DOWN, l);
        if ((st = mk_add(m, INIT_NORM, wt, dim, 0, "blk.%d.attn_norm.weight", l))) return st;
        if (p->fused) { /* one matrix: attn_v's rows share attn_q's type */
            if ((st = mk_add(m, INIT_MATRIX, t_dim, dim, q_dim + 2 * kv_dim,
                             "blk.%d.attn_qkv.weight", l)))
                return st;
        } else if ((st = mk_add(m, INIT_MATRIX, t_dim, dim, q_dim, "blk.%d.attn_q.weight", l)) ||
                   (st = mk_add(m, INIT_MATRIX, t_dim, dim, kv_dim, "blk.%d.attn_k.weight", l)) ||
                   (st = mk_add(m, INIT_MATRIX, t_v, dim, kv_dim, "blk.%d.attn_v.weight", l))) {
            return st;
        }
        if (p->qkv_bias && ((st = mk_add(m, INIT_BIAS, wt, q_dim, 0, "blk.%d.attn_q.bias", l)) ||
                            (st = mk_add(m, INIT_BIAS, wt, kv_dim, 0, "blk.%d.attn_k.bias", l)) ||
                            (st = mk_add(m, INIT_BIAS, wt, kv_dim, 0, "blk.%d.attn_v.bias", l))))
            return st;
        if (p->qk_norm &&
            ((st = mk_add(m, INIT_NORM, wt, p->head_dim, 0, "blk.%d.attn_q_norm.weight", l)) ||
             (st = mk_add(m, INIT_NORM, wt, p->head_dim, 0, "blk.%d.attn_k_norm.weight", l))))
            return st;
        if ((st = mk_add(m, INIT_MATRIX, t_q, q_dim, dim, "blk.%d.attn_output.weight", l)) ||
            (post_norms &&
             (st = mk_add(m, INIT_NORM, wt, dim, 0, "blk.%d.post_attention_norm.weight", l))) ||
            (st = mk_add(m, INIT_NORM, wt, dim, 0,
                         p->gptoss_window ? "blk.%d.post_attention_norm.weight"
                                          : "blk.%d.ffn_norm.weight",
                         l)) ||
            (post_norms &&
             (st = mk_add(m, INIT_NORM, wt, dim, 0, "blk.%d.post_ffw_norm.weight", l))))
            return st;
        if (p->n_expert > 0) {
            if ((st = mk_expert_layer(m, wt, l))) return st;
            continue;
        }
        if (p->fused) { /* ffn_up holds gate then up */
            if ((st = mk_add(m, INIT_MATRIX, t_dim, dim, 2 * ffn, "blk.%d.ffn_up.weight", l)))
                return st;
        } else if ((st = mk_add(m, INIT_MATRIX, t_dim, dim, ffn, "blk.%d.ffn_gate.weight", l)) ||
                   (st = mk_add(m, INIT_MATRIX, t_dim, dim, ffn, "blk.%d.ffn_up.weight", l))) {
            return st;
        }
        if ((st = mk_add(m, INIT_MATRIX, t_ffn, ffn, dim, "blk.%d.ffn_down.weight", l))) return st;
    }
    if (p->orig_ctx) { /* LongRoPE divisors of the rotated pairs' frequencies */
        int64_t n_pairs = (p->n_rot ? p->n_rot : p->head_dim) / 2;
        if ((st = mk_add(m, INIT_NORM, wt, n_pairs, 0, "rope_factors_short.weight", 0)) ||
            (st = mk_add(m, INIT_LONG, wt, n_pairs, 0, "rope_factors_long.weight", 0)))
            return st;
    }
    if ((st = mk_add(m, INIT_NORM, wt, dim, 0, "output_norm.weight", 0))) return st;
    if (!p->tied && (st = mk_add(m, INIT_MATRIX, t_out, dim, m->vocab.n, "output.weight", 0)))
        return st;
    return p->pooling == 4 ? mk_rerank_head(m, t_out) : RK_OK;
}

/* Resolve the preset, load the vocabulary and declare everything. */
static rk_status mk_prepare(const rk_mkmodel_opts *opts, mk_model *m) {
    memset(m, 0, sizeof *m);
    if (!opts) return rk_errorf(RK_ERR_INVALID, "mkmodel: NULL options");
    rk_status st = rk_mk_preset_find(opts->preset, &m->p, &m->name);
    if (st) return st;
    int known = 0;
    for (size_t i = 0; i < N_WTYPES; i++) known |= k_wtypes[i].type == opts->wtype;
    if (!known)
        return rk_errorf(RK_ERR_INVALID,
                         "mkmodel: weight type %s not supported (F32, F16, BF16, Q8_0, Q4_0, "
                         "Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS, MXFP4)",
                         rk_ggml_type_name((uint32_t)opts->wtype));
    if ((st = rk_mk_vocab_load(m->p, m->name, opts->vocab_path, &m->vocab)) ||
        (st = rk_gguf_writer_create(&m->w)) || (st = mk_metadata(m, opts)) ||
        (st = mk_tensors(m, opts->wtype))) {
        mk_model_free(m);
        return st;
    }
    return RK_OK;
}

/* Write the model to path; see mkmodel.h. */
rk_status rk_mkmodel_write(const char *path, const rk_mkmodel_opts *opts) {
    if (!path) return rk_errorf(RK_ERR_INVALID, "mkmodel: NULL path");
    mk_model m;
    rk_status st = mk_prepare(opts, &m);
    if (st) return st;
    mk_fill_ctx fc = {m.tensors, opts->seed};
    st = rk_gguf_writer_write_file(m.w, path, mk_fill, &fc);
    mk_model_free(&m);
    return st;
}

/* Build the model in memory; see mkmodel.h. */
rk_status rk_mkmodel_build_memory(const rk_mkmodel_opts *opts, void **out_buf, size_t *out_len) {
    if (!out_buf || !out_len) return rk_errorf(RK_ERR_INVALID, "mkmodel: NULL output");
    mk_model m;
    rk_status st = mk_prepare(opts, &m);
    if (st) return st;
    mk_fill_ctx fc = {m.tensors, opts->seed};
    st = rk_gguf_writer_write_memory(m.w, mk_fill, &fc, out_buf, out_len);
    mk_model_free(&m);
    return st;
}
