/* engine/gguf_internal.h — the parts of the GGUF reader and writer shared by
 * their source files. Private to engine/: nothing outside them includes this
 * header (the API is engine/gguf.h).
 *
 * The files:
 *   gguf.c         the file format (described at its top), the ggml and
 *                  value types, and the reader: parsing and validating a
 *                  file, opening and closing it, its tensors;
 *   gguf_meta.c    metadata values: decoding them, enumerating the pairs and
 *                  the typed getters (rk_gguf_get_*);
 *   gguf_info.c    the human-readable summary (rk_gguf_print_info);
 *   gguf_writer.c  the writer (rk_gguf_writer_*). */
#ifndef RK_GGUF_INTERNAL_H
#define RK_GGUF_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/gguf.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF reader assumes a little-endian host"
#endif

#define RK_GGUF_MAGIC             0x46554747u
#define RK_GGUF_DEFAULT_ALIGNMENT 32u
#define RK_GGUF_TYPE_COUNT        13u

/* ------------------------------------------------------------ ggml types */

typedef struct rk_ggml_traits {
    const char *name;
    uint32_t blck;      /* elements per block; 0 = unknown / removed type */
    uint32_t type_size; /* bytes per block */
} rk_ggml_traits;

/* The traits of a ggml type, or NULL when the type is unknown or removed. */
const rk_ggml_traits *rk_ggml_traits_of(uint32_t type);

/* ------------------------------------------------------------ value types */

/* The name of a metadata value type ("u32", "string", ...), "?" when unknown. */
const char *rk_gguf_value_type_name(uint32_t t);

/* Size in bytes of a fixed-size value type, 0 for string, array and unknown. */
size_t rk_gguf_scalar_size(uint32_t t);

/* Is t one of the integer value types (bool is not)? */
bool rk_gguf_is_int_type(uint32_t t);

/* A decoded number: integers keep their sign, floats are widened to double. */
typedef struct rk_gguf_num {
    bool is_signed;
    bool is_float;
    uint64_t u;
    int64_t i;
    double f;
} rk_gguf_num;

/* Decode one little-endian value of fixed-size type t from p. */
rk_gguf_num rk_gguf_decode_num(uint32_t t, const uint8_t *p);

/* ------------------------------------------------------------ the reader */

typedef struct rk_gguf_kv {
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
} rk_gguf_kv;

struct rk_gguf {
    const uint8_t *base; /* the file's bytes */
    size_t size;
    void *map;  /* mmap'ed region (rk_gguf_open), NULL for memory */
    char *name; /* file name for messages, or "<memory>" */
    uint32_t version;
    size_t alignment;
    size_t data_offset; /* start of the data section */

    int64_t n_kv;
    rk_gguf_kv *kvs;    /* (n_kv) in file order */
    int64_t *kv_sorted; /* (n_kv) indices sorted by key */

    int64_t n_tensors;
    rk_gguf_tensor *tensors; /* (n_tensors) in file order */
    char **tensor_names;     /* (n_tensors) owned copies */
    int64_t *t_sorted;       /* (n_tensors) indices sorted by name */
};

#endif
