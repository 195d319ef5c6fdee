#!/usr/bin/env bash
# Builds the documentation site (Sphinx; sources in docs/, configuration docs/conf.py) into
# build/docs/html with warnings as errors (-W), every warning reported before failing
# (--keep-going) and every cross-reference required to resolve (-n, nitpicky).
#
# The API reference is generated from the docstrings of the attnlab that Python imports: the
# installed package (pip install ".[docs]", or the wheel with its docs extra), or a source
# build through PYTHONPATH=python (scripts/dev-build.sh). attnlab.torch and attnlab.dask are
# documented against mocks where torch or dask is missing.
#
#   scripts/build-docs.sh                      # a fresh build (about 20 s)
#   scripts/build-docs.sh -j 2                 # any further sphinx-build arguments
#
# Environment: PYTHON (default python), ATTNLAB_DOCS_OUT (default build/docs).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python}"
OUT="${ATTNLAB_DOCS_OUT:-$ROOT/build/docs}"
"$PY" -c "import attnlab, sys; print(f'build-docs.sh: attnlab {attnlab.__version__} from {attnlab.__file__}', file=sys.stderr)"
# autosummary writes one page per public name into docs/generated: start from none, so that a
# name removed from docs/api.rst leaves no orphan page behind
rm -rf docs/generated "$OUT"
start=$(date +%s)
"$PY" -m sphinx -b html -W --keep-going -n -q -d "$OUT/doctrees" docs "$OUT/html" "$@"
echo "build-docs.sh: $OUT/html/index.html in $(( $(date +%s) - start )) s, no warnings"
