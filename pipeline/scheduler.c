/* pipeline/scheduler.c — see scheduler.h.
 *
 * Locks: e->mu guards the queue, the state, the service pointer and the list
 * of running jobs; each job's mu guards its reply channel. The engine never
 * holds e->mu while it computes, and never holds a job's mu while it takes
 * e->mu. A job is completed (done = 1) only after it left both the queue and
 * the running list, so nothing reaches it through the engine afterwards. */
#include "pipeline/scheduler.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct meta {
    char key[33];
    char *id;        /* malloc'ed document id, or NULL */
    double last_use; /* unix seconds */
    struct meta *next;
} meta;

struct rk_scheduler {
    rk_scheduler_params p;
    char *model_path;
    pthread_t thread;
    int thread_started;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    rk_scheduler_state state;
    char fail_msg[320];
    rk_service *svc;
    rk_job *head, *tail;
    int n_queued;
    atomic_int n_anytime; /* queued jobs with anytime set */
    int stop;
    rk_job **running; /* (max_batch) generations in the pipeline, changed by the engine only */
    int n_running;
    rk_job **embedding; /* (cap_embedding) embedding jobs in the pipeline, likewise */
    int n_embedding, cap_embedding;

    /* Engine thread only. */
    meta **buckets; /* (n_buckets) chunk key -> id, last use */
    size_t n_buckets, n_meta;
    uint64_t chunk_removed, prefix_flushed;
    uint64_t preemptions;
    double last_publish;
};

/* ---------------------------------------------------------------- jobs */

rk_status rk_job_init(rk_job *j) {
    memset(j, 0, sizeof *j);
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca)) return rk_errorf(RK_ERR_INTERNAL, "job: condattr");
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int bad = pthread_cond_init(&j->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (bad) return rk_errorf(RK_ERR_INTERNAL, "job: cannot create a condition variable");
    if (pthread_mutex_init(&j->mu, NULL)) {
        pthread_cond_destroy(&j->cv);
        return rk_errorf(RK_ERR_INTERNAL, "job: cannot create a mutex");
    }
    return RK_OK;
}

void rk_job_destroy(rk_job *j) {
    if (!j) return;
    rk_request_free(&j->req);
    pthread_cond_destroy(&j->cv);
    pthread_mutex_destroy(&j->mu);
}

int rk_job_wait(rk_job *j, int seen, double deadline, int *out_n_tokens, int *out_done) {
    int timed_out = 0;
    pthread_mutex_lock(&j->mu);
    while (!j->done && j->n_tokens <= seen) {
        if (deadline > 0) {
            if (rk_time_now() >= deadline) {
                timed_out = 1;
                break;
            }
            struct timespec ts;
            ts.tv_sec = (time_t)deadline;
            ts.tv_nsec = (long)((deadline - (double)ts.tv_sec) * 1e9);
            if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
            pthread_cond_timedwait(&j->cv, &j->mu, &ts);
        } else {
            pthread_cond_wait(&j->cv, &j->mu);
        }
    }
    *out_n_tokens = j->n_tokens;
    *out_done = j->done;
    pthread_mutex_unlock(&j->mu);
    return timed_out;
}

/* Hand the job back to its owner; the engine must not touch it afterwards. */
static void complete(rk_job *j, int ran, rk_status st, const char *msg) {
    pthread_mutex_lock(&j->mu);
    j->ran = ran;
    j->status = st;
    snprintf(j->error, sizeof j->error, "%s", st ? msg : "");
    if (ran && !j->fn) j->n_tokens = j->req.n_out;
    j->done = 1;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* A preempted generation cancelled while it waited to resume: it ends with
 * the tokens it had (its report was completed when it was preempted). */
static void cancel_preempted(rk_job *j) {
    j->req.finish_reason = RK_FINISH_CANCELLED;
    j->req.resume = 0;
    j->req.finished = 1;
}

/* Take j off the running list, then complete it. */
static void finish(rk_scheduler *e, rk_job *j, int ran, rk_status st, const char *msg) {
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < e->n_running; i++)
        if (e->running[i] == j) {
            e->running[i] = e->running[--e->n_running];
            break;
        }
    pthread_mutex_unlock(&e->mu);
    complete(j, ran, st, msg);
}

/* Take embedding job j off its list, then complete it. */
static void embed_finish(rk_scheduler *e, rk_job *j, rk_status st, const char *msg) {
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < e->n_embedding; i++)
        if (e->embedding[i] == j) {
            memmove(e->embedding + i, e->embedding + i + 1,
                    (size_t)(e->n_embedding - i - 1) * sizeof *e->embedding);
            e->n_embedding--;
            break;
        }
    pthread_mutex_unlock(&e->mu);
    complete(j, 1, st, msg);
}

static void unlink_job(rk_scheduler *e, rk_job *j) {
    if (j->prev)
        j->prev->next = j->next;
    else
        e->head = j->next;
    if (j->next)
        j->next->prev = j->prev;
    else
        e->tail = j->prev;
    j->next = j->prev = NULL;
    j->queued = 0;
    e->n_queued--;
    if (j->anytime) atomic_fetch_sub(&e->n_anytime, 1);
}

/* ---------------------------------------------------------------- chunk metadata */

static size_t key_hash(const char *key) {
    size_t h = 1469598103934665603ull;
    for (const char *p = key; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ull;
    return h;
}

static meta *meta_find(rk_scheduler *e, const char *key) {
    if (!e->n_buckets) return NULL;
    for (meta *m = e->buckets[key_hash(key) & (e->n_buckets - 1)]; m; m = m->next)
        if (!strcmp(m->key, key)) return m;
    return NULL;
}

/* Drop metadata of keys the chunk index no longer holds. */
static void meta_prune(rk_scheduler *e) {
    for (size_t b = 0; b < e->n_buckets; b++) {
        meta **pp = &e->buckets[b];
        while (*pp) {
            meta *m = *pp;
            rk_chunk_key k;
            if (rk_chunk_key_parse(m->key, &k) || !rk_chunk_index_find(e->svc->chunks, k)) {
                *pp = m->next;
                free(m->id);
                free(m);
                e->n_meta--;
            } else {
                pp = &m->next;
            }
        }
    }
}

const char *rk_scheduler_chunk_meta(rk_scheduler *e, const char *key, double *out_last_use) {
    meta *m = meta_find(e, key);
    if (out_last_use) *out_last_use = m ? m->last_use : 0;
    return m ? m->id : NULL;
}

void rk_scheduler_chunk_touch(rk_scheduler *e, const char *key, const char *id) {
    if (strlen(key) != 32) return;
    if (!e->n_buckets) {
        e->buckets = calloc(1024, sizeof *e->buckets);
        if (!e->buckets) return;
        e->n_buckets = 1024;
    }
    meta *m = meta_find(e, key);
    if (!m) {
        rk_chunk_stats cs;
        rk_chunk_index_get_stats(e->svc->chunks, &cs);
        if (e->n_meta > 2 * cs.entries + 1024) meta_prune(e);
        if (e->n_meta >= e->n_buckets * 2) { /* grow the table */
            size_t nb = e->n_buckets * 2;
            meta **nbk = calloc(nb, sizeof *nbk);
            if (nbk) {
                for (size_t b = 0; b < e->n_buckets; b++)
                    for (meta *x = e->buckets[b], *nx; x; x = nx) {
                        nx = x->next;
                        size_t h = key_hash(x->key) & (nb - 1);
                        x->next = nbk[h];
                        nbk[h] = x;
                    }
                free(e->buckets);
                e->buckets = nbk;
                e->n_buckets = nb;
            }
        }
        if (!(m = calloc(1, sizeof *m))) return;
        memcpy(m->key, key, 33);
        size_t h = key_hash(key) & (e->n_buckets - 1);
        m->next = e->buckets[h];
        e->buckets[h] = m;
        e->n_meta++;
    }
    if (id) {
        char *d = strdup(id);
        if (d) {
            free(m->id);
            m->id = d;
        }
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    m->last_use = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void meta_free(rk_scheduler *e) {
    for (size_t b = 0; b < e->n_buckets; b++)
        for (meta *m = e->buckets[b], *n; m; m = n) {
            n = m->next;
            free(m->id);
            free(m);
        }
    free(e->buckets);
    e->buckets = NULL;
    e->n_buckets = e->n_meta = 0;
}

void rk_scheduler_count_removed(rk_scheduler *e, uint64_t chunks, uint64_t prefix_evictions) {
    e->chunk_removed += chunks;
    e->prefix_flushed += prefix_evictions;
}

/* ---------------------------------------------------------------- statistics */

typedef struct walk_ctx {
    rk_scheduler *e;
    rk_cache_snapshot *s;
    uint64_t block_bytes;
} walk_ctx;

static int walk_entry(void *ctx, const rk_chunk_entry *en) {
    walk_ctx *w = ctx;
    rk_cache_snapshot *s = w->s;
    if (en->refs > 0) s->chunk_referenced++;
    s->chunk_bytes += (uint64_t)en->n_blocks * w->block_bytes;
    if (en->hits == 0) return 0;
    /* Keep the top entries by hits, most first (insertion into a short list). */
    int pos = s->n_top;
    while (pos > 0 && s->top[pos - 1].hits < en->hits) pos--;
    if (pos >= RK_STATS_TOP) return 0;
    int last = s->n_top < RK_STATS_TOP ? s->n_top : RK_STATS_TOP - 1;
    memmove(&s->top[pos + 1], &s->top[pos], (size_t)(last - pos) * sizeof s->top[0]);
    if (s->n_top < RK_STATS_TOP) s->n_top++;
    rk_top_chunk *t = &s->top[pos];
    rk_chunk_key_hex(en->key, t->key);
    const char *id = rk_scheduler_chunk_meta(w->e, t->key, NULL);
    snprintf(t->id, sizeof t->id, "%s", id ? id : "");
    t->hits = en->hits;
    t->owner = en->owner;
    return 0;
}

/* Publish a snapshot; n_finishing running generations are about to be
 * answered and are not counted as running any more. */
static void publish(rk_scheduler *e, int n_finishing) {
    rk_service *svc = e->svc;
    if (!svc || !e->p.publish) return;
    e->last_publish = rk_time_now();
    rk_cache_snapshot s;
    memset(&s, 0, sizeof s);
    rk_chunk_index_get_stats(svc->chunks, &s.chunk);
    if (svc->prefix) {
        s.have_prefix = 1;
        rk_radix_get_stats(svc->prefix, &s.prefix);
    }
    for (int p = 0; p < RK_POOL_COUNT; p++) {
        s.pool_total[p] = rk_arena_pool_total(svc->arena, (rk_pool_tag)p);
        s.pool_free[p] = rk_arena_pool_free(svc->arena, (rk_pool_tag)p);
    }
    s.kv = svc->kv;
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    walk_ctx w = {.e = e,
                  .s = &s,
                  .block_bytes =
                      2ull * (uint64_t)kv->n_layers * (uint64_t)kv->block_size *
                      rk_dtype_row_bytes(kv->dtype, (size_t)kv->n_kv_heads * (size_t)kv->head_dim)};
    rk_chunk_index_foreach(svc->chunks, walk_entry, &w);
    s.chunk_removed = e->chunk_removed;
    s.preemptions = e->preemptions;
    s.nonfinite_logits = svc->nonfinite_logits;
    s.prefix_flushed = e->prefix_flushed;
    rk_store_counters sc;
    if (svc->store && rk_store_stats(svc->store, &sc) == RK_OK) {
        s.have_store = 1;
        s.store_rows = sc.rows;
        s.store_bytes = sc.bytes;
        s.store_loads = sc.loads;
        s.store_writes = sc.writes;
        s.store_dropped_at_recovery = sc.dropped_on_recovery;
        s.store_corrupt_after_open = sc.corrupt_after_open;
        s.store_quarantined = sc.quarantined;
        s.store_rows_rebuilt = sc.rows_rebuilt;
        s.store_unreadable = sc.unreadable;
    }
    if (svc->loader) rk_loader_stats_get(svc->loader, &s.loads);
    if (svc->writer) rk_loader_stats_get(svc->writer, &s.writes);
    pthread_mutex_lock(&e->mu);
    s.queued = e->n_queued;
    s.running = e->n_running - n_finishing;
    pthread_mutex_unlock(&e->mu);
    e->p.publish(e->p.stats_ctx, &s);
}

void rk_scheduler_publish(rk_scheduler *e) { publish(e, 0); }

/* ---------------------------------------------------------------- commands */

/* Run a command job on the engine thread, publish, and complete it. */
static void run_command(rk_scheduler *e, rk_job *j) {
    rk_error_clear();
    rk_status st = j->fn(j->fn_ctx, e, e->svc);
    char msg[320];
    snprintf(msg, sizeof msg, "%s", rk_error_message());
    rk_scheduler_publish(e);
    complete(j, 1, st, msg);
}

/* Between decode steps: run the light commands waiting, publish statistics. */
static void poll_anytime(rk_scheduler *e) {
    while (atomic_load(&e->n_anytime) > 0) {
        pthread_mutex_lock(&e->mu);
        rk_job *j = e->head;
        while (j && !j->anytime) j = j->next;
        if (j) unlink_job(e, j);
        pthread_mutex_unlock(&e->mu);
        if (!j) break;
        run_command(e, j);
    }
    if (rk_time_now() - e->last_publish > 0.1) rk_scheduler_publish(e);
}

/* One pipeline call; on failure, each request is retried alone. */
static void run_group(rk_scheduler *e, rk_request **reqs, int n, rk_run_result *res) {
    rk_error_clear();
    rk_status st = rk_pipeline_run(e->svc, reqs, n, NULL);
    if (st == RK_OK) {
        for (int i = 0; i < n; i++) res[i] = (rk_run_result){.status = RK_OK};
        return;
    }
    char msg[320];
    snprintf(msg, sizeof msg, "%s", rk_error_message());
    if (n > 1)
        RK_LOG_INFO("a batch of %d requests failed (%s: %s); running them one by one", n,
                    rk_status_str(st), msg);
    for (int i = 0; i < n; i++) {
        res[i].status = st;
        snprintf(res[i].error, sizeof res[i].error, "%s", msg);
        if (n == 1) continue;
        rk_error_clear();
        res[i].status = rk_pipeline_run(e->svc, &reqs[i], 1, NULL);
        snprintf(res[i].error, sizeof res[i].error, "%s", res[i].status ? rk_error_message() : "");
    }
    /* A request that ran alone holds nothing when it starts and the caches evict
     * what no request references: if its KV still does not fit, it never will. */
    for (int i = 0; i < n; i++)
        if (res[i].status == RK_ERR_EXHAUSTED) {
            char m[320];
            snprintf(m, sizeof m, "%s", res[i].error);
            res[i].status = RK_ERR_CONTEXT;
            snprintf(res[i].error, sizeof res[i].error,
                     "the request needs more KV memory than the server has (%.200s)", m);
        }
}

void rk_scheduler_run(rk_scheduler *e, rk_request **reqs, int n, rk_run_result *out) {
    int mb = e->p.max_batch > 0 ? e->p.max_batch : 1;
    for (int s = 0; s < n; s += mb) run_group(e, reqs + s, n - s < mb ? n - s : mb, out + s);
}

/* ---------------------------------------------------------------- generations */

/* Show the job's waiter the tokens it has not seen yet. */
static void publish_tokens(rk_job *j) {
    pthread_mutex_lock(&j->mu);
    if (j->n_tokens != j->req.n_out) {
        j->n_tokens = j->req.n_out;
        if (j->notify_tokens) pthread_cond_broadcast(&j->cv);
    }
    pthread_mutex_unlock(&j->mu);
}

/* Publish the new tokens of the running jobs; record the finished ones,
 * publish statistics (before answering: a client may ask for them right
 * after), then complete them. `admitted`: the statistics are published in
 * any case, since the new requests now hold their blocks; so they are when a
 * request got its first token (its prompt is cached by then). */
static void after_pass(rk_scheduler *e, int admitted) {
    int n = e->n_running; /* only the engine thread changes the running list */
    rk_job *jobs[n > 0 ? n : 1];
    memcpy(jobs, e->running, (size_t)n * sizeof *jobs);
    int n_done = 0;
    for (int i = 0; i < n; i++) {
        rk_job *j = jobs[i];
        admitted |= j->n_tokens == 0 && j->req.n_out > 0; /* only the engine writes n_tokens */
        if (!j->req.finished) continue;
        n_done++;
        if (e->p.record_request) e->p.record_request(e->p.stats_ctx, &j->req);
        for (int k = 0; k < j->req.n_chunks; k++)
            if (j->req.chunk_reports[k].key[0])
                rk_scheduler_chunk_touch(e, j->req.chunk_reports[k].key,
                                         j->chunk_ids ? j->chunk_ids[k] : NULL);
    }
    if (admitted || n_done) publish(e, n_done);
    for (int i = 0; i < n; i++) {
        if (jobs[i]->req.finished)
            finish(e, jobs[i], 1, jobs[i]->req.failure, jobs[i]->req.failure_msg);
        else
            publish_tokens(jobs[i]);
    }
}

/* Put jobs back at the head of the queue, in their order: they wait for
 * running requests to release blocks. When the engine is stopping they are
 * completed as cancelled instead. */
static void requeue(rk_scheduler *e, rk_job **jobs, int n) {
    pthread_mutex_lock(&e->mu);
    int stop = e->stop;
    for (int i = n - 1; i >= 0 && !stop; i--) {
        rk_job *j = jobs[i];
        for (int r = 0; r < e->n_running; r++)
            if (e->running[r] == j) {
                e->running[r] = e->running[--e->n_running];
                break;
            }
        j->queued = 1;
        j->prev = NULL;
        j->next = e->head;
        if (e->head)
            e->head->prev = j;
        else
            e->tail = j;
        e->head = j;
        e->n_queued++;
    }
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < n && stop; i++)
        finish(e, jobs[i], 0, RK_ERR_BUSY,
               "the request was cancelled: the server is shutting down");
}

/* Admit new generations: their prompt stages (2-6) up to the question pass,
 * which the next step runs with the decode tokens. When the
 * live pool cannot hold them while others run, they wait in the queue; a
 * group that fails otherwise is retried one by one, so a failure is its
 * request's own; one that cannot fit even alone fails with RK_ERR_CONTEXT. */
static void admit_jobs(rk_scheduler *e, rk_pipeline *p, rk_job **fresh, int n) {
    rk_request *reqs[n];
    rk_job *jobs[n];
    int m = 0;
    double now = rk_time_now();
    for (int i = 0; i < n; i++) {
        rk_job *j = fresh[i];
        if (j->req.cancel && j->req.resume) { /* preempted, then cancelled */
            cancel_preempted(j);
            if (e->p.record_request) e->p.record_request(e->p.stats_ctx, &j->req);
            finish(e, j, 1, RK_OK, "");
            continue;
        }
        if (j->req.cancel) {
            finish(e, j, 0, RK_ERR_BUSY, "the request was cancelled before it ran");
            continue;
        }
        if (!j->req.resume) j->req.t.queue_ms = (now - j->t_submit) * 1e3;
        reqs[m] = &j->req;
        jobs[m++] = j;
    }
    if (m == 0) return;
    rk_error_clear();
    rk_status st = rk_pipeline_join(p, reqs, m);
    if (st == RK_OK) {
        after_pass(e, 1);
        return;
    }
    /* Blocks the others hold come back: wait for them. */
    if (st == RK_ERR_EXHAUSTED &&
        (rk_pipeline_n_running(p) > 0 || rk_pipeline_n_embedding(p) > 0)) {
        requeue(e, jobs, m);
        return;
    }
    char msg[320];
    snprintf(msg, sizeof msg, "%s", rk_error_message());
    if (m > 1) {
        RK_LOG_INFO("admitting %d requests failed (%s: %s); admitting them one by one", m,
                    rk_status_str(st), msg);
        for (int i = 0; i < m; i++) admit_jobs(e, p, &jobs[i], 1);
        return;
    }
    if (st == RK_ERR_EXHAUSTED) { /* alone, with nothing else running: it never fits */
        char why[320];
        snprintf(why, sizeof why, "the request needs more KV memory than the server has (%.200s)",
                 msg);
        finish(e, jobs[0], 1, RK_ERR_CONTEXT, why);
    } else {
        finish(e, jobs[0], 1, st, msg);
    }
}

/* ---------------------------------------------------------------- embedding work */

/* An embedding job joins the steps (the running list's companion). */
static void embed_start(rk_scheduler *e, rk_pipeline *p, rk_job *j) {
    pthread_mutex_lock(&e->mu);
    if (e->n_embedding == e->cap_embedding) {
        int cap = e->cap_embedding ? e->cap_embedding * 2 : 8;
        rk_job **q = realloc(e->embedding, (size_t)cap * sizeof *q);
        if (!q) {
            pthread_mutex_unlock(&e->mu);
            complete(j, 1, RK_ERR_NOMEM, "engine: out of memory");
            return;
        }
        e->embedding = q;
        e->cap_embedding = cap;
    }
    e->embedding[e->n_embedding++] = j;
    if (e->stop) rk_embed_task_cancel(j->embed); /* take_all did not see it */
    pthread_mutex_unlock(&e->mu);
    rk_error_clear();
    if (rk_pipeline_embed_join(p, j->embed)) {
        char msg[320];
        snprintf(msg, sizeof msg, "%s", rk_error_message());
        embed_finish(e, j, RK_ERR_NOMEM, msg);
    }
}

/* Complete the embedding jobs whose tasks are done, after publishing the
 * statistics (their blocks are back: a client may ask right after). */
static void embed_collect(rk_scheduler *e) {
    int published = 0;
    for (int i = e->n_embedding - 1; i >= 0; i--) {
        rk_job *j = e->embedding[i];
        rk_status st;
        char msg[320];
        if (!rk_embed_task_done(j->embed, &st, msg, sizeof msg)) continue;
        if (!published++) rk_scheduler_publish(e);
        embed_finish(e, j, st, msg);
    }
}

/* ---------------------------------------------------------------- steps */

/* One decode step for every running generation (and the step's embedding
 * pass). The ones it preempted go back to the head of the queue, oldest
 * first, to resume when the live pool has room for them again. A failed
 * step fails them all. */
static void step_jobs(rk_scheduler *e, rk_pipeline *p) {
    rk_error_clear();
    rk_status st = rk_pipeline_step(p, NULL);
    embed_collect(e);
    if (st == RK_OK) {
        rk_request *out[e->p.max_batch];
        rk_job *jobs[e->p.max_batch];
        int n = rk_pipeline_take_preempted(p, out, e->p.max_batch);
        for (int i = 0; i < n; i++) {
            jobs[i] = (rk_job *)(void *)((char *)out[i] - offsetof(rk_job, req));
            jobs[i]->est_blocks = rk_request_live_blocks(e->svc, out[i]);
        }
        e->preemptions += (uint64_t)n;
        if (n) requeue(e, jobs, n);
        after_pass(e, n > 0);
        return;
    }
    char msg[320];
    snprintf(msg, sizeof msg, "%s", rk_error_message());
    RK_LOG_WARN("a decode step failed (%s: %s)", rk_status_str(st), msg);
    rk_pipeline_abort(p);
    rk_scheduler_publish(e);
    while (e->n_running > 0) finish(e, e->running[0], 1, st, msg);
}

/* With e->mu held: the work of the next iteration. An embedding job at the
 * head of the queue joins the steps at once (*out_embed). Then a command at
 * the head runs when it may (a light one at once, the others once no
 * generation or embedding runs: they may run the pipeline themselves);
 * otherwise queued generations join the running ones, up to max_batch, in
 * queue order, while their estimated blocks fit in the free live pool (the
 * first one when nothing runs, whatever its size). They go on the running
 * list. */
static void take_work(rk_scheduler *e, rk_job **out_cmd, rk_job **out_embed, rk_job **fresh,
                      int *out_n) {
    *out_cmd = *out_embed = NULL;
    *out_n = 0;
    rk_job *h = e->head;
    if (h && h->embed) {
        unlink_job(e, h);
        *out_embed = h;
        h = e->head;
    }
    if (!h) return;
    if (h->fn) {
        if (h->anytime || (e->n_running == 0 && e->n_embedding == 0)) {
            unlink_job(e, h);
            *out_cmd = h;
        }
        return;
    }
    int budget = rk_arena_pool_free(e->svc->arena, RK_POOL_LIVE), n = 0;
    for (rk_job *j = h, *next; j && e->n_running < e->p.max_batch; j = next) {
        next = j->next;
        if (j->fn || j->embed || (j->est_blocks > budget && e->n_running > 0)) break;
        unlink_job(e, j);
        fresh[n++] = j;
        e->running[e->n_running++] = j;
        budget -= j->est_blocks;
    }
    *out_n = n;
}

/* Wait on e->cv (e->mu held) for at most s seconds; nonzero on timeout. */
static int timed_wait(rk_scheduler *e, double s) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double end = (double)ts.tv_sec + ts.tv_nsec * 1e-9 + s;
    ts.tv_sec = (time_t)end;
    ts.tv_nsec = (long)((end - (double)ts.tv_sec) * 1e9);
    return pthread_cond_timedwait(&e->cv, &e->mu, &ts) != 0;
}

static void sleep_s(double d) {
    struct timespec ts = {(time_t)d, (long)((d - (double)(time_t)d) * 1e9)};
    nanosleep(&ts, NULL);
}

/* ---------------------------------------------------------------- the thread */

/* Iteration-level scheduling: each iteration admits the generations that
 * arrived (their prompt stages 2-6 but the question pass) and the embedding
 * work, then runs one step: a forward pass of the next token of every
 * running generation and of the joined ones' prompt work (within
 * step_tokens), and an embedding pass within what that left; a request
 * leaves in the step it finishes. Light commands run between
 * iterations. On stop, what runs was flagged cancelled and leaves at the next
 * step. */
static void engine_loop(rk_scheduler *e, rk_pipeline *p) {
    rk_job *fresh[e->p.max_batch];
    for (;;) {
        rk_job *cmd, *embed;
        int n_new = 0;
        /* With tier reads or writes under way, an idle engine looks in every
         * 10 ms to place what finished (a read's chunk, a write's row). */
        int tier_work = rk_pipeline_tier_work(p);
        pthread_mutex_lock(&e->mu);
        while (!e->stop && !e->head && e->n_running == 0 && e->n_embedding == 0)
            if (!tier_work)
                pthread_cond_wait(&e->cv, &e->mu);
            else if (timed_wait(e, 0.01))
                break;
        if (e->stop && e->n_running == 0 && e->n_embedding == 0) {
            pthread_mutex_unlock(&e->mu);
            break;
        }
        take_work(e, &cmd, &embed, fresh, &n_new);
        pthread_mutex_unlock(&e->mu);
        if (embed) embed_start(e, p, embed);
        if (rk_pipeline_n_running(p) == 0) /* a step places them otherwise */
            rk_pipeline_collect_loads(p);  /* reads that finished while nothing ran */
        if (cmd) {
            run_command(e, cmd);
            continue;
        }
        if (n_new) admit_jobs(e, p, fresh, n_new);
        if (rk_pipeline_n_running(p) > 0 || rk_pipeline_n_embedding(p) > 0) step_jobs(e, p);
        if (e->p.token_delay_s > 0 && (n_new || e->n_running || e->n_embedding))
            sleep_s(e->p.token_delay_s);
        poll_anytime(e);
    }
}

static void *engine_main(void *arg) {
    rk_scheduler *e = arg;
    for (double waited = 0; waited < e->p.load_delay_s; waited += 0.01) {
        pthread_mutex_lock(&e->mu);
        int stop = e->stop;
        pthread_mutex_unlock(&e->mu);
        if (stop) break;
        sleep_s(0.01);
    }
    rk_service *svc = NULL;
    rk_pipeline *p = NULL;
    rk_status st = rk_service_open(&e->p.cfg, e->model_path, &svc);
    if (!st && (st = rk_pipeline_create(svc, &p))) {
        rk_service_close(svc);
        svc = NULL;
    }
    pthread_mutex_lock(&e->mu);
    if (st) {
        e->state = RK_SCHEDULER_FAILED;
        snprintf(e->fail_msg, sizeof e->fail_msg, "%s", rk_error_message());
    } else {
        e->svc = svc;
        if (e->state == RK_SCHEDULER_LOADING) e->state = RK_SCHEDULER_READY;
    }
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (st) return NULL;
    rk_scheduler_publish(e);
    engine_loop(e, p);
    rk_pipeline_free(p);
    return NULL;
}

/* ---------------------------------------------------------------- API */

rk_status rk_scheduler_start(const rk_scheduler_params *p, rk_scheduler **out) {
    *out = NULL;
    rk_scheduler *e = calloc(1, sizeof *e);
    if (!e) return rk_errorf(RK_ERR_NOMEM, "engine: out of memory");
    e->p = *p;
    if (e->p.max_batch < 1) e->p.max_batch = 1;
    e->running = calloc((size_t)e->p.max_batch, sizeof *e->running);
    e->model_path = p->model_path ? strdup(p->model_path) : NULL;
    if (!e->running || (p->model_path && !e->model_path)) {
        free(e->running);
        free(e->model_path);
        free(e);
        return rk_errorf(RK_ERR_NOMEM, "engine: out of memory");
    }
    e->p.model_path = e->model_path;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    e->state = RK_SCHEDULER_LOADING;
    /* The pipeline's batches keep arrays on the engine thread's stack: give it room. */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 8u << 20);
    int rc = pthread_create(&e->thread, &attr, engine_main, e);
    pthread_attr_destroy(&attr);
    if (rc) {
        pthread_cond_destroy(&e->cv);
        pthread_mutex_destroy(&e->mu);
        free(e->running);
        free(e->model_path);
        free(e);
        return rk_errorf(RK_ERR_INTERNAL, "engine: cannot start its thread");
    }
    e->thread_started = 1;
    *out = e;
    return RK_OK;
}

rk_scheduler_state rk_scheduler_get_state(rk_scheduler *e, char *msg, size_t cap) {
    pthread_mutex_lock(&e->mu);
    rk_scheduler_state s = e->state;
    if (msg && cap) snprintf(msg, cap, "%s", e->fail_msg);
    pthread_mutex_unlock(&e->mu);
    return s;
}

rk_service *rk_scheduler_service(rk_scheduler *e) {
    pthread_mutex_lock(&e->mu);
    rk_service *s = e->svc;
    pthread_mutex_unlock(&e->mu);
    return s;
}

rk_status rk_scheduler_submit(rk_scheduler *e, rk_job *j) {
    pthread_mutex_lock(&e->mu);
    rk_status st = RK_OK;
    if (e->state != RK_SCHEDULER_READY) {
        st = rk_errorf(RK_ERR_UNSUPPORTED, "%s",
                       e->state == RK_SCHEDULER_LOADING  ? "the model is still loading"
                       : e->state == RK_SCHEDULER_FAILED ? "the model failed to load"
                                                         : "the server is shutting down");
    } else if (e->n_queued >= e->p.max_queue) {
        st = rk_errorf(RK_ERR_BUSY, "the queue is full (%d requests waiting)", e->n_queued);
    } else {
        j->t_submit = rk_time_now();
        j->est_blocks = j->fn || j->embed ? 0 : rk_request_live_blocks(e->svc, &j->req);
        j->done = j->ran = 0;
        j->n_tokens = 0;
        j->queued = 1;
        j->next = NULL;
        j->prev = e->tail;
        if (e->tail)
            e->tail->next = j;
        else
            e->head = j;
        e->tail = j;
        e->n_queued++;
        if (j->anytime) atomic_fetch_add(&e->n_anytime, 1);
        pthread_cond_broadcast(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

void rk_scheduler_cancel(rk_scheduler *e, rk_job *j) {
    pthread_mutex_lock(&e->mu);
    int was_queued = j->queued;
    if (was_queued) unlink_job(e, j);
    pthread_mutex_unlock(&e->mu);
    if (was_queued && !j->fn && j->req.resume) {
        cancel_preempted(j);
        complete(j, 1, RK_OK, "");
    } else if (was_queued) {
        complete(j, 0, RK_ERR_BUSY, "the request was cancelled before it ran");
    } else if (j->embed) {
        rk_embed_task_cancel(j->embed);
    } else if (!j->fn) {
        j->req.cancel = 1;
    }
}

/* With e->mu held: unlink every queued job into a list; flag the running ones. */
static rk_job *take_all(rk_scheduler *e) {
    rk_job *list = NULL, **tail = &list;
    while (e->head) {
        rk_job *j = e->head;
        unlink_job(e, j);
        *tail = j;
        tail = &j->next;
    }
    for (int i = 0; i < e->n_running; i++)
        if (!e->running[i]->fn) e->running[i]->req.cancel = 1;
    for (int i = 0; i < e->n_embedding; i++) rk_embed_task_cancel(e->embedding[i]->embed);
    return list;
}

static void complete_list(rk_job *list, const char *why) {
    while (list) {
        rk_job *next = list->next;
        list->next = NULL;
        complete(list, 0, RK_ERR_BUSY, why);
        list = next;
    }
}

void rk_scheduler_cancel_all(rk_scheduler *e) {
    pthread_mutex_lock(&e->mu);
    rk_job *list = take_all(e);
    pthread_mutex_unlock(&e->mu);
    complete_list(list, "the request was cancelled: the server is shutting down");
}

int rk_scheduler_queued(rk_scheduler *e) {
    pthread_mutex_lock(&e->mu);
    int n = e->n_queued;
    pthread_mutex_unlock(&e->mu);
    return n;
}

void rk_scheduler_free(rk_scheduler *e) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    if (e->state != RK_SCHEDULER_FAILED) e->state = RK_SCHEDULER_STOPPING;
    rk_job *list = take_all(e);
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    complete_list(list, "the request was cancelled: the server is shutting down");
    if (e->thread_started) pthread_join(e->thread, NULL);
    if (e->svc) meta_free(e);
    rk_service_close(e->svc);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    free(e->running);
    free(e->embedding);
    free(e->model_path);
    free(e);
}
