"""Tests of vLLM's own objects, in-process on a CPU: its config, its speculator
and ours, its connectors, its graph manager's lifecycle. docs/testing.md, "Layout"."""
