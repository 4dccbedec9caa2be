"""Chat formats (data/chat.py, data/conversations.py:Conversation) on the real chat templates of three families, read
from llama.cpp's source tree (it ships them for its own template tests): Qwen3 (<think> … </think>), gpt-oss
(harmony: analysis and final channels) and Gemma (<start_of_turn> … <end_of_turn>, Gemma 2's template, whose turn
markers Gemma 3 shares). Each template is put on SmolLM2's tokenizer with the family's special tokens added, and
conversations written in that format go through the data job's own turn builder: the loss mask is 1 on the
assistant's tokens only, thinking spans leave it when data.loss_on_thinking=false, target.chat_template_kwargs
reach the template (and are refused when the template never reads them); a template that drops earlier thinking
starts a new row from its own rendering (or, asked to, ends the conversation with a stated reason), one that refuses
it ends the conversation with a stated reason, never a traceback."""

import copy

import pytest
from conftest import REPO

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.data.chat import chat_ids, thinking_format, user_prompt_ids, with_template_kwargs
from specdrafter.data.conversations import Conversation, build_conversations
from specdrafter.data.shards import is_subsequence, settings_fingerprint, write_shard
from specdrafter.jobs.recipe import load_recipe
from specdrafter.train.batches import TrainingData

TEMPLATES = llamacpp.source_dir() / "models" / "templates"
pytestmark = pytest.mark.skipif(not (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").is_file(),
                                reason="llama.cpp's source tree is not unpacked (specdrafter-llamacpp install)")

# family: (template file, special tokens to add, EOS, an answer written in the family's format, its thinking)
FAMILIES = {
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", ["<think>", "</think>"], "<|im_end|>",
              "<think>\nTwo and two make four.\n</think>\n\nIt is 4.", "<think>\nTwo and two make four.\n</think>"),
    "gpt_oss": ("openai-gpt-oss-120b.jinja", ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
                                              "<|constrain|>", "<|call|>"], "<|return|>",
                "<|channel|>analysis<|message|>Two and two make four.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>It is 4.",
                "<|channel|>analysis<|message|>Two and two make four.<|end|>"),
    "gemma": ("google-gemma-2-2b-it.jinja", ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>", "It is 4.", ""),
}


def family_tokenizer(base, family):
    template, specials, eos, _, _ = FAMILIES[family]
    tokenizer = copy.deepcopy(base)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    tokenizer.eos_token = eos
    return tokenizer


def conversation(split=False):
    return Conversation({"id": "c", "text": "What is 2+2?", "turns": ["What is 2+2?", "And 3+3?"], "reference": None,
                         "truncated": False, "source": "target"}, split_rewritten=split)


def answer_turn(tokenizer, family, thinking=None, split=False):
    """A conversation with one assistant turn written in the family's format, through the data job's builder."""
    _, _, eos, answer, _ = FAMILIES[family]
    c = conversation(split)
    messages = c.context(tokenizer, 0, 1000, 10_000)
    eos_ids = [tokenizer.convert_tokens_to_ids(eos)]
    c.add_turn(messages, tokenizer(answer, add_special_tokens=False)["input_ids"] + eos_ids, tokenizer, eos_ids,
               thinking)
    return c


def trained_text(tokenizer, c):
    return tokenizer.decode([t for t, m in zip(c.input_ids, c.loss_mask) if m])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_loss_mask_is_the_assistants_answer_in_each_family_format(smollm2_tokenizer, family):
    tokenizer = family_tokenizer(smollm2_tokenizer, family)
    _, _, eos, answer, _ = FAMILIES[family]
    c = answer_turn(tokenizer, family)
    prompt = user_prompt_ids(tokenizer, "What is 2+2?")
    assert c.input_ids[:len(prompt)] == prompt and c.loss_mask == [0] * len(prompt) + [1] * (len(c.input_ids) - len(prompt))
    assert trained_text(tokenizer, c) == answer + eos  # the whole answer, thinking and its closing EOS included
    record = c.record()
    assert record["num_prompt_tokens"] == len(prompt) and record["num_response_tokens"] == len(c.input_ids) - len(prompt)


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_loss_on_thinking_false_masks_exactly_the_thinking_span(smollm2_tokenizer, family):
    tokenizer = family_tokenizer(smollm2_tokenizer, family)
    _, _, eos, answer, thinking_text = FAMILIES[family]
    thinking = thinking_format(tokenizer)
    assert thinking is not None
    c = answer_turn(tokenizer, family, thinking)
    assert trained_text(tokenizer, c) == answer.replace(thinking_text, "") + eos
    assert c.record()["num_response_tokens"] == len(tokenizer(answer, add_special_tokens=False)["input_ids"]) + 1


def test_a_thought_cut_at_max_new_tokens_is_masked_to_the_end(smollm2_tokenizer):
    tokenizer = family_tokenizer(smollm2_tokenizer, "qwen3")
    c = conversation()
    messages = c.context(tokenizer, 0, 1000, 10_000)
    cut = tokenizer("<think>\nTwo and two", add_special_tokens=False)["input_ids"]  # no </think>, no EOS
    c.add_turn(messages, cut, tokenizer, [tokenizer.eos_token_id], thinking_format(tokenizer))
    assert sum(c.loss_mask) == 0 and not c.finished


def test_gemma_turns_extend_and_each_answer_is_masked_in(smollm2_tokenizer):
    """Gemma's template lays earlier turns out as they were generated: a second turn extends the ids, and the mask
    holds both answers (with their <end_of_turn>) and nothing of the template's."""
    tokenizer = family_tokenizer(smollm2_tokenizer, "gemma")
    c = answer_turn(tokenizer, "gemma")
    messages = c.context(tokenizer, 1, 1000, 10_000)
    assert messages is not None and c.next_ids[:len(c.input_ids)] == c.input_ids
    eos = [tokenizer.eos_token_id]
    c.add_turn(messages, tokenizer("It is 6.", add_special_tokens=False)["input_ids"] + eos, tokenizer, eos)
    assert trained_text(tokenizer, c) == "It is 4.<end_of_turn>It is 6.<end_of_turn>"
    assert c.input_ids == chat_ids(tokenizer, c.messages, False)[:len(c.input_ids)]


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_a_template_that_drops_earlier_thinking_ends_the_conversation_when_asked_to(smollm2_tokenizer, family):
    """data.rewritten_history=stop: Qwen3's template drops an earlier answer's <think> block and gpt-oss's its
    analysis channel, so the second turn's ids no longer extend the first's: the conversation ends after one turn."""
    tokenizer = family_tokenizer(smollm2_tokenizer, family)
    c = answer_turn(tokenizer, family)
    assert c.context(tokenizer, 1, 1000, 10_000) is None and c.stop_reason == "roundtrip_mismatch" and not c.open
    assert [r["id"] for r in c.records()] == ["c"]


def test_a_gpt_oss_answer_goes_back_to_its_template_by_channel_and_the_next_turn_is_a_new_row(smollm2_tokenizer):
    """A harmony answer is stored with its analysis in `thinking` and its final answer in `content` (the template
    refuses channel tags in either), so the template renders the first row back to exactly the generated ids; the
    second turn, whose context drops that analysis as a server's would, is row "c/turn1" with only its answer trained."""
    tokenizer = family_tokenizer(smollm2_tokenizer, "gpt_oss")
    c = answer_turn(tokenizer, "gpt_oss", split=True)
    assert c.messages[-1] == {"role": "assistant", "content": "It is 4.", "thinking": "Two and two make four."}
    assert chat_ids(tokenizer, c.messages, False) == c.input_ids  # analysis, final, <|return|>: as generated
    messages = c.context(tokenizer, 1, 1000, 10_000)
    assert messages is not None and c.open
    eos = [tokenizer.convert_tokens_to_ids("<|return|>")]
    answer = "<|channel|>analysis<|message|>Three more.<|end|><|start|>assistant<|channel|>final<|message|>It is 6."
    c.add_turn(messages, tokenizer(answer, add_special_tokens=False)["input_ids"] + eos, tokenizer, eos)
    first, second = c.records()
    assert [first["id"], second["id"]] == ["c", "c/turn1"]
    context = chat_ids(tokenizer, messages, True)
    assert "Two and two" not in tokenizer.decode(context) and "<|message|>It is 4.<|end|>" in tokenizer.decode(context)
    assert second["input_ids"][:len(context)] == context
    assert tokenizer.decode([t for t, m in zip(second["input_ids"], second["loss_mask"]) if m]) == answer + "<|return|>"
    assert chat_ids(tokenizer, c.messages, False) == second["input_ids"]


def test_a_rewritten_history_starts_a_new_row_from_the_templates_own_rendering(smollm2_tokenizer):
    """data.rewritten_history=split (the default): where Qwen3's template drops the first answer's thinking, the
    second turn becomes its own row "c/turn1": its ids are the template's rendering of the whole conversation (what a
    server is sent for that turn), its mask only the new answer; the first row stays as it was generated."""
    tokenizer = family_tokenizer(smollm2_tokenizer, "qwen3")
    c = answer_turn(tokenizer, "qwen3", split=True)
    first = c.record()
    messages = c.context(tokenizer, 1, 1000, 10_000)
    assert messages is not None and c.open
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    c.add_turn(messages, tokenizer("<think>\nSix.\n</think>\n\nIt is 6.", add_special_tokens=False)["input_ids"] + eos,
               tokenizer, eos)
    rows = c.records()
    assert [r["id"] for r in rows] == ["c", "c/turn1"] and rows[0] == first
    second = rows[1]
    context = chat_ids(tokenizer, messages, True)
    assert second["input_ids"][:len(context)] == context and "Two and two" not in tokenizer.decode(context)
    assert second["loss_mask"] == [0] * len(context) + [1] * (len(second["input_ids"]) - len(context))
    assert tokenizer.decode([t for t, m in zip(second["input_ids"], second["loss_mask"]) if m]) == \
        "<think>\nSix.\n</think>\n\nIt is 6.<|im_end|>"
    assert second["num_prompt_tokens"] == len(context) and second["num_turns"] == 2


def test_chat_template_kwargs_reach_every_rendering_and_a_key_the_template_never_reads_is_refused(smollm2_tokenizer):
    qwen = with_template_kwargs(family_tokenizer(smollm2_tokenizer, "qwen3"), {"enable_thinking": False})
    assert qwen.decode(user_prompt_ids(qwen, "Hi")).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen.chat_template_kwargs == {"enable_thinking": False}
    oss = with_template_kwargs(family_tokenizer(smollm2_tokenizer, "gpt_oss"), {"reasoning_effort": "low"})
    assert "Reasoning: low" in oss.decode(user_prompt_ids(oss, "Hi"))
    with pytest.raises(SpecdrafterError, match=r"target.chat_template_kwargs': the target's chat template never "
                                               r"reads 'enable_thinkng'; it reads .*enable_thinking"):
        with_template_kwargs(family_tokenizer(smollm2_tokenizer, "qwen3"), {"enable_thinkng": False})


def test_template_kwargs_and_masked_thinking_are_part_of_the_data_settings():
    recipe = REPO / "recipes" / "smollm2-135m-data.yaml"
    plain = settings_fingerprint(load_recipe(recipe, []))
    assert "target.chat_template_kwargs" not in plain and "data.loss_on_thinking" not in plain  # old shards match
    changed = settings_fingerprint(load_recipe(recipe, ["target.chat_template_kwargs.enable_thinking=false",
                                                        "data.loss_on_thinking=false"]))
    assert changed["target.chat_template_kwargs"] == {"enable_thinking": False}
    assert changed["data.loss_on_thinking"] is False


def test_loss_on_thinking_false_on_a_target_without_thinking_markers_is_one_line(smollm2_tokenizer):
    from specdrafter.data.conversations import untrained_thinking

    cfg = load_recipe(REPO / "recipes" / "smollm2-135m-data.yaml", ["data.loss_on_thinking=false"])
    with pytest.raises(SpecdrafterError, match="'data.loss_on_thinking' is false, but the target's tokenizer has no "
                                               "thinking markers"):
        untrained_thinking(cfg.data, smollm2_tokenizer)


TWO_TURNS = {"qwen3": ["<think>\nEasy.\n</think>\n\nIt is 4.", "<think>\nAgain.\n</think>\n\nIt is 6."],
             "gpt_oss": ["<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.",
                         "<|channel|>analysis<|message|>Again.<|end|><|start|>assistant<|channel|>final<|message|>It is 6."]}


@pytest.mark.parametrize("family", list(TWO_TURNS))
def test_the_data_jobs_turn_builder_splits_conversations_at_a_rewritten_history(smollm2_tokenizer, tmp_path, family):
    """Two teacher-forced turns of Qwen3-format or gpt-oss (harmony) answers through build_conversations (the data
    job's builder): each conversation gives its first row and a "/turn1" row, the shard's id check accepts them,
    training holds a conversation's rows out together (its tokenizer check reads the stored messages back), and with
    data.rewritten_history=stop each ends after its first answer."""
    tokenizer = family_tokenizer(smollm2_tokenizer, family)
    answers = TWO_TURNS[family]
    prompts = [{"id": f"p{i}", "text": "What is 2+2?", "turns": ["What is 2+2?", "And 3+3?"], "reference": answers,
                "truncated": False, "source": "dataset"} for i in range(3)]
    eos = [tokenizer.convert_tokens_to_ids(FAMILIES[family][2])]
    for setting, ids in (("split", ["p0", "p0/turn1", "p1", "p1/turn1", "p2", "p2/turn1"]), ("stop", ["p0", "p1", "p2"])):
        d = load_recipe(REPO / "recipes" / "smollm2-135m-data.yaml", ["data.max_turns=2",
                                                                       f"data.rewritten_history={setting}"]).data
        counts = {}
        rows = build_conversations(prompts, None, tokenizer, eos, d, 0, 1000, 10_000, counts)
        assert [r["id"] for r in rows] == ids and is_subsequence([r["id"] for r in rows], ["p0", "p1", "p2"])
        assert all(r["num_response_tokens"] == sum(r["loss_mask"]) > 0 for r in rows)
        assert counts.get("rows_from_rewritten_history", 0) == (3 if setting == "split" else 0)
        assert counts.get("roundtrip_mismatch", 0) == (0 if setting == "split" else 3)
    d = load_recipe(REPO / "recipes" / "smollm2-135m-data.yaml", ["data.max_turns=2"]).data  # split, the default
    rows_split = build_conversations(prompts, None, tokenizer, eos, d, 0, 1000, 10_000, {})
    write_shard(rows_split, ["p0", "p1", "p2"], tmp_path / "shards" / "shard-00000", {})
    for seed in range(6):
        data = TrainingData(tmp_path, tokenizer, f"{family}-like", 512, heldout=1, seed=seed)
        held = {rows_split[i]["id"].split("/")[0] for i in data.heldout}
        trained = {rows_split[i]["id"].split("/")[0] for i in data.train}
        assert len(data.heldout) == 2 and len(held) == 1 and not held & trained


def test_a_template_that_refuses_a_later_turn_ends_the_conversation_with_a_reason(smollm2_tokenizer):
    """A template that raises (here one that takes a single exchange only) ends the conversation at that turn as
    `template_refused`, keeping the turns before it, never with a traceback."""
    tokenizer = family_tokenizer(smollm2_tokenizer, "gemma")
    tokenizer.chat_template = ("{% if messages|length > 2 %}{{ raise_exception('one exchange only') }}{% endif %}"
                               + tokenizer.chat_template)
    c = answer_turn(tokenizer, "gemma")
    assert c.context(tokenizer, 1, 1000, 10_000) is None and c.stop_reason == "template_refused" and not c.open
    assert [r["id"] for r in c.records()] == ["c"] and trained_text(tokenizer, c) == "It is 4.<end_of_turn>"
