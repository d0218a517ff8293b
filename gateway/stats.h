/* gateway/stats.h — the service's statistics for GET /v1/stats (JSON) and
 * GET /metrics (Prometheus text).
 *
 * The engine thread owns the caches, so it alone reads their counters: after
 * every batch or command it publishes a snapshot (rk_stats_publish). HTTP
 * worker threads record response statuses; finished requests add their
 * timings to latency histograms. Everything sits behind one mutex, so any
 * thread may read a consistent view at any time. Counters only grow: nothing
 * resets on a scrape. */
#ifndef RK_STATS_H
#define RK_STATS_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "chunkcache/arena.h"
#include "chunkcache/chunk_index.h"
#include "chunkcache/radix.h"
#include "pipeline/pipeline.h"
#include "pipeline/scheduler.h"

typedef struct rk_stats rk_stats; /* opaque */

rk_status rk_stats_create(rk_stats **out);
void rk_stats_free(rk_stats *s);

/* Store the engine's latest snapshot; counter growth since the previous one
 * goes into the per-minute buckets of the hit-rate windows. */
void rk_stats_publish(rk_stats *s, const rk_cache_snapshot *snap);

#define RK_STATS_TENANTS 64 /* tenants counted by name; the others count as "other" */

/* Name the tenants 1..n (n <= RK_STATS_TENANTS; names are copied) whose
 * counters are kept apart: requests owned by tenant 0 count as "default",
 * those of tenants past n as "other". Call once, before serving. */
void rk_stats_set_tenants(rk_stats *s, const char *const *names, int n);

/* A finished generation: its timings go into the latency histograms, its
 * token counts into the reuse totals, and its counts into its tenant's
 * (r->opt.owner's) counters. */
void rk_stats_record_request(rk_stats *s, const rk_request *r);

/* An HTTP response with this status was sent (counted per status). */
void rk_stats_record_status(rk_stats *s, int http_status);

/* Requests being served now (parsed and not yet answered): add +1 or -1. */
void rk_stats_in_flight(rk_stats *s, int delta);

/* The shared Redis tier's counters, read just before stats are served (its
 * writes are asynchronous, so an engine snapshot would lag them). */
void rk_stats_publish_redis(rk_stats *s, const rk_redis_counters *c);

/* Read the latest published snapshot. */
void rk_stats_snapshot(rk_stats *s, rk_cache_snapshot *out);

/* The /v1/stats document (new reference; NULL when out of memory). */
json_t *rk_stats_json(rk_stats *s);

/* The same for a caller who sees every tenant (all) or tenant `owner` only:
 * top_chunks lists the caller's chunks and `tenants` the caller's counters. */
json_t *rk_stats_json_for(rk_stats *s, int all, int owner);

/* The /metrics page in Prometheus text format 0.0.4 (malloc'ed, NUL-terminated;
 * NULL when out of memory). */
char *rk_stats_prometheus(rk_stats *s);

/* ---------------------------------------------------------------- histograms */

#define RK_HIST_BUCKETS 20 /* finite upper bounds; +Inf is implicit */

/* A latency histogram in seconds with fixed bounds (50 µs to 60 s). */
typedef struct rk_hist {
    uint64_t counts[RK_HIST_BUCKETS + 1]; /* per bucket (not cumulative); last = +Inf */
    uint64_t n;
    double sum, max;
} rk_hist;

/* The finite bucket upper bounds, in seconds (RK_HIST_BUCKETS of them). */
const double *rk_hist_bounds(void);
void rk_hist_add(rk_hist *h, double seconds);
/* The q-quantile (0..1), interpolated inside its bucket; 0 when empty. */
double rk_hist_quantile(const rk_hist *h, double q);

#endif
