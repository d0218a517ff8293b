/* tests/test_reuse.c — whole-sequence prefix reuse: a finished request's
 * merged sequence (system, chunks as they sit in the live sequence, question,
 * generated tokens) goes into the radix tree, and a later request sharing a
 * prefix of it computes only what follows; blocks move from the live pool to
 * the prefix pool on the way. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/pipeline.h"
#include "tests/testutil.h"

/* ---------------------------------------------------------------- retagging */

Test(reuse, retag_moves_blocks_between_pools_and_keeps_their_sizes) {
    rk_backend *be;
    rk_arena *a;
    cr_assert_eq(rk_backend_create("cpu", 1, &be), RK_OK);
    rk_arena_params p = {.n_layers = 1,
                         .n_kv_heads = 1,
                         .head_dim = 4,
                         .block_size = 8,
                         .dtype = RK_DTYPE_F32,
                         .pool_blocks = {4, 2, 1}};
    cr_assert_eq(rk_arena_create(be, &p, &a), RK_OK);
    int32_t live[4], pre;
    cr_assert_eq(rk_arena_alloc(a, RK_POOL_LIVE, 4, live), RK_OK);
    /* Three to move, two free prefix blocks: nothing moves. */
    cr_assert_eq(rk_arena_retag(a, live, 3, RK_POOL_PREFIX), RK_ERR_EXHAUSTED);
    for (int i = 0; i < 4; i++) cr_assert_eq(rk_arena_block_pool(a, live[i]), RK_POOL_LIVE);
    cr_assert_eq(rk_arena_pool_free(a, RK_POOL_PREFIX), 2);
    cr_assert_eq(rk_arena_retag(a, live, 2, RK_POOL_PREFIX), RK_OK);
    cr_assert_eq(rk_arena_block_pool(a, live[0]), RK_POOL_PREFIX);
    cr_assert_eq(rk_arena_block_pool(a, live[1]), RK_POOL_PREFIX);
    cr_assert_eq(rk_arena_refcount(a, live[0]), 1, "references are kept");
    /* The prefix pool's spare blocks joined the live pool, free. */
    cr_assert_eq(rk_arena_pool_free(a, RK_POOL_PREFIX), 0);
    cr_assert_eq(rk_arena_pool_free(a, RK_POOL_LIVE), 2);
    int32_t two[2];
    cr_assert_eq(rk_arena_alloc(a, RK_POOL_LIVE, 2, two), RK_OK);
    for (int i = 0; i < 2; i++) cr_assert_eq(rk_arena_block_pool(a, two[i]), RK_POOL_LIVE);
    cr_assert_eq(rk_arena_alloc(a, RK_POOL_PREFIX, 1, &pre), RK_ERR_EXHAUSTED);
    /* Already there: no move needed, nothing free needed. */
    cr_assert_eq(rk_arena_retag(a, live, 2, RK_POOL_PREFIX), RK_OK);
    /* A retagged block returns to its new pool. */
    cr_assert_eq(rk_arena_release(a, live, 4), RK_OK);
    cr_assert_eq(rk_arena_release(a, two, 2), RK_OK);
    for (int i = 0; i < RK_POOL_COUNT; i++)
        cr_assert_eq(rk_arena_pool_free(a, (rk_pool_tag)i), p.pool_blocks[i]);
    cr_assert_eq(rk_arena_retag(a, live, 1, RK_POOL_PREFIX), RK_ERR_INTERNAL,
                 "a free block cannot move");
    rk_arena_free(a);
    rk_backend_free(be);
}
