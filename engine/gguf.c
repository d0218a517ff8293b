/* engine/gguf.c — the GGUF format, and the reader (see gguf.h; metadata
 * getters in gguf_meta.c, the summary in gguf_info.c, the writer in
 * gguf_writer.c).
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
#include "engine/gguf_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/kernels.h"

/* ================================================================ ggml types */

static const rk_ggml_traits k_ggml_traits[] = {
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

const rk_ggml_traits *rk_ggml_traits_of(uint32_t type) {
    if (type >= N_GGML_TRAITS || k_ggml_traits[type].blck == 0) return NULL;
    return &k_ggml_traits[type];
}

/* Return the name of a ggml type ("F32", "Q8_0", ...) or "?" when unknown. */
const char *rk_ggml_type_name(uint32_t type) {
    const rk_ggml_traits *t = rk_ggml_traits_of(type);
    return t ? t->name : "?";
}

/* Return the bytes taken by n_elements of a type, or 0 when the type is
 * unknown, n_elements is negative, not a whole number of blocks, or the size
 * overflows. */
size_t rk_ggml_type_row_bytes(uint32_t type, int64_t n_elements) {
    const rk_ggml_traits *t = rk_ggml_traits_of(type);
    if (!t || n_elements < 0 || (uint64_t)n_elements % t->blck != 0) return 0;
    uint64_t blocks = (uint64_t)n_elements / t->blck;
    if (blocks > SIZE_MAX / t->type_size) return 0;
    return (size_t)(blocks * t->type_size);
}

const char *rk_gguf_value_type_name(uint32_t t) {
    static const char *names[RK_GGUF_TYPE_COUNT] = {"u8",  "i8",  "u16",  "i16",    "u32",
                                                    "i32", "f32", "bool", "string", "array",
                                                    "u64", "i64", "f64"};
    return t < RK_GGUF_TYPE_COUNT ? names[t] : "?";
}

/* Size in bytes of a fixed-size value type, 0 for string, array and unknown. */
size_t rk_gguf_scalar_size(uint32_t t) {
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

/* ================================================================ reader */

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

static void kv_free(rk_gguf_kv *kv) {
    free(kv->key);
    free(kv->str);
    free(kv->arr);
    free(kv->arr_strs);
    free(kv->arr_lens);
    free(kv->arr_blob);
}

/* Read an array of strings: validate every length in a first pass, then copy
 * all strings into one block. */
static rk_status read_str_array(cursor *c, rk_gguf_kv *kv) {
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
static rk_status read_kv(cursor *c, int64_t index, rk_gguf_kv *kv) {
    size_t at = c->pos;
    char what[64];
    snprintf(what, sizeof what, "key of metadata pair %" PRId64, index);
    rk_status st = cur_name(c, &kv->key, what);
    if (st) return st;
    char vwhat[320];
    snprintf(vwhat, sizeof vwhat, "value of key '%.200s'", kv->key);
    st = cur_u32(c, &kv->type, vwhat);
    if (st) return st;
    if (kv->type >= RK_GGUF_TYPE_COUNT)
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
        return cur_read(c, kv->scalar, rk_gguf_scalar_size(kv->type), vwhat);

    st = cur_u32(c, &kv->arr_type, vwhat);
    if (st) return st;
    st = cur_u64(c, &kv->arr_n, vwhat);
    if (st) return st;
    if (kv->arr_type == RK_GGUF_ARRAY)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: key '%s' at offset %zu is an array of arrays (not supported)",
                         c->name, kv->key, at);
    if (kv->arr_type >= RK_GGUF_TYPE_COUNT)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: key '%s' at offset %zu is an array of unknown type %" PRIu32, c->name,
                         kv->key, at, kv->arr_type);
    if (kv->arr_type == RK_GGUF_STRING) return read_str_array(c, kv);
    size_t esize = rk_gguf_scalar_size(kv->arr_type);
    if (kv->arr_n > cur_left(c) / esize)
        return rk_errorf(RK_ERR_FORMAT,
                         "%s: key '%s' at offset %zu: array of %" PRIu64
                         " %s elements runs past the end of the file (%zu bytes left)",
                         c->name, kv->key, at, kv->arr_n, rk_gguf_value_type_name(kv->arr_type),
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
    const rk_ggml_traits *tr = rk_ggml_traits_of(t->type);
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
    const rk_gguf_kv *kvs = t_sort_ctx->kvs;
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
    if (magic != RK_GGUF_MAGIC)
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
    g->alignment = RK_GGUF_DEFAULT_ALIGNMENT;
    int64_t ai = rk_gguf_find_key(g, "general.alignment");
    if (ai >= 0) {
        const rk_gguf_kv *kv = &g->kvs[ai];
        if (kv->type != RK_GGUF_UINT32)
            return rk_errorf(RK_ERR_FORMAT, "%s: general.alignment has type %s (must be u32)",
                             g->name, rk_gguf_value_type_name(kv->type));
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
