/* engine/gguf_writer.c — the GGUF writer (see engine/gguf.h; the format is
 * described at the top of gguf.c).
 *
 * Pairs and tensor declarations are copied in as they are set; the file is
 * laid out (header, then each tensor aligned) and encoded in one pass into a
 * buffer or a mapped file, the caller's fill callback writing each tensor's
 * bytes in place. A file is written to path.tmp, synced and renamed. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine/gguf_internal.h"

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
    w->alignment = RK_GGUF_DEFAULT_ALIGNMENT;
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
    if (!kv || !(kv->key = rk_strdup(key)))
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
    size_t es = rk_gguf_scalar_size(type);
    if (es == 0 || !value)
        return rk_errorf(RK_ERR_INVALID, "gguf writer: key '%s': type %s is not a scalar",
                         key ? key : "(null)", rk_gguf_value_type_name(type));
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
    size_t es = rk_gguf_scalar_size(elem_type);
    if (es == 0)
        return rk_errorf(RK_ERR_INVALID, "gguf writer: key '%s': arrays of %s need another setter",
                         kname(key), rk_gguf_value_type_name(elem_type));
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
    const rk_ggml_traits *tr = rk_ggml_traits_of((uint32_t)type);
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
    if (!t || !(t->name = rk_strdup(name)))
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
            n += rk_gguf_scalar_size(kv->type);
        else if (kv->arr_type == RK_GGUF_STRING)
            n += 4 + 8 + 8 * (size_t)kv->arr_n + kv->blob_len;
        else
            n += 4 + 8 + (size_t)kv->arr_n * rk_gguf_scalar_size(kv->arr_type);
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
    p = put_u32(p, RK_GGUF_MAGIC);
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
            p = put(p, kv->scalar, rk_gguf_scalar_size(kv->type));
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
                p = put(p, kv->arr, (size_t)kv->arr_n * rk_gguf_scalar_size(kv->arr_type));
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
