/* tests/test_responses.c — POST /v1/responses (OpenAI's Responses API) on
 * the real `ragkv serve` binary over loopback HTTP: response objects,
 * input items and instructions answered as the same chat is, function
 * tools round trips, text.format, errors, stored responses (GET, DELETE,
 * input_items, limits, tenants), the event stream, previous_response_id
 * reusing the whole earlier conversation from the cache, and the official
 * `openai` npm SDK (tests/openai_sdk_responses.mjs) where npm is there.
 * Models: ../shared/models/stories260K.gguf (skipped when absent) and a
 * synthetic Qwen3 (ragkv mkmodel) for thinking, tools and schemas. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "tests/testutil.h"

static rk_test_server S;

typedef rk_test_resp resp;

static void stop_server(void) { rk_test_server_stop_checked(&S); }

TestSuite(responses, .fini = stop_server, .timeout = 600);

static void start_with(const char *const *args) {
    cr_assert_eq(rk_test_server_start_ready(&S, "responses", NULL, args), 0,
                 "the server did not start (log: %s)", S.log);
}

/* ragkv serve on stories260K (skipped when absent), with extra args. */
static void start_stories(const char *a1, const char *a2) {
    const char *model = rk_test_shared_path("models/stories260K.gguf");
    if (!model) cr_skip_test("missing ../shared/models/stories260K.gguf");
    char path[4096];
    snprintf(path, sizeof path, "%s", model);
    const char *args[] = {"--model", path, a1, a2, NULL};
    if (!a1) args[2] = NULL;
    start_with(args);
}

static char *qwen3_model(void) { return rk_test_model("qwen3-tiny", "f32", 1); }

static resp call(const char *method, const char *path, const char *headers, const char *body) {
    resp r;
    cr_assert_eq(rk_test_exchange(&S.t, method, path, headers, body, &r), 0, "%s %s: no answer",
                 method, path);
    return r;
}

/* POST /v1/responses with body; asserts the status. */
static resp create(int status, const char *body) {
    resp r = call("POST", "/v1/responses", NULL, body);
    cr_assert_eq(r.http.status, status, "%s -> %d %s", body, r.http.status, r.http.body);
    return r;
}

static char *fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));
static char *fmt(const char *f, ...) {
    static char buf[8][16384];
    static int next;
    char *b = buf[next++ % 8];
    va_list ap;
    va_start(ap, f);
    vsnprintf(b, sizeof buf[0], f, ap);
    va_end(ap);
    return b;
}

static long long jint(json_t *j, const char *path) { return rk_test_jint(j, path); }
static const char *jstr(json_t *j, const char *path) { return rk_test_jstr(j, path); }

/* The text of the response's message item. */
static const char *output_text(json_t *r) {
    json_t *out = json_object_get(r, "output");
    for (size_t i = 0; i < json_array_size(out); i++) {
        json_t *it = json_array_get(out, i);
        if (!strcmp(json_string_value(json_object_get(it, "type")), "message"))
            return rk_test_jstr(it, "content.0.text");
    }
    return NULL;
}

/* ================================================================ objects */

Test(responses, a_string_input_answers_a_response_object_that_is_stored) {
    start_stories(NULL, NULL);
    resp r = create(200, "{\"input\": \"Once upon a time\", \"max_output_tokens\": 12, "
                         "\"seed\": 3, \"metadata\": {\"k\": \"v\"}, \"user\": \"u1\"}");
    json_t *j = r.json;
    cr_assert_str_eq(jstr(j, "object"), "response");
    cr_assert(!strncmp(jstr(j, "id"), "resp_", 5));
    cr_assert_str_eq(jstr(j, "status"), "incomplete", "%s", r.http.body);
    cr_assert_str_eq(jstr(j, "incomplete_details.reason"), "max_output_tokens");
    cr_assert_str_eq(jstr(j, "metadata.k"), "v");
    cr_assert_str_eq(jstr(j, "output.0.type"), "message");
    cr_assert_str_eq(jstr(j, "output.0.role"), "assistant");
    cr_assert_str_eq(jstr(j, "output.0.content.0.type"), "output_text");
    cr_assert(json_is_array(rk_test_jget(j, "output.0.content.0.annotations")));
    cr_assert_eq(jint(j, "usage.output_tokens"), 12);
    cr_assert_eq(jint(j, "usage.total_tokens"),
                 jint(j, "usage.input_tokens") + jint(j, "usage.output_tokens"));
    cr_assert_not_null(rk_test_jget(j, "usage.input_tokens_details.cached_tokens"));
    cr_assert_eq(jint(j, "usage.output_tokens_details.reasoning_tokens"), 0);
    cr_assert_not_null(rk_test_jget(j, "ragkv.timings"), "the ragkv report rides along");
    cr_assert(json_is_true(rk_test_jget(j, "store")));

    char id[96], path[160];
    snprintf(id, sizeof id, "%s", jstr(j, "id"));
    snprintf(path, sizeof path, "/v1/responses/%s", id);
    resp g = call("GET", path, NULL, NULL);
    cr_assert_eq(g.http.status, 200, "%s", g.http.body);
    cr_assert(json_equal(g.json, j), "GET returns the response as it was answered");
    snprintf(path, sizeof path, "/v1/responses/%s/input_items", id);
    resp items = call("GET", path, NULL, NULL);
    cr_assert_eq(items.http.status, 200, "%s", items.http.body);
    cr_assert_str_eq(jstr(items.json, "object"), "list");
    cr_assert_str_eq(jstr(items.json, "data.0.type"), "message");
    cr_assert_str_eq(jstr(items.json, "data.0.role"), "user");
    cr_assert_str_eq(jstr(items.json, "data.0.content.0.text"), "Once upon a time");
    cr_assert_eq(json_array_size(rk_test_jget(items.json, "data")), 1);

    snprintf(path, sizeof path, "/v1/responses/%s", id);
    resp d = call("DELETE", path, NULL, NULL);
    cr_assert_eq(d.http.status, 200, "%s", d.http.body);
    cr_assert_str_eq(jstr(d.json, "id"), id);
    cr_assert(json_is_true(rk_test_jget(d.json, "deleted")));
    resp gone = call("GET", path, NULL, NULL);
    cr_assert_eq(gone.http.status, 404, "%s", gone.http.body);
    cr_assert_str_eq(jstr(gone.json, "error.type"), "invalid_request_error");
    resp again = call("DELETE", path, NULL, NULL);
    cr_assert_eq(again.http.status, 404);
    resp none = call("GET", "/v1/responses/resp_nope/input_items", NULL, NULL);
    cr_assert_eq(none.http.status, 404);
    resp prev = create(404, "{\"input\": \"x\", \"previous_response_id\": \"resp_nope\"}");
    cr_assert_str_eq(jstr(prev.json, "error.param"), "previous_response_id");
    resp put = call("PUT", path, NULL, "{}");
    cr_assert_eq(put.http.status, 405);

    resp unstored = create(200, "{\"input\": \"Hi\", \"max_output_tokens\": 2, \"store\": false}");
    cr_assert(json_is_false(rk_test_jget(unstored.json, "store")));
    snprintf(path, sizeof path, "/v1/responses/%s", jstr(unstored.json, "id"));
    resp nf = call("GET", path, NULL, NULL);
    cr_assert_eq(nf.http.status, 404, "store: false keeps nothing");
    resp *all[] = {&r, &g, &items, &d, &gone, &again, &none, &prev, &put, &unstored, &nf};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) rk_test_resp_free(all[i]);
}

/* Input items, a string content and parts, and instructions render the same
 * conversation as the chat route: the same seed gives the same answer and
 * the same prompt. */
Test(responses, items_and_instructions_answer_as_the_same_chat_does) {
    start_stories(NULL, NULL);
    resp r = create(200, "{\"instructions\": \"You tell stories.\", \"input\": ["
                         "{\"role\": \"user\", \"content\": \"Tell me about a cat.\"},"
                         "{\"type\": \"message\", \"role\": \"assistant\", \"content\": "
                         "[{\"type\": \"output_text\", \"text\": \"The cat sat.\"}]},"
                         "{\"role\": \"user\", \"content\": [{\"type\": \"input_text\", \"text\": "
                         "\"And the dog?\"}]}], \"max_output_tokens\": 16, \"seed\": 9, "
                         "\"temperature\": 0.8, \"top_p\": 0.9}");
    resp c = rk_test_postf(&S.t, "/v1/chat/completions",
                           "{\"messages\": [{\"role\": \"system\", \"content\": \"You tell "
                           "stories.\"}, {\"role\": \"user\", \"content\": \"Tell me about a "
                           "cat.\"}, {\"role\": \"assistant\", \"content\": \"The cat sat.\"}, "
                           "{\"role\": \"user\", \"content\": \"And the dog?\"}], \"max_tokens\": "
                           "16, \"seed\": 9, \"temperature\": 0.8, \"top_p\": 0.9}");
    cr_assert_eq(c.http.status, 200, "%s", c.http.body);
    cr_assert_str_eq(output_text(r.json), jstr(c.json, "choices.0.message.content"));
    cr_assert_eq(jint(r.json, "usage.input_tokens"), jint(c.json, "usage.prompt_tokens"));
    cr_assert_str_eq(jstr(r.json, "instructions"), "You tell stories.");
    cr_assert(json_real_value(rk_test_jget(r.json, "top_p")) > 0.89);
    resp plain = create(200, "{\"input\": \"And the dog?\", \"max_output_tokens\": 2}");
    cr_assert_lt(jint(plain.json, "usage.input_tokens"), jint(r.json, "usage.input_tokens"));
    rk_test_resp_free(&r);
    rk_test_resp_free(&c);
    rk_test_resp_free(&plain);
}

Test(responses, what_cannot_be_honoured_is_a_400_naming_the_field) {
    start_stories(NULL, NULL);
    static const struct {
        const char *body, *param;
    } cases[] = {
        {"{\"input\": 5}", "input"},
        {"{\"input\": []}", "input"},
        {"{\"input\": [{\"role\": \"user\", \"content\": [{\"type\": \"input_image\", "
         "\"image_url\": \"http://x\"}]}]}",
         "input"},
        {"{\"input\": [{\"role\": \"user\", \"content\": [{\"type\": \"input_file\", "
         "\"file_id\": \"f\"}]}]}",
         "input"},
        {"{\"input\": [{\"type\": \"item_reference\", \"id\": \"x\"}]}", "input"},
        {"{\"input\": [{\"type\": \"function_call\", \"name\": \"f\"}]}", "input"},
        {"{\"input\": \"x\", \"tools\": [{\"type\": \"web_search\"}]}", "tools"},
        {"{\"input\": \"x\", \"tool_choice\": {\"type\": \"file_search\"}, \"tools\": []}",
         "tool_choice"},
        {"{\"input\": \"x\", \"text\": {\"format\": {\"type\": \"yaml\"}}}", "text.format"},
        {"{\"input\": \"x\", \"background\": true}", "background"},
        {"{\"input\": \"x\", \"reasoning\": {\"effort\": \"huge\"}}", "reasoning.effort"},
        {"{\"input\": \"x\", \"instructions\": 3}", "instructions"},
        {"{\"input\": \"x\", \"include\": [\"reasoning.encrypted_content\"]}", "include"},
        {"{\"input\": \"x\", \"store\": \"yes\"}", "store"},
        {"{\"input\": \"x\", \"metadata\": []}", "metadata"},
        {"{\"input\": \"x\", \"previous_response_id\": 7}", "previous_response_id"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        resp r = create(400, cases[i].body);
        cr_assert_str_eq(jstr(r.json, "error.type"), "invalid_request_error");
        const char *p = json_string_value(rk_test_jget(r.json, "error.param"));
        cr_assert(p && !strcmp(p, cases[i].param), "%s: param %s, want %s (%s)", cases[i].body,
                  p ? p : "null", cases[i].param, r.http.body);
        rk_test_resp_free(&r);
    }
    resp bad = create(400, "not json");
    rk_test_resp_free(&bad);
    char deep[256] = "{\"input\": \"x\", \"metadata\": ";
    for (int i = 0; i < 40; i++) strcat(deep, "[");
    for (int i = 0; i < 40; i++) strcat(deep, "]");
    strcat(deep, "}");
    resp nested = create(400, deep);
    cr_assert(strstr(jstr(nested.json, "error.message"), "deeper"), "%s", nested.http.body);
    rk_test_resp_free(&nested);
    /* The chat path's own checks still apply. */
    resp mt = create(400, "{\"input\": \"x\", \"max_output_tokens\": -1}");
    rk_test_resp_free(&mt);
}

/* ================================================================ conversations */

/* Three turns chained by previous_response_id: each turn renders the stored
 * conversation before its input, so the radix tree already holds every
 * token of the earlier turns (prompts and answers) and only the new input
 * is computed. */
Test(responses, previous_response_id_reuses_every_earlier_token) {
    start_stories(NULL, NULL);
    const char *inputs[] = {"Once upon a time there was a girl.", "What was her name?",
                            "Where did she live?"};
    char prev[96] = "";
    long long last_total = 0;
    for (int t = 0; t < 3; t++) {
        char p[160] = "";
        if (prev[0]) snprintf(p, sizeof p, ", \"previous_response_id\": \"%s\"", prev);
        resp r = create(200, fmt("{\"instructions\": \"Tell a story.\", \"input\": \"%s\", "
                                 "\"max_output_tokens\": 12, \"seed\": %d%s}",
                                 inputs[t], t + 1, p));
        long long in = jint(r.json, "usage.input_tokens"),
                  out = jint(r.json, "usage.output_tokens");
        long long cached = jint(r.json, "usage.input_tokens_details.cached_tokens");
        cr_log_info("turn %d: input %lld, cached %lld, output %lld", t + 1, in, cached, out);
        if (t > 0) {
            /* A margin of 2 tokens: the earlier answer's end, which the
             * render closes with its end-of-turn, may tokenize apart. */
            cr_assert_geq(cached, last_total - 2,
                          "turn %d: %lld cached of %lld; the turns before held %lld", t + 1, cached,
                          in, last_total);
            cr_assert_gt(in, last_total, "turn %d carries the whole conversation", t + 1);
            long long computed = jint(r.json, "ragkv.timings.prompt_tokens_computed");
            cr_assert_leq(computed, in - last_total + 2, "turn %d computed %lld", t + 1, computed);
            cr_assert_str_eq(jstr(r.json, "previous_response_id"), prev);
        }
        last_total = in + out;
        snprintf(prev, sizeof prev, "%s", jstr(r.json, "id"));
        rk_test_resp_free(&r);
    }
    /* input_items lists the last turn's own input. */
    resp items = call("GET", fmt("/v1/responses/%s/input_items?order=asc", prev), NULL, NULL);
    cr_assert_eq(items.http.status, 200);
    cr_assert_eq(json_array_size(rk_test_jget(items.json, "data")), 1);
    cr_assert_str_eq(jstr(items.json, "data.0.content.0.text"), inputs[2]);
    rk_test_resp_free(&items);
}

/* Documents (the `documents` field, or ragkv_chunk parts) are cached
 * chunks, and stay in the stored conversation: the next turn renders them
 * where they were and reuses everything before its own input. */
Test(responses, documents_are_chunks_and_stay_with_the_conversation) {
    start_stories(NULL, NULL);
    resp t1 = create(200, "{\"input\": \"What did the cat do?\", \"documents\": [\"The cat "
                          "sat on the mat all day long.\", {\"text\": \"The dog ran in the "
                          "park.\"}], \"max_output_tokens\": 6, \"seed\": 2}");
    cr_assert_eq(json_array_size(rk_test_jget(t1.json, "ragkv.chunks")), 2, "%s", t1.http.body);
    resp items = call("GET", fmt("/v1/responses/%s/input_items", jstr(t1.json, "id")), NULL, NULL);
    cr_assert(json_is_true(rk_test_jget(items.json, "data.0.content.0.ragkv_chunk")), "%s",
              items.http.body);
    /* At least turn 1's prompt, documents included, is reused (its answer
     * too where it tokenizes alike in the rendered turn: the three-turn
     * test checks that). */
    long long before = jint(t1.json, "usage.input_tokens");
    resp t2 = create(200, fmt("{\"input\": \"And the dog?\", \"previous_response_id\": \"%s\", "
                              "\"max_output_tokens\": 6, \"seed\": 3}",
                              jstr(t1.json, "id")));
    cr_assert_eq(json_array_size(rk_test_jget(t2.json, "ragkv.chunks")), 2, "%s", t2.http.body);
    cr_assert_geq(jint(t2.json, "usage.input_tokens_details.cached_tokens"), before - 2, "%s",
                  t2.http.body);
    /* The same documents as parts of an input item render the same prompt. */
    resp parts = create(200, "{\"input\": [{\"role\": \"user\", \"content\": [{\"type\": "
                             "\"input_text\", \"text\": \"The cat sat on the mat all day "
                             "long.\", \"ragkv_chunk\": true}, {\"type\": \"input_text\", "
                             "\"text\": \"The dog ran in the park.\", \"ragkv_chunk\": true}, "
                             "{\"type\": \"input_text\", \"text\": \"What did the cat "
                             "do?\"}]}], \"max_output_tokens\": 6, \"seed\": 2}");
    cr_assert_str_eq(output_text(parts.json), output_text(t1.json));
    cr_assert_eq(jint(parts.json, "usage.input_tokens"), jint(t1.json, "usage.input_tokens"));
    cr_assert_str_eq(jstr(parts.json, "ragkv.chunks.0.status"), "hit");
    resp *all[] = {&t1, &items, &t2, &parts};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) rk_test_resp_free(all[i]);
}

/* With chunking.tool_results, a function_call_output of passages is a
 * chunk group where it stands, after the user message's documents. */
Test(responses, a_chunked_function_call_output_is_a_group_where_it_stands) {
    char *model = qwen3_model();
    const char *args[] = {"--model", model, NULL};
    start_with(args);
    resp r = create(
        200, "{\"input\": [{\"role\": \"user\", \"content\": [{\"type\": \"input_text\", "
             "\"text\": \"The cat sat.\", \"ragkv_chunk\": true}, {\"type\": \"input_text\", "
             "\"text\": \"Find the dog.\"}]}, {\"type\": \"function_call\", \"call_id\": "
             "\"c1\", \"name\": \"search\", \"arguments\": \"{}\"}, {\"type\": "
             "\"function_call_output\", \"call_id\": \"c1\", \"output\": \"[\\\"The dog "
             "ran.\\\", \\\"The dog sat.\\\"]\"}], \"chunking\": {\"tool_results\": true}, "
             "\"max_output_tokens\": 3, \"temperature\": 0}");
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.chunks")), 3, "%s", r.http.body);
    cr_assert_eq(jint(r.json, "ragkv.chunks.0.group"), 0);
    cr_assert_eq(jint(r.json, "ragkv.chunks.1.group"), 1);
    cr_assert_eq(jint(r.json, "ragkv.chunks.2.group"), 1);
    cr_assert_eq(json_array_size(rk_test_jget(r.json, "ragkv.texts")), 1);
    rk_test_resp_free(&r);
    free(model);
}

/* The store keeps at most --responses-max responses, dropping the oldest. */
Test(responses, the_store_drops_the_oldest_beyond_its_count) {
    start_stories("--responses-max", "2");
    char ids[3][96];
    for (int i = 0; i < 3; i++) {
        resp r = create(200, "{\"input\": \"Hi\", \"max_output_tokens\": 1}");
        snprintf(ids[i], sizeof ids[i], "%s", jstr(r.json, "id"));
        rk_test_resp_free(&r);
    }
    int want[3] = {404, 200, 200};
    for (int i = 0; i < 3; i++) {
        resp g = call("GET", fmt("/v1/responses/%s", ids[i]), NULL, NULL);
        cr_assert_eq(g.http.status, want[i], "response %d: %d", i, g.http.status);
        rk_test_resp_free(&g);
    }
}

/* A response larger than --responses-max-bytes is not kept, and a kept one
 * is dropped --responses-ttl-s after it was made. */
Test(responses, the_store_keeps_nothing_over_its_bytes_or_past_its_ttl) {
    const char *small[] = {"--responses-max-bytes", "1024", NULL};
    start_with(small);
    resp r = create(200, "{\"input\": \"Hi\", \"max_output_tokens\": 1}");
    cr_assert_gt(strlen(r.http.body), 1024);
    resp g = call("GET", fmt("/v1/responses/%s", jstr(r.json, "id")), NULL, NULL);
    cr_assert_eq(g.http.status, 404, "a response over the store's bytes is not kept");
    rk_test_resp_free(&r);
    rk_test_resp_free(&g);
    stop_server();
    const char *ttl[] = {"--responses-ttl-s", "1", NULL};
    start_with(ttl);
    r = create(200, "{\"input\": \"Hi\", \"max_output_tokens\": 1}");
    const char *path = fmt("/v1/responses/%s", jstr(r.json, "id"));
    g = call("GET", path, NULL, NULL);
    cr_assert_eq(g.http.status, 200);
    rk_test_resp_free(&g);
    struct timespec ts = {1, 500 * 1000 * 1000};
    nanosleep(&ts, NULL);
    g = call("GET", path, NULL, NULL);
    cr_assert_eq(g.http.status, 404, "expired after its TTL");
    rk_test_resp_free(&r);
    rk_test_resp_free(&g);
}

/* One tenant never sees, continues or deletes another's response. */
Test(responses, a_tenant_never_sees_another_tenants_response) {
    char *keys = rk_test_write_tmp("responses", "keys.json",
                                   "{\"keys\": [{\"key\": \"key-a\", \"tenant\": \"A\"}, "
                                   "{\"key\": \"key-b\", \"tenant\": \"B\"}]}");
    const char *args[] = {"--api-keys-file", keys, NULL};
    start_with(args);
    free(keys);
    const char *ha = "Authorization: Bearer key-a\r\n", *hb = "Authorization: Bearer key-b\r\n";
    resp a = call("POST", "/v1/responses", ha, "{\"input\": \"Hi\", \"max_output_tokens\": 2}");
    cr_assert_eq(a.http.status, 200, "%s", a.http.body);
    const char *id = jstr(a.json, "id");
    const char *path = fmt("/v1/responses/%s", id);
    resp ga = call("GET", path, ha, NULL), gb = call("GET", path, hb, NULL);
    cr_assert_eq(ga.http.status, 200);
    cr_assert_eq(gb.http.status, 404, "B does not see A's response");
    resp ib = call("GET", fmt("/v1/responses/%s/input_items", id), hb, NULL);
    cr_assert_eq(ib.http.status, 404);
    resp cb = call("POST", "/v1/responses", hb,
                   fmt("{\"input\": \"x\", \"previous_response_id\": \"%s\"}", id));
    cr_assert_eq(cb.http.status, 404, "B cannot continue A's conversation");
    resp db = call("DELETE", path, hb, NULL);
    cr_assert_eq(db.http.status, 404);
    resp ga2 = call("GET", path, ha, NULL);
    cr_assert_eq(ga2.http.status, 200, "B's delete left A's response");
    resp *all[] = {&a, &ga, &gb, &ib, &cb, &db, &ga2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) rk_test_resp_free(all[i]);
}

/* ================================================================ streams */

/* The events of a stream, each {"type", ...}: the "event:" line names the
 * data's type; sequence numbers count up from 0. */
static json_t *read_events(const char *body) {
    json_t *evs = json_array();
    long long seq = 0;
    for (const char *p = strstr(body, "event: "); p; p = strstr(p + 1, "\nevent: ")) {
        if (*p == '\n') p++;
        const char *nl = strchr(p, '\n');
        cr_assert(nl && !strncmp(nl + 1, "data: ", 6), "%s", p);
        const char *end = strstr(nl, "\n\n");
        cr_assert(end);
        json_error_t e;
        json_t *d = json_loadb(nl + 7, (size_t)(end - nl - 7), 0, &e);
        cr_assert_not_null(d, "%s: %.200s", e.text, nl + 7);
        size_t tl = (size_t)(nl - p - 7);
        cr_assert(!strncmp(jstr(d, "type"), p + 7, tl) && strlen(jstr(d, "type")) == tl);
        cr_assert_eq(jint(d, "sequence_number"), seq++, "%s", jstr(d, "type"));
        json_array_append_new(evs, d);
        p = end;
    }
    return evs;
}

/* The response with what differs between two requests removed: ids, the
 * time, the ragkv report (timings, cache state). */
static json_t *comparable(json_t *r) {
    json_t *c = json_deep_copy(r);
    json_object_del(c, "id");
    json_object_del(c, "created_at");
    json_object_del(c, "ragkv");
    json_object_del(json_object_get(c, "usage"), "input_tokens_details");
    json_t *out = json_object_get(c, "output");
    for (size_t i = 0; i < json_array_size(out); i++) {
        json_object_del(json_array_get(out, i), "id");
        json_object_del(json_array_get(out, i), "call_id");
    }
    return c;
}

static const char *ev_type(json_t *evs, size_t i) {
    return json_string_value(json_object_get(json_array_get(evs, i), "type"));
}

Test(responses, a_stream_sends_the_events_in_order_and_ends_with_the_unstreamed_response) {
    start_stories(NULL, NULL);
    const char *body = "{\"input\": \"Once upon a time\", \"max_output_tokens\": 20, \"seed\": 11, "
                       "\"stop\": [\"zzz\"]%s}";
    resp whole = create(200, fmt(body, ""));
    resp st = create(200, fmt(body, ", \"stream\": true"));
    cr_assert(strstr(rk_test_header(&st, "Content-Type"), "text/event-stream"));
    json_t *evs = read_events(st.http.body);
    size_t n = json_array_size(evs);
    static const char *const head[] = {"response.created", "response.in_progress",
                                       "response.output_item.added", "response.content_part.added"};
    for (size_t i = 0; i < 4; i++) cr_assert_str_eq(ev_type(evs, i), head[i]);
    static const char *const tail[] = {"response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.incomplete"};
    for (size_t i = 0; i < 4; i++) cr_assert_str_eq(ev_type(evs, n - 4 + i), tail[i]);
    rk_strbuf text = {0};
    for (size_t i = 4; i < n - 4; i++) {
        cr_assert_str_eq(ev_type(evs, i), "response.output_text.delta");
        rk_strbuf_puts(&text, jstr(json_array_get(evs, i), "delta"));
    }
    cr_assert_gt(n, 9, "the text came in several deltas");
    cr_assert_str_eq(text.s, output_text(whole.json));
    cr_assert_str_eq(jstr(json_array_get(evs, n - 4), "text"), text.s);
    json_t *fin = rk_test_jget(json_array_get(evs, n - 1), "response");
    cr_assert_str_eq(jstr(json_array_get(evs, 0), "response.id"), jstr(fin, "id"));
    json_t *a = comparable(fin), *b = comparable(whole.json);
    char *sa = json_dumps(a, JSON_SORT_KEYS), *sb = json_dumps(b, JSON_SORT_KEYS);
    cr_assert(json_equal(a, b), "streamed:\n%s\nunstreamed:\n%s", sa, sb);
    /* The streamed response is stored as it ended. */
    resp g = call("GET", fmt("/v1/responses/%s", jstr(fin, "id")), NULL, NULL);
    cr_assert(json_equal(g.json, fin));
    free(sa);
    free(sb);
    json_decref(a);
    json_decref(b);
    json_decref(evs);
    rk_strbuf_free(&text);
    rk_test_resp_free(&whole);
    rk_test_resp_free(&st);
    rk_test_resp_free(&g);
}

/* A stream the server's timeout cuts (--timeout-s) ends with
 * response.incomplete, reason "cancelled", its message item incomplete.
 * Greedy, so that the answer is one that runs to max_output_tokens (a
 * sampled one may end by itself before the timeout). */
Test(responses, a_stream_cut_by_the_timeout_ends_incomplete) {
    const char *args[] = {"--timeout-s", "1", "--token-delay-s", "0.05", NULL};
    start_with(args);
    resp st = create(200, "{\"input\": \"Hi\", \"max_output_tokens\": 400, \"temperature\": 0, "
                          "\"stream\": true}");
    json_t *evs = read_events(st.http.body);
    size_t n = json_array_size(evs);
    cr_assert_str_eq(ev_type(evs, n - 1), "response.incomplete", "%s", st.http.body);
    json_t *fin = rk_test_jget(json_array_get(evs, n - 1), "response");
    cr_assert_str_eq(jstr(fin, "incomplete_details.reason"), "cancelled");
    cr_assert_str_eq(jstr(fin, "output.0.status"), "incomplete");
    cr_assert_lt(jint(fin, "usage.output_tokens"), 400);
    json_decref(evs);
    rk_test_resp_free(&st);
}

/* ================================================================ thinking, tools, schemas */

static const char *const TOOLS =
    "[{\"type\": \"function\", \"name\": \"get_weather\", \"description\": \"The weather.\", "
    "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\", "
    "\"maxLength\": 12}}, \"required\": [\"city\"], \"additionalProperties\": false}}]";

/* Qwen3's <think> block is a reasoning item before the message, whole and
 * streamed; effort minimal renders no thinking. A required function call
 * is a function_call item; its output, sent with previous_response_id,
 * continues the conversation from the cache. */
Test(responses, thinking_is_a_reasoning_item_and_a_function_call_round_trips) {
    char *model = qwen3_model();
    const char *args[] = {"--model", model, NULL};
    start_with(args);
    const char *think = "{\"input\": \"Hi\", \"max_output_tokens\": 4, \"temperature\": 0, "
                        "\"logit_bias\": {\"151667\": 100}%s}";
    resp r = create(200, fmt(think, ""));
    cr_assert_str_eq(jstr(r.json, "output.0.type"), "reasoning", "%s", r.http.body);
    cr_assert_str_eq(jstr(r.json, "output.0.content.0.type"), "reasoning_text");
    cr_assert_str_eq(jstr(r.json, "output.0.content.0.text"), "<think><think><think>");
    cr_assert_str_eq(jstr(r.json, "output.1.type"), "message");
    cr_assert_gt(jint(r.json, "usage.output_tokens_details.reasoning_tokens"), 0);
    cr_assert_leq(jint(r.json, "usage.output_tokens_details.reasoning_tokens"),
                  jint(r.json, "usage.output_tokens"));
    resp st = create(200, fmt(think, ", \"stream\": true"));
    json_t *evs = read_events(st.http.body);
    rk_strbuf rt = {0};
    int saw_part = 0;
    for (size_t i = 0; i < json_array_size(evs); i++) {
        if (!strcmp(ev_type(evs, i), "response.reasoning_text.delta"))
            rk_strbuf_puts(&rt, jstr(json_array_get(evs, i), "delta"));
        if (!strcmp(ev_type(evs, i), "response.content_part.added") &&
            !strcmp(jstr(json_array_get(evs, i), "part.type"), "reasoning_text"))
            saw_part = 1;
    }
    cr_assert(saw_part);
    cr_assert_str_eq(rt.s, "<think><think><think>", "%s", st.http.body);
    resp off = create(200, fmt(think, ", \"reasoning\": {\"effort\": \"minimal\"}"));
    cr_assert_str_eq(jstr(off.json, "output.0.type"), "message", "%s", off.http.body);
    cr_assert_eq(jint(off.json, "usage.input_tokens"), jint(r.json, "usage.input_tokens") + 4,
                 "effort minimal renders an empty think block");

    resp call1 = create(200, fmt("{\"input\": \"Weather in Paris?\", \"tools\": %s, "
                                 "\"tool_choice\": \"required\", \"max_output_tokens\": 60, "
                                 "\"seed\": 5}",
                                 TOOLS));
    json_t *fc = rk_test_jget(call1.json, "output.0");
    cr_assert_str_eq(jstr(fc, "type"), "function_call", "%s", call1.http.body);
    cr_assert_str_eq(jstr(fc, "name"), "get_weather");
    cr_assert_str_eq(jstr(fc, "status"), "completed");
    json_t *a = json_loads(jstr(fc, "arguments"), 0, NULL);
    cr_assert(json_is_string(json_object_get(a, "city")), "%s", jstr(fc, "arguments"));
    json_decref(a);
    /* Qwen3's template drops an earlier answer's thinking block (here the
     * empty one of a constrained answer), so the cache holds turn 1's
     * prompt up to its answer's opening, which is rendered again. */
    long long before = jint(call1.json, "usage.input_tokens") - 6;
    resp turn2 =
        create(200, fmt("{\"previous_response_id\": \"%s\", \"input\": [{\"type\": "
                        "\"function_call_output\", \"call_id\": \"%s\", \"output\": "
                        "\"{\\\"temp_c\\\": 21}\"}], \"tools\": %s, \"max_output_tokens\": "
                        "8, \"seed\": 1}",
                        jstr(call1.json, "id"), jstr(fc, "call_id"), TOOLS));
    cr_assert_geq(jint(turn2.json, "usage.input_tokens_details.cached_tokens"), before, "%s",
                  turn2.http.body);
    resp bad_call = create(400, fmt("{\"input\": [{\"type\": \"function_call_output\", "
                                    "\"output\": \"x\"}], \"tools\": %s}",
                                    TOOLS));
    cr_assert_str_eq(jstr(bad_call.json, "error.param"), "input");
    /* Streamed, the call is an item with its arguments in a delta. */
    resp sc = create(200, fmt("{\"input\": \"Weather in Paris?\", \"tools\": %s, \"tool_choice\": "
                              "\"required\", \"max_output_tokens\": 60, \"seed\": 5, "
                              "\"stream\": true}",
                              TOOLS));
    json_t *sevs = read_events(sc.http.body);
    size_t n = json_array_size(sevs);
    cr_assert_str_eq(ev_type(sevs, 2), "response.output_item.added");
    cr_assert_str_eq(ev_type(sevs, 3), "response.function_call_arguments.delta");
    cr_assert_str_eq(ev_type(sevs, 4), "response.function_call_arguments.done");
    cr_assert_str_eq(ev_type(sevs, n - 1), "response.completed");
    cr_assert_str_eq(jstr(json_array_get(sevs, 4), "arguments"), jstr(fc, "arguments"));
    json_decref(sevs);
    json_decref(evs);
    rk_strbuf_free(&rt);
    resp *all[] = {&r, &st, &off, &call1, &turn2, &bad_call, &sc};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) rk_test_resp_free(all[i]);
    free(model);
}

Test(responses, text_format_json_schema_gives_json_that_fits_it) {
    char *model = qwen3_model();
    const char *args[] = {"--model", model, NULL};
    start_with(args);
    for (int seed = 1; seed <= 3; seed++) {
        resp r =
            create(200, fmt("{\"input\": \"A person as JSON.\", \"max_output_tokens\": 120, "
                            "\"seed\": %d, \"text\": {\"format\": {\"type\": \"json_schema\", "
                            "\"name\": \"person\", \"strict\": true, \"schema\": {\"type\": "
                            "\"object\", \"properties\": {\"name\": {\"type\": \"string\", "
                            "\"maxLength\": 16}, \"age\": {\"type\": \"integer\", \"minimum\": "
                            "0, \"maximum\": 99}}, \"required\": [\"name\", \"age\"], "
                            "\"additionalProperties\": false}}}}",
                            seed));
        cr_assert_str_eq(jstr(r.json, "status"), "completed", "%s", r.http.body);
        cr_assert_str_eq(jstr(r.json, "text.format.type"), "json_schema");
        json_t *v = json_loads(output_text(r.json), 0, NULL);
        cr_assert(json_is_object(v), "%s", output_text(r.json));
        cr_assert_eq(json_object_size(v), 2);
        cr_assert(json_is_string(json_object_get(v, "name")));
        json_int_t age = json_integer_value(json_object_get(v, "age"));
        cr_assert(json_is_integer(json_object_get(v, "age")) && age >= 0 && age <= 99);
        json_decref(v);
        rk_test_resp_free(&r);
    }
    free(model);
}

/* ================================================================ the openai SDK */

static int run(const char *cmd) {
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* Run tests/SCRIPT with node from the folder above node_modules (the path
 * of a file npm installed, cut at "/node_modules/"), against the server. */
static void run_node(const char *installed, const char *script) {
    char dir[2048], src[1024], cmd[8192];
    snprintf(dir, sizeof dir, "%s", installed);
    *strstr(dir, "/node_modules/") = '\0';
    snprintf(src, sizeof src, "%s", RK_TEST_DATA);
    *strstr(src, "/tests/data") = '\0';
    snprintf(cmd, sizeof cmd,
             "cp '%s/tests/%s' '%s/' && cd '%s' && RAGKV_URL='http://127.0.0.1:%d/v1' timeout 300 "
             "node %s </dev/null 2>&1",
             src, script, dir, dir, S.port, script);
    FILE *f = popen(cmd, "r");
    cr_assert(f);
    static char out[65536];
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    int st = pclose(f);
    int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
    cr_log_info("%s:\n%s", script, out);
    cr_assert_eq(code, 0, "%s failed (%d):\n%s", script, code, out);
    cr_assert(strstr(out, "ok: all checks passed"), "%s", out);
}

/* The Agents SDK for JavaScript runs an agent with one function tool
 * (returning documents) on /v1/responses to a final answer
 * (tests/openai_agents_responses.mjs); skipped where npm cannot install it. */
Test(responses, the_openai_agents_sdk_runs_an_agent_with_a_function_tool, .timeout = 900) {
    const char *why = NULL;
    char *pkg = rk_test_npm_file("@openai/agents@0.20", "@openai/agents", "package.json", &why);
    if (!pkg) cr_skip_test("%s: the Agents SDK test is skipped", why);
    char *model = qwen3_model();
    const char *args[] = {"--model", model, "--served-model-name", "ragkv-test", NULL};
    start_with(args);
    run_node(pkg, "openai_agents_responses.mjs");
    free(pkg);
    free(model);
}

/* responses.create, .stream, .parse (zod), function tools and
 * previous_response_id through the official SDK
 * (tests/openai_sdk_responses.mjs); skipped where npm cannot install it. */
Test(responses, the_official_openai_sdk_speaks_responses, .timeout = 900) {
    const char *why = NULL;
    char *sdk = rk_test_npm_file("openai@6", "openai", "package.json", &why);
    if (!sdk) cr_skip_test("%s: the openai SDK test is skipped", why);
    char *zod = rk_test_npm_file("zod@3", "zod", "package.json", &why);
    if (!zod) cr_skip_test("%s: the openai SDK test is skipped", why);
    /* An ES module resolves packages from its own folder: zod is linked
     * beside the SDK (each package has a folder of its own). */
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "ln -sfn '%.*s' '%.*szod'", (int)(strlen(zod) - 13), zod,
             (int)(strlen(sdk) - 19), sdk); /* - "/package.json", - "openai/package.json" */
    cr_assert_eq(run(cmd), 0, "%s", cmd);
    char *model = qwen3_model();
    const char *args[] = {"--model", model, "--served-model-name", "ragkv-test", NULL};
    start_with(args);
    run_node(sdk, "openai_sdk_responses.mjs");
    free(sdk);
    free(zod);
    free(model);
}
