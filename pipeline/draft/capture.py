"""Which target layers SGLang 0.5.23 captures for EAGLE-3, and the ids a draft must carry to get the same.

The server's `--return-aux-hidden-state-layer-ids` (reported back as `return_aux_hidden_state_layer_ids`)
and a draft's `eagle_config.eagle_aux_hidden_state_layer_ids` fill one field
(`model_runner_components/spec_aux_hidden_state.py`); the target model's
`set_eagle3_layers_to_capture` then maps it to `layers_to_capture` — the layers whose *input*
(the previous layer's output) is captured:

  Llama family (`models/llama.py`)         no ids: [2, N//2, N−3]; ids: each + 1
  DeepSeek/Kimi (`models/deepseek_v2.py`,  no ids: [2, N//2, N−3]; ids: each + 1 when the first is 1,
   `kimi_k25.py` delegates to it)          else as given

Both at extraction and at serving the same model maps the same field the same way, so the draft
serves on the layers the data was extracted from exactly when it carries the ids the server was
given, verbatim — or none when the server used its default. The manifest records them so
(`SERVER_IDS`); manifests before this record them as layer inputs (`LAYER_INPUTS`).
"""

from __future__ import annotations

SERVER_IDS = "sglang-server-ids"  # ids as given to / reported by the server: the model's capture code maps them
LAYER_INPUTS = "sglang-layer-input"  # older manifests: id i is the input of layer i (the Llama default's convention)
AUX_IDS_EAGLE_CONFIG = "eagle-config"  # a checkpoint's DraftConfig.aux_ids: its aux_layer_ids are written verbatim
TOY_MODEL = "toy-lm"  # the toy server's model_path: before SERVER_IDS it reported layer inputs
DEEPSEEK_FAMILY = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25"})


def family(model_type: str | None) -> str:
    """'deepseek' for the models whose capture follows deepseek_v2.py, else 'llama'."""
    return "deepseek" if (model_type or "").lower() in DEEPSEEK_FAMILY else "llama"


def default_capture(n_layers: int) -> list[int]:
    """SGLang's default: the inputs of layers 2, N//2 and N−3."""
    return [2, n_layers // 2, n_layers - 3]


def captured_layers(ids: list[int] | None, n_layers: int, *, model_type: str | None = None) -> list[int]:
    """The layers whose input SGLang captures when given `ids` (None or empty: the server's default)."""
    if not ids:
        return default_capture(n_layers)
    ids = [int(i) for i in ids]
    if family(model_type) == "deepseek" and ids[0] != 1:
        return ids
    return [i + 1 for i in ids]


def draft_ids(ids: list[int] | None, convention: str | None, n_layers: int | None, *, model: str | None = None) -> list[int]:
    """The `eagle_aux_hidden_state_layer_ids` a draft needs to be fed the layers extraction captured ([]: write
    none, the server's default). `ids`, `convention` and `model` are the manifest's."""
    if not ids:
        return []
    if convention == SERVER_IDS or model != TOY_MODEL:
        # an older manifest from a real SGLang labelled the server's ids as layer inputs: they were the server's
        return [int(i) for i in ids]
    # LAYER_INPUTS from the toy server, which reported layer inputs (its default meaning "none")
    if isinstance(n_layers, int) and list(ids) == default_capture(n_layers):
        return []
    return [int(i) - 1 for i in ids]
