/* The public entry points other than the layer stack: ISA choice, threads, matmul, norms. Every call that uses
 * the pool or the scratch buffers holds one mutex (two Python threads may call at once; they are serialized).
 *
 * The ISA is chosen once from CPUID (every path is compiled into the library, each translation unit with its own
 * flags, so the same binary loads on any CPU of its architecture); fs_set_isa lets tests force a path. */
#define _DEFAULT_SOURCE /* madvise flags */
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "fs_internal.h"

static pthread_mutex_t api_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t isa_once = PTHREAD_ONCE_INIT;
static const fs_isa_impl *isa_best, *isa_now;

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void unlock_in_child(void) { pthread_mutex_init(&api_mu, NULL); } /* its holder did not fork along */
static void register_atfork(void) { pthread_atfork(NULL, NULL, unlock_in_child); }

void fs_lock(void) {
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&api_mu);
}
void fs_unlock(void) { pthread_mutex_unlock(&api_mu); }

static const fs_isa_impl *const ALL[] = {
#if defined(__x86_64__)
    &fs_isa_avx512vnni, &fs_isa_avx512, &fs_isa_avx2,
#endif
#if defined(__aarch64__)
    &fs_isa_neon,
#endif
    &fs_isa_portable,
};

static int runs_here(const fs_isa_impl *impl) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                       __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (impl == &fs_isa_avx512vnni) return avx512 && __builtin_cpu_supports("avx512vnni");
    if (impl == &fs_isa_avx512) return avx512;
    if (impl == &fs_isa_avx2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
    (void)impl;
    return 1; /* portable, and NEON (baseline on aarch64) */
}

static void choose(void) {
    for (size_t i = 0; i < sizeof ALL / sizeof ALL[0]; i++)
        if (runs_here(ALL[i])) {
            isa_best = isa_now = ALL[i];
            return;
        }
}

const fs_isa_impl *fs_current_isa(void) {
    pthread_once(&isa_once, choose);
    return isa_now;
}

const char *fs_isa(void) { return fs_current_isa()->name; }

static const fs_isa_impl *find(const char *name) {
    for (size_t i = 0; i < sizeof ALL / sizeof ALL[0]; i++)
        if (strcmp(ALL[i]->name, name) == 0) return ALL[i];
    return NULL;
}

int fs_isa_available(const char *name) {
    const fs_isa_impl *impl = name ? find(name) : NULL;
    return impl != NULL && runs_here(impl);
}

int fs_set_isa(const char *name) {
    pthread_once(&isa_once, choose);
    const fs_isa_impl *impl = name ? find(name) : isa_best;
    if (impl == NULL || !runs_here(impl)) return FS_EISA;
    fs_lock();
    isa_now = impl;
    fs_unlock();
    return FS_OK;
}

int fs_init(int n_threads) {
    fs_lock();
    const int n = fs_pool_resize(n_threads);
    fs_unlock();
    return n;
}

int fs_threads(void) { return fs_pool_threads(); }

/* ---- scratch ------------------------------------------------------------------------------------------------ */

static struct {
    void *p;
    size_t cap;
} scratch[FS_S_COUNT];

void *fs_scratch(int id, size_t bytes) {
    if (bytes > scratch[id].cap) {
        void *p = NULL;
        const size_t cap = bytes + bytes / 2 + 4096;
        if (posix_memalign(&p, 64, cap) != 0) return NULL;
        free(scratch[id].p);
        scratch[id].p = p;
        scratch[id].cap = cap;
    }
    return scratch[id].p;
}

int fs_act_alloc(fs_act *a, int id, int64_t n, int64_t cols) {
    const size_t nb = (size_t)(cols / FS_QB), vbytes = (size_t)(n * cols) * sizeof(int16_t);
    const size_t sbytes = (nb * (size_t)n * sizeof(float) + 63) / 64 * 64;
    uint8_t *p = fs_scratch(id, vbytes + 2 * sbytes + 64);
    if (p == NULL) return FS_ENOMEM;
    a->v = (int16_t *)p;
    a->d = (float *)(p + (vbytes + 63) / 64 * 64);
    a->dv = (float *)((uint8_t *)a->d + sbytes);
    a->n = n;
    a->cols = cols;
    return FS_OK;
}

/* ---- matmuls through the pool ------------------------------------------------------------------------------ */

typedef struct mm_item {
    int mi;
    int64_t p0, p1, r0, r1;
} mm_item;

typedef struct mm_job {
    const fs_mm *ms;
    const mm_item *items;
    const fs_isa_impl *isa;
} mm_job;

static void mm_run(void *ctx, int64_t i, int thread) {
    const mm_job *j = ctx;
    const mm_item *it = &j->items[i];
    (void)thread;
    j->isa->matmul(&j->ms[it->mi], it->p0, it->p1, it->r0, it->r1);
}

/* Work items: row chunks of FS_CHUNK x groups of panels, about 4 groups per thread per matrix. */
void fs_run_matmuls(const fs_mm *ms, int count) {
    const int threads = fs_pool_threads();
    int64_t n_items = 0;
    for (int pass = 0; pass < 2; pass++) {
        mm_item *items = pass ? fs_scratch(FS_S_ITEMS, (size_t)n_items * sizeof *items) : NULL;
        if (pass && items == NULL) return;
        int64_t k = 0;
        for (int mi = 0; mi < count; mi++) {
            const fs_mm *m = &ms[mi];
            const int64_t panels = fs_panels(m->rows), n = m->n;
            const int64_t group = threads == 1 ? panels : (panels + 4 * threads - 1) / (4 * threads);
            for (int64_t r0 = 0; r0 < n; r0 += FS_CHUNK)
                for (int64_t p0 = 0; p0 < panels; p0 += group, k++)
                    if (pass)
                        items[k] = (mm_item){mi, p0, p0 + group < panels ? p0 + group : panels, r0,
                                             r0 + FS_CHUNK < n ? r0 + FS_CHUNK : n};
        }
        n_items = k;
        if (pass) {
            mm_job job = {ms, items, fs_current_isa()};
            fs_pool_run(mm_run, &job, n_items);
        }
    }
}

typedef struct quant_job {
    const float *x;
    int64_t ldx;
    fs_act *a;
    const fs_isa_impl *isa;
} quant_job;

static void quant_run(void *ctx, int64_t r, int thread) {
    const quant_job *j = ctx;
    (void)thread;
    j->isa->quantize_row(j->x + r * j->ldx, r, j->a);
}

void fs_quantize_rows(const float *x, int64_t ldx, fs_act *a) {
    quant_job job = {x, ldx, a, fs_current_isa()};
    if (a->n * a->cols >= 16384)
        fs_pool_run(quant_run, &job, a->n);
    else
        for (int64_t r = 0; r < a->n; r++) quant_run(&job, r, 0);
}

int fs_matmul_locked(const fs_matrix *w, const float *x, int64_t n, float *y, int act_id) {
    fs_act a;
    fs_mm m = {w->type, w->rows, w->cols, n, w->data, NULL, x, w->cols, y, w->rows};
    if (!fs_traits_of(w->type)->is_float) {
        if (fs_act_alloc(&a, act_id, n, w->cols) != FS_OK) return FS_ENOMEM;
        fs_quantize_rows(x, w->cols, &a);
        m.a = &a;
    }
    fs_run_matmuls(&m, 1);
    return FS_OK;
}

int fs_matmul(int type, int64_t rows, int64_t cols, const void *packed, const float *x, int64_t n, float *y) {
    if (fs_packed_size(type, rows, cols) < 0 || n < 0 || rows > INT32_MAX || cols > INT32_MAX) return FS_EINVAL;
    if (n == 0) return FS_OK;
    const fs_matrix w = {packed, type, (int32_t)rows, (int32_t)cols};
    fs_lock();
    const int rc = fs_matmul_locked(&w, x, n, y, FS_S_ACT);
    fs_unlock();
    return rc;
}

int fs_quantize_act(const float *x, int64_t n, int64_t cols, int16_t *v, float *d) {
    if (n < 0 || cols <= 0 || cols % FS_QB) return FS_ESHAPE;
    fs_lock();
    fs_act a;
    int rc = fs_act_alloc(&a, FS_S_ACT, n, cols);
    if (rc == FS_OK) {
        fs_quantize_rows(x, cols, &a);
        for (int64_t r = 0; r < n; r++)
            for (int64_t b = 0; b < cols / FS_QB; b++) {
                memcpy(v + r * cols + b * FS_QB, a.v + (b * n + r) * FS_QB, FS_QB * sizeof *v);
                d[r * (cols / FS_QB) + b] = a.d[b * n + r];
            }
    }
    fs_unlock();
    return rc;
}

int fs_rmsnorm(const float *x, const float *w, int64_t n, int64_t dim, float eps, float *out) {
    if (n < 0 || dim <= 0) return FS_ESHAPE;
    const fs_isa_impl *isa = fs_current_isa();
    for (int64_t r = 0; r < n; r++) isa->rmsnorm_row(x + r * dim, w, dim, eps, out + r * dim);
    return FS_OK;
}

int fs_final(const float *x, const float *norm, int64_t n, float eps, const fs_matrix *head, float *logits) {
    if (n < 0 || fs_packed_size(head->type, head->rows, head->cols) < 0) return FS_EINVAL;
    if (n == 0) return FS_OK;
    fs_lock();
    int rc = FS_ENOMEM;
    const float *h = x;
    if (norm) {
        float *buf = fs_scratch(FS_S_NORM, (size_t)(n * head->cols) * sizeof(float));
        if (buf) fs_rmsnorm(x, norm, n, head->cols, eps, buf);
        h = buf;
    }
    if (h) rc = fs_matmul_locked(head, h, n, logits, FS_S_ACT);
    fs_unlock();
    return rc;
}

int fs_advise_hugepages(void *p, int64_t n) {
#if defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20, lo = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    const uintptr_t hi = ((uintptr_t)p + (uintptr_t)n) & ~(huge - 1);
    if (hi <= lo) return 0;
    return madvise((void *)lo, hi - lo, MADV_HUGEPAGE) == 0 ? 0 : -1;
#else
    (void)p, (void)n;
    return -1;
#endif
}

int64_t fs_struct_size(const char *name) {
    if (strcmp(name, "fs_matrix") == 0) return (int64_t)sizeof(fs_matrix);
    if (strcmp(name, "fs_layer") == 0) return (int64_t)sizeof(fs_layer);
    if (strcmp(name, "fs_config") == 0) return (int64_t)sizeof(fs_config);
    if (strcmp(name, "fs_group") == 0) return (int64_t)sizeof(fs_group);
    if (strcmp(name, "fs_layer_x") == 0) return (int64_t)sizeof(fs_layer_x);
    if (strcmp(name, "fs_arch") == 0) return (int64_t)sizeof(fs_arch);
    return -1;
}
