"""The GitHub workflows' safety settings, read from the YAML files themselves."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_CI = os.path.join(REPO, ".github", "workflows", "gpu-ci.yml")


def _checkout_steps_text(text: str) -> list[tuple[int, str]]:
    """(line number, the step's own lines) of every `actions/checkout` step, without a YAML
    parser (PyYAML is not a dependency): a step runs from its `- ` line to the next line
    indented no deeper than that dash."""
    lines = text.splitlines()
    steps = []
    for i, line in enumerate(lines):
        if not re.match(r"\s*(-\s+)?uses:\s*['\"]?actions/checkout@", line):
            continue
        start = i
        while start >= 0 and not re.match(r"\s*-\s", lines[start]):
            start -= 1
        assert start >= 0, f"line {i + 1}: a checkout step with no '- ' above it"
        dash = len(lines[start]) - len(lines[start].lstrip())
        end = start + 1
        while end < len(lines) and (
            not lines[end].strip()
            or lines[end].lstrip().startswith("#")
            or len(lines[end]) - len(lines[end].lstrip()) > dash
        ):
            end += 1
        steps.append((start + 1, "\n".join(lines[start:end])))
    return steps


def test_every_checkout_step_in_gpu_ci_drops_its_credentials():
    # the gpu job runs branch code on a self-hosted runner: a token left in .git/config by
    # actions/checkout would be readable by that code
    with open(GPU_CI) as f:
        text = f.read()
    steps = _checkout_steps_text(text)
    assert len(steps) >= 2, "expected a checkout step in both the cpu and the gpu job"
    for line, step in steps:
        assert re.search(r"^\s+with:\s*$(\n.*)*?\n\s+persist-credentials:\s*false\s*$", step, re.M), (
            f"gpu-ci.yml line {line}: checkout without persist-credentials: false:\n{step}"
        )


def test_every_checkout_step_in_gpu_ci_drops_its_credentials_per_yaml():
    yaml = pytest.importorskip("yaml", reason="PyYAML absent: the plain-text test above covers it")
    with open(GPU_CI) as f:
        text = f.read()
    workflow = yaml.safe_load(text)
    checkouts = [
        (name, step)
        for name, job in workflow["jobs"].items()
        for step in job.get("steps", [])
        if str(step.get("uses", "")).startswith("actions/checkout@")
    ]
    # the plain-text reader sees the same steps
    assert len(checkouts) == len(_checkout_steps_text(text)) >= 2
    for name, step in checkouts:
        assert (step.get("with") or {}).get("persist-credentials") is False, (name, step)


def test_the_plain_text_reader_finds_a_checkout_without_the_setting():
    text = (
        "jobs:\n  a:\n    steps:\n      - uses: actions/checkout@v4\n"
        "      - uses: actions/setup-python@v5\n        with:\n          persist-credentials: false\n"
        "      - name: co\n        uses: actions/checkout@v4\n        with:\n"
        "          persist-credentials: false\n"
    )
    steps = _checkout_steps_text(text)
    assert [line for line, _ in steps] == [4, 8]
    assert "persist-credentials" not in steps[0][1]
    assert "persist-credentials: false" in steps[1][1]


def _gpu_ci_text() -> str:
    with open(GPU_CI) as f:
        return f.read()


def test_the_compile_job_covers_every_triton_the_gpu_matrix_pins():
    # the compile job checks, without a GPU, what each gpu job's Triton will compile: a release
    # the gpu matrix gains must be compiled for too (and .ci/compile_matrix.sh reads the same pins)
    text = _gpu_ci_text()
    pinned = set(re.findall(r"\{torch:\s*\"[0-9.]+\",\s*triton:\s*\"([0-9.]+)\"\}", text))
    lists = re.findall(r"^\s+triton:\s*\[([^\]]*)\]\s*$", text, re.M)
    assert len(lists) == 1, "expected one `triton: [...]` list, the compile job's matrix"
    compiled = set(re.findall(r"\"([0-9.]+)\"", lists[0]))
    assert len(pinned) >= 5 and compiled == pinned, (sorted(pinned), sorted(compiled))
    assert re.search(r"run: bash \.ci/compile_matrix\.sh \"\$\{\{ matrix\.triton \}\}\"", text)


def test_the_compile_matrix_script_reads_the_gpu_matrix_pins():
    # with no release named, .ci/compile_matrix.sh compiles every pin of gpu-ci.yml (the compiles
    # themselves take minutes a release; --list stops after reading the pins)
    import subprocess

    script = os.path.join(REPO, ".ci", "compile_matrix.sh")
    run = subprocess.run(["bash", script, "--list"], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    pinned = sorted(set(re.findall(r"triton:\s*\"([0-9.]+)\"", _gpu_ci_text())))
    assert sorted(run.stdout.split()) == pinned and "3.0.0" in pinned, run.stdout


def test_every_torch_of_the_gpu_matrix_has_one_triton_pin_per_yaml():
    # each torch column installs the Triton it pins: a torch without its pin (or a pin for a torch
    # the matrix lacks) would run with whatever Triton pip picks, unchecked by the compile job
    yaml = pytest.importorskip("yaml", reason="PyYAML absent: the compile-job test reads the pins as text")
    matrix = yaml.safe_load(_gpu_ci_text())["jobs"]["gpu"]["strategy"]["matrix"]
    pins = [(row["torch"], row["triton"]) for row in matrix["include"]]
    assert sorted(t for t, _ in pins) == sorted(matrix["torch"]), pins
    # an excluded pair names a python and a torch of the matrix (a typo would exclude nothing)
    for row in matrix.get("exclude", []):
        assert row["python"] in matrix["python"] and row["torch"] in matrix["torch"], row
