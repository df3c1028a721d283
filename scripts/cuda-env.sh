#!/usr/bin/env bash
# Sets up a CUDA 13.0 build environment on a machine without a GPU or a system toolkit, then
# prints the exports that point cargo, cudarc and candle-kernels at it. Usage:
#     eval "$(scripts/cuda-env.sh)"
# Everything lives under $SPECRS_CUDA_DIR (default ~/.cache/specrs-cuda, outside any clone, so the
# paths cargo sees stay the same and a CUDA target directory stays warm): a venv holding nvcc and the
# runtime libraries from PyPI, pinned to 13.0 to match the GPU machine's driver (a driver cannot
# JIT PTX newer than itself), and a link directory with unversioned .so names plus a libcuda stub
# generated from cuda.h (link-time only; the driver's real libcuda.so.1 is used at run time).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${SPECRS_CUDA_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specrs-cuda}"
PYTHON="${PYTHON:-python3}"
TOOLKIT='cuda-toolkit[nvcc,cccl,cudart,nvrtc,curand,cublas]==13.0.3.0'

if [ ! -x "$ROOT/venv/bin/python" ]; then
    "$PYTHON" -m venv "$ROOT/venv" >&2
fi
if [ ! -f "$ROOT/venv/.installed" ]; then
    "$ROOT/venv/bin/pip" install --quiet --upgrade pip >&2
    "$ROOT/venv/bin/pip" install --quiet "$TOOLKIT" >&2
    touch "$ROOT/venv/.installed"
fi
CU=$("$ROOT/venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')

LINK="$ROOT/link"
if [ ! -f "$LINK/lib/libcuda.so" ]; then
    mkdir -p "$LINK/lib"
    for lib in cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13 cudart.so.13; do
        ln -sf "$CU/lib/lib$lib" "$LINK/lib/lib${lib%%.so*}.so"
    done
    # A stub with every cu* entry point of cuda.h, so -lcuda links; nothing calls it.
    echo '#include <cuda.h>' | gcc -x c -E -P -I"$CU/include" - \
        | grep -oE 'CUresult\s+cu[A-Za-z0-9_]+\s*\(' | sed -E 's/CUresult\s+//;s/\s*\(//' | sort -u \
        | sed 's/.*/int &(void){return 999;}/' > "$LINK/stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$LINK/lib/libcuda.so" "$LINK/stub.c"
    for dir in bin include nvvm; do ln -sfn "$CU/$dir" "$LINK/$dir"; done
    # For running CPU-side tests of a CUDA build here (NVRTC needs no GPU): the stub under the
    # name the loader asks for. Never carried to a GPU machine, whose driver provides the real one.
    mkdir -p "$ROOT/stub-run"
    ln -sf "$LINK/lib/libcuda.so" "$ROOT/stub-run/libcuda.so.1"
fi

# CUDA_COMPUTE_CAP: candle-kernels compiles for this architecture (90 = H100/H200) instead of
# asking nvidia-smi, which a CPU machine lacks.
cat <<EXPORTS
export CUDA_HOME="$LINK" CUDA_PATH="$LINK" CUDA_ROOT="$LINK"
export PATH="$LINK/bin:\$PATH"
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-90}" CUDARC_CUDA_VERSION=13000
export SPECRS_CUDA_LIBS="$CU/lib" SPECRS_CUDA_STUB_RUN="$ROOT/stub-run"
EXPORTS
