"""A run's vision-language side, decided once from the recipe: the family, the image arithmetic, the resolution cap
(`vision.max_pixels`) and why, the data and its collator. `plan`, `train` and `data` all ask `vision_of(recipe)`,
so they agree on the cap and on every sample's image tokens.

The cap: `vision.max_pixels` when the recipe sets it, else the family's default (`ImageArithmetic.default_cap`):
for Qwen-VL the smaller of the checkpoint's own (preprocessor_config.json; Qwen2.5-VL ships 12,845,056 pixels =
16,384 tokens per image) and 1280·28·28, the cap Qwen's model card recommends (`lowmem_ft.vision.qwen_vl`); Gemma-3
has none (every image is 256 tokens, `lowmem_ft.vision.gemma3`), nor have LLaVA-1.5 (a fixed crop,
`lowmem_ft.vision.llava`) and LLaVA-OneVision (grids fixed by its pinpoints, `lowmem_ft.vision.llava_onevision`);
Idefics3 / SmolVLM's is the checkpoint's own longest edge (`lowmem_ft.vision.idefics3`: k × k tiles). An image at
Qwen's shipped cap can make one sample's logits alone 16,384 × 152,064 × 4 bytes = 9.3 GB in fp32; at 1280 tokens they
are 0.7 GB. The planner then sizes `memory.max_seq_len` from the data's lengths *with*
their image tokens (`profile`); samples longer than it are dropped and counted, never cut inside an image.

Not done here: choosing the cap jointly with the batch and the savers against the VRAM target (the cap is fixed before
planning), and `vision.train` (the tower is always frozen).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_ft.errors import UserError
from lowmem_ft.vision.families import KNOWN_VLMS, VISION_FAMILIES, ImageArithmetic, VisionFamily, vision_family


@dataclass(frozen=True)
class VisionSetup:
    family: VisionFamily
    images: ImageArithmetic  # the checkpoint's processor, as numbers
    max_pixels: int  # the cap this run resizes to
    why: str  # how the cap was chosen, for the plan and the banner

    @property
    def max_tokens_per_image(self) -> int:
        return self.images.max_tokens(self.max_pixels)

    def load(self, recipe, tokenizer, source=None, decode: bool = True):
        """The image chats of `source` (default: the recipe's training data), tokenized at this cap; `decode`: each
        image decoded once (training), else its header read (`data stats`, the planner's profile)."""
        from lowmem_ft.data.sources import sources_of
        from lowmem_ft.vision.data import load_vision_data

        if source is None:
            if recipe.data.mix:
                raise UserError(
                    "vision-language training reads one data set of image chats (--data), not data.mix; combine "
                    "them into one file or folder"
                )
            (source,) = sources_of(recipe)
        return load_vision_data(
            source, tokenizer, self.images, max_pixels=self.max_pixels,
            max_seq_len=recipe.memory.max_seq_len if recipe.memory.max_seq_len else 1 << 30,
            skip_bad_lines=recipe.data.skip_bad_lines, decode=decode,
        )  # fmt: skip

    def profile(self, recipe, tokenizer):
        """The data's token lengths with their image tokens at this cap (before any max_seq_len), from the images'
        headers (nothing decoded)."""
        from dataclasses import replace

        from lowmem_ft.data.profile import LengthProfile

        data = self.load(replace(recipe, memory=replace(recipe.memory, max_seq_len=0)), tokenizer, decode=False)
        profile = LengthProfile.from_lengths([len(r["input_ids"]) for r in data.records])
        exact = getattr(self.images, "sample_patches", None)  # patches that are no multiple of tokens (OneVision)
        patches = max(
            exact(r["sizes"]) if exact else sum(r["image_tokens"]) * self.images.patches_per_token for r in data.records
        )
        return replace(profile, image_patches=patches)  # the tower's and the pixel values' worst sample

    def prepare(self, recipe, tokenizer) -> tuple[Any, Any, dict[str, Any]]:
        """(train dataset, eval dataset or None, data summary) for the trainer; the images stay files until the
        collator opens them. Eval data as the text path finds it: `data.eval_path`, `data.eval_split`, or
        `data.eval_fraction` of the training rows' samples held out (`lowmem_ft.data.prepare.held_out_split`)."""
        from lowmem_ft.data.prepare import held_out_split
        from lowmem_ft.data.sources import eval_source_of

        data = self.load(recipe, tokenizer)
        records, held, where = data.records, [], None
        source = eval_source_of(recipe)
        if source is not None:
            held, where = self.load(recipe, tokenizer, source).records, source.label
        elif recipe.data.eval_fraction > 0:
            seed, fraction = recipe.training.seed, recipe.data.eval_fraction
            keep, out = held_out_split(len(records), fraction, seed)
            records, held = [records[i] for i in keep], [records[i] for i in out]
            where = f"held out {fraction:g} of {recipe.data.path} (seed {seed})"
        summary = {
            "format": "messages + images",
            "loss_on": "assistant turns",
            "vision": data.summary(self.max_pixels) | {"max_pixels_why": self.why},
            "records": len(records),
            "eval_records": len(held),
            "eval_source": where,
        }
        return _dataset(records), _dataset(held) if held else None, summary

    def describe(self, recipe) -> dict[str, Any]:
        """What `plan` says about the images: the cap and why, and with data the image tokens per sample."""
        out: dict[str, Any] = {"max_pixels": self.max_pixels, "max_tokens_per_image": self.max_tokens_per_image,
                               "why": self.why}  # fmt: skip
        if recipe.data.path:
            from dataclasses import replace

            unbounded = replace(recipe, memory=replace(recipe.memory, max_seq_len=0))
            out["data"] = self.load(unbounded, _tokenizer(recipe), decode=False).summary(self.max_pixels)
        return out

    def banner(self, summary: dict[str, Any]) -> str:
        """The banner's images line: images per sample, image tokens per sample and the cap (`prepare`'s summary)."""
        v = summary["vision"]
        n, t = v["images_per_sample"], v["image_tokens_per_sample"]
        cap = (
            f"≤ {self.max_tokens_per_image} tokens per image at vision.max_pixels {self.max_pixels}"
            if len(self.images.caps(self.max_pixels)) > 1
            else f"{self.max_tokens_per_image} tokens per image at most, fixed by the checkpoint"
        )
        return (
            f"{n['p50']} per sample at p50 ({n['max']} at most), {t['p50']} image tokens per sample at p50 "
            f"({t['max']} at most); {cap}"
        )

    def save_preprocessor(self, recipe, directory: Path) -> None:
        """The checkpoint's preprocessor_config.json with this run's cap, beside the saved weights: what loads the
        image processor for them resizes images as training did. The checkpoint's processor_config.json goes beside
        it as it is (Idefics3's image_seq_len, LLaVA's patch_size and feature strategy, Gemma-3's image_seq_length:
        what `AutoProcessor` needs to expand the image tokens)."""
        config = self.images.with_cap(_preprocessor(recipe.model.name_or_path), self.max_pixels)
        (Path(directory) / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")
        processor = Path(recipe.model.name_or_path) / "processor_config.json"
        if processor.is_file():
            shutil.copy2(processor, Path(directory) / processor.name)

    def collator(self, recipe, tokenizer):
        from transformers import AutoImageProcessor

        from lowmem_ft.vision.data import VisionCollator

        processor = AutoImageProcessor.from_pretrained(recipe.model.name_or_path)
        image_token_id = tokenizer.convert_tokens_to_ids(self.images.image_token)
        return VisionCollator(processor, tokenizer.pad_token_id, self.images, self.max_pixels, files="image_files",
                              image_token_id=image_token_id)  # fmt: skip


def _dataset(records: list[dict[str, Any]]):
    """The trainer's dataset of tokenized image chats: ids, labels, and the image files the collator opens."""
    from datasets import Dataset

    return Dataset.from_list(
        [{"input_ids": r["input_ids"], "labels": r["labels"], "image_files": r["images"],
          "image_tokens": r["image_tokens"], "sizes": r["sizes"]} for r in records]
    )  # fmt: skip


def vision_lines(described: dict[str, Any]) -> list[str]:
    """The plan's lines about the images (`VisionSetup.describe`)."""
    lines = [f"  images   {described['why']}"]
    data = described.get("data")
    if data:
        t, n = data["image_tokens_per_sample"], data["images_per_sample"]
        lines.append(
            f"           image tokens per sample p50 {t['p50']}, p99 {t['p99']}, max {t['max']} "
            f"({n['p50']} image(s) per sample at p50, {n['max']} at most); "
            f"samples p50 {data['tokens_per_sample']['p50']} tokens with their images"
        )
    return lines


def choose_cap(start, overrides: dict, plan) -> tuple[dict, Any, str | None]:
    """The resolution cap the planner trains at, chosen with the plan: the largest of the family's caps
    (`ImageArithmetic.caps`: Qwen-VL's `CAP_TOKENS` within the checkpoint's own cap; Idefics3's k tiles a side;
    Gemma-3's, LLaVA's and LLaVA-OneVision's one) at which the plan's `memory.max_seq_len` keeps every sample whole
    with its image tokens, else the smallest. `plan(overrides, profile)` plans as `choose_recipe` does. Returns (overrides with
    vision.max_pixels set, the length profile at that cap, why); the overrides and None as they were for a text model,
    a recipe that sets vision.max_pixels, or no data."""
    from dataclasses import replace

    from lowmem_ft.recipe.load import merge

    vision = vision_of(start)
    if vision is None or start.vision.max_pixels or not start.data.path:
        return overrides, run_profile(start), None
    tokenizer = _tokenizer(start)
    caps = vision.images.caps(vision.max_pixels)
    for i, cap in enumerate(caps):
        at_cap = replace(vision, max_pixels=cap)
        profile = at_cap.profile(replace(start, vision=replace(start.vision, max_pixels=cap)), tokenizer)
        chosen = merge(overrides, {"vision": {"max_pixels": cap}})
        recipe, _ = plan(chosen, profile)
        if recipe.memory.max_seq_len >= profile.max:
            why = vision.images.cap_why(cap)
            if len(caps) == 1:
                return chosen, profile, vision.why + _kept_with(recipe)
            if i:
                larger = caps[i - 1]
                why += (
                    f", the largest at which every sample fits whole in the plan's {recipe.memory.max_seq_len} "
                    f"tokens (at {larger} the longest would need more than the smallest setup fits)"
                )
            else:
                why += f": {vision.why.split(': ', 1)[-1]}; every sample fits whole"
            return chosen, profile, why + _kept_with(recipe)
    dropped = f"samples longer than the plan's {recipe.memory.max_seq_len} tokens are dropped and counted"
    if len(caps) == 1:
        return chosen, profile, f"{vision.why}; {dropped}"
    return chosen, profile, f"{vision.images.cap_why(cap)}, the smallest tried: {dropped}"


def with_images(arch, recipe, profile, request):
    """The planner's request with the images of a vision-language step: one sample's patches (`plan_patches`), and
    for `vision.train: full` 16-bit weights, fixed (the tower's own weights train: 4-/8-bit loading would quantize
    them, `lowmem_ft.vision.tower.modules_to_save`). The request as it was for a text model."""
    from dataclasses import replace

    if arch.vision is None:
        return request
    start = replace(request.start, image_patches=plan_patches(arch, recipe, profile))
    if recipe.vision.train == "full":
        start = replace(start, quantization="none")
        return replace(request, start=start, fixed=request.fixed | {"quantization"})
    return replace(request, start=start)


def plan_patches(arch, recipe, profile) -> int:
    """The patches of one sample the plan prices (`Setup.image_patches`) for a vision-language checkpoint trained on
    images (`vision_of`): the data's most (its images at the cap, `VisionSetup.profile`), else one image as large as
    the cap allows (`vision.max_pixels`, or the family's default cap). 0 for a text model, and for Gemma-3 on data
    without images (trained as text)."""
    if arch.vision is None:
        return 0
    if profile is not None and profile.image_patches:
        return profile.image_patches
    vision = vision_of(recipe)
    return 0 if vision is None else arch.vision.patches_at(vision.max_pixels)


def _kept_with(recipe) -> str:
    """What the plan at the chosen cap pays for it, for the reason line: the cap is stepped down only when no setup
    the planner searches (micro batch down to 1 with accumulation, NF4, checkpointing, the savers) fits the longest
    sample's image tokens."""
    m = recipe.memory
    storage = {"nf4": "NF4", "int8": "int8"}.get(recipe.model.quantization, "16-bit weights")
    savers = [name for name, on in (("gradient checkpointing", m.gradient_checkpointing),
              ("activation offloading", m.activation_offloading), ("tiled MLP", m.tiled_mlp)) if on]  # fmt: skip
    return f", with {storage}, micro batch {m.micro_batch_size}" + (f", {', '.join(savers)}" if savers else "")


def _tokenizer(recipe):
    from lowmem_ft.data.tokenize import load_tokenizer

    m = recipe.model
    return load_tokenizer(m.name_or_path, m.trust_remote_code, recipe.data.chat_template or None)


def run_profile(recipe):
    """The length profile the planner sizes `memory.max_seq_len` from: of image chats with their image tokens at the
    run's resolution cap when the model is a vision-language checkpoint (`vision_of`), else the text path's."""
    vision = vision_of(recipe)
    if vision is None:
        from lowmem_ft.data import length_profile

        return length_profile(recipe)
    return vision.profile(recipe, _tokenizer(recipe))


def _cached_config(model: str, trust_remote_code: bool) -> dict[str, Any]:
    """The config transformers loads for `model` (the Hub cache, offline), or {} when it loads none: the text path
    then says what is wrong, as it did before images were known."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code).to_dict()
    except Exception:  # noqa: BLE001 — any failure here is the text path's to report
        return {}


def _preprocessor(model: str) -> dict[str, Any]:
    path = Path(model) / "preprocessor_config.json"
    if Path(model).is_dir():
        if not path.is_file():
            raise UserError(f"model {model}: a vision-language checkpoint without preprocessor_config.json")
        return json.loads(path.read_text(encoding="utf-8"))
    from lowmem_ft.memory.arch import catalog_entry

    entry = catalog_entry(model)
    return (entry[1].get("preprocessor") if entry else None) or {}


def vision_of(recipe) -> VisionSetup | None:
    """The run's vision side when the recipe's model is a vision-language checkpoint lowmem-ft trains on images;
    None for a text model, and for Gemma-3 on data without images (trained as text, as before). Any other VLM is one
    line naming its family."""
    from lowmem_ft.memory.arch import load_config_dict

    model = recipe.model.name_or_path
    try:
        config, _ = load_config_dict(model)
    except UserError:  # a Hub id read from the cache while offline: the config transformers finds there, if any
        config = _cached_config(model, recipe.model.trust_remote_code)
    model_type = str(config.get("model_type", ""))
    if model_type not in KNOWN_VLMS and model_type not in VISION_FAMILIES:
        return None
    family = vision_family(model_type, model)
    if family.text_too and not _has_images(recipe):
        return None
    images = family.images(_preprocessor(model), config)
    asked = recipe.vision.max_pixels
    if asked:  # set by the user, or by the planner (`choose_cap`: the plan says why)
        return VisionSetup(family, images, asked, images.cap_why(asked))
    cap, why = images.default_cap()
    return VisionSetup(family, images, cap, why)


def _has_images(recipe) -> bool:
    """Whether the recipe's training data holds images (a row with an `images` list, or one `image`)."""
    from lowmem_ft.data.sources import sources_of
    from lowmem_ft.vision.rows import has_images

    if not recipe.data.path or recipe.data.mix:
        return False
    try:
        (source,) = sources_of(recipe)
    except UserError:  # the text path says what is wrong with the data
        return False
    return has_images(source)
