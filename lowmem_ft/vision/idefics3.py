"""Idefics3 / SmolVLM's images as numbers: how an image is resized, split into tiles plus a global image, and which
tokens stand for it in the decoder's sequence: the `ImageArithmetic` of `lowmem_ft.vision.families`. Pure arithmetic
but `process` (the collator's call into transformers).

The rule, read in transformers 5.24 (image_processing_pil_idefics3.py `Idefics3ImageProcessorPil._preprocess`; the
SmolVLM copy is identical, image_processing_pil_smolvlm.py):

1. resize so the longest edge is `size.longest_edge` (up or down, aspect kept, the other side rounded up to even;
   `_resize_output_size_rescale_to_max_len`), then below 4096 on either side;
2. `resize_for_vision_encoder`: the longest side up to a multiple of the tile (`max_image_size.longest_edge`), the
   other side from the aspect ratio, then up to a multiple of the tile too;
3. `split_images`: an image larger than one tile becomes rows × cols tiles and a global image (the whole image
   resized to one tile); an image of one tile stays one.

Every tile is `image_seq_len` tokens in the decoder: the tower's (tile / patch)² patches, pixel-shuffled by
scale_factor² (SmolVLM-Instruct: (384 / 14)² = 729 patches / 9 = 81). The processor writes an image as
(processing_idefics3.py `replace_image_token`, processing_smolvlm.py `_prompt_split_image`)

    <fake_token_around_image><row_1_col_1><image>×seq … one per tile, "\\n" after each row,
    "\\n"<fake_token_around_image><global-img><image>×seq<fake_token_around_image>

and a single tile as `<fake_token_around_image><global-img><image>×seq<fake_token_around_image>`.

The resolution knob is `size.longest_edge`; lowmem-ft's `vision.max_pixels` names it by its area: the longest edge
is the largest multiple of the tile whose square is within `vision.max_pixels` (at least one tile), so the planner's
caps are (k · tile)² for k tiles per side.

`tokens` counts the `<image>` tokens (seq_len per tile: the features the connector scatters into the sequence, what
every family's `tokens` counts); `positions` counts all the expansion takes in the sequence, its row / column and
global-image markers and newlines too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

MAX_IMAGE_SIZE = 4096  # image_processing_pil_idefics3.py: no side above it after the first resize
FAKE, GLOBAL, IMAGE = "<fake_token_around_image>", "<global-img>", "<image>"


@dataclass(frozen=True)
class Idefics3Images:
    """Idefics3 / SmolVLM's image processor (preprocessor_config.json) and the model's tokens per tile."""

    tile: int = 364  # max_image_size.longest_edge (Idefics3ImageProcessorPil's default; SmolVLM-Instruct: 384)
    longest_edge: int = 4 * 364  # size.longest_edge (SmolVLM-Instruct: 1536)
    seq_len: int = 169  # image tokens per tile: (image_size / patch)² / scale_factor²
    patches_per_tile: int = 676  # the tower's sequence per tile: (image_size / patch)²
    splitting: bool = True  # do_image_splitting
    channels: int = 3
    newline_pair: int = 1  # tokens of "\n\n" between the last row and the global image (1: a merging BPE)
    placeholder: str = IMAGE  # what the chat template renders once per image
    image_token: str = IMAGE  # what the tower's features replace, seq_len times per tile

    @classmethod
    def from_preprocessor(cls, preprocessor: dict[str, Any], config: dict[str, Any] | None = None) -> Idefics3Images:
        config = config or {}
        vision = config.get("vision_config") or {}
        image_size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 32))
        scale = int(config.get("scale_factor", 2))
        patches = (image_size // patch) ** 2
        tile = int((preprocessor.get("max_image_size") or {}).get("longest_edge", cls.tile))
        return cls(
            tile=tile,
            longest_edge=int((preprocessor.get("size") or {}).get("longest_edge", 4 * tile)),
            seq_len=patches // scale**2,  # the model's count (Idefics3Connector.pixel_shuffle), which the processor's
            patches_per_tile=patches,  # processor_config.json image_seq_len must equal
            splitting=bool(preprocessor.get("do_image_splitting", True)),
        )

    # -- the knob -------------------------------------------------------------------------------------------------
    @property
    def max_pixels(self) -> int:
        """The checkpoint's own cap as an area: its longest edge squared."""
        return self.longest_edge**2

    def edge(self, max_pixels: int | None = None) -> int:
        """The longest edge `max_pixels` allows: a multiple of the tile, at least one tile."""
        if not max_pixels:
            return self.longest_edge
        return max(1, math.isqrt(max_pixels) // self.tile) * self.tile

    def default_cap(self) -> tuple[int, str]:
        """(the cap without data, why): the checkpoint's own longest edge."""
        return self.max_pixels, f"vision.max_pixels {self.max_pixels}: the checkpoint's own ({self.describe()})"

    def cap_why(self, cap: int) -> str:
        return f"vision.max_pixels {cap} ({self.describe(cap)})"

    def caps(self, ceiling: int) -> list[int]:
        """The caps the planner tries, largest first: k tiles per side, from the checkpoint's own down to one, none
        above `ceiling`."""
        caps = [(k * self.tile) ** 2 for k in range(self.longest_edge // self.tile, 0, -1)]
        return [cap for cap in caps if cap <= ceiling] or [ceiling]

    def with_cap(self, config: dict[str, Any], cap: int) -> dict[str, Any]:
        """preprocessor_config.json resizing at `cap`, for the weights a run saves."""
        return {**config, "size": {**(config.get("size") or {}), "longest_edge": self.edge(cap)}}

    def at_cap(self, cap: int) -> Idefics3Images:
        """The processor as a saved preprocessor_config.json at `cap` reads (`generate` of a run)."""
        return replace(self, longest_edge=self.edge(cap))

    def describe(self, max_pixels: int | None = None) -> str:
        k = self.edge(max_pixels) // self.tile
        tiles = f"≤ {k}×{k} tiles of {self.tile} px + a global image" if k > 1 and self.splitting else "1 tile"
        return f"longest edge {self.edge(max_pixels)}: {tiles}, ≤ {self.max_tokens(max_pixels)} tokens per image"

    # -- one image ------------------------------------------------------------------------------------------------
    def resized(self, height: int, width: int, max_pixels: int | None = None) -> tuple[int, int]:
        """Steps 1 and 2: the (height, width) the image has before it is split."""
        edge = self.edge(max_pixels)
        aspect = width / height
        if width >= height:  # _resize_output_size_rescale_to_max_len
            width, height = edge, int(edge / aspect)
            height += height % 2
        else:
            height, width = edge, int(edge * aspect)
            width += width % 2
        height, width = max(height, 1), max(width, 1)
        aspect = width / height  # _resize_output_size_scale_below_upper_bound
        if width >= height and width > MAX_IMAGE_SIZE:
            width, height = MAX_IMAGE_SIZE, max(int(MAX_IMAGE_SIZE / aspect), 1)
        elif height > width and height > MAX_IMAGE_SIZE:
            height, width = MAX_IMAGE_SIZE, max(int(MAX_IMAGE_SIZE * aspect), 1)
        if not self.splitting:
            return self.tile, self.tile
        t, aspect = self.tile, width / height  # resize_for_vision_encoder
        if width >= height:
            width = math.ceil(width / t) * t
            height = math.ceil(int(width / aspect) / t) * t
        else:
            height = math.ceil(height / t) * t
            width = math.ceil(int(height * aspect) / t) * t
        return height, width

    def grid(self, height: int, width: int, max_pixels: int | None = None) -> tuple[int, int]:
        """(rows, cols) of tiles; (0, 0) for an image of one tile (what the processor's rows / cols say)."""
        h, w = self.resized(height, width, max_pixels)
        if h > self.tile or w > self.tile:
            return h // self.tile, w // self.tile
        return 0, 0

    def tiles(self, height: int, width: int, max_pixels: int | None = None) -> int:
        """Images the tower sees for this one: rows × cols tiles and the global image, or the one tile."""
        rows, cols = self.grid(height, width, max_pixels)
        return rows * cols + 1

    @property
    def patches_per_token(self) -> int:
        """Tower patches behind one image token: the connector's pixel shuffle folds scale_factor² into one."""
        return self.patches_per_tile // self.seq_len

    def patches(self, height: int, width: int, max_pixels: int | None = None) -> int:
        return self.tiles(height, width, max_pixels) * self.patches_per_tile

    def expansion(self, height: int, width: int, max_pixels: int | None = None, images_in_sample: int = 1) -> str:
        """The text the image's `<image>` placeholder becomes (the processor's own expansion)."""
        seq = IMAGE * self.seq_len
        single = f"{FAKE}{GLOBAL}{seq}{FAKE}"
        rows, cols = self.grid(height, width, max_pixels)
        if not rows:
            return single
        lines = "".join(
            "".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{seq}" for c in range(cols)) + "\n" for r in range(rows)
        )
        return f"{lines}\n{single}"

    def tokens(self, height: int, width: int, max_pixels: int | None = None, images_in_sample: int = 1) -> int:
        """`<image>` tokens of one image: seq_len per tile."""
        return self.seq_len * self.tiles(height, width, max_pixels)

    def positions(self, height: int, width: int, max_pixels: int | None = None) -> int:
        """Positions the image takes in the decoder's sequence (`expansion` tokenized: every special one token, "\\n"
        one, the "\\n\\n" before the global image `newline_pair`)."""
        rows, cols = self.grid(height, width, max_pixels)
        single = self.seq_len + 3
        if not rows:
            return single
        return rows * (cols * (self.seq_len + 2) + 1) + self.newline_pair - 1 + single

    def max_tokens(self, max_pixels: int | None = None) -> int:
        """The most `<image>` tokens one image makes under `max_pixels`: a square image split k × k."""
        k = self.edge(max_pixels) // self.tile
        return self.tokens(k * self.tile, k * self.tile, max_pixels)

    # -- the processor --------------------------------------------------------------------------------------------
    def processor_kwargs(self, max_pixels: int) -> dict[str, Any]:
        return {"size": {"longest_edge": self.edge(max_pixels)}, "return_row_col_info": True}

    def process(self, processor, images: list[list], cap: int) -> tuple[dict[str, Any], list[int]]:
        """(pixel_values (batch, most tiles, 3, tile, tile) and pixel_attention_mask, zero-padded per sample; the
        `<image>` tokens the processor's tiling makes of each image, in order) for each sample's PIL images. The
        processor's rows × cols are checked against this arithmetic's grid too: the expansion's row / column markers
        follow it, and a 2 × 3 grid for a 3 × 2 one would make the same token count."""
        out = processor(images=images, **self.processor_kwargs(cap), return_tensors="pt")
        grids = [list(zip(r, c, strict=True)) for r, c in zip(out.pop("rows"), out.pop("cols"), strict=True)]
        expected = [[self.grid(image.height, image.width, cap) for image in sample] for sample in images]
        if grids != expected:  # the arithmetic and the processor disagree: a bug, never trained through
            raise RuntimeError(f"image processor tiled the images {grids}, the arithmetic gives {expected}")
        made = [self.seq_len * (r * c + 1) for sample in grids for r, c in sample]
        return dict(out), made

    def image_units(self, inputs: dict[str, Any]) -> tuple[list[int], dict[str, list[int]]]:
        """None per image: pixel_values and pixel_attention_mask hold one row per sample (tiles padded per sample),
        so `VisionCollator.split` cuts them by rows."""
        del inputs
        return [], {}

    def text_inputs(self, input_ids, image_token_id: int) -> dict[str, Any]:
        del input_ids, image_token_id
        return {}
