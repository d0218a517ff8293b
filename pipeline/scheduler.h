/* pipeline/scheduler.h — the engine thread of `ragkv serve` and its request queue.
 *
 * One engine thread owns the rk_service (backend, model, KV arena, radix tree,
 * chunk index); nothing else touches them, so they need no locks. It loads
 * the model itself (the HTTP server listens meanwhile and answers /health
 * with 503), then schedules per decode step (continuous batching): each
 * iteration admits the generations queued since the last one (up to
 * max_batch running in all, while the live pool has room) by running their
 * prompt stages, then runs one decode step for every running generation,
 * publishes each new token on its job's reply channel, and completes the
 * jobs that finished or were cancelled in that step. A request arriving
 * while others generate joins them at the next step. A request is admitted
 * when the live blocks of its prompt fit; it takes more as it decodes. When
 * the pool runs dry, the youngest running generation is preempted: it
 * releases its blocks, keeps its tokens and goes back to the head of the
 * queue, to resume where it stopped once there is room (counted in the
 * snapshot's preemptions). A new request whose prompt does not fit while
 * others run waits at the head of the queue; one whose prompt and
 * max_tokens cannot fit even alone fails (RK_ERR_CONTEXT). Embedding work
 * (a job's rk_embed_task) joins the running generations too: each step's
 * embedding pass feeds its inputs within what the step budget left, so a
 * large embedding call never stalls the streams for more than a step. Cache commands (list, delete,
 * flush, pre-warm) are jobs too: functions run on the engine thread between steps; the light ones
 * (list, get, delete, flush) at once, the others (which may run the pipeline themselves) once no
 * generation runs. Statistics are published after every admission, every completion and every 100
 * ms.
 *
 * A job belongs to its submitter (an HTTP worker thread), who must not free
 * it before rk_job_wait reported it done: until then the engine may write it. */
#ifndef RK_PIPELINE_SCHEDULER_H
#define RK_PIPELINE_SCHEDULER_H

#include <pthread.h>
#include <stddef.h>

#include "pipeline/loader.h"
#include "pipeline/pipeline.h"

#define RK_STATS_TOP 10 /* top chunks by hits shown in /v1/stats */

typedef struct rk_top_chunk {
    char key[33];
    char id[256]; /* "" when no id is known */
    uint64_t hits;
    int owner; /* the entry's owner (rk_req_options.owner) */
} rk_top_chunk;

/* What the engine thread publishes. */
typedef struct rk_cache_snapshot {
    rk_chunk_stats chunk;
    uint64_t chunk_removed;    /* entries removed by DELETE or flush (not counted as evictions
                                  by the index) */
    uint64_t chunk_referenced; /* ready entries with references now */
    uint64_t chunk_bytes;      /* KV bytes of the chunk entries */
    int have_prefix;
    rk_radix_stats prefix;
    uint64_t prefix_flushed; /* radix evictions caused by a flush (manual) */
    int pool_total[RK_POOL_COUNT], pool_free[RK_POOL_COUNT];
    rk_kv_plan kv; /* how the KV memory was sized (pool tokens: pool_total * kv.block_size) */
    rk_top_chunk top[RK_STATS_TOP];
    int n_top;
    int queued;                /* requests waiting for the engine */
    int running;               /* generations in progress */
    uint64_t preemptions;      /* generations taken off the live pool and requeued, all-time */
    uint64_t nonfinite_logits; /* requests failed by a NaN or infinite logit, all-time */
    /* The chunk store (disk tier): zero while none is configured. */
    int have_store;
    uint64_t store_rows, store_bytes, store_loads, store_writes, store_dropped_at_recovery;
    uint64_t store_corrupt_after_open, store_quarantined, store_rows_rebuilt, store_unreadable;
    rk_loader_stats loads;  /* the disk tier's reads off the engine thread */
    rk_loader_stats writes; /* its writes on the writer thread (loads = writes done) */
} rk_cache_snapshot;

typedef struct rk_scheduler rk_scheduler; /* opaque */

typedef enum rk_scheduler_state {
    RK_SCHEDULER_LOADING = 0,
    RK_SCHEDULER_READY = 1,
    RK_SCHEDULER_FAILED = 2,   /* the model could not be loaded */
    RK_SCHEDULER_STOPPING = 3, /* shutting down: no new jobs */
} rk_scheduler_state;

typedef struct rk_scheduler_params {
    rk_config cfg;
    const char *model_path; /* NULL = the embedded model; copied */
    int max_queue;          /* jobs waiting at most (submit fails beyond) */
    int max_batch;          /* generations running together at most */
    double load_delay_s;    /* testing aid: wait this long before loading */
    double token_delay_s;   /* testing aid: sleep after every decode step */
    /* Where statistics go (both may be NULL), called on the engine thread:
     * a snapshot of the caches after every admission, completion or command
     * (and every 100 ms while requests decode), and every request that
     * completed. */
    void (*publish)(void *ctx, const rk_cache_snapshot *snap);
    void (*record_request)(void *ctx, const rk_request *r);
    void *stats_ctx;
} rk_scheduler_params;

/* A function run on the engine thread, with the service (command jobs). */
typedef rk_status (*rk_scheduler_fn)(void *ctx, rk_scheduler *e, rk_service *svc);

typedef struct rk_job {
    /* Set by the submitter before rk_scheduler_submit. */
    rk_request req;       /* a generation (prepared), when fn and embed are NULL */
    rk_scheduler_fn fn;   /* or a command */
    rk_embed_task *embed; /* or embedding work (/v1/embeddings, /v1/rerank): run in the
                             steps, beside the generations; the submitter's */
    void *fn_ctx;
    int notify_tokens;      /* wake the waiter at every token (streaming, stop strings) */
    int anytime;            /* a command that may run between two decode steps while
                               generations run (it must not run the pipeline itself) */
    char *const *chunk_ids; /* (req.n_chunks) document ids to remember, or NULL; not owned */

    /* The reply channel: under mu, read through rk_job_wait. */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_tokens;     /* tokens published: req.out_tokens[0 .. n_tokens) are final */
    int done;         /* the engine is finished with the job */
    int ran;          /* it went through the pipeline (0: cancelled while queued) */
    rk_status status; /* of the generation or command */
    char error[320];  /* message when status != RK_OK */

    /* Private to the engine. */
    double t_submit;
    int est_blocks;
    int queued;
    struct rk_job *next, *prev;
} rk_job;

/* Initialise a job (zeroed, with its mutex and condition variable). */
rk_status rk_job_init(rk_job *j);
/* Free the request the job holds and its synchronisation objects. Only for a
 * job never submitted or reported done. */
void rk_job_destroy(rk_job *j);

/* Wait until more than `seen` tokens are published, the job is done, or the
 * deadline (rk_time_now() clock; <= 0 = none) passes. Writes the published
 * token count and the done flag; returns 1 when the deadline passed first. */
int rk_job_wait(rk_job *j, int seen, double deadline, int *out_n_tokens, int *out_done);

/* Start the engine thread; it loads the model in the background. */
rk_status rk_scheduler_start(const rk_scheduler_params *p, rk_scheduler **out);

/* The current state; when FAILED, msg (cap bytes, may be NULL) gets the reason. */
rk_scheduler_state rk_scheduler_get_state(rk_scheduler *e, char *msg, size_t cap);

/* The service once READY (NULL before). Threads other than the engine's may
 * read only its immutable parts: cfg, the model's hyper-parameters,
 * fingerprint, GGUF metadata and tokenizer (immutable and safe for concurrent
 * readers), e.g. to tokenize with rk_request_prepare. */
rk_service *rk_scheduler_service(rk_scheduler *e);

/* Queue a job. RK_ERR_BUSY when the queue is full, RK_ERR_UNSUPPORTED when
 * the engine is not ready (loading, failed, stopping); the job is then not
 * queued and stays the caller's. */
rk_status rk_scheduler_submit(rk_scheduler *e, rk_job *j);

/* Cancel a job: a queued one is taken out of the queue and completed at once
 * (done, ran = 0); a running generation or embedding task is flagged and
 * stops at its next step. The caller still waits for done. */
void rk_scheduler_cancel(rk_scheduler *e, rk_job *j);

/* Flag every running generation and complete every queued job as cancelled. */
void rk_scheduler_cancel_all(rk_scheduler *e);

/* Jobs waiting now. */
int rk_scheduler_queued(rk_scheduler *e);

/* Stop: no new jobs, queued ones completed as cancelled, running ones
 * flagged; join the thread and close the service. Then free. Accepts NULL. */
void rk_scheduler_free(rk_scheduler *e);

/* ---------------------------------------------------------------- engine thread only */

/* The outcome of one request of rk_scheduler_run. */
typedef struct rk_run_result {
    rk_status status;
    char error[320];
} rk_run_result;

/* For commands: run prepared requests to completion through rk_pipeline_run
 * in batches of max_batch (no generation runs meanwhile). When a batch fails
 * (e.g. the live pool cannot hold all of it), each of its requests is
 * retried alone, so one request's failure is its own. */
void rk_scheduler_run(rk_scheduler *e, rk_request **reqs, int n, rk_run_result *out);

/* Per-chunk metadata the engine keeps beside the chunk index: the document
 * id given for a key, and the wall-clock time of its last use. Returns the id
 * (NULL when none) and writes the last use (0 when unknown). Engine thread
 * only (a cache command's function). The id is the scheduler's: copy it
 * before the function returns, since the next touch or prune of the table
 * (any later engine step) may replace or free it. */
const char *rk_scheduler_chunk_meta(rk_scheduler *e, const char *key, double *out_last_use);
/* Remember an id (NULL keeps the one known; copied) and a use now. Engine
 * thread only. Keys that are not 32 characters are ignored. */
void rk_scheduler_chunk_touch(rk_scheduler *e, const char *key, const char *id);

/* Count a manual removal from the chunk index (DELETE, flush) and prefix-cache
 * evictions caused by a flush, for the evictions-by-reason counters. */
void rk_scheduler_count_removed(rk_scheduler *e, uint64_t chunks, uint64_t prefix_evictions);

/* Publish a statistics snapshot now. */
void rk_scheduler_publish(rk_scheduler *e);

#endif
