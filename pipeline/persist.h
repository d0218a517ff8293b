/* pipeline/persist.h — chunk KV to and from the persistent tiers: the disk
 * store and the shared Redis tier. */
#ifndef RK_PERSIST_H
#define RK_PERSIST_H

#include "pipeline/loader.h"
#include "pipeline/pipeline.h"

/* The tiers' body check (rk_store_body_check): a KV body must be of an
 * unquantized KV dtype, a whole number of its elements, and every value
 * finite (a NaN or infinity would poison every answer that attends to it). */
int rk_persist_body_check(const rk_store_layout *layout, const void *body, size_t body_size,
                          char *why, size_t why_cap);

/* Write a ready entry's KV to the store and the Redis tier, those there are
 * (rk_persist_write_tiers with to_disk set, no lock). policy is "isolated"
 * or "system"; doc_id may be NULL. */
rk_status rk_persist_write(rk_service *svc, const rk_chunk_entry *e, const char *policy,
                           const char *doc_id);

/* Write a ready entry's KV through to the tiers: the store when to_disk is
 * set (and there is one), the Redis tier when there is one (asynchronously;
 * a dropped write is no error). One download of the KV feeds both. release
 * (may be NULL) is the entry's Redis compute lock: freed by the write, or at
 * once when nothing is written. */
rk_status rk_persist_write_tiers(rk_service *svc, const rk_chunk_entry *e, const char *policy,
                                 const char *doc_id, int to_disk, const rk_redis_lock *release);

/* Engine thread: wait for every disk write queued to the writer and end
 * it (its row commits). rk_pipeline_run, the cache commands, pre-warming
 * and closing the service call it, so that what they report is on disk;
 * the steps end the writes that finished as they go. */
void rk_persist_drain_writes(rk_service *svc);

/* Fill a reserved (PENDING) entry from the store when it holds a verified
 * payload for the same tokens and layout; *out_loaded says whether it did. A
 * missing, bad or mismatched payload is not an error: the caller computes. */
rk_status rk_persist_load(rk_service *svc, rk_chunk_entry *e, int *out_loaded);

/* The same from the loader thread (pipeline/loader.h): queue a read of the
 * store's payload for the reserved entry e or, when the store has none and
 * Redis is worth asking, a Redis lookup; e is marked loading and held by the
 * load. *out_queued 0 when neither applies (nothing taken). */
rk_status rk_persist_load_start(rk_service *svc, rk_chunk_entry *e, int *out_queued);

/* Given the compute lock a Redis lookup took for e: 1 when a request that
 * will compute e keeps it (to release with the write), 0 when none does. */
typedef int (*rk_persist_lock_fn)(void *ctx, rk_chunk_entry *e, const rk_redis_lock *lk);

/* Engine thread: the loads the loader finished go into their entries (READY,
 * source "disk" or "redis") when they hold a verified payload for the same
 * tokens and layout; an entry whose load found nothing is computed by
 * whoever holds it (or removed, when nobody does), with the Redis compute
 * lock handed to hand_lock. Queued loads of entries nobody else holds are
 * cancelled. Returns the number of entries filled. */
int rk_persist_collect_loads(rk_service *svc, rk_persist_lock_fn hand_lock, void *ctx);

/* Drop a load unread or untaken (rk_loader_free's drop; ctx is the service). */
void rk_persist_drop_load(void *svc, rk_load *ld);

/* After the disk tier missed: fill a reserved entry from the Redis tier when
 * the cost gate says a load beats computing and Redis holds a verified value
 * for the same tokens and layout (then it is copied to the disk tier too).
 * On a miss, take the fleet-wide compute lock: *out_locked says it is held
 * (*out_lock: pass it to rk_persist_write_tiers after computing, or to
 * rk_redis_unlock if computing fails). When another replica holds it, wait
 * for its value until svc->redis_wait_until (blocking this thread), then
 * compute without a lock. Redis being down is not an error. */
rk_status rk_persist_load_redis(rk_service *svc, rk_chunk_entry *e, int *out_loaded,
                                rk_redis_lock *out_lock, int *out_locked);

/* Start an admission's chunk lookups: together they wait at most
 * cfg.redis_wait_ms for chunks other replicas compute. */
void rk_persist_begin_lookups(rk_service *svc);

/* Record a prefill pass of n_tokens that took seconds, for the cost gate. */
void rk_persist_note_prefill(rk_service *svc, int n_tokens, double seconds);

#endif
