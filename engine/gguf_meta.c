/* engine/gguf_meta.c — a GGUF file's metadata: decoding values, enumerating
 * the pairs, looking keys up and the typed getters (see engine/gguf.h). The
 * reader (gguf.c) has copied every pair into memory at open. */
#include <inttypes.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf_internal.h"

/* ================================================================ values */

bool rk_gguf_is_int_type(uint32_t t) {
    return t == RK_GGUF_UINT8 || t == RK_GGUF_INT8 || t == RK_GGUF_UINT16 || t == RK_GGUF_INT16 ||
           t == RK_GGUF_UINT32 || t == RK_GGUF_INT32 || t == RK_GGUF_UINT64 || t == RK_GGUF_INT64;
}

static bool is_signed_type(uint32_t t) {
    return t == RK_GGUF_INT8 || t == RK_GGUF_INT16 || t == RK_GGUF_INT32 || t == RK_GGUF_INT64;
}

/* The n-byte unsigned integer at p (file and host are little-endian: see the
 * check in gguf_internal.h). */
static uint64_t load_u(const uint8_t *p, size_t n) {
    uint64_t x = 0;
    memcpy(&x, p, n);
    return x;
}

/* Decode one little-endian value of fixed-size type t from p. */
rk_gguf_num rk_gguf_decode_num(uint32_t t, const uint8_t *p) {
    rk_gguf_num v = {0};
    switch (t) {
    case RK_GGUF_UINT8:
    case RK_GGUF_BOOL: v.u = p[0]; break;
    case RK_GGUF_INT8: v.i = (int8_t)p[0]; break;
    case RK_GGUF_UINT16: v.u = load_u(p, 2); break;
    case RK_GGUF_INT16: v.i = (int16_t)load_u(p, 2); break;
    case RK_GGUF_UINT32: v.u = load_u(p, 4); break;
    case RK_GGUF_INT32: v.i = (int32_t)load_u(p, 4); break;
    case RK_GGUF_UINT64: v.u = load_u(p, 8); break;
    case RK_GGUF_INT64: v.i = (int64_t)load_u(p, 8); break;
    case RK_GGUF_FLOAT32: {
        float x;
        memcpy(&x, p, 4);
        v.f = x;
        break;
    }
    case RK_GGUF_FLOAT64: memcpy(&v.f, p, 8); break;
    default: break;
    }
    v.is_signed = is_signed_type(t);
    v.is_float = (t == RK_GGUF_FLOAT32 || t == RK_GGUF_FLOAT64);
    return v;
}

/* ================================================================ metadata */

/* Return the number of metadata pairs. */
int64_t rk_gguf_n_kv(const rk_gguf *g) { return g->n_kv; }

static const rk_gguf_kv *kv_at(const rk_gguf *g, int64_t i) {
    return (i >= 0 && i < g->n_kv) ? &g->kvs[i] : NULL;
}

/* Return the key of pair i (owned by g), or NULL when i is out of range. */
const char *rk_gguf_kv_key(const rk_gguf *g, int64_t i) {
    const rk_gguf_kv *kv = kv_at(g, i);
    return kv ? kv->key : NULL;
}

/* Return the value type of pair i; i must be in range. */
rk_gguf_type rk_gguf_kv_type(const rk_gguf *g, int64_t i) {
    const rk_gguf_kv *kv = kv_at(g, i);
    return kv ? (rk_gguf_type)kv->type : RK_GGUF_UINT8;
}

/* Return the element type of array pair i (0 for non-arrays). */
rk_gguf_type rk_gguf_kv_arr_type(const rk_gguf *g, int64_t i) {
    const rk_gguf_kv *kv = kv_at(g, i);
    return (kv && kv->type == RK_GGUF_ARRAY) ? (rk_gguf_type)kv->arr_type : RK_GGUF_UINT8;
}

/* Return the element count of array pair i (0 for non-arrays). */
uint64_t rk_gguf_kv_arr_n(const rk_gguf *g, int64_t i) {
    const rk_gguf_kv *kv = kv_at(g, i);
    return (kv && kv->type == RK_GGUF_ARRAY) ? kv->arr_n : 0;
}

/* Return the index of key (binary search over the sorted index), or -1. */
int64_t rk_gguf_find_key(const rk_gguf *g, const char *key) {
    if (!g || !key) return -1;
    int64_t lo = 0, hi = g->n_kv - 1;
    while (lo <= hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int64_t idx = g->kv_sorted[mid];
        int c = strcmp(g->kvs[idx].key, key);
        if (c == 0) return idx;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return -1;
}

/* Find key; RK_ERR_NOT_FOUND (no message) when absent. */
static rk_status kv_find(const rk_gguf *g, const char *key, const rk_gguf_kv **out) {
    int64_t i = rk_gguf_find_key(g, key);
    if (i < 0) return RK_ERR_NOT_FOUND;
    *out = &g->kvs[i];
    return RK_OK;
}

static rk_status kv_type_error(const rk_gguf *g, const rk_gguf_kv *kv, const char *wanted) {
    if (kv->type == RK_GGUF_ARRAY)
        return rk_errorf(RK_ERR_FORMAT, "%s: key '%s' is an array of %s, expected %s", g->name,
                         kv->key, rk_gguf_value_type_name(kv->arr_type), wanted);
    return rk_errorf(RK_ERR_FORMAT, "%s: key '%s' has type %s, expected %s", g->name, kv->key,
                     rk_gguf_value_type_name(kv->type), wanted);
}

/* Read an integer-typed scalar as a signed/unsigned pair. */
static rk_status kv_int(const rk_gguf *g, const char *key, const char *wanted, rk_gguf_num *out,
                        const rk_gguf_kv **out_kv) {
    const rk_gguf_kv *kv;
    rk_status st = kv_find(g, key, &kv);
    if (st) return st;
    if (!rk_gguf_is_int_type(kv->type)) return kv_type_error(g, kv, wanted);
    *out = rk_gguf_decode_num(kv->type, kv->scalar);
    *out_kv = kv;
    return RK_OK;
}

/* Get an integer key as u32 (any integer type whose value fits). */
rk_status rk_gguf_get_u32(const rk_gguf *g, const char *key, uint32_t *out) {
    rk_gguf_num v;
    const rk_gguf_kv *kv;
    rk_status st = kv_int(g, key, "an integer", &v, &kv);
    if (st) return st;
    if (v.is_signed ? (v.i < 0 || v.i > (int64_t)UINT32_MAX) : v.u > UINT32_MAX)
        return rk_errorf(RK_ERR_FORMAT, "%s: key '%s' = %s%" PRIu64 " does not fit in u32", g->name,
                         key, v.is_signed && v.i < 0 ? "-" : "",
                         v.is_signed ? (v.i < 0 ? (uint64_t)0 - (uint64_t)v.i : (uint64_t)v.i)
                                     : v.u);
    *out = (uint32_t)(v.is_signed ? (uint64_t)v.i : v.u);
    return RK_OK;
}

/* Get an integer key as i32 (any integer type whose value fits). */
rk_status rk_gguf_get_i32(const rk_gguf *g, const char *key, int32_t *out) {
    rk_gguf_num v;
    const rk_gguf_kv *kv;
    rk_status st = kv_int(g, key, "an integer", &v, &kv);
    if (st) return st;
    if (v.is_signed ? (v.i < INT32_MIN || v.i > INT32_MAX) : v.u > (uint64_t)INT32_MAX) {
        if (v.is_signed)
            return rk_errorf(RK_ERR_FORMAT, "%s: key '%s' = %" PRId64 " does not fit in i32",
                             g->name, key, v.i);
        return rk_errorf(RK_ERR_FORMAT, "%s: key '%s' = %" PRIu64 " does not fit in i32", g->name,
                         key, v.u);
    }
    *out = (int32_t)(v.is_signed ? v.i : (int64_t)v.u);
    return RK_OK;
}

/* Get an integer key as u64 (any non-negative integer). */
rk_status rk_gguf_get_u64(const rk_gguf *g, const char *key, uint64_t *out) {
    rk_gguf_num v;
    const rk_gguf_kv *kv;
    rk_status st = kv_int(g, key, "an integer", &v, &kv);
    if (st) return st;
    if (v.is_signed && v.i < 0)
        return rk_errorf(RK_ERR_FORMAT, "%s: key '%s' = %" PRId64 " is negative, expected u64",
                         g->name, key, v.i);
    *out = v.is_signed ? (uint64_t)v.i : v.u;
    return RK_OK;
}

/* Get a float32 or float64 key as float. */
rk_status rk_gguf_get_f32(const rk_gguf *g, const char *key, float *out) {
    const rk_gguf_kv *kv;
    rk_status st = kv_find(g, key, &kv);
    if (st) return st;
    if (kv->type != RK_GGUF_FLOAT32 && kv->type != RK_GGUF_FLOAT64)
        return kv_type_error(g, kv, "f32 or f64");
    *out = (float)rk_gguf_decode_num(kv->type, kv->scalar).f;
    return RK_OK;
}

/* Get a bool key (any non-zero byte is true) as 0 or 1. */
rk_status rk_gguf_get_bool(const rk_gguf *g, const char *key, int *out) {
    const rk_gguf_kv *kv;
    rk_status st = kv_find(g, key, &kv);
    if (st) return st;
    if (kv->type != RK_GGUF_BOOL) return kv_type_error(g, kv, "bool");
    *out = kv->scalar[0] != 0;
    return RK_OK;
}

/* Get a string key; the string is owned by g. */
rk_status rk_gguf_get_str(const rk_gguf *g, const char *key, const char **out, size_t *out_len) {
    const rk_gguf_kv *kv;
    rk_status st = kv_find(g, key, &kv);
    if (st) return st;
    if (kv->type != RK_GGUF_STRING) return kv_type_error(g, kv, "string");
    *out = kv->str;
    if (out_len) *out_len = kv->str_len;
    return RK_OK;
}

/* Get an array of strings; the arrays are owned by g. */
rk_status rk_gguf_get_arr_str(const rk_gguf *g, const char *key, const char *const **out_strs,
                              const uint32_t **out_lens, size_t *out_n) {
    const rk_gguf_kv *kv;
    rk_status st = kv_find(g, key, &kv);
    if (st) return st;
    if (kv->type != RK_GGUF_ARRAY || kv->arr_type != RK_GGUF_STRING)
        return kv_type_error(g, kv, "an array of strings");
    *out_strs = (const char *const *)kv->arr_strs;
    if (out_lens) *out_lens = kv->arr_lens;
    *out_n = (size_t)kv->arr_n;
    return RK_OK;
}

/* Get a numeric array converted to float (any numeric or bool element type);
 * *out is malloc'ed and owned by the caller. */
rk_status rk_gguf_get_arr_f32(const rk_gguf *g, const char *key, float **out, size_t *out_n) {
    const rk_gguf_kv *kv;
    rk_status st = kv_find(g, key, &kv);
    if (st) return st;
    if (kv->type != RK_GGUF_ARRAY || kv->arr_type == RK_GGUF_STRING)
        return kv_type_error(g, kv, "a numeric array");
    size_t n = (size_t)kv->arr_n, es = rk_gguf_scalar_size(kv->arr_type);
    float *a = malloc((n ? n : 1) * sizeof *a);
    if (!a) return rk_errorf(RK_ERR_NOMEM, "%s: key '%s': out of memory", g->name, key);
    const uint8_t *p = kv->arr;
    for (size_t i = 0; i < n; i++) {
        rk_gguf_num v = rk_gguf_decode_num(kv->arr_type, p + i * es);
        a[i] = v.is_float ? (float)v.f : v.is_signed ? (float)v.i : (float)v.u;
    }
    *out = a;
    *out_n = n;
    return RK_OK;
}

/* Get an integer (or bool) array converted to i32; every value must fit.
 * *out is malloc'ed and owned by the caller. */
rk_status rk_gguf_get_arr_i32(const rk_gguf *g, const char *key, int32_t **out, size_t *out_n) {
    const rk_gguf_kv *kv;
    rk_status st = kv_find(g, key, &kv);
    if (st) return st;
    if (kv->type != RK_GGUF_ARRAY ||
        !(rk_gguf_is_int_type(kv->arr_type) || kv->arr_type == RK_GGUF_BOOL))
        return kv_type_error(g, kv, "an integer array");
    size_t n = (size_t)kv->arr_n, es = rk_gguf_scalar_size(kv->arr_type);
    int32_t *a = malloc((n ? n : 1) * sizeof *a);
    if (!a) return rk_errorf(RK_ERR_NOMEM, "%s: key '%s': out of memory", g->name, key);
    const uint8_t *p = kv->arr;
    for (size_t i = 0; i < n; i++) {
        rk_gguf_num v = rk_gguf_decode_num(kv->arr_type, p + i * es);
        bool fits = v.is_signed ? (v.i >= INT32_MIN && v.i <= INT32_MAX) : v.u <= INT32_MAX;
        if (!fits) {
            free(a);
            return rk_errorf(RK_ERR_FORMAT, "%s: key '%s': element %zu does not fit in i32",
                             g->name, key, i);
        }
        a[i] = v.is_signed ? (int32_t)v.i : (int32_t)v.u;
    }
    *out = a;
    *out_n = n;
    return RK_OK;
}
