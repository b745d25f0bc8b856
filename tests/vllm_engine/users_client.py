"""Hidden states through the OpenAI API, as our users' client gets them.

The ``speculators`` project's data generation (``vllm_client.py``) sends each
sample as a Completions request with the token ids as ``prompt``,
``max_tokens=1`` and ``extra_body={"return_token_ids": True}``; checks that
the echoed ``prompt_token_ids`` are its own; takes the file from
``kv_transfer_params["hidden_states_path"]``; waits until it can take the
``.lock`` exclusively (the connector holds it until the file is written),
removes the lock, and loads the safetensors. This module does the same with
the ``openai`` client, so the server is driven exactly through that path.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

import openai
import torch
from safetensors.torch import load_file

LOCK_TIMEOUT_S = 60.0


async def hidden_states_path(
    client: openai.AsyncOpenAI, model: str, token_ids: list[int]
) -> str:
    response = await client.completions.create(
        model=model,
        prompt=token_ids,
        max_tokens=1,
        extra_body={"return_token_ids": True},
    )
    (choice,) = response.choices
    echoed = getattr(choice, "prompt_token_ids", None)
    if echoed != token_ids:
        raise AssertionError(f"the server echoed {echoed}, not the prompt sent")
    params = getattr(response, "kv_transfer_params", None) or {}
    if "hidden_states_path" not in params:
        raise AssertionError(f"no hidden_states_path in kv_transfer_params {params}")
    return params["hidden_states_path"]


async def wait_for_lock(path: str, poll_s: float = 0.05) -> None:
    """Take the file's lock exclusively (once the writer let go), then remove
    the lock file, as the users' client does."""
    lock = f"{path}.lock"
    fd = os.open(lock, os.O_RDWR)
    try:
        async with asyncio.timeout(LOCK_TIMEOUT_S):
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(poll_s)
    finally:
        os.close(fd)
    os.remove(lock)


async def fetch(
    client: openai.AsyncOpenAI, model: str, token_ids: list[int]
) -> tuple[Path, dict[str, torch.Tensor]]:
    """One sample: the saved file's path and its tensors."""
    path = await hidden_states_path(client, model, token_ids)
    await wait_for_lock(path)
    return Path(path), load_file(path)


async def fetch_all(
    base_url: str, model: str, prompts: list[list[int]], timeout_s: float = 120.0
) -> list[tuple[Path, dict[str, torch.Tensor]]]:
    """All prompts at once, concurrently, as the data generation sends them."""
    async with openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="EMPTY", timeout=timeout_s, max_retries=0
    ) as client:
        return await asyncio.gather(*(fetch(client, model, p) for p in prompts))
