"""Vision-language data: TRL-style `messages` with `{"type": "image"}` parts plus an `images` column (or LLaMA-Factory's
`<image>` in a message's text, ShareGPT's `conversations` too; every shape and source in `lowmem_ft.vision.rows`),
tokenized with the image placeholders expanded to the tokens the processor makes, and the loss on the assistant's
text only.

    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]}],
     "images": ["img/red.png"]}

The conversation is rendered and masked by the text path (`lowmem_ft.data.chat`: the template's markers, TRL's
training version, or turn by turn), so image rows get exactly the assistant masks text rows get. The template renders
one placeholder per image (Qwen2.5-VL: `<|image_pad|>`, Gemma-3: `<start_of_image>`, SmolVLM / LLaVA: `<image>`);
each is replaced in the text by what the family's processor puts there (`ImageArithmetic.expansion`: Qwen's pad
repeated once per token, Gemma-3's newlines, image markers and 256 soft tokens per crop, Idefics3's tiles with their
row / column and global-image markers, LLaVA-OneVision's grid or, in a sample of several images, its base crop), from
the image's pixel size and `vision.max_pixels` (and the images in the sample), before
the text is tokenized, as the processor does; every token inside an expansion is -100: image tokens are never
labels. The collator turns the images into pixel values with the checkpoint's own image processor at the same cap and
checks that it made the token count the sample holds.

Our own reading rather than TRL's `DataCollatorForVisionLanguageModeling`: that collator needs the model's
processor class, and Qwen2/2.5-VL's loads its video processor, which needs torchvision (not loadable beside the CPU
build of torch); the PIL image processors transformers ships (`Qwen2VLImageProcessorPil`, `Gemma3ImageProcessorPil`,
`Idefics3ImageProcessorPil`, ...) need nothing more. A string content becomes one text part, as TRL's
`prepare_multimodal_messages` writes it (LLaVA-1.5's template renders parts only).
"""

from __future__ import annotations

import itertools
import logging
import re
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_ft.data.chat import IGNORE, Renderer, SampleError, chat_template_for, labels_for, samples
from lowmem_ft.data.formats import BadLine
from lowmem_ft.data.sources import DataSource
from lowmem_ft.errors import UserError
from lowmem_ft.vision.families import ImageArithmetic
from lowmem_ft.vision.images import BadImage, ImageFile, image_entry
from lowmem_ft.vision.rows import (
    IMAGE_PLACEHOLDER,
    as_messages,
    as_source,
    image_entries,
    image_rows,
    images_first,
    placeholders,
)

log = logging.getLogger(__name__)


@dataclass
class VisionData:
    """Tokenized image rows and the account of them."""

    records: list[dict[str, Any]]  # input_ids, labels, images (absolute paths), image_tokens (per image)
    rows: int = 0
    skipped: Counter = field(default_factory=Counter)  # why → rows skipped (--skip-bad-lines)
    too_long: int = 0  # samples dropped: longer than max_seq_len (never cut inside their image tokens)

    def summary(self, max_pixels: int) -> dict[str, Any]:
        per_sample = sorted(sum(r["image_tokens"]) for r in self.records)
        images = sorted(len(r["images"]) for r in self.records)
        lengths = sorted(len(r["input_ids"]) for r in self.records)
        pixels = sorted(p for r in self.records for p in r["pixels"])  # each image's own, before the cap

        def pct(xs: list[int], q: float) -> int:
            return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0

        return {
            "rows": self.rows,
            "samples": len(self.records),
            "images_per_sample": {"p50": pct(images, 0.5), "max": images[-1] if images else 0},
            "image_tokens_per_sample": {
                "p50": pct(per_sample, 0.5),
                "p99": pct(per_sample, 0.99),
                "max": per_sample[-1] if per_sample else 0,
            },  # fmt: skip
            "tokens_per_sample": {"p50": pct(lengths, 0.5), "max": lengths[-1] if lengths else 0},
            "pixels_per_image": {"p50": pct(pixels, 0.5), "p99": pct(pixels, 0.99), "max": pixels[-1] if pixels else 0},
            "max_pixels": max_pixels,
            "dropped_too_long": self.too_long,
            "skipped": dict(self.skipped),
        }


def _with_image_parts(message: dict) -> dict:
    """A message whose text says `<image>` (LLaMA-Factory) as TRL's content parts: the text around each placeholder,
    an image part in its place."""
    content = message.get("content")
    if not isinstance(content, str) or IMAGE_PLACEHOLDER not in content:
        return message
    parts: list[dict] = []
    for i, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return {**message, "content": parts}


def _as_parts(message: dict) -> dict:
    """A string content as one text part, as TRL's `prepare_multimodal_messages` writes it: the VLM templates render
    both alike (Qwen2.5-VL's, SmolVLM's) or only parts (LLaVA-1.5's, whose `selectattr('type', ...)` drops a
    string)."""
    content = message.get("content")
    return {**message, "content": [{"type": "text", "text": content}]} if isinstance(content, str) else message


def _check_record(record: dict) -> tuple[list[dict], list[Any]]:
    messages, images = as_messages(record), image_entries(record)
    if images and not placeholders(messages):  # no image's place marked: before the first user text, as TRL does
        messages = images_first(messages, len(images))
    messages = [_as_parts(_with_image_parts(m)) if isinstance(m, dict) else m for m in messages]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise BadImage(f"message {i + 1} needs a role of system, user or assistant")
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
                    raise BadImage(f"message {i + 1}: content parts must be {{'type': 'text'|'image'}} objects")
        elif not isinstance(content, str):
            raise BadImage(f"message {i + 1}: content must be a string or a list of parts")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadImage("has no assistant message to learn")
    n = placeholders(messages)
    if n != len(images):
        raise BadImage(
            f"has {n} image placeholder(s) ({{'type': 'image'}} parts or <image>) but {len(images)} image(s)"
        )
    return messages, images


def _expand(text: str, spans: list[tuple[int, int]], placeholder: str, expansions: list[str]):
    """(text, spans, image spans): each image placeholder the template rendered replaced by the text the processor
    puts there (`ImageArithmetic.expansion`), as the processor does before it tokenizes; the loss spans moved with
    it, and the character spans of the expansions (their tokens are never labels)."""
    out, images, last = [], [], 0
    starts: list[tuple[int, int]] = []  # (where a placeholder ended in `text`, its growth)
    for expansion in expansions:
        at = text.index(placeholder, last)
        out.append(text[last:at])
        begin = sum(len(piece) for piece in out)
        out.append(expansion)
        images.append((begin, begin + len(expansion)))
        last = at + len(placeholder)
        starts.append((last, len(expansion) - len(placeholder)))
    out.append(text[last:])

    def shifted(position: int) -> int:
        return position + sum(grow for end, grow in starts if end <= position)

    moved = [(shifted(start), shifted(end)) for start, end in spans]
    return "".join(out), moved, images


def tokenize_row(
    record: dict, base: Path, tokenizer, render: Renderer, images: ImageArithmetic, max_pixels: int,
    decode: bool = True,
) -> list[dict[str, Any]]:  # fmt: skip
    """The samples of one row (one, or one per trained turn where the template is not prefix-stable); its images
    decoded once (`decode`) or their headers read. Raises BadImage / SampleError."""
    messages, entries = _check_record(record)
    files: list[ImageFile] = [image_entry(entry, base, i, decode) for i, entry in enumerate(entries)]
    out = []
    for text, spans in samples({"messages": messages}, render):
        k = text.count(images.placeholder)  # a sample cut at an earlier turn holds the images before it
        if k > len(files):
            raise BadImage(f"the chat template rendered {k} image placeholder(s) for {len(files)} image(s)")
        # an image's tokens may depend on how many the sample holds (LLaVA-OneVision: a grid for one, the base
        # crop for each of several)
        counts = [images.tokens(f.height, f.width, max_pixels, k) for f in files[:k]]
        expansions = [images.expansion(f.height, f.width, max_pixels, k) for f in files[:k]]
        text, spans, image_spans = _expand(text, spans, images.placeholder, expansions)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        labels = labels_for(ids, offsets, text, spans, render.template.masking)
        for i, (start, end) in enumerate(offsets):  # an image's tokens are never labels (train_on_prompt too)
            if any(begin <= start and end <= stop for begin, stop in image_spans):
                labels[i] = IGNORE
        out.append({"input_ids": ids, "labels": labels, "images": [f.path for f in files[:k]],
                    "image_tokens": counts, "pixels": [f.width * f.height for f in files[:k]],
                    "sizes": [(f.height, f.width) for f in files[:k]]})  # fmt: skip
    return out


def load_vision_data(
    data: str | Path | DataSource, tokenizer, images: ImageArithmetic, *, max_pixels: int, max_seq_len: int,
    skip_bad_lines: bool = False, decode: bool = True,
) -> VisionData:  # fmt: skip
    """Every row of a data set of image chats (a file, directory, saved or Hub data set: `lowmem_ft.vision.rows`),
    tokenized; one line naming the row for a bad one (or, with `skip_bad_lines`, skipped and counted). `decode`:
    every image decoded once, so a truncated one fails here (training); else only its header is read (`data stats`,
    the planner's profile)."""
    source = as_source(data)
    render = Renderer(tokenizer, chat_template_for(tokenizer, train_on_prompt=False))
    out = VisionData([])
    for where, base, record in image_rows(source):
        out.rows += 1
        try:
            if isinstance(record, BadLine):
                raise BadImage(str(record))
            for sample in tokenize_row(record, base, tokenizer, render, images, max_pixels, decode):
                if len(sample["input_ids"]) > max_seq_len:  # never cut inside its image tokens: dropped, counted
                    out.too_long += 1
                elif any(label != IGNORE for label in sample["labels"]):
                    out.records.append(sample)
        except (BadImage, SampleError) as exc:
            if not skip_bad_lines:
                raise UserError(f"{where}: {exc}; fix or remove the row (or pass --skip-bad-lines)") from None
            out.skipped[re.sub(r" \([^)]*\)", "", str(exc))] += 1  # the reason, without the row's particulars
            log.warning("%s: skipped: %s", where, exc)
    if out.too_long:
        log.warning(
            "%s: %d sample(s) longer than memory.max_seq_len=%d with their image tokens dropped (an image is never "
            "cut); lower vision.max_pixels or raise memory.max_seq_len to keep them", source.label, out.too_long,
            max_seq_len,
        )  # fmt: skip
    if not out.records:
        raise UserError(f"{source.label}: no trainable sample (rows {out.rows}, too long {out.too_long}, skipped "
                        f"{sum(out.skipped.values())})")  # fmt: skip
    return out


class VisionCollator:
    """Right-padded ids and labels, and the batch's images as the checkpoint's image processor makes them (at
    `max_pixels`), as the model takes them (`ImageArithmetic.process`: Qwen-VL's pixel_values rows of all images with
    one image_grid_thw each; Gemma-3's one pixel square per crop, and its token_type_ids; Idefics3's tiles per sample,
    zero-padded, with their mask; LLaVA's one crop per image; LLaVA-OneVision's crops per sample with image_sizes)."""

    def __init__(self, image_processor, pad_token_id: int, images: ImageArithmetic, max_pixels: int,
                 files: str = "images", image_token_id: int = -1):  # fmt: skip
        self.image_processor = image_processor
        self.files = files  # the column of image paths (`image_files` in a trainer's dataset: TRL reads `images`)
        self.pad = pad_token_id
        self.images = images
        self.max_pixels = max_pixels
        self.image_token_id = image_token_id
        self.made: deque = deque(maxlen=256)  # weak references to the image tensors of the batches made, newest last

    def pixels_held(self) -> int:
        """Bytes of the image tensors this collator made that are still alive: the batches the trainer holds (every
        micro batch of the optimizer step, collated before the first, and the one the loader collated ahead)."""
        alive = [ref() for ref in self.made]
        return sum(t.numel() * t.element_size() for t in alive if t is not None)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        from lowmem_ft.vision.images import load_rgb

        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), self.pad, dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            labels[i, :n] = torch.tensor(f["labels"])
            mask[i, :n] = 1
        batch: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        batch |= self.images.text_inputs(ids, self.image_token_id)
        if any(f[self.files] for f in features):
            images = [[load_rgb(p) for p in f[self.files]] for f in features]
            inputs, made = self.images.process(self.image_processor, images, self.max_pixels)
            expected = [t for f in features for t in f["image_tokens"]]
            if made != expected:  # the arithmetic and the processor disagree: a bug, never trained through
                raise RuntimeError(f"image processor made {made} tokens per image, the data holds {expected}")
            batch |= inputs
            self.made.extend(weakref.ref(t) for t in inputs.values() if isinstance(t, torch.Tensor))
        return batch

    def split(self, inputs: dict[str, Any], rows: int) -> list[dict[str, Any]]:
        """A micro batch this collator made, as consecutive pieces of at most `rows` samples, each with exactly its
        samples' images: what the OOM guard runs when it halves a micro batch (`lowmem_ft.train.resilience.guard`).

        Rows of ids, labels, masks and per-row image inputs (Idefics3's tiles) are sliced; inputs of one entry per
        image unit (Qwen-VL's pixel_values rows, concatenated over every image's patches, with one image_grid_thw
        each; Gemma-3's crops; LLaVA's and LLaVA-OneVision's images) go with the sample whose image tokens they
        fill, found by counting each row's image tokens against the units' (`ImageArithmetic.image_units`). A piece
        without images carries no image inputs, as the collator makes such a batch."""
        ids = inputs["input_ids"]
        batch = ids.shape[0]
        if rows >= batch:
            return [inputs]
        tokens, entries = self.images.image_units(inputs) if "pixel_values" in inputs else ([], {})
        per_row = (ids == self.image_token_id).sum(1).tolist()
        owner = _owners(per_row, tokens) if entries else []
        text = {"input_ids", "attention_mask", "labels", *self.images.text_inputs(ids[:1], self.image_token_id)}
        pieces = []
        for start in range(0, batch, rows):
            stop = min(start + rows, batch)
            units = [u for u, r in enumerate(owner) if start <= r < stop]  # consecutive: images are in sample order
            imageless = self.image_token_id >= 0 and not any(per_row[start:stop])
            piece: dict[str, Any] = {}
            for key, value in inputs.items():
                if imageless and key not in text:
                    continue
                if key in entries:
                    if units:
                        offsets = [0, *itertools.accumulate(entries[key])]
                        piece[key] = value[offsets[units[0]] : offsets[units[-1] + 1]]
                elif key == "batch_num_images":  # LLaVA-OneVision: images of each sample that has any
                    if units:
                        piece[key] = value.new_tensor(list(Counter(owner[u] for u in units).values()))
                elif hasattr(value, "shape") and value.dim() > 0:
                    if value.shape[0] != batch:
                        raise ValueError(f"cannot split image input {key!r} of shape {tuple(value.shape)} by samples")
                    piece[key] = value[start:stop]
                else:
                    piece[key] = value
            pieces.append(piece)
        return pieces


def _owners(per_row: list[int], tokens: list[int]) -> list[int]:
    """The row each image unit belongs to: units are in sample order, and a row's image tokens are its units'."""
    owner, unit = [], 0
    for row, count in enumerate(per_row):
        held = 0
        while held < count and unit < len(tokens):
            held += tokens[unit]
            owner.append(row)
            unit += 1
        if held != count:
            raise RuntimeError(f"row {row} holds {count} image tokens, its images {held}: cannot split the batch")
    if unit != len(tokens):
        raise RuntimeError(f"{len(tokens) - unit} image(s) of the batch have no image tokens: cannot split it")
    return owner
