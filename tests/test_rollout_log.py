"""The rollout log (rollout_log.py): every step's samples on disk, with what the update used, and
--replay, which trains on them again."""

import json
import re

import pytest
import torch

from conftest import read_metrics, run_grpo, small_run_args


def _train(out):
    return [r for r in map(json.loads, (out / "rollouts.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


def test_the_log_holds_every_sample_and_what_the_update_used(tiny_model_dir, tmp_path):
    """Two steps of 2 x 4 with a KL term and every sample in detail: 16 train records, 2 x 2 held-out
    ones (steps 0 and 2); each advantage is the group's; step 1's log-probs are the starting
    model's (computed here again, by hand), and so is its reference; step 2's new_logprob is the
    exported model's -- the log holds what the update read, not something like it."""
    import pandas as pd
    from grpo import group_advantages
    from logprobs import completion_logprobs, pack
    from model import load_model
    out = tmp_path / "run"
    args = small_run_args(tiny_model_dir, out) + ["--steps", "2", "--eval-every", "2",
                                                   "--eval-size", "2", "--rollout-tokens", "-1"]
    run_grpo(args)
    frame = pd.read_json(out / "rollouts.jsonl", lines=True)  # (one line, as documented)
    assert list(frame.groupby("kind").size().items()) == [("eval", 4), ("train", 16)]
    train = _train(out)
    assert [r["step"] for r in train] == [1] * 8 + [2] * 8 and all(r["kept"] for r in train)
    for step in (1, 2):
        rows = [r for r in train if r["step"] == step]
        expected = group_advantages(torch.tensor([r["reward"] for r in rows]), 4)
        assert [r["advantage"] for r in rows] == pytest.approx(expected.tolist(), abs=1e-6)
        assert all(len(r["tokens"]["pieces"]) == len(r["completion_ids"]) for r in rows)

    def logprobs_under(model, rows):
        ids, prompt_lens, lens = pack([r["prompt_ids"] for r in rows],
                                      [r["completion_ids"] for r in rows], pad_id=2)
        with torch.no_grad():
            lp = completion_logprobs(model, ids, prompt_lens, lens, temperature=1.0)[0]
        return [lp[i, :len(r["completion_ids"])].tolist() for i, r in enumerate(rows)]

    first = [r for r in train if r["step"] == 1 and "logprob" in r["tokens"]]
    assert first, "step 1 trained no sample"
    for r, lp in zip(first, logprobs_under(load_model(tiny_model_dir)[0], first)):
        assert r["tokens"]["logprob"] == pytest.approx(lp, abs=2e-4)
        assert r["tokens"]["ref_logprob"] == pytest.approx(lp, abs=2e-4)
        assert r["tokens"]["old_logprob"] == r["tokens"]["logprob"]  # (one update: pi_old = pi)
    last = [r for r in train if r["step"] == 2 and "new_logprob" in r["tokens"]]
    assert last, "step 2 trained no sample"
    for r, lp in zip(last, logprobs_under(load_model(str(out / "model"))[0], last)):
        assert r["tokens"]["new_logprob"] == pytest.approx(lp, abs=2e-4)


@pytest.mark.parametrize("task", [[], ["--data", "multiply", "--max-new-tokens", "32",
                                          "--max-episode-tokens", "64"]],
                         ids=["completions", "episodes"])
def test_replay_reproduces_the_run_exactly(tiny_model_dir, tmp_path, task):
    """--replay trains on the saved samples: same losses, same final weights, to the bit (fp32);
    episodes (the calculator task) too, their masks and turns rebuilt from the log."""
    from model import load_model
    original, replay = tmp_path / "original", tmp_path / "replay"
    run_grpo(small_run_args(tiny_model_dir, original) + ["--steps", "3"] + task)
    run_grpo(small_run_args(tiny_model_dir, replay) + ["--steps", "3", "--replay", str(original)]
             + task)
    keys = ("loss", "grad_norm", "kl", "reward", "accuracy", "trained_frac")
    assert [{k: r.get(k) for k in keys} for r in read_metrics(replay)] == \
        [{k: r.get(k) for k in keys} for r in read_metrics(original)]
    a, b = load_model(str(original / "model"))[0], load_model(str(replay / "model"))[0]
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    assert [r["completion_ids"] for r in _train(replay)] == \
        [r["completion_ids"] for r in _train(original)]


def test_a_replay_that_cannot_be_stops_in_one_line(two_steps, tmp_path):
    """No log there, too few steps in it, another group size, its own --out: one line each, before
    any model loads (--model points nowhere: reaching the load would fail otherwise)."""
    import shutil
    import grpo
    from cli import parse_config
    original = tmp_path / "original"
    shutil.copytree(two_steps, original)  # (a 2-step run's folder; its log is damaged below)
    base = small_run_args("no/such/model", tmp_path / "b")
    for extra, message in [(["--replay", str(tmp_path)], "no rollouts.jsonl there"),
                           (["--replay", str(original), "--steps", "3"],
                            "has no samples of step 3 (it holds steps 1-2)"),
                           (["--replay", str(original), "--steps", "2", "--num-generations", "2"],
                            "groups are not of --num-generations 2"),
                           (["--replay", str(original), "--steps", "2", "--out", str(original)],
                            "is this run's own --out")]:
        with pytest.raises(SystemExit, match=re.escape(message)):
            grpo.main(parse_config(grpo.Config, base + extra))
    assert len(_train(original)) == 16  # (the refused runs left it alone)
    lines = (original / "rollouts.jsonl").read_text().splitlines()
    (original / "rollouts.jsonl").write_text(lines[0].replace('"v": 1', '"v": 9') + "\n")
    with pytest.raises(SystemExit, match="line 1: rollouts of format 9"):
        grpo.main(parse_config(grpo.Config, base + ["--replay", str(original), "--steps", "1"]))


def test_new_logprob_computes_each_distinct_row_once_and_copies_it(tiny_model_dir):
    """Rows 0 and 2 are the same sample (prompt and completion), row 3 shares the prompt only: all
    four get the log-probs a plain forward of each row alone gives."""
    from conftest import make_batch
    from dataclasses import replace
    from grpo import Config
    from logprobs import completion_logprobs, pack
    from rollout_log import detail_index
    from trainer import UpdateStats, logprobs_after_update, setup_trainer
    trainer = setup_trainer(Config(model=tiny_model_dir, data="arith", dtype="fp32"))
    prompts, completions = [[5, 6, 7], [9, 10], [5, 6, 7], [5, 6, 7]], [[1, 2], [3], [1, 2], [4]]
    batch = replace(make_batch(prompts, completions, [1.0, -1.0, 1.0, -1.0]),
                    detail=detail_index(4, [0, 1, 2, 3]))
    keep = torch.arange(4)
    stats = UpdateStats(trainer, batch, keep)
    logprobs_after_update(trainer, batch, torch.ones(4, dtype=torch.bool), stats)
    for i in range(4):
        ids, prompt_lens, lens = pack([prompts[i]], [completions[i]], pad_id=2)
        with torch.no_grad():
            alone = completion_logprobs(trainer.model, ids, prompt_lens, lens,
                                        temperature=trainer.cfg.temperature)[0][0]
        assert stats.raw["token_detail"][i]["new_logprob"] == pytest.approx(alone.tolist(),
                                                                            abs=1e-5)


@pytest.mark.parametrize("budget", [{"max_tokens_per_microbatch": 12}, {"micro_batch_size": 2}])
def test_new_logprob_runs_in_the_updates_micro_batches(tiny_model_dir, budget, monkeypatch):
    """new_logprob's pass is cut as the update's are (trainer.micro_batches: by padded tokens or
    by count), not one pass over every logged row (on a GPU ~14 GB at once for one group of
    16 x 24K tokens): no forward holds more than the budget, each distinct row runs once, and
    every row -- its repeats too, which may fall in any micro-batch -- gets the log-probs of one
    pass over all of them."""
    import trainer as trainer_module
    from conftest import make_batch
    from dataclasses import replace
    from grpo import Config
    from logprobs import completion_logprobs
    from rollout_log import detail_index
    from trainer import UpdateStats, logprobs_after_update, setup_trainer
    trainer = setup_trainer(Config(model=tiny_model_dir, data="arith", dtype="fp32", **budget))
    # Lengths 5, 3, 5, 4, 7, 3: rows 2 and 5 repeat rows 0 and 1
    prompts = [[5, 6, 7], [9, 10], [5, 6, 7], [5, 6, 7], [11, 12, 13, 14], [9, 10]]
    completions = [[1, 2], [3], [1, 2], [4], [15, 16, 17], [3]]
    batch = replace(make_batch(prompts, completions, [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]),
                    detail=detail_index(6, list(range(6))))
    with torch.no_grad():
        lp, _ = completion_logprobs(trainer.compute, batch.input_ids, batch.prompt_lens,
                                    batch.completion_lens, temperature=trainer.cfg.temperature)
    passes = []  # (rows, tokens) of each forward
    real = trainer_module.completion_logprobs

    def spy(model, input_ids, *args, **kwargs):
        passes.append(tuple(input_ids.shape))
        return real(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "completion_logprobs", spy)
    stats = UpdateStats(trainer, batch, torch.arange(6))
    logprobs_after_update(trainer, batch, torch.ones(6, dtype=torch.bool), stats)
    assert sum(rows for rows, _ in passes) == 4  # each distinct row once
    if "micro_batch_size" in budget:
        assert all(rows <= 2 for rows, _ in passes), passes
    else:
        assert all(rows * tokens <= 12 for rows, tokens in passes), passes
    for i in range(6):
        n = len(completions[i])
        assert stats.raw["token_detail"][i]["new_logprob"] == pytest.approx(lp[i, :n].tolist(),
                                                                            abs=1e-5)


def test_a_bf16_run_logs_what_its_bf16_update_read(tiny_model_dir, tmp_path):
    """In bf16 (the trainer's bf16 copy) the log still holds the update's own numbers: at step 1
    the reference computes exactly as the policy does (trainer.computing_like), so their saved
    log-probs are equal, and the update moved new_logprob away from them."""
    out = tmp_path / "bf16"
    run_grpo(small_run_args(tiny_model_dir, out) + ["--steps", "1", "--dtype", "bf16",
                                                   "--num-generations", "2",
                                                   "--rollout-tokens", "-1"])
    trained = [r["tokens"] for r in _train(out) if "logprob" in r.get("tokens", {})]
    assert trained, "step 1 trained no sample"
    assert all(t["ref_logprob"] == t["logprob"] for t in trained)
    assert any(t["new_logprob"] != t["logprob"] for t in trained)


def test_the_format_round_trips_what_replay_needs(tmp_path, tokenizer):
    """A step written and read back gives replay the same completions -- ids, masks, truncation,
    the engine's float32 log-probs to the bit --, rewards, scores and which samples were kept."""
    from types import SimpleNamespace
    from rl import Scored, replayed
    from rollout_log import RolloutLog, saved_steps
    from sampling import Completions
    lps = torch.randn(4, 3).tolist()  # float32 values, as an engine returns them
    comps = Completions([[1, 2]] * 4, [[5, 6, 7]] * 4, [False, True, False, False],
                        ["a", "b", "c", "d"], lps, policy_version=3,
                        mask=[[True, False, True]] * 4)
    scored = Scored([{"problem": "p", "answer": "1"}] * 4, comps,
                    torch.tensor([1.0, 0.0, 0.5, 0.0]), [1.0, 0.0, 0.0, 0.0],
                    {"correctness": [1.0, 0.0, None, 0.0]})
    log = RolloutLog(tmp_path, 0)
    log.train(1, scored, 2, tokenizer, kept=[True, True, False, False],
              advantages=torch.tensor([0.7, -0.7]))
    session = SimpleNamespace(replay=saved_steps(str(tmp_path), 2, 1))
    sampled, trained, kept = replayed(session, 1)
    assert kept == [True, True, False, False]
    for name in ("prompt_ids", "completion_ids", "truncated", "text", "engine_logprobs", "mask"):
        assert getattr(sampled.completions, name) == getattr(comps, name), name
    assert sampled.completions.policy_version == 3
    assert torch.equal(sampled.rewards, scored.rewards) and sampled.per_fn == scored.per_fn
    assert trained.completions.text == ["a", "b"] and sampled.correct == scored.correct
    advantages = [r["advantage"] for r in _train(tmp_path)]
    assert advantages == [pytest.approx(0.7), pytest.approx(-0.7), None, None]


# ---------------------------------------------------------------------------------------------
# The log as a run folder holds it: kept whole, never followed, checked before a model loads
# (issue 55: 9, 10, 12).


def _no_model(monkeypatch):
    import rl
    monkeypatch.setattr(rl, "setup_local", lambda *a: pytest.fail("the model was loaded"))


class _DiskFull:
    """A file whose writes fail once `room` characters are written: a full disk."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, text):
        if len(text) > self.room:
            self.f.write(text[:self.room])
            self.f.flush()
            raise OSError(28, "No space left on device")
        self.room -= len(text)
        return self.f.write(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_resume_that_cannot_write_its_log_leaves_the_old_one_whole(tmp_path, monkeypatch):
    """Resumed at step 2, the log is cut back to steps 1-2 in a new file renamed over the old
    one: a disk that fills half way through leaves every byte of the old log (it was truncated,
    then written: the kept steps were lost)."""
    import builtins
    import rollout_log
    from rollout_log import RolloutLog
    log = tmp_path / "rollouts.jsonl"
    log.write_text("".join(json.dumps({"v": 1, "kind": "eval", "step": s, "id": i,
                                       "completion": "x" * 100, "correct": 1.0}) + "\n"
                           for s in (1, 2, 3) for i in range(5)))
    before = log.read_bytes()
    real_open = builtins.open
    monkeypatch.setattr(rollout_log, "open", lambda *a, **k: _DiskFull(real_open(*a, **k), 500)
                        if set("wxa") & set((a[1:2] or (k.get("mode", "r"),))[0])
                        else real_open(*a, **k), raising=False)
    with pytest.raises((OSError, SystemExit), match="No space left on device"):
        RolloutLog(tmp_path, resumed_at=2)
    assert log.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["rollouts.jsonl"]  # no half-written file
    monkeypatch.undo()
    RolloutLog(tmp_path, resumed_at=2)
    assert log.read_bytes() == b"".join(before.splitlines(keepends=True)[:10])


def test_a_resume_that_cannot_write_its_metrics_leaves_the_old_ones_whole(tmp_path,
                                                                          monkeypatch):
    """metrics.jsonl, rewritten from the checkpoint's history on a resume, likewise: in a new
    file renamed over the old one (it was truncated, then written)."""
    import builtins
    import evaluate
    metrics = tmp_path / "metrics.jsonl"
    history = [{"step": s, "reward": 0.5, "note": "x" * 100} for s in range(6)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in history))
    before = metrics.read_bytes()
    real_open = builtins.open
    monkeypatch.setattr(evaluate, "open", lambda *a, **k: _DiskFull(real_open(*a, **k), 300)
                        if set("wxa") & set((a[1:2] or (k.get("mode", "r"),))[0])
                        else real_open(*a, **k), raising=False)
    with pytest.raises(OSError, match="No space left on device"):
        evaluate.RunLog(tmp_path, history[:3])
    assert metrics.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no half-written file
    monkeypatch.undo()
    evaluate.RunLog(tmp_path, history[:3])
    assert metrics.read_bytes() == b"".join(before.splitlines(keepends=True)[:3])


@pytest.mark.parametrize("name", ["rollouts.jsonl", "metrics.jsonl", "report.html",
                                  "curves.png", "grpo_config.json"])
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_link_or_a_fifo_in_place_of_a_run_file_is_refused(tmp_path, monkeypatch, name, kind):
    """A run writes its own files in --out and follows nothing there: a symlink (a fresh run
    emptied its target) or a FIFO (the run blocked forever) is refused in one line before any
    model loads, and left as it was."""
    import os
    import grpo
    from cli import parse_config
    _no_model(monkeypatch)
    out, target = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    target.write_text("a user's file")
    if kind == "symlink":
        (out / name).symlink_to(target)
    else:
        os.mkfifo(out / name)
    what = "a symbolic link" if kind == "symlink" else "a FIFO"
    with pytest.raises(SystemExit, match=rf"^error: {re.escape(str(out / name))} is {what}, not "
                                         rf"a file: .* \(nothing was changed\)$"):
        grpo.main(parse_config(grpo.Config, ["--data", "arith", "--out", str(out)]))
    assert target.read_text() == "a user's file"
    assert (out / name).is_symlink() if kind == "symlink" else (out / name).is_fifo()


@pytest.fixture(scope="module")
def two_steps(tiny_model_dir, tmp_path_factory):
    """A 2-step run's folder, to replay (copied before a test damages its log)."""
    out = tmp_path_factory.mktemp("two") / "run"
    run_grpo(small_run_args(tiny_model_dir, out) + ["--steps", "2"])
    return out


def _damaged(two_steps, tmp_path, damage) -> tuple:
    """A copy of two_steps' log with damage(lines) done to its lines."""
    import shutil
    folder = tmp_path / "damaged"
    shutil.copytree(two_steps, folder)
    log = folder / "rollouts.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    damage(lines)
    log.write_text("".join(lines))
    return folder, log


def _edit(n: int, **changes):
    def damage(lines):
        r = json.loads(lines[n - 1])
        r.update({k: v for k, v in changes.items() if v is not ...})
        for k in [k for k, v in changes.items() if v is ...]:
            del r[k]
        lines[n - 1] = json.dumps(r) + "\n"
    return damage


def _put(n: int, text: str):
    def damage(lines):
        lines[n - 1] = text
    return damage


@pytest.mark.parametrize("damage, where", [
    (_put(3, "[1, 2, 3]\n"), "line 3: not a JSON object"),
    (_put(4, '{"v": 1, "kind": "train", "st\n'), "line 4: not JSON"),
    (_edit(2, completion_ids=...), "line 2, field completion_ids: missing"),
    (_edit(12, completion_ids=[5, 49152]), "line 12, field completion_ids: token id 49152 is "
                                            "past the vocabulary"),
    (_edit(5, prompt_ids=[1, -3]), "line 5, field prompt_ids: token id -3"),
    (_edit(6, reward="high"), "line 6, field reward: not a number"),
    (_edit(7, kept="yes"), "line 7, field kept: not true or false"),
    (_edit(9, step="two"), "line 9, field step: not a whole number"),
    (_edit(10, row=[1]), "line 10, field row: not an object"),
    (_edit(11, mask=[1] * 7), "line 11, field mask: 7 values for"),
    (_edit(13, kind="training"), "line 13, field kind: 'training'"),
], ids=["array", "cut", "no-ids", "vocabulary", "negative", "reward", "kept", "step", "row",
        "mask", "kind"])
def test_a_damaged_log_stops_replay_in_one_line_before_any_model_loads(
        tiny_model_dir, two_steps, tmp_path, monkeypatch, damage, where):
    """Every record a replay reads is checked once, before any model loads, and the first
    damage is named in one line -- the file, the line, the field (a token id past the
    vocabulary trained step 1 and crashed at step 2; a missing field, a line that is not an
    object: a crash mid-run)."""
    import grpo
    from cli import parse_config
    _no_model(monkeypatch)
    folder, log = _damaged(two_steps, tmp_path, damage)
    args = small_run_args(tiny_model_dir, tmp_path / "replay") + ["--steps", "2", "--replay",
                                                                   str(folder)]
    with pytest.raises(SystemExit, match=rf"^error: --replay {re.escape(str(folder))}: "
                                         rf"{re.escape(str(log))}, {re.escape(where)}"):
        grpo.main(parse_config(grpo.Config, args))


def test_replay_and_resume_drop_a_cut_last_line_and_say_so(tiny_model_dir, two_steps,
                                                           tmp_path, capsys):
    """A killed write leaves a cut last line: --replay of the steps before it and --resume
    drop it as a crash remnant and say so (they ended in JSONDecodeError, --resume after the
    model had loaded)."""
    folder, log = _damaged(two_steps, tmp_path, lambda lines: lines.append(lines[-1][:40]))
    result = run_grpo(small_run_args(tiny_model_dir, tmp_path / "replay") + [
        "--steps", "2", "--replay", str(folder)])
    assert f"{log}, line 17: cut short (a killed write): left out" in result.stdout
    out = tmp_path / "resumed"
    run_grpo(small_run_args(tiny_model_dir, out) + ["--steps", "3", "--save-every", "2"])
    whole = (out / "rollouts.jsonl").read_text()
    with open(out / "rollouts.jsonl", "a") as f:
        f.write('{"v": 1, "kind": "train", "step": 4, "ind')
    result = run_grpo(small_run_args(tiny_model_dir, out) + ["--steps", "3", "--resume", "auto"])
    [aside] = (out / "superseded").iterdir()  # (the finished run, past step_2: run_folder.py)
    assert f"{aside / 'rollouts.jsonl'}, line 25: cut short (a killed write): left out" \
        in result.stdout
    assert (out / "rollouts.jsonl").read_text() == whole


def test_a_damaged_log_stops_a_resume_in_one_line_before_any_model_loads(
        tiny_model_dir, tmp_path, monkeypatch):
    """A damaged line that is not the last one is no crash remnant: a resume stops at once,
    naming it, and says how to go on without the log."""
    import grpo
    from cli import parse_config
    out = tmp_path / "run"
    run_grpo(small_run_args(tiny_model_dir, out) + ["--steps", "2", "--save-every", "2"])
    lines = (out / "rollouts.jsonl").read_text().splitlines(keepends=True)
    lines[3] = lines[3][:30] + "\n"
    (out / "rollouts.jsonl").write_text("".join(lines))
    _no_model(monkeypatch)
    log = out / "rollouts.jsonl"
    with pytest.raises(SystemExit, match=rf"^error: {re.escape(str(log))}, line 4: not JSON .*"
                                         rf"move the file away to resume without its samples$"):
        grpo.main(parse_config(grpo.Config, small_run_args(tiny_model_dir, out) + [
            "--steps", "3", "--resume", "auto"]))
    assert (out / "rollouts.jsonl").read_text() == "".join(lines)


OSC52 = "\x1b]52;c;ZWNobyBwd25lZA==\x07"  # a terminal's clipboard write


def _record(**changes) -> dict:
    r = {"v": 1, "kind": "train", "step": 1, "index": 0, "group": 0, "sample": 0, "kept": True,
         "row": {"problem": "p"}, "prompt_ids": [1], "completion_ids": [2, 3], "completion": "c",
         "truncated": False, "policy_version": 0, "reward": 1.0, "rewards": {}, "correct": None,
         "advantage": 0.5}
    return {**r, **changes}


@pytest.mark.parametrize("line, said", [
    (json.dumps(_record(v=OSC52)), "line 1: rollouts of format \\x1b]52;c;ZWNobyBwd25lZA==\\x07, "),
    (json.dumps(_record(tokens={f"{OSC52}\nx": [1]})),
     "line 1, field tokens.\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\nx: 1 values for 2"),
    ('{"v": 1, "step": ' + "9" * 5000 + "}", "line 1: not JSON (Exceeds the limit (4300 digits) "
                                             "for integer string conversion"),
    ("[" * 100_000 + "]" * 100_000, "line 1: not JSON (nested too deeply)"),
], ids=["format", "field name", "huge number", "deep"])
def test_a_crafted_log_is_refused_in_one_printable_line(tmp_path, line, said):
    """What a crafted log holds reaches the refusal escaped -- an escape sequence in its format
    field or a field's name (a clipboard write, OSC 52) shows as text, never reaches the terminal
    as such -- and what json cannot read (a number of 5,000 digits, arrays nested 100,000 deep)
    is one line too, not a traceback."""
    from rollout_log import check_log
    log = tmp_path / "rollouts.jsonl"
    log.write_text(line + "\n" + json.dumps(_record()) + "\n")
    with pytest.raises(SystemExit) as stop:
        check_log(log)
    message = str(stop.value)
    assert message.startswith(f"error: {log}, {said}"), message
    assert message.isprintable()


def test_bytes_that_are_not_utf8_are_refused_in_one_line_or_cut_short(tmp_path):
    """A line of bytes that are not UTF-8 (a crafted log; a disk's damage) is named -- the file,
    the line, the byte -- in one printable line (it was UnicodeDecodeError's traceback, in
    report.py, a resume and --replay); a last line cut inside a character (a killed write) is a
    crash remnant, left out and said."""
    from rollout_log import check_log, json_lines
    log = tmp_path / "rollouts.jsonl"
    line = json.dumps(_record()).encode()
    log.write_bytes(line + b"\n" + line.replace(b'"c"', b'"\xff\x1b]52;c;eA==\x07"') + b"\n")
    with pytest.raises(SystemExit) as stop:
        check_log(log)
    message = str(stop.value)
    assert message.startswith(f"error: {log}, line 2: not UTF-8 (byte 0xff at offset "), message
    assert message.isprintable()
    last = json.dumps(_record(completion="é"), ensure_ascii=False).encode()
    log.write_bytes(line + b"\n" + last[:last.index(b"\xc3") + 1])
    said = []
    assert [n for n, _, _ in json_lines(log, said.append)] == [1]
    assert said == [f"{log}, line 2: cut short (a killed write): left out"]


def test_the_groups_shown_token_by_token_and_first_are_those_the_update_trained():
    """A group trains where its advantages are not 0: with --adv-scale unit an all-wrong group
    does (each sample -1), though its rewards are all alike -- it is kept token by token and shown
    among the trained ones, not last (helper-26); a group of GRPO's with no reward spread is not."""
    from grpo import group_advantages, unit_advantages
    from report import step_entry
    from rollout_log import detail_samples
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert detail_samples(rewards, group_advantages(rewards, 4), 4, 1) == [4, 5, 6, 7]
    assert detail_samples(rewards, unit_advantages(rewards), 4, 1) == [0, 1, 2, 3]
    assert detail_samples(rewards, torch.zeros(12), 4, 1) == [4, 5, 6, 7]  # (ppo.py: per token)
    for advantages, first in ((unit_advantages(rewards), [0, 1, 2]), (group_advantages(rewards, 4),
                                                                       [1, 0, 2])):
        views = [(i // 4, {}, {"reward": float(r), "advantage": float(a)})
                 for i, (r, a) in enumerate(zip(rewards, advantages))]
        assert [g["index"] for g in step_entry(1, views)["groups"]] == first
