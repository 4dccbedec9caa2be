"""Conformance run (issue 15): do the engines' own loaders read our exports unchanged? Not part of the test suite.

    python benchmarks/conformance.py [--out runs/conformance] [--reinstall]
    python launch/conformance.py [--out runs/conformance] [--reinstall]   (the same)

1. Creates (or reuses) a virtual environment at `cache_dir()/conformance-venv` (system site packages visible, so it
   reuses this machine's CPU torch / transformers) and pip-installs the engines' wheels without their GPU
   dependencies: vLLM 0.33.0 (`--no-deps` + the few pure-Python packages its model code imports), vLLM 0.32.0 and
   SGLang 0.5.x into side folders of the venv (`--target`, put on PYTHONPATH per check), speculators (`--no-deps`).
2. In this environment builds tiny drafters with specdrafter's own code (a 4-layer random Llama, hidden 32, with
   SmolLM2's tokenizer, as tests/test_export.py does): every kind's `conformance_variants` — EAGLE-3 with a pruned
   draft vocabulary and with the full one, Medusa heads (5 heads, 1 ResBlock each), an HF draft model, DFlash and
   DSpark (2 layers, blocks of 4, target layer outputs [0, 1, 2]) with the full and a pruned vocabulary; exports each
   in every format of its kind, and saves reference inputs and our logits. An export the format cannot express is
   a `refused` row with the exporter's one line.
3. Runs this file with `--worker` in the venv: each export is loaded by the engine's own code on CPU and compared
   with our tensors bit for bit; where the engine's module runs on CPU, one draft step (logits) is compared with
   ours (allclose). Rows that cannot run say why. Which checks an export gets depends on its format and on the
   writer family of its kind (work/families.json, from kinds/: writer), never on a kind's name.

Writes OUT/conformance.md (the table) and OUT/conformance.json (rows + installed versions + install times).
"""

import argparse
import ast
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional

VLLM_NEW, VLLM_OLD, SGLANG, SPECULATORS = "vllm==0.33.0", "vllm==0.32.0", "sglang>=0.5,<0.6", "speculators"
VLLM_DEPS = ["pyzmq", "msgspec", "cachetools", "cbor2", "pybase64", "blake3", "prometheus_client", "aiohttp", "multidict",
             "yarl", "propcache", "frozenlist", "aiosignal", "aiohappyeyeballs", "openai_harmony", "uvloop",
             "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11", "partial_json_parser", "llguidance"]  # what its model code imports
SPECULATORS_DEPS = ["loguru", "pydantic-settings", "hs-connectors"]  # speculators 0.9 imports hs_connectors


# ================================================================================= this environment: the driver
def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def pip(venv: Path, *args: str) -> float:
    t = time.time()
    subprocess.run([str(venv_python(venv)), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                   check=True)
    return round(time.time() - t, 1)


def setup_venv(venv: Path, skip: bool) -> dict:
    """The engines' wheels without their CUDA stacks. Reused when the marker of a finished install is there."""
    marker = venv / "conformance-installed.json"
    if marker.is_file() and skip is not False:
        return json.loads(marker.read_text())
    times = {}
    if not venv_python(venv).is_file():
        t = time.time()
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
        times["venv"] = round(time.time() - t, 1)
    times[VLLM_NEW] = pip(venv, "--no-deps", VLLM_NEW, *VLLM_DEPS)
    times[SPECULATORS] = pip(venv, "--no-deps", SPECULATORS, *SPECULATORS_DEPS)
    for name, spec in (("vllm-0.32", VLLM_OLD), ("sglang", SGLANG)):
        times[spec] = pip(venv, "--no-deps", "--upgrade", "--target", str(venv / name), spec)
    info = {"install_seconds": times, "versions": engine_versions(venv), "size": du(venv)}
    marker.write_text(json.dumps(info, indent=1))
    return info


def engine_versions(venv: Path) -> dict:
    code = ("import importlib.metadata as m, json, sys, glob, os; v = {}\n"
            "for n in ('vllm', 'speculators', 'torch', 'transformers'): v[n] = m.version(n)\n"
            "for d, n in (('vllm-0.32', 'vllm'), ('sglang', 'sglang')):\n"
            "    v[n + ' (' + d + ')'] = [m.PathDistribution.at(p).version for p in glob.glob(os.path.join(sys.argv[1], d, "
            "n + '-*.dist-info'))]\n"
            "print(json.dumps(v))")
    out = subprocess.run([str(venv_python(venv)), "-c", code, str(venv)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def du(path: Path) -> str:
    return subprocess.run(["du", "-sh", str(path)], capture_output=True, text=True).stdout.split("\t")[0]


def build_and_export(work: Path) -> dict:
    """Tiny drafters built and saved with specdrafter's own code, exported in every format, plus reference inputs
    and our logits for one draft step (work/reference.pt)."""
    import shutil

    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specdrafter.core.io import SpecdrafterError
    from specdrafter.data.assets import ensure_smollm2
    from specdrafter.export.formats import export
    from specdrafter.jobs.recipe import load_recipe
    from specdrafter.kinds import KINDS, build_drafter
    from specdrafter.kinds.block import BlockExport
    from specdrafter.recipes import RECIPES_DIR

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
    torch.manual_seed(0)
    target_dir = work / "tiny-target"
    target = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                          tie_word_embeddings=False)).eval().requires_grad_(False)
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    ids = torch.tensor([[1, 9690, 198, 504, 3287, 314, 253, 2114]])
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states  # hs[k] = the input to layer k (our aux-id reading)
    refs, exports, families = {}, {}, {}
    # every kind's conformance variants (kinds/: conformance.variants), e.g. eagle3-pruned / eagle3-full
    drafters = {name: (k, overrides) for k in KINDS.values() if k.conformance
                for name, overrides in k.conformance.variants.items()}
    for name, (kind, overrides) in drafters.items():
        run = work / "runs" / name
        cfg = load_recipe(RECIPES_DIR / kind.training.recipe,
                          [f"output_dir={run}", f"target.model={target_dir}", f"train.data_dir={run / 'data'}",
                           f"drafter.kind={kind.name}", "drafter.eagle.aux_layer_ids=[1,2,3]", "inference.k=3",
                           "train.wandb.mode=disabled", *overrides])
        drafter = build_drafter(cfg, target, None, tokenizer)
        module = drafter.module.eval()
        torch.manual_seed(1)
        with torch.no_grad():  # weights moved off their initial values; a draft vocabulary that is not the first Vd ids
            for q in module.parameters():
                if q.requires_grad:
                    q.add_(0.05 * torch.randn_like(q))
            kind.conformance.perturb(module, name, target.config.vocab_size)
        folder = run / "checkpoints" / "step-000004"
        drafter.save(module, folder / "drafter", tokenizer)
        (folder / "recipe.yaml").write_text(OmegaConf.to_yaml(cfg))
        (folder / "trainer_state.json").write_text(json.dumps({"step": 4, "tokens": 1000, "drafter": kind.name}))
        with torch.no_grad():
            refs[name] = kind.conformance.reference_step(module, target, hs, ids)
        for fmt in kind.export.formats:
            families[f"{fmt}/{name}"] = {"family": kind.export.family.value,  # JSON for the venv
                                           "method": kind.export.engines.method if isinstance(kind.export, BlockExport) else None}
            try:
                exports[f"{fmt}/{name}"] = str(export(folder, fmt, work / "exports" / name / fmt))
            except SpecdrafterError as e:
                exports[f"{fmt}/{name}"] = {"error": str(e)}
    torch.save(refs, work / "reference.pt")
    (work / "families.json").write_text(json.dumps(families, indent=1))
    return {"target": str(target_dir), "exports": exports}


def markdown(rows: list, info: dict) -> str:
    v = info.get("versions", {})
    head = (f"Engines: vLLM {v.get('vllm')} (venv), vLLM {', '.join(v.get('vllm (vllm-0.32)') or ['–'])} (side folder), "
            f"SGLang {', '.join(v.get('sglang (sglang)') or ['–'])}, speculators {v.get('speculators')}; "
            f"torch {v.get('torch')}, transformers {v.get('transformers')} (CPU). ")
    lines = [head, "", "| format | drafter | check | result | detail |", "|---|---|---|---|---|"]
    for r in rows:
        detail = str(r.get("detail", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['format']} | {r['drafter']} | {r['check']} | {r['result']} | {detail[:300]} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> None:
    from specdrafter.data.assets import cache_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/conformance")
    p.add_argument("--reinstall", action="store_true", help="pip-install again into the existing venv")
    a = p.parse_args(argv)
    # absolute: a check may chdir (speculators resolves a local verifier by its folder name from beside it)
    out, venv = Path(a.out).resolve(), cache_dir() / "conformance-venv"
    out.mkdir(parents=True, exist_ok=True)
    t = time.time()
    info = setup_venv(venv, False if a.reinstall else None)
    print(f"venv {venv} ready ({time.time() - t:.0f} s): {json.dumps(info['versions'])}", flush=True)
    work = out / "work"
    built = build_and_export(work)
    print(f"exported: {json.dumps(built['exports'], indent=1)}", flush=True)
    # the exporter's one-line refusal of what a format cannot express (SGLang and a pruned vocabulary)
    rows = [{"format": k.split("/")[0], "drafter": k.split("/")[1], "check": "export",
             "result": "refused" if "cannot express" in e["error"] else "fail", "detail": e["error"]}
            for k, e in built["exports"].items() if isinstance(e, dict)]
    res = work / "rows.json"
    proc = subprocess.run([str(venv_python(venv)), str(Path(__file__).resolve()), "--worker", str(work), str(venv),
                           str(res)], env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
                                           "PYTHONNOUSERSITE": "1"})
    rows += json.loads(res.read_text()) if res.is_file() else [
        {"format": "*", "drafter": "*", "check": "worker", "result": "fail", "detail": f"worker exited {proc.returncode}"}]
    table = markdown(rows, info)
    as_given = a.out.rstrip("/")  # the folder as the command named it: no machine's absolute path in the results
    (out / "conformance.md").write_text(("# Conformance with the engines\n\n" + table).replace(str(out), as_given))
    (out / "conformance.json").write_text(json.dumps({"rows": rows, **info, "exports": built["exports"]},
                                                     indent=1).replace(str(out), as_given))
    print(table)
    print(f"wrote {out / 'conformance.md'} and conformance.json")


# ======================================================================== the venv: the engines' own loaders
def worker(work: Path, venv: Path, res: Path) -> None:
    """Every check in its own subprocess (vLLM 0.32, SGLang and vLLM 0.33 cannot share one interpreter)."""
    exports = {f"{fmt.name}/{d.name}": fmt for d in sorted((work / "exports").iterdir()) for fmt in sorted(d.iterdir())}
    families = json.loads((work / "families.json").read_text())
    plan = []
    for key in exports:
        fmt, name = key.split("/")
        if families[key]["family"] == "block":  # DFlash, DSpark: export/block.py's folders
            plan += [(check, side, key) for check, side in BLOCK_CHECKS[fmt]]
            continue
        if fmt in ("vllm", "speculators"):
            plan += [("vllm", None, key), ("vllm", "vllm-0.32", key)]
        if fmt == "speculators":
            plan += [("speculators", None, key)]
        if fmt == "sglang":
            plan += [("sglang", "sglang", key)]
        if fmt == "medusa-vllm":
            plan += [("vllm-medusa", None, key), ("vllm-medusa", "vllm-0.32", key)]
        if fmt == "medusa":
            plan += [("none", None, key)]
        if fmt == "hf-draft":
            plan += [("vllm-llama", None, key), ("vllm-llama", "vllm-0.32", key)]
    rows = []
    for check, side, key in plan:
        env = {**os.environ, "PYTHONPATH": str(venv / side) if side else ""}
        one = res.with_suffix(".one.json")
        one.unlink(missing_ok=True)
        p = subprocess.run([sys.executable, __file__, "--check", check, str(work), key, str(one)], env=env,
                           capture_output=True, text=True, timeout=900)
        fmt, name = key.split("/")
        if one.is_file():
            rows += json.loads(one.read_text())
        else:
            tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"format": fmt, "drafter": name, "check": check, "result": "fail", "detail": f"crashed: {tail}"})
        print(json.dumps(rows[-1]), flush=True)
    res.write_text(json.dumps(rows, indent=1))


BLOCK_CHECKS = {  # block drafters' --format → (check, side folder of the venv) runs
    "vllm": [("vllm-block", None), ("vllm-block", "vllm-0.32")],
    "speculators": [("vllm-block", None), ("vllm-block", "vllm-0.32"), ("speculators-block", None)],
    "sglang": [("sglang-block", "sglang")],
}


def run_check(check: str, work: Path, key: str, one: Path) -> None:
    import torch

    fmt, name = key.split("/")
    folder = work / "exports" / name / fmt
    ref = torch.load(work / "reference.pt")[name]
    rows = []

    def row(what, result, detail=""):
        rows.append({"format": fmt, "drafter": name, "check": what, "result": result, "detail": detail})

    try:
        if check == "none":
            row("engine load", "not-run", "no engine reads this layout here: the Medusa repo's loader needs "
                "medusa_lm_head.pt (the card's one-line conversion) and the repo is not on PyPI; TGI is not installable")
        elif check == "vllm-block":
            import vllm
            vllm_block(folder, fmt, ref, f"vLLM {vllm.__version__}", row, json.loads((work / "families.json").read_text())[key])
        elif check.startswith("vllm"):
            import vllm
            tag = f"vLLM {vllm.__version__}"
            {"vllm": vllm_eagle3, "vllm-medusa": vllm_medusa, "vllm-llama": vllm_llama}[check](folder, fmt, ref, tag, row)
        elif check == "speculators":
            speculators_checks(folder, work, name, ref, row)
        elif check == "speculators-block":
            speculators_block(folder, work, name, ref, row)
        elif check == "sglang":
            sglang_mapping(folder, ref, row)
        elif check == "sglang-block":
            sglang_block(folder, ref, row)
    except Exception as e:  # one line per failure; the table shows it
        import traceback
        tb = traceback.extract_tb(e.__traceback__)[-1]
        row(f"{check}", "fail", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
            f"({Path(tb.filename).name}:{tb.lineno})")
    one.write_text(json.dumps(rows))


def vllm_stub_config(hf, target_layers: int, target_vocab: int):
    """The few config objects vLLM's module constructors read, on CPU (VLLM_TARGET_DEVICE=cpu): a real VllmConfig
    with the draft model's and speculative config's attributes stood in; anything else they ask is None."""
    from types import SimpleNamespace

    import torch
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig

    class Stub(SimpleNamespace):
        def __getattr__(self, k):
            if k.startswith("__"):
                raise AttributeError(k)
            return None

    mc = Stub(hf_config=hf, hf_text_config=hf, dtype=torch.float32, quantization=None, is_mm_prefix_lm=False,
              get_total_num_hidden_layers=lambda: target_layers, get_vocab_size=lambda: target_vocab)
    vc = VllmConfig(device_config=DeviceConfig(device="cpu"))
    object.__setattr__(vc, "speculative_config", Stub(draft_model_config=mc, parallel_drafting=False,
                                                      draft_load_config=LoadConfig(), enable_adaptive_verification=False))
    object.__setattr__(vc, "model_config", mc)
    return vc


_DIST = []


def vllm_build(cls, vc):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(vc):
        if not _DIST:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}")
            initialize_model_parallel(1, 1)
            _DIST.append(1)
        return cls(vllm_config=vc)


def vllm_cpu_ready(model, vc) -> str:
    """What vLLM's loader does after load_weights (quant_method.process_weights_after_loading: on CPU it picks the
    GEMM kernel); where its compiled CPU ops are missing (vllm._C is not built for this torch), plain F.linear."""
    import torch
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    try:
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
        return "vLLM's CPU GEMM dispatch"
    except Exception as e:
        for m in model.modules():
            if hasattr(m, "quant_method") and hasattr(m, "weight") and not hasattr(m, "cpu_linear"):
                m.cpu_linear = torch.nn.functional.linear
        return f"F.linear for the GEMM (vLLM's CPU GEMM dispatch failed: {type(e).__name__})"


def compare(row, tag, params: dict, expected: dict, skip=()):
    """Bit-exact: each of our tensors at its place in the engine's parameters (a slice of a fused one), and no
    engine parameter left unloaded (except `skip`: what the engine takes from the target)."""
    import torch

    bad, covered = [], {}
    for ours, (pname, rows_slice, t) in expected.items():
        p = params.get(pname)
        got = None if p is None else p.data[rows_slice]
        if got is None or got.shape != t.shape or not torch.equal(got.to(t.dtype), t):
            bad.append(ours)
        covered.setdefault(pname, 0)
        covered[pname] += t.shape[0] if t.dim() else 1
    unloaded = [n for n in params if n not in covered and not any(s in n for s in skip)]
    if bad or unloaded:
        row(f"{tag}: weights", "fail", f"differ: {bad[:4]}; engine parameters not loaded: {unloaded[:4]}")
    else:
        row(f"{tag}: weights", "pass", f"{len(expected)} tensors bit-exact in {len(covered)} engine parameters")


def eagle3_expected(weights: dict, prefix: str, lm_prefix: str = ""):
    """Our tensor → (vLLM / SGLang parameter, row slice): q/k/v stacked into qkv_proj, gate/up into gate_up_proj."""
    out = {}
    for n, t in weights.items():
        if n in ("t2d",):
            continue
        if n == "d2t":
            out[n] = ("draft_id_to_target_id", slice(0, t.shape[0]), t)
            continue
        m = n.replace("midlayer.", "layers.0.")
        target, start = m, 0
        for a, fused in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                         (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")):
            if a in m:
                target = m.replace(a, fused)
        order = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}
        key = next((k for k in order if f".{k}." in m), None)
        if key:
            sibs = [s for s in order if order[s] < order[key] and (s.startswith("gate") or s.startswith("up")) == (
                key.startswith("gate") or key.startswith("up"))]
            start = sum(weights[n.replace(key, s)].shape[0] for s in sibs)
        full = target if target.startswith("lm_head") else prefix + target
        out[n] = (full, slice(start, start + t.shape[0]), t)
    return out


def vllm_eagle3(folder: Path, fmt: str, ref: dict, tag: str, row) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    if fmt == "speculators":  # vLLM's own speculators-config adapter turns the folder's config into its draft config
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
        hf = SpeculatorsConfig.from_pretrained(str(folder))
    else:
        hf = AutoConfig.from_pretrained(str(folder))
    weights = load_file(str(folder / "model.safetensors"))
    V = ref["logits"].shape[-1]
    vc = vllm_stub_config(hf, 4, V)
    try:
        model = vllm_build(Eagle3LlamaForCausalLM, vc)
    except Exception as e:
        row(f"{tag}: weights", "not-run", f"vLLM's Eagle3LlamaForCausalLM could not be constructed on CPU: {e}")
        return
    model.load_weights(iter(weights.items()))
    params = dict(model.named_parameters())
    if "d2t" not in weights and getattr(model, "draft_id_to_target_id", None) is not None:
        row(f"{tag}: weights", "fail", "vLLM expects d2t (draft vocab ≠ target vocab) but the export has none")
        return
    compare(row, tag, params, eagle3_expected(weights, "model."), skip=("embed_tokens",))
    gemm = vllm_cpu_ready(model, vc)
    # one draft step through vLLM's own modules; the attention core for one position is its value (softmax of one score)
    with torch.no_grad():
        lm = model.model
        lm.embed_tokens.weight.data[:V] = ref["target_embed"]  # the engine shares the target's embedding
        layer = lm.layers[0]
        h = model.combine_hidden_states(ref["features"])
        emb = layer.input_layernorm(ref["embeds"])
        hidden, residual = layer._residual_norm(hidden_states=h)
        x = torch.cat([emb, hidden], -1)
        qkv = layer.self_attn.qkv_proj(x)
        qkv = qkv[0] if isinstance(qkv, tuple) else qkv
        a = layer.self_attn
        q_size, kv_size = a.q_size, a.kv_size
        v = qkv[:, q_size + kv_size:].reshape(1, a.num_kv_heads, a.head_dim)
        attn = v.repeat_interleave(a.num_heads // a.num_kv_heads, 1).reshape(1, -1)
        o = a.o_proj(attn)
        o = o[0] if isinstance(o, tuple) else o
        o, residual = layer.post_attention_layernorm(o, residual)
        o = layer.mlp(o)
        normed, _ = lm.norm(o, residual)
        logits = model.compute_logits(normed)
    ok = torch.allclose(logits, ref["logits"], atol=1e-5, rtol=1e-4) and torch.equal(logits.isinf(), ref["logits"].isinf())
    row(f"{tag}: draft step", "pass" if ok else "fail",
        "vLLM's fc, norms, qkv/o projections, MLP and compute_logits (d2t map) on one position; attention core "
        f"= the value of the single key (vLLM's attention backend needs its KV cache / forward context); {gemm}"
        + ("" if ok else f"; max |Δ| {float((logits - ref['logits']).nan_to_num(0, 0, 0).abs().max()):.3g}"))


def vllm_medusa(folder: Path, fmt: str, ref: dict, tag: str, row) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import PretrainedConfig

    try:
        from vllm.model_executor.models.medusa import Medusa
    except ImportError as e:
        row(f"{tag}: weights", "not-run", f"{tag} has no Medusa model class ({e}); Medusa needs vLLM 0.32")
        return
    try:
        from vllm.transformers_utils.configs.medusa import MedusaConfig
        hf = MedusaConfig.from_pretrained(str(folder))
    except ImportError:
        hf = PretrainedConfig.from_pretrained(str(folder))
    weights = load_file(str(folder / "model.safetensors"))
    V = ref["logits"].shape[-1]
    vc = vllm_stub_config(hf, 4, V)
    model = vllm_build(Medusa, vc)
    model.load_weights(iter(weights.items()))
    params = dict(model.named_parameters())
    compare(row, tag, params, {n: (n, slice(0, t.shape[0]), t) for n, t in weights.items()})
    gemm = vllm_cpu_ready(model, vc)
    with torch.no_grad():
        logits = torch.stack(model.compute_logits(model(ref["hidden"])))
    ok = logits.shape == ref["logits"].shape and torch.allclose(logits, ref["logits"], atol=1e-5, rtol=1e-4)
    row(f"{tag}: draft step", "pass" if ok else "fail", f"Medusa.forward + compute_logits (all 5 heads); {gemm}"
        + ("" if ok else f"; shapes {tuple(logits.shape)} vs {tuple(ref['logits'].shape)}"))


def vllm_llama(folder: Path, fmt: str, ref: dict, tag: str, row) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from vllm.model_executor.models.llama import LlamaForCausalLM

    hf = AutoConfig.from_pretrained(str(folder))
    weights = load_file(str(folder / "model.safetensors"))
    model = vllm_build(LlamaForCausalLM, vllm_stub_config(hf, hf.num_hidden_layers, hf.vocab_size))
    model.load_weights(iter(weights.items()))
    expected = eagle3_expected(weights, "")
    if hf.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    compare(row, tag, dict(model.named_parameters()), expected)
    row(f"{tag}: draft step", "not-run", "a full forward of vLLM's LlamaForCausalLM needs its attention backend's "
        "forward context (KV cache, metadata), which only a running engine sets up")


# ------------------------------------------------------------------------------------- block drafters (vLLM)
def vllm_block_config(folder: Path, fmt: str, method: str):
    """The draft config vLLM builds for a folder (transformers_utils/configs): the speculators adapter for a
    speculators folder, else the folder's own config, wrapped in EAGLEConfig for the methods SpeculativeConfig wraps
    (eagle, eagle3, dflash), and the speculative method and token count it serves with (None: the user's)."""
    from transformers import AutoConfig

    if fmt == "speculators":
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
        spec = SpeculatorsConfig.extract_vllm_speculative_config(json.loads((folder / "config.json").read_text()))
        return SpeculatorsConfig.from_pretrained(str(folder)), spec["method"], spec["num_speculative_tokens"]
    hf = AutoConfig.from_pretrained(str(folder))
    if method in ("eagle", "eagle3", "dflash"):  # as vllm/config/speculative.py does
        from vllm.transformers_utils.configs.eagle import EAGLEConfig
        hf = EAGLEConfig(hf, method=method, model_type="eagle")
    return hf, method, None


def vllm_block(folder: Path, fmt: str, ref: dict, tag: str, row, family: dict) -> None:
    """A DFlash / DSpark folder through vLLM's own code on CPU: the config it builds (class, captured layers, mask
    token), load_weights bit for bit, then one block drafted with its modules (fc, hidden_norm, qkv / o projections,
    q_norm / k_norm, rotary embedding, MLP, norms, compute_logits; DSpark's Markov bias and confidence) against ours.
    The attention core over [context K/V ; block K/V] is computed here: vLLM's backend needs its KV cache."""
    import importlib
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.models import registry
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    hf, method, tokens = vllm_block_config(folder, fmt, family["method"])
    module_name, cls_name = registry._SPECULATIVE_DECODING_MODELS[hf.architectures[0]]
    cls = getattr(importlib.import_module(f"vllm.model_executor.models.{module_name}"), cls_name)
    captured = list(get_eagle3_aux_layers_from_config(SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))))
    proposer = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf), pass_hidden_states_to_model=False)
    SpecDecodeBaseProposer._init_parallel_drafting_params(proposer)  # where vLLM reads the mask token
    mask, drafts = proposer.parallel_drafting_token_id, ref["logits"].shape[0]
    ok = (captured == ref["feature_layers"] and mask == ref["mask_token_id"] and method == family["method"]
          and tokens in (None, drafts))
    row(f"{tag}: config", "pass" if ok else "fail",
        f"{hf.architectures[0]} → {cls_name}; captures the inputs to layers {captured} (trained: "
        f"{ref['feature_layers']}); mask token {mask}; method {method}"
        + (f", num_speculative_tokens {tokens} (drafts per block: {drafts})" if tokens is not None else ""))

    weights = load_file(str(folder / "model.safetensors"))
    vc = vllm_stub_config(hf, 4, ref["target_embed"].shape[0])
    vc.speculative_config.draft_model_config.model = str(folder)  # DFlash looks for a mask_embedding.pt beside it
    model = vllm_build(cls, vc)
    model.load_weights(iter(weights.items()))
    full = "lm_head.weight" not in weights  # then the engine shares the target's lm_head
    compare(row, tag, dict(model.named_parameters()), eagle3_expected(weights, "model."),
            skip=("embed_tokens", "mask_embedding") + (("lm_head",) if full else ()))
    gemm = vllm_cpu_ready(model, vc)
    with torch.no_grad():
        if full:
            model.lm_head.weight.data.copy_(ref["target_lm_head"])
        hidden = vllm_block_hidden(model.model, ref, captured, mask)  # [S, d]
        heads = hasattr(model, "compute_draft_logits")  # DSpark: draft-vocab logits, then its Markov bias
        first_row = 0 if heads and getattr(hf, "sample_from_anchor", True) else 1  # DFlash drafts from the masks
        rows = hidden[first_row:]
        checks = vllm_block_logits(model, rows, ref, heads)
    bad = [name for name, good in checks.items() if not good]
    row(f"{tag}: draft step", "pass" if not bad else "fail",
        f"one block of {hidden.shape[0]} slots after 4 context positions, drafts from slot {first_row}: "
        f"{', '.join(checks)} allclose to ours" + (f" except {bad}" if bad else "") + f"; {gemm}")


def vllm_block_hidden(lm, ref: dict, captured, mask: int):
    """The final hidden states [S, d] of the block [anchor, mask × (S − 1)] at positions t.., through vLLM's layers."""
    import torch
    import torch.nn.functional as F

    features = torch.cat([ref["all_hidden"][i] for i in captured], -1)  # [t, m·d] what vLLM's target hands over
    context = lm.hidden_norm(lm.fc(features))  # [t, d] (precompute_and_store_context_kv: hidden_norm, then K/V)
    t = context.shape[0]
    S = len(ref["positions"]) - t  # the block's slots
    ids = torch.tensor([int(ref["anchor"])] + [mask] * (S - 1))
    x, residual = ref["target_embed"][ids], None  # [S, d] the target's embedding, which the engine shares
    at_context, at_block = torch.arange(t), torch.arange(t, t + S)
    for layer in lm.layers:
        a = layer.self_attn
        if residual is None:
            residual, h = x, layer.input_layernorm(x)
        else:
            h, residual = layer.input_layernorm(x, residual)

        def qkv(states):
            out = a.qkv_proj(states)
            return (out[0] if isinstance(out, tuple) else out).split([a.q_size, a.kv_size, a.kv_size], -1)

        def heads(v, n):  # [n_tok, n·hd] → per-head RMSNorm input [n_tok, n, hd]
            return v.reshape(v.shape[0], n, a.head_dim)
        q, k, v = qkv(h)
        _, kc, vc = qkv(context)
        q = a.q_norm(heads(q, a.num_heads)).reshape(q.shape)
        k = a.k_norm(heads(k, a.num_kv_heads)).reshape(k.shape)
        kc = a.k_norm(heads(kc, a.num_kv_heads)).reshape(kc.shape)
        q, k = a.rotary_emb(at_block, q.clone(), k.clone())
        _, kc = a.rotary_emb(at_context, kc.clone(), kc.clone())
        keys = heads(torch.cat([kc, k]), a.num_kv_heads).transpose(0, 1)  # [kvh, t + S, hd]
        values = heads(torch.cat([vc, v]), a.num_kv_heads).transpose(0, 1)
        group = a.num_heads // a.num_kv_heads
        out = F.scaled_dot_product_attention(heads(q, a.num_heads).transpose(0, 1), keys.repeat_interleave(group, 0),
                                             values.repeat_interleave(group, 0), scale=a.scaling)  # non-causal
        o = a.o_proj(out.transpose(0, 1).reshape(S, -1))
        x, residual = layer.post_attention_layernorm(o[0] if isinstance(o, tuple) else o, residual)
        x = layer.mlp(x)
    hidden, _ = lm.norm(x, residual)
    return hidden


def vllm_block_logits(model, rows, ref: dict, heads: bool) -> dict:
    """check name → allclose: the drafts' logits (full-vocabulary after d2t for DFlash; draft-vocabulary, the
    Markov-corrected first draft, its confidence and its target id for DSpark)."""
    import torch

    def close(a, b):
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-4, rtol=1e-4) and torch.equal(
            a.isinf(), b.isinf())
    if not heads:
        logits = model.compute_logits(rows)  # [γ, V]: −inf off the draft vocabulary
        ours = torch.full_like(logits, float("-inf"))
        ours[:, ref["draft_ids"]] = ref["logits"].to(logits.dtype)
        return {"compute_logits (d2t)": close(logits, ours)}
    draft = model.compute_draft_logits(rows)  # [γ, Vd]
    embed = model.markov_embed(ref["anchor"])  # [1, r] W1[prev], prev = the anchor
    first = draft[:1] + model.markov_bias(embed)
    checks = {"draft logits": close(draft, ref["logits"]), "Markov-corrected first draft": close(first[0], ref["first"])}
    if ref["confidence"] is not None and getattr(model.model, "confidence_head", None) is not None:
        checks["confidence"] = close(model.compute_confidence(rows[:1], embed)[0], torch.sigmoid(ref["confidence"]))
    top = model.map_draft_to_target(first.argmax(-1))
    checks["d2t of the first draft"] = int(top) == int(ref["draft_ids"][ref["first"].argmax()])
    return checks


def speculators_checks(folder: Path, work: Path, name: str, ref: dict, row) -> None:
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel

    tag = f"speculators {importlib.metadata.version('speculators')}"
    weights = load_file(str(folder / "model.safetensors"))
    os.chdir(work)  # verifier.name_or_path of a local target is its folder name: resolvable from beside it, as in use
    try:
        model = Eagle3DraftModel.from_pretrained(str(folder))
    except Exception as e:
        row(f"{tag}: from_pretrained", "fail", f"{type(e).__name__}: {str(e).splitlines()[0]}")
        model = None
    if model is not None:
        sd = model.state_dict()
        bad = [n for n, t in weights.items() if n not in ("d2t", "t2d") and (n not in sd or not torch.equal(sd[n], t))]
        for n in ("d2t", "t2d"):
            if n in weights and (n not in sd or not torch.equal(sd[n].to(weights[n].dtype), weights[n])):
                bad.append(n)
        c = model.config
        conf = (c.norm_before_residual is False and list(c.eagle_aux_hidden_state_layer_ids) == [1, 2, 3]
                and c.draft_vocab_size == weights["lm_head.weight"].shape[0])
        row(f"{tag}: from_pretrained", "pass" if not bad and conf else "fail",
            f"Eagle3DraftModel: {len(weights)} tensors bit-exact, norm_before_residual false, ids [1, 2, 3]"
            if not bad and conf else f"differ: {bad[:4]}; config ok: {conf}")
        row(f"{tag}: draft step", "not-run", "Eagle3DraftModel.forward is the training-time TTT loss over a "
            "packed sequence with flex-attention block masks; no single-step inference entry point")
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    out = work / "converted" / name
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    src = work / "exports" / name / "vllm"  # the converter does not read the ids from the config: passed as a user would
    ids = json.loads((src / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    Eagle3Converter().convert(src, out, base_model=str(work / "tiny-target"), validate=False, norm_before_residual=False,
                              eagle_aux_hidden_state_layer_ids=ids)
    conv = load_file(str(out / "model.safetensors"))
    same = sorted(conv) == sorted(weights) and all(torch.equal(conv[n], weights[n]) for n in weights)
    extra = sorted(set(conv) - set(weights))
    missing = sorted(set(weights) - set(conv))
    cc, ours = json.loads((out / "config.json").read_text()), json.loads((folder / "config.json").read_text())
    keys = ["speculators_model_type", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
            "eagle_aux_hidden_state_layer_ids"]
    diff = {k: (cc.get(k), ours.get(k)) for k in keys if cc.get(k) != ours.get(k)}
    row(f"{tag}: converter(vllm export) = our speculators export",
        "pass" if same and not diff else "fail",
        "Eagle3Converter.convert of the `vllm` folder gives the same tensors and config keys" if same and not diff
        else f"tensors only in converter's: {extra[:4]}, only in ours: {missing[:4]}; config differs: {diff}")


# ------------------------------------------------------------------------------ block drafters (speculators)
def speculators_block(folder: Path, work: Path, name: str, ref: dict, row) -> None:
    """A DFlash / DSpark speculators folder through the library's own SpeculatorModel.from_pretrained (the class
    from speculators_model_type, the embedding and a full vocabulary's lm_head from the verifier); where the library
    has a converter from z-lab's layout, our `vllm` folder converted must equal our `speculators` folder."""
    import importlib.util
    import shutil

    import torch
    from safetensors.torch import load_file
    from speculators.model import SpeculatorModel

    tag = f"speculators {importlib.metadata.version('speculators')}"
    weights = load_file(str(folder / "model.safetensors"))
    os.chdir(work)  # verifier.name_or_path of a local target is its folder name: resolvable from beside it, as in use
    model = SpeculatorModel.from_pretrained(str(folder))
    sd, c = model.state_dict(), model.config
    bad = [n for n, t in weights.items() if n not in sd or not torch.equal(sd[n].to(t.dtype), t)]
    if "lm_head.weight" not in weights:  # a full vocabulary: the verifier's lm_head, loaded by the library
        bad += [] if torch.equal(sd["lm_head.weight"], ref["target_lm_head"]) else ["lm_head.weight (verifier's)"]
    conf = {"aux_hidden_state_layer_ids": list(c.aux_hidden_state_layer_ids) == ref["feature_layers"],
            "mask_token_id": c.mask_token_id == ref["mask_token_id"],
            "speculative_tokens": c.speculators_config.proposal_methods[0].speculative_tokens == ref["logits"].shape[0],
            # the anchor slot drafts exactly when a block drafts as many tokens as it has slots (DSpark)
            "sample_from_anchor": bool(c.sample_from_anchor) == (ref["logits"].shape[0] == len(ref["positions"]) - 4)}
    wrong = [k for k, good in conf.items() if not good]
    filled = "embedding" + ("" if "lm_head.weight" in weights else " and lm_head")
    row(f"{tag}: from_pretrained", "pass" if not bad and not wrong else "fail",
        f"{type(model).__name__}: {len(weights)} tensors bit-exact, the verifier's {filled} filled in; "
        f"{', '.join(conf)} as trained" if not bad and not wrong else f"differ: {bad[:4]}; config wrong: {wrong}")
    row(f"{tag}: draft step", "not-run", f"{type(model).__name__}.forward is the training-time loss over sampled "
        "anchors with flex-attention block masks; no single-block inference entry point")
    model_type = json.loads((folder / "config.json").read_text())["speculators_model_type"]
    if importlib.util.find_spec(f"speculators.convert.{model_type}") is None:
        row(f"{tag}: converter", "not-run", f"speculators has no converter for {model_type} checkpoints")
        return
    if "lm_head.weight" in weights:
        row(f"{tag}: converter", "not-run", "the library's converter of z-lab checkpoints assumes the full vocabulary "
            "(draft_vocab_size = vocab_size); this drafter's is pruned")
        return
    converter = importlib.import_module(f"speculators.convert.{model_type}")
    cls = next(getattr(converter, n) for n in dir(converter) if n.endswith("Converter"))
    out = work / "converted" / name
    shutil.rmtree(out, ignore_errors=True)
    cls().convert(work / "exports" / name / "vllm", out, base_model=str(work / "tiny-target"), validate=False)
    conv, ours = load_file(str(out / "model.safetensors")), json.loads((folder / "config.json").read_text())
    cc = json.loads((out / "config.json").read_text())
    keys = ["speculators_model_type", "block_size", "mask_token_id", "aux_hidden_state_layer_ids", "draft_vocab_size"]
    diff = {k: (cc.get(k), ours.get(k)) for k in keys if cc.get(k) != ours.get(k)}
    body = [n for n in weights if n not in conv or not torch.equal(conv[n].to(weights[n].dtype), weights[n])]
    row(f"{tag}: {cls.__name__}(vllm export) = our speculators export", "pass" if not diff and not body else "fail",
        f"the library's conversion of the z-lab-layout `vllm` folder has our tensors and {', '.join(keys)}"
        if not diff and not body else f"config differs: {diff}; tensors differ: {body[:4]}")


# ----------------------------------------------------------------------------------- block drafters (SGLang)
def loose_module(path: Path, namespace: Optional[dict] = None) -> dict:
    """The top-level definitions of an SGLang source file that run without its imports: sglang.srt cannot be
    imported here (triton, sgl_kernel are CUDA-only), and these functions need none of what fails."""
    ns = {"__name__": f"loose_{path.stem}", **(namespace or {})}
    for node in ast.parse(path.read_text()).body:
        try:
            exec(compile(ast.Module([node], []), str(path), "exec"), ns)
        except Exception:  # an import of a CUDA-only module, or a definition built on one
            continue
    return ns


def method_source(path: Path, cls: str, method: str, rename: Optional[Dict[str, str]] = None):
    """One method of a class in `path` as a plain function (its decorators dropped, `rename` applied to its text:
    super() needs the class, which cannot be built here)."""
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)
    fn.decorator_list = []
    text = ast.unparse(fn)
    for old, new in (rename or {}).items():
        text = text.replace(old, new)
    return text


def sglang_block(folder: Path, ref: dict, row) -> None:
    """A DFlash / DSpark folder read by SGLang's own code, taken from the installed wheel's source: its config parsers
    (dflash_utils.parse_dflash_draft_config, dspark_config.parse_dspark_draft_config), the target's
    set_dflash_layers_to_capture (models/llama.py), and the draft's load_weights (models/dflash.py, dspark.py) run
    on recording parameters: which SGLang parameter (and shard) each of our tensors lands in."""
    import importlib.util

    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    srt = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt"
    tag = f"SGLang {importlib.metadata.version('sglang')}"
    hf = AutoConfig.from_pretrained(str(folder))
    utils = loose_module(srt / "speculative" / "dflash_utils.py")
    parsed = utils["parse_dflash_draft_config"](draft_hf_config=hf)
    ids = parsed.resolve_target_layer_ids(target_num_layers=4, draft_num_layers=hf.num_hidden_layers)
    target = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), model=SimpleNamespace())
    capture = {"List": List, "Optional": Optional}  # its annotations
    exec(method_source(srt / "models" / "llama.py", "LlamaForCausalLM", "set_dflash_layers_to_capture"), capture)
    capture["set_dflash_layers_to_capture"](target, ids)
    conf = {"captured layers": target.model.layers_to_capture == ref["feature_layers"],
            "block size": parsed.block_size == len(ref["positions"]) - 4,
            "mask token": parsed.mask_token_id == ref["mask_token_id"]}
    weights = load_file(str(folder / "model.safetensors"))
    heads = (srt / "models" / "dspark.py").is_file() and hf.architectures[0] in loose_entry_classes(srt / "models" / "dspark.py")
    if heads:  # a DSpark draft: gamma (the drafts per block) and the Markov head as SGLang parses them
        dspark = loose_module(srt / "speculative" / "dspark_components" / "dspark_config.py",
                              {"parse_dflash_draft_config": utils["parse_dflash_draft_config"]})
        d = dspark["parse_dspark_draft_config"](draft_hf_config=hf)
        rank = weights["markov_head.markov_w1.weight"].shape[1]
        conf.update({"gamma": d.gamma == ref["logits"].shape[0], "markov_rank": d.markov_rank == rank,
                     "markov_head_type": d.markov_head_type == "vanilla",
                     "sample_from_anchor": dspark["get_dspark_sample_from_anchor"](hf)})
    wrong = [k for k, good in conf.items() if not good]
    row(f"{tag}: config", "pass" if not wrong else "fail",
        f"{hf.architectures[0]}: captures the inputs to layers {target.model.layers_to_capture} (trained: "
        f"{ref['feature_layers']}), {', '.join(conf)} as trained" + (f"; wrong: {wrong}" if wrong else ""))

    routed = sglang_block_routes(srt, weights, hf, heads)
    shards = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1, None: 0}
    got = {(n, shards[s]): w for n, s, w in routed}
    expected = {}
    for n, (pname, _, t) in eagle3_expected(weights, "").items():
        sub = n.split(".")[-2]
        expected[n] = (pname, {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}.get(sub, 0), t)
    bad = [n for n, (p, s, t) in expected.items() if (p, s) not in got or not torch.equal(got[(p, s)], t)]
    row(f"{tag}: weight-name mapping", "pass" if not bad else "fail",
        f"{'DSparkDraftMixin' if heads else 'DFlashDraftModel'}.load_weights routes all {len(expected)} tensors "
        "(q/k/v → qkv_proj shards, gate/up → gate_up_proj) bit-exact to the parameter names its module builds (read "
        "from models/dflash.py, dspark.py); none ignored"
        if not bad else f"not routed / differ: {bad[:4]}")
    row(f"{tag}: module + draft step", "not-run", "importing sglang.srt needs triton and sgl_kernel (CUDA-only "
        "wheels): SGLang's draft module cannot be built on this CPU-only machine")


def loose_entry_classes(path: Path) -> List[str]:
    """The class names in a model file's `EntryClass = [...]` (how SGLang registers architectures)."""
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "EntryClass")
    return [e.id for e in node.value.elts]


def sglang_block_routes(srt: Path, weights: dict, hf, heads: bool) -> list:
    """(parameter, shard, tensor) for every tensor SGLang's load_weights loads, on a stand-in draft whose parameters
    are the names SGLang's DFlashDraftModel (+ DSpark's heads) builds."""
    import torch

    loaded = []

    def default_weight_loader(param, w, shard=None):
        loaded.append((param.name, shard, w))

    shapes: Dict[str, List[int]] = {}  # SGLang's parameter → its shape (q/k/v and gate/up stacked along rows)
    for n, t in weights.items():
        if n in ("d2t", "t2d", "lm_head.weight"):
            continue
        fused = (n.replace("q_proj", "qkv_proj").replace("k_proj", "qkv_proj").replace("v_proj", "qkv_proj")
                 .replace("gate_proj", "gate_up_proj").replace("up_proj", "gate_up_proj"))
        rows = shapes.get(fused, [0, *t.shape[1:]])[0] if fused != n else 0
        shapes[fused] = [rows + t.shape[0], *t.shape[1:]]
    params = {n: SimpleNamespace(name=n, shape=torch.Size(shape)) for n, shape in sorted(shapes.items())}
    ns = {"torch": torch, "Iterable": __import__("typing").Iterable, "Tuple": tuple, "Optional": Optional, "List": List,
          "default_weight_loader": default_weight_loader, "_logical_linear_weight_shape": None}
    exec(method_source(srt / "models" / "dflash.py", "DFlashDraftModel", "load_weights"), ns)
    base = ns["load_weights"]
    draft = SimpleNamespace(named_parameters=lambda: list(params.items()), projector_type=None,
                            is_nemotron_35_draft=False, num_context_features=len(hf.dflash_config["target_layer_ids"]),
                            config=hf, confidence_head=object())
    if not heads:
        base(draft, iter(weights.items()))
        return loaded
    dspark = loose_module(srt / "models" / "dspark.py")
    ns.update(_DSPARK_SKIPPED_WEIGHT_PREFIXES=dspark["_DSPARK_SKIPPED_WEIGHT_PREFIXES"])
    exec(method_source(srt / "models" / "dspark.py", "DSparkDraftMixin", "load_weights",
                       {"super().load_weights(": "self.base_load_weights("}), ns)
    exec(method_source(srt / "models" / "dspark.py", "DSparkDraftMixin", "_load_confidence_weights"), ns)
    draft.base_load_weights = lambda w: base(draft, iter(w))
    confidence = ns["_load_confidence_weights"]
    draft._load_confidence_weights = lambda **kw: confidence(draft, **kw)
    ns["load_weights"](draft, iter(weights.items()))
    return loaded


def sglang_mapping(folder: Path, ref: dict, row) -> None:
    """SGLang's LlamaForCausalLMEagle3.load_weights, taken from the installed wheel's source and run on recording
    parameters: which SGLang parameter (and shard) each of our tensors lands in. Importing sglang.srt needs triton
    and sgl_kernel (CUDA), so the module itself cannot be built here."""
    import ast
    import importlib.util

    import torch
    from safetensors.torch import load_file

    spec = importlib.util.find_spec("sglang")
    src_path = Path(spec.submodule_search_locations[0]) / "srt" / "models" / "llama_eagle3.py"
    version = importlib.metadata.version("sglang")
    tag = f"SGLang {version}"
    tree = ast.parse(src_path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LlamaForCausalLMEagle3")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights")
    fn.decorator_list = []
    loaded = []

    def default_weight_loader(param, w, shard=None):
        loaded.append((param.name, shard, w))

    ns = {"torch": torch, "Iterable": __import__("typing").Iterable, "Tuple": tuple, "default_weight_loader":
          default_weight_loader}
    exec(compile(ast.Module([fn], []), str(src_path), "exec"), ns)
    weights = load_file(str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    names = ["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
             "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
             "model.layers.0.post_attention_layernorm.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight"]

    class P:
        def __init__(self, n):
            self.name = n

    class Self:
        def named_parameters(self):
            return [(n, P(n)) for n in names]
    me = Self()
    ns["load_weights"](me, iter(weights.items()))
    shards = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1, None: 0}
    got = {(n, shards[s]): w for n, s, w in loaded}
    expected = {}
    for n, (pname, _, t) in eagle3_expected({k: v for k, v in weights.items() if k != "d2t"}, "model.").items():
        sub = n.split(".")[-2]
        expected[n] = (pname, {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}.get(sub, 0), t)
    bad = [n for n, (p, s, t) in expected.items() if (p, s) not in got or not torch.equal(got[(p, s)], t)]
    unloaded = [n for n in names if not any(p == n for p, _ in got)]
    hot_ok = "d2t" not in weights or torch.equal(me.hot_token_id, weights["d2t"] + torch.arange(len(weights["d2t"])))
    ids = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    ok = not bad and not unloaded and hot_ok and ids == [0, 1, 2] and "eagle_aux_hidden_state_layer_ids" not in config
    row(f"{tag}: weight-name mapping", "pass" if ok else "fail",
        (f"load_weights routes {len(expected)} tensors (q/k/v → qkv_proj shards, gate/up → gate_up_proj) to SGLang's "
         f"parameter names bit-exact; d2t → hot_token_id; eagle_config ids {ids} (SGLang's reading)") if ok else
        f"differ / unrouted: {bad[:4]}; parameters never loaded: {unloaded[:4]}; hot_token_id ok: {hot_ok}; ids {ids}")
    row(f"{tag}: module + draft step", "not-run", "importing sglang.srt needs triton and sgl_kernel (CUDA-only "
        "wheels): SGLang's Eagle3 module cannot be built on this CPU-only machine")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    elif sys.argv[1:2] == ["--check"]:
        run_check(sys.argv[2], Path(sys.argv[3]), sys.argv[4], Path(sys.argv[5]))
    else:
        main()
