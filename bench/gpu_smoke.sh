#!/usr/bin/env bash
# GPU smoke check for a machine with NVIDIA GPUs: real NVML readings through the probe
# and one sampler tick, printed as JSON. Run from the repository root after `make setup`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=index,name,utilization.gpu,memory.used,power.draw --format=csv || true
"$PY" - <<'PY'
import json, tempfile, time
from pathlib import Path
from pipeline.observe.probes.gpu import GpuProbe
from pipeline.config import Workspace, parse_config
from pipeline.observe.sampler import Sampler
from pipeline.store import Store

probe = GpuProbe()
first = probe.read()
print("probe, first read:", json.dumps(first.value or {"unknown": first.unknown}, indent=1))
time.sleep(2)
second = probe.read()
print("probe, second read (util averaged over the 2 s since the first):",
      json.dumps(second.value or {"unknown": second.unknown}, indent=1))
with tempfile.TemporaryDirectory() as tmp:
    cfg = Path(tmp) / "eagle3.toml"
    cfg.write_text('[stages.extract]\nargv = ["sleep", "30"]\n')
    ws = Workspace(config=parse_config(cfg.read_text(), name="eagle3.toml"), path=cfg)
    from pipeline.controller import Controller
    ctl = Controller(workspace=ws)
    ctl.start("extract")
    sampler = Sampler(ws=ws, store=ctl.store)
    obs, verdict = sampler.tick()["extract"]
    print("sampler tick, extract observation gpus:", json.dumps(obs.get("gpus"), indent=1))
    print("unknown:", obs.get("unknown"))
    sampler.close()
    ctl.stop_all(grace_s=2)
    ctl.close()
PY
