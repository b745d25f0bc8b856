"""Tests that run only on a CUDA device (skipped elsewhere; perf/gpu_check.sh runs
them). docs/testing.md, "Layout"."""
