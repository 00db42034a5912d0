"""The CPython behaviours funshard relies on beyond the language still hold (and a broken
one says so)."""

import re
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import mesh_for

import funshard as fs
from funshard import _py_compat

_RANGE = re.escape(_py_compat.SUPPORTED_PYTHON)


@pytest.fixture(autouse=True)
def _fresh_check():
    # `check()` caches its verdict; every test here judges a (possibly faked) Python anew.
    _py_compat.check.cache_clear()
    yield
    _py_compat.check.cache_clear()


def test_assumptions_hold_on_this_python():
    _py_compat.check()  # raises naming the broken assumption otherwise


# Ids by position: the same on every xdist worker (a function's repr is not).
@pytest.mark.parametrize(
    "what,read,want",
    _py_compat._probes(),
    ids=[f"probe{i}" for i in range(len(_py_compat._probes()))],
)
def test_each_probe_reads_as_expected(what, read, want):
    assert read(_py_compat._Probe()) is want, what


def test_a_wrong_argument_decoding_names_itself_and_the_range(monkeypatch):
    # LOAD_ATTR's argument with its flag bit handled as on the other side of 3.12.
    monkeypatch.setattr(_py_compat, "_METHOD_BIT", not _py_compat._METHOD_BIT)
    with pytest.raises(
        RuntimeError,
        match=r"CPython .* no longer show `x\.seen` in the "
        r"reader's code .*`\.data` read.*Python" + _RANGE,
    ):
        _py_compat.check()


def test_a_call_taken_for_an_attribute_read_names_itself(monkeypatch):
    monkeypatch.setattr(_py_compat, "_attribute_name_at", lambda code, offset: "seen")
    with pytest.raises(RuntimeError, match=r"wrongly show getattr\(x, 'seen'\).*Python" + _RANGE):
        _py_compat.check()


def test_a_missing_opcode_names_itself(monkeypatch):
    monkeypatch.setattr(_py_compat, "_EXTENDED_ARG", None)
    with pytest.raises(RuntimeError, match="dis.opmap has no EXTENDED_ARG.*Python" + _RANGE):
        _py_compat.check()


@pytest.mark.skipif(
    sys.version_info[:2] != (3, 12),
    reason="only 3.12 moves f_lasti onto a specialised read's inline cache",
)
def test_a_specialised_read_needs_the_walk_back_over_its_cache(monkeypatch):
    monkeypatch.setattr(_py_compat, "_CACHE", -1)  # no code unit is a cache entry
    assert not _py_compat._hot_read(_py_compat._Probe())
    with pytest.raises(RuntimeError, match=r"no longer show `x\.seen`.*Python" + _RANGE):
        _py_compat.check()


def test_every_data_read_in_a_hot_loop_of_the_loss_is_refused():
    # The same `.data` instruction run many times in one trace: on 3.12 the interpreter
    # specialises it and f_lasti then points into its inline cache. Jitted: the loss is
    # traced the same way, and one compiled program costs ~3 s where the eager step
    # compiles each of its ~600 operations apart (~50 s).
    layers = 40
    state = fs.shard({"w": [jnp.ones((8, 2)) for _ in range(layers)]}, mesh_for("2"))

    def loss(s, x):
        refused = 0
        for leaf in s["w"]:
            try:
                _ = leaf.data
            except TypeError:
                refused += 1
        assert refused == layers, refused
        return jnp.mean(x @ fs.unshard(s)["w"][0])

    loss_value, _ = jax.jit(fs.value_and_grad(loss))(state, jnp.ones((4, 8)))
    assert loss_value == 8.0


def test_thread_position_tells_a_stuck_thread_from_a_moving_one():
    import threading
    import time

    stop, entered, done = threading.Event(), threading.Event(), [False]

    def stuck():
        entered.set()
        stop.wait()  # one call, in C: the frame does not move

    def moving():
        # A thread only yields the GIL at certain instructions, so a tight loop may look
        # still; one that waits in two different places does not.
        entered.set()
        while not done[0]:
            time.sleep(0.001)
            time.sleep(0.001)

    try:
        for target, moves in ((stuck, False), (moving, True)):
            entered.clear()
            done[0] = False
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            entered.wait(30)
            seen = set()
            for _ in range(40):
                seen.add(_py_compat.thread_position(thread.ident))
                time.sleep(0.005)
            assert None not in seen
            assert (len(seen) > 1) == moves, (target.__name__, seen)
            stop.set()
            done[0] = True
            thread.join(30)
            stop.clear()
        assert _py_compat.thread_position(thread.ident) is None
        assert _py_compat.thread_position(None) is None
    finally:
        stop.set()
        done[0] = True
