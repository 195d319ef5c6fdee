#!/usr/bin/env bash
# Builds attnlab._core with another C++ compiler (default: clang++) and runs the kernel tests
# against that build, loaded through a PYTHONPATH overlay as scripts/sanitize.sh does: the module
# goes to build/compiler-<name>/pkg/attnlab (a copy of python/attnlab), nothing is written to
# python/attnlab or site-packages.
#
#   scripts/check-compiler.sh                    # clang++: every variant built, isolation checked,
#                                                # the kernel suites on the best variant, test_isa
#   CXX=g++-13 scripts/check-compiler.sh test_mha.py   # another compiler, any pytest arguments
#   ATTNLAB_ISAS="generic;avx512" scripts/check-compiler.sh   # fewer variants, a shorter build
#
# Needs cmake, ninja, pybind11 and Eigen (as scripts/dev-build.sh) and the compiler.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python}"
export CXX="${CXX:-clang++}"
command -v "$CXX" >/dev/null || { echo "check-compiler.sh: $CXX not found" >&2; exit 2; }
# pybind11 and Eigen (cmeel-eigen) in the current environment when missing, as sanitize.sh does
"$PY" -c "import pybind11, cmeel" 2>/dev/null || "$PY" -m pip install --quiet "pybind11>=2.12" "cmeel-eigen>=3.4"
NAME="$(basename "$CXX")"
OUT="$ROOT/build/compiler-$NAME"
PKG="$OUT/pkg"
mkdir -p "$OUT"
start=$(date +%s)
VERSION="$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)"
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi
cmake -S . -B "$OUT/cmake" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$CXX" \
  -DPython_EXECUTABLE="$(command -v "$PY")" ${ATTNLAB_ISAS:+-DATTNLAB_ISAS="$ATTNLAB_ISAS"} \
  -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DSKBUILD_PROJECT_VERSION="$VERSION" -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$PKG/attnlab" \
  > "$OUT/cmake.log" 2>&1 || { cat "$OUT/cmake.log"; exit 1; }
cmake --build "$OUT/cmake" -j "${ATTNLAB_BUILD_JOBS:-2}"
"$PY" scripts/overlay-package.py "$PKG"
echo "check-compiler.sh: built with $CXX in $(( $(date +%s) - start )) s"
SO="$(ls "$PKG"/attnlab/_core*.so)"
if [[ "$(uname -m)" == x86_64 ]]; then "$PY" scripts/check-isa-isolation.py "$SO"; fi

export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - "$PKG" "$NAME" <<'EOF2'
import sys
import attnlab
pkg, name = sys.argv[1], sys.argv[2]
info = attnlab.build_info()
assert attnlab.__file__.startswith(pkg), f"imported {attnlab.__file__}, not the overlay in {pkg}"
print(f"check-compiler.sh: {name}: {info['compiler']}; isa {info['isa']} of {info['built_isas']}")
if "clang" in name:
    assert info["compiler"].startswith("clang"), info["compiler"]
EOF2
if [[ $# -gt 0 ]]; then
  TESTS=("$@")
else
  TESTS=(test_mha.py test_bilinear.py test_additive.py test_backward_mha.py
         test_backward_bilinear.py test_backward_additive.py test_errors.py test_isa.py
         -k "not comparison_suites and not torch")
fi
start=$(date +%s)
(cd tests && "$PY" -m pytest -q -p no:cacheprovider -x "${TESTS[@]}")
echo "check-compiler.sh: tests ran in $(( $(date +%s) - start )) s"
