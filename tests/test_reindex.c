/* tests/test_reindex.c — reindex/: where a request's chunks go (sequential
 * and parallel position modes) and the token copies that move cached chunk
 * KV into a request's live blocks. */
#include <criterion/criterion.h>
#include <stdlib.h>

#include "reindex/reindex.h"

Test(reindex, sequential_layout_follows_table_order) {
    const int lens[] = {3, 7, 2};
    rk_layout l;
    cr_assert_eq(rk_layout_plan(RK_POSITIONS_SEQUENTIAL, 5, lens, 3, &l), RK_OK);
    cr_assert_eq(l.n_chunks, 3);
    const int want[] = {5, 8, 15};
    for (int k = 0; k < 3; k++) {
        cr_expect_eq(l.index[k], want[k], "chunk %d index", k);
        cr_expect_eq(l.pos[k], want[k], "chunk %d position", k);
    }
    cr_expect_eq(l.question_index, 17);
    cr_expect_eq(l.question_pos, 17);
    rk_layout_free(&l);
    cr_expect_null(l.pos);
}

Test(reindex, parallel_layout_starts_every_chunk_after_the_system_prompt) {
    const int lens[] = {3, 7, 2};
    rk_layout l;
    cr_assert_eq(rk_layout_plan(RK_POSITIONS_PARALLEL, 5, lens, 3, &l), RK_OK);
    const int want_index[] = {5, 8, 15};
    for (int k = 0; k < 3; k++) {
        cr_expect_eq(l.index[k], want_index[k], "chunk %d index", k);
        cr_expect_eq(l.pos[k], 5, "chunk %d position", k);
    }
    /* The table still holds every chunk; the question follows the longest one. */
    cr_expect_eq(l.question_index, 17);
    cr_expect_eq(l.question_pos, 12);
    rk_layout_free(&l);
}

Test(reindex, no_chunks_puts_the_question_right_after_the_system_prompt) {
    for (int mode = RK_POSITIONS_SEQUENTIAL; mode <= RK_POSITIONS_PARALLEL; mode++) {
        rk_layout l;
        cr_assert_eq(rk_layout_plan((rk_position_mode)mode, 9, NULL, 0, &l), RK_OK);
        cr_expect_eq(l.n_chunks, 0);
        cr_expect_eq(l.question_index, 9, "mode %d", mode);
        cr_expect_eq(l.question_pos, 9, "mode %d", mode);
        rk_layout_free(&l);
    }
}

Test(reindex, copy_plan_maps_table_indices_to_slots_across_blocks) {
    enum { BS = 4 };
    const int32_t src_blocks[] = {7, 2};
    int32_t dst_blocks[] = {1, 5};
    rk_seq dst = {.blocks = dst_blocks, .n_blocks = 2, .cap = 2, .n_tokens = 8};
    rk_copy_plan p = {0};
    /* Source tokens 2..5 (blocks 7 then 2) to destination indices 3..6 (blocks 1 then 5). */
    cr_assert_eq(rk_copy_plan_add(&p, BS, src_blocks, 2, &dst, 3, 4, 10), RK_OK);
    const int32_t want_src[] = {30, 31, 8, 9}, want_dst[] = {7, 20, 21, 22};
    cr_assert_eq(p.n, 4);
    for (int i = 0; i < 4; i++) {
        cr_expect_eq(p.src[i], want_src[i], "src %d", i);
        cr_expect_eq(p.dst[i], want_dst[i], "dst %d", i);
        cr_expect_eq(p.delta[i], 10, "delta %d", i);
    }
    /* A second chunk appends with its own delta (negative: moved to an earlier position). */
    cr_assert_eq(rk_copy_plan_add(&p, BS, src_blocks, 0, &dst, 0, 1, -3), RK_OK);
    cr_expect_eq(p.n, 5);
    cr_expect_eq(p.src[4], 28);
    cr_expect_eq(p.dst[4], 4);
    cr_expect_eq(p.delta[4], -3);
    rk_copy_plan_free(&p);
    cr_expect_null(p.src);
    cr_expect_eq(p.n, 0);
}

Test(reindex, copy_plan_grows_past_its_first_capacity_and_keeps_earlier_entries) {
    enum { BS = 16, N = 1000 };
    int32_t *blocks = malloc((N / BS + 1) * sizeof *blocks);
    cr_assert_not_null(blocks);
    for (int b = 0; b <= N / BS; b++) blocks[b] = (N / BS) - b; /* reversed block ids */
    rk_seq dst = {.blocks = blocks, .n_blocks = N / BS + 1, .cap = N / BS + 1};
    rk_copy_plan p = {0};
    for (int i = 0; i < N; i += 100)
        cr_assert_eq(rk_copy_plan_add(&p, BS, blocks, i, &dst, i, 100, i), RK_OK);
    cr_assert_eq(p.n, N);
    cr_expect_geq(p.cap, N);
    for (int i = 0; i < N; i++) {
        int32_t slot = blocks[i / BS] * BS + i % BS;
        cr_expect_eq(p.src[i], slot, "src %d", i);
        cr_expect_eq(p.dst[i], slot, "dst %d", i);
        cr_expect_eq(p.delta[i], i / 100 * 100, "delta %d", i);
    }
    rk_copy_plan_free(&p);
    free(blocks);
}
