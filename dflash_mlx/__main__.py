"""``python -m dflash_mlx``: the ``dflash-mlx`` command line."""

from .cli import app

if __name__ == "__main__":
    app(prog_name="dflash-mlx")
