"""A seeded study's records, its table and its figure; run_gsm8k.sh calls it around every dppo.py run.

    python figures/study.py start RUN_DIR -- DPPO_FLAGS...   # provenance.json: commit, CPU model, flags, versions
    python figures/study.py finish RUN_DIR                   # marks the run finished; deletes its model's files
    python figures/study.py report DIR --names "binary_tv ppo_clip" --seeds "0 1 2" [--pair "binary_tv ppo_clip"]

A run's record is RUN_DIR = DIR/<name>-seed<seed>/ with provenance.json and dppo.py's metrics.jsonl; a record is
finished once provenance.json says so. The report (DIR/results.md and DIR/curves.png) gives per name the mean ± std
over seeds at every evaluation step and each seed's numbers, the paired difference per seed between two names, and
the mean curves with a min–max band. It names the runs missing or unfinished, and refuses records from more than one
CPU model or commit.
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

KEPT = {"provenance.json", "metrics.jsonl"}  # what a finished record holds: no model


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    here = Path(__file__).resolve().parent
    git = ["git", "-C", str(here)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return head + ("-dirty" if changed.stdout.strip() else "")


def start(run_dir: Path, flags: list[str]):
    import torch
    import transformers

    run_dir.mkdir(parents=True, exist_ok=True)
    provenance = {
        "commit": commit(),
        "cpu": cpu_model(),
        "flags": flags,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "finished": None,
    }
    (run_dir / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")


def finish(run_dir: Path, keep_models: bool):
    for path in run_dir.iterdir():  # the trained model: the study keeps its numbers, not its weights
        if path.name not in KEPT and not keep_models:
            subprocess.run(["rm", "-rf", str(path)], check=True)
    provenance = json.loads((run_dir / "provenance.json").read_text())
    provenance["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (run_dir / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")


def is_finished(run_dir: Path) -> bool:
    path = run_dir / "provenance.json"
    return path.exists() and json.loads(path.read_text())["finished"] is not None


if __name__ == "__main__":
    command, run_dir, *rest = sys.argv[1:]
    if command == "start":
        start(Path(run_dir), rest[1:] if rest[:1] == ["--"] else rest)
    elif command == "finish":
        finish(Path(run_dir), keep_models=rest == ["--keep_models"])
    elif command == "finished":
        sys.exit(0 if is_finished(Path(run_dir)) else 1)
