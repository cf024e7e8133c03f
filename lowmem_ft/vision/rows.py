"""The rows of image chats from every source the text path reads, in the shapes users bring them.

Sources are the text path's (`lowmem_ft.data.sources`): a JSONL / JSON file, a Parquet file, a directory of data files
(a Hub-style data set folder with `data/train-*.parquet` shards), a `save_to_disk` directory or a Hub id. Rows are
read by `lowmem_ft.data.readers.iter_rows` with media left undecoded, so a `datasets` `Image` column comes as
`{"bytes": ..., "path": ...}` and `lowmem_ft.vision.images` reads each image once, header or whole, as it needs.

A row is one of (each normalised to TRL's `messages` + `images`):

- TRL's: `messages` whose content parts include `{"type": "image"}`, and `images` (or one `image`, as TRL's
  `SFTTrainer` collator takes it). Where no message marks an image's place, the images go before the first user
  message's text, as TRL's `prepare_multimodal_messages` puts them.
- LLaMA-Factory's: `<image>` in a message's text (`messages`, or ShareGPT `conversations` of `from` / `value`
  turns with its `system` column, read by the text path's `formats.convert`), and `images`.

`data.columns` renames a data set's columns to these names as it does for text (`{messages: conversation}`).
Relative image paths are relative to the data file's directory (a saved data set's: its directory; a Hub data set's:
the working directory).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from lowmem_ft.data.formats import BadLine, convert
from lowmem_ft.data.readers import iter_rows, rename
from lowmem_ft.data.sources import DataSource, file_kind, resolve_source
from lowmem_ft.errors import UserError
from lowmem_ft.vision.images import BadImage

# LLaMA-Factory's multimodal datasets (data/mllm_demo.json) mark an image's place in a message's text with this
IMAGE_PLACEHOLDER = "<image>"


def as_source(data: str | Path | DataSource) -> DataSource:
    return data if isinstance(data, DataSource) else resolve_source(str(data))


def image_rows(source: DataSource) -> Iterator[tuple[str, Path, dict | BadLine]]:
    """(where, the directory its relative image paths start from, the row or why it is none) for every row."""
    if source.kind in ("hub", "saved"):
        base = Path.cwd() if source.kind == "hub" else Path(source.path)
        for where, row in iter_rows(source, decode_media=False):
            yield where, base, _renamed(row, source)
        return
    for name in source.files:  # one file at a time, so each row knows its file's directory
        one = replace(source, kind=file_kind(name) or source.kind, files=(name,))
        for where, row in iter_rows(one, decode_media=False):
            yield where, Path(name).parent, _renamed(row, source)


def _renamed(row: dict | BadLine, source: DataSource) -> dict | BadLine:
    """The row with `data.columns` applied (`{messages: conversation}`), as the text path renames it."""
    if isinstance(row, BadLine):
        return row
    try:
        return rename(row, source.column_map, source.key)
    except BadLine as exc:
        return exc


def image_entries(row: dict) -> list[Any]:
    """The row's images: its `images` list (one entry alone is one image), or TRL's single `image` column."""
    images = row["images"] if "images" in row else row.get("image")
    if images is None:
        return []
    if isinstance(images, str | bytes | dict):
        return [images]
    if not isinstance(images, list):
        raise BadImage(f"'images' must be a list of file names or images, got {type(images).__name__}")
    return images


def has_images(data: str | Path | DataSource) -> bool:
    """Whether a row of the data holds an image (False where the data cannot be read: the text path then says why).
    A data set with a schema (Parquet, saved, Hub) without an `images` / `image` column is answered from its first
    row; a JSON file is read until a row with an image, as its rows may differ."""
    try:
        source = as_source(data)
        schema = source.kind not in ("jsonl", "json") and not any(
            file_kind(f) in ("jsonl", "json") for f in source.files
        )
        for _, _, row in image_rows(source):
            if isinstance(row, dict) and image_entries(row):
                return True
            if schema and isinstance(row, dict) and "images" not in row and "image" not in row:
                return False
    except (UserError, BadImage):
        return False
    return False


def as_messages(row: dict) -> list:
    """A row's conversation as `messages`: its own, or ShareGPT's `conversations` converted by the text path."""
    if "messages" in row or "conversations" not in row:
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadImage("needs a non-empty 'messages' list (or ShareGPT 'conversations')")
        return messages
    try:
        return convert({k: v for k, v in row.items() if k not in ("images", "image")}, "sharegpt")["messages"]
    except BadLine as exc:
        raise BadImage(str(exc)) from None


def placeholders(messages: list[dict]) -> int:
    """Images the messages mark: `{"type": "image"}` parts and LLaMA-Factory's `<image>` in a string content."""
    n = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            n += content.count(IMAGE_PLACEHOLDER)
        elif isinstance(content, list):
            n += sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image")
    return n


def images_first(messages: list[dict], count: int) -> list[dict]:
    """Messages that mark no image, with `count` image parts before the first user message's text (TRL's
    `prepare_multimodal_messages`)."""
    out, placed = [], False
    for m in messages:
        if not placed and isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
            m, placed = {**m, "content": [{"type": "image"}] * count + parts}, True
        out.append(m)
    return out
