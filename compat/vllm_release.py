"""A vLLM release's source distribution, fetched from the package index pip
uses and unpacked: its ``vllm/`` (the Python sources, no compiled parts) and
vLLM's own ``tests/`` with the root ``conftest.py``.

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
    index = (index or os.environ.get("PIP_INDEX_URL") or INDEX).rstrip("/")
    page = f"{index}/vllm/"
    with urllib.request.urlopen(page, timeout=60) as response:
        links = _Links()
        links.feed(response.read().decode())
    name = f"vllm-{version}.tar.gz"
    for href in links.hrefs:
        url, _, fragment = urllib.request.urljoin(page, href).partition("#")
        if url.rsplit("/", 1)[-1] == name:
            digest = re.fullmatch(r"sha256=([0-9a-f]{64})", fragment)
            if digest is None:
                raise RuntimeError(f"{page} gives {name} without a sha256")
            return url, digest.group(1)
    raise RuntimeError(f"{page} has no {name}: is {version} a vLLM release?")


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
        digest = hashlib.sha256()
        with (
            urllib.request.urlopen(url, timeout=300) as response,
            open(archive, "wb") as out,
        ):
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != sha256:
            raise RuntimeError(
                f"{url}: sha256 {digest.hexdigest()}, the index says {sha256}"
            )
        with tarfile.open(archive) as tar:
            tar.extractall(scratch, filter="data")
        # Renamed into place whole, so a folder with PKG-INFO is complete.
        shutil.rmtree(folder, ignore_errors=True)
        (Path(scratch) / f"vllm-{version}").rename(folder)
    return folder


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python compat/vllm_release.py VERSION...", file=sys.stderr)
        return 2
    for version in argv:
        print(sdist(version))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
