"""Benchmark: peak memory of one EAGLE-3 loss step at Llama-3's vocabulary (128,256 tokens, draft vocabulary 32,000,
7 TTT steps — recipes/llama8b.yaml), with the full-vocabulary teacher rows as before and with the draft-vocabulary
teacher (train.drafters.teacher_rows: chunked normaliser, only the draft rows kept).

    python benchmarks/bench_teacher_memory.py [--tokens 1024] [--hidden 512]

Each arm runs in a fresh process on a random 2-layer target with the real vocabulary and `--hidden` width (the
teacher's memory depends on the vocabulary and the number of rows, not on the width) and reports the rise of the
process's peak resident memory (ru_maxrss) over one forward + loss + backward of the drafter.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

V, VD = 128_256, 32_000


def one_step(mode: str, tokens: int, hidden: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdrafter.jobs.recipe import load_recipe
    from specdrafter.kinds import build_drafter, feature_layers
    from specdrafter.recipes import RECIPES_DIR
    from specdrafter.train.batches import Batch
    from specdrafter.train.drafters import run_target
    from specdrafter.train.objectives import Objective

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    target = LlamaForCausalLM(config).eval().requires_grad_(False)
    cfg = load_recipe(RECIPES_DIR / "llama8b.yaml", ["drafter.eagle.aux_layer_ids=[1,2,3]", "target.model=unused"])
    tokens_seen = type("Counts", (), {"target_tokens": staticmethod(lambda: [torch.randint(0, V, (200_000,))])})
    drafter = build_drafter(cfg, target, tokens_seen)
    layers = feature_layers(cfg, config)
    input_ids = torch.randint(0, V, (1, tokens))
    loss_mask = torch.ones(1, tokens, dtype=torch.long)
    loss_mask[:, :16] = 0
    features = {k: torch.randn(1, tokens, hidden) for k in layers}
    batch = Batch(input_ids, loss_mask, torch.ones(1, tokens, dtype=torch.long), features)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    teacher = run_target(target, batch, layers, drafter.teacher_ids if mode == "draft_vocab" else None)
    loss = sum(p.loss(Objective.of(cfg.train))[0] for p in drafter.predictions(drafter.module, batch, teacher))
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "loss": round(float(loss), 4), "peak_rise_mib": round((peak - before) / 1024, 1),
            "teacher_rows_mib": round(teacher.logits.numel() * 4 / 2**20, 1)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--arm", choices=["full_vocab", "draft_vocab"], help=argparse.SUPPRESS)  # one arm, in-process
    args = parser.parse_args(argv)
    if args.arm:
        print(json.dumps(one_step(args.arm, args.tokens, args.hidden)))
        return
    arms = {}
    for arm in ("full_vocab", "draft_vocab"):
        done = subprocess.run([sys.executable, __file__, "--arm", arm, "--tokens",
                               str(args.tokens), "--hidden", str(args.hidden)], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"error: the {arm} arm failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
        arms[arm] = json.loads(done.stdout.strip().splitlines()[-1])
    report = {"vocab": V, "draft_vocab": VD, "ttt_steps": 7, "tokens": args.tokens, "arms": arms,
              "peak_ratio": round(arms["full_vocab"]["peak_rise_mib"] / max(arms["draft_vocab"]["peak_rise_mib"], 1e-9), 2)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
