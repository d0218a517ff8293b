/* store/store.c — the chunk store: SQLite metadata, the write and delete
 * protocols, recovery at open, the disk budget and the offline reports. The
 * payload file format lives in store/payload.c. */
#include "store/store.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <sqlite3.h>

#include "store/payload.h"

/* PRAGMA application_id of chunks.db: "RKKV". */
#define STORE_APP_ID 0x524b4b56

/* ---------------------------------------------------------------- schema */

/* k_migrations[v] takes a database from user_version v to v + 1. To add
 * version 2, append its SQL here and raise RK_STORE_SCHEMA_VERSION. */
static const char *const k_migrations[RK_STORE_SCHEMA_VERSION] = {
    /* 0 -> 1: the chunk table */
    "CREATE TABLE chunks ("
    "  key TEXT PRIMARY KEY NOT NULL,"
    "  model TEXT NOT NULL,"
    "  policy TEXT NOT NULL,"
    "  n_tokens INTEGER NOT NULL,"
    "  n_bytes INTEGER NOT NULL,"
    "  checksum TEXT NOT NULL,"
    "  created REAL NOT NULL,"
    "  last_access REAL NOT NULL,"
    "  hits INTEGER NOT NULL DEFAULT 0,"
    "  doc_id TEXT,"
    "  file TEXT NOT NULL);"
    "CREATE INDEX chunks_model_access ON chunks(model, last_access);"
    "CREATE INDEX chunks_model_hits ON chunks(model, hits);"
    "PRAGMA application_id = 1380666198;", /* STORE_APP_ID */
};
_Static_assert(STORE_APP_ID == 1380666198, "application id literal matches");

#define ROW_COLS                                                                                   \
    "key, model, policy, n_tokens, n_bytes, checksum, created, last_access, hits, doc_id"

/* Prepared statements kept for the store's life. Statements filtering by
 * model have a read-only twin whose filter `?1 IS NULL` lets every row
 * through (the model parameter is bound to NULL there). */
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
    ST_COUNT,
};

typedef struct stmt_sql {
    const char *rw, *ro; /* ro NULL: not prepared on read-only handles */
} stmt_sql;

static const stmt_sql k_sql[ST_COUNT] = {
    [ST_FIND] = {"SELECT " ROW_COLS " FROM chunks WHERE key = ?1",
                 "SELECT " ROW_COLS " FROM chunks WHERE key = ?1"},
    [ST_INSERT] = {"INSERT INTO chunks (key, model, policy, n_tokens, n_bytes, checksum, created,"
                   " last_access, hits, doc_id, file) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, 0,"
                   " ?8, ?9)",
                   NULL},
    [ST_TOUCH] = {"UPDATE chunks SET hits = hits + 1, last_access = ?2 WHERE key = ?1", NULL},
    [ST_DELETE] = {"DELETE FROM chunks WHERE key = ?1", NULL},
    [ST_LRU] = {"SELECT key, n_bytes FROM chunks WHERE model = ?1"
                " ORDER BY last_access, rowid LIMIT ?2",
                NULL},
    [ST_TOTALS] = {"SELECT COUNT(*), COALESCE(SUM(n_bytes), 0) FROM chunks WHERE model = ?1",
                   "SELECT COUNT(*), COALESCE(SUM(n_bytes), 0) FROM chunks WHERE ?1 IS NULL"},
    [ST_LIST_RECENT] = {"SELECT " ROW_COLS " FROM chunks WHERE model = ?1"
                        " ORDER BY last_access DESC, rowid DESC LIMIT ?2 OFFSET ?3",
                        "SELECT " ROW_COLS " FROM chunks WHERE ?1 IS NULL"
                        " ORDER BY last_access DESC, rowid DESC LIMIT ?2 OFFSET ?3"},
    [ST_LIST_HITS] = {"SELECT " ROW_COLS " FROM chunks WHERE model = ?1"
                      " ORDER BY hits DESC, last_access DESC, rowid DESC LIMIT ?2 OFFSET ?3",
                      "SELECT " ROW_COLS " FROM chunks WHERE ?1 IS NULL"
                      " ORDER BY hits DESC, last_access DESC, rowid DESC LIMIT ?2 OFFSET ?3"},
    [ST_SCAN] = {"SELECT " ROW_COLS " FROM chunks WHERE model = ?1 ORDER BY key",
                 "SELECT " ROW_COLS " FROM chunks WHERE ?1 IS NULL ORDER BY key"},
    [ST_KEYS_ALL] = {"SELECT key FROM chunks", "SELECT key FROM chunks"},
    [ST_BEGIN] = {"BEGIN IMMEDIATE", NULL},
    [ST_COMMIT] = {"COMMIT", NULL},
    [ST_ROLLBACK] = {"ROLLBACK", NULL},
};

/* ---------------------------------------------------------------- the handle */

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
    uint64_t rows, bytes;    /* this model's totals (kept in step with the table) */
    double last_stamp;       /* the last last_access handed out (strictly increasing) */
    rk_store_counters c;     /* counters since open */
};

/* ---------------------------------------------------------------- small helpers */

int rk_store_key_valid(const char *key) {
    if (!key) return 0;
    for (int i = 0; i < RK_STORE_KEY_LEN; i++) {
        char ch = key[i];
        if (!((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f'))) return 0;
    }
    return key[RK_STORE_KEY_LEN] == '\0';
}

static rk_status check_key(const char *key) {
    if (rk_store_key_valid(key)) return RK_OK;
    return rk_errorf(RK_ERR_INVALID, "store: invalid key (want 32 lowercase hex characters)");
}

void rk_store_options_default(rk_store_options *opts) {
    memset(opts, 0, sizeof *opts);
    opts->verify_on_open = 1;
}

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A last_access value later than every one handed out before, so LRU order
 * is the order of accesses even within one clock tick. */
static double next_stamp(rk_store *s) {
    double t = wall_now();
    if (t <= s->last_stamp) t = s->last_stamp + 1e-6;
    s->last_stamp = t;
    return t;
}

static char *str_dup(const char *z) {
    size_t n = strlen(z) + 1;
    char *p = malloc(n);
    if (p) memcpy(p, z, n);
    return p;
}

static char *path_join(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    char *p = malloc(na + nb + 2);
    if (!p) return NULL;
    memcpy(p, a, na);
    p[na] = '/';
    memcpy(p + na + 1, b, nb + 1);
    return p;
}

static rk_status key_list_reserve(key_list *l, size_t extra) {
    if (l->n + extra <= l->cap) return RK_OK;
    size_t cap = l->cap ? l->cap * 2 : 16;
    while (cap < l->n + extra) cap *= 2;
    key_buf *v = realloc(l->v, cap * sizeof *v);
    if (!v) return rk_errorf(RK_ERR_NOMEM, "store: no memory for a key list");
    l->v = v;
    l->cap = cap;
    return RK_OK;
}

static rk_status key_list_push(key_list *l, const char *key) {
    rk_status st = key_list_reserve(l, 1);
    if (st != RK_OK) return st;
    memcpy(l->v[l->n++], key, sizeof(key_buf));
    return RK_OK;
}

static void key_list_free(key_list *l) {
    free(l->v);
    memset(l, 0, sizeof *l);
}

static int key_cmp(const void *a, const void *b) { return strcmp(a, b); }

/* Write the paths of key's payload: its directory kv/ab, its file and its
 * temporary name. Any of the outputs may be NULL. */
static rk_status key_paths(const rk_store *s, const char *key, char *dir, char *file, char *tmp,
                           size_t cap) {
    int n = 0;
    if (dir) n |= snprintf(dir, cap, "%s/%.2s", s->kv_dir, key) >= (int)cap;
    if (file) n |= snprintf(file, cap, "%s/%.2s/%s.kv", s->kv_dir, key, key) >= (int)cap;
    if (tmp) n |= snprintf(tmp, cap, "%s/%.2s/%s.kv.tmp", s->kv_dir, key, key) >= (int)cap;
    if (n) return rk_errorf(RK_ERR_LIMIT, "store %s: path too long", s->dir);
    return RK_OK;
}

rk_status rk_store_payload_path(const rk_store *s, const char *key, char *buf, size_t cap) {
    if (!s || !buf) return rk_errorf(RK_ERR_INVALID, "store: NULL argument");
    rk_status st = check_key(key);
    if (st != RK_OK) return st;
    return key_paths(s, key, NULL, buf, NULL, cap);
}

const char *rk_store_dir(const rk_store *s) { return s ? s->dir : NULL; }

/* Remove a payload file whose row is gone; a missing file is fine. */
static void unlink_payload(rk_store *s, const char *key) {
    char path[PATH_MAX];
    if (key_paths(s, key, NULL, path, NULL, sizeof path) != RK_OK) return;
    if (unlink(path) != 0 && errno != ENOENT)
        RK_LOG_WARN("store %s: cannot remove %s: %s (removed at next open)", s->dir, path,
                    strerror(errno));
}

/* Move the file at path (its name base) into DIR/quarantine/ under a unique
 * name, never deleting it: a payload that failed a check is kept for
 * inspection. Returns 1 when it was moved, 0 when it was not there or could
 * not be moved (logged; it stays where it is). Callers count payloads. */
static int quarantine_file(rk_store *s, const char *path, const char *base) {
    char qdir[PATH_MAX], dst[PATH_MAX];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (snprintf(qdir, sizeof qdir, "%s/quarantine", s->dir) >= (int)sizeof qdir ||
        snprintf(dst, sizeof dst, "%s/%s.%lld%09ld", qdir, base, (long long)ts.tv_sec,
                 ts.tv_nsec) >= (int)sizeof dst)
        return 0;
    if (mkdir(qdir, 0755) != 0 && errno != EEXIST) {
        RK_LOG_WARN("store %s: cannot create %s: %s; %s stays in place", s->dir, qdir,
                    strerror(errno), path);
        return 0;
    }
    if (rename(path, dst) != 0) {
        if (errno != ENOENT)
            RK_LOG_WARN("store %s: cannot quarantine %s: %s; it stays in place", s->dir, path,
                        strerror(errno));
        return 0;
    }
    RK_LOG_WARN("store %s: moved %s to %s", s->dir, path, dst);
    return 1;
}

/* Quarantine the payload file of key, whose row is gone. */
static void quarantine_payload(rk_store *s, const char *key) {
    char path[PATH_MAX], base[RK_STORE_KEY_LEN + 4];
    if (key_paths(s, key, NULL, path, NULL, sizeof path) != RK_OK) return;
    snprintf(base, sizeof base, "%s.kv", key);
    s->c.quarantined += (uint64_t)quarantine_file(s, path, base);
}

/* ---------------------------------------------------------------- SQLite helpers */

static rk_status sql_status(int rc) {
    switch (rc & 0xff) {
    case SQLITE_NOMEM: return RK_ERR_NOMEM;
    case SQLITE_BUSY:
    case SQLITE_LOCKED: return RK_ERR_BUSY;
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB: return RK_ERR_FORMAT;
    case SQLITE_MISUSE:
    case SQLITE_RANGE: return RK_ERR_INTERNAL;
    default: return RK_ERR_IO; /* IOERR, FULL, READONLY, CANTOPEN, PERM, ... */
    }
}

static void note_corrupt(rk_store *s, int rc) {
    if ((rc & 0xff) == SQLITE_CORRUPT || (rc & 0xff) == SQLITE_NOTADB) s->db_corrupt = 1;
}

static rk_status sql_error(rk_store *s, int rc, const char *what) {
    note_corrupt(s, rc);
    return rk_errorf(sql_status(rc), "store %s: %s: %s", s->dir, what,
                     s->db ? sqlite3_errmsg(s->db) : sqlite3_errstr(rc));
}

/* Run SQL text with no result rows. */
static rk_status sql_exec(rk_store *s, const char *sql, const char *what) {
    char *err = NULL;
    int rc = sqlite3_exec(s->db, sql, NULL, NULL, &err);
    if (rc == SQLITE_OK) return RK_OK;
    note_corrupt(s, rc);
    rk_status st =
        rk_errorf(sql_status(rc), "store %s: %s: %s", s->dir, what, err ? err : sqlite3_errstr(rc));
    sqlite3_free(err);
    return st;
}

/* Read one integer from a single-row query. */
static rk_status sql_int(rk_store *s, const char *sql, int64_t *out) {
    sqlite3_stmt *q = NULL;
    int rc = sqlite3_prepare_v2(s->db, sql, -1, &q, NULL);
    if (rc == SQLITE_OK) rc = sqlite3_step(q);
    if (rc == SQLITE_ROW) {
        *out = sqlite3_column_int64(q, 0);
        sqlite3_finalize(q);
        return RK_OK;
    }
    rk_status st = sql_error(s, rc, sql);
    sqlite3_finalize(q);
    return st;
}

static sqlite3_stmt *stmt(rk_store *s, int id) {
    sqlite3_stmt *q = s->st[id];
    sqlite3_reset(q);
    sqlite3_clear_bindings(q);
    return q;
}

/* Bind this model's fingerprint as ?1 (NULL on read-only handles). */
static int bind_model(rk_store *s, sqlite3_stmt *q) {
    if (s->readonly) return sqlite3_bind_null(q, 1);
    return sqlite3_bind_text(q, 1, s->fingerprint, -1, SQLITE_STATIC);
}

/* Run a statement that returns no rows. */
static rk_status step_done(rk_store *s, sqlite3_stmt *q, const char *what) {
    int rc = sqlite3_step(q);
    rk_status st = rc == SQLITE_DONE ? RK_OK : sql_error(s, rc, what);
    sqlite3_reset(q);
    return st;
}

static void copy_text(char *dst, size_t cap, const unsigned char *src) {
    if (!src) src = (const unsigned char *)"";
    size_t n = strlen((const char *)src);
    if (n >= cap) n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

/* Fill e from a row selected with ROW_COLS. */
static void read_row(sqlite3_stmt *q, rk_store_entry *e) {
    memset(e, 0, sizeof *e);
    copy_text(e->key, sizeof e->key, sqlite3_column_text(q, 0));
    copy_text(e->model, sizeof e->model, sqlite3_column_text(q, 1));
    copy_text(e->policy, sizeof e->policy, sqlite3_column_text(q, 2));
    int64_t n_tokens = sqlite3_column_int64(q, 3);
    e->n_tokens = n_tokens < 0 || n_tokens > INT32_MAX ? -1 : (int32_t)n_tokens;
    int64_t n_bytes = sqlite3_column_int64(q, 4);
    e->n_bytes = n_bytes < 0 ? 0 : (uint64_t)n_bytes;
    copy_text(e->checksum, sizeof e->checksum, sqlite3_column_text(q, 5));
    e->created = sqlite3_column_double(q, 6);
    e->last_access = sqlite3_column_double(q, 7);
    int64_t hits = sqlite3_column_int64(q, 8);
    e->hits = hits < 0 ? 0 : (uint64_t)hits;
    copy_text(e->doc_id, sizeof e->doc_id, sqlite3_column_text(q, 9));
}

/* Look up key's row of any model; *out_found says whether there is one. */
static rk_status find_row(rk_store *s, const char *key, rk_store_entry *e, int *out_found) {
    sqlite3_stmt *q = stmt(s, ST_FIND);
    sqlite3_bind_text(q, 1, key, -1, SQLITE_STATIC);
    int rc = sqlite3_step(q);
    *out_found = 0;
    if (rc == SQLITE_ROW) {
        read_row(q, e);
        *out_found = 1;
        rc = SQLITE_DONE;
    }
    rk_status st = rc == SQLITE_DONE ? RK_OK : sql_error(s, rc, "look up a row");
    sqlite3_reset(q);
    return st;
}

/* Find key's row of this model (any model on read-only handles). */
static rk_status find_own_row(rk_store *s, const char *key, rk_store_entry *e, int *out_found) {
    rk_status st = find_row(s, key, e, out_found);
    if (st == RK_OK && *out_found && !s->readonly && strcmp(e->model, s->fingerprint) != 0)
        *out_found = 0;
    return st;
}

static rk_status load_totals(rk_store *s) {
    sqlite3_stmt *q = stmt(s, ST_TOTALS);
    bind_model(s, q);
    int rc = sqlite3_step(q);
    if (rc == SQLITE_ROW) {
        s->rows = (uint64_t)sqlite3_column_int64(q, 0);
        s->bytes = (uint64_t)sqlite3_column_int64(q, 1);
        rc = SQLITE_DONE;
    }
    rk_status st = rc == SQLITE_DONE ? RK_OK : sql_error(s, rc, "count rows");
    sqlite3_reset(q);
    return st;
}

static rk_status must_write(const rk_store *s) {
    if (!s) return rk_errorf(RK_ERR_INVALID, "store: NULL store");
    if (s->readonly)
        return rk_errorf(RK_ERR_INVALID, "store %s: opened read-only (inspection only)", s->dir);
    return RK_OK;
}

/* ---------------------------------------------------------------- batches */

/* The open transaction is gone (rolled back by us or by SQLite after an I/O
 * error): remove the files its puts wrote, forget the deferred unlinks (their
 * rows are back) and re-read the totals. */
static void batch_abandoned(rk_store *s) {
    for (size_t i = 0; i < s->batch_written.n; i++) unlink_payload(s, s->batch_written.v[i]);
    s->batch_written.n = 0;
    s->pending_unlink.n = 0;
    s->in_batch = 0;
    if (load_totals(s) != RK_OK)
        RK_LOG_WARN("store %s: cannot re-read totals: %s", s->dir, rk_error_message());
}

/* After a failed statement inside a batch: if SQLite rolled the transaction
 * back on its own, clean up as for a rollback. */
static void batch_check_alive(rk_store *s) {
    if (s->in_batch && sqlite3_get_autocommit(s->db)) {
        RK_LOG_WARN("store %s: the batch was rolled back after an error", s->dir);
        batch_abandoned(s);
    }
}

rk_status rk_store_begin(rk_store *s) {
    rk_status st = must_write(s);
    if (st != RK_OK) return st;
    if (s->in_batch) return rk_errorf(RK_ERR_INVALID, "store %s: a batch is already open", s->dir);
    st = step_done(s, stmt(s, ST_BEGIN), "begin a batch");
    if (st == RK_OK) s->in_batch = 1;
    return st;
}

static rk_status enforce_budget(rk_store *s);

rk_status rk_store_commit(rk_store *s) {
    rk_status st = must_write(s);
    if (st != RK_OK) return st;
    if (!s->in_batch) return rk_errorf(RK_ERR_INVALID, "store %s: no batch is open", s->dir);
    st = step_done(s, stmt(s, ST_COMMIT), "commit a batch");
    if (st != RK_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", rk_error_message());
        if (!sqlite3_get_autocommit(s->db)) step_done(s, stmt(s, ST_ROLLBACK), "roll back");
        batch_abandoned(s);
        return rk_errorf(st, "%s (batch rolled back)", msg);
    }
    for (size_t i = 0; i < s->pending_unlink.n; i++) unlink_payload(s, s->pending_unlink.v[i]);
    s->pending_unlink.n = 0;
    s->batch_written.n = 0;
    s->in_batch = 0;
    if (enforce_budget(s) != RK_OK)
        RK_LOG_WARN("store %s: eviction failed: %s", s->dir, rk_error_message());
    return RK_OK;
}

rk_status rk_store_rollback(rk_store *s) {
    rk_status st = must_write(s);
    if (st != RK_OK) return st;
    if (!s->in_batch) return rk_errorf(RK_ERR_INVALID, "store %s: no batch is open", s->dir);
    st = RK_OK;
    if (!sqlite3_get_autocommit(s->db)) st = step_done(s, stmt(s, ST_ROLLBACK), "roll back");
    batch_abandoned(s);
    return st;
}

/* ---------------------------------------------------------------- removal */

/* Delete key's row (n_bytes of payload) and then its file; inside a batch the
 * file goes when the batch commits. With bad set the payload failed a check:
 * its file is quarantined at once instead. */
static rk_status remove_entry(rk_store *s, const char *key, uint64_t n_bytes, int bad) {
    sqlite3_stmt *q = stmt(s, ST_DELETE);
    sqlite3_bind_text(q, 1, key, -1, SQLITE_STATIC);
    rk_status st = step_done(s, q, "delete a row");
    if (st != RK_OK) {
        batch_check_alive(s);
        return st;
    }
    if (s->rows) s->rows--;
    s->bytes = s->bytes >= n_bytes ? s->bytes - n_bytes : 0;
    if (bad) {
        quarantine_payload(s, key);
    } else if (s->in_batch) {
        if (key_list_push(&s->pending_unlink, key) != RK_OK)
            RK_LOG_WARN("store %s: no memory to defer a file removal (removed at next open)",
                        s->dir);
    } else {
        unlink_payload(s, key);
    }
    return RK_OK;
}

/* Evict least recently accessed rows of this model until the payload bytes
 * fit the disk budget. Not inside a batch (files of an open batch may still
 * be rolled back). */
static rk_status enforce_budget(rk_store *s) {
    uint64_t budget = s->opts.disk_budget_bytes;
    if (!budget || s->in_batch) return RK_OK;
    while (s->bytes > budget) {
        sqlite3_stmt *q = stmt(s, ST_LRU);
        bind_model(s, q);
        sqlite3_bind_int(q, 2, 64);
        key_list victims = {0};
        uint64_t *sizes = NULL, freed = 0;
        size_t cap = 0;
        int rc;
        rk_status st = RK_OK;
        while (freed < s->bytes && s->bytes - freed > budget &&
               (rc = sqlite3_step(q)) == SQLITE_ROW) {
            const char *key = (const char *)sqlite3_column_text(q, 0);
            uint64_t nb = (uint64_t)sqlite3_column_int64(q, 1);
            if (!rk_store_key_valid(key)) continue;
            if (victims.n == cap) {
                cap = cap ? cap * 2 : 16;
                uint64_t *ns = realloc(sizes, cap * sizeof *ns);
                if (!ns) {
                    st = rk_errorf(RK_ERR_NOMEM, "store: no memory for eviction");
                    break;
                }
                sizes = ns;
            }
            if ((st = key_list_push(&victims, key)) != RK_OK) break;
            sizes[victims.n - 1] = nb;
            freed += nb;
        }
        sqlite3_reset(q);
        if (st == RK_OK && victims.n == 0) {
            /* the totals drifted from the table: trust the table */
            st = load_totals(s);
            free(sizes);
            key_list_free(&victims);
            if (st != RK_OK || s->bytes <= budget) return st;
            return rk_errorf(RK_ERR_INTERNAL, "store %s: over budget with nothing to evict",
                             s->dir);
        }
        if (st == RK_OK) st = step_done(s, stmt(s, ST_BEGIN), "begin eviction");
        for (size_t i = 0; st == RK_OK && i < victims.n; i++) {
            sqlite3_stmt *d = stmt(s, ST_DELETE);
            sqlite3_bind_text(d, 1, victims.v[i], -1, SQLITE_STATIC);
            st = step_done(s, d, "evict a row");
        }
        if (st == RK_OK) st = step_done(s, stmt(s, ST_COMMIT), "commit eviction");
        if (st != RK_OK) {
            if (!sqlite3_get_autocommit(s->db)) step_done(s, stmt(s, ST_ROLLBACK), "roll back");
        } else {
            for (size_t i = 0; i < victims.n; i++) {
                unlink_payload(s, victims.v[i]);
                s->c.evictions++;
                s->c.evicted_bytes += sizes[i];
                s->rows = s->rows ? s->rows - 1 : 0;
                s->bytes = s->bytes >= sizes[i] ? s->bytes - sizes[i] : 0;
            }
        }
        free(sizes);
        key_list_free(&victims);
        if (st != RK_OK) return st;
    }
    return RK_OK;
}

/* ---------------------------------------------------------------- put */

static rk_status check_put_args(const rk_store_put_args *a) {
    rk_status st = check_key(a->key);
    if (st != RK_OK) return st;
    size_t np = a->policy ? strlen(a->policy) : 0;
    if (np == 0 || np > RK_STORE_POLICY_MAX)
        return rk_errorf(RK_ERR_INVALID, "store: policy must be 1..%d characters",
                         RK_STORE_POLICY_MAX);
    for (size_t i = 0; i < np; i++)
        if ((unsigned char)a->policy[i] < 0x21 || (unsigned char)a->policy[i] > 0x7e)
            return rk_errorf(RK_ERR_INVALID, "store: policy must be printable ASCII");
    if (a->doc_id && strlen(a->doc_id) > RK_STORE_DOC_ID_MAX)
        return rk_errorf(RK_ERR_INVALID, "store: doc_id longer than %d bytes", RK_STORE_DOC_ID_MAX);
    if (a->n_tokens < 1 || !a->tokens)
        return rk_errorf(RK_ERR_INVALID, "store: a chunk needs at least one token id");
    if (a->body_size && !a->body) return rk_errorf(RK_ERR_INVALID, "store: NULL body");
    if (a->body_size > (size_t)1 << 40)
        return rk_errorf(RK_ERR_LIMIT, "store: body of %zu bytes is too large", a->body_size);
    const rk_store_layout *l = &a->layout;
    if (l->n_layers < 0 || l->n_kv_heads < 0 || l->head_dim < 0 || l->block_size < 0 ||
        l->base_pos < 0)
        return rk_errorf(RK_ERR_INVALID, "store: negative field in the layout record");
    return RK_OK;
}

/* Insert the row of the payload whose header is h (n_bytes long): created
 * and last access are its creation time, a missing policy (version 1 files)
 * reads "unknown", an empty document id none. */
static rk_status insert_row(rk_store *s, const rk_payload_header *h, uint64_t n_bytes) {
    char sum_hex[RK_STORE_KEY_LEN + 1], rel[64];
    rk_payload_checksum_hex(h->checksum, sum_hex);
    snprintf(rel, sizeof rel, "kv/%.2s/%s.kv", h->key, h->key);
    sqlite3_stmt *q = stmt(s, ST_INSERT);
    sqlite3_bind_text(q, 1, h->key, -1, SQLITE_STATIC);
    sqlite3_bind_text(q, 2, h->fingerprint, -1, SQLITE_STATIC);
    sqlite3_bind_text(q, 3, h->policy[0] ? h->policy : "unknown", -1, SQLITE_STATIC);
    sqlite3_bind_int64(q, 4, h->n_tokens);
    sqlite3_bind_int64(q, 5, (sqlite3_int64)n_bytes);
    sqlite3_bind_text(q, 6, sum_hex, -1, SQLITE_STATIC);
    sqlite3_bind_double(q, 7, h->created);
    if (h->doc_id[0]) sqlite3_bind_text(q, 8, h->doc_id, -1, SQLITE_STATIC);
    sqlite3_bind_text(q, 9, rel, -1, SQLITE_STATIC);
    rk_status st = step_done(s, q, "insert a row");
    sqlite3_clear_bindings(q);
    return st;
}

/* Create kv/ab when missing, making the new entry durable in kv/. */
static rk_status ensure_subdir(rk_store *s, const char *sub) {
    if (rk_payload_io_fault() || mkdir(sub, 0755) != 0) {
        if (errno == EEXIST) return RK_OK;
        return rk_errorf(RK_ERR_IO, "%s: mkdir: %s", sub, strerror(errno));
    }
    int fd = open(s->kv_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fsync(fd) != 0) {
        rk_status st = rk_errorf(RK_ERR_IO, "%s: fsync directory: %s", s->kv_dir, strerror(errno));
        if (fd >= 0) close(fd);
        rmdir(sub);
        return st;
    }
    close(fd);
    return RK_OK;
}

rk_status rk_store_put(rk_store *s, const rk_store_put_args *a) {
    rk_status st = must_write(s);
    if (st != RK_OK) return st;
    if (!a) return rk_errorf(RK_ERR_INVALID, "store: NULL put arguments");
    if ((st = check_put_args(a)) != RK_OK) return st;

    rk_store_entry row;
    int found = 0;
    if ((st = find_row(s, a->key, &row, &found)) != RK_OK) return st;
    if (found) {
        if (strcmp(row.model, s->fingerprint) == 0) return RK_OK; /* idempotent */
        return rk_errorf(RK_ERR_INVALID, "store %s: key %s is stored for another model", s->dir,
                         a->key);
    }
    uint64_t n_bytes = rk_payload_file_bytes((uint64_t)a->n_tokens, a->body_size);
    if (s->opts.disk_budget_bytes && n_bytes > s->opts.disk_budget_bytes)
        return rk_errorf(RK_ERR_LIMIT,
                         "store %s: a %" PRIu64 "-byte payload exceeds the disk budget"
                         " of %" PRIu64 " bytes",
                         s->dir, n_bytes, s->opts.disk_budget_bytes);
    if (s->in_batch) {
        /* A rollback removes the files its puts wrote; a key whose earlier row
         * this batch deleted would lose its file that way. */
        for (size_t i = 0; i < s->pending_unlink.n; i++)
            if (strcmp(s->pending_unlink.v[i], a->key) == 0)
                return rk_errorf(RK_ERR_BUSY,
                                 "store %s: key %s was deleted in this batch; commit"
                                 " before storing it again",
                                 s->dir, a->key);
        /* Room to remember the file before it exists, so a rollback finds it. */
        if ((st = key_list_reserve(&s->batch_written, 1)) != RK_OK) return st;
    }

    char sub[PATH_MAX], file[PATH_MAX], tmp[PATH_MAX];
    if ((st = key_paths(s, a->key, sub, file, tmp, sizeof sub)) != RK_OK) return st;
    if ((st = ensure_subdir(s, sub)) != RK_OK) return st;

    rk_payload_header h;
    memset(&h, 0, sizeof h);
    memcpy(h.fingerprint, s->fingerprint, sizeof h.fingerprint);
    memcpy(h.key, a->key, sizeof h.key);
    h.n_tokens = (uint32_t)a->n_tokens;
    h.layout = a->layout;
    h.body_size = a->body_size;
    rk_payload_checksum(a->tokens, (size_t)a->n_tokens, a->body, a->body_size, h.checksum);
    snprintf(h.policy, sizeof h.policy, "%s", a->policy);
    snprintf(h.doc_id, sizeof h.doc_id, "%s", a->doc_id ? a->doc_id : "");
    h.created = next_stamp(s);

    if ((st = rk_payload_write(tmp, file, sub, &h, a->tokens, a->body)) != RK_OK) return st;
    s->c.writes++;
    s->c.write_bytes += n_bytes;

    st = insert_row(s, &h, n_bytes);
    if (st != RK_OK) {
        if (unlink(file) != 0 && errno != ENOENT)
            RK_LOG_WARN("store %s: cannot remove %s: %s", s->dir, file, strerror(errno));
        batch_check_alive(s);
        return st;
    }
    s->rows++;
    s->bytes += n_bytes;
    if (s->in_batch) {
        key_list_push(&s->batch_written, a->key); /* reserved above: cannot fail */
        return RK_OK;
    }
    if (enforce_budget(s) != RK_OK)
        RK_LOG_WARN("store %s: eviction failed: %s", s->dir, rk_error_message());
    return RK_OK;
}

/* ---------------------------------------------------------------- get and friends */

static void expect_from_row(const rk_store_entry *e, rk_payload_expect *x) {
    x->key = e->key;
    x->fingerprint = e->model;
    x->checksum_hex = e->checksum;
    x->n_tokens = e->n_tokens;
    x->n_bytes = e->n_bytes;
}

rk_status rk_store_get(rk_store *s, const char *key, rk_store_payload *out) {
    rk_status st = must_write(s);
    if (st != RK_OK) return st;
    if (!out) return rk_errorf(RK_ERR_INVALID, "store: NULL output");
    memset(out, 0, sizeof *out);
    if ((st = check_key(key)) != RK_OK) return st;
    rk_store_entry row;
    int found = 0;
    if ((st = find_own_row(s, key, &row, &found)) != RK_OK) return st;
    if (!found) return rk_errorf(RK_ERR_NOT_FOUND, "store: key %s not found", key);

    char path[PATH_MAX];
    if ((st = key_paths(s, key, NULL, path, NULL, sizeof path)) != RK_OK) return st;
    rk_payload_expect x;
    expect_from_row(&row, &x);
    rk_payload_header h;
    int32_t *tokens = NULL;
    void *body = NULL;
    st = rk_payload_read(path, &x, &h, &tokens, &body);
    char bad_body[256];
    if (st == RK_OK && s->opts.body_check &&
        s->opts.body_check(&h.layout, body, (size_t)h.body_size, bad_body, sizeof bad_body)) {
        free(tokens);
        free(body);
        st = rk_errorf(RK_ERR_FORMAT, "%s: %s", path, bad_body);
    }
    if (st == RK_ERR_FORMAT) {
        char why[512];
        snprintf(why, sizeof why, "%s", rk_error_message());
        RK_LOG_WARN("store %s: dropping a bad payload: %s", s->dir, why);
        if (remove_entry(s, key, row.n_bytes, 1) != RK_OK)
            RK_LOG_WARN("store %s: %s", s->dir, rk_error_message());
        s->c.dropped_on_load++;
        s->c.corrupt_after_open++;
        return rk_errorf(RK_ERR_NOT_FOUND, "store: %s failed verification and was dropped: %s", key,
                         why);
    }
    if (st != RK_OK) return st;

    sqlite3_stmt *q = stmt(s, ST_TOUCH);
    sqlite3_bind_text(q, 1, key, -1, SQLITE_STATIC);
    sqlite3_bind_double(q, 2, next_stamp(s));
    if (step_done(s, q, "record an access") != RK_OK) {
        /* The payload is verified; a lost hit count is no reason to fail. */
        RK_LOG_WARN("%s", rk_error_message());
        batch_check_alive(s);
    }
    out->meta = row;
    out->layout = h.layout;
    out->tokens = tokens;
    out->body = body;
    out->body_size = (size_t)h.body_size;
    s->c.loads++;
    s->c.load_bytes += row.n_bytes;
    return RK_OK;
}

void rk_store_payload_free(rk_store_payload *p) {
    if (!p) return;
    free(p->tokens);
    free(p->body);
    memset(p, 0, sizeof *p);
}

rk_status rk_store_contains(rk_store *s, const char *key, int *out_present) {
    if (!s || !out_present) return rk_errorf(RK_ERR_INVALID, "store: NULL argument");
    *out_present = 0;
    rk_status st = check_key(key);
    if (st != RK_OK) return st;
    rk_store_entry row;
    return find_own_row(s, key, &row, out_present);
}

rk_status rk_store_lookup(rk_store *s, const char *key, rk_store_entry *out) {
    if (!s || !out) return rk_errorf(RK_ERR_INVALID, "store: NULL argument");
    rk_status st = check_key(key);
    if (st != RK_OK) return st;
    int found = 0;
    if ((st = find_own_row(s, key, out, &found)) != RK_OK) return st;
    if (!found) return rk_errorf(RK_ERR_NOT_FOUND, "store: key %s not found", key);
    return RK_OK;
}

rk_status rk_store_delete(rk_store *s, const char *key) {
    rk_status st = must_write(s);
    if (st != RK_OK) return st;
    if ((st = check_key(key)) != RK_OK) return st;
    rk_store_entry row;
    int found = 0;
    if ((st = find_own_row(s, key, &row, &found)) != RK_OK) return st;
    if (!found) return rk_errorf(RK_ERR_NOT_FOUND, "store: key %s not found", key);
    if ((st = remove_entry(s, key, row.n_bytes, 0)) != RK_OK) return st;
    s->c.deletes++;
    return RK_OK;
}

typedef rk_status (*row_fn)(rk_store *s, const rk_store_entry *e, void *ctx);

/* Call fn for every row of this model (every model on read-only handles) in
 * key order. fn must not write to the table: callers collect what to delete
 * and delete after the walk. */
static rk_status for_each_row(rk_store *s, row_fn fn, void *ctx) {
    sqlite3_stmt *q = stmt(s, ST_SCAN);
    bind_model(s, q);
    rk_store_entry e;
    int rc;
    rk_status st = RK_OK;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        read_row(q, &e);
        if ((st = fn(s, &e, ctx)) != RK_OK) break;
    }
    if (st == RK_OK && rc != SQLITE_DONE) st = sql_error(s, rc, "scan rows");
    sqlite3_reset(q);
    return st;
}

static rk_status push_key(rk_store *s, const rk_store_entry *e, void *ctx) {
    (void)s;
    if (!rk_store_key_valid(e->key)) return RK_OK; /* names no file */
    return key_list_push(ctx, e->key);
}

/* Delete the rows of keys in one transaction, then their files (quarantined
 * with bad set: they failed a check). */
static rk_status remove_keys(rk_store *s, const key_list *keys, int bad, const char *what) {
    rk_status st = step_done(s, stmt(s, ST_BEGIN), what);
    for (size_t i = 0; st == RK_OK && i < keys->n; i++) {
        sqlite3_stmt *d = stmt(s, ST_DELETE);
        sqlite3_bind_text(d, 1, keys->v[i], -1, SQLITE_STATIC);
        st = step_done(s, d, what);
    }
    if (st == RK_OK) st = step_done(s, stmt(s, ST_COMMIT), what);
    if (st != RK_OK) {
        if (!sqlite3_get_autocommit(s->db)) step_done(s, stmt(s, ST_ROLLBACK), "roll back");
        return st;
    }
    for (size_t i = 0; i < keys->n; i++) {
        if (bad)
            quarantine_payload(s, keys->v[i]);
        else
            unlink_payload(s, keys->v[i]);
    }
    return RK_OK;
}

rk_status rk_store_flush(rk_store *s, uint64_t *out_removed) {
    rk_status st = must_write(s);
    if (st != RK_OK) return st;
    if (out_removed) *out_removed = 0;
    if (s->in_batch) return rk_errorf(RK_ERR_INVALID, "store %s: flush inside a batch", s->dir);
    key_list keys = {0};
    st = for_each_row(s, push_key, &keys);
    if (st == RK_OK) st = remove_keys(s, &keys, 0, "flush");
    if (st == RK_OK && out_removed) *out_removed = keys.n;
    key_list_free(&keys);
    if (st == RK_OK) st = load_totals(s);
    return st;
}

rk_status rk_store_list(rk_store *s, rk_store_sort sort, int limit, int offset,
                        rk_store_entry **out, int *out_n) {
    if (!s || !out || !out_n) return rk_errorf(RK_ERR_INVALID, "store: NULL argument");
    *out = NULL;
    *out_n = 0;
    if (sort != RK_STORE_SORT_RECENT && sort != RK_STORE_SORT_HITS)
        return rk_errorf(RK_ERR_INVALID, "store: unknown sort order %d", (int)sort);
    if (offset < 0) return rk_errorf(RK_ERR_INVALID, "store: negative offset");
    sqlite3_stmt *q = stmt(s, sort == RK_STORE_SORT_HITS ? ST_LIST_HITS : ST_LIST_RECENT);
    bind_model(s, q);
    sqlite3_bind_int(q, 2, limit > 0 ? limit : -1);
    sqlite3_bind_int(q, 3, offset);
    rk_store_entry *v = NULL;
    int n = 0, cap = 0, rc;
    rk_status st = RK_OK;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        if (n == cap) {
            if (cap > INT_MAX / 2) {
                st = rk_errorf(RK_ERR_LIMIT, "store: too many rows to list");
                break;
            }
            cap = cap ? cap * 2 : 32;
            rk_store_entry *nv = realloc(v, (size_t)cap * sizeof *nv);
            if (!nv) {
                st = rk_errorf(RK_ERR_NOMEM, "store: no memory to list rows");
                break;
            }
            v = nv;
        }
        read_row(q, &v[n++]);
    }
    if (st == RK_OK && rc != SQLITE_DONE) st = sql_error(s, rc, "list rows");
    sqlite3_reset(q);
    if (st != RK_OK) {
        free(v);
        return st;
    }
    *out = v;
    *out_n = n;
    return RK_OK;
}

rk_status rk_store_stats(rk_store *s, rk_store_counters *out) {
    if (!s || !out) return rk_errorf(RK_ERR_INVALID, "store: NULL argument");
    if (s->readonly) {
        rk_status st = load_totals(s); /* another process may be writing */
        if (st != RK_OK) return st;
    }
    *out = s->c;
    out->rows = s->rows;
    out->bytes = s->bytes;
    return RK_OK;
}

/* ---------------------------------------------------------------- directory scan */

/* Read every key of the table (all models) into a sorted list. */
static rk_status all_keys(rk_store *s, key_list *out) {
    sqlite3_stmt *q = stmt(s, ST_KEYS_ALL);
    int rc;
    rk_status st = RK_OK;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        const char *key = (const char *)sqlite3_column_text(q, 0);
        if (!rk_store_key_valid(key)) continue; /* names no file */
        if ((st = key_list_push(out, key)) != RK_OK) break;
    }
    if (st == RK_OK && rc != SQLITE_DONE) st = sql_error(s, rc, "read keys");
    sqlite3_reset(q);
    if (st == RK_OK && out->n) qsort(out->v, out->n, sizeof *out->v, key_cmp);
    return st;
}

static int is_hex(char ch) { return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f'); }

/* Give the payload file at path (named for key) its row back when it passes
 * the checks (the checksum too with full set); quarantine it when it fails
 * them; leave it in place, counted, when it cannot be read. */
static rk_status adopt_file(rk_store *s, const char *path, const char *key, int full) {
    rk_payload_header h;
    uint64_t n_bytes = 0;
    rk_status st = rk_payload_inspect(path, full, &h, &n_bytes);
    if (st == RK_OK && (strcmp(h.key, key) != 0 || !rk_store_key_valid(h.fingerprint)))
        st = rk_errorf(RK_ERR_FORMAT, "%s: the header names another key or no model", path);
    if (st == RK_ERR_NOMEM) return st;
    if (st == RK_ERR_FORMAT) {
        RK_LOG_WARN("store %s: payload without a row fails its checks: %s", s->dir,
                    rk_error_message());
        char base[RK_STORE_KEY_LEN + 4];
        snprintf(base, sizeof base, "%s.kv", key);
        s->c.quarantined += (uint64_t)quarantine_file(s, path, base);
        return RK_OK;
    }
    if (st != RK_OK) {
        RK_LOG_WARN("store %s: skipping an unreadable payload: %s", s->dir, rk_error_message());
        s->c.unreadable++;
        return RK_OK;
    }
    if ((st = insert_row(s, &h, n_bytes)) != RK_OK) return st;
    if (h.created > s->last_stamp) s->last_stamp = h.created;
    s->c.rows_rebuilt++;
    return RK_OK;
}

/* Walk the kv/ab/ directories for files without a row (keys: sorted keys of
 * every row) and temporary files. Without repair they are only counted in
 * *out_n. With repair (recovery and rebuild, in one transaction) payload
 * files get their row back or are quarantined (adopt_file), temporary files
 * are removed, and unreadable directories are skipped and counted. Files
 * that are not ours are left alone. */
static rk_status scan_files(rk_store *s, const key_list *keys, int repair, int full,
                            uint64_t *out_n) {
    *out_n = 0;
    DIR *top = opendir(s->kv_dir);
    if (!top) {
        if (errno == ENOENT) return RK_OK;
        if (!repair) return rk_errorf(RK_ERR_IO, "%s: opendir: %s", s->kv_dir, strerror(errno));
        RK_LOG_WARN("store %s: cannot read %s: %s; payload files not checked", s->dir, s->kv_dir,
                    strerror(errno));
        s->c.unreadable++;
        return RK_OK;
    }
    rk_status st = repair ? step_done(s, stmt(s, ST_BEGIN), "begin recovery") : RK_OK;
    struct dirent *d;
    while (st == RK_OK && (d = readdir(top)) != NULL) {
        const char *sub = d->d_name;
        if (strlen(sub) != 2 || !is_hex(sub[0]) || !is_hex(sub[1])) continue;
        char subpath[PATH_MAX];
        if (snprintf(subpath, sizeof subpath, "%s/%s", s->kv_dir, sub) >= (int)sizeof subpath)
            continue;
        DIR *dd = opendir(subpath);
        if (!dd) {
            if (errno == ENOTDIR || errno == ENOENT || !repair) continue;
            RK_LOG_WARN("store %s: skipping unreadable directory %s: %s", s->dir, subpath,
                        strerror(errno));
            s->c.unreadable++;
            continue;
        }
        struct dirent *f;
        while (st == RK_OK && (f = readdir(dd)) != NULL) {
            const char *name = f->d_name;
            size_t len = strlen(name);
            int tmp = len > 4 && strcmp(name + len - 4, ".tmp") == 0;
            key_buf key;
            if (!tmp) {
                if (len != RK_STORE_KEY_LEN + 3 || strcmp(name + RK_STORE_KEY_LEN, ".kv") != 0)
                    continue;
                memcpy(key, name, RK_STORE_KEY_LEN);
                key[RK_STORE_KEY_LEN] = '\0';
                if (!rk_store_key_valid(key) || key[0] != sub[0] || key[1] != sub[1]) continue;
                if (keys->n && bsearch(key, keys->v, keys->n, sizeof *keys->v, key_cmp)) continue;
            }
            (*out_n)++;
            char fpath[PATH_MAX];
            if (!repair ||
                snprintf(fpath, sizeof fpath, "%s/%s", subpath, name) >= (int)sizeof fpath)
                continue;
            if (!tmp) {
                st = adopt_file(s, fpath, key, full);
            } else if (unlink(fpath) == 0) {
                s->c.orphans_removed++;
            } else if (errno != ENOENT) {
                RK_LOG_WARN("store %s: cannot remove %s: %s", s->dir, fpath, strerror(errno));
            }
        }
        closedir(dd);
    }
    closedir(top);
    if (repair && st == RK_OK) st = step_done(s, stmt(s, ST_COMMIT), "commit recovery");
    if (repair && st != RK_OK && !sqlite3_get_autocommit(s->db))
        step_done(s, stmt(s, ST_ROLLBACK), "roll back");
    return st;
}

/* ---------------------------------------------------------------- verify */

typedef struct verify_ctx {
    int full;    /* check checksums too */
    int collect; /* collect keys of bad payloads (RK_ERR_FORMAT only) */
    rk_store_bad_fn on_bad;
    void *on_bad_ctx;
    rk_store_verify_result r;
    key_list bad; /* when collecting */
} verify_ctx;

/* Read the payload at path (checked against x) and run the body check on
 * it: RK_ERR_FORMAT with the reason when it fails. */
static rk_status check_body(rk_store *s, const char *path, const rk_payload_expect *x) {
    rk_payload_header h;
    int32_t *tokens = NULL;
    void *body = NULL;
    rk_status st = rk_payload_read(path, x, &h, &tokens, &body);
    char why[256];
    if (st == RK_OK && s->opts.body_check(&h.layout, body, (size_t)h.body_size, why, sizeof why))
        st = rk_errorf(RK_ERR_FORMAT, "%s: %s", path, why);
    free(tokens);
    free(body);
    return st;
}

static rk_status verify_row(rk_store *s, const rk_store_entry *e, void *ctx) {
    verify_ctx *v = ctx;
    v->r.checked++;
    if (!rk_store_key_valid(e->key)) {
        v->r.bad++;
        if (v->on_bad) v->on_bad(v->on_bad_ctx, e->key, "invalid key in the table");
        return RK_OK;
    }
    char path[PATH_MAX];
    rk_status st = key_paths(s, e->key, NULL, path, NULL, sizeof path);
    if (st != RK_OK) return st;
    rk_payload_expect x;
    expect_from_row(e, &x);
    rk_status cs = rk_payload_check(path, &x, v->full);
    if (cs == RK_OK && v->full && s->opts.body_check) cs = check_body(s, path, &x);
    if (cs == RK_OK) return RK_OK;
    if (cs == RK_ERR_NOMEM) return cs;
    v->r.bad++;
    if (v->on_bad) v->on_bad(v->on_bad_ctx, e->key, rk_error_message());
    if (v->collect && cs == RK_ERR_FORMAT) return key_list_push(&v->bad, e->key);
    return RK_OK;
}

void rk_store_set_body_check(rk_store *s, rk_store_body_check check) { s->opts.body_check = check; }

rk_status rk_store_verify(rk_store *s, int delete_bad, rk_store_bad_fn on_bad, void *ctx,
                          rk_store_verify_result *out) {
    if (!s || !out) return rk_errorf(RK_ERR_INVALID, "store: NULL argument");
    memset(out, 0, sizeof *out);
    if (delete_bad && s->readonly)
        return rk_errorf(RK_ERR_INVALID, "store %s: opened read-only, cannot delete", s->dir);
    verify_ctx v = {.full = 1, .collect = delete_bad, .on_bad = on_bad, .on_bad_ctx = ctx};
    rk_status st = for_each_row(s, verify_row, &v);
    for (size_t i = 0; st == RK_OK && i < v.bad.n; i++) {
        rk_store_entry e;
        int found = 0;
        st = find_own_row(s, v.bad.v[i], &e, &found);
        if (st == RK_OK && found && (st = remove_entry(s, e.key, e.n_bytes, 1)) == RK_OK) {
            v.r.deleted++;
            s->c.corrupt_after_open++;
        }
    }
    key_list_free(&v.bad);
    key_list keys = {0};
    if (st == RK_OK) st = all_keys(s, &keys);
    if (st == RK_OK) st = scan_files(s, &keys, 0, 0, &v.r.orphans);
    key_list_free(&keys);
    *out = v.r;
    return st;
}

/* ---------------------------------------------------------------- open and recovery */

static rk_status mkdir_p(const char *dir) {
    char path[PATH_MAX];
    size_t n = strlen(dir);
    if (n == 0 || n >= sizeof path) return rk_errorf(RK_ERR_INVALID, "store: bad directory name");
    memcpy(path, dir, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (path[i] != '/' && path[i] != '\0') continue;
        char saved = path[i];
        path[i] = '\0';
        if (mkdir(path, 0755) != 0 && errno != EEXIST)
            return rk_errorf(RK_ERR_IO, "%s: mkdir: %s", path, strerror(errno));
        path[i] = saved;
    }
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return rk_errorf(RK_ERR_IO, "%s: not a directory", dir);
    return RK_OK;
}

/* Read the schema version of chunks.db into *out_version and refuse a
 * database written by a newer ragkv or by something else, before anything is
 * written to it. */
static rk_status schema_check(rk_store *s, int64_t *out_version) {
    int64_t version = 0, app = 0;
    rk_status st = sql_int(s, "PRAGMA user_version", &version);
    if (st == RK_OK) st = sql_int(s, "PRAGMA application_id", &app);
    if (st != RK_OK) return st;
    if (version > RK_STORE_SCHEMA_VERSION)
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "store %s: chunks.db has schema version %lld but this ragkv knows up to "
                         "%d (written by a newer ragkv?)",
                         s->dir, (long long)version, RK_STORE_SCHEMA_VERSION);
    if (version > 0 && app != STORE_APP_ID)
        return rk_errorf(RK_ERR_FORMAT, "store %s: chunks.db is not a ragkv chunk store", s->dir);
    if (s->readonly && version < RK_STORE_SCHEMA_VERSION)
        return rk_errorf(RK_ERR_UNSUPPORTED,
                         "store %s: chunks.db has schema version %lld; open it once with "
                         "`ragkv serve --store` to migrate it to %d",
                         s->dir, (long long)version, RK_STORE_SCHEMA_VERSION);
    *out_version = version;
    return RK_OK;
}

/* Bring chunks.db from version to RK_STORE_SCHEMA_VERSION, one transaction
 * per step. */
static rk_status migrate(rk_store *s, int64_t version) {
    for (; version < RK_STORE_SCHEMA_VERSION; version++) {
        char what[64], setv[64];
        snprintf(what, sizeof what, "migrate schema %lld -> %lld", (long long)version,
                 (long long)version + 1);
        snprintf(setv, sizeof setv, "PRAGMA user_version = %lld", (long long)version + 1);
        rk_status st = sql_exec(s, "BEGIN IMMEDIATE", what);
        if (st == RK_OK) st = sql_exec(s, k_migrations[version], what);
        if (st == RK_OK) st = sql_exec(s, setv, what);
        if (st == RK_OK) st = sql_exec(s, "COMMIT", what);
        if (st != RK_OK) {
            if (!sqlite3_get_autocommit(s->db)) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
            return st;
        }
        RK_LOG_INFO("store %s: schema migrated to version %lld", s->dir, (long long)version + 1);
    }
    return RK_OK;
}

static rk_status open_db(rk_store *s) {
    char *db_path = path_join(s->dir, "chunks.db");
    if (!db_path) return rk_errorf(RK_ERR_NOMEM, "store: no memory");
    int flags = s->readonly ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE;
    int rc = sqlite3_open_v2(db_path, &s->db, flags, NULL);
    free(db_path);
    if (rc != SQLITE_OK) return sql_error(s, rc, "open chunks.db");
    sqlite3_extended_result_codes(s->db, 1);
    sqlite3_busy_timeout(s->db, 5000);
    int64_t version = 0;
    rk_status st = schema_check(s, &version);
    if (st == RK_OK && !s->readonly) {
        sqlite3_stmt *q = NULL;
        rc = sqlite3_prepare_v2(s->db, "PRAGMA journal_mode = WAL", -1, &q, NULL);
        if (rc == SQLITE_OK) rc = sqlite3_step(q);
        if (rc == SQLITE_ROW) {
            const char *mode = (const char *)sqlite3_column_text(q, 0);
            if (!mode || strcmp(mode, "wal") != 0)
                RK_LOG_WARN("store %s: SQLite refused WAL mode (journal mode %s)", s->dir,
                            mode ? mode : "?");
            rc = SQLITE_OK;
        }
        if (rc != SQLITE_OK) st = sql_error(s, rc, "set WAL mode");
        sqlite3_finalize(q);
        if (st == RK_OK) st = sql_exec(s, "PRAGMA synchronous = NORMAL", "set synchronous");
    }
    if (st == RK_OK && !s->readonly) st = migrate(s, version);
    for (int i = 0; st == RK_OK && i < ST_COUNT; i++) {
        const char *sql = s->readonly ? k_sql[i].ro : k_sql[i].rw;
        if (!sql) continue;
        rc = sqlite3_prepare_v3(s->db, sql, -1, SQLITE_PREPARE_PERSISTENT, &s->st[i], NULL);
        if (rc != SQLITE_OK) st = sql_error(s, rc, "prepare a statement");
    }
    return st;
}

static void log_bad(void *ctx, const char *key, const char *reason) {
    (void)key;
    RK_LOG_WARN("store %s: bad payload: %s", ((rk_store *)ctx)->dir, reason);
}

/* Recovery at open: see the header. */
static rk_status recover(rk_store *s) {
    /* rows of this model whose key could name no file */
    char bad_key_sql[] = "DELETE FROM chunks WHERE model = ?1 AND"
                         " (length(key) != 32 OR key GLOB '*[^0-9a-f]*')";
    sqlite3_stmt *q = NULL;
    int rc = sqlite3_prepare_v2(s->db, bad_key_sql, -1, &q, NULL);
    if (rc == SQLITE_OK) {
        sqlite3_bind_text(q, 1, s->fingerprint, -1, SQLITE_STATIC);
        rc = sqlite3_step(q);
    }
    rk_status st = rc == SQLITE_DONE ? RK_OK : sql_error(s, rc, "drop rows with bad keys");
    sqlite3_finalize(q);
    if (st != RK_OK) return st;
    s->c.dropped_on_recovery += (uint64_t)sqlite3_changes(s->db);

    /* this model's rows: check every payload (checksums with verify_on_open);
     * unreadable ones (permissions, EIO) stay: every load checks again */
    verify_ctx v = {
        .full = s->opts.verify_on_open, .collect = 1, .on_bad = log_bad, .on_bad_ctx = s};
    st = for_each_row(s, verify_row, &v);
    if (st == RK_OK && v.bad.n) st = remove_keys(s, &v.bad, 1, "drop bad rows");
    if (st == RK_OK) s->c.dropped_on_recovery += v.bad.n;
    key_list_free(&v.bad);
    if (st != RK_OK) return st;

    /* files without a row (any model's row keeps its file) and *.tmp */
    key_list keys = {0};
    uint64_t found = 0;
    st = all_keys(s, &keys);
    if (st == RK_OK) st = scan_files(s, &keys, 1, s->opts.verify_on_open, &found);
    key_list_free(&keys);
    if (st != RK_OK) return st;

    /* rows of other models: kept, counted */
    int64_t other = 0;
    q = NULL;
    rc = sqlite3_prepare_v2(s->db, "SELECT COUNT(*) FROM chunks WHERE model != ?1", -1, &q, NULL);
    if (rc == SQLITE_OK) {
        sqlite3_bind_text(q, 1, s->fingerprint, -1, SQLITE_STATIC);
        rc = sqlite3_step(q);
        if (rc == SQLITE_ROW) {
            other = sqlite3_column_int64(q, 0);
            rc = SQLITE_DONE;
        }
    }
    st = rc == SQLITE_DONE ? RK_OK : sql_error(s, rc, "count other models' rows");
    sqlite3_finalize(q);
    if (st != RK_OK) return st;
    s->c.other_model_rows = (uint64_t)other;
    if (other > 0)
        RK_LOG_WARN("store %s: %lld rows belong to another model fingerprint; kept but not served "
                    "by model %s",
                    s->dir, (long long)other, s->fingerprint);
    if (s->c.orphans_removed)
        RK_LOG_INFO("store %s: removed %llu temporary files of interrupted writes", s->dir,
                    (unsigned long long)s->c.orphans_removed);
    if (s->c.dropped_on_recovery)
        RK_LOG_WARN("store %s: dropped %llu bad rows at recovery", s->dir,
                    (unsigned long long)s->c.dropped_on_recovery);
    if (s->c.unreadable)
        RK_LOG_WARN("store %s: %llu unreadable directories or files skipped (left in place)",
                    s->dir, (unsigned long long)s->c.unreadable);
    return RK_OK;
}

static rk_status store_alloc(const char *dir, rk_store **out) {
    *out = NULL;
    if (!dir || !*dir) return rk_errorf(RK_ERR_INVALID, "store: empty directory name");
    rk_store *s = calloc(1, sizeof *s);
    if (!s) return rk_errorf(RK_ERR_NOMEM, "store: no memory");
    s->lock_fd = -1;
    s->dir = str_dup(dir);
    s->kv_dir = path_join(dir, "kv");
    if (!s->dir || !s->kv_dir) {
        rk_store_close(s);
        return rk_errorf(RK_ERR_NOMEM, "store: no memory");
    }
    *out = s;
    return RK_OK;
}

/* Close a store whose open failed with st and return st with the message.
 * A corrupt database gets the way out, first and short (callers show the
 * message in bounded buffers); SQLite's own words go to the log. */
static rk_status open_failed(rk_store *s, rk_status st) {
    char msg[768];
    if (s->db_corrupt) {
        RK_LOG_ERROR("%s", rk_error_message());
        snprintf(msg, sizeof msg,
                 "store %s: chunks.db is corrupt; with ragkv stopped, run `ragkv cache rebuild "
                 "--store %s` to set it aside and rebuild it from the payload files",
                 s->dir, s->dir);
    } else {
        snprintf(msg, sizeof msg, "%s", rk_error_message());
    }
    rk_store_close(s);
    return rk_errorf(st, "%s", msg);
}

/* Take DIR/LOCK for writing: RK_ERR_BUSY when another process holds it. */
static rk_status take_lock(rk_store *s) {
    char *lock = path_join(s->dir, "LOCK");
    if (!lock) return rk_errorf(RK_ERR_NOMEM, "store: no memory");
    rk_status st = RK_OK;
    if ((s->lock_fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644)) < 0)
        st = rk_errorf(RK_ERR_IO, "%s: open: %s", lock, strerror(errno));
    else if (flock(s->lock_fd, LOCK_EX | LOCK_NB) != 0)
        st = errno == EWOULDBLOCK
                 ? rk_errorf(RK_ERR_BUSY, "store %s: in use by another process", s->dir)
                 : rk_errorf(RK_ERR_IO, "%s: flock: %s", lock, strerror(errno));
    free(lock);
    return st;
}

/* Write the path DIR/name of a file of the store into buf. */
static rk_status store_path(const rk_store *s, const char *name, char *buf, size_t cap) {
    if (snprintf(buf, cap, "%s/%s", s->dir, name) >= (int)cap)
        return rk_errorf(RK_ERR_LIMIT, "store %s: path too long", s->dir);
    return RK_OK;
}

/* Set *out_missing when chunks.db does not exist or is empty: its rows are
 * then rebuilt from the payload files. A write-ahead log left without its
 * database cannot be applied to a new one: it goes to quarantine/. */
static rk_status db_missing(rk_store *s, int *out_missing) {
    char db[PATH_MAX], wal[PATH_MAX], shm[PATH_MAX];
    rk_status st = store_path(s, "chunks.db", db, sizeof db);
    if (st == RK_OK) st = store_path(s, "chunks.db-wal", wal, sizeof wal);
    if (st == RK_OK) st = store_path(s, "chunks.db-shm", shm, sizeof shm);
    if (st != RK_OK) return st;
    struct stat sb;
    *out_missing = 0;
    if (stat(db, &sb) == 0) {
        if (sb.st_size > 0) return RK_OK;
    } else if (errno != ENOENT) {
        return rk_errorf(RK_ERR_IO, "%s: stat: %s", db, strerror(errno));
    }
    *out_missing = 1;
    if (stat(wal, &sb) == 0) {
        if (sb.st_size == 0)
            unlink(wal); /* holds nothing; an empty log is harmless if it stays */
        else
            quarantine_file(s, wal, "chunks.db-wal");
    }
    if (unlink(shm) != 0 && errno != ENOENT)
        return rk_errorf(RK_ERR_IO, "%s: unlink: %s", shm, strerror(errno));
    return RK_OK;
}

/* Create chunks.db whole: the schema is written to chunks.db.new, which is
 * renamed into place only once it is complete, so a process killed while
 * creating a store never leaves a database without its tables behind. */
static rk_status create_db(rk_store *s) {
    char db[PATH_MAX], tmp[PATH_MAX];
    rk_status st = store_path(s, "chunks.db", db, sizeof db);
    if (st == RK_OK) st = store_path(s, "chunks.db.new", tmp, sizeof tmp);
    if (st != RK_OK) return st;
    if (unlink(tmp) != 0 && errno != ENOENT)
        return rk_errorf(RK_ERR_IO, "%s: unlink: %s", tmp, strerror(errno));
    int rc = sqlite3_open_v2(tmp, &s->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, NULL);
    st = rc == SQLITE_OK ? RK_OK : sql_error(s, rc, "create chunks.db");
    if (st == RK_OK) st = sql_exec(s, "PRAGMA journal_mode = WAL", "set WAL mode");
    if (st == RK_OK) st = migrate(s, 0);
    /* Closing the only connection checkpoints the log into the file. */
    if (s->db && sqlite3_close(s->db) != SQLITE_OK && st == RK_OK)
        st = rk_errorf(RK_ERR_IO, "store %s: cannot close the new chunks.db", s->dir);
    s->db = NULL;
    if (st == RK_OK && rename(tmp, db) != 0)
        st = rk_errorf(RK_ERR_IO, "%s: rename: %s", tmp, strerror(errno));
    if (st == RK_OK) {
        int fd = open(s->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0 || fsync(fd) != 0)
            st = rk_errorf(RK_ERR_IO, "%s: fsync: %s", s->dir, strerror(errno));
        if (fd >= 0) close(fd);
    }
    if (st != RK_OK) unlink(tmp);
    return st;
}

rk_status rk_store_open(const char *dir, const char *model_fingerprint,
                        const rk_store_options *opts, rk_store **out) {
    if (!out) return rk_errorf(RK_ERR_INVALID, "store: NULL output");
    *out = NULL;
    if (!rk_store_key_valid(model_fingerprint))
        return rk_errorf(RK_ERR_INVALID,
                         "store: model fingerprint must be 32 lowercase hex characters");
    rk_store *s = NULL;
    rk_status st = store_alloc(dir, &s);
    if (st != RK_OK) return st;
    memcpy(s->fingerprint, model_fingerprint, sizeof s->fingerprint);
    if (opts)
        s->opts = *opts;
    else
        rk_store_options_default(&s->opts);

    st = mkdir_p(dir);
    if (st == RK_OK && mkdir(s->kv_dir, 0755) != 0 && errno != EEXIST)
        st = rk_errorf(RK_ERR_IO, "%s: mkdir: %s", s->kv_dir, strerror(errno));
    if (st == RK_OK) st = take_lock(s);
    int missing = 0;
    if (st == RK_OK) st = db_missing(s, &missing);
    if (st == RK_OK && missing) st = create_db(s);
    if (st == RK_OK) st = open_db(s);
    int64_t last = 0;
    if (st == RK_OK)
        st = sql_int(s,
                     "SELECT CAST(COALESCE(MAX(last_access), 0) * 1000000 AS INTEGER)"
                     " FROM chunks",
                     &last);
    s->last_stamp = (double)last * 1e-6;
    if (st == RK_OK) st = recover(s);
    if (st == RK_OK) st = load_totals(s);
    if (st == RK_OK) st = enforce_budget(s); /* the budget may have shrunk since */
    if (st != RK_OK) return open_failed(s, st);
    if (missing && (s->c.rows_rebuilt || s->c.quarantined))
        RK_LOG_WARN("store %s: chunks.db was missing or empty: rebuilt %llu rows from the payload "
                    "files (%llu quarantined, %llu unreadable)",
                    dir, (unsigned long long)s->c.rows_rebuilt,
                    (unsigned long long)s->c.quarantined, (unsigned long long)s->c.unreadable);
    else if (s->c.rows_rebuilt)
        RK_LOG_WARN("store %s: gave %llu payload files without a row their row back", dir,
                    (unsigned long long)s->c.rows_rebuilt);
    RK_LOG_INFO("store %s: %llu rows, %llu bytes for model %s", dir, (unsigned long long)s->rows,
                (unsigned long long)s->bytes, s->fingerprint);
    *out = s;
    return RK_OK;
}

/* Return 1 when the database at path opens and passes SQLite's quick_check
 * as a ragkv store, else 0. */
static int db_sound(const char *path) {
    sqlite3 *db = NULL;
    sqlite3_stmt *q = NULL;
    int ok = sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL) == SQLITE_OK &&
             sqlite3_prepare_v2(db, "PRAGMA quick_check", -1, &q, NULL) == SQLITE_OK &&
             sqlite3_step(q) == SQLITE_ROW && sqlite3_column_text(q, 0) &&
             strcmp((const char *)sqlite3_column_text(q, 0), "ok") == 0;
    sqlite3_finalize(q);
    sqlite3_close(db);
    return ok;
}

/* Move chunks.db and its write-ahead log aside (the shared-memory index is
 * derived and removed), naming the new name in r->set_aside. */
static rk_status set_db_aside(rk_store *s, rk_store_rebuild_result *r) {
    char db[PATH_MAX], wal[PATH_MAX], shm[PATH_MAX], aside[PATH_MAX], wal_aside[PATH_MAX];
    rk_status st = store_path(s, "chunks.db", db, sizeof db);
    if (st == RK_OK) st = store_path(s, "chunks.db-wal", wal, sizeof wal);
    if (st == RK_OK) st = store_path(s, "chunks.db-shm", shm, sizeof shm);
    if (st != RK_OK) return st;
    struct stat sb;
    if (stat(db, &sb) != 0) return RK_OK; /* nothing to set aside */
    r->db_was_corrupt = !db_sound(db);
    time_t now = time(NULL);
    struct tm tm;
    char stamp[32];
    gmtime_r(&now, &tm);
    strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%SZ", &tm);
    snprintf(r->set_aside, sizeof r->set_aside, "chunks.db.%s-%s",
             r->db_was_corrupt ? "corrupt" : "old", stamp);
    if ((st = store_path(s, r->set_aside, aside, sizeof aside)) != RK_OK) return st;
    if (snprintf(wal_aside, sizeof wal_aside, "%s-wal", aside) >= (int)sizeof wal_aside)
        return rk_errorf(RK_ERR_LIMIT, "store %s: path too long", s->dir);
    if (stat(aside, &sb) == 0)
        return rk_errorf(RK_ERR_BUSY, "store %s: %s exists already; try again in a second", s->dir,
                         r->set_aside);
    if (rename(db, aside) != 0)
        return rk_errorf(RK_ERR_IO, "%s: rename to %s: %s", db, aside, strerror(errno));
    if (rename(wal, wal_aside) != 0 && errno != ENOENT)
        return rk_errorf(RK_ERR_IO, "%s: rename to %s: %s", wal, wal_aside, strerror(errno));
    if (unlink(shm) != 0 && errno != ENOENT)
        return rk_errorf(RK_ERR_IO, "%s: unlink: %s", shm, strerror(errno));
    return RK_OK;
}

rk_status rk_store_rebuild(const char *dir, rk_store_rebuild_result *out) {
    if (!out) return rk_errorf(RK_ERR_INVALID, "store: NULL output");
    memset(out, 0, sizeof *out);
    rk_store *s = NULL;
    rk_status st = store_alloc(dir, &s);
    if (st != RK_OK) return st;
    char db[PATH_MAX];
    struct stat sb;
    st = store_path(s, "chunks.db", db, sizeof db);
    if (st == RK_OK && stat(db, &sb) != 0 && stat(s->kv_dir, &sb) != 0)
        st = rk_errorf(RK_ERR_NOT_FOUND, "%s: no chunk store here (no chunks.db, no kv/)", dir);
    if (st == RK_OK) st = take_lock(s);
    if (st == RK_OK) st = set_db_aside(s, out);
    if (st == RK_OK) st = open_db(s);
    key_list none = {0};
    uint64_t found = 0;
    if (st == RK_OK) st = scan_files(s, &none, 1, 1, &found);
    out->rows_rebuilt = s->c.rows_rebuilt;
    out->quarantined = s->c.quarantined;
    out->unreadable = s->c.unreadable;
    out->tmp_removed = s->c.orphans_removed;
    if (st != RK_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", rk_error_message());
        rk_store_close(s);
        return rk_errorf(st, "%s", msg);
    }
    rk_store_close(s);
    RK_LOG_WARN("store %s: rebuilt %llu rows from the payload files (%llu quarantined, %llu "
                "unreadable)%s%s",
                dir, (unsigned long long)out->rows_rebuilt, (unsigned long long)out->quarantined,
                (unsigned long long)out->unreadable,
                out->set_aside[0] ? "; old database kept as " : "", out->set_aside);
    return RK_OK;
}

rk_status rk_store_open_readonly(const char *dir, rk_store **out) {
    if (!out) return rk_errorf(RK_ERR_INVALID, "store: NULL output");
    *out = NULL;
    rk_store *s = NULL;
    rk_status st = store_alloc(dir, &s);
    if (st != RK_OK) return st;
    s->readonly = 1;
    char *db_path = path_join(dir, "chunks.db");
    struct stat sb;
    if (!db_path)
        st = rk_errorf(RK_ERR_NOMEM, "store: no memory");
    else if (stat(db_path, &sb) != 0 && stat(s->kv_dir, &sb) == 0)
        st = rk_errorf(RK_ERR_NOT_FOUND,
                       "%s: chunks.db is missing; `ragkv cache rebuild --store %s` or the next "
                       "start-up rebuilds it from the payload files",
                       dir, dir);
    else if (stat(db_path, &sb) != 0)
        st = rk_errorf(RK_ERR_NOT_FOUND, "%s: no chunk store here (no chunks.db)", dir);
    free(db_path);
    if (st == RK_OK) st = open_db(s);
    if (st == RK_OK) st = load_totals(s);
    if (st != RK_OK) return open_failed(s, st);
    *out = s;
    return RK_OK;
}

void rk_store_close(rk_store *s) {
    if (!s) return;
    if (s->in_batch) {
        RK_LOG_WARN("store %s: closed with a batch open; rolling it back", s->dir);
        rk_store_rollback(s);
    }
    for (int i = 0; i < ST_COUNT; i++) sqlite3_finalize(s->st[i]);
    if (s->db) sqlite3_close(s->db);
    if (s->lock_fd >= 0) close(s->lock_fd); /* releases the flock */
    key_list_free(&s->batch_written);
    key_list_free(&s->pending_unlink);
    free(s->dir);
    free(s->kv_dir);
    free(s);
}

/* ---------------------------------------------------------------- reports */

static void format_time(double t, char *buf, size_t cap) {
    time_t sec = (time_t)t;
    struct tm tm;
    if (t <= 0 || !gmtime_r(&sec, &tm)) {
        snprintf(buf, cap, "-");
        return;
    }
    strftime(buf, cap, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

rk_status rk_store_print_ls(rk_store *s, FILE *f, rk_store_sort sort, int limit) {
    if (!s || !f) return rk_errorf(RK_ERR_INVALID, "store: NULL argument");
    rk_store_entry *v = NULL;
    int n = 0;
    rk_status st = rk_store_list(s, sort, limit, 0, &v, &n);
    if (st != RK_OK) return st;
    fprintf(f, "%-32s  %-8s  %-10s  %8s  %12s  %8s  %-20s  %s\n", "key", "model", "policy",
            "tokens", "bytes", "hits", "last_access", "doc_id");
    for (int i = 0; i < n; i++) {
        char when[32];
        format_time(v[i].last_access, when, sizeof when);
        fprintf(f, "%-32s  %-8.8s  %-10s  %8d  %12" PRIu64 "  %8" PRIu64 "  %-20s  %s\n", v[i].key,
                v[i].model, v[i].policy, (int)v[i].n_tokens, v[i].n_bytes, v[i].hits, when,
                v[i].doc_id[0] ? v[i].doc_id : "-");
    }
    fprintf(f, "%d rows\n", n);
    free(v);
    return RK_OK;
}

/* Count the files in DIR/quarantine/ (0 when there is none). */
static int count_quarantine(const rk_store *s) {
    char qdir[PATH_MAX];
    if (store_path(s, "quarantine", qdir, sizeof qdir) != RK_OK) return 0;
    DIR *d = opendir(qdir);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

rk_status rk_store_print_stats(rk_store *s, FILE *f) {
    if (!s || !f) return rk_errorf(RK_ERR_INVALID, "store: NULL argument");
    rk_store_counters c;
    rk_status st = rk_store_stats(s, &c);
    if (st != RK_OK) return st;
    fprintf(f, "store          %s\n", s->dir);
    fprintf(f, "schema         %d\n", RK_STORE_SCHEMA_VERSION);
    if (!s->readonly) fprintf(f, "model          %s\n", s->fingerprint);
    fprintf(f, "rows           %" PRIu64 "\n", c.rows);
    fprintf(f, "bytes          %" PRIu64 " (%.1f MiB)\n", c.bytes, (double)c.bytes / 1048576.0);

    sqlite3_stmt *q = NULL;
    int rc = sqlite3_prepare_v2(s->db,
                                "SELECT model, COUNT(*), COALESCE(SUM(n_bytes), 0),"
                                " COALESCE(SUM(hits), 0), MIN(created), MAX(last_access)"
                                " FROM chunks GROUP BY model ORDER BY model",
                                -1, &q, NULL);
    if (rc != SQLITE_OK) return sql_error(s, rc, "per-model totals");
    fprintf(f, "%-32s  %8s  %14s  %10s  %-20s  %s\n", "model", "rows", "bytes", "hits", "oldest",
            "last_access");
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        char oldest[32], last[32];
        format_time(sqlite3_column_double(q, 4), oldest, sizeof oldest);
        format_time(sqlite3_column_double(q, 5), last, sizeof last);
        const unsigned char *model = sqlite3_column_text(q, 0);
        fprintf(f, "%-32s  %8lld  %14lld  %10lld  %-20s  %s\n", model ? (const char *)model : "",
                (long long)sqlite3_column_int64(q, 1), (long long)sqlite3_column_int64(q, 2),
                (long long)sqlite3_column_int64(q, 3), oldest, last);
    }
    st = rc == SQLITE_DONE ? RK_OK : sql_error(s, rc, "per-model totals");
    sqlite3_finalize(q);
    if (st != RK_OK) return st;
    fprintf(f, "quarantine     %d files in %s/quarantine/\n", count_quarantine(s), s->dir);
    if (s->readonly) return RK_OK;
    fprintf(f, "other_model_rows     %" PRIu64 "\n", c.other_model_rows);
    fprintf(f, "loads                %" PRIu64 " (%" PRIu64 " bytes)\n", c.loads, c.load_bytes);
    fprintf(f, "writes               %" PRIu64 " (%" PRIu64 " bytes)\n", c.writes, c.write_bytes);
    fprintf(f, "dropped_on_recovery  %" PRIu64 "\n", c.dropped_on_recovery);
    fprintf(f, "dropped_on_load      %" PRIu64 "\n", c.dropped_on_load);
    fprintf(f, "corrupt_after_open   %" PRIu64 "\n", c.corrupt_after_open);
    fprintf(f, "quarantined          %" PRIu64 "\n", c.quarantined);
    fprintf(f, "rows_rebuilt         %" PRIu64 "\n", c.rows_rebuilt);
    fprintf(f, "unreadable           %" PRIu64 "\n", c.unreadable);
    fprintf(f, "orphans_removed      %" PRIu64 "\n", c.orphans_removed);
    fprintf(f, "evictions            %" PRIu64 " (%" PRIu64 " bytes)\n", c.evictions,
            c.evicted_bytes);
    fprintf(f, "deletes              %" PRIu64 "\n", c.deletes);
    return RK_OK;
}

static void print_bad(void *ctx, const char *key, const char *reason) {
    fprintf((FILE *)ctx, "BAD %s: %s\n", key, reason);
}

rk_status rk_store_print_verify(rk_store *s, FILE *f, uint64_t *out_bad) {
    if (!s || !f) return rk_errorf(RK_ERR_INVALID, "store: NULL argument");
    if (out_bad) *out_bad = 0;
    rk_store_verify_result r;
    rk_status st = rk_store_verify(s, 0, print_bad, f, &r);
    if (st != RK_OK) return st;
    fprintf(f, "checked %" PRIu64 " payloads: %" PRIu64 " bad, %" PRIu64 " orphan files\n",
            r.checked, r.bad, r.orphans);
    if (out_bad) *out_bad = r.bad;
    return RK_OK;
}
