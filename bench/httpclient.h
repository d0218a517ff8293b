/* bench/httpclient.h — a small blocking HTTP/1.1 client for a `ragkv serve`
 * on the loopback interface: one request per connection (Connection:
 * close), fixed-length or chunked bodies, a timeout per exchange. Used by
 * `ragkv bench --url` and the load program bench/bench_load.c.
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
