"""`eagle3 export CHECKPOINT --out DIR`: a training checkpoint as SGLang's EAGLE-3 draft directory.

config.json (LlamaForCausalLMEagle3) and model.safetensors with exactly the names SGLang
0.5.23 loads. The output is checked with SGLang's own load rules (`pipeline.draft.sglang`)
before it is moved into place; a problem refuses the export, naming each.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pipeline.draft.capture import AUX_IDS_EAGLE_CONFIG
from pipeline.draft.format import ARCH, NAMES
from pipeline.durable import fsync_path
from pipeline.errors import UserError
from pipeline.fileperm import honour_umask


def resolve_checkpoint(path: Path) -> Path:
    """A step directory, or a training --out directory (its `latest`)."""
    path = Path(path)
    if (path / "latest").exists():
        step = (path / "latest").read_text().strip()
        path = path / "checkpoints" / step
    if not (path / "model.safetensors").exists():
        raise UserError(f"{path}: no model.safetensors: give a training --out directory or one of its "
                        "checkpoints/step_N directories")
    return path


def sglang_config(cfg: dict) -> dict:
    """config.json for SGLang from the trainer's draft config."""
    from pipeline.draft import rope  # torch: only where a draft is exported

    out = {"architectures": [ARCH], "model_type": "llama", "num_hidden_layers": 1,
           "hidden_size": cfg["hidden_size"], "num_attention_heads": cfg["num_attention_heads"],
           "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
           "intermediate_size": cfg["intermediate_size"], "hidden_act": "silu", "rms_norm_eps": cfg["rms_norm_eps"],
           "max_position_embeddings": cfg["max_position_embeddings"], "rope_theta": cfg["rope_theta"],
           "rope_scaling": rope.normalise(cfg.get("rope_scaling")), "vocab_size": cfg["vocab_size"],
           "draft_vocab_size": cfg["draft_vocab_size"], "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    if cfg["target_hidden_size"] != cfg["hidden_size"]:
        out["target_hidden_size"] = cfg["target_hidden_size"]
    ids = cfg.get("aux_layer_ids") or []  # empty when the extraction used the server's default layers
    if ids and cfg.get("aux_ids") != AUX_IDS_EAGLE_CONFIG:  # an older checkpoint: layer inputs (Llama's + 1 undone)
        ids = [i - 1 for i in ids]
    if ids:  # the ids the extraction's server was given: the same model maps them to the same layers
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True}
    if cfg.get("train_max_length"):  # the context guard's record (SGLang reads no such key)
        out[TRAIN_MAX_LENGTH_KEY] = int(cfg["train_max_length"])
    return out


TRAIN_MAX_LENGTH_KEY = "eagle3_train_max_length"


def context_warning(draft: Path, *, served_context: int | None = None) -> str | None:
    """A warning when the target serves contexts longer than the draft was trained on (`served_context`, else
    the target's max_position_embeddings the draft's config carries): past its training length a draft's
    acceptance falls, and speculation can end up slower than none."""
    config = json.loads((Path(draft) / "config.json").read_text())
    trained = config.get(TRAIN_MAX_LENGTH_KEY)
    served = served_context or config.get("max_position_embeddings")
    if not isinstance(trained, int) or not isinstance(served, int) or served <= trained:
        return None
    return (f"WARNING: the draft was trained on samples of up to {trained:,} tokens and the target serves contexts "
            f"of up to {served:,}: past {trained:,} tokens its acceptance falls, and speculation can be slower than "
            "none; train with a larger --max-length (and --token-budget) on long data, or cap the served context")


def export_checkpoint(checkpoint: Path, out: Path, *, with_embeddings: Path | None = None) -> Path:
    """Write SGLang's layout (bf16 weights) into `out` (atomically: a temp dir, checked, then renamed)."""
    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.draft.sglang import check_export

    dtype = torch.bfloat16
    from pipeline.train.checkpoint import read_config

    step = resolve_checkpoint(checkpoint)
    cfg = read_config(step)
    state = load_file(str(step / "model.safetensors"))
    unknown = sorted(set(state) - set(NAMES))
    missing = sorted(set(NAMES) - set(state))
    if missing or unknown:
        raise UserError(f"{step}: not an SGLang-layout checkpoint (missing {missing or 'none'}, unknown "
                        f"{unknown or 'none'}); it must be retrained")
    tensors = {k: (v if v.dtype in (torch.int64, torch.bool) else v.to(dtype)).contiguous() for k, v in state.items()}
    if with_embeddings is not None:
        from pipeline.train.target import load_target

        tensors["embed_tokens.weight"] = load_target(str(with_embeddings), need_norm=False).embed.to(dtype).contiguous()
    config = sglang_config(cfg)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        honour_umask(tmp / "model.safetensors")  # SGLang may run as another user
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        problems = check_export(tmp)
        if problems:
            raise UserError(f"export refused: SGLang would not load it: {'; '.join(problems)}")
        for path in (tmp / "model.safetensors", tmp / "config.json", tmp):  # on the disk before it is the draft
            fsync_path(path)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        fsync_path(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tp_line(draft: Path) -> str:
    """Which tensor-parallel sizes SGLang loads the exported draft at, and why not at the others (a warning)."""
    from pipeline.draft.sglang import tp_summary

    ok, refused = tp_summary(json.loads((Path(draft) / "config.json").read_text()))
    line = f"loads at tensor-parallel sizes {', '.join(map(str, ok)) or 'none'}"
    if refused:
        line += ("; WARNING: not at " + "; ".join(refused)
                 + " — serve the target at a size it loads at, or retrain with --heads/--kv-heads that divide it")
    return line


def draft_note(train_out: Path | None, argv: list[str], *, cwd: Path) -> str:
    """'; draft for SGLang: DIR — serve with: …' for the trainer's OUT/draft, '' when it is not there."""
    if train_out is None or not (train_out / "draft" / "config.json").exists():
        return ""
    target = "TARGET_MODEL"
    for flag in ("--target-model", "--lm-head"):
        if flag in argv[:-1]:
            t = Path(argv[argv.index(flag) + 1])
            target = str(t if t.is_absolute() else cwd / t)
    draft = train_out / "draft"
    return f"; draft for SGLang: {draft} — serve it with `{launch_line(draft, target)}`"


def launch_line(draft: Path, target: str, *, steps: int = 5, topk: int = 1, tokens: int = 6) -> str:
    """The SGLang command that serves the target with this draft."""
    return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {draft} --speculative-num-steps {steps} "
            f"--speculative-eagle-topk {topk} --speculative-num-draft-tokens {tokens}")
