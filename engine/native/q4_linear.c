/* Matrix products over 4-bit weights, for layers whose weights already are 4-bit: a model converted from
 * a GGUF file in Q4_1 (the registry's SmolLM2) holds, in each group of 32 inputs, weights that are exactly
 * scale * code + minimum with codes 0..15. engine/kernels.py stores such a layer in this form only where it
 * gives back every weight bit for bit, so these products read the float32 model's own weights in 0.625 bytes
 * a weight (int8 groups take 1.125, and round the weights).
 *
 * q: [out, in / 2] bytes, read as 16-bit words: in each block of 64 inputs (two groups, 16 words), word w
 * holds inputs w, 16 + w, 32 + w and 48 + w in its four nibbles, lowest first, so four shifts and masks of
 * one 32-byte load give the block's codes as four vectors of 16 int16 in input order. scale, minimum:
 * [out, in / 32] IEEE half floats (the GGUF's own: engine/kernels.py keeps a layer so only where they are
 * exact; 0.625 bytes a weight in all, as llama.cpp's Q4_1), widened to float32 exactly where used;
 * y[r, o] = bias[o] + sum_i x[r, i] * (scale * code + minimum). `in`: a multiple of 64.
 * By the kernel number of engine.native.INT8_KERNELS:
 * - 0, 1 (float activations): each output's weights rebuilt in float (scale * code, then + minimum: the
 *   same two roundings as the check that stored them) and dotted with every row by int8_linear.c's tiles;
 * - 2, 3 (integer products): each row rounded to int16 per 32 inputs as int8_linear.c's int16 kernel does,
 *   then per group the exact integer sums sum(code * xq) and sum(xq): y = the sum over groups, in order, of
 *   scale * sx * sum(code * xq) (in 8 float lanes, then the lanes in a fixed order), plus the sum over groups
 *   of minimum * sx * sum(xq) (likewise).
 * Either way each (row, output) is summed by one thread in one fixed order, whatever rows share the call:
 * batched decoding equals serial decoding. */
#include <stdint.h>

#define GROUP 32
#define BLOCK 64 /* inputs a 32-byte load holds */
#define OUT_CHUNK 16
#define MAX_IN 16384
#define QROWS 16
#define PREFETCH 2048
#define MAX_TILE 8 /* outputs x rows of the largest integer tile */

#if defined(__F16C__)
#include <immintrin.h>
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
float cadence_half_to_float(uint16_t h); /* layer_ops.c: the same value, in plain C */
#define half_to_float cadence_half_to_float
#endif

typedef void (*rebuild_fn)(const void *weights, long c, long in, float *w);
void cadence_rebuilt_linear(const float *x, long rows, long in, const void *weights, rebuild_fn rebuild,
                            const float *bias, long out, float *y);

static void add_bias(const float *bias, long rows, long out, long o0, long n_out, float *y) {
    if (bias)
        for (long r = 0; r < rows; r++)
            for (long o = o0; o < o0 + n_out; o++) y[r * out + o] += bias[o];
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SIMD_Q4 1

/* One block's 64 codes as four vectors of 16 int16 (inputs 0-15, 16-31, 32-47, 48-63). */
static inline void unpack_block(const uint8_t *b, __m256i v[4]) {
    const __m256i words = _mm256_loadu_si256((const __m256i *)b), nibble = _mm256_set1_epi16(15);
    v[0] = _mm256_and_si256(words, nibble);
    v[1] = _mm256_and_si256(_mm256_srli_epi16(words, 4), nibble);
    v[2] = _mm256_and_si256(_mm256_srli_epi16(words, 8), nibble);
    v[3] = _mm256_srli_epi16(words, 12);
}
#endif

/* One output's weights in float: w[i] = scale * code + minimum, rounded after the product and after the sum
 * (no fused multiply-add: -std=c11 contracts nothing, and the vector way multiplies, then adds). */
static void dequantize_q4(const uint8_t *q, const uint16_t *scale, const uint16_t *minimum, long in, float *w) {
    for (long k = 0; k < in / BLOCK; k++) {
        const uint8_t *b = q + k * (BLOCK / 2);
        float *wb = w + k * BLOCK;
#ifdef SIMD_Q4
        _mm_prefetch((const char *)(b + PREFETCH), _MM_HINT_T0);
        __m256i v[4];
        unpack_block(b, v);
        for (int j = 0; j < 4; j++) {
            const __m256 d = _mm256_set1_ps(half_to_float(scale[2 * k + j / 2]));
            const __m256 m = _mm256_set1_ps(half_to_float(minimum[2 * k + j / 2]));
            const __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(v[j]));
            const __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v[j], 1));
            _mm256_storeu_ps(wb + 16 * j, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo), d), m));
            _mm256_storeu_ps(wb + 16 * j + 8, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hi), d), m));
        }
#else
        for (int i = 0; i < BLOCK; i++) {
            const int word = b[2 * (i % 16)] | b[2 * (i % 16) + 1] << 8;
            const float product = half_to_float(scale[2 * k + i / GROUP]) * (float)((word >> (4 * (i / 16))) & 15);
            wb[i] = product + half_to_float(minimum[2 * k + i / GROUP]);
        }
#endif
    }
}

struct q4_weights {
    const uint8_t *q;
    const uint16_t *scale, *minimum;
};

static void rebuild_q4(const void *weights, long c, long in, float *w) {
    const struct q4_weights *m = weights;
    const long groups = in / GROUP;
    dequantize_q4(m->q + c * (in / 2), m->scale + c * groups, m->minimum + c * groups, in, w);
}

static void q4_linear_float(const float *x, long rows, long in, const uint8_t *q, const uint16_t *scale,
                            const uint16_t *minimum, const float *bias, long out, float *y) {
    const struct q4_weights weights = {q, scale, minimum};
    cadence_rebuilt_linear(x, rows, in, &weights, rebuild_q4, bias, out, y);
}

#ifdef SIMD_Q4
void cadence_round_rows16(const float *x, long rows, long in, int16_t *q, float *d);

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* The sum over groups of minimum * scale * sum(xq): 8 groups a lane, then the lanes and the rest, in order. */
static inline float minimum_part(const uint16_t *m, const float *xsum, long groups) {
    __m256 acc = _mm256_setzero_ps();
    long g = 0;
    for (; g + 8 <= groups; g += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g))), _mm256_loadu_ps(xsum + g), acc);
    float total = hsum8(acc);
    for (; g < groups; g++) total = __builtin_fmaf(half_to_float(m[g]), xsum[g], total);
    return total;
}

/* prod[(c * RB + r) * groups + g] = scale of output c's group g * scale of row r's group g, for a tile. */
static inline void scale_products(const uint16_t *sw, const float *sx, long groups, int ob, int rb, float *prod) {
    for (int c = 0; c < ob; c++) {
        long g = 0;
        for (; g + 8 <= groups; g += 8) {
            const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sw + c * groups + g)));
            for (int r = 0; r < rb; r++)
                _mm256_storeu_ps(prod + (c * rb + r) * groups + g, _mm256_mul_ps(s, _mm256_loadu_ps(sx + r * groups + g)));
        }
        for (; g < groups; g++)
            for (int r = 0; r < rb; r++) prod[(c * rb + r) * groups + g] = half_to_float(sw[c * groups + g]) * sx[r * groups + g];
    }
}

/* q4tile_OB_RB: OB outputs against RB rows rounded to int16 (x; sx their scales, xsum scale * sum of each group). */
#define DEFINE_Q4TILE(OB, RB)                                                                            \
    static void q4tile_##OB##_##RB(const uint8_t *w, const uint16_t *sw, const uint16_t *mw, const int16_t *x, \
                                   const float *sx, const float *xsum, long in, float *y, long ldy) {    \
        const long groups = in / GROUP, half = in / 2;                                                   \
        float prod[MAX_TILE * MAX_IN / GROUP];                                                            \
        scale_products(sw, sx, groups, OB, RB, prod);                                                    \
        __m256 acc[OB][RB];                                                                              \
        _Pragma("GCC unroll 8") for (int c = 0; c < OB; c++)                                             \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) acc[c][r] = _mm256_setzero_ps();         \
        for (long k = 0; k < in / BLOCK; k++) {                                                          \
            _Pragma("GCC unroll 8") for (int c = 0; c < OB; c++) {                                       \
                const uint8_t *wb = w + c * half + k * (BLOCK / 2);                                      \
                _mm_prefetch((const char *)(wb + PREFETCH), _MM_HINT_T0);                                \
                __m256i v[4];                                                                            \
                unpack_block(wb, v);                                                                     \
                _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++) {                                    \
                    const long g = 2 * k + j;                                                            \
                    _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) {                               \
                        const int16_t *xg = x + r * in + g * GROUP;                                      \
                        const __m256i sum = _mm256_add_epi32(                                            \
                            _mm256_madd_epi16(v[2 * j], _mm256_loadu_si256((const __m256i *)xg)),        \
                            _mm256_madd_epi16(v[2 * j + 1], _mm256_loadu_si256((const __m256i *)(xg + 16)))); \
                        acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),                             \
                                                    _mm256_broadcast_ss(prod + (c * RB + r) * groups + g), acc[c][r]); \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        _Pragma("GCC unroll 8") for (int c = 0; c < OB; c++)                                             \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                          \
                y[r * ldy + c] = hsum8(acc[c][r]) + minimum_part(mw + c * groups, xsum + r * groups, groups); \
    }
DEFINE_Q4TILE(4, 1) DEFINE_Q4TILE(4, 2) DEFINE_Q4TILE(2, 3) DEFINE_Q4TILE(2, 4)
DEFINE_Q4TILE(1, 1) DEFINE_Q4TILE(1, 2) DEFINE_Q4TILE(1, 3) DEFINE_Q4TILE(1, 4)

#define Q4SHAPE(RB, OB)                                                                                 \
    case RB:                                                                                            \
        for (; c + OB <= n_out; c += OB)                                                                \
            q4tile_##OB##_##RB(w + c * half, sw + c * groups, mw + c * groups, xr, sxr, sumr, in, yr + c, ldy); \
        for (; c < n_out; c++) q4tile_1_##RB(w + c * half, sw + c * groups, mw + c * groups, xr, sxr, sumr, in, yr + c, ldy); \
        break;

static void q4_dot_rows(const uint8_t *w, const uint16_t *sw, const uint16_t *mw, long n_out, const int16_t *x,
                        const float *sx, const float *xsum, long rows, long in, float *y, long ldy) {
    const long groups = in / GROUP, half = in / 2;
    for (long r0 = 0; r0 < rows; r0 += 4) {
        const int n = rows - r0 < 4 ? (int)(rows - r0) : 4;
        const int16_t *xr = x + r0 * in;
        const float *sxr = sx + r0 * groups, *sumr = xsum + r0 * groups;
        float *yr = y + r0 * ldy;
        long c = 0;
        switch (n) { Q4SHAPE(1, 4) Q4SHAPE(2, 4) Q4SHAPE(3, 2) Q4SHAPE(4, 2) }
    }
}

static void q4_linear_int16(const float *x, long rows, long in, const uint8_t *q, const uint16_t *scale,
                            const uint16_t *minimum, const float *bias, long out, float *y) {
    const long groups = in / GROUP;
#pragma omp parallel
    {
        static __thread int16_t xq[QROWS * MAX_IN] __attribute__((aligned(64)));
        static __thread float xs[QROWS * MAX_IN / GROUP], xsum[QROWS * MAX_IN / GROUP];
        for (long r0 = 0; r0 < rows; r0 += QROWS) {
            const long n = rows - r0 < QROWS ? rows - r0 : QROWS;
            cadence_round_rows16(x + r0 * in, n, in, xq, xs);
            for (long g = 0; g < n * groups; g++) {
                int32_t s = 0; /* at most 32 * 32767: exact in a float too */
                for (int k = 0; k < GROUP; k++) s += xq[g * GROUP + k];
                xsum[g] = xs[g] * (float)s;
            }
#pragma omp for schedule(static) nowait
            for (long o0 = 0; o0 < out; o0 += OUT_CHUNK) {
                const long n_out = o0 + OUT_CHUNK < out ? OUT_CHUNK : out - o0;
                q4_dot_rows(q + o0 * (in / 2), scale + o0 * groups, minimum + o0 * groups, n_out, xq, xs, xsum, n, in,
                            y + r0 * out + o0, out);
                add_bias(bias, n, out, o0, n_out, y + r0 * out);
            }
        }
    }
}
#define INTEGER_WAY q4_linear_int16
#else
#define INTEGER_WAY q4_linear_float
#endif

/* x: [rows, in] float32; q, scale, minimum as above; bias [out] or NULL; y: [rows, out]. kernel: 0-3 as
 * engine.native.INT8_KERNELS: 0 and 1 the float way, 2 and 3 (the integer ones) the int16 way. */
void cadence_q4_linear(const float *x, long rows, long in, const uint8_t *q, const uint16_t *scale,
                       const uint16_t *minimum, const float *bias, long out, float *y, int kernel) {
    (kernel >= 2 ? INTEGER_WAY : q4_linear_float)(x, rows, in, q, scale, minimum, bias, out, y);
}
