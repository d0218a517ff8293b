/* tests/test_gguf.c — the GGUF reader and writer: round trips of every
 * metadata and tensor type, the real stories260K file, and hostile files
 * (bad magic and versions, every truncation, huge counts, bad shapes, offsets,
 * overlaps, duplicates), each of which must fail with a message, never crash;
 * and models whose hyper-parameters or weights are unusable (NaN or negative
 * epsilon, context length 0, NaN weights, ...), which the loader must refuse
 * naming the key or the tensor. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/gguf.h"
#include "engine/mkmodel.h"
#include "tests/testutil.h"

/* ---------------------------------------------------------------- helpers */

/* A growable byte buffer for building hostile files by hand. */
typedef struct bytes {
    uint8_t *p;
    size_t n, cap;
} bytes;

static void b_put(bytes *b, const void *src, size_t n) {
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n) cap *= 2;
        b->p = realloc(b->p, cap);
        cr_assert_not_null(b->p);
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void b_u32(bytes *b, uint32_t v) { b_put(b, &v, 4); }
static void b_u64(bytes *b, uint64_t v) { b_put(b, &v, 8); }
static void b_str(bytes *b, const char *s) {
    b_u64(b, strlen(s));
    b_put(b, s, strlen(s));
}
static void b_header(bytes *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    b_u32(b, 0x46554747u);
    b_u32(b, version);
    b_u64(b, n_tensors);
    b_u64(b, n_kv);
}
static void b_kv_u32(bytes *b, const char *key, uint32_t v) {
    b_str(b, key);
    b_u32(b, RK_GGUF_UINT32);
    b_u32(b, v);
}
/* A tensor info with up to 4 dims. */
static void b_tensor(bytes *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                     uint64_t offset) {
    b_str(b, name);
    b_u32(b, n_dims);
    for (uint32_t d = 0; d < n_dims; d++) b_u64(b, ne[d]);
    b_u32(b, type);
    b_u64(b, offset);
}
static void b_pad(bytes *b, size_t align) {
    static const uint8_t zero[64];
    while (b->n % align) b_put(b, zero, 1);
}
static void b_zeros(bytes *b, size_t n) {
    for (size_t i = 0; i < n; i++) b_put(b, "", 1);
}

/* Open a buffer, expecting failure with `status` and a message containing `needle`. */
static void expect_fail(const bytes *b, rk_status status, const char *needle) {
    /* Copy into an exact-size allocation so the sanitizer catches any over-read. */
    void *copy = malloc(b->n ? b->n : 1);
    cr_assert_not_null(copy);
    if (b->n) memcpy(copy, b->p, b->n);
    rk_gguf *g = (rk_gguf *)0x1;
    rk_error_clear();
    rk_status st = rk_gguf_open_memory(copy, b->n, &g);
    cr_expect_eq(st, status, "expected status %d (%s), got %d: %s", status, needle, st,
                 rk_error_message());
    cr_expect_null(g);
    cr_expect_neq(rk_error_message()[0], '\0');
    cr_expect_not_null(strstr(rk_error_message(), needle), "message '%s' lacks '%s'",
                       rk_error_message(), needle);
    free(copy);
}

/* Fill callback: byte j of tensor i is (i * 31 + j * 7) & 0xff. */
static rk_status fill_pattern(void *ctx, int64_t tensor_index, void *dst, size_t n_bytes) {
    (void)ctx;
    uint8_t *p = dst;
    for (size_t j = 0; j < n_bytes; j++) p[j] = (uint8_t)((size_t)tensor_index * 31 + j * 7);
    return RK_OK;
}

static bool data_has_pattern(const rk_gguf_tensor *t, int64_t index) {
    const uint8_t *p = t->data;
    for (size_t j = 0; j < t->n_bytes; j++)
        if (p[j] != (uint8_t)((size_t)index * 31 + j * 7)) return false;
    return true;
}

/* A writer with one key of every type and four tensors of four types. */
static rk_gguf_writer *make_full_writer(void) {
    rk_gguf_writer *w;
    cr_assert_eq(rk_gguf_writer_create(&w), RK_OK);
    uint8_t u8 = 200;
    int8_t i8 = -100;
    uint16_t u16 = 60000;
    int16_t i16 = -30000;
    int64_t i64 = -5000000000LL;
    double f64 = 3.14159265358979;
    cr_assert_eq(rk_gguf_writer_set_str(w, "general.architecture", "llama"), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_scalar(w, "t.u8", RK_GGUF_UINT8, &u8), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_scalar(w, "t.i8", RK_GGUF_INT8, &i8), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_scalar(w, "t.u16", RK_GGUF_UINT16, &u16), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_scalar(w, "t.i16", RK_GGUF_INT16, &i16), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_u32(w, "t.u32", 4000000000u), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_i32(w, "t.i32", -123456), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_f32(w, "t.f32", 1e-6f), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_bool(w, "t.bool", 1), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_bool(w, "t.bool_false", 0), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_str_len(w, "t.str_nul", "a\0b", 3), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_u64(w, "t.u64", 1ULL << 40), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_scalar(w, "t.i64", RK_GGUF_INT64, &i64), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_scalar(w, "t.f64", RK_GGUF_FLOAT64, &f64), RK_OK);
    const char *strs[] = {"hello", "", "w\xc3\xb6rld", "x\0y"};
    const uint32_t lens[] = {5, 0, 6, 3};
    cr_assert_eq(rk_gguf_writer_set_arr_str(w, "t.arr_str", strs, lens, 4), RK_OK);
    const int32_t ints[] = {-1, 0, 7, 2147483647};
    cr_assert_eq(rk_gguf_writer_set_arr_i32(w, "t.arr_i32", ints, 4), RK_OK);
    const float floats[] = {0.5f, -2.25f, 1e30f};
    cr_assert_eq(rk_gguf_writer_set_arr_f32(w, "t.arr_f32", floats, 3), RK_OK);
    const uint8_t u8s[] = {1, 2, 255};
    cr_assert_eq(rk_gguf_writer_set_arr(w, "t.arr_u8", RK_GGUF_UINT8, u8s, 3), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_arr_i32(w, "t.arr_empty", NULL, 0), RK_OK);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "a.f32", RK_GGML_F32, 2, (int64_t[]){3, 5}), RK_OK);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "b.f16", RK_GGML_F16, 1, (int64_t[]){7}), RK_OK);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "c.bf16", RK_GGML_BF16, 3, (int64_t[]){4, 3, 2}),
                 RK_OK);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "d.q8_0", RK_GGML_Q8_0, 4, (int64_t[]){64, 2, 1, 3}),
                 RK_OK);
    return w;
}

/* Check everything make_full_writer() put in. */
static void check_full(const rk_gguf *g) {
    cr_assert_eq(rk_gguf_version(g), 3);
    cr_assert_eq(rk_gguf_alignment(g), 32);
    cr_assert_eq(rk_gguf_n_kv(g), 19);
    cr_assert_str_eq(rk_gguf_kv_key(g, 0), "general.architecture");
    cr_assert_eq(rk_gguf_kv_type(g, 0), RK_GGUF_STRING);
    cr_assert_null(rk_gguf_kv_key(g, 19));
    cr_assert_null(rk_gguf_kv_key(g, -1));

    int64_t k = rk_gguf_find_key(g, "t.u8");
    cr_assert_eq(rk_gguf_kv_type(g, k), RK_GGUF_UINT8);
    k = rk_gguf_find_key(g, "t.f64");
    cr_assert_eq(rk_gguf_kv_type(g, k), RK_GGUF_FLOAT64);
    cr_assert_eq(rk_gguf_find_key(g, "t.nope"), -1);

    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    float f;
    int b;
    cr_assert_eq(rk_gguf_get_u32(g, "t.u8", &u32), RK_OK);
    cr_assert_eq(u32, 200);
    cr_assert_eq(rk_gguf_get_i32(g, "t.i8", &i32), RK_OK);
    cr_assert_eq(i32, -100);
    cr_assert_eq(rk_gguf_get_u32(g, "t.u16", &u32), RK_OK);
    cr_assert_eq(u32, 60000);
    cr_assert_eq(rk_gguf_get_i32(g, "t.i16", &i32), RK_OK);
    cr_assert_eq(i32, -30000);
    cr_assert_eq(rk_gguf_get_u32(g, "t.u32", &u32), RK_OK);
    cr_assert_eq(u32, 4000000000u);
    cr_assert_eq(rk_gguf_get_i32(g, "t.i32", &i32), RK_OK);
    cr_assert_eq(i32, -123456);
    cr_assert_eq(rk_gguf_get_f32(g, "t.f32", &f), RK_OK);
    cr_assert_eq(f, 1e-6f);
    cr_assert_eq(rk_gguf_get_bool(g, "t.bool", &b), RK_OK);
    cr_assert_eq(b, 1);
    cr_assert_eq(rk_gguf_get_bool(g, "t.bool_false", &b), RK_OK);
    cr_assert_eq(b, 0);
    cr_assert_eq(rk_gguf_get_u64(g, "t.u64", &u64), RK_OK);
    cr_assert_eq(u64, 1ULL << 40);
    cr_assert_eq(rk_gguf_get_f32(g, "t.f64", &f), RK_OK);
    cr_assert_float_eq(f, 3.14159265f, 1e-6f);

    const char *s;
    size_t len;
    cr_assert_eq(rk_gguf_get_str(g, "general.architecture", &s, &len), RK_OK);
    cr_assert_str_eq(s, "llama");
    cr_assert_eq(len, 5);
    cr_assert_eq(rk_gguf_get_str(g, "t.str_nul", &s, &len), RK_OK);
    cr_assert_eq(len, 3);
    cr_assert_eq(memcmp(s, "a\0b", 4), 0); /* NUL-terminated after its 3 bytes */

    const char *const *strs;
    const uint32_t *lens;
    size_t n;
    cr_assert_eq(rk_gguf_get_arr_str(g, "t.arr_str", &strs, &lens, &n), RK_OK);
    cr_assert_eq(n, 4);
    cr_assert_str_eq(strs[0], "hello");
    cr_assert_str_eq(strs[1], "");
    cr_assert_str_eq(strs[2], "w\xc3\xb6rld");
    cr_assert_eq(lens[2], 6);
    cr_assert_eq(lens[3], 3);
    cr_assert_eq(memcmp(strs[3], "x\0y", 4), 0);
    k = rk_gguf_find_key(g, "t.arr_str");
    cr_assert_eq(rk_gguf_kv_type(g, k), RK_GGUF_ARRAY);
    cr_assert_eq(rk_gguf_kv_arr_type(g, k), RK_GGUF_STRING);
    cr_assert_eq(rk_gguf_kv_arr_n(g, k), 4);

    int32_t *ia;
    cr_assert_eq(rk_gguf_get_arr_i32(g, "t.arr_i32", &ia, &n), RK_OK);
    cr_assert_eq(n, 4);
    cr_assert_eq(ia[0], -1);
    cr_assert_eq(ia[2], 7);
    cr_assert_eq(ia[3], 2147483647);
    free(ia);
    float *fa;
    cr_assert_eq(rk_gguf_get_arr_f32(g, "t.arr_f32", &fa, &n), RK_OK);
    cr_assert_eq(n, 3);
    cr_assert_eq(fa[0], 0.5f);
    cr_assert_eq(fa[1], -2.25f);
    cr_assert_eq(fa[2], 1e30f);
    free(fa);
    cr_assert_eq(rk_gguf_get_arr_i32(g, "t.arr_u8", &ia, &n), RK_OK);
    cr_assert_eq(n, 3);
    cr_assert_eq(ia[2], 255);
    free(ia);
    cr_assert_eq(rk_gguf_get_arr_f32(g, "t.arr_i32", &fa, &n), RK_OK); /* ints convert to float */
    cr_assert_eq(fa[0], -1.0f);
    free(fa);
    cr_assert_eq(rk_gguf_get_arr_i32(g, "t.arr_empty", &ia, &n), RK_OK);
    cr_assert_eq(n, 0);
    free(ia);

    cr_assert_eq(rk_gguf_n_tensors(g), 4);
    const char *names[] = {"a.f32", "b.f16", "c.bf16", "d.q8_0"};
    const uint32_t types[] = {RK_GGML_F32, RK_GGML_F16, RK_GGML_BF16, RK_GGML_Q8_0};
    const size_t sizes[] = {3 * 5 * 4, 7 * 2, 4 * 3 * 2 * 2, 2 * 34 * 2 * 3};
    for (int64_t i = 0; i < 4; i++) {
        const rk_gguf_tensor *t = rk_gguf_tensor_at(g, i);
        cr_assert_not_null(t);
        cr_assert_str_eq(t->name, names[i]);
        cr_assert_eq(rk_gguf_find_tensor(g, names[i]), t);
        cr_assert_eq(t->type, types[i]);
        cr_assert_eq(t->n_bytes, sizes[i], "%s: %zu bytes", t->name, t->n_bytes);
        cr_assert_eq(t->offset % 32, 0);
        cr_assert(data_has_pattern(t, i), "tensor %s data differs", t->name);
    }
    const rk_gguf_tensor *t = rk_gguf_find_tensor(g, "c.bf16");
    cr_assert_eq(t->n_dims, 3);
    cr_assert_eq(t->ne[0], 4);
    cr_assert_eq(t->ne[1], 3);
    cr_assert_eq(t->ne[2], 2);
    cr_assert_eq(t->ne[3], 1);
    t = rk_gguf_find_tensor(g, "d.q8_0");
    cr_assert_eq(t->n_dims, 4);
    cr_assert_eq(t->ne[3], 3);
    cr_assert_null(rk_gguf_find_tensor(g, "e.missing"));
    cr_assert_null(rk_gguf_tensor_at(g, 4));
}

/* ---------------------------------------------------------------- round trips */

Test(gguf, round_trip_in_memory_keeps_every_metadata_and_tensor_type) {
    rk_gguf_writer *w = make_full_writer();
    void *buf;
    size_t len;
    cr_assert_eq(rk_gguf_writer_write_memory(w, fill_pattern, NULL, &buf, &len), RK_OK);
    cr_assert_eq(len, rk_gguf_writer_total_size(w));
    cr_assert_eq(len % 32, 0);
    rk_gguf_writer_free(w);
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open_memory(buf, len, &g), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_gguf_file_size(g), len);
    check_full(g);
    rk_gguf_close(g);
    free(buf);
}

Test(gguf, round_trip_through_a_file_renames_the_temporary) {
    char *dir = rk_test_tmpdir("gguf");
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/full.gguf", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    rk_gguf_writer *w = make_full_writer();
    cr_assert_eq(rk_gguf_writer_write_file(w, path, fill_pattern, NULL), RK_OK, "%s",
                 rk_error_message());
    size_t expect = rk_gguf_writer_total_size(w);
    rk_gguf_writer_free(w);
    struct stat sb;
    cr_assert_eq(stat(tmp, &sb), -1, "the temporary file is left behind");
    cr_assert_eq(stat(path, &sb), 0);
    cr_assert_eq((size_t)sb.st_size, expect);
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open(path, &g), RK_OK, "%s", rk_error_message());
    check_full(g);
    rk_gguf_close(g);
    unlink(path);
    cr_expect_eq(rmdir(dir), 0, "test left files in %s", dir);
    free(dir);
}

Test(gguf, file_and_memory_outputs_are_byte_identical) {
    char *dir = rk_test_tmpdir("gguf");
    char path[4096];
    snprintf(path, sizeof path, "%s/same.gguf", dir);
    rk_gguf_writer *w = make_full_writer();
    void *buf;
    size_t len;
    cr_assert_eq(rk_gguf_writer_write_memory(w, fill_pattern, NULL, &buf, &len), RK_OK);
    cr_assert_eq(rk_gguf_writer_write_file(w, path, fill_pattern, NULL), RK_OK);
    rk_gguf_writer_free(w);
    size_t flen;
    char *file = rk_test_read_file(path, &flen);
    cr_assert_not_null(file);
    cr_assert_eq(flen, len);
    cr_assert_eq(memcmp(file, buf, len), 0);
    free(file);
    free(buf);
    unlink(path);
    cr_expect_eq(rmdir(dir), 0, "test left files in %s", dir);
    free(dir);
}

Test(gguf, writer_honours_a_custom_alignment) {
    rk_gguf_writer *w;
    cr_assert_eq(rk_gguf_writer_create(&w), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_u32(w, "general.alignment", 256), RK_OK);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "x", RK_GGML_F32, 1, (int64_t[]){3}), RK_OK);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "y", RK_GGML_F32, 1, (int64_t[]){5}), RK_OK);
    void *buf;
    size_t len;
    cr_assert_eq(rk_gguf_writer_write_memory(w, fill_pattern, NULL, &buf, &len), RK_OK);
    rk_gguf_writer_free(w);
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open_memory(buf, len, &g), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_gguf_alignment(g), 256);
    const rk_gguf_tensor *y = rk_gguf_find_tensor(g, "y");
    cr_assert_eq(y->offset, 256);
    cr_assert_eq(((const uint8_t *)y->data - (const uint8_t *)buf) % 256, 0);
    cr_assert(data_has_pattern(y, 1));
    rk_gguf_close(g);
    free(buf);
}

Test(gguf, getters_report_missing_keys_and_wrong_types) {
    rk_gguf_writer *w = make_full_writer();
    void *buf;
    size_t len;
    cr_assert_eq(rk_gguf_writer_write_memory(w, NULL, NULL, &buf, &len), RK_OK);
    rk_gguf_writer_free(w);
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open_memory(buf, len, &g), RK_OK);
    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    float f;
    int b;
    const char *s;
    rk_error_clear();
    cr_assert_eq(rk_gguf_get_u32(g, "no.such.key", &u32), RK_ERR_NOT_FOUND);
    cr_assert_str_eq(rk_error_message(), "", "absence must not leave a message");
    cr_assert_eq(rk_gguf_get_str(g, "no.such.key", &s, NULL), RK_ERR_NOT_FOUND);
    cr_assert_eq(rk_gguf_get_u32(g, "t.i32", &u32), RK_ERR_FORMAT); /* negative */
    cr_assert_not_null(strstr(rk_error_message(), "t.i32"));
    cr_assert_eq(rk_gguf_get_i32(g, "t.u32", &i32), RK_ERR_FORMAT); /* 4e9 does not fit */
    cr_assert_eq(rk_gguf_get_u64(g, "t.i64", &u64), RK_ERR_FORMAT); /* negative */
    cr_assert_eq(rk_gguf_get_u32(g, "t.u64", &u32), RK_ERR_FORMAT); /* 2^40 */
    cr_assert_eq(rk_gguf_get_u32(g, "t.f32", &u32), RK_ERR_FORMAT);
    cr_assert_eq(rk_gguf_get_f32(g, "general.architecture", &f), RK_ERR_FORMAT);
    cr_assert_not_null(strstr(rk_error_message(), "general.architecture"));
    cr_assert_eq(rk_gguf_get_bool(g, "t.u8", &b), RK_ERR_FORMAT);
    cr_assert_eq(rk_gguf_get_str(g, "t.u32", &s, NULL), RK_ERR_FORMAT);
    const char *const *strs;
    size_t n;
    cr_assert_eq(rk_gguf_get_arr_str(g, "t.arr_i32", &strs, NULL, &n), RK_ERR_FORMAT);
    int32_t *ia;
    float *fa;
    cr_assert_eq(rk_gguf_get_arr_i32(g, "t.arr_f32", &ia, &n), RK_ERR_FORMAT);
    cr_assert_eq(rk_gguf_get_arr_f32(g, "t.arr_str", &fa, &n), RK_ERR_FORMAT);
    cr_assert_eq(rk_gguf_get_arr_f32(g, "t.u32", &fa, &n), RK_ERR_FORMAT);
    cr_assert_eq(rk_gguf_get_u64(g, "t.u32", &u64), RK_OK);
    cr_assert_eq(u64, 4000000000u);
    rk_gguf_close(g);
    free(buf);
}

Test(gguf, writer_rejects_bad_declarations) {
    rk_gguf_writer *w;
    cr_assert_eq(rk_gguf_writer_create(&w), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_u32(w, "a", 1), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_u32(w, "a", 2), RK_ERR_INVALID);
    cr_assert_not_null(strstr(rk_error_message(), "duplicate key 'a'"));
    cr_assert_eq(rk_gguf_writer_set_str(w, "", "x"), RK_ERR_INVALID);
    cr_assert_eq(rk_gguf_writer_set_u32(w, "general.alignment", 48), RK_ERR_INVALID);
    cr_assert_eq(rk_gguf_writer_set_i32(w, "general.alignment", 64), RK_ERR_INVALID);
    cr_assert_eq(rk_gguf_writer_set_arr(w, "b", RK_GGUF_STRING, "x", 1), RK_ERR_INVALID);
    const int64_t ne[] = {32, 4, 1, 1, 1};
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "t", RK_GGML_F32, 0, ne), RK_ERR_INVALID);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "t", RK_GGML_F32, 5, ne), RK_ERR_INVALID);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "t", (rk_ggml_type)4, 2, ne), RK_ERR_INVALID);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "t", RK_GGML_Q8_0, 2, (int64_t[]){31, 1}),
                 RK_ERR_INVALID);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "t", RK_GGML_F32, 2, (int64_t[]){0, 1}),
                 RK_ERR_INVALID);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "t", RK_GGML_F32, 2, (int64_t[]){-4, 1}),
                 RK_ERR_INVALID);
    char long_name[80];
    memset(long_name, 'n', 64);
    long_name[64] = '\0';
    cr_assert_eq(rk_gguf_writer_add_tensor(w, long_name, RK_GGML_F32, 2, ne), RK_ERR_INVALID);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "t", RK_GGML_Q8_0, 2, ne), RK_OK);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "t", RK_GGML_F32, 2, ne), RK_ERR_INVALID);
    cr_assert_not_null(strstr(rk_error_message(), "duplicate tensor 't'"));
    cr_assert_eq(rk_gguf_writer_n_tensors(w), 1);
    rk_gguf_writer_free(w);
    rk_gguf_writer_free(NULL);
}

static rk_status fill_fails_on_second(void *ctx, int64_t tensor_index, void *dst, size_t n_bytes) {
    (void)ctx;
    if (tensor_index == 1) return rk_errorf(RK_ERR_INTERNAL, "fill refused tensor 1");
    memset(dst, 1, n_bytes);
    return RK_OK;
}

Test(gguf, a_failing_fill_leaves_no_file_behind) {
    char *dir = rk_test_tmpdir("gguf");
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s/fail.gguf", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    rk_gguf_writer *w = make_full_writer();
    cr_assert_eq(rk_gguf_writer_write_file(w, path, fill_fails_on_second, NULL), RK_ERR_INTERNAL);
    cr_assert_str_eq(rk_error_message(), "fill refused tensor 1");
    void *buf = NULL;
    size_t len = 0;
    cr_assert_eq(rk_gguf_writer_write_memory(w, fill_fails_on_second, NULL, &buf, &len),
                 RK_ERR_INTERNAL);
    cr_assert_null(buf);
    rk_gguf_writer_free(w);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), -1);
    cr_assert_eq(stat(tmp, &sb), -1);
    char bad[4200];
    snprintf(bad, sizeof bad, "%s/no/such/dir/x.gguf", dir);
    cr_assert_eq(rk_gguf_writer_create(&w), RK_OK);
    cr_assert_eq(rk_gguf_writer_write_file(w, bad, NULL, NULL), RK_ERR_IO);
    cr_assert_not_null(strstr(rk_error_message(), "x.gguf.tmp"));
    rk_gguf_writer_free(w);
    cr_expect_eq(rmdir(dir), 0, "test left files in %s", dir);
    free(dir);
}

Test(gguf, print_info_lists_metadata_tokenizer_and_tensors) {
    rk_gguf_writer *w = make_full_writer();
    const char *toks[] = {"<unk>", "<s>", "</s>"};
    cr_assert_eq(rk_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, NULL, 3), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_str(w, "tokenizer.ggml.model", "llama"), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1), RK_OK);
    void *buf;
    size_t len;
    cr_assert_eq(rk_gguf_writer_write_memory(w, NULL, NULL, &buf, &len), RK_OK);
    rk_gguf_writer_free(w);
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open_memory(buf, len, &g), RK_OK);
    char *text = NULL;
    size_t text_len = 0;
    FILE *out = open_memstream(&text, &text_len);
    cr_assert_not_null(out);
    rk_gguf_print_info(g, out);
    fclose(out);
    cr_assert_not_null(strstr(text, "gguf version: 3"));
    cr_assert_not_null(strstr(text, "architecture: llama"));
    cr_assert_not_null(strstr(text, "t.u32"));
    cr_assert_not_null(strstr(text, "4000000000"));
    cr_assert_not_null(strstr(text, "string[4]: \"hello\", \"\""));
    cr_assert_not_null(strstr(text, "tokenizer: model llama"));
    cr_assert_not_null(strstr(text, "bos      1 \"<s>\""));
    cr_assert_not_null(strstr(text, "d.q8_0"));
    cr_assert_not_null(strstr(text, "Q8_0"));
    cr_assert_not_null(strstr(text, "64 x 2 x 1 x 3"));
    cr_assert_not_null(strstr(text, "total: 430 parameters"), "%s", text);
    free(text);
    rk_gguf_close(g);
    free(buf);
}

Test(gguf, type_names_and_sizes) {
    cr_assert_str_eq(rk_ggml_type_name(RK_GGML_F32), "F32");
    cr_assert_str_eq(rk_ggml_type_name(RK_GGML_BF16), "BF16");
    cr_assert_str_eq(rk_ggml_type_name(12), "Q4_K");
    cr_assert_str_eq(rk_ggml_type_name(4), "?");
    cr_assert_str_eq(rk_ggml_type_name(100000), "?");
    cr_assert_eq(rk_ggml_type_row_bytes(RK_GGML_F16, 10), 20);
    cr_assert_eq(rk_ggml_type_row_bytes(RK_GGML_Q8_0, 64), 68);
    cr_assert_eq(rk_ggml_type_row_bytes(RK_GGML_Q8_0, 33), 0);
    cr_assert_eq(rk_ggml_type_row_bytes(14, 256), 210); /* Q6_K */
    cr_assert_eq(rk_ggml_type_row_bytes(RK_GGML_F32, -1), 0);
    cr_assert_eq(rk_ggml_type_row_bytes(33, 32), 0);
}

/* ---------------------------------------------------------------- the real model */

Test(gguf, stories260k_opens_with_the_expected_keys_and_tensors) {
    char *path;
    RK_REQUIRE_SHARED(path, "models/stories260K.gguf");
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open(path, &g), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_gguf_version(g), 3);
    cr_assert_eq(rk_gguf_file_size(g), 1185376);
    cr_assert_eq(rk_gguf_n_kv(g), 19);
    cr_assert_eq(rk_gguf_n_tensors(g), 48);
    const char *arch;
    cr_assert_eq(rk_gguf_get_str(g, "general.architecture", &arch, NULL), RK_OK);
    cr_assert_str_eq(arch, "llama");
    uint32_t v;
    cr_assert_eq(rk_gguf_get_u32(g, "llama.block_count", &v), RK_OK);
    cr_assert_eq(v, 5);
    cr_assert_eq(rk_gguf_get_u32(g, "llama.embedding_length", &v), RK_OK);
    cr_assert_eq(v, 64);
    cr_assert_eq(rk_gguf_get_u32(g, "llama.attention.head_count_kv", &v), RK_OK);
    cr_assert_eq(v, 4);
    cr_assert_eq(rk_gguf_get_u32(g, "llama.feed_forward_length", &v), RK_OK);
    cr_assert_eq(v, 172);
    float eps;
    cr_assert_eq(rk_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &eps), RK_OK);
    cr_assert_float_eq(eps, 1e-5f, 1e-9f);
    float theta;
    cr_assert_eq(rk_gguf_get_f32(g, "llama.rope.freq_base", &theta), RK_ERR_NOT_FOUND);
    const char *const *toks;
    size_t n_tok;
    cr_assert_eq(rk_gguf_get_arr_str(g, "tokenizer.ggml.tokens", &toks, NULL, &n_tok), RK_OK);
    cr_assert_eq(n_tok, 512);
    cr_assert_str_eq(toks[1], "<s>");
    cr_assert_str_eq(toks[3], "<0x00>");

    const rk_gguf_tensor *t = rk_gguf_find_tensor(g, "token_embd.weight");
    cr_assert_not_null(t);
    cr_assert_eq(t->type, RK_GGML_F32);
    cr_assert_eq(t->n_dims, 2);
    cr_assert_eq(t->ne[0], 64);
    cr_assert_eq(t->ne[1], 512);
    cr_assert_eq(t->n_bytes, 64 * 512 * 4);
    cr_assert_eq(t->offset, 0);
    t = rk_gguf_find_tensor(g, "blk.4.ffn_down.weight");
    cr_assert_not_null(t);
    cr_assert_eq(t->ne[0], 172);
    cr_assert_eq(t->ne[1], 64);
    t = rk_gguf_find_tensor(g, "blk.0.attn_k.weight");
    cr_assert_eq(t->ne[1], 32);
    cr_assert_not_null(rk_gguf_find_tensor(g, "output.weight"));
    cr_assert_null(rk_gguf_find_tensor(g, "blk.5.attn_q.weight"));
    const float *w = rk_gguf_find_tensor(g, "output_norm.weight")->data;
    cr_assert(isfinite(w[0]) && w[0] != 0.0f);
    rk_gguf_close(g);
    free(path);
}

/* ---------------------------------------------------------------- hostile files */

/* A small valid file: 3 keys (one a string array), 2 tensors whose sizes are
 * multiples of 32 so the file ends exactly at the last tensor's data. */
static void small_valid(void **out_buf, size_t *out_len) {
    rk_gguf_writer *w;
    cr_assert_eq(rk_gguf_writer_create(&w), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_str(w, "general.architecture", "llama"), RK_OK);
    cr_assert_eq(rk_gguf_writer_set_u32(w, "llama.block_count", 1), RK_OK);
    const char *toks[] = {"a", "bc"};
    cr_assert_eq(rk_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, NULL, 2), RK_OK);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "w", RK_GGML_F32, 2, (int64_t[]){4, 2}), RK_OK);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "v", RK_GGML_F16, 1, (int64_t[]){16}), RK_OK);
    cr_assert_eq(rk_gguf_writer_write_memory(w, fill_pattern, NULL, out_buf, out_len), RK_OK);
    rk_gguf_writer_free(w);
}

static bytes bytes_of(const void *p, size_t n) {
    bytes b = {0};
    b_put(&b, p, n);
    return b;
}

Test(gguf, rejects_wrong_magic) {
    void *buf;
    size_t len;
    small_valid(&buf, &len);
    bytes b = bytes_of(buf, len);
    b.p[0] = 'X';
    expect_fail(&b, RK_ERR_FORMAT, "not a GGUF file");
    free(b.p);
    free(buf);
}

Test(gguf, rejects_version_1_and_99_and_big_endian) {
    void *buf;
    size_t len;
    small_valid(&buf, &len);
    bytes b = bytes_of(buf, len);
    uint32_t v = 1;
    memcpy(b.p + 4, &v, 4);
    expect_fail(&b, RK_ERR_FORMAT, "version 1 is not supported");
    v = 99;
    memcpy(b.p + 4, &v, 4);
    expect_fail(&b, RK_ERR_FORMAT, "unsupported GGUF version 99");
    v = 0x03000000;
    memcpy(b.p + 4, &v, 4);
    expect_fail(&b, RK_ERR_FORMAT, "big-endian");
    v = 2; /* version 2 has the same layout and is accepted */
    memcpy(b.p + 4, &v, 4);
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open_memory(b.p, b.n, &g), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_gguf_version(g), 2);
    rk_gguf_close(g);
    free(b.p);
    free(buf);
}

Test(gguf, every_truncation_of_a_small_file_fails_cleanly) {
    void *buf;
    size_t len;
    small_valid(&buf, &len);
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open_memory(buf, len, &g), RK_OK);
    const rk_gguf_tensor *last = rk_gguf_tensor_at(g, 1);
    cr_assert_eq((const uint8_t *)last->data + last->n_bytes, (const uint8_t *)buf + len,
                 "the test needs a file without trailing padding");
    rk_gguf_close(g);
    for (size_t n = 0; n < len; n++) {
        void *copy = malloc(n ? n : 1); /* exact size: the sanitizer sees any over-read */
        memcpy(copy, buf, n);
        rk_error_clear();
        g = NULL;
        rk_status st = rk_gguf_open_memory(copy, n, &g);
        cr_assert_eq(st, RK_ERR_FORMAT, "prefix of %zu bytes: status %d", n, st);
        cr_assert_null(g);
        cr_assert_neq(rk_error_message()[0], '\0', "prefix of %zu bytes: no message", n);
        free(copy);
    }
    free(buf);
}

Test(gguf, random_corruptions_never_crash) {
    void *buf;
    size_t len;
    small_valid(&buf, &len);
    uint64_t s = 0x9E3779B97F4A7C15ull;
    int n_ok = 0, n_fail = 0;
    for (int iter = 0; iter < 3000; iter++) {
        uint8_t *copy = malloc(len);
        memcpy(copy, buf, len);
        int flips = 1 + iter % 4;
        for (int f = 0; f < flips; f++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            size_t pos = (size_t)(s % len);
            copy[pos] = (uint8_t)(s >> 32);
        }
        rk_gguf *g = NULL;
        rk_status st = rk_gguf_open_memory(copy, len, &g);
        if (st == RK_OK) {
            n_ok++;
            /* Touch everything the reader hands out. */
            for (int64_t i = 0; i < rk_gguf_n_kv(g); i++) cr_assert_not_null(rk_gguf_kv_key(g, i));
            unsigned sum = 0;
            for (int64_t i = 0; i < rk_gguf_n_tensors(g); i++) {
                const rk_gguf_tensor *t = rk_gguf_tensor_at(g, i);
                for (size_t j = 0; j < t->n_bytes; j++) sum += ((const uint8_t *)t->data)[j];
            }
            (void)sum;
            FILE *devnull = fopen("/dev/null", "w");
            rk_gguf_print_info(g, devnull);
            fclose(devnull);
            rk_gguf_close(g);
        } else {
            n_fail++;
            cr_assert(st == RK_ERR_FORMAT, "status %d: %s", st, rk_error_message());
            cr_assert_neq(rk_error_message()[0], '\0');
        }
        free(copy);
    }
    cr_assert_gt(n_fail, 100);
    cr_assert_gt(n_ok, 10); /* flips inside tensor data leave valid files */
    free(buf);
}

Test(gguf, rejects_huge_counts) {
    void *buf;
    size_t len;
    small_valid(&buf, &len);
    bytes b = bytes_of(buf, len);
    uint64_t huge = 1ULL << 62;
    memcpy(b.p + 8, &huge, 8); /* n_tensors */
    expect_fail(&b, RK_ERR_FORMAT, "tensor count 4611686018427387904");
    memcpy(b.p + 8, (const uint8_t *)buf + 8, 8);
    memcpy(b.p + 16, &huge, 8); /* n_kv */
    expect_fail(&b, RK_ERR_FORMAT, "metadata count 4611686018427387904");
    huge = UINT64_MAX;
    memcpy(b.p + 16, &huge, 8);
    expect_fail(&b, RK_ERR_FORMAT, "metadata count");
    free(b.p);
    free(buf);
}

Test(gguf, rejects_strings_past_the_end) {
    bytes b = {0};
    b_header(&b, 3, 0, 1);
    b_u64(&b, 1000); /* key length */
    b_put(&b, "general.name", 12);
    expect_fail(&b, RK_ERR_FORMAT, "past the end of the file");
    free(b.p);

    b = (bytes){0};
    b_header(&b, 3, 0, 1);
    b_str(&b, "general.name");
    b_u32(&b, RK_GGUF_STRING);
    b_u64(&b, UINT64_MAX); /* value length */
    b_put(&b, "abc", 3);
    expect_fail(&b, RK_ERR_FORMAT, "general.name");
    free(b.p);

    b = (bytes){0};
    b_header(&b, 3, 0, 1);
    b_str(&b, "tokenizer.ggml.tokens");
    b_u32(&b, RK_GGUF_ARRAY);
    b_u32(&b, RK_GGUF_STRING);
    b_u64(&b, 2);
    b_str(&b, "ok");
    b_u64(&b, 1ULL << 40); /* second string too long */
    b_put(&b, "xy", 2);
    expect_fail(&b, RK_ERR_FORMAT, "string 1");
    free(b.p);
}

Test(gguf, rejects_huge_arrays) {
    bytes b = {0};
    b_header(&b, 3, 0, 1);
    b_str(&b, "a");
    b_u32(&b, RK_GGUF_ARRAY);
    b_u32(&b, RK_GGUF_UINT32);
    b_u64(&b, 1ULL << 61);
    b_zeros(&b, 64);
    expect_fail(&b, RK_ERR_FORMAT, "key 'a'");
    free(b.p);

    b = (bytes){0};
    b_header(&b, 3, 0, 1);
    b_str(&b, "s");
    b_u32(&b, RK_GGUF_ARRAY);
    b_u32(&b, RK_GGUF_STRING);
    b_u64(&b, UINT64_MAX);
    b_zeros(&b, 64);
    expect_fail(&b, RK_ERR_FORMAT, "key 's'");
    free(b.p);
}

Test(gguf, rejects_arrays_of_arrays_and_unknown_value_types) {
    bytes b = {0};
    b_header(&b, 3, 0, 1);
    b_str(&b, "nested");
    b_u32(&b, RK_GGUF_ARRAY);
    b_u32(&b, RK_GGUF_ARRAY);
    b_u64(&b, 1);
    b_u32(&b, RK_GGUF_UINT8);
    b_u64(&b, 1);
    b_put(&b, "x", 1);
    expect_fail(&b, RK_ERR_FORMAT, "array of arrays");
    free(b.p);

    b = (bytes){0};
    b_header(&b, 3, 0, 1);
    b_str(&b, "weird");
    b_u32(&b, 13);
    b_u32(&b, 0);
    expect_fail(&b, RK_ERR_FORMAT, "unknown value type 13");
    free(b.p);

    b = (bytes){0};
    b_header(&b, 3, 0, 1);
    b_str(&b, "weird_arr");
    b_u32(&b, RK_GGUF_ARRAY);
    b_u32(&b, 77);
    b_u64(&b, 0);
    expect_fail(&b, RK_ERR_FORMAT, "unknown type 77");
    free(b.p);
}

Test(gguf, rejects_duplicate_and_empty_keys_and_bad_alignment) {
    bytes b = {0};
    b_header(&b, 3, 0, 2);
    b_kv_u32(&b, "llama.block_count", 1);
    b_kv_u32(&b, "llama.block_count", 2);
    expect_fail(&b, RK_ERR_FORMAT, "duplicate metadata key 'llama.block_count'");
    free(b.p);

    b = (bytes){0};
    b_header(&b, 3, 0, 1);
    b_kv_u32(&b, "", 1);
    expect_fail(&b, RK_ERR_FORMAT, "empty key");
    free(b.p);

    b = (bytes){0};
    b_header(&b, 3, 0, 1);
    b_u64(&b, 3);
    b_put(&b, "a\0b", 3);
    b_u32(&b, RK_GGUF_UINT32);
    b_u32(&b, 1);
    expect_fail(&b, RK_ERR_FORMAT, "NUL byte");
    free(b.p);

    b = (bytes){0};
    b_header(&b, 3, 0, 1);
    b_kv_u32(&b, "general.alignment", 48);
    expect_fail(&b, RK_ERR_FORMAT, "general.alignment = 48 is not a power of two");
    free(b.p);

    b = (bytes){0};
    b_header(&b, 3, 0, 1);
    b_str(&b, "general.alignment");
    b_u32(&b, RK_GGUF_UINT64);
    b_u64(&b, 32);
    expect_fail(&b, RK_ERR_FORMAT, "must be u32");
    free(b.p);
}

/* A file with the given tensor infos followed by `data_bytes` of data. */
static bytes one_tensor_file(uint32_t n_dims, const uint64_t *ne, uint32_t type, uint64_t offset,
                             size_t data_bytes) {
    bytes b = {0};
    b_header(&b, 3, 1, 0);
    b_tensor(&b, "blk.0.attn_q.weight", n_dims, ne, type, offset);
    b_pad(&b, 32);
    b_zeros(&b, data_bytes);
    return b;
}

Test(gguf, rejects_bad_tensor_dimensions) {
    const uint64_t ne5[5] = {2, 2, 2, 2, 2};
    bytes b = one_tensor_file(5, ne5, RK_GGML_F32, 0, 256);
    expect_fail(&b, RK_ERR_FORMAT, "has 5 dimensions");
    free(b.p);
    b = one_tensor_file(0, ne5, RK_GGML_F32, 0, 256);
    expect_fail(&b, RK_ERR_FORMAT, "has 0 dimensions");
    free(b.p);
    b = one_tensor_file(2, (const uint64_t[]){4, 0}, RK_GGML_F32, 0, 256);
    expect_fail(&b, RK_ERR_FORMAT, "dimension 1 is 0");
    free(b.p);
    b = one_tensor_file(2, (const uint64_t[]){(uint64_t)-4, 1}, RK_GGML_F32, 0, 256);
    expect_fail(&b, RK_ERR_FORMAT, "dimension 0 is -4");
    free(b.p);
    b = one_tensor_file(3, (const uint64_t[]){1ULL << 32, 1ULL << 32, 4}, RK_GGML_F32, 0, 256);
    expect_fail(&b, RK_ERR_FORMAT, "element count overflows");
    free(b.p);
    b = one_tensor_file(2, (const uint64_t[]){1ULL << 30, 1ULL << 30}, RK_GGML_F32, 0, 256);
    expect_fail(&b, RK_ERR_FORMAT, "outside the data section");
    free(b.p);
    b = one_tensor_file(1, (const uint64_t[]){48}, RK_GGML_Q8_0, 0, 256);
    expect_fail(&b, RK_ERR_FORMAT, "not a multiple of the Q8_0 block size");
    free(b.p);
}

Test(gguf, rejects_unknown_tensor_types) {
    bytes b = one_tensor_file(1, (const uint64_t[]){8}, 4, 0, 64); /* removed Q4_2 */
    expect_fail(&b, RK_ERR_FORMAT, "unknown type 4");
    free(b.p);
    b = one_tensor_file(1, (const uint64_t[]){8}, 1000, 0, 64);
    expect_fail(&b, RK_ERR_FORMAT, "blk.0.attn_q.weight");
    free(b.p);
    /* A known quantized type with a computable size is accepted (the loader decides). */
    b = one_tensor_file(1, (const uint64_t[]){256}, 12, 0, 160); /* Q4_K: 144 bytes */
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open_memory(b.p, b.n, &g), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_gguf_tensor_at(g, 0)->n_bytes, 144);
    rk_gguf_close(g);
    free(b.p);
}

Test(gguf, rejects_tensor_data_outside_the_file_or_misaligned) {
    bytes b = one_tensor_file(1, (const uint64_t[]){8}, RK_GGML_F32, 64, 64);
    expect_fail(&b, RK_ERR_FORMAT, "outside the data section");
    free(b.p);
    b = one_tensor_file(1, (const uint64_t[]){8}, RK_GGML_F32, UINT64_MAX - 31, 64);
    expect_fail(&b, RK_ERR_FORMAT, "outside the data section");
    free(b.p);
    b = one_tensor_file(1, (const uint64_t[]){8}, RK_GGML_F32, 8, 64);
    expect_fail(&b, RK_ERR_FORMAT, "not a multiple of the alignment 32");
    free(b.p);
    b = one_tensor_file(1, (const uint64_t[]){8}, RK_GGML_F32, 0, 31); /* 32 bytes needed */
    expect_fail(&b, RK_ERR_FORMAT, "outside the data section");
    free(b.p);
    /* No data section at all. */
    bytes h = {0};
    b_header(&h, 3, 1, 0);
    b_tensor(&h, "t", 1, (const uint64_t[]){8}, RK_GGML_F32, 0);
    expect_fail(&h, RK_ERR_FORMAT, "data section");
    free(h.p);
}

Test(gguf, rejects_overlapping_tensors_and_duplicate_names) {
    bytes b = {0};
    b_header(&b, 3, 2, 0);
    b_tensor(&b, "a", 1, (const uint64_t[]){16}, RK_GGML_F32, 0);
    b_tensor(&b, "b", 1, (const uint64_t[]){16}, RK_GGML_F32, 32); /* a spans 0..63 */
    b_pad(&b, 32);
    b_zeros(&b, 128);
    expect_fail(&b, RK_ERR_FORMAT, "overlap");
    free(b.p);

    b = (bytes){0};
    b_header(&b, 3, 2, 0);
    b_tensor(&b, "same", 1, (const uint64_t[]){8}, RK_GGML_F32, 0);
    b_tensor(&b, "same", 1, (const uint64_t[]){8}, RK_GGML_F32, 32);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    expect_fail(&b, RK_ERR_FORMAT, "duplicate tensor name 'same'");
    free(b.p);

    /* Out of order but disjoint is fine. */
    b = (bytes){0};
    b_header(&b, 3, 2, 0);
    b_tensor(&b, "late", 1, (const uint64_t[]){8}, RK_GGML_F32, 32);
    b_tensor(&b, "early", 1, (const uint64_t[]){8}, RK_GGML_F32, 0);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open_memory(b.p, b.n, &g), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_gguf_find_tensor(g, "early")->offset, 0);
    rk_gguf_close(g);
    free(b.p);
}

Test(gguf, accepts_an_empty_file_with_no_tensors_but_rejects_zero_bytes) {
    bytes b = {0};
    b_header(&b, 3, 0, 0);
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open_memory(b.p, b.n, &g), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_gguf_n_kv(g), 0);
    cr_assert_eq(rk_gguf_n_tensors(g), 0);
    rk_gguf_close(g);
    rk_gguf_close(NULL);
    bytes empty = {0};
    expect_fail(&empty, RK_ERR_FORMAT, "truncated");
    free(b.p);
}

Test(gguf, a_truncated_file_on_disk_fails_cleanly) {
    char *dir = rk_test_tmpdir("gguf");
    char path[4096];
    snprintf(path, sizeof path, "%s/trunc.gguf", dir);
    rk_gguf_writer *w = make_full_writer();
    cr_assert_eq(rk_gguf_writer_write_file(w, path, fill_pattern, NULL), RK_OK);
    size_t total = rk_gguf_writer_total_size(w);
    rk_gguf_writer_free(w);
    rk_gguf *g = NULL;
    const size_t cuts[] = {total - 40, total / 2, 100, 10};
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        cr_assert_eq(truncate(path, (off_t)cuts[i]), 0);
        cr_assert_eq(rk_gguf_open(path, &g), RK_ERR_FORMAT, "cut at %zu", cuts[i]);
        cr_assert_null(g);
        cr_assert_not_null(strstr(rk_error_message(), path), "%s", rk_error_message());
    }
    cr_assert_eq(truncate(path, 0), 0);
    cr_assert_eq(rk_gguf_open(path, &g), RK_ERR_FORMAT);
    cr_assert_not_null(strstr(rk_error_message(), "empty file"));
    unlink(path);
    cr_assert_eq(rk_gguf_open(path, &g), RK_ERR_IO);
    cr_assert_not_null(strstr(rk_error_message(), "cannot open"));
    cr_assert_eq(rk_gguf_open(dir, &g), RK_ERR_IO);
    cr_expect_eq(rmdir(dir), 0, "test left files in %s", dir);
    free(dir);
}

/* ---------------------------------------------------------------- model hyper-parameters */

/* One change to a copy of a model: replace (or drop) a metadata key, or
 * overwrite one element of a tensor with NaN or infinity. */
typedef struct edit {
    const char *key;   /* metadata key, or NULL */
    int drop;          /* leave the key out */
    rk_gguf_type type; /* of the new value: RK_GGUF_FLOAT32, RK_GGUF_UINT32 or RK_GGUF_STRING */
    float f;
    uint32_t u;
    const char *s;
    const char *tensor; /* tensor to poison, or NULL */
    int64_t at;         /* element index (ne[0] fastest) */
    int inf;            /* infinity instead of NaN */
} edit;

typedef struct copy_ctx {
    const rk_gguf *src;
    const edit *edits;
    int n_edits;
} copy_ctx;

static const edit *edit_for_key(const copy_ctx *c, const char *key) {
    for (int i = 0; i < c->n_edits; i++)
        if (c->edits[i].key && !strcmp(c->edits[i].key, key)) return &c->edits[i];
    return NULL;
}

/* Copy tensor i of the source, then poison the elements the edits name. */
static rk_status fill_copy(void *ctx, int64_t i, void *dst, size_t n_bytes) {
    const copy_ctx *c = ctx;
    const rk_gguf_tensor *t = rk_gguf_tensor_at(c->src, i);
    cr_assert_eq(t->n_bytes, n_bytes);
    memcpy(dst, t->data, n_bytes);
    for (int e = 0; e < c->n_edits; e++) {
        const edit *ed = &c->edits[e];
        if (!ed->tensor || strcmp(ed->tensor, t->name)) continue;
        uint32_t f32 = ed->inf ? 0x7f800000u : 0x7fc00000u;
        uint16_t f16 = ed->inf ? 0x7c00u : 0x7e00u, bf16 = ed->inf ? 0x7f80u : 0x7fc0u;
        unsigned char *p = dst;
        if (t->type == RK_GGML_F32)
            memcpy(p + ed->at * 4, &f32, 4);
        else
            memcpy(p + ed->at * 2, t->type == RK_GGML_F16 ? &f16 : &bf16, 2);
    }
    return RK_OK;
}

/* Put key k of src into w unchanged (the value types synthetic models use). */
static void copy_kv(rk_gguf_writer *w, const rk_gguf *src, int64_t k) {
    const char *key = rk_gguf_kv_key(src, k);
    rk_gguf_type type = rk_gguf_kv_type(src, k);
    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    float f;
    int b;
    const char *s;
    size_t n;
    switch (type) {
    case RK_GGUF_UINT32:
        cr_assert_eq(rk_gguf_get_u32(src, key, &u32), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_u32(w, key, u32), RK_OK);
        return;
    case RK_GGUF_INT32:
        cr_assert_eq(rk_gguf_get_i32(src, key, &i32), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_i32(w, key, i32), RK_OK);
        return;
    case RK_GGUF_UINT64:
        cr_assert_eq(rk_gguf_get_u64(src, key, &u64), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_u64(w, key, u64), RK_OK);
        return;
    case RK_GGUF_FLOAT32:
        cr_assert_eq(rk_gguf_get_f32(src, key, &f), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_f32(w, key, f), RK_OK);
        return;
    case RK_GGUF_BOOL:
        cr_assert_eq(rk_gguf_get_bool(src, key, &b), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_bool(w, key, b), RK_OK);
        return;
    case RK_GGUF_STRING:
        cr_assert_eq(rk_gguf_get_str(src, key, &s, &n), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_str_len(w, key, s, n), RK_OK);
        return;
    case RK_GGUF_ARRAY: break;
    default: cr_assert_fail("key %s: type %d not copied", key, type);
    }
    switch (rk_gguf_kv_arr_type(src, k)) {
    case RK_GGUF_STRING: {
        const char *const *strs;
        const uint32_t *lens;
        cr_assert_eq(rk_gguf_get_arr_str(src, key, &strs, &lens, &n), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_arr_str(w, key, strs, lens, n), RK_OK);
        return;
    }
    case RK_GGUF_FLOAT32: {
        float *a;
        cr_assert_eq(rk_gguf_get_arr_f32(src, key, &a, &n), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_arr_f32(w, key, a, n), RK_OK);
        free(a);
        return;
    }
    case RK_GGUF_INT32: {
        int32_t *a;
        cr_assert_eq(rk_gguf_get_arr_i32(src, key, &a, &n), RK_OK);
        cr_assert_eq(rk_gguf_writer_set_arr_i32(w, key, a, n), RK_OK);
        free(a);
        return;
    }
    default: cr_assert_fail("key %s: array type not copied", key);
    }
}

static void set_edit(rk_gguf_writer *w, const edit *e) {
    rk_status st = e->type == RK_GGUF_FLOAT32  ? rk_gguf_writer_set_f32(w, e->key, e->f)
                   : e->type == RK_GGUF_UINT32 ? rk_gguf_writer_set_u32(w, e->key, e->u)
                                               : rk_gguf_writer_set_str(w, e->key, e->s);
    cr_assert_eq(st, RK_OK, "%s", rk_error_message());
}

/* Write, with the GGUF writer, a copy of the synthetic `tiny` model (llama,
 * 4 layers, dim 128, 4 heads / 2 KV, 2-D weights of type wtype) with the
 * edits applied, and load it on the CPU backend. Returns the load status;
 * the model, when one loaded, is freed. */
static rk_status load_edited(rk_ggml_type wtype, const edit *edits, int n_edits) {
    rk_mkmodel_opts opts;
    rk_mkmodel_opts_default(&opts);
    opts.wtype = wtype;
    void *base;
    size_t base_len;
    cr_assert_eq(rk_mkmodel_build_memory(&opts, &base, &base_len), RK_OK, "%s", rk_error_message());
    rk_gguf *src;
    cr_assert_eq(rk_gguf_open_memory(base, base_len, &src), RK_OK, "%s", rk_error_message());
    copy_ctx c = {src, edits, n_edits};
    rk_gguf_writer *w;
    cr_assert_eq(rk_gguf_writer_create(&w), RK_OK);
    for (int64_t k = 0; k < rk_gguf_n_kv(src); k++) {
        const char *key = rk_gguf_kv_key(src, k);
        const edit *e = edit_for_key(&c, key);
        if (!e)
            copy_kv(w, src, k);
        else if (!e->drop)
            set_edit(w, e);
    }
    /* Edited keys the base model lacks are added. */
    for (int i = 0; i < n_edits; i++)
        if (edits[i].key && !edits[i].drop && rk_gguf_find_key(src, edits[i].key) < 0)
            set_edit(w, &edits[i]);
    for (int64_t i = 0; i < rk_gguf_n_tensors(src); i++) {
        const rk_gguf_tensor *t = rk_gguf_tensor_at(src, i);
        cr_assert_eq(rk_gguf_writer_add_tensor(w, t->name, (rk_ggml_type)t->type, t->n_dims, t->ne),
                     RK_OK);
    }
    void *buf;
    size_t len;
    cr_assert_eq(rk_gguf_writer_write_memory(w, fill_copy, &c, &buf, &len), RK_OK, "%s",
                 rk_error_message());
    rk_gguf_writer_free(w);
    rk_gguf_close(src);
    free(base);

    rk_backend *be;
    cr_assert_eq(rk_backend_create("cpu", 1, &be), RK_OK);
    rk_model *m = (rk_model *)0x1;
    rk_error_clear();
    rk_status st = rk_model_load_owned_buffer(buf, len, "edited", be, &m);
    if (st) cr_assert_null(m);
    rk_model_free(m);
    rk_backend_free(be);
    return st;
}

/* Load with one edit; expect RK_ERR_FORMAT and a message holding every needle. */
static void expect_refused(rk_ggml_type wtype, edit e, const char *needle, const char *needle2) {
    rk_status st = load_edited(wtype, &e, 1);
    cr_assert_eq(st, RK_ERR_FORMAT, "status %d: %s", st, rk_error_message());
    cr_assert_not_null(strstr(rk_error_message(), needle), "message '%s' lacks '%s'",
                       rk_error_message(), needle);
    if (needle2)
        cr_assert_not_null(strstr(rk_error_message(), needle2), "message '%s' lacks '%s'",
                           rk_error_message(), needle2);
}

static edit set_f32(const char *key, float v) {
    return (edit){.key = key, .type = RK_GGUF_FLOAT32, .f = v};
}
static edit set_u32(const char *key, uint32_t v) {
    return (edit){.key = key, .type = RK_GGUF_UINT32, .u = v};
}

Test(model_load, the_unedited_copy_loads) {
    cr_assert_eq(load_edited(RK_GGML_F32, NULL, 0), RK_OK, "%s", rk_error_message());
    /* The smallest values the checks allow. */
    edit ok[] = {set_u32("llama.context_length", 2),
                 set_f32("llama.attention.layer_norm_rms_epsilon", 1e-30f),
                 set_u32("llama.rope.dimension_count", 2)};
    cr_assert_eq(load_edited(RK_GGML_F32, ok, 3), RK_OK, "%s", rk_error_message());
}

Test(model_load, refuses_a_nan_negative_or_zero_rms_epsilon) {
    const char *key = "llama.attention.layer_norm_rms_epsilon";
    const float bad[] = {NAN, -1e-5f, 0.0f, INFINITY};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_refused(RK_GGML_F32, set_f32(key, bad[i]), key, NULL);
    expect_refused(RK_GGML_F32, (edit){.key = key, .type = RK_GGUF_STRING, .s = "1e-5"}, key,
                   "has type string");
}

Test(model_load, refuses_a_context_length_of_0_or_1) {
    expect_refused(RK_GGML_F32, set_u32("llama.context_length", 0), "llama.context_length", "= 0");
    expect_refused(RK_GGML_F32, set_u32("llama.context_length", 1), "llama.context_length", "= 1");
}

Test(model_load, refuses_a_bad_rope_frequency_base) {
    const float bad[] = {NAN, -10000.0f, 0.0f, INFINITY};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_refused(RK_GGML_F32, set_f32("llama.rope.freq_base", bad[i]), "llama.rope.freq_base",
                       NULL);
}

Test(model_load, refuses_a_bad_rope_dimension_count) {
    /* tiny: head_dim 32 */
    const uint32_t bad[] = {0, 3, 34, 64};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_refused(RK_GGML_F32, set_u32("llama.rope.dimension_count", bad[i]),
                       "llama.rope.dimension_count", NULL);
}

Test(model_load, refuses_a_bad_rope_scaling_factor_when_scaling) {
    edit e[] = {{.key = "llama.rope.scaling.type", .type = RK_GGUF_STRING, .s = "linear"},
                set_f32("llama.rope.scaling.factor", NAN)};
    cr_assert_eq(load_edited(RK_GGML_F32, e, 2), RK_ERR_FORMAT);
    cr_assert_not_null(strstr(rk_error_message(), "llama.rope.scaling.factor"), "%s",
                       rk_error_message());
    e[1].f = INFINITY;
    cr_assert_eq(load_edited(RK_GGML_F32, e, 2), RK_ERR_FORMAT);
    e[1].f = 2.0f;
    cr_assert_eq(load_edited(RK_GGML_F32, e, 2), RK_OK, "%s", rk_error_message());
}

Test(model_load, refuses_head_counts_that_do_not_divide) {
    expect_refused(RK_GGML_F32, set_u32("llama.attention.head_count_kv", 3),
                   "llama.attention.head_count 4", "llama.attention.head_count_kv 3");
    /* Without key_length, head_dim comes from embedding_length / head_count. */
    edit e[] = {set_u32("llama.attention.head_count", 3),
                set_u32("llama.attention.head_count_kv", 1),
                {.key = "llama.attention.key_length", .drop = 1},
                {.key = "llama.attention.value_length", .drop = 1}};
    cr_assert_eq(load_edited(RK_GGML_F32, e, 4), RK_ERR_FORMAT);
    cr_assert_not_null(strstr(rk_error_message(), "llama.embedding_length 128"), "%s",
                       rk_error_message());
}

Test(model_load, refuses_nan_and_infinite_weights_naming_the_tensor) {
    const rk_ggml_type types[] = {RK_GGML_F32, RK_GGML_F16, RK_GGML_BF16};
    for (size_t i = 0; i < 3; i++) {
        /* A matrix (of the weight type), past the first scan block. */
        expect_refused(types[i], (edit){.tensor = "blk.2.ffn_down.weight", .at = 5000},
                       "tensor blk.2.ffn_down.weight has a NaN", "element 5000");
        expect_refused(types[i], (edit){.tensor = "token_embd.weight", .at = 0, .inf = 1},
                       "tensor token_embd.weight has an infinite value", "element 0");
    }
    /* Norm weights are F32 in every file. */
    expect_refused(RK_GGML_BF16, (edit){.tensor = "blk.3.attn_norm.weight", .at = 127},
                   "tensor blk.3.attn_norm.weight has a NaN", "element 127");
    expect_refused(RK_GGML_F32, (edit){.tensor = "output.weight", .at = 128 * 10 - 1},
                   "tensor output.weight", "element 1279");
}

Test(gguf, nonfinite_scan_finds_the_first_nan_or_infinity_of_each_float_type) {
    rk_gguf_writer *w;
    cr_assert_eq(rk_gguf_writer_create(&w), RK_OK);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "f32", RK_GGML_F32, 1, (int64_t[]){10000}), RK_OK);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "f16", RK_GGML_F16, 1, (int64_t[]){10000}), RK_OK);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "bf16", RK_GGML_BF16, 1, (int64_t[]){10000}), RK_OK);
    cr_assert_eq(rk_gguf_writer_add_tensor(w, "q8", RK_GGML_Q8_0, 1, (int64_t[]){32}), RK_OK);
    void *buf;
    size_t len;
    cr_assert_eq(rk_gguf_writer_write_memory(w, NULL, NULL, &buf, &len), RK_OK);
    rk_gguf_writer_free(w);
    rk_gguf *g;
    cr_assert_eq(rk_gguf_open_memory(buf, len, &g), RK_OK, "%s", rk_error_message());
    /* Zero-filled; the largest finite values and negative zero are finite too. */
    const rk_gguf_tensor *t32 = rk_gguf_find_tensor(g, "f32"), *t16 = rk_gguf_find_tensor(g, "f16"),
                         *tb = rk_gguf_find_tensor(g, "bf16");
    uint32_t *p32 = (uint32_t *)t32->data;
    uint16_t *p16 = (uint16_t *)t16->data, *pb = (uint16_t *)tb->data;
    p32[1] = 0x7f7fffffu; /* FLT_MAX */
    p32[2] = 0x80000000u;
    p16[1] = 0x7bffu; /* 65504 */
    pb[1] = 0xff7fu;  /* -max */
    cr_assert_eq(rk_gguf_tensor_first_nonfinite(t32), -1);
    cr_assert_eq(rk_gguf_tensor_first_nonfinite(t16), -1);
    cr_assert_eq(rk_gguf_tensor_first_nonfinite(tb), -1);
    /* The last element, then an earlier one in another block, then a negative NaN. */
    p32[9999] = 0x7f800000u;
    p16[9999] = 0x7c00u;
    pb[9999] = 0x7f80u;
    cr_assert_eq(rk_gguf_tensor_first_nonfinite(t32), 9999);
    cr_assert_eq(rk_gguf_tensor_first_nonfinite(t16), 9999);
    cr_assert_eq(rk_gguf_tensor_first_nonfinite(tb), 9999);
    p32[4100] = 0xffc00001u;
    p16[4096] = 0xfe00u;
    pb[3] = 0xffc1u;
    cr_assert_eq(rk_gguf_tensor_first_nonfinite(t32), 4100);
    cr_assert_eq(rk_gguf_tensor_first_nonfinite(t16), 4096);
    cr_assert_eq(rk_gguf_tensor_first_nonfinite(tb), 3);
    cr_assert_eq(rk_gguf_tensor_first_nonfinite(rk_gguf_find_tensor(g, "q8")), -1);
    rk_gguf_close(g);
    free(buf);
}
