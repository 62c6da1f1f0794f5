#!/usr/bin/env bash
# Issue 32: τ of the toy draft trained and evaluated with rope_scaling {llama3, factor 8, original 32}, against the
# same run without it (demo settings, 2-process CPU training, 200 steps). SRC: a toy extraction holding out/,
# target/ and d.jsonl (the suite's toy-extraction fixture, or `eagle3 toy-server --export-target` + `eagle3
# extract`); W: a scratch directory. Prints eval-draft's JSON for each.
set -e
export SRC=${1:?toy extraction directory (out/, target/, d.jsonl)} W=${2:-/tmp/rope-tau}
cd "$(dirname "$0")/.."
P=.venv/bin/python
mkdir -p "$W" && rm -rf "$W"/t_scaled "$W"/ck_* && cp -r "$SRC/target" "$W/t_scaled"
$P -c 'import json, os; p = os.environ["W"] + "/t_scaled/config.json"; c = json.load(open(p)); c["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32, "low_freq_factor": 1.0, "high_freq_factor": 4.0}; json.dump(c, open(p, "w"))'
for v in plain scaled; do
  T="$SRC/target"; [ $v = scaled ] && T="$W/t_scaled"
  CUDA_VISIBLE_DEVICES="" $P -m torch.distributed.run --standalone --nproc-per-node 2 -m pipeline.train \
    --data "$SRC/out" --target-model "$T" --out "$W/ck_$v" --steps 200 --lr 1e-2 --ttt 5 --token-budget 1024 \
    --save-every 1000 --schedule constant --warmup-ratio 0.05 --max-grad-norm 1.0 > "$W/train_$v.log" 2>&1
done
$P - <<'PY'
import os, subprocess
from pipeline.toy.launch import ToyServer
src, w = os.environ["SRC"], os.environ["W"]
s = ToyServer()
try:
    for v in ("plain", "scaled"):
        target = f"{src}/target" if v == "plain" else f"{w}/t_scaled"
        r = subprocess.run([".venv/bin/python", "-m", "bot.cli", "eval-draft", "--draft", f"{w}/ck_{v}/draft", "--server",
                            s.url, "--data", f"{src}/d.jsonl", "--target-model", target, "--depth", "5", "--json"],
                           capture_output=True, text=True)
        print(v, r.stdout.strip() or r.stderr.strip())
finally:
    s.stop()
PY
