/* tests/test_engine.c — the CPU engine end to end: the golden greedy text of
 * the real stories260K model (through the binary and through the library),
 * batching that does not change results, synthetic qwen2/qwen3 models in F32
 * and BF16 that generate identically across thread counts, and clean errors
 * for hostile files and invalid prompts. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/gguf.h"
#include "config/config.h"
#include "engine/mkmodel.h"
#include "pipeline/pipeline.h"
#include "tests/testutil.h"

static rk_service *open_model(const char *path, int n_threads) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.n_threads = n_threads;
    cfg.kv_memory_mb = 64;
    rk_service *svc = NULL;
    rk_status st = rk_service_open(&cfg, path, &svc);
    cr_assert_eq(st, RK_OK, "open %s: %s", path ? path : "(embedded)", rk_error_message());
    return svc;
}

/* Greedy tokens after a prompt of ids. */
static int greedy(rk_service *svc, const int32_t *prompt, int n_prompt, int n, int32_t *out) {
    return rk_test_greedy(svc, prompt, n_prompt, 0, n, out);
}

/* ---------------------------------------------------------------- stories260K
 * The golden file holds 200 generated tokens after BOS (llama2.c's `-n 200`:
 * every one of the 200 forward passes yields a printed token), so the
 * command that reproduces it is `-n 200`. */

Test(engine, stories260k_greedy_matches_golden_text_through_the_binary) {
    char *model, *golden_path;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    RK_REQUIRE_SHARED(golden_path, "models/stories260K.greedy200.txt");
    size_t golden_len;
    char *golden = rk_test_read_file(golden_path, &golden_len);
    cr_assert_not_null(golden);
    char cmd[4096], *out;
    snprintf(cmd, sizeof cmd, "%s generate --model %s --prompt \"\" -n 200 --temp 0", RK_BIN,
             model);
    cr_assert_eq(rk_test_run(cmd, &out), 0);
    cr_assert_eq(strlen(out), golden_len, "got %zu bytes:\n%s", strlen(out), out);
    cr_assert_eq(memcmp(out, golden, golden_len), 0, "got:\n%s", out);
    free(out);
    free(golden);
    free(model);
    free(golden_path);
}

Test(engine, stories260k_greedy_matches_golden_text_through_the_library) {
    char *model, *golden_path;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    RK_REQUIRE_SHARED(golden_path, "models/stories260K.greedy200.txt");
    char *golden = rk_test_read_file(golden_path, NULL);
    rk_service *svc = open_model(model, 2);
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int32_t bos = rk_tokenizer_bos(tok), out[200];
    cr_assert_eq(bos, 1);
    cr_assert_eq(greedy(svc, &bos, 1, 200, out), 200);
    char *text;
    size_t len;
    cr_assert_eq(rk_tokenizer_decode(tok, out, 200, 0, 1, &text, &len), RK_OK);
    cr_assert_str_eq(text, golden);
    free(text);
    free(golden);
    free(model);
    free(golden_path);
    /* Every block went back to the live pool. */
    cr_assert_eq(rk_arena_pool_free(svc->arena, RK_POOL_LIVE),
                 rk_arena_pool_total(svc->arena, RK_POOL_LIVE));
    rk_service_close(svc);
}

Test(engine, a_batch_of_four_prompts_gives_the_tokens_of_each_alone) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    rk_service *svc = open_model(model, 2);
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    const char *texts[4] = {"Once upon a time", "Lily and Tom went to the park to play with a",
                            "The dog", "One day, a little bird saw a big red ball in the garden"};
    int32_t prompts[4][64], alone[4][40];
    rk_request *reqs[4];
    for (int i = 0; i < 4; i++) {
        int32_t *ids;
        size_t n;
        cr_assert_eq(rk_tokenizer_encode(tok, texts[i], strlen(texts[i]), 0, &ids, &n), RK_OK);
        prompts[i][0] = 1;
        memcpy(prompts[i] + 1, ids, n * sizeof *ids);
        free(ids);
        int max_new =
            25 + 5 * i; /* different lengths: sequences leave the batch at different steps */
        cr_assert_eq(greedy(svc, prompts[i], (int)n + 1, max_new, alone[i]), max_new);
        reqs[i] = rk_test_request(svc, prompts[i], (int)n + 1, 0, max_new);
    }
    cr_assert_eq(rk_pipeline_run(svc, reqs, 4, NULL), RK_OK, "%s", rk_error_message());
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(reqs[i]->n_out, 25 + 5 * i);
        for (int j = 0; j < reqs[i]->n_out; j++)
            cr_assert_eq(reqs[i]->out_tokens[j], alone[i][j], "prompt %d token %d", i, j);
        rk_test_request_free(reqs[i]);
    }
    rk_service_close(svc);
    free(model);
}

Test(engine, seeded_sampling_is_reproducible) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    rk_service *svc = open_model(model, 1);
    int32_t bos = 1, out[3][50];
    uint64_t seeds[3] = {7, 7, 8};
    for (int i = 0; i < 3; i++) {
        rk_request *r = rk_test_request(svc, &bos, 1, 0, 50);
        r->opt.sampling =
            (rk_sampler_params){.temperature = 0.9f, .top_k = 40, .top_p = 0.95f, .seed = seeds[i]};
        cr_assert_eq(rk_pipeline_run(svc, &r, 1, NULL), RK_OK);
        cr_assert_eq(r->n_out, 50);
        memcpy(out[i], r->out_tokens, sizeof out[i]);
        rk_test_request_free(r);
    }
    cr_assert_eq(memcmp(out[0], out[1], sizeof out[0]), 0);
    cr_assert_neq(memcmp(out[0], out[2], sizeof out[0]), 0,
                  "a different seed should change 50 sampled tokens");
    rk_service_close(svc);
    free(model);
}

/* ---------------------------------------------------------------- synthetic models */

static const char *CHATML_PROMPT =
    "<|im_start|>user\nWhat is a KV cache?<|im_end|>\n<|im_start|>assistant\n";

/* The greedy tokens after text with 1, 2 and 3 threads are the same. */
static void check_thread_invariance_on(const char *path, const char *text, int n_new) {
    int32_t out[3][64];
    int threads[3] = {1, 2, 3};
    for (int t = 0; t < 3; t++) {
        rk_service *svc = open_model(path, threads[t]);
        const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
        int32_t *ids;
        size_t n;
        cr_assert_eq(rk_tokenizer_encode(tok, text, strlen(text), 1, &ids, &n), RK_OK);
        if (text == CHATML_PROMPT && rk_tokenizer_find(tok, "<|im_start|>") >= 0)
            cr_assert_eq(ids[0], 151644); /* Qwen's <|im_start|> is one token */
        cr_assert_eq(greedy(svc, ids, (int)n, n_new, out[t]), n_new);
        free(ids);
        rk_service_close(svc);
    }
    cr_assert_eq(memcmp(out[0], out[1], (size_t)n_new * 4), 0, "1 vs 2 threads");
    cr_assert_eq(memcmp(out[0], out[2], (size_t)n_new * 4), 0, "1 vs 3 threads");
}

static void check_thread_invariance(const char *path, int n_new) {
    check_thread_invariance_on(path, CHATML_PROMPT, n_new);
}

Test(engine, qwen3_tiny_generates_identically_across_thread_counts) {
    char *path = rk_test_model("qwen3-tiny", "f32", 1);
    check_thread_invariance(path, 32);
    free(path);
}

Test(engine, qwen2_tiny_with_qkv_bias_generates_identically_across_thread_counts) {
    char *path = rk_test_model("qwen2-tiny", "bf16", 2);
    check_thread_invariance(path, 32);
    free(path);
}

/* qwen3moe: the experts a token chooses depend on nothing but its own
 * activations, so the thread count changes no token. */
Test(engine, qwen3moe_tiny_loads_its_experts_and_generates_identically_across_thread_counts) {
    const char *types[2] = {"f32", "q8_0"};
    for (int i = 0; i < 2; i++) {
        char *path = rk_test_model("qwen3moe-tiny", types[i], 1);
        rk_service *svc = open_model(path, 1);
        const rk_hparams *hp = rk_model_hparams(svc->model);
        cr_assert_str_eq(hp->desc->name, "qwen3moe");
        cr_assert_eq(hp->desc->moe, RK_MOE_SOFTMAX);
        cr_assert(hp->desc->qk_norm && hp->desc->moe_norm_topk);
        cr_assert_eq(hp->n_expert, 8);
        cr_assert_eq(hp->n_expert_used, 2);
        cr_assert_eq(hp->ffn_exp, 64);
        rk_service_close(svc);
        check_thread_invariance(path, 32);
        free(path);
    }
}

/* Sequences batched together share each expert's matmul (their tokens are
 * grouped by expert), and each still gets the tokens it gets alone. */
Test(engine, qwen3moe_tiny_batch_of_four_prompts_gives_the_tokens_of_each_alone) {
    char *path = rk_test_model("qwen3moe-tiny", "f32", 1);
    rk_service *svc = open_model(path, 2);
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    const char *texts[4] = {"<|im_start|>user\nHi<|im_end|>\n", "The cache keys KV by content.",
                            "x", "Experts are chosen per token, eight of one hundred and twenty"};
    int32_t alone[4][40];
    rk_request *reqs[4];
    for (int i = 0; i < 4; i++) {
        int32_t *ids;
        size_t n;
        cr_assert_eq(rk_tokenizer_encode(tok, texts[i], strlen(texts[i]), 1, &ids, &n), RK_OK);
        int max_new = 20 + 5 * i;
        cr_assert_eq(greedy(svc, ids, (int)n, max_new, alone[i]), max_new);
        reqs[i] = rk_test_request(svc, ids, (int)n, 0, max_new);
        free(ids);
    }
    cr_assert_eq(rk_pipeline_run(svc, reqs, 4, NULL), RK_OK, "%s", rk_error_message());
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(reqs[i]->n_out, 20 + 5 * i);
        for (int j = 0; j < reqs[i]->n_out; j++)
            cr_assert_eq(reqs[i]->out_tokens[j], alone[i][j], "prompt %d token %d", i, j);
        rk_test_request_free(reqs[i]);
    }
    rk_service_close(svc);
    free(path);
}

/* phi3 (fused QKV and gate/up, RoPE on 24 of 32 dimensions, LongRoPE long
 * factors and attention factor): the greedy tokens the reference engine
 * (llama.cpp's llama-server, default settings, prompt given as these ids)
 * generates on the same file, `ragkv mkmodel --preset phi3-tiny --vocab
 * tests/data/spm-tokenizer.json --seed 7`. */
Test(engine, phi3_tiny_greedy_matches_the_reference_engine) {
    char *path = rk_test_model("phi3-tiny", "f32", 7);
    static const int32_t prompt[] = {357, 360, 331, 364, 329, 343, 337, 353, 259, 333,
                                     329, 259, 272, 337, 312, 350, 259, 338, 263};
    static const int32_t want[16] = {22874, 22874, 22874, 22874, 18211, 18211, 18211, 18211,
                                     18211, 18211, 18211, 18211, 18211, 12818, 19638, 29901};
    rk_service *svc = open_model(path, 2);
    int32_t got[16];
    cr_assert_eq(greedy(svc, prompt, 19, 16, got), 16);
    for (int i = 0; i < 16; i++)
        cr_assert_eq(got[i], want[i], "token %d: %d, want %d", i, got[i], want[i]);
    rk_service_close(svc);
    free(path);
}

/* In BF16 the fused matrices are packed: a prompt of 2..16 tokens is
 * multiplied whole through the fused scratch, a longer one part by part. */
Test(engine, phi3_tiny_bf16_generates_identically_across_thread_counts) {
    char *path = rk_test_model("phi3-tiny", "bf16", 7);
    check_thread_invariance_on(path, "Once upon a time", 24);
    check_thread_invariance_on(path, CHATML_PROMPT, 24);
    free(path);
}

Test(engine, qwen3_0_6b_f32_and_bf16_load_and_generate_identically_across_threads,
     .timeout = 1200) {
    RK_SKIP_IF_LIGHT();
    const char *types[2] = {"f32", "bf16"};
    for (int i = 0; i < 2; i++) {
        char *path = rk_test_model("qwen3-0.6b", types[i], 3);
        rk_service *svc = open_model(path, 1);
        const rk_hparams *hp = rk_model_hparams(svc->model);
        cr_assert_eq(hp->n_layers, 28);
        cr_assert_eq(hp->head_dim, 128);
        cr_assert_eq(hp->n_vocab, 151936);
        cr_assert(hp->tied_embeddings && hp->desc->qk_norm);
        rk_service_close(svc);
        check_thread_invariance(path, 6);
        free(path);
    }
}

/* The Gemma families: what the loader reads from the files mkmodel writes as
 * the reference converter does, and generation over prompts longer than the
 * sliding window that does not depend on the thread count. */
static void check_plain_thread_invariance(const char *path, int n_new) {
    int32_t out[3][64];
    int threads[3] = {1, 2, 3};
    const char *text = "Once upon a time there was a little girl who lived in a village near the "
                       "forest, and every day she walked to the river";
    for (int t = 0; t < 3; t++) {
        rk_service *svc = open_model(path, threads[t]);
        int32_t *ids;
        size_t n;
        cr_assert_eq(
            rk_tokenizer_encode(rk_model_tokenizer(svc->model), text, strlen(text), 1, &ids, &n),
            RK_OK);
        cr_assert_gt(n, 20, "the prompt should exceed the window of 16");
        cr_assert_eq(greedy(svc, ids, (int)n, n_new, out[t]), n_new);
        free(ids);
        rk_service_close(svc);
    }
    cr_assert_eq(memcmp(out[0], out[1], (size_t)n_new * 4), 0, "1 vs 2 threads");
    cr_assert_eq(memcmp(out[0], out[2], (size_t)n_new * 4), 0, "1 vs 3 threads");
}

Test(engine, gemma3_layers_slide_with_the_local_rope_and_every_sixth_is_global) {
    char *path = rk_test_model("gemma3-micro", "f32", 4);
    rk_service *svc = open_model(path, 2);
    const rk_model *m = svc->model;
    const rk_hparams *hp = rk_model_hparams(m);
    cr_assert_str_eq(hp->desc->name, "gemma3");
    cr_assert(hp->desc->post_norms && hp->desc->embd_scale_sqrt && hp->desc->qk_norm);
    cr_assert_eq(hp->desc->act, RK_FFN_GELU_TANH);
    cr_assert_eq(hp->sliding_window, 16);
    cr_assert_eq(hp->swa_period, 6);
    cr_assert_float_eq(hp->attn_scale, 1.0f / sqrtf(32.0f), 1e-9);
    cr_assert_eq(hp->attn_softcap, 0.0f);
    cr_assert_eq(hp->final_softcap, 0.0f);
    cr_assert_eq(hp->rope.theta, 1e6f);
    cr_assert_eq(hp->rope_swa.theta, 10000.0f);
    for (int l = 0; l < 5; l++) cr_assert_eq(rk_model_rope(m, l), rk_model_rope(m, 0));
    cr_assert_neq(rk_model_rope(m, 5), rk_model_rope(m, 0));
    cr_assert_neq(rk_model_rope(m, 5)->freq[1], rk_model_rope(m, 0)->freq[1]);
    cr_assert_eq(rk_model_ropes(m)[5], rk_model_rope(m, 5));
    cr_assert_null(rk_model_rope(m, 6));
    rk_service_close(svc);
    check_plain_thread_invariance(path, 40);
    free(path);
}

/* gemma4-tiny (skipped without Gemma 3's tokenizer.json, its vocabulary):
 * the layer kinds from the file's array (sliding, sliding, global, twice),
 * heads of 16 in the sliding layers and 32 in the global ones, unscaled
 * attention, the final soft cap of 30, the global layers' RoPE rotating 4
 * of 16 pairs (rope_freqs.weight), and the last three layers
 * attending over the KV of layers 1 and 2: the KV cache and its sizing hold
 * three layers, not six. */
Test(engine, gemma4_tiny_reuses_kv_of_earlier_layers_and_holds_only_the_owning_ones) {
    char *path = rk_test_model("gemma4-tiny", "f32", 9);
    rk_service *svc = open_model(path, 2);
    const rk_model *m = svc->model;
    const rk_hparams *hp = rk_model_hparams(m);
    cr_assert_str_eq(hp->desc->name, "gemma4");
    cr_assert_eq(hp->n_layers, 6);
    cr_assert_eq(hp->n_kv_layers, 3);
    cr_assert_eq(hp->n_embd_per_layer, 32);
    cr_assert_eq(hp->attn_scale, 1.0f);
    cr_assert_eq(hp->final_softcap, 30.0f);
    cr_assert_eq(hp->sliding_window, 16);
    const int kv_of[6] = {0, 1, 2, 1, 1, 2}, window[6] = {16, 16, 0, 16, 16, 0};
    for (int l = 0; l < 6; l++) {
        cr_assert_eq(rk_model_kv_layer(m, l), kv_of[l], "layer %d", l);
        cr_assert_eq(rk_model_attn_params(m, l).window, window[l], "layer %d", l);
        cr_assert_eq(rk_model_rope(m, l), rk_model_rope(m, kv_of[l]), "the owner's RoPE");
    }
    cr_assert_eq(rk_model_kv_layer(m, 6), -1);
    const rk_rope *local = rk_model_rope(m, 0), *global = rk_model_rope(m, 2);
    cr_assert_eq(local->n_rot, 16);
    cr_assert_eq(global->n_rot, 32);
    cr_assert_float_eq(local->freq[1], powf(10000.0f, -2.0f / 16), 1e-6);
    cr_assert_float_eq(global->freq[1], powf(1e6f, -2.0f / 32), 1e-6);
    for (int i = 4; i < 16; i++) cr_assert_lt(global->freq[i], 1e-20f, "pair %d stays put", i);
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    cr_assert_eq(kv->n_layers, 3);
    cr_assert_eq(kv->head_dim, 32, "the sliding layers' heads of 16 padded to the global 32");
    cr_assert_eq(svc->kv.token_bytes,
                 2ull * 3 * rk_dtype_row_bytes(kv->dtype, (size_t)kv->n_kv_heads * kv->head_dim));
    json_t *j = rk_kv_plan_json(&svc->kv);
    cr_assert_eq(json_integer_value(json_object_get(j, "layers")), 3, "/stats says so");
    json_decref(j);
    rk_service_close(svc);
    check_plain_thread_invariance(path, 40);
    free(path);
}

/* A copy of gemma4 file src (in the test directory, as name) whose attn_v
 * tensors are left out (drop) or hold attn_k's values, with the u32 key
 * add_u32 = 8 added where not NULL. */
typedef struct vk_copy {
    const rk_gguf *g;
    int64_t src[512]; /* the source tensor of each written one */
} vk_copy;

static rk_status fill_vk(void *ctx, int64_t i, void *dst, size_t n_bytes) {
    const vk_copy *c = ctx;
    memcpy(dst, rk_gguf_tensor_at(c->g, c->src[i])->data, n_bytes);
    return RK_OK;
}

static char *copy_without_v(const char *src, int drop, const char *name, const char *add_u32) {
    char path[4200], tmp[4300];
    snprintf(path, sizeof path, "%s/models/%s", RK_TEST_TMP, name);
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open(src, &g), RK_OK, "%s", rk_error_message());
    rk_gguf_writer *w;
    cr_assert_eq(rk_gguf_writer_create(&w), RK_OK);
    for (int64_t i = 0; i < rk_gguf_n_kv(g); i++) rk_test_gguf_copy_kv(w, g, i);
    if (add_u32) cr_assert_eq(rk_gguf_writer_set_u32(w, add_u32, 8), RK_OK);
    static vk_copy c;
    c.g = g;
    int64_t n = 0;
    for (int64_t i = 0; i < rk_gguf_n_tensors(g); i++) {
        const rk_gguf_tensor *t = rk_gguf_tensor_at(g, i);
        const char *v = strstr(t->name, ".attn_v.weight");
        int64_t from = i;
        if (v && drop) continue;
        if (v) { /* blk.N.attn_v.weight -> blk.N.attn_k.weight */
            char k[96];
            snprintf(k, sizeof k, "%.*s.attn_k.weight", (int)(v - t->name), t->name);
            for (from = 0; strcmp(rk_gguf_tensor_at(g, from)->name, k) != 0; from++)
                cr_assert_lt(from + 1, rk_gguf_n_tensors(g), "%s has no %s", src, k);
        }
        cr_assert_lt(n, 512);
        c.src[n++] = from;
        cr_assert_eq(rk_gguf_writer_add_tensor(w, t->name, (rk_ggml_type)t->type, t->n_dims, t->ne),
                     RK_OK, "%s", rk_error_message());
    }
    snprintf(tmp, sizeof tmp, "%s.%d", path, (int)getpid());
    cr_assert_eq(rk_gguf_writer_write_file(w, tmp, fill_vk, &c), RK_OK, "%s", rk_error_message());
    rk_gguf_writer_free(w);
    rk_gguf_close(g);
    cr_assert_eq(rename(tmp, path), 0);
    return rk_strdup(path);
}

static void greedy_of(const char *path, const char *text, int n_new, int32_t *out) {
    rk_service *svc = open_model(path, 2);
    int32_t *ids;
    size_t n;
    cr_assert_eq(
        rk_tokenizer_encode(rk_model_tokenizer(svc->model), text, strlen(text), 1, &ids, &n),
        RK_OK);
    cr_assert_eq(greedy(svc, ids, (int)n, n_new, out), n_new);
    free(ids);
    rk_service_close(svc);
}

/* Without attn_v a gemma4 layer's V is its K before the K norm, as the
 * reference engine computes it: the file without attn_v gives the tokens of
 * the file whose attn_v holds attn_k's values, and not the original's. */
Test(engine, gemma4_without_attn_v_takes_v_from_k) {
    char *src = rk_test_model("gemma4-tiny", "f32", 9);
    char *no_v = copy_without_v(src, 1, "gemma4-tiny-no-v.gguf", NULL);
    char *v_is_k = copy_without_v(src, 0, "gemma4-tiny-v-is-k.gguf", NULL);
    const char *text = "Once upon a time, in a small village by the sea, there lived a girl";
    int32_t a[24], b[24], c[24];
    greedy_of(no_v, text, 24, a);
    greedy_of(v_is_k, text, 24, b);
    greedy_of(src, text, 24, c);
    cr_assert_arr_eq(a, b, sizeof a);
    cr_assert(memcmp(a, c, sizeof a) != 0, "the original's own attn_v gives other tokens");
    free(no_v);
    free(v_is_k);
    free(src);
}

/* A gemma4 file with experts (26B-A4B) is refused, not computed as its
 * dense FFN alone. */
Test(engine, gemma4_with_experts_is_refused) {
    char *src = rk_test_model("gemma4-tiny", "f32", 9);
    char *path = copy_without_v(src, 0, "gemma4-tiny-experts.gguf", "gemma4.expert_count");
    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 1, &be), RK_OK);
    rk_model *m;
    cr_assert_eq(rk_model_load(path, be, &m), RK_ERR_UNSUPPORTED);
    cr_assert(strstr(rk_error_message(), "gemma4.expert_count 8"), "%s", rk_error_message());
    rk_backend_free(be);
    free(path);
    free(src);
}

/* A gemma4 file without its per-layer kinds is refused, naming the key. */
Test(engine, gemma4_without_its_layer_kinds_is_refused) {
    char *src = rk_test_model("gemma4-tiny", "f32", 9);
    char *path = rk_test_model_without_key(src, "gemma4.attention.sliding_window_pattern",
                                           "gemma4-tiny-no-pattern.gguf");
    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 1, &be), RK_OK);
    rk_model *m;
    cr_assert_eq(rk_model_load(path, be, &m), RK_ERR_FORMAT);
    cr_assert_null(m);
    cr_assert(strstr(rk_error_message(), "gemma4.attention.sliding_window_pattern is missing"),
              "%s", rk_error_message());
    rk_backend_free(be);
    free(path);
    free(src);
}

Test(engine, gemma2_slides_on_even_layers_with_soft_caps) {
    char *path = rk_test_model("gemma2-tiny", "bf16", 5);
    rk_service *svc = open_model(path, 2);
    const rk_model *m = svc->model;
    const rk_hparams *hp = rk_model_hparams(m);
    cr_assert_str_eq(hp->desc->name, "gemma2");
    cr_assert_eq(hp->sliding_window, 16);
    cr_assert_eq(hp->swa_period, 2);
    cr_assert_eq(hp->attn_softcap, 50.0f);
    cr_assert_eq(hp->final_softcap, 30.0f);
    cr_assert(!hp->desc->qk_norm);
    /* one RoPE for every layer (gemma2's sliding layers use the global base) */
    for (int l = 1; l < hp->n_layers; l++)
        cr_assert_eq(memcmp(rk_model_rope(m, l)->freq, rk_model_rope(m, 0)->freq,
                            sizeof rk_model_rope(m, 0)->freq),
                     0);
    rk_service_close(svc);
    check_plain_thread_invariance(path, 40);
    free(path);
}

/* gemma3-tiny carries Gemma 3's real vocabulary (skipped without the
 * tokenizer.json, see rk_test_gemma3_tokenizer): the file says no space
 * prefix, its tokenizer gives the reference ids, <end_of_turn> ends
 * generation, and the model generates over the window. */
Test(engine, gemma3_tiny_reads_its_real_vocabulary_back_from_the_file) {
    char *path = rk_test_model("gemma3-tiny", "f32", 7);
    rk_service *svc = open_model(path, 2);
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    cr_assert_eq(rk_model_hparams(svc->model)->n_vocab, 262144);
    int b;
    cr_assert_eq(rk_gguf_get_bool(rk_model_gguf(svc->model), "tokenizer.ggml.add_space_prefix", &b),
                 RK_OK);
    cr_assert_eq(b, 0);
    const char *text = "Hello, my dog is cute";
    int32_t *ids, want[] = {9259, 236764, 1041, 4799, 563, 12864};
    size_t n;
    cr_assert_eq(rk_tokenizer_encode(tok, text, strlen(text), 1, &ids, &n), RK_OK);
    cr_assert_eq(n, 6);
    cr_assert_arr_eq(ids, want, sizeof want);
    free(ids);
    cr_assert(rk_tokenizer_is_eog(tok, rk_tokenizer_find(tok, "<end_of_turn>")));
    cr_assert_eq(rk_tokenizer_bos(tok), 2);
    rk_service_close(svc);
    check_plain_thread_invariance(path, 24);
    free(path);
}

/* ---------------------------------------------------------------- errors */

Test(engine, hostile_model_file_exits_1_with_a_message) {
    char *dir = rk_test_tmpdir("hostile");
    char path[4096], cmd[8192], *out;
    snprintf(path, sizeof path, "%s/bad.gguf", dir);
    FILE *f = fopen(path, "wb");
    /* A valid header claiming 2^62 metadata entries. */
    fwrite("GGUF\3\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\x40", 1, 24, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s generate --model %s --prompt hi 2>&1", RK_BIN, path);
    cr_assert_eq(rk_test_run(cmd, &out), 1, "output: %s", out);
    cr_assert(strstr(out, "bad.gguf") != NULL, "the message names the file: %s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s inspect %s/missing.gguf 2>&1", RK_BIN, dir);
    cr_assert_eq(rk_test_run(cmd, &out), 1);
    free(out);
    free(dir);
}

/* Load a header-only model file of the named family; return the status. */
static rk_status load_family(const char *arch) {
    rk_gguf_writer *w;
    cr_assert_eq(rk_gguf_writer_create(&w), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_str(w, "general.architecture", arch), RK_OK);
    void *buf;
    size_t len;
    cr_assert_eq(rk_gguf_writer_write_memory(w, NULL, NULL, &buf, &len), RK_OK);
    rk_gguf_writer_free(w);
    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 1, &be), RK_OK);
    rk_model *m = NULL;
    rk_status st = rk_model_load_owned_buffer(buf, len, "family.gguf", be, &m);
    cr_assert_null(m);
    rk_backend_free(be);
    return st;
}

Test(engine, unknown_family_is_unsupported_and_the_message_lists_the_known_ones) {
    cr_assert_eq(load_family("bert"), RK_ERR_UNSUPPORTED);
    const char *msg = rk_error_message();
    cr_assert_not_null(strstr(msg, "\"bert\" is not supported (llama, qwen2, qwen3"), "%s", msg);
}

Test(engine, qwen3moe_with_more_experts_used_than_it_has_is_a_format_error) {
    rk_gguf_writer *w;
    cr_assert_eq(rk_gguf_writer_create(&w), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_str(w, "general.architecture", "qwen3moe"), RK_OK);
    const char *keys[] = {"qwen3moe.block_count",          "qwen3moe.embedding_length",
                          "qwen3moe.attention.head_count", "qwen3moe.expert_count",
                          "qwen3moe.expert_used_count",    "qwen3moe.expert_feed_forward_length"};
    const uint32_t vals[] = {2, 128, 4, 4, 8, 64};
    for (int i = 0; i < 6; i++) cr_assert_eq(rk_gguf_writer_set_u32(w, keys[i], vals[i]), RK_OK);
    void *buf;
    size_t len;
    cr_assert_eq(rk_gguf_writer_write_memory(w, NULL, NULL, &buf, &len), RK_OK);
    rk_gguf_writer_free(w);
    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 1, &be), RK_OK);
    rk_model *m = NULL;
    cr_assert_eq(rk_model_load_owned_buffer(buf, len, "moe.gguf", be, &m), RK_ERR_FORMAT);
    cr_assert_null(m);
    const char *msg = rk_error_message();
    cr_assert_not_null(strstr(msg, "expert_count 4, expert_used_count 8"), "%s", msg);
    rk_backend_free(be);
}

Test(engine, recurrent_families_are_refused_with_the_reason) {
    const char *families[] = {"mamba", "qwen3next", "jamba"};
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(load_family(families[i]), RK_ERR_UNSUPPORTED);
        const char *msg = rk_error_message();
        cr_assert_not_null(strstr(msg, "recurrent state cannot be reused at another position"),
                           "%s", msg);
    }
}

Test(engine, invalid_utf8_prompt_exits_1_with_a_message) {
    char cmd[512], *out;
    snprintf(cmd, sizeof cmd, "%s generate --prompt \"$(printf 'ab\\377\\376')\" -n 4 2>&1",
             RK_BIN);
    cr_assert_eq(rk_test_run(cmd, &out), 1, "output: %s", out);
    cr_assert(strstr(out, "UTF-8") != NULL || strstr(out, "utf-8") != NULL, "%s", out);
    free(out);
}

Test(engine, bad_usage_exits_2) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s generate -n 5 2>/dev/null", RK_BIN);
    cr_assert_eq(rk_test_run(cmd, NULL), 2);
    snprintf(cmd, sizeof cmd, "%s generate --prompt x -n -3 2>/dev/null", RK_BIN);
    cr_assert_eq(rk_test_run(cmd, NULL), 2);
    snprintf(cmd, sizeof cmd, "%s frobnicate 2>/dev/null", RK_BIN);
    cr_assert_eq(rk_test_run(cmd, NULL), 2);
}

Test(engine, embedded_model_generates_without_a_file) {
    char cmd[512], *out;
    snprintf(cmd, sizeof cmd, "%s generate --prompt 'Hello' -n 8 --temp 0 --json", RK_BIN);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out);
    cr_assert(strstr(out, "\"object\":\"text_completion\"") != NULL, "%s", out);
    cr_assert(strstr(out, "\"completion_ids\":[") != NULL, "%s", out);
    cr_assert(strstr(out, "\"decode_tokens_per_s\"") != NULL, "%s", out);
    free(out);
}
