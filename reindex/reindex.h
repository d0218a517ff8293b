/* reindex/ — moving cached chunk KV to where a request needs it.
 *
 * A cached chunk's keys carry the rotation of its base positions b..b+n-1.
 * Placed at live offset L, the correct key of its token j is R(L+j)·k =
 * R(L-b)·R(b+j)·k, because RoPE rotations compose; values carry no position.
 * So a request copies the chunk's KV into its own live blocks, rotating keys
 * by delta = L - b, computed in fp32 from the integer delta. The cached entry
 * is never modified.
 *
 * Layout of a request's sequence (its table order):
 *   [system 0..S) [chunk 0] [chunk 1] ... [question] [generated ...]
 * Positions follow table order in `sequential` mode; in `parallel` mode every
 * chunk starts at position S and the question starts after the longest. */
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
} rk_layout;

/* Plan live offsets for a system prompt of n_system tokens followed by
 * chunks of the given lengths. rk_layout_free releases the arrays. */
rk_status rk_layout_plan(rk_position_mode mode, int n_system, const int *chunk_lens, int n_chunks,
                         rk_layout *out);
void rk_layout_free(rk_layout *l);

/* Slot of table index i in a sequence (i < blocks covered). */
static inline int32_t rk_seq_slot(const rk_seq *s, int block_size, int i) {
    return s->blocks[i / block_size] * block_size + i % block_size;
}

/* A list of token copies: K[dst] = R(delta)·K[src], V[dst] = V[src], all layers. */
typedef struct rk_copy_plan {
    int n, cap;
    int32_t *src, *dst, *delta;
} rk_copy_plan;

/* Add n tokens: source table indices src_first.. of src (e.g. a chunk entry's
 * blocks), destination table indices dst_first.. of dst, one delta for all. */
rk_status rk_copy_plan_add(rk_copy_plan *p, int block_size, const int32_t *src_blocks,
                           int src_first, const rk_seq *dst, int dst_first, int n, int delta);

/* Run the whole plan as one rope_shift_copy call, then empty it. */
rk_status rk_copy_plan_run(rk_copy_plan *p, rk_backend *be, rk_arena *a, const rk_rope *rope);

void rk_copy_plan_free(rk_copy_plan *p);

/* A run table: the block table of a sequence assembled from runs (see
 * rk_attn_batch in kernels.h), so that a cached chunk's blocks are attended in
 * place instead of being copied. Run k holds the entries [end[k-1], end[k])
 * (end[-1] read as 0) in the table entries first[k] .. first[k] +
 * ceil(len_k / block_size) - 1, starting at offset 0 of its first block, and
 * its keys sit delta[k] positions below the live ones. The table only names
 * blocks: the references are held by whoever owns them. */
typedef struct rk_runs {
    int n_runs, cap_runs;
    int32_t *end, *delta, *first; /* (n_runs) */
    int32_t *blocks;              /* (n_blocks) the table */
    int n_blocks, cap_blocks;
} rk_runs;

/* Append a run of n entries (n > 0) held in blocks[0 .. ceil(n / block_size)). */
rk_status rk_runs_add(rk_runs *t, int block_size, const int32_t *blocks, int n, int delta);

/* Slot of entry i (i < the last run's end). */
int32_t rk_runs_slot(const rk_runs *t, int block_size, int i);

/* The runs covering entries [0, kv_len): their count; with end and delta
 * non-NULL also their ends (the last one cut at kv_len) and deltas; with
 * n_table non-NULL the table entries they take. */
int rk_runs_cover(const rk_runs *t, int block_size, int kv_len, int32_t *end, int32_t *delta,
                  int *n_table);

void rk_runs_free(rk_runs *t);

#endif
