/* gateway/framing.c — where a request ends: the checks on its header lines
 * that decide how long its body is, made before any of the body is read.
 *
 * A proxy in front of ragkv and ragkv itself must agree on where each
 * request ends, or bytes one of them takes for a body the other runs as a
 * request (request smuggling). So anything about the framing that two
 * readers could take two ways is refused, and the connection closed:
 *
 *   - more header lines than the server keeps (CivetWeb keeps 64 and drops
 *     the rest unseen; a request with exactly 64 cannot be told apart from
 *     one with more, so 64 is refused too): 431;
 *   - a header name with white space before its colon, or not a token;
 *   - Content-Length other than digits only, or given twice;
 *   - Transfer-Encoding other than exactly `chunked`, given twice, beside
 *     Content-Length, or on HTTP/1.0;
 *   - Host or Authorization given twice; HTTP/1.1 without Host;
 *   - an expectation other than `100-continue` (417).
 *
 * Pure functions over a list of parsed headers: safe from any thread, and
 * what the fuzz target (fuzz/fuzz_request.c) drives. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "gateway/http.h"

/* RFC 9110, 5.6.2: tchar. */
static int is_tchar(unsigned char c) {
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return 1;
    return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

static int is_token(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (!is_tchar((unsigned char)*s)) return 0;
    return 1;
}

/* A Content-Length value: 1 to 18 digits, nothing else (no sign, no hex, no
 * white space); -1 otherwise. 18 digits cannot overflow a long long. */
static long long parse_length(const char *v) {
    size_t n = strlen(v);
    if (n == 0 || n > 18 || strspn(v, "0123456789") != n) return -1;
    long long x = 0;
    for (; *v; v++) x = x * 10 + (*v - '0');
    return x;
}

/* s as at most 64 printable ASCII characters (others as '?'), for a message
 * that must stay valid UTF-8 whatever the client sent. */
static const char *printable(const char *s, char out[65]) {
    size_t i = 0;
    for (; s[i] && i < 64; i++) out[i] = s[i] >= 0x20 && s[i] < 0x7f ? s[i] : '?';
    out[i] = '\0';
    return out;
}

static int refuse(rk_gw_framing *out, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int refuse(rk_gw_framing *out, int status, const char *fmt, ...) {
    out->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out->message, sizeof out->message, fmt, ap);
    va_end(ap);
    return -1;
}

int rk_gw_framing_check(const rk_gw_header *h, int n_headers, int max_headers,
                        const char *http_version, rk_gw_framing *out) {
    memset(out, 0, sizeof *out);
    out->content_length = -1;
    if (n_headers >= max_headers) {
        return refuse(out, 431, "the request has %d header lines or more; at most %d are accepted",
                      n_headers, max_headers - 1);
    }
    int n_length = 0, n_te = 0, n_host = 0, n_auth = 0;
    char shown[65];
    const char *te = NULL, *length = NULL;
    for (int i = 0; i < n_headers; i++) {
        const char *name = h[i].name, *value = h[i].value ? h[i].value : "";
        if (!name) continue;
        if (h[i].space_before_colon)
            return refuse(out, 400, "the header \"%s\" has white space before its colon",
                          printable(name, shown));
        if (!is_token(name))
            return refuse(out, 400, "a header name is not a token: \"%s\"", printable(name, shown));
        if (!strcasecmp(name, "Content-Length")) n_length++, length = value;
        if (!strcasecmp(name, "Transfer-Encoding")) n_te++, te = value;
        n_host += !strcasecmp(name, "Host");
        n_auth += !strcasecmp(name, "Authorization");
        if (!strcasecmp(name, "Expect") && strcasecmp(value, "100-continue"))
            return refuse(out, 417, "only the expectation `Expect: 100-continue` is supported");
    }
    if (n_length > 1)
        return refuse(out, 400, "the request has more than one Content-Length header");
    if (n_te > 1) return refuse(out, 400, "the request has more than one Transfer-Encoding header");
    if (n_length && n_te)
        return refuse(out, 400, "the request has both Content-Length and Transfer-Encoding");
    if (n_host > 1) return refuse(out, 400, "the request has more than one Host header");
    if (n_auth > 1) return refuse(out, 400, "the request has more than one Authorization header");
    int v11 = http_version && !strcmp(http_version, "1.1");
    if (!n_host && v11) return refuse(out, 400, "an HTTP/1.1 request needs a Host header");
    if (te) {
        if (!v11) return refuse(out, 400, "Transfer-Encoding is HTTP/1.1 only");
        if (strcasecmp(te, "chunked"))
            return refuse(out, 400, "Transfer-Encoding must be exactly `chunked`, not \"%s\"",
                          printable(te, shown));
        out->chunked = 1;
    }
    if (length && (out->content_length = parse_length(length)) < 0)
        return refuse(out, 400, "Content-Length must be digits only, not \"%s\"",
                      printable(length, shown));
    return 0;
}
