/* fuzz/fuzz_request.c — libFuzzer target over the HTTP request parsers: the
 * completion and chat bodies (with every chat template rendered, and the
 * body read as an answer's tool calls under each), pre-warm and
 * flush bodies, Responses bodies (translated into chat bodies, which then
 * parse as chat), the prompt splitter, and the framing check over the input
 * read as a request head (header counts and header syntax:
 * gateway/framing.c). No model is needed. Each input is
 * checked against the parsers' invariants; a violation aborts (a crash to
 * libFuzzer). tests/test_request_corpus.c includes this file and replays
 * fuzz/corpus/ through rk_fuzz_request_check under Criterion.
 *
 *   make fuzz                 (FUZZ_SECONDS=60 by default; scripts/fuzz.sh) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "gateway/chat.h"
#include "gateway/http.h"
#include "gateway/responses.h"

#define FUZZ_MAX_CHUNKS 8
#define FUZZ_MAX_TOKENS 4096

static int is_error_status(int s) {
    return s == 400 || s == 404 || s == 413 || s == 422 || s == 500 || s == 501;
}

/* A failed parse must explain itself with an error status and a message. */
static const char *check_error(const rk_http_error *e) {
    if (!is_error_status(e->status)) return "a parse failed with an unexpected HTTP status";
    if (!e->type || !e->type[0] || !e->message[0]) return "a parse failed without a message";
    if (!memchr(e->message, '\0', sizeof e->message)) return "an error message is not terminated";
    return NULL;
}

static const char *check_split(const rk_split *s, int max_chunks) {
    if (s->n_chunks < 0 || s->n_chunks > max_chunks) return "more chunks than allowed";
    if (s->n_empty_chunks < 0) return "a negative count of empty chunks";
    if (!s->system.s || !s->question.s) return "a missing system or question piece";
    if (strlen(s->system.s) != s->system.len || strlen(s->question.s) != s->question.len)
        return "a piece length that does not match its text";
    for (int i = 0; i < s->n_chunks; i++) {
        if (!s->chunks[i].s || s->chunks[i].len == 0) return "an empty chunk was kept";
        if (strlen(s->chunks[i].s) != s->chunks[i].len) return "a chunk length mismatch";
    }
    if (s->n_chunks > 0 && s->question.len == 0) return "chunks without a question";
    return NULL;
}

static const char *check_request(const rk_api_request *r) {
    const rk_req_options *o = &r->opt;
    if (o->max_tokens < 0 || o->max_tokens > FUZZ_MAX_TOKENS) return "max_tokens out of range";
    if (o->n_logprobs < 0 || o->n_logprobs > 20) return "logprobs out of range";
    if (!(o->sampling.temperature >= 0) || !(o->sampling.top_p > 0 && o->sampling.top_p <= 1))
        return "a sampling parameter out of range";
    if (o->sampling.top_k < 0) return "a negative top_k";
    if (r->n_stop < 0 || r->n_stop > RK_MAX_STOP) return "too many stop strings";
    for (int i = 0; i < r->n_stop; i++) {
        size_t n = strlen(r->stop[i]);
        if (n == 0 || n > RK_STOP_MAX_BYTES) return "a stop string of a bad length";
    }
    if (rk_separator_check(r->separator)) return "an invalid separator was accepted";
    if (r->n_choices < 1 || r->n_choices * (r->n_prompts ? r->n_prompts : 1) > RK_MAX_CHOICES)
        return "a choice count out of range";
    if (!(o->sampling.presence_penalty >= -2 && o->sampling.presence_penalty <= 2) ||
        !(o->sampling.frequency_penalty >= -2 && o->sampling.frequency_penalty <= 2) ||
        !(o->sampling.repetition_penalty > 0) || o->sampling.n_logit_bias < 0 ||
        o->sampling.n_logit_bias > RK_MAX_LOGIT_BIAS)
        return "a penalty or logit_bias out of range";
    for (int i = 0; i < r->n_prompts; i++) {
        const char *bad = r->batch ? check_split(&r->batch[i], FUZZ_MAX_CHUNKS) : NULL;
        if (bad) return bad;
        if (r->batch_tokens && (!r->batch_tokens[i] || r->batch_lens[i] < 1))
            return "an empty token prompt";
    }
    if (!r->chat && !r->have_pieces && r->n_prompts == 0)
        return "a completion parsed without pieces";
    return r->have_pieces ? check_split(&r->pieces, FUZZ_MAX_CHUNKS) : NULL;
}

/* ---------------------------------------------------------------- request heads */

#define FUZZ_MAX_HEADERS 64 /* as CivetWeb keeps */

/* The input read as a request head: the first line's last word is the
 * version ("HTTP/1.1" gives "1.1"), each later line up to an empty one or
 * the end is "name: value" (a line without a colon is a name with no
 * value); at most 80 lines are read, so counts past the limit are tried.
 * The text is copied into store (size + 1 bytes), which h points into. */
static int read_head(const uint8_t *data, size_t size, char *store, rk_gw_header *h, int cap,
                     const char **version) {
    memcpy(store, data, size);
    store[size] = '\0';
    *version = NULL;
    char *line = store, *end = store + strlen(store);
    int n = -1;
    while (line < end && n < cap) {
        char *eol = strstr(line, "\r\n");
        if (!eol) eol = end;
        *eol = '\0';
        if (n >= 0 && !line[0]) break;
        if (n < 0) {
            char *v = strrchr(line, ' ');
            v = v ? v + 1 : line;
            *version = !strncmp(v, "HTTP/", 5) ? v + 5 : v;
        } else {
            char *colon = strchr(line, ':');
            char *name_end = colon ? colon : line + strlen(line);
            int blank = name_end > line && (name_end[-1] == ' ' || name_end[-1] == '\t');
            while (name_end > line && (name_end[-1] == ' ' || name_end[-1] == '\t')) name_end--;
            char *value = colon ? colon + 1 : name_end;
            while (*value == ' ' || *value == '\t') value++;
            *name_end = '\0';
            h[n] = (rk_gw_header){.name = line, .value = value, .space_before_colon = blank};
        }
        n++;
        line = eol + (eol < end ? 2 : 0);
    }
    return n < 0 ? 0 : n;
}

/* The framing verdict on the input read as a request head. */
int rk_fuzz_head_verdict(const uint8_t *data, size_t size, rk_gw_framing *f);
int rk_fuzz_head_verdict(const uint8_t *data, size_t size, rk_gw_framing *f) {
    rk_gw_header h[80];
    char *store = malloc(size + 1);
    if (!store) return -2;
    const char *version;
    int n = read_head(data, size, store, h, 80, &version);
    int r = rk_gw_framing_check(h, n, FUZZ_MAX_HEADERS, version, f);
    free(store);
    return r;
}

/* The framing check's invariants on the input read as a request head. */
static const char *check_head(const uint8_t *data, size_t size) {
    rk_gw_header h[80];
    char *store = malloc(size + 1);
    if (!store) return NULL;
    const char *version, *bad = NULL;
    int n = read_head(data, size, store, h, 80, &version);
    rk_gw_framing f;
    int r = rk_gw_framing_check(h, n, FUZZ_MAX_HEADERS, version, &f);
    int n_cl = 0, n_te = 0, n_host = 0, n_auth = 0;
    const char *cl = NULL;
    for (int i = 0; i < n && i < FUZZ_MAX_HEADERS; i++) {
        if (!strcasecmp(h[i].name, "Content-Length")) n_cl++, cl = h[i].value;
        n_te += !strcasecmp(h[i].name, "Transfer-Encoding");
        n_host += !strcasecmp(h[i].name, "Host");
        n_auth += !strcasecmp(h[i].name, "Authorization");
    }
    if (r == 0) {
        if (n >= FUZZ_MAX_HEADERS)
            bad = "a head with as many headers as the parser keeps passed";
        else if (n_cl > 1 || n_te > 1 || n_host > 1 || n_auth > 1)
            bad = "a duplicate framing, Host or Authorization header passed";
        else if (n_cl && n_te)
            bad = "Content-Length beside Transfer-Encoding passed";
        else if (f.chunked != (n_te == 1))
            bad = "chunked does not match the head";
        else if (f.chunked && (!version || strcmp(version, "1.1")))
            bad = "Transfer-Encoding outside HTTP/1.1 passed";
        else if (cl && (!cl[0] || strspn(cl, "0123456789") != strlen(cl) ||
                        f.content_length != strtoll(cl, NULL, 10)))
            bad = "a Content-Length other than its digits passed";
        else if (!cl && f.content_length != -1)
            bad = "a length without Content-Length";
        for (int i = 0; i < n && !bad; i++)
            if (h[i].space_before_colon) bad = "white space before a colon passed";
    } else if (f.status != 400 && f.status != 417 && f.status != 431) {
        bad = "a head refused with an unexpected status";
    } else if ((f.status == 431) != (n >= FUZZ_MAX_HEADERS)) {
        bad = "431 without too many headers, or too many headers without 431";
    } else if (!f.message[0] || !memchr(f.message, '\0', sizeof f.message)) {
        bad = "a head refused without a message";
    }
    free(store);
    return bad;
}

/* The input as a POST /v1/responses body: translated into a chat body,
 * alone and after its own input items as a stored conversation, then parsed
 * as chat. 0 when it translates and parses; 1 when refused with a good
 * error; -1 with *bad set when an invariant broke. err gets the refusal. */
int rk_fuzz_responses(const uint8_t *data, size_t size, rk_http_error *err, const char **bad);
int rk_fuzz_responses(const uint8_t *data, size_t size, rk_http_error *err, const char **bad) {
    rk_parse_limits lim = {.max_chunks = FUZZ_MAX_CHUNKS, .max_tokens = FUZZ_MAX_TOKENS};
    json_t *root = rk_api_load_object((const char *)data, size, err);
    *bad = NULL;
    if (!root) return (*bad = check_error(err)) ? -1 : 1;
    int outcome = 0;
    json_t *conv = NULL;
    for (int pass = 0; pass < 2 && !*bad && outcome == 0; pass++) {
        json_t *input = NULL;
        json_t *chat = rk_resp_chat_body(root, conv, "fz", &input, err);
        if (!chat) {
            *bad = input ? "a refused body left its input items" : check_error(err);
            outcome = 1;
            break;
        }
        if (!json_is_array(input) || !json_array_size(input) ||
            !json_is_array(json_object_get(chat, "messages")))
            *bad = "a translated body without input items or messages";
        char *text = json_dumps(chat, JSON_COMPACT);
        rk_api_request r;
        if (!*bad && text && rk_api_parse(text, strlen(text), 1, &lim, &r, err) == RK_OK) {
            *bad = check_request(&r);
            rk_api_request_free(&r);
        } else if (!*bad && text) {
            *bad = check_error(err);
            outcome = 1;
        }
        free(text);
        json_decref(chat);
        json_decref(conv);
        conv = input; /* the second pass continues the first's conversation */
    }
    json_decref(conv);
    json_decref(root);
    return *bad ? -1 : outcome;
}

const char *rk_fuzz_request_check(const uint8_t *data, size_t size);

/* The input read as a model's answer under template t: no calls, or calls
 * of r's tools whose arguments are JSON objects, with the text before them. */
static const char *check_calls(rk_chat_template t, const rk_api_request *r, const char *data,
                               size_t size) {
    char *text = strndup(data, size), *content = NULL;
    if (!text) return NULL;
    json_t *calls = rk_chat_tool_calls(t, r, text, "id", &content);
    const char *bad = NULL;
    if (!calls != !content) bad = "tool calls without their content, or content without calls";
    if (calls && !json_array_size(calls)) bad = "an empty list of tool calls";
    for (size_t k = 0; !bad && k < json_array_size(calls); k++) {
        json_t *f = json_object_get(json_array_get(calls, k), "function");
        const char *name = json_string_value(json_object_get(f, "name"));
        const char *a = json_string_value(json_object_get(f, "arguments"));
        json_t *args = a ? json_loads(a, 0, NULL) : NULL;
        int known = 0;
        for (int i = 0; name && i < r->n_tools; i++) known |= !strcmp(r->tools[i].name, name);
        if (!known || !json_is_object(args)) bad = "a tool call of no tool, or not an object";
        json_decref(args);
    }
    json_decref(calls);
    free(content);
    free(text);
    return bad;
}

/* Run every parser over the input; NULL when every invariant holds, else what broke. */
const char *rk_fuzz_request_check(const uint8_t *data, size_t size) {
    const char *body = (const char *)data, *bad = NULL;
    rk_parse_limits lim = {.max_chunks = FUZZ_MAX_CHUNKS, .max_tokens = FUZZ_MAX_TOKENS};
    for (int chat = 0; chat <= 1 && !bad; chat++) {
        rk_api_request r;
        rk_http_error err = {0};
        if (rk_api_parse(body, size, chat, &lim, &r, &err) != RK_OK) {
            bad = check_error(&err);
            continue;
        }
        bad = check_request(&r);
        for (int t = RK_CHAT_CHATML; chat && !bad && t <= RK_CHAT_GEMMA4; t++) {
            rk_http_error e2 = {0};
            if (rk_chat_render((rk_chat_template)t, &r, FUZZ_MAX_CHUNKS, &e2) == RK_OK)
                bad = r.have_pieces ? check_split(&r.pieces, FUZZ_MAX_CHUNKS)
                                    : "a chat rendered without pieces";
            else
                bad = check_error(&e2);
            if (!bad && r.have_pieces && r.pieces.question.len == 0)
                bad = "a chat question piece without its template";
            if (!bad && r.n_tools) bad = check_calls((rk_chat_template)t, &r, body, size);
        }
        rk_api_request_free(&r);
    }
    if (!bad) {
        rk_prewarm_request p;
        rk_http_error err = {0};
        if (rk_prewarm_parse(body, size, &p, &err) == RK_OK) {
            if (p.n < 1 || p.n > RK_MAX_PREWARM || !p.system) bad = "a bad pre-warm request";
            for (int i = 0; i < p.n && !bad; i++)
                if (!p.texts[i] || !p.texts[i][0]) bad = "an empty pre-warm chunk was kept";
            rk_prewarm_request_free(&p);
        } else {
            bad = check_error(&err);
        }
    }
    if (!bad) {
        rk_flush_request f;
        rk_http_error err = {0};
        if (rk_flush_parse(body, size, &f, &err) == RK_OK) {
            if (!f.chunks && !f.prefix) bad = "a flush of nothing";
        } else {
            bad = check_error(&err);
        }
    }
    static const char *seps[] = {"##", "|", "<doc>"};
    for (int k = 0; k < 3 && !bad; k++) {
        rk_split s;
        rk_status st = rk_split_prompt(body, size, seps[k], FUZZ_MAX_CHUNKS, &s);
        if (st == RK_OK) {
            /* Embedded NUL bytes end a piece's C string early: compare up to them. */
            if (memchr(body, '\0', size) == NULL) bad = check_split(&s, FUZZ_MAX_CHUNKS);
            rk_split_free(&s);
        } else if (st != RK_ERR_INVALID && st != RK_ERR_LIMIT) {
            bad = "the splitter failed with an unexpected status";
        }
    }
    if (!bad) {
        rk_http_error err = {0};
        rk_fuzz_responses(data, size, &err, &bad);
    }
    if (!bad) bad = check_head(data, size);
    return bad;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *bad = rk_fuzz_request_check(data, size);
    if (bad) {
        fprintf(stderr, "invariant broken: %s\n", bad);
        abort();
    }
    return 0;
}
