"""Files a user points at — drafter folders, exports, checkpoints, targets, prompt files, datasets folders, the data
job's shards, the eval job's results.json — corrupt, truncated, zeroed, of the wrong kind, empty or missing: one line
naming the file and what is wrong, a non-zero exit from the launchers, never a traceback."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoConfig

from specdrafter.core.io import SpecdrafterError, write_checkpoint_state
from specdrafter.core.weights import check_model_folder
from specdrafter.data.assets import load_prompt_set, load_target
from specdrafter.data.shards import load_generated, write_shard
from specdrafter.eval.job import Results, find_run_checkpoints, results_header
from specdrafter.export.formats import find_source
from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds import KINDS, check_drafter_folder
from specdrafter.models.eagle import Eagle3Head, eagle3_config, load_eagle1, load_eagle3, save_eagle3
from specdrafter.models.medusa import MedusaHeads, load_medusa, medusa_config, save_medusa
from specdrafter.train.batches import read_stats

REPO = Path(__file__).resolve().parents[1]


def damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(raw[: len(raw) // 2]))
    elif how == "zero":
        path.write_bytes(bytes(len(raw)))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "missing":
        path.unlink()
    elif how == "garbage":
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    elif how == "list":
        path.write_text("[1, 2, 3]")
    elif how == "header-bitflip":
        raw[8] ^= 0x10  # the "{" that opens the JSON header of a safetensors file
        path.write_bytes(bytes(raw))
    elif how == "name-bitflip":
        at = raw.index(b"fc.weight")  # a tensor's name in the header: the file parses, the weights do not fit
        raw[at] ^= 0x01
        path.write_bytes(bytes(raw))
    else:  # bitflip at the end: the tensor data, which only a checksum can catch
        raw[-3] ^= 0x01
        path.write_bytes(bytes(raw))


def one_line(e) -> str:
    message = str(e.value)
    assert "\n" not in message and message
    return message


@pytest.fixture(scope="module")
def eagle_folder(tmp_path_factory, tiny_target) -> Path:
    torch.manual_seed(0)
    head = Eagle3Head(eagle3_config(AutoConfig.from_pretrained(tiny_target), [0, 1, 2], 256))
    return save_eagle3(head, tmp_path_factory.mktemp("heads") / "eagle3")


@pytest.fixture
def checkpoint(tmp_path, eagle_folder) -> Path:
    """A training checkpoint as the loop writes it, with the checksums of every file in trainer_state.json."""
    folder = tmp_path / "run" / "checkpoints" / "step-000004"
    shutil.copytree(eagle_folder, folder / "drafter")
    (folder / "recipe.yaml").write_text("output_dir: run\ndrafter:\n  kind: eagle3\n")
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"deepspeed state" * 100)
    write_checkpoint_state(folder, {"step": 4, "tokens": 100, "drafter": "eagle3", "metrics": {}})
    return folder


# ---------------------------------------------------------------------------------------------- drafters
DRAFTER_FAULTS = ([("config.json", how) for how in ("missing", "empty", "truncate", "zero", "garbage", "list")]
                  + [("model.safetensors", how) for how in ("missing", "empty", "truncate", "zero", "garbage",
                                                            "header-bitflip")])


@pytest.mark.parametrize("name, how", DRAFTER_FAULTS, ids=[f"{n}-{h}" for n, h in DRAFTER_FAULTS])
def test_a_damaged_drafter_folder_is_one_line_naming_the_file(tmp_path, eagle_folder, name, how):
    folder = tmp_path / "eagle3"
    shutil.copytree(eagle_folder, folder)
    damage(folder / name, how)
    with pytest.raises(SpecdrafterError) as e:
        check_drafter_folder(folder, KINDS["eagle3"])
    assert f"'{folder}': {name} " in one_line(e)
    if name == "model.safetensors" and how != "missing":  # the loader itself, without the folder check
        with pytest.raises(SpecdrafterError) as e:
            load_eagle3(folder)
        assert f"{folder / name}" in one_line(e)


def test_missing_folder_a_file_and_the_wrong_kind_are_one_line(tmp_path, eagle_folder, tiny_target):
    with pytest.raises(SpecdrafterError, match="does not exist"):
        check_drafter_folder(tmp_path / "nowhere", KINDS["eagle3"])
    with pytest.raises(SpecdrafterError, match="is a file, not a folder"):
        check_drafter_folder(eagle_folder / "model.safetensors", KINDS["eagle3"])
    for kind in ("medusa", "eagle1", "draft_model"):
        with pytest.raises(SpecdrafterError, match=f"holds an EAGLE-3 head, but recipe key 'drafter.kind' is {kind}"):
            check_drafter_folder(eagle_folder, KINDS[kind])
    medusa = save_medusa(MedusaHeads(medusa_config(AutoConfig.from_pretrained(tiny_target), 2, 1)), tmp_path / "medusa")
    with pytest.raises(SpecdrafterError, match="holds Medusa heads, but recipe key 'drafter.kind' is eagle3"):
        check_drafter_folder(medusa, KINDS["eagle3"])
    shutil.copyfile(eagle_folder / "model.safetensors", medusa / "model.safetensors")  # EAGLE weights, Medusa config
    with pytest.raises(SpecdrafterError, match="do not match its config.json"):
        load_medusa(medusa)
    renamed = tmp_path / "renamed"
    shutil.copytree(eagle_folder, renamed)
    damage(renamed / "model.safetensors", "name-bitflip")
    with pytest.raises(SpecdrafterError, match="do not fit an EAGLE-3 head of its config.json: .*fc.weight"):
        load_eagle3(renamed)
    eagle1 = tmp_path / "eagle1"  # EAGLE-3 weights under an EAGLE-1 config
    shutil.copytree(eagle_folder, eagle1)
    config = json.loads((eagle1 / "config.json").read_text())
    (eagle1 / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLMEagle"]}))
    with pytest.raises(SpecdrafterError, match="do not fit an EAGLE-1 head"):
        load_eagle1(eagle1)


@pytest.mark.parametrize("name", ["drafter/model.safetensors", "drafter/config.json"])
def test_a_checkpoints_drafter_is_checked_against_the_recorded_checksums(checkpoint, name):
    damage(checkpoint / name, "bitflip")  # still parses: only the checksum knows
    with pytest.raises(SpecdrafterError) as e:
        check_model_folder(checkpoint / "drafter", "drafter folder")
    assert f"its checkpoint is damaged ({name} does not match its checksum)" in one_line(e)
    with pytest.raises(SpecdrafterError, match=f"checkpoint '{checkpoint}' is damaged: {name} does not match"):
        find_source(checkpoint)  # export
    cfg = load_recipe(REPO / "recipes" / "smollm2-135m-eagle3.yaml", ["output_dir=x", f"eval.checkpoint={checkpoint}"])
    with pytest.raises(SpecdrafterError, match=f"is damaged: {name} does not match its checksum"):
        find_run_checkpoints(cfg)  # eval


def test_an_intact_checkpoint_and_an_export_load(checkpoint, tmp_path):
    state = find_source(checkpoint).state  # export: the state without its checksums
    assert state == {"step": 4, "tokens": 100, "drafter": "eagle3", "metrics": {}}
    cfg = load_recipe(REPO / "recipes" / "smollm2-135m-eagle3.yaml", ["output_dir=x", f"eval.checkpoint={checkpoint}"])
    assert [c.drafter for c in find_run_checkpoints(cfg)] == [checkpoint / "drafter"]
    export = tmp_path / "export"  # an export: the drafter at top level beside trainer_state.json
    shutil.copytree(checkpoint / "drafter", export)
    (export / "trainer_state.json").write_text(json.dumps({"step": 4, "drafter": "eagle3"}))
    cfg.eval.checkpoint = str(export)
    assert [c.drafter for c in find_run_checkpoints(cfg)] == [export]


@pytest.mark.parametrize("spec, message", [
    ("gpu", "recipe key 'target.device': 'gpu' is not a device (auto, cpu, cuda or cuda:N)"),
    ("meta", "recipe key 'target.device': 'meta' is not supported (auto, cpu, cuda or cuda:N)"),
    ("cuda:0", "recipe key 'target.device' is 'cuda:0' but this machine has no CUDA device; use auto or cpu"),
])
def test_a_bad_target_device_is_one_line(tiny_target, spec, message):
    if spec.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(SpecdrafterError) as e:
        load_target(str(tiny_target), device=spec)
    assert one_line(e) == message
    model, _ = load_target(str(tiny_target), device="auto")
    assert model.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_damaged_target_folder_is_one_line(tmp_path, tiny_target):
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    damage(target / "model.safetensors", "truncate")
    with pytest.raises(SpecdrafterError) as e:
        load_target(str(target))
    assert f"target '{target}': model.safetensors is truncated or corrupt" in one_line(e)


def test_a_damaged_draft_model_to_train_from_is_one_line(tmp_path, tiny_target):
    from transformers import AutoModelForCausalLM

    from specdrafter.kinds import build_drafter
    draft = tmp_path / "draft"
    shutil.copytree(tiny_target, draft)
    damage(draft / "model.safetensors", "zero")
    cfg = load_recipe(REPO / "recipes" / "smollm2-135m-draft.yaml",
                      [f"output_dir={tmp_path}", f"target.model={tiny_target}", f"drafter.path={draft}"])
    with pytest.raises(SpecdrafterError) as e:
        build_drafter(cfg, AutoModelForCausalLM.from_pretrained(tiny_target))
    assert f"draft model '{draft}': model.safetensors is truncated or corrupt" in one_line(e)


# ------------------------------------------------------------------------------------- datasets and shards
def test_damaged_datasets_folders_are_one_line(tmp_path):
    folder = tmp_path / "prompts"
    datasets.Dataset.from_list([{"prompt": f"Question {i}?"} for i in range(5)]).save_to_disk(str(folder))
    assert len(load_prompt_set(str(folder))) == 5
    arrow = next(folder.glob("*.arrow"))
    for how in ("truncate", "zero"):
        saved = arrow.read_bytes()
        damage(arrow, how)
        with pytest.raises(SpecdrafterError, match=f"{folder}: not a saved datasets folder"):
            load_prompt_set(str(folder))
        arrow.write_bytes(saved)
    (folder / "state.json").write_text("{")
    with pytest.raises(SpecdrafterError, match=f"{folder}: not a saved datasets folder"):
        load_prompt_set(str(folder))
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "x"}])}).save_to_disk(str(splits))
    with pytest.raises(SpecdrafterError, match="holds several splits \\(train\\)"):
        load_prompt_set(str(splits))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecdrafterError, match="not a saved datasets folder"):
        load_prompt_set(str(tmp_path / "empty"))


@pytest.mark.parametrize("how", ["truncate", "zero", "bitflip", "missing"])
def test_a_damaged_shard_of_the_training_data_is_named(tmp_path, how):
    out = tmp_path / "data"
    rows = [{"id": f"c{i}", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]} for i in range(4)]
    write_shard(rows[:2], [r["id"] for r in rows[:2]], out / "shards" / "shard-00000", {})
    write_shard(rows[2:], [r["id"] for r in rows[2:]], out / "shards" / "shard-00001", {})
    assert load_generated(out).num_rows == 4
    arrow = next((out / "shards" / "shard-00001").glob("*.arrow"))
    damage(arrow, how)
    with pytest.raises(SpecdrafterError) as e:
        load_generated(out)
    assert f"shard '{out / 'shards' / 'shard-00001'}' is damaged: {arrow.name} " in one_line(e)
    (out / "stats.json").write_text('{"shards": ')
    with pytest.raises(SpecdrafterError, match="stats.json' is not valid JSON"):
        read_stats(out / "stats.json")


# ------------------------------------------------------------------------------------------ results.json
@pytest.mark.parametrize("how", ["truncate", "zero", "bitflip-value"])
def test_a_damaged_results_json_is_moved_aside_and_the_evaluation_starts_afresh(tmp_path, caplog, how):
    cfg = load_recipe(REPO / "recipes" / "smollm2-135m-eagle3.yaml", ["output_dir=x"])
    results = Results(tmp_path, results_header(cfg))
    results.add({"id": "cell-1", "tau": 2.5, "outputs": "outputs/cell-1.jsonl"})
    assert Results(tmp_path, results_header(cfg)).data["cells"][0]["tau"] == 2.5  # its own checksum matches
    if how == "bitflip-value":  # still valid JSON, another number: only the checksum knows
        (tmp_path / "results.json").write_text((tmp_path / "results.json").read_text().replace("2.5", "3.5"))
    else:
        damage(tmp_path / "results.json", how)
    with caplog.at_level("WARNING", logger="specdrafter"):
        assert Results(tmp_path, results_header(cfg)).data["cells"] == []
    assert (tmp_path / "results.json.damaged").is_file()
    assert any("results.json is damaged" in r.message and "moved aside" in r.message for r in caplog.records)


# ------------------------------------------------------------------------------------------- the launchers
def run(*args, timeout=300):
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    return done.stderr.strip().splitlines()[-1]


def test_launchers_exit_with_one_line_on_damaged_files(tmp_path, eagle_folder, tiny_target, checkpoint):
    drafter = tmp_path / "drafter"
    shutil.copytree(eagle_folder, drafter)
    damage(drafter / "model.safetensors", "truncate")
    last = run("launch/generate.py", "recipes/smollm2-135m-generate.yaml", "drafter.kind=eagle3",
               f"drafter.path={drafter}", f"target.model={tiny_target}")
    assert last.startswith(f"error: drafter folder '{drafter}': model.safetensors is truncated or corrupt")

    damage(checkpoint / "drafter" / "model.safetensors", "bitflip")
    last = run("launch/export.py", str(checkpoint), "--format", "vllm", "--out", str(tmp_path / "out"))
    assert last == (f"error: checkpoint '{checkpoint}' is damaged: drafter/model.safetensors does not match its "
                    "checksum")

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "fine"}\n\n{"prompt": "caf\xe9"}\n')
    last = run("launch/generate_data.py", "recipes/smollm2-135m-data.yaml", f"output_dir={tmp_path / 'data'}",
               f"data.prompts={prompts}", f"target.model={tiny_target}")
    assert last == f"error: {prompts}:3: not UTF-8 text (byte 15 of the line)"
