#!/usr/bin/env bash
# CMAKE_ARGS for building llama-cpp-python here (the test extra compiles it from source).
# On x86-64, the instruction sets this processor has are named one by one instead of -march=native:
# a native build crashed on an Intel Xeon with AMX under KVM (a general protection fault in
# libggml-cpu at its first decode), so AMX stays off. Elsewhere (ARM) the native build is kept.
set -euo pipefail
[ "$(uname -m)" = x86_64 ] || exit 0
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
on() { case "$flags" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
echo "-DGGML_NATIVE=OFF -DGGML_AVX=$(on avx) -DGGML_AVX2=$(on avx2) -DGGML_FMA=$(on fma) -DGGML_F16C=$(on f16c)" \
     "-DGGML_BMI2=$(on bmi2) -DGGML_AVX_VNNI=$(on avx_vnni) -DGGML_AVX512=$(on avx512f)" \
     "-DGGML_AVX512_VBMI=$(on avx512vbmi) -DGGML_AVX512_VNNI=$(on avx512_vnni) -DGGML_AVX512_BF16=$(on avx512_bf16)" \
     "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
