/* kernels/cpu/populate.c — the pages of large buffers faulted in ahead of
 * use, by a thread of their own.
 *
 * Large buffers (the KV arena above all) are advised to use transparent huge
 * pages (backend.c). The kernel gives a huge page at the first write to it,
 * and may have to compact memory first: on a machine whose memory is
 * fragmented that stalls the writing thread for milliseconds a page. The
 * KV arena is written a little more at every step, so without this the
 * engine thread paid that cost in the middle of a forward pass: a step that
 * crossed into fresh pages of every layer's K and V took twice as long as
 * its neighbours (docs/benchmarks.md, "Cold arrival"). Here a thread walks
 * each buffer once with MADV_POPULATE_WRITE, a slice at a time, right after
 * it is allocated: the pages are made present without touching what they
 * hold, so the walk may overlap the buffer's use. Where the kernel has no
 * MADV_POPULATE_WRITE (before Linux 5.14) nothing is done. */
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels/cpu/cpu.h"

#define POPULATE_STEP ((size_t)32 << 20) /* bytes a call: a buffer's free waits at most this */
/* Buffers waiting at most. The queue is fixed so that adding to it never
 * allocates: how many allocations a load makes must not depend on how far
 * the thread has got (tests/test_faults.c fails each one in turn). */
#define POPULATE_QUEUE 256

typedef struct region {
    unsigned char *p;
    size_t n, done;
} region;

struct rk_populator {
    pthread_mutex_t mu;
    pthread_cond_t cv;        /* work arrived, or stop */
    pthread_cond_t idle;      /* a step ended */
    region q[POPULATE_QUEUE]; /* (n_q) in order; q[0] is the one being walked */
    int n_q;
    int busy; /* a step on q[0] is under way (the lock is not held) */
    int stop;
    int started; /* the thread runs */
    int off;     /* the kernel cannot populate: do nothing */
    pthread_t thread;
};

static void *populate_main(void *arg) {
    rk_populator *pp = arg;
    /* The lowest priority: the forward passes' threads come first. */
    (void)setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19);
    pthread_mutex_lock(&pp->mu);
    for (;;) {
        while (!pp->stop && pp->n_q == 0) pthread_cond_wait(&pp->cv, &pp->mu);
        if (pp->stop) break;
        region r = pp->q[0];
        size_t n = r.n - r.done < POPULATE_STEP ? r.n - r.done : POPULATE_STEP;
        pp->busy = 1;
        pthread_mutex_unlock(&pp->mu);
        int failed = madvise(r.p + r.done, n, MADV_POPULATE_WRITE) != 0;
        pthread_mutex_lock(&pp->mu);
        pp->busy = 0;
        /* q[0] is still r: forget waits for the step before removing it. */
        if (failed) pp->off = 1; /* no such advice here, or no memory: stop trying */
        pp->q[0].done += n;
        if (failed || pp->q[0].done >= pp->q[0].n) {
            pp->n_q--;
            for (int i = 0; i < pp->n_q; i++) pp->q[i] = pp->q[i + 1];
        }
        if (pp->off) pp->n_q = 0;
        pthread_cond_broadcast(&pp->idle);
    }
    pthread_mutex_unlock(&pp->mu);
    return NULL;
}

rk_status rk_populator_create(rk_populator **out) {
    rk_populator *pp = calloc(1, sizeof *pp);
    if (!pp) return rk_errorf(RK_ERR_NOMEM, "cpu: out of memory");
    pthread_mutex_init(&pp->mu, NULL);
    pthread_cond_init(&pp->cv, NULL);
    pthread_cond_init(&pp->idle, NULL);
    *out = pp;
    return RK_OK;
}

void rk_populator_add(rk_populator *pp, void *p, size_t n) {
    if (!pp || !p || !n) return;
    pthread_mutex_lock(&pp->mu);
    /* Without room or a thread, the buffer is faulted in by its first use. */
    if (!pp->off && pp->n_q < POPULATE_QUEUE &&
        (pp->started ||
         (pp->started = pthread_create(&pp->thread, NULL, populate_main, pp) == 0))) {
        pp->q[pp->n_q++] = (region){p, n, 0};
        pthread_cond_signal(&pp->cv);
    }
    pthread_mutex_unlock(&pp->mu);
}

void rk_populator_forget(rk_populator *pp, void *p) {
    if (!pp || !p) return;
    pthread_mutex_lock(&pp->mu);
    while (pp->busy && pp->n_q > 0 && pp->q[0].p == p) pthread_cond_wait(&pp->idle, &pp->mu);
    int kept = 0;
    for (int i = 0; i < pp->n_q; i++)
        if (pp->q[i].p != p) pp->q[kept++] = pp->q[i];
    pp->n_q = kept;
    pthread_mutex_unlock(&pp->mu);
}

void rk_populator_free(rk_populator *pp) {
    if (!pp) return;
    pthread_mutex_lock(&pp->mu);
    pp->stop = 1;
    pthread_cond_signal(&pp->cv);
    pthread_mutex_unlock(&pp->mu);
    if (pp->started) pthread_join(pp->thread, NULL);
    pthread_cond_destroy(&pp->idle);
    pthread_cond_destroy(&pp->cv);
    pthread_mutex_destroy(&pp->mu);
    free(pp);
}
