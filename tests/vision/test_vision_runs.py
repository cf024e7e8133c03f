"""Image runs like every run: the OOM guard's cut of a micro batch of image chats (each piece holds exactly its
samples' images, and the pieces' losses add up to the whole batch's), on every family's tiny checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_ft.vision.data import VisionCollator, load_vision_data
from lowmem_ft.vision.families import VISION_FAMILIES
from tests.vision.conftest import ROWS, write_rows

TEXT_ONLY = {
    "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}],
    "images": [],
}
# samples with 2, 0, 1 and 1 images: no family's image units line up with the rows by chance
BATCH = [ROWS[1], TEXT_ONLY, ROWS[0], ROWS[2]]


def _collated(model: str, folder: Path):
    from transformers import AutoImageProcessor, AutoTokenizer

    config = json.loads((Path(model) / "config.json").read_text())
    images = VISION_FAMILIES[config["model_type"]].images(
        json.loads((Path(model) / "preprocessor_config.json").read_text()), config
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    data = load_vision_data(write_rows(folder, BATCH), tokenizer, images, max_pixels=images.max_pixels,
                            max_seq_len=4096)  # fmt: skip
    assert len(data.records) == len(BATCH)
    collate = VisionCollator(AutoImageProcessor.from_pretrained(model), tokenizer.pad_token_id, images,
                             images.max_pixels, image_token_id=tokenizer.convert_tokens_to_ids(images.image_token))  # fmt: skip
    return collate, data.records


ROW_KEYS = {"input_ids", "attention_mask", "labels", "token_type_ids", "mm_token_type_ids"}  # one row per sample
FAMILIES = ["qwen_vl", "gemma3_vl", "smolvlm", "llava", "llava_onevision"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cut_micro_batch_keeps_each_samples_images(family, request, tmp_path):
    """Each piece's image inputs are exactly what the collator makes of that piece's samples alone (Qwen-VL's
    pixel_values rows are concatenated over the batch's images, Gemma-3's are crops: a row slice would be wrong);
    its rows are the whole batch's rows."""
    import torch

    collate, records = _collated(request.getfixturevalue(family), tmp_path)
    whole = collate(records)
    for rows in (1, 2, 3):
        pieces = collate.split(whole, rows)
        assert len(pieces) == -(-len(records) // rows)
        for i, piece in enumerate(pieces):
            alone = collate(records[i * rows : (i + 1) * rows])
            width = alone["input_ids"].shape[1]
            torch.testing.assert_close(piece["input_ids"], whole["input_ids"][i * rows : (i + 1) * rows])
            torch.testing.assert_close(piece["input_ids"][:, :width], alone["input_ids"])
            assert set(piece) - ROW_KEYS == set(alone) - ROW_KEYS, (family, rows, i)
            for key in set(alone) - ROW_KEYS:
                ours, theirs = piece[key], alone[key]
                if ours.dim() > 1 and ours.shape[1] > theirs.shape[1]:  # tiles / crops padded to the whole's most
                    assert not ours[:, theirs.shape[1] :].any()
                    ours = ours[:, : theirs.shape[1]]
                torch.testing.assert_close(ours, theirs, msg=f"{family} rows {rows} piece {i} {key}")


@pytest.mark.parametrize("family", ["qwen_vl", "gemma3_vl"])
def test_the_pieces_losses_add_up_to_the_whole_batchs(family, request, tmp_path):
    """The model's loss on the whole micro batch equals the label-weighted sum of its losses on the pieces the guard
    runs (what `MemorySafe._pieces` accumulates): a wrong cut would pair a sample with another's image."""
    import torch
    from transformers import AutoModelForImageTextToText

    model_dir = request.getfixturevalue(family)
    collate, records = _collated(model_dir, tmp_path)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    whole = collate(records)
    with torch.no_grad():
        expected = model(**whole).loss
        total = int(whole["labels"][:, 1:].ne(-100).sum())
        for rows in (1, 2):
            pieces = collate.split(whole, rows)
            summed = sum(model(**p).loss * int(p["labels"][:, 1:].ne(-100).sum()) / total for p in pieces)
            torch.testing.assert_close(summed, expected)


@pytest.mark.parametrize("how", ["eval_fraction", "eval_split", "eval_path"])
def test_eval_image_chats_come_as_the_text_paths_do(qwen_vl, tmp_path, how):
    """`data.eval_fraction` holds out samples of the training rows (seeded), `data.eval_split` reads a folder's test
    split, `data.eval_path` another data set: each tokenized as image chats, with its images."""
    from transformers import AutoTokenizer

    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.vision.setup import vision_of

    folder = tmp_path / "data"
    write_rows(folder, ROWS * 2, name="train.jsonl")
    write_rows(folder, [ROWS[1]], name="test.jsonl")
    sets = {"eval_fraction": ["data.eval_fraction=0.34"], "eval_split": ["data.eval_split=test"],
            "eval_path": [f"data.eval_path={folder / 'test.jsonl'}"]}[how]  # fmt: skip
    path = folder if how == "eval_split" else folder / "train.jsonl"
    recipe = resolve("8gb", [f"model.name_or_path={qwen_vl}", f"data.path={path}", *sets])
    train, evaluation, summary = vision_of(recipe).prepare(recipe, AutoTokenizer.from_pretrained(qwen_vl))
    held = 2 if how == "eval_fraction" else 1
    assert (len(train), len(evaluation)) == (2 * len(ROWS) - (held if how == "eval_fraction" else 0), held)
    assert summary["eval_records"] == held and summary["eval_source"]
    if how != "eval_fraction":  # the test split's one row: two images, its image files beside the data
        assert [len(files) for files in evaluation["image_files"]] == [2]
        assert all(Path(f).is_file() for f in evaluation["image_files"][0])
