"""Every fenced shell command in README.md, CONTRIBUTING.md and docs/*.md is exercised here, cheaply.

`python -m train|eval|distill.regenerate|distill.cache` commands are composed in-process with Hydra's compose API and
typed and validated as the entry points do (a misspelt key, a missing config or a missing value fails); launchers
(torchrun, deepspeed, scripts/train.sh, sbatch, srun, flock) are stripped to the module they launch; scripts' own
arguments go through their argument parsers; `make` targets, pip extras and serve lines are checked against the
Makefile, pyproject.toml and the model card's serve command. A command nobody taught this file to check fails too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(bash|sh|shell|console)\s*$")
HYDRA_MODULES = {"train", "eval", "distill.regenerate", "distill.cache"}
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")
# Commands that belong to the user's shell or another tool, not to this project: nothing of ours to check.
FOREIGN = {".", "source", "huggingface-cli", "git", "cd", "export", "echo", "ls", "cat", "cp", "mkdir", "rm", "tail",
           "grep", "nvidia-smi", "kill", "wc"}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def shell_commands(path: Path, root: Path = ROOT) -> list[Command]:
    """The commands of a doc's fenced bash blocks: continuation lines joined, comment lines dropped."""
    commands, block, pending, start = [], False, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            block = bool(FENCE.match(line)) if not block else False
            continue
        if not block or (not pending and (not line.strip() or line.lstrip().startswith("#"))):
            continue
        start = start if pending else number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        commands.append(Command(str(path.relative_to(root)), start, (pending + line).strip()))
        pending = ""
    return commands


ALL = [c for doc in DOCS if doc.is_file() for c in shell_commands(doc)]


def segments(text: str) -> list[list[str]]:
    """The simple commands of a line (split at &&, ;, |), comments removed, leading VAR=value assignments dropped."""
    out, current = [], []
    for token in shlex.split(text, comments=True):
        if token in ("&&", ";", "|", "||"):
            out.append(current)
            current = []
        else:
            current.append(token)
    out.append(current)
    return [[t for i, t in enumerate(seg) if not (ENV.match(t) and all(ENV.match(s) for s in seg[:i + 1]))]
            for seg in out if seg]


# ---- what each command is checked against -------------------------------------------------------------------------

def compose(module: str, overrides: list[str]):
    """The config `python -m <module> <overrides>` would run with, typed and validated as the entry points do."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from train.config import load_config, register_configs

    register_configs()
    overrides = [o for o in overrides if o not in ("--cfg", "job", "--help", "-h") and not o.startswith("hydra.")]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    config = load_config(cfg)
    # The data=sharegpt / data=text presets ask for a file; a command without one would only fail once data loads.
    assert config.data.source != "file" or config.data.path, f"python -m {module}: set data.path for data.source=file"
    return config


class _Parsed(Exception):
    pass


def check_script(path: str, args: list[str]) -> None:
    """Run a script's argument parsing, and only that: its parser's parse_args succeeds, then the script stops."""
    script = ROOT / path
    assert script.is_file(), f"{path} does not exist"
    if script.name == "export.py":
        spec = importlib.util.spec_from_file_location("docs_export", script)
        export = importlib.util.module_from_spec(spec)
        sys.modules["docs_export"] = export
        spec.loader.exec_module(export)
        export.parse(args)
        return
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, argv=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop
    saved_argv = sys.argv
    try:
        sys.argv = [str(script), *args]
        with pytest.raises(_Parsed):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved_argv


def check_make(args: list[str]) -> None:
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    names = [a for a in args if "=" not in a]
    assert names and set(names) <= targets, f"make {names}: the Makefile has {sorted(targets)}"
    for a in args:
        if a.startswith("ARGS="):
            compose("train", shlex.split(a[len("ARGS="):]))


def check_pip(args: list[str]) -> None:
    assert args[0] == "install", args
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    pins = {re.split(r"[=<>]", d)[0]: d for d in project["dependencies"]}
    for a in args[1:]:
        if a.startswith("-") or a.startswith("http"):
            continue
        if a.startswith("."):
            named = re.findall(r"\[([^\]]*)\]", a)
            asked = {e.strip() for group in named for e in group.split(",")}
            assert asked <= extras, f"pip extras {sorted(asked - extras)} are not in pyproject.toml ({sorted(extras)})"
        else:
            name = re.split(r"[=<>]", a)[0]
            assert name in pins and pins[name] == a, f"{a}: pyproject.toml pins {pins.get(name)}"


def check_serve(engine: str, line: str) -> None:
    """A serve line must be what the model card writes for that export (serve.export.serve_command)."""
    from serve.export import serve_command

    if engine == "vllm":
        target, spec = re.match(r"vllm serve (\S+) --speculative-config '(.*)'$", line).groups()
        spec = json.loads(spec)
        kind = {"eagle": "eagle1", "eagle3": "eagle3"}.get(spec["method"], spec["method"])
        want = serve_command("vllm", kind, target, spec["model"], spec["num_speculative_tokens"])
    else:
        flags = dict(re.findall(r"--([\w-]+) (\S+)", line))
        if flags["speculative-algorithm"] == "DFLASH":  # the verify window: the anchor plus the drafts
            want = serve_command("sglang", "dflash", flags["model-path"], flags["speculative-draft-model-path"],
                                 int(flags["speculative-num-draft-tokens"]) - 1)
            assert line == want, f"the model card would write:\n{want}"
            return
        kind = {"EAGLE": "eagle1", "EAGLE3": "eagle3"}.get(flags["speculative-algorithm"], "draft_model")
        tree = {"top_k": int(flags["speculative-eagle-topk"]), "total_tokens": int(flags["speculative-num-draft-tokens"])}
        want = serve_command("sglang", kind, flags["model-path"], flags["speculative-draft-model-path"],
                             int(flags["speculative-num-steps"]), tree)
    assert line == want, f"the model card would write:\n{want}"


def launched(seg: list[str]) -> tuple[str, list[str]] | None:
    """(module, overrides) of a launcher line, or None when the line is not a launcher."""
    head = seg[0]
    if head == "srun":
        rest = [t for t in seg[1:] if not t.startswith("-")]
        return launched(rest)
    if head == "torchrun" or seg[1:3] == ["-m", "torch.distributed.run"]:
        i = seg.index("-m", 3 if head != "torchrun" else 1)
        return seg[i + 1], seg[i + 2:]
    if head == "deepspeed":
        i = seg.index("--module")
        return seg[i + 1], seg[i + 2:]
    if head in ("scripts/train.sh", "sbatch"):
        args = seg[1:] if head == "scripts/train.sh" else seg[2:]
        if head == "sbatch":
            assert (ROOT / seg[1]).is_file() and seg[1] == "scripts/slurm/train.sbatch", seg[1]
        if not any(a.startswith("trainer=") for a in args):
            args = ["trainer=ddp", *args]  # what scripts/train.sh adds
        return "train", args
    return None


def exercise(text: str) -> None:
    for seg in segments(text):
        head = seg[0]
        if head in FOREIGN:
            continue
        if head == "flock":  # flock -s|-x LOCKFILE COMMAND...: the command is what runs
            exercise(shlex.join(seg[3:]))
            continue
        if head == "make":
            check_make(seg[1:])
        elif head == "pip":
            check_pip(seg[1:])
        elif head == "vllm":
            check_serve("vllm", text)
        elif head == "bash":  # bash SCRIPT: the script exists and parses
            assert len(seg) >= 2 and (ROOT / seg[1]).is_file(), f"bash: no such script {seg[1:2]}"
            parsed = subprocess.run(["bash", "-n", str(ROOT / seg[1])], capture_output=True, text=True)
            assert parsed.returncode == 0, parsed.stderr
        elif Path(head).name == "lint-imports":
            assert (ROOT / ".importlinter").is_file() and len(seg) == 1, seg
        elif seg[1:3] == ["-m", "pytest"] or Path(head).name == "pytest":
            args = seg[3:] if seg[1:3] == ["-m", "pytest"] else seg[1:]
            paths = [a for a in args if not a.startswith("-") and a != "not slow"]
            assert paths and all((ROOT / p.split("::")[0]).exists() for p in paths), f"pytest: no such file in {paths}"
        elif head in ("python", "python3", ".venv/bin/python", ".venv-vllm/bin/python"):
            if seg[1:3] == ["-m", "venv"]:
                continue
            if seg[1:3] == ["-m", "sglang.launch_server"]:
                check_serve("sglang", text)
            elif seg[1:3] == ["-m", "torch.distributed.run"]:
                module, args = launched(seg)
                assert module in HYDRA_MODULES, f"torch.distributed.run launches {module}, not an entry point"
                compose(module, args)
            elif seg[1] == "-m":
                assert seg[2] in HYDRA_MODULES, f"python -m {seg[2]}: not an entry point ({sorted(HYDRA_MODULES)})"
                compose(seg[2], seg[3:])
            else:
                check_script(seg[1], seg[2:])
        elif (found := launched(seg)) is not None:
            module, args = found
            assert module in HYDRA_MODULES, f"{head} launches {module}, not an entry point"
            compose(module, args)
        else:
            pytest.fail(f"no check for {head!r}: teach tests/test_docs_commands.py how to exercise it")


def test_the_docs_show_commands():
    docs = {c.doc for c in ALL}
    assert {"README.md", "docs/eagle.md", "docs/multi-gpu.md", "docs/export.md"} <= docs
    assert any(c.text == "make demo" for c in ALL) and any(c.text == "make test" for c in ALL)


@pytest.mark.parametrize("command", ALL, ids=str)
def test_doc_command(command: Command):
    exercise(command.text)


# ---- the checks above can fail -------------------------------------------------------------------------------------

@pytest.mark.parametrize("broken,error", [
    ("python -m train experiment=eagle3_llama3_8b data.path=x.jsonl trainer.stepz=5", "stepz"),
    ("python -m train experiment=no_such_experiment", "no_such_experiment"),
    ("python -m train experiment=eagle3_llama3_8b", "data.path"),  # a mandatory value left unset
    ("scripts/train.sh drafter=eagle9", "eagle9"),
    ("python scripts/export.py drafter_path=x format=vllm", "output_dir"),
    ("python scripts/bench_decode.py --presett gpu", "2"),  # argparse exits with status 2
    ("make deploy", "deploy"),
    (".venv/bin/python -m pytest -q tests/test_no_such_file.py", "no such file"),
    ("pip install -e '.[cuda]'", "cuda"),
    ("vllm serve meta-llama/Llama-3.1-8B-Instruct --speculative-config "
     "'{\"method\": \"eagle3\", \"model\": \"exports/x\", \"num_speculative_tokens\": 6, \"extra\": 1}'", "card"),
    ("ssh node0 python -m train", "no check"),
    ("python -m torch.distributed.run --standalone --nproc_per_node 2 -m train trainer=fsdpp", "fsdpp"),
    ("pytest -q tests/test_no_such_file.py", "no such file"),
])
def test_a_broken_command_fails(broken, error):
    with pytest.raises((Exception, SystemExit, pytest.fail.Exception), match=error):
        exercise(broken)


def test_shell_commands_joins_continuations_and_skips_other_blocks(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("```bash\n# a comment\npython -m train \\\n    drafter=medusa   # why\n```\n```text\nmake nope\n```\n")
    (cmd,) = shell_commands(doc, tmp_path)
    assert cmd.line == 3 and cmd.text.split() == ["python", "-m", "train", "drafter=medusa", "#", "why"]
    assert segments(cmd.text) == [["python", "-m", "train", "drafter=medusa"]]


# ---- the recommended recipe ----------------------------------------------------------------------------------------

def _readme_train_commands() -> list[list[str]]:
    return [seg for c in ALL if c.doc == "README.md" for seg in segments(c.text)
            if (found := launched(seg)) and found[0] == "train" or seg[:3] == ["python", "-m", "train"]]


def test_the_cluster_commands_train_the_8b_recipe():
    """The README's torchrun / Slurm lines name the experiment: the 8B recipe's data, steps and lr, not the toy's."""
    lines = _readme_train_commands()
    assert len(lines) >= 3
    for seg in lines:
        _, args = launched(seg) or ("train", seg[3:])
        cfg = compose("train", args)
        assert cfg.target.name == "meta-llama/Llama-3.1-8B-Instruct", seg
        assert (cfg.trainer.steps, cfg.trainer.lr, cfg.data.source) == (20000, 1e-4, "file"), seg
        assert (cfg.data.mode, cfg.data.path) == ("regenerated", "sharegpt.jsonl"), seg


def test_cfg_job_prints_the_8b_recipe():
    """`python -m train <the cluster example's overrides> --cfg job` prints the recipe's data, steps and lr."""
    seg = next(s for s in _readme_train_commands() if s[0] == "sbatch")
    _, args = launched(seg)
    out = subprocess.run([sys.executable, "-m", "train", *args, "--cfg", "job"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert "name: meta-llama/Llama-3.1-8B-Instruct" in out
    assert re.search(r"^  steps: 20000$", out, re.M) and re.search(r"^  lr: 0\.0001$", out, re.M), out
    assert "path: sharegpt.jsonl" in out and "mode: regenerated" in out and "engine: ddp" in out


def test_the_recipe_commands_fit_together():
    """The README's hub-id-to-served-drafter steps hand each other the same paths: the run dir training writes is the
    one evaluated and exported, the export is the one served, for the target trained on, with the recipe's γ."""
    readme = [c.text for c in ALL if c.doc == "README.md"]
    run_dir = next(re.search(r"SPECDRAFT_RUN_DIR=(\S+) scripts/train.sh", t).group(1) for t in readme
                   if "SPECDRAFT_RUN_DIR=" in t)
    drafter_paths = {re.search(r"drafter_path=(\S+)", t).group(1) for t in readme if "drafter_path=" in t}
    assert drafter_paths == {f"{run_dir}/drafter"}
    output_dir = next(re.search(r"output_dir=(\S+)", t).group(1) for t in readme if "scripts/export.py" in t)
    serve = next(t for t in readme if t.startswith("vllm serve"))
    target, spec = re.match(r"vllm serve (\S+) --speculative-config '(.*)'$", serve).groups()
    spec = json.loads(spec)
    recipe = compose("train", ["experiment=eagle3_llama3_8b", "data.path=x.jsonl"])
    assert (target, spec["model"], spec["method"]) == (recipe.target.name, output_dir, "eagle3")
    assert spec["num_speculative_tokens"] == recipe.eval.num_draft
