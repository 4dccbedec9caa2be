"""The planner's byte model (train/memory.py) against tensors measured on the CPU: the bytes per [rows, vocabulary]
element of each distillation objective (OBJECTIVE_BYTES: what the backward keeps, what is live at the peak) and the
EAGLE-3 head's saved bytes per token and TTT step (the 32·d / 20·d / 30·d factors and the terms beside them, in
fp32, bf16 and bf16 autocast) are what autograd actually saves when the real code runs on a tiny config."""

import pytest
import torch
from bench_plan import LiveTensorBytes
from conftest import REPO, tiny_llama_config
from omegaconf import OmegaConf
from transformers import LlamaForCausalLM

from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds import kind_of
from specdrafter.train.eagle import training_time_test
from specdrafter.train.memory import OBJECTIVE_BYTES, Counts, Setup, activations, objective_bytes
from specdrafter.train.objectives import distill_loss

ROWS, VOCAB = 64, 2048


def saved_bytes(fn, held):
    """fn()'s result and the bytes of the tensors autograd saves for its backward, each storage once, besides `held`
    (parameters and inputs, counted by other terms) and autocast's bf16 copies of parameters (memory.activations
    counts those as 2 bytes per trainable parameter)."""
    skip = {t.untyped_storage().data_ptr() for t in held}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and not _copy_of_parameter(t):
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _copy_of_parameter(t: torch.Tensor) -> bool:
    """Whether `t` comes from a leaf through one-input ops only (casts, transposes): a weight, not an activation."""
    fn = t.grad_fn
    while fn is not None and len(fn.next_functions) == 1:
        fn = fn.next_functions[0][0]
    return fn is not None and hasattr(fn, "variable")  # AccumulateGrad: the leaf's own node


@pytest.mark.parametrize("weights", [{name: 1.0} for name in OBJECTIVE_BYTES] + [{"tv": 1.0, "soft_ce": 1.0}],
                         ids=lambda w: "+".join(w))
def test_objective_bytes_are_what_the_loss_saves_and_its_peak(weights):
    """distill_loss on fp32 [rows, V] logits: bytes per element autograd keeps for the backward, and the peak of live
    tensor bytes above its inputs, as objective_bytes plans them (integers: a constant off by one byte fails)."""
    torch.manual_seed(0)
    teacher, draft = torch.randn(ROWS, VOCAB), torch.randn(ROWS, VOCAB, requires_grad=True)  # [rows, V]
    mask = torch.ones(ROWS, dtype=torch.bool)
    tracker = LiveTensorBytes()
    with tracker:
        for t in (teacher, draft, mask):
            tracker.add(t)
        before = tracker.peak = tracker.live
        _, saved = saved_bytes(lambda: distill_loss(teacher, draft, mask, weights).total, [teacher, draft, mask])
    planned_saved, planned_peak = objective_bytes(OmegaConf.create({"train": {"objective": weights}}))
    assert saved / (ROWS * VOCAB) == pytest.approx(planned_saved, abs=0.1)
    assert (tracker.peak - before) / (ROWS * VOCAB) == pytest.approx(planned_peak, abs=0.1)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp_bf16"])
def test_eagle3_saved_bytes_per_token_and_ttt_step(precision):
    """The EAGLE-3 head's forward as the loop runs it (fuse, the training-time test, the logits of every position: the
    worst batch the plan is for) on a tiny target shaped like SmolLM2 (d = h·hd, 3 KV heads, I ≈ 2.7·d): autograd's
    saved bytes are the plan's within d/4 bytes per token and TTT step, so a per-token factor off by one d fails."""
    B, L, steps, d = 2, 24, 3, 72
    config = tiny_llama_config(512, hidden_size=d, intermediate_size=192, num_hidden_layers=4, num_attention_heads=9,
                               num_key_value_heads=3, tie_word_embeddings=False)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).requires_grad_(False)  # the loop's frozen target
    cfg = load_recipe(REPO / "recipes" / "smollm2-135m-eagle3.yaml", [
        "target.dtype=float32", "drafter.eagle.aux_layer_ids=[1,2,3]", "drafter.eagle.draft_vocab_size=256",
        f"drafter.eagle.ttt_steps={steps}", f"train.precision={precision}", f"train.micro_batch_size={B}",
        f"train.max_length={L}", "train.features=online"])
    kind = kind_of(cfg)
    drafter = kind.training.drafter(cfg, target)
    module = drafter.module.to(torch.bfloat16 if precision == "bf16" else torch.float32)  # DeepSpeed's bf16 cast
    dtype = next(module.parameters()).dtype
    features = {k: torch.randn(B, L, d).to(dtype) for k in kind.training.feature_layers(cfg, 4)}  # run_target's, [B, L, d]
    ids = torch.randint(0, 512, (B, L))
    rows = torch.ones(B, L, dtype=torch.bool).nonzero(as_tuple=True)  # every position counted

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp_bf16"):  # jobs/train.py:autocast
            hidden = training_time_test(module, drafter.embed, module.fuse(features), ids, steps)  # per step [B, L, d]
            return [module.logits(h[rows]) for h in hidden]  # per step [B·L, Vd]

    held = [*module.parameters(), *module.buffers(), *target.parameters(), *features.values()]
    _, measured = saved_bytes(forward, held)
    trainable = sum(p.numel() for p in module.parameters())
    act = activations(cfg, config, Counts(0, trainable, 0, trainable), Setup(device="cpu"), kind)
    planned = act.saved - (2 * trainable if precision == "amp_bf16" else 0)  # the weight copies: not measured here
    assert abs(planned - measured) <= B * L * steps * d / 4, (planned, measured)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("variant, anchors, block_size, layers, max_length, draft_vocab", [
    ("dspark", 8, 4, 1, 24, 256), ("dspark", 16, 4, 2, 24, 256), ("dflash", 4, 8, 3, 48, 0)])
def test_block_drafter_saved_bytes(precision, variant, anchors, block_size, layers, max_length, draft_vocab):
    """A block drafter's training pass (all blocks of a batch at once, DSpark's heads teacher-forced) on a tiny target
    shaped like SmolLM2: autograd's saved bytes are the plan's within 1 % in fp32 and 8 % with bf16 weights (whose
    norm internals the plan fits rather than derives); a term per slot or per layer off by one d fails either."""
    B, d = 2, 72
    config = tiny_llama_config(512, hidden_size=d, intermediate_size=192, num_hidden_layers=6, num_attention_heads=9,
                               num_key_value_heads=3, tie_word_embeddings=False)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).requires_grad_(False)
    cfg = load_recipe(REPO / "recipes" / f"smollm2-135m-{variant}.yaml", [
        "target.dtype=float32", f"train.precision={precision}", f"train.micro_batch_size={B}",
        f"train.max_length={max_length}", f"drafter.block.num_layers={layers}", f"drafter.block.block_size={block_size}",
        "drafter.block.aux_layer_ids=[2,3,4]", f"drafter.block.anchors={anchors}",
        f"drafter.block.draft_vocab_size={draft_vocab}", "drafter.block.markov_rank=16", "inference.k=3"])
    kind = kind_of(cfg)
    module = kind.training.drafter(cfg, target).module.to(torch.bfloat16 if precision == "bf16" else torch.float32)
    dtype = next(module.parameters()).dtype
    context = torch.randn(B, max_length, 3 * d).to(dtype)  # the concatenated features: the plan counts them too
    ids = torch.randint(0, 500, (B, max_length))
    spots = torch.stack([torch.randperm(max_length - 1)[:anchors].sort().values for _ in range(B)])  # [B, N]

    def forward():
        return module(context, module.block_inputs(ids, spots), spots, target, module.teacher_prev(ids, spots))

    _, measured = saved_bytes(forward, [*module.parameters(), *module.buffers(), *target.parameters(), context])
    trainable = sum(p.numel() for p in module.parameters())
    act = activations(cfg, config, Counts(0, trainable, 0, trainable), Setup(device="cpu"), kind)
    planned = act.saved - context.numel() * context.element_size()
    assert abs(planned - measured) <= (0.01 if precision == "fp32" else 0.08) * measured, (planned, measured)
