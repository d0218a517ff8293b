/* pipeline/pipeline.h — the request pipeline, its stages numbered as in
 * docs/architecture.md ("The request path"):
 *
 *   1 prepare (split, tokenize) → 2 system prompt: the longest cached prefix
 *   of the request's sequence through the radix cache → 3 chunks after it
 *   through the chunk index (compute misses once, at base positions) →
 *   4 reindex (the cached KV attended in place with a position shift, or
 *   copied and rotated into the request's live blocks) → 5 repair →
 *   6 question prefill (first token) → 7 decode steps → 8 release (the
 *   whole sequence into the radix cache).
 *
 * The pipeline is incremental: rk_pipeline_admit runs the prompt stages of
 * new requests together (every stage's forward work for all of them in one
 * pass) and leaves them running; rk_pipeline_step decodes one token for every
 * running request, and a request that finished or was cancelled leaves in the
 * same step, releasing all it held. Requests admitted later join the next
 * step; with rk_pipeline_join their chunk misses and question pass are part
 * of the steps' forward passes (chunked by step_tokens). Blocks come as decoding needs
 * them; when the live pool runs dry the youngest request is preempted and
 * resumes later. Runs on the engine thread, which alone owns the model, the arena and
 * the caches.
 *
 * Its files, in three roles that data passes through one way: the scheduler
 * decides (step.c: rk_pipeline_admit/join/step/run, the step budget,
 * preemption, resuming; scheduler.c: the engine thread); the driver
 * (pipeline.c) runs a request's stages in order, one file each: request.c
 * (1: rk_request_prepare, the request's buffers and state, the report kept
 * across preemption), prefix.c (2: the radix match), chunks.c (3: lookups,
 * misses, single flight, feeds), reindex_stage.c (4), repair.c (5),
 * question.c (6), decode.c (7: a step's forward pass and sampling),
 * release.c (8: the sequence into the radix tree, then all a request holds);
 * the KV planner is stages 2-4 and 8, the runner batch.c (forward passes)
 * and decode.c. Also prewarm.c (rk_pipeline_prewarm), service.c (the
 * service object), cachectl.c (the rk_service_chunk_* calls); internal.h is
 * what they share, private to pipeline/. */
#ifndef RK_PIPELINE_H
#define RK_PIPELINE_H

#include <jansson.h>
#include <pthread.h>
#include <stdint.h>

#include "chunkcache/arena.h"
#include "chunkcache/chunk_index.h"
#include "chunkcache/radix.h"
#include "config/config.h"
#include "engine/engine.h"
#include "engine/grammar.h"
#include "store/redis.h"
#include "store/store.h"
#include "pipeline/split.h"
#include "reindex/reindex.h"

/* Seed of the embedded default model (`tiny`), fixed so every ragkv binary
 * serves the same weights. */
#define RK_EMBEDDED_MODEL_SEED 20261122u

/* The KV memory as resolved from the settings, the model and the machine
 * (rk_kv_plan_make). With `kv_memory_mb auto` the budget is
 *     min(max(min(RK_KV_AUTO_SHARE * left, most), floor), RK_KV_AUTO_CAP * left)
 * where most = RK_KV_AUTO_MAX_CONTEXTS contexts of KV (a small model needs
 * no more), left = the available memory (memory_limit_mb, or rk_memory_detect)
 * minus the model's weights, and floor = what gives the live and chunk pools
 * `context` tokens each at their shares: one request of the whole context
 * fits with every token in chunks, cached or not, while the rest of the live
 * pool serves others. When floor is above the cap the cap wins (logged). On
 * a device backend auto is RK_KV_AUTO_DEVICE_MB. */
#define RK_KV_AUTO_SHARE        0.5
#define RK_KV_AUTO_CAP          0.75
#define RK_KV_AUTO_MAX_CONTEXTS 64
/* auto on a backend other than the CPU (the arena in device memory): fixed. */
#define RK_KV_AUTO_DEVICE_MB 1024
typedef struct rk_kv_plan {
    rk_dtype dtype;
    int auto_sized;            /* kv_memory_mb was auto */
    int fits_context;          /* live and chunk pools hold `context` tokens each */
    uint64_t budget_bytes;     /* the KV budget */
    uint64_t memory_bytes;     /* auto: the memory sized from */
    uint64_t weight_bytes;     /* auto: the weights taken off it */
    const char *memory_source; /* auto: "MemAvailable", "cgroup" or "memory_limit_mb" */
    uint64_t token_bytes;      /* KV of one token, every layer, K and V */
    int kv_layers;             /* the layers that hold KV (Gemma 4: fewer than the model's) */
    int block_size;            /* tokens per block */
    int context;               /* tokens of the longest request (max_context or the model's) */
    int pool_blocks[RK_POOL_COUNT];
} rk_kv_plan;

/* Resolve cfg's KV type and budget for a model of shape hp whose weights take
 * weight_bytes, on backend `backend` ("cpu", "cuda"). RK_ERR_INVALID when the
 * memory left cannot hold a live block; RK_ERR_IO when auto finds no memory
 * figure. */
rk_status rk_kv_plan_make(const rk_config *cfg, const rk_hparams *hp, uint64_t weight_bytes,
                          const char *backend, rk_kv_plan *out);

/* The plan rk_service_open would make for cfg and the model at model_path
 * (NULL = the embedded model), without sizing an arena: the model is loaded
 * and freed. For --print-config. */
rk_status rk_kv_plan_for_model(const rk_config *cfg, const char *model_path, rk_kv_plan *out);

/* One line describing plan: type, budget and how it was chosen, tokens per
 * pool. */
void rk_kv_plan_describe(const rk_kv_plan *plan, char *buf, size_t n);

/* plan as JSON: {"dtype", "budget_mb", "auto", ..., "pools": {name: {"blocks",
 * "tokens"}}}; NULL when out of memory. */
json_t *rk_kv_plan_json(const rk_kv_plan *plan);

typedef struct rk_service {
    rk_config cfg;
    rk_kv_plan kv; /* how the arena was sized */
    rk_backend *be;
    rk_model *model;
    rk_arena *arena;
    rk_radix *prefix;         /* sequence cache over prefix-pool blocks; NULL when disabled */
    uint64_t prefix_ns;       /* from the model fingerprint; requests derive theirs from it */
    rk_chunk_index *chunks;   /* the chunk cache over chunk-pool blocks */
    rk_store *store;          /* the disk tier; NULL without --store */
    struct rk_loader *loader; /* reads the tiers off the engine thread; with a store or Redis */
    struct rk_loader *writer; /* writes the disk tier's payload files; with a store */

    /* The shared tier; NULL without --redis. */
    rk_redis *redis;
    /* Measured prefill tokens per second (a moving average; 0 = none yet): the
     * Redis cost gate compares a load with recomputing. */
    double prefill_tps;
    /* rk_time_now() after which an admission waits no more for chunks other
     * replicas compute. */
    double redis_wait_until;
    /* Requests failed because a forward pass gave them a NaN or infinite
     * logit (engine thread; read by the statistics snapshot). */
    uint64_t nonfinite_logits;
    /* The vocabulary's byte trie for constrained sampling, built on first
     * use (rk_service_grammar_vocab) under grammar_lock. */
    rk_grammar_vocab *grammar_vocab;
    pthread_mutex_t grammar_lock;
    /* Compiled grammars by content, shared by the HTTP workers that compile
     * them (thread-safe on its own). */
    rk_grammar_cache *grammar_cache;
} rk_service;

/* Create the backend, load the model (model_path NULL = build the embedded
 * `tiny` model in memory), size the arena from cfg (copied) and open the
 * tiers it names (store, Redis) with their threads. *out is the caller's,
 * freed with rk_service_close; on failure *out is NULL, everything taken
 * is freed and the message says what failed (RK_ERR_IO, RK_ERR_FORMAT,
 * RK_ERR_UNSUPPORTED for the model; RK_ERR_INVALID for a plan that does not
 * fit). Call it on the thread that will own the service: from then on only
 * that thread (the engine thread) touches it, except where a call below says
 * otherwise (rk_service_grammar_vocab; the statistics read through the
 * scheduler's snapshot). */
rk_status rk_service_open(const rk_config *cfg, const char *model_path, rk_service **out);
/* Stop the tier threads after their work under way (queued disk writes are
 * finished first), close the tiers, free the caches, the model and the
 * backend. No request may still hold anything of it (free the pipelines
 * first). Owner thread; accepts NULL. */
void rk_service_close(rk_service *svc);

/* The model's vocabulary as a byte trie for grammar states (built once, on
 * the first call, by whichever thread makes it; owned by the service). */
rk_status rk_service_grammar_vocab(rk_service *svc, const rk_grammar_vocab **out);

typedef enum rk_req_mode {
    RK_MODE_RAG = 0,   /* chunks through the chunk cache, reindexed into place */
    RK_MODE_PLAIN = 1, /* the pieces as one ordinary sequence, no chunk cache */
} rk_req_mode;

/* What a chunk's cached KV was computed after. */
typedef enum rk_chunk_context {
    RK_CONTEXT_ISOLATED = 0, /* alone, at positions 0..n-1 */
    RK_CONTEXT_SYSTEM = 1,   /* after the request's system prompt */
    /* After a fixed anchor, the model's BOS token, at positions 1..n (the
     * anchor's KV is not kept): the chunk's first token is no longer its
     * own attention sink. Shared by every request, like isolated. */
    RK_CONTEXT_ANCHOR = 2,
} rk_chunk_context;

typedef struct rk_req_options {
    rk_req_mode mode;
    int chunk_cache; /* 0 = the oracle: chunks computed fresh at their live positions */
    /* Match the request's sequence in the radix tree and insert it: the
     * system prompt after pass 1, the whole sequence (prompt and generated
     * tokens with KV) when the request finishes. */
    int prefix_cache;
    /* With prefix_cache: whole sequences (the above); 0 = the system prompt
     * only, matched and inserted alone (what the benchmark's modes measure). */
    int reuse_sequences;
    rk_chunk_context chunk_context;
    rk_position_mode positions;
    int max_tokens;
    /* 1: max_tokens is a default, not the client's: lowered to the context
     * the prompt leaves instead of failing the context check. */
    int max_tokens_fit;
    rk_sampler_params sampling;
    int stop_at_eog;
    int n_logprobs; /* 0..20 top log-probabilities per generated token */
    /* With n_logprobs > 0: also the log-probability of every prompt token
     * given the tokens before it, and the top n_logprobs there (the results'
     * prompt_* arrays). Needs logits at every prompt position, so the
     * request's prompt is computed whole: no chunks (RK_ERR_INVALID when it
     * has some), no radix match or insert, no repair; and with max_tokens 0
     * its prompt is still computed. */
    int prompt_logprobs;
    /* Constrain sampling to this grammar (response_format, grammar): every
     * token is drawn from the ones that keep the output a prefix of it, and
     * the end only where it may end. Borrowed: the caller keeps it alive
     * until the request has finished. NULL = unconstrained. */
    const rk_grammar *grammar;
    /* Repair, after reindexing: recompute chunk tokens with full attention
     * over the merged cache (system, earlier chunks, themselves). The
     * recomputed KV goes to live blocks only; the cached entries are untouched.
     * first_k: the first repair_k tokens of every chunk (0 = off).
     * deviation: the repair_ratio of the request's chunk tokens whose layer-1
     * K/V move most when layers 0..1 are recomputed over the merged cache
     * (0 = off; those two layers are then recomputed for every chunk token).
     * query (repair_query set, with repair_ratio): the repair_ratio of the
     * request's chunk tokens that the question's attention (a question pass
     * over the reused KV, its last layer) or the deviation ranks highest,
     * the two ranks taken in turn (see docs/fidelity.md). Every chunk's
     * first token ranks first in both ratio policies. */
    int repair_k;
    float repair_ratio;
    /* The cache scope (rk_cache_scope; {0, 0} = none): it goes into every
     * chunk key and the radix namespace, so chunks, prefixes and whole
     * sequences are shared only among requests of the same scope. */
    rk_chunk_key salt;
    /* Who the chunk entries this request creates belong to (0 = nobody in
     * particular): the owner the rk_service_chunk_* calls filter on. */
    int owner;
    int repair_query;
} rk_req_options;

/* Defaults: rag mode, chunk and prefix caches on, isolated, sequential,
 * 128 tokens, temperature 1, stop at end of generation, no salt, owner 0. */
void rk_req_options_default(rk_req_options *o);

#define RK_CACHE_SALT_MAX 256 /* bytes of a cache salt, a tenant's or a request's */

/* The cache scope of a request: {0, 0} when neither salt is given (NULL or
 * ""), so such requests share what they always shared. Otherwise XXH3-128
 * over the salts: a request's own salt alone (vLLM's cache_salt), or a
 * tenant's salt followed by the request's, in a domain of its own (a NUL
 * byte no JSON salt can hold leads it), so no request salt reaches a tenant's
 * scope and a tenant's request salt only divides that tenant's cache. */
rk_chunk_key rk_cache_scope(const char *tenant_salt, const char *request_salt);

/* How a chunk's KV was found. */
typedef enum rk_chunk_status {
    RK_CHUNK_STATUS_OFF = 0, /* the chunk cache was not used */
    RK_CHUNK_STATUS_HIT,
    RK_CHUNK_STATUS_MISS,
    /* The chunk pool had no room for it even after evicting what no request
     * holds: computed like a miss into the request's own live blocks, not
     * cached. */
    RK_CHUNK_STATUS_UNCACHED,
} rk_chunk_status;

/* Where a chunk's KV came from. */
typedef enum rk_chunk_source {
    RK_CHUNK_SOURCE_COMPUTED = 0,
    RK_CHUNK_SOURCE_ARENA,
    RK_CHUNK_SOURCE_DISK,
    RK_CHUNK_SOURCE_REDIS, /* loaded from the shared tier (another replica computed it) */
    /* Inside the prefix an earlier request's sequence shared with this one:
     * neither looked up nor reindexed (status RK_CHUNK_STATUS_HIT). */
    RK_CHUNK_SOURCE_PREFIX,
} rk_chunk_source;

/* Why a request stopped generating. */
typedef enum rk_finish_reason {
    RK_FINISH_LENGTH = 0, /* max_tokens reached */
    RK_FINISH_STOP,       /* an end-of-generation token */
    RK_FINISH_CANCELLED,  /* its cancel flag was set */
} rk_finish_reason;

typedef struct rk_chunk_report {
    char key[33]; /* "" when the cache is off */
    int tokens;
    rk_chunk_status status;
    rk_chunk_source source;
    int live_offset; /* position of its first token in this request */
    int group;       /* its chunk group (0 when the request has one) */
    double reindex_us;
    int repaired;  /* its tokens the repair policy recomputed through every layer */
    int zero_copy; /* attended in place in the chunk pool (else copied into live blocks) */
} rk_chunk_report;

typedef struct rk_req_timings {
    double queue_ms, lookup_ms, chunk_compute_ms, reindex_ms, repair_ms, prefill_ms, ttft_ms,
        decode_ms, total_ms;
} rk_req_timings;

typedef struct rk_req_state rk_req_state; /* private to the pipeline */

typedef struct rk_request {
    rk_req_options opt;
    /* Tokens of the pieces, owned by the request (rk_request_prepare fills them). */
    int32_t *sys; /* BOS (when the model uses one) + system prompt */
    int n_sys;
    int32_t **chunks; /* (n_chunks) */
    int *chunk_lens;
    int n_chunks;
    int n_empty_chunks; /* skipped by the splitter */
    int32_t *question;
    int n_question;
    /* More than one chunk group (rk_split's n_groups > 1; else 0): group g
     * is chunks [group_end[g - 1], group_end[g]) (from 0 for g = 0), and for
     * g < n_groups - 1 the text gap[g] (gap_len[g] tokens, n_gap_tokens in
     * all) follows it; the question follows the last group. */
    int n_groups;
    int *group_end;
    int32_t **gap;
    int *gap_len;
    int n_gap_tokens;

    /* Results. */
    int32_t *out_tokens; /* (opt.max_tokens) */
    int n_out;
    int32_t *top_ids;    /* (opt.max_tokens, opt.n_logprobs) when n_logprobs > 0 */
    float *top_logprobs; /* same shape */
    float *logprobs;     /* (opt.max_tokens) log-probability of each sampled token, set
                          * where opt.n_logprobs > 0 */
    /* With opt.prompt_logprobs, entry j of the prompt (sys, then question:
     * n_sys + n_question entries) has the log-probability of token j given
     * tokens 0..j-1 and the top opt.n_logprobs there, most likely first;
     * entry 0 has NaN and ids -1 (nothing comes before it). Set by the
     * prompt's passes, before the first token is sampled. */
    float *prompt_logprobs;     /* (n_sys + n_question) */
    int32_t *prompt_top_ids;    /* (n_sys + n_question, opt.n_logprobs) */
    float *prompt_top_logprobs; /* same shape */
    rk_finish_reason finish_reason;
    int finished; /* it left the pipeline: everything it held is released */
    /* Set when the pipeline failed this request alone (a forward pass gave
     * it a NaN or infinite logit, or its grammar outgrew its bound): it is finished and its tokens
     * must not be served; failure_msg says what happened. RK_OK otherwise. */
    rk_status failure;
    char failure_msg[200];
    rk_chunk_report *chunk_reports; /* (n_chunks) */
    int sys_cached;                 /* system tokens reused from the prefix cache */
    int conv_cached;       /* tokens past the system prompt reused from an earlier sequence */
    int recomputed_tokens; /* chunk tokens recomputed by the repair policy */
    int shared_blocks;     /* chunk-pool blocks its table uses in place (zero-copy) */
    int prompt_tokens, cached_tokens, computed_tokens;
    rk_req_timings t;
    /* Set when preparing failed because the prompt and max_tokens need more
     * context than the model (or max_context) has: the API's
     * context_length_exceeded. */
    int context_exceeded;

    /* Set from any thread (e.g. when the client disconnects): the request stops
     * at its next decode step with RK_FINISH_CANCELLED and releases all it holds. */
    _Atomic int cancel;

    /* Times the live pool ran out while it ran and it was preempted: taken
     * off with everything it held released, its tokens kept, to resume. */
    int preemptions;
    /* Private to the pipeline, kept across preemption: set while it waits
     * to resume, its hooks' index, when it was first admitted, and its
     * sampler's random state. */
    int resume;
    int rank;
    double t_admitted;
    uint64_t rng[2];
    /* Private: its position in opt.grammar (kept across preemption). */
    rk_grammar_state *grammar_state;

    rk_req_state *state;
} rk_request;

/* Tokenize split pieces into r (system with BOS; special tokens recognised in
 * the system prompt and question, never in chunk text) and allocate the
 * result arrays for r->opt. Enforces the service's limits (chunks, tokens
 * per chunk, context). On failure r holds nothing. */
rk_status rk_request_prepare(rk_service *svc, const rk_split *pieces, rk_request *r);

/* The same from token ids (copied): sys (BOS included) and question; no chunks. */
rk_status rk_request_prepare_tokens(rk_service *svc, const int32_t *sys, int n_sys,
                                    const int32_t *question, int n_question, rk_request *r);

/* Make a prepared request's grammar state (r->opt.grammar's) and its first
 * mask on the calling thread, so that the engine thread starts from them
 * instead of building them (an HTTP worker calls it). Nothing to do without
 * a grammar. A grammar over a bound gives RK_ERR_LIMIT naming it. */
rk_status rk_request_prepare_grammar(rk_service *svc, rk_request *r);

/* Free what the request owns (its tokens, result arrays, chunk reports and
 * grammar state) and zero those fields, not r itself, which may live on the
 * stack. Its pipeline state is freed when it leaves the pipeline, so the
 * request must not be running: it finished, was never admitted, or its
 * pipeline was freed. Accepts NULL and a zeroed request; may be called
 * twice. */
void rk_request_free(rk_request *r);

/* Called on the engine thread for every sampled token. req is the request's
 * rank in the order its pipeline admitted requests (0 for the first; with
 * rk_pipeline_run, its position in reqs); step is its number of tokens
 * before this one.
 *
 * force_token (NULL = off) is teacher forcing: asked after on_logits, it
 * returns the token to take at this step instead of sampling one, or -1 to
 * sample (an id outside the vocabulary samples too). The forced token is the
 * request's token from then on: it is reported (out_tokens, logprobs,
 * on_token), fed to the next step and checked for end of generation. */
typedef struct rk_pipeline_hooks {
    void *ctx;
    void (*on_token)(void *ctx, int req, int32_t token);
    void (*on_logits)(void *ctx, int req, int step, const float *logits, int n_vocab);
    int32_t (*force_token)(void *ctx, int req, int step);
} rk_pipeline_hooks;

typedef struct rk_pipeline rk_pipeline; /* the running requests; opaque */

/* A pipeline with no running requests over svc, which must outlive it. One
 * thread, the service's owner, calls every rk_pipeline_* function on it.
 * RK_ERR_NOMEM when out of memory (*out NULL). */
rk_status rk_pipeline_create(rk_service *svc, rk_pipeline **out);
/* Abort what still runs (rk_pipeline_abort), then free. Accepts NULL. */
void rk_pipeline_free(rk_pipeline *p);

/* Requests admitted and not finished. */
int rk_pipeline_n_running(const rk_pipeline *p);

/* Admit prepared requests: run their prompt stages together (system prompt,
 * chunks, reindex, repair, question prefill) and sample each one's first
 * token. Those that finish with it (max_tokens 0 or 1, end of generation)
 * leave at once; the others run. A request takes the live blocks of its
 * prompt and of its first generated token; decoding takes more a block at
 * a time. A preempted request (see rk_pipeline_step) is admitted again to
 * resume: its prompt is then its prompt and the tokens it generated but the
 * last, and it samples nothing (its next decode step feeds that last token).
 * On failure none of reqs is admitted and each has released everything it
 * took (finished stays 0); the running requests are untouched.
 * RK_ERR_EXHAUSTED: the live pool cannot hold them now; RK_ERR_LIMIT: the
 * prompt and max_tokens of one of them need more live blocks than the pool
 * has. hooks may be NULL. */
rk_status rk_pipeline_admit(rk_pipeline *p, rk_request *const *reqs, int n_reqs,
                            const rk_pipeline_hooks *hooks);

/* Tokens of the sequences of requests that left still being copied into
 * the radix tree. A request that reuses its chunks in place (zero-copy)
 * leaves a copy of its sequence to make, rotated out of the chunk pool's
 * blocks; beside decoding streams (a step budget) each step makes a slice
 * of it, and the request's blocks are held until it is made. */
int rk_pipeline_inserting(const rk_pipeline *p);

/* Admit prepared requests like rk_pipeline_admit, up to the question pass:
 * what is left of their prompts (the question, a system tail nothing else
 * needed first, a resumed request's generated tokens) runs in the next
 * rk_pipeline_step calls, in the same forward pass as the running requests'
 * decode tokens, and the last of it samples the first token. With a step
 * budget (the service's step_tokens > 0) their isolated chunk misses run
 * there too, before their questions: a request waits, taking no live block
 * more, until every chunk it needs is computed (by it, or by another
 * request that needs the same chunk), then its remaining stages run
 * between two steps; and the tokens its repair recomputes (the runs the
 * repair policy chose) are fed by the steps too, after its system tail and
 * before its question, so that no step stalls for them (a deviation or
 * query policy's scoring pass still runs between two steps). hooks are
 * those of the steps. Fails as rk_pipeline_admit does. */
rk_status rk_pipeline_join(rk_pipeline *p, rk_request *const *reqs, int n_reqs);

/* One step: a token for every running request in one forward pass, which
 * also feeds the prompt work of joined requests, in the order they were
 * admitted, at most the service's step_tokens of it (0 = all; the rest in
 * the next steps); then, when embedding work joined (rk_pipeline_embed_join),
 * one embedding pass within what that left of step_tokens.
 * Cancelled requests stop and leave first; every request that finished
 * (cancelled, end of generation, max_tokens) leaves in this call: its report
 * is complete, finished is 1 and every block reference, chunk reference and
 * radix lock it held is released. A request whose block table is full takes
 * one more live block, oldest request first; when the live pool has none,
 * the request admitted last is preempted: its sequence goes into the radix
 * tree (whole-sequence reuse), it releases all it holds like a finished one
 * but keeps its tokens (out_tokens, logprobs: nothing is reported twice),
 * and waits in rk_pipeline_take_preempted for the caller to admit it again.
 * On failure the running requests stay (see rk_pipeline_abort). hooks may
 * be NULL. */
rk_status rk_pipeline_step(rk_pipeline *p, const rk_pipeline_hooks *hooks);

/* Place the tier reads the loader finished and end the disk writes the
 * writer finished (rk_pipeline_step starts with it; the engine calls it
 * between commands too, so that reads which finish while nothing runs are
 * not left waiting); returns the entries filled. */
int rk_pipeline_collect_loads(rk_pipeline *p);

/* Tier reads and disk writes submitted and not yet placed or ended. */
int rk_pipeline_tier_work(const rk_pipeline *p);

/* Move up to cap of the requests preempted since the last call into out,
 * oldest first; returns how many. */
int rk_pipeline_take_preempted(rk_pipeline *p, rk_request **out, int cap);

/* Live blocks request r needs to be admitted: its prompt (for a zero-copy
 * request, not the chunk tokens attended in place; for a preempted one, its
 * generated tokens too), its first generated token, and the scratch of
 * chunks computed at their live position or after the system prompt. */
int rk_request_live_blocks(const rk_service *svc, const rk_request *r);

/* Release every running request as failed (its report is incomplete). */
void rk_pipeline_abort(rk_pipeline *p);

/* Run prepared requests to completion: admit them all, then step until none
 * runs, admitting preempted ones again as the live pool has room. Every reference and lock taken is
 * released before returning, on success and on error. hooks may be NULL. */
rk_status rk_pipeline_run(rk_service *svc, rk_request *const *reqs, int n_reqs,
                          const rk_pipeline_hooks *hooks);

/* ---------------------------------------------------------------- embeddings */

/* The pooling /v1/embeddings uses: cfg.pooling when set, else the model
 * file's (RK_POOLING_NONE when it has none). */
rk_pooling rk_service_pooling(const rk_service *svc);

/* Whether the service generates text (/v1/completions, /v1/chat/completions):
 * 1 unless the model file declares a pooling type (an embedding or a
 * reranking model), and then only when --pooling none overrides it. */
int rk_service_generates(const rk_service *svc);

/* Whether the service reranks: its pooling (rk_service_pooling) is rank and
 * the model file has a classification head cls.output.weight of shape (dim,
 * n_labels) in a weight type ragkv reads, with cls.output.bias (n_labels)
 * optional. 0 and a message (rk_error_message) otherwise. */
int rk_service_can_rerank(const rk_service *svc);

/* An embedding or rerank call: its inputs, run through the model as prompt
 * work of the engine's steps (rk_pipeline_embed_join), a slice at a time;
 * opaque. */
typedef struct rk_embed_task rk_embed_task;

/* A task over inputs[i] (n_tokens[i] >= 1 token ids inside the vocabulary;
 * the caller's, kept until the task is done) writing into out (the
 * caller's). pooling mean, cls or last: each input's final hidden states
 * (after the output norm) are pooled and L2-normalised into out (n_inputs,
 * dim). pooling rank (a reranking model, rk_service_can_rerank; the inputs
 * are the query and document already formatted and tokenized): the normed
 * hidden state of the pooled token (the last for qwen3, the first
 * otherwise) goes through the head, and the score is the first label's
 * probability after a softmax over the labels (qwen3: P("yes")), or the
 * first logit for other architectures, into out (n_inputs). Reads only the
 * service's immutable parts (any thread). RK_ERR_INVALID for pooling none,
 * a model that cannot rerank, or an empty input; RK_ERR_NOMEM. */
rk_status rk_embed_task_create(const rk_service *svc, const int32_t *const *inputs,
                               const int *n_tokens, int n_inputs, rk_pooling pooling, float *out,
                               rk_embed_task **out_task);
/* Ask the engine to end t at its next step (any thread). */
void rk_embed_task_cancel(rk_embed_task *t);
/* 1 once t is done (it holds no blocks then) with its status and message
 * (msg, cap bytes, may be NULL): RK_OK with out complete; RK_ERR_BUSY when
 * cancelled, RK_ERR_EXHAUSTED when the live pool had no room for an input
 * while no generation ran, RK_ERR_NOMEM or the forward pass's errors.
 * 0 while it runs. */
int rk_embed_task_done(const rk_embed_task *t, rk_status *out_status, char *msg, size_t cap);
/* Free a task that is done or never joined a pipeline. Accepts NULL. */
void rk_embed_task_free(rk_embed_task *t);

/* Add t to the pipeline's embedding work: each rk_pipeline_step then runs
 * one embedding pass after its own, holding slices of the joined tasks'
 * inputs in join order within what the step budget left (a step with no
 * decoding stream, or --step-tokens 0: up to 2048 tokens), until t is done
 * (rk_embed_task_done). RK_ERR_NOMEM. */
rk_status rk_pipeline_embed_join(rk_pipeline *p, rk_embed_task *t);
/* Embedding tasks joined and not done. */
int rk_pipeline_n_embedding(const rk_pipeline *p);

/* ---------------------------------------------------------------- pre-warming */

typedef struct rk_prewarm_item {
    /* in */
    const char *text; /* chunk text (UTF-8), len bytes */
    size_t len;
    const char *doc_id; /* may be NULL */
    rk_chunk_key salt;  /* cache scope, as rk_req_options' */
    int owner;          /* owner of the entries it creates, as rk_req_options' */
    /* out */
    char key[33];
    int tokens;
    const char *status; /* "cached" (arena or disk), "computed" or "failed" */
    const char *tier;   /* where it is now: "arena" or "disk" */
    char error[160];    /* why it failed */
} rk_prewarm_item;

/* Make sure every chunk's KV (isolated context) is cached without generating
 * anything: chunks found in the arena or the disk tier are "cached", the rest
 * are computed together in forward passes of bounded size. With persist set
 * (and a store), every chunk ends up on disk too. With a Redis tier, computed
 * chunks are written to it (with persist, those found in the arena too). A bad chunk (invalid
 * UTF-8, too long) fails alone. Returns an error only when the engine itself fails. */
rk_status rk_pipeline_prewarm(rk_service *svc, rk_prewarm_item *items, int n_items, int persist);

/* ---------------------------------------------------------------- cache control */

/* What the cache routes and `ragkv cache` do to the caches (pipeline/cachectl.c),
 * as C structs: no HTTP, no JSON. Engine thread only, like the rest, except
 * the shared tier's two calls (below).
 *
 * A viewer says whose entries a call may see: every one (all = 1), or only
 * those whose owner (rk_req_options.owner) is `owner`. An entry a viewer may
 * not see is absent to it: not listed, not found, not deleted. The disk tier
 * keeps no owner, so only a viewer of everything lists it or finds a chunk
 * that is on disk alone. */
typedef struct rk_cache_viewer {
    int all;
    int owner;
} rk_cache_viewer;

/* One cached chunk: an arena entry (tier "arena"), a store row ("disk") or a
 * shared-tier entry ("redis": key, tokens, bytes and created only). */
typedef struct rk_chunk_info {
    char key[33];
    const char *tier; /* "arena", "disk" or "redis" (constant) */
    int tokens;
    uint64_t bytes, hits;
    double created;
    double last_access; /* disk rows; 0 for arena entries (the caller's clock knows) */
    int owner;          /* arena entries */
    char source[12];    /* arena: "computed", "disk", "redis" */
    int refs, base_pos; /* arena */
    int on_disk;        /* arena: the store holds it too (0 without a store) */
    char policy[32];    /* disk rows */
    char doc_id[256];   /* disk rows: "" when none */
} rk_chunk_info;

typedef struct rk_chunk_listing {
    rk_chunk_info *v; /* (n) malloc'ed; free with rk_chunk_listing_free */
    int n;
    uint64_t total; /* entries the viewer may see, before offset and limit */
} rk_chunk_listing;

void rk_chunk_listing_free(rk_chunk_listing *l);

/* List the arena (disk = 0: most recently used first, or by hits, ties in
 * recency order) or the store (disk = 1: the store's order), limit entries
 * from offset. RK_ERR_INVALID for the disk tier without a store or for a
 * viewer that may not see everything. */
rk_status rk_service_chunk_list(rk_service *svc, const rk_cache_viewer *who, int disk, int by_hits,
                                int offset, int limit, rk_chunk_listing *out);

/* One chunk: the arena entry (on_disk set when the store has it too), else
 * the store row. RK_ERR_NOT_FOUND when the viewer sees neither. */
rk_status rk_service_chunk_get(rk_service *svc, const rk_cache_viewer *who, rk_chunk_key key,
                               rk_chunk_info *out);

/* Remove a chunk from the arena and the store; *in_arena and *on_disk say
 * where it was removed from. When its store row went but its payload file
 * could not be removed (a read-only directory), *on_disk is 0 and disk_why
 * (why_cap bytes) says why; the store keeps it from being served or
 * rebuilt (a tombstone) and removes it at an open that can. disk_why is ""
 * otherwise. RK_ERR_NOT_FOUND when the viewer sees it nowhere, RK_ERR_BUSY
 * while a request in flight holds it. */
rk_status rk_service_chunk_delete(rk_service *svc, const rk_cache_viewer *who, rk_chunk_key key,
                                  int *in_arena, int *on_disk, char *disk_why, size_t why_cap);

typedef struct rk_flush_counts {
    int chunks;                           /* arena entries removed */
    uint64_t prefix_nodes, prefix_tokens; /* radix nodes and tokens evicted */
    uint64_t disk_rows;                   /* store rows removed */
    uint64_t disk_files_left;             /* of their payload files, those that could not be
                                             removed (tombstoned: never served or rebuilt) */
    char disk_why[200];                   /* why the first of those stayed; "" when none */
} rk_flush_counts;

/* Empty the chunk index (chunks), the radix tree (prefix) and the store
 * (disk; RK_ERR_INVALID without a store), everyone's: a flush is an
 * operator's act. The shared tier has its own call, below. */
rk_status rk_service_flush(rk_service *svc, int chunks, int prefix, int disk, rk_flush_counts *out);

/* The shared (Redis) tier's entries of this model, in SCAN order, limit from
 * offset; total is the entries seen (SCAN has no count: offset + limit at
 * most). RK_ERR_INVALID without the tier or for a viewer that may not see
 * everything (the tier keeps no owners), RK_ERR_IO when Redis cannot be
 * reached.
 *
 * Unlike the calls above, this one and rk_service_redis_flush may run on any
 * thread, and should run off the engine thread: the tier opens a connection
 * of its own for them, so a SCAN over many keys never holds a step up. */
rk_status rk_service_redis_list(rk_service *svc, const rk_cache_viewer *who, int offset, int limit,
                                rk_chunk_listing *out);

/* Delete every shared-tier key of this model (payloads, markers, locks);
 * *out_keys receives the payloads removed. Other models' keys are kept.
 * RK_ERR_INVALID without the tier, RK_ERR_IO when Redis cannot be reached.
 * Any thread (see rk_service_redis_list). */
rk_status rk_service_redis_flush(rk_service *svc, uint64_t *out_keys);

#endif
