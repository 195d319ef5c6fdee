#!/usr/bin/env python3
"""Checks that the instruction-set variants inside attnlab._core cannot leak into each other.

The kernel sources are compiled once per instruction set into one shared object. If an inline
function or template instantiation compiled with AVX flags were merged by the linker with the
baseline copy of the same symbol, the generic path could execute AVX instructions on a CPU
without them (SIGILL). The build prevents it (a namespace per variant, Eigen's namespace renamed
per variant, baseline objects first on the link line); this script proves it on the result:

1. every function outside the avx2/avx512/native namespaces (``attnlab::isa_<v>``,
   ``attnlab_eigen_<v>``, or a template instantiated on their types) contains no VEX/EVEX-encoded
   instruction and no BMI/LZCNT/MOVBE instruction (what x86-64-v3/v4 add to the baseline);
   this covers static initialisers, which run at import whatever the CPU;
2. no symbol names the un-renamed ``Eigen::`` namespace (the bindings never include Eigen);
3. every variant's namespaces are present (it was really built in).

Usage: scripts/check-isa-isolation.py [path/to/_core*.so]   (x86-64 Linux, needs objdump)
"""

from __future__ import annotations

import glob
import re
import subprocess
import sys
from pathlib import Path

ISA_SPECIFIC = re.compile(r"\b(?:attnlab::isa_|attnlab_eigen_)(avx2|avx512|native)\b")
# Mnemonics the baseline (x86-64, SSE2) never has: VEX/EVEX ("v..."), AVX-512 mask registers
# ("k..."), BMI1/BMI2, LZCNT, MOVBE. (tzcnt is left out: it decodes as bsf on older CPUs, and
# compilers emit it for baseline targets where the two agree.)
FORBIDDEN = re.compile(
    r"^(v\w+|k(?:and|or|xor|xnor|not|mov|shift|test|unpck|add)\w*|andn|bextr|blsi|blsr|blsmsk|bzhi|"
    r"mulx|pdep|pext|rorx|sarx|shlx|shrx|lzcnt|movbe)$"
)
HEADER = re.compile(r"^[0-9a-f]+ <(.*)>:$")
INSN = re.compile(r"^\s*[0-9a-f]+:\s+(\S+)")


def main() -> int:
    if len(sys.argv) > 1:
        so = Path(sys.argv[1])
    else:
        found = sorted(
            glob.glob(str(Path(__file__).resolve().parent.parent / "python/attnlab/_core*.so"))
        )
        if not found:
            print(
                "check-isa-isolation: no _core*.so given or found in python/attnlab",
                file=sys.stderr,
            )
            return 2
        so = Path(found[0])
    out = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", str(so)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    bad: dict[str, set[str]] = {}
    seen_isas: set[str] = set()
    functions = 0
    name = ""
    specific = False
    for line in out.splitlines():
        m = HEADER.match(line)
        if m:
            name = m.group(1)
            functions += 1
            s = ISA_SPECIFIC.search(name)
            specific = s is not None
            if s:
                seen_isas.add(s.group(1))
            if "isa_generic" in name:
                seen_isas.add("generic")
            continue
        if specific or not name:
            continue
        m = INSN.match(line)
        if m and FORBIDDEN.match(m.group(1)):
            bad.setdefault(name, set()).add(m.group(1))
    syms = subprocess.run(["nm", "-C", str(so)], capture_output=True, text=True, check=True).stdout
    eigen = sorted(
        {ln.split(" ", 2)[-1] for ln in syms.splitlines() if re.search(r"\bEigen::", ln)}
    )
    status = 0
    if bad:
        status = 1
        print(
            f"check-isa-isolation: {len(bad)} function(s) outside the AVX namespaces use AVX/BMI "
            "instructions (the generic path could run them):",
            file=sys.stderr,
        )
        for n, ins in sorted(bad.items())[:40]:
            print(f"  {n[:160]}: {' '.join(sorted(ins)[:6])}", file=sys.stderr)
    if eigen:
        status = 1
        print(
            f"check-isa-isolation: {len(eigen)} symbol(s) in the un-renamed Eigen namespace:",
            file=sys.stderr,
        )
        for n in eigen[:20]:
            print(f"  {n[:160]}", file=sys.stderr)
    print(
        f"check-isa-isolation: {so.name}: {functions} functions; variants with their own code: "
        f"{', '.join(sorted(seen_isas)) or 'none'}; "
        f"{'OK' if status == 0 else 'FAILED'}"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
