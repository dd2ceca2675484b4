"""``convert_target``: targets go through mlx-lm's own converter, with safe output."""

import contextlib
import sys
from pathlib import Path
from typing import Optional

from dflash_mlx.atomic import check_output, staged_output
from dflash_mlx.errors import DFlashError
from dflash_mlx.loading import resolve


def convert_target(
    src: str,
    out: Path,
    *,
    quantize: bool = False,
    bits: Optional[int] = None,
    group_size: Optional[int] = None,
    dtype: Optional[str] = None,
    recipe: Optional[str] = None,
    force: bool = False,
) -> Path:
    """Run ``mlx_lm.convert.convert`` on ``src`` (hub id or local directory) into ``out``.

    ``recipe`` is one of mlx-lm's mixed recipes. The source is fetched first
    (the files mlx-lm would fetch) so that a missing or unreachable model is
    one clear error; mlx-lm's own messages go to stderr.
    """
    from mlx_lm.convert import QUANT_RECIPES, convert
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    if recipe is not None and recipe not in QUANT_RECIPES:
        raise DFlashError(
            f"unknown target recipe '{recipe}'; mlx-lm offers {', '.join(QUANT_RECIPES)}"
        )
    out = Path(out).expanduser()
    check_output(out, force)
    path = resolve(str(src), "target", DEFAULT_ALLOW_PATTERNS)
    with staged_output(out, force, [path]) as staged:
        try:
            with contextlib.redirect_stdout(sys.stderr):
                convert(
                    str(path),
                    str(staged),
                    quantize=quantize or bits is not None or recipe is not None,
                    q_group_size=group_size,
                    q_bits=bits,
                    dtype=dtype,
                    quant_predicate=recipe,
                )
        except Exception as e:
            message = " ".join(str(e).split()) or type(e).__name__
            raise DFlashError(f"cannot convert target '{src}': {message}") from None
    return out
