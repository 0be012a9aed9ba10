"""Output files that honour the umask, however they were written.

A file written under a temporary name and renamed into place must end up with the mode any new
file gets (0644 under umask 022), not the temporary file's: safetensors writes every file 0600
(a temporary file's mode), and `tempfile` creates 0600 files and 0700 folders.

    replace_file(tmp, path)      # chmod tmp to the umask's mode, then os.replace it onto path
    write_text_atomic(path, s)   # the same for a text written here
    honour_umask(folder)         # before renaming a finished folder into place
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """This process's umask, read without changing it (os.umask can only be read by setting it,
    which would race with threads creating files); os.umask's round trip where /proc has no field."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new regular file gets here (0o644 under umask 022)."""
    return 0o666 & ~current_umask()


def folder_mode() -> int:
    """The mode a new folder gets here (0o755 under umask 022)."""
    return 0o777 & ~current_umask()


def replace_file(tmp: str | Path, path: str | Path) -> None:
    """Rename the finished `tmp` onto `path` (atomic), with the umask's mode."""
    os.chmod(tmp, file_mode())
    os.replace(tmp, path)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through `<path>.tmp`: a reader sees the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    replace_file(tmp, path)


def honour_umask(folder: str | Path) -> None:
    """Give every file under `folder` (and the folders, `folder` itself included) the umask's mode;
    executables keep their execute bits where the umask allows them. Symlinks are left alone."""
    files, folders = file_mode(), folder_mode()
    root = Path(folder)
    os.chmod(root, folders)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, folders)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                executable = os.stat(path).st_mode & 0o111
                os.chmod(path, folders if executable else files)
