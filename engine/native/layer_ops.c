/* The small per-layer operations of a decoder step, fused, for float32 activations on CPU.
 *
 * Each stands for a handful of PyTorch calls (about 5-10 us of dispatch apiece on a 2-core CPU, where
 * the work itself takes well under a microsecond for one row): the residual add with the RMS norm after
 * it, the rotary embedding of q and k, SiLU(gate) * up, and the attention of a step's rows over their
 * slots' cached history (PyTorch's took 300 us a layer for one row of SmolLM2 at 160 positions, padded
 * so that rows do not change each other's sums; here each row and head is computed over exactly its own
 * positions). Every row is computed alone, in one fixed order, so a row's result never depends on the
 * rows beside it. Used by engine/families/decoder.py where the int8 precision runs on the native
 * kernel (float32 activations); float32 keeps PyTorch's ops, the yardstick. */
#include <math.h>
#include <string.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* e^x, the same polynomial in one lane (exp1) and eight (exp8), so a value's result never depends on
 * where it falls in a vector: x clamped to [-87.3, 88.3], e^x = 2^n e^r with |r| <= ln 2 / 2, e^r by
 * Cephes' degree-7 polynomial (about 1e-7 relative error). */
static const float EXP_LO = -87.3f, EXP_HI = 88.3f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f,
                   LN2_LO = -2.12194440e-4f, EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp1(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    const float n = nearbyintf(x * LOG2E);
    float r = fmaf(-n, LN2_HI, x);
    r = fmaf(-n, LN2_LO, r);
    float p = EXP_P[0];
    for (int i = 1; i < 6; i++) p = fmaf(p, r, EXP_P[i]);
    p = fmaf(p, r * r, r + 1.0f);
    return ldexpf(p, (int)n);
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

/* out[r, i] = silu(gate) * up = gate / (1 + e^-gate) * up, gate and up the two halves (f each) of
 * row r of gate_up (rows `stride` floats apart). */
void cadence_silu_mul(const float *gate_up, long rows, long f, long stride, float *out) {
    for (long r = 0; r < rows; r++) {
        const float *g = gate_up + r * stride, *u = g + f;
        float *o = out + r * f;
        long i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= f; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < f; i++) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
    }
}

/* sum = x + h (h may be NULL: sum is not written, x is normed), y = rms_norm(sum) * w, rows of d floats. */
void cadence_add_rms_norm(const float *x, const float *h, long rows, long d, const float *w, float eps,
                          float *sum, float *y) {
    for (long r = 0; r < rows; r++) {
        const float *v = x + r * d;
        if (h) {
            for (long i = 0; i < d; i++) sum[r * d + i] = v[i] + h[r * d + i];
            v = sum + r * d;
        }
        float lanes[8] = {0};
        for (long i = 0; i < d; i++) lanes[i % 8] += v[i] * v[i];
        const float total = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
        const float inv = 1.0f / sqrtf(total / (float)d + eps);
        for (long i = 0; i < d; i++) y[r * d + i] = v[i] * inv * w[i];
    }
}

/* x = the rows of `table` [vocab, d] at `tokens`, normed = rms_norm(x) * w: a step's embedding and its
 * first layer's input norm in one call (the same values as a gather, then cadence_add_rms_norm). */
void cadence_embed_norm(const long *tokens, long rows, const float *table, long d, const float *w, float eps,
                        float *x, float *normed) {
    for (long r = 0; r < rows; r++) memcpy(x + r * d, table + tokens[r] * d, d * sizeof(float));
    cadence_add_rms_norm(x, 0, rows, d, w, eps, x, normed);
}

/* rotate_half rotary embedding, in place, on `heads` heads of `dim` floats at the start of each row
 * (rows `stride` floats apart), with cos/sin tables [positions, dim] and each row's table row. */
void cadence_rotary(float *x, long rows, long stride, long heads, long dim, const float *cos_table,
                    const float *sin_table, const long *table_rows) {
    const long half = dim / 2;
    for (long r = 0; r < rows; r++) {
        const float *c = cos_table + table_rows[r] * dim, *s = sin_table + table_rows[r] * dim;
        for (long h = 0; h < heads; h++) {
            float *p = x + r * stride + h * dim;
            for (long i = 0; i < half; i++) {
                const float a = p[i], b = p[i + half];
                p[i] = a * c[i] - b * s[i];
                p[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* Attention's inner loops, for keys and values stored as float (suffix f32) or as IEEE half floats
 * (f16: Whisper's encoder memory in int8, half the bytes a step reads; converted exactly on loading,
 * with F16C where the CPU has it). q is float. Per (row, head), in one fixed order:
 * - dot: q . k over dim (a multiple of 8): 8 lanes summed in order, then the lanes in a fixed tree;
 * - dot4: four such dots at once (independent chains that overlap), each summed exactly as dot sums it;
 * - weigh: o[i] = (sum over j of w[j] * v[j][i], in order of j) * inv;
 * - attend_one: one query head over n keys and values: softmax(q . k * scale) . v (weights: n floats). */
float cadence_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    float value;
    if (exponent == 0) value = ldexpf((float)mantissa, -24); /* zero or subnormal */
    else if (exponent == 31) value = mantissa ? NAN : INFINITY;
    else value = ldexpf((float)(mantissa | 0x400), (int)exponent - 25);
    union { float f; uint32_t u; } bits = {value};
    bits.u |= sign;
    return bits.f;
}

#define LOAD1_f32(p) (*(p))
#define LOAD1_f16(p) cadence_half_to_float(*(p))
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VECTOR 1
#define LOAD8_f32(p) _mm256_loadu_ps(p)
#define LOAD8_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
static inline float lanes_sum(__m256 acc) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#define DEFINE_ATTEND_ONE(S, T)                                                                           \
    static inline float dot_##S(const float *a, const T *b, long dim) {                                   \
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), LOAD8_##S(b));                                      \
        for (long i = 8; i < dim; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), LOAD8_##S(b + i), acc); \
        return lanes_sum(acc);                                                                             \
    }                                                                                                      \
    static inline void dot4_##S(const float *a, const T *b, long dim, float *s) {                         \
        __m256 acc[4];                                                                                     \
        const __m256 a0 = _mm256_loadu_ps(a);                                                              \
        for (int t = 0; t < 4; t++) acc[t] = _mm256_mul_ps(a0, LOAD8_##S(b + t * dim));                    \
        for (long i = 8; i < dim; i += 8) {                                                                \
            const __m256 ai = _mm256_loadu_ps(a + i);                                                      \
            for (int t = 0; t < 4; t++) acc[t] = _mm256_fmadd_ps(ai, LOAD8_##S(b + t * dim + i), acc[t]);  \
        }                                                                                                  \
        for (int t = 0; t < 4; t++) s[t] = lanes_sum(acc[t]);                                              \
    }                                                                                                      \
    static inline void weigh_##S(const float *w, const T *v, long n, long dim, float inv, float *o) {     \
        for (long i0 = 0; i0 < dim; i0 += 32) {                                                            \
            const int parts = dim - i0 >= 32 ? 4 : (int)((dim - i0) / 8);                                 \
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}; \
            for (long j = 0; j < n; j++) {                                                                 \
                const __m256 wj = _mm256_broadcast_ss(w + j);                                              \
                for (int t = 0; t < parts; t++) acc[t] = _mm256_fmadd_ps(wj, LOAD8_##S(v + j * dim + i0 + 8 * t), acc[t]); \
            }                                                                                              \
            for (int t = 0; t < parts; t++) _mm256_storeu_ps(o + i0 + 8 * t, _mm256_mul_ps(acc[t], _mm256_set1_ps(inv))); \
        }                                                                                                  \
    }                                                                                                      \
    ATTEND_ONE(S, T)
#else
#define VECTOR 0
#define DEFINE_ATTEND_ONE(S, T)                                                                           \
    static inline float dot_##S(const float *a, const T *b, long dim) {                                   \
        float lanes[8];                                                                                    \
        for (int l = 0; l < 8; l++) lanes[l] = a[l] * LOAD1_##S(b + l);                                    \
        for (long i = 8; i < dim; i++) lanes[i % 8] += a[i] * LOAD1_##S(b + i);                            \
        return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7])); \
    }                                                                                                      \
    static inline void dot4_##S(const float *a, const T *b, long dim, float *s) {                         \
        for (int t = 0; t < 4; t++) s[t] = dot_##S(a, b + t * dim, dim);                                   \
    }                                                                                                      \
    static inline void weigh_##S(const float *w, const T *v, long n, long dim, float inv, float *o) {     \
        for (long i = 0; i < dim; i++) {                                                                   \
            float acc = 0;                                                                                 \
            for (long j = 0; j < n; j++) acc += w[j] * LOAD1_##S(v + j * dim + i);                         \
            o[i] = acc * inv;                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    ATTEND_ONE(S, T)
#endif

#define ATTEND_ONE(S, T)                                                                                  \
    static void attend_one_##S(const float *qh, const T *keys, const T *values, long n, long dim, float scale, \
                               float *weights, float *out) {                                               \
        float top = -INFINITY;                                                                             \
        long j = 0;                                                                                        \
        for (; j + 4 <= n; j += 4) {                                                                       \
            float s[4];                                                                                    \
            dot4_##S(qh, keys + j * dim, dim, s);                                                          \
            for (int t = 0; t < 4; t++) {                                                                  \
                weights[j + t] = s[t] * scale;                                                             \
                if (s[t] * scale > top) top = s[t] * scale;                                                \
            }                                                                                              \
        }                                                                                                  \
        for (; j < n; j++) {                                                                               \
            const float s = dot_##S(qh, keys + j * dim, dim) * scale;                                      \
            weights[j] = s;                                                                                \
            if (s > top) top = s;                                                                          \
        }                                                                                                  \
        exponentiate(weights, n, top);                                                                     \
        float total = 0;                                                                                   \
        for (long t = 0; t < n; t++) total += weights[t];                                                  \
        weigh_##S(weights, values, n, dim, 1.0f / total, out);                                             \
    }

/* w[t] = e^(w[t] - top), t < n, the same polynomial in every lane. */
static inline void exponentiate(float *w, long n, float top) {
    long t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; t + 8 <= n; t += 8) _mm256_storeu_ps(w + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(w + t), _mm256_set1_ps(top))));
#endif
    for (; t < n; t++) w[t] = exp1(w[t] - top);
}

DEFINE_ATTEND_ONE(f32, float)
DEFINE_ATTEND_ONE(f16, uint16_t)

/* Causal self-attention of a step's new rows over their slots' cached history (float32), the rows'
 * own keys and values written into the cache first.
 * q: row r's head h at q + r * q_stride + h * dim; k, v likewise (kv_heads heads, query head h reads
 * key head h / (heads / kv_heads)); cache_k, cache_v: [slots, kv_heads, positions, dim] with the given
 * slot and head strides (positions dim apart); a row at position p attends to positions
 * max(0, p - window + 1) .. p (window 0: from 0). out: [rows, heads * dim].
 * Each (row, head) is computed alone over exactly its own positions, in one order, so a row's result
 * never depends on what else shares the step (how many slots, rows or positions). */
void cadence_attend(const float *q, long q_stride, const float *k, long k_stride, const float *v, long v_stride,
                    long rows, long heads, long kv_heads, long dim, const long *row_slots, const long *row_positions,
                    float *cache_k, float *cache_v, long slot_stride, long head_stride, long window, float scale,
                    float *out) {
    long longest = 0;
    for (long r = 0; r < rows; r++) {
        for (long g = 0; g < kv_heads; g++) {
            const long at = row_slots[r] * slot_stride + g * head_stride + row_positions[r] * dim;
            for (long i = 0; i < dim; i++) {
                cache_k[at + i] = k[r * k_stride + g * dim + i];
                cache_v[at + i] = v[r * v_stride + g * dim + i];
            }
        }
        if (row_positions[r] + 1 > longest) longest = row_positions[r] + 1;
    }
    const long group = heads / kv_heads;
#pragma omp parallel if (rows * heads * longest >= 1024)
    {
        float *weights = malloc(sizeof(float) * (size_t)longest);
#pragma omp for schedule(static)
        for (long job = 0; job < rows * heads; job++) {
            const long r = job / heads, h = job % heads, p = row_positions[r];
            const long first = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
            const long base = row_slots[r] * slot_stride + (h / group) * head_stride + first * dim;
            attend_one_f32(q + r * q_stride + h * dim, cache_k + base, cache_v + base, p + 1 - first, dim, scale,
                       weights, out + r * heads * dim + h * dim);
        }
        free(weights);
    }
}

/* Attention of a step's rows over their slots' fixed memory (Whisper's encoder output, projected): row r's
 * head h reads positions 0 .. length - 1 of memory_k, memory_v [slots, heads, positions, dim] (slot and
 * head strides given; float, or half floats in the _f16 version) at its slot. q as in cadence_attend;
 * out: [rows, heads * dim]. */
#define DEFINE_ATTEND_MEMORY(S, T)                                                                        \
    void cadence_attend_memory_##S(const float *q, long q_stride, long rows, long heads, long dim,        \
                                   const long *row_slots, const T *memory_k, const T *memory_v,            \
                                   long slot_stride, long head_stride, long length, float scale, float *out) { \
        _Pragma("omp parallel if (rows * heads * length >= 1024)") {                                       \
            float *weights = malloc(sizeof(float) * (size_t)length);                                       \
            _Pragma("omp for schedule(static)")                                                            \
            for (long job = 0; job < rows * heads; job++) {                                                \
                const long r = job / heads, h = job % heads, base = row_slots[r] * slot_stride + h * head_stride; \
                attend_one_##S(q + r * q_stride + h * dim, memory_k + base, memory_v + base, length, dim, scale, \
                               weights, out + r * heads * dim + h * dim);                                  \
            }                                                                                              \
            free(weights);                                                                                 \
        }                                                                                                  \
    }
DEFINE_ATTEND_MEMORY(f32, float)
DEFINE_ATTEND_MEMORY(f16, uint16_t)

/* Whether half floats are converted with F16C here (else in plain C, slower, the same values). */
int cadence_f16c(void) { return VECTOR; }
