/* Weight formats: GGUF blocks -> the kernels' panel layout (fs_pack), and back to float32 (fs_dequant_rows,
 * bit-identical to ggml's dequantize_row_*).
 *
 * A packed matrix is ceil(rows / 16) panels, one after another; a panel holds 16 consecutive output rows
 * (zero-padded past `rows`) and is a run of panel-blocks, one per GGUF block column (32 columns, or 256 for the
 * K-quants). Inside a panel-block everything is lane-major so one 512-bit load serves the 16 rows:
 *
 *   scales   fp16 d[16] (and fp16 m[16] / dmin[16]); K-quants also u8 sc[8][16], u8 mn[8][16] (Q4_K/Q5_K) or
 *            i8 sc[16][16] (Q6_K): ggml's 6-bit packed scales are unpacked to bytes (+2.8% for Q4_K).
 *   nibbles  per 32-column (sub-)block, 4 chunks of 64 bytes = 32 little-endian uint16 words; word w belongs to
 *            lane w/2 and holds columns k = 2*(4c+t) + (w&1) in its nibbles t = 0..3. So one shift+mask of a
 *            chunk gives, for k-pair j = 4c+t, the (k, k+1) int16 pair of every lane: the operand of a
 *            vpdpwssd / vpmaddwd against a broadcast pair of int16 activations.
 *            Q4_0 stores q ^ 8 (the two's complement nibble of q - 8, sign-extended by shifts).
 *   high     Q5_*: 64 bytes = 32 words, bit j of word w = bit 4 of column 2j + (w&1).
 *            Q6_K: 2 chunks of 32 words, bits 2t..2t+1 of word w in chunk c = bits 4..5 of column 2(8c+t)+(w&1).
 *   Q8_0     16 x 32 bytes: byte 32j + 2*lane + h = q[lane][2j + h] (vpmovsxbw gives the pairs directly).
 *   floats   F32 / F16 / BF16: [cols][16] elements per panel.
 * Packed sizes equal the GGUF sizes except K-quants (+2.3-2.8%) and the zero rows padding the last panel. */
#include <stdlib.h>

#include "fs_internal.h"

static const fs_traits TRAITS[] = {
    /* type     qk   gguf  pb   asym float */
    {FS_F32,    1,   4,    64,   0, 1},
    {FS_F16,    1,   2,    32,   0, 1},
    {FS_BF16,   1,   2,    32,   0, 1},
    {FS_Q4_0,   32,  18,   288,  0, 0},
    {FS_Q4_1,   32,  20,   320,  1, 0},
    {FS_Q5_0,   32,  22,   352,  0, 0},
    {FS_Q5_1,   32,  24,   384,  1, 0},
    {FS_Q8_0,   32,  34,   544,  0, 0},
    {FS_Q4_K,   256, 144,  2368, 1, 0},
    {FS_Q5_K,   256, 176,  2880, 1, 0},
    {FS_Q6_K,   256, 210,  3360, 0, 0},
};

const fs_traits *fs_traits_of(int type) {
    for (size_t i = 0; i < sizeof TRAITS / sizeof TRAITS[0]; i++)
        if (TRAITS[i].type == type) return &TRAITS[i];
    return NULL;
}

int64_t fs_panels(int64_t rows) { return (rows + FS_PANEL - 1) / FS_PANEL; }

int64_t fs_packed_size(int type, int64_t rows, int64_t cols) {
    const fs_traits *t = fs_traits_of(type);
    if (t == NULL) return FS_ETYPE;
    if (rows <= 0 || cols <= 0 || cols % t->qk != 0 || (!t->is_float && cols % FS_QB != 0)) return FS_ESHAPE;
    return fs_panels(rows) * (cols / t->qk) * t->pb;
}

/* ---- GGUF block -> raw fields ---------------------------------------------------------------------------- */

/* One GGUF block's contents: q are the stored unsigned integers (Q8_0: int8 bits), scales as stored. */
typedef struct raw_block {
    uint8_t q[256];
    uint16_t d, m;          /* fp16 bits: d and m (Q4_1/Q5_1) or dmin (Q4_K/Q5_K) */
    uint8_t sc[16], mn[8];  /* K-quant sub-block scales and mins (Q6_K: int8 bits) */
} raw_block;

static void k4_scale_min(int j, const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *mn = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

static void nibbles32(const uint8_t *qs, uint8_t *q) { /* ggml's 32-element nibble order */
    for (int l = 0; l < 16; l++) {
        q[l] = qs[l] & 15;
        q[l + 16] = qs[l] >> 4;
    }
}

static void read_raw(int type, const uint8_t *b, raw_block *r) {
    switch (type) {
    case FS_Q4_0:
        r->d = fs_rd16(b);
        nibbles32(b + 2, r->q);
        break;
    case FS_Q4_1:
        r->d = fs_rd16(b);
        r->m = fs_rd16(b + 2);
        nibbles32(b + 4, r->q);
        break;
    case FS_Q5_0:
    case FS_Q5_1: {
        const int off = type == FS_Q5_0 ? 2 : 4;
        r->d = fs_rd16(b);
        r->m = type == FS_Q5_1 ? fs_rd16(b + 2) : 0;
        const uint32_t qh = (uint32_t)b[off] | (uint32_t)b[off + 1] << 8 | (uint32_t)b[off + 2] << 16 |
                            (uint32_t)b[off + 3] << 24;
        nibbles32(b + off + 4, r->q);
        for (int l = 0; l < 32; l++) r->q[l] |= (uint8_t)(((qh >> l) & 1) << 4);
        break;
    }
    case FS_Q8_0:
        r->d = fs_rd16(b);
        memcpy(r->q, b + 2, 32);
        break;
    case FS_Q4_K:
    case FS_Q5_K: {
        r->d = fs_rd16(b);
        r->m = fs_rd16(b + 2);
        for (int j = 0; j < 8; j++) k4_scale_min(j, b + 4, &r->sc[j], &r->mn[j]);
        const uint8_t *qh = b + 16, *qs = type == FS_Q4_K ? b + 16 : b + 48;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                uint8_t lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
                if (type == FS_Q5_K) {
                    lo |= (uint8_t)(((qh[l] >> (2 * c)) & 1) << 4);
                    hi |= (uint8_t)(((qh[l] >> (2 * c + 1)) & 1) << 4);
                }
                r->q[64 * c + l] = lo;
                r->q[64 * c + 32 + l] = hi;
            }
        break;
    }
    case FS_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        memcpy(r->sc, b + 192, 16);
        r->d = fs_rd16(b + 208);
        for (int h = 0; h < 2; h++, ql += 64, qh += 32)
            for (int l = 0; l < 32; l++) {
                uint8_t *q = r->q + 128 * h;
                q[l] = (uint8_t)((ql[l] & 15) | ((qh[l] & 3) << 4));
                q[l + 32] = (uint8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                q[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                q[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        break;
    }
    }
}

/* ---- raw fields of 16 rows -> one panel-block ------------------------------------------------------------- */

static void wr16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* nibbles of columns [k0, k0 + 32) of every lane (xor: 8 for Q4_0's signed nibbles) */
static void put_nibbles(const raw_block *r, int k0, uint8_t x, uint8_t *dst) {
    for (int c = 0; c < 4; c++)
        for (int w = 0; w < 32; w++) {
            uint16_t word = 0;
            for (int t = 0; t < 4; t++)
                word |= (uint16_t)(((r[w / 2].q[k0 + 2 * (4 * c + t) + (w & 1)] & 15) ^ x) << (4 * t));
            wr16(dst + 64 * c + 2 * w, word);
        }
}

static void put_high1(const raw_block *r, int k0, uint8_t *dst) { /* bit 4 of each column */
    for (int w = 0; w < 32; w++) {
        uint16_t word = 0;
        for (int j = 0; j < 16; j++) word |= (uint16_t)(((r[w / 2].q[k0 + 2 * j + (w & 1)] >> 4) & 1) << j);
        wr16(dst + 2 * w, word);
    }
}

static void put_high2(const raw_block *r, int k0, uint8_t *dst) { /* bits 4..5 of each column */
    for (int c = 0; c < 2; c++)
        for (int w = 0; w < 32; w++) {
            uint16_t word = 0;
            for (int t = 0; t < 8; t++)
                word |= (uint16_t)(((r[w / 2].q[k0 + 2 * (8 * c + t) + (w & 1)] >> 4) & 3) << (2 * t));
            wr16(dst + 64 * c + 2 * w, word);
        }
}

static void put_panel_block(int type, const raw_block *r, uint8_t *dst) {
    for (int l = 0; l < FS_PANEL; l++) wr16(dst + 2 * l, r[l].d);
    switch (type) {
    case FS_Q4_0:
        put_nibbles(r, 0, 8, dst + 32);
        break;
    case FS_Q4_1:
        for (int l = 0; l < FS_PANEL; l++) wr16(dst + 32 + 2 * l, r[l].m);
        put_nibbles(r, 0, 0, dst + 64);
        break;
    case FS_Q5_0:
        put_nibbles(r, 0, 0, dst + 32);
        put_high1(r, 0, dst + 288);
        break;
    case FS_Q5_1:
        for (int l = 0; l < FS_PANEL; l++) wr16(dst + 32 + 2 * l, r[l].m);
        put_nibbles(r, 0, 0, dst + 64);
        put_high1(r, 0, dst + 320);
        break;
    case FS_Q8_0:
        for (int j = 0; j < 16; j++)
            for (int l = 0; l < FS_PANEL; l++)
                for (int h = 0; h < 2; h++) dst[32 + 32 * j + 2 * l + h] = r[l].q[2 * j + h];
        break;
    case FS_Q4_K:
    case FS_Q5_K: {
        const int sub = type == FS_Q4_K ? 256 : 320;
        for (int l = 0; l < FS_PANEL; l++) {
            wr16(dst + 32 + 2 * l, r[l].m);
            for (int s = 0; s < 8; s++) {
                dst[64 + 16 * s + l] = r[l].sc[s];
                dst[192 + 16 * s + l] = r[l].mn[s];
            }
        }
        for (int s = 0; s < 8; s++) {
            put_nibbles(r, 32 * s, 0, dst + 320 + sub * s);
            if (type == FS_Q5_K) put_high1(r, 32 * s, dst + 320 + sub * s + 256);
        }
        break;
    }
    case FS_Q6_K:
        for (int l = 0; l < FS_PANEL; l++)
            for (int s = 0; s < 16; s++) dst[32 + 16 * s + l] = r[l].sc[s];
        for (int s = 0; s < 8; s++) {
            put_nibbles(r, 32 * s, 0, dst + 288 + 384 * s);
            put_high2(r, 32 * s, dst + 288 + 384 * s + 256);
        }
        break;
    }
}

int fs_pack(int type, int64_t rows, int64_t cols, const void *src, void *dst) {
    const int64_t size = fs_packed_size(type, rows, cols);
    if (size < 0) return (int)size;
    const fs_traits *t = fs_traits_of(type);
    const uint8_t *s = src;
    uint8_t *d = dst;
    const int64_t nb = cols / t->qk, row_bytes = nb * t->gguf_bytes;
    memset(d, 0, (size_t)size);
    if (t->is_float) { /* [panel][k][16] elements of gguf_bytes */
        const int es = t->gguf_bytes;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t k = 0; k < cols; k++)
                memcpy(d + (((r / FS_PANEL) * cols + k) * FS_PANEL + r % FS_PANEL) * es, s + (r * cols + k) * es,
                       (size_t)es);
        return FS_OK;
    }
    raw_block *raw = calloc(FS_PANEL, sizeof *raw);
    if (raw == NULL) return FS_ENOMEM;
    for (int64_t p = 0; p < fs_panels(rows); p++)
        for (int64_t b = 0; b < nb; b++) {
            memset(raw, 0, FS_PANEL * sizeof *raw);
            for (int l = 0; l < FS_PANEL && p * FS_PANEL + l < rows; l++)
                read_raw(type, s + (p * FS_PANEL + l) * row_bytes + b * t->gguf_bytes, &raw[l]);
            put_panel_block(type, raw, d + (p * nb + b) * t->pb);
        }
    free(raw);
    return FS_OK;
}

/* ---- panel-block -> decoded 32-column block ---------------------------------------------------------------- */

const uint8_t *fs_block_base(const fs_traits *t, const uint8_t *pw, int64_t b) {
    return pw + (b * FS_QB / t->qk) * t->pb;
}

static void get_nibbles(const uint8_t *src, int sign, fs_block *o) {
    for (int c = 0; c < 4; c++)
        for (int w = 0; w < 32; w++) {
            const uint16_t word = fs_rd16(src + 64 * c + 2 * w);
            for (int t = 0; t < 4; t++) {
                int v = (word >> (4 * t)) & 15;
                o->q[w / 2][2 * (4 * c + t) + (w & 1)] = (int16_t)(sign && v >= 8 ? v - 16 : v);
            }
        }
}

static void add_high(const uint8_t *src, int bits, int16_t offset, fs_block *o) {
    for (int w = 0; w < 32; w++)
        for (int j = 0; j < 16; j++) {
            const int c = bits == 1 ? 0 : j / 8, t = bits == 1 ? j : j % 8;
            const uint16_t word = fs_rd16(src + 64 * c + 2 * w);
            const int hb = (word >> (bits * t)) & ((1 << bits) - 1);
            int16_t *q = &o->q[w / 2][2 * j + (w & 1)];
            *q = (int16_t)(*q + (hb << 4) - offset);
        }
}

static void half_scales(const uint8_t *d16, fs_block *o) {
    for (int l = 0; l < FS_PANEL; l++) o->dw[0][l] = o->dw[1][l] = fs_half_to_float(fs_rd16(d16 + 2 * l));
}

void fs_decode_block(int type, const uint8_t *pw, int64_t b, fs_block *o) {
    const fs_traits *t = fs_traits_of(type);
    const uint8_t *base = fs_block_base(t, pw, b);
    const int s = (int)(b % (t->qk / FS_QB)); /* sub-block of a K-quant super-block */
    memset(o->mw, 0, sizeof o->mw);
    half_scales(base, o);
    switch (type) {
    case FS_Q4_0:
        get_nibbles(base + 32, 1, o);
        break;
    case FS_Q4_1:
    case FS_Q5_1:
        for (int l = 0; l < FS_PANEL; l++) o->mw[l] = fs_half_to_float(fs_rd16(base + 32 + 2 * l));
        get_nibbles(base + 64, 0, o);
        if (type == FS_Q5_1) add_high(base + 320, 1, 0, o);
        break;
    case FS_Q5_0:
        get_nibbles(base + 32, 0, o);
        add_high(base + 288, 1, 16, o);
        break;
    case FS_Q8_0:
        for (int j = 0; j < 16; j++)
            for (int l = 0; l < FS_PANEL; l++)
                for (int h = 0; h < 2; h++) o->q[l][2 * j + h] = (int8_t)base[32 + 32 * j + 2 * l + h];
        break;
    case FS_Q4_K:
    case FS_Q5_K: {
        const uint8_t *sub = base + 320 + (type == FS_Q4_K ? 256 : 320) * s;
        for (int l = 0; l < FS_PANEL; l++) {
            const float d = o->dw[0][l], dmin = fs_half_to_float(fs_rd16(base + 32 + 2 * l));
            o->dw[0][l] = o->dw[1][l] = d * (float)base[64 + 16 * s + l];
            o->mw[l] = -dmin * (float)base[192 + 16 * s + l];
        }
        get_nibbles(sub, 0, o);
        if (type == FS_Q5_K) add_high(sub + 256, 1, 0, o);
        break;
    }
    case FS_Q6_K: {
        const uint8_t *sub = base + 288 + 384 * s;
        for (int l = 0; l < FS_PANEL; l++) {
            const float d = o->dw[0][l];
            o->dw[0][l] = d * (float)(int8_t)base[32 + 16 * (2 * s) + l];
            o->dw[1][l] = d * (float)(int8_t)base[32 + 16 * (2 * s + 1) + l];
        }
        get_nibbles(sub, 0, o);
        add_high(sub + 256, 2, 32, o);
        break;
    }
    }
}

/* ---- dequantization ---------------------------------------------------------------------------------------- */

static float float_elem(int type, const uint8_t *p) {
    if (type == FS_F16) return fs_half_to_float(fs_rd16(p));
    if (type == FS_BF16) return fs_bf16_to_float(fs_rd16(p));
    float f;
    memcpy(&f, p, sizeof f);
    return f;
}

int fs_dequant_rows(int type, int64_t rows, int64_t cols, const void *packed, const int64_t *row_ids, int64_t n,
                    float *out) {
    const int64_t size = fs_packed_size(type, rows, cols);
    if (size < 0) return (int)size;
    for (int64_t i = 0; i < n; i++)
        if (row_ids[i] < 0 || row_ids[i] >= rows) return FS_EINVAL;
    const fs_traits *t = fs_traits_of(type);
    const uint8_t *w = packed;
    const int64_t panel_bytes = cols / t->qk * t->pb;
    if (t->is_float) {
        for (int64_t i = 0; i < n; i++) {
            const int64_t r = row_ids[i];
            const uint8_t *pw = w + (r / FS_PANEL) * panel_bytes + (r % FS_PANEL) * t->gguf_bytes;
            for (int64_t k = 0; k < cols; k++) out[i * cols + k] = float_elem(type, pw + k * t->pb);
        }
        return FS_OK;
    }
    fs_block *blk = malloc(sizeof *blk);
    if (blk == NULL) return FS_ENOMEM;
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = row_ids[i];
        const int l = (int)(r % FS_PANEL);
        for (int64_t b = 0; b < cols / FS_QB; b++) {
            fs_decode_block(type, w + (r / FS_PANEL) * panel_bytes, b, blk);
            float *o = out + i * cols + b * FS_QB;
            for (int k = 0; k < FS_QB; k++)
                o[k] = t->asym ? blk->dw[k / 16][l] * (float)blk->q[l][k] + blk->mw[l]
                               : blk->dw[k / 16][l] * (float)blk->q[l][k];
        }
    }
    free(blk);
    return FS_OK;
}
