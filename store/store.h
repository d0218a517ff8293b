/* store/store.h — the persistent chunk store: the disk tier behind the arena.
 *
 * A store is a directory:
 *
 *   DIR/chunks.db          SQLite metadata (WAL, synchronous=NORMAL), a row per chunk
 *   DIR/LOCK               flock'ed by the one process that opens DIR for writing
 *   DIR/kv/ab/<key>.kv     one payload file per chunk, named from its key only
 *   DIR/quarantine/        payload files that failed a check, kept for inspection
 *
 * A chunk is an opaque payload body (the caller's KV bytes) plus the token ids
 * it was computed from and a small layout record; the store knows nothing
 * about models or KV layouts. Keys are exactly 32 lowercase hex characters
 * (checked on every call), so no request can name a path.
 *
 * Writes: the payload goes to a temporary name in its final directory, is
 * checksummed (XXH3-128 over token ids and body), fsync'ed and renamed, the
 * directory is fsync'ed, and only then does the row commit. Deletes (and
 * flushes) remove the row and record a tombstone for its key in one
 * transaction, then remove the file, then the tombstone. So after a crash
 * every row points at a complete file; at worst a file without a row
 * remains, and a deleted chunk's file is never given its row back.
 *
 * Payload files describe themselves (key, model fingerprint, tokens, layout,
 * policy, document id, creation time, checksums), so the table can always be
 * rebuilt from them, and the store never deletes a payload it cannot explain.
 * Open runs recovery:
 *   - chunks.db missing or empty: the rows are rebuilt from the payload files
 *     (logged at warn level with the count);
 *   - chunks.db corrupt (SQLite: malformed, not a database): the open fails
 *     and names the way out, `ragkv cache rebuild --store DIR`
 *     (rk_store_rebuild), which sets the database aside and rebuilds it;
 *   - rows of this model whose payload is missing, of the wrong size, with a
 *     bad header or (with verify_on_open) a bad checksum are dropped and
 *     counted, their files moved to DIR/quarantine/;
 *   - the payload file of a tombstoned key (a delete or flush that could not
 *     remove it: a read-only directory, or a crash in between) is removed
 *     now and its tombstone cleared; when it still cannot be removed it stays,
 *     tombstoned, without a row, and is tried again at the next open;
 *   - a payload file without a row or tombstone (an interrupted eviction, a
 *     lost table) that passes the same checks gets its row back, whatever
 *     its model; one that fails them is moved to DIR/quarantine/; leftover
 *     *.tmp files of interrupted writes are removed;
 *   - a kv/ab directory or file that cannot be read is skipped, logged and
 *     counted (`unreadable`), and open goes on;
 *   - rows of another model fingerprint are kept, never served, and counted.
 * Every load verifies header and checksum again and never serves a bad
 * payload: its row is dropped, its file quarantined, and it is reported as
 * not found.
 *
 * A store handle is used by one thread at a time (the engine thread); the
 * caller serialises. Only one process may open a directory for writing (the
 * LOCK file); read-only handles (the `ragkv cache` commands) may look at it at
 * the same time. */
#ifndef RK_STORE_H
#define RK_STORE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "config/config.h"

/* The schema version this code writes (PRAGMA user_version of chunks.db). */
#define RK_STORE_SCHEMA_VERSION 2

/* Bytes of the fixed header at the start of every payload file this code
 * writes (format version 2); the token ids follow it, then the body (see
 * store/payload.c for the layout; version 1 files, with a 160-byte header,
 * are still read). */
#define RK_STORE_HEADER_BYTES 512

#define RK_STORE_KEY_LEN    32  /* lowercase hex characters in a key or fingerprint */
#define RK_STORE_POLICY_MAX 31  /* longest policy text */
#define RK_STORE_DOC_ID_MAX 255 /* longest document id */

typedef struct rk_store rk_store; /* opaque */

/* The layout record stored with a payload, opaque to the store. */
typedef struct rk_store_layout {
    int32_t n_layers, n_kv_heads, head_dim;
    int32_t dtype;      /* the caller's dtype code */
    int32_t block_size; /* tokens per KV block the body was laid out for */
    int32_t base_pos;   /* position of the chunk's first token when it was computed */
} rk_store_layout;

/* A check of a loaded body beyond its checksum, supplied by the caller, who
 * knows what the layout's dtype code means (the service checks that every KV
 * value is finite). Returns 0 when the body is usable; otherwise nonzero with
 * a short reason written into why (why_cap bytes). The store and the Redis
 * tier treat a body that fails it as corrupt. */
typedef int (*rk_store_body_check)(const rk_store_layout *layout, const void *body,
                                   size_t body_size, char *why, size_t why_cap);

typedef struct rk_store_options {
    uint64_t disk_budget_bytes;     /* payload bytes of this model kept on disk; 0 = unlimited */
    int verify_on_open;             /* checksum every payload at open (default 1); 0 = sizes
                                       and headers only (loads always verify) */
    rk_store_body_check body_check; /* run on every rk_store_get, and on every payload a
                                       full verify reads (at open with verify_on_open);
                                       NULL (default) = none */
    int read_delay_ms;              /* testing aid: sleep this long before every payload
                                       read, to measure a slow disk (default 0) */
    int write_delay_ms;             /* testing aid: the same before every payload write */
} rk_store_options;

/* Metadata of one row: what listing shows. Never any text of the chunk. */
typedef struct rk_store_entry {
    char key[RK_STORE_KEY_LEN + 1];
    char model[RK_STORE_KEY_LEN + 1]; /* model fingerprint */
    char policy[RK_STORE_POLICY_MAX + 1];
    char doc_id[RK_STORE_DOC_ID_MAX + 1]; /* "" when none was given */
    char checksum[RK_STORE_KEY_LEN + 1];  /* XXH3-128 of token ids + body, hex */
    int32_t n_tokens;
    uint64_t n_bytes;            /* payload file size */
    double created, last_access; /* unix seconds */
    uint64_t hits;
} rk_store_entry;

typedef struct rk_store_put_args {
    const char *key;    /* 32 lowercase hex */
    const char *policy; /* 1..RK_STORE_POLICY_MAX printable characters, e.g. "isolated" */
    const char *doc_id; /* NULL or up to RK_STORE_DOC_ID_MAX bytes */
    rk_store_layout layout;
    const int32_t *tokens; /* (n_tokens) */
    int32_t n_tokens;      /* >= 1 */
    const void *body;      /* (body_size) bytes; may be NULL when body_size is 0 */
    size_t body_size;
} rk_store_put_args;

/* A loaded chunk. tokens and body are malloc'ed and owned by the caller; free
 * them with rk_store_payload_free. */
typedef struct rk_store_payload {
    rk_store_entry meta; /* the row as it was before this load counted */
    rk_store_layout layout;
    int32_t *tokens; /* (meta.n_tokens) */
    void *body;      /* (body_size) bytes; NULL when body_size is 0 */
    size_t body_size;
} rk_store_payload;

typedef struct rk_store_counters {
    uint64_t rows, bytes;         /* rows and payload bytes of this model (read-only: all) */
    uint64_t other_model_rows;    /* rows of other fingerprints (kept, never served) */
    uint64_t loads, load_bytes;   /* successful gets since open */
    uint64_t writes, write_bytes; /* payload files written since open */
    uint64_t dropped_on_recovery; /* bad rows dropped at open */
    uint64_t dropped_on_load;     /* bad payloads dropped by a get (found corrupt after open) */
    uint64_t corrupt_after_open;  /* bad payloads found by a get or a verify after open */
    uint64_t quarantined;         /* payload files moved to DIR/quarantine/ since open */
    uint64_t rows_rebuilt;        /* rows recreated from payload files without one */
    uint64_t unreadable;          /* kv/ab directories or files skipped as unreadable */
    uint64_t orphans_removed;     /* *.tmp files of interrupted writes removed at open */
    uint64_t evictions, evicted_bytes; /* rows removed to honour the disk budget */
    uint64_t deletes;                  /* rows removed by rk_store_delete */
} rk_store_counters;

typedef enum rk_store_sort {
    RK_STORE_SORT_RECENT = 0, /* last access, newest first */
    RK_STORE_SORT_HITS = 1,   /* hits, most first; then newest first */
} rk_store_sort;

/* Fill opts with the defaults: no disk budget, verify_on_open on. */
void rk_store_options_default(rk_store_options *opts);

/* Return 1 when key is exactly 32 lowercase hex characters, else 0. */
int rk_store_key_valid(const char *key);

/* Open (creating if needed) the store in dir for the model whose fingerprint
 * is given (32 lowercase hex), run schema migration and recovery, and return
 * the handle in *out (free with rk_store_close). opts may be NULL for the
 * defaults. Fails with RK_ERR_BUSY when another process has dir open, and
 * RK_ERR_UNSUPPORTED when chunks.db has a newer schema than this code. */
rk_status rk_store_open(const char *dir, const char *model_fingerprint,
                        const rk_store_options *opts, rk_store **out);

/* Open an existing store for inspection only: no fingerprint (rows of every
 * model are visible), no lock, no recovery, nothing written. Such a handle
 * serves rk_store_list, rk_store_lookup, rk_store_contains, rk_store_stats,
 * rk_store_verify without deleting, and the rk_store_print_* reports; other
 * calls return RK_ERR_INVALID. RK_ERR_NOT_FOUND when dir holds no store. */
rk_status rk_store_open_readonly(const char *dir, rk_store **out);

typedef struct rk_store_rebuild_result {
    char set_aside[64];    /* name chunks.db was moved to in DIR; "" when there was none */
    int db_was_corrupt;    /* the old chunks.db failed SQLite's quick_check or could not open */
    uint64_t rows_rebuilt; /* rows recreated from payload files (every model) */
    uint64_t quarantined;  /* payload files that failed a check, moved to DIR/quarantine/ */
    uint64_t unreadable;   /* directories or files that could not be read (left in place) */
    uint64_t tmp_removed;  /* *.tmp files of interrupted writes removed */
} rk_store_rebuild_result;

/* Rebuild the table of the store in dir from its payload files, offline:
 * take the LOCK (RK_ERR_BUSY when a server holds it), move chunks.db (and
 * its -wal) aside as chunks.db.corrupt-<UTC time> (chunks.db.old-<time> when
 * it was sound), create a fresh one and give every payload file that fully
 * verifies its row back, whatever its model. Hits and access times start
 * over. RK_ERR_NOT_FOUND when dir holds no store. */
rk_status rk_store_rebuild(const char *dir, rk_store_rebuild_result *out);

/* Test hook for I/O fault injection: make the nth store I/O call from now (a
 * payload or directory open, read, write, fsync, rename, stat or mkdir) fail
 * with EIO; nth <= 0 disarms. Returns the number of such calls made since the
 * previous rk_store_fault_io() call, so a test can count the calls of an
 * operation. Process-wide and not thread-safe: for single-threaded tests. */
int rk_store_fault_io(int nth);

/* Close the store (rolling back an open batch) and free it; accepts NULL. */
void rk_store_close(rk_store *s);

/* Write one chunk: its payload file (durably) and then its row. A put of a
 * key already stored for this model returns RK_OK and keeps the existing row
 * and file. Outside a batch the row commits at once and the disk budget is
 * enforced; inside a batch the row commits with rk_store_commit. RK_ERR_LIMIT
 * when the payload alone exceeds the disk budget. On any failure no temporary
 * file and no row is left behind and earlier entries stay readable. */
rk_status rk_store_put(rk_store *s, const rk_store_put_args *args);

/* A put in three steps, so that the payload file can be written off the
 * thread that owns the handle (rk_store_put is the three in a row):
 *   rk_store_put_begin    (owning thread) checks the arguments and the disk
 *                         budget; *out is NULL when there is nothing to
 *                         write (the key is stored, or its write is under
 *                         way), else the write, which refers to args'
 *                         tokens and body until it ends;
 *   rk_store_put_write    (any thread) checksums and writes the payload file
 *                         durably (fsync'ed, renamed, directory fsync'ed),
 *                         from w alone, never the handle;
 *   rk_store_put_end      (owning thread) with rk_store_put_write's status:
 *                         commits the row, or removes the file when the
 *                         write failed or the key was deleted or flushed
 *                         since the begin (then RK_OK: nothing is wanted);
 *                         frees w and returns the put's status;
 *   rk_store_put_abandon  (owning thread) instead of the write and end: w
 *                         never wrote, forget it.
 * A crash between the write and the end leaves a payload file without a
 * row, which the next open gives its row back. */
typedef struct rk_store_write rk_store_write; /* opaque */

rk_status rk_store_put_begin(rk_store *s, const rk_store_put_args *args, rk_store_write **out);
rk_status rk_store_put_write(rk_store_write *w);
rk_status rk_store_put_end(rk_store *s, rk_store_write *w, rk_status write_status);
void rk_store_put_abandon(rk_store *s, rk_store_write *w);

/* Start a batch: the rows of the puts (and deletes) until rk_store_commit go
 * into one SQLite transaction. Payload files are still written by each put. */
rk_status rk_store_begin(rk_store *s);

/* Commit the batch, then remove files of rows deleted inside it and enforce
 * the disk budget. On failure the batch is rolled back as by
 * rk_store_rollback and the error returned. */
rk_status rk_store_commit(rk_store *s);

/* Abandon the batch: its rows are not stored and the payload files its puts
 * wrote are removed. */
rk_status rk_store_rollback(rk_store *s);

/* Load a chunk of this model: read its payload file, check the header
 * against the row and the checksum (and the body with opts.body_check), and
 * fill *out (release with
 * rk_store_payload_free). Counts a hit and updates the last access. A payload
 * that fails any check is deleted (row and file), counted in
 * dropped_on_load and reported as RK_ERR_NOT_FOUND with the reason; it is
 * never served. RK_ERR_NOT_FOUND also when no row exists; RK_ERR_IO when the
 * file cannot be read for another reason (then nothing is deleted). */
rk_status rk_store_get(rk_store *s, const char *key, rk_store_payload *out);

/* A load in three steps, so that the payload file can be read off the
 * thread that owns the handle (rk_store_get is the three in a row):
 *   rk_store_locate     the row of key (owning thread): *out_found 0 when
 *                       this model has none;
 *   rk_store_read       the payload file, checked as by rk_store_get (any
 *                       thread: it reads loc alone, never the handle);
 *                       RK_ERR_FORMAT when a check fails, RK_ERR_NOT_FOUND
 *                       when the file is gone (evicted meanwhile);
 *   rk_store_load_done  (owning thread) with rk_store_read's status and
 *                       error message: counts the load and its access, or
 *                       drops a payload that failed a check (row and file)
 *                       and counts it. */
typedef struct rk_store_located {
    char path[4096];
    rk_store_entry row;
    rk_store_body_check body_check;
    int read_delay_ms;
} rk_store_located;

rk_status rk_store_locate(rk_store *s, const char *key, rk_store_located *out, int *out_found);
rk_status rk_store_read(const rk_store_located *loc, rk_store_payload *out);
void rk_store_load_done(rk_store *s, const rk_store_located *loc, rk_status read_status,
                        const char *why);

/* Free the buffers of a payload filled by rk_store_get or rk_store_read and
 * zero it; accepts NULL and a zeroed payload. */
void rk_store_payload_free(rk_store_payload *p);

/* Set *out_present to 1 when a row of this model exists for key (the file is
 * not read), else 0. */
rk_status rk_store_contains(rk_store *s, const char *key, int *out_present);

/* Fill *out with the row of key (this model only); RK_ERR_NOT_FOUND if none.
 * Does not count as an access. */
rk_status rk_store_lookup(rk_store *s, const char *key, rk_store_entry *out);

/* What a delete or flush removed. A row is removed (and never served again)
 * even when its payload file cannot be: that file keeps a tombstone, so no
 * open gives it its row back, and each open tries to remove it again. */
typedef struct rk_store_removal {
    uint64_t rows;       /* rows removed */
    uint64_t files_left; /* of their payload files, those that could not be removed now */
    char why[200];       /* the first of those: the file and the reason; "" when none */
} rk_store_removal;

/* Remove the row and payload file of key; RK_ERR_NOT_FOUND if none. *out
 * (may be NULL) says what was removed. Inside a batch the file goes when
 * the batch commits (a failure then is logged, the tombstone kept). */
rk_status rk_store_delete(rk_store *s, const char *key, rk_store_removal *out);

/* Remove every row and payload file of this model; *out (may be NULL) says
 * how many rows went and which files stayed. Rows of other models are
 * kept. */
rk_status rk_store_flush(rk_store *s, rk_store_removal *out);

/* List rows of this model (read-only handles: of every model) sorted by sort,
 * skipping offset rows and returning at most limit (limit <= 0: all). *out is
 * a malloc'ed array of *out_n entries (NULL when 0) that the caller frees. */
rk_status rk_store_list(rk_store *s, rk_store_sort sort, int limit, int offset,
                        rk_store_entry **out, int *out_n);

/* Fill *out with the current row and byte totals and the counters since open. */
rk_status rk_store_stats(rk_store *s, rk_store_counters *out);

/* Called by rk_store_verify for each bad payload with its key and a reason. */
typedef void (*rk_store_bad_fn)(void *ctx, const char *key, const char *reason);

typedef struct rk_store_verify_result {
    uint64_t checked; /* rows whose payload was read */
    uint64_t bad;     /* of those, payloads that failed a check */
    uint64_t deleted; /* bad rows removed (only when asked) */
    uint64_t orphans; /* payload or *.tmp files without a row (never removed here) */
} rk_store_verify_result;

/* Set the body check of s (a read-only handle has none from its open);
 * rk_store_verify and loads run it from now on. */
void rk_store_set_body_check(rk_store *s, rk_store_body_check check);

/* Re-read every payload of this model (read-only handles: of every model) and
 * check its size, header and checksum (and the body check, when s has one). Each bad one is
 * reported through on_bad (may be NULL); with delete_bad set it is also removed (not allowed on
 * read-only handles). RK_OK even when payloads are bad: see *out. */
rk_status rk_store_verify(rk_store *s, int delete_bad, rk_store_bad_fn on_bad, void *ctx,
                          rk_store_verify_result *out);

/* Write the path of key's payload file into buf (cap bytes): DIR/kv/ab/<key>.kv. */
rk_status rk_store_payload_path(const rk_store *s, const char *key, char *buf, size_t cap);

/* The store's directory (owned by the store). */
const char *rk_store_dir(const rk_store *s);

/* --------------------------------------------------------- offline reports */

/* Print a table of rows (sorted, at most limit; <= 0 = all) to f: key, model,
 * policy, tokens, bytes, hits, last access, document id. */
rk_status rk_store_print_ls(rk_store *s, FILE *f, rk_store_sort sort, int limit);

/* Print the store's totals, per-model breakdown and counters to f. */
rk_status rk_store_print_stats(rk_store *s, FILE *f);

/* Verify every payload (without deleting), print one line per bad payload and
 * a summary to f; *out_bad (may be NULL) receives the number of bad payloads. */
rk_status rk_store_print_verify(rk_store *s, FILE *f, uint64_t *out_bad);

#endif
