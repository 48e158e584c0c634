"""The command lines as a new user meets them: --help, a typo, an impossible value, no network."""

import json
import os
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cli import parse_config
from conftest import run_grpo
from dpo import Config as DPOConfig
from evaluate import EvalConfig
from grpo import Config

ROOT = Path(__file__).resolve().parents[1]
CLIS = sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("*.py"), *ROOT.glob("benchmarks/*.py"),
                                                 *ROOT.glob("recipes/*.py")]
              if 'if __name__ == "__main__":' in p.read_text())


@pytest.mark.parametrize("script", CLIS)
def test_help_of_every_cli(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_every_cli_is_covered():
    assert {"grpo.py", "dpo.py", "evaluate.py", "benchmarks/grpo_step.py"} <= set(CLIS)


def test_a_config_file_with_the_replaced_bf16_key_is_one_line(tmp_path):
    config = tmp_path / "old.toml"
    config.write_text("bf16 = false\n")
    with pytest.raises(SystemExit, match=f"{config}: 'bf16' was replaced by --dtype .*: use "
                                         f'dtype = "fp32"'):
        parse_config(Config, ["--config", str(config), "--dry-run"])


@pytest.mark.parametrize("cls, argv, message", [
    (Config, ["--loss-agg", "foo"], "invalid choice: 'foo'"),
    (Config, ["--adv-scale", "median"], "invalid choice"),
    (Config, ["--ratio-level", "seq"], "invalid choice"),
    (Config, ["--rollout", "sglang"], "invalid choice"),
    (Config, ["--weight-sync", "nccl"], "invalid choice"),
    (Config, ["--template", "boxd"], "invalid choice"),
    (DPOConfig, ["--loss-type", "kto"], "invalid choice"),
    (EvalConfig, ["--backend", "trt"], "invalid choice"),
])
def test_fixed_choices_are_checked_when_parsed(cls, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_config(cls, argv + ["--dry-run"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1  # one line, not a usage block


@pytest.mark.parametrize("cls, argv, message", [
    (Config, ["--no-bf16"], "--no-bf16 was replaced by --dtype auto|bf16|fp32"),
    (DPOConfig, ["--bf16"], "use --dtype bf16"),
    (Config, ["--tools", "calculator", "--async-steps", "1"], "--async-steps 1 with --tools"),
    (Config, ["--max-turns", "0"], "--max-turns must be at least 1"),
    (Config, ["--num-generations", "1"], "--num-generations 1"),
    (Config, ["--steps", "-1"], "--steps must not be negative"),
    (Config, ["--eps-low", "1.5"], "--eps-low 1.5"),
    (Config, ["--eps-high", "-0.1"], "--eps-high -0.1"),
    (Config, ["--temperature", "0"], "--temperature 0"),
    (Config, ["--top-p", "0.95"], "--top-p 0.95"),
    (Config, ["--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
    (Config, ["--keep-last", "-1"], "--keep-last must not be negative"),
    (Config, ["--resume", "auto", "--init-from", "x"], "give one of them"),
    (Config, ["--async-steps", "2"], "--async-steps 2: 0 (on-policy) or 1"),
    (Config, ["--async-steps", "1", "--is-cap", "2"], "leave --is-cap out"),
    (Config, ["--rollout-tokens", "-2"], "--rollout-tokens -2: groups a step kept token by token"),
    (DPOConfig, ["--label-smoothing", "0.5"], "--label-smoothing 0.5"),
    (DPOConfig, ["--beta", "0"], "--beta 0"),
    (EvalConfig, ["-n", "0"], "^error: -n must be at least 1"),
    (EvalConfig, ["--top-p", "0"], "--top-p must be in (0, 1]"),
    # NaN never; infinity only where it means "no limit" (an infinite learning rate trains nothing)
    (Config, ["--lr", "inf"], "--lr inf: not a finite number"),
    (Config, ["--lr", "nan"], "--lr nan: not a finite number"),
    (Config, ["--beta", "inf"], "--beta inf: not a finite number"),
    (Config, ["--eps-high", "nan"], "--eps-high nan: not a finite number"),
    (Config, ["--gpu-gb", "inf"], "--gpu-gb inf: not a finite number"),
    (DPOConfig, ["--beta", "inf"], "--beta inf: not a finite number"),
    (EvalConfig, ["--temperature", "inf"], "--temperature inf: not a finite number"),
    # torch.manual_seed overflowed at the first rollout, the engines' seeds being multiples of it
    (Config, ["--seed", "1000000000000"], "--seed 1000000000000: must be from 0 to 4294967295"),
    (Config, ["--seed", "-1"], "--seed -1: must be from 0 to 4294967295"),
    (EvalConfig, ["--seed", str(2 ** 32)], "--seed 4294967296: must be from 0 to"),
    (Config, ["--reward", "correctness=abc"], "--reward correctness: its weight is not a finite"),
    (Config, ["--reward", "correctness=nan,format"], "--reward correctness: its weight is not"),
    (Config, ["--judge", "some/model=inf"], "--judge some/model: its weight is not a finite"),
])
def test_impossible_values_are_refused_by_dry_run(cls, argv, message):
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        parse_config(cls, argv + ["--dry-run"])


def test_no_limit_may_be_infinite():
    cfg = Config(eps_high=float("inf"), max_grad_norm=float("inf"))
    assert cfg.eps_high == cfg.max_grad_norm == float("inf")


def test_impossible_values_are_refused_in_a_toml_config(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('loss-agg = "foo"\n')
    with pytest.raises(SystemExit, match="'loss-agg' must be one of"):
        parse_config(Config, ["--config", str(path)])
    path.write_text("num_generations = 1\n")
    with pytest.raises(SystemExit, match="--num-generations 1"):
        parse_config(Config, ["--config", str(path)])
    for text, said in [("steps = true\n", "'steps' must be int, got True"),  # (a bool is an int)
                       ("eval_size = 4\neval-size = 500\n", "'eval_size' and 'eval-size' set one"),
                       (b'model = "caf\xe9"\n', "not valid TOML")]:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(SystemExit, match=said):
            parse_config(Config, ["--config", str(path)])
    with pytest.raises(SystemExit, match="a folder, not a TOML file"):
        parse_config(Config, ["--config", str(tmp_path)])


def test_flags_are_spelled_whole(capsys):
    """No prefix matching: evaluate.py's `--n 16` is refused, not read as --no-chat."""
    with pytest.raises(SystemExit):
        parse_config(EvalConfig, ["--n", "16"])
    assert "unrecognized arguments: --n 16" in capsys.readouterr().err


def test_a_hub_model_without_network_is_one_line(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "grpo.py", "--model", "Qwen/Qwen2.5-Math-1.5B",
                             "--data", "arith", "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert "the Hugging Face hub cannot be reached" in result.stderr
    assert "local folder" in result.stderr and "Traceback" not in result.stderr


def test_config_file_is_overridden_by_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('lr = 3e-6\nsteps = 7\nloss-agg = "seq-mean"\n')
    cfg = parse_config(Config, ["--config", str(path), "--steps", "9"])
    assert (cfg.lr, cfg.steps, cfg.loss_agg) == (3e-6, 9, "seq-mean")
    path.write_text("stepz = 3\n")
    with pytest.raises(SystemExit, match="unknown option 'stepz'"):
        parse_config(Config, ["--config", str(path)])
    path.write_text('steps = "many"\n')
    with pytest.raises(SystemExit, match="'steps' must be int"):
        parse_config(Config, ["--config", str(path)])


@pytest.mark.parametrize("recipe", sorted(str(p) for p in (ROOT / "recipes").rglob("*.toml")))


def test_every_recipe_passes_dry_run(recipe, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_config(Config, ["--config", recipe, "--dry-run"])
    assert exit_.value.code == 0
    assert "max_new_tokens" in capsys.readouterr().out


def test_installing_smolrl_shadows_no_other_package(tmp_path):
    """`pip install -e .` installs the dependencies only: outside the checkout, `import evaluate`
    is Hugging Face's package (here a stand-in), and smolrl's helper names are not importable."""
    fake = tmp_path / "site" / "evaluate"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("WHO = 'huggingface'\n")
    probe = ("import importlib.util, evaluate; print(evaluate.WHO); "
             "print([m for m in ('data', 'model', 'trainer', 'grpo', 'checkpoint') "
             "if importlib.util.find_spec(m)])")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, env={"PYTHONPATH": str(tmp_path / "site"),
                                                        "PATH": "/usr/bin:/bin"})
    assert result.stdout.split() == ["huggingface", "[]"], result.stderr


def test_a_hub_dataset_without_network_is_one_line(tiny_model_dir, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "grpo.py", "--model", str(tiny_model_dir),
                             "--data", "math", "--out", str(tmp_path / "o")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "error: --data DigitalLearningGmbH/MATH-lighteval: the Hugging Face hub cannot be reached "
        "and the dataset is not in the local cache; pass a local file (.jsonl, .csv, .parquet) or "
        "run where the hub is reachable"]


@pytest.mark.parametrize("model", ["./no/such/model", "Qwen/Qwen2.5-Mathh-1.5B"])
def test_a_mistyped_model_is_named_before_the_task_it_implies(model, tmp_path):
    """Without --data, any model but the offline default trains on MATH from the hub: a mistyped
    --model (a folder that is not there, an uncached hub id offline) is the line, not the MATH
    dataset it made the default."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "grpo.py", "--model", model, "--out",
                             str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env=env)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: --model {model}") or \
        lines[0].startswith(f"error: --model {model!r}"), lines[0]


def test_a_path_that_is_no_model_folder_is_one_line(tmp_path):
    """An empty folder, a run's checkpoints/, a config.json itself, a tokenizer's own folder or a
    LoRA checkpoint (adapters only) given as a model: one printable line naming the flag, not
    transformers' traceback after the data has loaded. load_tokenizer alone takes a tokenizer's
    folder."""
    from model import resolve
    for name in ("empty", "tokenizer", "lora", "esc\x1b]52;c;eA==\x07"):
        (tmp_path / name).mkdir()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "lora" / "adapter_config.json").write_text("{}")
    (tmp_path / "lora" / "tokenizer_config.json").write_text("{}")
    no_config = "without a config.json, so not a model's folder (a run's --out holds its model " \
                "in model/)"
    for given, why in [("empty", f"a folder {no_config}"), ("config.json", f"a file {no_config}"),
                       ("tokenizer", f"a folder {no_config}"),
                       ("lora", "a LoRA checkpoint, adapters without their model: resume its "
                                "run with --resume, or give the run's merged model (its "
                                "--out/model)"),
                       ("esc\x1b]52;c;eA==\x07", f"a folder {no_config}")]:
        with pytest.raises(SystemExit) as stop:
            resolve(str(tmp_path / given), "--critic-from")
        line = str(stop.value)
        assert line.isprintable() and line == \
            f"error: --critic-from {tmp_path / given}: {why}".replace("\x1b", "\\x1b") \
            .replace("\x07", "\\x07"), line
    assert resolve(str(tmp_path / "tokenizer"), tokenizer_only=True) == str(tmp_path / "tokenizer")
    for step in (2, 10, 9):  # a run still training: checkpoints, no model/ yet (10 after 9)
        (tmp_path / "run" / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "run" / "checkpoints" / f"step_{step}" / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as stop:
        resolve(str(tmp_path / "run"), "--init-from")
    assert str(stop.value) == f"error: --init-from {tmp_path / 'run'}: a run's folder without its " \
        f"model/ yet (written when the run ends); its latest checkpoint holds the weights: " \
        f"--init-from {tmp_path / 'run' / 'checkpoints' / 'step_10'}"
    (tmp_path / "run" / "checkpoints" / "step_\u00b2").mkdir()  # (a digit to isdigit, not to int)
    (tmp_path / "lora-run" / "checkpoints" / "step_3").mkdir(parents=True)
    (tmp_path / "lora-run" / "checkpoints" / "step_3" / "adapter_config.json").write_text("{}")
    with pytest.raises(SystemExit) as stop:
        resolve(str(tmp_path / "lora-run"))
    assert str(stop.value) == f"error: --model {tmp_path / 'lora-run'}: a LoRA run's folder " \
        f"without its merged model/ yet (written when the run ends; its checkpoints hold " \
        f"adapters alone): resume the run with --resume, or give its --out once it has ended"
    with pytest.raises(SystemExit, match="step_10$"):
        resolve(str(tmp_path / "run"))


def test_bad_data_for_the_default_model_is_named_before_its_conversion(tmp_path):
    """The offline default cannot be mistyped: on a fresh machine its GGUF file is converted (~20 s,
    0.5 GB) when it first loads, after the data is checked -- not to name a data file's typo."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": ""}  # (on a GPU the memory plan reads the model's config first)
    result = subprocess.run([sys.executable, "grpo.py", "--data", str(tmp_path / "typo.jsonl"),
                             "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode != 0 and "typo.jsonl" in result.stderr, result.stderr
    assert "converting" not in result.stdout + result.stderr


def test_a_turn_too_short_for_a_tool_call_stops_before_the_model_loads(tmp_path, monkeypatch):
    import grpo
    import rl
    monkeypatch.setattr(rl, "setup_local", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match=r"--max-new-tokens 16 .* tool 'guess' \("):
        grpo.main(parse_config(Config, ["--data", "guess", "--max-new-tokens", "16",
                                        "--out", str(tmp_path / "o")]))


def test_names_that_are_not_utf8(tiny_model_dir, tmp_path):
    """A --data file whose name is not UTF-8 (a byte \\xff) trains and ends with its curves and
    its page (it crashed in curves.png's title and the page, after training); an --out whose
    name is not UTF-8 -- where the tokenizer library cannot save the model, at the end of the
    run or in a checkpoint -- is refused in one line before anything loads."""
    data = bytes(tmp_path) + b"/pr\xffblems.jsonl"
    with open(data, "w") as f:
        f.writelines('{"problem": "What is %d + 1?", "answer": "%d"}\n' % (i, i + 1)
                     for i in range(8))
    args = ["--model", tiny_model_dir, "--prompts-per-step", "2", "--num-generations", "2",
            "--max-new-tokens", "4", "--eval-every", "0", "--steps", "1"]
    # (as Python decodes such an argument: os.fsdecode; the run in this process, conftest.run_grpo)
    run_grpo([*args, "--data", os.fsdecode(data), "--out", str(tmp_path / "out")])
    assert "pr\ufffdblems.jsonl" in (tmp_path / "out/report.html").read_text(encoding="utf-8")
    assert (tmp_path / "out/curves.png").exists()
    out = bytes(tmp_path) + b"/out\xff"
    result = subprocess.run([sys.executable, "grpo.py", *args, "--data", "arith", "--out", out],
                            cwd=ROOT, capture_output=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.decode(errors="replace").strip().splitlines() == [
        f"error: --out {tmp_path}/out\ufffd: not a UTF-8 name (the byte 0xff), under which the "
        f"tokenizer library cannot save a model; choose another --out"]
    assert not Path(out.decode(errors="surrogateescape")).exists()


def _asks_to_run_its_code(folder, tiny_model_dir, marker):
    """A model folder as a stranger might share it: config.json names a model_type transformers
    does not know and points (auto_map) at the folder's own code, which would write `marker`."""
    import shutil
    shutil.copytree(tiny_model_dir, folder)
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="smolrl-evil", architectures=["EvilForSequenceClassification"],
                  id2label={"0": "LABEL_0"}, auto_map={
                      "AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel",
                      "AutoModelForCausalLM": "evil.EvilModel",
                      "AutoModelForSequenceClassification": "evil.EvilModel"})
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(folder)


def test_no_loader_runs_a_model_folders_own_code(tiny_model_dir, tmp_path, monkeypatch):
    """Issue 55 item 14: --model, --reward-model, --judge, --teacher and --critic-from load with
    trust_remote_code=False; a folder whose config asks to run its own code stops in one line,
    no loader asks on the terminal (a user answering yes is simulated), and the code never runs."""
    import io
    from dataclasses import replace
    from types import SimpleNamespace

    import torch

    import distill
    import model
    import ppo
    from reward_models import Judge, RewardModel, check_learned_rewards
    marker = tmp_path / "ran"
    folder = _asks_to_run_its_code(tmp_path / "evil", tiny_model_dir, marker)
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    loaders = {
        "--model's tokenizer": lambda: model.load_tokenizer(folder),
        "--model": lambda: model.load_model(folder),
        "--model, a scalar head": lambda: model.load_model(folder, head="reward"),
        "--model's dtype": lambda: model.source_dtype(folder),
        "--reward-model, checked": lambda: check_learned_rewards(folder, "", ""),
        "--reward-model": lambda: RewardModel(folder, "answer-is", torch.float32),
        "--judge, checked": lambda: check_learned_rewards("", folder, ""),
        "--judge": lambda: Judge(folder, "answer-is", torch.float32),
        "--teacher, checked": lambda: distill.check_teacher(SimpleNamespace(
            teacher=folder, model=tiny_model_dir)),
        "--teacher": lambda: distill.load_teacher(folder, "cpu", torch.float32),
        "--critic-from": lambda: ppo.main(replace(ppo.Config(
            data="arith", model=tiny_model_dir, dtype="fp32"), critic_from=folder,
            out=str(tmp_path / "ppo"))),
    }
    for what, load in loaders.items():
        with pytest.raises(SystemExit) as stop:
            load()
        line = str(stop.value.code)
        assert line.startswith("error: ") and "\n" not in line and "smolrl-evil" in line, (what, line)
        assert not asked and not marker.exists(), what
    result = subprocess.run([sys.executable, "grpo.py", "--model", folder, "--data", "arith",
                             "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: --model {folder}: ")
    assert "Do you wish to run" not in result.stdout + result.stderr and not marker.exists()


def test_a_tracker_not_installed_is_refused_before_anything_loads(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SystemExit, match="--report-to wandb: wandb is not installed"):
        Config(report_to="wandb")


def test_a_tracker_that_fails_to_start_is_one_line(tmp_path, monkeypatch):
    """wandb.init raising (not logged in, no network) ends the run in one line naming the flag."""
    import wandb
    from evaluate import RunLog

    def refuse(**kw):
        raise RuntimeError("api_key not configured (no-tty)\nmore lines")
    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(SystemExit, match=r"^error: --report-to wandb: RuntimeError: api_key not "
                                         r"configured \(no-tty\) / more lines \(`wandb login`"):
        RunLog(tmp_path, [], "wandb", {})


def test_a_home_path_is_expanded_wherever_a_path_is_given(tmp_path, monkeypatch):
    """The shell expands `--out ~/x`, but not `--out=~/x`, a TOML value nor a list's later items:
    left as it is, `~` became a folder named `~` in the current one (--out) or a path that is not
    there (--model). Only the options that name paths: a column may be called `~`."""
    from evaluate import EvalConfig
    from run_folder import read_paths
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.toml").write_text('init_from = "~/start"\nreward_model = "~/rm=0.5, ~/rm2"\n'
                                     'answer_field = "~"\n')
    cfg = parse_config(Config, ["--config=~/c.toml", "--out=~/runs/a", "--data", "~/d.jsonl",
                                "--eval-data=~", "--reward=correctness=1,~/r.py:fn",
                                "--prompt-field=~root"])
    assert (cfg.out, cfg.data, cfg.eval_data, cfg.init_from) == (
        f"{tmp_path}/runs/a", f"{tmp_path}/d.jsonl", str(tmp_path), f"{tmp_path}/start")
    assert (cfg.reward_model, cfg.reward) == (f"{tmp_path}/rm=0.5,{tmp_path}/rm2",
                                              f"correctness=1,{tmp_path}/r.py:fn")
    assert (cfg.answer_field, cfg.prompt_field) == ("~", "~root")  # (columns, not paths)
    (tmp_path / "rm2").mkdir()
    assert tmp_path / "rm2" in read_paths(cfg)  # (what pruning superseded/ never deletes)
    assert parse_config(Config, ["--out", "a~b"]).out == "a~b"  # (only a leading ~ is a home)
    assert parse_config(EvalConfig, ["--data=~/a.jsonl,~/b.jsonl"]).data == \
        f"{tmp_path}/a.jsonl,{tmp_path}/b.jsonl"


def test_a_dangling_link_given_as_a_model_is_named_as_one(tmp_path, monkeypatch):
    """A link to a model that was moved or deleted is not "the hub cannot be reached"; nor is a
    mistyped folder under one that exists here."""
    from model import resolve
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "link").symlink_to(tmp_path / "gone")
    (tmp_path / "models" / "relative").symlink_to("../gone")
    (tmp_path / "models" / "loop").symlink_to("loop")
    for given, link, to in [("models/link", "models/link", tmp_path / "gone"),
                            ("models/link/", "models/link", tmp_path / "gone"),
                            ("models/relative/model", "models/relative", "gone"),
                            ("models/loop", "models/loop", "models/loop")]:
        with pytest.raises(SystemExit) as stop:
            resolve(given)
        assert str(stop.value) == f"error: --model {given}: {link} is a link to {to}, which " \
                                  f"leads to nothing", given
    with pytest.raises(SystemExit) as stop:
        resolve("models/smol-135m", "--init-from")
    assert str(stop.value).startswith("error: --init-from models/smol-135m: no such folder here "
                                      "(models/ holds no smol-135m), and ")


def test_wandb_without_credentials_is_refused_before_the_models_load(tmp_path, monkeypatch):
    """wandb.init looks for the API key once the models have loaded (minutes, for a large one),
    and on a terminal waits for it to be typed: open_run asks wandb.login (prompt=False) first,
    in one line, and leaves --out unlocked."""
    import wandb
    from session import open_run
    from run_folder import _held
    monkeypatch.delenv("WANDB_MODE", raising=False)
    asked = []

    def no_key(**kw):
        asked.append(kw)
        return False
    monkeypatch.setattr(wandb, "login", no_key)
    out = tmp_path / "o"
    with pytest.raises(SystemExit, match=r"^error: --report-to tensorboard,wandb: no wandb API key "
                                         r"here \(`wandb login`, or WANDB_API_KEY; "
                                         r"WANDB_MODE=offline logs without one\)$"):
        open_run(Config(out=str(out), model="unused", data="arith",
                        report_to="tensorboard,wandb"))
    assert asked == [{"verify": False, "prompt": False}]
    assert os.path.realpath(out) not in _held

    def bad_key(**kw):
        raise wandb.errors.AuthenticationError("WANDB_API_KEY invalid: API key must have 40+ "
                                               "characters, has 3.")
    monkeypatch.setattr(wandb, "login", bad_key)
    with pytest.raises(SystemExit, match=r"^error: --report-to wandb: AuthenticationError: "
                                         r"WANDB_API_KEY invalid: .* \(`wandb login`, or "):
        open_run(Config(out=str(out), model="unused", data="arith", report_to="wandb"))
    monkeypatch.setattr(wandb, "run", object())  # (a notebook's own run: login() says False)
    open_run(Config(out=str(tmp_path / "q"), model="unused", data="arith", report_to="wandb"))
    monkeypatch.setattr(wandb, "run", None)
    monkeypatch.setenv("WANDB_MODE", "offline")  # (no key needed: login not asked)
    monkeypatch.setattr(wandb, "setup", lambda: types.SimpleNamespace(
        settings=types.SimpleNamespace(mode="offline")))
    open_run(Config(out=str(tmp_path / "p"), model="unused", data="arith", report_to="wandb"))


def test_a_path_this_user_may_not_read_is_one_line(tmp_path):
    """A folder of another user's on the path a flag names: one line naming it, wherever it is
    first looked at (the task read from --data's first row, --out, the paths pruning keeps, a
    model's folder, --config; evaluate.py's data, and its --out checked for writing before the
    model loads), not os.stat's traceback. A PermissionError on a path no flag names -- a user's
    environment reading its own files -- keeps its traceback. As root, the cases run without the
    capabilities that let root read any file (the folders' modes then hold)."""
    import shutil
    drop = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root, and no setpriv to drop root's read-anything capabilities")
        drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    secret, read_only = tmp_path / "secret", tmp_path / "ro"
    (secret / "model").mkdir(parents=True)
    (secret / "model" / "config.json").write_text("{}")
    (secret / "d.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    (secret / "c.toml").write_text("steps = 2\n")
    read_only.mkdir()
    (secret / "t.py").write_text("def f(x):\n    return x\n")
    theirs = tmp_path / "theirs"  # (earlier results to move aside into a superseded/ ...)
    (theirs / "superseded").mkdir(parents=True)
    (theirs / "results.json").write_text("{}")
    if drop:
        os.chown(theirs / "superseded", 65534, 65534)  # (... of another user's)
    locked = tmp_path / "run" / "checkpoints" / "step_1"  # (a checkpoint in --out: another user's)
    locked.mkdir(parents=True)
    cases = [("grpo", ["--data", f"{secret}/d.jsonl"], f"{secret}/d.jsonl"),
             ("grpo", ["--model", f"{secret}/model", "--data", "arith"], f"{secret}/model"),
             ("grpo", ["--out", f"{secret}/o"], f"{secret}/o"),
             ("grpo", ["--config", f"{secret}/c.toml"], f"--config {secret}/c.toml"),
             ("grpo", ["--tools", f"calculator, {secret}/t.py:f"], f"{secret}/t.py"),
             ("grpo", ["--out", str(locked.parents[1]), "--resume", "auto"],
              f"{locked}/driver_state.pt"),
             ("evaluate", ["--data", f"arith,{secret}/d.jsonl"], f"{secret}/d.jsonl"),
             ("evaluate", ["--out", str(read_only)], ""),
             ("evaluate", ["--out", str(theirs)], "")]
    child = f"""
import sys; sys.argv = ["x"]
from cli import parse_config, readable_paths
import evaluate, grpo
for script, flags, _ in {cases!r}:
    try:
        if script == "grpo":
            grpo.main(parse_config(grpo.Config, ["--out", "{tmp_path}/o", *flags]))
        else:
            evaluate.main(["--out", "{tmp_path}/o", *flags])
    except SystemExit as e:
        print("said:", e)
import os; os.chdir("{tmp_path}")
for values in [{{"data": "{secret}/d.jsonl"}}, {{"out": "."}}]:  # (no flag names the file)
    try:
        with readable_paths(values):
            open("secret/lexicon.txt")
    except PermissionError as e:
        print("said: kept", type(e).__name__, e.filename)
"""
    secret.chmod(0)
    locked.chmod(0)
    read_only.chmod(0o555)
    (theirs / "superseded").chmod(0o755 if drop else 0o555)
    try:
        result = subprocess.run([*drop, sys.executable, "-c", child], cwd=ROOT,
                                capture_output=True, text=True, timeout=120,
                                env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                     "HF_HUB_OFFLINE": "1"})
    finally:
        secret.chmod(0o700)
        locked.chmod(0o700)
        read_only.chmod(0o755)
        (theirs / "superseded").chmod(0o755)
    denied = f"permission denied: this user (uid {os.geteuid()}) may not reach it, or a " \
             f"folder on its way"
    said = [line[6:] for line in result.stdout.splitlines() if line.startswith("said: ")]
    moving = "holds an earlier run's or evaluation's results.json, which it would move aside, but"
    assert said == [
        *(f"error: {path}: {denied}" for _, _, path in cases[:-2]),
        f"error: --out {read_only}: cannot write there (Permission denied); choose another --out",
        f"error: --out {theirs} {moving} this user (uid {os.geteuid()}) may not write in "
        f"{theirs}/superseded: choose another --out",
        "kept PermissionError secret/lexicon.txt", "kept PermissionError secret/lexicon.txt"], result.stdout[-3000:] + result.stderr[-3000:]


def test_earlier_files_in_a_sticky_folder_of_another_users_are_not_moved_late(tmp_path,
                                                                               monkeypatch):
    """--out in a folder like /tmp (anyone writes, only owners move): another user's earlier
    results.json there could not be moved aside after the whole evaluation; refused before."""
    import run_folder
    from run_folder import check_movable
    monkeypatch.setattr(run_folder, "moves_anyones", lambda: False)  # (no CAP_FOWNER: not root)
    out = tmp_path / "shared"
    out.mkdir()
    (out / "results.json").write_text("{}")
    out.chmod(0o1777)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(out).st_uid + 1)  # (someone else)
    with pytest.raises(SystemExit, match=r"results.json is another user's, in a folder \(sticky\) "
                                         r"where only its owner may move it: choose another --out$"):
        check_movable(out, [out / "results.json"])
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(out).st_uid)  # (the owner moves it)
    check_movable(out, [out / "results.json"])


def test_a_script_run_in_process_that_hangs_fails_its_test_at_its_deadline_or_the_callers(
        tmp_path):
    """conftest.run_script runs a script in the test's own process: one that hangs would hold up
    its worker for good, where a subprocess had a timeout. It raises RanTooLong at its deadline
    -- past any `except Exception` in the script -- and puts the SIGALRM handler back; a caller's
    alarm already running is the deadline instead, neither postponed nor re-armed; a script that
    takes SIGALRM for itself fails the test (helper-49's cases)."""
    import signal
    import time
    from conftest import RanTooLong, run_script

    class CallersLimit(BaseException):
        pass

    def callers_limit(*_):
        raise CallersLimit

    def script(name, text):
        (tmp_path / name).write_text(text)
        return str(tmp_path / name)

    hangs = script("hangs.py",
                   "import time\ntry:\n    time.sleep(30)\nexcept Exception:\n    pass\n")
    quick = script("quick.py", "import time\ntime.sleep(1.5)\n")
    takes = script("takes.py", "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n")
    original = signal.getsignal(signal.SIGALRM)
    try:
        start = time.monotonic()
        with pytest.raises(RanTooLong, match=r"still running after 1 s"):
            run_script(hangs, [], deadline=1)
        assert time.monotonic() - start < 5
        assert signal.getsignal(signal.SIGALRM) is original
        assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
        # the caller's alarm, due in 1 s, fires during the run, as the caller's
        signal.signal(signal.SIGALRM, callers_limit)
        signal.alarm(1)
        start = time.monotonic()
        with pytest.raises(CallersLimit):
            run_script(hangs, [], deadline=600)
        assert time.monotonic() - start < 5
        # a quick run under a caller's alarm leaves it running, not re-armed
        signal.setitimer(signal.ITIMER_REAL, 50)
        run_script(quick, [])
        assert 47 < signal.getitimer(signal.ITIMER_REAL)[0] < 48.6
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, original)
        with pytest.raises(AssertionError, match="set its own SIGALRM handler"):
            run_script(takes, [], deadline=5)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, original)
