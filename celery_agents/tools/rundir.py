"""Removing a sandboxed run's directory, whatever the tool left in it.

The tool is hostile and owned the directory: it may leave symbolic links to the worker's files
and folders, hard links, folders it made unwritable or unreadable (so that removing what is in
them fails at first), and trees nested deeper than Python recurses or a path can name. The
removal never follows a link: every name is removed through a descriptor of the folder holding it
(`unlinkat`, `renameat`, `rmdir` with `dir_fd`), so a link goes as a link and a hard link only
loses a name. Modes are changed only on the run's own folders (to 0700, so they can be listed and
emptied), through a descriptor opened with `O_NOFOLLOW` on what was checked to be a folder, never
through a name; files keep theirs. A folder's subfolders are moved up into the run's directory
before it is removed, so no depth of nesting needs more than three descriptors at once.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat

log = logging.getLogger(__name__)

_PATH_ONLY = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_LIST = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def remove_run_dir(path: str) -> None:
    """Remove the run's directory `path` and all in it, following no link (see the module
    docstring). A link at `path` itself is removed, not followed. Never raises: what cannot be
    removed is left and logged, so a tool cannot turn its cleanup into the worker's failure."""
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            os.unlink(path)
            return
        top = _open_folder(path, None)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("cannot remove the run directory %s: %s", path, exc)
        return
    try:
        _empty(top)
        os.rmdir(path)
    except OSError as exc:
        log.warning("cannot remove all of the run directory %s: %s", path, exc)
    finally:
        os.close(top)


def _empty(top: int) -> None:
    """Remove everything in the folder open as `top`; each pass takes one level of the tree."""
    while names := os.listdir(top):
        for name in names:
            _remove_entry(top, name)


def _remove_entry(top: int, name: str) -> None:
    """Remove `name` in `top`: anything but a folder loses its name; a folder is opened up, its
    files removed and its subfolders moved into `top` (a later pass takes them), then removed."""
    if not stat.S_ISDIR(os.stat(name, dir_fd=top, follow_symlinks=False).st_mode):
        os.unlink(name, dir_fd=top)
        return
    folder = _open_folder(name, top)
    try:
        for child in os.listdir(folder):
            if stat.S_ISDIR(os.stat(child, dir_fd=folder, follow_symlinks=False).st_mode):
                # Moving a folder to another parent rewrites its `..`: it must be writable.
                os.close(_open_folder(child, folder))
                os.rename(child, f".removed-{secrets.token_hex(8)}", src_dir_fd=folder, dst_dir_fd=top)
            else:
                os.unlink(child, dir_fd=folder)
    finally:
        os.close(folder)
    os.rmdir(name, dir_fd=top)


def _open_folder(name: str, parent: int | None) -> int:
    """The folder `name` (in `parent`, or a path) opened for listing, after setting its mode to
    0700. Refuses (NotADirectoryError) anything that is not a folder itself, a link to one included."""
    handle = os.open(name, _PATH_ONLY, dir_fd=parent)
    try:
        if not stat.S_ISDIR(os.fstat(handle).st_mode):
            raise NotADirectoryError(f"{name} is not a folder")
        # An O_PATH descriptor cannot be chmodded itself; its /proc name is that very folder.
        os.chmod(f"/proc/self/fd/{handle}", 0o700)
        return os.open(f"/proc/self/fd/{handle}", _LIST)
    finally:
        os.close(handle)
