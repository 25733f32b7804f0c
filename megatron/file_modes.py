"""Output files get the permissions the user's umask gives (0644 under umask 022), whoever wrote them.

Some writers create their file as a private temporary and rename it into place, so it keeps mode 0600
whatever the umask: safetensors' save_file does (a `.tmpXXXX` file opened 0600, then renamed), as does
anything built on tempfile.mkstemp. Files others on the machine cannot read break shared checkpoints and
model folders; call apply_umask on such outputs before they are published.
"""
import os
import stat


def current_umask():
    """The process umask, read from /proc (Linux) without changing it; else set and restored at once."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode():
    """The mode open() gives a new regular file: 0o666 less the umask (0o644 under umask 022)."""
    return 0o666 & ~current_umask()


def apply_umask(path):
    """Sets a regular file, or every regular file under a folder, to default_file_mode(); returns path.
    Symlinks are left alone."""
    mode = default_file_mode()
    paths = [path]
    if os.path.isdir(path) and not os.path.islink(path):
        paths = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    for file in paths:
        info = os.lstat(file)
        if stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) != mode:
            os.chmod(file, mode)
    return path
