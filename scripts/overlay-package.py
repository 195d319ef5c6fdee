#!/usr/bin/env python3
"""Copies python/attnlab (without any compiled module) to DEST/attnlab, for the scripts that
build a separate attnlab._core into DEST and load it through PYTHONPATH=DEST (sanitize.sh,
check-compiler.sh). Python files deleted from the source tree do not linger in DEST.

Usage: scripts/overlay-package.py DEST
"""

import shutil
import sys
from pathlib import Path

src = Path(__file__).resolve().parent.parent / "python" / "attnlab"
dst = Path(sys.argv[1]) / "attnlab"
dst.mkdir(parents=True, exist_ok=True)
for p in dst.rglob("*.py"):
    p.unlink()
shutil.copytree(
    src,
    dst,
    dirs_exist_ok=True,
    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "*.pyc"),
)
