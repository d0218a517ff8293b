/* engine/gguf.h — reading and writing GGUF model files (versions 2 and 3).
 *
 * The reader maps the file read-only, validates every count, length, offset
 * and alignment against the file size before using it, copies the metadata
 * (keys, strings, arrays) into memory it owns, and exposes tensor data as
 * pointers into the mapping. A malformed or hostile file yields an error with
 * a message (rk_error_message()), never a crash. The file format itself is
 * described at the top of gguf.c. */
#ifndef RK_GGUF_H
#define RK_GGUF_H

#include <stddef.h>
#include <stdint.h>

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
    RK_GGML_Q8_0 = 8,
    RK_GGML_BF16 = 30,
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

/* Name of a ggml type ("F32", "BF16", ...) or "?" ; bytes for n elements (0 if unknown). */
const char *rk_ggml_type_name(uint32_t type);
size_t rk_ggml_type_row_bytes(uint32_t type, int64_t n_elements);

/* ================================================================ writer
 * (declared below by the writer's implementation) */

#endif
