/* store/recover.c — integrity checking and crash recovery of the chunk store:
 * the directory scan that gives payload files without a row their row back
 * or quarantines them, verify (every row's payload against its row),
 * recovery at open (see store/store.h) and rk_store_rebuild, which sets a
 * lost or corrupt chunks.db aside and rebuilds it from the payload files. */
#include "store/store.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <sqlite3.h>

#include "store/internal.h"
#include "store/payload.h"

/* ---------------------------------------------------------------- directory scan */

/* Read every key of the table (all models) into a sorted list. */
static rk_status all_keys(rk_store *s, key_list *out) {
    sqlite3_stmt *q = rk_store_stmt(s, ST_KEYS_ALL);
    int rc;
    rk_status st = RK_OK;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        const char *key = (const char *)sqlite3_column_text(q, 0);
        if (!rk_store_key_valid(key)) continue; /* names no file */
        if ((st = rk_store_key_list_push(out, key)) != RK_OK) break;
    }
    if (st == RK_OK && rc != SQLITE_DONE) st = rk_store_sql_error(s, rc, "read keys");
    sqlite3_reset(q);
    if (st == RK_OK && out->n) qsort(out->v, out->n, sizeof *out->v, rk_store_key_cmp);
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
        s->c.quarantined += (uint64_t)rk_store_quarantine_file(s, path, base);
        return RK_OK;
    }
    if (st != RK_OK) {
        RK_LOG_WARN("store %s: skipping an unreadable payload: %s", s->dir, rk_error_message());
        s->c.unreadable++;
        return RK_OK;
    }
    if ((st = rk_store_insert_row(s, &h, n_bytes)) != RK_OK) return st;
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
    rk_status st =
        repair ? rk_store_step_done(s, rk_store_stmt(s, ST_BEGIN), "begin recovery") : RK_OK;
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
                if (keys->n && bsearch(key, keys->v, keys->n, sizeof *keys->v, rk_store_key_cmp))
                    continue;
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
    if (repair && st == RK_OK)
        st = rk_store_step_done(s, rk_store_stmt(s, ST_COMMIT), "commit recovery");
    if (repair && st != RK_OK && !sqlite3_get_autocommit(s->db))
        rk_store_step_done(s, rk_store_stmt(s, ST_ROLLBACK), "roll back");
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
    rk_status st = rk_store_key_paths(s, e->key, NULL, path, NULL, sizeof path);
    if (st != RK_OK) return st;
    rk_payload_expect x;
    rk_store_expect_from_row(e, &x);
    rk_status cs = rk_payload_check(path, &x, v->full);
    if (cs == RK_OK && v->full && s->opts.body_check) cs = check_body(s, path, &x);
    if (cs == RK_OK) return RK_OK;
    if (cs == RK_ERR_NOMEM) return cs;
    v->r.bad++;
    if (v->on_bad) v->on_bad(v->on_bad_ctx, e->key, rk_error_message());
    if (v->collect && cs == RK_ERR_FORMAT) return rk_store_key_list_push(&v->bad, e->key);
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
    rk_status st = rk_store_for_each_row(s, verify_row, &v);
    for (size_t i = 0; st == RK_OK && i < v.bad.n; i++) {
        rk_store_entry e;
        int found = 0;
        st = rk_store_find_own_row(s, v.bad.v[i], &e, &found);
        if (st == RK_OK && found &&
            (st = rk_store_remove_entry(s, e.key, e.n_bytes, 1, NULL)) == RK_OK) {
            v.r.deleted++;
            s->c.corrupt_after_open++;
        }
    }
    rk_store_key_list_free(&v.bad);
    key_list keys = {0};
    if (st == RK_OK) st = all_keys(s, &keys);
    if (st == RK_OK) st = scan_files(s, &keys, 0, 0, &v.r.orphans);
    rk_store_key_list_free(&keys);
    *out = v.r;
    return st;
}

/* ---------------------------------------------------------------- recovery at open */

/* The tombstones at open: remove each one's payload file and then the
 * tombstone; a key with a row again (put after its delete) just loses its
 * tombstone. Keys whose file still cannot be removed keep it and are added
 * to keys (sorted keys of every row), so the scan leaves their files alone. */
static rk_status clear_tombstones(rk_store *s, key_list *keys) {
    key_list t = {0};
    sqlite3_stmt *q = rk_store_stmt(s, ST_TOMB_KEYS);
    int rc;
    rk_status st = RK_OK;
    while ((rc = sqlite3_step(q)) == SQLITE_ROW) {
        const char *key = (const char *)sqlite3_column_text(q, 0);
        if (!rk_store_key_valid(key)) continue; /* names no file */
        if ((st = rk_store_key_list_push(&t, key)) != RK_OK) break;
    }
    if (st == RK_OK && rc != SQLITE_DONE) st = rk_store_sql_error(s, rc, "read tombstones");
    sqlite3_reset(q);
    size_t n_rows = keys->n, left = 0;
    char why[200] = "";
    for (size_t i = 0; st == RK_OK && i < t.n; i++) {
        const char *key = t.v[i];
        int has_row = n_rows && bsearch(key, keys->v, n_rows, sizeof *keys->v, rk_store_key_cmp);
        if (!has_row && rk_store_unlink_payload(s, key, left ? NULL : why, sizeof why) != 0) {
            left++;
            st = rk_store_key_list_push(keys, key);
            continue;
        }
        st = rk_store_tombstone(s, key, 0);
    }
    rk_store_key_list_free(&t);
    if (st != RK_OK) return st;
    if (left) {
        qsort(keys->v, keys->n, sizeof *keys->v, rk_store_key_cmp);
        RK_LOG_WARN("store %s: %zu payload files of removed chunks are still there (%s); they "
                    "stay tombstoned, never served, and are removed at an open that can",
                    s->dir, left, why);
    }
    return RK_OK;
}

static void log_bad(void *ctx, const char *key, const char *reason) {
    (void)key;
    RK_LOG_WARN("store %s: bad payload: %s", ((rk_store *)ctx)->dir, reason);
}

/* Recovery at open: see the header. */
rk_status rk_store_recover(rk_store *s) {
    /* rows of this model whose key could name no file */
    char bad_key_sql[] = "DELETE FROM chunks WHERE model = ?1 AND"
                         " (length(key) != 32 OR key GLOB '*[^0-9a-f]*')";
    sqlite3_stmt *q = NULL;
    int rc = sqlite3_prepare_v2(s->db, bad_key_sql, -1, &q, NULL);
    if (rc == SQLITE_OK) {
        sqlite3_bind_text(q, 1, s->fingerprint, -1, SQLITE_STATIC);
        rc = sqlite3_step(q);
    }
    rk_status st = rc == SQLITE_DONE ? RK_OK : rk_store_sql_error(s, rc, "drop rows with bad keys");
    sqlite3_finalize(q);
    if (st != RK_OK) return st;
    s->c.dropped_on_recovery += (uint64_t)sqlite3_changes(s->db);

    /* this model's rows: check every payload (checksums with verify_on_open);
     * unreadable ones (permissions, EIO) stay: every load checks again */
    verify_ctx v = {
        .full = s->opts.verify_on_open, .collect = 1, .on_bad = log_bad, .on_bad_ctx = s};
    st = rk_store_for_each_row(s, verify_row, &v);
    if (st == RK_OK && v.bad.n) st = rk_store_remove_keys(s, &v.bad, 1, "drop bad rows", NULL);
    if (st == RK_OK) s->c.dropped_on_recovery += v.bad.n;
    rk_store_key_list_free(&v.bad);
    if (st != RK_OK) return st;

    /* files without a row (any model's row keeps its file, and a tombstone
     * keeps a removed row's file from getting it back) and *.tmp */
    key_list keys = {0};
    uint64_t found = 0;
    st = all_keys(s, &keys);
    if (st == RK_OK) st = clear_tombstones(s, &keys);
    if (st == RK_OK) st = scan_files(s, &keys, 1, s->opts.verify_on_open, &found);
    rk_store_key_list_free(&keys);
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
    st = rc == SQLITE_DONE ? RK_OK : rk_store_sql_error(s, rc, "count other models' rows");
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

/* ---------------------------------------------------------------- rebuild */

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
    rk_status st = rk_store_file_path(s, "chunks.db", db, sizeof db);
    if (st == RK_OK) st = rk_store_file_path(s, "chunks.db-wal", wal, sizeof wal);
    if (st == RK_OK) st = rk_store_file_path(s, "chunks.db-shm", shm, sizeof shm);
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
    if ((st = rk_store_file_path(s, r->set_aside, aside, sizeof aside)) != RK_OK) return st;
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
    rk_status st = rk_store_alloc(dir, &s);
    if (st != RK_OK) return st;
    char db[PATH_MAX];
    struct stat sb;
    st = rk_store_file_path(s, "chunks.db", db, sizeof db);
    if (st == RK_OK && stat(db, &sb) != 0 && stat(s->kv_dir, &sb) != 0)
        st = rk_errorf(RK_ERR_NOT_FOUND, "%s: no chunk store here (no chunks.db, no kv/)", dir);
    if (st == RK_OK) st = rk_store_take_lock(s);
    if (st == RK_OK) st = set_db_aside(s, out);
    if (st == RK_OK) st = rk_store_open_db(s);
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
