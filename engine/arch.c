/* engine/arch.c — the model families ragkv computes, one description each
 * (see arch.h), and the ones it refuses on purpose. */
#include "engine/arch.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

static const rk_arch_desc k_archs[] = {
    {.name = "llama", .act = RK_FFN_SILU},
    {.name = "qwen2", .qkv_bias = 1, .rope_neox = 1, .act = RK_FFN_SILU},
    {.name = "qwen3", .qk_norm = 1, .rope_neox = 1, .act = RK_FFN_SILU},
    {.name = "phi3", .fused_qkv = 1, .fused_gate_up = 1, .rope_neox = 1, .act = RK_FFN_SILU},
    {.name = "qwen3moe",
     .qk_norm = 1,
     .rope_neox = 1,
     .act = RK_FFN_SILU,
     .moe = RK_MOE_SOFTMAX,
     .moe_norm_topk = 1},
    {.name = "gemma2",
     .rope_neox = 1,
     .swa_period = 2,
     .swa_default_window = 4096,
     .attn_softcap = 50.0f,
     .final_softcap_key = 1,
     .final_softcap = 30.0f,
     .scale_dim_layers = 46,
     .post_norms = 1,
     .embd_scale_sqrt = 1,
     .act = RK_FFN_GELU_TANH},
    {.name = "gemma3",
     .qk_norm = 1,
     .rope_neox = 1,
     .swa_period = 6,
     .swa_local_rope = 1,
     .final_softcap_key = 1,
     .scale_dim_layers = 62,
     .post_norms = 1,
     .embd_scale_sqrt = 1,
     .act = RK_FFN_GELU_TANH},
    /* Sliding layers alternate with global ones from layer 0 (l % 2 == 0
     * slides), YaRN on every layer as the file gives it. */
    {.name = "gpt-oss",
     .qkv_bias = 1,
     .rope_neox = 1,
     .swa_period = 2,
     .swa_default_window = 128,
     .act = RK_FFN_SWIGLU_OAI,
     .moe = RK_MOE_SOFTMAX_TOPK,
     .attn_out_bias = 1,
     .attn_sinks = 1,
     .moe_biases = 1,
     .ffn_norm = "post_attention_norm"},
    {.name = "gemma4",
     .qk_norm = 1,
     .rope_neox = 1,
     .swa_period = 1, /* sliding windows on; the layers' kinds are the file's array */
     .swa_local_rope = 1,
     .final_softcap_key = 1,
     .final_softcap = 30.0f,
     .post_norms = 1,
     .embd_scale_sqrt = 1,
     .act = RK_FFN_GELU_TANH,
     .swa_pattern_arr = 1,
     .attn_unscaled = 1,
     .v_norm = 1,
     .per_layer_embd = 1,
     .shared_kv = 1,
     .layer_out_scale = 1,
     .cpu_only = 1},
};
#define N_ARCHS (sizeof k_archs / sizeof k_archs[0])

/* Families whose layers keep a recurrent state in place of (or beside) KV. */
static const char *const k_recurrent[] = {
    "mamba",  "mamba2",    "rwkv6", "rwkv7",         "jamba",  "falcon-h1",  "qwen3next",
    "qwen35", "qwen35moe", "lfm2",  "granitehybrid", "plamo2", "nemotron_h",
};

const rk_arch_desc *rk_arch_find(const char *name) {
    for (size_t i = 0; i < N_ARCHS; i++)
        if (!strcmp(k_archs[i].name, name)) return &k_archs[i];
    return NULL;
}

const char *rk_arch_refusal(const char *name) {
    for (size_t i = 0; i < sizeof k_recurrent / sizeof k_recurrent[0]; i++)
        if (!strcmp(k_recurrent[i], name))
            return "its layers keep a recurrent state instead of KV, and a recurrent state "
                   "cannot be reused at another position, so its chunks cannot be cached";
    return NULL;
}

void rk_arch_names(char *out, size_t n) {
    size_t len = 0;
    if (n) out[0] = '\0';
    for (size_t i = 0; i < N_ARCHS && len < n; i++)
        len += (size_t)snprintf(out + len, n - len, "%s%s", i ? ", " : "", k_archs[i].name);
}
