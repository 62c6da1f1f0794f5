"""Files other users read (drafts, checkpoints, hidden states) get the mode the umask allows.

safetensors' writer creates its files 0600 whatever the umask, and a file made by
`tempfile.mkstemp` is 0600 too: an SGLang server running as another user could not load the
draft. `honour_umask` gives such a file the mode `open()` would have: 0666 less the umask.
"""

from __future__ import annotations

import os


def umask() -> int:
    """This process's umask, read without changing it (Linux's /proc, a few µs; elsewhere os.umask's
    set-and-restore)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def honour_umask(path: str | os.PathLike, *, executable: bool = False) -> None:
    """chmod `path` to 0666 (0777 with `executable`) less the umask."""
    os.chmod(path, (0o777 if executable else 0o666) & ~umask())
