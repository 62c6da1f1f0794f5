"""Making a write survive a crash of the machine, not just of the process.

A file written and renamed into place may still be in the page cache when a node loses power:
after the reboot the name points at a file of zeros or of no length. `fsync_path` flushes a
file's data, or a directory's entries (the rename itself), to the disk.
"""

from __future__ import annotations

import os


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (its entries: a create or a rename within it)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
