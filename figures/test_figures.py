"""Tests of the study tools (run_gsm8k.sh, figures/study.py) and the figures (tables redrawn from the committed records,
the drawn trust regions against the papers' closed forms); dppo.py's are in ../test_dppo.py, whose helpers these share.
Run: HF_HUB_OFFLINE=1 python -m pytest -q figures (the slow tier: -m slow; both: -m "slow or not slow")."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never wait on the Hub

import functools
import hashlib
import importlib.util
import itertools
import json
import math
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # dppo.py, rewards.py and test_dppo.py
import dppo  # noqa: E402
from test_dppo import HERE, SMALL_DEMO, comparable, missing_test_asset, records, slow, step_records_so_far  # noqa: E402
from test_dppo import demo_cache, tiny_checkpoint, tiny_policy  # noqa: E402, F401  (fixtures its tests take)


# ---------------------------------------------------------------------------- run_gsm8k.sh


@slow
def test_run_gsm8k_smoke_mode_end_to_end(demo_cache, tmp_path):
    # As a user runs it: no --model, so the built-in model from ~/.cache/dppo, here the session's one.
    (tmp_path / "home" / ".cache").mkdir(parents=True)
    (tmp_path / "home" / ".cache" / "dppo").symlink_to(demo_cache)
    objectives = ["dcpo", "topk_tv"]  # two of the eight: the pipeline is the same for each
    smoke = ["bash", str(HERE / "run_gsm8k.sh"), "--smoke", "--out", tmp_path, "--objectives", " ".join(objectives)]
    result = subprocess.run(smoke, capture_output=True, text=True, env={**os.environ, "HOME": str(tmp_path / "home")})
    assert result.returncode == 0, result.stderr[-2000:]
    rows = table_rows(tmp_path / "results.md", "Per run")
    assert list(rows) == objectives
    for objective, row in rows.items():
        evals = [r for r in records(tmp_path / f"{objective}-seed0") if "eval/accuracy" in r]
        assert [r["step"] for r in evals] == [0, 3]  # before and after training only
        assert row[:2] == [f"{100 * evals[i]['eval/accuracy']:.1f}" for i in (0, -1)]
    if importlib.util.find_spec("matplotlib") is not None:  # an optional extra: without it, the table alone
        assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def write_metrics(path: Path, accuracies, blocked, blocked_rare, lengths, also_by_tv=None):
    """A hand-made metrics.jsonl: evaluations every 2 steps, and a step record per entry of `blocked`."""
    path.mkdir(parents=True)
    records = []
    for step, (b, rare, n) in enumerate(zip(blocked, blocked_rare, lengths), start=1):
        record = {"step": step, "reward/mean": 0.5, "completion/length_mean": n, "completion/truncated": 0.1 * step}
        record |= {"policy/abs_pi_minus_mu_mean": 0.01 * step, "policy/abs_pi_minus_mu_max": 0.1 * step}
        record |= {"policy/mismatch_first_update_mean": 0.001, "policy/rare_token_frac": 0.2}
        record |= {"trust_region/blocked_frac": b, "trust_region/blocked_rare_frac": rare}
        if also_by_tv is not None:
            record["trust_region/blocked_also_by_tv_frac"] = also_by_tv
        records.append(record)
    records += [{"step": 2 * i, "eval/accuracy": a, "time/elapsed_s": 60.0 * i} for i, a in enumerate(accuracies)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["step"])))
    provenance = {"commit": "0" * 40, "cpu": "a CPU", "flags": [], "finished": "2026-01-01 00:00:00"}
    (path / "provenance.json").write_text(json.dumps(provenance))


def table_rows(results: Path, title: str) -> dict[str, list[str]]:
    """The rows of results.md's table under the line that starts with title: {name: its cells}."""
    lines = results.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    table = itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2 :])
    return {row.split("`")[1]: row.strip("| ").split(" | ")[1:] for row in table if row.startswith("| `")}


def study_report(out: Path) -> list:
    """Hand-made runs of pg (1 seed, linked as seed 1) and ppo_clip (2 seeds), and the command that reports on them."""
    write_metrics(out / "pg-seed0", [0.3, 0.1, 0.2], blocked=[0, 0], blocked_rare=[0, 0], lengths=[10, 20])
    for seed, final in ((0, 0.5), (1, 0.7)):
        runs = dict(blocked=[0.1, 0.3], blocked_rare=[0.05, 0.3], lengths=[10, 20], also_by_tv=0.05)
        write_metrics(out / f"ppo_clip-seed{seed}", [0.3, 0.4, final], **runs)
    (out / "pg-seed1").symlink_to(out / "pg-seed0")
    report = f"bash {HERE / 'run_gsm8k.sh'} --report --demo --out {out}".split()
    return [*report, "--objectives", "pg ppo_clip", "--seeds", "0 1"]


def test_a_study_report_has_mean_and_std_over_seeds_with_or_without_matplotlib(tmp_path):
    """The table needs no matplotlib: here it cannot be imported (a stand-in that raises ImportError comes first on
    the path), and the report says in one line how to get the curves."""
    (tmp_path / "no-matplotlib" / "matplotlib").mkdir(parents=True)
    (tmp_path / "no-matplotlib" / "matplotlib" / "__init__.py").write_text("raise ImportError('not installed')\n")
    hidden = {**os.environ, "PYTHONPATH": str(tmp_path / "no-matplotlib")}
    result = subprocess.run(study_report(tmp_path / "study"), capture_output=True, text=True, timeout=120, env=hidden)
    assert result.returncode == 0 and result.stderr.count("\n") == 1, result.stderr
    assert "pip install matplotlib" in result.stderr
    assert not (tmp_path / "study" / "curves.png").exists()
    rows = table_rows(tmp_path / "study" / "results.md", "Per run")
    # before, final, lowest, truncated at the end, |pi-mu| at the end, its max, at update 1, blocked, rare among
    # the blocked (weighted by tokens: (0.05*10 + 0.3*20) / (0.1*10 + 0.3*20)), rare among all, TV overlap, seconds
    pg = "30.0 ± 0.0 | 20.0 ± 0.0 | 10.0 ± 0.0 | 15.0 ± 0.0 | 0.0150 ± 0.0000 | 0.200 ± 0.000 | 1.0e-03 ± 0.0e+00"
    assert rows["pg"] == f"{pg} | 0.00 ± 0.00 | – | 20.0 ± 0.0 | – | 120 ± 0".split(" | ")
    assert rows["ppo_clip"][:3] == ["30.0 ± 0.0", "60.0 ± 14.1", "30.0 ± 0.0"]
    assert rows["ppo_clip"][7:11] == ["20.00 ± 0.00", "92.9 ± 0.0", "20.0 ± 0.0", "21.4 ± 0.0"]  # (0.5 + 1) / 7


@slow
def test_a_study_report_draws_the_curves_with_matplotlib(tmp_path):
    if importlib.util.find_spec("matplotlib") is None:
        missing_test_asset("matplotlib is not installed (pip install matplotlib): the curves cannot be tested")
    result = subprocess.run(study_report(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert list(table_rows(tmp_path / "results.md", "Greedy held-out accuracy")) == ["pg", "ppo_clip"]


def readme_study() -> tuple[list[str], list[str]]:
    """The seeded SmolLM2 study's command, `bash run_gsm8k.sh --demo --model $GGUF … --variant … -- FLAGS`, from its
    README: the script's options, and the flags after -- for every dppo.py run."""
    readme = (HERE / "figures" / "smollm2_seeds" / "README.md").read_text(encoding="utf-8")  # its study's README
    line = re.search(r"^bash run_gsm8k\.sh (--demo --model \$GGUF .*--variant .*)$", readme, re.M).group(1)
    options, flags = line.split(" -- ")
    return shlex.split(options), flags.split()


def with_option(options: list[str], name: str, value=None) -> list[str]:
    """options without name's value, and with value instead if given."""
    i = options.index(name)
    return options[:i] + options[i + 2 :] + ([name, value] if value is not None else [])


@slow
def test_the_readme_study_runs_in_pieces_on_the_demo_model(demo_cache, tmp_path):
    """The README's seeded study for 2 steps on the demo model, seed 0: each record holds its provenance and no
    model; the same command again skips every finished run; the report over a partial set names the runs missing
    or unfinished, and refuses records from two CPU models."""
    options, flags = readme_study()
    names = options[options.index("--objectives") + 1].split()
    out = tmp_path / "study"
    options = with_option(with_option(with_option(options, "--model"), "--seeds", "0"), "--out", str(out))
    flags += f"--steps 2 --eval_every 2 --eval_n 8 --eval_batch_size 8 --cache_dir {demo_cache}".split()
    study = ["bash", str(HERE / "run_gsm8k.sh"), *options, "--", *flags]
    first = subprocess.run(study, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    variant, variant_flags = options[options.index("--variant") + 1 : options.index("--variant") + 3]
    for name in names:
        provenance = json.loads((out / f"{name}-seed0" / "provenance.json").read_text())
        assert provenance["finished"] and re.fullmatch(r"[0-9a-f]{40}(-dirty)?", provenance["commit"])
        assert provenance["cpu"] and provenance["torch"] == torch.__version__
        assert provenance["flags"][-len(flags) :] == flags
        assert (variant_flags if name == variant else f"--objective {name}") in " ".join(provenance["flags"])
        assert sorted(path.name for path in (out / f"{name}-seed0").iterdir()) == ["metrics.jsonl", "provenance.json"]
    metrics = {name: (out / f"{name}-seed0" / "metrics.jsonl").read_bytes() for name in names}
    again = subprocess.run(study, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout.count("finished before, skipped") == len(names), again.stderr
    assert metrics == {name: (out / f"{name}-seed0" / "metrics.jsonl").read_bytes() for name in names}
    shutil.copytree(out / f"{names[0]}-seed0", out / f"{names[0]}-seed1")  # a run stopped part way
    unfinished = json.loads((out / f"{names[0]}-seed1" / "provenance.json").read_text()) | {"finished": None}
    (out / f"{names[0]}-seed1" / "provenance.json").write_text(json.dumps(unfinished))
    report = ["python", str(HERE / "figures" / "study.py"), "report", str(out), "--names", " ".join(names)]
    partial = subprocess.run([*report, "--seeds", "0 1"], capture_output=True, text=True, timeout=120)
    assert partial.returncode == 0, partial.stderr
    assert f"{names[0]} seed 1 (unfinished); {names[1]} seed 1 (missing)" in partial.stdout
    assert table_rows(out / "results.md", "Greedy held-out accuracy")[names[0]][0] == "0"  # seed 1 is left out
    elsewhere = json.loads((out / f"{names[1]}-seed0" / "provenance.json").read_text()) | {"cpu": "another CPU"}
    (out / f"{names[1]}-seed0" / "provenance.json").write_text(json.dumps(elsewhere))
    mixed = subprocess.run([*report, "--seeds", "0"], capture_output=True, text=True, timeout=120)
    assert mixed.returncode == 1 and "the records come from 2 cpus" in mixed.stderr


@slow
def test_a_record_names_its_model_file_by_name_and_hash_so_a_study_resumes_from_another_checkout(tmp_path):
    """A GGUF file given to --model is recorded by name and sha256, not by the path of the machine that ran it: the
    same file elsewhere (another virtual environment) continues the study; another file of that name is refused; an
    older record, which holds the path, is read by the file's name."""
    study = [sys.executable, str(HERE / "figures" / "study.py")]
    here, there = tmp_path / "venv-a" / "model.gguf", tmp_path / "venv-b" / "model.gguf"
    for path, content in ((here, b"weights"), (there, b"weights")):
        path.parent.mkdir()
        path.write_bytes(content)
    run = tmp_path / "study" / "pg-seed0"

    def call(command, model, *more):
        flags = ["--model", str(model), "--objective", "pg", *more]
        return subprocess.run([*study, command, str(run), "--", *flags], capture_output=True, text=True, timeout=120)

    assert call("start", here).returncode == 0
    provenance = json.loads((run / "provenance.json").read_text())
    assert provenance["flags"][:2] == ["--model", "model.gguf"] and str(tmp_path) not in json.dumps(provenance)
    assert provenance["model_file"] == {"name": "model.gguf", "sha256": hashlib.sha256(b"weights").hexdigest()}
    assert call("state", there).stdout.strip() == "new"  # started, no checkpoint yet: not refused
    assert "--seed" in call("state", there, "--seed", "1").stderr  # any other flag still counts
    there.write_bytes(b"other weights")
    refused = call("state", there)
    assert refused.returncode == 2 and "not of this model.gguf" in refused.stderr
    older = provenance | {"flags": ["--model", str(here), "--objective", "pg"]}
    del older["model_file"]
    (run / "provenance.json").write_text(json.dumps(older))
    assert call("state", there).stdout.strip() == "new"  # an older record: by the file's name


def test_the_compare_table_has_a_column_per_record_directory_and_pools_none(tmp_path):
    """study.py compare: a column per directory (each holding one kind of machine), per name the mean ± std at the
    step asked and each seed's value; a name a directory lacks is "not run"."""
    for seed, accuracy in ((0, 0.5), (1, 0.7)):
        write_metrics(
            tmp_path / "a" / f"pg-seed{seed}",
            [0.3, 0.4, accuracy],
            blocked=[0, 0],
            blocked_rare=[0, 0],
            lengths=[10, 20],
        )
    write_metrics(tmp_path / "b" / "pg-seed0", [0.3, 0.2, 0.1], blocked=[0, 0], blocked_rare=[0, 0], lengths=[10, 20])
    write_metrics(
        tmp_path / "b" / "ppo_clip-seed1", [0.3, 0.2, 0.9], blocked=[0, 0], blocked_rare=[0, 0], lengths=[10, 20]
    )
    command = [
        sys.executable,
        str(HERE / "figures" / "study.py"),
        "compare",
        "--names",
        "pg ppo_clip",
        "--seeds",
        "0 1",
    ]
    command += ["--column", f"first={tmp_path / 'a'}", "--column", f"second={tmp_path / 'b'}"]
    result = subprocess.run([*command, "--step", "4"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = {
        line.split("`")[1]: line.strip("| ").split(" | ")[1:] for line in result.stdout.splitlines() if "| `" in line
    }
    assert rows["pg"] == ["60.0 ± 14.1 (50.0 / 70.0; seeds 0, 1)", "10.0 (10.0; seeds 0)"]
    assert rows["ppo_clip"] == ["not run", "90.0 (90.0; seeds 1)"]
    assert result.stdout.count("- first:") == result.stdout.count("- second:") == 1


def study_module():
    spec = importlib.util.spec_from_file_location("study", HERE / "figures" / "study.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    return study


def test_the_sustained_drop_break_rule_and_fishers_exact_test_by_hand():
    """The stale-data study's rule (figures/smollm2_stale/preregistration.md) on the records that motivated it: one
    dip that recovers breaks no run under it; a fall of 15 points from its own best does. Fisher's one-sided p: the
    break counts its readings name (5 of 5 against 1 of 5, 4 of 5 against 0 of 5) are below 0.05, 5 against 2 not."""
    study = study_module()
    dip = {0: 15.5, 5: 5.5, 10: 18.0, 15: 25.0, 20: 30.0}  # the stress study's topk_tv seed 0, in shape
    assert study.fell_at(dip, "first_drop") == [5] and study.fell_at(dip, "sustained_drop") == []
    rose_and_fell = {0: 15.5, 5: 45.5, 10: 26.0}  # its pilot's pg at U = 8, lr 3e-5: 19.5 below its best
    assert study.fell_at(rose_and_fell, "first_drop") == [] and study.fell_at(rose_and_fell, "sustained_drop") == [10]
    assert study.fell_at({0: 20, 5: 14, 10: 15, 15: 30, 20: 30}, "sustained_drop") == [5]  # two in a row: the first
    assert study.fell_at({0: 20, 5: 22, 10: 24, 15: 24, 20: 15}, "sustained_drop") == [20]  # the last, 5 below (9
    # below its best: the last clause alone breaks it)
    assert study.fell_at({0: 20, 5: 15.1, 10: 14, 15: 20, 20: 21}, "sustained_drop") == []  # 4.9 below, then 6
    assert study.fisher_one_sided(0, 5, 5, 5) == pytest.approx(1 / 252)
    assert study.fisher_one_sided(1, 5, 5, 5) == study.fisher_one_sided(0, 5, 4, 5) == pytest.approx(6 / 252)
    assert study.fisher_one_sided(2, 5, 5, 5) == pytest.approx(21 / 252)  # 0.083: not below 0.05
    assert study.fisher_one_sided(3, 5, 3, 5) == pytest.approx((20 * 6 + 15 * 4 + 6) / 252)  # equal counts: 0.74


def test_the_delay_sign_test_and_the_break_counts_across_directories_by_hand(tmp_path):
    """The reuse study's readings (figures/reuse_demo/preregistration.md): the sign test's p (9 of 10 and 5 of 5
    pass at 0.05, 8 of 10 and 4 of 4 do not); a mask that never broke counts as later, one that broke at the same
    step does not, a seed where neither broke is left out; the break counts of two directories and Fisher's p."""
    study = study_module()
    sign_test = study.sign_test_one_sided
    assert [sign_test(*k) for k in ((9, 10), (5, 5), (8, 10), (4, 4))] == [11 / 1024, 1 / 32, 56 / 1024, 1 / 16]
    curves = {"pg": [[30, 20, 20], [30, 20, 20], [30, 40, 40]], "binary_tv": [[30, 40, 40], [30, 20, 20], [30, 40, 40]]}
    for name, runs in curves.items():  # broke at step 2, 2, none; and none, 2, none
        for seed, accuracies in enumerate(runs):
            write_metrics(tmp_path / "E4" / f"{name}-seed{seed}", accuracies, [0.0], [0.0], [10])
            write_metrics(tmp_path / "E1" / f"{name}-seed{seed}", [30, 40, 40], [0.0], [0.0], [10])
    finished = study.load_records(tmp_path / "E4", ["pg", "binary_tv"], ["0", "1", "2"])[0]
    assert study.later_breaks(finished, "binary_tv", "pg", ["0", "1", "2"], "sustained_drop") == (1, 2)
    table = study.breaks(
        [("E 1", tmp_path / "E1"), ("E 4", tmp_path / "E4")], ["pg", "binary_tv"], ["0", "1", "2"], "sustained_drop"
    )
    assert "| `pg` | 0 of 3 | 2 of 3 | 0.200 |" in table and "| `binary_tv` | 0 of 3 | 1 of 3 | 0.500 |" in table


def test_the_two_sided_tests_and_the_discordant_seeds_by_hand(tmp_path):
    """The IPO study's readings (figures/ipo_reuse_demo/preregistration.md): Fisher's two-sided p on Fisher's own
    tea-tasting table (3 of 4 against 1 of 4: 0.486, and one-sided 0.243); the two-sided sign test (6 against 0
    passes at 0.05, 5 against 0 cannot); the discordant seeds of two arms, a seed where both broke left out."""
    study = study_module()
    assert study.fisher_two_sided(3, 4, 1, 4) == pytest.approx(34 / 70) and study.fisher_one_sided(
        1, 4, 3, 4
    ) == pytest.approx(17 / 70)
    assert study.fisher_two_sided(0, 5, 5, 5) == pytest.approx(2 / 252)  # the two extreme tables, 1/252 each
    assert study.fisher_two_sided(2, 5, 2, 5) == pytest.approx(1.0)
    assert [study.sign_test_two_sided(*k) for k in ((6, 6), (0, 6), (5, 5), (3, 6))] == [1 / 32, 1 / 32, 1 / 16, 1.0]
    curves = {
        "ipo": [[30, 20, 20], [30, 20, 20], [30, 40, 40]],
        "binary_tv": [[30, 40, 40], [30, 20, 20], [30, 20, 20]],
    }
    for name, runs in curves.items():  # ipo broke on seeds 0 and 1, binary_tv on 1 and 2
        for seed, accuracies in enumerate(runs):
            write_metrics(tmp_path / f"{name}-seed{seed}", accuracies, [0.0], [0.0], [10])
    finished = study.load_records(tmp_path, ["ipo", "binary_tv"], ["0", "1", "2"])[0]
    assert study.discordant_seeds(finished, "ipo", "binary_tv", ["0", "1", "2"], "sustained_drop") == (1, 1)
    text = study.report(
        tmp_path, ["ipo", "binary_tv"], ["0", "1", "2"], [("ipo", "binary_tv")], "sustained_drop", paired=True
    )
    expected = "- `ipo` broke and `binary_tv` held on 1 seeds, the reverse on 1: sign test p = 0.750 one-sided, "
    assert expected + "1.000 two-sided; Fisher two-sided p = 1.000" in text


def test_kinds_by_seed_allows_a_kind_per_seed_and_refuses_two_within_one(tmp_path):
    """A seed is a stratum (figures/smollm2_reuse_by_seed/preregistration.md): records of two CPU kinds in one table
    are refused, unless kinds_by_seed, which names each seed's kind; two kinds within one seed are refused even then."""
    study = study_module()
    for name in ("pg", "topk_tv"):
        for seed, kind in ((0, "family 25"), (1, "family 26")):
            write_metrics(tmp_path / f"{name}-seed{seed}", [30, 40], [0.0], [0.0], [10])
            provenance = json.loads((tmp_path / f"{name}-seed{seed}" / "provenance.json").read_text())
            provenance |= {"cpu_id": kind, "cpu_capability": "AVX512"}
            (tmp_path / f"{name}-seed{seed}" / "provenance.json").write_text(json.dumps(provenance))
    with pytest.raises(SystemExit, match="2 cpu_ids"):
        study.load_records(tmp_path, ["pg", "topk_tv"], ["0", "1"])
    text = study.report(tmp_path, ["pg", "topk_tv"], ["0", "1"], [], "sustained_drop", kinds_by_seed=True)
    assert "| 0 | a CPU, family 25, AVX512 |" in text and "| 1 | a CPU, family 26, AVX512 |" in text
    assert f"Records in `{tmp_path}`: 4 finished of 4 (seeds 0, 1); commit 0000000, CPU one CPU kind per seed" in text
    provenance = json.loads((tmp_path / "pg-seed1" / "provenance.json").read_text())
    (tmp_path / "pg-seed1" / "provenance.json").write_text(json.dumps(provenance | {"cpu_id": "family 25"}))
    with pytest.raises(SystemExit, match="seed 1's records come from 2 CPU kinds"):
        study.load_records(tmp_path, ["pg", "topk_tv"], ["0", "1"], kinds_by_seed=True)


def test_pool_reads_each_seed_from_one_directory_with_its_own_commit_and_kind(tmp_path, capsys):
    """The by-seed study's secondary reading pools stage 2's seeds with its own: two directories, two commits, two CPU
    kinds, a seed from each. pg breaks on both seeds (30 → 20 → 20), topk_tv on neither: 0 of 2 against 2 of 2 is
    Fisher's one-sided 1 / C(4, 2) = 0.167. --results puts the table elsewhere. Refused: --pool without
    --kinds_by_seed, a seed in both directories, two settings, two CPU kinds within a seed, two commits in one
    directory."""
    study = study_module()
    stage2, by_seed = tmp_path / "stage2", tmp_path / "by_seed"
    for directory, seed, commit, kind in ((stage2, 0, "a" * 40, "family 25"), (by_seed, 5, "b" * 40, "family 26")):
        for name, accuracies in (("pg", [30, 20, 20]), ("topk_tv", [30, 40, 40])):
            write_metrics(directory / f"{name}-seed{seed}", accuracies, [0.0], [0.0], [10])
            provenance = json.loads((directory / f"{name}-seed{seed}" / "provenance.json").read_text())
            provenance |= {"commit": commit, "cpu_id": kind, "cpu_capability": "AVX512"}
            (directory / f"{name}-seed{seed}" / "provenance.json").write_text(json.dumps(provenance))
    names, seeds, pairs = ["pg", "topk_tv"], ["0", "5"], [("topk_tv", "pg")]
    text = study.report(by_seed, names, seeds, pairs, "sustained_drop", kinds_by_seed=True, pool=[stage2])
    assert f"Records in `{by_seed}`, `{stage2}`: 4 finished of 4 (seeds 0, 5); a commit per directory, CPU one" in text
    assert f"| 0 | `{stage2}` | aaaaaaa | a CPU, family 25, AVX512 |" in text
    assert f"| 5 | `{by_seed}` | bbbbbbb | a CPU, family 26, AVX512 |" in text
    assert "- `topk_tv` 0 of 2, `pg` 2 of 2: p = 0.167" in text
    with pytest.raises(SystemExit, match="need kinds_by_seed"):
        study.load_records(by_seed, names, seeds, pool=[stage2])
    with pytest.raises(SystemExit) as refused:
        study.main([str(by_seed), "--names", "pg topk_tv", "--seeds", "0 5", "--pool", str(stage2)])
    assert refused.value.code == 2 and "give --kinds_by_seed too" in capsys.readouterr().err
    pooled = ["--names", "pg topk_tv", "--seeds", "0 5", "--pool", str(stage2), "--kinds_by_seed"]
    study.main([str(by_seed), *pooled, "--results", str(tmp_path / "pooled.md"), "--figure", str(tmp_path / "p.png")])
    assert "| 0 | `" in (tmp_path / "pooled.md").read_text() and not (by_seed / "results.md").exists()
    shutil.copytree(by_seed / "pg-seed5", stage2 / "pg-seed5")
    with pytest.raises(SystemExit, match="seed 5 has records in"):
        study.load_records(by_seed, names, seeds, kinds_by_seed=True, pool=[stage2])
    shutil.rmtree(stage2 / "pg-seed5")
    provenance = json.loads((stage2 / "topk_tv-seed0" / "provenance.json").read_text())
    (stage2 / "topk_tv-seed0" / "provenance.json").write_text(json.dumps(provenance | {"flags": ["--lr", "1e-5"]}))
    with pytest.raises(SystemExit, match="ran 2 settings"):
        study.load_records(by_seed, names, seeds, kinds_by_seed=True, pool=[stage2])
    (stage2 / "topk_tv-seed0" / "provenance.json").write_text(json.dumps(provenance))
    provenance = json.loads((stage2 / "pg-seed0" / "provenance.json").read_text())
    (stage2 / "pg-seed0" / "provenance.json").write_text(json.dumps(provenance | {"cpu_id": "family 26"}))
    with pytest.raises(SystemExit, match="seed 0's records come from 2 CPU kinds"):
        study.load_records(by_seed, names, seeds, kinds_by_seed=True, pool=[stage2])
    shutil.copytree(stage2 / "topk_tv-seed0", stage2 / "topk_tv-seed1")  # a second seed, of stage 2's commit
    (stage2 / "pg-seed0" / "provenance.json").write_text(json.dumps(provenance | {"commit": "c" * 40}))
    with pytest.raises(SystemExit, match="holds records of 2 commits"):  # one commit a seed, two in the directory
        study.load_records(by_seed, names, ["0", "1", "5"], kinds_by_seed=True, pool=[stage2])


def test_the_t_table_is_students_t_at_97_5_percent_for_each_degree_of_freedom():
    """Each entry of T_975, integrated under Student's t density (Simpson's rule, from 0), gives 0.975 to within its
    rounding to 3 decimals; a pooled reading of 15 seeds reads the entry of 14 degrees of freedom."""
    study = study_module()
    for df, t in enumerate(study.T_975, start=1):
        log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
        density = [math.exp(log_c - (df + 1) / 2 * math.log1p((t * i / 20000) ** 2 / df)) for i in range(20001)]
        half = t / 20000 / 3 * (density[0] + density[-1] + 4 * sum(density[1:-1:2]) + 2 * sum(density[2:-1:2]))
        assert 0.5 + half == pytest.approx(0.975, abs=density[-1] * 0.0005 + 1e-6), df


def test_a_gap_on_fifteen_seeds_reads_its_t_interval():
    """15 seeds, each +5 or +6 (eight +5s): mean 5.467, std 0.516, so the interval is 5.467 ± 2.145 · 0.516 / √15 =
    [+5.2, +5.8], which excludes 0: a gap. With no t value the verdict would have read "not a gap"."""
    study = study_module()
    gaps = [5.0] * 8 + [6.0] * 7
    assert study.t_interval(gaps) == "[+5.2, +5.8]"
    assert study.paired_verdict(gaps, 15, "sign_and_interval") == "a gap: one sign in every seed, interval excludes 0"
    with pytest.raises(SystemExit, match="no t value for 31 seeds"):
        study.t_bounds([5.0] * 16 + [6.0] * 15)


def test_a_report_wires_each_pair_to_its_interval_break_counts_and_sign_test_by_hand(tmp_path):
    """report() on hand-made runs, 3 seeds: pg falls 10 points and stays (broken at step 2 on every seed); binary_tv
    ends 10, 20, 30 points above it. t(0.975, 2 df) = 4.303: step 2's +10, +15, +20 is 15 ± 5, 15 ∓ 4.303 · 5 / √3 =
    [+2.6, +27.4], a gap; step 4's +10, +20, +30 is [−4.8, +44.8], not one. Fisher: 0 of 3 against 3 of 3 is 1 / C(6, 3)
    = 0.050; binary_tv later on 3 of 3: the sign test's 1/8."""
    study = study_module()
    for seed, (middle, last) in enumerate(((0.3, 0.3), (0.35, 0.4), (0.4, 0.5))):
        write_metrics(tmp_path / f"binary_tv-seed{seed}", [0.3, middle, last], [0.0], [0.0], [10])
        write_metrics(tmp_path / f"pg-seed{seed}", [0.3, 0.2, 0.2], [0.0], [0.0], [10])
    text = study.report(
        tmp_path,
        ["pg", "binary_tv"],
        ["0", "1", "2"],
        [("binary_tv", "pg")],
        "sustained_drop",
        "sign_and_interval",
        delay=True,
    )
    rows = [line for line in text.splitlines() if line.startswith("| `binary_tv` − `pg` |")]
    assert rows == [
        "| `binary_tv` − `pg` | 2 | +10.0 | +15.0 | +20.0 | +15.0 ± 5.0 | [+2.6, +27.4] | a gap: one sign in every "
        "seed, interval excludes 0 |",
        "| `binary_tv` − `pg` | 4 | +10.0 | +20.0 | +30.0 | +20.0 ± 10.0 | [-4.8, +44.8] | one sign in every seed, "
        "interval includes 0: not a gap |",
    ]
    assert "| `pg` | broke on | 3 of 3 seeds |" in text and "| `binary_tv` | broke on | 0 of 3 seeds |" in text
    assert "- `binary_tv` 0 of 3, `pg` 3 of 3: p = 0.050" in text.splitlines()
    assert "- `binary_tv` later than `pg` on 3 of 3: p = 0.125" in text.splitlines()


def test_a_report_stars_the_minutes_of_a_run_that_shared_its_cpu_or_resumed_and_no_other(tmp_path):
    """A resumed run's clock restarts at its checkpoint, and a run beside other work is slowed by it: its minutes are
    not its whole run's own, and the report says so with a star; a run with neither mark has none."""
    for name in ("pg", "ppo_clip", "binary_tv"):
        write_metrics(tmp_path / f"{name}-seed0", [0.3, 0.4], blocked=[0.0], blocked_rare=[0], lengths=[10])
    for name, mark in (("pg", "resumed"), ("ppo_clip", "shared_cpu")):
        provenance = json.loads((tmp_path / f"{name}-seed0" / "provenance.json").read_text())
        (tmp_path / f"{name}-seed0" / "provenance.json").write_text(json.dumps(provenance | {mark: "why"}))
    report = study_module().report(tmp_path, ["pg", "ppo_clip", "binary_tv"], ["0"], [], "sustained_drop")
    minutes = {
        line.split("`")[1]: line.strip("| ").split(" | ")[-1]
        for line in report.split("| minutes |")[1].split("\n\n")[0].splitlines()
        if line.startswith("| `")
    }
    assert minutes == {"pg": "1.0 *", "ppo_clip": "1.0 *", "binary_tv": "1.0"}  # one seed: no std


def test_the_share_of_blocked_tokens_pulled_back_toward_mu_by_hand(tmp_path):
    """--toward_mu: of the blocked tokens, the share with A > 0 and π falling or A < 0 and π rising, weighted by each
    step's tokens. ipo seed 0: (0.05 · 10 + 0.10 · 30) / (0.1 · 10 + 0.2 · 30) = 3.5 / 7 = 50%; seed 1, whose second
    step blocks nothing: 0.02 · 10 / (0.1 · 10) = 20%. binary_tv's mask keeps those tokens: 0. pg logs no split."""
    split = {  # (A > 0 and π falling, A < 0 and π rising) per step, each a fraction of the step's tokens
        ("ipo", 0): [(0.02, 0.03), (0.05, 0.05)],
        ("ipo", 1): [(0.01, 0.01), (0.0, 0.0)],
        ("binary_tv", 0): [(0.0, 0.0), (0.0, 0.0)],
        ("binary_tv", 1): [(0.0, 0.0), (0.0, 0.0)],
    }
    blocked = {("ipo", 0): [0.1, 0.2], ("ipo", 1): [0.1, 0.0], ("binary_tv", 0): [0.1, 0.1]}
    lengths = {("ipo", 0): [10, 30]}
    for name, seed in itertools.product(("pg", "ipo", "binary_tv"), (0, 1)):
        run = tmp_path / f"{name}-seed{seed}"
        default = [0.1, 0.1] if name != "pg" else [0.0, 0.0]
        write_metrics(run, [0.3, 0.4], blocked.get((name, seed), default), [0, 0], lengths.get((name, seed), [10, 10]))
        if (name, seed) in split:
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for record in records:
                if "reward/mean" in record:
                    falling, rising = split[name, seed][record["step"] - 1]
                    record["trust_region/blocked_frac_pos_adv_falling"] = falling
                    record["trust_region/blocked_frac_neg_adv_rising"] = rising
            (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    names, seeds = ["pg", "ipo", "binary_tv"], ["0", "1"]
    assert "toward μ" not in study_module().report(tmp_path, names, seeds, [], "sustained_drop")
    report = study_module().report(tmp_path, names, seeds, [], "sustained_drop", toward=True)
    header = next(line for line in report.splitlines() if "| toward μ |" in line).strip("| ").split(" | ")
    column = header.index("toward μ")
    cells = {
        line.split("`")[1]: line.strip("| ").split(" | ")[column]
        for line in report.split("| toward μ |")[1].split("\n\n")[0].splitlines()
        if line.startswith("| `")
    }
    assert cells == {"pg": "–", "ipo": "35.0 ± 21.2", "binary_tv": "0.0 ± 0.0"}


def test_the_offpolicy_table_has_a_row_per_name_and_setting_with_numbers_by_hand(tmp_path):
    """study.py offpolicy: final and lowest accuracy, the largest |pi - mu| (0.1 x the last step here) and the tokens
    blocked, weighted by each step's tokens: (0.1 x 10 + 0.3 x 30) / 40 = 25% for the first setting."""
    write_metrics(
        tmp_path / "fresh" / "pg-seed0", [0.3, 0.4, 0.5], blocked=[0.1, 0.3], blocked_rare=[0, 0], lengths=[10, 30]
    )
    write_metrics(
        tmp_path / "fresh" / "pg-seed1", [0.3, 0.2, 0.7], blocked=[0.0, 0.0], blocked_rare=[0, 0], lengths=[10, 30]
    )
    write_metrics(
        tmp_path / "stale" / "pg-seed0", [0.3, 0.1, 0.2], blocked=[0, 0, 0.5], blocked_rare=[0] * 3, lengths=[5] * 3
    )
    command = [
        sys.executable,
        str(HERE / "figures" / "study.py"),
        "offpolicy",
        "--names",
        "pg ppo_clip",
        "--seeds",
        "0 1",
    ]
    command += ["--row", f"k 0={tmp_path / 'fresh'}", "--row", f"k 4={tmp_path / 'stale'}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = [line.strip("| ").split(" | ")[1:] for line in result.stdout.splitlines() if line.startswith("| `pg`")]
    assert rows[0] == [
        "k 0",
        "0, 1",
        "60.0 ± 14.1 (50.0 / 70.0)",
        "25.0 ± 7.1 (30.0 / 20.0)",
        "0.200 ± 0.000 (0.200 / 0.200)",
        "12.50 ± 17.68 (25.00 / 0.00)",
    ]
    assert rows[1] == ["k 4", "0", "20.0 (20.0)", "10.0 (10.0)", "0.300 (0.300)", "16.67 (16.67)"]
    assert "| `ppo_clip` | k 0 | not run |" in result.stdout
    assert "not in the table: ppo_clip seed 0 (missing)" in result.stdout


@slow
def test_a_study_records_a_run_stopped_by_a_non_finite_loss_and_goes_on_but_ends_on_any_other_failure(
    demo_cache, tmp_path
):
    """An absurd learning rate: update 1 moves the weights by about 1e30, update 2's loss is NaN, so each run stops
    at step 1; both are finished records marked with that step, and the report follows. A run that failed otherwise
    (its metrics end without the stop) is refused, exit 2, which ends the study (set -e)."""
    out = tmp_path / "study"
    tiny = f"--cache_dir {demo_cache} --prompts_per_step 4 --samples_per_prompt 4 --eval_n 8 --learning_rate 1e30"
    study = ["bash", str(HERE / "run_gsm8k.sh"), "--demo", "--objectives", "ppo_clip pg", "--steps", "3"]
    result = subprocess.run([*study, "--out", out, "--", *tiny.split()], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("ppo_clip", "pg"):
        provenance = json.loads((out / f"{name}-seed0" / "provenance.json").read_text())
        assert provenance["finished"] and provenance["stopped_nonfinite_at_step"] == 1
        assert sorted(path.name for path in (out / f"{name}-seed0").iterdir()) == ["metrics.jsonl", "provenance.json"]
    assert (out / "results.md").exists()
    (out / "pg-seed0" / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')  # no stop in it
    finish = ["python", str(HERE / "figures" / "study.py"), "finish", str(out / "pg-seed0"), "--stopped"]
    refused = subprocess.run(finish, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "not on a non-finite loss" in refused.stderr


@slow
def test_a_study_resumes_a_killed_run_to_the_numbers_of_one_never_killed_and_refuses_a_record_of_other_flags(
    demo_cache, tmp_path
):
    """run_gsm8k.sh's demo study, killed (SIGKILL, the whole process group) once it has logged step 1, before its
    first checkpoint: started again, it starts the run over, and the new record says so. Killed again once that
    checkpoint is written, then started again: it resumes from the checkpoint, the record says so, and its records
    equal an uninterrupted run's. The same study with another flag is refused in one line naming the flag and the
    record's directory, and the record is kept."""
    flags = f"{SMALL_DEMO} --steps 6 --eval_every 2 --cache_dir {demo_cache}".split()

    def study(out, *more):
        options = ["--demo", "--objectives", "binary_tv", "--save_every", "2", "--out", str(out)]
        return ["bash", str(HERE / "run_gsm8k.sh"), *options, "--", *flags, *more]

    def killed_once(written) -> int:  # the step of the last record when it was killed
        killed = subprocess.Popen(study(tmp_path / "killed"), start_new_session=True, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while not written() and killed.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        assert not json.loads((record / "provenance.json").read_text())["finished"]
        return study_module().last_logged_step(record)

    whole = subprocess.run(study(tmp_path / "whole"), capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-3000:]
    record = tmp_path / "killed" / "binary_tv-seed0"
    first = killed_once(lambda: step_records_so_far(record))
    assert not (record / "checkpoint").exists()
    second = killed_once(lambda: (record / "checkpoint").exists())
    provenance = json.loads((record / "provenance.json").read_text())
    [started_over] = provenance["started_over"]  # when, and how far the attempt before got
    assert re.fullmatch(
        rf"at [\d: -]+: the attempt started [\d: -]+ had logged up to step {first} and left no checkpoint", started_over
    )
    again = subprocess.run(study(tmp_path / "killed"), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "resumed from its last checkpoint" in again.stdout, again.stderr[-3000:]
    assert comparable(records(record)) == comparable(records(tmp_path / "whole" / "binary_tv-seed0"))
    [resumed] = json.loads((record / "provenance.json").read_text())["resumed"]
    assert f"from its step-2 checkpoint (the attempt before had logged up to step {second})" in resumed
    before = (record / "metrics.jsonl").read_bytes()
    other = subprocess.run(study(tmp_path / "killed", "--learning_rate", "3e-4"), capture_output=True, text=True)
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr
    assert f"{record} holds a run with no --learning_rate, not --learning_rate 3e-4" in other.stderr
    assert (record / "metrics.jsonl").read_bytes() == before


@slow
def test_the_readme_study_table_is_redrawn_from_the_committed_records(tmp_path):
    """Every report command in a study's README (the stale-data study's with --gap sign_and_interval, the criterion it
    registered) redraws its results.md, or the file its --results names, from its records as committed (but where
    each run broke, added after the first three were drawn); each line of the seeded study's tables (but that one) and
    of each `breaks` table is in it. A study still running, its README's title says so, has no results to redraw."""
    readmes = sorted((HERE / "figures").glob("*/README.md"), key=lambda p: (p.parent.name == "smollm2_seeds", p))
    for readme in [path.read_text(encoding="utf-8") for path in readmes]:
        for command in re.finditer(r"^python figures/study\.py report (figures/\S+) ((?:.*\\\n)*.*)$", readme, re.M):
            args = shlex.split(command[2].replace("\\\n", " "))  # a command may go on over lines ending in \
            results = args[args.index("--results") + 1] if "--results" in args else f"{command[1]}/results.md"
            if not (HERE / results).exists():  # a study still running: its README says so, and has no results yet
                assert readme.splitlines()[0].endswith(": running"), f"{results} is not committed"
                continue
            for directory in [command[1], *(args[i + 1] for i, arg in enumerate(args) if arg == "--pool")]:
                shutil.copytree(HERE / directory, tmp_path / directory, dirs_exist_ok=True)
            report = [sys.executable, str(HERE / "figures/study.py"), "report", command[1], *args]
            result = subprocess.run([*report, "--figure", "drawn.png"], capture_output=True, text=True, cwd=tmp_path)
            assert result.returncode == 0, result.stderr
            drawn, committed = ((root / results).read_text() for root in (tmp_path, HERE))
            if "\nWhere each run broke" not in committed:
                drawn = re.sub(r"\nWhere each run broke.*?\n(?=\nPer run)", "", drawn, flags=re.S)
            assert drawn == committed, command[1]
        for command in re.finditer(r"^python figures/study\.py breaks (.*) --figure \S+$", readme, re.M):
            breaks = [sys.executable, str(HERE / "figures/study.py"), "breaks", *shlex.split(command[1])]
            printed = subprocess.run(breaks, capture_output=True, text=True, cwd=HERE).stdout.splitlines()
            assert printed and [line for line in printed if line not in readme.splitlines()] == [], command[1]
    drawn = drawn.split("\nPer run")[0]  # the seeded study's, last, as committed: no table of where each run broke
    assert [line for line in drawn.splitlines() if line not in set(readme.splitlines())] == []  # in results.md alone
    verdict = study_module().paired_verdict  # fp32's ppo_clip − pg at step 20: one sign, [−25.2, +50.2]
    assert verdict([30.0, 4.5, 3.0], 3) == "a gap: one sign in every seed"
    assert verdict([30.0, 4.5, 3.0], 3, "sign_and_interval") == "one sign in every seed, interval includes 0: not a gap"
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "drawn.png").read_bytes()[:4] == b"\x89PNG"


def test_the_results_documents_table_across_machines_is_what_study_py_compare_writes():
    """The results index's table across machines, the SmolLM2 arms in three record directories (a column each), is
    the output of the compare command written above it, line for line: no number in it is typed by hand."""
    document = (HERE / "figures" / "README.md").read_text(encoding="utf-8")
    command = re.search(r"^python figures/study\.py compare (.*)$", document, re.M)
    result = subprocess.run(
        [sys.executable, str(HERE / "figures" / "study.py"), "compare", *shlex.split(command.group(1))],
        capture_output=True,
        text=True,
        cwd=HERE,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = set(document.splitlines())
    assert [line for line in result.stdout.splitlines() if line not in lines] == []
    assert document.index(result.stdout.splitlines()[2]) < document.index("## The demo model's evidence")


# ---------------------------------------------------------------------------- What DPPO changes: the README's figures
# figures/what_dppo_changes.py draws them from dppo.py's own functions; these tests hold what it draws to closed forms
# written here from the papers, so a figure that moved would fail here first.


@functools.cache
def figures():
    spec = importlib.util.spec_from_file_location("what_dppo_changes", HERE / "figures" / "what_dppo_changes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REACH_MU = torch.tensor([1e-4, 1e-3, 0.01, 0.05, 0.1, 0.3, 0.5, 0.7, 0.9, 0.97], dtype=torch.float64)


def binary_kl_by_hand(q, p):  # KL(mu || pi) over {a_t, the rest}, mu first (DPPO, arXiv 2602.04879, eq. 14)
    return q * (q / p).log() + (1 - q) * ((1 - q) / (1 - p)).log()


def bisect(f, low, high, iterations=80):  # where the increasing f crosses 0 between low and high, elementwise
    for _ in range(iterations):
        middle = (low + high) / 2
        low, high = torch.where(f(middle) < 0, middle, low), torch.where(f(middle) < 0, high, middle)
    return (low + high) / 2


@slow
def test_the_drawn_trust_regions_end_where_the_papers_closed_forms_do():
    """The furthest pi(a_t) that keeps its gradient, found by bisection on objective_loss and autograd, against the
    closed forms: PPO's pi/mu = 1 - eps_low, 1 + eps_high (eq. 7; DAPO eq. 8); binary TV's |pi - mu| = delta (DPPO eqs.
    11-13); binary KL's KL = delta (eq. 14); DCPO's roots of |r (r - 1)| q = eps (arXiv 2509.02333, eq. 4)."""
    figs = figures()
    mu = REACH_MU
    one, zero = torch.ones_like(mu), torch.zeros_like(mu)
    dcpo_low = 0.5 + 0.5 * (1 - 4 * 0.2 / mu).clamp(min=0).sqrt()
    dcpo_high = (0.5 + 0.5 * (1 + 4 * 0.28 / mu).sqrt()).clamp(max=10)
    kl_up = bisect(lambda p: binary_kl_by_hand(mu, p) - 0.05, mu, one - 1e-12)
    kl_down = bisect(lambda p: 0.05 - binary_kl_by_hand(mu, p), torch.full_like(mu, 1e-300), mu)
    kl_down = torch.where(binary_kl_by_hand(mu, torch.full_like(mu, 1e-12)) > 0.05, kl_down, zero)
    expected = {  # objective: (down for A < 0, up for A > 0)
        "ppo_clip": (0.8 * mu, (1.28 * mu).clamp(max=1)),
        "binary_tv": ((mu - 0.15).clamp(min=0), (mu + 0.15).clamp(max=1)),
        "binary_kl": (kl_down, kl_up),
        "dcpo": (dcpo_low * mu, (dcpo_high * mu).clamp(max=1)),
    }
    drawn = [(name, flags, place) for name, flags, place in figs.REGIONS if name in expected]
    assert sorted(name for name, _, _ in drawn) == sorted(expected)  # a renamed region would skip its check
    for name, flags, place in drawn:
        down, up = figs.furthest_reach(flags, mu, -1.0, place), figs.furthest_reach(flags, mu, +1.0, place)
        assert torch.allclose(down, expected[name][0], rtol=1e-6, atol=1e-9), name
        assert torch.allclose(up, expected[name][1], rtol=1e-6, atol=1e-9), name


def test_cppo_drawn_after_a_spent_prefix_ends_where_its_budget_does():
    """CPPO (arXiv 2606.10968, eqs. 8-11, 22), the 6th of 6 tokens after five with D = 0.06: w_6 = 0.8, W_5 = 4.6,
    S_5 = 0.276, delta_b = clamp(P90(D), 0.02, 0.04) = 0.04, c_6 = min(0.15, 0.15 + 0.04 * 4.6 - 0.276) = 0.058; the
    token is blocked once 0.8 |pi - mu| > 0.058. As its first token, CPPO is binary TV at delta 0.15."""
    figs = figures()
    mu = REACH_MU
    spent, first = (flags for name, flags, place in figs.REGIONS if name.startswith("cppo"))
    reach = 0.058 / 0.8
    assert figs.SPENT_DRIFT == 0.06
    assert torch.allclose(figs.furthest_reach(spent, mu, +1.0, "spent"), (mu + reach).clamp(max=1), atol=1e-9)
    assert torch.allclose(figs.furthest_reach(spent, mu, -1.0, "spent"), (mu - reach).clamp(min=0), atol=1e-9)
    assert torch.allclose(figs.furthest_reach(first, mu, +1.0), (mu + 0.15).clamp(max=1), atol=1e-9)


def test_the_drawn_weights_of_cispo_drpo_and_the_relaxed_clip():
    """cispo's gradient is PG's times clip(r, 1 - eps_low, 1 + eps_high) / r (MiniMax-M1, eqs. 4-5: 0 and 5 by
    default); drpo's is PG's times 1 - sign(A (r - 1)) |pi - mu| / delta (arXiv 2606.09821, eq. 9); the relaxed clip
    (DPPO section 6) lets a token with mu < 0.1 through on both sides, still under the dual clip for A < 0."""
    figs = figures()
    mu = torch.tensor([1e-4, 1e-3, 0.05, 0.3, 0.6], dtype=torch.float64)
    pi = torch.tensor([1e-2, 1e-4, 0.5, 0.31, 0.2], dtype=torch.float64)
    r = pi / mu
    flags = {name: flags for name, flags, place in figs.REGIONS}
    for sign in (1.0, -1.0):
        cispo = figs.gradient_weight(flags["cispo (its weight)"], mu, pi, sign)
        assert torch.allclose(cispo, r.clamp(0, 5) / r)
        drpo = figs.gradient_weight(flags["drpo (its weight)"], mu, pi, sign)
        assert torch.allclose(drpo, 1 - torch.sign(sign * (r - 1)) * (pi - mu).abs() / 12.5)
    relaxed = flags["ppo_clip --relax_clip both"]
    assert figs.gradient_weight(relaxed, mu, pi, +1.0).tolist() == [1, 1, 1, 1, 1]  # r = 100 passes at mu = 1e-4
    assert figs.gradient_weight(relaxed, mu, pi, -1.0).tolist() == [0, 1, 1, 1, 0]  # dual clip r > 10; 0.6 is common


def test_the_decade_table_counts_tokens_by_hand():
    figs = figures()
    mu = torch.tensor([5e-5, 5e-3, 5e-3, 0.5, 0.95], dtype=torch.float64)
    pi = torch.tensor([5e-5, 7e-3, 5e-3, 0.2, 0.95], dtype=torch.float64)
    rows = figs.decade_table({"bfloat16": (mu, pi)})
    assert rows[2] == "| bfloat16 | [0, 0.0001) | 1 | 0 | 0 | 0 | 0 |"
    # two tokens: |log r| 0.336 and 0; p99 of the two = 0.99 * 0.336; max |pi - mu| 0.002; one outside [0.8, 1.28]
    assert rows[4] == f"| bfloat16 | [0.001, 0.01) | 2 | {0.99 * math.log(1.4):.3g} | 0.002 | 1 | 0 |"
    assert rows[6] == f"| bfloat16 | [0.1, 0.9) | 1 | {math.log(2.5):.3g} | 0.3 | 1 | 1 |"
    assert rows[7] == "| bfloat16 | [0.9, 1] | 1 | 0 | 0 | 0 | 0 |"


def test_figure_1_records_mu_from_the_copy_and_pi_from_the_fp32_policy(tiny_checkpoint):
    """Every sampled token's mu as the recorder took it from a copy in the given dtype, and pi from the fp32 policy:
    an fp32 copy matches to float rounding, a bf16 one does not, and both see the same number of tokens."""
    tokens = figures().sampled_tokens(str(tiny_checkpoint), "arithmetic", ("float32", "bfloat16"), 4, 2, 6)
    (mu32, pi32), (mu16, pi16) = tokens["float32"], tokens["bfloat16"]
    assert len(mu32) == len(pi32) and len(mu16) == len(pi16) and len(mu32) > 8
    assert (pi32 / mu32).log().abs().max() < 1e-5
    assert (pi16 / mu16).log().abs().max() > 1e-4


def test_figure_1_refuses_a_bad_gguf_file_in_one_line_as_dppo_py_does(tmp_path, capsys, monkeypatch):
    model = tmp_path / "empty.gguf"
    model.touch()
    monkeypatch.setattr(dppo, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        figures().main(["--only", "numerics", "--model", str(model), "--out", str(tmp_path)])
    assert exit_info.value.code == 2  # one error line, last, whatever the script said before it (no matplotlib, ...)
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [f"dppo.py: error: --model {model}: an empty file"]


def test_the_rare_right_answer_is_slower_under_the_clip_than_under_tv_or_none():
    """The bandit's ordering, held at seed 0 because it held in all 5 seeds the README reports (steps to 0.5 from
    mu0 = 1e-3: ppo_clip 6, binary_tv 4, pg 4): PPO's clip slows a rare right token that binary TV lets grow."""
    steps = {objective: len(figures().bandit(objective, 1e-3, seed=0)) for objective in ("pg", "ppo_clip", "binary_tv")}
    assert steps["ppo_clip"] > steps["binary_tv"] >= steps["pg"]


@slow
def test_without_matplotlib_the_figures_command_prints_its_tables_and_draws_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    figures().main(["--only", "regions", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert "| `binary_tv` | 0 – 0.15 |" in captured.out and "no figure drawn" in captured.err
    assert not list(tmp_path.iterdir())


def test_token_classes_on_hand_made_completions(tiny_policy):
    """What a blocked token is (figures/what_dppo_changes.py --only blocked), on known pieces: an EOS id; the final
    answer's last occurrence; only digits, operators and spaces; a letter; anything else (a space, newline, ####)."""
    tokenizer, eos = tiny_policy[1], tiny_policy[1].eos_token_id
    pieces = [("Ann has", "words"), (" 6 * 7 = 42", "digits and operators")]
    pieces += [("\n####", "other"), ("42", "final answer")]
    ids = [tokenizer(text, add_special_tokens=False).input_ids for text, _ in pieces]
    expected = [kind if tokenizer.decode([t]).strip() else "other" for (_, kind), i in zip(pieces, ids) for t in i]
    assert figures().token_classes(tokenizer, [*sum(ids, []), eos], {eos}) == [*expected, "end of sequence"]
    assert "final answer" not in figures().token_classes(tokenizer, ids[0], {eos})  # no number, no answer


@slow
def test_the_blocked_token_record_is_the_mask_the_update_used(demo_cache, monkeypatch):
    """--only blocked judges every trained token again with objective_loss, once per region: for the objective the
    run trains, its record is the mask rl_step handed to add_token_stats, token for token."""
    used, add_token_stats = [], dppo.add_token_stats

    def keeping(stats, cfg, sampled, pi, anchor, A, blocked, first):
        lengths = sampled.completion_mask.sum(1).tolist()
        used.extend((blocked & (A != 0))[row, : int(n)].tolist() for row, n in enumerate(lengths))
        add_token_stats(stats, cfg, sampled, pi, anchor, A, blocked, first)

    monkeypatch.setattr(dppo, "add_token_stats", keeping)
    run = ["--cache_dir", str(demo_cache), "--objective", "ppo_clip", "--steps", "2", "--eval_n", "8"]
    records = figures().blocked_tokens(figures().BLOCKED_RUN + run)[0]
    assert [record["blocked"]["ppo_clip"] for record in records] == used
    assert any(map(any, used)) and not all(map(all, used))  # the clip bound some tokens, not all


# ---------------------------------------------------------------------------- the prefill's timing


def test_the_prefill_table_quotes_its_record():
    """memory_and_speed.md's prefill table: every median, range and change is figures/prefill_timing_cpu.json's."""
    record = json.loads((HERE / "figures" / "prefill_timing_cpu.json").read_text())
    text = (HERE / "figures" / "memory_and_speed.md").read_text()
    for shape, digits in (("smollm2", 2), ("demo", 3)):
        case = record["shapes"][shape]
        for side in ("before", "after"):
            s = case[side]
            assert f"{s['median_s']:.{digits}f} s ({s['min_s']:.{digits}f}–{s['max_s']:.{digits}f})" in text
        assert f"−{-100 * case['median_change']:.0f}%" in text and case["same_completions"]
        assert f"largest \\|Δ log μ\\| {case['largest_abs_dlogmu']:.1e}".replace("e-0", "e-") in text


def test_the_ipo_study_readme_quotes_its_report():
    """figures/ipo_reuse_demo/README.md: each arm's row (breaks, accuracy at step 200, tokens blocked, the share pulled
    back toward μ) and the answer's interval are the cells of results.md, which the redraw test holds to the records."""
    directory = HERE / "figures" / "ipo_reuse_demo"
    results, readme = directory / "results.md", (directory / "README.md").read_text()
    text = results.read_text()
    final, training = table_rows(results, "Per run"), table_rows(results, "Over training")
    header = next(line for line in text.splitlines() if line.startswith("| name | reward end"))
    columns = header.strip("| ").split(" | ")[1:]
    for arm in ("pg", "binary_tv", "ipo_0.15", "ipo_0.3"):
        broke = re.search(rf"^\| `{re.escape(arm)}` \| broke on \| (\d+ of \d+) seeds \|", text, re.M)[1]
        cells = [
            broke,
            final[arm][1],
            training[arm][columns.index("blocked")],
            training[arm][columns.index("toward μ")],
        ]
        assert f"| `{arm}` | " + " | ".join(cells) + " |" in readme
    row = next(line for line in text.splitlines() if line.startswith("| `ipo_0.15` − `binary_tv` | 200 |"))
    mean, interval = (cell.replace("-", "−") for cell in row.strip("| ").split(" | ")[-3:-1])
    answer = " ".join(readme.split())  # the prose wraps anywhere
    assert f"is {mean.split(' ± ')[0]} points, with a 95% t interval of {interval}" in answer


# ---------------------------------------------------------------------------- the studies' drivers: a seed is a stratum


def reuse_study_module():
    sys.path.insert(0, str(HERE / "figures"))
    spec = importlib.util.spec_from_file_location("reuse_study", HERE / "figures" / "reuse_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_by_seed_drivers_set_aside_a_seed_of_another_kind_and_run_the_arms_in_order(tmp_path, monkeypatch):
    """--stage by_seed and --stage ipo (their pre-registrations: a seed's arms on one CPU kind): a seed whose records
    hold another kind is moved to set_aside/ whole, finished or not, and starts over here; a seed of this kind keeps
    its records; the arms run seed by seed, in the registered order."""
    reuse_study = reuse_study_module()
    monkeypatch.chdir(tmp_path)
    here = {"cpu": "AMD EPYC", "cpu_id": "cpu family 26 model 2 stepping 1", "cpu_capability": "AVX512"}
    monkeypatch.setattr(reuse_study.study, "machine", lambda: here | {"gpu": "none"})
    ran = []
    monkeypatch.setattr(reuse_study, "broke", lambda directory, arm, seed, *rest: ran.append((arm, seed)))
    directory = reuse_study.IPO_DEMO
    old_kind = here | {"cpu_id": "cpu family 25 model 17 stepping 1"}
    for arm, seed, kind in (("pg", 0, old_kind), ("binary_tv", 0, old_kind), ("pg", 1, here)):
        (directory / f"{arm}-seed{seed}").mkdir(parents=True)
        (directory / f"{arm}-seed{seed}" / "provenance.json").write_text(json.dumps(kind))
    reuse_study.ipo(main=None)
    shelf = directory / "set_aside" / "seed0-AMD_EPYC-cpu_family_25_model_17_stepping_1-AVX512"
    assert sorted(path.name for path in shelf.iterdir()) == ["binary_tv-seed0", "pg-seed0"]
    assert not (directory / "pg-seed0").exists() and (directory / "pg-seed1").exists()
    assert ran == [(arm, seed) for seed in range(10) for arm in reuse_study.IPO_ARMS]
    ran.clear()
    monkeypatch.setattr(reuse_study, "PINNED", {"torch": torch.__version__.split("+")[0], "transformers": "x"})
    with pytest.raises(SystemExit, match="the study pins"):
        reuse_study.by_seed(main=None)
    assert ran == []
