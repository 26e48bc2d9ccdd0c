"""dppo.py: RL post-training of a language model with trust-region policy objectives, in one file.

    python dppo.py                                    # offline demo: a built-in tiny model learns arithmetic on a CPU
    python dppo.py --objective topk_tv                # the same with DPPO's top-K TV trust region
    python dppo.py --model Qwen/Qwen2.5-0.5B-Instruct  # GSM8K on one GPU
    torchrun --nproc_per_node 8 dppo.py --model Qwen/Qwen2.5-1.5B-Instruct  # on 8 GPUs, sharded with FSDP2

One training step (read the file top to bottom, in this order):
    config -> data -> model -> processes (torchrun) -> rollout -> rewards -> advantages -> objectives -> update
    -> evaluation -> main
    1. rollout: P prompts x G samples in one batched Hugging Face `generate`. While sampling we record,
       per completion token, the distribution mu it was drawn from: log mu(sampled token), mu's top-K ids
       and log-probs (sampled token always included), and mu's entropy. Full-vocabulary logits are kept
       for one decoding step at a time, never for the whole rollout.
    2. rewards: 1/0 correctness of the final number (rewards.py).
    3. advantages: GRPO per group of G completions of one prompt, or DCPO's SAS, which also remembers
       each prompt's rewards from earlier visits.
    4. updates: the rollout batch is split into M mini-batches, one AdamW step each, on the per-token
       loss of --objective: a policy gradient with no trust region (pg), PPO's ratio clip (ppo_clip),
       DCPO's probability-dependent clip (dcpo), ERC's entropy-ratio mask on top of ppo_clip (erc), or
       DPPO's divergence mask (binary_tv, binary_kl, topk_tv, topk_kl). Only the first update is
       on-policy; every trust region acts on updates 2..M. The training forward pass computes the
       output layer a chunk of positions at a time, so no B x T x V logits tensor exists here either.

Every formula names the paper (arXiv id) and equation it comes from; the README's objectives table maps
each --objective to its paper.

Simplifications, stated once:
  - Every trust region is anchored to mu as recorded at sampling time, as DPPO prescribes; --recompute_old
    anchors to a recomputed old policy instead (the DPPO paper's ablation).
  - Rewards are binary; no KL penalty to a reference model; no entropy bonus.
  - On CUDA the weights and AdamW stay fp32 and the forward passes run in bf16 (autocast in one process,
    FSDP2's mixed precision under torchrun); log-probs, ratios and losses are always computed in fp32.
    On CPU everything is fp32.
  - Under torchrun each process runs the whole loop on its share of every step (see "processes"); only
    FSDP2 sharding, no tensor or pipeline parallelism, so a process holds the whole model (in bf16 on
    GPUs) while it generates. No vLLM: generation is plain `generate`, from the policy itself, or with
    --sampler_dtype from a copy in bf16/fp16 that gets the trained weights before every rollout, as an
    inference engine would: the training-inference mismatch, on a switch.
  - The loss on the first (on-policy) update is ~0 by construction (r = 1 and advantages are centred
    per group): a flat loss curve is not a sign that nothing is learned. Watch reward and accuracy.
"""

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import pickle
import random
import shutil
import signal
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import huggingface_hub.constants
import huggingface_hub.utils
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from tqdm import tqdm

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor  # noqa: E402

from rewards import extract_answer, extract_gold, reward  # noqa: E402

# ============================================================================ config

OBJECTIVES = ["pg", "ppo_clip", "dcpo", "erc", "binary_tv", "binary_kl", "topk_tv", "topk_kl"]


def setting(default, help, **argparse_kwargs):
    """A Config field that is also a command-line flag: its help text and any argparse options ride along."""
    return field(default=default, metadata=dict(help=help, **argparse_kwargs))


@dataclass
class Config:
    # --- what to train, on what ---
    model: str = setting("", "Hub id or local directory of a causal LM; empty = the built-in tiny demo model")
    dataset: str = setting("gsm8k", "'gsm8k' (Hub openai/gsm8k), another Hub dataset name, 'arithmetic' (generated in "
                                    "code), a JSONL file with question/answer fields, or a directory: saved with "
                                    "datasets' save_to_disk, or holding train.jsonl and test.jsonl")
    objective: str = setting("ppo_clip", "policy objective, i.e. which trust region (the README maps each to its paper)",
                             choices=OBJECTIVES)
    # --- rollout: sampling from mu ---
    prompts_per_step: int = setting(32, "P: prompts per rollout batch")
    samples_per_prompt: int = setting(8, "G: completions per prompt (the GRPO group)")
    max_new_tokens: int = setting(512, "completion length limit; longer completions are truncated")
    temperature: float = setting(1.0, "sampling temperature T; pi's logits are divided by the same T")
    topk: int = setting(20, "K: how many of mu's most probable tokens are recorded per position (DPPO's top-K divergences)")
    sampler_dtype: str = setting("policy", "sample from the trained policy itself ('policy'), or from a copy of it in this "
                                           "dtype, refreshed from the trained weights before every rollout as an "
                                           "inference engine receives them: the training-inference mismatch on a switch",
                                 choices=["policy", "float32", "bfloat16", "float16"])
    # --- advantages and loss aggregation (shared by every objective) ---
    advantage: str = setting("grpo", "'grpo': group-standardised rewards; 'sas': DCPO's smooth advantage "
                                     "standardisation, with per-prompt reward history across visits (arXiv 2509.02333)",
                             choices=["grpo", "sas"])
    scale_rewards: str = setting("group", "GRPO advantage: 'group' divides by the group std, 'none' only centres (Dr. GRPO)",
                                 choices=["group", "none"])
    loss_agg: str = setting("token_mean", "how per-token losses are averaged over a mini-batch (see token_weights)",
                            choices=["token_mean", "seq_mean_token_mean", "seq_sum"])
    # --- trust regions; each objective reads only its own ---
    clip_low: float = setting(0.2, "ppo_clip, erc: ratio clipped below at 1 - eps_low; dcpo: eps_low of its bounds")
    clip_high: float = setting(0.28, "ppo_clip, erc: ratio clipped above at 1 + eps_high (DAPO clip-higher); dcpo: eps_high")
    dual_clip: float = setting(10.0, "ppo_clip, dcpo, erc: dual-clip constant c; for A < 0 the loss is at most -A*c")
    dcpo_r_max: float = setting(10.0, "dcpo: cap r_max on its upper ratio bound")
    erc_beta_low: float = setting(0.05, "erc: keep a token's gradient only if its entropy ratio is above 1 - beta_low")
    erc_beta_high: float = setting(0.05, "erc: ... and below 1 + beta_high")
    delta_low: float = setting(0.15, "binary_*/topk_*: a token with A < 0 whose probability falls is blocked when D > delta_low")
    delta_high: float = setting(0.15, "binary_*/topk_*: a token with A > 0 whose probability rises is blocked when D > delta_high")
    is_cap: float = setting(math.inf, "pg, binary_*/topk_*: cap C on the importance weight min(r, C); inf = off, as the DPPO authors run")
    recompute_old: bool = setting(False, "anchor every trust region to a no-grad forward pass of the policy before the "
                                         "step's first update, instead of to mu recorded at sampling (DPPO paper's ablation)")
    # --- optimisation ---
    steps: int = setting(200, "RL steps: one rollout batch and its updates each")
    epochs: int = setting(0, "if > 0: passes over the training set, which sets the number of steps (replaces --steps)")
    updates_per_step: int = setting(4, "M: mini-batches per rollout batch, one optimizer step each (M >= 2: the trust region acts from update 2 on)")
    micro_batch_size: int = setting(8, "completions per forward/backward; gradients accumulate over a mini-batch")
    learning_rate: float = setting(1e-6, "AdamW learning rate")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    max_grad_norm: float = setting(1.0, "gradient-norm clipping per optimizer step")
    gradient_checkpointing: bool = setting(False, "keep only each transformer layer's input in the training forward pass "
                                                  "and recompute the rest in backward: less memory, ~1 more forward of time")
    # --- evaluation ---
    eval_every: int = setting(20, "greedy held-out accuracy every this many steps (and before and after training)")
    eval_n: int = setting(200, "held-out problems per evaluation")
    eval_batch_size: int = setting(64, "prompts per evaluation generate call")
    # --- bookkeeping ---
    seed: int = setting(0, "seed for data order, sampling and initialisation")
    device: str = setting("auto", "'auto' (CUDA if available, else CPU), 'cuda', 'cpu', ...")
    output_dir: str = setting("", "where metrics.jsonl and the final model go; empty = runs/<objective>-seed<seed>")
    save_every: int = setting(0, "write a checkpoint (model, optimizer, step, random states, SAS history) to "
                                 "<output_dir>/checkpoint every this many steps; 0 = only on Ctrl-C")
    resume: str = setting("", "continue the run whose output_dir this is, from its checkpoint (give the same other flags)")
    cache_dir: str = setting("~/.cache/dppo", "where the built-in tiny model is built once and reused")


# Defaults that belong to a method rather than to the run: DCPO (arXiv 2509.02333) is SAS advantages plus its
# "only token mean" aggregation, and DPPO's KL variants (arXiv 2602.04879) use a smaller threshold than its TV ones.
OBJECTIVE_DEFAULTS = {"dcpo": dict(advantage="sas", loss_agg="seq_sum"),
                      "binary_kl": dict(delta_low=0.05, delta_high=0.05),
                      "topk_kl": dict(delta_low=0.05, delta_high=0.05)}

# With no --model, the run is the offline CPU demo. These replace the single-GPU defaults above.
DEMO_DEFAULTS = dict(dataset="arithmetic", max_new_tokens=16, steps=200, updates_per_step=2, micro_batch_size=128,
                     learning_rate=1e-4, eval_every=20, eval_n=500, eval_batch_size=250)


def parse_config(argv=None) -> Config:
    """Flags typed on the command line always win; then the objective's own defaults; then the demo's."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], argument_default=argparse.SUPPRESS)
    parser.error = fail  # an unknown flag or objective, or a value of the wrong type: one line, exit status 2
    for f in dataclasses.fields(Config):
        special = [f"{name}: {overrides[f.name]!r}" for name, overrides in OBJECTIVE_DEFAULTS.items() if f.name in overrides]
        if f.name in DEMO_DEFAULTS:
            special.append(f"demo: {DEMO_DEFAULTS[f.name]!r}")
        help = f"{f.metadata['help']} (default: {'; '.join([repr(f.default)] + special)})"
        if isinstance(f.default, bool):
            parser.add_argument(f"--{f.name}", action="store_true", help=help)
        else:
            parser.add_argument(f"--{f.name}", type=type(f.default), choices=f.metadata.get("choices"), help=help)
    given = vars(parser.parse_args(argv))  # only the flags actually typed, thanks to SUPPRESS
    demo_defaults = {} if given.get("model") else DEMO_DEFAULTS
    objective_defaults = OBJECTIVE_DEFAULTS.get(given.get("objective", Config.objective), {})
    cfg = Config(**{**demo_defaults, **objective_defaults, **given})
    if not cfg.output_dir:
        cfg.output_dir = f"runs/{cfg.objective}-seed{cfg.seed}"
    check_config(cfg)
    return cfg


MUST_BE_POSITIVE = ["prompts_per_step", "max_new_tokens", "temperature", "topk", "clip_low", "clip_high", "dual_clip",
                    "dcpo_r_max", "erc_beta_low", "erc_beta_high", "delta_low", "delta_high", "is_cap", "steps",
                    "updates_per_step", "micro_batch_size", "learning_rate", "max_grad_norm", "eval_every", "eval_n",
                    "eval_batch_size"]


def check_config(cfg: Config):
    """Settings that cannot work are refused before anything is loaded (the vocabulary size is checked
    once the model is): one line and exit status 2, see fail()."""
    for name in MUST_BE_POSITIVE:
        if not getattr(cfg, name) > 0:  # `not > 0` also refuses NaN
            fail(f"--{name} must be > 0, got {getattr(cfg, name)}")
    if cfg.clip_low >= 1:
        fail(f"--clip_low must be < 1 (the ratio's lower bound is 1 - clip_low), got {cfg.clip_low}")
    if cfg.samples_per_prompt < 2:
        fail(f"--samples_per_prompt must be at least 2 (GRPO compares a prompt's samples), got {cfg.samples_per_prompt}")
    world = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's number of processes; each takes 1/world of a step
    if cfg.prompts_per_step % world:
        fail(f"--prompts_per_step {cfg.prompts_per_step} cannot be split over {world} processes: make it a multiple of {world}")
    rollout_batch = cfg.prompts_per_step * cfg.samples_per_prompt // world  # completions per process
    if rollout_batch % cfg.updates_per_step:
        fail(f"--updates_per_step {cfg.updates_per_step} does not divide the rollout batch of {cfg.prompts_per_step} x "
             f"{cfg.samples_per_prompt}{f' / {world} processes' if world > 1 else ''} = {rollout_batch} completions")
    minibatch = rollout_batch // cfg.updates_per_step
    if cfg.micro_batch_size < minibatch and minibatch % cfg.micro_batch_size:
        fail(f"--micro_batch_size {cfg.micro_batch_size} does not divide the mini-batch of {minibatch} completions"
             + (" per process" if world > 1 else ""))
    if cfg.epochs < 0 or cfg.weight_decay < 0:
        fail("--epochs and --weight_decay must be >= 0")


# ============================================================================ data
# A problem is {"question": str, "answer": str}; the gold answer's last line is "#### N" (GSM8K's format).

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
    """GSM8K-shaped one-step word problems over small numbers, split into disjoint warm-up, test and
    train sets (no question appears in two sets). The seed is fixed so every run and the cached tiny
    model see the same sets."""
    rng, seen, problems = random.Random(seed), set(), []
    while len(problems) < n_warmup + n_test + n_train:
        op, template = rng.choice(ARITHMETIC_TEMPLATES)
        if op == "+":
            a, b = rng.randint(1, 10), rng.randint(1, 10)
        elif op == "-":
            a = rng.randint(2, 20)
            b = rng.randint(1, a - 1)
        else:
            a, b = rng.randint(2, 9), rng.randint(2, 9)
        question = template.format(n=rng.choice(NAMES), x=rng.choice(NOUNS), a=a, b=b)
        if question not in seen:
            seen.add(question)
            c = {"+": a + b, "-": a - b, "*": a * b}[op]
            problems.append({"question": question, "answer": f"{a} {op} {b} = {c}\n#### {c}"})
    return {"warmup": problems[:n_warmup], "test": problems[n_warmup : n_warmup + n_test],
            "train": problems[n_warmup + n_test :]}


def read_jsonl(path) -> list[dict]:
    """Problems from a JSONL file; a line that is not a JSON object with question and answer is an error."""
    if not Path(path).is_file():
        fail(f"{path}: no such file")
    problems = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                problem = json.loads(line)
            except json.JSONDecodeError as error:
                fail(f"{path}, line {number}: not valid JSON ({error.msg})")
            if not isinstance(problem, dict) or not isinstance(problem.get("question"), str) \
                    or not isinstance(problem.get("answer"), str):
                fail(f"{path}, line {number}: needs string fields 'question' and 'answer'")
            problems.append(problem)
    return problems


def load_problems(cfg: Config) -> tuple[list[dict], list[dict]]:
    """(train, held-out) problems for --dataset, which is one of:
      'arithmetic'                  generated in code (the demo's problems);
      a JSONL file                  question/answer lines; its last eval_n problems are held out;
      a directory                   saved with datasets' save_to_disk, or holding train.jsonl and test.jsonl;
      a Hub dataset name            with train and test splits; 'gsm8k' is openai/gsm8k, config 'main'."""
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
        for split in ("train", "test"):
            if not (path / f"{split}.jsonl").is_file():
                fail(f"--dataset {cfg.dataset}: no {split}.jsonl there (a dataset directory holds train.jsonl and "
                     "test.jsonl, or a DatasetDict written by save_to_disk)")
        return read_jsonl(path / "train.jsonl"), read_jsonl(path / "test.jsonl")
    if looks_like_a_path(cfg.dataset) or cfg.dataset.endswith((".jsonl", ".json")):
        fail(f"--dataset {cfg.dataset}: no such file or directory")
    name, config = ("openai/gsm8k", "main") if cfg.dataset in ("gsm8k", "openai/gsm8k") else (cfg.dataset, None)
    require_hub(f"the dataset {name}")
    from datasets import load_dataset
    try:
        splits = load_dataset(name, config)
    except (ConnectionError, FileNotFoundError) as error:  # offline and not cached; or no such dataset on the Hub
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            fail(not_in_offline_cache(f"--dataset {cfg.dataset}: the Hub dataset {name} is", "a local JSONL file or directory"))
        fail(f"--dataset {cfg.dataset}: {first_line(error)}")
    return train_and_test(splits, cfg.dataset)


def train_and_test(splits, source: str) -> tuple[list[dict], list[dict]]:
    """The train and test splits of a datasets DatasetDict as lists of problems, once their columns are checked."""
    for split in ("train", "test"):
        if split not in splits:
            fail(f"--dataset {source}: no {split!r} split (it has {', '.join(map(repr, splits))}); train and test are needed")
        if not {"question", "answer"} <= set(splits[split].column_names):
            fail(f"--dataset {source}: its {split} split has columns {splits[split].column_names}; "
                 "'question' and 'answer' are needed")
    return [dict(row) for row in splits["train"]], [dict(row) for row in splits["test"]]


def looks_like_a_path(name: str) -> bool:
    """A name written as a local path (absolute, ./, ../ or ~), which the Hub would never have."""
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..")


def not_in_offline_cache(subject: str, local: str) -> str:
    return (f"{subject} not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 forbids downloading it; "
            f"pass {local} instead, or run once with HF_HUB_OFFLINE unset to download it")


def first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def require_hub(what: str):
    """Fail fast, in one line, when `what` has to come from the Hugging Face Hub and the Hub cannot be
    reached: the Hub clients would retry for tens of seconds, then raise a page-long traceback.
    With HF_HUB_OFFLINE=1 the check is skipped and the loaders read the local Hugging Face cache."""
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return
    endpoint = huggingface_hub.constants.ENDPOINT
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=5)
    except urllib.error.HTTPError:
        pass  # the Hub answered, even if with an error status: it is reachable
    except (OSError, ValueError) as error:
        fail(f"cannot reach the Hugging Face Hub at {endpoint} to download {what} "
             f"({getattr(error, 'reason', error)}); pass a local path instead, or set HF_HUB_OFFLINE=1 to use your local cache")


def fail(message: str):
    """A one-line error and exit status 2 (bad input), instead of a traceback. Under torchrun every process
    meets the same bad input and exits, so none is left waiting for another, and rank 0 says why: the others
    give it a few seconds first, because torchrun stops every process as soon as one has exited."""
    if os.environ.get("RANK", "0") == "0":
        print(f"dppo.py: error: {message}", file=sys.stderr)
    else:
        time.sleep(5)
    sys.exit(2)


# A chat model gets one user turn, the question and then the instruction below, through its own chat
# template (whose default system turn it was tuned with). This is the user turn of the "qwen-boxed" prompt
# of Qwen's math evaluation code, GSM8K among its benchmarks (QwenLM/Qwen2.5-Math, evaluation/utils.py):
# no few-shot examples needed, and one \boxed{} span for the reward to read. Models without a
# chat template (the tiny demo model) see a plain "Question: ...\nAnswer:" prompt.
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def format_prompt(tokenizer, question: str) -> str:
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": f"{question}\n{BOXED_INSTRUCTION}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"Question: {question}\nAnswer:"


def tokenize_prompts(tokenizer, prompts: list[str], device) -> dict:
    """Left-padded, so that every completion starts in the same column."""
    return tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                     add_special_tokens=not tokenizer.chat_template).to(device)


# ============================================================================ model

def check_model_source(name_or_path: str):
    """Refuse a --model that cannot load, before anything is downloaded: a local directory that is missing or
    is not a saved model; a Hub id while the Hub is unreachable, or, with HF_HUB_OFFLINE=1, not in the cache."""
    local = Path(name_or_path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            fail(f"--model {name_or_path}: no config.json there (a model directory is one written by save_pretrained)")
        if not any(local.glob("*.safetensors")) and not any(local.glob("*.bin")):
            fail(f"--model {name_or_path}: no weights there (*.safetensors or *.bin)")
        return
    try:
        huggingface_hub.utils.validate_repo_id(name_or_path)
        is_hub_id = not looks_like_a_path(name_or_path)
    except huggingface_hub.utils.HFValidationError:
        is_hub_id = False
    if not is_hub_id:
        fail(f"--model {name_or_path}: no such directory")
    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        require_hub(f"the model {name_or_path}")
    elif not isinstance(huggingface_hub.try_to_load_from_cache(name_or_path, "config.json"), str):
        fail(not_in_offline_cache(f"--model {name_or_path}:", "a local model directory"))


def load_policy(name_or_path: str, device: torch.device, gradient_checkpointing: bool = False):
    """A causal LM and its tokenizer, from the Hub or a local directory, ready for sampling.

    The checkpoint's own generation_config.json (Qwen2.5-Instruct ships temperature 0.7, top_p 0.8,
    top_k 20, repetition_penalty 1.1) is replaced by a blank one: generate() fills every sampling
    setting we leave unset from it, and then mu would not be the distribution our flags describe.
    Only its EOS ids are kept: generation stops on every one of them.
    Dropout is switched off (every dropout probability in the config set to 0): the update runs in train
    mode, and pi must equal mu there before the first step."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        config = AutoConfig.from_pretrained(name_or_path)
        for key, value in config.to_dict().items():
            if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
                setattr(config, key, 0.0)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, config=config, dtype=torch.float32).to(device)
    except OSError as error:  # no such model on the Hub, or only part of it in the offline cache, ...
        fail(f"--model {name_or_path}: {first_line(error)}")
    if gradient_checkpointing:  # HF recomputes each decoder layer in backward, in train mode only (update_policy)
        model.activation_checkpointing_enable()  # non-reentrant torch.utils.checkpoint per layer
    eos = model.generation_config.eos_token_id
    eos_ids = sorted({tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None})
    if not eos_ids:
        fail(f"--model {name_or_path}: neither its tokenizer nor its generation config names an EOS token, "
             "so no completion could ever end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
    return model, tokenizer


def make_sampler(model, sampler_dtype: str):
    """What the rollouts sample from: the policy itself, or a copy of it in another dtype (--sampler_dtype), as
    an inference engine such as vLLM holds one. The copy gets the trained weights by refresh_sampler."""
    if sampler_dtype == "policy":
        return model
    return copy.deepcopy(model).to(getattr(torch, sampler_dtype)).eval().requires_grad_(False)


@torch.no_grad()
def refresh_sampler(sampler, model):
    """Copy the trained weights into the sampler, cast to its dtype, before a rollout (under torchrun every
    process gathers the whole model into its own copy)."""
    if sampler is not model:
        sampler.load_state_dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))


def autocast(model):
    """bf16 matmuls on CUDA with fp32 weights (fp32 master weights, no loss scaling needed); nothing on CPU,
    nor for a sampler copy whose weights are already in the dtype it should run in, nor under FSDP2, whose
    mixed-precision policy casts the weights itself (see shard)."""
    if model.device.type == "cuda" and model.dtype == torch.float32 and not isinstance(model, FSDPModule):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# The training forward pass computes the output layer for at most this many positions x vocabulary entries at once:
# 32 MiB of fp32 logits per temporary (55 positions at Qwen's 151,936 tokens), whatever the vocabulary.
LOGITS_CHUNK_ELEMENTS = 2**23


def policy_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                    topk_ids=None, with_entropy=False):
    """One teacher-forced forward pass of pi over prompt + completion. Returns, for the T completion tokens:
      logp       (B, T)     log pi(a_t | s_t), fp32, with gradient;
      topk_logp  (B, T, K)  log pi at the given ids (mu's top K), without gradient, if topk_ids is given;
      entropy    (B, T)     full-vocabulary entropy of pi(. | s_t), without gradient, if with_entropy.

    Prompts are left-padded and completions right-padded, so the T completion tokens sit in the last T
    columns and are predicted from the hidden states of the T columns before them. Position ids are
    passed explicitly, counted from each row's first real token, as generate() counted them. The
    transformer body runs once, through the model's own forward (so that FSDP2, under torchrun, gathers and
    frees the weights as for any forward) asked for the logits of no position; the output layer then runs on
    a chunk of positions at a time, under activation checkpointing, so no B x T x V logits tensor ever
    exists: each chunk's logits are dropped after use and recomputed in the backward pass. (This takes logits = lm_head(last hidden state), as in
    the Llama, Qwen and Mistral families; a model that rescales its logits would need that step too.)"""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], dim=1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    (B, T), K = completion_ids.shape, topk_ids.shape[-1] if topk_ids is not None else 0
    no_position = torch.zeros(0, dtype=torch.long, device=input_ids.device)  # the model's own output layer: no logits
    hidden = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                   logits_to_keep=no_position, output_hidden_states=True).hidden_states[-1]  # after the final norm
    hidden, targets = hidden[:, -T - 1 : -1].reshape(B * T, -1), completion_ids.reshape(B * T)
    topk_ids = topk_ids.reshape(B * T, K) if topk_ids is not None else None
    lm_head = model.get_output_embeddings()
    n = max(1, LOGITS_CHUNK_ELEMENTS // lm_head.weight.shape[0])  # positions per chunk
    chunks = [torch.utils.checkpoint.checkpoint(chunk_logprobs, lm_head, hidden[i : i + n], targets[i : i + n],
                                                temperature, topk_ids[i : i + n] if topk_ids is not None else None,
                                                with_entropy, use_reentrant=False)
              for i in range(0, B * T, n)]
    logp = torch.cat([chunk[0] for chunk in chunks]).view(B, T)
    topk_logp = torch.cat([chunk[1] for chunk in chunks]).view(B, T, K) if topk_ids is not None else None
    entropy = torch.cat([chunk[2] for chunk in chunks]).view(B, T) if with_entropy else None
    return logp, topk_logp, entropy


def chunk_logprobs(lm_head, hidden, targets, temperature, topk_ids, with_entropy):
    """For N positions' hidden states (N, H): log pi of their targets (N,), and, without gradient, log pi
    at topk_ids (N, K) and the entropy (N,). log pi = logit/T - logsumexp(logits/T), in fp32."""
    logits = lm_head(hidden).float() / temperature
    log_normaliser = logits.logsumexp(-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - log_normaliser
    with torch.no_grad():
        topk_logp = logits.gather(-1, topk_ids) - log_normaliser[:, None] if topk_ids is not None else None
        entropy = entropy_from_logits(logits, log_normaliser) if with_entropy else None
    return logp, topk_logp, entropy


def entropy_from_logits(logits: torch.Tensor, log_normaliser: torch.Tensor) -> torch.Tensor:
    """H = -sum_a p(a) log p(a) = log Z - sum_a p(a) logit(a), with p = exp(logit - log Z), over the last axis
    of finite logits. p is the only (N, V) copy made: the product is formed in place in it."""
    p = (logits - log_normaliser[:, None]).exp_()
    return log_normaliser - p.mul_(logits).sum(-1)


def train_tokenizer(corpus: list[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer (any string encodes) with distinct EOS and pad tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|pad|>")


TINY_MODEL_VERSION = "tiny-qwen2-v1"  # bump when the recipe below changes, so caches are rebuilt


def build_tiny_model(cache_dir: str) -> str:
    """The demo's policy: a 0.55M-parameter Qwen2-architecture model with a byte-level BPE vocabulary
    trained on the arithmetic problems (451 tokens: the corpus runs out of merges before 512),
    warm-started by supervised learning on the warm-up set until it solves about 30% of a dev split,
    so that RL starts from partial competence as it would from a pretrained LM. Built once into
    cache_dir, loaded back through the same Auto classes as a real checkpoint."""
    path = Path(cache_dir).expanduser() / TINY_MODEL_VERSION
    if (path / "config.json").exists():
        return str(path)
    from transformers import Qwen2Config

    print(f"building the tiny demo model in {path} (once)")
    torch.manual_seed(0)
    sets = arithmetic_problems()
    building = path.with_name(f"{path.name}.building-{os.getpid()}")
    trained = train_tokenizer([f"Question: {p['question']}\nAnswer: {p['answer']}" for p in sets["warmup"] + sets["train"]])
    config = Qwen2Config(vocab_size=len(trained), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=trained.eos_token_id, pad_token_id=trained.pad_token_id)
    trained.save_pretrained(building)
    config.save_pretrained(building)
    # Reload as users will: beside a qwen2 config.json, AutoTokenizer rebuilds a Qwen2 tokenizer (digits
    # split one by one) from this vocabulary, so the model must learn on *its* token boundaries.
    tokenizer = AutoTokenizer.from_pretrained(building)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    warm_up(model, tokenizer, sets["warmup"][:-200], dev=sets["warmup"][-200:], target_accuracy=0.30)
    model.save_pretrained(building)
    try:
        building.rename(path)
    except OSError:  # another process finished first: use theirs
        shutil.rmtree(building)
    return str(path)


def warm_up(model, tokenizer, problems, dev, target_accuracy, batch_size=64, lr=2e-3, check_every=10, max_steps=2000):
    """Supervised fine-tuning on gold solutions (maximise log pi of each gold completion), stopped as
    soon as greedy dev accuracy reaches target_accuracy."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng, device = random.Random(0), torch.device("cpu")
    for step in range(1, max_steps + 1):
        batch = rng.sample(problems, batch_size)
        prompts = tokenize_prompts(tokenizer, [format_prompt(tokenizer, p["question"]) for p in batch], device)
        completions = tokenizer([" " + p["answer"] + tokenizer.eos_token for p in batch], return_tensors="pt",
                                padding=True, padding_side="right", add_special_tokens=False)
        logp, _, _ = policy_logprobs(model, prompts.input_ids, prompts.attention_mask,
                                     completions.input_ids, completions.attention_mask, temperature=1.0)
        mask = completions.attention_mask
        loss = -(logp * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % check_every == 0:
            accuracy = evaluate(model, tokenizer, dev, max_new_tokens=16, batch_size=len(dev))
            print(f"  warm-up step {step}: loss {loss.item():.3f}, dev accuracy {accuracy:.1%}")
            if accuracy >= target_accuracy:
                break


# ============================================================================ processes
# `torchrun --nproc_per_node N dppo.py ...` starts N copies of this file that share every RL step: each samples,
# scores and trains on P/N of the step's prompts; FSDP2 shards the weights, gradients and AdamW state; the
# numbers that must be global (loss normalisers, rewards, metrics, evaluation counts) are added up across
# processes; rank 0 alone prints and writes. Without torchrun there is no process group: all of it is a no-op.

def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes: (0, 1) unless started by torchrun."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def set_up_device(name: str) -> torch.device:
    """The device to train on. Under torchrun, also join the process group: NCCL between GPUs, one per
    process, or gloo between CPU processes."""
    device = torch.device(name if name != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    if "LOCAL_RANK" in os.environ:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def shard(model):
    """FSDP2 (torch.distributed.fsdp.fully_shard): each decoder layer is one unit, the root (embeddings, final
    norm, output layer) another. Each process keeps 1/N of every parameter, of its gradient and of its AdamW
    state; a unit's whole weights exist only while it computes. On GPUs the weights and AdamW stay fp32 and
    compute runs in bf16, with gradients reduced in fp32; on CPUs everything is fp32."""
    if not dist.is_initialized():
        return model
    precision = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if model.device.type == "cuda" else MixedPrecisionPolicy()
    # policy_logprobs's hidden states include the layers' outputs, views that nothing here writes to in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for unit in [*model.get_decoder().layers, model]:  # each decoder layer, then the root
        fully_shard(unit, mp_policy=precision)
        unit.set_gradient_divide_factor(1.0)  # token_weights divide by the whole mini-batch's count across
        unit.set_force_sum_reduction_for_comms(True)  # processes, so their gradients add up, not average
    return model


@contextlib.contextmanager
def full_weights(model):
    """Generate with whole weights, gathered once for the call and freed after it (FSDP2 alone would gather each
    unit before every forward pass, i.e. per new token). All processes enter together (the gathers are
    collective); inside, each may generate as many tokens as it needs."""
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not model, recurse=False)  # FSDP2 keeps the root gathered in training


def all_processes(values: list, op=dist.ReduceOp.SUM) -> list[float]:
    """Numbers added up (or reduced with op) over all processes: the numbers themselves in a single process."""
    if not dist.is_initialized():
        return [float(value) for value in values]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    totals = torch.tensor([float(value) for value in values], dtype=torch.float64, device=device)
    dist.all_reduce(totals, op=op)
    return totals.tolist()


def gathered(items: list) -> list:
    """Every process's list, concatenated in rank order: the list itself in a single process."""
    if not dist.is_initialized():
        return items
    lists = [None] * dist.get_world_size()
    dist.all_gather_object(lists, items)
    return [item for items_of_rank in lists for item in items_of_rank]


# ============================================================================ rollout

class SamplingRecorder(LogitsProcessor):
    """Records mu, the distribution generate() samples each token from, one decoding step at a time.

    generate() runs logits processors on the raw logits, before its own temperature warper, so we
    divide by T here: mu = softmax(logits / T), which is exactly what is sampled with top_k=0, top_p=1.
    The token sampled at step t is only known at step t+1 (it is then the last column of input_ids), so
    we keep a reference to step t's raw logits (generate's own tensor, not a copy) and log Z until then.
    The extra memory is a few (B, V) temporaries for one step, fewer than generate's own sampling makes."""

    def __init__(self, temperature: float, k: int):
        self.temperature, self.k = temperature, k
        self.logp_mu, self.topk_ids, self.topk_logp_mu, self.entropy_mu = [], [], [], []
        self.pending = None  # (raw logits (B, V), log Z (B,)) of the newest step, until its token is known

    def __call__(self, input_ids, scores):
        if self.pending is not None:
            self.record_sampled(input_ids[:, -1])
        logits = scores.float() / self.temperature
        log_normaliser = logits.logsumexp(-1)
        top_logits, top_ids = logits.topk(min(self.k, logits.shape[-1]), dim=-1)
        self.topk_ids.append(top_ids)
        self.topk_logp_mu.append(top_logits - log_normaliser[:, None])
        self.entropy_mu.append(entropy_from_logits(logits, log_normaliser))
        self.pending = (scores, log_normaliser)
        return scores

    def record_sampled(self, tokens):
        """log mu of the sampled tokens; a sampled token outside mu's top K takes the K-th slot (the
        evicted token joins the 'other' bucket), as the DPPO authors' code does."""
        scores, log_normaliser = self.pending
        logp = scores.gather(-1, tokens[:, None]).squeeze(-1).float() / self.temperature - log_normaliser
        step = len(self.logp_mu)
        ids, top_logp = self.topk_ids[step], self.topk_logp_mu[step]
        outside = ~(ids == tokens[:, None]).any(-1)
        ids[outside, -1], top_logp[outside, -1] = tokens[outside], logp[outside]
        self.logp_mu.append(logp)
        self.pending = None

    def finish(self, completion_ids) -> dict:
        """The recorded tensors, (B, T) or (B, T, K), for the T generated columns."""
        T = completion_ids.shape[1]
        if len(self.logp_mu) < T:
            self.record_sampled(completion_ids[:, -1])
        # generate() may run one step more than it keeps (a deferred stop check): drop it.
        return {name: torch.stack(getattr(self, name)[:T], dim=1)
                for name in ("logp_mu", "topk_ids", "topk_logp_mu", "entropy_mu")}


@dataclass
class Rollout:
    """A batch of B = P*G sampled completions (the G samples of a prompt in consecutive rows) and what
    the objectives need to know about mu. With --recompute_old, logp_mu, topk_logp_mu and entropy_mu are
    overwritten with pi_old's before the updates (see recompute_anchor): they always hold the anchor."""
    prompt_ids: torch.Tensor       # (B, Lp) left-padded
    prompt_mask: torch.Tensor      # (B, Lp)
    completion_ids: torch.Tensor   # (B, T)  right-padded
    completion_mask: torch.Tensor  # (B, T)  1.0 up to and including the first EOS, 0.0 after
    logp_mu: torch.Tensor          # (B, T)  log mu(a_t | s_t) of the sampled token
    topk_ids: torch.Tensor         # (B, T, K) mu's K most probable ids, the sampled token always among them
    topk_logp_mu: torch.Tensor     # (B, T, K) their log mu
    entropy_mu: torch.Tensor       # (B, T)  full-vocabulary entropy of mu(. | s_t)
    texts: list[str]               # the completions as text, up to the first EOS

    def rows(self, index: torch.Tensor) -> "Rollout":
        """A subset of rows, without the columns that are padding in every one of them."""
        prompt_mask, completion_mask = self.prompt_mask[index], self.completion_mask[index]
        first = int(prompt_mask.any(0).int().argmax())
        T = int(completion_mask.sum(1).max())
        return Rollout(self.prompt_ids[index, first:], prompt_mask[:, first:], self.completion_ids[index, :T],
                       completion_mask[:, :T], self.logp_mu[index, :T], self.topk_ids[index, :T],
                       self.topk_logp_mu[index, :T], self.entropy_mu[index, :T], [self.texts[i] for i in index])


def completion_mask(completion_ids, eos_ids) -> torch.Tensor:
    """1.0 up to and including the first EOS, 0.0 after it (generate() pads rows that have finished)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device)).long()
    eos_strictly_before = is_eos.cumsum(1) - is_eos
    return (eos_strictly_before == 0).float()


def decode(tokenizer, completion_ids, mask) -> list[str]:
    """Each completion as text, up to and including its first EOS (which skip_special_tokens drops)."""
    lengths = mask.sum(1).long().tolist()
    return tokenizer.batch_decode([ids[:n] for ids, n in zip(completion_ids.tolist(), lengths)], skip_special_tokens=True)


@torch.no_grad()
def generate_rollout(model, tokenizer, prompts: list[str], cfg: Config) -> Rollout:
    """Sample one completion per prompt (repeat a prompt G times for a group), recording mu as it goes.
    Every sampling setting is passed explicitly: generate(do_sample=True) would
    otherwise apply top_k=50, and a checkpoint's defaults would change mu behind our back."""
    inputs = tokenize_prompts(tokenizer, prompts, model.device)
    recorder = SamplingRecorder(cfg.temperature, cfg.topk)
    with full_weights(model), autocast(model):
        sequences = model.generate(**inputs, do_sample=True, temperature=cfg.temperature, top_k=0, top_p=1.0,
                                   repetition_penalty=1.0, max_new_tokens=cfg.max_new_tokens,
                                   logits_processor=[recorder])
    completion_ids = sequences[:, inputs.input_ids.shape[1]:]
    mask = completion_mask(completion_ids, model.generation_config.eos_token_id)
    return Rollout(inputs.input_ids, inputs.attention_mask, completion_ids, mask, **recorder.finish(completion_ids),
                   texts=decode(tokenizer, completion_ids, mask))


# ============================================================================ rewards
# rewards.py: reward(completion, gold) is 1.0 when the completion's final number equals the gold one.


# ============================================================================ advantages

def grpo_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str = "group", eps: float = 1e-6):
    """GRPO (arXiv 2402.03300, §4.1.2): A_j = (R_j - mean(R)) / (std(R) + eps) over the G completions of
    one prompt, Bessel-corrected std. scale_rewards='none' only centres: A_j = R_j - mean(R)
    (Dr. GRPO, arXiv 2503.20783). A group whose rewards are all equal gets A = 0: it teaches nothing."""
    groups = rewards.view(-1, group_size)
    advantages = groups - groups.mean(1, keepdim=True)
    if scale_rewards == "group":
        advantages = advantages / (groups.std(1, keepdim=True) + eps)
    return advantages.flatten()


def sas_advantages(rewards: torch.Tensor, group_size: int, prompt_keys: list, history: dict) -> torch.Tensor:
    """DCPO's Smooth Advantage Standardization (arXiv 2509.02333, its SAS equations). Each prompt keeps, across
    visits, the mean and std of its rewards over all its visits so far, each visit weighted equally:
    history[key] = (visits i, mean_tot, std_tot), updated in place. On visit i, with the group's own
    statistics (mean_new, std_new, Bessel-corrected like GRPO):
        A_new = (R - mean_new) / std_new          A_tot = (R - mean_tot) / std_tot       (0 where std = 0)
        SA_new = (i-1)/i * A_new + 1/i * A_tot    SA_tot = 1/i * A_new + (i-1)/i * A_tot
        A = whichever of SA_new, SA_tot is smaller in magnitude (a tie goes to SA_tot).
    Visit 1 is GRPO without the eps; a later group with equal rewards gets A = (1/i) * A_tot, not 0."""
    advantages = []
    for key, R in zip(prompt_keys, rewards.view(-1, group_size)):
        mean_new, std_new = R.mean().item(), R.std().item()
        visits, mean_old, std_old = history.get(key, (0, 0.0, 0.0))
        i = visits + 1
        mean_tot = (visits * mean_old + mean_new) / i
        std_tot = math.sqrt((visits * std_old**2 + std_new**2 + (visits / i) * (mean_new - mean_old) ** 2) / i)
        history[key] = (i, mean_tot, std_tot)
        A_new = (R - mean_new) / std_new if std_new > 0 else torch.zeros_like(R)
        A_tot = (R - mean_tot) / std_tot if std_tot > 0 else torch.zeros_like(R)
        SA_new = (i - 1) / i * A_new + 1 / i * A_tot
        SA_tot = 1 / i * A_new + (i - 1) / i * A_tot
        advantages.append(torch.where(SA_new.abs() < SA_tot.abs(), SA_new, SA_tot))
    return torch.cat(advantages)


def step_advantages(rewards: list[float], indices: list[int], reward_history: dict, cfg: Config) -> tuple:
    """The whole step's rewards and advantages, in prompt order (P x G each), from this process's rewards. The
    rewards are gathered from every process first (P x G numbers), so that DCPO's per-prompt history is the
    same on every process, whichever saw a prompt on an earlier visit, and equals a single process's."""
    all_rewards = torch.tensor(gathered(rewards))
    if cfg.advantage == "sas":
        return all_rewards, sas_advantages(all_rewards, cfg.samples_per_prompt, indices, reward_history)
    return all_rewards, grpo_advantages(all_rewards, cfg.samples_per_prompt, cfg.scale_rewards)

# ============================================================================ objectives
# Every objective is a per-token loss l_t to minimise, from fp32 log-probs: logp = log pi(a_t|s_t)
# with gradient; logp_mu = log mu(a_t|s_t), the anchor, recorded at sampling; the sequence's advantage A
# broadcast over its tokens. Each also returns the mask of tokens its trust region gave no gradient.
#
# First, DPPO's divergences between mu(.|s_t) and pi(.|s_t) (arXiv 2602.04879: binary TV and KL, eqs. 13-14;
# the top-K ones and their lower-bound property, its appendix). Each is the TV or KL of the two
# distributions *coarsened to a partition* of the vocabulary: {sampled token, the rest} (binary) or
# {mu's top-K tokens one by one, the rest} (top-K). A coarser partition never increases TV or KL, so
# binary <= top-K <= full vocabulary: the approximations can only block less. Computed in fp32, without
# gradient; probabilities are clamped at 1e-12 so every value is finite at p or q = 0 or 1.

LOG_EPS = math.log(1e-12)


def log1mexp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - p) from log p, accurate near p = 1, where computing 1 - p directly loses every digit."""
    return (-torch.expm1(logp)).clamp(min=1e-12).log()


def with_rest(logp: torch.Tensor) -> torch.Tensor:
    """Log-probs of the cells of a partition: the given outcomes (last axis) plus 'the rest' = 1 - their sum."""
    return torch.cat([logp, log1mexp(logp.logsumexp(-1, keepdim=True))], dim=-1)


def partition_tv(logp_mu: torch.Tensor, logp_pi: torch.Tensor) -> torch.Tensor:
    """TV(mu, pi) = 1/2 sum_cells |mu(cell) - pi(cell)|, cells on the last axis."""
    return 0.5 * (logp_mu.exp() - logp_pi.exp()).abs().sum(-1)


def partition_kl(logp_mu: torch.Tensor, logp_pi: torch.Tensor) -> torch.Tensor:
    """KL(mu || pi) = sum_cells mu(cell) log(mu(cell) / pi(cell)), cells on the last axis, mu first."""
    logp_mu, logp_pi = logp_mu.clamp(min=LOG_EPS), logp_pi.clamp(min=LOG_EPS)
    return (logp_mu.exp() * (logp_mu - logp_pi)).sum(-1)


@torch.no_grad()
def binary_tv(logp_mu, logp_pi):
    """D = |p - q|: TV over {a_t, the rest}, where both cells differ by the same amount."""
    return (logp_mu.exp() - logp_pi.exp()).abs()


@torch.no_grad()
def binary_kl(logp_mu, logp_pi):
    """D = q log(q/p) + (1-q) log((1-q)/(1-p)): KL(mu || pi) over {a_t, the rest}."""
    return partition_kl(with_rest(logp_mu.unsqueeze(-1)), with_rest(logp_pi.unsqueeze(-1)))


@torch.no_grad()
def topk_tv(topk_logp_mu, topk_logp_pi):
    """D = 1/2 (sum_{a in S} |mu(a) - pi(a)| + |mu(other) - pi(other)|), S = mu's top-K ids, sampled token included."""
    return partition_tv(with_rest(topk_logp_mu), with_rest(topk_logp_pi))


@torch.no_grad()
def topk_kl(topk_logp_mu, topk_logp_pi):
    """D = sum_{a in S} mu(a) log(mu(a)/pi(a)) + mu(other) log(mu(other)/pi(other))."""
    return partition_kl(with_rest(topk_logp_mu), with_rest(topk_logp_pi))


@torch.no_grad()
def full_tv(logits_mu, logits_pi):
    """The exact TV over the whole vocabulary, from two logits tensors (for tests and teaching)."""
    return partition_tv(logits_mu.float().log_softmax(-1), logits_pi.float().log_softmax(-1))


@torch.no_grad()
def full_kl(logits_mu, logits_pi):
    """The exact KL(mu || pi) over the whole vocabulary, from two logits tensors (for tests and teaching)."""
    return partition_kl(logits_mu.float().log_softmax(-1), logits_pi.float().log_softmax(-1))


def pg_loss(logp, logp_mu, advantages, is_cap=math.inf):
    """No trust region: importance-weighted policy gradient, the DPPO paper's "PG-IS" control (arXiv 2602.04879):
        l = -A * sg(min(r, C)) * log pi,   r = pi / mu,   C = is_cap (inf: no cap)
    For r <= C its gradient is that of -A * r. Nothing is ever blocked."""
    ratio = torch.exp(logp - logp_mu).detach()
    return -advantages * ratio.clamp(max=is_cap) * logp, torch.zeros_like(logp, dtype=torch.bool)


def clipped_surrogate(logp, logp_mu, advantages, ratio_low, ratio_high, dual_clip):
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv 1707.06347, eq. 7) between any ratio bounds,
    with dual-clip for A < 0 (Ye et al. 2020, arXiv 1912.09729):
        l = max(-A*r, -A*clip(r, ratio_low, ratio_high)),   and if A < 0: l = min(l, -A*c)
    Returns l and the mask of tokens where a clip binds (they get no gradient)."""
    ratio = torch.exp(logp - logp_mu)
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(ratio_low, ratio_high))
    loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    clipped = ((advantages > 0) & (ratio > ratio_high)) | \
              ((advantages < 0) & ((ratio < ratio_low) | (ratio > dual_clip)))
    return loss, clipped


def ppo_clip_loss(logp, logp_mu, advantages, clip_low=0.2, clip_high=0.28, dual_clip=10.0):
    """PPO/GRPO with DAPO's decoupled clip-higher bounds (arXiv 2503.14476, eq. 8): r in [1 - eps_low, 1 + eps_high]."""
    return clipped_surrogate(logp, logp_mu, advantages, 1 - clip_low, 1 + clip_high, dual_clip)


def dcpo_bounds(q, eps_low=0.2, eps_high=0.28, r_max=10.0):
    """DCPO's token-specific ratio bounds (arXiv 2509.02333, eq. 4): the roots of |r (r - 1)| * q <= eps, with
    q = mu(a_t). Rare tokens get room to grow; r_high is capped at r_max:
        r_low = 1/2 + 1/2 sqrt(max(1 - 4 eps_low / q, 0)),   r_high = min(1/2 + 1/2 sqrt(1 + 4 eps_high / q), r_max)"""
    ratio_low = 0.5 + 0.5 * torch.sqrt((1 - 4 * eps_low / q).clamp(min=0))
    ratio_high = (0.5 + 0.5 * torch.sqrt(1 + 4 * eps_high / q)).clamp(max=r_max)
    return ratio_low, ratio_high


def dcpo_loss(logp, logp_mu, advantages, clip_low=0.2, clip_high=0.28, r_max=10.0, dual_clip=10.0):
    """DCPO's dynamic adaptive clipping: the clipped surrogate between dcpo_bounds(q), q = mu(a_t), without gradient."""
    ratio_low, ratio_high = dcpo_bounds(logp_mu.exp().detach(), clip_low, clip_high, r_max)
    return clipped_surrogate(logp, logp_mu, advantages, ratio_low, ratio_high, dual_clip)


def erc_loss(ppo_loss, entropy_pi, entropy_mu, beta_low=0.05, beta_high=0.05):
    """Entropy Ratio Clipping (arXiv 2512.05591) on top of ppo_clip: with rho = (H_pi + 1e-8) / (H_mu + 1e-8),
    the full-vocabulary entropies at this position (no gradient flows through rho),
        l = l_ppo_clip where 1 - beta_low < rho < 1 + beta_high,   sg(l_ppo_clip) elsewhere.
    A hard gradient mask, not a penalty: masked tokens still count in the aggregation's denominator.
    Returns l and the mask of kept tokens."""
    rho = (entropy_pi + 1e-8) / (entropy_mu + 1e-8)
    kept = (rho > 1 - beta_low) & (rho < 1 + beta_high)
    return torch.where(kept, ppo_loss, ppo_loss.detach()), kept


def dppo_loss(logp, logp_mu, advantages, divergence, delta_low, delta_high, is_cap=math.inf):
    """DPPO (arXiv 2602.04879, eqs. 11-12): l = -A * sg(min(r, C)) * M * log pi, with the trust-region mask M
    (no gradient) blocking a token only when it moves *away* from mu past the threshold:
        M = 0  iff  (A > 0 and p > q and D > delta_high)  or  (A < 0 and p < q and D > delta_low)
    p = pi(a_t), q = mu(a_t), D = the divergence between mu(.|s_t) and pi(.|s_t). A token moving back toward
    mu is never blocked, however large D is. For r <= C the gradient is that of -A * r * M.
    Returns l and the mask of blocked tokens."""
    ratio = torch.exp(logp - logp_mu).detach()
    blocked = dppo_blocked(logp, logp_mu, advantages, divergence, delta_low, delta_high)
    return -advantages * ratio.clamp(max=is_cap) * (~blocked) * logp, blocked


def dppo_blocked(logp, logp_mu, advantages, divergence, delta_low, delta_high):
    """DPPO's trust-region mask, 1 - M: the tokens that move away from mu with D past its threshold."""
    return ((advantages > 0) & (logp > logp_mu) & (divergence > delta_high)) | \
           ((advantages < 0) & (logp < logp_mu) & (divergence > delta_low))


def objective_loss(cfg: Config, logp, anchor: "Rollout", advantages, topk_logp, entropy) -> tuple:
    """--objective's per-token loss for one micro-batch. `anchor` holds mu's (or pi_old's) log-probs; topk_logp
    and entropy are pi's at mu's top-K ids and over the vocabulary, when the objective needs them.
    Returns (l, blocked, diagnostics): blocked = tokens the trust region gave no gradient; diagnostics =
    per-token values worth logging (DPPO's divergence, ERC's kept mask)."""
    A = advantages
    # A sampled token has mu(a_t) > 0; should a recorded log mu round to -inf, the ratio is capped at p / 1e-12
    # instead of becoming infinite (and 0 * inf = NaN in the loss).
    logp_mu = anchor.logp_mu.clamp(min=LOG_EPS)
    if cfg.objective == "pg":
        return *pg_loss(logp, logp_mu, A, cfg.is_cap), {}
    if cfg.objective == "ppo_clip":
        return *ppo_clip_loss(logp, logp_mu, A, cfg.clip_low, cfg.clip_high, cfg.dual_clip), {}
    if cfg.objective == "dcpo":
        return *dcpo_loss(logp, logp_mu, A, cfg.clip_low, cfg.clip_high, cfg.dcpo_r_max, cfg.dual_clip), {}
    if cfg.objective == "erc":
        loss, clipped = ppo_clip_loss(logp, logp_mu, A, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        loss, kept = erc_loss(loss, entropy, anchor.entropy_mu, cfg.erc_beta_low, cfg.erc_beta_high)
        return loss, clipped | ~kept, {"erc/kept": kept.float()}
    if cfg.objective == "binary_tv":
        divergence = binary_tv(logp_mu, logp)
    elif cfg.objective == "binary_kl":
        divergence = binary_kl(logp_mu, logp)
    elif cfg.objective == "topk_tv":
        divergence = topk_tv(anchor.topk_logp_mu, topk_logp)
    else:
        divergence = topk_kl(anchor.topk_logp_mu, topk_logp)
    loss, blocked = dppo_loss(logp, logp_mu, A, divergence, cfg.delta_low, cfg.delta_high, cfg.is_cap)
    return loss, blocked, {"trust_region/divergence": divergence}


# ============================================================================ update

def token_weights(mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """Per-token weights w with sum(w * l) = the mini-batch's loss. They are computed over the
    whole mini-batch, so splitting it into micro-batches for memory does not change the update; under torchrun,
    across processes too (a per-process count would weigh a token by its neighbours' lengths on its process)."""
    if loss_agg == "token_mean":  # DAPO (arXiv 2503.14476, eq. 8's 1/sum|o_i|): every token of the mini-batch counts the same
        return mask / all_processes([mask.sum()])[0]
    completions = all_processes([mask.shape[0]])[0]
    if loss_agg == "seq_mean_token_mean":  # original GRPO: mean over completions of each one's token mean
        return mask / mask.sum(1, keepdim=True) / completions
    return mask / completions  # seq_sum: mean over completions of each one's token sum (DCPO's OTM)


class TokenStats:
    """Running sums, counts and maxima of per-token diagnostics over the completion tokens of one RL step."""

    def __init__(self):
        self.sum, self.count, self.max = defaultdict(float), defaultdict(int), defaultdict(lambda: -math.inf)

    def add(self, name: str, values: torch.Tensor):
        self.sum[name] += values.sum().item()
        self.count[name] += values.numel()
        self.max[name] = max(self.max[name], values.max().item())

    def over_all_processes(self):
        """Under torchrun: sums and counts added up over processes, maxima the largest."""
        names = sorted(self.sum)
        totals = all_processes([self.sum[name] for name in names] + [self.count[name] for name in names])
        maxima = all_processes([self.max[name] for name in names], op=dist.ReduceOp.MAX)
        for i, name in enumerate(names):
            self.sum[name], self.count[name], self.max[name] = totals[i], totals[len(names) + i], maxima[i]


# Where a trust region bites (the DPPO paper argues that PPO's ratio clip falls mostly on low-probability
# tokens, and a divergence mask does not): a token counts as rare when mu(a_t) < RARE_TOKEN_MU, and the clip
# objectives' blocked tokens are compared with those a binary-TV mask at DIAGNOSTIC_TV_DELTA would block.
RARE_TOKEN_MU = 0.15
DIAGNOSTIC_TV_DELTA = 0.15


@torch.no_grad()
def recompute_anchor(model, rollout: Rollout, cfg: Config) -> Rollout:
    """--recompute_old, the DPPO paper's ablation: anchor the trust region to pi_old, the policy as it is
    before this step's first update (one no-grad forward pass), instead of to mu as recorded at sampling.
    The two differ by the sampler's numerics (here: generate's incremental KV-cache pass versus a
    full teacher-forced one; bf16 on CUDA). mu's top-K ids stay the partition for top-K divergences."""
    logp, topk_logp, entropy = rollout.logp_mu.clone(), rollout.topk_logp_mu.clone(), rollout.entropy_mu.clone()
    for rows in torch.arange(len(rollout.texts)).split(cfg.micro_batch_size):
        mb = rollout.rows(rows)
        with autocast(model):
            old = policy_logprobs(model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask,
                                  cfg.temperature, topk_ids=mb.topk_ids, with_entropy=True)
        T = mb.completion_ids.shape[1]
        logp[rows, :T], topk_logp[rows, :T], entropy[rows, :T] = old
    return dataclasses.replace(rollout, logp_mu=logp, topk_logp_mu=topk_logp, entropy_mu=entropy)


def accumulate_gradient(model, minibatch: Rollout, advantages: torch.Tensor, cfg: Config, stats: TokenStats,
                        first_update: bool = True) -> float:
    """Backpropagate one mini-batch's loss, one micro-batch at a time (gradients add up); return the
    loss and add the per-token diagnostics to stats. The token weights are the whole mini-batch's.
    On the step's first update pi is still pi_old, so |pi - mu| there is the sampler's numerics alone
    (the training-inference mismatch); on later updates it adds the drift of the updates."""
    weights = token_weights(minibatch.completion_mask, cfg.loss_agg)
    needs_topk, needs_entropy = cfg.objective in ("topk_tv", "topk_kl"), cfg.objective == "erc"
    total_loss = 0.0
    for rows in torch.arange(len(advantages)).split(cfg.micro_batch_size):
        mb, A = minibatch.rows(rows), advantages[rows, None]
        with autocast(model):
            logp, topk_logp, entropy = policy_logprobs(model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids,
                                                       mb.completion_mask, cfg.temperature,
                                                       topk_ids=mb.topk_ids if needs_topk else None,
                                                       with_entropy=needs_entropy)
        loss, blocked, diagnostics = objective_loss(cfg, logp, mb, A, topk_logp, entropy)
        loss = (loss * weights[rows, : logp.shape[1]]).sum()
        loss.backward()
        total_loss += loss.item()
        with torch.no_grad():
            m = mb.completion_mask.bool()
            stats.add("tokens", m.float())
            stats.add("blocked_pos_adv", (blocked & (A > 0))[m].float())
            stats.add("blocked_neg_adv", (blocked & (A < 0))[m].float())
            p, q = logp.exp(), mb.logp_mu.exp()
            abs_pi_minus_mu = (p - q).abs()[m]
            stats.add("policy/abs_pi_minus_mu", abs_pi_minus_mu)
            stats.add("policy/mismatch_first_update" if first_update else "policy/drift_later_updates", abs_pi_minus_mu)
            rare = q < RARE_TOKEN_MU
            stats.add("rare", rare[m].float())
            stats.add("blocked_rare", (blocked & rare)[m].float())
            if cfg.objective in ("ppo_clip", "dcpo", "erc"):  # would DPPO's binary-TV mask have blocked them too?
                tv_blocked = dppo_blocked(logp, mb.logp_mu, A, binary_tv(mb.logp_mu, logp),
                                          DIAGNOSTIC_TV_DELTA, DIAGNOSTIC_TV_DELTA)
                stats.add("blocked_also_by_tv", (blocked & tv_blocked)[m].float())
            for name, values in diagnostics.items():
                stats.add(name, values[m])
    return total_loss


def update_policy(model, optimizer, rollout: Rollout, advantages: torch.Tensor, cfg: Config) -> dict:
    """M optimizer steps on one rollout batch: shuffle its completions, split them into M mini-batches,
    and for each accumulate the gradient, clip its norm, and step. Returns the step's diagnostics."""
    advantages = advantages.to(model.device)
    model.train()  # --gradient_checkpointing acts only in train mode (dropout is off, see load_policy)
    if cfg.recompute_old:
        rollout = recompute_anchor(model, rollout, cfg)
    losses, grad_norms, stats = [], [], TokenStats()
    for update, minibatch in enumerate(torch.randperm(len(advantages)).chunk(cfg.updates_per_step)):
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate_gradient(model, rollout.rows(minibatch), advantages[minibatch], cfg, stats, first_update=update == 0)
        losses.append(all_processes([loss])[0])  # the mini-batch's loss: every process's share added up
        grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm).item())
        if not (math.isfinite(losses[-1]) and math.isfinite(grad_norms[-1])):
            model.eval()
            raise FloatingPointError(f"non-finite loss {losses[-1]} or gradient norm {grad_norms[-1]} "
                                     f"in update {len(losses)} of {cfg.updates_per_step}")
        optimizer.step()
    model.eval()  # and generate() must run in eval mode: in train mode, checkpointing turns off its KV cache
    stats.over_all_processes()
    tokens = stats.sum.pop("tokens")
    blocked_pos, blocked_neg = stats.sum.pop("blocked_pos_adv"), stats.sum.pop("blocked_neg_adv")
    metrics = {"loss": sum(losses) / len(losses), "grad_norm": sum(grad_norms) / len(grad_norms),
               "trust_region/blocked_frac": (blocked_pos + blocked_neg) / tokens,
               "trust_region/blocked_frac_pos_adv": blocked_pos / tokens,
               "trust_region/blocked_frac_neg_adv": blocked_neg / tokens,
               "policy/rare_token_frac": stats.sum.pop("rare") / tokens,
               "trust_region/blocked_rare_frac": stats.sum.pop("blocked_rare") / tokens}
    if "blocked_also_by_tv" in stats.sum:
        metrics["trust_region/blocked_also_by_tv_frac"] = stats.sum.pop("blocked_also_by_tv") / tokens
    for name, total in stats.sum.items():
        if name == "erc/kept":
            metrics["erc/kept_frac"] = total / tokens
        else:
            metrics[f"{name}_mean"], metrics[f"{name}_max"] = total / stats.count[name], stats.max[name]
    return metrics


# ============================================================================ evaluation

@torch.no_grad()
def evaluate(model, tokenizer, problems: list[dict], max_new_tokens: int, batch_size: int) -> float:
    """Greedy accuracy: the fraction of problems whose greedy completion earns reward 1. Under torchrun each
    process answers every N-th problem and the counts of correct answers are added up."""
    rank, world = rank_and_world()
    mine, correct = problems[rank::world], 0.0
    with full_weights(model), autocast(model):
        for start in range(0, len(mine), batch_size):
            batch = mine[start : start + batch_size]
            inputs = tokenize_prompts(tokenizer, [format_prompt(tokenizer, p["question"]) for p in batch], model.device)
            sequences = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
            completion_ids = sequences[:, inputs.input_ids.shape[1]:]
            texts = decode(tokenizer, completion_ids, completion_mask(completion_ids, model.generation_config.eos_token_id))
            correct += sum(reward(text, extract_gold(p["answer"])) for text, p in zip(texts, batch))
    return all_processes([correct])[0] / len(problems)


# ============================================================================ main

def reset_peak_memory(device: torch.device):
    """Start measuring one phase's peak memory: the CUDA allocator's peak, or on Linux the process's
    peak resident set size (writing 5 to /proc/self/clear_refs resets it)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_memory_mb(device: torch.device) -> float:
    """The phase's peak memory in MiB: tensors allocated on the GPU; on a CPU, the whole process's peak
    RSS as Linux's /proc reports it (NaN on systems without /proc)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return math.nan


def problem_batch(n_problems: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The problem indices of RL step `step` (from 1): passes over the set, each in its own seeded shuffle,
    so the data order is a function of (seed, step) and a resumed run sees what an uninterrupted one would.
    An index is also the prompt's key for DCPO's per-prompt reward history."""
    epoch, position = divmod(step - 1, n_problems // batch_size)
    order = random.Random(f"{seed}:{epoch}").sample(range(n_problems), n_problems)
    return order[position * batch_size : (position + 1) * batch_size]


def rl_step(step: int, model, sampler, tokenizer, optimizer, train_problems: list[dict], reward_history: dict,
            cfg: Config) -> dict:
    """One RL step, the module docstring's steps 1-4, on this process's share of the step's prompts (whole
    groups); returns the step's metrics, over all processes."""
    rank, world = rank_and_world()
    P, G = cfg.prompts_per_step, cfg.samples_per_prompt
    indices = problem_batch(len(train_problems), P, cfg.seed, step)
    problems = [train_problems[i] for i in indices[rank * P // world : (rank + 1) * P // world] for _ in range(G)]
    started = time.time()
    reset_peak_memory(model.device)
    refresh_sampler(sampler, model)
    # 1. rollout, 2. rewards, 3. advantages (from every process's rewards)
    rollout = generate_rollout(sampler, tokenizer, [format_prompt(tokenizer, p["question"]) for p in problems], cfg)
    rewards = [reward(text, extract_gold(p["answer"])) for text, p in zip(rollout.texts, problems)]
    all_rewards, all_advantages = step_advantages(rewards, indices, reward_history, cfg)
    rollout_s, rollout_peak_mb = time.time() - started, peak_memory_mb(model.device)
    started = time.time()
    reset_peak_memory(model.device)
    # 4. updates, on this process's share of each mini-batch
    stats = update_policy(model, optimizer, rollout, all_advantages.chunk(world)[rank], cfg)
    update_s, update_peak_mb = time.time() - started, peak_memory_mb(model.device)
    # what the step did, over all processes
    mask = rollout.completion_mask
    eos_ids = torch.tensor(model.generation_config.eos_token_id, device=mask.device)
    completions, answers, tokens, truncated, entropy = all_processes([
        len(rollout.texts), sum(extract_answer(text) is not None for text in rollout.texts), mask.sum(),
        (~torch.isin(rollout.completion_ids, eos_ids).any(1)).sum(), (rollout.entropy_mu * mask).sum()])
    peaks = all_processes([rollout_peak_mb, update_peak_mb], op=dist.ReduceOp.MAX)  # the largest process's
    return {"step": step,
            "reward/mean": all_rewards.mean().item(),
            "reward/zero_spread_groups": (all_rewards.view(-1, G).std(1) == 0).float().mean().item(),
            "reward/answer_found": answers / completions,
            "completion/length_mean": tokens / completions,
            "completion/truncated": truncated / completions,
            "policy/entropy_mu": entropy / tokens,
            "advantage/nonzero_frac": (all_advantages != 0).float().mean().item(),  # DCPO's "response utilisation"
            **stats,
            "time/rollout_s": rollout_s,
            "time/update_s": update_s,
            "throughput/generated_tokens_per_s": tokens / rollout_s,
            "throughput/trained_tokens_per_s": tokens / update_s,
            "memory/rollout_peak_mb": peaks[0],
            "memory/update_peak_mb": peaks[1]}


def save_model(model, tokenizer, directory: Path):
    """A save_pretrained checkpoint of the whole model, which --model loads in one process. Under torchrun every
    process hands in its shards and rank 0 writes."""
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank_and_world()[0] == 0:
        model.save_pretrained(directory, state_dict=weights)
        tokenizer.save_pretrained(directory)


def save_checkpoint(run_dir: Path, model, tokenizer, optimizer, step: int, reward_history: dict, initial_accuracy):
    """Everything the run needs to go on exactly as if uninterrupted, in <run_dir>/checkpoint: the model, AdamW's
    state (whole, gathered from every process), the step, SAS's history and every process's torch random
    streams (dppo.py draws its other random numbers from seeded random.Random instances). Written to a
    temporary directory first and then renamed into place, so a crash mid-write leaves the last one whole."""
    partial, final, old = (run_dir / name for name in ("checkpoint.partial", "checkpoint", "checkpoint.old"))
    rank = rank_and_world()[0]
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    save_model(model, tokenizer, partial)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    random_states = gathered([{"torch": torch.get_rng_state(),
                               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}])
    if rank == 0:
        torch.save({"step": step, "optimizer": optimizer_state, "reward_history": reward_history,
                    "initial_accuracy": initial_accuracy, "random_states": random_states}, partial / "training_state.pt")
        if final.exists():
            final.rename(old)
        partial.rename(final)
        shutil.rmtree(old, ignore_errors=True)


def restore_checkpoint(checkpoint: Path, model, optimizer) -> tuple[int, float, dict]:
    """AdamW's state and this process's random streams from a checkpoint (the model was loaded from it);
    returns the step to go on from, the accuracy before training and SAS's history. The file is read with
    weights_only=True: tensors and plain Python values only, so a crafted one cannot run code."""
    try:
        state = torch.load(checkpoint / "training_state.pt", weights_only=True)
    except pickle.UnpicklingError:
        fail(f"--resume: {checkpoint}/training_state.pt holds more than tensors and plain Python values (unpickling "
             "them could run code), so it is not a dppo checkpoint and is not loaded")
    rank, world = rank_and_world()
    if len(state["random_states"]) != world:
        fail(f"--resume: the checkpoint in {checkpoint} was written by {len(state['random_states'])} processes, "
             f"and this run has {world}; resume with as many")
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    torch.set_rng_state(state["random_states"][rank]["torch"])
    if state["random_states"][rank]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["random_states"][rank]["cuda"])
    return state["step"] + 1, state["initial_accuracy"], state["reward_history"]


def writable_directory(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".dppo-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        fail(f"--output_dir {path}: not writable ({error.strerror or error})")
    return path


def load_data(cfg: Config, resume_from) -> tuple[list[dict], list[dict]]:
    """The training and held-out problems, once a --model that cannot load has been refused (before the dataset,
    which may have to be downloaded)."""
    if resume_from and not (resume_from / "training_state.pt").is_file():
        fail(f"--resume {cfg.resume}: no checkpoint there ({resume_from}/training_state.pt); "
             "a run writes one with --save_every N or on Ctrl-C")
    if cfg.model and not resume_from:
        check_model_source(cfg.model)
    train_problems, held_out = load_problems(cfg)
    if len(train_problems) < cfg.prompts_per_step or not held_out[: cfg.eval_n]:
        fail(f"--dataset {cfg.dataset}: {len(train_problems)} training and {len(held_out)} held-out problems; "
             f"a step needs {cfg.prompts_per_step} (--prompts_per_step) and evaluation at least 1")
    return train_problems, held_out[: cfg.eval_n]


def load_model(cfg: Config, resume_from, device) -> tuple:
    """The policy and its tokenizer (from the checkpoint to resume, --model, or the built-in demo model), the
    sampler, and AdamW over the policy's parameters (sharded under torchrun)."""
    with torch.random.fork_rng(devices=[]):  # so a run samples the same whether or not the demo model was cached
        checkpoint = str(resume_from) if resume_from else cfg.model or build_tiny_model(cfg.cache_dir)
    model, tokenizer = load_policy(checkpoint, device, cfg.gradient_checkpointing)
    vocabulary = model.get_output_embeddings().weight.shape[0]
    if cfg.topk > vocabulary:
        fail(f"--topk {cfg.topk} is more than the model's {vocabulary} tokens")
    sampler = make_sampler(model, cfg.sampler_dtype)  # the policy itself unless --sampler_dtype is given
    model = shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return model, tokenizer, sampler, optimizer


STOP_REQUESTED = []  # set by Ctrl-C


def stop_after_this_step(signum, frame):
    """Ctrl-C lets the current step finish, saves a checkpoint and stops; a second Ctrl-C stops at once."""
    if STOP_REQUESTED:
        raise KeyboardInterrupt
    STOP_REQUESTED.append(True)
    if rank_and_world()[0] == 0:
        print("\nCtrl-C: stopping after this step, with a checkpoint (Ctrl-C again to quit now)", file=sys.stderr)


def main(argv=None) -> dict:
    cfg = parse_config(argv)
    device = set_up_device(cfg.device)
    rank = rank_and_world()[0]
    torch.manual_seed(cfg.seed + rank)  # each process draws its own samples; rank 0 draws what one process would
    started = time.time()
    output_dir = writable_directory(Path(cfg.output_dir))
    resume_from = Path(cfg.resume) / "checkpoint" if cfg.resume else None
    train_problems, held_out = load_data(cfg, resume_from)
    model, tokenizer, sampler, optimizer = load_model(cfg, resume_from, device)
    first_step, initial_accuracy, reward_history = restore_checkpoint(resume_from, model, optimizer) if resume_from \
        else (1, None, {})  # reward_history: --advantage sas's per-prompt reward statistics across visits
    # One JSON line per step and per evaluation, flushed as written: an interrupted run keeps every step it finished.
    metrics_file = open(output_dir / "metrics.jsonl" if rank == 0 else os.devnull, "a" if resume_from else "w")
    steps = cfg.epochs * (len(train_problems) // cfg.prompts_per_step) if cfg.epochs > 0 else cfg.steps
    evaluation = dict(problems=held_out, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.eval_batch_size)
    if initial_accuracy is None:
        initial_accuracy = evaluate(model, tokenizer, **evaluation)
        print(json.dumps({"step": 0, "eval/accuracy": initial_accuracy, "time/elapsed_s": time.time() - started}), file=metrics_file, flush=True)
    accuracy = initial_accuracy
    STOP_REQUESTED.clear()
    previous_handler = signal.signal(signal.SIGINT, stop_after_this_step)
    try:
        progress = tqdm(range(first_step, steps + 1), desc=cfg.objective, dynamic_ncols=True, disable=rank != 0)
        for step in progress:
            try:
                metrics = rl_step(step, model, sampler, tokenizer, optimizer, train_problems, reward_history, cfg)
            except FloatingPointError as error:
                save_model(model, tokenizer, output_dir)
                sys.exit(f"dppo.py: stopped at step {step} ({cfg.objective}): {error}. The model as it was before that "
                         f"optimizer step is saved in {output_dir}, with metrics.jsonl up to step {step - 1}" if rank == 0 else 1)
            print(json.dumps({**metrics, "time/elapsed_s": time.time() - started}), file=metrics_file, flush=True)
            if step % cfg.eval_every == 0 or step == steps:
                accuracy = evaluate(model, tokenizer, **evaluation)
                print(json.dumps({"step": step, "eval/accuracy": accuracy, "time/elapsed_s": time.time() - started}), file=metrics_file, flush=True)
            progress.set_postfix(reward=f"{metrics['reward/mean']:.2f}", acc=f"{accuracy:.2f}",
                                 blocked=f"{metrics['trust_region/blocked_frac']:.3f}",
                                 gen_tok_s=f"{metrics['throughput/generated_tokens_per_s']:.0f}",
                                 train_tok_s=f"{metrics['throughput/trained_tokens_per_s']:.0f}")
            stop = all_processes([len(STOP_REQUESTED)], op=dist.ReduceOp.MAX)[0] > 0  # Ctrl-C reached any process
            if (cfg.save_every and step % cfg.save_every == 0) or stop:
                save_checkpoint(output_dir, model, tokenizer, optimizer, step, reward_history, initial_accuracy)
            if stop:
                sys.exit(f"dppo.py: interrupted after step {step}; continue with the same flags and --resume {output_dir}"
                         if rank == 0 else 1)
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        metrics_file.close()
    save_model(model, tokenizer, output_dir)
    if rank == 0:
        print(f"{cfg.objective}: held-out greedy accuracy {initial_accuracy:.1%} -> {accuracy:.1%} "
              f"({100 * (accuracy - initial_accuracy):+.1f} points) in {time.time() - started:.0f} s; "
              f"metrics and model in {output_dir}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"initial_accuracy": initial_accuracy, "final_accuracy": accuracy}

if __name__ == "__main__":
    main()
