"""Tests that need torch alone (no vLLM): the graph core, the write op, the cache
size arithmetic, perf/'s own tools and the GPU check's rehearsal. docs/testing.md,
"Layout"."""
