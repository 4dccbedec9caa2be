"""Conformance run (issue 15): do the engines' own loaders read our exports unchanged? Not part of the test suite.

    python launch/conformance.py [--out runs/conformance] [--reinstall]
    python -m specdrafter.export.conformance [--out runs/conformance] [--reinstall]   (the same)

1. Creates (or reuses) a virtual environment at `cache_dir()/conformance-venv` (system site packages visible, so it
   reuses this machine's CPU torch / transformers) and pip-installs the engines' wheels without their GPU
   dependencies: vLLM 0.33.0 (`--no-deps` + the few pure-Python packages its model code imports), vLLM 0.32.0 and
   SGLang 0.5.x into side folders of the venv (`--target`, put on PYTHONPATH per check), speculators (`--no-deps`).
2. In this environment builds tiny drafters with specdrafter's own code (a 4-layer random Llama, hidden 32, with
   SmolLM2's tokenizer, as tests/test_export.py does): EAGLE-3 with a pruned draft vocabulary and with the full one,
   Medusa heads (5 heads, 1 ResBlock each), an HF draft model; exports each in every format of
   `export/formats.py:FORMATS`, and saves reference inputs and our logits.
3. Runs this file with `--worker` in the venv: each export is loaded by the engine's own code on CPU and compared
   with our tensors bit for bit; where the engine's module runs on CPU, one draft step (logits) is compared with
   ours (allclose). Rows that cannot run say why.

Writes OUT/conformance.md (the table) and OUT/conformance.json (rows + installed versions + install times).
"""

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VLLM_NEW, VLLM_OLD, SGLANG, SPECULATORS = "vllm==0.33.0", "vllm==0.32.0", "sglang>=0.5,<0.6", "speculators"
VLLM_DEPS = ["pyzmq", "msgspec", "cachetools", "cbor2", "pybase64", "blake3", "prometheus_client", "aiohttp", "multidict",
             "yarl", "propcache", "frozenlist", "aiosignal", "aiohappyeyeballs", "openai_harmony", "uvloop",
             "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11", "partial_json_parser", "llguidance"]  # what its model code imports
SPECULATORS_DEPS = ["loguru", "pydantic-settings"]


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
    from specdrafter.core.recipe import load_recipe
    from specdrafter.data.assets import ensure_smollm2
    from specdrafter.export.formats import export
    from specdrafter.kinds import KINDS, build_drafter
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
    refs, exports = {}, {}
    # every kind's conformance variants (kinds/: conformance_variants), e.g. eagle3-pruned / eagle3-full
    drafters = {name: (k, overrides) for k in KINDS.values() for name, overrides in k.conformance_variants().items()}
    for name, (kind, overrides) in drafters.items():
        run = work / "runs" / name
        cfg = load_recipe(RECIPES_DIR / kind.recipe,
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
            kind.perturb(module, name, target.config.vocab_size)
        folder = run / "checkpoints" / "step-000004"
        drafter.save(module, folder / "drafter", tokenizer)
        (folder / "recipe.yaml").write_text(OmegaConf.to_yaml(cfg))
        (folder / "trainer_state.json").write_text(json.dumps({"step": 4, "tokens": 1000, "drafter": kind.name}))
        with torch.no_grad():
            refs[name] = kind.reference_step(module, target, hs, ids)
        for fmt in kind.formats:
            try:
                exports[f"{fmt}/{name}"] = str(export(folder, fmt, work / "exports" / name / fmt))
            except SpecdrafterError as e:
                exports[f"{fmt}/{name}"] = {"error": str(e)}
    torch.save(refs, work / "reference.pt")
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


def main() -> None:
    from specdrafter.data.assets import cache_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/conformance")
    p.add_argument("--reinstall", action="store_true", help="pip-install again into the existing venv")
    a = p.parse_args()
    out, venv = Path(a.out), cache_dir() / "conformance-venv"
    out.mkdir(parents=True, exist_ok=True)
    t = time.time()
    info = setup_venv(venv, False if a.reinstall else None)
    print(f"venv {venv} ready ({time.time() - t:.0f} s): {json.dumps(info['versions'])}", flush=True)
    work = out / "work"
    built = build_and_export(work)
    print(f"exported: {json.dumps(built['exports'], indent=1)}", flush=True)
    rows = [{"format": k.split("/")[0], "drafter": k.split("/")[1], "check": "export", "result": "fail",
             "detail": e["error"]} for k, e in built["exports"].items() if isinstance(e, dict)]
    res = work / "rows.json"
    proc = subprocess.run([str(venv_python(venv)), str(Path(__file__).resolve()), "--worker", str(work), str(venv),
                           str(res)], env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
                                           "PYTHONNOUSERSITE": "1"})
    rows += json.loads(res.read_text()) if res.is_file() else [
        {"format": "*", "drafter": "*", "check": "worker", "result": "fail", "detail": f"worker exited {proc.returncode}"}]
    table = markdown(rows, info)
    (out / "conformance.md").write_text("# Conformance with the engines\n\n" + table)
    (out / "conformance.json").write_text(json.dumps({"rows": rows, **info, "exports": built["exports"]}, indent=1))
    print(table)
    print(f"wrote {out / 'conformance.md'} and conformance.json")


# ======================================================================== the venv: the engines' own loaders
def worker(work: Path, venv: Path, res: Path) -> None:
    """Every check in its own subprocess (vLLM 0.32, SGLang and vLLM 0.33 cannot share one interpreter)."""
    exports = {f"{fmt.name}/{d.name}": fmt for d in sorted((work / "exports").iterdir()) for fmt in sorted(d.iterdir())}
    plan = []
    for key in exports:
        fmt, name = key.split("/")
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
        elif check.startswith("vllm"):
            import vllm
            tag = f"vLLM {vllm.__version__}"
            {"vllm": vllm_eagle3, "vllm-medusa": vllm_medusa, "vllm-llama": vllm_llama}[check](folder, fmt, ref, tag, row)
        elif check == "speculators":
            speculators_checks(folder, work, name, ref, row)
        elif check == "sglang":
            sglang_mapping(folder, ref, row)
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
