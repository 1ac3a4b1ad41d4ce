"""Thin Temporal activity adapters: plan, code, compile, test, profile."""
