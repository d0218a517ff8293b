/* store/report.c — the chunk store's offline reports: the row listing, the
 * totals and counters, and verify, as `ragkv cache ls|stats|verify` print
 * them. */
#include "store/store.h"

#include <dirent.h>
#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <time.h>

#include <sqlite3.h>

#include "store/internal.h"

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
    if (rk_store_file_path(s, "quarantine", qdir, sizeof qdir) != RK_OK) return 0;
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
    if (rc != SQLITE_OK) return rk_store_sql_error(s, rc, "per-model totals");
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
    st = rc == SQLITE_DONE ? RK_OK : rk_store_sql_error(s, rc, "per-model totals");
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
