/* bench/bench_load.c — a bounded load test of `ragkv serve`.
 *
 *   bench_load [--seconds N] [--clients N] [--url http://127.0.0.1:PORT] [--max-tokens N]
 *
 * Starts the server (the ragkv binary next to this program, embedded model,
 * --port 0) unless --url names a running one on 127.0.0.1, then runs N client
 * threads (default 16) for N seconds (default 60) mixing cache hits (a fixed
 * set of chunks), misses (fresh random chunks), streams and malformed
 * requests (bad JSON, bad fields, oversized bodies, too many chunks, unknown
 * routes). It fails (exit 1) on any 5xx other than a 503 with Retry-After,
 * on a malformed request not answered with its 4xx, on a crash, when the
 * pool and lock counts of /v1/stats are not back to their starting values
 * at the end, or when the server it started does not exit with status 0 on
 * SIGTERM (under the sanitizers: no leaks). Prints requests/s and latency
 * percentiles. */
#include <fcntl.h>
#include <jansson.h>
#include <libgen.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench/httpclient.h"
#include "bench/setup.h"

static int g_port;
static double g_seconds = 60;
static int g_clients = 16, g_max_tokens = 8;
static atomic_int g_stop;

static void sleep_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* ---------------------------------------------------------------- HTTP */

typedef rk_http_response reply;

/* The server: set once, before any client thread starts. */
static rk_http_target g_target;

/* One request over a fresh connection; returns 0 when a response came back. */
static int request(const char *method, const char *path, const char *body, size_t len, reply *r) {
    return rk_http_exchange(&g_target, method, path, NULL, body, len, r) ? -1 : 0;
}

static int retry_after(const reply *r) { return rk_http_header(r, "Retry-After") != NULL; }

static json_t *get_json(const char *path) {
    reply r;
    if (request("GET", path, NULL, 0, &r) || r.status != 200) {
        rk_http_response_free(&r);
        return NULL;
    }
    json_t *j = json_loads(r.body, 0, NULL);
    rk_http_response_free(&r);
    return j;
}

/* ---------------------------------------------------------------- the workload */

enum { K_HIT, K_MISS, K_STREAM, K_BAD, K_COUNT };
static const char *k_names[K_COUNT] = {"hit", "miss", "stream", "malformed"};

typedef struct client {
    pthread_t t;
    uint64_t rng;
    int n[K_COUNT], n_503, n_fail, n_conn_err;
    double *lat[K_COUNT]; /* ms of successful requests */
    int n_lat[K_COUNT], cap_lat[K_COUNT];
    char first_failure[512];
} client;

static uint64_t next_rand(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static const char *k_words[] = {"river",  "stone",   "green",  "market", "silver", "cloud",
                                "paper",  "engine",  "garden", "winter", "copper", "signal",
                                "harbor", "lantern", "orbit",  "meadow"};

static void random_text(client *c, char *out, size_t cap, int words) {
    size_t o = 0;
    for (int i = 0; i < words && o + 16 < cap; i++)
        o += (size_t)snprintf(out + o, cap - o, "%s%s", i ? " " : "",
                              k_words[next_rand(&c->rng) % 16]);
    snprintf(out + o, cap - o, " %llu.", (unsigned long long)(next_rand(&c->rng) % 1000000));
}

static void fail(client *c, const char *what, const reply *r) {
    c->n_fail++;
    if (!c->first_failure[0])
        snprintf(c->first_failure, sizeof c->first_failure, "%s: status %d: %.300s", what,
                 r ? r->status : -1, r && r->body ? r->body : "(no response)");
}

static void record(client *c, int kind, double ms) {
    if (c->n_lat[kind] == c->cap_lat[kind]) {
        int cap = c->cap_lat[kind] ? c->cap_lat[kind] * 2 : 1024;
        double *p = realloc(c->lat[kind], (size_t)cap * sizeof *p);
        if (!p) return;
        c->lat[kind] = p;
        c->cap_lat[kind] = cap;
    }
    c->lat[kind][c->n_lat[kind]++] = ms;
}

/* A generation: 200, or 503 with Retry-After (overloaded). */
static void generation(client *c, int kind, const char *body) {
    reply r;
    double t = rk_time_now();
    if (request("POST", "/v1/completions", body, strlen(body), &r)) {
        c->n_conn_err++;
        fail(c, "no response to a generation", NULL);
        return;
    }
    double ms = (rk_time_now() - t) * 1e3;
    c->n[kind]++;
    if (r.status == 200) {
        if (kind == K_STREAM ? !strstr(r.body, "data: [DONE]") : !strstr(r.body, "\"usage\""))
            fail(c, "a 200 without a complete body", &r);
        else
            record(c, kind, ms);
    } else if (r.status == 503 && retry_after(&r)) {
        c->n_503++;
    } else {
        fail(c, k_names[kind], &r);
    }
    rk_http_response_free(&r);
}

/* A malformed request and the status it must get. */
static void malformed(client *c) {
    static const struct {
        const char *path, *body;
        int want;
    } cases[] = {
        {"/v1/completions", "{\"prompt\": ", 400},
        {"/v1/completions", "[1, 2]", 400},
        {"/v1/completions", "{\"prompt\": 7}", 400},
        {"/v1/completions", "{\"prompt\": \"x\", \"temperature\": \"hot\"}", 400},
        {"/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": -3}", 400},
        {"/v1/completions", "{\"prompt\": \"S##A##\"}", 400},
        {"/v1/completions", "{\"prompt\": \"x\", \"repair\": {\"policy\": \"best\"}}", 400},
        {"/v1/chat/completions", "{\"messages\": []}", 400},
        {"/v1/chunks", "{\"chunks\": []}", 400},
        {"/v1/nowhere", "{}", 404},
        {"/v1/completions", NULL, 422}, /* too many chunks, built below */
        {"/v1/completions", NULL, 413}, /* oversized, built below */
    };
    int i = (int)(next_rand(&c->rng) % (sizeof cases / sizeof cases[0]));
    char *body = NULL;
    size_t len;
    if (cases[i].want == 422) {
        body = malloc(8192);
        int o = snprintf(body, 8192, "{\"prompt\": \"S");
        for (int k = 0; k < 100; k++) o += snprintf(body + o, (size_t)(8192 - o), "##c%d", k);
        snprintf(body + o, (size_t)(8192 - o), "##Q\"}");
        len = strlen(body);
    } else if (cases[i].want == 413) {
        len = 2u << 20; /* over the 1 MiB default */
        body = malloc(len);
        memset(body, 'a', len);
        memcpy(body, "{\"prompt\": \"", 12);
        memcpy(body + len - 2, "\"}", 2);
    } else {
        len = strlen(cases[i].body);
    }
    reply r;
    double t = rk_time_now();
    int rc = request("POST", cases[i].path, body ? body : cases[i].body, len, &r);
    free(body);
    c->n[K_BAD]++;
    if (rc) {
        c->n_conn_err++;
        fail(c, "no response to a malformed request", NULL);
        return;
    }
    if (r.status == cases[i].want)
        record(c, K_BAD, (rk_time_now() - t) * 1e3);
    else if (r.status == 503 && retry_after(&r))
        c->n_503++;
    else
        fail(c, "a malformed request got the wrong status", &r);
    rk_http_response_free(&r);
}

static const char *k_fixed[8] = {
    "The river runs past the old stone mill and into the green valley below.",
    "Copper wire carries the signal from the harbor to the lantern on the hill.",
    "In winter the market closes early and the paper lanterns stay dark.",
    "The engine of the silver train hums as it leaves the station at dawn.",
    "A garden of meadow flowers grows where the orbit of the moon is drawn.",
    "Clouds gather over the harbor; the fishermen pull their boats ashore.",
    "The library keeps maps of every river and stone bridge in the county.",
    "Every morning the baker lights the oven and the street smells of bread."};

static void *client_main(void *arg) {
    client *c = arg;
    char body[4096], a[512], b[512];
    while (!atomic_load(&g_stop)) {
        unsigned pick = (unsigned)(next_rand(&c->rng) % 100);
        if (pick < 25) {
            malformed(c);
            continue;
        }
        int kind = pick < 60 ? K_HIT : pick < 85 ? K_MISS : K_STREAM;
        if (kind == K_MISS) {
            random_text(c, a, sizeof a, 12);
            random_text(c, b, sizeof b, 10);
        } else {
            snprintf(a, sizeof a, "%s", k_fixed[next_rand(&c->rng) % 8]);
            snprintf(b, sizeof b, "%s", k_fixed[next_rand(&c->rng) % 8]);
        }
        snprintf(body, sizeof body,
                 "{\"prompt\": \"You answer from the documents.##%s##%s##Question %u?\", "
                 "\"max_tokens\": %d, \"temperature\": 0%s}",
                 a, b, (unsigned)(next_rand(&c->rng) % 1000), g_max_tokens,
                 kind == K_STREAM ? ", \"stream\": true" : "");
        generation(c, kind, body);
    }
    return NULL;
}

/* ---------------------------------------------------------------- the server */

static pid_t start_server(const char *bin, const char *log) {
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) dup2(fd, 2);
        execl(bin, bin, "serve", "--port", "0", (char *)NULL);
        _exit(127);
    }
    for (double until = rk_time_now() + 60; rk_time_now() < until; sleep_s(0.02)) {
        FILE *f = fopen(log, "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) {
            const char *p = strstr(line, "listening on http://127.0.0.1:");
            if (p) g_port = (int)strtol(p + strlen("listening on http://127.0.0.1:"), NULL, 10);
        }
        if (f) fclose(f);
        if (g_port > 0) break;
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) return -1;
    }
    return g_port > 0 ? pid : -1;
}

static int stop_server(pid_t pid) {
    kill(pid, SIGTERM);
    int st = 0;
    for (double until = rk_time_now() + 120; waitpid(pid, &st, WNOHANG) != pid; sleep_s(0.02))
        if (rk_time_now() > until) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

typedef struct counts {
    long long live_used, chunk_refs, prefix_locked, queued;
} counts;

static int read_counts(counts *c) {
    json_t *j = get_json("/v1/stats");
    if (!j) return -1;
    c->live_used = json_integer_value(
        json_object_get(json_object_get(json_object_get(j, "pools"), "live"), "used"));
    c->chunk_refs = json_integer_value(json_object_get(json_object_get(j, "chunks"), "referenced"));
    c->prefix_locked =
        json_integer_value(json_object_get(json_object_get(j, "prefix"), "locked_tokens"));
    c->queued = json_integer_value(json_object_get(json_object_get(j, "requests"), "queued"));
    json_decref(j);
    return 0;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(const double *v, int n, double q) {
    if (n == 0) return 0;
    int i = (int)(q * (n - 1) + 0.5);
    return v[i];
}

typedef struct opts {
    double seconds;
    int clients, max_tokens;
    char url[256];
} opts;

static const rk_setting k_settings[] = {
    {"seconds", "seconds", RK_SET_DOUBLE, offsetof(opts, seconds), 0, 0.001, 86400, 0, 0,
     "N  how long the clients run (default: 60)"},
    {"clients", "clients", RK_SET_INT, offsetof(opts, clients), 0, 1, 1024, 0, 0,
     "N  client threads (default: 16)"},
    {"max_tokens", "max-tokens", RK_SET_INT, offsetof(opts, max_tokens), 0, 0, 1 << 20, 0, 0,
     "N  max_tokens of each completion (default: 8)"},
    {"url", "url", RK_SET_STR, offsetof(opts, url), sizeof(((opts *)0)->url), 0, 0, 0, 0,
     "http://127.0.0.1:PORT  a running server (default: start `ragkv serve --port 0`)"},
};

/* The clients, run for --seconds; NULL when out of memory. */
static client *run_clients(double *elapsed) {
    client *cl = calloc((size_t)g_clients, sizeof *cl);
    if (!cl) return NULL;
    double t0 = rk_time_now();
    for (int i = 0; i < g_clients; i++) {
        cl[i].rng = 0x1234567ull * (uint64_t)(i + 1) ^ (uint64_t)time(NULL);
        pthread_create(&cl[i].t, NULL, client_main, &cl[i]);
    }
    while (rk_time_now() - t0 < g_seconds) sleep_s(0.05);
    atomic_store(&g_stop, 1);
    for (int i = 0; i < g_clients; i++) pthread_join(cl[i].t, NULL);
    *elapsed = rk_time_now() - t0;
    return cl;
}

/* The chunk cache line of /v1/stats. */
static void print_chunk_stats(void) {
    json_t *stats = get_json("/v1/stats");
    json_t *ch = json_object_get(stats, "chunks");
    if (ch)
        printf("  chunk cache: %lld lookups, hit rate %.3f, %lld entries, %lld capacity "
               "evictions\n",
               (long long)json_integer_value(json_object_get(ch, "lookups")),
               json_real_value(json_object_get(ch, "hit_rate")),
               (long long)json_integer_value(json_object_get(ch, "entries")),
               (long long)json_integer_value(
                   json_object_get(json_object_get(ch, "evictions"), "capacity")));
    json_decref(stats);
}

/* Start `ragkv serve` from next to this program, its stderr into log. */
static pid_t start_own_server(char *log, size_t log_size) {
    char exe[4096], bin[4200];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return -1;
    exe[n] = '\0';
    snprintf(bin, sizeof bin, "%s/ragkv", dirname(exe));
    snprintf(log, log_size, "/tmp/bench_load-%d.log", (int)getpid());
    pid_t pid = start_server(bin, log);
    if (pid <= 0) fprintf(stderr, "bench_load: cannot start %s (log: %s)\n", bin, log);
    return pid;
}

typedef struct totals {
    int n[K_COUNT], n_503, n_fail, total;
    const char *first; /* the first failure a client kept, or NULL */
} totals;

static void sum_clients(const client *cl, totals *t) {
    memset(t, 0, sizeof *t);
    for (int i = 0; i < g_clients; i++) {
        for (int k = 0; k < K_COUNT; k++) t->n[k] += cl[i].n[k];
        t->n_503 += cl[i].n_503;
        t->n_fail += cl[i].n_fail;
        if (!t->first && cl[i].first_failure[0]) t->first = cl[i].first_failure;
    }
    for (int k = 0; k < K_COUNT; k++) t->total += t->n[k];
}

/* Latency percentiles over every client: the generations together, then
 * each kind of request. */
static void print_latency(const client *cl) {
    double *lat[K_COUNT], *all = NULL;
    int n_lat[K_COUNT] = {0}, n_all = 0;
    for (int k = 0; k < K_COUNT; k++) {
        for (int i = 0; i < g_clients; i++) n_lat[k] += cl[i].n_lat[k];
        lat[k] = malloc((size_t)(n_lat[k] + 1) * sizeof *lat[k]);
    }
    all = malloc((size_t)(n_lat[K_HIT] + n_lat[K_MISS] + n_lat[K_STREAM] + 1) * sizeof *all);
    for (int k = 0; k < K_COUNT; k++) {
        int o = 0;
        for (int i = 0; i < g_clients; i++) {
            memcpy(lat[k] + o, cl[i].lat[k], (size_t)cl[i].n_lat[k] * sizeof(double));
            o += cl[i].n_lat[k];
            if (k != K_BAD)
                memcpy(all + n_all, cl[i].lat[k], (size_t)cl[i].n_lat[k] * sizeof(double)),
                    n_all += cl[i].n_lat[k];
        }
        qsort(lat[k], (size_t)n_lat[k], sizeof(double), cmp_double);
    }
    qsort(all, (size_t)n_all, sizeof(double), cmp_double);
    printf("  generation latency ms (%d answered 200): p50 %.2f  p99 %.2f\n", n_all,
           pct(all, n_all, 0.5), pct(all, n_all, 0.99));
    for (int k = 0; k < K_COUNT; k++)
        printf("    %-9s p50 %8.2f  p99 %8.2f  (n %d)\n", k_names[k], pct(lat[k], n_lat[k], 0.5),
               pct(lat[k], n_lat[k], 0.99), n_lat[k]);
    for (int k = 0; k < K_COUNT; k++) free(lat[k]);
    free(all);
}

/* Wait (up to a minute) for the queue to empty and the pools and locks to
 * be back where they started; 1 when they are. */
static int wait_settled(const counts *base, counts *end) {
    for (double until = rk_time_now() + 60; rk_time_now() < until; sleep_s(0.05)) {
        if (read_counts(end)) break;
        if (end->queued == 0 && end->live_used == base->live_used &&
            end->chunk_refs == base->chunk_refs && end->prefix_locked == base->prefix_locked)
            return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    static const char *usage =
        "usage: bench_load [--seconds N] [--clients N] [--max-tokens N] [--url URL]\n"
        "A bounded load test of `ragkv serve`: hits, misses, streams and malformed requests\n"
        "from N clients; exit status 1 on a server error, a wrong answer to a bad request,\n"
        "pool or lock counts not back at the end, or an unclean shutdown.\n";
    opts a = {.seconds = g_seconds, .clients = g_clients, .max_tokens = g_max_tokens};
    rk_settings own = {k_settings, sizeof k_settings / sizeof k_settings[0], &a};
    int exit_code;
    if (rk_bench_parse("bench_load", usage, NULL, 0, &own, argc, argv, &exit_code))
        return exit_code;
    g_seconds = a.seconds;
    g_clients = a.clients;
    g_max_tokens = a.max_tokens;
    const char *url = a.url[0] ? a.url : NULL;
    signal(SIGPIPE, SIG_IGN);
    pid_t pid = 0;
    char log[4200] = "";
    if (url) {
        if (sscanf(url, "http://127.0.0.1:%d", &g_port) != 1 || g_port <= 0) {
            fprintf(stderr, "bench_load: --url must be http://127.0.0.1:PORT\n");
            return 2;
        }
    } else if ((pid = start_own_server(log, sizeof log)) <= 0) {
        return 1;
    }
    char where[64];
    snprintf(where, sizeof where, "http://127.0.0.1:%d", g_port);
    if (rk_http_parse_url(where, 300, &g_target)) {
        fprintf(stderr, "bench_load: %s\n", rk_error_message());
        if (pid) stop_server(pid);
        return 1;
    }
    /* Wait until the model is loaded. */
    json_t *h = NULL;
    for (double until = rk_time_now() + 60; !(h = get_json("/ready")) && rk_time_now() < until;)
        sleep_s(0.02);
    json_decref(h);
    counts base;
    if (read_counts(&base)) {
        fprintf(stderr, "bench_load: /v1/stats did not answer\n");
        if (pid) stop_server(pid);
        return 1;
    }

    double elapsed;
    client *cl = run_clients(&elapsed);
    if (!cl) {
        fprintf(stderr, "bench_load: out of memory\n");
        if (pid) stop_server(pid);
        return 1;
    }

    totals t;
    sum_clients(cl, &t);
    /* Pools and locks back where they started, once the queue is empty. */
    counts end = {0};
    int settled = wait_settled(&base, &end);

    printf("bench_load: %.1f s, %d clients: %d requests, %.1f requests/s\n", elapsed, g_clients,
           t.total, t.total / elapsed);
    printf("  by kind: %d hit, %d miss, %d stream, %d malformed; 503 with Retry-After: %d; "
           "failures: %d\n",
           t.n[K_HIT], t.n[K_MISS], t.n[K_STREAM], t.n[K_BAD], t.n_503, t.n_fail);
    print_latency(cl);
    print_chunk_stats();
    printf("  after: live blocks used %lld (start %lld), chunk refs %lld, prefix locked tokens "
           "%lld: %s\n",
           end.live_used, base.live_used, end.chunk_refs, end.prefix_locked,
           settled ? "back to baseline" : "NOT back to baseline");
    int ok = t.n_fail == 0 && settled && t.total > 0;
    if (t.first) printf("  first failure: %s\n", t.first);
    if (pid) {
        int st = stop_server(pid);
        printf("  server exit status on SIGTERM: %d%s\n", st, st ? " (see the log)" : "");
        if (st) {
            ok = 0;
            printf("  server log: %s\n", log);
        } else {
            unlink(log);
        }
    }
    for (int k = 0; k < K_COUNT; k++)
        for (int i = 0; i < g_clients; i++) free(cl[i].lat[k]);
    free(cl);
    printf("bench_load: %s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
}
