"""hs-connectors' ``FP8HiddenStatesConnector``, saving on a CPU.

The package (the ``speculators`` project's connectors, ``hs-connectors`` on
PyPI) subclasses vLLM's ``ExampleHiddenStatesConnector`` and overrides only
its final write, ``_write_tensors``: quantize to ``float8_e4m3fn`` with one
scale per token, ``save_file``, release the lock. The CUDA stream hand-off it
inherits (``_submit_async_write``: a copy on a side stream into pinned memory,
an event) cannot run on a CPU-only torch, so this subclass takes that one
method from :class:`vllm_on_cpu.hidden_states_connector.CPUHiddenStatesConnector`
(the same rows, extracted at once, handed to ``_write_tensors``, here the
package's). Everything else, the quantizing write included, is the package's.
"""

from __future__ import annotations

from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector

from vllm_on_cpu.hidden_states_connector import CPUHiddenStatesConnector


class CPUFP8HiddenStatesConnector(FP8HiddenStatesConnector):
    _submit_async_write = CPUHiddenStatesConnector._submit_async_write
