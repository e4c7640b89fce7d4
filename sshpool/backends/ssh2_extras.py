"""The libssh2 calls ssh2-python does not wrap, made through ctypes on the very libssh2 it
loaded (`load_extras`), and the libssh2 pointers read from its SFTP objects after checking
their layout (`lib_pointer`, `forget_pointer`): what `sshpool.backends.ssh2`'s SFTP needs
beyond ssh2-python. Plain ctypes: this module imports no SSH library, and `load_extras` finds
libssh2 only once ssh2-python has loaded it.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

# libssh2_sftp_symlink_ex's type argument for a readlink.
READLINK = 1


class Extras(NamedTuple):
    readlink: Any
    posix_rename: Any
    close_handle: Any
    shutdown: Any
    get_channel: Any
    window_read: Any


def load_extras() -> Extras | None:
    """libssh2 functions ssh2-python does not wrap: readlink (`libssh2_sftp_symlink_ex` with
    READLINK), posix-rename@openssh.com (`libssh2_sftp_posix_rename_ex`, libssh2
    >= 1.11: SFTP v3's rename never replaces, and rename_ex's overwrite flags are only sent to
    v5 servers), and `libssh2_sftp_close_handle` and `libssh2_sftp_shutdown`, which must be
    repeated until they stop answering EAGAIN: ssh2-python calls them once (its close marks
    the handle closed even on EAGAIN) or when the object is freed, in whatever order the
    garbage collector picks; and `libssh2_sftp_get_channel` with
    `libssh2_channel_window_read_ex`, which read an SFTP channel's receive window (what the
    transfer tests check). Taken from the very libssh2 the process has loaded for ssh2-python;
    None when that is not found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libssh2" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            extras = Extras(
                lib.libssh2_sftp_symlink_ex,
                lib.libssh2_sftp_posix_rename_ex,
                lib.libssh2_sftp_close_handle,
                lib.libssh2_sftp_shutdown,
                lib.libssh2_sftp_get_channel,
                lib.libssh2_channel_window_read_ex,
            )
        except (OSError, AttributeError):
            continue
        p, s, u = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint
        extras.readlink.argtypes = [p, s, u, s, u, ctypes.c_int]
        extras.posix_rename.argtypes = [p, s, ctypes.c_size_t, s, ctypes.c_size_t]
        extras.close_handle.argtypes = [p]
        extras.shutdown.argtypes = [p]
        for fn in extras[:4]:
            fn.restype = ctypes.c_int
        extras.get_channel.argtypes = [p]
        extras.get_channel.restype = p
        # (channel, unsigned long *read_avail, unsigned long *window_size_initial): the
        # current receive window.
        ulong_p = ctypes.POINTER(ctypes.c_ulong)
        extras.window_read.argtypes = [p, ulong_p, ulong_p]
        extras.window_read.restype = ctypes.c_ulong
        return extras
    return None


# The object layouts of ssh2.sftp.SFTP and ssh2.sftp_handle.SFTPHandle (their .pxd): the
# Python object header, the libssh2 pointer, then the owner (`Session _session`, `SFTP
# _sftp`). Checked before use: the owner slot must hold the owner, or the extras are not used.
PYOBJECT_HEAD = object.__basicsize__
PTR = ctypes.sizeof(ctypes.c_void_p)


def lib_pointer(obj: Any, owner: Any) -> int | None:
    """The libssh2 pointer inside an ssh2-python SFTP or SFTPHandle, after checking the
    layout (the owner's address follows it)."""
    if type(obj).__basicsize__ < PYOBJECT_HEAD + 2 * PTR:
        return None
    if ctypes.c_void_p.from_address(id(obj) + PYOBJECT_HEAD + PTR).value != id(owner):
        return None
    return ctypes.c_void_p.from_address(id(obj) + PYOBJECT_HEAD).value


def forget_pointer(obj: Any) -> None:
    """NULL the libssh2 pointer of an SFTP or SFTPHandle we closed (or gave up on), so that
    ssh2-python's own close and __dealloc__ find nothing to free (libssh2 answers NULL with
    LIBSSH2_ERROR_BAD_USE): freed twice, or after its owner in a garbage cycle, it crashes."""
    ctypes.c_void_p.from_address(id(obj) + PYOBJECT_HEAD).value = None
