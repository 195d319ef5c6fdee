#!/usr/bin/env bash
# Fast developer loop: builds the extension module attnlab._core, with every instruction-set
# variant of the platform (or those in ATTNLAB_ISAS, e.g. "generic;avx2"), into python/attnlab,
# serialised by a lock so that several shells can call it. Then: PYTHONPATH=python python -m pytest
set -euo pipefail
cd "$(dirname "$0")/.."
ISAS="${ATTNLAB_ISAS:-}"
BUILD="build/dev${ISAS:+-${ISAS//;/-}}"
exec 9>build/.dev-build.lock 2>/dev/null || { mkdir -p build; exec 9>build/.dev-build.lock; }
flock 9
PYBIND11_DIR="$(python -c 'import pybind11; print(pybind11.get_cmake_dir())')"
VERSION="$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -Dpybind11_DIR="$PYBIND11_DIR" \
  -DPython_EXECUTABLE="$(command -v python)" ${ISAS:+-DATTNLAB_ISAS="$ISAS"} \
  -DSKBUILD_PROJECT_VERSION="$VERSION" -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$PWD/python/attnlab" \
  ${ATTNLAB_CMAKE_ARGS:-} > "$BUILD.log" 2>&1 || { cat "$BUILD.log"; exit 1; }
cmake --build "$BUILD" -j "${ATTNLAB_BUILD_JOBS:-2}"
