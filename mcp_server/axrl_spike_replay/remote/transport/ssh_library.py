"""asyncssh, imported once for every module of this package that speaks SSH.

asyncssh's own type hints name cryptography's DSA classes, and cryptography (>= 43) warns on each such name: ten
lines of `CryptographyDeprecationWarning: DSA is deprecated` on the first import of asyncssh, before any SSH or
Slurm path prints anything of its own. Those warnings, and only those (that message, raised from asyncssh's
modules), are silenced here, while asyncssh is imported; the import is otherwise untouched. Import asyncssh (and
the names below) from this module so that the first import happens here.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"DSA is deprecated", module=r"asyncssh(\.|$)")
    import asyncssh
    from asyncssh.config import SSHClientConfig, SSHConfig
    from asyncssh.constants import FILEXFER_TYPE_DIRECTORY, FILEXFER_TYPE_REGULAR

__all__ = ["FILEXFER_TYPE_DIRECTORY", "FILEXFER_TYPE_REGULAR", "SSHClientConfig", "SSHConfig", "asyncssh"]
