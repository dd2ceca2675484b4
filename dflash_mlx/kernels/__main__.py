"""``python -m dflash_mlx.kernels``: the kernels on the CPU emulator (see :mod:`.emulated`)."""

import sys

from .emulated import main

sys.exit(main())
