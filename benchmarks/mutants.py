"""Does the test suite catch plausible one-line bugs? A mutation pass by hand-written mutants.

    .venv/bin/python benchmarks/mutants.py                  # every mutant (~1 h on 2 busy cores)
    .venv/bin/python benchmarks/mutants.py --only dpo.py    # those whose name or file has "dpo.py"
    .venv/bin/python benchmarks/mutants.py --list           # the mutants, without running them
    .venv/bin/python benchmarks/mutants.py --check          # each snippet still occurs exactly once
    .venv/bin/python benchmarks/mutants.py --pinned-only    # each new test kills its mutants

Each mutant is one small edit of one file -- the bug someone could plausibly write or a refactor
could introduce -- with the tests that exercise that code: the one expected to fail first, then the
rest of the area's fast tests (pytest -x stops at the first failure, so a killed mutant costs one
test; a survivor runs them all). The tests of tests/test_pinned.py written for a mutant (`pinned`)
run only if it survives the others: the table then says which new test kills it. A mutant marked
`equivalent` changes nothing any caller can observe (the reason is given); it is run all the same,
to confirm that it survives.

The working tree is never written: its files (git ls-files: tracked, and untracked but not
ignored) are copied once to a temporary folder, where each mutant is applied, its tests run with a
timeout, and the file restored. Before any mutant, every test named below must pass there
unmutated. PYTHONDONTWRITEBYTECODE=1: no stale .pyc of a mutated file can outlive it.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutant:
    name: str
    file: str
    old: str  # occurs exactly once in `file`
    new: str
    bug: str  # the bug it stands for, in one line
    tests: list  # pytest node ids: the expected killer first, then the area's other fast tests
    pinned: tuple = ()  # tests/test_pinned.py tests written for it, run if it survives `tests`
    equivalent: str = ""  # why no caller can tell it apart (it should survive)
    skip: str = ""  # why it is not run here


# ---------------------------------------------------------------------------------------------
# Test sets: the fast tests of each area (no grpo.py / dpo.py training runs in a subprocess).

TS, TM, TR, TC, TD, TE = (f"tests/test_{n}.py::" for n in ("train_step", "model", "rollout",
                                                            "checkpoint", "dpo", "env"))
PIN = "tests/test_pinned.py::"
LOSS = ["tests/test_grpo_loss.py"]
TRAIN = [TS + n for n in (
    "test_skipping_zero_advantage_sequences_changes_neither_loss_nor_gradient",
    "test_kl_is_zero_before_the_first_update", "test_engine_mismatch_covers_every_sampled_token",
    "test_a_non_finite_step_leaves_the_weights_alone",
    "test_one_trainer_issues_no_collective_even_inside_a_process_group",
    "test_overlong_filtered_sample_has_zero_weight",
    "test_token_budget_micro_batches_leave_loss_and_gradient_unchanged",
    "test_bf16_copy_sums_micro_batches_in_fp32_and_takes_the_new_master_weights",
    "test_a_skipped_update_leaves_the_applied_ones_metrics_whole")] + \
    [TE + "test_observation_tokens_get_no_gradient"] + LOSS
MODEL = ["tests/test_model.py", TR + "test_completion_logprobs_match_full_log_softmax",
         TR + "test_pack_and_mask_from_lengths_with_pad_equal_eos",
         TC + "test_an_export_replaces_the_model_folder_whole",
         TC + "test_the_trained_model_is_saved_in_the_dtype_it_came_in"]
ROLLOUT = ["tests/test_rollout.py", TE + "test_an_episode_on_the_hf_engine"]
CHECKPOINT = [TC + n for n in (
    "test_a_run_prunes_only_its_own_checkpoints", "test_keep_last_zero_keeps_every_checkpoint",
    "test_checkpoint_state_loads_weights_only", "test_a_damaged_checkpoint_is_named",
    "test_a_fresh_run_refuses_a_folder_with_another_runs_checkpoints",  # (stop before the model)
    "test_a_crafted_checkpoint_cannot_run_code")]
DPO = [TD + n for n in (
    "test_sigmoid_loss_and_rewards", "test_label_smoothing_cdpo", "test_hinge_ipo_robust",
    "test_gradient_raises_chosen_and_lowers_rejected", "test_prompt_tokens_do_not_change_the_loss",
    "test_micro_batching_leaves_loss_and_gradient_unchanged", "test_other_column_names",
    "test_too_long_prompt_is_skipped_and_counted_and_long_pairs_keep_the_response")]
DAPO = LOSS + [TS + "test_overlong_filtered_sample_has_zero_weight",
               TE + "test_observation_tokens_get_no_gradient",
               "tests/test_grpo_e2e.py::test_dynamic_sampling_never_loops_forever",
               "tests/test_grpo_e2e.py::test_dynamic_sampling_fills_the_batch"]
EPISODES = [TE + n for n in (
    "test_bad_tool_calls_are_answered_with_errors_and_counted",
    "test_an_episode_continues_from_the_ids_it_sampled_and_masks_the_observations",
    "test_the_environment_answers_and_scores_an_episode",
    "test_observation_tokens_get_no_gradient", "test_an_episode_on_the_hf_engine")]
TB = "tests/test_sandbox.py::"
SANDBOX = ["tests/test_sandbox.py"]  # (the whole file: about 15 s)


def first(*killers, then):
    """The expected killers, then the area's tests (each once, in order; run() runs the named
    tests in a pytest of their own first)."""
    return list(dict.fromkeys([*killers, *then]))


# ---------------------------------------------------------------------------------------------
# The mutants.

MUTANTS = [
    # --- grpo.py, --async-steps 1 (issue 30) ---
    Mutant("async-pi-old-on-policy", "grpo.py",
           "old = batch.engine_logprobs[idx][:, :logprobs.shape[1]]  # policy, per the engine",
           "old = logprobs.detach()  # policy, per the engine",
           "async GRPO silently on-policy: pi_old = the current policy, ratio 1, no clipping",
           TRAIN, pinned=(PIN + "test_async_ratio_uses_the_engines_logprobs_as_pi_old",)),
    Mutant("async-engine-rows", "grpo.py",
           "old = batch.engine_logprobs[idx][:, :logprobs.shape[1]]  # policy, per the engine",
           "old = batch.engine_logprobs[:len(idx), :logprobs.shape[1]]  # policy, per the engine",
           "pi_old of the batch's first rows, not of the micro-batch's",
           TRAIN, pinned=(PIN + "test_async_ratio_uses_the_engines_logprobs_as_pi_old",)),

    # --- logprobs.py, model.py, hardware.py: log-probs, sharing, masks, saving, the dtype ---
    Mutant("head-temperature-multiplied", "logprobs.py",
           "return z.mul_(scale / temperature)", "return z.mul_(scale * temperature)",
           "the linear head's logits multiplied by T instead of divided",
           first(TR + "test_completion_logprobs_match_full_log_softmax", then=MODEL)),
    Mutant("autograd-head-no-temperature", "logprobs.py",
           "logits = head_logits(model, hidden) / temperature  # (n, V) fp32",
           "logits = head_logits(model, hidden)  # (n, V) fp32",
           "other heads (bias, soft-capping) ignore the sampling temperature",
           first(TM + "test_completion_logprobs_of_a_bigram_model_by_hand", then=MODEL)),
    Mutant("head-backward-onehot-sign", "logprobs.py",
           "probs[torch.arange(len(probs), device=probs.device), targets] += g",
           "probs[torch.arange(len(probs), device=probs.device), targets] -= g",
           "the written-out backward subtracts the one-hot instead of adding it",
           first(TM + "test_linear_head_backward_equals_autograd", then=MODEL)),
    Mutant("head-backward-no-scale", "logprobs.py",
           "g = grad_logp * ctx.scale / ctx.temperature  # (n,)",
           "g = grad_logp / ctx.temperature  # (n,)",
           "the backward forgets logit_scale / logits_scaling",
           first(TM + "test_linear_head_backward_equals_autograd", then=MODEL)),
    Mutant("entropy-sign", "logprobs.py",
           "entropy = log_total - e.mul_(z).sum(-1) / total",
           "entropy = log_total + e.mul_(z).sum(-1) / total",
           "entropy computed with the wrong sign of E[z]",
           first(TR + "test_completion_logprobs_match_full_log_softmax", then=MODEL)),
    Mutant("state-not-shifted", "logprobs.py",
           "hidden = hidden[rows, pos - 1]  # (n, H)", "hidden = hidden[rows, pos]  # (n, H)",
           "token t read from the state at t (which has seen it), not t - 1",
           first(TR + "test_completion_logprobs_match_full_log_softmax", then=MODEL)),
    Mutant("shared-first-state", "logprobs.py",
           "state[b, :min(n, 1)] = start + P - 1", "state[b, :min(n, 1)] = start + P",
           "a shared prompt's first completion token read from the wrong state",
           first(TM + "test_a_shared_prompt_gives_every_completion_its_own_rows_logprobs",
                 then=MODEL)),
    Mutant("shared-mask-sees-siblings", "logprobs.py",
           "((k == 0) | (k == q))", "(k <= q)",
           "a completion attends to the completions packed before it",
           first(TM + "test_a_shared_prompt_gives_every_completion_its_own_rows_logprobs",
                 then=MODEL)),
    Mutant("shared-positions-run-on", "logprobs.py",
           "positions[r, at:at + n] = torch.arange(P, P + n)",
           "positions[r, at:at + n] = torch.arange(at, at + n)",
           "packed completions' positions continue from the previous completion",
           first(TM + "test_a_shared_prompt_gives_every_completion_its_own_rows_logprobs",
                 then=MODEL)),
    Mutant("prefix-layout-sees-next", "attention.py",
           "sees_own = (j[None, None, :] <= j[None, :, None])",
           "sees_own = (j[None, None, :] <= j[None, :, None] + 1)",
           "smolrl's prefix-shared attention lets a completion token see the next one",
           first(TM + "test_a_shared_prompt_gives_every_completion_its_own_rows_logprobs",
                 then=MODEL)),
    Mutant("prefix-layout-longest-prompt", "attention.py",
           "sees_prompt = (i[None, None, :] < P_of[:, None, None])",
           "sees_prompt = (i[None, None, :] < P)",
           "a completion after a shorter prompt sees the longest prompt's worth of its row",
           first(TM + "test_a_shared_prompt_gives_every_completion_its_own_rows_logprobs",
                 then=MODEL)),
    Mutant("small-attention-ungrouped", "attention.py",
           "p = _probs(q.reshape(B, KV, H // KV * n, D), k, mask, scaling)",
           "p = _probs(q.transpose(1, 2).reshape(B, KV, H // KV * n, D), k, mask, scaling)",
           "short rows' attention groups query heads and positions wrongly",
           first(TM + "test_a_shared_prompt_gives_every_completion_its_own_rows_logprobs",
                 then=MODEL)),
    Mutant("small-attention-backward-no-rowsum", "attention.py",
           "return dp.sub_(rowsum).mul_(p).mul_(scaling)",
           "return dp.mul_(p).mul_(scaling)",
           "the recomputed attention's backward forgets the softmax's row-sum term",
           first(TM + "test_small_attention_recomputes_in_its_backward_the_gradients_sdpa_gives",
                 then=MODEL)),
    Mutant("length-mask-inclusive", "logprobs.py",
           "return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]",
           "return torch.arange(T, device=lengths.device)[None, :] <= lengths[:, None]",
           "masks one token too long: padding (pad == eos) trained",
           first(TR + "test_pack_and_mask_from_lengths_with_pad_equal_eos", then=MODEL)),
    Mutant("rope-buffers-cast", "model.py",
           "    for p in model.parameters():\n        p.data = p.data.to(dtype)",
           "    for p in itertools.chain(model.parameters(), model.buffers()):\n"
           "        p.data = p.data.to(dtype)",
           "cast_parameters casts the buffers too: RoPE's inv_freq in bf16",
           first(TM + "test_bf16_engine_keeps_rope_in_fp32_far_into_the_sequence", then=MODEL)),
    Mutant("stop-ids-drop-lists", "model.py",
           "ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}",
           "ids |= set() if isinstance(eos, (list, tuple)) else {eos}",
           "a generation config's list of eos ids ignored",
           first(TR + "test_every_eos_id_stops_without_truncation", then=ROLLOUT)),
    Mutant("save-config-dtype-kept", "model.py",
           "if dtype is not None and state_dict:  # save_pretrained writes",
           "if False:  # save_pretrained writes",
           "a bf16 export's config.json still says float32",
           first(TC + "test_the_trained_model_is_saved_in_the_dtype_it_came_in", then=MODEL)),
    Mutant("replace-leaves-old", "model.py",
           "        shutil.rmtree(old, ignore_errors=True)\n\n\n# ----",
           "        pass\n\n\n# ----",
           "replace_folder never deletes the old folder it set aside",
           first(TC + "test_an_export_replaces_the_model_folder_whole", then=MODEL)),
    Mutant("replace-deletes-first", "model.py",
           "os.replace(target, old / target.name)", "shutil.rmtree(target)",
           "the old folder deleted before the new one is in place: a crash leaves neither",
           MODEL,
           pinned=(PIN + "test_a_folder_swap_that_fails_halfway_leaves_the_old_folder_whole",)),
    Mutant("dtype-slower-wins", "hardware.py",
           'name = "bf16" if bf16 >= BF16_MARGIN * fp32 else "fp32"',
           'name = "bf16" if bf16 < fp32 else "fp32"',
           "--dtype auto picks the slower kind (emulated bf16 on an AVX2 laptop)",
           MODEL + ["tests/test_gpu_memory.py"],
           pinned=(PIN + "test_choose_dtype_on_a_cpu_takes_bf16_only_by_a_clear_margin",)),
    Mutant("dtype-no-margin", "hardware.py",
           'name = "bf16" if bf16 >= BF16_MARGIN * fp32 else "fp32"',
           'name = "bf16" if bf16 > fp32 else "fp32"',
           "--dtype auto flips between launches when the two rates are close (a loaded machine)",
           MODEL, pinned=(PIN + "test_choose_dtype_on_a_cpu_takes_bf16_only_by_a_clear_margin",)),
    Mutant("dtype-resume-retimed", "hardware.py",
           "    if recorded in DTYPES:", "    if False:",
           "a resumed run times the matmuls again and may change dtype half-way", MODEL,
           pinned=(PIN + "test_a_resumed_run_computes_in_the_dtype_it_recorded",)),

    # --- trainer.py: micro-batches, the engine's correction, the step, the bookkeeping ---
    Mutant("micro-batch-drops-one", "trainer.py",
           "keep[s:s + cfg.micro_batch_size] for s", "keep[s:s + cfg.micro_batch_size - 1] for s",
           "every micro-batch loses its last sequence",
           first(TS + "test_skipping_zero_advantage_sequences_changes_neither_loss_nor_gradient",
                 then=TRAIN)),
    Mutant("token-budget-inclusive", "trainer.py",
           "int(seq_lens[current[0]]) > cfg.max_tokens_per_microbatch",
           "int(seq_lens[current[0]]) >= cfg.max_tokens_per_microbatch",
           "a micro-batch that exactly fills the token budget is split",
           first("tests/test_grpo_loss.py::test_token_budget_micro_batches_respect_the_budget",
                 then=TRAIN)),
    Mutant("is-cap-inverted", "trainer.py",
           "torch.exp(old - engine).clamp(max=is_cap)",
           "torch.exp(engine - old).clamp(max=is_cap)",
           "--is-cap weights pi_engine / pi_old instead of pi_old / pi_engine",
           TRAIN,
           pinned=(PIN + "test_is_cap_weights_are_the_truncated_ratio_of_trainer_to_engine",)),
    Mutant("correction-engine-rows", "trainer.py",
           "engine = batch.engine_logprobs[idx][:, :old.shape[1]]  # (b, T)",
           "engine = batch.engine_logprobs[:len(idx), :old.shape[1]]  # (b, T)",
           "the mismatch compares a micro-batch with the batch's first rows",
           first(TS + "test_engine_mismatch_covers_every_sampled_token", then=TRAIN)),
    Mutant("master-grads-overwritten", "trainer.py",
           "master.grad.add_(p.grad)",
           "master.grad.copy_(p.grad)",
           "bf16 copy: each micro-batch's gradient replaces the sum so far",
           first(TS + "test_bf16_copy_sums_micro_batches_in_fp32_and_takes_the_new_master_weights",
                 then=TRAIN)),
    Mutant("bf16-copy-not-refreshed", "trainer.py",
           "            p.copy_(master)", "            pass",
           "the bf16 copy keeps the old weights after the optimizer step",
           first(TS + "test_bf16_copy_sums_micro_batches_in_fp32_and_takes_the_new_master_weights",
                 then=TRAIN)),
    Mutant("step-ignores-loss", "trainer.py",
           "finite = math.isfinite(grad_norm) and math.isfinite(loss)",
           "finite = math.isfinite(grad_norm)",
           "a non-finite loss with finite gradients still steps",
           first(TS + "test_a_non_finite_step_leaves_the_weights_alone", then=TRAIN),
           pinned=(PIN + "test_a_non_finite_loss_skips_the_step_even_with_finite_gradients",)),
    Mutant("grads-not-freed", "trainer.py",
           "    trainer.optimizer.zero_grad(set_to_none=True)\n    return grad_norm",
           "    return grad_norm",
           "gradients never zeroed: they pile up over steps",
           first(TS + "test_bf16_copy_sums_micro_batches_in_fp32_and_takes_the_new_master_weights",
                 then=TRAIN)),
    Mutant("stats-unweighted-metrics", "trainer.py",
           "self._sums[key] = self._sums.get(key, 0.0) + v * tokens",
           "self._sums[key] = self._sums.get(key, 0.0) + v",
           "clip fractions, KL, entropy averaged per micro-batch, then divided by tokens",
           TRAIN, pinned=(PIN + "test_the_step_reports_the_mean_of_its_updates_and_token_weighted"
                                "_metrics",)),
    Mutant("stats-loss-not-averaged", "trainer.py",
           '        self.raw["loss"] /= applied\n', "",
           "with several updates per rollout the reported loss is their sum",
           TRAIN, pinned=(PIN + "test_the_step_reports_the_mean_of_its_updates_and_token_weighted"
                                "_metrics",)),
    Mutant("any-rank-trains-always", "trainer.py",
           "trainer.group)) > 0", "trainer.group)) >= 0",
           "a batch with nothing to train still steps the optimizer and the LR schedule",
           TRAIN, pinned=(PIN + "test_a_batch_without_signal_takes_no_optimizer_step",)),
    Mutant("max-abs-diff-averaged", "trainer.py",
           'out[key] = v if key.endswith("max_abs_diff") else v / max(n, 1)',
           "out[key] = v / max(n, 1)",
           "the engine mismatch's running max divided like a sum",
           first(TS + "test_engine_mismatch_covers_every_sampled_token", then=TRAIN)),
    Mutant("reference-shares-own-verdict", "trainer.py",
           "    ref.smolrl_shares_prompts = policy.smolrl_shares_prompts\n", "",
           "a reference loaded anew (--resume) never shares prompts while the policy does",
           first(TS + "test_kl_is_zero_before_the_first_update", then=TRAIN),
           pinned=(PIN + "test_a_resumed_runs_reference_takes_the_policys_prompt_sharing"
                         "_verdict",)),
    Mutant("untrained-mismatch-inverted", "trainer.py",
           "rest = (~trained & (lens > 0)).nonzero().flatten()",
           "rest = (trained & (lens > 0)).nonzero().flatten()",
           "the mismatch counts trained sequences twice and skipped ones never",
           first(TS + "test_engine_mismatch_covers_every_sampled_token", then=TRAIN)),
    Mutant("policy-no-temperature", "trainer.py",
           "                           temperature=cfg.temperature)",
           "                           )",
           "the trainer's log-probs at T = 1 while the engine samples at T",
           first(TS + "test_skipping_zero_advantage_sequences_changes_neither_loss_nor_gradient",
                 then=TRAIN)),
    Mutant("fsdp-no-padding-passes", "trainer.py",
           "return mbs + [torch.zeros(1, dtype=torch.long, device=trainer.device)] * "
           "(most - real), real", "return mbs, real",
           "FSDP ranks with fewer micro-batches run fewer passes: the collectives hang",
           [], skip="FSDP2 needs several trainer processes on Ray "
                    "(tests/test_distributed.py::test_fsdp_two_trainers_equal_one_process)"),
    Mutant("bad-steps-one-late", "trainer.py",
           "if bad_steps >= MAX_BAD_STEPS:", "if bad_steps > MAX_BAD_STEPS:",
           "the run stops after four non-finite steps in a row, not three",
           [TS + "test_a_run_stops_after_three_non_finite_steps_in_a_row"]),

    # --- rollout.py, sampling.py: stopping, sampling, engine log-probs, shared prefix, seeds ---
    Mutant("stop-token-dropped", "sampling.py",
           "return tokens[:i + 1], False", "return tokens[:i], False",
           "the stop token is cut from the completion: the model never learns to stop",
           first(TR + "test_cut_at_stop_keeps_the_stop_token", then=ROLLOUT)),
    Mutant("truncation-uncapped", "sampling.py",
           "return tokens[:max_new_tokens], True", "return tokens, True",
           "a completion without a stop token is not cut to max_new_tokens", ROLLOUT,
           equivalent="both engines already return at most max_new_tokens tokens (HF decodes "
                      "exactly that many; vLLM is asked for max_tokens), and env.Agent passes "
                      "its own limit to the engine"),
    Mutant("stop-marks-truncated", "sampling.py",
           "return tokens[:i + 1], False", "return tokens[:i + 1], True",
           "every completion marked truncated (overlong filtering drops them all)",
           first(TR + "test_cut_at_stop_keeps_the_stop_token", then=ROLLOUT)),
    Mutant("sample-no-temperature", "sampling.py",
           "    if T != 1:  # in place only on a copy of our own, never on the caller's logits",
           "    if False:  # in place only on a copy of our own, never on the caller's logits",
           "the engine samples at T = 1 whatever the temperature",
           first(TR + "test_sample_next_draws_from_the_tempered_distribution", then=ROLLOUT)),
    Mutant("top-p-inclusive", "sampling.py",
           "(mass_before < sampling.top_p)", "(mass_before <= sampling.top_p)",
           "top-p keeps one token more when the nucleus reaches top_p exactly",
           ROLLOUT, pinned=(PIN + "test_top_p_stops_at_the_first_token_that_reaches_it",)),
    Mutant("cdf-total-ignored", "sampling.py",
           "u = r[:, None] * coarse[:, -1:]  # (B, 1)",
           "u = r[:, None]  # (B, 1)",
           "top-p: the uniform draw ignores the nucleus' total mass (u past it draws the last token)",
           first(TR + "test_sample_next_top_p_keeps_the_smallest_nucleus", then=ROLLOUT)),
    Mutant("cdf-tail-dropped", "sampling.py",
           "        if whole < V:", "        if False:",
           "the vocabulary's last, partial block is left out of the draw (Qwen's 151,936 tokens)",
           first(TR + "test_the_blocked_inverse_cdf_draws_what_one_running_sum_draws",
                 then=ROLLOUT)),
    Mutant("searchsorted-left", "sampling.py",
           "j = torch.searchsorted(fine, u, right=True)",
           "j = torch.searchsorted(fine, u, right=False)",
           "inverse-CDF draw takes the first index whose CDF reaches u, not exceeds it", ROLLOUT,
           equivalent="the two differ only when the fp64 uniform u equals a CDF value exactly "
                      "(u = 0 and a zero-probability first token, or ties): probability ~2^-53 "
                      "per draw"),
    Mutant("engine-logprob-no-temperature", "sampling.py",
           "logp = torch.log_softmax(scaled, dim=-1)  # (B, V)",
           "logp = torch.log_softmax(logits.float(), dim=-1)  # (B, V)",
           "the engine's log-probs (pi_old under --async-steps) at T = 1",
           first(TR + "test_engine_logprobs_are_those_of_the_logits_it_sampled_from",
                 then=ROLLOUT)),
    Mutant("engine-logprobs-uncut", "rollout.py",
           "logprobs.append(row_lps[:len(tokens)])", "logprobs.append(row_lps)",
           "engine log-probs run on past the completion (an episode's get misaligned)",
           first(TE + "test_an_episode_on_the_hf_engine", then=ROLLOUT),
           pinned=(PIN + "test_engine_logprobs_cover_exactly_each_completions_tokens",)),
    Mutant("prefix-whole-prompt", "rollout.py",
           "prefix = min(prompts, key=len)[:-1]", "prefix = min(prompts, key=len)",
           "a prompt that is all shared prefix has no token left for its next-token logits",
           ROLLOUT, pinned=(PIN + "test_prompts_sharing_a_prefix_decode_as_if_alone",)),
    Mutant("prefix-positions-restart", "rollout.py",
           "positions = (attn.cumsum(-1) - 1).clamp(min=0)[:, C:]",
           "positions = (attn[:, C:].cumsum(-1) - 1).clamp(min=0)",
           "after a shared prefix, prompt positions restart at 0",
           ROLLOUT, pinned=(PIN + "test_prompts_sharing_a_prefix_decode_as_if_alone",)),
    Mutant("prefix-not-attended", "rollout.py",
           "attn[i, C - held[i]:C] = 1", "attn[i, C - held[i]:C] = 0",
           "prompts do not attend to the shared prefix's cache",
           ROLLOUT, pinned=(PIN + "test_prompts_sharing_a_prefix_decode_as_if_alone",)),
    Mutant("kept-keys-overclaimed", "rollout.py",
           "n = min(len(commonprefix([row.tokens, prompt])), len(prompt) - 1)",
           "n = min(len(commonprefix([row.tokens, prompt])) + 1, len(prompt) - 1)",
           "an episode's next turn takes one token more from its kept keys than it shares",
           first(TE + "test_episodes_continue_from_kept_keys_and_values_with_nothing_changed",
                 then=ROLLOUT)),
    Mutant("kept-keys-outlive-weights", "rollout.py",
           "self.version, self.kept = version, {}\n        if self.shares_weights:",
           "self.version = version\n        if self.shares_weights:",
           "keys and values computed by the old weights continue a call after a weight update",
           first(TE + "test_kept_keys_and_values_never_outlive_the_weights", then=ROLLOUT)),
    Mutant("decode-attention-ungrouped-scale", "attention.py",
           "scaling = scaling if scaling is not None else query.shape[-1] ** -0.5",
           "scaling = query.shape[-1] ** -0.5 if scaling is None else 1.0",
           "smolrl's attention ignores the model's scaling: its log-probs drift",
           first(TM + "test_smolrl_attention_gives_the_logits_sdpa_gives", then=ROLLOUT)),
    Mutant("decode-position-stuck", "rollout.py",
           "attn.new_ones(len(live), 1)], 1), position + 1",
           "attn.new_ones(len(live), 1)], 1), position",
           "every decoded token gets the same position",
           first(TR + "test_prompts_of_different_lengths_decode_as_if_alone", then=ROLLOUT)),
    Mutant("decode-live-not-narrowed", "rollout.py",
           "live, token, attn, position = live[stay], token[stay], attn[stay], position[stay]",
           "token, attn, position = token[stay], attn[stay], position[stay]",
           "after a sample stops, tokens are written to the wrong rows",
           first(TR + "test_prompts_of_different_lengths_decode_as_if_alone", then=ROLLOUT)),
    Mutant("seed-ignores-index", "sampling.py",
           'digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=4).digest()',
           'digest = hashlib.blake2b(f"{seed}".encode(), digest_size=4).digest()',
           "every prompt of a call draws the same random stream",
           ROLLOUT, pinned=(PIN + "test_request_seeds_differ_per_prompt_and_fit_31_bits",)),
    Mutant("seed-32-bits", "sampling.py",
           'return int.from_bytes(digest, "little") >> 1',
           'return int.from_bytes(digest, "little")',
           "seeds up to 2^32: past what a signed 32-bit seed holds",
           ROLLOUT, pinned=(PIN + "test_request_seeds_differ_per_prompt_and_fit_31_bits",)),

    # --- checkpoint.py ---
    Mutant("prune-any-run", "checkpoint.py",
           "ours = [p for p in _checkpoints(folder) if _run_of(p) == driver.run_id]",
           "ours = _checkpoints(folder)",
           "--keep-last deletes another run's checkpoints",
           first(TC + "test_a_run_prunes_only_its_own_checkpoints", then=CHECKPOINT)),
    Mutant("prune-by-name", "checkpoint.py",
           "for old in sorted(ours, key=_step_of)[:-keep_last]:",
           "for old in sorted(ours)[:-keep_last]:",
           "pruning sorts step_10 before step_5 and deletes the newer",
           first(TC + "test_a_run_prunes_only_its_own_checkpoints", then=CHECKPOINT)),
    Mutant("prune-keep-zero", "checkpoint.py",
           "if keep_last:  # this run's own checkpoints only, and never the one it resumed from",
           "if True:  # this run's own checkpoints only, and never the one it resumed from",
           "--keep-last 0 prunes as well", CHECKPOINT,
           equivalent="sorted(...)[:-0] is sorted(...)[:0], empty: --keep-last 0 deletes nothing "
                      "either way"),
    Mutant("refuse-when-resuming", "checkpoint.py",
           "foreign = [p for p in found if not resume_dir or _run_of(p) != run]",
           "foreign = [p for p in found if resume_dir and _run_of(p) != run]",
           "a fresh run writes over another run's checkpoints", CHECKPOINT,
           pinned=(TC + "test_a_fresh_run_refuses_a_folder_with_another_runs_checkpoints",)),
    Mutant("resume-into-any-folder", "checkpoint.py",
           "foreign = [p for p in found if not resume_dir or _run_of(p) != run]",
           "foreign = [p for p in found if not resume_dir]",
           "a resume into another run's --out mixes the two runs' checkpoints", CHECKPOINT,
           pinned=(TC + "test_a_resume_into_another_runs_folder_is_refused_as_a_fresh_run_is",)),
    Mutant("prune-the-start", "checkpoint.py",
           "            if driver.resumed_from and old.resolve() == Path(driver.resumed_from)"
           ".resolve():\n                continue\n", "",
           "--keep-last deletes the checkpoint the run resumed from", CHECKPOINT,
           pinned=(TC + "test_resuming_an_earlier_step_branches_and_keeps_every_checkpoint",)),
    Mutant("later-checkpoints-stay", "checkpoint.py",
           "    return [p for p in found if _step_of(p) > checkpoint_step(resume_dir)]",
           "    return []",
           "an abandoned branch's later checkpoints stay: --resume auto picks them", CHECKPOINT,
           pinned=(TC + "test_resuming_an_earlier_step_branches_and_keeps_every_checkpoint",)),
    Mutant("unpickle-anything", "checkpoint.py",
           "weights_only=True, mmap=mmap", "weights_only=False, mmap=mmap",
           "a shared checkpoint can run code on --resume",
           first(TC + "test_a_crafted_checkpoint_cannot_run_code", then=CHECKPOINT)),
    Mutant("newest-by-name", "checkpoint.py",
           'return max(_checkpoints(Path(out) / "checkpoints"), key=_step_of, default=None)',
           'return max(_checkpoints(Path(out) / "checkpoints"), default=None)',
           "--resume auto takes step_9 over step_10", CHECKPOINT,
           pinned=(PIN + "test_resume_auto_takes_the_highest_step_not_the_last_name",)),
    Mutant("run-id-not-saved", "checkpoint.py",
           '"run_id": driver.run_id}, tmp / "driver_state.pt")', '}, tmp / "driver_state.pt")',
           "checkpoints carry no run id: --keep-last prunes nothing",
           first(TC + "test_keep_last_zero_keeps_every_checkpoint", then=CHECKPOINT)),
    Mutant("run-id-shared-default", "checkpoint.py",
           "run_id: str = field(default_factory=lambda: uuid.uuid4().hex)",
           "run_id: str = uuid.uuid4().hex",
           "one run id for every run of a process (evaluated once, at import)", CHECKPOINT,
           pinned=(PIN + "test_a_run_keeps_its_id_across_resumes_and_runs_get_their_own",)),
    Mutant("resume-new-run-id", "checkpoint.py",
           'state.get("run_id") or uuid.uuid4().hex, resumed_from', "uuid.uuid4().hex, resumed_from",
           "a resumed run takes a new id and never prunes its earlier checkpoints", CHECKPOINT,
           pinned=(PIN + "test_a_run_keeps_its_id_across_resumes_and_runs_get_their_own",)),

    # --- dpo.py ---
    Mutant("cdpo-sign", "dpo.py",
           "losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)",
           "losses = -(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)",
           "cDPO's flipped-label term with the wrong sign",
           first(TD + "test_label_smoothing_cdpo", then=DPO)),
    Mutant("robust-denominator", "dpo.py",
           "/ (1 - 2 * eps)", "/ (1 - eps)",
           "rDPO normalised by 1 - eps instead of 1 - 2 eps",
           first(TD + "test_hinge_ipo_robust", then=DPO)),
    Mutant("ipo-target", "dpo.py",
           "losses = (h - 1 / (2 * beta)) ** 2", "losses = (h - 1 / beta) ** 2",
           "IPO's target margin 1 / beta instead of 1 / (2 beta)",
           first(TD + "test_hinge_ipo_robust", then=DPO)),
    Mutant("hinge-margin", "dpo.py",
           "losses = torch.relu(1 - beta * h)", "losses = torch.relu(-beta * h)",
           "SLiC's hinge without its margin",
           first(TD + "test_hinge_ipo_robust", then=DPO)),
    Mutant("rewards-without-reference", "dpo.py",
           "chosen_rewards = beta * chosen_logratio.detach()",
           "chosen_rewards = beta * policy_chosen_logps.detach()",
           "the implicit reward forgets the reference",
           first(TD + "test_sigmoid_loss_and_rewards", then=DPO)),
    Mutant("pair-mask-dropped", "dpo.py",
           "logps = (logprobs * mask).sum(1)  # (2B,)", "logps = logprobs.sum(1)  # (2B,)",
           "response log-probs summed without the length mask", DPO,
           equivalent="completion_logprobs already returns 0 past each response's length"),
    Mutant("ipo-average-by-T", "dpo.py",
           "logps = logps / response_lens", "logps = logps / logprobs.shape[1]",
           "IPO averages over the micro-batch's longest response, not each one's own",
           DPO, pinned=(PIN + "test_ipo_averages_each_response_over_its_own_length",)),
    Mutant("chosen-rejected-swapped", "dpo.py",
           "return logps[:len(pairs)], logps[len(pairs):]",
           "return logps[len(pairs):], logps[:len(pairs)]",
           "chosen and rejected log-probs swapped: DPO trains the wrong way",
           first(TD + "test_prompt_tokens_do_not_change_the_loss", then=DPO)),
    Mutant("micro-batch-mean", "dpo.py",
           "loss = losses.sum() / num_pairs", "loss = losses.mean()",
           "each micro-batch averaged on its own: the batch loss depends on the split",
           first(TD + "test_micro_batching_leaves_loss_and_gradient_unchanged", then=DPO)),
    Mutant("ipo-sft-divided-twice", "dpo.py",
           'nll = -(pc if cfg.loss_type == "ipo" else pc / chosen_lens)',
           "nll = -(pc / chosen_lens)",
           "under IPO the SFT term divides the already averaged log-prob by the length again",
           DPO, pinned=(PIN + "test_ipo_references_and_sft_term_are_length_averaged_too",)),
    Mutant("ipo-reference-summed", "dpo.py",
           'average = cfg.loss_type == "ipo"\n    out = []', "average = False\n    out = []",
           "under IPO the cached reference log-probs are sums, the policy's averages",
           DPO, pinned=(PIN + "test_ipo_references_and_sft_term_are_length_averaged_too",)),
    Mutant("prompt-keeps-start", "pairs.py",
           "prompt_ids = prompt_ids[-cfg.max_prompt_length:]",
           "prompt_ids = prompt_ids[:cfg.max_prompt_length]",
           "an over-long pair keeps the start of its prompt and loses the question's end",
           DPO, pinned=(PIN + "test_an_over_long_pair_loses_the_start_of_its_prompt",)),

    # --- DAPO: dynamic sampling, overlong penalty and filtering (grpo.py, reward.py) ---
    Mutant("select-correct-unguarded", "rl.py",
           "[self.correct[i] for i in indices] if self.correct else [],",
           "[self.correct[i] for i in indices],",
           "dynamic sampling crashes on rows without answers (guess, custom rewards): correct = []",
           DAPO, pinned=(PIN + "test_dynamic_sampling_keeps_groups_of_rows_without_answers",)),
    Mutant("signal-always", "grpo.py",
           "return rewards.view(-1, G).std(1) > 1e-6", "return rewards.view(-1, G).std(1) >= 0",
           "dynamic sampling keeps groups whose rewards are all equal",
           first("tests/test_grpo_e2e.py::test_dynamic_sampling_never_loops_forever", then=DAPO),
           pinned=(PIN + "test_dynamic_sampling_keeps_the_first_groups_with_signal_and_counts_the"
                         "_rest",)),
    Mutant("signal-over-limit", "grpo.py",
           "chosen = signal.nonzero().flatten().tolist()[:limit - len(parts)]",
           "chosen = signal.nonzero().flatten().tolist()[:limit]",
           "dynamic sampling keeps more than N groups",
           first("tests/test_grpo_e2e.py::test_dynamic_sampling_fills_the_batch", then=DAPO),
           pinned=(PIN + "test_dynamic_sampling_keeps_the_first_groups_with_signal_and_counts_the"
                         "_rest",)),
    Mutant("dropped-counts-kept", "grpo.py",
           "dropped += int((~signal).sum())", "dropped += int(signal.sum())",
           "dropped_groups counts the groups with signal",
           first("tests/test_grpo_e2e.py::test_dynamic_sampling_never_loops_forever", then=DAPO),
           pinned=(PIN + "test_dynamic_sampling_keeps_the_first_groups_with_signal_and_counts_the"
                         "_rest",)),
    Mutant("fill-rounds-one-short", "grpo.py",
           "and len(rounds) <= cfg.max_fill_rounds):", "and len(rounds) < cfg.max_fill_rounds):",
           "one refill round fewer than --max-fill-rounds",
           first("tests/test_grpo_e2e.py::test_dynamic_sampling_never_loops_forever", then=DAPO)),
    Mutant("penalty-subtracted", "rl.py",
           "rewards = [r + p for r, p in zip(rewards, overlong(",
           "rewards = [r - p for r, p in zip(rewards, overlong(",
           "the overlong penalty (<= 0) subtracted: long answers rewarded",
           DAPO, pinned=(PIN + "test_the_overlong_penalty_is_added_to_the_reward",)),
    Mutant("penalty-boundary", "reward.py",
           "return [0.0 if n <= start else", "return [0.0 if n < start else",
           "the penalty starts one token earlier", DAPO,
           equivalent="at n == start the penalty is -min(1, 0 / buffer) = -0.0, which equals 0.0"),
    Mutant("penalty-slope", "reward.py",
           "-min(1.0, (n - start) / buffer)", "-min(1.0, (n - start) / max_new_tokens)",
           "the penalty falls over max_new_tokens instead of the buffer",
           first("tests/test_grpo_loss.py::test_overlong_penalty_values", then=DAPO)),
    Mutant("denominator-counts-empty", "rl.py",
           "sequences = float((completion_lens > 0).sum())",
           "sequences = float(len(completion_lens))",
           "seq-mean counts overlong-filtered sequences",
           first("tests/test_grpo_loss.py::test_loss_denominator_counts_only_sequences_in_the_loss",
                 then=DAPO)),
    Mutant("filter-inverted", "rl.py",
           "in_loss = ~torch.tensor(comps.truncated)", "in_loss = torch.tensor(comps.truncated)",
           "--overlong-filter trains only the truncated samples",
           DAPO, pinned=(PIN + "test_overlong_filtering_takes_truncated_samples_out_of_the_loss_and"
                               "_its_count",)),
    Mutant("denom-counts-filtered", "rl.py",
           "denom = loss_denominator(loss_agg, trained_lens * in_loss, cfg.max_new_tokens)",
           "denom = loss_denominator(loss_agg, trained_lens, cfg.max_new_tokens)",
           "filtered samples still count in the token-mean's denominator",
           DAPO, pinned=(PIN + "test_overlong_filtering_takes_truncated_samples_out_of_the_loss_and"
                               "_its_count",)),
    Mutant("filtered-still-trained", "grpo.py",
           "trained = batch.in_loss & (lens > 0)", "trained = lens > 0",
           "overlong-filtered samples still trained",
           first(TS + "test_overlong_filtered_sample_has_zero_weight", then=DAPO)),

    # --- env.py: the turn loop ---
    Mutant("sampled-not-masked", "env.py",
           "e.mask += [True] * len(tokens)", "e.mask += [False] * len(tokens)",
           "the model's own tokens masked out of training",
           first(TE + "test_an_episode_continues_from_the_ids_it_sampled_and_masks_the"
                      "_observations", then=EPISODES)),
    Mutant("observation-trained", "env.py",
           "e.mask += [False] * len(observation)", "e.mask += [True] * len(observation)",
           "tool results trained as if the model wrote them",
           first(TE + "test_an_episode_continues_from_the_ids_it_sampled_and_masks_the"
                      "_observations", then=EPISODES)),
    Mutant("observation-logprobs-missing", "env.py",
           "    e.logprobs += [0.0] * len(observation)\n", "",
           "engine log-probs misaligned with the ids after a tool result",
           first(TE + "test_an_episode_on_the_hf_engine", then=EPISODES),
           pinned=(PIN + "test_an_episodes_engine_logprobs_line_up_with_its_ids",)),
    Mutant("budget-off-by-one", "env.py",
           "if len(e.ids) + len(observation) >= max_tokens:",
           "if len(e.ids) + len(observation) > max_tokens:",
           "an episode that fills --max-episode-tokens exactly samples one token more",
           EPISODES, pinned=(PIN + "test_an_episode_never_exceeds_its_token_budget",)),
    Mutant("last-turn-always-truncates", "env.py",
           "e.done, e.truncated = True, cut or bool(last and (calls or malformed))",
           "e.done, e.truncated = True, cut or last",
           "an answer given on the last turn is marked truncated",
           EPISODES, pinned=(PIN + "test_a_call_on_the_last_turn_truncates_the_episode_and_an"
                                   "_answer_does_not",)),
    Mutant("last-turn-never", "env.py",
           "last=turn + 1 == self.max_turns", "last=turn == self.max_turns",
           "a tool call on the last turn runs, and the episode is not marked truncated",
           EPISODES, pinned=(PIN + "test_a_call_on_the_last_turn_truncates_the_episode_and_an"
                                   "_answer_does_not",)),
    Mutant("turn-seed-repeated", "env.py",
           "request_seed(sampling.seed, turn),",
           "sampling.seed,",
           "every turn of a seeded episode draws the same random stream",
           EPISODES, pinned=(PIN + "test_each_turn_draws_with_its_own_seed_and_a_good_call_is_no"
                                   "_error",)),
    Mutant("room-unclamped", "env.py",
           "rooms = [max(1, min(budget - len(e.ids), seeded.max_new_tokens))",
           "rooms = [min(budget - len(e.ids), seeded.max_new_tokens)",
           "a turn could be asked for 0 or fewer tokens", EPISODES,
           equivalent="an episode still running has len(ids) < max_tokens (_model_turn ends it "
                      "when ids and the observation reach the budget), so room >= 1 already"),
    Mutant("room-of-the-fullest", "env.py",
           "rooms = [max(1, min(budget - len(e.ids), seeded.max_new_tokens))",
           "rooms = [max(1, min(max(budgets) - max(len(r.ids) for r in running), "
           "seeded.max_new_tokens))",
           "every episode's turn cut at the fullest episode's room", EPISODES,
           pinned=("tests/test_env.py::test_each_episode_has_its_own_room",)),
    Mutant("overlong-against-a-turn", "rl.py",
           "budget = cfg.max_episode_tokens if episodes else cfg.max_new_tokens",
           "budget = cfg.max_new_tokens",
           "a whole episode measured against one turn's --max-new-tokens", DAPO,
           pinned=("tests/test_env.py::test_the_overlong_penalty_of_an_episode_is_against_its_own"
                   "_budget",)),
    Mutant("parse-catches-little", "env.py",
           "        except Exception as e:  # whatever the model wrote",
           "        except (ValueError, TypeError) as e:  # whatever the model wrote",
           "JSON nested 600 deep (RecursionError) stops the run", EPISODES,
           pinned=("tests/test_env.py::test_whatever_the_model_writes_becomes_an_observation_never"
                   "_an_exception",)),
    Mutant("tool-errors-count-calls", "env.py",
           'e.tool_errors += sum(text.startswith("error:") for _, text in results)',
           "e.tool_errors += len(results)",
           "every tool result counted as an error",
           EPISODES, pinned=(PIN + "test_each_turn_draws_with_its_own_seed_and_a_good_call_is_no"
                                   "_error",)),
    Mutant("arguments-unchecked", "env.py",
           "if not isinstance(arguments, dict):", "if False:",
           "a call whose arguments are a JSON string gets Python's TypeError as its result",
           EPISODES, pinned=(PIN + "test_tool_arguments_that_are_not_an_object_are_named_as"
                                   "_such",)),

    # --- sandbox.py: the kernel's wall, the filter and the limits ---
    # (No mutant lets the code fork: as root there is no RLIMIT_NPROC behind the filter, and the
    # fork-bomb test would really fork.)
    Mutant("environment-inherited", "sandbox.py",
           'env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"})', "env=None)",
           "the model's code sees the trainer's environment (tokens, keys)",
           first(TB + "test_the_sandbox_ends_every_bad_call_as_an_error[a secret in the "
                      "environment]", then=SANDBOX)),
    Mutant("output-limit-exclusive", "sandbox.py",
           "while len(data) <= OUTPUT:", "while len(data) < OUTPUT:",
           "output of exactly OUTPUT bytes is reported as too long",
           first(TB + "test_output_of_exactly_the_limit_is_whole", then=SANDBOX)),
    Mutant("no-cpu-limit", "sandbox.py",
           "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))", "pass",
           "no CPU-time limit (only the wall clock ends a busy loop)",
           first(TB + "test_a_cpu_hog_is_stopped_and_told_it_hit_the_cpu_limit", then=SANDBOX)),
    Mutant("cpu-limit-hard-equal", "sandbox.py", "(cpu, cpu + 1)", "(cpu, cpu)",
           "SIGKILL at the hard CPU limit comes first: a CPU hog reads 'killed'",
           first(TB + "test_a_cpu_hog_is_stopped_and_told_it_hit_the_cpu_limit", then=SANDBOX)),
    Mutant("root-not-dropped", "sandbox.py", "if uid >= 0:", "if False:",
           "a root trainer's code stays uid 0 (the host's sysctls, root's files)",
           first(TB + "test_the_code_is_not_root_and_holds_no_capability", then=SANDBOX),
           equivalent="" if os.geteuid() == 0 else "the trainer is not root: there is nothing "
                                                  "to drop"),
    Mutant("network-shared", "sandbox.py", '"--unshare-net", ', "",
           "the code shares the host's network (its loopback, its abstract sockets)",
           first(TB + "test_the_sandbox_reaches_no_network[host-loopback]", then=SANDBOX)),
    Mutant("pid-shared", "sandbox.py", '"--unshare-pid", ', "",
           "the code sees the host's processes in /proc",
           first(TB + "test_the_sandbox_sees_only_its_own_processes", then=SANDBOX)),
    Mutant("no-die-with-parent", "sandbox.py", '"--die-with-parent", ', "",
           "killing bwrap at the deadline leaves the sandbox running",
           first(TB + "test_a_timed_out_call_leaves_no_process_behind", then=SANDBOX)),
    Mutant("root-writable", "sandbox.py", '"--remount-ro", "/", ', "",
           "the sandbox's root (an unbounded tmpfs) is writable beside /tmp",
           first(TB + "test_the_sandbox_ends_every_bad_call_as_an_error[a write in the root]",
                 then=SANDBOX)),
    Mutant("x32-allowed", "sandbox.py", "[(at_least, 0x40000000)] + ", "",
           "x32 system calls (other numbers, same kernel) pass the filter",
           first(TB + "test_raw_system_calls_meet_the_filter[x32-fork]", then=SANDBOX)),
    Mutant("arch-unchecked", "sandbox.py", "(equal, 1, 0, arch)", "(equal, 1, 1, arch)",
           "a 32-bit system call is read with x86_64's numbers (int 0x80 forks)",
           first(TB + "test_a_32_bit_system_call_kills_the_code", then=SANDBOX)),
    Mutant("no-memory-limit", "sandbox.py",
           "resource.setrlimit(resource.RLIMIT_AS, (memory, memory))", "pass",
           "no address-space limit", SANDBOX,
           skip="unsafe to run on a shared machine: the memory-bomb test would then really "
                "allocate 8 GB; killed by its own test by construction (MemoryError needs the "
                "limit)"),
    Mutant("memfd-allowed", "sandbox.py", '"memfd_create", "memfd_secret", ', '"memfd_secret", ',
           "a memfd holds host memory outside the address space (8 GiB in one call)",
           first(TB + "test_memory_outside_the_address_space_cannot_be_had[memfd]",
                 then=SANDBOX)),
    Mutant("keyrings-allowed", "sandbox.py", '"add_key", "request_key", "keyctl", ', "",
           "the code reads, plants and clears the trainer's session keys",
           first(TB + "test_the_code_cannot_read_the_trainers_keys", then=SANDBOX)),
    Mutant("keys-visible", "sandbox.py", 'MASKED = ("/proc/keys", "/proc/key-users")',
           "MASKED = ()", "/proc/keys lists the descriptions of the trainer's keys",
           first(TB + "test_the_code_cannot_read_the_trainers_keys", then=SANDBOX)),
    Mutant("no-files-limit", "sandbox.py",
           "resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))", "pass",
           "the code holds thousands of pipes' buffers (141 MiB, outside its address space)",
           first(TB + "test_pipes_hold_no_more_than_the_few_files_the_code_may_open",
                 then=SANDBOX)),
    Mutant("cgroup-not-entered", "sandbox.py", "    if cgroup is None:\n        return []",
           "    if True:\n        return []",
           "the call's memory cgroup is made but the code never runs in it",
           first(TB + "test_the_memory_cgroup_alone_stops_what_the_filter_lets_through[memfd]",
                 then=SANDBOX)),  # (its test is skipped where no memory cgroup can be made)
    Mutant("stdin-unsealed", "sandbox.py", "fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW",
           "(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW",
           "the code grows its stdin memfd: 1.5 GiB no limit counts",
           first(TB + "test_the_code_can_neither_grow_nor_write_its_own_stdin[fallocate]",
                 then=SANDBOX)),
    Mutant("aio-allowed", "sandbox.py", '"io_setup", "io_destroy", ', '"io_destroy", ',
           "sixteen io_setup(4096) take every AIO context of the host",
           first(TB + "test_the_code_takes_no_aio_context_of_the_host", then=SANDBOX)),
    Mutant("xattrs-allowed", "sandbox.py", '"setxattr", "lsetxattr", ', '"lsetxattr", ',
           "extended attributes of /tmp's files hold unreclaimable kernel memory",
           first(TB + "test_memory_outside_the_address_space_cannot_be_had[tmpfs-xattrs]",
                 then=SANDBOX)),
    Mutant("no-signals-limit", "sandbox.py",
           "resource.setrlimit(resource.RLIMIT_SIGPENDING, (signals, signals))", "pass",
           "the code takes every queued signal and POSIX timer of the trainer's uid",
           first(TB + "test_the_code_uses_up_no_count_it_shares_with_the_trainer[posix-timers]",
                 then=SANDBOX)),
    Mutant("ptrace-allowed", "sandbox.py", '"ptrace", "process_vm_readv", ',
           '"process_vm_readv", ',
           "the code attaches to bwrap's pid 1 and holds memory past the call",
           first(TB + "test_the_code_cannot_reach_into_the_sandboxs_pid_1", then=SANDBOX)),
    Mutant("vmsplice-allowed", "sandbox.py", '"vmsplice", "splice", ', '"splice", ',
           "a pipe holds huge pages the code unmapped: 512 MiB a pipe outside RLIMIT_AS",
           first(TB + "test_a_pipe_holds_no_page_the_code_has_unmapped", then=SANDBOX)),
    Mutant("prefix-bound-whole", "sandbox.py", 'args += ["--ro-bind", path, path]',
           'args += ["--ro-bind", sys.base_prefix, sys.base_prefix]',
           "the code reads conda's environment variables and pip.conf in the interpreter's prefix",
           first(TB + "test_the_interpreters_prefix_shows_only_what_python_needs",
                 then=SANDBOX)),
    Mutant("site-packages-shown", "sandbox.py", "if stdlib in outside and os.path.isdir(packages):",
           "if False:", "the code reads the base interpreter's site-packages",
           first(TB + "test_the_interpreters_prefix_shows_only_what_python_needs",
                 then=SANDBOX)),
    Mutant("prefix-under-usr-shown", "sandbox.py",
           "hidden = [folder for folder in _installation() if _within(folder, SYSTEM)]",
           "hidden = []", "the code reads a conda env's files where the env is under /usr/local",
           first(TB + "test_an_interpreter_under_usr_shows_only_what_python_needs",
                 then=SANDBOX)),
    Mutant("elf-any-name-bound", "sandbox.py", 'if name and "/" not in name]', "]",
           "a library's NEEDED name binds any file, or the whole host",
           first(TB + "test_what_no_loader_would_load_is_neither_read_nor_bound", then=SANDBOX)),
    Mutant("no-disk-limit", "sandbox.py", '"--size", str(DISK), ', "",
           "/tmp is a tmpfs without a size", SANDBOX,
           skip="unsafe to run on a shared machine: the full-disk test would then fill memory "
                "for 2 s; killed by its own test by construction (ENOSPC needs the size)"),
]


# ---------------------------------------------------------------------------------------------
# Running them.


def copy_tree(dest: Path):
    """The working tree's files (tracked, and untracked but not ignored) under dest."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, names.split("\0")):
        source = ROOT / name
        if source.is_file():  # (a tracked file deleted in the working tree is skipped)
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def pytest(tree: Path, tests: list, timeout: int) -> tuple[str, str, float]:
    """Run `tests` in `tree` (-x): ("passed" | "failed" | "timeout" | "error", the first failing
    test or what went wrong, seconds)."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE",
               "--no-header", "-W", "ignore", *tests]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.time()
    try:
        result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                                timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"over {timeout} s", time.time() - t0
    seconds = time.time() - t0
    if result.returncode == 0:
        return "passed", "", seconds
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", result.stdout, re.MULTILINE)
    if result.returncode == 1 and failed:
        return "failed", failed[0], seconds
    return "error", (result.stdout + result.stderr).strip().splitlines()[-1][:200], seconds


def apply(tree: Path, mutant: Mutant) -> str:
    """The mutated text of the mutant's file (the original must occur exactly once, and the
    mutated file must still compile)."""
    text = (tree / mutant.file).read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise ValueError(f"{mutant.name}: the snippet occurs {count} times in {mutant.file}")
    mutated = text.replace(mutant.old, mutant.new)
    compile(mutated, mutant.file, "exec")
    return mutated


def run(mutant: Mutant, tree: Path, timeout: int, pinned_only: bool = False) -> tuple[str, str]:
    """(result, by which test) for one mutant; its file is restored whatever happens.
    pinned_only: run only its tests/test_pinned.py tests (do the new tests kill it?)."""
    if mutant.skip:
        return "not run", mutant.skip
    path = tree / mutant.file
    original = path.read_text()
    path.write_text(apply(tree, mutant))
    try:
        outcome, test = "passed", ""
        # The named tests in a pytest of their own: given a test and its file, pytest runs the
        # file in its order, and "killed by" would name the file's first test that fails.
        named = [t for t in mutant.tests if "::" in t]
        for tests in ([] if pinned_only else [named, [t for t in mutant.tests if "::" not in t]]):
            if tests and outcome == "passed":
                outcome, test, _ = pytest(tree, tests, timeout)
        if outcome == "passed" and mutant.pinned:
            outcome, test, _ = pytest(tree, list(mutant.pinned), timeout)
            if outcome != "passed":
                return ("killed by a new test" if outcome == "failed" else outcome), test
    finally:
        path.write_text(original)
    if outcome == "passed":
        return ("equivalent: survived" if mutant.equivalent else "SURVIVED"), ""
    label = "killed" if outcome == "failed" else outcome  # (a timeout or a crash kills it too)
    return (f"{label} (not equivalent!)" if mutant.equivalent else label), test


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="",
                        help="mutants whose name or file contains this (comma-separated: any)")
    parser.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    parser.add_argument("--check", action="store_true",
                        help="check every snippet occurs once and compiles mutated; run nothing")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    parser.add_argument("--pinned-only", action="store_true",
                        help="only the mutants with tests in tests/test_pinned.py, against those "
                             "tests alone: does each new test kill every mutant it names?")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip running the tests unmutated first")
    args = parser.parse_args()
    wanted = args.only.split(",")
    mutants = [m for m in MUTANTS if any(w in m.name or w in m.file for w in wanted)
               and (m.pinned or not args.pinned_only)]
    if args.list:
        for m in mutants:
            print(f"{m.file:14} {m.name:32} {m.bug}")
        return

    with tempfile.TemporaryDirectory(prefix="smolrl-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        for m in mutants:  # every snippet is checked before anything runs
            apply(tree, m)
        if args.check:
            print(f"{len(mutants)} mutants: every snippet occurs once, every mutated file compiles")
            return
        if not args.no_baseline:
            tests = list(dict.fromkeys(t for m in mutants if not m.skip for t in (
                m.pinned if args.pinned_only else [*m.tests, *m.pinned])))
            outcome, test, seconds = pytest(tree, tests, args.timeout * 4)
            print(f"baseline: {len(tests)} test ids unmutated: {outcome} {test} ({seconds:.0f} s)")
            if outcome != "passed":
                raise SystemExit("error: the tests must pass unmutated first")
        rows = []
        for m in mutants:
            t0 = time.time()
            result, test = run(m, tree, args.timeout, args.pinned_only)
            rows.append((m, result, test))
            print(f"{m.file:14} {m.name:32} {result:24} {test}  ({time.time() - t0:.0f} s)",
                  flush=True)
    print("\n| file | mutant | bug | result | killed by / why |\n|---|---|---|---|---|")
    for m, result, test in rows:
        print(f"| {m.file} | {m.name} | {m.bug} | {result} | "
              f"{m.equivalent if m.equivalent and 'survived' in result else test} |")
    counts = {}
    for _, result, _ in rows:
        counts[result] = counts.get(result, 0) + 1
    print("\n" + ", ".join(f"{n} {r}" for r, n in sorted(counts.items())))


if __name__ == "__main__":
    main()
