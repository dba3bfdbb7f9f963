/* Matrix products over 4-bit weights, for layers whose weights already are 4-bit: a model converted from
 * a GGUF file in Q4_1 (the registry's SmolLM2) holds, in each group of 32 inputs, weights that are exactly
 * scale * code + minimum with codes 0..15. engine/kernels.py stores such a layer in this form only where it
 * gives back every weight bit for bit, so these products read the float32 model's own weights in 0.625 bytes
 * a weight (int8 groups take 1.125, and round the weights).
 *
 * q: [out, in / 2] bytes: in each block of 64 inputs (two groups, 32 bytes), byte i holds input i's code in
 * its low nibble and input 32 + i's in its high one, so one mask and one shift of a 32-byte load give the
 * block's two groups as 32 unsigned bytes each, in input order. scale, minimum: [out, in / 32] IEEE half
 * floats (the GGUF's own: engine/kernels.py keeps a layer so only where they are exact; 0.625 bytes a weight
 * in all, as llama.cpp's Q4_1), widened to float32 exactly where used;
 * y[r, o] = bias[o] + sum_i x[r, i] * (scale * code + minimum). `in`: a multiple of 64.
 * By the kernel number of engine.native.INT8_KERNELS:
 * - 0, 1 (float activations): each output's weights rebuilt in float (scale * code, then + minimum: the
 *   same two roundings as the check that stored them) and dotted with every row by int8_linear.c's tiles;
 * - 2 (8-bit integer products): each row rounded to int8 per 32 inputs as int8_linear.c's int8 kernel does;
 *   per group the exact integer sums sum(code * xq) (unsigned codes times signed bytes, pairs summed in 16
 *   bits: at most 2 * 15 * 127, no saturation; VNNI's dpbusd where the CPU has it, the same lane sums) and
 *   sum(xq);
 * - 3 (16-bit integer products): each row rounded to int16 per 32 inputs as int8_linear.c's int16 kernel
 *   does; the same sums, codes widened to 16 bits (each row's inputs reordered within each group to the
 *   order the widening leaves the codes in: an integer sum does not depend on its order);
 *   either integer way, y = the sum over groups, in order, of scale * sx * sum(code * xq) (in 8 float lanes,
 *   then the lanes in a fixed order), plus the sum over groups of minimum * sx * sum(xq) (likewise).
 * Every way sums each (row, output) in one thread in one fixed order, whatever rows share the call:
 * batched decoding equals serial decoding. */
#include <stdint.h>
#include <string.h>

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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SIMD_Q4 1

/* One block's two groups of codes: 32 unsigned bytes each, in input order. */
static inline void unpack_block(const uint8_t *b, __m256i *low, __m256i *high) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)b), nibble = _mm256_set1_epi8(15);
    *low = _mm256_and_si256(bytes, nibble);
    *high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
}
#endif

/* One output's weights in float: w[i] = scale * code + minimum, rounded after the product and after the sum
 * (no fused multiply-add: -std=c11 contracts nothing, and the vector way multiplies, then adds). */
static void dequantize_q4(const uint8_t *q, const uint16_t *scale, const uint16_t *minimum, long in, float *w) {
    for (long k = 0; k < in / BLOCK; k++) {
        const uint8_t *b = q + k * (BLOCK / 2);
#ifdef SIMD_Q4
        _mm_prefetch((const char *)(b + PREFETCH), _MM_HINT_T0);
        __m256i codes[2];
        unpack_block(b, &codes[0], &codes[1]);
#endif
        for (int j = 0; j < 2; j++) {
            const long g = 2 * k + j;
            const float d = half_to_float(scale[g]), m = half_to_float(minimum[g]);
            float *wg = w + g * GROUP;
#ifdef SIMD_Q4
            for (int part = 0; part < 4; part++) {
                const __m128i half = part < 2 ? _mm256_castsi256_si128(codes[j]) : _mm256_extracti128_si256(codes[j], 1);
                const __m256i wide = _mm256_cvtepu8_epi32(part % 2 ? _mm_srli_si128(half, 8) : half);
                _mm256_storeu_ps(wg + 8 * part, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(d)),
                                                              _mm256_set1_ps(m)));
            }
#else
            for (int i = 0; i < GROUP; i++) {
                const float product = d * (float)((b[i] >> (4 * j)) & 15);
                wg[i] = product + m;
            }
#endif
        }
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
void cadence_round_rows8(const float *x, long rows, long in, int8_t *q, float *d);

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

/* A group's exact integer sum(code * xq) in 8 int32 lanes: codes as 32 unsigned bytes, xq int8 (32 bytes) or
 * int16 (reordered: 16-bit codes come out of the bytes' widening as inputs 0-7 and 16-23, then 8-15 and
 * 24-31, and xq is stored in that order). */
static inline __m256i group_sum8(__m256i codes, const int8_t *xg) { /* lane k: inputs 4k .. 4k + 3 */
    const __m256i x = _mm256_loadu_si256((const __m256i *)xg);
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), codes, x);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
#endif
}
static inline __m256i group_sum16(__m256i codes, const int16_t *xg) {
    const __m256i zero = _mm256_setzero_si256();
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_unpacklo_epi8(codes, zero), _mm256_loadu_si256((const __m256i *)xg)),
                            _mm256_madd_epi16(_mm256_unpackhi_epi8(codes, zero),
                                              _mm256_loadu_si256((const __m256i *)(xg + 16))));
}

/* q4tile<BITS>_OB_RB: OB outputs against RB rows rounded to BITS-bit integers (x; sx their scales, xsum scale
 * * sum of each group). */
#define DEFINE_Q4TILE(BITS, T, OB, RB)                                                                   \
    static void q4tile##BITS##_##OB##_##RB(const uint8_t *w, const uint16_t *sw, const uint16_t *mw, const T *x, \
                                           const float *sx, const float *xsum, long in, float *y, long ldy) { \
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
                __m256i codes[2];                                                                        \
                unpack_block(wb, &codes[0], &codes[1]);                                                  \
                _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++) {                                    \
                    const long g = 2 * k + j;                                                            \
                    _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) {                               \
                        const __m256i sum = group_sum##BITS(codes[j], x + r * in + g * GROUP);           \
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
#define DEFINE_Q4TILES(BITS, T)                                                                         \
    DEFINE_Q4TILE(BITS, T, 4, 1) DEFINE_Q4TILE(BITS, T, 4, 2) DEFINE_Q4TILE(BITS, T, 2, 3)               \
    DEFINE_Q4TILE(BITS, T, 2, 4) DEFINE_Q4TILE(BITS, T, 1, 1) DEFINE_Q4TILE(BITS, T, 1, 2)               \
    DEFINE_Q4TILE(BITS, T, 1, 3) DEFINE_Q4TILE(BITS, T, 1, 4)
DEFINE_Q4TILES(8, int8_t)
DEFINE_Q4TILES(16, int16_t)

#define Q4SHAPE(BITS, RB, OB)                                                                           \
    case RB:                                                                                            \
        for (; c + OB <= n_out; c += OB)                                                                \
            q4tile##BITS##_##OB##_##RB(w + c * half, sw + c * groups, mw + c * groups, xr, sxr, sumr, in, yr + c, ldy); \
        for (; c < n_out; c++)                                                                          \
            q4tile##BITS##_1_##RB(w + c * half, sw + c * groups, mw + c * groups, xr, sxr, sumr, in, yr + c, ldy); \
        break;

/* q4_dot_rows<BITS>: n_out outputs against `rows` rounded rows, 4 rows at a time. */
#define DEFINE_Q4_DOT_ROWS(BITS, T)                                                                     \
    static void q4_dot_rows##BITS(const uint8_t *w, const uint16_t *sw, const uint16_t *mw, long n_out, const T *x, \
                                  const float *sx, const float *xsum, long rows, long in, float *y, long ldy) { \
        const long groups = in / GROUP, half = in / 2;                                                  \
        for (long r0 = 0; r0 < rows; r0 += 4) {                                                         \
            const int n = rows - r0 < 4 ? (int)(rows - r0) : 4;                                         \
            const T *xr = x + r0 * in;                                                                  \
            const float *sxr = sx + r0 * groups, *sumr = xsum + r0 * groups;                            \
            float *yr = y + r0 * ldy;                                                                   \
            long c = 0;                                                                                 \
            switch (n) { Q4SHAPE(BITS, 1, 4) Q4SHAPE(BITS, 2, 4) Q4SHAPE(BITS, 3, 2) Q4SHAPE(BITS, 4, 2) } \
        }                                                                                               \
    }
DEFINE_Q4_DOT_ROWS(8, int8_t)
DEFINE_Q4_DOT_ROWS(16, int16_t)

#define round_rows8 cadence_round_rows8 /* rows rounded for the 8-bit way: in input order */

/* Rows rounded for the 16-bit way: as cadence_round_rows16, then each group's inputs 8-15 and 16-23 swapped
 * (the order group_sum16 reads them in). */
static void round_rows16(const float *x, long rows, long in, int16_t *q, float *d) {
    cadence_round_rows16(x, rows, in, q, d);
    for (long g = 0; g < rows * (in / GROUP); g++) {
        int16_t swap[8], *p = q + g * GROUP;
        memcpy(swap, p + 8, sizeof swap);
        memcpy(p + 8, p + 16, sizeof swap);
        memcpy(p + 16, swap, sizeof swap);
    }
}

static void add_bias(const float *bias, long rows, long out, long o0, long n_out, float *y) {
    if (bias)
        for (long r = 0; r < rows; r++)
            for (long o = o0; o < o0 + n_out; o++) y[r * out + o] += bias[o];
}

/* q4_linear_int<BITS>: each thread rounds QROWS rows at a time (its own copy), then its share of outputs. */
#define DEFINE_Q4_LINEAR_INT(BITS, T)                                                                   \
    static void q4_linear_int##BITS(const float *x, long rows, long in, const uint8_t *q, const uint16_t *scale, \
                                    const uint16_t *minimum, const float *bias, long out, float *y) {   \
        const long groups = in / GROUP;                                                                 \
        _Pragma("omp parallel") {                                                                       \
            static __thread T xq[QROWS * MAX_IN] __attribute__((aligned(64)));                          \
            static __thread float xs[QROWS * MAX_IN / GROUP], xsum[QROWS * MAX_IN / GROUP];             \
            for (long r0 = 0; r0 < rows; r0 += QROWS) {                                                 \
                const long n = rows - r0 < QROWS ? rows - r0 : QROWS;                                   \
                round_rows##BITS(x + r0 * in, n, in, xq, xs);                                           \
                for (long g = 0; g < n * groups; g++) {                                                 \
                    int32_t s = 0; /* at most 32 * 32767: exact in a float too */                       \
                    for (int k = 0; k < GROUP; k++) s += xq[g * GROUP + k];                             \
                    xsum[g] = xs[g] * (float)s;                                                         \
                }                                                                                       \
                _Pragma("omp for schedule(static) nowait")                                              \
                for (long o0 = 0; o0 < out; o0 += OUT_CHUNK) {                                          \
                    const long n_out = o0 + OUT_CHUNK < out ? OUT_CHUNK : out - o0;                     \
                    q4_dot_rows##BITS(q + o0 * (in / 2), scale + o0 * groups, minimum + o0 * groups, n_out, xq, xs, \
                                      xsum, n, in, y + r0 * out + o0, out);                            \
                    add_bias(bias, n, out, o0, n_out, y + r0 * out);                                    \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
    }
DEFINE_Q4_LINEAR_INT(8, int8_t)
DEFINE_Q4_LINEAR_INT(16, int16_t)
#define EIGHT_BIT_WAY q4_linear_int8
#define SIXTEEN_BIT_WAY q4_linear_int16
#else
#define EIGHT_BIT_WAY q4_linear_float
#define SIXTEEN_BIT_WAY q4_linear_float
#endif

/* x: [rows, in] float32; q, scale, minimum as above; bias [out] or NULL; y: [rows, out]. kernel: 0-3 as
 * engine.native.INT8_KERNELS: 0 and 1 the float way, 2 the 8-bit integer way, 3 the 16-bit one. */
void cadence_q4_linear(const float *x, long rows, long in, const uint8_t *q, const uint16_t *scale,
                       const uint16_t *minimum, const float *bias, long out, float *y, int kernel) {
    (kernel == 3 ? SIXTEEN_BIT_WAY : kernel == 2 ? EIGHT_BIT_WAY : q4_linear_float)(x, rows, in, q, scale, minimum,
                                                                                   bias, out, y);
}
