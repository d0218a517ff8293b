/* tests/test_openai.c — the HTTP service as OpenAI clients and hostile
 * HTTP clients see it: the real `ragkv serve` binary on a free loopback
 * port, spoken to with the loopback client of bench/httpclient.h, raw
 * sockets for what no client sends on purpose, and the official `openai`
 * npm SDK (tests/openai_sdk.mjs) where npm and its registry are reachable. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench/httpclient.h"
#include "tests/testutil.h"

/* ================================================================ the server */

/* The server of the current test (tests/testutil.h starts and stops it). */
static rk_test_server S;

typedef rk_test_resp resp;

/* A whole exchange with the test's server (asserts that an answer came). */
static resp request(const char *method, const char *path, const char *headers, const char *body) {
    resp r;
    cr_assert_eq(rk_test_exchange(&S.t, method, path, headers, body, &r), 0, "%s %s: no answer: %s",
                 method, path, rk_error_message());
    return r;
}

/* SIGTERM the test's server; an unclean exit or a sanitizer report fails. */
static void stop_server(void) { rk_test_server_stop_checked(&S); }

static void start_with(const char *const *args) {
    cr_assert_eq(rk_test_server_start_ready(&S, "openai", NULL, args), 0,
                 "the server did not start");
}

static void start_default(void) { start_with(NULL); }

/* ================================================================ raw sockets */

/* A connection to the server from a loopback address of our choosing. */
static int connect_from(const char *from) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fd >= 0);
    if (from) {
        struct sockaddr_in b = {.sin_family = AF_INET};
        inet_pton(AF_INET, from, &b.sin_addr);
        cr_assert_eq(bind(fd, (struct sockaddr *)&b, sizeof b), 0, "cannot bind %s", from);
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)S.port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0, "cannot connect");
    struct timeval tv = {20, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

static void send_str(int fd, const char *s) {
    size_t n = strlen(s);
    while (n) {
        ssize_t k = send(fd, s, n, MSG_NOSIGNAL);
        cr_assert(k > 0, "send failed");
        s += k;
        n -= (size_t)k;
    }
}

/* Everything the server sends until it closes (or 20 s pass); malloc'ed. */
static char *recv_all(int fd) {
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap);
    cr_assert(buf);
    for (ssize_t k; (k = recv(fd, buf + len, cap - len - 1, 0)) > 0;) {
        len += (size_t)k;
        if (len + 1 >= cap) cr_assert((buf = realloc(buf, cap *= 2)));
    }
    buf[len] = '\0';
    return buf;
}

/* One whole response on a connection kept open (framed by its
 * Content-Length); malloc'ed. */
static char *recv_one(int fd) {
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap);
    cr_assert(buf);
    buf[0] = '\0';
    for (;;) {
        const char *end = strstr(buf, "\r\n\r\n"), *cl = strstr(buf, "\r\nContent-Length: ");
        if (end && cl && cl < end && (size_t)(end + 4 - buf) + (size_t)atol(cl + 18) <= len) break;
        ssize_t k = recv(fd, buf + len, cap - len - 1, 0);
        if (k <= 0) break;
        len += (size_t)k;
        buf[len] = '\0';
        cr_assert(len + 1 < cap, "a response over 64 KiB");
    }
    return buf;
}

/* How many times needle occurs in hay. */
static int count(const char *hay, const char *needle) {
    int n = 0;
    for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle)) n++;
    return n;
}

/* ================================================================ framing */

TestSuite(openai, .init = start_default, .fini = stop_server, .timeout = 300);
TestSuite(openai_opts, .fini = stop_server, .timeout = 300);

/* A request with two Content-Length headers is refused and its connection
 * closed: the GET hidden in its body (as the second length would have it)
 * never runs. */
Test(openai, a_second_content_length_is_400_and_nothing_smuggled_runs) {
    const char *hidden = "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n";
    char req[512];
    snprintf(req, sizeof req,
             "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             "Content-Length: 2\r\nContent-Length: %zu\r\n\r\n{}%s",
             2 + strlen(hidden), hidden);
    int fd = connect_from(NULL);
    send_str(fd, req);
    char *a = recv_all(fd);
    close(fd);
    cr_assert(!strncmp(a, "HTTP/1.1 400", 12), "%s", a);
    cr_assert_eq(count(a, "HTTP/1.1 "), 1, "more than one answer came: %s", a);
    cr_assert(strstr(a, "Content-Length header"), "%s", a);
    cr_assert_null(strstr(a, "\"object\":\"list\""), "the hidden request ran: %s", a);
    free(a);
    /* Content-Length with Transfer-Encoding: the same. */
    fd = connect_from(NULL);
    send_str(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n");
    a = recv_all(fd);
    close(fd);
    cr_assert(!strncmp(a, "HTTP/1.1 400", 12), "%s", a);
    cr_assert_eq(count(a, "HTTP/1.1 "), 1, "%s", a);
    free(a);
}

Test(openai, http_1_1_without_host_is_400_and_an_unknown_expectation_417) {
    int fd = connect_from(NULL);
    send_str(fd, "GET /health HTTP/1.1\r\n\r\n");
    char *a = recv_all(fd);
    close(fd);
    cr_assert(!strncmp(a, "HTTP/1.1 400", 12), "%s", a);
    cr_assert(strstr(a, "Host"), "%s", a);
    free(a);
    fd = connect_from(NULL);
    send_str(fd, "GET /health HTTP/1.1\r\nHost: x\r\nExpect: something-else\r\n\r\n");
    a = recv_all(fd);
    close(fd);
    cr_assert(!strncmp(a, "HTTP/1.1 417", 12), "%s", a);
    free(a);
}

/* Expect: 100-continue is answered at once (curl waits a second otherwise),
 * then the request is served as usual, and the connection kept. */
Test(openai, expect_100_continue_is_answered_before_the_body) {
    const char *body = "{\"prompt\": \"Once\", \"max_tokens\": 2}";
    char head[256];
    snprintf(head, sizeof head,
             "POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
             "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
             strlen(body));
    int fd = connect_from(NULL);
    send_str(fd, head);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    cr_assert_eq(poll(&p, 1, 900), 1, "no 100 Continue within 0.9 s");
    char buf[64] = "";
    ssize_t k = recv(fd, buf, 25, 0);
    cr_assert_eq(k, 25);
    cr_assert_str_eq(buf, "HTTP/1.1 100 Continue\r\n\r\n");
    send_str(fd, body);
    send_str(fd, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    char *a = recv_all(fd);
    close(fd);
    cr_assert(!strncmp(a, "HTTP/1.1 200", 12), "%s", a);
    cr_assert(strstr(a, "\"text_completion\""), "%s", a);
    cr_assert_eq(count(a, "HTTP/1.1 200"), 2, "the next request was not served: %s", a);
    free(a);
}

/* ================================================================ a client gone */

static long long running_now(void) {
    resp r = request("GET", "/v1/stats", NULL, NULL);
    long long n = rk_test_jint(r.json, "requests.running");
    rk_test_resp_free(&r);
    return n;
}

Test(openai_opts, a_client_that_leaves_a_request_not_streamed_stops_it) {
    const char *args[] = {"--token-delay-s", "0.01", NULL};
    start_with(args);
    const char *body = "{\"prompt\": \"Once\", \"max_tokens\": 1000, \"ignore_eos\": true}";
    rk_http_conn c;
    cr_assert_eq(rk_http_open(&S.t, "POST", "/v1/completions", NULL, body, strlen(body), &c),
                 RK_OK);
    double until = rk_test_now() + 20;
    while (running_now() != 1 && rk_test_now() < until) rk_test_sleep(0.02);
    cr_assert_eq(running_now(), 1, "the request never ran");
    rk_test_sleep(0.2);
    rk_http_close(&c);
    double t0 = rk_test_now();
    while (running_now() != 0 && rk_test_now() < t0 + 10) rk_test_sleep(0.02);
    double took = rk_test_now() - t0;
    cr_assert_eq(running_now(), 0, "still running 10 s after its client left");
    cr_assert(took < 1.5, "it ran on %.2f s after its client left", took);
    resp r = request("GET", "/v1/stats", NULL, NULL);
    cr_assert(rk_test_jint(r.json, "tokens.generated") < 900, "generated %lld",
              rk_test_jint(r.json, "tokens.generated"));
    cr_assert_eq(rk_test_jint(r.json, "requests.by_status.499"), 1, "%s", r.http.body);
    rk_test_resp_free(&r);
}

/* requests.in_flight of /v1/stats once it is want (a request answered just
 * before may still be finishing when the next one reads it), or its value
 * after 20 s. */
static long long in_flight_becomes(long long want) {
    long long n = -1;
    for (double until = rk_test_now() + 20; n != want && rk_test_now() < until;) {
        resp r = request("GET", "/v1/stats", NULL, NULL);
        n = rk_test_jint(r.json, "requests.in_flight");
        rk_test_resp_free(&r);
        if (n != want) rk_test_sleep(0.02);
    }
    return n;
}

/* requests.in_flight counts the requests being handled, not the stats
 * request that reads it: 0 on an idle server, 1 beside one generation. */
Test(openai_opts, stats_in_flight_does_not_count_the_stats_request_itself) {
    const char *args[] = {"--token-delay-s", "0.01", NULL};
    start_with(args);
    cr_assert_eq(in_flight_becomes(0), 0, "an idle server");
    const char *body = "{\"prompt\": \"Once\", \"max_tokens\": 1000, \"ignore_eos\": true}";
    rk_http_conn c;
    cr_assert_eq(rk_http_open(&S.t, "POST", "/v1/completions", NULL, body, strlen(body), &c),
                 RK_OK);
    double until = rk_test_now() + 20;
    while (running_now() != 1 && rk_test_now() < until) rk_test_sleep(0.02);
    cr_assert_eq(running_now(), 1, "the request never ran");
    cr_assert_eq(in_flight_becomes(1), 1, "one generation running");
    cr_assert_eq(running_now(), 1, "the generation ended before its in_flight was read");
    rk_http_close(&c);
    cr_assert_eq(in_flight_becomes(0), 0, "the generation's client left 20 s ago");
}

/* ================================================================ context */

Test(openai_opts, an_omitted_max_tokens_fits_the_context_and_overflow_is_context_length_exceeded) {
    const char *args[] = {"--max-context", "64", NULL};
    start_with(args);
    const char *prompt = "Once upon a time there was a little girl named Lily. She liked to play "
                         "outside in the park with her friends and her dog. One day";
    resp r = rk_test_postf(&S.t, "/v1/completions", "{\"prompt\": \"%s\", \"ignore_eos\": true}",
                           prompt);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    long long pt = rk_test_jint(r.json, "usage.prompt_tokens");
    cr_assert(pt > 40 && pt < 64, "prompt_tokens %lld: the test wants 40..63", pt);
    cr_assert_eq(rk_test_jint(r.json, "usage.completion_tokens"), 64 - pt);
    cr_assert_str_eq(rk_test_jstr(r.json, "choices.0.finish_reason"), "length");
    rk_test_resp_free(&r);
    r = rk_test_postf(&S.t, "/v1/completions", "{\"prompt\": \"%s\", \"max_tokens\": 30}", prompt);
    cr_assert_eq(r.http.status, 400, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "error.code"), "context_length_exceeded");
    cr_assert_str_eq(rk_test_jstr(r.json, "error.param"), "prompt");
    cr_assert_eq(rk_test_jint(r.json, "error.status"), 400);
    cr_assert_str_eq(rk_test_jstr(r.json, "error.type"), "invalid_request_error");
    cr_assert(strstr(rk_test_jstr(r.json, "error.message"), "context"));
    rk_test_resp_free(&r);
    /* A prompt longer than the context, limit omitted: the same. */
    r = rk_test_postf(&S.t, "/v1/chat/completions",
                      "{\"messages\": [{\"role\": \"user\", \"content\": \"%s %s\"}]}", prompt,
                      prompt);
    cr_assert_eq(r.http.status, 400, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "error.code"), "context_length_exceeded");
    cr_assert_str_eq(rk_test_jstr(r.json, "error.param"), "messages");
    rk_test_resp_free(&r);
}

/* A prompt of token ids is the text prompt's ids: BOS goes in front only
 * where the model's text prompts get one (phi3-tiny's do not). */
Test(openai_opts, a_token_id_prompt_answers_as_its_text_does_with_bos_only_where_text_has_it) {
    char *model = rk_test_model("phi3-tiny", "f32", 7);
    const char *args[] = {"--model", model, NULL};
    start_with(args);
    const char *body = "{\"prompt\": %s, \"max_tokens\": 6, \"temperature\": 0}";
    resp t = rk_test_postf(&S.t, "/tokenize", "{\"content\": \"Once upon a time the cat\"}");
    cr_assert_eq(t.http.status, 200, "%s", t.http.body);
    char *ids = json_dumps(rk_test_jget(t.json, "tokens"), JSON_COMPACT);
    resp a = rk_test_postf(&S.t, "/v1/completions", body, "\"Once upon a time the cat\"");
    resp b = rk_test_postf(&S.t, "/v1/completions", body, ids);
    cr_assert_eq(a.http.status, 200, "%s", a.http.body);
    cr_assert_eq(b.http.status, 200, "%s", b.http.body);
    cr_assert_eq(rk_test_jint(a.json, "usage.prompt_tokens"),
                 (long long)json_array_size(rk_test_jget(t.json, "tokens")));
    cr_assert_eq(rk_test_jint(b.json, "usage.prompt_tokens"),
                 rk_test_jint(a.json, "usage.prompt_tokens"));
    cr_assert(json_equal(rk_test_jget(a.json, "ragkv.completion_ids"),
                         rk_test_jget(b.json, "ragkv.completion_ids")),
              "%s\n%s", a.http.body, b.http.body);
    free(ids);
    rk_test_resp_free(&t);
    rk_test_resp_free(&a);
    rk_test_resp_free(&b);
    free(model);
}

/* The delta field of every event of a chat stream, concatenated; each
 * event has a first choice. */
static void stream_field(const char *body, const char *field, char *out, size_t cap) {
    out[0] = '\0';
    for (const char *p = strstr(body, "data: {"); p; p = strstr(p + 1, "data: {")) {
        const char *end = strstr(p, "\n\n");
        char *ev = strndup(p + 6, end ? (size_t)(end - p - 6) : strlen(p + 6));
        json_t *j = json_loads(ev, 0, NULL);
        cr_assert_not_null(j, "%s", ev);
        cr_assert(json_is_object(json_array_get(json_object_get(j, "choices"), 0)), "%s", ev);
        const char *v = json_string_value(json_object_get(
            json_object_get(json_array_get(json_object_get(j, "choices"), 0), "delta"), field));
        if (v) strncat(out, v, cap - strlen(out) - 1);
        json_decref(j);
        free(ev);
    }
}

/* Qwen3 thinks in a <think> block: it goes to reasoning_content, whole and
 * streamed, never to content (the first tokens forced to <think> by
 * logit_bias); enable_thinking false renders an empty block instead, and
 * --reasoning off leaves the block in content. */
Test(openai_opts, a_thinking_models_think_block_is_reasoning_content_not_content) {
    char *model = rk_test_model("qwen3-tiny", "f32", 1);
    const char *args[] = {"--model", model, NULL};
    start_with(args);
    const char *body = "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], "
                       "\"max_tokens\": 3, \"temperature\": 0, \"ignore_eos\": true, "
                       "\"logit_bias\": {\"151667\": 100}%s}";
    resp r = rk_test_postf(&S.t, "/v1/chat/completions", body, "");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "choices.0.message.reasoning_content"), "<think><think>",
                     "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "choices.0.message.content"), "");
    resp st = rk_test_postf(&S.t, "/v1/chat/completions", body, ", \"stream\": true");
    char reasoning[256], content[256];
    stream_field(st.http.body, "reasoning_content", reasoning, sizeof reasoning);
    stream_field(st.http.body, "content", content, sizeof content);
    cr_assert_str_eq(reasoning, "<think><think>", "%s", st.http.body);
    cr_assert_str_eq(content, "", "%s", st.http.body);
    /* Thinking off: the prompt ends with an empty block, 4 tokens more. */
    resp off = rk_test_postf(&S.t, "/v1/chat/completions", body,
                             ", \"chat_template_kwargs\": {\"enable_thinking\": false}");
    cr_assert_eq(off.http.status, 200, "%s", off.http.body);
    cr_assert_eq(rk_test_jint(off.json, "usage.prompt_tokens"),
                 rk_test_jint(r.json, "usage.prompt_tokens") + 4, "%s", off.http.body);
    resp bad = rk_test_postf(&S.t, "/v1/chat/completions", body,
                             ", \"chat_template_kwargs\": {\"enable_thinking\": 1}");
    cr_assert_eq(bad.http.status, 400, "%s", bad.http.body);
    rk_test_resp_free(&r);
    rk_test_resp_free(&st);
    rk_test_resp_free(&off);
    rk_test_resp_free(&bad);
    stop_server();
    const char *args_off[] = {"--model", model, "--reasoning", "off", NULL};
    start_with(args_off);
    r = rk_test_postf(&S.t, "/v1/chat/completions", body, "");
    cr_assert_str_eq(rk_test_jstr(r.json, "choices.0.message.content"), "<think><think><think>",
                     "%s", r.http.body);
    cr_assert_null(rk_test_jget(r.json, "choices.0.message.reasoning_content"));
    rk_test_resp_free(&r);
    free(model);
}

/* Each family serves chat with documents over HTTP: its template renders
 * the turn, the documents are chunks, and a repeat finds them cached. */
Test(openai_opts, every_family_answers_chat_with_documents_and_hits_them_on_repeat,
     .timeout = 600) {
    /* gemma4-tiny last: it needs Gemma 3's tokenizer.json and skips without it */
    const char *presets[] = {"phi3-tiny", "gemma3-micro", "gemma2-tiny", "qwen3moe-tiny",
                             "gemma4-tiny"};
    const char *body =
        "{\"messages\": [{\"role\": \"system\", \"content\": \"Answer from the documents.\"}, "
        "{\"role\": \"user\", \"content\": \"Who had the red ball?\"}], "
        "\"documents\": [{\"text\": \"Lily had a red ball. She played with it in the garden.\"}, "
        "{\"text\": \"Tom had a big dog named Max who liked to run.\"}], \"max_tokens\": 4, "
        "\"temperature\": 0}";
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        char *model = rk_test_model(presets[i], "f32", 3);
        const char *args[] = {"--model", model, NULL};
        start_with(args);
        resp a = rk_test_postf(&S.t, "/v1/chat/completions", "%s", body);
        resp b = rk_test_postf(&S.t, "/v1/chat/completions", "%s", body);
        cr_assert_eq(a.http.status, 200, "%s: %s", presets[i], a.http.body);
        cr_assert_eq(b.http.status, 200, "%s: %s", presets[i], b.http.body);
        cr_assert_eq(json_array_size(rk_test_jget(a.json, "ragkv.chunks")), 2, "%s", presets[i]);
        cr_assert_str_eq(rk_test_jstr(a.json, "ragkv.chunks.0.status"), "miss", "%s", presets[i]);
        cr_assert_str_eq(rk_test_jstr(b.json, "ragkv.chunks.0.status"), "hit", "%s", presets[i]);
        cr_assert_str_eq(rk_test_jstr(b.json, "ragkv.chunks.1.status"), "hit", "%s", presets[i]);
        cr_assert(json_equal(rk_test_jget(a.json, "choices.0.message.content"),
                             rk_test_jget(b.json, "choices.0.message.content")),
                  "%s: %s\n%s", presets[i], a.http.body, b.http.body);
        rk_test_resp_free(&a);
        rk_test_resp_free(&b);
        stop_server();
        free(model);
    }
}

/* Gemma 4 over HTTP (gemma4-tiny, whose vocabulary has Gemma 4's chat
 * tokens): the server picks the gemma4 template, and an answer that opens
 * with the thought channel (constrained by a grammar to one, as a random
 * model writes none) gives the thought as reasoning_content and the rest as
 * content, whole and streamed. */
Test(openai_opts, gemma4_chat_takes_its_template_its_thought_and_its_tools, .timeout = 300) {
    char *model = rk_test_model("gemma4-tiny", "f32", 3);
    const char *args[] = {"--model", model, NULL};
    start_with(args);
    resp m = request("GET", "/v1/models", NULL, NULL);
    cr_assert_str_eq(rk_test_jstr(m.json, "data.0.ragkv.chat_template"), "gemma4", "%s",
                     m.http.body);
    const char *body =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Who had the red ball?\"}], "
        "\"documents\": [{\"text\": \"Lily had a red ball.\"}], \"max_tokens\": 40, "
        "\"temperature\": 0, \"grammar\": \"root ::= \\\"<|channel>thought\\\\nThe "
        "document says so.<channel|>Lily.\\\"\"%s}";
    resp a = rk_test_postf(&S.t, "/v1/chat/completions", body, "");
    cr_assert_eq(a.http.status, 200, "%s", a.http.body);
    cr_assert_str_eq(rk_test_jstr(a.json, "choices.0.message.reasoning_content"),
                     "The document says so.", "%s", a.http.body);
    cr_assert_str_eq(rk_test_jstr(a.json, "choices.0.message.content"), "Lily.", "%s", a.http.body);
    resp b = rk_test_postf(&S.t, "/v1/chat/completions", body, ", \"stream\": true");
    cr_assert_eq(b.http.status, 200);
    cr_assert_not_null(strstr(b.http.body, "\"reasoning_content\":\""), "%s", b.http.body);
    cr_assert_null(strstr(b.http.body, "<|channel>"), "%s", b.http.body);
    cr_assert_null(strstr(b.http.body, "<channel|>"), "%s", b.http.body);
    /* Tools: a call written in Gemma 4's syntax (forced here by a grammar,
     * after a thought and some text) is a tool call, whole and streamed. */
    const char *tools =
        "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
        "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": "
        "\"string\"}, \"unit\": {\"type\": \"string\", \"enum\": [\"c\", \"f\"]}}, "
        "\"required\": [\"unit\"]}}}]";
    const char *call_body =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather in Paris?\"}], "
        "\"max_tokens\": 120, \"temperature\": 0, %s, \"grammar\": \"root ::= "
        "\\\"<|channel>thought\\\\nAsk the tool.<channel|>Checking. "
        "<|tool_call>call:get_weather{city:<|\\\\\\\"|>Paris<|\\\\\\\"|>,unit:<|\\\\\\\"|>c<|"
        "\\\\\\\"|>}<tool_call|>\\\"\"%s}";
    resp c = rk_test_postf(&S.t, "/v1/chat/completions", call_body, tools, "");
    cr_assert_eq(c.http.status, 200, "%s", c.http.body);
    cr_assert_str_eq(rk_test_jstr(c.json, "choices.0.finish_reason"), "tool_calls", "%s",
                     c.http.body);
    cr_assert_str_eq(rk_test_jstr(c.json, "choices.0.message.tool_calls.0.function.name"),
                     "get_weather");
    cr_assert_str_eq(rk_test_jstr(c.json, "choices.0.message.tool_calls.0.function.arguments"),
                     "{\"city\":\"Paris\",\"unit\":\"c\"}");
    cr_assert_str_eq(rk_test_jstr(c.json, "choices.0.message.content"), "Checking.");
    cr_assert_str_eq(rk_test_jstr(c.json, "choices.0.message.reasoning_content"), "Ask the tool.");
    resp cs = rk_test_postf(&S.t, "/v1/chat/completions", call_body, tools, ", \"stream\": true");
    cr_assert_eq(cs.http.status, 200);
    cr_assert_not_null(strstr(cs.http.body, "\"tool_calls\":[{"), "%s", cs.http.body);
    cr_assert_not_null(strstr(cs.http.body, "\"finish_reason\":\"tool_calls\""), "%s",
                       cs.http.body);
    cr_assert_null(strstr(cs.http.body, "<|tool_call>"), "%s", cs.http.body);
    /* tool_choice required: the answer is constrained to a call of the tool,
     * its required enum filled (the only choices: c or f) */
    resp rq = rk_test_postf(&S.t, "/v1/chat/completions",
                            "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather?\"}], "
                            "\"max_tokens\": 200, \"temperature\": 0, \"tool_choice\": "
                            "\"required\", \"parallel_tool_calls\": false, %s}",
                            tools);
    cr_assert_eq(rq.http.status, 200, "%s", rq.http.body);
    cr_assert_str_eq(rk_test_jstr(rq.json, "choices.0.finish_reason"), "tool_calls", "%s",
                     rq.http.body);
    cr_assert_str_eq(rk_test_jstr(rq.json, "choices.0.message.tool_calls.0.function.name"),
                     "get_weather");
    json_t *cargs = json_loads(
        rk_test_jstr(rq.json, "choices.0.message.tool_calls.0.function.arguments"), 0, NULL);
    const char *unit = json_string_value(json_object_get(cargs, "unit"));
    cr_assert(unit && (!strcmp(unit, "c") || !strcmp(unit, "f")), "%s", rq.http.body);
    json_decref(cargs);
    /* the conversation goes on with the call and its result in the model's
     * turn (rendered as tests/test_gemma4.c checks) */
    resp h = rk_test_postf(
        &S.t, "/v1/chat/completions",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather in Paris?\"}, "
        "{\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"call_1\", "
        "\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": "
        "\"{\\\"unit\\\": \\\"c\\\"}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": \"call_1\", "
        "\"content\": \"{\\\"temp\\\": 18}\"}], \"max_tokens\": 4, \"temperature\": 0, %s}",
        tools);
    cr_assert_eq(h.http.status, 200, "%s", h.http.body);
    /* /apply-template: the prompt the chat route would run (thinking on by
     * default, the tools declared), with its pieces and tokens, BOS first */
    resp at = rk_test_postf(&S.t, "/apply-template",
                            "{\"messages\": [{\"role\": \"user\", \"content\": \" Hi \"}], "
                            "\"documents\": [{\"text\": \"Doc.\"}], \"tools\": [{\"type\": "
                            "\"function\", \"function\": {\"name\": \"ping\"}}]}");
    cr_assert_eq(at.http.status, 200, "%s", at.http.body);
    cr_assert_str_eq(rk_test_jstr(at.json, "prompt"),
                     "<|turn>system\n<|think|>\n<|tool>declaration:ping{description:<|\"|><|\"|>}"
                     "<tool|><turn|>\n<|turn>user\nDoc.Hi<turn|>\n<|turn>model\n");
    cr_assert_str_eq(rk_test_jstr(at.json, "ragkv.chunks.0"), "Doc.");
    cr_assert_str_eq(rk_test_jstr(at.json, "ragkv.question"), "Hi<turn|>\n<|turn>model\n");
    json_t *toks = rk_test_jget(at.json, "ragkv.tokens");
    cr_assert_eq(json_integer_value(json_array_get(toks, 0)),
                 json_integer_value(rk_test_jget(m.json, "data.0.ragkv.bos")));
    resp tk = rk_test_postf(&S.t, "/tokenize",
                            "{\"content\": \"<|turn>system\\n<|think|>\\n<|tool>declaration:ping{"
                            "description:<|\\\"|><|\\\"|>}<tool|><turn|>\\n<|turn>user\\n\"}");
    cr_assert_eq(tk.http.status, 200, "%s", tk.http.body);
    for (size_t i = 0; i < json_array_size(rk_test_jget(tk.json, "tokens")); i++)
        cr_assert(json_equal(json_array_get(toks, i + 1),
                             json_array_get(rk_test_jget(tk.json, "tokens"), i)),
                  "token %zu of the system piece", i);
    rk_test_resp_free(&at);
    rk_test_resp_free(&tk);
    rk_test_resp_free(&m);
    rk_test_resp_free(&a);
    rk_test_resp_free(&b);
    rk_test_resp_free(&c);
    rk_test_resp_free(&cs);
    rk_test_resp_free(&rq);
    rk_test_resp_free(&h);
    stop_server();
    free(model);
}

/* A max_tokens over the server's largest that no prompt fits beside is over
 * the context: 400 context_length_exceeded, as OpenAI answers, not the 422
 * of a server limit (OpenAI's SDKs raise BadRequestError for it). */
Test(openai_opts, max_tokens_beyond_the_context_is_context_length_exceeded_not_422) {
    const char *args[] = {"--max-context", "256", "--max-tokens", "200", NULL};
    start_with(args);
    static const char *const paths[] = {"/v1/completions", "/v1/chat/completions"};
    static const char *const params[] = {"prompt", "messages"};
    for (int chat = 0; chat < 2; chat++)
        for (int k = 0; k < 2; k++) {
            long long mt = k ? 100000 : 256; /* over the server's 200, and no room for a prompt */
            resp r = rk_test_postf(&S.t, paths[chat],
                                   chat ? "{\"messages\": [{\"role\": \"user\", \"content\": "
                                          "\"Hi\"}], \"max_tokens\": %lld}"
                                        : "{\"prompt\": \"Once\", \"max_tokens\": %lld}",
                                   mt);
            cr_assert_eq(r.http.status, 400, "max_tokens %lld: %s", mt, r.http.body);
            cr_assert_str_eq(rk_test_jstr(r.json, "error.code"), "context_length_exceeded");
            cr_assert_str_eq(rk_test_jstr(r.json, "error.type"), "invalid_request_error");
            cr_assert_str_eq(rk_test_jstr(r.json, "error.param"), params[chat]);
            cr_assert(strstr(rk_test_jstr(r.json, "error.message"), "context"), "%s", r.http.body);
            rk_test_resp_free(&r);
        }
    /* Over the server's limit with room in the context: the server's limit, 422. */
    resp r = rk_test_postf(&S.t, "/v1/completions", "{\"prompt\": \"Once\", \"max_tokens\": 201}");
    cr_assert_eq(r.http.status, 422, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "error.param"), "max_tokens");
    cr_assert(json_is_null(rk_test_jget(r.json, "error.code")), "%s", r.http.body);
    rk_test_resp_free(&r);
}

/* ================================================================ response shapes */

Test(openai, ids_and_system_fingerprint_follow_openai) {
    resp m = request("GET", "/v1/models", NULL, NULL);
    const char *fp = rk_test_jstr(m.json, "data.0.ragkv.fingerprint");
    resp r = rk_test_postf(&S.t, "/v1/completions", "{\"prompt\": \"Once\", \"max_tokens\": 2}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert(!strncmp(rk_test_jstr(r.json, "id"), "cmpl-", 5), "%s", rk_test_jstr(r.json, "id"));
    cr_assert_str_eq(rk_test_jstr(r.json, "system_fingerprint"), fp);
    cr_assert(rk_test_header(&r, "X-Request-Id"));
    rk_test_resp_free(&r);
    r = rk_test_postf(
        &S.t, "/v1/chat/completions",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"max_tokens\": 2}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert(!strncmp(rk_test_jstr(r.json, "id"), "chatcmpl-", 9), "%s",
              rk_test_jstr(r.json, "id"));
    cr_assert_str_eq(rk_test_jstr(r.json, "system_fingerprint"), fp);
    cr_assert_str_eq(rk_test_jstr(r.json, "object"), "chat.completion");
    rk_test_resp_free(&r);
    rk_test_resp_free(&m);
}

/* ================================================================ stream framing */

/* Read every event of one stream as a client that indexes choices[0] on each
 * would, and check OpenAI's framing: choices[0] exists on every event but
 * the usage event, which comes once, last, and only with include_usage;
 * every choice finishes once; ragkv's report comes once per choice (in the
 * usage event or on the finish event, top level, for one choice; inside
 * each choice's finish event for several). */
static void read_every_event(const char *path, const char *body, int include_usage, int n_choices) {
    char full[2048];
    snprintf(full, sizeof full, "{%s, \"stream\": true%s}", body,
             include_usage ? ", \"stream_options\": {\"include_usage\": true}" : "");
    resp st = request("POST", path, "Content-Type: application/json\r\n", full);
    cr_assert_eq(st.http.status, 200, "%s: %s", full, st.http.body);
    int events = 0, empty = 0, finishes = 0, reports = 0, done = 0, last_empty = 0;
    for (const char *p = st.http.body; *p;) {
        cr_assert(!strncmp(p, "data: ", 6), "%s: not an event: %.60s", full, p);
        const char *end = strstr(p, "\n\n");
        cr_assert(end, "%s: an event is not ended by a blank line", full);
        cr_assert(!done, "%s: an event after [DONE]", full);
        if (!strncmp(p + 6, "[DONE]", 6)) {
            done = 1;
            p = end + 2;
            continue;
        }
        json_t *ev = json_loadb(p + 6, (size_t)(end - p - 6), 0, NULL);
        cr_assert(ev, "%s: not JSON: %.200s", full, p);
        events++;
        json_t *choices = json_object_get(ev, "choices");
        cr_assert(json_is_array(choices), "%s: no choices: %.300s", full, p);
        json_t *c0 = json_array_get(choices, 0); /* what such a client reads */
        last_empty = c0 == NULL;
        if (!c0) {
            empty++;
            cr_assert(include_usage, "%s: an event with empty choices, usage not asked: %.300s",
                      full, p);
            cr_assert(json_is_object(json_object_get(ev, "usage")), "%.300s", p);
        } else {
            cr_assert(json_is_integer(json_object_get(c0, "index")), "%.300s", p);
            cr_assert(!json_is_object(json_object_get(ev, "usage")),
                      "%s: usage on a choice event: %.300s", full, p);
            finishes += json_is_string(json_object_get(c0, "finish_reason"));
            reports += json_is_object(json_object_get(c0, "ragkv"));
        }
        reports += json_is_object(json_object_get(ev, "ragkv"));
        json_decref(ev);
        p = end + 2;
    }
    cr_assert(done, "%s: no [DONE]", full);
    cr_assert(events >= n_choices, "%s: %d events", full, events);
    cr_assert_eq(empty, include_usage, "%s: %d events with empty choices", full, empty);
    if (include_usage) cr_assert(last_empty, "%s: the usage event is not the last", full);
    cr_assert_eq(finishes, n_choices, "%s: %d finish events for %d choices", full, finishes,
                 n_choices);
    cr_assert_eq(reports, n_choices, "%s: %d ragkv reports for %d choices", full, reports,
                 n_choices);
    rk_test_resp_free(&st);
}

Test(openai, every_stream_event_has_a_first_choice_unless_usage_was_asked) {
    static const struct {
        const char *path, *body;
        int n_choices;
    } kinds[] = {
        {"/v1/completions", "\"prompt\": \"Once\", \"max_tokens\": 6", 1},
        {"/v1/completions", "\"prompt\": \"Once\", \"max_tokens\": 6, \"logprobs\": 2", 1},
        {"/v1/completions", "\"prompt\": \"Once\", \"max_tokens\": 0", 1},
        {"/v1/completions", "\"prompt\": \"Once\", \"max_tokens\": 6, \"n\": 2", 2},
        {"/v1/completions", "\"prompt\": [\"Once\", \"Then\"], \"max_tokens\": 6", 2},
        {"/v1/chat/completions",
         "\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"max_tokens\": 6", 1},
        {"/v1/chat/completions",
         "\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"max_tokens\": 6, "
         "\"logprobs\": true, \"top_logprobs\": 1",
         1},
        {"/v1/chat/completions",
         "\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"max_tokens\": 6, \"n\": 3",
         3},
    };
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++)
        for (int usage = 0; usage <= 1; usage++)
            read_every_event(kinds[k].path, kinds[k].body, usage, kinds[k].n_choices);
}

/* Content parts are separate paragraphs: joined with "\n", not glued. */
Test(openai, chat_content_parts_are_joined_with_newlines) {
    const char *fmt = "{\"messages\": [{\"role\": \"user\", \"content\": %s}], \"max_tokens\": 4, "
                      "\"temperature\": 0}";
    resp parts = rk_test_postf(&S.t, "/v1/chat/completions", fmt,
                               "[{\"type\": \"text\", \"text\": \"What is\"}, {\"type\": \"text\", "
                               "\"text\": \"the best book\"}]");
    resp nl = rk_test_postf(&S.t, "/v1/chat/completions", fmt, "\"What is\\nthe best book\"");
    resp glued = rk_test_postf(&S.t, "/v1/chat/completions", fmt, "\"What isthe best book\"");
    cr_assert_eq(parts.http.status, 200, "%s", parts.http.body);
    cr_assert_eq(rk_test_jint(parts.json, "usage.prompt_tokens"),
                 rk_test_jint(nl.json, "usage.prompt_tokens"));
    cr_assert(json_equal(rk_test_jget(parts.json, "ragkv.completion_ids"),
                         rk_test_jget(nl.json, "ragkv.completion_ids")));
    cr_assert_neq(rk_test_jint(parts.json, "ragkv.question.tokens"),
                  rk_test_jint(glued.json, "ragkv.question.tokens"));
    rk_test_resp_free(&parts);
    rk_test_resp_free(&nl);
    rk_test_resp_free(&glued);
}

/* One chat logprobs entry: {token, logprob, bytes} (top_logprobs: k of them). */
static void check_chat_logprob(json_t *e, int k) {
    cr_assert(json_is_string(json_object_get(e, "token")));
    cr_assert(json_is_number(json_object_get(e, "logprob")));
    cr_assert(json_real_value(json_object_get(e, "logprob")) <= 0);
    json_t *bytes = json_object_get(e, "bytes");
    cr_assert(json_is_array(bytes));
    if (k >= 0) {
        json_t *tops = json_object_get(e, "top_logprobs");
        cr_assert_eq(json_array_size(tops), (size_t)k);
        for (int i = 0; i < k; i++) check_chat_logprob(json_array_get(tops, (size_t)i), -1);
    }
}

Test(openai, chat_logprobs_have_the_chat_shape_whole_and_streamed) {
    const char *body = "{\"messages\": [{\"role\": \"user\", \"content\": \"Tell a story\"}], "
                       "\"max_tokens\": 6, \"temperature\": 0, \"ignore_eos\": true, "
                       "\"logprobs\": true, \"top_logprobs\": 3%s}";
    resp r = rk_test_postf(&S.t, "/v1/chat/completions", body, "");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    json_t *content = rk_test_jget(r.json, "choices.0.logprobs.content");
    cr_assert_eq(json_array_size(content), 6, "%s", r.http.body);
    for (size_t i = 0; i < 6; i++) check_chat_logprob(json_array_get(content, i), 3);
    /* The tokens' bytes make the text. */
    char text[512] = "";
    for (size_t i = 0; i < 6; i++) {
        json_t *b = json_object_get(json_array_get(content, i), "bytes");
        for (size_t k = 0; k < json_array_size(b); k++) {
            size_t l = strlen(text);
            text[l] = (char)json_integer_value(json_array_get(b, k));
            text[l + 1] = '\0';
        }
    }
    cr_assert(strstr(text, rk_test_jstr(r.json, "choices.0.message.content")),
              "bytes \"%s\" vs text \"%s\"", text,
              rk_test_jstr(r.json, "choices.0.message.content"));
    /* Streamed: each content event carries its own tokens' log-probabilities. */
    resp st = rk_test_postf(&S.t, "/v1/chat/completions", body, ", \"stream\": true");
    cr_assert_eq(st.http.status, 200);
    size_t n_entries = 0, events = 0;
    for (const char *p = strstr(st.http.body, "data: {"); p; p = strstr(p + 1, "data: {")) {
        json_t *ev = json_loadb(p + 6, strcspn(p + 6, "\n"), 0, NULL);
        cr_assert(ev, "%s", p);
        json_t *c = rk_test_jget(ev, "choices.0.delta.content");
        if (c && json_string_length(c) > 0) {
            events++;
            json_t *lp = rk_test_jget(ev, "choices.0.logprobs.content");
            cr_assert(json_array_size(lp) >= 1, "a content event without logprobs: %.300s", p);
            for (size_t i = 0; i < json_array_size(lp); i++)
                check_chat_logprob(json_array_get(lp, i), 3);
            n_entries += json_array_size(lp);
        }
        json_decref(ev);
    }
    cr_assert(events >= 1);
    cr_assert_eq(n_entries, 6, "the stream's logprobs cover %zu tokens, want 6", n_entries);
    rk_test_resp_free(&st);
    rk_test_resp_free(&r);
}

Test(openai, completion_logprobs_keep_the_completions_shape_with_text_offset) {
    resp r = rk_test_postf(&S.t, "/v1/completions",
                           "{\"prompt\": \"Once\", \"max_tokens\": 4, \"logprobs\": 2, "
                           "\"temperature\": 0, \"ignore_eos\": true}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    json_t *lp = rk_test_jget(r.json, "choices.0.logprobs");
    cr_assert_eq(json_array_size(json_object_get(lp, "tokens")), 4);
    cr_assert_eq(json_array_size(json_object_get(lp, "token_logprobs")), 4);
    cr_assert_eq(json_array_size(json_object_get(lp, "top_logprobs")), 4);
    json_t *off = json_object_get(lp, "text_offset");
    cr_assert_eq(json_array_size(off), 4);
    cr_assert_eq(json_integer_value(json_array_get(off, 0)), 0);
    for (size_t i = 1; i < 4; i++)
        cr_assert(json_integer_value(json_array_get(off, i)) >=
                  json_integer_value(json_array_get(off, i - 1)));
    rk_test_resp_free(&r);
}

/* Streamed with a stop string: the log-probabilities of every token counted
 * in usage come out, the one that completed the stop string included. */
Test(openai, streamed_logprobs_cover_every_token_up_to_a_stop_string) {
    const char *req = "{\"prompt\": \"Once upon a time\", \"max_tokens\": 24, \"temperature\": 0, "
                      "\"ignore_eos\": true, \"logprobs\": 1%s}";
    resp whole = rk_test_postf(&S.t, "/v1/completions", req, "");
    cr_assert_eq(whole.http.status, 200, "%s", whole.http.body);
    const char *text = rk_test_jstr(whole.json, "choices.0.text");
    size_t len = strlen(text);
    cr_assert(len >= 12, "the greedy text is too short: \"%s\"", text);
    char stop[8], extra[128];
    snprintf(stop, sizeof stop, "%.3s", text + len / 2); /* a piece from the middle */
    cr_assert_null(strpbrk(stop, "\"\\"), "pick another prompt: %s", stop);
    snprintf(extra, sizeof extra,
             ", \"stop\": \"%s\", \"stream\": true, \"stream_options\": {\"include_usage\": true}",
             stop);
    resp st = rk_test_postf(&S.t, "/v1/completions", req, extra);
    cr_assert_eq(st.http.status, 200);
    size_t entries = 0;
    long long usage = -1;
    for (const char *p = strstr(st.http.body, "data: {"); p; p = strstr(p + 1, "data: {")) {
        json_t *ev = json_loadb(p + 6, strcspn(p + 6, "\n"), 0, NULL);
        cr_assert(ev);
        entries += json_array_size(rk_test_jget(ev, "choices.0.logprobs.token_logprobs"));
        if (json_is_object(json_object_get(ev, "usage")))
            usage = rk_test_jint(ev, "usage.completion_tokens");
        json_decref(ev);
    }
    cr_assert(strstr(st.http.body, "\"finish_reason\":\"stop\""), "%s", st.http.body);
    cr_assert_eq((long long)entries, usage, "logprobs for %zu tokens, usage counts %lld", entries,
                 usage);
    rk_test_resp_free(&st);
    rk_test_resp_free(&whole);
}

/* ================================================================ model names */

Test(openai_opts, served_model_names_and_the_strict_policy) {
    const char *args[] = {"--served-model-name", "gpt-x,alias-2", "--model-name-policy", "strict",
                          NULL};
    start_with(args);
    resp r = request("GET", "/v1/models", NULL, NULL);
    cr_assert_str_eq(rk_test_jstr(r.json, "data.0.id"), "gpt-x");
    rk_test_resp_free(&r);
    r = request("GET", "/v1/models/alias-2", NULL, NULL);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "id"), "gpt-x");
    cr_assert_str_eq(rk_test_jstr(r.json, "object"), "model");
    rk_test_resp_free(&r);
    r = request("GET", "/v1/models/gpt-9", NULL, NULL);
    cr_assert_eq(r.http.status, 404, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "error.code"), "model_not_found");
    rk_test_resp_free(&r);
    r = rk_test_postf(&S.t, "/v1/completions",
                      "{\"prompt\": \"x\", \"max_tokens\": 1, \"model\": \"alias-2\"}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "model"), "gpt-x");
    rk_test_resp_free(&r);
    r = rk_test_postf(&S.t, "/v1/completions",
                      "{\"prompt\": \"x\", \"max_tokens\": 1, \"model\": \"gpt-9\"}");
    cr_assert_eq(r.http.status, 404, "%s", r.http.body);
    cr_assert_str_eq(rk_test_jstr(r.json, "error.code"), "model_not_found");
    cr_assert_str_eq(rk_test_jstr(r.json, "error.param"), "model");
    rk_test_resp_free(&r);
}

/* ================================================================ connections per address */

/* 60 connections from 127.0.0.1 with a limit of 20: on every one /health
 * and /ready answer, on the 40 beyond the limit /v1/models is answered 503 and the
 * connection closed; the service still answers 127.0.0.2 at once, and once
 * they are closed 127.0.0.1 is served again. */
Test(openai_opts, requests_beyond_the_per_address_limit_are_refused_but_probes_answer) {
    const char *args[] = {"--max-connections-per-ip", "20", NULL};
    start_with(args);
    enum { N = 60 };
    int fds[N], refused = 0, probes = 0;
    for (int i = 0; i < N; i++) fds[i] = connect_from("127.0.0.1");
    /* A probe on each, answered while all 60 are open: every one has been
     * taken (and counted) before any closes. */
    for (int i = 0; i < N; i++) send_str(fds[i], "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    for (int i = 0; i < N; i++) {
        char *a = recv_one(fds[i]);
        probes += !strncmp(a, "HTTP/1.1 200", 12);
        free(a);
    }
    int ready = 0;
    for (int i = 0; i < N; i++) send_str(fds[i], "GET /ready HTTP/1.1\r\nHost: x\r\n\r\n");
    for (int i = 0; i < N; i++) {
        char *a = recv_one(fds[i]);
        ready += !strncmp(a, "HTTP/1.1 200", 12);
        free(a);
    }
    cr_assert_eq(ready, N, "/ready answered 200 on %d of %d connections", ready, N);
    for (int i = 0; i < N; i++)
        send_str(fds[i], "GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    for (int i = 0; i < N; i++) {
        char *a = recv_all(fds[i]);
        refused += !strncmp(a, "HTTP/1.1 503", 12) && strstr(a, "max_connections_per_ip");
        free(a);
    }
    cr_assert_eq(probes, N, "/health answered 200 on %d of %d connections", probes, N);
    cr_assert_eq(refused, N - 20, "%d of %d connections were refused, want %d", refused, N, N - 20);
    int other = connect_from("127.0.0.2");
    double t0 = rk_test_now();
    send_str(other, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    char *a = recv_all(other);
    close(other);
    cr_assert(!strncmp(a, "HTTP/1.1 200", 12), "%s", a);
    cr_assert(rk_test_now() - t0 < 1, "/health from another address took %.2f s",
              rk_test_now() - t0);
    free(a);
    for (int i = 0; i < N; i++) close(fds[i]);
    resp r = {0};
    for (double t_end = rk_test_now() + 10; rk_test_now() < t_end; rk_test_sleep(0.05)) {
        r = request("GET", "/health", NULL, NULL);
        if (r.http.status == 200) break;
        rk_test_resp_free(&r);
    }
    cr_assert_eq(r.http.status, 200);
    rk_test_resp_free(&r);
}

/* ================================================================ CORS */

Test(openai, cors_is_off_unless_an_origin_is_set) {
    resp r = request("OPTIONS", "/v1/chat/completions", "Origin: https://app.example\r\n", NULL);
    cr_assert_eq(r.http.status, 405, "%s", r.http.body);
    cr_assert_null(rk_test_header(&r, "Access-Control-Allow-Origin"));
    rk_test_resp_free(&r);
}

Test(openai_opts, cors_answers_preflights_and_marks_responses) {
    const char *args[] = {"--cors-origin", "https://app.example", "--api-key", "k1", NULL};
    start_with(args);
    resp r = request("OPTIONS", "/v1/chat/completions",
                     "Origin: https://app.example\r\nAccess-Control-Request-Method: POST\r\n"
                     "Access-Control-Request-Headers: authorization, content-type\r\n",
                     NULL);
    cr_assert_eq(r.http.status, 204, "%s", r.http.body);
    cr_assert_str_eq(rk_test_header(&r, "Access-Control-Allow-Origin"), "https://app.example");
    cr_assert(strstr(rk_test_header(&r, "Access-Control-Allow-Methods"), "POST"));
    cr_assert(strstr(rk_test_header(&r, "Access-Control-Allow-Headers"), "authorization"));
    rk_test_resp_free(&r);
    r = request("POST", "/v1/completions",
                "Origin: https://app.example\r\nAuthorization: Bearer k1\r\n",
                "{\"prompt\": \"x\", \"max_tokens\": 1}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert_str_eq(rk_test_header(&r, "Access-Control-Allow-Origin"), "https://app.example");
    rk_test_resp_free(&r);
}

/* ================================================================ tokenize */

/* What `ragkv tokenize --text TEXT` prints (the embedded model). */
static json_t *cli_tokenize(const char *text) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "'%s' tokenize --text '%s' 2>/dev/null", RK_BIN, text);
    FILE *f = popen(cmd, "r");
    cr_assert(f);
    char out[4096] = "";
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    pclose(f);
    json_t *j = json_loads(out, 0, NULL);
    cr_assert(json_is_array(j), "ragkv tokenize printed: %s", out);
    return j;
}

/* `echo` starts a completion's text with its prompt, whole and streamed
 * (the prompt is the first event), per prompt of a batch; on chat it is
 * refused. */
Test(openai, echo_puts_the_prompt_before_the_completion) {
    const char *body = "{\"prompt\": %s, \"max_tokens\": 6, \"seed\": 4, \"n\": %d%s}";
    resp plain = rk_test_postf(&S.t, "/v1/completions", body, "\"Once upon a time\"", 1, "");
    resp echo =
        rk_test_postf(&S.t, "/v1/completions", body, "\"Once upon a time\"", 1, ", \"echo\": true");
    char want[512];
    snprintf(want, sizeof want, "Once upon a time%s", rk_test_jstr(plain.json, "choices.0.text"));
    cr_assert_str_eq(rk_test_jstr(echo.json, "choices.0.text"), want, "%s", echo.http.body);
    cr_assert_eq(rk_test_jint(echo.json, "usage.completion_tokens"),
                 rk_test_jint(plain.json, "usage.completion_tokens"));
    resp st = rk_test_postf(&S.t, "/v1/completions", body, "\"Once upon a time\"", 1,
                            ", \"echo\": true, \"stream\": true");
    const char *first = strstr(st.http.body, "\"text\":\"");
    cr_assert(first && !strncmp(first + 8, "Once upon a time\"", 17), "%s", st.http.body);
    rk_strbuf all = {0};
    for (const char *p = strstr(st.http.body, "\"text\":\""); p; p = strstr(p + 1, "\"text\":\"")) {
        json_t *v = json_loadb(p + 7, strcspn(p + 8, "\"") + 2, JSON_DECODE_ANY, NULL);
        rk_strbuf_puts(&all, json_string_value(v));
        json_decref(v);
    }
    cr_assert_str_eq(all.s, want);
    resp batch = rk_test_postf(&S.t, "/v1/completions", body, "[\"A cat\", \"A dog\"]", 2,
                               ", \"echo\": true");
    cr_assert_eq(json_array_size(rk_test_jget(batch.json, "choices")), 4, "%s", batch.http.body);
    for (int i = 0; i < 4; i++) {
        char path[32];
        snprintf(path, sizeof path, "choices.%d.text", i);
        cr_assert(!strncmp(rk_test_jstr(batch.json, path), i < 2 ? "A cat" : "A dog", 5));
    }
    resp chat = rk_test_postf(&S.t, "/v1/chat/completions",
                              "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
                              "\"echo\": true}");
    cr_assert_eq(chat.http.status, 400);
    rk_strbuf_free(&all);
    resp *rs[] = {&plain, &echo, &st, &batch, &chat};
    for (size_t i = 0; i < sizeof rs / sizeof rs[0]; i++) rk_test_resp_free(rs[i]);
}

/* ================================================================ echo with logprobs */

/* The one-token oracle of a prompt token: a completion of the tokens before
 * it (ids[0..i), "" for none), its one token forced to ids[i] by logit_bias
 * (log-probabilities are of the raw logits, before any bias). Returns the
 * answer's logprobs object (owned by *out). */
static json_t *one_step(json_t *ids, size_t i, int k, resp *out) {
    rk_strbuf prefix = {0};
    rk_strbuf_puts(&prefix, i ? "[" : "\"\"");
    for (size_t j = 0; j < i; j++)
        rk_strbuf_printf(&prefix, "%s%lld", j ? ", " : "",
                         (long long)json_integer_value(json_array_get(ids, j)));
    if (i) rk_strbuf_puts(&prefix, "]");
    long long want = json_integer_value(json_array_get(ids, i));
    *out =
        rk_test_postf(&S.t, "/v1/completions",
                      "{\"prompt\": %s, \"max_tokens\": 1, \"temperature\": 0, \"logprobs\": %d, "
                      "\"ignore_eos\": true, \"logit_bias\": {\"%lld\": 100}}",
                      prefix.s, k, want);
    rk_strbuf_free(&prefix);
    cr_assert_eq(out->http.status, 200, "%s", out->http.body);
    cr_assert_eq(rk_test_jint(out->json, "ragkv.completion_ids.0"), want, "%s", out->http.body);
    return rk_test_jget(out->json, "choices.0.logprobs");
}

/* Top log-probabilities {text: logprob} equal (same texts, values within
 * 1e-4), with k entries in order, most likely first. */
static void check_top(json_t *top, json_t *want, int k, size_t i) {
    cr_assert(json_is_object(top), "top_logprobs[%zu] is an object", i);
    cr_assert_eq(json_object_size(top), (size_t)k, "top_logprobs[%zu] has %d entries", i, k);
    const char *key;
    json_t *v;
    double before = 0;
    int first = 1;
    json_object_foreach(top, key, v) {
        double lp = json_real_value(v);
        cr_assert(first || lp <= before, "top_logprobs[%zu] is sorted", i);
        before = lp;
        first = 0;
        json_t *w = json_object_get(want, key);
        cr_assert(w, "top_logprobs[%zu] has '%s' that the one-step run has not", i, key);
        cr_assert_float_eq(lp, json_real_value(w), 1e-4, "top_logprobs[%zu]['%s']", i, key);
    }
}

/* `echo` with `logprobs` (lm-evaluation-harness's loglikelihood request):
 * the prompt's tokens are its tokenization, each with the log-probability
 * a one-token completion of the tokens before it gives it; text offsets
 * point into the prompt; max_tokens 0 answers the prompt alone, and with
 * generated tokens they follow; a token-id prompt scores the same; a
 * stream sends the prompt with its entries first, for each choice. */
Test(openai_opts, echo_with_logprobs_scores_each_prompt_token_as_a_one_token_completion_does) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    const char *args[] = {"--model", model, NULL};
    start_with(args);
    enum { K = 3, GEN = 3 };
    const char *prompt = "Once upon a time there was a little dog named Max";
    size_t plen = strlen(prompt);
    resp tk =
        rk_test_postf(&S.t, "/tokenize", "{\"content\": \"%s\", \"with_pieces\": true}", prompt);
    cr_assert_eq(tk.http.status, 200, "%s", tk.http.body);
    json_t *pieces = rk_test_jget(tk.json, "tokens"), *ids = json_array();
    size_t n = json_array_size(pieces);
    for (size_t i = 0; i < n; i++)
        json_array_append(ids, json_object_get(json_array_get(pieces, i), "id"));
    cr_assert_gt(n, 8);

    resp e = rk_test_postf(&S.t, "/v1/completions",
                           "{\"prompt\": \"%s\", \"echo\": true, \"logprobs\": %d, "
                           "\"max_tokens\": 0}",
                           prompt, K);
    cr_assert_eq(e.http.status, 200, "%s", e.http.body);
    cr_assert_str_eq(rk_test_jstr(e.json, "choices.0.text"), prompt);
    cr_assert_str_eq(rk_test_jstr(e.json, "choices.0.finish_reason"), "length");
    cr_assert_eq(rk_test_jint(e.json, "usage.completion_tokens"), 0);
    json_t *lp = rk_test_jget(e.json, "choices.0.logprobs");
    json_t *tokens = json_object_get(lp, "tokens"), *lps = json_object_get(lp, "token_logprobs");
    json_t *tops = json_object_get(lp, "top_logprobs"), *offs = json_object_get(lp, "text_offset");
    cr_assert_eq(json_array_size(tokens), n, "%s", e.http.body);
    cr_assert_eq(json_array_size(lps), n);
    cr_assert_eq(json_array_size(tops), n);
    cr_assert_eq(json_array_size(offs), n);
    for (size_t i = 0; i < n; i++) {
        const char *piece = json_string_value(json_object_get(json_array_get(pieces, i), "piece"));
        const char *tok = json_string_value(json_array_get(tokens, i));
        cr_assert_str_eq(tok, piece, "token %zu", i);
        long long off = json_integer_value(json_array_get(offs, i));
        cr_assert(off >= 0 && (size_t)off <= plen);
        if (i == 0)
            cr_assert_eq(off, 0);
        else /* the piece's text where its offset points */
            cr_assert(!strncmp(prompt + off, tok, strlen(tok)), "token %zu '%s' at %lld", i, tok,
                      off);
        /* stories260K puts BOS before the prompt: the first token has one too. */
        resp o;
        json_t *want = one_step(ids, i, K, &o);
        cr_assert(json_is_real(json_array_get(lps, i)), "token_logprobs[%zu]", i);
        cr_assert_float_eq(
            json_real_value(json_array_get(lps, i)),
            json_real_value(json_array_get(json_object_get(want, "token_logprobs"), 0)), 1e-4,
            "token_logprobs[%zu]", i);
        check_top(json_array_get(tops, i), json_array_get(json_object_get(want, "top_logprobs"), 0),
                  K, i);
        rk_test_resp_free(&o);
    }

    /* The same prompt as token ids scores the same. */
    char *id_list = json_dumps(ids, JSON_COMPACT);
    resp ti = rk_test_postf(&S.t, "/v1/completions",
                            "{\"prompt\": %s, \"echo\": true, \"logprobs\": %d, "
                            "\"max_tokens\": 0}",
                            id_list, K);
    cr_assert_eq(ti.http.status, 200, "%s", ti.http.body);
    json_t *ti_lps = rk_test_jget(ti.json, "choices.0.logprobs.token_logprobs");
    cr_assert_eq(json_array_size(ti_lps), n);
    for (size_t i = 0; i < n; i++)
        cr_assert_float_eq(json_real_value(json_array_get(ti_lps, i)),
                           json_real_value(json_array_get(lps, i)), 1e-4);

    /* With generated tokens: the prompt's entries, then theirs, offsets on. */
    const char *gen_body = "{\"prompt\": \"%s\", \"echo\": true, \"logprobs\": 1, \"max_tokens\": "
                           "%d, \"temperature\": 0, \"ignore_eos\": true%s}";
    resp g = rk_test_postf(&S.t, "/v1/completions", gen_body, prompt, GEN, "");
    cr_assert_eq(g.http.status, 200, "%s", g.http.body);
    json_t *glp = rk_test_jget(g.json, "choices.0.logprobs");
    cr_assert_eq(json_array_size(json_object_get(glp, "tokens")), n + GEN, "%s", g.http.body);
    cr_assert_eq(json_integer_value(json_array_get(json_object_get(glp, "text_offset"), n)),
                 (long long)plen);
    cr_assert(!strncmp(rk_test_jstr(g.json, "choices.0.text"), prompt, plen));
    for (size_t i = 0; i < n; i++)
        cr_assert_float_eq(
            json_real_value(json_array_get(json_object_get(glp, "token_logprobs"), i)),
            json_real_value(json_array_get(lps, i)), 1e-4);

    /* Streamed, two choices: each choice's first event is the prompt with its
     * n entries; its later events carry the generated tokens' entries, with
     * offsets from the prompt's end. */
    resp st = rk_test_postf(&S.t, "/v1/completions", gen_body, prompt, GEN,
                            ", \"stream\": true, \"n\": 2");
    cr_assert_eq(st.http.status, 200, "%s", st.http.body);
    int events[2] = {0, 0};
    size_t generated[2] = {0, 0};
    for (const char *p = strstr(st.http.body, "data: {"); p; p = strstr(p + 1, "data: {")) {
        json_t *ev = json_loadb(p + 6, strcspn(p + 6, "\n"), 0, NULL);
        cr_assert(ev, "an event is JSON");
        json_t *c = json_array_get(json_object_get(ev, "choices"), 0);
        int idx = (int)json_integer_value(json_object_get(c, "index"));
        json_t *elp = json_object_get(c, "logprobs");
        if (c && json_is_null(json_object_get(c, "finish_reason"))) {
            cr_assert(idx == 0 || idx == 1);
            json_t *et = json_object_get(elp, "tokens");
            if (events[idx]++ == 0) {
                cr_assert_str_eq(json_string_value(json_object_get(c, "text")), prompt);
                cr_assert_eq(json_array_size(et), n, "%s", p);
            } else {
                for (size_t j = 0; j < json_array_size(et); j++)
                    cr_assert_geq(
                        json_integer_value(json_array_get(json_object_get(elp, "text_offset"), j)),
                        (long long)plen);
                generated[idx] += json_array_size(et);
            }
        }
        json_decref(ev);
    }
    for (int c = 0; c < 2; c++) {
        cr_assert_gt(events[c], 1, "choice %d", c);
        cr_assert_eq(generated[c], GEN, "choice %d streamed %zu generated entries", c,
                     generated[c]);
    }
    free(id_list);
    json_decref(ids);
    resp *rs[] = {&tk, &e, &ti, &g, &st};
    for (size_t i = 0; i < sizeof rs / sizeof rs[0]; i++) rk_test_resp_free(rs[i]);
    free(model);
}

/* On a model without BOS the first prompt token has nothing before it:
 * null log-probability and top_logprobs, as OpenAI answers; the next is
 * the one-token completion's of the first. */
Test(openai_opts, echo_with_logprobs_gives_null_to_a_first_token_with_nothing_before_it) {
    char *model = rk_test_model("phi3-tiny", "f32", 7);
    const char *args[] = {"--model", model, NULL};
    start_with(args);
    resp tk = rk_test_postf(&S.t, "/tokenize", "{\"content\": \"Once upon a time\"}");
    json_t *ids = rk_test_jget(tk.json, "tokens");
    resp e = rk_test_postf(&S.t, "/v1/completions",
                           "{\"prompt\": \"Once upon a time\", \"echo\": true, \"logprobs\": 2, "
                           "\"max_tokens\": 0}");
    cr_assert_eq(e.http.status, 200, "%s", e.http.body);
    json_t *lp = rk_test_jget(e.json, "choices.0.logprobs");
    cr_assert_eq(json_array_size(json_object_get(lp, "tokens")), json_array_size(ids));
    cr_assert(json_is_null(json_array_get(json_object_get(lp, "token_logprobs"), 0)), "%s",
              e.http.body);
    cr_assert(json_is_null(json_array_get(json_object_get(lp, "top_logprobs"), 0)));
    resp o;
    json_t *want = one_step(ids, 1, 2, &o);
    cr_assert_float_eq(json_real_value(json_array_get(json_object_get(lp, "token_logprobs"), 1)),
                       json_real_value(json_array_get(json_object_get(want, "token_logprobs"), 0)),
                       1e-4, "%s", e.http.body);
    check_top(json_array_get(json_object_get(lp, "top_logprobs"), 1),
              json_array_get(json_object_get(want, "top_logprobs"), 0), 2, 1);
    rk_test_resp_free(&o);
    rk_test_resp_free(&e);
    rk_test_resp_free(&tk);
    free(model);
}

Test(openai, tokenize_and_detokenize_match_the_cli) {
    const char *text = "Once upon a time, Lily";
    json_t *want = cli_tokenize(text);
    resp r = rk_test_postf(&S.t, "/tokenize", "{\"content\": \"%s\"}", text);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    cr_assert(json_equal(json_object_get(r.json, "tokens"), want), "%s", r.http.body);
    rk_test_resp_free(&r);
    r = rk_test_postf(&S.t, "/tokenize",
                      "{\"content\": \"%s\", \"with_pieces\": true, \"add_special\": true}", text);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    json_t *toks = json_object_get(r.json, "tokens");
    cr_assert_eq(json_array_size(toks), json_array_size(want) + 1, "add_special adds BOS");
    cr_assert(json_is_integer(rk_test_jget(r.json, "tokens.0.id")));
    cr_assert(json_equal(rk_test_jget(r.json, "tokens.1.id"), json_array_get(want, 0)));
    cr_assert(rk_test_jget(r.json, "tokens.1.piece"));
    rk_test_resp_free(&r);
    char *ids = json_dumps(want, JSON_COMPACT);
    r = rk_test_postf(&S.t, "/detokenize", "{\"tokens\": %s}", ids);
    free(ids);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    const char *back = rk_test_jstr(r.json, "content");
    cr_assert(!strcmp(back, text) || (back[0] == ' ' && !strcmp(back + 1, text)),
              "detokenized \"%s\"", back);
    rk_test_resp_free(&r);
    r = rk_test_postf(&S.t, "/detokenize", "{\"tokens\": [-1]}");
    cr_assert_eq(r.http.status, 400, "%s", r.http.body);
    rk_test_resp_free(&r);
    json_decref(want);
}

/* ================================================================ the openai SDK */

/* Run a shell command; its exit status. */
static int run(const char *cmd) {
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* The official `openai` npm package (v6), installed once from the npm
 * registry into build/npm: the folder in dir, or the test is skipped, saying
 * why, where node, npm or the registry is not there. The package is
 * installed in a folder of this process's and renamed into place whole,
 * marked "installed", so that a suite run beside this one, or an install
 * killed midway, never leaves a half-installed package to run. */
static void sdk_installed(char *dir, size_t cap) {
    if (run("command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1"))
        cr_skip_test("node and npm are not installed: the openai SDK test is skipped");
    char cmd[8192], tmp[1100];
    snprintf(dir, cap, "%s/../npm", RK_TEST_TMP);
    snprintf(tmp, sizeof tmp, "%s.%ld", dir, (long)getpid());
    snprintf(cmd, sizeof cmd, "test -f '%s/installed'", dir);
    if (run(cmd)) {
        snprintf(cmd, sizeof cmd,
                 "rm -rf '%s' && mkdir -p '%s' && timeout 300 npm install --prefix '%s' "
                 "--no-audit --no-fund --no-save --loglevel=error openai@6 </dev/null "
                 ">'%s.install.log' 2>&1 && touch '%s/installed'",
                 tmp, tmp, tmp, dir, tmp);
        int failed = run(cmd);
        /* the first whole install in place wins; a later one is dropped */
        snprintf(cmd, sizeof cmd,
                 "if [ %d -eq 0 ] && ! [ -f '%s/installed' ]; then rm -rf '%s'; mv -T '%s' '%s' "
                 "2>/dev/null; "
                 "fi; rm -rf '%s'",
                 failed, dir, dir, tmp, dir, tmp);
        run(cmd);
        if (failed)
            cr_skip_test("npm could not install openai@6 (registry unreachable?); see "
                         "%s.install.log: the openai SDK test is skipped",
                         dir);
    }
}

/* Run tests/SCRIPT against the running server from the SDK's folder dir,
 * where node finds the package; it must print "ok: all checks passed". */
static void run_sdk_script(const char *dir, const char *script) {
    char src[1024], cmd[4096];
    snprintf(src, sizeof src, "%s", RK_SHARED_DIR);
    char *tail = strstr(src, "/../shared");
    if (tail) *tail = '\0';
    snprintf(cmd, sizeof cmd, "cp '%s/tests/%s' '%s/%s'", src, script, dir, script);
    cr_assert_eq(run(cmd), 0, "cannot copy tests/%s from %s", script, src);
    snprintf(cmd, sizeof cmd,
             "cd '%s' && RAGKV_URL='http://127.0.0.1:%d/v1' timeout 240 node %s "
             "</dev/null 2>&1",
             dir, S.port, script);
    FILE *f = popen(cmd, "r");
    cr_assert(f);
    char out[16384] = "";
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    int st = pclose(f);
    int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
    cr_log_info("%s:\n%s", script, out);
    cr_assert_eq(code, 0, "%s failed (%d):\n%s", script, code, out);
    cr_assert(strstr(out, "ok: all checks passed"), "%s", out);
}

/* Completions, chat, streams, logprobs, errors and model names through the
 * SDK (tests/openai_sdk.mjs), on the embedded model. */
Test(openai_opts, the_official_openai_sdk_reads_every_answer, .timeout = 600) {
    char dir[1024];
    sdk_installed(dir, sizeof dir);
    const char *args[] = {"--max-context", "256", "--served-model-name", "ragkv-test", NULL};
    start_with(args);
    run_sdk_script(dir, "openai_sdk.mjs");
}

/* Structured output and tool calls through the SDK's own parsing helpers
 * (chat.completions.parse, the streaming helper's finalChatCompletion), on
 * a synthetic Qwen3 model (ChatML tool tags) with the real vocabulary
 * (tests/openai_sdk_structured.mjs). */
Test(openai_opts, the_official_openai_sdk_parses_structured_output_and_tool_calls, .timeout = 900) {
    char dir[1024];
    sdk_installed(dir, sizeof dir);
    char *model = rk_test_model("qwen3-tiny", "f32", 1);
    const char *args[] = {"--model", model, "--served-model-name", "ragkv-test", NULL};
    start_with(args);
    run_sdk_script(dir, "openai_sdk_structured.mjs");
    free(model);
}

/* gpt-oss (harmony) through the SDK (tests/openai_sdk_harmony.mjs):
 * documents and their chunk hits, the analysis channel as
 * reasoning_content and a tool call as tool_calls, whole and streamed. */
Test(openai_opts, the_official_openai_sdk_reads_gpt_oss_reasoning_and_tool_calls, .timeout = 900) {
    char dir[1024];
    sdk_installed(dir, sizeof dir);
    char *model = rk_test_model("gpt-oss-tiny", "f32", 3);
    const char *args[] = {"--model", model, "--served-model-name", "ragkv-test", NULL};
    start_with(args);
    run_sdk_script(dir, "openai_sdk_harmony.mjs");
    free(model);
}

/* embeddings.create through the SDK, floats and base64 (which the SDK asks
 * for by default and decodes itself), on an embedding model
 * (tests/openai_sdk_embeddings.mjs). */
Test(openai_opts, the_official_openai_sdk_reads_embeddings_as_floats_and_base64, .timeout = 600) {
    char dir[1024];
    sdk_installed(dir, sizeof dir);
    char *model = rk_test_model("qwen3-embedding-tiny", "f32", 1);
    const char *args[] = {"--model", model, "--served-model-name", "ragkv-test", NULL};
    start_with(args);
    run_sdk_script(dir, "openai_sdk_embeddings.mjs");
    free(model);
}
