#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <sys/mman.h>
#include "fs_internal.h"
#include <immintrin.h>
extern double T[8];
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
    int n = atoi(argv[1]), ctx = atoi(argv[2]), threads = argc > 3 ? atoi(argv[3]) : 1;
    if (getenv("FTZ")) _mm_setcsr(_mm_getcsr() | 0x8040);
    fs_init(threads);
    int shapes[7][2] = {{576,576},{192,576},{192,576},{576,576},{1536,576},{1536,576},{576,1536}};
    size_t total = 0; for (int j = 0; j < 7; j++) total += fs_packed_size(3, shapes[j][0], shapes[j][1]);
    total *= 30; size_t sz = (total + (4<<20)) / (2<<20) * (2<<20);
    uint8_t *arena = aligned_alloc(2<<20, sz); madvise(arena, sz, MADV_HUGEPAGE);
    fs_layer L[30]; srand(1); size_t off = 0;
    float *ones = malloc(576 * 4); for (int i = 0; i < 576; i++) ones[i] = 1.0f;
    for (int l = 0; l < 30; l++) { fs_matrix *ms[7] = {&L[l].q,&L[l].k,&L[l].v,&L[l].o,&L[l].gate,&L[l].up,&L[l].down};
      for (int j = 0; j < 7; j++) { int rows = shapes[j][0], cols = shapes[j][1]; int64_t g = (int64_t)rows*cols/32*20;
        uint8_t *raw = malloc(g); for (int64_t i = 0; i < g; i++) raw[i] = rand();
        for (int64_t b = 0; b < g/20; b++) { raw[b*20]=0x1F; raw[b*20+1]=0x21; raw[b*20+2]=0xCD; raw[b*20+3]=0xAC; }
        fs_pack(3, rows, cols, raw, arena + off); free(raw); *ms[j] = (fs_matrix){arena + off, 3, rows, cols}; off += fs_packed_size(3, rows, cols); }
      L[l].attn_norm = ones; L[l].mlp_norm = ones; L[l].q_bias = L[l].k_bias = L[l].v_bias = NULL; }
    fs_config c = {576, 9, 3, 64, 1536, 1e-5f};
    int cap = ctx + 64; size_t csz = (size_t)30 * 3 * cap * 64;
    float *kc = malloc(csz * 4), *vc = malloc(csz * 4); for (size_t i = 0; i < csz; i++) kc[i] = vc[i] = (float)rand() / RAND_MAX - 0.5f;
    float *cs = malloc(cap * 64 * 4), *sn = malloc(cap * 64 * 4); for (int i = 0; i < cap * 64; i++) { cs[i] = 1; sn[i] = 0; }
    float *x = malloc(n * 576 * 4); int32_t *pos = malloc(n * 4); for (int i = 0; i < n; i++) pos[i] = ctx + i;
    double best = 1e9, Tb[8] = {0};
    for (int rep = 0; rep < 12; rep++) {
        for (int i = 0; i < n * 576; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
        for (int i = 0; i < 8; i++) T[i] = 0;
        double t0 = now(); fs_layers_forward(&c, L, 30, x, n, pos, cs, sn, cap, kc, vc, cap, ctx, NULL, NULL); double dt = now() - t0;
        if (dt < best) { best = dt; for (int i = 0; i < 8; i++) Tb[i] = T[i]; }
    }
    printf("n=%d ctx=%d threads=%d: %.2f ms | norm+q %.2f qkv %.2f rope %.2f attn %.2f o %.2f gu %.2f silu %.2f down %.2f\n", n, ctx, threads, best*1e3,
      Tb[0]*1e3, Tb[1]*1e3, Tb[2]*1e3, Tb[3]*1e3, Tb[4]*1e3, Tb[5]*1e3, Tb[6]*1e3, Tb[7]*1e3);
}
