"""One answer to one sample file: parse, validate, convert and write (the CPU-heavy half of extraction).

The same function runs in the client's threads (`--parse-workers 0`) and in the parse worker
processes (`pipeline.extract.parse_worker`), so both paths write the same bytes. It needs nothing
of the client's state but the row width already seen (every answer of a run must match it).
"""

from __future__ import annotations

import errno
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.draft.capture import SERVER_IDS
from pipeline.extract import fastparse
from pipeline.extract.preflight import Plan
from pipeline.extract.response import BadResponse, check_rows, prefill_rows, topk_rows
from pipeline.extract.writer import sample_path, tensors_for, write_sample

DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES}
LAYER_CONVENTION = SERVER_IDS  # layer_ids exactly as the server reported them (pipeline/draft/capture.py)


class DiskError(Exception):
    """The output cannot be written: the run stops, resumable once fixed."""


@dataclass(frozen=True)
class StoreSpec:
    """What storing needs from the run's options and the server's plan (JSON-able, for the workers)."""

    out: Path
    mode: str
    parser: str
    dtype: str
    dump_field: str
    plan: Plan

    def to_json(self) -> dict:
        return {"out": str(self.out), "mode": self.mode, "parser": self.parser, "dtype": self.dtype,
                "dump_field": self.dump_field, "plan": asdict(self.plan)}

    @classmethod
    def from_json(cls, d: dict) -> StoreSpec:
        return cls(out=Path(d["out"]), mode=d["mode"], parser=d["parser"], dtype=d["dtype"],
                   dump_field=d["dump_field"], plan=Plan(**d["plan"]))


@dataclass(frozen=True)
class Stored:
    """A sample written: its file's size, the row width its answer had, and the answer's size."""

    nbytes: int
    width: int
    answer_bytes: int
    topk_mass: float | None = None  # the target probability the stored top-K holds, averaged over positions


def store_answer(spec: StoreSpec, box: list, *, idx: int, ids: list[int], sid: str | None,
                 loss_mask: list[int] | None, width: int | None) -> Stored:
    """Parse the answer taken out of `box` (so that its text is freed as soon as it is parsed),
    check it against the sample and the run's row width, and write the sample's file.
    Raises BadResponse (the answer is unusable) or DiskError (the output is not writable)."""
    p = spec.plan
    content = box.pop()
    fast = None
    if spec.mode != "dump" and spec.parser == "fast":
        try:
            fast = fastparse.split(content)
        except ValueError:  # the rest of the answer is not JSON: json.loads below says so
            fast = None
    try:
        answer = fast[0] if fast else json.loads(content)
        meta = answer["meta_info"]
    except (ValueError, KeyError, TypeError):
        raise BadResponse("the server's answer is not SGLang's /generate JSON") from None
    size = len(content)
    del content  # the answer's text is no longer needed: its memory goes back before the write
    rows = fast[1] if fast else _rows(spec, meta)
    seen = check_rows(rows, seq=len(ids), layers=p.layers, width=width, chunk=p.chunk)
    topk = topk_rows(meta, seq=len(ids), k=p.topk) if p.topk else None
    tensors = tensors_for(token_ids=ids, rows=rows, layers=p.layers, dtype=spec.dtype, topk=topk, loss_mask=loss_mask)
    metadata = {"model": p.model, "layer_ids": json.dumps(p.layer_ids), "layer_convention": LAYER_CONVENTION,
                "final_layer": "present" if p.final_present else "absent", "id": "" if sid is None else sid}
    try:
        nbytes = write_sample(sample_path(spec.out, idx), tensors, metadata)
    except OSError as exc:
        if exc.errno in DISK_ERRNOS:
            raise DiskError(f"cannot write {spec.out / 'hidden_states'}: {exc.strerror}; free space or fix "
                            "permissions, then run the same command to resume") from None
        raise
    finally:
        _drop_dump(spec, meta)
    return Stored(nbytes=nbytes, width=seen, answer_bytes=size, topk_mass=captured_mass(topk[1]) if topk else None)


def captured_mass(logprobs: list) -> float:
    """The mean over positions of Σ exp(logprob) of the stored top-K: how much of the target's distribution the
    training target holds (1.0: all of it)."""
    import numpy as np

    lp = np.asarray(logprobs, dtype=np.float64)
    return float(np.exp(lp).sum(axis=-1).mean()) if lp.size else 1.0


def _rows(spec: StoreSpec, meta: dict) -> list:
    if spec.mode != "dump":
        return prefill_rows(meta)
    from safetensors.torch import load_file

    path = meta.get(spec.dump_field)
    if not isinstance(path, str):
        raise BadResponse(f"dump mode: meta_info.{spec.dump_field} missing")
    try:
        hs = load_file(path)["hidden_states"]
    except (OSError, KeyError, Exception) as exc:  # noqa: BLE001 - any unreadable dump is a bad answer
        raise BadResponse(f"dump file {path} unreadable ({type(exc).__name__})") from None
    return hs.reshape(hs.shape[0], -1).float().tolist()


def _drop_dump(spec: StoreSpec, meta: dict) -> None:
    path = meta.get(spec.dump_field) if spec.mode == "dump" else None
    if isinstance(path, str):
        Path(path).unlink(missing_ok=True)
