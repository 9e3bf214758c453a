#!/usr/bin/env bash
# Bench a model as an AVX2-only CPU would run it, on a CPU that has more (AVX-512): both engines held to AVX2.
#
#   bash examples/avx2_only_bench.sh MODEL.powerinfer.gguf WORK_FOLDER [pitools bench options ...]
#
# llama.cpp: llama-cpp-python of the version our kernels are pinned to (kernels/ggml_ops.py TESTED_VERSION),
# built from its source with AVX2 and without -march=native or AVX-512, installed in a virtual environment of
# its own under WORK_FOLDER with this checkout; our runtime in it then calls that build's ggml as well. Our numba
# kernels are compiled for Haswell's features (no VNNI, no BF16; their cache kept in WORK_FOLDER), and OpenBLAS
# takes its Haswell kernels. The memory system stays this machine's, so this is a proxy for an AVX2-only CPU,
# not one: say so beside its figures. The build takes ~10 minutes on 2 cores, once.
set -euo pipefail
model=$(realpath "$1")
work=$(realpath -m "$2")
shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)
version=0.3.36
mkdir -p "$work"

if [ ! -x "$work/venv/bin/pitools" ]; then
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install -q -e "$repo"
    "$work/venv/bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work/sdist"
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF" \
        "$work/venv/bin/pip" wheel -q --no-deps "$work/sdist/llama_cpp_python-$version.tar.gz" -w "$work/wheels"
    "$work/venv/bin/pip" install -q --force-reinstall --no-deps "$work/wheels/llama_cpp_python-$version"-*.whl
fi

export NUMBA_CPU_NAME=haswell
export NUMBA_CPU_FEATURES="+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+lzcnt,+movbe,+mmx,+pclmul,+popcnt,\
+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave"
export OPENBLAS_CORETYPE=Haswell
export NUMBA_CACHE_DIR="$work/numba-cache"
# the kernels compiled for these features before the bench's rounds, and how each layer runs (ggml's AVX2
# products, no VNNI) printed
"$work/venv/bin/pitools" run "$model" --kernels wait -n 2 -p "import os" --verbose >&2
"$work/venv/bin/pitools" bench "$model" "$@"
