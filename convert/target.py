"""``convert_target``: targets go through mlx-lm's own converter, with safe output."""

import contextlib
import sys
from pathlib import Path
from typing import Optional

from dflash_mlx.errors import DFlashError

from .writer import staged_output


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

    ``recipe`` is one of mlx-lm's mixed recipes. mlx-lm's progress goes to stderr.
    """
    from mlx_lm.convert import QUANT_RECIPES, convert

    if recipe is not None and recipe not in QUANT_RECIPES:
        raise DFlashError(
            f"unknown target recipe '{recipe}'; mlx-lm offers {', '.join(QUANT_RECIPES)}"
        )
    with staged_output(out, force) as staged:
        try:
            with contextlib.redirect_stdout(sys.stderr):
                convert(
                    str(src),
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
    return Path(out)
