/* Internal declarations shared by the engine's translation units: type traits, the decoded-block form every
 * kernel agrees on, the quantized-activation buffer, the per-ISA function table and the thread pool.
 *
 * The numerics every ISA path implements identically (so a row's result never depends on the path's tiling):
 *  - an activation row is quantized per 32-column block b: amax = max|x|, d_b = amax / 32767, v = rne(x * (32767 /
 *    amax)) clamped to +-32767 (all zero when amax == 0), dv_b = d_b * float(sum of the block's v);
 *  - a weight block is w = dw * q + mw with q a small integer (signed for the symmetric types, mw = 0 there);
 *  - y = 0; per block in column order: [asymmetric types] y = fma(mw, dv_b, y); y = fma(float(dot), dw * d_b, y),
 *    where dot = sum q*v is exact in int32 (Q6_K: two steps per block, one per 16-column half, no mw step);
 *  - float weight types: y = 0; per column k in order: y = fma(x_k, w_k, y).
 * Integer partial sums may be split any way (they are exact); the float sequence may not. */
#ifndef FS_INTERNAL_H
#define FS_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "fs.h"

#define FS_INLINE static inline __attribute__((always_inline))
#define FS_QB 32     /* columns per activation block */
#define FS_TILE 8    /* activation rows per kernel tile */
#define FS_CHUNK 64  /* activation rows per matmul work item (weights are re-read from cache per chunk) */

typedef struct fs_traits {
    int type;
    int qk;         /* columns per GGUF block (1 for the float types) */
    int gguf_bytes; /* bytes per GGUF block */
    int pb;         /* packed bytes per panel-block: FS_PANEL rows x qk columns */
    int asym;       /* 1: blocks carry an offset mw (the kernel's extra fma step) */
    int is_float;   /* 1: F32 / F16 / BF16, no activation quantization */
} fs_traits;

const fs_traits *fs_traits_of(int type); /* NULL for an unsupported type */
int64_t fs_panels(int64_t rows);         /* ceil(rows / FS_PANEL) */

/* One 32-column block of a panel, decoded: what the portable kernel and fs_dequant_rows work from. */
typedef struct fs_block {
    int16_t q[FS_PANEL][FS_QB]; /* [lane][k] integer weights */
    float dw[2][FS_PANEL];      /* [16-column half][lane] scale (the halves differ only for Q6_K) */
    float mw[FS_PANEL];         /* [lane] offset (0 for the symmetric types) */
} fs_block;

/* Decodes 32-column block b (in column order, b < cols / 32) of the panel starting at pw. */
void fs_decode_block(int type, const uint8_t *pw, int64_t b, fs_block *out);

/* Byte offsets of the pieces of a panel-block (formats.c describes the layout). */
const uint8_t *fs_block_base(const fs_traits *t, const uint8_t *pw, int64_t b);

FS_INLINE float fs_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man != 0) { /* subnormal: normalize */
        uint32_t e = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((man & 0x3ffu) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

FS_INLINE float fs_bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

FS_INLINE uint16_t fs_rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Quantized activations of n rows: block-major, so a tile's rows of one block are adjacent in memory. */
typedef struct fs_act {
    int16_t *v; /* [cols / 32][n][32] */
    float *d;   /* [cols / 32][n] block scale */
    float *dv;  /* [cols / 32][n] d * float(sum of the block's v) */
    int64_t n, cols;
} fs_act;

/* One matmul y [n, ldy] (columns [0, rows)) = x @ W^T. */
typedef struct fs_mm {
    int type;
    int64_t rows, cols, n; /* n: activation rows */
    const uint8_t *w;   /* packed */
    const fs_act *a;    /* integer types: the quantized x */
    const float *x;     /* float types: x [n, ldx] */
    int64_t ldx;
    float *y;
    int64_t ldy;
} fs_mm;

/* Attention of one layer for n new rows (see fs_layers_forward). Work items are (kv head, block of up to
 * FS_ATT_ROWS rows): every q head of the kv head's group and every row of the block share each 16-slot block of
 * K and V while it is in L1. */
#define FS_ATT_ROWS 4
typedef struct fs_attn {
    const float *q; /* [n, q_heads * hd], rotated */
    const float *kc, *vc; /* this layer's caches [kv_heads][capacity][hd] */
    const uint8_t *mask;  /* [n, start + n] or NULL */
    float *out;           /* [n, q_heads * hd] */
    float *scratch;       /* per thread: thread_stride floats (fs_attn_scratch) */
    int64_t capacity, start, n, ld_scores, thread_stride;
    int64_t window; /* 0, or each row attends to its last `window` visible keys (fs_window_lo) */
    int q_heads, group, hd;
    float scale;
} fs_attn;

/* The first slot row r may attend to under the window: the slot of the `window`-th visible key counted from the
 * row's end (visible: its mask, or slots [0, start + r] without one), 0 when it sees fewer. */
FS_INLINE int64_t fs_window_lo(const fs_attn *at, int64_t r) {
    if (at->window <= 0) return 0;
    if (!at->mask) {
        const int64_t limit = at->start + r + 1;
        return limit > at->window ? limit - at->window : 0;
    }
    const int64_t total = at->start + at->n;
    const uint8_t *vis = at->mask + r * total;
    int64_t seen = 0;
    for (int64_t s = total - 1; s >= 0; s--)
        if (vis[s] && ++seen == at->window) return s;
    return 0;
}

/* floats of per-thread attention scratch: scores [pairs][ld_scores] then per pair 32 + hd floats of state */
FS_INLINE int64_t fs_attn_scratch(int group, int hd, int64_t ld_scores) {
    return (int64_t)FS_ATT_ROWS * group * (ld_scores + 32 + (hd + 15) / 16 * 16);
}

/* What one ISA path provides. Every function computes the numerics above exactly; only speed differs. */
typedef struct fs_isa_impl {
    const char *name;
    /* panels [p0, p1) x activation rows [r0, r1) */
    void (*matmul)(const fs_mm *m, int64_t p0, int64_t p1, int64_t r0, int64_t r1);
    void (*quantize_row)(const float *x, int64_t r, fs_act *a); /* row r of a from x [cols] */
    void (*rmsnorm_row)(const float *x, const float *w, int64_t dim, float eps, float *out);
    void (*attend)(const fs_attn *at, int kv_head, int64_t r0, int64_t r1, int thread); /* rows [r0, r1) */
    void (*silu_mul)(float *g, const float *u, int64_t n); /* g = silu(g) * u */
    void (*gelu_mul)(float *g, const float *u, int64_t n); /* g = gelu_tanh(g) * u */
} fs_isa_impl;

extern const fs_isa_impl fs_isa_portable;
void fs_mm_portable(const fs_mm *m, int64_t p0, int64_t p1, int64_t r0, int64_t r1);
#if defined(__x86_64__) || defined(_M_X64)
extern const fs_isa_impl fs_isa_avx2, fs_isa_avx512, fs_isa_avx512vnni;
#endif
#if defined(__aarch64__)
extern const fs_isa_impl fs_isa_neon;
#endif

const fs_isa_impl *fs_current_isa(void);

/* The pool: runs fn(ctx, item, thread) for item in [0, n_items) on all threads and returns when all are done. */
typedef void (*fs_job_fn)(void *ctx, int64_t item, int thread);
void fs_pool_run(fs_job_fn fn, void *ctx, int64_t n_items);
int fs_pool_resize(int n_threads);
int fs_pool_threads(void);

/* Runs the matmuls ms[0..count) (sharing one pool dispatch) with the current ISA. */
void fs_run_matmuls(const fs_mm *ms, int count);
/* Quantizes rows [0, a->n) of x [a->n, ldx] into a (through the pool when that pays). */
void fs_quantize_rows(const float *x, int64_t ldx, fs_act *a);

/* The API mutex (api.c): held by every call that uses the pool or the scratch buffers. */
void fs_lock(void);
void fs_unlock(void);

/* Library-owned scratch buffers, grown as needed, 64-byte aligned, contents not kept across calls. Only used
 * under the API mutex. */
enum fs_scratch_id {
    FS_S_ACT, FS_S_ACT2, FS_S_ITEMS, FS_S_NORM, FS_S_Q, FS_S_K, FS_S_V, FS_S_ATT, FS_S_OUT, FS_S_G, FS_S_U,
    FS_S_SCORES, FS_S_GROUPS, FS_S_AMAX, FS_S_AMAX_BEST, FS_S_COUNT
};
void *fs_scratch(int id, size_t bytes); /* NULL when out of memory */
int fs_act_alloc(fs_act *a, int id, int64_t n, int64_t cols);
/* y [n, m->rows] = x [n, m->cols] @ W^T for a caller holding the lock; act_id: the scratch for x quantized. */
int fs_matmul_locked(const fs_matrix *w, const float *x, int64_t n, float *y, int act_id);

#endif
