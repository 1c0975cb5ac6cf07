/* The AVX-512 matmul (F + BW + VL + DQ; built a second time with -DFS_VNNI for vpdpwssd). Lanes = the 16 output
 * rows of a panel. Per 32-column block, each 64-byte chunk of nibble words unpacks by shift+mask into four zmm of
 * (k, k+1) int16 pairs, and each activation row contributes a broadcast pair per vpdpwssd (vpmaddwd + vpaddd
 * without VNNI). A tile of up to FS_TILE activation rows shares every unpacked weight vector; the float part per
 * row and block is the fixed sequence of fs_internal.h, so any tile size gives the same bits.
 *
 * Registers for a full tile: FS_TILE float accumulators + FS_TILE int dots + 4 weight vectors (one chunk). zmm
 * vpdpwssd needs ~16 independent chains to reach its throughput here, so small tiles split each row's dot into
 * 2-4 int partial sums (exact: any split of an int sum gives the same int). Measured limits, 8-row tile, data in
 * L1: the dpwssd + broadcast stream alone 24 ns per panel-block, + unpack and float part 32 ns (NOTES.md). */
#include <immintrin.h>

#include "fs_internal.h"
#include "ops_avx512.h"

#ifdef FS_VNNI
#define DPW(acc, w, x) _mm512_dpwssd_epi32((acc), (w), (x))
#define ISA_TABLE fs_isa_avx512vnni
#define ISA_NAME "avx512vnni"
#else
#define DPW(acc, w, x) _mm512_add_epi32((acc), _mm512_madd_epi16((w), (x)))
#define ISA_TABLE fs_isa_avx512
#define ISA_NAME "avx512"
#endif

#define LD(p) _mm512_loadu_si512((const void *)(p))

FS_INLINE __m512 half16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
FS_INLINE __m512 u8_16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
FS_INLINE __m512 i8_16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
FS_INLINE __m512i pair(const int16_t *v) { /* broadcast (v[0], v[1]) */
    int32_t x;
    memcpy(&x, v, sizeof x);
    return _mm512_set1_epi32(x);
}

/* one 64-byte chunk of nibble words -> 4 vectors of int16 pairs */
FS_INLINE void nibbles(const uint8_t *p, int sign, __m512i *w) {
    const __m512i c = LD(p);
    if (sign) {
        w[0] = _mm512_srai_epi16(_mm512_slli_epi16(c, 12), 12);
        w[1] = _mm512_srai_epi16(_mm512_slli_epi16(c, 8), 12);
        w[2] = _mm512_srai_epi16(_mm512_slli_epi16(c, 4), 12);
        w[3] = _mm512_srai_epi16(c, 12);
    } else {
        const __m512i m = _mm512_set1_epi16(15);
        w[0] = _mm512_and_si512(c, m);
        w[1] = _mm512_and_si512(_mm512_srli_epi16(c, 4), m);
        w[2] = _mm512_and_si512(_mm512_srli_epi16(c, 8), m);
        w[3] = _mm512_srli_epi16(c, 12);
    }
}

/* Block b's pieces: scales (dw for each 16-column half, mw) and where its integer weights start. */
typedef struct blk {
    __m512 dw0, dw1, mw;
    const uint8_t *q; /* nibbles / bytes */
    const uint8_t *h; /* high bits */
} blk;

FS_INLINE blk block(const int T, const uint8_t *pw, int64_t b) {
    blk k;
    const int pb = T == FS_Q4_K ? 2368 : T == FS_Q5_K ? 2880 : T == FS_Q6_K ? 3360 : 0;
    if (pb) { /* K-quants: super-block b / 8, sub-block s */
        const uint8_t *base = pw + (b / 8) * pb;
        const int s = (int)(b % 8);
        const __m512 d = half16(base);
        if (T == FS_Q6_K) {
            k.dw0 = _mm512_mul_ps(d, i8_16(base + 32 + 16 * (2 * s)));
            k.dw1 = _mm512_mul_ps(d, i8_16(base + 32 + 16 * (2 * s + 1)));
            k.mw = _mm512_setzero_ps();
            k.q = base + 288 + 384 * s;
            k.h = k.q + 256;
        } else {
            const __m512 ndmin = _mm512_sub_ps(_mm512_setzero_ps(), half16(base + 32));
            k.dw0 = k.dw1 = _mm512_mul_ps(d, u8_16(base + 64 + 16 * s));
            k.mw = _mm512_mul_ps(ndmin, u8_16(base + 192 + 16 * s));
            k.q = base + 320 + (T == FS_Q4_K ? 256 : 320) * s;
            k.h = k.q + 256;
        }
        return k;
    }
    const int bytes = T == FS_Q4_0 ? 288 : T == FS_Q4_1 ? 320 : T == FS_Q5_0 ? 352 : T == FS_Q5_1 ? 384 : 544;
    const uint8_t *base = pw + b * bytes;
    const int asym = T == FS_Q4_1 || T == FS_Q5_1;
    k.dw0 = k.dw1 = half16(base);
    k.mw = asym ? half16(base + 32) : _mm512_setzero_ps();
    k.q = base + (asym ? 64 : 32);
    k.h = k.q + 256;
    return k;
}

/* The 4 weight vectors of chunk c (k-pairs j = 4c .. 4c+3) of block k. */
FS_INLINE void unpack(const int T, const blk *k, int c, __m512i *w) {
    if (T == FS_Q8_0) {
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++)
            w[t] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(k->q + 32 * (4 * c + t))));
        return;
    }
    nibbles(k->q + 64 * c, T == FS_Q4_0, w);
    if (T == FS_Q5_0 || T == FS_Q5_1 || T == FS_Q5_K) { /* bit 4 of pair j from bit j of the high word */
        const __m512i m = _mm512_set1_epi16(0x10), H = LD(k->h);
        __m512i g = c < 1 ? _mm512_slli_epi16(H, 4) : c < 2 ? H : _mm512_srli_epi16(H, 4 * (c - 1));
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            w[t] = _mm512_ternarylogic_epi32(w[t], g, m, 0xF8); /* w | (g & m) */
            g = _mm512_srli_epi16(g, 1);
        }
    }
    if (T == FS_Q6_K) { /* bits 4..5 of pair j = 8h + t from bits 2t..2t+1 of high chunk h */
        const __m512i m = _mm512_set1_epi16(0x30), H = LD(k->h + 64 * (c / 2));
        __m512i g = c % 2 ? _mm512_srli_epi16(H, 4) : _mm512_slli_epi16(H, 4);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            w[t] = _mm512_ternarylogic_epi32(w[t], g, m, 0xF8);
            g = _mm512_srli_epi16(g, 2);
        }
    }
    if (T == FS_Q5_0 || T == FS_Q6_K) {
        const __m512i off = _mm512_set1_epi16(T == FS_Q5_0 ? 16 : 32);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) w[t] = _mm512_sub_epi16(w[t], off);
    }
}

/* Software prefetch of the panel FS_PREFETCH bytes ahead of block b (the hardware prefetcher alone leaves a
 * single row at ~20 GB/s; with this ~28 GB/s). 4096 streams Gemma 3's 178 MB Q8_0 LM head at one row ~12% faster
 * than 2048 (docs/experiments.md); -DFS_PREFETCH overrides it for such experiments. */
#ifndef FS_PREFETCH
#define FS_PREFETCH 4096
#endif
FS_INLINE void prefetch(const int T, const uint8_t *pw, int64_t b) {
    const int bytes = T == FS_Q4_0 ? 288 : T == FS_Q4_1 ? 320 : T == FS_Q5_0 ? 352 : T == FS_Q5_1 ? 384
                    : T == FS_Q8_0 ? 544 : T == FS_Q4_K ? 296 : T == FS_Q5_K ? 360 : 420; /* per 32 columns */
    const char *p = (const char *)pw + b * bytes + FS_PREFETCH;
#pragma GCC unroll 9
    for (int off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

/* int partial sums per activation row: enough independent vpdpwssd chains (~16) to hide its latency */
#define NPART(R) ((R) <= 2 ? 4 : (R) <= 4 ? 2 : 1)

/* acc[i] += float part of one block (or 16-column half, Q6_K) for rows i < R */
FS_INLINE void block_float(const int T, const int R, __m512i (*dot)[4], const int np, __m512 dw, __m512 mw,
                           const float *d, const float *dv, __m512 *acc) {
    const int asym = T == FS_Q4_1 || T == FS_Q5_1 || T == FS_Q4_K || T == FS_Q5_K;
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) {
        __m512i sum = dot[i][0];
#pragma GCC unroll 4
        for (int p = 1; p < np; p++) sum = _mm512_add_epi32(sum, dot[i][p]);
        if (asym) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dv[i]), acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(d[i])), acc[i]);
    }
}

/* R activation rows [r0, r0 + R) x one panel. */
FS_INLINE void tile_quant(const int T, const int R, const uint8_t *pw, int64_t nb, const fs_act *a, int64_t r0,
                          float *y, int64_t ldy, __mmask16 lanes) {
    const int np = NPART(R);
    __m512 acc[FS_TILE];
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk k = block(T, pw, b);
        prefetch(T, pw, b);
        const int16_t *v = a->v + (b * a->n + r0) * FS_QB;
        const float *d = a->d + b * a->n + r0, *dv = a->dv + b * a->n + r0;
        __m512i dot[FS_TILE][4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            __m512i w[4];
            unpack(T, &k, c, w);
            const int cc = T == FS_Q6_K ? c % 2 : c; /* Q6_K: each 16-column half sums on its own */
            const int p = cc % np, first = cc < np;
#pragma GCC unroll 16
            for (int i = 0; i < R; i++)
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    const __m512i x = pair(v + FS_QB * i + 2 * (4 * c + t));
                    dot[i][p] = first && t == 0 ? _mm512_madd_epi16(w[t], x) : DPW(dot[i][p], w[t], x);
                }
            if (T == FS_Q6_K && c % 2 == 1) /* a 16-column half done: its own scale, no offset */
                block_float(T, R, dot, np < 2 ? np : 2, c == 1 ? k.dw0 : k.dw1, k.mw, d, dv, acc);
        }
        if (T != FS_Q6_K) block_float(T, R, dot, np, k.dw0, k.mw, d, dv, acc);
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(y + (r0 + i) * ldy, lanes, acc[i]);
}

FS_INLINE __m512 float_weights(const int T, const uint8_t *p) {
    if (T == FS_F32) return _mm512_loadu_ps((const float *)p);
    if (T == FS_F16) return half16(p);
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

FS_INLINE void tile_float(const int T, const int R, const uint8_t *pw, int64_t cols, const float *x, int64_t ldx,
                          float *y, int64_t ldy, __mmask16 lanes) {
    const int es = T == FS_F32 ? 64 : 32;
    __m512 acc[FS_TILE];
    #pragma GCC unroll 16
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < cols; k++) {
        _mm_prefetch((const char *)pw + k * es + FS_PREFETCH, _MM_HINT_T0);
        const __m512 w = float_weights(T, pw + k * es);
        #pragma GCC unroll 16
        for (int i = 0; i < R; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k]), w, acc[i]);
    }
    #pragma GCC unroll 16
    for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(y + i * ldy, lanes, acc[i]);
}

typedef void (*qtile_fn)(const uint8_t *, int64_t, const fs_act *, int64_t, float *, int64_t, __mmask16);
typedef void (*ftile_fn)(const uint8_t *, int64_t, const float *, int64_t, float *, int64_t, __mmask16);

#define QTILE(T, R)                                                                                             \
    static void qt_##T##_##R(const uint8_t *pw, int64_t nb, const fs_act *a, int64_t r0, float *y, int64_t ldy, \
                             __mmask16 lanes) {                                                                 \
        tile_quant(T, R, pw, nb, a, r0, y, ldy, lanes);                                                         \
    }
#define QTILES(T) QTILE(T, 1) QTILE(T, 2) QTILE(T, 3) QTILE(T, 4) QTILE(T, 5) QTILE(T, 6) QTILE(T, 7) QTILE(T, 8) \
    static const qtile_fn qt_##T[FS_TILE + 1] = {0, qt_##T##_1, qt_##T##_2, qt_##T##_3, qt_##T##_4,           \
                                                 qt_##T##_5, qt_##T##_6, qt_##T##_7, qt_##T##_8};
#define FTILE(T, R)                                                                                             \
    static void ft_##T##_##R(const uint8_t *pw, int64_t cols, const float *x, int64_t ldx, float *y,            \
                             int64_t ldy, __mmask16 lanes) {                                                    \
        tile_float(T, R, pw, cols, x, ldx, y, ldy, lanes);                                                      \
    }
#define FTILES(T) FTILE(T, 1) FTILE(T, 2) FTILE(T, 3) FTILE(T, 4) FTILE(T, 5) FTILE(T, 6) FTILE(T, 7) FTILE(T, 8) \
    static const ftile_fn ft_##T[FS_TILE + 1] = {0, ft_##T##_1, ft_##T##_2, ft_##T##_3, ft_##T##_4,           \
                                                 ft_##T##_5, ft_##T##_6, ft_##T##_7, ft_##T##_8};

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

static const ftile_fn *ftiles(int type) {
    return type == FS_F32 ? ft_FS_F32 : type == FS_F16 ? ft_FS_F16 : ft_FS_BF16;
}

static void mm_avx512(const fs_mm *m, int64_t p0, int64_t p1, int64_t r0, int64_t r1) {
    const fs_traits *t = fs_traits_of(m->type);
    const int64_t panel_bytes = m->cols / t->qk * t->pb;
    const qtile_fn *qt = t->is_float ? NULL : qtiles(m->type);
    const ftile_fn *ft = t->is_float ? ftiles(m->type) : NULL;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t left = m->rows - p * FS_PANEL;
        const __mmask16 lanes = (__mmask16)(left >= FS_PANEL ? 0xFFFF : (1u << left) - 1);
        const uint8_t *pw = m->w + p * panel_bytes;
        for (int64_t r = r0; r < r1; r += FS_TILE) {
            const int R = (int)(r1 - r < FS_TILE ? r1 - r : FS_TILE);
            float *y = m->y + p * FS_PANEL;
            if (qt)
                qt[R](pw, m->cols / FS_QB, m->a, r, y, m->ldy, lanes);
            else
                ft[R](pw, m->cols, m->x + r * m->ldx, m->ldx, y + r * m->ldy, m->ldy, lanes);
        }
    }
}

const fs_isa_impl ISA_TABLE = {
    ISA_NAME, mm_avx512, avx512_quantize_row, avx512_rmsnorm_row, avx512_attend, avx512_silu_mul, avx512_gelu_mul,
};
