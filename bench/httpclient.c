/* bench/httpclient.c — see httpclient.h. */
#include "bench/httpclient.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

/* Accept http://HOST:PORT[/] where HOST is localhost or a 127.x.x.x address. */
rk_status rk_http_parse_url(const char *url, double timeout_s, rk_http_target *t) {
    memset(t, 0, sizeof *t);
    t->timeout_s = timeout_s;
    const char *p = url;
    if (strncmp(p, "http://", 7))
        return rk_errorf(RK_ERR_INVALID, "--url %s: only http://HOST:PORT is supported", url);
    p += 7;
    const char *colon = strchr(p, ':');
    if (!colon || colon == p || (size_t)(colon - p) >= sizeof t->host)
        return rk_errorf(RK_ERR_INVALID, "--url %s: want http://127.0.0.1:PORT", url);
    memcpy(t->host, p, (size_t)(colon - p));
    t->host[colon - p] = '\0';
    char port[16];
    size_t n = strcspn(colon + 1, "/");
    if (n == 0 || n >= sizeof port || (colon[1 + n] && strcmp(colon + 1 + n, "/")))
        return rk_errorf(RK_ERR_INVALID, "--url %s: want http://127.0.0.1:PORT", url);
    memcpy(port, colon + 1, n);
    port[n] = '\0';
    long v;
    if (rk_parse_long(port, 1, 65535, &v))
        return rk_errorf(RK_ERR_INVALID, "--url %s: bad port '%s'", url, port);
    t->port = (int)v;
    const char *ip = !strcmp(t->host, "localhost") ? "127.0.0.1" : t->host;
    t->addr.sin_family = AF_INET;
    t->addr.sin_port = htons((uint16_t)v);
    if (inet_pton(AF_INET, ip, &t->addr.sin_addr) != 1)
        return rk_errorf(RK_ERR_INVALID, "--url %s: '%s' is not an IPv4 address", url, t->host);
    if ((ntohl(t->addr.sin_addr.s_addr) >> 24) != 127)
        return rk_errorf(RK_ERR_INVALID, "--url %s: the benchmark only talks to loopback", url);
    return RK_OK;
}

/* Decode a chunked transfer-encoded body in place; returns its length or -1. */
static long dechunk(char *s, size_t len) {
    size_t in = 0, out = 0;
    for (;;) {
        char *end;
        if (in >= len) return -1;
        errno = 0;
        unsigned long n = strtoul(s + in, &end, 16);
        if (end == s + in || errno) return -1;
        char *crlf = strstr(end, "\r\n");
        if (!crlf) return -1;
        in = (size_t)(crlf - s) + 2;
        if (n == 0) break;
        if (n > len - in) return -1;
        memmove(s + out, s + in, n);
        out += n;
        in += n;
        if (in + 2 > len || s[in] != '\r' || s[in + 1] != '\n') return -1;
        in += 2;
    }
    s[out] = '\0';
    return (long)out;
}

rk_status rk_http_exchange(const rk_http_target *t, const char *method, const char *path,
                           const char *headers, const char *body, size_t body_len,
                           rk_http_response *out) {
    return rk_http_exchange_stream(t, method, path, headers, body, body_len, NULL, NULL, out);
}

rk_status rk_http_exchange_stream(const rk_http_target *t, const char *method, const char *path,
                                  const char *headers, const char *body, size_t body_len,
                                  rk_http_on_recv on_recv, void *ctx, rk_http_response *out) {
    memset(out, 0, sizeof *out);
    rk_http_conn c;
    rk_status st = rk_http_open(t, method, path, headers, body, body_len, &c);
    return st ? st : rk_http_finish(&c, on_recv, ctx, out);
}

/* Send all of p[0..n); a server refusing a body (413) may close before
 * reading all of it, and its answer is still there to read, so a reset is
 * no failure when may_reset is set. */
static rk_status send_all(const rk_http_target *t, int fd, const char *p, size_t n, int may_reset) {
    for (size_t off = 0; off < n;) {
        ssize_t k = send(fd, p + off, n - off, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && may_reset && (errno == EPIPE || errno == ECONNRESET)) return RK_OK;
        if (k <= 0)
            return rk_errorf(RK_ERR_IO, "http: send to %s:%d: %s", t->host, t->port,
                             strerror(errno));
        off += (size_t)k;
    }
    return RK_OK;
}

rk_status rk_http_open(const rk_http_target *t, const char *method, const char *path,
                       const char *headers, const char *body, size_t body_len, rk_http_conn *c) {
    memset(c, 0, sizeof *c);
    c->t = t;
    c->fd = socket(AF_INET, SOCK_STREAM, 0);
    if (c->fd < 0) return rk_errorf(RK_ERR_IO, "http: socket: %s", strerror(errno));
    struct timeval tv = {.tv_sec = (time_t)t->timeout_s,
                         .tv_usec =
                             (suseconds_t)((t->timeout_s - (double)(time_t)t->timeout_s) * 1e6)};
    setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(c->fd, (const struct sockaddr *)&t->addr, sizeof t->addr)) {
        int e = errno;
        rk_http_close(c);
        return rk_errorf(RK_ERR_IO, "http: cannot connect to %s:%d: %s", t->host, t->port,
                         strerror(e));
    }
    static const char fmt[] = "%s %s HTTP/1.1\r\nHost: %s:%d\r\nUser-Agent: ragkv\r\n"
                              "Accept: application/json\r\nConnection: close\r\n%s%s%s\r\n";
    char length[96] = "";
    if (body)
        snprintf(length, sizeof length, "Content-Type: application/json\r\nContent-Length: %zu\r\n",
                 body_len);
    const char *extra = headers ? headers : "";
    /* Sized from the parts: a path may be any length (a test sends 64 KiB). */
    int hn = snprintf(NULL, 0, fmt, method, path, t->host, t->port, length, extra, "");
    char *head = hn < 0 ? NULL : malloc((size_t)hn + 1);
    if (!head) {
        rk_http_close(c);
        return rk_errorf(RK_ERR_NOMEM, "http: out of memory");
    }
    snprintf(head, (size_t)hn + 1, fmt, method, path, t->host, t->port, length, extra, "");
    rk_status st = send_all(t, c->fd, head, (size_t)hn, 0);
    free(head);
    if (!st && body) st = send_all(t, c->fd, body, body_len, 1);
    if (st) rk_http_close(c);
    return st;
}

/* Read what arrived next onto c->raw; *out_n is the bytes read, 0 when the
 * server closed. */
static rk_status recv_more(rk_http_conn *c, size_t *out_n) {
    char buf[16384];
    ssize_t k;
    *out_n = 0;
    do k = recv(c->fd, buf, sizeof buf, 0);
    while (k < 0 && errno == EINTR);
    if (k < 0) {
        int e = errno;
        return rk_errorf(RK_ERR_IO, "http: no answer from %s:%d: %s", c->t->host, c->t->port,
                         e == EAGAIN || e == EWOULDBLOCK ? "timed out" : strerror(e));
    }
    char *grown = c->raw;
    if (c->len + (size_t)k + 1 > c->cap && c->len + (size_t)k <= (64u << 20)) {
        c->cap = (c->len + (size_t)k + 1) * 2;
        grown = realloc(c->raw, c->cap);
    }
    if (c->len + (size_t)k > (64u << 20) || !grown)
        return rk_errorf(RK_ERR_LIMIT, "http: response from %s:%d is too large", c->t->host,
                         c->t->port);
    c->raw = grown;
    memcpy(c->raw + c->len, buf, (size_t)k);
    c->len += (size_t)k;
    c->raw[c->len] = '\0';
    *out_n = (size_t)k;
    return RK_OK;
}

rk_status rk_http_wait_for(rk_http_conn *c, const char *needle) {
    while (!c->raw || !strstr(c->raw, needle)) {
        size_t n;
        rk_status st = recv_more(c, &n);
        if (st) return st;
        if (n == 0)
            return rk_errorf(RK_ERR_IO, "http: %s:%d closed before sending '%s'", c->t->host,
                             c->t->port, needle);
    }
    return RK_OK;
}

rk_status rk_http_finish(rk_http_conn *c, rk_http_on_recv on_recv, void *ctx,
                         rk_http_response *out) {
    memset(out, 0, sizeof *out);
    for (;;) {
        size_t n;
        rk_status st = recv_more(c, &n);
        if (st) {
            rk_http_close(c);
            return st;
        }
        if (n == 0) break;
        if (on_recv) on_recv(ctx, c->raw, c->len);
    }
    char *raw = c->raw;
    size_t len = c->len;
    c->raw = NULL;
    rk_http_close(c);
    return rk_http_parse(raw, len, out);
}

void rk_http_close(rk_http_conn *c) {
    if (c->fd >= 0) close(c->fd);
    free(c->raw);
    memset(c, 0, sizeof *c);
    c->fd = -1;
}

rk_status rk_http_parse(char *raw, size_t len, rk_http_response *out) {
    memset(out, 0, sizeof *out);
    int status;
    char *hend = raw ? strstr(raw, "\r\n\r\n") : NULL;
    if (!hend || sscanf(raw, "HTTP/1.%*d %d", &status) != 1) {
        free(raw);
        return rk_errorf(RK_ERR_FORMAT, "http: malformed response");
    }
    *hend = '\0';
    char *bstart = hend + 4;
    size_t blen = len - (size_t)(bstart - raw);
    int chunked = 0;
    long clen = -1;
    for (char *line = strstr(raw, "\r\n"); line; line = strstr(line + 2, "\r\n")) {
        const char *h = line + 2;
        if (!strncasecmp(h, "Transfer-Encoding:", 18) && strstr(h, "chunked")) chunked = 1;
        if (!strncasecmp(h, "Content-Length:", 15)) clen = strtol(h + 15, NULL, 10);
    }
    if (chunked) {
        long n = dechunk(bstart, blen);
        if (n < 0) {
            free(raw);
            return rk_errorf(RK_ERR_FORMAT, "http: bad chunked body");
        }
        blen = (size_t)n;
    } else if (clen >= 0 && (size_t)clen < blen) {
        blen = (size_t)clen;
    }
    /* One allocation holds both: the head stays in place, the body moves to
     * follow it (left by the de-chunking). */
    memmove(hend + 1, bstart, blen);
    hend[1 + blen] = '\0';
    out->status = status;
    out->head = raw;
    out->body = hend + 1;
    out->body_len = blen;
    return RK_OK;
}

void rk_http_response_free(rk_http_response *r) {
    if (!r) return;
    free(r->head);
    memset(r, 0, sizeof *r);
}

const char *rk_http_header(const rk_http_response *r, const char *name) {
    size_t n = strlen(name);
    for (const char *line = strstr(r->head, "\r\n"); line; line = strstr(line + 2, "\r\n")) {
        const char *h = line + 2;
        if (!strncasecmp(h, name, n) && h[n] == ':') {
            h += n + 1;
            while (*h == ' ' || *h == '\t') h++;
            return h;
        }
    }
    return NULL;
}

rk_status rk_http_request(const rk_http_target *t, const char *method, const char *path,
                          const char *body, size_t body_len, int *out_status, char **out_body) {
    rk_http_response r;
    *out_status = 0;
    *out_body = NULL;
    rk_status st = rk_http_exchange(t, method, path, NULL, body, body_len, &r);
    if (st) return st;
    *out_body = malloc(r.body_len + 1);
    if (*out_body) memcpy(*out_body, r.body, r.body_len + 1);
    *out_status = r.status;
    rk_http_response_free(&r);
    return *out_body ? RK_OK : rk_errorf(RK_ERR_NOMEM, "http: out of memory");
}

/* POST a JSON value; returns the status and the parsed body (NULL when not JSON). */
rk_status rk_http_post_json(const rk_http_target *t, const char *path, json_t *body,
                            int *out_status, json_t **out_json, char **out_raw) {
    char *s = json_dumps(body, JSON_COMPACT);
    *out_json = NULL;
    if (out_raw) *out_raw = NULL;
    if (!s) return rk_errorf(RK_ERR_NOMEM, "http: out of memory");
    char *raw;
    rk_status st = rk_http_request(t, "POST", path, s, strlen(s), out_status, &raw);
    free(s);
    if (st) return st;
    *out_json = json_loads(raw, 0, NULL);
    if (out_raw)
        *out_raw = raw;
    else
        free(raw);
    return RK_OK;
}
