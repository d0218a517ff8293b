/* engine/gguf.c — GGUF reader and writer (see gguf.h).
 *
 * ---------------------------------------------------------------- the format
 *
 * GGUF is the single-file model format of ggml / llama.cpp. Every number is
 * little-endian; there is no implicit padding between fields.
 *
 *   header
 *     u32     magic       "GGUF" (bytes 47 47 55 46, i.e. 0x46554747 read as u32)
 *     u32     version     1, 2 or 3; v1 used u32 counts and lengths (rejected
 *                         here), v2 and v3 use u64 (v3 only adds big-endian
 *                         files, which are flagged by the version reading as
 *                         0x03000000 and rejected)
 *     u64     n_tensors
 *     u64     n_kv
 *   n_kv metadata pairs
 *     string  key         a string is u64 byte length + that many bytes, no NUL
 *     u32     value type  rk_gguf_type (0..12)
 *     value               u8 i8 u16 i16 u32 i32 f32 bool(1 byte) string u64 i64 f64,
 *                         or an array: u32 element type, u64 count, then count
 *                         values of that type (packed; strings each carry their
 *                         own length). ggml never writes arrays of arrays and
 *                         this reader rejects them.
 *   n_tensors tensor infos
 *     string  name
 *     u32     n_dims      1..4
 *     u64     ne[n_dims]  elements per dimension, ne[0] the fastest-varying
 *     u32     type        ggml type (F32 = 0, F16 = 1, Q8_0 = 8, BF16 = 30, ...)
 *     u64     offset      of the tensor's data from the start of the data section;
 *                         a multiple of the alignment
 *   padding             zero bytes up to the next multiple of the alignment
 *   data section        the tensors' bytes; ggml and gguf-py write them in info
 *                       order, each padded to the alignment
 *
 * The alignment is the metadata key `general.alignment` (u32, a non-zero power
 * of two) or 32 when absent. A tensor's byte size follows from its type: types
 * are stored in blocks of blck elements taking type_size bytes, ne[0] must be a
 * multiple of blck, and n_bytes = ne[0] / blck * type_size * ne[1] * ne[2] * ne[3].
 * A matrix for y = W x with W of shape (out, in) is stored with ne = {in, out}.
 *
 * ---------------------------------------------------------------- the reader
 *
 * The whole file is mapped (or a caller buffer used) and parsed with a cursor
 * that checks every read against the bytes left. Counts are checked against
 * the smallest encoding their items could have before anything is allocated,
 * so a hostile count can never make us allocate more than a small multiple of
 * the file size. Metadata is copied; tensor data stays in the mapping. */
#include "engine/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/kernels.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF reader assumes a little-endian host"
#endif

#define GGUF_MAGIC             0x46554747u
#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_TYPE_COUNT        13u

/* ================================================================ ggml types */

typedef struct ggml_traits {
    const char *name;
    uint32_t blck;      /* elements per block; 0 = unknown / removed type */
    uint32_t type_size; /* bytes per block */
} ggml_traits;

static const ggml_traits k_ggml_traits[] = {
    [0] = {"F32", 1, 4},         [1] = {"F16", 1, 2},         [2] = {"Q4_0", 32, 18},
    [3] = {"Q4_1", 32, 20},      [6] = {"Q5_0", 32, 22},      [7] = {"Q5_1", 32, 24},
    [8] = {"Q8_0", 32, 34},      [9] = {"Q8_1", 32, 36},      [10] = {"Q2_K", 256, 84},
    [11] = {"Q3_K", 256, 110},   [12] = {"Q4_K", 256, 144},   [13] = {"Q5_K", 256, 176},
    [14] = {"Q6_K", 256, 210},   [15] = {"Q8_K", 256, 292},   [16] = {"IQ2_XXS", 256, 66},
    [17] = {"IQ2_XS", 256, 74},  [18] = {"IQ3_XXS", 256, 98}, [19] = {"IQ1_S", 256, 50},
    [20] = {"IQ4_NL", 32, 18},   [21] = {"IQ3_S", 256, 110},  [22] = {"IQ2_S", 256, 82},
    [23] = {"IQ4_XS", 256, 136}, [24] = {"I8", 1, 1},         [25] = {"I16", 1, 2},
    [26] = {"I32", 1, 4},        [27] = {"I64", 1, 8},        [28] = {"F64", 1, 8},
    [29] = {"IQ1_M", 256, 56},   [30] = {"BF16", 1, 2},       [34] = {"TQ1_0", 256, 54},
    [35] = {"TQ2_0", 256, 66},   [39] = {"MXFP4", 32, 17},
};

#define N_GGML_TRAITS (sizeof k_ggml_traits / sizeof k_ggml_traits[0])

static const ggml_traits *ggml_traits_of(uint32_t type) {
    if (type >= N_GGML_TRAITS || k_ggml_traits[type].blck == 0) return NULL;
    return &k_ggml_traits[type];
}

/* Return the name of a ggml type ("F32", "Q8_0", ...) or "?" when unknown. */
const char *rk_ggml_type_name(uint32_t type) {
    const ggml_traits *t = ggml_traits_of(type);
    return t ? t->name : "?";
}

/* Return the bytes taken by n_elements of a type, or 0 when the type is
 * unknown, n_elements is negative, not a whole number of blocks, or the size
 * overflows. */
size_t rk_ggml_type_row_bytes(uint32_t type, int64_t n_elements) {
    const ggml_traits *t = ggml_traits_of(type);
    if (!t || n_elements < 0 || (uint64_t)n_elements % t->blck != 0) return 0;
    uint64_t blocks = (uint64_t)n_elements / t->blck;
    if (blocks > SIZE_MAX / t->type_size) return 0;
    return (size_t)(blocks * t->type_size);
}

static const char *gguf_type_name(uint32_t t) {
    static const char *names[GGUF_TYPE_COUNT] = {"u8",  "i8",  "u16",  "i16",    "u32",
                                                 "i32", "f32", "bool", "string", "array",
                                                 "u64", "i64", "f64"};
    return t < GGUF_TYPE_COUNT ? names[t] : "?";
}

/* Size in bytes of a fixed-size value type, 0 for string, array and unknown. */
static size_t gguf_scalar_size(uint32_t t) {
    switch (t) {
    case RK_GGUF_UINT8:
    case RK_GGUF_INT8:
    case RK_GGUF_BOOL: return 1;
    case RK_GGUF_UINT16:
    case RK_GGUF_INT16: return 2;
    case RK_GGUF_UINT32:
    case RK_GGUF_INT32:
    case RK_GGUF_FLOAT32: return 4;
    case RK_GGUF_UINT64:
    case RK_GGUF_INT64:
    case RK_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

static bool is_int_type(uint32_t t) {
    return t == RK_GGUF_UINT8 || t == RK_GGUF_INT8 || t == RK_GGUF_UINT16 || t == RK_GGUF_INT16 ||
           t == RK_GGUF_UINT32 || t == RK_GGUF_INT32 || t == RK_GGUF_UINT64 || t == RK_GGUF_INT64;
}

static bool is_signed_type(uint32_t t) {
    return t == RK_GGUF_INT8 || t == RK_GGUF_INT16 || t == RK_GGUF_INT32 || t == RK_GGUF_INT64;
}

/* A decoded number: integers keep their sign, floats are widened to double. */
typedef struct num_value {
    bool is_signed;
    bool is_float;
    uint64_t u;
    int64_t i;
    double f;
} num_value;

/* The n-byte unsigned integer at p (file and host are little-endian: see the
 * check at the top). */
static uint64_t load_u(const uint8_t *p, size_t n) {
    uint64_t x = 0;
    memcpy(&x, p, n);
    return x;
}

/* Decode one little-endian value of fixed-size type t from p. */
static num_value decode_num(uint32_t t, const uint8_t *p) {
    num_value v = {0};
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

/* ================================================================ reader state */

typedef struct gguf_kv {
    char *key; /* NUL-terminated copy */
    uint32_t type;
    uint32_t arr_type; /* arrays only */
    uint64_t arr_n;    /* arrays only */
    uint8_t scalar[8]; /* fixed-size scalars, raw little-endian */
    char *str;         /* strings: NUL-terminated copy */
    size_t str_len;
    void *arr;          /* numeric arrays: raw copy of arr_n elements */
    char **arr_strs;    /* string arrays: (arr_n) pointers into arr_blob */
    uint32_t *arr_lens; /* string arrays: (arr_n) byte lengths */
    char *arr_blob;     /* string arrays: all strings, each NUL-terminated */
} gguf_kv;

struct rk_gguf {
    const uint8_t *base; /* the file's bytes */
    size_t size;
    void *map;  /* mmap'ed region (rk_gguf_open), NULL for memory */
    char *name; /* file name for messages, or "<memory>" */
    uint32_t version;
    size_t alignment;
    size_t data_offset; /* start of the data section */

    int64_t n_kv;
    gguf_kv *kvs;       /* (n_kv) in file order */
    int64_t *kv_sorted; /* (n_kv) indices sorted by key */

    int64_t n_tensors;
    rk_gguf_tensor *tensors; /* (n_tensors) in file order */
    char **tensor_names;     /* (n_tensors) owned copies */
    int64_t *t_sorted;       /* (n_tensors) indices sorted by name */
};

/* A bounds-checked read position over the file. */
typedef struct cursor {
    const uint8_t *p;
    size_t size;
    size_t pos;
    const char *name;
} cursor;

static size_t cur_left(const cursor *c) { return c->size - c->pos; }

/* Read n bytes into dst (may be NULL to skip); what names the field. */
static rk_status cur_read(cursor *c, void *dst, size_t n, const char *what) {
    if (n > cur_left(c))
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: truncated at offset %zu reading %s (need %zu bytes, %zu left)",
                         c->name, c->pos, what, n, cur_left(c));
    if (dst) memcpy(dst, c->p + c->pos, n);
    c->pos += n;
    return RK_OK;
}

static rk_status cur_u32(cursor *c, uint32_t *v, const char *what) {
    return cur_read(c, v, 4, what);
}
static rk_status cur_u64(cursor *c, uint64_t *v, const char *what) {
    return cur_read(c, v, 8, what);
}

/* Read a string's length and check that its bytes are in the file; on success
 * *out_s points at the bytes (not NUL-terminated) and the cursor is past them. */
static rk_status cur_str_view(cursor *c, const uint8_t **out_s, uint64_t *out_len,
                              const char *what) {
    size_t at = c->pos;
    uint64_t len;
    rk_status st = cur_u64(c, &len, what);
    if (st) return st;
    if (len > cur_left(c))
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: %s at offset %zu has length %" PRIu64
                         " past the end of the file (%zu bytes left)",
                         c->name, what, at, len, cur_left(c));
    *out_s = c->p + c->pos;
    *out_len = len;
    c->pos += (size_t)len;
    return RK_OK;
}

/* Copy a string as a NUL-terminated heap string. Names (keys and tensor names)
 * must be non-empty and free of NUL bytes. */
static rk_status cur_name(cursor *c, char **out, const char *what) {
    size_t at = c->pos;
    const uint8_t *s;
    uint64_t len;
    rk_status st = cur_str_view(c, &s, &len, what);
    if (st) return st;
    if (len == 0) return rk_errorf(RK_ERR_FORMAT, "%s: empty %s at offset %zu", c->name, what, at);
    if (memchr(s, 0, (size_t)len))
        return rk_errorf(RK_ERR_FORMAT, "%s: %s at offset %zu contains a NUL byte", c->name, what,
                         at);
    char *copy = malloc((size_t)len + 1);
    if (!copy) return rk_errorf(RK_ERR_NOMEM, "%s: out of memory reading %s", c->name, what);
    memcpy(copy, s, (size_t)len);
    copy[len] = '\0';
    *out = copy;
    return RK_OK;
}

static void kv_free(gguf_kv *kv) {
    free(kv->key);
    free(kv->str);
    free(kv->arr);
    free(kv->arr_strs);
    free(kv->arr_lens);
    free(kv->arr_blob);
}

/* Read an array of strings: validate every length in a first pass, then copy
 * all strings into one block. */
static rk_status read_str_array(cursor *c, gguf_kv *kv) {
    size_t start = c->pos;
    uint64_t n = kv->arr_n;
    if (n > cur_left(c) / 8)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: key '%s': array of %" PRIu64
                         " strings cannot fit in the %zu bytes left at offset %zu",
                         c->name, kv->key, n, cur_left(c), c->pos);
    size_t total = 0;
    for (uint64_t i = 0; i < n; i++) {
        size_t at = c->pos;
        uint64_t len;
        if (cur_left(c) < 8)
            return rk_errorf(
                RK_ERR_FORMAT,
                "%s: key '%s': truncated at offset %zu reading the length of string %" PRIu64,
                c->name, kv->key, at, i);
        memcpy(&len, c->p + c->pos, 8);
        c->pos += 8;
        if (len > cur_left(c))
            return rk_errorf(RK_ERR_FORMAT,
                             "%s: key '%s': string %" PRIu64 " at offset %zu has length %" PRIu64
                             " past the end of the file (%zu bytes left)",
                             c->name, kv->key, i, at, len, cur_left(c));
        c->pos += (size_t)len;
        if (len > UINT32_MAX)
            return rk_errorf(RK_ERR_FORMAT,
                             "%s: key '%s': element %" PRIu64 " is longer than 4 GiB", c->name,
                             kv->key, i);
        total += (size_t)len + 1; /* bounded by the file size plus n */
    }
    c->pos = start;
    size_t n_alloc = n ? (size_t)n : 1;
    kv->arr_strs = malloc(n_alloc * sizeof *kv->arr_strs);
    kv->arr_lens = malloc(n_alloc * sizeof *kv->arr_lens);
    kv->arr_blob = malloc(total ? total : 1);
    if (!kv->arr_strs || !kv->arr_lens || !kv->arr_blob)
        return rk_errorf(RK_ERR_NOMEM, "%s: key '%s': out of memory for %" PRIu64 " strings",
                         c->name, kv->key, n);
    char *dst = kv->arr_blob;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t len;
        memcpy(&len, c->p + c->pos, 8);
        c->pos += 8;
        memcpy(dst, c->p + c->pos, (size_t)len);
        c->pos += (size_t)len;
        dst[len] = '\0';
        kv->arr_strs[i] = dst;
        kv->arr_lens[i] = (uint32_t)len;
        dst += len + 1;
    }
    return RK_OK;
}

/* Read one metadata pair; kv is zeroed by the caller and freed by it on error. */
static rk_status read_kv(cursor *c, int64_t index, gguf_kv *kv) {
    size_t at = c->pos;
    char what[64];
    snprintf(what, sizeof what, "key of metadata pair %" PRId64, index);
    rk_status st = cur_name(c, &kv->key, what);
    if (st) return st;
    char vwhat[320];
    snprintf(vwhat, sizeof vwhat, "value of key '%.200s'", kv->key);
    st = cur_u32(c, &kv->type, vwhat);
    if (st) return st;
    if (kv->type >= GGUF_TYPE_COUNT)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: key '%s' at offset %zu has unknown value type %" PRIu32, c->name,
                         kv->key, at, kv->type);
    if (kv->type == RK_GGUF_STRING) {
        const uint8_t *s;
        uint64_t len;
        st = cur_str_view(c, &s, &len, vwhat);
        if (st) return st;
        kv->str = malloc((size_t)len + 1);
        if (!kv->str)
            return rk_errorf(RK_ERR_NOMEM, "%s: key '%s': out of memory", c->name, kv->key);
        memcpy(kv->str, s, (size_t)len);
        kv->str[len] = '\0';
        kv->str_len = (size_t)len;
        return RK_OK;
    }
    if (kv->type != RK_GGUF_ARRAY)
        return cur_read(c, kv->scalar, gguf_scalar_size(kv->type), vwhat);

    st = cur_u32(c, &kv->arr_type, vwhat);
    if (st) return st;
    st = cur_u64(c, &kv->arr_n, vwhat);
    if (st) return st;
    if (kv->arr_type == RK_GGUF_ARRAY)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: key '%s' at offset %zu is an array of arrays (not supported)",
                         c->name, kv->key, at);
    if (kv->arr_type >= GGUF_TYPE_COUNT)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: key '%s' at offset %zu is an array of unknown type %" PRIu32, c->name,
                         kv->key, at, kv->arr_type);
    if (kv->arr_type == RK_GGUF_STRING) return read_str_array(c, kv);
    size_t esize = gguf_scalar_size(kv->arr_type);
    if (kv->arr_n > cur_left(c) / esize)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: key '%s' at offset %zu: array of %" PRIu64
                         " %s elements runs past the end of the file (%zu bytes left)",
                         c->name, kv->key, at, kv->arr_n, gguf_type_name(kv->arr_type),
                         cur_left(c));
    size_t n_bytes = (size_t)kv->arr_n * esize;
    kv->arr = malloc(n_bytes ? n_bytes : 1);
    if (!kv->arr) return rk_errorf(RK_ERR_NOMEM, "%s: key '%s': out of memory", c->name, kv->key);
    return cur_read(c, kv->arr, n_bytes, vwhat);
}

/* Read one tensor info into t (name stored in *out_name). */
static rk_status read_tensor_info(cursor *c, int64_t index, rk_gguf_tensor *t, char **out_name) {
    size_t at = c->pos;
    char what[64];
    snprintf(what, sizeof what, "name of tensor %" PRId64, index);
    rk_status st = cur_name(c, out_name, what);
    if (st) return st;
    const char *name = *out_name;
    t->name = name;
    char twhat[320];
    snprintf(twhat, sizeof twhat, "info of tensor '%.200s'", name);
    st = cur_u32(c, &t->n_dims, twhat);
    if (st) return st;
    if (t->n_dims == 0 || t->n_dims > RK_GGUF_MAX_DIMS)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: tensor '%s' at offset %zu has %" PRIu32 " dimensions (1..%d allowed)",
                         c->name, name, at, t->n_dims, RK_GGUF_MAX_DIMS);
    uint64_t n_elem = 1;
    for (uint32_t d = 0; d < RK_GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        uint64_t ne;
        st = cur_u64(c, &ne, twhat);
        if (st) return st;
        if (ne == 0 || ne > (uint64_t)INT64_MAX)
            return rk_errorf(RK_ERR_FORMAT,
                             "%s: tensor '%s' at offset %zu: dimension %" PRIu32 " is %" PRId64
                             " (must be positive)",
                             c->name, name, at, d, (int64_t)ne);
        if (n_elem > (uint64_t)INT64_MAX / ne)
            return rk_errorf(RK_ERR_FORMAT,
                             "%s: tensor '%s' at offset %zu: element count overflows", c->name,
                             name, at);
        n_elem *= ne;
        t->ne[d] = (int64_t)ne;
    }
    st = cur_u32(c, &t->type, twhat);
    if (st) return st;
    const ggml_traits *tr = ggml_traits_of(t->type);
    if (!tr)
        return rk_errorf(RK_ERR_FORMAT, "%s: tensor '%s' at offset %zu has unknown type %" PRIu32,
                         c->name, name, at, t->type);
    if ((uint64_t)t->ne[0] % tr->blck != 0)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: tensor '%s': ne[0] = %" PRId64
                         " is not a multiple of the %s block size %" PRIu32,
                         c->name, name, t->ne[0], tr->name, tr->blck);
    uint64_t blocks = n_elem / tr->blck;
    if (blocks > SIZE_MAX / tr->type_size)
        return rk_errorf(RK_ERR_FORMAT, "%s: tensor '%s': byte size overflows", c->name, name);
    t->n_bytes = (size_t)(blocks * tr->type_size);
    return cur_u64(c, &t->offset, twhat);
}

/* qsort has no context argument in C11, so the comparators read the file being
 * sorted from a thread-local (parsing may run in several threads at once). */
static _Thread_local const rk_gguf *t_sort_ctx;

static int cmp_kv_idx(const void *a, const void *b) {
    const gguf_kv *kvs = t_sort_ctx->kvs;
    return strcmp(kvs[*(const int64_t *)a].key, kvs[*(const int64_t *)b].key);
}

static int cmp_tensor_name(const void *a, const void *b) {
    const rk_gguf_tensor *ts = t_sort_ctx->tensors;
    return strcmp(ts[*(const int64_t *)a].name, ts[*(const int64_t *)b].name);
}

static int cmp_tensor_offset(const void *a, const void *b) {
    const rk_gguf_tensor *ts = t_sort_ctx->tensors;
    uint64_t x = ts[*(const int64_t *)a].offset, y = ts[*(const int64_t *)b].offset;
    return x < y ? -1 : x > y;
}

static void sort_idx(const rk_gguf *g, int64_t *idx, int64_t n,
                     int (*cmp)(const void *, const void *)) {
    for (int64_t i = 0; i < n; i++) idx[i] = i;
    t_sort_ctx = g;
    qsort(idx, (size_t)n, sizeof *idx, cmp);
}

static const char *kv_key_of(const rk_gguf *g, int64_t i) { return g->kvs[i].key; }
static const char *tensor_name_of(const rk_gguf *g, int64_t i) { return g->tensors[i].name; }

/* A name two of the n entries share, given their indices sorted by name;
 * NULL when all differ. */
static const char *shared_name(const rk_gguf *g, const int64_t *sorted, int64_t n,
                               const char *(*name_of)(const rk_gguf *, int64_t)) {
    for (int64_t i = 1; i < n; i++)
        if (strcmp(name_of(g, sorted[i - 1]), name_of(g, sorted[i])) == 0)
            return name_of(g, sorted[i]);
    return NULL;
}

/* The magic and a version this reader knows. */
static rk_status read_header(rk_gguf *g, cursor *c) {
    uint32_t magic;
    rk_status st = cur_u32(c, &magic, "magic");
    if (st) return st;
    if (magic != GGUF_MAGIC)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: not a GGUF file (magic 0x%08" PRIx32 ", expected \"GGUF\")", g->name,
                         magic);
    st = cur_u32(c, &g->version, "version");
    if (st) return st;
    if (g->version == 1)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: GGUF version 1 is not supported (only versions 2 and 3; re-convert "
                         "the model)",
                         g->name);
    if (g->version != 2 && g->version != 3) {
        if ((g->version & 0xFFFFu) == 0)
            return rk_errorf(RK_ERR_FORMAT,
                             "%s: GGUF version 0x%08" PRIx32
                             " looks byte-swapped: big-endian files are not supported",
                             g->name, g->version);
        return rk_errorf(RK_ERR_FORMAT, "%s: unsupported GGUF version %" PRIu32 " (only 2 and 3)",
                         g->name, g->version);
    }
    return RK_OK;
}

/* The metadata pairs, sorted by key for lookups; keys must be distinct. */
static rk_status read_kvs(rk_gguf *g, cursor *c, uint64_t n_kv) {
    g->kvs = calloc(n_kv ? (size_t)n_kv : 1, sizeof *g->kvs);
    g->kv_sorted = malloc((n_kv ? (size_t)n_kv : 1) * sizeof *g->kv_sorted);
    if (!g->kvs || !g->kv_sorted) return rk_errorf(RK_ERR_NOMEM, "%s: out of memory", g->name);
    for (uint64_t i = 0; i < n_kv; i++) {
        g->n_kv = (int64_t)i + 1; /* so close() frees the partial pair */
        rk_status st = read_kv(c, (int64_t)i, &g->kvs[i]);
        if (st) return st;
    }
    g->n_kv = (int64_t)n_kv;
    sort_idx(g, g->kv_sorted, g->n_kv, cmp_kv_idx);
    const char *dup = shared_name(g, g->kv_sorted, g->n_kv, kv_key_of);
    if (dup) return rk_errorf(RK_ERR_FORMAT, "%s: duplicate metadata key '%s'", g->name, dup);
    return RK_OK;
}

/* general.alignment, when set: a u32 power of two. */
static rk_status read_alignment(rk_gguf *g) {
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t ai = rk_gguf_find_key(g, "general.alignment");
    if (ai >= 0) {
        const gguf_kv *kv = &g->kvs[ai];
        if (kv->type != RK_GGUF_UINT32)
            return rk_errorf(RK_ERR_FORMAT, "%s: general.alignment has type %s (must be u32)",
                             g->name, gguf_type_name(kv->type));
        uint32_t a;
        memcpy(&a, kv->scalar, 4);
        if (a == 0 || (a & (a - 1)) != 0)
            return rk_errorf(RK_ERR_FORMAT,
                             "%s: general.alignment = %" PRIu32 " is not a power of two", g->name,
                             a);
        g->alignment = a;
    }
    return RK_OK;
}

/* The tensor infos. */
static rk_status read_tensors(rk_gguf *g, cursor *c, uint64_t n_tensors) {
    g->tensors = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *g->tensors);
    g->tensor_names = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *g->tensor_names);
    g->t_sorted = malloc((n_tensors ? (size_t)n_tensors : 1) * sizeof *g->t_sorted);
    if (!g->tensors || !g->tensor_names || !g->t_sorted)
        return rk_errorf(RK_ERR_NOMEM, "%s: out of memory", g->name);
    for (uint64_t i = 0; i < n_tensors; i++) {
        g->n_tensors = (int64_t)i + 1;
        rk_status st = read_tensor_info(c, (int64_t)i, &g->tensors[i], &g->tensor_names[i]);
        if (st) return st;
    }
    g->n_tensors = (int64_t)n_tensors;
    return RK_OK;
}

/* The data section from the aligned offset after pos: every tensor aligned,
 * inside it, not overlapping another, and named once. */
static rk_status place_tensors(rk_gguf *g, size_t pos) {
    /* The data section starts at the next multiple of the alignment. */
    size_t pad = (g->alignment - pos % g->alignment) % g->alignment;
    if (pad > SIZE_MAX - pos) return rk_errorf(RK_ERR_FORMAT, "%s: data offset overflows", g->name);
    g->data_offset = pos + pad;
    if (g->n_tensors > 0 && g->data_offset > g->size)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: truncated: the data section would start at %zu, past the end of the "
                         "file (%zu bytes)",
                         g->name, g->data_offset, g->size);
    size_t data_size = g->n_tensors > 0 ? g->size - g->data_offset : 0;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        rk_gguf_tensor *t = &g->tensors[i];
        if (t->offset % g->alignment != 0)
            return rk_errorf(RK_ERR_FORMAT,
                             "%s: tensor '%s' has offset %" PRIu64
                             " not a multiple of the alignment %zu",
                             g->name, t->name, t->offset, g->alignment);
        if (t->offset > data_size || t->n_bytes > data_size - t->offset)
            return rk_errorf(RK_ERR_FORMAT,
                             "%s: tensor '%s' (offset %" PRIu64
                             ", %zu bytes) lies outside the data section (%zu bytes at %zu)",
                             g->name, t->name, t->offset, t->n_bytes, data_size, g->data_offset);
        t->data = g->base + g->data_offset + t->offset;
    }
    sort_idx(g, g->t_sorted, g->n_tensors, cmp_tensor_offset);
    for (int64_t i = 1; i < g->n_tensors; i++) {
        const rk_gguf_tensor *a = &g->tensors[g->t_sorted[i - 1]];
        const rk_gguf_tensor *b = &g->tensors[g->t_sorted[i]];
        if (a->offset + a->n_bytes > b->offset)
            return rk_errorf(RK_ERR_FORMAT,
                             "%s: tensors '%s' (offset %" PRIu64
                             ", %zu bytes) and '%s' (offset %" PRIu64 ") overlap",
                             g->name, a->name, a->offset, a->n_bytes, b->name, b->offset);
    }
    sort_idx(g, g->t_sorted, g->n_tensors, cmp_tensor_name);
    const char *dup = shared_name(g, g->t_sorted, g->n_tensors, tensor_name_of);
    if (dup) return rk_errorf(RK_ERR_FORMAT, "%s: duplicate tensor name '%s'", g->name, dup);
    return RK_OK;
}

/* Parse the file held in g->base / g->size. */
static rk_status gguf_parse(rk_gguf *g) {
    cursor c = {g->base, g->size, 0, g->name};
    rk_status st = read_header(g, &c);
    if (st) return st;
    uint64_t n_tensors, n_kv;
    if ((st = cur_u64(&c, &n_tensors, "tensor count"))) return st;
    if ((st = cur_u64(&c, &n_kv, "metadata count"))) return st;
    /* A pair takes at least 8 (key length) + 1 (key) + 4 (type) + 1 (value) bytes,
     * a tensor info at least 8 + 1 + 4 + 8 + 4 + 8. */
    if (n_kv > cur_left(&c) / 14)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: metadata count %" PRIu64 " cannot fit in the %zu bytes of the file",
                         g->name, n_kv, g->size);
    if (n_tensors > cur_left(&c) / 33)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: tensor count %" PRIu64 " cannot fit in the %zu bytes of the file",
                         g->name, n_tensors, g->size);
    if ((st = read_kvs(g, &c, n_kv)) || (st = read_alignment(g)) ||
        (st = read_tensors(g, &c, n_tensors)))
        return st;
    return place_tensors(g, c.pos);
}

static rk_status gguf_new(const char *name, rk_gguf **out) {
    rk_gguf *g = calloc(1, sizeof *g);
    size_t n = strlen(name) + 1;
    char *copy = malloc(n);
    if (!g || !copy) {
        free(g);
        free(copy);
        return rk_errorf(RK_ERR_NOMEM, "%s: out of memory", name);
    }
    memcpy(copy, name, n);
    g->name = copy;
    *out = g;
    return RK_OK;
}

/* Open path, map it read-only and validate it; see gguf.h. */
rk_status rk_gguf_open(const char *path, rk_gguf **out) {
    if (!path || !out) return rk_errorf(RK_ERR_INVALID, "rk_gguf_open: NULL argument");
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return rk_errorf(RK_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return rk_errorf(RK_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return rk_errorf(RK_ERR_IO, "%s: not a regular file", path);
    }
    if (sb.st_size == 0) {
        close(fd);
        return rk_errorf(RK_ERR_FORMAT, "%s: empty file (0 bytes), not a GGUF file", path);
    }
    if ((uint64_t)sb.st_size > SIZE_MAX) {
        close(fd);
        return rk_errorf(RK_ERR_IO, "%s: file too large to map", path);
    }
    size_t size = (size_t)sb.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return rk_errorf(RK_ERR_IO, "%s: cannot mmap: %s", path, strerror(e));
    rk_gguf *g;
    rk_status st = gguf_new(path, &g);
    if (st) {
        munmap(map, size);
        return st;
    }
    g->map = map;
    g->base = map;
    g->size = size;
    st = gguf_parse(g);
    if (st) {
        rk_gguf_close(g);
        return st;
    }
    *out = g;
    return RK_OK;
}

/* Parse a caller-owned buffer; see gguf.h. */
rk_status rk_gguf_open_memory(const void *data, size_t size, rk_gguf **out) {
    if (!out || (!data && size))
        return rk_errorf(RK_ERR_INVALID, "rk_gguf_open_memory: NULL argument");
    *out = NULL;
    rk_gguf *g;
    rk_status st = gguf_new("<memory>", &g);
    if (st) return st;
    g->base = data;
    g->size = size;
    st = gguf_parse(g);
    if (st) {
        rk_gguf_close(g);
        return st;
    }
    *out = g;
    return RK_OK;
}

/* Free the metadata copies and unmap the file; accepts NULL. */
void rk_gguf_close(rk_gguf *g) {
    if (!g) return;
    if (g->kvs)
        for (int64_t i = 0; i < g->n_kv; i++) kv_free(&g->kvs[i]);
    free(g->kvs);
    free(g->kv_sorted);
    if (g->tensor_names)
        for (int64_t i = 0; i < g->n_tensors; i++) free(g->tensor_names[i]);
    free(g->tensor_names);
    free(g->tensors);
    free(g->t_sorted);
    if (g->map) munmap(g->map, g->size);
    free(g->name);
    free(g);
}

/* Return the file's GGUF version (2 or 3). */
uint32_t rk_gguf_version(const rk_gguf *g) { return g->version; }
/* Return the data alignment (general.alignment or 32). */
size_t rk_gguf_alignment(const rk_gguf *g) { return g->alignment; }
/* Return the size of the file in bytes. */
size_t rk_gguf_file_size(const rk_gguf *g) { return g->size; }

/* ================================================================ metadata */

/* Return the number of metadata pairs. */
int64_t rk_gguf_n_kv(const rk_gguf *g) { return g->n_kv; }

static const gguf_kv *kv_at(const rk_gguf *g, int64_t i) {
    return (i >= 0 && i < g->n_kv) ? &g->kvs[i] : NULL;
}

/* Return the key of pair i (owned by g), or NULL when i is out of range. */
const char *rk_gguf_kv_key(const rk_gguf *g, int64_t i) {
    const gguf_kv *kv = kv_at(g, i);
    return kv ? kv->key : NULL;
}

/* Return the value type of pair i; i must be in range. */
rk_gguf_type rk_gguf_kv_type(const rk_gguf *g, int64_t i) {
    const gguf_kv *kv = kv_at(g, i);
    return kv ? (rk_gguf_type)kv->type : RK_GGUF_UINT8;
}

/* Return the element type of array pair i (0 for non-arrays). */
rk_gguf_type rk_gguf_kv_arr_type(const rk_gguf *g, int64_t i) {
    const gguf_kv *kv = kv_at(g, i);
    return (kv && kv->type == RK_GGUF_ARRAY) ? (rk_gguf_type)kv->arr_type : RK_GGUF_UINT8;
}

/* Return the element count of array pair i (0 for non-arrays). */
uint64_t rk_gguf_kv_arr_n(const rk_gguf *g, int64_t i) {
    const gguf_kv *kv = kv_at(g, i);
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
static rk_status kv_find(const rk_gguf *g, const char *key, const gguf_kv **out) {
    int64_t i = rk_gguf_find_key(g, key);
    if (i < 0) return RK_ERR_NOT_FOUND;
    *out = &g->kvs[i];
    return RK_OK;
}

static rk_status kv_type_error(const rk_gguf *g, const gguf_kv *kv, const char *wanted) {
    if (kv->type == RK_GGUF_ARRAY)
        return rk_errorf(RK_ERR_FORMAT, "%s: key '%s' is an array of %s, expected %s", g->name,
                         kv->key, gguf_type_name(kv->arr_type), wanted);
    return rk_errorf(RK_ERR_FORMAT, "%s: key '%s' has type %s, expected %s", g->name, kv->key,
                     gguf_type_name(kv->type), wanted);
}

/* Read an integer-typed scalar as a signed/unsigned pair. */
static rk_status kv_int(const rk_gguf *g, const char *key, const char *wanted, num_value *out,
                        const gguf_kv **out_kv) {
    const gguf_kv *kv;
    rk_status st = kv_find(g, key, &kv);
    if (st) return st;
    if (!is_int_type(kv->type)) return kv_type_error(g, kv, wanted);
    *out = decode_num(kv->type, kv->scalar);
    *out_kv = kv;
    return RK_OK;
}

/* Get an integer key as u32 (any integer type whose value fits). */
rk_status rk_gguf_get_u32(const rk_gguf *g, const char *key, uint32_t *out) {
    num_value v;
    const gguf_kv *kv;
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
    num_value v;
    const gguf_kv *kv;
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
    num_value v;
    const gguf_kv *kv;
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
    const gguf_kv *kv;
    rk_status st = kv_find(g, key, &kv);
    if (st) return st;
    if (kv->type != RK_GGUF_FLOAT32 && kv->type != RK_GGUF_FLOAT64)
        return kv_type_error(g, kv, "f32 or f64");
    *out = (float)decode_num(kv->type, kv->scalar).f;
    return RK_OK;
}

/* Get a bool key (any non-zero byte is true) as 0 or 1. */
rk_status rk_gguf_get_bool(const rk_gguf *g, const char *key, int *out) {
    const gguf_kv *kv;
    rk_status st = kv_find(g, key, &kv);
    if (st) return st;
    if (kv->type != RK_GGUF_BOOL) return kv_type_error(g, kv, "bool");
    *out = kv->scalar[0] != 0;
    return RK_OK;
}

/* Get a string key; the string is owned by g. */
rk_status rk_gguf_get_str(const rk_gguf *g, const char *key, const char **out, size_t *out_len) {
    const gguf_kv *kv;
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
    const gguf_kv *kv;
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
    const gguf_kv *kv;
    rk_status st = kv_find(g, key, &kv);
    if (st) return st;
    if (kv->type != RK_GGUF_ARRAY || kv->arr_type == RK_GGUF_STRING)
        return kv_type_error(g, kv, "a numeric array");
    size_t n = (size_t)kv->arr_n, es = gguf_scalar_size(kv->arr_type);
    float *a = malloc((n ? n : 1) * sizeof *a);
    if (!a) return rk_errorf(RK_ERR_NOMEM, "%s: key '%s': out of memory", g->name, key);
    const uint8_t *p = kv->arr;
    for (size_t i = 0; i < n; i++) {
        num_value v = decode_num(kv->arr_type, p + i * es);
        a[i] = v.is_float ? (float)v.f : v.is_signed ? (float)v.i : (float)v.u;
    }
    *out = a;
    *out_n = n;
    return RK_OK;
}

/* Get an integer (or bool) array converted to i32; every value must fit.
 * *out is malloc'ed and owned by the caller. */
rk_status rk_gguf_get_arr_i32(const rk_gguf *g, const char *key, int32_t **out, size_t *out_n) {
    const gguf_kv *kv;
    rk_status st = kv_find(g, key, &kv);
    if (st) return st;
    if (kv->type != RK_GGUF_ARRAY || !(is_int_type(kv->arr_type) || kv->arr_type == RK_GGUF_BOOL))
        return kv_type_error(g, kv, "an integer array");
    size_t n = (size_t)kv->arr_n, es = gguf_scalar_size(kv->arr_type);
    int32_t *a = malloc((n ? n : 1) * sizeof *a);
    if (!a) return rk_errorf(RK_ERR_NOMEM, "%s: key '%s': out of memory", g->name, key);
    const uint8_t *p = kv->arr;
    for (size_t i = 0; i < n; i++) {
        num_value v = decode_num(kv->arr_type, p + i * es);
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

/* ================================================================ tensors */

/* Return the number of tensors. */
int64_t rk_gguf_n_tensors(const rk_gguf *g) { return g->n_tensors; }

/* Return tensor i (owned by g), or NULL when out of range. */
const rk_gguf_tensor *rk_gguf_tensor_at(const rk_gguf *g, int64_t i) {
    return (i >= 0 && i < g->n_tensors) ? &g->tensors[i] : NULL;
}

/* Return the tensor called name (binary search), or NULL. */
const rk_gguf_tensor *rk_gguf_find_tensor(const rk_gguf *g, const char *name) {
    if (!g || !name) return NULL;
    int64_t lo = 0, hi = g->n_tensors - 1;
    while (lo <= hi) {
        int64_t mid = lo + (hi - lo) / 2;
        const rk_gguf_tensor *t = &g->tensors[g->t_sorted[mid]];
        int c = strcmp(t->name, name);
        if (c == 0) return t;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return NULL;
}

int64_t rk_gguf_tensor_first_nonfinite(const rk_gguf_tensor *t) {
    switch (t->type) {
    case RK_GGML_F32: return rk_dtype_first_nonfinite(RK_DTYPE_F32, t->data, t->n_bytes / 4);
    case RK_GGML_F16: return rk_dtype_first_nonfinite(RK_DTYPE_F16, t->data, t->n_bytes / 2);
    case RK_GGML_BF16: return rk_dtype_first_nonfinite(RK_DTYPE_BF16, t->data, t->n_bytes / 2);
    }
    return -1;
}

/* ================================================================ info printer */

/* Print s (len bytes) quoted, escaping control bytes, cut after max bytes. */
static void print_quoted(FILE *out, const char *s, size_t len, size_t max) {
    fputc('"', out);
    size_t n = len < max ? len : max;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\')
            fprintf(out, "\\%c", ch);
        else if (ch == '\n')
            fputs("\\n", out);
        else if (ch == '\t')
            fputs("\\t", out);
        else if (ch < 0x20 || ch == 0x7f)
            fprintf(out, "\\x%02x", ch);
        else
            fputc(ch, out);
    }
    fputc('"', out);
    if (n < len) fputs("...", out);
}

static void print_num(FILE *out, uint32_t type, const uint8_t *p) {
    num_value v = decode_num(type, p);
    if (type == RK_GGUF_BOOL)
        fputs(v.u ? "true" : "false", out);
    else if (v.is_float)
        fprintf(out, "%.9g", v.f);
    else if (v.is_signed)
        fprintf(out, "%" PRId64, v.i);
    else
        fprintf(out, "%" PRIu64, v.u);
}

static void print_kv_value(FILE *out, const gguf_kv *kv) {
    if (kv->type == RK_GGUF_STRING) {
        print_quoted(out, kv->str, kv->str_len, 72);
        return;
    }
    if (kv->type != RK_GGUF_ARRAY) {
        print_num(out, kv->type, kv->scalar);
        return;
    }
    fprintf(out, "%s[%" PRIu64 "]", gguf_type_name(kv->arr_type), kv->arr_n);
    uint64_t show = kv->arr_n < 5 ? kv->arr_n : 5;
    for (uint64_t i = 0; i < show; i++) {
        fputs(i ? ", " : ": ", out);
        if (kv->arr_type == RK_GGUF_STRING)
            print_quoted(out, kv->arr_strs[i], kv->arr_lens[i], 24);
        else
            print_num(out, kv->arr_type,
                      (const uint8_t *)kv->arr + i * gguf_scalar_size(kv->arr_type));
    }
    if (show < kv->arr_n) fputs(", ...", out);
}

/* Print the text of token id from tokenizer.ggml.tokens, or nothing. */
static void print_token_text(FILE *out, const rk_gguf *g, uint32_t id) {
    const char *const *toks;
    const uint32_t *lens;
    size_t n;
    if (rk_gguf_get_arr_str(g, "tokenizer.ggml.tokens", &toks, &lens, &n) == RK_OK) {
        if (id < n) {
            fputc(' ', out);
            print_quoted(out, toks[id], lens[id], 32);
        } else {
            fputs(" (not a token: unset)", out);
        }
    }
    rk_error_clear();
}

/* Print a human-readable summary of the file to out: header, every metadata
 * pair (arrays summarised), a tokenizer summary, the tensor table and totals. */
void rk_gguf_print_info(const rk_gguf *g, FILE *out) {
    fprintf(out, "file:         %s\n", g->name);
    fprintf(out, "size:         %zu bytes\n", g->size);
    fprintf(out, "gguf version: %" PRIu32 "\n", g->version);
    fprintf(out, "alignment:    %zu (data section at offset %zu)\n", g->alignment, g->data_offset);
    const char *arch = NULL;
    if (rk_gguf_get_str(g, "general.architecture", &arch, NULL) != RK_OK) arch = NULL;
    rk_error_clear();
    fprintf(out, "architecture: %s\n", arch ? arch : "(none)");

    fprintf(out, "\nmetadata (%" PRId64 " keys):\n", g->n_kv);
    for (int64_t i = 0; i < g->n_kv; i++) {
        const gguf_kv *kv = &g->kvs[i];
        fprintf(out, "  %-44s %-7s ", kv->key, gguf_type_name(kv->type));
        print_kv_value(out, kv);
        fputc('\n', out);
    }

    const char *model = NULL, *pre = NULL;
    const char *const *toks;
    const uint32_t *lens;
    size_t n_tok = 0, n_merges = 0;
    if (rk_gguf_get_str(g, "tokenizer.ggml.model", &model, NULL) != RK_OK) model = NULL;
    if (rk_gguf_get_str(g, "tokenizer.ggml.pre", &pre, NULL) != RK_OK) pre = NULL;
    if (rk_gguf_get_arr_str(g, "tokenizer.ggml.tokens", &toks, &lens, &n_tok) != RK_OK) n_tok = 0;
    if (rk_gguf_get_arr_str(g, "tokenizer.ggml.merges", &toks, &lens, &n_merges) != RK_OK)
        n_merges = 0;
    rk_error_clear();
    if (model || n_tok) {
        fprintf(out, "\ntokenizer: model %s, pre %s, %zu tokens, %zu merges\n",
                model ? model : "(none)", pre ? pre : "(none)", n_tok, n_merges);
        static const char *ids[] = {"bos", "eos", "unknown", "padding"};
        for (size_t k = 0; k < sizeof ids / sizeof ids[0]; k++) {
            char key[64];
            snprintf(key, sizeof key, "tokenizer.ggml.%s_token_id", ids[k]);
            uint32_t id;
            if (rk_gguf_get_u32(g, key, &id) != RK_OK) {
                rk_error_clear();
                continue;
            }
            fprintf(out, "  %-8s %" PRIu32, ids[k], id);
            print_token_text(out, g, id);
            fputc('\n', out);
        }
    }

    fprintf(out, "\ntensors (%" PRId64 "):\n", g->n_tensors);
    fprintf(out, "  %-40s %-6s %-28s %14s %6s\n", "name", "type", "shape (ne[0] first)", "bytes",
            "bpw");
    uint64_t n_params = 0, n_bytes = 0;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        const rk_gguf_tensor *t = &g->tensors[i];
        char shape[96];
        int len = 0;
        uint64_t ne = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) {
            len += snprintf(shape + len, sizeof shape - (size_t)len, "%s%" PRId64, d ? " x " : "",
                            t->ne[d]);
            ne *= (uint64_t)t->ne[d];
        }
        n_params += ne;
        n_bytes += t->n_bytes;
        fprintf(out, "  %-40s %-6s %-28s %14zu %6.2f\n", t->name, rk_ggml_type_name(t->type), shape,
                t->n_bytes, (double)t->n_bytes * 8.0 / (double)ne);
    }
    fprintf(out,
            "\ntotal: %" PRIu64 " parameters (%.3f M), %" PRIu64
            " bytes of tensor data (%.2f MiB), %.2f bits per weight\n",
            n_params, (double)n_params / 1e6, n_bytes, (double)n_bytes / (1024.0 * 1024.0),
            n_params ? (double)n_bytes * 8.0 / (double)n_params : 0.0);
}

/* ================================================================ writer */

typedef struct wkv {
    char *key;
    uint32_t type;
    uint32_t arr_type;
    uint64_t arr_n;
    uint8_t scalar[8];
    char *str; /* strings */
    size_t str_len;
    void *arr;      /* numeric arrays: raw elements */
    char *blob;     /* string arrays: the strings back to back, no NULs */
    uint32_t *lens; /* string arrays: (arr_n) lengths */
    size_t blob_len;
} wkv;

typedef struct wtensor {
    char *name;
    uint32_t type;
    uint32_t n_dims;
    int64_t ne[RK_GGUF_MAX_DIMS];
    size_t n_bytes;
    uint64_t offset; /* assigned by w_layout */
} wtensor;

struct rk_gguf_writer {
    wkv *kvs;
    int64_t n_kv, cap_kv;
    wtensor *tensors;
    int64_t n_tensors, cap_tensors;
    size_t alignment;
};

#define GGML_MAX_NAME 64 /* ggml's limit on tensor names, NUL included */

/* Create an empty writer (version 3, alignment 32). */
rk_status rk_gguf_writer_create(rk_gguf_writer **out) {
    if (!out) return rk_errorf(RK_ERR_INVALID, "rk_gguf_writer_create: NULL argument");
    rk_gguf_writer *w = calloc(1, sizeof *w);
    if (!w) return rk_errorf(RK_ERR_NOMEM, "gguf writer: out of memory");
    w->alignment = GGUF_DEFAULT_ALIGNMENT;
    *out = w;
    return RK_OK;
}

static void wkv_free(wkv *kv) {
    free(kv->key);
    free(kv->str);
    free(kv->arr);
    free(kv->blob);
    free(kv->lens);
}

/* Free the writer and its copies; accepts NULL. */
void rk_gguf_writer_free(rk_gguf_writer *w) {
    if (!w) return;
    for (int64_t i = 0; i < w->n_kv; i++) wkv_free(&w->kvs[i]);
    for (int64_t i = 0; i < w->n_tensors; i++) free(w->tensors[i].name);
    free(w->kvs);
    free(w->tensors);
    free(w);
}

/* A key for messages: NULL shows as "(null)". */
static const char *kname(const char *key) { return key ? key : "(null)"; }

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = malloc(n);
    if (p) memcpy(p, s, n);
    return p;
}

/* Room for entry n (zeroed) in a writer's array of *cap entries of size
 * bytes, doubling from first. Returns the array, moved or not, or NULL when
 * out of memory (the array is then unchanged). */
static void *w_grow(void *items, int64_t n, int64_t *cap, size_t size, int64_t first) {
    if (n == *cap) {
        int64_t c = *cap ? *cap * 2 : first;
        void *p = realloc(items, (size_t)c * size);
        if (!p) return NULL;
        items = p;
        *cap = c;
    }
    memset((char *)items + (size_t)n * size, 0, size);
    return items;
}

/* Append a new pair for key with type; checks the key and duplicates. */
static rk_status w_new_kv(rk_gguf_writer *w, const char *key, uint32_t type, wkv **out) {
    if (!w || !key || !*key) return rk_errorf(RK_ERR_INVALID, "gguf writer: empty or NULL key");
    for (int64_t i = 0; i < w->n_kv; i++)
        if (strcmp(w->kvs[i].key, key) == 0)
            return rk_errorf(RK_ERR_INVALID, "gguf writer: duplicate key '%s'", key);
    wkv *kvs = w_grow(w->kvs, w->n_kv, &w->cap_kv, sizeof *kvs, 32);
    if (kvs) w->kvs = kvs;
    wkv *kv = kvs ? &kvs[w->n_kv] : NULL;
    if (!kv || !(kv->key = dup_str(key)))
        return rk_errorf(RK_ERR_NOMEM, "gguf writer: out of memory for key '%s'", key);
    kv->type = type;
    w->n_kv++;
    *out = kv;
    return RK_OK;
}

/* Drop the last pair (after a failed allocation of its value). */
static rk_status w_drop_last(rk_gguf_writer *w, rk_status st) {
    w->n_kv--;
    wkv_free(&w->kvs[w->n_kv]);
    return st;
}

/* Set a fixed-size scalar of any type from the value pointed to by value. */
rk_status rk_gguf_writer_set_scalar(rk_gguf_writer *w, const char *key, rk_gguf_type type,
                                    const void *value) {
    size_t es = gguf_scalar_size(type);
    if (es == 0 || !value)
        return rk_errorf(RK_ERR_INVALID, "gguf writer: key '%s': type %s is not a scalar",
                         key ? key : "(null)", gguf_type_name(type));
    if (key && strcmp(key, "general.alignment") == 0) {
        uint32_t a = 0;
        if (type == RK_GGUF_UINT32) memcpy(&a, value, 4);
        if (type != RK_GGUF_UINT32 || a == 0 || (a & (a - 1)) != 0)
            return rk_errorf(RK_ERR_INVALID,
                             "gguf writer: general.alignment must be a u32 power of two");
    }
    wkv *kv;
    rk_status st = w_new_kv(w, key, type, &kv);
    if (st) return st;
    memcpy(kv->scalar, value, es);
    if (type == RK_GGUF_UINT32 && strcmp(key, "general.alignment") == 0) {
        uint32_t a;
        memcpy(&a, value, 4);
        w->alignment = a;
    }
    return RK_OK;
}

/* Typed scalar setters. */
rk_status rk_gguf_writer_set_u32(rk_gguf_writer *w, const char *key, uint32_t v) {
    return rk_gguf_writer_set_scalar(w, key, RK_GGUF_UINT32, &v);
}
rk_status rk_gguf_writer_set_i32(rk_gguf_writer *w, const char *key, int32_t v) {
    return rk_gguf_writer_set_scalar(w, key, RK_GGUF_INT32, &v);
}
rk_status rk_gguf_writer_set_u64(rk_gguf_writer *w, const char *key, uint64_t v) {
    return rk_gguf_writer_set_scalar(w, key, RK_GGUF_UINT64, &v);
}
rk_status rk_gguf_writer_set_f32(rk_gguf_writer *w, const char *key, float v) {
    return rk_gguf_writer_set_scalar(w, key, RK_GGUF_FLOAT32, &v);
}
rk_status rk_gguf_writer_set_bool(rk_gguf_writer *w, const char *key, int v) {
    uint8_t b = v ? 1 : 0;
    return rk_gguf_writer_set_scalar(w, key, RK_GGUF_BOOL, &b);
}

/* Set a string value of len bytes (copied). */
rk_status rk_gguf_writer_set_str_len(rk_gguf_writer *w, const char *key, const char *s,
                                     size_t len) {
    if (!s && len)
        return rk_errorf(RK_ERR_INVALID, "gguf writer: key '%s': NULL string", kname(key));
    wkv *kv;
    rk_status st = w_new_kv(w, key, RK_GGUF_STRING, &kv);
    if (st) return st;
    kv->str = malloc(len ? len : 1);
    if (!kv->str)
        return w_drop_last(w, rk_errorf(RK_ERR_NOMEM, "gguf writer: out of memory for '%s'", key));
    if (len) memcpy(kv->str, s, len);
    kv->str_len = len;
    return RK_OK;
}

rk_status rk_gguf_writer_set_str(rk_gguf_writer *w, const char *key, const char *s) {
    if (!s) return rk_errorf(RK_ERR_INVALID, "gguf writer: key '%s': NULL string", kname(key));
    return rk_gguf_writer_set_str_len(w, key, s, strlen(s));
}

/* Set a numeric array of n elements of elem_type (copied). */
rk_status rk_gguf_writer_set_arr(rk_gguf_writer *w, const char *key, rk_gguf_type elem_type,
                                 const void *values, size_t n) {
    size_t es = gguf_scalar_size(elem_type);
    if (es == 0)
        return rk_errorf(RK_ERR_INVALID, "gguf writer: key '%s': arrays of %s need another setter",
                         kname(key), gguf_type_name(elem_type));
    if (!values && n)
        return rk_errorf(RK_ERR_INVALID, "gguf writer: key '%s': NULL array", kname(key));
    if (n > SIZE_MAX / es)
        return rk_errorf(RK_ERR_INVALID, "gguf writer: key '%s': array too large", kname(key));
    wkv *kv;
    rk_status st = w_new_kv(w, key, RK_GGUF_ARRAY, &kv);
    if (st) return st;
    kv->arr_type = elem_type;
    kv->arr_n = n;
    kv->arr = malloc(n ? n * es : 1);
    if (!kv->arr)
        return w_drop_last(w, rk_errorf(RK_ERR_NOMEM, "gguf writer: out of memory for '%s'", key));
    if (n) memcpy(kv->arr, values, n * es);
    return RK_OK;
}

rk_status rk_gguf_writer_set_arr_i32(rk_gguf_writer *w, const char *key, const int32_t *v,
                                     size_t n) {
    return rk_gguf_writer_set_arr(w, key, RK_GGUF_INT32, v, n);
}
rk_status rk_gguf_writer_set_arr_f32(rk_gguf_writer *w, const char *key, const float *v, size_t n) {
    return rk_gguf_writer_set_arr(w, key, RK_GGUF_FLOAT32, v, n);
}

/* Set an array of n strings (copied into one block); lens may be NULL. */
rk_status rk_gguf_writer_set_arr_str(rk_gguf_writer *w, const char *key, const char *const *strs,
                                     const uint32_t *lens, size_t n) {
    if (!strs && n)
        return rk_errorf(RK_ERR_INVALID, "gguf writer: key '%s': NULL array", kname(key));
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (!strs[i])
            return rk_errorf(RK_ERR_INVALID, "gguf writer: key '%s': string %zu is NULL",
                             kname(key), i);
        size_t len = lens ? lens[i] : strlen(strs[i]);
        if (len > UINT32_MAX || total > SIZE_MAX - len)
            return rk_errorf(RK_ERR_INVALID, "gguf writer: key '%s': string %zu too long",
                             kname(key), i);
        total += len;
    }
    wkv *kv;
    rk_status st = w_new_kv(w, key, RK_GGUF_ARRAY, &kv);
    if (st) return st;
    kv->arr_type = RK_GGUF_STRING;
    kv->arr_n = n;
    kv->blob = malloc(total ? total : 1);
    kv->lens = malloc(n ? n * sizeof *kv->lens : 1);
    if (!kv->blob || !kv->lens)
        return w_drop_last(w, rk_errorf(RK_ERR_NOMEM, "gguf writer: out of memory for '%s'", key));
    char *dst = kv->blob;
    for (size_t i = 0; i < n; i++) {
        size_t len = lens ? lens[i] : strlen(strs[i]);
        memcpy(dst, strs[i], len);
        dst += len;
        kv->lens[i] = (uint32_t)len;
    }
    kv->blob_len = total;
    return RK_OK;
}

/* Declare a tensor; its data is requested from the fill callback at write time. */
rk_status rk_gguf_writer_add_tensor(rk_gguf_writer *w, const char *name, rk_ggml_type type,
                                    uint32_t n_dims, const int64_t *ne) {
    if (!w || !name || !ne) return rk_errorf(RK_ERR_INVALID, "gguf writer: NULL tensor argument");
    size_t len = strlen(name);
    if (len == 0 || len >= GGML_MAX_NAME)
        return rk_errorf(RK_ERR_INVALID, "gguf writer: tensor name '%s' must have 1..%d bytes",
                         name, GGML_MAX_NAME - 1);
    if (n_dims == 0 || n_dims > RK_GGUF_MAX_DIMS)
        return rk_errorf(RK_ERR_INVALID, "gguf writer: tensor '%s': %" PRIu32 " dimensions", name,
                         n_dims);
    const ggml_traits *tr = ggml_traits_of((uint32_t)type);
    if (!tr)
        return rk_errorf(RK_ERR_INVALID, "gguf writer: tensor '%s': unknown type %d", name,
                         (int)type);
    uint64_t n_elem = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] <= 0 || n_elem > (uint64_t)INT64_MAX / (uint64_t)ne[d])
            return rk_errorf(RK_ERR_INVALID, "gguf writer: tensor '%s': bad dimension %" PRId64,
                             name, ne[d]);
        n_elem *= (uint64_t)ne[d];
    }
    if ((uint64_t)ne[0] % tr->blck != 0)
        return rk_errorf(RK_ERR_INVALID,
                         "gguf writer: tensor '%s': ne[0] not a multiple of the block size", name);
    if (n_elem / tr->blck > SIZE_MAX / tr->type_size)
        return rk_errorf(RK_ERR_INVALID, "gguf writer: tensor '%s': too large", name);
    for (int64_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return rk_errorf(RK_ERR_INVALID, "gguf writer: duplicate tensor '%s'", name);
    wtensor *ts = w_grow(w->tensors, w->n_tensors, &w->cap_tensors, sizeof *ts, 64);
    if (ts) w->tensors = ts;
    wtensor *t = ts ? &ts[w->n_tensors] : NULL;
    if (!t || !(t->name = dup_str(name)))
        return rk_errorf(RK_ERR_NOMEM, "gguf writer: out of memory for tensor '%s'", name);
    t->type = (uint32_t)type;
    t->n_dims = n_dims;
    for (uint32_t d = 0; d < RK_GGUF_MAX_DIMS; d++) t->ne[d] = d < n_dims ? ne[d] : 1;
    t->n_bytes = (size_t)(n_elem / tr->blck * tr->type_size);
    w->n_tensors++;
    return RK_OK;
}

/* Return the number of tensors declared so far. */
int64_t rk_gguf_writer_n_tensors(const rk_gguf_writer *w) { return w->n_tensors; }

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Size of the encoded header (everything before the padding of the data section). */
static size_t w_header_size(const rk_gguf_writer *w) {
    size_t n = 4 + 4 + 8 + 8;
    for (int64_t i = 0; i < w->n_kv; i++) {
        const wkv *kv = &w->kvs[i];
        n += 8 + strlen(kv->key) + 4;
        if (kv->type == RK_GGUF_STRING)
            n += 8 + kv->str_len;
        else if (kv->type != RK_GGUF_ARRAY)
            n += gguf_scalar_size(kv->type);
        else if (kv->arr_type == RK_GGUF_STRING)
            n += 4 + 8 + 8 * (size_t)kv->arr_n + kv->blob_len;
        else
            n += 4 + 8 + (size_t)kv->arr_n * gguf_scalar_size(kv->arr_type);
    }
    for (int64_t i = 0; i < w->n_tensors; i++)
        n += 8 + strlen(w->tensors[i].name) + 4 + 8 * (size_t)w->tensors[i].n_dims + 4 + 8;
    return n;
}

/* Assign tensor offsets (in declaration order, each padded to the alignment)
 * and return the total file size in *out_total, the data section start in
 * *out_data. */
static rk_status w_layout(rk_gguf_writer *w, size_t *out_data, size_t *out_total) {
    size_t a = w->alignment;
    size_t data = align_up(w_header_size(w), a);
    size_t off = 0;
    for (int64_t i = 0; i < w->n_tensors; i++) {
        wtensor *t = &w->tensors[i];
        t->offset = off;
        if (off > SIZE_MAX - t->n_bytes || off + t->n_bytes > SIZE_MAX - a)
            return rk_errorf(RK_ERR_INVALID, "gguf writer: file size overflows");
        off = align_up(off + t->n_bytes, a);
    }
    if (off > SIZE_MAX - data) return rk_errorf(RK_ERR_INVALID, "gguf writer: file size overflows");
    *out_data = data;
    *out_total = data + off;
    return RK_OK;
}

/* Return the size in bytes the written file will have. */
size_t rk_gguf_writer_total_size(rk_gguf_writer *w) {
    size_t data, total;
    if (w_layout(w, &data, &total)) return 0;
    return total;
}

static uint8_t *put(uint8_t *p, const void *src, size_t n) {
    memcpy(p, src, n);
    return p + n;
}
static uint8_t *put_u32(uint8_t *p, uint32_t v) { return put(p, &v, 4); }
static uint8_t *put_u64(uint8_t *p, uint64_t v) { return put(p, &v, 8); }
static uint8_t *put_str(uint8_t *p, const char *s, size_t len) {
    p = put_u64(p, len);
    return put(p, s, len);
}

/* Encode the header, metadata and tensor infos at dst and zero the padding up
 * to the data section. */
static void w_encode_header(const rk_gguf_writer *w, uint8_t *dst, size_t data_offset) {
    uint8_t *p = dst;
    p = put_u32(p, GGUF_MAGIC);
    p = put_u32(p, 3);
    p = put_u64(p, (uint64_t)w->n_tensors);
    p = put_u64(p, (uint64_t)w->n_kv);
    for (int64_t i = 0; i < w->n_kv; i++) {
        const wkv *kv = &w->kvs[i];
        p = put_str(p, kv->key, strlen(kv->key));
        p = put_u32(p, kv->type);
        if (kv->type == RK_GGUF_STRING) {
            p = put_str(p, kv->str, kv->str_len);
        } else if (kv->type != RK_GGUF_ARRAY) {
            p = put(p, kv->scalar, gguf_scalar_size(kv->type));
        } else {
            p = put_u32(p, kv->arr_type);
            p = put_u64(p, kv->arr_n);
            if (kv->arr_type == RK_GGUF_STRING) {
                const char *s = kv->blob;
                for (uint64_t j = 0; j < kv->arr_n; j++) {
                    p = put_str(p, s, kv->lens[j]);
                    s += kv->lens[j];
                }
            } else {
                p = put(p, kv->arr, (size_t)kv->arr_n * gguf_scalar_size(kv->arr_type));
            }
        }
    }
    for (int64_t i = 0; i < w->n_tensors; i++) {
        const wtensor *t = &w->tensors[i];
        p = put_str(p, t->name, strlen(t->name));
        p = put_u32(p, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) p = put_u64(p, (uint64_t)t->ne[d]);
        p = put_u32(p, t->type);
        p = put_u64(p, t->offset);
    }
    memset(p, 0, data_offset - (size_t)(p - dst));
}

/* Encode the whole file into buf (total bytes), asking fill for tensor data. */
static rk_status w_encode(const rk_gguf_writer *w, uint8_t *buf, size_t data_offset, size_t total,
                          rk_gguf_fill_fn fill, void *ctx, bool zero_padding) {
    w_encode_header(w, buf, data_offset);
    for (int64_t i = 0; i < w->n_tensors; i++) {
        const wtensor *t = &w->tensors[i];
        uint8_t *dst = buf + data_offset + t->offset;
        rk_status st = fill ? fill(ctx, i, dst, t->n_bytes) : RK_OK;
        if (!fill) memset(dst, 0, t->n_bytes);
        if (st) return st;
        size_t end = data_offset + t->offset + t->n_bytes;
        size_t next = i + 1 < w->n_tensors ? data_offset + w->tensors[i + 1].offset : total;
        if (zero_padding) memset(buf + end, 0, next - end);
    }
    return RK_OK;
}

/* Write the file to a malloc'ed buffer; see gguf.h. */
rk_status rk_gguf_writer_write_memory(rk_gguf_writer *w, rk_gguf_fill_fn fill, void *ctx,
                                      void **out_buf, size_t *out_len) {
    if (!w || !out_buf || !out_len) return rk_errorf(RK_ERR_INVALID, "gguf writer: NULL argument");
    size_t data, total;
    rk_status st = w_layout(w, &data, &total);
    if (st) return st;
    uint8_t *buf = malloc(total);
    if (!buf) return rk_errorf(RK_ERR_NOMEM, "gguf writer: out of memory for %zu bytes", total);
    st = w_encode(w, buf, data, total, fill, ctx, true);
    if (st) {
        free(buf);
        return st;
    }
    *out_buf = buf;
    *out_len = total;
    return RK_OK;
}

/* fsync the directory holding path so a rename is durable (best effort). */
static void fsync_parent_dir(const char *path) {
    const char *slash = strrchr(path, '/');
    char dir[4096];
    if (!slash) {
        snprintf(dir, sizeof dir, ".");
    } else {
        size_t n = (size_t)(slash - path);
        if (n == 0) n = 1;
        if (n >= sizeof dir) return;
        memcpy(dir, path, n);
        dir[n] = '\0';
    }
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return;
    (void)fsync(fd);
    close(fd);
}

/* Write the file to path via path.tmp, fsync and rename; see gguf.h. */
rk_status rk_gguf_writer_write_file(rk_gguf_writer *w, const char *path, rk_gguf_fill_fn fill,
                                    void *ctx) {
    if (!w || !path) return rk_errorf(RK_ERR_INVALID, "gguf writer: NULL argument");
    size_t data, total;
    rk_status st = w_layout(w, &data, &total);
    if (st) return st;
    size_t plen = strlen(path);
    char *tmp = malloc(plen + 5);
    if (!tmp) return rk_errorf(RK_ERR_NOMEM, "gguf writer: out of memory");
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp", 5);

    int fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        st = rk_errorf(RK_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
        free(tmp);
        return st;
    }
    /* Reserve the blocks first so a full disk is an error here, not a SIGBUS
     * while writing through the mapping. */
    int e = posix_fallocate(fd, 0, (off_t)total);
    if (e == EOPNOTSUPP || e == EINVAL) e = ftruncate(fd, (off_t)total) == 0 ? 0 : errno;
    uint8_t *map = MAP_FAILED;
    if (e) {
        st = rk_errorf(RK_ERR_IO, "%s: cannot allocate %zu bytes: %s", tmp, total, strerror(e));
    } else {
        map = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map == MAP_FAILED)
            st = rk_errorf(RK_ERR_IO, "%s: cannot mmap %zu bytes: %s", tmp, total, strerror(errno));
    }
    if (!st) {
        /* posix_fallocate leaves the file zero-filled, so padding needs no writes. */
        st = w_encode(w, map, data, total, fill, ctx, false);
        if (munmap(map, total) != 0 && !st)
            st = rk_errorf(RK_ERR_IO, "%s: munmap: %s", tmp, strerror(errno));
    }
    if (!st && fsync(fd) != 0) st = rk_errorf(RK_ERR_IO, "%s: fsync: %s", tmp, strerror(errno));
    if (close(fd) != 0 && !st) st = rk_errorf(RK_ERR_IO, "%s: close: %s", tmp, strerror(errno));
    if (!st && rename(tmp, path) != 0)
        st = rk_errorf(RK_ERR_IO, "%s: cannot rename to %s: %s", tmp, path, strerror(errno));
    if (st)
        unlink(tmp);
    else
        fsync_parent_dir(path);
    free(tmp);
    return st;
}
