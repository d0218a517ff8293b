/* tests/test_mkmodel.c — the synthetic model writer: presets build, read back
 * with the expected hyper-parameters, tensor names, shapes and types, and the
 * weights are deterministic per seed and identical (before rounding) across
 * weight types. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/gguf.h"
#include "engine/mkmodel.h"
#include "kernels/kernels.h"
#include "tests/testutil.h"

#define QWEN3_VOCAB "tokenizers/qwen3/tokenizer.json"

/* ---------------------------------------------------------------- helpers */

static void build(const char *preset, rk_ggml_type wtype, uint64_t seed, const char *vocab,
                  void **buf, size_t *len) {
    rk_mkmodel_opts o;
    rk_mkmodel_opts_default(&o);
    o.preset = preset;
    o.wtype = wtype;
    o.seed = seed;
    o.vocab_path = vocab;
    rk_status st = rk_mkmodel_build_memory(&o, buf, len);
    cr_assert_eq(st, RK_OK, "%s: %s", preset, rk_error_message());
}

static uint32_t get_u32(const rk_gguf *g, const char *key) {
    uint32_t v = 0;
    cr_assert_eq(rk_gguf_get_u32(g, key, &v), RK_OK, "key %s", key);
    return v;
}

static float get_f32(const rk_gguf *g, const char *key) {
    float v = 0;
    cr_assert_eq(rk_gguf_get_f32(g, key, &v), RK_OK, "key %s", key);
    return v;
}

static const char *get_str(const rk_gguf *g, const char *key) {
    const char *s = NULL;
    cr_assert_eq(rk_gguf_get_str(g, key, &s, NULL), RK_OK, "key %s", key);
    return s;
}

/* Assert tensor name exists with type and shape {ne0} or {ne0, ne1} (ne1 = 0: 1-D). */
static void expect_tensor(const rk_gguf *g, const char *name, uint32_t type, int64_t ne0,
                          int64_t ne1) {
    const rk_gguf_tensor *t = rk_gguf_find_tensor(g, name);
    cr_assert_not_null(t, "tensor %s missing", name);
    cr_assert_eq(t->type, type, "%s: type %s", name, rk_ggml_type_name(t->type));
    cr_assert_eq(t->n_dims, ne1 ? 2u : 1u, "%s: %u dims", name, t->n_dims);
    cr_assert_eq(t->ne[0], ne0, "%s: ne[0] = %lld", name, (long long)t->ne[0]);
    if (ne1) cr_assert_eq(t->ne[1], ne1, "%s: ne[1] = %lld", name, (long long)t->ne[1]);
}

/* Check the per-layer tensors of a preset with the given shape. */
static void expect_layers(const rk_gguf *g, int n_layers, uint32_t wt, int64_t dim, int64_t q_dim,
                          int64_t kv_dim, int64_t ffn, int bias, int qk_norm, int64_t head_dim) {
    char name[96];
    for (int l = 0; l < n_layers; l++) {
#define T(suffix, type, a, b)                                                                      \
    snprintf(name, sizeof name, "blk.%d." suffix, l);                                              \
    expect_tensor(g, name, type, a, b)
        T("attn_norm.weight", RK_GGML_F32, dim, 0);
        T("attn_q.weight", wt, dim, q_dim);
        T("attn_k.weight", wt, dim, kv_dim);
        T("attn_v.weight", wt, dim, kv_dim);
        T("attn_output.weight", wt, q_dim, dim);
        T("ffn_norm.weight", RK_GGML_F32, dim, 0);
        T("ffn_gate.weight", wt, dim, ffn);
        T("ffn_up.weight", wt, dim, ffn);
        T("ffn_down.weight", wt, ffn, dim);
        if (bias) {
            T("attn_q.bias", RK_GGML_F32, q_dim, 0);
            T("attn_k.bias", RK_GGML_F32, kv_dim, 0);
            T("attn_v.bias", RK_GGML_F32, kv_dim, 0);
        } else {
            snprintf(name, sizeof name, "blk.%d.attn_q.bias", l);
            cr_assert_null(rk_gguf_find_tensor(g, name));
        }
        if (qk_norm) {
            T("attn_q_norm.weight", RK_GGML_F32, head_dim, 0);
            T("attn_k_norm.weight", RK_GGML_F32, head_dim, 0);
        } else {
            snprintf(name, sizeof name, "blk.%d.attn_q_norm.weight", l);
            cr_assert_null(rk_gguf_find_tensor(g, name));
        }
#undef T
    }
    snprintf(name, sizeof name, "blk.%d.attn_q.weight", n_layers);
    cr_assert_null(rk_gguf_find_tensor(g, name), "one layer too many");
}

/* ---------------------------------------------------------------- presets */

Test(mkmodel, lists_the_presets_with_descriptions) {
    size_t n = 0;
    const rk_mkmodel_preset_info *p = rk_mkmodel_presets(&n);
    const char *names[] = {"tiny",
                           "qwen3-0.6b",
                           "qwen3-tiny",
                           "qwen2-tiny",
                           "llama-1b",
                           "qwen3-8b",
                           "qwen3-embedding-tiny",
                           "qwen3-reranker-tiny",
                           "phi3-tiny",
                           "qwen3moe-tiny",
                           "qwen3moe-a3b-12l",
                           "gemma2-tiny",
                           "gemma3-micro",
                           "gemma3-tiny",
                           "gemma3-1b"};
    size_t n_names = sizeof names / sizeof names[0];
    cr_assert_geq(n, n_names);
    for (size_t i = 0; i < n; i++) cr_assert_gt(strlen(p[i].description), 20);
    for (size_t k = 0; k < n_names; k++) {
        int found = 0;
        for (size_t i = 0; i < n; i++) found |= !strcmp(p[i].name, names[k]);
        cr_expect(found, "preset %s is not listed", names[k]);
    }
    cr_assert_str_eq(p[0].name, "tiny");
}

/* The reranker preset is written as the reference converter writes
 * Qwen3-Reranker: rank pooling, the yes/no labels, the rerank prompt and a
 * two-row head. */
Test(mkmodel, the_reranker_preset_has_the_rank_pooling_head_and_prompt) {
    const char *vocab = rk_test_shared_path("tokenizers/qwen3/tokenizer.json");
    if (!vocab) cr_skip_test("missing ../shared/tokenizers/qwen3/tokenizer.json");
    rk_mkmodel_opts o;
    rk_mkmodel_opts_default(&o);
    o.preset = "qwen3-reranker-tiny";
    o.vocab_path = vocab;
    void *buf;
    size_t len;
    cr_assert_eq(rk_mkmodel_build_memory(&o, &buf, &len), RK_OK, "%s", rk_error_message());
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open_memory(buf, len, &g), RK_OK, "%s", rk_error_message());
    uint32_t pooling = 0;
    cr_expect_eq(rk_gguf_get_u32(g, "qwen3.pooling_type", &pooling), RK_OK);
    cr_expect_eq(pooling, 4);
    const char *const *labels;
    size_t n_labels = 0;
    cr_assert_eq(rk_gguf_get_arr_str(g, "qwen3.classifier.output_labels", &labels, NULL, &n_labels),
                 RK_OK);
    cr_assert_eq(n_labels, 2);
    cr_expect_str_eq(labels[0], "yes");
    cr_expect_str_eq(labels[1], "no");
    const char *tmpl;
    size_t tlen;
    cr_assert_eq(rk_gguf_get_str(g, "tokenizer.chat_template.rerank", &tmpl, &tlen), RK_OK);
    cr_expect(strstr(tmpl, "<Query>: {query}\n<Document>: {document}<|im_end|>"), "%s", tmpl);
    const rk_gguf_tensor *t = rk_gguf_find_tensor(g, "cls.output.weight");
    cr_assert_not_null(t);
    cr_expect_eq(t->ne[0], 128);
    cr_expect_eq(t->ne[1], 2);
    /* Its rows are the (tied) output projection's rows of "yes" and "no". */
    const char *const *toks;
    size_t n_toks = 0;
    cr_assert_eq(rk_gguf_get_arr_str(g, "tokenizer.ggml.tokens", &toks, NULL, &n_toks), RK_OK);
    int64_t ids[2] = {-1, -1};
    for (size_t i = 0; i < n_toks; i++) {
        if (ids[0] < 0 && !strcmp(toks[i], "yes")) ids[0] = (int64_t)i;
        if (ids[1] < 0 && !strcmp(toks[i], "no")) ids[1] = (int64_t)i;
    }
    const rk_gguf_tensor *e = rk_gguf_find_tensor(g, "token_embd.weight");
    cr_assert(e && ids[0] >= 0 && ids[1] >= 0);
    for (int k = 0; k < 2; k++)
        cr_expect_eq(memcmp((const float *)t->data + k * 128, (const float *)e->data + ids[k] * 128,
                            128 * sizeof(float)),
                     0, "row %d is not token %lld's", k, (long long)ids[k]);
    rk_gguf_close(g);
    free(buf);
}

Test(mkmodel, preset_shapes_match_the_real_models) {
    rk_mkmodel_hparams h;
    cr_assert_eq(rk_mkmodel_preset_hparams("qwen3-8b", &h), RK_OK);
    cr_assert_str_eq(h.arch, "qwen3");
    cr_assert_eq(h.n_layers, 36);
    cr_assert_eq(h.dim, 4096);
    cr_assert_eq(h.n_heads, 32);
    cr_assert_eq(h.n_kv_heads, 8);
    cr_assert_eq(h.head_dim, 128);
    cr_assert_eq(h.ffn_dim, 12288);
    cr_assert_eq(h.tied_embeddings, 0);
    cr_assert_eq(h.n_vocab, 151936);
    cr_assert_eq(h.n_expert, 0);
    cr_assert_eq(rk_mkmodel_preset_hparams("qwen3moe-a3b-12l", &h), RK_OK);
    cr_assert_str_eq(h.arch, "qwen3moe");
    cr_assert_eq(h.n_layers, 12);
    cr_assert_eq(h.dim, 2048);
    cr_assert_eq(h.n_heads, 32);
    cr_assert_eq(h.n_kv_heads, 4);
    cr_assert_eq(h.head_dim, 128);
    cr_assert_eq(h.n_expert, 128);
    cr_assert_eq(h.n_expert_used, 8);
    cr_assert_eq(h.ffn_exp, 768);
    cr_assert_eq(h.tied_embeddings, 0);
    cr_assert_eq(rk_mkmodel_preset_hparams("qwen3-0.6b", &h), RK_OK);
    cr_assert_eq(h.n_layers, 28);
    cr_assert_eq(h.dim, 1024);
    cr_assert_eq(h.n_heads, 16);
    cr_assert_eq(h.n_kv_heads, 8);
    cr_assert_eq(h.head_dim, 128);
    cr_assert_eq(h.ffn_dim, 3072);
    cr_assert_eq(h.n_ctx, 40960);
    cr_assert_eq(h.rope_theta, 1e6f);
    cr_assert_eq(h.rms_eps, 1e-6f);
    cr_assert_eq(h.tied_embeddings, 1);
    cr_assert_eq(h.qk_norm, 1);
    cr_assert_eq(h.qkv_bias, 0);
    cr_assert_eq(rk_mkmodel_preset_hparams("llama-1b", &h), RK_OK);
    cr_assert_str_eq(h.arch, "llama");
    cr_assert_eq(h.n_layers, 22);
    cr_assert_eq(h.dim, 2048);
    cr_assert_eq(h.n_heads, 32);
    cr_assert_eq(h.n_kv_heads, 4);
    cr_assert_eq(h.head_dim, 64);
    cr_assert_eq(h.ffn_dim, 5632);
    cr_assert_eq(h.n_ctx, 2048);
    cr_assert_eq(h.n_vocab, 32000);
    cr_assert_eq(rk_mkmodel_preset_hparams("qwen2-tiny", &h), RK_OK);
    cr_assert_eq(h.qkv_bias, 1);
    cr_assert_eq(h.qk_norm, 0);
    cr_assert_eq(rk_mkmodel_preset_hparams("gpt-5", &h), RK_ERR_NOT_FOUND);
    cr_assert_not_null(strstr(rk_error_message(), "qwen3-tiny"), "%s", rk_error_message());
}

Test(mkmodel, parses_weight_type_names) {
    rk_ggml_type t;
    cr_assert_eq(rk_mkmodel_parse_wtype("f32", &t), RK_OK);
    cr_assert_eq(t, RK_GGML_F32);
    cr_assert_eq(rk_mkmodel_parse_wtype("F16", &t), RK_OK);
    cr_assert_eq(t, RK_GGML_F16);
    cr_assert_eq(rk_mkmodel_parse_wtype("bf16", &t), RK_OK);
    cr_assert_eq(t, RK_GGML_BF16);
    static const struct {
        const char *name;
        rk_ggml_type type;
    } q[] = {{"q8_0", RK_GGML_Q8_0},   {"Q4_0", RK_GGML_Q4_0},    {"q4_k_m", RK_GGML_Q4_K},
             {"q5_k_m", RK_GGML_Q5_K}, {"q6_k", RK_GGML_Q6_K},    {"Q3_K_M", RK_GGML_Q3_K},
             {"q2_k", RK_GGML_Q2_K},   {"iq4_xs", RK_GGML_IQ4_XS}};
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) {
        cr_assert_eq(rk_mkmodel_parse_wtype(q[i].name, &t), RK_OK, "%s", q[i].name);
        cr_assert_eq(t, q[i].type, "%s", q[i].name);
    }
    cr_assert_eq(rk_mkmodel_parse_wtype("q4_k", &t), RK_ERR_INVALID); /* a tensor type, not a mix */
    cr_assert_eq(rk_mkmodel_parse_wtype("q3_k", &t), RK_ERR_INVALID);
    cr_assert_eq(rk_mkmodel_parse_wtype("iq4_nl", &t), RK_ERR_INVALID);
    cr_assert_eq(rk_mkmodel_parse_wtype(NULL, &t), RK_ERR_INVALID);
}

Test(mkmodel, rejects_unknown_presets_weight_types_and_missing_vocabularies) {
    rk_mkmodel_opts o;
    rk_mkmodel_opts_default(&o);
    void *buf = NULL;
    size_t len = 0;
    o.preset = "nope";
    cr_assert_eq(rk_mkmodel_build_memory(&o, &buf, &len), RK_ERR_NOT_FOUND);
    cr_assert_not_null(strstr(rk_error_message(), "unknown preset 'nope'"));
    o.preset = "tiny";
    o.wtype = RK_GGML_Q4_1; /* a tensor type, no mix of ours */
    cr_assert_eq(rk_mkmodel_build_memory(&o, &buf, &len), RK_ERR_INVALID);
    cr_assert_not_null(strstr(rk_error_message(), "Q4_1"));
    o.wtype = RK_GGML_F32;
    o.preset = "qwen3-tiny";
    o.vocab_path = "/nonexistent/tokenizer.json";
    char *dir = rk_test_tmpdir("mkmodel");
    char path[4096];
    snprintf(path, sizeof path, "%s/never.gguf", dir);
    rk_status st = rk_mkmodel_write(path, &o);
    cr_assert_neq(st, RK_OK);
    cr_assert_not_null(strstr(rk_error_message(), "/nonexistent/tokenizer.json"), "%s",
                       rk_error_message());
    cr_assert_not_null(strstr(rk_error_message(), "qwen3-tiny"));
    struct stat sb;
    cr_assert_eq(stat(path, &sb), -1);
    cr_assert_null(buf);
    cr_expect_eq(rmdir(dir), 0);
    free(dir);
}

/* ---------------------------------------------------------------- tiny */

Test(mkmodel, tiny_builds_in_memory_with_the_expected_hyper_parameters) {
    void *buf;
    size_t len;
    build("tiny", RK_GGML_F32, 42, NULL, &buf, &len);
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open_memory(buf, len, &g), RK_OK, "%s", rk_error_message());
    cr_assert_str_eq(get_str(g, "general.architecture"), "llama");
    cr_assert_str_eq(get_str(g, "general.name"), "ragkv synthetic tiny");
    cr_assert_eq(get_u32(g, "general.file_type"), 0);
    cr_assert_eq(get_u32(g, "llama.block_count"), 4);
    cr_assert_eq(get_u32(g, "llama.embedding_length"), 128);
    cr_assert_eq(get_u32(g, "llama.attention.head_count"), 4);
    cr_assert_eq(get_u32(g, "llama.attention.head_count_kv"), 2);
    cr_assert_eq(get_u32(g, "llama.attention.key_length"), 32);
    cr_assert_eq(get_u32(g, "llama.attention.value_length"), 32);
    cr_assert_eq(get_u32(g, "llama.feed_forward_length"), 384);
    cr_assert_eq(get_u32(g, "llama.context_length"), 4096);
    cr_assert_eq(get_u32(g, "llama.rope.dimension_count"), 32);
    cr_assert_eq(get_f32(g, "llama.rope.freq_base"), 10000.0f);
    cr_assert_eq(get_f32(g, "llama.attention.layer_norm_rms_epsilon"), 1e-5f);
    cr_assert_str_eq(get_str(g, "tokenizer.ggml.model"), "llama");
    cr_assert_eq(get_u32(g, "tokenizer.ggml.bos_token_id"), 1);
    cr_assert_eq(get_u32(g, "tokenizer.ggml.eos_token_id"), 2);
    int add_bos = 0;
    cr_assert_eq(rk_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add_bos), RK_OK);
    cr_assert_eq(add_bos, 1);

    const char *const *toks;
    size_t n_vocab;
    cr_assert_eq(rk_gguf_get_arr_str(g, "tokenizer.ggml.tokens", &toks, NULL, &n_vocab), RK_OK);
    cr_assert_gt(n_vocab, 259);
    cr_assert_str_eq(toks[1], "<s>");
    cr_assert_eq(get_u32(g, "llama.vocab_size"), n_vocab);
    rk_mkmodel_hparams h;
    cr_assert_eq(rk_mkmodel_preset_hparams("tiny", &h), RK_OK);
    cr_assert_eq((size_t)h.n_vocab, n_vocab);

    cr_assert_eq(rk_gguf_n_tensors(g), 1 + 4 * 9 + 2);
    expect_tensor(g, "token_embd.weight", RK_GGML_F32, 128, (int64_t)n_vocab);
    expect_tensor(g, "output.weight", RK_GGML_F32, 128, (int64_t)n_vocab);
    expect_tensor(g, "output_norm.weight", RK_GGML_F32, 128, 0);
    expect_layers(g, 4, RK_GGML_F32, 128, 128, 64, 384, 0, 0, 32);

    /* Sane values: matrices centred with std 1/sqrt(in), norms near 1. */
    const rk_gguf_tensor *t = rk_gguf_find_tensor(g, "blk.0.ffn_down.weight");
    const float *w = t->data;
    size_t n = (size_t)(t->ne[0] * t->ne[1]);
    double sum = 0, sq = 0;
    for (size_t i = 0; i < n; i++) {
        cr_assert(isfinite(w[i]));
        sum += w[i];
        sq += (double)w[i] * w[i];
    }
    double mean = sum / (double)n, std = sqrt(sq / (double)n - mean * mean);
    cr_assert_lt(fabs(mean), 0.005);
    cr_assert_float_eq(std, 1.0 / sqrt(384.0), 0.003);
    const float *norm = rk_gguf_find_tensor(g, "blk.3.attn_norm.weight")->data;
    for (int i = 0; i < 128; i++) cr_assert(norm[i] >= 0.95f && norm[i] <= 1.05f);
    rk_gguf_close(g);
    free(buf);
}

Test(mkmodel, the_same_seed_gives_the_same_bytes_and_another_seed_differs) {
    void *a, *b, *c;
    size_t la, lb, lc;
    build("tiny", RK_GGML_BF16, 7, NULL, &a, &la);
    build("tiny", RK_GGML_BF16, 7, NULL, &b, &lb);
    build("tiny", RK_GGML_BF16, 8, NULL, &c, &lc);
    cr_assert_eq(la, lb);
    cr_assert_eq(memcmp(a, b, la), 0);
    cr_assert_eq(la, lc);
    rk_gguf *ga, *gc;
    cr_assert_eq(rk_gguf_open_memory(a, la, &ga), RK_OK);
    cr_assert_eq(rk_gguf_open_memory(c, lc, &gc), RK_OK);
    for (int64_t i = 0; i < rk_gguf_n_tensors(ga); i++) {
        const rk_gguf_tensor *ta = rk_gguf_tensor_at(ga, i), *tc = rk_gguf_tensor_at(gc, i);
        cr_assert_str_eq(ta->name, tc->name);
        cr_assert_neq(memcmp(ta->data, tc->data, ta->n_bytes), 0, "%s equal across seeds",
                      ta->name);
    }
    uint64_t seed;
    cr_assert_eq(rk_gguf_get_u64(gc, "ragkv.synthetic.seed", &seed), RK_OK);
    cr_assert_eq(seed, 8);
    rk_gguf_close(ga);
    rk_gguf_close(gc);
    free(a);
    free(b);
    free(c);
}

Test(mkmodel, f16_and_bf16_weights_are_the_f32_weights_rounded) {
    void *b32, *b16, *bbf;
    size_t l32, l16, lbf;
    build("tiny", RK_GGML_F32, 99, NULL, &b32, &l32);
    build("tiny", RK_GGML_F16, 99, NULL, &b16, &l16);
    build("tiny", RK_GGML_BF16, 99, NULL, &bbf, &lbf);
    rk_gguf *g32, *g16, *gbf;
    cr_assert_eq(rk_gguf_open_memory(b32, l32, &g32), RK_OK);
    cr_assert_eq(rk_gguf_open_memory(b16, l16, &g16), RK_OK);
    cr_assert_eq(rk_gguf_open_memory(bbf, lbf, &gbf), RK_OK);
    cr_assert_eq(get_u32(g16, "general.file_type"), 1);
    cr_assert_eq(get_u32(gbf, "general.file_type"), 32);
    cr_assert_lt(l16, l32);
    int n_checked = 0;
    for (int64_t i = 0; i < rk_gguf_n_tensors(g32); i++) {
        const rk_gguf_tensor *t32 = rk_gguf_tensor_at(g32, i);
        const rk_gguf_tensor *t16 = rk_gguf_tensor_at(g16, i);
        const rk_gguf_tensor *tbf = rk_gguf_tensor_at(gbf, i);
        cr_assert_str_eq(t32->name, t16->name);
        cr_assert_eq(t32->type, RK_GGML_F32);
        if (t32->n_dims == 1) {
            cr_assert_eq(t16->type, RK_GGML_F32, "%s: 1-D tensors stay F32", t16->name);
            cr_assert_eq(memcmp(t32->data, t16->data, t32->n_bytes), 0);
            continue;
        }
        cr_assert_eq(t16->type, RK_GGML_F16, "%s", t16->name);
        cr_assert_eq(tbf->type, RK_GGML_BF16, "%s", tbf->name);
        const float *f = t32->data;
        const uint16_t *h = t16->data, *bf = tbf->data;
        size_t n = (size_t)(t32->ne[0] * t32->ne[1]);
        for (size_t j = 0; j < n; j++) {
            cr_assert_eq(h[j], rk_f32_to_f16(f[j]), "%s[%zu]", t32->name, j);
            cr_assert_eq(bf[j], rk_f32_to_bf16(f[j]), "%s[%zu]", t32->name, j);
        }
        n_checked++;
    }
    cr_assert_eq(n_checked, 1 + 4 * 7 + 1);
    rk_gguf_close(g32);
    rk_gguf_close(g16);
    rk_gguf_close(gbf);
    free(b32);
    free(b16);
    free(bbf);
}

/* The quantized types: each matrix holds exactly the f32 weights quantized
 * by rk_quantize, in the type the mix gives it (tiny: dim 128 and FFN 384,
 * so K types fall back to Q8_0 everywhere; Q4_0 keeps the untied output
 * projection wide, at Q8_0 since Q6_K does not fit 128). */
Test(mkmodel, quantized_weights_are_the_f32_weights_quantized) {
    static const struct {
        rk_ggml_type wt;
        uint32_t file_type;
        rk_ggml_type body, output;
    } k[] = {{RK_GGML_Q8_0, 7, RK_GGML_Q8_0, RK_GGML_Q8_0},
             {RK_GGML_Q4_0, 2, RK_GGML_Q4_0, RK_GGML_Q8_0},
             {RK_GGML_Q4_K, 15, RK_GGML_Q8_0, RK_GGML_Q8_0},
             {RK_GGML_Q5_K, 17, RK_GGML_Q8_0, RK_GGML_Q8_0},
             {RK_GGML_Q6_K, 18, RK_GGML_Q8_0, RK_GGML_Q8_0}};
    void *b32;
    size_t l32;
    build("tiny", RK_GGML_F32, 7, NULL, &b32, &l32);
    rk_gguf *g32;
    cr_assert_eq(rk_gguf_open_memory(b32, l32, &g32), RK_OK);
    for (size_t w = 0; w < sizeof k / sizeof k[0]; w++) {
        void *bq;
        size_t lq;
        build("tiny", k[w].wt, 7, NULL, &bq, &lq);
        rk_gguf *gq;
        cr_assert_eq(rk_gguf_open_memory(bq, lq, &gq), RK_OK, "%s", rk_error_message());
        cr_assert_eq(get_u32(gq, "general.file_type"), k[w].file_type);
        cr_assert_lt(lq, l32 / 3);
        for (int64_t i = 0; i < rk_gguf_n_tensors(g32); i++) {
            const rk_gguf_tensor *tf = rk_gguf_tensor_at(g32, i);
            const rk_gguf_tensor *tq = rk_gguf_tensor_at(gq, i);
            cr_assert_str_eq(tf->name, tq->name);
            if (tf->n_dims == 1) {
                cr_assert_eq(tq->type, RK_GGML_F32, "%s: 1-D tensors stay F32", tq->name);
                continue;
            }
            rk_ggml_type want = strcmp(tq->name, "output.weight") ? k[w].body : k[w].output;
            cr_assert_eq(tq->type, want, "%s: %s, want %s", tq->name, rk_ggml_type_name(tq->type),
                         rk_ggml_type_name(want));
            rk_dtype dt = want == RK_GGML_Q8_0 ? RK_DTYPE_Q8_0 : RK_DTYPE_Q4_0;
            size_t n = (size_t)(tf->ne[0] * tf->ne[1]);
            unsigned char *expect = malloc(tq->n_bytes);
            cr_assert_not_null(expect);
            rk_quantize(expect, tf->data, dt, n);
            cr_assert_eq(memcmp(expect, tq->data, tq->n_bytes), 0, "%s differs from quantize(f32)",
                         tq->name);
            free(expect);
        }
        rk_gguf_close(gq);
        free(bq);
    }
    rk_gguf_close(g32);
    free(b32);
}

/* The low-bit mixes on tiny (rows of 128 and 384, no whole super-block):
 * each type falls back as the reference quantizer's does, Q2_K, Q3_K and
 * IQ4_XS to IQ4_NL, Q4_K to Q5_0, Q5_K to Q5_1, Q6_K (the output) to Q8_0;
 * q3_k_m keeps attn_v wider in layers 0 and 1 and attn_output and
 * ffn_down at (the fallback of) Q4_K. Each matrix holds the f32 weights
 * quantized by rk_quantize. */
static rk_ggml_type tiny_low_bit_type(rk_ggml_type wt, const char *name) {
    if (!strcmp(name, "output.weight")) return RK_GGML_Q8_0;
    if (wt != RK_GGML_Q3_K) return RK_GGML_IQ4_NL;
    if (strstr(name, "attn_v"))
        return !strncmp(name, "blk.0.", 6) || !strncmp(name, "blk.1.", 6) ? RK_GGML_Q5_1
                                                                          : RK_GGML_Q5_0;
    if (strstr(name, "attn_output") || strstr(name, "ffn_down")) return RK_GGML_Q5_0;
    return RK_GGML_IQ4_NL;
}

static rk_dtype dtype_of_ggml(rk_ggml_type t) {
    switch (t) {
    case RK_GGML_Q8_0: return RK_DTYPE_Q8_0;
    case RK_GGML_Q5_0: return RK_DTYPE_Q5_0;
    case RK_GGML_Q5_1: return RK_DTYPE_Q5_1;
    case RK_GGML_IQ4_NL: return RK_DTYPE_IQ4_NL;
    case RK_GGML_Q2_K: return RK_DTYPE_Q2_K;
    case RK_GGML_Q3_K: return RK_DTYPE_Q3_K;
    case RK_GGML_Q4_K: return RK_DTYPE_Q4_K;
    case RK_GGML_Q6_K: return RK_DTYPE_Q6_K;
    case RK_GGML_IQ4_XS: return RK_DTYPE_IQ4_XS;
    default: cr_assert_fail("type %s", rk_ggml_type_name(t));
    }
    return RK_DTYPE_F32;
}

Test(mkmodel, low_bit_mixes_fall_back_as_the_reference_quantizer_does) {
    static const struct {
        rk_ggml_type wt;
        uint32_t file_type;
    } k[] = {{RK_GGML_Q3_K, 12}, {RK_GGML_Q2_K, 10}, {RK_GGML_IQ4_XS, 30}};
    void *b32;
    size_t l32;
    build("tiny", RK_GGML_F32, 7, NULL, &b32, &l32);
    rk_gguf *g32;
    cr_assert_eq(rk_gguf_open_memory(b32, l32, &g32), RK_OK);
    for (size_t w = 0; w < sizeof k / sizeof k[0]; w++) {
        void *bq;
        size_t lq;
        build("tiny", k[w].wt, 7, NULL, &bq, &lq);
        rk_gguf *gq;
        cr_assert_eq(rk_gguf_open_memory(bq, lq, &gq), RK_OK, "%s", rk_error_message());
        cr_assert_eq(get_u32(gq, "general.file_type"), k[w].file_type);
        for (int64_t i = 0; i < rk_gguf_n_tensors(g32); i++) {
            const rk_gguf_tensor *tf = rk_gguf_tensor_at(g32, i);
            const rk_gguf_tensor *tq = rk_gguf_tensor_at(gq, i);
            if (tf->n_dims == 1) continue;
            rk_ggml_type want = tiny_low_bit_type(k[w].wt, tq->name);
            cr_assert_eq(tq->type, want, "%s: %s, want %s", tq->name, rk_ggml_type_name(tq->type),
                         rk_ggml_type_name(want));
            unsigned char *expect = malloc(tq->n_bytes);
            cr_assert_not_null(expect);
            rk_quantize(expect, tf->data, dtype_of_ggml(want), (size_t)(tf->ne[0] * tf->ne[1]));
            cr_assert_eq(memcmp(expect, tq->data, tq->n_bytes), 0, "%s differs from quantize(f32)",
                         tq->name);
            free(expect);
        }
        rk_gguf_close(gq);
        free(bq);
    }
    rk_gguf_close(g32);
    free(b32);
}

/* qwen3-tiny's ffn_down (rows of 256) in the low-bit mixes: Q4_K in
 * q3_k_m (past the first sixteenth of two layers), Q3_K in q2_k, and
 * IQ4_XS's own type in iq4_xs (no layer in the first eighth); the rows of
 * 128 fall back to IQ4_NL, the tied embedding (the output) to Q8_0. */
Test(mkmodel, low_bit_mixes_put_their_types_where_rows_are_whole_super_blocks) {
    RK_SKIP_IF_LIGHT(); /* builds with the real vocabulary: slow under the sanitizer */
    char *vocab;
    RK_REQUIRE_SHARED(vocab, QWEN3_VOCAB);
    static const rk_ggml_type mixes[][2] = {{RK_GGML_Q3_K, RK_GGML_Q4_K},
                                            {RK_GGML_Q2_K, RK_GGML_Q3_K},
                                            {RK_GGML_IQ4_XS, RK_GGML_IQ4_XS}};
    for (size_t w = 0; w < 3; w++) {
        void *b;
        size_t l;
        build("qwen3-tiny", mixes[w][0], 3, vocab, &b, &l);
        rk_gguf *g;
        cr_assert_eq(rk_gguf_open_memory(b, l, &g), RK_OK);
        for (int layer = 0; layer < 2; layer++) {
            char name[64];
            snprintf(name, sizeof name, "blk.%d.ffn_down.weight", layer);
            cr_assert_eq(rk_gguf_find_tensor(g, name)->type, mixes[w][1], "%s %s",
                         rk_ggml_type_name(mixes[w][0]), name);
        }
        cr_assert_eq(rk_gguf_find_tensor(g, "blk.1.ffn_up.weight")->type, RK_GGML_IQ4_NL);
        cr_assert_eq(rk_gguf_find_tensor(g, "token_embd.weight")->type, RK_GGML_Q8_0);
        rk_gguf_close(g);
        free(b);
    }
    free(vocab);
}

/* qwen3-tiny's FFN of 256 takes K types: ffn_down (rows of 256) is Q6_K in
 * the K mixes' wider layers (of two layers, the second) and in q6_k, the
 * mix's own type in the other layer; the rows of 128 fall back to Q8_0. */
Test(mkmodel, k_mixes_put_q6_k_where_rows_are_whole_super_blocks) {
    RK_SKIP_IF_LIGHT(); /* builds with the real vocabulary: slow under the sanitizer */
    char *vocab;
    RK_REQUIRE_SHARED(vocab, QWEN3_VOCAB);
    static const rk_ggml_type mixes[] = {RK_GGML_Q4_K, RK_GGML_Q5_K, RK_GGML_Q6_K};
    for (size_t w = 0; w < 3; w++) {
        void *b;
        size_t l;
        build("qwen3-tiny", mixes[w], 3, vocab, &b, &l);
        rk_gguf *g;
        cr_assert_eq(rk_gguf_open_memory(b, l, &g), RK_OK);
        cr_assert_eq(rk_gguf_find_tensor(g, "blk.1.ffn_down.weight")->type, RK_GGML_Q6_K);
        cr_assert_eq(rk_gguf_find_tensor(g, "blk.0.ffn_down.weight")->type, mixes[w]);
        cr_assert_eq(rk_gguf_find_tensor(g, "blk.1.ffn_up.weight")->type, RK_GGML_Q8_0);
        cr_assert_eq(rk_gguf_find_tensor(g, "token_embd.weight")->type, RK_GGML_Q8_0);
        rk_gguf_close(g);
        free(b);
    }
    free(vocab);
}

/* ---------------------------------------------------------------- qwen */

/* Write preset with the shared Qwen3 vocabulary to a temp file and open it. */
static rk_gguf *write_and_open(const char *preset, rk_ggml_type wtype, uint64_t seed,
                               const char *vocab, char **out_dir, char *path, size_t path_cap) {
    *out_dir = rk_test_tmpdir("mkmodel");
    snprintf(path, path_cap, "%s/%s.gguf", *out_dir, preset);
    rk_mkmodel_opts o;
    rk_mkmodel_opts_default(&o);
    o.preset = preset;
    o.wtype = wtype;
    o.seed = seed;
    o.vocab_path = vocab;
    cr_assert_eq(rk_mkmodel_write(path, &o), RK_OK, "%s", rk_error_message());
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open(path, &g), RK_OK, "%s", rk_error_message());
    return g;
}

static void remove_model(rk_gguf *g, char *dir, const char *path) {
    rk_gguf_close(g);
    cr_expect_eq(unlink(path), 0);
    cr_expect_eq(rmdir(dir), 0);
    free(dir);
}

static void expect_qwen3_vocab(const rk_gguf *g) {
    cr_assert_str_eq(get_str(g, "tokenizer.ggml.model"), "gpt2");
    cr_assert_str_eq(get_str(g, "tokenizer.ggml.pre"), "qwen2");
    const char *const *toks;
    const uint32_t *lens;
    size_t n;
    cr_assert_eq(rk_gguf_get_arr_str(g, "tokenizer.ggml.tokens", &toks, &lens, &n), RK_OK);
    cr_assert_eq(n, 151936);
    cr_assert_str_eq(toks[151644], "<|im_start|>");
    cr_assert_str_eq(toks[151645], "<|im_end|>");
    cr_assert_str_eq(toks[151643], "<|endoftext|>");
    cr_assert_eq(lens[151644], 12);
    int32_t *types;
    size_t n_types;
    cr_assert_eq(rk_gguf_get_arr_i32(g, "tokenizer.ggml.token_type", &types, &n_types), RK_OK);
    cr_assert_eq(n_types, 151936);
    cr_assert_eq(types[151644], 3); /* control */
    cr_assert_eq(types[151935], 5); /* padding: unused */
    free(types);
    const char *const *merges;
    size_t n_merges;
    cr_assert_eq(rk_gguf_get_arr_str(g, "tokenizer.ggml.merges", &merges, NULL, &n_merges), RK_OK);
    cr_assert_eq(n_merges, 151387);
    cr_assert_eq(get_u32(g, "tokenizer.ggml.bos_token_id"), 151643);
}

Test(mkmodel, qwen3_tiny_has_qwen3_names_shapes_and_the_real_vocabulary) {
    char *vocab;
    RK_REQUIRE_SHARED(vocab, QWEN3_VOCAB);
    char *dir, path[4096];
    rk_gguf *g = write_and_open("qwen3-tiny", RK_GGML_F32, 1, vocab, &dir, path, sizeof path);
    cr_assert_str_eq(get_str(g, "general.architecture"), "qwen3");
    cr_assert_eq(get_u32(g, "qwen3.block_count"), 2);
    cr_assert_eq(get_u32(g, "qwen3.embedding_length"), 128);
    cr_assert_eq(get_u32(g, "qwen3.attention.head_count"), 4);
    cr_assert_eq(get_u32(g, "qwen3.attention.head_count_kv"), 2);
    cr_assert_eq(get_u32(g, "qwen3.attention.key_length"), 32);
    cr_assert_eq(get_u32(g, "qwen3.feed_forward_length"), 256);
    cr_assert_eq(get_u32(g, "qwen3.context_length"), 40960);
    cr_assert_eq(get_f32(g, "qwen3.rope.freq_base"), 1e6f);
    cr_assert_eq(get_f32(g, "qwen3.attention.layer_norm_rms_epsilon"), 1e-6f);
    expect_qwen3_vocab(g);
    cr_assert_eq(rk_gguf_n_tensors(g), 1 + 2 * 11 + 1);
    expect_tensor(g, "token_embd.weight", RK_GGML_F32, 128, 151936);
    expect_tensor(g, "output_norm.weight", RK_GGML_F32, 128, 0);
    cr_assert_null(rk_gguf_find_tensor(g, "output.weight"), "embeddings are tied");
    expect_layers(g, 2, RK_GGML_F32, 128, 128, 64, 256, 0, 1, 32);
    remove_model(g, dir, path);
    free(vocab);
}

Test(mkmodel, qwen2_tiny_has_qkv_biases_and_no_qk_norm) {
    char *vocab;
    RK_REQUIRE_SHARED(vocab, QWEN3_VOCAB);
    char *dir, path[4096];
    rk_gguf *g = write_and_open("qwen2-tiny", RK_GGML_BF16, 1, vocab, &dir, path, sizeof path);
    cr_assert_str_eq(get_str(g, "general.architecture"), "qwen2");
    cr_assert_eq(get_u32(g, "qwen2.block_count"), 2);
    cr_assert_eq(get_u32(g, "qwen2.attention.head_count_kv"), 2);
    cr_assert_eq(get_f32(g, "qwen2.rope.freq_base"), 1e6f);
    cr_assert_eq(get_u32(g, "general.file_type"), 32);
    expect_qwen3_vocab(g);
    cr_assert_eq(rk_gguf_n_tensors(g), 1 + 2 * 12 + 1);
    expect_tensor(g, "token_embd.weight", RK_GGML_BF16, 128, 151936);
    cr_assert_null(rk_gguf_find_tensor(g, "output.weight"));
    expect_layers(g, 2, RK_GGML_BF16, 128, 128, 64, 256, 1, 0, 32);
    const float *bias = rk_gguf_find_tensor(g, "blk.1.attn_k.bias")->data;
    for (int i = 0; i < 64; i++) cr_assert(fabsf(bias[i]) < 0.035f && isfinite(bias[i]));
    remove_model(g, dir, path);
    free(vocab);
}

/* Assert a stacked expert tensor {ne0, ne1, n_expert} of type. */
static void expect_experts(const rk_gguf *g, const char *name, uint32_t type, int64_t ne0,
                           int64_t ne1, int64_t n_expert) {
    const rk_gguf_tensor *t = rk_gguf_find_tensor(g, name);
    cr_assert_not_null(t, "tensor %s missing", name);
    cr_assert_eq(t->type, type, "%s: type %s", name, rk_ggml_type_name(t->type));
    cr_assert_eq(t->n_dims, 3u, "%s: %u dims", name, t->n_dims);
    cr_assert_eq(t->ne[0], ne0, "%s: ne[0] = %lld", name, (long long)t->ne[0]);
    cr_assert_eq(t->ne[1], ne1, "%s: ne[1] = %lld", name, (long long)t->ne[1]);
    cr_assert_eq(t->ne[2], n_expert, "%s: ne[2] = %lld", name, (long long)t->ne[2]);
}

Test(mkmodel, qwen3moe_tiny_has_the_reference_expert_keys_and_stacked_experts) {
    char *vocab;
    RK_REQUIRE_SHARED(vocab, QWEN3_VOCAB);
    char *dir, path[4096];
    rk_gguf *g = write_and_open("qwen3moe-tiny", RK_GGML_Q8_0, 1, vocab, &dir, path, sizeof path);
    cr_assert_str_eq(get_str(g, "general.architecture"), "qwen3moe");
    cr_assert_eq(get_u32(g, "qwen3moe.block_count"), 2);
    cr_assert_eq(get_u32(g, "qwen3moe.embedding_length"), 128);
    cr_assert_eq(get_u32(g, "qwen3moe.expert_count"), 8);
    cr_assert_eq(get_u32(g, "qwen3moe.expert_used_count"), 2);
    cr_assert_eq(get_u32(g, "qwen3moe.expert_feed_forward_length"), 64);
    cr_assert_eq(get_u32(g, "qwen3moe.attention.key_length"), 32);
    expect_qwen3_vocab(g);
    /* per layer: 2 norms, q k v o, 2 QK norms, the router and 3 expert stacks */
    cr_assert_eq(rk_gguf_n_tensors(g), 1 + 2 * 12 + 1);
    char name[96];
    for (int l = 0; l < 2; l++) {
        snprintf(name, sizeof name, "blk.%d.ffn_gate_inp.weight", l);
        expect_tensor(g, name, RK_GGML_F32, 128, 8);
        snprintf(name, sizeof name, "blk.%d.ffn_gate_exps.weight", l);
        expect_experts(g, name, RK_GGML_Q8_0, 128, 64, 8);
        snprintf(name, sizeof name, "blk.%d.ffn_up_exps.weight", l);
        expect_experts(g, name, RK_GGML_Q8_0, 128, 64, 8);
        snprintf(name, sizeof name, "blk.%d.ffn_down_exps.weight", l);
        expect_experts(g, name, RK_GGML_Q8_0, 64, 128, 8);
        snprintf(name, sizeof name, "blk.%d.ffn_gate.weight", l);
        cr_assert_null(rk_gguf_find_tensor(g, name), "no dense FFN");
        snprintf(name, sizeof name, "blk.%d.attn_q_norm.weight", l);
        expect_tensor(g, name, RK_GGML_F32, 32, 0);
    }
    /* Each expert of the stack has its own random weights: expert 0 and 7 differ. */
    const rk_gguf_tensor *t = rk_gguf_find_tensor(g, "blk.1.ffn_up_exps.weight");
    size_t per = t->n_bytes / 8;
    cr_assert_neq(memcmp(t->data, (const char *)t->data + 7 * per, per), 0);
    remove_model(g, dir, path);
    free(vocab);
}

Test(mkmodel, qwen3_tiny_weight_types_and_seeds) {
    RK_SKIP_IF_LIGHT(); /* four builds with the real vocabulary: slow under the sanitizer */
    char *vocab;
    RK_REQUIRE_SHARED(vocab, QWEN3_VOCAB);
    void *a, *b, *c, *d;
    size_t la, lb, lc, ld;
    build("qwen3-tiny", RK_GGML_F16, 5, vocab, &a, &la);
    build("qwen3-tiny", RK_GGML_F16, 5, vocab, &b, &lb);
    build("qwen3-tiny", RK_GGML_F16, 6, vocab, &c, &lc);
    build("qwen3-tiny", RK_GGML_F32, 5, vocab, &d, &ld);
    cr_assert_eq(la, lb);
    cr_assert_eq(memcmp(a, b, la), 0, "same seed, different bytes");
    rk_gguf *ga, *gc, *gd;
    cr_assert_eq(rk_gguf_open_memory(a, la, &ga), RK_OK);
    cr_assert_eq(rk_gguf_open_memory(c, lc, &gc), RK_OK);
    cr_assert_eq(rk_gguf_open_memory(d, ld, &gd), RK_OK);
    const rk_gguf_tensor *ea = rk_gguf_find_tensor(ga, "token_embd.weight");
    const rk_gguf_tensor *ec = rk_gguf_find_tensor(gc, "token_embd.weight");
    const rk_gguf_tensor *ed = rk_gguf_find_tensor(gd, "token_embd.weight");
    cr_assert_eq(ea->type, RK_GGML_F16);
    cr_assert_eq(ed->type, RK_GGML_F32);
    cr_assert_eq(rk_gguf_find_tensor(ga, "blk.0.attn_q_norm.weight")->type, RK_GGML_F32);
    cr_assert_eq(ea->n_bytes, (size_t)128 * 151936 * 2);
    cr_assert_neq(memcmp(ea->data, ec->data, ea->n_bytes), 0, "seeds 5 and 6 gave equal weights");
    const uint16_t *h = ea->data;
    const float *f = ed->data;
    for (size_t j = 0; j < 128 * 151936; j += 997) cr_assert_eq(h[j], rk_f32_to_f16(f[j]));
    rk_gguf_close(ga);
    rk_gguf_close(gc);
    rk_gguf_close(gd);
    free(a);
    free(b);
    free(c);
    free(d);
    free(vocab);
}

Test(mkmodel, qwen3_0_6b_writes_its_full_shapes, .timeout = 600) {
    RK_SKIP_IF_LIGHT();
    char *vocab;
    RK_REQUIRE_SHARED(vocab, QWEN3_VOCAB);
    char *dir, path[4096];
    rk_gguf *g = write_and_open("qwen3-0.6b", RK_GGML_BF16, 3, vocab, &dir, path, sizeof path);
    cr_assert_eq(get_u32(g, "qwen3.block_count"), 28);
    cr_assert_eq(rk_gguf_n_tensors(g), 1 + 28 * 11 + 1);
    expect_tensor(g, "token_embd.weight", RK_GGML_BF16, 1024, 151936);
    cr_assert_null(rk_gguf_find_tensor(g, "output.weight"));
    expect_layers(g, 28, RK_GGML_BF16, 1024, 2048, 1024, 3072, 0, 1, 128);
    uint64_t n_params = 0;
    for (int64_t i = 0; i < rk_gguf_n_tensors(g); i++) {
        const rk_gguf_tensor *t = rk_gguf_tensor_at(g, i);
        n_params += (uint64_t)(t->ne[0] * t->ne[1]);
    }
    cr_assert_eq(n_params, 596049920ull); /* Qwen3-0.6B: 0.44 B + 0.16 B embedding */
    remove_model(g, dir, path);
    free(vocab);
}
