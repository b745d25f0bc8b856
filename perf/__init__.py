"""Performance sweep and regression gate for cg_extract (see perf/README.md)."""
