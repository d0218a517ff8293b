/* pipeline/loader.c — the tiers' reads on a thread of their own (see
 * loader.h). Three lists under one mutex: queued (submitted, not started),
 * the one being read, and done (read, not yet taken). */
#include "pipeline/loader.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct rk_loader {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv_work; /* the thread: a load was queued, room freed, or stop */
    pthread_cond_t cv_done; /* the owner: a load finished */
    rk_load *queue_head, *queue_tail;
    rk_load *done_head, *done_tail;
    rk_load *reading;
    uint64_t max_bytes, in_flight;
    int stop, n_queued, n_done;
    rk_loader_stats st;
};

static void append(rk_load **head, rk_load **tail, rk_load *ld) {
    ld->next = NULL;
    if (*tail)
        (*tail)->next = ld;
    else
        *head = ld;
    *tail = ld;
}

/* The next load to read once it fits the bytes in flight (one alone always
 * fits), or NULL on stop. With l->mu held. */
static rk_load *next_load(rk_loader *l) {
    for (;;) {
        if (l->stop) return NULL;
        rk_load *ld = l->queue_head;
        if (ld && (l->in_flight == 0 || l->in_flight + ld->bytes <= l->max_bytes)) {
            l->queue_head = ld->next;
            if (!l->queue_head) l->queue_tail = NULL;
            l->n_queued--;
            l->st.bytes_queued -= ld->bytes;
            return ld;
        }
        pthread_cond_wait(&l->cv_work, &l->mu);
    }
}

static void *loader_main(void *arg) {
    rk_loader *l = arg;
    pthread_mutex_lock(&l->mu);
    for (rk_load *ld; (ld = next_load(l));) {
        l->reading = ld;
        l->in_flight += ld->bytes;
        pthread_mutex_unlock(&l->mu);
        double t0 = rk_time_now();
        if (ld->tier == RK_LOAD_WRITE)
            ld->st = rk_store_put_write(ld->write);
        else if (ld->tier == RK_LOAD_DISK)
            ld->st = rk_store_read(&ld->loc, &ld->payload);
        else
            ld->st = rk_redis_lookup(ld->redis, RK_REDIS_CONN_LOADER, ld->key, ld->tokens,
                                     ld->n_tokens, &ld->layout, ld->body_size, ld->wait_ms,
                                     &ld->payload, &ld->lock, &ld->found);
        ld->seconds = rk_time_now() - t0;
        snprintf(ld->why, sizeof ld->why, "%s", ld->st ? rk_error_message() : "");
        pthread_mutex_lock(&l->mu);
        l->reading = NULL;
        l->st.loads++;
        l->st.seconds += ld->seconds;
        if (ld->st || (ld->tier == RK_LOAD_REDIS && ld->found != RK_REDIS_FOUND_VALUE))
            l->st.failed++;
        else
            l->st.bytes += ld->bytes;
        append(&l->done_head, &l->done_tail, ld);
        l->n_done++;
        pthread_cond_broadcast(&l->cv_done);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

rk_status rk_loader_create(uint64_t max_bytes, rk_loader **out) {
    *out = NULL;
    rk_loader *l = calloc(1, sizeof *l);
    if (!l) return rk_errorf(RK_ERR_NOMEM, "loader: out of memory");
    l->max_bytes = max_bytes;
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv_work, NULL);
    pthread_cond_init(&l->cv_done, NULL);
    if (pthread_create(&l->thread, NULL, loader_main, l)) {
        pthread_cond_destroy(&l->cv_done);
        pthread_cond_destroy(&l->cv_work);
        pthread_mutex_destroy(&l->mu);
        free(l);
        return rk_errorf(RK_ERR_INTERNAL, "loader: cannot start its thread");
    }
    *out = l;
    return RK_OK;
}

void rk_loader_free(rk_loader *l, void (*drop)(void *ctx, rk_load *ld), void *ctx) {
    if (!l) return;
    pthread_mutex_lock(&l->mu);
    l->stop = 1;
    pthread_cond_broadcast(&l->cv_work);
    pthread_mutex_unlock(&l->mu);
    pthread_join(l->thread, NULL);
    rk_load *lists[2] = {l->queue_head, l->done_head};
    for (int i = 0; i < 2; i++)
        for (rk_load *ld = lists[i], *next; ld; ld = next) {
            next = ld->next;
            drop(ctx, ld);
        }
    pthread_cond_destroy(&l->cv_done);
    pthread_cond_destroy(&l->cv_work);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

void rk_loader_submit(rk_loader *l, rk_load *ld) {
    pthread_mutex_lock(&l->mu);
    append(&l->queue_head, &l->queue_tail, ld);
    l->n_queued++;
    l->st.bytes_queued += ld->bytes;
    pthread_cond_broadcast(&l->cv_work);
    pthread_mutex_unlock(&l->mu);
}

rk_load *rk_loader_take(rk_loader *l) {
    pthread_mutex_lock(&l->mu);
    rk_load *ld = l->done_head;
    if (ld) {
        l->done_head = ld->next;
        if (!l->done_head) l->done_tail = NULL;
        l->n_done--;
        l->in_flight -= ld->bytes;
        pthread_cond_broadcast(&l->cv_work); /* room for the next read */
        ld->next = NULL;
    }
    pthread_mutex_unlock(&l->mu);
    return ld;
}

rk_load *rk_loader_cancel(rk_loader *l, int (*unwanted)(const rk_load *ld)) {
    rk_load *out = NULL, **at = &out;
    pthread_mutex_lock(&l->mu);
    rk_load **pp = &l->queue_head, *last = NULL;
    while (*pp) {
        rk_load *ld = *pp;
        if (unwanted(ld)) {
            *pp = ld->next;
            l->n_queued--;
            l->st.bytes_queued -= ld->bytes;
            l->st.cancelled++;
            ld->next = NULL;
            *at = ld;
            at = &ld->next;
        } else {
            last = ld;
            pp = &ld->next;
        }
    }
    l->queue_tail = last;
    pthread_mutex_unlock(&l->mu);
    return out;
}

int rk_loader_pending(rk_loader *l) {
    pthread_mutex_lock(&l->mu);
    int n = l->n_queued + l->n_done + (l->reading != NULL);
    pthread_mutex_unlock(&l->mu);
    return n;
}

void rk_loader_wait(rk_loader *l, double max_s) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double end = (double)ts.tv_sec + ts.tv_nsec * 1e-9 + max_s;
    ts.tv_sec = (time_t)end;
    ts.tv_nsec = (long)((end - (double)ts.tv_sec) * 1e9);
    pthread_mutex_lock(&l->mu);
    while (!l->done_head && !l->stop)
        if (pthread_cond_timedwait(&l->cv_done, &l->mu, &ts)) break;
    pthread_mutex_unlock(&l->mu);
}

void rk_loader_stats_get(rk_loader *l, rk_loader_stats *out) {
    pthread_mutex_lock(&l->mu);
    *out = l->st;
    out->bytes_in_flight = l->in_flight;
    out->queued = l->n_queued;
    pthread_mutex_unlock(&l->mu);
}
