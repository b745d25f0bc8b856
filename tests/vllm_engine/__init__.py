"""vLLM's real MRv2 engine on a CPU, in subprocesses (the ``e2e`` marker), and
the drivers those subprocesses run. docs/testing.md, "Layout"."""
