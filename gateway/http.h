/* gateway/http.h — private to gateway/: the server object and the HTTP
 * plumbing the route files share (server.c, generate.c, chunks.c).
 *
 * A req_ctx is one HTTP request on one thread; every send_* function writes
 * its whole response (status, headers, body) on rc's connection and records
 * the status for the log line. */
#ifndef RK_GATEWAY_HTTP_H
#define RK_GATEWAY_HTTP_H

#include <civetweb.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "gateway/api.h"
#include "gateway/chat.h"
#include "gateway/server.h"
#include "gateway/stats.h"
#include "gateway/tenants.h"
#include "pipeline/scheduler.h"

struct rk_server {
    rk_server_options o;
    struct mg_context *ctx;
    rk_scheduler *engine;
    rk_stats *stats;
    rk_tenants *tenants; /* from api_keys_file; NULL without one */
    int port;
    atomic_int stopping;
    atomic_int in_flight; /* requests being handled */
    atomic_int admitted;  /* of those, the ones counted against request_slots */
    int request_slots;    /* http_threads, resolved */
    atomic_ullong counter;
    double started_unix;
    rk_scheduler_state last_state; /* as rk_server_poll last saw it */
    /* Model facts computed once the engine is ready (under info_mu). */
    pthread_mutex_t info_mu;
    int have_info;
    char model_name[256];
    rk_chat_template tmpl;
    int forced_tmpl; /* --chat-template resolved: a rk_chat_template, or -1 (the model's) */
    int thinks;      /* answers start with a <think> block split off as reasoning_content */
    /* Open connections per client address (max_connections_per_ip). */
    struct rk_gw_conn_table *conns;
    int conns_per_ip;                /* resolved; 0: no limit */
    double header_timeout_s;         /* resolved: min(header_timeout_s, request_timeout_s) */
    struct rk_gw_watchdog *watchdog; /* header and body deadlines */
    atomic_long ri_offset; /* where CivetWeb keeps a connection's request_info; 0 = not known */
    atomic_int name_mismatch_logged;
    struct rk_resp_store *responses; /* stored responses; NULL when responses_max is 0 */
};
typedef struct rk_server server;

/* What one HTTP request is: for the log line. */
typedef struct req_ctx {
    server *S;
    struct mg_connection *conn;
    const char *method, *path; /* path: percent-decoded */
    int head;                  /* a HEAD request: headers only */
    char id[40];
    double t0;
    int status;
    char detail[512];    /* extra log fields */
    int expect_continue; /* the client sent `Expect: 100-continue` ... */
    int continued;       /* ... and was told to go on (rk_gw_read_body) */
    /* Who is asking (set by authorization): the tenant of a tenant key (0:
     * none), and whether the caller sees every tenant's chunks (the admin
     * key; any caller while no keys file names tenants). */
    int tenant;
    int sees_all;
    /* The request holds one of request_slots; rk_gw_read_body gives it back
     * while the body arrives and takes it again once it is whole. */
    int holds_slot;
} req_ctx;

/* The chunks rc's caller may see. */
static inline rk_cache_viewer rk_gw_viewer(const req_ctx *rc) {
    return (rk_cache_viewer){.all = rc->sees_all, .owner = rc->tenant};
}

/* A fresh 64-bit random number (ids, seeds). Any thread. */
uint64_t rk_gw_random(server *S);

/* Responses: headers (length -1: none, the body is streamed), a text body,
 * a JSON body (the reference is taken; 503 adds Retry-After), errors in the
 * API's envelope. */
void rk_gw_send_headers(req_ctx *rc, int status, const char *type, long long length,
                        const char *retry_after);
/* Access-Control-Allow-* headers when cors_origin is set (between
 * mg_response_header_start and _send). */
void rk_gw_add_cors_headers(req_ctx *rc);
void rk_gw_send_text(req_ctx *rc, int status, const char *type, const char *body, size_t len,
                     const char *retry_after);
void rk_gw_send_json(req_ctx *rc, int status, json_t *body);
json_t *rk_gw_error_body(const rk_http_error *e); /* new reference */
void rk_gw_send_error(req_ctx *rc, const rk_http_error *e);
void rk_gw_send_errorf(req_ctx *rc, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Read the body (at most max_body_bytes), which must arrive whole within
 * request_timeout_s of the headers' end, however it trickles in. While it
 * arrives the request holds no request slot; it takes one again once the
 * body is whole. Returns 0 and a malloc'ed NUL-terminated buffer, or -1
 * after sending 413, 408 (too slow), 400 (the client ended it short) or 503
 * (every slot was taken meanwhile). */
int rk_gw_read_body(req_ctx *rc, char **out, size_t *out_len);

/* Does the `model` a client named match the served one (its name, file,
 * fingerprint or one of --served-model-name's)? */
int rk_gw_model_matches(server *S, rk_service *svc, const char *name);
/* The name a request's `model` is answered under: 0 when name is one the
 * server answers to (its served names, its file, its fingerprint; any name
 * under the "any" policy, a mismatch logged once), or -1 after filling err
 * (404 model_not_found) under the "strict" policy. */
int rk_gw_check_model(server *S, rk_service *svc, const char *name, rk_http_error *err);

/* The service when the model is ready (NULL otherwise), with the served
 * name and chat template computed on first use. */
rk_service *rk_gw_ready_service(server *S);

/* 503: loading, failed to load, or shutting down. */
void rk_gw_send_not_ready(req_ctx *rc);

/* The body of a route that answers from the model: read it, find the ready
 * service (*svc) and parse the body as a JSON object. Returns the object
 * (the caller's), or NULL after sending the error (the read's, 503 not
 * ready, 400 not JSON or not an object). */
json_t *rk_gw_read_json(req_ctx *rc, rk_service **svc);

/* Run fn(arg) on a thread with a 4 MiB stack and wait: CivetWeb's workers
 * have small stacks. Returns -1 when no thread could be started. */
int rk_gw_run_big_stack(void (*fn)(void *), void *arg);

/* ---------------------------------------------------------------- framing.c */

/* One header line as parsed: its name and value (NUL-terminated), and
 * whether white space stood between the name and the colon (CivetWeb drops
 * it; the raw line is refused). */
typedef struct rk_gw_header {
    const char *name, *value;
    int space_before_colon;
} rk_gw_header;

/* The verdict on a request's framing. */
typedef struct rk_gw_framing {
    int status;               /* 0: acceptable; else 400, 417 or 431 */
    char message[160];        /* why, when refused */
    long long content_length; /* the body's length; -1: none given */
    int chunked;              /* Transfer-Encoding: chunked */
} rk_gw_framing;

/* Check the framing of a request with n_headers header lines h (at most
 * max_headers - 1 are accepted: a parser that keeps max_headers cannot tell
 * the last from more) and HTTP version http_version ("1.1", "1.0"; NULL:
 * unknown). Returns 0, or -1 with out->status and out->message set; a
 * refused request's connection must be closed after the answer. */
int rk_gw_framing_check(const rk_gw_header *h, int n_headers, int max_headers,
                        const char *http_version, rk_gw_framing *out);

/* ---------------------------------------------------------------- conns.c */

/* The socket of the connection ri describes (mg_get_request_info), found
 * among the process's descriptors by its addresses; -1 when not found. Only
 * while a handler holds the connection. */
int rk_gw_conn_fd(const struct mg_request_info *ri);

/* 1 when the client of socket fd has closed or reset the connection (a
 * peek finds the end of the stream); 0 otherwise, and for fd < 0. */
int rk_gw_peer_gone(int fd);

/* Open connections counted per client address; thread-safe. cap: addresses
 * expected at once (the table grows beyond). */
typedef struct rk_gw_conn_table rk_gw_conn_table;
rk_status rk_gw_conns_create(int cap, rk_gw_conn_table **out);
void rk_gw_conns_free(rk_gw_conn_table *t); /* accepts NULL */
/* Add delta (+1 opened, -1 closed) to addr's count; returns the new count. */
int rk_gw_conns_add(rk_gw_conn_table *t, const char *addr, int delta);

/* What the server keeps about one connection, as CivetWeb's user
 * connection data (conn_opened in server.c makes it, conn_closed frees it). */
typedef struct rk_gw_conn_state {
    int fd;         /* its socket; -1 when not found */
    long ticket;    /* its armed deadline (rk_gw_watchdog_arm); 0: none */
    int counted;    /* counted against its address (max_connections_per_ip) */
    int over_limit; /* opened beyond max_connections_per_ip */
} rk_gw_conn_state;

/* Deadlines on sockets: one thread shuts each armed socket down for
 * reading when its deadline passes, so that a read blocked on it (CivetWeb
 * reading headers, mg_read reading a body) ends at once, however slowly
 * bytes trickle in; what is written still goes out. Thread-safe. */
typedef struct rk_gw_watchdog rk_gw_watchdog;
rk_status rk_gw_watchdog_start(rk_gw_watchdog **out);
void rk_gw_watchdog_stop(rk_gw_watchdog *w); /* accepts NULL */
/* Arm fd for deadline (rk_time_now()); returns a ticket, or 0 when nothing
 * was armed (w NULL, fd < 0, out of memory). Disarm before fd is closed. */
long rk_gw_watchdog_arm(rk_gw_watchdog *w, int fd, double deadline);
void rk_gw_watchdog_disarm(rk_gw_watchdog *w, long ticket); /* 0 is ignored */

/* The routes of generate.c and chunks.c; each answers and returns 0. */
int rk_gw_handle_generate(req_ctx *rc, int chat);

/* A route that answers a chat generation in a shape of its own
 * (responses.c): what the chat path would write goes through it first. */
typedef struct rk_gw_sink {
    void *ctx;
    /* The chat.completion object of an unstreamed answer (the reference is
     * taken) into the object sent (a new reference; NULL: out of memory). */
    json_t *(*final)(void *ctx, json_t *obj);
    /* A chat.completion.chunk event, or an error envelope mid-stream (the
     * reference is taken), into the bytes written (malloc'ed; "" for none,
     * NULL: out of memory). */
    char *(*event)(void *ctx, json_t *ev);
    /* The stream's end (where chat writes [DONE]): the bytes written. */
    char *(*done)(void *ctx);
    /* When set, nothing is generated: once the body is parsed, rendered and
     * tokenized, this answers the request with what it would run (the
     * pieces in api, their tokens in req); the others are not called. */
    void (*prompt)(void *ctx, const rk_api_request *api, const rk_request *req);
} rk_gw_sink;

/* Generate for a body already read (taken: freed here), answering as
 * /v1/completions (chat 0) or /v1/chat/completions (chat 1) would, through
 * sink when not NULL (chat only, one choice). Errors before the answer
 * starts are sent as the chat route sends them. Returns 0. */
int rk_gw_generate(req_ctx *rc, int chat, char *body, size_t len, const rk_gw_sink *sink);
int rk_gw_handle_prewarm(req_ctx *rc);
int rk_gw_handle_list(req_ctx *rc);
int rk_gw_handle_chunk_key(req_ctx *rc, const char *hex, int del);
int rk_gw_handle_flush(req_ctx *rc);
int rk_gw_handle_tokenize(req_ctx *rc, int detokenize);
int rk_gw_handle_apply_template(req_ctx *rc);
int rk_gw_handle_embeddings(req_ctx *rc);
int rk_gw_handle_rerank(req_ctx *rc);
/* POST /v1/responses (rest NULL); GET or DELETE (del) /v1/responses/{id}
 * and GET /v1/responses/{id}/input_items (rest: what follows the slash). */
int rk_gw_handle_responses(req_ctx *rc, const char *rest, int del);
/* Run fn on the engine thread as a command job and wait (at most until the
 * request's timeout). Returns the command's status (RK_ERR_EXHAUSTED when it
 * never ran: queue full, timeout, shutdown), with its message in msg. */
rk_status rk_gw_run_command(req_ctx *rc, rk_scheduler_fn fn, void *ctx, int anytime, char *msg,
                            size_t cap);

/* Run inputs (n of them, n_tokens[i] token ids each) through the model on
 * the engine thread as embedding work of its steps (rk_embed_task, pooling
 * as rk_embed_task_create takes it: rank gives scores) into out, and wait
 * (at most until the request's timeout, then cancelled). Returns its status
 * (RK_ERR_EXHAUSTED when it never ran: queue full, timeout, shutdown), with
 * its message in msg. */
rk_status rk_gw_run_embed(req_ctx *rc, rk_service *svc, int32_t *const *ids, const int *n_tokens,
                          int n, rk_pooling pooling, float *out, char *msg, size_t cap);

/* The caller's most hit chunks (at most RK_STATS_TOP, each with hits), as
 * /v1/stats' top_chunks, asked of the engine; NULL when it could not answer. */
json_t *rk_gw_top_chunks(req_ctx *rc);

#endif
