"""The DFlash drafts: the v1 network and its config (``model.py``), DFlash2's
conv-wrapped network (``dflash2.py``) and its candidate selector
(``selector.py``), DSpark's network with its Markov and confidence heads
(``dspark.py``) and the packagings it reads (``dspark_packaging.py``), each layer's context cache (``cache.py``), the stacked KV
injection (``injection.py``) and the reduced drafting vocabulary
(``vocab.py``). Modules outside this folder use what is named here."""

from .cache import DraftContextCache
from .dflash2 import DFlash2Config, DFlash2Draft, is_dflash2
from .dspark import DSparkConfig, DSparkDraft, draft_classes, is_dspark, network_class
from .model import FULL, SLIDING, DFlashDraft, DraftConfig, default_target_layer_ids, visible
from .vocab import RANKING_FILE, SubsetHead, rank_corpus, rank_tokens, read_ranking, subset_head, write_ranking

__all__ = [
    "DraftContextCache", "FULL", "SLIDING", "DFlashDraft", "DraftConfig", "default_target_layer_ids", "visible",
    "DFlash2Config", "DFlash2Draft", "draft_classes", "is_dflash2", "network_class",
    "DSparkConfig", "DSparkDraft", "is_dspark",
    "RANKING_FILE", "SubsetHead", "rank_corpus", "rank_tokens", "read_ranking", "subset_head", "write_ranking",
]
