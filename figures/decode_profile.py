"""Where one decode step's time goes on a GPU, at the README's 0.5B shape: a random model of Qwen2.5-0.5B's shape and
vocabulary (test_dppo.write_tiny_checkpoint; a random model rarely stops, so every rollout runs all 512 steps),
P = 32 prompts x G = 8 samples, 512 new tokens, --generation_cache static, the sampler as dppo.py's defaults make it
on CUDA (the policy itself: fp32 weights under bf16 autocast).

    python figures/decode_profile.py OUT_DIR [--dppo PATH] [--label NAME] [--variants]

PATH: the dppo.py to time (default: this checkout's), so that one call times a change against the code before it.
It prints, and writes to OUT_DIR/<label>.json (and the profiler's tables to OUT_DIR/<label>_*.txt):
1. rollouts timed whole, after one that compiles: generated tokens per second and ms per decode step;
2. one rollout with the device synchronised at marks in every decode step, split into the forward (generate's compiled
   call), recording mu (SamplingRecorder), sampling (the temperature, softmax, multinomial, the stop check) and the
   rest (generate's bookkeeping between them: inputs for the next step, the logits' fp32 copy);
3. torch.profiler over 20 decode steps (steps 101-120 of a rollout): the top operations by CUDA and by CPU time,
   and the GPU's busy time per step against the step's wall time;
4. the bandwidth floor: the bytes one decode step must read (the weights as the sampler holds them, and the KV cache
   at its mean fill) over the card's copy bandwidth, measured here;
5. with --variants, the rollout without recording mu (plain sampling), with a bf16 sampler copy, and with the
   recorder's per-step work (logits / tau, log Z, top-K, entropy) as one compiled function (a candidate cut: its
   tokens/s, and how far what it records is from what the plain recorder records on the same rollout).
"""

import argparse
import dataclasses
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

HERE = Path(__file__).resolve().parent.parent
P, G, NEW_TOKENS, PROFILED = 32, 8, 512, range(101, 121)


def load_dppo(path: Path):
    sys.path.insert(0, str(HERE))  # rewards.py, test_dppo.py
    spec = importlib.util.spec_from_file_location("dppo", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["dppo"] = module  # test_dppo's `import dppo` gets this one
    spec.loader.exec_module(module)
    return module


class EveryStep(StoppingCriteria):
    """Called once per decode step, after its token is drawn: a hook that never stops generation."""

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, input_ids, scores, **kwargs):
        self.hook()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def synchronised_clock():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--dppo", type=Path, default=HERE / "dppo.py")
    parser.add_argument("--label", default="dppo")
    parser.add_argument("--variants", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, 4 x 2 samples of 32 tokens: a check")
    parser.add_argument("--checkpoint", type=Path, help="where the random model is written, or read if it is there")
    parser.add_argument("--quick", action="store_true", help="the whole rollouts alone (1.), for a before and after")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dppo = load_dppo(args.dppo)
    import test_dppo

    try:  # "skipping cudagraphs due to ..." if generate's compiled step cannot be captured
        torch._logging.set_logs(perf_hints=True, recompiles=True)
    except Exception as error:  # noqa: BLE001 - a diagnostic only
        print(f"no torch logs: {error}")
    global P, G, NEW_TOKENS, PROFILED
    shape = dict(vocab_size=test_dppo.QWEN_VOCAB_SIZE, hidden_size=896, intermediate_size=4864, num_hidden_layers=24)
    heads = dict(num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6)
    if args.tiny:
        P, G, NEW_TOKENS, PROFILED, shape, heads = 4, 2, 32, range(11, 16), {}, {}
    checkpoint = args.checkpoint or Path(tempfile.mkdtemp()) / "checkpoint"
    if not (checkpoint / "config.json").exists():
        test_dppo.write_tiny_checkpoint(checkpoint, **shape, **heads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    flags = ["--dataset", "arithmetic", "--generation_cache", "static", "--max_new_tokens", str(NEW_TOKENS)]
    cfg = dppo.parse_config(["--model", str(checkpoint), *flags])
    model, tokenizer = dppo.load_policy(str(checkpoint), device)
    problems = dppo.arithmetic_problems()["train"][:P]
    cfg = dataclasses.replace(cfg, max_prompt_tokens=dppo.prompt_length_limit(cfg, tokenizer, problems, device))
    prompts = [dppo.format_prompt(tokenizer, p["question"]) for p in problems for _ in range(G)]
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dppo": str(args.dppo),
    }
    result["transformers"] = sys.modules["transformers"].__version__

    def rollout(sampler, label, record_mu=True):
        torch.manual_seed(0)
        started = synchronised_clock()
        if record_mu:
            rolled = dppo.generate_rollout(sampler, tokenizer, prompts, cfg)
            tokens, steps = rolled.completion_mask.sum(), rolled.completion_ids.shape[1]
        else:
            with dppo.autocast(sampler, cfg.precision):
                _, ids, mask = dppo.generate(sampler, tokenizer, prompts, cfg, **dppo.sampling(cfg))
            tokens, steps = mask.sum(), ids.shape[1]
        seconds = synchronised_clock() - started
        timing = dict(seconds=seconds, tokens=int(tokens), decode_steps=int(steps))
        timing |= dict(tokens_per_s=int(tokens) / seconds, ms_per_step=1000 * seconds / int(steps))
        print(f"{label}: {seconds:.2f} s, {timing['tokens_per_s']:.0f} tokens/s, {timing['ms_per_step']:.2f} ms a step")
        return timing

    result["warm-up (compiles)"] = rollout(model, "warm-up (compiles)")
    result["rollout"] = [rollout(model, f"rollout {i}") for i in (1, 2)]
    if args.quick:
        (args.out / f"{args.label}.json").write_text(json.dumps(result, indent=1) + "\n")
        return

    # 2. the split: marks at the compiled forward's start and end, the recorder's start and end, the stop check
    marks = []
    get_compiled_call = type(model).get_compiled_call
    recorder_call = dppo.SamplingRecorder.__call__

    def marked_compiled_call(self, compile_config):
        forward = get_compiled_call(self, compile_config)

        def marked(*args, **kwargs):
            marks.append(("forward", synchronised_clock()))
            outputs = forward(*args, **kwargs)
            marks.append(("forward end", synchronised_clock()))
            return outputs

        return marked

    def marked_recorder(self, input_ids, scores):
        marks.append(("record", synchronised_clock()))
        scores = recorder_call(self, input_ids, scores)
        marks.append(("record end", synchronised_clock()))
        return scores

    sampling = dppo.sampling
    type(model).get_compiled_call = marked_compiled_call
    dppo.SamplingRecorder.__call__ = marked_recorder
    dppo.sampling = lambda c: sampling(c) | {"stopping_criteria": StoppingCriteriaList([EveryStep(stop_mark)])}

    def stop_mark():
        marks.append(("stop check end", synchronised_clock()))

    result["rollout, synchronised at the marks"] = rollout(model, "rollout, synchronised")
    type(model).get_compiled_call = get_compiled_call
    dppo.SamplingRecorder.__call__ = recorder_call
    phase_of = {  # the interval between two marks -> its phase
        ("forward", "forward end"): "forward",
        ("record", "record end"): "recording mu",
        ("record end", "stop check end"): "sampling",
        ("forward end", "record"): "rest",
        ("stop check end", "forward"): "rest",
        ("stop check end", "record"): "forward and rest, uncompiled",  # where generate compiles nothing (a CPU)
    }
    first = next(i for i, (name, _) in enumerate(marks) if name == "stop check end")  # after the prefill's step
    totals, steps = dict.fromkeys(["forward", "recording mu", "sampling", "rest"], 0.0), 0
    for (before, t_before), (after, t_after) in zip(marks[first:], marks[first + 1 :]):
        phase = phase_of.get((before, after), f"other: {before} -> {after}")
        totals[phase] = totals.get(phase, 0.0) + t_after - t_before
        steps += after == "stop check end"
    split = {name: 1000 * total / steps for name, total in totals.items()}
    split["decode steps"] = steps
    result["mean ms per decode step, synchronised"] = split
    print("synchronised split, mean ms per decode step:", {k: round(v, 3) for k, v in split.items()})

    # 3. torch.profiler over 20 decode steps
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    schedule = torch.profiler.schedule(skip_first=PROFILED.start - 5, wait=0, warmup=5, active=len(PROFILED), repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule) as profiler:
        dppo.sampling = lambda c: sampling(c) | {"stopping_criteria": StoppingCriteriaList([EveryStep(profiler.step)])}
        result["rollout, profiled"] = rollout(model, "rollout, profiled")
    dppo.sampling = sampling
    averages = profiler.key_averages()
    for by in ("cuda", "cpu"):
        table = f"no table sorted by {by} time in this torch"
        for key in (f"self_{by}_time_total", "self_device_time_total"):
            try:
                table = averages.table(sort_by=key, row_limit=25, max_name_column_width=70)
                break
            except (AttributeError, KeyError, ValueError):
                continue
        (args.out / f"{args.label}_top_by_{by}.txt").write_text(table)
        print(f"\ntop operations by {by} time over {len(PROFILED)} decode steps:\n{table}")

    def device_us(event):
        for name in ("self_device_time_total", "self_cuda_time_total"):
            if hasattr(event, name):
                return getattr(event, name)
        return 0.0

    busy = sum(device_us(event) for event in averages) / len(PROFILED) / 1000
    result["GPU busy ms per decode step (profiler)"] = busy
    result["CUDA graph launches in the profiled steps"] = sum(e.count for e in averages if "GraphLaunch" in e.key)
    print(f"GPU busy {busy:.2f} ms a decode step; {result['CUDA graph launches in the profiled steps']} graph launches")

    # 4. the bandwidth floor
    size = 2**30 if device.type == "cuda" else 2**24
    source, target = (
        torch.empty(size, dtype=torch.uint8, device=device),
        torch.empty(size, dtype=torch.uint8, device=device),
    )
    target.copy_(source)
    started = synchronised_clock()
    for _ in range(10):
        target.copy_(source)
    bandwidth = 2 * size * 10 / (synchronised_clock() - started)  # bytes read and written per second
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    bf16_weights = sum(p.numel() * 2 for p in model.parameters())
    config, length = model.config, cfg.max_prompt_tokens + NEW_TOKENS
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    kv_per_token = (
        config.num_hidden_layers * kv_heads * head_dim * (4 + 2)
    )  # keys fp32 (RoPE under autocast), values bf16
    mean_fill = cfg.max_prompt_tokens + NEW_TOKENS / 2  # the attention reads the cache up to the current position
    kv_bytes = P * G * kv_per_token * mean_fill
    result["bandwidth floor"] = dict(
        copy_bandwidth_GB_s=bandwidth / 1e9,
        weights_GB_as_held=weights / 1e9,
        weights_GB_bf16=bf16_weights / 1e9,
        kv_cache_GB_mean_read=kv_bytes / 1e9,
        kv_cache_GB_full=P * G * kv_per_token * length / 1e9,
        floor_ms_as_held=1000 * (weights + bf16_weights + kv_bytes) / bandwidth,  # read fp32, write and read bf16
        floor_ms_bf16_copy=1000 * (bf16_weights + kv_bytes) / bandwidth,
    )
    print("bandwidth floor:", {k: round(v, 3) for k, v in result["bandwidth floor"].items()})

    # 5. variants
    if args.variants:
        result["rollout without recording mu"] = rollout(model, "without recording mu", record_mu=False)
        bf16 = dppo.make_sampler(model, "bfloat16")
        rollout(bf16, "bf16 sampler copy, warm-up (compiles)")
        result["rollout, bf16 sampler copy"] = rollout(bf16, "bf16 sampler copy")
        result["rollout, recorder compiled"] = compiled_recorder_variant(dppo, rollout, model, tokenizer, prompts, cfg)
    if device.type == "cuda":
        result["peak memory GiB"] = torch.cuda.max_memory_allocated() / 2**30
    (args.out / f"{args.label}.json").write_text(json.dumps(result, indent=1) + "\n")


def compiled_recorder_variant(dppo, rollout, model, tokenizer, prompts, cfg):
    """The recorder's per-step reductions over the vocabulary in one compiled function (fewer kernels and launches a
    step); timed as a whole rollout, then the same rollout recorded both ways and compared."""

    def summary(scores, temperature: float, k: int):
        logits = scores.float() / temperature
        log_normaliser = logits.logsumexp(-1)
        top_logits, top_ids = logits.topk(k, dim=-1)
        entropy = log_normaliser - ((logits - log_normaliser[:, None]).exp() * logits).sum(-1)
        return log_normaliser, top_logits - log_normaliser[:, None], top_ids, entropy

    compiled = torch.compile(summary, dynamic=False)
    plain_call = dppo.SamplingRecorder.__call__

    def compiled_call(self, input_ids, scores):
        if self.pending is not None:
            self.record_sampled_token(input_ids[:, -1])
        log_normaliser, top_logp, top_ids, entropy = compiled(scores, self.temperature, min(self.k, scores.shape[-1]))
        self.topk_ids.append(top_ids)
        self.topk_logp_mu.append(top_logp)
        self.entropy_mu.append(entropy)
        self.pending = (scores, log_normaliser)
        return scores

    def recorded(call):
        dppo.SamplingRecorder.__call__ = call
        torch.manual_seed(0)
        try:
            return dppo.generate_rollout(model, tokenizer, prompts, cfg)
        finally:
            dppo.SamplingRecorder.__call__ = plain_call

    dppo.SamplingRecorder.__call__ = compiled_call
    try:
        rollout(model, "recorder compiled, warm-up (compiles)")
        timing = rollout(model, "recorder compiled")
    finally:
        dppo.SamplingRecorder.__call__ = plain_call
    plain, fused = recorded(plain_call), recorded(compiled_call)
    timing["same completions"] = bool(torch.equal(plain.completion_ids, fused.completion_ids))
    timing["same top-K ids"] = bool(torch.equal(plain.topk_ids, fused.topk_ids))
    for name in ("logp", "topk_logp", "entropy"):
        difference = (getattr(plain.mu, name) - getattr(fused.mu, name)).abs().max()
        timing[f"max |{name} difference|"] = float(difference)
    print(
        "recorder compiled against plain, same rollout:", {k: v for k, v in timing.items() if "|" in k or "same" in k}
    )
    return timing


if __name__ == "__main__":
    main()
