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
    /* Gemma 4 (model_gemma4.c): the KV layer it writes (its own) or reads
     * (an earlier one's; owns_kv 0), its FFN width, its per-layer embedding's
     * gate (dim -> ple), projection (ple -> dim) and norm, its output scale */
    int kv_layer, owns_kv, ffn_dim;
    /* Its heads' size: hp.head_dim (the KV cache's), or less in a family whose
     * sliding and global layers differ (gemma4): its Q, K and V are then
     * zero-padded to hp.head_dim for RoPE, the KV cache and attention (the
     * padding adds nothing to q·k, attention is unscaled, and the output's
     * padding is dropped before attn_output) */
    int head_dim;
    rk_matrix ple_gate, ple_proj;
    const float *ple_norm;
    float out_scale; /* 1 where the file has none */
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
    /* Per-layer shapes read from arrays (NULL: every layer the same): a
     * layer's FFN width, whether it slides */
    int *ffn_of;
    unsigned char *slides;
    int head_dim_swa, head_dim_global; /* each kind's head size, 0: hp.head_dim */
    /* Gemma 4's per-layer embeddings (model_gemma4.c): the table (n_vocab,
     * n_layers * ple), the projection from the embedding, its norm (ple),
     * a ones vector (head_dim, V's weightless norm), the batch's inputs
     * (cap, n_layers, ple) and a buffer of as many floats, host memory */
    const void *ple_embd;
    rk_dtype ple_type;
    rk_matrix ple_model_proj;
    const float *ple_proj_norm, *ones;
    float *ple_in, *ple_tmp;
    int ple_cap;
};

/* Read the hyper-parameters and RoPE tables of m's GGUF into m->hp, m->rope
 * and m->rope_swa, checked; the error names the key. */
rk_status rk_model_read_hparams(rk_model *m);

/* Apply the file's per-frequency RoPE divisors and attention factor to m->rope. */
rk_status rk_model_apply_rope_freqs(rk_model *m);

/* Whether layer l of a model with hp slides over a window. */
int rk_model_layer_slides(const rk_hparams *hp, int l);
/* The same for m's layer l, read from the file's per-layer array where it has one. */
int rk_model_slides(const rk_model *m, int l);

/* Gemma 4 (model_gemma4.c). Read the keys of the family's layer kinds,
 * shared KV and per-layer embeddings (after the common ones). */
rk_status rk_gemma4_read_hparams(rk_model *m);
/* Load the per-layer embedding tensors and each layer's output scale. */
rk_status rk_gemma4_load(rk_model *m);
/* The batch's per-layer inputs from tokens (host, n) and the scaled
 * embeddings in m->s.x, into m->ple_in. */
rk_status rk_gemma4_ple_inputs(rk_model *m, const int32_t *tokens, int n);
/* Rows of x (host) from width `from` to `to`, in place: widen pads each row
 * with zeros, narrow drops each row's tail. */
void rk_gemma4_widen(float *x, int rows, int from, int to);
void rk_gemma4_narrow(float *x, int rows, int from, int to);
/* x += layer l's per-layer embedding term; then x *= its output scale. */
rk_status rk_gemma4_layer_out(rk_model *m, int l, int n);
void rk_gemma4_free(rk_model *m);

#endif
