"""SSH backends: one module per SSH library, behind the interface of `base.py`.

* `base.py`: the interface (`Backend`, `Connection`, `Exit`), the contract in docstrings.
* `translate.py`: the rules all backends share (connect errors, known_hosts names, host key
  preference, dead peers); each backend keeps only its own library's table.
* `asyncssh.py` (the default), `paramiko.py`, `ssh2.py` (with `ssh2_extras.py`, the libssh2
  calls ssh2-python lacks, through ctypes): one backend each, imported only when chosen, so an
  optional library that is not installed costs nothing until it is asked for.

```python
from sshpool.backends import load_backend
backend = load_backend("paramiko")   # ImportError naming the extra when paramiko is missing
```

This package imports the sshpool core (`target`, `errors`, `command`, `tracing`) and its
libraries, nothing of the pool (`sshpool.pool`, `host`, `connect`) nor the dev rig.
"""

from __future__ import annotations

import importlib

from sshpool.backends.base import Backend, Connection, Exit

# Backend name -> (module, class). The module imports its library; the pip extra of each
# optional library is named after the backend.
BACKENDS: dict[str, tuple[str, str]] = {
    "asyncssh": ("sshpool.backends.asyncssh", "AsyncsshBackend"),
    "paramiko": ("sshpool.backends.paramiko", "ParamikoBackend"),
    "ssh2": ("sshpool.backends.ssh2", "Ssh2Backend"),
}


def load_backend(name: str) -> Backend:
    """A new instance of the backend called `name`, importing its library only now.

    Raises ValueError for an unknown name, and ImportError naming the pip extra
    (``pip install 'sshapi[paramiko]'``) when the backend's library is not installed."""
    try:
        module_name, class_name = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown SSH backend {name!r}: choose {', '.join(BACKENDS)}") from None
    backend: Backend = getattr(importlib.import_module(module_name), class_name)()
    return backend


__all__ = ["BACKENDS", "Backend", "Connection", "Exit", "load_backend"]
