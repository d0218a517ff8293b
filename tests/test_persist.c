/* tests/test_persist.c — the disk tier: chunks written through to the store,
 * loaded back after a restart (identical results), offline pre-warming with
 * the real binary (progress, resumption, malformed lines, SIGKILL at random
 * points), failing writes that leave serving untouched, and deletes in a
 * read-only store that say what stayed and never come back. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <jansson.h>
#include <linux/fs.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "pipeline/pipeline.h"
#include "store/payload.h"
#include "tests/testutil.h"

static rk_service *open_with_store_kv(const char *model, const char *dir, const char *dtype) {
    rk_config cfg;
    rk_config_defaults(&cfg);
    cfg.n_threads = 2;
    cfg.kv_memory_mb = 64;
    snprintf(cfg.kv_dtype, sizeof cfg.kv_dtype, "%s", dtype);
    snprintf(cfg.store_dir, sizeof cfg.store_dir, "%s", dir);
    rk_service *svc;
    cr_assert_eq(rk_service_open(&cfg, model, &svc), RK_OK, "%s", rk_error_message());
    return svc;
}

static rk_service *open_with_store(const char *model, const char *dir) {
    return open_with_store_kv(model, dir, "auto");
}

typedef struct first_logits {
    float *v;
    int n;
} first_logits;

static void keep_first(void *ctx, int req, int step, const float *logits, int n_vocab) {
    first_logits *f = ctx;
    (void)req;
    if (step != 0) return;
    f->v = malloc((size_t)n_vocab * sizeof *f->v);
    memcpy(f->v, logits, (size_t)n_vocab * sizeof *f->v);
    f->n = n_vocab;
}

/* Run prompt greedily for 8 tokens; fills r (caller frees) and the first logits. */
static void run(rk_service *svc, const char *prompt, rk_request *r, first_logits *fl) {
    rk_split sp;
    cr_assert_eq(rk_split_prompt(prompt, strlen(prompt), NULL, 64, &sp), RK_OK);
    memset(r, 0, sizeof *r);
    rk_req_options_default(&r->opt);
    r->opt.max_tokens = 8;
    r->opt.sampling.temperature = 0;
    r->opt.stop_at_eog = 0;
    r->opt.prefix_cache = 0; /* a repeat would reuse its earlier sequence, chunks and all */
    cr_assert_eq(rk_request_prepare(svc, &sp, r), RK_OK, "%s", rk_error_message());
    rk_split_free(&sp);
    rk_pipeline_hooks h = {.ctx = fl, .on_logits = fl ? keep_first : NULL};
    rk_request *one = r;
    cr_assert_eq(rk_pipeline_run(svc, &one, 1, &h), RK_OK, "%s", rk_error_message());
}

static const char *PROMPT =
    "Tell a story.##Lily found a shiny key under the old tree.##"
    "The key opened a small wooden box full of letters.##What was in the box?";

/* Q8_0 KV goes through the store as its blocks (34 bytes per 32 values) and
 * comes back identical; a service keeping another KV type finds none of it
 * (the type is part of the chunk key and of the payload's layout record). */
Test(persist, q8_0_chunks_round_trip_through_the_store_and_other_types_miss_them) {
    char *dir = rk_test_tmpdir("persist-q8");
    rk_service *svc = open_with_store_kv(NULL, dir, "q8_0");
    rk_request a, b, c;
    first_logits la = {0}, lb = {0};
    run(svc, PROMPT, &a, &la);
    cr_assert_eq(a.chunk_reports[0].source, RK_CHUNK_SOURCE_COMPUTED);
    rk_service_close(svc);
    svc = open_with_store_kv(NULL, dir, "q8_0");
    run(svc, PROMPT, &b, &lb);
    cr_assert_eq(b.chunk_reports[0].source, RK_CHUNK_SOURCE_DISK);
    cr_assert_eq(b.chunk_reports[1].source, RK_CHUNK_SOURCE_DISK);
    cr_assert_arr_eq(la.v, lb.v, (size_t)la.n * sizeof(float),
                     "loaded q8_0 KV gives the same logits");
    cr_assert_arr_eq(a.out_tokens, b.out_tokens, 8 * sizeof(int32_t));
    rk_service_close(svc);
    svc = open_with_store_kv(NULL, dir, "f16");
    run(svc, PROMPT, &c, NULL);
    cr_assert_eq(c.chunk_reports[0].source, RK_CHUNK_SOURCE_COMPUTED, "f16 finds no q8_0 chunk");
    rk_service_close(svc);
    rk_request_free(&a);
    rk_request_free(&b);
    rk_request_free(&c);
    free(la.v);
    free(lb.v);
    free(dir);
}

Test(persist, a_restart_serves_chunks_from_disk_with_identical_results) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    char *dir = rk_test_tmpdir("persist");
    rk_service *svc = open_with_store(model, dir);
    rk_request a;
    first_logits la = {0};
    run(svc, PROMPT, &a, &la);
    cr_assert_eq(a.chunk_reports[0].source, RK_CHUNK_SOURCE_COMPUTED);
    rk_store_counters sc;
    rk_store_stats(svc->store, &sc);
    cr_assert_eq(sc.rows, 2, "both chunks were written through");
    rk_service_close(svc);

    svc = open_with_store(model, dir); /* the restart */
    rk_request b, c;
    first_logits lb = {0};
    run(svc, PROMPT, &b, &lb);
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(b.chunk_reports[k].status, RK_CHUNK_STATUS_HIT);
        cr_assert_eq(b.chunk_reports[k].source, RK_CHUNK_SOURCE_DISK);
    }
    cr_assert_eq(b.cached_tokens,
                 b.chunk_reports[0].tokens + b.chunk_reports[1].tokens + b.sys_cached);
    /* Same tokens as the fresh compute; logits within 1e-5 of their scale (the
     * fresh run's first pass also computed the chunks, so its matmuls took
     * more rows and may round differently). */
    cr_assert_eq(memcmp(a.out_tokens, b.out_tokens, 8 * sizeof(int32_t)), 0);
    double scale = 0, d = 0;
    for (int i = 0; i < la.n; i++) {
        scale = fmax(scale, fabs(la.v[i]));
        d = fmax(d, fabs((double)la.v[i] - lb.v[i]));
    }
    cr_assert_leq(d, 1e-5 * scale, "logits differ by %g (scale %g)", d, scale);
    /* The disk payload is byte for byte what the arena held: a disk hit and an
     * arena hit give bit-identical logits. */
    first_logits lc = {0};
    run(svc, PROMPT, &c, &lc);
    cr_assert_eq(c.chunk_reports[0].source, RK_CHUNK_SOURCE_ARENA,
                 "the next hit comes from memory");
    for (int i = 0; i < lb.n; i++) cr_assert_eq(lb.v[i], lc.v[i], "logit %d differs", i);
    free(lc.v);
    rk_chunk_stats cs;
    rk_chunk_index_get_stats(svc->chunks, &cs);
    cr_assert_eq(cs.disk_loads, 2);
    cr_assert_eq(cs.computes, 0);
    rk_request_free(&a);
    rk_request_free(&b);
    rk_request_free(&c);
    free(la.v);
    free(lb.v);
    rk_service_close(svc);
    free(dir);
    free(model);
}

Test(persist, failing_writes_leave_serving_untouched) {
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    char *dir = rk_test_tmpdir("persist-full");
    rk_service *svc = open_with_store(model, dir);
    /* A full disk: files may not grow past 4 KiB (each payload is larger). */
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {4096, 4096};
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
    rk_request a, b;
    run(svc, PROMPT, &a, NULL);
    cr_assert_eq(a.chunk_reports[0].status, RK_CHUNK_STATUS_MISS);
    cr_assert_eq(a.n_out, 8, "the request is served from the arena");
    rk_store_counters sc;
    rk_store_stats(svc->store, &sc);
    cr_assert_eq(sc.rows, 0, "nothing half-written is kept");
    run(svc, PROMPT, &b, NULL);
    cr_assert_eq(b.chunk_reports[0].source, RK_CHUNK_SOURCE_ARENA);
    cr_assert_eq(memcmp(a.out_tokens, b.out_tokens, 8 * sizeof(int32_t)), 0);
    rk_request_free(&a);
    rk_request_free(&b);
    rk_service_close(svc);
    free(dir);
    free(model);
}

/* ---------------------------------------------------------------- the binary */

static char *write_corpus(const char *dir, int n, int bad_line) {
    char *path = malloc(strlen(dir) + 32);
    sprintf(path, "%s/corpus.jsonl", dir);
    FILE *f = fopen(path, "w");
    for (int i = 0; i < n; i++) {
        if (i == bad_line) fprintf(f, "{\"id\": \"broken\", \"text\": \n");
        fprintf(f,
                "{\"id\": \"doc-%d#0\", \"text\": \"Document %d says the answer is %d and "
                "that the sky over town %d was clear on day %d.\"}\n",
                i, i, i * 7, i % 13, i);
    }
    fclose(f);
    return path;
}

Test(persist, prewarm_then_generate_hits_from_disk_then_from_the_arena) {
    char *dir = rk_test_tmpdir("prewarm");
    char *corpus = write_corpus(dir, 5, -1);
    char cmd[8192], *out;
    snprintf(cmd, sizeof cmd, "%s prewarm --input %s --store %s/store 2>&1", RK_BIN, corpus, dir);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out);
    cr_assert(strstr(out, "5 computed") != NULL, "%s", out);
    free(out);
    /* Rerun: resumable, nothing computed again. */
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out);
    cr_assert(strstr(out, "0 computed, 5 already cached") != NULL, "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd,
             "%s generate --store %s/store --no-prefix-cache --json --repeat 2 -n 2 --temp 0 "
             "--prompt "
             "'S##Document 3 says the answer is 21 and that the sky over town 3 was clear on day "
             "3.##Document 1 says the answer is 7 and that the sky over town 1 was clear on day "
             "1.##Q'",
             RK_BIN, dir);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out);
    char *second = strchr(out, '\n');
    cr_assert_not_null(second);
    *second++ = '\0';
    cr_assert(strstr(out, "\"source\":\"disk\"") && !strstr(out, "\"source\":\"computed\""),
              "first request: %s", out);
    cr_assert(strstr(second, "\"source\":\"arena\"") && !strstr(second, "\"source\":\"disk\""),
              "second request: %s", second);
    free(out);
    free(corpus);
    free(dir);
}

/* Overwrite the first bytes of DIR/chunks.db, as a disk error would. */
static void clobber_db(const char *store) {
    char path[4200];
    snprintf(path, sizeof path, "%s/chunks.db", store);
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f, "%s", path);
    for (int i = 0; i < 100; i++) fputc(0x5a, f);
    cr_assert_eq(fclose(f), 0);
}

/* Prewarm 3 documents into DIR/store, damage or remove its chunks.db as
 * told, and return the generate command that asks for documents 0 and 2. */
static void lost_db_setup(char *dir, char *store, size_t cap, char *gen, size_t gen_cap) {
    char *corpus = write_corpus(dir, 3, -1);
    char cmd[8192], *out;
    snprintf(store, cap, "%s/store", dir);
    snprintf(cmd, sizeof cmd, "%s prewarm --input %s --store %s 2>&1", RK_BIN, corpus, store);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out);
    free(out);
    free(corpus);
    snprintf(gen, gen_cap,
             "%s generate --store %s --json -n 1 --temp 0 --prompt 'S##Document 0 says the answer "
             "is 0 and that the sky over town 0 was clear on day 0.##Document 2 says the answer is "
             "14 and that the sky over town 2 was clear on day 2.##Q' 2>&1",
             RK_BIN, store);
}

Test(persist, removed_store_database_is_rebuilt_and_chunks_still_come_from_disk) {
    char *dir = rk_test_tmpdir("lostdb");
    char store[4096], gen[8192], path[4200], *out;
    lost_db_setup(dir, store, sizeof store, gen, sizeof gen);
    snprintf(path, sizeof path, "%s/chunks.db", store);
    cr_assert_eq(unlink(path), 0);
    cr_assert_eq(rk_test_run(gen, &out), 0, "%s", out);
    cr_assert(strstr(out, "rebuilt 3 rows"), "start-up does not say it rebuilt: %s", out);
    cr_assert(strstr(out, "\"source\":\"disk\"") && !strstr(out, "\"source\":\"computed\""),
              "the chunks were not served from disk: %s", out);
    free(out);
    free(dir);
}

Test(persist, corrupt_store_database_names_the_way_out_and_cache_rebuild_takes_it) {
    char *dir = rk_test_tmpdir("corruptdb");
    char store[4096], gen[8192], cmd[8192], *out;
    lost_db_setup(dir, store, sizeof store, gen, sizeof gen);
    clobber_db(store);
    cr_assert_neq(rk_test_run(gen, &out), 0, "started over a corrupt database: %s", out);
    char want[4200];
    snprintf(want, sizeof want, "ragkv cache rebuild --store %s", store);
    cr_assert(strstr(out, want), "the error does not name the way out: %s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s cache rebuild --store %s 2>&1", RK_BIN, store);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out);
    cr_assert(strstr(out, "chunks.db.corrupt-") && strstr(out, "rebuilt 3 rows"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s cache verify --store %s 2>&1", RK_BIN, store);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out);
    cr_assert(strstr(out, "checked 3 payloads: 0 bad, 0 orphan files"), "%s", out);
    free(out);
    cr_assert_eq(rk_test_run(gen, &out), 0, "%s", out);
    cr_assert(strstr(out, "\"source\":\"disk\"") && !strstr(out, "\"source\":\"computed\""),
              "the chunks were not served from disk after the rebuild: %s", out);
    free(out);
    free(dir);
}

Test(persist, malformed_input_lines_are_reported_and_skipped) {
    char *dir = rk_test_tmpdir("prewarm-bad");
    char *corpus = write_corpus(dir, 4, 2);
    char cmd[8192], *out;
    snprintf(cmd, sizeof cmd, "%s prewarm --input %s --store %s/store 2>&1", RK_BIN, corpus, dir);
    cr_assert_eq(rk_test_run(cmd, &out), 1, "%s", out);
    cr_assert(strstr(out, "corpus.jsonl:3:") != NULL, "the message names line 3: %s", out);
    cr_assert(strstr(out, "4 computed") != NULL, "%s", out);
    free(out);
    free(corpus);
    free(dir);
}

Test(persist, prewarm_killed_at_random_points_always_leaves_a_consistent_store, .timeout = 600) {
    char *dir = rk_test_tmpdir("prewarm-kill");
    char *corpus = write_corpus(dir, 200, -1);
    char store[4096], cmd[8192], *out;
    snprintf(store, sizeof store, "%s/store", dir);
    srand(4242);
    for (int round = 0; round < 20; round++) {
        pid_t pid = fork();
        cr_assert_neq(pid, -1);
        if (pid == 0) {
            freopen("/dev/null", "w", stderr);
            execl(RK_BIN, RK_BIN, "prewarm", "--input", corpus, "--store", store, "--batch", "8",
                  (char *)NULL);
            _exit(127);
        }
        /* Kill at a random point once the store exists (a slow build,
         * such as the sanitizer one, takes a while to get there). */
        char db[4200];
        snprintf(db, sizeof db, "%s/chunks.db", store);
        for (int ms = 0; ms < 30000 && access(db, F_OK) != 0; ms += 5) usleep(5000);
        usleep((useconds_t)(20000 + rand() % 400000));
        kill(pid, SIGKILL);
        int status;
        waitpid(pid, &status, 0);
        /* chunks.db appears only whole, so no kill leaves a half-made one. */
        cr_assert_eq(access(db, F_OK), 0, "round %d: the store was never created", round);
        snprintf(cmd, sizeof cmd, "%s cache verify --store %s 2>&1", RK_BIN, store);
        cr_assert_eq(rk_test_run(cmd, &out), 0, "round %d: the store does not verify:\n%s", round,
                     out);
        free(out);
    }
    snprintf(cmd, sizeof cmd, "%s prewarm --input %s --store %s 2>&1", RK_BIN, corpus, store);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s cache stats --store %s 2>&1", RK_BIN, store);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out);
    cr_assert(strstr(out, "200") != NULL, "all 200 chunks are stored: %s", out);
    free(out);
    free(corpus);
    free(dir);
}

/* Put a NaN into the KV of the payload file at path, its checksums
 * recomputed, as a damaged disk or a careless tool could. */
static void poison_payload(const char *path) {
    size_t len = 0;
    char *b = rk_test_read_file(path, &len);
    cr_assert_not_null(b, "%s", path);
    rk_payload_header h;
    cr_assert_eq(rk_payload_header_decode(path, (uint8_t *)b, len, &h), RK_OK, "%s",
                 rk_error_message());
    int32_t *toks = (int32_t *)(void *)(b + RK_STORE_HEADER_BYTES);
    char *kv = b + RK_STORE_HEADER_BYTES + 4 * (size_t)h.n_tokens;
    if (h.layout.dtype == RK_DTYPE_F32) {
        float nan = NAN;
        memcpy(kv + h.body_size / 4 / 2 * 4, &nan, sizeof nan);
    } else { /* f16 (the default) or bf16: both NaNs have the top exponent bits set */
        cr_assert(h.layout.dtype == RK_DTYPE_F16 || h.layout.dtype == RK_DTYPE_BF16,
                  "an f32, f16 or bf16 KV store");
        uint16_t nan = h.layout.dtype == RK_DTYPE_F16 ? 0x7e00 : 0x7fc0;
        memcpy(kv + h.body_size / 2 / 2 * 2, &nan, sizeof nan);
    }
    rk_payload_checksum(toks, h.n_tokens, kv, (size_t)h.body_size, h.checksum);
    rk_payload_header_encode(&h, (uint8_t *)b);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(b, 1, len, f), len);
    fclose(f);
    free(b);
}

Test(persist, nan_kv_on_disk_is_found_by_verify_and_quarantined_at_load_never_served) {
    char *dir = rk_test_tmpdir("nan-disk");
    char store[4096], gen[8192], cmd[16384], *out, *files;
    lost_db_setup(dir, store, sizeof store, gen, sizeof gen);
    snprintf(cmd, sizeof cmd, "find %s/kv -name '*.kv'", store);
    cr_assert_eq(rk_test_run(cmd, &files), 0);
    int n = 0;
    for (char *line = strtok(files, "\n"); line; line = strtok(NULL, "\n"), n++)
        poison_payload(line);
    free(files);
    cr_assert_eq(n, 3);
    /* The rows' checksums are the old ones: rebuild them from the files, as
     * the files now say (their checksums are sound). */
    snprintf(cmd, sizeof cmd, "rm %s/chunks.db && %s cache rebuild --store %s 2>&1", store, RK_BIN,
             store);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "%s", out);
    cr_assert(strstr(out, "rebuilt 3 rows"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s cache verify --store %s 2>&1", RK_BIN, store);
    cr_assert_eq(rk_test_run(cmd, &out), 1, "verify passed NaN KV: %s", out);
    cr_assert(strstr(out, "NaN or infinite") && strstr(out, "3 bad"), "%s", out);
    free(out);
    cr_assert_eq(rk_test_run(gen, &out), 0, "%s", out);
    cr_assert(!strstr(out, "\"source\":\"disk\""), "NaN KV was served from disk: %s", out);
    cr_assert(strstr(out, "\"source\":\"computed\""), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "ls %s/quarantine | wc -l", store);
    cr_assert_eq(rk_test_run(cmd, &out), 0);
    /* The store's open (verify_on_open) checks every payload's KV too. */
    cr_assert_eq(atoi(out), 3, "the bad payloads were not quarantined: %s", out);
    free(out);
    free(dir);
}

/* ---------------------------------------------------------------- deletes that cannot remove a
 * file */

static rk_test_server g_srv;

static void stop_srv(void) { rk_test_server_stop_checked(&g_srv); }

/* Make directory dir unwritable (on 1) or writable again (on 0) for the
 * server: chmod for a user, the immutable attribute for root, whom
 * permissions do not bind. Returns 1 when, made unwritable, no file can be
 * created in it; 0 when that could not be arranged here (then undone). */
static int set_unwritable(const char *dir, int on) {
    if (geteuid() == 0) {
        int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0) return 0;
        int flags = 0, ok = ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
        if (ok) {
            flags = on ? flags | FS_IMMUTABLE_FL : flags & ~FS_IMMUTABLE_FL;
            ok = ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0;
        }
        close(fd);
        if (!ok) return 0;
    } else if (chmod(dir, on ? 0555 : 0755) != 0) {
        return 0;
    }
    if (!on) return 1;
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/probe", dir);
    int fd = open(probe, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return 1;
    close(fd);
    unlink(probe);
    set_unwritable(dir, 0);
    return 0;
}

static rk_test_resp srv_call(const char *method, const char *path, const char *body) {
    rk_test_resp r;
    cr_assert_eq(rk_test_exchange(&g_srv.t, method, path, NULL, body, &r), 0, "%s %s: no answer",
                 method, path);
    return r;
}

/* With the store's directories read-only, DELETE and flush remove the rows
 * but not the files: their answers say so ("disk": false and the reason;
 * disk_files_left), and no restart brings the chunks back; the first start
 * that can write removes the files. */
Test(persist, a_delete_that_cannot_remove_its_file_says_so_and_a_restart_keeps_it_deleted,
     .fini = stop_srv, .timeout = 300) {
    char *dir = rk_test_tmpdir("persist-rodel");
    const char *args[] = {"--store", dir, NULL};
    cr_assert_eq(rk_test_server_start_ready(&g_srv, "persist", NULL, args), 0);
    rk_test_resp r = srv_call("POST", "/v1/chunks",
                              "{\"chunks\": [\"A chunk that will be deleted.\", \"A chunk that "
                              "will be flushed.\"], \"persist\": true}");
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    char key[2][33], sub[2][4200], file[2][4300]; /* dir is a short scratch path */
    for (int i = 0; i < 2; i++) {
        char p[32];
        snprintf(p, sizeof p, "data.%d.key", i);
        snprintf(key[i], sizeof key[i], "%s", rk_test_jstr(r.json, p));
        snprintf(sub[i], sizeof sub[i], "%.4000s/kv/%.2s", dir, key[i]);
        snprintf(file[i], sizeof file[i], "%s/kv/%.2s/%.32s.kv", dir, key[i], key[i]);
        cr_assert_eq(access(file[i], F_OK), 0, "%s was not written", file[i]);
    }
    rk_test_resp_free(&r);
    int ro = 1;
    for (int i = 0; i < 2; i++) ro = ro && set_unwritable(sub[i], 1);
    if (!ro) {
        for (int i = 0; i < 2; i++) set_unwritable(sub[i], 0);
        free(dir);
        cr_skip_test("cannot make a directory unwritable here (no immutable attribute)");
    }

    /* What the server answers and keeps while the directories stay read-only;
     * checked once they are writable again, so a failure leaves none behind. */
    char path[80];
    snprintf(path, sizeof path, "/v1/chunks/%s", key[0]);
    rk_test_resp del = srv_call("DELETE", path, NULL);
    rk_test_resp flush = srv_call("POST", "/v1/cache/flush", "{\"what\": \"all\", \"disk\": true}");
    int stopped = rk_test_server_stop(&g_srv);
    int restarted = rk_test_server_start_ready(&g_srv, "persist", NULL, args);
    rk_test_resp stats = restarted ? (rk_test_resp){0} : srv_call("GET", "/v1/stats", NULL);
    int stopped2 = restarted ? -1 : rk_test_server_stop(&g_srv);
    for (int i = 0; i < 2; i++) cr_assert(set_unwritable(sub[i], 0));

    cr_assert_eq(del.http.status, 200, "%s", del.http.body);
    cr_assert(json_is_true(rk_test_jget(del.json, "arena")), "%s", del.http.body);
    cr_assert(json_is_false(rk_test_jget(del.json, "disk")), "%s", del.http.body);
    const char *why = rk_test_jstr(del.json, "disk_error");
    cr_assert(why && strstr(why, key[0]) && !strstr(why, dir), "%s", del.http.body);
    cr_assert_eq(flush.http.status, 200, "%s", flush.http.body);
    cr_assert_eq(rk_test_jint(flush.json, "flushed.disk_rows"), 1, "%s", flush.http.body);
    cr_assert_eq(rk_test_jint(flush.json, "flushed.disk_files_left"), 1, "%s", flush.http.body);
    cr_assert(rk_test_jstr(flush.json, "flushed.disk_error"), "%s", flush.http.body);
    cr_assert_eq(stopped, 0);
    cr_assert_eq(restarted, 0);
    cr_assert_eq(rk_test_jint(stats.json, "store.rows"), 0, "the chunks came back: %s",
                 stats.http.body);
    cr_assert_eq(rk_test_jint(stats.json, "store.rows_rebuilt"), 0, "%s", stats.http.body);
    cr_assert_eq(stopped2, 0);
    for (int i = 0; i < 2; i++) cr_assert_eq(access(file[i], F_OK), 0, "%s went", file[i]);
    rk_test_resp_free(&del);
    rk_test_resp_free(&flush);
    rk_test_resp_free(&stats);

    /* Writable again: the next start removes both files and serves neither. */
    cr_assert_eq(rk_test_server_start_ready(&g_srv, "persist", NULL, args), 0);
    r = srv_call("GET", "/v1/stats", NULL);
    cr_assert_eq(rk_test_jint(r.json, "store.rows"), 0, "%s", r.http.body);
    cr_assert_eq(rk_test_jint(r.json, "store.rows_rebuilt"), 0, "%s", r.http.body);
    rk_test_resp_free(&r);
    for (int i = 0; i < 2; i++) cr_assert_neq(access(file[i], F_OK), 0, "%s stayed", file[i]);
    free(dir);
}
