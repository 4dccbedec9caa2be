"""Recipe regression: a fixed tiny run of each drafter kind, trained through the real loop (jobs/train.py under
DeepSpeed, a world of one), logs these exact per-step losses. A change to the data order, the batching, a drafter,
an objective, the optimizer or the schedule moves them; a deliberate change re-records them (copy the
new numbers from the failure's captured output, after checking that the change was meant to move them)."""

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

import specdrafter.jobs.train as train_loop
from specdrafter.data.regenerate import generate_dataset
from specdrafter.jobs.recipe import load_recipe

STEPS = 3
# Teacher-forced answers (data.responses=dataset): the data job samples nothing, so the data is fixed text.
FACTS = ["Rivers carry water from the hills down to the sea.", "Bees make honey from the nectar of flowers.",
         "Glass is made by melting sand at a high temperature.", "Owls hunt at night and sleep during the day.",
         "Tea leaves are dried before they are brewed.", "Salt keeps food from spoiling for a long time.",
         "Clouds form when warm air rises and cools.", "Chess is played on a board of sixty-four squares.",
         "Bread rises because yeast makes bubbles of gas.", "Maps show places smaller than they really are."]
# Shrinks the SmolLM2 recipes to conftest's 2-layer target, fp32 throughout (no bf16 autocast); lr, objective and
# decay stay each recipe's own. The random target's logits are near-uniform at T = 1, where every drafter's loss is
# its entropy and barely moves (halving the lr hides within rtol 1e-4): T = 0.05 gives the teacher a shape to learn.
TINY = ["target.dtype=float32", "train.precision=fp32", "train.features=online", "train.temperature=0.05",
        "train.max_length=64", "train.micro_batch_size=2", "train.heldout=2", "train.warmup_steps=1", "train.seed=0",
        f"train.max_steps={STEPS}", "train.eval_every=1", f"train.save_every={STEPS}", "train.wandb.mode=disabled",
        "drafter.num_layers=1", "drafter.medusa.num_heads=2", "drafter.eagle.aux_layer_ids=[0,1,2]",
        "drafter.eagle.draft_vocab_size=256", "drafter.eagle.ttt_steps=2", "drafter.block.num_layers=1",
        "drafter.block.block_size=4", "drafter.block.aux_layer_ids=[1]", "drafter.block.anchors=8",
        "drafter.block.markov_rank=8", "drafter.block.draft_vocab_size=256", "inference.k=3"]
RUNS = {  # kind: (recipe, overrides)
    "draft_model": ("smollm2-135m-draft", []),
    "medusa": ("smollm2-135m-medusa", ["drafter.medusa.stage=1"]),
    "eagle3": ("smollm2-135m-eagle3", []),
    "eagle1": ("smollm2-135m-eagle3", ["drafter.kind=eagle1"]),
    "eagle31": ("smollm2-135m-eagle31", []),  # EAGLE-3 with fc_norm and norm_output
    "dflash": ("smollm2-135m-dflash", []),
    "dflash_dpace": ("smollm2-135m-dflash", ["drafter.block.loss_weighting=dpace"]),  # D-PACE's row weights
    "dspark": ("smollm2-135m-dspark", []),
    # the selector over the full vocabulary (a pruned one is refused), 4 candidates, rank 8
    "dflash2": ("smollm2-135m-dflash2", ["drafter.block.draft_vocab_size=0", "drafter.block.selector_top_k=4",
                                         "drafter.block.selector_rank=8"]),
    # the GRU correction over the full vocabulary (a pruned one is refused), small widths; λ falls 1 → 0 over the run
    "domino": ("smollm2-135m-domino", ["drafter.block.draft_vocab_size=0", "drafter.block.gru_hidden_dim=16",
                                       "drafter.block.correction_dim=8"]),
    "peagle": ("smollm2-135m-peagle", ["drafter.peagle.depths=3"]),  # K = 3: depth 0 and two masked slots, COD
}
# Recorded with this file; without one_thread, OMP_NUM_THREADS=1 and 2 gave these very bits as well.
EXPECTED = {
    "draft_model": [0.178634, 0.163110, 0.142609],
    "medusa": [24.3368, 24.5474, 23.2845],
    "eagle3": [13.2767, 13.1302, 13.7931],
    "eagle1": [1.36815, 1.31366, 1.31618],
    "eagle31": [15.2984, 14.5914, 12.9230],
    "dflash": [30.8389, 30.5925, 30.8996],
    "dflash_dpace": [16.9659, 16.9793, 16.7856],
    "dspark": [6.88394, 6.75242, 6.71308],
    "dflash2": [37.3063, 37.4204, 37.0271],
    "domino": [32.2691, 31.9219, 32.1467],
    "peagle": [2.95053, 2.96297, 2.93300],
}


@pytest.fixture(scope="module")
def fixed_data(tmp_path_factory, tiny_target) -> Path:
    root = tmp_path_factory.mktemp("regression-data")
    rows = [{"id": f"f{i}", "conversations": [{"from": "human", "value": f"Tell me one fact, number {i}."},
                                             {"from": "gpt", "value": fact}]} for i, fact in enumerate(FACTS)]
    prompts = root / "facts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    generate_dataset(load_recipe(REPO / "recipes" / "smollm2-135m-data.yaml", [
        f"output_dir={root / 'data'}", f"target.model={tiny_target}", "target.dtype=float32", f"data.prompts={prompts}",
        "data.responses=dataset", "data.exclude=[]", f"data.num_conversations={len(FACTS)}", "data.min_prompt_tokens=3",
        "data.shard_size=5", "data.hidden_states.layer_ids=[]"]))
    return root / "data"


@pytest.mark.parametrize("kind", list(RUNS))
def test_fixed_tiny_run_logs_the_recorded_losses(kind, tmp_path, tiny_target, fixed_data, one_thread, in_process_training):
    recipe, extra = RUNS[kind]
    train_loop.train(load_recipe(REPO / "recipes" / f"{recipe}.yaml", [
        f"output_dir={tmp_path}", f"target.model={tiny_target}", f"train.data_dir={fixed_data}", *TINY, *extra]))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in records]
    print(f"{kind}: {losses!r}")  # shown when it fails: the numbers to record after a deliberate change
    assert losses == pytest.approx(EXPECTED[kind], rel=1e-4)


def test_a_held_markov_head_does_not_learn_through_the_real_loop(tmp_path, tiny_target, fixed_data, one_thread,
                                                                 in_process_training):
    """drafter.block.markov_hold through DeepSpeed's engine and scheduler: held for the whole run, the Markov
    head's learning rate does not matter (two scales, bit-identical drafters); released from step 0, it does."""
    def trained(name, *extra):
        train_loop.train(load_recipe(REPO / "recipes" / "smollm2-135m-dspark.yaml", [
            f"output_dir={tmp_path / name}", f"target.model={tiny_target}", f"train.data_dir={fixed_data}", *TINY,
            *extra]))
        return load_file(tmp_path / name / "checkpoints" / f"step-{STEPS:06d}" / "drafter" / "model.safetensors")

    held = trained("held", "drafter.block.markov_hold=0.99")  # round(0.99 × 3 steps) = all 3
    held_faster = trained("held-faster", "drafter.block.markov_hold=0.99", "drafter.block.markov_lr_scale=50")
    free_faster = trained("free-faster", "drafter.block.markov_lr_scale=50")
    assert held.keys() == held_faster.keys() and any(k.startswith("markov_head.") for k in held)
    assert all(torch.equal(held[k], held_faster[k]) for k in held)
    assert not torch.equal(held["markov_head.markov_w2.weight"], free_faster["markov_head.markov_w2.weight"])
