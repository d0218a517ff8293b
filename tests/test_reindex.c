/* tests/test_reindex.c — reindex/: where a request's chunks go (sequential
 * and parallel position modes), the token copies that move cached chunk KV
 * into a request's live blocks, and the run tables that let attention read
 * cached blocks in place. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "reindex/reindex.h"

Test(reindex, sequential_layout_follows_table_order) {
    const int lens[] = {3, 7, 2};
    rk_layout l;
    cr_assert_eq(rk_layout_plan(RK_POSITIONS_SEQUENTIAL, 5, lens, 3, NULL, &l), RK_OK);
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
    cr_assert_eq(rk_layout_plan(RK_POSITIONS_PARALLEL, 5, lens, 3, NULL, &l), RK_OK);
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
        cr_assert_eq(rk_layout_plan((rk_position_mode)mode, 9, NULL, 0, NULL, &l), RK_OK);
        cr_expect_eq(l.n_chunks, 0);
        cr_expect_eq(l.question_index, 9, "mode %d", mode);
        cr_expect_eq(l.question_pos, 9, "mode %d", mode);
        rk_layout_free(&l);
    }
}

Test(reindex, chunk_groups_follow_the_texts_between_them) {
    /* system 5; group 0: chunks of 4 and 7; a text of 3; group 1: none; a
     * text of 2; group 2: a chunk of 6; then the question. */
    const int lens[] = {4, 7, 6}, ends[] = {2, 2, 3}, gaps[] = {3, 2};
    rk_layout_groups g = {3, ends, gaps};
    rk_layout l;
    cr_assert_eq(rk_layout_plan(RK_POSITIONS_SEQUENTIAL, 5, lens, 3, &g, &l), RK_OK);
    cr_expect_eq(l.n_gaps, 2);
    cr_expect_eq(l.index[0], 5);
    cr_expect_eq(l.index[1], 9);
    cr_expect_eq(l.gap_index[0], 16);
    cr_expect_eq(l.gap_index[1], 19);
    cr_expect_eq(l.index[2], 21);
    cr_expect_eq(l.question_index, 27);
    for (int k = 0; k < 3; k++) cr_expect_eq(l.pos[k], l.index[k]);
    cr_expect_eq(l.gap_pos[0], 16);
    cr_expect_eq(l.question_pos, 27);
    rk_layout_free(&l);
    /* Parallel: a group's chunks share its first position; what follows
     * starts after its longest chunk. Table indices are the same. */
    cr_assert_eq(rk_layout_plan(RK_POSITIONS_PARALLEL, 5, lens, 3, &g, &l), RK_OK);
    cr_expect_eq(l.pos[0], 5);
    cr_expect_eq(l.pos[1], 5);
    cr_expect_eq(l.gap_pos[0], 12);
    cr_expect_eq(l.gap_pos[1], 15);
    cr_expect_eq(l.pos[2], 17);
    cr_expect_eq(l.question_pos, 23);
    cr_expect_eq(l.index[2], 21);
    cr_expect_eq(l.question_index, 27);
    rk_layout_free(&l);
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

/* Three runs over 4-token blocks: the system prompt where it was computed
 * (delta 0), a cached chunk 10 positions below its live place, a short one
 * 2 above. Each run starts at offset 0 of its own first block. */
static void three_runs(rk_runs *t) {
    const int32_t sys[] = {9, 3}, chunk[] = {7, 1}, tail[] = {4};
    memset(t, 0, sizeof *t);
    cr_assert_eq(rk_runs_add(t, 4, sys, 6, 0), RK_OK);
    cr_assert_eq(rk_runs_add(t, 4, chunk, 5, 10), RK_OK);
    cr_assert_eq(rk_runs_add(t, 4, tail, 3, -2), RK_OK);
}

Test(reindex, run_table_slots_restart_at_each_runs_first_block) {
    rk_runs t;
    three_runs(&t);
    cr_assert_eq(t.n_runs, 3);
    cr_assert_eq(t.n_blocks, 5);
    const int32_t want_end[] = {6, 11, 14}, want_first[] = {0, 2, 4};
    for (int k = 0; k < 3; k++) {
        cr_expect_eq(t.end[k], want_end[k], "run %d end", k);
        cr_expect_eq(t.first[k], want_first[k], "run %d first table entry", k);
    }
    /* Entry 5 is the system's sixth token (block 3, offset 1); entry 6 opens
     * the chunk's block 7 although the system's block has room left. */
    const int entries[] = {0, 3, 4, 5, 6, 9, 10, 11, 13};
    const int32_t want_slot[] = {36, 39, 12, 13, 28, 31, 4, 16, 18};
    for (int i = 0; i < 9; i++)
        cr_expect_eq(rk_runs_slot(&t, 4, entries[i]), want_slot[i], "entry %d", entries[i]);
    rk_runs_free(&t);
    cr_expect_null(t.blocks);
    cr_expect_eq(t.n_runs, 0);
}

Test(reindex, run_table_cover_cuts_the_last_run_at_the_kv_length) {
    rk_runs t;
    three_runs(&t);
    int32_t end[3], delta[3];
    int n_table = -1;
    /* Into the chunk: two runs, the second cut at 8, three table entries. */
    cr_assert_eq(rk_runs_cover(&t, 4, 8, end, delta, &n_table), 2);
    cr_expect_eq(end[0], 6);
    cr_expect_eq(end[1], 8);
    cr_expect_eq(delta[0], 0);
    cr_expect_eq(delta[1], 10);
    cr_expect_eq(n_table, 3);
    /* Exactly the system prompt: one run, its two blocks. */
    cr_assert_eq(rk_runs_cover(&t, 4, 6, end, delta, &n_table), 1);
    cr_expect_eq(end[0], 6);
    cr_expect_eq(n_table, 2);
    /* Everything: every run and block. */
    cr_assert_eq(rk_runs_cover(&t, 4, 14, end, delta, &n_table), 3);
    cr_expect_eq(end[2], 14);
    cr_expect_eq(delta[2], -2);
    cr_expect_eq(n_table, 5);
    /* The table size alone, and nothing at all. */
    cr_assert_eq(rk_runs_cover(&t, 4, 12, NULL, NULL, &n_table), 3);
    cr_expect_eq(n_table, 5);
    cr_assert_eq(rk_runs_cover(&t, 4, 0, end, delta, &n_table), 0);
    cr_expect_eq(n_table, 0);
    rk_runs_free(&t);
}

Test(reindex, run_table_grows_past_its_first_capacity_and_keeps_earlier_runs) {
    enum { BS = 16, RUNS = 40 };
    rk_runs t = {0};
    /* Each run is one block and one token long: two blocks, ids 2k and 2k + 1. */
    for (int k = 0; k < RUNS; k++) {
        const int32_t blocks[] = {2 * k, 2 * k + 1};
        cr_assert_eq(rk_runs_add(&t, BS, blocks, BS + 1, k), RK_OK);
    }
    cr_assert_eq(t.n_runs, RUNS);
    cr_assert_eq(t.n_blocks, 2 * RUNS);
    for (int k = 0; k < RUNS; k++) {
        int start = k * (BS + 1);
        cr_expect_eq(rk_runs_slot(&t, BS, start), 2 * k * BS, "run %d first entry", k);
        cr_expect_eq(rk_runs_slot(&t, BS, start + BS), (2 * k + 1) * BS, "run %d last entry", k);
        cr_expect_eq(t.delta[k], k);
    }
    int n_table;
    cr_expect_eq(rk_runs_cover(&t, BS, RUNS * (BS + 1), NULL, NULL, &n_table), RUNS);
    cr_expect_eq(n_table, 2 * RUNS);
    rk_runs_free(&t);
}
