"""Is one stream's int8 decode bound by the kernel's arithmetic or by memory? The native kernels
(engine/native/int8_linear.c, q4_linear.c) timed from C, without Python or PyTorch between the calls:

    .venv/bin/python bench/int8_roofline.py [--threads 1,2] [--repeats 30]

- **in cache**: one gate/up product of SmolLM2-135M (576 -> 3072, 1.8 MB of int8 weights and scales),
  again and again, so its weights come from the caches: what the kernel's arithmetic allows;
- **streamed**: every product of one SmolLM2-135M decode step at one row (30 layers' q/k/v, out,
  gate/up and down, then the 49152-row output layer: 151 MB, far larger than the caches), in order:
  what one token's products take when their weights come from memory;
- **plain read**: a buffer of the same 151 MB summed with AVX2 loads and nothing else, on the same
  threads: this machine's memory read rate, the bound for the line above.

Kernels: i16dot and i8dot (int8 weights, activations rounded to int16 or int8), and q4 (the layers in their
own 4-bit weights, as int8 precision keeps SmolLM2's, scales and minimums in half floats, with the output layer on i16dot:
98 MB a step instead of 151; activations rounded to int16), and q4i8 (the same, activations rounded to int8).

When "streamed" sits near "plain read" and far below "in cache", the step is bound by memory: only
fewer bytes a weight (4-bit weights, as llama.cpp reads them) make it faster. Prints the CPU model;
run on a quiet machine. Needs the C compiler engine/native builds with (AVX2 and FMA)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HARNESS = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <stdint.h>
#define GROUP 32
typedef void (*product)(const float *, long, long, const int8_t *, const float *, const float *, long, float *);
void cadence_int8_linear_int8_dot(const float *, long, long, const int8_t *, const float *, const float *, long, float *);
void cadence_int8_linear_int16_dot(const float *, long, long, const int8_t *, const float *, const float *, long, float *);
void cadence_q4_linear(const float *, long, long, const uint8_t *, const uint16_t *, const uint16_t *, const float *,
                       long, float *, int);
static const uint16_t *minimums;  /* q4: one buffer of minimums (half floats), as large as the largest layer needs */

static void q4_way(const float *x, long rows, long in, const int8_t *q, const float *scale, const float *bias,
                   long out, float *y, int kernel) {
    if (in == 576 && out == 49152) /* the output layer stays int8 */
        cadence_int8_linear_int16_dot(x, rows, in, q, scale, bias, out, y);
    else
        cadence_q4_linear(x, rows, in, (const uint8_t *)q, (const uint16_t *)scale, minimums, bias, out, y, kernel);
}
static void q4_product(const float *x, long rows, long in, const int8_t *q, const float *scale, const float *bias,
                       long out, float *y) { q4_way(x, rows, in, q, scale, bias, out, y, 3); }
static void q4_product8(const float *x, long rows, long in, const int8_t *q, const float *scale, const float *bias,
                        long out, float *y) { q4_way(x, rows, in, q, scale, bias, out, y, 2); }

static double best_of(int repeats, int calls, product run, int n, int8_t **q, float **s, const long *in,
                      const long *out, const float *x, float *y) {
    double best = 1e9;
    for (int r = 0; r < repeats; r++) {
        const double t0 = omp_get_wtime();
        for (int c = 0; c < calls; c++)
            for (int m = 0; m < n; m++) run(x, 1, in[m], q[m], s[m], NULL, out[m], y);
        const double t = (omp_get_wtime() - t0) / calls;
        if (t < best) best = t;
    }
    return best;
}

int main(int argc, char **argv) {
    const int repeats = atoi(argv[1]);
    /* SmolLM2-135M: q/k/v 576 -> 960, out 576 -> 576, gate/up 576 -> 3072, down 1536 -> 576, x30; output 576 -> 49152 */
    const long shapes[5][2] = {{576, 960}, {576, 576}, {576, 3072}, {1536, 576}, {576, 49152}};
    enum { N = 121 };
    int8_t *q[N];
    float *s[N], *s_q4[N]; /* s_q4: the 4-bit layers' scales as half floats (the output layer's int8 ones as they are) */
    long in[N], out[N];
    double bytes = 0;
    for (int m = 0; m < N; m++) {
        const int k = m == N - 1 ? 4 : m % 4;
        in[m] = shapes[k][0], out[m] = shapes[k][1];
        q[m] = aligned_alloc(64, in[m] * out[m]);
        s[m] = malloc(out[m] * (in[m] / GROUP) * sizeof(float));
        for (long i = 0; i < in[m] * out[m]; i++) q[m][i] = (int8_t)((i * 37 + m) % 255 - 127);
        for (long i = 0; i < out[m] * (in[m] / GROUP); i++) s[m][i] = 0.001f * (1 + i % 7);
        uint16_t *h = malloc(out[m] * (in[m] / GROUP) * sizeof(uint16_t));
        for (long i = 0; i < out[m] * (in[m] / GROUP); i++) h[i] = _cvtss_sh(s[m][i], 0);
        s_q4[m] = m == N - 1 ? s[m] : (float *)h;
        bytes += in[m] * out[m] + out[m] * (in[m] / GROUP) * sizeof(float);
    }
    float *x = malloc(1536 * sizeof(float)), *y = malloc(49152 * sizeof(float));
    for (int i = 0; i < 1536; i++) x[i] = (float)(i % 11) * 0.1f - 0.5f;
    uint16_t *m = calloc(3072 * 48, sizeof(uint16_t));
    minimums = m;
    double q4_bytes = 0; /* the layers' codes (half a byte), scales and minimums, and the int8 output layer */
    for (int k = 0; k < N; k++)
        q4_bytes += k == N - 1 ? in[k] * out[k] + out[k] * (in[k] / GROUP) * 4.0
                              : in[k] * out[k] / 2.0 + 2.0 * out[k] * (in[k] / GROUP) * 2;
    const char *names[4] = {"i16dot", "i8dot", "q4", "q4i8"};
    const product runs[4] = {cadence_int8_linear_int16_dot, cadence_int8_linear_int8_dot, q4_product, q4_product8};
    for (int k = 0; k < 4; k++) {
        float **scales = k >= 2 ? s_q4 : s;
        const double hot = best_of(repeats, 50, runs[k], 1, q + 2, scales + 2, in + 2, out + 2, x, y);
        const double layer = in[2] * out[2] + out[2] * (in[2] / GROUP) * sizeof(float);
        const double hot_bytes = k >= 2 ? in[2] * out[2] / 2.0 + 2 * out[2] * (in[2] / GROUP) * sizeof(uint16_t) : layer;
        const double streamed = best_of(repeats, 1, runs[k], N, q, scales, in, out, x, y);
        printf("%s in-cache %.1f GB/s\n%s streamed %.1f GB/s %.2f ms\n", names[k], hot_bytes / hot / 1e9, names[k],
               (k >= 2 ? q4_bytes : bytes) / streamed / 1e9, streamed * 1e3);
    }
    const long n = (long)bytes / 64 * 64;
    char *buffer = aligned_alloc(64, n);
    memset(buffer, 1, n);
    double best = 1e9;
    long total = 0;
    for (int r = 0; r < repeats; r++) {
        const double t0 = omp_get_wtime();
        long sum = 0;
#pragma omp parallel reduction(+ : sum)
        {
            __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
#pragma omp for schedule(static)
            for (long i = 0; i < n; i += 64) {
                a = _mm256_add_epi8(a, _mm256_load_si256((const __m256i *)(buffer + i)));
                b = _mm256_add_epi8(b, _mm256_load_si256((const __m256i *)(buffer + i + 32)));
            }
            sum += _mm256_extract_epi8(_mm256_add_epi8(a, b), 0);
        }
        const double t = omp_get_wtime() - t0;
        total += sum;
        if (t < best) best = t;
    }
    printf("read %.1f GB/s %ld\n", n / best / 1e9, total % 2);
    return 0;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default=",".join(str(t) for t in sorted({1, os.cpu_count() or 1})),
                        help="thread counts to run (default: 1 and every core)")
    parser.add_argument("--repeats", type=int, default=30, help="each figure is the best of this many runs")
    args = parser.parse_args()

    from engine.calibration import device_identity
    from engine.native import FLAGS, _compiler

    compiler = _compiler()
    if compiler is None:
        sys.exit("No C compiler found: the native int8 kernels cannot be built here.")
    sources = sorted(str(p) for p in (ROOT / "engine" / "native").glob("*.c"))
    with tempfile.TemporaryDirectory() as folder:
        harness, program = Path(folder) / "roofline.c", Path(folder) / "roofline"
        harness.write_text(HARNESS)
        flags = [f for f in FLAGS if f not in ("-shared", "-fPIC")]
        built = subprocess.run([compiler, *flags, "-o", str(program), str(harness), *sources, "-lm"],
                               capture_output=True, text=True)
        if built.returncode != 0:
            sys.exit(f"The harness did not compile: {built.stderr.strip()[-400:]}")
        import torch

        print(f"# {device_identity(torch.device('cpu')).replace('_', ' ')}; int8 products at one row, C only")
        print("| threads | kernel | in cache GB/s | streamed GB/s | streamed ms a step | plain read GB/s | streamed / read |")
        print("|---|---|---|---|---|---|---|")
        for threads in (int(t) for t in args.threads.split(",")):
            run = subprocess.run([str(program), str(args.repeats)], capture_output=True, text=True, check=True,
                                 env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
            figures = {}
            for line in run.stdout.splitlines():
                words = line.split()
                label = (words[0],) if words[0] == "read" else tuple(words[:2])
                figures[label] = [float(w) for w in words[len(label):] if w[0].isdigit()]
            read = figures[("read",)][0]
            for kernel in ("i16dot", "i8dot", "q4", "q4i8"):
                hot, (streamed, ms) = figures[(kernel, "in-cache")][0], figures[(kernel, "streamed")][:2]
                print(f"| {threads} | {kernel} | {hot:.1f} | {streamed:.1f} | {ms:.2f} | {read:.1f} | {streamed / read:.0%} |")


if __name__ == "__main__":
    main()
