"""A seeded study's records, its table and its figure; run_gsm8k.sh calls it around every dppo.py run.

    python figures/study.py start RUN_DIR -- DPPO_FLAGS...   # provenance.json: commit, machine, flags, versions
    python figures/study.py state RUN_DIR -- DPPO_FLAGS...   # finished, resume or new; exit 2 if the record differs
    python figures/study.py finish RUN_DIR [--stopped]       # marks the run finished; deletes its model's files
    python figures/study.py report DIR --names "binary_tv ppo_clip" --seeds "0 1 2" [--pair "binary_tv ppo_clip"]
                                   [--rule first_drop|sustained_drop] [--gap sign|sign_and_interval] [--toward_mu]
                                   [--kinds_by_seed [--pool DIR2 ...]] [--results FILE] [--figure FILE]
    python figures/study.py compare --column "LABEL=DIR" --column ... --names "..." --seeds "0 1 2" --step 20
    python figures/study.py breaks --column "LABEL=DIR" --column ... --names "..." --seeds "0 1 2" [--figure F]

A run's record is RUN_DIR = DIR/<name>-seed<seed>/ with provenance.json and dppo.py's metrics.jsonl; a record is
finished once provenance.json says so. The report (DIR/results.md and DIR/curves.png) gives per name the mean ± std
over seeds at every evaluation step and each seed's numbers, the paired difference per seed between two names, and
the mean curves with a min–max band. It names the runs missing or unfinished, and refuses records from more than one
commit or kind of machine: a run's numbers depend on the CPU's arithmetic (its family, model and stepping, and the
vector extensions torch dispatches to: bf16 is native on some CPUs, emulated on others), or on the GPU and CUDA.
"""

import argparse
import hashlib
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

KEPT = {"provenance.json", "metrics.jsonl"}  # what a finished record holds: no model


def lscpu(field: str) -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith(f"{field}:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return ""


def machine() -> dict:
    """What decides a run's arithmetic, beyond the code: the CPU (and what torch dispatches to on it), the GPU."""
    import torch

    cpu = {
        "cpu": lscpu("Model name") or platform.processor() or platform.machine(),
        "cpu_id": " ".join(f"{f.lower()} {lscpu(f) or '?'}" for f in ("CPU family", "Model", "Stepping")),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    if not torch.cuda.is_available():
        return cpu | {"gpu": "none"}
    smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    driver = subprocess.run(smi, capture_output=True, text=True).stdout.split("\n")[0].strip() or "?"
    return cpu | {"gpu": f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}, driver {driver}"}


def commit() -> str:
    here = Path(__file__).resolve().parent
    git = ["git", "-C", str(here)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return head + ("-dirty" if changed.stdout.strip() else "")


def model_file(flags: list[str]) -> dict | None:
    """--model's file as {name, sha256} when it is a file (a GGUF): a record names it so, not by the path of the
    machine that ran it, and a study resumes from another checkout or virtual environment."""
    values = flag_values(flags)
    path = Path(values.get("--model", ""))
    if not values.get("--model") or not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(2**20), b""):
            digest.update(block)
    return {"name": path.name, "sha256": digest.hexdigest()}


def portable(flags: list[str]) -> list[str]:
    """The flags with a --model file given by its name alone (its hash is in the record's model_file)."""
    return [Path(flag).name if i and flags[i - 1] == "--model" else flag for i, flag in enumerate(flags)]


def start(run_dir: Path, flags: list[str]):
    """A new record in run_dir. An unfinished record there (one with no checkpoint to resume from) is started over,
    and the new record says so: when, and how far each earlier attempt got, whose minutes are in no record's clock."""
    import torch
    import transformers

    started_over = []
    if (run_dir / "provenance.json").exists():
        earlier = json.loads((run_dir / "provenance.json").read_text())
        if earlier["finished"] is not None:
            refuse(f"{run_dir} holds a finished run: give this one another --out")
        step = last_logged_step(run_dir)
        got = f"logged up to step {step}" if step is not None else "logged no step"
        attempt = f"at {now()}: the attempt started {earlier['started']} had {got} and left no checkpoint"
        started_over = [*earlier.get("started_over", []), attempt]
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)  # nothing of an earlier attempt is kept but that note
    run_dir.mkdir(parents=True)
    file = model_file(flags)
    provenance = {
        "commit": commit(),
        **machine(),
        "flags": portable(flags) if file else flags,
        **({"model_file": file} if file else {}),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "started": now(),
        "finished": None,
        **({"started_over": started_over} if started_over else {}),
    }
    (run_dir / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")


def finish(run_dir: Path, keep_models: bool, stopped: bool = False):
    """Marks the run finished; with stopped (dppo.py failed), only a run that stopped on a non-finite loss, which
    keeps its step as where it broke: any other failure is refused, exit 2, and ends the study."""
    provenance = json.loads((run_dir / "provenance.json").read_text())
    if stopped:
        last = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()][-1]
        if "stopped_nonfinite" not in last:
            refuse(f"dppo.py failed in {run_dir}, not on a non-finite loss: see its message above")
        provenance["stopped_nonfinite_at_step"] = last["step"]
    for path in run_dir.iterdir():  # the trained model: the study keeps its numbers, not its weights
        if path.name not in KEPT and not keep_models:
            subprocess.run(["rm", "-rf", str(path)], check=True)
    provenance["finished"] = now()
    (run_dir / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def last_logged_step(run_dir: Path) -> int | None:
    """The step of the last whole record in run_dir's metrics.jsonl (a killed run may leave its last line cut short)."""
    path = run_dir / "metrics.jsonl"
    whole = path.read_text().split("\n")[:-1] if path.exists() else []  # after the last newline: "" or a cut line
    return json.loads(whole[-1])["step"] if whole else None


def is_finished(run_dir: Path) -> bool:
    path = run_dir / "provenance.json"
    return path.exists() and json.loads(path.read_text())["finished"] is not None


def flag_values(flags: list[str]) -> dict:
    """{--flag: its value, '' for a switch}: the last of a repeated flag wins, as in argparse."""
    values, flag = {}, None
    for token in flags:
        if token.startswith("--"):
            flag, values[token] = token, ""
        else:
            values[flag] = f"{values[flag]} {token}".strip()
    return values


def refuse(message: str):
    print(f"study.py: {message}", file=sys.stderr)
    sys.exit(2)


def state(run_dir: Path, flags: list[str]) -> str:
    """'finished' (skip it), 'resume' (from its checkpoint; the record says when, and how far the attempt before got;
    dppo.py --resume drops the records logged past the checkpoint) or 'new'; a record whose flags (model included) or
    commit differ from the run asked for is refused in one line, exit 2: never skipped, never overwritten."""
    path = run_dir / "provenance.json"
    if not path.exists():
        return "new"
    recorded = json.loads(path.read_text())
    if recorded["commit"] != commit():
        refuse(f"{run_dir} holds a run of commit {recorded['commit'][:12]}, not {commit()[:12]}: give it another --out")
    asked, had = flag_values(flags), flag_values(recorded["flags"])
    file = model_file(flags)
    if file and "--model" in had:  # a model file: by its name and, where the record has it, its hash; not its path
        if Path(had["--model"]).name != file["name"] or recorded.get("model_file", file)["sha256"] != file["sha256"]:
            refuse(
                f"{run_dir} holds a run of --model {had['--model']}, not of this {file['name']}: give it another --out"
            )
        asked["--model"] = had["--model"]
    for flag in [*asked, *(flag for flag in had if flag not in asked)]:
        if asked.get(flag) != had.get(flag):
            mine, theirs = (
                f"{flag} {x}".strip() if x is not None else f"no {flag}" for x in (asked.get(flag), had.get(flag))
            )
            refuse(f"{run_dir} holds a run with {theirs}, not {mine}: give this study another --out")
    if recorded["finished"] is not None:
        return "finished"
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # dppo.py, beside figures/
    from dppo import newest_checkpoint  # where a kill during its save left the newest whole one

    checkpoint = newest_checkpoint(run_dir) / "training_state.pt"
    if not checkpoint.exists():
        return "new"

    step = torch.load(checkpoint, weights_only=True)["step"]
    resumed = recorded.get("resumed", [])
    resumed = [resumed] if isinstance(resumed, str) else resumed  # a note written by hand
    got = f"the attempt before had logged up to step {last_logged_step(run_dir)}"
    resumed.append(f"at {now()} from its step-{step} checkpoint ({got}): from started to finished is not its run time")
    path.write_text(json.dumps(recorded | {"resumed": resumed}, indent=1) + "\n")
    return "resume"


END = 5  # "at the end" = the mean over a run's last END steps


CPU_KIND = ("cpu", "cpu_id", "cpu_capability")  # what a run's arithmetic depends on, as provenance.json records it


def load_records(directory: Path, names: list[str], seeds: list[str], kinds_by_seed: bool = False, pool=()):
    """{(name, seed): records} of the finished runs; the runs missing or unfinished; the origin, which names the one
    CPU kind and commit of the records.
    With kinds_by_seed, the CPU kind may differ between seeds but not within one (a seed is a stratum): the origin's
    CPU then reads "one kind per seed", and origin["kinds"] maps each seed to its kind.
    With pool, more directories join the table, and each seed's records come from one directory only. Each directory
    holds one commit, so the commit may differ between seeds too. origin["commits"] maps each seed to its commit, and
    origin["directories"] maps each seed to its directory."""
    if pool and not kinds_by_seed:
        sys.exit("study.py: records pooled from several directories need kinds_by_seed: a seed is a stratum")
    directories = [directory, *pool]
    where = {}
    for seed in seeds:
        holders = [d for d in directories if any((d / f"{name}-seed{seed}").exists() for name in names)]
        if len(holders) > 1:
            sys.exit(
                f"study.py: seed {seed} has records in {', '.join(map(str, holders))}: a seed comes from one directory"
            )
        where[seed] = holders[0] if holders else directory
    finished, absent = {}, []
    for name in names:
        for seed in seeds:
            run_dir = where[seed] / f"{name}-seed{seed}"
            if not (run_dir / "provenance.json").exists():
                absent.append(f"{name} seed {seed} (missing)")
            elif not is_finished(run_dir):
                absent.append(f"{name} seed {seed} (unfinished)")
            else:
                provenance = json.loads((run_dir / "provenance.json").read_text())
                records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
                finished[name, seed] = (provenance, records)
    for d in directories if pool else []:  # a directory is one study: one commit
        commits = {run[0]["commit"] for (_, seed), run in finished.items() if where[seed] == d}
        if len(commits) > 1:
            sys.exit(f"study.py: {d} holds records of {len(commits)} commits: a directory holds one")
    settings = {tuple(shared_flags(run[0]["flags"])) for run in finished.values()} if pool else set()
    if len(settings) > 1:  # pooled seeds ran one setting: the flags agree but for name and seed
        sys.exit(f"study.py: the pooled records ran {len(settings)} settings: their flags differ")
    keys = ("cpu", "cpu_id", "cpu_capability", "gpu", "commit")
    if kinds_by_seed:
        keys = ("gpu",) if pool else ("gpu", "commit")
    origins = {key: {run[0].get(key, "not recorded") for run in finished.values()} for key in keys}
    kinds, commits = {}, {}
    if kinds_by_seed:
        for seed in seeds:
            here = {
                tuple(run[0].get(key, "not recorded") for key in CPU_KIND)
                for (_, s), run in finished.items()
                if s == seed
            }
            if len(here) > 1:
                sys.exit(f"study.py: seed {seed}'s records come from {len(here)} CPU kinds: a seed holds one")
            kinds |= {seed: next(iter(here))} if here else {}
            commits |= {seed: run[0]["commit"] for (_, s), run in finished.items() if s == seed}
    for key, values in origins.items():
        if len(values) > 1:
            sys.exit(
                f"study.py: the records come from {len(values)} {key}s ({', '.join(sorted(values))}): one table "
                f"holds one; report each {key}'s records from a directory of their own"
            )
    origin = {key: next(iter(values), "–") for key, values in origins.items()}
    if kinds_by_seed:
        origin |= {"cpu": "one CPU kind per seed (the table of kinds)", "cpu_id": "–", "cpu_capability": "–"}
        origin["kinds"] = kinds
    if pool:
        origin["commit"] = "a commit per directory"
        origin["commits"] = commits
        origin["directories"] = {seed: where[seed] for seed in kinds}
    return finished, absent, origin


def accuracies(records) -> dict[int, float]:
    return {r["step"]: 100 * r["eval/accuracy"] for r in records if "eval/accuracy" in r}


def mean_std(values, fmt=".1f") -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    return f"{statistics.mean(values):{fmt}} ± {statistics.stdev(values):{fmt.lstrip('+')}}"  # a spread has no sign


TOWARD_MU = ("trust_region/blocked_frac_pos_adv_falling", "trust_region/blocked_frac_neg_adv_rising")


def toward_mu(steps, tokens, blocked) -> float | None:
    """Of all blocked tokens, the share (%) whose gradient pulls π(a_t) back toward μ(a_t): A > 0 with π(a_t) below
    μ(a_t), or A < 0 with π(a_t) above it. DPPO's mask keeps these tokens, and IPO blocks them."""
    if not blocked or not any(TOWARD_MU[0] in r for r in steps):
        return None
    pulled_back = [sum(r.get(key, 0.0) for key in TOWARD_MU) for r in steps]  # as fractions of each step's tokens
    return 100 * sum(share * n for share, n in zip(pulled_back, tokens)) / blocked


def training(records) -> dict:
    """A run's dynamics: truncation and blocked tokens over its steps, where the blocks sit, the policy's drift."""
    steps = [r for r in records if "reward/mean" in r]
    if not steps:  # a run that broke at its first step
        return dict.fromkeys(["reward end", "truncated first", "truncated end", "blocked", "at branching"], None) | {
            "A<0, falling": None,
            "toward μ": None,
            "drift": None,
            "minutes": [r for r in records if "time/elapsed_s" in r][-1]["time/elapsed_s"] / 60,
        }
    tokens = [r["completion/length_mean"] for r in steps]  # a step's blocked fraction counts its tokens
    blocked = sum(r["trust_region/blocked_frac"] * n for r, n in zip(steps, tokens))

    def share_of_blocked(key, of_blocked=True):  # of all blocked tokens, the share in that class (%)
        if not blocked or not any(key in r for r in steps):  # a step that blocked nothing logs no share of the blocked
            return None
        weight = [r.get(key, 0.0) * (r["trust_region/blocked_frac"] if of_blocked else 1) for r in steps]
        return 100 * sum(w * n for w, n in zip(weight, tokens)) / blocked

    return {
        "reward end": 100 * statistics.mean(r["reward/mean"] for r in steps[-END:]),
        "truncated first": 100 * statistics.mean(r["completion/truncated"] for r in steps[:END]),
        "truncated end": 100 * statistics.mean(r["completion/truncated"] for r in steps[-END:]),
        "blocked": 100 * blocked / sum(tokens),
        "at branching": share_of_blocked("trust_region/blocked_at_branching_frac"),
        "A<0, falling": share_of_blocked("trust_region/blocked_frac_neg_adv_falling", of_blocked=False),
        "toward μ": toward_mu(steps, tokens, blocked),
        "drift": statistics.mean(r["policy/abs_pi_minus_mu_mean"] for r in steps),
        "minutes": [r for r in records if "time/elapsed_s" in r][-1]["time/elapsed_s"] / 60,
    }


def run_summary(records):
    """The columns of the demo's and the stress test's tables (README): one run's accuracy, drift and blocked tokens."""
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    steps = [r for r in records if "reward/mean" in r]
    if not steps:  # a run that broke at its first step: its accuracy alone
        seconds = [r for r in records if "time/elapsed_s" in r][-1]["time/elapsed_s"]
        return (
            {key: None for key in SUMMARY_KEYS}
            | {"before": evals[0], "final": evals[-1], "lowest": min(evals)}
            | {"seconds": seconds}
        )
    end = steps[-END:]
    tokens = [r["completion/length_mean"] for r in steps]  # every step has P x G completions: weights by token count
    blocked = sum(r["trust_region/blocked_frac"] * n for r, n in zip(steps, tokens))

    def share_of_blocked(key):  # e.g. of all blocked tokens, the share with mu(a_t) < 0.15
        if blocked == 0 or key not in steps[0]:
            return None
        return sum(r[key] * n for r, n in zip(steps, tokens)) / blocked

    return {
        "before": evals[0],
        "final": evals[-1],
        "lowest": min(evals),
        "truncated": statistics.mean(r["completion/truncated"] for r in end),
        "drift": statistics.mean(r["policy/abs_pi_minus_mu_mean"] for r in end),
        "drift_max": max(r["policy/abs_pi_minus_mu_max"] for r in steps),
        "mismatch": statistics.mean(r["policy/mismatch_first_update_mean"] for r in steps),
        "blocked": statistics.mean(r["trust_region/blocked_frac"] for r in steps),
        "rare_blocked": share_of_blocked("trust_region/blocked_rare_frac"),
        "rare_all": statistics.mean(r["policy/rare_token_frac"] for r in steps),
        "tv_too": share_of_blocked("trust_region/blocked_also_by_tv_frac"),
        "seconds": [r for r in records if "time/elapsed_s" in r][-1]["time/elapsed_s"],
    }


SUMMARY_KEYS = "before final lowest truncated drift drift_max mismatch blocked rare_blocked rare_all tv_too".split()
BREAK_POINTS = 5  # a run breaks where an evaluation is this many points or more below its own step-0 accuracy
FALL_FROM_BEST = 15  # sustained_drop: ... or this many points or more below its own best earlier evaluation
RULES = {  # each study's pre-registered rule, by name (report --rule); a non-finite loss breaks a run under each
    "first_drop": f"its first evaluation {BREAK_POINTS} points or more below its own step-0 accuracy",
    "sustained_drop": f"two consecutive evaluations (at the first of them), or its last, {BREAK_POINTS} points or more "
    f"below its own step-0 accuracy; or an evaluation {FALL_FROM_BEST} points or more below its own best earlier one",
}


def fell_at(evals: dict[int, float], rule: str) -> list[int]:
    """The evaluation steps at which a run counts as broken under `rule` (RULES), earliest first."""
    steps = sorted(evals)
    below = [round(evals[0] - evals[step], 6) >= BREAK_POINTS for step in steps]
    if rule == "first_drop":
        return [step for step, low in zip(steps, below) if low]
    fell = []
    for i, step in enumerate(steps[1:], start=1):
        sustained = below[i] and (i == len(steps) - 1 or below[i + 1])
        from_best = round(max(evals[s] for s in steps[:i]) - evals[step], 6) >= FALL_FROM_BEST
        if sustained or from_best:
            fell.append(step)
    return fell


def p_value(p: float) -> str:
    """A p-value to three places, or in two figures where three places would print 0.000."""
    return f"{p:.3f}" if p >= 0.0005 else f"{p:.1e}"


def fisher_one_sided(breaks_a: int, runs_a: int, breaks_b: int, runs_b: int) -> float:
    """Fisher's exact test, one-sided: the chance, with the margins fixed, that b breaks breaks_b times or more."""
    breaks, runs = breaks_a + breaks_b, runs_a + runs_b
    ways = [
        math.comb(breaks, x) * math.comb(runs - breaks, runs_b - x) for x in range(breaks_b, min(runs_b, breaks) + 1)
    ]
    return sum(ways) / math.comb(runs, runs_b)


def fisher_two_sided(breaks_a: int, runs_a: int, breaks_b: int, runs_b: int) -> float:
    """Fisher's exact test, two-sided: with the margins fixed, the chance of a table no more likely than the one seen
    (the sum of the tables' hypergeometric chances, as R's fisher.test and scipy's fisher_exact sum them)."""
    breaks, runs = breaks_a + breaks_b, runs_a + runs_b

    def chance(x: int) -> float:  # b breaks x times
        return math.comb(breaks, x) * math.comb(runs - breaks, runs_b - x) / math.comb(runs, runs_b)

    seen = chance(breaks_b)
    tables = range(max(0, breaks - runs_a), min(runs_b, breaks) + 1)
    return min(1.0, sum(chance(x) for x in tables if chance(x) <= seen * (1 + 1e-7)))


def sign_test_two_sided(successes: int, n: int) -> float:
    """The exact sign test, two-sided: twice the one-sided chance of the larger side, at most 1."""
    return min(1.0, 2 * sign_test_one_sided(max(successes, n - successes), n)) if n else 1.0


def discordant_seeds(finished, a: str, b: str, seeds: list[str], rule: str) -> tuple[int, int]:
    """(on how many seeds a broke and b held, on how many b broke and a held), over the seeds with both runs."""
    a_only = b_only = 0
    for seed in [seed for seed in seeds if (a, seed) in finished and (b, seed) in finished]:
        broke_a, broke_b = (broke_at(*finished[name, seed], rule) is not None for name in (a, b))
        a_only += broke_a and not broke_b
        b_only += broke_b and not broke_a
    return a_only, b_only


def sign_test_one_sided(successes: int, n: int) -> float:
    """The exact sign test, one-sided: the chance of `successes` or more of n, each with probability 1/2."""
    return sum(math.comb(n, k) for k in range(successes, n + 1)) / 2**n


def broke_at(provenance: dict, records, rule: str) -> int | None:
    """The step where a run broke under `rule` (its first evaluation that breaks it, or where its loss was non-finite,
    whichever came first); None if it never broke."""
    fell, stopped = fell_at(accuracies(records), rule), provenance.get("stopped_nonfinite_at_step")
    return min([*fell[:1], *([stopped] if stopped is not None else [])], default=None)


def later_breaks(finished, a: str, b: str, seeds: list[str], rule: str) -> tuple[int, int]:
    """On the seeds where a's run or b's broke: (on how many a broke later than b, how many). A run that never broke
    counts as later; both breaking at the same step does not."""
    later = either = 0
    for seed in [seed for seed in seeds if (a, seed) in finished and (b, seed) in finished]:
        at_a, at_b = (broke_at(*finished[name, seed], rule) for name in (a, b))
        if at_a is not None or at_b is not None:
            either += 1
            later += at_b is not None and (at_a is None or at_a > at_b)
    return later, either


def breaking(provenance: dict, records, rule: str = "first_drop") -> dict:
    """Where a run broke, if it did: its first evaluation that breaks it under `rule` (RULES), or the step whose loss
    was non-finite (dppo.py stopped there), whichever came first; and the run's extremes."""
    evals, step = accuracies(records), broke_at(provenance, records, rule)
    grad_norms = [r["grad_norm"] for r in records if "grad_norm" in r]
    if step is not None and step == provenance.get("stopped_nonfinite_at_step"):
        broke = f"step {step} (non-finite loss)"
    else:
        broke = f"step {step} ({evals[step]:.1f}%)" if step is not None else "none"
    return {
        "step 0": f"{evals[0]:.1f}",
        "last evaluation": f"{evals[max(evals)]:.1f} (step {max(evals)})",
        "lowest": f"{min(evals.values()):.1f}",
        "broke at": broke,
        "largest gradient norm": f"{max(grad_norms):.3g}" if grad_norms else "–",
    }


def breaking_table(finished, names, seeds, rule="first_drop", pairs=(), delay=False, paired=False) -> list[str]:
    """Per run, where it broke (under `rule`, or a non-finite loss) and its extremes; under sustained_drop, each pair's
    break counts and Fisher's one-sided p; with delay, on how many seeds each pair's first broke later (a sign test)."""
    columns = ["step 0", "last evaluation", "lowest", "broke at", "largest gradient norm"]
    lines = [
        "",
        f"Where each run broke: {RULES[rule]}, or "
        "the step whose loss was non-finite (the run stopped there); held-out accuracy (%) at step 0, at its last "
        "evaluation and its lowest; the largest of its steps' gradient norms (each the mean over the step's "
        "optimizer steps, before clipping):",
        "",
        "| name | seed | " + " | ".join(columns) + " |",
        "|---" * (2 + len(columns)) + "|",
    ]
    for name in names:
        runs = {seed: breaking(*finished[name, seed], rule) for seed in seeds if (name, seed) in finished}
        for seed, run in runs.items():
            lines.append(f"| `{name}` | {seed} | " + " | ".join(run[c] for c in columns) + " |")
        if runs:
            broken = sum(run["broke at"] != "none" for run in runs.values())
            lines.append(f"| `{name}` | broke on | {broken} of {len(runs)} seeds |" + " |" * (len(columns) - 1))
    if rule == "sustained_drop" and pairs:
        lines += ["", "Break counts per pair, and Fisher's exact one-sided p that the second breaks more often:", ""]
        for a, b in pairs:
            counts = []
            for name in (a, b):
                runs = [breaking(*finished[name, seed], rule) for seed in seeds if (name, seed) in finished]
                counts += [sum(run["broke at"] != "none" for run in runs), len(runs)]
            p = f"p = {p_value(fisher_one_sided(*counts))}" if counts[1] and counts[3] else "no runs"
            lines.append(f"- `{a}` {counts[0]} of {counts[1]}, `{b}` {counts[2]} of {counts[3]}: {p}")
    if rule == "sustained_drop" and pairs and paired:
        lines += [
            "",
            "Per pair, the seeds where one run broke and the other held (the discordant seeds): the exact sign test's "
            "p, one-sided (the second breaks on more of them) and two-sided; and Fisher's exact two-sided p on the "
            "break counts:",
            "",
        ]
        for a, b in pairs:
            a_only, b_only = discordant_seeds(finished, a, b, seeds, rule)
            n = a_only + b_only
            counts = []
            for name in (a, b):
                runs = [breaking(*finished[name, seed], rule) for seed in seeds if (name, seed) in finished]
                counts += [sum(run["broke at"] != "none" for run in runs), len(runs)]
            one, two = p_value(sign_test_one_sided(b_only, n)), p_value(sign_test_two_sided(b_only, n))
            fisher = p_value(fisher_two_sided(*counts)) if counts[1] and counts[3] else "no runs"
            lines.append(
                f"- `{a}` broke and `{b}` held on {a_only} seeds, the reverse on {b_only}: sign test p = {one} "
                f"one-sided, {two} two-sided; Fisher two-sided p = {fisher}"
            )
    if rule == "sustained_drop" and pairs and delay:
        lines += [
            "",
            "Per pair, on the seeds where either run broke: on how many the first broke later than the second (one "
            "that never broke counts as later; both at the same step do not), and the exact one-sided sign test's p:",
            "",
        ]
        for a, b in pairs:
            later, either = later_breaks(finished, a, b, seeds, rule)
            p = f"p = {p_value(sign_test_one_sided(later, either))}" if either else "neither broke on any seed"
            lines.append(f"- `{a}` later than `{b}` on {later} of {either}: {p}")
    return lines


def minutes_not_its_own(provenance: dict) -> bool:
    """A record marked as sharing its CPU, or resumed from a checkpoint (its clock restarts there)."""
    return bool(provenance.get("shared_cpu") or provenance.get("resumed"))


def summary_table(finished, names, seeds) -> list[str]:
    """The table run_gsm8k.sh has always ended in, mean ± std over seeds; the README's demo and stress tables."""
    lines = [
        "",
        f'Per run, mean ± std over seeds (accuracy in %; "end" = the mean over the last {END} steps):',
        "",
        "| objective | accuracy before | final | lowest | truncated at the end (%) | \\|π−μ\\| at the end | "
        "\\|π−μ\\| max | \\|π−μ\\| at update 1 | tokens blocked (%) | of them μ(a_t) < 0.15 (%) | "
        "all tokens μ(a_t) < 0.15 (%) | clipped that TV δ=0.15 blocks too (%) | seconds per run |",
        "|---" * 13 + "|",
    ]
    for name in names:
        runs = [run_summary(finished[name, seed][1]) for seed in seeds if (name, seed) in finished]

        def cell(key, scale=1.0, fmt=".1f"):
            return mean_std([run[key] * scale for run in runs if run[key] is not None], fmt)

        lines.append(
            f"| `{name}` | {cell('before', 100)} | {cell('final', 100)} | {cell('lowest', 100)} | "
            f"{cell('truncated', 100)} | {cell('drift', fmt='.4f')} | {cell('drift_max', fmt='.3f')} | "
            f"{cell('mismatch', fmt='.1e')} | {cell('blocked', 100, '.2f')} | {cell('rare_blocked', 100)} | "
            f"{cell('rare_all', 100)} | {cell('tv_too', 100)} | {cell('seconds', fmt='.0f')} |"
        )
    return lines


def shared_flags(flags: list[str]) -> list[str]:
    """A run's dppo.py flags without its objective's and seed's, and --model as its file's name."""
    shown, i = [], 0
    while i < len(flags):
        if flags[i] in ("--objective", "--seed", "--relax_clip", "--relax_below"):
            i += 2
            continue
        shown.append(Path(flags[i]).name if i and flags[i - 1] == "--model" else flags[i])
        i += 1
    return shown


T_975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
]  # Student's t, 97.5%, 1 to 29 degrees of freedom (2 to 30 seeds)


GAPS = {  # each study's pre-registered gap criterion, by name (report --gap)
    "sign": "one sign on every seed",
    "sign_and_interval": "one sign on every seed and a 95% t interval that excludes 0",
}


def t_bounds(gaps: list[float]) -> tuple[float, float] | None:
    """The 95% t interval of the mean paired difference, seeds - 1 degrees of freedom; None under 2 seeds."""
    if len(gaps) < 2:
        return None
    if len(gaps) > len(T_975) + 1:
        sys.exit(f"study.py: no t value for {len(gaps)} seeds: T_975 stops at {len(T_975) + 1}")
    half = T_975[len(gaps) - 2] * statistics.stdev(gaps) / math.sqrt(len(gaps))
    return statistics.mean(gaps) - half, statistics.mean(gaps) + half


def t_interval(gaps: list[float]) -> str:
    bounds = t_bounds(gaps)
    return "–" if bounds is None else f"[{bounds[0]:+.1f}, {bounds[1]:+.1f}]"


def paired_verdict(gaps: list[float], n_seeds: int, criterion: str = "sign") -> str:
    """The criterion fixed before the runs (GAPS): a gap only if every seed's difference has the same sign, and under
    sign_and_interval only if its 95% t interval excludes 0 too."""
    signs = {(gap > 0) - (gap < 0) for gap in gaps}
    if not gaps:
        return "no seed has both runs"
    if n_seeds == 1:
        return "one seed: no verdict"
    if 0 in signs or len(signs) > 1:
        return "within the seeds' spread" if len(gaps) > 1 else "one seed, no sign"
    if len(gaps) < n_seeds:
        return f"one sign so far ({len(gaps)} of {n_seeds} seeds)"
    if criterion == "sign":
        return "a gap: one sign in every seed"
    low, high = t_bounds(gaps)  # every seed has both runs, and there are 2 or more
    if low <= 0 <= high:
        return "one sign in every seed, interval includes 0: not a gap"
    return "a gap: one sign in every seed, interval excludes 0"


def machine_text(origin: dict) -> str:
    cpu = f"CPU {origin['cpu']}"
    if origin["cpu_id"] not in ("not recorded", "–"):  # older records name the CPU's model alone
        cpu += f" ({origin['cpu_id']}, torch's {origin['cpu_capability']} kernels)"
    return cpu + ("" if origin["gpu"] in ("none", "not recorded", "–") else f", GPU {origin['gpu']}")


def report(
    directory: Path,
    names: list[str],
    seeds: list[str],
    pairs: list[tuple[str, str]],
    rule="first_drop",
    gap="sign",
    delay=False,
    paired=False,
    kinds_by_seed=False,
    toward=False,
    pool=(),
) -> str:
    finished, absent, origin = load_records(directory, names, seeds, kinds_by_seed, pool)
    flags = shared_flags(next(iter(finished.values()))[0]["flags"]) if finished else []
    eval_steps = sorted({step for _, records in finished.values() for step in accuracies(records)})
    where = ", ".join(f"`{d}`" for d in (directory, *pool))
    commit = origin["commit"] if pool else f"commit {origin['commit'][:7]}"  # pooled: "a commit per directory"
    lines = [
        f"Records in {where}: {len(finished)} finished of {len(names) * len(seeds)} (seeds {', '.join(seeds)}); "
        f"{commit}, {machine_text(origin)}. Flags: `{' '.join(flags)}`, and each run's name, seed.",
        "",
        "Greedy held-out accuracy (%) at each evaluation step: mean ± std over the finished seeds, then each seed's.",
        "",
        "| name | seeds | " + " | ".join(f"step {step}" for step in eval_steps) + " |",
        "|---" * (2 + len(eval_steps)) + "|",
    ]
    for name in names:
        runs = {seed: accuracies(finished[name, seed][1]) for seed in seeds if (name, seed) in finished}
        cells = []
        for step in eval_steps:
            values = [run[step] for run in runs.values() if step in run]
            each = " / ".join(f"{run[step]:.1f}" for run in runs.values() if step in run)
            cells.append(f"{mean_std(values)} ({each})" if values else "–")
        lines.append(f"| `{name}` | {', '.join(runs) or '–'} | " + " | ".join(cells) + " |")
    if pairs:
        chance = 100 * 2 * 0.5 ** len(seeds)
        if chance >= 1:
            chance = f"{chance:.0f}"
        elif chance >= 0.1:
            chance = f"{chance:.1f}"  # 10 seeds: 0.2%
        else:
            chance = f"{chance:.2g}"  # 15 seeds: 0.0061%, not 0.0%
        chance = f"which {len(seeds)} seeds meet by chance {chance}% of the time under a coin-flip sign"
        criterion = f"{GAPS[gap]}, {chance}" if gap == "sign" else f"{GAPS[gap]} (one sign alone, {chance})"
        lines += [
            "",
            "Paired differences in points, per seed (same seed, same prompt order), their mean ± std and its 95% t "
            "interval (seeds − 1 degrees of freedom); the verdict is the criterion fixed before the runs, "
            f"{criterion}:",
            "",
        ]
        lines += ["| pair | step | " + " | ".join(f"seed {seed}" for seed in seeds) + " | mean | 95% t | verdict |"]
        lines += ["|---" * (5 + len(seeds)) + "|"]
    for a, b in pairs:
        shared = [seed for seed in seeds if (a, seed) in finished and (b, seed) in finished]
        for step in eval_steps[1:]:
            gaps = {s: accuracies(finished[a, s][1])[step] - accuracies(finished[b, s][1])[step] for s in shared}
            cells = [f"{gaps[s]:+.1f}" if s in gaps else "–" for s in seeds]
            gap_list = list(gaps.values())
            verdict = paired_verdict(gap_list, len(seeds), gap)
            summary = f"{mean_std(gap_list, '+.1f')} | {t_interval(gap_list)} | {verdict}"
            lines.append(f"| `{a}` − `{b}` | {step} | " + " | ".join(cells) + f" | {summary} |")
    columns = ["reward end", "truncated first", "truncated end", "blocked", "at branching", "A<0, falling", "drift"]
    if toward:
        columns.insert(columns.index("drift"), "toward μ")
    columns.append("minutes")
    lines += [
        "",
        f"Over training, mean ± std over seeds: the sampled reward (%) over the last {END} steps (a second outcome); "
        f"completions truncated (%) over the first and the last {END} steps; "
        "tokens blocked (%, of all trained tokens); of the blocked, the share at branching points (μ(a_t) < 0.5) and "
        "with A < 0 and π falling (%); "
        + (
            "of the blocked, the share its gradient pulls back toward μ (A > 0 with π < μ, or A < 0 with π > μ; %); "
            if toward
            else ""
        )
        + "|π − μ| of the sampled tokens, mean over steps; minutes per run (its "
        "evaluations included; * where a run shared its CPU or resumed from a checkpoint, so its minutes are not its "
        "whole run's own).",
        "",
        "| name | " + " | ".join(columns) + " |",
        "|---" * (1 + len(columns)) + "|",
    ]
    for name in names:
        runs = [training(finished[name, seed][1]) for seed in seeds if (name, seed) in finished]
        formats = {"drift": ".4f", "blocked": ".2f"}
        cells = [mean_std([run[c] for run in runs if run[c] is not None], formats.get(c, ".1f")) for c in columns]
        if any(minutes_not_its_own(finished[name, seed][0]) for seed in seeds if (name, seed) in finished):
            cells[-1] += " *"
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines += breaking_table(finished, names, seeds, rule, pairs, delay, paired)
    if pool:
        lines += [
            "",
            "Each seed's directory, commit and CPU kind, as its records' provenance names them:",
            "",
            "| seed | directory | commit | CPU kind |",
            "|---|---|---|---|",
        ]
        for seed, kind in origin["kinds"].items():
            commit = origin["commits"][seed][:7]
            lines.append(f"| {seed} | `{origin['directories'][seed]}` | {commit} | {', '.join(kind)} |")
    elif kinds_by_seed:
        lines += [
            "",
            "Each seed's CPU kind, as its records' provenance names it:",
            "",
            "| seed | CPU kind |",
            "|---|---|",
        ]
        lines += [f"| {seed} | {', '.join(kind)} |" for seed, kind in origin["kinds"].items()]
    lines += summary_table(finished, names, seeds)
    if absent:
        lines += ["", f"Not in the tables: {'; '.join(absent)}."]
    return "\n".join(lines) + "\n"


def compare(columns: list[tuple[str, Path]], names: list[str], seeds: list[str], step: int) -> str:
    """One table across record directories, a column each (a kind of machine, a sampler): per name, the mean ± std
    over the finished seeds at `step`, each seed's value. A column is one directory's records, which load_records
    holds to one commit and one kind of machine; nothing is pooled across columns."""
    loaded = [(label, directory, *load_records(directory, names, seeds)) for label, directory in columns]
    lines = [
        f"Greedy held-out accuracy (%) at step {step}, a column per record directory: mean ± std over the seeds "
        '(each seed\'s value; its seeds); "not run" where the directory holds no finished run of that name.',
        "",
        "| name | " + " | ".join(label for label, *_ in loaded) + " |",
        "|---" * (1 + len(loaded)) + "|",
    ]
    for name in names:
        cells = []
        for _, _, finished, _, _ in loaded:
            runs = {seed: accuracies(finished[name, seed][1]) for seed in seeds if (name, seed) in finished}
            at = {seed: run[step] for seed, run in runs.items() if step in run}
            each = " / ".join(f"{value:.1f}" for value in at.values())
            cells.append(f"{mean_std(list(at.values()))} ({each}; seeds {', '.join(at)})" if at else "not run")
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    lines.append("")
    for label, directory, finished, _, origin in loaded:
        flags = shared_flags(next(iter(finished.values()))[0]["flags"]) if finished else []
        where = f"`{directory}`, commit {origin['commit'][:7]}, {machine_text(origin)}"
        lines.append(f"- {label}: {where}; flags `{' '.join(flags)}`")
    return "\n".join(lines) + "\n"


def breaks(columns: list[tuple[str, Path]], names: list[str], seeds: list[str], rule: str) -> str:
    """Per name, its break count in each record directory (a setting: E = 1 against E = 4, say) and Fisher's exact
    one-sided p that it breaks more often in the second than in the first. Nothing is pooled across directories."""
    loaded = [(label, directory, *load_records(directory, names, seeds)) for label, directory in columns]
    (first, *_), (second, *_) = loaded[:2]
    lines = [
        f"Runs broken ({RULES[rule]}, or a non-finite loss), per name and record directory, and Fisher's exact "
        f"one-sided p that a name breaks more often in `{second}` than in `{first}`:",
        "",
        "| name | " + " | ".join(label for label, *_ in loaded) + " | p |",
        "|---" * (2 + len(loaded)) + "|",
    ]
    for name in names:
        counts = []
        for _, _, finished, _, _ in loaded:
            runs = [broke_at(*finished[name, seed], rule) for seed in seeds if (name, seed) in finished]
            counts.append((sum(run is not None for run in runs), len(runs)))
        p = p_value(fisher_one_sided(*counts[0], *counts[1])) if counts[0][1] and counts[1][1] else "–"
        lines.append(f"| `{name}` | " + " | ".join(f"{b} of {n}" for b, n in counts) + f" | {p} |")
    lines.append("")
    for label, directory, finished, absent, origin in loaded:
        missing = f"; not in the table: {'; '.join(absent)}" if absent else ""
        lines.append(f"- {label}: `{directory}`, commit {origin['commit'][:7]}, {machine_text(origin)}{missing}")
    return "\n".join(lines) + "\n"


def draw_settings(columns: list[tuple[str, Path]], names: list[str], seeds: list[str], path: Path):
    """A panel per name: its held-out accuracy over steps in each record directory, mean and min–max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = [(label, load_records(directory, names, seeds)[0]) for label, directory in columns]
    figure, axes = plt.subplots(1, len(names), figsize=(4.4 * len(names), 3.6), sharey=True, squeeze=False)
    for name, ax in zip(names, axes[0]):
        for i, (label, finished) in enumerate(loaded):
            curves = [accuracies(finished[name, seed][1]) for seed in seeds if (name, seed) in finished]
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(curve) for curve in curves)))
            values = [[curve[step] for curve in curves] for step in steps]
            mean = [statistics.mean(v) for v in values]
            ax.plot(steps, mean, color=f"C{i}", marker="o", markersize=4, label=f"{label} ({len(curves)})")
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=f"C{i}", alpha=0.2)
        ax.set_title(f"{name}: held-out accuracy (%)", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, title="setting (seeds)", title_fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def knob(records) -> dict:
    """One run's cells of the off-policy table: final and lowest accuracy, largest |π − μ|, tokens blocked."""
    evals, steps = list(accuracies(records).values()), [r for r in records if "reward/mean" in r]
    tokens = [r["completion/length_mean"] for r in steps]  # a step's share of blocked tokens counts its tokens
    return {
        "final": evals[-1],
        "lowest": min(evals),
        "largest": max((r["policy/abs_pi_minus_mu_max"] for r in steps), default=None),
        "blocked": 100 * sum(r["trust_region/blocked_frac"] * n for r, n in zip(steps, tokens)) / sum(tokens)
        if steps
        else None,
    }


def offpolicy(rows: list[tuple[str, Path]], names: list[str], seeds: list[str]) -> str:
    """One table, a row per name and record directory (a setting of the off-policy knobs): mean ± std over the seeds
    and each seed's value. Each directory's records are held to one commit and one kind of machine (load_records)."""
    loaded = [(label, directory, *load_records(directory, names, seeds)) for label, directory in rows]
    lines = [
        "Per name and setting, mean ± std over the seeds (each seed's value): the final and the lowest greedy held-out "
        "accuracy (%, every evaluation, step 0 included); the largest |π − μ| of a sampled token in any update of the "
        "run; the tokens blocked (%, of every token an update trained on, weighted by each step's tokens: a rollout "
        "reused E times counts its tokens E times).",
        "",
        "| name | setting | seeds | final | lowest | largest \\|π − μ\\| | tokens blocked (%) |",
        "|---" * 7 + "|",
    ]
    formats = {"final": ".1f", "lowest": ".1f", "largest": ".3f", "blocked": ".2f"}
    for name in names:
        for label, _, finished, _, _ in loaded:
            runs = {seed: knob(finished[name, seed][1]) for seed in seeds if (name, seed) in finished}
            cells = []
            for key, fmt in formats.items():
                values = [run[key] for run in runs.values() if run[key] is not None]
                each = " / ".join(f"{value:{fmt}}" for value in values)
                cells.append(f"{mean_std(values, fmt)} ({each})" if values else "–")
            lines.append(f"| `{name}` | {label} | {', '.join(runs) or 'not run'} | " + " | ".join(cells) + " |")
    lines.append("")
    for label, directory, finished, absent, origin in loaded:
        flags = shared_flags(next(iter(finished.values()))[0]["flags"]) if finished else []
        where = f"`{directory}`, commit {origin['commit'][:7]}, {machine_text(origin)}"
        missing = f"; not in the table: {'; '.join(absent)}" if absent else ""
        lines.append(f"- {label}: {where}; flags `{' '.join(flags)}`{missing}")
    return "\n".join(lines) + "\n"


def draw(directory: Path, names: list[str], seeds: list[str], path: Path, toward=False, kinds_by_seed=False, pool=()):
    """Each name's mean over its finished seeds, with the min–max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finished = load_records(directory, names, seeds, kinds_by_seed, pool)[0]
    panels = [
        ("held-out accuracy (%)", "eval/accuracy"),
        ("completions truncated (%)", "completion/truncated"),
        ("tokens blocked (%)", "trust_region/blocked_frac"),
        ("|π − μ| of sampled tokens, mean (dotted: update 1)", "policy/abs_pi_minus_mu_mean"),
    ]
    if any("policy/staleness_steps" in r for _, records in finished.values() for r in records):
        panels.append(("realised staleness (steps)", "policy/staleness_steps"))
    if toward:
        panels.insert(3, ("of the blocked, pulled back toward μ (%)", "toward_mu"))
        for _, records in finished.values():  # a step's share of its blocked tokens, where it blocked any
            for r in records:
                if r.get("trust_region/blocked_frac") and TOWARD_MU[0] in r:
                    r["toward_mu"] = sum(r.get(key, 0.0) for key in TOWARD_MU) / r["trust_region/blocked_frac"]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6))
    for (title, key), ax in zip(panels, axes):
        scale = 1 if key.startswith("policy/") else 100
        for i, name in enumerate(names):
            curves = [
                {r["step"]: scale * r[key] for r in finished[name, s][1] if key in r}
                for s in seeds
                if (name, s) in finished
            ]
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(curve) for curve in curves)))
            values = [[curve[step] for curve in curves] for step in steps]
            marker = "o" if key == "eval/accuracy" else None  # evaluations are few: each one shown
            mean = [statistics.mean(v) for v in values]
            ax.plot(steps, mean, color=f"C{i}", marker=marker, markersize=4, label=f"{name} ({len(curves)})")
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=f"C{i}", alpha=0.2)
            if key == "policy/abs_pi_minus_mu_mean":  # the numerics' floor: update 1, where pi = pi_old
                first = "policy/mismatch_first_update_mean"  # in the same step records as the key drawn
                floor = [
                    {r["step"]: r[first] for r in finished[name, s][1] if first in r}
                    for s in seeds
                    if (name, s) in finished
                ]
                at = [statistics.mean(f[step] for f in floor) for step in steps]
                ax.plot(steps, at, color=f"C{i}", linestyle=":", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, title="name (seeds)", title_fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description="a seeded study's table and figure, from its records")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--names", required=True, help='the objectives and variants, e.g. "binary_tv ppo_clip"')
    parser.add_argument("--seeds", required=True, help='e.g. "0 1 2"')
    parser.add_argument("--pair", action="append", default=[], help='"A B": A − B per seed; repeatable')
    parser.add_argument("--figure", type=Path, help="where the figure goes (default DIRECTORY/curves.png)")
    parser.add_argument("--rule", choices=list(RULES), default="first_drop", help="the study's registered break rule")
    parser.add_argument("--gap", choices=list(GAPS), default="sign", help="the study's registered gap criterion")
    parser.add_argument("--delay", action="store_true", help="sustained_drop: does each pair's first break later?")
    parser.add_argument("--paired", action="store_true", help="sustained_drop: each pair's discordant seeds")
    parser.add_argument("--kinds_by_seed", action="store_true", help="one CPU kind per seed, not per directory")
    parser.add_argument("--toward_mu", action="store_true", help="the share of blocked tokens pulled back toward μ")
    parser.add_argument(
        "--pool",
        action="append",
        type=Path,
        default=[],
        help="another directory of records whose seeds join the table, each seed from one directory; repeatable; "
        "needs --kinds_by_seed",
    )
    parser.add_argument("--results", type=Path, help="where the table goes (default DIRECTORY/results.md)")
    args = parser.parse_args(argv)
    if args.pool and not args.kinds_by_seed:
        parser.error("--pool reads each seed as a stratum: give --kinds_by_seed too")
    names, seeds, pairs = args.names.split(), args.seeds.split(), [tuple(pair.split()) for pair in args.pair]
    if args.delay and (args.rule != "sustained_drop" or not pairs):
        parser.error("--delay reads the pairs' breaks under --rule sustained_drop: give both, and a --pair")
    if args.paired and (args.rule != "sustained_drop" or not pairs):
        parser.error("--paired reads the pairs' breaks under --rule sustained_drop: give both, and a --pair")
    table = report(
        args.directory,
        names,
        seeds,
        pairs,
        args.rule,
        args.gap,
        args.delay,
        args.paired,
        args.kinds_by_seed,
        args.toward_mu,
        args.pool,
    )
    (args.results or args.directory / "results.md").write_text(table)
    print(table, end="")
    try:
        draw(
            args.directory,
            names,
            seeds,
            args.figure or args.directory / "curves.png",
            args.toward_mu,
            args.kinds_by_seed,
            args.pool,
        )
    except ImportError:
        print("no figure: `pip install matplotlib` to draw it", file=sys.stderr)


def compare_main(argv=None):
    parser = argparse.ArgumentParser(description="one table across record directories, a column each")
    parser.add_argument("--column", action="append", required=True, help='"LABEL=DIRECTORY"; repeatable, in order')
    parser.add_argument("--names", required=True, help='the objectives and variants, e.g. "binary_tv ppo_clip"')
    parser.add_argument("--seeds", required=True, help='e.g. "0 1 2"')
    parser.add_argument("--step", type=int, required=True, help="the evaluation step compared")
    args = parser.parse_args(argv)
    columns = [(column.split("=", 1)[0], Path(column.split("=", 1)[1])) for column in args.column]
    print(compare(columns, args.names.split(), args.seeds.split(), args.step), end="")


def offpolicy_main(argv=None):
    parser = argparse.ArgumentParser(description="the off-policy knobs' table: a row per name and record directory")
    parser.add_argument("--row", action="append", required=True, help='"SETTING=DIRECTORY"; repeatable, in order')
    parser.add_argument("--names", required=True, help='the objectives and variants, e.g. "binary_tv ppo_clip"')
    parser.add_argument("--seeds", required=True, help='e.g. "0 1 2"')
    args = parser.parse_args(argv)
    rows = [(row.split("=", 1)[0], Path(row.split("=", 1)[1])) for row in args.row]
    print(offpolicy(rows, args.names.split(), args.seeds.split()), end="")


def breaks_main(argv=None):
    parser = argparse.ArgumentParser(description="break counts across record directories, and the figure of them")
    parser.add_argument("--column", action="append", required=True, help='"LABEL=DIRECTORY"; repeatable, in order')
    parser.add_argument("--names", required=True, help='the objectives and variants, e.g. "binary_tv ppo_clip"')
    parser.add_argument("--seeds", required=True, help='e.g. "0 1 2"')
    parser.add_argument("--rule", choices=list(RULES), default="sustained_drop", help="the registered break rule")
    parser.add_argument("--figure", type=Path, help="also draw each name's accuracy in each directory here")
    args = parser.parse_args(argv)
    columns = [(column.split("=", 1)[0], Path(column.split("=", 1)[1])) for column in args.column]
    if len(columns) < 2:
        parser.error("two --column at least: the first is what the second is tested against")
    print(breaks(columns, args.names.split(), args.seeds.split(), args.rule), end="")
    if args.figure:
        draw_settings(columns, args.names.split(), args.seeds.split(), args.figure)


if __name__ == "__main__":
    if sys.argv[1:2] in (["report"], ["compare"], ["offpolicy"], ["breaks"]):
        commands = dict(report=main, compare=compare_main, offpolicy=offpolicy_main, breaks=breaks_main)
        commands[sys.argv[1]](sys.argv[2:])
        sys.exit()
    command, run_dir, *rest = sys.argv[1:]
    if command == "start":
        start(Path(run_dir), rest[1:] if rest[:1] == ["--"] else rest)
    elif command == "finish":
        finish(Path(run_dir), keep_models="--keep_models" in rest, stopped="--stopped" in rest)
    elif command == "state":
        print(state(Path(run_dir), rest[1:] if rest[:1] == ["--"] else rest))
