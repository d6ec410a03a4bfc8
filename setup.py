"""Build of hebrus_torch._C: CPU kernels everywhere, Metal kernels and .mm glue on macOS."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import platform
import sys

from setuptools import setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "mps_kernels"))

# The torch versions the C++ kernels are built and tested against (hebrus_torch/_torch_support.py, read by
# its path: importing the package here would import torch's extension). The extension uses torch's C++ API
# (not only its stable ABI), so a build against another torch can crash at run time (a qsa_pool built
# against torch 2.11 segfaulted): refuse a torch outside the range here, and record the version so that
# the package refuses to load a build whose torch has changed since (hebrus_torch/_extension.py).
_spec = importlib.util.spec_from_file_location("_hebrus_torch_support",
                                               os.path.join(ROOT, "hebrus_torch", "_torch_support.py"))
torch_support = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torch_support)
BUILD_INFO = os.path.join(ROOT, "hebrus_torch", "_build_info.json")


def _check_torch() -> None:
    if os.environ.get("HEBRUS_SKIP_TORCH_CHECK") != "1":
        # A torch outside the range; or pip's build isolation importing another torch series than the
        # environment being installed into has (the build would then never be loaded there).
        why = (torch_support.unsupported_torch(torch.__version__)
               or torch_support.isolated_build_mismatch(torch.__version__, sys.executable))
        if why is not None:
            raise SystemExit(why)
    with open(BUILD_INFO, "w") as f:
        json.dump({"torch": torch.__version__, "cxx": torch_support.cxx_standard(torch.__version__)}, f)


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def extension() -> CppExtension:
    _check_torch()
    debug = os.environ.get("DEBUG", "0") == "1"
    # -ffp-contract=off: no fused multiply-add the source did not ask for, so every build of a
    # kernel sums in the order the source states (chunk invariance is bitwise).
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    # C++20 on every supported torch (2.14's and 2.15's headers require it; hebrus_torch/_torch_support.py).
    cxx += [f"-std={torch_support.cxx_standard(torch.__version__)}", "-ffp-contract=off", "-fvisibility=hidden"]
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
