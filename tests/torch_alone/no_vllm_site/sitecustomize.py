"""Test-only: this interpreter without vLLM, as on the GPU check's machine.

Put this folder on ``PYTHONPATH`` and every Python process started with it
(pytest's children included) finds no ``vllm``: ``import vllm`` raises
``ModuleNotFoundError`` and ``importlib.util.find_spec("vllm")`` is None, as
where it is not installed. Used by ``tests/torch_alone/test_gpu_check.py`` to rehearse
``perf/gpu_check.sh`` on a CPU.
"""

import sys
from importlib.machinery import PathFinder


class PathFinderWithoutVllm(PathFinder):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] == "vllm":
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [
    PathFinderWithoutVllm if finder is PathFinder else finder
    for finder in sys.meta_path
]
