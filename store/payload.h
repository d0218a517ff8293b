/* store/payload.h — private to store/: reading, writing and checking KV
 * payload files. The format is documented at the top of store/payload.c. */
#ifndef RK_STORE_PAYLOAD_H
#define RK_STORE_PAYLOAD_H

#include <stddef.h>
#include <stdint.h>

#include "config/config.h"
#include "store/store.h"

/* The fields of a payload header. */
typedef struct rk_payload_header {
    uint32_t header_bytes; /* as read: 160 (version 1) or 512; ignored by writes */
    char fingerprint[RK_STORE_KEY_LEN + 1];
    char key[RK_STORE_KEY_LEN + 1];
    uint32_t n_tokens;
    rk_store_layout layout;
    uint64_t body_size;
    uint8_t checksum[16];                 /* XXH3-128 of token ids + body, canonical (big-endian) */
    char policy[RK_STORE_POLICY_MAX + 1]; /* "" in version 1 files */
    char doc_id[RK_STORE_DOC_ID_MAX + 1]; /* "" when none (and in version 1 files) */
    double created;                       /* unix seconds; 0 in version 1 files */
} rk_payload_header;

/* What a reader expects, from the row that names the file. */
typedef struct rk_payload_expect {
    const char *key;
    const char *fingerprint;
    const char *checksum_hex; /* 32 hex */
    int64_t n_tokens;
    uint64_t n_bytes; /* file size */
} rk_payload_expect;

/* Size of the payload file for n_tokens token ids and body_size body bytes. */
uint64_t rk_payload_file_bytes(uint64_t n_tokens, uint64_t body_size);

/* Compute the XXH3-128 checksum of tokens(n_tokens) followed by the body. */
void rk_payload_checksum(const int32_t *tokens, size_t n_tokens, const void *body, size_t body_size,
                         uint8_t out[16]);

/* Write the 32-hex form of a checksum (and a NUL) into out. */
void rk_payload_checksum_hex(const uint8_t sum[16], char out[RK_STORE_KEY_LEN + 1]);

/* Write the header's bytes (the current version: RK_STORE_HEADER_BYTES). */
void rk_payload_header_encode(const rk_payload_header *h, uint8_t b[RK_STORE_HEADER_BYTES]);

/* Decode a header held in memory (len bytes available at b), trusting
 * nothing: magic, version, size, header checksum and every field are
 * checked. what names the source in the RK_ERR_FORMAT message. */
rk_status rk_payload_header_decode(const char *what, const uint8_t *b, size_t len,
                                   rk_payload_header *h);

/* 1 when the n bytes at p are all printable ASCII without spaces. */
int rk_payload_printable(const uint8_t *p, size_t n);

/* Write header, tokens and body to tmp_path, fsync it, rename it to
 * final_path and fsync dir_path (the directory holding both). On failure no
 * file is left at either name and an RK_ERR_IO message says what failed. */
rk_status rk_payload_write(const char *tmp_path, const char *final_path, const char *dir_path,
                           const rk_payload_header *h, const int32_t *tokens, const void *body);

/* Check the file at path against e: its size, its header and (when full is
 * set) the checksum of everything after the header. Returns RK_OK when good,
 * RK_ERR_FORMAT when the payload is bad (missing, truncated, mismatched,
 * corrupt: the message says which), RK_ERR_IO when it cannot be read for
 * another reason, RK_ERR_NOMEM. */
rk_status rk_payload_check(const char *path, const rk_payload_expect *e, int full);

/* Read the file at path with no row to compare with: its header must be
 * sound and, with full set, the checksum over the rest must match. Fills
 * *out_h and the file size *out_bytes. Statuses as rk_payload_check. */
rk_status rk_payload_inspect(const char *path, int full, rk_payload_header *out_h,
                             uint64_t *out_bytes);

/* Count one I/O call of the store and return 1 (errno set to EIO) when it is
 * the one rk_store_fault_io() armed to fail, else 0. Every payload open, read,
 * write, fsync, rename and stat calls it first. */
int rk_payload_io_fault(void);

/* Read and fully verify the file at path against e, returning the header and
 * malloc'ed token ids (e->n_tokens) and body (NULL when empty) that the caller
 * frees. Statuses as rk_payload_check; on failure nothing is returned. */
rk_status rk_payload_read(const char *path, const rk_payload_expect *e, rk_payload_header *out_h,
                          int32_t **out_tokens, void **out_body);

#endif
