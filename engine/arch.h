/* engine/arch.h — what makes each model family what it is, in one place.
 *
 * A GGUF file names its family in general.architecture. Every difference
 * between the families ragkv computes is one field of the family's
 * description below, read once at load; the forward pass reads the
 * description, never the family's name. Shapes (layers, widths, heads,
 * windows, RoPE bases) are the file's; the description says which of the
 * file's keys and tensors a family has and how the pass uses them.
 *
 * Norm weights: GGUF converters fold Gemma's `1 + w` RMSNorm offset into the
 * stored weight (Gemma 4's norms have none), so every family's norm is plain
 * x / rms(x) * w here.
 *
 * Thread-safety: the descriptions are constant; any thread may read them. */
#ifndef RK_ARCH_H
#define RK_ARCH_H

#include <stddef.h>

/* The FFN's gate activation: out = act(x·Wgate) * (x·Wup), then ·Wdown. */
typedef enum rk_ffn_act {
    RK_FFN_SILU = 0,      /* SwiGLU: llama, qwen2, qwen3 */
    RK_FFN_GELU_TANH = 1, /* GeGLU with tanh-approximated GELU: gemma2, gemma3, gemma4 */
    /* gpt-oss's clamped SwiGLU: g' = min(g, 7), u' = clamp(u, -7, 7),
     * out = g' sigmoid(1.702 g') (u' + 1) (the reference's swiglu_oai) */
    RK_FFN_SWIGLU_OAI = 2,
} rk_ffn_act;

/* How a mixture-of-experts router's logits become expert weights. */
typedef enum rk_moe_gating {
    RK_MOE_NONE = 0,    /* a dense FFN */
    RK_MOE_SOFTMAX = 1, /* softmax over all experts, then top-k */
    RK_MOE_SIGMOID = 2, /* sigmoid per expert, then top-k */
    /* top-k of the logits themselves, then softmax over the k chosen
     * (gpt-oss; the reference's SOFTMAX_WEIGHT gating) */
    RK_MOE_SOFTMAX_TOPK = 3,
} rk_moe_gating;

typedef struct rk_arch_desc {
    const char *name; /* general.architecture */
    /* Attention */
    unsigned qkv_bias : 1;  /* attn_{q,k,v}.bias required (optional otherwise) */
    unsigned qk_norm : 1;   /* per-head RMSNorm on Q and K: attn_{q,k}_norm */
    unsigned fused_qkv : 1; /* one attn_qkv matrix holds [Q; K; V] */
    unsigned rope_neox : 1; /* RoPE pairs (i, i + n_rot/2), else (2i, 2i + 1) */
    /* Sliding-window layers: 0 none; p > 0 every p-th layer (l % p == p - 1)
     * is global and the others slide over <arch>.attention.sliding_window
     * table positions. */
    int swa_period;
    /* The window when the file has no <arch>.attention.sliding_window: 0
     * makes every layer global (Gemma 3 files without the key), gemma2's
     * files default to 4096 as the reference engine does. */
    int swa_default_window;
    /* Sliding layers rotate with <arch>.rope.freq_base_swa, default 10000,
     * unscaled (Gemma 3's local RoPE); else with the global RoPE, whose base
     * <arch>.rope.freq_base_swa overrides when present (gemma2). */
    unsigned swa_local_rope : 1;
    /* Soft-capping, cap * tanh(x / cap): the attention logits when
     * attn_softcap > 0, at <arch>.attn_logit_softcapping (default
     * attn_softcap); the output logits at <arch>.final_logit_softcapping
     * (default final_softcap, 0: none) in families that read that key
     * (final_softcap_key). */
    float attn_softcap;
    unsigned final_softcap_key : 1;
    float final_softcap;
    /* q·k is scaled by 1/sqrt(head_dim), except in a model of exactly this
     * many layers, scaled by 1/sqrt(dim / n_heads) (Gemma's 27B models,
     * whose query_pre_attn_scalar is not the head size; 0: never). */
    int scale_dim_layers;
    /* Norms and the residual stream */
    unsigned post_norms : 1;      /* post_attention_norm, post_ffw_norm before each add */
    unsigned embd_scale_sqrt : 1; /* token embeddings multiplied by sqrt(dim) */
    /* FFN */
    unsigned fused_gate_up : 1; /* ffn_up holds [gate; up] (no ffn_gate tensor) */
    rk_ffn_act act;
    rk_moe_gating moe; /* RK_MOE_NONE: dense */
    /* Mixture of experts: the chosen experts' weights divided by their sum
     * (the reference engine fixes this per family, e.g. on for qwen3moe) */
    unsigned moe_norm_topk : 1;
    /* gpt-oss: attn_output.bias; a learned sink logit per head
     * (blk.N.attn_sinks.weight, rk_attn_params.sinks); biases on the router
     * (ffn_gate_inp.bias) and on every expert's gate, up and down
     * (ffn_{gate,up,down}_exps.bias, {width, n_expert}) */
    unsigned attn_out_bias : 1;
    unsigned attn_sinks : 1;
    unsigned moe_biases : 1;
    /* The norm before the FFN, blk.N.<ffn_norm>.weight; NULL: "ffn_norm"
     * (gpt-oss files call it "post_attention_norm") */
    const char *ffn_norm;
    /* Gemma 4 (model_gemma4.c). Each layer's kind (sliding or global) is
     * the file's per-layer bool array <arch>.attention.sliding_window_pattern,
     * and the two kinds have their own rotated dims
     * (<arch>.rope.dimension_count_swa) */
    unsigned swa_pattern_arr : 1;
    unsigned attn_unscaled : 1; /* q·k not scaled (Q and K are RMS-normed per head) */
    unsigned v_norm : 1;        /* V RMS-normed per head without a weight; attn_v optional
                                 * (V = K before its norm when absent) */
    /* Per-layer token embeddings (<arch>.embedding_length_per_layer_input
     * wide per layer, 0: none): a second embedding table, projected from the
     * scaled embedding and added, gated into each layer's output. */
    unsigned per_layer_embd : 1;
    /* The last <arch>.attention.shared_kv_layers layers compute no K/V and
     * attend over the KV of the last owning layer of their kind: the KV
     * cache holds the owning layers only (rk_model_kv_layer). */
    unsigned shared_kv : 1;
    unsigned layer_out_scale : 1; /* blk.N.layer_output_scale.weight, optional, scales x */
    unsigned cpu_only : 1;        /* refused on other backends */
} rk_arch_desc;

/* The description of the family named name, or NULL when ragkv does not
 * compute it. */
const rk_arch_desc *rk_arch_find(const char *name);

/* A one-line reason for a family ragkv refuses on purpose (a recurrent state
 * instead of KV, which cannot be reused at another position), or NULL. */
const char *rk_arch_refusal(const char *name);

/* The supported families' names, comma-separated, into out (n bytes,
 * truncated to fit), for messages and help. */
void rk_arch_names(char *out, size_t n);

#endif
