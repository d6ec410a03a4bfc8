"""msl_emu: compile Metal compute kernels as host C++ (shim/msl_shim.h) and run them on the CPU.

    mod = msl_emu.build("mps_kernels/ple_conv.metal")       # translate + compile to a cached .so
    mod.dispatch("ple_conv_float", [x, w, ...], grid=(n, 1, 1), tg=(256, 1, 1))   # dispatchThreads
    ok, out = msl_emu.check_clang("mps_kernels/ple_conv.metal")   # strict address-space check

What gets compiled is :func:`embed_metal.inline_source` of the file, the same text the MPS glue
embeds and hands to Metal, behind ``#include "msl_shim.h"`` and three line-preserving rewrites no
macro can express: ``[[threadgroup(i)]]`` parameters, threadgroup locals (one poisoned,
bounds-checked copy per threadgroup) and threadgroup pointers (bounds-checked ``tgptr``).
Kernels are found as plain ``kernel void name(`` functions and as ``[[host_name("...")]]``
instantiations after macro expansion (``g++ -E``), so MLX-style instantiation macros work.

Every GPU thread is a fiber; threadgroups run one at a time per worker in forward, reverse or
random order, and so do the fibers inside a threadgroup between synchronisation points. Buffers are
copied into guard-paged memory for the launch: an access past either end of a device buffer stops
the launch with the buffer, offset, GPU thread and source line (``MSLError``).

Shared objects are cached under ``build/metal_emu/`` keyed by a hash of the translated source,
the shim and the compiler flags.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(HERE, "shim")
SCAN_DIR = os.path.join(SHIM, "scan")
REPO = os.path.dirname(os.path.dirname(HERE))
KERNEL_DIR = os.path.join(REPO, "mps_kernels")
BUILD_DIR = os.environ.get("HEBRUS_METAL_EMU_BUILD", os.path.join(REPO, "build", "metal_emu"))
CXXFLAGS = ["-std=c++20", "-fno-exceptions", "-fno-rtti", "-ffp-contract=off", "-fvisibility=hidden",
            "-Wno-attributes", "-I", SHIM]
CLANG = os.environ.get("HEBRUS_CLANG", "clang++-19")

if KERNEL_DIR not in sys.path:
    sys.path.insert(0, KERNEL_DIR)
import embed_metal  # noqa: E402  (mps_kernels/embed_metal.py)

# Definitions the glue prepends to the embedded source (csrc/mps/hebrus_mps.h).
DEFAULT_DEFINES = {"HEBRUS_METAL_BFLOAT": "1"}


class MSLError(RuntimeError):
    """A kernel failed to compile, or a launch hit a bug the emulator detects."""


class WatchdogError(MSLError):
    """A launch ran past the watchdog's budget (``watchdog_s``): a kernel that does not terminate."""


# ---- translation ----------------------------------------------------------------------------------

_TYPE = r"[A-Za-z_][\w:]*(?:\s*<[^<>;(){}]*>)?"
_TG_LOCAL = re.compile(r"\bthreadgroup\s+((?:const\s+)?" + _TYPE + r")\s+([A-Za-z_]\w*)\s*((?:\[[^\];]*\]\s*)*);")
_TG_PTR_CONST_FIRST = re.compile(r"\bconst\s+threadgroup\s+(" + _TYPE + r")\s*\*")
_TG_PTR = re.compile(r"\bthreadgroup\s+((?:const\s+)?" + _TYPE + r"(?:\s+const)?)\s*\*")
_KERNEL_DECL = re.compile(r"(?P<head>template\s*<[^;{}]*>\s*)?(?:\[\[\s*kernel\b[^\]]*\]\]|\bkernel\b)\s*"
                          r"(?:\[\[[^\]]*\]\]\s*)*void\s+(?P<name>[A-Za-z_]\w*)\s*\(")
_INSTANTIATION = re.compile(r"template\s*\[\[\s*host_name\s*\(\s*(?P<name>(?:\"[^\"]*\"\s*)+)\)\s*\]\]\s*"
                            r"\[\[\s*kernel\s*\]\]\s*decltype\s*\(\s*(?P<fn>[^;]+?)\s*\)\s*(?P=fn)\s*;")


_PRAGMA_CONTRACT_OFF = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+METAL[ \t]+fp[ \t]+contract[ \t]*\([ \t]*off[ \t]*\)[ \t]*$", re.M)
_HOST_CONTRACT_OFF = "MSL_FP_CONTRACT_OFF"  # shim/msl_shim.h: the host compiler's pragma, on one line
_PRAGMA_MATH_MODE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+METAL[ \t]+fp[ \t]+math_mode[ \t]*\([^)]*\)[ \t]*$", re.M)
_HOST_NAME_ATTRS = re.compile(r"template(\s*)\[\[\s*host_name\s*\([^\]]*\)\s*\]\]\s*\[\[\s*kernel\s*\]\]")


def rewrite(src: str) -> str:
    """Line-preserving rewrites of threadgroup declarations (see module docstring), and Metal's
    attributes between `template` and an explicit instantiation dropped (standard C++ rejects them;
    the kernel names were collected from them before)."""
    src = _HOST_NAME_ATTRS.sub(r"template\1", src)
    src = re.sub(r"\[\[\s*threadgroup\s*\(", "[[msl_threadgroup_arg(", src)
    # Metal's fp pragmas, as the host compiler's: contraction off is honoured whatever -ffp-contract
    # says (so building with =fast shows what the pragma pins); math_mode(safe) is the host's default.
    src = _PRAGMA_CONTRACT_OFF.sub(_HOST_CONTRACT_OFF, src)
    src = _PRAGMA_MATH_MODE.sub("", src)
    counter = iter(range(1, 1 << 30))

    def local(m: re.Match) -> str:
        typ, name, dims = m.group(1), m.group(2), re.findall(r"\[([^\]]*)\]", m.group(3))
        full = f"::msl_rt::tgarray<{typ}, {', '.join(d.strip() for d in dims)}>" if dims else typ
        return f"auto& {name} = ::msl_rt::tg_local<{full}>({next(counter)});"

    src = _TG_LOCAL.sub(local, src)
    src = _TG_PTR_CONST_FIRST.sub(lambda m: f"::msl_rt::tgptr<const {m.group(1)}> ", src)
    src = _TG_PTR.sub(lambda m: f"::msl_rt::tgptr<{m.group(1)}> ", src)
    return src


def _prelude(defines: dict[str, str]) -> str:
    return "".join(f"#define {k} {v}\n" for k, v in defines.items())


def scan_kernels(text: str, defines: dict[str, str], cxx: str = "g++") -> list[tuple[str, str]]:
    """[(kernel name, call expression)] after macro expansion of the (inlined) source."""
    pre = "#define __METAL_VERSION__ 320\n#define MSL_EMULATOR 1\n" + _prelude(defines)
    r = subprocess.run([cxx, "-E", "-P", "-x", "c++", "-std=c++20", "-I", SCAN_DIR, "-"], input=pre + text,
                       capture_output=True, text=True)
    if r.returncode:
        raise MSLError("preprocessing failed:\n" + r.stderr)
    found: dict[str, str] = {}
    for m in _KERNEL_DECL.finditer(r.stdout):
        if not m.group("head"):
            found[m.group("name")] = m.group("name")
    for m in _INSTANTIATION.finditer(r.stdout):
        name = "".join(re.findall(r"\"([^\"]*)\"", m.group("name")))
        found[name] = re.sub(r"\s+", " ", m.group("fn"))
    return list(found.items())


_MAX_TOTAL = re.compile(r"\[\[\s*kernel\s*,\s*max_total_threads_per_threadgroup\s*\(\s*(\d+)\s*\)\s*\]\]\s*"
                        r"void\s+([A-Za-z_]\w*)\s*\(")


def kernel_limits(text: str, defines: dict[str, str], cxx: str = "g++") -> dict[str, int]:
    """{kernel name: max_total_threads_per_threadgroup} for kernels that declare one (after macro expansion)."""
    pre = "#define __METAL_VERSION__ 320\n#define MSL_EMULATOR 1\n" + _prelude(defines)
    r = subprocess.run([cxx, "-E", "-P", "-x", "c++", "-std=c++20", "-I", SCAN_DIR, "-"], input=pre + text,
                       capture_output=True, text=True)
    if r.returncode:
        raise MSLError("preprocessing failed:\n" + r.stderr)
    by_fn = {m.group(2): int(m.group(1)) for m in _MAX_TOTAL.finditer(r.stdout)}
    out = {}
    for name, call in scan_kernels(text, defines, cxx):
        base = call.split("<")[0].strip()
        if base in by_fn:
            out[name] = by_fn[base]
    return out


def translate(path: str, defines: dict[str, str] | None = None, cxx: str = "g++") -> tuple[str, list[str]]:
    """C++ translation unit for a .metal file; returns (text, kernel names)."""
    defines = dict(DEFAULT_DEFINES if defines is None else defines)
    text = embed_metal.inline_source(path, (KERNEL_DIR,), line_names="abspath")
    kernels = scan_kernels(text, defines, cxx)
    out = ['#include "msl_shim.h"\n', _prelude(defines), rewrite(text), '\n#line 1 "<msl_emu launchers>"\n']
    for name, call in kernels:
        out.append(f'extern "C" __attribute__((visibility("default"))) int msl_launch__{name}'
                   f'(const ::msl_rt::LaunchDesc* L) {{ return ::msl_rt::launch(L, [] {{ {call}(); }}); }}\n')
    return "".join(out), [n for n, _ in kernels]


def _shim_digest() -> str:
    h = hashlib.sha1()
    for name in sorted(os.listdir(SHIM)):
        p = os.path.join(SHIM, name)
        if os.path.isfile(p):
            h.update(name.encode())
            h.update(open(p, "rb").read())
    return h.hexdigest()


def _compile_cached(source: str, stem: str, cmd_prefix: list[str], suffix: str, key_extra: str = "") -> str:
    """Compile `source` to a shared object under BUILD_DIR unless an identical build exists.
    `key_extra`: anything else the result depends on (contents of headers it includes)."""
    key = hashlib.sha1("\0".join([source, key_extra, _shim_digest(), *cmd_prefix]).encode()).hexdigest()[:16]
    os.makedirs(BUILD_DIR, exist_ok=True)
    so = os.path.join(BUILD_DIR, f"{stem}.{key}.{suffix}.so")
    if os.path.exists(so):
        return so
    fd, cpp = tempfile.mkstemp(prefix=stem + ".", suffix=".cpp", dir=BUILD_DIR)
    with os.fdopen(fd, "w") as f:
        f.write(source)
    tmp_so = cpp[:-4] + ".so"
    r = subprocess.run([*cmd_prefix, cpp, "-o", tmp_so], capture_output=True, text=True)
    if r.returncode:
        raise MSLError(f"compile of {stem} failed:\n{r.stderr}")
    os.replace(tmp_so, so)
    os.replace(cpp, so[:-3] + ".cpp")  # kept next to the .so: addr2line and debuggers read it
    return so


# ---- launching ------------------------------------------------------------------------------------

class LaunchDesc(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("tg", ctypes.c_uint32 * 3), ("mode", ctypes.c_int32),
                ("buffers", ctypes.POINTER(ctypes.c_void_p)), ("buf_len", ctypes.POINTER(ctypes.c_uint64)),
                ("nbuf", ctypes.c_int32), ("tg_len", ctypes.POINTER(ctypes.c_uint64)), ("ntg", ctypes.c_int32),
                ("workers", ctypes.c_int32), ("sched", ctypes.c_int32), ("seed", ctypes.c_uint32),
                ("strict", ctypes.c_int32), ("stack_kb", ctypes.c_uint64), ("guard", ctypes.c_int32),
                ("err", ctypes.c_void_p), ("errlen", ctypes.c_int32), ("simd_seed", ctypes.c_uint32),
                ("device_vis", ctypes.c_int32), ("watchdog_s", ctypes.c_double)]

# The SIMD-group reduction order of the emulated GPU (shim: tree_reduce): a random binary tree drawn
# from this seed; 0 is plain lane order. Fixed per session, as a GPU's order is fixed by its hardware;
# tests vary it to show no kernel depends on it beyond rounding.
SIMD_SEED = int(os.environ.get("HEBRUS_EMU_SIMD_SEED", "1"))


SCHEDULES = ("forward", "reverse", "random")

# The emulated GPU's watchdog: CPU seconds a launch may take (per worker thread) before it is aborted
# with a WatchdogError naming the kernel, as a GPU aborts a command buffer whose kernel does not
# finish. Every kernel of today launches in well under a second of CPU at the mutation checks' sizes
# (gdn_delta_rule_slots: 0.2 s); the default leaves room for the larger test shapes. 0 turns it off.
WATCHDOG_S = float(os.environ.get("HEBRUS_EMU_WATCHDOG_S", "300"))


def _as_buffer(b):
    """(address, nbytes, keep-alive) of a buffer argument: a CPU torch tensor, numpy array or bytes."""
    if hasattr(b, "data_ptr") and hasattr(b, "is_contiguous"):  # torch.Tensor
        if b.device.type != "cpu" or not b.is_contiguous():
            raise ValueError("emulator buffers must be contiguous CPU tensors")
        return b.data_ptr(), b.numel() * b.element_size(), b
    if hasattr(b, "__array_interface__"):  # numpy
        if not b.flags.c_contiguous:
            raise ValueError("emulator buffers must be C-contiguous")
        return b.ctypes.data, b.nbytes, b
    if isinstance(b, (bytes, bytearray, memoryview)):
        raw = bytes(b)
        buf = ctypes.create_string_buffer(raw, len(raw))
        return ctypes.addressof(buf), len(raw), buf
    raise TypeError(f"unsupported buffer type {type(b)}")


class Module:
    def __init__(self, so_path: str, names: list[str], limits: dict[str, int] | None = None):
        self.path = so_path
        self.lib = ctypes.CDLL(so_path)
        self.kernels = names
        self.limits = limits or {}  # kernel -> max_total_threads_per_threadgroup

    def dispatch(self, name: str, buffers, grid, tg, *, threads: bool = True, tg_mem=(), sched: str = "forward",
                 seed: int = 0, workers: int = 1, strict: bool = True, guard: str = "end", stack_kb: int = 256,
                 simd_seed: int | None = None, device_visibility: bool = False, watchdog_s: float | None = None):
        """Run kernel `name`. With threads=True (the default, MetalKernelFunction::dispatch) `grid` is
        threads per grid and the last threadgroup may be partial; with threads=False `grid` is
        threadgroups per grid. buffers[i] is bound to [[buffer(i)]] and written back in place.
        guard="end" puts every buffer's end against a guard page, guard="start" its start.
        watchdog_s: the CPU seconds the launch may take before it is stopped with WatchdogError
        (default WATCHDOG_S; 0: no limit)."""
        if name not in self.kernels:
            raise MSLError(f"no kernel {name!r} in {os.path.basename(self.path)} (has {self.kernels})")
        fn = getattr(self.lib, "msl_launch__" + name)
        tg_threads = 1
        for v in tuple(tg):
            tg_threads *= int(v)
        limit = self.limits.get(name)
        if limit is not None and tg_threads > limit:  # Metal refuses the dispatch (the pipeline's maximum)
            raise MSLError(f"{name}: threadgroups of {tg_threads} threads exceed the kernel's "
                           f"max_total_threads_per_threadgroup({limit})")
        bufs = [_as_buffer(b) for b in buffers]
        n = max(1, len(bufs))
        ptrs = (ctypes.c_void_p * n)(*[b[0] for b in bufs])
        lens = (ctypes.c_uint64 * n)(*[b[1] for b in bufs])
        tgl = (ctypes.c_uint64 * max(1, len(tg_mem)))(*tg_mem)
        err = ctypes.create_string_buffer(4096)
        pad = lambda v: (tuple(int(x) for x in v) + (1, 1, 1))[:3]  # noqa: E731
        d = LaunchDesc((ctypes.c_uint32 * 3)(*pad(grid)), (ctypes.c_uint32 * 3)(*pad(tg)), int(threads),
                       ptrs, lens, len(bufs), tgl, len(tg_mem), workers, SCHEDULES.index(sched), seed & 0xFFFFFFFF,
                       int(strict), stack_kb, {"end": 0, "start": 1}[guard], ctypes.cast(err, ctypes.c_void_p),
                       len(err), (SIMD_SEED if simd_seed is None else simd_seed) & 0xFFFFFFFF,
                       int(device_visibility), float(WATCHDOG_S if watchdog_s is None else watchdog_s))
        if fn(ctypes.byref(d)):
            msg = self._symbolize(err.value.decode(errors="replace"))
            if msg.startswith("watchdog:"):
                raise WatchdogError(f"kernel {name}: {msg}")
            raise MSLError(msg)

    def _symbolize(self, msg: str) -> str:
        """Replace [pc=+0x...] with the kernel source line (addr2line), when available."""
        m = re.search(r"\[pc=\+0x([0-9a-f]+)\]", msg)
        tool = shutil.which("addr2line")
        if m is None or tool is None:
            return msg
        r = subprocess.run([tool, "-e", self.path, "-i", hex(int(m.group(1), 16))], capture_output=True, text=True)
        where = [ln for ln in r.stdout.split() if ln and not ln.startswith("??")]
        kernel_lines = [w for w in where if w.split(":")[0].endswith((".metal", ".h"))]
        kernel_lines.sort(key=lambda w: os.path.dirname(w.split(":")[0]) == SHIM)  # the kernel's own line first
        if where:
            msg = msg.replace(m.group(0), "at " + (kernel_lines or where)[0])
        return msg


def build(path: str, cxx: str = "g++", opt: str = "-O1", defines: dict[str, str] | None = None,
          extra: tuple[str, ...] = ()) -> Module:
    """Translate and compile a .metal file (cached); returns the loaded Module."""
    scan_cxx = cxx if cxx in ("g++", "gcc") else "g++"
    text, names = translate(path, defines, scan_cxx)
    cmd = [cxx, *CXXFLAGS, opt, "-g", "-fPIC", "-shared", *extra]
    so = _compile_cached(text, os.path.basename(path), cmd, os.path.basename(cxx))
    inlined = embed_metal.inline_source(path, (KERNEL_DIR,), line_names="abspath")
    return Module(so, names, kernel_limits(inlined, dict(DEFAULT_DEFINES if defines is None else defines), scan_cxx))


def check(path: str, cxx: str = "g++", defines: dict[str, str] | None = None) -> tuple[bool, str]:
    """Syntax/type check of a .metal file through the emulator shim (-fsyntax-only)."""
    text, _ = translate(path, defines)
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
        f.write(text)
    try:
        r = subprocess.run([cxx, *CXXFLAGS, "-fsyntax-only", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    return r.returncode == 0, r.stderr


# ---- strict clang check -----------------------------------------------------------------------------

def have_clang() -> bool:
    return shutil.which(CLANG) is not None


def check_clang(path: str, defines: dict[str, str] | None = None, extra: tuple[str, ...] = ()) -> tuple[bool, str]:
    """clang-only check: real address spaces (device/threadgroup/constant) and ext_vector_type
    vectors (shim/msl_check_clang.h); declarations only, nothing runs. Returns (ok, diagnostics)."""
    defines = dict(DEFAULT_DEFINES if defines is None else defines)
    src = embed_metal.inline_source(path, (KERNEL_DIR,), line_names="abspath")
    src = re.sub(r"#\s*include\s*<metal_\w+>", "", src)
    src = re.sub(r"\[\[\s*threadgroup\s*\(", "[[msl_threadgroup_arg(", src)
    # MSL threadgroup locals are not automatic variables: static gives them a place clang accepts.
    src = _TG_LOCAL.sub(lambda m: "static " + m.group(0), src)
    # Metal accepts attributes between `template` and an explicit instantiation; standard C++ does not.
    src = _HOST_NAME_ATTRS.sub(r"template\1", src)
    text = '#include "msl_check_clang.h"\n' + _prelude(defines) + src
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
        f.write(text)
    try:
        r = subprocess.run([CLANG, "-std=c++17", "-fsyntax-only", "-Wall", "-Wno-unknown-attributes",
                            "-Wno-unused-function", "-I", SHIM, *extra, f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    return r.returncode == 0 and "warning:" not in r.stderr, r.stderr

