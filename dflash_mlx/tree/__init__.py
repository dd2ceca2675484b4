"""DDTree: a tree of drafts per cycle. Construction from the draft's
per-position distributions (``build.py``), the ancestor mask, positions and
cache compaction (``attention.py``), the GatedDeltaNet recurrence over the
tree (``gated_delta.py``) and the decoder that runs it (``decoder.py``).
Modules outside this folder use what is named here."""

from .decoder import TreeDecoder

__all__ = ["TreeDecoder"]
