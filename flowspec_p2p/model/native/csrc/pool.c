/* The persistent thread pool: n - 1 workers plus the calling thread. A job is fn(ctx, item, thread) over items
 * [0, n_items), handed out in chunks (results never depend on who runs an item: every item writes its own
 * outputs). After a job, workers spin for FS_SPIN_NS waiting for the next one (a layer stack runs several jobs
 * per layer, microseconds apart), then sleep on a condition variable.
 *
 * The caller waits only for the items that were claimed, never for a worker to check in: on a shared machine a
 * worker may be descheduled, and then the caller simply runs the items itself. Claims carry the job's generation
 * (claim = gen << 32 | next item), so a worker that wakes late can't claim items of a later job, and the job's
 * description is stable while any of its items is claimed and unfinished.
 *
 * Wake-up: the caller bumps `gen`, then wakes sleepers if `sleepers` > 0; a worker announces itself in
 * `sleepers` before re-checking `gen` under the mutex. Both use sequentially consistent atomics, so one of them
 * always sees the other's write and no wake-up is lost. The caller holds the API mutex (api.c): one job at a time. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <time.h>

#include "fs_internal.h"

#define FS_SPIN_NS 300000LL /* how long an idle worker spins before sleeping */
#define FS_MAX_THREADS 256

static struct {
    int n;                     /* threads, the caller included */
    pthread_t th[FS_MAX_THREADS];
    atomic_uint gen;           /* bumped once per job (and to stop) */
    unsigned start_gen;        /* gen when the workers were created: what they wait to change */
    atomic_int quit;
    atomic_int sleepers;
    atomic_uint_least64_t claim; /* gen << 32 | next unclaimed item */
    atomic_llong completed;    /* items of the current job finished */
    fs_job_fn fn;
    void *ctx;
    int64_t n_items, chunk;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} P = {.n = 1, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Claims and runs chunks of job `gen` until none is left (or a later job has started). */
static void run_items(unsigned gen, int thread) {
    for (;;) {
        uint64_t c = atomic_load(&P.claim);
        if ((unsigned)(c >> 32) != gen || (int64_t)(c & 0xffffffffu) >= P.n_items) return;
        if (!atomic_compare_exchange_weak(&P.claim, &c, c + (uint64_t)P.chunk)) continue;
        const int64_t i0 = (int64_t)(c & 0xffffffffu), i1 = i0 + P.chunk < P.n_items ? i0 + P.chunk : P.n_items;
        for (int64_t i = i0; i < i1; i++) P.fn(P.ctx, i, thread);
        atomic_fetch_add(&P.completed, i1 - i0);
    }
}

/* Waits until gen != seen; returns the new gen. */
static unsigned wait_job(unsigned seen) {
    const int64_t t0 = now_ns();
    for (unsigned spins = 0;; spins++) {
        const unsigned g = atomic_load(&P.gen);
        if (g != seen) return g;
        cpu_relax();
        if ((spins & 255) == 255 && now_ns() - t0 > FS_SPIN_NS) break;
    }
    pthread_mutex_lock(&P.mu);
    atomic_fetch_add(&P.sleepers, 1);
    while (atomic_load(&P.gen) == seen) pthread_cond_wait(&P.cv, &P.mu);
    atomic_fetch_sub(&P.sleepers, 1);
    pthread_mutex_unlock(&P.mu);
    return atomic_load(&P.gen);
}

static void *worker(void *arg) {
    const int thread = (int)(intptr_t)arg;
    unsigned seen = P.start_gen;
    for (;;) {
        seen = wait_job(seen);
        if (atomic_load(&P.quit)) return NULL;
        run_items(seen, thread);
    }
}

static void wake(void) {
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
    }
}

void fs_pool_run(fs_job_fn fn, void *ctx, int64_t n_items) {
    if (n_items <= 0) return;
    if (P.n == 1 || n_items == 1 || n_items > 0xffffffffLL) {
        for (int64_t i = 0; i < n_items; i++) fn(ctx, i, 0);
        return;
    }
    const unsigned gen = atomic_load(&P.gen) + 1;
    P.fn = fn;
    P.ctx = ctx;
    P.n_items = n_items;
    P.chunk = n_items / (4 * P.n) > 1 ? n_items / (4 * P.n) : 1;
    atomic_store(&P.completed, 0);
    atomic_store(&P.claim, (uint64_t)gen << 32);
    atomic_store(&P.gen, gen);
    wake();
    run_items(gen, 0);
    for (unsigned spins = 0; atomic_load(&P.completed) < n_items; spins++) {
        cpu_relax();
        if ((spins & 1023) == 1023) sched_yield(); /* a worker holding a chunk was descheduled */
    }
}

static void stop_workers(void) {
    if (P.n == 1) return;
    atomic_store(&P.quit, 1);
    pthread_mutex_lock(&P.mu);
    atomic_fetch_add(&P.gen, 1);
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    for (int t = 1; t < P.n; t++) pthread_join(P.th[t], NULL);
    atomic_store(&P.quit, 0);
    P.n = 1;
}

/* In a forked child only the forking thread exists: run jobs on it alone. */
static void after_fork_in_child(void) {
    P.n = 1;
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.cv, NULL);
    atomic_store(&P.sleepers, 0);
}

static void fs_pool_register_atfork(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

int fs_pool_resize(int n_threads) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, fs_pool_register_atfork);
    if (n_threads < 1) n_threads = 1;
    if (n_threads > FS_MAX_THREADS) n_threads = FS_MAX_THREADS;
    if (n_threads == P.n) return P.n;
    stop_workers();
    P.start_gen = atomic_load(&P.gen);
    for (int t = 1; t < n_threads; t++) {
        if (pthread_create(&P.th[t], NULL, worker, (void *)(intptr_t)t) != 0) break;
        P.n = t + 1;
    }
    return P.n;
}

int fs_pool_threads(void) { return P.n; }
