#!/usr/bin/env bash
# Compare objectives: each objective x seed trains from the same model with the same budget, and the study
# ends in markdown tables (each evaluation's accuracy, mean ± std over seeds and each seed's) and a figure (mean
# curves, min–max band over seeds), drawn by figures/study.py. The same command started again continues a study:
# a finished run is skipped, an unfinished one resumes from its last checkpoint (--save_every, default 10 steps; one
# with no checkpoint yet starts over, saying so), and a record whose flags (model included) or commit differ from the
# run asked for is refused in one line naming the flag and the record's directory: never skipped, never overwritten.
# A run that stops on a non-finite loss is finished as a record marked with its step; the study goes on.
#
#   bash run_gsm8k.sh                                            # GSM8K, all thirteen objectives, Qwen2.5-0.5B-Instruct, one GPU
#   bash run_gsm8k.sh --objectives "ppo_clip topk_tv" --steps 50 --model Qwen/Qwen2.5-1.5B-Instruct
#   bash run_gsm8k.sh --models "Qwen/Qwen2.5-0.5B-Instruct Qwen/Qwen2.5-1.5B-Instruct" --seeds "0 1 2"  # a study each
#   bash run_gsm8k.sh --dataset path/to/gsm8k                    # a local copy (JSONL files or save_to_disk)
#   bash run_gsm8k.sh --seeds "0 1 2" -- --learning_rate 2e-6    # flags after -- go to every dppo.py run
#   bash run_gsm8k.sh --demo --seeds "0 1 2" -- --updates_per_step 16   # offline: the built-in demo model and data
#   bash run_gsm8k.sh --objectives "ppo_clip relax" --variant relax "--objective ppo_clip --relax_clip low" \
#        --pair "relax ppo_clip"                                 # a variant with a name of its own, paired by seed
#   bash run_gsm8k.sh --smoke                                    # the GSM8K pipeline offline on a CPU, 3 steps an objective
#   bash run_gsm8k.sh --report --out runs/gsm8k                  # only (re)write the tables and figure of finished runs
#   bash run_gsm8k.sh --help                                     # this text
#
# Options: --model M (default Qwen/Qwen2.5-0.5B-Instruct), --models "M1 M2 ..." (a study per model, each under
# <out>/<model's last name>/), --dataset D (default gsm8k), --objectives "A B ..." (default all thirteen), --seeds "0 1 ..."
# (default 0), --steps N (on GSM8K default 100), --eval_every N (on GSM8K default steps/5: 6 evaluations), --eval_n N,
# --save_every N (default 10: a checkpoint every N steps, for resuming), --out DIR,
# --variant NAME "FLAGS" (a name in --objectives that runs dppo.py with FLAGS; repeatable), --pair "A B" (the report's
# A − B per seed; repeatable), --keep_models, --demo, --smoke, --report, -h/--help; everything after -- goes to every
# dppo.py run.
#
# --demo runs `python dppo.py` as it is with no --model (the tiny model on all the arithmetic problems, the
# demo's defaults), so a study on a laptop CPU is the demo plus the flags given after --.
# Each run's record goes to <out>/<name>-seed<seed>/: provenance.json (commit, CPU model, flags, versions; finished
# or not) and metrics.jsonl; the trained model is deleted unless --keep_models. The tables go to <out>/results.md, the
# figure to <out>/curves.png (with matplotlib installed); the report names the runs missing or unfinished and refuses
# records from two CPU models or commits. --out defaults to runs/gsm8k (runs/demo with --demo, runs/gsm8k-smoke with
# --smoke). On GSM8K the held-out set is the first --eval_n problems of the test split (default 1,319: all of it).
set -euo pipefail
here=$(dirname "$0")
original=("$@")
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }  # the comment above
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"  # so the inline Python below can import dppo

model=Qwen/Qwen2.5-0.5B-Instruct
dataset=gsm8k
objectives="pg ppo_clip dcpo erc cispo gspo binary_tv binary_kl topk_tv topk_kl drpo cppo ipo"
seeds=0
steps=
eval_n=
out=
mode=gsm8k
report_only=0
model_given=0
models=
eval_every=
save_every=10
keep_models=()
pairs=()
declare -A variants=()  # name -> its dppo.py flags, e.g. relax_low -> "--objective ppo_clip --relax_clip low"
while (($#)); do
  case "$1" in
    --model) model=$2; model_given=1; shift 2 ;;
    --models) models=$2; shift 2 ;;
    --eval_every) eval_every=$2; shift 2 ;;
    --save_every) save_every=$2; shift 2 ;;
    --dataset) dataset=$2; shift 2 ;;
    --objectives) objectives=$2; shift 2 ;;
    --seeds) seeds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --eval_n) eval_n=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --variant) variants[$2]=$3; shift 3 ;;
    --keep_models) keep_models=(--keep_models); shift ;;
    --pair) pairs+=("$2"); shift 2 ;;
    --smoke) mode=smoke; shift ;;
    --demo) mode=demo; shift ;;
    --report) report_only=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "run_gsm8k.sh: unknown argument $1 (see bash run_gsm8k.sh --help)" >&2; exit 2 ;;
  esac
done
extra=("$@")

if [[ -n $models ]]; then  # a study per model, each under <out>/<its last name>/: this command, with one model
  options=()
  for ((i = 0; i < ${#original[@]} - ${#extra[@]}; i++)); do
    case ${original[i]} in
      --models|--out) ((i++)) ;;
      --) ;;
      *) options+=("${original[i]}") ;;
    esac
  done
  [[ $mode == demo ]] && base=runs/demo || base=runs/gsm8k
  for model in $models; do
    bash "$0" "${options[@]}" --model "$model" --out "${out:-$base}/${model##*/}" -- "${extra[@]}"
  done
  exit
fi

case $mode in
  gsm8k)
    out=${out:-runs/gsm8k}
    steps=${steps:-100}
    run=(--model "$model" --dataset "$dataset" --eval_n "${eval_n:-1319}" --steps "$steps")
    run+=(--eval_every "${eval_every:-$((steps >= 5 ? steps / 5 : 1))}") ;;
  demo)
    out=${out:-runs/demo}
    run=()
    if ((model_given)); then run+=(--model "$model" --dataset arithmetic); fi
    if [[ -n $steps ]]; then run+=(--steps "$steps"); fi
    if [[ -n $eval_n ]]; then run+=(--eval_n "$eval_n"); fi
    if [[ -n $eval_every ]]; then run+=(--eval_every "$eval_every"); fi ;;
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
      read -ra objective <<< "${variants[$name]:---objective $name}"
      flags=("${run[@]}" "${objective[@]}" --seed "$seed" --save_every "$save_every" "${extra[@]}")
      state=$(python "$here/figures/study.py" state "$record" -- "${flags[@]}")  # exit 2: the record differs
      case $state in
        finished) echo "== $name, seed $seed: finished before, skipped"; continue ;;
        resume) echo "== $name, seed $seed: resumed from its last checkpoint"; resume=(--resume "$record") ;;
        new) echo "== $name, seed $seed$([[ -e $record ]] && echo ': unfinished, no checkpoint: started over')"
             resume=()  # study.py start clears an unfinished record, and the new one says it started over
             python "$here/figures/study.py" start "$record" -- "${flags[@]}" ;;
      esac
      if python "$here/dppo.py" "${flags[@]}" --output_dir "$record" "${resume[@]}"; then
        python "$here/figures/study.py" finish "$record" "${keep_models[@]}"
      else  # a run stopped by a non-finite loss is a record too, marked so; any other failure ends the study here
        python "$here/figures/study.py" finish "$record" --stopped "${keep_models[@]}"
      fi
    done
  done
fi

pair_flags=()
for pair in "${pairs[@]}"; do pair_flags+=(--pair "$pair"); done
python "$here/figures/study.py" report "$out" --names "$objectives" --seeds "$seeds" "${pair_flags[@]}"
