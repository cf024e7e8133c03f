"""Supervised fine-tuning on TRL's `SFTTrainer`, the method every recipe starts from.

The one idea: the data is tokenized, masked and fitted by `lowmem_ft.data.prepare` (packed there when the model's
attention keeps samples apart, `lowmem_ft.train.args.batching`), so TRL's own preparation is skipped and its trainer
(`MemorySafeSFTTrainer`, with the monitor, guard and OOM recovery) sees batches already the planned size. Its loss is
the model's, which our chunked loss head may answer (`memory.chunked_loss`, `lowmem_ft.train.losses`).
"""

from __future__ import annotations

from typing import Any

from lowmem_ft.train.methods import MethodData
from lowmem_ft.train.observe.progress import SFT_SHOWN


class SFT:
    name = "sft"
    shown = SFT_SHOWN
    logged: tuple[str, ...] = ()  # the loss and token accuracy are the run's common figures
    traced = True  # the training step `lowmem_ft.train.trace.step` traces
    takes_rewards = False
    images = True
    chunked_loss = True

    def batching(self, recipe):
        from lowmem_ft.train.args import batching

        return batching(recipe)

    def batch_text(self, recipe, world_size: int) -> str:
        return ""  # sequences per step, as the banner says by default

    def config(self, sft_args, recipe):
        return sft_args

    def prepare_data(self, recipe, tokenizer, reward_fns: list) -> MethodData:
        from lowmem_ft.data.prepare import prepare_datasets

        return MethodData(*prepare_datasets(recipe, tokenizer))

    def trainer(self, recipe) -> tuple[type, dict[str, Any]]:
        from lowmem_ft.train.resilience.trainer import MemorySafeSFTTrainer

        return MemorySafeSFTTrainer, {}


METHODS = {"sft": SFT()}
