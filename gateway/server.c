/* gateway/server.c — `ragkv serve`: configuration, the CivetWeb front end,
 * routing, authentication, responses and Server-Sent Events, shutdown.
 *
 * Threads: CivetWeb's workers run handle_request(); they read and validate
 * the body, tokenize (the tokenizer is immutable, safe for concurrent
 * readers) and queue a job for the engine thread (engine.h), then wait on the
 * job's reply channel. Cache commands are functions queued the same way, so
 * only the engine thread ever touches the arena, the radix tree and the chunk
 * index. The main thread waits for SIGINT/SIGTERM and shuts down: new
 * requests get 503, in-flight ones have a grace period, then are cancelled
 * and write their last answer (a stream's final event, a queued request's
 * 503); CivetWeb is stopped (joining its workers), then the engine. */
#include "gateway/server.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "config/settings.h"
#include "pipeline/scheduler.h"
#include "pipeline/pipeline.h"
#include "gateway/report.h"
#include "gateway/stats.h"
#include "engine/tokenizer.h"

#define EXIT_USAGE 2

/* ================================================================ settings */

/* Everything `ragkv serve` can be told: the rk_config fields and the
 * server's own. Each is settable from the JSON config file (by name), the
 * environment (RAGKV_ + the name in upper case) and a flag. */
typedef struct serve_opts {
    rk_config cfg;
    char model[1024];
    char host[256];
    int port;
    char api_key[256];
    char admin_key[256];
    long long max_body_bytes;
    int queue;
    double timeout_s;
    int max_batch;
    int log_prompts;
    double grace_s;
    int http_threads;
    double request_timeout_s;
    char log_level[16];
    double load_delay_s;
    double token_delay_s;
} serve_opts;

#define OFF(m) offsetof(serve_opts, m)
#define STR(m) OFF(m), sizeof(((serve_opts *)0)->m)

/* The server's own settings; rk_config's come from config/settings.c. */
static const rk_setting k_serve_settings[] = {
    {"model", "model", RK_SET_STR, STR(model), 0, 0, 0, 0,
     "F.gguf  model file (default: the embedded tiny model)"},
    {"host", "host", RK_SET_STR, STR(host), 0, 0, 0, 0,
     "H  address to listen on (default: 127.0.0.1)"},
    {"port", "port", RK_SET_INT, OFF(port), 0, 0, 65535, 0, 0,
     "P  port (default: 8080; 0 = any free port, printed)"},
    {"api_key", "api-key", RK_SET_STR, STR(api_key), 0, 0, 0, 1,
     "KEY  require `Authorization: Bearer KEY` on every route but /health"},
    {"admin_key", "admin-key", RK_SET_STR, STR(admin_key), 0, 0, 0, 1,
     "KEY  require this key for cache flush and chunk delete"},
    {"max_body_bytes", "max-body-bytes", RK_SET_LONG, OFF(max_body_bytes), 0, 1, 1LL << 34, 0, 0,
     "N  largest request body (default: 1048576; larger: 413)"},
    {"queue", "queue", RK_SET_INT, OFF(queue), 0, 1, 1 << 20, 0, 0,
     "N  requests waiting for the engine at most (default: 64; more: 503)"},
    {"timeout_s", "timeout-s", RK_SET_DOUBLE, OFF(timeout_s), 0, 0.001, 1e7, 0, 0,
     "S  cancel a request waiting or running longer (default: 600)"},
    {"max_batch", "max-batch", RK_SET_INT, OFF(max_batch), 0, 1, 4096, 0, 0,
     "N  requests run together at most (default: 16)"},
    {"log_prompts", "log-prompts", RK_SET_BOOL, OFF(log_prompts), 0, 0, 1, 0, 0,
     "  log prompt text (never logged otherwise)"},
    {"grace_s", "grace-s", RK_SET_DOUBLE, OFF(grace_s), 0, 0, 3600, 0, 0,
     "S  on SIGINT/SIGTERM, let requests finish this long (default: 5)"},
    {"http_threads", "http-threads", RK_SET_INT, OFF(http_threads), 0, 0, 4096, 0, 0,
     "N  requests handled at once, more get 503 (default: 0 = queue + 16); 5 N connections "
     "are served"},
    {"request_timeout_s", "request-timeout-s", RK_SET_DOUBLE, OFF(request_timeout_s), 0, 0.1, 3600,
     0, 0,
     "S  a client must send the headers, then the body, within this long, and read what is "
     "written to it (default: 10)"},
    {"log_level", "log-level", RK_SET_STR, STR(log_level), 0, 0, 0, 0,
     "L  debug|info|warn|error (default: warn)"},
    {"load_delay_s", "load-delay-s", RK_SET_DOUBLE, OFF(load_delay_s), 0, 0, 3600, 0, 0,
     "S  testing aid: wait before loading the model"},
    {"token_delay_s", "token-delay-s", RK_SET_DOUBLE, OFF(token_delay_s), 0, 0, 60, 0, 0,
     "S  testing aid: sleep after every generated token"},
};

/* The tables `ragkv serve` reads, bound to o: its own, then rk_config's. */
enum { N_TABLES = 2 };
static void bind_settings(serve_opts *o, rk_settings tabs[N_TABLES]) {
    tabs[0] =
        (rk_settings){k_serve_settings, sizeof k_serve_settings / sizeof k_serve_settings[0], o};
    tabs[1] = (rk_settings){rk_config_settings, rk_config_n_settings, &o->cfg};
}

static void opts_defaults(serve_opts *o) {
    memset(o, 0, sizeof *o);
    rk_config_defaults(&o->cfg);
    snprintf(o->host, sizeof o->host, "127.0.0.1");
    o->port = 8080;
    o->max_body_bytes = 1 << 20;
    o->queue = 64;
    o->timeout_s = 600;
    o->max_batch = 16;
    o->grace_s = 5;
    o->request_timeout_s = 10;
    snprintf(o->log_level, sizeof o->log_level, "warn");
}

/* ================================================================ the server */

typedef struct server {
    serve_opts o;
    struct mg_context *ctx;
    rk_scheduler *engine;
    rk_stats *stats;
    atomic_int stopping;
    atomic_int in_flight; /* requests being handled */
    atomic_int admitted;  /* of those, the ones counted against request_slots */
    int request_slots;    /* http_threads, resolved */
    atomic_ullong counter;
    double started_unix;
    /* Model facts computed once the engine is ready (under info_mu). */
    pthread_mutex_t info_mu;
    int have_info;
    char model_name[256];
    rk_chat_template tmpl;
} server;

/* What one HTTP request is: for the log line. */
typedef struct req_ctx {
    server *S;
    struct mg_connection *conn;
    const char *method, *path; /* path: percent-decoded */
    int head;                  /* a HEAD request: headers only */
    char id[40];
    double t0;
    int status;
    char detail[512]; /* extra log fields */
} req_ctx;

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t fresh_random(server *S) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^
                 (atomic_fetch_add(&S->counter, 1) * 0x2545f4914f6cdd1dull) ^
                 ((uint64_t)getpid() << 48);
    return splitmix(&x);
}

/* ---------------------------------------------------------------- responses */

static void send_headers(req_ctx *rc, int status, const char *type, long long length,
                         const char *retry_after) {
    struct mg_connection *c = rc->conn;
    rc->status = status;
    mg_response_header_start(c, status);
    mg_response_header_add(c, "Content-Type", type, -1);
    if (length >= 0) {
        char n[32];
        snprintf(n, sizeof n, "%lld", length);
        mg_response_header_add(c, "Content-Length", n, -1);
    }
    mg_response_header_add(c, "X-Request-Id", rc->id, -1);
    if (retry_after) mg_response_header_add(c, "Retry-After", retry_after, -1);
    if (status == 405) {
        const char *allow = !strcmp(rc->path, "/v1/chunks")         ? "GET, HEAD, POST"
                            : !strncmp(rc->path, "/v1/chunks/", 11) ? "GET, HEAD, DELETE"
                            : !strcmp(rc->path, "/v1/completions") ||
                                    !strcmp(rc->path, "/v1/chat/completions") ||
                                    !strcmp(rc->path, "/v1/cache/flush")
                                ? "POST"
                                : "GET, HEAD";
        mg_response_header_add(c, "Allow", allow, -1);
    }
    mg_response_header_send(c);
}

static void send_text(req_ctx *rc, int status, const char *type, const char *body, size_t len,
                      const char *retry_after) {
    send_headers(rc, status, type, (long long)len, retry_after);
    if (len && !rc->head) mg_write(rc->conn, body, len);
}

/* Send a JSON body (the reference is taken). */
static void send_json(req_ctx *rc, int status, json_t *body) {
    char *s = body ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    if (!s) {
        static const char oom[] =
            "{\"error\":{\"code\":500,\"type\":\"internal_error\",\"message\":\"out of memory\"}}";
        send_text(rc, 500, "application/json", oom, sizeof oom - 1, NULL);
        return;
    }
    send_text(rc, status, "application/json", s, strlen(s), status == 503 ? "1" : NULL);
    free(s);
}

static json_t *error_body(const rk_http_error *e) {
    json_t *code = e->code ? json_string(e->code) : json_integer(e->status);
    return json_pack("{s:{s:o, s:s, s:s}}", "error", "code", code, "type", e->type, "message",
                     e->message);
}

static void send_error(req_ctx *rc, const rk_http_error *e) {
    send_json(rc, e->status, error_body(e));
}

static void send_errorf(req_ctx *rc, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void send_errorf(req_ctx *rc, int status, const char *fmt, ...) {
    rk_http_error e = {.status = status, .type = rk_http_error_type(status)};
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof e.message, fmt, ap);
    va_end(ap);
    send_error(rc, &e);
}

/* ---------------------------------------------------------------- request bodies */

/* Read the body (at most max_body_bytes), which must arrive within
 * request_timeout_s. Returns 0 and a malloc'ed buffer, or -1 after sending
 * 413, 408 (too slow) or 400 (the client ended it short). */
static int read_body(req_ctx *rc, char **out, size_t *out_len) {
    server *S = rc->S;
    const struct mg_request_info *ri = mg_get_request_info(rc->conn);
    long long max = S->o.max_body_bytes, cl = ri->content_length;
    double deadline = rk_time_now() + S->o.request_timeout_s;
    *out = NULL;
    *out_len = 0;
    if (cl > max) {
        /* Drain what is reasonable so the client sees the answer, then close. */
        size_t sink_cap = 65536;
        char *sink = malloc(sink_cap);
        long long left = cl < 64LL << 20 ? cl : 0;
        while (sink && left > 0 && rk_time_now() < deadline) {
            int n = mg_read(rc->conn, sink,
                            (size_t)(left < (long long)sink_cap ? left : (long long)sink_cap));
            if (n <= 0) break;
            left -= n;
        }
        free(sink);
        mg_disable_connection_keep_alive(rc->conn);
        send_errorf(rc, 413, "the body has %lld bytes; at most %lld are accepted", cl, max);
        return -1;
    }
    size_t cap = cl >= 0 ? (size_t)cl + 1 : 65536, len = 0;
    char *buf = malloc(cap);
    if (!buf) {
        send_errorf(rc, 500, "out of memory");
        return -1;
    }
    /* One mg_read waits at most request_timeout_ms for what it asks (CivetWeb's
     * own limit); the deadline bounds the whole body, however it trickles in. */
    int late = 0;
    for (;;) {
        if (cl >= 0 && (long long)len >= cl) break;
        if (rk_time_now() >= deadline) {
            late = 1;
            break;
        }
        if (len + 1 >= cap) {
            if ((long long)len > max) break;
            cap *= 2;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                send_errorf(rc, 500, "out of memory");
                return -1;
            }
            buf = nb;
        }
        int n = mg_read(rc->conn, buf + len, cap - 1 - len);
        if (n <= 0) break;
        len += (size_t)n;
        if ((long long)len > max) break;
    }
    if ((long long)len > max || late || (cl >= 0 && (long long)len < cl)) {
        free(buf);
        mg_disable_connection_keep_alive(rc->conn);
        if ((long long)len > max)
            send_errorf(rc, 413, "the body is larger than %lld bytes", max);
        else if (late)
            send_errorf(rc, 408, "the body did not arrive within %g s (%zu bytes came)",
                        S->o.request_timeout_s, len);
        else
            send_errorf(rc, 400, "the body ended after %zu of %lld bytes", len, cl);
        return -1;
    }
    buf[len] = '\0';
    *out = buf;
    *out_len = len;
    return 0;
}

/* ---------------------------------------------------------------- model facts */

/* The service when ready, with the served name and chat template computed. */
static rk_service *ready_service(server *S) {
    if (rk_scheduler_get_state(S->engine, NULL, 0) != RK_SCHEDULER_READY) return NULL;
    rk_service *svc = rk_scheduler_service(S->engine);
    if (!svc) return NULL;
    pthread_mutex_lock(&S->info_mu);
    if (!S->have_info) {
        const rk_hparams *hp = rk_model_hparams(svc->model);
        if (hp->name[0]) {
            snprintf(S->model_name, sizeof S->model_name, "%s", hp->name);
        } else if (S->o.model[0]) {
            const char *b = strrchr(S->o.model, '/');
            snprintf(S->model_name, sizeof S->model_name, "%.255s", b ? b + 1 : S->o.model);
        } else {
            snprintf(S->model_name, sizeof S->model_name, "ragkv-embedded");
        }
        const char *jinja = NULL;
        const rk_gguf *g = rk_model_gguf(svc->model);
        if (g && rk_gguf_get_str(g, "tokenizer.chat_template", &jinja, NULL)) jinja = NULL;
        const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
        S->tmpl = rk_chat_template_detect(jinja, hp->arch_name,
                                          rk_tokenizer_find(tok, "<|start_header_id|>") >= 0);
        S->have_info = 1;
    }
    pthread_mutex_unlock(&S->info_mu);
    return svc;
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

static void send_not_ready(req_ctx *rc) {
    char msg[320];
    rk_scheduler_state st = rk_scheduler_get_state(rc->S->engine, msg, sizeof msg);
    if (atomic_load(&rc->S->stopping) || st == RK_SCHEDULER_STOPPING)
        send_errorf(rc, 503, "the server is shutting down");
    else if (st == RK_SCHEDULER_FAILED)
        send_errorf(rc, 503, "the model failed to load: %s", msg);
    else
        send_errorf(rc, 503, "the model is still loading");
}

/* ================================================================ generation */

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
    if (g->api.chat) {
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
            if (g->api.stream && !g->client_gone) stream_progress(g);
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
        rk_http_error e = {.status = status,
                           .type = rk_http_error_type(status),
                           .code = j->ran ? rk_http_error_code(j->status) : NULL};
        snprintf(e.message, sizeof e.message, "%.319s", msg);
        if (g->headers_sent) { /* mid-stream: an error event, then the end */
            sse_event(g, error_body(&e));
            write_all(g, "data: [DONE]\n\n", 14);
        } else if (!g->client_gone) {
            send_error(rc, &e);
        }
        return;
    }
    gt_feed(&g->text, j->req.out_tokens, j->req.n_out);
    if (g->text.stop_at >= 0 && g->text.stop_tokens < j->req.n_out)
        j->req.n_out = g->text.stop_tokens; /* usage, ids and logprobs end at the stop */
    log_generation(g);
    if (g->timed_out && !g->api.stream) {
        send_errorf(rc, 503, "the request ran longer than the timeout (%g s) and was cancelled",
                    rc->S->o.timeout_s);
        return;
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
    send_json(rc, 200, obj);
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
    if (!g->api.seed_given) g->api.opt.sampling.seed = fresh_random(S);
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

static int handle_generate(req_ctx *rc, int chat) {
    server *S = rc->S;
    double deadline = rc->t0 + S->o.timeout_s;
    char *body;
    size_t len;
    if (read_body(rc, &body, &len)) return 0;
    gen g;
    memset(&g, 0, sizeof g);
    g.rc = rc;
    g.text.stop_at = -1;
    g.svc = ready_service(S);
    if (S->o.log_prompts) /* the only place prompt text may reach the log */
        RK_LOG_INFO("id=%s body: %.*s", rc->id, (int)(len < 4000 ? len : 4000), body);
    if (!g.svc) {
        free(body);
        send_not_ready(rc);
        goto done;
    }
    prep_gen p = {.S = S, .g = &g, .body = body, .len = len, .chat = chat};
    prep_generation(&p);
    free(body);
    if (p.err.status) {
        send_error(rc, &p.err);
        goto done;
    }
    g.job->notify_tokens = g.api.stream || g.api.n_stop > 0;
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
            send_errorf(rc, 503, "%s; try again", rk_error_message());
        else
            send_not_ready(rc);
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
    rk_api_request_free(&g.api);
    return 0;
}

/* ================================================================ cache commands */

/* Run fn on the engine thread and wait (at most until the request timeout).
 * Returns the command's status (RK_ERR_EXHAUSTED when it never ran: queue
 * full, timeout, shutdown), with its message in msg. */
static rk_status run_command(req_ctx *rc, rk_scheduler_fn fn, void *ctx, int anytime, char *msg,
                             size_t cap) {
    server *S = rc->S;
    rk_job job;
    if (rk_job_init(&job)) return rk_errorf(RK_ERR_INTERNAL, "cannot create a job");
    job.fn = fn;
    job.fn_ctx = ctx;
    job.anytime = anytime;
    rk_status st = rk_scheduler_submit(S->engine, &job);
    if (st) {
        snprintf(msg, cap, "%s", rk_error_message());
        rk_job_destroy(&job);
        return RK_ERR_EXHAUSTED; /* queue full, loading or stopping: 503 */
    }
    int n, done = 0, timed_out = 0;
    while (!done)
        if (rk_job_wait(&job, 0, timed_out ? 0 : rc->t0 + S->o.timeout_s, &n, &done)) {
            timed_out = 1;
            rk_scheduler_cancel(S->engine, &job);
        }
    st = job.ran ? job.status : RK_ERR_EXHAUSTED;
    snprintf(msg, cap, "%s",
             job.ran                     ? job.error
             : atomic_load(&S->stopping) ? "the server is shutting down"
                                         : "the command was cancelled before it ran");
    rk_job_destroy(&job);
    return st;
}

static uint64_t kv_block_bytes(rk_service *svc) {
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    return 2ull * (uint64_t)kv->n_layers * (uint64_t)kv->block_size *
           rk_dtype_row_bytes(kv->dtype, (size_t)kv->n_kv_heads * (size_t)kv->head_dim);
}

/* One cached entry as JSON (engine thread: reads the index and metadata). */
static json_t *entry_json(rk_scheduler *e, rk_service *svc, const rk_chunk_entry *en) {
    char key[33];
    rk_chunk_key_hex(en->key, key);
    double last = 0;
    const char *id = rk_scheduler_chunk_meta(e, key, &last);
    return json_pack(
        "{s:s, s:s?, s:i, s:I, s:I, s:f, s:f, s:s, s:s, s:i, s:i}", "key", key, "id", id, "tokens",
        en->n_tokens, "bytes", (json_int_t)((uint64_t)en->n_blocks * kv_block_bytes(svc)), "hits",
        (json_int_t)en->hits, "created", en->created, "last_access", last > 0 ? last : en->created,
        "tier", "arena", "source", en->source, "refs", en->refs, "base_pos", en->base_pos);
}

/* One store row as JSON (the disk tier). */
static json_t *disk_entry_json(const rk_store_entry *r) {
    return json_pack("{s:s, s:s?, s:i, s:I, s:I, s:f, s:f, s:s, s:s}", "key", r->key, "id",
                     r->doc_id[0] ? r->doc_id : NULL, "tokens", r->n_tokens, "bytes",
                     (json_int_t)r->n_bytes, "hits", (json_int_t)r->hits, "created", r->created,
                     "last_access", r->last_access, "tier", "disk", "policy", r->policy);
}

typedef struct list_cmd {
    int by_hits, limit, offset, disk;
    const rk_chunk_entry **v;
    int n, cap, oom;
    json_t *out;
} list_cmd;

static int collect(void *ctx, const rk_chunk_entry *en) {
    list_cmd *l = ctx;
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 256;
        const rk_chunk_entry **v = realloc(l->v, (size_t)cap * sizeof *v);
        if (!v) {
            l->oom = 1;
            return 1;
        }
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = en;
    return 0;
}

static void sort_by_hits(const rk_chunk_entry **v, int n) {
    /* Stable insertion-merge: a bottom-up merge sort keeps recency order among ties. */
    const rk_chunk_entry **tmp = malloc((size_t)(n ? n : 1) * sizeof *tmp);
    if (!tmp) return;
    for (int w = 1; w < n; w *= 2)
        for (int lo = 0; lo < n; lo += 2 * w) {
            int mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            int i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = v[j]->hits > v[i]->hits ? v[j++] : v[i++];
            while (i < mid) tmp[k++] = v[i++];
            while (j < hi) tmp[k++] = v[j++];
            memcpy(v + lo, tmp + lo, (size_t)(hi - lo) * sizeof *v);
        }
    free(tmp);
}

/* The disk tier's rows (the store sorts and pages them). */
static rk_status list_disk(list_cmd *l, rk_service *svc) {
    rk_store_entry *rows = NULL;
    int n = 0;
    rk_store_counters sc;
    rk_status st = rk_store_stats(svc->store, &sc);
    if (!st)
        st = rk_store_list(svc->store, l->by_hits ? RK_STORE_SORT_HITS : RK_STORE_SORT_RECENT,
                           l->limit, l->offset, &rows, &n);
    if (st) return st;
    json_t *data = json_array();
    for (int i = 0; i < n && data; i++) json_array_append_new(data, disk_entry_json(&rows[i]));
    free(rows);
    l->out = json_pack("{s:s, s:o, s:I, s:i, s:i, s:s, s:s}", "object", "list", "data", data,
                       "total", (json_int_t)sc.rows, "offset", l->offset, "limit", l->limit, "sort",
                       l->by_hits ? "hits" : "recent", "tier", "disk");
    return l->out ? RK_OK : rk_errorf(RK_ERR_NOMEM, "out of memory");
}

static rk_status list_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    list_cmd *l = ctx;
    if (l->disk) return list_disk(l, svc);
    rk_chunk_index_foreach(svc->chunks, collect, l);
    if (l->oom) return rk_errorf(RK_ERR_NOMEM, "out of memory");
    if (l->by_hits) sort_by_hits(l->v, l->n);
    json_t *data = json_array();
    for (int i = l->offset; i < l->n && i < l->offset + l->limit && data; i++)
        json_array_append_new(data, entry_json(e, svc, l->v[i]));
    l->out = json_pack("{s:s, s:o, s:i, s:i, s:i, s:s, s:s}", "object", "list", "data", data,
                       "total", l->n, "offset", l->offset, "limit", l->limit, "sort",
                       l->by_hits ? "hits" : "recent", "tier", "arena");
    return l->out ? RK_OK : rk_errorf(RK_ERR_NOMEM, "out of memory");
}

typedef struct key_cmd {
    rk_chunk_key key;
    char hex[33];
    json_t *out;
    int in_arena, on_disk; /* what a delete removed */
} key_cmd;

static rk_status get_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    key_cmd *k = ctx;
    rk_chunk_entry *en = rk_chunk_index_find(svc->chunks, k->key);
    int on_disk = 0;
    if (svc->store) rk_store_contains(svc->store, k->hex, &on_disk);
    if (en) {
        k->out = entry_json(e, svc, en);
        if (k->out && svc->store) json_object_set_new(k->out, "on_disk", json_boolean(on_disk));
    } else if (on_disk) {
        rk_store_entry row;
        if (rk_store_lookup(svc->store, k->hex, &row) == RK_OK) k->out = disk_entry_json(&row);
    }
    if (!k->out && !en && !on_disk)
        return rk_errorf(RK_ERR_NOT_FOUND, "no cached chunk has the key %s", k->hex);
    return k->out ? RK_OK : rk_errorf(RK_ERR_NOMEM, "out of memory");
}

/* Remove a chunk from the arena and from the store. */
static rk_status delete_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    key_cmd *k = ctx;
    rk_status st = rk_chunk_index_remove(svc->chunks, k->key);
    if (st == RK_ERR_BUSY)
        return rk_errorf(st, "the chunk %s is in use by a request in flight; try again", k->hex);
    if (st && st != RK_ERR_NOT_FOUND) return st;
    k->in_arena = st == RK_OK;
    if (k->in_arena) rk_scheduler_count_removed(e, 1, 0);
    if (svc->store) {
        rk_status ds = rk_store_delete(svc->store, k->hex);
        if (ds && ds != RK_ERR_NOT_FOUND) return ds;
        k->on_disk = ds == RK_OK;
    }
    if (!k->in_arena && !k->on_disk)
        return rk_errorf(RK_ERR_NOT_FOUND, "no cached chunk has the key %s", k->hex);
    return RK_OK;
}

typedef struct flush_cmd {
    rk_flush_request req;
    int chunks;
    uint64_t prefix_nodes, prefix_tokens, disk_rows;
} flush_cmd;

static rk_status flush_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    flush_cmd *f = ctx;
    if (f->req.chunks) f->chunks = rk_chunk_index_flush(svc->chunks);
    if (f->req.prefix && svc->prefix) {
        rk_radix_stats a, b;
        rk_radix_get_stats(svc->prefix, &a);
        rk_radix_flush(svc->prefix);
        rk_radix_get_stats(svc->prefix, &b);
        f->prefix_nodes = b.evictions - a.evictions;
        f->prefix_tokens = b.tokens_evicted - a.tokens_evicted;
    }
    rk_scheduler_count_removed(e, (uint64_t)f->chunks, f->prefix_nodes);
    if (f->req.disk && svc->store) return rk_store_flush(svc->store, &f->disk_rows);
    return RK_OK;
}

typedef struct prewarm_cmd {
    /* The isolated context: the pipeline's own pre-warm, which also checks
     * the disk tier and writes to it (persist). */
    rk_prewarm_item *items; /* (n) or NULL */
    int persist;
    /* The system context: one request per chunk, computing and generating nothing. */
    rk_request **reqs; /* (n) NULL where the chunk failed before running */
    rk_run_result *res;
    int n;
    char **ids;
} prewarm_cmd;

static rk_status prewarm_fn(void *ctx, rk_scheduler *e, rk_service *svc) {
    prewarm_cmd *p = ctx;
    if (p->items) {
        rk_status st = rk_pipeline_prewarm(svc, p->items, p->n, p->persist);
        for (int i = 0; i < p->n; i++)
            if (p->items[i].key[0] && strcmp(p->items[i].status, "failed"))
                rk_scheduler_chunk_touch(e, p->items[i].key, p->ids[i]);
        return st;
    }
    rk_request **run = malloc((size_t)p->n * sizeof *run);
    rk_run_result *res = malloc((size_t)p->n * sizeof *res);
    if (!run || !res) {
        free(run);
        free(res);
        return rk_errorf(RK_ERR_NOMEM, "out of memory");
    }
    int m = 0;
    for (int i = 0; i < p->n; i++)
        if (p->reqs[i]) run[m++] = p->reqs[i];
    rk_scheduler_run(e, run, m, res);
    for (int i = 0, k = 0; i < p->n; i++) {
        if (!p->reqs[i]) continue;
        p->res[i] = res[k++];
        if (p->res[i].status == RK_OK && p->reqs[i]->chunk_reports[0].key[0])
            rk_scheduler_chunk_touch(e, p->reqs[i]->chunk_reports[0].key, p->ids[i]);
    }
    free(run);
    free(res);
    return RK_OK;
}

/* A request that computes one chunk and generates nothing. */
static rk_status prewarm_request(rk_service *svc, const int32_t *sys, int n_sys, const char *text,
                                 int context_system, rk_request **out) {
    *out = NULL;
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int32_t *ids = NULL;
    size_t n = 0;
    rk_status st = rk_tokenizer_encode(tok, text, strlen(text), 0, &ids, &n);
    if (st) return st;
    if (n == 0) {
        free(ids);
        return rk_errorf(RK_ERR_INVALID, "the chunk tokenizes to nothing");
    }
    if ((long)n > svc->cfg.max_chunk_tokens) {
        free(ids);
        return rk_errorf(RK_ERR_LIMIT, "the chunk has %zu tokens; at most %d are allowed", n,
                         svc->cfg.max_chunk_tokens);
    }
    long ctx_limit =
        svc->cfg.max_context > 0 ? svc->cfg.max_context : rk_model_hparams(svc->model)->n_ctx;
    if ((long)n + n_sys > ctx_limit) {
        free(ids);
        return rk_errorf(RK_ERR_LIMIT, "the chunk needs %ld tokens of context; the limit is %ld",
                         (long)n + n_sys, ctx_limit);
    }
    rk_request *r = calloc(1, sizeof *r);
    if (!r) {
        free(ids);
        return rk_errorf(RK_ERR_NOMEM, "out of memory");
    }
    rk_req_options_default(&r->opt);
    r->opt.max_tokens = 0;
    r->opt.chunk_context = context_system ? RK_CONTEXT_SYSTEM : RK_CONTEXT_ISOLATED;
    r->opt.prefix_cache = context_system;
    r->sys = malloc((size_t)(n_sys + 1) * sizeof *r->sys);
    r->chunks = calloc(1, sizeof *r->chunks);
    r->chunk_lens = calloc(1, sizeof *r->chunk_lens);
    r->out_tokens = malloc(sizeof *r->out_tokens);
    r->logprobs = malloc(sizeof *r->logprobs);
    r->chunk_reports = calloc(1, sizeof *r->chunk_reports);
    if (!r->sys || !r->chunks || !r->chunk_lens || !r->out_tokens || !r->logprobs ||
        !r->chunk_reports) {
        free(ids);
        rk_request_free(r);
        free(r);
        return rk_errorf(RK_ERR_NOMEM, "out of memory");
    }
    if (n_sys) memcpy(r->sys, sys, (size_t)n_sys * sizeof *sys);
    r->n_sys = n_sys;
    r->chunks[0] = ids;
    r->chunk_lens[0] = (int)n;
    r->n_chunks = 1;
    *out = r;
    return RK_OK;
}

typedef struct prep_pw {
    rk_service *svc;
    const char *body;
    size_t len;
    rk_prewarm_request pw;
    prewarm_cmd cmd;
    rk_http_error err; /* status 0: prepared */
} prep_pw;

/* Parse the body and tokenize every chunk (on a big stack). */
static void prep_prewarm(void *arg) {
    prep_pw *p = arg;
    rk_service *svc = p->svc;
    if (rk_prewarm_parse(p->body, p->len, &p->pw, &p->err)) return;
    if (p->pw.persist && !svc->store && !svc->redis) {
        rk_http_errorf(&p->err, 501,
                       "persistence is not configured: start the server with --store DIR "
                       "or --redis URL");
        return;
    }
    p->cmd.n = p->pw.n;
    p->cmd.ids = p->pw.ids;
    if (!p->pw.context_system) { /* the engine tokenizes and looks up */
        p->cmd.persist = p->pw.persist;
        p->cmd.items = calloc((size_t)p->pw.n, sizeof *p->cmd.items);
        if (!p->cmd.items) {
            rk_http_errorf(&p->err, 500, "out of memory");
            return;
        }
        for (int i = 0; i < p->pw.n; i++)
            p->cmd.items[i] = (rk_prewarm_item){
                .text = p->pw.texts[i], .len = strlen(p->pw.texts[i]), .doc_id = p->pw.ids[i]};
        return;
    }
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int bos = rk_tokenizer_add_bos(tok) && rk_tokenizer_bos(tok) >= 0;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    rk_error_clear();
    rk_status st = RK_OK;
    if (p->pw.context_system && *p->pw.system &&
        (st = rk_tokenizer_encode(tok, p->pw.system, strlen(p->pw.system), 1, &ids, &n_ids))) {
        rk_http_errorf(&p->err, rk_http_status_of(st), "system: %s", rk_error_message());
        return;
    }
    int32_t *sys = malloc((n_ids + 1) * sizeof *sys);
    p->cmd.n = p->pw.n;
    p->cmd.ids = p->pw.ids;
    p->cmd.reqs = calloc((size_t)p->pw.n, sizeof *p->cmd.reqs);
    p->cmd.res = calloc((size_t)p->pw.n, sizeof *p->cmd.res);
    if (!sys || !p->cmd.reqs || !p->cmd.res) {
        free(ids);
        free(sys);
        rk_http_errorf(&p->err, 500, "out of memory");
        return;
    }
    if (bos) sys[0] = rk_tokenizer_bos(tok);
    if (n_ids) memcpy(sys + bos, ids, n_ids * sizeof *sys);
    free(ids);
    for (int i = 0; i < p->pw.n; i++) {
        rk_error_clear();
        rk_status cs = prewarm_request(svc, sys, (int)n_ids + bos, p->pw.texts[i],
                                       p->pw.context_system, &p->cmd.reqs[i]);
        if (cs) {
            p->cmd.res[i].status = cs;
            snprintf(p->cmd.res[i].error, sizeof p->cmd.res[i].error, "%s", rk_error_message());
        }
    }
    free(sys);
}

static int handle_prewarm(req_ctx *rc) {
    server *S = rc->S;
    char *body;
    size_t len;
    if (read_body(rc, &body, &len)) return 0;
    prep_pw p;
    memset(&p, 0, sizeof p);
    p.svc = ready_service(S);
    p.body = body;
    p.len = len;
    if (!p.svc) {
        send_not_ready(rc);
        goto done;
    }
    prep_prewarm(&p);
    if (p.err.status) {
        send_error(rc, &p.err);
        goto done;
    }
    char msg[320];
    rk_status st = run_command(rc, prewarm_fn, &p.cmd, 0, msg, sizeof msg);
    if (st) {
        send_errorf(rc, rk_http_status_of(st), "%s", msg);
        goto done;
    }
    json_t *data = json_array();
    int computed = 0, cached = 0, failed = 0;
    for (int i = 0; i < p.pw.n && data; i++) {
        const char *status = "failed", *key = NULL, *tier = NULL, *error = NULL;
        int tokens = 0;
        if (p.cmd.items) { /* isolated: the pipeline's pre-warm */
            rk_prewarm_item *it = &p.cmd.items[i];
            status = it->status ? it->status : "failed";
            key = it->key[0] ? it->key : NULL;
            tier = strcmp(status, "failed") ? it->tier : NULL;
            error = strcmp(status, "failed") ? NULL : it->error;
            tokens = it->tokens;
        } else { /* system context: one request per chunk */
            rk_request *r = p.cmd.reqs[i];
            if (p.cmd.res[i].status == RK_OK && r) {
                status = r->chunk_reports[0].status == RK_CHUNK_STATUS_HIT ? "cached" : "computed";
                tier = r->chunk_reports[0].source == RK_CHUNK_SOURCE_DISK ? "disk" : "arena";
            } else {
                error = p.cmd.res[i].error;
            }
            key = r && r->chunk_reports[0].key[0] ? r->chunk_reports[0].key : NULL;
            tokens = r ? r->chunk_lens[0] : 0;
        }
        computed += !strcmp(status, "computed");
        cached += !strcmp(status, "cached");
        failed += !strcmp(status, "failed");
        json_array_append_new(data, json_pack("{s:i, s:s?, s:s?, s:i, s:s, s:s?, s:s?}", "index", i,
                                              "id", p.pw.ids[i], "key", key, "tokens", tokens,
                                              "status", status, "tier", tier, "error", error));
    }
    snprintf(rc->detail, sizeof rc->detail, " chunks=%d computed=%d cached=%d failed=%d", p.pw.n,
             computed, cached, failed);
    send_json(rc, 200,
              json_pack("{s:s, s:o, s:i, s:i, s:i}", "object", "list", "data", data, "computed",
                        computed, "cached", cached, "failed", failed));
done:
    free(body);
    if (p.cmd.reqs)
        for (int i = 0; i < p.cmd.n; i++) {
            rk_request_free(p.cmd.reqs[i]);
            free(p.cmd.reqs[i]);
        }
    free(p.cmd.reqs);
    free(p.cmd.res);
    free(p.cmd.items);
    rk_prewarm_request_free(&p.pw);
    return 0;
}

/* Query parameter as an integer in [lo, hi]; def when absent. -1 on a bad value. */
static int query_int(const char *qs, const char *name, long lo, long hi, long def, long *out) {
    char buf[32];
    *out = def;
    if (!qs) return 0;
    int n = mg_get_var(qs, strlen(qs), name, buf, sizeof buf);
    if (n == -1) return 0;
    if (n < 0) return -1;
    char *end;
    errno = 0;
    long v = strtol(buf, &end, 10);
    if (errno || end == buf || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

/* The shared tier's entries, in SCAN order, listed on this thread: the tier
 * opens a connection of its own, so the engine is never held up by a SCAN. */
static void list_redis(req_ctx *rc, const list_cmd *l) {
    if (!rc->S->o.cfg.redis_url[0]) {
        send_errorf(rc, 501,
                    "the shared tier is not configured: start the server with --redis URL");
        return;
    }
    rk_service *svc = ready_service(rc->S);
    if (!svc) {
        send_not_ready(rc);
        return;
    }
    if (l->by_hits) {
        send_errorf(rc, 400, "the redis tier is listed in SCAN order: 'sort' must be recent");
        return;
    }
    rk_redis_entry *v = NULL;
    int n = 0;
    if (rk_redis_list(svc->redis, l->offset + l->limit, &v, &n)) {
        send_errorf(rc, 503, "%s", rk_error_message());
        return;
    }
    json_t *data = json_array();
    for (int i = l->offset; i < n && data; i++)
        json_array_append_new(data,
                              json_pack("{s:s, s:i, s:I, s:f, s:s}", "key", v[i].key, "tokens",
                                        v[i].n_tokens, "bytes", (json_int_t)v[i].n_bytes, "created",
                                        v[i].created, "tier", "redis"));
    free(v);
    /* SCAN has no count: total is what was seen, offset + limit at most. */
    send_json(rc, 200,
              json_pack("{s:s, s:o, s:i, s:i, s:i, s:s, s:s}", "object", "list", "data", data,
                        "total", n, "offset", l->offset, "limit", l->limit, "sort", "scan", "tier",
                        "redis"));
}

static int handle_list(req_ctx *rc) {
    const struct mg_request_info *ri = mg_get_request_info(rc->conn);
    const char *qs = ri->query_string;
    long limit, offset;
    if (query_int(qs, "limit", 1, 100000, 100, &limit))
        return send_errorf(rc, 400, "'limit' must be an integer from 1 to 100000"), 0;
    if (query_int(qs, "offset", 0, 1L << 30, 0, &offset))
        return send_errorf(rc, 400, "'offset' must be a non-negative integer"), 0;
    list_cmd l = {.limit = (int)limit, .offset = (int)offset};
    char sort[16] = "recent";
    int sn = qs ? mg_get_var(qs, strlen(qs), "sort", sort, sizeof sort) : -1;
    if (sn == -1)
        snprintf(sort, sizeof sort, "recent");
    else if (sn < 0)
        return send_errorf(rc, 400, "'sort' must be hits or recent"), 0;
    if (!strcmp(sort, "hits"))
        l.by_hits = 1;
    else if (strcmp(sort, "recent") != 0)
        return send_errorf(rc, 400, "'sort' must be hits or recent"), 0;
    char tier[16] = "arena";
    int tn = qs ? mg_get_var(qs, strlen(qs), "tier", tier, sizeof tier) : -1;
    if (tn == -1) snprintf(tier, sizeof tier, "arena");
    if (tn < -1 || (strcmp(tier, "arena") && strcmp(tier, "disk") && strcmp(tier, "redis")))
        return send_errorf(rc, 400, "'tier' must be arena, disk or redis"), 0;
    if (!strcmp(tier, "redis")) return list_redis(rc, &l), 0;
    l.disk = !strcmp(tier, "disk");
    if (l.disk && !rc->S->o.cfg.store_dir[0])
        return send_errorf(rc, 501,
                           "persistence is not configured: start the server with "
                           "--store DIR"),
               0;
    if (!ready_service(rc->S)) return send_not_ready(rc), 0;
    char msg[320];
    rk_status st = run_command(rc, list_fn, &l, 1, msg, sizeof msg);
    free(l.v);
    if (st) {
        json_decref(l.out);
        return send_errorf(rc, rk_http_status_of(st), "%s", msg), 0;
    }
    send_json(rc, 200, l.out);
    return 0;
}

static int handle_chunk_key(req_ctx *rc, const char *hex, int del) {
    key_cmd k = {0};
    if (strlen(hex) != 32 || rk_chunk_key_parse(hex, &k.key))
        return send_errorf(rc, 400, "a chunk key is 32 lowercase hexadecimal digits"), 0;
    rk_chunk_key_hex(k.key, k.hex);
    if (!ready_service(rc->S)) return send_not_ready(rc), 0;
    char msg[320];
    rk_status st = run_command(rc, del ? delete_fn : get_fn, &k, 1, msg, sizeof msg);
    if (st) {
        json_decref(k.out);
        int status = st == RK_ERR_BUSY ? 409 : rk_http_status_of(st);
        return send_errorf(rc, status, "%s", msg), 0;
    }
    if (del)
        send_json(rc, 200,
                  json_pack("{s:s, s:b, s:b, s:b}", "key", k.hex, "deleted", 1, "arena", k.in_arena,
                            "disk", k.on_disk));
    else
        send_json(rc, 200, k.out);
    return 0;
}

static int handle_flush(req_ctx *rc) {
    char *body;
    size_t len;
    if (read_body(rc, &body, &len)) return 0;
    flush_cmd f = {0};
    rk_http_error err = {0};
    rk_status st = rk_flush_parse(body, len, &f.req, &err);
    free(body);
    if (st) return send_error(rc, &err), 0;
    if (f.req.disk && !rc->S->o.cfg.store_dir[0])
        return send_errorf(rc, 501,
                           "persistence is not configured: start the server with "
                           "--store DIR"),
               0;
    if (f.req.redis && !rc->S->o.cfg.redis_url[0])
        return send_errorf(rc, 501,
                           "the shared tier is not configured: start the server with --redis URL"),
               0;
    rk_service *svc = ready_service(rc->S);
    if (!svc) return send_not_ready(rc), 0;
    char msg[320];
    if ((st = run_command(rc, flush_fn, &f, 1, msg, sizeof msg)))
        return send_errorf(rc, rk_http_status_of(st), "%s", msg), 0;
    /* The shared tier on this thread (its own connection): a SCAN over many
     * keys must not hold the engine up. Other models' keys are kept. */
    uint64_t redis_keys = 0;
    if (f.req.redis && rk_redis_flush(svc->redis, &redis_keys))
        return send_errorf(rc, 503, "%s", rk_error_message()), 0;
    send_json(rc, 200,
              json_pack("{s:{s:i, s:I, s:I, s:I, s:I}}", "flushed", "chunks", f.chunks,
                        "prefix_nodes", (json_int_t)f.prefix_nodes, "prefix_tokens",
                        (json_int_t)f.prefix_tokens, "disk_rows", (json_int_t)f.disk_rows,
                        "redis_keys", (json_int_t)redis_keys));
    return 0;
}

/* ================================================================ small routes */

static int handle_health(req_ctx *rc) {
    char msg[320];
    rk_scheduler_state st = rk_scheduler_get_state(rc->S->engine, msg, sizeof msg);
    if (st == RK_SCHEDULER_READY && !atomic_load(&rc->S->stopping)) {
        send_json(rc, 200, json_pack("{s:s}", "status", "ok"));
        return 0;
    }
    const char *what = atomic_load(&rc->S->stopping) || st == RK_SCHEDULER_STOPPING ? "stopping"
                       : st == RK_SCHEDULER_FAILED                                  ? "failed"
                                                                                    : "loading";
    char m[400];
    snprintf(m, sizeof m, "%s%s%s",
             !strcmp(what, "loading")    ? "the model is still loading"
             : !strcmp(what, "stopping") ? "the server is shutting down"
                                         : "the model failed to load",
             st == RK_SCHEDULER_FAILED ? ": " : "", st == RK_SCHEDULER_FAILED ? msg : "");
    send_json(rc, 503,
              json_pack("{s:s, s:{s:i, s:s, s:s}}", "status", what, "error", "code", 503, "type",
                        "overloaded", "message", m));
    return 0;
}

static int handle_models(req_ctx *rc) {
    server *S = rc->S;
    rk_service *svc = ready_service(S);
    if (!svc) return send_not_ready(rc), 0;
    const rk_hparams *hp = rk_model_hparams(svc->model);
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    json_t *info = json_pack(
        "{s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:s, s:s, s:i, s:i, s:s}",
        "fingerprint", rk_model_fingerprint(svc->model), "architecture", hp->arch_name, "n_layers",
        hp->n_layers, "dim", hp->dim, "n_heads", hp->n_heads, "n_kv_heads", hp->n_kv_heads,
        "head_dim", hp->head_dim, "ffn_dim", hp->ffn_dim, "n_vocab", hp->n_vocab, "n_ctx",
        hp->n_ctx, "rope_theta", (double)hp->rope.theta, "weight_type", rk_dtype_name(hp->wtype),
        "chat_template", rk_chat_template_name(S->tmpl), "block_size", svc->cfg.block_size, "bos",
        rk_tokenizer_bos(tok), "source", S->o.model[0] ? S->o.model : "embedded");
    json_t *m =
        json_pack("{s:s, s:s, s:I, s:s, s:o}", "id", S->model_name, "object", "model", "created",
                  (json_int_t)S->started_unix, "owned_by", "ragkv", "ragkv", info);
    send_json(rc, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", m));
    return 0;
}

/* The Redis tier's live counters into the stats about to be served. */
static void refresh_redis_stats(server *S) {
    rk_service *svc = ready_service(S);
    if (!svc || !svc->redis) return;
    rk_redis_counters c;
    rk_redis_stats(svc->redis, &c);
    rk_stats_publish_redis(S->stats, &c);
}

static int handle_stats(req_ctx *rc) {
    if (!ready_service(rc->S)) return send_not_ready(rc), 0;
    refresh_redis_stats(rc->S);
    send_json(rc, 200, rk_stats_json(rc->S->stats));
    return 0;
}

static int handle_metrics(req_ctx *rc) {
    refresh_redis_stats(rc->S);
    char *text = rk_stats_prometheus(rc->S->stats);
    if (!text) return send_errorf(rc, 500, "out of memory"), 0;
    send_text(rc, 200, "text/plain; version=0.0.4; charset=utf-8", text, strlen(text), NULL);
    free(text);
    return 0;
}

/* ================================================================ routing */

/* Constant-time comparison of a presented key with the expected one. */
static int key_equal(const char *given, const char *want) {
    size_t a = strlen(given), b = strlen(want);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < b; i++)
        diff |= (unsigned char)(i < a ? given[i] : 0) ^ (unsigned char)want[i];
    return diff == 0;
}

/* 0 when the request may go on; otherwise a 401 was sent. */
static int authorize(req_ctx *rc, int admin) {
    const serve_opts *o = &rc->S->o;
    const char *need1 = admin && o->admin_key[0] ? o->admin_key : o->api_key;
    const char *need2 = !admin && o->admin_key[0] ? o->admin_key : NULL;
    if (!need1[0]) return 0;
    /* The scheme is case-insensitive and ends at white space (RFC 7235). */
    const char *h = mg_get_header(rc->conn, "Authorization");
    const char *given = NULL;
    if (h && !strncasecmp(h, "Bearer", 6) && (h[6] == ' ' || h[6] == '\t'))
        for (given = h + 6; *given == ' ' || *given == '\t';) given++;
    if (given && (key_equal(given, need1) || (need2 && key_equal(given, need2)))) return 0;
    send_errorf(rc, 401, "%s",
                !given                     ? "missing `Authorization: Bearer KEY`"
                : admin && o->admin_key[0] ? "this route needs the admin key"
                                           : "wrong API key");
    return -1;
}

typedef enum route {
    R_NONE,
    R_HEALTH,
    R_METRICS,
    R_MODELS,
    R_COMPLETIONS,
    R_CHAT,
    R_CHUNKS,
    R_CHUNK_KEY,
    R_FLUSH,
    R_STATS
} route;

static route find_route(const char *path) {
    static const struct {
        const char *path;
        route r;
    } table[] = {{"/health", R_HEALTH},
                 {"/metrics", R_METRICS},
                 {"/v1/models", R_MODELS},
                 {"/v1/completions", R_COMPLETIONS},
                 {"/v1/chat/completions", R_CHAT},
                 {"/v1/chunks", R_CHUNKS},
                 {"/v1/cache/flush", R_FLUSH},
                 {"/v1/stats", R_STATS}};
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (!strcmp(path, table[i].path)) return table[i].r;
    if (!strncmp(path, "/v1/chunks/", 11) && path[11] && !strchr(path + 11, '/'))
        return R_CHUNK_KEY;
    return R_NONE;
}

static int dispatch(req_ctx *rc) {
    const char *m = rc->method;
    int get = !strcmp(m, "GET") || rc->head, post = !strcmp(m, "POST");
    int del = !strcmp(m, "DELETE");
    route r = find_route(rc->path);
    if (r == R_NONE) return send_errorf(rc, 404, "no route %s %s", m, rc->path), 0;
    int ok = r == R_COMPLETIONS || r == R_CHAT || r == R_FLUSH ? post
             : r == R_CHUNKS                                   ? get || post
             : r == R_CHUNK_KEY                                ? get || del
                                                               : get;
    if (!ok) return send_errorf(rc, 405, "%s is not allowed on %s", m, rc->path), 0;
    if (r == R_HEALTH) return handle_health(rc);
    int admin = r == R_FLUSH || (r == R_CHUNK_KEY && del);
    if (authorize(rc, admin)) return 0;
    if (atomic_load(&rc->S->stopping) && r != R_METRICS && r != R_STATS)
        return send_errorf(rc, 503, "the server is shutting down"), 0;
    switch (r) {
    case R_METRICS: return handle_metrics(rc);
    case R_MODELS: return handle_models(rc);
    case R_COMPLETIONS: return handle_generate(rc, 0);
    case R_CHAT: return handle_generate(rc, 1);
    case R_CHUNKS: return post ? handle_prewarm(rc) : handle_list(rc);
    case R_CHUNK_KEY: return handle_chunk_key(rc, rc->path + 11, del);
    case R_FLUSH: return handle_flush(rc);
    case R_STATS: return handle_stats(rc);
    default: return 0;
    }
}

/* ---------------------------------------------------------------- big stacks */

/* CivetWeb's worker threads have 100 KiB stacks (fixed when the library was
 * built), too little for parsing and tokenizing (jansson recursion, the
 * tokenizer, PCRE2's JIT stack) and, under AddressSanitizer, even for
 * CivetWeb's own header printing. So each request is handled on a
 * short-lived helper thread with a large stack while the CivetWeb worker
 * waits for it; the connection is used by one thread at a time. */
typedef struct big_call {
    void (*fn)(void *);
    void *arg;
} big_call;

static void *big_trampoline(void *p) {
    big_call *c = p;
    c->fn(c->arg);
    return NULL;
}

/* Run fn(arg) on a thread with a 4 MiB stack and wait. Returns -1 when no
 * thread could be started (fn did not run). */
static int run_big_stack(void (*fn)(void *), void *arg) {
    pthread_attr_t a;
    if (pthread_attr_init(&a)) return -1;
    pthread_attr_setstacksize(&a, 4u << 20);
    pthread_t t;
    big_call c = {fn, arg};
    int rc = pthread_create(&t, &a, big_trampoline, &c);
    pthread_attr_destroy(&a);
    if (rc) return -1;
    pthread_join(t, NULL);
    return 0;
}

/* An error answered before (or instead of) routing, on CivetWeb's own
 * thread, in the JSON shape; the connection is closed after it. Kept small:
 * that thread's stack is. */
static void send_bare_error(struct mg_connection *conn, int status, const char *message) {
    rk_http_error e = {.status = status, .type = rk_http_error_type(status)};
    snprintf(e.message, sizeof e.message, "%s", message);
    json_t *j = error_body(&e);
    char *body = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    const struct mg_request_info *ri = mg_get_request_info(conn);
    int head = ri && ri->request_method && !strcmp(ri->request_method, "HEAD");
    size_t len = body ? strlen(body) : 0;
    char hdr[256];
    int n = snprintf(hdr, sizeof hdr,
                     "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: "
                     "%zu\r\n%sConnection: close\r\n\r\n",
                     status, mg_get_response_code_text(conn, status), len,
                     status == 503 ? "Retry-After: 1\r\n" : "");
    mg_disable_connection_keep_alive(conn);
    if (n > 0 && (size_t)n < sizeof hdr) mg_write(conn, hdr, (size_t)n);
    if (len && !head) mg_write(conn, body, len);
    free(body);
}

static void serve_one(void *arg) {
    struct mg_connection *conn = arg;
    server *S = mg_get_user_data(mg_get_context(conn));
    const struct mg_request_info *ri = mg_get_request_info(conn);
    /* CivetWeb leaves the path encoded (decode_url no): decoded here, where
     * an encoded NUL byte, which would cut the path short, is refused. */
    const char *raw = ri->local_uri ? ri->local_uri : "/";
    size_t raw_len = strlen(raw);
    char *path = malloc(raw_len + 1);
    if (!path) {
        send_bare_error(conn, 500, "out of memory");
        mg_set_user_connection_data(conn, (void *)(intptr_t)500);
        return;
    }
    int path_len = mg_url_decode(raw, (int)raw_len, path, (int)raw_len + 1, 0);
    req_ctx rc = {.S = S,
                  .conn = conn,
                  .method = ri->request_method ? ri->request_method : "?",
                  .path = path,
                  .t0 = rk_time_now()};
    rc.head = !strcmp(rc.method, "HEAD");
    uint64_t rnd = fresh_random(S);
    snprintf(rc.id, sizeof rc.id, "req-%016llx", (unsigned long long)rnd);
    atomic_fetch_add(&S->in_flight, 1);
    rk_stats_in_flight(S->stats, 1);
    if (path_len < 0 || (size_t)path_len != strlen(path))
        send_errorf(&rc, 400, "the path holds an encoded NUL byte (%%00)");
    else
        dispatch(&rc);
    rk_stats_in_flight(S->stats, -1);
    atomic_fetch_sub(&S->in_flight, 1);
    int quiet = !strcmp(rc.path, "/health") || !strcmp(rc.path, "/metrics");
    if (!quiet) rk_stats_record_status(S->stats, rc.status);
    rk_log(quiet ? RK_LOG_DEBUG : RK_LOG_INFO, "request", "id=%s %s %s status=%d ms=%.2f%s", rc.id,
           rc.method, rc.path, rc.status, (rk_time_now() - rc.t0) * 1e3, rc.detail);
    free(path);
    mg_set_user_connection_data(conn, (void *)(intptr_t)(rc.status > 0 ? rc.status : 500));
}

/* CivetWeb runs more connection threads than requests may be handled at
 * once (rk_serve_main), so that idle and slow clients, which hold a thread
 * each until request_timeout_s, cannot take the ones requests need. A
 * request beyond request_slots is refused at once; /health and /metrics are
 * never counted, so probes answer under any load. */
static int handle_request(struct mg_connection *conn) {
    server *S = mg_get_user_data(mg_get_context(conn));
    const struct mg_request_info *ri = mg_get_request_info(conn);
    const char *uri = ri->local_uri ? ri->local_uri : "";
    int counted = strcmp(uri, "/health") && strcmp(uri, "/metrics");
    if (counted && atomic_fetch_add(&S->admitted, 1) >= S->request_slots) {
        atomic_fetch_sub(&S->admitted, 1);
        send_bare_error(conn, 503, "every request slot is busy (http_threads); try again");
        return 503;
    }
    int status = 503;
    if (run_big_stack(serve_one, conn) == 0) {
        intptr_t st = (intptr_t)mg_get_user_connection_data(conn);
        status = st > 0 ? (int)st : 500;
    } else {
        send_bare_error(conn, 503, "cannot start a request thread");
    }
    mg_set_user_connection_data(conn, NULL);
    if (counted) atomic_fetch_sub(&S->admitted, 1);
    return status;
}

/* CivetWeb's own refusals (a malformed or oversized request, an unknown
 * method, an unsupported HTTP version), in the service's JSON error shape. */
static int civet_error(struct mg_connection *conn, int status, const char *message) {
    send_bare_error(conn, status, message && *message ? message : "the request was refused");
    return 0;
}

static int civet_log(const struct mg_connection *conn, const char *message) {
    (void)conn;
    RK_LOG_WARN("civetweb: %s", message);
    return 1;
}

/* ================================================================ main */

/* CivetWeb's listening thread polls with a 2 s timeout and notices mg_stop
 * only then; a connection to the listening port wakes it at once. */
typedef struct poker {
    int port;
    atomic_int done;
} poker;

static void *poke_listener(void *arg) {
    poker *p = arg;
    while (!atomic_load(&p->done)) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd >= 0) {
            struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)p->port)};
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            (void)connect(fd, (struct sockaddr *)&a, sizeof a);
            close(fd);
        }
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* mg_stop, woken quickly when the server listens on a loopback-reachable port. */
static void stop_civetweb(struct mg_context *ctx, int port, const char *host) {
    poker p = {.port = port};
    pthread_t t;
    int poke =
        port > 0 &&
        (!strcmp(host, "127.0.0.1") || !strcmp(host, "0.0.0.0") || !strcmp(host, "localhost")) &&
        pthread_create(&t, NULL, poke_listener, &p) == 0;
    mg_stop(ctx);
    if (poke) {
        atomic_store(&p.done, 1);
        pthread_join(t, NULL);
    }
}

static const char *k_usage =
    "usage: ragkv serve [--model F.gguf] [--config F.json] [--host H] [--port P] [options]\n"
    "Serve the HTTP API (docs/api.md). Settings come from defaults, then the --config\n"
    "file (JSON, keys as named in --print-config), then RAGKV_<NAME> environment\n"
    "variables, then flags.\n";

/* The one option of `ragkv serve` that is not a setting. */
enum { O_PRINT_CONFIG = 1 };

static rk_status on_serve_option(void *ctx, int val, const char *arg) {
    (void)arg;
    if (val == O_PRINT_CONFIG) *(int *)ctx = 1;
    return RK_OK;
}

/* Parse flags over defaults, config file and environment (every table reads
 * all three). Returns -1 to exit with status *out_exit. */
static int parse_args(int argc, char **argv, serve_opts *o, int *print_config, int *out_exit) {
    static const struct option extra[] = {{"print-config", no_argument, 0, O_PRINT_CONFIG},
                                          {0, 0, 0, 0}};
    rk_settings tabs[N_TABLES];
    opts_defaults(o);
    bind_settings(o, tabs);
    rk_cmdline cl = {.cmd = "serve",
                     .usage = k_usage,
                     .tabs = tabs,
                     .n_tabs = N_TABLES,
                     .n_shared = N_TABLES,
                     .extra = extra,
                     .extra_help =
                         "  --print-config        print the effective settings as JSON and exit\n",
                     .on_extra = on_serve_option,
                     .ctx = print_config,
                     .first = 1};
    int next = rk_cmdline_parse(&cl, argc, argv, out_exit);
    if (next < 0) return -1;
    *out_exit = EXIT_USAGE;
    if (next < argc) {
        fprintf(stderr, "ragkv serve: unexpected argument '%s' (see ragkv serve --help)\n",
                argv[next]);
        return -1;
    }
    if (rk_log_level_parse(o->log_level) < 0) {
        fprintf(stderr, "ragkv serve: log_level must be debug, info, warn or error, got '%s'\n",
                o->log_level);
        return -1;
    }
    if (rk_config_validate(&o->cfg)) {
        fprintf(stderr, "ragkv serve: %s\n", rk_error_message());
        return -1;
    }
    return 0;
}

/* Wait until no request is being handled, for at most seconds. */
static void wait_requests_done(server *S, double seconds) {
    double until = rk_time_now() + seconds;
    while (atomic_load(&S->in_flight) > 0 && rk_time_now() < until) {
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* The scheduler's statistics hooks, into the server's rk_stats. */
static void publish_stats(void *ctx, const rk_cache_snapshot *snap) { rk_stats_publish(ctx, snap); }
static void record_request(void *ctx, const rk_request *r) { rk_stats_record_request(ctx, r); }

/* --print-config: the effective settings as JSON on stdout; the exit code. */
static int print_settings(serve_opts *o) {
    rk_settings tabs[N_TABLES];
    bind_settings(o, tabs);
    json_t *j = rk_settings_json(tabs, N_TABLES);
    rk_kv_plan kv; /* the KV sizes resolved against the model and this machine */
    if (j && rk_kv_plan_for_model(&o->cfg, o->model[0] ? o->model : NULL, &kv) == RK_OK)
        json_object_set_new(j, "kv_resolved", rk_kv_plan_json(&kv));
    else if (j)
        fprintf(stderr, "ragkv serve: KV sizes not resolved: %s\n", rk_error_message());
    char *s =
        j ? json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(7)) : NULL;
    json_decref(j);
    if (s) puts(s);
    free(s);
    return s ? 0 : EXIT_FAILURE;
}

/* Start CivetWeb on o's host and port and say where it listens; *out_port
 * gets the port bound (o's, or the one chosen for port 0). */
static rk_status start_http(server *S, int *out_port) {
    const serve_opts *o = &S->o;
    char ports[320], threads[16], request_ms[24], keep_alive_ms[24];
    int colon = strchr(o->host, ':') != NULL; /* IPv6 literal */
    snprintf(ports, sizeof ports, "%s%s%s:%d", colon ? "[" : "", o->host, colon ? "]" : "",
             o->port);
    int nt = o->http_threads > 0 ? o->http_threads : o->queue + 16;
    S->request_slots = nt < 4 ? 4 : nt > 4096 ? 4096 : nt;
    /* CivetWeb serves each connection on one thread of its own, from the
     * request line to the close, waiting or not. Four threads more per
     * request slot let 4 x http_threads idle or slow connections be held
     * while requests are still served; each is dropped after
     * request_timeout_s, which bounds the headers, every read and every
     * write, or after keep_alive_ms between two requests. */
    snprintf(threads, sizeof threads, "%d", 5 * S->request_slots);
    long rt_ms = (long)(o->request_timeout_s * 1000 + 0.5);
    snprintf(request_ms, sizeof request_ms, "%ld", rt_ms);
    snprintf(keep_alive_ms, sizeof keep_alive_ms, "%ld", rt_ms < 5000 ? rt_ms : 5000);
    const char *mg_opts[] = {"listening_ports", ports, "num_threads", threads, "request_timeout_ms",
                             request_ms, "enable_keep_alive", "yes", "keep_alive_timeout_ms",
                             keep_alive_ms,
                             /* serve_one decodes the path and refuses %00 */
                             "decode_url", "no",
                             /* an absolute URI naming this port is served, whatever host it
                              * names (keys, not CivetWeb's domains, guard the routes) */
                             "enable_auth_domain_check", "no", NULL};
    struct mg_callbacks cb;
    memset(&cb, 0, sizeof cb);
    cb.begin_request = handle_request;
    cb.log_message = civet_log;
    cb.http_error = civet_error;
    mg_init_library(0);
    S->ctx = mg_start(&cb, S, mg_opts);
    if (!S->ctx) {
        mg_exit_library();
        return rk_errorf(RK_ERR_IO, "cannot listen on %s (in use, or not a local address?)", ports);
    }
    struct mg_server_port sp[4];
    int n_ports = mg_get_server_ports(S->ctx, 4, sp);
    *out_port = n_ports > 0 ? sp[0].port : o->port;
    fprintf(stderr, "ragkv: listening on http://%s%s%s:%d\n", colon ? "[" : "", o->host,
            colon ? "]" : "", *out_port);
    fflush(stderr);
    return RK_OK;
}

/* Wait for SIGINT or SIGTERM, watching the model load: 0, or EXIT_FAILURE
 * when the model could not be loaded. */
static int wait_for_signal(server *S, sigset_t *sigs) {
    rk_scheduler_state last = RK_SCHEDULER_LOADING;
    for (;;) {
        struct timespec tick = {0, 100 * 1000 * 1000};
        int sig = sigtimedwait(sigs, NULL, &tick);
        if (sig == SIGINT || sig == SIGTERM) {
            RK_LOG_INFO("signal %d: shutting down", sig);
            return 0;
        }
        char msg[320];
        rk_scheduler_state st = rk_scheduler_get_state(S->engine, msg, sizeof msg);
        if (st != last && st == RK_SCHEDULER_READY) {
            rk_service *svc = ready_service(S);
            char kv[512];
            if (svc) rk_kv_plan_describe(&svc->kv, kv, sizeof kv);
            if (svc) fprintf(stderr, "ragkv: %s\n", kv);
            RK_LOG_INFO("model ready: %s (chat template %s)", S->model_name,
                        rk_chat_template_name(S->tmpl));
        }
        if (st == RK_SCHEDULER_FAILED) {
            fprintf(stderr, "ragkv serve: cannot start: %s\n", msg);
            return EXIT_FAILURE;
        }
        last = st;
    }
}

/* Shutdown: refuse new work (503), give in-flight requests the grace
 * period, then cancel the rest: a running generation stops at its next
 * step and its stream ends with a final event ("cancelled", with usage)
 * and [DONE]; a queued one is answered 503. Their handlers write that
 * before CivetWeb stops, as its stop flag ends every read and write; a
 * client that does not read is given up after request_timeout_s. */
static void shut_down(server *S, int port) {
    atomic_store(&S->stopping, 1);
    wait_requests_done(S, S->o.grace_s);
    rk_scheduler_cancel_all(S->engine);
    wait_requests_done(S, S->o.request_timeout_s + 2);
    stop_civetweb(S->ctx, port, S->o.host);
    rk_scheduler_free(S->engine);
    S->engine = NULL;
    mg_exit_library();
    RK_LOG_INFO("stopped");
}

int rk_serve_main(int argc, char **argv) {
    server *S = calloc(1, sizeof *S);
    if (!S) {
        fprintf(stderr, "ragkv serve: out of memory\n");
        return EXIT_FAILURE;
    }
    int print_config = 0, exit_code = 0;
    if (parse_args(argc, argv, &S->o, &print_config, &exit_code)) {
        free(S);
        return exit_code;
    }
    serve_opts *o = &S->o;
    if (print_config) {
        exit_code = print_settings(o);
        free(S);
        return exit_code;
    }
    rk_log_set_level((rk_log_level)rk_log_level_parse(o->log_level));

    /* Signals: every thread created from here on blocks them; main waits for them. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    pthread_mutex_init(&S->info_mu, NULL);
    S->started_unix = (double)time(NULL);
    int rc = EXIT_FAILURE, port;
    rk_status st = rk_stats_create(&S->stats);
    rk_scheduler_params ep = {.cfg = o->cfg,
                              .model_path = o->model[0] ? o->model : NULL,
                              .max_queue = o->queue,
                              .max_batch = o->max_batch,
                              .load_delay_s = o->load_delay_s,
                              .token_delay_s = o->token_delay_s,
                              .publish = publish_stats,
                              .record_request = record_request,
                              .stats_ctx = S->stats};
    if (!st) st = rk_scheduler_start(&ep, &S->engine);
    if (!st && (st = start_http(S, &port))) rk_scheduler_free(S->engine);
    if (st) {
        fprintf(stderr, "ragkv serve: %s\n", rk_error_message());
    } else {
        rc = wait_for_signal(S, &sigs);
        shut_down(S, port);
    }
    rk_stats_free(S->stats);
    pthread_mutex_destroy(&S->info_mu);
    free(S);
    return rc;
}
