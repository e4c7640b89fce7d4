# The executor: runs on the host under the account's own python3 (3.6 or newer), sent over the
# SSH channel by the pool (sshpool/agent/client.py) and never written to disk. Standard library
# only, and Python 3.6 syntax: login hosts run old interpreters.
#
# It speaks frames on its stdin and stdout (the channel) and nothing else: it listens on no
# socket and writes no file. A frame is a 9-byte header (payload length, type, request id; big
# endian) and its payload. The pool starts commands (START, a JSON object: argv or a shell line,
# env, cwd, stdin, timeout, output cap), feeds their stdin (STDIN, EOF), takes their output
# (OUT, ERR) and acknowledges it (ACK), and may kill them (KILL); the executor reports the start
# (STARTED, with the process group) and the end (EXIT: status or signal name, bytes counted).
#
# Why it is shaped like this:
# - each command runs in a session of its own (setsid, as sshd does), so one killpg reaches
#   what it started; a kill, a timeout and the channel closing all TERM the group, then KILL
#   it after a grace period;
# - output is read only while the pool has acknowledged enough of it (a window per command) and
#   while the executor's own outgoing buffer is small: memory stays bounded on both sides
#   however much a command prints;
# - a malformed or oversized frame is answered with a PROTO frame and skipped; the executor
#   never trusts a length it has not bounded and never dies of a bad request;
# - when its channel closes (EOF or error on stdin, TERM or HUP), it kills every group it
#   started and exits;
# - it runs isolated (`python3 -I -S`: no site, no user site, no PYTHON* variables, not the
#   home directory on sys.path), so no file the account's files hold runs inside it, and it
#   makes itself undumpable first thing, so the account's commands cannot open its stdin and
#   stdout through /proc/<pid>/fd (nor ptrace it); their own programs are dumpable again
#   after execve, as the kernel resets the flag there.
import errno
import json
import os
import pwd
import selectors
import signal
import struct
import subprocess
import sys
import time

VERSION = 1
HEADER = struct.Struct(">IBI")
# Client -> executor.
START, STDIN, EOF, KILL, ACK = 1, 2, 3, 4, 5
# Executor -> client.
HELLO, STARTED, OUT, ERR, EXIT, REFUSED, PROTO = 16, 17, 18, 19, 20, 21, 22

MAX_FRAME = 1 << 20  # the largest payload accepted; longer frames are skipped
WINDOW = 256 << 10  # output bytes per command sent and not yet acknowledged
CHUNK = 64 << 10  # one read from a command's pipe
OUTBUF_HIGH = 1 << 20  # stop reading commands while this much waits for the channel
STDIN_MAX = 64 << 20  # stdin buffered for one command that does not read it
GRACE = 1.0  # seconds between TERM and KILL
LINGER = 0.5  # after KILL, seconds until pipes held open by a detached process are closed
PR_SET_DUMPABLE = 4  # linux/prctl.h


class Job(object):
    def __init__(self, rid, proc, cap, deadline):
        self.rid = rid
        self.proc = proc
        self.pgid = proc.pid
        self.cap = cap
        self.deadline = deadline
        self.pipes = {}  # fd -> frame type (OUT or ERR)
        if proc.stdout is not None:
            self.pipes[proc.stdout.fileno()] = OUT
            self.pipes[proc.stderr.fileno()] = ERR
        self.counts = {OUT: 0, ERR: 0}
        self.unacked = 0
        self.stdin_fd = proc.stdin.fileno() if proc.stdin is not None else None
        self.stdin_buf = bytearray()
        self.stdin_eof = False
        self.status = None  # os.waitpid status once reaped
        self.kill_at = None  # when TERM turns into KILL
        self.close_at = None  # when pipes still open after a KILL are closed
        self.timed_out = False


class Executor(object):
    def __init__(self, max_jobs, exposed=None):
        self.max_jobs = max_jobs
        self.exposed = exposed
        self.sel = selectors.DefaultSelector()
        self.jobs = {}
        self.by_fd = {}
        self.inbuf = bytearray()
        self.skip = 0
        self.outbuf = bytearray()
        self.writing = False
        self.closing = False
        self.shell = login_shell()
        for fd in (0, 1):
            os.set_blocking(fd, False)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *a: None)
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGHUP, self.on_signal)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        self.sel.register(0, selectors.EVENT_READ, "in")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")

    def on_signal(self, signum, frame):
        self.closing = True

    # ---- frames out

    def send(self, kind, rid, payload):
        self.outbuf += HEADER.pack(len(payload), kind, rid)
        self.outbuf += payload
        if not self.writing:
            self.flush()

    def send_json(self, kind, rid, obj):
        self.send(kind, rid, json.dumps(obj).encode())

    def flush(self):
        try:
            while self.outbuf:
                n = os.write(1, self.outbuf)
                del self.outbuf[:n]
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                self.outbuf = bytearray()
                self.closing = True  # the channel is gone
                return
        want = bool(self.outbuf)
        if want != self.writing:
            self.writing = want
            if want:
                self.sel.register(1, selectors.EVENT_WRITE, "out")
            else:
                self.sel.unregister(1)

    # ---- frames in

    def read_input(self):
        try:
            data = os.read(0, CHUNK)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return
            data = b""
        if not data:
            self.closing = True
            return
        self.inbuf += data
        while True:
            if self.skip:
                n = min(self.skip, len(self.inbuf))
                del self.inbuf[:n]
                self.skip -= n
                if self.skip:
                    return
            if len(self.inbuf) < HEADER.size:
                return
            length, kind, rid = HEADER.unpack_from(self.inbuf)
            if length > MAX_FRAME:
                del self.inbuf[: HEADER.size]
                self.skip = length
                self.proto(rid, "frame of %d bytes is over the %d-byte limit" % (length, MAX_FRAME))
                continue
            if len(self.inbuf) < HEADER.size + length:
                return
            payload = bytes(self.inbuf[HEADER.size : HEADER.size + length])
            del self.inbuf[: HEADER.size + length]
            try:
                self.handle(kind, rid, payload)
            except Exception as exc:  # a bad request never ends the executor
                self.proto(rid, "request dropped: %s" % (exc,))

    def proto(self, rid, message):
        self.send_json(PROTO, rid, {"error": message})

    def handle(self, kind, rid, payload):
        job = self.jobs.get(rid)
        if kind == START:
            self.start(rid, payload)
        elif kind == ACK:
            if job is not None:
                job.unacked = max(0, job.unacked - struct.unpack(">I", payload)[0])
                self.watch(job)
        elif kind == STDIN:
            if job is not None and job.stdin_fd is not None and not job.stdin_eof:
                if len(job.stdin_buf) + len(payload) > STDIN_MAX:
                    raise ValueError("stdin over %d bytes waits unread" % STDIN_MAX)
                job.stdin_buf += payload
                self.watch_stdin(job)
        elif kind == EOF:
            if job is not None and job.stdin_fd is not None:
                job.stdin_eof = True
                self.watch_stdin(job)
        elif kind == KILL:
            if job is not None:
                self.kill(job)
        else:
            raise ValueError("unknown frame type %d" % kind)

    # ---- commands

    def start(self, rid, payload):
        if rid in self.jobs:
            self.send_json(REFUSED, rid, {"error": "request id %d is running" % rid})
            return
        if len(self.jobs) >= self.max_jobs or self.closing:
            self.send_json(REFUSED, rid, {"error": "busy", "busy": True})
            return
        try:
            req = json.loads(payload.decode("utf-8"))
            if "argv" in req:
                argv = [str(a) for a in req["argv"]]
                if not argv:
                    raise ValueError("empty argv")
            else:
                argv = [self.shell, "-c", str(req["line"])]
            env = None
            if req.get("env"):
                env = dict(os.environ)
                env.update((str(k), str(v)) for k, v in req["env"].items())
            cwd = req.get("cwd") or None
            timeout = req.get("timeout")
            cap = req.get("cap")
            cap = None if cap is None else int(cap)
            with_stdin = bool(req.get("stdin"))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            self.send_json(REFUSED, rid, {"error": "malformed start: %s" % (exc,)})
            return
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            # As a shell says it: not found 127, not executable 126, anything else 1.
            code = 127 if exc.errno == errno.ENOENT else 126 if exc.errno == errno.EACCES else 1
            what = cwd if (cwd and exc.filename == cwd) else argv[0]
            message = ("%s: %s\n" % (what, exc.strerror)).encode()
            self.send_json(STARTED, rid, {"pgid": None})
            self.send(ERR, rid, message)
            self.send_json(
                EXIT,
                rid,
                {"status": code, "signal": None, "stdout_bytes": 0, "stderr_bytes": len(message)},
            )
            return
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        job = Job(rid, proc, cap, deadline)
        self.jobs[rid] = job
        for fd in list(job.pipes) + ([job.stdin_fd] if job.stdin_fd is not None else []):
            os.set_blocking(fd, False)
            self.by_fd[fd] = job
        self.send_json(STARTED, rid, {"pgid": job.pgid})
        self.watch(job)

    def watch(self, job):
        """Read a command's pipes only while its window and the outgoing buffer have room."""
        room = job.unacked < WINDOW and len(self.outbuf) < OUTBUF_HIGH
        for fd in job.pipes:
            key = self.sel.get_map().get(fd)
            if room and key is None:
                self.sel.register(fd, selectors.EVENT_READ, "pipe")
            elif not room and key is not None:
                self.sel.unregister(fd)

    def watch_stdin(self, job):
        fd = job.stdin_fd
        if fd is None:
            return
        if not job.stdin_buf and job.stdin_eof:
            self.close_stdin(job)
            return
        registered = fd in self.sel.get_map()
        if job.stdin_buf and not registered:
            self.sel.register(fd, selectors.EVENT_WRITE, "stdin")
        elif not job.stdin_buf and registered:
            self.sel.unregister(fd)

    def close_stdin(self, job):
        fd = job.stdin_fd
        if fd is None:
            return
        if fd in self.sel.get_map():
            self.sel.unregister(fd)
        self.by_fd.pop(fd, None)
        job.proc.stdin.close()
        job.stdin_fd = None
        job.stdin_buf = bytearray()

    def write_stdin(self, job):
        try:
            n = os.write(job.stdin_fd, job.stdin_buf)
            del job.stdin_buf[:n]
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return
            self.close_stdin(job)  # the command stopped reading: drop the rest, as sshd does
            return
        self.watch_stdin(job)

    def read_pipe(self, fd):
        job = self.by_fd[fd]
        kind = job.pipes[fd]
        # Within the window: the pool never holds more than WINDOW unacknowledged bytes.
        size = (
            CHUNK
            if job.cap is not None and job.counts[kind] >= job.cap
            else min(CHUNK, WINDOW - job.unacked)
        )
        try:
            data = os.read(fd, max(1, size))
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return
            data = b""
        if not data:
            self.close_pipe(job, fd)
            return
        sent = job.counts[kind]
        job.counts[kind] += len(data)
        if job.cap is not None:
            data = data[: max(0, job.cap - sent)]  # past the cap: counted, not sent
        if data:
            job.unacked += len(data)
            self.send(kind, job.rid, data)
        self.watch(job)

    def close_pipe(self, job, fd):
        if fd in self.sel.get_map():
            self.sel.unregister(fd)
        del job.pipes[fd]
        self.by_fd.pop(fd, None)
        for stream in (job.proc.stdout, job.proc.stderr):
            if stream is not None and not stream.closed and stream.fileno() == fd:
                stream.close()
        self.maybe_done(job)

    def kill(self, job, timed_out=False):
        job.timed_out = job.timed_out or timed_out
        if job.kill_at is None:
            killpg(job.pgid, signal.SIGTERM)
            job.kill_at = time.monotonic() + GRACE
            job.close_at = job.kill_at + LINGER

    def reap(self):
        for job in list(self.jobs.values()):
            if job.status is None:
                try:
                    pid, status = os.waitpid(job.proc.pid, os.WNOHANG)
                except OSError:
                    pid, status = job.proc.pid, 0
                if pid:
                    job.status = status
                    job.proc.returncode = 0  # reaped here: Popen must not wait for it
                    self.maybe_done(job)

    def maybe_done(self, job):
        if job.status is None or job.pipes:
            return
        self.close_stdin(job)
        del self.jobs[job.rid]
        status = job.status
        end = {
            "stdout_bytes": job.counts[OUT],
            "stderr_bytes": job.counts[ERR],
            "timed_out": job.timed_out,
            "status": None,
            "signal": None,
        }
        if os.WIFSIGNALED(status):
            end["status"] = -1
            end["signal"] = signal_name(os.WTERMSIG(status))
        else:
            end["status"] = os.WEXITSTATUS(status)
        self.send_json(EXIT, job.rid, end)

    def timers(self):
        """Timeouts and kill escalation; returns the seconds until the next one."""
        now = time.monotonic()
        nearest = None
        for job in list(self.jobs.values()):
            if job.deadline is not None and job.kill_at is None and now >= job.deadline:
                self.kill(job, timed_out=True)
            if job.kill_at is not None and now >= job.kill_at:
                killpg(job.pgid, signal.SIGKILL)
                job.kill_at = float("inf")
            if job.close_at is not None and now >= job.close_at and job.status is not None:
                # A process that left the group (setsid, double fork) holds the pipes: the
                # command is over for us; it gets EPIPE or SIGPIPE at its next write.
                for fd in list(job.pipes):
                    self.close_pipe(job, fd)
                continue
            for t in (job.deadline if job.kill_at is None else None, job.kill_at, job.close_at):
                if t is not None and now < t != float("inf"):
                    nearest = t if nearest is None else min(nearest, t)
        return None if nearest is None else max(0.0, nearest - now)

    def run(self):
        self.send_json(
            HELLO,
            0,
            {
                "version": VERSION,
                "pid": os.getpid(),
                "max_jobs": self.max_jobs,
                "window": WINDOW,
                "max_frame": MAX_FRAME,
                "python": sys.version.split()[0],
                "exposed": self.exposed,
            },
        )
        while not self.closing:
            wait = self.timers()
            for key, _ in self.sel.select(wait):
                what = key.data
                if what == "in":
                    self.read_input()
                elif what == "out":
                    self.flush()
                elif what == "wake":
                    drain(self.wake_r)
                    self.reap()
                elif what == "pipe":
                    if key.fd in self.by_fd:
                        self.read_pipe(key.fd)
                elif what == "stdin":
                    job = self.by_fd.get(key.fd)
                    if job is not None:
                        self.write_stdin(job)
                if self.closing:
                    break
            self.reap()
            if len(self.outbuf) < OUTBUF_HIGH:
                for job in list(self.jobs.values()):
                    self.watch(job)
        self.shutdown()

    def shutdown(self):
        """The channel closed: TERM every group, KILL what is left after the grace period."""
        for job in self.jobs.values():
            killpg(job.pgid, signal.SIGTERM)
        end = time.monotonic() + GRACE
        while self.jobs and time.monotonic() < end:
            self.reap_quietly()
            time.sleep(0.02)
        for job in self.jobs.values():
            killpg(job.pgid, signal.SIGKILL)

    def reap_quietly(self):
        for rid, job in list(self.jobs.items()):
            try:
                pid, _ = os.waitpid(job.proc.pid, os.WNOHANG)
            except OSError:
                pid = job.proc.pid
            if pid and not group_alive(job.pgid):
                job.proc.returncode = 0
                del self.jobs[rid]


def killpg(pgid, sig):
    if pgid is None or pgid <= 1:  # never `kill -1`
        return
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except OSError:
        return False
    return True


def signal_name(num):
    try:
        return signal.Signals(num).name[3:]
    except ValueError:
        return str(num)


def drain(fd):
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass


def undumpable():
    """Make this process undumpable (Linux: /proc/<pid>/fd then belongs to root and ptrace is
    refused to the account); None when done, else why not (another kernel, no ctypes)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            return "prctl: %s" % os.strerror(ctypes.get_errno())
    except (ImportError, OSError, AttributeError) as exc:
        return "prctl unavailable: %s" % (exc,)
    return None


def login_shell():
    try:
        shell = pwd.getpwuid(os.getuid()).pw_shell
    except KeyError:
        shell = ""
    return shell or "/bin/sh"


def main():
    exposed = undumpable()
    max_jobs = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    Executor(max_jobs, exposed).run()


if __name__ == "__main__":
    main()
