/* store/open.c — opening and closing the chunk store: the schema and its
 * migrations, the prepared statements, the directory lock, creating
 * chunks.db whole, rk_store_open (which runs recovery, store/recover.c),
 * rk_store_open_readonly and rk_store_close. */
#include "store/store.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sqlite3.h>

#include "store/internal.h"

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
    /* 1 -> 2: tombstones, the keys of removed rows whose payload file may
     * still be there (it must not get its row back) */
    "CREATE TABLE tombstones (key TEXT PRIMARY KEY NOT NULL) WITHOUT ROWID;",
};
_Static_assert(STORE_APP_ID == 1380666198, "application id literal matches");

#define ROW_COLS                                                                                   \
    "key, model, policy, n_tokens, n_bytes, checksum, created, last_access, hits, doc_id"

/* The SQL of the prepared statements (ST_* in store/internal.h): the text for
 * read-write handles and its read-only twin. */
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
    [ST_TOMB_ADD] = {"INSERT OR IGNORE INTO tombstones (key) VALUES (?1)", NULL},
    [ST_TOMB_DEL] = {"DELETE FROM tombstones WHERE key = ?1", NULL},
    [ST_TOMB_KEYS] = {"SELECT key FROM tombstones ORDER BY key", NULL},
};

/* ---------------------------------------------------------------- open */

static char *path_join(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    char *p = malloc(na + nb + 2);
    if (!p) return NULL;
    memcpy(p, a, na);
    p[na] = '/';
    memcpy(p + na + 1, b, nb + 1);
    return p;
}

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
    rk_status st = rk_store_sql_int(s, "PRAGMA user_version", &version);
    if (st == RK_OK) st = rk_store_sql_int(s, "PRAGMA application_id", &app);
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
        rk_status st = rk_store_sql_exec(s, "BEGIN IMMEDIATE", what);
        if (st == RK_OK) st = rk_store_sql_exec(s, k_migrations[version], what);
        if (st == RK_OK) st = rk_store_sql_exec(s, setv, what);
        if (st == RK_OK) st = rk_store_sql_exec(s, "COMMIT", what);
        if (st != RK_OK) {
            if (!sqlite3_get_autocommit(s->db)) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
            return st;
        }
        RK_LOG_INFO("store %s: schema migrated to version %lld", s->dir, (long long)version + 1);
    }
    return RK_OK;
}

rk_status rk_store_open_db(rk_store *s) {
    char *db_path = path_join(s->dir, "chunks.db");
    if (!db_path) return rk_errorf(RK_ERR_NOMEM, "store: no memory");
    int flags = s->readonly ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE;
    int rc = sqlite3_open_v2(db_path, &s->db, flags, NULL);
    free(db_path);
    if (rc != SQLITE_OK) return rk_store_sql_error(s, rc, "open chunks.db");
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
        if (rc != SQLITE_OK) st = rk_store_sql_error(s, rc, "set WAL mode");
        sqlite3_finalize(q);
        if (st == RK_OK)
            st = rk_store_sql_exec(s, "PRAGMA synchronous = NORMAL", "set synchronous");
    }
    if (st == RK_OK && !s->readonly) st = migrate(s, version);
    for (int i = 0; st == RK_OK && i < ST_COUNT; i++) {
        const char *sql = s->readonly ? k_sql[i].ro : k_sql[i].rw;
        if (!sql) continue;
        rc = sqlite3_prepare_v3(s->db, sql, -1, SQLITE_PREPARE_PERSISTENT, &s->st[i], NULL);
        if (rc != SQLITE_OK) st = rk_store_sql_error(s, rc, "prepare a statement");
    }
    return st;
}

rk_status rk_store_alloc(const char *dir, rk_store **out) {
    *out = NULL;
    if (!dir || !*dir) return rk_errorf(RK_ERR_INVALID, "store: empty directory name");
    rk_store *s = calloc(1, sizeof *s);
    if (!s) return rk_errorf(RK_ERR_NOMEM, "store: no memory");
    s->lock_fd = -1;
    s->dir = rk_strdup(dir);
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
rk_status rk_store_take_lock(rk_store *s) {
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
rk_status rk_store_file_path(const rk_store *s, const char *name, char *buf, size_t cap) {
    if (snprintf(buf, cap, "%s/%s", s->dir, name) >= (int)cap)
        return rk_errorf(RK_ERR_LIMIT, "store %s: path too long", s->dir);
    return RK_OK;
}

/* Set *out_missing when chunks.db does not exist or is empty: its rows are
 * then rebuilt from the payload files. A write-ahead log left without its
 * database cannot be applied to a new one: it goes to quarantine/. */
static rk_status db_missing(rk_store *s, int *out_missing) {
    char db[PATH_MAX], wal[PATH_MAX], shm[PATH_MAX];
    rk_status st = rk_store_file_path(s, "chunks.db", db, sizeof db);
    if (st == RK_OK) st = rk_store_file_path(s, "chunks.db-wal", wal, sizeof wal);
    if (st == RK_OK) st = rk_store_file_path(s, "chunks.db-shm", shm, sizeof shm);
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
            rk_store_quarantine_file(s, wal, "chunks.db-wal");
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
    rk_status st = rk_store_file_path(s, "chunks.db", db, sizeof db);
    if (st == RK_OK) st = rk_store_file_path(s, "chunks.db.new", tmp, sizeof tmp);
    if (st != RK_OK) return st;
    if (unlink(tmp) != 0 && errno != ENOENT)
        return rk_errorf(RK_ERR_IO, "%s: unlink: %s", tmp, strerror(errno));
    int rc = sqlite3_open_v2(tmp, &s->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, NULL);
    st = rc == SQLITE_OK ? RK_OK : rk_store_sql_error(s, rc, "create chunks.db");
    if (st == RK_OK) st = rk_store_sql_exec(s, "PRAGMA journal_mode = WAL", "set WAL mode");
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
    rk_status st = rk_store_alloc(dir, &s);
    if (st != RK_OK) return st;
    memcpy(s->fingerprint, model_fingerprint, sizeof s->fingerprint);
    if (opts)
        s->opts = *opts;
    else
        rk_store_options_default(&s->opts);

    st = mkdir_p(dir);
    if (st == RK_OK && mkdir(s->kv_dir, 0755) != 0 && errno != EEXIST)
        st = rk_errorf(RK_ERR_IO, "%s: mkdir: %s", s->kv_dir, strerror(errno));
    if (st == RK_OK) st = rk_store_take_lock(s);
    int missing = 0;
    if (st == RK_OK) st = db_missing(s, &missing);
    if (st == RK_OK && missing) st = create_db(s);
    if (st == RK_OK) st = rk_store_open_db(s);
    int64_t last = 0;
    if (st == RK_OK)
        st = rk_store_sql_int(s,
                              "SELECT CAST(COALESCE(MAX(last_access), 0) * 1000000 AS INTEGER)"
                              " FROM chunks",
                              &last);
    s->last_stamp = (double)last * 1e-6;
    if (st == RK_OK) st = rk_store_recover(s);
    if (st == RK_OK) st = rk_store_load_totals(s);
    if (st == RK_OK) st = rk_store_enforce_budget(s); /* the budget may have shrunk since */
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

rk_status rk_store_open_readonly(const char *dir, rk_store **out) {
    if (!out) return rk_errorf(RK_ERR_INVALID, "store: NULL output");
    *out = NULL;
    rk_store *s = NULL;
    rk_status st = rk_store_alloc(dir, &s);
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
    if (st == RK_OK) st = rk_store_open_db(s);
    if (st == RK_OK) st = rk_store_load_totals(s);
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
    rk_store_key_list_free(&s->batch_written);
    rk_store_key_list_free(&s->pending_unlink);
    rk_store_key_list_free(&s->writing);
    free(s->dir);
    free(s->kv_dir);
    free(s);
}
