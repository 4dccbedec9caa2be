"""A recipe typed and checked: `typed_recipe` merges a recipe's YAML and its `key=value` overrides onto the schema
(core/recipe.py), names the key of anything that does not merge (an unknown key, with the nearest valid one; a
wrong type; a value that does not parse), then runs every check that needs no drafter kind: no NaN, infinity or
out-of-range integer, each key's own rules (the schema's `Rule`s, in one pass: `_check_rules`), and the rules
across keys of each section (`_check_data`, `_check_train`, `_check_inference`, `_check_eval`). The kind's own
rules follow in jobs/recipe.py:checked_recipe. Also here, since the checks and decoding read the inference section
alike: whether it decodes a tree (`is_tree`) and the recipe as a chain (`as_chain`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from typing import Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from specdrafter.core.io import first_line
from specdrafter.core.recipe import Recipe, RecipeError, Rule


def typed_recipe(tree: DictConfig, overrides: List[str] = ()) -> DictConfig:
    """`tree` merged onto the schema with `key=value` overrides, and every check that needs no drafter kind: the
    schema's, each section's. Jobs build recipes with jobs/recipe.py:checked_recipe, which adds the kind's rules."""
    schema, from_file = _schema(), tree
    dotlist = _parse_overrides(list(overrides))
    try:
        cfg = OmegaConf.merge(schema, from_file, dotlist)
        tree = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # a broken ${...} names its key here
    except OmegaConfBaseException as e:
        raise RecipeError(_explain(e, schema)) from None
    except Exception as e:  # TypeError / ValueError inside OmegaConf (a mapping where a list goes): find the key
        raise RecipeError(f"recipe key {_culprit(from_file, dotlist)!r} has the wrong type ({first_line(e)})") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise RecipeError(f"recipe key {missing[0]!r} is required but has no value (set it in the YAML or as {missing[0]}=...)")
    _check_numbers(tree)
    _check_rules(tree)
    for check in (_check_data, _check_train, _check_inference, _check_eval):
        check(cfg)
    return cfg


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The typed defaults, built once (OmegaConf.merge copies it, never changes it)."""
    return OmegaConf.structured(Recipe)


def _culprit(*configs: DictConfig) -> str:
    """The first key of `configs` that does not merge into the schema on its own (the deepest one that fails)."""
    def fails(key: str, value) -> bool:
        tree = value
        for part in reversed(key.split(".")):
            tree = {part: tree}
        try:
            OmegaConf.merge(_schema(), OmegaConf.create(tree))
            return False
        except Exception:
            return True

    def search(node: dict, prefix: str) -> Optional[str]:
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if fails(key, v):
                return (search(v, key) if isinstance(v, dict) and v else None) or key
        return None

    for c in configs:
        found = search(OmegaConf.to_container(c, resolve=False), "")
        if found:
            return found
    return "?"


def _parse_overrides(overrides: List[str]) -> DictConfig:
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise RecipeError(f"override {bad[0]!r} is not of the form key=value")
    empty = [o for o in overrides if "" in o.partition("=")[0].split(".")]
    if empty:
        raise RecipeError(f"override {empty[0]!r}: the key has an empty part (a.b.c=value)")
    try:
        return OmegaConf.from_dotlist(overrides)
    except Exception:  # name the override whose value does not parse
        for o in overrides:
            try:
                OmegaConf.from_dotlist([o])
            except Exception as e:
                problem = getattr(e, "problem", None) or first_line(e)
                raise RecipeError(f"override {o!r}: the value is not valid YAML ({problem})") from None
        raise


def _check_numbers(tree: dict) -> None:
    """No NaN or infinity anywhere, every integer within int64 (seeds, counts and sizes reach torch), and no list
    inside a list of strings (OmegaConf lets one through)."""
    for key, value in _leaves(tree):
        if isinstance(value, (list, dict)) and key in STRING_LISTS:
            raise RecipeError(f"recipe key {key!r} is a list of strings, got an item {value}")
        if isinstance(value, float) and not math.isfinite(value):
            raise RecipeError(f"recipe key {key!r} must be a finite number, got {value}")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
            raise RecipeError(f"recipe key {key!r}: {value} is out of range (at most 2**63 - 1)")


@functools.lru_cache(maxsize=1)
def _rules() -> Dict[str, Tuple[Rule, ...]]:
    """Every key's rules, from the schema's fields: {"data.seed": (SEED,), ...}."""
    found = {}

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            elif f.metadata.get("rules"):
                found[prefix + f.name] = f.metadata["rules"]
    walk(Recipe, "")
    return found


def _check_rules(tree: dict) -> None:
    """Every single-key rule of the schema, in one pass over the resolved recipe."""
    for key, rules in _rules().items():
        value = _lookup(tree, key)
        if value is None:
            continue
        for rule in rules:
            items = [(key, value)] if rule.whole else _leaves(value, key)
            for name, item in items:
                if item is not None and not rule.ok(item):
                    raise RecipeError(rule.problem(name, item))


def _lookup(tree: dict, key: str):
    """The value at a dotted key of a plain recipe tree."""
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _leaves(node, prefix: str = ""):
    """(dotted key, value) of every scalar of a container; list items keep their parent's key (a list inside a list
    of strings comes out whole)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, list):
        for v in node:
            whole = isinstance(v, (list, dict)) and prefix in STRING_LISTS
            yield from ((prefix, v),) if whole else _leaves(v, prefix)
    else:
        yield prefix, node


STRING_LISTS = ("data.exclude", "data.servers", "drafter.lora.target_modules", "eval.sets")  # List[str] keys


# Keys of other tools' recipes whose values mean something else here: a near-miss hint would mislead.
OTHER_SPELLINGS = {
    "drafter.block.target_layer_ids": "that is DFlash's spelling, layer outputs; here every feature layer is named by "
                                      "its input, as in drafter.eagle.aux_layer_ids: drafter.block.aux_layer_ids = "
                                      "each id + 1"}


def _explain(e: OmegaConfBaseException, schema: DictConfig) -> str:
    key = e.full_key or "?"
    first_line = (e.msg or str(e)).splitlines()[0] if (e.msg or str(e)) else type(e).__name__
    if isinstance(e, ConfigKeyError):
        if key in OTHER_SPELLINGS:
            return f"unknown recipe key {key!r}: {OTHER_SPELLINGS[key]}"
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(schema, parent) if parent else schema
        valid = [f"{parent}.{k}" if parent else k for k in node.keys()] if isinstance(node, DictConfig) else []
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (valid keys here: {', '.join(valid)})"
        return f"unknown recipe key {key!r}{hint}"
    return f"recipe key {key!r}: {first_line}"


def _check_data(cfg: DictConfig) -> None:
    d = cfg.data
    if d.engine.value == "server" and not d.servers:
        raise RecipeError("recipe key 'data.servers' must list at least one server URL with data.engine=server "
                          "(e.g. data.servers=[http://127.0.0.1:8000])")
    if d.engine.value == "llama.cpp" and d.servers:
        raise RecipeError("recipe key 'data.servers' is for data.engine=server; data.engine=llama.cpp starts its own "
                          "llama-server of the target (remove data.servers, or use data.engine=server)")
    if d.engine.value == "llama.cpp" and d.llamacpp.outtype is not None and d.llamacpp.outtype.value == "q8_0":
        raise RecipeError("recipe key 'data.llamacpp.outtype': q8_0 would sample a quantised model, not the target "
                          "(use f32, bf16 or f16, or leave it unset for target.dtype's)")
    if d.responses.value == "mix" and d.target_share is None:
        raise RecipeError("recipe key 'data.target_share' is required with data.responses=mix (the share of "
                          "conversations the target regenerates, in [0, 1])")
    if d.min_prompt_tokens > d.max_prompt_tokens:
        raise RecipeError(f"recipe key 'data.min_prompt_tokens' ({d.min_prompt_tokens}) exceeds data.max_prompt_tokens "
                          f"({d.max_prompt_tokens})")


def is_tree(inference: DictConfig) -> bool:
    """Whether a recipe's inference section decodes a tree (a static inference.tree or a dynamic one): the one place
    this is decided."""
    return bool(inference.tree or inference.dynamic_tree.total_tokens)


def as_chain(cfg: DictConfig) -> DictConfig:
    """A copy of the recipe with its tree removed: what decodes it as a chain."""
    c = cfg.copy()
    c.inference.tree, c.inference.dynamic_tree.total_tokens = [], 0
    return c


def _check_inference(cfg: DictConfig) -> None:
    inf = cfg.inference
    if inf.tree and inf.dynamic_tree.total_tokens:
        raise RecipeError("recipe keys 'inference.tree' and 'inference.dynamic_tree.total_tokens': choose a static or a dynamic "
                          "tree, not both")
    if inf.verifier.value == "asd" and inf.temperature > 0:
        raise RecipeError("recipe key 'inference.verifier': asd is defined for greedy decoding only "
                          "(set inference.temperature=0)")
    if inf.verifier.value == "asd" and is_tree(inf):
        raise RecipeError("recipe key 'inference.verifier': asd verifies chains; set inference.tree=[] and "
                          "inference.dynamic_tree.total_tokens=0")


# train.objective keys, checked here before anything under train/ loads; train/objectives.py:DIVERGENCES implements
# each (tests/test_objectives.py pins the two to the same names).
OBJECTIVES = ("tv", "fkl", "rkl", "jsd", "soft_ce")


def _check_train(cfg: DictConfig) -> None:
    unknown = [name for name in cfg.train.objective if name not in OBJECTIVES]
    if unknown:
        raise RecipeError(f"recipe key 'train.objective.{unknown[0]}': unknown objective (valid: {', '.join(OBJECTIVES)})")


def _check_eval(cfg: DictConfig) -> None:
    inf = cfg.inference
    if "tree" in {v.value for v in cfg.eval.verifiers} and not is_tree(inf):
        raise RecipeError("recipe key 'eval.verifiers': tree needs inference.tree (static) or "
                          "inference.dynamic_tree.total_tokens")

