"""Benchmarks: kernels now; training workloads over shaped links as they land.

Every benchmark runs its baseline in the same invocation and reports ratios.
Run ``sylvie-comm bench --help`` (or ``python -m sylvie_comm.bench --help``).
"""
