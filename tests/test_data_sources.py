"""The data job's sources and engine: the in-process sampler against the math (χ²) and against HF `generate`
(greedy token identity), multi-turn regeneration by the real SmolLM2 target, teacher-forced (`dataset`) and
`mix` rows, and that such data trains every drafter kind unchanged."""

import json
from pathlib import Path

import pytest
import torch
from conftest import small_data_recipe
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from specdrafter.data.chat import chat_ids
from specdrafter.data.hf_engine import generate_responses, sample_tokens
from specdrafter.data.regenerate import generate_dataset
from specdrafter.data.shards import load_generated
from specdrafter.inference.sampling import SamplingParams, sampling_probs
from specdrafter.jobs.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
DATA_RECIPE = REPO / "recipes" / "smollm2-135m-data.yaml"


recipe = small_data_recipe


def chat_rows(n: int, with_answers=True):
    """n two-turn chat rows (ShareGPT's shape); every third without assistant turns when asked."""
    rows = []
    for i in range(n):
        chat = [{"from": "human", "value": f"Tell me one fact about the number {i + 7}."},
                {"from": "gpt", "value": f"The number {i + 7} is {'odd' if i % 2 == 0 else 'even'}."},
                {"from": "human", "value": "And one more, please."},
                {"from": "gpt", "value": f"It is {'greater' if i + 7 > 9 else 'smaller'} than nine."}]
        if not with_answers and i % 3 == 0:
            chat = [m for m in chat if m["from"] == "human"]
        rows.append({"id": f"c{i}", "conversations": chat})
    return rows


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assistant_spans(row):
    """The loss-masked stretches of a row, as lists of ids."""
    spans, current = [], []
    for t, m in zip(row["input_ids"], row["loss_mask"]):
        if m:
            current.append(t)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


# ------------------------------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (1.0, 1.0), (1.3, 0.5)])
def test_batched_sampler_draws_from_the_top_p_distribution(temperature, top_p):
    """χ² of 40k draws per row against inference.sampling's p (the verifiers' own definition of top-p). Row 0 is
    peaked (its nucleus lies in the 64 best tokens), row 1 nearly flat over 300 tokens (the full-sort path)."""
    g = torch.Generator().manual_seed(0)
    V = 300
    peaked = torch.randn(V, generator=g) * 2
    flat = torch.randn(V, generator=g) * 0.05
    logits = torch.stack([peaked, flat])  # [2, V]
    n = 40_000
    for row in range(2):  # one row at a time: a batch takes the full-sort path when any row needs it
        draws = torch.stack([sample_tokens(logits[row:row + 1], temperature, top_p, g) for _ in range(n)])[:, 0]
        p = sampling_probs(logits[row], SamplingParams(temperature=temperature, top_p=top_p))  # [V] float64
        support = int((p > 0).sum())
        assert support > 1 and (top_p == 1 or (support <= 64) == (row == 0))  # the fast path, then the full sort
        counts = torch.bincount(draws, minlength=V).double()
        assert counts[p == 0].sum() == 0  # never outside the nucleus
        keep = p > 0
        expected = p[keep] * n
        big = expected >= 5  # χ² cells need expected counts ≥ 5: pool the rare ones
        obs = torch.cat([counts[keep][big], counts[keep][~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-4


def test_in_process_engine_matches_hf_generate_greedily_on_smollm2(smollm2_dir, smollm2_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    prompts = [chat_ids(smollm2_tokenizer, [{"role": "user", "content": t}], True)
               for t in ("Name a colour.", "What is 2 + 2?", "Write one sentence about the sea and the sky.",
                         "Say hello.")]
    ours = generate_responses(model, smollm2_tokenizer, prompts, 16, 0.0, 1.0, batch_size=4)
    for prompt, response in zip(prompts, ours):
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=2)[0, len(prompt):]
        assert response == hf.tolist()[:len(response)] and (response[-1] == 2 or len(response) == 16)
    assert any(r[-1] == 2 and len(r) < 16 for r in ours)  # rows of different lengths left the batch early


# --------------------------------------------------------------------------------------------- multi-turn
def test_multi_turn_regeneration_masks_every_target_turn(tmp_path, smollm2_dir, smollm2_tokenizer):
    prompts = write_jsonl(tmp_path / "chat.jsonl", [
        {"id": "a", "turns": ["Reply with one word: what colour is the sky?", "And the grass?", "And snow?"]},
        {"id": "b", "turns": ["Reply with one word: what is the capital of France?", "And of Italy?"]},
        {"id": "c", "turns": ["Say only: yes.", "Say only: no."]}])
    out = tmp_path / "run"
    stats = generate_dataset(recipe(out, smollm2_dir, prompts, "data.max_turns=3", "data.temperature=0",
                                    "data.max_new_tokens=24", "data.exclude=[]"))
    rows = list(load_generated(out))
    assert stats["assistant_turns"] == sum(r["num_turns"] for r in rows) > len(rows)
    assert stats["by_source"] == {"target": {"conversations": 3, "response_tokens": stats["response_tokens"]}}
    for row in rows:
        assert row["source"] == "target"
        turns = [m for m in row["messages"] if m["role"] == "assistant"]
        spans = assistant_spans(row)
        assert len(spans) == len(turns) == row["num_turns"]
        for span, message in zip(spans, turns):  # each masked span is one answer through its closing EOS
            assert span[-1] == 2 or not row["finished"]
            assert smollm2_tokenizer.decode(span[:-1] if span[-1] == 2 else span) == message["content"]
        # the ids are what the chat template lays out for the conversation (the answers round-trip)
        full = chat_ids(smollm2_tokenizer, row["messages"], False)
        assert full[:len(row["input_ids"])] == row["input_ids"]
    a = next(r for r in rows if r["id"] == "a")
    assert a["num_turns"] == 3 and [m["role"] for m in a["messages"]] == ["user", "assistant"] * 3


# -------------------------------------------------------------------------------------- teacher-forced / mix
def test_teacher_forced_rows_are_the_datasets_own_turns(tmp_path, tiny_target, smollm2_tokenizer):
    prompts = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6, with_answers=False))
    out = tmp_path / "run"
    stats = generate_dataset(recipe(out, tiny_target, prompts, "data.responses=dataset", "data.max_turns=2",
                                    "data.exclude=[]"))
    rows = list(load_generated(out))
    assert len(rows) == 4 and stats["this_run"]["conversation_ends"]["no_assistant_turns"] == 2  # counted skips
    assert stats["this_run"]["generated_tokens"] == 0 and stats["by_source"]["dataset"]["conversations"] == 4
    for row in rows:
        i = int(row["id"][1:])
        answers = [f"The number {i + 7} is {'odd' if i % 2 == 0 else 'even'}.",
                   f"It is {'greater' if i + 7 > 9 else 'smaller'} than nine."]
        assert row["source"] == "dataset" and row["num_turns"] == 2
        assert [m["content"] for m in row["messages"] if m["role"] == "assistant"] == answers
        assert [smollm2_tokenizer.decode(s) for s in assistant_spans(row)] == [a + "<|im_end|>" for a in answers]
        full = chat_ids(smollm2_tokenizer, row["messages"], False)
        assert full[:len(row["input_ids"])] == row["input_ids"] and row["input_ids"][-1] == 2
    # a rerun keeps the shards whose skipped conversations left them short (regression: they were regenerated forever)
    again = generate_dataset(recipe(out, tiny_target, prompts, "data.responses=dataset", "data.max_turns=2",
                                    "data.exclude=[]"))
    assert again["this_run"]["generated_conversations"] == 0 and not (out / "corrupt").exists()


def test_mix_draws_a_seeded_share_of_target_rows(tmp_path, tiny_target):
    prompts = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
    cfg = recipe(tmp_path / "run", tiny_target, prompts, "data.responses=mix", "data.target_share=0.5",
                 "data.num_conversations=12", "data.exclude=[]")
    stats = generate_dataset(cfg)
    rows = list(load_generated(tmp_path / "run"))
    sources = {r["id"]: r["source"] for r in rows}
    assert set(sources.values()) == {"target", "dataset"}
    assert {k: v["conversations"] for k, v in stats["by_source"].items()} == {
        s: sum(x == s for x in sources.values()) for s in ("dataset", "target")}
    assert sum(v["response_tokens"] for v in stats["by_source"].values()) == stats["response_tokens"]
    again = generate_dataset(recipe(tmp_path / "again", tiny_target, prompts, "data.responses=mix",
                                    "data.target_share=0.5", "data.num_conversations=12", "data.exclude=[]"))
    assert {r["id"]: r["source"] for r in load_generated(tmp_path / "again")} == sources
    assert again["by_source"] == stats["by_source"]


def test_mix_without_a_share_is_one_line(tmp_path, tiny_target, prompt_file):
    from specdrafter.core.io import SpecdrafterError
    with pytest.raises(SpecdrafterError, match="data.target_share"):
        recipe(tmp_path, tiny_target, prompt_file, "data.responses=mix")


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "draft_model"])
def test_multi_turn_mixed_data_trains_every_drafter(tmp_path, tiny_target, smollm2_tokenizer, kind):
    """Multi-turn rows from both sources load into the trainer unchanged: every loss-masked token is predicted,
    offline features line up with the rows, and one optimizer step's loss is finite."""
    from specdrafter.kinds import build_drafter, feature_layers
    from specdrafter.train.batches import TrainingData
    from specdrafter.train.drafters import run_target
    from specdrafter.train.objectives import Objective

    prompts = write_jsonl(tmp_path / "chat.jsonl", chat_rows(10))
    data = tmp_path / "data"
    generate_dataset(recipe(data, tiny_target, prompts, "data.responses=mix", "data.target_share=0.5",
                            "data.max_turns=2", "data.num_conversations=10", "data.exclude=[]",
                            "data.hidden_states.layer_ids=[0,1,2]", "data.hidden_states.dtype=float32"))
    recipes = {"eagle3": "smollm2-135m-eagle3", "medusa": "smollm2-135m-medusa", "draft_model": "smollm2-135m-draft"}
    cfg = load_recipe(REPO / "recipes" / f"{recipes[kind]}.yaml", [
        f"output_dir={tmp_path / 'train'}", f"target.model={tiny_target}", f"train.data_dir={data}", "train.heldout=2",
        "drafter.num_layers=1", "drafter.eagle.aux_layer_ids=[0,1,2]", "drafter.eagle.draft_vocab_size=512",
        "drafter.medusa.num_heads=2", "train.max_length=256"])
    target = AutoModelForCausalLM.from_pretrained(tiny_target).eval().requires_grad_(False)
    layers = feature_layers(cfg, target.config)
    offline = cfg.train.features.value == "offline"
    td = TrainingData(data, smollm2_tokenizer, str(tiny_target), 256, 2, 0, layers if offline else ())
    rows = list(load_generated(data))
    assert {r["source"] for r in rows} == {"target", "dataset"} and max(r["num_turns"] for r in rows) == 2
    drafter = build_drafter(cfg, target, td, smollm2_tokenizer)
    batch = td.batch(td.train[:4])
    if offline:  # cached features are the target's own layer inputs for these very rows
        with torch.no_grad():
            full = target(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
        real = batch.attention_mask.bool()
        torch.testing.assert_close(batch.features[1][real], full.hidden_states[1][real], atol=1e-4, rtol=1e-4)
    predictions = drafter.predictions(drafter.module, batch, run_target(target, batch, layers))
    assert len(predictions[0].draft_logits) == int(batch.loss_mask[:, 1 if kind == "draft_model" else 2:].sum())
    loss = sum(p.loss(Objective.of(cfg.train))[0] for p in predictions)
    loss.backward()
    assert torch.isfinite(loss) and any(q.grad is not None for q in drafter.module.parameters())
