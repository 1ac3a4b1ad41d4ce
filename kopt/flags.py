"""Compiler options a candidate may ask for: an allow-list, not a deny-list.

Flags are text an LLM chose, so every option must be known to change code generation only. Each
list item is one whole option (`-Xptxas=-v,-O3`, never `-Xptxas` then `-v`): an option that takes
the next item as its value could smuggle a path or a tool in. Anything that names a file, a
directory, a tool, a plugin, a dump or a linker option is refused, and so is anything unknown.
"""

from __future__ import annotations

import re

from kopt.models import Target

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_VALUE = r"[A-Za-z0-9_.+\-]*"  # a macro value: no quotes, slashes, @, commas or spaces
COMMON = [
    r"-O[0-3s]", r"-Ofast", r"-g0", r"-w", r"-Wall", r"-Wextra", r"-Wno-[a-z0-9-]+", r"-std=c\+\+(?:17|20)",
    rf"-D{_IDENT}(?:={_VALUE})?", rf"-U{_IDENT}",
]  # fmt: skip
# Host (g++) code generation: target ISA and tuning, and a fixed set of optimization switches.
_F_NAMES = (
    "fast-math|unroll-loops|unroll-all-loops|tree-vectorize|tree-loop-vectorize|tree-slp-vectorize|"
    "strict-aliasing|omit-frame-pointer|inline-functions|inline-small-functions|prefetch-loop-arrays|peel-loops|"
    "ipa-pta|finite-math-only|associative-math|reciprocal-math|signed-zeros|trapping-math|math-errno|"
    "rounding-math|split-loops|unswitch-loops|gcse|ivopts|schedule-insns|schedule-insns2|exceptions|rtti|"
    "vect-cost-model=(?:unlimited|dynamic|cheap|very-cheap)|fp-contract=(?:fast|on|off)|"
    "excess-precision=(?:fast|standard)|simd-cost-model=(?:unlimited|dynamic|cheap)"
)
HOST = [
    rf"-f(?:no-)?(?:{_F_NAMES})", r"-march=[a-z0-9.+-]+", r"-mtune=[a-z0-9.+-]+", r"-m(?:no-)?[a-z0-9]+(?:-[a-z0-9]+)*",
    r"--param=[a-z0-9-]+=[0-9]+",
]  # fmt: skip
_PTXAS = r"(?:-O[0-3]|-v|--verbose|-warn-spills|-warn-lmem-usage|--warn-on-spills|--warn-on-local-memory-usage|" \
    r"-dlcm=(?:ca|cg|cs)|-dscm=(?:cg|cs|wt|wb)|--def-load-cache=(?:ca|cg|cs)|--def-store-cache=(?:cg|cs|wt|wb)|" \
    r"--allow-expensive-optimizations=(?:true|false)|--maxrregcount=[0-9]+|-maxrregcount=[0-9]+|" \
    r"--fmad=(?:true|false)|--disable-optimizer-constants)"  # fmt: skip
NVCC = [
    r"--use_fast_math|-use_fast_math", r"-lineinfo|--generate-line-info", r"--extra-device-vectorization",
    r"--(?:ftz|prec-div|prec-sqrt|fmad)=(?:true|false)", r"-(?:ftz|prec-div|prec-sqrt|fmad)=(?:true|false)",
    r"--?maxrregcount=[0-9]+", r"--restrict|-restrict", r"--expt-relaxed-constexpr|--expt-extended-lambda",
    r"--extended-lambda", r"--resource-usage", r"-Wno-deprecated-gpu-targets", r"--?ptxas-options=" + _PTXAS +
    r"(?:," + _PTXAS + r")*", r"-Xptxas=" + _PTXAS + r"(?:," + _PTXAS + r")*",
]  # fmt: skip
_COMPILED = {
    "cpu": re.compile("|".join(f"(?:{p})" for p in COMMON + HOST)),
    "cuda": re.compile("|".join(f"(?:{p})" for p in COMMON + NVCC)),
    "host": re.compile("|".join(f"(?:{p})" for p in COMMON + HOST)),
}
_XCOMPILER = re.compile(r"(?:-Xcompiler|--compiler-options)=(.+)")


def check_flags(flags: list[str], target: Target | None = None) -> list[str]:
    """Problems with a flag list (empty when every item is on the allow-list of `target`; with no
    target, an item must be on the list of either)."""
    targets = [target] if target else ["cpu", "cuda"]
    problems = []
    for flag in flags:
        if not isinstance(flag, str) or not flag.startswith("-") or any(c.isspace() or c == "\x00" for c in flag):
            problems.append(f"{flag!r}: each option must be one item starting with '-' and without spaces")
        elif not any(_allowed(flag, t) for t in targets):
            problems.append(
                f"{flag!r}: not on the allow-list of compiler options (optimization, ISA, macros, ptxas options; "
                "nothing that names a file, a path, a tool or a linker option)"
            )
    return problems


def _allowed(flag: str, target: str) -> bool:
    if _COMPILED[target].fullmatch(flag):
        return True
    m = _XCOMPILER.fullmatch(flag)
    return target == "cuda" and m is not None and all(_COMPILED["host"].fullmatch(p) for p in m.group(1).split(","))


def flag_summary(target: Target) -> str:
    """The allow-list of `target` in words, for the agents' prompts (check_flags is the rule)."""
    common = "-O0..-O3, -Os, -Ofast, -g0, -w, -Wall, -Wextra, -Wno-<warning>, -std=c++17|c++20, -DNAME[=VALUE], -UNAME"
    host = ("-march=<cpu>, -mtune=<cpu>, -m<isa feature> (e.g. -mavx2, -mfma, -mno-avx512f), --param=<name>=<n>, "
            "-f[no-]<switch> for: " + _F_NAMES.replace("|", ", ").replace("(?:", "{").replace(")", "}"))
    if target == "cpu":
        return f"{common}; {host}"
    return (f"{common}; --use_fast_math, -lineinfo, --extra-device-vectorization, --ftz|--prec-div|--prec-sqrt|"
            "--fmad=true|false, --maxrregcount=<n>, --restrict, --expt-relaxed-constexpr, --extended-lambda, "
            "--resource-usage, -Xptxas=<ptxas options, comma-separated: -O0..-O3, -v, -dlcm=ca|cg|cs, "
            "-dscm=cg|cs|wt|wb, --maxrregcount=<n>, --allow-expensive-optimizations=true|false, ...>, "
            "-Xcompiler=<host options as for the cpu target, comma-separated>; each option one item, no spaces")
