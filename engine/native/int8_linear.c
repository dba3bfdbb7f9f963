/* Weight-only int8 matrix product for decoding on CPU: y[r, o] = bias[o] + sum_i x[r, i] * q[o, i] * scale[o, i / 32].
 *
 * Weights are int8 in groups of 32 along the input, one float scale per group (what llama.cpp calls
 * Q8_0); activations stay float32. Each output channel is dequantized once per call into a per-thread
 * float buffer (16 channels: L1/L2-sized), then dotted with every row. Each (row, output) sum is computed by one
 * thread in one fixed order (one 8-lane sum over the input, then its lanes), whatever other rows share
 * the call, so batched decoding equals serial decoding. Three kernels (engine.native.INT8_KERNELS picks one
 * per machine): this one, the same in 16 lanes (AVX-512), and one that rounds the activations to int8 too
 * and multiplies integers (at the end of this file).
 * Built on the user's machine with -march=native by engine/native, called through ctypes. */
#include <stdint.h>

#define GROUP 32
#define OUT_CHUNK 16 /* outputs a thread takes at a time */
#define MAX_IN 16384 /* inputs per layer (a 7B model's widest is 14336) */
#define PREFETCH 1024 /* bytes of weight asked for ahead of the one dequantized (the next channel's, at a row's end) */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SIMD 1

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static void dequantize(const int8_t *q, const float *s, long in, float *w) {
    for (long g = 0; g < in / GROUP; g++) {
        _mm_prefetch((const char *)(q + g * GROUP + PREFETCH), _MM_HINT_T0); /* 5-10% faster on a Zen 3, side by side */
        const __m256 scale = _mm256_broadcast_ss(s + g);
        for (int k = 0; k < GROUP; k += 8) {
            const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + g * GROUP + k));
            _mm256_storeu_ps(w + g * GROUP + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale));
        }
    }
}

/* PREFIX_OB_RB: OB outputs (dequantized rows of w, `in` apart) against RB rows of x, one LANES-lane sum
 * per (output, row) over the input in order, so a row's arithmetic is the same in every tile shape. */
#define DEFINE_TILE(PREFIX, VEC, LANES, ZERO, LOADU, LOAD, FMA, HSUM, OB, RB)                           \
    static void PREFIX##_##OB##_##RB(const float *w, const float *x, long in, float *y, long ldy) {      \
        VEC acc[OB][RB];                                                                                 \
        _Pragma("GCC unroll 8") for (int c = 0; c < OB; c++)                                             \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) acc[c][r] = ZERO();                     \
        for (long i = 0; i < in; i += LANES) {                                                           \
            VEC xv[RB];                                                                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) xv[r] = LOADU(x + r * in + i);          \
            _Pragma("GCC unroll 8") for (int c = 0; c < OB; c++) {                                       \
                const VEC wv = LOAD(w + c * in + i);                                                     \
                _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) acc[c][r] = FMA(wv, xv[r], acc[c][r]); \
            }                                                                                            \
        }                                                                                                \
        _Pragma("GCC unroll 8") for (int c = 0; c < OB; c++)                                             \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) y[r * ldy + c] = HSUM(acc[c][r]);      \
    }

#define SHAPE(PREFIX, RB, OB)                                                                          \
    case RB:                                                                                           \
        for (; c + OB <= n_out; c += OB) PREFIX##_##OB##_##RB(w + c * in, xr, in, yr + c, ldy);        \
        for (; c < n_out; c++) PREFIX##_1_##RB(w + c * in, xr, in, yr + c, ldy);                       \
        break;

/* NAME: n_out dequantized outputs (w: [n_out, in]) against every row of x, 4 rows at a time, in tiles
 * of OB1..OB4 outputs for 1..4 rows; y[r * ldy + c]. */
#define DEFINE_DOT_ROWS(NAME, PREFIX, OB1, OB2, OB3, OB4)                                               \
    static void NAME(const float *w, long n_out, const float *x, long rows, long in, float *y, long ldy) { \
        for (long r0 = 0; r0 < rows; r0 += 4) {                                                        \
            const int n = rows - r0 < 4 ? (int)(rows - r0) : 4;                                        \
            const float *xr = x + r0 * in;                                                             \
            float *yr = y + r0 * ldy;                                                                  \
            long c = 0;                                                                                \
            switch (n) { SHAPE(PREFIX, 1, OB1) SHAPE(PREFIX, 2, OB2) SHAPE(PREFIX, 3, OB3) SHAPE(PREFIX, 4, OB4) } \
        }                                                                                              \
    }

#define TILE8(OB, RB) DEFINE_TILE(tile, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_load_ps, _mm256_fmadd_ps, hsum, OB, RB)
TILE8(8, 1) TILE8(4, 2) TILE8(2, 3) TILE8(2, 4) TILE8(1, 1) TILE8(1, 2) TILE8(1, 3) TILE8(1, 4)
DEFINE_DOT_ROWS(dot_rows, tile, 8, 4, 2, 2)
#else
#define SIMD 0
/* Without AVX2 and FMA: plain C, the same structure (8 lanes summed per row, then combined). */
static void dequantize(const int8_t *q, const float *s, long in, float *w) {
    for (long i = 0; i < in; i++) w[i] = (float)q[i] * s[i / GROUP];
}

static void dot_rows(const float *w, long n_out, const float *x, long rows, long in, float *y, long ldy) {
    for (long c = 0; c < n_out; c++)
        for (long r = 0; r < rows; r++) {
            float lanes[8] = {0};
            for (long i = 0; i < in; i++) lanes[i % 8] += w[c * in + i] * x[r * in + i];
            y[r * ldy + c] = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
        }
}
#endif

int cadence_int8_simd(void) { return SIMD; }

int cadence_int8_group(void) { return GROUP; }

int cadence_int8_max_in(void) { return MAX_IN; }

typedef void (*dequantize_fn)(const int8_t *, const float *, long, float *);
typedef void (*dot_rows_fn)(const float *, long, const float *, long, long, float *, long);
typedef void (*rebuild_fn)(const void *weights, long c, long in, float *w); /* output c's weights, in float */

/* Each thread OUT_CHUNK outputs at a time: each output's weights rebuilt in float (a per-thread buffer), then
 * dotted with every row by DOT. */
static void rebuilt_linear(const float *x, long rows, long in, const void *weights, rebuild_fn rebuild,
                           const float *bias, long out, float *y, dot_rows_fn dot) {
#pragma omp parallel
    {
        static __thread float w[OUT_CHUNK * MAX_IN] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (long o0 = 0; o0 < out; o0 += OUT_CHUNK) {
            const long n_out = o0 + OUT_CHUNK < out ? OUT_CHUNK : out - o0;
            for (long c = 0; c < n_out; c++) rebuild(weights, o0 + c, in, w + c * in);
            dot(w, n_out, x, rows, in, y + o0, out);
            if (bias)
                for (long r = 0; r < rows; r++)
                    for (long o = o0; o < o0 + n_out; o++) y[r * out + o] += bias[o];
        }
    }
}

/* For q4_linear.c: rebuilt_linear on this file's 8-lane float tiles. */
void cadence_rebuilt_linear(const float *x, long rows, long in, const void *weights, rebuild_fn rebuild,
                            const float *bias, long out, float *y) {
    rebuilt_linear(x, rows, in, weights, rebuild, bias, out, y, dot_rows);
}

struct int8_weights {
    const int8_t *q;
    const float *scale;
    dequantize_fn dequantize;
};

static void rebuild_int8(const void *weights, long c, long in, float *w) {
    const struct int8_weights *m = weights;
    m->dequantize(m->q + c * in, m->scale + c * (in / GROUP), in, w);
}

static void int8_linear(const float *x, long rows, long in, const int8_t *q, const float *scale, const float *bias,
                        long out, float *y, dequantize_fn deq, dot_rows_fn dot) {
    const struct int8_weights weights = {q, scale, deq};
    rebuilt_linear(x, rows, in, &weights, rebuild_int8, bias, out, y, dot);
}

/* x: [rows, in] float32, q: [out, in] int8, scale: [out, in / 32] float32, bias: [out] float32 or NULL,
 * y: [rows, out] float32. `in` must be a multiple of 32 and at most MAX_IN. */
void cadence_int8_linear(const float *x, long rows, long in, const int8_t *q, const float *scale,
                         const float *bias, long out, float *y) {
    int8_linear(x, rows, in, q, scale, bias, out, y, dequantize, dot_rows);
}

#if defined(__AVX512F__)
/* The same product in 16 lanes (AVX-512), for processors that have it: one 16-lane sum per (row, output)
 * over the input in order, then its lanes in a fixed order, so here too a row's bits never depend on its
 * batch mates (but differ from the 8-lane kernel's). engine/native times both once per machine. */
static inline float hsum16(__m512 v) {
    const __m256 lo = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static void dequantize16(const int8_t *q, const float *s, long in, float *w) {
    for (long g = 0; g < in / GROUP; g++) {
        _mm_prefetch((const char *)(q + g * GROUP + PREFETCH), _MM_HINT_T0);
        const __m512 scale = _mm512_set1_ps(s[g]);
        for (int k = 0; k < GROUP; k += 16) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(q + g * GROUP + k));
            _mm512_store_ps(w + g * GROUP + k, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale));
        }
    }
}

#define TILE16(OB, RB) DEFINE_TILE(tile16, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_load_ps, _mm512_fmadd_ps, hsum16, OB, RB)
TILE16(8, 1) TILE16(8, 2) TILE16(4, 3) TILE16(4, 4) TILE16(1, 1) TILE16(1, 2) TILE16(1, 3) TILE16(1, 4)
DEFINE_DOT_ROWS(dot_rows16, tile16, 8, 8, 4, 4)

int cadence_int8_has16(void) { return 1; }

void cadence_int8_linear16(const float *x, long rows, long in, const int8_t *q, const float *scale,
                           const float *bias, long out, float *y) {
    int8_linear(x, rows, in, q, scale, bias, out, y, dequantize16, dot_rows16);
}
#else
int cadence_int8_has16(void) { return 0; }

void cadence_int8_linear16(const float *x, long rows, long in, const int8_t *q, const float *scale,
                           const float *bias, long out, float *y) {
    cadence_int8_linear(x, rows, in, q, scale, bias, out, y);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* The same weights against activations rounded to int8 too: each row is cut into groups of 32 inputs, each
 * group scaled by its largest magnitude to [-127, 127] and rounded to nearest (even); a (row, output) sum is
 * then, group by group in order, the exact integer dot product of the two int8 groups times both scales,
 * added into 8 float lanes, then the lanes in a fixed order: what llama.cpp computes for Q8_0 weights. The
 * integer products cost a fraction of float conversions (VNNI where the CPU has it, else AVX2 pairs), and
 * a row's rounding and sums never depend on its batch mates, so batched decoding still equals serial. */
#define QROWS 16 /* rows a thread rounds at a time (its own copy: no thread waits for another) */

/* A group's 32 inputs into v, and their largest magnitude. */
static inline float load_group(const float *xg, __m256 v[4]) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(xg + 8 * k);
        m = _mm256_max_ps(m, _mm256_and_ps(v[k], magnitude));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

static void quantize_rows(const float *x, long rows, long in, int8_t *q, float *d) {
    const __m256i unpack = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' lane interleave */
    for (long g = 0; g < rows * (in / GROUP); g++) {
        __m256 v[4];
        const float amax = load_group(x + g * GROUP, v);
        d[g] = amax / 127.0f;
        const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i i[4];
        for (int k = 0; k < 4; k++) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inverse));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256((__m256i *)(q + g * GROUP), _mm256_permutevar8x32_epi32(bytes, unpack));
    }
}

static inline __m256 dot_group(__m256i w, __m256i x) { /* 8 lanes of 4 products each, exact */
    const __m256i magnitude = _mm256_sign_epi8(w, w), signed_x = _mm256_sign_epi8(x, w);
#if defined(__AVXVNNI__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), magnitude, signed_x));
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, signed_x));
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), _mm256_set1_epi16(1)));
#endif
}

/* PREFIX_OB_RB: OB outputs' int8 weights (rows of w, `in` apart; scales sw, `groups` apart) against RB
 * rounded rows (x, sx); prefetches each weight row QPREFETCH bytes ahead (small layers stream from memory). */
#define QPREFETCH 4096
#define DEFINE_QTILE(OB, RB)                                                                             \
    static void qtile_##OB##_##RB(const int8_t *w, const float *sw, const int8_t *x, const float *sx,     \
                                  long in, float *y, long ldy) {                                          \
        const long groups = in / GROUP;                                                                   \
        __m256 acc[OB][RB];                                                                               \
        _Pragma("GCC unroll 8") for (int c = 0; c < OB; c++)                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) acc[c][r] = _mm256_setzero_ps();         \
        for (long g = 0; g < groups; g++) {                                                               \
            __m256i xv[RB];                                                                               \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                          \
                xv[r] = _mm256_loadu_si256((const __m256i *)(x + r * in + g * GROUP));                    \
            _Pragma("GCC unroll 8") for (int c = 0; c < OB; c++) {                                        \
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + c * in + g * GROUP));         \
                _mm_prefetch((const char *)(w + c * in + g * GROUP + QPREFETCH), _MM_HINT_T0);            \
                _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++)                                      \
                    acc[c][r] = _mm256_fmadd_ps(dot_group(wv, xv[r]),                                     \
                                                _mm256_set1_ps(sw[c * groups + g] * sx[r * groups + g]), acc[c][r]); \
            }                                                                                             \
        }                                                                                                 \
        _Pragma("GCC unroll 8") for (int c = 0; c < OB; c++)                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) y[r * ldy + c] = hsum(acc[c][r]);       \
    }
DEFINE_QTILE(4, 1) DEFINE_QTILE(4, 2) DEFINE_QTILE(2, 3) DEFINE_QTILE(2, 4)
DEFINE_QTILE(1, 1) DEFINE_QTILE(1, 2) DEFINE_QTILE(1, 3) DEFINE_QTILE(1, 4)

#define QSHAPE(PREFIX, RB, OB)                                                                           \
    case RB:                                                                                             \
        for (; c + OB <= n_out; c += OB) PREFIX##_##OB##_##RB(w + c * in, sw + c * groups, xr, sxr, in, yr + c, ldy); \
        for (; c < n_out; c++) PREFIX##_1_##RB(w + c * in, sw + c * groups, xr, sxr, in, yr + c, ldy);  \
        break;

/* NAME: n_out outputs' int8 weights against `rows` rounded rows of element type T, 4 rows at a time, in
 * the tiles PREFIX_OB_RB (4, 4, 2, 2 outputs for 1..4 rows). */
#define DEFINE_QDOT_ROWS(NAME, PREFIX, T)                                                                \
    static void NAME(const int8_t *w, const float *sw, long n_out, const T *x, const float *sx, long rows, \
                     long in, float *y, long ldy) {                                                      \
        const long groups = in / GROUP;                                                                  \
        for (long r0 = 0; r0 < rows; r0 += 4) {                                                          \
            const int n = rows - r0 < 4 ? (int)(rows - r0) : 4;                                          \
            const T *xr = x + r0 * in;                                                                   \
            const float *sxr = sx + r0 * groups;                                                         \
            float *yr = y + r0 * ldy;                                                                    \
            long c = 0;                                                                                  \
            switch (n) { QSHAPE(PREFIX, 1, 4) QSHAPE(PREFIX, 2, 4) QSHAPE(PREFIX, 3, 2) QSHAPE(PREFIX, 4, 2) } \
        }                                                                                                \
    }

/* NAME: as cadence_int8_linear, with each thread rounding QROWS rows at a time to T by QUANTIZE (its own
 * copy: no thread waits for another), then DOT_ROWS over its share of the outputs. */
#define DEFINE_INTEGER_LINEAR(NAME, T, QUANTIZE, DOT_ROWS)                                               \
    void NAME(const float *x, long rows, long in, const int8_t *q, const float *scale, const float *bias, \
              long out, float *y) {                                                                      \
        const long groups = in / GROUP;                                                                  \
        _Pragma("omp parallel") {                                                                        \
            static __thread T xq[QROWS * MAX_IN] __attribute__((aligned(64)));                           \
            static __thread float xs[QROWS * MAX_IN / GROUP];                                            \
            for (long r0 = 0; r0 < rows; r0 += QROWS) {                                                  \
                const long n = rows - r0 < QROWS ? rows - r0 : QROWS;                                    \
                QUANTIZE(x + r0 * in, n, in, xq, xs);                                                    \
                _Pragma("omp for schedule(static) nowait")                                               \
                for (long o0 = 0; o0 < out; o0 += OUT_CHUNK) {                                           \
                    const long n_out = o0 + OUT_CHUNK < out ? OUT_CHUNK : out - o0;                      \
                    DOT_ROWS(q + o0 * in, scale + o0 * groups, n_out, xq, xs, n, in, y + r0 * out + o0, out); \
                    if (bias)                                                                            \
                        for (long r = r0; r < r0 + n; r++)                                               \
                            for (long o = o0; o < o0 + n_out; o++) y[r * out + o] += bias[o];            \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }

DEFINE_QDOT_ROWS(qdot_rows, qtile, int8_t)

int cadence_int8_has_int8_dot(void) { return 1; }

/* Rows rounded to int8 per 32 inputs as above (q4_linear.c's 8-bit way reads them). */
void cadence_round_rows8(const float *x, long rows, long in, int8_t *q, float *d) { quantize_rows(x, rows, in, q, d); }

/* As cadence_int8_linear, with the activations rounded to int8 as above. */
DEFINE_INTEGER_LINEAR(cadence_int8_linear_int8_dot, int8_t, quantize_rows, qdot_rows)
#else
int cadence_int8_has_int8_dot(void) { return 0; }

void cadence_int8_linear_int8_dot(const float *x, long rows, long in, const int8_t *q, const float *scale,
                                  const float *bias, long out, float *y) {
    cadence_int8_linear(x, rows, in, q, scale, bias, out, y);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* The same weights against activations rounded to int16 (per 32 inputs, scaled by the group's largest
 * magnitude to [-32767, 32767], rounded to nearest even): 256 times finer than int8, so its results stay as
 * close to float32's as the float kernels' (the weights' own rounding dominates), while a group's products
 * are still exact integers (each 16-bit pair product-summed into 32 bits, at most 32 * 127 * 32767 < 2^24,
 * so exact in float too) and no weight is converted to float: for the products whose inputs rounding to int8
 * harms (the MLP's down projection, the output layer). Per (row, output): group by group in order, then the
 * 8 lanes in a fixed order, each row alone, so batched decoding still equals serial. */
static void quantize_rows16(const float *x, long rows, long in, int16_t *q, float *d) {
    for (long g = 0; g < rows * (in / GROUP); g++) {
        __m256 v[4];
        const float amax = load_group(x + g * GROUP, v);
        d[g] = amax / 32767.0f;
        const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
        for (int k = 0; k < 4; k += 2) {
            const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inverse));
            const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[k + 1], inverse));
            /* packs interleaves 128-bit halves: a0-3 b0-3 a4-7 b4-7; the permute puts them back in order */
            _mm256_storeu_si256((__m256i *)(q + g * GROUP + 8 * k),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
        }
    }
}

#define DEFINE_WTILE(OB, RB)                                                                             \
    static void wtile_##OB##_##RB(const int8_t *w, const float *sw, const int16_t *x, const float *sx,    \
                                  long in, float *y, long ldy) {                                          \
        const long groups = in / GROUP;                                                                   \
        __m256 acc[OB][RB];                                                                               \
        _Pragma("GCC unroll 8") for (int c = 0; c < OB; c++)                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) acc[c][r] = _mm256_setzero_ps();         \
        for (long g = 0; g < groups; g++) {                                                               \
            _Pragma("GCC unroll 8") for (int c = 0; c < OB; c++) {                                        \
                const int8_t *wg = w + c * in + g * GROUP;                                                \
                _mm_prefetch((const char *)(wg + QPREFETCH), _MM_HINT_T0);                                \
                const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)wg));            \
                const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wg + 16)));     \
                _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) {                                    \
                    const int16_t *xg = x + r * in + g * GROUP;                                           \
                    const __m256i sum = _mm256_add_epi32(                                                 \
                        _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xg)),                   \
                        _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xg + 16))));           \
                    acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),                                  \
                                                _mm256_set1_ps(sw[c * groups + g] * sx[r * groups + g]), acc[c][r]); \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        _Pragma("GCC unroll 8") for (int c = 0; c < OB; c++)                                              \
            _Pragma("GCC unroll 8") for (int r = 0; r < RB; r++) y[r * ldy + c] = hsum(acc[c][r]);       \
    }
DEFINE_WTILE(4, 1) DEFINE_WTILE(4, 2) DEFINE_WTILE(2, 3) DEFINE_WTILE(2, 4)
DEFINE_WTILE(1, 1) DEFINE_WTILE(1, 2) DEFINE_WTILE(1, 3) DEFINE_WTILE(1, 4)

DEFINE_QDOT_ROWS(wdot_rows, wtile, int16_t)

/* For q4_linear.c: rows rounded to int16 as above. */
void cadence_round_rows16(const float *x, long rows, long in, int16_t *q, float *d) { quantize_rows16(x, rows, in, q, d); }

/* As cadence_int8_linear, with the activations rounded to int16 as above. */
DEFINE_INTEGER_LINEAR(cadence_int8_linear_int16_dot, int16_t, quantize_rows16, wdot_rows)
#else
void cadence_int8_linear_int16_dot(const float *x, long rows, long in, const int8_t *q, const float *scale,
                                   const float *bias, long out, float *y) {
    cadence_int8_linear(x, rows, in, q, scale, bias, out, y);
}
#endif
