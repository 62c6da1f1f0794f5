"""The toy target's tokenizer and chat template, written as a Hugging Face directory's files.

So that `eagle3 prepare --target-model DIR` runs on the toy target as it does on a real one
(transformers' `AutoTokenizer`, local files only), the toy's 256 ids are characters:
id 0 is `[UNK]`, ids 1–253 one character each (printable ASCII first), and two special
tokens close the range — `<|im_start|>` (254) and `<|im_end|>` (255), the end-of-turn token
that regeneration stops a turn at. The template is ChatML's shape without its extras.

The files are written as JSON here (no `tokenizers` import: `eagle3 init --demo` stays light);
`tests/unit/pipeline/test_prepare.py` loads them through transformers.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

UNK = "[UNK]"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
IM_START_ID, IM_END_ID = 254, 255
# printable ASCII, then Latin letters from À on, up to id 253
CHARACTERS = list(string.printable) + [chr(0xC0 + k) for k in range(IM_START_ID - 1 - len(string.printable))]
CHAT_TEMPLATE = ("{% for m in messages %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END + "\n"
                 "{% endfor %}{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}")


def _special(content: str) -> dict:
    return {"content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": True}


def write_tokenizer(directory: Path) -> None:
    """tokenizer.json (a character-level WordLevel model), tokenizer_config.json (with the chat template)
    and special_tokens_map.json into `directory`."""
    vocab = {UNK: 0, **{c: i for i, c in enumerate(CHARACTERS, start=1)}}
    assert len(vocab) == IM_START_ID
    specials = {IM_START_ID: IM_START, IM_END_ID: IM_END}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, **_special(s)} for i, s in specials.items()],
        "normalizer": None,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": r"[\s\S]"}, "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK},
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
              "eos_token": IM_END, "pad_token": IM_END, "unk_token": UNK, "bos_token": None,
              "model_max_length": 2048, "clean_up_tokenization_spaces": False,
              "added_tokens_decoder": {str(i): _special(s) for i, s in specials.items()}}
    directory = Path(directory)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=1))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": IM_END, "pad_token": IM_END, "unk_token": UNK}, indent=1))
