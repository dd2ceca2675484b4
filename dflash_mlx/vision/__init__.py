"""Images in the prompt (docs/vision.md): the vision tower of a multimodal
checkpoint read with mlx-vlm beside mlx-lm's text model (``tower.py``), image
sources (``sources.py``), and the target whose prefill sees the images
(``target.py``; Qwen3.5's placement and positions in ``qwen.py``).
Modules outside this folder use what is named here."""

from .sources import MAX_IMAGE_BYTES, Image, ImageSource, read_image
from .target import ImagePrompt, VisionTarget
from .tower import FAMILIES, remember, tower, user_turn, with_images

__all__ = ["MAX_IMAGE_BYTES", "Image", "ImageSource", "read_image", "ImagePrompt", "VisionTarget", "FAMILIES",
           "remember", "tower", "user_turn", "with_images"]
