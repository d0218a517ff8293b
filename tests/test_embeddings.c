/* tests/test_embeddings.c — POST /v1/embeddings end to end: the real `ragkv
 * serve` on loopback with the qwen3-embedding-tiny preset (Qwen3 vocabulary,
 * pooling_type 3 = last token), and qwen3-tiny (no pooling key) with and
 * without --pooling, alone and beside a stream. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define DIM 128 /* the tiny presets' width */

static rk_test_server S;

static void stop_server(void) { rk_test_server_stop_checked(&S); }

/* Start a server on preset's model with extra args (NULL-terminated, at most 8). */
static void start(const char *preset, const char *const *extra) {
    char *model = rk_test_model(preset, "f32", 1);
    const char *args[12] = {"--model", model};
    int n = 2;
    for (int i = 0; extra && extra[i]; i++) args[n++] = extra[i];
    args[n] = NULL;
    cr_assert_eq(rk_test_server_start_ready(&S, "embeddings", NULL, args), 0,
                 "the server did not start");
    free(model);
}

static rk_test_resp post(const char *body) {
    rk_test_resp r;
    cr_assert_eq(rk_test_exchange(&S.t, "POST", "/v1/embeddings",
                                  "Content-Type: application/json\r\n", body, &r),
                 0, "no answer");
    cr_assert_not_null(r.json, "not JSON: %s", r.http.body);
    return r;
}

/* data[i].embedding as floats (DIM of them; asserted). */
static void vec_of(json_t *root, int i, float *out) {
    char path[64];
    snprintf(path, sizeof path, "data.%d.embedding", i);
    json_t *e = rk_test_jget(root, path);
    cr_assert(json_is_array(e), "%s is not an array", path);
    cr_assert_eq(json_array_size(e), DIM);
    for (int k = 0; k < DIM; k++) out[k] = (float)json_number_value(json_array_get(e, (size_t)k));
}

static double dot(const float *a, const float *b) {
    double s = 0;
    for (int k = 0; k < DIM; k++) s += (double)a[k] * b[k];
    return s;
}

/* Check an error answer: status, envelope, and code (NULL: null). */
static void expect_error(const char *body, int status, const char *code) {
    rk_test_resp r = post(body);
    cr_expect_eq(r.http.status, status, "%s -> %d: %s", body, r.http.status, r.http.body);
    cr_expect_str_eq(rk_test_jstr(r.json, "error.type"), "invalid_request_error");
    cr_expect(json_is_string(rk_test_jget(r.json, "error.message")));
    json_t *c = rk_test_jget(r.json, "error.code");
    if (code)
        cr_expect(json_is_string(c) && !strcmp(json_string_value(c), code), "code for %s", body);
    else
        cr_expect(json_is_null(c), "code for %s", body);
    rk_test_resp_free(&r);
}

TestSuite(embeddings, .fini = stop_server, .timeout = 300);

Test(embeddings, one_string_gives_a_unit_vector_of_the_model_width_with_its_token_count) {
    start("qwen3-embedding-tiny", NULL);
    rk_test_resp r = post("{\"input\": \"The cat sat on the mat.\", \"model\": \"x\"}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_expect_str_eq(rk_test_jstr(r.json, "object"), "list");
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "data")), 1);
    cr_expect_str_eq(rk_test_jstr(r.json, "data.0.object"), "embedding");
    cr_expect_eq(rk_test_jint(r.json, "data.0.index"), 0);
    float v[DIM];
    vec_of(r.json, 0, v);
    cr_expect_float_eq(dot(v, v), 1.0, 1e-5, "norm^2 %g", dot(v, v));
    /* The same text's tokens, as /tokenize counts them with the special ones. */
    rk_test_resp t;
    cr_assert_eq(
        rk_test_exchange(&S.t, "POST", "/tokenize", NULL,
                         "{\"content\": \"The cat sat on the mat.\", \"add_special\": true}", &t),
        0);
    long long n = (long long)json_array_size(rk_test_jget(t.json, "tokens"));
    cr_expect_gt(n, 3);
    cr_expect_eq(rk_test_jint(r.json, "usage.prompt_tokens"), n);
    cr_expect_eq(rk_test_jint(r.json, "usage.total_tokens"), n);
    /* The token ids themselves give the same vector. */
    char body[2048];
    int o = snprintf(body, sizeof body, "{\"input\": ");
    char *ids = json_dumps(rk_test_jget(t.json, "tokens"), JSON_COMPACT);
    o += snprintf(body + o, sizeof body - (size_t)o, "%s}", ids);
    free(ids);
    rk_test_resp r2 = post(body);
    cr_assert_eq(r2.http.status, 200, "%s", r2.http.body);
    float w[DIM];
    vec_of(r2.json, 0, w);
    cr_expect_float_eq(dot(v, w), 1.0, 1e-5);
    rk_test_resp_free(&r2);
    rk_test_resp_free(&t);
    rk_test_resp_free(&r);
}

Test(embeddings, a_batch_equals_its_inputs_one_by_one_and_repeats_exactly) {
    start("qwen3-embedding-tiny", NULL);
    const char *texts[] = {"Paris is the capital of France.",
                           "Instruct: Given a web search query, retrieve relevant passages\n"
                           "Query: what is the capital of France?",
                           "x", "KV caches store keys and values for every layer and token."};
    int n = 4;
    char body[4096] = "{\"input\": [";
    for (int i = 0; i < n; i++) {
        json_t *s = json_string(texts[i]);
        char *q = json_dumps(s, JSON_ENCODE_ANY);
        strcat(body, i ? ", " : "");
        strcat(body, q);
        free(q);
        json_decref(s);
    }
    strcat(body, "]}");
    rk_test_resp b = post(body);
    cr_assert_eq(b.http.status, 200, "%s", b.http.body);
    cr_assert_eq(json_array_size(rk_test_jget(b.json, "data")), (size_t)n);
    long long total = 0;
    for (int i = 0; i < n; i++) {
        float bv[DIM], sv[DIM], again[DIM];
        vec_of(b.json, i, bv);
        json_t *s = json_string(texts[i]);
        char *q = json_dumps(s, JSON_ENCODE_ANY);
        json_decref(s);
        char one[2048];
        snprintf(one, sizeof one, "{\"input\": %s}", q);
        free(q);
        rk_test_resp r = post(one), r2 = post(one);
        cr_assert_eq(r.http.status, 200, "%s", r.http.body);
        vec_of(r.json, 0, sv);
        vec_of(r2.json, 0, again);
        total += rk_test_jint(r.json, "usage.prompt_tokens");
        cr_expect_geq(dot(bv, sv), 1.0 - 1e-5, "input %d: cosine %.8f", i, dot(bv, sv));
        cr_expect_eq(memcmp(sv, again, sizeof sv), 0, "input %d: the same input twice differs", i);
        rk_test_resp_free(&r);
        rk_test_resp_free(&r2);
    }
    cr_expect_eq(rk_test_jint(b.json, "usage.prompt_tokens"), total);
    /* Different texts give different vectors. */
    float a[DIM], c[DIM];
    vec_of(b.json, 0, a);
    vec_of(b.json, 3, c);
    cr_expect_lt(dot(a, c), 0.9999);
    rk_test_resp_free(&b);
}

static int b64val(char ch) {
    const char *abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const char *p = strchr(abc, ch);
    return p && ch ? (int)(p - abc) : -1;
}

Test(embeddings, base64_is_the_float_vector_as_little_endian_float32) {
    start("qwen3-embedding-tiny", NULL);
    const char *in = "\"retrieval augmented generation\"";
    char body[256];
    snprintf(body, sizeof body, "{\"input\": %s, \"encoding_format\": \"float\"}", in);
    rk_test_resp f = post(body);
    snprintf(body, sizeof body, "{\"input\": %s, \"encoding_format\": \"base64\"}", in);
    rk_test_resp b = post(body);
    cr_assert_eq(b.http.status, 200, "%s", b.http.body);
    const char *s = rk_test_jstr(b.json, "data.0.embedding");
    size_t len = strlen(s);
    cr_assert_eq(len, (DIM * 4 + 2) / 3 * 4);
    unsigned char bytes[DIM * 4 + 3];
    size_t nb = 0;
    for (size_t i = 0; i < len; i += 4) {
        int v[4];
        for (int k = 0; k < 4; k++) v[k] = s[i + k] == '=' ? 0 : b64val(s[i + k]);
        for (int k = 0; k < 4; k++) cr_assert_geq(v[k], 0, "bad base64 at %zu", i + k);
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | v[3];
        bytes[nb++] = (unsigned char)(w >> 16);
        if (s[i + 2] != '=') bytes[nb++] = (unsigned char)(w >> 8);
        if (s[i + 3] != '=') bytes[nb++] = (unsigned char)w;
    }
    cr_assert_eq(nb, DIM * 4);
    float fv[DIM];
    vec_of(f.json, 0, fv);
    for (int k = 0; k < DIM; k++) {
        uint32_t u = (uint32_t)bytes[4 * k] | (uint32_t)bytes[4 * k + 1] << 8 |
                     (uint32_t)bytes[4 * k + 2] << 16 | (uint32_t)bytes[4 * k + 3] << 24;
        float x;
        memcpy(&x, &u, 4);
        cr_expect_eq(x, fv[k], "element %d: %.9g vs %.9g", k, x, fv[k]);
    }
    rk_test_resp_free(&f);
    rk_test_resp_free(&b);
}

Test(embeddings, bad_requests_get_400_in_the_error_envelope) {
    const char *extra[] = {"--max-context", "32", NULL};
    start("qwen3-embedding-tiny", extra);
    expect_error("{\"input\": \"\"}", 400, NULL);
    expect_error("{\"input\": []}", 400, NULL);
    expect_error("{\"input\": [\"ok\", \"\"]}", 400, NULL);
    expect_error("{}", 400, NULL);
    expect_error("{\"input\": 5}", 400, NULL);
    expect_error("{\"input\": [[1, 2], [999999999]]}", 400, NULL);
    expect_error("{\"input\": \"hi\", \"encoding_format\": \"int8\"}", 400, NULL);
    expect_error("{\"input\": \"hi\", \"dimensions\": 129}", 400, NULL);
    expect_error("{\"input\": \"hi\", \"dimensions\": 0}", 400, NULL);
    expect_error("{\"input\": \"hi\", \"truncate\": \"yes\"}", 400, NULL);
    expect_error("{\"input\": \"hi\", \"truncate\": true, \"truncation_direction\": \"up\"}", 400,
                 NULL);
    char body[1024] = "{\"input\": \"";
    for (int i = 0; i < 40; i++) strcat(body, "token after token ");
    strcat(body, "\"}");
    expect_error(body, 400, "context_length_exceeded");
    /* The full width is accepted; the server still answers after the errors. */
    rk_test_resp r = post("{\"input\": \"hi\", \"dimensions\": 128}");
    cr_expect_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
}

/* The models route lists what the model does; a model without a pooling type
 * makes no embeddings, unless --pooling gives it one. */
static int has_embedding_capability(void) {
    rk_test_resp r;
    cr_assert_eq(rk_test_exchange(&S.t, "GET", "/v1/models", NULL, NULL, &r), 0);
    json_t *caps = rk_test_jget(r.json, "data.0.capabilities");
    cr_assert(json_is_array(caps), "%s", r.http.body);
    int found = 0;
    for (size_t i = 0; i < json_array_size(caps); i++)
        found |= !strcmp(json_string_value(json_array_get(caps, i)), "embedding");
    rk_test_resp_free(&r);
    return found;
}

Test(embeddings, a_model_without_pooling_refuses_until_pooling_is_set) {
    start("qwen3-tiny", NULL);
    cr_expect_not(has_embedding_capability());
    expect_error("{\"input\": \"hello\"}", 400, NULL);
    rk_test_server_stop_checked(&S);
    const char *extra[] = {"--pooling", "mean", NULL};
    start("qwen3-tiny", extra);
    cr_expect(has_embedding_capability());
    rk_test_resp r = post("{\"input\": [\"hello\", \"world\"]}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    float a[DIM], b[DIM];
    vec_of(r.json, 0, a);
    vec_of(r.json, 1, b);
    cr_expect_float_eq(dot(a, a), 1.0, 1e-5);
    cr_expect_lt(dot(a, b), 0.9999);
    rk_test_resp_free(&r);
}

Test(embeddings, the_embedding_model_lists_the_embedding_capability) {
    start("qwen3-embedding-tiny", NULL);
    cr_expect(has_embedding_capability());
}

/* The stats the engine published after the last command or request. */
static json_t *stats(void) {
    rk_test_resp r;
    cr_assert_eq(rk_test_exchange(&S.t, "GET", "/v1/stats", NULL, NULL, &r), 0);
    json_t *j = json_incref(r.json);
    rk_test_resp_free(&r);
    cr_assert_not_null(j);
    return j;
}

Test(embeddings, an_embedding_call_leaves_nothing_in_the_caches_or_the_live_pool) {
    /* A generative model pooled by --pooling both embeds and generates. */
    const char *extra[] = {"--pooling", "last", NULL};
    start("qwen3-tiny", extra);
    rk_test_resp r = post("{\"input\": [\"a passage long enough to fill more than one KV block of "
                          "sixteen tokens, so that blocks are taken\", \"and another\"]}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
    json_t *s = stats();
    cr_expect_eq(rk_test_jint(s, "prefix.cached_tokens"), 0);
    cr_expect_eq(rk_test_jint(s, "chunks.entries"), 0);
    cr_expect_eq(rk_test_jint(s, "pools.live.used"), 0);
    json_decref(s);
    /* A generation of the same text does cache its sequence: the check above can fail. */
    rk_test_resp g;
    cr_assert_eq(rk_test_exchange(&S.t, "POST", "/v1/completions", NULL,
                                  "{\"prompt\": \"a passage long enough to fill more than one KV "
                                  "block of sixteen tokens, so that blocks are taken\", "
                                  "\"max_tokens\": 2}",
                                  &g),
                 0);
    cr_assert_eq(g.http.status, 200, "%s", g.http.body);
    rk_test_resp_free(&g);
    s = stats();
    cr_expect_gt(rk_test_jint(s, "prefix.cached_tokens"), 0);
    json_decref(s);
}

/* data[0].embedding of an answer as n floats (asserted). */
static void vec_n(json_t *root, float *out, int n) {
    json_t *e = rk_test_jget(root, "data.0.embedding");
    cr_assert(json_is_array(e));
    cr_assert_eq(json_array_size(e), (size_t)n);
    for (int k = 0; k < n; k++) out[k] = (float)json_number_value(json_array_get(e, (size_t)k));
}

Test(embeddings, dimensions_are_the_first_values_renormalised) {
    start("qwen3-embedding-tiny", NULL);
    rk_test_resp full = post("{\"input\": \"matryoshka dolls nest\"}");
    rk_test_resp cut = post("{\"input\": \"matryoshka dolls nest\", \"dimensions\": 32}");
    cr_assert_eq(cut.http.status, 200, "%s", cut.http.body);
    float f[DIM], c[32];
    vec_of(full.json, 0, f);
    vec_n(cut.json, c, 32);
    double norm = 0, n2 = 0;
    for (int k = 0; k < 32; k++) norm += (double)f[k] * f[k];
    norm = sqrt(norm);
    for (int k = 0; k < 32; k++) {
        cr_expect_float_eq(c[k], f[k] / norm, 1e-6, "value %d: %g vs %g", k, c[k], f[k] / norm);
        n2 += (double)c[k] * c[k];
    }
    cr_expect_float_eq(n2, 1.0, 1e-5);
    /* base64 carries the same 32 values: 128 bytes. */
    rk_test_resp b = post("{\"input\": \"matryoshka dolls nest\", \"dimensions\": 32, "
                          "\"encoding_format\": \"base64\"}");
    cr_assert_eq(b.http.status, 200, "%s", b.http.body);
    cr_expect_eq(strlen(rk_test_jstr(b.json, "data.0.embedding")), (32 * 4 + 2) / 3 * 4);
    rk_test_resp_free(&b);
    rk_test_resp_free(&cut);
    rk_test_resp_free(&full);
}

Test(embeddings, a_generative_model_pooled_by_flag_serves_its_full_width_only) {
    const char *extra[] = {"--pooling", "mean", NULL};
    start("qwen3-tiny", extra);
    expect_error("{\"input\": \"hi\", \"dimensions\": 32}", 400, NULL);
    rk_test_resp r = post("{\"input\": \"hi\", \"dimensions\": 128}");
    cr_expect_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
}

Test(embeddings, truncate_cuts_an_input_to_the_context_from_the_side_asked) {
    const char *extra[] = {"--max-context", "16", NULL};
    start("qwen3-embedding-tiny", extra);
    /* 16 tokens or more: count them with /tokenize. */
    const char *text = "one two three four five six seven eight nine ten eleven twelve thirteen "
                       "fourteen fifteen sixteen seventeen eighteen nineteen twenty";
    rk_test_resp t;
    char body[1024];
    snprintf(body, sizeof body, "{\"content\": \"%s\", \"add_special\": true}", text);
    cr_assert_eq(rk_test_exchange(&S.t, "POST", "/tokenize", NULL, body, &t), 0);
    json_t *toks = rk_test_jget(t.json, "tokens");
    size_t n = json_array_size(toks);
    cr_assert_gt(n, 16);
    snprintf(body, sizeof body, "{\"input\": \"%s\"}", text);
    expect_error(body, 400, "context_length_exceeded");
    /* Right (the default): the first 16 tokens; left: the last 16. */
    const char *dirs[] = {"", ", \"truncation_direction\": \"left\""};
    for (int d = 0; d < 2; d++) {
        snprintf(body, sizeof body, "{\"input\": \"%s\", \"truncate\": true%s}", text, dirs[d]);
        rk_test_resp r = post(body);
        cr_assert_eq(r.http.status, 200, "%s", r.http.body);
        cr_expect_eq(rk_test_jint(r.json, "usage.prompt_tokens"), 16);
        char ids[512] = "{\"input\": [";
        for (size_t i = 0; i < 16; i++) {
            size_t k = d ? n - 16 + i : i;
            snprintf(ids + strlen(ids), sizeof ids - strlen(ids), "%s%lld", i ? "," : "",
                     (long long)json_integer_value(json_array_get(toks, k)));
        }
        strcat(ids, "]}");
        rk_test_resp w = post(ids);
        cr_assert_eq(w.http.status, 200, "%s", w.http.body);
        float a[DIM], b[DIM];
        vec_of(r.json, 0, a);
        vec_of(w.json, 0, b);
        cr_expect_float_eq(dot(a, b), 1.0, 1e-5, "direction %d", d);
        rk_test_resp_free(&w);
        rk_test_resp_free(&r);
    }
    rk_test_resp_free(&t);
}

Test(embeddings, an_embedding_model_does_not_generate) {
    start("qwen3-embedding-tiny", NULL);
    rk_test_resp g;
    cr_assert_eq(rk_test_exchange(&S.t, "POST", "/v1/completions", NULL,
                                  "{\"prompt\": \"hello\", \"max_tokens\": 2}", &g),
                 0);
    cr_expect_eq(g.http.status, 400, "%s", g.http.body);
    rk_test_resp_free(&g);
}

/* A large call and a stream on one server: the call's inputs go through the
 * steps a slice at a time (--step-tokens 8, inputs of 20 tokens and more:
 * each over several passes), between the stream's tokens. The stream
 * starts first and asks for 16 tokens; the call, sent after its first one,
 * needs more than 100 steps. Run as one command between two steps (as
 * before), the call would be answered before the stream's next token; in
 * the steps, the stream ends first while the call is still unanswered. The
 * vectors are the ones the call gets alone (no stream: no budget, every
 * input whole in one pass), and nothing stays in the live pool. */
Test(embeddings, a_large_call_runs_in_slices_between_a_streams_tokens_with_the_same_vectors) {
    const char *extra[] = {"--pooling", "mean", "--step-tokens", "8", "--token-delay-s",
                           "0.01",      NULL};
    start("qwen3-tiny", extra);
    enum { N = 40 };
    json_t *input = json_array();
    for (int i = 0; i < N; i++)
        json_array_append_new(
            input, json_sprintf("Passage %d: the river runs past the mill, the baker bakes bread "
                                "and the bell rings over the valley %d times.",
                                i, 3 * i + 1));
    json_t *req = json_pack("{s:o}", "input", input);
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);

    rk_http_conn g, e;
    const char *gen =
        "{\"prompt\": \"Once upon a time\", \"max_tokens\": 16, \"ignore_eos\": true, "
        "\"temperature\": 0, \"stream\": true}";
    cr_assert_eq(rk_http_open(&S.t, "POST", "/v1/completions", NULL, gen, strlen(gen), &g), RK_OK);
    cr_assert_eq(rk_http_wait_for(&g, "data: "), RK_OK, "no first token: %s", rk_error_message());
    cr_assert_eq(rk_http_open(&S.t, "POST", "/v1/embeddings", NULL, body, strlen(body), &e), RK_OK);
    rk_http_response gr;
    cr_assert_eq(rk_http_finish(&g, NULL, NULL, &gr), RK_OK, "%s", rk_error_message());
    /* All 16 tokens came (the last event lists them; a loaded machine may
     * carry several tokens in one event), and the stream ended. */
    const char *last = NULL;
    for (const char *p = gr.body; (p = strstr(p, "data: {")); p++) last = p;
    cr_assert_not_null(last, "no event: %s", gr.body);
    json_t *end = json_loadb(last + 6, strcspn(last + 6, "\n"), 0, NULL);
    cr_assert_not_null(end, "%s", last);
    cr_expect_eq(json_array_size(json_object_get(json_object_get(end, "ragkv"), "completion_ids")),
                 16, "the stream ended with: %s", last);
    json_decref(end);
    cr_expect(strstr(gr.body, "data: [DONE]") != NULL, "the stream did not end: %s", gr.body);
    rk_http_response_free(&gr);
    /* The stream is over; the embedding call has not been answered yet. */
    struct pollfd pf = {.fd = e.fd, .events = POLLIN};
    cr_expect_eq(poll(&pf, 1, 0), 0,
                 "the embedding call was answered before the stream's last token");
    rk_test_resp sliced = {0};
    cr_assert_eq(rk_http_finish(&e, NULL, NULL, &sliced.http), RK_OK, "%s", rk_error_message());
    rk_test_resp_parse_json(&sliced);
    cr_assert_eq(sliced.http.status, 200, "%s", sliced.http.body);
    rk_test_resp whole = post(body);
    cr_assert_eq(whole.http.status, 200, "%s", whole.http.body);
    cr_expect_eq(rk_test_jint(whole.json, "usage.prompt_tokens"),
                 rk_test_jint(sliced.json, "usage.prompt_tokens"));
    cr_assert_gt(rk_test_jint(whole.json, "usage.prompt_tokens"), N * 20);
    double worst = 0;
    for (int i = 0; i < N; i++) {
        float a[DIM], b[DIM];
        vec_of(sliced.json, i, a);
        vec_of(whole.json, i, b);
        for (int k = 0; k < DIM; k++) worst = fmax(worst, fabs((double)a[k] - b[k]));
    }
    cr_log_info("sliced against whole: max |difference| %.3g", worst);
    cr_expect_leq(worst, 1e-5, "the sliced vectors differ from the whole ones by %.3g", worst);
    json_t *st = stats();
    cr_expect_eq(rk_test_jint(st, "pools.live.used"), 0);
    json_decref(st);
    rk_test_resp_free(&whole);
    rk_test_resp_free(&sliced);
    free(body);
}

/* A call that runs past --timeout-s is cancelled in the steps: 503 with the
 * timeout named, and what its inputs held (an input fed over two passes
 * holds blocks between them) goes back to the live pool. 2048 inputs of 12
 * tokens are 12 passes of 2048 tokens, each step followed by the test
 * delay of 0.05 s: far past the 0.2 s allowed. */
Test(embeddings, a_call_past_the_timeout_is_cancelled_and_releases_its_blocks) {
    const char *extra[] = {"--timeout-s", "0.2", "--token-delay-s", "0.05", NULL};
    start("qwen3-embedding-tiny", extra);
    json_t *input = json_array();
    for (int i = 0; i < 2048; i++) {
        json_t *ids = json_array();
        for (int k = 0; k < 12; k++) json_array_append_new(ids, json_integer(1000 + 7 * i + k));
        json_array_append_new(input, ids);
    }
    json_t *req = json_pack("{s:o}", "input", input);
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    rk_test_resp r = post(body);
    cr_expect_eq(r.http.status, 503, "%s", r.http.body);
    cr_expect(strstr(rk_test_jstr(r.json, "error.message"), "timeout") != NULL, "%s", r.http.body);
    rk_test_resp_free(&r);
    json_t *st = stats();
    cr_expect_eq(rk_test_jint(st, "pools.live.used"), 0);
    json_decref(st);
    /* The server goes on: a small call is answered. It takes one step, but
     * on a loaded machine a step may itself outlast the 0.2 s, so it is
     * tried until answered (a cancelled try is the timeout's 503). */
    rk_test_resp ok = {0};
    for (int try = 0; try < 50; try++) {
        rk_test_resp_free(&ok);
        ok = post("{\"input\": \"still here\"}");
        if (ok.http.status != 503) break;
    }
    cr_expect_eq(ok.http.status, 200, "%s", ok.http.body);
    rk_test_resp_free(&ok);
    free(body);
}
