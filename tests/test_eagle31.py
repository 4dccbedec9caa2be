"""EAGLE-3.1 (docs/algorithms.md §EAGLE-3.1): the EAGLE-3 head with `fc_norm` (an RMSNorm on each captured layer
before fc), `norm_output` (the post-norm hidden state fed back between draft steps) or `norm_before_fc` (one RMSNorm
over the concatenation). The head computes what the peers' code computes; greedy decoding through the loop is the
target's own and sampling at T = 1 follows the target's distribution (χ²); training on cached features equals
training online; the engines' folders carry the flags at the top level and load back identically; llama.cpp reads
norm_before_fc back and serves it T = 0-identically, and refuses what its graph lacks; bad input is one line."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_first_two_tokens_follow, sample_first_two_through_the_loop, tiny_llama_config
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.inference.decode import speculative_generate, tree_speculative_generate
from specdrafter.inference.eagle import EagleProposer, EagleTreeProposer
from specdrafter.inference.sampling import SamplingParams
from specdrafter.jobs.decode import build_proposer
from specdrafter.models.eagle import Eagle3Head, eagle3_config, load_eagle3, save_eagle3
from specdrafter.models.features import capture_features

V, VD, AUX = 96, 40, [1, 2, 4]
EAGLE31 = {"fc_norm": True, "norm_output": True}
PROMPTS = [[5, 17, 42, 9], [1, 2, 3, 4, 5, 6, 7, 8], [50, 60]]
NEW, EOS = 12, [2]


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(V, num_hidden_layers=4)).eval()


def eagle31_head(target, flags=EAGLE31, mimic=False, vocab=VD) -> Eagle3Head:
    """A random head with non-trivial norm weights; `mimic` reads the target's last feature through a near-identity
    layer and its own norm and lm_head, so drafts are partly accepted and rollbacks run."""
    torch.manual_seed(1)
    head = Eagle3Head(eagle3_config(target.config, AUX, vocab, flags=flags)).eval()
    d = target.config.hidden_size
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(2))[:vocab].sort().values
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(vocab))
        head.t2d[ids] = True
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))  # a norm weight of ones would hide a missing norm
        head.lm_head.weight.mul_(20.0)
        if mimic:
            head.fc.weight.zero_()
            head.fc.weight[:, 2 * d:] = torch.eye(d)
            head.midlayer.self_attn.o_proj.weight.mul_(0.1)
            head.midlayer.mlp.down_proj.weight.mul_(0.1)
            head.norm.weight.copy_(target.model.norm.weight)
            head.lm_head.weight.copy_(target.lm_head.weight[ids])
    return head


# ------------------------------------------------------------------------------------------ the head
def test_the_head_computes_the_peers_eagle31_step(target):
    """fuse = fc(concat(RMSNorm_i(f_i))) (vLLM's, SGLang's and speculators' fc_norm: one norm of d_t per aux layer);
    the state a step returns — fed to the next step and to lm_head without another norm — is norm(h) (norm_output);
    norm_before_fc is one RMSNorm of 3·d_t over the concatenation (speculators' input_norm, llama.cpp's)."""
    head, eps = eagle31_head(target), target.config.rms_norm_eps
    with capture_features(target, AUX) as feats:
        target(input_ids=torch.tensor([PROMPTS[1]]))
    parts = [F.rms_norm(feats[k], (32,), head.fc_norm[i].weight, eps) for i, k in enumerate(AUX)]
    fused = head.fuse(feats)
    torch.testing.assert_close(fused, head.fc(torch.cat(parts, -1)))
    embeds = target.get_input_embeddings()(torch.tensor([PROMPTS[1]]))
    positions, mask = torch.arange(8)[None], torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    out, _ = head(fused, embeds, positions, mask)
    h, _ = head.midlayer(fused, embeds, head.rotary_emb(fused, positions), mask)
    torch.testing.assert_close(out, F.rms_norm(h, (32,), head.norm.weight, eps))  # post-norm, fed back
    torch.testing.assert_close(head.logits(out), head.lm_head(out))
    concat = eagle31_head(target, {"norm_before_fc": True})
    x = torch.cat([feats[k] for k in AUX], -1)
    assert concat.input_norm.weight.shape == (96,) and not concat.norm_output
    torch.testing.assert_close(concat.fuse(feats), concat.fc(F.rms_norm(x, (96,), concat.input_norm.weight, eps)))
    with pytest.raises(SpecdrafterError, match="fc_norm and norm_before_fc exclude each other") as e:
        eagle3_config(target.config, AUX, VD, flags={"fc_norm": True, "norm_before_fc": True})
    assert "\n" not in str(e.value)


def test_a_checkpoint_round_trips_with_the_engines_names_and_keys(tmp_path, target):
    head = eagle31_head(target)
    folder = save_eagle3(head, tmp_path / "eagle31")
    stored, config = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(stored) and "input_norm.weight" not in stored
    assert config["fc_norm"] is True and config["norm_output"] is True and "norm_before_fc" not in config
    loaded = load_eagle3(folder)
    assert loaded.norm_output and all(torch.equal(loaded.state_dict()[k], v) for k, v in head.state_dict().items())
    plain = json.loads((save_eagle3(eagle31_head(target, {}), tmp_path / "eagle3") / "config.json").read_text())
    assert not {"fc_norm", "norm_output", "norm_before_fc"} & set(plain)  # an EAGLE-3 folder is unchanged


# ------------------------------------------------------------------------------------------ exactness
@pytest.fixture(scope="module")
def references(target):
    return [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, eos_token_id=EOS,
                            pad_token_id=2)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("flags", [EAGLE31, {"norm_before_fc": True}], ids=["fc_norm+norm_output", "norm_before_fc"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_decoding_is_token_identical_to_target_generate(target, references, flags, tree):
    head = eagle31_head(target, flags, mimic=True)
    accepted = []
    for prompt, reference in zip(PROMPTS, references):
        if tree:
            result = tree_speculative_generate(target, EagleTreeProposer(head, target, 4, 4, 12), prompt, NEW,
                                               SamplingParams(0.0), EOS)
        else:
            result = speculative_generate(target, EagleProposer(head, target), prompt, NEW, SamplingParams(0.0), 3, EOS)
        assert result.tokens == reference
        accepted += [c.accepted for c in result.cycles]
    assert max(accepted) >= 2 and min(accepted) < max(accepted)  # drafts accepted and rejected: rollbacks ran


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_decoding_at_temperature_1_samples_the_first_two_tokens_from_the_target(tree, one_thread):
    """χ² (level 1e-4, fixed seeds) of the first two tokens the real loop emits at T = 1 with an EAGLE-3.1 head, as
    tests/test_eagle_inference.py checks EAGLE-3: 8 tokens, 6 of them in the draft vocabulary, a sharpened target."""
    torch.manual_seed(0)
    small = LlamaForCausalLM(tiny_llama_config(8, num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                                               tie_word_embeddings=False)).eval()
    with torch.no_grad():
        small.lm_head.weight.mul_(15.0)
    torch.manual_seed(1)
    head = Eagle3Head(eagle3_config(small.config, [0, 1, 2], 6, flags=EAGLE31)).eval()
    ids = torch.tensor([0, 1, 3, 4, 6, 7])
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(6))
        head.t2d[ids] = True
        head.lm_head.weight.mul_(20.0)
        for norm in head.fc_norm:
            norm.weight.uniform_(0.5, 1.5)
    proposer = EagleTreeProposer(head, small, depth=2, top_k=2, total_tokens=4) if tree else EagleProposer(head, small)
    prompt, n = [3, 5], 1500
    counts, accepted, drafted = sample_first_two_through_the_loop(small, proposer, prompt, n, tree)
    assert 0 < accepted < drafted
    assert_first_two_tokens_follow(small, prompt, counts, n)


# ------------------------------------------------------------------------------------------ training
TRAIN = ["target.dtype=float32", "train.precision=fp32", "train.temperature=0.05", "train.max_length=64",
         "train.micro_batch_size=2", "train.heldout=2", "train.warmup_steps=1", "train.seed=0", "train.max_steps=3",
         "train.eval_every=3", "train.save_every=3", "train.wandb.mode=disabled", "drafter.eagle.aux_layer_ids=[0,1,2]",
         "drafter.eagle.draft_vocab_size=256", "drafter.eagle.ttt_steps=2"]


def test_training_offline_equals_online_and_is_deterministic(tmp_path, tiny_target, feature_data, one_thread,
                                                             in_process_training):
    """The real loop (jobs/train.py) on the EAGLE-3.1 recipe: cached features give the losses online features give,
    a rerun gives the same weights, the norms learn, and the saved folder is an EAGLE-3.1 head."""
    from conftest import REPO

    import specdrafter.jobs.train as train_loop
    from specdrafter.jobs.recipe import load_recipe

    def run(name, features):
        out = tmp_path / name
        train_loop.train(load_recipe(REPO / "recipes" / "smollm2-135m-eagle31.yaml", [
            f"output_dir={out}", f"target.model={tiny_target}", f"train.data_dir={feature_data}", *TRAIN,
            f"train.features={features}"]))
        losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        drafter = out / "checkpoints" / "step-000003" / "drafter"
        return losses, load_file(str(drafter / "model.safetensors")), json.loads((drafter / "config.json").read_text())

    offline, again, online = run("offline", "offline"), run("again", "offline"), run("online", "online")
    assert offline[0] == again[0] and all(torch.equal(again[1][k], v) for k, v in offline[1].items())
    assert offline[0] == pytest.approx(online[0], rel=1e-4)
    for k, v in offline[1].items():
        torch.testing.assert_close(online[1][k], v, atol=1e-4, rtol=1e-4)
    assert offline[2]["fc_norm"] is True and offline[2]["norm_output"] is True
    assert all(not torch.equal(offline[1][f"fc_norm.{i}.weight"], torch.ones(32)) for i in range(3))  # they learn


# ------------------------------------------------------------------------------------------ exports
@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_the_engines_folders_carry_the_flags_and_load_back_identically(tmp_path, drafter_run_of, fmt):
    from specdrafter.export.formats import export
    run = drafter_run_of("eagle3", "drafter.eagle.fc_norm=true", "drafter.eagle.norm_output=true")
    trained = load_eagle3(run / "checkpoints" / "step-000004" / "drafter")
    out = export(run, fmt, tmp_path / fmt)
    config, tensors = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert config["fc_norm"] is True and config["norm_output"] is True  # top level: what vLLM, SGLang, speculators read
    assert not {"fc_norm", "norm_output"} & set(config.get("transformer_layer_config", {}))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(tensors)
    loaded = load_eagle3(out)
    assert loaded.norm_output and all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.state_dict().items())


# ------------------------------------------------------------------------------------------ llama.cpp
needs_llamacpp = pytest.mark.skipif(not llamacpp.installed(), reason="llama.cpp is not built")


@needs_llamacpp
def test_llamacpp_reads_norm_before_fc_back_and_serves_it_as_the_target_alone(tmp_path, drafter_run_of,
                                                                             gguf_target_dir):
    from specdrafter.export.formats import export
    from specdrafter.export.gguf import DRAFT_FILE, read_gguf
    from specdrafter.inference.llama_server import LlamaServer
    out = export(drafter_run_of("eagle3", "drafter.eagle.draft_vocab_size=0", "drafter.eagle.norm_before_fc=true"),
                 "gguf", tmp_path / "gguf")
    found = read_gguf(out / DRAFT_FILE)
    assert found["fields"]["eagle3.norm_before_fc"] is True and found["target_layers"] == [1, 3, 5]
    assert [shape for name, shape in found["tensors"].items() if name.startswith("enc.")] == [[3 * 64]]
    target_gguf = tmp_path / "target.gguf"
    llamacpp.convert(gguf_target_dir, target_gguf)
    prompt = list(range(100, 120))
    with LlamaServer(target_gguf, context=512) as server:
        alone = server.complete(prompt, 24)
    with LlamaServer(target_gguf, context=512, draft=out / DRAFT_FILE, spec_type="draft-eagle3", n_max=3) as server:
        drafted = server.complete(prompt, 24)
    assert len(alone["tokens"]) == 24 and drafted["tokens"] == alone["tokens"] and drafted["timings"]["draft_n"] > 0


@pytest.mark.parametrize("flag", ["fc_norm", "norm_output"])
def test_gguf_of_what_llamacpps_graph_lacks_is_one_line(tmp_path, drafter_run_of, flag):
    from specdrafter.export.formats import export
    if not llamacpp.installed():
        pytest.skip("llama.cpp is not built")
    run = drafter_run_of("eagle3", "drafter.eagle.draft_vocab_size=0", f"drafter.eagle.{flag}=true")
    with pytest.raises(SpecdrafterError, match=f"EAGLE-3.1 head has {flag}, and llama.cpp 11434's EAGLE-3 graph") as e:
        export(run, "gguf", tmp_path / "gguf")
    assert "\n" not in str(e.value) and not (tmp_path / "gguf").exists()


# ------------------------------------------------------------------------------------------ bad input
def test_eagle31_asked_of_a_folder_trained_without_it_is_one_line(tmp_path, drafter_run_of, gguf_target_dir):
    from conftest import REPO

    from specdrafter.core.recipe import RecipeError
    from specdrafter.jobs.recipe import load_recipe
    folder = drafter_run_of("eagle3") / "checkpoints" / "step-000004" / "drafter"
    target = LlamaForCausalLM.from_pretrained(gguf_target_dir).eval()

    def cfg(*extra):
        return load_recipe(REPO / "recipes" / "smollm2-135m-eagle31.yaml", [
            f"output_dir={tmp_path}", f"target.model={gguf_target_dir}", f"drafter.path={folder}", *extra])
    with pytest.raises(SpecdrafterError, match=r"recipe key 'drafter.eagle.fc_norm' asks for EAGLE-3.1's fc_norm, but "
                                               r"the head in .* was trained without it") as e:
        build_proposer(cfg(), target)
    assert "\n" not in str(e.value)
    assert build_proposer(cfg("drafter.eagle.fc_norm=false", "drafter.eagle.norm_output=false"), target)  # as EAGLE-3
    for extra, message in [(["drafter.eagle.norm_before_fc=true"], "exclude each other"),
                           (["drafter.kind=eagle1"], "EAGLE-1 head has none")]:
        with pytest.raises(RecipeError, match=message) as e:
            cfg(*extra)
        assert "\n" not in str(e.value)
