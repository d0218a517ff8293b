/* reindex/ — a cached chunk's KV where a request needs it: the layout of a
 * request's sequence, and the two ways its chunks' cached KV gets there.
 *
 * A cached chunk's keys carry the rotation of its base positions b..b+n-1.
 * Placed at live offset L, the correct key of its token j is R(L+j)·k =
 * R(L-b)·R(b+j)·k, because RoPE rotations compose; values carry no position.
 * So one integer delta = L - b per chunk moves its KV to any live offset
 * (the rotation computed in fp32 from the integer delta). The cached entry is
 * never modified on either path.
 *
 * Layout (rk_layout) of a request's sequence, its table order:
 *   [system 0..S) [chunk 0] [chunk 1] ... [question] [generated ...]
 * Positions follow table order in `sequential` mode; in `parallel` mode every
 * chunk starts at position S and the question starts after the longest. The
 * radix key of a request follows the same order (pipeline/pipeline.c).
 *
 * Zero-copy (run tables, rk_runs; the default where the backend has
 * position-shifted attention): the request's block table is assembled from
 * runs: its system blocks (delta 0), each cached chunk's own chunk-pool
 * blocks as they are (delta = live offset - base), its live blocks for the
 * question and generated tokens (delta 0). Nothing is copied; attention
 * rotates each key by its run's delta as it reads it (rk_attn_batch's
 * segments in kernels.h). Blocks a request will write (a `first_k` repair)
 * are first copied, rotated to their live offset, into private live blocks,
 * a run of their own with delta 0: copy on write at block granularity.
 *
 * Copy (copy plans, rk_copy_plan; --reindex copy, the deviation and query
 * repair policies, the oracle, other backends): every chunk's KV is
 * copied into the request's own live blocks in one rope_shift_copy call,
 * keys rotated by delta, values copied as they are. A copy plan also serves
 * other moves of KV rows: the partial radix page a match continues into
 * (delta 0), a scratch sequence's chunk into its entry, a zero-copy
 * sequence into prefix-pool blocks when it is inserted into the radix tree.
 *
 * Errors and ownership, per call below. Every call reports failure with an
 * rk_status and a message (rk_error_message, thread-local) and leaves its
 * output as documented on failure; nothing here aborts.
 * Thread-safety: none inside and no global state. A layout, a copy plan or a
 * run table is used by one thread at a time; rk_copy_plan_run also uses the
 * backend and the arena, so it runs on the thread that owns them (the
 * engine thread in `ragkv serve`). rk_layout_plan, rk_seq_slot, rk_runs_slot
 * and rk_runs_cover only read their inputs and may run anywhere. */
#ifndef RK_REINDEX_H
#define RK_REINDEX_H

#include <stdint.h>

#include "chunkcache/arena.h"
#include "config/config.h"
#include "kernels/kernels.h"

typedef enum rk_position_mode {
    RK_POSITIONS_SEQUENTIAL = 0,
    RK_POSITIONS_PARALLEL = 1,
} rk_position_mode;

typedef struct rk_layout {
    int n_chunks;
    int *pos;   /* (n_chunks) live position of each chunk's first token */
    int *index; /* (n_chunks) table index of each chunk's first token */
    int question_pos, question_index;
    /* With chunk groups: the text after group g (g < n_gaps = groups - 1)
     * starts at table index gap_index[g] and position gap_pos[g]. */
    int n_gaps;
    int *gap_pos, *gap_index;
} rk_layout;

/* Chunk groups: group g is chunks [end[g - 1], end[g]) (from 0 for g = 0)
 * and a text of gap_len[g] tokens follows it, for g < n - 1. */
typedef struct rk_layout_groups {
    int n;
    const int *end;
    const int *gap_len;
} rk_layout_groups;

/* Plan table indices and live positions for a system prompt of n_system
 * tokens followed by chunks of the given lengths (n_chunks >= 0), in
 * groups when groups is not NULL (else one group), then the question. In
 * table order every segment follows the one before. Sequential positions
 * are the table indices; parallel ones start every chunk of a group at the
 * group's first position and what follows it after its longest chunk.
 * *out is overwritten and owns malloc'ed arrays afterwards: release them
 * with rk_layout_free. RK_ERR_NOMEM leaves *out empty (nothing to free). */
rk_status rk_layout_plan(rk_position_mode mode, int n_system, const int *chunk_lens, int n_chunks,
                         const rk_layout_groups *groups, rk_layout *out);
/* Free the arrays and zero the layout; a zeroed layout is fine. */
void rk_layout_free(rk_layout *l);

/* Slot of table index i in a sequence (i < blocks covered; not checked). */
static inline int32_t rk_seq_slot(const rk_seq *s, int block_size, int i) {
    return s->blocks[i / block_size] * block_size + i % block_size;
}

/* A list of token copies: K[dst] = R(delta)·K[src], V[dst] = V[src], all
 * layers. A zeroed plan is empty; the plan owns its arrays (rk_copy_plan_free)
 * and keeps them across runs. It names slots only: the caller keeps the
 * source and destination blocks referenced until the plan has run; within
 * one run no destination slot may be written twice or also be a source. */
typedef struct rk_copy_plan {
    int n, cap;
    int32_t *src, *dst, *delta;
} rk_copy_plan;

/* Add n tokens: source table indices src_first.. of src (e.g. a chunk entry's
 * blocks), destination table indices dst_first.. of dst, one delta for all.
 * Both ranges must lie inside the blocks given (not checked here; the
 * backend's rope_shift_copy checks the slots against the arena when the plan
 * runs). RK_ERR_NOMEM leaves the plan as it was. */
rk_status rk_copy_plan_add(rk_copy_plan *p, int block_size, const int32_t *src_blocks,
                           int src_first, const rk_seq *dst, int dst_first, int n, int delta);

/* Run the whole plan as one rope_shift_copy call on be over a's KV with the
 * model's RoPE of each layer (rk_model_ropes), then empty it (also on failure: the plan is not
 * retried). An empty plan is RK_OK without a call. Errors are the backend's: RK_ERR_INVALID, found
 * before anything is written, for a slot outside the arena, a destination slot written twice, a
 * slot that is both a source and a destination, or a rope the cache's head size does not fit;
 * RK_ERR_NOMEM; RK_ERR_DEVICE on an accelerator, after which the
 * destination rows are undefined. The sources are never written. */
rk_status rk_copy_plan_run(rk_copy_plan *p, rk_backend *be, rk_arena *a,
                           const rk_rope *const *ropes);

/* Free the arrays and zero the plan; a zeroed plan is fine. */
void rk_copy_plan_free(rk_copy_plan *p);

/* A run table: the block table of a sequence assembled from runs (see
 * rk_attn_batch in kernels.h), so that a cached chunk's blocks are attended in
 * place instead of being copied. Run k holds the entries [end[k-1], end[k])
 * (end[-1] read as 0) in the table entries first[k] .. first[k] +
 * ceil(len_k / block_size) - 1, starting at offset 0 of its first block, and
 * its keys sit delta[k] positions below the live ones. The table only names
 * blocks: the references are held by whoever owns them (the request's
 * sequences for its own blocks, its chunk-entry references for the cached
 * ones), for as long as the table is used. A zeroed table is empty; it owns
 * its arrays (rk_runs_free). */
typedef struct rk_runs {
    int n_runs, cap_runs;
    int32_t *end, *delta, *first; /* (n_runs) */
    int32_t *blocks;              /* (n_blocks) the table */
    int n_blocks, cap_blocks;
} rk_runs;

/* Append a run of n entries (n > 0) held in blocks[0 .. ceil(n / block_size))
 * (copied: the ids, not the blocks), its keys delta positions below the live
 * ones. RK_ERR_NOMEM leaves the table as it was. */
rk_status rk_runs_add(rk_runs *t, int block_size, const int32_t *blocks, int n, int delta);

/* Slot of entry i (0 <= i < the last run's end; not checked). */
int32_t rk_runs_slot(const rk_runs *t, int block_size, int i);

/* The runs covering entries [0, kv_len): their count; with end and delta
 * non-NULL also their ends (the last one cut at kv_len) and deltas; with
 * n_table non-NULL the table entries they take. */
int rk_runs_cover(const rk_runs *t, int block_size, int kv_len, int32_t *end, int32_t *delta,
                  int *n_table);

/* Free the arrays and zero the table; a zeroed table is fine. */
void rk_runs_free(rk_runs *t);

#endif
