"""Kernel packages and the C kernel ABI header (kopt_abi.h), shipped as package data."""
