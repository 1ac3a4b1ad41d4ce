"""The search attributes a run sets (workflow) and `kopt runs` reads (front end), and the kinds the
embedded server registers them with."""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

KERNEL_KEY = SearchAttributeKey.for_keyword("KoptKernel")
TARGET_KEY = SearchAttributeKey.for_keyword("KoptTarget")
ROUND_KEY = SearchAttributeKey.for_int("KoptRound")
BEST_KEY = SearchAttributeKey.for_float("KoptBestSpeedup")

# For `temporal server start-dev --search-attribute NAME=KIND`.
SERVER_KINDS = {KERNEL_KEY.name: "Keyword", TARGET_KEY.name: "Keyword", ROUND_KEY.name: "Int", BEST_KEY.name: "Double"}
