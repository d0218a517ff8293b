/* kernels/cpu/threadpool.c — a persistent pthread pool for the CPU backend.
 *
 * n_threads - 1 workers live as long as the pool. A job is published by
 * bumping a generation counter under the mutex and broadcasting; workers spin
 * briefly on the counter (ops come in quick succession during a forward pass)
 * and then sleep on a condition variable, so an idle pool uses no CPU. Tasks
 * are claimed from an atomic counter; the caller claims tasks too and then
 * waits for the workers to report the job done. Which thread runs a task
 * never changes what the task computes, so results do not depend on it. */
#include <assert.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>
#ifdef __SSE2__
#include <immintrin.h>
#endif

#include "kernels/cpu/cpu.h"

/* Bounded spin before sleeping: about 25 us of pause instructions, yielding
 * the core now and then in case another runnable thread shares it. */
#define SPIN_ITERS 1000
#define SPIN_YIELD 100

struct rk_threadpool {
    int n_threads; /* the caller included */
    pthread_t *workers;
    int n_started;

    pthread_mutex_t mu;
    pthread_cond_t cv_work; /* workers wait here for a new generation */
    pthread_cond_t cv_done; /* the caller waits here for the workers */
    atomic_uint generation;
    int stop;

    /* the current job, written before the generation is published */
    rk_task_fn fn;
    void *ctx;
    int n_tasks;
    atomic_int next;
    atomic_int pending; /* workers that have not finished the current job */
    atomic_int busy;    /* a job is running (catches a nested or concurrent run) */
};

typedef struct worker_arg {
    rk_threadpool *pool;
    int id;
} worker_arg;

static inline void cpu_relax(int i) {
#ifdef __SSE2__
    _mm_pause();
#endif
    if (i % SPIN_YIELD == SPIN_YIELD - 1) sched_yield();
}

static void run_tasks(rk_threadpool *pool, int thread_id) {
    for (;;) {
        int t = atomic_fetch_add_explicit(&pool->next, 1, memory_order_relaxed);
        if (t >= pool->n_tasks) break;
        pool->fn(pool->ctx, t, thread_id);
    }
}

static void *worker_main(void *p) {
    worker_arg arg = *(worker_arg *)p;
    free(p);
    rk_threadpool *pool = arg.pool;
    unsigned seen = 0;
    for (;;) {
        unsigned g = atomic_load_explicit(&pool->generation, memory_order_acquire);
        for (int i = 0; g == seen && i < SPIN_ITERS; i++) {
            cpu_relax(i);
            g = atomic_load_explicit(&pool->generation, memory_order_acquire);
        }
        if (g == seen) {
            pthread_mutex_lock(&pool->mu);
            while ((g = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen &&
                   !pool->stop)
                pthread_cond_wait(&pool->cv_work, &pool->mu);
            int stop = pool->stop;
            pthread_mutex_unlock(&pool->mu);
            if (stop) break;
        }
        seen = g;
        run_tasks(pool, arg.id);
        if (atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&pool->mu);
            pthread_cond_signal(&pool->cv_done);
            pthread_mutex_unlock(&pool->mu);
        }
    }
    return NULL;
}

/* Start n_threads - 1 workers; on failure stop the ones already started. */
rk_status rk_threadpool_create(int n_threads, rk_threadpool **out) {
    *out = NULL;
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    if (n_threads > 1024)
        return rk_errorf(RK_ERR_INVALID, "threadpool: %d threads is too many (max 1024)",
                         n_threads);
    rk_threadpool *pool = calloc(1, sizeof *pool);
    if (!pool) return rk_errorf(RK_ERR_NOMEM, "threadpool: out of memory");
    pool->n_threads = n_threads;
    atomic_init(&pool->generation, 0);
    atomic_init(&pool->next, 0);
    atomic_init(&pool->pending, 0);
    atomic_init(&pool->busy, 0);
    if (pthread_mutex_init(&pool->mu, NULL) != 0) {
        free(pool);
        return rk_errorf(RK_ERR_INTERNAL, "threadpool: pthread_mutex_init failed");
    }
    if (pthread_cond_init(&pool->cv_work, NULL) != 0) {
        pthread_mutex_destroy(&pool->mu);
        free(pool);
        return rk_errorf(RK_ERR_INTERNAL, "threadpool: pthread_cond_init failed");
    }
    if (pthread_cond_init(&pool->cv_done, NULL) != 0) {
        pthread_cond_destroy(&pool->cv_work);
        pthread_mutex_destroy(&pool->mu);
        free(pool);
        return rk_errorf(RK_ERR_INTERNAL, "threadpool: pthread_cond_init failed");
    }
    if (n_threads > 1) {
        pool->workers = calloc((size_t)n_threads - 1, sizeof *pool->workers);
        if (!pool->workers) {
            rk_threadpool_free(pool);
            return rk_errorf(RK_ERR_NOMEM, "threadpool: out of memory");
        }
        for (int i = 1; i < n_threads; i++) {
            worker_arg *arg = malloc(sizeof *arg);
            if (!arg) {
                rk_threadpool_free(pool);
                return rk_errorf(RK_ERR_NOMEM, "threadpool: out of memory");
            }
            arg->pool = pool;
            arg->id = i;
            if (pthread_create(&pool->workers[i - 1], NULL, worker_main, arg) != 0) {
                free(arg);
                rk_threadpool_free(pool);
                return rk_errorf(RK_ERR_INTERNAL, "threadpool: cannot start thread %d of %d", i,
                                 n_threads);
            }
            pool->n_started++;
        }
    }
    *out = pool;
    return RK_OK;
}

void rk_threadpool_free(rk_threadpool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->mu);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->cv_work);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->n_started; i++) pthread_join(pool->workers[i], NULL);
    free(pool->workers);
    pthread_cond_destroy(&pool->cv_done);
    pthread_cond_destroy(&pool->cv_work);
    pthread_mutex_destroy(&pool->mu);
    free(pool);
}

int rk_threadpool_size(const rk_threadpool *pool) { return pool->n_threads; }

void rk_threadpool_run(rk_threadpool *pool, int n_tasks, rk_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    int was_busy = atomic_exchange_explicit(&pool->busy, 1, memory_order_acquire);
    assert(!was_busy && "rk_threadpool_run is not reentrant");
    (void)was_busy;
    if (pool->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
        atomic_store_explicit(&pool->busy, 0, memory_order_release);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n_tasks = n_tasks;
    atomic_store_explicit(&pool->next, 0, memory_order_relaxed);
    atomic_store_explicit(&pool->pending, pool->n_threads - 1, memory_order_relaxed);
    pthread_mutex_lock(&pool->mu);
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool->cv_work);
    pthread_mutex_unlock(&pool->mu);

    run_tasks(pool, 0);

    for (int i = 0; i < SPIN_ITERS; i++) {
        if (atomic_load_explicit(&pool->pending, memory_order_acquire) == 0) break;
        cpu_relax(i);
    }
    if (atomic_load_explicit(&pool->pending, memory_order_acquire) != 0) {
        pthread_mutex_lock(&pool->mu);
        while (atomic_load_explicit(&pool->pending, memory_order_acquire) != 0)
            pthread_cond_wait(&pool->cv_done, &pool->mu);
        pthread_mutex_unlock(&pool->mu);
    }
    atomic_store_explicit(&pool->busy, 0, memory_order_release);
}
