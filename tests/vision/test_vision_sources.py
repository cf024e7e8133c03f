"""Image chats in every shape users bring them read as the same samples: the same conversation from a JSONL file of
paths, a Parquet file / Arrow file / `save_to_disk` directory / Hub-style folder whose `images` column is a `datasets` `Image`
feature holding bytes, a plain Parquet file of raw bytes, base64 data URIs, LLaMA-Factory's ShareGPT with `<image>`,
and TRL's one `image` column with no placeholder; and each way such an image can be bad is one line naming the row."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest

from lowmem_ft.errors import UserError
from lowmem_ft.vision.data import load_vision_data
from lowmem_ft.vision.families import VISION_FAMILIES
from tests.vision.conftest import ROWS, write_images, write_rows


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWMEM_FT_CACHE", str(tmp_path / "cache"))  # image bytes are written under it


def _load(model: str, data, **kwargs):
    from transformers import AutoTokenizer

    config = json.loads((Path(model) / "config.json").read_text())
    preprocessor = json.loads((Path(model) / "preprocessor_config.json").read_text())
    images = VISION_FAMILIES[config["model_type"]].images(preprocessor, config)
    tokenizer = AutoTokenizer.from_pretrained(model)
    return load_vision_data(
        data, tokenizer, images, **({"max_pixels": images.max_pixels, "max_seq_len": 4096} | kwargs)
    )


def _parted(messages: list[dict]) -> list[dict]:
    """String contents as one text part: the one type an Arrow column of content holds."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]}
            for m in messages]  # fmt: skip


def _sharegpt(messages: list[dict]) -> list[dict]:
    """LLaMA-Factory's ShareGPT turns: image parts as `<image>` in the text."""
    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    out = []
    for m in _parted(messages):
        text = "".join("<image>" if p["type"] == "image" else p["text"] for p in m["content"])
        out.append({"from": roles[m["role"]], "value": text})
    return out


def _image_dataset(folder: Path, stored):
    """ROWS as a `datasets` Dataset whose images column is `List(Image())`, each image as `stored(file)` gives it."""
    from datasets import Dataset, Image, List

    rows = {"messages": [_parted(r["messages"]) for r in ROWS],
            "images": [[stored(folder / name) for name in r["images"]] for r in ROWS]}  # fmt: skip
    return Dataset.from_dict(rows).cast_column("images", List(Image()))


def _shapes(folder: Path) -> dict[str, Path]:
    """name → the data in that shape, all holding ROWS."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_images(folder)
    as_bytes = lambda path: {"bytes": path.read_bytes(), "path": None}  # noqa: E731 — what push_to_hub embeds
    out = {}
    ds = _image_dataset(folder, as_bytes)
    ds.to_parquet(str(folder / "images.parquet"))
    out["parquet, Image bytes"] = folder / "images.parquet"
    ds.save_to_disk(str(folder / "saved"))
    out["save_to_disk, Image bytes"] = folder / "saved"
    shutil.copy(next((folder / "saved").glob("*.arrow")), folder / "images.arrow")  # a datasets Arrow shard alone
    out["Arrow file, Image bytes"] = folder / "images.arrow"
    (folder / "hub" / "data").mkdir(parents=True)
    ds.to_parquet(str(folder / "hub" / "data" / "train-00000-of-00001.parquet"))
    out["Hub-style folder of shards"] = folder / "hub"
    table = pa.table({"messages": [_parted(r["messages"]) for r in ROWS],
                      "images": [[(folder / n).read_bytes() for n in r["images"]] for r in ROWS]})  # fmt: skip
    pq.write_table(table, folder / "raw.parquet")  # no datasets metadata: a list of binary
    out["parquet, raw bytes"] = folder / "raw.parquet"

    def uri(name: str) -> str:
        kind = "png" if name.endswith(".png") else "jpeg"
        return f"data:image/{kind};base64," + base64.b64encode((folder / name).read_bytes()).decode()

    out["base64 data URIs"] = _jsonl(
        folder / "b64.jsonl", [{**r, "images": [uri(n) for n in r["images"]]} for r in ROWS]
    )
    sharegpt = [{"conversations": _sharegpt(r["messages"]), "images": r["images"]} for r in ROWS]
    out["ShareGPT <image>"] = _jsonl(folder / "sharegpt.jsonl", sharegpt)
    return out


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("family", ["qwen_vl", "smolvlm"])
def test_every_shape_reads_as_the_same_samples(family, request, tmp_path):
    """ids, labels and image tokens of each shape equal those of the JSONL file of paths (itself checked against
    the processor in test_vision_data / test_idefics3)."""
    model = request.getfixturevalue(family)
    plain = _load(model, write_rows(tmp_path, [{**r, "messages": _parted(r["messages"])} for r in ROWS]))
    for shape, data in _shapes(tmp_path / "shapes").items():
        loaded = _load(model, data)
        assert len(loaded.records) == len(plain.records), shape
        for ours, theirs in zip(loaded.records, plain.records, strict=True):
            assert ours["input_ids"] == theirs["input_ids"], shape
            assert ours["labels"] == theirs["labels"], shape
            assert ours["image_tokens"] == theirs["image_tokens"] and ours["sizes"] == theirs["sizes"], shape
            assert all(Path(p).is_file() for p in ours["images"]), shape  # bytes became files the collator opens


def test_trl_single_image_column_without_placeholder_goes_before_the_user_text(qwen_vl, tmp_path):
    """TRL's `image` column and string contents (`prepare_multimodal_messages`): the image before the first user
    message's text, which is ROWS[0] exactly."""
    plain = _load(qwen_vl, write_rows(tmp_path, [ROWS[0]]))
    trl = {"messages": [{"role": "user", "content": "What colour is it?"}, {"role": "assistant", "content": "It is red."}],
           "image": "img/red.png"}  # fmt: skip
    ours = _load(qwen_vl, _jsonl(tmp_path / "trl.jsonl", [trl]))
    assert ours.records[0]["input_ids"] == plain.records[0]["input_ids"]
    assert ours.records[0]["labels"] == plain.records[0]["labels"]


def _bytes_row(data: bytes) -> dict:
    return {"messages": _parted(ROWS[0]["messages"]), "images": [{"bytes": data, "path": "photo.png"}]}


def _saved(folder: Path, rows: list[dict]) -> Path:
    from datasets import Dataset, Image, List

    Dataset.from_list(rows).cast_column("images", List(Image())).save_to_disk(str(folder / "saved"))
    return folder / "saved"


def test_bad_image_bytes_are_one_line_naming_the_row(qwen_vl, tmp_path):
    write_images(tmp_path)
    whole = (tmp_path / "img" / "red.png").read_bytes()
    good = _bytes_row(whole)
    cases = {
        "truncated": (whole[: len(whole) // 2], r"saved row 1: images\[0\] \('photo.png' bytes\) is truncated"),
        "not an image": (b"not a picture\n" * 8, r"saved row 1: images\[0\] \('photo.png' bytes\) is not an image"),
    }
    for case, (data, message) in cases.items():
        folder = tmp_path / case.replace(" ", "_")
        path = _saved(folder, [good, _bytes_row(data)])
        with pytest.raises(UserError, match=message) as info:
            _load(qwen_vl, path)
        assert "\n" not in str(info.value) and "fix or remove the row (or pass --skip-bad-lines)" in str(info.value)
        loaded = _load(qwen_vl, path, skip_bad_lines=True)  # or skipped and counted
        assert len(loaded.records) == 1 and sum(loaded.skipped.values()) == 1, case


JSONL_CASES = {
    "url while offline": (
        "http://example.com/a.png",
        r"b.jsonl:2: image 'http://example.com/a.png' is a URL; images "
        "must be local files or bytes",
    ),  # fmt: skip
    "bad base64": ("data:image/png;base64,@@@", r"b.jsonl:2: images\[0\] is a data URI whose base64 does not decode"),
    "not an image URI": ("data:text/plain;base64,aGk=", r"b.jsonl:2: images\[0\] is a data URI that is not a base64"),
    "placeholders != images": (["img/red.png", "img/red.png"], r"b.jsonl:2: has 1 image placeholder\(s\)"),
    "dict without bytes or path": ({"bytes": None}, r"b.jsonl:2: images\[0\] is a dict with neither"),
}


@pytest.mark.parametrize("case", list(JSONL_CASES))
def test_bad_image_entries_are_one_line_naming_the_row(qwen_vl, tmp_path, case):
    entry, message = JSONL_CASES[case]
    rows = [ROWS[0], {**ROWS[0], "images": entry if isinstance(entry, list) else [entry]}]
    path = write_rows(tmp_path, rows, name="b.jsonl")
    with pytest.raises(UserError, match=message) as info:
        _load(qwen_vl, path)
    assert "\n" not in str(info.value)
    assert len(_load(qwen_vl, path, skip_bad_lines=True).records) == 1


def test_an_image_over_the_decompression_bomb_limit_is_refused_from_its_header(qwen_vl, tmp_path, monkeypatch):
    """PIL refuses an image of more pixels than Image.MAX_IMAGE_PIXELS when it opens it (header only): refused
    whether the data is decoded (train) or not (data stats)."""
    from PIL import Image

    folder = tmp_path / "bomb"
    folder.mkdir()
    Image.new("RGB", (77, 55), (1, 2, 3)).save(folder / "big.png")  # a size no other test reads (cached by file)
    path = _jsonl(folder / "b.jsonl", [{**ROWS[0], "images": ["big.png"]}])
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    for decode in (False, True):
        with pytest.raises(UserError, match=r"b.jsonl:1: image 'big.png' is over PIL's decompression-bomb limit"):
            _load(qwen_vl, path, decode=decode)


def test_data_stats_reads_headers_only(qwen_vl, tmp_path, monkeypatch, capsys):
    """`data stats` of images whose pixel data cannot be decoded: it reports their sizes from the headers, so it
    never decodes (train decodes, and refuses the truncated file)."""
    from PIL import ImageFile

    from lowmem_ft.cli import main

    data = write_rows(tmp_path, ROWS)

    def no_decoding(self):
        raise AssertionError("data stats decoded an image")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    assert main(["data", "stats", str(data), "--model", qwen_vl, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["data"]
    assert d["image_tokens_per_sample"] == {"p50": 8, "p99": 12, "max": 12}
    assert d["pixels_per_image"]["max"] == 100 * 60


def test_data_stats_and_plan_read_a_saved_data_set_of_image_bytes(qwen_vl, tmp_path, capsys):
    """`data stats` and `plan` take a `save_to_disk` folder of `Image` bytes as they take the JSONL file: the same
    image tokens per sample (test_vision_train reads the JSONL file's)."""
    from lowmem_ft.cli import main

    data = _shapes(tmp_path)["save_to_disk, Image bytes"]
    assert main(["data", "stats", str(data), "--model", qwen_vl]) == 0
    out = capsys.readouterr().out
    assert "image tokens per sample p50 8, p99 12, max 12" in out and "read from the image headers" in out
    assert main(["plan", "--vram", "8", "--model", qwen_vl, "--data", str(data), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vision"]["data"]["image_tokens_per_sample"]["max"] == 12


def test_data_columns_name_the_conversation_column(qwen_vl, tmp_path):
    """`data.columns={messages: conversation}` as for text rows; without it the row is one line naming the row."""

    from lowmem_ft.data.sources import resolve_source

    path = _jsonl(tmp_path / "c.jsonl", [{"conversation": ROWS[0]["messages"], "images": ROWS[0]["images"]}])
    write_images(tmp_path)
    plain = _load(qwen_vl, write_rows(tmp_path, [ROWS[0]], name="plain.jsonl"))
    source = resolve_source(str(path), columns={"messages": "conversation"})
    assert _load(qwen_vl, source).records[0]["input_ids"] == plain.records[0]["input_ids"]
    with pytest.raises(UserError, match=r"c.jsonl:1: needs a non-empty 'messages' list"):
        _load(qwen_vl, path)
