"""Session fixtures: tiny target checkpoints for every family and DFlash drafts for them."""

import atexit
import json
import os
import shutil
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
# cost curves measured by tests (block_size="auto") stay out of the user's cache,
# subprocesses included; removed when this process (each xdist worker) exits
os.environ["DFLASH_MLX_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash-mlx-test-cache-")
atexit.register(shutil.rmtree, os.environ["DFLASH_MLX_CACHE_DIR"], ignore_errors=True)

import pytest
from checkpoints import FAMILIES, write_draft, write_target


@pytest.fixture(scope="session")
def target_dirs(tmp_path_factory):
    """Family name -> directory of a saved tiny target (mlx-lm format + tokenizer)."""
    dirs = {}
    for family in FAMILIES:
        dirs[family] = tmp_path_factory.mktemp(f"target-{family}")
        write_target(dirs[family], family)
    return dirs


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory, target_dirs):
    """Function (family, dialect="new", **write_draft kwargs) -> directory of a cached draft."""
    cache = {}

    def get(family, dialect="new", **kwargs):
        key = (family, dialect, repr(sorted(kwargs.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"draft-{family}-{dialect}")
            target_config = json.loads((target_dirs[family] / "config.json").read_text())
            write_draft(path, target_config, dialect=dialect, **kwargs)
            cache[key] = path
        return cache[key]

    return get


@pytest.fixture(autouse=True)
def fresh_kernels():
    """Each test dispatches kernels under a fresh policy: nothing forced to the
    reference, no self-check run yet, no warning given."""
    from dflash_mlx.kernels import KernelPolicy, use_policy

    with use_policy(KernelPolicy()):
        yield
