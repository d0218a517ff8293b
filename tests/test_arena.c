/* tests/test_arena.c — the KV block arena: pools, quotas, all-or-nothing
 * allocation, reference counts, double-free detection and poisoning. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "chunkcache/arena.h"

static rk_backend *be;
static rk_arena *arena;

static rk_arena_params params(int live, int prefix, int chunk) {
    return (rk_arena_params){.n_layers = 2,
                             .n_kv_heads = 2,
                             .head_dim = 8,
                             .block_size = 16,
                             .dtype = RK_DTYPE_F32,
                             .pool_blocks = {live, prefix, chunk}};
}

static void setup(void) {
    cr_assert_eq(rk_backend_create("cpu", 1, &be), RK_OK);
    rk_arena_params p = params(8, 4, 6);
    cr_assert_eq(rk_arena_create(be, &p, &arena), RK_OK);
}

static void teardown(void) {
    rk_arena_free(arena);
    rk_backend_free(be);
}

TestSuite(arena, .init = setup, .fini = teardown);

Test(arena, pools_are_contiguous_id_ranges) {
    int32_t ids[8];
    cr_assert_eq(rk_arena_alloc(arena, RK_POOL_LIVE, 8, ids), RK_OK);
    for (int i = 0; i < 8; i++) cr_assert_eq(rk_arena_block_pool(arena, ids[i]), RK_POOL_LIVE);
    cr_assert_eq(ids[0], 0);
    cr_assert_eq(rk_arena_alloc(arena, RK_POOL_PREFIX, 1, ids), RK_OK);
    cr_assert_eq(ids[0], 8);
    cr_assert_eq(rk_arena_alloc(arena, RK_POOL_CHUNK, 1, ids), RK_OK);
    cr_assert_eq(ids[0], 12);
    cr_assert_eq(rk_arena_block_pool(arena, 18), -1);
}

Test(arena, exhaustion_returns_error_and_changes_nothing) {
    int32_t ids[16];
    cr_assert_eq(rk_arena_alloc(arena, RK_POOL_CHUNK, 4, ids), RK_OK);
    cr_assert_eq(rk_arena_pool_free(arena, RK_POOL_CHUNK), 2);
    int32_t more[3] = {-7, -7, -7};
    cr_assert_eq(rk_arena_alloc(arena, RK_POOL_CHUNK, 3, more), RK_ERR_EXHAUSTED);
    cr_assert_eq(more[0], -7, "a failed allocation must not write ids");
    cr_assert_eq(rk_arena_pool_free(arena, RK_POOL_CHUNK), 2);
    cr_assert_eq(rk_arena_pool_free(arena, RK_POOL_LIVE), 8);
    cr_assert_eq(rk_arena_pool_free(arena, RK_POOL_PREFIX), 4);
    for (int i = 12; i < 18; i++) cr_assert_eq(rk_arena_refcount(arena, i), i < 16 ? 1 : 0);
}

Test(arena, quotas_keep_pools_apart) {
    int32_t ids[8];
    /* The chunk pool cannot grow into live blocks, and live cannot take chunk blocks. */
    cr_assert_eq(rk_arena_alloc(arena, RK_POOL_CHUNK, 7, ids), RK_ERR_EXHAUSTED);
    cr_assert_eq(rk_arena_alloc(arena, RK_POOL_LIVE, 8, ids), RK_OK);
    int32_t one;
    cr_assert_eq(rk_arena_alloc(arena, RK_POOL_LIVE, 1, &one), RK_ERR_EXHAUSTED);
    cr_assert_eq(rk_arena_pool_free(arena, RK_POOL_CHUNK), 6);
    cr_assert_eq(rk_arena_pool_free(arena, RK_POOL_PREFIX), 4);
}

Test(arena, references_keep_a_block_until_the_last_release) {
    int32_t id;
    cr_assert_eq(rk_arena_alloc(arena, RK_POOL_PREFIX, 1, &id), RK_OK);
    cr_assert_eq(rk_arena_ref(arena, &id, 1), RK_OK);
    cr_assert_eq(rk_arena_refcount(arena, id), 2);
    cr_assert_eq(rk_arena_release(arena, &id, 1), RK_OK);
    cr_assert_eq(rk_arena_pool_free(arena, RK_POOL_PREFIX), 3);
    cr_assert_eq(rk_arena_release(arena, &id, 1), RK_OK);
    cr_assert_eq(rk_arena_pool_free(arena, RK_POOL_PREFIX), 4);
    cr_assert_eq(rk_arena_refcount(arena, id), 0);
}

Test(arena, double_free_is_reported_and_harmless) {
    int32_t id;
    cr_assert_eq(rk_arena_alloc(arena, RK_POOL_LIVE, 1, &id), RK_OK);
    cr_assert_eq(rk_arena_release(arena, &id, 1), RK_OK);
    cr_assert_eq(rk_arena_release(arena, &id, 1), RK_ERR_INTERNAL);
    cr_assert_eq(rk_arena_pool_free(arena, RK_POOL_LIVE), 8, "the free list must not grow twice");
    int32_t bad = 999;
    cr_assert_eq(rk_arena_release(arena, &bad, 1), RK_ERR_INTERNAL);
    cr_assert_eq(rk_arena_ref(arena, &id, 1), RK_ERR_INTERNAL);
}

Test(arena, freed_blocks_are_reused_last_in_first_out) {
    int32_t ids[3];
    cr_assert_eq(rk_arena_alloc(arena, RK_POOL_LIVE, 3, ids), RK_OK);
    cr_assert_eq(rk_arena_release(arena, &ids[1], 1), RK_OK);
    int32_t again;
    cr_assert_eq(rk_arena_alloc(arena, RK_POOL_LIVE, 1, &again), RK_OK);
    cr_assert_eq(again, ids[1]);
}

Test(arena, poison_mode_fills_freed_blocks_with_nan) {
    rk_arena *pa;
    rk_arena_params p = params(2, 0, 0);
    p.poison = 1;
    cr_assert_eq(rk_arena_create(be, &p, &pa), RK_OK);
    const rk_kv_cache *kv = rk_arena_kv(pa);
    int32_t id;
    cr_assert_eq(rk_arena_alloc(pa, RK_POOL_LIVE, 1, &id), RK_OK);
    size_t per_block = 16 * 2 * 8;
    float *k1 = (float *)kv->k[1] + (size_t)id * per_block;
    for (size_t i = 0; i < per_block; i++) k1[i] = 1.0f;
    cr_assert_eq(rk_arena_release(pa, &id, 1), RK_OK);
    for (size_t i = 0; i < per_block; i++) cr_assert(isnan(k1[i]));
    float *v0 = (float *)kv->v[0] + (size_t)id * per_block;
    cr_assert(isnan(v0[per_block - 1]));
    rk_arena_free(pa);
}

Test(arena, q8_0_blocks_are_34_bytes_per_32_values_and_poison_their_scales) {
    rk_arena *pa;
    rk_arena_params p = params(2, 0, 0);
    p.dtype = RK_DTYPE_Q8_0;
    cr_assert_eq(rk_arena_create(be, &p, &pa), RK_ERR_INVALID, "heads of 8 are not whole blocks");
    cr_assert_null(pa);
    p.head_dim = 64;
    p.poison = 1;
    cr_assert_eq(rk_arena_create(be, &p, &pa), RK_OK, "%s", rk_error_message());
    cr_assert_eq(rk_arena_block_bytes(&p), 2 * 2 * 16 * (2 * 64 / 32 * 34));
    const rk_kv_cache *kv = rk_arena_kv(pa);
    int32_t id;
    cr_assert_eq(rk_arena_alloc(pa, RK_POOL_LIVE, 1, &id), RK_OK);
    size_t per_block = 16 * 2 * 64 / 32 * 34;
    unsigned char *k1 = (unsigned char *)kv->k[1] + (size_t)id * per_block;
    memset(k1, 0, per_block);
    cr_assert_eq(rk_arena_release(pa, &id, 1), RK_OK);
    for (size_t b = 0; b < per_block; b += 34)
        cr_assert(isnan(rk_f16_to_f32((uint16_t)(k1[b] | k1[b + 1] << 8))), "block at %zu", b);
    rk_arena_free(pa);
}

Test(arena, rejects_bad_block_sizes) {
    rk_arena *bad;
    int sizes[] = {0, 4, 12, 128};
    for (int i = 0; i < 4; i++) {
        rk_arena_params p = params(2, 0, 0);
        p.block_size = sizes[i];
        cr_assert_eq(rk_arena_create(be, &p, &bad), RK_ERR_INVALID);
        cr_assert_null(bad);
    }
    rk_arena_params p = params(0, 1, 1);
    cr_assert_eq(rk_arena_create(be, &p, &bad), RK_ERR_INVALID);
}

Test(arena, budget_split_by_share) {
    rk_arena_params p = params(0, 0, 0);
    size_t block = rk_arena_block_bytes(&p);
    cr_assert_eq(block, 2 * 2 * 16 * 2 * 8 * 4);
    float share[3] = {0.5f, 0.25f, 0.25f};
    cr_assert_eq(rk_arena_params_from_budget(&p, 100 * block, share), RK_OK);
    cr_assert_eq(p.pool_blocks[RK_POOL_LIVE], 50);
    cr_assert_eq(p.pool_blocks[RK_POOL_PREFIX], 25);
    cr_assert_eq(p.pool_blocks[RK_POOL_CHUNK], 25);
    float too_much[3] = {0.8f, 0.2f, 0.2f};
    cr_assert_eq(rk_arena_params_from_budget(&p, 100 * block, too_much), RK_ERR_INVALID);
}

Test(arena, sequence_reserve_maps_slots_through_its_blocks) {
    rk_seq s = {0};
    int32_t slots[40];
    cr_assert_eq(rk_seq_reserve(&s, arena, RK_POOL_LIVE, 20, slots), RK_OK);
    cr_assert_eq(s.n_blocks, 2);
    cr_assert_eq(slots[0], s.blocks[0] * 16);
    cr_assert_eq(slots[17], s.blocks[1] * 16 + 1);
    s.n_tokens = 20;
    cr_assert_eq(rk_seq_reserve(&s, arena, RK_POOL_LIVE, 13, slots), RK_OK);
    cr_assert_eq(s.n_blocks, 3);
    cr_assert_eq(slots[12], s.blocks[2] * 16);
    /* Too large: all or nothing, the sequence keeps its three blocks. */
    cr_assert_eq(rk_seq_reserve(&s, arena, RK_POOL_LIVE, 200, slots), RK_ERR_EXHAUSTED);
    cr_assert_eq(s.n_blocks, 3);
    cr_assert_eq(rk_arena_pool_free(arena, RK_POOL_LIVE), 5);
    rk_seq_release(&s, arena);
    cr_assert_eq(rk_arena_pool_free(arena, RK_POOL_LIVE), 8);
    cr_assert_null(s.blocks);
}
