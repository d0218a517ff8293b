/* gateway/conns.c — connections below the HTTP level: finding the socket
 * of a CivetWeb connection, noticing that its client has gone, counting
 * open connections per client address (max_connections_per_ip), and the
 * deadline thread that ends headers and bodies arriving too slowly.
 *
 * CivetWeb 1.15 does not give its connections' sockets away. A connection's
 * socket is the one open descriptor whose peer is the client's address and
 * port and whose own port is the server's: rk_gw_conn_fd finds it among the
 * process's descriptors (/proc/self/fd). While a handler holds the
 * connection, CivetWeb neither closes nor reuses that descriptor, so the
 * handler may poll it; no other thread reads or writes it then. */
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gateway/http.h"

/* ---------------------------------------------------------------- sockets */

/* Does the socket address a hold ip (text, as CivetWeb writes it) and port? */
static int addr_is(const struct sockaddr_storage *a, const char *ip, int port) {
    char text[INET6_ADDRSTRLEN];
    if (a->ss_family == AF_INET) {
        const struct sockaddr_in *s = (const struct sockaddr_in *)a;
        if (ntohs(s->sin_port) != port) return 0;
        return inet_ntop(AF_INET, &s->sin_addr, text, sizeof text) && !strcmp(text, ip);
    }
    if (a->ss_family == AF_INET6) {
        const struct sockaddr_in6 *s = (const struct sockaddr_in6 *)a;
        if (ntohs(s->sin6_port) != port) return 0;
        return inet_ntop(AF_INET6, &s->sin6_addr, text, sizeof text) && !strcmp(text, ip);
    }
    return 0;
}

static int port_of(const struct sockaddr_storage *a) {
    if (a->ss_family == AF_INET) return ntohs(((const struct sockaddr_in *)a)->sin_port);
    if (a->ss_family == AF_INET6) return ntohs(((const struct sockaddr_in6 *)a)->sin6_port);
    return -1;
}

int rk_gw_conn_fd(const struct mg_request_info *ri) {
    if (!ri || !ri->remote_addr[0]) return -1;
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int found = -1, dfd = dirfd(d);
    for (struct dirent *e; found < 0 && (e = readdir(d));) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        int fd = atoi(e->d_name);
        struct stat st;
        if (fd == dfd || fstat(fd, &st) || !S_ISSOCK(st.st_mode)) continue;
        struct sockaddr_storage peer, self;
        socklen_t pl = sizeof peer, sl = sizeof self;
        if (getpeername(fd, (struct sockaddr *)&peer, &pl) ||
            getsockname(fd, (struct sockaddr *)&self, &sl))
            continue;
        if (port_of(&self) == ri->server_port && addr_is(&peer, ri->remote_addr, ri->remote_port))
            found = fd;
    }
    closedir(d);
    return found;
}

int rk_gw_peer_gone(int fd) {
    if (fd < 0) return 0;
    struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return 0;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return 1;
    /* Readable: either the next pipelined request, or the end of the stream. */
    char c;
    return recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

/* ---------------------------------------------------------------- per-address limit */

struct rk_gw_conn_table {
    pthread_mutex_t mu;
    struct addr_count {
        char addr[48];
        int n;
    } * e; /* (n_e) the addresses with open connections */
    int n_e, cap;
};

rk_status rk_gw_conns_create(int cap, rk_gw_conn_table **out) {
    rk_gw_conn_table *t = calloc(1, sizeof *t);
    if (t) t->e = calloc((size_t)(cap > 0 ? cap : 1), sizeof *t->e);
    if (!t || !t->e) {
        free(t);
        *out = NULL;
        return rk_errorf(RK_ERR_NOMEM, "out of memory");
    }
    t->cap = cap > 0 ? cap : 1;
    pthread_mutex_init(&t->mu, NULL);
    *out = t;
    return RK_OK;
}

void rk_gw_conns_free(rk_gw_conn_table *t) {
    if (!t) return;
    pthread_mutex_destroy(&t->mu);
    free(t->e);
    free(t);
}

int rk_gw_conns_add(rk_gw_conn_table *t, const char *addr, int delta) {
    pthread_mutex_lock(&t->mu);
    int i = 0;
    while (i < t->n_e && strcmp(t->e[i].addr, addr)) i++;
    if (i == t->n_e && delta > 0) {
        if (t->n_e == t->cap) { /* more addresses than connection threads: grow */
            struct addr_count *ne = realloc(t->e, (size_t)t->cap * 2 * sizeof *ne);
            if (!ne) {
                pthread_mutex_unlock(&t->mu);
                return 0; /* not counted: never refused for want of memory */
            }
            t->e = ne;
            t->cap *= 2;
        }
        snprintf(t->e[i].addr, sizeof t->e[i].addr, "%s", addr);
        t->e[i].n = 0;
        t->n_e++;
    }
    int n = 0;
    if (i < t->n_e) {
        n = t->e[i].n += delta;
        if (n <= 0) t->e[i] = t->e[--t->n_e];
    }
    pthread_mutex_unlock(&t->mu);
    return n;
}

/* ---------------------------------------------------------------- deadlines */

/* One thread sleeps until the earliest armed deadline and shuts the socket
 * of each one that passes down for reading: a read CivetWeb is blocked in
 * (for headers, or inside mg_read for a body) returns at once with the end
 * of the stream, however slowly bytes were trickling in, and the answer can
 * still be written. Disarming under the same lock as the shutdown, before
 * the socket is closed, keeps a reused descriptor safe. */
struct rk_gw_watchdog {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct armed {
        long ticket;
        int fd;
        double deadline; /* rk_time_now() */
    } * e;               /* (n_e) */
    int n_e, cap, stop;
    long next_ticket;
    pthread_t thread;
};

static void *watchdog_main(void *arg) {
    rk_gw_watchdog *w = arg;
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        double now = rk_time_now(), first = now + 1.0;
        for (int i = 0; i < w->n_e;) {
            if (w->e[i].deadline <= now) {
                shutdown(w->e[i].fd, SHUT_RD);
                w->e[i] = w->e[--w->n_e];
                continue;
            }
            if (w->e[i].deadline < first) first = w->e[i].deadline;
            i++;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        double wait = first - now;
        long ns = ts.tv_nsec + (long)((wait - (double)(long)wait) * 1e9);
        ts.tv_sec += (time_t)wait + ns / 1000000000L;
        ts.tv_nsec = ns % 1000000000L;
        pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

rk_status rk_gw_watchdog_start(rk_gw_watchdog **out) {
    *out = NULL;
    rk_gw_watchdog *w = calloc(1, sizeof *w);
    if (!w) return rk_errorf(RK_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&w->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&w->thread, NULL, watchdog_main, w)) {
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w);
        return rk_errorf(RK_ERR_NOMEM, "cannot start the deadline thread");
    }
    *out = w;
    return RK_OK;
}

void rk_gw_watchdog_stop(rk_gw_watchdog *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w->e);
    free(w);
}

long rk_gw_watchdog_arm(rk_gw_watchdog *w, int fd, double deadline) {
    if (!w || fd < 0) return 0;
    pthread_mutex_lock(&w->mu);
    if (w->n_e == w->cap) {
        int cap = w->cap ? 2 * w->cap : 64;
        struct armed *ne = realloc(w->e, (size_t)cap * sizeof *ne);
        if (!ne) {
            pthread_mutex_unlock(&w->mu);
            return 0; /* not armed: CivetWeb's own timeouts still apply */
        }
        w->e = ne;
        w->cap = cap;
    }
    long t = ++w->next_ticket;
    w->e[w->n_e++] = (struct armed){.ticket = t, .fd = fd, .deadline = deadline};
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return t;
}

void rk_gw_watchdog_disarm(rk_gw_watchdog *w, long ticket) {
    if (!w || ticket <= 0) return;
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->n_e; i++)
        if (w->e[i].ticket == ticket) {
            w->e[i] = w->e[--w->n_e];
            break;
        }
    pthread_mutex_unlock(&w->mu);
}
