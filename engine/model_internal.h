/* engine/model_internal.h — what the model's files share: its structs, and
 * the hyper-parameter reader (model_hparams.c) the loader (model.c) calls.
 * Private to engine/. */
#ifndef RK_MODEL_INTERNAL_H
#define RK_MODEL_INTERNAL_H

#include "engine/engine.h"
#include "engine/moe.h"

typedef struct rk_matrix {
    const void *w;      /* (rows, cols) backend memory, cols contiguous */
    const void *packed; /* w in the backend's packed layout, or NULL (see pack_mat) */
    rk_dtype type;
    int rows, cols;
} rk_matrix;

typedef struct rk_layer {
    const float *attn_norm, *ffn_norm;           /* (dim) */
    const float *q_norm, *k_norm;                /* (head_dim), qwen3, gemma3 */
    const float *post_attn_norm, *post_ffn_norm; /* (dim), families with post_norms */
    int window;                                  /* sliding window of the layer, 0: global */
    const float *bq, *bk, *bv;                   /* (n_heads*head_dim), (kv_dim), (kv_dim); qwen2 */
    const float *bo;                             /* (dim) attn_output.bias; gpt-oss */
    const float *sinks;                          /* (n_heads) host memory; gpt-oss */
    rk_matrix wq, wk, wv, wo, gate, up, down;
    /* [wq; wk; wv] and [gate; up] packed as one matrix each where the
     * backend packs them (see fuse_mats), else rows 0 */
    rk_matrix qkv, gate_up;
    /* Mixture of experts (load_experts): the router and each expert's
     * matrices in place of gate, up and down; moe.gate NULL when dense */
    rk_moe_layer moe;
} rk_layer;

/* Activation buffers, sized for cap tokens and cap_logits logit rows. */
typedef struct rk_scratch {
    int cap, cap_logits, cap_blocks;
    float *x, *xb;                 /* (cap, dim) */
    float *q, *att;                /* (cap, n_heads*head_dim) */
    float *k, *v;                  /* (cap, kv_dim) */
    float *hb, *hb2;               /* (cap, ffn_dim) */
    float *fused;                  /* (cap, max(q + 2 kv, 2 ffn_dim)): fused matmul outputs */
    float *xl;                     /* (cap_logits, dim) */
    float *logits;                 /* (cap_logits, n_vocab) */
    int32_t *tokens, *pos, *slots; /* (cap) */
    int32_t *table;                /* (cap_blocks) */
} rk_scratch;

struct rk_model {
    rk_hparams hp;
    rk_rope rope;
    rk_rope rope_swa; /* the sliding layers' (hp.rope_swa) */
    rk_backend *be;
    rk_gguf *gguf;
    void *owned_buf;
    rk_tokenizer *tok;
    const void *embd; /* token_embd (n_vocab, dim) */
    rk_dtype embd_type;
    const float *out_norm;
    rk_matrix out;
    rk_layer *layers;
    const rk_rope **layer_rope; /* (n_layers) the RoPE of each layer */
    void **allocs;              /* backend buffers this model owns */
    int n_allocs, cap_allocs;
    void **host_allocs; /* host buffers (converted small tensors) */
    int n_host, cap_host;
    size_t weight_bytes;
    int has_fused;        /* some layer has a fused matrix (fuse_mats, or the file's) */
    rk_moe_scratch moe_s; /* the MoE FFN's buffers (host memory) */
    char fingerprint[33];
    rk_scratch s;
};

/* Read the hyper-parameters and RoPE tables of m's GGUF into m->hp, m->rope
 * and m->rope_swa, checked; the error names the key. */
rk_status rk_model_read_hparams(rk_model *m);

/* Apply the file's per-frequency RoPE divisors and attention factor to m->rope. */
rk_status rk_model_apply_rope_freqs(rk_model *m);

/* Whether layer l of a model with hp slides over a window. */
int rk_model_layer_slides(const rk_hparams *hp, int l);

#endif
