"""Triton kernels of graphrunner: each module holds one kernel and its launcher."""
