"""The warm job's channel under the stop button: a SIGINT never splits a message, and an
interrupted poll loses none it read (the ranks' end: tests/launch/test_debug.py)."""

import os
import signal
import threading
import time
from multiprocessing.connection import Client

import pytest

from nbgpu._children import sigint_held
from nbgpu.launch.relay import CellServer


def test_a_held_sigint_lands_once_the_block_is_done():
    done = []
    with pytest.raises(KeyboardInterrupt):  # noqa: PT012  (where it lands is the point)
        with sigint_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # Python would have run the handler by now
            done.append("the block")
        done.append("after it")
    assert done == ["the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nothing_held_nothing_raised_and_other_threads_hold_nothing():
    with sigint_held():
        pass
    seen = []
    worker = threading.Thread(target=lambda: seen.append(sigint_held().__enter__()))
    worker.start()
    worker.join()
    assert seen == [None]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_interrupted_poll_hands_its_messages_to_the_next(tmp_path):
    server = CellServer(tmp_path, "token")
    ranks = []

    def rank():  # a rank's end: the token both ways, then its hello
        conn = Client(str(server.path), family="AF_UNIX", authkey=b"token")
        conn.send({"op": "hello", "rank": 0, "pid": os.getpid()})
        ranks.append(conn)

    joining = threading.Thread(target=rank)
    joining.start()
    deadline = time.monotonic() + 10
    while 0 not in server.ranks and time.monotonic() < deadline:
        server.poll(0.05)
    joining.join()
    try:
        ranks[0].send({"op": "done", "cell": 1})
        ranks[0].send({"op": "said", "text": "x"})
        take = server._take

        def read_then_interrupted(*args):  # the stop button, while the answers are read
            take(*args)
            os.kill(os.getpid(), signal.SIGINT)

        server._take = read_then_interrupted
        time.sleep(0.1)
        with pytest.raises(KeyboardInterrupt):
            server.poll(1.0)
        server._take = take
        began = time.monotonic()
        assert server.poll(5.0) == [
            (0, {"op": "done", "cell": 1}),
            (0, {"op": "said", "text": "x"}),
        ]
        assert time.monotonic() - began < 1.0  # kept messages: no waiting for more
    finally:
        server.close()
        for conn in ranks:
            conn.close()
