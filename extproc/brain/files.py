"""Files and sockets the brain makes in directories: only in directories nobody else controls.

A directory another user owns, or may write, lets that user swap the brain's socket for one of theirs (and
receive every prompt Envoy sends) or read the admin token: refused, as ssh's StrictModes refuses a home or
.ssh another user may write."""

from __future__ import annotations

import os
import secrets
import stat

from ..config import ConfigError


def check_private_dir(directory: str, field: str) -> None:
    """ConfigError naming ``field`` unless ``directory`` is ours (or root's) and nobody else may write it, and no
    ancestor belongs to another user (who could rename it away and put theirs in its place).

    An ancestor writable by all is allowed: a container's emptyDir is 0777 with one user in it, and ``/tmp`` has
    the sticky bit; where other users share an ancestor without the sticky bit, choose another place."""
    real = os.path.realpath(directory)
    me = os.geteuid()
    d = real
    while True:
        st = os.stat(d)
        if st.st_uid not in (me, 0):
            raise ConfigError(f"{field}: {d} belongs to another user (uid {st.st_uid}), who could swap what the brain "
                              "puts there: use a directory of this user's own")
        if d == real and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ConfigError(f"{field}: {d} may be written by other users (mode {oct(st.st_mode & 0o7777)}), who "
                              "could swap what the brain puts there: chmod go-w it, or use a private directory")
        parent = os.path.dirname(d)
        if parent == d:
            return
        d = parent


def make_private_dir(directory: str, field: str, mode: int = 0o700) -> None:
    """``directory`` made with ``mode`` if it is missing, then checked as ``check_private_dir`` checks it."""
    if not os.path.isdir(directory):
        try:
            os.makedirs(directory, mode=mode)
        except OSError as e:
            raise ConfigError(f"{field}: cannot create {directory} ({e.strerror}): set {field} to a path this user "
                              "may write") from None
    check_private_dir(directory, field)


def write_private_file(path: str, text: str, field: str) -> None:
    """``text`` in ``path``, mode 0600 from its first byte: written to an unguessable new name (O_EXCL, O_NOFOLLOW:
    never through a link somebody planted) and renamed over ``path`` (a rename replaces a link, never follows it)."""
    directory = os.path.dirname(os.path.abspath(path))
    make_private_dir(directory, field)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def read_secret_file(path: str, field: str) -> bytes:
    """A secret's bytes (surrounding white space dropped), or a ConfigError naming ``field``: the file must exist, hold
    at least 16 bytes, and be neither readable nor writable by every user (a Kubernetes Secret mounted 0440 is fine)."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            secret = f.read(4096).strip()
    except OSError as e:
        raise ConfigError(f"{field}: cannot read {path} ({e.strerror})") from None
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
        raise ConfigError(f"{field}: {path} may be read or written by other users (mode {oct(st.st_mode & 0o777)}): "
                          "chmod 600 it")
    if len(secret) < 16:
        raise ConfigError(f"{field}: {path} holds {len(secret)} bytes; a secret needs at least 16 (openssl rand -hex "
                          f"32)")
    return secret


def secret_in(path: str, field: str) -> bytes:
    """The secret in ``path``, made (32 random bytes, hex, mode 0600) if the file does not exist yet."""
    if not os.path.lexists(path):
        write_private_file(path, secrets.token_hex(32) + "\n", field)
    return read_secret_file(path, field)


__all__ = ["check_private_dir", "make_private_dir", "read_secret_file", "secret_in", "write_private_file"]
