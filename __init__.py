"""Not the package: the root of a shmserve checkout (the package is ``shmserve/`` inside it).

Why this file exists: a checkout in a directory named ``shmserve``, and Python started from the
directory that holds it (``python3 app.py`` next to the clone), finds the checkout first on
``sys.path`` (the current directory comes first).  Without this file it would be imported as an
empty namespace package that hides the installed one: ``ImportError: cannot import name 'Client'
from 'shmserve' (unknown location)``.  Imported under that name, this file makes the checkout's own
package (``shmserve/`` inside it) the one imported, and warns that it did; if that package cannot
be used from the checkout (its extensions are not built there), it raises an ImportError that says
what happened and what to do.

Under any other name (a test runner importing the checkout's directory as a package of its own
name, as pytest does) it does nothing.  shmserve's own processes never import it: they start with
``-P`` (the current directory not on ``sys.path``).
"""

if __name__ == "shmserve":
    import os as _os
    import warnings as _warnings

    _inner = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "shmserve")
    _advice = ("Run Python from another directory (inside the checkout, say: cd shmserve), or rename the checkout "
               "(mv shmserve shmserve-src) and install it again from there (make serve).")
    __path__ = [_inner]
    _built = any(n.startswith("_atomics.") and n.endswith(".so") for n in _os.listdir(_inner))
    if not _built:  # (built in place by make serve; not by a plain clone)
        raise ImportError(
            f"{_os.path.dirname(_inner)} is a shmserve checkout (its repository), not the shmserve package: Python "
            f"looks in the current directory first, so the checkout hides the installed package, and its own "
            f"package is not built.  {_advice}")
    with open(_os.path.join(_inner, "__init__.py")) as _f:
        exec(compile(_f.read(), _f.name, "exec"))
    _warnings.warn(f"shmserve: the checkout at {_os.path.dirname(_inner)} is used, not the installed package "
                   f"(Python looks in the current directory first). {_advice}", stacklevel=2)
