/* tests/test_cluster.c — several replicas behind HAProxy, sharing Redis: the
 * shipped deploy/haproxy/haproxy.cfg (its ports and paths rewritten to free
 * loopback ones) in front of two real `ragkv serve` processes on one
 * redis-server. The same documents sent twice through the balancer, in
 * another order, are computed once across the cluster; a request whose
 * affinity key maps to a replica that is then killed is still answered
 * (retried on the other replica, then routed there by the health checks).
 * The deployment files parse and pass their checkers (haproxy -c, YAML with
 * the keys they must have, systemd-analyze verify where it is available).
 *
 * Skips visibly without haproxy or redis-server (scripts/install-deps.sh
 * installs both) or without ../shared/models/stories260K.gguf. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "config/config.h"
#include "tests/testutil.h"

static int have(const char *tool) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", tool);
    return rk_test_run(cmd, NULL) == 0;
}

/* The shipped HAProxy configuration, with `bind :8080` on lb_port, its
 * server-template (replicas found by DNS) replaced by the two replicas'
 * loopback ports and the runtime socket in dir (malloc'ed). */
static char *cluster_cfg(int lb_port, const int *ports, const char *dir) {
    char *src = rk_test_read_file(RK_SOURCE_DIR "/deploy/haproxy/haproxy.cfg", NULL);
    cr_assert_not_null(src, "deploy/haproxy/haproxy.cfg is missing");
    rk_strbuf out = {0};
    int binds = 0, servers = 0, sockets = 0;
    for (char *line = strtok(src, "\n"); line; line = strtok(NULL, "\n")) {
        const char *t = line + strspn(line, " ");
        if (!strcmp(t, "bind :8080")) {
            rk_strbuf_printf(&out, "    bind 127.0.0.1:%d\n", lb_port);
            binds++;
        } else if (!strncmp(t, "server-template ragkv- ", 23)) {
            for (int n = 1; n <= 2; n++)
                rk_strbuf_printf(&out, "    server ragkv-%d 127.0.0.1:%d\n", n, ports[n - 1]);
            servers++;
        } else if (!strncmp(t, "stats socket ", 13)) {
            rk_strbuf_printf(&out, "    stats socket %s/admin.sock mode 600 level admin\n", dir);
            sockets++;
        } else {
            rk_strbuf_printf(&out, "%s\n", line);
        }
    }
    free(src);
    char *text = rk_strbuf_take(&out);
    cr_assert_not_null(text);
    cr_assert(binds == 1 && servers == 1 && sockets == 1,
              "haproxy.cfg changed shape: %d binds on :8080, %d server-templates, %d sockets",
              binds, servers, sockets);
    return text;
}

/* Start haproxy -db -f cfg in the foreground, its output in log. */
static pid_t start_haproxy(const char *cfg, const char *log) {
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the test */
        if (!freopen(log, "w", stdout)) _exit(127);
        dup2(STDOUT_FILENO, STDERR_FILENO);
        execlp("haproxy", "haproxy", "-db", "-f", cfg, (char *)NULL);
        _exit(127);
    }
    return pid;
}

static void stop_pid(pid_t pid) {
    if (pid <= 0) return;
    kill(pid, SIGTERM);
    for (int i = 0; i < 500 && waitpid(pid, NULL, WNOHANG) != pid; i++) rk_test_sleep(0.01);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* A counter of the replica's /metrics (the first series whose line starts
 * with name, e.g. `ragkv_chunk_misses_total ` or
 * `ragkv_requests_total{status="200"} `); 0 when absent. */
static long long metric(rk_test_server *s, const char *name) {
    rk_test_resp r;
    cr_assert_eq(rk_test_exchange(&s->t, "GET", "/metrics", NULL, NULL, &r), 0);
    cr_assert_eq(r.http.status, 200);
    long long v = 0;
    size_t n = strlen(name);
    for (const char *p = r.http.body; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (!strncmp(p, name, n)) {
            v = atoll(p + n);
            break;
        }
    rk_test_resp_free(&r);
    return v;
}

static long long answered(rk_test_server *s) {
    return metric(s, "ragkv_requests_total{status=\"200\"} ");
}

/* The replicas' 200 counters once their sum reaches total (a request is
 * counted just after its answer is sent), at most 10 s. */
static void answered_all(rk_test_server *rep, int n, long long total, long long *out) {
    for (double until = rk_test_now() + 10;; rk_test_sleep(0.01)) {
        long long sum = 0;
        for (int i = 0; i < n; i++) sum += out[i] = rep[i].pid ? answered(&rep[i]) : 0;
        if (sum >= total || rk_test_now() > until) return;
    }
}

/* POST a completion through the balancer (headers may be NULL): its status. */
static int through(const rk_http_target *lb, const char *headers, const char *prompt) {
    char body[1024];
    snprintf(body, sizeof body, "{\"prompt\": \"%s\", \"max_tokens\": 1, \"temperature\": 0}",
             prompt);
    rk_test_resp r;
    cr_assert_eq(rk_test_exchange(lb, "POST", "/v1/completions", headers, body, &r), 0,
                 "no answer through HAProxy");
    int status = r.http.status;
    if (status != 200) cr_log_info("through HAProxy: %d %s", status, r.http.body);
    rk_test_resp_free(&r);
    return status;
}

/* Wait until the replica lists n chunks in Redis (its writes are
 * asynchronous). */
static void wait_redis_chunks(rk_test_server *s, long long n) {
    long long total = -1;
    for (double until = rk_test_now() + 30; rk_test_now() < until; rk_test_sleep(0.02)) {
        rk_test_resp r;
        cr_assert_eq(rk_test_exchange(&s->t, "GET", "/v1/chunks?tier=redis", NULL, NULL, &r), 0);
        total = r.json ? rk_test_jint(r.json, "total") : -1;
        rk_test_resp_free(&r);
        if (total >= n) return;
    }
    cr_assert_fail("Redis holds %lld chunks, not %lld", total, n);
}

static const char *DOC_A =
    "The lighthouse keeper climbed the tower every evening to light the lamp for the boats.";
static const char *DOC_B =
    "In the village below, the baker woke before dawn to bake bread for the fishermen.";
static const char *DOC_C =
    "A small red fox lived at the edge of the forest and hunted mice in the tall grass.";
static const char *DOC_D =
    "Every spring the river flooded the meadow and the children sailed paper boats on it.";

Test(cluster, two_replicas_behind_haproxy_share_documents_keep_affinity_and_fail_over,
     .timeout = 600) {
    if (!have("haproxy")) cr_skip_test("haproxy is not installed (scripts/install-deps.sh)");
    char *model;
    RK_REQUIRE_SHARED(model, "models/stories260K.gguf");
    rk_test_redis redis = {0};
    rk_test_redis_start(&redis); /* skips without redis-server */
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", redis.port);
    rk_test_server rep[2] = {{0}};
    for (int i = 0; i < 2; i++) {
        const char *args[] = {"--model",   model, "--kv-memory-mb",     "32",
                              "--redis",   url,   "--redis-min-tokens", "1",
                              "--grace-s", "10",  "--redis-wait-ms",    "5000",
                              NULL};
        cr_assert_eq(rk_test_server_start_ready(&rep[i], "cluster", NULL, args), 0,
                     "replica %d did not start; see %s", i + 1, rep[i].log);
    }
    int ports[2] = {rep[0].port, rep[1].port}, lb_port = rk_test_free_port();
    char *dir = rk_test_tmpdir("cluster-haproxy");
    char *cfg_text = cluster_cfg(lb_port, ports, dir);
    char cfg[4200], log[4200];
    snprintf(cfg, sizeof cfg, "%s/haproxy.cfg", dir);
    snprintf(log, sizeof log, "%s/haproxy.log", dir);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    fputs(cfg_text, f);
    fclose(f);
    free(cfg_text);
    pid_t lb = start_haproxy(cfg, log);
    char where[64];
    snprintf(where, sizeof where, "http://127.0.0.1:%d", lb_port);
    rk_http_target t;
    cr_assert_eq(rk_http_parse_url(where, 120, &t), RK_OK);
    /* Ready once HAProxy's checks see both replicas up: a request answers. */
    int status = 0;
    for (double until = rk_test_now() + 30; rk_test_now() < until; rk_test_sleep(0.1)) {
        rk_test_resp r;
        if (rk_test_exchange(&t, "GET", "/ready", NULL, NULL, &r) == 0) status = r.http.status;
        rk_test_resp_free(&r);
        if (status == 200) break;
    }
    char *hlog = rk_test_read_file(log, NULL);
    cr_assert_eq(status, 200, "HAProxy did not answer /ready; its log:\n%s", hlog ? hlog : "");
    free(hlog);

    /* An affinity key for each replica: X-Ragkv-Affinity decides where a
     * request goes, and the same key goes there again. */
    char key[2][128] = {"", ""};
    long long seen[2], now[2];
    answered_all(rep, 2, 0, seen);
    for (int k = 0; k < 64 && !(key[0][0] && key[1][0]); k++) {
        char h[128];
        snprintf(h, sizeof h, "X-Ragkv-Affinity: corpus-%d\r\n", k);
        cr_assert_eq(through(&t, h, "Once upon a time"), 200);
        answered_all(rep, 2, seen[0] + seen[1] + 1, now);
        for (int i = 0; i < 2; i++)
            if (now[i] > seen[i] && !key[i][0]) snprintf(key[i], sizeof key[i], "%s", h);
        memcpy(seen, now, sizeof seen);
    }
    cr_assert(key[0][0] && key[1][0], "64 keys did not reach both replicas");
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(through(&t, key[i], "Once upon a time"), 200);
        answered_all(rep, 2, seen[0] + seen[1] + 1, now);
        cr_assert_eq(now[i], seen[i] + 1, "a key moved with both replicas up");
        memcpy(seen, now, sizeof seen);
    }

    /* The same two documents, in one order on replica 1, then in the other
     * on replica 2: computed once across the cluster, the second time read
     * from Redis. */
    char prompt[512];
    snprintf(prompt, sizeof prompt, "You answer.##%s##%s##Who woke first?", DOC_A, DOC_B);
    cr_assert_eq(through(&t, key[0], prompt), 200);
    wait_redis_chunks(&rep[0], 2);
    snprintf(prompt, sizeof prompt, "You answer.##%s##%s##Who woke first?", DOC_B, DOC_A);
    cr_assert_eq(through(&t, key[1], prompt), 200);
    long long miss = 0, lookups = 0;
    for (int i = 0; i < 2; i++) {
        miss += metric(&rep[i], "ragkv_chunk_misses_total ");
        lookups += metric(&rep[i], "ragkv_chunk_lookups_total ");
    }
    cr_assert_eq(lookups, 4, "the cluster looked up %lld chunks, not 4", lookups);
    cr_assert_eq(miss, 2, "the cluster computed %lld chunks for 2 distinct documents", miss);
    cr_assert_eq(metric(&rep[1], "ragkv_chunk_hits_total{source=\"redis\"} "), 2,
                 "replica 2 did not read both documents from Redis");

    /* Without a header the first document of the body chooses: the same
     * first document (another system prompt, so no sequence is reused)
     * reaches the replica that computed it, whose KV memory has it. */
    static const char *arena = "ragkv_chunk_hits_total{source=\"arena\"} ";
    long long arena0 = metric(&rep[0], arena) + metric(&rep[1], arena);
    snprintf(prompt, sizeof prompt, "You answer.##%s##%s##Where?", DOC_C, DOC_D);
    cr_assert_eq(through(&t, NULL, prompt), 200);
    snprintf(prompt, sizeof prompt, "Be brief.##%s##%s##Where?", DOC_C, DOC_D);
    cr_assert_eq(through(&t, NULL, prompt), 200);
    cr_assert_eq(metric(&rep[0], arena) + metric(&rep[1], arena), arena0 + 2,
                 "the same first document did not reach the same replica");
    /* Replica 1 dies (SIGKILL: its port refuses connections at once, long
     * before the health checks notice). The next requests for its key are
     * answered by replica 2: first by a retry on the refused connection,
     * then by routing once the checks mark it down. */
    kill(rep[0].pid, SIGKILL);
    waitpid(rep[0].pid, NULL, 0);
    rep[0].pid = 0;
    long long other = answered(&rep[1]);
    for (int i = 0; i < 6; i++) {
        cr_assert_eq(through(&t, key[0], "Once upon a time"), 200, "request %d after the stop", i);
        if (i == 2) rk_test_sleep(3); /* past fall 2 x inter 1s: marked down */
    }
    answered_all(&rep[1], 1, other + 6, now);
    cr_assert_eq(now[0], other + 6, "replica 2 did not answer the 6 requests");

    stop_pid(lb);
    rk_test_server_stop_checked(&rep[1]);
    rk_test_redis_stop(&redis);
    rk_test_redis_free(&redis);
    free(dir);
    free(model);
}

/* ---------------------------------------------------------------- deployment files */

Test(cluster, the_haproxy_configuration_passes_haproxy_c) {
    if (!have("haproxy")) cr_skip_test("haproxy is not installed (scripts/install-deps.sh)");
    /* As shipped, but with the runtime socket in a scratch directory (the
     * shipped one is under /run/haproxy, which the test may not write). */
    char *dir = rk_test_tmpdir("cluster-haproxy-c");
    char cmd[8400], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "sed 's|/run/haproxy/|%s/|' %s/deploy/haproxy/haproxy.cfg > %s/h.cfg && "
             "RAGKV_REPLICAS=localhost haproxy -c -f %s/h.cfg 2>&1",
             dir, RK_SOURCE_DIR, dir, dir);
    cr_assert_eq(rk_test_run(cmd, &out), 0, "haproxy -c: %s", out);
    free(out);
    free(dir);
}

/* The checker script: YAML documents parse and hold the keys a deployment
 * needs (scripts/check-deploy.py). */
Test(cluster, compose_and_kubernetes_files_parse_with_their_required_keys) {
    char cmd[4200], *out = NULL;
    snprintf(cmd, sizeof cmd, "cd %s && /usr/bin/env python3 scripts/check-deploy.py 2>&1",
             RK_SOURCE_DIR);
    int rc = rk_test_run(cmd, &out);
    if (rc == 127) cr_skip_test("python3 is not installed");
    if (rc == 77) cr_skip_test("%s", out ? out : "python3 yaml is not installed");
    cr_assert_eq(rc, 0, "scripts/check-deploy.py: %s", out);
    cr_log_info("%s", out);
    free(out);
}

Test(cluster, the_systemd_unit_passes_systemd_analyze_verify) {
    if (!have("systemd-analyze")) cr_skip_test("systemd-analyze is not installed");
    char cmd[4200], *out = NULL;
    /* ExecStart must name an executable that exists for verify: a copy of
     * the unit with the binary built here. */
    char *dir = rk_test_tmpdir("cluster-systemd");
    snprintf(cmd, sizeof cmd,
             "sed 's|/usr/local/bin/ragkv|%s|g' %s/deploy/systemd/ragkv.service > "
             "%s/ragkv.service && systemd-analyze verify %s/ragkv.service 2>&1",
             RK_BIN, RK_SOURCE_DIR, dir, dir);
    int rc = rk_test_run(cmd, &out);
    cr_assert_eq(rc, 0, "systemd-analyze verify: %s", out);
    /* A line it cannot parse is only a warning, "FILE:LINE: ...": none. */
    char where[4200];
    snprintf(where, sizeof where, "%s/ragkv.service:", dir);
    cr_assert_null(strstr(out ? out : "", where), "systemd-analyze verify: %s", out);
    free(out);
    free(dir);
}
