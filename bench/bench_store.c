/* bench/bench_store.c — chunk store throughput on the local disk: payload
 * writes (fsync and rename included) and verified loads, warm (page cache)
 * and cold (the files' pages dropped with posix_fadvise), plus the checksum
 * pass a verify_on_open restart makes, for a 1 MiB payload (about a 512-token
 * chunk of a small model) and a 256-token chunk of qwen3-0.6b in f32 KV
 * (28 layers * 2 * 256 * 8 * 128 * 4 bytes = 56 MiB).
 *
 * usage: bench_store [DIR]   (default: a fresh directory under /var/tmp,
 * removed afterwards) */
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statfs.h>
#include <unistd.h>

#include "config/settings.h"
#include "store/store.h"

#define FP "0123456789abcdef0123456789abcdef"

typedef struct bench_case {
    const char *name;
    int32_t n_tokens;
    size_t body_size;
    int n_puts;
} bench_case;

static void key_of(int c, int i, char out[RK_STORE_KEY_LEN + 1]) {
    snprintf(out, RK_STORE_KEY_LEN + 1, "%08x%08x%016x", 0xbe9c0000u + (unsigned)c, (unsigned)i,
             (unsigned)(i * 2654435761u));
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static int fail(const char *what, rk_status st) {
    fprintf(stderr, "bench_store: %s: %s (%s)\n", what, rk_status_str(st), rk_error_message());
    return 1;
}

/* Drop the page cache of every payload of case c (clean pages only: the
 * files were fsync'ed). */
static void drop_cache(rk_store *s, int c, int n) {
    for (int i = 0; i < n; i++) {
        char key[RK_STORE_KEY_LEN + 1], path[4096];
        key_of(c, i, key);
        if (rk_store_payload_path(s, key, path, sizeof path) != RK_OK) continue;
        int fd = open(path, O_RDONLY);
        if (fd < 0) continue;
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
    }
}

/* Load every payload of case c; returns seconds, or < 0 on failure. */
static double load_all(rk_store *s, int c, int n, const bench_case *bc) {
    double t0 = rk_time_now();
    for (int i = 0; i < n; i++) {
        char key[RK_STORE_KEY_LEN + 1];
        key_of(c, i, key);
        rk_store_payload p;
        rk_status st = rk_store_get(s, key, &p);
        if (st != RK_OK) return fail("get", st), -1;
        if (p.body_size != bc->body_size) return -1;
        rk_store_payload_free(&p);
    }
    return rk_time_now() - t0;
}

int main(int argc, char **argv) {
    rk_cmdline cl = {.prog = "bench_store",
                     .usage = "usage: bench_store [DIR]\n"
                              "Chunk store write, load and verify throughput in DIR (default: a "
                              "fresh directory\nunder /var/tmp, removed afterwards).\n",
                     .first = 1};
    int exit_code, next = rk_cmdline_parse(&cl, argc, argv, &exit_code);
    if (next < 0) return exit_code;
    if (argc - next > 1) {
        fprintf(stderr, "bench_store: one DIR at most (see bench_store --help)\n");
        return 2;
    }
    char dir[4096];
    int own_dir = next == argc;
    if (own_dir) {
        snprintf(dir, sizeof dir, "/var/tmp/ragkv-bench-store-XXXXXX");
        if (!mkdtemp(dir)) {
            perror("bench_store: mkdtemp");
            return 1;
        }
    } else {
        snprintf(dir, sizeof dir, "%s", argv[next]);
    }
    struct statfs fs;
    int tmpfs = statfs(dir, &fs) == 0 && fs.f_type == 0x01021994;
    printf("store in %s%s\n", dir, tmpfs ? " (tmpfs: NOT a disk, numbers are memory speed)" : "");

    const bench_case cases[] = {
        {"1 MiB, 512 tok", 512, (size_t)1 << 20, 64},
        {"qwen3-0.6b 256 tok f32 (56 MiB)", 256, (size_t)28 * 2 * 256 * 8 * 128 * 4, 8},
    };
    const int n_cases = (int)(sizeof cases / sizeof *cases);
    printf("%-32s %5s %12s %9s %12s %12s %14s\n", "payload", "puts", "write MB/s", "ms/put",
           "load warm", "load cold", "verify open");
    printf("%-32s %5s %12s %9s %12s %12s %14s\n", "", "", "(fsync'ed)", "", "MB/s", "MB/s", "MB/s");
    int rc = 0;
    for (int c = 0; c < n_cases && rc == 0; c++) {
        const bench_case *bc = &cases[c];
        char sub[4200];
        snprintf(sub, sizeof sub, "%s/case%d", dir, c);
        rk_store_options o;
        rk_store_options_default(&o);
        rk_store *s = NULL;
        rk_status st = rk_store_open(sub, FP, &o, &s);
        if (st != RK_OK) return fail("open", st);
        int32_t *tokens = malloc((size_t)bc->n_tokens * sizeof *tokens);
        uint8_t *body = malloc(bc->body_size);
        if (!tokens || !body) {
            fprintf(stderr, "bench_store: out of memory\n");
            return 1;
        }
        for (int i = 0; i < bc->n_tokens; i++) tokens[i] = i * 7 + 3;
        uint64_t x = 88172645463325252ull;
        for (size_t i = 0; i < bc->body_size; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            body[i] = (uint8_t)x;
        }
        uint64_t file_bytes = RK_STORE_HEADER_BYTES + 4 * (uint64_t)bc->n_tokens + bc->body_size;
        double mb = (double)file_bytes * bc->n_puts / 1e6;

        double t0 = rk_time_now();
        for (int i = 0; i < bc->n_puts && rc == 0; i++) {
            char key[RK_STORE_KEY_LEN + 1];
            key_of(c, i, key);
            body[0] = (uint8_t)i;
            rk_store_put_args a = {.key = key,
                                   .policy = "isolated",
                                   .layout = {28, 8, 128, 0, 16, 0},
                                   .tokens = tokens,
                                   .n_tokens = bc->n_tokens,
                                   .body = body,
                                   .body_size = bc->body_size};
            if ((st = rk_store_put(s, &a)) != RK_OK) rc = fail("put", st);
        }
        double t_write = rk_time_now() - t0;
        double t_warm = rc ? -1 : load_all(s, c, bc->n_puts, bc);
        drop_cache(s, c, bc->n_puts);
        double t_cold = t_warm < 0 ? -1 : load_all(s, c, bc->n_puts, bc);
        rk_store_close(s);
        s = NULL;
        /* a restart with verify_on_open re-reads every payload (warm cache) */
        t0 = rk_time_now();
        if (t_cold >= 0 && (st = rk_store_open(sub, FP, &o, &s)) != RK_OK) rc = fail("reopen", st);
        double t_open = rk_time_now() - t0;
        rk_store_close(s);
        if (t_cold < 0) rc = 1;
        if (rc == 0)
            printf("%-32s %5d %12.0f %9.2f %12.0f %12.0f %14.0f\n", bc->name, bc->n_puts,
                   mb / t_write, 1e3 * t_write / bc->n_puts, mb / t_warm, mb / t_cold, mb / t_open);
        free(tokens);
        free(body);
    }
    if (own_dir) nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    return rc;
}
