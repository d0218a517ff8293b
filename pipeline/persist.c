/* pipeline/persist.c — chunk KV between the arena and the persistent tiers:
 * the store (disk) and the shared Redis tier, whose values are byte for byte
 * disk payloads.
 *
 * A payload body holds, for each layer, the chunk's K rows then its V rows,
 * one row (n_kv_heads * head_dim values of the KV dtype) per token, in token
 * order: (n_layers, 2, n_tokens, n_kv_heads, head_dim). The layout record
 * says what it was computed for; a load checks it against the running model
 * and arena, and the token ids against the request's, before any byte is used. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline/persist.h"

static size_t row_bytes(const rk_kv_cache *kv) {
    return rk_dtype_row_bytes(kv->dtype, (size_t)kv->n_kv_heads * kv->head_dim);
}

/* Payload body size and layout record of an entry in the running arena. */
static size_t body_bytes(const rk_kv_cache *kv, const rk_chunk_entry *e) {
    return 2 * (size_t)e->n_tokens * row_bytes(kv) * (size_t)kv->n_layers;
}

static rk_store_layout entry_layout(const rk_kv_cache *kv, const rk_chunk_entry *e) {
    return (rk_store_layout){.n_layers = kv->n_layers,
                             .n_kv_heads = kv->n_kv_heads,
                             .head_dim = kv->head_dim,
                             .dtype = (int32_t)kv->dtype,
                             .block_size = kv->block_size,
                             .base_pos = e->base_pos};
}

/* Copy an entry's KV between its chunk-pool blocks and a payload body, in
 * the body order above: to_body downloads, else uploads. */
static rk_status copy_body(rk_service *svc, const rk_chunk_entry *e, char *body, int to_body) {
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    rk_backend *be = svc->be;
    size_t rb = row_bytes(kv), per_layer = 2 * (size_t)e->n_tokens * rb;
    int bs = kv->block_size;
    rk_status st = RK_OK;
    for (int l = 0; l < kv->n_layers && !st; l++)
        for (int kind = 0; kind < 2 && !st; kind++) {
            char *blocks = kind == 0 ? kv->k[l] : kv->v[l];
            char *part = body + (size_t)l * per_layer + (size_t)kind * e->n_tokens * rb;
            for (int t = 0; t < e->n_tokens && !st; t += bs) {
                int n = e->n_tokens - t < bs ? e->n_tokens - t : bs;
                size_t off = (size_t)e->blocks[t / bs] * bs * rb;
                st =
                    to_body
                        ? be->ops->download(be, part + (size_t)t * rb, blocks + off, (size_t)n * rb)
                        : be->ops->upload(be, blocks + off, part + (size_t)t * rb, (size_t)n * rb);
            }
        }
    return st;
}

int rk_persist_body_check(const rk_store_layout *layout, const void *body, size_t body_size,
                          char *why, size_t why_cap) {
    rk_dtype dt = (rk_dtype)layout->dtype;
    int known = layout->dtype >= 0 && layout->dtype < RK_DTYPE_COUNT &&
                (dt == RK_DTYPE_Q8_0 || rk_dtype_size(dt) > 0);
    /* Bytes of the smallest unit of values: one value, or one q8_0 block. */
    size_t unit = !known ? 0 : dt == RK_DTYPE_Q8_0 ? rk_dtype_row_bytes(dt, 32) : rk_dtype_size(dt);
    size_t per_unit = dt == RK_DTYPE_Q8_0 ? 32 : 1;
    if (!known || unit == 0 || body_size % unit) {
        snprintf(why, why_cap, "KV dtype %d does not fit a %zu-byte body", (int)layout->dtype,
                 body_size);
        return 1;
    }
    size_t n_values = body_size / unit * per_unit;
    int64_t at = rk_dtype_first_nonfinite(dt, body, n_values);
    if (at < 0) return 0;
    snprintf(why, why_cap, "KV value %lld of %zu is NaN or infinite", (long long)at, n_values);
    return 1;
}

/* Hand value (may be NULL) to the Redis tier, which writes it
 * asynchronously and then frees release (may be NULL); with no value the
 * lock is freed at once. A dropped write (queue full) is
 * counted by the tier and is no error. */
static rk_status hand_to_redis(rk_service *svc, rk_redis_value *value,
                               const rk_redis_lock *release) {
    if (value) {
        rk_status st = rk_redis_put_value(svc->redis, value, release);
        return st == RK_ERR_LIMIT ? RK_OK : st;
    }
    if (release) (void)rk_redis_unlock(svc->redis, release);
    return RK_OK;
}

/* Free a write job and the copies it owned. */
static void free_write(rk_load *ld) {
    free(ld->write_tokens);
    free(ld->write_body);
    free(ld);
}

/* A write the writer finished, or one that never started (st: its status,
 * why: its message): the put ends (the row commits), and value goes on to
 * Redis. A failed disk write does not keep the chunk from the fleet. */
static rk_status end_write(rk_service *svc, rk_load *ld) {
    rk_status st = rk_store_put_end(svc->store, ld->write, ld->st);
    if (st)
        RK_LOG_WARN("chunk %s not persisted: %s", ld->key, ld->st ? ld->why : rk_error_message());
    rk_status rs = hand_to_redis(svc, ld->value, ld->has_release ? &ld->release : NULL);
    free_write(ld);
    return st ? st : rs;
}

/* End the writes the writer finished; returns how many. */
static int collect_writes(rk_service *svc) {
    int n = 0;
    for (rk_load *ld; svc->writer && (ld = rk_loader_take(svc->writer)); n++)
        (void)end_write(svc, ld);
    return n;
}

void rk_persist_drain_writes(rk_service *svc) {
    while (svc->writer && rk_loader_pending(svc->writer)) {
        rk_loader_wait(svc->writer, 0.05);
        collect_writes(svc);
    }
}

/* Put the payload a describes into the disk tier and then hand value (may
 * be NULL) and release (may be NULL) to Redis; tokens and body (malloc'ed
 * or NULL: what a's point at when they are the caller's to give) are taken.
 * With the writer, the put begins here, its file is written on the writer
 * thread and it ends when the engine thread takes it back (collect_writes):
 * the engine thread never waits for the disk unless the bytes queued for it
 * pass load_mb, and then only until they fit. Without (or when the tokens
 * could not be copied), the put runs here. */
static rk_status write_disk(rk_service *svc, const rk_store_put_args *a, int32_t *tokens,
                            void *body, rk_redis_value *value, const rk_redis_lock *release) {
    rk_load *ld = calloc(1, sizeof *ld);
    if (!ld) {
        free(tokens);
        free(body);
        rk_redis_value_free(value);
        if (release) (void)rk_redis_unlock(svc->redis, release);
        return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    }
    ld->tier = RK_LOAD_WRITE;
    ld->bytes = a->body_size;
    ld->write_tokens = tokens;
    ld->write_body = body;
    ld->value = value;
    if (release) ld->release = *release, ld->has_release = 1;
    snprintf(ld->key, sizeof ld->key, "%s", a->key);
    ld->st = rk_store_put_begin(svc->store, a, &ld->write);
    if (ld->st) snprintf(ld->why, sizeof ld->why, "%s", rk_error_message());
    if (ld->st || !ld->write) return end_write(svc, ld);
    if (!svc->writer || a->tokens != tokens) {
        ld->st = rk_store_put_write(ld->write);
        if (ld->st) snprintf(ld->why, sizeof ld->why, "%s", rk_error_message());
        return end_write(svc, ld);
    }
    uint64_t max = (uint64_t)svc->cfg.load_mb << 20;
    for (rk_loader_stats ws;;) { /* room for it among the bytes queued to write */
        rk_loader_stats_get(svc->writer, &ws);
        uint64_t held = ws.bytes_in_flight + ws.bytes_queued;
        if (held == 0 || held + ld->bytes <= max) break;
        rk_loader_wait(svc->writer, 0.01);
        collect_writes(svc);
    }
    rk_loader_submit(svc->writer, ld);
    return RK_OK;
}

rk_status rk_persist_write(rk_service *svc, const rk_chunk_entry *e, const char *policy,
                           const char *doc_id) {
    return rk_persist_write_tiers(svc, e, policy, doc_id, 1, NULL);
}

rk_status rk_persist_write_tiers(rk_service *svc, const rk_chunk_entry *e, const char *policy,
                                 const char *doc_id, int to_disk, const rk_redis_lock *release) {
    int disk = to_disk && svc->store;
    /* Below min_tokens the tier neither fetches nor writes: no value to build. */
    int redis = svc->redis && e->n_tokens >= svc->cfg.redis_min_tokens;
    if (!disk && !redis) {
        if (release) (void)rk_redis_unlock(svc->redis, release);
        return RK_OK;
    }
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    size_t body_size = body_bytes(kv, e);
    rk_store_layout layout = entry_layout(kv, e);
    char key[33];
    rk_chunk_key_hex(e->key, key);
    /* One download feeds both tiers: the Redis value's body when there is
     * one (handed over without a copy), else a buffer of our own. */
    rk_redis_value *v = NULL;
    void *body = NULL;
    rk_status st;
    if (redis)
        st = rk_redis_value_new(key, policy, doc_id, &layout, e->tokens, e->n_tokens, body_size, &v,
                                &body);
    else
        st =
            (body = malloc(body_size ? body_size : 1))
                ? RK_OK
                : rk_errorf(RK_ERR_NOMEM, "store: out of memory for a %zu-byte payload", body_size);
    if (!st) st = copy_body(svc, e, body, 1);
    if (st) {
        if (redis)
            rk_redis_value_free(v);
        else
            free(body);
        if (release) (void)rk_redis_unlock(svc->redis, release);
        return st;
    }
    if (!disk) return hand_to_redis(svc, v, release);
    rk_store_put_args a = {.key = key,
                           .policy = policy,
                           .doc_id = doc_id,
                           .layout = layout,
                           .tokens = e->tokens,
                           .n_tokens = e->n_tokens,
                           .body = body,
                           .body_size = body_size};
    /* The write outlives the entry (an eviction may free it): its tokens go
     * with it. */
    int32_t *tokens = svc->writer ? malloc((size_t)e->n_tokens * sizeof *tokens) : NULL;
    if (tokens) a.tokens = memcpy(tokens, e->tokens, (size_t)e->n_tokens * sizeof *tokens);
    return write_disk(svc, &a, tokens, redis ? NULL : body, v, release);
}

/* Put a verified store payload into reserved entry e when it was computed
 * from the same tokens in the same layout; *out_loaded says it was. */
static rk_status take_store_payload(rk_service *svc, rk_chunk_entry *e, const rk_store_payload *p,
                                    int *out_loaded) {
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    int ok = p->meta.n_tokens == e->n_tokens &&
             memcmp(p->tokens, e->tokens, (size_t)e->n_tokens * sizeof *e->tokens) == 0 &&
             p->layout.n_layers == kv->n_layers && p->layout.n_kv_heads == kv->n_kv_heads &&
             p->layout.head_dim == kv->head_dim && p->layout.dtype == (int32_t)kv->dtype &&
             p->layout.base_pos == e->base_pos && p->body_size == body_bytes(kv, e);
    if (!ok) {
        RK_LOG_WARN(
            "chunk %s: the stored payload does not match this model or request; computing it",
            p->meta.key);
        return RK_OK;
    }
    rk_status st = copy_body(svc, e, p->body, 0);
    if (!st) *out_loaded = 1;
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
    st = take_store_payload(svc, e, &p, out_loaded);
    rk_store_payload_free(&p);
    return st;
}

/* Upload a verified Redis payload into the entry and copy it to the disk
 * tier, whose payload files hold the same bytes. Verified: the tier returns
 * only values that passed its tag (with a secret), checksums and
 * rk_persist_body_check, so nothing unchecked reaches the disk. */
static rk_status take_redis_payload(rk_service *svc, rk_chunk_entry *e, rk_store_payload *p,
                                    int *out_loaded) {
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    if (p->body_size != body_bytes(kv, e)) return RK_OK; /* another layout: compute */
    rk_status st = copy_body(svc, e, p->body, 0);
    if (st) return st;
    *out_loaded = 1;
    if (svc->store) {
        char key[33];
        rk_chunk_key_hex(e->key, key);
        rk_store_put_args a = {.key = key,
                               .policy = p->meta.policy,
                               .doc_id = p->meta.doc_id[0] ? p->meta.doc_id : NULL,
                               .layout = p->layout,
                               .tokens = p->tokens,
                               .n_tokens = p->meta.n_tokens,
                               .body = p->body,
                               .body_size = p->body_size};
        (void)write_disk(svc, &a, p->tokens, p->body, NULL, NULL); /* logged there */
        p->tokens = NULL;
        p->body = NULL;
    }
    return RK_OK;
}

/* Whether a Redis lookup of e is worth it: Redis configured, and the cost
 * gate says a fetch beats computing (not when Redis is down or the chunk
 * short: the computed chunk is still offered to the tier). */
static int redis_worth_it(rk_service *svc, const rk_chunk_entry *e) {
    if (!svc->redis) return 0;
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    uint64_t n_bytes = rk_redis_value_bytes(e->n_tokens, body_bytes(kv, e));
    return rk_redis_worth_fetching(svc->redis, e->n_tokens, n_bytes, svc->prefill_tps);
}

rk_status rk_persist_load_start(rk_service *svc, rk_chunk_entry *e, int *out_queued) {
    *out_queued = 0;
    if (!svc->loader) return RK_OK;
    rk_load *ld = calloc(1, sizeof *ld);
    if (!ld) return rk_errorf(RK_ERR_NOMEM, "pipeline: out of memory");
    rk_chunk_key_hex(e->key, ld->key);
    int found = 0;
    rk_status st = svc->store ? rk_store_locate(svc->store, ld->key, &ld->loc, &found) : RK_OK;
    if (st) {
        free(ld);
        return st;
    }
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    if (found) {
        ld->tier = RK_LOAD_DISK;
        ld->bytes = ld->loc.row.n_bytes;
    } else if (redis_worth_it(svc, e)) {
        ld->tier = RK_LOAD_REDIS;
        ld->redis = svc->redis;
        ld->tokens = e->tokens;
        ld->n_tokens = e->n_tokens;
        ld->layout = entry_layout(kv, e);
        ld->body_size = body_bytes(kv, e);
        ld->bytes = rk_redis_value_bytes(e->n_tokens, ld->body_size);
        ld->wait_ms = svc->cfg.redis_wait_ms;
    } else {
        free(ld);
        return RK_OK;
    }
    ld->entry = e;
    rk_chunk_index_hold(e);
    e->loading = 1;
    rk_loader_submit(svc->loader, ld);
    *out_queued = 1;
    return RK_OK;
}

void rk_persist_drop_load(void *ctx, rk_load *ld) {
    rk_service *svc = ctx;
    if (ld->tier == RK_LOAD_WRITE) { /* not written: the chunk is computed again when asked */
        rk_store_put_abandon(svc->store, ld->write);
        rk_redis_value_free(ld->value);
        if (ld->has_release) (void)rk_redis_unlock(svc->redis, &ld->release);
        free_write(ld);
        return;
    }
    if (ld->tier == RK_LOAD_REDIS && !ld->st && ld->found == RK_REDIS_FOUND_LOCK)
        (void)rk_redis_unlock(svc->redis, &ld->lock);
    ld->entry->loading = 0;
    rk_chunk_index_release(svc->chunks, ld->entry, 1);
    rk_store_payload_free(&ld->payload);
    free(ld);
}

/* A queued load nobody waits for: its reference is the entry's last. */
static int unwanted(const rk_load *ld) { return ld->entry->refs <= 1; }

/* A finished load into its entry: *out_loaded when the entry is READY now. */
static void place_load(rk_service *svc, rk_load *ld, rk_persist_lock_fn hand_lock, void *ctx,
                       int *out_loaded) {
    rk_chunk_entry *e = ld->entry;
    rk_status st = ld->st;
    char why[320];
    snprintf(why, sizeof why, "%s", ld->why);
    if (ld->tier == RK_LOAD_DISK) {
        rk_store_load_done(svc->store, &ld->loc, ld->st, ld->why);
        if (!st && (st = take_store_payload(svc, e, &ld->payload, out_loaded)))
            snprintf(why, sizeof why, "%s", rk_error_message());
    } else if (!st && ld->found == RK_REDIS_FOUND_VALUE) {
        if ((st = take_redis_payload(svc, e, &ld->payload, out_loaded)))
            snprintf(why, sizeof why, "%s", rk_error_message());
    } else if (!st && ld->found == RK_REDIS_FOUND_LOCK && !hand_lock(ctx, e, &ld->lock)) {
        (void)rk_redis_unlock(svc->redis, &ld->lock); /* nobody left to compute it */
    }
    if (st) RK_LOG_WARN("chunk %s: %s; computing it", ld->key, why);
    if (*out_loaded) {
        rk_chunk_index_loaded(svc->chunks, e);
        if (ld->tier == RK_LOAD_REDIS) snprintf(e->source, sizeof e->source, "redis");
    }
}

int rk_persist_collect_loads(rk_service *svc, rk_persist_lock_fn hand_lock, void *ctx) {
    collect_writes(svc);
    if (!svc->loader) return 0;
    for (rk_load *ld = rk_loader_cancel(svc->loader, unwanted), *next; ld; ld = next) {
        next = ld->next;
        rk_persist_drop_load(svc, ld);
    }
    int n = 0;
    for (rk_load *ld; (ld = rk_loader_take(svc->loader));) {
        rk_chunk_entry *e = ld->entry;
        int loaded = 0;
        place_load(svc, ld, hand_lock, ctx, &loaded);
        e->loading = 0;
        n += loaded;
        rk_chunk_index_release(svc->chunks, e, !loaded);
        rk_store_payload_free(&ld->payload);
        free(ld);
    }
    return n;
}

rk_status rk_persist_load_redis(rk_service *svc, rk_chunk_entry *e, int *out_loaded,
                                rk_redis_lock *out_lock, int *out_locked) {
    *out_loaded = *out_locked = 0;
    if (!redis_worth_it(svc, e)) return RK_OK;
    const rk_kv_cache *kv = rk_arena_kv(svc->arena);
    rk_store_layout layout = entry_layout(kv, e);
    char key[33];
    rk_chunk_key_hex(e->key, key);
    /* All of an admission's waits for other replicas share redis_wait_ms. */
    double left_ms = (svc->redis_wait_until - rk_time_now()) * 1e3;
    rk_store_payload p;
    rk_redis_found found;
    rk_status st =
        rk_redis_lookup(svc->redis, RK_REDIS_CONN_ENGINE, key, e->tokens, e->n_tokens, &layout,
                        body_bytes(kv, e), left_ms > 0 ? (int)left_ms : 0, &p, out_lock, &found);
    if (st) return st;
    *out_locked = found == RK_REDIS_FOUND_LOCK;
    if (found != RK_REDIS_FOUND_VALUE) return RK_OK;
    st = take_redis_payload(svc, e, &p, out_loaded);
    rk_store_payload_free(&p);
    return st;
}

void rk_persist_begin_lookups(rk_service *svc) {
    svc->redis_wait_until = rk_time_now() + svc->cfg.redis_wait_ms / 1e3;
}

void rk_persist_note_prefill(rk_service *svc, int n_tokens, double seconds) {
    if (n_tokens <= 0 || !(seconds > 0)) return;
    double tps = n_tokens / seconds;
    /* A moving average: one pass of odd size moves the estimate a quarter. */
    svc->prefill_tps = svc->prefill_tps > 0 ? 0.75 * svc->prefill_tps + 0.25 * tps : tps;
}
