#!/usr/bin/env bash
# Patch an unpacked vLLM 0.20.1 tree so that it imports without xgrammar/llguidance.
# Usage: patch_vllm.sh <dir containing vllm/>
# Idempotent.
#  * backend_xgrammar.py / backend_guidance.py use LazyLoader proxies (xgr.*, llguidance.*)
#    in dataclass-field / signature annotations, which are evaluated at class-definition
#    time -> importing the module would import xgrammar/llguidance. Adding
#    `from __future__ import annotations` makes those annotations lazy strings.
#  * Deletes the FlashAttention-2 library (Hopper uses FA3; FA2 import is try/except-guarded).
set -euo pipefail
ROOT="${1:?usage: patch_vllm.sh <site dir containing vllm/>}"
cd "$ROOT"
for f in vllm/v1/structured_output/backend_xgrammar.py vllm/v1/structured_output/backend_guidance.py; do
  [ -f "$f" ] || { echo "missing $f" >&2; exit 1; }
  if grep -q '^from __future__ import annotations' "$f"; then
    echo "already patched: $f"; continue
  fi
  # insert after the leading comment block (SPDX lines), before the first statement
  awk 'BEGIN{done=0} { if(!done && $0 !~ /^#/ ){ print "from __future__ import annotations"; print ""; done=1 } print }' "$f" > "$f.tmp"
  mv "$f.tmp" "$f"
  echo "patched: $f"
done
# Drop FA2 (182 MB): not used on SM90 when FA3 is present (fa_utils.get_flash_attn_version
# prefers FA3 on major==9; FA2 only for ALiBi models / explicit flash_attn_version=2).
rm -fv vllm/vllm_flash_attn/_vllm_fa2_C*.so
# Record what was done
echo "patched by benchmarks/offline_vllm/patch_vllm.sh: __future__ annotations in backend_xgrammar/backend_guidance; FA2 .so removed" > vllm/_OFFLINE_PATCHES.txt
