#!/usr/bin/env bash
# GSM8K with each objective in turn, on one GPU: the same model, seed and budget for every objective,
# greedy accuracy on the GSM8K test split before and after training, and a markdown results table.
#
#   bash run_gsm8k.sh                                            # all eight objectives, Qwen2.5-0.5B-Instruct
#   bash run_gsm8k.sh --objectives "ppo_clip topk_tv" --steps 50 --model Qwen/Qwen2.5-1.5B-Instruct
#   bash run_gsm8k.sh --dataset path/to/gsm8k                    # a local copy (JSONL files or save_to_disk)
#   bash run_gsm8k.sh -- --learning_rate 2e-6                    # flags after -- go to every dppo.py run
#   bash run_gsm8k.sh --smoke                                    # the same pipeline offline on a CPU in about a minute
#
# Each objective's run goes to <out>/<objective>/ (metrics.jsonl and the trained model), the table to
# <out>/results.md; --out defaults to runs/gsm8k (runs/gsm8k-smoke with --smoke). The held-out set is
# the first --eval_n problems of the test split (default 1,319: all of it).
set -euo pipefail
here=$(dirname "$0")
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"  # so the inline Python below can import dppo

model=Qwen/Qwen2.5-0.5B-Instruct
dataset=gsm8k
objectives="pg ppo_clip dcpo erc binary_tv binary_kl topk_tv topk_kl"
steps=100
seed=0
eval_n=1319
out=
smoke=0
model_given=0
while (($#)); do
  case "$1" in
    --model) model=$2; model_given=1; shift 2 ;;
    --dataset) dataset=$2; shift 2 ;;
    --objectives) objectives=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --eval_n) eval_n=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --smoke) smoke=1; shift ;;
    --) shift; break ;;
    *) echo "run_gsm8k.sh: unknown argument $1 (see the top of this file)" >&2; exit 2 ;;
  esac
done
extra=("$@")

if ((smoke)); then
  # The same script end to end with local stand-ins: the built-in tiny model (or --model, e.g. a tiny
  # model at Qwen's vocabulary) and GSM8K-format train/test files written from dppo.py's arithmetic problems.
  out=${out:-runs/gsm8k-smoke}
  dataset=$out/data
  steps=3
  eval_n=50
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
  extra=(--prompts_per_step 8 --samples_per_prompt 4 --max_new_tokens 16 --updates_per_step 2 --micro_batch_size 32
         --learning_rate 1e-4 --eval_batch_size 50 "${extra[@]}")
fi

out=${out:-runs/gsm8k}
for objective in $objectives; do
  echo "== $objective"
  python "$here/dppo.py" --model "$model" --dataset "$dataset" --objective "$objective" --seed "$seed" --steps "$steps" \
    --eval_n "$eval_n" --eval_every "$steps" --output_dir "$out/$objective" "${extra[@]}"
done

python - "$out" "$model" "$dataset" "$steps" "$seed" $objectives <<'EOF' | tee "$out/results.md"
import json, sys
from pathlib import Path

out, model, dataset, steps, seed, objectives = Path(sys.argv[1]), *sys.argv[2:6], sys.argv[6:]
print(f"`{model}` on `{dataset}`: {steps} steps per objective, seed {seed}; greedy accuracy on the held-out set.\n")
print("| objective | accuracy before | accuracy after | change (points) | wall time | tokens blocked |")
print("|---|---|---|---|---|---|")
for objective in objectives:
    records = [json.loads(line) for line in (out / objective / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/accuracy" in r]
    blocked = [r["trust_region/blocked_frac"] for r in records if "trust_region/blocked_frac" in r]
    before, after = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    print(f"| `{objective}` | {before:.1%} | {after:.1%} | {100 * (after - before):+.1f} | "
          f"{evals[-1]['time/elapsed_s']:.0f} s | {sum(blocked) / len(blocked):.2%} |")
EOF
