"""hs-connectors' ``MooncakeHiddenStatesConnector``, on a CPU, with a local
Mooncake store.

The connector puts each finished request's hidden states into a Mooncake
distributed store, keyed by the transfer manifest it returns as the request's
``kv_transfer_params``; the trainer reads them back with
``hs_connectors.transfer.MooncakeTransfer``. On a CPU:

* the store is ``mooncake-transfer-engine-non-cuda`` over TCP on 127.0.0.1,
  with a ``mooncake_master`` started here (:func:`mooncake_master`); its
  transfer engine needs ``libibverbs.so.1`` (Debian's ``libibverbs1``) to load,
  even for TCP;
* the connector's CUDA stream hand-off (a copy stream and an event, from
  ``_device()``, the accelerator's torch module) takes ``torch.cpu``'s
  streams and events, which run everything in order. That one method is all
  this subclass changes. (Its pinned staging buffer falls back to pageable
  memory by itself, with a warning.)

The samples live in the memory the engine's store client mounted, so they are
read while the engine runs (:func:`fetch_samples`).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from hs_connectors.mooncake_hidden_states_connector import (
    MooncakeHiddenStatesConnector,
)
from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig
from hs_connectors.transfer import MooncakeTransfer
from safetensors.torch import save_file

HOST = "127.0.0.1"
SEGMENT_BYTES = 64 << 20  # each client's share of the store, and its buffer
READ_TIMEOUT_S = 120.0


class CPUMooncakeHiddenStatesConnector(MooncakeHiddenStatesConnector):
    def _device(self) -> Any:
        return torch.cpu


def store_config(master: str) -> MooncakeStoreConfig:
    """A client of the store whose master is at ``master`` (host:port)."""
    return MooncakeStoreConfig(
        local_hostname=HOST,
        metadata_server="P2PHANDSHAKE",
        master_server_address=master,
        global_segment_size=SEGMENT_BYTES,
        local_buffer_size=SEGMENT_BYTES,
        protocol="tcp",
        num_writer_threads=1,
    )


def kv_transfer_config(master: str) -> dict[str, Any]:
    """``--kv-transfer-config`` for this connector, as hs-connectors'
    ``MooncakeBackend.build_kv_transfer_config`` makes it."""
    return {
        "kv_connector": CPUMooncakeHiddenStatesConnector.__name__,
        "kv_connector_module_path": __name__,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"mooncake": asdict(store_config(master))},
    }


@contextlib.contextmanager
def mooncake_master(rpc_port: int, metrics_port: int, log: Path) -> Iterator[str]:
    """The package's ``mooncake_master`` on 127.0.0.1; yields its address."""
    import mooncake

    binary = Path(mooncake.__file__).parent / "mooncake_master"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                str(binary),
                f"-rpc_port={rpc_port}",
                f"-metrics_port={metrics_port}",
                f"-metrics_host={HOST}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        time.sleep(1.0)  # it binds its ports at once; clients retry anyway
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited {proc.returncode}: see {log}")
        yield f"{HOST}:{rpc_port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def fetch_samples(
    llm: Any, requests: list[dict[str, Any]], master: str, storage: Path
) -> None:
    """Read every request's sample with hs-connectors' ``MooncakeTransfer``,
    as the trainer does, while the engine steps (the connector submits a
    finished request's put one step later), and save it under ``storage`` as
    the request's ``path``, in the Example connector's file format."""
    reader = MooncakeTransfer(MooncakeHiddenStatesStore(store_config(master)))
    reader.setup()
    storage.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=1) as pool:
        reads = [
            pool.submit(reader.get_generated, r["kv_transfer_params"]) for r in requests
        ]
        deadline = time.monotonic() + READ_TIMEOUT_S
        while not all(f.done() for f in reads) and time.monotonic() < deadline:
            llm.llm_engine.step()
            time.sleep(0.05)
        for request, read in zip(requests, reads, strict=True):
            sample = read.result(timeout=0)
            path = storage / f"{request['kv_transfer_params']['handle']}.safetensors"
            save_file(sample, str(path))
            request["path"] = str(path)
