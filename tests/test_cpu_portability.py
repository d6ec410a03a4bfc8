"""The CPU kernels also build where they are not built here: the portable path (what arm64 macOS and
any non-x86 CPU compile, with x86 blocks switched off) and clang's dialect of the vector extensions,
checked with ``clang++ -fsyntax-only`` against the installed torch headers (in setup.py's C++ standard for them)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLANG = os.environ.get("HEBRUS_CLANG", "clang++-19")
KERNELS = sorted(f for f in os.listdir(os.path.join(ROOT, "csrc", "cpu")) if f.endswith(".cpp"))

pytestmark = pytest.mark.skipif(shutil.which(CLANG) is None, reason=f"{CLANG} is not installed")


def clang_syntax(source_root: str, name: str) -> subprocess.CompletedProcess:
    import torch
    from torch.utils.cpp_extension import include_paths

    from hebrus_torch._torch_support import cxx_standard

    cmd = [CLANG, f"-std={cxx_standard(torch.__version__)}", "-fsyntax-only", "-ffp-contract=off", "-Werror=unused-function",
           "-I", os.path.join(source_root, "csrc"), "-I", os.path.join(ROOT, "mps_kernels"),
           "-I", sysconfig.get_paths()["include"]]
    for inc in include_paths():
        cmd += ["-I", inc]
    cmd.append(os.path.join(source_root, "csrc", "cpu", name))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name", KERNELS)
def test_portable_path_compiles_with_clang(tmp_path, name):
    """Every `defined(__x86_64__)` block off: the code a non-x86 build sees."""
    src = os.path.join(ROOT, "csrc")
    dst = tmp_path / "csrc"
    shutil.copytree(src, dst)
    for folder, _, files in os.walk(dst):
        for f in files:
            path = os.path.join(folder, f)
            text = open(path).read()
            open(path, "w").write(re.sub(r"defined\(__x86_64__\)", "0", text))
    done = clang_syntax(str(tmp_path), name)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.parametrize("name", KERNELS)
def test_x86_path_compiles_with_clang(name):
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip("the x86 path needs an x86-64 Linux host here")
    done = clang_syntax(ROOT, name)
    assert done.returncode == 0, done.stderr[-4000:]
