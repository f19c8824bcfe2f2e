"""Command-line microbenchmarks and tools, each its own ``python -m benchmarks.<name>``.

What ``python -m experiments.run`` runs (the Hydra sweeps, capacity searches, validations) lives
in ``experiments/``; these scripts time one component (attention, GEMMs, the step, batching,
the HTTP path, llama.cpp side by side), soak the server, or count host time per step.
"""
