#!/usr/bin/env bash
# Shrink an unpacked vLLM 0.20.1 tree for a Hopper GPU (H100/H200). Usage: patch_vllm.sh <dir containing vllm/>
# Idempotent. vLLM's Python code is left as released (xgrammar and llguidance travel with it now).
#  * Deletes the FlashAttention-2 library (182 MB): on SM90 vLLM uses FA3 (fa_utils.get_flash_attn_version
#    prefers FA3 on major == 9; FA2 only for ALiBi models / an explicit flash_attn_version=2), and its
#    FA2 import is try/except-guarded.
#  * With PRUNE_SASS=1 (the default): drops from vLLM's CUDA libraries the cubins for non-Hopper GPUs
#    (prune_fatbin.py says why that is safe on sm_90); the sm_90/sm_90a cubins and all PTX stay.
set -euo pipefail
TOOLS="$(cd "$(dirname "$0")" && pwd)"
ROOT="${1:?usage: patch_vllm.sh <site dir containing vllm/>}"
PY="${PYTHON:-python3}"
cd "$ROOT"
[ -f vllm/__init__.py ] || { echo "no vllm/ in $ROOT" >&2; exit 1; }
rm -fv vllm/vllm_flash_attn/_vllm_fa2_C*.so
note="FA2 .so removed"
if [ "${PRUNE_SASS:-1}" = 1 ]; then
  find vllm -name '*.so' -print0 | sort -z | xargs -0 "$PY" "$TOOLS/prune_fatbin.py"
  note="$note; non-Hopper cubins dropped from vLLM's CUDA libraries (prune_fatbin.py): runs on sm_90 (H100/H200) only"
fi
echo "patched by benchmarks/offline_vllm/patch_vllm.sh: $note" > vllm/_OFFLINE_PATCHES.txt
