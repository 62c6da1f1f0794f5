"""`eagle3 eval-draft`: the acceptance length τ of an exported draft, measured as SGLang serves it.

For each prompt the target's greedy continuation comes from the server's `/generate`
(temperature 0, `output_ids`), and the target's auxiliary hidden states for the whole
sequence from a second request with `return_hidden_states`. Then chain speculation with
top-1 drafts is replayed exactly as SGLang's EAGLE worker runs it: the draft extends over
each newly accepted index i with the token i+1, the target's features at i and position i
(its KV cache then holds those entries only); from the last accepted index c it drafts
`depth` tokens, step k at position c+k reading its own pre-norm output of step k−1; the
target accepts the longest matching prefix and adds its own next token. τ is the mean of
(accepted + 1) over rounds: 1 is no speed-up, depth + 1 the most.

Baselines on the same prompts: a bigram table (token → most frequent next token in the
target's continuations of the *other* half of the prompts), and the same draft with its
auxiliary features zeroed (what the features contribute).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.draft.sglang import SglangDraft, load_rules, read_export
from pipeline.errors import UserError
from pipeline.extract.dataset import parse_line
from pipeline.train.target import load_target


@dataclass
class Chain:
    """Rounds of one drafter: accepted counts, and per-depth (accepted, reached)."""

    depth: int
    rounds: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reached = [0] * self.depth
        self.hits = [0] * self.depth

    def add(self, proposal: list[int], truth: list[int]) -> int:
        a = 0
        for k in range(self.depth):
            self.reached[k] += 1
            if k < len(proposal) and proposal[k] == truth[k]:
                self.hits[k] += 1
                a += 1
            else:
                break
        self.rounds.append(a)
        return a

    def summary(self) -> dict:
        n = len(self.rounds)
        return {"tau": (sum(self.rounds) / n + 1) if n else None, "rounds": n,
                "accept_by_depth": [round(h / r, 4) if r else None for h, r in zip(self.hits, self.reached, strict=True)]}


def replay(seq: list[int], start: int, depth: int, chain: Chain, propose) -> None:
    """Chain speculation over `seq` from committed index `start` (the prompt's last index)."""
    c = start
    while c + 1 + depth <= len(seq) - 1:
        proposal = propose(c)
        a = chain.add(proposal, seq[c + 2: c + 2 + depth])
        c += a + 1


class DraftProposer:
    """SGLang's draft-extend then draft-decode loop over one sequence."""

    def __init__(self, draft, seq: list[int], feats: torch.Tensor, depth: int) -> None:
        self.draft, self.seq, self.feats, self.depth = draft, seq, feats, depth
        self.done = -1  # last index extended with the target's features
        draft.reset()

    def __call__(self, c: int) -> list[int]:
        d = self.draft
        d.truncate(self.done + 1)  # forget the previous round's draft steps
        idx = torch.arange(self.done + 1, c + 1)
        tokens = torch.tensor([self.seq[i + 1] for i in idx.tolist()])
        ids, hidden = d.forward(tokens, self.feats[idx], idx)
        self.done = c
        out = [int(ids[-1])]
        h = hidden[-1:]
        for k in range(1, self.depth):
            ids, h = d.forward(torch.tensor([out[-1]]), h, torch.tensor([c + k]))
            out.append(int(ids[-1]))
        return out


def bigram_table(seqs: list[list[int]]) -> dict[int, int]:
    counts: dict[int, Counter] = defaultdict(Counter)
    for s in seqs:
        for a, b in zip(s, s[1:], strict=False):
            counts[a][b] += 1
    return {a: c.most_common(1)[0][0] for a, c in counts.items()}


def bigram_proposer(table: dict[int, int], seq: list[int], depth: int):
    def propose(c: int) -> list[int]:
        out, tok = [], seq[c + 1]
        for _ in range(depth):
            if tok not in table:
                break
            tok = table[tok]
            out.append(tok)
        return out
    return propose


def _post(client, url: str, body: dict) -> dict:
    import httpx

    try:
        r = client.post(f"{url}/generate", json=body)
    except httpx.HTTPError as exc:
        raise UserError(f"--server {url}: {type(exc).__name__}: {exc}") from None
    if r.status_code != 200:
        raise UserError(f"--server {url}: /generate answered {r.status_code}: {r.text[:200]}")
    try:
        return r.json()
    except ValueError:
        raise UserError(f"--server {url}: /generate did not answer JSON") from None


def fetch(url: str, prompt: list[int], new_tokens: int, target_hidden: int, client) -> tuple[list[int], torch.Tensor]:
    """(prompt + greedy continuation, aux features [len, 3·H]) from the server."""
    gen = _post(client, url, {"input_ids": prompt, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}})
    out = gen.get("output_ids")
    if not isinstance(out, list) or not out:
        raise UserError(f"--server {url}: /generate answered without output_ids")
    seq = prompt + [int(t) for t in out]
    hs = _post(client, url, {"input_ids": seq, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                             "return_hidden_states": True})
    rows = (hs.get("meta_info") or {}).get("hidden_states")
    if not isinstance(rows, list) or not rows or not isinstance(rows[0], list):
        raise UserError(f"--server {url}: no meta_info.hidden_states; start SGLang with --enable-return-hidden-states "
                        "and aux capture (--enable-return-aux-hidden-states --speculative-algorithm EAGLE3)")
    feats = torch.tensor(rows[0], dtype=torch.float32)
    if feats.dim() != 2 or feats.shape[0] != len(seq):
        raise UserError(f"--server {url}: {len(rows[0])} hidden rows for {len(seq)} tokens (chunked prefill? "
                        "start the server with --chunked-prefill-size above the longest sequence)")
    width = feats.shape[1]
    if width not in (3 * target_hidden, 4 * target_hidden):
        raise UserError(f"--server {url}: hidden rows are {width} wide; the draft needs 3 aux layers × "
                        f"{target_hidden} (aux capture on; {target_hidden} alone is the final layer only)")
    return seq, feats[:, : 3 * target_hidden]


def read_prompts(path: Path, n: int, length: int) -> list[list[int]]:
    prompts: list[list[int]] = []
    try:
        with open(path, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                if len(prompts) >= n:
                    break
                try:
                    ids = parse_line(raw)[0]
                except ValueError as exc:
                    raise UserError(f"--data {path}: line {lineno}: {exc}") from None
                prompts.append(ids[:length])
    except OSError as exc:
        raise UserError(f"--data {path}: {exc.strerror}") from None
    if len(prompts) < 2:
        raise UserError(f"--data {path}: needs at least 2 prompts (half learn the bigram table, half are measured)")
    return prompts


def evaluate(*, draft_dir: Path, server: str, data: Path, target_model: str | None, depth: int = 5,
             prompts: int = 64, prompt_len: int = 48, new_tokens: int = 96, say=print) -> dict:
    """τ of the draft, of the bigram table and of the draft without aux features; accuracy by depth."""
    import httpx


    try:
        cfg, tensors = read_export(draft_dir)
    except (OSError, ValueError) as exc:
        raise UserError(f"--draft {draft_dir}: not an exported draft ({exc})") from None
    embed = tensors.get("embed_tokens.weight")
    loaded, problems = load_rules(cfg, tensors)
    if problems:
        raise UserError(f"--draft {draft_dir}: SGLang would not load it: {'; '.join(problems)}")
    if embed is None:
        if not target_model:
            raise UserError("--target-model DIR is needed: the draft has no embedding (SGLang takes the target's)")

        embed = load_target(target_model, need_norm=False).embed
    draft = SglangDraft(loaded, embed)
    ps = read_prompts(Path(data), prompts, prompt_len)
    ht = int(cfg.get("target_hidden_size") or cfg["hidden_size"])
    seqs = []
    with httpx.Client(timeout=120.0) as client:
        for i, p in enumerate(ps):
            seqs.append((len(p) - 1, *fetch(server.rstrip("/"), p, new_tokens, ht, client)))
            if (i + 1) % 16 == 0:
                say(f"eval-draft: {i + 1} / {len(ps)} continuations")
    half = len(seqs) // 2
    table = bigram_table([s for _, s, _ in seqs[:half]])
    chains = {"draft": Chain(depth), "no_aux": Chain(depth), "bigram": Chain(depth)}
    with torch.inference_mode():
        for start, seq, feats in seqs[half:]:
            for name, zero in (("draft", False), ("no_aux", True)):
                draft.zero_aux = zero
                replay(seq, start, depth, chains[name], DraftProposer(draft, seq, feats, depth))
            replay(seq, start, depth, chains["bigram"], bigram_proposer(table, seq, depth))
    res = {k: v.summary() for k, v in chains.items()}
    return {"depth": depth, "prompts_measured": len(seqs) - half, "bigram_learned_from": half,
            "tau": res["draft"]["tau"], "tau_bigram": res["bigram"]["tau"], "tau_no_aux": res["no_aux"]["tau"],
            "accept_by_depth": res["draft"]["accept_by_depth"], "detail": res}


def format_result(r: dict) -> str:
    acc = ", ".join("-" if a is None else f"{a:.2f}" for a in r["accept_by_depth"])
    return (f"acceptance length τ at depth {r['depth']} (max {r['depth'] + 1}): draft {r['tau']:.2f}, "
            f"bigram table {r['tau_bigram']:.2f}, draft without aux features {r['tau_no_aux']:.2f}\n"
            f"accepted by depth (given the earlier ones): [{acc}]; {r['prompts_measured']} prompts measured, "
            f"bigram table from {r['bigram_learned_from']} others")


def main(args) -> int:
    r = evaluate(draft_dir=Path(args.draft), server=args.server, data=Path(args.data), target_model=args.target_model,
                 depth=args.depth, prompts=args.prompts, new_tokens=args.new_tokens,
                 say=(lambda _m: None) if args.json else print)
    print(json.dumps(r) if args.json else format_result(r))
    return 0
