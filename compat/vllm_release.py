"""A vLLM release's source distribution, fetched from the package index pip
uses and unpacked: its ``vllm/`` (the Python sources, no compiled parts) and
vLLM's own ``tests/`` with the root ``conftest.py``. Also a release's CUDA
wheel (:func:`wheel`, sha256 pinned in :data:`WHEELS`), whose Python
``compat/release_on_cpu.py`` runs on a CPU.

    python compat/vllm_release.py 0.32.0 0.33.0     # prints each unpacked folder

``pip download --no-binary :all: vllm==X`` fetches the same file but then
builds its metadata, which needs CUDA, and fails; so the file is taken from
the index's simple page (PEP 503) and checked against the sha256 the page
gives. ``PIP_INDEX_URL`` names another index. Unpacked once under
``$CG_EXTRACT_CACHE`` (default ``~/.cache/cg_extract``).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

INDEX = "https://pypi.org/simple"
# The CUDA wheels whose Python runs here (compat/release_on_cpu.py), pinned:
# any other file under that name is refused.
WHEELS = {
    "0.33.0": (
        "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
    ),
    "0.34.0": (
        "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "79ca4b3cd74aec08c4bf476bdf0cb15735b605ae5368526a2faae1e30f044ca2",
    ),
}


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "cg_extract"
    return Path(os.environ.get("CG_EXTRACT_CACHE", default))


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def sdist_link(version: str, index: str | None = None) -> tuple[str, str]:
    """(URL, sha256) of ``vllm-<version>.tar.gz`` on the index's simple page."""
    return file_link(f"vllm-{version}.tar.gz", index)


def file_link(name: str, index: str | None = None) -> tuple[str, str]:
    """(URL, sha256) of vLLM's file ``name`` on the index's simple page."""
    index = (index or os.environ.get("PIP_INDEX_URL") or INDEX).rstrip("/")
    page = f"{index}/vllm/"
    with urllib.request.urlopen(page, timeout=60) as response:
        links = _Links()
        links.feed(response.read().decode())
    for href in links.hrefs:
        url, _, fragment = urllib.request.urljoin(page, href).partition("#")
        if url.rsplit("/", 1)[-1] == name:
            digest = re.fullmatch(r"sha256=([0-9a-f]{64})", fragment)
            if digest is None:
                raise RuntimeError(f"{page} gives {name} without a sha256")
            return url, digest.group(1)
    raise RuntimeError(f"{page} has no {name}: is it a vLLM release's file?")


def _download(url: str, sha256: str, out: Path) -> None:
    """``url`` saved as ``out``, or an error if its sha256 is not ``sha256``."""
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=300) as response, open(out, "wb") as f:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != sha256:
        raise RuntimeError(f"{url}: sha256 {digest.hexdigest()}, expected {sha256}")


def sdist(version: str) -> Path:
    """The unpacked source distribution of vLLM ``version`` (a folder with
    ``vllm/``, ``tests/`` and ``pyproject.toml``), fetched when missing."""
    folder = cache_dir() / f"vllm-{version}"
    if (folder / "PKG-INFO").is_file():
        return folder
    url, sha256 = sdist_link(version)
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as scratch:
        archive = Path(scratch) / "sdist.tar.gz"
        _download(url, sha256, archive)
        with tarfile.open(archive) as tar:
            tar.extractall(scratch, filter="data")
        # Renamed into place whole, so a folder with PKG-INFO is complete.
        shutil.rmtree(folder, ignore_errors=True)
        (Path(scratch) / f"vllm-{version}").rename(folder)
    return folder


def wheel(version: str) -> Path:
    """vLLM ``version``'s CUDA wheel (:data:`WHEELS`), fetched when missing
    and checked against its pinned sha256."""
    name, sha256 = WHEELS[version]
    path = cache_dir() / name
    if path.is_file():
        return path
    url, listed = file_link(name)
    if listed != sha256:
        raise RuntimeError(
            f"the index lists {name} as sha256 {listed}, pinned {sha256}"
        )
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as scratch:
        _download(url, sha256, Path(scratch) / name)
        (Path(scratch) / name).rename(path)  # whole, or not there
    return path


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python compat/vllm_release.py VERSION...", file=sys.stderr)
        return 2
    for version in argv:
        print(sdist(version))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
