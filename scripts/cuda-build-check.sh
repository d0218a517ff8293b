#!/usr/bin/env bash
# When nvcc is present, configure and build with -DRAGKV_CUDA=ON so the CUDA
# code always compiles. The CUDA tests themselves need a GPU to run.
set -euo pipefail
NVCC=$(command -v nvcc || true)
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -z "$NVCC" ]; then
    echo "cuda build: skipped (nvcc not found)"
    exit 0
fi
echo "cuda build: configuring with $NVCC"
cmake -S . -B build-cuda -DCMAKE_BUILD_TYPE=Release -DRAGKV_CUDA=ON \
      -DCMAKE_CUDA_COMPILER="$NVCC" >/dev/null
cmake --build build-cuda -j "$(nproc)"
echo "cuda build: ok"
