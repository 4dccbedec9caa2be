"""Fuzzing the two loaders every user file goes through: the recipe loader (core/recipe.py: load_recipe and the CLI)
and the prompt-file loader (data/assets.py: load_prompt_set). Hundreds of generated malformed inputs, fixed seed,
in-process: never a traceback, always a SpecdrafterError of one line that names the key, or the line of the file."""

import dataclasses
import json
import random
import re
import typing
from enum import Enum

import pytest
import yaml
from conftest import REPO
from omegaconf import OmegaConf

from specdrafter.core.io import SpecdrafterError
from specdrafter.core.recipe import Recipe, RecipeError
from specdrafter.data.assets import load_prompt_set
from specdrafter.jobs.cli import cli
from specdrafter.jobs.recipe import load_recipe

SEED = 20240617
BASE_RECIPE = REPO / "recipes" / "smollm2-135m-eagle3.yaml"


# --------------------------------------------------------------------------------------------- the schema
def schema_fields(cls=Recipe, prefix=""):
    """(dotted key, type) of every leaf of the recipe schema."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            yield from schema_fields(t, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", t


def sections(cls=Recipe, prefix=""):
    """Dotted keys of every mapping of the schema ("" = the top level)."""
    yield prefix.rstrip(".")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from sections(hints[f.name], f"{prefix}{f.name}.")


FIELDS = dict(schema_fields())
SECTIONS = list(sections())


def full_recipe() -> dict:
    """A valid recipe with every key written out (the eagle3 recipe over the schema defaults)."""
    return OmegaConf.to_container(load_recipe(BASE_RECIPE, ["output_dir=fuzz-out"]), enum_to_str=True)


def dump(tree: dict) -> bytes:
    return yaml.safe_dump(tree, sort_keys=False).encode()


def put(tree: dict, key: str, value) -> dict:
    tree = json.loads(json.dumps(tree))  # a deep copy
    *parents, leaf = key.split(".")
    node = tree
    for p in parents:
        node = node[p]
    node[leaf] = value
    return tree


def is_list(t) -> bool:
    return typing.get_origin(t) in (list, typing.List)


def is_number(t) -> bool:
    inner = [a for a in typing.get_args(t) if a is not type(None)]
    return t in (int, float) or (typing.get_origin(t) is typing.Union and inner == [float])


def innermost(t):
    while is_list(t):
        t = typing.get_args(t)[0]
    return t


def wrong_types(t) -> list:
    """Values of the wrong type for a field of type `t` (ints and floats are valid strings: not listed for str)."""
    if is_list(t):
        item = typing.get_args(t)[0]
        bad_item = ([["x"]] if is_list(item) else [[1]] if item is str else ["not-a-number"] if item in (int, float)
                    else ["bogus"])
        return ["a-string", {"x": 1}, 5, bad_item]
    if typing.get_origin(t) in (dict, typing.Dict):
        return ["a-string", [1.0], {"soft_ce": "heavy"}]
    if isinstance(t, type) and issubclass(t, Enum):
        return ["bogus-choice", ["x"], {"x": 1}]
    if t is bool:
        return ["maybe", [True], {"x": 1}]
    if t is int:
        return ["abc", 2.5, [1, 2], {"x": 1}]
    if is_number(t):
        return ["abc", [0.5], {"x": 1.0}]
    return [[1, 2], {"x": 1}]  # str, Optional[str], Union[int, str]


# Out-of-range values of every bounded key (a list's item when the key holds a list). Every numeric key of the schema
# must appear here: test_every_number_of_the_schema_has_a_rule.
OUT_OF_RANGE = {
    "data.num_conversations": [0, -5], "data.min_prompt_tokens": [-1, 100000], "data.max_prompt_tokens": [0],
    "data.max_new_tokens": [0], "data.temperature": [-0.5], "data.top_p": [0, 1.5], "data.batch_size": [0],
    "data.shard_size": [-3], "data.seed": [-1, 2**32], "data.concurrency": [0], "data.max_turns": [0],
    "data.workers": [0], "data.worker": [-1], "data.llamacpp.threads": [-1],
    "target.chat_template_kwargs": [{"enable-thinking": False}],
    "data.target_share": [-0.1, 1.5], "data.hidden_states.layer_ids": [[-1]], "data.hidden_states.batch_size": [0],
    "drafter.num_layers": [0], "drafter.layers": [[0, -2]], "drafter.lora.r": [-1], "drafter.lora.alpha": [0, -16],
    "drafter.lora.dropout": [-0.1, 1.0], "drafter.medusa.num_heads": [0], "drafter.medusa.num_layers": [-1],
    "drafter.medusa.decay": [0], "drafter.medusa.stage": [0, 3], "drafter.medusa.heads_weight": [0],
    "drafter.medusa.backbone_lr_ratio": [-1], "drafter.eagle.aux_layer_ids": [[1, 2], [-1, 2, 3]],
    "drafter.eagle.ttt_steps": [0], "drafter.eagle.step_decay": [0], "drafter.eagle.draft_vocab_size": [-1],
    "drafter.eagle.feature_weight": [-1], "drafter.eagle.ce_weight": [-0.1],
    "drafter.block.num_layers": [0], "drafter.block.block_size": [1, 0], "drafter.block.aux_layer_ids": [[0]],
    "drafter.block.num_features": [0], "drafter.block.mask_token_id": [-1], "drafter.block.anchors": [0],
    "drafter.block.loss_decay": [-1], "drafter.block.dpace_alpha": [0, 1.5], "drafter.block.markov_rank": [-1],
    "drafter.block.markov_lr_scale": [0, -1], "drafter.block.markov_hold": [-0.1, 1.0], "drafter.block.confidence_weight": [-0.5],
    "drafter.block.draft_vocab_size": [-1], "drafter.block.conv_kernel_size": [0], "drafter.block.conv_group_size": [0],
    "drafter.block.selector_rank": [0], "drafter.block.selector_top_k": [1], "drafter.block.selector_weight": [-1],
    "drafter.block.gru_hidden_dim": [0], "drafter.block.correction_dim": [0], "drafter.block.uncorrected_drafts": [-1],
    "drafter.block.base_weight": [-0.1, 1.5], "drafter.block.base_decay": [-0.1, 1.5],
    "drafter.peagle.depths": [1], "drafter.peagle.cod_ratio": [0, 1], "drafter.peagle.cod_ratio_min": [-0.1, 1.5],
    "drafter.peagle.mask_token_id": [-1], "drafter.peagle.depth_decay": [0],
    "drafter.mtp.steps": [0], "drafter.mtp.step_decay": [0],
    "train.objective": [{"soft_ce": -1.0}, {"soft_ce": 0.0}], "train.temperature": [0, -1], "train.jsd_beta": [0, 1],
    "train.max_length": [1], "train.data_tokens": [-1], "train.epochs": [0], "train.max_steps": [-1],
    "train.micro_batch_size": [0], "train.grad_accum": [0], "train.lr": [0, -1e-4], "train.warmup_steps": [-1],
    "train.min_lr_ratio": [1.5, -0.1], "train.weight_decay": [-0.01], "train.grad_clip": [-1], "train.zero_stage": [4],
    "train.heldout": [-1], "train.eval_every": [0], "train.save_every": [0], "train.keep_checkpoints": [0],
    "train.seed": [-7, 2**40], "train.decode_check_every": [-1], "train.gpu_memory_gb": [0, -8],
    "inference.max_new_tokens": [0], "inference.temperature": [-1], "inference.top_k": [-1],
    "inference.top_p": [0, 2], "inference.k": [0, "fast"], "inference.k_max": [0], "inference.tree": [[[0], [-1]]],
    "inference.dynamic_tree.total_tokens": [-1], "inference.dynamic_tree.depth": [0],
    "inference.dynamic_tree.top_k": [0],
    "inference.asd.budget": [-1], "inference.asd.gate": [-0.5], "inference.asd.max_mismatches": [0],
    "inference.typical.eps": [-0.1], "inference.typical.delta": [-1], "inference.seed": [-1],
    "eval.sets": [[]], "eval.num_prompts": [0], "eval.max_new_tokens": [0], "eval.temperatures": [[], [0, -1]],
    "eval.repeats": [0], "eval.llamacpp.threads": [0, -1], "eval.llamacpp.p_min_sweep": [[0.5, 1.0], [0]],
    "eval.verifiers": [[]], "eval.k_sweep": [[0, 2]], "eval.asd_sweep": [[[4, 0.25]], [[-1, 0.25, 1]]],
    "scaling.budgets": [[0, 100]], "scaling.compare_budget": [-1], "scaling.tokens_per_conversation": [0],
}


# ------------------------------------------------------------------------------------------ recipe cases
def recipe_cases():
    """(name, file bytes, what the error must name: a recipe key, or None for "a line of the file")."""
    rng = random.Random(SEED)
    base = full_recipe()
    cases = []
    for key, t in FIELDS.items():  # wrong types, every field
        for value in rng.sample(wrong_types(t), 2 if is_list(t) else 1):
            cases.append((f"type:{key}={value!r}", dump(put(base, key, value)), key))
    for section in SECTIONS:  # unknown and misspelled keys, every depth (and an unknown objective in train.objective)
        node = base
        for p in filter(None, section.split(".")):
            node = node[p]
        for bad in [misspell(rng, rng.choice(list(node))) for _ in range(2)] + [random_word(rng)]:
            if bad in node:
                continue
            key = f"{section}.{bad}" if section else bad
            cases.append((f"unknown:{key}", dump(put(base, key, rng.choice([1, "x", [1], {"y": 2}]))), key))
    for bad in ("soft_cee", "kl", random_word(rng)):
        cases.append((f"unknown:train.objective.{bad}", dump(put(base, f"train.objective.{bad}", 1.0)),
                      f"train.objective.{bad}"))
    for key, values in OUT_OF_RANGE.items():  # out of range
        for value in values:
            cases.append((f"range:{key}={value!r}", dump(put(base, key, value)), key))
    numbers = [k for k, t in FIELDS.items() if is_number(innermost(t)) or innermost(t) is int]
    for key in numbers + ["train.objective"]:  # huge numbers, NaN, infinities (as items of the lists of numbers)
        t = FIELDS[key]
        huge = [10**30, -(2**63), 1e400] if innermost(t) is int else [float("nan"), float("inf"), -float("inf"), 1e400]
        value = rng.choice(huge)
        cases.append((f"number:{key}={value!r}", dump(put(base, key, where_numbers_go(key, t, value))), key))
    for key, t in FIELDS.items():  # lists (and mappings) where a scalar goes
        if not is_list(t) and typing.get_origin(t) not in (dict, typing.Dict):
            cases.append((f"list:{key}", dump(put(base, key, rng.choice([[1, 2], [], [[0]], ["a", "b"]]))), key))
    text = dump(base).decode().splitlines()
    for i in range(40):  # YAML syntax errors at random lines
        at = rng.randrange(len(text) + 1)
        broken = text[:at] + [rng.choice(SYNTAX_ERRORS)] + text[at:]
        cases.append((f"yaml:{i}", "\n".join(broken).encode(), None))
    for i in range(40):  # binary garbage, and control characters in otherwise valid UTF-8
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
        if i % 2:
            raw = ("output_dir: x\n" + "".join(chr(rng.choice([0, 1, 7, 27, 0xFFFE, 0x85, rng.randrange(32, 127)]))
                                               for _ in range(60))).encode("utf-8", "surrogatepass")
        cases.append((f"garbage:{i}", raw, None))
    for i, raw in enumerate([b"", b"\n\n", b"# only a comment\n", b"   ", b"---\n", b"~\n", b"null\n"]):
        cases.append((f"empty:{i}", raw, "output_dir"))
    return cases


def where_numbers_go(key: str, t, value):
    """`value` where a field of type `t` holds its numbers: itself, a list's item, an item of a list of lists."""
    if key == "eval.asd_sweep":
        return [[value, 0.25, 1]]
    if key == "train.objective":
        return {"soft_ce": value}
    if not is_list(t):
        return value
    return [[value]] if is_list(typing.get_args(t)[0]) else [value]


SYNTAX_ERRORS = ["key: [unclosed", "other: {a: 1", 'quoted: "never closed', "\tkey: tabbed", "- a list item", ": :",
                 "alias: *nowhere", "tag: !!python/object:os.system x", "  - [", "]", "a: b: c", "% directive"]


def misspell(rng, word: str) -> str:
    i = rng.randrange(len(word))
    how = rng.randrange(4)
    if how == 0 and len(word) > 1:
        j = min(i + 1, len(word) - 1)
        return word[:i] + word[j] + word[i] + word[j + 1:] if i != j else word + "s"
    if how == 1 and len(word) > 1:
        return word[:i] + word[i + 1:]
    if how == 2:
        return word[:i] + word[i] + word[i:]
    return word.upper() if word.upper() != word else word + "_"


def random_word(rng) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randrange(3, 12)))


CASES = recipe_cases()


def test_the_base_written_out_in_full_loads_back_unchanged(tmp_path):
    """Every case is this file with one thing broken: unbroken, with every key of the schema written out at the
    value it resolved to, it must load, to itself (a rule refusing a key's own default, or a key that cannot be
    written back, would make the cases fail for the wrong reason)."""
    path = tmp_path / "full.yaml"
    path.write_bytes(dump(full_recipe()))
    assert OmegaConf.to_container(load_recipe(path), enum_to_str=True) == full_recipe()


def test_every_number_of_the_schema_has_a_rule():
    numbers = {k for k, t in FIELDS.items() if is_number(innermost(t)) or innermost(t) is int
               or typing.get_origin(t) in (dict, typing.Dict) or t == typing.Union[int, str]}
    assert numbers <= set(OUT_OF_RANGE), sorted(numbers - set(OUT_OF_RANGE))


def test_fuzzed_recipes_fail_in_one_line_naming_the_key_or_the_line(tmp_path):
    failures = []
    for i, (name, raw, key) in enumerate(CASES):
        path = tmp_path / f"case-{i}.yaml"
        path.write_bytes(raw)
        try:
            load_recipe(path)
            failures.append(f"{name}: accepted")
            continue
        except RecipeError as e:
            message = str(e)
        except Exception as e:  # noqa: BLE001 — the point of the test
            failures.append(f"{name}: {type(e).__name__}: {e}")
            continue
        names_it = re.search(rf"'{re.escape(key)}[\[.']" if key else  # garbage that parses names its stray key
                             rf"{re.escape(str(path))}:\d+: |^unknown recipe key '", message)
        if "\n" in message or not names_it:
            failures.append(f"{name}: {message!r}")
        if i % 8 == 0:  # the CLI: one line on stderr, exit status 1
            with pytest.raises(SystemExit) as done:
                cli(lambda cfg: None, [str(path)])
            if not (isinstance(done.value.code, str) and done.value.code == f"error: {message}"):
                failures.append(f"{name}: cli exited with {done.value.code!r}")
    assert not failures, f"{len(failures)} of {len(CASES)}:\n" + "\n".join(failures[:40])


BAD_OVERRIDES = [
    ("train.lr", "train.lr"), ("=1", "=1"), ("train.lr=[", "train.lr=["), ("train.lr={", "train.lr={"),
    ("train.lr=1e999", "train.lr"), ("train.lr=nan", "train.lr"), ("train.lr=-inf", "train.lr"),
    ("train.lr=\x00", "train.lr"), ("train.lr=!!python/name:os.system", "train.lr"), ("nokey.x=1", "nokey"),
    ("train..lr=1", "train..lr"), ("train.lr.=1", "train.lr."), ("train.lr=${oops", "train.lr"),
    ("train.lr=${no.such.key}", "train.lr"), ("data.prompts=${oc.env:SPECDRAFTER_FUZZ_UNSET}", "data.prompts"),
    ("train.seed=99999999999999999999999", "train.seed"), ("eval.temperatures=[0,.nan]", "eval.temperatures"),
    ("inference.tree=[[0],[a]]", "inference.tree"), ("train.objective.soft_ce=.inf", "train.objective.soft_ce"),
    ("train.wandb.mode=sometimes", "train.wandb.mode"), ("drafter.kind=[eagle3]", "drafter.kind"),
]


@pytest.mark.parametrize("override, named", BAD_OVERRIDES, ids=[o for o, _ in BAD_OVERRIDES])
def test_fuzzed_overrides_fail_in_one_line_naming_them(override, named, capsys):
    with pytest.raises(SystemExit) as done:
        cli(lambda cfg: None, [str(BASE_RECIPE), override])
    code = done.value.code
    assert isinstance(code, str) and code.startswith("error: ") and "\n" not in code, code
    assert named in code, code


# ------------------------------------------------------------------------------------------ prompt files
GOOD_ROWS = [{"id": "a", "prompt": "Tell me about rivers."}, {"turns": ["Hi there.", "And then?"]},
             {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]},
             {"conversations": [{"from": "human", "value": "Count to three."}, {"from": "gpt", "value": "1 2 3"}]}]
BAD_ROWS = [b'{"prompt": "unterminated', b"{prompt: 'x'}", b"[", b'{"prompt": "x"} trailing', b"NaN garbage",
            b"[1, 2]", b"42", b'"a string"', b"null", b"true", b'{"id": "x"}', b"{}", b'{"text": "x"}',
            b'{"turns": []}', b'{"turns": [""]}', b'{"turns": ["   "]}', b'{"prompt": ""}', b'{"prompt": "  \\t "}',
            b'{"turns": "a string"}', b'{"turns": {"a": "b"}}', b'{"turns": [1]}', b'{"turns": [null]}',
            b'{"prompt": 5}', b'{"prompt": ["x"]}', b'{"messages": "abc"}', b'{"messages": [1]}',
            b'{"messages": [{"role": "assistant", "content": "x"}]}', b'{"messages": [{"role": "user", "content": 5}]}',
            b'{"conversations": [{"from": "human"}]}', b'{"turns": ["ok"], "messages": "abc"}',
            b'{"turns": ["ok"], "conversations": [["x"]]}', b'{"prompt": "caf\xe9"}', b"\xff\xfe\x00\x01",
            b'{"prompt": "x\x00"}', b"\x00\x00\x00"]


def prompt_cases():
    rng = random.Random(SEED + 1)
    cases = []
    for i in range(240):
        rows = [json.dumps(rng.choice(GOOD_ROWS)).encode() for _ in range(rng.randrange(0, 12))]
        at = rng.randrange(len(rows) + 1)
        rows.insert(at, BAD_ROWS[i % len(BAD_ROWS)])
        blanks = rng.randrange(3)  # blank lines before: the line number counts them
        lines = [b""] * blanks + rows
        cases.append((f"row:{i}:{BAD_ROWS[i % len(BAD_ROWS)][:30]!r}", b"\n".join(lines) + b"\n", blanks + at + 1))
    for i, raw in enumerate([b"", b"\n", b"\n\n  \n", b"   "]):
        cases.append((f"empty:{i}", raw, None))
    return cases


PROMPT_CASES = prompt_cases()


def test_fuzzed_prompt_files_fail_in_one_line_naming_the_line(tmp_path):
    failures = []
    for i, (name, raw, line) in enumerate(PROMPT_CASES):
        path = tmp_path / f"prompts-{i}.jsonl"
        path.write_bytes(raw)
        try:
            load_prompt_set(str(path))
            failures.append(f"{name}: accepted")
            continue
        except SpecdrafterError as e:
            message = str(e)
        except Exception as e:  # noqa: BLE001
            failures.append(f"{name}: {type(e).__name__}: {e}")
            continue
        expected = f"{path}:{line}: " if line else f"{path}: the prompt file is empty"
        if "\n" in message or not message.startswith(expected):
            failures.append(f"{name}: {message!r}")
    assert not failures, f"{len(failures)} of {len(PROMPT_CASES)}:\n" + "\n".join(failures[:40])


def test_good_rows_still_load(tmp_path):
    path = tmp_path / "good.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in GOOD_ROWS) + "\r\n")
    records = load_prompt_set(str(path))
    assert [r["turns"] for r in records] == [["Tell me about rivers."], ["Hi there.", "And then?"], ["Name a colour."],
                                             ["Count to three."]]
    assert records[2]["reference"] == ["Blue."] and records[0]["id"] == "a" and records[1]["id"] == "good/2"
