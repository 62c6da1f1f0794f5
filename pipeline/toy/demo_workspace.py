"""`eagle3 init --demo DIR`: a self-contained toy pipeline (every path inside DIR).

The toy server as `server`, extraction of a generated dataset as `extract`, and
2-process CPU torchrun training as `train` — each runnable by hand.
"""

from __future__ import annotations

import json
import random
import socket
import sys
from pathlib import Path
from typing import Any

from pipeline.prepare import prepare

SAMPLES = 300
TRAIN_STEPS = 200  # about 40 s of 2-process CPU training at 1,024 tokens a batch: τ ≈ 4.0 at depth 5 on the toy target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


EOT = 255  # the toy conversations' end-of-turn token, <|im_end|> (regenerate stops a turn at it)


def _words(rng: random.Random, low: int, high: int) -> str:
    """Lower-case words of 2–7 letters, low–high characters in all."""
    text: list[str] = []
    size = rng.randint(low, high)
    while sum(map(len, text)) + len(text) < size:
        text.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))))
    return " ".join(text)


def write_chat(path: Path, n: int = SAMPLES, *, seed: int = 7) -> None:
    """n ShareGPT conversations in the toy target's characters (a system prompt on every third, two user →
    assistant exchanges each): what `eagle3 prepare` reads."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(n):
            turns = [{"from": "system", "value": "Answer in a few words."}] if i % 3 == 0 else []
            for _ in range(2):
                turns += [{"from": "human", "value": _words(rng, 16, 96)}, {"from": "gpt", "value": _words(rng, 8, 32)}]
            fh.write(json.dumps({"id": f"demo-{i}", "conversations": turns}) + "\n")


def write_dataset(path: Path, n: int = SAMPLES, *, seed: int = 7, turns: bool = False) -> int:
    """n samples of toy token ids, 32–256 tokens each; returns the token total. With `turns`, each is a
    conversation as `eagle3 prepare` writes it: user tokens, then an assistant turn ending with EOT, twice,
    with loss_mask 1 on the assistant's tokens (what `eagle3 regenerate` reads)."""
    rng = random.Random(seed)
    total = 0
    with open(path, "w") as fh:
        for i in range(n):
            if turns:
                ids: list[int] = []
                mask: list[int] = []
                for _ in range(2):
                    user = [rng.randrange(EOT) for _ in range(rng.randint(16, 96))]
                    answer = [rng.randrange(EOT) for _ in range(rng.randint(8, 32))] + [EOT]
                    ids, mask = ids + user + answer, mask + [0] * len(user) + [1] * len(answer)
                line = {"id": f"demo-{i}", "input_ids": ids, "loss_mask": mask}
            else:
                ids = [rng.randrange(256) for _ in range(rng.randint(32, 256))]
                line = {"id": f"demo-{i}", "input_ids": ids}
            total += len(ids)
            fh.write(json.dumps(line) + "\n")
    return total


def config_text(*, python: str, port: int, steps: int = TRAIN_STEPS, regenerate: bool = False) -> str:
    """The demo workspace's eagle3.toml (with `regenerate`: a regeneration stage before extraction, whose
    output the extraction reads)."""
    url = f"http://127.0.0.1:{port}"
    server = [python, "-m", "bot.cli", "toy-server", "--port", str(port)]
    data = "regenerated.jsonl" if regenerate else "data.jsonl"
    extract = [python, "-m", "bot.cli", "extract", "--server", url, "--data", data, "--out", "out",
               "--concurrency", "4", "--server-wait", "120"]
    # sampled, not greedy: every conversation's answer starts after the same "<|im_start|>assistant\n", and the toy
    # target's next token depends on the last two, so its greedy answers are all one sequence (τ 1.03, measured)
    regen = [python, "-m", "bot.cli", "regenerate", "--server", url, "--data", "data.jsonl", "--out", data,
             "--concurrency", "4", "--max-new-tokens", "24", "--temperature", "0.8", "--server-wait", "120"]
    train = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "pipeline.train",
             "--data", "out", "--target-model", "target", "--out", "ckpt", "--steps", str(steps),
             "--lr", "1e-2", "--ttt", "5", "--token-budget", "1024", "--save-every", "100",
             # the toy's own settings (the defaults are a real draft's: 1e-4, cosine, clip 0.5)
             "--schedule", "constant", "--warmup-ratio", "0.05", "--max-grad-norm", "1.0"]
    restarting: dict[str, Any] = {"restart": "on-failure", "restart_backoff_s": 1}
    sections = [
        _section("monitor", tick_s=1, stall_floor_s=30, fake_gpus=2,
                 notes={"fake_gpus": "scripted idle GPUs in place of NVML"}),
        _section("handoff", server_stop_grace_s=10, gpu_release_timeout_s=60, settle_s=1, verify_sample=50),
        _section("stages.server", argv=server, url=url, port=port, max_restarts=3, **restarting),
        _section("stages.regenerate", argv=regen, data="data.jsonl", out=data, **restarting,
                 notes={"argv": "the toy target answers each conversation's assistant turns again; auto-start then "
                                "starts extraction"}) if regenerate else "",
        _section("stages.extract", argv=extract, data=data, out="out", **restarting),
        _section("stages.train", argv=train, out="ckpt",
                 env={"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
                      "CUDA_VISIBLE_DEVICES": ""},
                 notes={"env": "the toy trains on the CPU whatever GPUs the host has (a 2-process run on a 1-GPU "
                               "host would ask for cuda:1)"}),
    ]
    return "# eagle3-ops demo workspace: the toy pipeline on this machine's CPU.\n" + "\n".join(s for s in sections if s)


def _section(title: str, *, notes: dict[str, str] | None = None, **fields) -> str:
    """One TOML table: `[title]`, then `key = value` for each field (strings and lists as JSON writes them, which
    TOML reads alike; a dict as an inline table), each after its comment line in `notes`, if any."""
    def value(v) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {json.dumps(x)}" for k, x in v.items()) + " }"
        return json.dumps(v)
    lines, notes = [f"[{title}]"], notes or {}
    for k, v in fields.items():
        lines += ([f"# {notes[k]}"] if k in notes else []) + [f"{k} = {value(v)}"]
    return "\n".join(lines) + "\n"


def write_demo_workspace(directory: Path, *, steps: int = TRAIN_STEPS, regenerate: bool = False,
                         samples: int = SAMPLES, say=None) -> Path:
    """Write data, the toy target's HF directory and eagle3.toml into `directory`; returns the config path.
    With `regenerate`, the data starts as a ShareGPT chat file (chat.jsonl) that `eagle3 prepare` renders with
    the toy target's tokenizer and chat template into data.jsonl, as an operator's would."""
    from pipeline.toy.model import export_target

    directory.mkdir(parents=True, exist_ok=True)
    export_target(directory / "target")
    if regenerate:
        write_chat(directory / "chat.jsonl", samples)
        prepare(target_model=str(directory / "target"), data=directory / "chat.jsonl",
                out=directory / "data.jsonl", say=say or (lambda _m: None))
    else:
        write_dataset(directory / "data.jsonl", samples)
    cfg = directory / "eagle3.toml"
    cfg.write_text(config_text(python=sys.executable, port=_free_port(), steps=steps, regenerate=regenerate))
    return cfg
