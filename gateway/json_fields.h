/* gateway/json_fields.h — private to gateway/: the getters the request
 * parsers (http_json.c, structured.c) read JSON fields with. Each leaves
 * its output untouched when the field is absent or null, and returns nonzero
 * after filling err (a 400 naming the field) when the field has the wrong
 * type or range. */
#ifndef RK_GATEWAY_JSON_FIELDS_H
#define RK_GATEWAY_JSON_FIELDS_H

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/api.h"

/* Each getter leaves *out untouched when the field is absent (or null) and
 * returns nonzero after filling err when it has the wrong type or range. */

static inline int get_int(json_t *o, const char *name, json_int_t lo, json_int_t hi,
                          json_int_t *out, rk_http_error *err) {
    json_t *v = json_object_get(o, name);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_integer(v)) return rk_http_errorf(err, 400, "'%s' must be an integer", name), 1;
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi)
        return rk_http_errorf(err, 400, "'%s' must be from %lld to %lld, got %lld", name,
                              (long long)lo, (long long)hi, (long long)x),
               1;
    *out = x;
    return 0;
}

static inline int get_num(json_t *o, const char *name, double lo, double hi, int lo_open,
                          double *out, rk_http_error *err) {
    json_t *v = json_object_get(o, name);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_number(v)) return rk_http_errorf(err, 400, "'%s' must be a number", name), 1;
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi) || (lo_open && x == lo))
        return rk_http_errorf(err, 400, "'%s' must be %s %g and at most %g, got %g", name,
                              lo_open ? "above" : "at least", lo, hi, x),
               1;
    *out = x;
    return 0;
}

static inline int get_bool(json_t *o, const char *name, int *out, rk_http_error *err) {
    json_t *v = json_object_get(o, name);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) return rk_http_errorf(err, 400, "'%s' must be true or false", name), 1;
    *out = json_is_true(v);
    return 0;
}

/* A string field that must be one of two words: *out = 0 for a, 1 for b. */
static inline int get_choice(json_t *o, const char *name, const char *a, const char *b, int *out,
                             rk_http_error *err) {
    json_t *v = json_object_get(o, name);
    if (!v || json_is_null(v)) return 0;
    const char *s = json_string_value(v);
    if (s && !strcmp(s, a))
        *out = 0;
    else if (s && !strcmp(s, b))
        *out = 1;
    else
        return rk_http_errorf(err, 400, "'%s' must be \"%s\" or \"%s\"", name, a, b), 1;
    return 0;
}

/* A string of 1..cap-1 bytes without NUL (a cache salt, a tenant name) into
 * out[cap]. */
static inline int get_text(json_t *o, const char *name, char *out, size_t cap, rk_http_error *err) {
    json_t *v = json_object_get(o, name);
    if (!v || json_is_null(v)) return 0;
    const char *s = json_string_value(v);
    size_t n = s ? json_string_length(v) : 0;
    if (!s || n == 0 || n >= cap || n != strlen(s))
        return rk_http_errorf(err, 400, "'%s' must be a string of 1 to %zu bytes", name, cap - 1),
               1;
    memcpy(out, s, n + 1);
    return 0;
}

/* chunk_context: "isolated" (0), "system" (1) or "anchor" (2). */
static inline int get_context(json_t *o, int *out, rk_http_error *err) {
    static const char *const names[] = {"isolated", "system", "anchor"};
    json_t *v = json_object_get(o, "chunk_context");
    if (!v || json_is_null(v)) return 0;
    const char *s = json_string_value(v);
    for (int i = 0; s && i < 3; i++)
        if (!strcmp(s, names[i])) {
            *out = i;
            return 0;
        }
    return rk_http_errorf(err, 400,
                          "'chunk_context' must be \"isolated\", \"system\" or \"anchor\""),
           1;
}

/* A chunk entry: "text" or {"id": "...", "text": "..."}. *text and *id point
 * into the JSON (id NULL when absent). */
static inline int chunk_entry(json_t *v, int i, const char **text, const char **id,
                              rk_http_error *err) {
    *id = NULL;
    if (json_is_string(v)) {
        *text = json_string_value(v);
        return 0;
    }
    if (json_is_object(v)) {
        json_t *t = json_object_get(v, "text"), *d = json_object_get(v, "id");
        if (!json_is_string(t))
            return rk_http_errorf(err, 400, "chunks[%d].text must be a string", i), 1;
        if (d && !json_is_null(d)) {
            if (!json_is_string(d))
                return rk_http_errorf(err, 400, "chunks[%d].id must be a string", i), 1;
            if (json_string_length(d) > 255)
                return rk_http_errorf(err, 400, "chunks[%d].id is longer than 255 bytes", i), 1;
            *id = json_string_value(d);
        }
        *text = json_string_value(t);
        return 0;
    }
    return rk_http_errorf(err, 400, "chunks[%d] must be a string or {\"id\", \"text\"}", i), 1;
}

#endif
