"""The DFlash draft: the network and its config (``model.py``), each layer's
context cache (``cache.py``), the stacked KV injection (``injection.py``) and
the reduced drafting vocabulary (``vocab.py``). Modules outside this folder
use what is named here."""

from .model import FULL, SLIDING, DFlashDraft, DraftConfig, default_target_layer_ids, visible
from .vocab import RANKING_FILE, rank_corpus, rank_tokens, read_ranking, subset_head, write_ranking

__all__ = [
    "FULL", "SLIDING", "DFlashDraft", "DraftConfig", "default_target_layer_ids", "visible",
    "RANKING_FILE", "rank_corpus", "rank_tokens", "read_ranking", "subset_head", "write_ranking",
]
