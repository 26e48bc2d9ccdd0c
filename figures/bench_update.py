"""The trust regions' cost: each objective's update phase (2 optimizer steps) timed against ppo_clip's on a tiny
Qwen2 at Qwen's vocabulary, and its peak memory. A measurement, not a test (figures/memory_and_speed.md):

    HF_HUB_OFFLINE=1 python figures/bench_update.py
"""

import ctypes
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

FIGURES = Path(__file__).resolve().parent
sys.path.insert(0, str(FIGURES.parent))  # dppo.py, rewards.py and test_dppo.py
import dppo  # noqa: E402
from test_dppo import config, update, write_qwen_checkpoint  # noqa: E402


def update_phase_runner(checkpoint: str, completions=16, new_tokens=64):
    """A function that runs one objective's update phase (2 optimizer steps) on the same sampled batch, from the
    same weights with a fresh AdamW and the same mini-batch split every time, and returns its seconds."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = dppo.load_policy(checkpoint, device)
    problems = dppo.arithmetic_problems()["test"][: completions // 4]
    prompts = [dppo.format_prompt(tokenizer, p["question"]) for p in problems for _ in range(4)]
    torch.manual_seed(0)
    rollout = dppo.generate_rollout(model, tokenizer, prompts, config(max_new_tokens=new_tokens))
    advantages = dppo.grpo_advantages(torch.arange(completions).remainder(3).eq(0).float(), group_size=4)
    weights = {name: value.clone() for name, value in model.state_dict().items()}

    def update_phase(objective: str) -> float:
        model.load_state_dict(weights)
        flags = f"--objective {objective} --updates_per_step 2 --micro_batch_size {completions // 2}"
        cfg = dppo.parse_config(["--model", checkpoint, *flags.split(), "--learning_rate", "1e-4"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
        torch.manual_seed(1)
        started = time.perf_counter()
        update(model, optimizer, rollout, advantages, cfg)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    update_phase("ppo_clip")  # warm-up
    return update_phase, device, rollout.completion_mask.sum().item()


def objective_seconds(checkpoint: str, rounds=7) -> dict:
    """Each round runs every objective's update phase once, in a fresh random order; an objective's figure is the
    median over rounds of its time divided by ppo_clip's in the same round. On a CPU: one thread, and glibc keeps the
    memory it frees, as CUDA's caching allocator does (page faults and two threads' stalls on this 2-core machine
    moved a run's time by up to 20% from one repeat to the next, more than the differences measured here)."""
    if not torch.cuda.is_available():
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-1, 2**40)  # M_TRIM_THRESHOLD: never give the heap's free top back
        libc.mallopt(-3, 2**25)  # M_MMAP_THRESHOLD: blocks up to 32 MiB (glibc's most) come from the heap
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if not torch.cuda.is_available() else threads)
    try:
        update_phase, device, tokens = update_phase_runner(checkpoint)
        seconds, ratios, order = defaultdict(list), defaultdict(list), random.Random(0)
        for _ in range(rounds):
            this_round = {o: update_phase(o) for o in order.sample(dppo.OBJECTIVES, len(dppo.OBJECTIVES))}
            for objective, t in this_round.items():
                seconds[objective].append(t)
                ratios[objective].append(t / this_round["ppo_clip"])
    finally:
        torch.set_num_threads(threads)
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu, 1 thread",
        "tokens": tokens,
        "seconds": {o: statistics.median(t) for o, t in seconds.items()},
        "ratio": {o: statistics.median(r) for o, r in ratios.items()},
        "ratio_spread": {o: (min(r), max(r)) for o, r in ratios.items()},
    }


def objective_peak_mib(checkpoint: str) -> dict:
    """Each objective's update phase once, peak memory above the memory before it, in MiB: allocated tensors on CUDA; on
    a CPU the RSS of a fresh process started with MALLOC_MMAP_THRESHOLD_ set low (see rollout_peak_memory_mib)."""
    update_phase, device, _ = update_phase_runner(checkpoint)
    peaks = {}
    for objective in dppo.OBJECTIVES:
        dppo.reset_peak_memory(device)
        before = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else dppo.peak_memory_mb(device)
        update_phase(objective)
        peaks[objective] = dppo.peak_memory_mb(device) - before
    return peaks


def bench(checkpoint: str):
    """The trust regions' cost, printed as a table: each objective's update phase against ppo_clip's on a tiny Qwen2
    at Qwen's vocabulary, where the output layer's work (which the trust regions add to) is most of the step.
    A measurement, not a test: on a shared machine its ratios move by more than the few percent they resolve."""
    timing = objective_seconds(checkpoint)
    if torch.cuda.is_available():
        peaks = objective_peak_mib(checkpoint)
    else:
        probe = f"import json, bench_update; print(json.dumps(bench_update.objective_peak_mib({checkpoint!r})))"
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        done = subprocess.run([sys.executable, "-c", probe], cwd=FIGURES, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        peaks = json.loads(done.stdout.splitlines()[-1])
    print(
        f"update phase: {timing['tokens']:.0f} completion tokens, 2 optimizer steps; {timing['device']}\n"
        "| objective | time | vs ppo_clip (min-max over rounds) | peak memory | vs ppo_clip |\n"
        "|---|---|---|---|---|"
    )
    for objective in dppo.OBJECTIVES:
        low, high = timing["ratio_spread"][objective]
        print(
            f"| {objective} | {timing['seconds'][objective]:.2f} s | {timing['ratio'][objective]:.3f}x "
            f"({low:.2f}-{high:.2f}) | {peaks[objective]:.0f} MiB | {peaks[objective] / peaks['ppo_clip']:.2f}x |"
        )


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        bench(str(write_qwen_checkpoint(Path(directory))))
