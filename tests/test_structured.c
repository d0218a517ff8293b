/* tests/test_structured.c — structured output end to end: the real `ragkv
 * serve` binary on a loopback port, asked for response_format json_object and
 * json_schema and for a `grammar`, on stories260K and on a synthetic Qwen3
 * model (the real Qwen3 vocabulary), at temperature 1 over 20 seeds: every
 * answer must parse and satisfy its schema. Schemas that cannot be enforced
 * are refused with 400 naming their JSON path. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "bench/httpclient.h"
#include "engine/grammar.h"
#include "tests/testutil.h"

/* The server of the current test (tests/testutil.h starts and stops it). */
static rk_test_server S;

/* `ragkv serve --port 0 --threads 2 --model M` until /health answers 200. */
static void start(const char *model) {
    const char *args[] = {"--threads", "2", "--model", model, NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "structured", NULL, args), 0,
                 "the server did not start (log: %s)", S.log);
}

/* Stop the server; an unclean exit or a sanitizer report fails the test. */
static void stop(void) { rk_test_server_stop_checked(&S); }

/* POST a body; returns the parsed JSON answer (or NULL) and the status. */
static json_t *post(const char *path, const char *body, int *status, char **raw) {
    rk_http_response r;
    cr_assert_eq(rk_http_exchange(&S.t, "POST", path, NULL, body, strlen(body), &r), RK_OK,
                 "POST %s: no answer", path);
    *status = r.status;
    json_t *j = json_loadb(r.body, r.body_len, 0, NULL);
    if (raw) {
        *raw = malloc(r.body_len + 1);
        memcpy(*raw, r.body, r.body_len);
        (*raw)[r.body_len] = 0;
    }
    rk_http_response_free(&r);
    return j;
}

/* The answer text of a completion or chat response. */
static const char *answer(json_t *j, int chat) {
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *t = chat ? json_object_get(json_object_get(c, "message"), "content")
                     : json_object_get(c, "text");
    cr_assert(json_is_string(t), "no answer text");
    return json_string_value(t);
}

static const char *finish(json_t *j) {
    return json_string_value(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "finish_reason"));
}

/* The schema every json_schema test asks for, and a check of what it allows. */
#define PERSON_SCHEMA                                                                              \
    "{\"type\":\"object\",\"properties\":{"                                                        \
    "\"name\":{\"type\":\"string\",\"maxLength\":12},"                                             \
    "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":120},"                                \
    "\"mood\":{\"enum\":[\"happy\",\"sad\",\"calm\"]},"                                            \
    "\"pets\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"pattern\":\"^[a-z]{1,8}$\"},"   \
    "\"maxItems\":3},"                                                                             \
    "\"nick\":{\"anyOf\":[{\"type\":\"string\",\"maxLength\":5},{\"type\":\"null\"}]}},"           \
    "\"required\":[\"name\",\"age\",\"mood\",\"pets\",\"nick\"],\"additionalProperties\":false}"

static void check_person(const char *text) {
    json_error_t e;
    json_t *v = json_loads(text, 0, &e);
    cr_assert(json_is_object(v), "not a JSON object: %s (%s)", text, e.text);
    cr_expect_eq(json_object_size(v), 5, "%s", text);
    json_t *name = json_object_get(v, "name"), *age = json_object_get(v, "age");
    json_t *mood = json_object_get(v, "mood"), *pets = json_object_get(v, "pets");
    json_t *nick = json_object_get(v, "nick");
    cr_expect(json_is_string(name), "%s", text);
    cr_expect(json_is_integer(age) && json_integer_value(age) >= 0 &&
                  json_integer_value(age) <= 120,
              "%s", text);
    const char *m = json_string_value(mood);
    cr_expect(m && (!strcmp(m, "happy") || !strcmp(m, "sad") || !strcmp(m, "calm")), "%s", text);
    cr_expect(json_is_array(pets) && json_array_size(pets) <= 3, "%s", text);
    for (size_t i = 0; i < json_array_size(pets); i++) {
        const char *p = json_string_value(json_array_get(pets, i));
        cr_expect(p && strlen(p) >= 1 && strlen(p) <= 8 &&
                      strspn(p, "abcdefghijklmnopqrstuvwxyz") == strlen(p),
                  "%s", text);
    }
    cr_expect(json_is_null(nick) || json_is_string(nick), "%s", text);
    json_decref(v);
}

/* 20 seeded requests at temperature 1 with response_format rf, at most
 * max_tokens each (json_object closes its object within them). */
static void twenty(int chat, const char *rf, int is_schema, int max_tokens) {
    for (int seed = 1; seed <= 20; seed++) {
        char body[4096];
        if (chat)
            snprintf(body, sizeof body,
                     "{\"messages\":[{\"role\":\"user\",\"content\":\"Describe a person as "
                     "JSON.\"}],\"temperature\":1,\"seed\":%d,\"max_tokens\":%d,"
                     "\"response_format\":%s}",
                     seed, max_tokens, rf);
        else
            snprintf(body, sizeof body,
                     "{\"prompt\":\"Once upon a time\",\"temperature\":1,\"seed\":%d,"
                     "\"max_tokens\":%d,\"response_format\":%s}",
                     seed, max_tokens, rf);
        int status;
        char *raw;
        json_t *j = post(chat ? "/v1/chat/completions" : "/v1/completions", body, &status, &raw);
        cr_assert_eq(status, 200, "seed %d: %s", seed, raw);
        const char *text = answer(j, chat);
        cr_expect_str_eq(finish(j), "stop", "seed %d: %s", seed, text);
        if (is_schema) {
            check_person(text);
        } else {
            json_t *v = json_loads(text, 0, NULL);
            cr_expect(json_is_object(v), "seed %d: not a JSON object: %s", seed, text);
            json_decref(v);
        }
        json_decref(j);
        free(raw);
    }
}

#define SCHEMA_RF                                                                                  \
    "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"person\",\"strict\":true,"              \
    "\"schema\":" PERSON_SCHEMA "}}"

Test(structured, stories260k_gives_json_objects_and_schema_valid_json_in_20_of_20, .fini = stop) {
    const char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    start(model);
    twenty(0, "{\"type\":\"json_object\"}", 0, 300);
    twenty(0, SCHEMA_RF, 1, 300);
    free((char *)model);
}

Test(structured, a_synthetic_qwen3_gives_json_objects_and_schema_valid_json_in_20_of_20,
     .fini = stop) {
    char *model = rk_test_model("qwen3-tiny", "f32", 1);
    start(model);
    twenty(1, "{\"type\":\"json_object\"}", 0, 100);
    twenty(1, SCHEMA_RF, 1, 200);
    free(model);
}

Test(structured, schemas_that_cannot_be_enforced_are_refused_with_their_path, .fini = stop) {
    const char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    start(model);
    const char *cases[][2] = {
        {"{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p\",\"schema\":{\"type\":"
         "\"object\","
         "\"properties\":{\"age\":{\"type\":\"string\",\"format\":\"date\"}}}}}",
         "$.properties.age.format"},
        {"{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p\",\"schema\":{\"type\":\"strng\"}"
         "}}",
         "$.type"},
        {"{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p\"}}", "'schema'"},
        {"{\"type\":\"yaml\"}", "response_format.type"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char body[2048];
        snprintf(body, sizeof body, "{\"prompt\":\"x\",\"response_format\":%s}", cases[i][0]);
        int status;
        char *raw;
        json_t *j = post("/v1/completions", body, &status, &raw);
        cr_expect_eq(status, 400, "%s: %s", cases[i][0], raw);
        const char *msg =
            json_string_value(json_object_get(json_object_get(j, "error"), "message"));
        cr_expect(msg && strstr(msg, cases[i][1]), "want \"%s\" in %s", cases[i][1], raw);
        json_decref(j);
        free(raw);
    }
    int status;
    char *raw;
    json_t *j = post("/v1/completions",
                     "{\"prompt\":\"x\",\"grammar\":\"root ::= root \\\"a\\\"\"}", &status, &raw);
    cr_expect_eq(status, 400, "%s", raw);
    cr_expect(strstr(raw, "left-recursive"), "%s", raw);
    json_decref(j);
    free(raw);
    free((char *)model);
}

Test(structured, a_grammar_constrains_and_max_tokens_still_ends_with_length, .fini = stop) {
    const char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    start(model);
    for (int seed = 1; seed <= 5; seed++) {
        char body[512];
        snprintf(body, sizeof body,
                 "{\"prompt\":\"Once\",\"temperature\":1,\"seed\":%d,\"max_tokens\":20,"
                 "\"grammar\":\"root ::= (\\\"yes\\\" | \\\"no\\\") \\\", \\\" [0-9]{2}\"}",
                 seed);
        int status;
        char *raw;
        json_t *j = post("/v1/completions", body, &status, &raw);
        cr_assert_eq(status, 200, "%s", raw);
        const char *t = answer(j, 0);
        cr_expect((!strncmp(t, "yes, ", 5) && strlen(t) == 7) ||
                      (!strncmp(t, "no, ", 4) && strlen(t) == 6),
                  "seed %d: %s", seed, t);
        cr_expect_str_eq(finish(j), "stop");
        json_decref(j);
        free(raw);
    }
    /* Two tokens cannot hold the person: the answer is cut, and says so. */
    int status;
    char *raw;
    json_t *j = post("/v1/completions",
                     "{\"prompt\":\"Once\",\"max_tokens\":2,\"response_format\":" SCHEMA_RF "}",
                     &status, &raw);
    cr_assert_eq(status, 200, "%s", raw);
    cr_expect_str_eq(finish(j), "length", "%s", raw);
    cr_expect_eq(answer(j, 0)[0], '{', "%s", raw);
    json_decref(j);
    free(raw);
    free((char *)model);
}

Test(structured, a_streamed_answer_is_schema_valid_json_too, .fini = stop) {
    const char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    start(model);
    int status;
    char *raw;
    json_t *j =
        post("/v1/completions",
             "{\"prompt\":\"Once upon a time\",\"temperature\":1,\"seed\":7,\"stream\":true,"
             "\"max_tokens\":300,\"response_format\":" SCHEMA_RF "}",
             &status, &raw);
    json_decref(j);
    cr_assert_eq(status, 200, "%s", raw);
    /* Join the text of every data: event. */
    char *text = calloc(1, strlen(raw) + 1);
    for (char *p = strstr(raw, "data: "); p; p = strstr(p + 6, "data: ")) {
        if (!strncmp(p + 6, "[DONE]", 6)) break;
        char *end = strstr(p, "\n\n");
        json_t *ev = json_loadb(p + 6, end ? (size_t)(end - p - 6) : strlen(p + 6), 0, NULL);
        const char *piece = json_string_value(
            json_object_get(json_array_get(json_object_get(ev, "choices"), 0), "text"));
        if (piece) strcat(text, piece);
        json_decref(ev);
    }
    check_person(text);
    free(text);
    free(raw);
    free((char *)model);
}

/* ---------------------------------------------------------------- tools */

#define WEATHER_TOOLS                                                                              \
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Weather in " \
    "a city\",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\","  \
    "\"maxLength\":10},\"unit\":{\"enum\":[\"c\",\"f\"]}},\"required\":[\"city\",\"unit\"],"       \
    "\"additionalProperties\":false}}},"                                                           \
    "{\"type\":\"function\",\"function\":{\"name\":\"add\",\"parameters\":{\"type\":\"object\","   \
    "\"properties\":{\"a\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":99},\"b\":{\"type\":"   \
    "\"integer\",\"minimum\":0,\"maximum\":99}},\"required\":[\"a\",\"b\"],"                       \
    "\"additionalProperties\":false}}}]"

/* A call in the response shape: its id and type, a known name, arguments
 * that parse and satisfy that tool's parameters. */
static void check_call(json_t *call, const char *want_name) {
    cr_assert(json_is_object(call));
    cr_expect(json_is_string(json_object_get(call, "id")));
    cr_expect_str_eq(json_string_value(json_object_get(call, "type")), "function");
    json_t *f = json_object_get(call, "function");
    const char *name = json_string_value(json_object_get(f, "name"));
    const char *args = json_string_value(json_object_get(f, "arguments"));
    cr_assert(name && args, "a call without name or arguments");
    if (want_name) cr_expect_str_eq(name, want_name);
    json_t *a = json_loads(args, 0, NULL);
    cr_assert(json_is_object(a), "arguments are not a JSON object: %s", args);
    if (!strcmp(name, "get_weather")) {
        const char *u = json_string_value(json_object_get(a, "unit"));
        cr_expect(json_is_string(json_object_get(a, "city")) && u &&
                      (!strcmp(u, "c") || !strcmp(u, "f")) && json_object_size(a) == 2,
                  "%s", args);
    } else {
        cr_expect_str_eq(name, "add");
        json_t *x = json_object_get(a, "a"), *y = json_object_get(a, "b");
        cr_expect(json_is_integer(x) && json_is_integer(y) && json_integer_value(x) <= 99 &&
                      json_integer_value(y) <= 99 && json_object_size(a) == 2,
                  "%s", args);
    }
    json_decref(a);
}

static json_t *tool_request(const char *extra, int seed, int *status, char **raw) {
    char body[8192];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"What is the weather in Paris?\"}],"
             "\"temperature\":1,\"seed\":%d,\"max_tokens\":200,\"tools\":" WEATHER_TOOLS "%s}",
             seed, extra);
    return post("/v1/chat/completions", body, status, raw);
}

Test(structured, required_and_named_tool_choices_give_valid_calls_on_qwen3, .fini = stop) {
    char *model = rk_test_model("qwen3-tiny", "f32", 1);
    start(model);
    for (int seed = 1; seed <= 10; seed++) {
        const char *extra = seed <= 4 ? ",\"tool_choice\":\"required\""
                            : seed <= 7
                                ? ",\"tool_choice\":{\"type\":\"function\",\"function\":"
                                  "{\"name\":\"add\"}}"
                                : ",\"tool_choice\":\"required\",\"parallel_tool_calls\":false";
        int status;
        char *raw;
        json_t *j = tool_request(extra, seed, &status, &raw);
        cr_assert_eq(status, 200, "%s", raw);
        cr_expect_str_eq(finish(j), "tool_calls", "%s", raw);
        json_t *msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
        json_t *calls = json_object_get(msg, "tool_calls");
        cr_assert(json_is_array(calls) && json_array_size(calls) >= 1, "%s", raw);
        if (seed > 7) cr_expect_eq(json_array_size(calls), 1, "%s", raw);
        for (size_t k = 0; k < json_array_size(calls); k++)
            check_call(json_array_get(calls, k), seed > 4 && seed <= 7 ? "add" : NULL);
        json_decref(j);
        free(raw);
    }
    /* Streamed: the calls arrive as delta.tool_calls. */
    int status;
    char *raw;
    json_t *j = tool_request(",\"tool_choice\":\"required\",\"stream\":true", 3, &status, &raw);
    json_decref(j);
    cr_assert_eq(status, 200, "%s", raw);
    char *p = strstr(raw, "\"tool_calls\":[");
    cr_assert(p, "no delta.tool_calls: %s", raw);
    cr_expect(strstr(raw, "\"finish_reason\":\"tool_calls\""), "%s", raw);
    for (char *e = strstr(raw, "data: "); e; e = strstr(e + 6, "data: ")) {
        if (!strncmp(e + 6, "[DONE]", 6)) break;
        char *end = strstr(e, "\n\n");
        json_t *ev = json_loadb(e + 6, end ? (size_t)(end - e - 6) : strlen(e + 6), 0, NULL);
        json_t *tc = json_object_get(
            json_object_get(json_array_get(json_object_get(ev, "choices"), 0), "delta"),
            "tool_calls");
        for (size_t k = 0; k < json_array_size(tc); k++) {
            cr_expect(json_is_integer(json_object_get(json_array_get(tc, k), "index")));
            check_call(json_array_get(tc, k), NULL);
        }
        json_decref(ev);
    }
    free(raw);
    /* A history with a call and its result renders and answers. */
    j = post("/v1/chat/completions",
             "{\"messages\":[{\"role\":\"user\",\"content\":\"Add 2 and 3\"},"
             "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":"
             "\"function\",\"function\":{\"name\":\"add\",\"arguments\":\"{\\\"a\\\":2,\\\"b\\\":3}"
             "\"}}]},"
             "{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"5\"}],"
             "\"max_tokens\":8,\"tools\":" WEATHER_TOOLS "}",
             &status, &raw);
    cr_expect_eq(status, 200, "%s", raw);
    json_decref(j);
    free(raw);
    free(model);
}

Test(structured, tool_requests_that_cannot_be_served_are_refused, .fini = stop) {
    const char *stories;
    RK_REQUIRE_SHARED(stories, "models/stories260K.gguf");
    start(stories); /* a Llama-2 chat template: no tool-call format */
    int status;
    char *raw;
    json_t *j = tool_request("", 1, &status, &raw);
    cr_expect_eq(status, 400, "%s", raw);
    cr_expect(strstr(raw, "llama2"), "%s", raw);
    json_decref(j);
    free(raw);
    const char *bad[][2] = {
        {",\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"nope\"}}", "nope"},
        {",\"tool_choice\":\"sometimes\"", "tool_choice"},
        {",\"tool_choice\":\"required\",\"response_format\":{\"type\":\"json_object\"}",
         "combined"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        j = tool_request(bad[i][0], 1, &status, &raw);
        cr_expect_eq(status, 400, "%s: %s", bad[i][0], raw);
        cr_expect(strstr(raw, bad[i][1]), "want \"%s\" in %s", bad[i][1], raw);
        json_decref(j);
        free(raw);
    }
    j = post("/v1/completions", "{\"prompt\":\"x\",\"tools\":[]}", &status, &raw);
    cr_expect_eq(status, 400, "%s", raw);
    json_decref(j);
    free(raw);
    free((char *)stories);
}

/* A string schema with pattern p (JSON-escaped in the body), 10 seeds on a
 * synthetic Qwen3 (random weights: every allowed token is likely, the
 * multi-byte ones included); each answer must be a JSON string whose every
 * character passes ok, of n characters. */
static void pattern_answers(const char *p, int n, int (*ok)(unsigned char)) {
    for (int seed = 1; seed <= 10; seed++) {
        char body[1024];
        snprintf(body, sizeof body,
                 "{\"prompt\":\"x\",\"temperature\":1,\"seed\":%d,\"max_tokens\":40,"
                 "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p\","
                 "\"schema\":{\"type\":\"string\",\"pattern\":\"%s\"}}}}",
                 seed, p);
        int status;
        char *raw;
        json_t *j = post("/v1/completions", body, &status, &raw);
        cr_assert_eq(status, 200, "%s: %s", p, raw);
        const char *text = answer(j, 0);
        json_t *v = json_loads(text, JSON_DECODE_ANY, NULL);
        cr_assert(json_is_string(v), "%s, seed %d: not a JSON string: %s", p, seed, text);
        const char *s = json_string_value(v);
        cr_expect_eq(json_string_length(v), (size_t)n, "%s, seed %d: %s", p, seed, text);
        for (size_t i = 0; i < json_string_length(v); i++)
            cr_expect(ok((unsigned char)s[i]), "%s, seed %d: byte 0x%02x in %s", p, seed,
                      (unsigned char)s[i], text);
        json_decref(v);
        json_decref(j);
        free(raw);
    }
}

static int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static int is_ascii_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
static int is_upper(unsigned char c) { return c >= 'A' && c <= 'Z'; }

Test(structured, negated_class_escapes_in_a_pattern_exclude_multibyte_characters, .fini = stop) {
    char *model = rk_test_model("qwen3-tiny", "f32", 1);
    start(model);
    pattern_answers("^[^\\\\D]{3}$", 3, is_digit);
    pattern_answers("^[^\\\\S]{3}$", 3, is_ascii_space);
    pattern_answers("^[^\\\\W\\\\d_a-z]{2}$", 2, is_upper);
    free(model);
}

Test(structured, a_pattern_that_matches_no_output_string_is_refused, .fini = stop) {
    const char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    start(model);
    const char *pats[] = {"^[^\\\\s\\\\S]$", "^\\\\u0000+$", "^a[^\\\\d\\\\D]$"};
    for (size_t i = 0; i < sizeof pats / sizeof *pats; i++) {
        char body[1024];
        snprintf(body, sizeof body,
                 "{\"prompt\":\"x\",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":"
                 "{\"name\":\"p\",\"schema\":{\"type\":\"object\",\"properties\":{\"code\":"
                 "{\"type\":\"string\",\"pattern\":\"%s\"}}}}}}",
                 pats[i]);
        int status;
        char *raw;
        json_t *j = post("/v1/completions", body, &status, &raw);
        cr_expect_eq(status, 400, "%s: %s", pats[i], raw);
        cr_expect(strstr(raw, "$.properties.code.pattern: no string"), "%s: %s", pats[i], raw);
        json_decref(j);
        free(raw);
    }
    free((char *)model);
}

/* A grammar of 79,000 alternatives alive at once (a body just under the
 * 1 MiB limit) is refused on the HTTP worker with the bound it is over,
 * instead of holding the engine thread; the same request again costs no
 * second compile (the cache), and a stream started meanwhile is served. */
Test(structured, a_grammar_over_the_width_bound_is_refused_naming_it, .fini = stop) {
    /* The sanitizer build parses the 1 MB text slower than the server's one
     * second, so there the time bound would be the one named. */
    if (rk_test_light()) cr_skip_test("skipped in the light (sanitizer) pass: 1 MB grammar");
    const char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    start(model);
    size_t cap = 79000 * 12 + 256, o = 0;
    char *body = malloc(cap);
    o += (size_t)snprintf(body, cap, "{\"prompt\":\"x\",\"max_tokens\":4,\"grammar\":\"root ::= ");
    for (int i = 0; i < 79000; i++)
        o += (size_t)snprintf(body + o, cap - o, "%s\\\"%05d\\\"", i ? " | " : "", i);
    snprintf(body + o, cap - o, "\"}");
    cr_assert_lt(strlen(body), (size_t)1048576);
    for (int k = 0; k < 2; k++) {
        int status;
        char *raw;
        json_t *j = post("/v1/completions", body, &status, &raw);
        cr_expect_eq(status, 400, "%.300s", raw);
        cr_expect(strstr(raw, "more than 4096 alternatives at once"), "%.300s", raw);
        json_decref(j);
        free(raw);
    }
    free(body);
    int status;
    char *raw;
    json_t *j = post("/v1/completions",
                     "{\"prompt\":\"Once\",\"max_tokens\":8,\"grammar\":\"root ::= [a-z]+\"}",
                     &status, &raw);
    cr_expect_eq(status, 200, "%s", raw);
    json_decref(j);
    free(raw);
    free((char *)model);
}

/* The largest grammar the bounds accept, as a JSON string's contents: 4,096
 * alternatives alive at once (the width bound), each [a-z]{250} and a word of
 * its own, 1,044,480 elements of the 1,048,576 allowed. An output takes at
 * least 254 bytes. */
static char *largest_grammar_json(void) {
    size_t cap = (size_t)RK_GRAMMAR_MAX_WIDTH * 24 + 256, o = 0;
    char *t = malloc(cap);
    cr_assert_not_null(t);
    o += (size_t)snprintf(t, cap, "root ::= ");
    for (int i = 0; i < RK_GRAMMAR_MAX_WIDTH; i++)
        o += (size_t)snprintf(t + o, cap - o, "%s[a-z]{250} \\\"%c%c%c\\\"", i ? " | " : "",
                              'a' + i % 26, 'a' + i / 26 % 26, 'a' + i / 676);
    return t;
}

/* SIGTERM while a request with the largest accepted grammar streams (its
 * first token out, its output not yet complete): the server ends the stream
 * and exits with status 0, within its grace time and the wait after it
 * (rk_test_server_stop kills it after 60 s, which fails the test). */
Test(structured, sigterm_with_the_largest_grammar_in_flight_exits_cleanly, .timeout = 180) {
    const char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    const char *args[] = {"--threads", "2", "--model", model, "--grace-s", "1", NULL};
    cr_assert_eq(rk_test_server_start_ready(&S, "structured", NULL, args), 0,
                 "the server did not start (log: %s)", S.log);
    char *grammar = largest_grammar_json();
    size_t cap = strlen(grammar) + 512;
    char *body = malloc(cap);
    int blen = snprintf(body, cap,
                        "{\"prompt\":\"Once\",\"max_tokens\":2000,\"stream\":true,"
                        "\"ignore_eos\":true,\"grammar\":\"%s\"}",
                        grammar);
    free(grammar);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)S.port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {120, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    char head[256];
    int hlen = snprintf(head, sizeof head,
                        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                        "application/json\r\nContent-Length: %d\r\n\r\n",
                        blen);
    cr_assert_eq(send(fd, head, (size_t)hlen, MSG_NOSIGNAL), hlen);
    for (int off = 0; off < blen;) {
        ssize_t k = send(fd, body + off, (size_t)(blen - off), MSG_NOSIGNAL);
        cr_assert_gt(k, 0, "the body could not be sent");
        off += (int)k;
    }
    free(body);
    /* In flight: its first token has streamed. */
    size_t got = 0, rcap = 1 << 16;
    char *resp = malloc(rcap);
    while (!memmem(resp, got, "\"text\"", 6)) {
        if (got + 4096 > rcap) resp = realloc(resp, rcap *= 2);
        ssize_t k = recv(fd, resp + got, rcap - got, 0);
        cr_assert_gt(k, 0, "the stream ended before its first token: %.*s", (int)got, resp);
        got += (size_t)k;
    }
    cr_assert(!strncmp(resp, "HTTP/1.1 200", 12), "%.300s", resp);
    cr_assert_eq(kill(S.pid, SIGTERM), 0);
    /* The stream ends (finished within the grace time, or cancelled). */
    for (;;) {
        if (got + 4096 > rcap) resp = realloc(resp, rcap *= 2);
        ssize_t k = recv(fd, resp + got, rcap - got, 0);
        if (k <= 0) break;
        got += (size_t)k;
    }
    cr_expect(memmem(resp, got, "data: [DONE]", 12), "the stream did not end: %.300s",
              got > 300 ? resp + got - 300 : resp);
    free(resp);
    close(fd);
    int status = rk_test_server_stop(&S); /* waits for the exit, SIGKILL after 60 s */
    cr_expect_eq(status, 0, "ragkv serve exited with status %d after SIGTERM (log: %s)", status,
                 S.log);
    free((char *)model);
}
