/* gateway/generate.c — POST /v1/completions and /v1/chat/completions: a
 * request prepared (parsed, rendered, tokenized) on the worker thread,
 * queued for the engine, waited for while its tokens are streamed as
 * Server-Sent Events, and answered in OpenAI's shapes. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/tokenizer.h"
#include "gateway/chat.h"
#include "gateway/http.h"
#include "gateway/report.h"
/* Incremental text of a generation: decoded bytes, what has been sent, stop
 * strings. Text goes out only up to a point that is final: complete UTF-8
 * characters, and far enough from the end that no stop string can still
 * begin before it. */
typedef struct gen_text {
    const rk_tokenizer *tok;
    char *raw; /* decoded bytes of the tokens so far */
    size_t len, cap;
    int decoded;     /* tokens decoded */
    int skip_space;  /* drop the leading space of the first piece (as rk_report_text) */
    size_t sent;     /* raw bytes already turned into text */
    long stop_at;    /* raw offset of the first stop match, or -1 */
    int stop_tokens; /* tokens up to the one that completed that match */
    size_t max_stop; /* longest stop string */
    char *const *stop;
    int n_stop;
    int oom;
} gen_text;

static void gt_append(gen_text *g, const char *s, size_t n) {
    if (g->oom || n == 0) return;
    if (g->len + n + 1 > g->cap) {
        size_t cap = g->cap ? g->cap : 256;
        while (cap < g->len + n + 1) cap *= 2;
        char *p = realloc(g->raw, cap);
        if (!p) {
            g->oom = 1;
            return;
        }
        g->raw = p;
        g->cap = cap;
    }
    memcpy(g->raw + g->len, s, n);
    g->len += n;
}

/* Look for stop strings ending in the bytes after offset before. */
static void gt_find_stop(gen_text *g, size_t before) {
    size_t from = before > g->max_stop ? before - g->max_stop + 1 : 0;
    for (int k = 0; k < g->n_stop; k++) {
        size_t sl = strlen(g->stop[k]);
        if (g->len < from + sl) continue;
        const char *hit = memmem(g->raw + from, g->len - from, g->stop[k], sl);
        if (hit && (g->stop_at < 0 || hit - g->raw < g->stop_at)) g->stop_at = hit - g->raw;
    }
}

/* Decode tokens [decoded, n) one at a time, until one completes a stop
 * string: the generation ends with that token (the engine may have sampled
 * more before it heard; they are not part of the answer). */
static void gt_feed(gen_text *g, const int32_t *tokens, int n) {
    for (; g->decoded < n && g->stop_at < 0; g->decoded++) {
        int32_t id = tokens[g->decoded];
        char *t;
        size_t tl, before = g->len;
        if (rk_tokenizer_decode(g->tok, &id, 1, 0, g->skip_space, &t, &tl)) continue;
        gt_append(g, t, tl);
        free(t);
        if (rk_tokenizer_token_bytes(g->tok, id, 0, NULL, 0) > 0) g->skip_space = 0;
        if (g->n_stop && g->len > before) {
            gt_find_stop(g, before);
            if (g->stop_at >= 0) g->stop_tokens = g->decoded + 1;
        }
    }
}

/* The next piece of text that is final (malloc'ed, valid UTF-8; NULL when
 * nothing new). final: the generation is over, send the rest. */
static char *gt_take(gen_text *g, int final) {
    size_t limit = g->stop_at >= 0 ? (size_t)g->stop_at : g->len;
    if (!final && g->stop_at < 0 && g->n_stop)
        limit = g->len > g->max_stop - 1 ? g->len - (g->max_stop - 1) : 0;
    size_t end = g->sent;
    if (final) {
        end = limit > g->sent ? limit : g->sent;
    } else {
        const unsigned char *s = (const unsigned char *)g->raw;
        while (end < limit) {
            uint32_t cp;
            int l = rk_utf8_decode(s + end, g->len - end, &cp);
            if (l < 0) break;  /* wait for the rest of the character */
            if (l == 0) l = 1; /* an invalid byte: becomes U+FFFD on its own */
            if (end + (size_t)l > limit) break;
            end += (size_t)l;
        }
    }
    if (end <= g->sent) return NULL;
    char *t = rk_utf8_sanitize(g->raw + g->sent, end - g->sent, NULL);
    g->sent = end;
    return t;
}

typedef struct gen {
    req_ctx *rc;
    rk_api_request api;
    rk_job *job;
    rk_service *svc;
    gen_text text;
    char id[40];
    long created;
    int headers_sent, client_gone, timed_out;
    /* Chat with tools (tool_choice not none): the answer is held back until
     * it is whole, then parsed for calls (tool_calls: NULL when none). */
    int tools_active;
    json_t *tool_calls;
    char *tool_content;
} gen;

static int write_all(gen *g, const char *s, size_t n) {
    if (g->client_gone) return -1;
    if (mg_write(g->rc->conn, s, n) != (int)n) {
        g->client_gone = 1;
        rk_scheduler_cancel(g->rc->S->engine, g->job);
        return -1;
    }
    return 0;
}

static int sse_event(gen *g, json_t *ev) {
    char *s = ev ? json_dumps(ev, JSON_COMPACT) : NULL;
    json_decref(ev);
    if (!s) return -1;
    int rc = write_all(g, "data: ", 6) || write_all(g, s, strlen(s)) || write_all(g, "\n\n", 2);
    free(s);
    return rc;
}

static void sse_start(gen *g) {
    if (g->headers_sent) return;
    g->headers_sent = 1;
    mg_disable_connection_keep_alive(g->rc->conn);
    struct mg_connection *c = g->rc->conn;
    g->rc->status = 200;
    mg_response_header_start(c, 200);
    mg_response_header_add(c, "Content-Type", "text/event-stream", -1);
    mg_response_header_add(c, "Cache-Control", "no-cache", -1);
    mg_response_header_add(c, "X-Request-Id", g->rc->id, -1);
    mg_response_header_send(c);
}

/* One streamed piece in OpenAI's chunk shape. */
static json_t *chunk_event(gen *g, const char *text, int first) {
    const char *model = g->rc->S->model_name;
    if (g->api.chat) {
        json_t *delta = first ? json_pack("{s:s, s:s}", "role", "assistant", "content", text)
                              : json_pack("{s:s}", "content", text);
        return json_pack("{s:s, s:s, s:I, s:s, s:[{s:i, s:o, s:n}]}", "id", g->id, "object",
                         "chat.completion.chunk", "created", (json_int_t)g->created, "model", model,
                         "choices", "index", 0, "delta", delta, "finish_reason");
    }
    return json_pack("{s:s, s:s, s:I, s:s, s:[{s:i, s:s, s:n, s:n}]}", "id", g->id, "object",
                     "text_completion", "created", (json_int_t)g->created, "model", model,
                     "choices", "index", 0, "text", text, "finish_reason", "logprobs");
}

static const char *finish_reason(gen *g) {
    if (g->tool_calls) return "tool_calls";
    if (g->text.stop_at >= 0) return "stop";
    return rk_finish_reason_name(g->job->req.finish_reason);
}

/* The final object: a whole response, or the last streamed event (text is
 * the remainder then). usage and ragkv come from the report. */
static json_t *final_object(gen *g, const char *text, int streamed) {
    rk_request *r = &g->job->req;
    const rk_tokenizer *tok = rk_model_tokenizer(g->svc->model);
    json_t *full = rk_report_completion(tok, r, g->id, g->created, g->rc->S->model_name);
    if (!full) return NULL;
    json_t *choice0 = json_array_get(json_object_get(full, "choices"), 0);
    json_t *logprobs = json_incref(json_object_get(choice0, "logprobs"));
    json_t *usage = json_incref(json_object_get(full, "usage"));
    json_t *ragkv = json_incref(json_object_get(full, "ragkv"));
    json_decref(full);
    if (!logprobs || !usage || !ragkv) {
        json_decref(logprobs);
        json_decref(usage);
        json_decref(ragkv);
        return NULL;
    }
    const char *fr = finish_reason(g);
    json_t *choice;
    const char *object;
    if (g->api.chat && g->tool_calls) { /* the calls went out in an earlier event when streamed */
        object = streamed ? "chat.completion.chunk" : "chat.completion";
        choice = streamed ? json_pack("{s:i, s:{}, s:s, s:o}", "index", 0, "delta", "finish_reason",
                                      fr, "logprobs", logprobs)
                          : json_pack("{s:i, s:{s:s, s:o, s:O}, s:s, s:o}", "index", 0, "message",
                                      "role", "assistant", "content",
                                      *g->tool_content ? json_string(g->tool_content) : json_null(),
                                      "tool_calls", g->tool_calls, "finish_reason", fr, "logprobs",
                                      logprobs);
    } else if (g->api.chat) {
        object = streamed ? "chat.completion.chunk" : "chat.completion";
        choice = streamed ? json_pack("{s:i, s:{s:s}, s:s, s:o}", "index", 0, "delta", "content",
                                      text, "finish_reason", fr, "logprobs", logprobs)
                          : json_pack("{s:i, s:{s:s, s:s}, s:s, s:o}", "index", 0, "message",
                                      "role", "assistant", "content", text, "finish_reason", fr,
                                      "logprobs", logprobs);
    } else {
        object = "text_completion";
        choice = json_pack("{s:i, s:s, s:s, s:o}", "index", 0, "text", text, "finish_reason", fr,
                           "logprobs", logprobs);
    }
    return json_pack("{s:s, s:s, s:I, s:s, s:[o], s:o, s:o}", "id", g->id, "object", object,
                     "created", (json_int_t)g->created, "model", g->rc->S->model_name, "choices",
                     choice, "usage", usage, "ragkv", ragkv);
}

/* Stream the new text, if any. */
static void stream_progress(gen *g) {
    char *t = gt_take(&g->text, 0);
    if (!t) return;
    int first = !g->headers_sent;
    sse_start(g);
    if (*t) sse_event(g, chunk_event(g, t, first));
    free(t);
}

/* Wait for the job, streaming as it goes; sets g->timed_out. */
static void wait_job(gen *g, double deadline) {
    server *S = g->rc->S;
    int seen = 0, done = 0, n;
    while (!done) {
        int to = rk_job_wait(g->job, seen, g->timed_out ? 0 : deadline, &n, &done);
        if (to) {
            g->timed_out = 1;
            rk_scheduler_cancel(S->engine, g->job);
            continue;
        }
        if (n > seen && !done) {
            /* Tokens 0..n-1 are final; the engine may append more meanwhile. */
            gt_feed(&g->text, g->job->req.out_tokens, n);
            seen = n;
            if (g->text.stop_at >= 0) rk_scheduler_cancel(S->engine, g->job);
            if (g->api.stream && !g->client_gone && !g->tools_active) stream_progress(g);
        }
    }
}

static void log_generation(gen *g) {
    rk_request *r = &g->job->req;
    int hits = 0, misses = 0;
    for (int k = 0; k < r->n_chunks; k++) {
        hits += r->chunk_reports[k].status == RK_CHUNK_STATUS_HIT;
        misses += r->chunk_reports[k].status == RK_CHUNK_STATUS_MISS;
    }
    snprintf(g->rc->detail, sizeof g->rc->detail,
             " prompt_tokens=%d cached_tokens=%d completion_tokens=%d chunks=%d hits=%d misses=%d "
             "finish=%s queue_ms=%.2f ttft_ms=%.2f engine_ms=%.2f%s",
             r->prompt_tokens, r->cached_tokens, r->n_out, r->n_chunks, hits, misses,
             finish_reason(g), r->t.queue_ms, r->t.ttft_ms, r->t.total_ms,
             g->client_gone ? " client_gone=1" : "");
}

static void respond_generation(gen *g) {
    rk_job *j = g->job;
    req_ctx *rc = g->rc;
    if (!j->ran || j->status) {
        int status = !j->ran ? 503 : rk_http_status_of(j->status);
        char msg[400];
        if (g->timed_out && !j->ran)
            snprintf(msg, sizeof msg, "the request waited longer than the timeout (%g s)",
                     rc->S->o.timeout_s);
        else if (!j->ran && atomic_load(&rc->S->stopping))
            snprintf(msg, sizeof msg, "the server is shutting down");
        else if (j->status == RK_ERR_EXHAUSTED)
            snprintf(msg, sizeof msg, "out of KV memory, try again: %s", j->error);
        else
            snprintf(msg, sizeof msg, "%s", j->error[0] ? j->error : rk_status_str(j->status));
        if (g->headers_sent) { /* mid-stream: an error event, then the end */
            rk_http_error e = {.status = status, .type = rk_http_error_type(status)};
            snprintf(e.message, sizeof e.message, "%.319s", msg);
            sse_event(g, rk_gw_error_body(&e));
            write_all(g, "data: [DONE]\n\n", 14);
        } else if (!g->client_gone) {
            rk_gw_send_errorf(rc, status, "%s", msg);
        }
        return;
    }
    gt_feed(&g->text, j->req.out_tokens, j->req.n_out);
    if (g->text.stop_at >= 0 && g->text.stop_tokens < j->req.n_out)
        j->req.n_out = g->text.stop_tokens; /* usage, ids and logprobs end at the stop */
    char *all = NULL; /* with tools: the whole answer, parsed for calls before it is logged */
    if (g->tools_active) {
        all = gt_take(&g->text, 1);
        g->tool_calls =
            rk_chat_tool_calls(rc->S->tmpl, &g->api, all ? all : "", g->id, &g->tool_content);
    }
    log_generation(g);
    if (g->timed_out && !g->api.stream) {
        free(all);
        rk_gw_send_errorf(rc, 503,
                          "the request ran longer than the timeout (%g s) and was cancelled",
                          rc->S->o.timeout_s);
        return;
    }
    if (g->tools_active) {
        if (g->tool_calls && g->api.stream && !g->client_gone) {
            /* The text before the calls, then the calls whole (one fragment
             * each), then the end. */
            sse_start(g);
            json_t *delta =
                json_pack("{s:s, s:s}", "role", "assistant", "content", g->tool_content);
            sse_event(g, json_pack("{s:s, s:s, s:I, s:s, s:[{s:i, s:o, s:n}]}", "id", g->id,
                                   "object", "chat.completion.chunk", "created",
                                   (json_int_t)g->created, "model", rc->S->model_name, "choices",
                                   "index", 0, "delta", delta, "finish_reason"));
            json_t *frag = json_array();
            for (size_t k = 0; frag && k < json_array_size(g->tool_calls); k++) {
                json_t *c = json_deep_copy(json_array_get(g->tool_calls, k));
                if (c) json_object_set_new(c, "index", json_integer((json_int_t)k));
                json_array_append_new(frag, c);
            }
            sse_event(g, json_pack("{s:s, s:s, s:I, s:s, s:[{s:i, s:{s:o}, s:n}]}", "id", g->id,
                                   "object", "chat.completion.chunk", "created",
                                   (json_int_t)g->created, "model", rc->S->model_name, "choices",
                                   "index", 0, "delta", "tool_calls", frag, "finish_reason"));
            free(all);
            sse_event(g, final_object(g, "", 1));
            write_all(g, "data: [DONE]\n\n", 14);
            return;
        }
        if (all && g->api.stream && !g->client_gone && *all) { /* no call: the text as usual */
            sse_start(g);
            sse_event(g, chunk_event(g, all, 1));
        } else if (all && !g->api.stream) {
            json_t *obj = final_object(g, all, 0);
            free(all);
            rk_gw_send_json(rc, 200, obj);
            return;
        }
        free(all);
    }
    if (g->api.stream) {
        if (g->client_gone) return;
        int first = !g->headers_sent;
        sse_start(g);
        char *rest = gt_take(&g->text, 1);
        if (first && g->api.chat && rest && *rest) { /* the role goes with the first piece */
            sse_event(g, chunk_event(g, rest, 1));
            free(rest);
            rest = NULL;
        }
        sse_event(g, final_object(g, rest ? rest : "", 1));
        free(rest);
        write_all(g, "data: [DONE]\n\n", 14);
        return;
    }
    char *text = gt_take(&g->text, 1);
    json_t *obj = final_object(g, text ? text : "", 0);
    free(text);
    rk_gw_send_json(rc, 200, obj);
}

/* Does the `model` a client named match the served one? */
static int model_matches(server *S, rk_service *svc, const char *name) {
    if (!strcmp(name, S->model_name) || !strcmp(name, rk_model_fingerprint(svc->model))) return 1;
    if (S->o.model[0]) {
        const char *b = strrchr(S->o.model, '/');
        b = b ? b + 1 : S->o.model;
        size_t n = strlen(b);
        if (!strcmp(name, b) || !strcmp(name, S->o.model)) return 1;
        if (n > 5 && !strcmp(b + n - 5, ".gguf") && strlen(name) == n - 5 &&
            !strncmp(name, b, n - 5))
            return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- preparing a generation */

typedef struct prep_gen {
    server *S;
    gen *g;
    const char *body;
    size_t len;
    int chat;
    rk_http_error err; /* status 0: prepared */
} prep_gen;

/* Parse, check, render (chat), tokenize: everything before queueing. */
static void prep_generation(void *arg) {
    prep_gen *p = arg;
    server *S = p->S;
    gen *g = p->g;
    rk_http_error *err = &p->err;
    rk_parse_limits lim = {.max_chunks = S->o.cfg.max_chunks, .max_tokens = S->o.cfg.max_tokens};
    (void)rk_repair_parse(S->o.cfg.repair, &lim.repair_k, &lim.repair_ratio); /* validated */
    if (rk_api_parse(p->body, p->len, p->chat, &lim, &g->api, err)) return;
    rk_service *svc = g->svc;
    if (g->api.model && !model_matches(S, svc, g->api.model)) {
        rk_http_errorf(err, 404, "model \"%s\" is not served here; this server serves \"%s\"",
                       g->api.model, S->model_name);
        return;
    }
    if (p->chat && rk_chat_render(S->tmpl, &g->api, S->o.cfg.max_chunks, err)) return;
    if (!g->api.seed_given) g->api.opt.sampling.seed = rk_gw_random(S);
    g->job = malloc(sizeof *g->job);
    if (!g->job || rk_job_init(g->job)) {
        free(g->job);
        g->job = NULL;
        rk_http_errorf(err, 500, "out of memory");
        return;
    }
    g->job->req.opt = g->api.opt;
    rk_error_clear();
    rk_status st = rk_request_prepare(svc, &g->api.pieces, &g->job->req);
    if (st) {
        rk_http_errorf(err, rk_http_status_of(st), "%s", rk_error_message());
        return;
    }
    if (g->api.chunk_ids && g->job->req.n_chunks == g->api.pieces.n_chunks)
        g->job->chunk_ids = g->api.chunk_ids;
}

int rk_gw_handle_generate(req_ctx *rc, int chat) {
    server *S = rc->S;
    double deadline = rc->t0 + S->o.timeout_s;
    char *body;
    size_t len;
    if (rk_gw_read_body(rc, &body, &len)) return 0;
    gen g;
    memset(&g, 0, sizeof g);
    g.rc = rc;
    g.text.stop_at = -1;
    g.svc = rk_gw_ready_service(S);
    if (S->o.log_prompts) /* the only place prompt text may reach the log */
        RK_LOG_INFO("id=%s body: %.*s", rc->id, (int)(len < 4000 ? len : 4000), body);
    if (!g.svc) {
        free(body);
        rk_gw_send_not_ready(rc);
        goto done;
    }
    prep_gen p = {.S = S, .g = &g, .body = body, .len = len, .chat = chat};
    prep_generation(&p);
    free(body);
    if (p.err.status) {
        rk_gw_send_error(rc, &p.err);
        goto done;
    }
    g.job->notify_tokens = g.api.stream || g.api.n_stop > 0;
    g.tools_active = g.api.chat && g.api.n_tools > 0 && g.api.tool_choice != RK_TOOLS_NONE;
    g.text.tok = rk_model_tokenizer(g.svc->model);
    g.text.skip_space = g.job->req.n_question == 0 && g.job->req.n_sys == 1;
    g.text.stop = g.api.stop;
    g.text.n_stop = g.api.n_stop;
    for (int k = 0; k < g.api.n_stop; k++) {
        size_t l = strlen(g.api.stop[k]);
        if (l > g.text.max_stop) g.text.max_stop = l;
    }
    snprintf(g.id, sizeof g.id, "%s", rc->id);
    g.created = (long)time(NULL);
    rk_status st = rk_scheduler_submit(S->engine, g.job);
    if (st) {
        if (st == RK_ERR_BUSY)
            rk_gw_send_errorf(rc, 503, "%s; try again", rk_error_message());
        else
            rk_gw_send_not_ready(rc);
        goto done;
    }
    wait_job(&g, deadline);
    respond_generation(&g);
done:
    if (g.job) {
        rk_job_destroy(g.job);
        free(g.job);
    }
    free(g.text.raw);
    json_decref(g.tool_calls);
    free(g.tool_content);
    rk_api_request_free(&g.api);
    return 0;
}
