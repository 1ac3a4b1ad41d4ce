"""Agent roles (planner, coder, ...) and their providers. `offline` needs no LLM."""
