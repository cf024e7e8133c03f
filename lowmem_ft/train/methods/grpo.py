"""GRPO on TRL 1.16's `GRPOTrainer` (its transformers generation path), with the monitor, guard and OOM recovery
every method has.

The one idea: a GRPO optimizer step is rounds of three phases — generation (one `generate` call for the round's
b × steps_per_generation completions, `num_generations` per prompt), scoring (no-grad passes: the old policy's when
rounds and optimizer steps are misaligned, the reference's when beta > 0), and training micro-steps of b
completions — and TRL computes every advantage over the whole round *before* it shuffles the round and cuts it into
micro-steps (`_generate_and_score_completions`, `_prepare_inputs`). So:

- the round is made once per micro-step, outside `MemorySafe`'s OOM recovery (`training_step`): a retry or a
  replayed micro-step reuses the same completions, and a piece of a micro-step never sees other advantages than the
  whole one. An OOM while generating is one line naming the knobs that shrink a round (no smaller piece helps);
- the guard's pieces are rows of the micro-step, each weighted by its share of the micro-step's loss as TRL
  normalises it (`piece_weights`: per completion for grpo / dr_grpo / sapo / luspo, per completion token for bnpo,
  a global token count for dapo / cispo / vespo, whose pieces add up as they are). A prompt's completions are
  spread over micro-steps by TRL itself, so keeping them together inside a micro-step would change nothing;
- the monitor marks `generation` after the round's `generate`, `scoring` after each no-grad pass, then forward /
  backward / optimizer as for SFT, and pauses its per-forward samples inside generation and scoring (a full model's
  `generate` calls its forward once per token). On the CPU each mark is compared with `lowmem_ft.memory.grpo`'s
  phase peak for the round that ran (`lowmem_ft.train.measure.exact`);
- the spent round is dropped before the next is generated (TRL keeps it until the new one replaces it), so two
  rounds are never alive together.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

from lowmem_ft.errors import UserError
from lowmem_ft.train.methods import MethodData
from lowmem_ft.train.methods.rewards import RewardFailed
from lowmem_ft.train.resilience.trainer import MemorySafe

log = logging.getLogger(__name__)

# How TRL 1.16 normalises each loss (grpo_trainer.py `_compute_loss`): a mean over completions, a mean over the
# micro-step's completion tokens, or a sum over a normaliser fixed for the whole round.
PER_COMPLETION = ("grpo", "dr_grpo", "sapo", "luspo")
PER_LOCAL_TOKEN = ("bnpo",)
GLOBAL_NORMALISER = ("dapo", "cispo", "vespo")
# TRL's metric names shown on the progress line (log key → label)
GRPO_SHOWN = {"reward": "reward", "reward_std": "reward std", "completions/mean_length": "len", "kl": "kl",
              "clip_ratio/region_mean": "clip"}  # fmt: skip


def grpo_config(sft_args, recipe) -> GRPOConfig:
    """TRL's `GRPOConfig` with every `TrainingArguments` field the SFT config decided, and GRPO's own keys."""
    from transformers import TrainingArguments

    g = recipe.grpo
    shared = {f.name: getattr(sft_args, f.name) for f in fields(TrainingArguments) if f.init}
    shared.pop("group_by_length", None)
    shared["remove_unused_columns"] = False  # the data's other columns reach the reward functions
    shared |= {"eval_strategy": "no", "do_eval": False, "load_best_model_at_end": False}
    return GRPOConfig(
        **shared,
        num_generations=g.num_generations,
        max_completion_length=g.max_completion_length,
        steps_per_generation=g.steps_per_generation or None,
        beta=g.beta,
        loss_type=g.loss_type,
        epsilon=g.epsilon,
        temperature=g.temperature,
        top_p=g.top_p,
        disable_dropout=True,  # the scoring passes and the training pass must see the same weights
        use_vllm=False,
    )


def prepare_data(recipe, tokenizer) -> tuple[Any, None, dict[str, Any]]:
    """The prompts of a GRPO run (`lowmem_ft.data.prompts`): read, long ones cut or left out (counted)."""
    from datasets import Dataset

    from lowmem_ft.data.prompts import fit_prompts
    from lowmem_ft.data.readers import RecordReader, log_skipped
    from lowmem_ft.data.sources import check_source, eval_source_of

    d, g = recipe.data, recipe.grpo
    if d.mix or d.streaming:
        raise UserError(f"data.{'mix' if d.mix else 'streaming'} is not supported for GRPO yet; give one --data source")
    if eval_source_of(recipe) is not None or d.eval_fraction > 0:
        raise UserError("--method grpo: evaluation data is not supported yet (evaluating generates too); drop it")
    source = check_source(recipe)[0]
    reader = RecordReader(source, d.skip_bad_lines, fmt="prompts")
    records = _templated(list(reader), tokenizer, source.label, reader.skipped, d.skip_bad_lines)
    for line in reader.skipped:
        log_skipped(line)
    kept, fit = fit_prompts(records, tokenizer, g.max_prompt_length, g.prompt_truncation)
    if not kept:
        raise UserError(
            f"{source.label}: no prompt fits grpo.max_prompt_length={g.max_prompt_length} "
            f"({fit.dropped} left out); raise it or use prompt_truncation keep_end"
        )
    log.info("data: %s", fit.describe(g.max_prompt_length))
    summary = {
        "path": d.path,
        "format": "prompts",
        "records": len(records),
        "train_records": len(kept),
        "eval_records": 0,
        "skipped_lines": reader.skipped,
        "columns": sorted({k for r in kept for k in r if k != "prompt"}),
        "loss_on": "generated completions",
        "prompt_fit": {"kept": fit.kept, "cut": fit.cut, "dropped": fit.dropped, "longest": fit.longest},
        "prompt_truncation": g.prompt_truncation,
    }
    return Dataset.from_list(kept), None, summary


def _templated(records: list, tokenizer, label: str, skipped: list[str], skip_bad: bool) -> list:
    """The records whose prompts the tokenizer (its chat template) takes, as TRL will tokenize them at every round;
    a prompt it rejects stops the run here, naming its row, or is skipped and listed."""
    from lowmem_ft.data.formats import BadLine
    from lowmem_ft.data.prompts import prompt_ids

    out = []
    for i, record in enumerate(records, 1):
        try:
            prompt_ids(tokenizer, record["prompt"])
        except BadLine as exc:
            if not skip_bad:
                raise UserError(f"{label} record {i}: {exc} (or pass --skip-bad-lines)") from None
            skipped.append(f"{label} record {i}: {exc}")
            continue
        out.append(record)
    return out


def unscored_problem(names: list[str], step: int, first: int, count: int, rows: int, prompts) -> str:
    """The line for completions no reward scored (every function returned None: "does not apply")."""
    from lowmem_ft.train.methods.rewards import row_of

    return (
        f"{count} of {rows} completions at step {step} have no reward (every reward returned None: "
        f"{', '.join(names)}), the first completion {first}{row_of(prompts, first)}"
    )


def reward_functions(recipe, user: list, columns: list[str]) -> list:
    """The run's reward functions: the recipe's built-ins, then the command line's `--reward-fn` files."""
    from lowmem_ft.train.methods.rewards import RewardOptions, build_rewards, parse_builtin

    g = recipe.grpo
    options = RewardOptions(g.answer_column, g.format_regex, g.max_completion_length)
    builtins = [parse_builtin(entry) for entry in g.rewards]
    return build_rewards(builtins, user, options, ["prompt", *columns])


def piece_weights(loss_type: str, pieces: list[dict[str, Any]], rows: int) -> list[float]:
    """Each piece's share of the micro-step's loss as TRL normalises `loss_type` (see the module docstring)."""
    if len(pieces) == 1 or loss_type in GLOBAL_NORMALISER:
        return [1.0] * len(pieces)
    if loss_type in PER_LOCAL_TOKEN:
        tokens = [float(p["completion_mask"].sum()) for p in pieces]
        total = sum(tokens) or 1.0
        return [t / total for t in tokens]
    return [p["completion_ids"].shape[0] / rows for p in pieces]


def row_pieces(inputs: dict[str, Any], per_piece: int) -> list[dict[str, Any]]:
    """A micro-step's rows in pieces of `per_piece`, in order; per-row tensors cut, the rest (the round's token
    count, scalars) kept whole."""
    rows = inputs["completion_ids"].shape[0]
    if per_piece >= rows:
        return [inputs]
    return [
        {k: v[a : a + per_piece] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows else v
         for k, v in inputs.items()}
        for a in range(0, rows, per_piece)
    ]  # fmt: skip


class GenerationOutOfMemory(UserError):
    """A round's generation did not fit: no smaller piece helps, a smaller round does."""


class MemorySafeGRPOTrainer(MemorySafe, GRPOTrainer):
    """`GRPOTrainer` with `MemorySafe`'s monitor samples and OOM recovery (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        self._in_micro_step = False
        super().__init__(*args, **kwargs)

    # -- the round -------------------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        step = self._step
        if step % (self.args.steps_per_generation * self.num_iterations) == 0:
            self._buffered_inputs = None  # the spent round: freed before the next one is generated
        try:
            batch = GRPOTrainer._prepare_inputs(self, inputs)
        except torch.OutOfMemoryError:
            raise self._generation_oom() from None
        self._in_micro_step = True
        try:
            return super().training_step(model, batch, num_items_in_batch)
        finally:
            self._in_micro_step = False
            self._step = step + 1  # one micro-step, however many pieces and retries ran it

    def _prepare_inputs(self, inputs):
        if self._in_micro_step:  # a slice of the round, already on the device
            return inputs
        return super()._prepare_inputs(inputs)

    def _generation_oom(self) -> GenerationOutOfMemory:
        a = self.args
        return GenerationOutOfMemory(
            f"out of memory generating a round of {a.generation_batch_size} completions (up to "
            f"{a.max_completion_length} tokens each) at step {self.state.global_step + 1}; lower "
            "grpo.steps_per_generation, grpo.num_generations or grpo.max_completion_length (or plan with --vram), "
            "then continue with --resume"
        )

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards (each function's values checked where it is called, `rewards.CheckedReward`), then the
        round's unscored rows (`unscored_problem`): said once, counted; a round with none scored stops the run."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        unscored = torch.isnan(rewards).all(dim=1)
        if bool(unscored.any()):
            self.unscored_rows = getattr(self, "unscored_rows", 0) + int(unscored.sum())
            first = int(unscored.nonzero()[0][0])
            line = unscored_problem(self.reward_func_names, self.state.global_step + 1, first, int(unscored.sum()),
                                    rewards.shape[0], prompts if first < len(prompts) else None)  # fmt: skip
            if bool(unscored.all()):
                raise RewardFailed(line + "; no completion of the round has a reward, so nothing can be learned")
            if self.unscored_rows == int(unscored.sum()):  # the first round with one: said once, counted after
                log.warning("%s; TRL gives them no advantage (counted in metrics.json as unscored_completions)", line)
        return rewards

    def _generate_and_score_completions(self, inputs):
        with self.monitor.paused():  # generate and the scoring passes are marked as phases, not per forward
            return super()._generate_and_score_completions(inputs)

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        if self.model.training and self.monitor.exact is not None:
            longest = max((len(c) for c in out[0]), default=0)
            self.monitor.exact.round_shape(len(prompt_ids), max(len(p) for p in prompt_ids), longest)
        if self.model.training:
            self.monitor.sample("generation")
        return out

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # the forward phase ends with TRL's loss (log-probs and entropies are computed after the model's forward)
        with self.monitor.paused(exact=False):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            self.monitor.sample("forward")
        return loss

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if not torch.is_grad_enabled() and self.model.training:
            self.monitor.sample("scoring")
        return out

    def _metric_state(self):
        return {k: len(v) for k, v in self._metrics["train"].items()}

    def _restore_metrics(self, saved) -> None:
        """Forget what failed or replayed passes added to TRL's train metrics (the round's own stay)."""
        for key, values in self._metrics["train"].items():
            del values[saved.get(key, len(values)) :]

    # -- pieces ----------------------------------------------------------------------------------------------------
    def _pieces(self, inputs, num_items_in_batch):
        rows = inputs["completion_ids"].shape[0]
        parts = row_pieces(inputs, max(1, min(rows, self.guard.sub_batch)))
        sizes = [p["completion_ids"].shape[0] for p in parts]
        spans = [(sum(sizes[:k]), n) for k, n in enumerate(sizes)]
        return parts, piece_weights(self.loss_type, parts, rows), (0, rows, spans)


class GRPO:
    """GRPO as a `lowmem_ft.train.methods.Method`: prompts (never packed), the recipe's and the command line's
    reward functions checked against the data's columns before any weight is read, TRL's own loss."""

    name = "grpo"
    shown = GRPO_SHOWN
    # TRL's names: rewards/<function>/mean, completions/mean_length, clip_ratio/region_mean, kl, reward, reward_std
    logged = ("rewards/*", "completions/mean_length", "clip_ratio/region_mean", "kl", "reward", "reward_std")
    traced = False  # a round generates: the tracer runs SFT steps only
    takes_rewards = True
    chunked_loss = False  # TRL computes GRPO's loss from its own log-probs (`lowmem_ft.memory.grpo.method_setup`)

    def batching(self, recipe):
        from lowmem_ft.train.args import Batching

        return Batching(False)

    def batch_text(self, recipe, world_size: int) -> str:
        """A step's batch on the banner: completions per step, and the round one generate call makes."""
        g, mem = recipe.grpo, recipe.memory
        effective = mem.micro_batch_size * mem.gradient_accumulation * world_size
        rows = mem.micro_batch_size * (g.steps_per_generation or mem.gradient_accumulation) * world_size
        return (
            f"{effective} completions per step; a round generates {rows} ({rows // g.num_generations} prompts × "
            f"{g.num_generations}), up to {g.max_completion_length} tokens each"
        )

    def config(self, sft_args, recipe) -> GRPOConfig:
        return grpo_config(sft_args, recipe)

    def prepare_data(self, recipe, tokenizer, reward_fns: list) -> MethodData:
        train_ds, eval_ds, summary = prepare_data(recipe, tokenizer)
        # before any weight is read: a missing reward or a column a reward needs is one line now
        rewards = reward_functions(recipe, reward_fns, summary["columns"])
        return MethodData(train_ds, eval_ds, summary, {"reward_funcs": rewards})

    def trainer(self, recipe) -> tuple[type, dict[str, Any]]:
        return MemorySafeGRPOTrainer, {}


METHODS = {"grpo": GRPO()}
