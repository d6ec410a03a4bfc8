"""Type-check the MPS glue (csrc/mps/*.mm) as plain C++ against the installed torch headers, in the C++
standard setup.py builds that torch with (hebrus_torch._torch_support.cxx_standard: C++20 from torch 2.15).

The glue uses only PyTorch's C++ MetalShaderLibrary API, whose Objective-C types sit behind
``#ifdef __OBJC__``; compiled as C++ (``g++ -x c++ -fsyntax-only``) every call, type and overload
is checked on Linux. The embedded-source header is generated first, as setup.py does on macOS.
Each file is checked with and without bfloat kernels (HEBRUS_METAL_BFLOAT).

    python tests/metal/check_mm_syntax.py      # exit status 0 when every file passes
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "mps_kernels"))
sys.path.insert(0, REPO)
import embed_metal  # noqa: E402


def mm_files() -> list[str]:
    return sorted(glob.glob(os.path.join(REPO, "csrc", "mps", "*.mm")))


def command(path: str, generated: str, bfloat: bool, cxx: str = "g++") -> list[str]:
    import torch
    from torch.utils.cpp_extension import include_paths

    from hebrus_torch._torch_support import cxx_standard

    cmd = [cxx, "-x", "c++", f"-std={cxx_standard(torch.__version__)}", "-fsyntax-only", "-Wall", "-Wno-unused-function",
           "-DHEBRUS_WITH_MPS=1", "-I", os.path.join(REPO, "csrc"), "-I", os.path.join(REPO, "mps_kernels"),
           "-I", generated]
    for inc in include_paths():
        cmd += ["-isystem", inc]
    if bfloat:
        cmd.append("-DHEBRUS_METAL_BFLOAT=1")
    return cmd + [path]


def check(path: str, generated: str, bfloat: bool = True, cxx: str = "g++") -> tuple[str, bool, str]:
    """(file and variant, ok, compiler output) of one .mm; `generated` holds the embedded-source header."""
    r = subprocess.run(command(path, generated, bfloat, cxx), capture_output=True, text=True)
    name = f"{os.path.relpath(path, REPO)} (HEBRUS_METAL_BFLOAT={int(bfloat)})"
    return name, r.returncode == 0 and "warning:" not in r.stderr, r.stderr


def inputs_digest(cxx: str = "g++") -> str:
    """Hash of everything the check reads: glue, kernel sources, torch version, compiler."""
    import hashlib

    import torch

    h = hashlib.sha1(torch.__version__.encode())
    h.update(subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.encode())
    paths = [*mm_files(), *glob.glob(os.path.join(REPO, "csrc", "mps", "*.h")),
             *glob.glob(os.path.join(REPO, "csrc", "*.h")),
             *glob.glob(os.path.join(REPO, "mps_kernels", "*")), os.path.abspath(__file__)]
    for p in sorted(paths):
        if os.path.isfile(p):
            h.update(p.encode())
            h.update(open(p, "rb").read())
    return h.hexdigest()[:16]


def check_all(cxx: str = "g++", variants=(True, False), jobs: int = 2,
              bfloat_off_files: int | None = None) -> list[tuple[str, bool, str]]:
    """check() of every .mm with and without bfloat kernels, `jobs` compilers at a time.
    `bfloat_off_files` limits the HEBRUS_METAL_BFLOAT=0 pass to the first n files (the macro is
    only read in hebrus_mps.h, which every file includes)."""
    from concurrent.futures import ThreadPoolExecutor

    with tempfile.TemporaryDirectory(prefix="hebrus_mm_") as generated:
        embed_metal.write_embedded_header(os.path.join(REPO, "mps_kernels"), generated)
        files = mm_files()
        work = [(f, True) for f in files] if True in variants else []
        if False in variants:
            work += [(f, False) for f in files[: bfloat_off_files if bfloat_off_files is not None else len(files)]]
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(lambda fb: check(fb[0], generated, fb[1], cxx), work))


if __name__ == "__main__":
    import torch

    from hebrus_torch._torch_support import cxx_standard

    print(f"torch {torch.__version__}, -std={cxx_standard(torch.__version__)}")
    failed = 0
    for name, ok, out in check_all(*sys.argv[1:], jobs=os.cpu_count() or 2):
        print(("ok    " if ok else "FAIL  ") + name)
        if not ok:
            failed += 1
            print(out)
    sys.exit(1 if failed else 0)
