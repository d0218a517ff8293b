/* pipeline/prefix.c — stage 2 of a request (the numbering of
 * docs/architecture.md, driven by pipeline.c): its layout as a radix key
 * (build_key), the match of that key in the radix tree, of which it takes
 * the usable prefix (usable_prefix: never part of a chunk), the blocks
 * reserved for the rest of its sequence (rk_start_request), and its system
 * pages into the tree once computed (rk_insert_system). KV planner, engine
 * thread only. */
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "pipeline/internal.h"

/* Set on the first token of every chunk and of the question in a radix key,
 * so the same tokens segmented differently never match (token ids are below
 * 2^24, checked when the key is built). */
#define SEGMENT_MARK (1 << 30)

/* The radix namespace of a request: everything besides the key's tokens that
 * changes the KV of its merged sequence. A plain sequence depends on its
 * tokens alone. */
static uint64_t request_ns(const rk_service *svc, const rk_request *r) {
    int32_t v[8] = {(int32_t)r->opt.mode, (int32_t)rk_arena_kv(svc->arena)->dtype};
    if (r->opt.mode == RK_MODE_RAG) {
        v[2] = r->opt.chunk_cache;
        v[3] = (int32_t)r->opt.chunk_context;
        v[4] = (int32_t)r->opt.positions;
        v[5] = r->opt.repair_k;
        memcpy(&v[6], &r->opt.repair_ratio, sizeof(float));
        v[7] = r->opt.repair_query;
    }
    uint64_t ns = XXH3_64bits_withSeed(v, sizeof v, svc->prefix_ns);
    if (r->opt.salt.hi || r->opt.salt.lo) { /* a salted request's tree of its own */
        uint64_t salt[2] = {r->opt.salt.hi, r->opt.salt.lo};
        ns = XXH3_64bits_withSeed(salt, sizeof salt, ns);
    }
    return ns;
}

/* The radix key of the prompt's layout (room for the generated tokens
 * after it). */
static rk_status build_key(rk_service *svc, rk_request *r) {
    rk_req_state *s = r->state;
    if (rk_model_hparams(svc->model)->n_vocab > SEGMENT_MARK >> 6)
        return rk_errorf(RK_ERR_INTERNAL,
                         "pipeline: a vocabulary of %d tokens leaves no room "
                         "for segment marks in radix keys",
                         rk_model_hparams(svc->model)->n_vocab);
    /* The key follows the layout (a zero-copy table maps the same entries to
     * blocks through its runs). */
    int n_seq = s->q_index + s->n_qtok;
    s->key = malloc((size_t)(n_seq + r->opt.max_tokens + 1) * sizeof *s->key);
    if (!s->key) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    if (r->n_sys) memcpy(s->key, r->sys, (size_t)r->n_sys * sizeof *s->key);
    if (s->n_qtok) memcpy(s->key + s->q_index, s->qtok, (size_t)s->n_qtok * sizeof *s->key);
    if (r->opt.mode != RK_MODE_RAG) return RK_OK;
    for (int k = 0; k < r->n_chunks; k++) {
        memcpy(s->key + s->layout.index[k], r->chunks[k],
               (size_t)r->chunk_lens[k] * sizeof *s->key);
        s->key[s->layout.index[k]] |= SEGMENT_MARK;
    }
    for (int g = 0; g < s->layout.n_gaps; g++) { /* the texts between chunk groups */
        if (!r->gap_len[g]) continue;
        memcpy(s->key + s->layout.gap_index[g], r->gap[g], (size_t)r->gap_len[g] * sizeof *s->key);
        s->key[s->layout.gap_index[g]] |= SEGMENT_MARK;
    }
    /* Generated tokens resumed as prompt carry no mark, as when inserted. */
    if (s->n_qtok > s->n_gen) s->key[s->q_index] |= SEGMENT_MARK;
    return RK_OK;
}

/* How much of a matched prefix of n tokens a RAG request may take: never part
 * of a chunk (cut back to its start); with repair on, all chunks or none, so
 * the repair policy sees the chunks it would have seen (with the query
 * policy, all chunks only with the whole question after them). */
static int usable_prefix(const rk_request *r, int n) {
    const rk_req_state *s = r->state;
    if (r->opt.mode != RK_MODE_RAG) return n;
    for (int k = 0; k < r->n_chunks; k++)
        if (s->layout.index[k] < n && n < s->layout.index[k] + r->chunk_lens[k])
            n = s->layout.index[k];
    int repair = r->opt.repair_k > 0 || r->opt.repair_ratio > 0;
    if (repair && r->n_chunks && n < s->layout.question_index && n > s->layout.index[0])
        n = s->layout.index[0];
    /* The query policy's choice depends on the question: the whole of it too. */
    if (repair && r->opt.repair_query && r->n_chunks && n > s->layout.index[0] &&
        n < s->layout.question_index + r->n_question)
        n = s->layout.index[0];
    return n;
}

/* Table entries of the prompt: the layout's, or for a zero-copy table the
 * system prompt padded to a block and the question (the chunks are runs of
 * the chunk pool's blocks). */
static int prompt_table_entries(const rk_request *r, int bs) {
    const rk_req_state *s = r->state;
    if (!s->zc) return s->q_index + s->n_qtok;
    return (r->n_sys + bs - 1) / bs * bs + s->n_qtok;
}

/* Match the request's prompt key (all but its last token) in the radix tree,
 * share the whole pages of the usable prefix, take a reference on the page
 * that continues it for less than a page (its rows are copied before pass 1),
 * reserve blocks for the rest of the system (prefix pool for the pages that
 * will be inserted, the partial last one included, live pool after) and for
 * the chunks, question and generated tokens. The question tokens inside the
 * prefix are dropped from those to feed.
 *
 * A zero-copy request whose match reaches its question has every chunk in
 * the prefix: it takes the copy path, with nothing left to copy. Otherwise
 * it takes the system prompt alone from the match. */
static rk_status start_request(rk_service *svc, rk_request *r) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena);
    rk_status st;
    /* The key: the whole prompt, or the system prompt alone (whose last token
     * is left for its logits when nothing follows). */
    int whole_seq = r->opt.reuse_sequences;
    int n_key = whole_seq ? s->q_index + s->n_qtok : r->n_sys;
    int leave_one = whole_seq || s->n_qtok == 0;
    /* A prompt whose log-probabilities are asked is computed whole: a
     * prefix taken from the tree would leave its rows without logits. */
    int use_prefix = svc->prefix && r->opt.prefix_cache && n_key > 0 && !r->opt.prompt_logprobs;
    if (use_prefix) {
        if ((st = build_key(svc, r))) return st;
        s->ns = request_ns(svc, r);
        int32_t *pages = malloc((size_t)(n_key / bs + 1) * sizeof *pages);
        if (!pages) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
        rk_radix_result m;
        st = rk_radix_match(svc->prefix, s->ns, s->key, n_key,
                            RK_RADIX_PARTIAL | (leave_one ? RK_RADIX_LEAVE_ONE : 0), pages, &m);
        s->lock = m.node;
        int use = usable_prefix(r, m.n_matched + m.n_partial);
        if (s->zc && use >= s->q_index)
            s->zc = 0;
        else if (s->zc && use > r->n_sys)
            use = r->n_sys;
        int whole = use / bs;
        int32_t src = use < m.n_matched ? pages[whole] : m.partial_page;
        /* The partial page is not locked: reference it before anything can evict it. */
        if (!st && use % bs && !(st = rk_arena_ref(svc->arena, &src, 1))) {
            s->partial_src = src;
            s->n_partial = use % bs;
        }
        if (!st) st = rk_seq_share(&s->kv, svc->arena, pages, whole);
        free(pages);
        if (st) return st;
        s->reused = use;
        s->sys_first = use < r->n_sys ? use : r->n_sys;
        int n_new = r->n_sys - whole * bs;
        if (use < r->n_sys) {
            st = rk_seq_reserve(&s->kv, svc->arena, RK_POOL_PREFIX, n_new, NULL);
            if (st == RK_ERR_EXHAUSTED) {
                rk_radix_evict(svc->prefix, n_new, NULL);
                st = rk_seq_reserve(&s->kv, svc->arena, RK_POOL_PREFIX, n_new, NULL);
            }
            if (st == RK_OK) {
                s->kv.n_tokens += n_new;
                s->n_insert = r->n_sys;
            } else if (st != RK_ERR_EXHAUSTED) {
                return st;
            } /* else the prefix pool is all locked: compute in live blocks, cache nothing */
        }
    }
    r->sys_cached = s->sys_first;
    r->conv_cached = s->reused - s->sys_first;
    s->n_prompt = prompt_table_entries(r, bs);
    /* Blocks come as decoding needs them; the whole generation must fit
     * the live pool alone, or waiting never helps. */
    long life = (s->n_prompt + (long)r->opt.max_tokens - s->n_gen + bs - 1) / bs - s->kv.n_blocks;
    for (int k = 0; s->zc && k < r->n_chunks; k++)
        life += (rk_private_tokens(r, r->chunk_lens[k], bs) + bs - 1) / bs;
    if (life > rk_arena_pool_total(svc->arena, RK_POOL_LIVE))
        return rk_errorf(RK_ERR_CONTEXT,
                         "the request needs more KV memory than the server has: %ld live "
                         "blocks for its prompt and max_tokens, the live pool has %d",
                         life, rk_arena_pool_total(svc->arena, RK_POOL_LIVE));
    /* The prompt and the first token a decode step feeds. */
    int rest = s->n_prompt + (r->opt.max_tokens > 0) - s->kv.n_tokens;
    if ((st = rk_seq_reserve(&s->kv, svc->arena, RK_POOL_LIVE, rest, NULL))) return st;
    /* A zero-copy table's entries count in the layout's terms: the runs map
     * them to blocks. */
    s->kv.n_tokens = s->zc ? s->q_index + s->n_qtok : s->n_prompt;
    int skip = s->reused - s->q_index;
    if (skip > 0) { /* never all of them: the last prompt token is always computed */
        memmove(s->qtok, s->qtok + skip, (size_t)(s->n_qtok - skip) * sizeof *s->qtok);
        s->n_qtok -= skip;
        s->q_index += skip;
        s->q_pos += skip;
    }
    return RK_OK;
}

/* start_request for either reindex path. Zero-copy: the merged sequence's
 * own blocks are the system's (its partial last block a run of its own) and
 * the live ones for the question and generated tokens; the chunks' blocks are
 * the cache entries'. kv.n_tokens then counts table entries of the run table. */
rk_status rk_start_request(rk_service *svc, rk_request *r) {
    r->state->zc = rk_zero_copy_for(svc, r, 1);
    return start_request(svc, r);
}

/* Drop the reference on the partial page a match continued into. */
void rk_drop_partial(rk_service *svc, rk_req_state *s) {
    if (s->n_partial) rk_arena_release(svc->arena, &s->partial_src, 1);
    s->n_partial = 0;
    s->partial_src = -1;
}

/* After the radix-bound system pages are computed: insert them, the partial
 * last page as the tail it is (the request goes on writing its later rows,
 * which a match never copies). The tree takes a reference on the pages it
 * keeps; its locked path replaces ours. */
rk_status rk_insert_system(rk_service *svc, rk_request *r) {
    rk_req_state *s = r->state;
    int bs = rk_arena_block_size(svc->arena), present;
    rk_radix_node *node;
    /* The tree owns the partial page from the call on, even when it fails. */
    rk_status st =
        s->n_insert % bs ? rk_arena_ref(svc->arena, &s->kv.blocks[s->n_insert / bs], 1) : RK_OK;
    if (st) return st;
    st = rk_radix_insert_partial(svc->prefix, s->ns, s->key, s->n_insert, s->kv.blocks, 0, &present,
                                 &node);
    if (st) return st;
    st = rk_arena_ref(svc->arena, s->kv.blocks + present / bs,
                      (s->n_insert / bs * bs - present) / bs);
    if (st) return st;
    if (s->lock) rk_radix_unlock(svc->prefix, s->lock);
    s->lock = node;
    s->n_insert = 0;
    return RK_OK;
}
