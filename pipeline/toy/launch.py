"""Starting the toy SGLang-compatible server as a subprocess (port 0, real HTTP on loopback): tests and benchmarks."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class ToyServer:
    """A running toy server (`python -m pipeline.toy.server`, the same as `eagle3 toy-server`)."""

    def __init__(self, *flags: str, port: int = 0) -> None:
        self.flags = flags
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.toy.server", "--port", str(port), *flags],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None  # stdout=PIPE
        self.out = self.proc.stdout
        line = self.out.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"toy server did not start: {line}{self.out.read()}")
        self.url = line.split("listening on ")[1].split()[0]
        self.port = int(self.url.rsplit(":", 1)[1])

    def metric(self, name: str) -> float:
        import httpx

        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + "{"):
                return float(line.split()[-1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.out.close()


def write_dataset(path: Path, n: int, *, seed: int = 0, lo: int = 16, hi: int = 200, bad_lines: tuple = ()) -> list:
    """n samples of random token ids; `bad_lines` indices hold malformed lines. Returns the ids (None if bad)."""
    rng = random.Random(seed)
    samples: list[list[int] | None] = []
    with open(path, "w") as fh:
        for i in range(n):
            if i in bad_lines:
                fh.write('{"input_ids": "oops"}\n')
                samples.append(None)
                continue
            ids = [rng.randrange(256) for _ in range(rng.randint(lo, hi))]
            samples.append(ids)
            fh.write(json.dumps({"id": f"s{i}", "input_ids": ids}) + "\n")
    return samples
