"""Recipes: every file validates; bad keys, types, values and paths fail in one line naming the key."""

import re
import runpy
import subprocess
import sys

import pytest
from conftest import REPO
from omegaconf import OmegaConf

from specdrafter.core.recipe import RecipeError
from specdrafter.jobs.recipe import load_recipe

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
DATA_RECIPE = REPO / "recipes" / "smollm2-135m-data.yaml"
EAGLE_RECIPE = REPO / "recipes" / "smollm2-135m-eagle3.yaml"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_validates_and_its_header_command_runs(path, monkeypatch, capsys):
    """The command in the recipe's header comment names a launcher that exists; that launcher, run in this process as
    the command would run it (with --print-config), prints this recipe resolved and exits cleanly."""
    cfg = load_recipe(path)
    header = "\n".join(line for line in path.read_text().splitlines()[:6] if line.startswith("#"))
    command = re.search(rf"(launch/\w+\.py) recipes/{re.escape(path.name)}(\s|$)", header)
    assert command, f"{path.name}: the header comment gives no launch/... command for this recipe"
    launcher = REPO / command.group(1)
    assert launcher.is_file(), launcher
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [command.group(1), f"recipes/{path.name}", "--print-config"])
    runpy.run_path(str(launcher), run_name="__main__")  # a failure would raise SystemExit
    printed = OmegaConf.create(capsys.readouterr().out)
    assert OmegaConf.to_container(printed) == OmegaConf.to_container(cfg, enum_to_str=True)


def test_overrides_merge_with_types():
    cfg = load_recipe(DATA_RECIPE, ["data.num_conversations=7", "data.temperature=0", "data.overlong=truncate"])
    assert cfg.data.num_conversations == 7 and cfg.data.temperature == 0.0
    assert cfg.data.overlong.value == "truncate"


def error_of(overrides, path=DATA_RECIPE) -> str:
    with pytest.raises(RecipeError) as e:
        load_recipe(path, overrides)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_misspelled_key_names_it_and_the_closest_valid_key():
    msg = error_of(["data.num_conversation=3"])
    assert "'data.num_conversation'" in msg and "did you mean 'data.num_conversations'" in msg


def test_unknown_key_in_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("output_dir: x\ntarget:\n  modle: smollm2-135m-instruct\n")
    msg = error_of([], bad)
    assert "'target.modle'" in msg and "'target.model'" in msg


@pytest.mark.parametrize("override,key", [("data.batch_size=many", "data.batch_size"),
                                          ("data.overlong=cut", "data.overlong"),
                                          ("target.dtype=int3", "target.dtype"),
                                          ("data.hidden_states.layer_ids=[a]", "data.hidden_states.layer_ids")])
def test_wrong_type_names_the_key(override, key):
    assert f"'{key}" in error_of([override])


@pytest.mark.parametrize("override,key", [("data.batch_size=0", "data.batch_size"),
                                          ("data.top_p=1.5", "data.top_p"),
                                          ("data.exclude=[mmlu]", "data.exclude"),
                                          ("data.min_prompt_tokens=999", "data.min_prompt_tokens")])
def test_bad_value_names_the_key(override, key):
    assert f"'{key}'" in error_of([override])


def test_missing_required_value(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data:\n  num_conversations: 2\n")
    assert "'output_dir' is required" in error_of([], recipe)


def test_nonexistent_paths_fail_before_loading():
    assert "model folder '/nonexistent/model' does not exist" in error_of(["target.model=/nonexistent/model"])
    assert "'data.prompts'" in error_of(["data.prompts=./no-such-prompts.jsonl"])


def test_dflashs_layer_output_spelling_is_refused_with_the_input_ids():
    """One layer-id convention (layer inputs): DFlash's target_layer_ids are outputs, so no near-miss hint."""
    error = error_of(["drafter.block.target_layer_ids=[1,8]"])
    assert "unknown recipe key 'drafter.block.target_layer_ids'" in error and "drafter.block.aux_layer_ids" in error
    assert "each id + 1" in error and "did you mean" not in error


def test_missing_recipe_file_and_bad_override_shape(tmp_path):
    assert "not found" in error_of([], tmp_path / "nope.yaml")
    assert "key=value" in error_of(["data.batch_size"])


def run_cli(*args):
    return subprocess.run([sys.executable, str(REPO / "launch" / "generate_data.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_cli_bad_key_is_one_line_and_nonzero_exit():
    done = run_cli(DATA_RECIPE, "data.shard_sise=4")
    assert done.returncode != 0
    lines = [l for l in done.stderr.splitlines() if l.strip()]
    assert "Traceback" not in done.stderr
    assert lines == ["error: unknown recipe key 'data.shard_sise' (did you mean 'data.shard_size'?)"]


def test_cli_print_config_prints_the_resolved_recipe_and_exits():
    done = run_cli(DATA_RECIPE, "data.seed=5", "--print-config")
    assert done.returncode == 0, done.stderr
    cfg = OmegaConf.create(done.stdout)
    assert cfg.data.seed == 5 and cfg.target.model == "smollm2-135m-instruct"


def test_print_config_runs_the_checks_against_the_targets_config(smollm2_dir):
    """train.max_length beyond the target's positions is refused from its config.json alone, --print-config or not."""
    done = subprocess.run([sys.executable, str(REPO / "launch" / "train_eagle.py"), str(EAGLE_RECIPE),
                           "train.max_length=1000000", "--print-config"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["error: recipe key 'train.max_length' (1000000) exceeds the target's "
                                                "max_position_embeddings (8192)"]


GENERATE_RECIPE = REPO / "recipes" / "smollm2-135m-generate.yaml"


@pytest.mark.parametrize("overrides,key", [(["inference.k=0"], "inference.k"),
                                           (["inference.temperature=-1"], "inference.temperature"),
                                           (["inference.top_p=0"], "inference.top_p"),
                                           (["inference.top_k=-3"], "inference.top_k"),
                                           (["inference.verifier=asd", "inference.temperature=0.7"], "inference.verifier"),
                                           (["inference.verifier=typical"], "inference.verifier"),
                                           (["drafter.kind=draft_model", "drafter.path=./missing"], "drafter.path"),
                                           (["drafter.kind=medusa2"], "drafter.kind")])
def test_inference_settings_are_checked_before_loading(overrides, key):
    assert f"'{key}'" in error_of(overrides, GENERATE_RECIPE)
