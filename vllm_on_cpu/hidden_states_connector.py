"""vLLM's ``ExampleHiddenStatesConnector``, saving on a CPU.

The real connector copies a finished request's hidden states out of the KV
cache on a CUDA stream into pinned memory and writes the file from a thread
pool once a CUDA event fires; on a CPU-only torch the pinned allocation raises
inside the engine, after the lock file was made and before anything is saved.
This subclass changes only that transport: it extracts the same rows with the
connector's own reader and writes them at once, through the connector's own
``_write_tensors`` (``save_file``, then the lock released). Everything else is
the parent's: the file name (``<storage>/<request id>.safetensors`` or the
request's ``hidden_states_path``), the safetensors keys (``hidden_states``,
``token_ids``), the lock created and held from the request's first step, the
``kv_transfer_params`` the scheduler returns, and ``get_finished``'s
bookkeeping, which sees the save as a copy already done.

Engines load it with ``kv_connector_module_path``, the way the
``speculators`` project loads its connectors (see :func:`kv_transfer_config`).
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _CopyDone:
    """Stands for the CUDA event of a device-to-host copy that has finished:
    the parent polls ``query()`` in ``get_finished`` and its writer thread
    calls ``synchronize()``."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:  # as the parent: rank 0 alone saves
            return
        assert self._kv_cache is not None
        # The parent's slot arithmetic: every slot of the request's blocks,
        # in order; the reader keeps the first num_tokens rows.
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        tensors = {
            "hidden_states": extract_from_kv_cache(
                self._kv_cache, slots, num_tokens
            ).clone(),
            "token_ids": pending.token_ids.clone(),
        }
        assert pending.req_id not in self._req_futures, (
            "Found another KV transfer request with same req_id!"
        )
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        # The lock wait_for_save created (LOCK_EX held); made here only where
        # the parent makes it too.
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(
                pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644
            )
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _CopyDone()
        self._write_tensors(tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done


def kv_transfer_config(
    storage: str | os.PathLike, connector: type = CPUHiddenStatesConnector
) -> dict[str, Any]:
    """``--kv-transfer-config`` for ``connector`` (this one unless told),
    saving under ``storage``."""
    return {
        "kv_connector": connector.__name__,
        "kv_connector_module_path": connector.__module__,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
