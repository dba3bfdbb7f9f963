/* A decoder's layers over one step's rows in a single call, for the int8 precision's fused path on CPU.
 *
 * engine/families/decoder.py runs each layer as about twenty PyTorch and ctypes calls (views, slices, new
 * tensors, then the C kernels of int8_linear.c and layer_ops.c); for one row of a small model the calls'
 * own cost is most of the step. This loop makes exactly the same kernel calls, in the same order, on the
 * same values, so its results are the same bits as the Python loop's (tests/test_native.py checks it),
 * and every row is still computed alone. Layers of the Llama layout only: q, k, v in one product (bias
 * allowed), rotary on whole heads, attention over the KV cache, SiLU-gated MLP, RMS norms. */
#include <stdint.h>

void cadence_int8_linear(const float *x, long rows, long in, const int8_t *q, const float *scale,
                         const float *bias, long out, float *y);
void cadence_int8_linear16(const float *x, long rows, long in, const int8_t *q, const float *scale,
                           const float *bias, long out, float *y);
void cadence_int8_linear_int8_dot(const float *x, long rows, long in, const int8_t *q, const float *scale,
                                  const float *bias, long out, float *y);
void cadence_int8_linear_int16_dot(const float *x, long rows, long in, const int8_t *q, const float *scale,
                                   const float *bias, long out, float *y);
void cadence_add_rms_norm(const float *x, const float *h, long rows, long d, const float *w, float eps,
                          float *sum, float *y);
void cadence_rotary(float *x, long rows, long stride, long heads, long dim, const float *cos_table,
                    const float *sin_table, const long *table_rows);
void cadence_attend(const float *q, long q_stride, const float *k, long k_stride, const float *v, long v_stride,
                    long rows, long heads, long kv_heads, long dim, const long *row_slots, const long *row_positions,
                    float *cache_k, float *cache_v, long slot_stride, long head_stride, long window, float scale,
                    float *out);
void cadence_silu_mul(const float *gate_up, long rows, long f, long stride, float *out);

void cadence_q4_linear(const float *x, long rows, long in, const uint8_t *q, const uint16_t *scale,
                       const uint16_t *minimum, const float *bias, long out, float *y, int kernel);

typedef void (*int8_linear_fn)(const float *, long, long, const int8_t *, const float *, const float *, long, float *);

static int8_linear_fn kernel_of(int kernel) {
    return kernel == 3   ? cadence_int8_linear_int16_dot
           : kernel == 2 ? cadence_int8_linear_int8_dot
           : kernel == 1 ? cadence_int8_linear16
                         : cadence_int8_linear;
}

/* The product over every row, each run of rows of one kind (generated[r]: 1 for a generated token's row,
 * 0 for a prompt's; NULL: all prompt rows) by its kind's kernel. Every kernel sums each row alone, so a
 * row's result depends on its own kind only, never on its neighbours'. minimum: NULL for int8 weights (q
 * int8, scale float32), else the 4-bit weights' minimums (q their codes, scale and minimum half floats:
 * q4_linear.c). */
void cadence_int8_linear_by_kind(const float *x, long rows, long in, const int8_t *q, const void *scale,
                                 const void *minimum, const float *bias, long out, float *y,
                                 const uint8_t *generated, int prompt_kernel, int generated_kernel) {
    for (long r0 = 0, r1; r0 < rows; r0 = r1) {
        const int kind = generated ? generated[r0] : 0;
        for (r1 = r0 + 1; r1 < rows && (generated ? generated[r1] : 0) == kind; r1++) {
        }
        const int kernel = kind ? generated_kernel : prompt_kernel;
        if (minimum)
            cadence_q4_linear(x + r0 * in, r1 - r0, in, (const uint8_t *)q, scale, minimum, bias, out, y + r0 * out, kernel);
        else
            kernel_of(kernel)(x + r0 * in, r1 - r0, in, q, (const float *)scale, bias, out, y + r0 * out);
    }
}

/* Each layer's pointers, in this order, in `layers` (PER_LAYER of them a layer): the four products' int8
 * (or 4-bit) weights, scales, minimums (NULL: int8 weights) and biases (NULL: none), the MLP's input norm,
 * the next layer's input norm (NULL after the last layer: the residual add alone), and the layer's key and
 * value caches (last). */
enum { QKV_Q, QKV_S, QKV_M, QKV_B, OUT_Q, OUT_S, OUT_M, OUT_B, UP_Q, UP_S, UP_M, UP_B, DOWN_Q, DOWN_S, DOWN_M, DOWN_B,
       FFN_NORM, NEXT_NORM, CACHE_K, CACHE_V, PER_LAYER };

long cadence_decoder_layers_per_layer(void) { return PER_LAYER; }

/* The floats of work space a step of `rows` rows needs. */
long cadence_decoder_layers_work(long rows, long d, long heads, long kv_heads, long dim, long ffn) {
    return rows * ((heads + 2 * kv_heads) * dim + heads * dim + d + 3 * ffn);
}

/* x [rows, d]: the residual stream entering layer 0, `normed` [rows, d] its input norm; on return x
 * holds the stream after the last layer (before the final norm). Kernels: 0, 1, 2, 3 for the 8-lane,
 * 16-lane, int8-integer and int16-integer kernels (engine.native.INT8_KERNELS), one for prompt rows
 * and one for generated rows (as cadence_int8_linear_by_kind), and one for generated rows in the MLP's
 * down projection (whose inputs, SiLU(gate) * up, carry the outliers that rounding activations to int8
 * loses most on);
 * windows[i]: layer i's sliding window (0: none); the cache strides as in cadence_attend; work:
 * cadence_decoder_layers_work floats. */
void cadence_decoder_layers(void *const *layers, long n_layers, const long *windows, long rows, long d, long heads,
                            long kv_heads, long dim, long ffn, float eps, float scale, const uint8_t *generated,
                            int prompt_kernel, int generated_kernel, int generated_down_kernel,
                            const float *cos_table, const float *sin_table, const long *table_rows,
                            const long *row_slots, const long *row_positions, long slot_stride, long head_stride,
                            float *x, float *normed, float *work) {
#define PRODUCT_ON(input, in, which, out, y, kernel)                                                     \
    cadence_int8_linear_by_kind(input, rows, in, p[which##_Q], p[which##_S], p[which##_M], p[which##_B], out, y, \
                                generated, prompt_kernel, kernel)
#define PRODUCT(input, in, which, out, y) PRODUCT_ON(input, in, which, out, y, generated_kernel)
    const long width = (heads + 2 * kv_heads) * dim;
    float *qkv = work, *attended = qkv + rows * width, *h = attended + rows * heads * dim, *up = h + rows * d,
          *gated = up + rows * 2 * ffn;
    for (long i = 0; i < n_layers; i++) {
        void *const *p = layers + i * PER_LAYER;
        PRODUCT(normed, d, QKV, width, qkv);
        cadence_rotary(qkv, rows, width, heads + kv_heads, dim, cos_table, sin_table, table_rows);
        cadence_attend(qkv, width, qkv + heads * dim, width, qkv + (heads + kv_heads) * dim, width, rows, heads,
                       kv_heads, dim, row_slots, row_positions, p[CACHE_K], p[CACHE_V], slot_stride, head_stride,
                       windows[i], scale, attended);
        PRODUCT(attended, heads * dim, OUT, d, h);
        cadence_add_rms_norm(x, h, rows, d, p[FFN_NORM], eps, x, normed);
        PRODUCT(normed, d, UP, 2 * ffn, up);
        cadence_silu_mul(up, rows, ffn, 2 * ffn, gated);
        PRODUCT_ON(gated, ffn, DOWN, d, h, generated_down_kernel);
        if (p[NEXT_NORM]) {
            cadence_add_rms_norm(x, h, rows, d, p[NEXT_NORM], eps, x, normed);
        } else {
            for (long j = 0; j < rows * d; j++) x[j] += h[j];
        }
    }
}
#undef PRODUCT
#undef PRODUCT_ON
