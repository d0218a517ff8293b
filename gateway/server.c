/* gateway/server.c — the HTTP service's frame: CivetWeb set-up, routing,
 * authentication, limits, the small routes (health, models, stats,
 * metrics), and shutdown. The generation routes are in generate.c, the chunk
 * and cache routes in chunks.c, the responses every route sends and the body
 * reader in respond.c.
 *
 * Threads: CivetWeb's workers run handle_request(), which hands the request
 * to a thread with a large stack (serve_one) and waits. The owner's thread
 * watches the model load (rk_server_poll) and shuts down (rk_server_stop):
 * new requests get 503, in-flight ones have a grace period, then are
 * cancelled and write their last answer (a stream's final event, a queued
 * request's 503); CivetWeb is stopped (joining its workers), then the
 * engine. */
#include <arpa/inet.h>
#include <civetweb.h>
#include <jansson.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "engine/gguf.h"
#include "engine/tokenizer.h"
#include "gateway/http.h"
#include "gateway/responses.h"

/* ================================================================ small routes */

/* The server's state for the probes: "ok" (serving), "loading", "stopping"
 * (from the moment SIGTERM arrives) or "failed" (msg says why). */
static const char *probe_state(server *S, char *msg, size_t cap) {
    rk_scheduler_state st = rk_scheduler_get_state(S->engine, msg, cap);
    if (atomic_load(&S->stopping) || st == RK_SCHEDULER_STOPPING) return "stopping";
    return st == RK_SCHEDULER_READY ? "ok" : st == RK_SCHEDULER_FAILED ? "failed" : "loading";
}

/* GET /health (ready 0): 200 while the process is alive, loading or
 * draining included, so that a liveness probe never kills a server that is
 * loading its model or finishing its requests; 503 only when the model
 * failed to load. GET /ready (ready 1): 200 when requests are served, 503
 * while loading and from the moment SIGTERM arrives, so that a load
 * balancer sends new work elsewhere. */
static int handle_probe(req_ctx *rc, int ready) {
    char msg[320];
    const char *what = probe_state(rc->S, msg, sizeof msg);
    int serving = !strcmp(what, "ok");
    if (serving || (!ready && strcmp(what, "failed"))) {
        rk_gw_send_json(rc, 200, json_pack("{s:s}", "status", what));
        return 0;
    }
    char m[400];
    snprintf(m, sizeof m, "%s%s%s",
             !strcmp(what, "loading")    ? "the model is still loading"
             : !strcmp(what, "stopping") ? "the server is shutting down"
                                         : "the model failed to load",
             !strcmp(what, "failed") ? ": " : "", !strcmp(what, "failed") ? msg : "");
    rk_http_error e = {.status = 503, .type = rk_http_error_type(503)};
    snprintf(e.message, sizeof e.message, "%.319s", m);
    json_t *body = rk_gw_error_body(&e);
    json_object_set_new(body, "status", json_string(what));
    rk_gw_send_json(rc, 503, body);
    return 0;
}

/* GET /v1/models, or GET /v1/models/{id} (id non-NULL): the served model. */
static int handle_models(req_ctx *rc, const char *id) {
    server *S = rc->S;
    rk_service *svc = rk_gw_ready_service(S);
    if (!svc) return rk_gw_send_not_ready(rc), 0;
    if (id && !rk_gw_model_matches(S, svc, id)) {
        rk_http_error e;
        rk_http_errorf(&e, 404, "model \"%.200s\" is not served here; this server serves \"%s\"",
                       id, S->model_name);
        e.code = "model_not_found";
        rk_gw_send_error(rc, &e);
        return 0;
    }
    const rk_hparams *hp = rk_model_hparams(svc->model);
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    /* The file's name, never its path: where the host keeps it is not the
     * client's business. */
    const char *file = strrchr(S->o.model, '/');
    file = file ? file + 1 : S->o.model;
    json_t *info = json_pack(
        "{s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:s, s:s, s:i, s:i, s:s}",
        "fingerprint", rk_model_fingerprint(svc->model), "architecture", hp->arch_name, "n_layers",
        hp->n_layers, "n_kv_layers", hp->n_kv_layers, "dim", hp->dim, "n_heads", hp->n_heads,
        "n_kv_heads", hp->n_kv_heads, "head_dim", hp->head_dim, "ffn_dim", hp->ffn_dim, "n_vocab",
        hp->n_vocab, "n_ctx", hp->n_ctx, "rope_theta", (double)hp->rope.theta, "weight_type",
        rk_dtype_name(hp->wtype), "chat_template", rk_chat_template_name(S->tmpl), "block_size",
        svc->cfg.block_size, "bos", rk_tokenizer_bos(tok), "source", file[0] ? file : "embedded");
    /* A model completes unless its file declares a pooling type (an
     * embedding or reranking model); one with a pooling type (its file's or
     * --pooling) makes embeddings, one with rank pooling and a
     * classification head reranks. */
    json_t *caps = json_array();
    rk_pooling pooling = rk_service_pooling(svc);
    if (caps && rk_service_generates(svc)) json_array_append_new(caps, json_string("completion"));
    if (caps && pooling != RK_POOLING_NONE && pooling != RK_POOLING_RANK)
        json_array_append_new(caps, json_string("embedding"));
    if (caps && pooling == RK_POOLING_RANK && rk_service_can_rerank(svc))
        json_array_append_new(caps, json_string("rerank"));
    rk_error_clear();
    json_t *m = json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", S->model_name, "object", "model",
                          "created", (json_int_t)S->started_unix, "owned_by", "ragkv",
                          "capabilities", caps, "ragkv", info);
    if (id)
        rk_gw_send_json(rc, 200, m);
    else
        rk_gw_send_json(rc, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", m));
    return 0;
}

/* The Redis tier's live counters into the stats about to be served. */
static void refresh_redis_stats(server *S) {
    rk_service *svc = rk_gw_ready_service(S);
    if (!svc || !svc->redis) return;
    rk_redis_counters c;
    rk_redis_stats(svc->redis, &c);
    rk_stats_publish_redis(S->stats, &c);
}

static int handle_stats(req_ctx *rc) {
    if (!rk_gw_ready_service(rc->S)) return rk_gw_send_not_ready(rc), 0;
    refresh_redis_stats(rc->S);
    json_t *doc = rk_stats_json_for(rc->S->stats, rc->sees_all, rc->tenant);
    /* The requests in flight are the others: this one does not count itself. */
    json_t *in_flight = json_object_get(json_object_get(doc, "requests"), "in_flight");
    if (json_integer_value(in_flight) > 0)
        json_integer_set(in_flight, json_integer_value(in_flight) - 1);
    /* The snapshot's top chunks are everyone's ten: a tenant gets its own
     * ten from the engine (the snapshot's, filtered, if it cannot answer). */
    json_t *top = doc && !rc->sees_all ? rk_gw_top_chunks(rc) : NULL;
    if (top) json_object_set_new(doc, "top_chunks", top);
    rk_gw_send_json(rc, 200, doc);
    return 0;
}

static int handle_metrics(req_ctx *rc) {
    refresh_redis_stats(rc->S);
    char *text = rk_stats_prometheus(rc->S->stats);
    if (!text) return rk_gw_send_errorf(rc, 500, "out of memory"), 0;
    rk_gw_send_text(rc, 200, "text/plain; version=0.0.4; charset=utf-8", text, strlen(text), NULL);
    free(text);
    return 0;
}

/* ================================================================ routing */

/* Which keys may call a route. */
typedef enum route_access {
    ACCESS_USER = 0,     /* the user key, a tenant key or the admin key */
    ACCESS_ADMIN = 1,    /* the admin key (the user key while none is set) */
    ACCESS_DELETE = 2,   /* as ACCESS_ADMIN, or a tenant key (its own chunks) */
    ACCESS_OPERATOR = 3, /* as ACCESS_USER but no tenant key (/metrics: every tenant's counters) */
} route_access;

/* 0 when the request may go on, with rc->tenant and rc->sees_all set;
 * otherwise a 401 was sent. Every configured key is compared, in constant
 * time, whatever matches. */
static int authorize(req_ctx *rc, route_access need) {
    const rk_server_options *o = &rc->S->o;
    const rk_tenants *tn = rc->S->tenants;
    /* The scheme is case-insensitive and ends at white space (RFC 7235). */
    const char *h = mg_get_header(rc->conn, "Authorization");
    const char *given = NULL;
    if (h && !strncasecmp(h, "Bearer", 6) && (h[6] == ' ' || h[6] == '\t'))
        for (given = h + 6; *given == ' ' || *given == '\t';) given++;
    int is_admin = given && o->admin_key[0] && rk_key_equal(given, o->admin_key);
    int is_user = given && o->api_key[0] && rk_key_equal(given, o->api_key);
    int tenant = given && tn ? rk_tenants_find(tn, given) : 0;
    /* Without a keys file every caller sees every chunk, as with one key. */
    rc->sees_all = is_admin || !tn;
    rc->tenant = tenant;
    const char *admin_need = o->admin_key[0] ? o->admin_key : o->api_key;
    int admin_ok = admin_need[0] ? (o->admin_key[0] ? is_admin : is_user) : !tn;
    int user_ok = is_admin || is_user || (!o->api_key[0] && !tn);
    int ok = need == ACCESS_USER       ? user_ok || tenant
             : need == ACCESS_OPERATOR ? user_ok
             : need == ACCESS_ADMIN    ? admin_ok
                                       : admin_ok || tenant;
    if (ok) return 0;
    rk_gw_send_errorf(
        rc, 401, "%s",
        !given                              ? "missing `Authorization: Bearer KEY`"
        : need == ACCESS_OPERATOR && tenant ? "this route needs the user or the admin key"
        : need != ACCESS_USER && (o->admin_key[0] || tenant) ? "this route needs the admin key"
                                                             : "wrong API key");
    return -1;
}

typedef enum route {
    R_NONE,
    R_HEALTH,
    R_READY,
    R_METRICS,
    R_MODELS,
    R_COMPLETIONS,
    R_CHAT,
    R_CHUNKS,
    R_CHUNK_KEY,
    R_FLUSH,
    R_STATS,
    R_MODEL_ID,
    R_TOKENIZE,
    R_DETOKENIZE,
    R_APPLY_TEMPLATE,
    R_EMBEDDINGS,
    R_RERANK,
    R_RESPONSES,
    R_RESPONSE_ID,
    R_RESPONSE_ITEMS
} route;

static route find_route(const char *path) {
    static const struct {
        const char *path;
        route r;
    } table[] = {{"/health", R_HEALTH},
                 {"/ready", R_READY},
                 {"/metrics", R_METRICS},
                 {"/v1/models", R_MODELS},
                 {"/v1/completions", R_COMPLETIONS},
                 {"/v1/chat/completions", R_CHAT},
                 {"/v1/chunks", R_CHUNKS},
                 {"/v1/cache/flush", R_FLUSH},
                 {"/v1/stats", R_STATS},
                 {"/tokenize", R_TOKENIZE},
                 {"/detokenize", R_DETOKENIZE},
                 {"/apply-template", R_APPLY_TEMPLATE},
                 {"/v1/embeddings", R_EMBEDDINGS},
                 {"/v1/rerank", R_RERANK},
                 {"/rerank", R_RERANK},
                 {"/v1/responses", R_RESPONSES}};
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (!strcmp(path, table[i].path)) return table[i].r;
    if (!strncmp(path, "/v1/chunks/", 11) && path[11] && !strchr(path + 11, '/'))
        return R_CHUNK_KEY;
    if (!strncmp(path, "/v1/models/", 11) && path[11]) return R_MODEL_ID;
    if (!strncmp(path, "/v1/responses/", 14) && path[14] && path[14] != '/') {
        const char *slash = strchr(path + 14, '/');
        if (!slash) return R_RESPONSE_ID;
        if (!strcmp(slash, "/input_items")) return R_RESPONSE_ITEMS;
    }
    return R_NONE;
}

/* The routes that take POST alone. */
static int post_only(route r) {
    return r == R_COMPLETIONS || r == R_CHAT || r == R_FLUSH || r == R_TOKENIZE ||
           r == R_DETOKENIZE || r == R_APPLY_TEMPLATE || r == R_EMBEDDINGS || r == R_RERANK ||
           r == R_RESPONSES;
}

/* A CORS preflight (OPTIONS with cors_origin set): 204 with what the route
 * allows; browsers send no credentials with it, so no key is asked. */
static int handle_preflight(req_ctx *rc, route r) {
    struct mg_connection *c = rc->conn;
    const char *asked = mg_get_header(c, "Access-Control-Request-Headers");
    const char *methods = r == R_CHUNKS        ? "GET, HEAD, POST, OPTIONS"
                          : r == R_CHUNK_KEY   ? "GET, HEAD, DELETE, OPTIONS"
                          : post_only(r)       ? "POST, OPTIONS"
                          : r == R_RESPONSE_ID ? "GET, HEAD, DELETE, OPTIONS"
                                               : "GET, HEAD, OPTIONS";
    rc->status = 204;
    mg_response_header_start(c, 204);
    rk_gw_add_cors_headers(rc);
    mg_response_header_add(c, "Access-Control-Allow-Methods", methods, -1);
    mg_response_header_add(c, "Access-Control-Allow-Headers",
                           asked && *asked ? asked : "Authorization, Content-Type", -1);
    mg_response_header_add(c, "Access-Control-Max-Age", "86400", -1);
    mg_response_header_add(c, "Content-Length", "0", -1);
    mg_response_header_add(c, "X-Request-Id", rc->id, -1);
    mg_response_header_send(c);
    return 0;
}

static int dispatch(req_ctx *rc) {
    const char *m = rc->method;
    int get = !strcmp(m, "GET") || rc->head, post = !strcmp(m, "POST");
    int del = !strcmp(m, "DELETE");
    route r = find_route(rc->path);
    if (r == R_NONE) return rk_gw_send_errorf(rc, 404, "no route %s %s", m, rc->path), 0;
    if (!strcmp(m, "OPTIONS") && rc->S->o.cors_origin[0]) return handle_preflight(rc, r);
    int ok = post_only(r)                             ? post
             : r == R_CHUNKS                          ? get || post
             : r == R_CHUNK_KEY || r == R_RESPONSE_ID ? get || del
                                                      : get;
    if (!ok) return rk_gw_send_errorf(rc, 405, "%s is not allowed on %s", m, rc->path), 0;
    if (r == R_HEALTH || r == R_READY) return handle_probe(rc, r == R_READY);
    route_access need = r == R_FLUSH              ? ACCESS_ADMIN
                        : r == R_CHUNK_KEY && del ? ACCESS_DELETE
                        : r == R_METRICS          ? ACCESS_OPERATOR
                                                  : ACCESS_USER;
    if (authorize(rc, need)) return 0;
    if (atomic_load(&rc->S->stopping) && r != R_METRICS && r != R_STATS)
        return rk_gw_send_errorf(rc, 503, "the server is shutting down"), 0;
    switch (r) {
    case R_METRICS: return handle_metrics(rc);
    case R_MODELS: return handle_models(rc, NULL);
    case R_MODEL_ID: return handle_models(rc, rc->path + 11);
    case R_TOKENIZE: return rk_gw_handle_tokenize(rc, 0);
    case R_DETOKENIZE: return rk_gw_handle_tokenize(rc, 1);
    case R_APPLY_TEMPLATE: return rk_gw_handle_apply_template(rc);
    case R_EMBEDDINGS: return rk_gw_handle_embeddings(rc);
    case R_RERANK: return rk_gw_handle_rerank(rc);
    case R_RESPONSES: return rk_gw_handle_responses(rc, NULL, 0);
    case R_RESPONSE_ID:
    case R_RESPONSE_ITEMS: return rk_gw_handle_responses(rc, rc->path + 14, del);
    case R_COMPLETIONS: return rk_gw_handle_generate(rc, 0);
    case R_CHAT: return rk_gw_handle_generate(rc, 1);
    case R_CHUNKS: return post ? rk_gw_handle_prewarm(rc) : rk_gw_handle_list(rc);
    case R_CHUNK_KEY: return rk_gw_handle_chunk_key(rc, rc->path + 11, del);
    case R_FLUSH: return rk_gw_handle_flush(rc);
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
int rk_gw_run_big_stack(void (*fn)(void *), void *arg) {
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
    json_t *j = rk_gw_error_body(&e);
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

/* One request handed to serve_one, the status it answered, and whether it
 * still holds a request slot. */
typedef struct one_call {
    struct mg_connection *conn;
    int status;
    int holds_slot;
} one_call;

static void serve_one(void *arg) {
    one_call *call = arg;
    struct mg_connection *conn = call->conn;
    server *S = mg_get_user_data(mg_get_context(conn));
    const struct mg_request_info *ri = mg_get_request_info(conn);
    /* CivetWeb leaves the path encoded (decode_url no): decoded here, where
     * an encoded NUL byte, which would cut the path short, is refused. */
    const char *raw = ri->local_uri ? ri->local_uri : "/";
    size_t raw_len = strlen(raw);
    char *path = malloc(raw_len + 1);
    if (!path) {
        send_bare_error(conn, 500, "out of memory");
        call->status = 500;
        return;
    }
    int path_len = mg_url_decode(raw, (int)raw_len, path, (int)raw_len + 1, 0);
    req_ctx rc = {.S = S,
                  .conn = conn,
                  .method = ri->request_method ? ri->request_method : "?",
                  .path = path,
                  .t0 = rk_time_now(),
                  .holds_slot = call->holds_slot};
    rc.head = !strcmp(rc.method, "HEAD");
    const char *expect = mg_get_header(conn, "Expect");
    rc.expect_continue = expect && !strcasecmp(expect, "100-continue");
    uint64_t rnd = rk_gw_random(S);
    snprintf(rc.id, sizeof rc.id, "req-%016llx", (unsigned long long)rnd);
    atomic_fetch_add(&S->in_flight, 1);
    rk_stats_in_flight(S->stats, 1);
    if (path_len < 0 || (size_t)path_len != strlen(path))
        rk_gw_send_errorf(&rc, 400, "the path holds an encoded NUL byte (%%00)");
    else
        dispatch(&rc);
    rk_stats_in_flight(S->stats, -1);
    atomic_fetch_sub(&S->in_flight, 1);
    int quiet =
        !strcmp(rc.path, "/health") || !strcmp(rc.path, "/ready") || !strcmp(rc.path, "/metrics");
    if (!quiet) rk_stats_record_status(S->stats, rc.status);
    const char *tenant = rk_tenants_name(S->tenants, rc.tenant); /* the name, never the key */
    rk_log(quiet ? RK_LOG_DEBUG : RK_LOG_INFO, "request", "id=%s %s %s status=%d ms=%.2f%s%s%s",
           rc.id, rc.method, rc.path, rc.status, (rk_time_now() - rc.t0) * 1e3, rc.detail,
           tenant ? " tenant=" : "", tenant ? tenant : "");
    free(path);
    call->status = rc.status > 0 ? rc.status : 500;
    call->holds_slot = rc.holds_slot;
}

/* CivetWeb parses the request line and headers in place, turning each line
 * end, the colon after a name and the white space before it into NUL bytes,
 * and stops without a word at the 64th header or at a line it cannot read
 * (one that starts with white space, a colon or a byte above 126): the
 * lines after it are dropped unseen, and a Content-Length among them with
 * them. What it left in its buffer shows both. Every line must end in CRLF:
 * then the next header's name starts two bytes after a value's end, and
 * after the last value come the two NULs of its line end, the CR of the
 * empty line and the NUL CivetWeb wrote over that line's LF. Those bytes lie
 * in the header block, except where its last line ends in a bare LF: then
 * the two read past the block's last NUL lie in the rest of CivetWeb's
 * request buffer (never beyond it but for a block that fills it to its last
 * byte), and whatever they hold the request is refused or, as CivetWeb read
 * it whole, served.
 *
 * Fills h (MG_MAX_HEADERS) from ri and returns NULL, or why the header
 * block is refused (400). */
static const char *read_header_lines(const struct mg_request_info *ri, rk_gw_header *h) {
    int n = ri->num_headers;
    const char *prev_end = ri->http_version ? ri->http_version + strlen(ri->http_version) : NULL;
    for (int i = 0; i < n; i++) {
        const char *name = ri->http_headers[i].name, *value = ri->http_headers[i].value;
        if (!name || !value) return "a header line could not be read";
        size_t len = strlen(name);
        /* "Name :": CivetWeb wrote NULs over the blank and the colon. */
        h[i] = (rk_gw_header){.name = name,
                              .value = value,
                              .space_before_colon = value > name + len + 1 && !name[len + 1]};
        if (prev_end && name != prev_end + 2) return "header lines must end in CRLF and not fold";
        prev_end = value + strlen(value);
    }
    if (!prev_end) return NULL;
    if (n == 0) /* "HTTP/1.0" CR LF CR, all three blanked, and the final NUL */
        return prev_end[0] || prev_end[1] || prev_end[2] || prev_end[3]
                   ? "header lines must end in CRLF; a line that starts with white space, a "
                     "colon or a byte above 126 is not a header"
                   : NULL;
    if (prev_end[0] || prev_end[1] || prev_end[2] != '\r' || prev_end[3])
        return "header lines must end in CRLF; a line that starts with white space, a colon or "
               "a byte above 126 is not a header";
    return NULL;
}

/* The request's framing (framing.c), refused before anything is read of its
 * body: NULL, or why, with the status in *status (400, 417 or 431). */
static const char *framing_error(const struct mg_request_info *ri, rk_gw_framing *f, int *status) {
    rk_gw_header h[MG_MAX_HEADERS];
    *status = 400;
    const char *bad = ri->num_headers < MG_MAX_HEADERS ? read_header_lines(ri, h) : NULL;
    if (bad) return bad;
    if (ri->num_headers >= MG_MAX_HEADERS) memset(h, 0, sizeof h);
    if (!rk_gw_framing_check(h, ri->num_headers, MG_MAX_HEADERS, ri->http_version, f)) return NULL;
    *status = f->status;
    return f->message;
}

/* CivetWeb runs more connection threads than requests may be handled at
 * once (start_http), so that idle and slow clients, which hold a thread
 * each until a deadline ends them, cannot take the ones requests need. A
 * request beyond request_slots is refused at once; so is one on a
 * connection its address opened beyond max_connections_per_ip. /health,
 * /ready and /metrics are never refused by either limit, so probes answer under any
 * load. The connection's header deadline is off while a request is handled
 * and armed again for the next request on it. */
static int handle_request(struct mg_connection *conn) {
    server *S = mg_get_user_data(mg_get_context(conn));
    const struct mg_request_info *ri = mg_get_request_info(conn);
    const char *uri = ri->local_uri ? ri->local_uri : "";
    if (!atomic_load(&S->ri_offset))
        atomic_store(&S->ri_offset, (long)((const char *)ri - (const char *)conn));
    rk_gw_conn_state *cs = mg_get_user_connection_data(conn);
    if (cs) { /* the headers are in */
        rk_gw_watchdog_disarm(S->watchdog, cs->ticket);
        cs->ticket = 0;
    }
    rk_gw_framing f;
    int refused;
    const char *bad = framing_error(ri, &f, &refused);
    if (bad) { /* send_bare_error closes the connection */
        RK_LOG_DEBUG("request from %s refused (%d): %s", ri->remote_addr, refused, bad);
        send_bare_error(conn, refused, bad);
        return refused;
    }
    int probe = !strcmp(uri, "/health") || !strcmp(uri, "/ready") || !strcmp(uri, "/metrics");
    if (!probe && cs && cs->over_limit) {
        RK_LOG_DEBUG("request from %s refused (max_connections_per_ip %d)", ri->remote_addr,
                     S->conns_per_ip);
        send_bare_error(conn, 503,
                        "this address has max_connections_per_ip connections open; close some "
                        "and try again");
        return 503;
    }
    /* A request with a body takes its slot once the body is in
     * (rk_gw_read_body): a body on its way holds none. */
    int has_body = ri->content_length > 0 || mg_get_header(conn, "Transfer-Encoding");
    int takes_slot = !probe && !has_body;
    if (takes_slot && atomic_fetch_add(&S->admitted, 1) >= S->request_slots) {
        atomic_fetch_sub(&S->admitted, 1);
        send_bare_error(conn, 503, "every request slot is busy (http_threads); try again");
        return 503;
    }
    one_call call = {.conn = conn, .status = 500, .holds_slot = takes_slot};
    int status = 503;
    if (rk_gw_run_big_stack(serve_one, &call) == 0)
        status = call.status;
    else
        send_bare_error(conn, 503, "cannot start a request thread");
    if (call.holds_slot) atomic_fetch_sub(&S->admitted, 1);
    if (cs) /* the next request on this connection, if it stays open */
        cs->ticket = rk_gw_watchdog_arm(S->watchdog, cs->fd, rk_time_now() + S->header_timeout_s);
    return status;
}

/* A new connection, as a connection thread takes it: its socket found, its
 * header deadline armed, and, with max_connections_per_ip set, counted
 * against its address; one beyond the limit is marked, and each of its
 * requests but the probes is answered 503 (handle_request). Its address is
 * known before any request is read: CivetWeb fills it in before this
 * callback but hands out its request_info only once a request was read, so
 * it is reached at the offset a request showed (start_http makes one at
 * once; before that, nothing is kept). */
static int conn_opened(const struct mg_connection *conn, void **conn_data) {
    server *S = mg_get_user_data(mg_get_context(conn));
    long off = atomic_load(&S->ri_offset);
    if (!off) return 0;
    const struct mg_request_info *ri = (const void *)((const char *)conn + off);
    if (!ri->remote_addr[0]) return 0;
    rk_gw_conn_state *cs = calloc(1, sizeof *cs);
    if (!cs) return 0;
    cs->fd = rk_gw_conn_fd(ri);
    if (S->conns_per_ip > 0) {
        cs->counted = 1;
        int n = rk_gw_conns_add(S->conns, ri->remote_addr, 1);
        cs->over_limit = n > S->conns_per_ip;
    }
    cs->ticket = rk_gw_watchdog_arm(S->watchdog, cs->fd, rk_time_now() + S->header_timeout_s);
    *conn_data = cs;
    return 0;
}

/* Before CivetWeb closes the socket: the deadline disarmed, the count
 * taken off, the state freed. */
static void conn_closed(const struct mg_connection *conn) {
    server *S = mg_get_user_data(mg_get_context(conn));
    rk_gw_conn_state *cs = mg_get_user_connection_data(conn);
    if (!cs) return;
    rk_gw_watchdog_disarm(S->watchdog, cs->ticket);
    const struct mg_request_info *ri = mg_get_request_info(conn);
    if (cs->counted && ri) rk_gw_conns_add(S->conns, ri->remote_addr, -1);
    free(cs);
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
/* One GET /health to the server itself, so that handle_request learns
 * where CivetWeb keeps a connection's request_info (conn_opened reads the
 * client's address there before any request). Best effort: without it the
 * first request from anywhere teaches the same. */
static void learn_request_offset(server *S, int port) {
    const char *h = S->o.host;
    int v6 = strchr(h, ':') != NULL;
    struct sockaddr_storage a;
    memset(&a, 0, sizeof a);
    socklen_t len;
    if (v6) {
        struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&a;
        s6->sin6_family = AF_INET6;
        s6->sin6_port = htons((uint16_t)port);
        if (!strcmp(h, "::") || inet_pton(AF_INET6, h, &s6->sin6_addr) != 1)
            s6->sin6_addr = in6addr_loopback;
        len = sizeof *s6;
    } else {
        struct sockaddr_in *s4 = (struct sockaddr_in *)&a;
        s4->sin_family = AF_INET;
        s4->sin_port = htons((uint16_t)port);
        if (!strcmp(h, "0.0.0.0") || inet_pton(AF_INET, h, &s4->sin_addr) != 1)
            s4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        len = sizeof *s4;
    }
    int fd = socket(a.ss_family, SOCK_STREAM, 0);
    if (fd < 0) return;
    struct timeval tv = {2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    static const char req[] = "GET /health HTTP/1.1\r\nHost: ragkv\r\nConnection: close\r\n\r\n";
    if (!connect(fd, (struct sockaddr *)&a, len) &&
        send(fd, req, sizeof req - 1, MSG_NOSIGNAL) == (ssize_t)sizeof req - 1) {
        char buf[512];
        while (recv(fd, buf, sizeof buf, 0) > 0) {
        }
    }
    close(fd);
}

/* ================================================================ life cycle */

void rk_server_options_default(rk_server_options *o) {
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
    o->header_timeout_s = 5;
    o->reasoning = -1;
    o->responses_max = 10000;
    o->responses_max_bytes = 256LL << 20;
    o->responses_ttl_s = 3600;
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

/* Start CivetWeb on o's host and port and say where it listens; *out_port
 * gets the port bound (o's, or the one chosen for port 0). */
static rk_status start_http(server *S, int *out_port) {
    const rk_server_options *o = &S->o;
    char ports[320], threads[16], request_ms[24], keep_alive_ms[24];
    int colon = strchr(o->host, ':') != NULL; /* IPv6 literal */
    snprintf(ports, sizeof ports, "%s%s%s:%d", colon ? "[" : "", o->host, colon ? "]" : "",
             o->port);
    int nt = o->http_threads > 0 ? o->http_threads : o->queue + 16;
    S->request_slots = nt < 4 ? 4 : nt > 4096 ? 4096 : nt;
    /* CivetWeb serves each connection on one thread of its own, from the
     * request line to the close, waiting or not. Four threads more per
     * request slot let 4 x http_threads idle or slow connections be held
     * while requests are still served. A connection must send its headers
     * within header_timeout_s of a thread taking it (or of the previous
     * answer on it), whatever its address, or the watchdog ends it; a body
     * must arrive within request_timeout_s of the headers (rk_gw_read_body);
     * request_timeout_s also bounds each write. */
    snprintf(threads, sizeof threads, "%d", 5 * S->request_slots);
    /* Per address: off unless set (behind a proxy every client shares one
     * address). */
    S->conns_per_ip = o->max_connections_per_ip > 0 ? o->max_connections_per_ip : 0;
    S->header_timeout_s = o->header_timeout_s > 0 && o->header_timeout_s < o->request_timeout_s
                              ? o->header_timeout_s
                              : o->request_timeout_s;
    if (rk_gw_conns_create(5 * S->request_slots, &S->conns)) return RK_ERR_NOMEM;
    rk_status wst = rk_gw_watchdog_start(&S->watchdog);
    if (wst) {
        rk_gw_conns_free(S->conns);
        S->conns = NULL;
        return wst;
    }
    long rt_ms = (long)(o->request_timeout_s * 1000 + 0.5);
    long ht_ms = (long)(S->header_timeout_s * 1000 + 0.5);
    snprintf(request_ms, sizeof request_ms, "%ld", rt_ms);
    snprintf(keep_alive_ms, sizeof keep_alive_ms, "%ld", ht_ms);
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
    cb.init_connection = conn_opened;
    cb.connection_close = conn_closed;
    mg_init_library(0);
    S->ctx = mg_start(&cb, S, mg_opts);
    if (!S->ctx) {
        rk_gw_conns_free(S->conns);
        S->conns = NULL;
        rk_gw_watchdog_stop(S->watchdog);
        S->watchdog = NULL;
        mg_exit_library();
        return rk_errorf(RK_ERR_IO, "cannot listen on %s (in use, or not a local address?)", ports);
    }
    struct mg_server_port sp[4];
    int n_ports = mg_get_server_ports(S->ctx, 4, sp);
    *out_port = n_ports > 0 ? sp[0].port : o->port;
    learn_request_offset(S, *out_port);
    fprintf(stderr, "ragkv: listening on http://%s%s%s:%d\n", colon ? "[" : "", o->host,
            colon ? "]" : "", *out_port);
    fflush(stderr);
    return RK_OK;
}

/* The keys file: its tenants, whose names the statistics label. Neither
 * --api-key nor --admin-key may also be a tenant's key. */
static rk_status load_tenants(server *S) {
    rk_status st = rk_tenants_load(S->o.api_keys_file, &S->tenants);
    if (st) return st;
    if ((S->o.api_key[0] && rk_tenants_has_key(S->tenants, S->o.api_key)) ||
        (S->o.admin_key[0] && rk_tenants_has_key(S->tenants, S->o.admin_key)))
        return rk_errorf(RK_ERR_INVALID,
                         "%s: a tenant's key is also the --api-key or the --admin-key",
                         S->o.api_keys_file);
    int n = rk_tenants_count(S->tenants);
    const char *names[RK_STATS_TENANTS];
    for (int i = 0; i < n && i < RK_STATS_TENANTS; i++)
        names[i] = rk_tenants_name(S->tenants, i + 1);
    rk_stats_set_tenants(S->stats, names, n < RK_STATS_TENANTS ? n : RK_STATS_TENANTS);
    RK_LOG_INFO("%d tenant%s from %s", n, n == 1 ? "" : "s", S->o.api_keys_file);
    return RK_OK;
}

/* --chat-template: a template's name, or a Jinja file whose text names one
 * as a GGUF's tokenizer.chat_template would (-1 in *out when none is set). */
static rk_status resolve_chat_template(const char *spec, int *out) {
    *out = -1;
    if (!spec[0]) return RK_OK;
    for (int t = RK_CHAT_CHATML; t <= RK_CHAT_GEMMA4; t++)
        if (!strcmp(spec, rk_chat_template_name((rk_chat_template)t))) return *out = t, RK_OK;
    FILE *f = fopen(spec, "rb");
    if (!f)
        return rk_errorf(RK_ERR_INVALID,
                         "chat_template: '%s' is neither a template name (chatml, llama3, llama2, "
                         "phi3, gemma, harmony, gemma4) nor a readable file: %s",
                         spec, strerror(errno));
    size_t cap = 1 << 20;
    char *text = malloc(cap);
    size_t n = text ? fread(text, 1, cap - 1, f) : 0;
    int big = text && n == cap - 1 && fgetc(f) != EOF;
    fclose(f);
    if (!text) return rk_errorf(RK_ERR_NOMEM, "out of memory");
    text[n] = '\0';
    /* Recognised only when the text decides, whatever the architecture says. */
    rk_chat_template a = rk_chat_template_detect(text, "qwen3", 0, 0);
    int known = a == rk_chat_template_detect(text, NULL, 0, 0);
    free(text);
    if (big) return rk_errorf(RK_ERR_INVALID, "chat_template: %s is over 1 MiB", spec);
    if (!known)
        return rk_errorf(RK_ERR_INVALID,
                         "chat_template: no template is recognised in %s (it must use "
                         "<|im_start|>, <|start_header_id|>, [INST], <|assistant|> with <|end|>, "
                         "<start_of_turn>, or <|turn>)",
                         spec);
    *out = (int)a;
    return RK_OK;
}

rk_status rk_server_start(const rk_server_options *o, rk_server **out, int *out_port) {
    *out = NULL;
    int forced_tmpl;
    rk_status tst = resolve_chat_template(o->chat_template, &forced_tmpl);
    if (tst) return tst;
    if (o->chat_separator[0] && rk_separator_check(o->chat_separator))
        return rk_errorf(RK_ERR_INVALID, "chat_separator: %s", rk_error_message());
    server *S = calloc(1, sizeof *S);
    if (!S) return rk_errorf(RK_ERR_NOMEM, "out of memory");
    S->o = *o;
    S->forced_tmpl = forced_tmpl;
    pthread_mutex_init(&S->info_mu, NULL);
    S->started_unix = (double)time(NULL);
    S->last_state = RK_SCHEDULER_LOADING;
    rk_status st = rk_stats_create(&S->stats);
    if (!st && o->api_keys_file[0]) st = load_tenants(S);
    if (!st && o->responses_max > 0)
        st = rk_resp_store_create(o->responses_max, o->responses_max_bytes, o->responses_ttl_s,
                                  &S->responses);
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
    if (!st && (st = start_http(S, &S->port))) {
        rk_scheduler_free(S->engine);
        S->engine = NULL;
    }
    if (st) {
        rk_stats_free(S->stats);
        rk_tenants_free(S->tenants);
        rk_resp_store_free(S->responses);
        pthread_mutex_destroy(&S->info_mu);
        free(S);
        return st;
    }
    *out_port = S->port;
    *out = S;
    return RK_OK;
}

rk_scheduler_state rk_server_poll(rk_server *S, char *msg, size_t cap) {
    rk_scheduler_state st = rk_scheduler_get_state(S->engine, msg, cap);
    if (st != S->last_state && st == RK_SCHEDULER_READY) {
        rk_service *svc = rk_gw_ready_service(S);
        if (svc) { /* the KV sizes resolved for this model and machine */
            char kv[512];
            rk_kv_plan_describe(&svc->kv, kv, sizeof kv);
            fprintf(stderr, "ragkv: %s\n", kv);
        }
        RK_LOG_INFO("model ready: %s (chat template %s)", S->model_name,
                    rk_chat_template_name(S->tmpl));
    }
    S->last_state = st;
    return st;
}

/* Shutdown: refuse new work (503), give in-flight requests the grace
 * period, then cancel the rest: a running generation stops at its next
 * step and its stream ends with a final event ("cancelled", with usage)
 * and [DONE]; a queued one is answered 503. Their handlers write that
 * before CivetWeb stops, as its stop flag ends every read and write; a
 * client that does not read is given up after request_timeout_s. */
void rk_server_stop(rk_server *S) {
    if (!S) return;
    atomic_store(&S->stopping, 1);
    wait_requests_done(S, S->o.grace_s);
    rk_scheduler_cancel_all(S->engine);
    wait_requests_done(S, S->o.request_timeout_s + 2);
    stop_civetweb(S->ctx, S->port, S->o.host);
    rk_scheduler_free(S->engine);
    S->engine = NULL;
    mg_exit_library();
    rk_gw_watchdog_stop(S->watchdog);
    rk_gw_conns_free(S->conns);
    rk_stats_free(S->stats);
    rk_tenants_free(S->tenants);
    rk_resp_store_free(S->responses);
    pthread_mutex_destroy(&S->info_mu);
    free(S);
    RK_LOG_INFO("stopped");
}
