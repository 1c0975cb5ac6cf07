/* The NEON matmul (aarch64: Raspberry Pi 4/5, Jetson; NEON is baseline there, no flags). A 128-bit register has
 * 4 int32 lanes, so a 16-row panel runs as four 4-lane quarters (each reads its own 16 bytes of every 64-byte
 * chunk: the packed layout is the AVX-512 one). An int16 pair vector [lane][k, k+1] times a broadcast activation
 * pair goes through vmlal_s16 / vmlal_high_s16 into two int32 accumulators whose pairwise sum (vpaddq) is the
 * per-lane dot; then the fixed float sequence of fs_internal.h per block. Tiles of up to 4 rows. */
#if defined(__aarch64__)
#include <arm_neon.h>

#include "fs_internal.h"
#include "ops_impl.h"

#define TILEN 4

FS_INLINE float32x4_t half4(const uint8_t *p) { return vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(p))); }
FS_INLINE uint16x8_t bytes4_u16(const uint8_t *p) {
    uint32_t x;
    memcpy(&x, p, sizeof x);
    return vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(x)));
}
FS_INLINE float32x4_t u8_4(const uint8_t *p) { return vcvtq_f32_u32(vmovl_u16(vget_low_u16(bytes4_u16(p)))); }
FS_INLINE float32x4_t i8_4(const uint8_t *p) {
    const int16x8_t s = vreinterpretq_s16_u16(vshlq_n_u16(bytes4_u16(p), 8));
    return vcvtq_f32_s32(vmovl_s16(vshr_n_s16(vget_low_s16(s), 8))); /* sign-extend the bytes */
}
FS_INLINE int16x8_t pair(const int16_t *v) {
    int32_t x;
    memcpy(&x, v, sizeof x);
    return vreinterpretq_s16_s32(vdupq_n_s32(x));
}

/* 16 bytes of nibble words (4 lanes) -> 4 vectors of int16 pairs */
FS_INLINE void nibbles(const uint8_t *p, int sign, int16x8_t *w) {
    const uint16x8_t c = vld1q_u16((const uint16_t *)p);
    if (sign) {
        const int16x8_t s = vreinterpretq_s16_u16(c);
        w[0] = vshrq_n_s16(vshlq_n_s16(s, 12), 12);
        w[1] = vshrq_n_s16(vshlq_n_s16(s, 8), 12);
        w[2] = vshrq_n_s16(vshlq_n_s16(s, 4), 12);
        w[3] = vshrq_n_s16(s, 12);
    } else {
        const uint16x8_t m = vdupq_n_u16(15);
        w[0] = vreinterpretq_s16_u16(vandq_u16(c, m));
        w[1] = vreinterpretq_s16_u16(vandq_u16(vshrq_n_u16(c, 4), m));
        w[2] = vreinterpretq_s16_u16(vandq_u16(vshrq_n_u16(c, 8), m));
        w[3] = vreinterpretq_s16_u16(vshrq_n_u16(c, 12));
    }
}

typedef struct blk {
    float32x4_t dw0, dw1, mw;
    const uint8_t *q, *h;
} blk;

/* block b of quarter qt (lanes 4qt .. 4qt+3) */
FS_INLINE blk block(const int T, const uint8_t *pw, int64_t b, int qt) {
    blk k;
    const int pb = T == FS_Q4_K ? 2368 : T == FS_Q5_K ? 2880 : T == FS_Q6_K ? 3360 : 0;
    const int l0 = 4 * qt;
    if (pb) {
        const uint8_t *base = pw + (b / 8) * pb;
        const int s = (int)(b % 8);
        const float32x4_t d = half4(base + 2 * l0);
        if (T == FS_Q6_K) {
            k.dw0 = vmulq_f32(d, i8_4(base + 32 + 16 * (2 * s) + l0));
            k.dw1 = vmulq_f32(d, i8_4(base + 32 + 16 * (2 * s + 1) + l0));
            k.mw = vdupq_n_f32(0.0f);
            k.q = base + 288 + 384 * s;
        } else {
            const float32x4_t ndmin = vnegq_f32(half4(base + 32 + 2 * l0));
            k.dw0 = k.dw1 = vmulq_f32(d, u8_4(base + 64 + 16 * s + l0));
            k.mw = vmulq_f32(ndmin, u8_4(base + 192 + 16 * s + l0));
            k.q = base + 320 + (T == FS_Q4_K ? 256 : 320) * s;
        }
        k.h = k.q + 256;
        return k;
    }
    const int bytes = T == FS_Q4_0 ? 288 : T == FS_Q4_1 ? 320 : T == FS_Q5_0 ? 352 : T == FS_Q5_1 ? 384 : 544;
    const uint8_t *base = pw + b * bytes;
    const int asym = T == FS_Q4_1 || T == FS_Q5_1;
    k.dw0 = k.dw1 = half4(base + 2 * l0);
    k.mw = asym ? half4(base + 32 + 2 * l0) : vdupq_n_f32(0.0f);
    k.q = base + (asym ? 64 : 32);
    k.h = k.q + 256;
    return k;
}

FS_INLINE int16x8_t or_masked(int16x8_t w, uint16x8_t g, uint16x8_t m) {
    return vreinterpretq_s16_u16(vorrq_u16(vreinterpretq_u16_s16(w), vandq_u16(g, m)));
}

FS_INLINE void unpack(const int T, const blk *k, int c, int qt, int16x8_t *w) {
    if (T == FS_Q8_0) {
        for (int t = 0; t < 4; t++) w[t] = vmovl_s8(vld1_s8((const int8_t *)(k->q + 32 * (4 * c + t) + 8 * qt)));
        return;
    }
    nibbles(k->q + 64 * c + 16 * qt, T == FS_Q4_0, w);
    if (T == FS_Q5_0 || T == FS_Q5_1 || T == FS_Q5_K) {
        const uint16x8_t m = vdupq_n_u16(0x10), H = vld1q_u16((const uint16_t *)(k->h + 16 * qt));
        uint16x8_t g = c == 0 ? vshlq_n_u16(H, 4) : c == 1 ? H : c == 2 ? vshrq_n_u16(H, 4) : vshrq_n_u16(H, 8);
        for (int t = 0; t < 4; t++) {
            w[t] = or_masked(w[t], g, m);
            g = vshrq_n_u16(g, 1);
        }
    }
    if (T == FS_Q6_K) {
        const uint16x8_t m = vdupq_n_u16(0x30), H = vld1q_u16((const uint16_t *)(k->h + 64 * (c / 2) + 16 * qt));
        uint16x8_t g = c % 2 ? vshrq_n_u16(H, 4) : vshlq_n_u16(H, 4);
        for (int t = 0; t < 4; t++) {
            w[t] = or_masked(w[t], g, m);
            g = vshrq_n_u16(g, 2);
        }
    }
    if (T == FS_Q5_0 || T == FS_Q6_K) {
        const int16x8_t off = vdupq_n_s16(T == FS_Q5_0 ? 16 : 32);
        for (int t = 0; t < 4; t++) w[t] = vsubq_s16(w[t], off);
    }
}

FS_INLINE void block_float(const int T, const int R, const int32x4_t *lo, const int32x4_t *hi, float32x4_t dw,
                           float32x4_t mw, const float *d, const float *dv, float32x4_t *acc) {
    const int asym = T == FS_Q4_1 || T == FS_Q5_1 || T == FS_Q4_K || T == FS_Q5_K;
    for (int i = 0; i < R; i++) {
        const int32x4_t dot = vpaddq_s32(lo[i], hi[i]);
        if (asym) acc[i] = vfmaq_f32(acc[i], mw, vdupq_n_f32(dv[i]));
        acc[i] = vfmaq_f32(acc[i], vcvtq_f32_s32(dot), vmulq_f32(dw, vdupq_n_f32(d[i])));
    }
}

FS_INLINE void store4(float *y, float32x4_t v, int lanes) {
    if (lanes >= 4) {
        vst1q_f32(y, v);
    } else {
        float tmp[4];
        vst1q_f32(tmp, v);
        for (int l = 0; l < lanes; l++) y[l] = tmp[l];
    }
}

FS_INLINE void tile_quant(const int T, const int R, const uint8_t *pw, int qt, int64_t nb, const fs_act *a,
                          int64_t r0, float *y, int64_t ldy, int lanes) {
    float32x4_t acc[TILEN];
    int32x4_t lo[TILEN], hi[TILEN]; /* the int dot of each row, in two halves */
    for (int i = 0; i < R; i++) {
        acc[i] = vdupq_n_f32(0.0f);
        lo[i] = hi[i] = vdupq_n_s32(0);
    }
    for (int64_t b = 0; b < nb; b++) {
        const blk k = block(T, pw, b, qt);
        const int16_t *v = a->v + (b * a->n + r0) * FS_QB;
        const float *d = a->d + b * a->n + r0, *dv = a->dv + b * a->n + r0;
        for (int c = 0; c < 4; c++) {
            int16x8_t w[4];
            unpack(T, &k, c, qt, w);
            const int first = T == FS_Q6_K ? c % 2 == 0 : c == 0;
            for (int i = 0; i < R; i++)
                for (int t = 0; t < 4; t++) {
                    const int16x8_t x = pair(v + FS_QB * i + 2 * (4 * c + t));
                    if (first && t == 0) {
                        lo[i] = vmull_s16(vget_low_s16(w[t]), vget_low_s16(x));
                        hi[i] = vmull_high_s16(w[t], x);
                    } else {
                        lo[i] = vmlal_s16(lo[i], vget_low_s16(w[t]), vget_low_s16(x));
                        hi[i] = vmlal_high_s16(hi[i], w[t], x);
                    }
                }
            if (T == FS_Q6_K && c % 2 == 1) block_float(T, R, lo, hi, c == 1 ? k.dw0 : k.dw1, k.mw, d, dv, acc);
        }
        if (T != FS_Q6_K) block_float(T, R, lo, hi, k.dw0, k.mw, d, dv, acc);
    }
    for (int i = 0; i < R; i++) store4(y + (r0 + i) * ldy + 4 * qt, acc[i], lanes);
}

FS_INLINE float32x4_t float_weights(const int T, const uint8_t *p) {
    if (T == FS_F32) return vld1q_f32((const float *)p);
    if (T == FS_F16) return half4(p);
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)p), 16));
}

FS_INLINE void tile_float(const int T, const int R, const uint8_t *pw, int qt, int64_t cols, const float *x,
                          int64_t ldx, float *y, int64_t ldy, int lanes) {
    const int es = T == FS_F32 ? 64 : 32;
    float32x4_t acc[TILEN];
    for (int i = 0; i < R; i++) acc[i] = vdupq_n_f32(0.0f);
    for (int64_t k = 0; k < cols; k++) {
        const float32x4_t w = float_weights(T, pw + k * es + es / 4 * qt);
        for (int i = 0; i < R; i++) acc[i] = vfmaq_f32(acc[i], vdupq_n_f32(x[i * ldx + k]), w);
    }
    for (int i = 0; i < R; i++) store4(y + i * ldy + 4 * qt, acc[i], lanes);
}

typedef void (*qtile_fn)(const uint8_t *, int, int64_t, const fs_act *, int64_t, float *, int64_t, int);
typedef void (*ftile_fn)(const uint8_t *, int, int64_t, const float *, int64_t, float *, int64_t, int);

#define QTILE(T, R)                                                                                             \
    static void qt_##T##_##R(const uint8_t *pw, int qt, int64_t nb, const fs_act *a, int64_t r0, float *y,      \
                             int64_t ldy, int lanes) {                                                          \
        tile_quant(T, R, pw, qt, nb, a, r0, y, ldy, lanes);                                                     \
    }
#define QTILES(T) QTILE(T, 1) QTILE(T, 2) QTILE(T, 3) QTILE(T, 4) \
    static const qtile_fn qt_##T[TILEN + 1] = {0, qt_##T##_1, qt_##T##_2, qt_##T##_3, qt_##T##_4};
#define FTILE(T, R)                                                                                             \
    static void ft_##T##_##R(const uint8_t *pw, int qt, int64_t cols, const float *x, int64_t ldx, float *y,    \
                             int64_t ldy, int lanes) {                                                          \
        tile_float(T, R, pw, qt, cols, x, ldx, y, ldy, lanes);                                                  \
    }
#define FTILES(T) FTILE(T, 1) FTILE(T, 2) FTILE(T, 3) FTILE(T, 4) \
    static const ftile_fn ft_##T[TILEN + 1] = {0, ft_##T##_1, ft_##T##_2, ft_##T##_3, ft_##T##_4};

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

static void mm_neon(const fs_mm *m, int64_t p0, int64_t p1, int64_t r0, int64_t r1) {
    const fs_traits *t = fs_traits_of(m->type);
    const int64_t panel_bytes = m->cols / t->qk * t->pb;
    const qtile_fn *qtf = t->is_float ? NULL : qtiles(m->type);
    const ftile_fn *ft = m->type == FS_F32 ? ft_FS_F32 : m->type == FS_F16 ? ft_FS_F16 : ft_FS_BF16;
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *pw = m->w + p * panel_bytes;
        for (int qt = 0; qt < 4; qt++) {
            const int64_t left = m->rows - p * FS_PANEL - 4 * qt;
            if (left <= 0) break;
            const int lanes = left >= 4 ? 4 : (int)left;
            for (int64_t r = r0; r < r1; r += TILEN) {
                const int R = (int)(r1 - r < TILEN ? r1 - r : TILEN);
                float *y = m->y + p * FS_PANEL;
                if (qtf)
                    qtf[R](pw, qt, m->cols / FS_QB, m->a, r, y, m->ldy, lanes);
                else
                    ft[R](pw, qt, m->cols, m->x + r * m->ldx, m->ldx, y + r * m->ldy, m->ldy, lanes);
            }
        }
    }
}

const fs_isa_impl fs_isa_neon = {
    "neon", mm_neon, fs_op_quantize_row, fs_op_rmsnorm_row, fs_op_attend, fs_op_silu_mul, fs_op_gelu_mul,
};
#else
typedef int fs_neon_unused; /* an empty translation unit elsewhere */
#endif
