"""Finding and loading targets and drafts, from local directories or the hub."""

import json
from pathlib import Path

import mlx.nn as nn
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import load_model

from .draft import DFlashDraft, draft_classes
from .draft import read_ranking
from .errors import DFlashError
from .precision import cast_draft, choose_draft_dtype, device_description
from .vision import remember

DRAFT_FILES = ["*.json", "*.safetensors"]
TOKENIZER_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]  # no weights
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # one of them, or *.tiktoken


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def resolve(path_or_repo: str, what: str, allow_patterns: list[str] | None = None) -> Path:
    """A local directory as is; otherwise a hub repo id fetched with huggingface_hub."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DFlashError(f"{what} path '{path}' is not a directory")
        return path
    if str(path_or_repo).startswith((".", "/", "~")) or str(path_or_repo).count("/") != 1:
        raise DFlashError(f"{what} '{path_or_repo}' is neither a local directory nor a hub repo id")
    try:
        return Path(snapshot_download(path_or_repo, allow_patterns=allow_patterns))
    except HFValidationError:
        raise DFlashError(f"{what} '{path_or_repo}' is not a valid hub repo id") from None
    except LocalEntryNotFoundError:
        reason = "it is not in the local cache and the hub cannot be reached (offline?)"
    except RepositoryNotFoundError:
        reason = "no such repository, or it needs a login"
    except Exception as e:  # any other HTTP or filesystem failure
        reason = _one_line(e)
    raise DFlashError(
        f"cannot download {what} '{path_or_repo}': {reason}; pass a local directory instead"
    )


def check_tokenizer(path: Path) -> None:
    """DFlashError unless the target directory holds a tokenizer: without its
    files transformers makes an empty one, and every prompt encodes to nothing."""
    if not any((path / name).is_file() for name in TOKENIZER_NAMES) and not list(path.glob("*.tiktoken")):
        raise DFlashError(f"target '{path}' has no tokenizer (no {', '.join(TOKENIZER_NAMES)}); "
                          "copy the tokenizer files of the model it was made from into it")


def load(path_or_repo: str, lazy: bool = False) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a target model and tokenizer with mlx-lm (local path or hub repo)."""
    path = resolve(path_or_repo, "target")
    try:
        model, tokenizer = mlx_lm_load(str(path), lazy=lazy)
    except Exception as e:
        raise DFlashError(f"cannot load target from '{path}': {_one_line(e)}") from None
    check_tokenizer(path)
    remember(model, path)  # where an image prompt finds the vision tower
    # a prompt longer than the context: generation says so (validate.prompt_length), not transformers
    getattr(tokenizer._tokenizer, "deprecation_warnings", {})["sequence-length-is-longer-than-the-specified-maximum"] = True
    return model, tokenizer


def load_draft(path_or_repo: str, lazy: bool = False, dtype: str = "auto") -> DFlashDraft:
    """Load a DFlash draft (v1, DFlash2 or DSpark by its ``architectures``): the z-lab
    HF layout (either config dialect) or the MLX layout written by
    ``dflash-mlx convert`` (optionally quantized). ``dtype``: what it computes
    in (``precision.choose_draft_dtype``: auto is float32 on M1/M2)."""
    cast_to, _ = choose_draft_dtype(device_description(), dtype)
    path = resolve(path_or_repo, "draft", DRAFT_FILES)
    if not (path / "config.json").is_file():
        raise DFlashError(f"draft directory '{path}' has no config.json")
    if not list(path.glob("model*.safetensors")):
        raise DFlashError(f"draft directory '{path}' has no model*.safetensors weights")
    try:
        model, _ = load_model(
            path, lazy=lazy, get_model_classes=draft_classes
        )
    except DFlashError:
        raise
    except json.JSONDecodeError as e:
        raise DFlashError(f"draft config '{path / 'config.json'}' is not valid JSON: {e}") from None
    except Exception as e:
        raise DFlashError(f"cannot load draft from '{path}': {_one_line(e)}") from None
    try:
        model.vocab_ranking = read_ranking(path)
    except DFlashError as e:  # only a reduced drafting vocabulary needs it: raised then (subset_head)
        model.vocab_ranking = e
    return cast_draft(model, cast_to)
