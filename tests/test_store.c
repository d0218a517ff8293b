/* tests/test_store.c — the persistent chunk store on real files: round trips
 * across a restart, listing and counters, every kind of corruption (found at
 * open and at load, never served), other models' rows, hostile keys, write
 * failures (read-only directory, file size limit, an I/O error injected at
 * every call of a put and a get), SIGKILL in the middle of writes, the disk
 * budget, batches, schema versions, and recovery that loses nothing: a
 * removed, emptied or corrupt database rebuilt from the payload files, bad
 * payloads quarantined, unreadable directories skipped. */
#include <criterion/criterion.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include "pipeline/persist.h"
#include "store/store.h"
#include "tests/testutil.h"

#define FP_A "0123456789abcdef0123456789abcdef"
#define FP_B "fedcba9876543210fedcba9876543210"

/* Bytes of the payload header in front of the token ids. */
#define H RK_STORE_HEADER_BYTES

#define ASSERT_OK(expr)                                                                            \
    do {                                                                                           \
        rk_status st__ = (expr);                                                                   \
        cr_assert_eq(st__, RK_OK, "%s: %s (%s)", #expr, rk_status_str(st__), rk_error_message());  \
    } while (0)

/* snprintf into a char array, failing the test when the path does not fit. */
#define PATHF(buf, ...) cr_assert(snprintf(buf, sizeof buf, __VA_ARGS__) < (int)sizeof buf)

/* ---------------------------------------------------------------- fixtures */

static uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* A chunk whose every byte follows from its seed. */
typedef struct chunk {
    char key[RK_STORE_KEY_LEN + 1];
    char doc_id[32];
    rk_store_layout layout;
    int32_t n_tokens;
    int32_t *tokens;
    uint8_t *body;
    size_t body_size;
} chunk;

static void make_key(uint64_t seed, char out[RK_STORE_KEY_LEN + 1]) {
    snprintf(out, RK_STORE_KEY_LEN + 1, "%016llx%016llx", (unsigned long long)mix(seed),
             (unsigned long long)mix(seed ^ 0x5555));
}

static void chunk_make(chunk *c, uint64_t seed, int32_t n_tokens, size_t body_size) {
    memset(c, 0, sizeof *c);
    make_key(seed, c->key);
    snprintf(c->doc_id, sizeof c->doc_id, "doc-%llu", (unsigned long long)seed);
    c->layout = (rk_store_layout){.n_layers = 2 + (int)(seed % 5),
                                  .n_kv_heads = 4,
                                  .head_dim = 64,
                                  .dtype = 1,
                                  .block_size = 16,
                                  .base_pos = (int)(seed % 7)};
    c->n_tokens = n_tokens;
    c->tokens = malloc((size_t)n_tokens * sizeof *c->tokens);
    cr_assert_not_null(c->tokens);
    for (int i = 0; i < n_tokens; i++) c->tokens[i] = (int32_t)(mix(seed * 1000003 + i) % 150000);
    c->body_size = body_size;
    c->body = body_size ? malloc(body_size) : NULL;
    cr_assert(body_size == 0 || c->body);
    uint64_t x = seed;
    for (size_t i = 0; i < body_size; i++) {
        if (i % 8 == 0) x = mix(x);
        c->body[i] = (uint8_t)(x >> (8 * (i % 8)));
    }
}

static void chunk_free(chunk *c) {
    free(c->tokens);
    free(c->body);
    memset(c, 0, sizeof *c);
}

static uint64_t chunk_file_bytes(const chunk *c) {
    return RK_STORE_HEADER_BYTES + 4 * (uint64_t)c->n_tokens + c->body_size;
}

static rk_store_put_args chunk_args(const chunk *c) {
    return (rk_store_put_args){.key = c->key,
                               .policy = "isolated",
                               .doc_id = c->doc_id,
                               .layout = c->layout,
                               .tokens = c->tokens,
                               .n_tokens = c->n_tokens,
                               .body = c->body,
                               .body_size = c->body_size};
}

static rk_status put_chunk(rk_store *s, const chunk *c) {
    rk_store_put_args a = chunk_args(c);
    return rk_store_put(s, &a);
}

/* Load c's key and check every byte, the layout and the metadata. */
static void expect_chunk(rk_store *s, const chunk *c) {
    rk_store_payload p;
    rk_status st = rk_store_get(s, c->key, &p);
    cr_assert_eq(st, RK_OK, "get %s: %s", c->key, rk_error_message());
    cr_assert_str_eq(p.meta.key, c->key);
    cr_assert_str_eq(p.meta.model, FP_A);
    cr_assert_str_eq(p.meta.policy, "isolated");
    cr_assert_str_eq(p.meta.doc_id, c->doc_id);
    cr_assert_eq(p.meta.n_tokens, c->n_tokens);
    cr_assert_eq(p.meta.n_bytes, chunk_file_bytes(c));
    cr_assert_eq(memcmp(&p.layout, &c->layout, sizeof p.layout), 0, "layout differs");
    cr_assert_eq(memcmp(p.tokens, c->tokens, (size_t)c->n_tokens * 4), 0, "tokens differ");
    cr_assert_eq(p.body_size, c->body_size);
    if (c->body_size) cr_assert_eq(memcmp(p.body, c->body, c->body_size), 0, "body differs");
    rk_store_payload_free(&p);
    cr_assert_null(p.tokens);
}

static rk_store *open_store(const char *dir, const char *fp, int verify_on_open) {
    rk_store_options o;
    rk_store_options_default(&o);
    o.verify_on_open = verify_on_open;
    rk_store *s = NULL;
    ASSERT_OK(rk_store_open(dir, fp, &o, &s));
    return s;
}

static rk_store_counters stats_of(rk_store *s) {
    rk_store_counters c;
    ASSERT_OK(rk_store_stats(s, &c));
    return c;
}

static int present(rk_store *s, const char *key) {
    int p = -1;
    ASSERT_OK(rk_store_contains(s, key, &p));
    return p;
}

static char *payload_path(rk_store *s, const char *key) {
    static char path[4096];
    ASSERT_OK(rk_store_payload_path(s, key, path, sizeof path));
    return path;
}

static int file_exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

/* Count files under dir/kv whose names end in suffix. */
static int count_files(const char *dir, const char *suffix) {
    char kv[4096];
    snprintf(kv, sizeof kv, "%s/kv", dir);
    DIR *top = opendir(kv);
    if (!top) return 0;
    int n = 0;
    struct dirent *d;
    while ((d = readdir(top)) != NULL) {
        if (d->d_name[0] == '.') continue;
        char sub[4200];
        PATHF(sub, "%s/%s", kv, d->d_name);
        DIR *dd = opendir(sub);
        if (!dd) continue;
        struct dirent *f;
        while ((f = readdir(dd)) != NULL) {
            if (f->d_name[0] == '.') continue;
            size_t len = strlen(f->d_name), ls = strlen(suffix);
            if (len > ls && strcmp(f->d_name + len - ls, suffix) == 0) n++;
        }
        closedir(dd);
    }
    closedir(top);
    return n;
}

/* Count files in dir/quarantine whose names start with prefix. */
static int count_quarantined(const char *dir, const char *prefix) {
    char q[4096];
    snprintf(q, sizeof q, "%s/quarantine", dir);
    DIR *d = opendir(q);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    closedir(d);
    return n;
}

/* Count the open file descriptors of this process. */
static int count_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    cr_assert_not_null(d);
    int n = 0;
    while (readdir(d) != NULL) n++;
    closedir(d);
    return n;
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

/* Remove a test directory once the test has passed. */
static void rm_rf(char *dir) {
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    free(dir);
}

static void flip_byte(const char *path, long offset) {
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    cr_assert_eq(fseek(f, offset, SEEK_SET), 0);
    int ch = fgetc(f);
    cr_assert_neq(ch, EOF);
    cr_assert_eq(fseek(f, offset, SEEK_SET), 0);
    fputc(ch ^ 0x40, f);
    cr_assert_eq(fclose(f), 0);
}

static void sql_on(const char *dir, const char *sql) {
    char path[4096];
    snprintf(path, sizeof path, "%s/chunks.db", dir);
    sqlite3 *db = NULL;
    cr_assert_eq(sqlite3_open(path, &db), SQLITE_OK);
    char *err = NULL;
    cr_assert_eq(sqlite3_exec(db, sql, NULL, NULL, &err), SQLITE_OK, "%s: %s", sql,
                 err ? err : "?");
    sqlite3_close(db);
}

static long long sql_int_on(const char *dir, const char *sql) {
    char path[4096];
    snprintf(path, sizeof path, "%s/chunks.db", dir);
    sqlite3 *db = NULL;
    sqlite3_stmt *q = NULL;
    cr_assert_eq(sqlite3_open(path, &db), SQLITE_OK);
    cr_assert_eq(sqlite3_prepare_v2(db, sql, -1, &q, NULL), SQLITE_OK, "%s", sqlite3_errmsg(db));
    cr_assert_eq(sqlite3_step(q), SQLITE_ROW);
    long long v = sqlite3_column_int64(q, 0);
    sqlite3_finalize(q);
    sqlite3_close(db);
    return v;
}

/* ---------------------------------------------------------------- round trips */

Test(store, put_survives_a_restart_with_identical_bytes) {
    char *dir = rk_test_tmpdir("store-restart");
    chunk c[3];
    chunk_make(&c[0], 1, 512, 1 << 20);
    chunk_make(&c[1], 2, 1, 0); /* one token, empty body */
    chunk_make(&c[2], 3, 77, 12345);
    rk_store *s = open_store(dir, FP_A, 1);
    for (int i = 0; i < 3; i++) ASSERT_OK(put_chunk(s, &c[i]));
    rk_store_close(s);

    s = open_store(dir, FP_A, 1);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.rows, 3);
    cr_assert_eq(st.dropped_on_recovery, 0);
    cr_assert_eq(st.orphans_removed, 0);
    for (int i = 0; i < 3; i++) expect_chunk(s, &c[i]);

    /* the file starts with the magic and has exactly header + tokens + body bytes */
    const char *path = payload_path(s, c[2].key);
    size_t len = 0;
    char *raw = rk_test_read_file(path, &len);
    cr_assert_not_null(raw);
    cr_assert_eq(memcmp(raw, "RKKV", 4), 0);
    cr_assert_eq(len, H + 4 * 77 + 12345);
    cr_assert_eq(memcmp(raw + H, c[2].tokens, 4 * 77), 0);
    free(raw);
    char want_tail[80];
    snprintf(want_tail, sizeof want_tail, "/kv/%.2s/%s.kv", c[2].key, c[2].key);
    cr_assert(strstr(path, want_tail), "payload path %s", path);

    rk_store_close(s);
    for (int i = 0; i < 3; i++) chunk_free(&c[i]);
    rm_rf(dir);
}

Test(store, put_of_an_existing_key_is_idempotent) {
    char *dir = rk_test_tmpdir("store-idem");
    chunk c, other;
    chunk_make(&c, 10, 32, 1000);
    chunk_make(&other, 11, 40, 2000);
    memcpy(other.key, c.key, sizeof c.key); /* same key, different content */
    rk_store *s = open_store(dir, FP_A, 1);
    ASSERT_OK(put_chunk(s, &c));
    ASSERT_OK(put_chunk(s, &c));
    ASSERT_OK(put_chunk(s, &other));
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.rows, 1);
    cr_assert_eq(st.writes, 1);
    cr_assert_eq(count_files(dir, ".kv"), 1);
    expect_chunk(s, &c); /* the first row and file are kept */
    rk_store_close(s);
    chunk_free(&c);
    chunk_free(&other);
    rm_rf(dir);
}

Test(store, list_sorts_by_hits_and_by_recent_access) {
    char *dir = rk_test_tmpdir("store-list");
    chunk c[3];
    rk_store *s = open_store(dir, FP_A, 1);
    for (int i = 0; i < 3; i++) {
        chunk_make(&c[i], 20 + (uint64_t)i, 8, 100);
        ASSERT_OK(put_chunk(s, &c[i]));
    }
    rk_store_payload p;
    for (int i = 0; i < 3; i++) {
        ASSERT_OK(rk_store_get(s, c[1].key, &p));
        rk_store_payload_free(&p);
    }
    ASSERT_OK(rk_store_get(s, c[0].key, &p));
    rk_store_payload_free(&p);

    rk_store_entry *v = NULL;
    int n = 0;
    ASSERT_OK(rk_store_list(s, RK_STORE_SORT_HITS, 0, 0, &v, &n));
    cr_assert_eq(n, 3);
    cr_assert_str_eq(v[0].key, c[1].key);
    cr_assert_eq(v[0].hits, 3);
    cr_assert_str_eq(v[1].key, c[0].key);
    cr_assert_eq(v[1].hits, 1);
    cr_assert_str_eq(v[2].key, c[2].key);
    cr_assert_eq(v[2].hits, 0);
    cr_assert_str_eq(v[2].doc_id, c[2].doc_id);
    cr_assert_eq(v[2].n_bytes, H + 32 + 100);
    free(v);

    ASSERT_OK(rk_store_list(s, RK_STORE_SORT_RECENT, 0, 0, &v, &n));
    cr_assert_eq(n, 3);
    cr_assert_str_eq(v[0].key, c[0].key); /* read last */
    cr_assert_str_eq(v[1].key, c[1].key);
    cr_assert_str_eq(v[2].key, c[2].key); /* written last, never read */
    cr_assert(v[0].last_access > v[1].last_access && v[1].last_access > v[2].last_access);
    free(v);

    ASSERT_OK(rk_store_list(s, RK_STORE_SORT_HITS, 1, 1, &v, &n));
    cr_assert_eq(n, 1);
    cr_assert_str_eq(v[0].key, c[0].key);
    free(v);
    ASSERT_OK(rk_store_list(s, RK_STORE_SORT_HITS, 10, 3, &v, &n));
    cr_assert_eq(n, 0);
    cr_assert_null(v);

    rk_store_entry e;
    ASSERT_OK(rk_store_lookup(s, c[1].key, &e));
    cr_assert_eq(e.hits, 3);
    cr_assert_str_eq(e.policy, "isolated");
    rk_store_close(s);
    for (int i = 0; i < 3; i++) chunk_free(&c[i]);
    rm_rf(dir);
}

Test(store, delete_removes_row_and_file) {
    char *dir = rk_test_tmpdir("store-delete");
    chunk a, b;
    chunk_make(&a, 30, 16, 500);
    chunk_make(&b, 31, 16, 500);
    rk_store *s = open_store(dir, FP_A, 1);
    ASSERT_OK(put_chunk(s, &a));
    ASSERT_OK(put_chunk(s, &b));
    char path[4096];
    snprintf(path, sizeof path, "%s", payload_path(s, a.key));
    cr_assert(file_exists(path));
    ASSERT_OK(rk_store_delete(s, a.key, NULL));
    cr_assert_eq(present(s, a.key), 0);
    cr_assert(!file_exists(path));
    rk_store_payload p;
    cr_assert_eq(rk_store_get(s, a.key, &p), RK_ERR_NOT_FOUND);
    cr_assert_eq(rk_store_delete(s, a.key, NULL), RK_ERR_NOT_FOUND);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.deletes, 1);
    cr_assert_eq(st.rows, 1);
    expect_chunk(s, &b);
    rk_store_close(s);
    chunk_free(&a);
    chunk_free(&b);
    rm_rf(dir);
}

/* A put in three steps (the service writes the file on a thread of its
 * own): the row commits only at the end, after the file is on disk; a
 * second begin of the key while its write is under way writes nothing; a
 * delete or flush between the begin and the end keeps the write from
 * bringing the chunk back; a write left without its end (a crash) gets its
 * row back at the next open. */
Test(store, a_put_in_three_steps_commits_its_row_only_at_the_end) {
    char *dir = rk_test_tmpdir("store-put3");
    chunk a, b, c;
    chunk_make(&a, 40, 16, 700);
    chunk_make(&b, 41, 16, 700);
    chunk_make(&c, 42, 16, 700);
    rk_store *s = open_store(dir, FP_A, 1);
    rk_store_put_args args = chunk_args(&a);
    rk_store_write *w, *again;
    ASSERT_OK(rk_store_put_begin(s, &args, &w));
    cr_assert_not_null(w);
    ASSERT_OK(rk_store_put_begin(s, &args, &again));
    cr_assert_null(again, "a second begin of a key under way writes nothing");
    ASSERT_OK(rk_store_put_write(w));
    char path[4096];
    snprintf(path, sizeof path, "%s", payload_path(s, a.key));
    cr_assert(file_exists(path), "the file is written before the end");
    cr_assert_eq(present(s, a.key), 0, "no row before the end");
    ASSERT_OK(rk_store_put_end(s, w, RK_OK));
    expect_chunk(s, &a);
    cr_assert_eq(stats_of(s).writes, 1);

    /* Flushed while its file was written: nothing comes back. */
    args = chunk_args(&b);
    ASSERT_OK(rk_store_put_begin(s, &args, &w));
    ASSERT_OK(rk_store_flush(s, NULL));
    ASSERT_OK(rk_store_put_write(w));
    ASSERT_OK(rk_store_put_end(s, w, RK_OK));
    cr_assert_eq(present(s, b.key), 0);
    cr_assert(!file_exists(payload_path(s, b.key)), "the flushed write's file is removed");
    cr_assert_eq(stats_of(s).rows, 0);

    /* A failed write ends with its error and leaves nothing. */
    args = chunk_args(&b);
    ASSERT_OK(rk_store_put_begin(s, &args, &w));
    cr_assert_eq(rk_store_put_end(s, w, RK_ERR_IO), RK_ERR_IO);
    cr_assert_eq(present(s, b.key), 0);
    ASSERT_OK(put_chunk(s, &b)); /* and the key can be written again */
    expect_chunk(s, &b);

    /* Written, never ended (the process died): the next open rebuilds its row. */
    args = chunk_args(&c);
    ASSERT_OK(rk_store_put_begin(s, &args, &w));
    ASSERT_OK(rk_store_put_write(w));
    rk_store_put_abandon(s, w);
    rk_store_close(s);
    s = open_store(dir, FP_A, 1);
    expect_chunk(s, &c);
    expect_chunk(s, &b);
    rk_store_close(s);
    chunk_free(&a);
    chunk_free(&b);
    chunk_free(&c);
    rm_rf(dir);
}

Test(store, stats_counters_are_exact) {
    char *dir = rk_test_tmpdir("store-stats");
    chunk c[3];
    chunk_make(&c[0], 40, 10, 1000); /* H + 40 + 1000 bytes */
    chunk_make(&c[1], 41, 20, 2000); /* H + 80 + 2000 */
    chunk_make(&c[2], 42, 30, 3000); /* H + 120 + 3000 */
    rk_store *s = open_store(dir, FP_A, 1);
    for (int i = 0; i < 3; i++) ASSERT_OK(put_chunk(s, &c[i]));
    ASSERT_OK(put_chunk(s, &c[0])); /* idempotent: no write */
    rk_store_payload p;
    ASSERT_OK(rk_store_get(s, c[1].key, &p));
    rk_store_payload_free(&p);
    ASSERT_OK(rk_store_get(s, c[1].key, &p));
    rk_store_payload_free(&p);
    ASSERT_OK(rk_store_get(s, c[2].key, &p));
    rk_store_payload_free(&p);
    ASSERT_OK(rk_store_delete(s, c[0].key, NULL));
    char missing[33];
    make_key(999, missing);
    cr_assert_eq(rk_store_get(s, missing, &p), RK_ERR_NOT_FOUND);

    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.rows, 2);
    cr_assert_eq(st.bytes, (H + 2080) + (H + 3120));
    cr_assert_eq(st.writes, 3);
    cr_assert_eq(st.write_bytes, (H + 1040) + (H + 2080) + (H + 3120));
    cr_assert_eq(st.loads, 3);
    cr_assert_eq(st.load_bytes, (H + 2080) * 2 + (H + 3120));
    cr_assert_eq(st.deletes, 1);
    cr_assert_eq(st.dropped_on_load, 0);
    cr_assert_eq(st.dropped_on_recovery, 0);
    cr_assert_eq(st.other_model_rows, 0);
    cr_assert_eq(st.evictions, 0);
    rk_store_close(s);

    /* the totals survive a restart; the per-session counters start again */
    s = open_store(dir, FP_A, 1);
    st = stats_of(s);
    cr_assert_eq(st.rows, 2);
    cr_assert_eq(st.bytes, (H + 2080) + (H + 3120));
    cr_assert_eq(st.writes, 0);
    cr_assert_eq(st.loads, 0);
    rk_store_close(s);
    for (int i = 0; i < 3; i++) chunk_free(&c[i]);
    rm_rf(dir);
}

/* ---------------------------------------------------------------- corruption */

typedef enum damage {
    TRUNCATE,
    FLIP_BODY,
    FLIP_TOKEN,
    FLIP_HEADER,
    DELETE_FILE,
} damage;

static void do_damage(const char *path, damage d, const chunk *c) {
    switch (d) {
    case TRUNCATE: cr_assert_eq(truncate(path, (off_t)chunk_file_bytes(c) - 100), 0); break;
    case FLIP_BODY: flip_byte(path, H + 4 * c->n_tokens + (long)c->body_size / 2); break;
    case FLIP_TOKEN: flip_byte(path, H + 4 * 3 + 1); break;
    case FLIP_HEADER: flip_byte(path, 84); break; /* n_layers */
    case DELETE_FILE: cr_assert_eq(unlink(path), 0); break;
    }
}

#define N_CORRUPT 4

/* Store four chunks, damage the second, and check it is found at open (with
 * verify_on_open) or at load (damage done while the store is open), dropped,
 * counted and never served, while the others stay readable. */
static void corruption_case(damage d, int at_open) {
    char *dir = rk_test_tmpdir("store-corrupt");
    chunk c[N_CORRUPT];
    rk_store *s = open_store(dir, FP_A, at_open);
    for (int i = 0; i < N_CORRUPT; i++) {
        chunk_make(&c[i], 50 + (uint64_t)i, 64, 8192);
        ASSERT_OK(put_chunk(s, &c[i]));
    }
    char path[4096];
    snprintf(path, sizeof path, "%s", payload_path(s, c[1].key));
    rk_store_payload p;
    if (at_open) {
        rk_store_close(s);
        do_damage(path, d, &c[1]);
        s = open_store(dir, FP_A, 1);
        rk_store_counters st = stats_of(s);
        cr_assert_eq(st.dropped_on_recovery, 1);
        cr_assert_eq(st.rows, N_CORRUPT - 1);
        cr_assert_eq(present(s, c[1].key), 0);
        cr_assert_eq(rk_store_get(s, c[1].key, &p), RK_ERR_NOT_FOUND);
        cr_assert_null(p.tokens);
        cr_assert_eq(stats_of(s).dropped_on_load, 0);
    } else {
        do_damage(path, d, &c[1]);
        rk_store_verify_result vr;
        ASSERT_OK(rk_store_verify(s, 0, NULL, NULL, &vr));
        cr_assert_eq(vr.checked, N_CORRUPT);
        cr_assert_eq(vr.bad, 1);
        cr_assert_eq(vr.deleted, 0);
        cr_assert_eq(present(s, c[1].key), 1); /* verify does not delete unless asked */
        rk_status st = rk_store_get(s, c[1].key, &p);
        cr_assert_eq(st, RK_ERR_NOT_FOUND, "bad payload served: %s", rk_status_str(st));
        cr_assert(strstr(rk_error_message(), "dropped"), "message: %s", rk_error_message());
        cr_assert_null(p.tokens);
        cr_assert_null(p.body);
        rk_store_counters cs = stats_of(s);
        cr_assert_eq(cs.dropped_on_load, 1);
        cr_assert_eq(cs.dropped_on_recovery, 0);
        cr_assert_eq(cs.rows, N_CORRUPT - 1);
        cr_assert_eq(cs.loads, 0);
        cr_assert_eq(present(s, c[1].key), 0);
        cr_assert_eq(rk_store_get(s, c[1].key, &p), RK_ERR_NOT_FOUND);
        cr_assert_eq(stats_of(s).dropped_on_load, 1); /* counted once */
    }
    cr_assert(!file_exists(path), "bad payload file left behind");
    /* moved aside for inspection, never deleted */
    int kept = d == DELETE_FILE ? 0 : 1;
    cr_assert_eq(stats_of(s).quarantined, (uint64_t)kept);
    cr_assert_eq(stats_of(s).corrupt_after_open, at_open ? 0u : 1u);
    cr_assert_eq(count_quarantined(dir, c[1].key), kept);
    for (int i = 0; i < N_CORRUPT; i++)
        if (i != 1) expect_chunk(s, &c[i]);
    rk_store_close(s);
    /* gone for good: a restart does not bring it back */
    s = open_store(dir, FP_A, 1);
    cr_assert_eq(present(s, c[1].key), 0);
    cr_assert_eq(stats_of(s).dropped_on_recovery, 0);
    rk_store_close(s);
    for (int i = 0; i < N_CORRUPT; i++) chunk_free(&c[i]);
    rm_rf(dir);
}

Test(store_corruption, truncated_payload_is_dropped_at_open) { corruption_case(TRUNCATE, 1); }
Test(store_corruption, truncated_payload_is_dropped_at_load) { corruption_case(TRUNCATE, 0); }
Test(store_corruption, flipped_body_byte_is_dropped_at_open) { corruption_case(FLIP_BODY, 1); }
Test(store_corruption, flipped_body_byte_is_dropped_at_load) { corruption_case(FLIP_BODY, 0); }
Test(store_corruption, flipped_token_byte_is_dropped_at_open) { corruption_case(FLIP_TOKEN, 1); }
Test(store_corruption, flipped_token_byte_is_dropped_at_load) { corruption_case(FLIP_TOKEN, 0); }
Test(store_corruption, flipped_header_byte_is_dropped_at_open) { corruption_case(FLIP_HEADER, 1); }
Test(store_corruption, flipped_header_byte_is_dropped_at_load) { corruption_case(FLIP_HEADER, 0); }
Test(store_corruption, deleted_payload_is_dropped_at_open) { corruption_case(DELETE_FILE, 1); }
Test(store_corruption, deleted_payload_is_dropped_at_load) { corruption_case(DELETE_FILE, 0); }

Test(store_corruption, open_without_verify_skips_checksums_and_load_catches_them) {
    char *dir = rk_test_tmpdir("store-noverify");
    chunk a, b;
    chunk_make(&a, 60, 64, 8192);
    chunk_make(&b, 61, 64, 8192);
    rk_store *s = open_store(dir, FP_A, 0);
    ASSERT_OK(put_chunk(s, &a));
    ASSERT_OK(put_chunk(s, &b));
    char pa[4096], pb[4096];
    snprintf(pa, sizeof pa, "%s", payload_path(s, a.key));
    snprintf(pb, sizeof pb, "%s", payload_path(s, b.key));
    rk_store_close(s);
    flip_byte(pa, H + 4 * 64 + 100); /* body */
    flip_byte(pb, H + 8);            /* token ids */

    s = open_store(dir, FP_A, 0); /* sizes and headers only: both pass */
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.dropped_on_recovery, 0);
    cr_assert_eq(st.rows, 2);
    rk_store_payload p;
    cr_assert_eq(rk_store_get(s, a.key, &p), RK_ERR_NOT_FOUND);
    cr_assert(strstr(rk_error_message(), "checksum mismatch"), "%s", rk_error_message());
    cr_assert_eq(rk_store_get(s, b.key, &p), RK_ERR_NOT_FOUND);
    st = stats_of(s);
    cr_assert_eq(st.dropped_on_load, 2);
    cr_assert_eq(st.rows, 0);
    cr_assert_eq(count_files(dir, ".kv"), 0);
    rk_store_close(s);
    chunk_free(&a);
    chunk_free(&b);
    rm_rf(dir);
}

Test(store_recovery, row_deleted_behind_our_back_is_rebuilt_from_its_payload_at_open) {
    char *dir = rk_test_tmpdir("store-orphan");
    chunk c[3];
    rk_store *s = open_store(dir, FP_A, 1);
    for (int i = 0; i < 3; i++) {
        chunk_make(&c[i], 70 + (uint64_t)i, 16, 300);
        ASSERT_OK(put_chunk(s, &c[i]));
    }
    char path[4096];
    snprintf(path, sizeof path, "%s", payload_path(s, c[0].key));
    rk_store_close(s);
    char sql[128];
    snprintf(sql, sizeof sql, "DELETE FROM chunks WHERE key = '%s'", c[0].key);
    sql_on(dir, sql);
    cr_assert(file_exists(path));

    s = open_store(dir, FP_A, 1);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.orphans_removed, 0);
    cr_assert_eq(st.rows_rebuilt, 1);
    cr_assert_eq(st.quarantined, 0);
    cr_assert_eq(st.dropped_on_recovery, 0);
    cr_assert_eq(st.rows, 3);
    cr_assert(file_exists(path), "payload without a row was removed");
    for (int i = 0; i < 3; i++) expect_chunk(s, &c[i]);
    rk_store_close(s);
    for (int i = 0; i < 3; i++) chunk_free(&c[i]);
    rm_rf(dir);
}

Test(store_recovery, stray_tmp_files_are_removed_and_foreign_files_kept) {
    char *dir = rk_test_tmpdir("store-tmp");
    chunk c;
    chunk_make(&c, 80, 16, 300);
    rk_store *s = open_store(dir, FP_A, 1);
    ASSERT_OK(put_chunk(s, &c));
    rk_store_close(s);
    char tmp1[4200], tmp2[4200], foreign[4200], sub[4200];
    snprintf(tmp1, sizeof tmp1, "%s/kv/%.2s/%s.kv.tmp", dir, c.key, c.key);
    snprintf(sub, sizeof sub, "%s/kv/ff", dir);
    mkdir(sub, 0755);
    PATHF(tmp2, "%s/ffffffffffffffffffffffffffffffff.kv.tmp", sub);
    PATHF(foreign, "%s/notes.txt", sub);
    const char *paths[] = {tmp1, tmp2, foreign};
    for (int i = 0; i < 3; i++) {
        FILE *f = fopen(paths[i], "wb");
        cr_assert_not_null(f);
        fputs("half-written", f);
        fclose(f);
    }
    s = open_store(dir, FP_A, 1);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.orphans_removed, 2);
    cr_assert(!file_exists(tmp1));
    cr_assert(!file_exists(tmp2));
    cr_assert(file_exists(foreign), "a file the store did not write was removed");
    cr_assert_eq(count_files(dir, ".tmp"), 0);
    expect_chunk(s, &c);
    rk_store_close(s);
    chunk_free(&c);
    rm_rf(dir);
}

/* ---------------------------------------------------------------- models, keys */

Test(store, another_fingerprint_serves_nothing_and_keeps_the_rows) {
    char *dir = rk_test_tmpdir("store-models");
    chunk c[3], mine;
    rk_store *s = open_store(dir, FP_A, 1);
    for (int i = 0; i < 3; i++) {
        chunk_make(&c[i], 90 + (uint64_t)i, 16, 400);
        ASSERT_OK(put_chunk(s, &c[i]));
    }
    rk_store_close(s);

    s = open_store(dir, FP_B, 1);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.other_model_rows, 3);
    cr_assert_eq(st.rows, 0);
    cr_assert_eq(st.dropped_on_recovery, 0);
    cr_assert_eq(st.orphans_removed, 0);
    rk_store_payload p;
    rk_store_entry e;
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(present(s, c[i].key), 0);
        cr_assert_eq(rk_store_get(s, c[i].key, &p), RK_ERR_NOT_FOUND);
        cr_assert_eq(rk_store_lookup(s, c[i].key, &e), RK_ERR_NOT_FOUND);
        cr_assert_eq(rk_store_delete(s, c[i].key, NULL), RK_ERR_NOT_FOUND);
        /* storing the same key for this model is refused, not overwritten */
        cr_assert_eq(put_chunk(s, &c[i]), RK_ERR_INVALID);
    }
    rk_store_entry *v = NULL;
    int n = -1;
    ASSERT_OK(rk_store_list(s, RK_STORE_SORT_RECENT, 0, 0, &v, &n));
    cr_assert_eq(n, 0);
    chunk_make(&mine, 95, 8, 100);
    ASSERT_OK(put_chunk(s, &mine));
    rk_store_removal removed;
    ASSERT_OK(rk_store_flush(s, &removed)); /* flushes model B only */
    cr_assert_eq(removed.rows, 1);
    cr_assert_eq(removed.files_left, 0);
    ASSERT_OK(put_chunk(s, &mine));
    rk_store_verify_result vr;
    ASSERT_OK(rk_store_verify(s, 1, NULL, NULL, &vr));
    cr_assert_eq(vr.checked, 1);
    cr_assert_eq(vr.bad, 0);
    cr_assert_eq(vr.orphans, 0);
    rk_store_close(s);

    s = open_store(dir, FP_A, 1);
    st = stats_of(s);
    cr_assert_eq(st.rows, 3);
    cr_assert_eq(st.other_model_rows, 1);
    for (int i = 0; i < 3; i++) expect_chunk(s, &c[i]);
    cr_assert_eq(present(s, mine.key), 0);
    rk_store_close(s);
    for (int i = 0; i < 3; i++) chunk_free(&c[i]);
    chunk_free(&mine);
    rm_rf(dir);
}

Test(store, bad_keys_are_rejected_as_invalid) {
    char *dir = rk_test_tmpdir("store-keys");
    rk_store *s = open_store(dir, FP_A, 1);
    chunk c;
    chunk_make(&c, 100, 4, 16);
    const char *bad[] = {
        "../etc/passwd",
        "0123456789abcdef0123456789abcde",   /* 31 */
        "0123456789abcdef0123456789abcdef0", /* 33 */
        "0123456789ABCDEF0123456789abcdef",  /* uppercase */
        "0123456789abcdeg0123456789abcdef",  /* not hex */
        "../../../../../../../../etc/pass",  /* 32 characters, a path */
        "0123456789abcdef0123456789abcde/",
        "",
        NULL,
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        const char *k = bad[i];
        rk_store_put_args a = chunk_args(&c);
        a.key = k;
        rk_store_payload p;
        rk_store_entry e;
        int pr;
        char path[4096];
        cr_assert_eq(rk_store_put(s, &a), RK_ERR_INVALID, "put %s", k ? k : "NULL");
        cr_assert_eq(rk_store_get(s, k, &p), RK_ERR_INVALID);
        cr_assert_eq(rk_store_contains(s, k, &pr), RK_ERR_INVALID);
        cr_assert_eq(rk_store_lookup(s, k, &e), RK_ERR_INVALID);
        cr_assert_eq(rk_store_delete(s, k, NULL), RK_ERR_INVALID);
        cr_assert_eq(rk_store_payload_path(s, k, path, sizeof path), RK_ERR_INVALID);
        cr_assert_eq(rk_store_key_valid(k), 0);
    }
    cr_assert_eq(count_files(dir, ""), 0);
    cr_assert_eq(stats_of(s).rows, 0);

    /* other bad arguments */
    rk_store_put_args a = chunk_args(&c);
    a.policy = "has space";
    cr_assert_eq(rk_store_put(s, &a), RK_ERR_INVALID);
    a = chunk_args(&c);
    a.n_tokens = 0;
    cr_assert_eq(rk_store_put(s, &a), RK_ERR_INVALID);
    a = chunk_args(&c);
    a.layout.n_layers = -1;
    cr_assert_eq(rk_store_put(s, &a), RK_ERR_INVALID);
    rk_store_close(s);

    rk_store *t = NULL;
    cr_assert_eq(rk_store_open(dir, "0123456789ABCDEF0123456789abcdef", NULL, &t), RK_ERR_INVALID);
    cr_assert_eq(rk_store_open(dir, "short", NULL, &t), RK_ERR_INVALID);
    cr_assert_null(t);
    chunk_free(&c);
    rm_rf(dir);
}

Test(store, a_second_writer_on_the_same_directory_is_refused) {
    char *dir = rk_test_tmpdir("store-lock");
    rk_store *s = open_store(dir, FP_A, 1), *t = NULL;
    cr_assert_eq(rk_store_open(dir, FP_A, NULL, &t), RK_ERR_BUSY);
    cr_assert(strstr(rk_error_message(), "in use"), "%s", rk_error_message());
    cr_assert_null(t);
    /* a read-only look is fine meanwhile */
    ASSERT_OK(rk_store_open_readonly(dir, &t));
    rk_store_close(t);
    rk_store_close(s);
    s = open_store(dir, FP_A, 1); /* the lock went with the close */
    rk_store_close(s);
    rm_rf(dir);
}

/* ---------------------------------------------------------------- write failures */

/* Put a chunk that must fail and check nothing of it remains. */
static void expect_failed_put(rk_store *s, const char *dir, const chunk *c, const char *why) {
    rk_status st = put_chunk(s, c);
    cr_assert_eq(st, RK_ERR_IO, "put should fail with an I/O error, got %s", rk_status_str(st));
    cr_assert(strstr(rk_error_message(), why), "message \"%s\" lacks \"%s\"", rk_error_message(),
              why);
    cr_assert_eq(present(s, c->key), 0);
    cr_assert_eq(count_files(dir, ".tmp"), 0, "temporary file left behind");
    char path[4096];
    snprintf(path, sizeof path, "%s", payload_path(s, c->key));
    cr_assert(!file_exists(path));
}

/* Permissions only bind an unprivileged user: when running as root, become
 * nobody for the rest of this test process, or skip the test (freeing dir,
 * whose leak the sanitizer pass would report) when that user cannot reach dir. */
static void drop_root_or_skip(char *dir) {
    if (geteuid() != 0) return;
    cr_assert_eq(chown(dir, 65534, 65534), 0);
    if (setgid(65534) != 0 || setuid(65534) != 0) {
        free(dir);
        cr_skip_test("running as root and cannot drop privileges: %s", strerror(errno));
    }
    prctl(PR_SET_DUMPABLE, 1); /* keep LeakSanitizer able to inspect this process */
    if (access(dir, R_OK | W_OK | X_OK) != 0) { /* e.g. the checkout is under a 0700 dir */
        char why[4200];
        snprintf(why, sizeof why, "%s is out of an unprivileged user's reach: %s", dir,
                 strerror(errno));
        free(dir);
        cr_skip_test("%s", why);
    }
}

Test(store_faults, read_only_directory_fails_the_put_cleanly) {
    char *dir = rk_test_tmpdir("store-rodir");
    drop_root_or_skip(dir);
    chunk ok[2], fail_same, fail_new;
    chunk_make(&ok[0], 110, 16, 1000);
    chunk_make(&ok[1], 111, 16, 1000);
    chunk_make(&fail_same, 112, 16, 1000);
    fail_same.key[0] = ok[0].key[0]; /* lands in ok[0]'s existing subdirectory */
    fail_same.key[1] = ok[0].key[1];
    chunk_make(&fail_new, 113, 16, 1000);
    char kv[4096];
    snprintf(kv, sizeof kv, "%s/kv", dir);
    rk_store *s = open_store(dir, FP_A, 1);
    for (int i = 0; i < 2; i++) ASSERT_OK(put_chunk(s, &ok[i]));
    /* a new subdirectory must be needed for fail_new */
    char sub[4200];
    snprintf(sub, sizeof sub, "%s/%.2s", kv, fail_new.key);
    cr_assert(!file_exists(sub));

    char sub0[4200], sub1[4200], probe[4200];
    snprintf(sub0, sizeof sub0, "%s/%.2s", kv, ok[0].key);
    snprintf(sub1, sizeof sub1, "%s/%.2s", kv, ok[1].key);
    cr_assert_eq(chmod(kv, 0555), 0);
    cr_assert_eq(chmod(sub0, 0555), 0);
    cr_assert_eq(chmod(sub1, 0555), 0);
    PATHF(probe, "%s/probe", sub0);
    int fd = open(probe, O_WRONLY | O_CREAT, 0644);
    if (fd >= 0) {
        close(fd);
        unlink(probe);
        chmod(kv, 0755);
        chmod(sub0, 0755);
        chmod(sub1, 0755);
        rk_store_close(s);
        cr_skip_test("chmod 0555 does not stop writes here (root or odd filesystem)");
    }

    expect_failed_put(s, dir, &fail_same, "Permission denied");
    expect_failed_put(s, dir, &fail_new, "Permission denied");
    for (int i = 0; i < 2; i++) expect_chunk(s, &ok[i]);
    cr_assert_eq(stats_of(s).rows, 2);

    /* writable again: the store goes on */
    cr_assert_eq(chmod(kv, 0755), 0);
    cr_assert_eq(chmod(sub0, 0755), 0);
    cr_assert_eq(chmod(sub1, 0755), 0);
    ASSERT_OK(put_chunk(s, &fail_new));
    expect_chunk(s, &fail_new);
    rk_store_close(s);
    chunk_free(&ok[0]);
    chunk_free(&ok[1]);
    chunk_free(&fail_same);
    chunk_free(&fail_new);
    rm_rf(dir);
}

/* A delete in a directory the store may not write to removes the row but
 * not the file: it says so, and no open gives the file its row back; the
 * first open that can removes it. Root ignores directory permissions: the
 * test process becomes nobody (drop_root_or_skip). */
Test(store_faults, a_file_a_read_only_directory_keeps_is_reported_and_never_resurrected) {
    char *dir = rk_test_tmpdir("store-rodel");
    drop_root_or_skip(dir);
    chunk a, b;
    chunk_make(&a, 130, 16, 1000);
    chunk_make(&b, 131, 16, 1000);
    cr_assert_neq(strncmp(a.key, b.key, 2), 0, "the two chunks must use two directories");
    rk_store *s = open_store(dir, FP_A, 1);
    ASSERT_OK(put_chunk(s, &a));
    ASSERT_OK(put_chunk(s, &b));
    char sub[4200], path[4200], probe[4300];
    PATHF(sub, "%s/kv/%.2s", dir, a.key);
    PATHF(path, "%s", payload_path(s, a.key));
    cr_assert_eq(chmod(sub, 0555), 0);
    PATHF(probe, "%s/probe", sub);
    int fd = open(probe, O_WRONLY | O_CREAT, 0644);
    if (fd >= 0) {
        close(fd);
        unlink(probe);
        chmod(sub, 0755);
        rk_store_close(s);
        chunk_free(&a);
        chunk_free(&b);
        free(dir);
        cr_skip_test("chmod 0555 does not stop writes here (root or odd filesystem)");
    }

    rk_store_removal rm;
    ASSERT_OK(rk_store_delete(s, a.key, &rm));
    cr_assert_eq(rm.rows, 1);
    cr_assert_eq(rm.files_left, 1, "the delete claims the file went");
    cr_assert(strstr(rm.why, "Permission denied"), "%s", rm.why);
    cr_assert(strstr(rm.why, a.key), "%s", rm.why);
    cr_assert_eq(present(s, a.key), 0);
    cr_assert(file_exists(path));
    rk_store_close(s);

    /* still read-only: the file stays, without its row */
    s = open_store(dir, FP_A, 1);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(present(s, a.key), 0, "the deleted chunk came back");
    cr_assert_eq(st.rows_rebuilt, 0);
    cr_assert_eq(st.rows, 1);
    rk_store_payload p;
    cr_assert_eq(rk_store_get(s, a.key, &p), RK_ERR_NOT_FOUND);
    expect_chunk(s, &b);
    cr_assert(file_exists(path));
    rk_store_close(s);
    cr_assert_eq(sql_int_on(dir, "SELECT COUNT(*) FROM tombstones"), 1);

    /* writable again: the next open removes it */
    cr_assert_eq(chmod(sub, 0755), 0);
    s = open_store(dir, FP_A, 1);
    cr_assert_eq(present(s, a.key), 0);
    cr_assert_eq(stats_of(s).rows_rebuilt, 0);
    cr_assert(!file_exists(path), "the tombstoned file was not removed");
    rk_store_close(s);
    cr_assert_eq(sql_int_on(dir, "SELECT COUNT(*) FROM tombstones"), 0);

    /* and the key may be stored again */
    s = open_store(dir, FP_A, 1);
    ASSERT_OK(put_chunk(s, &a));
    expect_chunk(s, &a);
    rk_store_close(s);
    chunk_free(&a);
    chunk_free(&b);
    rm_rf(dir);
}

/* The same for a flush, as root too: the unlink of the second file fails
 * with EIO (rk_store_fault_io). Then a tombstone left by a crash between a
 * delete's commit and its unlink (the file back in place) keeps the file
 * from getting its row back too. */
Test(store_faults, a_flush_reports_the_files_it_could_not_remove_and_no_open_rebuilds_them) {
    char *dir = rk_test_tmpdir("store-flushleft");
    chunk c[3];
    for (int i = 0; i < 3; i++) chunk_make(&c[i], 140 + (unsigned)i, 16, 1000);
    rk_store *s = open_store(dir, FP_A, 1);
    for (int i = 0; i < 3; i++) ASSERT_OK(put_chunk(s, &c[i]));
    rk_store_removal rm;
    rk_store_fault_io(2);
    rk_status st = rk_store_flush(s, &rm);
    rk_store_fault_io(0);
    ASSERT_OK(st);
    cr_assert_eq(rm.rows, 3);
    cr_assert_eq(rm.files_left, 1);
    cr_assert(strstr(rm.why, strerror(EIO)), "%s", rm.why);
    cr_assert_eq(stats_of(s).rows, 0);
    cr_assert_eq(count_files(dir, ".kv"), 1);
    rk_store_close(s);
    cr_assert_eq(sql_int_on(dir, "SELECT COUNT(*) FROM tombstones"), 1);
    s = open_store(dir, FP_A, 1);
    cr_assert_eq(stats_of(s).rows, 0, "a flushed chunk came back");
    cr_assert_eq(stats_of(s).rows_rebuilt, 0);
    cr_assert_eq(count_files(dir, ".kv"), 0);
    rk_store_close(s);
    cr_assert_eq(sql_int_on(dir, "SELECT COUNT(*) FROM tombstones"), 0);

    /* a crash after the delete's commit, before its unlink */
    s = open_store(dir, FP_A, 1);
    ASSERT_OK(put_chunk(s, &c[0]));
    char path[4096], saved[4200];
    snprintf(path, sizeof path, "%s", payload_path(s, c[0].key));
    PATHF(saved, "%s/saved.bin", dir);
    cr_assert_eq(link(path, saved), 0, "%s", strerror(errno));
    ASSERT_OK(rk_store_delete(s, c[0].key, &rm));
    cr_assert_eq(rm.files_left, 0);
    cr_assert(!file_exists(path));
    rk_store_close(s);
    cr_assert_eq(rename(saved, path), 0);
    char sql[200]; /* as if the unlink never ran */
    snprintf(sql, sizeof sql, "INSERT INTO tombstones (key) VALUES ('%s')", c[0].key);
    sql_on(dir, sql);
    s = open_store(dir, FP_A, 1);
    cr_assert_eq(present(s, c[0].key), 0, "the deleted chunk came back");
    cr_assert(!file_exists(path));
    rk_store_close(s);
    for (int i = 0; i < 3; i++) chunk_free(&c[i]);
    rm_rf(dir);
}

Test(store_faults, file_size_limit_fails_the_put_cleanly) {
    char *dir = rk_test_tmpdir("store-fsize");
    chunk small[2], big;
    chunk_make(&small[0], 120, 16, 1000);
    chunk_make(&small[1], 121, 16, 1000);
    chunk_make(&big, 122, 512, 1 << 20);
    rk_store *s = open_store(dir, FP_A, 1);
    for (int i = 0; i < 2; i++) ASSERT_OK(put_chunk(s, &small[i]));

    /* Criterion runs this test in its own process: the limit ends with it. */
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit old, lim;
    cr_assert_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
    lim = old;
    lim.rlim_cur = 512 * 1024;
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);

    expect_failed_put(s, dir, &big, "File too large");
    for (int i = 0; i < 2; i++) expect_chunk(s, &small[i]);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.rows, 2);
    cr_assert_eq(st.writes, 2);

    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &old), 0);
    ASSERT_OK(put_chunk(s, &big));
    expect_chunk(s, &big);
    rk_store_close(s);
    chunk_free(&small[0]);
    chunk_free(&small[1]);
    chunk_free(&big);
    rm_rf(dir);
}

/* ---------------------------------------------------------------- crash consistency */

#define CRASH_PUTS 200

/* The chunk of the i-th put of run `run`: 1..64 KiB of body. Its doc_id
 * names (run, i), so a reader can rebuild it from the row alone. */
static void crash_chunk(chunk *c, int run, int i) {
    uint64_t seed = 1000000ull * (uint64_t)(run + 1) + (uint64_t)i;
    uint64_t h = mix(seed);
    chunk_make(c, seed, 1 + (int32_t)(h % 128), 1024 + (size_t)((h >> 20) % (63 * 1024 + 1)));
    snprintf(c->doc_id, sizeof c->doc_id, "%d:%d", run, i);
}

/* The writer process: 200 puts (in batches of 8 on odd runs), one byte to
 * fd after each put is durable. Never returns. */
static void crash_writer(const char *dir, int run, int fd) {
    rk_store_options o;
    rk_store_options_default(&o);
    o.verify_on_open = 0;
    rk_store *s = NULL;
    if (rk_store_open(dir, FP_A, &o, &s) != RK_OK) _exit(2);
    int batched = run % 2;
    for (int i = 0; i < CRASH_PUTS; i++) {
        if (batched && i % 8 == 0 && rk_store_begin(s) != RK_OK) _exit(3);
        chunk c;
        crash_chunk(&c, run, i);
        rk_store_put_args a = chunk_args(&c);
        rk_status st = rk_store_put(s, &a);
        free(c.tokens);
        free(c.body);
        if (st != RK_OK) _exit(4);
        if (batched && (i % 8 == 7 || i == CRASH_PUTS - 1) && rk_store_commit(s) != RK_OK) _exit(5);
        if (!batched || i % 8 == 7 || i == CRASH_PUTS - 1) {
            int n = batched ? 8 : 1;
            if (batched && i == CRASH_PUTS - 1) n = CRASH_PUTS % 8 ? CRASH_PUTS % 8 : 8;
            char buf[8] = {0};
            if (write(fd, buf, (size_t)n) != n) _exit(6);
        }
    }
    rk_store_close(s);
    _exit(0);
}

/* Reopen and check: nothing dropped, every row verifies and holds the bytes
 * its doc_id says, as many rows as payload files, no temporary file. Returns
 * the number of rows. */
static uint64_t check_consistent(const char *dir, uint64_t max_orphans) {
    rk_store *s = open_store(dir, FP_A, 1);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.dropped_on_recovery, 0, "a row pointed at a bad payload after a crash");
    cr_assert_leq(st.orphans_removed, max_orphans, "more orphans than files in flight");
    rk_store_verify_result vr;
    ASSERT_OK(rk_store_verify(s, 0, NULL, NULL, &vr));
    cr_assert_eq(vr.bad, 0);
    cr_assert_eq(vr.orphans, 0);
    cr_assert_eq(vr.checked, st.rows);
    cr_assert_eq((uint64_t)count_files(dir, ".kv"), st.rows, "rows and payload files differ");
    cr_assert_eq(count_files(dir, ".tmp"), 0);
    rk_store_entry *v = NULL;
    int n = 0;
    ASSERT_OK(rk_store_list(s, RK_STORE_SORT_RECENT, 0, 0, &v, &n));
    cr_assert_eq((uint64_t)n, st.rows);
    for (int k = 0; k < n; k++) {
        int run = -1, i = -1;
        cr_assert_eq(sscanf(v[k].doc_id, "%d:%d", &run, &i), 2);
        chunk c;
        crash_chunk(&c, run, i);
        cr_assert_str_eq(c.key, v[k].key);
        expect_chunk(s, &c);
        chunk_free(&c);
    }
    free(v);
    rk_store_close(s);
    return st.rows;
}

Test(store_crash, sigkill_during_puts_leaves_every_row_verifiable, .timeout = 600) {
    char *dir = rk_test_tmpdir("store-crash");
    srand(12345);
    uint64_t rows = 0;
    for (int run = 0; run < 20; run++) {
        int fds[2];
        cr_assert_eq(pipe(fds), 0);
        pid_t pid = fork();
        cr_assert_neq(pid, -1);
        if (pid == 0) {
            close(fds[0]);
            crash_writer(dir, run, fds[1]);
        }
        close(fds[1]);
        /* let a random number of puts complete, then kill at a random moment */
        int want = rand() % CRASH_PUTS, got = 0;
        char buf[64];
        while (got < want) {
            ssize_t r = read(fds[0], buf,
                             sizeof buf < (size_t)(want - got) ? sizeof buf : (size_t)(want - got));
            if (r <= 0) break;
            got += (int)r;
        }
        usleep((useconds_t)(rand() % 3000));
        kill(pid, SIGKILL);
        int status = 0;
        cr_assert_eq(waitpid(pid, &status, 0), pid);
        while (read(fds[0], buf, sizeof buf) > 0) {
        } /* drain */
        close(fds[0]);
        cr_assert(WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) == 0),
                  "writer failed with status %d", WEXITSTATUS(status));
        /* in flight at the kill: one file, or a whole uncommitted batch of 8 */
        uint64_t now = check_consistent(dir, run % 2 ? 8 : 1);
        cr_log_info("run %d (%s): killed after %d acknowledged puts; %llu new rows", run,
                    run % 2 ? "batches of 8" : "single puts", want,
                    (unsigned long long)(now - rows));
        cr_assert_geq(now, rows + (uint64_t)want, "run %d: %d acknowledged puts, %llu new rows",
                      run, want, (unsigned long long)(now - rows));
        cr_assert_leq(now, rows + CRASH_PUTS);
        rows = now;
    }
    /* a complete run: all 200 land */
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0) {
        int null = open("/dev/null", O_WRONLY);
        crash_writer(dir, 20, null);
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "writer status %d", status);
    cr_assert_eq(check_consistent(dir, 0), rows + CRASH_PUTS);
    rk_store *s = open_store(dir, FP_A, 1);
    for (int i = 0; i < CRASH_PUTS; i++) {
        chunk c;
        crash_chunk(&c, 20, i);
        expect_chunk(s, &c);
        chunk_free(&c);
    }
    rk_store_close(s);
    rm_rf(dir);
}

/* ---------------------------------------------------------------- budget, batches */

Test(store, disk_budget_evicts_the_least_recently_used) {
    char *dir = rk_test_tmpdir("store-budget");
    enum { N = 7, ENTRY = H + 64 + 4000 };
    chunk c[N];
    for (int i = 0; i < N; i++) chunk_make(&c[i], 130 + (uint64_t)i, 16, 4000);
    rk_store_options o;
    rk_store_options_default(&o);
    o.disk_budget_bytes = 5 * ENTRY;
    rk_store *s = NULL;
    ASSERT_OK(rk_store_open(dir, FP_A, &o, &s));
    for (int i = 0; i < 5; i++) ASSERT_OK(put_chunk(s, &c[i]));
    cr_assert_eq(stats_of(s).evictions, 0);
    rk_store_payload p;
    ASSERT_OK(rk_store_get(s, c[0].key, &p)); /* c[0] becomes the most recent */
    rk_store_payload_free(&p);
    ASSERT_OK(put_chunk(s, &c[5]));
    ASSERT_OK(put_chunk(s, &c[6]));
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.evictions, 2);
    cr_assert_eq(st.evicted_bytes, 2 * ENTRY);
    cr_assert_eq(st.rows, 5);
    cr_assert_eq(st.bytes, 5 * ENTRY);
    cr_assert_eq(present(s, c[0].key), 1, "the recently read entry was evicted");
    cr_assert_eq(present(s, c[1].key), 0);
    cr_assert_eq(present(s, c[2].key), 0);
    for (int i = 3; i < N; i++) cr_assert_eq(present(s, c[i].key), 1);
    cr_assert_eq(count_files(dir, ".kv"), 5);
    expect_chunk(s, &c[0]);

    /* one payload larger than the whole budget is refused up front */
    chunk huge;
    chunk_make(&huge, 140, 16, 6 * ENTRY);
    cr_assert_eq(put_chunk(s, &huge), RK_ERR_LIMIT);
    cr_assert_eq(present(s, huge.key), 0);
    cr_assert_eq(count_files(dir, ".kv"), 5);
    rk_store_close(s);

    /* a smaller budget at the next open evicts down to it */
    o.disk_budget_bytes = 2 * ENTRY;
    ASSERT_OK(rk_store_open(dir, FP_A, &o, &s));
    st = stats_of(s);
    cr_assert_eq(st.rows, 2);
    cr_assert_eq(st.evictions, 3);
    cr_assert_eq(present(s, c[0].key), 1); /* read last, by expect_chunk */
    cr_assert_eq(present(s, c[6].key), 1);
    for (int i = 3; i < 6; i++) cr_assert_eq(present(s, c[i].key), 0);
    cr_assert_eq(count_files(dir, ".kv"), 2);
    rk_store_close(s);
    for (int i = 0; i < N; i++) chunk_free(&c[i]);
    chunk_free(&huge);
    rm_rf(dir);
}

Test(store, batches_commit_together_and_roll_back_cleanly) {
    char *dir = rk_test_tmpdir("store-batch");
    chunk c[6];
    for (int i = 0; i < 6; i++) chunk_make(&c[i], 150 + (uint64_t)i, 16, 700);
    rk_store *s = open_store(dir, FP_A, 1);
    cr_assert_eq(rk_store_commit(s), RK_ERR_INVALID);
    ASSERT_OK(rk_store_begin(s));
    cr_assert_eq(rk_store_begin(s), RK_ERR_INVALID);
    for (int i = 0; i < 3; i++) ASSERT_OK(put_chunk(s, &c[i]));
    expect_chunk(s, &c[1]); /* visible to this store before the commit */
    ASSERT_OK(rk_store_rollback(s));
    cr_assert_eq(stats_of(s).rows, 0);
    cr_assert_eq(count_files(dir, ".kv"), 0, "rolled-back payload files left behind");
    for (int i = 0; i < 3; i++) cr_assert_eq(present(s, c[i].key), 0);

    ASSERT_OK(rk_store_begin(s));
    for (int i = 0; i < 6; i++) ASSERT_OK(put_chunk(s, &c[i]));
    ASSERT_OK(rk_store_delete(s, c[5].key, NULL)); /* its file goes at commit */
    cr_assert_eq(count_files(dir, ".kv"), 6);
    cr_assert_eq(put_chunk(s, &c[5]), RK_ERR_BUSY);
    ASSERT_OK(rk_store_commit(s));
    cr_assert_eq(count_files(dir, ".kv"), 5);

    /* a batch left open at close is rolled back */
    ASSERT_OK(rk_store_begin(s));
    ASSERT_OK(put_chunk(s, &c[5]));
    rk_store_close(s);

    s = open_store(dir, FP_A, 1);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.rows, 5);
    cr_assert_eq(st.orphans_removed, 0);
    for (int i = 0; i < 5; i++) expect_chunk(s, &c[i]);
    cr_assert_eq(present(s, c[5].key), 0);
    cr_assert_eq(count_files(dir, ".kv"), 5);
    rk_store_removal removed;
    ASSERT_OK(rk_store_flush(s, &removed));
    cr_assert_eq(removed.rows, 5);
    cr_assert_eq(count_files(dir, ".kv"), 0);
    cr_assert_eq(stats_of(s).rows, 0);
    rk_store_close(s);
    for (int i = 0; i < 6; i++) chunk_free(&c[i]);
    rm_rf(dir);
}

/* ---------------------------------------------------------------- schema */

Test(store_schema, a_version_0_database_migrates_to_the_current_version) {
    char *dir = rk_test_tmpdir("store-schema0");
    sql_on(dir, "CREATE TABLE scratch (x INTEGER)"); /* a real database, user_version 0 */
    cr_assert_eq(sql_int_on(dir, "PRAGMA user_version"), 0);
    rk_store *s = open_store(dir, FP_A, 1);
    chunk c;
    chunk_make(&c, 160, 8, 64);
    ASSERT_OK(put_chunk(s, &c));
    rk_store_close(s);
    cr_assert_eq(sql_int_on(dir, "PRAGMA user_version"), RK_STORE_SCHEMA_VERSION);
    cr_assert_eq(sql_int_on(dir, "PRAGMA application_id"), 0x524b4b56);
    cr_assert_eq(sql_int_on(dir, "SELECT COUNT(*) FROM chunks"), 1);
    cr_assert_eq(sql_int_on(dir, "SELECT COUNT(*) FROM sqlite_master WHERE name = 'scratch'"), 1);
    s = open_store(dir, FP_A, 1); /* already current: opens as is */
    expect_chunk(s, &c);
    rk_store_close(s);
    chunk_free(&c);
    rm_rf(dir);
}

Test(store_schema, a_version_1_database_gains_tombstones_and_keeps_its_rows) {
    char *dir = rk_test_tmpdir("store-schema1");
    rk_store *s = open_store(dir, FP_A, 1);
    chunk c;
    chunk_make(&c, 161, 8, 64);
    ASSERT_OK(put_chunk(s, &c));
    rk_store_close(s);
    sql_on(dir, "DROP TABLE tombstones; PRAGMA user_version = 1"); /* as version 1 left it */
    rk_store *ro = NULL;
    cr_assert_eq(rk_store_open_readonly(dir, &ro), RK_ERR_UNSUPPORTED);
    s = open_store(dir, FP_A, 1);
    expect_chunk(s, &c);
    ASSERT_OK(rk_store_delete(s, c.key, NULL));
    rk_store_close(s);
    cr_assert_eq(sql_int_on(dir, "PRAGMA user_version"), 2);
    cr_assert_eq(sql_int_on(dir, "SELECT COUNT(*) FROM tombstones"), 0);
    chunk_free(&c);
    rm_rf(dir);
}

Test(store_schema, a_future_version_is_refused_with_a_clear_message) {
    char *dir = rk_test_tmpdir("store-schema99");
    sql_on(dir, "CREATE TABLE chunks (key TEXT); PRAGMA user_version = 99");
    rk_store *s = NULL;
    cr_assert_eq(rk_store_open(dir, FP_A, NULL, &s), RK_ERR_UNSUPPORTED);
    cr_assert_null(s);
    cr_assert(strstr(rk_error_message(), "schema version 99"), "%s", rk_error_message());
    cr_assert(strstr(rk_error_message(), "newer ragkv"), "%s", rk_error_message());
    cr_assert_eq(rk_store_open_readonly(dir, &s), RK_ERR_UNSUPPORTED);
    cr_assert_eq(sql_int_on(dir, "PRAGMA user_version"), 99); /* untouched */
    rm_rf(dir);
}

Test(store_schema, a_foreign_database_is_refused) {
    char *dir = rk_test_tmpdir("store-foreign");
    sql_on(dir, "CREATE TABLE chunks (key TEXT); PRAGMA user_version = 1");
    rk_store *s = NULL;
    cr_assert_eq(rk_store_open(dir, FP_A, NULL, &s), RK_ERR_FORMAT);
    cr_assert(strstr(rk_error_message(), "not a ragkv chunk store"), "%s", rk_error_message());
    rm_rf(dir);
}

/* ---------------------------------------------------------------- offline reports */

static char *capture(rk_status (*fn)(rk_store *, FILE *), rk_store *s) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    cr_assert_not_null(f);
    ASSERT_OK(fn(s, f));
    fclose(f);
    return buf;
}

static rk_status print_ls_all(rk_store *s, FILE *f) {
    return rk_store_print_ls(s, f, RK_STORE_SORT_HITS, 0);
}

static uint64_t g_bad;
static rk_status print_verify(rk_store *s, FILE *f) { return rk_store_print_verify(s, f, &g_bad); }

Test(store_offline, read_only_handle_lists_counts_and_verifies_without_deleting) {
    char *dir = rk_test_tmpdir("store-offline");
    rk_store *ro = NULL;
    cr_assert_eq(rk_store_open_readonly(dir, &ro), RK_ERR_NOT_FOUND);
    cr_assert_null(ro);

    chunk a[2], b;
    rk_store *s = open_store(dir, FP_A, 1);
    for (int i = 0; i < 2; i++) {
        chunk_make(&a[i], 170 + (uint64_t)i, 32, 1000);
        ASSERT_OK(put_chunk(s, &a[i]));
    }
    rk_store_close(s);
    s = open_store(dir, FP_B, 1);
    chunk_make(&b, 180, 32, 1000);
    ASSERT_OK(put_chunk(s, &b));
    char pb[4096];
    snprintf(pb, sizeof pb, "%s", payload_path(s, b.key));
    rk_store_close(s);
    flip_byte(pb, H + 4 * 32 + 10);

    ASSERT_OK(rk_store_open_readonly(dir, &ro));
    rk_store_counters st = stats_of(ro);
    cr_assert_eq(st.rows, 3); /* every model */
    cr_assert_eq(st.bytes, 3 * (H + 128 + 1000));
    char *ls = capture(print_ls_all, ro);
    for (int i = 0; i < 2; i++) cr_assert(strstr(ls, a[i].key), "%s", ls);
    cr_assert(strstr(ls, b.key));
    cr_assert(strstr(ls, "3 rows"), "%s", ls);
    cr_assert(strstr(ls, a[0].doc_id));
    free(ls);
    char *stats = capture(rk_store_print_stats, ro);
    cr_assert(strstr(stats, FP_A) && strstr(stats, FP_B), "%s", stats);
    free(stats);
    char *ver = capture(print_verify, ro);
    cr_assert_eq(g_bad, 1);
    cr_assert(strstr(ver, b.key) && strstr(ver, "checksum mismatch"), "%s", ver);
    cr_assert(strstr(ver, "checked 3 payloads: 1 bad"), "%s", ver);
    free(ver);
    cr_assert(file_exists(pb), "read-only verify deleted a file");

    rk_store_payload p;
    rk_store_verify_result vr;
    cr_assert_eq(put_chunk(ro, &b), RK_ERR_INVALID);
    cr_assert_eq(rk_store_get(ro, a[0].key, &p), RK_ERR_INVALID);
    cr_assert_eq(rk_store_delete(ro, a[0].key, NULL), RK_ERR_INVALID);
    cr_assert_eq(rk_store_flush(ro, NULL), RK_ERR_INVALID);
    cr_assert_eq(rk_store_verify(ro, 1, NULL, NULL, &vr), RK_ERR_INVALID);
    cr_assert_eq(rk_store_begin(ro), RK_ERR_INVALID);
    cr_assert_eq(present(ro, b.key), 1);
    rk_store_close(ro);

    /* the writable store of model B still finds and drops it */
    s = open_store(dir, FP_B, 1);
    cr_assert_eq(stats_of(s).dropped_on_recovery, 1);
    rk_store_close(s);
    for (int i = 0; i < 2; i++) chunk_free(&a[i]);
    chunk_free(&b);
    rm_rf(dir);
}

Test(store_recovery, rows_with_hostile_keys_are_dropped_and_name_no_file) {
    char *dir = rk_test_tmpdir("store-hostile");
    chunk c;
    chunk_make(&c, 190, 16, 300);
    rk_store *s = open_store(dir, FP_A, 1);
    ASSERT_OK(put_chunk(s, &c));
    rk_store_close(s);
    /* a bait file where a naive path join would land */
    char bait[4200];
    PATHF(bait, "%s/passwd.kv", dir);
    FILE *f = fopen(bait, "wb");
    cr_assert_not_null(f);
    fclose(f);
    sql_on(dir, "INSERT INTO chunks (key, model, policy, n_tokens, n_bytes, checksum, created,"
                " last_access, hits, file) VALUES"
                " ('../passwd', '" FP_A "', 'isolated', 1, 164, 'x', 0, 0, 0, 'x'),"
                " ('../../etc/shadow', '" FP_B "', 'isolated', 1, 164, 'x', 0, 0, 0, 'x')");

    rk_store *ro = NULL;
    ASSERT_OK(rk_store_open_readonly(dir, &ro));
    rk_store_verify_result vr;
    ASSERT_OK(rk_store_verify(ro, 0, NULL, NULL, &vr));
    cr_assert_eq(vr.checked, 3);
    cr_assert_eq(vr.bad, 2);
    rk_store_close(ro);

    s = open_store(dir, FP_A, 1);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.dropped_on_recovery, 1); /* this model's hostile row */
    cr_assert_eq(st.other_model_rows, 1);    /* the other model's row is kept, never used */
    cr_assert_eq(st.rows, 1);
    cr_assert(file_exists(bait), "a file outside kv/ was touched");
    expect_chunk(s, &c);
    rk_store_close(s);
    chunk_free(&c);
    rm_rf(dir);
}

Test(store, verify_can_delete_what_it_finds_bad) {
    char *dir = rk_test_tmpdir("store-verify-delete");
    chunk c[3];
    rk_store *s = open_store(dir, FP_A, 1);
    for (int i = 0; i < 3; i++) {
        chunk_make(&c[i], 200 + (uint64_t)i, 16, 3000);
        ASSERT_OK(put_chunk(s, &c[i]));
    }
    flip_byte(payload_path(s, c[0].key), H + 64 + 5);
    cr_assert_eq(truncate(payload_path(s, c[2].key), 100), 0);
    rk_store_verify_result vr;
    ASSERT_OK(rk_store_verify(s, 1, NULL, NULL, &vr));
    cr_assert_eq(vr.checked, 3);
    cr_assert_eq(vr.bad, 2);
    cr_assert_eq(vr.deleted, 2);
    cr_assert_eq(vr.orphans, 0);
    cr_assert_eq(present(s, c[0].key), 0);
    cr_assert_eq(present(s, c[2].key), 0);
    cr_assert_eq(count_files(dir, ".kv"), 1);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.rows, 1);
    cr_assert_eq(st.bytes, H + 64 + 3000);
    expect_chunk(s, &c[1]);
    rk_store_close(s);
    for (int i = 0; i < 3; i++) chunk_free(&c[i]);
    rm_rf(dir);
}

/* ---------------------------------------------------------------- rebuild and quarantine */

#define N_REBUILD 5

/* Store N_REBUILD chunks (the last for model B) and close; c is filled. */
static void store_for_rebuild(const char *dir, chunk c[N_REBUILD]) {
    rk_store *s = open_store(dir, FP_A, 1);
    for (int i = 0; i < N_REBUILD - 1; i++) {
        chunk_make(&c[i], 300 + (uint64_t)i, 24 + i, 2000 + 100 * (size_t)i);
        ASSERT_OK(put_chunk(s, &c[i]));
    }
    rk_store_close(s);
    chunk_make(&c[N_REBUILD - 1], 399, 8, 500);
    s = open_store(dir, FP_B, 1);
    ASSERT_OK(put_chunk(s, &c[N_REBUILD - 1]));
    rk_store_close(s);
}

/* Every chunk of c is on disk, has its row back, and model A's are served
 * byte for byte with their policy and document id. */
static void expect_rebuilt(const char *dir, chunk c[N_REBUILD]) {
    cr_assert_eq(count_files(dir, ".kv"), N_REBUILD, "a payload file was lost");
    rk_store *s = open_store(dir, FP_A, 1);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.rows, N_REBUILD - 1);
    cr_assert_eq(st.other_model_rows, 1);
    cr_assert_eq(st.quarantined, 0);
    for (int i = 0; i < N_REBUILD - 1; i++) expect_chunk(s, &c[i]);
    rk_store_verify_result vr;
    ASSERT_OK(rk_store_verify(s, 0, NULL, NULL, &vr));
    cr_assert_eq(vr.bad, 0);
    cr_assert_eq(vr.orphans, 0);
    rk_store_close(s);
}

static void remove_db(const char *dir, int truncate_it) {
    const char *names[] = {"chunks.db", "chunks.db-wal", "chunks.db-shm"};
    for (int i = 0; i < 3; i++) {
        char path[4200];
        PATHF(path, "%s/%s", dir, names[i]);
        if (i == 0 && truncate_it)
            cr_assert_eq(truncate(path, 0), 0, "%s: %s", path, strerror(errno));
        else
            cr_assert(unlink(path) == 0 || errno == ENOENT);
    }
}

static void lost_database_case(int truncate_it) {
    char *dir = rk_test_tmpdir("store-lostdb");
    chunk c[N_REBUILD];
    store_for_rebuild(dir, c);
    remove_db(dir, truncate_it);

    rk_store *s = open_store(dir, FP_A, 1);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(count_files(dir, ".kv"), N_REBUILD, "open removed payload files");
    cr_assert_eq(st.rows_rebuilt, N_REBUILD);
    cr_assert_eq(st.rows, N_REBUILD - 1);
    cr_assert_eq(st.other_model_rows, 1);
    cr_assert_eq(st.orphans_removed, 0);
    for (int i = 0; i < N_REBUILD - 1; i++) expect_chunk(s, &c[i]);
    rk_store_close(s);
    expect_rebuilt(dir, c);
    s = open_store(dir, FP_A, 1); /* rebuilt once: the next open finds every row */
    cr_assert_eq(stats_of(s).rows_rebuilt, 0);
    rk_store_close(s);
    for (int i = 0; i < N_REBUILD; i++) chunk_free(&c[i]);
    rm_rf(dir);
}

Test(store_rebuild, removed_database_keeps_every_payload_and_rebuilds_the_rows) {
    lost_database_case(0);
}

Test(store_rebuild, emptied_database_keeps_every_payload_and_rebuilds_the_rows) {
    lost_database_case(1);
}

Test(store_rebuild, a_log_left_without_its_database_is_set_aside_not_applied) {
    char *dir = rk_test_tmpdir("store-lostdb-wal");
    chunk c[N_REBUILD];
    store_for_rebuild(dir, c);
    remove_db(dir, 0);
    char wal[4200];
    PATHF(wal, "%s/chunks.db-wal", dir);
    FILE *f = fopen(wal, "wb");
    cr_assert_not_null(f);
    for (int i = 0; i < 4096; i++) fputc(i & 0xff, f);
    cr_assert_eq(fclose(f), 0);

    rk_store *s = open_store(dir, FP_A, 1);
    cr_assert_eq(stats_of(s).rows_rebuilt, N_REBUILD);
    cr_assert_eq(stats_of(s).quarantined, 0); /* counts payload files only */
    rk_store_close(s);
    cr_assert_eq(count_quarantined(dir, "chunks.db-wal."), 1, "the log was not kept aside");
    expect_rebuilt(dir, c);
    for (int i = 0; i < N_REBUILD; i++) chunk_free(&c[i]);
    rm_rf(dir);
}

/* Overwrite len bytes of chunks.db at offset with junk. */
static void damage_db(const char *dir, long offset, int len) {
    char path[4200];
    PATHF(path, "%s/chunks.db", dir);
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f);
    cr_assert_eq(fseek(f, offset, SEEK_SET), 0);
    for (int i = 0; i < len; i++) fputc(0xa5 ^ i, f);
    cr_assert_eq(fclose(f), 0);
}

static void corrupt_database_case(long offset, int len) {
    char *dir = rk_test_tmpdir("store-corruptdb");
    chunk c[N_REBUILD];
    store_for_rebuild(dir, c);
    cr_assert_eq(sql_int_on(dir, "PRAGMA page_size"), 4096);
    damage_db(dir, offset, len);

    rk_store *s = NULL;
    cr_assert_eq(rk_store_open(dir, FP_A, NULL, &s), RK_ERR_FORMAT);
    cr_assert_null(s);
    char want[4200];
    PATHF(want, "ragkv cache rebuild --store %s", dir);
    cr_assert(strstr(rk_error_message(), "chunks.db is corrupt"), "%s", rk_error_message());
    cr_assert(strstr(rk_error_message(), want), "%s", rk_error_message());
    cr_assert_eq(count_files(dir, ".kv"), N_REBUILD, "a failed open removed payload files");
    cr_assert_eq(rk_store_open_readonly(dir, &s), RK_ERR_FORMAT); /* `ragkv cache ls` */
    cr_assert(strstr(rk_error_message(), want), "%s", rk_error_message());

    rk_store_rebuild_result r;
    ASSERT_OK(rk_store_rebuild(dir, &r));
    cr_assert_eq(r.db_was_corrupt, 1);
    cr_assert_eq(strncmp(r.set_aside, "chunks.db.corrupt-", 18), 0, "%s", r.set_aside);
    cr_assert_eq(r.rows_rebuilt, N_REBUILD);
    cr_assert_eq(r.quarantined, 0);
    char aside[4200];
    PATHF(aside, "%s/%s", dir, r.set_aside);
    cr_assert(file_exists(aside), "the corrupt database was not kept");
    expect_rebuilt(dir, c);
    for (int i = 0; i < N_REBUILD; i++) chunk_free(&c[i]);
    rm_rf(dir);
}

Test(store_rebuild, database_that_is_not_a_database_fails_open_and_rebuild_loses_nothing) {
    corrupt_database_case(0, 100); /* the SQLite header */
}

Test(store_rebuild, malformed_database_fails_open_and_rebuild_loses_nothing) {
    corrupt_database_case(4096 + 8, 64); /* the chunks table's first page */
}

Test(store_rebuild, rebuild_refuses_a_store_in_use_and_a_directory_without_one) {
    char *dir = rk_test_tmpdir("store-rebuild-busy");
    rk_store_rebuild_result r;
    cr_assert_eq(rk_store_rebuild(dir, &r), RK_ERR_NOT_FOUND);
    rk_store *s = open_store(dir, FP_A, 1);
    cr_assert_eq(rk_store_rebuild(dir, &r), RK_ERR_BUSY);
    rk_store_close(s);
    ASSERT_OK(rk_store_rebuild(dir, &r)); /* sound and empty: kept as .old */
    cr_assert_eq(r.db_was_corrupt, 0);
    cr_assert_eq(strncmp(r.set_aside, "chunks.db.old-", 14), 0, "%s", r.set_aside);
    cr_assert_eq(r.rows_rebuilt, 0);
    rm_rf(dir);
}

Test(store_rebuild, corrupt_payload_without_a_row_is_quarantined_not_deleted) {
    char *dir = rk_test_tmpdir("store-quarantine");
    chunk c[N_REBUILD];
    store_for_rebuild(dir, c);
    rk_store *s = open_store(dir, FP_A, 1);
    char path[4096];
    snprintf(path, sizeof path, "%s", payload_path(s, c[0].key));
    rk_store_close(s);
    remove_db(dir, 0);
    flip_byte(path, H + 4 * c[0].n_tokens + 7); /* body */

    s = open_store(dir, FP_A, 1);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.rows_rebuilt, N_REBUILD - 1);
    cr_assert_eq(st.quarantined, 1);
    cr_assert_eq(present(s, c[0].key), 0);
    cr_assert(!file_exists(path));
    cr_assert_eq(count_quarantined(dir, c[0].key), 1, "the bad payload was not kept aside");
    for (int i = 1; i < N_REBUILD - 1; i++) expect_chunk(s, &c[i]);
    char *report = capture(rk_store_print_stats, s);
    cr_assert(strstr(report, "quarantined          1"), "%s", report);
    free(report);
    rk_store_close(s);
    ASSERT_OK(rk_store_open_readonly(dir, &s)); /* `ragkv cache stats` shows it offline */
    report = capture(rk_store_print_stats, s);
    cr_assert(strstr(report, "quarantine     1 files in "), "%s", report);
    free(report);
    rk_store_close(s);
    for (int i = 0; i < N_REBUILD; i++) chunk_free(&c[i]);
    rm_rf(dir);
}

Test(store_rebuild, unreadable_directory_is_skipped_and_counted) {
    char *dir = rk_test_tmpdir("store-unreadable");
    drop_root_or_skip(dir);
    chunk a, b;
    chunk_make(&a, 500, 16, 1000);
    chunk_make(&b, 501, 16, 1000);
    cr_assert_neq(strncmp(a.key, b.key, 2), 0, "the two chunks must use two directories");
    rk_store *s = open_store(dir, FP_A, 1);
    ASSERT_OK(put_chunk(s, &a));
    ASSERT_OK(put_chunk(s, &b));
    rk_store_close(s);
    char sub[4200];
    PATHF(sub, "%s/kv/%.2s", dir, a.key);
    cr_assert_eq(chmod(sub, 0), 0);
    DIR *probe = opendir(sub);
    if (probe) {
        closedir(probe);
        chmod(sub, 0755);
        chunk_free(&a);
        chunk_free(&b);
        free(dir);
        cr_skip_test("chmod 000 does not stop reads here (root or odd filesystem)");
    }

    s = open_store(dir, FP_A, 1);
    rk_store_counters st = stats_of(s);
    cr_assert_geq(st.unreadable, 1);
    cr_assert_eq(st.rows, 2); /* a's row stays: its file may come back */
    cr_assert_eq(st.dropped_on_recovery, 0);
    cr_assert_eq(st.quarantined, 0);
    expect_chunk(s, &b);
    rk_store_payload p;
    cr_assert_eq(rk_store_get(s, a.key, &p), RK_ERR_IO);
    cr_assert_eq(present(s, a.key), 1);
    rk_store_close(s);

    /* the same with the table gone: a is neither rebuilt nor removed */
    remove_db(dir, 0);
    s = open_store(dir, FP_A, 1);
    cr_assert_geq(stats_of(s).unreadable, 1);
    cr_assert_eq(stats_of(s).rows_rebuilt, 1);
    rk_store_close(s);
    cr_assert_eq(chmod(sub, 0755), 0);
    s = open_store(dir, FP_A, 1);
    cr_assert_eq(stats_of(s).rows_rebuilt, 1);
    expect_chunk(s, &a);
    expect_chunk(s, &b);
    rk_store_close(s);
    chunk_free(&a);
    chunk_free(&b);
    rm_rf(dir);
}

/* Write c as a version 1 payload file (160-byte header, no policy, creation
 * time or document id) for model fp at its place under dir/kv. */
static void write_v1_payload(const char *dir, const chunk *c, const char *fp) {
    uint8_t h[160] = {0};
    memcpy(h, "RKKV", 4);
    h[4] = 1;   /* version */
    h[8] = 160; /* header size */
    memcpy(h + 16, fp, 32);
    memcpy(h + 48, c->key, 32);
    memcpy(h + 80, &c->n_tokens, 4);
    memcpy(h + 84, &c->layout, sizeof c->layout);
    uint64_t body_size = c->body_size;
    memcpy(h + 112, &body_size, 8);
    XXH3_state_t *st = XXH3_createState();
    cr_assert_not_null(st);
    XXH3_128bits_reset(st);
    XXH3_128bits_update(st, c->tokens, 4 * (size_t)c->n_tokens);
    XXH3_128bits_update(st, c->body, c->body_size);
    XXH128_canonical_t sum;
    XXH128_canonicalFromHash(&sum, XXH3_128bits_digest(st));
    XXH3_freeState(st);
    memcpy(h + 120, sum.digest, 16);
    uint64_t hsum = XXH3_64bits(h, 152);
    memcpy(h + 152, &hsum, 8);
    char sub[4200], path[4300];
    PATHF(sub, "%s/kv/%.2s", dir, c->key);
    mkdir(sub, 0755);
    PATHF(path, "%s/%s.kv", sub, c->key);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(h, 1, 160, f), 160);
    cr_assert_eq(fwrite(c->tokens, 4, (size_t)c->n_tokens, f), (size_t)c->n_tokens);
    cr_assert_eq(fwrite(c->body, 1, c->body_size, f), c->body_size);
    cr_assert_eq(fclose(f), 0);
}

Test(store_rebuild, version_1_payloads_are_still_read_and_rebuilt) {
    char *dir = rk_test_tmpdir("store-v1");
    chunk c;
    chunk_make(&c, 700, 20, 3000);
    rk_store *s = open_store(dir, FP_A, 1);
    rk_store_close(s);
    write_v1_payload(dir, &c, FP_A);
    s = open_store(dir, FP_A, 1);
    cr_assert_eq(stats_of(s).rows_rebuilt, 1);
    rk_store_payload p;
    ASSERT_OK(rk_store_get(s, c.key, &p));
    cr_assert_str_eq(p.meta.policy, "unknown");
    cr_assert_str_eq(p.meta.doc_id, "");
    cr_assert_eq(p.meta.n_bytes, 160 + 4 * 20 + 3000);
    cr_assert_eq(memcmp(&p.layout, &c.layout, sizeof p.layout), 0);
    cr_assert_eq(memcmp(p.tokens, c.tokens, 4 * 20), 0);
    cr_assert_eq(memcmp(p.body, c.body, 3000), 0);
    rk_store_payload_free(&p);
    rk_store_close(s);
    chunk_free(&c);
    rm_rf(dir);
}

/* ---------------------------------------------------------------- I/O fault injection */

/* Check the store holds exactly the chunks of ok (n of them), all verified. */
static void expect_consistent(rk_store *s, const char *dir, chunk *ok, int n) {
    rk_store_verify_result vr;
    ASSERT_OK(rk_store_verify(s, 0, NULL, NULL, &vr));
    cr_assert_eq(vr.checked, (uint64_t)n);
    cr_assert_eq(vr.bad, 0);
    cr_assert_eq(vr.orphans, 0, "a file without a row was left");
    cr_assert_eq(count_files(dir, ".kv"), n);
    for (int i = 0; i < n; i++) expect_chunk(s, &ok[i]);
}

Test(store_faults, every_failing_io_call_of_a_put_fails_it_cleanly) {
    char *dir = rk_test_tmpdir("store-fault-put");
    chunk base, c;
    chunk_make(&base, 600, 32, 3000);
    chunk_make(&c, 601, 48, 5000);
    rk_store *s = open_store(dir, FP_A, 1);
    ASSERT_OK(put_chunk(s, &base));
    /* how many I/O calls a put of c makes */
    rk_store_fault_io(0);
    ASSERT_OK(put_chunk(s, &c));
    int n_calls = rk_store_fault_io(0);
    cr_assert_geq(n_calls, 8, "a put makes only %d I/O calls", n_calls);
    ASSERT_OK(rk_store_delete(s, c.key, NULL));
    int fds = count_fds();
    for (int nth = 1; nth <= n_calls; nth++) {
        rk_store_fault_io(nth);
        rk_status st = put_chunk(s, &c);
        rk_store_fault_io(0);
        cr_assert_eq(st, RK_ERR_IO, "I/O call %d of %d failed but the put gave %s", nth, n_calls,
                     rk_status_str(st));
        cr_assert(strstr(rk_error_message(), strerror(EIO)), "%s", rk_error_message());
        cr_assert_eq(present(s, c.key), 0);
        cr_assert_eq(count_files(dir, ".tmp"), 0, "call %d: temporary file left", nth);
        cr_assert_eq(count_fds(), fds, "call %d: a file descriptor leaked", nth);
        expect_consistent(s, dir, &base, 1);
    }
    rk_store_fault_io(n_calls + 1); /* past the last call: never fires */
    ASSERT_OK(put_chunk(s, &c));
    rk_store_fault_io(0);
    chunk both[2] = {base, c};
    expect_consistent(s, dir, both, 2);
    rk_store_close(s);
    chunk_free(&base);
    chunk_free(&c);
    rm_rf(dir);
}

Test(store_faults, every_failing_io_call_of_a_get_fails_it_and_serves_nothing) {
    char *dir = rk_test_tmpdir("store-fault-get");
    chunk c;
    chunk_make(&c, 610, 40, (1 << 20) + 4000); /* a body read in two pieces */
    rk_store *s = open_store(dir, FP_A, 1);
    ASSERT_OK(put_chunk(s, &c));
    rk_store_payload p;
    rk_store_fault_io(0);
    ASSERT_OK(rk_store_get(s, c.key, &p));
    int n_calls = rk_store_fault_io(0);
    rk_store_payload_free(&p);
    cr_assert_geq(n_calls, 5, "a get makes only %d I/O calls", n_calls);
    int fds = count_fds();
    for (int nth = 1; nth <= n_calls; nth++) {
        rk_store_fault_io(nth);
        rk_status st = rk_store_get(s, c.key, &p);
        rk_store_fault_io(0);
        cr_assert_eq(st, RK_ERR_IO, "I/O call %d of %d failed but the get gave %s", nth, n_calls,
                     rk_status_str(st));
        cr_assert(strstr(rk_error_message(), strerror(EIO)), "%s", rk_error_message());
        cr_assert_null(p.tokens);
        cr_assert_null(p.body);
        cr_assert_eq(count_fds(), fds, "call %d: a file descriptor leaked", nth);
        rk_store_counters st2 = stats_of(s);
        cr_assert_eq(st2.dropped_on_load, 0, "an I/O error dropped a good payload");
        cr_assert_eq(st2.quarantined, 0);
        expect_consistent(s, dir, &c, 1);
    }
    rk_store_close(s);
    chunk_free(&c);
    rm_rf(dir);
}

Test(store_faults, io_errors_while_rebuilding_leave_the_files_for_the_next_open) {
    char *dir = rk_test_tmpdir("store-fault-rebuild");
    chunk c[N_REBUILD];
    store_for_rebuild(dir, c);
    remove_db(dir, 0);
    rk_store_fault_io(1); /* the first payload read of the rebuild */
    rk_store *s = open_store(dir, FP_A, 1);
    rk_store_fault_io(0);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.unreadable, 1);
    cr_assert_eq(st.rows_rebuilt, N_REBUILD - 1);
    cr_assert_eq(st.quarantined, 0);
    rk_store_close(s);
    expect_rebuilt(dir, c); /* the next open finds the skipped one */
    for (int i = 0; i < N_REBUILD; i++) chunk_free(&c[i]);
    rm_rf(dir);
}

/* A payload whose KV holds a NaN or an infinity (checksums sound) is corrupt
 * to the service's body check: quarantined at load like a bad checksum, in
 * each KV dtype; a finite one of the same shape loads. */
Test(store_corruption, non_finite_kv_is_quarantined_at_load_in_every_kv_dtype) {
    char *dir = rk_test_tmpdir("store-nonfinite");
    rk_store_options o;
    rk_store_options_default(&o);
    o.body_check = rk_persist_body_check;
    rk_store *s = NULL;
    ASSERT_OK(rk_store_open(dir, FP_A, &o, &s));
    /* dtype, element size, a non-finite element's bits */
    const struct {
        int dtype, size;
        uint32_t bits;
    } bad[] = {{0, 4, 0x7fc00000u}, {0, 4, 0xff800000u}, {1, 2, 0x7e00u},
               {1, 2, 0x7c00u},     {2, 2, 0x7fc0u},     {2, 2, 0xff80u}};
    enum { NB = sizeof bad / sizeof bad[0] };
    chunk c[NB + 1];
    for (int i = 0; i <= NB; i++) {
        chunk_make(&c[i], 300 + (uint64_t)i, 16, 4096);
        c[i].layout.dtype = i < NB ? bad[i].dtype : 1;
        memset(c[i].body, 0, c[i].body_size); /* finite: zeros */
        if (i < NB) memcpy(c[i].body + 40 * bad[i].size, &bad[i].bits, (size_t)bad[i].size);
        ASSERT_OK(put_chunk(s, &c[i]));
    }
    for (int i = 0; i < NB; i++) {
        rk_store_payload p;
        cr_assert_eq(rk_store_get(s, c[i].key, &p), RK_ERR_NOT_FOUND, "case %d was served", i);
        cr_assert(strstr(rk_error_message(), "NaN or infinite"), "%s", rk_error_message());
        cr_assert_eq(present(s, c[i].key), 0);
        cr_assert_eq(count_quarantined(dir, c[i].key), 1, "case %d not quarantined", i);
    }
    expect_chunk(s, &c[NB]);
    rk_store_counters st = stats_of(s);
    cr_assert_eq(st.quarantined, NB);
    cr_assert_eq(st.dropped_on_load, NB);
    rk_store_close(s);
    for (int i = 0; i <= NB; i++) chunk_free(&c[i]);
    rm_rf(dir);
}
