/* gateway/responses.c — POST /v1/responses, GET and DELETE
 * /v1/responses/{id}, GET /v1/responses/{id}/input_items. A Responses body
 * becomes a chat body (responses_input.c), with the stored conversation of
 * previous_response_id before its input, and runs on the chat path
 * (rk_gw_generate) with a sink that turns the chat answer into a response
 * object, or its chunk events into the Responses events: output items
 * (reasoning, message, function_call) opened, their text in deltas, closed,
 * and response.completed carrying the whole response, built from the items
 * as the unstreamed answer is. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/tokenizer.h"
#include "gateway/http.h"
#include "gateway/responses.h"

typedef struct resp_ctx {
    req_ctx *rc;
    server *S;
    char id[64];   /* "resp_..." */
    char base[48]; /* what item ids are named after */
    long created;
    json_t *root;         /* the request body */
    json_t *input;        /* this request's input items */
    json_t *conversation; /* the stored items before them ([] when none) */
    int store;
    /* The stream: events sent, items so far, the open ones (-1: none). */
    int seq, started, failed;
    json_t *output;
    int reasoning_at, message_at, n_calls;
    rk_strbuf rtext, mtext;
    char finish[32];
    json_t *usage, *ragkv, *error;
} resp_ctx;

/* ---------------------------------------------------------------- the response object */

static int reasoning_tokens(resp_ctx *x, json_t *output) {
    rk_service *svc = rk_gw_ready_service(x->S);
    int n = 0;
    for (size_t i = 0; svc && i < json_array_size(output); i++) {
        json_t *it = json_array_get(output, i);
        const char *ty = json_string_value(json_object_get(it, "type"));
        if (!ty || strcmp(ty, "reasoning")) continue;
        json_t *c = json_array_get(json_object_get(it, "content"), 0);
        const char *t = json_string_value(json_object_get(c, "text"));
        int32_t *ids = NULL;
        size_t k = 0;
        if (t && !rk_tokenizer_encode(rk_model_tokenizer(svc->model), t, strlen(t), 1, &ids, &k))
            n += (int)k;
        free(ids);
    }
    return n;
}

/* Chat's usage in the Responses shape. */
static json_t *usage_of(resp_ctx *x, json_t *u, json_t *output) {
    if (!u) return json_null();
    json_int_t in = json_integer_value(json_object_get(u, "prompt_tokens"));
    json_int_t out = json_integer_value(json_object_get(u, "completion_tokens"));
    json_int_t rt = reasoning_tokens(x, output);
    json_int_t cached = json_integer_value(
        json_object_get(json_object_get(u, "prompt_tokens_details"), "cached_tokens"));
    return json_pack("{s:I, s:{s:I}, s:I, s:{s:I}, s:I}", "input_tokens", in,
                     "input_tokens_details", "cached_tokens", cached, "output_tokens", out,
                     "output_tokens_details", "reasoning_tokens", rt < out ? rt : out,
                     "total_tokens", in + out);
}

static json_t *field_or(json_t *root, const char *name, json_t *dflt) {
    json_t *v = json_object_get(root, name);
    if (v && !json_is_null(v)) {
        json_decref(dflt);
        return json_incref(v);
    }
    return dflt;
}

/* The response with output (taken), its state (status: "in_progress",
 * "completed", "incomplete" or "failed"), chat's usage and ragkv report. */
static json_t *response_object(resp_ctx *x, json_t *output, const char *status, json_t *usage,
                               json_t *ragkv) {
    json_t *root = x->root, *rs = json_object_get(root, "reasoning");
    json_t *prev = json_object_get(root, "previous_response_id");
    json_t *o = json_pack(
        "{s:s, s:s, s:I, s:s, s:o, s:n, s:o, s:o, s:s, s:o, s:o, s:o, s:o, s:o, s:b, s:o, s:o, "
        "s:o, s:o, s:o, s:s, s:o}",
        "id", x->id, "object", "response", "created_at", (json_int_t)x->created, "status", status,
        "error", x->error ? json_incref(x->error) : json_null(), "incomplete_details",
        "instructions", field_or(root, "instructions", json_null()), "max_output_tokens",
        field_or(root, "max_output_tokens", json_null()), "model", x->S->model_name, "output",
        output, "parallel_tool_calls", field_or(root, "parallel_tool_calls", json_true()),
        "previous_response_id", prev ? json_incref(prev) : json_null(), "reasoning",
        json_pack("{s:O, s:n}", "effort",
                  json_object_get(rs, "effort") ? json_object_get(rs, "effort") : json_null(),
                  "summary"),
        "metadata", field_or(root, "metadata", json_object()), "store", x->store, "temperature",
        field_or(root, "temperature", json_real(1.0)), "top_p",
        field_or(root, "top_p", json_real(1.0)), "text",
        json_pack(
            "{s:o}", "format",
            field_or(json_object_get(root, "text"), "format", json_pack("{s:s}", "type", "text"))),
        "tool_choice", field_or(root, "tool_choice", json_string("auto")), "tools",
        field_or(root, "tools", json_array()), "truncation", "disabled", "usage",
        usage_of(x, usage, output));
    if (!o) return NULL;
    if (!strcmp(status, "incomplete"))
        json_object_set_new(
            o, "incomplete_details",
            json_pack("{s:s}", "reason",
                      !strcmp(x->finish, "cancelled") ? "cancelled" : "max_output_tokens"));
    if (ragkv) json_object_set(o, "ragkv", ragkv);
    return o;
}

/* ---------------------------------------------------------------- output items */

static json_t *reasoning_item(resp_ctx *x, const char *text) {
    char id[64];
    snprintf(id, sizeof id, "rs_%s", x->base);
    return json_pack("{s:s, s:s, s:[], s:[{s:s, s:s}]}", "id", id, "type", "reasoning", "summary",
                     "content", "type", "reasoning_text", "text", text);
}

static json_t *text_part(const char *text) {
    return json_pack("{s:s, s:s, s:[], s:[]}", "type", "output_text", "text", text, "annotations",
                     "logprobs");
}

static json_t *message_item(resp_ctx *x, const char *status, json_t *content) {
    char id[64];
    snprintf(id, sizeof id, "msg_%s", x->base);
    return json_pack("{s:s, s:s, s:s, s:s, s:o}", "id", id, "type", "message", "role", "assistant",
                     "status", status, "content", content);
}

static json_t *call_item(resp_ctx *x, int k, json_t *call, const char *args, const char *status) {
    char id[64];
    snprintf(id, sizeof id, "fc_%s_%d", x->base, k);
    json_t *f = json_object_get(call, "function");
    const char *call_id = json_string_value(json_object_get(call, "id"));
    const char *name = json_string_value(json_object_get(f, "name"));
    return json_pack("{s:s, s:s, s:s, s:s, s:s, s:s}", "id", id, "type", "function_call", "call_id",
                     call_id ? call_id : id, "name", name ? name : "", "arguments", args, "status",
                     status);
}

/* A response's status for chat's finish_reason: stop and tool_calls are
 * completed; length (max_output_tokens) and cancelled (the timeout, a
 * shutdown) incomplete. */
static const char *status_of(const char *finish) {
    return !strcmp(finish, "length") || !strcmp(finish, "cancelled") ? "incomplete" : "completed";
}

/* The output items of a chat answer's message. */
static json_t *items_of_message(resp_ctx *x, json_t *msg, const char *finish) {
    json_t *out = json_array();
    const char *r = json_string_value(json_object_get(msg, "reasoning_content"));
    const char *c = json_string_value(json_object_get(msg, "content"));
    json_t *calls = json_object_get(msg, "tool_calls");
    if (r && *r) json_array_append_new(out, reasoning_item(x, r));
    const char *st = status_of(finish);
    if ((c && *c) || !json_array_size(calls))
        json_array_append_new(out, message_item(x, st, json_pack("[o]", text_part(c ? c : ""))));
    for (size_t k = 0; k < json_array_size(calls); k++) {
        json_t *call = json_array_get(calls, k);
        const char *a =
            json_string_value(json_object_get(json_object_get(call, "function"), "arguments"));
        json_array_append_new(out, call_item(x, (int)k, call, a ? a : "{}", "completed"));
    }
    return out;
}

/* Keep a finished response (store: true) with its conversation. */
static void keep(resp_ctx *x, json_t *response) {
    if (!x->store || !x->S->responses) return;
    json_t *conv = json_deep_copy(x->conversation);
    json_array_extend(conv, x->input);
    json_array_extend(conv, json_object_get(response, "output"));
    if (conv && rk_resp_store_put(x->S->responses, x->rc->tenant, x->id, response, x->input, conv))
        RK_LOG_WARN("id=%s: the response was not stored: %s", x->rc->id, rk_error_message());
    json_decref(conv);
}

/* The sink's final: a chat.completion as a response object. */
static json_t *sink_final(void *ctx, json_t *obj) {
    resp_ctx *x = ctx;
    json_t *choice = json_array_get(json_object_get(obj, "choices"), 0);
    const char *fr = json_string_value(json_object_get(choice, "finish_reason"));
    fr = fr ? fr : "stop";
    snprintf(x->finish, sizeof x->finish, "%s", fr);
    json_t *items = items_of_message(x, json_object_get(choice, "message"), fr);
    json_t *r = response_object(x, items, status_of(fr), json_object_get(obj, "usage"),
                                json_object_get(obj, "ragkv"));
    json_decref(obj);
    if (r) keep(x, r);
    return r;
}

/* ---------------------------------------------------------------- events */

/* One event: "event: TYPE" and its data with type and sequence_number
 * (data taken). */
static void emit(resp_ctx *x, rk_strbuf *out, const char *type, json_t *data) {
    if (!data) {
        out->oom = 1;
        return;
    }
    json_object_set_new(data, "type", json_string(type));
    json_object_set_new(data, "sequence_number", json_integer(x->seq++));
    char *s = json_dumps(data, JSON_COMPACT);
    json_decref(data);
    if (!s) {
        out->oom = 1;
        return;
    }
    rk_strbuf_printf(out, "event: %s\ndata: %s\n\n", type, s);
    free(s);
}

static json_t *item_at(resp_ctx *x, int at) { return json_array_get(x->output, (size_t)at); }

static const char *item_id(resp_ctx *x, int at) {
    return json_string_value(json_object_get(item_at(x, at), "id"));
}

/* Open an item (added to the output in progress). */
static int open_item(resp_ctx *x, rk_strbuf *out, json_t *item) {
    int at = (int)json_array_size(x->output);
    json_array_append_new(x->output, item);
    emit(x, out, "response.output_item.added",
         json_pack("{s:i, s:O}", "output_index", at, "item", item));
    return at;
}

static void text_delta(resp_ctx *x, rk_strbuf *out, int reasoning, const char *d) {
    int at = reasoning ? x->reasoning_at : x->message_at;
    if (at < 0) {
        json_t *item = reasoning ? json_pack("{s:s, s:s, s:[], s:[]}", "id", "", "type",
                                             "reasoning", "summary", "content")
                                 : message_item(x, "in_progress", json_array());
        char id[64];
        snprintf(id, sizeof id, "rs_%s", x->base);
        if (reasoning) json_object_set_new(item, "id", json_string(id));
        at = open_item(x, out, item);
        json_t *part = reasoning ? json_pack("{s:s, s:s}", "type", "reasoning_text", "text", "")
                                 : text_part("");
        emit(x, out, "response.content_part.added",
             json_pack("{s:s, s:i, s:i, s:o}", "item_id", item_id(x, at), "output_index", at,
                       "content_index", 0, "part", part));
        *(reasoning ? &x->reasoning_at : &x->message_at) = at;
    }
    rk_strbuf_puts(reasoning ? &x->rtext : &x->mtext, d);
    json_t *ev = json_pack("{s:s, s:i, s:i, s:s}", "item_id", item_id(x, at), "output_index", at,
                           "content_index", 0, "delta", d);
    if (ev && !reasoning) json_object_set_new(ev, "logprobs", json_array());
    emit(x, out, reasoning ? "response.reasoning_text.delta" : "response.output_text.delta", ev);
}

/* Close the open reasoning (reasoning) or message item with its text. */
static void close_item(resp_ctx *x, rk_strbuf *out, int reasoning, const char *status) {
    int *at = reasoning ? &x->reasoning_at : &x->message_at;
    if (*at < 0) return;
    rk_strbuf *b = reasoning ? &x->rtext : &x->mtext;
    const char *text = b->s ? b->s : "";
    const char *id = item_id(x, *at);
    json_t *ev = json_pack("{s:s, s:i, s:i, s:s}", "item_id", id, "output_index", *at,
                           "content_index", 0, "text", text);
    if (ev && !reasoning) json_object_set_new(ev, "logprobs", json_array());
    emit(x, out, reasoning ? "response.reasoning_text.done" : "response.output_text.done", ev);
    json_t *item = reasoning ? reasoning_item(x, text)
                             : message_item(x, status, json_pack("[o]", text_part(text)));
    emit(x, out, "response.content_part.done",
         json_pack("{s:s, s:i, s:i, s:O}", "item_id", id, "output_index", *at, "content_index", 0,
                   "part", json_array_get(json_object_get(item, "content"), 0)));
    json_array_set_new(x->output, (size_t)*at, item);
    emit(x, out, "response.output_item.done",
         json_pack("{s:i, s:O}", "output_index", *at, "item", item));
    *at = -1;
}

static void function_call(resp_ctx *x, rk_strbuf *out, json_t *call) {
    const char *args =
        json_string_value(json_object_get(json_object_get(call, "function"), "arguments"));
    args = args ? args : "{}";
    int k = x->n_calls++;
    int at = open_item(x, out, call_item(x, k, call, "", "in_progress"));
    const char *id = item_id(x, at);
    emit(x, out, "response.function_call_arguments.delta",
         json_pack("{s:s, s:i, s:s}", "item_id", id, "output_index", at, "delta", args));
    emit(x, out, "response.function_call_arguments.done",
         json_pack("{s:s, s:i, s:s}", "item_id", id, "output_index", at, "arguments", args));
    json_t *item = call_item(x, k, call, args, "completed");
    json_array_set_new(x->output, (size_t)at, item);
    emit(x, out, "response.output_item.done",
         json_pack("{s:i, s:O}", "output_index", at, "item", item));
}

static void start_stream(resp_ctx *x, rk_strbuf *out) {
    if (x->started) return;
    x->started = 1;
    json_t *r = response_object(x, json_array(), "in_progress", NULL, NULL);
    emit(x, out, "response.created", json_pack("{s:o}", "response", r));
    r = response_object(x, json_array(), "in_progress", NULL, NULL);
    emit(x, out, "response.in_progress", json_pack("{s:o}", "response", r));
}

/* One chat chunk's delta as events. */
static void on_delta(resp_ctx *x, rk_strbuf *out, json_t *delta) {
    const char *r = json_string_value(json_object_get(delta, "reasoning_content"));
    const char *c = json_string_value(json_object_get(delta, "content"));
    json_t *calls = json_object_get(delta, "tool_calls");
    if (r && *r) text_delta(x, out, 1, r);
    if ((c && *c) || json_array_size(calls)) close_item(x, out, 1, NULL);
    if (c && *c) text_delta(x, out, 0, c);
    if (json_array_size(calls)) close_item(x, out, 0, "completed");
    for (size_t k = 0; k < json_array_size(calls); k++)
        function_call(x, out, json_array_get(calls, k));
}

static char *sink_event(void *ctx, json_t *ev) {
    resp_ctx *x = ctx;
    rk_strbuf out = {0};
    start_stream(x, &out);
    json_t *err = json_object_get(ev, "error"), *choices = json_object_get(ev, "choices");
    if (err) { /* mid-stream: an error event; the stream ends with response.failed */
        x->failed = 1;
        json_decref(x->error);
        x->error =
            json_pack("{s:O, s:O}", "code",
                      json_object_get(err, "code") ? json_object_get(err, "code") : json_null(),
                      "message", json_object_get(err, "message"));
        emit(x, &out, "error",
             json_pack("{s:O, s:O, s:O}", "code", json_object_get(err, "code"), "message",
                       json_object_get(err, "message"), "param", json_object_get(err, "param")));
    } else if (json_is_array(choices) && !json_array_size(choices)) { /* usage */
        json_decref(x->usage);
        json_decref(x->ragkv);
        x->usage = json_incref(json_object_get(ev, "usage"));
        x->ragkv = json_incref(json_object_get(ev, "ragkv"));
    } else {
        json_t *choice = json_array_get(choices, 0);
        const char *fr = json_string_value(json_object_get(choice, "finish_reason"));
        if (fr) snprintf(x->finish, sizeof x->finish, "%s", fr);
        on_delta(x, &out, json_object_get(choice, "delta"));
    }
    json_decref(ev);
    char *s = rk_strbuf_take(&out);
    return s;
}

static char *sink_done(void *ctx) {
    resp_ctx *x = ctx;
    rk_strbuf out = {0};
    start_stream(x, &out);
    const char *fr = x->finish[0] ? x->finish : "stop";
    close_item(x, &out, 1, NULL);
    if (x->message_at < 0 && !x->n_calls && !x->failed) text_delta(x, &out, 0, "");
    close_item(x, &out, 0, x->failed ? "incomplete" : status_of(fr));
    const char *status = x->failed ? "failed" : status_of(fr);
    json_t *r = response_object(x, json_incref(x->output), status, x->usage, x->ragkv);
    if (r && !x->failed) keep(x, r);
    char type[48];
    snprintf(type, sizeof type, "response.%s", status);
    emit(x, &out, type, json_pack("{s:o}", "response", r));
    return rk_strbuf_take(&out);
}

/* ---------------------------------------------------------------- routes */

static void send_not_found(req_ctx *rc, const char *id, const char *param) {
    rk_http_error e = {.status = 404, .type = rk_http_error_type(404), .param = param};
    snprintf(e.message, sizeof e.message, "no response with id '%.200s'", id);
    rk_gw_send_error(rc, &e);
}

/* Parse and translate; 0 with x ready and *chat the chat body, or -1 after answering. */
static int prepare(resp_ctx *x, const char *body, size_t len, json_t **chat) {
    req_ctx *rc = x->rc;
    rk_http_error lerr = {0};
    if (!(x->root = rk_api_load_object(body, len, &lerr))) {
        rk_gw_send_error(rc, &lerr);
        return -1;
    }
    json_t *prev = json_object_get(x->root, "previous_response_id");
    if (prev && !json_is_null(prev)) {
        if (!json_is_string(prev)) {
            rk_http_error e = {0};
            rk_http_errorf(&e, 400, "'previous_response_id' must be a string");
            rk_gw_send_error(rc, &e);
            return -1;
        }
        const char *pid = json_string_value(prev);
        if (!x->S->responses ||
            rk_resp_store_get(x->S->responses, rc->tenant, pid, NULL, NULL, &x->conversation)) {
            send_not_found(rc, pid, "previous_response_id");
            return -1;
        }
    }
    if (!x->conversation) x->conversation = json_array();
    json_t *st = json_object_get(x->root, "store");
    x->store = !json_is_false(st);
    rk_http_error err = {0};
    *chat = rk_resp_chat_body(x->root, x->conversation, x->base, &x->input, &err);
    if (!*chat) {
        rk_gw_send_error(rc, &err);
        return -1;
    }
    return 0;
}

static int handle_create(req_ctx *rc) {
    char *body;
    size_t len;
    if (rk_gw_read_body(rc, &body, &len)) return 0;
    resp_ctx x = {.rc = rc, .S = rc->S, .reasoning_at = -1, .message_at = -1};
    snprintf(x.base, sizeof x.base, "%s", rc->id + 4);
    snprintf(x.id, sizeof x.id, "resp_%s", x.base);
    x.created = (long)time(NULL);
    x.output = json_array();
    json_t *chat = NULL;
    int bad = prepare(&x, body, len, &chat);
    free(body);
    if (!bad) {
        char *text = json_dumps(chat, JSON_COMPACT);
        if (!text) {
            rk_gw_send_errorf(rc, 500, "out of memory");
        } else {
            rk_gw_sink sink = {
                .ctx = &x, .final = sink_final, .event = sink_event, .done = sink_done};
            rk_gw_generate(rc, 1, text, strlen(text), &sink);
        }
    }
    json_decref(chat);
    json_decref(x.root);
    json_decref(x.input);
    json_decref(x.conversation);
    json_decref(x.output);
    json_decref(x.usage);
    json_decref(x.ragkv);
    json_decref(x.error);
    rk_strbuf_free(&x.rtext);
    rk_strbuf_free(&x.mtext);
    return 0;
}

/* GET /v1/responses/{id}/input_items: a list, newest first unless ?order=asc. */
static void send_input_items(req_ctx *rc, json_t *input) {
    const char *q = mg_get_request_info(rc->conn)->query_string;
    int asc = q && strstr(q, "order=asc");
    json_t *data = json_array();
    size_t n = json_array_size(input);
    for (size_t i = 0; i < n; i++)
        json_array_append(data, json_array_get(input, asc ? i : n - 1 - i));
    json_t *first = json_object_get(json_array_get(data, 0), "id");
    json_t *last = json_object_get(json_array_get(data, n ? n - 1 : 0), "id");
    rk_gw_send_json(rc, 200,
                    json_pack("{s:s, s:o, s:O, s:O, s:b}", "object", "list", "data", data,
                              "first_id", first ? first : json_null(), "last_id",
                              last ? last : json_null(), "has_more", 0));
}

int rk_gw_handle_responses(req_ctx *rc, const char *rest, int del) {
    if (!rest) return handle_create(rc);
    char id[128];
    size_t l = strcspn(rest, "/");
    int items = rest[l] != '\0';
    snprintf(id, sizeof id, "%.*s", (int)(l < sizeof id ? l : sizeof id - 1), rest);
    rk_resp_store *st = rc->S->responses;
    if (del) {
        if (!st || rk_resp_store_delete(st, rc->tenant, id)) return send_not_found(rc, id, NULL), 0;
        rk_gw_send_json(rc, 200,
                        json_pack("{s:s, s:s, s:b}", "id", id, "object", "response", "deleted", 1));
        return 0;
    }
    json_t *resp = NULL, *input = NULL;
    if (!st ||
        rk_resp_store_get(st, rc->tenant, id, items ? NULL : &resp, items ? &input : NULL, NULL))
        return send_not_found(rc, id, NULL), 0;
    if (items) {
        send_input_items(rc, input);
        json_decref(input);
    } else {
        rk_gw_send_json(rc, 200, resp);
    }
    return 0;
}
