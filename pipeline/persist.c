/* pipeline/persist.c — chunk KV between the arena and the store (the disk tier).
 *
 * A payload body holds, for each layer, the chunk's K rows then its V rows,
 * one row (n_kv_heads * head_dim values of the KV dtype) per token, in token
 * order: (n_layers, 2, n_tokens, n_kv_heads, head_dim). The layout record
 * says what it was computed for; a load checks it against the running model
 * and arena, and the token ids against the request's, before any byte is used. */
#include <stdlib.h>
#include <string.h>

#include "pipeline/persist.h"

static size_t row_bytes(const rk_kv_cache *kv) {
    return (size_t)kv->n_kv_heads * kv->head_dim * rk_dtype_size(kv->dtype);
}

rk_status rk_persist_write(rk_service *svc, const rk_chunk_entry *e, const char *policy,
                           const char *doc_id) {
    if (!svc->store) return RK_OK;
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    rk_backend *be = svc->be;
    size_t rb = row_bytes(kv), per_layer = 2 * (size_t)e->n_tokens * rb;
    size_t body_size = per_layer * (size_t)kv->n_layers;
    char *body = malloc(body_size ? body_size : 1);
    if (!body)
        return rk_errorf(RK_ERR_NOMEM, "store: out of memory for a %zu-byte payload", body_size);
    rk_status st = RK_OK;
    int bs = kv->block_size;
    for (int l = 0; l < kv->n_layers && !st; l++)
        for (int kind = 0; kind < 2 && !st; kind++) {
            const char *src = kind == 0 ? kv->k[l] : kv->v[l];
            char *dst = body + (size_t)l * per_layer + (size_t)kind * e->n_tokens * rb;
            for (int t = 0; t < e->n_tokens && !st; t += bs) {
                int n = e->n_tokens - t < bs ? e->n_tokens - t : bs;
                size_t off = (size_t)e->blocks[t / bs] * bs * rb;
                st = be->ops->download(be, dst + (size_t)t * rb, src + off, (size_t)n * rb);
            }
        }
    if (!st) {
        char key[33];
        rk_chunk_key_hex(e->key, key);
        rk_store_put_args a = {.key = key,
                               .policy = policy,
                               .doc_id = doc_id,
                               .layout = {.n_layers = kv->n_layers,
                                          .n_kv_heads = kv->n_kv_heads,
                                          .head_dim = kv->head_dim,
                                          .dtype = (int32_t)kv->dtype,
                                          .block_size = kv->block_size,
                                          .base_pos = e->base_pos},
                               .tokens = e->tokens,
                               .n_tokens = e->n_tokens,
                               .body = body,
                               .body_size = body_size};
        st = rk_store_put(svc->store, &a);
    }
    free(body);
    return st;
}

rk_status rk_persist_load(rk_service *svc, rk_chunk_entry *e, int *out_loaded) {
    *out_loaded = 0;
    if (!svc->store) return RK_OK;
    char key[33];
    rk_chunk_key_hex(e->key, key);
    int present = 0;
    rk_status st = rk_store_contains(svc->store, key, &present);
    if (st || !present) return st;
    rk_store_payload p;
    if ((st = rk_store_get(svc->store, key, &p))) {
        /* A bad payload was dropped by the store: compute instead. */
        RK_LOG_WARN("chunk %s: %s; computing it", key, rk_error_message());
        return RK_OK;
    }
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    size_t rb = row_bytes(kv), per_layer = 2 * (size_t)e->n_tokens * rb;
    int ok = p.meta.n_tokens == e->n_tokens &&
             memcmp(p.tokens, e->tokens, (size_t)e->n_tokens * sizeof *e->tokens) == 0 &&
             p.layout.n_layers == kv->n_layers && p.layout.n_kv_heads == kv->n_kv_heads &&
             p.layout.head_dim == kv->head_dim && p.layout.dtype == (int32_t)kv->dtype &&
             p.layout.base_pos == e->base_pos && p.body_size == per_layer * (size_t)kv->n_layers;
    if (!ok) {
        RK_LOG_WARN(
            "chunk %s: the stored payload does not match this model or request; computing it", key);
        rk_store_payload_free(&p);
        return RK_OK;
    }
    rk_backend *be = svc->be;
    int bs = kv->block_size;
    for (int l = 0; l < kv->n_layers && !st; l++)
        for (int kind = 0; kind < 2 && !st; kind++) {
            char *dst = kind == 0 ? kv->k[l] : kv->v[l];
            const char *src =
                (const char *)p.body + (size_t)l * per_layer + (size_t)kind * e->n_tokens * rb;
            for (int t = 0; t < e->n_tokens && !st; t += bs) {
                int n = e->n_tokens - t < bs ? e->n_tokens - t : bs;
                size_t off = (size_t)e->blocks[t / bs] * bs * rb;
                st = be->ops->upload(be, dst + off, src + (size_t)t * rb, (size_t)n * rb);
            }
        }
    rk_store_payload_free(&p);
    if (!st) *out_loaded = 1;
    return st;
}
