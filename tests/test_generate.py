"""The data job on a tiny random Llama with SmolLM2's tokenizer: filtering, loss masks, shards, resume,
corruption, kill -9, hidden states; and batched generation on the real SmolLM2 target."""

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from conftest import small_data_recipe, tiny_llama_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdrafter.core.io import SpecdrafterError, claim
from specdrafter.data.assets import load_target
from specdrafter.data.hf_engine import generate_responses
from specdrafter.data.regenerate import generate_dataset
from specdrafter.data.shards import check_free_space, claim_path, load_generated

REPO = Path(__file__).resolve().parents[1]
DATA_RECIPE = REPO / "recipes" / "smollm2-135m-data.yaml"


recipe = small_data_recipe


def shard_rows(out):
    return {p.name: datasets.load_from_disk(str(p)).to_dict() for p in sorted((out / "shards").glob("shard-*"))}


def test_job_filters_prompts_and_masks_exactly_the_target_tokens(tmp_path, tiny_target, prompt_file):
    out = tmp_path / "run"
    stats = generate_dataset(recipe(out, tiny_target, prompt_file, "data.num_conversations=20"))  # consider all
    p = stats["prompts"]
    assert (p["duplicates"], p["too_short"], p["overlong_skipped"], p["eval_excluded"]) == (1, 1, 1, 1)
    assert stats["conversations"] == 9 and stats["shards"] == 3
    assert (out / "recipe.yaml").is_file() and (out / "stats.json").is_file()

    tok = AutoTokenizer.from_pretrained(tiny_target)
    data = load_generated(out)
    assert "mt" not in data["id"] and "p3" not in data["id"] and "p11" not in data["id"]
    for row in data:
        prompt = tok.apply_chat_template([row["messages"][0]], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
        n = row["num_prompt_tokens"]
        assert row["input_ids"][:n] == prompt and len(prompt) == n
        assert row["loss_mask"] == [0] * n + [1] * row["num_response_tokens"]
        response = row["input_ids"][n:]
        assert 0 < len(response) <= 12
        text = tok.decode(response[:-1] if row["finished"] else response)
        assert row["messages"][1] == {"role": "assistant", "content": text}


def test_dataset_shrinks_and_grows_by_whole_shards_without_regenerating(tmp_path, tiny_target, prompt_file):
    generate_dataset(recipe(tmp_path, tiny_target, prompt_file, "data.num_conversations=6"))
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "shards").glob("shard-*/shard.json")}
    stats = generate_dataset(recipe(tmp_path, tiny_target, prompt_file, "data.num_conversations=3"))
    assert stats["conversations"] == 3 and stats["this_run"]["generated_conversations"] == 0
    stats = generate_dataset(recipe(tmp_path, tiny_target, prompt_file, "data.num_conversations=6"))
    assert stats["conversations"] == 6 and stats["this_run"]["generated_conversations"] == 0
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "shards").glob("shard-*/shard.json")}
    assert after == before


def test_overlong_prompts_are_truncated_when_asked(tmp_path, tiny_target, prompt_file):
    stats = generate_dataset(recipe(tmp_path, tiny_target, prompt_file, "data.overlong=truncate",
                                    "data.num_conversations=20"))
    assert stats["prompts"]["truncated"] == 1 and stats["prompts"]["overlong_skipped"] == 0
    row = next(r for r in load_generated(tmp_path) if r["prompt_truncated"])
    assert row["id"] == "p11"
    tok = AutoTokenizer.from_pretrained(tiny_target)
    assert len(tok(row["messages"][0]["content"], add_special_tokens=False)["input_ids"]) <= 64


def test_empty_prompt_set_after_filtering_is_one_clear_error(tmp_path, tiny_target, prompt_file):
    cfg = recipe(tmp_path, tiny_target, prompt_file, "data.min_prompt_tokens=200", "data.max_prompt_tokens=300")
    with pytest.raises(SpecdrafterError, match="no prompts left after filtering"):
        generate_dataset(cfg)
    assert list(tmp_path.iterdir()) == [prompt_file]  # no recipe.yaml, no shards/: nothing that looks like output


def file_state(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in root.rglob("*")}


def test_a_job_that_fails_on_its_prompt_file_leaves_no_output_and_keeps_an_earlier_runs(tmp_path, tiny_target,
                                                                                          prompt_file):
    """Issue 54: a bad prompt file left recipe.yaml and an empty shards/ behind (and overwrote a finished run's
    recipe.yaml on a rerun), because the output folder was prepared before the prompts were read."""
    empty, corrupt = tmp_path / "empty.jsonl", tmp_path / "corrupt.jsonl"
    empty.write_text("")
    corrupt.write_bytes(b'{"id": "a", "prompt": "fine"}\n{"id": "b", "prompt": "cut off\n')
    for bad, message in [(empty, "the prompt file is empty"), (corrupt, "corrupt.jsonl:2: not valid JSON")]:
        out = tmp_path / f"run-{bad.stem}"
        with pytest.raises(SpecdrafterError, match=message):
            generate_dataset(recipe(out, tiny_target, bad))
        assert not out.exists()

    out = tmp_path / "run"
    generate_dataset(recipe(out, tiny_target, prompt_file))
    before = file_state(out)
    done = subprocess.run([sys.executable, "launch/generate_data.py", str(DATA_RECIPE), f"output_dir={out}",
                           f"target.model={tiny_target}", f"data.prompts={corrupt}"], cwd=REPO, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: ") and "not valid JSON" in done.stderr
    assert file_state(out) == before  # the finished run's recipe.yaml, shards and stats are as they were


def test_resume_keeps_finished_shards_and_reproduces_missing_ones(tmp_path, tiny_target, prompt_file):
    cfg = recipe(tmp_path, tiny_target, prompt_file)
    generate_dataset(cfg)
    first = shard_rows(tmp_path)
    kept = tmp_path / "shards" / "shard-00000" / "data-00000-of-00001.arrow"
    mtime = kept.stat().st_mtime_ns
    shutil.rmtree(tmp_path / "shards" / "shard-00001")
    stats = generate_dataset(cfg)
    assert stats["this_run"]["generated_conversations"] == 3
    assert kept.stat().st_mtime_ns == mtime
    assert shard_rows(tmp_path) == first  # per-shard seeds: the regenerated shard is the same sample


def test_parallel_workers_share_the_shards_and_make_the_same_dataset(tmp_path, tiny_target, prompt_file):
    """Workers claim shards (a lock each): a worker makes its own first, then any other no worker holds, and skips a
    held one — and its temps, which the holder may be writing. Whoever makes a shard, it is the same sample."""
    one = tmp_path / "one"
    generate_dataset(recipe(one, tiny_target, prompt_file, "data.num_conversations=9"))
    split = tmp_path / "split"
    args = [split, tiny_target, prompt_file, "data.num_conversations=9", "data.workers=2"]
    stale = split / "shards" / ".shard-00001.abc.tmp"  # the temp of a shard another worker holds: not ours to delete
    stale.mkdir(parents=True)
    with claim(claim_path(split, "shard-00001")) as held:  # a live worker 1 making shard 1
        assert held
        first = generate_dataset(recipe(*args))
    assert first["waiting"] == 1 and not (split / "stats.json").exists() and stale.exists()
    assert sorted(p.name for p in (split / "shards").glob("shard-*")) == ["shard-00000", "shard-00002"]
    # worker 1 was killed: its claim went with it, so worker 0 takes shard 1 over, its temp with it, and assembles
    last = generate_dataset(recipe(*args))
    assert last["conversations"] == 9 and last["this_run"]["generated_conversations"] == 3
    assert (split / "stats.json").is_file() and not stale.exists()
    assert shard_rows(split) == shard_rows(one)  # per-shard seeds: who made a shard does not change it
    # the hidden-state cache the same way: worker 1 caches its shard 1, then 2; shard 0 is held
    cache = ["data.hidden_states.layer_ids=[1,2]", "data.hidden_states.dtype=float32"]
    with claim(claim_path(split, "shard-00000.safetensors")) as held:
        assert held
        waiting = generate_dataset(recipe(*args, "data.worker=1", *cache))
    assert waiting["waiting"] == 1
    assert sorted(p.name for p in (split / "hidden").glob("*")) == ["shard-00001.safetensors", "shard-00002.safetensors"]
    generate_dataset(recipe(*args, *cache))
    generate_dataset(recipe(one, tiny_target, prompt_file, "data.num_conversations=9", *cache))
    for i in range(3):
        name = f"shard-{i:05d}.safetensors"
        split_file, one_file = load_file(str(split / "hidden" / name)), load_file(str(one / "hidden" / name))
        assert split_file.keys() == one_file.keys() and all(torch.equal(split_file[k], one_file[k]) for k in one_file)
    assert json.loads((split / "stats.json").read_text())["hidden_state_layers"] == [1, 2]
    with pytest.raises(SpecdrafterError, match="data.worker' \\(2\\) must be below data.workers \\(2\\)"):
        generate_dataset(recipe(split, tiny_target, prompt_file, "data.workers=2", "data.worker=2"))


def test_a_claim_is_exclusive_until_its_holder_lets_go_or_dies(tmp_path):
    path = tmp_path / ".claims" / "shard-00003"
    with claim(path) as first:
        with claim(path) as second:
            assert first and not second
    with claim(path) as again:
        assert again
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from specdrafter.core.io import claim\n"
                               f"with claim(Path({str(path)!r})) as held:\n print(held, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "True"
    with claim(path) as taken:
        assert not taken  # a live worker's
    holder.kill()  # SIGKILL: no cleanup runs, the kernel drops the lock
    holder.wait()
    with claim(path) as taken:
        assert taken


def test_corrupt_shard_is_named_moved_aside_and_regenerated(tmp_path, tiny_target, prompt_file, caplog):
    cfg = recipe(tmp_path, tiny_target, prompt_file)
    generate_dataset(cfg)
    first = shard_rows(tmp_path)
    arrow = tmp_path / "shards" / "shard-00002" / "data-00000-of-00001.arrow"
    arrow.write_bytes(arrow.read_bytes()[:100])
    generate_dataset(cfg)
    assert "shard-00002 is not usable (data-00000-of-00001.arrow does not match its checksum)" in caplog.text
    assert len(list((tmp_path / "corrupt").iterdir())) == 1
    assert shard_rows(tmp_path) == first


def test_changed_settings_refuse_to_mix_with_old_shards(tmp_path, tiny_target, prompt_file):
    generate_dataset(recipe(tmp_path, tiny_target, prompt_file))
    with pytest.raises(SpecdrafterError, match="generated with data.temperature=0.7"):
        generate_dataset(recipe(tmp_path, tiny_target, prompt_file, "data.temperature=0.3"))


# The data job, killed by SIGKILL at a known point, whatever the machine's speed: the third shard is written whole
# into its temp folder, and the job dies just before that folder is renamed into place.
KILLED_BEFORE_THE_THIRD_PUBLISH = """
import os, runpy, signal, sys
from specdrafter.data import shards
publish, published = shards.publish_dir, []
def publish_unless_third(tmp, folder):
    if len(published) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    publish(tmp, folder)
    published.append(folder)
shards.publish_dir = publish_unless_third
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_kill_9_loses_at_most_the_shard_in_progress(tmp_path, tiny_target, prompt_file):
    args = [sys.executable, str(REPO / "launch" / "generate_data.py"), str(DATA_RECIPE), f"output_dir={tmp_path}",
            f"target.model={tiny_target}", "target.dtype=float32", f"data.prompts={prompt_file}", "data.num_conversations=20",
            "data.responses=target", "data.shard_size=1", "data.batch_size=1", "data.min_prompt_tokens=3",
            "data.max_new_tokens=48", "data.hidden_states.layer_ids=[]", "data.overlong=truncate"]
    killed = subprocess.run([sys.executable, "-c", KILLED_BEFORE_THE_THIRD_PUBLISH, *args[1:]], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    shards = tmp_path / "shards"
    assert sorted(p.name for p in shards.glob("shard-*")) == ["shard-00000", "shard-00001"]
    assert [p.name.split(".")[1] for p in shards.glob(".*.tmp")] == ["shard-00002"]  # the shard in progress
    def first_two():  # the finished shards' files, as they are on disk
        return {p.relative_to(shards): (p.stat().st_mtime_ns, p.read_bytes()) for p in shards.glob("shard-0000[01]/*")}
    kept = first_two()
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming: 2 of 10 shards already done" in done.stderr and first_two() == kept  # kept, not redone
    # what the job says: the recipe.yaml it saved (not the recipe), its progress, one closing line
    assert f"recipe: {tmp_path / 'recipe.yaml'}\n" in done.stderr and "output_dir:" not in done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("data: 10 conversations, ")
    assert done.stderr.strip().endswith(f"in 10 shards → {tmp_path}")
    assert len(load_generated(tmp_path)) == 10
    assert not list((tmp_path / "shards").glob(".*.tmp")) and not (tmp_path / "corrupt").exists()


def test_hidden_states_are_the_targets_layer_inputs(tmp_path, tiny_target, prompt_file):
    cfg = recipe(tmp_path, tiny_target, prompt_file, "data.hidden_states.layer_ids=[0,1,2]",
                 "data.hidden_states.dtype=float32", "data.hidden_states.batch_size=2")
    generate_dataset(cfg)
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    shard = datasets.load_from_disk(str(tmp_path / "shards" / "shard-00001"))
    cached = load_file(str(tmp_path / "hidden" / "shard-00001.safetensors"))
    offsets = cached["offsets"].tolist()
    assert offsets[0] == 0 and offsets[-1] == sum(len(x) for x in shard["input_ids"])
    for i, ids in enumerate(shard["input_ids"]):  # one unpadded sequence at a time
        with torch.no_grad():
            ref = model.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        rows = slice(offsets[i], offsets[i + 1])
        for k in (0, 1):
            torch.testing.assert_close(cached[f"layer_{k}"][rows], ref[k][0], atol=1e-5, rtol=1e-4)
        # id 2 = L is the last layer's output before the final norm (HF's hidden_states[L] is after it)
        torch.testing.assert_close(model.model.norm(cached["layer_2"][rows]), ref[2][0], atol=1e-5, rtol=1e-4)
    mtime = (tmp_path / "hidden" / "shard-00001.safetensors").stat().st_mtime_ns
    generate_dataset(cfg)  # rerun: valid caches are kept
    assert (tmp_path / "hidden" / "shard-00001.safetensors").stat().st_mtime_ns == mtime


def test_hidden_state_layer_out_of_range_and_disk_space(tmp_path, tiny_target, prompt_file):
    with pytest.raises(SpecdrafterError, match="layer_ids': layer id 3 is out of range for a target with 2 layers"):
        generate_dataset(recipe(tmp_path, tiny_target, prompt_file, "data.hidden_states.layer_ids=[1,3]"))
    with pytest.raises(SpecdrafterError, match="GiB is free"):
        check_free_space(shutil.disk_usage(tmp_path).free + 2**30, tmp_path)


def test_tokenizer_without_chat_template_is_refused(tmp_path, tiny_target):
    folder = tmp_path / "no-template"
    shutil.copytree(tiny_target, folder)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdrafterError, match="has no chat template"):
        load_target(str(folder))


def test_tokenizer_that_does_not_match_the_target_is_refused(tmp_path, tiny_target, smollm2_tokenizer):
    folder = tmp_path / "small-vocab"
    AutoModelForCausalLM.from_config(tiny_llama_config(1000)).save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    with pytest.raises(SpecdrafterError, match="tokenizer and target do not match"):
        load_target(str(folder))


def test_batched_left_padded_generation_matches_batch_size_1_on_smollm2(smollm2_dir, smollm2_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    prompts = [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"]
               for t in ("What is 2 + 2?", "Name a colour.", "Write one sentence about the sea and the sky.")]
    one = generate_responses(model, smollm2_tokenizer, prompts, 10, 0.0, 1.0, batch_size=1)
    batched = generate_responses(model, smollm2_tokenizer, prompts, 10, 0.0, 1.0, batch_size=3)
    assert batched == one and all(len(r) > 0 for r in one)
