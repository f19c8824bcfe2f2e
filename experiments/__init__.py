"""Experiment entry points (Hydra apps, benchmarks) and plotting."""
