/* AVX-512 versions of the layer ops of ops_impl.h, computing the same bits (the same float operations in the
 * same order; only the order of exact operations, such as max, differs). Included by kern_avx512.c.
 *
 * The attention scores of 16 slots are reduced together: each slot's 16 lane partials (lane l: head elements
 * i = l mod 16) go through fs_reduce16's tree (a[l] += a[l + w], w = 8, 4, 2, 1) as four levels of shuffles and
 * adds over 16 registers, ending with the 16 scores in one register. */
#ifndef FS_OPS_AVX512_H
#define FS_OPS_AVX512_H

#include <immintrin.h>

#include "ops_impl.h"

/* fs_reduce16 of one register */
FS_INLINE float tree1(__m512 a) {
    const __m256 b = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    const __m128 d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

/* fs_reduce16 of a[0..15] -> the 16 results, in order */
FS_INLINE __m512 tree16(const __m512 *a) {
    __m512 c[8], d[4], g[2];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE));
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)
        d[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD));
#pragma GCC unroll 2
    for (int j = 0; j < 2; j++)
        g[j] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * j], d[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(d[2 * j], d[2 * j + 1], 0xEE));
    const __m512 h = _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, h); /* lane 4k + m of h is slot 4m + k */
}

FS_INLINE __m512 exp16(__m512 x) {
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-64.0f), _CMP_NLT_UQ); /* not x < -64 */
    x = _mm512_min_ps(_mm512_set1_ps(88.0f), x);
    const __m512 nf = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), magic),
                                    magic);
    __m512 r = _mm512_fmadd_ps(nf, _mm512_set1_ps(-0.693145751953125f), x);
    r = _mm512_fmadd_ps(nf, _mm512_set1_ps(-1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(nf), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(bits)));
}

FS_INLINE __mmask16 first(int64_t count) { return (__mmask16)(count >= 16 ? 0xFFFF : (1u << count) - 1); }

static void avx512_quantize_row(const float *x, int64_t r, fs_act *a) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < a->cols / FS_QB; b++) {
        const int64_t bi = b * a->n + r;
        const __m512 x0 = _mm512_loadu_ps(x + b * FS_QB), x1 = _mm512_loadu_ps(x + b * FS_QB + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, sign), _mm512_and_ps(x1, sign)));
        int16_t *v = a->v + bi * FS_QB;
        if (!(amax > 0.0f)) {
            _mm512_storeu_si512(v, _mm512_setzero_si512());
            a->d[bi] = a->dv[bi] = 0.0f;
            continue;
        }
        const __m512 inv = _mm512_set1_ps(32767.0f / amax), lim = _mm512_set1_ps(32767.0f);
        const __m512 nlim = _mm512_set1_ps(-32767.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(x0, inv), lim), nlim));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(x1, inv), lim), nlim));
        _mm256_storeu_si256((__m256i *)v, _mm512_cvtepi32_epi16(q0));
        _mm256_storeu_si256((__m256i *)(v + 16), _mm512_cvtepi32_epi16(q1));
        a->d[bi] = amax / 32767.0f;
        a->dv[bi] = a->d[bi] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

static void avx512_rmsnorm_row(const float *x, const float *w, int64_t dim, float eps, float *out) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 m = first(dim - i);
        const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        acc = _mm512_mask3_fmadd_ps(v, v, acc, m);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(tree1(acc) / (float)dim + eps));
    for (int64_t i = 0; i < dim; i += 16) {
        const __mmask16 m = first(dim - i);
        const __m512 xr = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), r);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(xr, _mm512_maskz_loadu_ps(m, w + i)));
    }
}

static void avx512_silu_mul(float *g, const float *u, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f), neg = _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = first(n - i);
        const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_xor_ps(x, neg))));
        _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
}

static void avx512_gelu_mul(float *g, const float *u, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f), neg = _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u));
    const __m512 a = _mm512_set1_ps(FS_GELU_A), c = _mm512_set1_ps(FS_GELU_2C);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = first(n - i);
        const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        const __m512 t = _mm512_mul_ps(c, _mm512_add_ps(x, _mm512_mul_ps(a, x3)));
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_xor_ps(t, neg))));
        _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
}

/* slots [s0, s0 + count) of one kv head: their scores (fs_dot * scale), in order; NQ = hd / 16 */
FS_INLINE __m512 scores16(const int NQ, const __m512 *q, const float *kc, int64_t s0, int count, float scale) {
    __m512 a[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        a[j] = _mm512_setzero_ps();
        if (j < count) {
            const float *k = kc + (s0 + j) * 16 * NQ;
#pragma GCC unroll 16
            for (int c = 0; c < NQ; c++) a[j] = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(k + 16 * c), a[j]);
        }
    }
    return _mm512_mul_ps(tree16(a), _mm512_set1_ps(scale));
}

/* Software prefetch of the 16 cache slots [s, s + 16) of one kv head (none past ``end``): K and V stream from
 * memory once per token, and the hardware prefetcher alone leaves them at ~10 GB/s. */
#define FS_ATT_PREFETCH 32 /* slots ahead */
FS_INLINE void prefetch_slots(const float *c, int64_t s, int64_t end, int hd) {
    if (s >= end) return;
    const int64_t n = (end - s < 16 ? end - s : 16) * hd * (int64_t)sizeof(float);
    const char *p = (const char *)(c + s * hd);
    for (int64_t off = 0; off < n; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

/* visible slots among [s0, s0 + count) for row r, none below lo (its window's first slot) */
FS_INLINE __mmask16 visible(const fs_attn *at, int64_t r, int64_t s0, int64_t count, int64_t lo) {
    const int64_t total = at->start + at->n, limit = at->mask ? total : at->start + r + 1;
    if (s0 >= limit || s0 + count <= lo) return 0;
    __mmask16 m = first(limit - s0 < count ? limit - s0 : count);
    if (lo > s0) m &= (__mmask16)~((1u << (lo - s0)) - 1);
    if (!at->mask) return m;
    return _mm_mask_cmpneq_epi8_mask(m, _mm_maskz_loadu_epi8(m, at->mask + r * total + s0), _mm_setzero_si128());
}

/* o (in st, per pair) += the visible slots of [s0, s0 + 16) for GB pairs of one row, in slot order; each V row
 * feeds the GB pairs' NQ accumulators (independent chains). w: the pairs' weights [GB][16]. */
FS_INLINE void values16(const int NQ, const int GB, const float *vc, int64_t s0, __mmask16 m, const float *w,
                        float *const *st) {
    __m512 o[4][16];
#pragma GCC unroll 4
    for (int g = 0; g < GB; g++)
#pragma GCC unroll 16
        for (int c = 0; c < NQ; c++) o[g][c] = _mm512_loadu_ps(st[g] + 32 + 16 * c);
    for (unsigned bits = m; bits; bits &= bits - 1) {
        const int j = __builtin_ctz(bits);
        const float *v = vc + (s0 + j) * 16 * NQ;
        __m512 vr[16];
#pragma GCC unroll 16
        for (int c = 0; c < NQ; c++) vr[c] = _mm512_loadu_ps(v + 16 * c);
#pragma GCC unroll 4
        for (int g = 0; g < GB; g++) {
            const __m512 wj = _mm512_set1_ps(w[16 * g + j]);
#pragma GCC unroll 16
            for (int c = 0; c < NQ; c++) o[g][c] = _mm512_fmadd_ps(wj, vr[c], o[g][c]);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < GB; g++)
#pragma GCC unroll 16
        for (int c = 0; c < NQ; c++) _mm512_storeu_ps(st[g] + 32 + 16 * c, o[g][c]);
}

/* Rows [r0, r1) x the q heads of kv head kvh, pair p = (r - r0) * group + g. Pass 1: each 16-slot block of K
 * serves every pair (scores, running max); pass 2: each block of V (weights, denominator lanes, output). State
 * per pair in scratch: max[16], denominator lanes[16], output[hd]. The denominator lanes follow the visible
 * keys' count, not their slots (as fs_op_attend1): a block's visible weights are compressed and rotated onto the
 * lanes after the ones already used, so a row's result does not depend on where its keys sit in the cache. */
FS_INLINE void attend_nq(const int NQ, const fs_attn *at, int kvh, int64_t r0, int64_t r1, int thread) {
    const int GB = NQ <= 4 ? 4 : NQ <= 8 ? 2 : 1; /* pairs per V pass: GB * NQ accumulators */
    const int hd = 16 * NQ, G = at->group, np = (int)(r1 - r0) * G;
    const int64_t ps = 32 + hd;
    float *sc = at->scratch + thread * at->thread_stride, *state = sc + np * at->ld_scores;
    const float *kc = at->kc + (int64_t)kvh * at->capacity * hd, *vc = at->vc + (int64_t)kvh * at->capacity * hd;
    const int64_t end = at->mask ? at->start + at->n : at->start + r1;
    for (int p = 0; p < np; p++) {
        _mm512_storeu_ps(state + p * ps, _mm512_set1_ps(-INFINITY));
        _mm512_storeu_ps(state + p * ps + 16, _mm512_setzero_ps());
        for (int c = 0; c < NQ; c++) _mm512_storeu_ps(state + p * ps + 32 + 16 * c, _mm512_setzero_ps());
    }
    int any[FS_ATT_ROWS] = {0};
    int used[FS_ATT_ROWS] = {0}; /* visible slots so far per row, mod 16: the next denominator lane */
    int64_t lo[FS_ATT_ROWS], first_slot = end; /* each row's window start; the blocks begin at the lowest */
    for (int64_t r = r0; r < r1; r++) {
        lo[r - r0] = fs_window_lo(at, r);
        first_slot = lo[r - r0] < first_slot ? lo[r - r0] : first_slot;
    }
    const int64_t begin = first_slot / 16 * 16;
    for (int64_t s0 = begin; s0 < end; s0 += 16) {
        const int count = (int)(end - s0 < 16 ? end - s0 : 16);
        prefetch_slots(kc, s0 + FS_ATT_PREFETCH, end, hd);
        for (int64_t r = r0; r < r1; r++) {
            const __mmask16 m = visible(at, r, s0, count, lo[r - r0]);
            if (!m) continue;
            any[r - r0] = 1;
            for (int g = 0; g < G; g++) {
                const int p = (int)(r - r0) * G + g;
                const float *qp = at->q + (r * at->q_heads + kvh * G + g) * hd;
                __m512 q[16];
#pragma GCC unroll 16
                for (int c = 0; c < NQ; c++) q[c] = _mm512_loadu_ps(qp + 16 * c);
                const __m512 s = scores16(NQ, q, kc, s0, count, at->scale);
                _mm512_mask_storeu_ps(sc + p * at->ld_scores + s0, m, s);
                const __m512 mx = _mm512_loadu_ps(state + p * ps);
                _mm512_storeu_ps(state + p * ps, _mm512_mask_max_ps(mx, m, mx, s));
            }
        }
    }
    for (int p = 0; p < np; p++) /* the max over lanes, in every lane */
        _mm512_storeu_ps(state + p * ps, _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_loadu_ps(state + p * ps))));
    for (int64_t s0 = begin; s0 < end; s0 += 16) {
        const int count = (int)(end - s0 < 16 ? end - s0 : 16);
        prefetch_slots(vc, s0 + FS_ATT_PREFETCH, end, hd);
        for (int64_t r = r0; r < r1; r++) {
            const __mmask16 m = visible(at, r, s0, count, lo[r - r0]);
            if (!m) continue;
            const int off = used[r - r0], k = __builtin_popcount(m);
            used[r - r0] = (off + k) % 16;
            /* lanes off, off + 1, ... (mod 16) get the block's k visible weights, in order */
            const __m512i rot = _mm512_and_si512(_mm512_sub_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(off)), _mm512_set1_epi32(15));
            const __mmask16 lanes = (__mmask16)((((1u << k) - 1) << off | ((1u << k) - 1) >> (16 - off)) & 0xFFFF);
            for (int g0 = 0; g0 < G; g0 += GB) {
                float w[4 * 16], *st[4];
                const int gb = G - g0 < GB ? G - g0 : GB;
                for (int g = 0; g < gb; g++) {
                    const int p = (int)(r - r0) * G + g0 + g;
                    st[g] = state + p * ps;
                    const __m512 pv = _mm512_maskz_mov_ps(
                        m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + p * at->ld_scores + s0),
                                               _mm512_loadu_ps(st[g]))));
                    _mm512_storeu_ps(w + 16 * g, pv);
                    const __m512 lanes_pv = _mm512_permutexvar_ps(rot, _mm512_maskz_compress_ps(m, pv));
                    const __m512 den = _mm512_loadu_ps(st[g] + 16);
                    _mm512_storeu_ps(st[g] + 16, _mm512_mask_add_ps(den, lanes, den, lanes_pv));
                }
                switch (gb) {
                case 1: values16(NQ, 1, vc, s0, m, w, st); break;
                case 2: values16(NQ, 2, vc, s0, m, w, st); break;
                case 3: values16(NQ, 3, vc, s0, m, w, st); break;
                default: values16(NQ, NQ <= 4 ? 4 : 2, vc, s0, m, w, st); break; /* gb == GB */
                }
            }
        }
    }
    for (int64_t r = r0; r < r1; r++)
        for (int g = 0; g < G; g++) {
            const float *st = state + ((int)(r - r0) * G + g) * ps;
            float *out = at->out + (r * at->q_heads + kvh * G + g) * hd;
            const __m512 denom = _mm512_set1_ps(any[r - r0] ? tree1(_mm512_loadu_ps(st + 16)) : 1.0f);
            for (int c = 0; c < NQ; c++)
                _mm512_storeu_ps(out + 16 * c, _mm512_div_ps(_mm512_loadu_ps(st + 32 + 16 * c), denom));
        }
}

static void avx512_attend(const fs_attn *at, int kvh, int64_t r0, int64_t r1, int thread) {
    switch (at->hd) {
    case 16: attend_nq(1, at, kvh, r0, r1, thread); break;
    case 32: attend_nq(2, at, kvh, r0, r1, thread); break;
    case 64: attend_nq(4, at, kvh, r0, r1, thread); break;
    case 128: attend_nq(8, at, kvh, r0, r1, thread); break;
    case 256: attend_nq(16, at, kvh, r0, r1, thread); break; /* Gemma 3 */
    default: fs_op_attend(at, kvh, r0, r1, thread); /* other head sizes: the plain C definition */
    }
}

#endif
