"""Not the package: the root of a shmserve checkout (the package is ``shmserve/`` inside it).

Why this file exists: a checkout in a directory named ``shmserve``, and Python started from the
directory that holds it (``python3 app.py`` next to the clone), would find the checkout first on
``sys.path`` (the current directory comes first) and import it as an empty namespace package that
hides the installed one: ``ImportError: cannot import name 'Client' from 'shmserve' (unknown
location)``.  Being a regular package, the checkout is imported as this file instead, which says
what happened and what to do.  shmserve's own processes never import it: they start with ``-P``
(the current directory not on ``sys.path``).  Imported from anywhere else, it is never reached.
"""

import os as _os

raise ImportError(
    f"{_os.path.dirname(_os.path.abspath(__file__))} is a shmserve checkout (its repository), not the "
    "shmserve package: Python looks in the current directory first, so the checkout hides the installed "
    "package.  Run Python from another directory (inside the checkout, say: cd shmserve), or rename the "
    "checkout (mv shmserve shmserve-src) and install it again from there (make serve).")
