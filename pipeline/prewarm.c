/* pipeline/prewarm.c — rk_pipeline_prewarm (see pipeline.h): chunks computed
 * into the chunk cache ahead of the requests that will use them, and written
 * through to the disk and Redis tiers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/internal.h"
#include "pipeline/persist.h"

/* ---------------------------------------------------------------- pre-warming */

/* Tokens per forward pass while pre-warming: bounds activation memory. */
#define PREWARM_PASS_TOKENS 8192

static void item_fail(rk_prewarm_item *it, const char *why) {
    it->status = "failed";
    snprintf(it->error, sizeof it->error, "%s", why);
}

/* Persist an arena entry unless the store has it already. */
static void persist_if_missing(rk_service *svc, const rk_chunk_entry *e, const char *doc_id) {
    int present = 0;
    char key[33];
    rk_chunk_key_hex(e->key, key);
    if (rk_store_contains(svc->store, key, &present) == RK_OK && !present &&
        rk_persist_write(svc, e, "isolated", doc_id))
        RK_LOG_WARN("chunk %s not persisted: %s", key, rk_error_message());
}

/* A chunk pre-warming computed: to the disk tier with persist (one KV
 * download for both tiers) and to the Redis tier when there is one. */
static void prewarm_write(rk_service *svc, const rk_chunk_entry *e, const char *doc_id,
                          int persist) {
    if (persist && svc->store) {
        persist_if_missing(svc, e, doc_id); /* writes the Redis tier too */
    } else if (svc->redis && rk_persist_write_tiers(svc, e, "isolated", doc_id, 0, NULL)) {
        char key[33];
        rk_chunk_key_hex(e->key, key);
        RK_LOG_WARN("chunk %s not shared: %s", key, rk_error_message());
    }
}

rk_status rk_pipeline_prewarm(rk_service *svc, rk_prewarm_item *items, int n_items, int persist) {
    const rk_tokenizer *tok = rk_model_tokenizer(svc->model);
    int bs = rk_arena_block_size(svc->arena);
    rk_request policy_req = {.opt = {.chunk_context = RK_CONTEXT_ISOLATED}};
    rk_chunk_policy policy;
    rk_request_chunk_policy(svc, &policy_req, &policy);
    rk_chunk_entry **held = calloc((size_t)(n_items ? n_items : 1), sizeof *held);
    rk_seq *views = calloc((size_t)(n_items ? n_items : 1), sizeof *views);
    int *computing = calloc((size_t)(n_items ? n_items : 1), sizeof *computing);
    if (!held || !views || !computing) {
        free(held);
        free(views);
        free(computing);
        return rk_errorf(RK_ERR_NOMEM, "prewarm: out of memory");
    }
    batch b = {0};
    rk_status st = RK_OK;
    int first = 0; /* first item of the current pass */
    for (int i = 0; i <= n_items && !st; i++) {
        /* Run the pass when it is full or at the end. */
        if (i == n_items || b.n_tok >= PREWARM_PASS_TOKENS) {
            if ((st = rk_batch_run(svc, &b))) break;
            for (int j = first; j < i; j++) {
                if (!computing[j]) continue;
                rk_chunk_index_ready(svc->chunks, held[j]);
                items[j].status = "computed";
                prewarm_write(svc, held[j], items[j].doc_id, persist);
            }
            rk_batch_reset(&b);
            first = i;
            if (i == n_items) break;
        }
        rk_prewarm_item *it = &items[i];
        it->status = "failed";
        it->tier = "arena";
        it->key[0] = it->error[0] = '\0';
        rk_text text = {(char *)it->text, it->len};
        int32_t *ids = NULL;
        if (rk_request_encode(tok, &text, 0, &ids, &it->tokens)) {
            item_fail(it, rk_error_message());
            continue;
        }
        if (it->tokens == 0 || it->tokens > svc->cfg.max_chunk_tokens) {
            char why[160];
            snprintf(why, sizeof why, "the chunk has %d tokens; 1 to %d are allowed", it->tokens,
                     svc->cfg.max_chunk_tokens);
            item_fail(it, why);
            free(ids);
            continue;
        }
        policy.salt = it->salt;
        rk_chunk_key key = rk_chunk_key_compute(&policy, ids, it->tokens);
        rk_chunk_key_hex(key, it->key);
        rk_chunk_entry *e = rk_chunk_index_find(svc->chunks, key);
        int on_disk = 0;
        if (e) {
            it->status = "cached";
            if (persist) prewarm_write(svc, e, it->doc_id, persist);
        } else if (svc->store && rk_store_contains(svc->store, it->key, &on_disk) == RK_OK &&
                   on_disk) {
            it->status = "cached";
            it->tier = "disk";
        } else {
            rk_chunk_lookup kind;
            if (rk_chunk_index_acquire(svc->chunks, key, ids, it->tokens, 0, &e, &kind)) {
                item_fail(it, rk_error_message());
            } else if (kind != RK_CHUNK_MISS) {
                held[i] = e; /* a duplicate within this call: computed once */
                it->status = "cached";
            } else {
                held[i] = e;
                e->owner = it->owner;
                computing[i] = 1;
                views[i] =
                    (rk_seq){.blocks = e->blocks, .n_blocks = e->n_blocks, .n_tokens = e->n_tokens};
                st = rk_batch_add(&b, bs, &views[i], e->tokens, e->n_tokens, 0, 0, 0);
            }
        }
        free(ids);
    }
    for (int i = 0; i < n_items; i++)
        if (held[i]) rk_chunk_index_release(svc->chunks, held[i], st != RK_OK);
    if (st)
        for (int i = 0; i < n_items; i++)
            if (computing[i] && strcmp(items[i].status, "computed") != 0)
                item_fail(&items[i], "the engine failed while computing it");
    rk_persist_drain_writes(svc); /* what it reports persisted is on disk */
    rk_batch_free(&b);
    free(held);
    free(views);
    free(computing);
    return st;
}
