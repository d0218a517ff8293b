/* bench/httpclient.h — a small blocking HTTP/1.1 client for a `ragkv serve`
 * on the loopback interface: one request per connection (Connection:
 * close), fixed-length or chunked bodies, a timeout per exchange. Used by
 * `ragkv bench --url`, the load program bench/bench_load.c and the HTTP
 * tests (tests/test_http.c).
 *
 * Thread-safety: a target is read-only after rk_http_parse_url, so any
 * number of threads may send requests to one target at the same time. */
#ifndef RK_HTTPCLIENT_H
#define RK_HTTPCLIENT_H

#include <jansson.h>
#include <netinet/in.h>
#include <stddef.h>

#include "config/config.h"

/* Where requests go. */
typedef struct rk_http_target {
    struct sockaddr_in addr;
    char host[64];
    int port;
    double timeout_s;
} rk_http_target;

/* Accept http://HOST:PORT[/] where HOST is localhost or a 127.x.x.x address
 * (anything else is RK_ERR_INVALID); timeout_s bounds every send and receive. */
rk_status rk_http_parse_url(const char *url, double timeout_s, rk_http_target *t);

/* One answer: the status, the head (status line and headers) and the body,
 * de-chunked. head and body share one allocation that
 * rk_http_response_free releases. */
typedef struct rk_http_response {
    int status;
    char *head; /* NUL-terminated; header lines separated by CRLF */
    char *body; /* NUL-terminated, body_len bytes (more NULs may be inside) */
    size_t body_len;
} rk_http_response;

/* One exchange on a fresh connection: method, path, extra request header
 * lines ("Name: value\r\n" each; NULL = none) and an optional body sent as
 * application/json (NULL = none). The answer is read even when the server
 * closes before taking the whole body (a 413). RK_ERR_IO when the server
 * cannot be reached or answers nothing in time, RK_ERR_FORMAT on a malformed
 * answer; *out is then empty. */
rk_status rk_http_exchange(const rk_http_target *t, const char *method, const char *path,
                           const char *headers, const char *body, size_t body_len,
                           rk_http_response *out);

/* Called after every read of an answer with all its raw bytes so far (head
 * included, before de-chunking), at the time they arrived: a streaming
 * client notes when its first event came. */
typedef void (*rk_http_on_recv)(void *ctx, const char *raw, size_t len);

/* rk_http_exchange that calls on_recv(ctx, ...) as the answer arrives. */
rk_status rk_http_exchange_stream(const rk_http_target *t, const char *method, const char *path,
                                  const char *headers, const char *body, size_t body_len,
                                  rk_http_on_recv on_recv, void *ctx, rk_http_response *out);

/* An exchange taken in steps, for a caller that acts while the answer is
 * still coming (reads a stream's first event, then drops the connection or
 * makes other requests before reading the rest). */
typedef struct rk_http_conn {
    const rk_http_target *t; /* must outlive the connection */
    int fd;
    char *raw; /* the answer's bytes so far, NUL-terminated; NULL before any */
    size_t len, cap;
} rk_http_conn;

/* Connect and send the request, as rk_http_exchange does: with body NULL no
 * Content-Length is sent, so a caller that sends its body itself later (on
 * c->fd) names it in headers. On success the caller ends c with
 * rk_http_finish or rk_http_close; on failure c holds nothing. */
rk_status rk_http_open(const rk_http_target *t, const char *method, const char *path,
                       const char *headers, const char *body, size_t body_len, rk_http_conn *c);

/* Read until needle appears in the answer's raw bytes (head included).
 * RK_ERR_IO when the server closes or the timeout passes first; c stays open
 * either way. */
rk_status rk_http_wait_for(rk_http_conn *c, const char *needle);

/* Read the rest of the answer until the server closes (on_recv as in
 * rk_http_exchange_stream; may be NULL) and parse it into *out. c is closed
 * whatever the outcome. */
rk_status rk_http_finish(rk_http_conn *c, rk_http_on_recv on_recv, void *ctx,
                         rk_http_response *out);

/* Abandon the exchange: close the connection, free what was read. */
void rk_http_close(rk_http_conn *c);

/* Parse a whole answer held in raw (malloc'ed, NUL-terminated, len bytes;
 * taken over: it becomes out->head, or is freed on failure). For bytes a
 * caller read itself; RK_ERR_FORMAT when they are no HTTP answer. */
rk_status rk_http_parse(char *raw, size_t len, rk_http_response *out);

/* Accepts NULL and an empty response. */
void rk_http_response_free(rk_http_response *r);

/* The value of the response header called name (case-insensitive), up to the
 * CRLF that ends it; NULL when absent. */
const char *rk_http_header(const rk_http_response *r, const char *name);

/* rk_http_exchange without extra headers, for the body alone: on success
 * *out_status is the HTTP status and *out_body the malloc'ed NUL-terminated
 * body, which the caller frees. */
rk_status rk_http_request(const rk_http_target *t, const char *method, const char *path,
                          const char *body, size_t body_len, int *out_status, char **out_body);

/* POST a JSON value; *out_json is the parsed answer (NULL when it is not
 * JSON; the caller decrefs) and, when out_raw is not NULL, *out_raw the raw
 * body (the caller frees). */
rk_status rk_http_post_json(const rk_http_target *t, const char *path, json_t *body,
                            int *out_status, json_t **out_json, char **out_raw);

#endif
