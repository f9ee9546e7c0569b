#!/usr/bin/env bash
# Install vLLM 0.20.1 (and the packages it needs that the machine lacks) into $VLIBS (default
# /root/vlibs) on a machine without network access, then check it (check.py).
# The parts made by build.sh (p1/part.aa, p2/part.ab, ...) travel one or more per call as carried
# folders .vllm/pN of the work tree; each call copies the ones it has into $STASH (default
# /root/vstash, outside the work tree, kept while the machine stays warm):
#   earlier calls:  bash benchmarks/offline_vllm/install.sh --stash-only
#   the last call:  bash .vllm/pN/install.sh        (build.sh filled in the sha256 and part count;
#                                                    the copy at .vllm/install.sh is the same)
# Then: python -m vllm.entrypoints.openai.api_server ... or benchmarks/*.py --vllm --vllm-path /root/vlibs,
# with PYTHONPATH=/root/vlibs:/root/pylibs (README.md).
set -euo pipefail
EXPECTED_SHA256=unset-run-build.sh
EXPECTED_PARTS=0
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$HERE"
for _ in 1 2 3; do [ -d "$ROOT/benchmarks/offline_vllm" ] && break; ROOT="$(dirname "$ROOT")"; done
PY="${PYTHON:-/opt/torch/.venv/bin/python3}"
[ -x "$PY" ] || PY=python3
VLIBS="${VLIBS:-/root/vlibs}"
STASH="${STASH:-/root/vstash}"
TARBALL="${TARBALL:-/tmp/vllm.tar.xz}"
PYLIBS="${PYLIBS:-/root/pylibs}"
WHEELS="${WHEELS:-$ROOT/.wheels}"

# copy the parts this call carried into the stash
mkdir -p "$STASH"
for f in "$ROOT"/.vllm/p*/part.*; do
  [ -f "$f" ] || continue
  cp -f "$f" "$STASH/" && echo "[install] stashed $(basename "$f") ($(stat -c %s "$f") bytes)"
done
if [ "${1:-}" = "--stash-only" ]; then ls -l "$STASH"; exit 0; fi
[ "$EXPECTED_PARTS" != 0 ] || { echo "[install] run the copy that build.sh filled in (.vllm/pN/install.sh)" >&2; exit 1; }

# tempering's own dependencies as wheels in .wheels at the repository root -> $PYLIBS (if missing there)
if [ ! -d "$PYLIBS/pydantic" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "[install] installing $WHEELS into $PYLIBS"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$PYLIBS" "$WHEELS"/*.whl
fi

if [ -f "$VLIBS/vllm/__init__.py" ] && [ -f "$VLIBS/.vllm_pkg_sha256" ] \
   && [ "$(cat "$VLIBS/.vllm_pkg_sha256")" = "$EXPECTED_SHA256" ]; then
  echo "[install] $VLIBS already holds this package; skipping extraction"
else
  n=$(ls "$STASH"/part.* 2>/dev/null | wc -l)
  if [ "$n" -ne "$EXPECTED_PARTS" ]; then
    echo "[install] ERROR: found $n parts in $STASH, expected $EXPECTED_PARTS:" >&2
    ls -l "$STASH" >&2 || true
    exit 1
  fi
  cat "$STASH"/part.* > "$TARBALL"
  got=$(sha256sum "$TARBALL" | cut -d' ' -f1)
  if [ "$got" != "$EXPECTED_SHA256" ]; then
    echo "[install] ERROR: sha256 mismatch ($got != $EXPECTED_SHA256): parts from another build?" >&2; exit 1
  fi
  rm -rf "$VLIBS.tmp" && mkdir -p "$VLIBS.tmp"
  if command -v xz >/dev/null 2>&1 && tar -C "$VLIBS.tmp" -xJf "$TARBALL"; then
    echo "[install] extracted with tar -J"
  else
    echo "[install] tar -J unavailable/failed; extracting with python tarfile"
    rm -rf "$VLIBS.tmp" && mkdir -p "$VLIBS.tmp"
    "$PY" -c "import sys,tarfile; t=tarfile.open(sys.argv[1],'r:xz'); kw={'filter':'fully_trusted'} if hasattr(tarfile,'fully_trusted_filter') else {}; t.extractall(sys.argv[2],**kw)" "$TARBALL" "$VLIBS.tmp"
  fi
  echo "$EXPECTED_SHA256" > "$VLIBS.tmp/.vllm_pkg_sha256"
  rm -rf "$VLIBS" && mv "$VLIBS.tmp" "$VLIBS"
  rm -f "$TARBALL"
  echo "[install] installed into $VLIBS ($(du -sh "$VLIBS" | cut -f1))"
fi

[ "${SKIP_CHECK:-0}" = 1 ] || PYTHONPATH="$VLIBS:$PYLIBS${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$HERE/check.py" ${CHECK_ARGS:-}
