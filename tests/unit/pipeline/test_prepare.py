"""`eagle3 prepare` (issue 34): chat templates rendered, assistant-only loss masks, on tiny tokenizers built here."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.prepare import LineError, Renderer, load_tokenizer, prepare, read_meta, turns_of

pytestmark = pytest.mark.timeout(60)

# Written from the documented formats (Llama-3.1's model card; Kimi-K2's tokenizer_config), without their extras.
LLAMA31 = ("{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
           "{{- m['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
           "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
# the same, with a generation prompt whose whitespace `{%-` strips: the mask must not change
LLAMA31_STRIPPED = LLAMA31.replace("{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}",
                                   "<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")
KIMI = ("{%- for m in messages %}{%- if m['role'] == 'system' %}<|im_system|>system<|im_middle|>"
        "{%- elif m['role'] == 'user' %}<|im_user|>user<|im_middle|>{%- else %}<|im_assistant|>assistant<|im_middle|>"
        "{%- endif %}{{ m['content'] }}<|im_end|>{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{%- endif %}")
# ChatML with {% generation %} markers: transformers' own assistant mask to agree with
MARKED = ("{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{%- if m['role'] == 'assistant' %}"
          "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{%- else %}{{ m['content'] }}<|im_end|>"
          "{%- endif %}\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|im_system|>",
            "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>", "<|im_start|>"]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo!"}, {"role": "user", "content": "more"},
                {"role": "assistant", "content": "ok."}]


H = "<|start_header_id|>", "<|end_header_id|>\n\n"


def tokenizer_dir(root: Path, template: str) -> Path:
    """A character-level fast tokenizer (every printable character one token, the template's markers special)."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(["[UNK]", *string.printable])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   unk_token="[UNK]")
    fast.chat_template = template
    path = root / f"tok-{abs(hash(template))}"
    fast.save_pretrained(path)
    return path


def by_hand(tok, segments: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Ids and mask of hand-split text: each (text, trained) piece tokenized alone (markers and characters)."""
    ids, mask = [], []
    for text, trained in segments:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask


LLAMA_SEGMENTS = [(f"<|begin_of_text|>{H[0]}system{H[1]}Be brief.<|eot_id|>{H[0]}user{H[1]}hi<|eot_id|>"
                   f"{H[0]}assistant{H[1]}", 0), ("yo!<|eot_id|>", 1),
                  (f"{H[0]}user{H[1]}more<|eot_id|>{H[0]}assistant{H[1]}", 0), ("ok.<|eot_id|>", 1)]


@pytest.mark.parametrize("template, segments", [
    (LLAMA31, LLAMA_SEGMENTS), (LLAMA31_STRIPPED, LLAMA_SEGMENTS),
    (KIMI, [("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>"
             "<|im_assistant|>assistant<|im_middle|>", 0), ("yo!<|im_end|>", 1),
            ("<|im_user|>user<|im_middle|>more<|im_end|><|im_assistant|>assistant<|im_middle|>", 0),
            ("ok.<|im_end|>", 1)]),
])
def test_masks_equal_hand_computed_ones_on_documented_templates(tmp_path, template, segments):
    """Multi-turn with a system prompt: 1 on each assistant turn's tokens and its end-of-turn token, 0 elsewhere."""
    tok = load_tokenizer(str(tokenizer_dir(tmp_path, template)), trust_remote_code=False)
    got = Renderer(tok).prepare(CONVERSATION, max_length=None)
    ids, mask = by_hand(tok, segments)
    assert got.input_ids == ids and got.loss_mask == mask


# ChatML as Qwen writes it: "<|im_end|>\n" after every turn, the newline outside the markers (layout, not output)
MARKED_NEWLINE = MARKED.replace("{%- endif %}\n{%- endfor %}", "{%- endif %}{{ '\\n' }}{%- endfor %}")


@pytest.mark.parametrize("template", [MARKED, MARKED_NEWLINE], ids=["chatml", "chatml-newline"])
def test_masks_agree_with_the_generation_markers_own(tmp_path, template):
    tok = load_tokenizer(str(tokenizer_dir(tmp_path, template)), trust_remote_code=False)
    assert "<|im_end|>\n<|im_start|>" in tok.apply_chat_template(CONVERSATION, tokenize=False) or template == MARKED
    theirs = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ours = Renderer(tok).prepare(CONVERSATION, max_length=None)
    assert ours.input_ids == list(theirs["input_ids"]) and ours.loss_mask == list(theirs["assistant_masks"])


def test_a_slow_tokenizer_is_tokenized_piecewise_to_the_same_mask(tmp_path):
    tok = load_tokenizer(str(tokenizer_dir(tmp_path, KIMI)), trust_remote_code=False)

    class Slow:  # no offsets, as a tiktoken-based remote-code tokenizer
        is_fast = False
        chat_template = tok.chat_template

        def apply_chat_template(self, *a, **kw):
            return tok.apply_chat_template(*a, **kw)

        def encode(self, text, add_special_tokens=False):
            return tok.encode(text, add_special_tokens=add_special_tokens)

    fast = Renderer(tok).prepare(CONVERSATION, max_length=None)
    slow = Renderer(Slow()).prepare(CONVERSATION, max_length=None)
    assert (slow.input_ids, slow.loss_mask) == (fast.input_ids, fast.loss_mask)


def test_formats_and_roles():
    share = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    assert turns_of(share, "auto") == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert turns_of({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
                    "messages")[1]["role"] == "assistant"


def test_a_file_with_bad_lines_prepares_the_rest_names_each_and_writes_the_sidecar(tmp_path, capsys):
    tdir = tokenizer_dir(tmp_path, LLAMA31)
    good = {"id": "c1", "messages": CONVERSATION[1:]}
    lines = [json.dumps(good), "{not json", json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
             json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]}),
             json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
             json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                                           {"from": "human", "value": "x" * 80}, {"from": "gpt", "value": "b"}]}),
             json.dumps({"messages": [{"role": "user", "content": "q" * 80}, {"role": "assistant", "content": "a"}]})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "train.jsonl"
    s = prepare(target_model=str(tdir), data=tmp_path / "in.jsonl", out=out, max_length=60, system="Be brief.",
                show=1)
    err = capsys.readouterr().err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["c1", "line-6"] and s.conversations == 2 and s.cut == 2
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) <= 60 for r in rows)
    assert "line 2: not JSON" in err and "line 3: turn 1: unknown role 'robot'" in err
    assert "line 4: turn 2: empty assistant turn" in err and "line 5: no assistant turn: nothing to train on" in err
    assert "line 7: no assistant token left within --max-length 60" in err
    assert "prepare: 2 conversations" in err and "5 line(s) skipped" in err and "2 cut to --max-length" in err
    assert "⟦yo!<|eot_id|>⟧" in err  # --show 1: the tokens trained on, marked
    meta = read_meta(out)
    assert meta["conversations"] == 2 and meta["skipped"] == 5 and len(meta["chat_template_sha256"]) == 64
    # the end of turn, read off the template (a line cut by --max-length ends on content instead): <|eot_id|>
    tok = load_tokenizer(str(tdir), trust_remote_code=False)
    assert meta["end_of_turn_ids"] == [tok.convert_tokens_to_ids("<|eot_id|>")]
    assert any(r["input_ids"][-1] not in meta["end_of_turn_ids"] for r in rows)  # a cut one
    # the first conversation as --show prints it, for the run's thread before anything is extracted from it
    assert meta["preview"]["id"] == "c1" and "⟦yo!<|eot_id|>⟧" in meta["preview"]["text"]
    assert (tmp_path / "train.meta.json").exists() and not list(tmp_path.glob(".train*"))


def test_refusals_are_one_line(tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        load_tokenizer(str(tmp_path / "nope"), trust_remote_code=False)
    plain = tokenizer_dir(tmp_path, LLAMA31)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in plain.glob("chat_template*"):
        f.unlink()
    with pytest.raises(UserError, match="has no chat template"):
        load_tokenizer(str(plain), trust_remote_code=False)


def test_prepared_data_is_what_extraction_reads_and_records(tmp_path):
    """prepare → extract on the toy server: the loss mask reaches the hidden-state files, the sidecar the manifest."""
    import sqlite3

    from safetensors import safe_open

    from tests.conftest import eagle3
    from tests.toy import ToyServer

    tdir = tokenizer_dir(tmp_path, KIMI)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": f"c{i}", "messages": CONVERSATION}) + "\n"
                                               for i in range(3)))
    prepare(target_model=str(tdir), data=tmp_path / "in.jsonl", out=tmp_path / "train.jsonl", say=lambda m: None)
    row = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    server = ToyServer()
    try:
        res = eagle3("extract", "--server", server.url, "--data", str(tmp_path / "train.jsonl"), "--out",
                     str(tmp_path / "out"))
    finally:
        server.stop()
    assert res.returncode == 0, res.stderr
    with safe_open(str(tmp_path / "out" / "hidden_states" / "hs_0.safetensors"), "pt") as f:
        assert f.get_tensor("loss_mask").tolist() == row["loss_mask"]
    conn = sqlite3.connect(tmp_path / "out" / "manifest.sqlite")
    prepared = json.loads(conn.execute("SELECT value FROM meta WHERE key = 'prepared'").fetchone()[0])
    conn.close()
    assert prepared["conversations"] == 3 and prepared["chat_template_sha256"] == read_meta(
        tmp_path / "train.jsonl")["chat_template_sha256"]


def test_the_toy_target_carries_a_tokenizer_and_template_that_prepare_reads(tmp_path):
    """The toy target's HF directory is prepared from as a real one is: its ids are the toy's (under 256), every
    trained run is an assistant's text closed by <|im_end|> (255), the demo's end-of-turn token."""
    from pipeline.toy.demo_workspace import EOT, write_chat
    from pipeline.toy.model import VOCAB, export_target

    target = export_target(tmp_path / "target")
    write_chat(tmp_path / "chat.jsonl", 6)
    prepare(target_model=str(target), data=tmp_path / "chat.jsonl", out=tmp_path / "data.jsonl", say=lambda m: None)
    tok = load_tokenizer(str(target), trust_remote_code=False)
    chats = [json.loads(x) for x in (tmp_path / "chat.jsonl").read_text().splitlines()]
    for row, chat in zip((json.loads(x) for x in (tmp_path / "data.jsonl").read_text().splitlines()), chats,
                         strict=True):
        assert row["id"] == chat["id"] and max(row["input_ids"]) < VOCAB
        runs, run = [], []
        for i, m in zip(row["input_ids"], row["loss_mask"], strict=True):
            if m:
                run.append(i)
            elif run:
                runs, run = runs + [run], []
        runs += [run] if run else []
        answers = [t["value"] for t in chat["conversations"] if t["from"] == "gpt"]
        assert [r[-1] for r in runs] == [EOT] * len(answers)
        assert [tok.decode(r[:-1]) for r in runs] == answers
        assert tok.decode(row["input_ids"]).startswith("<|im_start|>")


@pytest.mark.parametrize("text", ['[{"messages": []},\n {"messages": []}]\n', '[\n  {"messages": []}\n]\n'])
def test_a_json_array_is_named_as_such_with_the_way_to_convert_it(tmp_path, text):
    from pipeline.errors import UserError

    (tmp_path / "chats.json").write_text(text)
    with pytest.raises(UserError) as refused:
        prepare(target_model=str(tmp_path / "no-model"), data=tmp_path / "chats.json", out=tmp_path / "o.jsonl")
    assert "a JSON array, not JSON lines" in str(refused.value) and "jq -c '.[]'" in str(refused.value)



# Issue 51. Llama-3.1's tool calling as its model card documents it, reduced to its shape: the tools in a system
# header, a tool call as JSON ending <|eom_id|>, the tool's output under the "ipython" role.
LLAMA31_TOOLS = (
    "{{- bos_token }}{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools: ' + tools | tojson"
    " + '<|eot_id|>' }}{%- endif %}{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and m['tool_calls'] %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for c in m['tool_calls'] %}{{- '{\"name\": \"' + c['function']['name'] + '\", \"parameters\": ' + "
    "c['function']['arguments'] | tojson + '}' }}{%- endfor %}{{- '<|eom_id|>' }}"
    "{%- elif m['role'] == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m['content'] + "
    "'<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + "
    "'<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
# Qwen3's thinking template, reduced to its shape: reasoning in <think>…</think> before the answer, rendered only for
# the assistant turns after the last user message (earlier turns lose theirs once a later question follows)
QWEN3_THINKING = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.get('reasoning_content') and loop.index0 > ns.last %}{{- '<think>\\n' + m['reasoning_content'] + "
    "'\\n</think>\\n\\n' }}{%- endif %}{{- m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_tool_calls_are_trained_and_tool_output_never_on_a_llama_31_tool_template(tmp_path):
    """An OpenAI tool-calling conversation (content null on the call, a tool turn, the line's tools): the call and
    the answer after the tool are the assistant's own tokens; the tools' definitions and the tool's output are not."""
    tok = load_tokenizer(str(tokenizer_dir(tmp_path, LLAMA31_TOOLS)), trust_remote_code=False)
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    line = {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."}], "tools": tools}
    turns = turns_of(line, "auto")
    assert [t["role"] for t in turns] == ["user", "assistant", "tool", "assistant"] and turns[2]["tool_call_id"] == "c1"
    got = Renderer(tok).prepare(turns, max_length=None, tools=tools)
    call = '{"name": "get", "parameters": ' + json.dumps({"city": "Oslo"}) + "}"
    ids, mask = by_hand(tok, [
        (f"<|begin_of_text|>{H[0]}system{H[1]}Tools: {json.dumps(tools)}<|eot_id|>{H[0]}user{H[1]}weather?<|eot_id|>"
         f"{H[0]}assistant{H[1]}", 0), (f"{call}<|eom_id|>", 1),
        (f"{H[0]}ipython{H[1]}sunny<|eot_id|>{H[0]}assistant{H[1]}", 0), ("It is sunny.<|eot_id|>", 1)])
    assert got.input_ids == ids and got.loss_mask == mask


def test_reasoning_is_trained_where_the_template_renders_it_and_dropped_on_request(tmp_path):
    """Qwen3-style thinking: the last answer's <think>…</think> is the assistant's own (trained); an earlier turn's
    reasoning is not rendered once a later question follows, so only its answer is; --drop-reasoning leaves it out."""
    tok = load_tokenizer(str(tokenizer_dir(tmp_path, QWEN3_THINKING)), trust_remote_code=False)
    line = {"messages": [{"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "4", "reasoning_content": "add"},
                         {"role": "user", "content": "and 3+3?"},
                         {"role": "assistant", "content": "6", "reasoning_content": "add again"}]}
    got = Renderer(tok).prepare(turns_of(line, "auto"), max_length=None)
    ids, mask = by_hand(tok, [("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0), ("4<|im_end|>", 1),
                              ("\n<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n", 0),
                              ("<think>\nadd again\n</think>\n\n6<|im_end|>", 1), ("\n", 0)])
    assert got.input_ids == ids and got.loss_mask == mask
    dropped = Renderer(tok).prepare(turns_of(line, "auto", reasoning=False), max_length=None)
    ids, mask = by_hand(tok, [("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n", 0), ("4<|im_end|>", 1),
                              ("\n<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n", 0),
                              ("6<|im_end|>", 1), ("\n", 0)])
    assert dropped.input_ids == ids and dropped.loss_mask == mask


def test_a_genuine_leading_space_in_an_answer_is_trained(tmp_path):
    """ChatML as Qwen2.5 writes it: the generation prompt ends with its newline, and an answer that starts with a
    space starts with a token the model must learn to emit."""
    tok = load_tokenizer(str(tokenizer_dir(tmp_path, CHATML)), trust_remote_code=False)
    got = Renderer(tok).prepare([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " yes"}],
                                max_length=None)
    ids, mask = by_hand(tok, [("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0), (" yes<|im_end|>", 1),
                              ("\n", 0)])
    assert got.input_ids == ids and got.loss_mask == mask


def test_tool_turn_shapes_are_checked_with_one_line_each():
    with pytest.raises(LineError, match="turn 1: 'tool_calls' must be a non-empty list on an assistant turn"):
        turns_of({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": 1}]}]}, "auto")
    with pytest.raises(LineError, match="turn 2: 'content' is not text"):
        turns_of({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]}, "auto")


def test_chat_regeneration_drops_earlier_reasoning_where_the_template_does_as_serving_would(tmp_path):
    """Issue 51: `regenerate --target-model` builds each turn's prompt by rendering the history through the template.
    On a Qwen3-style thinking template the first answer's reasoning is gone from the second turn's prompt — the
    context serving gives the model — where sending the earlier turns back as generated tokens would keep it."""
    import threading

    from pipeline.regenerate import Options, Regenerator

    tok = load_tokenizer(str(tokenizer_dir(tmp_path, QWEN3_THINKING)), trust_remote_code=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    answers = iter(["<think>\nfirst thoughts\n</think>\n\n4", "<think>\nadd again\n</think>\n\n6"])
    prompts = []

    class Chats:
        lock = threading.Lock()
        max_length = None

        def __init__(self):
            self.tok, self.renderer = tok, Renderer(tok)

        def conversation(self, sid):
            return [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "old 4"},
                    {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "old 6"}], None

    r = Regenerator(Options(server="http://127.0.0.1:1", data=tmp_path / "d.jsonl", out=tmp_path / "o.jsonl"),
                    say=lambda m: None)
    r.chats, r.eot_ids = Chats(), [end]

    def text(ids):  # the character tokenizer's tokens joined (its decode puts spaces between them)
        return "".join(tok.convert_ids_to_tokens(list(ids)))

    tok_decode = tok.decode
    tok.decode = lambda ids, **_: text(ids)  # what regenerate decodes an answer with, without the spaces

    def generate(prompt):
        prompts.append(text(prompt))
        return tok(next(answers) + "<|im_end|>", add_special_tokens=False)["input_ids"], True

    r.generate = generate
    ids, mask = r.regenerate_chat("c1")
    assert prompts[0] == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert "first thoughts" not in prompts[1] and prompts[1].endswith(
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n"), prompts[1]
    tok.decode = tok_decode
    trained = text(t for t, m in zip(ids, mask, strict=True) if m)
    assert trained == "4<|im_end|><think>\nadd again\n</think>\n\n6<|im_end|>", trained  # the answers, the last's reasoning
