"""Static checks on a candidate before it runs: its source text and its shared library's symbols.

Pure functions, no torch. A violation is a precise, human-readable line; an empty list passes.
They catch the cheats a runtime check sees only by luck (work on another stream or thread, calls
into a library that does the work, process control) and say so before any GPU time is spent.
They are a first line, not the only one: the harness also checks behaviour at run time.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from kopt import build

ALLOWED_INCLUDES, ALLOWED_INCLUDE_PREFIXES = build.ALLOWED_INCLUDES, build.ALLOWED_INCLUDE_PREFIXES

# (pattern on code without comments and strings, what it means)
FORBIDDEN: list[tuple[str, str]] = [
    (r"\bcudaStreamCreate\w*", "creates a CUDA stream (all work must go on the stream it is given)"),
    (r"\bcudaStreamPerThread\b|\bcudaStreamLegacy\b|\bcudaStreamDefault\b",
     "uses a stream other than the one it is given"),
    (r"\bcudaLaunchHostFunc\b|\bcudaStreamAddCallback\b", "runs host work from the stream (callbacks)"),
    (r"\bcudaStreamBeginCapture\w*|\bcudaGraph\w+", "builds or launches CUDA graphs of its own"),
    (r"\bcudaDeviceReset\b|\bcudaSetDevice\b|\bcudaDeviceSetLimit\b|\bcudaDeviceSetCacheConfig\b",
     "changes device-wide state"),
    (r"\bcudaMemcpy(?:2D|3D)?(?:ToSymbol|FromSymbol)?\s*\(|\bcudaMemset\s*\(",
     "synchronous copy on the legacy default stream (use the *Async form on the given stream)"),
    (r"\bcu[A-Z]\w*\s*\(", "calls the CUDA driver API directly"),
    (r"\bstd\s*::\s*(?:thread|jthread|async)\b", "creates a thread"),
    (r"\bpthread_create\b|\bthrd_create\b|#\s*pragma\s+omp\b|\bomp_\w+", "creates threads"),
    (r"(?<![.>])\b(?:fork|vfork|system|popen|posix_spawnp?|exec[lv]p?e?|execveat|clone|daemon)\s*\(",
     "starts a process"),
    (r"(?<![.>])\b(?:exit|_exit|_Exit|quick_exit|abort|raise|kill|signal|sigaction|setjmp|longjmp)\s*\(",
     "controls the process (exit, signals)"),
    (r"\b(?:dlopen|dlsym|dlmopen|dlvsym)\b", "loads code at run time"),
    (r"\bcublas\w*|\bcublasLt\w*|\bcudnn\w*|\bcufft\w*|\bcurand(?!_)\w*|\bcusparse\w*|\bcusolver\w*|\bnccl\w*",
     "calls a library that does the work"),
    (r"\b(?:torch|at|c10|caffe2|pybind11)\s*::", "calls torch (or Python)"),
    (r"\bPy[A-Z]\w*\s*\(|\b_Py\w+", "calls the Python C API"),
    (r"(?<![.>])\b(?:fopen|freopen|open|openat|creat|fdopen|dup2?|dup3|fcntl|ioctl|mmap|mprotect|ptrace|syscall|"
     r"setrlimit|prctl|socket|connect|chdir|unlink)\s*\(", "does file, memory-map or process I/O"),
    (r"(?<![\w.>:])(?:write|read|pwrite|pread|close)\s*\(\s*\d", "writes or reads a raw file descriptor"),
    (r"__attribute__\s*\(\(\s*(?:constructor|destructor)", "runs code at library load or unload"),
    # Machine code smuggled in as data: a byte array placed in .text (red team, 2026-11-23) made raw
    # system calls that no source pattern names. A kernel has no reason to choose its sections.
    (r"\bsection\s*\(|__declspec\s*\(\s*allocate|\bgnu\s*::\s*section\b",
     "places code or data in a section of its choice (machine code hidden in data)"),
    (r"%globaltimer|%clock\b|%clock64\b", "reads or patches device timers in inline assembly"),
    (r"\bclock_gettime\b|\bgettimeofday\b|\bstd\s*::\s*chrono\b|\bcudaEvent\w+",
     "reads clocks or events (timing is the harness's job)"),
]
LAUNCH = re.compile(r"<<<(.*?)>>>", re.S)


def strip_comments_and_strings(source: str) -> str:
    """Source with comments and string/char literals blanked (newlines kept, for line numbers)."""
    out, i, n = [], 0, len(source)
    while i < n:
        c = source[i]
        if source.startswith("//", i):
            j = source.find("\n", i)
            i = n if j < 0 else j
        elif source.startswith("/*", i):
            j = source.find("*/", i + 2)
            end = n if j < 0 else j + 2
            out.append("\n" * source.count("\n", i, end))
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and source[j] != c and source[j] != "\n":
                j += 2 if source[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _split_top_level(args: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in args:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur).strip())
    return parts


def check_source(source: str, target: str) -> list[str]:
    """Violations in a candidate's source, each `line N: what (the text)`; empty when clean."""
    violations = build.source_problems(source)  # includes and compile-time file reads
    code = strip_comments_and_strings(source)
    # The include lines were checked above; their names must not trip the identifier rules.
    code = re.sub(r"^[ \t]*#[ \t]*include[^\n]*", "", code, flags=re.M)
    for pattern, meaning in FORBIDDEN:
        for m in re.finditer(pattern, code):
            text = m.group(0).rstrip("( \t\n")
            violations.append(f"line {_line(code, m.start())}: {meaning} ({text})")
    if target == "cuda":
        for m in LAUNCH.finditer(code):
            cfg = _split_top_level(m.group(1))
            if len(cfg) < 4 or cfg[3] in ("0", "nullptr", "NULL", "(cudaStream_t)0", "cudaStreamLegacy"):
                violations.append(
                    f"line {_line(code, m.start())}: kernel launch <<<{m.group(1).strip()}>>> without the given "
                    "stream (runs on the default stream, outside the harness's timing)"
                )
    for m in re.finditer(r'"(/proc/|/dev/|/sys/)', source):
        violations.append(f"line {_line(source, m.start())}: names a system path ({m.group(1)})")
    return sorted(set(violations), key=lambda v: int(v.split(":")[0].split()[1]))


# ---------------------------------------------------------------- shared library symbols

# Undefined symbols a g++ kernel may import: libc memory/string basics, libm, the C++ runtime.
CPU_ALLOWED_SYMBOLS = {
    "memcpy", "memmove", "memset", "memcmp", "memchr", "strlen", "strcmp", "strncmp", "malloc", "free", "calloc",
    "realloc", "posix_memalign", "aligned_alloc", "__stack_chk_fail", "__assert_fail", "__cxa_finalize",
    "__cxa_atexit", "__cxa_thread_atexit_impl", "__gmon_start__", "_ITM_deregisterTMCloneTable",
    "_ITM_registerTMCloneTable", "__gxx_personality_v0", "_Unwind_Resume", "__cxa_begin_catch",
    "__cxa_end_catch", "__cxa_rethrow", "__cxa_allocate_exception", "__cxa_free_exception", "__cxa_throw",
    "__cxa_guard_acquire", "__cxa_guard_release", "__cxa_guard_abort", "__cxa_pure_virtual",
    "__memcpy_chk", "__memset_chk", "__memmove_chk", "printf", "puts", "putchar", "fprintf", "fputs",
    "fwrite", "fflush", "stderr", "stdout", "__printf_chk", "__fprintf_chk", "snprintf", "__snprintf_chk",
    "__errno_location", "__tls_get_addr",
}  # fmt: skip
LIBM = re.compile(
    r"^(?:__)?(?:exp|exp2|expm1|log|log2|log10|log1p|pow|sqrt|cbrt|hypot|sin|cos|tan|asin|acos|atan|atan2|"
    r"sinh|cosh|tanh|asinh|acosh|atanh|erf|erfc|lgamma|tgamma|fma|fmax|fmin|fmod|remainder|floor|ceil|round|"
    r"lround|llround|trunc|rint|lrint|llrint|nearbyint|frexp|ldexp|scalbn|modf|copysign|nextafter|sincos|"
    r"fabs|isnan|isinf|finite)[fl]?(?:_finite)?(?:@.*)?$"
)
# libgcc's soft-float helpers (_Float16 conversions, long double arithmetic) and the like.
LIBGCC = re.compile(r"^__(?:extend|trunc|fix|fixuns|float|floatun|mul|div|add|sub|neg|cmp|eq|ne|lt|le|gt|ge|unord|powi)"
                    r"[a-z]+\d?$")
CXX_RUNTIME = re.compile(r"^_Z(?:n[wa]m|d[la]Pv|St\d+__throw_|NSt|St9terminate|SaIc|NKSt|TISt|TVN10__cxxabiv)")
# Imports no kernel needs. On CUDA this deny-list is all that can be checked: the static CUDA
# runtime linked into every nvcc library imports dlopen, pthreads, sockets and kill itself.
DENIED_SYMBOLS = re.compile(
    r"^(?:fork|vfork|system|popen|posix_spawnp?|exec[lv]p?e?|execveat|ptrace|"
    r"cublas\w*|cublasLt\w*|cudnn\w*|cufft\w*|curand\w*|cusparse\w*|cusolver\w*|nccl\w*|Py\w+|_Py\w+|"
    r"_ZN2at\w*|_ZN3c10\w*|_ZN5torch\w*|_ZNSt6thread\w*|omp_\w+|GOMP_\w+|__kmpc_\w+)$"
)
CPU_DENIED_SYMBOLS = re.compile(r"^(?:pthread_create|dlopen|dlsym|dlmopen|kill|socket|connect|syscall|write|open)$")
ALLOWED_NEEDED = re.compile(
    r"^(?:libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|ld-linux[\w.-]*|libcudart|libcuda)\.so[\d.]*$"
)


def _nm_undefined(library: Path) -> list[str] | None:
    nm = shutil.which("nm")
    if nm is None:
        return None
    proc = subprocess.run([nm, "-D", "--undefined-only", str(library)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return None
    return [ln.split()[-1] for ln in proc.stdout.splitlines() if ln.strip()]


def _needed(library: Path) -> list[str] | None:
    readelf = shutil.which("readelf")
    if readelf is None:
        return None
    proc = subprocess.run([readelf, "-d", str(library)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return None
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", proc.stdout)


def check_library(library: Path, target: str) -> tuple[list[str], list[str]]:
    """(violations, notes) for a compiled candidate: linked libraries and undefined symbols."""
    violations, notes = [], []
    needed = _needed(library)
    if needed is None:
        notes.append("readelf not found: linked libraries not checked")
    else:
        violations += [f"links {lib} (not on the allow-list of libraries)" for lib in needed
                       if not ALLOWED_NEEDED.match(lib)]  # fmt: skip
    symbols = _nm_undefined(library)
    if symbols is None:
        notes.append("nm not found: imported symbols not checked")
        return violations, notes
    for sym in symbols:
        base = sym.split("@")[0]
        if DENIED_SYMBOLS.match(base) or (target == "cpu" and CPU_DENIED_SYMBOLS.match(base)):
            violations.append(f"imports {sym} (process control, threads, I/O or a library that does the work)")
        elif target == "cpu" and not (
            base in CPU_ALLOWED_SYMBOLS or LIBM.match(base) or LIBGCC.match(base) or CXX_RUNTIME.match(base)
        ):
            violations.append(f"imports {sym} (not on the CPU allow-list: libc memory/string, libm, C++ runtime)")
    return violations, notes
