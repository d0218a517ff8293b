/* tests/test_http_framing.c — where a request ends, and what slow clients
 * can hold, against the real `ragkv serve` on loopback over plain sockets:
 * requests whose framing two readers could take two ways (a proxy in front
 * and ragkv) are refused and their connection closed, so that bytes sent as
 * a body never run as a request; slow headers and slow bodies are cut at
 * their deadlines, hold no request slot, and never keep /health waiting. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bench/httpclient.h"
#include "tests/testutil.h"

static rk_test_server S;

static void start_default(void) {
    cr_assert_eq(rk_test_server_start_ready(&S, "framing", NULL, NULL), 0,
                 "the server did not start");
}

static void stop_server(void) { rk_test_server_stop_checked(&S); }

/* ---------------------------------------------------------------- raw sockets */

static int connect_from(const char *from, double timeout_s) {
    return rk_test_connect(S.port, from, timeout_s);
}

/* The number of whole responses at the start of raw (each framed by its
 * Content-Length). */
static int whole_responses(const char *raw, size_t len) {
    int n = 0;
    for (const char *p = raw; p < raw + len && !strncmp(p, "HTTP/1.1 ", 9); n++) {
        const char *end = strstr(p, "\r\n\r\n"), *cl = strstr(p, "\r\nContent-Length: ");
        if (!end || !cl || cl > end) break;
        const char *next = end + 4 + atol(cl + 18);
        if (next > raw + len) break;
        p = next;
    }
    return n;
}

/* Read from fd until want whole responses came, the peer closed, or the
 * receive timeout; the bytes, malloc'ed and NUL-terminated. */
static char *recv_responses(int fd, int want) {
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap);
    cr_assert(buf);
    buf[0] = '\0';
    while (whole_responses(buf, len) < want) {
        if (len + 1 >= cap) {
            buf = realloc(buf, cap *= 2);
            cr_assert(buf);
        }
        ssize_t k = recv(fd, buf + len, cap - len - 1, 0);
        if (k <= 0) break;
        len += (size_t)k;
        buf[len] = '\0';
    }
    return buf;
}

/* The number of responses in raw bytes: status lines ("HTTP/1.1 " and three
 * digits) anywhere, even where a body was cut short. */
static int count_responses(const char *raw) {
    int n = 0;
    for (const char *p = raw; (p = strstr(p, "HTTP/1.1 ")); p++)
        n += p[9] >= '1' && p[9] <= '5' && p[10] >= '0' && p[10] <= '9';
    return n;
}

/* The status of the first response in raw bytes, or -1. */
static int first_status(const char *raw) {
    return !strncmp(raw, "HTTP/1.1 ", 9) ? atoi(raw + 9) : -1;
}

static long long completed_generations(void) {
    rk_test_resp r;
    cr_assert_eq(rk_test_exchange(&S.t, "GET", "/v1/stats", NULL, NULL, &r), 0);
    cr_assert_eq(r.http.status, 200, "%s", r.http.body);
    long long n = rk_test_jint(r.json, "requests.completed_generations");
    rk_test_resp_free(&r);
    return n;
}

/* A whole completion request, the one smuggled in the bodies below: if it
 * runs, the server answers it on the same connection and counts one more
 * completed generation. */
static const char smuggled[] = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                               "Content-Type: application/json\r\nContent-Length: 29\r\n\r\n"
                               "{\"prompt\":\"x\",\"max_tokens\":1}";

/* head: a request line and header lines without the empty line; the
 * smuggled request follows the empty line, as a body the head frames one
 * way or another. The server must answer want with Connection: close and
 * nothing else, and the smuggled completion must never run. */
static void expect_smuggling_refused(const char *what, const char *head, int want) {
    long long before = completed_generations();
    size_t n = strlen(head) + 2 + sizeof smuggled;
    char *req = malloc(n);
    cr_assert(req);
    int len = snprintf(req, n, "%s\r\n%s", head, smuggled);
    int fd = connect_from(NULL, 60);
    cr_assert(fd >= 0);
    cr_assert_eq(rk_test_send_all(fd, req, (size_t)len), 0);
    int closed;
    char *raw = rk_test_recv_all(fd, NULL, &closed);
    close(fd);
    cr_assert(closed, "%s: the connection was left open: %s", what, raw);
    cr_assert_eq(first_status(raw), want, "%s: %s", what, raw);
    cr_assert_eq(count_responses(raw), 1, "%s: the smuggled request ran: %s", what, raw);
    cr_assert(strstr(raw, "\r\nConnection: close\r\n"), "%s: %s", what, raw);
    cr_assert(strstr(raw, "\"error\""), "%s: not the JSON error shape: %s", what, raw);
    cr_assert_eq(completed_generations(), before, "%s: the smuggled completion ran", what);
    free(raw);
    free(req);
}

/* head followed by n_extra header lines "X-Filler-i: a". */
static char *with_headers(const char *first, int n_extra, const char *last) {
    size_t cap = strlen(first) + strlen(last) + (size_t)n_extra * 32 + 8;
    char *s = malloc(cap);
    cr_assert(s);
    size_t len = (size_t)snprintf(s, cap, "%s", first);
    for (int i = 0; i < n_extra; i++)
        len += (size_t)snprintf(s + len, cap - len, "X-Filler-%d: a\r\n", i);
    snprintf(s + len, cap - len, "%s", last);
    return s;
}

/* ================================================================ framing */

TestSuite(framing, .init = start_default, .fini = stop_server, .timeout = 300);

/* The check itself: two well-framed requests on one connection are both
 * answered, so a smuggled request that ran would be seen. */
Test(framing, two_well_framed_requests_on_one_connection_are_both_answered) {
    long long before = completed_generations();
    char req[512];
    int len = snprintf(req, sizeof req, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n%s", smuggled);
    int fd = connect_from(NULL, 60);
    cr_assert(fd >= 0);
    cr_assert_eq(rk_test_send_all(fd, req, (size_t)len), 0);
    char *raw = recv_responses(fd, 2);
    close(fd);
    cr_assert_eq(count_responses(raw), 2, "%s", raw);
    /* The engine counts a generation just after its answer is sent. */
    long long now = before;
    for (double until = rk_test_now() + 30; now == before && rk_test_now() < until;)
        now = completed_generations();
    cr_assert_eq(now, before + 1);
    free(raw);
}

Test(framing, a_content_length_past_the_kept_headers_is_431_and_its_body_never_runs) {
    /* Host, 62 fillers, then Content-Length as the 64th line... */
    char cl[64];
    snprintf(cl, sizeof cl, "Content-Length: %zu\r\n", sizeof smuggled - 1);
    char *head = with_headers("POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 62, cl);
    expect_smuggling_refused("Content-Length as the 64th header", head, 431);
    free(head);
    /* ... and as the 65th, which CivetWeb drops unseen. */
    head = with_headers("POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 63, cl);
    expect_smuggling_refused("Content-Length as the 65th header", head, 431);
    free(head);
}

Test(framing, transfer_encoding_past_the_kept_headers_is_refused) {
    /* Content-Length frames an empty body; Transfer-Encoding, 65th, says the
     * smuggled request is part of a chunked one. */
    char *head = with_headers("GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n", 62,
                              "Transfer-Encoding: chunked\r\n");
    expect_smuggling_refused("Transfer-Encoding as the 65th header", head, 431);
    free(head);
}

Test(framing, sixty_three_headers_are_served_and_sixty_four_refused) {
    for (int extra = 62; extra <= 63; extra++) {
        char *head = with_headers("GET /health HTTP/1.1\r\nHost: x\r\n", extra, "\r\n");
        int fd = connect_from(NULL, 60);
        cr_assert(fd >= 0);
        cr_assert_eq(rk_test_send_all(fd, head, strlen(head)), 0);
        shutdown(fd, SHUT_WR);
        int closed;
        char *raw = rk_test_recv_all(fd, NULL, &closed);
        close(fd);
        cr_assert_eq(first_status(raw), extra == 62 ? 200 : 431, "%d headers: %s", extra + 1, raw);
        if (extra == 63)
            cr_assert(strstr(raw, "at most 63"), "the message names the limit: %s", raw);
        free(raw);
        free(head);
    }
}

Test(framing, a_content_length_other_than_digits_is_400_and_closes) {
    /* CivetWeb itself answers 411 to what does not start with a digit. */
    static const struct {
        const char *value;
        int status;
    } cases[] = {{"0x1e", 400},  {"+30", 400}, {"30 ", 400}, {"3 0", 400},
                 {"30,30", 400}, {"1e1", 400}, {"-1", 411},  {"", 411}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char head[256];
        snprintf(head, sizeof head,
                 "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %s\r\n",
                 cases[i].value);
        expect_smuggling_refused(head, head, cases[i].status);
    }
}

Test(framing, a_transfer_encoding_not_exactly_chunked_is_refused) {
    static const char *lines[] = {"Transfer-Encoding : chunked",
                                  "Transfer-Encoding: chunked, identity",
                                  "Transfer-Encoding: identity", "Transfer-Encoding: xchunked",
                                  "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked"};
    for (size_t i = 0; i < sizeof lines / sizeof lines[0]; i++) {
        char head[256];
        snprintf(head, sizeof head, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n%s\r\n", lines[i]);
        expect_smuggling_refused(head, head, 400);
    }
    /* Transfer-Encoding means nothing to HTTP/1.0. */
    expect_smuggling_refused(
        "HTTP/1.0 chunked", "POST /v1/completions HTTP/1.0\r\nTransfer-Encoding: chunked\r\n", 400);
}

Test(framing, a_second_host_or_authorization_is_400) {
    expect_smuggling_refused("two Host", "GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n", 400);
    expect_smuggling_refused("two Authorization",
                             "GET /health HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer a\r\n"
                             "Authorization: Bearer b\r\n",
                             400);
}

/* CivetWeb stops reading headers at a line it cannot parse and drops the
 * rest, Content-Length included: such a request is refused whole. */
Test(framing, a_header_line_the_parser_would_drop_is_400) {
    char cl[64];
    snprintf(cl, sizeof cl, "Content-Length: %zu\r\n", sizeof smuggled - 1);
    static const char *lines[] = {"\x80junk: 1\r\n", " folded\r\n", ":empty\r\n"};
    for (size_t i = 0; i < sizeof lines / sizeof lines[0]; i++) {
        char head[256];
        snprintf(head, sizeof head, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n%s%s", lines[i],
                 cl);
        expect_smuggling_refused(lines[i], head, 400);
        snprintf(head, sizeof head, "POST /v1/completions HTTP/1.0\r\n%s%s", lines[i], cl);
        expect_smuggling_refused(lines[i], head, 400);
    }
    expect_smuggling_refused("bare LF", "GET /health HTTP/1.1\nHost: x\n", 400);
}

/* ================================================================ slow clients */

static void start_with(const char *const *args) {
    cr_assert_eq(rk_test_server_start_ready(&S, "framing", NULL, args), 0,
                 "the server did not start");
}

/* The in_flight gauge of /v1/stats, less the stats request itself; -1 when
 * the stats request was not answered 200 (a loaded server may turn it away
 * while every worker thread is busy: the caller asks again). */
static long long in_flight(void) {
    rk_test_resp r;
    cr_assert_eq(rk_test_exchange(&S.t, "GET", "/v1/stats", NULL, NULL, &r), 0);
    json_t *v = r.http.status == 200 ? rk_test_jget(r.json, "requests.in_flight") : NULL;
    long long n = json_is_integer(v) ? json_integer_value(v) : -1; /* itself not counted */
    rk_test_resp_free(&r);
    return n;
}

/* A POST whose headers announce a 100-byte body, of which one byte is sent. */
static int open_unfinished_body(const char *from) {
    int fd = connect_from(from, 60);
    cr_assert(fd >= 0, "cannot connect from %s", from ? from : "127.0.0.1");
    static const char head[] = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                               "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{";
    cr_assert_eq(rk_test_send_all(fd, head, sizeof head - 1), 0);
    return fd;
}

/* A body trickling in a byte every 0.2 s, faster than any one read's
 * timeout, is still cut at request_timeout_s (1 s) after its headers. */
Test(slow, a_trickling_body_is_cut_at_the_request_timeout, .fini = stop_server, .timeout = 120) {
    const char *args[] = {"--request-timeout-s", "1", NULL};
    start_with(args);
    int fd = open_unfinished_body(NULL);
    double t0 = rk_test_now();
    int answered = 0;
    for (int i = 0; i < 98 && !answered; i++) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        answered = poll(&p, 1, 200) == 1;
        if (!answered)
            cr_assert_eq(rk_test_send_all(fd, " ", 1), 0, "the connection ended unanswered");
    }
    double took = rk_test_now() - t0;
    cr_assert(answered, "the whole body came in %.1f s without an answer", took);
    int closed;
    char *raw = rk_test_recv_all(fd, NULL, &closed);
    close(fd);
    cr_assert_eq(first_status(raw), 408, "%s", raw);
    /* The whole body would take 20 s at this pace: a 408 well before that is
     * the deadline's (1 s), with room for a loaded machine. */
    cr_assert(took < 10, "a trickling body held its connection %.2f s", took);
    cr_assert(closed && strstr(raw, "\r\nConnection: close\r\n"), "%s", raw);
    free(raw);
}

/* Eight bodies from 127.0.0.2 that never finish, on a server of four
 * request slots: none is refused, and 127.0.0.3 is still served. */
Test(slow, unfinished_bodies_hold_no_request_slot, .fini = stop_server, .timeout = 120) {
    const char *args[] = {"--http-threads", "4", "--request-timeout-s", "60", NULL};
    start_with(args);
    enum { N = 8 };
    int fds[N];
    for (int i = 0; i < N; i++) fds[i] = open_unfinished_body("127.0.0.2");
    /* Wait until each is being handled or has been answered. */
    int answered = 0;
    long long n = 0;
    for (double until = rk_test_now() + 30; rk_test_now() < until;) {
        answered = 0;
        for (int i = 0; i < N; i++) {
            struct pollfd p = {.fd = fds[i], .events = POLLIN};
            answered += poll(&p, 1, 0) == 1;
        }
        if ((n = in_flight()) + answered >= N) break;
    }
    for (int i = 0; answered && i < N; i++) { /* say what the first answer was */
        struct pollfd p = {.fd = fds[i], .events = POLLIN};
        if (poll(&p, 1, 0) != 1) continue;
        char buf[512] = "";
        ssize_t k = recv(fds[i], buf, sizeof buf - 1, 0);
        cr_assert_fail("%d unfinished bodies were answered (%lld in flight); one: %.*s", answered,
                       n, (int)(k > 0 ? k : 0), buf);
    }
    cr_assert_eq(n, N);
    int fd = connect_from("127.0.0.3", 60);
    cr_assert(fd >= 0);
    static const char req[] = "GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    cr_assert_eq(rk_test_send_all(fd, req, sizeof req - 1), 0);
    int closed;
    char *raw = rk_test_recv_all(fd, NULL, &closed);
    close(fd);
    cr_assert_eq(first_status(raw), 200, "%s", raw);
    free(raw);
    for (int i = 0; i < N; i++) close(fds[i]);
}

/* Without max_connections_per_ip (the default), one address may hold more
 * connections than the old default limit (4 x http_threads, at least 64)
 * and is still served. */
Test(slow, the_per_address_limit_is_off_by_default, .fini = stop_server, .timeout = 120) {
    const char *args[] = {"--http-threads", "16", NULL}; /* 80 connection threads */
    start_with(args);
    enum { N = 70 };
    int fds[N];
    for (int i = 0; i < N; i++) {
        fds[i] = connect_from("127.0.0.2", 60);
        cr_assert(fds[i] >= 0);
    }
    /* A probe on each first: all 70 are taken and open at once. */
    for (int i = 0; i < N; i++) {
        static const char req[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
        cr_assert_eq(rk_test_send_all(fds[i], req, sizeof req - 1), 0);
    }
    for (int i = 0; i < N; i++) {
        char *raw = recv_responses(fds[i], 1);
        cr_assert_eq(first_status(raw), 200, "connection %d: %s", i, raw);
        free(raw);
    }
    /* Then a request that is not a probe on each, one at a time (the
     * request slots play no part). */
    for (int i = 0; i < N; i++) {
        static const char req[] = "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n";
        cr_assert_eq(rk_test_send_all(fds[i], req, sizeof req - 1), 0);
        char *raw = recv_responses(fds[i], 1);
        cr_assert_eq(first_status(raw), 200, "connection %d: %s", i, raw);
        free(raw);
    }
    for (int i = 0; i < N; i++) close(fds[i]);
}

/* Four times as many connections as there are connection threads, spread
 * over ten addresses, each sending headers that never end: /health from
 * an eleventh is answered within a few header deadlines (1 s each), not
 * after request_timeout_s (30 s). */
Test(slow, slow_headers_from_many_addresses_do_not_keep_health_waiting, .fini = stop_server,
     .timeout = 120) {
    const char *args[] = {"--http-threads",
                          "4",
                          "--header-timeout-s",
                          "1",
                          "--request-timeout-s",
                          "30",
                          NULL}; /* 20 connection threads */
    start_with(args);
    enum { N_ADDR = 10, PER = 8 };
    int fds[N_ADDR * PER];
    for (int a = 0; a < N_ADDR; a++)
        for (int i = 0; i < PER; i++) {
            char from[32];
            snprintf(from, sizeof from, "127.0.0.%d", 2 + a);
            int fd = fds[a * PER + i] = connect_from(from, 60);
            cr_assert(fd >= 0, "cannot connect from %s", from);
            static const char part[] = "GET /health HTTP/1.1\r\nHost: x\r\n";
            cr_assert_eq(rk_test_send_all(fd, part, sizeof part - 1), 0);
        }
    double t0 = rk_test_now();
    int fd = connect_from("127.0.0.50", 60);
    cr_assert(fd >= 0);
    static const char req[] = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    cr_assert_eq(rk_test_send_all(fd, req, sizeof req - 1), 0);
    int closed;
    char *raw = rk_test_recv_all(fd, NULL, &closed);
    double took = rk_test_now() - t0;
    close(fd);
    cr_assert_eq(first_status(raw), 200, "%s", raw);
    /* Four rounds of the 1 s header deadline; without it, the 30 s request
     * timeout. The bound sits between, with room for a loaded machine. */
    cr_assert(took < 20, "/health waited %.2f s behind %d slow-header connections", took,
              N_ADDR * PER);
    cr_log_info("/health answered in %.2f s behind %d slow-header connections from %d addresses",
                took, N_ADDR * PER, N_ADDR);
    free(raw);
    for (int i = 0; i < N_ADDR * PER; i++) close(fds[i]);
}

/* With max_connections_per_ip, a probe on a connection beyond the limit is
 * answered; another request there is 503. */
Test(slow, probes_answer_beyond_the_per_address_limit, .fini = stop_server, .timeout = 120) {
    const char *args[] = {"--max-connections-per-ip", "2", NULL};
    start_with(args);
    int held[2];
    for (int i = 0; i < 2; i++) {
        held[i] = connect_from("127.0.0.2", 60);
        static const char req[] = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
        cr_assert_eq(rk_test_send_all(held[i], req, sizeof req - 1), 0);
        char *raw = recv_responses(held[i], 1); /* taken and counted */
        cr_assert_eq(first_status(raw), 200, "%s", raw);
        free(raw);
    }
    static const char *paths[] = {"/health", "/metrics", "/v1/models"};
    for (int i = 0; i < 3; i++) {
        int fd = connect_from("127.0.0.2", 60);
        char req[128];
        int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                         paths[i]);
        cr_assert_eq(rk_test_send_all(fd, req, (size_t)n), 0);
        int closed;
        char *raw = rk_test_recv_all(fd, NULL, &closed);
        close(fd);
        cr_assert_eq(first_status(raw), i < 2 ? 200 : 503, "%s: %s", paths[i], raw);
        free(raw);
    }
    for (int i = 0; i < 2; i++) close(held[i]);
}
