"""Compile a candidate's source into a shared library with g++ (cpu) or nvcc (cuda).

Direct compiler calls, no torch: a CUDA candidate builds in a few seconds on a machine without
a GPU. A compile error is data (CompileResult.ok = False), never an exception.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import kernels
from containment import jail
from containment.procs import kill_group
from kopt.flags import check_flags, flag_summary
from kopt.models import Target
from kopt.redact import redact

KERNELS_INCLUDE = Path(kernels.__file__).resolve().parent  # kopt_abi.h ships inside the package
CUDA_ARCH = ["-gencode=arch=compute_90a,code=sm_90a"]  # H100/H200; no PTX embedded


KOPT_INCLUDES = {"kopt_abi.h", "kopt_cpu_half.h", "kopt_cuda.h"}
CUDA_INCLUDES = {  # device-side headers
    "cuda_runtime.h", "cuda_runtime_api.h", "cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h", "cuda_fp4.h",
    "cuda_fp6.h", "vector_types.h", "vector_functions.h", "device_launch_parameters.h", "math_constants.h",
    "cooperative_groups.h", "mma.h", "cuda_pipeline.h", "cuda_pipeline_primitives.h", "cuda_awbarrier.h",
    "cuda_awbarrier_primitives.h", "sm_90_rt.h", "crt/host_defines.h",
}  # fmt: skip
STD_INCLUDES = {  # C and C++ standard headers that do no process, thread or file work
    "cstdint", "cmath", "climits", "cstddef", "cstring", "cfloat", "cassert", "cstdlib", "cstdio",
    "type_traits", "algorithm", "array", "limits", "utility", "numeric", "initializer_list", "tuple",
    "bit", "new", "math.h", "stdint.h", "string.h", "stddef.h", "limits.h", "float.h", "assert.h",
    "stdlib.h", "stdio.h", "stdbool.h", "inttypes.h", "cinttypes",
}  # fmt: skip
SIMD_INCLUDES = {  # CPU SIMD intrinsics
    "immintrin.h", "x86intrin.h", "emmintrin.h", "xmmintrin.h", "pmmintrin.h", "smmintrin.h", "tmmintrin.h",
    "nmmintrin.h", "arm_neon.h", "arm_sve.h",
}  # fmt: skip
ALLOWED_INCLUDES = KOPT_INCLUDES | CUDA_INCLUDES | STD_INCLUDES | SIMD_INCLUDES
ALLOWED_INCLUDE_PREFIXES = ("cooperative_groups/", "cub/", "cuda/std/", "cuda/barrier", "cuda/pipeline",
                            "cuda/annotated_ptr", "cuda/ptx", "cute/", "cutlass/numeric", "cutlass/array")
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include(?:_next)?\b[ \t]*(.*)$', re.M)
# Ways to make the compiler or assembler read a file of the source's choosing (checked on the raw
# text: asm strings and pragmas included), or to name a path at all.
FILE_READS = [
    (re.compile(r"\.incbin\b|\.include\b|\.file\s+\d|\.loc_file"), "makes the assembler read a file (.incbin, .include)"),
    (re.compile(r"#[ \t]*embed\b|__has_embed|__has_include"), "asks the preprocessor about or for a file (#embed, __has_include)"),
    (re.compile(r"#[ \t]*import\b|#[ \t]*pragma[ \t]+(?:GCC[ \t]+)?(?:dependency|include_alias|poison_file)"),
     "makes the preprocessor read a file (#import, #pragma dependency)"),
    (re.compile(r"\b_Pragma\s*\("), "_Pragma (a pragma built from a string)"),
    # red team, 2026-11-23: a gas macro spells the directive from its argument (".\\a" with a = include)
    (re.compile(r"\.(?:macro|irpc?|rept|altmacro|purgem)\b"), "defines assembler macros (which can spell .include)"),
]  # fmt: skip


ASM = re.compile(r"\b(?:asm|__asm__|__asm)\b(?:\s|volatile\b|__volatile__\b|goto\b|inline\b)*\(")
STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')


def _normalized(source: str) -> str:
    """The text the preprocessor sees for our purposes: line splices joined, the trigraph and the
    digraph for '#' spelled as '#', comments removed (string literals kept)."""
    text = source.replace("\\\r\n", "").replace("\\\n", "").replace("??=", "#").replace("%:", "#")
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            out.append(" ")
            i = n if j < 0 else j + 2
        elif text[i] in "\"'":
            j = i + 1
            while j < n and text[j] != text[i] and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def asm_problems(text: str) -> list[str]:
    """Inline assembly whose template is not plain string literals, or that names an assembler
    directive reading a file (.include, .incbin), once adjacent literals are joined."""
    problems = []
    for m in ASM.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        depth, j = 1, m.end()
        while j < len(text) and depth and not (depth == 1 and text[j] == ":"):
            if text[j] == '"':
                lit = STRING.match(text, j)
                j = lit.end() if lit else j + 1
                continue
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            j += 1
        template = text[m.end() : j - 1 if depth == 0 else j]  # up to the closing ")" or the first ":"
        literals = STRING.findall(template)
        if STRING.sub("", template).strip():
            problems.append(f"line {line}: an asm template that is not plain string literals (a macro?)")
        joined = "".join(lit[1:-1] for lit in literals).lower()
        if ".inc" in joined:
            problems.append(f"line {line}: inline assembly that makes the assembler read a file (.include, .incbin)")
    return problems


def include_problems(source: str) -> list[str]:
    """Includes off the allow-list, or not a plain <name>/"name" (a macro, a path), line by line."""
    problems = []
    for m in INCLUDE.finditer(source):
        line = source.count("\n", 0, m.start()) + 1
        target = re.match(r'([<"])([^>"]+)[>"]\s*(?://.*|/\*.*)?$', m.group(1).strip())
        if target is None:
            problems.append(f"line {line}: #include of something other than a plain <name> or \"name\" (a macro?)")
            continue
        name = target.group(2).strip()
        if name not in ALLOWED_INCLUDES and not name.startswith(ALLOWED_INCLUDE_PREFIXES):
            shown = f"<{name}>" if target.group(1) == "<" else f'"{name}"'
            problems.append(f"line {line}: includes {shown} (not on the allow-list)")
    return problems


def source_problems(source: str) -> list[str]:
    """What must not reach the compiler at all: includes off the allow-list and file reads through
    the preprocessor or the assembler. Checked before any compiler runs."""
    text = _normalized(source)  # line numbers count spliced lines as one
    problems = include_problems(text) + asm_problems(text)
    for pattern, what in FILE_READS:
        for m in pattern.finditer(text):
            problems.append(f"line {text.count(chr(10), 0, m.start()) + 1}: {what}")
    return problems


@dataclass(frozen=True)
class Toolchain:
    name: str  # e.g. "cpu" or "cuda13-sm90a"; the build queue is kopt-build-<name>
    target: Target
    compiler: str
    version: str


def toolchain_facts(tc: Toolchain) -> list[str]:
    """What a candidate's author needs to know of the toolchain that builds it, one fact a line: the
    compiler and version, the fixed part of every build command, the allowed headers and compiler
    options, and the shared headers' declarations (the agents' prompts show them)."""
    fixed = compile_command(tc, Path("kernel"), Path("kernel.so"), [])
    fixed = [Path(fixed[0]).name] + [a for a in fixed[1:] if not a.startswith("-I") and a not in ("-o", "kernel",
                                                                                                   "kernel.so")]
    headers = KOPT_INCLUDES | STD_INCLUDES | (CUDA_INCLUDES if tc.target == "cuda" else SIMD_INCLUDES)
    headers -= {"kopt_cuda.h"} if tc.target == "cpu" else {"kopt_cpu_half.h"}
    prefixes = ", ".join(f"<{p}...>" for p in ALLOWED_INCLUDE_PREFIXES) if tc.target == "cuda" else ""
    facts = [f"compiler: {tc.version}", f"every build: {' '.join(fixed)} (C++17; the flags a candidate asks for "
             "come after these)",
             "allowed headers (any other #include is refused before compiling): "
             + " ".join(f"<{h}>" for h in sorted(headers)) + (f"; and under {prefixes}" if prefixes else ""),
             f"allowed compiler options: {flag_summary(tc.target)}"]  # fmt: skip
    for name in sorted((KOPT_INCLUDES - {"kopt_abi.h"}) & headers):  # the toolkit; the ABI is the entry's
        facts.append(f"{name} declares: {'; '.join(header_declarations((KERNELS_INCLUDE / name).read_text()))}")
    return facts


def header_declarations(text: str) -> list[str]:
    """The top-level declarations of a C/C++ header with the comments above them, bodies left out
    (`int f(int x)`; a one-line struct whole): what a caller needs of kopt's shared headers."""
    out, depth, pending = [], 0, ""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    for raw in text.splitlines():
        line, _, comment = raw.partition("//")
        line = line.rstrip()
        if depth == 0 and not line.strip() and comment.strip() and not raw.lstrip().startswith("#"):
            joined = out and out[-1].startswith("(") and out[-1].endswith(")") and pending == "comment"
            out[-1:] = [f"{out[-1][:-1]} {comment.strip()})"] if joined else [*out[-1:], f"({comment.strip()})"]
            pending = "comment"
            continue
        if pending == "comment":
            pending = ""
        if depth == 0 and not line.startswith("#") and line.strip():
            pending = f"{pending} {line.strip()}".strip()
            if "{" in line or line.endswith(";"):
                whole = pending.startswith("struct") and pending.count("{") == pending.count("}") > 0
                head = pending.rstrip(" ;") if whole else pending.split("{")[0].rstrip(" ;")
                if head and not head.startswith(("}", "asm")):
                    out.append(re.sub(r"\s+", " ", head.replace("[[maybe_unused]] ", "")))
                pending = ""
        depth += line.count("{") - line.count("}")
    return out


def find_nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


def find_cuda_tool(name: str) -> str | None:
    """A CUDA toolkit tool (compute-sanitizer, ncu): on PATH, in /usr/local/cuda/bin, or beside nvcc."""
    nvcc = find_nvcc()
    candidates = [shutil.which(name), f"/usr/local/cuda/bin/{name}"]
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent / name))
    return next((c for c in candidates if c and Path(c).is_file()), None)


def detect_toolchain(target: Target) -> Toolchain | None:
    """The local toolchain for a target, or None when its compiler is missing."""
    if target == "cpu":
        cxx = shutil.which(os.environ.get("CXX", "g++"))
        if not cxx:
            return None
        version = _first_line([cxx, "--version"])
        return Toolchain(name="cpu", target="cpu", compiler=cxx, version=version)
    nvcc = find_nvcc()
    if not nvcc:
        return None
    version = _first_line([nvcc, "--version"], pick=r"release (\d+)\.(\d+)")
    major = re.search(r"release (\d+)", version)
    return Toolchain(name=f"cuda{major.group(1) if major else 'x'}-sm90a", target="cuda", compiler=nvcc, version=version)


def compile_command(tc: Toolchain, source: Path, output: Path, flags: list[str]) -> list[str]:
    if tc.target == "cpu":
        return [tc.compiler, "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", *flags,
                f"-I{KERNELS_INCLUDE}", "-o", str(output), str(source)]
    return [tc.compiler, "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden", *CUDA_ARCH,
            "-Xptxas", "-v", *flags, f"-I{KERNELS_INCLUDE}", "-o", str(output), str(source)]


@dataclass
class BuildOutput:
    ok: bool
    seconds: float
    log: str
    command: list[str]
    resource_usage: str


COMPILER_MEMORY_MB = 8192  # address space of each compiler process (cicc, ptxas, cc1plus)
COMPILER_PROCESSES = 256
LOG_LIMIT = 256 << 10  # bytes of compiler output kept (a file echoed into the log stops here)


def compiler_jail(tc: Toolchain, workdir: Path) -> jail.JailSpec:
    """The compiler's sandbox: its install root and kopt's headers read-only, the build directory
    the only writable place, no network, a memory cap, an environment of its own."""
    root = Path(tc.compiler).resolve().parent.parent
    tmp = workdir / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {"PATH": f"{Path(tc.compiler).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir),
           "TMPDIR": str(tmp), "LANG": "C.UTF-8"}  # fmt: skip
    return jail.JailSpec(scratch=str(workdir), read_only=(str(KERNELS_INCLUDE), str(root)), env=env,
                         address_space_mb=COMPILER_MEMORY_MB, processes=COMPILER_PROCESSES, file_size_mb=512)  # fmt: skip


async def build(tc: Toolchain, source_text: str, workdir: Path, flags: list[str], timeout_s: float = 300,
                shown_as: str | None = None) -> BuildOutput:  # fmt: skip
    """Write the source into workdir and compile it to workdir/kernel.so, in the compiler's jail.
    Flags off the allow-list and sources that would read files at compile time never reach it. The log
    names the source `shown_as` (the user's file; by default its bare name), not the build directory's
    copy a person cannot open."""
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / ("kernel.cu" if tc.target == "cuda" else "kernel.cpp")
    out = workdir / "kernel.so"
    cmd = compile_command(tc, src, out, flags)
    remarks = workdir / "vectorizer-remarks.txt"
    if tc.target == "cpu" and "clang" not in tc.version.lower():  # GCC's loop-by-loop vectorizer report
        cmd = [*cmd[:-1], f"-fopt-info-vec-all={remarks}", cmd[-1]]
    refused = check_flags(flags, tc.target) + source_problems(source_text)
    if refused:
        log = "refused before compiling: " + "\n".join(refused)  # the first reason on the line reports quote
        return BuildOutput(ok=False, seconds=0.0, log=redact(log), command=cmd, resource_usage="")
    src.write_text(source_text)
    spec = compiler_jail(tc, workdir)
    argv, env = (cmd, spec.env) if jail.disabled() else (jail.command(spec, cmd, "tool"), jail.launcher_env())
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=workdir, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        stdout, _ = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
        log = stdout[-LOG_LIMIT:].decode(errors="replace")
        if proc.returncode == jail.SETUP_FAILED and "kopt-jail:" in log:
            log = f"sandbox unavailable, compiler not run: {log.strip()}"
        ok = proc.returncode == 0 and out.is_file()
    except asyncio.TimeoutError:
        kill_group(proc.pid)
        await proc.wait()
        log, ok = f"compiler timed out after {timeout_s:.0f} s", False
    except asyncio.CancelledError:
        kill_group(proc.pid)
        raise
    seconds = time.monotonic() - start
    log = redact(log.replace(str(src), shown_as or src.name))
    if tc.target == "cuda":
        usage = "\n".join(line for line in log.splitlines() if "ptxas info" in line)
    else:
        usage = vectorizer_summary(remarks.read_text(errors="replace") if remarks.is_file() else "", src.name)
        mix = instruction_mix(out) if ok else ""
        usage = "\n".join(part for part in (usage, mix) if part)
    return BuildOutput(ok=ok, seconds=seconds, log=log, command=cmd, resource_usage=usage)


SKIPPED_FUNCTIONS = ("_init", "_fini", "frame_dummy", "register_tm_clones", "deregister_tm_clones",
                     "__do_global_dtors_aux")  # the toolchain's own code in every library  # fmt: skip
MIX = (("512-bit vector", re.compile(r"%zmm")), ("256-bit vector", re.compile(r"%ymm")),
       ("FMA", re.compile(r"^v?fn?m(add|sub)")), ("fp16 conversions", re.compile(r"^vcvt(ph2ps|ps2ph)")),
       ("scalar float", re.compile(r"^v?\w+s[sd]\b")), ("packed float", re.compile(r"^v?\w+p[sd]\b")))  # fmt: skip


def disassemble(binary: Path, timeout_s: float) -> str | None:
    """objdump -d of a library or archive (demangled, one instruction a line, no raw bytes): a linear
    sweep of every executable section. None where objdump is missing or fails; TimeoutExpired passes
    through (a caller that judges may not take a binary it could not read for a clean one)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        return None
    try:
        proc = subprocess.run([objdump, "-d", "-C", "-w", "--no-show-raw-insn", str(binary)], capture_output=True,
                              text=True, errors="replace", timeout=timeout_s)  # fmt: skip
    except OSError:
        return None
    return proc.stdout if proc.returncode == 0 else None


def instruction_mix(library: Path) -> str:
    """One line on the library's own machine code (objdump -d): how many instructions, how many use
    512/256-bit registers, FMA, fp16 conversions, scalar and packed float, and the calls it makes out
    (libm's expf, say). Empty where objdump is missing or fails (x86-64 spellings; elsewhere the
    counts are of what matches)."""
    if not Path(library).is_file():
        return ""
    try:
        listing = disassemble(library, timeout_s=60)
    except subprocess.TimeoutExpired:
        return ""
    if listing is None:
        return ""
    counts = {name: 0 for name, _ in MIX}
    calls: dict[str, int] = {}
    total, own = 0, False
    for line in listing.splitlines():
        if head := re.match(r"^[0-9a-f]+ <(.+)>:$", line):
            name = head.group(1)
            own = "@plt" not in name and name not in SKIPPED_FUNCTIONS
        elif own and (ins := re.match(r"^\s+[0-9a-f]+:\s+(\S.*)$", line)):
            text = ins.group(1)
            total += 1
            for name, rx in MIX:
                counts[name] += bool(rx.search(text))
            if called := re.match(r"^(?:call|jmp)\w*\s+\S+\s+<([^>+]+)@plt>", text):
                calls[called.group(1)] = calls.get(called.group(1), 0) + 1
    if not total:
        return ""
    parts = ", ".join(f"{name} {n}" for name, n in counts.items())
    out = ", ".join(f"{f} x{n}" for f, n in sorted(calls.items(), key=lambda kv: -kv[1]))
    return f"instruction mix of the library's own code: {total} instructions; {parts}; calls out: {out or 'none'}"


REMARK = re.compile(r"^(?P<file>[^:\s]+):(?P<line>\d+):\d+: (?P<kind>optimized|missed): (?P<text>.+)$")
MAX_REMARKS = 24


def vectorizer_summary(remarks: str, source_name: str) -> str:
    """GCC's vectorizer remarks (-fopt-info-vec-all) as one line per loop: vectorized (and how), or
    left scalar with the first reasons GCC gave (they follow its "couldn't vectorize loop" line, at the
    statement that stopped it). Headers by their base name; at most MAX_REMARKS lines."""
    done: dict[tuple[str, int], str] = {}
    why: dict[tuple[str, int], list[str]] = {}
    current = None
    for raw in remarks.splitlines():
        m = REMARK.match(raw.strip())
        if m is None:
            continue
        where, text = (Path(m["file"]).name, int(m["line"])), m["text"].strip().rstrip(".;")
        if m["kind"] == "optimized" and "vectorized" in text:
            done.setdefault(where, text)
            current = where
        elif text == "couldn't vectorize loop":
            why.setdefault(where, [])
            current = where
        elif current is not None and len(why.get(current, [])) < 2:
            reason = text.removeprefix("not vectorized: ")
            if reason not in why.setdefault(current, []):
                why[current].append(reason)
    lines = []
    for where in sorted({*done, *why}, key=lambda w: (w[0] != source_name, w)):
        head = f"{where[0]}:{where[1]}: "
        lines.append(head + done[where] if where in done else
                     head + "loop not vectorized" + (f": {'; '.join(why[where])}" if why[where] else ""))
    shown = lines[:MAX_REMARKS]
    if len(lines) > len(shown):
        shown.append(f"... {len(lines) - len(shown)} more loops")
    return "\n".join(shown)


def _first_line(cmd: list[str], pick: str | None = None) -> str:
    try:
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if pick:
        for line in text.splitlines():
            if re.search(pick, line):
                return line.strip()
    return text.splitlines()[0].strip() if text else "unknown"
