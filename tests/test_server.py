"""Serving-engine client against real `transformers serve` processes (SmolLM2 on CPU, fp32): greedy replies equal
`model.generate`, the probe switches sampling on and refuses other tokenizers, dead servers are dropped."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from conftest import PROMPTS, REPO
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import RecipeError
from specdrafter.data.assets import load_target
from specdrafter.data.server import SAMPLING_MESSAGES, TRANSFORMERS_SAMPLING, ServerEngine, parse_reply
from specdrafter.jobs.recipe import load_recipe

START_TIMEOUT_S = 180
SERVE = "from transformers.cli.transformers import main; main()"  # `transformers serve`, from this interpreter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder, log_path):
    """`transformers serve FOLDER` on a free local port, pinned to the folder, offline, on one CPU thread (two
    threads on a shared 2-core machine made a 1-token request take 4 s instead of 0.2 s). Returns (process, URL)."""
    port = free_port()
    with open(log_path, "w") as log:  # the server writes to its own copy of the file descriptor
        process = subprocess.Popen([sys.executable, "-c", SERVE, "serve", str(folder), "--host", "127.0.0.1",
                                    "--port", str(port), "--device", "cpu", "--dtype", "float32"],
                                   stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    return process, f"http://127.0.0.1:{port}"


def wait_until_ready(process, url, log_path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"transformers serve exited ({process.returncode}): {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(0.25)
    pytest.fail(f"transformers serve did not answer {url}/v1/models within {START_TIMEOUT_S} s: "
                f"{log_path.read_text()[-2000:]}")


def stop(process) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def servers(smollm2_dir, tmp_path_factory):
    """Two servers of the target, started together; the second is for the test that kills one mid-run."""
    logs = tmp_path_factory.mktemp("serve")
    started = [start_server(smollm2_dir, logs / f"serve-{i}.log") for i in range(2)]
    try:
        for i, (process, url) in enumerate(started):
            wait_until_ready(process, url, logs / f"serve-{i}.log")
        yield started
    finally:
        for process, _ in started:
            stop(process)


@pytest.fixture(scope="module")
def url(servers) -> str:
    return servers[0][1]


@pytest.fixture(scope="module")
def probed(url, smollm2_tokenizer):
    """(engine, what its probe found): probed for sampling at temperature 1; one request at a time, so that seeds
    reproduce (see the test below)."""
    engine = ServerEngine([url], 1, smollm2_tokenizer)
    return engine, engine.probe(1.0, 1.0)


@pytest.fixture(scope="module")
def engine(probed):
    return probed[0]


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def user(text):
    return [{"role": "user", "content": text}]


def one_line(e) -> str:
    message = str(e.value)
    assert message and "\n" not in message
    return message


def test_probe_finds_greedy_plain_requests_and_switches_sampling_on(probed, url, smollm2_dir):
    _, facts = probed
    (server,) = facts["servers"]
    assert server["url"] == url and server["model"] == str(smollm2_dir)
    assert server["plain_requests_sample"] is False  # SmolLM2's generation config has no do_sample
    assert server["extra_fields"] == TRANSFORMERS_SAMPLING and server["token_ids_from_server"] is False
    assert facts["servers_unreachable"] == []


def test_greedy_replies_are_the_targets_generate_ids(engine, smollm2_dir, smollm2_tokenizer):
    """Exact for these prompts: the server runs the same fp32 weights through the same unbatched `generate`. In
    general re-tokenised ids can differ from generated ones (a model may emit a non-canonical split of a word),
    and `transformers serve` reports "length" for a reply whose EOS is the last token allowed, so it loses its EOS."""
    conversations = [user("Name three colors."), user(PROMPTS[0])]
    replies = engine.respond(conversations, 16, 0.0, 1.0, seed=0)
    model, _ = load_target(str(smollm2_dir), "float32")
    eos = smollm2_tokenizer.eos_token_id
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server: the same reduction order, and no fight over the cores
    try:
        for conversation, reply in zip(conversations, replies):
            prompt = smollm2_tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                           return_tensors="pt", return_dict=True)["input_ids"]  # [1, T]
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            assert reply == out[0, prompt.shape[1]:].tolist()  # [new tokens]
    finally:
        torch.set_num_threads(threads)
    finished, cut = replies
    assert finished[-1] == eos and len(finished) < 16  # stopped on its own: closed by EOS
    assert eos not in cut and len(cut) == 16  # hit max_new_tokens: no EOS
    assert smollm2_tokenizer.decode(finished[:-1]) == "1. Red\n2. Blue\n3. Green"
    assert engine.counters["token_ids_retokenised"] >= 2 and engine.counters["skipped"] == 0


def test_sampled_replies_differ_by_seed_and_reproduce(engine):
    """`transformers serve` seeds torch's global generator when a request arrives: reruns reproduce one request at
    a time (concurrency 1), not when requests overlap."""
    first, second = engine.respond([SAMPLING_MESSAGES, SAMPLING_MESSAGES], 12, 1.0, 1.0, seed=5)
    assert first != second and len(first) <= 12 and len(second) <= 12
    assert engine.respond([SAMPLING_MESSAGES], 12, 1.0, 1.0, seed=5) == [first]


def other_vocabulary(smollm2_tokenizer):
    """A byte-level BPE of 400 tokens trained on a few prompts, with the target's special tokens and chat template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(PROMPTS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                   chat_template=smollm2_tokenizer.chat_template)


def other_chat_template(smollm2_dir):
    """The target's vocabulary, but a chat template without SmolLM2's default system prompt."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                               "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
                               "{{ '<|im_start|>assistant\n' }}{% endif %}")
    return tokenizer


@pytest.mark.parametrize("variant", ["vocabulary", "chat_template"])
def test_probe_refuses_a_tokenizer_that_is_not_the_servers(variant, url, smollm2_dir, smollm2_tokenizer):
    tokenizer = other_vocabulary(smollm2_tokenizer) if variant == "vocabulary" else other_chat_template(smollm2_dir)
    with pytest.raises(SpecdrafterError) as e:
        ServerEngine([url], 2, tokenizer).probe(0.0, 1.0)
    assert "tokenizer or chat template is not the target's" in one_line(e) and url in str(e.value)
    assert "the probe prompt is" in str(e.value)


def test_unreachable_server_is_refused_in_one_line(smollm2_tokenizer):
    dead = dead_url()
    with pytest.raises(SpecdrafterError) as e:
        ServerEngine([dead], 2, smollm2_tokenizer, retries=1).probe(0.7, 0.95)
    assert one_line(e).startswith("no server reachable") and dead in str(e.value)


def test_dead_server_is_dropped_and_the_live_one_answers(url, smollm2_tokenizer):
    dead = dead_url()
    engine = ServerEngine([dead, url], 4, smollm2_tokenizer, retries=1)
    assert engine.probe(0.0, 1.0)["servers_unreachable"] == [dead]
    replies = engine.respond([user(p) for p in PROMPTS[:3]], 6, 0.0, 1.0, seed=0)
    assert all(len(r) == 6 for r in replies)
    assert engine.counters["servers_dropped"] == 1 and engine.counters["requests"] == 3


def test_a_server_that_dies_mid_run_is_dropped_and_its_requests_go_to_the_other(servers, smollm2_tokenizer):
    (_, live), (doomed, dying) = servers
    engine = ServerEngine([live, dying], 4, smollm2_tokenizer, retries=1)
    alone = ServerEngine([dying], 1, smollm2_tokenizer, retries=1)
    engine.probe(0.0, 1.0)
    alone.probe(0.0, 1.0)
    stop(doomed)
    replies = engine.respond([user(p) for p in PROMPTS[:4]], 6, 0.0, 1.0, seed=0)
    assert all(len(r) == 6 for r in replies)
    counters = engine.counters
    assert counters["servers_dropped"] == 1 and counters["failures"] >= 2 and counters["skipped"] == 0
    assert counters["retries"] == counters["failures"] and counters["requests"] == 4 + counters["retries"]
    with pytest.raises(SpecdrafterError) as e:
        alone.respond([user(PROMPTS[0])], 6, 0.0, 1.0, seed=0)
    assert one_line(e).startswith("every server failed") and dying in str(e.value)


@pytest.mark.parametrize("choice", [
    {"token_ids": [9906, 2]},  # vLLM and SGLang with "return_token_ids": true
    {"logprobs": {"content": [{"token": "token_id:9906", "logprob": -0.1}, {"token": "token_id:2", "logprob": 0.0}]}},
])
def test_token_ids_are_read_from_either_reply_shape(choice):
    """The shapes vLLM and SGLang document (no such server here: this checks the reading, not the request)."""
    payload = {"choices": [{"message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop", **choice}],
               "usage": {"prompt_tokens": 7, "completion_tokens": 2}}
    reply = parse_reply(payload)
    assert reply.token_ids == [9906, 2] and reply.content == "Hello" and reply.prompt_tokens == 7


DATA_RECIPE = REPO / "recipes" / "smollm2-135m-data.yaml"


@pytest.mark.parametrize("overrides,expected", [
    (["data.engine=server"], "recipe key 'data.servers' must list at least one server URL with data.engine=server"),
    (["data.engine=server", "data.servers=[localhost:8000]"], "'localhost:8000' is not an http(s) URL"),
    (["data.servers=[http://h:8000/v1/chat/completions]"], "base URL"),
    (["data.concurrency=0"], "recipe key 'data.concurrency' must be >= 1"),
])
def test_recipe_rejects_bad_server_settings(overrides, expected):
    with pytest.raises(RecipeError) as e:
        load_recipe(DATA_RECIPE, overrides)
    assert expected in one_line(e)


def test_recipe_accepts_server_urls():
    cfg = load_recipe(DATA_RECIPE, ["data.engine=server", "data.servers=[http://127.0.0.1:8000,https://gpu-1/v1]",
                                    "data.concurrency=32"])
    assert list(cfg.data.servers) == ["http://127.0.0.1:8000", "https://gpu-1/v1"] and cfg.data.concurrency == 32


def test_engine_rejects_a_malformed_url(smollm2_tokenizer):
    with pytest.raises(SpecdrafterError) as e:
        ServerEngine(["gpu-1:8000"], 1, smollm2_tokenizer)
    assert "'gpu-1:8000' is not an http(s) URL" in one_line(e)


def test_data_job_through_the_server_writes_the_in_process_engines_shards(url, smollm2_dir, tmp_path):
    """The data job end to end through a real server: greedy two-turn conversations land in shards with the same
    columns, token ids, loss masks and messages as the in-process engine's, and stats.json records the server."""
    import datasets

    from specdrafter.data.regenerate import generate_dataset
    from specdrafter.data.shards import load_generated
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"c{i}", "turns": [t, "Say it again in other words."]}) + "\n"
                               for i, t in enumerate(["Reply in one word: what colour is the sky?",
                                                      "Name one planet.", "Say only: hello."])))
    common = [f"target.model={smollm2_dir}", "target.dtype=float32", f"data.prompts={prompts}", "data.responses=target",
              "data.exclude=[]", "data.num_conversations=3", "data.shard_size=2", "data.max_turns=2", "data.temperature=0",
              "data.max_new_tokens=12", "data.min_prompt_tokens=3", "data.hidden_states.layer_ids=[]"]
    stats = {}
    for engine, extra in (("hf", []), ("server", ["data.engine=server", f"data.servers=[{url}]", "data.concurrency=2"])):
        stats[engine] = generate_dataset(load_recipe(DATA_RECIPE, [f"output_dir={tmp_path / engine}", *common, *extra]))
    hf, served = load_generated(tmp_path / "hf"), load_generated(tmp_path / "server")
    assert hf.column_names == served.column_names and hf.features == served.features
    assert [p.name for p in sorted((tmp_path / "hf" / "shards").iterdir())] == \
        [p.name for p in sorted((tmp_path / "server" / "shards").iterdir())]
    assert hf.to_dict() == served.to_dict()  # greedy: the same target gives the same conversations
    assert max(hf["num_turns"]) == 2
    assert stats["server"]["this_run"]["engine"]["requests"] >= 3
    assert stats["server"]["response_tokens"] == stats["hf"]["response_tokens"]
    assert isinstance(datasets.load_from_disk(str(next((tmp_path / "server" / "shards").iterdir()))), datasets.Dataset)
