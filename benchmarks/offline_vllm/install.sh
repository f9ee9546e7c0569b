#!/usr/bin/env bash
# Install vLLM 0.20.1 (and the packages it needs that the machine lacks) into $VLIBS (default
# /root/vlibs) on a machine without network access, then check its imports (check.py).
# The parts made by build.sh (p1/part.aa, p2/part.ab, ...) must be in $STASH (default /root/vstash).
# From the repository root, with the build's output at .vllm:  bash .vllm/install.sh
# Then: python benchmarks/tensor_parallel.py ... --vllm --vllm-path /root/vlibs
set -euo pipefail
EXPECTED_SHA256=4fe6afb1ecff706057e0591fbc4d684997635e50686960953528882c577f399b
EXPECTED_PARTS=3
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-/opt/torch/.venv/bin/python3}"
[ -x "$PY" ] || PY=python3
VLIBS="${VLIBS:-/root/vlibs}"
STASH="${STASH:-/root/vstash}"
TARBALL="${TARBALL:-/tmp/vllm.tar.xz}"
PYLIBS="${PYLIBS:-/root/pylibs}"

# tempering's own dependencies as wheels in .wheels at the repository root -> $PYLIBS (if missing there)
if [ ! -d "$PYLIBS/pydantic" ] && ls "$HERE"/../.wheels/*.whl >/dev/null 2>&1; then
  echo "[install] installing .wheels into $PYLIBS"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$PYLIBS" "$HERE"/../.wheels/*.whl
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
    echo "[install] ERROR: sha256 mismatch ($got != $EXPECTED_SHA256)" >&2; exit 1
  fi
  rm -rf "$VLIBS.tmp" && mkdir -p "$VLIBS.tmp"
  if command -v xz >/dev/null 2>&1 && tar -C "$VLIBS.tmp" -xJf "$TARBALL"; then
    echo "[install] extracted with tar -J"
  else
    echo "[install] tar -J unavailable/failed; extracting with python tarfile"
    rm -rf "$VLIBS.tmp" && mkdir -p "$VLIBS.tmp"
    "$PY" -c "import sys,tarfile; t=tarfile.open(sys.argv[1],'r:xz'); kw={'filter':'fully_trusted'} if hasattr(tarfile,'fully_trusted_filter') else {}; t.extractall(sys.argv[2],**kw)" "$TARBALL" "$VLIBS.tmp"
  fi
  # optional wheels shipped inside the archive (none by default)
  if ls "$VLIBS.tmp"/_wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$VLIBS.tmp" "$VLIBS.tmp"/_wheels/*.whl
    rm -rf "$VLIBS.tmp/_wheels"
  fi
  echo "$EXPECTED_SHA256" > "$VLIBS.tmp/.vllm_pkg_sha256"
  rm -rf "$VLIBS" && mv "$VLIBS.tmp" "$VLIBS"
  rm -f "$TARBALL"
  echo "[install] installed into $VLIBS ($(du -sh "$VLIBS" | cut -f1))"
fi

PYTHONPATH="$VLIBS:$PYLIBS${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$HERE/check.py"
