/* tests/faultinject.h — allocation failure on demand, for tests/test_faults.c.
 *
 * The test_faults executable alone is linked with
 * -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=strdup,--wrap=aligned_alloc:
 * every such call made from an object linked into it (the static ragkv_core
 * library and the test itself) lands in faultinject.c, which counts it while
 * a run is armed and makes the chosen one return NULL with errno ENOMEM. Calls
 * made inside shared libraries (libc's own, jansson, SQLite, OpenBLAS,
 * xxHash, Criterion) are not seen; under ASan the real functions are ASan's,
 * so what the wrappers hand out is still checked and leak-tracked. */
#ifndef RK_FAULTINJECT_H
#define RK_FAULTINJECT_H

/* Start counting allocations from zero. n >= 1: the nth one from now fails
 * (only that one: later allocations succeed again, as after a transient
 * shortage); n == 0: count only. */
void rk_fault_alloc_fail_at(long n);

/* The same, but the nth allocation and every one after it fail until
 * rk_fault_alloc_stop(): memory that stays exhausted, so error paths that
 * themselves allocate are exercised too. */
void rk_fault_alloc_fail_from(long n);

/* Stop counting and failing; the count is kept for rk_fault_alloc_count(). */
void rk_fault_alloc_stop(void);

/* Allocations counted since the last rk_fault_alloc_fail_at(). */
long rk_fault_alloc_count(void);

/* 1 when the armed failure has been delivered. */
int rk_fault_alloc_fired(void);

/* The distinct places in the code that allocated since the last arming (by
 * return address), for runs too long to fail at every N: the number of the
 * first and of the last allocation made from each, in order of first use.
 * Fills up to cap of each and returns how many sites there were (1024 at
 * most are told apart). */
int rk_fault_alloc_sites(long *out_first, long *out_last, int cap);

#endif
