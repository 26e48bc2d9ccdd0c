"""Tests for dppo.py and rewards.py. Run: HF_HUB_OFFLINE=1 pytest -q test_dppo.py

The math tests use hand-built tensors and hand-computed numbers; the model tests use a tiny random
Qwen2 written with save_pretrained and loaded back by path, as a user's checkpoint would be.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never wait on the Hub
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import dppo
from rewards import extract_answer, extract_gold, reward

HERE = Path(__file__).parent


# ---------------------------------------------------------------------------- rewards

@pytest.mark.parametrize("answer_field, gold", [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72", "72"),
    ("He earns $36 * 30 = $<<36*30=1080>>1080.\n#### 1,080", "1,080"),
    ("The largest number is <<-47=-47>>-47.\n#### -47", "-47"),
    ("Total: 2,100*1,200 = <<2100*1200=2520000>>2,520,000 pixels\n#### 2,520,000", "2,520,000"),
    ("#### 3 apples... no wait\n#### 5", "5"),  # the last '####' wins
])
def test_extract_gold_reads_the_last_hashes_line(answer_field, gold):
    assert extract_gold(answer_field) == gold


@pytest.mark.parametrize("completion, answer", [
    ("so the total is \\boxed{1,234}.", "1,234"),
    ("first \\boxed{3}, then correcting: \\boxed{4}", "4"),
    ("\\boxed{\\frac{1}{2}} is the answer", "\\frac{1}{2}"),  # nested braces are matched
    ("\\boxed{7} and a stray \\boxed{8", "7"),  # the last *closed* box
    ("<answer> 7 </answer>", "7"),
    ("<answer>3</answer> and later <answer>9</answer>", "9"),
    ("48/2 = 24\n#### 72 clips", "72"),
    ("It costs $18.00 in total.", "18.00"),
    ("I have 3 apples and 4 pears", "4"),
    ("no number here at all", None),
    ("", None),
])
def test_extract_answer_table(completion, answer):
    assert extract_answer(completion) == answer


@pytest.mark.parametrize("completion, gold, expected", [
    ("\\boxed{1,234}", "1234", 1.0),
    ("The answer is $18.00.", "18", 1.0),
    ("#### 18.", "18", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("<answer> 7 </answer>", "7", 1.0),
    ("so 5 - 12 = -7\n#### -7", "-7", 1.0),
    ("#### 2,520,000", "2,520,000", 1.0),
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("#### 118", "18", 0.0),  # no substring credit
    ("#### 1.8", "18", 0.0),
    ("\\boxed{-18}", "18", 0.0),
    ("The answer is 18, no wait, 19", "18", 0.0),  # the last number counts
    ("no number", "18", 0.0),
    ("", "18", 0.0),
    ("\\boxed{}", "18", 0.0),
])
def test_reward_table(completion, gold, expected):
    assert reward(completion, gold) == expected


@pytest.mark.parametrize("completion", [
    "{" * 50_000 + "}" * 50_000,
    "\\boxed{" * 14_000,
    "1," * 50_000,
    "#### " * 20_000,
    "<answer>" * 10_000 + "</answer>",
    "9" * 100_000,
    "\\boxed{" + "9" * 99_990 + "}",
    "".join(chr(i) for i in range(0x20, 0x3000)) * 8,
])
def test_reward_never_raises_and_is_fast_on_huge_strings(completion):
    started = time.perf_counter()
    assert reward(completion, "18") in (0.0, 1.0)
    extract_answer(completion)
    assert time.perf_counter() - started < 0.5


# ---------------------------------------------------------------------------- a tiny checkpoint on disk

def write_tiny_checkpoint(path: Path, vocab_size=300, seed=0) -> Path:
    """A random 2-layer Qwen2 with a byte-level BPE tokenizer, written with save_pretrained."""
    corpus = [f"Question: {p['question']}\nAnswer: {p['answer']}"
              for p in dppo.arithmetic_problems(n_warmup=300, n_test=0, n_train=0)["warmup"]]
    tokenizer = dppo.train_tokenizer(corpus, vocab_size)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_policy(tiny_checkpoint):
    return dppo.load_policy(str(tiny_checkpoint), torch.device("cpu"))


def config(**overrides) -> dppo.Config:
    return dataclasses.replace(dppo.parse_config([]), **overrides)


def teacher_forced_logp(model, rollout, temperature):
    """log_softmax(logits / T) over the full vocabulary at every completion position: the plain way."""
    input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attention_mask = torch.cat([rollout.prompt_mask, torch.ones_like(rollout.completion_ids)], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    T = rollout.completion_ids.shape[1]
    return torch.log_softmax(logits[:, -T - 1 : -1].float() / temperature, dim=-1)


def sample(policy, temperature, topk, n=6, max_new_tokens=12):
    model, tokenizer = policy
    prompts = [dppo.format_prompt(tokenizer, q) for q in ["Ann has 3 pens.", "How many?", "There are 7 rows of 4 eggs."]]
    torch.manual_seed(1)
    cfg = config(temperature=temperature, topk=topk, max_new_tokens=max_new_tokens)
    return dppo.generate_rollout(model, tokenizer, [p for p in prompts for _ in range(n // 3)], cfg)


def test_prompts_use_the_chat_template_when_there_is_one():
    tokenizer = dppo.train_tokenizer(["a few words"], vocab_size=260)
    assert dppo.format_prompt(tokenizer, "What is 2+3?") == "Question: What is 2+3?\nAnswer:"
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert dppo.format_prompt(tokenizer, "What is 2+3?") == (
        "<|im_start|>user\nWhat is 2+3?\nPlease reason step by step, and put your final answer within \\boxed{}."
        "<|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------------------- rollout: what is recorded about mu

@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_recorded_mu_equals_teacher_forced_softmax_over_temperature(tiny_policy, temperature):
    rollout = sample(tiny_policy, temperature, topk=5)
    logp = teacher_forced_logp(tiny_policy[0], rollout, temperature)
    m = rollout.completion_mask.bool()
    sampled = logp.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    assert (rollout.logp_mu - sampled)[m].abs().max() <= 1e-4
    assert (rollout.topk_logp_mu - logp.gather(-1, rollout.topk_ids))[m].abs().max() <= 1e-4
    entropy = -(logp.exp() * logp).sum(-1)
    assert (rollout.entropy_mu - entropy)[m].abs().max() <= 1e-4


def test_sampled_token_is_always_in_the_recorded_topk(tiny_policy):
    # A hot temperature over a random model: the sampled token usually ranks far below K = 3.
    rollout = sample(tiny_policy, temperature=3.0, topk=3, n=12)
    logp = teacher_forced_logp(tiny_policy[0], rollout, 3.0)
    m = rollout.completion_mask.bool()
    in_set = (rollout.topk_ids == rollout.completion_ids.unsqueeze(-1)).any(-1)
    assert in_set[m].all()
    true_top = logp.topk(3, dim=-1).indices
    evicted = (true_top != rollout.completion_ids.unsqueeze(-1)).all(-1) & m
    assert evicted.sum() >= 10  # the rule was exercised
    # The sampled token takes the K-th slot; the K-1 most probable tokens stay where they were.
    assert torch.equal(rollout.topk_ids[evicted][:, 2], rollout.completion_ids[evicted])
    assert torch.equal(rollout.topk_ids[evicted][:, :2], true_top[evicted][:, :2])
    assert torch.equal(rollout.topk_ids[~evicted & m], true_top[~evicted & m])


def test_completion_mask_includes_the_first_eos_and_nothing_after():
    eos_ids = [5, 7]
    ids = torch.tensor([[1, 5, 2, 5], [1, 2, 3, 4], [7, 0, 0, 0], [3, 7, 5, 0]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]).float()
    assert torch.equal(dppo.completion_mask(ids, eos_ids), expected)


# ---------------------------------------------------------------------------- advantages and objective

def test_grpo_advantages_on_a_hand_made_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # group 1: mean 0.5, Bessel std sqrt((4 * 0.25) / 3) = 0.57735; group 2: all equal -> 0
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (math.sqrt(1 / 3) + 1e-6)
    assert torch.allclose(dppo.grpo_advantages(rewards, 4), torch.cat([expected, torch.zeros(4)]))
    centred = dppo.grpo_advantages(rewards, 4, scale_rewards="none")
    assert torch.equal(centred, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


# (A, r, loss, d loss / d log pi, clip binds) with eps_low 0.2, eps_high 0.28, dual clip c = 10
PPO_CASES = [
    (+1.0, 1.10, -1.10, -1.10, False),  # inside [0.8, 1.28]: gradient -A*r
    (+1.0, 1.50, -1.28, 0.0, True),     # A > 0 above 1 + eps_high: clipped, no gradient
    (+1.0, 0.50, -0.50, -0.50, False),  # A > 0 below 1 - eps_low: never clipped (moving back up)
    (-1.0, 0.50, 0.80, 0.0, True),      # A < 0 below 1 - eps_low: clipped, no gradient
    (-1.0, 1.50, 1.50, 1.50, False),    # A < 0 above 1 + eps_high: not clipped (moving back down)
    (-1.0, 20.0, 10.0, 0.0, True),      # A < 0, r > c: dual clip caps the loss at -A*c
    (-2.0, 0.90, 1.80, 1.80, False),    # inside, |A| = 2
    (0.0, 1.50, 0.0, 0.0, False),       # A = 0: nothing to learn
]


def test_ppo_clip_loss_and_gradient_on_hand_built_tensors():
    A, r, loss, grad, binds = (torch.tensor(column) for column in zip(*PPO_CASES))
    logp_mu = torch.full_like(r, -2.0)
    logp = (logp_mu + r.log()).requires_grad_()
    out, clipped = dppo.ppo_clip_loss(logp, logp_mu, A, clip_low=0.2, clip_high=0.28, dual_clip=10.0)
    out.sum().backward()
    assert torch.allclose(out, loss, atol=1e-5)
    assert torch.allclose(logp.grad, grad, atol=1e-5)
    assert torch.equal(clipped, binds)


# ---------------------------------------------------------------------------- aggregation and micro-batching

def test_token_weights_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert torch.allclose(dppo.token_weights(mask, "token_mean"), mask / 5)
    assert torch.allclose(dppo.token_weights(mask, "seq_mean_token_mean"),
                          torch.tensor([[1 / 4, 1 / 4, 0], [1 / 6, 1 / 6, 1 / 6]]))
    assert torch.allclose(dppo.token_weights(mask, "seq_sum"), mask / 2)


def hand_built_rollout(vocab_size, seed=0) -> tuple[dppo.Rollout, torch.Tensor]:
    """8 completions of different lengths after left-padded prompts of different lengths."""
    g = torch.Generator().manual_seed(seed)
    B, Lp, T, K = 8, 5, 6, 3
    prompt_mask = (torch.arange(Lp) >= torch.tensor([0, 2, 1, 3, 0, 4, 2, 1])[:, None]).long()
    completion_mask = (torch.arange(T) < torch.tensor([6, 3, 1, 5, 2, 6, 4, 3])[:, None]).float()
    rollout = dppo.Rollout(
        prompt_ids=torch.randint(2, vocab_size, (B, Lp), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        completion_ids=torch.randint(2, vocab_size, (B, T), generator=g),
        completion_mask=completion_mask,
        logp_mu=-math.log(vocab_size) + 0.3 * torch.randn(B, T, generator=g),  # some ratios leave the clip range
        topk_ids=torch.zeros(B, T, K, dtype=torch.long), topk_logp_mu=torch.zeros(B, T, K),
        entropy_mu=torch.zeros(B, T), texts=[""] * B)
    return rollout, torch.randn(B, generator=g)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "seq_sum"])
def test_gradient_is_the_same_for_1_or_4_micro_batches(tiny_policy, loss_agg):
    model = tiny_policy[0]
    rollout, advantages = hand_built_rollout(model.config.vocab_size)
    gradients = []
    for micro_batch_size in (8, 2):
        model.zero_grad()
        sums = dppo.accumulate_gradient(model, rollout, advantages, config(loss_agg=loss_agg, micro_batch_size=micro_batch_size))
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert sums["tokens"] == 30 and sums["clipped_pos"] + sums["clipped_neg"] > 0
    assert gradients[0].abs().max() > 1e-4
    assert torch.allclose(gradients[0], gradients[1], atol=1e-6, rtol=1e-4)
    model.zero_grad()


# ---------------------------------------------------------------------------- end to end

@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> str:
    """The built-in demo model, built once for the test session (about 20 s)."""
    cache = str(tmp_path_factory.mktemp("dppo-cache"))
    dppo.build_tiny_model(cache)
    return cache


def test_two_training_steps_on_a_checkpoint_loaded_by_path(demo_cache, tmp_path):
    # The demo model is a save_pretrained directory that solves some problems, so advantages are non-zero.
    checkpoint = dppo.build_tiny_model(demo_cache)
    problems = dppo.arithmetic_problems()["test"][:40]
    dataset = tmp_path / "problems.jsonl"
    dataset.write_text("".join(json.dumps(p) + "\n" for p in problems))
    out = tmp_path / "run"
    dppo.main(["--model", checkpoint, "--dataset", str(dataset), "--steps", "2", "--prompts_per_step", "4",
               "--samples_per_prompt", "4", "--max_new_tokens", "16", "--updates_per_step", "2",
               "--micro_batch_size", "3", "--learning_rate", "1e-3", "--eval_n", "8", "--eval_every", "1",
               "--output_dir", str(out)])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/accuracy" in r]
    steps = [r for r in records if "eval/accuracy" not in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and all(0 <= r["eval/accuracy"] <= 1 for r in evals)
    assert [r["step"] for r in steps] == [1, 2]
    expected = {"reward/mean", "reward/zero_spread_groups", "completion/length_mean", "completion/truncated",
                "policy/entropy_mu", "loss", "grad_norm", "clip/frac", "clip/frac_pos_adv", "clip/frac_neg_adv",
                "policy/abs_pi_minus_mu_mean", "policy/abs_pi_minus_mu_max", "time/rollout_s", "time/update_s"}
    assert expected <= set(steps[0]) and all(math.isfinite(v) for v in steps[0].values())
    assert any(r["reward/mean"] > 0 for r in steps)
    before = Qwen2ForCausalLM.from_pretrained(checkpoint).state_dict()
    after = Qwen2ForCausalLM.from_pretrained(out).state_dict()
    assert any(not torch.equal(before[name], after[name]) for name in before)


def test_demo_model_stops_at_eos_and_the_mask_ends_there(demo_cache):
    model, tokenizer = dppo.load_policy(dppo.build_tiny_model(demo_cache), torch.device("cpu"))
    problems = dppo.arithmetic_problems()["test"][:16]
    torch.manual_seed(0)
    rollout = dppo.generate_rollout(model, tokenizer, [dppo.format_prompt(tokenizer, p["question"]) for p in problems],
                                    config(max_new_tokens=16))
    eos = tokenizer.eos_token_id
    ended = [eos in row for row in rollout.completion_ids.tolist()]
    assert sum(ended) >= 12  # the warmed-up model answers and stops
    for row, mask in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist()):
        length = row.index(eos) + 1 if eos in row else len(row)
        assert mask == [1.0] * length + [0.0] * (len(row) - length)
        assert all(token == tokenizer.pad_token_id for token in row[length:])


def test_the_demo_learns(demo_cache, tmp_path):
    result = dppo.main(["--cache_dir", demo_cache, "--steps", "40", "--eval_every", "40", "--output_dir", str(tmp_path)])
    assert result["final_accuracy"] >= result["initial_accuracy"] + 0.08


# ---------------------------------------------------------------------------- command line

def test_demo_defaults_apply_only_without_a_model_and_never_over_a_typed_flag():
    assert dppo.parse_config([]).dataset == "arithmetic"
    assert dppo.parse_config([]).learning_rate == 1e-4
    assert dppo.parse_config(["--learning_rate", "3e-4"]).learning_rate == 3e-4
    assert dppo.parse_config(["--model", "Qwen/Qwen2.5-0.5B-Instruct"]).dataset == "gsm8k"
    assert dppo.parse_config(["--model", "Qwen/Qwen2.5-0.5B-Instruct"]).learning_rate == 1e-6
    with pytest.raises(SystemExit):
        dppo.parse_config(["--objective", "no_such_objective"])


def test_help_exits_zero():
    result = subprocess.run([sys.executable, str(HERE / "dppo.py"), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "--objective" in result.stdout
