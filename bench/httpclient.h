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

/* One exchange on a fresh connection: method, path, an optional body sent as
 * application/json (NULL = none). On success *out_status is the HTTP status
 * and *out_body the malloc'ed NUL-terminated body (de-chunked), which the
 * caller frees. RK_ERR_IO when the server cannot be reached or answers
 * nothing in time, RK_ERR_FORMAT on a malformed answer. */
rk_status rk_http_request(const rk_http_target *t, const char *method, const char *path,
                          const char *body, size_t body_len, int *out_status, char **out_body);

/* POST a JSON value; *out_json is the parsed answer (NULL when it is not
 * JSON; the caller decrefs) and, when out_raw is not NULL, *out_raw the raw
 * body (the caller frees). */
rk_status rk_http_post_json(const rk_http_target *t, const char *path, json_t *body,
                            int *out_status, json_t **out_json, char **out_raw);

#endif
