/* The small per-layer operations of a decoder step, fused, for float32 activations on CPU.
 *
 * Each is a handful of PyTorch calls (about 5-10 us of dispatch apiece on a 2-core CPU, where the work
 * itself takes well under a microsecond for one row): the residual add and the RMS norm after it, and
 * the rotary embedding of q and k. Every row is computed alone, in one fixed order, so a row's result
 * never depends on the rows beside it. Used by engine/families/decoder.py where the int8 precision runs
 * on the native kernel (float32 activations); float32 keeps PyTorch's ops, the yardstick. */
#include <math.h>

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
