#!/usr/bin/env bash
# Build vLLM 0.20.1 for a Python 3.12 / CUDA 13 / torch 2.11 machine without network access, for
# `--vllm --vllm-path DIR` of rollout.py, moe.py and tensor_parallel.py (see README.md here).
# Output, in $OUT_DIR (default: .vllm at the repository root, ignored by git): p1/part.aa,
# p2/part.ab, ... (an xz tarball split into parts of at most 60 MiB), and install.sh and check.py
# with the tarball's sha256 and part count filled in.
# Needs: pip (any python), unzip, tar, xz, split, sha256sum, and PyPI.
set -euo pipefail
TOOLS="$(cd "$(dirname "$0")" && pwd)"
OUT_DIR="${OUT_DIR:-$(cd "$TOOLS/../.." && pwd)/.vllm}"
mkdir -p "$OUT_DIR" && cd "$OUT_DIR"
cp "$TOOLS/install.sh" "$TOOLS/check.py" .
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
PIPDL=(pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}")

# 1. vLLM wheel
mkdir -p dl deps
"${PIPDL[@]}" -d dl vllm==0.20.1

# 2. Dependencies missing on the target (closure of vLLM's non-extra Requires-Dist, minus
#    what the machine already has, or gets from tempering's own dependencies, and minus the
#    optional parts left out: see README.md).
DEPS=(
  # direct vLLM requirements
  blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 msgspec==0.22.0 pyzmq==27.3.0
  pybase64==1.5.1 partial-json-parser==0.2.1.1.post7 openai-harmony==0.0.8
  setproctitle==1.3.8 depyf==0.20.0 compressed-tensors==0.15.0.1 lark==1.2.2
  diskcache==5.6.3 outlines_core==0.2.14 lm-format-enforcer==0.11.3
  mistral_common==1.13.1 python-json-logger==4.2.0 watchfiles==1.3.0 ijson==3.6.0
  prometheus-fastapi-instrumentator==8.1.0
  # their dependencies
  astor==0.8.1 dill==0.4.1 loguru==0.7.3 interegular==0.3.3
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  pydantic-extra-types==2.11.1 pycountry==26.2.16
)
"${PIPDL[@]}" -d deps "${DEPS[@]}"

# 3. Stage: unpacked vLLM wheel (patched + shrunk) + unpacked dependency wheels
rm -rf stage && mkdir stage
unzip -q dl/vllm-0.20.1-*.whl -d stage
bash "$TOOLS/patch_vllm.sh" stage
for w in deps/*.whl; do unzip -qo "$w" -d stage; done
rm -rf stage/*.data                                   # dill's helper scripts only
rm -rf stage/pycountry/locales stage/pycountry/tests  # 20 MB of gettext translations, unused
find stage -name __pycache__ -type d -prune -exec rm -rf {} +

# Sanity: nothing we carry may shadow a package the target already has
for d in torch numpy transformers tokenizers pydantic pydantic_core typing_extensions openai fastapi starlette; do
  [ ! -e "stage/$d" ] || { echo "ERROR: stage would shadow $d" >&2; exit 1; }
done

# 5. Archive + split
rm -rf out && mkdir out
tar -C stage --sort=name --owner=0 --group=0 --numeric-owner --mtime='2026-01-01' -cf - . \
  | xz -T0 -9e > out/vllm.tar.xz
SHA=$(sha256sum out/vllm.tar.xz | cut -d' ' -f1)
( cd out && split -b 60m vllm.tar.xz part. )
rm -rf p[0-9]*
i=0
for f in out/part.*; do
  i=$((i+1)); mkdir -p "p$i"; mv "$f" "p$i/"
done
sed -i "s/^EXPECTED_SHA256=.*/EXPECTED_SHA256=$SHA/; s/^EXPECTED_PARTS=.*/EXPECTED_PARTS=$i/" install.sh
rm -f out/vllm.tar.xz
echo "archive sha256=$SHA parts=$i"
ls -l p*/part.*
