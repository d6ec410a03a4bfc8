"""Issue 34: the extension builds against the user's torch where it is a supported one (2.13.x, 2.14.x,
2.15.x), is refused at build time outside that range by a message that names it, pip's build isolation
cannot swap in another torch unnoticed, a build is only loaded under the torch series it was built for,
and ``python -m hebrus_torch --report`` says plainly whether the native kernels are in use."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
import torch

from hebrus_torch import _extension
from hebrus_torch._torch_support import (SUPPORTED_MINORS, SUPPORTED_RANGE, cxx_standard, isolated_build_mismatch,
                                         minor, supported_range_text, unsupported_torch)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The installed torch's distribution version, as pip records it: without the local tag torch.__version__
# may carry (PyPI's Linux CUDA wheels: "2.15.0" for torch.__version__ "2.15.0+cu132").
INSTALLED_TORCH = importlib.metadata.version("torch")


def test_supported_range():
    assert SUPPORTED_MINORS == ("2.13", "2.14", "2.15")
    assert supported_range_text() == "torch 2.13.x, 2.14.x or 2.15.x"
    for version in ("2.13.0", "2.13.0+cpu", "2.14.1+cu130", "2.15.0", "2.15.2"):
        assert unsupported_torch(version) is None, version
    for version in ("2.12.1", "2.16.0", "2.16.0.dev20260301+cpu", "3.0.0", "not-a-version"):
        why = unsupported_torch(version)
        assert why is not None and "2.13.x, 2.14.x or 2.15.x" in why, version
    assert "found torch 2.16.0" in unsupported_torch("2.16.0")
    assert minor("2.14.1+cu130") == "2.14" and minor("2.16.0.dev20260301") == "2.16"


def test_the_running_torch_is_a_supported_one():
    assert unsupported_torch(torch.__version__) is None


def test_cxx_standard_is_cxx20_for_every_supported_torch():
    # torch 2.14's and 2.15's headers need C++20 (ATen.h #error); 2.13's cpp_extension defaults to it too.
    for series in SUPPORTED_MINORS:
        assert cxx_standard(series + ".0") == "c++20"


def test_pyproject_requires_the_supported_range_not_one_torch():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert f"torch{SUPPORTED_RANGE}" in project["build-system"]["requires"]
    assert f"torch{SUPPORTED_RANGE}" in project["project"]["dependencies"]


@pytest.fixture
def source_copy(tmp_path) -> str:
    """What setup.py reads, copied (no build outputs): its checks run there, not in this checkout."""
    import shutil

    dst = tmp_path / "src"
    dst.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), dst / name)
    for name in ("hebrus_torch", "csrc", "mps_kernels"):
        shutil.copytree(os.path.join(ROOT, name), dst / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "_build_info.json"))
    return str(dst)


def run_setup_with_torch(src: str, version: str | None = None) -> subprocess.CompletedProcess:
    """``setup.py --version`` in ``src`` (its torch checks run when the extension is declared, before anything
    is compiled) under a torch that reports ``version`` (default: the real one)."""
    code = ("import runpy, sys, torch\n"
            + (f"torch.__version__ = {version!r}\n" if version else "")
            + "sys.argv = ['setup.py', '--version']\n"
            "runpy.run_path('setup.py', run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if k != "HEBRUS_SKIP_TORCH_CHECK"}
    return subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("version", ["2.12.1", "2.16.0"])
def test_setup_refuses_a_torch_outside_the_range_by_name(source_copy, version):
    done = run_setup_with_torch(source_copy, version)
    assert done.returncode != 0
    assert f"found torch {version}" in done.stderr and "2.13.x, 2.14.x or 2.15.x" in done.stderr, done.stderr[-2000:]
    assert not os.path.exists(os.path.join(source_copy, "hebrus_torch", "_build_info.json"))   # nothing recorded


def test_setup_refuses_a_build_against_another_torch_than_the_environments(source_copy):
    # Build isolation's case: the build imports a supported torch of another series than the one installed.
    other = "2.15.0" if minor(torch.__version__) != "2.15" else "2.14.1"
    done = run_setup_with_torch(source_copy, other)
    assert done.returncode != 0
    assert f"built against torch {other}, but the environment it installs into has torch {INSTALLED_TORCH}" \
        in done.stderr and "--no-build-isolation" in done.stderr, done.stderr[-2000:]


def test_setup_builds_against_the_running_torch_as_cxx20(source_copy):
    done = run_setup_with_torch(source_copy)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(os.path.join(source_copy, "hebrus_torch", "_build_info.json")) as f:
        assert json.load(f) == {"torch": torch.__version__, "cxx": "c++20"}


def test_an_isolated_build_against_another_torch_series_is_refused():
    # What pip's build isolation does with a pinned or newest torch: the build imports one torch, the
    # environment it installs into has another. The environment's torch is read outside the isolation.
    assert isolated_build_mismatch(torch.__version__, sys.executable) is None
    other = "2.15.0" if minor(torch.__version__) != "2.15" else "2.14.1"
    why = isolated_build_mismatch(other, sys.executable)
    assert why is not None and f"built against torch {other}" in why and f"has torch {INSTALLED_TORCH}" in why
    assert "--no-build-isolation" in why


def test_isolated_build_check_reads_the_environment_past_pythonpath(tmp_path):
    # pip's isolation works through PYTHONPATH (a sitecustomize that hides the environment's site-packages
    # and adds the build requirements): a fake torch 2.99.0 on PYTHONPATH is not the environment's torch.
    fake = tmp_path / "torch-2.99.0.dist-info"
    fake.mkdir()
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.99.0\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    seen = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                          env=env, capture_output=True, text=True, timeout=120).stdout.strip()
    assert seen == "2.99.0"                                           # what the build would see
    code = ("import runpy, sys; print(runpy.run_path(sys.argv[1])['environment_torch'](sys.executable))")
    module = os.path.join(ROOT, "hebrus_torch", "_torch_support.py")
    got = subprocess.run([sys.executable, "-c", code, module], env=env, capture_output=True, text=True,
                         timeout=120).stdout.strip()
    assert got == INSTALLED_TORCH


def test_a_build_is_only_loaded_under_its_torch_series(tmp_path):
    info = tmp_path / "_build_info.json"
    info.write_text(json.dumps({"torch": "2.13.0+cpu", "cxx": "c++20"}))
    assert _extension.build_mismatch(str(info), "2.13.1") is None
    for running in ("2.14.1+cu130", "2.15.0"):
        why = _extension.build_mismatch(str(info), running)
        assert f"built against torch 2.13.0+cpu, this is torch {running}" in why
        assert "rebuild it against this torch: pip install --no-build-isolation" in why
    why = _extension.build_mismatch(str(info), "2.16.0")
    assert "outside the supported range (torch 2.13.x, 2.14.x or 2.15.x)" in why
    assert _extension.build_info(str(info)) == {"torch": "2.13.0+cpu", "cxx": "c++20"}
    info.write_text("[1, 2]")
    assert _extension.build_info(str(info)) is None and _extension.build_mismatch(str(info), "2.15.0") is None


def run_report(package_root: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hebrus_torch", "--report"], cwd=package_root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": package_root})


def test_report_names_the_torch_and_the_native_ops():
    done = run_report(ROOT)
    first = done.stdout.splitlines()[0]
    assert first == f"hebrus_torch 0.1.0 on torch {torch.__version__}"
    if _extension.EXTENSION_ERROR is None:
        assert done.returncode == 0 and "native extension: loaded" in done.stdout
        assert all(line.split()[1] == "native" for line in done.stdout.splitlines()[3:] if line.strip())
    else:
        assert done.returncode == 1 and "native extension: NOT USED" in done.stdout


def test_report_says_plainly_when_the_extension_is_not_used(tmp_path):
    # A copy of the package whose recorded build is for another torch: not loaded, and the report says why.
    import shutil

    shutil.copytree(os.path.join(ROOT, "hebrus_torch"), tmp_path / "hebrus_torch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "hebrus_torch" / "_build_info.json").write_text(json.dumps({"torch": "2.12.0"}))
    done = run_report(str(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "native extension: NOT USED: every op runs its PyTorch reference" in done.stdout
    assert f"why: hebrus_torch's extension was built against torch 2.12.0, this is torch {torch.__version__}" \
        in done.stdout
    assert "native" not in "".join(line.split()[1] for line in done.stdout.splitlines()[4:] if line.strip())


def test_macos_workflow_builds_and_tests_every_supported_torch():
    yaml = pytest.importorskip("yaml")
    with open(os.path.join(ROOT, ".github", "workflows", "macos.yml")) as f:
        jobs = yaml.safe_load(f)["jobs"]
    for name in ("build", "pipelines", "mps"):
        job = jobs[name]
        versions = job["strategy"]["matrix"]["torch"]
        assert tuple(minor(v) for v in versions) == SUPPORTED_MINORS, name
        assert job["strategy"]["fail-fast"] is False and "continue-on-error" not in job, name
        steps = "\n".join(step.get("run", "") for step in job["steps"])
        assert "torch==${{ matrix.torch }}" in steps, name
    for name in ("build", "mps"):
        assert "python -m hebrus_torch --report" in "\n".join(s.get("run", "") for s in jobs[name]["steps"]), name


def test_a_wheel_carries_the_recorded_torch(source_copy):
    # Without _build_info.json in the wheel, a non-editable install would load its extension under any torch.
    env = {k: v for k, v in os.environ.items() if k != "HEBRUS_SKIP_TORCH_CHECK"}
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", "wheel_lib"], cwd=source_copy,
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(os.path.join(source_copy, "wheel_lib", "hebrus_torch", "_build_info.json")) as f:
        assert json.load(f)["torch"] == torch.__version__
