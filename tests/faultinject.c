/* tests/faultinject.c — the --wrap targets behind tests/faultinject.h. The
 * state is atomic: compute threads may allocate while the test thread runs. */
#include "tests/faultinject.h"

#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>

void *__real_malloc(size_t size);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t size);
char *__real_strdup(const char *s);
void *__real_aligned_alloc(size_t alignment, size_t size);

void *__wrap_malloc(size_t size);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t size);
char *__wrap_strdup(const char *s);
void *__wrap_aligned_alloc(size_t alignment, size_t size);

static atomic_int g_active;
static atomic_long g_count;
static atomic_long g_fail_at;
static atomic_int g_persistent;
static atomic_int g_fired;

static void arm(long n, int persistent) {
    atomic_store(&g_active, 0);
    atomic_store(&g_count, 0);
    atomic_store(&g_fail_at, n);
    atomic_store(&g_persistent, persistent);
    atomic_store(&g_fired, 0);
    atomic_store(&g_active, 1);
}

void rk_fault_alloc_fail_at(long n) { arm(n, 0); }
void rk_fault_alloc_fail_from(long n) { arm(n, 1); }

void rk_fault_alloc_stop(void) { atomic_store(&g_active, 0); }
long rk_fault_alloc_count(void) { return atomic_load(&g_count); }
int rk_fault_alloc_fired(void) { return atomic_load(&g_fired); }

/* Count one allocation while armed; 1 when it must fail. */
static int should_fail(void) {
    if (!atomic_load(&g_active)) return 0;
    long k = atomic_fetch_add(&g_count, 1) + 1, at = atomic_load(&g_fail_at);
    if (at == 0 || k < at || (k > at && !atomic_load(&g_persistent))) return 0;
    atomic_store(&g_fired, 1);
    errno = ENOMEM;
    return 1;
}

void *__wrap_malloc(size_t size) { return should_fail() ? NULL : __real_malloc(size); }

void *__wrap_calloc(size_t n, size_t size) { return should_fail() ? NULL : __real_calloc(n, size); }

/* A failed realloc leaves the block as it was, as the real one does. */
void *__wrap_realloc(void *p, size_t size) {
    return should_fail() ? NULL : __real_realloc(p, size);
}

char *__wrap_strdup(const char *s) { return should_fail() ? NULL : __real_strdup(s); }

void *__wrap_aligned_alloc(size_t alignment, size_t size) {
    return should_fail() ? NULL : __real_aligned_alloc(alignment, size);
}
