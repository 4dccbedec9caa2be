"""The table of drafter kinds (kinds/): the schema and the table agree, every stage asks the kind, and no module
outside kinds/ decides anything by a kind's name."""

import ast
import dataclasses
import importlib
import types
from collections.abc import Mapping
from pathlib import Path

import pytest

import specdrafter.core.recipe as schema
from specdrafter.core.recipe import RecipeError
from specdrafter.export.formats import FORMATS, WRITERS
from specdrafter.jobs.recipe import load_recipe
from specdrafter.kinds import KINDS, kind_of_config
from specdrafter.kinds.base import Kind
from specdrafter.recipes import RECIPES_DIR

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "data", "eval", "export", "engines", "inference", "jobs", "models", "train", "launch", "benchmarks")
NAMES = set(KINDS)
EXPORTS = {  # --format → the kinds it exports
    "vllm": ["peagle", "eagle3", "dflash", "dspark", "dflash2", "domino"],
    "sglang": ["eagle3", "dflash", "dspark", "dflash2", "domino"],
    "speculators": ["eagle3", "dflash", "dspark"],
    "gguf": ["eagle3", "dflash", "dspark", "dflash2", "draft_model"],
    "medusa-vllm": ["medusa"],
    "medusa": ["medusa"],
    "hf-draft": ["draft_model"],
}


def test_the_table_is_the_one_registration_of_a_kind():
    """KINDS registers a kind; the schema names none (no enum of kind names to keep in step): drafter.kind is checked
    against the table where a recipe is loaded, one line listing the table's names."""
    assert all(kind.name == name for name, kind in KINDS.items())
    assert schema.DrafterConfig().kind in KINDS
    enums = [e for e in vars(schema).values() if isinstance(e, type) and issubclass(e, schema.Enum) and e is not schema.Enum]
    assert enums and not [e.__name__ for e in enums if len({m.value for m in e} & NAMES) >= 2]
    with pytest.raises(RecipeError, match=r"recipe key 'drafter.kind': Invalid value 'eagle9', expected one of "
                                          rf"\[{', '.join(KINDS)}\]"):
        load_recipe(RECIPES_DIR / "smollm2-135m-eagle3.yaml", ["drafter.kind=eagle9"])


def test_a_kind_holds_its_names_and_one_record_per_concern():
    """name, description, title and how its folder is recognised on the kind; everything a job asks in the record of
    the job's concern (kinds/base.py)."""
    assert [f.name for f in dataclasses.fields(Kind)] == ["name", "description", "title", "recognises", "decoding",
                                                         "export", "training", "planning", "conformance"]
    for kind in KINDS.values():  # the planner plans what trains; the conformance run exports what a recipe trains
        assert (kind.planning is None) == (kind.training is None), kind.name
        assert kind.conformance is None or (kind.training and kind.training.recipe and kind.export.formats), kind.name


def test_every_trainable_kind_has_its_launcher_and_recipe():
    for kind in KINDS.values():
        if kind.training:
            assert (REPO / "launch" / kind.training.launcher).is_file(), kind.name
            if kind.training.recipe:
                assert (REPO / "recipes" / kind.training.recipe).is_file(), kind.name


def test_every_format_has_a_writer_for_each_of_its_kinds():
    """One --format may serve several kinds (`vllm`: EAGLE-3, DFlash, DSpark); each kind's writer writes it. gguf is
    the folder of the format the kind's llama.cpp spec converts, which its writer writes."""
    assert set(FORMATS) == {f for w in WRITERS.values() for f in w.formats} | {"gguf"}
    # written out, not derived from KINDS as FORMATS is: a kind that lost a format, or a FORMATS built another way,
    # shows here as a difference (the order is the table's: the kinds in KINDS order)
    assert {fmt: [k.name for k in kinds] for fmt, kinds in FORMATS.items()} == EXPORTS
    assert list(FORMATS) == list(EXPORTS)  # --format's choices, in the order the kinds first name them
    for fmt, kinds in FORMATS.items():
        assert all((k.export.llamacpp.converts if fmt == "gguf" else fmt) in WRITERS[k.export.family].formats
                   for k in kinds), fmt
    for name, kind in KINDS.items():  # and from the kind's side: each of its formats lists it, none other does
        assert {fmt for fmt, names in EXPORTS.items() if name in names} == set(kind.export.formats), name
    assert not KINDS["eagle1"].export.formats and not KINDS["self_draft"].export.formats  # no engine serves these as they are


@pytest.mark.parametrize("config, name", [
    ({"architectures": ["LlamaForCausalLMEagle3"]}, "eagle3"),
    ({"architectures": ["Eagle3Speculator"]}, "eagle3"),
    ({"model_type": "medusa"}, "medusa"),
    ({"architectures": ["MedusaModel"]}, "medusa"),
    ({"architectures": ["LlamaForCausalLM"]}, "draft_model"),
    ({"architectures": ["DFlashDraftModel"], "variant": "dflash"}, "dflash"),
    ({"architectures": ["Qwen3DSparkModel"], "variant": "dspark"}, "dspark"),
    ({"architectures": ["DSparkDraftModel"], "variant": "dspark"}, "dspark"),  # the name our folders had before
    ({"architectures": ["DSparkDraftModel"], "variant": "dflash"}, None),  # the variant names another architecture
    ({"architectures": ["DFlash2DraftModel"], "variant": "dflash2"}, "dflash2"),
    ({"architectures": ["DFlash2DraftModel"], "dflash_config": {"target_layer_ids": [1]}}, "dflash2"),  # vLLM's layout
    ({"architectures": ["DFlashDraftModel"], "variant": "domino"}, "domino"),
    ({"architectures": ["DFlashDraftModel"], "dflash_config": {"target_layer_ids": [1], "projector_type": "domino"}},
     "domino"),  # vLLM's layout: a DFlash folder with Domino's projector
    ({"architectures": ["DominoDraftModel"], "dflash_config": {"target_layer_ids": [1], "projector_type": "domino"}},
     "domino"),  # SpecForge's class name
    ({"architectures": ["BertModel"]}, None),
    ({"architectures": ["Qwen3NextForCausalLM"], "mtp_layout": "qwen3_next"}, "mtp"),  # before any causal LM
    ({"architectures": ["LlamaForCausalLMEagle3"], "parallel_drafting": True}, "peagle"),  # before EAGLE-3
])
def test_a_folder_config_names_its_kind(config, name):
    found = kind_of_config(config)
    assert (found.name if found else None) == name


def _names_in(node) -> set:
    """Kind names among the string constants of `node` (a constant, or a tuple / list / set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names_in(e) for e in node.elts)) if node.elts else set()
    return set()


def kind_branches(source: str) -> list:
    """(line, what) of every comparison with a kind's name and every table keyed by two or more kinds' names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            names = set().union(*(_names_in(x) for x in operands))
            # a kind's name compared with something that holds a kind (a format or model_type may share the name)
            if names and any("kind" in ast.unparse(x) or "drafter" in ast.unparse(x) for x in operands):
                found.append((node.lineno, f"compares with {sorted(names)}"))
        elif isinstance(node, ast.Dict):
            names = set().union(*(_names_in(k) for k in node.keys if k is not None)) if node.keys else set()
            if len(names) >= 2:
                found.append((node.lineno, f"a table keyed by {sorted(names)}"))
        elif isinstance(node, ast.match_case) and _names_in(getattr(node.pattern, "value", None)):
            found.append((node.pattern.lineno, "matches a kind's name"))
    return found


def test_the_scan_finds_a_branch():
    assert kind_branches('if kind == "eagle3":\n    pass\n') == [(1, "compares with ['eagle3']")]
    assert kind_branches('ok = cfg.drafter.kind.value in ("medusa", "x")\n')
    assert kind_branches('if c.state.get("drafter") == "eagle1": pass\n')
    assert kind_branches('TAGS = {"eagle3": 1, "draft_model": 2}\n')
    assert not kind_branches('fmt = {"vllm": 1, "medusa": 2}\nif fmt == "vllm": pass\n')  # a format, not a kind


def test_no_module_outside_the_kinds_table_branches_on_a_kind_name():
    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            offenders += [f"{path.relative_to(REPO)}:{line}: {what}" for line, what in kind_branches(path.read_text())]
    assert not offenders, "decide these through kinds/ (the kind's attributes and methods):\n" + "\n".join(offenders)


# Tables the scan allows, each keyed by what a saved file says rather than by a recipe's kind.
ALLOWED_TABLES = {"specdrafter.models.block.VARIANTS": "config.json's `variant`, read where a folder is loaded",
                  "specdrafter.models.block_folders.VARIANTS": "the same table, imported where folders are read"}


def tables_of_kind_names(module: types.ModuleType) -> list:
    """The module-level mappings of `module`, however built (a literal, a comprehension, dict(zip(...)), an update
    after the fact), whose keys or values hold two or more kinds' names."""
    found = []
    for name, value in vars(module).items():
        if isinstance(value, Mapping) and value is not KINDS:  # the table itself, imported
            keys = {k for k in value if isinstance(k, str)} & NAMES
            values = {v for v in value.values() if isinstance(v, str)} & NAMES
            if len(keys) >= 2 or len(values) >= 2:
                found.append(f"{module.__name__}.{name}: {'keyed' if len(keys) >= 2 else 'valued'} by "
                             f"{sorted(keys if len(keys) >= 2 else values)}")
    return found


def test_the_table_scan_finds_tables_built_any_way():
    planted = types.ModuleType("planted")
    exec("ENGINE = dict(zip(['eagle3', 'medusa'], [1, 2]))\n"
         "ARCH = {a: k for a, k in [('DFlashDraftModel', 'dflash'), ('Qwen3DSparkModel', 'dspark')]}\n"
         "FORMATS = {'vllm': 1, 'medusa': 2}\n", vars(planted))  # a format may share a kind's name
    assert tables_of_kind_names(planted) == ["planted.ENGINE: keyed by ['eagle3', 'medusa']",
                                             "planted.ARCH: valued by ['dflash', 'dspark']"]


def test_no_module_outside_the_kinds_table_holds_a_table_of_kind_names():
    offenders, scanned = [], 0
    for package in ("core", "data", "eval", "export", "engines", "inference", "jobs", "models", "train"):  # kinds/: the table
        for path in sorted((REPO / package).rglob("*.py")):
            name = "specdrafter." + ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            offenders += [t for t in tables_of_kind_names(importlib.import_module(name))
                          if t.split(":")[0] not in ALLOWED_TABLES]
            scanned += 1
    assert scanned > 40
    assert not offenders, "decide these through kinds/ (the kind's attributes and methods):\n" + "\n".join(offenders)


# ------------------------------------------------------------------------- llama.cpp's names for the kinds
ENGINE_RECORDS = [k.export.llamacpp for k in KINDS.values() if k.export.llamacpp]
SPEC_TYPES = {r.spec_type for r in ENGINE_RECORDS}  # llama-server's --spec-type of each kind it serves
GGUF_ARCHS = {r.gguf_arch for r in ENGINE_RECORDS if r.gguf_arch}  # general.architecture of their GGUFs


def llamacpp_branches(source: str) -> list:
    """(line, what) of every comparison with a llama.cpp --spec-type, every comparison of something named `arch` with
    a drafter GGUF's architecture, and every table keyed by either: decisions that belong to the kind's LlamaCpp
    record."""
    def strings(node) -> set:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(strings(e) for e in node.elts)) if node.elts else set()
        return set()

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            held = set().union(*(strings(x) for x in operands))
            if held & SPEC_TYPES:
                found.append((node.lineno, f"compares with {sorted(held & SPEC_TYPES)}"))
            elif held & GGUF_ARCHS and any("arch" in ast.unparse(x) for x in operands):
                found.append((node.lineno, f"compares an architecture with {sorted(held & GGUF_ARCHS)}"))
        elif isinstance(node, ast.Dict) and node.keys:
            held = set().union(*(strings(k) for k in node.keys if k is not None))
            if held & (SPEC_TYPES | GGUF_ARCHS):
                found.append((node.lineno, f"a table keyed by {sorted(held & (SPEC_TYPES | GGUF_ARCHS))}"))
    return found


def test_the_llamacpp_scan_finds_a_branch():
    assert llamacpp_branches('if spec == "draft-eagle3":\n    pass\n') == [(1, "compares with ['draft-eagle3']")]
    assert llamacpp_branches('ok = spec in ("draft-dflash", "draft-dspark")\n')
    assert llamacpp_branches('if facts["arch"] == "dflash": pass\n')
    assert llamacpp_branches('SPEC = {"eagle3": "draft-eagle3"}\n')
    assert not llamacpp_branches('if fmt == "vllm": pass\nargs = ["--spec-type", spec]\n')


def test_no_module_outside_the_kinds_table_branches_on_a_llamacpp_name():
    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            offenders += [f"{path.relative_to(REPO)}:{line}: {what}" for line, what in llamacpp_branches(path.read_text())]
    assert not offenders, "ask the kind's export.llamacpp record instead:\n" + "\n".join(offenders)
