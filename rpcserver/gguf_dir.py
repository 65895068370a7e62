"""`--gguf-dir DIR`: the GGUF files a worker offers to load weights from (protocol_spec.md §8.3).

The directory is read once, at start-up: every regular file directly in it whose name ends in `.gguf`
is opened (symbolic links and subdirectories are skipped, so nothing outside DIR is ever opened) and
its digest computed. From then on the worker holds the open descriptors and knows the files only by
their position in that list; no command carries a path. A load reads with pread() at offsets checked
against the size the file had at start-up, straight into the destination buffer, and then hashes what
it read: a file that changed since gives a short read or another hash, and the load answers 0.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kernels.hashing import fnv1a64
from wire.gguf_files import MAX_FILES, GgufFile, file_digest
from .memory import RequestError

log = logging.getLogger("rpcserver")


@dataclass
class _Open:
    name: str
    fd: int
    entry: GgufFile


class GgufDir:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.files: list[_Open] = []
        for entry in sorted(os.scandir(self.directory), key=lambda e: e.name):
            if not entry.name.endswith(".gguf") or entry.is_symlink() or not entry.is_file(follow_symlinks=False):
                continue
            if len(self.files) == MAX_FILES:
                log.warning("--gguf-dir: more than %d GGUF files; offering the first %d", MAX_FILES, MAX_FILES)
                break
            try:  # O_NOFOLLOW: a file swapped for a link after the scan is not followed either
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                log.warning("--gguf-dir: cannot open %s: %s", entry.name, exc.strerror or exc)
                continue
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                continue
            try:
                digest = file_digest(st.st_size, lambda offset, length: os.pread(fd, length, offset))
            except (OSError, ValueError) as exc:
                log.warning("--gguf-dir: cannot read %s: %s", entry.name, exc)
                os.close(fd)
                continue
            self.files.append(_Open(entry.name, fd, GgufFile(st.st_size, digest)))

    @property
    def entries(self) -> list[GgufFile]:
        return [f.entry for f in self.files]

    def describe(self) -> str:
        total = sum(f.entry.size for f in self.files)
        return f"{len(self.files)} GGUF file(s), {total >> 20} MiB in {self.directory}"

    def close(self) -> None:
        for f in self.files:
            os.close(f.fd)
        self.files = []

    def check(self, file_id: int, offset: int, size: int) -> int:
        """The descriptor of file `file_id` if [offset, offset + size) lies inside it; else RequestError."""
        if file_id >= len(self.files):
            raise RequestError(f"no GGUF file {file_id} (this worker offers {len(self.files)})")
        limit = self.files[file_id].entry.size
        if offset > limit or size > limit - offset:  # overflow-safe
            raise RequestError(f"file range {offset}+{size} outside GGUF file {file_id} of {limit} bytes")
        return self.files[file_id].fd

    @staticmethod
    def load(fd: int, offset: int, dst: np.ndarray, digest: int) -> bool:
        """Reads dst.size bytes at `offset` into dst (a checked region of a buffer); True if all were read
        and they hash to `digest`. On False, dst holds whatever was read."""
        view = memoryview(dst).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:  # the file shrank since start-up
                return False
            done += n
        return fnv1a64(dst) == digest
