/* gateway/errors.c — the API's one error envelope: HTTP statuses for the
 * lower layers' rk_status codes, OpenAI's type names and error codes, the
 * field an error message names, and rk_http_errorf. Pure functions, safe from any thread. */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "gateway/api.h"

int rk_http_status_of(rk_status st) {
    switch (st) {
    case RK_OK: return 200;
    case RK_ERR_INVALID:
    case RK_ERR_UNSUPPORTED:
    case RK_ERR_CONTEXT:
    case RK_ERR_FORMAT: return 400;
    case RK_ERR_NOT_FOUND: return 404;
    case RK_ERR_LIMIT: return 422;
    case RK_ERR_EXHAUSTED:
    case RK_ERR_BUSY: return 503;
    default: return 500;
    }
}

const char *rk_http_error_code(rk_status st) {
    return st == RK_ERR_CONTEXT ? RK_CODE_CONTEXT_LENGTH : NULL;
}

const char *rk_http_error_type(int status) {
    switch (status) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable_error";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

/* A character of a field path: a name, an index, a dot between them. */
static int path_char(char c) {
    return isalnum((unsigned char)c) || c == '_' || c == '.' || c == '[' || c == ']';
}

const char *rk_http_error_param(const char *message, char *buf, size_t cap) {
    const char *p = message, *end;
    if (*p == '\'') { /* 'name' ... */
        end = ++p;
        while (path_char(*end)) end++;
        if (*end != '\'') return NULL;
    } else { /* name[i].more ... : an unquoted path names a field only with an index */
        end = p;
        while (isalnum((unsigned char)*end) || *end == '_') end++;
        if (end == p || *end != '[') return NULL;
        while (path_char(*end)) end++;
        while (end > p && end[-1] == '.') end--;
    }
    size_t n = (size_t)(end - p);
    if (n == 0 || n >= cap || !(isalpha((unsigned char)*p) || *p == '_')) return NULL;
    memcpy(buf, p, n);
    buf[n] = '\0';
    return buf;
}

static rk_status status_of_http(int status) {
    switch (status) {
    case 404: return RK_ERR_NOT_FOUND;
    case 409: return RK_ERR_BUSY;
    case 413:
    case 422: return RK_ERR_LIMIT;
    case 501: return RK_ERR_UNSUPPORTED;
    case 503: return RK_ERR_EXHAUSTED;
    default: return status >= 500 ? RK_ERR_INTERNAL : RK_ERR_INVALID;
    }
}

rk_status rk_http_errorf(rk_http_error *err, int status, const char *fmt, ...) {
    err->status = status;
    err->type = rk_http_error_type(status);
    err->code = err->param = NULL;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    return status_of_http(status);
}
