#!/usr/bin/env bash
# Build vLLM 0.20.1 for a Python 3.12 / CUDA 13 / torch 2.11 Hopper machine without network access:
# offline `LLM(...).generate` for `--vllm --vllm-path DIR` of rollout.py, moe.py and tensor_parallel.py,
# and the OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`, with LoRA, the
# hermes tool parser, structured outputs through xgrammar, /metrics). See README.md here.
# Output, in $OUT_DIR (default: .vllm at the repository root, ignored by git): p1/part.aa,
# p2/part.ab, ... (an xz tarball split into parts of at most $PART_SIZE, default 56m = 56 MiB), and
# install.sh and check.py with the tarball's sha256 and part count filled in (also copied into the
# last part's folder, so that carrying that folder brings them).
# Needs: pip (any python), unzip, tar, xz, split, sha256sum, strip, python3, and PyPI.
# Knobs: PRUNE_SASS=0 keeps the cubins of non-Hopper GPUs (bigger: needed on Ampere/Ada/Blackwell);
#        PART_SIZE (split -b syntax); XZ_OPT_LEVEL (default -9e).
set -euo pipefail
TOOLS="$(cd "$(dirname "$0")" && pwd)"
OUT_DIR="${OUT_DIR:-$(cd "$TOOLS/../.." && pwd)/.vllm}"
PART_SIZE="${PART_SIZE:-56m}"
mkdir -p "$OUT_DIR" && cd "$OUT_DIR"
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_35_x86_64)
PIPDL=(pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}")

# 1. vLLM wheel (fresh folders: every wheel in deps/ is unpacked; pip's cache makes a rebuild cheap)
rm -rf dl deps && mkdir -p dl deps
"${PIPDL[@]}" -d dl vllm==0.20.1

# 2. Dependencies missing on the target: the closure of vLLM's non-extra Requires-Dist on the paths of
#    LLM(...).generate and of the OpenAI server, minus what the GPU image already has (torch 2.11,
#    transformers, triton, numpy, aiohttp, anyio, httpx, h11, prometheus_client, uvloop, jinja2, pyyaml,
#    regex, requests, pillow, opencv, tiktoken, sentencepiece, psutil, ...; /work/.library/device/KINDS.md)
#    and minus the optional parts left out (README.md). The result does not depend on tempering's own
#    wheels (.wheels -> /root/pylibs): vLLM gets the versions it pins (llguidance 1.3.x, not tempering's
#    1.6.x) and versions checked with it (pydantic, fastapi, starlette, openai 2.x, ...), from $VLIBS,
#    which comes first on its PYTHONPATH.
DEPS=(
  # direct vLLM requirements
  blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 msgspec==0.22.0 pyzmq==27.3.0
  pybase64==1.5.1 partial-json-parser==0.2.1.1.post7 openai-harmony==0.0.8
  setproctitle==1.3.8 depyf==0.20.0 compressed-tensors==0.15.0.1 lark==1.2.2
  diskcache==5.6.3 outlines_core==0.2.14 lm-format-enforcer==0.11.3
  mistral_common==1.13.1 python-json-logger==4.2.0 watchfiles==1.3.0 ijson==3.6.0
  prometheus-fastapi-instrumentator==8.1.0 gguf==0.19.0
  # structured outputs: xgrammar (vLLM's default backend; 0.1.32 needs no tvm-ffi), and llguidance at
  # the version vLLM pins (its fallback for schemas xgrammar does not support)
  xgrammar==0.1.32 llguidance==1.3.0
  # the OpenAI server: web stack and protocol types (fastapi <0.137 as later vLLM releases pin; from 0.142 on it needs opentelemetry)
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  fastapi==0.136.3 starlette==1.10.0 uvicorn==0.55.0 httptools==0.9.0 python-multipart==0.0.34
  openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
  model-hosting-container-standards==0.1.16 jmespath==1.1.0
  # pydantic 2.14 needs typing-extensions >= 4.16 (backward compatible; shadows the image's copy, for vLLM only)
  typing-extensions==4.16.0
  # their dependencies
  astor==0.8.1 dill==0.4.1 loguru==0.7.3 interegular==0.3.3
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  pydantic-extra-types==2.11.1 pycountry==26.2.16
)
"${PIPDL[@]}" -d deps "${DEPS[@]}"

# 3. Stage: unpacked vLLM wheel (shrunk: patch_vllm.sh) + unpacked dependency wheels
rm -rf stage && mkdir stage
unzip -q dl/vllm-0.20.1-*.whl -d stage
bash "$TOOLS/patch_vllm.sh" stage
for w in deps/*.whl; do unzip -qo "$w" -d stage; done
rm -rf stage/*.data                                   # dill's helper scripts only
rm -rf stage/pycountry/locales stage/pycountry/tests  # 20 MB of gettext translations, unused
rm -f stage/xgrammar/lib/libxgrammar.a                # 57 MB static library, for C++ users only
# debug info only (the code is unchanged): xgrammar's bindings 35 -> ~8 MB, httptools' parsers
strip --strip-debug stage/xgrammar/xgrammar_bindings.*.so stage/httptools/parser/*.so
find stage -name __pycache__ -type d -prune -exec rm -rf {} +

# Sanity: nothing we carry may shadow a package that the target has and vLLM needs at its version
for d in torch numpy transformers tokenizers huggingface_hub safetensors triton \
         jinja2 anyio httpx h11 aiohttp prometheus_client uvloop yaml PIL cv2 tiktoken; do
  [ ! -e "stage/$d" ] || { echo "ERROR: stage would shadow $d" >&2; exit 1; }
done

# 4. Archive + split
rm -rf out && mkdir out
tar -C stage --sort=name --owner=0 --group=0 --numeric-owner --mtime='2026-01-01' -cf - . \
  | xz -T0 "${XZ_OPT_LEVEL:--9e}" > out/vllm.tar.xz
SHA=$(sha256sum out/vllm.tar.xz | cut -d' ' -f1)
( cd out && split -b "$PART_SIZE" vllm.tar.xz part. )
rm -rf p[0-9]*
i=0
for f in out/part.*; do
  i=$((i+1)); mkdir -p "p$i"; mv "$f" "p$i/"
done
rm -f out/vllm.tar.xz
cp "$TOOLS/install.sh" "$TOOLS/check.py" .
sed -i "s/^EXPECTED_SHA256=.*/EXPECTED_SHA256=$SHA/; s/^EXPECTED_PARTS=.*/EXPECTED_PARTS=$i/" install.sh
cp install.sh check.py "p$i/"
echo "archive sha256=$SHA parts=$i (stage $(du -sh stage | cut -f1))"
ls -l p*/part.*
