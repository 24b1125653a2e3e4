"""Capture `sglite tui` from a real terminal (tmux) into docs/: running, paused with a
prompt arriving, the workload done, and the help screen, at 80x24 and 200x50.

    python docs/make_tui_captures.py [--model-path smollm2-135m] [--out docs]

Needs tmux and an installed sglite (the README's first command). Each capture is the
text of the terminal (tmux capture-pane), written to OUT/tui-WxH-STATE.txt.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

SIZES = ((80, 24), (200, 50))
SESSION = "sglite-captures"


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def screen() -> str:
    return tmux("capture-pane", "-t", SESSION, "-p")


def wait_for(text: str, timeout: float = 300.0) -> str:
    """Poll the terminal until ``text`` shows (the top line or the footer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = screen()
        if text in shown:
            return shown
        time.sleep(0.2)
    raise SystemExit(f"error: {text!r} did not show within {timeout:.0f} s; the screen:\n{screen()}")


def keys(*k: str) -> None:
    for key in k:
        tmux("send-keys", "-t", SESSION, key)
        time.sleep(0.15)


def start(cmd: str, width: int, height: int) -> None:
    subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
    for attempt in range(10):
        # Killing the last session stops the tmux server; a new-session sent while it is
        # still shutting down fails, so try again briefly.
        made = subprocess.run(["tmux", "new-session", "-d", "-s", SESSION, "-x", str(width),
                               "-y", str(height), f"{cmd}; sleep 600"], capture_output=True, text=True)
        if made.returncode == 0:
            break
        time.sleep(0.5)
    else:
        raise SystemExit(f"error: tmux new-session failed: {made.stderr.strip()}")
    wait_for("q quit")


def capture_size(sglite: str, model: str, width: int, height: int, out: Path) -> None:
    def save(state: str, text: str) -> None:
        path = out / f"tui-{width}x{height}-{state}.txt"
        path.write_text(text.rstrip("\n") + "\n")
        print(f"wrote {path}", file=sys.stderr)

    start(f"{sglite} tui --model-path {shlex.quote(model)}", width, height)
    time.sleep(3)  # the demo workload a few seconds in
    save("running", screen())
    save("done", wait_for("idle — workload done"))
    keys("?")
    save("help", wait_for("what the screen shows"))
    start(f"{sglite} tui --model-path {shlex.quote(model)} --paused", width, height)
    keys("n", "n", "n", "a")
    tmux("send-keys", "-t", SESSION, "-l", "Why is the sky blue?")
    keys("Enter")
    save("paused-arriving", wait_for("arriving: r"))
    subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="smollm2-135m")
    p.add_argument("--out", default=str(Path(__file__).parent))
    p.add_argument("--sglite", default="sglite", help="the sglite command (default: the one on PATH)")
    args = p.parse_args()
    for width, height in SIZES:
        capture_size(args.sglite, args.model_path, width, height, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
