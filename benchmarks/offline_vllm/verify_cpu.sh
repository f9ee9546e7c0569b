#!/usr/bin/env bash
# Check the bundle that build.sh made on a machine WITHOUT a GPU, as far as that goes: a Python 3.12
# venv with the GPU image's versions of what vLLM uses (torch 2.11.0+cu130 and its CUDA wheels,
# transformers 5.17.0, triton 3.6.0, numpy 2.5.2, ...; no pydantic/fastapi/openai, as there), the
# bundle alone on PYTHONPATH, and a stub libcuda.so.1 (every driver call fails) so that vLLM's CUDA
# libraries load. Runs install.sh's join/sha256/unpack on the parts, then check.py: everything
# passes except the GPU kernel runs (skipped). Needs pyenv's 3.12 (or PY312), gcc, PyPI; ~3 GB.
# Usage: bash benchmarks/offline_vllm/verify_cpu.sh      (VENV=/work/scratch/gpu312 by default)
set -euo pipefail
TOOLS="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$TOOLS/../.." && pwd)"
OUT_DIR="${OUT_DIR:-$ROOT/.vllm}"
VENV="${VENV:-/work/scratch/gpu312}"
PY312="${PY312:-$(ls -d /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1)}"
WORK="${WORK:-/tmp/vllm_verify}"

if [ ! -x "$VENV/bin/python" ]; then
  "${PY312:?no python3.12: set PY312}" -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip
  "$VENV/bin/pip" install -q torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 triton==3.6.0 \
    transformers==5.17.0 huggingface_hub==1.33.0 tokenizers==0.23.2 numpy==2.5.2 safetensors==0.8.0 \
    sentencepiece==0.2.2 tiktoken==0.14.0 accelerate==1.15.0 psutil peft aiohttp anyio httpx \
    prometheus-client uvloop pyyaml regex requests pillow opencv-python-headless numba cloudpickle \
    py-cpuinfo msgpack protobuf jinja2 einops typer rich click xxhash ninja setuptools six scipy nvidia-ml-py
  # the GPU image has none of these (typer pulls pydantic in here)
  "$VENV/bin/pip" uninstall -y -q pydantic pydantic-core annotated-types typing-inspection || true
fi

rm -rf "$WORK" && mkdir -p "$WORK/stash" "$WORK/stub"
printf 'int %s(void){return 100;}\n' cuInit cuDriverGetVersion cuDeviceGetCount cuGetProcAddress \
  cuGetProcAddress_v2 cuCtxGetCurrent cuCtxSetCurrent cuDeviceGetAttribute cuDevicePrimaryCtxRetain \
  cuGetErrorString cuMemAddressFree cuMemAddressReserve cuMemCreate cuMemGetAllocationGranularity \
  cuMemMap cuMemRelease cuMemSetAccess cuMemUnmap cuPointerGetAttribute cuTensorMapEncodeTiled > "$WORK/stub/stub.c"
gcc -shared -fPIC -o "$WORK/stub/libcuda.so.1" -Wl,-soname,libcuda.so.1 "$WORK/stub/stub.c"

last=$(ls -d "$OUT_DIR"/p[0-9]* | sort -V | tail -1)
cp "$OUT_DIR"/p*/part.* "$WORK/stash/"
STASH="$WORK/stash" VLIBS="$WORK/vlibs" PYLIBS="$WORK/no-pylibs" PYTHON="$VENV/bin/python" SKIP_CHECK=1 \
  bash "$last/install.sh"
cd "$WORK" && LD_LIBRARY_PATH="$WORK/stub" PYTHONPATH="$WORK/vlibs" "$VENV/bin/python" "$last/check.py"
