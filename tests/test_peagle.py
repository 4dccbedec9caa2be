"""P-EAGLE (train/peagle.py, inference/peagle.py, kinds/peagle.py): an EAGLE-3 head that drafts K tokens in one pass.
COD's chains are nested and supervised; what a depth sees in training is what its slot sees when decoding; greedy
decoding through the loop is the target's own and sampling at T = 1 follows the target's distribution (χ²); the real
loop trains it from cached features as from online ones; its folder round-trips and exports for vLLM with what
vLLM's P-EAGLE code reads; bad input (K beyond the trained depths, formats no pinned engine serves) is one line."""

import json

import pytest
import torch
from conftest import (
    REPO,
    assert_first_two_tokens_follow,
    sample_first_two_through_the_loop,
    tiny_llama_config,
)
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from specdrafter.core.io import SpecdrafterError
from specdrafter.inference.decode import speculative_generate
from specdrafter.inference.peagle import PEagleProposer
from specdrafter.inference.sampling import SamplingParams
from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds import KINDS, build_drafter, kind_of_config
from specdrafter.models.eagle import Eagle3Head, eagle3_config
from specdrafter.models.features import capture_features
from specdrafter.train.peagle import PEagleHead, cod_chains, flat_outputs, load_peagle, peagle_config, save_eagle3

V, VD, AUX, K = 96, 40, [1, 2, 4], 4
PROMPTS = [[5, 17, 42, 9], [1, 2, 3, 4, 5, 6, 7, 8], [50, 60]]
NEW, EOS = 12, [2]


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(V, num_hidden_layers=4)).eval()


def peagle_head(target, mimic=False, vocab=VD, depths=K, aux=AUX) -> PEagleHead:
    """A random head; `mimic` reads the target's last feature through a near-identity layer and the target's norm and
    lm_head rows, so drafts are partly accepted and rollbacks run."""
    torch.manual_seed(1)
    head = PEagleHead(peagle_config(target.config, aux, vocab, depths, V - 1)).eval()
    d = target.config.hidden_size
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(2))[:vocab].sort().values
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(vocab))
        head.t2d[ids] = True
        head.lm_head.weight.mul_(20.0)
        if mimic:
            head.fc.weight.zero_()
            head.fc.weight[:, 2 * d:] = torch.eye(d)
            head.midlayer.self_attn.o_proj.weight.mul_(0.1)
            head.midlayer.mlp.down_proj.weight.mul_(0.1)
            head.norm.weight.copy_(target.model.norm.weight)
            head.lm_head.weight.copy_(target.lm_head.weight[ids])
    return head


# ------------------------------------------------------------------------------------------ COD and the head
def test_cod_keeps_nested_supervised_chains_at_a_geometric_rate():
    """Depth j keeps floor(n · max(r^j, r_min)) chains (n: positions whose x_{t+2} is target-generated), each among
    depth j − 1's, and only where x_{a+j+2} is target-generated."""
    torch.manual_seed(0)
    loss_mask = torch.zeros(2, 40, dtype=torch.long)
    loss_mask[0, 6:] = 1
    loss_mask[1, 3:30] = 1
    chains = cod_chains(loss_mask, 5, 0.6, 0.2)
    n = torch.tensor([34, 27])  # the t with x_{t+2} in the answer: 4..37 and 1..27
    previous = [set(range(40)), set(range(40))]
    for j, (anchors, valid) in enumerate(chains, start=1):
        for b in range(2):
            kept = anchors[b][valid[b]].tolist()
            assert len(kept) == int(n[b] * max(0.6 ** j, 0.2)) == len(set(kept))
            assert kept == sorted(kept) and set(kept) <= previous[b]
            assert all(loss_mask[b, a + 2:a + j + 3].all() for a in kept)  # the chain's tokens all target-generated
            previous[b] = set(kept)


def test_a_depth_sees_in_training_what_its_slot_sees_when_decoding(target):
    """The flat COD pass's output at (chain a, depth j) equals the proposer's one-pass output for slot j after the
    committed tokens x_0 … x_{a+1}: same inputs, positions and visibility."""
    head = peagle_head(target)
    ids = torch.tensor([[7, 3, 9, 14, 22, 5, 61, 33, 2, 80, 11, 40]])
    loss_mask = torch.ones_like(ids)
    torch.manual_seed(3)
    chains = cod_chains(loss_mask, K, 0.9, 0.5)
    with torch.no_grad(), capture_features(target, AUX) as feats:
        target(input_ids=ids)
        out = flat_outputs(head, target.get_input_embeddings(), head.fuse(feats), ids, chains)[0]  # [N, d]
    T, checked = ids.shape[1], 0
    for a in chains[-1][0][0][chains[-1][1][0]].tolist():  # chains that reach the last depth
        proposer = PEagleProposer(head, target)
        committed = ids[0, :a + 2].tolist()
        with torch.no_grad(), capture_features(target, AUX) as prefix:
            target(input_ids=torch.tensor([committed]))
        proposer.observe({k: v[0, :a + 1] for k, v in prefix.items()})  # features of positions 0..a
        probs = proposer.propose(committed, K, SamplingParams(1.0), torch.Generator().manual_seed(0)).probs  # [K, V]
        rows = []
        start = T
        for anchors, valid in chains:
            rows.append(start + anchors[0][valid[0]].tolist().index(a))
            start += anchors.shape[1]
        expected = torch.stack([out[a]] + [out[r] for r in rows])  # depth 0 at a, then depths 1 … K − 1
        q = head.logits(expected).double().softmax(-1)  # [K, Vd] the rows training compares with the target's
        torch.testing.assert_close(probs[:, head.draft_ids], q, atol=1e-5, rtol=1e-4)
        checked += 1
    assert checked


# ------------------------------------------------------------------------------------------ exactness
@pytest.fixture(scope="module")
def references(target):
    return [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, eos_token_id=EOS,
                            pad_token_id=2)[0, len(p):].tolist() for p in PROMPTS]


def test_greedy_decoding_is_token_identical_to_target_generate(target, references, one_thread):
    head = peagle_head(target, mimic=True)
    accepted = []
    for prompt, reference in zip(PROMPTS, references):
        result = speculative_generate(target, PEagleProposer(head, target), prompt, NEW, SamplingParams(0.0), K, EOS)
        assert result.tokens == reference
        accepted += [c.accepted for c in result.cycles]
        assert all(c.drafted == K for c in result.cycles[:-1])  # K drafts per pass
    assert max(accepted) >= 2 and min(accepted) < max(accepted)  # drafts accepted and rejected: rollbacks ran


def test_decoding_at_temperature_1_samples_the_first_two_tokens_from_the_target(one_thread):
    """χ² (level 1e-4, fixed seeds) of the first two tokens the real loop emits at T = 1 when both come from one
    P-EAGLE pass (k = 2: depth 0 and the first masked slot): 8 tokens, 6 in the draft vocabulary, a sharpened target."""
    torch.manual_seed(0)
    small = LlamaForCausalLM(tiny_llama_config(8, num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                                               tie_word_embeddings=False)).eval()
    with torch.no_grad():
        small.lm_head.weight.mul_(15.0)
    torch.manual_seed(1)
    head = PEagleHead(peagle_config(small.config, [0, 1, 2], 6, 2, 5)).eval()
    ids = torch.tensor([0, 1, 3, 4, 6, 7])
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(6))
        head.t2d[ids] = True
        head.lm_head.weight.mul_(20.0)
        head.mask_hidden.mul_(3.0)
    prompt, n = [3, 5], 1500
    counts, accepted, drafted = sample_first_two_through_the_loop(small, PEagleProposer(head, small), prompt, n, False)
    assert 0 < accepted < drafted
    assert_first_two_tokens_follow(small, prompt, counts, n)


# ------------------------------------------------------------------------------------------ folders and bad input
def test_a_folder_round_trips_and_names_its_kind(tmp_path, target):
    head = peagle_head(target)
    folder = save_eagle3(head, tmp_path / "peagle")
    config = json.loads((folder / "config.json").read_text())
    assert config["parallel_drafting"] is True and config["num_depths"] == K and config["mask_token_id"] == V - 1
    assert load_file(str(folder / "model.safetensors"))["mask_hidden"].shape == (1, 3 * 32)
    loaded = load_peagle(folder)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in head.state_dict().items())
    assert kind_of_config(config) is KINDS["peagle"]
    assert kind_of_config({**config, "parallel_drafting": False}) is KINDS["eagle3"]  # an EAGLE-3 head stays one
    with pytest.raises(SpecdrafterError, match="is not a P-EAGLE head"):
        load_peagle(save_eagle3(Eagle3Head(eagle3_config(target.config, AUX, VD)), tmp_path / "eagle3"))
    with pytest.raises(SpecdrafterError, match="have no mask_hidden: without it the head cannot draft past its first"):
        load_peagle(save_eagle3(Eagle3Head(head.config), tmp_path / "no-mask"))  # the keys, not the tensor


@pytest.fixture(scope="module")
def peagle_run(tmp_path_factory, gguf_target_dir, smollm2_tokenizer):
    """A run folder holding one checkpoint of a P-EAGLE head built from the recipe (K = 4) for the 6-layer target."""
    target = LlamaForCausalLM.from_pretrained(gguf_target_dir).eval()
    run = tmp_path_factory.mktemp("peagle-run")
    cfg = load_recipe(REPO / "recipes" / "smollm2-135m-peagle.yaml", [
        f"output_dir={run}", f"target.model={gguf_target_dir}", "target.dtype=float32", "train.wandb.mode=disabled",
        "drafter.eagle.aux_layer_ids=[1,3,5]", "drafter.eagle.draft_vocab_size=0"])
    drafter = build_drafter(cfg, target, None, smollm2_tokenizer)
    folder = run / "checkpoints" / "step-000004"
    drafter.save(drafter.module, folder / "drafter", smollm2_tokenizer)
    (folder / "recipe.yaml").write_text(OmegaConf.to_yaml(cfg))
    (folder / "trainer_state.json").write_text(json.dumps({"step": 4, "drafter": "peagle", "metrics": {}}))
    return run, target


def test_k_beyond_the_trained_depths_is_one_line(peagle_run, gguf_target_dir):
    run, target = peagle_run
    drafter = run / "checkpoints" / "step-000004" / "drafter"
    recipe = REPO / "recipes" / "smollm2-135m-peagle.yaml"
    base = [f"target.model={gguf_target_dir}", f"drafter.path={drafter}", "target.dtype=float32"]
    decoding = KINDS["peagle"].decoding
    assert isinstance(decoding.proposer(load_recipe(recipe, base), target, str(drafter)), PEagleProposer)
    with pytest.raises(SpecdrafterError, match=r"recipe key 'inference.k' \(6\) exceeds the 4 tokens the P-EAGLE "
                                               r"head .* drafts in one pass") as e:
        decoding.proposer(load_recipe(recipe, [*base, "inference.k=6"]), target, str(drafter))
    assert "\n" not in str(e.value)


def test_the_vllm_export_carries_what_vllms_parallel_drafting_reads(tmp_path, peagle_run):
    """vLLM (>= 0.16, #32887): an EAGLE-3 folder (LlamaForCausalLMEagle3, top-level aux ids), a top-level
    mask_token_id (get_parallel_drafting_token_id), the mask_hidden tensor (3·d, read as view(1, -1)), served with
    parallel_drafting: true; the folder loads back identically."""
    from specdrafter.export.formats import export
    run, _ = peagle_run
    out = export(run, "vllm", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert config["mask_token_id"] == 16 and config["parallel_drafting"] is True and config["num_depths"] == 4
    weights = load_file(str(out / "model.safetensors"))
    assert weights["mask_hidden"].shape == (1, 3 * 64) and "d2t" not in weights  # full vocabulary: no maps
    assert '"parallel_drafting": true' in (out / "README.md").read_text()
    original = load_peagle(run / "checkpoints" / "step-000004" / "drafter")
    assert all(torch.equal(load_peagle(out).state_dict()[k], v) for k, v in original.state_dict().items())


@pytest.mark.parametrize("fmt, why", [("sglang", r"--format sglang exports .* but .* holds a P-EAGLE head .* use --format vllm"),
                                      ("speculators", r"--format speculators exports .* holds a P-EAGLE head"),
                                      ("gguf", r"--format gguf: llama.cpp serves no drafter like a P-EAGLE head")])
def test_formats_no_pinned_engine_serves_are_one_line(tmp_path, peagle_run, fmt, why):
    from specdrafter.export.formats import export
    with pytest.raises(SpecdrafterError, match=why) as e:
        export(peagle_run[0], fmt, tmp_path / fmt)
    assert "\n" not in str(e.value) and not (tmp_path / fmt).exists()


# ------------------------------------------------------------------------------------------ training
TRAIN = ["target.dtype=float32", "train.precision=fp32", "train.temperature=0.05", "train.max_length=64",
         "train.micro_batch_size=2", "train.heldout=2", "train.warmup_steps=1", "train.seed=0", "train.max_steps=3",
         "train.eval_every=3", "train.save_every=3", "train.wandb.mode=disabled", "drafter.eagle.aux_layer_ids=[0,1,2]",
         "drafter.eagle.draft_vocab_size=256", "drafter.peagle.depths=3", "inference.k=3"]


def test_training_offline_equals_online_and_is_deterministic(tmp_path, tiny_target, feature_data, one_thread,
                                                             in_process_training):
    """The real loop (jobs/train.py) on the P-EAGLE recipe: cached features give the losses online features give
    (COD draws the same chains), a rerun gives the same weights, mask_hidden learns, and the saved folder is a
    P-EAGLE head of K = 3."""
    import specdrafter.jobs.train as train_loop

    def run(name, features):
        out = tmp_path / name
        train_loop.train(load_recipe(REPO / "recipes" / "smollm2-135m-peagle.yaml", [
            f"output_dir={out}", f"target.model={tiny_target}", f"train.data_dir={feature_data}", *TRAIN,
            f"train.features={features}"]))
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        drafter = out / "checkpoints" / "step-000003" / "drafter"
        return records, load_file(str(drafter / "model.safetensors")), json.loads((drafter / "config.json").read_text())

    offline, again, online = run("offline", "offline"), run("again", "offline"), run("online", "online")
    losses = [r["loss"] for r in offline[0]]
    assert losses == [r["loss"] for r in again[0]] and all(torch.equal(again[1][k], v) for k, v in offline[1].items())
    assert losses == pytest.approx([r["loss"] for r in online[0]], rel=1e-4)
    for k, v in offline[1].items():
        torch.testing.assert_close(online[1][k], v, atol=1e-4, rtol=1e-4)
    assert offline[2]["parallel_drafting"] is True and offline[2]["num_depths"] == 3
    assert any(k.startswith("loss/depth2") or "depth2" in k for k in offline[0][-1])  # every depth is logged
