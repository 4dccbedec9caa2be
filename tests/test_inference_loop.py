"""The speculative loop over HF models: greedy output identical to target.generate, the target as its own
draft accepts everything, cache rollback leaves exactly the committed prefix, bad input is refused."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO, tiny_llama_config
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, DynamicCache, LlamaForCausalLM

from specdrafter.core.io import SpecdrafterError, write_checkpoint_state
from specdrafter.core.recipe import ASDConfig
from specdrafter.inference.decode import speculative_generate
from specdrafter.inference.proposers import DraftModelProposer, check_vocabularies, self_draft
from specdrafter.inference.sampling import SamplingParams
from specdrafter.jobs.decode import decode, load_decoder, resolve_drafter
from specdrafter.jobs.recipe import load_recipe
from specdrafter.models.eagle import Eagle3Head, eagle3_config, save_eagle3

PROMPTS = [[5, 17, 42, 9], [1, 2, 3, 4, 5, 6, 7, 8], [250]]


@pytest.fixture(scope="module")
def tiny_pair():
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config(300, num_hidden_layers=4, tie_word_embeddings=False)).eval()
    torch.manual_seed(1)
    draft = LlamaForCausalLM(tiny_llama_config(300, num_hidden_layers=1, tie_word_embeddings=False)).eval()
    return target, draft


EOS = [2]


def greedy_reference(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=EOS, pad_token_id=2)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_chain_is_token_identical_to_target_generate(tiny_pair, k):
    target, draft = tiny_pair
    for proposer in (DraftModelProposer(draft), DraftModelProposer(self_draft(target, 1))):
        for prompt in PROMPTS:
            result = speculative_generate(target, proposer, prompt, 24, SamplingParams(0.0), k, EOS)
            assert result.tokens == greedy_reference(target, prompt, 24)
    assert result.alpha < 1  # the random draft is rejected sometimes, so rollback was exercised


def test_greedy_chain_on_smollm2_matches_generate(smollm2_dir, smollm2_tokenizer):
    target = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    proposer = DraftModelProposer(self_draft(target, 8))
    for text in ("What is the capital of Japan?", "Write a short poem about rain."):
        prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"]
        result = speculative_generate(target, proposer, prompt, 24, SamplingParams(0.0), 4, EOS)
        assert result.tokens == greedy_reference(target, prompt, 24)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_target_as_its_own_draft_accepts_every_token(tiny_pair, temperature):
    target, _ = tiny_pair
    k = 4
    result = speculative_generate(target, DraftModelProposer(target), PROMPTS[0], 25, SamplingParams(temperature), k,
                                  generator=torch.Generator().manual_seed(0))
    assert all(c.accepted == k for c in result.cycles)
    assert len(result.tokens) == 25 and len(result.cycles) == 5  # τ = k + 1 exactly


def test_draft_cache_rollback_keeps_exactly_the_committed_prefix(tiny_pair):
    target, draft = tiny_pair
    proposer = DraftModelProposer(draft)
    committed = list(PROMPTS[1])
    proposal = proposer.propose(committed, 4, SamplingParams(0.0))
    committed += proposal.tokens[:2].tolist() + [7]  # 2 accepted, then a correction token
    proposer.rollback(len(committed))
    assert proposer.cache.get_seq_length() == len(committed) - 1
    fresh = DynamicCache()
    draft(input_ids=torch.tensor([committed[:-1]]), cache=fresh, use_cache=True)
    for layer, ref in zip(proposer.cache.layers, fresh.layers):
        torch.testing.assert_close(layer.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, ref.values, atol=1e-5, rtol=1e-5)


def test_asd_at_zero_budget_reproduces_strict_greedy(tiny_pair):
    target, draft = tiny_pair
    strict = speculative_generate(target, DraftModelProposer(draft), PROMPTS[1], 20, SamplingParams(0.0), 4)
    asd0 = speculative_generate(target, DraftModelProposer(draft), PROMPTS[1], 20, SamplingParams(0.0), 4,
                                asd=ASDConfig(budget=0.0))
    assert asd0.tokens == strict.tokens and asd0.asd_regret == 0


def test_asd_with_a_budget_accepts_cheap_mismatches_and_charges_their_exact_regret(tiny_pair):
    """The counterpart of the zero budget: the random pair's logits are flat, so mismatches are cheap, and ASD with a
    budget of 1 emits tokens strict greedy would not. Replaying its output through one plain target pass, the regret
    max_v z(v) - z(x) of every emitted token sums to the ledger (corrections and bonus tokens are argmaxes and cost
    nothing), which stays within the budget."""
    target, draft = tiny_pair
    strict = speculative_generate(target, DraftModelProposer(draft), PROMPTS[1], 20, SamplingParams(0.0), 4)
    asd = speculative_generate(target, DraftModelProposer(draft), PROMPTS[1], 20, SamplingParams(0.0), 4,
                               asd=ASDConfig(budget=1.0, gate=0.25, max_mismatches=2))
    assert len(asd.tokens) == 20 and asd.tokens != strict.tokens
    assert sum(c.accepted + 1 for c in asd.cycles) == 20  # no accepted token was cut off by max_new_tokens
    with torch.no_grad():
        z = target(torch.tensor([PROMPTS[1] + asd.tokens])).logits[0, len(PROMPTS[1]) - 1:-1].double()  # row i scores token i
    regret = [float(z[i].max() - z[i, x]) for i, x in enumerate(asd.tokens)]
    first = next(i for i, (a, b) in enumerate(zip(asd.tokens, strict.tokens)) if a != b)
    assert asd.tokens[:first] == strict.tokens[:first] and regret[first] > 0  # the first difference: an accepted mismatch
    assert 0 < asd.asd_regret <= 1.0 and sum(regret) == pytest.approx(asd.asd_regret, abs=1e-4)
    assert sum(r > 0 for r in regret) >= 2 and max(regret) <= 0.25 * 4  # local gate: r_i <= g · (K - i) <= g · K


def test_asd_charges_only_the_mismatches_it_emits_when_max_new_tokens_cuts_a_block(tiny_pair):
    """At the last cycle max_new_tokens may cut the accepted drafts short: a mismatch that is never emitted must not
    spend the budget. For every length the ledger equals the regret replayed over the tokens actually emitted."""
    target, draft = tiny_pair
    cut = 0
    for n in range(2, 10):  # before the fix, n = 2, 3, 6, 7, 8 charged 1.11 for 0.46 emitted, ... 2.50 for 2.08
        asd = speculative_generate(target, DraftModelProposer(draft), PROMPTS[1], n, SamplingParams(0.0), 4,
                                   asd=ASDConfig(budget=3.0, gate=0.5, max_mismatches=4))
        with torch.no_grad():
            z = target(torch.tensor([PROMPTS[1] + asd.tokens])).logits[0, len(PROMPTS[1]) - 1:-1].double()
        regret = sum(float(z[i].max() - z[i, x]) for i, x in enumerate(asd.tokens))
        assert len(asd.tokens) == n and asd.asd_regret == pytest.approx(regret, abs=1e-4), n
        cut += sum(c.accepted + 1 for c in asd.cycles) > n
    assert cut  # some lengths did cut the last block short


def test_bad_input_is_refused_in_one_line(tiny_pair):
    target, draft = tiny_pair
    other = LlamaForCausalLM(tiny_llama_config(320, num_hidden_layers=1)).eval()
    with pytest.raises(SpecdrafterError, match=r"draft vocabulary \(320 tokens\) differs from the target's \(300"):
        check_vocabularies(target, other)
    with pytest.raises(SpecdrafterError, match="block length k"):
        speculative_generate(target, DraftModelProposer(draft), PROMPTS[0], 5, k=0)
    with pytest.raises(SpecdrafterError, match="exceeds the target's context of 512"):
        speculative_generate(target, DraftModelProposer(draft), list(range(1, 300)) * 2, 5)
    # the prompt and max_new_tokens fit (505 + 5 <= 512), the draft block does not: the message says so, with numbers
    with pytest.raises(SpecdrafterError, match=r"max_new_tokens \(5\) \+ one draft block or tree \(4\) = 514 positions.*"
                                               r"the draft block must fit too"):
        speculative_generate(target, DraftModelProposer(draft), list(range(1, 300)) + list(range(1, 207)), 5, k=4)
    with pytest.raises(SpecdrafterError, match="empty prompt"):
        speculative_generate(target, DraftModelProposer(draft), [], 5)
    with pytest.raises(SpecdrafterError, match="greedy decoding only"):
        speculative_generate(target, DraftModelProposer(draft), PROMPTS[0], 5, SamplingParams(1.0), asd=ASDConfig())
    for n in (0, -1, 2.5):  # 0 used to decode forever: the loop stopped only when the count equalled it
        with pytest.raises(SpecdrafterError, match=r"max_new_tokens must be an integer >= 1"):
            speculative_generate(target, DraftModelProposer(draft), PROMPTS[0], n)
    for prompt in ([5, 300], [-1, 4]):  # torch's embedding raised IndexError from inside the loop
        with pytest.raises(SpecdrafterError, match=r"is not a token id of the target \(0 ≤ id < 300\)"):
            speculative_generate(target, DraftModelProposer(draft), prompt, 5)
    with pytest.raises(SpecdrafterError, match="num_layers"):
        self_draft(target, 9)


def test_decode_job_from_a_recipe(tmp_path, smollm2_tokenizer):
    """decode() at T = 0 (the recipe's own temperature), chain and static tree, emits exactly the target's greedy
    continuation of the chat-templated prompt. The target is untied and sharpened: a tied random Llama only repeats
    the prompt's last token, which any decoder would reproduce."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config(len(smollm2_tokenizer), tie_word_embeddings=False)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(10.0)
    target.save_pretrained(tmp_path / "target")
    smollm2_tokenizer.save_pretrained(tmp_path / "target")
    cfg = load_recipe(REPO / "recipes" / "smollm2-135m-generate.yaml",
                      [f"target.model={tmp_path / 'target'}", "drafter.num_layers=1", "inference.max_new_tokens=12",
                       "output_dir=unused"])
    prompt = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": cfg.inference.prompt}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    reference = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                                eos_token_id=target.generation_config.eos_token_id, pad_token_id=2)[0, len(prompt):].tolist()
    assert cfg.inference.temperature == 0 and len(set(reference)) > 2  # not a repeated token
    report = decode(cfg)
    assert report.result.tokens == reference and "tok/s" in report.summary() and "τ =" in report.summary()
    assert report.text == smollm2_tokenizer.decode(reference, skip_special_tokens=True)
    assert 0 < report.result.alpha < 1  # the 1-layer self-draft is partly rejected: rollback was exercised
    cfg.inference.tree = [[0], [1], [0, 0]]
    report = decode(cfg)
    assert report.result.tokens == reference
    cfg.inference.tree = [[0], [1, 0]]
    with pytest.raises(SpecdrafterError, match="without its parent"):
        decode(cfg)
    cfg.inference.prompt = "   "
    with pytest.raises(SpecdrafterError, match="inference.prompt' is empty"):
        decode(cfg)


GENERATE_RECIPE = REPO / "recipes" / "smollm2-135m-generate.yaml"


def test_one_decode_checks_its_recipe_once_and_its_drafter_folder_once(tmp_path, smollm2_tokenizer, monkeypatch):
    """A recipe is checked where it is loaded and trusted after; the drafter folder is verified (its files read and
    hashed) once, before the target loads — not again by each layer it passes through."""
    import specdrafter.kinds as kinds
    from specdrafter.kinds.base import Kind

    sharp_target(tmp_path / "target", smollm2_tokenizer)
    torch.manual_seed(3)
    LlamaForCausalLM(tiny_llama_config(len(smollm2_tokenizer), num_hidden_layers=1)).save_pretrained(tmp_path / "draft")
    calls = {"check_recipe": 0, "check_model_folder": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(Kind, "check_recipe", counted("check_recipe", Kind.check_recipe))
    monkeypatch.setattr(kinds, "check_model_folder", counted("check_model_folder", kinds.check_model_folder))
    cfg = load_recipe(GENERATE_RECIPE, [f"target.model={tmp_path / 'target'}", "drafter.kind=draft_model",
                                        f"drafter.path={tmp_path / 'draft'}", "inference.k=3", "inference.max_new_tokens=4",
                                        "output_dir=unused", "drafter.run=null"])
    assert len(decode(cfg).result.tokens) == 4
    assert calls == {"check_recipe": 1, "check_model_folder": 1}


def sharp_target(folder, tokenizer):
    """An untied, sharpened tiny Llama with SmolLM2's tokenizer, saved in `folder` (a tied random one only repeats the
    prompt's last token, which any decoder would reproduce)."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config(len(tokenizer), tie_word_embeddings=False)).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(10.0)
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return target


def test_the_demo_decodes_with_the_run_once_it_holds_a_drafter_and_says_which(tmp_path, smollm2_tokenizer, caplog):
    """drafter.run (the generate recipe's main-job run): until it holds a drafter trained for the recipe's target the
    self-draft decodes, and the job says so and what trains one; then the run's newest checkpoint decodes (here an
    EAGLE-3 head), named in one line. Greedy decoding stays the target's own continuation either way."""
    target = sharp_target(tmp_path / "target", smollm2_tokenizer)
    run = tmp_path / "run"
    overrides = [f"target.model={tmp_path / 'target'}", "drafter.num_layers=1", "inference.max_new_tokens=8",
                 "output_dir=unused"]
    assert resolve_drafter(load_recipe(GENERATE_RECIPE, overrides)).line.endswith(
        "python launch/train_eagle.py recipes/smollm2-135m-eagle3.yaml trains one there")  # the recipe's own run
    cfg = load_recipe(GENERATE_RECIPE, [*overrides, f"drafter.run={run}"])
    with caplog.at_level("INFO", logger="specdrafter"):
        alone = decode(cfg)
    assert f"drafter: a self-draft (drafter.kind=self_draft): {run} holds no trained drafter yet" in caplog.messages

    folder = run / "checkpoints" / "step-000004"
    save_eagle3(Eagle3Head(eagle3_config(target.config, [0, 1, 2], 256)), folder / "drafter")
    (folder / "recipe.yaml").write_text(f"output_dir: {run}\ntarget:\n  model: {tmp_path / 'target'}\n")
    write_checkpoint_state(folder, {"step": 4, "tokens": 100, "drafter": "eagle3", "metrics": {}})
    caplog.clear()
    with caplog.at_level("INFO", logger="specdrafter"):
        trained = decode(cfg)
    assert caplog.messages[0] == f"drafter: an EAGLE-3 head, {folder / 'drafter'} (the newest checkpoint of drafter.run {run})"
    assert trained.result.tokens == alone.result.tokens and len(set(alone.result.tokens)) > 2
    cfg.inference.tree = [[0], [1], [0, 0]]  # a static tree: an EAGLE-3 head drafts dynamic ones; refused, not swapped
    with pytest.raises(SpecdrafterError, match=f"^the newest checkpoint of drafter.run {run} holds an EAGLE-3 head, "
                                               "which cannot decode this recipe: .*drafts dynamic trees"):
        resolve_drafter(cfg)
    cfg.inference.tree = []

    (folder / "recipe.yaml").write_text(f"output_dir: {run}\ntarget:\n  model: another-target\n")
    write_checkpoint_state(folder, {"step": 4, "tokens": 100, "drafter": "eagle3", "metrics": {}})
    assert resolve_drafter(cfg).line == (f"drafter: a self-draft (drafter.kind=self_draft): {run} was trained for target "
                                         f"'another-target', not '{tmp_path / 'target'}'")


def eagle3_run(run, target, target_folder):
    """`run` holding one checkpoint of a random EAGLE-3 head trained (so its recipe says) for `target_folder`."""
    folder = run / "checkpoints" / "step-000004"
    save_eagle3(Eagle3Head(eagle3_config(target.config, [0, 1, 2], 256)), folder / "drafter")
    (folder / "recipe.yaml").write_text(f"output_dir: {run}\ntarget:\n  model: {target_folder}\n")
    write_checkpoint_state(folder, {"step": 4, "tokens": 100, "drafter": "eagle3", "metrics": {}})
    return folder


@pytest.mark.parametrize("overrides, refusal", [
    (["inference.verifier=typical", "inference.tree=[[0],[1],[0,0]]"],
     "recipe key 'inference.verifier': typical acceptance needs Medusa heads"),
    (["inference.tree=[[0],[1],[0,0]]"], "recipe key 'inference.tree': an EAGLE-3 head drafts dynamic trees")])
def test_a_recipe_the_runs_head_cannot_decode_is_refused_naming_the_head(tmp_path, smollm2_tokenizer, overrides,
                                                                         refusal):
    """The generate recipe with drafter.run holding an EAGLE-3 head: typical acceptance and a static tree are refused
    where the recipe loads, naming the head that would decode (not drafter.kind's self-draft, which decodes only
    while the run holds no drafter: then the same recipe decodes); drafter.run=null decodes with the self-draft."""
    target = sharp_target(tmp_path / "target", smollm2_tokenizer)
    run = tmp_path / "run"
    base = [f"target.model={tmp_path / 'target'}", "drafter.num_layers=1", "output_dir=unused", f"drafter.run={run}",
            *overrides]
    load_recipe(GENERATE_RECIPE, [*base[:4], "inference.tree=[[0],[1],[0,0]]"])  # no drafter in the run: the self-draft
    folder = eagle3_run(run, target, tmp_path / "target")
    with pytest.raises(SpecdrafterError) as e:
        load_recipe(GENERATE_RECIPE, base)
    line = str(e.value)
    assert line.startswith(refusal) and "\n" not in line and "it is self_draft" not in line
    assert f"drafter.run {run} holds an EAGLE-3 head ({folder / 'drafter'}), which decodes in place of " \
           "drafter.kind=self_draft" in line
    if "inference.verifier=typical" not in overrides:
        assert resolve_drafter(load_recipe(GENERATE_RECIPE, [*base, "drafter.run=null"])).line == (
            "drafter: a self-draft (drafter.kind=self_draft)")


def test_the_block_length_tuner_is_calibrated_before_the_timed_request(tmp_path, smollm2_tokenizer):
    """k = auto: Decoder.calibrate measures the pass costs once, outside any request's time; the request then uses
    them as they are (it would otherwise calibrate within its first request, inside decode's timer)."""
    sharp_target(tmp_path / "target", smollm2_tokenizer)
    cfg = load_recipe(GENERATE_RECIPE, [f"target.model={tmp_path / 'target'}", "drafter.num_layers=1", "inference.k=auto",
                                        "inference.max_new_tokens=6", "output_dir=unused", "drafter.run=null"])
    decoder = load_decoder(cfg)
    prompt = [1, 504, 3287, 314]
    assert decoder.block_length is not None and not decoder.block_length.calibrated
    decoder.calibrate(prompt)
    costs = decoder.block_length.costs
    assert sorted(costs.v) == list(range(1, cfg.inference.k_max + 2))
    decoder(prompt)
    assert decoder.block_length.costs is costs
    cfg.inference.k = 3
    assert load_decoder(cfg).block_length is None  # a fixed block length: nothing to calibrate


def test_the_decode_launcher_says_which_drafter_and_not_the_recipe(tmp_path, smollm2_tokenizer):
    """What the decode job prints by default: the drafter it decodes with, the text, a one-line summary; the resolved
    recipe only with --print-config."""
    sharp_target(tmp_path / "target", smollm2_tokenizer)
    args = [sys.executable, str(REPO / "launch" / "generate.py"), str(GENERATE_RECIPE), f"target.model={tmp_path / 'target'}",
            "drafter.num_layers=1", "inference.max_new_tokens=4", f"drafter.run={tmp_path / 'run'}"]
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[0] == (f"drafter: a self-draft (drafter.kind=self_draft): {tmp_path / 'run'} "
                                                   "holds no trained drafter yet")
    assert "output_dir:" not in done.stdout + done.stderr  # no recipe
    text, summary = done.stdout.rstrip("\n").rsplit("\n", 1)
    assert summary.startswith("decode: ") and "τ =" in summary and text.strip()
    printed = subprocess.run([*args, "--print-config"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert OmegaConf.create(printed.stdout).drafter.run == str(tmp_path / "run") and "drafter:" not in printed.stderr
