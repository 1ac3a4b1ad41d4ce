"""A pre-imported harness parent: fork one fresh child per job, so no job pays torch's import.

    python -m gpu_worker.zygote CONTROL_FD

The zygote imports torch and the harness modules once, never touches CUDA, never runs candidate
code, and never starts threads of its own. Per job it receives three descriptors over the control
socket (SCM_RIGHTS: the job pipe for stdin, the result pipe, the log file), forks, and answers
`pid N`; the child starts a new session, closes the control socket, and runs harness.main exactly
as `python -m gpu_worker.harness` would. When a child ends the zygote reaps it and reports
`exit N STATUS` (a negative status is the signal). It exits when the control socket closes.
The runner side is ZygoteClient (spawn.py uses it; compute-sanitizer runs still exec).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import sys
import traceback

from containment import jail

PR_SET_PDEATHSIG = 1


def _child(sock: socket.socket, wake: tuple[int, int], fds: list[int], zygote: int, spec: str) -> None:
    stdin_r, result_w, log_w = fds
    try:
        os.setsid()
        _die_with_parent(zygote)
        sock.close()  # the control socket never reaches candidate code
        for fd in wake:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.dup2(stdin_r, 0)
        os.dup2(log_w, 1)
        os.dup2(log_w, 2)
        os.close(stdin_r)
        os.close(log_w)
        _contain(spec)
        from gpu_worker import harness

        harness.main([str(result_w)])
    except BaseException:  # noqa: BLE001 - report, never return into the zygote's loop
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(70)
    os._exit(71)


def _die_with_parent(zygote: int) -> None:
    """SIGKILL this child when the zygote dies (the zygote has one thread, so that is the event)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != zygote:  # it died before prctl took effect
        os._exit(72)


def _contain(spec: str) -> None:
    """Enter the job's jail (containment.jail) before anything of the job is read; this process becomes
    the jail's supervisor and only the contained process returns. No jail, no job: unless the user
    allowed it (KOPT_ALLOW_UNSANDBOXED=1, carried in the empty spec), the child exits with
    jail.SETUP_FAILED and the reason on its stderr."""
    if not spec:
        print("kopt-jail: sandbox off (KOPT_SANDBOX=off, KOPT_ALLOW_UNSANDBOXED=1)", file=sys.stderr)
        return
    try:
        jail.enter(jail.JailSpec.from_json(spec))
    except jail.JailError as exc:
        print(f"kopt-jail: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(jail.SETUP_FAILED)


def _recv_job(sock: socket.socket) -> tuple[bytes, list[int], str]:
    """One job message: b"J", a 4-byte length, the jail spec (JSON), with three descriptors."""
    msg, fds, _, _ = socket.recv_fds(sock, 5, 3)
    if len(msg) < 5 or msg[:1] != b"J":
        return msg, fds, ""
    size = int.from_bytes(msg[1:5], "big")
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            break
        body += chunk
    return msg[:1], fds, body.decode()


def _status(raw: int) -> int:
    return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


def serve(control_fd: int) -> None:
    sock = socket.socket(fileno=control_fd)
    # Warm every import a job needs (torch first); none of them may start CUDA.
    import torch  # noqa: F401

    from gpu_worker import context, correctness, harness, profiling  # noqa: F401

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sock.sendall(b"ready\n")
    children: set[int] = set()
    me = os.getpid()
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in readable:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            for pid in list(children):
                done, raw = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    sock.sendall(f"exit {pid} {_status(raw)}\n".encode())
        if sock in readable:
            try:
                msg, fds, spec = _recv_job(sock)
            except OSError:
                msg, fds, spec = b"", [], ""
            if not msg:
                for pid in children:  # the runner is gone: so are its jobs
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                return
            if len(fds) != 3:
                for fd in fds:
                    os.close(fd)
                sock.sendall(b"pid -1\n")
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(sock, (wake_r, wake_w), fds, me, spec)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            sock.sendall(f"pid {pid}\n".encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]))
