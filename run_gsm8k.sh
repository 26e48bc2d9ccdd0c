#!/usr/bin/env bash
# Compare objectives: each objective x seed trains from the same model with the same budget, and the study
# ends in a markdown table (mean ± std over seeds) and a figure of the curves of every run.
#
#   bash run_gsm8k.sh                                            # GSM8K, all twelve objectives, Qwen2.5-0.5B-Instruct, one GPU
#   bash run_gsm8k.sh --objectives "ppo_clip topk_tv" --steps 50 --model Qwen/Qwen2.5-1.5B-Instruct
#   bash run_gsm8k.sh --dataset path/to/gsm8k                    # a local copy (JSONL files or save_to_disk)
#   bash run_gsm8k.sh --seeds "0 1 2" -- --learning_rate 2e-6    # flags after -- go to every dppo.py run
#   bash run_gsm8k.sh --demo --seeds "0 1 2" -- --updates_per_step 16   # offline: the built-in demo model and data
#   bash run_gsm8k.sh --smoke                                    # the GSM8K pipeline offline on a CPU, 3 steps an objective
#   bash run_gsm8k.sh --report --out runs/gsm8k                  # only (re)write the table and figure of finished runs
#   bash run_gsm8k.sh --help                                     # this text
#
# Options: --model M (default Qwen/Qwen2.5-0.5B-Instruct), --dataset D (default gsm8k), --objectives "A B ..."
# (default all twelve), --seeds "0 1 ..." (default 0), --steps N (on GSM8K default 100), --eval_n N, --out DIR, --demo,
# --smoke, --report, -h/--help; everything after -- goes to every dppo.py run.
#
# --demo runs `python dppo.py` as it is with no --model (the tiny model on all the arithmetic problems, the
# demo's defaults), so a study on a laptop CPU is the demo plus the flags given after --.
# Each run goes to <out>/<objective>-seed<seed>/ (metrics.jsonl and the trained model); the table to
# <out>/results.md and the curves to <out>/curves.png (with matplotlib installed). --out defaults to
# runs/gsm8k (runs/demo with --demo, runs/gsm8k-smoke with --smoke). On GSM8K the held-out set is the first
# --eval_n problems of the test split (default 1,319: all of it).
set -euo pipefail
here=$(dirname "$0")
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }  # the comment above
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"  # so the inline Python below can import dppo

model=Qwen/Qwen2.5-0.5B-Instruct
dataset=gsm8k
objectives="pg ppo_clip dcpo erc cispo gspo binary_tv binary_kl topk_tv topk_kl drpo cppo"
seeds=0
steps=
eval_n=
out=
mode=gsm8k
report_only=0
model_given=0
keep_models=()
declare -A variants=()  # name -> its dppo.py flags, e.g. relax_low -> "--objective ppo_clip --relax_clip low"
while (($#)); do
  case "$1" in
    --model) model=$2; model_given=1; shift 2 ;;
    --dataset) dataset=$2; shift 2 ;;
    --objectives) objectives=$2; shift 2 ;;
    --seeds) seeds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --eval_n) eval_n=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --variant) variants[$2]=$3; shift 3 ;;
    --keep_models) keep_models=(--keep_models); shift ;;
    --smoke) mode=smoke; shift ;;
    --demo) mode=demo; shift ;;
    --report) report_only=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "run_gsm8k.sh: unknown argument $1 (see bash run_gsm8k.sh --help)" >&2; exit 2 ;;
  esac
done
extra=("$@")

case $mode in
  gsm8k)
    out=${out:-runs/gsm8k}
    steps=${steps:-100}
    run=(--model "$model" --dataset "$dataset" --eval_n "${eval_n:-1319}" --steps "$steps" --eval_every "$steps") ;;
  demo)
    out=${out:-runs/demo}
    run=()
    if ((model_given)); then run+=(--model "$model" --dataset arithmetic); fi
    if [[ -n $steps ]]; then run+=(--steps "$steps"); fi
    if [[ -n $eval_n ]]; then run+=(--eval_n "$eval_n"); fi ;;
  smoke)
    # The GSM8K path end to end with local stand-ins: the built-in tiny model (or --model, e.g. a tiny model
    # at Qwen's vocabulary) and GSM8K-format train/test files written from dppo.py's arithmetic problems.
    out=${out:-runs/gsm8k-smoke}
    dataset=$out/data
    if ((!report_only)); then
      mkdir -p "$dataset"
      python - "$dataset" <<'EOF'
import json, sys
import dppo
problems = dppo.arithmetic_problems()
for split, rows in (("train", problems["train"][:200]), ("test", problems["test"])):
    with open(f"{sys.argv[1]}/{split}.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
EOF
      if ((!model_given)); then
        model=$(python -c "import contextlib, sys, dppo
with contextlib.redirect_stdout(sys.stderr):  # build progress to the terminal, only the path to \$model
    path = dppo.build_tiny_model(dppo.Config.cache_dir)
print(path)")
      fi
    fi
    run=(--model "$model" --dataset "$dataset" --steps 3 --eval_n 50 --eval_every 3 --prompts_per_step 8
         --samples_per_prompt 4 --max_new_tokens 16 --updates_per_step 2 --micro_batch_size 32 --learning_rate 1e-4
         --eval_batch_size 50) ;;
esac

if ((!report_only)); then
  for seed in $seeds; do
    for name in $objectives; do
      record=$out/$name-seed$seed
      if python "$here/figures/study.py" finished "$record"; then
        echo "== $name, seed $seed: finished before, skipped"
        continue
      fi
      echo "== $name, seed $seed"
      read -ra objective <<< "${variants[$name]:---objective $name}"
      flags=("${run[@]}" "${objective[@]}" --seed "$seed" "${extra[@]}")
      rm -rf "$record"  # an unfinished run starts again from step 0
      python "$here/figures/study.py" start "$record" -- "${flags[@]}"
      python "$here/dppo.py" "${flags[@]}" --output_dir "$record"
      python "$here/figures/study.py" finish "$record" "${keep_models[@]}"
    done
  done
fi

python - "$out" "$*" "$seeds" $objectives <<'EOF' | tee "$out/results.md"
"""The study's table (results.md, mean ± std over seeds) and curves (curves.png), from each run's metrics.jsonl."""
import json, statistics, sys
from pathlib import Path

out, flags, seeds, objectives = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(), sys.argv[4:]
END = 5  # "at the end" = the mean over the last END steps


def run_summary(records):
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    steps = [r for r in records if "reward/mean" in r]
    end = steps[-END:]
    tokens = [r["completion/length_mean"] for r in steps]  # every step has P x G completions: weights by token count
    blocked = sum(r["trust_region/blocked_frac"] * n for r, n in zip(steps, tokens))

    def share_of_blocked(key):  # e.g. of all blocked tokens, the share with mu(a_t) < 0.15
        if blocked == 0 or key not in steps[0]:
            return None
        return sum(r[key] * n for r, n in zip(steps, tokens)) / blocked

    return {"before": evals[0], "final": evals[-1], "lowest": min(evals),
            "truncated": statistics.mean(r["completion/truncated"] for r in end),
            "drift": statistics.mean(r["policy/abs_pi_minus_mu_mean"] for r in end),
            "drift_max": max(r["policy/abs_pi_minus_mu_max"] for r in steps),
            "mismatch": statistics.mean(r["policy/mismatch_first_update_mean"] for r in steps),
            "blocked": statistics.mean(r["trust_region/blocked_frac"] for r in steps),
            "rare_blocked": share_of_blocked("trust_region/blocked_rare_frac"),
            "rare_all": statistics.mean(r["policy/rare_token_frac"] for r in steps),
            "tv_too": share_of_blocked("trust_region/blocked_also_by_tv_frac"),
            "seconds": [r for r in records if "time/elapsed_s" in r][-1]["time/elapsed_s"]}


def cell(runs, key, scale=1.0, fmt=".1f"):
    values = [run[key] * scale for run in runs if run[key] is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    return f"{statistics.mean(values):{fmt}} ± {statistics.stdev(values):{fmt}}"


records = {(objective, seed): [json.loads(line) for line in (out / f"{objective}-seed{seed}" / "metrics.jsonl").open()]
           for objective in objectives for seed in seeds}
print(f"{len(seeds)} seed(s) ({', '.join(seeds)}) per objective; extra flags: `{flags or 'none'}`. Accuracy is "
      f"greedy, on the held-out set, in %; mean ± std over seeds. \"End\" = the mean over the last {END} steps.\n")
print("| objective | accuracy before | final | lowest | truncated at the end (%) | \\|π−μ\\| at the end | "
      "\\|π−μ\\| max | \\|π−μ\\| at update 1 | tokens blocked (%) | of them μ(a_t) < 0.15 (%) | "
      "all tokens μ(a_t) < 0.15 (%) | clipped that TV δ=0.15 blocks too (%) | seconds per run |")
print("|---" * 13 + "|")
for objective in objectives:
    runs = [run_summary(records[objective, seed]) for seed in seeds]
    print(f"| `{objective}` | {cell(runs, 'before', 100)} | {cell(runs, 'final', 100)} | {cell(runs, 'lowest', 100)} | "
          f"{cell(runs, 'truncated', 100)} | {cell(runs, 'drift', fmt='.4f')} | {cell(runs, 'drift_max', fmt='.3f')} | "
          f"{cell(runs, 'mismatch', fmt='.1e')} | {cell(runs, 'blocked', 100, '.2f')} | {cell(runs, 'rare_blocked', 100)} | "
          f"{cell(runs, 'rare_all', 100)} | {cell(runs, 'tv_too', 100)} | {cell(runs, 'seconds', fmt='.0f')} |")

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print(f"no {out}/curves.png: `pip install matplotlib` to draw the curves", file=sys.stderr)
    sys.exit(0)
panels = [("held-out accuracy", "eval/accuracy"), ("|π − μ| of sampled tokens, mean", "policy/abs_pi_minus_mu_mean"),
          ("completions truncated", "completion/truncated"), ("tokens blocked", "trust_region/blocked_frac")]
figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8))
for (title, key), ax in zip(panels, axes):
    for i, objective in enumerate(objectives):
        for j, seed in enumerate(seeds):
            points = [(r["step"], r[key]) for r in records[objective, seed] if key in r]
            ax.plot(*zip(*points), color=f"C{i % 10}", linestyle="-" if i < 10 else "--", alpha=0.8, linewidth=1.2,
                    label=objective if j == 0 else None)  # ten colours, then dashed
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
axes[0].legend(fontsize=8)
figure.tight_layout()
figure.savefig(out / "curves.png", dpi=110)
print(f"curves: {out}/curves.png", file=sys.stderr)
EOF
