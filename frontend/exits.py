"""The exit codes of every kopt command, in one place (the README lists them under Quick start)."""

OK = 0
FAILED = 1  # the run failed; the candidate is rejected (evaluate) or wrong (verify)
USAGE = 2  # bad arguments, settings or input
SLOWER = 3  # kopt verify: correct, and slower than the baseline beyond the noise
INFRA = 4  # kopt verify: the package's baseline or the machine failed, not the candidate
