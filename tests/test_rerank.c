/* tests/test_rerank.c — POST /v1/rerank end to end: the real `ragkv serve`
 * on loopback with the qwen3-reranker-tiny preset (Qwen3 vocabulary,
 * pooling_type 4 = rank, a yes/no head cls.output and Qwen3-Reranker's
 * prompt), and the routes a reranking, an embedding and a generative model
 * each refuse. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static rk_test_server S;

static void stop_server(void) { rk_test_server_stop_checked(&S); }

/* Start a server on preset's model with extra args (NULL-terminated, at most 4). */
static void start(const char *preset, const char *const *extra) {
    char *model = rk_test_model(preset, "f32", 1);
    const char *args[8] = {"--model", model};
    int n = 2;
    for (int i = 0; extra && extra[i]; i++) args[n++] = extra[i];
    args[n] = NULL;
    cr_assert_eq(rk_test_server_start_ready(&S, "rerank", NULL, args), 0,
                 "the server did not start");
    free(model);
}

static rk_test_resp post_to(const char *path, const char *body) {
    rk_test_resp r;
    cr_assert_eq(
        rk_test_exchange(&S.t, "POST", path, "Content-Type: application/json\r\n", body, &r), 0,
        "no answer");
    cr_assert_not_null(r.json, "not JSON: %s", r.http.body);
    return r;
}

static rk_test_resp post(const char *body) { return post_to("/v1/rerank", body); }

/* Check an error answer on path: status, envelope, and a message containing
 * words (NULL: any). */
static void expect_error_at(const char *path, const char *body, int status, const char *words) {
    rk_test_resp r = post_to(path, body);
    cr_expect_eq(r.http.status, status, "%s %.80s -> %d: %s", path, body, r.http.status,
                 r.http.body);
    cr_expect_str_eq(rk_test_jstr(r.json, "error.type"), "invalid_request_error");
    const char *msg = rk_test_jstr(r.json, "error.message");
    cr_expect(msg && (!words || strstr(msg, words)), "%s: message %s", body, msg ? msg : "(none)");
    rk_test_resp_free(&r);
}

static void expect_error(const char *body, int status, const char *words) {
    expect_error_at("/v1/rerank", body, status, words);
}

#define QUERY "\"What is the capital of France?\""
#define DOCS                                                                                       \
    "[\"Paris is the capital and largest city of France.\", {\"text\": \"The mitochondria is the " \
    "powerhouse of the cell.\"}, \"Berlin is the capital of Germany.\", {\"text\": \"France's "    \
    "capital city, Paris, lies on the Seine.\"}]"
static const char *const k_docs[] = {"Paris is the capital and largest city of France.",
                                     "The mitochondria is the powerhouse of the cell.",
                                     "Berlin is the capital of Germany.",
                                     "France's capital city, Paris, lies on the Seine."};
#define N_DOCS 4

/* results[i] of r as (index, score). */
static void result_at(rk_test_resp *r, int i, int *index, double *score) {
    char path[64];
    snprintf(path, sizeof path, "results.%d.index", i);
    *index = (int)rk_test_jint(r->json, path);
    snprintf(path, sizeof path, "results.%d.relevance_score", i);
    json_t *s = rk_test_jget(r->json, path);
    cr_assert(json_is_number(s), "%s: %s", path, r->http.body);
    *score = json_number_value(s);
}

TestSuite(rerank, .fini = stop_server, .timeout = 300);

Test(rerank, every_document_gets_a_yes_probability_sorted_best_first) {
    start("qwen3-reranker-tiny", NULL);
    rk_test_resp r = post("{\"model\": \"x\", \"query\": " QUERY ", \"documents\": " DOCS "}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_expect_str_eq(rk_test_jstr(r.json, "object"), "list");
    cr_expect(json_is_string(rk_test_jget(r.json, "model")));
    json_t *results = rk_test_jget(r.json, "results");
    cr_assert_eq(json_array_size(results), N_DOCS, "%s", r.http.body);
    int seen[N_DOCS] = {0};
    double prev = 2.0, first = 0, last = 0;
    for (int i = 0; i < N_DOCS; i++) {
        int index;
        double score;
        result_at(&r, i, &index, &score);
        cr_assert(index >= 0 && index < N_DOCS, "index %d", index);
        seen[index]++;
        cr_expect(score > 0.0 && score < 1.0, "a probability: %g", score);
        cr_expect_leq(score, prev, "not sorted at %d", i);
        cr_expect_null(rk_test_jget(r.json, "results.0.document"), "no documents unless asked");
        prev = score;
        if (i == 0) first = score;
        last = score;
    }
    for (int i = 0; i < N_DOCS; i++) cr_expect_eq(seen[i], 1, "document %d listed once", i);
    cr_expect_gt(first - last, 1e-6, "the documents score the same: %g", first);
    long long tokens = rk_test_jint(r.json, "usage.prompt_tokens");
    cr_expect_gt(tokens, N_DOCS * 60, "the prompt is about 70 tokens a pair: %lld", tokens);
    cr_expect_eq(rk_test_jint(r.json, "usage.total_tokens"), tokens);

    /* Each document alone scores what it scores in the batch, every time;
     * /rerank answers the same. */
    for (int d = 0; d < N_DOCS; d++) {
        json_t *s = json_string(k_docs[d]);
        char *q = json_dumps(s, JSON_ENCODE_ANY);
        json_decref(s);
        char body[1024];
        snprintf(body, sizeof body, "{\"query\": " QUERY ", \"documents\": [%s]}", q);
        free(q);
        rk_test_resp one = post_to(d % 2 ? "/rerank" : "/v1/rerank", body);
        cr_assert_eq(one.http.status, 200, "%s", one.http.body);
        int index;
        double alone, batch = -1;
        result_at(&one, 0, &index, &alone);
        cr_expect_eq(index, 0);
        for (int i = 0; i < N_DOCS; i++) {
            int bi;
            double bs;
            result_at(&r, i, &bi, &bs);
            if (bi == d) batch = bs;
        }
        cr_expect_float_eq(alone, batch, 1e-5, "document %d: %.8f alone, %.8f in the batch", d,
                           alone, batch);
        rk_test_resp_free(&one);
    }
    rk_test_resp_free(&r);
}

Test(rerank, top_n_keeps_the_best_and_return_documents_gives_their_text) {
    start("qwen3-reranker-tiny", NULL);
    rk_test_resp all = post("{\"query\": " QUERY ", \"documents\": " DOCS "}");
    cr_assert_eq(all.http.status, 200, "%s", all.http.body);
    rk_test_resp top = post("{\"query\": " QUERY ", \"documents\": " DOCS
                            ", \"top_n\": 2, \"return_documents\": true}");
    cr_assert_eq(top.http.status, 200, "%s", top.http.body);
    cr_assert_eq(json_array_size(rk_test_jget(top.json, "results")), 2, "%s", top.http.body);
    for (int i = 0; i < 2; i++) {
        int a, b;
        double sa, sb;
        result_at(&all, i, &a, &sa);
        result_at(&top, i, &b, &sb);
        cr_expect_eq(a, b, "rank %d", i);
        cr_expect_float_eq(sa, sb, 1e-6);
        char path[64];
        snprintf(path, sizeof path, "results.%d.document.text", i);
        const char *text = rk_test_jstr(top.json, path);
        cr_expect(text && !strcmp(text, k_docs[b]), "%s: %s", path, text ? text : "(none)");
    }
    /* The usage counts every document scored, not only those returned. */
    cr_expect_eq(rk_test_jint(top.json, "usage.prompt_tokens"),
                 rk_test_jint(all.json, "usage.prompt_tokens"));
    /* top_n beyond the documents returns them all. */
    rk_test_resp many =
        post("{\"query\": " QUERY ", \"documents\": [\"a\", \"b\"], \"top_n\": 10}");
    cr_expect_eq(json_array_size(rk_test_jget(many.json, "results")), 2, "%s", many.http.body);
    rk_test_resp_free(&many);
    rk_test_resp_free(&top);
    rk_test_resp_free(&all);
}

Test(rerank, bad_requests_get_400_saying_what_is_wrong) {
    const char *extra[] = {"--max-context", "128", NULL};
    start("qwen3-reranker-tiny", extra);
    expect_error("{\"documents\": [\"a\"]}", 400, "'query' is required");
    expect_error("{\"query\": 5, \"documents\": [\"a\"]}", 400, "'query' must be a string");
    expect_error("{\"query\": \"\", \"documents\": [\"a\"]}", 400, "'query' is empty");
    expect_error("{\"query\": \"q\"}", 400, "'documents' is required");
    expect_error("{\"query\": \"q\", \"documents\": \"a\"}", 400, "'documents' must be an array");
    expect_error("{\"query\": \"q\", \"documents\": []}", 400, "1 to 1000 documents");
    expect_error("{\"query\": \"q\", \"documents\": [\"a\", 7]}", 400, "'documents[1]'");
    expect_error("{\"query\": \"q\", \"documents\": [{\"txt\": \"a\"}]}", 400, "'documents[0]'");
    expect_error("{\"query\": \"q\", \"documents\": [\"a\"], \"top_n\": 0}", 400, "'top_n'");
    expect_error("{\"query\": \"q\", \"documents\": [\"a\"], \"return_documents\": \"yes\"}", 400,
                 "'return_documents'");
    expect_error("{\"query\": \"q\", \"documents\": [\"a\"], \"model\": 3}", 400, "'model'");
    expect_error("[1]", 400, "JSON object");
    expect_error("{\"query\": ", 400, "not valid JSON");
    /* Too many documents. */
    size_t cap = 1001 * 6 + 64;
    char *body = malloc(cap);
    cr_assert_not_null(body);
    size_t o = (size_t)snprintf(body, cap, "{\"query\": \"q\", \"documents\": [");
    for (int i = 0; i < 1001; i++)
        o += (size_t)snprintf(body + o, cap - o, "%s\"d\"", i ? "," : "");
    snprintf(body + o, cap - o, "]}");
    expect_error(body, 400, "1 to 1000 documents, got 1001");
    free(body);
    /* A document that with the query and the prompt is over the context. */
    char lng[2048] = "{\"query\": \"q\", \"documents\": [\"short\", \"";
    for (int i = 0; i < 40; i++) strcat(lng, "token after token ");
    strcat(lng, "\"]}");
    rk_test_resp r = post(lng);
    cr_expect_eq(r.http.status, 400, "%s", r.http.body);
    cr_expect_str_eq(rk_test_jstr(r.json, "error.code"), "context_length_exceeded");
    const char *msg = rk_test_jstr(r.json, "error.message");
    cr_expect(msg && strstr(msg, "'documents[1]'") && strstr(msg, "context of 128"), "%s", msg);
    rk_test_resp_free(&r);
    /* The server still answers after the errors. */
    r = post("{\"query\": \"q\", \"documents\": [\"short\"]}");
    cr_expect_eq(r.http.status, 200, "%s", r.http.body);
    rk_test_resp_free(&r);
}

/* The capabilities /v1/models lists, as one comma-separated string. */
static void capabilities(char *out, size_t cap) {
    rk_test_resp r;
    cr_assert_eq(rk_test_exchange(&S.t, "GET", "/v1/models", NULL, NULL, &r), 0);
    json_t *caps = rk_test_jget(r.json, "data.0.capabilities");
    cr_assert(json_is_array(caps), "%s", r.http.body);
    out[0] = '\0';
    for (size_t i = 0; i < json_array_size(caps); i++) {
        strncat(out, i ? "," : "", cap - strlen(out) - 1);
        strncat(out, json_string_value(json_array_get(caps, i)), cap - strlen(out) - 1);
    }
    rk_test_resp_free(&r);
}

Test(rerank, a_reranking_model_reranks_only) {
    start("qwen3-reranker-tiny", NULL);
    char caps[128];
    capabilities(caps, sizeof caps);
    cr_expect_str_eq(caps, "rerank");
    expect_error_at("/v1/embeddings", "{\"input\": \"hello\"}", 400, "/v1/rerank");
    expect_error_at("/v1/completions", "{\"prompt\": \"hello\", \"max_tokens\": 2}", 400,
                    "does not generate");
    expect_error_at(
        "/v1/chat/completions",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 2}", 400,
        "does not generate");
}

/* Qwen3-Reranker's prompt with q and d in place, as a JSON string (malloc'ed). */
static char *filled_prompt(const char *q, const char *d) {
    char text[2048];
    snprintf(text, sizeof text,
             "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
             "Query and the Instruct provided. Note that the answer can only be \"yes\" or "
             "\"no\".<|im_end|>\n<|im_start|>user\n<Instruct>: Given a web search query, "
             "retrieve relevant passages that answer the query\n<Query>: %s\n<Document>: "
             "%s<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
             q, d);
    json_t *s = json_string(text);
    char *out = json_dumps(s, JSON_ENCODE_ANY);
    json_decref(s);
    return out;
}

/* The id of a one-token text. */
static long long token_id(const char *text) {
    char body[128];
    snprintf(body, sizeof body, "{\"content\": \"%s\"}", text);
    rk_test_resp t = post_to("/tokenize", body);
    cr_assert_eq(json_array_size(rk_test_jget(t.json, "tokens")), 1, "%s: %s", text, t.http.body);
    long long id = rk_test_jint(t.json, "tokens.0");
    rk_test_resp_free(&t);
    return id;
}

/* The score is P("yes") against "no" after the prompt: the same model served
 * with --pooling none generates, and its next-token logprobs for "yes" and
 * "no" after the filled prompt (each forced in turn by logit_bias; the
 * logprobs reported are the model's, before the bias) give the same
 * probability; the pair is the same tokens too. */
Test(rerank, the_score_is_the_yes_probability_the_model_generates_after_the_prompt) {
    const char *q = "Which city is the capital of France?";
    const char *docs[] = {"Paris is the capital and largest city of France.",
                          "Photosynthesis turns light into chemical energy.",
                          "<|im_end|> a document with a control token in it"};
    double score[3];
    long long n_tokens[3];
    start("qwen3-reranker-tiny", NULL);
    for (int i = 0; i < 3; i++) {
        json_t *d = json_string(docs[i]);
        char *dj = json_dumps(d, JSON_ENCODE_ANY);
        json_decref(d);
        char body[1024];
        snprintf(body, sizeof body, "{\"query\": \"%s\", \"documents\": [%s]}", q, dj);
        free(dj);
        rk_test_resp r = post(body);
        cr_assert_eq(r.http.status, 200, "%s", r.http.body);
        int index;
        result_at(&r, 0, &index, &score[i]);
        n_tokens[i] = rk_test_jint(r.json, "usage.prompt_tokens");
        rk_test_resp_free(&r);
    }
    rk_test_server_stop_checked(&S);

    const char *extra[] = {"--pooling", "none", NULL};
    start("qwen3-reranker-tiny", extra);
    char caps[128];
    capabilities(caps, sizeof caps);
    cr_expect_str_eq(caps, "completion");
    expect_error("{\"query\": \"q\", \"documents\": [\"a\"]}", 400, "does not rerank");
    long long yes = token_id("yes"), no = token_id("no");
    for (int i = 0; i < 3; i++) {
        char *prompt = filled_prompt(q, docs[i]);
        double lp[2];
        for (int k = 0; k < 2; k++) { /* the model's logprob of yes, then of no, forced */
            char body[4096];
            snprintf(body, sizeof body,
                     "{\"prompt\": %s, \"max_tokens\": 1, \"temperature\": 0, \"logprobs\": 1, "
                     "\"logit_bias\": {\"%lld\": 100}}",
                     prompt, k ? no : yes);
            rk_test_resp r = post_to("/v1/completions", body);
            cr_assert_eq(r.http.status, 200, "%s", r.http.body);
            cr_expect_eq(rk_test_jint(r.json, "usage.prompt_tokens"), n_tokens[i], "document %d",
                         i);
            cr_assert_eq(rk_test_jint(r.json, "ragkv.completion_ids.0"), k ? no : yes);
            json_t *l = rk_test_jget(r.json, "choices.0.logprobs.token_logprobs.0");
            cr_assert(json_is_number(l), "%s", r.http.body);
            lp[k] = json_number_value(l);
            rk_test_resp_free(&r);
        }
        free(prompt);
        double p_yes = 1.0 / (1.0 + exp(lp[1] - lp[0]));
        cr_expect_float_eq(score[i], p_yes, 2e-5, "document %d: score %.7f, P(yes) %.7f", i,
                           score[i], p_yes);
    }
}

/* Without tokenizer.chat_template.rerank a pair is [BOS] query [EOS] [SEP]
 * document [EOS], each special token where the vocabulary adds it: for the
 * Qwen3 vocabulary (none of them) the query's tokens then the document's,
 * control tokens in the texts not parsed. */
Test(rerank, without_a_rerank_prompt_the_pair_is_the_query_then_the_document) {
    char *src = rk_test_model("qwen3-reranker-tiny", "f32", 1);
    char *model = rk_test_model_without_key(src, "tokenizer.chat_template.rerank",
                                            "qwen3-reranker-tiny-no-prompt.gguf");
    const char *args[] = {"--model", model, NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "rerank", NULL, args), 0);
    free(model);
    free(src);
    const char *q = "capital of France", *d = "Paris <|im_end|> is the capital";
    char body[512];
    long long n = 0;
    const char *texts[] = {q, d};
    for (int i = 0; i < 2; i++) {
        snprintf(body, sizeof body, "{\"content\": \"%s\", \"parse_special\": false}", texts[i]);
        rk_test_resp t = post_to("/tokenize", body);
        n += (long long)json_array_size(rk_test_jget(t.json, "tokens"));
        rk_test_resp_free(&t);
    }
    snprintf(body, sizeof body, "{\"query\": \"%s\", \"documents\": [\"%s\"]}", q, d);
    rk_test_resp r = post(body);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_expect_eq(rk_test_jint(r.json, "usage.prompt_tokens"), n, "%s", r.http.body);
    int index;
    double score;
    result_at(&r, 0, &index, &score);
    cr_expect(score > 0 && score < 1, "%g", score);
    rk_test_resp_free(&r);
}

Test(rerank, an_embedding_model_embeds_only) {
    start("qwen3-embedding-tiny", NULL);
    char caps[128];
    capabilities(caps, sizeof caps);
    cr_expect_str_eq(caps, "embedding");
    expect_error("{\"query\": \"q\", \"documents\": [\"a\"]}", 400, "does not rerank");
    expect_error_at("/v1/completions", "{\"prompt\": \"hello\", \"max_tokens\": 2}", 400,
                    "/v1/embeddings");
    expect_error_at(
        "/v1/chat/completions",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 2}", 400,
        "/v1/embeddings");
}

Test(rerank, a_generative_model_does_not_rerank) {
    start("qwen3-tiny", NULL);
    char caps[128];
    capabilities(caps, sizeof caps);
    cr_expect_str_eq(caps, "completion");
    expect_error("{\"query\": \"q\", \"documents\": [\"a\"]}", 400, "does not rerank");
}
