"""dppo.py: RL post-training of a language model under a trust region, in one file.

It implements DPPO (Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879)
and the objectives that the paper compares it to.

    python dppo.py                                     # offline demo: a tiny model learns arithmetic by DPPO
    python dppo.py --objective ppo_clip                # the same under PPO's clip, the baseline
    python dppo.py --model Qwen/Qwen2.5-0.5B-Instruct  # GSM8K on one GPU
    torchrun --nproc_per_node 8 dppo.py --model Qwen/Qwen2.5-1.5B-Instruct  # 8 GPUs, FSDP2 sharding

The names are the paper's:
  - mu is the sampler's distribution, recorded while sampling. pi is the policy being trained.
  - a_t is the token sampled at position t of a completion, and s_t is the text before it.
  - r = pi(a_t) / mu(a_t) is the probability ratio of a token. A is the advantage of the token's completion.
  - The anchor is the distribution that the trust region measures from: mu as sampled. Under --recompute_old
    (the paper's ablation), the anchor is pi_old, the policy before the step's first update.
  - A rollout holds B = P x G completions of at most T tokens: G completions of each of P prompts.
  - The update makes E passes over a rollout (--ppo_epochs). Each pass has U mini-batches
    (--updates_per_step), and each mini-batch is one AdamW step.
  - tau is the sampling temperature. K is the number of mu's most probable tokens that are recorded.
  - C is a cap on r. k is the age of a rollout in steps (--staleness).
  - sg(x) is x with its gradient stopped (stop-gradient).

What DPPO changes. PPO clips r to [1 - eps, 1 + eps]. The clip lets the probability of a token move by
at most eps * mu(a_t), which is next to nothing for a rare token. DPPO instead bounds a divergence D
between mu and pi by delta. It removes the gradient of a token only where the update moves the token
away from mu past delta. This is eq. 11's mask M, used in eq. 12:
    M = 0  iff  A * (r - 1) > 0  and  D > delta          (for example D = |pi(a_t) - mu(a_t)|)
    loss_t = -A * sg(r) * M * log pi(a_t)
The paper argues that the clip's cuts fall mostly on rare tokens. RARE_TOKEN_MU is where dppo.py
measures that.

The algorithm, with the definitions that do each part:

    for step in 1 .. steps:                                           train
        one RL step:                                                  rl_step
        sample P prompts x G completions, recording log mu(a_t)       generate_rollout,
          and mu's top K                                              SamplingRecorder
        reward 1 for the right final answer, else 0                   score, rewards.py
        advantages per group of G completions                         step_advantages, grpo_advantages
        [--staleness k] queue the rollout, and train on the one       rl_step
          sampled k steps ago
        the anchor is mu as sampled                                   rl_step
          [--recompute_old] pi_old, with a correction                 recompute_anchor
        E passes of U mini-batches, one AdamW step each:              rl_step
          each token's weight in the mini-batch's loss                token_weights
          per micro-batch: log pi from one teacher-forced pass        policy_logprobs
                           loss_t from log pi, the anchor and A       objective_loss
                             pg_loss | ppo_clip_loss
                             | dppo_loss with D = binary_tv | binary_kl | topk_tv | topk_kl
                             | the neighbours (after the training loop)
        every eval_every steps: greedy held-out accuracy              evaluate

Simplifications:
  - The trust region is anchored to mu as sampled, as DPPO prescribes. The top-K divergences use mu's
    top-K ids. --recompute_old anchors the trust region to pi_old instead, and a weight on pi_old / mu
    keeps the ratio against mu. This is the paper's ablation.
  - The rewards are binary. There is no KL penalty to a reference model, no entropy bonus and no value
    function.
  - No tensor of B x T x V logits is ever made, where V is the vocabulary's size. mu is recorded one
    step at a time while sampling, and pi's output layer runs on a chunk of positions at a time.
  - On CUDA, the forward passes run in bf16 over fp32 weights, and AdamW runs in fp32. On a CPU,
    everything is fp32. Log-probs, ratios and losses are always fp32.
  - Under torchrun, FSDP2 shards the model. Each process runs the loop on its share of a step, and
    gathers the whole model to generate.
  - There is no vLLM. Hugging Face's `generate` samples from the policy. With --sampler_dtype, it
    samples from a copy of the policy in another dtype, refreshed every step, as an inference engine's
    copy would be.
"""

import argparse
import collections
import contextlib
import copy
import dataclasses
import functools
import gc
import importlib.util
import json
import math
import os
import pickle
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple, Optional

import huggingface_hub.constants
import huggingface_hub.utils
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor
from transformers import DynamicCache
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedTokenizerFast
from transformers import Qwen2Config, StaticCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from rewards import extract_answer, extract_gold, reward

# ============================================================================ config

OBJECTIVES = "pg ppo_clip dcpo erc cispo gspo binary_tv binary_kl topk_tv topk_kl drpo cppo ipo".split()


def setting(default, help, choices=""):
    """A Config field that is also a command-line flag. choices is one string of words: "a b c"."""
    return dataclasses.field(default=default, metadata=dict(help=help, choices=choices.split() or None))


@dataclasses.dataclass
class Config:
    # -------- what is trained, on what
    model: str = setting("", "a causal LM's Hub id, directory or GGUF file; empty: the demo's tiny model")
    dataset: str = setting("gsm8k", "gsm8k, a Hub dataset, arithmetic (the demo's), a JSONL file or directory")
    objective: str = setting(
        "binary_tv", "binary_* and topk_* are DPPO's; ppo_clip is its baseline", " ".join(OBJECTIVES)
    )
    # -------- sampling: the rollout and mu
    prompts_per_step: int = setting(32, "P: prompts per rollout")
    samples_per_prompt: int = setting(8, "G: completions per prompt (the GRPO group)")
    max_new_tokens: int = setting(512, "completion length limit; longer completions are cut")
    temperature: float = setting(1.0, "sampling temperature tau; pi's logits are divided by the same tau")
    topk: int = setting(20, "K: how many of mu's most probable tokens are recorded per position")
    sampler_dtype: str = setting("policy", "sample from a copy in this dtype", "policy float32 bfloat16 float16")
    # -------- advantages, and how the loss is aggregated
    scale_rewards: str = setting("group", "GRPO: divide by the group's std, or not (Dr. GRPO)", "group none")
    loss_agg: str = setting("token_mean", "see token_weights", "token_mean seq_mean_token_mean seq_sum seq_sum_norm")
    skip_zero_advantage: bool = setting(False, "leave completions with A = 0 out of the loss's normaliser")
    truncated_reward: str = setting("keep", "a completion cut at the limit scores as usual, or 0", "keep zero")
    overlong_filter: bool = setting(False, "DAPO's overlong filter: completions cut at the limit leave the loss")
    # -------- the objectives' thresholds
    clip_low: float = setting(0.2, "ppo_clip, erc, gspo: r clipped at 1 - clip_low; cispo, dcpo: eps_low")
    clip_high: float = setting(0.28, "ppo_clip, erc, gspo: r clipped at 1 + clip_high; cispo, dcpo: eps_high")
    relax_clip: str = setting("none", "ppo_clip: the bounds that rare tokens escape", "none high low both")
    relax_below: float = setting(0.1, "ppo_clip, --relax_clip: alpha; a token escapes where anchor(a_t) < alpha")
    dual_clip: float = setting(10.0, "ppo_clip, dcpo, erc: dual-clip constant c; for A < 0, loss <= -A * c")
    delta_low: float = setting(0.15, "DPPO: blocks a token where A < 0, pi(a_t) falls and D > delta_low")
    delta_high: float = setting(0.15, "DPPO: blocks a token where A > 0, pi(a_t) rises and D > delta_high")
    is_cap: float = setting(math.inf, "pg, DPPO, cppo: cap C on the importance weight min(r, C); inf: none")
    # -------- training
    steps: int = setting(200, "RL steps, each one rollout and its updates")
    epochs: int = setting(0, "if > 0: passes over the training set; they set the number of steps, not --steps")
    updates_per_step: int = setting(4, "U: mini-batches per pass over a rollout, one optimizer step each")
    ppo_epochs: int = setting(1, "E: passes over each rollout, each shuffled into U mini-batches (verl's name)")
    staleness: int = setting(
        0, "k: train on rollouts k steps old; the last k steps sample none (--steps shapes the run; --resume refills)"
    )
    micro_batch_size: int = setting(8, "completions per forward and backward; gradients add up over a mini-batch")
    learning_rate: float = setting(1e-6, "AdamW learning rate")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    max_grad_norm: float = setting(1.0, "gradient-norm clipping per optimizer step")
    seed: int = setting(0, "seed for data order, sampling and initialisation")
    # -------- evaluation
    eval_every: int = setting(20, "greedy held-out accuracy before training, every this many steps, and after")
    eval_n: int = setting(200, "held-out problems per evaluation")
    eval_batch_size: int = setting(64, "prompts per evaluation generate call")
    eval_samples: int = setting(0, "k > 0: also avg@k and pass@k of k samples a problem at --temperature")
    # -------- plumbing: memory, speed, files
    gradient_checkpointing: bool = setting(False, "recompute layers in backward: less memory, ~1 more forward")
    precision: str = setting("auto", "forward-pass dtype; auto: bf16 on CUDA", "auto bf16 fp32")
    generation_cache: str = setting(
        "auto", "KV cache: grown a token at a time, or allocated once; auto: static on CUDA", "auto dynamic static"
    )
    max_prompt_tokens: int = setting(0, "longer prompts are refused; static pads to it (0: longest, to 64s)")
    device: str = setting("auto", "auto (CUDA if available, else CPU), cuda, cpu, ...")
    output_dir: str = setting(
        "", "metrics.jsonl and the model go here; empty: --resume's, or runs/<objective>-seed<seed>"
    )
    save_every: int = setting(0, "save <output_dir>/checkpoint every this many steps; 0: only on Ctrl-C")
    report_to: str = setting("none", "also send the metrics to a tracker", "none wandb tensorboard trackio")
    resume: str = setting("", "continue the run in this output_dir from its checkpoint (same other flags)")
    overwrite_output_dir: bool = setting(False, "start over in an --output_dir that holds metrics.jsonl")
    cache_dir: str = setting("~/.cache/dppo", "where the built-in tiny model is built once and reused")
    # -------- the neighbours' and the ablation's own flags (see them after the training loop)
    advantage: str = setting("grpo", "GRPO's group standardisation, or DCPO's smooth one", "grpo sas")
    dcpo_r_max: float = setting(10.0, "dcpo: the cap r_max on its upper ratio bound")
    erc_beta_low: float = setting(0.05, "erc: a token keeps its gradient only if its entropy ratio > 1 - beta_low")
    erc_beta_high: float = setting(0.05, "erc: ... and < 1 + beta_high")
    drpo_delta: float = setting(12.5, "drpo: its penalty's delta; a token's gradient weight is 1 -+ D / delta")
    cppo_delta: float = setting(0.15, "cppo: delta, the most a token's position-weighted |pi - mu| may move")
    cppo_w_min: float = setting(0.8, "cppo: position weight of a completion's last token (1 at its first)")
    cppo_delta_b_min: float = setting(0.02, "cppo: delta_b, the budget per token, is in [delta_b_min, 2 delta_b_min]")
    ipo_eps: float = setting(0.3, "ipo: blocks a token where |pi - mu| > eps, whatever A and its direction")
    ipo_kl_tau: float = setting(0.0, "ipo: tau in its KL term tau * (log r)^2 on every completion token")
    recompute_old: bool = setting(False, "anchor the trust region to a recomputed pi_old, not to mu (DPPO's ablation)")
    rollout_correction: str = setting(
        "tis", "--recompute_old: the weight on w = pi_old / mu", "tis token_mis seq_mis none"
    )
    correction_cap: float = setting(2.0, "tis, seq_mis: the cap on w (verl's rollout_is_threshold)")
    correction_low: float = setting(0.5, "token_mis, seq_mis: the lower bound on w (verl's IcePop)")
    correction_high: float = setting(5.0, "token_mis, seq_mis: the upper bound on w (verl's IcePop)")


# Some methods have defaults of their own. DCPO (arXiv 2509.02333) uses SAS advantages and its "only
# token mean" aggregation. DPPO's KL variants use a smaller delta.
OBJECTIVE_DEFAULTS = {
    "dcpo": dict(advantage="sas", loss_agg="seq_sum"),
    "cispo": dict(clip_low=1.0, clip_high=4.0),  # no lower bound (MiniMax-M1), and a cap of 5 (ScaleRL)
    "gspo": dict(clip_low=3e-4, clip_high=4e-4, loss_agg="seq_mean_token_mean"),  # the GSPO paper's
    "binary_kl": dict(delta_low=0.05, delta_high=0.05),
    "topk_kl": dict(delta_low=0.05, delta_high=0.05),
}


@contextlib.contextmanager
def timed(phase: str):
    """The time spent inside this block counts towards the step's phase `phase`, in train's metrics.

    The block's peak memory counts towards the phase too (see STEP_CLOCK)."""
    reset_peak_memory(STEP_CLOCK.device)
    started = time.time()
    yield
    seconds, peak = STEP_CLOCK.get(phase, (0.0, 0.0))
    STEP_CLOCK[phase] = (seconds + time.time() - started, max(peak, peak_memory_mb(STEP_CLOCK.device)))


# ============================================================================ one RL step


class Sampled(NamedTuple):
    """A rollout with its rewards and advantages, queued until a step trains on it.

    Under torchrun, each process holds its own share of the rollout."""

    rollout: "Rollout"
    rewards: torch.Tensor  # (B,) 1 for a right final answer, else 0
    advantages: torch.Tensor  # (B,)
    sampled_at: int  # the step that sampled it, with the policy as the step before it left it


def rl_step(step: int, model, sampler, tokenizer, optimizer, problems, run: "Run", cfg: Config) -> dict:
    """One RL step: sample and reward a rollout, anchor the trust region, update pi, and return the metrics.

    A rollout is B = P x G completions, G of each of P prompts. The update makes E passes over the
    rollout. Each pass shuffles the rollout into U mini-batches, and each mini-batch is one AdamW step.
    The completions of a mini-batch go through the model one micro-batch at a time, and their gradients
    add up. A completion with A = 0 has no gradient (IPO's KL term aside), so the update skips it."""
    # The sampler gets pi's weights. When the sampler is pi itself, there is nothing to do.
    refresh_sampler(sampler, model)

    # Sample this step's rollout and record mu. With --staleness k, sampling runs k steps ahead, so that the
    # queue holds k + 1 rollouts.
    while len(run.queue) < cfg.staleness + 1:
        # trained_at is the step that will train on this rollout, and whose prompts the rollout takes.
        trained_at = step + len(run.queue)
        if trained_at > run.last_step:  # --staleness k: the last k steps sample none
            break
        with timed("rollout"):
            indices = problem_batch(len(problems), cfg.prompts_per_step, cfg.seed, trained_at)
            asked = []  # each of this process's problems, G times in a row
            for i in this_process_share(indices):
                asked += [problems[i]] * cfg.samples_per_prompt
            prompts = [format_prompt(tokenizer, problem["question"]) for problem in asked]
            rollout = generate_rollout(sampler, tokenizer, prompts, cfg)
            rewards = score(rollout, asked, cfg.truncated_reward)
            advantages = step_advantages(rewards, indices, run.reward_history, cfg)
        run.queue.append(Sampled(rollout, rewards, advantages, sampled_at=step))
    # Train on the oldest rollout: this step's own, or under --staleness k, the one sampled k steps ago.
    sampled = run.queue.popleft()
    rollout = sampled.rollout
    measured = UpdateMetrics(cfg)  # the update's diagnostics, for metrics.jsonl

    with timed("update"):
        # The anchor is what the trust region measures from: mu as sampled, as DPPO prescribes. The
        # correction is a weight on each token's loss: 1, unless --recompute_old corrects pi_old to mu.
        anchor = rollout.mu
        correction = torch.ones_like(rollout.completion_mask)
        # Under --recompute_old (the paper's ablation), the anchor is pi_old, and a weight corrects it to mu.
        if cfg.recompute_old:
            anchor, correction = recompute_anchor(model, rollout, sampled.advantages, cfg, measured)

        # Each token of a completion carries the completion's advantage. Under --overlong_filter, the
        # completions that were cut at the length limit get A = 0.
        if cfg.overlong_filter:
            kept = ~rollout.truncated[:, None]
        else:
            kept = torch.ones_like(rollout.truncated[:, None])
        A = sampled.advantages.to(model.device)[:, None] * kept  # (B, 1)
        # The tokens that the loss averages over. --skip_zero_advantage leaves out completions with A = 0.
        counted = rollout.completion_mask * kept
        if cfg.skip_zero_advantage:
            counted = counted * (A != 0)
        moving = moves_pi(A[:, 0], cfg)  # the completions whose loss has a gradient: only these are computed

        needs = objective_needs(cfg.objective)  # what the objective reads besides log pi(a_t)
        model.train()  # --gradient_checkpointing acts only in train mode (dropout is off, see load_policy)
        update = 0  # the optimizer steps taken so far in this RL step
        for epoch in range(cfg.ppo_epochs):
            order = torch.randperm(len(A))  # each pass shuffles the rollout anew
            for minibatch in order.chunk(cfg.updates_per_step):
                # Each token's weight in the mini-batch's loss. The loss averages over the whole mini-batch,
                # on every process, whatever its micro-batches: token_weights divides by those counts.
                local_counts = token_counts(counted[minibatch])
                counts = all_reduced(local_counts)
                # weights covers the whole rollout, because the micro-batches below index it by row.
                weights = torch.zeros_like(correction)  # (B, T)
                shares = token_weights(counted[minibatch], cfg.loss_agg, counts, cfg.max_new_tokens)
                weights[minibatch] = shares * correction[minibatch]

                optimizer.zero_grad(set_to_none=True)
                # Micro-batches of the rows that move pi. Every process runs as many micro-batches as the
                # busiest one, because FSDP2's collectives need equal counts.
                micro_batches, left_out = rows_that_move_pi(minibatch, moving, cfg.micro_batch_size)
                for rows in micro_batches:
                    batch = rollout.select(rows)  # these rows, without their all-padding columns
                    width = batch.completion_ids.shape[1]
                    anchored = anchor.select(rows, width)
                    pi = policy_logprobs(model, batch, cfg.temperature, cfg.precision, **needs)
                    token_loss, blocked = objective_loss(cfg, pi, anchored, A[rows], batch.completion_mask)
                    loss = (token_loss * weights[rows, :width]).sum()
                    loss.backward()
                    measured.add_micro_batch(update, loss, batch, pi, anchored, A[rows], blocked)

                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                # On a non-finite gradient norm, add_update raises FloatingPointError before this optimizer
                # step: train then saves the model and stops the run.
                measured.add_update(update, grad_norm, rollout, left_out)
                optimizer.step()
                update += 1
        # generate() must run in eval mode: in train mode, gradient checkpointing turns off its KV cache.
        model.eval()

    return step_metrics(step, sampled, STEP_CLOCK, model, cfg) | measured.metrics()


# ============================================================================ sampling and recording mu


class LogProbs(NamedTuple):
    """A policy's log-probs at the completion tokens of a batch.

    They are mu's as sampled, the anchor's, or pi's in training."""

    logp: torch.Tensor  # (B, T)    log p(a_t | s_t) of the sampled token
    topk_logp: Optional[torch.Tensor]  # (B, T, K) log p at mu's top-K ids (the sampled token among them)
    entropy: Optional[torch.Tensor]  # (B, T)    entropy of p(. | s_t) over the whole vocabulary

    def select(self, rows: torch.Tensor, T: int) -> "LogProbs":
        """These rows and their first T columns, in each field that is present."""
        return LogProbs(*(None if x is None else x[rows, :T] for x in self))


class SamplingRecorder(LogitsProcessor):
    """Records mu = softmax(logits / tau) while generate() samples with top_k=0 and top_p=1 (see sampling).

    Given generate's inputs, it computes what these lines of plain torch compute:

        out = model.generate(**inputs, **sampling(cfg), output_logits=True, return_dict_in_generate=True)
        log_mu = (torch.stack(out.logits, dim=1).float() / cfg.temperature).log_softmax(-1)  # (B, T, V)
        logp_mu = log_mu.gather(-1, out.sequences[:, -len(out.logits) :, None]).squeeze(-1)  # at the sampled tokens
        topk_logp_mu, topk_ids = log_mu.topk(cfg.topk, dim=-1)  # and the sampled token in the K-th slot if outside
        entropy_mu = -(log_mu.exp() * log_mu).sum(-1)

    It does so without the (B, T, V) logits. It sees the logits of one step at a time, before the temperature
    is applied and before the step's token is drawn. So it records the token of step t at step t + 1, where
    that token is the last column of input_ids. It records the last step's token in finish."""

    def __init__(self, temperature: float, k: int):
        self.temperature = temperature
        self.k = k
        self.logp_mu = []  # per step: (B,) log mu(a_t) of the sampled token
        self.topk_ids = []  # (B, K) mu's K most probable ids, the sampled token forced in
        self.topk_logp_mu = []  # (B, K) their log mu
        self.entropy_mu = []  # (B,) H(mu(. | s_t)) over the whole vocabulary
        # The newest step's raw logits (B, V) and log normaliser (B,), until its sampled token is known.
        self.pending = None

    def __call__(self, input_ids, scores):
        # The one-step lag: the token of step t is known at step t + 1, as the last column of input_ids.
        if self.pending is not None:
            self.record_sampled_token(input_ids[:, -1])
        logits = scores.float() / self.temperature
        log_normaliser = logits.logsumexp(-1)
        top_logits, top_ids = logits.topk(min(self.k, logits.shape[-1]), dim=-1)
        self.topk_ids.append(top_ids)
        self.topk_logp_mu.append(top_logits - log_normaliser[:, None])
        self.entropy_mu.append(entropy_from_logits(logits, log_normaliser))
        self.pending = (scores, log_normaliser)
        return scores

    def record_sampled_token(self, tokens):
        scores, log_normaliser = self.pending
        logp = scores.gather(-1, tokens[:, None]).squeeze(-1).float() / self.temperature - log_normaliser
        t = len(self.logp_mu)
        ids = self.topk_ids[t]
        top_logp = self.topk_logp_mu[t]
        # A sampled token outside mu's top K takes the K-th slot. The token that it evicts joins "the
        # rest", as in DPPO's code.
        outside = ~(ids == tokens[:, None]).any(-1)
        # torch.where, not ids[outside]: boolean indexing would wait for the GPU at every step.
        ids[:, -1] = torch.where(outside, tokens, ids[:, -1])
        top_logp[:, -1] = torch.where(outside, logp, top_logp[:, -1])
        self.logp_mu.append(logp)
        self.pending = None

    def finish(self, completion_ids) -> tuple[torch.Tensor, LogProbs]:
        """mu's top-K ids (B, T, K) and mu's LogProbs.

        The last step's token is known only now, from the completions."""
        T = completion_ids.shape[1]
        if len(self.logp_mu) < T:
            self.record_sampled_token(completion_ids[:, -1])
        # generate() may run one step more than it keeps, so each list is cut at T.
        steps = (self.logp_mu, self.topk_logp_mu, self.entropy_mu)
        topk_ids = torch.stack(self.topk_ids[:T], dim=1)
        mu = LogProbs(*(torch.stack(x[:T], dim=1) for x in steps))
        return topk_ids, mu


@dataclasses.dataclass(frozen=True)
class Rollout:
    """What sampling produced: B = P x G completions, and mu.

    The G completions of a prompt are in consecutive rows."""

    prompt_ids: torch.Tensor  # (B, Lp) left-padded
    prompt_mask: torch.Tensor  # (B, Lp)
    completion_ids: torch.Tensor  # (B, T)  right-padded
    completion_mask: torch.Tensor  # (B, T)  1.0 up to and including the first EOS, 0.0 after
    topk_ids: torch.Tensor  # (B, T, K) mu's K most probable ids, the sampled token always among them
    mu: LogProbs  # the sampler's, as recorded while sampling
    texts: list[str]  # the completions as text, up to the first EOS
    truncated: torch.Tensor  # (B,) True where a completion was cut at --max_new_tokens, before any EOS

    def select(self, rows: torch.Tensor) -> "Rollout":
        """These rows (a micro-batch), without the columns that are padding in all of them.

        Without those columns, a forward pass over the rows costs less."""
        first = int(self.prompt_mask[rows].any(0).int().argmax())  # the first column that any row uses
        T = int(self.completion_mask[rows].sum(1).max())  # the longest completion, its EOS included
        prompts = dict(prompt_ids=self.prompt_ids[rows, first:], prompt_mask=self.prompt_mask[rows, first:])
        tokens = dict(
            completion_ids=self.completion_ids[rows, :T],
            completion_mask=self.completion_mask[rows, :T],
            topk_ids=self.topk_ids[rows, :T],
        )
        texts = dict(texts=[self.texts[i] for i in rows], truncated=self.truncated[rows])
        return Rollout(**prompts, **tokens, mu=self.mu.select(rows, T), **texts)


# A chat model gets the question, then the zero-shot "qwen-boxed" prompt of Qwen2.5-Math's evaluation, in one user turn.
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def format_prompt(tokenizer, question: str) -> str:
    """The prompt for a question: the chat template's user turn, or plain text for a model without a template."""
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": f"{question}\n{BOXED_INSTRUCTION}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"Question: {question}\nAnswer:"  # models without a chat template (the demo's)


def problem_batch(n_problems: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The indices of the P problems that step `step` samples (DCPO's prompt keys). They depend on the seed and the
    step alone, so a resumed run sees the same problems. Each pass over the data has its own order."""
    epoch, position = divmod(step - 1, n_problems // batch_size)
    order = random.Random(f"{seed}:{epoch}").sample(range(n_problems), n_problems)
    return order[position * batch_size : (position + 1) * batch_size]


def generate_rollout(model, tokenizer, prompts: list[str], cfg: Config) -> Rollout:
    """Samples one completion per prompt, and records mu."""
    recorder = SamplingRecorder(cfg.temperature, cfg.topk)
    with full_weights(model), autocast(model, cfg.precision):
        recording = dict(logits_processor=[recorder], **sampling(cfg))
        inputs, tokens, mask = generate(model, tokenizer, prompts, cfg, prefill_once=True, **recording)
    topk_ids, mu = recorder.finish(tokens)
    # A completion without any EOS was cut at the length limit.
    eos = torch.tensor(model.generation_config.eos_token_id, device=tokens.device)
    cut = ~torch.isin(tokens, eos).any(1)
    texts = decode(tokenizer, tokens, mask)
    return Rollout(
        prompt_ids=inputs.input_ids,
        prompt_mask=inputs.attention_mask,
        completion_ids=tokens,
        completion_mask=mask,
        topk_ids=topk_ids,
        mu=mu,
        texts=texts,
        truncated=cut,
    )


def sampling(cfg: Config) -> dict:
    """generate's settings under which mu = softmax(logits / tau) over the whole vocabulary.

    Every setting is explicit, because otherwise the generation config of a checkpoint would change mu."""
    return dict(do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0, repetition_penalty=1.0)


# ============================================================================ rewards and advantages


def score(rollout: "Rollout", problems: list[dict], truncated_reward: str = "keep") -> torch.Tensor:
    """The reward of each completion: 1 if its final answer is its problem's answer, else 0 (rewards.py).

    With truncated_reward "zero", a completion cut at the length limit gets 0, whatever its text says."""
    scores = []
    for text, problem in zip(rollout.texts, problems):
        scores.append(reward(text, extract_gold(problem["answer"])))
    rewards = torch.tensor(scores)
    if truncated_reward == "zero":
        rewards[rollout.truncated.cpu()] = 0.0
    return rewards


# Rewards whose std is at most this are equal up to rounding. Their advantages are then exactly 0, as every
# test of A != 0 needs.
EQUAL_REWARDS_STD = 1e-6


def grpo_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group", eps: float = 1e-6):
    """GRPO's advantages (arXiv 2402.03300, §4.1.2), over the G completions of each prompt:
        A_j = (R_j - mean(R)) / (std(R) + eps)
    std is Bessel-corrected. With scale_rewards='none', the rewards are only centred (Dr. GRPO,
    arXiv 2503.20783). Equal rewards give A = 0."""
    groups = rewards.view(-1, group_size)
    std = groups.std(1, keepdim=True)
    advantages = groups - groups.mean(1, keepdim=True)
    if scale_rewards == "group":
        advantages = advantages / (std + eps)
    return torch.where(std > EQUAL_REWARDS_STD, advantages, 0.0).flatten()


def step_advantages(rewards: torch.Tensor, indices: list[int], reward_history: dict, cfg: Config) -> torch.Tensor:
    """The advantages of the step's completions, from the rewards of the step's prompts (indices).

    GRPO computes them within each group. SAS computes them from the reward history of each prompt. Every
    process keeps the whole history, so SAS reads the rewards of every process."""
    if cfg.advantage == "sas":
        every_process = all_gathered(rewards)
        advantages = sas_advantages(every_process, cfg.samples_per_prompt, indices, reward_history)
        return this_process_share(advantages)
    return grpo_advantages(rewards, cfg.samples_per_prompt, cfg.scale_rewards)


# ============================================================================ batches and token weights


def moves_pi(A: torch.Tensor, cfg: Config) -> torch.Tensor:
    """The completions whose loss has a gradient.

    These are the completions with A != 0, because every loss except IPO's KL term is a multiple of A or |A|.
    Under ipo with kl_tau > 0, they are all the completions."""
    return (A != 0) | (cfg.objective == "ipo" and cfg.ipo_kl_tau > 0)


def rows_that_move_pi(rows: torch.Tensor, moving: torch.Tensor, micro_batch_size: int) -> tuple[list, torch.Tensor]:
    """Micro-batches of the rows whose loss has a gradient (`moving`, from moves_pi), and the rows left out.

    Every process makes as many micro-batches as the busiest process, because FSDP2's collectives need equal
    counts. Every process also makes at least one, so that AdamW steps on zero gradients rather than on None.
    Rows that would be left out fill the extra micro-batches, one row each."""
    chosen = moving[rows].to(rows.device)
    moved = rows[chosen]
    still = rows[~chosen]
    micro_batches = [moved[i : i + micro_batch_size] for i in range(0, len(moved), micro_batch_size)]
    busiest = all_reduced(torch.tensor(len(micro_batches), device=moving.device), dist.ReduceOp.MAX)
    n = max(int(busiest), 1)
    filled = n - len(micro_batches)
    fillers = [still[i : i + 1] for i in range(filled)]
    return micro_batches + fillers, still[filled:]


def token_weights(mask: torch.Tensor, loss_agg: str, counts=None, max_new_tokens: int = 0) -> torch.Tensor:
    """Per-token weights w such that sum(w * l) is the mini-batch's loss, whatever its micro-batches.

    counts holds (tokens, completions with a token) of the whole mini-batch over every process, as
    token_counts counts them. By default, counts are this mask's."""
    if counts is None:
        counts = token_counts(mask)
    tokens, completions = counts.clamp(min=1)
    if loss_agg == "token_mean":  # DAPO (arXiv 2503.14476, eq. 8's 1/sum|o_i|): every token counts the same
        return mask / tokens
    if loss_agg == "seq_mean_token_mean":  # original GRPO: mean over completions of each one's token mean
        return mask / mask.sum(1, keepdim=True).clamp(min=1) / completions
    if loss_agg == "seq_sum":  # mean over completions of each one's token sum (DCPO's OTM)
        return mask / completions
    if loss_agg == "seq_sum_norm":  # Dr. GRPO (arXiv 2503.20783): each one's token sum over the length limit
        if not max_new_tokens > 0:
            raise ValueError(f"token_weights: seq_sum_norm divides by max_new_tokens > 0, got {max_new_tokens}")
        return mask / max_new_tokens / completions
    raise ValueError(f"token_weights: unknown loss_agg {loss_agg!r}")


def token_counts(mask: torch.Tensor) -> torch.Tensor:
    """(tokens, completions with at least one token) of a mask: what token_weights divides by."""
    return torch.stack([mask.sum(), (mask.sum(1) > 0).sum().to(mask.dtype)])


# ============================================================================ objectives
# Each objective returns a per-token loss l_t to minimise, and `blocked`, the tokens whose gradient the
# trust region removed. Its inputs are logp = log pi(a_t | s_t) (fp32, with gradient), logp_anchor = the
# anchor's log-prob of the same token (mu as sampled, or pi_old), A (B, 1), and the objective's own
# thresholds, never a Config. pi comes first everywhere.


def objective_loss(cfg: Config, pi: LogProbs, anchor: LogProbs, advantages: torch.Tensor, mask: torch.Tensor) -> tuple:
    """The per-token loss and blocked tokens of --objective, with the thresholds from its flags.

    The neighbours' objectives come after the training loop."""
    logp = pi.logp
    logp_anchor = anchor.logp
    A = advantages
    clip = dict(clip_low=cfg.clip_low, clip_high=cfg.clip_high)
    if cfg.objective == "pg":
        return pg_loss(logp, logp_anchor, A, is_cap=cfg.is_cap)
    elif cfg.objective == "ppo_clip":
        relaxed = dict(relax=cfg.relax_clip, relax_below=cfg.relax_below)
        return ppo_clip_loss(logp, logp_anchor, A, **clip, dual_clip=cfg.dual_clip, **relaxed)
    elif cfg.objective in ("binary_tv", "binary_kl", "topk_tv", "topk_kl"):
        D = dppo_divergence(cfg.objective, pi, anchor)
        thresholds = dict(delta_low=cfg.delta_low, delta_high=cfg.delta_high, is_cap=cfg.is_cap)
        return dppo_loss(logp, logp_anchor, A, D, **thresholds)
    elif cfg.objective == "dcpo":
        return dcpo_loss(logp, logp_anchor, A, **clip, r_max=cfg.dcpo_r_max, dual_clip=cfg.dual_clip)
    elif cfg.objective == "erc":
        band = dict(beta_low=cfg.erc_beta_low, beta_high=cfg.erc_beta_high)
        ppo_clip = dict(**clip, dual_clip=cfg.dual_clip)
        return erc_loss(logp, logp_anchor, A, pi.entropy, anchor.entropy, **band, **ppo_clip)
    elif cfg.objective == "cispo":
        return cispo_loss(logp, logp_anchor, A, **clip)
    elif cfg.objective == "gspo":
        return gspo_loss(logp, logp_anchor, A, mask, **clip)
    elif cfg.objective == "drpo":
        return drpo_loss(logp, logp_anchor, A, delta=cfg.drpo_delta)
    elif cfg.objective == "cppo":
        budget = dict(w_min=cfg.cppo_w_min, delta_b_min=cfg.cppo_delta_b_min, is_cap=cfg.is_cap)
        return cppo_loss(logp, logp_anchor, A, mask, delta=cfg.cppo_delta, **budget)
    elif cfg.objective == "ipo":
        return ipo_loss(logp, logp_anchor, A, eps=cfg.ipo_eps, kl_tau=cfg.ipo_kl_tau)
    raise ValueError(f"unknown objective {cfg.objective!r}")


def objective_needs(objective: str) -> dict:
    """What objective_loss reads of pi and the anchor besides log p(a_t).

    That is p at mu's top-K ids (for the top-K divergences), or the entropy (for erc)."""
    return dict(with_topk=objective in ("topk_tv", "topk_kl"), with_entropy=objective == "erc")


LOG_EPS = math.log(1e-12)


def log_ratio(logp, logp_anchor):
    """log r = log pi(a_t) - log anchor(a_t).

    The anchor's log-prob is clamped at log 1e-12 (LOG_EPS), so that r stays finite."""
    return logp - logp_anchor.clamp(min=LOG_EPS)


def pg_loss(logp, logp_anchor, advantages, is_cap=math.inf):
    """No trust region: the DPPO paper's "PG-IS" control (arXiv 2602.04879).

        l = -A * sg(min(r, C)) * log pi,   r = pi / anchor,   C = is_cap (inf: no cap)

    For r <= C, the gradient of l is the gradient of -A * r."""
    ratio = log_ratio(logp, logp_anchor).exp().detach()
    return -advantages * ratio.clamp(max=is_cap) * logp, torch.zeros_like(logp, dtype=torch.bool)


def clipped_surrogate(logp, logp_anchor, advantages, ratio_low, ratio_high, dual_clip):
    """PPO's clipped surrogate (arXiv 1707.06347, eq. 7), with dual-clip (arXiv 1912.09729) for A < 0:

        l = max(-A * r, -A * clip(r, ratio_low, ratio_high)),   and if A < 0: l = min(l, -A * c)

    r = pi / anchor, and c = dual_clip. A token is blocked where a clip binds."""
    ratio = log_ratio(logp, logp_anchor).exp()
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(ratio_low, ratio_high))
    loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    clipped_up = (advantages > 0) & (ratio > ratio_high)
    clipped_down = (advantages < 0) & ((ratio < ratio_low) | (ratio > dual_clip))
    return loss, clipped_up | clipped_down


def ppo_clip_loss(
    logp, logp_anchor, advantages, clip_low=0.2, clip_high=0.28, dual_clip=10.0, relax="none", relax_below=0.1
):
    """PPO/GRPO with DAPO's decoupled clip-higher bounds (arXiv 2503.14476, eq. 8).

    r is clipped to [1 - eps_low, 1 + eps_high], with eps_low = clip_low and eps_high = clip_high. relax
    is the DPPO paper's relaxed clip (its section 6): a token with anchor(a_t) < relax_below escapes the
    bounds that relax names."""
    if relax not in ("none", "high", "low", "both"):
        raise ValueError(f"ppo_clip_loss: relax must be none, high, low or both, got {relax!r}")
    ratio_low = 1 - clip_low
    ratio_high = 1 + clip_high
    if relax != "none":
        rare = logp_anchor.detach().exp() < relax_below
        escapes_low = rare & (relax in ("low", "both"))
        ratio_low = torch.where(escapes_low, 0.0, torch.full_like(logp_anchor, ratio_low))
        escapes_high = rare & (relax in ("high", "both"))
        ratio_high = torch.where(escapes_high, math.inf, torch.full_like(logp_anchor, ratio_high))
    return clipped_surrogate(logp, logp_anchor, advantages, ratio_low, ratio_high, dual_clip)


def dppo_loss(logp, logp_anchor, advantages, divergence, delta_low=0.15, delta_high=0.15, is_cap=math.inf):
    """DPPO (arXiv 2602.04879, eqs. 11-12), with r = pi / anchor and the anchor mu as sampled:

        l = -A * sg(min(r, C)) * M * log pi
        M = 0  iff  (A > 0 and r > 1 and D > delta_high)  or  (A < 0 and r < 1 and D > delta_low)

    The mask M blocks a token only when the token moves *away* from the anchor past delta. It never blocks a
    token that moves back, however large D is. D is the divergence (no gradient) between anchor(. | s_t) and
    pi(. | s_t): binary_tv, binary_kl, topk_tv or topk_kl. Returns (l, blocked), where blocked = 1 - M.
    Every objective returns blocked in this sense as its second value: the complement of its eq. 11 mask."""
    log_r = log_ratio(logp, logp_anchor).detach()
    too_far_up = (advantages > 0) & (log_r > 0) & (divergence > delta_high)
    too_far_down = (advantages < 0) & (log_r < 0) & (divergence > delta_low)
    blocked = too_far_up | too_far_down
    return -advantages * log_r.exp().clamp(max=is_cap) * (~blocked) * logp, blocked


def dppo_divergence(objective: str, pi: LogProbs, anchor: LogProbs) -> torch.Tensor:
    """D for a DPPO objective, between anchor(. | s_t) and pi(. | s_t).

    Both distributions are coarsened to {a_t, the rest} (binary_*) or to {mu's top K, the rest} (topk_*)."""
    divergence = dict(binary_tv=binary_tv, binary_kl=binary_kl, topk_tv=topk_tv, topk_kl=topk_kl)[objective]
    if objective.startswith("binary_"):
        return divergence(logp=pi.logp, logp_anchor=anchor.logp)
    return divergence(topk_logp=pi.topk_logp, topk_logp_anchor=anchor.topk_logp)


# DPPO's divergences (arXiv 2602.04879, eqs. 13-14; the top-K ones: its appendix). Each is the TV or the KL
# between the next-token distributions of the anchor and of pi, coarsened to {a_t, the rest} or to {mu's
# top-K ids, the rest}. So binary <= top-K <= full vocabulary. They have no gradient. The KLs are
# KL(anchor || pi). Their log-probs are keyword-only arguments, so that pi and the anchor cannot be swapped.


@torch.no_grad()
def binary_tv(*, logp, logp_anchor):
    """D = |p - q|, where p = pi(a_t) and q = anchor(a_t).

    This is the TV over {a_t, the rest}: both cells differ by |p - q|, and the TV is half the sum."""
    return (logp.exp() - logp_anchor.exp()).abs()


@torch.no_grad()
def binary_kl(*, logp, logp_anchor):
    """D = q log(q / p) + (1 - q) log((1 - q) / (1 - p)), where p = pi(a_t) and q = anchor(a_t).

    This is KL(anchor || pi) over {a_t, the rest}."""
    cells = with_rest(logp.unsqueeze(-1))
    cells_anchor = with_rest(logp_anchor.unsqueeze(-1))
    return partition_kl(logp=cells, logp_anchor=cells_anchor)


@torch.no_grad()
def topk_tv(*, topk_logp, topk_logp_anchor):
    """D = 1/2 (sum_{a in S} |q(a) - p(a)| + |q(other) - p(other)|).

    p is pi and q is the anchor. S is mu's top-K ids, the sampled token included, and "other" is the rest of
    the vocabulary. This is TV(anchor, pi) over S and the rest."""
    return partition_tv(logp=with_rest(topk_logp), logp_anchor=with_rest(topk_logp_anchor))


@torch.no_grad()
def topk_kl(*, topk_logp, topk_logp_anchor):
    """D = sum_{a in S} q(a) log(q(a) / p(a)) + q(other) log(q(other) / p(other)).

    p is pi and q is the anchor. S is mu's top-K ids, the sampled token included, and "other" is the rest of
    the vocabulary. This is KL(anchor || pi) over S and the rest."""
    return partition_kl(logp=with_rest(topk_logp), logp_anchor=with_rest(topk_logp_anchor))


def with_rest(logp: torch.Tensor) -> torch.Tensor:
    """Log-probs of a partition's cells: the given outcomes (last axis), plus "the rest" = 1 - their sum."""
    # log(1 - p), computed with expm1 so that it stays accurate near p = 1.
    rest = (-torch.expm1(logp.logsumexp(-1, keepdim=True))).clamp(min=1e-12).log()
    return torch.cat([logp, rest], dim=-1)


def partition_tv(*, logp: torch.Tensor, logp_anchor: torch.Tensor) -> torch.Tensor:
    """TV(anchor, pi) = 1/2 sum_cells |anchor(cell) - pi(cell)|.

    The cells are on the last axis."""
    return 0.5 * (logp_anchor.exp() - logp.exp()).abs().sum(-1)


def partition_kl(*, logp: torch.Tensor, logp_anchor: torch.Tensor) -> torch.Tensor:
    """KL(anchor || pi) = sum_cells anchor(cell) log(anchor(cell) / pi(cell)).

    The cells are on the last axis."""
    logp_anchor = logp_anchor.clamp(min=LOG_EPS)
    logp = logp.clamp(min=LOG_EPS)
    return (logp_anchor.exp() * (logp_anchor - logp)).sum(-1)


# ============================================================================ pi's log-probs

# pi's output layer computes at most this many logits at once, counted as positions x vocabulary (256 MiB
# in fp32).
LOGITS_CHUNK = 2**26
# A pass with gradient and more logits than this (4 GiB in fp32) recomputes each chunk's logits in backward,
# instead of keeping them.
LOGITS_KEPT = 2**30


def policy_logprobs(model, batch, temperature, precision="fp32", with_topk=False, with_entropy=False) -> LogProbs:
    """log pi(a_t | s_t) (B, T) in fp32 with gradient, from one teacher-forced pass over a batch.

    The batch has a Rollout's fields. Let x be the prompts and completions side by side, and T the width
    of the completions. In plain torch:

        logits = model(x).logits[:, -T - 1 : -1].float() / temperature  # the positions that predict a_1 .. a_T
        logp = logits.log_softmax(-1).gather(-1, batch.completion_ids[..., None]).squeeze(-1)

    This function computes the same without the (B, T, V) logits: the output layer runs on a chunk of
    positions at a time (logprobs_in_chunks). If asked, it also computes, without gradient, log pi at
    mu's top-K ids (B, T, K) and the entropy (B, T)."""
    T = batch.completion_ids.shape[1]
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask.long()], dim=1)
    # Positions count from each row's first real token, as generate() counts them.
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    # The model keeps no logits: logprobs_in_chunks runs the output layer in chunks instead.
    no_logits = torch.zeros(0, dtype=torch.long, device=input_ids.device)
    hidden_states_only = dict(use_cache=False, logits_to_keep=no_logits, output_hidden_states=True)
    with autocast(model, precision):
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        out = model(**inputs, **hidden_states_only)
        # The last hidden states (after the final norm), at the positions that predict a_1 .. a_T.
        hidden = out.hidden_states[-1][:, -T - 1 : -1]
        topk_ids = batch.topk_ids if with_topk else None
        # The output layer, and what the model's forward applies after it (OutputLogits, in the plumbing).
        logits = OutputLogits(model)
        return logprobs_in_chunks(logits, hidden, batch.completion_ids, topk_ids, temperature, with_entropy)


def logprobs_in_chunks(logits_of, hidden, targets, topk_ids, temperature, with_entropy) -> LogProbs:
    """LogProbs at (B, T) targets, from the hidden states that predict them.

    The output layer computes LOGITS_CHUNK logits at a time. When a pass with gradient holds more than
    LOGITS_KEPT logits, each chunk's logits are recomputed in backward instead of kept."""
    B, T = targets.shape
    n = max(1, LOGITS_CHUNK // logits_of.vocab_size)  # positions per chunk
    recompute = torch.is_grad_enabled() and B * T * logits_of.vocab_size > LOGITS_KEPT
    hidden = hidden.reshape(B * T, -1).split(n)
    targets = targets.reshape(B * T).split(n)
    if topk_ids is not None:
        topk_ids = topk_ids.reshape(B * T, -1).split(n)
    else:
        topk_ids = [None] * len(targets)
    in_chunk = chunk_logprobs
    if recompute:
        in_chunk = functools.partial(checkpoint, chunk_logprobs, use_reentrant=False)
    logp = []
    topk_logp = []
    entropy = []
    for args in zip(hidden, targets, topk_ids):
        chunk_logp, chunk_topk_logp, chunk_entropy = in_chunk(logits_of, *args, temperature, with_entropy)
        logp.append(chunk_logp)
        topk_logp.append(chunk_topk_logp)
        entropy.append(chunk_entropy)
    topk_logp = torch.cat(topk_logp).unflatten(0, (B, T)) if topk_ids[0] is not None else None
    entropy = torch.cat(entropy).view(B, T) if with_entropy else None
    return LogProbs(torch.cat(logp).view(B, T), topk_logp, entropy)


def chunk_logprobs(logits_of, hidden, targets, topk_ids, temperature, with_entropy):
    """log pi = logit / tau - logsumexp(logits / tau) in fp32, at the targets of N positions.

    If asked, log pi at topk_ids and the entropy are also computed, without gradient."""
    logits = logits_of(hidden) / temperature
    log_normaliser = logits.logsumexp(-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - log_normaliser
    with torch.no_grad():
        topk_logp = None
        if topk_ids is not None:
            topk_logp = logits.gather(-1, topk_ids) - log_normaliser[:, None]
        entropy = None
        if with_entropy:
            entropy = entropy_from_logits(logits, log_normaliser)
    return logp, topk_logp, entropy


def entropy_from_logits(logits: torch.Tensor, log_normaliser: torch.Tensor) -> torch.Tensor:
    """H = -sum p log p = log Z - sum p * logit, over the last axis, where log Z is the log normaliser.

    p is the only (N, V) copy, and it is reused in place."""
    p = (logits - log_normaliser[:, None]).exp_()
    return log_normaliser - p.mul_(logits).sum(-1)


# ============================================================================ evaluation


def evaluate(model, tokenizer, problems, cfg: Config) -> dict:
    """Greedy held-out accuracy, and the share of greedy answers cut at --max_new_tokens.

    With --eval_samples k, it also measures avg@k and pass@k. avg@k is the mean accuracy of k samples a
    problem at the sampling temperature (DPPO's and CPPO's avg@16)."""
    mine = this_process_share(problems, interleaved=True)
    k = cfg.eval_samples
    # The sums, over problems, of greedy accuracy, avg@k, pass@k, and greedy answers cut short.
    totals = torch.zeros(4, dtype=torch.float64, device=model.device)
    # Evaluation draws from its own random stream, so that training samples what it would without evaluation.
    own_random_stream = torch.random.fork_rng(devices=[] if model.device.type == "cpu" else [model.device])
    with full_weights(model), autocast(model, cfg.precision), own_random_stream:
        for start in range(0, len(mine), cfg.eval_batch_size):
            batch = mine[start : start + cfg.eval_batch_size]
            right, cut_short = rewards_of(model, tokenizer, batch, cfg, do_sample=False)
            counts = torch.tensor([sum(right), sum(cut_short)], dtype=totals.dtype, device=totals.device)
            totals[0::3] += counts  # totals[0] and totals[3]: greedy accuracy and greedy answers cut short
            if k:
                samples = []  # each problem k times in a row
                for problem in batch:
                    samples += [problem] * k
                right_of_samples, _ = rewards_of(model, tokenizer, samples, cfg, **sampling(cfg))
                right = torch.tensor(right_of_samples).view(-1, k)
                totals[1] += right.mean(1).sum()
                totals[2] += sum(pass_at_k(k, int(correct), k) for correct in right.sum(1))
    greedy, avg, passed, cut_short = (all_reduced(totals) / len(problems)).tolist()
    sampled = {"eval/avg_at_k": avg, "eval/pass_at_k": passed} if k else {}
    return {"eval/accuracy": greedy, **sampled, "eval/truncated": cut_short}


def rewards_of(model, tokenizer, problems: list[dict], cfg: Config, **decoding) -> tuple[list[float], list[bool]]:
    """Samples one completion per problem, decoded as `decoding` says.

    Returns the 0/1 reward of each completion, and whether the completion ended without EOS."""
    prompts = [format_prompt(tokenizer, p["question"]) for p in problems]
    _, ids, mask = generate(model, tokenizer, prompts, cfg, **decoding)
    eos = torch.tensor(model.generation_config.eos_token_id, device=ids.device)
    cut_short = ~torch.isin(ids, eos).any(1)
    texts = decode(tokenizer, ids, mask)
    rewards = []
    for text, problem in zip(texts, problems):
        rewards.append(reward(text, extract_gold(problem["answer"])))
    return rewards, cut_short.tolist()


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k of Chen et al. 2021 (arXiv 2107.03374, eq. 1): 1 - C(n - c, k) / C(n, k).

    Of the n samples, c = correct are right."""
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


# ============================================================================ the training loop


def train(cfg: Config, model, sampler, tokenizer, optimizer, problems, held_out, run: "Run") -> float:
    """Runs the RL steps and logs each one. Returns the last held-out accuracy.

    The greedy held-out accuracy is measured before the first step, every --eval_every steps, and after
    the last step. A checkpoint is written every --save_every steps and on Ctrl-C. The model is saved at
    the end."""
    if run.initial_accuracy is None:
        run.initial_accuracy = run.log(0, evaluate(model, tokenizer, held_out, cfg))["eval/accuracy"]
    accuracy = run.initial_accuracy
    for step in run.steps:
        STEP_CLOCK.restart(model.device)  # times the step's rollout and update (see timed)
        try:
            metrics = rl_step(step, model, sampler, tokenizer, optimizer, problems, run, cfg)
        except FloatingPointError as error:
            # The optimizer step that failed was not taken. Save the model as it is, and stop.
            save_model(model, tokenizer, run.output_dir)
            run.log(step, {"stopped_nonfinite": 1})  # a study's record of where the run broke
            leave_after_rank_0(
                f"dppo.py: stopped at step {step} ({cfg.objective}): {error}. The model before that "
                f"optimizer step is in {run.output_dir}, metrics.jsonl up to step {step - 1} and the stop"
            )
        run.log(step, metrics)
        if step % cfg.eval_every == 0 or step == run.last_step:
            accuracy = run.log(step, evaluate(model, tokenizer, held_out, cfg))["eval/accuracy"]
        run.show_progress(metrics, accuracy)
        stop = run.stop_requested()  # Ctrl-C on any process: this step is finished, saved, and the run stops
        if stop or (cfg.save_every and step % cfg.save_every == 0):
            save_checkpoint(run, model, tokenizer, optimizer, step)
        if stop:
            resume = f"continue with the same flags and --resume {run.output_dir}"
            leave_after_rank_0(f"dppo.py: interrupted after step {step}; {resume}")
    save_model(model, tokenizer, run.output_dir)
    return accuracy


# ============================================================================ neighbours and the ablation
# What follows is neither DPPO nor its baseline. The neighbours are the trust regions that the DPPO
# paper and its sequels compare against; objective_loss picks one by --objective. The paper's ablation
# anchors the trust region to pi_old (rl_step's --recompute_old).


# -------- DCPO (arXiv 2509.02333): smooth advantages (--advantage sas), and clip bounds from anchor(a_t)


def sas_advantages(rewards: torch.Tensor, group_size: int, prompt_keys: list, history: dict) -> torch.Tensor:
    """DCPO's Smooth Advantage Standardization (arXiv 2509.02333).

    history[key] = (visits i, mean_tot, std_tot) holds the statistics of a prompt's rewards over all its
    visits, equally weighted. It is updated in place. On visit i, with the group's mean_new and std_new:
        A_new = (R - mean_new) / std_new          A_tot = (R - mean_tot) / std_tot       (0 where std = 0)
        SA_new = (i-1)/i * A_new + 1/i * A_tot    SA_tot = 1/i * A_new + (i-1)/i * A_tot
    A is whichever of SA_new and SA_tot is smaller in magnitude. A tie goes to SA_tot."""
    advantages = []
    for key, R in zip(prompt_keys, rewards.view(-1, group_size)):
        mean_new = R.mean().item()
        std_new = R.std().item()
        visits, mean_old, std_old = history.get(key, (0, 0.0, 0.0))
        i = visits + 1
        mean_tot = (visits * mean_old + mean_new) / i
        variance_tot = (visits * std_old**2 + std_new**2 + (visits / i) * (mean_new - mean_old) ** 2) / i
        std_tot = math.sqrt(variance_tot)
        history[key] = (i, mean_tot, std_tot)
        A_new = (R - mean_new) / std_new if std_new > 0 else torch.zeros_like(R)
        A_tot = (R - mean_tot) / std_tot if std_tot > 0 else torch.zeros_like(R)
        SA_new = (i - 1) / i * A_new + 1 / i * A_tot
        SA_tot = 1 / i * A_new + (i - 1) / i * A_tot
        advantages.append(torch.where(SA_new.abs() < SA_tot.abs(), SA_new, SA_tot))
    return torch.cat(advantages)


def dcpo_bounds(q, eps_low=0.2, eps_high=0.28, r_max=10.0):
    """DCPO's token-specific bounds (arXiv 2509.02333, eq. 4), where q = anchor(a_t).

    The bounds are the roots of |r (r - 1)| * q <= eps:
        r_low = 1/2 + 1/2 sqrt(max(1 - 4 eps_low / q, 0))
        r_high = min(1/2 + 1/2 sqrt(1 + 4 eps_high / q), r_max)"""
    ratio_low = 0.5 + 0.5 * torch.sqrt((1 - 4 * eps_low / q).clamp(min=0))
    ratio_high = (0.5 + 0.5 * torch.sqrt(1 + 4 * eps_high / q)).clamp(max=r_max)
    return ratio_low, ratio_high


def dcpo_loss(logp, logp_anchor, advantages, clip_low=0.2, clip_high=0.28, r_max=10.0, dual_clip=10.0):
    """DCPO's dynamic adaptive clipping: the clipped surrogate between dcpo_bounds(q).

    q = anchor(a_t), without gradient."""
    ratio_low, ratio_high = dcpo_bounds(logp_anchor.exp().detach(), clip_low, clip_high, r_max)
    return clipped_surrogate(logp, logp_anchor, advantages, ratio_low, ratio_high, dual_clip)


# -------- ERC, CISPO, GSPO: an entropy gate, a weight clip, a sequence-level ratio


def erc_loss(logp, logp_anchor, advantages, entropy_pi, entropy_anchor, beta_low=0.05, beta_high=0.05, **clip):
    """Entropy Ratio Clipping (arXiv 2512.05591), on top of ppo_clip.

    clip holds ppo_clip's clip_low, clip_high and dual_clip. H_pi and H_anchor are the entropies of pi
    and of the anchor at s_t, and rho = (H_pi + 1e-8) / (H_anchor + 1e-8) has no gradient:
        l = l_ppo_clip where 1 - beta_low < rho < 1 + beta_high, and sg(l_ppo_clip) elsewhere
    A token is blocked where the clip binds or rho is outside that band."""
    loss, clipped = ppo_clip_loss(logp, logp_anchor, advantages, **clip)
    kept = entropy_ratio_kept(entropy_pi, entropy_anchor, beta_low, beta_high)
    return torch.where(kept, loss, loss.detach()), clipped | ~kept


def entropy_ratio_kept(entropy_pi, entropy_anchor, beta_low, beta_high):
    """The tokens whose entropy ratio rho is inside ERC's band (1 - beta_low, 1 + beta_high)."""
    rho = (entropy_pi + 1e-8) / (entropy_anchor + 1e-8)
    return (rho > 1 - beta_low) & (rho < 1 + beta_high)


def cispo_loss(logp, logp_anchor, advantages, clip_low=1.0, clip_high=4.0):
    """CISPO (MiniMax-M1, arXiv 2506.13585, eqs. 4-5): the importance weight is clipped, never the token.

        l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi,   r = pi / anchor

    eps_low = clip_low and eps_high = clip_high. No token is blocked."""
    weight = cispo_weight(logp, logp_anchor, clip_low, clip_high)
    return -weight * advantages * logp, torch.zeros_like(logp, dtype=torch.bool)


@torch.no_grad()
def cispo_weight(logp, logp_anchor, clip_low=1.0, clip_high=4.0):
    """CISPO's importance weight clip(r, 1 - eps_low, 1 + eps_high), where r = pi / anchor."""
    return log_ratio(logp, logp_anchor).exp().clamp(1 - clip_low, 1 + clip_high)


def gspo_loss(logp, logp_anchor, advantages, mask, clip_low=3e-4, clip_high=4e-4):
    """GSPO (arXiv 2507.18071), in its GSPO-token form: one ratio s_i per completion i.

    y_it is token t of completion i. Where the clip binds, all the tokens of the completion are blocked:
        s_i = exp(mean_t log(pi / anchor)), the mean over the completion's real tokens
        s_it = sg(s_i) * pi(y_it) / sg(pi(y_it))
        l_it = max(-A * s_it, -A * clip(s_it, 1 - eps_low, 1 + eps_high))"""
    real = mask.bool()
    # Padding neither enters the mean nor can poison it.
    log_r = torch.where(real, log_ratio(logp, logp_anchor), 0.0)
    log_s = log_r.sum(-1, keepdim=True) / real.sum(-1, keepdim=True).clamp(min=1)
    s = torch.exp(log_s.detach() + torch.where(real, logp - logp.detach(), 0.0))
    loss = torch.maximum(-advantages * s, -advantages * s.clamp(1 - clip_low, 1 + clip_high))
    clipped_up = (advantages > 0) & (s.detach() > 1 + clip_high)
    clipped_down = (advantages < 0) & (s.detach() < 1 - clip_low)
    return loss, (clipped_up | clipped_down) & real


# -------- DPPO's sequels, by the DPPO authors' group (2026). Their code is Tencent-Hunyuan/UniRL,
# unirl/algorithms/. Both sequels keep binary TV against the anchor, and change how they treat a token
# that moves away from the anchor.


def drpo_loss(logp, logp_anchor, advantages, delta=12.5):
    """DRPO (arXiv 2606.09821, section 3, eq. 8): DPPO's binary-TV mask becomes a smooth penalty on r.

    r = pi / anchor, as everywhere. The penalty is quadratic and weighted by |A|. Its gradient flows
    through r only, with log r clamped to [-20, 20], as in UniRL:
        l = -A * r + |A| * q * (r - 1)^2 / (2 delta),   q = anchor(a_t)
    The gradient of l (eq. 9) is -A * r * w * grad log pi, where w = drpo_weight. No token is cut. A token
    counts as blocked where w <= 0."""
    ratio = log_ratio(logp, logp_anchor).clamp(-20.0, 20.0).exp()
    q = logp_anchor.detach().clamp(min=LOG_EPS).exp()
    loss = -advantages * ratio + advantages.abs() * q * (ratio - 1) ** 2 / (2 * delta)
    return loss, drpo_weight(logp, logp_anchor, advantages, delta) <= 0


@torch.no_grad()
def drpo_weight(logp, logp_anchor, advantages, delta=12.5):
    """DRPO's gradient weight (its Table 1): w = 1 - sign(A (r - 1)) * |pi - anchor| / delta.

    w is below 1 for a token that moves away from the anchor, and negative past D = delta. w is above 1
    for a token that moves back."""
    moving_away = torch.sign(advantages * log_ratio(logp, logp_anchor))
    return 1 - moving_away * binary_tv(logp=logp, logp_anchor=logp_anchor.clamp(min=LOG_EPS)) / delta


def cppo_loss(logp, logp_anchor, advantages, mask, delta=0.15, w_min=0.8, delta_b_min=0.02, is_cap=math.inf):
    """CPPO (arXiv 2606.10968, eqs. 8-11 and Algorithm 1; delta_b: eq. 22).

    CPPO keeps DPPO's binary-TV mask, makes it stricter early in a completion, and puts a budget on the
    divergence that the completion's prefix has spent. Each completion is taken over its own T real tokens
    t = 1..T, and D_t = |pi - anchor| at a_t (fp32, no gradient):
        w_t = 1 - (1 - w_min) (t - 1) / (T - 1),   Z_t = w_t D_t
        S, W = the sums of Z and of w over the tokens before t
        delta_b = clamp(quantile_0.9(D_1..D_T), delta_b_min, 2 delta_b_min)
        c_t = min(delta, delta + delta_b W - S)
        l = -A * sg(min(r, C)) * M * log pi,   M = 0 iff A (r - 1) > 0 (moving away) and Z_t > c_t"""
    real = mask.detach() > 0
    # The mask is computed in fp32, whatever the input's dtype.
    log_r = log_ratio(logp.detach().float(), logp_anchor.detach().float())
    with torch.no_grad():
        T = real.sum(-1, keepdim=True)  # each completion's own length, its first EOS included
        # w is 0 on padding, so that padding enters no sum.
        w = (1 - (1 - w_min) * (real.cumsum(-1) - 1) / (T - 1).clamp(min=1)) * real
        D = binary_tv(logp=logp.float(), logp_anchor=logp_anchor.float().clamp(min=LOG_EPS)) * real
        Z = w * D
        # S and W sum over the tokens before t, whether those were kept or blocked.
        S = Z.cumsum(-1) - Z
        W = w.cumsum(-1) - w
        # nanquantile leaves out the padding, and interpolates linearly, as UniRL does.
        quantile = torch.nanquantile(torch.where(real, D, math.nan), 0.9, dim=-1, keepdim=True)
        delta_b = quantile.clamp(delta_b_min, 2 * delta_b_min)
        c = (delta + delta_b * W - S).clamp(max=delta)
        blocked = real & (advantages * log_r > 0) & (Z > c)
    ratio = log_ratio(logp, logp_anchor).detach().exp().clamp(max=is_cap)  # in the input's dtype
    return torch.where(real & ~blocked, -advantages * ratio * logp, 0.0), blocked


# -------- IPO (prime-rl, PrimeIntellect-ai/prime-rl, ipo_loss_fn; no paper): DPPO's binary TV, no sign


def ipo_loss(logp, logp_anchor, advantages, eps=0.3, kl_tau=0.0):
    """IPO, prime-rl's trust region since its pull request #3418 (2026-08).

    IPO keeps DPPO's binary-TV divergence D = |pi(a_t) - anchor(a_t)|, but blocks a token whatever A is and
    whichever way the token moved:
        M = 0  iff  D > eps,        l = -A * sg(r) * M * log pi + kl_tau * (log r)^2
    DPPO's mask keeps a token that moved away from the anchor against A's push, because the token's gradient
    pulls it back. IPO blocks that token too. The KL term acts on every token, blocked or not, and on the
    completions with A = 0. Its gradient with respect to log pi is 2 * kl_tau * log r. prime-rl writes
    -A * r * M, which has the same gradient. In dppo.py, --skip_zero_advantage and --overlong_filter give a
    completion the weight 0 in the loss, and so remove its KL term too."""
    log_r = log_ratio(logp, logp_anchor)
    blocked = binary_tv(logp=logp, logp_anchor=logp_anchor) > eps
    policy_gradient = -advantages * log_r.detach().exp() * (~blocked) * logp
    return policy_gradient + kl_tau * log_r**2, blocked


# -------- the paper's ablation: the anchor is pi_old


@torch.no_grad()
def recompute_anchor(model, rollout: Rollout, advantages, cfg: Config, stats: "TokenStats") -> tuple:
    """--recompute_old: the anchor becomes pi_old, the policy before the step's first update.

    pi_old is computed at the tokens of the completions that move pi (moves_pi), as far as the objective
    reads it, and is zero elsewhere. The per-token weight of the loss becomes rollout_correction's
    weight on pi_old / mu, and 0 on the other completions. Returns pi_old and that weight. The weight's
    statistics go to `stats`."""
    needs = objective_needs(cfg.objective)
    pi_old = LogProbs(
        logp=torch.zeros_like(rollout.mu.logp),
        topk_logp=torch.zeros_like(rollout.mu.topk_logp) if needs["with_topk"] else None,
        entropy=torch.zeros_like(rollout.mu.entropy) if needs["with_entropy"] else None,
    )
    A = advantages.to(model.device)
    for rows in rows_that_move_pi(torch.arange(len(A)), moves_pi(A, cfg), cfg.micro_batch_size)[0]:
        part = policy_logprobs(model, rollout.select(rows), cfg.temperature, cfg.precision, **needs)
        # A micro-batch drops its all-padding columns, so it may be narrower than pi_old.
        for whole, x in zip(pi_old, part):
            if x is not None:
                whole[rows, : x.shape[1]] = x
    modes = dict(
        mode=cfg.rollout_correction,
        cap=cfg.correction_cap,
        low=cfg.correction_low,
        high=cfg.correction_high,
    )
    real = (rollout.completion_mask * moves_pi(A, cfg)[:, None]).bool()
    weight, flagged = rollout_correction(pi_old.logp, rollout.mu.logp, real, **modes)
    stats.add("rollout_correction/weight", weight[real])
    stats.add("rollout_correction/flagged_frac", flagged[real].float())
    stats.add("policy/abs_old_minus_mu", (pi_old.logp.exp() - rollout.mu.logp.exp()).abs()[real])
    return pi_old, weight


@torch.no_grad()
def rollout_correction(logp_pi_old, logp_mu, mask, mode="tis", cap=2.0, low=0.5, high=5.0):
    """--recompute_old in the DPPO paper's form (Stable-RL's compute_policy_loss_with_mask).

    A loss anchored to pi_old, times this weight on w = pi_old / mu ('tis' with an infinite cap), has the
    gradient of -A * sg(pi / mu) * M * log pi. The modes are verl's:
        'tis'        min(w, cap)
        'token_mis'  w, or 0 outside [low, high] (IcePop)
        'seq_mis'    min(w, cap), or 0 on every token of a completion whose geometric-mean w is outside
                     [low, high]
        'none'       1
    Returns the weight, and the real tokens that it truncated or zeroed."""
    if mode not in ("tis", "token_mis", "seq_mis", "none"):
        raise ValueError(f"rollout_correction: mode must be tis, token_mis, seq_mis or none, got {mode!r}")
    real = mask.bool()
    log_w = torch.where(real, logp_pi_old - logp_mu.clamp(min=LOG_EPS), 0.0)
    w = log_w.exp()
    if mode == "none":
        return real.to(w.dtype), torch.zeros_like(real)
    if mode == "token_mis":
        kept = (w >= low) & (w <= high)
        return torch.where(kept, w, 0.0) * real, ~kept & real
    weight = w.clamp(max=cap)
    flagged = w > cap
    if mode == "seq_mis":
        geometric_mean = (log_w.sum(-1, keepdim=True) / real.sum(-1, keepdim=True).clamp(min=1)).exp()
        kept = (geometric_mean >= low) & (geometric_mean <= high)
        weight = torch.where(kept, weight, 0.0)
        flagged = flagged | ~kept
    return weight * real, flagged & real


# ==================================================================================================== plumbing


# -------- set-up: flags, device, data, model, resume, then the training loop with its log, tracker and Ctrl-C


def main(argv=None) -> dict:
    cfg = parse_config(argv)
    device = set_up_device(cfg.device)
    rank = rank_and_world()[0]
    torch.manual_seed(cfg.seed + rank)  # each process draws its own samples; rank 0 draws what one process would
    started = time.time()
    output_dir = writable_directory(Path(cfg.output_dir))
    if (output_dir / "metrics.jsonl").exists() and not (cfg.resume or cfg.overwrite_output_dir):
        fail(f"--output_dir {output_dir} holds a run: continue it with --resume, or start over: --overwrite_output_dir")
    resume_from = newest_checkpoint(Path(cfg.resume)) if cfg.resume else None
    train_problems, held_out = load_data(cfg, resume_from)
    model, tokenizer, sampler, optimizer = load_model(cfg, resume_from, device)
    prompt_limit = prompt_length_limit(cfg, tokenizer, train_problems + held_out, device)
    cfg = dataclasses.replace(cfg, max_prompt_tokens=prompt_limit)
    first_step, carried = restore_checkpoint(resume_from, model, optimizer) if resume_from else (1, {})
    last_step = cfg.epochs * (len(train_problems) // cfg.prompts_per_step) if cfg.epochs > 0 else cfg.steps
    with Run(cfg, output_dir, first_step, last_step, carried, device, started) as run:
        accuracy = train(cfg, model, sampler, tokenizer, optimizer, train_problems, held_out, run)
    if rank == 0:
        gain = f"{run.initial_accuracy:.1%} -> {accuracy:.1%} ({100 * (accuracy - run.initial_accuracy):+.1f} points)"
        took = f"in {time.time() - started:.0f} s; metrics and model in {output_dir}"
        print(f"{cfg.objective}: held-out greedy accuracy {gain} {took}")
    return {"initial_accuracy": run.initial_accuracy, "final_accuracy": accuracy}


class Run(contextlib.ExitStack):
    """The training loop's bookkeeping: the progress bar; what a checkpoint carries (the first accuracy, SAS's reward
    history, the queued rollouts, the tracker's run to continue); records to metrics.jsonl and the tracker; Ctrl-C."""

    def __init__(self, cfg, output_dir, first_step, last_step, carried, device, started):
        super().__init__()
        rank_0 = rank_and_world()[0] == 0
        self.steps = tqdm(range(first_step, last_step + 1), desc=cfg.objective, dynamic_ncols=True, disable=not rank_0)
        self.last_step, self.output_dir, self.device, self.started = last_step, output_dir, device, started
        self.initial_accuracy, self.reward_history = carried.get("initial_accuracy"), carried.get("reward_history", {})
        self.queue = collections.deque(carried.get("queue", []))  # --staleness: the rollouts sampled ahead
        self.tracker_resume = carried.get("tracker_resume")
        metrics_path = output_dir / "metrics.jsonl" if rank_0 else os.devnull
        if first_step > 1 and rank_0 and metrics_path.exists():  # resumed: what a killed run logged past its
            os.truncate(metrics_path, bytes_before(metrics_path, first_step))  # checkpoint is run, and logged, again
        self.metrics_file = self.enter_context(open(metrics_path, "a" if first_step > 1 else "w"))
        self.tracker = cfg.report_to if rank_0 else "none"
        if self.tracker == "tensorboard":  # it keeps no run config: the flags go to its text tab
            from torch.utils.tensorboard import SummaryWriter

            self.writer = self.enter_context(SummaryWriter(output_dir / "tensorboard", purge_step=first_step))
            self.writer.add_text("config", json.dumps(dataclasses.asdict(cfg)))
        elif self.tracker in ("wandb", "trackio"):  # trackio takes wandb's calls
            tracker = importlib.import_module(self.tracker)
            model = Path(cfg.model).name.removesuffix(".gguf") if cfg.model else "demo"  # a study's runs: one group
            name, group = f"{model}-{cfg.objective}-seed{cfg.seed}", output_dir.resolve().parent.name
            earlier = (self.tracker_resume or {}).get(self.tracker)  # resumed: wandb's run by its id, trackio's by name
            again = dict(resume="allow", **({"id": earlier} if self.tracker == "wandb" else {})) if earlier else {}
            self.writer = tracker.init(project="dppo", name=name, group=group, config=dataclasses.asdict(cfg), **again)
            self.tracker_resume = {self.tracker: self.writer.id}
            self.callback(self.writer.finish)
        self.ctrl_c = []  # not empty once Ctrl-C was pressed
        self.callback(signal.signal, signal.SIGINT, signal.signal(signal.SIGINT, self.on_ctrl_c))

    def on_ctrl_c(self, signum, frame):
        if self.ctrl_c:
            raise KeyboardInterrupt
        self.ctrl_c.append(True)
        if rank_and_world()[0] == 0:
            print("\nCtrl-C: stopping after this step, with a checkpoint (Ctrl-C again to quit now)", file=sys.stderr)

    def log(self, step: int, values: dict) -> dict:
        """A line at a time, flushed: a stopped run keeps every finished step."""
        scalars = {**values, "time/elapsed_s": time.time() - self.started}
        print(json.dumps({"step": step, **scalars}), file=self.metrics_file, flush=True)
        if self.tracker == "tensorboard":
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
        elif self.tracker != "none":
            self.writer.log(scalars, step=step)
        return values

    def show_progress(self, metrics: dict, accuracy: float):  # as a person reads them: tqdm would print 1.02e+4
        self.steps.set_postfix_str(
            f"acc={accuracy:.1%}, blocked={metrics['trust_region/blocked_frac']:.2%}, "
            f"gen_tok_s={metrics['throughput/generated_tokens_per_s']:.0f}, reward={metrics['reward/mean']:.3f}"
        )

    def stop_requested(self) -> bool:  # a collective: every process stops after the same step
        return all_reduced(torch.tensor(len(self.ctrl_c), device=self.device), dist.ReduceOp.MAX).item() > 0


# -------- input checks: bad input ends in one line on stderr and exit status 2 (see fail), before anything slow


def parse_config(argv=None) -> Config:
    """Flags typed on the command line always win; then the objective's own defaults; then the demo's."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], argument_default=argparse.SUPPRESS)
    parser.error = fail  # an unknown flag or objective, or a value of the wrong type: one line, exit status 2
    other_defaults = {**OBJECTIVE_DEFAULTS, "demo": DEMO_DEFAULTS}  # each flag's help lists its own
    for f in dataclasses.fields(Config):
        special = [f"{name}: {values[f.name]!r}" for name, values in other_defaults.items() if f.name in values]
        help = f"{f.metadata['help']} (default: {'; '.join([repr(f.default)] + special)})"
        boolean = isinstance(f.default, bool)
        kind = dict(action="store_true") if boolean else dict(type=type(f.default), choices=f.metadata["choices"])
        parser.add_argument(f"--{f.name}", help=help, **kind)
    given = vars(parser.parse_args(argv))  # only the flags actually typed, thanks to SUPPRESS
    demo_defaults = {} if given.get("model") else DEMO_DEFAULTS
    objective_defaults = OBJECTIVE_DEFAULTS.get(given.get("objective", Config.objective), {})
    cfg = Config(**{**demo_defaults, **objective_defaults, **given})
    cfg = dataclasses.replace(cfg, output_dir=cfg.output_dir or cfg.resume or f"runs/{cfg.objective}-seed{cfg.seed}")
    check_config(cfg)
    return cfg


MAY_BE_INFINITE = {"is_cap", "max_grad_norm", "dual_clip", "dcpo_r_max", "correction_cap", "correction_high"}


def check_config(cfg: Config):
    may_be_0 = "steps epochs weight_decay save_every cppo_delta_b_min eval_samples max_prompt_tokens staleness".split()
    may_be_0 += ["ipo_kl_tau"]
    for name, value in dataclasses.asdict(cfg).items():  # every number > 0 (`not > 0` refuses NaN too); the seed any
        at_least_0 = name in may_be_0
        if type(value) in (int, float) and name != "seed" and not (value >= 0 if at_least_0 else value > 0):
            fail(f"--{name} must be {'>=' if at_least_0 else '>'} 0, got {value}")
    for name, value in dataclasses.asdict(cfg).items():  # inf means "none" for a cap or a bound alone
        if type(value) is float and math.isinf(value) and name not in MAY_BE_INFINITE:
            fail(f"--{name} must be finite, got {value}")
    for name in ("dual_clip", "dcpo_r_max"):  # bounds on the ratio above 1
        if not getattr(cfg, name) > 1:
            fail(f"--{name} must be > 1 (a bound on the ratio r above 1), got {getattr(cfg, name)}")
    if cfg.clip_low > 1:
        fail(f"--clip_low must be <= 1 (the ratio's lower bound is 1 - clip_low), got {cfg.clip_low}")
    if cfg.cppo_w_min > 1:
        fail(f"--cppo_w_min must be in (0, 1] (the position weight falls from 1 to it), got {cfg.cppo_w_min}")
    if cfg.ppo_epochs > 1 and cfg.staleness > 0 and os.environ.get("RANK", "0") == "0":
        print("dppo.py: note: --ppo_epochs > 1 and --staleness > 0: their two lags add up", file=sys.stderr)
    if cfg.samples_per_prompt < 2:
        fail(f"--samples_per_prompt must be at least 2 (GRPO compares a group), got {cfg.samples_per_prompt}")
    if cfg.report_to != "none" and importlib.util.find_spec(cfg.report_to) is None:  # an optional extra
        fail(f"--report_to {cfg.report_to}: the {cfg.report_to} package is not installed; pip install {cfg.report_to}")
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's number of processes; each takes 1/world of a step
    if cfg.prompts_per_step % world:
        fail(f"--prompts_per_step {cfg.prompts_per_step} cannot be split over {world} processes: use a multiple")
    rollout_batch = cfg.prompts_per_step * cfg.samples_per_prompt // world  # completions per process
    if rollout_batch % cfg.updates_per_step:
        fail(
            f"--updates_per_step {cfg.updates_per_step} does not divide the rollout batch of {cfg.prompts_per_step} x "
            f"{cfg.samples_per_prompt}{f' / {world} processes' if world > 1 else ''} = {rollout_batch} completions"
        )


def writable_directory(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()  # can a file be written there?
    except OSError as error:
        fail(f"--output_dir {path}: not writable ({error.strerror or error})")
    return path


def not_in_offline_cache(subject: str, local: str) -> str:
    offline = "not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 forbids downloading it"
    return f"{subject} {offline}; pass {local} instead, or run once with HF_HUB_OFFLINE unset to download it"


def first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def require_hub(what: str):
    """One line, fast, if `what` must come from an unreachable Hub (its clients would retry, then print a traceback)."""
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return  # the loaders read the local cache
    endpoint = huggingface_hub.constants.ENDPOINT
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=5)
    except urllib.error.HTTPError:
        pass  # the Hub answered, even if with an error status: it is reachable
    except (OSError, ValueError) as error:
        fail(
            f"cannot reach the Hugging Face Hub at {endpoint} to download {what} "
            f"({getattr(error, 'reason', error)}); pass a local path instead, or set HF_HUB_OFFLINE=1 to use your cache"
        )


def fail(message: str):
    if os.environ.get("RANK", "0") == "0":
        print(f"dppo.py: error: {message}", file=sys.stderr)
    else:
        time.sleep(5)  # under torchrun rank 0 says it, while the others wait to exit
    sys.exit(2)


# -------- data: a problem is {"question": str, "answer": str}; the gold answer's last line is "#### N" (GSM8K's format)


def load_data(cfg: Config, resume_from) -> tuple[list[dict], list[dict]]:
    if resume_from and not (resume_from / "training_state.pt").is_file():
        fail(f"--resume {cfg.resume}: no checkpoint there; a run writes one with --save_every N or on Ctrl-C")
    if cfg.model and not resume_from:
        check_model_source(cfg.model)  # a --model that cannot load is refused before the dataset downloads
    train_problems, held_out = load_problems(cfg)
    if len(train_problems) < cfg.prompts_per_step or not held_out[: cfg.eval_n]:
        needs = f"a step needs {cfg.prompts_per_step} (--prompts_per_step) and evaluation at least 1"
        fail(f"--dataset {cfg.dataset}: {len(train_problems)} training and {len(held_out)} held-out problems; {needs}")
    return train_problems, held_out[: cfg.eval_n]


def load_problems(cfg: Config) -> tuple[list[dict], list[dict]]:
    if cfg.dataset == "arithmetic":
        sets = arithmetic_problems()
        return sets["train"], sets["test"]
    path = Path(cfg.dataset).expanduser()
    if path.is_file():
        problems = read_jsonl(path)
        return problems[: -cfg.eval_n], problems[-cfg.eval_n :]
    if (path / "dataset_dict.json").is_file():
        from datasets import load_from_disk

        return train_and_test(load_from_disk(str(path)), cfg.dataset)
    if path.is_dir():
        return read_jsonl(path / "train.jsonl"), read_jsonl(path / "test.jsonl")
    if cfg.dataset.startswith(("/", "./", "../", "~")) or cfg.dataset.endswith((".jsonl", ".json")):  # a local path
        fail(f"--dataset {cfg.dataset}: no such file or directory")
    name, config = ("openai/gsm8k", "main") if cfg.dataset in ("gsm8k", "openai/gsm8k") else (cfg.dataset, None)
    require_hub(f"the dataset {name}")
    from datasets import load_dataset

    try:
        splits = load_dataset(name, config)
    except (ConnectionError, FileNotFoundError) as error:  # offline and not cached; or no such dataset on the Hub
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            fail(not_in_offline_cache(f"--dataset {cfg.dataset}: the Hub dataset {name} is", "a local file or folder"))
        fail(f"--dataset {cfg.dataset}: {first_line(error)}")
    return train_and_test(splits, cfg.dataset)


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():  # in a dataset directory
        fail(f"--dataset {path.parent}: no {path.name} there (a dataset directory holds train.jsonl and test.jsonl)")
    problems = []
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            problem = json.loads(line)
        except json.JSONDecodeError as error:
            fail(f"{path}, line {number}: not valid JSON ({error.msg})")
        if not isinstance(problem, dict) or not all(isinstance(problem.get(k), str) for k in ("question", "answer")):
            fail(f"{path}, line {number}: needs string fields 'question' and 'answer'")
        problems.append(problem)
    return problems


def train_and_test(splits, source: str) -> tuple[list[dict], list[dict]]:
    for split in ("train", "test"):
        if split not in splits:
            names = ", ".join(map(repr, splits))
            fail(f"--dataset {source}: no {split!r} split (it has {names}); train and test are needed")
        if not {"question", "answer"} <= set(splits[split].column_names):
            fail(f"--dataset {source}: its {split} split has columns {splits[split].column_names}, no question/answer")
    return [dict(row) for row in splits["train"]], [dict(row) for row in splits["test"]]


def prompt_length_limit(cfg: Config, tokenizer, problems: list[dict], device: torch.device) -> int:
    """--max_prompt_tokens, with no prompt longer; under the static cache, if 0, the longest rounded up to 64."""
    if not (cfg.max_prompt_tokens or uses_static_cache(cfg, device)):
        return 0
    prompts = [format_prompt(tokenizer, p["question"]) for p in problems]
    longest = max(map(len, tokenizer(prompts, add_special_tokens=not tokenizer.chat_template).input_ids))
    if cfg.max_prompt_tokens and longest > cfg.max_prompt_tokens:
        fail(f"--max_prompt_tokens {cfg.max_prompt_tokens}: the data set has a prompt of {longest} tokens")
    return cfg.max_prompt_tokens or -(-longest // 64) * 64


# -------- model and sampler


def load_model(cfg: Config, resume_from, device) -> tuple:
    with torch.random.fork_rng(devices=[]):  # so a run samples the same whether or not the demo model was cached
        checkpoint = str(resume_from) if resume_from else cfg.model or build_tiny_model(cfg.cache_dir)
    sharded = dist.is_initialized()  # then the model is built empty and filled from rank 0, see fill_from_rank_0
    model, tokenizer = load_policy(checkpoint, device, cfg.gradient_checkpointing, empty=sharded)
    if cfg.topk > model.get_output_embeddings().weight.shape[0]:
        fail(f"--topk {cfg.topk} is more than the model's {model.get_output_embeddings().weight.shape[0]} tokens")
    sampler = make_sampler(model, cfg.sampler_dtype)  # the policy itself unless --sampler_dtype is given
    model = shard(model, in_bf16(cfg.precision, device))
    if sharded:
        whole = load_policy(checkpoint, torch.device("cpu"))[0] if rank_and_world()[0] == 0 else None
        for module in [model] if sampler is model else [model, sampler]:
            fill_from_rank_0(module, whole, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return model, tokenizer, sampler, optimizer


def load_policy(name_or_path: str, device: torch.device, gradient_checkpointing: bool = False, empty: bool = False):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # read when a tokenizer first runs in parallel
    AttentionInterface.register("sdpa_packed_decode", packed_decode_attention)  # here, not on import: see its
    AttentionMaskInterface.register("sdpa_packed_decode", sdpa_mask)  # docstring; its masks are SDPA's
    gguf = {"gguf_file": os.path.basename(name_or_path)} if name_or_path.endswith(".gguf") else {}
    where = os.path.dirname(os.path.abspath(name_or_path)) if gguf else name_or_path
    try:
        tokenizer, config = AutoTokenizer.from_pretrained(where, **gguf), AutoConfig.from_pretrained(where, **gguf)
        for key, value in config.to_dict().items():  # dropout off: the update runs in train mode, where pi must be mu
            if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
                setattr(config, key, 0.0)
        if empty:  # built on the meta device, without weights (see fill_from_rank_0)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with contextlib.suppress(OSError):  # the EOS ids, as from_pretrained reads them
                model.generation_config = GenerationConfig.from_pretrained(name_or_path)
        else:
            model = AutoModelForCausalLM.from_pretrained(where, **gguf, config=config, dtype=torch.float32).to(device)
            check_output_logits(model, name_or_path)
        if gguf and not empty:  # its weights, dequantized to fp32, are trained and saved as an ordinary checkpoint's
            model.hf_quantizer = None
            del model.config.quantization_config
    except OSError as error:  # no such model on the Hub, or only part of it in the offline cache, ...
        fail(f"--model {name_or_path}: {first_line(error)}")
    except (ValueError, struct.error) as error:  # a GGUF file cut short: fewer bytes than its header names
        if not gguf:
            raise
        fail(f"--model {name_or_path}: truncated or unreadable: {first_line(error)}")
    if gradient_checkpointing:  # non-reentrant torch.utils.checkpoint per decoder layer, in train mode only
        model.activation_checkpointing_enable()
    eos = model.generation_config.eos_token_id
    eos_ids = sorted({tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None})
    if not eos_ids:
        fail(f"--model {name_or_path}: neither its tokenizer nor its generation config names an EOS token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # EOS ids only: generate() would take every unset setting from the checkpoint's (Qwen2.5: top_k 20, top_p 0.8, ...)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
    if model._supports_sdpa:  # else the attention it loaded with (Gemma 2's soft-capped scores: eager)
        model.set_attn_implementation("sdpa_packed_decode")  # SDPA as before; see packed_decode_attention
    return model, tokenizer


def check_output_logits(model, name_or_path: str):
    """A model whose forward makes its logits otherwise than OutputLogits is refused: pi would not be what mu is."""
    with torch.no_grad():  # on the first 8 token ids: a few positions suffice
        out = model(input_ids=torch.arange(8, device=model.device)[None], output_hidden_states=True)
        ours, theirs = OutputLogits(model)(out.hidden_states[-1]), out.logits.float()
    if not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max())):
        named = ", ".join(f"{key} {value}" for key, value in model.config.to_dict().items() if "logit" in key and value)
        fail(f"--model {name_or_path}: its forward changes its output layer's logits ({named or '?'}): not loaded")


class OutputLogits:
    """The logits, fp32, as the model's forward makes them: the output layer, then what its config says comes after
    (Cohere's logit_scale, Granite's logits_scaling, Gemma's final_logit_softcapping c: c * tanh(logits / c))."""

    def __init__(self, model):
        config = model.config.get_text_config()
        self.lm_head, self.vocab_size = model.get_output_embeddings(), model.get_output_embeddings().weight.shape[0]
        self.scale = (getattr(config, "logit_scale", None) or 1.0) / (getattr(config, "logits_scaling", None) or 1.0)
        self.cap = getattr(config, "final_logit_softcapping", None)

    def __call__(self, hidden):
        logits = self.lm_head(hidden).float() * self.scale  # * 1.0 for most models: the same bits
        return self.cap * torch.tanh(logits / self.cap) if self.cap else logits


CPU_FLAGS = {"bfloat16": {"avx512_bf16", "amx_bf16", "bf16"}, "float16": {"avx512_fp16", "amx_fp16", "asimdhp"}}


def make_sampler(model, sampler_dtype: str):
    if sampler_dtype == "policy":
        return model
    cpuinfo = Path("/proc/cpuinfo")  # Linux's: the CPU's instructions (CPU_FLAGS: bf16's and fp16's, x86's and Arm's)
    on_a_cpu = model.device.type == "cpu" and sampler_dtype in CPU_FLAGS and rank_and_world()[0] == 0
    if on_a_cpu and cpuinfo.exists() and not set(cpuinfo.read_text().split()) & CPU_FLAGS[sampler_dtype]:
        why = "torch emulates them: sampling takes several times as long as with --sampler_dtype float32"
        print(f"dppo.py: this CPU has no {sampler_dtype} instructions; {why}", file=sys.stderr)
    return copy.deepcopy(model).to(getattr(torch, sampler_dtype)).eval().requires_grad_(False)


@torch.no_grad()
def refresh_sampler(sampler, model):
    if sampler is not model:
        weights = sampler.state_dict()
        for name, value in model.state_dict().items():
            weights[name].copy_(value.full_tensor() if isinstance(value, DTensor) else value)


def check_model_source(name_or_path: str):
    local = Path(name_or_path).expanduser()
    if name_or_path.endswith(".gguf"):  # its first bytes; load_policy names a file cut short as it reads the header
        if not local.is_file():
            fail(f"--model {name_or_path}: no such file")
        with local.open("rb") as file:
            magic = file.read(4)
        if magic != b"GGUF":
            fail(f"--model {name_or_path}: {'not a GGUF file' if magic else 'an empty file'}")
        if importlib.util.find_spec("gguf") is None:  # an optional extra, needed for GGUF files alone
            fail(f"--model {name_or_path}: reading a GGUF file needs the gguf package; pip install gguf accelerate")
        return
    if local.exists():
        if not (local / "config.json").is_file():
            fail(f"--model {name_or_path}: no config.json there (a model directory is one written by save_pretrained)")
        if not any(local.glob("*.safetensors")) and not any(local.glob("*.bin")):
            fail(f"--model {name_or_path}: no weights there (*.safetensors or *.bin)")
        return
    try:  # a local path (./x, ../x, ~/x, /x, a/b/c) is never a Hub id
        huggingface_hub.utils.validate_repo_id(name_or_path)
    except huggingface_hub.utils.HFValidationError:
        fail(f"--model {name_or_path}: no such directory")
    require_hub(f"the model {name_or_path}")
    cached = huggingface_hub.try_to_load_from_cache(name_or_path, "config.json")
    if huggingface_hub.constants.HF_HUB_OFFLINE and not isinstance(cached, str):
        fail(not_in_offline_cache(f"--model {name_or_path}:", "a local model directory"))


# -------- processes: under torchrun N processes share every step, each on P/N of its prompts, FSDP2-sharded; global
# numbers (normalisers, rewards, metrics) are added up; rank 0 alone writes. Without torchrun all this is a no-op.


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def this_process_share(items, interleaved=False):
    """This process's 1/world of items: contiguous (a step's prompts, advantages) or interleaved (evaluation's)."""
    rank, world = rank_and_world()
    return items[rank::world] if interleaved else items[rank * len(items) // world : (rank + 1) * len(items) // world]


def set_up_device(name: str) -> torch.device:
    device = torch.device(name if name != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    if "LOCAL_RANK" in os.environ:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def shard(model, bf16=False):
    if not dist.is_initialized():
        return model
    precision = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
    # policy_logprobs's hidden states include the layers' outputs, views that nothing here writes to in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for unit in [*model.get_decoder().layers, model]:  # each decoder layer, then the root
        fully_shard(unit, mp_policy=precision)
        unit.set_gradient_divide_factor(1.0)  # token_weights divide by the whole mini-batch's count across
        unit.set_force_sum_reduction_for_comms(True)  # processes, so their gradients add up, not average
    return model


def fill_from_rank_0(module, whole, device):
    """Rank 0 alone has read the weights (`whole`, on CPU): fill every process's share of `module`, built on meta."""
    module.to_empty(device=device)
    if isinstance(module, FSDPModule):  # (a sampler copy gets its weights from refresh_sampler before each rollout)
        weights = whole.state_dict() if whole is not None else {}
        set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in module.named_buffers():  # what a state dict leaves out (RoPE's)
        if whole is not None:
            buffer.copy_(whole.get_buffer(name))
        dist.broadcast(buffer, src=0)


@contextlib.contextmanager
def full_weights(model):
    """Whole weights for generate, gathered once (FSDP2 alone would gather them for every token); a collective."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not model, recurse=False)  # FSDP2 keeps the root gathered


def leave_after_rank_0(message: str):
    """sys.exit(message) on rank 0, once every process is here; the others leave with status 0, since torchrun stops
    every process (SIGTERM) once one exits non-zero, which would cut rank 0's model, message or tracker short."""
    if dist.is_initialized():
        dist.barrier()
    sys.exit(message if rank_and_world()[0] == 0 else 0)


def all_reduced(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """x added up over the processes, in place (op=dist.ReduceOp.MAX: the largest): one collective for a tensor."""
    if dist.is_initialized():
        dist.all_reduce(x, op)
    return x


def all_gathered(x: torch.Tensor) -> torch.Tensor:
    """Every process's x (each the same shape), concatenated in rank order."""
    if not dist.is_initialized():
        return x
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else x.device
    parts = [torch.empty_like(x, device=on) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.to(on))
    return torch.cat(parts).to(x.device)


def all_gathered_objects(item) -> list:
    """Every process's item (any picklable object), in rank order: for checkpoints, not for the training loop."""
    if not dist.is_initialized():
        return [item]
    items = [None] * dist.get_world_size()
    dist.all_gather_object(items, item)
    return items


# -------- generation (prompts to tokens, tokens to text, bf16 autocast, the static cache), then checkpoints


def generate(model, tokenizer, prompts: list[str], cfg: Config, prefill_once=False, **decoding):
    """(prompt inputs, completion ids, completion mask) of model.generate, prompts left-padded (tokenize_prompts).
    With prefill_once, a prompt repeated in consecutive rows (a GRPO group) is prefilled once, not once a row."""
    static = uses_static_cache(cfg, model.device)
    inputs = tokenize_prompts(tokenizer, prompts, model.device, length=cfg.max_prompt_tokens if static else 0)
    prompt_length = inputs.input_ids.shape[1]
    cache = StaticCache(model.config, max_cache_len=prompt_length + cfg.max_new_tokens) if static else None
    if prefill_once and any(this == next_one for this, next_one in zip(prompts, prompts[1:])):
        cache = prefilled_cache(model, inputs, prompts, cache)
    if cache is not None:
        decoding |= dict(cache=cache, disable_compile=isinstance(model, FSDPModule))  # FSDP2's gathered weights move
    completion_ids = model.generate(**inputs, max_new_tokens=cfg.max_new_tokens, **decoding)[:, prompt_length:]
    return inputs, completion_ids, completion_mask(completion_ids, model.generation_config.eos_token_id)


def uses_static_cache(cfg: Config, device: torch.device) -> bool:
    """--generation_cache auto is static on CUDA, where generate then compiles its decoding step once, and dynamic
    elsewhere. A static cache is allocated once, so every call has the same shapes. Its values keep their own dtype
    (transformers >= 5.24): under bf16 autocast RoPE turns the keys fp32, while the values stay bf16."""
    return cfg.generation_cache == "static" or (cfg.generation_cache == "auto" and device.type == "cuda")


@torch.no_grad()
def prefilled_cache(model, inputs, prompts: list[str], cache=None):
    """Fills `cache` (a new DynamicCache if None) with the keys and values of every prompt but its last token. A run of
    equal consecutive prompts is computed once and copied to each of its rows. generate then starts from the last
    prompt token, as it does for any cache that holds a prefix. The prefill batch is smaller than the whole batch, so
    its numbers may differ from the whole batch's by rounding."""
    firsts = [row for row in range(len(prompts)) if row == 0 or prompts[row] != prompts[row - 1]]
    copies = torch.tensor(firsts[1:] + [len(prompts)]) - torch.tensor(firsts)
    input_ids, mask = inputs.input_ids[firsts, :-1], inputs.attention_mask[firsts, :-1]
    position_ids = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)  # as generate numbers a left-padded prompt
    prefix = DynamicCache(config=model.config)
    cache = DynamicCache(config=model.config) if cache is None else cache
    model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=prefix, logits_to_keep=1)
    copies = copies.to(input_ids.device)
    for index, layer in enumerate(prefix.layers):
        cache.update(layer.keys.repeat_interleave(copies, 0), layer.values.repeat_interleave(copies, 0), index)
    return cache


def tokenize_prompts(tokenizer, prompts: list[str], device, length=0) -> dict:
    """Left-padded (every completion starts in the same column) to `length`, or to the longest prompt if 0."""
    padding = dict(padding="max_length", max_length=length) if length else dict(padding=True)
    special = not tokenizer.chat_template  # a chat template already holds the special tokens
    inputs = tokenizer(prompts, return_tensors="pt", padding_side="left", add_special_tokens=special, **padding)
    return inputs.to(device)


def completion_mask(completion_ids, eos_ids) -> torch.Tensor:
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device)).long()
    return (is_eos.cumsum(1) - is_eos == 0).float()  # 1.0 up to and including the first EOS (generate() pads after)


def decode(tokenizer, completion_ids, mask) -> list[str]:
    lengths = mask.sum(1).long().tolist()  # up to and including the first EOS
    completions = [ids[:n] for ids, n in zip(completion_ids.tolist(), lengths)]
    return tokenizer.batch_decode(completions, skip_special_tokens=True)


def autocast(model, precision: str):
    """bf16 matmuls over fp32 weights; not for a sampler copy in its own dtype, nor under FSDP2 (see shard)."""
    if in_bf16(precision, model.device) and model.dtype == torch.float32 and not isinstance(model, FSDPModule):
        return torch.autocast(model.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def in_bf16(precision: str, device: torch.device) -> bool:
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def packed_decode_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA, but a decode step packs each KV head's group of query heads as its query rows compiled too
    (transformers packs them uncompiled only): the KV cache is read once, not per head (figures/gpu_decode_h200)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] > 1 or groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    B, H, _, D = query.shape
    packed = query.view(B, H // groups, groups, D)  # (B, H, 1, D) -> (B, H_kv, H / H_kv, D)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attention_mask, scale=kwargs["scaling"])
    return out.reshape(B, 1, H, D), None  # as transformers' attention functions return it


def save_model(model, tokenizer, directory: Path):
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank_and_world()[0] == 0:
        model.save_pretrained(directory, state_dict=weights)
        tokenizer.save_pretrained(directory)


def save_checkpoint(run: "Run", model, tokenizer, optimizer, step: int):
    partial, final, old = (run.output_dir / name for name in ("checkpoint.partial", "checkpoint", "checkpoint.old"))
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights, optimizer_state = get_state_dict(model, optimizer, options=whole)
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    random_states = all_gathered_objects({"torch": torch.get_rng_state(), "cuda": cuda_states})  # every process's
    # each process's queued rollouts (--staleness) as tensors and plain values: a checkpoint holds no classes
    plain = [dict(w._asdict(), rollout=dict(vars(w.rollout), mu=w.rollout.mu._asdict())) for w in run.queue]
    queue = all_gathered_objects(tensors_to(plain, "cpu"))
    if rank_and_world()[0] == 0:
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, state_dict=weights)
        tokenizer.save_pretrained(partial)
        carried = {name: getattr(run, name) for name in ("initial_accuracy", "reward_history", "tracker_resume")}
        state = dict(step=step, optimizer=optimizer_state, random_states=random_states, queue=queue, **carried)
        torch.save(state, partial / "training_state.pt.tmp")
        (partial / "training_state.pt.tmp").rename(partial / "training_state.pt")  # last: now partial is whole
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)  # one a kill left before its removal: final is whole and newer
            final.rename(old)
        partial.rename(final)  # written aside, then renamed: a kill anywhere leaves a whole one (newest_checkpoint)
        shutil.rmtree(old, ignore_errors=True)


def newest_checkpoint(output_dir: Path) -> Path:
    """The newest whole one wherever a kill fell in save_checkpoint: partial once its training_state.pt is in (last)"""
    names = ("checkpoint.partial", "checkpoint", "checkpoint.old")
    whole = [output_dir / name for name in names if (output_dir / name / "training_state.pt").is_file()]
    return (whole or [output_dir / "checkpoint"])[0]


def restore_checkpoint(checkpoint: Path, model, optimizer) -> tuple[int, dict]:
    try:
        state = torch.load(checkpoint / "training_state.pt", weights_only=True)  # a checkpoint cannot run code
    except pickle.UnpicklingError:
        fail(f"--resume: {checkpoint}/training_state.pt holds more than tensors and plain Python values; not loaded")
    rank, world = rank_and_world()
    if len(state["random_states"]) != world:
        fail(f"--resume: {checkpoint} was written by {len(state['random_states'])} processes, and this run has {world}")
    set_optimizer_state_dict(model, optimizer, state.pop("optimizer"), options=StateDictOptions(full_state_dict=True))
    torch.set_rng_state(state["random_states"][rank]["torch"])
    if state["random_states"][rank]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["random_states"][rank]["cuda"])
    plain = tensors_to(state["queue"][rank], model.device)  # this process's queued rollouts, rebuilt
    queue = [
        Sampled(**w | {"rollout": Rollout(**w["rollout"] | {"mu": LogProbs(**w["rollout"]["mu"])})}) for w in plain
    ]
    return state["step"] + 1, state | {"queue": queue}


def bytes_before(metrics: Path, step: int) -> int:
    """The bytes of metrics.jsonl's records of steps before `step` (a killed run's later ones, or a cut one, follow)"""
    return sum(len(line) for line in metrics.open("rb") if line.endswith(b"\n") and json.loads(line)["step"] < step)


def tensors_to(tree, device):  # every tensor in nested dicts and lists moved
    return torch.utils._pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


# -------- diagnostics: what a step did, for metrics.jsonl, outside the loss path


# The DPPO paper argues that PPO's ratio clip falls mostly on rare tokens (mu(a_t) < RARE_TOKEN_MU), a divergence mask
# not: the clip objectives are compared with DPPO's binary-TV mask at --delta_low/--delta_high (add_token_stats).
RARE_TOKEN_MU = 0.15


@torch.no_grad()
def add_token_stats(stats, cfg: Config, sampled: Rollout, pi: LogProbs, anchor: LogProbs, A, blocked, first: bool):
    """A micro-batch's statistics. On a step's first update pi is pi_old: |pi - mu| is the sampler's numerics (k=0)"""
    real, logp, logp_anchor = sampled.completion_mask.bool(), pi.logp, anchor.logp
    blocked = blocked & (A != 0)  # a token with A = 0 has no gradient to lose
    p, q = logp.exp(), sampled.mu.logp.exp()
    rare = q < RARE_TOKEN_MU
    tv = binary_tv(logp=logp, logp_anchor=logp_anchor)  # D of DPPO's binary-TV mask, for the two comparisons below
    stats.add("trust_region/blocked_frac", blocked[real].float())
    stats.add("trust_region/blocked_frac_pos_adv", (blocked & (A > 0))[real].float())
    stats.add("trust_region/blocked_frac_neg_adv", (blocked & (A < 0))[real].float())
    stats.add("policy/rare_token_frac", rare[real].float())
    stats.add("trust_region/blocked_rare_frac", (blocked & rare)[real].float())
    stats.add("policy/abs_pi_minus_mu", (p - q).abs()[real])
    stats.add("policy/mismatch_first_update" if first else "policy/drift_later_updates", (p - q).abs()[real])
    if cfg.objective not in ("pg", "cispo"):  # the mask's split (pg and cispo block nothing): which side, how far
        for sign, has_sign in (("pos", A > 0), ("neg", A < 0)):
            for side, moved in (("rising", logp > logp_anchor), ("falling", logp < logp_anchor)):
                stats.add(f"trust_region/blocked_frac_{sign}_adv_{side}", (blocked & has_sign & moved)[real].float())
        stats.add("trust_region/abs_pi_minus_mu_blocked", (p - q).abs()[real & blocked])
        stats.add("trust_region/abs_pi_minus_mu_kept", (p - q).abs()[real & ~blocked & (A != 0)])
        stats.add("trust_region/blocked_at_branching_frac", (q < 0.5)[real & blocked].float())  # of blocked tokens
    if cfg.objective in ("ppo_clip", "dcpo", "erc", "gspo"):  # would DPPO's binary-TV mask have blocked them too?
        tv_blocked = dppo_loss(logp, logp_anchor, A, tv, delta_low=cfg.delta_low, delta_high=cfg.delta_high)[1]
        stats.add("trust_region/blocked_also_by_tv_frac", (blocked & tv_blocked)[real].float())
    if cfg.objective == "erc":
        kept = entropy_ratio_kept(pi.entropy, anchor.entropy, cfg.erc_beta_low, cfg.erc_beta_high)
        stats.add("erc/kept_frac", kept[real].float())
    elif cfg.objective == "cispo":  # its clip moves the weight, not the token: how often it does
        clipped = cispo_weight(logp, logp_anchor, cfg.clip_low, cfg.clip_high) != log_ratio(logp, logp_anchor).exp()
        stats.add("cispo/clipped_frac", clipped[real].float())
    elif cfg.objective in ("binary_tv", "binary_kl", "topk_tv", "topk_kl"):
        stats.add("trust_region/divergence", dppo_divergence(cfg.objective, pi, anchor)[real])
    elif cfg.objective == "drpo":  # its weight on each token's gradient, 1 -+ D / delta; blocked: weight <= 0
        stats.add("drpo/weight", drpo_weight(logp, logp_anchor, A, cfg.drpo_delta)[real])
        stats.add("drpo/nonpositive_weight_frac", blocked[real].float())
    elif cfg.objective == "cppo":  # blocked by its position weight or budget where DPPO's binary TV at delta keeps it
        tv_blocked = dppo_loss(logp, logp_anchor, A, tv, delta_low=cfg.cppo_delta, delta_high=cfg.cppo_delta)[1]
        stats.add("cppo/blocked_beyond_tv_frac", (blocked & ~tv_blocked)[real].float())


class TokenStats(dict):
    """name -> (sum, count, max) over a step's tokens, kept on the device; reported over every process as a share if
    "_frac" is in the name, else as _mean and _max."""

    def add(self, name: str, values: torch.Tensor):  # values may be empty: a name is reported if any process has some
        total, count, largest = self.get(name, (0.0, 0, values.new_full((), -math.inf, dtype=torch.float64)))
        largest = torch.cat([values.flatten().double(), largest.view(1)]).max()
        self[name] = (total + values.sum().double(), count + values.numel(), largest)

    def metrics(self) -> dict:
        names = sorted(self)
        totals = torch.stack([self[name][0] for name in names])
        totals, counts = all_reduced(torch.cat([totals, totals.new_tensor([self[name][1] for name in names])])).chunk(2)
        maxima = all_reduced(torch.stack([self[name][2] for name in names]), dist.ReduceOp.MAX).tolist()
        reported = {}
        for name, mean, maximum, count in zip(names, (totals / counts).tolist(), maxima, counts.tolist()):
            if count > 0:  # else no token of this kind on any process this step
                reported |= {name: mean} if "_frac" in name else {f"{name}_mean": mean, f"{name}_max": maximum}
        return reported


class UpdateMetrics(TokenStats):
    """The update's diagnostics: each optimizer step's loss (float64) and gradient norm, whose means are reported, and
    the token statistics of add_token_stats."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg, self.losses, self.grad_norms = cfg, [], []

    def add_micro_batch(self, update: int, loss, sampled: Rollout, pi: LogProbs, anchor: LogProbs, A, blocked):
        if update == len(self.losses):
            self.losses.append(torch.zeros((), dtype=torch.float64, device=loss.device))
        self.losses[update] += loss.detach()
        add_token_stats(self, self.cfg, sampled, pi, anchor, A, blocked, first=update == 0)

    def add_update(self, update: int, grad_norm: torch.Tensor, rollout: Rollout, left_out: torch.Tensor):
        """An optimizer step's gradient norm, and the completions it left out (A = 0)."""
        self.add_left_out(rollout, left_out)
        self.add_grad_norm(update, grad_norm)

    def add_left_out(self, rollout: Rollout, rows: torch.Tensor):
        """Completions with A = 0, not computed: kept in every share of blocked tokens; counted in mu's rare share."""
        real = rollout.completion_mask[rows].bool()
        self.add("policy/rare_token_frac", (rollout.mu.logp[rows].exp() < RARE_TOKEN_MU)[real].float())
        for name in [n for n in self if "blocked" in n and "_frac" in n and "branching" not in n or "nonpositive" in n]:
            self.add(name, real.new_zeros(int(real.sum())))

    def add_grad_norm(self, update: int, grad_norm: torch.Tensor):
        self.grad_norms.append(grad_norm.item())
        if not math.isfinite(self.grad_norms[-1]):  # the same on every process: the norm is over the whole model
            raise FloatingPointError(
                f"non-finite loss {self.losses[update].item()} or gradient norm {self.grad_norms[-1]} in update "
                f"{update + 1} of {self.cfg.ppo_epochs * self.cfg.updates_per_step}"
            )

    def metrics(self) -> dict:
        losses = all_reduced(torch.stack(self.losses)).tolist()  # each mini-batch's loss, every process's share added
        grad_norm = sum(self.grad_norms) / len(self.grad_norms)
        return {"loss": sum(losses) / len(losses), "grad_norm": grad_norm, **super().metrics()}


def step_metrics(step: int, sampled: Sampled, clock: dict, model, cfg: Config) -> dict:
    """A step's metrics over every process: its rewards, completions, times and memory peaks."""
    rollout, mask = sampled.rollout, sampled.rollout.completion_mask
    rewards, advantages = (
        all_gathered(sampled.rewards),
        all_gathered(sampled.advantages),
    )  # every process's, in prompt order
    groups = rewards.view(-1, cfg.samples_per_prompt)
    answers = sum(extract_answer(text) is not None for text in rollout.texts)
    sums = [len(rollout.texts), answers, mask.sum(), rollout.truncated.sum(), (rollout.mu.entropy * mask).sum()]
    sums = all_reduced(torch.stack([torch.as_tensor(x, dtype=torch.float64, device=mask.device) for x in sums]))
    completions, answers, tokens, truncated, entropy = sums.tolist()
    (rollout_s, rollout_mb), (update_s, update_mb) = clock.get("rollout", (0.0, 0.0)), clock["update"]
    lag = {"policy/staleness_steps": step - sampled.sampled_at, "rollout/sampled_at_step": sampled.sampled_at}
    peaks = all_reduced(mask.new_tensor([rollout_mb, update_mb], dtype=torch.float64), dist.ReduceOp.MAX)
    return {
        "reward/mean": rewards.mean().item(),
        "reward/zero_spread_groups": (groups.std(1) <= EQUAL_REWARDS_STD).float().mean().item(),
        "reward/answer_found": answers / completions,
        "completion/length_mean": tokens / completions,
        "completion/truncated": truncated / completions,
        "policy/entropy_mu": entropy / tokens,
        "advantage/nonzero_frac": (advantages != 0).float().mean().item(),
        "time/rollout_s": rollout_s,
        "time/update_s": update_s,
        "throughput/generated_tokens_per_s": tokens / rollout_s if rollout_s else 0.0,
        "throughput/trained_tokens_per_s": tokens / update_s,
        "memory/rollout_peak_mb": peaks[0].item(),
        "memory/update_peak_mb": peaks[1].item(),
        **(lag if cfg.staleness else {}),
    }


class PhaseClock(dict):
    """phase -> (seconds, peak memory in MiB) of a step's calls of the functions timed for that phase (see timed)."""

    device = torch.device("cpu")  # train's restart gives it the model's

    def restart(self, device: torch.device):
        self.clear()
        self.device = device


STEP_CLOCK = PhaseClock()


def reset_peak_memory(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.reset_peak_memory_stats(device)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets the process's peak RSS (VmHWM)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with contextlib.suppress(OSError, StopIteration), open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))
    return math.nan


# ============================================================================ the offline demo
# With no --model: GSM8K-shaped arithmetic, a tiny model warm-started on it, and these in place of Config's defaults.
DEMO_DEFAULTS = dict(dataset="arithmetic", max_new_tokens=16, eval_every=20, eval_n=500, eval_batch_size=250)
DEMO_DEFAULTS |= dict(steps=200, updates_per_step=2, micro_batch_size=128, learning_rate=1e-4)


ARITHMETIC_TEMPLATES = [  # (operation, question); {n} is a name, {x} a plural noun
    ("+", "{n} has {a} {x}. {n} gets {b} more. How many {x} does {n} have now?"),
    ("+", "There are {a} {x} in a box and {b} {x} on the table. How many {x} are there in all?"),
    ("-", "{n} has {a} {x} and gives away {b}. How many {x} does {n} have left?"),
    ("-", "A shop had {a} {x} and sold {b} of them. How many {x} are left?"),
    ("*", "{n} buys {a} bags with {b} {x} in each. How many {x} does {n} buy?"),
    ("*", "There are {a} rows of {b} {x}. How many {x} are there?"),
]
NAMES = ["Ann", "Ben", "Cai", "Dev", "Eli", "Fay", "Gus", "Ida"]
NOUNS = ["apples", "pens", "cards", "books", "shells", "coins", "eggs", "stamps"]


def arithmetic_problems(n_warmup=2000, n_test=500, n_train=5000, seed=1234) -> dict[str, list[dict]]:
    rng, problems = random.Random(seed), {}  # question -> problem, as first drawn
    while len(problems) < n_warmup + n_test + n_train:
        op, template = rng.choice(ARITHMETIC_TEMPLATES)
        low, high = {"+": (1, 10), "-": (2, 20), "*": (2, 9)}[op]
        a = rng.randint(low, high)
        b = rng.randint(1, a - 1) if op == "-" else rng.randint(low, high)
        question = template.format(n=rng.choice(NAMES), x=rng.choice(NOUNS), a=a, b=b)
        c = {"+": a + b, "-": a - b, "*": a * b}[op]
        problems.setdefault(question, {"question": question, "answer": f"{a} {op} {b} = {c}\n#### {c}"})
    problems = list(problems.values())  # one-step problems, each question once: the three sets are disjoint
    test_end = n_warmup + n_test
    return dict(warmup=problems[:n_warmup], test=problems[n_warmup:test_end], train=problems[test_end:])


def train_tokenizer(corpus: list[str], vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special_tokens, alphabet = ["<|endoftext|>", "<|pad|>"], pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=alphabet)
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|pad|>")


TINY_MODEL_VERSION = "tiny-qwen2-v1"  # bump when the recipe below changes, so caches are rebuilt


def build_tiny_model(cache_dir: str) -> str:
    """The demo's policy, built once: a tiny Qwen2 warm-started to ~30% dev accuracy, so RL starts part-competent."""
    path = Path(cache_dir).expanduser() / TINY_MODEL_VERSION
    if (path / "config.json").exists():
        return str(path)
    print(f"building the tiny demo model in {path} (once)")
    torch.manual_seed(0)
    sets = arithmetic_problems()
    building = path.with_name(f"{path.name}.building-{os.getpid()}")
    corpus = [f"Question: {p['question']}\nAnswer: {p['answer']}" for p in sets["warmup"] + sets["train"]]
    trained = train_tokenizer(corpus)
    tokens = dict(vocab_size=len(trained), eos_token_id=trained.eos_token_id, pad_token_id=trained.pad_token_id)
    layers = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config = Qwen2Config(**tokens, hidden_size=128, intermediate_size=512, **layers, tie_word_embeddings=True)
    trained.save_pretrained(building)
    config.save_pretrained(building)
    # as users will: next to a qwen2 config, a Qwen2 tokenizer (digit by digit)
    tokenizer = AutoTokenizer.from_pretrained(building)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=[trained.eos_token_id], pad_token_id=trained.pad_token_id)
    warm_up(model, tokenizer, sets["warmup"][:-200], dev=sets["warmup"][-200:], target_accuracy=0.30)
    model.save_pretrained(building)
    try:
        building.rename(path)
    except OSError:  # another process finished first: use theirs
        shutil.rmtree(building)
    return str(path)


def warm_up(model, tokenizer, problems, dev, target_accuracy, batch_size=64, lr=2e-3, check_every=10, max_steps=2000):
    """Supervised fine-tuning on gold solutions until greedy dev accuracy reaches target_accuracy."""
    optimizer, rng = torch.optim.AdamW(model.parameters(), lr=lr), random.Random(0)
    dev_cfg = Config(max_new_tokens=16, eval_batch_size=len(dev))
    for step in range(1, max_steps + 1):
        batch = rng.sample(problems, batch_size)
        prompts = tokenize_prompts(tokenizer, [format_prompt(tokenizer, p["question"]) for p in batch], "cpu")
        answers = [" " + p["answer"] + tokenizer.eos_token for p in batch]
        targets = tokenizer(answers, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        mask = targets.attention_mask
        prompt = dict(prompt_ids=prompts.input_ids, prompt_mask=prompts.attention_mask)
        pairs = SimpleNamespace(**prompt, completion_ids=targets.input_ids, completion_mask=mask)
        loss = -(policy_logprobs(model, pairs, 1.0).logp * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % check_every == 0:
            accuracy = evaluate(model, tokenizer, dev, dev_cfg)["eval/accuracy"]
            print(f"  warm-up step {step}: loss {loss.item():.3f}, dev accuracy {accuracy:.1%}")
            if accuracy >= target_accuracy:
                break


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # once main's sharded model is collected, gloo's threads end while Python still runs
        gc.collect()  # (at exit, they would free its tensors as the interpreter goes: SIGABRT, pytorch issue 190489)
        dist.destroy_process_group()
