"""``python -m shardfusion.export CKPT OUT [--overwrite]``: the command line of :mod:`shardfusion.checkpoint.export`.

Needs the ``safetensors`` package (``pip install 'shardfusion[train]'``).
"""

import sys

from shardfusion.checkpoint.export import export, main

__all__ = ["export", "main"]

if __name__ == "__main__":
    sys.exit(main())
