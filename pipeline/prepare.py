"""`eagle3 prepare`: a chat dataset rendered with the target's chat template, with a loss mask over the
assistant's tokens only — the extraction's input.

Input lines: ShareGPT (`conversations`: [{"from": "human"|"gpt"|"system", "value": …}]) or OpenAI-style
(`messages`: [{"role": "user"|"assistant"|"system", "content": …}]); `--format auto` tells them apart per line.
Output lines: {"id", "input_ids", "loss_mask"} (the extraction's dataset format), written atomically, with a
sidecar `OUT.meta.json` (template hash, tokenizer, counts) that extraction records in its manifest.

The assistant spans are found by rendering, not by `{% generation %}` markers (the Llama-3.1 and Kimi
templates have none): for assistant turn i, the conversation up to turn i with the generation prompt ends
where the turn's text begins, and the conversation through turn i ends where it ends — its content and the
end-of-turn token the model must learn to emit. Where a template renders earlier turns differently once later
ones follow (a prefix is not a prefix of the whole), the turn's content is looked up in the full text after
the previous turn instead. Characters map to tokens through the tokenizer's offsets (a fast tokenizer); a slow
one (tiktoken-based remote code) is tokenized piecewise at the span boundaries, and the pieces are checked
to add up to the whole text's tokens.

SpecForge does the same job in `prepare_data.py` / `data/template.py` with per-model regexes over a
rendered text; this reads no model-specific pattern.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import UserError

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "model": "assistant", "bard": "assistant", "system": "system",
         # a tool's output (OpenAI's "tool", older "function"; ShareGPT's "observation"; Llama 3.1's "ipython"):
         # context the model reads, never trained on
         "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool"}
# what an OpenAI-style message carries besides its role and text, passed to the template as given
CARRIED = ("tool_calls", "tool_call_id", "name", "reasoning_content")
PROGRESS_EVERY_S = 2.0


class LineError(ValueError):
    """A line that cannot be prepared: counted and named, never fatal."""


def turns_of(obj, fmt: str, *, reasoning: bool = True) -> list[dict]:
    """The line's conversation as [{"role", "content", …}], roles normalised, with the tool calls, the tool call
    ids and names and the reasoning (`reasoning_content`; dropped with `reasoning=False`) an OpenAI-style message
    carries; LineError with the reason."""
    if not isinstance(obj, dict):
        raise LineError("not a JSON object")
    if fmt == "auto":
        fmt = "sharegpt" if "conversations" in obj else "messages" if "messages" in obj else ""
        if not fmt:
            raise LineError("no 'conversations' (ShareGPT) or 'messages' (OpenAI-style) list")
    key, role_key, text_key = (("conversations", "from", "value") if fmt == "sharegpt"
                               else ("messages", "role", "content"))
    items = obj.get(key)
    if not isinstance(items, list) or not items:
        raise LineError(f"'{key}' is missing or empty")
    turns = []
    for n, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise LineError(f"turn {n} is not an object")
        role = ROLES.get(str(item.get(role_key, "")).lower())
        if role is None:
            raise LineError(f"turn {n}: unknown role {item.get(role_key)!r} (expected user, assistant, system or "
                            "tool)")
        text = item.get(text_key)
        calls = item.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list) or not calls):
            raise LineError(f"turn {n}: 'tool_calls' must be a non-empty list on an assistant turn")
        if text is None and calls:
            text = ""  # an assistant turn that only calls tools (content null, as the OpenAI format writes it)
        if not isinstance(text, str):
            raise LineError(f"turn {n}: '{text_key}' is not text")
        if role == "assistant" and not text.strip() and not calls:
            raise LineError(f"turn {n}: empty assistant turn")
        turn = {"role": role, "content": text}
        turn.update({k: item[k] for k in CARRIED if item.get(k) is not None
                     and (reasoning or k != "reasoning_content")})
        turns.append(turn)
    if not any(t["role"] == "assistant" for t in turns):
        raise LineError("no assistant turn: nothing to train on")
    return turns


@dataclass
class Prepared:
    """One conversation's tokens and loss mask."""

    input_ids: list[int]
    loss_mask: list[int]
    cut: bool = False


class Renderer:
    """The target's tokenizer and chat template, and the masks they give."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.fast = bool(getattr(tokenizer, "is_fast", False))

    def render(self, turns: list[dict], *, generation_prompt: bool, tools: list | None = None) -> str:
        extra = {"tools": tools} if tools else {}
        return self.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt, **extra)

    def spans(self, turns: list[dict], *, tools: list | None = None) -> tuple[str, list[tuple[int, int]]]:
        """(rendered text, character spans of the assistant turns: their reasoning where the template renders it,
        content, tool calls and end of turn; never a tool's output, which is its own turn)."""
        full = self.render(turns, generation_prompt=False, tools=tools)
        spans, cursor = [], 0
        for i, t in enumerate(turns):
            if t["role"] != "assistant":
                continue
            before = self.render(turns[:i], generation_prompt=True, tools=tools) if i else None
            through = self.render(turns[: i + 1], generation_prompt=False, tools=tools)
            if before is not None and full.startswith(through) and through.startswith(before) and len(before) >= cursor:
                start, end = len(before), len(through)
                # a generation prompt that stops short of the header's trailing whitespace: start at the text —
                # unless the text itself begins there (a genuine leading space is the model's to learn)
                first = t.get("reasoning_content") or t["content"]
                if not (first and through.startswith(first, start)):
                    at = through.find(first.strip(), start) if first.strip() else -1
                    if at > start and not through[start:at].strip():
                        start = at
            else:  # a template that renders earlier turns differently: the content in the full text, then its tail
                content = t["content"].strip()
                if not content:
                    raise LineError(f"assistant turn {i + 1}: the template renders earlier turns differently and "
                                    "this one has no text to find them by (a tool call only)")
                start = full.find(content, cursor)
                if start < 0:
                    raise LineError(f"assistant turn {i + 1}: its text is not in the rendered conversation "
                                    "(does the template rewrite it?)")
                end = start + len(content)
                tail = through[through.rfind(content) + len(content):] if content in through else ""
                if tail and full.startswith(tail, end):
                    end += len(tail)
            # whitespace the template writes after the end-of-turn token (ChatML's "<|im_end|>\n") is the layout
            # between turns, not what the model emits: it stops at the end-of-turn token
            while end > start and full[end - 1].isspace():
                end -= 1
            if end > start:
                spans.append((start, end))
            cursor = max(cursor, end)
        return full, spans

    def tokens(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """Token ids of `text` and a mask: 1 on every token that overlaps an assistant span."""
        if self.fast:
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(enc["input_ids"])
            mask = [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]]
            return ids, mask
        # a slow tokenizer has no offsets: tokenize the pieces between span boundaries, and check that they
        # add up to the whole (special tokens at the boundaries make them so on chat templates)
        cuts = sorted({0, len(text), *(p for s in spans for p in s)})
        ids, mask = [], []
        for a, b in zip(cuts, cuts[1:], strict=False):
            piece = self.tok.encode(text[a:b], add_special_tokens=False)
            inside = any(s <= a and b <= e for s, e in spans)
            ids += piece
            mask += [int(inside)] * len(piece)
        if ids != self.tok.encode(text, add_special_tokens=False):
            raise LineError("the tokenizer joins tokens across an assistant boundary (no offsets to map it): use "
                            "the model's fast tokenizer (tokenizer.json)")
        return ids, mask

    def prepare(self, turns: list[dict], *, max_length: int | None, tools: list | None = None) -> Prepared:
        text, spans = self.spans(turns, tools=tools)
        ids, mask = self.tokens(text, spans)
        cut = max_length is not None and len(ids) > max_length
        if cut:
            ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            raise LineError("no assistant token left" + (f" within --max-length {max_length}" if cut else ""))
        return Prepared(ids, mask, cut)

    def end_of_turn_ids(self) -> list[int]:
        """The tokens that end an assistant turn, read off the template (never off the data, where a turn cut by
        --max-length ends on ordinary content): the last trained token of a probe conversation's answer, and the
        tokenizer's end of sequence when it is another token. `regenerate` stops the target's answers at them."""
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
        text, spans = self.spans(probe)
        ids, mask = self.tokens(text, spans)
        trained = [t for t, m in zip(ids, mask, strict=True) if m]
        special = set(getattr(self.tok, "all_special_ids", None) or [])
        out = [trained[-1]] if trained and trained[-1] in special else []
        eos = getattr(self.tok, "eos_token_id", None)
        if isinstance(eos, int) and eos not in out:
            out.append(eos)
        return out

    def show(self, p: Prepared) -> str:
        """The tokens, those trained on in ⟦…⟧."""
        out, inside = [], False
        for tid, m in zip(p.input_ids, p.loss_mask, strict=True):
            if m and not inside:
                out.append("⟦")
            elif not m and inside:
                out.append("⟧")
            inside = bool(m)
            out.append(self.tok.decode([tid]))
        return "".join(out) + ("⟧" if inside else "")


def load_tokenizer(path: str, *, trust_remote_code: bool):
    """The target's tokenizer from its local directory (never the network); one-line errors."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"--target-model {path}: not a directory (give the target's Hugging Face directory)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError("eagle3 prepare needs transformers: pip install 'eagle3-ops[prepare]'") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "trust_remote_code" in str(exc) and not trust_remote_code:
            raise UserError(f"--target-model {path}: its tokenizer is the model's own code; pass --trust-remote-code "
                            "to run it") from None
        raise UserError(f"--target-model {path}: cannot load its tokenizer ({exc})") from None
    except (OSError, ImportError) as exc:
        raise UserError(f"--target-model {path}: cannot load its tokenizer ({type(exc).__name__}: {exc})") from None
    if not getattr(tok, "chat_template", None):
        raise UserError(f"--target-model {path}: its tokenizer has no chat template (tokenizer_config.json "
                        "chat_template, or chat_template.jinja)")
    return tok


@dataclass
class Summary:
    conversations: int = 0
    tokens: int = 0
    assistant_tokens: int = 0
    cut: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason → count
    first_skipped: list[str] = field(default_factory=list)  # "line N: reason", the first few

    def skip(self, n: int, reason: str, kind: str) -> None:
        self.skipped[kind] += 1
        if len(self.first_skipped) < 10:
            self.first_skipped.append(f"line {n}: {reason}")

    def line(self) -> str:
        share = 100.0 * self.assistant_tokens / self.tokens if self.tokens else 0.0
        text = (f"prepare: {self.conversations:,} conversations, {self.tokens:,} tokens, {share:.1f} % of them "
                f"assistant tokens (trained on); {self.cut:,} cut to --max-length; "
                f"{sum(self.skipped.values()):,} line(s) skipped")
        return text + ("" if not self.skipped else " (" + "; ".join(f"{n} × {r}" for r, n in
                                                                    self.skipped.most_common(5)) + ")")


def refuse_json_array(data: Path) -> None:
    """A file holding one JSON array (`[{…}, {…}]`, over one line or many) is not JSON lines: said in one line,
    with the way to convert it, instead of "not JSON" for each of its lines."""
    with open(data, "rb") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith(b"[") and not head.startswith(b"[]"):
        raise UserError(f"--data {data}: a JSON array, not JSON lines; give JSONL, one conversation a line, e.g. "
                        f"`jq -c '.[]' {data} > {data.with_suffix('.jsonl')}`")


def prepare(*, target_model: str, data: Path, out: Path, fmt: str = "auto", max_length: int | None = None,
            system: str | None = None, trust_remote_code: bool = False, show: int = 0, reasoning: bool = True,
            say=None) -> Summary:
    """Render, mask and write every line of `data` into `out` (atomically) and `out`.meta.json."""
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    if not data.is_file():
        raise UserError(f"--data {data}: no such file")
    refuse_json_array(data)
    renderer = Renderer(load_tokenizer(target_model, trust_remote_code=trust_remote_code))
    total_bytes = data.stat().st_size or 1
    s = Summary()
    preview = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    last = time.monotonic()
    try:
        with open(data, "rb") as src, open(tmp, "w") as dst:
            for n, raw in enumerate(src, 1):
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw)
                    turns = turns_of(obj, fmt, reasoning=reasoning)
                    tools = obj.get("tools")
                    if tools is not None and not isinstance(tools, list):
                        raise LineError("'tools' is not a list of tool definitions")
                    if system is not None and turns[0]["role"] != "system":
                        turns = [{"role": "system", "content": system}, *turns]
                    p = renderer.prepare(turns, max_length=max_length, tools=tools)
                except LineError as exc:
                    s.skip(n, str(exc), str(exc).split(": ", 1)[-1] if str(exc).startswith("turn ") else str(exc))
                    continue
                except ValueError as exc:
                    s.skip(n, f"not JSON ({exc})", "not JSON")
                    continue
                except Exception as exc:  # noqa: BLE001 - a template error on one conversation
                    s.skip(n, f"the chat template failed ({type(exc).__name__}: {exc})", "the chat template failed")
                    continue
                sid = obj.get("id", f"line-{n}")
                dst.write(json.dumps({"id": str(sid), "input_ids": p.input_ids, "loss_mask": p.loss_mask}) + "\n")
                s.conversations += 1
                s.tokens += len(p.input_ids)
                s.assistant_tokens += sum(p.loss_mask)
                s.cut += int(p.cut)
                if s.conversations == 1:  # what the channel is shown before anything is extracted from it
                    preview = {"id": str(sid), "line": n, "tokens": len(p.input_ids), "trained": sum(p.loss_mask),
                               "text": _clip_preview(renderer.show(p))}
                if s.conversations <= show:
                    say(f"--- conversation {sid} (line {n}): {len(p.input_ids)} tokens, trained on those in ⟦…⟧\n"
                        f"{renderer.show(p)}")
                if time.monotonic() - last >= PROGRESS_EVERY_S:
                    last = time.monotonic()
                    say(f"prepare: line {n:,} ({100.0 * src.tell() / total_bytes:.0f} % of {data.name}), "
                        f"{s.conversations:,} conversations")
            dst.flush()
            os.fsync(dst.fileno())
        if not s.conversations:
            raise UserError(f"--data {data}: no line could be prepared" +
                            (f" (first: {s.first_skipped[0]})" if s.first_skipped else ""))
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    meta = {"tokenizer": str(Path(target_model).resolve()), "tokenizer_class": type(renderer.tok).__name__,
            "chat_template_sha256": hashlib.sha256(renderer.tok.chat_template.encode()).hexdigest(),
            "format": fmt, "max_length": max_length, "system": system, "source": str(data.resolve()),
            "reasoning": "kept where the template renders it" if reasoning else "dropped (--drop-reasoning)",
            "conversations": s.conversations, "tokens": s.tokens, "assistant_tokens": s.assistant_tokens,
            "cut": s.cut, "skipped": sum(s.skipped.values()), "end_of_turn_ids": renderer.end_of_turn_ids(),
            "preview": preview}
    meta_path = meta_path_of(out)
    meta_tmp = meta_path.with_name(f".{meta_path.name}.tmp-{os.getpid()}")
    meta_tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(meta_tmp, meta_path)
    for line in s.first_skipped:
        say(f"prepare: skipped {line}")
    say(s.line())
    say(f"prepare: wrote {out} and {meta_path.name}; next: eagle3 extract --data {out} …")
    return s


PREVIEW_CHARS = 2500  # a Slack code block shows this much readably


def _clip_preview(text: str) -> str:
    """The first conversation as `--show` prints it, cut to PREVIEW_CHARS (its start is where masks go wrong)."""
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + " …"


def meta_path_of(data: Path) -> Path:
    """The sidecar of a prepared dataset: OUT.meta.json beside OUT."""
    return data.with_name(data.name.removesuffix(".jsonl") + ".meta.json")


def read_meta(data: Path) -> dict | None:
    """The sidecar's content, when `data` was written by prepare (None otherwise or when unreadable)."""
    try:
        meta = json.loads(meta_path_of(data).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None
