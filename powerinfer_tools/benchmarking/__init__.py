"""Measuring the pipeline: synthetic real-shape models and side-by-side benchmarks."""
