/* gateway/stats.c — see stats.h. Hit-rate windows come from per-minute
 * buckets: the window of the last N minutes sums the current (partial) minute
 * and the N - 1 minutes before it.
 *
 * Chunk hits and misses are counted from the finished requests' chunk
 * reports, one per chunk occurrence: a hit by its source (arena, disk, redis,
 * or prefix: inside a sequence the radix cache reused, never looked up) or a
 * miss (computed). So the totals agree with what the responses report, and
 * the hit rate is the share of chunks not computed. Chunks of a request with
 * the chunk cache off are not counted. */
#include "gateway/stats.h"

#include "gateway/report.h"

#include <pthread.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define N_MINUTES 60

/* One tenant's counters. */
typedef struct tenant_counts {
    uint64_t requests, prompt_tokens, cached_tokens, chunk_hits, chunk_misses;
} tenant_counts;

#define SLOT_OTHER (RK_STATS_TENANTS + 1) /* slot 0: default; 1..64: named */

typedef struct minute_bucket {
    int64_t minute; /* minutes since the epoch; -1 = unused */
    uint64_t lookups, hits, misses;
} minute_bucket;

struct rk_stats {
    pthread_mutex_t mu;
    double started; /* rk_time_now() at creation */
    rk_cache_snapshot snap;
    int have_snap;
    minute_bucket minutes[N_MINUTES];
    uint64_t chunk_hits[RK_CHUNK_SOURCE_PREFIX + 1]; /* per rk_chunk_source (COMPUTED unused) */
    uint64_t chunk_misses;
    uint64_t chunk_hit_tokens, chunk_computed_tokens; /* the tokens of those chunks */
    uint64_t status_counts[600];                      /* per HTTP status */
    uint64_t requests_done;                           /* finished generations */
    uint64_t prompt_tokens, cached_tokens, completion_tokens;
    int in_flight;
    rk_hist lookup, reindex, ttft, queue, total;
    rk_hist tpot; /* decode time per output token after the first */
    /* The shared Redis tier, read live from its counters (thread-safe) when
     * stats are served. Get round trips: the tier keeps a count and a total
     * time, so each read adds its new round trips at their mean latency. */
    int have_redis;
    rk_redis_counters redis;
    rk_hist redis_latency;
    rk_hist tier_load; /* disk tier reads, each at the mean of those published together */
    char tenant_names[RK_STATS_TENANTS + 2][64]; /* by slot */
    int n_tenants;
    tenant_counts tenants[RK_STATS_TENANTS + 2];
};

static int tenant_slot(const rk_stats *s, int owner) {
    return owner <= 0 ? 0 : owner <= s->n_tenants ? owner : SLOT_OTHER;
}

void rk_stats_set_tenants(rk_stats *s, const char *const *names, int n) {
    pthread_mutex_lock(&s->mu);
    if (n > RK_STATS_TENANTS) n = RK_STATS_TENANTS;
    for (int i = 0; i < n; i++)
        snprintf(s->tenant_names[i + 1], sizeof s->tenant_names[0], "%s", names[i]);
    s->n_tenants = n;
    pthread_mutex_unlock(&s->mu);
}

/* ---------------------------------------------------------------- histograms */

static const double k_bounds[RK_HIST_BUCKETS] = {
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1,     0.25,   0.5,     1.0,    2.5,   5.0,    10.0,  20.0, 30.0,  60.0};

const double *rk_hist_bounds(void) { return k_bounds; }

void rk_hist_add(rk_hist *h, double seconds) {
    if (!(seconds >= 0)) seconds = 0; /* NaN or negative: count as zero */
    int b = 0;
    while (b < RK_HIST_BUCKETS && seconds > k_bounds[b]) b++;
    h->counts[b]++;
    h->n++;
    h->sum += seconds;
    if (seconds > h->max) h->max = seconds;
}

double rk_hist_quantile(const rk_hist *h, double q) {
    if (h->n == 0) return 0;
    double rank = q * (double)h->n;
    uint64_t cum = 0;
    for (int b = 0; b <= RK_HIST_BUCKETS; b++) {
        if (h->counts[b] == 0) continue;
        if ((double)(cum + h->counts[b]) >= rank) {
            double lo = b == 0 ? 0 : k_bounds[b - 1];
            double hi = b < RK_HIST_BUCKETS ? k_bounds[b] : h->max;
            if (hi > h->max) hi = h->max; /* never report beyond what was seen */
            if (lo > hi) lo = hi;
            double frac = (rank - (double)cum) / (double)h->counts[b];
            if (frac < 0) frac = 0;
            return lo + (hi - lo) * frac;
        }
        cum += h->counts[b];
    }
    return h->max;
}

/* ---------------------------------------------------------------- life */

rk_status rk_stats_create(rk_stats **out) {
    rk_stats *s = calloc(1, sizeof *s);
    if (!s) return rk_errorf(RK_ERR_NOMEM, "stats: out of memory");
    if (pthread_mutex_init(&s->mu, NULL)) {
        free(s);
        return rk_errorf(RK_ERR_INTERNAL, "stats: cannot create a mutex");
    }
    s->started = rk_time_now();
    for (int i = 0; i < N_MINUTES; i++) s->minutes[i].minute = -1;
    snprintf(s->tenant_names[0], sizeof s->tenant_names[0], "default");
    snprintf(s->tenant_names[SLOT_OTHER], sizeof s->tenant_names[0], "other");
    *out = s;
    return RK_OK;
}

void rk_stats_free(rk_stats *s) {
    if (!s) return;
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static int64_t now_minute(void) { return (int64_t)time(NULL) / 60; }

static minute_bucket *bucket_now(rk_stats *s) {
    int64_t m = now_minute();
    minute_bucket *b = &s->minutes[m % N_MINUTES];
    if (b->minute != m) *b = (minute_bucket){.minute = m};
    return b;
}

void rk_stats_publish(rk_stats *s, const rk_cache_snapshot *snap) {
    pthread_mutex_lock(&s->mu);
    const rk_loader_stats *old = &s->snap.loads, *now = &snap->loads;
    if (now->loads > old->loads) {
        uint64_t n = now->loads - old->loads;
        double mean = (now->seconds - old->seconds) / (double)n;
        for (uint64_t i = 0; i < n; i++) rk_hist_add(&s->tier_load, mean);
    }
    s->snap = *snap;
    s->have_snap = 1;
    pthread_mutex_unlock(&s->mu);
}

void rk_stats_publish_redis(rk_stats *s, const rk_redis_counters *c) {
    pthread_mutex_lock(&s->mu);
    const rk_redis_counters *old = &s->redis;
    if (c->get_count > old->get_count) {
        uint64_t n = c->get_count - old->get_count;
        double mean = (c->get_seconds - old->get_seconds) / (double)n;
        for (uint64_t i = 0; i < n; i++) rk_hist_add(&s->redis_latency, mean);
    }
    s->redis = *c;
    s->have_redis = 1;
    pthread_mutex_unlock(&s->mu);
}

void rk_stats_record_request(rk_stats *s, const rk_request *r) {
    pthread_mutex_lock(&s->mu);
    s->requests_done++;
    s->prompt_tokens += (uint64_t)r->prompt_tokens;
    s->cached_tokens += (uint64_t)r->cached_tokens;
    s->completion_tokens += (uint64_t)r->n_out;
    tenant_counts *tc = &s->tenants[tenant_slot(s, r->opt.owner)];
    tc->requests++;
    tc->prompt_tokens += (uint64_t)r->prompt_tokens;
    tc->cached_tokens += (uint64_t)r->cached_tokens;
    rk_hist_add(&s->lookup, r->t.lookup_ms / 1e3);
    rk_hist_add(&s->reindex, r->t.reindex_ms / 1e3);
    if (r->n_out > 0) rk_hist_add(&s->ttft, (r->t.queue_ms + r->t.ttft_ms) / 1e3);
    rk_hist_add(&s->queue, r->t.queue_ms / 1e3);
    rk_hist_add(&s->total, r->t.total_ms / 1e3);
    if (r->n_out > 1) rk_hist_add(&s->tpot, r->t.decode_ms / 1e3 / (r->n_out - 1));
    minute_bucket *b = bucket_now(s);
    for (int k = 0; k < r->n_chunks; k++) {
        const rk_chunk_report *c = &r->chunk_reports[k];
        if (c->status == RK_CHUNK_STATUS_HIT && c->source > RK_CHUNK_SOURCE_COMPUTED &&
            c->source <= RK_CHUNK_SOURCE_PREFIX) {
            s->chunk_hits[c->source]++;
            tc->chunk_hits++;
            s->chunk_hit_tokens += (uint64_t)c->tokens;
            b->hits++;
        } else if (c->status == RK_CHUNK_STATUS_MISS ||
                   (c->status == RK_CHUNK_STATUS_HIT && c->source == RK_CHUNK_SOURCE_COMPUTED)) {
            s->chunk_misses++;
            tc->chunk_misses++;
            s->chunk_computed_tokens += (uint64_t)c->tokens;
            b->misses++;
        } else {
            continue; /* the chunk cache was off */
        }
        b->lookups++;
    }
    pthread_mutex_unlock(&s->mu);
}

void rk_stats_record_status(rk_stats *s, int http_status) {
    if (http_status < 100 || http_status >= 600) return;
    pthread_mutex_lock(&s->mu);
    s->status_counts[http_status]++;
    pthread_mutex_unlock(&s->mu);
}

void rk_stats_in_flight(rk_stats *s, int delta) {
    pthread_mutex_lock(&s->mu);
    s->in_flight += delta;
    pthread_mutex_unlock(&s->mu);
}

void rk_stats_snapshot(rk_stats *s, rk_cache_snapshot *out) {
    pthread_mutex_lock(&s->mu);
    *out = s->snap;
    pthread_mutex_unlock(&s->mu);
}

/* ---------------------------------------------------------------- JSON */

static double ratio(uint64_t a, uint64_t b) { return b ? (double)a / (double)b : 0.0; }

static uint64_t chunk_hits_total(const rk_stats *s) {
    uint64_t h = 0;
    for (int i = RK_CHUNK_SOURCE_ARENA; i <= RK_CHUNK_SOURCE_PREFIX; i++) h += s->chunk_hits[i];
    return h;
}

/* {"arena": n, "disk": n, "redis": n, "prefix": n} */
static json_t *hits_by_source_json(const rk_stats *s) {
    json_t *o = json_object();
    for (int i = RK_CHUNK_SOURCE_ARENA; o && i <= RK_CHUNK_SOURCE_PREFIX; i++)
        json_object_set_new(o, rk_chunk_source_name((rk_chunk_source)i),
                            json_integer((json_int_t)s->chunk_hits[i]));
    return o;
}

/* The share of the live pool (the KV of requests in flight) in use: what
 * limits how many requests run at once. Cached chunks and prefixes have pools
 * of their own and are reported per pool. */
static double kv_usage(const rk_cache_snapshot *c) {
    int total = c->pool_total[RK_POOL_LIVE];
    return ratio((uint64_t)(total - c->pool_free[RK_POOL_LIVE]), (uint64_t)total);
}

static json_t *window_json(const rk_stats *s, int n_minutes) {
    int64_t now = now_minute();
    uint64_t l = 0, h = 0, m = 0;
    for (int i = 0; i < N_MINUTES; i++) {
        const minute_bucket *b = &s->minutes[i];
        if (b->minute < 0 || b->minute > now || b->minute <= now - n_minutes) continue;
        l += b->lookups;
        h += b->hits;
        m += b->misses;
    }
    return json_pack("{s:I, s:I, s:I, s:f}", "lookups", (json_int_t)l, "hits", (json_int_t)h,
                     "misses", (json_int_t)m, "hit_rate", ratio(h, l));
}

static json_t *latency_json(const rk_hist *h) {
    return json_pack("{s:I, s:f, s:f, s:f, s:f, s:f}", "count", (json_int_t)h->n, "p50_ms",
                     rk_hist_quantile(h, 0.5) * 1e3, "p90_ms", rk_hist_quantile(h, 0.9) * 1e3,
                     "p99_ms", rk_hist_quantile(h, 0.99) * 1e3, "mean_ms",
                     h->n ? h->sum / (double)h->n * 1e3 : 0.0, "max_ms", h->max * 1e3);
}

static json_t *pools_json(const rk_cache_snapshot *c) {
    json_t *o = json_object();
    for (int p = 0; p < RK_POOL_COUNT && o; p++)
        json_object_set_new(o, rk_pool_name((rk_pool_tag)p),
                            json_pack("{s:i, s:i, s:i, s:I}", "total", c->pool_total[p], "used",
                                      c->pool_total[p] - c->pool_free[p], "free", c->pool_free[p],
                                      "tokens", (json_int_t)c->pool_total[p] * c->kv.block_size));
    return o;
}

static json_t *requests_json(const rk_stats *s) {
    json_t *by = json_object();
    uint64_t total = 0;
    char code[8];
    for (int i = 100; i < 600 && by; i++) {
        if (!s->status_counts[i]) continue;
        snprintf(code, sizeof code, "%d", i);
        json_object_set_new(by, code, json_integer((json_int_t)s->status_counts[i]));
        total += s->status_counts[i];
    }
    return json_pack("{s:I, s:o, s:I, s:i, s:i, s:i, s:I, s:I}", "total", (json_int_t)total,
                     "by_status", by, "completed_generations", (json_int_t)s->requests_done,
                     "in_flight", s->in_flight, "queued", s->snap.queued, "running",
                     s->snap.running, "preemptions", (json_int_t)s->snap.preemptions,
                     "nonfinite_logits", (json_int_t)s->snap.nonfinite_logits);
}

static json_t *tenant_json(const tenant_counts *t) {
    return json_pack("{s:I, s:I, s:I, s:I, s:I}", "requests", (json_int_t)t->requests,
                     "prompt_tokens", (json_int_t)t->prompt_tokens, "cached_tokens",
                     (json_int_t)t->cached_tokens, "chunk_hits", (json_int_t)t->chunk_hits,
                     "chunk_misses", (json_int_t)t->chunk_misses);
}

/* The per-tenant counters a caller may read (under s->mu). */
static json_t *tenants_json(const rk_stats *s, int all, int owner) {
    json_t *o = json_object();
    for (int slot = 0; slot <= SLOT_OTHER && o; slot++) {
        int listed =
            slot == 0 || slot <= s->n_tenants || (slot == SLOT_OTHER && s->tenants[slot].requests);
        if (!listed || (!all && slot != tenant_slot(s, owner))) continue;
        json_object_set_new(o, s->tenant_names[slot], tenant_json(&s->tenants[slot]));
    }
    return o;
}

json_t *rk_stats_json(rk_stats *s) { return rk_stats_json_for(s, 1, 0); }

/* The most hit chunks a caller may see (under s->mu). */
static json_t *top_chunks_json(const rk_stats *s, int all, int owner) {
    const rk_cache_snapshot *c = &s->snap;
    json_t *top = json_array();
    for (int i = 0; i < c->n_top && top; i++)
        if (all || c->top[i].owner == owner)
            json_array_append_new(top, json_pack("{s:s, s:s?, s:I}", "key", c->top[i].key, "id",
                                                 c->top[i].id[0] ? c->top[i].id : NULL, "hits",
                                                 (json_int_t)c->top[i].hits));
    return top;
}

static json_t *chunks_json(const rk_stats *s) {
    const rk_cache_snapshot *c = &s->snap;
    const rk_chunk_stats *ch = &c->chunk;
    uint64_t hits = chunk_hits_total(s), lookups = hits + s->chunk_misses;
    return json_pack(
        "{s:I, s:I, s:o, s:I, s:f, s:{s:o, s:o, s:o}, s:I, s:I, s:f, s:{s:I, s:I}, s:I, s:I, "
        "s:I, s:I, s:I, s:I}",
        "lookups", (json_int_t)lookups, "hits", (json_int_t)hits, "hits_by_source",
        hits_by_source_json(s), "misses", (json_int_t)s->chunk_misses, "hit_rate",
        ratio(hits, lookups), "windows", "1m", window_json(s, 1), "5m", window_json(s, 5), "60m",
        window_json(s, 60), "hit_tokens", (json_int_t)s->chunk_hit_tokens, "computed_tokens",
        (json_int_t)s->chunk_computed_tokens, "token_hit_rate",
        ratio(s->chunk_hit_tokens, s->chunk_hit_tokens + s->chunk_computed_tokens), "evictions",
        "capacity", (json_int_t)ch->evictions, "manual", (json_int_t)c->chunk_removed,
        "evicted_tokens", (json_int_t)ch->evicted_tokens, "entries", (json_int_t)ch->entries,
        "tokens", (json_int_t)ch->tokens, "blocks", (json_int_t)ch->blocks, "bytes",
        (json_int_t)c->chunk_bytes, "referenced", (json_int_t)c->chunk_referenced);
}

static json_t *prefix_json(const rk_cache_snapshot *c) {
    const rk_radix_stats *px = &c->prefix;
    uint64_t px_manual = c->prefix_flushed <= px->evictions ? c->prefix_flushed : px->evictions;
    return c->have_prefix
               ? json_pack("{s:b, s:I, s:I, s:I, s:I, s:I, s:{s:I, s:I}, s:I, s:I, s:I, s:I}",
                           "enabled", 1, "queries", (json_int_t)px->queries, "hits",
                           (json_int_t)px->hits, "misses", (json_int_t)px->misses, "reused_tokens",
                           (json_int_t)px->tokens_reused, "computed_tokens",
                           (json_int_t)px->tokens_computed, "evictions", "capacity",
                           (json_int_t)(px->evictions - px_manual), "manual", (json_int_t)px_manual,
                           "evicted_tokens", (json_int_t)px->tokens_evicted, "nodes",
                           (json_int_t)px->nodes, "cached_tokens", (json_int_t)px->cached_tokens,
                           "locked_tokens", (json_int_t)px->protected_tokens)
               : json_pack("{s:b}", "enabled", 0);
}

static json_t *store_json(const rk_stats *s) {
    const rk_cache_snapshot *c = &s->snap;
    return c->have_store
               ? json_pack(
                     "{s:b, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:o, s:o}", "configured",
                     1, "rows", (json_int_t)c->store_rows, "bytes", (json_int_t)c->store_bytes,
                     "loads", (json_int_t)c->store_loads, "writes", (json_int_t)c->store_writes,
                     "dropped_at_recovery", (json_int_t)c->store_dropped_at_recovery,
                     "corrupt_after_open", (json_int_t)c->store_corrupt_after_open, "quarantined",
                     (json_int_t)c->store_quarantined, "rows_rebuilt",
                     (json_int_t)c->store_rows_rebuilt, "unreadable",
                     (json_int_t)c->store_unreadable, "reads",
                     json_pack("{s:I, s:I, s:I, s:I, s:i, s:o}", "completed",
                               (json_int_t)c->loads.loads, "failed", (json_int_t)c->loads.failed,
                               "cancelled", (json_int_t)c->loads.cancelled, "bytes_in_flight",
                               (json_int_t)c->loads.bytes_in_flight, "queued", c->loads.queued,
                               "latency", latency_json(&s->tier_load)),
                     "writes_pending",
                     json_pack("{s:I, s:I}", "bytes",
                               (json_int_t)(c->writes.bytes_in_flight + c->writes.bytes_queued),
                               "failed", (json_int_t)c->writes.failed))
               : json_pack("{s:b, s:n, s:n, s:i, s:i, s:i, s:i, s:i, s:i, s:i}", "configured", 0,
                           "rows", "bytes", "loads", 0, "writes", 0, "dropped_at_recovery", 0,
                           "corrupt_after_open", 0, "quarantined", 0, "rows_rebuilt", 0,
                           "unreadable", 0);
}

static json_t *tiers_json(const rk_stats *s) {
    const rk_cache_snapshot *c = &s->snap;
    const rk_redis_counters *rd = &s->redis;
    return json_pack(
        "{s:{s:I, s:I}, s:o?, s:o?}", "arena", "entries", (json_int_t)c->chunk.entries, "bytes",
        (json_int_t)c->chunk_bytes, "disk",
        c->have_store ? json_pack("{s:I, s:I}", "entries", (json_int_t)c->store_rows, "bytes",
                                  (json_int_t)c->store_bytes)
                      : NULL,
        "redis",
        s->have_redis ? json_pack("{s:I, s:I, s:I, s:I}", "loads", (json_int_t)rd->hits, "writes",
                                  (json_int_t)rd->writes, "bytes_in", (json_int_t)rd->bytes_in,
                                  "bytes_out", (json_int_t)rd->bytes_out)
                      : NULL);
}

static json_t *redis_json(const rk_stats *s) {
    const rk_redis_counters *rd = &s->redis;
    return s->have_redis
               ? json_pack(
                     "{s:b, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, "
                     "s:I, s:I, s:f, s:f, s:s, s:I, s:o}",
                     "configured", 1, "hits", (json_int_t)rd->hits, "misses",
                     (json_int_t)rd->misses, "errors", (json_int_t)rd->errors, "skipped",
                     (json_int_t)rd->skipped, "dropped_corrupt", (json_int_t)rd->dropped_corrupt,
                     "size_refused", (json_int_t)rd->size_refused, "auth_failures",
                     (json_int_t)rd->auth_failures, "layout_mismatch",
                     (json_int_t)rd->layout_mismatch, "writes", (json_int_t)rd->writes,
                     "write_drops", (json_int_t)rd->write_drops, "queued", (json_int_t)rd->queued,
                     "bytes_in", (json_int_t)rd->bytes_in, "bytes_out", (json_int_t)rd->bytes_out,
                     "locks_acquired", (json_int_t)rd->locks_acquired, "locks_busy",
                     (json_int_t)rd->locks_busy, "mean_get_s",
                     rd->get_count ? rd->get_seconds / (double)rd->get_count : 0.0,
                     "load_bytes_per_s", rd->load_bytes_per_s, "breaker",
                     rd->breaker == RK_REDIS_OPEN ? "open" : "closed", "breaker_opened",
                     (json_int_t)rd->breaker_opened, "latency", latency_json(&s->redis_latency))
               : json_pack("{s:b}", "configured", 0);
}

json_t *rk_stats_json_for(rk_stats *s, int all, int owner) {
    pthread_mutex_lock(&s->mu);
    const rk_cache_snapshot *c = &s->snap;
    json_t *top = top_chunks_json(s, all, owner), *chunks = chunks_json(s),
           *prefix = prefix_json(c), *store = store_json(s), *tiers = tiers_json(s),
           *redis = redis_json(s);
    json_t *tokens = json_pack("{s:I, s:I, s:I, s:I, s:f}", "prompt", (json_int_t)s->prompt_tokens,
                               "reused", (json_int_t)s->cached_tokens, "computed",
                               (json_int_t)(s->prompt_tokens - s->cached_tokens), "generated",
                               (json_int_t)s->completion_tokens, "reuse_rate",
                               ratio(s->cached_tokens, s->prompt_tokens));
    json_t *latency = json_pack(
        "{s:o, s:o, s:o, s:o, s:o, s:o}", "lookup", latency_json(&s->lookup), "reindex",
        latency_json(&s->reindex), "ttft", latency_json(&s->ttft), "queue", latency_json(&s->queue),
        "total", latency_json(&s->total), "time_per_output_token", latency_json(&s->tpot));
    json_t *root =
        json_pack("{s:f, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:f, s:o, s:o, s:o, s:o}", "uptime_s",
                  rk_time_now() - s->started, "requests", requests_json(s), "tokens", tokens,
                  "chunks", chunks, "prefix", prefix, "tiers", tiers, "pools", pools_json(c), "kv",
                  rk_kv_plan_json(&c->kv), "kv_usage_ratio", kv_usage(c), "latency", latency,
                  "store", store, "redis", redis, "top_chunks", top);
    if (root) json_object_set_new(root, "tenants", tenants_json(s, all, owner));
    pthread_mutex_unlock(&s->mu);
    return root;
}

/* ---------------------------------------------------------------- Prometheus */

static void counter(rk_strbuf *t, const char *name, const char *help, uint64_t v) {
    rk_strbuf_printf(t, "# HELP %s %s\n# TYPE %s counter\n%s %llu\n", name, help, name, name,
                     (unsigned long long)v);
}

static void gauge(rk_strbuf *t, const char *name, const char *help, double v) {
    rk_strbuf_printf(t, "# HELP %s %s\n# TYPE %s gauge\n%s %.9g\n", name, help, name, name, v);
}

static void histogram(rk_strbuf *t, const char *name, const char *help, const rk_hist *h) {
    rk_strbuf_printf(t, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int b = 0; b < RK_HIST_BUCKETS; b++) {
        cum += h->counts[b];
        rk_strbuf_printf(t, "%s_bucket{le=\"%g\"} %llu\n", name, k_bounds[b],
                         (unsigned long long)cum);
    }
    rk_strbuf_printf(t, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.9g\n%s_count %llu\n", name,
                     (unsigned long long)h->n, name, h->sum, name, (unsigned long long)h->n);
}

/* The chunk and prefix caches' counters, evictions and responses. */
static void prom_caches(rk_strbuf *t, const rk_stats *s, const rk_cache_snapshot *c) {
    uint64_t hits = chunk_hits_total(s);
    counter(t, "ragkv_chunk_lookups_total",
            "Chunks in finished requests with the chunk cache on (hits + misses).",
            hits + s->chunk_misses);
    rk_strbuf_printf(
        t,
        "# HELP ragkv_chunk_hits_total Chunks in finished requests not computed, by where their KV "
        "came from.\n# TYPE ragkv_chunk_hits_total counter\n");
    for (int i = RK_CHUNK_SOURCE_ARENA; i <= RK_CHUNK_SOURCE_PREFIX; i++)
        rk_strbuf_printf(t, "ragkv_chunk_hits_total{source=\"%s\"} %llu\n",
                         rk_chunk_source_name((rk_chunk_source)i),
                         (unsigned long long)s->chunk_hits[i]);
    counter(t, "ragkv_chunk_misses_total",
            "Chunks in finished requests that were computed (cache misses).", s->chunk_misses);
    counter(t, "ragkv_chunk_hit_tokens_total",
            "Tokens of the chunks counted in ragkv_chunk_hits_total (not computed).",
            s->chunk_hit_tokens);
    counter(t, "ragkv_chunk_computed_tokens_total",
            "Tokens of the chunks counted in ragkv_chunk_misses_total (computed).",
            s->chunk_computed_tokens);
    counter(t, "ragkv_prefix_queries_total", "System prompts matched against the prefix cache.",
            c->prefix.queries);
    counter(t, "ragkv_prefix_hit_tokens_total",
            "System-prompt tokens reused from the prefix cache.", c->prefix.tokens_reused);
    uint64_t px_manual =
        c->prefix_flushed <= c->prefix.evictions ? c->prefix_flushed : c->prefix.evictions;
    rk_strbuf_printf(t, "# HELP ragkv_evictions_total Cache entries evicted, by pool and reason.\n"
                        "# TYPE ragkv_evictions_total counter\n");
    rk_strbuf_printf(t, "ragkv_evictions_total{pool=\"chunk\",reason=\"capacity\"} %llu\n",
                     (unsigned long long)c->chunk.evictions);
    rk_strbuf_printf(t, "ragkv_evictions_total{pool=\"chunk\",reason=\"manual\"} %llu\n",
                     (unsigned long long)c->chunk_removed);
    rk_strbuf_printf(t, "ragkv_evictions_total{pool=\"prefix\",reason=\"capacity\"} %llu\n",
                     (unsigned long long)(c->prefix.evictions - px_manual));
    rk_strbuf_printf(t, "ragkv_evictions_total{pool=\"prefix\",reason=\"manual\"} %llu\n",
                     (unsigned long long)px_manual);
    rk_strbuf_printf(t, "# HELP ragkv_requests_total HTTP responses sent, by status.\n"
                        "# TYPE ragkv_requests_total counter\n");
    for (int i = 100; i < 600; i++)
        if (s->status_counts[i])
            rk_strbuf_printf(t, "ragkv_requests_total{status=\"%d\"} %llu\n", i,
                             (unsigned long long)s->status_counts[i]);
}

/* The disk and Redis tiers. */
static void prom_tiers(rk_strbuf *t, const rk_stats *s, const rk_cache_snapshot *c) {
    counter(t, "ragkv_store_loads_total", "Chunks loaded from the disk store.", c->store_loads);
    if (c->have_store || s->have_redis) {
        histogram(t, "ragkv_tier_load_seconds",
                  "Disk and Redis tier reads on the loader thread (each at the mean of those "
                  "published together).",
                  &s->tier_load);
        gauge(t, "ragkv_tier_load_bytes_in_flight",
              "Chunk bytes being read from the tiers or read and not yet placed.",
              (double)c->loads.bytes_in_flight);
        counter(t, "ragkv_tier_loads_cancelled_total",
                "Queued tier reads dropped because no request waited for them any more.",
                c->loads.cancelled);
        gauge(t, "ragkv_tier_write_bytes_in_flight",
              "Computed chunk bytes queued for the disk tier's writer thread or being written.",
              (double)(c->writes.bytes_in_flight + c->writes.bytes_queued));
        counter(t, "ragkv_tier_writes_failed_total",
                "Disk tier writes that failed on the writer thread (the chunk stays in the arena).",
                c->writes.failed);
    }
    if (s->have_redis) {
        const rk_redis_counters *rd = &s->redis;
        counter(t, "ragkv_redis_hits_total", "Chunks loaded from the shared Redis tier.", rd->hits);
        counter(t, "ragkv_redis_misses_total",
                "Redis tier lookups that found no usable value (skipped calls included).",
                rd->misses);
        counter(t, "ragkv_redis_errors_total",
                "Failed Redis calls (connect, I/O, timeout, error reply).", rd->errors);
        counter(t, "ragkv_redis_writes_total", "Chunks committed to the Redis tier.", rd->writes);
        counter(t, "ragkv_redis_auth_failures_total",
                "Redis values deleted because their HMAC tag did not verify under the secret.",
                rd->auth_failures);
        rk_strbuf_printf(
            t,
            "# HELP ragkv_redis_bytes_total Chunk payload bytes moved to and from Redis.\n"
            "# TYPE ragkv_redis_bytes_total counter\n"
            "ragkv_redis_bytes_total{direction=\"in\"} %llu\n"
            "ragkv_redis_bytes_total{direction=\"out\"} %llu\n",
            (unsigned long long)rd->bytes_in, (unsigned long long)rd->bytes_out);
        histogram(t, "ragkv_redis_latency_seconds",
                  "Redis tier get round trips (each at the mean of those read together).",
                  &s->redis_latency);
    }
}

/* The KV pools and the per-tenant counters. */
static void prom_pools_tenants(rk_strbuf *t, const rk_stats *s, const rk_cache_snapshot *c) {
    rk_strbuf_printf(t, "# HELP ragkv_pool_blocks KV blocks per pool and state.\n"
                        "# TYPE ragkv_pool_blocks gauge\n");
    for (int p = 0; p < RK_POOL_COUNT; p++) {
        const char *name = rk_pool_name((rk_pool_tag)p);
        rk_strbuf_printf(t, "ragkv_pool_blocks{pool=\"%s\",state=\"used\"} %d\n", name,
                         c->pool_total[p] - c->pool_free[p]);
        rk_strbuf_printf(t, "ragkv_pool_blocks{pool=\"%s\",state=\"free\"} %d\n", name,
                         c->pool_free[p]);
    }
    static const struct {
        const char *name, *help;
        size_t off;
    } per_tenant[] = {
        {"ragkv_tenant_requests_total", "Completed generations, by tenant.",
         offsetof(tenant_counts, requests)},
        {"ragkv_tenant_prompt_tokens_total", "Prompt tokens of completed generations, by tenant.",
         offsetof(tenant_counts, prompt_tokens)},
        {"ragkv_tenant_cached_tokens_total",
         "Prompt tokens served from caches in completed generations, by tenant.",
         offsetof(tenant_counts, cached_tokens)},
        {"ragkv_tenant_chunk_hits_total",
         "Chunks of completed generations found cached, by tenant.",
         offsetof(tenant_counts, chunk_hits)},
        {"ragkv_tenant_chunk_misses_total", "Chunks of completed generations computed, by tenant.",
         offsetof(tenant_counts, chunk_misses)},
    };
    for (size_t m = 0; m < sizeof per_tenant / sizeof per_tenant[0]; m++) {
        rk_strbuf_printf(t, "# HELP %s %s\n# TYPE %s counter\n", per_tenant[m].name,
                         per_tenant[m].help, per_tenant[m].name);
        for (int slot = 0; slot <= SLOT_OTHER; slot++) {
            const tenant_counts *tc = &s->tenants[slot];
            if (slot > s->n_tenants && !(slot == SLOT_OTHER && tc->requests)) continue;
            uint64_t v;
            memcpy(&v, (const char *)tc + per_tenant[m].off, sizeof v);
            rk_strbuf_printf(t, "%s{tenant=\"%s\"} %llu\n", per_tenant[m].name,
                             s->tenant_names[slot], (unsigned long long)v);
        }
    }
}

/* Latencies and the serving set, named as vLLM names them. */
static void prom_serving(rk_strbuf *t, const rk_stats *s, const rk_cache_snapshot *c) {
    histogram(t, "ragkv_ttft_seconds", "Time to first token, queueing included.", &s->ttft);
    histogram(t, "ragkv_reindex_seconds", "Time to copy and rotate a request's cached chunks.",
              &s->reindex);
    gauge(t, "ragkv_requests_running", "Generations in progress.", c->running);
    gauge(t, "ragkv_requests_waiting", "Generations queued for the engine.", c->queued);
    gauge(t, "ragkv_kv_usage_ratio", "Share of the live KV pool in use (0..1).", kv_usage(c));
    counter(t, "ragkv_prompt_tokens_total", "Prompt tokens of completed generations.",
            s->prompt_tokens);
    counter(t, "ragkv_generation_tokens_total", "Tokens generated by completed generations.",
            s->completion_tokens);
    counter(t, "ragkv_preemptions_total",
            "Generations taken off the live pool to make room, then resumed.", c->preemptions);
    counter(t, "ragkv_nonfinite_logits_total",
            "Requests failed because the model produced a NaN or infinite logit.",
            c->nonfinite_logits);
    histogram(t, "ragkv_time_per_output_token_seconds",
              "Decode time per generated token after the first, per request.", &s->tpot);
    histogram(t, "ragkv_queue_time_seconds", "Time a generation waited for the engine.", &s->queue);
    histogram(t, "ragkv_e2e_request_latency_seconds",
              "Time from submission to the last token, queueing included.", &s->total);
}

char *rk_stats_prometheus(rk_stats *s) {
    rk_strbuf t = {0};
    pthread_mutex_lock(&s->mu);
    prom_caches(&t, s, &s->snap);
    prom_tiers(&t, s, &s->snap);
    prom_pools_tenants(&t, s, &s->snap);
    prom_serving(&t, s, &s->snap);
    pthread_mutex_unlock(&s->mu);
    return rk_strbuf_take(&t);
}
