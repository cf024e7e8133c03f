"""Opening the images a data row names, and every way one can be bad, said in one line that names the row.

An image entry is what TRL's and LLaMA-Factory's VLM data hold (LLaMA-Factory `mm_plugin._regularize_images`: a path,
bytes, or a `datasets` `Image` value `{"bytes": ..., "path": ...}`): a file name (relative to the data's directory;
absolute ones are kept), raw image bytes, such a dict (its bytes when it has them, else its path), or a
`data:image/...;base64,` URI (what the OpenAI chat form and transformers' `load_image` take). A URL is refused in one
line: images must be local files or bytes.

Bytes are written once to a file named by their SHA-256 under lowmem-ft's cache (`cache_root()/images`), so the rest
of the run sees every image as a file: the collator opens it when it makes a batch, a DataLoader worker or another
rank is passed a path rather than the bytes, and a data set of many images is not held in memory.

Two reads: `decode=False` reads the header only (`Image.open(...).size`: the pixel size, and PIL's decompression-bomb
check, which runs on open) — what `data stats` and the planner's data profile need, fast on large images; `decode=True`
decodes each image once before training, so a truncated or undecodable file fails before any weight is loaded rather
than at step 1000. Both are cached by file identity.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class BadImage(ValueError):
    """One image of a row cannot be used; the message says why and which image."""


@dataclass(frozen=True)
class ImageFile:
    path: str  # absolute
    width: int
    height: int


def resolve(name: str, base: Path) -> Path:
    if "://" in name:
        raise BadImage(
            f"image {name!r} is a URL; images must be local files or bytes (download it and name the file, relative "
            "to the data file)"
        )
    path = Path(name)
    return path if path.is_absolute() else base / path


def open_image(name: str, base: Path, decode: bool = True) -> ImageFile:
    """The image file `name` (relative to `base`), its header read (`decode=False`) or fully decoded once; BadImage
    saying why it cannot be used."""
    if not isinstance(name, str) or not name:
        raise BadImage(f"image entries must be file names or bytes, got {name!r}")
    path = resolve(name, base)
    if not path.is_file():
        raise BadImage(f"image {name!r} not found (looked for {path})")
    return _sized(path, f"image {name!r}", decode)


def image_entry(entry: Any, base: Path, index: int, decode: bool = True) -> ImageFile:
    """One entry of a row's images (a file name, bytes, a `datasets` Image dict or a base64 data URI) as a file;
    `index` names it in messages when it has no name."""
    if isinstance(entry, dict):
        if entry.get("bytes"):
            return _from_bytes(entry["bytes"], f"images[{index}] ({_named(entry)} bytes)", decode)
        if entry.get("path"):
            return open_image(entry["path"], base, decode)
        raise BadImage(f"images[{index}] is a dict with neither 'bytes' nor 'path'")
    if isinstance(entry, bytes | bytearray):
        return _from_bytes(bytes(entry), f"images[{index}] (bytes)", decode)
    if isinstance(entry, str) and entry.startswith("data:"):
        head, _, payload = entry.partition(",")
        if not head.startswith("data:image/") or not head.endswith(";base64"):
            raise BadImage(f"images[{index}] is a data URI that is not a base64 image (data:image/...;base64,...)")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise BadImage(f"images[{index}] is a data URI whose base64 does not decode") from None
        return _from_bytes(data, f"images[{index}] (base64)", decode)
    return open_image(entry, base, decode)


def _named(entry: dict) -> str:
    return repr(Path(entry["path"]).name) if isinstance(entry.get("path"), str) and entry["path"] else "its"


def _from_bytes(data: bytes, what: str, decode: bool) -> ImageFile:
    """The bytes as a content-addressed file under the cache (written once), then read as a file is."""
    from lowmem_ft.cache import cache_root

    digest = hashlib.sha256(data).hexdigest()
    path = cache_root() / "images" / digest[:2] / digest
    if not path.is_file() or path.stat().st_size != len(data):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{digest}.{os.getpid()}.part")
        partial.write_bytes(data)
        os.replace(partial, path)  # atomic: another rank writing the same image meets a whole file
    return _sized(path, what, decode)


def _sized(path: Path, what: str, decode: bool) -> ImageFile:
    stat = path.stat()
    read = _decoded_size if decode else _header_size
    width, height = read(str(path), stat.st_mtime_ns, stat.st_size, what)
    return ImageFile(str(path), width, height)


@functools.lru_cache(maxsize=1 << 16)
def _header_size(path: str, mtime_ns: int, size: int, what: str) -> tuple[int, int]:
    """(width, height) from the image's header, nothing decoded; cached by file identity (`_decoded_size`)."""
    del mtime_ns, size
    return _read(path, what, decode=False)


@functools.lru_cache(maxsize=1 << 16)
def _decoded_size(path: str, mtime_ns: int, size: int, what: str) -> tuple[int, int]:
    """(width, height) of a fully decoded image; cached by file identity, so the planner's trials at several caps
    (`lowmem_ft.vision.setup.choose_cap`) decode each image once."""
    del mtime_ns, size  # the cache key: a file rewritten since is read again
    return _read(path, what, decode=True)


def _read(path: str, what: str, decode: bool) -> tuple[int, int]:
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # over the limit: refused, not warned
            with Image.open(path) as image:  # reads the header, and runs PIL's decompression-bomb check on the size
                if decode:
                    image.load()  # decodes: a truncated file fails here ("image file is truncated")
                width, height = image.size
    except UnidentifiedImageError:
        raise BadImage(f"{what} is not an image PIL can read") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise BadImage(f"{what} is over PIL's decompression-bomb limit ({exc})") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise BadImage(f"{what} is truncated or undecodable ({exc})") from None
    return width, height


def forget_sizes() -> None:
    """Forget every size read (both caches): the next read of each image opens it again (benchmarks)."""
    _header_size.cache_clear()
    _decoded_size.cache_clear()


def load_rgb(path: str):
    """The image as the processors take it (RGB)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")
