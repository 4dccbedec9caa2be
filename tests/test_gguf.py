"""--format gguf through llama.cpp's own converter (export/gguf.py): every kind llama.cpp serves converts, the GGUF
reads the layers the drafter was trained on and keeps a pruned vocabulary, the kinds it does not serve are refused in
one line; and llama-server decodes with the converted drafter exactly as the target alone at T = 0. Needs the llama.cpp
build (`specdrafter-llamacpp install`); skipped without it, except the refusals."""

import shutil
import subprocess
from pathlib import Path

import pytest

from specdrafter.core import llamacpp
from specdrafter.core.io import SpecdrafterError
from specdrafter.export.formats import export
from specdrafter.export.gguf import DRAFT_FILE, read_gguf
from specdrafter.inference.llama_server import LlamaServer

REPO = Path(__file__).resolve().parents[1]
BUILT = llamacpp.installed()
needs_llamacpp = pytest.mark.skipif(not BUILT, reason="llama.cpp is not built (specdrafter-llamacpp install)")
@needs_llamacpp
@pytest.mark.parametrize("kind, extra, arch, layers", [
    ("eagle3", ["drafter.eagle.draft_vocab_size=0"], "eagle3", [1, 3, 5]),
    ("dflash", ["drafter.block.draft_vocab_size=0"], "dflash", [1, 3, 5]),
    ("dspark", [], "dflash", [1, 3, 5]),  # llama.cpp's DSpark is DFlash's architecture plus the Markov head
    ("draft_model", [], "llama", None),
])
def test_each_kind_llamacpp_serves_converts_reading_the_trained_layers(tmp_path, drafter_run_of, kind, extra, arch, layers):
    out = export(drafter_run_of(kind, *extra), "gguf", tmp_path / kind)
    found = read_gguf(out / DRAFT_FILE)
    assert found["arch"] == arch and found["target_layers"] == layers
    card = (out / "README.md").read_text()
    assert "library_name: gguf" in card and f"-md {DRAFT_FILE}" in card
    assert sorted(p.name for p in out.iterdir() if p.suffix == ".gguf") == [DRAFT_FILE]


@needs_llamacpp
def test_a_draft_model_exports_at_q8_0_as_users_serve_draft_models(tmp_path, drafter_run_of):
    """--gguf-type q8_0: the converter quantises the matrices (a quarter of f32's bytes, 8.5 bits a weight);
    another format with a weight type is one line."""
    run = drafter_run_of("draft_model")
    f32, q8 = export(run, "gguf", tmp_path / "f32"), export(run, "gguf", tmp_path / "q8", gguf_type="q8_0")
    assert read_gguf(q8 / DRAFT_FILE)["arch"] == "llama"
    assert (q8 / DRAFT_FILE).stat().st_size < 0.45 * (f32 / DRAFT_FILE).stat().st_size
    with pytest.raises(SpecdrafterError, match=r"^--gguf-type q8_0: a weight type of --format gguf \(f32, bf16"):
        export(run, "vllm", tmp_path / "vllm", gguf_type="q8_0")
    q4 = export(run, "gguf", tmp_path / "q4", gguf_type="q4_0")  # llama-quantize on the converter's f32 file
    assert read_gguf(q4 / DRAFT_FILE)["arch"] == "llama" and sorted(p.name for p in q4.iterdir()) == sorted(
        p.name for p in q8.iterdir())  # no f32 file left beside it
    assert (q4 / DRAFT_FILE).stat().st_size < (q8 / DRAFT_FILE).stat().st_size  # the vocabulary's text is most of a tiny one


@needs_llamacpp
def test_a_file_llama_quantize_cannot_read_is_one_line_and_leaves_nothing(tmp_path):
    bad = tmp_path / "draft.gguf.f32"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(SpecdrafterError, match=r"^llama-quantize failed to make q4_k_m of draft.gguf.f32 \(.*; its log: ") as e:
        llamacpp.quantize(bad, tmp_path / "draft.gguf", "q4_k_m")
    assert "\n" not in str(e.value) and sorted(p.name for p in tmp_path.iterdir()) == ["draft.gguf.f32"]


@needs_llamacpp
def test_a_pruned_eagle3_vocabulary_survives_conversion(tmp_path, drafter_run_of):
    out = export(drafter_run_of("eagle3", "drafter.eagle.draft_vocab_size=1024"), "gguf", tmp_path / "pruned")
    d2t = {name: shape for name, shape in read_gguf(out / DRAFT_FILE)["tensors"].items() if name.endswith("d2t")}
    assert list(d2t.values()) == [[1024]]


@needs_llamacpp
def test_a_pruned_dflash_vocabulary_llamacpp_cannot_convert_is_one_line(tmp_path, drafter_run_of):
    with pytest.raises(SpecdrafterError, match="keeps no pruned draft vocabulary for a DFlash") as e:
        export(drafter_run_of("dflash", "drafter.block.draft_vocab_size=1024"), "gguf", tmp_path / "dflash")
    assert "\n" not in str(e.value) and not (tmp_path / "dflash").exists()


@pytest.mark.parametrize("kind, extra", [("medusa", []), ("eagle1", [])])
def test_a_kind_llamacpp_does_not_serve_is_one_line(tmp_path, drafter_run_of, kind, extra):
    with pytest.raises(SpecdrafterError, match="llama.cpp serves no drafter like") as e:
        export(drafter_run_of(kind, *extra), "gguf", tmp_path / kind)
    assert "\n" not in str(e.value) and not (tmp_path / kind).exists()


# ----------------------------------------------------------------------------------------------- serving
def greedy_completion(model: Path, prompt: list, n: int, **drafter) -> dict:
    """llama-server serving `model` (with the drafter's keyword arguments), one greedy /completion of `prompt`."""
    with LlamaServer(model, context=512, **drafter) as server:
        return server.complete(prompt, n)


@needs_llamacpp
@pytest.mark.parametrize("kind, override, spec_type", [
    ("eagle3", "drafter.eagle.draft_vocab_size=0", "draft-eagle3"),
    ("dflash", "drafter.block.draft_vocab_size=0", "draft-dflash"),
    ("dspark", "drafter.eagle.draft_vocab_size=0", "draft-dspark"),
    ("draft_model", "drafter.num_layers=1", "draft-simple"),
])
def test_llama_server_with_the_drafter_decodes_as_the_target_alone(tmp_path, drafter_run_of, gguf_target_dir, kind,
                                                                   override, spec_type):
    """Greedy, 24 tokens: the drafter may only change the speed. A random drafter is rejected often, so the rollback
    runs."""
    target_gguf = tmp_path / "target.gguf"
    llamacpp.convert(gguf_target_dir, target_gguf)
    out = export(drafter_run_of(kind, override), "gguf", tmp_path / kind)
    prompt = list(range(100, 120))
    alone = greedy_completion(target_gguf, prompt, 24)
    drafted = greedy_completion(target_gguf, prompt, 24, draft=out / DRAFT_FILE, spec_type=spec_type, n_max=3)
    assert len(alone["tokens"]) == 24 and drafted["tokens"] == alone["tokens"]
    assert drafted["timings"]["draft_n"] > 0  # the drafter drafted
    shutil.rmtree(out)


@needs_llamacpp
def test_the_command_converts_a_target_and_refuses_a_folder_without_config(tmp_path, gguf_target_dir):
    done = subprocess.run(["specdrafter-llamacpp", "convert", str(gguf_target_dir), "--out", str(tmp_path / "t.gguf")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert read_gguf(tmp_path / "t.gguf")["arch"] == "llama"
    done = subprocess.run(["specdrafter-llamacpp", "convert", str(tmp_path), "--out", str(tmp_path / "x.gguf")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"error: {str(tmp_path)!r} is not a model folder (no config.json)"]
