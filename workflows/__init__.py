"""Deterministic workflow code only: no I/O, no torch, no clocks."""
