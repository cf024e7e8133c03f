"""Opening the images a data row names, and every way one can be bad, said in one line that names the row.

Paths are relative to the data file's directory (absolute ones are kept). An image is decoded once here, when the
data is read, so a truncated or undecodable file fails before any weight is loaded rather than at step 1000; its
pixel size is what the image-token arithmetic reads (`lowmem_ft.vision.families`).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path


class BadImage(ValueError):
    """One image of a row cannot be used; the message says why and which file."""


@dataclass(frozen=True)
class ImageFile:
    path: str  # absolute
    width: int
    height: int


def resolve(name: str, base: Path) -> Path:
    if "://" in name:
        raise BadImage(
            f"image {name!r} is a URL; lowmem-ft reads images from files (download it and name the file, relative "
            "to the data file)"
        )
    path = Path(name)
    return path if path.is_absolute() else base / path


def open_image(name: str, base: Path) -> ImageFile:
    """The image `name` (relative to `base`), fully decoded once; BadImage saying why it cannot be used."""
    if not isinstance(name, str) or not name:
        raise BadImage(f"image entries must be file names, got {name!r}")
    path = resolve(name, base)
    if not path.is_file():
        raise BadImage(f"image {name!r} not found (looked for {path})")
    stat = path.stat()
    width, height = _decoded_size(str(path), stat.st_mtime_ns, stat.st_size, name)
    return ImageFile(str(path), width, height)


@functools.lru_cache(maxsize=1 << 16)
def _decoded_size(path: str, mtime_ns: int, size: int, name: str) -> tuple[int, int]:
    """(width, height) of a fully decoded image; cached by file identity, so the planner's trials at several caps
    (`lowmem_ft.vision.setup.choose_cap`) decode each image once."""
    from PIL import Image, UnidentifiedImageError

    del mtime_ns, size  # the cache key: a file rewritten since is decoded again
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # over the limit: refused, not warned
            with Image.open(path) as image:
                image.load()  # decodes: a truncated file fails here ("image file is truncated")
                width, height = image.size
    except UnidentifiedImageError:
        raise BadImage(f"image {name!r} is not an image PIL can read") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise BadImage(f"image {name!r} is over PIL's decompression-bomb limit ({exc})") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise BadImage(f"image {name!r} is truncated or undecodable ({exc})") from None
    return width, height


def load_rgb(path: str):
    """The image as the processors take it (RGB)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")
