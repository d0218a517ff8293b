/* engine/mkmodel_presets.c — the synthetic-model presets: names, help
 * lines and shapes (see mkmodel.h), and their lookups. */
#include <string.h>

#include "engine/mkmodel_internal.h"
#include "engine/tokenizer.h"

/* Names and help lines; k_presets below has the shapes, in the same order. */
static const rk_mkmodel_preset_info k_infos[] = {
    {"tiny", "llama, 4 layers, dim 128, 4 heads / 2 KV, FFN 384, tiny vocabulary (the built-in "
             "default, ~1 M parameters)"},
    {"qwen3-0.6b", "qwen3, Qwen3-0.6B shapes: 28 layers, dim 1024, 16 heads / 8 KV, head 128, "
                   "FFN 3072, tied, Qwen3 vocabulary (~0.6 B parameters, 2.4 GB in F32)"},
    {"qwen3-tiny", "qwen3, 2 layers, dim 128, 4 heads / 2 KV, head 32, FFN 256, tied, Qwen3 "
                   "vocabulary (fast tests of the qwen3 path)"},
    {"qwen2-tiny", "qwen2 (QKV biases), 2 layers, dim 128, 4 heads / 2 KV, head 32, FFN 256, "
                   "tied, Qwen3 vocabulary"},
    {"llama-1b", "llama, TinyLlama-1.1B shapes: 22 layers, dim 2048, 32 heads / 4 KV, FFN 5632, "
                 "tiny vocabulary padded to 32000 (~1.1 B parameters, 4.4 GB in F32)"},
    {"qwen3-8b", "qwen3, Qwen3-8B shapes: 36 layers, dim 4096, 32 heads / 8 KV, head 128, FFN "
                 "12288, untied, Qwen3 vocabulary (~8.2 B parameters, 33 GB in F32)"},
    {"qwen3-embedding-tiny", "qwen3-tiny's shapes and Qwen3 vocabulary with pooling_type 3 "
                             "(last token), as Qwen3-Embedding files have: an embedding model"},
    {"qwen3-reranker-tiny", "qwen3-tiny's shapes and Qwen3 vocabulary with pooling_type 4 "
                            "(rank), a yes/no head cls.output and the rerank prompt, as "
                            "Qwen3-Reranker files have: a reranking model"},
    {"phi3-tiny", "phi3 (fused QKV and gate/up, RoPE on 24 of 32 dimensions, LongRoPE from "
                  "4096 to 8192), 2 layers, dim 128, 4 heads / 2 KV, FFN 256, tied, Phi-3 "
                  "vocabulary (--vocab: Llama 2's tokenizer.json)"},
    {"phi4-mini", "phi3, Phi-4-mini shapes: 32 layers, dim 3072, 24 heads / 8 KV, head 128, RoPE "
                  "on 96 dimensions, FFN 8192, LongRoPE from 4096 to 131072, tied, o200k "
                  "vocabulary (--vocab: its tokenizer.json; ~3.8 B parameters, 15 GB in F32)"},
    {"qwen3moe-tiny", "qwen3moe (mixture of experts), 2 layers, dim 128, 4 heads / 2 KV, head 32, "
                      "8 experts of FFN 64, 2 used per token, tied, Qwen3 vocabulary"},
    {"qwen3moe-a3b-12l", "qwen3moe, Qwen3-30B-A3B's layer shapes: dim 2048, 32 heads / 4 KV, head "
                         "128, 128 experts of FFN 768, 8 used, untied, Qwen3 vocabulary, 12 of its "
                         "48 layers (~7.9 B parameters, 4.6 GB at q4_k_m)"},
    {"gemma2-tiny", "gemma2, 4 layers, dim 128, 4 heads / 2 KV, head 32, FFN 256, tied, "
                    "sliding window 16 on even layers, soft-capping 50 / 30, tiny vocabulary"},
    {"gemma3-micro", "gemma3, 6 layers (5 sliding, window 16, then 1 global), dim 128, 4 heads / "
                     "2 KV, head 32, FFN 256, tied, QK-norm, tiny vocabulary (tests that do not "
                     "read the Gemma 3 vocabulary)"},
    {"gemma3-tiny", "gemma3, 6 layers (5 sliding, window 16, then 1 global), dim 64, 4 heads / 2 "
                    "KV, head 32, FFN 128, tied, QK-norm, Gemma 3 vocabulary (--vocab)"},
    {"gpt-oss-tiny",
     "gpt-oss (attention sinks, sliding window 128 on even layers, YaRN x32 from "
     "4096, 8 experts of FFN 64 with biases, 2 used, clamped SwiGLU), 4 layers, "
     "dim 128, 4 heads / 2 KV, head 32, untied, o200k_harmony vocabulary (--vocab)"},
    {"gpt-oss-20b-6l", "gpt-oss, gpt-oss-20b's layer shapes: dim 2880, 64 heads / 8 KV, head 64, "
                       "32 experts of FFN 2880, 4 used, untied, o200k_harmony vocabulary "
                       "(--vocab), 6 of its 24 layers (~5.3 B parameters, 3.2 GB at mxfp4)"},
    {"gemma3-1b", "gemma3, Gemma-3-1B shapes: 26 layers (window 512, every sixth global), dim "
                  "1152, 4 heads / 1 KV, head 256, FFN 6912, tied, Gemma 3 vocabulary (~1 B "
                  "parameters, 4 GB in F32)"},
    {"gemma4-tiny", "gemma4, 6 layers (2 sliding, window 16, then 1 global; the last 3 reuse the "
                    "KV of layers 1 and 2), dim 64, 4 heads / 2 KV, head 16 sliding and 32 global "
                    "(RoPE on 8 of its 32), FFN 128 (256 in the KV-sharing layers), per-layer "
                    "embeddings of 32, tied, Gemma 3 vocabulary"},
    {"gemma4-e2b", "gemma4, Gemma-4-E2B shapes: 35 layers (window 512, every fifth global, the "
                   "last 20 reuse KV), dim 1536, 8 heads / 1 KV, head 256 (global 512), FFN 6144 "
                   "(12288 sharing), per-layer embeddings of 256, tied, Gemma 3 vocabulary"},
};

static const preset k_presets[] = {
    /* tiny */
    {.arch = "llama",
     .n_layers = 4,
     .dim = 128,
     .n_heads = 4,
     .n_kv_heads = 2,
     .head_dim = 32,
     .ffn_dim = 384,
     .n_ctx = 4096,
     .theta = 10000.0f,
     .eps = 1e-5f,
     .vocab = VOCAB_TINY},
    /* qwen3-0.6b */
    {.arch = "qwen3",
     .n_layers = 28,
     .dim = 1024,
     .n_heads = 16,
     .n_kv_heads = 8,
     .head_dim = 128,
     .ffn_dim = 3072,
     .n_ctx = 40960,
     .theta = 1e6f,
     .eps = 1e-6f,
     .tied = 1,
     .qk_norm = 1,
     .vocab = VOCAB_QWEN3},
    /* qwen3-tiny */
    {.arch = "qwen3",
     .n_layers = 2,
     .dim = 128,
     .n_heads = 4,
     .n_kv_heads = 2,
     .head_dim = 32,
     .ffn_dim = 256,
     .n_ctx = 40960,
     .theta = 1e6f,
     .eps = 1e-6f,
     .tied = 1,
     .qk_norm = 1,
     .vocab = VOCAB_QWEN3},
    /* qwen2-tiny */
    {.arch = "qwen2",
     .n_layers = 2,
     .dim = 128,
     .n_heads = 4,
     .n_kv_heads = 2,
     .head_dim = 32,
     .ffn_dim = 256,
     .n_ctx = 32768,
     .theta = 1e6f,
     .eps = 1e-6f,
     .tied = 1,
     .qkv_bias = 1,
     .vocab = VOCAB_QWEN3},
    /* llama-1b */
    {.arch = "llama",
     .n_layers = 22,
     .dim = 2048,
     .n_heads = 32,
     .n_kv_heads = 4,
     .head_dim = 64,
     .ffn_dim = 5632,
     .n_ctx = 2048,
     .theta = 10000.0f,
     .eps = 1e-5f,
     .vocab = VOCAB_TINY_32000},
    /* qwen3-8b */
    {.arch = "qwen3",
     .n_layers = 36,
     .dim = 4096,
     .n_heads = 32,
     .n_kv_heads = 8,
     .head_dim = 128,
     .ffn_dim = 12288,
     .n_ctx = 40960,
     .theta = 1e6f,
     .eps = 1e-6f,
     .qk_norm = 1,
     .vocab = VOCAB_QWEN3},
    /* qwen3-embedding-tiny */
    {.arch = "qwen3",
     .n_layers = 2,
     .dim = 128,
     .n_heads = 4,
     .n_kv_heads = 2,
     .head_dim = 32,
     .ffn_dim = 256,
     .n_ctx = 40960,
     .theta = 1e6f,
     .eps = 1e-6f,
     .tied = 1,
     .qk_norm = 1,
     .vocab = VOCAB_QWEN3,
     .pooling = 3},
    /* qwen3-reranker-tiny */
    {.arch = "qwen3",
     .n_layers = 2,
     .dim = 128,
     .n_heads = 4,
     .n_kv_heads = 2,
     .head_dim = 32,
     .ffn_dim = 256,
     .n_ctx = 40960,
     .theta = 1e6f,
     .eps = 1e-6f,
     .tied = 1,
     .qk_norm = 1,
     .vocab = VOCAB_QWEN3,
     .pooling = 4},
    /* phi3-tiny */
    {.arch = "phi3",
     .n_layers = 2,
     .dim = 128,
     .n_heads = 4,
     .n_kv_heads = 2,
     .head_dim = 32,
     .ffn_dim = 256,
     .n_ctx = 8192,
     .theta = 10000.0f,
     .eps = 1e-5f,
     .tied = 1,
     .vocab = VOCAB_PHI3,
     .fused = 1,
     .n_rot = 24,
     .orig_ctx = 4096},
    /* phi4-mini */
    {.arch = "phi3",
     .n_layers = 32,
     .dim = 3072,
     .n_heads = 24,
     .n_kv_heads = 8,
     .head_dim = 128,
     .ffn_dim = 8192,
     .n_ctx = 131072,
     .theta = 10000.0f,
     .eps = 1e-5f,
     .tied = 1,
     .vocab = VOCAB_PHI4,
     .fused = 1,
     .n_rot = 96,
     .orig_ctx = 4096},
    /* qwen3moe-tiny */
    {.arch = "qwen3moe",
     .n_layers = 2,
     .dim = 128,
     .n_heads = 4,
     .n_kv_heads = 2,
     .head_dim = 32,
     .ffn_dim = 256,
     .n_ctx = 40960,
     .theta = 1e6f,
     .eps = 1e-6f,
     .tied = 1,
     .qk_norm = 1,
     .vocab = VOCAB_QWEN3,
     .n_expert = 8,
     .n_expert_used = 2,
     .ffn_exp = 64},
    /* qwen3moe-a3b-12l */
    {.arch = "qwen3moe",
     .n_layers = 12,
     .dim = 2048,
     .n_heads = 32,
     .n_kv_heads = 4,
     .head_dim = 128,
     .ffn_dim = 6144,
     .n_ctx = 40960,
     .theta = 1e6f,
     .eps = 1e-6f,
     .qk_norm = 1,
     .vocab = VOCAB_QWEN3,
     .n_expert = 128,
     .n_expert_used = 8,
     .ffn_exp = 768},
    /* gemma2-tiny */
    {.arch = "gemma2",
     .n_layers = 4,
     .dim = 128,
     .n_heads = 4,
     .n_kv_heads = 2,
     .head_dim = 32,
     .ffn_dim = 256,
     .n_ctx = 8192,
     .theta = 10000.0f,
     .eps = 1e-6f,
     .tied = 1,
     .vocab = VOCAB_TINY},
    /* gemma3-micro */
    {.arch = "gemma3",
     .n_layers = 6,
     .dim = 128,
     .n_heads = 4,
     .n_kv_heads = 2,
     .head_dim = 32,
     .ffn_dim = 256,
     .n_ctx = 32768,
     .theta = 1e6f,
     .eps = 1e-6f,
     .tied = 1,
     .qk_norm = 1,
     .vocab = VOCAB_TINY},
    /* gemma3-tiny */
    {.arch = "gemma3",
     .n_layers = 6,
     .dim = 64,
     .n_heads = 4,
     .n_kv_heads = 2,
     .head_dim = 32,
     .ffn_dim = 128,
     .n_ctx = 32768,
     .theta = 1e6f,
     .eps = 1e-6f,
     .tied = 1,
     .qk_norm = 1,
     .vocab = VOCAB_GEMMA3},
    /* gpt-oss-tiny */
    {.arch = "gpt-oss",
     .n_layers = 4,
     .dim = 128,
     .n_heads = 4,
     .n_kv_heads = 2,
     .head_dim = 32,
     .ffn_dim = 64,
     .n_ctx = 131072,
     .theta = 150000.0f,
     .eps = 1e-5f,
     .qkv_bias = 1,
     .vocab = VOCAB_HARMONY,
     .n_expert = 8,
     .n_expert_used = 2,
     .ffn_exp = 64,
     .gptoss_window = 128,
     .yarn_orig_ctx = 4096,
     .yarn_factor = 32.0f},
    /* gpt-oss-20b-6l */
    {.arch = "gpt-oss",
     .n_layers = 6,
     .dim = 2880,
     .n_heads = 64,
     .n_kv_heads = 8,
     .head_dim = 64,
     .ffn_dim = 2880,
     .n_ctx = 131072,
     .theta = 150000.0f,
     .eps = 1e-5f,
     .qkv_bias = 1,
     .vocab = VOCAB_HARMONY,
     .n_expert = 32,
     .n_expert_used = 4,
     .ffn_exp = 2880,
     .gptoss_window = 128,
     .yarn_orig_ctx = 4096,
     .yarn_factor = 32.0f},
    /* gemma3-1b */
    {.arch = "gemma3",
     .n_layers = 26,
     .dim = 1152,
     .n_heads = 4,
     .n_kv_heads = 1,
     .head_dim = 256,
     .ffn_dim = 6912,
     .n_ctx = 32768,
     .theta = 1e6f,
     .eps = 1e-6f,
     .tied = 1,
     .qk_norm = 1,
     .vocab = VOCAB_GEMMA3},
    /* gemma4-tiny */
    {.arch = "gemma4",
     .n_layers = 6,
     .dim = 64,
     .n_heads = 4,
     .n_kv_heads = 2,
     .head_dim = 32,
     .ffn_dim = 128,
     .n_ctx = 32768,
     .theta = 1e6f,
     .eps = 1e-6f,
     .tied = 1,
     .qk_norm = 1,
     .vocab = VOCAB_GEMMA3},
    /* gemma4-e2b */
    {.arch = "gemma4",
     .n_layers = 35,
     .dim = 1536,
     .n_heads = 8,
     .n_kv_heads = 1,
     .head_dim = 512,
     .ffn_dim = 6144,
     .n_ctx = 131072,
     .theta = 1e6f,
     .eps = 1e-6f,
     .tied = 1,
     .qk_norm = 1,
     .vocab = VOCAB_GEMMA3},
};

static const gemma4_extra k_gemma4[] = {
    {"gemma4-tiny", 16, 3, 16, 16, 4, 3, 32, 256, 10000.0f, 30.0f},
    {"gemma4-e2b", 512, 5, 256, 256, 64, 20, 256, 12288, 10000.0f, 30.0f},
};

const gemma4_extra *rk_mk_gemma4_of(const char *name) {
    for (size_t i = 0; i < sizeof k_gemma4 / sizeof k_gemma4[0]; i++)
        if (strcmp(k_gemma4[i].name, name) == 0) return &k_gemma4[i];
    return NULL;
}

static const gemma_extra k_gemma[] = {
    {"gemma2-tiny", 16, 50.0f, 30.0f, 0.0f},
    {"gemma3-micro", 16, 0.0f, 0.0f, 0.0f},
    {"gemma3-tiny", 16, 0.0f, 0.0f, 0.0f},
    {"gemma3-1b", 512, 0.0f, 0.0f, 0.0f},
};

/* The Gemma additions of the preset named name, NULL for the others. */
const gemma_extra *rk_mk_gemma_of(const char *name) {
    for (size_t i = 0; i < sizeof k_gemma / sizeof k_gemma[0]; i++)
        if (strcmp(k_gemma[i].name, name) == 0) return &k_gemma[i];
    return NULL;
}

#define N_PRESETS (sizeof k_presets / sizeof k_presets[0])
_Static_assert(sizeof k_infos / sizeof k_infos[0] == N_PRESETS, "one info line per preset");

/* Return the preset table; see mkmodel.h. */
const rk_mkmodel_preset_info *rk_mkmodel_presets(size_t *out_n) {
    if (out_n) *out_n = N_PRESETS;
    return k_infos;
}

/* Find a preset by name (NULL = "tiny"); *out_name gets its static name. */
rk_status rk_mk_preset_find(const char *name, const preset **out, const char **out_name) {
    if (!name) name = "tiny";
    for (size_t i = 0; i < N_PRESETS; i++)
        if (strcmp(k_infos[i].name, name) == 0) {
            *out = &k_presets[i];
            if (out_name) *out_name = k_infos[i].name;
            return RK_OK;
        }
    char list[512] = "";
    for (size_t i = 0; i < N_PRESETS; i++) {
        strncat(list, i ? ", " : "", sizeof list - strlen(list) - 1);
        strncat(list, k_infos[i].name, sizeof list - strlen(list) - 1);
    }
    return rk_errorf(RK_ERR_NOT_FOUND, "mkmodel: unknown preset '%s' (presets: %s)", name, list);
}

/* Return a preset's shape; see mkmodel.h. */
rk_status rk_mkmodel_preset_hparams(const char *preset_name, rk_mkmodel_hparams *out) {
    const preset *p;
    rk_status st = rk_mk_preset_find(preset_name, &p, NULL);
    if (st) return st;
    memset(out, 0, sizeof *out);
    out->arch = p->arch;
    out->n_layers = p->n_layers;
    out->dim = p->dim;
    out->n_heads = p->n_heads;
    out->n_kv_heads = p->n_kv_heads;
    out->head_dim = p->head_dim;
    out->ffn_dim = p->ffn_dim;
    out->n_ctx = p->n_ctx;
    out->rope_theta = p->theta;
    out->rms_eps = p->eps;
    out->tied_embeddings = p->tied;
    out->qkv_bias = p->qkv_bias;
    out->qk_norm = p->qk_norm;
    out->n_expert = p->n_expert;
    out->n_expert_used = p->n_expert_used;
    out->ffn_exp = p->ffn_exp;
    if (p->vocab == VOCAB_QWEN3) {
        out->n_vocab = QWEN3_N_VOCAB;
    } else if (p->vocab == VOCAB_GEMMA3) {
        out->n_vocab = GEMMA3_N_VOCAB;
    } else if (p->vocab == VOCAB_TINY_32000) {
        out->n_vocab = LLAMA_N_VOCAB;
    } else if (p->vocab == VOCAB_PHI3) {
        out->n_vocab = PHI3_N_VOCAB;
    } else if (p->vocab == VOCAB_PHI4) {
        out->n_vocab = PHI4_N_VOCAB;
    } else if (p->vocab == VOCAB_HARMONY) {
        out->n_vocab = HARMONY_N_VOCAB;
    } else {
        rk_vocab v;
        if ((st = rk_vocab_tiny(&v))) return st;
        out->n_vocab = v.n_tokens;
        rk_vocab_free(&v);
    }
    return RK_OK;
}
