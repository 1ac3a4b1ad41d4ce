"""Static checks on a candidate before it runs: its source text and its shared library.

Pure functions, no torch. A violation is a precise, human-readable line; an empty list passes.
They catch the cheats a runtime check sees only by luck (work on another stream or thread, calls
into a library that does the work, process control) and say so before any GPU time is spent.
They are a first line, not the only one: the harness also checks behaviour at run time.

Some things only a cheat needs: a kernel computes its outputs from its inputs, so it has no use for
the process environment, its pid, the machine's name, the terminal, its resource limits, the clock,
the cycle counter, its caller's stack, the loader's state, the thread control block (glibc caches the
thread id there: %fs:0x2d0 is the pid, no call needed), which SM runs it, or system calls of its own.
Code that reads them can tell the harness from production and behave differently in each; such a
candidate is refused with the reason, before it runs (issue #25, item 7).

Three scans, because each alone can be dodged:
- the source with comments and strings blanked: identifiers (getenv, getpid, __rdtsc, ...);
- the string literals of the source, escapes decoded and adjacent literals joined (what an asm
  statement hands the assembler): instructions (syscall, sysenter, int $0x80, rdtsc, cpuid, rdfsbase),
  PTX special registers (%smid, %globaltimer, ...), and in asm templates the data directives (.byte,
  .word, .inst, ...) that emit machine code no instruction scan of the source can read, and the segment
  registers (%fs:, %gs:, fs:[...]); a thread_local variable is not refused: the compiler reaches it
  through %fs, the source does not;
- the library's machine code (objdump -d): system-call, cycle-counter and rd/wr{fs,gs}base instructions
  (not %fs accesses: the stack protector and thread_local variables make those in honest code). The
  preprocessor can spell anything (token pasting, stringification), so the text scans are not
  final; an instruction in the library is. On CPU, g++ links libc dynamically, so a candidate's
  library holds no system-call instruction at all (the three package baselines hold none). cpuid
  is not looked for here: libgcc's __builtin_cpu_supports support, linked into honest libraries,
  executes it. On CUDA, nvcc links the static CUDA runtime into the library; its own functions may
  hold such instructions (CUDA 13's holds none of these, one cpuid), so the instructions found in
  the libcudart_static.a that nvcc links are allowed where the library has them in a function of
  the same name (the runtime's are named libcudart_static_<hash>); anything else is the candidate's.
  Without that archive the CUDA machine code is not scanned (a note says so).
The machine-code scan also refuses a branch, or a rip-relative address, that lands inside a function
but not on an instruction start: compiled code never does that, and a jump one byte into
`movl $0x90c3050f, %ecx` runs 0f 05 c3, a syscall and a return (red team, 2026-11-26). On CPU, inline
assembly is refused outright (empty templates, compiler barriers, excepted): intrinsics name every
SIMD instruction. What no scan sees: a jump whose target is computed at run time (an address plus
an offset in a register), or into libc's own syscall() from an allowed import's address
(tests/hostile/libc_syscall.cpp); the sandbox holds there.
"""

from __future__ import annotations

import bisect
import functools
import re
import shutil
import subprocess
from pathlib import Path

from containment import build

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
    (r"\bclock_gettime\b|\bgettimeofday\b|\bstd\s*::\s*chrono\b|\bcudaEvent\w+",
     "reads clocks or events (timing is the harness's job)"),
]

# What only code that tells the harness from production needs (issue #25, item 7). Each: (names, what it
# means). The names are matched as identifiers in the code (not after `.` or `->`: a member of that name is
# something else), as words in asm templates (`call getpid@PLT`, an asm label that renames a declaration) and,
# on CPU, as imported symbols. `{}` in the meaning is the name found.
WHY = "a kernel has no use for it; only code that tells the harness from production does"
SANDBOX = "a kernel has no use for them; only code that escapes its sandbox or tells the harness from production does"
RANDOM = "a kernel's result must not depend on a draw (one wrong call in many passes every check)"
PROBES: list[tuple[str, str]] = [
    (r"getenv|secure_getenv|__secure_getenv|environ|__environ|_environ",
     f"reads the process environment ({{}}): {WHY}"),
    (r"getpid|getppid|gettid|getuid|geteuid|getgid|getegid|getresuid|getresgid|getpgrp|getpgid|getsid|"
     r"getlogin|getlogin_r|program_invocation_name|program_invocation_short_name|__progname|__progname_full",
     f"asks which process it is ({{}}): {WHY}"),
    (r"sched_getcpu|sched_getaffinity|pthread_getaffinity_np|uname|gethostname|getdomainname|sysconf|"
     r"get_nprocs|get_nprocs_conf|get_phys_pages|get_avphys_pages|sysinfo|getloadavg",
     f"asks which machine or CPU it runs on ({{}}): {WHY}"),
    (r"isatty|ttyname|ttyname_r|ctermid", f"asks whether it has a terminal ({{}}): {WHY}"),
    (r"getrlimit|getrlimit64|prlimit|prlimit64|getrusage", f"reads its resource limits or usage ({{}}): {WHY}"),
    (r"__rdtsc|__rdtscp|_rdtsc|__builtin_ia32_rdtscp?|__builtin_readcyclecounter|__builtin_readsteadycounter|"
     r"_rdpid_u32|__builtin_ia32_rdpid|__rdpmc|__builtin_ia32_rdpmc",
     f"reads the CPU's cycle counter ({{}}): {WHY} (timing is the harness's job)"),
    # A random draw of its own makes a kernel wrong on a call in many (one in 65536: red team, 2026-11-27), which
    # no number of checked calls reaches.
    (r"_rdrand(?:16|32|64)_step|_rdseed(?:16|32|64)_step|__builtin_ia32_rdrand\w*|__builtin_ia32_rdseed\w*",
     f"draws random numbers from the CPU ({{}}): {RANDOM}"),
    # The thread pointer (%fs on x86-64) leads to glibc's thread control block, which caches the thread
    # id at a fixed offset: the pid without a call (red team, 2026-11-25: `movl %fs:0x2d0`). A C++
    # thread_local variable is not this: the compiler reaches it through %fs, the source never says so.
    (r"__builtin_thread_pointer|__builtin_set_thread_pointer|__seg_fs|__seg_gs|_(?:read|write)[fg]sbase_u(?:32|64)|"
     r"__builtin_ia32_(?:rd|wr)[fg]sbase(?:32|64)|arch_prctl|pthread_self|thrd_current|pthread_getattr_np",
     f"reads the thread control block directly ({{}}): {WHY}"),
    (r"__builtin_return_address|__builtin_frame_address|__builtin_extract_return_addr|_Unwind_Backtrace|"
     r"_Unwind_GetIP|_Unwind_GetIPInfo|_Unwind_GetCFA|backtrace|backtrace_symbols|backtrace_symbols_fd",
     f"walks the stack into its caller ({{}}): {WHY}"),
    (r"dl_iterate_phdr|dladdr|dladdr1|dlinfo|getauxval|_r_debug|_dl_\w+|__libc_\w+",
     f"reads the loader's or libc's own state ({{}}): {WHY}"),
    # CUDA device code: which SM or grid it runs on (libcu++'s cuda::ptx and clang's builtins spell %smid too)
    (r"get_sreg_(?:smid|nsmid|gridid|envreg\d+|clock\w*|globaltimer\w*)|"
     r"__nvvm_read_ptx_sreg_(?:smid|nsmid|gridid|envreg\d+|clock\w*|globaltimer\w*)",
     f"reads which SM or grid runs it, or a device clock ({{}}): {WHY}"),
]
# Common words: only a call counts (`float clock = ...` is a variable; clock64 is CUDA's device clock).
CLOCK_CALLS = (r"clock|clock64|time|times|timespec_get|ftime",
               f"reads a clock ({{}}): {WHY} (timing is the harness's job)")
PROBE_CODE = [(re.compile(rf"(?<![\w.>$])(?:{names})\b"), meaning) for names, meaning in PROBES] + [
    (re.compile(rf"(?<![\w.>$])(?:{CLOCK_CALLS[0]})(?=\s*\()"), CLOCK_CALLS[1])]
PROBE_WORDS = [(re.compile(rf"(?<![\w.$%])(?:{names})(?![\w$])"), meaning)
               for names, meaning in [*PROBES, CLOCK_CALLS]]  # fmt: skip

# Instructions and PTX registers a kernel has no use for, looked for in every string literal (an asm
# statement's template is one; its `asm` keyword may come from a macro) once escapes are decoded and
# adjacent literals joined. Lower case: the assembler does not care.
STRING_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"(?<![\w.%$])(?:syscall|sysenter)\b|(?<![\w.%$])int\s*\$?\s*(?:0x80|128)\b"),
     f"makes system calls itself ({{}}): {SANDBOX}"),
    (re.compile(r"(?<![\w.%$])(?:rdtscp?|rdpid|rdpmc)\b"), f"reads the CPU's cycle counter ({{}}): {WHY}"),
    (re.compile(r"(?<![\w.%$])(?:rd|wr)[fg]sbase[lq]?\b"), f"reads the thread control block directly ({{}}): {WHY}"),
    (re.compile(r"(?<![\w.%$])cpuid\b"), f"asks the CPU who it is in inline assembly ({{}}): {WHY}"),
    (re.compile(r"(?<![\w.%$])(?:rdrand|rdseed)[wlq]?\b"), f"draws random numbers from the CPU ({{}}): {RANDOM}"),
    (re.compile(r"%(?:smid|nsmid|gridid|envreg\d+)\b"), f"reads which SM or grid runs it ({{}}): {WHY}"),
    (re.compile(r"%(?:globaltimer(?:_lo|_hi)?|clock|clock64|clock_hi)\b"),
     "reads or patches device timers in inline assembly ({}) (timing is the harness's job)"),
]
# Only in asm templates: a software interrupt of any number, an aarch64 system call, and the assembler
# directives that emit data, which in .text is machine code (`.byte 0x0f, 0x05` is a syscall) that no
# scan of the source can read. PTX has none of these words (its `.b8`, `.align 16 .b8` are not them).
ASM_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"(?<![\w.%$])(?:int|svc)\b[^;\n]*"),
     f"raises a software interrupt or makes a system call in inline assembly ({{}}): {SANDBOX}"),
    (re.compile(r"(?<![\w.$])\.(?:byte|[248]byte|short|hword|word|int|long|quad|octa|inst(?:\.[nw])?|insn|ascii|"
                r"asciz|string(?:8|16|32|64)?|fill|skip|space|dcb?(?:\.[a-z])?|ds(?:\.[a-z])?|float|single|double|"
                r"hfloat|bfloat16|[dfgt]float|sleb128|uleb128|base64|value)\b|"
                r"(?<![\w.$])\.(?:b|p2)?align[wl]?\s[^,;\n]*,\s*[^,\s;]|(?<![\w.$])\.org\b[^;\n]*,"),
     "emits raw bytes from inline assembly ({}): machine code that no scan of the source can read (a kernel "
     "writes its instructions by name)"),
    # A segment register: `%fs:0x2d0` (`%%fs` with operands), Intel's `fs:[0x2d0]` or the bare prefix
    # `fs movl 0x2d0, %eax` reads the thread control block, which caches the thread id; a kernel's own
    # assembly has no use for either register.
    (re.compile(r"(?<![\w.$%])%*[fg]s\b(?:\s*:\s*[^,;\n]*)?"),
     f"reads the thread control block directly ({{}}): {WHY}"),
]
LAUNCH = re.compile(r"<<<(.*?)>>>", re.S)


def strip_comments_and_strings(source: str, keep_strings: bool = False) -> str:
    """Source with comments and string/char literals blanked (newlines kept, for line numbers);
    with keep_strings, only the comments."""
    out, i, n = [], 0, len(source)
    while i < n:
        c = source[i]
        if source.startswith("//", i):
            j = source.find("\n", i)
            i = n if j < 0 else j
        elif source.startswith("/*", i):
            j = source.find("*/", i + 2)
            end = n if j < 0 else j + 2
            out.append(" " + "\n" * source.count("\n", i, end))
            i = end
        elif c in "\"'":
            j = i + 1
            while j < n and source[j] != c and source[j] != "\n":
                j += 2 if source[j] == "\\" else 1
            out.append(source[i : j + 1] if keep_strings else c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _with_strings(source: str) -> str:
    """What the compiler reads for our purposes: line splices joined, comments blanked, strings kept."""
    return strip_comments_and_strings(source.replace("\\\r\n", "").replace("\\\n", ""), keep_strings=True)


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


ESCAPE = re.compile(r"\\(?:x[0-9a-fA-F]+|[0-7]{1,3}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)", re.S)
SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "f": "\f", "v": "\v"}
RAW_PREFIX = re.compile(r"(?:u8|[uUL])?R$")
RAW_OPEN = re.compile(r'"([^()\\\s"]{0,16})\(')


def _decode(body: str) -> str:
    """A string literal's body as the compiler reads it: C escapes (\\n, \\x2e, \\056, ...) decoded."""

    def one(m: re.Match[str]) -> str:
        e = m.group(0)[1:]
        if e[0] in "xuU":
            return chr(int(e[1:], 16) % 0x110000)
        if e[0] in "01234567":
            return chr(int(e, 8))
        return SIMPLE_ESCAPES.get(e, e)

    return ESCAPE.sub(one, body)


def string_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string literal in the source, comments skipped, escapes decoded and adjacent
    literals joined ("sys" "call" is "syscall" to the compiler); raw literals R"(...)" read as written."""
    text = _with_strings(source)
    out: list[tuple[int, str]] = []
    i, n, last_end = 0, len(text), -1
    while i < n:
        c = text[i]
        if c == "'":  # a character literal (or a digit separator: skipped to the next quote on the line)
            j = i + 1
            while j < n and text[j] != "'" and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if c != '"':
            i += 1
            continue
        start = i
        raw = RAW_OPEN.match(text, i) if RAW_PREFIX.search(text[max(0, i - 3) : i]) else None
        if raw:
            end = text.find(")" + raw.group(1) + '"', raw.end())
            end = n if end < 0 else end
            piece, i = text[raw.end() : end], end + len(raw.group(1)) + 2
        else:
            j = i + 1
            while j < n and text[j] != '"' and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            piece, i = _decode(text[i + 1 : j]), j + 1
        if out and last_end >= 0 and not text[last_end:start].strip():
            out[-1] = (out[-1][0], out[-1][1] + piece)
        else:
            out.append((text.count("\n", 0, start) + 1, piece))
        last_end = i
    return out


def asm_templates(source: str) -> list[tuple[int, str, bool]]:
    """(line, text, statement) of each asm template (what the assembler reads), escapes decoded and
    literals joined; `statement`: an asm statement, not the register or symbol name a declaration takes
    (`register long r asm("r10")`, after a declarator). A template that is not plain literals is refused
    by build.source_problems."""
    text = _with_strings(source)
    out = []
    for m in build.ASM.finditer(text):
        before = text[: m.start()].rstrip()[-1:]
        statement = not (before.isalnum() or before in "_)]")
        depth, j = 1, m.end()
        while j < len(text) and depth and not (depth == 1 and text[j] == ":"):
            if text[j] == '"':
                lit = build.STRING.match(text, j)
                j = lit.end() if lit else j + 1
                continue
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            j += 1
        template = text[m.end() : j]
        out.append((text.count("\n", 0, m.start()) + 1, "".join(_decode(lit[1:-1]) for lit in
                                                                  build.STRING.findall(template)), statement))  # fmt: skip
    return out


def _found(line: int, meaning: str, text: str) -> str:
    text = " ".join(text.split())
    return f"line {line}: {meaning.format(text)}" if "{}" in meaning else f"line {line}: {meaning} ({text})"


# A `__device__` or `__managed__` declaration: a variable where `;`, `=`, `[` or `{` comes before any `(`.
DEVICE_DECL = re.compile(r"\b__(?:device|managed)__\b([^;={(\[]*)([;={(\[])")


def _device_variables(code: str) -> list[str]:
    """Writable device variables (`__device__ int count;`, `__managed__`): GPU memory that outlives the call,
    shared by every call on every stream (the ABI: a call keeps nothing between calls; two streams at once
    race on it). `const` ones are tables; `__constant__` is not writable by a kernel; `__shared__` is per block."""
    found = []
    for m in DEVICE_DECL.finditer(code):
        head, stop = m.group(1), m.group(2)
        before = re.split(r"[;{})]", code[max(0, m.start() - 40) : m.start()])[-1]  # `const` may come first
        if stop == "(" or re.search(r"\b(?:const|constexpr|__constant__|__shared__)\b", before + head):
            continue
        text = " ".join(m.group(0).split())[:60]
        found.append(f"line {_line(code, m.start())}: a writable device variable ({text}): {STATE_WHY}")
    return found


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
    for rx, meaning in PROBE_CODE:
        violations += [_found(_line(code, m.start()), meaning, m.group(0)) for m in rx.finditer(code)]
    # An asm keyword must come with its template, where the checks below can read it: a macro that
    # expands to `asm volatile` hides the statement from them.
    for m in re.finditer(r"\b(?:asm|__asm__|__asm)\b", code):
        if not build.ASM.match(code, m.start()):
            violations.append(f"line {_line(code, m.start())}: an asm keyword without its template right after it "
                              "(inline assembly spelled through a macro, out of the checks' sight)")
    for line, text in string_literals(source):
        for rx, meaning in STRING_RULES:
            violations += [_found(line, meaning, m.group(0)) for m in rx.finditer(text.lower())]
    for line, text, statement in asm_templates(source):
        if target == "cpu" and statement and text.strip():
            violations.append(f"line {line}: inline assembly in a CPU kernel ({' '.join(text.split())[:60]}): "
                              "intrinsics (<immintrin.h>) name every SIMD instruction; assembly only hides machine "
                              "code from the checks (an empty template, a compiler barrier, is allowed)")
        for rx, meaning in ASM_RULES:
            violations += [_found(line, meaning, m.group(0)) for m in rx.finditer(text.lower())]
        for rx, meaning in PROBE_WORDS:  # symbol names: case matters
            violations += [_found(line, meaning, m.group(0)) for m in rx.finditer(text)]
    if target == "cuda":
        violations += _device_variables(code)
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


# ---------------------------------------------------------------- machine code

# Instructions the candidate's own machine code may not hold, in objdump's spelling. cpuid is not one:
# libgcc's __builtin_cpu_supports code, linked into honest libraries, runs it.
MID_INSTRUCTION = "a branch or address into the middle of an instruction"
MACHINE_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\b(?:syscall|sysenter|svc)\b|\bint\s+\$0x80\b"), f"makes system calls itself ({{}}): {SANDBOX}"),
    (re.compile(r"\b(?:rdtscp?|rdpid|rdpmc)\b"), f"reads the CPU's cycle counter ({{}}): {WHY}"),
    (re.compile(r"\b(?:rdrand|rdseed)\b"), f"draws random numbers from the CPU ({{}}): {RANDOM}"),
    # Not any %fs access: every stack-protector check reads %fs:0x28 and thread_local variables go through it.
    (re.compile(r"\b(?:rd|wr)[fg]sbase\b"), f"reads the thread control block directly ({{}}): {WHY}"),
    # Compiled code branches only to the start of an instruction; a jump into the middle of one runs the
    # bytes of its operands as instructions (`mov $0x90c3050f, %eax` holds 0f 05, a syscall, and c3,
    # ret): machine code that even this scan reads as something else (red team, 2026-11-26).
    (re.compile(r"^" + re.escape(MID_INSTRUCTION)), "hides machine code inside another instruction ({}): code no "
     "scan can read, as only a cheat writes it"),
]
FUNCTION = re.compile(r"^([0-9a-f]+) <(.+)>:$")
BRANCH = re.compile(r"^(?:j[a-z]+|call[a-z]*|loop[a-z]*|xbegin)\s+([0-9a-f]+)\b")
RIP_TARGET = re.compile(r"\(%rip\).*#\s*([0-9a-f]+)\b")
INSTRUCTION = re.compile(r"^\s*([0-9a-f]+):\s+(.+)$")


def _forbidden_instructions(binary: Path) -> dict[tuple[str, str], list[str]] | None:
    """{(function, instruction): [addresses]} of the MACHINE_RULES instructions in a library or archive's
    code (objdump -d, a linear sweep of every executable section), and of the branches and rip-relative
    addresses that land inside a function but not on an instruction start (as MID_INSTRUCTION); None
    when objdump is missing or fails."""
    listing = build.disassemble(binary, timeout_s=120)
    if listing is None:
        return None
    found: dict[tuple[str, str], list[str]] = {}
    function = "?"
    starts: set[int] = set()
    spans: list[tuple[int, int]] = []  # each function's (first, last) instruction address
    targets: list[tuple[str, str, int]] = []  # (function, address, target) of branches and rip-relative operands
    for line in listing.splitlines():
        if head := FUNCTION.match(line):
            function = head.group(2)
            spans.append((int(head.group(1), 16), int(head.group(1), 16)))
        elif ins := INSTRUCTION.match(line):
            address = int(ins.group(1), 16)
            starts.add(address)
            if spans:
                spans[-1] = (spans[-1][0], address)
            if to := BRANCH.match(ins.group(2)) or RIP_TARGET.search(ins.group(2)):
                targets.append((function, ins.group(1), int(to.group(1), 16)))
            text = re.sub(r"[<#].*", "", ins.group(2))  # objdump's notes, as in `call 1030 <syscall@plt>`
            for rx, _ in MACHINE_RULES:
                if m := rx.search(text):
                    found.setdefault((function, " ".join(m.group(0).split())), []).append(ins.group(1))
    spans.sort()
    firsts = [first for first, _ in spans]
    for function, address, target in targets:
        i = bisect.bisect_right(firsts, target) - 1
        if target not in starts and i >= 0 and target <= spans[i][1]:
            found.setdefault((function, MID_INSTRUCTION), []).append(address)
    return found


@functools.cache
def _cuda_runtime_sites() -> frozenset[tuple[str, str]] | None:
    """(function, instruction) pairs of the static CUDA runtime that nvcc links into every library:
    libcudart_static.a in nvcc's own library directories (`nvcc -dryrun` names them; nvcc may be a
    wrapper script elsewhere); None when it is not found."""
    nvcc = build.find_nvcc()
    if nvcc is None:
        return None
    try:
        proc = subprocess.run([nvcc, "-dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    for directory in re.findall(r'-L"?([^"\s]+)', proc.stdout + proc.stderr):
        archive = Path(directory) / "libcudart_static.a"
        if archive.is_file():
            sites = _forbidden_instructions(archive)
            return None if sites is None else frozenset(sites)
    return None


def check_machine_code(library: Path, target: str) -> tuple[list[str], list[str]]:
    """(violations, notes): system-call and cycle-counter instructions in the candidate's own machine code.
    On CUDA, those inside the static CUDA runtime's own functions are not the candidate's."""
    found = _forbidden_instructions(library)
    if found is None:
        return [], ["objdump not found (or failed): machine code not checked"]
    allowed: frozenset[tuple[str, str]] = frozenset()
    if target == "cuda":
        runtime = _cuda_runtime_sites()
        if runtime is None:
            return [], ["static CUDA runtime (libcudart_static.a) not found: machine code not checked"]
        allowed = runtime
    violations = []
    for (function, instruction), addresses in sorted(found.items()):
        if (function, instruction) in allowed:
            continue
        what = next(meaning for rx, meaning in MACHINE_RULES if rx.search(instruction))
        more = f", {len(addresses) - 1} more" if len(addresses) > 1 else ""
        violations.append("its machine code " + what.format(f"{instruction} at 0x{addresses[0]}{more} in {function}"))
    return violations, []


def _probe_import(symbol: str) -> str | None:
    """Why an imported symbol only serves to tell the harness from production, or None. libc's own
    __libc_* symbols come in through libstdc++'s headers (__libc_single_threaded): the generic reason."""
    if symbol.startswith("__libc_"):
        return None
    return next((meaning.format(symbol) for rx, meaning in PROBE_WORDS if rx.fullmatch(symbol)), None)


# Writable sections a C++ shared library has of its own (the dynamic linker's tables, constructors,
# RELRO data), and the C runtime's writable objects: anything else writable is the kernel's own state.
RUNTIME_WRITABLE_SECTIONS = {".init_array", ".fini_array", ".dynamic", ".got", ".got.plt", ".data.rel.ro", ".data",
                             ".bss"}  # fmt: skip
RUNTIME_OBJECTS = {"completed.0", "completed.1", "__dso_handle", "__TMC_END__"}
STATE_BYTES_ALLOWED = 64  # .data and .bss together, beyond which unnamed writable data is refused too
STATE_WHY = ("the ABI: a call keeps nothing between calls (calls may come from several threads at once, and a "
             "kept value serves a cache or a count)")  # fmt: skip


def _writable_state(library: Path) -> list[str] | None:
    """Static or thread_local data a CPU library keeps between calls (red team, 2026-11-27: fp32 staging
    buffers made `static`, racing when two threads call); None when readelf is missing or fails."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return None
    try:
        sections = subprocess.run([readelf, "-SW", str(library)], capture_output=True, text=True, timeout=60)
        symbols = subprocess.run([readelf, "-sW", "-C", str(library)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if sections.returncode or symbols.returncode:
        return None
    names, found, size = {}, [], 0
    # readelf -SW's rows: [Nr] Name Type Address Off Size ES Flg ...
    section_row = r"^\s*\[\s*(\d+)\]\s+(\S+)\s+\S+\s+\S+\s+\S+\s+([0-9a-f]+)\s+\S+\s+(\S*)"
    for m in re.finditer(section_row, sections.stdout, re.M):
        index, name, bytes_, flags = int(m.group(1)), m.group(2), int(m.group(3), 16), m.group(4)
        names[index] = name
        if "W" in flags and "A" in flags and name not in RUNTIME_WRITABLE_SECTIONS:
            found.append(f"a writable section {name} ({bytes_} bytes{', thread-local' if 'T' in flags else ''})")
        elif name in (".data", ".bss"):
            size += bytes_
    for m in re.finditer(r"^\s*\d+:\s+[0-9a-f]+\s+(\d+)\s+(OBJECT|TLS)\s+\S+\s+\S+\s+(\d+)\s+(.+)$", symbols.stdout,
                         re.M):  # fmt: skip
        bytes_, index, name = int(m.group(1)), int(m.group(3)), m.group(4).strip()
        if bytes_ and names.get(index) in (".data", ".bss") and name not in RUNTIME_OBJECTS:
            found.append(f"`{name}` ({bytes_} bytes)")
    if not found and size > STATE_BYTES_ALLOWED:
        found.append(f"{size} bytes of writable data")
    if not found:
        return []
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return [f"keeps writable state between calls (static or thread_local data): {', '.join(found[:3])}{more} "
            f"({STATE_WHY})"]


def check_library(library: Path, target: str) -> tuple[list[str], list[str]]:
    """(violations, notes) for a compiled candidate: linked libraries, undefined symbols, machine code."""
    violations, notes = [], []
    needed = _needed(library)
    if needed is None:
        notes.append("readelf not found: linked libraries not checked")
    else:
        violations += [f"links {lib} (not on the allow-list of libraries)" for lib in needed
                       if not ALLOWED_NEEDED.match(lib)]  # fmt: skip
    code_violations, code_notes = check_machine_code(library, target)
    violations, notes = violations + code_violations, notes + code_notes
    if target == "cpu":
        state = _writable_state(library)
        if state is None:
            notes.append("readelf not found (or failed): static data not checked")
        violations += state or []
    symbols = _nm_undefined(library)
    if symbols is None:
        notes.append("nm not found: imported symbols not checked")
        return violations, notes
    for sym in symbols:
        base = sym.split("@")[0]
        if DENIED_SYMBOLS.match(base) or (target == "cpu" and CPU_DENIED_SYMBOLS.match(base)):
            violations.append(f"imports {sym} (process control, threads, I/O or a library that does the work)")
        elif target == "cpu" and (probe := _probe_import(base)):
            violations.append(f"imports {sym}: {probe}")
        elif target == "cpu" and not (
            base in CPU_ALLOWED_SYMBOLS or LIBM.match(base) or LIBGCC.match(base) or CXX_RUNTIME.match(base)
        ):
            violations.append(f"imports {sym} (not on the CPU allow-list: libc memory/string, libm, C++ runtime)")
    return violations, notes
