/* store/store.c — the chunk store's index and metadata operations: keys and
 * paths, the SQLite helpers, the write and delete protocols (batches,
 * removal, the disk budget, put), get and the other lookups, flush, list and
 * stats. Open and close are in store/open.c, recovery at open in
 * store/recover.c, the offline reports in store/report.c; the payload file
 * format lives in store/payload.c. */
#include "store/store.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <sqlite3.h>

#include "store/internal.h"
#include "store/payload.h"

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

rk_status rk_store_key_list_push(key_list *l, const char *key) {
    rk_status st = key_list_reserve(l, 1);
    if (st != RK_OK) return st;
    memcpy(l->v[l->n++], key, sizeof(key_buf));
    return RK_OK;
}

void rk_store_key_list_free(key_list *l) {
    free(l->v);
    memset(l, 0, sizeof *l);
}

int rk_store_key_cmp(const void *a, const void *b) { return strcmp(a, b); }

/* Write the paths of key's payload: its directory kv/ab, its file and its
 * temporary name. Any of the outputs may be NULL. */
rk_status rk_store_key_paths(const rk_store *s, const char *key, char *dir, char *file, char *tmp,
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
    return rk_store_key_paths(s, key, NULL, buf, NULL, cap);
}

const char *rk_store_dir(const rk_store *s) { return s ? s->dir : NULL; }

/* Remove the payload file of a deleted row; a missing file is fine. Returns
 * 0, or the errno of a failed unlink (logged; its reason into why, cap
 * bytes, when why is not NULL). The unlink is an I/O call of
 * rk_store_fault_io's. */
int rk_store_unlink_payload(rk_store *s, const char *key, char *why, size_t cap) {
    char path[PATH_MAX];
    if (rk_store_key_paths(s, key, NULL, path, NULL, sizeof path) != RK_OK) return 0;
    if ((rk_payload_io_fault() ? -1 : unlink(path)) == 0 || errno == ENOENT) return 0;
    int err = errno;
    RK_LOG_WARN("store %s: cannot remove %s: %s", s->dir, path, strerror(err));
    if (why) snprintf(why, cap, "cannot remove kv/%.2s/%.32s.kv: %s", key, key, strerror(err));
    return err;
}

/* The same, without a report, for files whose row never committed or was
 * evicted (an eviction's file that stays gets its row back at the next open,
 * and is evicted again). */
static void unlink_payload(rk_store *s, const char *key) {
    char path[PATH_MAX];
    if (rk_store_key_paths(s, key, NULL, path, NULL, sizeof path) != RK_OK) return;
    if (unlink(path) != 0 && errno != ENOENT)
        RK_LOG_WARN("store %s: cannot remove %s: %s", s->dir, path, strerror(errno));
}

/* Record (add 1) or clear (add 0) the tombstone of key: its row is gone and
 * its payload file must not get the row back at an open. */
rk_status rk_store_tombstone(rk_store *s, const char *key, int add) {
    sqlite3_stmt *q = rk_store_stmt(s, add ? ST_TOMB_ADD : ST_TOMB_DEL);
    sqlite3_bind_text(q, 1, key, -1, SQLITE_STATIC);
    return rk_store_step_done(s, q, add ? "record a tombstone" : "clear a tombstone");
}

/* Count a payload file that could not be removed in *out (may be NULL). */
static void note_file_left(rk_store_removal *out, const char *why) {
    if (!out) return;
    if (!out->files_left++) snprintf(out->why, sizeof out->why, "%s", why);
}

/* Remove the payload file of a removed row whose tombstone is recorded, and
 * then the tombstone; a file that cannot be removed keeps it (counted in
 * *out). The caller runs the tombstone's removal inside a transaction of
 * its own or not at all (clear 0: it clears them together). Returns 1 when
 * the file is gone. */
static int remove_tombstoned(rk_store *s, const char *key, int clear, rk_store_removal *out) {
    char why[200];
    if (rk_store_unlink_payload(s, key, why, sizeof why) != 0) {
        note_file_left(out, why);
        return 0;
    }
    if (clear && rk_store_tombstone(s, key, 0) != RK_OK)
        RK_LOG_WARN("store %s: %s (cleared at the next open)", s->dir, rk_error_message());
    return 1;
}

/* Move the file at path (its name base) into DIR/quarantine/ under a unique
 * name, never deleting it: a payload that failed a check is kept for
 * inspection. Returns 1 when it was moved, 0 when it was not there or could
 * not be moved (logged; it stays where it is). Callers count payloads. */
int rk_store_quarantine_file(rk_store *s, const char *path, const char *base) {
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
    if (rk_store_key_paths(s, key, NULL, path, NULL, sizeof path) != RK_OK) return;
    snprintf(base, sizeof base, "%s.kv", key);
    s->c.quarantined += (uint64_t)rk_store_quarantine_file(s, path, base);
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

rk_status rk_store_sql_error(rk_store *s, int rc, const char *what) {
    note_corrupt(s, rc);
    return rk_errorf(sql_status(rc), "store %s: %s: %s", s->dir, what,
                     s->db ? sqlite3_errmsg(s->db) : sqlite3_errstr(rc));
}

/* Run SQL text with no result rows. */
rk_status rk_store_sql_exec(rk_store *s, const char *sql, const char *what) {
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
rk_status rk_store_sql_int(rk_store *s, const char *sql, int64_t *out) {
    sqlite3_stmt *q = NULL;
    int rc = sqlite3_prepare_v2(s->db, sql, -1, &q, NULL);
    if (rc == SQLITE_OK) rc = sqlite3_step(q);
    if (rc == SQLITE_ROW) {
        *out = sqlite3_column_int64(q, 0);
        sqlite3_finalize(q);
        return RK_OK;
    }
    rk_status st = rk_store_sql_error(s, rc, sql);
    sqlite3_finalize(q);
    return st;
}

sqlite3_stmt *rk_store_stmt(rk_store *s, int id) {
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
rk_status rk_store_step_done(rk_store *s, sqlite3_stmt *q, const char *what) {
    int rc = sqlite3_step(q);
    rk_status st = rc == SQLITE_DONE ? RK_OK : rk_store_sql_error(s, rc, what);
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
    sqlite3_stmt *q = rk_store_stmt(s, ST_FIND);
    sqlite3_bind_text(q, 1, key, -1, SQLITE_STATIC);
    int rc = sqlite3_step(q);
    *out_found = 0;
    if (rc == SQLITE_ROW) {
        read_row(q, e);
        *out_found = 1;
        rc = SQLITE_DONE;
    }
    rk_status st = rc == SQLITE_DONE ? RK_OK : rk_store_sql_error(s, rc, "look up a row");
    sqlite3_reset(q);
    return st;
}

/* Find key's row of this model (any model on read-only handles). */
rk_status rk_store_find_own_row(rk_store *s, const char *key, rk_store_entry *e, int *out_found) {
    rk_status st = find_row(s, key, e, out_found);
    if (st == RK_OK && *out_found && !s->readonly && strcmp(e->model, s->fingerprint) != 0)
        *out_found = 0;
    return st;
}

rk_status rk_store_load_totals(rk_store *s) {
    sqlite3_stmt *q = rk_store_stmt(s, ST_TOTALS);
    bind_model(s, q);
    int rc = sqlite3_step(q);
    if (rc == SQLITE_ROW) {
        s->rows = (uint64_t)sqlite3_column_int64(q, 0);
        s->bytes = (uint64_t)sqlite3_column_int64(q, 1);
        rc = SQLITE_DONE;
    }
    rk_status st = rc == SQLITE_DONE ? RK_OK : rk_store_sql_error(s, rc, "count rows");
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
    if (rk_store_load_totals(s) != RK_OK)
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
    st = rk_store_step_done(s, rk_store_stmt(s, ST_BEGIN), "begin a batch");
    if (st == RK_OK) s->in_batch = 1;
    return st;
}

rk_status rk_store_commit(rk_store *s) {
    rk_status st = must_write(s);
    if (st != RK_OK) return st;
    if (!s->in_batch) return rk_errorf(RK_ERR_INVALID, "store %s: no batch is open", s->dir);
    st = rk_store_step_done(s, rk_store_stmt(s, ST_COMMIT), "commit a batch");
    if (st != RK_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", rk_error_message());
        if (!sqlite3_get_autocommit(s->db))
            rk_store_step_done(s, rk_store_stmt(s, ST_ROLLBACK), "roll back");
        batch_abandoned(s);
        return rk_errorf(st, "%s (batch rolled back)", msg);
    }
    for (size_t i = 0; i < s->pending_unlink.n; i++)
        (void)remove_tombstoned(s, s->pending_unlink.v[i], 1, NULL);
    s->pending_unlink.n = 0;
    s->batch_written.n = 0;
    s->in_batch = 0;
    if (rk_store_enforce_budget(s) != RK_OK)
        RK_LOG_WARN("store %s: eviction failed: %s", s->dir, rk_error_message());
    return RK_OK;
}

rk_status rk_store_rollback(rk_store *s) {
    rk_status st = must_write(s);
    if (st != RK_OK) return st;
    if (!s->in_batch) return rk_errorf(RK_ERR_INVALID, "store %s: no batch is open", s->dir);
    st = RK_OK;
    if (!sqlite3_get_autocommit(s->db))
        st = rk_store_step_done(s, rk_store_stmt(s, ST_ROLLBACK), "roll back");
    batch_abandoned(s);
    return st;
}

/* ---------------------------------------------------------------- removal */

/* Delete key's row (n_bytes of payload) and then its file; inside a batch the
 * file goes when the batch commits. The row goes with a tombstone for key,
 * in one transaction, which goes when the file has gone (see store.h). With
 * bad set the payload failed a check: its file is quarantined at once
 * instead, and no tombstone is needed (an open quarantines it again). */
rk_status rk_store_remove_entry(rk_store *s, const char *key, uint64_t n_bytes, int bad,
                                rk_store_removal *out) {
    int own = !bad && !s->in_batch; /* a transaction of our own for row and tombstone */
    rk_status st = own ? rk_store_step_done(s, rk_store_stmt(s, ST_BEGIN), "delete a row") : RK_OK;
    if (st == RK_OK) {
        sqlite3_stmt *q = rk_store_stmt(s, ST_DELETE);
        sqlite3_bind_text(q, 1, key, -1, SQLITE_STATIC);
        st = rk_store_step_done(s, q, "delete a row");
    }
    if (st == RK_OK && !bad) st = rk_store_tombstone(s, key, 1);
    if (st == RK_OK && own) st = rk_store_step_done(s, rk_store_stmt(s, ST_COMMIT), "delete a row");
    if (st != RK_OK) {
        if (own && !sqlite3_get_autocommit(s->db))
            rk_store_step_done(s, rk_store_stmt(s, ST_ROLLBACK), "roll back");
        batch_check_alive(s);
        return st;
    }
    if (s->rows) s->rows--;
    s->bytes = s->bytes >= n_bytes ? s->bytes - n_bytes : 0;
    if (out) out->rows++;
    if (bad) {
        quarantine_payload(s, key);
    } else if (s->in_batch) {
        if (rk_store_key_list_push(&s->pending_unlink, key) != RK_OK)
            RK_LOG_WARN("store %s: no memory to defer a file removal (removed at next open)",
                        s->dir);
    } else {
        (void)remove_tombstoned(s, key, 1, out);
    }
    return RK_OK;
}

/* Evict least recently accessed rows of this model until the payload bytes
 * fit the disk budget. Not inside a batch (files of an open batch may still
 * be rolled back). */
rk_status rk_store_enforce_budget(rk_store *s) {
    uint64_t budget = s->opts.disk_budget_bytes;
    if (!budget || s->in_batch) return RK_OK;
    while (s->bytes > budget) {
        sqlite3_stmt *q = rk_store_stmt(s, ST_LRU);
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
            if ((st = rk_store_key_list_push(&victims, key)) != RK_OK) break;
            sizes[victims.n - 1] = nb;
            freed += nb;
        }
        sqlite3_reset(q);
        if (st == RK_OK && victims.n == 0) {
            /* the totals drifted from the table: trust the table */
            st = rk_store_load_totals(s);
            free(sizes);
            rk_store_key_list_free(&victims);
            if (st != RK_OK || s->bytes <= budget) return st;
            return rk_errorf(RK_ERR_INTERNAL, "store %s: over budget with nothing to evict",
                             s->dir);
        }
        if (st == RK_OK) st = rk_store_step_done(s, rk_store_stmt(s, ST_BEGIN), "begin eviction");
        for (size_t i = 0; st == RK_OK && i < victims.n; i++) {
            sqlite3_stmt *d = rk_store_stmt(s, ST_DELETE);
            sqlite3_bind_text(d, 1, victims.v[i], -1, SQLITE_STATIC);
            st = rk_store_step_done(s, d, "evict a row");
        }
        if (st == RK_OK) st = rk_store_step_done(s, rk_store_stmt(s, ST_COMMIT), "commit eviction");
        if (st != RK_OK) {
            if (!sqlite3_get_autocommit(s->db))
                rk_store_step_done(s, rk_store_stmt(s, ST_ROLLBACK), "roll back");
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
        rk_store_key_list_free(&victims);
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
rk_status rk_store_insert_row(rk_store *s, const rk_payload_header *h, uint64_t n_bytes) {
    char sum_hex[RK_STORE_KEY_LEN + 1], rel[64];
    rk_payload_checksum_hex(h->checksum, sum_hex);
    snprintf(rel, sizeof rel, "kv/%.2s/%s.kv", h->key, h->key);
    sqlite3_stmt *q = rk_store_stmt(s, ST_INSERT);
    sqlite3_bind_text(q, 1, h->key, -1, SQLITE_STATIC);
    sqlite3_bind_text(q, 2, h->fingerprint, -1, SQLITE_STATIC);
    sqlite3_bind_text(q, 3, h->policy[0] ? h->policy : "unknown", -1, SQLITE_STATIC);
    sqlite3_bind_int64(q, 4, h->n_tokens);
    sqlite3_bind_int64(q, 5, (sqlite3_int64)n_bytes);
    sqlite3_bind_text(q, 6, sum_hex, -1, SQLITE_STATIC);
    sqlite3_bind_double(q, 7, h->created);
    if (h->doc_id[0]) sqlite3_bind_text(q, 8, h->doc_id, -1, SQLITE_STATIC);
    sqlite3_bind_text(q, 9, rel, -1, SQLITE_STATIC);
    rk_status st = rk_store_step_done(s, q, "insert a row");
    sqlite3_clear_bindings(q);
    /* A put of a deleted key: its file was replaced, the row is back. */
    if (st == RK_OK) st = rk_store_tombstone(s, h->key, 0);
    return st;
}

/* Create kv/ab (sub) when missing, making the new entry durable in kv/. */
static rk_status ensure_subdir(const char *kv_dir, const char *sub) {
    if (rk_payload_io_fault() || mkdir(sub, 0755) != 0) {
        if (errno == EEXIST) return RK_OK;
        return rk_errorf(RK_ERR_IO, "%s: mkdir: %s", sub, strerror(errno));
    }
    int fd = open(kv_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fsync(fd) != 0) {
        rk_status st = rk_errorf(RK_ERR_IO, "%s: fsync directory: %s", kv_dir, strerror(errno));
        if (fd >= 0) close(fd);
        rmdir(sub);
        return st;
    }
    close(fd);
    return RK_OK;
}

/* A put between its begin and its end: everything its payload write needs,
 * so that rk_store_put_write never reads the handle. */
struct rk_store_write {
    rk_payload_header h; /* all but the checksum, which the write computes */
    const int32_t *tokens;
    const void *body;
    uint64_t n_bytes;
    uint64_t generation; /* s->generation at the begin */
    int delay_ms;
    char kv_dir[PATH_MAX], sub[PATH_MAX], file[PATH_MAX], tmp[PATH_MAX];
};

static int writing(const rk_store *s, const char *key) {
    for (size_t i = 0; i < s->writing.n; i++)
        if (strcmp(s->writing.v[i], key) == 0) return 1;
    return 0;
}

rk_status rk_store_put_begin(rk_store *s, const rk_store_put_args *a, rk_store_write **out) {
    *out = NULL;
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
    if (writing(s, a->key)) return RK_OK; /* its write is under way */
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
    rk_store_write *w = calloc(1, sizeof *w);
    if (!w) return rk_errorf(RK_ERR_NOMEM, "store: out of memory for a write");
    if ((st = rk_store_key_paths(s, a->key, w->sub, w->file, w->tmp, sizeof w->sub)) != RK_OK ||
        (st = rk_store_key_list_push(&s->writing, a->key)) != RK_OK) {
        free(w);
        return st;
    }
    snprintf(w->kv_dir, sizeof w->kv_dir, "%s", s->kv_dir);
    memcpy(w->h.fingerprint, s->fingerprint, sizeof w->h.fingerprint);
    memcpy(w->h.key, a->key, sizeof w->h.key);
    w->h.n_tokens = (uint32_t)a->n_tokens;
    w->h.layout = a->layout;
    w->h.body_size = a->body_size;
    snprintf(w->h.policy, sizeof w->h.policy, "%s", a->policy);
    snprintf(w->h.doc_id, sizeof w->h.doc_id, "%s", a->doc_id ? a->doc_id : "");
    w->h.created = next_stamp(s);
    w->tokens = a->tokens;
    w->body = a->body;
    w->n_bytes = n_bytes;
    w->generation = s->generation;
    w->delay_ms = s->opts.write_delay_ms;
    *out = w;
    return RK_OK;
}

rk_status rk_store_put_write(rk_store_write *w) {
    if (w->delay_ms > 0) {
        struct timespec ts = {w->delay_ms / 1000, (w->delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    rk_payload_checksum(w->tokens, w->h.n_tokens, w->body, w->h.body_size, w->h.checksum);
    rk_status st = ensure_subdir(w->kv_dir, w->sub);
    if (st == RK_OK) st = rk_payload_write(w->tmp, w->file, w->sub, &w->h, w->tokens, w->body);
    return st;
}

/* Forget w's key among the writes under way. */
static void end_writing(rk_store *s, const rk_store_write *w) {
    for (size_t i = 0; i < s->writing.n; i++)
        if (strcmp(s->writing.v[i], w->h.key) == 0) {
            memmove(s->writing.v[i], s->writing.v[s->writing.n - 1], sizeof(key_buf));
            s->writing.n--;
            return;
        }
}

rk_status rk_store_put_end(rk_store *s, rk_store_write *w, rk_status write_status) {
    if (!w) return write_status;
    end_writing(s, w);
    rk_status st = write_status;
    if (st == RK_OK && w->generation != s->generation) {
        /* Deleted or flushed while it was written: the row is not wanted. */
        if (unlink(w->file) != 0 && errno != ENOENT)
            RK_LOG_WARN("store %s: cannot remove %s: %s", s->dir, w->file, strerror(errno));
        free(w);
        return RK_OK;
    }
    if (st == RK_OK) {
        s->c.writes++;
        s->c.write_bytes += w->n_bytes;
        st = rk_store_insert_row(s, &w->h, w->n_bytes);
        if (st != RK_OK) {
            if (unlink(w->file) != 0 && errno != ENOENT)
                RK_LOG_WARN("store %s: cannot remove %s: %s", s->dir, w->file, strerror(errno));
            batch_check_alive(s);
        }
    }
    if (st == RK_OK) {
        s->rows++;
        s->bytes += w->n_bytes;
        if (s->in_batch)
            rk_store_key_list_push(&s->batch_written, w->h.key); /* reserved: cannot fail */
        else if (rk_store_enforce_budget(s) != RK_OK)
            RK_LOG_WARN("store %s: eviction failed: %s", s->dir, rk_error_message());
    }
    free(w);
    return st;
}

void rk_store_put_abandon(rk_store *s, rk_store_write *w) {
    if (!w) return;
    end_writing(s, w);
    free(w);
}

rk_status rk_store_put(rk_store *s, const rk_store_put_args *a) {
    rk_store_write *w;
    rk_status st = rk_store_put_begin(s, a, &w);
    if (st != RK_OK || !w) return st;
    return rk_store_put_end(s, w, rk_store_put_write(w));
}

/* ---------------------------------------------------------------- get and friends */

void rk_store_expect_from_row(const rk_store_entry *e, rk_payload_expect *x) {
    x->key = e->key;
    x->fingerprint = e->model;
    x->checksum_hex = e->checksum;
    x->n_tokens = e->n_tokens;
    x->n_bytes = e->n_bytes;
}

rk_status rk_store_locate(rk_store *s, const char *key, rk_store_located *out, int *out_found) {
    *out_found = 0;
    rk_status st = must_write(s);
    if (st != RK_OK) return st;
    if ((st = check_key(key)) != RK_OK) return st;
    memset(out, 0, sizeof *out);
    if ((st = rk_store_find_own_row(s, key, &out->row, out_found)) != RK_OK || !*out_found)
        return st;
    out->body_check = s->opts.body_check;
    out->read_delay_ms = s->opts.read_delay_ms;
    return rk_store_key_paths(s, key, NULL, out->path, NULL, sizeof out->path);
}

rk_status rk_store_read(const rk_store_located *loc, rk_store_payload *out) {
    memset(out, 0, sizeof *out);
    if (loc->read_delay_ms > 0) {
        struct timespec ts = {loc->read_delay_ms / 1000, (loc->read_delay_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    rk_payload_expect x;
    rk_store_expect_from_row(&loc->row, &x);
    rk_payload_header h;
    int32_t *tokens = NULL;
    void *body = NULL;
    rk_status st = rk_payload_read(loc->path, &x, &h, &tokens, &body);
    char bad_body[256];
    if (st == RK_OK && loc->body_check &&
        loc->body_check(&h.layout, body, (size_t)h.body_size, bad_body, sizeof bad_body)) {
        free(tokens);
        free(body);
        return rk_errorf(RK_ERR_FORMAT, "%s: %s", loc->path, bad_body);
    }
    if (st != RK_OK) return st;
    out->meta = loc->row;
    out->layout = h.layout;
    out->tokens = tokens;
    out->body = body;
    out->body_size = (size_t)h.body_size;
    return RK_OK;
}

void rk_store_load_done(rk_store *s, const rk_store_located *loc, rk_status read_status,
                        const char *why) {
    const char *key = loc->row.key;
    if (read_status == RK_ERR_FORMAT) {
        RK_LOG_WARN("store %s: dropping a bad payload: %s", s->dir, why);
        if (rk_store_remove_entry(s, key, loc->row.n_bytes, 1, NULL) != RK_OK)
            RK_LOG_WARN("store %s: %s", s->dir, rk_error_message());
        s->c.dropped_on_load++;
        s->c.corrupt_after_open++;
        return;
    }
    if (read_status != RK_OK) return;
    sqlite3_stmt *q = rk_store_stmt(s, ST_TOUCH);
    sqlite3_bind_text(q, 1, key, -1, SQLITE_STATIC);
    sqlite3_bind_double(q, 2, next_stamp(s));
    if (rk_store_step_done(s, q, "record an access") != RK_OK) {
        /* The payload is verified; a lost hit count is no reason to fail. */
        RK_LOG_WARN("%s", rk_error_message());
        batch_check_alive(s);
    }
    s->c.loads++;
    s->c.load_bytes += loc->row.n_bytes;
}

rk_status rk_store_get(rk_store *s, const char *key, rk_store_payload *out) {
    if (!out) return rk_errorf(RK_ERR_INVALID, "store: NULL output");
    memset(out, 0, sizeof *out);
    rk_store_located loc;
    int found = 0;
    rk_status st = rk_store_locate(s, key, &loc, &found);
    if (st != RK_OK) return st;
    if (!found) return rk_errorf(RK_ERR_NOT_FOUND, "store: key %s not found", key);
    st = rk_store_read(&loc, out);
    /* The error message is kept across the bookkeeping, which may log. */
    char why[512];
    snprintf(why, sizeof why, "%s", st ? rk_error_message() : "");
    rk_store_load_done(s, &loc, st, why);
    if (st == RK_ERR_FORMAT)
        return rk_errorf(RK_ERR_NOT_FOUND, "store: %s failed verification and was dropped: %s", key,
                         why);
    if (st != RK_OK) return rk_errorf(st, "%s", why);
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
    return rk_store_find_own_row(s, key, &row, out_present);
}

rk_status rk_store_lookup(rk_store *s, const char *key, rk_store_entry *out) {
    if (!s || !out) return rk_errorf(RK_ERR_INVALID, "store: NULL argument");
    rk_status st = check_key(key);
    if (st != RK_OK) return st;
    int found = 0;
    if ((st = rk_store_find_own_row(s, key, out, &found)) != RK_OK) return st;
    if (!found) return rk_errorf(RK_ERR_NOT_FOUND, "store: key %s not found", key);
    return RK_OK;
}

rk_status rk_store_delete(rk_store *s, const char *key, rk_store_removal *out) {
    if (out) memset(out, 0, sizeof *out);
    rk_status st = must_write(s);
    if (st != RK_OK) return st;
    if ((st = check_key(key)) != RK_OK) return st;
    rk_store_entry row;
    int found = 0;
    if ((st = rk_store_find_own_row(s, key, &row, &found)) != RK_OK) return st;
    if (!found) return rk_errorf(RK_ERR_NOT_FOUND, "store: key %s not found", key);
    if ((st = rk_store_remove_entry(s, key, row.n_bytes, 0, out)) != RK_OK) return st;
    s->c.deletes++;
    s->generation++; /* a write under way must not bring it back */
    return RK_OK;
}

typedef rk_status (*row_fn)(rk_store *s, const rk_store_entry *e, void *ctx);

/* Call fn for every row of this model (every model on read-only handles) in
 * key order. fn must not write to the table: callers collect what to delete
 * and delete after the walk. */
rk_status rk_store_for_each_row(rk_store *s, row_fn fn, void *ctx) {
    sqlite3_stmt *q = rk_store_stmt(s, ST_SCAN);
    bind_model(s, q);
    rk_store_entry e;
    int rc;
    rk_status st = RK_OK;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        read_row(q, &e);
        if ((st = fn(s, &e, ctx)) != RK_OK) break;
    }
    if (st == RK_OK && rc != SQLITE_DONE) st = rk_store_sql_error(s, rc, "scan rows");
    sqlite3_reset(q);
    return st;
}

static rk_status push_key(rk_store *s, const rk_store_entry *e, void *ctx) {
    (void)s;
    if (!rk_store_key_valid(e->key)) return RK_OK; /* names no file */
    return rk_store_key_list_push(ctx, e->key);
}

/* Delete the rows of keys in one transaction, then their files (quarantined
 * with bad set: they failed a check). Without bad each row leaves a
 * tombstone in the same transaction, and the tombstones of the files that
 * went are cleared together afterwards. */
rk_status rk_store_remove_keys(rk_store *s, const key_list *keys, int bad, const char *what,
                               rk_store_removal *out) {
    rk_status st = rk_store_step_done(s, rk_store_stmt(s, ST_BEGIN), what);
    for (size_t i = 0; st == RK_OK && i < keys->n; i++) {
        sqlite3_stmt *d = rk_store_stmt(s, ST_DELETE);
        sqlite3_bind_text(d, 1, keys->v[i], -1, SQLITE_STATIC);
        st = rk_store_step_done(s, d, what);
        if (st == RK_OK && !bad) st = rk_store_tombstone(s, keys->v[i], 1);
    }
    if (st == RK_OK) st = rk_store_step_done(s, rk_store_stmt(s, ST_COMMIT), what);
    if (st != RK_OK) {
        if (!sqlite3_get_autocommit(s->db))
            rk_store_step_done(s, rk_store_stmt(s, ST_ROLLBACK), "roll back");
        return st;
    }
    if (out) out->rows += keys->n;
    if (bad) {
        for (size_t i = 0; i < keys->n; i++) quarantine_payload(s, keys->v[i]);
        return RK_OK;
    }
    char *gone = calloc(keys->n ? keys->n : 1, 1); /* 1 where the file went */
    for (size_t i = 0; i < keys->n; i++) {
        int g = remove_tombstoned(s, keys->v[i], !gone, out);
        if (gone) gone[i] = (char)g;
    }
    if (!gone) return RK_OK;
    rk_status cs = rk_store_step_done(s, rk_store_stmt(s, ST_BEGIN), "clear tombstones");
    for (size_t i = 0; cs == RK_OK && i < keys->n; i++)
        if (gone[i]) cs = rk_store_tombstone(s, keys->v[i], 0);
    if (cs == RK_OK) cs = rk_store_step_done(s, rk_store_stmt(s, ST_COMMIT), "clear tombstones");
    if (cs != RK_OK) {
        RK_LOG_WARN("store %s: %s (cleared at the next open)", s->dir, rk_error_message());
        if (!sqlite3_get_autocommit(s->db))
            rk_store_step_done(s, rk_store_stmt(s, ST_ROLLBACK), "roll back");
    }
    free(gone);
    return RK_OK;
}

rk_status rk_store_flush(rk_store *s, rk_store_removal *out) {
    if (out) memset(out, 0, sizeof *out);
    rk_status st = must_write(s);
    if (st != RK_OK) return st;
    if (s->in_batch) return rk_errorf(RK_ERR_INVALID, "store %s: flush inside a batch", s->dir);
    key_list keys = {0};
    st = rk_store_for_each_row(s, push_key, &keys);
    if (st == RK_OK) st = rk_store_remove_keys(s, &keys, 0, "flush", out);
    if (st == RK_OK) s->generation++; /* nor bring back what was flushed */
    rk_store_key_list_free(&keys);
    if (st == RK_OK) st = rk_store_load_totals(s);
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
    sqlite3_stmt *q = rk_store_stmt(s, sort == RK_STORE_SORT_HITS ? ST_LIST_HITS : ST_LIST_RECENT);
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
    if (st == RK_OK && rc != SQLITE_DONE) st = rk_store_sql_error(s, rc, "list rows");
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
        rk_status st = rk_store_load_totals(s); /* another process may be writing */
        if (st != RK_OK) return st;
    }
    *out = s->c;
    out->rows = s->rows;
    out->bytes = s->bytes;
    return RK_OK;
}
