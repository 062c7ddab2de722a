# The Python side of run_code: an IPython InteractiveShell that runs one
# cell per request, so state persists between calls like a notebook.
#
# moat-core starts it with `python3 -c` inside the sandbox and speaks JSON
# lines: requests {"code": str, "limit": int, "max_results": int,
# "results_budget": int} on stdin; events on stdout:
#   {"type": "ready"}
#   {"type": "stream", "name": "stdout"|"stderr", "text": str}
#   {"type": "done", "execution_count": int, "result": {mime: value}|null,
#    "displays": [{mime: value}], "left_out": int, "cut": bool,
#    "error": {name, value, traceback}|null}
# Binary values (PNG, JPEG) are base64 strings. The displays and the
# value's rich types kept are at most max_results and results_budget bytes
# as written (left_out counts the rest), and the value's text and the
# error's texts at most limit bytes each, so that a cell's line fits the
# host's bound on one line; "cut" says a text was shortened. The host bounds them
# again: the cell's own code runs in this process and can send anything.
#
# File descriptors 0, 1 and 2 are taken over so that nothing the code does
# (print, os.write, subprocesses, input()) can mix with the protocol: the
# protocol keeps private duplicates, fd 0 becomes /dev/null, and fds 1 and 2
# become pipes whose contents are forwarded as stream events.

import base64
import codecs
import json
import os
import signal
import sys
import threading

PROTO_IN = os.fdopen(os.dup(0), "r", encoding="utf-8")
PROTO_OUT = os.fdopen(os.dup(1), "w", encoding="utf-8")
DIAG = os.fdopen(os.dup(2), "w", encoding="utf-8", buffering=1)
SEND_LOCK = threading.Lock()


def send(message):
    line = json.dumps(message, ensure_ascii=False)
    with SEND_LOCK:
        PROTO_OUT.write(line + "\n")
        PROTO_OUT.flush()


devnull = os.open(os.devnull, os.O_RDONLY)
os.dup2(devnull, 0)
os.close(devnull)

# Marks the end of one cell's output in a pipe: everything written before it
# belongs to that cell. Bytes no UTF-8 text contains, so print() cannot forge it.
MARK = b"\xff\xfe\xfdmoat-cell-end\xfd\xfe\xff"


class Pump(threading.Thread):
    """Forwards what is written to fd `fd` as stream events."""

    def __init__(self, name, fd):
        super().__init__(daemon=True)
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        self.fd = fd
        self.read = read
        self.stream = name
        self.drained = threading.Event()
        # Characters the running cell may still send; what it prints beyond
        # is read and dropped, and only counted (sent at the cell's end).
        self.budget = 0
        self.dropped = 0
        self.start()

    def run(self):
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = b""
        while True:
            data = os.read(self.read, 65536)
            if not data:
                return
            pending += data
            while True:
                at = pending.find(MARK)
                if at < 0:
                    break
                self.emit(decoder.decode(pending[:at], final=True))
                pending = pending[at + len(MARK):]
                if self.dropped:
                    send({"type": "stream", "name": self.stream, "text": "", "dropped": self.dropped})
                    self.dropped = 0
                self.drained.set()
            # Hold back a tail that may be the start of a mark.
            keep = 0
            for n in range(min(len(MARK) - 1, len(pending)), 0, -1):
                if MARK.startswith(pending[-n:]):
                    keep = n
                    break
            self.emit(decoder.decode(pending[: len(pending) - keep]))
            pending = pending[len(pending) - keep:]

    def emit(self, text):
        kept = text[: max(self.budget, 0)]
        self.budget -= len(kept)
        self.dropped += len(text) - len(kept)
        if kept:
            send({"type": "stream", "name": self.stream, "text": kept})

    def drain(self):
        """Waits until everything written to the fd so far was forwarded."""
        self.drained.clear()
        os.write(self.fd, MARK)
        self.drained.wait()


sys.stdout.flush()
sys.stderr.flush()
PUMPS = [Pump("stdout", 1), Pump("stderr", 2)]
sys.stdout = open(1, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)
sys.stderr = open(2, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)
sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr

# matplotlib's inline backend hooks itself into the running shell when it is
# loaded, shows figures on plt.show() and those left open after each cell.
os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")

from IPython.core.displayhook import DisplayHook  # noqa: E402
from IPython.core.displaypub import DisplayPublisher  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402


class Cell:
    result = None
    displays = []
    traceback = None


class Displays(DisplayPublisher):
    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
        Cell.displays.append(data)

    def clear_output(self, wait=False):
        Cell.displays.clear()


class Results(DisplayHook):
    def write_output_prompt(self):
        pass

    def write_format_data(self, format_dict, md_dict=None):
        Cell.result = format_dict

    def finish_displayhook(self):
        sys.stdout.flush()


class Shell(InteractiveShell):
    def _showtraceback(self, etype, evalue, stb):
        Cell.traceback = self.InteractiveTB.stb2text(stb)


shell = Shell.instance(displayhook_class=Results, display_pub_class=Displays, colors="NoColor")


def plain(data):
    """A MIME bundle as JSON: bytes as base64, everything else as is."""
    out = {}
    for mime, value in (data or {}).items():
        if isinstance(value, bytes):
            if mime.startswith("image/") and mime != "image/svg+xml":
                value = base64.b64encode(value).decode("ascii")
            else:
                value = value.decode("utf-8", "replace")
        out[mime] = value
    return out


def size(value):
    """Bytes `value` takes in a protocol line (as send() writes it)."""
    return len(json.dumps(value, ensure_ascii=False).encode())


def cut(text, most):
    """`text`, shortened until it takes at most `most` bytes in a line."""
    taken = size(text)
    while text and taken > most:
        text = text[: max(0, min(len(text) - 1, len(text) * most // taken))]
        taken = size(text)
    return text


def fit(bundles, most, budget):
    """The bundles that fit `most` and `budget` bytes, and how many did not."""
    kept, left_out = [], 0
    for bundle in bundles:
        taken = sum(size(v) for v in bundle.values())
        if len(kept) >= most or taken > budget:
            left_out += 1
            continue
        budget -= taken
        kept.append(bundle)
    return kept, left_out


def run(code, limit, most, budget):
    Cell.result, Cell.displays, Cell.traceback = None, [], None
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        outcome = shell.run_cell(code, store_history=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    for pump in PUMPS:
        pump.drain()
    error = None
    exc = outcome.error_in_exec or outcome.error_before_exec
    shortened = False
    if exc is not None:
        whole = {"name": type(exc).__name__, "value": str(exc), "traceback": Cell.traceback or ""}
        error = {"name": cut(whole["name"], 256), "value": cut(whole["value"], limit),
                 "traceback": cut(whole["traceback"], limit)}
        shortened = error != whole
    # The line stays within the host's bound on it (results, the value's
    # text and the error's two texts, each bounded in bytes as written).
    result = plain(Cell.result) if Cell.result else None
    text = None
    if result is not None and isinstance(result.get("text/plain"), str):
        whole = result.pop("text/plain")
        text = cut(whole, limit)
        shortened = shortened or text != whole
    bundles = [plain(d) for d in Cell.displays] + ([result] if result else [])
    displays, left_out = fit(bundles, most, budget)
    if result and displays and displays[-1] is result:
        displays.pop()
    else:
        result = None
    if text is not None:
        result = dict(result or {}, **{"text/plain": text})
    send(
        {
            "type": "done",
            "execution_count": shell.execution_count - 1,
            "result": result,
            "displays": displays,
            "left_out": left_out,
            "cut": shortened,
            "error": error,
        }
    )


def main():
    send({"type": "ready"})
    while True:
        try:
            line = PROTO_IN.readline()
            if not line:
                return
            request = json.loads(line)
            for pump in PUMPS:
                pump.budget = request["limit"]
            run(request["code"], request["limit"], request["max_results"], request["results_budget"])
        except KeyboardInterrupt:
            continue
        except Exception as e:  # the runner's own failure, not the user's
            DIAG.write(f"moat runner: {type(e).__name__}: {e}\n")
            return


# SIGINT interrupts the running cell (IPython turns it into a
# KeyboardInterrupt error); between cells it is ignored.
signal.signal(signal.SIGINT, signal.SIG_IGN)
main()
