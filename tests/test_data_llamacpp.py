"""llama.cpp's llama-server as the data job's engine (`data.engine: server`): a tiny random Llama with SmolLM2's
tokenizer, converted by llama.cpp's own converter and served with one thread. The probe recognises the server and
asks it for the sampled ids and the plain sampling chain; the chain's distribution is the in-process engine's
(softmax(logits / T), then the top-p nucleus) and llama-server's default one is not; greedy ids are the target's
own; the data job writes its shards from the server's ids and a drafter trains on them; a server with another chat
template is refused in one line. Needs the llama.cpp build (`specdrafter-llamacpp install`); skipped without it, but
for the reading of its reply's shape."""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, REPO, small_data_recipe, tiny_llama_config
from test_regression import TINY as TINY_TRAINING  # its 3-step run shrunk to a 2-layer target, fp32, online features
from transformers import LlamaForCausalLM

import specdrafter.inference.llama_server as llama_server_module
import specdrafter.jobs.train as train_loop
from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.data.regenerate import generate_dataset
from specdrafter.data.server import (
    LLAMA_SERVER,
    LLAMA_SERVER_FIELDS,
    LLAMA_SERVER_TOKEN_IDS,
    ServerEngine,
    parse_reply,
)
from specdrafter.data.shards import load_generated
from specdrafter.inference.llama_server import LlamaServer
from specdrafter.jobs.data import run_data_job
from specdrafter.jobs.recipe import load_recipe

needs_llamacpp = pytest.mark.skipif(not llamacpp.installed(),
                                    reason="llama.cpp is not built (specdrafter-llamacpp install)")

SHARPEN = 30.0  # a random lm_head gives near-uniform rows: ties for the argmax, nothing for the nucleus to cut
EOS_PULL = 12.0  # how far EOS's lm_head row points along the mean final hidden state (see target_dir)
MAX_NEW = 12


def user(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A 2-layer random Llama (hidden 32, untied lm_head sharpened ×30) with SmolLM2's tokenizer. A random target
    practically never samples EOS, so EOS's lm_head row is pointed along the mean final hidden state of a few
    prompts: replies then end on EOS after a few tokens or are cut at max_new_tokens, and both paths run."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(len(smollm2_tokenizer), tie_word_embeddings=False)).eval()
    eos = smollm2_tokenizer.eos_token_id
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
        hidden = torch.cat([model.model(smollm2_tokenizer.apply_chat_template(
            user(p), add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]).last_hidden_state[0]
            for p in PROMPTS[:3]])  # [tokens, hidden]
        mean = hidden.mean(0)
        model.lm_head.weight[eos] = EOS_PULL * mean / mean.norm() ** 2
    folder = tmp_path_factory.mktemp("llamacpp-target")
    model.save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def target_gguf(target_dir) -> Path:
    out = target_dir / "target.gguf"
    llamacpp.convert(target_dir, out)
    return out


@pytest.fixture(scope="module")
def server(target_gguf):
    """llama-server on one thread, two slots (the data job keeps two requests in flight)."""
    with LlamaServer(target_gguf, threads=1, parallel=2, extra=["--jinja"]) as running:
        yield running


@pytest.fixture(scope="module")
def probed(server, smollm2_tokenizer):
    engine = ServerEngine([server.url], 2, smollm2_tokenizer)
    return engine, engine.probe(0.7, 0.95)


@needs_llamacpp
def test_the_probe_recognises_llama_server_and_asks_for_ids_and_the_plain_chain(probed, server, target_gguf):
    _, facts = probed
    (found,) = facts["servers"]
    assert found["engine"] == LLAMA_SERVER and found["model"] == str(target_gguf)
    assert found["token_ids_from_server"] is True
    assert found["extra_fields"] == {**LLAMA_SERVER_TOKEN_IDS["tokens"], **LLAMA_SERVER_FIELDS}
    assert found["plain_requests_sample"] is None and facts["servers_unreachable"] == []


def nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> dict:
    """The in-process engine's law (data/hf_engine.py:sample_tokens): id → probability."""
    probs, ids = torch.softmax(logits.double() / temperature, -1).sort(descending=True)
    kept = probs.cumsum(0) - probs < top_p
    return dict(zip(ids[kept].tolist(), (probs[kept] / probs[kept].sum()).tolist()))


def served_law(server, messages, temperature: float, top_p: float, fields: dict) -> dict:
    """The distribution llama-server draws the first token from: its probabilities after the sampling chain."""
    reply = server.post("/v1/chat/completions", {
        "messages": messages, "max_tokens": 1, "temperature": temperature, "top_p": top_p, "logprobs": True,
        "top_logprobs": 4000, "post_sampling_probs": True, **fields})
    return {t["id"]: t["prob"] for t in reply["choices"][0]["logprobs"]["content"][0]["top_probs"]}


def total_variation(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(t, 0.0) - q.get(t, 0.0)) for t in set(p) | set(q))


@needs_llamacpp
def test_the_sampling_fields_give_the_in_process_engines_law_and_the_default_chain_does_not(
        server, target_dir, smollm2_tokenizer):
    """At T = 1, top-p 0.95 the nucleus holds over a thousand tokens of a long tail: llama-server's default chain
    (top-k 40, min-p 0.05, top-p before the temperature) keeps a handful; with the fields it keeps the nucleus with
    the same probabilities (float32 logits there, float64 here: the token on the nucleus' edge may differ)."""
    model = LlamaForCausalLM.from_pretrained(target_dir).eval()
    messages = user(PROMPTS[0])
    prompt = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]  # [V]
    for temperature, top_p in ((1.0, 0.95), (0.7, 0.9)):
        want = nucleus(logits, temperature, top_p)
        got = served_law(server, messages, temperature, top_p, LLAMA_SERVER_FIELDS)
        assert len(set(got) ^ set(want)) <= 2 and total_variation(got, want) < 1e-3
    want = nucleus(logits, 1.0, 0.95)
    default = served_law(server, messages, 1.0, 0.95, {})
    assert len(want) > 1000 and len(default) < 50 and total_variation(default, want) > 0.1


@needs_llamacpp
def test_greedy_ids_are_the_targets_own_and_sampled_ones_follow_the_seed(probed, target_dir, smollm2_tokenizer,
                                                                       one_thread):
    """The ids are llama-server's own (`__verbose.tokens`), EOS included, not re-tokenised text: at T = 0 they are
    HF `generate`'s ids for the same weights."""
    engine, _ = probed
    conversations = [user(p) for p in PROMPTS[:2] + PROMPTS[4:8]]
    replies = engine.respond(conversations, MAX_NEW, 0.0, 1.0, seed=0)
    model = LlamaForCausalLM.from_pretrained(target_dir).eval()
    eos = smollm2_tokenizer.eos_token_id
    for conversation, reply in zip(conversations, replies):
        prompt = smollm2_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_tensors="pt",
                                                       return_dict=True)["input_ids"]  # [1, T]
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        assert reply == out[0, prompt.shape[1]:].tolist()  # [new tokens]
    assert any(r[-1] == eos and len(r) < MAX_NEW for r in replies)  # the EOS llama-server stopped on, returned
    assert all(eos not in r[:-1] for r in replies)
    sampled = engine.respond([conversations[0]] * 3, MAX_NEW, 0.7, 0.95, seed=3)
    assert len(set(map(tuple, sampled))) > 1  # seeds 3, 4, 5
    assert engine.respond([conversations[0]], MAX_NEW, 0.7, 0.95, seed=3) == sampled[:1]
    assert engine.counters["token_ids_retokenised"] == 0 and engine.counters["token_ids_from_server"] >= 10


@needs_llamacpp
def test_the_data_job_regenerates_through_llama_server_and_a_drafter_trains_on_it(
        server, target_dir, prompt_file, tmp_path, smollm2_tokenizer, one_thread, in_process_training):
    out = tmp_path / "data"
    stats = generate_dataset(small_data_recipe(out, target_dir, prompt_file, "data.engine=server",
                                               f"data.servers=[{server.url}]", "data.concurrency=2"))
    engine = stats["this_run"]["engine"]
    assert engine["servers"][0]["engine"] == LLAMA_SERVER and engine["token_ids_retokenised"] == 0
    assert engine["token_ids_from_server"] >= 8 and engine["skipped"] == 0
    data = load_generated(out)
    assert stats["conversations"] == len(data) == 8
    eos = smollm2_tokenizer.eos_token_id
    for row in data:
        n = row["num_prompt_tokens"]
        prompt = smollm2_tokenizer.apply_chat_template([row["messages"][0]], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"]
        assert row["input_ids"][:n] == prompt and row["loss_mask"] == [0] * n + [1] * row["num_response_tokens"]
        response = row["input_ids"][n:]
        assert 0 < len(response) <= MAX_NEW and (response[-1] == eos) == row["finished"]
        text = smollm2_tokenizer.decode(response[:-1] if row["finished"] else response)
        assert row["messages"][1] == {"role": "assistant", "content": text}
    assert 0 < stats["finished_responses"] < 8  # both paths: ended on EOS, cut at max_new_tokens
    assert json.loads((out / "stats.json").read_text())["this_run"]["engine"]["servers"][0]["engine"] == LLAMA_SERVER

    run = tmp_path / "run"
    train_loop.train(load_recipe(REPO / "recipes" / "smollm2-135m-eagle3.yaml", [
        f"output_dir={run}", f"target.model={target_dir}", f"train.data_dir={out}", *TINY_TRAINING]))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records)


@needs_llamacpp
def test_data_engine_llama_cpp_serves_the_target_itself_and_stops_it(server, target_dir, prompt_file, tmp_path,
                                                                     one_thread, caplog):
    """data.engine=llama.cpp: the job converts the target (into the cache), starts its own llama-server with
    data.concurrency slots and stops it; at T = 0 its rows are those of the same job sent to a server started by
    hand (data.engine=server), and a rerun finds every shard made and starts no server. No server of its own is
    left running."""
    caplog.set_level("INFO", logger="specdrafter")
    greedy = ["data.temperature=0", "data.concurrency=2"]
    before = set(llama_server_module._RUNNING)  # the module's own server
    by_hand = generate_dataset(small_data_recipe(tmp_path / "by-hand", target_dir, prompt_file, "data.engine=server",
                                                 f"data.servers=[{server.url}]", *greedy))
    cfg = small_data_recipe(tmp_path / "own", target_dir, prompt_file, "data.engine=llama.cpp",
                            "data.llamacpp.threads=1", *greedy)
    own = run_data_job(cfg)
    assert "llama-server of the target on" in caplog.text
    assert own["this_run"]["engine"]["servers"][0]["engine"] == LLAMA_SERVER and set(llama_server_module._RUNNING) == before
    assert own["conversations"] == by_hand["conversations"] == 8
    assert load_generated(tmp_path / "own")["input_ids"] == load_generated(tmp_path / "by-hand")["input_ids"]
    caplog.clear()
    again = run_data_job(small_data_recipe(tmp_path / "own", target_dir, prompt_file, "data.engine=llama.cpp",
                                           "data.llamacpp.threads=1", *greedy))
    assert "llama-server of the target on" not in caplog.text and "resuming: 3 of 3 shards already done" in caplog.text
    assert again["this_run"]["generated_conversations"] == 0 and set(llama_server_module._RUNNING) == before


@pytest.mark.parametrize("extra, says", [
    (["data.servers=[http://127.0.0.1:8080]"], "data.servers' is for data.engine=server"),
    (["data.llamacpp.outtype=q8_0"], "q8_0 would sample a quantised model"),
])
def test_data_engine_llama_cpp_bad_settings_are_one_line(tmp_path, target_dir, prompt_file, extra, says):
    with pytest.raises(SpecdrafterError, match=says):
        small_data_recipe(tmp_path / "data", target_dir, prompt_file, "data.engine=llama.cpp", *extra)


@needs_llamacpp
def test_a_server_with_another_chat_template_is_refused_in_one_line(target_gguf, smollm2_tokenizer):
    """The GGUF's own SmolLM2 template replaced by llama.cpp's built-in Llama 3 one: the prompt ids llama-server
    feeds its model (/apply-template, /tokenize) are not the target's."""
    with LlamaServer(target_gguf, threads=1, extra=["--jinja", "--chat-template", "llama3"]) as other:
        with pytest.raises(SpecdrafterError) as e:
            ServerEngine([other.url], 1, smollm2_tokenizer).probe(0.7, 0.95)
    message = str(e.value)
    assert "\n" not in message and other.url in message
    assert "tokenizer or chat template is not the target's" in message and "prompt token ids differ" in message


@pytest.mark.parametrize("tokens, content, expected", [
    ([9906, 2], "Hello", [9906, 2]),  # the sampled ids, EOS included
    ([], "", []),  # an empty reply
    ([], "Hello", None),  # return_tokens not honoured: no ids, the text would be re-tokenised
])
def test_llama_servers_ids_are_read_from_its_verbose_field(tokens, content, expected):
    """The shape llama-server's chat endpoint answers with "return_tokens" and "verbose" (no server needed)."""
    payload = {"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 7, "completion_tokens": len(tokens)},
               "__verbose": {"tokens": tokens, "stop_type": "eos", "prompt": "..."}}
    reply = parse_reply(payload)
    assert reply.token_ids == expected and reply.content == content and reply.prompt_tokens == 7


@needs_llamacpp
def test_another_llama_server_build_and_its_environment_are_used_when_given(target_gguf, tmp_path):
    """LlamaServer(binary=, env=): the benchmarks run a patched build beside the pinned one, with its switch set."""
    copy = tmp_path / "llama-server-copy"
    copy.write_bytes(llamacpp.binary("llama-server").read_bytes())
    copy.chmod(0o755)
    with LlamaServer(target_gguf, threads=1, binary=copy, env={"SPECDRAFTER_PROBE": "1"}) as running:
        pid = running.process.pid
        assert Path(f"/proc/{pid}/exe").resolve() == copy.resolve()
        assert b"SPECDRAFTER_PROBE=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
