/* engine/gguf.h — reading and writing GGUF model files (versions 2 and 3).
 *
 * The reader maps the file read-only, validates every count, length, offset
 * and alignment against the file size before using it, copies the metadata
 * (keys, strings, arrays) into memory it owns, and exposes tensor data as
 * pointers into the mapping. A malformed or hostile file yields an error with
 * a message (rk_error_message()), never a crash. The file format itself is
 * described at the top of gguf.c.
 *
 * Ownership: an opened rk_gguf owns its mapping and its metadata copies;
 * every string, array and tensor pointer it hands out stays valid until
 * rk_gguf_close, and is read-only. A writer owns what was added to it.
 *
 * Threads: an opened file is immutable, so any number of threads may read
 * it (lookups, tensor data) at once; open and close are the owner's, with
 * no reader left. A writer is used by one thread. Errors go to the calling
 * thread's message slot. */
#ifndef RK_GGUF_H
#define RK_GGUF_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "config/config.h"

/* Metadata value types, numbered as in the file. */
typedef enum rk_gguf_type {
    RK_GGUF_UINT8 = 0,
    RK_GGUF_INT8 = 1,
    RK_GGUF_UINT16 = 2,
    RK_GGUF_INT16 = 3,
    RK_GGUF_UINT32 = 4,
    RK_GGUF_INT32 = 5,
    RK_GGUF_FLOAT32 = 6,
    RK_GGUF_BOOL = 7,
    RK_GGUF_STRING = 8,
    RK_GGUF_ARRAY = 9,
    RK_GGUF_UINT64 = 10,
    RK_GGUF_INT64 = 11,
    RK_GGUF_FLOAT64 = 12,
} rk_gguf_type;

/* Tensor element types, numbered as in ggml. Only the ones ragkv computes
 * with are named; others are reported as unsupported by the loader. */
typedef enum rk_ggml_type {
    RK_GGML_F32 = 0,
    RK_GGML_F16 = 1,
    RK_GGML_Q4_0 = 2,
    RK_GGML_Q4_1 = 3,
    RK_GGML_Q5_0 = 6,
    RK_GGML_Q5_1 = 7,
    RK_GGML_Q8_0 = 8,
    RK_GGML_Q2_K = 10,
    RK_GGML_Q3_K = 11,
    RK_GGML_Q4_K = 12,
    RK_GGML_Q5_K = 13,
    RK_GGML_Q6_K = 14,
    RK_GGML_IQ4_NL = 20,
    RK_GGML_IQ4_XS = 23,
    RK_GGML_BF16 = 30,
    RK_GGML_MXFP4 = 39,
} rk_ggml_type;

#define RK_GGUF_MAX_DIMS 4

typedef struct rk_gguf_tensor {
    const char *name;             /* NUL-terminated, owned by the rk_gguf */
    uint32_t type;                /* rk_ggml_type value as stored in the file */
    uint32_t n_dims;              /* 1..RK_GGUF_MAX_DIMS */
    int64_t ne[RK_GGUF_MAX_DIMS]; /* elements per dim, ne[0] fastest; unused dims are 1 */
    uint64_t offset;              /* offset from the start of the data section */
    size_t n_bytes;               /* size of the data */
    const void *data;             /* points into the read-only mapping */
} rk_gguf_tensor;

typedef struct rk_gguf rk_gguf; /* opaque */

/* Open and validate a GGUF file. On success *out owns the mapping and must be
 * released with rk_gguf_close(). On failure returns RK_ERR_IO / RK_ERR_FORMAT /
 * RK_ERR_NOMEM with a message naming the file and the problem. */
rk_status rk_gguf_open(const char *path, rk_gguf **out);

/* Same, over a caller-owned buffer that must outlive the rk_gguf (tests, fuzzing). */
rk_status rk_gguf_open_memory(const void *data, size_t size, rk_gguf **out);

/* Release everything; accepts NULL. */
void rk_gguf_close(rk_gguf *g);

uint32_t rk_gguf_version(const rk_gguf *g);
size_t rk_gguf_alignment(const rk_gguf *g);
size_t rk_gguf_file_size(const rk_gguf *g);

/* ---- metadata: enumerate */
int64_t rk_gguf_n_kv(const rk_gguf *g);
const char *rk_gguf_kv_key(const rk_gguf *g, int64_t i);
rk_gguf_type rk_gguf_kv_type(const rk_gguf *g, int64_t i);
/* For arrays: element type and count (0 for non-arrays). */
rk_gguf_type rk_gguf_kv_arr_type(const rk_gguf *g, int64_t i);
uint64_t rk_gguf_kv_arr_n(const rk_gguf *g, int64_t i);
/* Index of a key, or -1 when absent. */
int64_t rk_gguf_find_key(const rk_gguf *g, const char *key);

/* ---- metadata: typed getters. Each returns RK_ERR_NOT_FOUND when the key is
 * absent (with no message: absence is often normal) and RK_ERR_FORMAT when the
 * stored type cannot be converted (with a message). Integer getters accept any
 * integer type whose value fits; float getters accept float32 and float64. */
rk_status rk_gguf_get_u32(const rk_gguf *g, const char *key, uint32_t *out);
rk_status rk_gguf_get_i32(const rk_gguf *g, const char *key, int32_t *out);
rk_status rk_gguf_get_u64(const rk_gguf *g, const char *key, uint64_t *out);
rk_status rk_gguf_get_f32(const rk_gguf *g, const char *key, float *out);
rk_status rk_gguf_get_bool(const rk_gguf *g, const char *key, int *out);
/* *out is NUL-terminated and owned by g; *out_len (may be NULL) excludes the NUL. */
rk_status rk_gguf_get_str(const rk_gguf *g, const char *key, const char **out, size_t *out_len);

/* Arrays of strings: *out_strs[i] NUL-terminated, *out_lens[i] its byte length
 * (strings may contain NUL bytes in principle), both owned by g. */
rk_status rk_gguf_get_arr_str(const rk_gguf *g, const char *key, const char *const **out_strs,
                              const uint32_t **out_lens, size_t *out_n);
/* Numeric arrays, converted; *out is malloc'ed and owned by the caller. */
rk_status rk_gguf_get_arr_f32(const rk_gguf *g, const char *key, float **out, size_t *out_n);
rk_status rk_gguf_get_arr_i32(const rk_gguf *g, const char *key, int32_t **out, size_t *out_n);

/* ---- tensors */
int64_t rk_gguf_n_tensors(const rk_gguf *g);
const rk_gguf_tensor *rk_gguf_tensor_at(const rk_gguf *g, int64_t i);
/* NULL when absent. */
const rk_gguf_tensor *rk_gguf_find_tensor(const rk_gguf *g, const char *name);
/* Index of the first NaN or infinite element of an F32, F16 or BF16 tensor
 * (ne[0] fastest), or -1 when all are finite; other types are not examined
 * (-1). Reads every element, in vectorised blocks. */
int64_t rk_gguf_tensor_first_nonfinite(const rk_gguf_tensor *t);

/* Name of a ggml type ("F32", "BF16", ...) or "?" ; bytes for n elements (0 if unknown). */
const char *rk_ggml_type_name(uint32_t type);
size_t rk_ggml_type_row_bytes(uint32_t type, int64_t n_elements);

/* Print a human-readable summary of g to out (for `ragkv inspect`): version,
 * alignment, architecture, every metadata pair (scalars with their value,
 * arrays as type, length and first elements), a tokenizer summary (model, pre,
 * vocabulary size, merges, special token ids and texts), the tensor table
 * (name, type, shape, bytes, bits per weight) and the parameter and byte
 * totals with the bits per weight of the whole file. */
void rk_gguf_print_info(const rk_gguf *g, FILE *out);

/* ================================================================ writer
 *
 * Collect metadata and tensor declarations, then write a GGUF v3 file in one
 * go. Metadata is written in the order it was set; tensors are laid out in
 * declaration order, each aligned to general.alignment (32 unless set), as
 * ggml and gguf-py expect. Tensor data is not held by the writer: at write
 * time the fill callback is asked for each tensor in turn, writing straight
 * into the destination (the output buffer, or the mapped output file), so a
 * multi-GB model streams through without a second copy in memory.
 *
 *     rk_gguf_writer *w;
 *     rk_gguf_writer_create(&w);
 *     rk_gguf_writer_set_str(w, "general.architecture", "llama");
 *     rk_gguf_writer_add_tensor(w, "token_embd.weight", RK_GGML_F32, 2, (int64_t[]){64, 512});
 *     rk_gguf_writer_write_file(w, "model.gguf", my_fill, my_ctx);
 *     rk_gguf_writer_free(w);
 *
 * Setters copy their arguments and return RK_ERR_INVALID (with a message) for
 * NULL or empty keys, a key set twice, bad tensor shapes or unknown types, a
 * tensor name of 64 bytes or more (ggml's limit) or a duplicate tensor name;
 * RK_ERR_NOMEM when a copy cannot be made. A failed setter leaves the writer
 * as it was. */

typedef struct rk_gguf_writer rk_gguf_writer; /* opaque */

/* Supplies the data of tensor tensor_index (0-based, declaration order): write
 * exactly n_bytes to dst (in the tensor's type, ne[0] fastest). Return RK_OK,
 * or an error status with a message, which abandons the write. */
typedef rk_status (*rk_gguf_fill_fn)(void *ctx, int64_t tensor_index, void *dst, size_t n_bytes);

/* Create an empty writer; free it with rk_gguf_writer_free(). */
rk_status rk_gguf_writer_create(rk_gguf_writer **out);
/* Free the writer and everything it copied; accepts NULL. */
void rk_gguf_writer_free(rk_gguf_writer *w);

/* Scalars. set_bool stores 0 or 1. Setting general.alignment (u32, a power of
 * two) changes the data alignment of the written file. */
rk_status rk_gguf_writer_set_u32(rk_gguf_writer *w, const char *key, uint32_t v);
rk_status rk_gguf_writer_set_i32(rk_gguf_writer *w, const char *key, int32_t v);
rk_status rk_gguf_writer_set_u64(rk_gguf_writer *w, const char *key, uint64_t v);
rk_status rk_gguf_writer_set_f32(rk_gguf_writer *w, const char *key, float v);
rk_status rk_gguf_writer_set_bool(rk_gguf_writer *w, const char *key, int v);
/* Any fixed-size scalar type (u8 .. f64, bool): value points at one value of
 * that type in host (little-endian) layout. */
rk_status rk_gguf_writer_set_scalar(rk_gguf_writer *w, const char *key, rk_gguf_type type,
                                    const void *value);
/* Strings: z_value NUL-terminated, or s of len bytes (may contain NULs). */
rk_status rk_gguf_writer_set_str(rk_gguf_writer *w, const char *key, const char *z_value);
rk_status rk_gguf_writer_set_str_len(rk_gguf_writer *w, const char *key, const char *s, size_t len);

/* Arrays. Strings: n_strs strings, lens[i] their byte lengths or lens NULL to
 * use strlen; all copied into one block. */
rk_status rk_gguf_writer_set_arr_str(rk_gguf_writer *w, const char *key, const char *const *strs,
                                     const uint32_t *lens, size_t n_strs);
rk_status rk_gguf_writer_set_arr_i32(rk_gguf_writer *w, const char *key, const int32_t *values,
                                     size_t n_values);
rk_status rk_gguf_writer_set_arr_f32(rk_gguf_writer *w, const char *key, const float *values,
                                     size_t n_values);
/* Any fixed-size element type: values points at n_values packed elements. */
rk_status rk_gguf_writer_set_arr(rk_gguf_writer *w, const char *key, rk_gguf_type elem_type,
                                 const void *values, size_t n_values);

/* Declare a tensor of n_dims (1..4) dimensions ne[0..n_dims-1] (ne[0] fastest;
 * a matrix W of shape (out, in) has ne = {in, out}). Any ggml type with a known
 * block size is accepted; ne[0] must be a multiple of its block size. */
rk_status rk_gguf_writer_add_tensor(rk_gguf_writer *w, const char *name, rk_ggml_type type,
                                    uint32_t n_dims, const int64_t *ne);
/* Number of tensors declared so far. */
int64_t rk_gguf_writer_n_tensors(const rk_gguf_writer *w);
/* Size in bytes of the file the writer would write now (0 if it overflows). */
size_t rk_gguf_writer_total_size(rk_gguf_writer *w);

/* Write the file to path: to path.tmp first (space reserved up front, written
 * through a shared mapping), fsync, then rename over path. fill may be NULL
 * (tensors zero-filled). On failure path.tmp is removed, path is untouched,
 * and the status is the fill callback's or RK_ERR_IO with a message. */
rk_status rk_gguf_writer_write_file(rk_gguf_writer *w, const char *path, rk_gguf_fill_fn fill,
                                    void *ctx);
/* Write the file to a malloc'ed buffer (*out_buf, *out_len; the caller frees
 * it). fill may be NULL (tensors zero-filled). */
rk_status rk_gguf_writer_write_memory(rk_gguf_writer *w, rk_gguf_fill_fn fill, void *ctx,
                                      void **out_buf, size_t *out_len);

#endif
