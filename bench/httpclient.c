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
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return rk_errorf(RK_ERR_IO, "http: socket: %s", strerror(errno));
    struct timeval tv = {.tv_sec = (time_t)t->timeout_s,
                         .tv_usec =
                             (suseconds_t)((t->timeout_s - (double)(time_t)t->timeout_s) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (const struct sockaddr *)&t->addr, sizeof t->addr)) {
        int e = errno;
        close(fd);
        return rk_errorf(RK_ERR_IO, "http: cannot connect to %s:%d: %s", t->host, t->port,
                         strerror(e));
    }
    size_t extra = headers ? strlen(headers) : 0;
    char *head = malloc(512 + extra);
    if (!head) {
        close(fd);
        return rk_errorf(RK_ERR_NOMEM, "http: out of memory");
    }
    int hn = snprintf(head, 512,
                      "%s %s HTTP/1.1\r\nHost: %s:%d\r\nUser-Agent: ragkv\r\n"
                      "Accept: application/json\r\nConnection: close\r\n",
                      method, path, t->host, t->port);
    if (body)
        hn += snprintf(head + hn, 512 - (size_t)hn,
                       "Content-Type: application/json\r\nContent-Length: %zu\r\n", body_len);
    memcpy(head + hn, headers ? headers : "", extra);
    hn += (int)extra;
    memcpy(head + hn, "\r\n", 2);
    hn += 2;
    const char *parts[2] = {head, body};
    size_t lens[2] = {(size_t)hn, body ? body_len : 0};
    for (int p = 0; p < 2; p++)
        for (size_t off = 0; off < lens[p];) {
            ssize_t k = send(fd, parts[p] + off, lens[p] - off, MSG_NOSIGNAL);
            if (k < 0 && errno == EINTR) continue;
            /* A server refusing a body (413) may close before reading all of
             * it: its answer is still there to read. */
            if (k < 0 && p == 1 && (errno == EPIPE || errno == ECONNRESET)) break;
            if (k <= 0) {
                int e = errno;
                close(fd);
                free(head);
                return rk_errorf(RK_ERR_IO, "http: send to %s:%d: %s", t->host, t->port,
                                 strerror(e));
            }
            off += (size_t)k;
        }
    free(head);
    struct {
        char *s;
        size_t len, cap;
    } in = {0};
    char buf[16384];
    for (;;) {
        ssize_t k = recv(fd, buf, sizeof buf, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            int e = errno;
            close(fd);
            free(in.s);
            return rk_errorf(RK_ERR_IO, "http: no answer from %s:%d: %s", t->host, t->port,
                             e == EAGAIN || e == EWOULDBLOCK ? "timed out" : strerror(e));
        }
        if (k == 0) break;
        char *grown = in.s;
        if (in.len + (size_t)k + 1 > in.cap && in.len + (size_t)k <= (64u << 20)) {
            in.cap = (in.len + (size_t)k + 1) * 2;
            grown = realloc(in.s, in.cap);
        }
        if (in.len + (size_t)k > (64u << 20) || !grown) {
            close(fd);
            free(in.s);
            return rk_errorf(RK_ERR_LIMIT, "http: response from %s:%d is too large", t->host,
                             t->port);
        }
        in.s = grown;
        memcpy(in.s + in.len, buf, (size_t)k);
        in.len += (size_t)k;
        in.s[in.len] = '\0';
        if (on_recv) on_recv(ctx, in.s, in.len);
    }
    close(fd);
    int status;
    char *hend = in.s ? strstr(in.s, "\r\n\r\n") : NULL;
    if (!hend || sscanf(in.s, "HTTP/1.%*d %d", &status) != 1) {
        free(in.s);
        return rk_errorf(RK_ERR_FORMAT, "http: malformed response from %s:%d", t->host, t->port);
    }
    *hend = '\0';
    char *bstart = hend + 4;
    size_t blen = in.len - (size_t)(bstart - in.s);
    int chunked = 0;
    long clen = -1;
    for (char *line = strstr(in.s, "\r\n"); line; line = strstr(line + 2, "\r\n")) {
        const char *h = line + 2;
        if (!strncasecmp(h, "Transfer-Encoding:", 18) && strstr(h, "chunked")) chunked = 1;
        if (!strncasecmp(h, "Content-Length:", 15)) clen = strtol(h + 15, NULL, 10);
    }
    if (chunked) {
        long n = dechunk(bstart, blen);
        if (n < 0) {
            free(in.s);
            return rk_errorf(RK_ERR_FORMAT, "http: bad chunked body from %s:%d", t->host, t->port);
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
    out->head = in.s;
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
