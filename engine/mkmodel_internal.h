/* engine/mkmodel_internal.h — what the synthetic-model writer's files
 * share: a preset's shape (mkmodel_presets.c holds the table) and the lookups
 * mkmodel.c uses. Private to engine/. */
#ifndef RK_MKMODEL_INTERNAL_H
#define RK_MKMODEL_INTERNAL_H

#include "engine/mkmodel.h"
#include "engine/tokenizer.h"

typedef enum vocab_kind {
    VOCAB_TINY,       /* rk_vocab_tiny() as is */
    VOCAB_TINY_32000, /* rk_vocab_tiny() padded with unused tokens to 32000 */
    VOCAB_QWEN3,      /* the Qwen3 tokenizer.json padded to 151936 */
    VOCAB_PHI3,       /* Llama 2's (or Phi-3's) tokenizer.json, Phi-3's added tokens, to 32064 */
    VOCAB_PHI4,   /* o200k's (or Phi-4-mini's) tokenizer.json, Phi-4's added tokens, to 200064 */
    VOCAB_GEMMA3, /* the Gemma 3 tokenizer.json (262144 tokens) */
    /* o200k_harmony: o200k's pieces (gpt-oss's or o200k's tokenizer.json),
     * the harmony special tokens at their ids 199998..200018, to 201088 */
    VOCAB_HARMONY,
} vocab_kind;

typedef struct preset {
    const char *arch;
    int n_layers, dim, n_heads, n_kv_heads, head_dim, ffn_dim, n_ctx;
    float theta, eps;
    int tied, qkv_bias, qk_norm;
    vocab_kind vocab;
    int pooling; /* <arch>.pooling_type written when > 0 (1 mean, 2 cls, 3 last, 4 rank: with
                    the head and prompt of mk_rerank_*); 0: no key */
    /* phi3: attn_qkv and ffn_up hold the fused matrices; RoPE on the first
     * n_rot dimensions (0: all); LongRoPE factors for a context_length above
     * orig_ctx (0: none) */
    int fused, n_rot, orig_ctx;
    /* Mixture of experts (0 experts: a dense FFN): experts per layer, used per
     * token, and each expert's FFN width */
    int n_expert, n_expert_used, ffn_exp;
    /* gpt-oss: Q/K/V/O biases, attn_sinks, post_attention_norm as the FFN's
     * norm, router and expert biases; sliding window (even layers), YaRN
     * with this factor from orig_ctx (see mkmodel_gptoss.c) */
    int gptoss_window, yarn_orig_ctx;
    float yarn_factor;
} preset;

#define QWEN3_N_VOCAB 151936
#define LLAMA_N_VOCAB 32000
#define PHI3_N_VOCAB  32064
#define PHI4_N_VOCAB  200064

#define GEMMA3_N_VOCAB  262144
#define HARMONY_N_VOCAB 201088

/* What the Gemma presets add (keys the reference converter writes):
 * <arch>.attention.sliding_window, gemma2's soft caps, and for the
 * post-norms the tensors post_attention_norm and post_ffw_norm. */
typedef struct gemma_extra {
    const char *name;    /* the preset */
    int window;          /* attention.sliding_window */
    float attn_softcap;  /* attn_logit_softcapping (gemma2), 0: no key */
    float final_softcap; /* final_logit_softcapping (gemma2), 0: no key */
    float rope_linear;   /* rope.scaling.type linear with this factor (> 0), 0: no key */
} gemma_extra;

/* What the Gemma 4 presets add, as the reference converter writes them:
 * the layer kinds as a bool array (every period-th layer global), the head
 * size of the sliding layers (the preset's head_dim is the global layers'),
 * their rotated dims and base, the global layers' proportional RoPE
 * (rope_freqs.weight: rot_pairs pairs rotate, the others get divisor 1e30),
 * shared KV layers, per-layer embeddings of width ple, the shared layers'
 * FFN width (double-wide MLP; 0: the preset's), the final soft cap. */
typedef struct gemma4_extra {
    const char *name;
    int window, period, head_dim_swa, n_rot_swa, rot_pairs, n_shared, ple, ffn_shared;
    float theta_swa, final_softcap;
} gemma4_extra;

/* The Gemma 4 additions of the preset named name, NULL for the others. */
const gemma4_extra *rk_mk_gemma4_of(const char *name);

/* Find a preset by name (NULL = "tiny"); *out_name (may be NULL) gets its
 * static name. RK_ERR_NOT_FOUND lists the presets. */
rk_status rk_mk_preset_find(const char *name, const preset **out, const char **out_name);

/* The Gemma additions of the preset named name, NULL for the others. */
const gemma_extra *rk_mk_gemma_of(const char *name);

/* ---------------------------------------------------------------- vocabulary (mkmodel_vocab.c) */

/* A vocabulary ready for the writer: token pointers (into the loaded rk_vocab
 * or the padding block), with padding applied. */
typedef struct mk_vocab {
    rk_vocab v;          /* as loaded; owns the strings */
    int32_t n;           /* tokens after padding */
    const char **tokens; /* (n) */
    float *scores;       /* (n) or NULL */
    int32_t *types;      /* (n) */
    char *pad_blob;      /* texts of the padding tokens */
} mk_vocab;

/* The preset's vocabulary into *mv (vocab_path: its tokenizer.json, or NULL
 * for the preset's default); errors name the preset (pname). */
rk_status rk_mk_vocab_load(const preset *p, const char *pname, const char *vocab_path,
                           mk_vocab *mv);
/* Release mv and zero it; accepts a zeroed one. */
void rk_mk_vocab_free(mk_vocab *mv);
/* The tokenizer.ggml.* keys of mv into w. */
rk_status rk_mk_vocab_write(rk_gguf_writer *w, const mk_vocab *mv);

#endif
