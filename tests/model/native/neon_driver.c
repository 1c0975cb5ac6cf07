/* Test driver for the NEON path, cross-compiled for aarch64 and run under qemu by test_neon.py: reads test cases
 * from argv[1], runs them through the engine (which must have chosen the "neon" path) and writes the results to
 * argv[2]. All numbers are little-endian; layouts as in fs.h.
 *
 *   case 1 (matmul): i32 type rows cols n, GGUF bytes, f32 x[n][cols]
 *       -> f32 dequant[rows][cols], y[n][rows] (one call), y[n][rows] (row by row), y[n][rows] (2 threads)
 *   case 2 (layers): i32 hidden q_heads kv_heads head_dim inter n_layers n start capacity max_pos has_mask
 *                    has_attn_norm has_bias, f32 eps; per layer 7 x (i32 type, GGUF bytes) [q k v o gate up down],
 *                    attn_norm, mlp_norm, biases; f32 x, i32 pos, f32 cos, sin, k_cache, v_cache, u8 mask
 *       -> f32 x[n][hidden], k_cache, v_cache */
#include <stdio.h>
#include <stdlib.h>

#include "fs_internal.h"

static FILE *in, *out;

static void rd(void *p, size_t n) {
    if (n && fread(p, 1, n, in) != n) {
        fprintf(stderr, "neon_driver: short read\n");
        exit(2);
    }
}
static int32_t rd_i32(void) {
    int32_t v;
    rd(&v, sizeof v);
    return v;
}
static void *rd_alloc(size_t n) {
    void *p = malloc(n ? n : 1);
    rd(p, n);
    return p;
}
static void wr(const void *p, size_t n) { fwrite(p, 1, n, out); }

static fs_matrix rd_matrix(int64_t rows, int64_t cols) {
    const int type = rd_i32();
    const fs_traits *t = fs_traits_of(type);
    void *raw = rd_alloc((size_t)(rows * (cols / t->qk) * t->gguf_bytes));
    void *packed = malloc((size_t)fs_packed_size(type, rows, cols));
    if (fs_pack(type, rows, cols, raw, packed) != FS_OK) exit(3);
    free(raw);
    return (fs_matrix){packed, type, (int32_t)rows, (int32_t)cols};
}

static void case_matmul(void) {
    const int32_t type = rd_i32(), rows = rd_i32(), cols = rd_i32(), n = rd_i32();
    const fs_matrix w = rd_matrix(rows, cols);
    (void)type;
    float *x = rd_alloc(sizeof(float) * (size_t)(n * cols)), *y = malloc(sizeof(float) * (size_t)(n * rows));
    float *deq = malloc(sizeof(float) * (size_t)rows * cols);
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)rows);
    for (int64_t r = 0; r < rows; r++) ids[r] = r;
    fs_dequant_rows(w.type, rows, cols, w.data, ids, rows, deq);
    wr(deq, sizeof(float) * (size_t)rows * cols);
    fs_init(1);
    fs_matmul(w.type, rows, cols, w.data, x, n, y);
    wr(y, sizeof(float) * (size_t)(n * rows));
    for (int r = 0; r < n; r++) fs_matmul(w.type, rows, cols, w.data, x + (int64_t)r * cols, 1, y + (int64_t)r * rows);
    wr(y, sizeof(float) * (size_t)(n * rows));
    fs_init(2);
    fs_matmul(w.type, rows, cols, w.data, x, n, y);
    wr(y, sizeof(float) * (size_t)(n * rows));
    fs_init(1);
    free((void *)w.data), free(x), free(y), free(deq), free(ids);
}

static float *rd_floats(int64_t count) { return rd_alloc(sizeof(float) * (size_t)count); }

static void case_layers(void) {
    fs_config c;
    c.hidden = rd_i32(), c.q_heads = rd_i32(), c.kv_heads = rd_i32(), c.head_dim = rd_i32();
    c.intermediate = rd_i32();
    const int n_layers = rd_i32(), n = rd_i32(), start = rd_i32(), cap = rd_i32(), max_pos = rd_i32();
    const int has_mask = rd_i32(), has_attn_norm = rd_i32(), has_bias = rd_i32();
    rd(&c.eps, sizeof c.eps);
    const int64_t qd = (int64_t)c.q_heads * c.head_dim, kvd = (int64_t)c.kv_heads * c.head_dim;
    fs_layer *L = calloc((size_t)n_layers, sizeof *L);
    for (int l = 0; l < n_layers; l++) {
        L[l].q = rd_matrix(qd, c.hidden), L[l].k = rd_matrix(kvd, c.hidden), L[l].v = rd_matrix(kvd, c.hidden);
        L[l].o = rd_matrix(c.hidden, qd), L[l].gate = rd_matrix(c.intermediate, c.hidden);
        L[l].up = rd_matrix(c.intermediate, c.hidden), L[l].down = rd_matrix(c.hidden, c.intermediate);
        L[l].attn_norm = has_attn_norm ? rd_floats(c.hidden) : NULL;
        L[l].mlp_norm = rd_floats(c.hidden);
        if (has_bias) L[l].q_bias = rd_floats(qd), L[l].k_bias = rd_floats(kvd), L[l].v_bias = rd_floats(kvd);
    }
    const int64_t cache = (int64_t)n_layers * kvd * cap;
    float *x = rd_floats((int64_t)n * c.hidden);
    int32_t *pos = rd_alloc(sizeof(int32_t) * (size_t)n);
    float *cos = rd_floats((int64_t)max_pos * c.head_dim), *sin = rd_floats((int64_t)max_pos * c.head_dim);
    float *kc = rd_floats(cache), *vc = rd_floats(cache);
    uint8_t *mask = has_mask ? rd_alloc((size_t)n * (size_t)(start + n)) : NULL;
    const int done = fs_layers_forward(&c, L, n_layers, x, n, pos, cos, sin, max_pos, kc, vc, cap, start, mask, NULL);
    if (done != n_layers) {
        fprintf(stderr, "neon_driver: fs_layers_forward returned %d\n", done);
        exit(4);
    }
    wr(x, sizeof(float) * (size_t)n * c.hidden);
    wr(kc, sizeof(float) * (size_t)cache);
    wr(vc, sizeof(float) * (size_t)cache);
}

int main(int argc, char **argv) {
    if (argc != 3 || !(in = fopen(argv[1], "rb")) || !(out = fopen(argv[2], "wb"))) return 1;
    if (strcmp(fs_isa(), "neon") != 0) {
        fprintf(stderr, "neon_driver: the engine chose %s, not neon\n", fs_isa());
        return 5;
    }
    int32_t kind;
    while (fread(&kind, sizeof kind, 1, in) == 1) {
        if (kind == 1)
            case_matmul();
        else if (kind == 2)
            case_layers();
        else
            return 6;
    }
    fclose(out);
    return 0;
}
