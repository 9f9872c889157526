"""HTTP to an admin endpoint on TCP or on a Unix socket (Envoy's admin lives on one: ``envoy.admin_path``).

A Unix socket is named as ``http+unix://<the socket's path, %-quoted>/the/path``, so that a base URL plus a path
is a URL either way (``admin + "/stats?format=json"``)."""

from __future__ import annotations

import http.client
import socket
import urllib.error
import urllib.parse
import urllib.request

UNIX_SCHEME = "http+unix://"


def unix_url(path: str) -> str:
    return UNIX_SCHEME + urllib.parse.quote(str(path), safe="")


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._unix_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._unix_path)
        except OSError:
            s.close()
            raise
        self.sock = s


def request(url: str, method: str = "GET", timeout: float = 2.0, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> bytes:
    """The response body; urllib's HTTPError (an OSError) for a status of 400 or more, as for a TCP URL."""
    if not url.startswith(UNIX_SCHEME):
        req = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()
    sock, _, path = url[len(UNIX_SCHEME):].partition("/")
    conn = _UnixConnection(urllib.parse.unquote(sock), timeout)
    try:
        conn.request(method, "/" + path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read()
        if r.status >= 400:
            raise urllib.error.HTTPError(url, r.status, r.reason, r.headers, None)
        return data
    finally:
        conn.close()


def get(url: str, timeout: float = 2.0) -> bytes:
    return request(url, timeout=timeout)
