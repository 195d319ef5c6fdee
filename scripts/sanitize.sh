#!/usr/bin/env bash
# Runs tests against a build of the kernels instrumented with AddressSanitizer and
# UndefinedBehaviorSanitizer (CMake option ATTNLAB_SANITIZE), and fails on any report.
#
#   scripts/sanitize.sh                     # build (Debug: Eigen's assertions on), run the fast subset
#   scripts/sanitize.sh test_mha.py -k gqa  # any pytest arguments, relative to tests/
#   ATTNLAB_SANITIZE_FULL=1 scripts/sanitize.sh   # the whole suite (slow: ~10x the normal run)
#
# Only the one variant is compiled into the module (ATTNLAB_ISAS=<isa>), and forced with
# ATTNLAB_ISA. How it stays apart from the normal install: the module is compiled into
# build/sanitize-<isa>/pkg/attnlab (a copy of python/attnlab without any compiled module) and
# loaded through PYTHONPATH=build/sanitize-<isa>/pkg with ATTNLAB_ISA=<isa>; nothing is written
# to python/attnlab or to site-packages, so neither `pip install .` nor scripts/dev-build.sh can
# pick it up, and a normal `import attnlab` never sees it. The script checks that the imported
# module is the instrumented one before running anything.
#
# Python itself is not instrumented, so libasan is LD_PRELOADed (found with
# `gcc -print-file-name=libasan.so`). Options:
#   ASAN_OPTIONS  detect_leaks=0            CPython keeps interned objects to exit: not our leaks
#                 allocator_may_return_null=1  huge requests return NULL -> MemoryError, as in
#                                           a normal build (the memory tests check exactly that)
#                 log_path=<dir>/asan       reports in files, from subprocesses too
#   UBSAN_OPTIONS halt_on_error=1:print_stacktrace=1:log_path=<dir>/ubsan
#                                           the first report aborts the run
# The run fails if any report file appears (or the pytest log shows one), or a test fails.
# libstdc++ is preloaded with libasan (see PRELOAD below). ATTNLAB_FUZZ_CALLS=N shortens the
# stress run of test_fuzz.py (10,000 calls, ~15 s under the sanitizers).
#
# Environment: ATTNLAB_SANITIZE_ISA (avx2 when the CPU has it, else generic),
# ATTNLAB_SANITIZE_WORKERS (pytest-xdist processes; default: the cores, nproc),
# ATTNLAB_SANITIZE_DIR (default build/sanitize-<isa>), CXX (default: the system g++, whose
# libasan is preloaded; the two must match).
# Needs cmake, ninja (optional), pybind11, Eigen (cmeel-eigen or libeigen3-dev) and
# pytest-xdist: missing Python packages among these are installed into the current environment
# with pip.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python}"

ISA="${ATTNLAB_SANITIZE_ISA:-}"
if [[ -z "$ISA" ]]; then
  if grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo && grep -qw bmi2 /proc/cpuinfo; then
    ISA=avx2
  else
    ISA=generic
  fi
fi
OUT="${ATTNLAB_SANITIZE_DIR:-$ROOT/build/sanitize-$ISA}"
BUILD="$OUT/cmake"
PKG="$OUT/pkg"
LOG="$OUT/pytest.log"
mkdir -p "$OUT"

# --- tools
"$PY" -c "import pybind11" 2>/dev/null || "$PY" -m pip install --quiet "pybind11>=2.12"
HAVE_EIGEN='import sys, os; sys.exit(not any(os.path.isfile(os.path.join(p, "cmeel.prefix", "include", "eigen3", "Eigen", "Core")) for p in sys.path))'
if ! "$PY" -c "$HAVE_EIGEN" && [[ ! -f /usr/include/eigen3/Eigen/Core ]]; then
  "$PY" -m pip install --quiet "cmeel-eigen>=3.4"
fi
command -v cmake >/dev/null || "$PY" -m pip install --quiet cmake
# the tests in one process per core (pytest-xdist): in one, the subset took 9 of CI's 29
# minutes (531 s; 377 s in two, docs/performance.md)
XDIST_OK='import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split(".")[:2])) < (3, 2))'
"$PY" -c "$XDIST_OK" 2>/dev/null || "$PY" -m pip install --quiet "pytest-xdist>=3.2"  # worksteal
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi
export CXX="${CXX:-g++}"
LIBASAN="$("$CXX" -print-file-name=libasan.so)"
[[ -f "$LIBASAN" ]] || { echo "sanitize.sh: libasan.so not found via $CXX" >&2; exit 2; }
# libstdc++ preloaded too: python does not link it, and ASan's __cxa_throw interceptor must find
# the real one at start-up, or the first C++ exception (every ValueError raised by the
# bindings) aborts with "CHECK failed: asan_interceptors.cpp ... real___cxa_throw".
PRELOAD="$LIBASAN $("$CXX" -print-file-name=libstdc++.so)"

# --- build the instrumented module into the overlay package
start=$(date +%s)
VERSION="$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)"
rm -f "$PKG"/attnlab/_core_*.so  # the per-ISA modules of earlier versions
cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Debug -DATTNLAB_SANITIZE=ON \
  -DATTNLAB_ISAS="$ISA" -DPython_EXECUTABLE="$(command -v "$PY")" \
  -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DSKBUILD_PROJECT_VERSION="$VERSION" -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$PKG/attnlab" \
  > "$OUT/cmake.log" 2>&1 || { cat "$OUT/cmake.log"; exit 1; }
cmake --build "$BUILD" -j "${ATTNLAB_SANITIZE_JOBS:-2}"
"$PY" scripts/overlay-package.py "$PKG"
echo "sanitize.sh: built $ISA in $(( $(date +%s) - start )) s"

# --- run
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
export ATTNLAB_ISA="$ISA"
# Reports go to files (pytest captures stderr, and a dying child process's stderr is easily
# lost): $OUT/reports/asan.<pid>, ubsan.<pid>, from this process and every subprocess.
REPORTS="$OUT/reports"
rm -rf "$REPORTS"
mkdir -p "$REPORTS"
ASAN_BASE="detect_leaks=0:allocator_may_return_null=1:halt_on_error=1"
export ASAN_OPTIONS="$ASAN_BASE:log_path=$REPORTS/asan${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$REPORTS/ubsan${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export ATTNLAB_SANITIZED=1  # lets tests skip what ASan cannot do (e.g. RSS measurements)
export ATTNLAB_REUSE_MEMORY=0  # every array from malloc, inside ASan's guard zones
LD_PRELOAD="$PRELOAD" "$PY" - "$PKG" "$ISA" <<'EOF'
import sys
import attnlab
from attnlab._loader import core
pkg, isa = sys.argv[1], sys.argv[2]
assert attnlab.__file__.startswith(pkg), f"imported {attnlab.__file__}, not the overlay in {pkg}"
assert core.__file__.startswith(pkg) and core.ISA == isa, core.__file__
print(f"sanitize.sh: using {core.__file__}")
EOF

if [[ $# -gt 0 ]]; then
  TESTS=("$@")
elif [[ -n "${ATTNLAB_SANITIZE_FULL:-}" ]]; then
  TESTS=(.)
else
  # The fast subset: every kernel, forward and backward, every error path, the 10,000-call
  # fuzzer, the property tests, the eight-thread test, the half-precision kernels, the q/k norms
  # and rotary embeddings, the GEMM's gradients binding.
  # Left out: torch comparisons (torch under a preloaded libasan is slow and not what is
  # being checked), notebooks, and the GIL tests (long single-threaded calls, ~2 min under
  # ASan, checking nothing about memory).
  TESTS=(test_mha.py test_bilinear.py test_additive.py test_backward_mha.py
         test_backward_bilinear.py test_backward_additive.py test_errors.py
         test_properties.py test_fuzz.py test_concurrency.py test_memory.py test_numerics.py
         test_options.py test_decode.py test_interrupt.py test_half_sdpa.py test_half_convert.py
         test_half.py test_qk_norm.py test_gemm_blocking.py test_packed_weight.py
         -k "not torch and not gil_is_released")
fi
start=$(date +%s)
set +e
WORKERS="${ATTNLAB_SANITIZE_WORKERS:-$(nproc)}"
(cd tests && LD_PRELOAD="$PRELOAD" "$PY" -m pytest -q -p no:cacheprovider -x -n "$WORKERS" \
  --dist worksteal "${TESTS[@]}") \
  2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e
echo "sanitize.sh: tests ran in $(( $(date +%s) - start )) s (log: $LOG)"
# (report files holding only "WARNING: AddressSanitizer failed to allocate" lines are the
# impossible-size tests getting NULL, as intended)
PATTERN="ERROR: AddressSanitizer|runtime error:|AddressSanitizer: CHECK|ERROR: LeakSanitizer"
if grep -lqE "$PATTERN" "$REPORTS"/* "$LOG" 2>/dev/null; then
  echo "sanitize.sh: sanitizer report(s) found:" >&2
  for f in $(grep -lE "$PATTERN" "$REPORTS"/* 2>/dev/null); do
    echo "== $f" >&2
    grep -vE "WARNING: AddressSanitizer failed to allocate" "$f" | head -60 >&2
  done
  exit 1
fi
exit "$status"
