"""The patch ids of the workflows' `workflow.patched` branches, one home, each with what it changed.

A run records a patch id the first time its branch runs; a history recorded before the change
replays the old path. An id is never reused or renamed: committed golden histories (tests/golden)
and runs in flight name them.
"""

# Runs started with LLM_FAULTS_PATCH (docs/decisions/0016): an unusable reply fails its candidate and
# the round goes on; an unavailable endpoint is retried with backoff for as long as the wall-time
# budget allows (the run waits); only errors no retry can fix (key, model, request) stop the run, with
# their reason in the result. Histories recorded before replay the old path (5 attempts, then fail).
LLM_FAULTS_PATCH = "llm-faults"

# Runs started with ACTIVITY_IDS_PATCH give every activity an id naming its round and slot
# (kopt/activity_table.py), which history groups by; older histories keep Temporal's numbering.
ACTIVITY_IDS_PATCH = "activity-ids"

# Runs started with SHAPE_GUARD_PATCH accept no new best that is statistically slower than the
# baseline at any (shape, dtype) beyond SHAPE_SLOWDOWN_LIMIT, unless the request allows regressions.
SHAPE_GUARD_PATCH = "shape-regressions"

# Runs started with NOISE_FLOOR_PATCH call a shape a regression only beyond the A/B's noise floor too
# (kopt.models.regression_limit; docs/decisions/0027); older histories replay the 2 % limit alone.
NOISE_FLOOR_PATCH = "shape-guard-noise-floor"  # also ReverifyBest's

# Plan requests carry the last records in full and a digest of the older ones (kopt.plan_history);
# histories recorded before this change replay the old path, which sent every record.
COMPACT_HISTORY_PATCH = "compact-plan-history"

# Runs started with HOLDOUT_PATCH judge the best, after the last round, on the request's held-out
# shapes (never tested or timed by the search): OptimizeResult.holdout (docs/decisions/0020).
HOLDOUT_PATCH = "holdout-shapes"

# Packages with [dispatch.<target>]: after the last round, per-bucket tunable values from the measured
# candidates are built into one library that dispatches on the call's shape (kopt.dispatch), judged
# like a candidate and kept if it beats the best (docs/decisions/0023). Older runs never had the step.
SPECIALIZE_PATCH = "shape-specialized"

# Runs started with HEAD_TO_HEAD_PATCH replace a best that is not the baseline only by beating it in one
# interleaved A/B measurement (the round's best against the best's library; min-gain and the noise
# floor judged on that interval: docs/decisions/0037). Older histories replay the ratio-of-ratios rule
# (each candidate's speedup over a baseline measured at another time).
HEAD_TO_HEAD_PATCH = "head-to-head"

# Runs started with BUDGET_HOLDOUT_PATCH skip the held-out step, as the shape-specialized one always
# was, when the search stopped because a budget (wall time, device time, cost, tokens) ran out: the
# budget bounds the whole run, not the search alone (issue #28). Older histories replay the step.
BUDGET_HOLDOUT_PATCH = "budget-skips-holdout"

# Runs started with BUDGET_RESERVE_PATCH start a round, the shape-specialized step or the held-out step
# only where the wall-time and device-time budgets have room for it (as long as the last round took,
# or the best's own test and profile): the run ends within its budget instead of overrunning it by a
# step begun near its end (rules.no_room, issue #28). Older histories replay without the checks.
BUDGET_RESERVE_PATCH = "budget-reserves-steps"

# Offline runs of several candidates a round started with ASYNC_SLOTS_PATCH judge their candidates in
# asynchronous slots: each candidate is compared with the best as soon as it finishes and its slot takes
# the next proposal, so no GPU waits for a round's slowest candidate (docs/decisions/0041, issue #28).
# Older histories, and runs of one candidate a round or of an LLM provider, replay rounds in step.
ASYNC_SLOTS_PATCH = "async-slots"

# Runs with a wall-time budget started with BUDGET_CANCELS_PATCH cancel the candidates still running
# when the budget runs out (a timer wakes the workflow then), in asynchronous slots and in lockstep
# rounds alike: the run ends at its budget, not after the candidates begun before it (issue #28: 186 s
# for a 140-s budget on an H100).
BUDGET_CANCELS_PATCH = "budget-cancels-running"
