#!/usr/bin/env bash
# aarch64: cross-compiles the kernels (the generic variant: Eigen vectorises it with NEON, which
# is part of the aarch64 baseline) and cpp/selftest/selftest.cpp with Debian's
# g++-aarch64-linux-gnu, then runs the self-test (every kernel, float32 and float64, against a
# naive reference; every backward against finite differences; 1 and 3 threads) under
# qemu-aarch64-static. Fails when the build fails, when Eigen does not report NEON, or when any
# check fails.
#
#   scripts/check-aarch64.sh            # needs g++-aarch64-linux-gnu, qemu-user-static, cmake,
#                                       # and Eigen (cmeel-eigen in the Python env, or
#                                       # libeigen3-dev; ATTNLAB_EIGEN_INCLUDE overrides)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
CXX_AARCH64="${CXX_AARCH64:-aarch64-linux-gnu-g++}"
QEMU="${QEMU_AARCH64:-qemu-aarch64-static}"
SYSROOT="${ATTNLAB_AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}"
for tool in "$CXX_AARCH64" "$QEMU" cmake; do
  command -v "$tool" >/dev/null || {
    echo "check-aarch64.sh: $tool not found (Debian: apt-get install g++-aarch64-linux-gnu qemu-user-static cmake)" >&2
    exit 2
  }
done
if [[ -z "${ATTNLAB_EIGEN_INCLUDE:-}" && ! -f /usr/include/eigen3/Eigen/Core ]]; then
  "$PY" -c "import cmeel" 2>/dev/null || "$PY" -m pip install --quiet "cmeel-eigen>=3.4"
fi
EIGEN="${ATTNLAB_EIGEN_INCLUDE:-$("$PY" -c 'import sys, os; print(next((os.path.join(p, "cmeel.prefix", "include", "eigen3") for p in sys.path if os.path.isfile(os.path.join(p, "cmeel.prefix", "include", "eigen3", "Eigen", "Core"))), ""))' 2>/dev/null || true)}"
[[ -n "$EIGEN" ]] || EIGEN=/usr/include/eigen3
[[ -f "$EIGEN/Eigen/Core" ]] || { echo "check-aarch64.sh: Eigen not found (pip install cmeel-eigen)" >&2; exit 2; }
OUT="$ROOT/build/aarch64"
mkdir -p "$ROOT/build"  # the log sits beside the build folder: a fresh clone has neither
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi
start=$(date +%s)
cmake -S . -B "$OUT" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_CXX_COMPILER="$CXX_AARCH64" \
  -DATTNLAB_PYTHON=OFF -DATTNLAB_SELFTEST=ON -DATTNLAB_EIGEN_INCLUDE="$EIGEN" \
  > "$OUT.log" 2>&1 || { cat "$OUT.log"; exit 1; }
cmake --build "$OUT" -j "${ATTNLAB_BUILD_JOBS:-2}"
file "$OUT/attnlab_selftest" 2>/dev/null | grep -q "ARM aarch64" || {
  echo "check-aarch64.sh: attnlab_selftest is not an aarch64 executable" >&2; exit 1; }
echo "check-aarch64.sh: cross-compiled in $(( $(date +%s) - start )) s"
start=$(date +%s)
"$QEMU" -L "$SYSROOT" "$OUT/attnlab_selftest" | tee "$OUT/selftest.log"
grep -q "Eigen SIMD: ARM NEON" "$OUT/selftest.log" || {
  echo "check-aarch64.sh: the generic aarch64 build does not use NEON" >&2; exit 1; }
echo "check-aarch64.sh: self-test under $QEMU in $(( $(date +%s) - start )) s"
