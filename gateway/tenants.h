/* gateway/tenants.h — API keys that name tenants (`ragkv serve
 * --api-keys-file F`).
 *
 * F is JSON: {"keys": [{"key": "…", "tenant": "A", "salt": "…"}, …]}. Each
 * key belongs to one tenant; a tenant's salt (its name unless given) is the
 * cache scope of its requests, so tenants share no cached chunk, prefix or
 * sequence (pipeline.h, rk_cache_scope). Several keys may name one tenant
 * (key rotation); they must then agree on the salt. No two tenants may have
 * one salt (they would share a cache).
 *
 * Tenants are numbered from 1 in the order the file first names them: that
 * number is the owner of the chunk entries their requests create, and the
 * index of their counters. Keys are secrets: no message, log line or output
 * ever holds one. A table is read once and then only read (any thread). */
#ifndef RK_TENANTS_H
#define RK_TENANTS_H

#include <stddef.h>

#include "config/config.h"

#define RK_TENANT_KEY_MAX  255  /* bytes of a key */
#define RK_TENANT_NAME_MAX 63   /* bytes of a tenant name: letters, digits, . _ - */
#define RK_TENANTS_MAX     4096 /* keys in one file */

typedef struct rk_tenants rk_tenants; /* opaque */

/* Parse a keys file's text (len bytes). A malformed file fails with a message
 * naming the entry and field (`keys[2].tenant: ...`), never a key's value.
 * The caller owns *out (rk_tenants_free). */
rk_status rk_tenants_parse(const char *text, size_t len, rk_tenants **out);

/* Read and parse the file at path (messages start with the path). */
rk_status rk_tenants_load(const char *path, rk_tenants **out);

void rk_tenants_free(rk_tenants *t); /* accepts NULL */

/* The tenant (1..rk_tenants_count) whose key is `given`, or 0. Every key is
 * compared, each in time that depends on its length alone, so the time taken
 * does not tell which key, or how much of one, matched. Allocates nothing. */
int rk_tenants_find(const rk_tenants *t, const char *given);

/* Distinct tenants. */
int rk_tenants_count(const rk_tenants *t);

/* Tenant id's name and salt (id 1..count); NULL for any other id. */
const char *rk_tenants_name(const rk_tenants *t, int id);
const char *rk_tenants_salt(const rk_tenants *t, int id);

/* The tenant named name (1..count), or 0. */
int rk_tenants_by_name(const rk_tenants *t, const char *name);

/* 1 when some key of t equals key (a check that --api-key and --admin-key
 * are not also tenant keys). */
int rk_tenants_has_key(const rk_tenants *t, const char *key);

/* Constant-time comparison of a presented key with an expected one: the time
 * depends on the expected key's length only. */
int rk_key_equal(const char *given, const char *want);

#endif
