"""The torch versions the C++/Metal extension builds against, and how each is built.

The extension uses torch's C++ API (``at::Tensor``, ``at::parallel_for``, ``TORCH_LIBRARY``, and on macOS
``at::native::mps::MetalShaderLibrary``), not only its stable ABI, so a build serves exactly the torch
minor series it was compiled against: each supported torch is built on its own (docs/install.md says
why). setup.py reads this module by its path (it must not import the package, which imports torch's
extension), hebrus_torch._extension and ``python -m hebrus_torch`` import it; so it imports nothing
but the standard library.
"""

from __future__ import annotations

__all__ = ["SUPPORTED_MINORS", "SUPPORTED_RANGE", "cxx_standard", "minor", "supported_range_text",
           "unsupported_torch"]

# Each minor series is built and its test suite run (tests/torch_matrix.sh; macOS CI's matrix).
SUPPORTED_MINORS: tuple[str, ...] = ("2.13", "2.14", "2.15")
# The same range as a requirement specifier (pyproject.toml's build requirement and dependency state
# it too; tests/test_torch_support.py checks they agree).
SUPPORTED_RANGE = ">=2.13,<2.16"
# The C++ standard: C++20 on every supported torch. 2.14's and 2.15's headers require it (ATen.h: "#error C++20
# or later compatible compiler is required to use ATen"); 2.13's warn without it (default member initializers
# for bit-fields, c10/core/AutogradState.h) and its cpp_extension builds extensions as C++20 unless told
# otherwise. Older torches (only built with HEBRUS_SKIP_TORCH_CHECK=1) keep C++17.
_FIRST_CXX20 = (2, 13)


def _minor_tuple(version: str) -> tuple[int, int]:
    parts = str(version).split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"not a torch version: {version!r}") from None


def minor(version: str) -> str:
    """``"2.15"`` of ``"2.15.0+cu130"``, ``"2.14.1"``, ``"2.16.0.dev20260101"``: the series a build is for."""
    return "%d.%d" % _minor_tuple(version)


def supported_range_text() -> str:
    """The supported range in words: ``"torch 2.13.x, 2.14.x or 2.15.x"``."""
    names = [f"{m}.x" for m in SUPPORTED_MINORS]
    return "torch " + ", ".join(names[:-1]) + " or " + names[-1]


def unsupported_torch(version: str) -> str | None:
    """Why the extension is not built against torch ``version`` (a message naming the supported range),
    or None where it is supported."""
    try:
        series = minor(version)
    except ValueError as exc:
        return f"hebrus_torch's C++ extension builds against {supported_range_text()}: {exc}"
    if series in SUPPORTED_MINORS:
        return None
    return (f"hebrus_torch's C++ extension builds against {supported_range_text()} (torch{SUPPORTED_RANGE}), "
            f"found torch {version}: install a supported torch (e.g. pip install 'torch{SUPPORTED_RANGE}') and "
            f"build again; docs/install.md lists what each version is checked with")


def cxx_standard(version: str) -> str:
    """The ``-std=`` value the extension (and the tests' syntax checks of csrc/) compiles with against
    torch ``version``: ``"c++20"`` from torch 2.13 on, else ``"c++17"``."""
    return "c++20" if _minor_tuple(version) >= _FIRST_CXX20 else "c++17"


def environment_torch(python: str) -> str | None:
    """The torch version installed for interpreter ``python`` as it runs on its own, or None without one.

    ``-I`` ignores PYTHONPATH, through which pip's build isolation (a sitecustomize) swaps the
    environment's site-packages for the isolated build requirements: the answer is the torch of the
    environment pip installs into, not the one the build imports."""
    import subprocess

    code = ("import importlib.metadata as m\n"
            "try:\n    print(m.version('torch'))\nexcept m.PackageNotFoundError:\n    pass\n")
    try:
        done = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def isolated_build_mismatch(build_torch: str, python: str) -> str | None:
    """Why a build against torch ``build_torch`` would not serve the environment of ``python``: pip's build
    isolation installed another torch series for the build than the environment has (the extension would
    then be refused at import and every op would run its PyTorch reference). None where they agree, and
    where the environment has no torch (pip installs one from the dependencies)."""
    installed = environment_torch(python)
    if installed is None or minor(installed) == minor(build_torch):
        return None
    return (f"hebrus_torch is being built against torch {build_torch}, but the environment it installs into has "
            f"torch {installed}: a build serves only the torch it was built against, so the extension would not "
            f"be loaded there. pip's build isolation installed the other torch; build against yours with "
            f"`pip install --no-build-isolation .` (or -e .), see docs/install.md")
