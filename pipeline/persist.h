/* pipeline/persist.h — chunk KV to and from the persistent store. */
#ifndef RK_PERSIST_H
#define RK_PERSIST_H

#include "pipeline/pipeline.h"

/* Write a ready entry's KV to the store (no-op without a store). policy is
 * "isolated" or "system"; doc_id may be NULL. */
rk_status rk_persist_write(rk_service *svc, const rk_chunk_entry *e, const char *policy,
                           const char *doc_id);

/* Fill a reserved (PENDING) entry from the store when it holds a verified
 * payload for the same tokens and layout; *out_loaded says whether it did. A
 * missing, bad or mismatched payload is not an error: the caller computes. */
rk_status rk_persist_load(rk_service *svc, rk_chunk_entry *e, int *out_loaded);

#endif
