/* gateway/errors.c — the API's one error envelope: HTTP statuses for the
 * lower layers' rk_status codes, their type names, OpenAI's error codes, and
 * rk_http_errorf. Pure functions, safe from any thread. */
#include <stdarg.h>
#include <stdio.h>

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
    case 400: return "invalid_request";
    case 401: return "unauthorized";
    case 403: return "forbidden";
    case 404: return "not_found";
    case 405: return "method_not_allowed";
    case 408: return "request_timeout";
    case 409: return "conflict";
    case 413:
    case 431: return "request_too_large";
    case 422: return "unprocessable";
    case 429: return "rate_limited";
    case 501: return "not_implemented";
    case 503: return "overloaded";
    case 505: return "http_version_not_supported";
    default: return status >= 500 ? "internal_error" : "invalid_request";
    }
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
