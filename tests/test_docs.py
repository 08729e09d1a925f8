"""The README and the documentation (issue 42): what they show runs, and the API reference
covers the public API.

Every fenced command (```bash blocks, and "$ " lines in output blocks) and every ```python
block of README.md and docs/*.md is listed in COVERAGE with how it runs: here ("run", slow:
executed as written on the CPU; Python blocks use the emulated device where a GPU would
be), in CI (".ci/run" holds it verbatim), or, on the reference page of benchmarks, by the
test that runs its quick variant or not at all on a CPU (a GPU's, or a run of many
minutes). A block nobody listed fails the quick test, so a new one cannot go unrun.
`mkdocs build --strict` (broken links, missing API references) runs in CI (.ci/run).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cswap

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REFERENCE_PAGES = {"docs/benchmarks.md"}  # commands listed for reference, not recipes

RUN, CI = "run", "ci"
# command -> how it runs. ("test", node): the quick variant that test runs; ("gpu" | "long", why): not on a CPU here.
COVERAGE = {
    'python -m pip install -e ".[test]"': CI,
    "python -m pytest -n auto -q": CI,
    "python -m pytest -n auto -q -m slow": CI,
    "cswap-train": RUN,
    "cswap-plan --model resnet50 --dataset imagenet --batch 256 --gpu h100-sxm-80gb": RUN,
    "cswap-plan --hf-config benchmarks/hf_configs/llama-3.2-1b.json --seq-len 2048 --batch 4 "
    "--gpu rtx-4090 --dtype bf16 --optimizer adamw --fit": RUN,
    "cswap-plan --hf-config benchmarks/hf_configs/llama-3-8b.json --seq-len 4096 --lora-rank 16 "
    "--gpu rtx-4090-24gb --dtype bf16 --optimizer adam": RUN,
    "cswap-tune --quick": RUN,
    "python -m cswap.env": RUN,
    "python -m cswap.kernels.aot --arch 90 --blocks 128 --dtypes int32": RUN,
    # the reference page of benchmarks
    "python benchmarks/codecs.py": ("gpu", "1 MiB .. 1 GiB on a GPU"),
    "python benchmarks/codecs.py --quick": ("test", "tests/test_benchmarks.py::test_codec_benchmark_quick_run_writes_results"),
    "python benchmarks/kernel_builds.py": ("test", "tests/test_kernel_build.py::test_no_compile_errors_and_no_hot_spills"),
    "python benchmarks/instructions.py": ("long", "counts every codec in the interpreter"),
    "python benchmarks/codec_counts.py": ("test", "tests/test_benchmarks.py::"
                                                  "test_codec_counts_benchmark_counts_both_trees_and_fits_the_h200"),
    "python benchmarks/lz4_chunks.py": ("long", "LZ4 on every activation of the ratio corpus"),
    "python benchmarks/zans_tiles.py": ("gpu", "times ZANS's kernels on a GPU; tests/test_benchmarks.py::"
                                               "test_zans_tile_benchmark_round_trips_each_tile_and_prices_the_short_ones "
                                               "runs its --quick"),
    "python benchmarks/lz4_warps.py": ("gpu", "times LZ4's encoder on a GPU; tests/test_benchmarks.py::"
                                              "test_lz4_warps_benchmark_writes_the_same_bytes_at_every_count "
                                              "runs its --quick"),
    "python benchmarks/codecs_ab.py --base-site /tmp/site-base": ("gpu", "times two trees' kernels on a GPU; "
                                                                     "tests/test_benchmarks.py::test_codecs_ab_runs_"
                                                                     "both_trees_and_compares_each_case runs it on CPU"),
    "python benchmarks/codec_host.py": ("test", "tests/test_benchmarks.py::test_codec_host_benchmark_splits_a_calls_"
                                                "host_time"),
    "python benchmarks/runtime.py": ("gpu", "VGG16 at ImageNet shape"),
    "python benchmarks/runtime.py --quick": ("test", "tests/test_benchmarks.py::test_runtime_benchmark_quick_run_matches_losses"),
    "python benchmarks/runtime.py --dataset cifar10 --batch 32 --emulate measured": ("gpu", "measures a GPU"),
    "python benchmarks/twin.py": ("test", "tests/test_benchmarks.py::test_twin_benchmark_replays_the_h200_runs"),
    "python benchmarks/twin.py --gpu": ("gpu", "measures a GPU"),
    "python benchmarks/trace.py": ("gpu", "profiles a GPU"),
    "python benchmarks/memory_peak.py benchmarks/results/<device>/trace/memory-*.pickle.gz":
        ("test", "tests/test_memory_peak.py"),
    "python benchmarks/send_gaps.py benchmarks/results/<device>/trace/trace-*-sc.json.gz":
        ("test", "tests/test_send_gaps.py"),
    "python benchmarks/gil_wait.py": ("test", "tests/test_gil_wait.py"),
    "python benchmarks/soak.py": ("long", "1000 steps"),
    "python benchmarks/soak.py --quick": ("test", "tests/test_soak.py"),
    "python benchmarks/plan_paper.py": ("long", "3.5 min"),
    "python benchmarks/plan_paper.py --quick": ("test", "tests/test_plan_paper.py"),
    "python benchmarks/plan_budget.py": ("test", "tests/test_plan_budget_bench.py"),
    "python benchmarks/plan_recompute.py": ("long", "13 min"),
    "python benchmarks/train.py --budget-gib 32 --datasets cifar10": ("gpu", "every model and mode at full size"),
    "python benchmarks/train.py --quick": ("test", "tests/test_benchmarks.py::test_train_benchmark_quick_run_writes_results_and_readme"),
}


def _blocks():
    """(page, language, text) of every fenced block."""
    for page in PAGES:
        lines, lang, body = page.read_text().splitlines(), None, []
        for line in lines:
            fence = re.match(r"^```(\w*)\s*$", line)
            if fence and lang is None:
                lang, body = fence.group(1) or "text", []
            elif line.startswith("```") and lang is not None:
                yield page, lang, "\n".join(body)
                lang = None
            elif lang is not None:
                body.append(line)


def _commands(lang: str, text: str) -> list[str]:
    """The shell commands of a block: a bash block's lines, or an output block's "$ " lines,
    continuations joined and comments dropped."""
    if lang == "bash":
        lines = [re.sub(r"\s+#.*$", "", line).strip() for line in text.splitlines()]
    elif lang == "text":
        lines, inside = [], False
        for line in text.splitlines():
            if line.startswith("$ ") or inside:
                lines.append(line.removeprefix("$ ").strip())
                inside = line.rstrip().endswith("\\")
    else:
        return []
    out, joined = [], ""
    for code in lines:
        if not code:
            continue
        if code.endswith("\\"):
            joined += code[:-1].strip() + " "
            continue
        out.append((joined + code).strip())
        joined = ""
    return out


def _shown():
    commands, python = {}, {}
    for page, lang, text in _blocks():
        where = str(page.relative_to(ROOT))
        for command in _commands(lang, text):
            commands.setdefault(command, set()).add(where)
        if lang == "python":
            python.setdefault(text, set()).add(where)
    return commands, python


COMMANDS, PYTHON = _shown()


def test_every_command_shown_is_covered():
    missing = {c: sorted(p) for c, p in COMMANDS.items() if c not in COVERAGE}
    assert not missing, f"commands shown but not in tests/test_docs.py's COVERAGE: {missing}"
    stale = sorted(set(COVERAGE) - set(COMMANDS))
    assert not stale, f"COVERAGE lists commands no page shows: {stale}"
    ci = (ROOT / ".ci" / "run").read_text()
    for command, how in COVERAGE.items():
        pages = COMMANDS[command]
        if how == CI:
            assert command in ci, f"{command!r}: .ci/run does not run it as written"
        elif how != RUN:
            assert pages <= REFERENCE_PAGES, f"{command!r} is on {sorted(pages)}: a recipe must run as written"
            if how[0] == "test":
                path, _, name = how[1].partition("::")
                assert (ROOT / path).is_file() and (not name or f"def {name}(" in (ROOT / path).read_text()), how


def test_the_api_reference_lists_cswap_all_once():
    shown = re.findall(r"^::: cswap\.(\w+)\s*$", (ROOT / "docs" / "api.md").read_text(), flags=re.M)
    assert sorted(shown) == sorted(cswap.__all__)


def test_the_readme_is_a_first_five_minutes():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    cells = [cell.strip() for line in text.splitlines() if line.startswith("|") for cell in line.split("|")]
    assert max(map(len, cells)) <= 200


def _run(command: str, tmp_path, timeout: int) -> str:
    env = {**os.environ, "CSWAP_HOME": str(tmp_path / "home")}
    exe = Path(sys.executable).parent
    argv = command.split()
    if argv[0].startswith("cswap-"):
        argv[0] = str(exe / argv[0])
    elif argv[0] == "python":
        argv[0] = sys.executable
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"{command}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(c for c, how in COVERAGE.items() if how == RUN), ids=lambda c: c[:50])
def test_each_command_runs_as_written(command, tmp_path):
    out = _run(command, tmp_path, timeout=1200)
    shown = "\n".join(text for page, lang, text in _blocks() if lang == "text")
    if command.startswith("cswap-plan --model resnet50"):
        # The rows that do not depend on the measured sparsity are as the README shows them.
        for mode in ("none", "vdnn"):
            row = next(line for line in out.splitlines() if line.startswith(f"{mode} "))
            assert row in shown, f"README/docs show a stale {mode} row; now:\n{row}"
    if command.endswith("--fit"):  # the setups searched, as README shows (how many combinations the
        line = out.splitlines()[0]     # ranking keeps apart moves by one from run to run)
        assert line.split(" PREDICTED")[0] in shown, f"README shows a stale --fit summary; now:\n{line}"


@pytest.mark.slow
@pytest.mark.parametrize("code", sorted(PYTHON), ids=lambda code: sorted(PYTHON[code])[0])
def test_each_python_block_runs_as_written(code, tmp_path):
    env = {**os.environ, "CSWAP_HOME": str(tmp_path / "home"), "MPLBACKEND": "Agg"}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"{sorted(PYTHON[code])}:\n{code}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
