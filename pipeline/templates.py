"""The configuration `eagle3 init` writes: a commented production template."""

import sys
from pathlib import Path


def production_template(bin_dir: str | None = None) -> str:
    """The template with stage commands at absolute paths (`bin_dir`: this install's bin,
    where `eagle3` and `torchrun` live): a service's PATH holds neither."""
    return PRODUCTION_TEMPLATE.replace("{BIN}", bin_dir or str(Path(sys.executable).parent))


PRODUCTION_TEMPLATE = """\
# eagle3-ops configuration — an 8-GPU host: SGLang server, hidden-state extraction,
# 4-GPU torchrun training. Replace every <PLACEHOLDER>; a stage whose settings still
# hold one refuses to start and names the key; `eagle3 serve` refuses while any is left.
# `eagle3 check-config` validates this file. Stage commands are absolute paths: under
# systemd the service's PATH holds neither the venv's `eagle3` nor its `torchrun`.
# Relative paths are relative to this file. Secrets (SLACK_BOT_TOKEN, SLACK_APP_TOKEN,
# SLACK_SIGNING_SECRET) come from the environment only, never from this file.

[state]
dir = ".eagle3"              # store and stage logs
log_max_bytes = 100_000_000  # rotate a stage log past this size
log_keep = 3

[monitor]
tick_s = 10                  # seconds between observations
stall_floor_s = 60           # shortest silence that may count as a stall

[handoff]
max_failed_share = 0.001     # 0.1 % failed samples still counts as complete
server_stop_grace_s = 60     # SIGTERM, then SIGKILL after this long

[slack]
channel = "<SLACK_CHANNEL_ID>"
allowed_user_ids = []        # who may start, stop, arm auto-start (empty: nobody)
allowed_channel_ids = []     # where the bot answers (empty: anywhere)
oncall_user_ids = []         # @-mentioned on alerts
post_interval_min = 30
redact_patterns = ["hf_[A-Za-z0-9]{20,}"]  # also masked in log excerpts posted to Slack

[stages.server]
# sglang lives in its own environment on the GPU host (it pins its own torch).
# --enable-return-hidden-states: hidden states over HTTP; the aux-capture flags make
# them the 3 EAGLE-3 auxiliary layers; the radix cache must be off (a prefix hit
# returns only uncached rows); chunked prefill must cover the longest sample.
argv = ["<SGLANG_VENV>/bin/python", "-m", "sglang.launch_server",
        "--model-path", "<MODEL_PATH>", "--tp", "8", "--port", "30000",
        "--enable-return-hidden-states", "--enable-return-aux-hidden-states",
        "--speculative-algorithm", "EAGLE3", "--disable-radix-cache",
        "--chunked-prefill-size", "32768", "--enable-metrics"]
gpus = [0, 1, 2, 3, 4, 5, 6, 7]
url = "http://127.0.0.1:30000"
port = 30000
restart = "on-failure"
max_restarts = 3

[stages.extract]
argv = ["{BIN}/eagle3", "extract", "--server", "http://127.0.0.1:30000",
        "--data", "<DATA_JSONL>", "--out", "<EXTRACT_OUT>", "--concurrency", "32"]
data = "<DATA_JSONL>"
out = "<EXTRACT_OUT>"
restart = "on-failure"

[stages.train]
# --token-budget: padded tokens per batch per GPU; 4096 on 80–96 GB GPUs at H = 7,168 (Kimi-K2.5), 8192 for
# Llama-3.1-8B on 80 GB (README: settings for real targets). Other flags: --lr 1e-4, --warmup-ratio 0.015
# (then cosine), --max-grad-norm 0.5, --grad-accum 1, --max-length 2048, --seed 0, --save-every 50, --eval-every 0
# (at the end), --log-every 1, --keep-last 3, --keep-previous 2, --skip-bad; training resumes by default, --fresh
# starts over, --resume refuses (rather than moves aside) a checkpoint of another shape (docs/operator.md).
argv = ["{BIN}/torchrun", "--standalone", "--nproc-per-node", "4", "-m", "pipeline.train",
        "--data", "<EXTRACT_OUT>", "--target-model", "<MODEL_PATH>", "--out", "<CKPT_DIR>",
        "--steps", "<STEPS>", "--token-budget", "4096"]
gpus = [0, 1, 2, 3]
out = "<CKPT_DIR>"
"""
