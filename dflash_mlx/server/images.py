"""A request's images (docs/vision.md): each image part's data URL or
http(s) URL read off the event loop, with ``vision``'s size and time limits,
a 400 naming the part that cannot be read; and why a server's target takes
no images, decided once at load."""

import asyncio
from typing import Optional

from .. import vision
from ..errors import DFlashError
from .errors import APIError

Source = tuple[str, str]  # (the request's field naming an image part, its URL)
SCHEMES = ("data:", "http://", "https://")  # a client's URL never names a file on the server


def refusal(target, alone: bool) -> Optional[str]:
    """Why this server refuses images (None: it takes them). ``alone``: the
    target runs in this process (not a distributed group). The vision tower
    is read here, lazily, on the thread that owns MLX."""
    if not alone:
        return "images are not supported with --distributed"
    try:
        vision.tower(target)
    except DFlashError as e:
        return str(e)
    return None


async def read(sources: list[Source], refused: Optional[str]) -> list[vision.Image]:
    """The images, in order, read on a thread of their own; a 400 naming the
    first image part where the server takes none (``refused``), or the part
    that is no image, too large, or cannot be fetched in time."""
    if sources and refused:
        raise APIError(400, f"{sources[0][0]}: {refused}", sources[0][0])
    return await asyncio.to_thread(lambda: [_image(param, url) for param, url in sources])


def _image(param: str, url: str) -> vision.Image:
    if not url.startswith(SCHEMES):
        raise APIError(400, f"{param} must be a data URL ('data:image/png;base64,...') or an http(s) URL", param)
    try:
        return vision.read_image(url)
    except DFlashError as e:
        raise APIError(400, f"{param}: {e}", param) from None
