"""Images as requests give them: a file path, raw bytes, a PIL image, a
``data:`` URL or an http(s) URL (fetched with a size and a time limit). Each
becomes an RGB PIL image and the SHA-256 of its bytes, which tells two images
apart wherever prompts are compared."""

import base64
import binascii
import hashlib
import io
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from ..errors import DFlashError

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an image file or download larger than this is refused
FETCH_SECONDS = 10.0  # an http(s) image that takes longer to arrive is refused

ImageSource = Union[str, Path, bytes, "PIL.Image.Image"]  # noqa: F821


@dataclass(frozen=True)
class Image:
    """One prompt image: its pixels and the hash of the bytes it came from."""

    pixels: "PIL.Image.Image"  # noqa: F821, RGB
    digest: str  # sha256 hex of the encoded bytes (of the raw RGB pixels for a PIL image)


def _decode(data: bytes, what: str) -> Image:
    from PIL import Image as PILImage, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise DFlashError(f"{what} is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB")
    try:
        pixels = PILImage.open(io.BytesIO(data))
        pixels.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DFlashError(f"{what} is not an image PIL can read ({' '.join(str(e).split())})") from None
    return Image(pixels.convert("RGB"), hashlib.sha256(data).hexdigest())


def _data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise DFlashError("an image data URL must be 'data:<type>;base64,<data>'")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise DFlashError("an image data URL holds invalid base64") from None


def fetch(url: str, limit: int = MAX_IMAGE_BYTES, seconds: float = FETCH_SECONDS) -> bytes:
    """The bytes at an http(s) URL: at most ``limit`` of them, within ``seconds``."""
    try:
        with urllib.request.urlopen(url, timeout=seconds) as response:
            data = response.read(limit + 1)
    except Exception as e:  # HTTP errors, refused connections, timeouts
        raise DFlashError(f"cannot fetch image '{url}': {' '.join(str(e).split()) or type(e).__name__}") from None
    if len(data) > limit:
        raise DFlashError(f"image '{url}' is larger than {limit // (1024 * 1024)} MB")
    return data


def read_image(source: Union[ImageSource, Image]) -> Image:
    """An ``Image`` from a path, bytes, PIL image, data URL or http(s) URL
    (one-line DFlashError if it cannot be read); an ``Image`` as it is."""
    if isinstance(source, Image):  # read already (the server reads a request's images before queueing it)
        return source
    if isinstance(source, bytes):
        return _decode(source, "an image given as bytes")
    if hasattr(source, "convert") and hasattr(source, "tobytes"):  # a PIL image
        rgb = source.convert("RGB")
        return Image(rgb, hashlib.sha256(rgb.tobytes() + repr(rgb.size).encode()).hexdigest())
    text = str(source)
    if text.startswith("data:"):
        return _decode(_data_url(text), "an image data URL")
    if text.startswith(("http://", "https://")):
        return _decode(fetch(text), f"image '{text}'")
    path = Path(text).expanduser()
    if not path.is_file():
        raise DFlashError(f"image '{text}' is not a file, a data URL or an http(s) URL")
    if path.stat().st_size > MAX_IMAGE_BYTES:
        raise DFlashError(f"image '{text}' is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB")
    return _decode(path.read_bytes(), f"image '{text}'")
