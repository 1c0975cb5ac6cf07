/* Public C API of the native CPU inference engine (loaded from Python with ctypes: see ../_lib.py, which mirrors
 * every struct and signature here; keep the two in step).
 *
 * Weights stay in their GGUF quantized blocks, re-laid out once by fs_pack into panels of FS_PANEL output rows
 * (layout: formats.c). A matmul quantizes each float activation row to int16 per 32-column block, does exact int32
 * dot products against the integer weights and combines blocks with a fixed sequence of float32 operations, so a
 * row's result is bit-identical whatever else is in the batch, whatever the tiling and the thread count.
 *
 * Sizes are int64_t; the C side trusts every pointer and size (the Python side checks them before each call).
 * Functions returning int return 0 (or a count) on success and a negative FS_E* code on a bad argument. */
#ifndef FS_H
#define FS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FS_API __attribute__((visibility("default")))

/* GGUF (ggml) type ids of the supported weight types. */
enum fs_type {
    FS_F32 = 0, FS_F16 = 1, FS_Q4_0 = 2, FS_Q4_1 = 3, FS_Q5_0 = 6, FS_Q5_1 = 7, FS_Q8_0 = 8,
    FS_Q4_K = 12, FS_Q5_K = 13, FS_Q6_K = 14, FS_BF16 = 30,
};

enum fs_error { FS_OK = 0, FS_EINVAL = -1, FS_ETYPE = -2, FS_ESHAPE = -3, FS_ENOMEM = -4, FS_EISA = -5 };

#define FS_PANEL 16 /* output rows per packed panel: one 512-bit register of int32/float32 lanes */

/* A packed weight matrix W [rows, cols] (y = x @ W^T). data: fs_packed_size(type, rows, cols) bytes. */
typedef struct fs_matrix {
    const uint8_t *data;
    int32_t type, rows, cols;
} fs_matrix;

/* One Llama-family decoder layer. Shapes: q [q_heads*head_dim, hidden], k and v [kv_heads*head_dim, hidden],
 * o [hidden, q_heads*head_dim], gate and up [intermediate, hidden], down [hidden, intermediate]. */
typedef struct fs_layer {
    const float *attn_norm; /* [hidden], or NULL: the block has no input norm (EAGLE's draft head) */
    fs_matrix q, k, v, o, gate, up, down;
    const float *q_bias; /* [q_heads*head_dim] or NULL (qwen2 has q/k/v biases) */
    const float *k_bias; /* [kv_heads*head_dim] or NULL */
    const float *v_bias; /* [kv_heads*head_dim] or NULL */
    const float *mlp_norm; /* [hidden] */
} fs_layer;

typedef struct fs_config {
    int32_t hidden, q_heads, kv_heads, head_dim, intermediate;
    float eps; /* RMSNorm epsilon */
} fs_config;

/* Threads: a persistent pool of n_threads - 1 workers plus the caller (n_threads >= 1; resizable). Returns the
 * thread count now in use. Every compute call is serialized by one mutex. */
FS_API int fs_init(int n_threads);
FS_API int fs_threads(void);

/* ISA paths: "portable", "avx2", "avx512", "avx512vnni", "neon". fs_isa_available says whether this build and CPU
 * run a path; fs_set_isa(NULL) goes back to the best one. */
FS_API const char *fs_isa(void);
FS_API int fs_isa_available(const char *name);
FS_API int fs_set_isa(const char *name);

/* Packing: src is the tensor's GGUF bytes (row-major [rows, cols], cols / block-size blocks per row). */
FS_API int64_t fs_packed_size(int type, int64_t rows, int64_t cols); /* bytes, or < 0 when unsupported */
FS_API int fs_pack(int type, int64_t rows, int64_t cols, const void *src, void *dst);
/* out [n, cols] float32: rows row_ids[0..n) of the packed matrix, equal bit for bit to ggml's dequantization. */
FS_API int fs_dequant_rows(int type, int64_t rows, int64_t cols, const void *packed, const int64_t *row_ids,
                           int64_t n, float *out);

/* y [n, rows] = x [n, cols] @ W^T. */
FS_API int fs_matmul(int type, int64_t rows, int64_t cols, const void *packed, const float *x, int64_t n,
                     float *y);
/* ids [n]: the argmax of each row of x [n, cols] @ W^T, equal to torch.argmax of fs_matmul's y (the lowest index
 * among equal maxima; the first NaN if any), without holding y: each thread keeps the maxima of the slices it
 * computes (argmax.c). */
FS_API int fs_matmul_argmax(int type, int64_t rows, int64_t cols, const void *packed, const float *x, int64_t n,
                            int64_t *ids);
/* out [n, dim] = x / rms(x) * w (out may equal x). */
FS_API int fs_rmsnorm(const float *x, const float *w, int64_t n, int64_t dim, float eps, float *out);
/* logits [n, head.rows] = rmsnorm(x [n, head.cols], norm) @ head^T (norm may be NULL: no norm). */
FS_API int fs_final(const float *x, const float *norm, int64_t n, float eps, const fs_matrix *head, float *logits);
/* The activation quantization, exposed for tests: v [n, cols] int16, d [n, cols / 32] float32. */
FS_API int fs_quantize_act(const float *x, int64_t n, int64_t cols, int16_t *v, float *d);

/* Runs layers [0, n_layers) on n rows. x [n, hidden] is the residual stream, updated in place. pos [n] are the
 * rows' positions (< max_pos) into rope_cos / rope_sin [max_pos, head_dim]. The KV caches are
 * [n_layers][kv_heads][capacity][head_dim] float32; the new rows' K (rotated) and V go to slots [start, start+n).
 * mask: NULL (all of [0, start) plus causal among the new rows) or uint8 [n, start+n], 1 = visible. stop: NULL or
 * a flag checked before each layer. Returns the number of layers completed, or a negative FS_E* code. */
FS_API int fs_layers_forward(const fs_config *cfg, const fs_layer *layers, int n_layers, float *x, int64_t n,
                             const int32_t *pos, const float *rope_cos, const float *rope_sin, int64_t max_pos,
                             float *k_cache, float *v_cache, int64_t capacity, int64_t start, const uint8_t *mask,
                             volatile int *stop);

/* What a layer of another family adds to the Llama layer (fs_layer): an array parallel to the layers. */
typedef struct fs_layer_x {
    const float *q_norm, *k_norm; /* [head_dim] QK-norm: RMSNorm of each head's q and k before the rotation, or NULL */
    const float *post_attn_norm;  /* [hidden] RMSNorm of the attention's output before the residual add, or NULL */
    const float *post_mlp_norm;   /* [hidden] RMSNorm of the MLP's output before the residual add, or NULL */
    int64_t window;               /* sliding window: a row sees only the last `window` keys visible to it; 0: all */
    int32_t rope;                 /* the rotary tables it uses: 0 or 1 (an index into the call's tables) */
    int32_t pad;
} fs_layer_x;

enum fs_activation { FS_ACT_SILU = 0, FS_ACT_GELU_TANH = 1 };

/* The numerics a whole stack shares beyond fs_config. */
typedef struct fs_arch {
    int32_t act;      /* the gated MLP's activation: FS_ACT_SILU or FS_ACT_GELU_TANH */
    float attn_scale; /* softmax scale of q.k; 0: 1 / sqrt(head_dim) */
} fs_arch;

/* Rows [row0, row0 + n) of a batched forward that belong to one request: its KV caches ([n_layers][kv_heads]
 * [capacity][head_dim] float32; the rows' K and V go to slots [start, start + n)) and its mask (NULL, or uint8
 * [n, start + n] as in fs_layers_forward). */
typedef struct fs_group {
    float *k_cache, *v_cache;
    const uint8_t *mask;
    int64_t row0, n, capacity, start;
} fs_group;

/* fs_layers_forward over the rows of several requests at once: groups[0..n_groups) cover x's n rows in order
 * (contiguous, each n >= 1). The matmuls run over all n rows together (each weight streamed once); each row
 * attends only to its own group's cache. A row's result is bit-identical to running its group alone. Returns the
 * number of layers completed, or a negative FS_E* code. */
FS_API int fs_layers_forward_groups(const fs_config *cfg, const fs_layer *layers, int n_layers, float *x, int64_t n,
                                    const int32_t *pos, const float *rope_cos, const float *rope_sin,
                                    int64_t max_pos, const fs_group *groups, int n_groups, volatile int *stop);

/* fs_layers_forward_groups for every family: arch (NULL: SiLU, 1/sqrt(head_dim)) and xs (NULL, or one fs_layer_x
 * per layer); rope_cos[i] / rope_sin[i] [max_pos, head_dim] for i < n_rope are the rotary tables a layer picks by its
 * xs[l].rope (0 without xs). A windowed layer's row attends to the last `window` of the keys its mask (or the causal
 * default) makes visible: on a row's path (one key per position) that is positions (pos - window, pos]. */
FS_API int fs_layers_forward_x(const fs_config *cfg, const fs_arch *arch, const fs_layer *layers,
                               const fs_layer_x *xs, int n_layers, float *x, int64_t n, const int32_t *pos,
                               const float *const *rope_cos, const float *const *rope_sin, int n_rope,
                               int64_t max_pos, const fs_group *groups, int n_groups, volatile int *stop);

/* Asks the OS to back [p, p + n) with transparent huge pages (the 2 MiB-aligned part of it; call before the
 * memory is first written). Packed weights stream with far fewer TLB misses. Returns 0, or -1 where unsupported. */
FS_API int fs_advise_hugepages(void *p, int64_t n);

/* Sizes of the structs above, so a binding can check its mirror. */
FS_API int64_t fs_struct_size(const char *name);

#ifdef __cplusplus
}
#endif
#endif
