"""Child processes and polling with a deadline: what the stack and the real-engine helper share."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from extproc.tools.stack import admin_http


class StackError(RuntimeError):
    pass


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A loopback port the OS picks, for a process that cannot be told port 0 (or prints no bound port). Another
    process could take it before the child binds; the child's start then fails with its log."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """A process's resident memory, MiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) / 1024 for x in f if x.startswith("VmRSS:"))


def wait_for(cond: Callable[[], Any], timeout: float, what: str, proc: "Proc | None" = None,
             every: float = 0.05) -> Any:
    """Poll ``cond`` until it returns something truthy; fail clearly past ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            v = cond()
        except Exception:
            v = None
        if v:
            return v
        if proc is not None and proc.popen.poll() is not None:
            raise StackError(f"{proc.name} exited with {proc.popen.returncode} while waiting for {what}; log: "
                             f"{proc.log_tail()}")
        if time.monotonic() > deadline:
            raise StackError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def http_get(url: str, timeout: float = 2.0) -> bytes:
    """GET a TCP URL, or an ``http+unix://`` one (Envoy's admin socket)."""
    return admin_http.get(url, timeout)


# Linux's parent-death signal, set by util-linux's setpriv before it execs the command: a process this one started
# gets SIGTERM when this one dies, however it dies (warmroute up killed with -9, a test runner killed), instead of
# running on orphaned. Only for processes started from the main thread: the signal follows the thread that started
# the process, and a worker thread that ends would take its processes with it.
_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None


class Proc:
    def __init__(self, name: str, argv: list[str], workdir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = argv
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (the process's log, closed when it is stopped)
        if _SETPRIV and threading.current_thread() is threading.main_thread():
            argv = [_SETPRIV, "--pdeathsig", "TERM", "--", *argv]
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, env=env)

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        self.terminate()
        self.reap(time.monotonic() + timeout)

    def terminate(self) -> None:
        """SIGTERM to its process group (stop several at once: terminate each, then reap each)."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def reap(self, deadline: float, grace: float = 5.0) -> None:
        """Wait for it until ``deadline``, then SIGKILL it."""
        try:
            self.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self._log.close()

    def kill(self) -> None:
        """SIGKILL: a replica or brain that dies without a goodbye."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)
