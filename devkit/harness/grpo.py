"""A GRPO step's phases, measured: what `lowmem_ft.memory.grpo` predicts, phase by phase.

    python -m devkit.harness.grpo                       # the default grid on two zoo families
    python -m devkit.harness.grpo --family qwen2.5 --adapter full --beta 0.04

A zoo model is built through `build_model` (the path `train` uses: LoRA, QLoRA or full) and trained for one
optimizer step by TRL 1.16's own `GRPOTrainer` on the CPU — its HF `generate` path, its scoring passes, its fused
head's loss — under `PeakMemory` (exact live tensor bytes). A subclass only marks the phase boundaries:

- generation: `_generate_single_turn` (one `generate` call for the round's b × steps_per_generation rows);
- scoring: `_get_per_token_logps_and_entropies` under no_grad (the old policy's and the reference's passes);
- forward / backward: `compute_loss`, then the rest of `training_step`;
- optimizer: the optimizer's step (a Trainer callback on each side of it).

Every prompt has P tokens and every completion exactly C (`min_new_tokens = C`), so the shapes the memory model is
given are the ones that ran. Each phase's peak is the peak live bytes between its two marks.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devkit import zoo
from lowmem_ft.memory.arch import Architecture

PHASES = ("generation", "scoring", "forward", "backward", "optimizer step")


@dataclass(frozen=True)
class Case:
    family: str = "llama3"
    adapter: str = "lora"  # lora | qlora | full
    prompt_len: int = 12  # P
    completion_len: int = 20  # C
    num_generations: int = 4  # G
    micro_batch: int = 4  # b: completions per micro-step
    steps_per_generation: int = 2  # micro-steps one generation round covers
    gradient_accumulation: int = 2
    beta: float = 0.0
    gradient_checkpointing: bool = True
    # optimizer steps: the second is the steady state (the optimizer's states exist in every phase); the first
    # optimizer step makes its states tensor by tensor, under the estimate's "states alive" envelope
    steps: int = 2

    @property
    def optimizer_steps(self) -> int:
        """`steps`, or more so that a second round runs (a round covering two optimizer steps needs a third): the
        second round generates beside the first's buffer and the optimizer's states, the steady state."""
        second_round = -(-(self.steps_per_generation + 1) // self.gradient_accumulation)
        return max(self.steps, second_round) if self.steps > 1 else self.steps


def _recipe(model_dir: Path, case: Case):
    from lowmem_ft.recipe.load import resolve

    return resolve(
        None,
        {
            "model": {"name_or_path": str(model_dir), "quantization": "nf4" if case.adapter == "qlora" else "none"},
            "adapter": {"kind": "full" if case.adapter == "full" else "lora", "r": 8, "dropout": 0.0},
            "memory": {
                "gradient_checkpointing": case.gradient_checkpointing,
                "micro_batch_size": case.micro_batch,
                "max_seq_len": case.prompt_len + case.completion_len,
                "gradient_accumulation": case.gradient_accumulation,
            },
        },
    )


def _prompts(tokenizer, n: int, length: int) -> list[dict[str, Any]]:
    """n plain-text prompts of exactly `length` tokens (TRL tokenizes plain prompts without special tokens added
    by the template; the tokenizer's own BOS is counted by re-encoding), with an answer column."""
    words = [
        w
        for w in [
            "the",
            "cat",
            "sat",
            "on",
            "a",
            "mat",
            "and",
            "then",
            "ran",
            "to",
            "the",
            "old",
            "red",
            "barn",
            "by",
            "the",
            "hill",
        ]
    ]
    out = []
    for i in range(n):
        ids: list[int] = []
        k = i
        while len(ids) < length:
            ids = tokenizer(" ".join(words[(k + j) % len(words)] for j in range(len(ids) + 1 + i)))["input_ids"]
            k += 1
        text = tokenizer.decode(ids[:length], skip_special_tokens=True)
        while len(tokenizer(text)["input_ids"]) > length:
            text = text[:-1]
        out.append({"prompt": text, "answer": f"#### {i}"})
    return out


def measure(case: Case) -> tuple[dict[str, float], Architecture, Any]:
    """Peak live bytes of each phase of one GRPO optimizer step (and the architecture and CPU setup it ran with)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lowmem_ft.choosing import setup_from_recipe
    from lowmem_ft.train.measure.peak import PeakMemory
    from lowmem_ft.train.model import build_model

    peaks: dict[str, float] = {}
    meter: list[PeakMemory] = []

    def mark(label: str | None) -> None:
        if meter:
            m = meter[0].mark(label or "other")
            if label:
                peaks[label] = max(peaks.get(label, 0), m.peak_bytes)

    class Marked(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            mark(None)
            peaks.setdefault("generation start", meter[0].live_bytes)
            out = super()._generate_single_turn(*args, **kwargs)
            mark("generation")
            return out

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if torch.is_grad_enabled():
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            mark(None)
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            mark("scoring")
            return out

        def compute_loss(self, *args, **kwargs):
            mark(None)
            out = super().compute_loss(*args, **kwargs)
            mark("forward")
            return out

        def training_step(self, *args, **kwargs):
            out = super().training_step(*args, **kwargs)
            mark("backward")
            return out

    class OptimizerMarks(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            mark(None)

        def on_optimizer_step(self, args, state, control, **kw):
            mark("optimizer step")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = zoo.build(case.family, Path(tmp) / "model")
        recipe = _recipe(model_dir, case)
        model = build_model(recipe)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # enough prompts that no epoch ends inside the run (an epoch's end cuts an accumulation short, and a round
        # shorter than the run would never be followed by a second)
        micro_steps = case.optimizer_steps * case.gradient_accumulation + 3 * case.steps_per_generation
        prompts = _prompts(tokenizer, -(-micro_steps * case.micro_batch // case.num_generations), case.prompt_len)
        config = GRPOConfig(
            output_dir=str(Path(tmp) / "out"),
            per_device_train_batch_size=case.micro_batch,
            gradient_accumulation_steps=case.gradient_accumulation,
            steps_per_generation=case.steps_per_generation,
            num_generations=case.num_generations,
            max_completion_length=case.completion_len,
            generation_kwargs={"min_new_tokens": case.completion_len},
            beta=case.beta,
            max_steps=case.optimizer_steps,
            optim=setup_from_recipe(recipe, device="cpu").optimizer,
            learning_rate=1e-4,
            gradient_checkpointing=case.gradient_checkpointing,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_dropout=True,
            seed=0,
        )

        def reward(completions, answer, **kwargs):
            return [float(len(c) % 3) for c in completions]

        trainer = Marked(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=Dataset.from_list(prompts),
            processing_class=tokenizer,
            callbacks=[OptimizerMarks()],
        )
        with PeakMemory(device="cpu", roots=[model, trainer]) as pm:
            meter.append(pm)
            trainer.train()
        peaks["marks"] = [(m.label, m.live_bytes, m.peak_bytes) for m in pm.marks]  # type: ignore[assignment]
        meter.clear()
        config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config.to_dict()
        peaks["config"] = config  # type: ignore[assignment]
        arch = Architecture.from_config(config)
        setup = setup_from_recipe(recipe, device="cpu")
        del trainer, model
        gc.collect()
    return peaks, arch, setup


def predict(case: Case, arch: Architecture, setup) -> dict[str, float]:
    from lowmem_ft.memory.grpo import GrpoShape, phase_peaks

    shape = GrpoShape(
        prompt_len=case.prompt_len,
        completion_len=case.completion_len,
        num_generations=case.num_generations,
        steps_per_generation=case.steps_per_generation,
        beta=case.beta,
        frees_spent_round=False,  # TRL's own trainer keeps it until the next round is made
        adapter_bf16=True,  # and casts a quantized model's adapter to bf16 (lowmem-ft's trainer undoes that)
    )
    # each phase's peak over the steps: the last step's, whose optimizer states exist (one step: made in it)
    return phase_peaks(arch, setup, shape, states=case.steps > 1)


CASES = (
    Case(),
    Case(family="qwen2.5"),
    Case(adapter="full"),
    Case(family="qwen2.5", adapter="full"),
    Case(steps_per_generation=1, beta=0.04, prompt_len=40),
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.harness.grpo", description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))), help="indices into CASES")
    args = ap.parse_args(argv)
    print("| case | phase | measured B | predicted B | error |\n| --- | --- | --- | --- | --- |")
    for i in (int(x) for x in args.cases.split(",")):
        case = CASES[i]
        measured, arch, setup = measure(case)
        predicted = predict(case, arch, setup)
        name = (
            f"{case.family} {case.adapter} P {case.prompt_len} C {case.completion_len} G {case.num_generations} "
            f"b {case.micro_batch} spg {case.steps_per_generation} ga {case.gradient_accumulation} beta {case.beta}"
        )
        for phase in PHASES:
            m, p = measured.get(phase), predicted.get(phase)
            if m is None and p is None:
                continue
            err = f"{(p - m) / m:+.2%}" if m and p else ""
            print(f"| {name} | {phase} | {m or 0:,.0f} | {p or 0:,.0f} | {err} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
