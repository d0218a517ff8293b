/* pipeline/internal.h — private to pipeline/: nothing outside this folder
 * includes it (the public interface is pipeline.h). It holds what the
 * request pipeline's files share: a request's state, a forward pass under
 * construction, an admission, the running requests, and the functions that
 * cross files.
 *
 * The request pipeline's files, in three roles that data passes through one
 * way (the scheduler decides and calls the others; the KV planner owns
 * blocks; the runner computes; nothing below calls back up):
 *   step.c     the scheduler's per-step policy: admission into the running
 *              requests, one step (make room, preempt, the pass), leaving,
 *              resuming, rk_pipeline_run.
 *   pipeline.c the driver: stages 1-8 (numbered as in docs/architecture.md)
 *              in order, each a call into the file named after it, and
 *              pass 1 of stages 2 and 3.
 *   request.c  stage 1, prepare: tokenizing the pieces, the context and
 *              max_tokens checks, the result buffers, a request's state
 *              (rk_init_request), rk_request_free.
 *   prefix.c   stage 2, system prompt: the radix key, match and usable
 *              prefix, the blocks reserved, the system pages inserted.
 *   chunks.c   stage 3, chunks: lookups, tier loads, misses (single
 *              flight), how they are fed (pass 1, pass 2, the steps).
 *   reindex_stage.c  stage 4, reindex: the zero-copy run tables, or the
 *              chunks copied into the request's blocks.
 *   repair.c   stage 5, repair, and its policies (deviation, query, first_k).
 *   question.c stage 6, question: the rest of the prompt, fed in the steps.
 *   decode.c   stage 7, decode: a step's forward pass, sampling, the report.
 *   release.c  stage 8, release: the sequence into the radix tree, then all
 *              a request holds given back.
 *   batch.c    the runner: a forward pass under construction, run.
 *   prewarm.c  rk_pipeline_prewarm: chunks into the cache ahead of requests.
 * Around them: service.c (the service object), scheduler.c (the engine
 * thread), split.c, persist.c (the disk and Redis tiers), cachectl.c. */
#ifndef RK_PIPELINE_INTERNAL_H
#define RK_PIPELINE_INTERNAL_H

#include "pipeline/pipeline.h"

typedef struct rk_insert_job rk_insert_job; /* release.c */

/* A scratch sequence: KV computed somewhere other than the request's own
 * table, then copied into place. */
typedef struct scratch {
    rk_seq kv;
    int used;      /* kv holds references of its own */
    int borrowed;  /* kv.blocks are a chunk entry's: never released through kv */
    int src_first; /* table index of the chunk's first token in kv */
    int pass2;     /* computed in pass 2 (after the system prompt) */
    int anchored;  /* computed in pass 1 after the anchor, then copied into its entry */
    /* The chunk pool had no room: its entry is the request's own, not in the
     * index, its blocks from the live pool (see acquire_uncached). */
    int uncached;
    /* An isolated miss (or another request's PENDING entry) computed by the
     * steps' passes, a slice within the step budget at a time, straight
     * into the entry's blocks (kv borrows them); see chunk_wait. */
    int stepped;
    /* A `system`- or `anchor`-context miss fed like an isolated one, by
     * pass 1 or by the steps, straight into its entry's blocks: attended
     * through a run table of two runs, the request's context (its system
     * pages, or its anchor block) then the entry's blocks (see
     * feed_in_context). n_runs 0: not fed that way. */
    rk_runs ctx_runs;
    int32_t *tokens; /* oracle with system context: system + chunk tokens */

    /* The fleet-wide compute lock on its chunk, held when rlocked. */
    rk_redis_lock rlock;
    int rlocked;
} scratch;

/* A run of chunk tokens the repair recomputes through every layer: n
 * tokens at positions pos.., table indices idx.. of the merged sequence. */
typedef struct repair_run {
    const int32_t *tokens;
    int n, pos, idx;
} repair_run;

struct rk_req_state {
    rk_seq kv;           /* the merged sequence (zero-copy: its system and live blocks) */
    int zc;              /* zero-copy: the merged sequence's table is `runs` */
    rk_runs runs;        /* zero-copy: system, each chunk's cached blocks, live blocks */
    rk_seq own;          /* zero-copy: private copies of the chunk blocks a repair writes */
    rk_seq anchor;       /* `anchor` context: one live block, the anchor token at position 0 */
    rk_radix_node *lock; /* radix path held for the request */
    int sys_first;       /* first system token to compute */
    int n_insert;        /* system tokens to insert into the radix tree after pass 1 */
    int32_t partial_src; /* radix page the match continues into (referenced), -1 = none */
    int n_partial;       /* its first rows to copy, at table index reused - n_partial */
    uint64_t ns;         /* the request's radix namespace */
    int32_t *key;        /* (layout + max_tokens) radix key of the merged sequence */
    int n_prompt;        /* table entries of the prompt */
    int reused;          /* table entries taken from the radix tree */
    int n_valid;         /* table entries whose KV is written */
    rk_layout layout;
    rk_chunk_entry **entries; /* (n_chunks) references held, NULL for oracle chunks */
    rk_chunk_lookup *kinds;   /* (n_chunks) */
    scratch *scratch;         /* (n_chunks) used ones have kv.n_blocks > 0 */
    /* Tokens fed in the question pass: the question (plain: chunks +
     * question), then, resuming, the tokens generated before but the last. */
    int32_t *qtok;
    int n_qtok;
    int n_gen; /* those generated tokens */
    /* Resuming: the report of its first admission, put back once admitted
     * (the resumed prompt finds its chunks cached, and so on). */
    rk_request *first_report;
    int q_index, q_pos; /* table index and position of the first of them */
    int next_pos;       /* position of the next token to feed */
    /* The prompt work left to the question pass (its last pass, merged with
     * decode steps, see rk_run_pass): the system tail from sys_next (== n_sys
     * when pass 1 computed it), then ptok[p_next .. n_ptok) at table index
     * p_idx and position p_pos on; the last of it gives the first token. */
    int prefilling;
    /* Set (with prefilling) while its stepped chunks are computed by the
     * steps' passes: the stages after the chunks (system chunks, reindex,
     * repair, queue prompt) run once every one of them is READY. */
    int chunk_wait;
    int sys_next;
    const int32_t *ptok;
    int n_ptok, p_idx, p_pos, p_next;
    /* Stage 5's chosen runs, in table order (n_rtok tokens in all, r_next of
     * them fed): run at admission, or, stepped (rk_repair_stepped), fed by
     * the steps' passes after the system tail and before ptok. */
    repair_run *repair;
    int n_repair, cap_repair, n_rtok, r_next;
    /* Stepped, the deviation policy's pass too (rk_repair_score_step):
     * while scoring, dev_next of its dev_total chunk tokens have been run
     * through layers 0..1; dev_before holds their reused layer-1 K/V. Its
     * runs are recorded when it ends; nothing of its prompt is fed before.
     * q_mass: the query policy's attention score of each chunk token, in
     * chunk order, until the deviation pass ends (repair.c fuse_ranks). */
    int scoring, dev_next, dev_total;
    float *dev_before, *q_mass;
    int row, fed_sys, fed_p, fed_r; /* in the current pass: its logits row (-1: none), tokens fed */
    /* In the current pass, with the prompt's log-probabilities: lp_n logits
     * rows from lp_row, for its prompt tokens from lp_seq on (rk_feed_prompt). */
    int lp_row, lp_seq, lp_n;
    rk_sampler sampler;
    int done;
    int hook_index; /* the hooks' req: its rank in admission order */
    double t_start;
};

/* One forward pass under construction: sequences with their tokens, slots and
 * block tables. */
typedef struct batch {
    int n_tok, cap_tok;
    int32_t *tokens, *pos, *slots;
    int n_seq, cap_seq;
    int32_t *q_start, *kv_len;
    int32_t *logit_rows; /* (cap_rows) the n_logits rows asked for */
    int cap_rows;
    int n_prompt_rows;     /* of them, rows of prompts' log-probabilities (rk_feed_prompt) */
    const rk_seq **tables; /* (n_seq) the sequence whose blocks are its table */
    const rk_runs **runs;  /* (n_seq) its run table instead, or NULL */
    int32_t *seg_start, *seg_end, *seg_delta; /* the runs, when some sequence has them */
    int cap_segs;
    int max_blocks;
    int32_t *table; /* (n_seq, max_blocks) built at run time */
    int n_logits;
    float *logits; /* (n_logits, n_vocab) */
    int cap_logits;
    int n_layers; /* run only the first n_layers (0 = all) */
    float *out_q; /* not NULL: the last layer run's queries, (n_tok, n_heads * head_dim) */
} batch;

/* The PENDING chunk entries one forward pass computes, and how many tokens
 * of each: a chunk that several requests need is fed once a pass. */
typedef struct chunk_feed {
    rk_chunk_entry **e; /* (n) */
    int *tokens;        /* (n) */
    int n, cap;
} chunk_feed;

/* The requests admitted together and the buffers their passes share. */
typedef struct admission {
    rk_service *svc;
    rk_request *const *reqs;
    int n;
    batch *b;
    rk_copy_plan *copies;
    /* Leave isolated chunk misses and the repair's recompute to the steps'
     * passes (rk_pipeline_join with a step budget) instead of computing them
     * at admission. */
    int defer;
    chunk_feed *feed; /* pass 1's chunk entries */
} admission;

/* The running requests (rk_pipeline, opaque in pipeline.h): the
 * scheduler's (step.c); the driver and the runner use its pass buffers. */
struct rk_pipeline {
    rk_service *svc;
    rk_request **running; /* (cap) admitted and unfinished, by rank (first admission) */
    int n_running, cap;
    int n_admitted;         /* requests admitted so far: the next one's rank */
    rk_request **work;      /* (2 cap) the current pass's decoding and prefilling requests */
    rk_request **preempted; /* (cap_preempted) waiting to resume, by rank */
    int n_preempted, cap_preempted;
    batch b; /* reused by every pass */
    rk_copy_plan copies;
    chunk_feed feed;        /* the chunk entries of the pass under construction */
    rk_embed_task **embeds; /* (cap_embeds) embedding work joined and not done, in join order */
    int n_embeds, cap_embeds;
    /* Sequences of requests that left, being copied into the radix tree a
     * slice a step (release.c), oldest first. */
    rk_insert_job **inserts;
    int n_inserts, cap_inserts;
};

/* ---------------------------------------------------------------- embed.c: embedding work */

/* One embedding pass of the step: slices of tasks' inputs, in their order,
 * at most budget tokens of them (<= 0: up to 2048). Cancelled tasks end
 * first; a failure ends the tasks it touched (rk_embed_task_done). When the
 * live pool has no room for any slice, they wait for the generations to
 * release blocks (others_running), or the first waiting task fails. */
void rk_embed_step(rk_service *svc, rk_embed_task *const *tasks, int n_tasks, int budget,
                   int others_running);

/* ---------------------------------------------------------------- pipeline.c: the driver */

/* Stages 1-6 of the requests admitted together (see pipeline.c): their
 * state, then up to the question pass itself (defer: up to the chunks the
 * steps' passes compute, for the requests that wait for them); on failure
 * every one of reqs has released what it took. Fresh requests get their
 * rank (*n_fresh of them). */
rk_status rk_admit_stages(rk_pipeline *p, rk_request *const *reqs, int n_reqs, int defer,
                          int *n_fresh);
/* Stages 2 (system prompt) and 3 (chunks), first part: the radix match and
 * the chunk lookups of every request in a, then pass 1 (the system tails
 * something attends to before the question pass, the chunk misses fed at
 * admission); the new system pages go into the tree. */
rk_status rk_stage_system_and_chunks(admission *a);
/* The stages after the chunks' first part: 3 chunks' pass 2, 4 reindex,
 * 5 repair, 6 question set-up. */
rk_status rk_stages_after_chunks(admission *a);
/* A finished request leaves (stages 7's report and 8): its report is
 * completed and all it holds released (a failed one's sequence is not
 * kept; a zero-copy one's copy into the radix tree is queued on p, see
 * rk_inserts_step). */
void rk_leave(rk_pipeline *p, rk_request *r);

/* ---------------------------------------------------------------- request.c: stage 1 */

/* Tokenize text t (special: control tokens parsed) into *ids (malloc'ed,
 * NULL when empty) of *n tokens. */
rk_status rk_request_encode(const rk_tokenizer *tok, const rk_text *t, int special, int32_t **ids,
                            int *n);
/* Give r a fresh state (r->state) for an admission; on failure the caller
 * releases what it took with rk_release_request. */
rk_status rk_init_request(rk_service *svc, rk_request *r);
/* The chunk group chunk k of r belongs to (0 when r has one). */
int rk_chunk_group(const rk_request *r, int k);
/* Whether chunk k of r lies in the prefix its admission took from the radix
 * tree (computed and repaired as an earlier request left it). */
int rk_chunk_from_prefix(const rk_request *r, int k);
/* Give an uncached entry's live blocks back (once). */
void rk_drop_uncached_blocks(rk_service *svc, rk_chunk_entry *e);
/* Keep what a request's first admission reported (before it is preempted),
 * and put it back when it resumes: a resumed request reports its first
 * admission, whose work the caches now stand in for. */
rk_status rk_save_report(rk_request *r);
void rk_restore_report(rk_request *r);

/* ---------------------------------------------------------------- prefix.c: stage 2 */

/* Match r's prompt key in the radix tree and reserve the blocks of the rest
 * of its sequence, for either reindex path (zero-copy: its own blocks are
 * the system's and the live ones; kv.n_tokens counts table entries of the
 * run table). */
rk_status rk_start_request(rk_service *svc, rk_request *r);
/* Drop the reference on the partial page a match continued into. */
void rk_drop_partial(rk_service *svc, rk_req_state *s);
/* After the radix-bound system pages are computed: insert them (the tree's
 * locked path replaces the request's). */
rk_status rk_insert_system(rk_service *svc, rk_request *r);

/* ---------------------------------------------------------------- chunks.c: stage 3 */

/* The chunk-key policy of request r's chunks. */
void rk_request_chunk_policy(rk_service *svc, const rk_request *r, rk_chunk_policy *p);
/* Look up every chunk of r; queue the work each needs for pass 1 (or mark
 * it stepped, for the steps' passes). */
rk_status rk_plan_chunks(admission *a, rk_request *r);
/* Stage 3, second part: pass 2 (the `system`-context misses on a backend
 * without run tables), the scratch-computed chunks copied into their
 * entries, then every whole entry ready and written through to the tiers. */
rk_status rk_stage_system_chunks(admission *a);
/* Whether every stepped chunk of r (chunk_wait) is READY or computed. */
int rk_chunks_computed(const rk_request *r);
/* Feed r's stepped chunks that are still being computed into p's pass, at
 * most *left tokens (the system tail first in the `system` context). */
rk_status rk_feed_chunks(rk_pipeline *p, rk_request *r, int *left);

/* ---------------------------------------------------------------- reindex_stage.c: stage 4 */

/* Whether the backend's attention reads a sequence through a run table
 * (position-shifted attention): the CPU's. */
int rk_attends_runs(const rk_service *svc);
/* Whether request r reuses its cached chunks in place (zero-copy) rather
 * than copying them (tell: log once when the backend cannot). */
int rk_zero_copy_for(const rk_service *svc, const rk_request *r, int tell);
/* Stage 4 (reindex). */
rk_status rk_stage_reindex(admission *a);
/* Tokens of a zero-copy request's chunk of n tokens that are copied into
 * private blocks: those of the blocks its `first_k` repair writes. */
int rk_private_tokens(const rk_request *r, int n, int bs);

/* ---------------------------------------------------------------- repair.c: stage 5 */

/* Stage 5 (repair, optional). */
rk_status rk_stage_repair(admission *a);
/* Whether r's repair runs are left to the steps' passes (a defers, r has
 * something to generate). */
int rk_repair_stepped(const admission *a, const rk_request *r);
/* Add up to *left tokens (< 0: no limit) of the repair runs r has not fed
 * to b, in table order; *left goes down and s->fed_r is what was added. */
rk_status rk_repair_feed(batch *b, int bs, rk_req_state *s, int *left);
/* One slice of the deviation passes of the requests of reqs that are
 * scoring, in a pass of the policy's layers worth budget tokens of full
 * passes (<= 0: all of it), in b (reset); a request whose pass ends gets
 * its runs recorded (then the steps feed them, and its question). */
rk_status rk_repair_score_step(rk_service *svc, batch *b, rk_request *const *reqs, int n_reqs,
                               int budget);

/* ---------------------------------------------------------------- question.c: stage 6 */

/* Stage 6 (question), its set-up: what is left of each request's prompt for
 * the question pass. A cancelled request is done. */
void rk_queue_prompt(admission *a);
/* Feed what is left of r's prompt into b, at most *left tokens: its system
 * tail, its stepped repair runs, then the rest; logits for the last token
 * when it has no token yet; with opt.prompt_logprobs (until its first
 * token) for every token, at most max_rows of them in b's prompt rows. */
rk_status rk_feed_prompt(batch *b, int bs, rk_request *r, int *left, int max_rows);
/* After the pass ran: the prompt rows rk_feed_prompt asked for r reduced to
 * its prompt log-probability entries. */
void rk_take_prompt_logprobs(rk_request *r, const float *logits, int n_vocab);

/* ---------------------------------------------------------------- decode.c: stage 7 */

/* Complete r's report (token counts, total time) when it leaves or is
 * preempted. */
void rk_finish_report(rk_request *r);
/* One forward pass: the next token of every request in dec, then at most
 * budget tokens (<= 0: all) of the prompt work of the requests in pre;
 * each request with logits in it takes its next token. */
rk_status rk_run_pass(rk_pipeline *p, rk_request *const *dec, int n_dec, rk_request *const *pre,
                      int n_pre, int budget, const rk_pipeline_hooks *hooks);

/* ---------------------------------------------------------------- release.c: stage 8 */

/* A finished or preempted request's whole sequence into the radix tree
 * (its prompt key and the generated tokens that have KV); failures only
 * lose the caching. A zero-copy sequence is a copy of its runs: with p not
 * NULL it is queued on p (rk_inserts_step runs it), else made at once. */
void rk_insert_sequence(rk_service *svc, rk_pipeline *p, rk_request *r);
/* Release all r holds (failed: nothing goes into the radix tree, entries
 * computed for it are dropped); r->state is NULL after. */
void rk_release_request(rk_service *svc, rk_request *r, int failed);
/* rk_release_request for a request that leaves p (failed when r->failure
 * is set): a zero-copy sequence's copy into the tree is queued on p. */
void rk_release_leaving(rk_pipeline *p, rk_request *r);
/* Run the queued copies of sequences into the radix tree, oldest first, at
 * most max tokens of them (<= 0: all); those done go into the tree.
 * Returns how many are still queued. */
int rk_inserts_step(rk_pipeline *p, int max);
/* Drop the queued copies (their sequences are not cached). */
void rk_inserts_drop(rk_pipeline *p);

/* ---------------------------------------------------------------- batch.c: the runner */

/* Empty b for the next pass, keeping its buffers. */
void rk_batch_reset(batch *b);
/* Free b's buffers; b is empty after. */
void rk_batch_free(batch *b);
/* want_logits of rk_batch_add: a logits row for every token added. */
#define RK_LOGITS_ALL 2

/* Logits rows one pass computes for prompts' log-probabilities, at most
 * (the rest of such a prompt goes to the next passes): this many bytes of
 * logits, and at least one row. */
#define RK_PROMPT_LOGITS_BYTES (32 << 20)

/* Add n tokens of seq to b, at positions pos0.. and table indices idx0..
 * (their slots from seq's blocks); want_logits: 1, a logits row for the
 * last; RK_LOGITS_ALL, one for each. */
rk_status rk_batch_add(batch *b, int bs, const rk_seq *seq, const int32_t *tokens, int n, int pos0,
                       int idx0, int want_logits);
/* rk_batch_add for a request's merged sequence, addressed through its run
 * table when it reuses chunks in place. */
rk_status rk_batch_add_req(batch *b, int bs, const rk_req_state *s, const int32_t *tokens, int n,
                           int pos0, int idx0, int want_logits);
/* Run b's forward pass (nothing when empty); its logits rows land in b->logits. */
rk_status rk_batch_run(rk_service *svc, batch *b);

/* Add up to *left tokens (< 0: no limit) of the PENDING entry e's
 * uncomputed tokens to b, through seq (a view of e's blocks) or, for a
 * chunk computed after a context, through runs (the context, then e's
 * blocks: the tokens go at table index base_pos + progress), unless f has
 * it already this pass or a tier load is filling it; *left goes down by what
 * was added. */
rk_status rk_feed_chunk(batch *b, int bs, chunk_feed *f, rk_chunk_entry *e, const rk_seq *seq,
                        const rk_runs *runs, int *left);
/* After the pass ran: each fed entry's progress goes up by its tokens; f is
 * empty after. */
void rk_feed_done(chunk_feed *f);
void rk_feed_free(chunk_feed *f);

#endif
