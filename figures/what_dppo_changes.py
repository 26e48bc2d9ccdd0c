"""What DPPO changes, computed by dppo.py's own functions (the README's section of that name).

    python figures/what_dppo_changes.py                     # the three figures, offline, on the demo model
    python figures/what_dppo_changes.py --only numerics --model DIR --dataset D   # Figure 1 on your checkpoint
    python figures/what_dppo_changes.py --only blocked --model DIR -- --dataset D  # the tokens each region blocks

1. trust_regions.png: over a grid of (mu(a_t), pi(a_t)), where each objective lets a token's gradient through,
   blocks it or re-weights it, from objective_loss and autograd (the DPPO paper's Figure 2, left); beside them, the
   furthest pi(a_t) may go from mu(a_t) before its gradient stops.
2. numerics_<model>.png: pi/mu and |pi - mu| of every sampled token, mu recorded from a bf16 or fp16 copy of the
   policy and pi computed by the fp32 policy at the same weights: the whole difference is numerics (its Figure 1).
3. rare_right_answer.png: a one-step bandit whose rewarded token starts rare, trained through objective_loss and
   token_weights with AdamW: steps until it reaches probability 0.5; how far a common wrong token falls in one step.
4. blocked_<model>.png (--only blocked, flags for dppo.py after --): a few RL steps of `python dppo.py` with a bf16
   sampler, every trained token recorded where rl_step hands it to add_token_stats, and judged by objective_loss
   under each of ppo_clip, dcpo, binary_tv, topk_tv and cppo at the same (pi, mu, A): which tokens each blocks, by mu's
   decade, the advantage's sign and side, and what they are; the completions with the most blocked tokens, drawn.

No formula is typed here: every loss, mask, divergence, advantage and aggregation is dppo.py's, so each figure is also
a check of them. Without matplotlib the tables are printed and nothing is drawn.
"""

import argparse
import dataclasses
import importlib
import math
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
dppo = importlib.import_module("dppo")  # dppo.py, one folder up

# ---------------------------------------------------------------------------- 1. the trust regions

# (panel, dppo.py's flags, where the token sits): "first" is a completion's first token; "spent" is the last of six,
# after five that each moved |pi - mu| = SPENT_DRIFT (mu 0.5, pi 0.56), which spends part of CPPO's budget.
REGIONS = [
    ("ppo_clip", ["--objective", "ppo_clip"], "first"),
    ("ppo_clip --relax_clip both", ["--objective", "ppo_clip", "--relax_clip", "both"], "first"),
    ("dcpo", ["--objective", "dcpo"], "first"),
    ("binary_tv", ["--objective", "binary_tv"], "first"),
    ("binary_kl", ["--objective", "binary_kl"], "first"),
    ("cispo (its weight)", ["--objective", "cispo"], "first"),
    ("drpo (its weight)", ["--objective", "drpo"], "first"),
    ("cppo, first token", ["--objective", "cppo"], "first"),
    ("cppo, 6th token, budget spent", ["--objective", "cppo"], "spent"),
]
SPENT_DRIFT = 0.06
SIDES = {"A > 0": 1.0, "A < 0": -1.0}


def gradient_weight(flags, mu: torch.Tensor, pi: torch.Tensor, sign: float, place="first") -> torch.Tensor:
    """Tokens with mu(a_t) = mu, pi(a_t) = pi and advantage `sign`: d loss / d log pi(a_t) by objective_loss and
    autograd, over the same for --objective pg (plain PG, -A pi/mu). 1: the gradient passes as PG's; 0: blocked; else
    re-weighted. The anchor is mu; objective_loss gets log-probs only: the objectives drawn need no top-K or entropy."""
    return token_gradient(flags, mu, pi, sign, place) / token_gradient(["--objective", "pg"], mu, pi, sign, place)


def token_gradient(flags, mu: torch.Tensor, pi: torch.Tensor, sign: float, place: str) -> torch.Tensor:
    cfg = dppo.parse_config(flags)
    logp, logp_mu = pi.double().log()[:, None], mu.double().log()[:, None]
    if place == "spent":
        before = torch.ones(len(mu), 5, dtype=torch.float64)
        logp = torch.cat([(before * (0.5 + SPENT_DRIFT)).log(), logp], 1)
        logp_mu = torch.cat([(before * 0.5).log(), logp_mu], 1)
    logp.requires_grad_()
    advantages = torch.full((len(mu), 1), sign, dtype=torch.float64)
    loss, _ = dppo.objective_loss(
        cfg, dppo.LogProbs(logp, None, None), dppo.LogProbs(logp_mu, None, None), advantages, torch.ones_like(logp)
    )
    loss.sum().backward()
    return logp.grad[:, -1]


def furthest_reach(flags, mu: torch.Tensor, sign: float, place="first", iterations=60) -> torch.Tensor:
    """The furthest pi(a_t) may move from mu(a_t) with its gradient still passing: up for A > 0 (1 if nothing
    blocks it), down for A < 0 (0 if nothing does). Bisection on gradient_weight: exactly where the objective stops."""
    end = torch.full_like(mu, 1 - 1e-12 if sign > 0 else 1e-12)
    open_to_the_end = gradient_weight(flags, mu, end, sign, place) != 0
    inside, outside = mu.clone(), end.clone()  # the gradient passes at pi = mu, on policy
    for _ in range(iterations):
        middle = (inside + outside) / 2
        passes = gradient_weight(flags, mu, middle, sign, place) != 0
        inside, outside = torch.where(passes, middle, inside), torch.where(passes, outside, middle)
    return torch.where(open_to_the_end, end.round(), inside)


REACH = ["ppo_clip", "dcpo", "binary_tv", "binary_kl", "cppo, 6th token, budget spent"]


def reach_table(mus=(1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9)) -> list[str]:
    mu = torch.tensor(mus, dtype=torch.float64)
    rows = ["| objective | " + " | ".join(f"μ = {m:g}" for m in mus) + " |", "|---" * (len(mus) + 1) + "|"]
    for name, flags, place in REGIONS:
        if name in REACH:
            down, up = furthest_reach(flags, mu, -1, place), furthest_reach(flags, mu, +1, place)
            cells = [f"{low:.3g} – {high:.3g}" for low, high in zip(down.tolist(), up.tolist())]
            rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return rows


def draw_regions(plt, path: Path, n=161):
    """Two rows of panels for A > 0, two for A < 0: nine objectives, then the furthest reach of five."""
    from matplotlib.colors import ListedColormap, TwoSlopeNorm

    axis = torch.logspace(-4, 0, n, dtype=torch.float64).clamp(max=1 - 1e-9)
    pi, mu = (x.flatten() for x in torch.meshgrid(axis, axis, indexing="ij"))  # rows: pi; columns: mu
    grey = ListedColormap([(0, 0, 0, 0), (0.3, 0.3, 0.3, 1)])  # blocked tokens, over the weight's colours
    shown = dict(origin="lower", extent=(-4, 0, -4, 0))
    figure, axes = plt.subplots(4, 5, figsize=(11, 9.4))
    for side, (name_of_side, sign) in enumerate(SIDES.items()):
        panels = axes[2 * side : 2 * side + 2].flatten()
        for ax, (name, flags, place) in zip(panels, REGIONS):
            weight = gradient_weight(flags, mu, pi, sign, place).view(n, n)
            ax.imshow(weight.numpy(), cmap="RdBu_r", norm=TwoSlopeNorm(1, 0, 2), **shown)
            ax.imshow((weight == 0).double().numpy(), cmap=grey, **shown)
            ax.plot([-4, 0], [-4, 0], color="k", linewidth=0.5, linestyle=":")
            ax.set_xticks([-4, -3, -2, -1, 0], ["1e-4", "", "0.01", "", "1"], fontsize=7)
            ax.set_yticks([-4, -3, -2, -1, 0], ["1e-4", "", "0.01", "", "1"], fontsize=7)
            ax.set_title(f"{name}, {name_of_side}", fontsize=8)
            ax.set_xlabel("μ(a_t)", fontsize=7, labelpad=1)
            ax.set_ylabel("π(a_t)", fontsize=7, labelpad=1)
        ax = panels[-1]
        line = torch.logspace(-4, 0, 200, dtype=torch.float64).clamp(max=1 - 1e-9)
        for name, flags, place in REGIONS:
            if name in REACH:
                ax.plot(line, furthest_reach(flags, line, sign, place), linewidth=1, label=name.split(",")[0])
        ax.plot(line, line, color="k", linewidth=0.5, linestyle=":")
        ax.set(xscale="log", yscale="log", xlim=(1e-4, 1), ylim=(1e-5, 1.5))
        ax.tick_params(labelsize=7)
        ax.set_title(f"furthest π(a_t) with a gradient, {name_of_side}", fontsize=7)
        ax.set_xlabel("μ(a_t)", fontsize=7, labelpad=1)
        ax.legend(fontsize=6, loc="lower right")
    figure.suptitle(
        "A token's gradient over plain PG's, by dppo.objective_loss and autograd: "
        "grey blocked, white passing, blue damped, red boosted",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=80)


# ---------------------------------------------------------------------------- 2. the paper's Figure 1


def sampled_tokens(model: str, dataset: str, dtypes, prompts: int, samples: int, new_tokens: int) -> dict:
    """dtype -> (mu(a_t), pi(a_t)) over every sampled completion token: mu as dppo.py records it from a copy of the
    policy in that dtype (--sampler_dtype), pi from the fp32 policy at the same weights, one teacher-forced pass per
    16 completions (pi_old: the first update's pi). Nothing is trained."""
    flags = ["--dataset", dataset, "--max_new_tokens", str(new_tokens), "--precision", "fp32", "--eval_n", "1"]
    cfg = dppo.parse_config(flags + (["--model", model] if model else []))
    if model:
        dppo.check_model_source(model)  # as dppo.main's load_data does: a --model that cannot load fails in one line
    policy, tokenizer = dppo.load_policy(model or dppo.build_tiny_model(cfg.cache_dir), torch.device("cpu"))
    problems = dppo.load_problems(cfg)[0][:prompts]
    texts = [dppo.format_prompt(tokenizer, p["question"]) for p in problems for _ in range(samples)]
    tokens = {}
    for dtype in dtypes:
        torch.manual_seed(0)
        rollout = dppo.generate_rollout(dppo.make_sampler(policy, dtype), tokenizer, texts, cfg)
        logp = torch.zeros_like(rollout.mu.logp)
        with torch.no_grad():
            for rows in torch.arange(len(texts)).split(16):
                batch = rollout.select(rows)
                logp[rows, : batch.completion_ids.shape[1]] = dppo.policy_logprobs(policy, batch, cfg.temperature).logp
        real = rollout.completion_mask.bool()
        tokens[dtype] = (rollout.mu.logp[real].double().exp(), logp[real].double().exp())
    return tokens


DECADES = [(0.0, 1e-4), (1e-4, 1e-3), (1e-3, 1e-2), (1e-2, 0.1), (0.1, 0.9), (0.9, 1.0 + 1e-9)]


def decade_table(tokens: dict) -> list[str]:
    rows = [
        "| sampler | μ(a_t) | tokens | p99 \\|log(π/μ)\\| | max \\|π − μ\\| "
        "| π/μ outside [0.8, 1.28] | \\|π − μ\\| > 0.15 |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype, (mu, pi) in tokens.items():
        for low, high in DECADES:
            inside = (mu >= low) & (mu < high)
            span = f"[{low:g}, {min(high, 1):g}{']' if high > 1 else ')'}"
            if not inside.any():
                rows.append(f"| {dtype} | {span} | 0 | – | – | – | – |")
                continue
            ratio, gap = pi[inside] / mu[inside], (pi[inside] - mu[inside]).abs()
            outside_clip = ((ratio < 0.8) | (ratio > 1.28)).sum().item()
            rows.append(
                f"| {dtype} | {span} | {inside.sum().item():,} | {ratio.log().abs().quantile(0.99).item():.3g} | "
                f"{gap.max().item():.2g} | {outside_clip} | {(gap > 0.15).sum().item()} |"
            )
    return rows


def draw_numerics(plt, tokens: dict, name: str, path: Path):
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, (dtype, (mu, pi)) in enumerate(tokens.items()):
        left.scatter(mu, pi / mu, s=2, alpha=0.4, color=f"C{i}", label=f"μ from a {dtype} copy")
        right.scatter(mu, (pi - mu).abs().clamp(min=1e-9), s=2, alpha=0.4, color=f"C{i}")
    for bound in (0.8, 1.28):
        left.axhline(bound, color="k", linewidth=0.7, linestyle="--")
    right.axhline(0.15, color="k", linewidth=0.7, linestyle="--")
    left.set(xscale="log", yscale="log", xlabel="μ(a_t)", title=f"π/μ, {name} (dashed: PPO's clip at 0.8, 1.28)")
    right.set(xscale="log", yscale="log", xlabel="μ(a_t)", title="|π − μ| (dashed: binary TV's δ = 0.15)")
    left.legend(fontsize=7, markerscale=4)
    figure.tight_layout()
    figure.savefig(path, dpi=90)


# ---------------------------------------------------------------------------- 3. a rare right answer

BANDIT_OBJECTIVES = ["pg", "ppo_clip", "binary_tv", "topk_tv", "cppo", "drpo"]


def bandit(objective, mu0, seed, rewarded=True, vocab=451, samples=4096, updates=4, lr=0.3, steps=100) -> list:
    """A one-step bandit: V logits, token 0 at probability mu0 and the rest equal; token 0 alone is rewarded, or
    (rewarded=False) alone is not. Each step samples `samples` tokens through dppo.py's SamplingRecorder (mu, its
    top K), takes GRPO advantages over them as one group, and makes `updates` AdamW steps on objective_loss weighted
    by token_weights, as rl_step does. Returns token 0's probability after each step: until it reaches 0.5,
    or for `steps` steps."""
    torch.manual_seed(seed)
    cfg = dppo.parse_config(["--objective", objective])
    logits = torch.zeros(vocab, dtype=torch.float64)
    logits[0] = math.log(mu0 / (1 - mu0) * (vocab - 1))
    logits.requires_grad_()
    optimizer = torch.optim.AdamW([logits], lr=lr, weight_decay=0.0)
    mask = torch.ones(samples, 1)
    weights = dppo.token_weights(mask, cfg.loss_agg, max_new_tokens=cfg.max_new_tokens)
    history = []
    for _ in range(steps):
        scores = logits.detach().float().expand(samples, vocab)  # every sample from the same state
        recorder = dppo.SamplingRecorder(cfg.temperature, cfg.topk)
        recorder(None, scores)
        sampled = torch.multinomial(scores[0].softmax(-1), samples, replacement=True)
        topk_ids, mu = recorder.finish(sampled[:, None])
        rewards = (sampled == 0).float() if rewarded else (sampled != 0).float()
        advantages = dppo.grpo_advantages(rewards, samples)[:, None]
        for _ in range(updates):
            logp = logits.float().log_softmax(-1)
            pi = dppo.LogProbs(logp[sampled][:, None], logp[topk_ids], None)
            loss, _ = dppo.objective_loss(cfg, pi, mu, advantages, mask)
            optimizer.zero_grad()
            (loss * weights).sum().backward()
            optimizer.step()
        history.append(logits.detach().softmax(-1)[0].item())
        if rewarded and history[-1] >= 0.5:
            break
    return history


def rare_right_answer(seeds=5, mus=(1e-3, 1e-2, 1e-1), common=0.95, fall_lrs=(0.3, 1.0)) -> dict:
    """Steps to 0.5 from each mu0 (at bandit's learning rate), and a common wrong token's fall in one step at each
    of fall_lrs, for every objective and seed."""
    rises = {(o, m): [bandit(o, m, seed) for seed in range(seeds)] for o in BANDIT_OBJECTIVES for m in mus}
    falls = {
        (o, lr): [bandit(o, common, seed, rewarded=False, lr=lr, steps=1)[0] for seed in range(seeds)]
        for o in BANDIT_OBJECTIVES
        for lr in fall_lrs
    }
    return {"rises": rises, "falls": falls, "mus": mus, "common": common, "fall_lrs": fall_lrs}


def mean_std(values, digits=1) -> str:
    spread = f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.{digits}f}{spread}"


def bandit_table(result: dict) -> list[str]:
    mus, lrs = result["mus"], result["fall_lrs"]
    header = [f"steps to 0.5 from {m:g}" for m in mus] + [f"× in step 1 from {mus[0]:g}"]
    header += [f"{result['common']:g} after one step, A < 0, lr {lr:g}" for lr in lrs]
    rows = ["| objective | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
    for objective in BANDIT_OBJECTIVES:
        cells = []
        for m in mus:
            histories = result["rises"][objective, m]
            reached = [len(h) for h in histories if h[-1] >= 0.5]
            cells.append(mean_std(reached) if len(reached) == len(histories) else f"{len(reached)} of {len(histories)}")
        cells.append(mean_std([h[0] / mus[0] for h in result["rises"][objective, mus[0]]]))
        cells += [mean_std(result["falls"][objective, lr], 3) for lr in lrs]
        rows.append(f"| `{objective}` | " + " | ".join(cells) + " |")
    return rows


def draw_bandit(plt, result: dict, path: Path):
    lrs = result["fall_lrs"]
    figure, (rise, fall) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw=dict(width_ratios=[3, 2]))
    for i, objective in enumerate(BANDIT_OBJECTIVES):
        for m, style in zip(result["mus"], ["-", "--", ":"]):
            history = result["rises"][objective, m][0]  # seed 0
            label = objective if m == result["mus"][0] else None
            rise.plot(range(len(history) + 1), [m, *history], style, color=f"C{i}", marker=".", label=label)
        for j, lr in enumerate(lrs):
            at = i + (j - (len(lrs) - 1) / 2) * 0.8 / len(lrs)
            fall.bar(
                at, statistics.mean(result["falls"][objective, lr]), 0.8 / len(lrs), color=f"C{i}", alpha=1 - 0.5 * j
            )
    rise.axhline(0.5, color="k", linewidth=0.5)
    rise.set(yscale="log", xlabel="step (one rollout, 4 AdamW updates)", ylabel="π(the right token)")
    rise.set_title("a rare right token, seed 0: from 1e-3 (—), 1e-2 (--), 0.1 (··)", fontsize=9)
    rise.legend(fontsize=7)
    fall.axhline(result["common"], color="k", linewidth=0.5)
    fall.set_xticks(range(len(BANDIT_OBJECTIVES)), BANDIT_OBJECTIVES, fontsize=7, rotation=30)
    fall.set_ylim(0, 1)
    lr_text = ", ".join(f"lr {lr:g}" + (" (pale)" if j else "") for j, lr in enumerate(lrs))
    fall.set_title(f"π of a common wrong token ({result['common']:g}), one step: {lr_text}", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=90)


# ---------------------------------------------------------------------------- 4. the tokens each trust region blocks

BLOCKERS = ["ppo_clip", "dcpo", "binary_tv", "topk_tv", "cppo"]
# The run recorded: DPPO's top-K TV (so that pi's top K is computed), a bf16 sampler; typed flags come after these.
BLOCKED_RUN = [
    "--objective",
    "topk_tv",
    "--sampler_dtype",
    "bfloat16",
    "--steps",
    "20",
    "--eval_n",
    "20",
]  # each judged at the same (pi, mu, A) by objective_loss
CLASSES = ["end of sequence", "final answer", "digits and operators", "words", "other"]
ARITHMETIC = set("0123456789+-*/=×÷.,$% ")


def token_classes(tokenizer, ids: list[int], eos_ids) -> list[str]:
    """Each completion token's class (CLASSES, first match): an EOS id; a token overlapping the final answer's last
    occurrence in the text (rewards.extract_answer's); only digits, operators and spaces; a token with a letter."""
    offsets = [len(tokenizer.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids) + 1)]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    answer = dppo.extract_answer(text)
    start = text.rfind(answer) if answer else -1
    span = range(start, start + len(answer)) if start >= 0 else range(0)
    classes = []
    for i, token in enumerate(ids):
        piece = text[offsets[i] : offsets[i + 1]]
        if token in eos_ids:
            classes.append("end of sequence")
        elif span and offsets[i] < span.stop and offsets[i + 1] > span.start:
            classes.append("final answer")
        elif piece.strip() and set(piece) <= ARITHMETIC:
            classes.append("digits and operators")
        elif any(c.isalpha() for c in piece):
            classes.append("words")
        else:
            classes.append("other")
    return classes


def blocked_tokens(flags: list[str]) -> tuple[list[dict], object, set]:
    """Every token trained in a few RL steps of `python dppo.py FLAGS`, recorded where rl_step hands it to
    add_token_stats: its update, position, id, text class, mu(a_t), pi(a_t) and A, and which of BLOCKERS block it
    at that (pi, mu, A), each by objective_loss on the same tensors (the run trains under the objective its flags
    name; pi's top-K is computed when that objective is topk_tv or topk_kl)."""
    records, update = [], [0]
    add_token_stats, token_counts = dppo.add_token_stats, dppo.token_counts

    def counting_mini_batches(mask):  # rl_step calls it once a mini-batch
        update[0] += 1
        return token_counts(mask)

    def recording(stats, cfg, sampled, pi, anchor, A, blocked, first):
        add_token_stats(stats, cfg, sampled, pi, anchor, A, blocked, first)
        pi = dppo.LogProbs(*(None if x is None else x.detach() for x in pi))
        judged = {}
        for objective in BLOCKERS:
            if objective in ("topk_tv", "topk_kl") and pi.topk_logp is None:
                continue
            settings = dataclasses.replace(cfg, objective=objective, **dppo.OBJECTIVE_DEFAULTS.get(objective, {}))
            judged[objective] = dppo.objective_loss(settings, pi, anchor, A, sampled.completion_mask)[1] & (A != 0)
        for row in range(len(A)):
            length = int(sampled.completion_mask[row].sum())
            ids = sampled.completion_ids[row, :length].tolist()
            records.append(
                dict(
                    update=update[0],
                    ids=ids,
                    advantage=float(A[row]),
                    mu=sampled.mu.logp[row, :length].exp().tolist(),
                    pi=pi.logp[row, :length].exp().tolist(),
                    blocked={name: mask[row, :length].tolist() for name, mask in judged.items()},
                )
            )

    dppo.add_token_stats, dppo.token_counts = recording, counting_mini_batches
    try:
        with tempfile.TemporaryDirectory() as out:
            dppo.main(flags + ["--output_dir", out, "--eval_every", "1000000"])
            tokenizer = dppo.AutoTokenizer.from_pretrained(out)
            eos = dppo.GenerationConfig.from_pretrained(out).eos_token_id
    finally:
        dppo.add_token_stats, dppo.token_counts = add_token_stats, token_counts
    return records, tokenizer, {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}


def token_table(records: list[dict], tokenizer, eos_ids) -> list[dict]:
    """One row per trained token: mu, pi, A, side (pi above or below mu), class, text and what blocks it."""
    tokens = []
    for record in records:
        classes = token_classes(tokenizer, record["ids"], eos_ids)
        for t, token in enumerate(record["ids"]):
            mu, pi = record["mu"][t], record["pi"][t]
            tokens.append(
                dict(
                    mu=mu,
                    pi=pi,
                    advantage=record["advantage"],
                    rising=pi > mu,
                    position=t,
                    cls=classes[t],
                    text=tokenizer.decode([token]),
                    blocked={name: mask[t] for name, mask in record["blocked"].items()},
                )
            )
    return tokens


def share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.2f}% ({part})" if whole else "–"


def blocked_tables(tokens: list[dict]) -> list[str]:
    """The README's tables: blocked share per objective by mu's decade and by the advantage's sign and side; the tokens
    the clip blocks that binary TV keeps and the reverse; what the blocked tokens are, beside all trained tokens."""
    names = [name for name in BLOCKERS if name in tokens[0]["blocked"]]
    lines = ["| trained tokens (A ≠ 0) | count | " + " | ".join(f"`{name}` blocks" for name in names) + " |"]
    lines.append("|---" * (len(names) + 2) + "|")
    trained = [x for x in tokens if x["advantage"] != 0]  # a token with A = 0 has no gradient to lose
    groups = {f"μ in [{low:g}, {high:.3g})": [x for x in trained if low <= x["mu"] < high] for low, high in DECADES}
    for sign, positive in (("A > 0", True), ("A < 0", False)):
        for side, rising in (("rising", True), ("falling", False)):
            groups[f"{sign}, π {side}"] = [
                x for x in trained if (x["advantage"] > 0) == positive and x["rising"] == rising
            ]
    groups["all"] = trained
    for label, group in groups.items():
        cells = [share(sum(x["blocked"][name] for x in group), len(group)) for name in names]
        lines.append(f"| {label} | {len(group):,} | " + " | ".join(cells) + " |")
    for first, second in (("ppo_clip", "binary_tv"), ("binary_tv", "ppo_clip")):
        only = [x["text"] for x in tokens if x["blocked"][first] and not x["blocked"][second]]
        common = Counter(only).most_common(12)
        listed = ", ".join(f"`{text!r}` {count}" for text, count in common) or "none"
        lines += ["", f"Blocked by `{first}`, kept by `{second}`: {len(only)} tokens; the most frequent: {listed}"]
    lines += ["", "| what the token is | all trained tokens | " + " | ".join(f"blocked by `{n}`" for n in names) + " |"]
    lines.append("|---" * (len(names) + 2) + "|")
    for label in [*CLASSES, "a branching point: μ(a_t) < 0.5"]:
        cells = []
        for group in [trained] + [[x for x in trained if x["blocked"][name]] for name in names]:
            found = sum(x["mu"] < 0.5 if label.startswith("a branching") else x["cls"] == label for x in group)
            cells.append(share(found, len(group)))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


COLOURS = {
    "ppo_clip": "tab:red",
    "dcpo": "tab:orange",
    "binary_tv": "tab:blue",
    "topk_tv": "tab:green",
    "cppo": "tab:purple",
}


def draw_blocked(plt, records: list[dict], tokenizer, path: Path, shown=3):
    """The completions with the most blocked tokens, a token at a time; under each token a bar for each objective that
    blocks it, one colour per objective."""
    chosen = sorted(records, key=lambda r: -sum(sum(mask) for mask in r["blocked"].values()))[:shown]
    names = list(records[0]["blocked"])
    figure, axes = plt.subplots(len(chosen), 1, figsize=(12, 1.8 * len(chosen)), squeeze=False)
    renderer = figure.canvas.get_renderer()
    for ax, record in zip(axes[:, 0], chosen):
        ax.set_axis_off()
        ax.set_title(f"a completion with A = {record['advantage']:+.2f}", loc="left", fontsize=9)
        x, y = 0.0, 0.8
        for t, token in enumerate(record["ids"]):
            label = ax.text(x, y, tokenizer.decode([token]).replace("\n", "⏎"), fontsize=9, family="monospace")
            width = label.get_window_extent(renderer).transformed(ax.transAxes.inverted()).width
            if x + width > 1:
                x, y = 0.0, y - 0.45
                label.set_position((x, y))
            for k, name in enumerate(names):
                if record["blocked"][name][t]:
                    ax.plot([x, x + width], [y - 0.05 - 0.06 * k] * 2, color=COLOURS[name], lw=2.5)
            x += width
        ax.set_xlim(0, 1)
        ax.set_ylim(y - 0.4, 1.1)
    handles = [plt.Line2D([], [], color=COLOURS[name], lw=2.5, label=f"blocked by {name}") for name in names]
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(path, dpi=90)


# ---------------------------------------------------------------------------- the command


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", choices=["regions", "numerics", "bandit", "blocked"], help="one figure (default: all)"
    )
    parser.add_argument("--model", default="", help="the checkpoint, as dppo.py's --model; default: the demo's")
    parser.add_argument("--dataset", default="arithmetic", help="Figure 1's prompts, as dppo.py's --dataset")
    parser.add_argument("--prompts", type=int, default=128, help="Figure 1: prompts")
    parser.add_argument("--samples", type=int, default=8, help="Figure 1: completions per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=16, help="Figure 1: completion length limit")
    parser.add_argument("--out", default=str(HERE), help="where the PNGs go")
    parser.add_argument("dppo_flags", nargs="*", help="blocked: after --, flags for the dppo.py run it records")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
        print("matplotlib is not installed (pip install matplotlib): the tables only, no figure drawn", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    if args.only in (None, "regions"):
        print("\n".join(["## The trust regions: how far π(a_t) may move from μ(a_t), down (A < 0) – up (A > 0)", ""]))
        print("\n".join(reach_table()))
        if plt:
            draw_regions(plt, out / "trust_regions.png")
    if args.only in (None, "numerics"):
        model, name = args.model, checkpoint_name(args.model)
        tokens = sampled_tokens(
            model, args.dataset, ("bfloat16", "float16"), args.prompts, args.samples, args.max_new_tokens
        )
        print("\n".join([f"\n## Figure 1: {name}, pi (fp32) against mu (a copy in another dtype)", ""]))
        print("\n".join(decade_table(tokens)))
        if plt:
            draw_numerics(plt, tokens, name, out / f"numerics_{name.replace(' ', '_')}.png")
    if args.only in (None, "bandit"):
        result = rare_right_answer()
        print("\n".join(["\n## A rare right answer: a one-step bandit, 5 seeds", ""]))
        print("\n".join(bandit_table(result)))
        if plt:
            draw_bandit(plt, result, out / "rare_right_answer.png")
    if args.only in (None, "blocked"):
        model, name = args.model, checkpoint_name(args.model)
        flags = BLOCKED_RUN + (["--model", model] if model else []) + args.dppo_flags
        records, tokenizer, eos_ids = blocked_tokens(flags)
        print("\n".join([f"\n## The tokens each trust region blocks: {name}, python dppo.py {' '.join(flags)}", ""]))
        print("\n".join(blocked_tables(token_table(records, tokenizer, eos_ids))))
        if plt:
            draw_blocked(plt, records, tokenizer, out / f"blocked_{name.replace(' ', '_')}.png")
    print(f"\n{time.time() - started:.0f} s" + (f"; figures in {out}" if plt else ""), file=sys.stderr)


def checkpoint_name(model: str) -> str:  # 'SmolLM2-135M-Instruct' for its 'SmolLM2-135M-Instruct.Q4_1.gguf'
    name = Path(model).name or "the demo model"
    return name.split(".")[0] if name.endswith(".gguf") else name


if __name__ == "__main__":
    main()
