"""Supervised fine-tuning on TRL's `SFTTrainer`, the method every recipe starts from.

The one idea: the data is tokenized, masked and fitted by `lowmem_ft.data.prepare` (packed there when the model's
attention keeps samples apart, `lowmem_ft.train.args.batching`), so TRL's own preparation is skipped and its trainer
(`MemorySafeSFTTrainer`, with the monitor, guard and OOM recovery) sees batches already the planned size. Its loss is
the model's, which our chunked loss head may answer (`memory.chunked_loss`, `lowmem_ft.train.losses`). A
vision-language checkpoint trains on image chats the same way: `lowmem_ft.vision` reads them and brings the collator
(`prepare_data`), and the run treats them as any data (`MethodData`).
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
        from lowmem_ft.vision.setup import vision_of

        vision = vision_of(recipe)
        if vision is None:
            return MethodData(*prepare_datasets(recipe, tokenizer))
        # image chats (`lowmem_ft.vision`): their own reading, and a collator that opens the image files column into
        # pixel values at the run's resolution cap; the processor at that cap is saved beside the weights
        train, eval_data, summary = vision.prepare(recipe, tokenizer)
        collator = vision.collator(recipe, tokenizer)
        return MethodData(
            train,
            eval_data,
            summary,
            trainer_kwargs={"data_collator": collator},
            keeps_columns=True,
            held=collator.pixels_held,
            banner=vision.banner(summary),
            save_beside=lambda directory: vision.save_preprocessor(recipe, directory),
        )

    def trainer(self, recipe) -> tuple[type, dict[str, Any]]:
        from lowmem_ft.train.resilience.trainer import MemorySafeSFTTrainer

        return MemorySafeSFTTrainer, {}


METHODS = {"sft": SFT()}
