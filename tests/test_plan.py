"""The planner (jobs/plan.py, launch/plan.py): cluster recipes planned on the meta device in seconds, one line per
failing sanity check, and the launchers' check silent on CPU."""

import json
import runpy
import sys

import pytest
import torch
from conftest import REPO
from transformers import Qwen2Config, Qwen3NextConfig

from specdrafter.core.io import SpecdrafterError
from specdrafter.jobs.plan import GIB, Setup, make_plan, meta_counts, model_states, preflight, target_config
from specdrafter.jobs.plan import main as plan_main
from specdrafter.jobs.recipe import load_recipe
from specdrafter.models.targets import serving_cache_bytes

LLAMA8B = REPO / "recipes" / "llama8b.yaml"
EIGHT = Setup(world=8, gpus_per_node=8)
LAUNCHERS = [("train_eagle.py", "llama8b.yaml"), ("train_medusa.py", "llama8b-medusa.yaml"),
             ("train_draft.py", "llama8b-draft.yaml"), ("train_block.py", "llama8b-dspark.yaml")]


def plan_of(recipe=LLAMA8B, *overrides, setup=EIGHT):
    return make_plan(load_recipe(recipe, list(overrides)), str(recipe), setup)


def failures(plan):
    return plan.problems()


@pytest.fixture(scope="module")
def llama8b():
    return plan_of()


def test_llama8b_plan_counts_and_fits(llama8b):
    c = llama8b.counts
    assert 8.0e9 < c.target < 8.1e9  # Llama-3.1-8B from recipes/targets, no weights
    assert 4.0e8 < c.trainable < 4.5e8 and c.frozen == 0  # the EAGLE-3 head with a 32k draft vocabulary
    assert llama8b.terms["target weights"] == 2 * c.target
    assert set(llama8b.terms) >= {"drafter weights", "gradients", "optimizer state", "activations", "teacher logits"}
    assert llama8b.fits and not failures(llama8b)
    assert llama8b.data["cache_per_million"] == 4 * 4096 * 2 * 10**6  # layers 2, 16, 29, 32 in bf16


def test_plan_text_has_every_section(llama8b):
    from specdrafter.jobs.plan import format_plan

    text = format_plan(llama8b, load_recipe(LLAMA8B))
    for needle in ("per rank", "total", "teacher logits", "data job: recipes/llama8b-data.yaml",
                   "per 1M tokens", "per node (8 GPU(s), 1 node(s))", "checks"):
        assert needle in text


def test_aux_layer_out_of_range_is_one_line():
    problems = failures(plan_of(LLAMA8B, "drafter.eagle.aux_layer_ids=[2,16,40]"))
    assert problems and "'drafter.eagle.aux_layer_ids'" in problems[0] and "40" in problems[0]
    assert "\n" not in problems[0]


def test_draft_vocab_beyond_vocab():
    problems = failures(plan_of(LLAMA8B, "drafter.eagle.draft_vocab_size=200000"))
    assert "'drafter.eagle.draft_vocab_size' (200000) exceeds" in problems[0]


def test_ttt_steps_beyond_positions():
    problems = failures(plan_of(LLAMA8B, "train.max_length=131070", "train.gpu_memory_gb=100000"))
    assert "'drafter.eagle.ttt_steps' (7) reach position 131076" in problems[0]


def test_world_size_against_batch(tmp_path):
    (tmp_path / "stats.json").write_text(json.dumps({"conversations": 300, "tokens": 300_000, "shards": 1}))
    ok = plan_of(LLAMA8B, f"train.data_dir={tmp_path}")
    assert not failures(ok) and ok.data["measured"]
    problems = failures(plan_of(LLAMA8B, f"train.data_dir={tmp_path}", setup=Setup(world=64, gpus_per_node=8)))
    assert problems[0].startswith("recipe keys 'train.micro_batch_size' / 'train.grad_accum': 44 training")


def test_data_job_is_the_saved_recipe_then_train_data_recipe_then_this_one(tmp_path):
    """The data facts come from the recipe.yaml the data job saved in train.data_dir once it ran, before that from
    the recipe train.data_recipe names (recipes/llama8b-data.yaml: 200000 conversations of ≤ 4 turns), and without
    one from this recipe's own data section."""
    named = plan_of(LLAMA8B, f"train.data_dir={tmp_path}").data
    assert named["job"] == "recipes/llama8b-data.yaml" and named["conversations"] == 200_000
    assert named["per_conversation"] == 4 * (1024 + 1024 + 32)
    (tmp_path / "recipe.yaml").write_text("output_dir: x\ndata: {num_conversations: 300, max_turns: 1}\n")
    saved = plan_of(LLAMA8B, f"train.data_dir={tmp_path}").data
    assert saved["job"] == str(tmp_path / "recipe.yaml") and saved["conversations"] == 300
    own = plan_of(LLAMA8B, f"train.data_dir={tmp_path / 'none'}", "train.data_recipe=null", "data.num_conversations=7").data
    assert own["job"] == "this recipe's data section" and own["conversations"] == 7
    with pytest.raises(SpecdrafterError, match="^recipe key 'train.data_recipe': no recipe 'nothing.yaml'"):
        plan_of(LLAMA8B, "train.data_recipe=nothing.yaml")


def test_memory_that_does_not_fit_names_the_term_and_key():
    plan = plan_of(LLAMA8B, "train.gpu_memory_gb=20")
    assert not plan.fits
    line = failures(plan)[0]
    assert line.startswith("does not fit:") and "biggest term activations" in line and "train.micro_batch_size" in line


def test_offline_cache_missing_layers(tmp_path):
    (tmp_path / "stats.json").write_text(json.dumps({"conversations": 900, "tokens": 10**6, "shards": 1,
                                                     "hidden_state_layers": [2, 16, 32]}))
    problems = failures(plan_of(LLAMA8B, f"train.data_dir={tmp_path}", "train.features=offline"))
    assert "offline needs layers [2, 16, 29, 32]" in problems[0]


def test_zero_partitions_optimizer_state():
    cfg = load_recipe(LLAMA8B)
    counts = meta_counts(cfg, target_config(cfg.target.model))
    one, eight = (model_states(cfg, counts, Setup(world=n, gpus_per_node=n)) for n in (1, 8))
    assert eight.optimizer * 8 == pytest.approx(one.optimizer, rel=1e-6)
    assert eight.grads_kept * 8 == pytest.approx(one.grads_kept, rel=1e-6)


def test_draft_model_from_shipped_config_and_medusa():
    draft = plan_of(REPO / "recipes" / "llama8b-draft.yaml")
    assert draft.counts.frozen > 1e9 and draft.counts.trainable < 1e8  # Llama-3.2-1B base + LoRA r=64
    medusa = plan_of(REPO / "recipes" / "llama8b-medusa.yaml")
    assert medusa.counts.trainable > 2.5e9  # 5 heads × (d² + d·V)
    assert medusa.terms["activations"] > 10 * GIB  # [rows, 128k vocabulary] per head


def test_dspark_plan_counts_its_layers_and_blocks():
    """5 Llama-8B-wide layers, fc over 5 features and the heads are trainable; the target is not. The activations grow
    with the blocks per sequence (drafter.block.anchors) and fit."""
    dspark = plan_of(REPO / "recipes" / "llama8b-dspark.yaml")
    d, I = 4096, 14336
    layer = 2 * d * d + 2 * (d // 4) * d + 3 * d * I  # q, o [d, d]; k, v [d/4, d] (8 of 32 heads); the MLP
    heads = 128256 * 256 + 32000 * 256 + (d + 256 + 1)  # Markov W1, W2 (draft vocabulary) and the confidence head
    assert dspark.counts.trainable == pytest.approx(5 * layer + 5 * d * d + heads, rel=1e-3)
    assert dspark.fits and not failures(dspark)
    fewer = plan_of(REPO / "recipes" / "llama8b-dspark.yaml", "drafter.block.anchors=64")
    assert fewer.terms["activations"] < dspark.terms["activations"] / 2


# Public totals from the model cards (Gemma 3 27B's: its language model, the vision tower not loaded); "active" is
# what one token's forward multiplies by (gpt-oss's cards count 3.6 B and 5.1 B that way, without the embedding
# lookup; Qwen3-30B-A3B's 3.3 B counts its embedding too).
HUB_TARGETS = [("Qwen/Qwen3-8B", 8.19e9, 7.57e9), ("Qwen/Qwen3-30B-A3B", 30.5e9, 3.04e9),
               ("openai/gpt-oss-20b", 20.9e9, 3.6e9), ("openai/gpt-oss-120b", 116.8e9, 5.1e9),
               ("google/gemma-3-27b-it", 27.0e9, 27.0e9), ("mistralai/Mistral-Small-24B-Instruct-2501", 23.6e9, 22.9e9),
               ("deepseek-ai/DeepSeek-V3", 671e9, 36.6e9)]


@pytest.mark.parametrize("model,total,active", HUB_TARGETS, ids=[m.split("/")[1] for m, _, _ in HUB_TARGETS])
def test_each_shipped_hub_target_counts_its_published_parameters(model, total, active):
    """recipes/targets/ configs build on the meta device into the published totals (all experts: every rank holds
    them) and the active count: routed experts count num_experts_per_tok of their rows."""
    c = plan_of(LLAMA8B, f"target.model={model}", "drafter.eagle.aux_layer_ids=[1,2,3]",
                "drafter.eagle.draft_vocab_size=1000", "train.max_length=256").counts
    assert c.target == pytest.approx(total, rel=0.005)
    assert c.target_active == pytest.approx(active, rel=0.01)


# Serving KV cache per sequence at 32,768 tokens, bf16, by hand from each published config:
# Qwen3-8B 36 layers × 2 (K, V) × 8 heads × 128 × 2 B = 144 KiB a position; gpt-oss-20b 12 full layers × 2 × 8 × 64 ×
# 2 B a position plus 12 sliding ones holding their last 128; DeepSeek-V3's MLA 61 × (512 latent + 64 RoPE key) × 2 B;
# Gemma-3-27B 10 full of 62 layers × 2 × 16 × 128 × 2 B, the other 52 capped at their window of 1,024.
KIB = 1024
SERVING = [("Qwen/Qwen3-8B", 144 * KIB * 32768), ("openai/gpt-oss-20b", 12 * 2048 * 32768 + 12 * 2048 * 128),
           ("deepseek-ai/DeepSeek-V3", 61 * 576 * 2 * 32768),
           ("google/gemma-3-27b-it", 10 * 8 * KIB * 32768 + 52 * 8 * KIB * 1024),
           ("meta-llama/Llama-3.1-8B-Instruct", 128 * KIB * 32768)]


@pytest.mark.parametrize("model,expected", SERVING, ids=[m.split("/")[1] for m, _ in SERVING])
def test_the_plan_gives_the_serving_kv_cache_each_architecture_keeps(model, expected):
    """What an engine caches per sequence: full layers every position, sliding layers their window, MLA its compressed
    latent; printed in the plan."""
    assert serving_cache_bytes(target_config(model), 32768) == expected
    plan = plan_of(LLAMA8B, f"target.model={model}", "drafter.eagle.aux_layer_ids=[1,2,3]",
                   "drafter.eagle.draft_vocab_size=1000", "train.max_length=256")
    assert plan.serving_cache[32768] == expected


def test_a_linear_attention_layers_state_does_not_grow_with_the_context():
    config = Qwen3NextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    full = 2 * 2 * 16 * 2  # one full-attention layer of four: K and V, 2 heads × 16, bf16, a position
    state = 3 * (4 * 16 * 16 + (2 * 32 + 64) * 3) * 2  # three linear layers: the state and the conv's last 3 inputs
    assert [serving_cache_bytes(config, n) for n in (1, 100)] == [state + full, state + 100 * full]


HUB_RECIPES = ["qwen3-8b-eagle3.yaml", "qwen3-8b-dspark.yaml", "gpt-oss-20b-eagle3.yaml"]


@pytest.mark.parametrize("recipe", HUB_RECIPES)
def test_hub_recipes_plan_within_their_named_gpu(recipe):
    """The shipped Qwen3-8B and gpt-oss-20b recipes name an 80 GB GPU (train.gpu_memory_gb) and plan within it, every
    check ok, their data job's recipe found."""
    plan = plan_of(REPO / "recipes" / recipe)
    assert plan.budget_gb == 80 and plan.fits and not failures(plan)
    assert plan.data["job"].startswith("recipes/") and plan.data["job"].endswith("-data.yaml")


def test_gpt_oss_eagle3_at_2048_tokens_does_not_fit_80gb_and_names_the_activations():
    """gpt-oss's 64 query heads: at 2048 tokens the head's 7 TTT steps of fp32 attention probabilities overflow 80 GB,
    which is why its recipe trains at 1536."""
    plan = plan_of(REPO / "recipes" / "gpt-oss-20b-eagle3.yaml", "train.max_length=2048")
    assert not plan.fits and "activations" in " ".join(failures(plan))


def test_per_node_numbers(llama8b):
    from specdrafter.jobs.plan import format_plan

    two = plan_of(setup=Setup(world=16, gpus_per_node=8))
    assert two.setup.nodes == 2
    assert "2 node(s) × 8 GPU(s) = world 16" in format_plan(two, load_recipe(LLAMA8B))
    assert two.terms["optimizer state"] < llama8b.terms["optimizer state"]


def test_cli_prints_plan_and_fails_in_one_line(capsys):
    plan_main([str(LLAMA8B), "--nodes", "2", "--gpus-per-node=4"])
    out = capsys.readouterr()
    assert "2 node(s) × 4 GPU(s) = world 8" in out.out
    assert out.err == ""  # the plan is the output: no resolved recipe before it
    with pytest.raises(SystemExit, match="^error: does not fit"):
        plan_main([str(LLAMA8B), "train.gpu_memory_gb=10", "--nodes=2"])
    assert "world 16" in capsys.readouterr().out  # the whole plan before the failing line
    with pytest.raises(SystemExit, match="^error: --gpus-per-node needs a positive integer, got '0'$"):
        plan_main([str(LLAMA8B), "--gpus-per-node", "0"])
    with pytest.raises(SystemExit, match=r"^usage: .* RECIPE.yaml \[key=value ...\] \[--nodes N\] \[--gpus-per-node N\]"):
        plan_main(["--nodes", "2"])


def launch(monkeypatch, script: str, *args: str) -> str:
    """Run launch/<script> in this process as `python launch/<script> ARGS` would; its exit message."""
    monkeypatch.setattr(sys, "argv", [f"launch/{script}", *args])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(REPO / "launch" / script), run_name="__main__")
    return done.value.code


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: on a GPU the check runs")
@pytest.mark.parametrize("script,recipe", LAUNCHERS)
def test_on_cpu_the_launchers_go_past_the_check_to_training(script, recipe, tmp_path, capsys, monkeypatch,
                                                            in_process_training):
    """A memory budget no plan fits is no reason to refuse on CPU: the launcher says nothing about a plan and reaches
    training, which stops at its first own check (no data job given)."""
    code = launch(monkeypatch, script, str(REPO / "recipes" / recipe), "train.gpu_memory_gb=1", "train.data_dir=null",
                  f"output_dir={tmp_path / 'run'}")
    assert code.startswith("error: recipe key 'train.data_dir' is required"), code
    printed = capsys.readouterr()
    assert "plan:" not in printed.out + printed.err


def test_unknown_hub_target_is_one_line(monkeypatch):
    def offline(name, *args, **kwargs):
        raise OSError(f"{name} is not a local folder and the hub is unreachable")

    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", offline)
    with pytest.raises(SpecdrafterError, match="no config for model 'nobody/Nothing-1B'.*recipes/targets/Nothing-1B.json"):
        plan_of(LLAMA8B, "target.model=nobody/Nothing-1B")


def fake_gpus(monkeypatch, count: int, gib: int = 80) -> None:
    """torch reports `count` CUDA devices of `gib` GiB each (the planner reads nothing else of a GPU)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # if jobs/train.py is first imported below: DeepSpeed stays on the CPU
    props = type("Props", (), {"total_memory": gib * GIB})
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: count)
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda index: props)


def test_preflight_on_cuda_prints_one_line_or_refuses(capsys, monkeypatch):
    fake_gpus(monkeypatch, 8)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    plan = preflight(load_recipe(LLAMA8B))
    assert plan.setup.world == 8 and plan.budget_source == "this GPU"
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("plan: ") and "of 80 GiB per GPU" in out[0]
    with pytest.raises(SpecdrafterError, match="^does not fit.*train.gpu_memory_gb"):
        preflight(load_recipe(LLAMA8B, ["train.gpu_memory_gb=30"]))
    with pytest.raises(SpecdrafterError, match="aux_layer_ids"):
        preflight(load_recipe(LLAMA8B, ["drafter.eagle.aux_layer_ids=[2,16,33]"]))


@pytest.mark.parametrize("script,recipe", LAUNCHERS)
def test_on_cuda_the_launchers_refuse_a_plan_that_does_not_fit_before_training(script, recipe, tmp_path, monkeypatch):
    """On a GPU the launcher's first act after the recipe is the plan: 10 GiB cannot hold the 8B target, so it exits
    with the planner's one line, before training makes its output_dir or loads anything."""
    fake_gpus(monkeypatch, 1)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)  # one process on one GPU
    code = launch(monkeypatch, script, str(REPO / "recipes" / recipe), "train.gpu_memory_gb=10",
                  f"output_dir={tmp_path / 'run'}")
    assert code.startswith("error: does not fit: ") and "train.gpu_memory_gb" in code and "\n" not in code, code
    assert code.endswith("(launch/plan.py prints the whole plan)")
    assert not (tmp_path / "run").exists()


def test_a_bf16_target_too_big_for_the_gpu_says_so_rather_than_suggesting_bf16():
    """Gemma 3 27B's language model in bf16 is 50 GiB on every rank: the plan names the target, already at 2 bytes a
    weight, and asks for more memory; an fp32 target is told to go bf16."""
    overrides = ["target.model=google/gemma-3-27b-it", "drafter.eagle.aux_layer_ids=[2,31,59]"]
    bf16 = " ".join(failures(plan_of(LLAMA8B, *overrides)))
    assert "biggest term target weights" in bf16 and "already at 2 bytes a weight: use GPUs with more memory" in bf16
    fp32 = " ".join(failures(plan_of(LLAMA8B, *overrides, "target.dtype=float32")))
    assert "change target.dtype=bfloat16" in fp32


def test_a_gguf_target_is_planned_from_its_converted_folder_or_named_to_fetch(tmp_path, monkeypatch):
    """qwen2.5-coder-1.5b-instruct, a built-in GGUF target, is read from its converted folder in the cache; before
    it is converted the planner says what to run, in one line."""
    monkeypatch.setenv("SPECDRAFTER_CACHE", str(tmp_path))
    with pytest.raises(SpecdrafterError, match=r"^the built-in target 'qwen2.5-coder-1.5b-instruct' is not converted "
                                               r"yet: run python launch/fetch_assets.py qwen2.5-coder-1.5b-instruct$"):
        target_config("qwen2.5-coder-1.5b-instruct")
    folder = tmp_path / "models" / "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M"
    folder.mkdir(parents=True)
    Qwen2Config(hidden_size=64, num_hidden_layers=3).save_pretrained(folder)
    assert target_config("qwen2.5-coder-1.5b-instruct").num_hidden_layers == 3
