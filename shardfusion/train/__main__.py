"""``python -m shardfusion.train``: see :mod:`shardfusion.train.job`.

The process ends with ``exit_now`` (``os._exit`` after flushing stdout and stderr) once ``main`` has returned its
exit status: everything it wrote is closed by then, and the interpreter's teardown with torch and the job imported
costs about a second on 2 cores for nothing (measured: 0.86 s between the forkserver's end and the process's). A
usage error (``SystemExit`` raised inside ``main``) exits the normal way.
"""

from shardfusion.train.job import main
from shardfusion.train.launch import exit_now

exit_now(main())
