/* The AVX2 + FMA + F16C matmul. AVX2 has 16 ymm registers of 8 int32 lanes, so a 16-row panel is run as two
 * 8-lane halves (each reads its own 32 bytes of every 64-byte chunk: the packed layout is the AVX-512 one). Per
 * 64-bit-wide step: vpmaddwd of a (k, k+1) int16 pair vector against a broadcast activation pair, vpaddd into
 * the row's int32 dot; then the fixed float sequence of fs_internal.h per block. Tiles of up to 4 rows. */
#include <immintrin.h>

#include "fs_internal.h"
#include "ops_impl.h"

#define TILE2 4 /* activation rows per tile: 4 float + 4 int accumulators + 4 weight vectors + constants */

FS_INLINE __m256i ld(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
FS_INLINE __m256 half8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
FS_INLINE __m256 u8_8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
FS_INLINE __m256 i8_8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
FS_INLINE __m256i pair(const int16_t *v) {
    int32_t x;
    memcpy(&x, v, sizeof x);
    return _mm256_set1_epi32(x);
}

/* 32 bytes of nibble words (8 lanes) -> 4 vectors of int16 pairs */
FS_INLINE void nibbles(const uint8_t *p, int sign, __m256i *w) {
    const __m256i c = ld(p);
    if (sign) {
        w[0] = _mm256_srai_epi16(_mm256_slli_epi16(c, 12), 12);
        w[1] = _mm256_srai_epi16(_mm256_slli_epi16(c, 8), 12);
        w[2] = _mm256_srai_epi16(_mm256_slli_epi16(c, 4), 12);
        w[3] = _mm256_srai_epi16(c, 12);
    } else {
        const __m256i m = _mm256_set1_epi16(15);
        w[0] = _mm256_and_si256(c, m);
        w[1] = _mm256_and_si256(_mm256_srli_epi16(c, 4), m);
        w[2] = _mm256_and_si256(_mm256_srli_epi16(c, 8), m);
        w[3] = _mm256_srli_epi16(c, 12);
    }
}

typedef struct blk {
    __m256 dw0, dw1, mw;
    const uint8_t *q, *h;
} blk;

/* block b of half `half` (lanes 8*half .. 8*half+7) */
FS_INLINE blk block(const int T, const uint8_t *pw, int64_t b, int half) {
    blk k;
    const int pb = T == FS_Q4_K ? 2368 : T == FS_Q5_K ? 2880 : T == FS_Q6_K ? 3360 : 0;
    const int l0 = 8 * half;
    if (pb) {
        const uint8_t *base = pw + (b / 8) * pb;
        const int s = (int)(b % 8);
        const __m256 d = half8(base + 2 * l0);
        if (T == FS_Q6_K) {
            k.dw0 = _mm256_mul_ps(d, i8_8(base + 32 + 16 * (2 * s) + l0));
            k.dw1 = _mm256_mul_ps(d, i8_8(base + 32 + 16 * (2 * s + 1) + l0));
            k.mw = _mm256_setzero_ps();
            k.q = base + 288 + 384 * s;
        } else {
            const __m256 ndmin = _mm256_sub_ps(_mm256_setzero_ps(), half8(base + 32 + 2 * l0));
            k.dw0 = k.dw1 = _mm256_mul_ps(d, u8_8(base + 64 + 16 * s + l0));
            k.mw = _mm256_mul_ps(ndmin, u8_8(base + 192 + 16 * s + l0));
            k.q = base + 320 + (T == FS_Q4_K ? 256 : 320) * s;
        }
        k.h = k.q + 256;
        return k;
    }
    const int bytes = T == FS_Q4_0 ? 288 : T == FS_Q4_1 ? 320 : T == FS_Q5_0 ? 352 : T == FS_Q5_1 ? 384 : 544;
    const uint8_t *base = pw + b * bytes;
    const int asym = T == FS_Q4_1 || T == FS_Q5_1;
    k.dw0 = k.dw1 = half8(base + 2 * l0);
    k.mw = asym ? half8(base + 32 + 2 * l0) : _mm256_setzero_ps();
    k.q = base + (asym ? 64 : 32);
    k.h = k.q + 256;
    return k;
}

FS_INLINE __m256i or_masked(__m256i w, __m256i g, __m256i m) { return _mm256_or_si256(w, _mm256_and_si256(g, m)); }

/* the 4 weight vectors of chunk c, lanes of `half` */
FS_INLINE void unpack(const int T, const blk *k, int c, int half, __m256i *w) {
    if (T == FS_Q8_0) {
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++)
            w[t] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(k->q + 32 * (4 * c + t) + 16 * half)));
        return;
    }
    nibbles(k->q + 64 * c + 32 * half, T == FS_Q4_0, w);
    if (T == FS_Q5_0 || T == FS_Q5_1 || T == FS_Q5_K) {
        const __m256i m = _mm256_set1_epi16(0x10), H = ld(k->h + 32 * half);
        __m256i g = c < 1 ? _mm256_slli_epi16(H, 4) : c < 2 ? H : _mm256_srli_epi16(H, 4 * (c - 1));
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            w[t] = or_masked(w[t], g, m);
            g = _mm256_srli_epi16(g, 1);
        }
    }
    if (T == FS_Q6_K) {
        const __m256i m = _mm256_set1_epi16(0x30), H = ld(k->h + 64 * (c / 2) + 32 * half);
        __m256i g = c % 2 ? _mm256_srli_epi16(H, 4) : _mm256_slli_epi16(H, 4);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            w[t] = or_masked(w[t], g, m);
            g = _mm256_srli_epi16(g, 2);
        }
    }
    if (T == FS_Q5_0 || T == FS_Q6_K) {
        const __m256i off = _mm256_set1_epi16(T == FS_Q5_0 ? 16 : 32);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) w[t] = _mm256_sub_epi16(w[t], off);
    }
}

#define FS_PREFETCH 2048 /* bytes ahead (kern_avx512.c streams 4096 ahead; not measured here on AVX2) */
FS_INLINE void prefetch(const int T, const uint8_t *pw, int64_t b) {
    const int bytes = T == FS_Q4_0 ? 288 : T == FS_Q4_1 ? 320 : T == FS_Q5_0 ? 352 : T == FS_Q5_1 ? 384
                    : T == FS_Q8_0 ? 544 : T == FS_Q4_K ? 296 : T == FS_Q5_K ? 360 : 420; /* per 32 columns */
    const char *p = (const char *)pw + b * bytes + FS_PREFETCH;
#pragma GCC unroll 9
    for (int off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

FS_INLINE void block_float(const int T, const int R, __m256i *dot, __m256 dw, __m256 mw, const float *d,
                           const float *dv, __m256 *acc) {
    const int asym = T == FS_Q4_1 || T == FS_Q5_1 || T == FS_Q4_K || T == FS_Q5_K;
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
        if (asym) acc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(dv[i]), acc[i]);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(dw, _mm256_set1_ps(d[i])), acc[i]);
    }
}

FS_INLINE void store8(float *y, __m256 v, int lanes) {
    if (lanes >= 8) {
        _mm256_storeu_ps(y, v);
    } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, v);
        for (int l = 0; l < lanes; l++) y[l] = tmp[l];
    }
}

/* R activation rows x one 8-lane half panel */
FS_INLINE void tile_quant(const int T, const int R, const uint8_t *pw, int half, int64_t nb, const fs_act *a,
                          int64_t r0, float *y, int64_t ldy, int lanes) {
    __m256 acc[TILE2];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk k = block(T, pw, b, half);
        if (half == 0) prefetch(T, pw, b);
        const int16_t *v = a->v + (b * a->n + r0) * FS_QB;
        const float *d = a->d + b * a->n + r0, *dv = a->dv + b * a->n + r0;
        __m256i dot[TILE2];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m256i w[4];
            unpack(T, &k, c, half, w);
            const int first = T == FS_Q6_K ? c % 2 == 0 : c == 0;
#pragma GCC unroll 8
            for (int i = 0; i < R; i++)
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    const __m256i p = _mm256_madd_epi16(w[t], pair(v + FS_QB * i + 2 * (4 * c + t)));
                    dot[i] = first && t == 0 ? p : _mm256_add_epi32(dot[i], p);
                }
            if (T == FS_Q6_K && c % 2 == 1) block_float(T, R, dot, c == 1 ? k.dw0 : k.dw1, k.mw, d, dv, acc);
        }
        if (T != FS_Q6_K) block_float(T, R, dot, k.dw0, k.mw, d, dv, acc);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) store8(y + (r0 + i) * ldy + 8 * half, acc[i], lanes);
}

FS_INLINE __m256 float_weights(const int T, const uint8_t *p) {
    if (T == FS_F32) return _mm256_loadu_ps((const float *)p);
    if (T == FS_F16) return half8(p);
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

FS_INLINE void tile_float(const int T, const int R, const uint8_t *pw, int half, int64_t cols, const float *x,
                          int64_t ldx, float *y, int64_t ldy, int lanes) {
    const int es = T == FS_F32 ? 64 : 32;
    __m256 acc[TILE2];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < cols; k++) {
        _mm_prefetch((const char *)pw + k * es + FS_PREFETCH, _MM_HINT_T0);
        const __m256 w = float_weights(T, pw + k * es + es / 2 * half);
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(x[i * ldx + k]), w, acc[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) store8(y + i * ldy + 8 * half, acc[i], lanes);
}

typedef void (*qtile_fn)(const uint8_t *, int, int64_t, const fs_act *, int64_t, float *, int64_t, int);
typedef void (*ftile_fn)(const uint8_t *, int, int64_t, const float *, int64_t, float *, int64_t, int);

#define QTILE(T, R)                                                                                             \
    static void qt_##T##_##R(const uint8_t *pw, int half, int64_t nb, const fs_act *a, int64_t r0, float *y,    \
                             int64_t ldy, int lanes) {                                                          \
        tile_quant(T, R, pw, half, nb, a, r0, y, ldy, lanes);                                                   \
    }
#define QTILES(T) QTILE(T, 1) QTILE(T, 2) QTILE(T, 3) QTILE(T, 4) \
    static const qtile_fn qt_##T[TILE2 + 1] = {0, qt_##T##_1, qt_##T##_2, qt_##T##_3, qt_##T##_4};
#define FTILE(T, R)                                                                                             \
    static void ft_##T##_##R(const uint8_t *pw, int half, int64_t cols, const float *x, int64_t ldx, float *y,  \
                             int64_t ldy, int lanes) {                                                          \
        tile_float(T, R, pw, half, cols, x, ldx, y, ldy, lanes);                                                \
    }
#define FTILES(T) FTILE(T, 1) FTILE(T, 2) FTILE(T, 3) FTILE(T, 4) \
    static const ftile_fn ft_##T[TILE2 + 1] = {0, ft_##T##_1, ft_##T##_2, ft_##T##_3, ft_##T##_4};

QTILES(FS_Q4_0) QTILES(FS_Q4_1) QTILES(FS_Q5_0) QTILES(FS_Q5_1) QTILES(FS_Q8_0)
QTILES(FS_Q4_K) QTILES(FS_Q5_K) QTILES(FS_Q6_K)
FTILES(FS_F32) FTILES(FS_F16) FTILES(FS_BF16)

static const qtile_fn *qtiles(int type) {
    switch (type) {
    case FS_Q4_0: return qt_FS_Q4_0;
    case FS_Q4_1: return qt_FS_Q4_1;
    case FS_Q5_0: return qt_FS_Q5_0;
    case FS_Q5_1: return qt_FS_Q5_1;
    case FS_Q8_0: return qt_FS_Q8_0;
    case FS_Q4_K: return qt_FS_Q4_K;
    case FS_Q5_K: return qt_FS_Q5_K;
    case FS_Q6_K: return qt_FS_Q6_K;
    }
    return NULL;
}

static void mm_avx2(const fs_mm *m, int64_t p0, int64_t p1, int64_t r0, int64_t r1) {
    const fs_traits *t = fs_traits_of(m->type);
    const int64_t panel_bytes = m->cols / t->qk * t->pb;
    const qtile_fn *qt = t->is_float ? NULL : qtiles(m->type);
    const ftile_fn *ft = m->type == FS_F32 ? ft_FS_F32 : m->type == FS_F16 ? ft_FS_F16 : ft_FS_BF16;
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *pw = m->w + p * panel_bytes;
        for (int half = 0; half < 2; half++) {
            const int64_t left = m->rows - p * FS_PANEL - 8 * half;
            if (left <= 0) break;
            const int lanes = left >= 8 ? 8 : (int)left;
            for (int64_t r = r0; r < r1; r += TILE2) {
                const int R = (int)(r1 - r < TILE2 ? r1 - r : TILE2);
                float *y = m->y + p * FS_PANEL;
                if (qt)
                    qt[R](pw, half, m->cols / FS_QB, m->a, r, y, m->ldy, lanes);
                else
                    ft[R](pw, half, m->cols, m->x + r * m->ldx, m->ldx, y + r * m->ldy, m->ldy, lanes);
            }
        }
    }
}

const fs_isa_impl fs_isa_avx2 = {
    "avx2", mm_avx2, fs_op_quantize_row, fs_op_rmsnorm_row, fs_op_attend, fs_op_silu_mul, fs_op_gelu_mul,
};
