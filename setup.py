"""Build of hebrus_torch._C: CPU kernels everywhere, Metal kernels and .mm glue on macOS."""

from __future__ import annotations

import glob
import os
import platform
import sys

from setuptools import setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "mps_kernels"))


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def extension() -> CppExtension:
    debug = os.environ.get("DEBUG", "0") == "1"
    # -ffp-contract=off: no fused multiply-add the source did not ask for, so every build of a
    # kernel sums in the order the source states (chunk invariance is bitwise).
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    cxx += ["-std=c++17", "-ffp-contract=off", "-fvisibility=hidden"]
    sources = ["csrc/library.cpp"] + _sources("csrc/cpu/*.cpp")
    extra_link: list[str] = []
    if platform.system() == "Linux":
        # at::parallel_for only runs threads when the extension itself is built with OpenMP
        # (it then shares torch's libgomp).
        cxx.append("-fopenmp")
        extra_link.append("-fopenmp")
    include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "mps_kernels")]
    with_mps = platform.system() == "Darwin" and torch.backends.mps.is_built()
    if with_mps:
        from embed_metal import write_embedded_header  # mps_kernels/embed_metal.py

        write_embedded_header(os.path.join(ROOT, "mps_kernels"), os.path.join(ROOT, "build", "generated"))
        include_dirs.append(os.path.join(ROOT, "build", "generated"))
        sources += _sources("csrc/mps/*.mm")
        cxx += ["-ObjC++", "-DHEBRUS_WITH_MPS=1"]
        if os.environ.get("HEBRUS_METAL_BFLOAT", "1") == "1":
            cxx.append("-DHEBRUS_METAL_BFLOAT=1")
        extra_link += ["-framework", "Metal", "-framework", "Foundation"]
    return CppExtension(
        "hebrus_torch._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx},
        extra_link_args=extra_link,
        py_limited_api=True,
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
