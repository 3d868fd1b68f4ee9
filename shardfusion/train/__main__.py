"""``python -m shardfusion.train``: see :mod:`shardfusion.train.job`."""

import sys

from shardfusion.train.job import main

sys.exit(main())
