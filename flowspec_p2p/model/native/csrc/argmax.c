/* The argmax of each row of a product x @ W^T, without the product: greedy decoding wants only the LM head's best
 * token, and on a 262k vocabulary a row of float32 logits is 1 MiB.
 *
 * Work items are (a chunk of FS_CHUNK activation rows, a group of AM_PANELS panels). Each item runs the ISA's matmul
 * on its panels into its thread's small buffer (L1-sized: AM_PANELS * FS_PANEL floats per row), which holds exactly
 * the values the full product would hold there (every output is computed by the same kernel tile from the same
 * block sequence: fs_internal.h's numerics), and keeps each row's first maximum. The caller then merges the groups in
 * index order: the result is torch.argmax of the full product, bit for bit. Ties go to the lowest index (a later
 * group wins only with a strictly larger value); a NaN counts as the largest value and the first NaN wins, as in
 * torch. */
#include <math.h>

#include "fs_internal.h"

#define AM_PANELS 64 /* panels per work item: 1024 output rows, 4 KiB of floats per activation row */
#define AM_WIDTH (AM_PANELS * FS_PANEL)

typedef struct am_job {
    const fs_mm *m;
    const fs_isa_impl *isa;
    int64_t groups, panels, panel_bytes, rows_per_item;
    float *buf;   /* per thread [rows_per_item][AM_WIDTH] */
    float *best;  /* [groups][n]: each group's maximum per activation row */
    int64_t *at;  /* [groups][n]: its first index in the group */
} am_job;

typedef float am_f4 __attribute__((vector_size(16))); /* 4 lanes: SSE2 on x86-64, NEON on aarch64 */
typedef int32_t am_i4 __attribute__((vector_size(16)));

/* The first maximum of y [len] (len >= 1): the first NaN if there is one. One SIMD pass for the maximum (per
 * lane: the larger value, as maxps; an inf or a NaN turns the lane's `bad` into NaN, sending the row to the exact
 * scalar pass), then the first index holding it. */
static void first_max(const float *y, int64_t len, float *best, int64_t *at) {
    am_f4 acc[4], bad[4];
    for (int l = 0; l < 4; l++) acc[l] = (am_f4){-INFINITY, -INFINITY, -INFINITY, -INFINITY}, bad[l] = (am_f4){0};
    const int64_t whole = len / 16 * 16;
    for (int64_t k = 0; k < whole; k += 16)
        for (int l = 0; l < 4; l++) {
            am_f4 v;
            memcpy(&v, y + k + 4 * l, sizeof v);
            const am_i4 gt = v > acc[l];
            acc[l] = (am_f4)(((am_i4)v & gt) | ((am_i4)acc[l] & ~gt));
            bad[l] += v - v;
        }
    float m = -INFINITY, b = 0.0f;
    for (int l = 0; l < 4; l++)
        for (int i = 0; i < 4; i++) m = acc[l][i] > m ? acc[l][i] : m, b += bad[l][i];
    for (int64_t k = whole; k < len; k++) m = y[k] > m ? y[k] : m, b += y[k] - y[k];
    if (b != b) { /* an inf or a NaN: the first NaN wins, else the first maximum */
        int64_t i = 0;
        for (int64_t k = 0; k < len; k++) {
            if (y[k] != y[k]) {
                i = k;
                break;
            }
            if (y[k] > y[i]) i = k;
        }
        *best = y[i];
        *at = i;
        return;
    }
    int64_t k = 0;
    while (y[k] != m) k++; /* m is one of y's values (an all -inf row took the scalar pass: -inf - -inf is NaN) */
    *best = m;
    *at = k;
}

static void am_run(void *ctx, int64_t item, int thread) {
    const am_job *j = ctx;
    const fs_mm *m = j->m;
    const int64_t g = item % j->groups, r0 = item / j->groups * j->rows_per_item;
    const int64_t r1 = r0 + j->rows_per_item < m->n ? r0 + j->rows_per_item : m->n;
    const int64_t p0 = g * AM_PANELS, p1 = p0 + AM_PANELS < j->panels ? p0 + AM_PANELS : j->panels;
    float *y = j->buf + (int64_t)thread * j->rows_per_item * AM_WIDTH;
    /* the item's panels and rows as a matmul of their own: weights from panel p0, activations from row r0 */
    fs_mm sub = *m;
    fs_act a;
    sub.w = m->w + p0 * j->panel_bytes;
    sub.rows = m->rows - p0 * FS_PANEL;
    sub.y = y;
    sub.ldy = AM_WIDTH;
    if (m->a) {
        a = *m->a; /* block-major: rows keep their stride a->n, the views start at row r0 */
        a.v += r0 * FS_QB;
        a.d += r0;
        a.dv += r0;
        sub.a = &a;
    } else {
        sub.x = m->x + r0 * m->ldx;
    }
    j->isa->matmul(&sub, 0, p1 - p0, 0, r1 - r0);
    const int64_t len = sub.rows < (p1 - p0) * FS_PANEL ? sub.rows : (p1 - p0) * FS_PANEL;
    for (int64_t r = r0; r < r1; r++) {
        int64_t k;
        first_max(y + (r - r0) * AM_WIDTH, len, &j->best[g * m->n + r], &k);
        j->at[g * m->n + r] = p0 * FS_PANEL + k;
    }
}

int fs_matmul_argmax(int type, int64_t rows, int64_t cols, const void *packed, const float *x, int64_t n,
                     int64_t *ids) {
    if (fs_packed_size(type, rows, cols) < 0 || n < 0 || rows < 1 || rows > INT32_MAX || cols > INT32_MAX)
        return FS_EINVAL;
    if (n == 0) return FS_OK;
    const fs_traits *t = fs_traits_of(type);
    const int64_t panels = fs_panels(rows), groups = (panels + AM_PANELS - 1) / AM_PANELS;
    const int64_t per = n < FS_CHUNK ? n : FS_CHUNK, chunks = (n + per - 1) / per;
    fs_lock();
    const int threads = fs_pool_threads();
    int rc = FS_ENOMEM;
    fs_act a;
    float *buf = fs_scratch(FS_S_AMAX, (size_t)(threads * per * AM_WIDTH) * sizeof(float));
    uint8_t *res = fs_scratch(FS_S_AMAX_BEST, (size_t)(groups * n) * (sizeof(float) + sizeof(int64_t)));
    if (buf && res && (t->is_float || fs_act_alloc(&a, FS_S_ACT, n, cols) == FS_OK)) {
        fs_mm m = {type, rows, cols, n, packed, NULL, x, cols, NULL, 0};
        if (!t->is_float) {
            fs_quantize_rows(x, cols, &a);
            m.a = &a;
        }
        am_job job = {&m, fs_current_isa(), groups, panels, cols / t->qk * t->pb, per, buf,
                      (float *)(res + (size_t)(groups * n) * sizeof(int64_t)), (int64_t *)res};
        fs_pool_run(am_run, &job, chunks * groups);
        for (int64_t r = 0; r < n; r++) { /* groups in index order: a later one wins only when strictly larger */
            float best = job.best[r];
            int64_t at = job.at[r];
            for (int64_t g = 1; g < groups; g++) {
                const float v = job.best[g * n + r];
                if (best == best && (v != v || v > best)) {
                    best = v;
                    at = job.at[g * n + r];
                }
            }
            ids[r] = at;
        }
        rc = FS_OK;
    }
    fs_unlock();
    return rc;
}
