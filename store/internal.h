/* store/internal.h — private to store/: nothing outside this folder includes
 * it (the public interface is store.h). It holds the chunk store's handle,
 * its prepared statements and the functions its files share.
 *
 * The chunk store's files:
 *   store.c    the index and metadata operations: keys and paths, the SQLite
 *              helpers, batches, removal, the disk budget, put, get, contains,
 *              lookup, delete, flush, list, stats.
 *   open.c     the schema and its migrations, the prepared statements, open
 *              (creating chunks.db whole, the lock), read-only open, close.
 *   recover.c  integrity checking and crash recovery: the directory scan that
 *              adopts or quarantines payload files without a row, verify, the
 *              recovery run at open, rebuild of a lost or corrupt chunks.db.
 *   report.c   the offline reports (`ragkv cache ls|stats|verify`).
 * Around them: payload.c (payload.h), the payload file format and its I/O. */
#ifndef RK_STORE_INTERNAL_H
#define RK_STORE_INTERNAL_H

#include <sqlite3.h>
#include <stddef.h>
#include <stdint.h>

#include "store/payload.h"
#include "store/store.h"

/* Prepared statements kept for the store's life (their SQL is in open.c).
 * Statements filtering by model have a read-only twin whose filter
 * `?1 IS NULL` lets every row through (the model parameter is bound to NULL
 * there). */
enum {
    ST_FIND,
    ST_INSERT,
    ST_TOUCH,
    ST_DELETE,
    ST_LRU,
    ST_TOTALS,
    ST_LIST_RECENT,
    ST_LIST_HITS,
    ST_SCAN,
    ST_KEYS_ALL,
    ST_BEGIN,
    ST_COMMIT,
    ST_ROLLBACK,
    ST_TOMB_ADD,
    ST_TOMB_DEL,
    ST_TOMB_KEYS,
    ST_COUNT,
};

typedef char key_buf[RK_STORE_KEY_LEN + 1];

/* A growable list of keys. */
typedef struct key_list {
    key_buf *v;
    size_t n, cap;
} key_list;

struct rk_store {
    char *dir;                              /* store root */
    char *kv_dir;                           /* dir/kv */
    char fingerprint[RK_STORE_KEY_LEN + 1]; /* "" on read-only handles */
    int readonly;
    int db_corrupt; /* SQLite reported the database malformed or not a database */
    rk_store_options opts;
    int lock_fd; /* flock'ed DIR/LOCK; -1 on read-only handles */
    sqlite3 *db;
    sqlite3_stmt *st[ST_COUNT];
    int in_batch;
    key_list batch_written;  /* payload files written by puts of the open batch */
    key_list pending_unlink; /* files of rows deleted inside the open batch */
    key_list writing;        /* keys between rk_store_put_begin and its end */
    uint64_t generation;     /* bumped by every delete and flush */
    uint64_t rows, bytes;    /* this model's totals (kept in step with the table) */
    double last_stamp;       /* the last last_access handed out (strictly increasing) */
    rk_store_counters c;     /* counters since open */
};

/* What rk_store_for_each_row calls for each row. */
typedef rk_status (*row_fn)(rk_store *s, const rk_store_entry *e, void *ctx);

/* store.c: keys, paths and files. */
rk_status rk_store_key_list_push(key_list *l, const char *key);
void rk_store_key_list_free(key_list *l);
int rk_store_key_cmp(const void *a, const void *b); /* qsort/bsearch order of key_buf */
rk_status rk_store_key_paths(const rk_store *s, const char *key, char *dir, char *file, char *tmp,
                             size_t cap);
int rk_store_quarantine_file(rk_store *s, const char *path, const char *base);

/* store.c: SQLite helpers. rk_store_sql_error notes a corrupt database and
 * returns the status with a message naming what failed; rk_store_stmt returns
 * prepared statement id reset, its bindings cleared. */
rk_status rk_store_sql_error(rk_store *s, int rc, const char *what);
rk_status rk_store_sql_exec(rk_store *s, const char *sql, const char *what);
rk_status rk_store_sql_int(rk_store *s, const char *sql, int64_t *out);
sqlite3_stmt *rk_store_stmt(rk_store *s, int id);
rk_status rk_store_step_done(rk_store *s, sqlite3_stmt *q, const char *what);
rk_status rk_store_find_own_row(rk_store *s, const char *key, rk_store_entry *e, int *out_found);
rk_status rk_store_load_totals(rk_store *s); /* re-read this model's rows and bytes */
rk_status rk_store_insert_row(rk_store *s, const rk_payload_header *h, uint64_t n_bytes);
void rk_store_expect_from_row(const rk_store_entry *e, rk_payload_expect *x);

/* store.c: rows and their files. out (may be NULL) gathers what a removal
 * left; rk_store_unlink_payload returns 0 or the errno of a failed unlink,
 * its reason in why (cap bytes; may be NULL). */
rk_status rk_store_remove_entry(rk_store *s, const char *key, uint64_t n_bytes, int bad,
                                rk_store_removal *out);
rk_status rk_store_enforce_budget(rk_store *s);
rk_status rk_store_for_each_row(rk_store *s, row_fn fn, void *ctx);
rk_status rk_store_remove_keys(rk_store *s, const key_list *keys, int bad, const char *what,
                               rk_store_removal *out);
int rk_store_unlink_payload(rk_store *s, const char *key, char *why, size_t cap);
rk_status rk_store_tombstone(rk_store *s, const char *key, int add);

/* open.c: a handle for dir with nothing opened yet (rk_store_alloc), the
 * lock, the path DIR/name, chunks.db opened with its statements prepared
 * (rk_store_open_db). */
rk_status rk_store_alloc(const char *dir, rk_store **out);
rk_status rk_store_take_lock(rk_store *s);
rk_status rk_store_file_path(const rk_store *s, const char *name, char *buf, size_t cap);
rk_status rk_store_open_db(rk_store *s);

/* recover.c: recovery at open (see store.h). */
rk_status rk_store_recover(rk_store *s);

#endif
