"""Keep taking and releasing ephemeral ports on 127.0.0.1, as a busy machine does.

Used to check the multi-process tests for port races (issue 31): run it in the background while
the gloo tests run. Each round binds ``--hold`` sockets to port 0 (the OS assigns ephemeral
ports, the ones a test that picks a "free" port and binds it later would be given), keeps them
open ``--seconds-held`` and closes them: by default 5,000 held at once, about a sixth of
Linux's default range (32768-60999), so a port chosen and bound a few seconds later is taken in
between about once in six. It stops by itself after ``--minutes``.

    python .ci/port_grabber.py --minutes 120 &
"""

from __future__ import annotations

import argparse
import logging
import socket
import time

logger = logging.getLogger("port_grabber")


def grab_round(hold: int, seconds_held: float) -> int:
    """Bind ``hold`` sockets to port 0 on 127.0.0.1 and listen, wait, close them; how many."""
    socks = []
    try:
        for _ in range(hold):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(1)
            socks.append(s)
        time.sleep(seconds_held)
    finally:
        for s in socks:
            s.close()
    return len(socks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--hold", type=int, default=5000, help="ports held at once")
    parser.add_argument("--seconds-held", type=float, default=0.2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    end, rounds, ports = time.monotonic() + 60 * args.minutes, 0, 0
    while time.monotonic() < end:
        ports += grab_round(args.hold, args.seconds_held)
        rounds += 1
    logger.info("%d rounds, %d ports taken and released", rounds, ports)


if __name__ == "__main__":
    main()
