/* gateway/respond.c — what every route writes and reads on its
 * connection: response headers (with CORS when configured), text and JSON
 * bodies, errors in the API's envelope, and the request body under the
 * size and time limits (answering `Expect: 100-continue`). Each function
 * runs on the request's own thread and uses only its connection. */
#include <civetweb.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "gateway/http.h"

/* ---------------------------------------------------------------- responses */

void rk_gw_add_cors_headers(req_ctx *rc) {
    const char *origin = rc->S->o.cors_origin;
    if (!origin[0]) return;
    mg_response_header_add(rc->conn, "Access-Control-Allow-Origin", origin, -1);
    mg_response_header_add(rc->conn, "Access-Control-Expose-Headers", "X-Request-Id", -1);
    if (strcmp(origin, "*")) mg_response_header_add(rc->conn, "Vary", "Origin", -1);
}

void rk_gw_send_headers(req_ctx *rc, int status, const char *type, long long length,
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
    rk_gw_add_cors_headers(rc);
    if (retry_after) mg_response_header_add(c, "Retry-After", retry_after, -1);
    /* A client told to wait for 100 Continue that gets its answer instead
     * never sends the body: the connection cannot carry another request. */
    if (rc->expect_continue && !rc->continued) mg_disable_connection_keep_alive(c);
    if (status == 405) {
        const char *allow =
            !strcmp(rc->path, "/v1/chunks")         ? "GET, HEAD, POST"
            : !strncmp(rc->path, "/v1/chunks/", 11) ? "GET, HEAD, DELETE"
            : !strncmp(rc->path, "/v1/responses/", 14) && !strchr(rc->path + 14, '/')
                ? "GET, HEAD, DELETE"
            : !strcmp(rc->path, "/v1/completions") || !strcmp(rc->path, "/v1/chat/completions") ||
                    !strcmp(rc->path, "/v1/responses") || !strcmp(rc->path, "/v1/cache/flush") ||
                    !strcmp(rc->path, "/tokenize") || !strcmp(rc->path, "/detokenize")
                ? "POST"
                : "GET, HEAD";
        mg_response_header_add(c, "Allow", allow, -1);
    }
    mg_response_header_send(c);
}

void rk_gw_send_text(req_ctx *rc, int status, const char *type, const char *body, size_t len,
                     const char *retry_after) {
    rk_gw_send_headers(rc, status, type, (long long)len, retry_after);
    if (len && !rc->head) mg_write(rc->conn, body, len);
}

/* Send a JSON body (the reference is taken). */
void rk_gw_send_json(req_ctx *rc, int status, json_t *body) {
    char *s = body ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    if (!s) {
        static const char oom[] =
            "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\",\"param\":"
            "null,\"code\":null,\"status\":500}}";
        rk_gw_send_text(rc, 500, "application/json", oom, sizeof oom - 1, NULL);
        return;
    }
    rk_gw_send_text(rc, status, "application/json", s, strlen(s), status == 503 ? "1" : NULL);
    free(s);
}

/* OpenAI's envelope, which its SDKs read (message, type, param, code), with
 * the HTTP status in `status`: `code` is OpenAI's string code or null,
 * `param` the field at fault (given, or named by the message) or null
 * (docs/api.md). */
json_t *rk_gw_error_body(const rk_http_error *e) {
    char field[64];
    const char *name = e->param ? e->param : rk_http_error_param(e->message, field, sizeof field);
    json_t *code = e->code ? json_string(e->code) : json_null();
    json_t *param = name ? json_string(name) : json_null();
    return json_pack("{s:{s:s, s:s, s:o, s:o, s:i}}", "error", "message", e->message, "type",
                     e->type, "param", param, "code", code, "status", e->status);
}

void rk_gw_send_error(req_ctx *rc, const rk_http_error *e) {
    rk_gw_send_json(rc, e->status, rk_gw_error_body(e));
}

void rk_gw_send_errorf(req_ctx *rc, int status, const char *fmt, ...) {
    rk_http_error e = {.status = status, .type = rk_http_error_type(status)};
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof e.message, fmt, ap);
    va_end(ap);
    rk_gw_send_error(rc, &e);
}

/* ---------------------------------------------------------------- request bodies */

/* The body, which must be whole by deadline (rk_time_now()); the
 * watchdog ends any read still blocked then. As rk_gw_read_body, without the
 * request slot. */
static int read_body_by(req_ctx *rc, double deadline, char **out, size_t *out_len) {
    server *S = rc->S;
    const struct mg_request_info *ri = mg_get_request_info(rc->conn);
    long long max = S->o.max_body_bytes, cl = ri->content_length;
    *out = NULL;
    *out_len = 0;
    if (rc->expect_continue && cl > max) { /* refused before the client sends it */
        rk_gw_send_errorf(rc, 413, "the body has %lld bytes; at most %lld are accepted", cl, max);
        return -1;
    }
    if (rc->expect_continue && !rc->continued) {
        /* On the socket itself: CivetWeb takes any mg_write for the start of
         * the response and would then send no status line of its own. */
        static const char go_on[] = "HTTP/1.1 100 Continue\r\n\r\n";
        int fd = rk_gw_conn_fd(mg_get_request_info(rc->conn));
        rc->continued = 1;
        if (fd < 0 ||
            send(fd, go_on, sizeof go_on - 1, MSG_NOSIGNAL) != (ssize_t)sizeof go_on - 1) {
            mg_disable_connection_keep_alive(rc->conn);
            rk_gw_send_errorf(rc, 400, "the connection failed before the body was read");
            return -1;
        }
    }
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
        rk_gw_send_errorf(rc, 413, "the body has %lld bytes; at most %lld are accepted", cl, max);
        return -1;
    }
    size_t cap = cl >= 0 ? (size_t)cl + 1 : 65536, len = 0;
    char *buf = malloc(cap);
    if (!buf) {
        rk_gw_send_errorf(rc, 500, "out of memory");
        return -1;
    }
    /* One mg_read returns only once it has what it asks, however slowly
     * that trickles in; the watchdog cuts it at the deadline. */
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
                rk_gw_send_errorf(rc, 500, "out of memory");
                return -1;
            }
            buf = nb;
        }
        int n = mg_read(rc->conn, buf + len, cap - 1 - len);
        if (n <= 0) { /* the client ended it, or the watchdog did at the deadline */
            late = rk_time_now() >= deadline;
            break;
        }
        len += (size_t)n;
        if ((long long)len > max) break;
    }
    if ((long long)len > max || late || (cl >= 0 && (long long)len < cl)) {
        free(buf);
        mg_disable_connection_keep_alive(rc->conn);
        if ((long long)len > max)
            rk_gw_send_errorf(rc, 413, "the body is larger than %lld bytes", max);
        else if (late)
            rk_gw_send_errorf(rc, 408, "the body did not arrive within %g s (%zu bytes came)",
                              S->o.request_timeout_s, len);
        else
            rk_gw_send_errorf(rc, 400, "the body ended after %zu of %lld bytes", len, cl);
        return -1;
    }
    buf[len] = '\0';
    *out = buf;
    *out_len = len;
    return 0;
}

int rk_gw_read_body(req_ctx *rc, char **out, size_t *out_len) {
    server *S = rc->S;
    double deadline = rk_time_now() + S->o.request_timeout_s;
    rk_gw_conn_state *cs = mg_get_user_connection_data(rc->conn);
    long ticket = cs ? rk_gw_watchdog_arm(S->watchdog, cs->fd, deadline) : 0;
    /* A body on its way holds no request slot (a request with a body is
     * admitted here, once it is in): slow bodies cannot take the slots other
     * clients' requests need. */
    if (rc->holds_slot) {
        atomic_fetch_sub(&S->admitted, 1);
        rc->holds_slot = 0;
    }
    int rc_read = read_body_by(rc, deadline, out, out_len);
    rk_gw_watchdog_disarm(S->watchdog, ticket);
    if (rc_read) return rc_read;
    if (atomic_fetch_add(&S->admitted, 1) >= S->request_slots) {
        atomic_fetch_sub(&S->admitted, 1);
        free(*out);
        *out = NULL;
        *out_len = 0;
        rk_gw_send_errorf(rc, 503, "every request slot is busy (http_threads); try again");
        return -1;
    }
    rc->holds_slot = 1;
    return 0;
}
